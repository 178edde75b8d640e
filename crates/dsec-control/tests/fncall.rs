//! Function calls over a `FakeNode` (its calls run on a throw-away copy of the
//! sandbox's files): a member is lent for one call and given back, replaced after
//! `max_calls` or an anomaly, files go in and come back, nothing of a call reaches the
//! next, and bad calls are refused.

use std::time::{Duration, Instant};

use dsec_control::SandboxApi;
use dsec_wire::v1::{
    Command, CreateSandboxRequest, FnCallPolicy, FnCallRequest, FnCallStatus, Pool, PoolSpec,
};
use dsec_wire::ErrorCode;

mod common;
use common::{op, Fixture};

fn request(pool: &str, cmd: &str) -> FnCallRequest {
    let mut r: FnCallRequest =
        serde_json::from_value(serde_json::json!({"pool": pool})).expect("defaults");
    r.command = Some(Command::Shell(cmd.into()));
    r
}

async fn call_pool(f: &Fixture, name: &str, size: u32, max_calls: u32) -> Pool {
    let spec = PoolSpec {
        name: name.into(),
        template: CreateSandboxRequest::default(),
        min: size,
        max: size,
        autoscale: Default::default(),
        fncall: Some(FnCallPolicy { max_calls }),
    };
    f.plane.create_pool(op(), spec).await.expect("create pool");
    wait_pool(f, name, |p| p.ready == size).await
}

async fn wait_pool(f: &Fixture, name: &str, cond: impl Fn(&Pool) -> bool) -> Pool {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let p = f.plane.get_pool(op(), name).await.expect("get pool");
        if cond(&p) {
            return p;
        }
        assert!(Instant::now() < deadline, "pool never got there: {p:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_serves_max_calls_then_is_replaced_and_calls_leave_nothing() {
    let f = Fixture::new().await;
    call_pool(&f, "judge", 1, 3).await;
    let mut ids = Vec::new();
    for i in 0..7 {
        // Each call leaves a file behind in its view; none sees the last one's.
        let r = f
            .plane
            .fncall(op(), request("judge", "cat /left-behind"))
            .await
            .expect("call");
        assert_eq!(
            r.exit_code,
            Some(1),
            "call {i} saw a file a call left: {r:?}"
        );
        let w = f
            .plane
            .fncall(op(), request("judge", &format!("echo {i} > /left-behind")))
            .await
            .expect("call");
        assert_eq!(w.status, FnCallStatus::Finished, "{w:?}");
        ids.push(r.sandbox_id.clone());
        ids.push(w.sandbox_id);
        // Lent and given back: nothing stays busy between calls.
        let p = wait_pool(&f, "judge", |p| p.busy == 0).await;
        assert!(p.busy == 0, "{p:?}");
    }
    // 14 calls at 3 per sandbox: 5 sandboxes, each serving 3 in a row (the last 2).
    let mut runs: Vec<(String, usize)> = Vec::new();
    for id in ids {
        match runs.last_mut() {
            Some((last, n)) if *last == id => *n += 1,
            _ => runs.push((id, 1)),
        }
    }
    let counts: Vec<usize> = runs.iter().map(|(_, n)| *n).collect();
    assert_eq!(counts, vec![3, 3, 3, 3, 2], "{runs:?}");
    let p = f.plane.get_pool(op(), "judge").await.expect("pool");
    assert_eq!(p.calls, 14, "{p:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anomaly_replaces_the_sandbox_and_files_go_in_and_out() {
    let f = Fixture::new().await;
    call_pool(&f, "j", 1, 1000).await;
    let first = f
        .plane
        .fncall(op(), request("j", "true"))
        .await
        .expect("call");
    let bad = f
        .plane
        .fncall(op(), request("j", "fake-anomaly"))
        .await
        .expect("call with an anomaly");
    assert_eq!(bad.sandbox_id, first.sandbox_id);
    let next = f
        .plane
        .fncall(op(), request("j", "true"))
        .await
        .expect("call after");
    assert_ne!(
        next.sandbox_id, first.sandbox_id,
        "the sandbox that misbehaved served again"
    );
    // It is deleted behind the call's answer.
    let deadline = Instant::now() + Duration::from_secs(10);
    while f.plane.get_sandbox(op(), &first.sandbox_id).await.is_ok() {
        assert!(
            Instant::now() < deadline,
            "the replaced sandbox is still there"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let mut io = request("j", "cat /in/data.txt > /out.txt");
    io.files
        .insert("/in/data.txt".into(), b"input bytes\n".to_vec().into());
    io.fetch_files = vec!["/out.txt".into(), "/missing".into()];
    let r = f.plane.fncall(op(), io).await.expect("io call");
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    let out = &r.files["/out.txt"];
    assert_eq!(
        out.data.as_ref().map(|d| d.0.as_slice()),
        Some(&b"input bytes\n"[..])
    );
    assert!(r.files["/missing"].error.is_some(), "{r:?}");

    // Bad calls: an unknown pool, an unknown language, a pool made for claims.
    let e = f
        .plane
        .fncall(op(), request("nope", "true"))
        .await
        .expect_err("unknown pool");
    assert_eq!(e.code, ErrorCode::NotFound, "{e:?}");
    let mut lang = request("j", "true");
    lang.command = None;
    lang.code = Some("print(1)".into());
    lang.language = Some("cobol".into());
    let e = f.plane.fncall(op(), lang).await.expect_err("language");
    assert!(e.message.contains("cobol"), "{e:?}");
}

/// A member whose agent never answers a call (stopped mid-call) holds the caller only
/// until the call's timeout and a grace: the call then runs on another member, and the
/// stuck one is not lent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_member_costs_its_timeout_and_the_call_runs_elsewhere() {
    let f = Fixture::new().await;
    call_pool(&f, "stuck", 2, 100).await;
    f.node.stall_next_call();
    let mut req = request("stuck", "echo fine");
    req.timeout_s = 1.0;
    let t = Instant::now();
    let r = f.plane.fncall(op(), req).await.expect("call");
    let took = t.elapsed();
    assert_eq!(r.status, FnCallStatus::Finished, "{r:?}");
    assert_eq!(r.stdout, "fine\n");
    assert!(
        took >= Duration::from_secs(1) && took < Duration::from_secs(15),
        "{took:?}"
    );
    // The stuck member is replaced: the pool is whole again, none left busy.
    wait_pool(&f, "stuck", |p| p.ready == 2 && p.busy == 0).await;
    for _ in 0..4 {
        let r = f
            .plane
            .fncall(op(), request("stuck", "echo again"))
            .await
            .expect("later call");
        assert_eq!(r.stdout, "again\n", "{r:?}");
    }
}

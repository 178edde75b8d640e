//! Pause and resume: a paused sandbox's processes do not run, its page cache goes back to
//! the host, calls answer `paused` (or resume it with `auto_resume`), and after resume
//! everything continues where it stopped: sessions, background processes, files.

use std::time::Duration;

use dsec_e2e::{host, require_root, sh, Server};
use dsec_wire::v1::*;
use dsec_wire::ErrorCode;

/// CPU ticks (user + system) used so far by the sandbox's processes, seen from the host.
fn cpu_ticks(id: &str) -> u64 {
    host::processes(id)
        .into_iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
        .filter_map(|s| {
            let rest = s[s.rfind(')')? + 2..].to_string();
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread")]
async fn pause_freezes_reclaims_and_resume_continues_where_it_stopped() {
    if !require_root() {
        return;
    }
    let s = Server::shared("pause");
    let c = s.client();
    let sb = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect("create");
    let session = c
        .create_session(&sb.id, CreateSessionRequest::default())
        .await
        .expect("session");
    let run = |cmd: &str| SessionRunRequest {
        command: cmd.into(),
        timeout_s: Some(30.0),
        request_id: None,
    };
    c.run_in_session(&sb.id, &session.session, run("cd /tmp && export X=42"))
        .await
        .expect("session run");
    c.start_process(
        &sb.id,
        StartProcessRequest {
            tag: Some("spin".into()),
            ..dsec_e2e::background(Command::Shell("while :; do :; done".into()))
        },
    )
    .await
    .expect("spinner");
    // 64 MiB of page cache charged to the sandbox.
    let r = c
        .exec(
            &sb.id,
            sh("mkdir -p /work && dd if=/dev/zero of=/work/big bs=1M count=64 conv=fsync status=none && cat /work/big >/dev/null && echo ok"),
        )
        .await
        .expect("exec");
    assert_eq!(r.stdout, "ok\n", "{r:?}");

    let p = c.pause_sandbox(&sb.id).await.expect("pause");
    assert_eq!(p.sandbox.state, SandboxState::Paused);
    assert!(p.memory_before_bytes > 48 << 20, "{p:?}");
    assert!(
        p.memory_after_bytes < p.memory_before_bytes / 2,
        "reclaim gave back too little: {} -> {}",
        p.memory_before_bytes,
        p.memory_after_bytes
    );
    // Frozen: the spinner uses no CPU.
    let t0 = cpu_ticks(&sb.id);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(cpu_ticks(&sb.id), t0, "processes ran while paused");
    // Calls answer `paused`; pausing again is a no-op.
    let e = c.exec(&sb.id, sh("true")).await.expect_err("paused");
    assert_eq!(e.code(), Some(ErrorCode::Paused));
    assert_eq!(
        c.pause_sandbox(&sb.id)
            .await
            .expect("pause again")
            .sandbox
            .state,
        SandboxState::Paused
    );
    assert_eq!(
        c.get_sandbox(&sb.id).await.expect("get").state,
        SandboxState::Paused
    );

    let resumed = c.resume_sandbox(&sb.id).await.expect("resume");
    assert_eq!(resumed.state, SandboxState::Ready);
    let t1 = cpu_ticks(&sb.id);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(cpu_ticks(&sb.id) > t1, "the spinner runs again");
    let r = c
        .run_in_session(&sb.id, &session.session, run("echo $X $(pwd)"))
        .await
        .expect("session after resume");
    assert_eq!(r.output, "42 /tmp\n", "session state survives");
    let r = c
        .exec(&sb.id, sh("du -m /work/big | cut -f1"))
        .await
        .expect("exec");
    assert_eq!(r.stdout, "64\n");
    c.resume_sandbox(&sb.id)
        .await
        .expect("resume is idempotent");

    // A paused sandbox can be deleted, and nothing of it is left.
    c.pause_sandbox(&sb.id).await.expect("pause");
    c.delete_sandbox(&sb.id).await.expect("delete paused");
    assert!(host::processes(&sb.id).is_empty());
    assert!(host::cgroup_dirs(&sb.id).is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn auto_resume_wakes_a_paused_sandbox_on_use() {
    if !require_root() {
        return;
    }
    let s = Server::shared("pause");
    let c = s.client();
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            auto_resume: true,
            ..Default::default()
        })
        .await
        .expect("create");
    assert!(sb.auto_resume);
    c.pause_sandbox(&sb.id).await.expect("pause");
    let r = c
        .exec(&sb.id, sh("echo awake"))
        .await
        .expect("exec resumes");
    assert_eq!(r.stdout, "awake\n");
    assert_eq!(
        c.get_sandbox(&sb.id).await.expect("get").state,
        SandboxState::Ready
    );
    c.delete_sandbox(&sb.id).await.expect("delete");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_job_suspends_and_resumes_as_a_whole_with_its_clock_stopped() {
    if !require_root() {
        return;
    }
    let s = Server::shared("pause");
    let c = s.client();
    let job = format!("job-{}", std::process::id());
    let mut ids = Vec::new();
    for i in 0..50 {
        let sb = c
            .create_sandbox(CreateSandboxRequest {
                labels: [
                    (JOB_LABEL.to_string(), job.clone()),
                    ("i".to_string(), i.to_string()),
                ]
                .into(),
                timeout_s: Some(600),
                ..Default::default()
            })
            .await
            .expect("create");
        c.exec(&sb.id, sh(&format!("echo {i} > /state")))
            .await
            .expect("exec");
        ids.push(sb.id);
    }
    ids.sort();
    // A sandbox of another job is not touched.
    let other = c
        .create_sandbox(CreateSandboxRequest {
            labels: [(JOB_LABEL.to_string(), format!("{job}-other"))].into(),
            ..Default::default()
        })
        .await
        .expect("create other");

    let r = c.suspend_job(&job).await.expect("suspend");
    assert_eq!(
        r.sandboxes.iter().map(|o| o.id.clone()).collect::<Vec<_>>(),
        ids
    );
    for o in &r.sandboxes {
        assert!(o.error.is_none(), "{o:?}");
        assert_eq!(o.state, SandboxState::Paused);
    }
    let before = c.get_sandbox(&ids[0]).await.expect("get");
    assert!(before.job_suspended_at.is_some());
    assert_eq!(
        c.get_sandbox(&other.id).await.expect("other").state,
        SandboxState::Ready
    );
    // Idempotent.
    let again = c.suspend_job(&job).await.expect("suspend again");
    assert!(again
        .sandboxes
        .iter()
        .all(|o| o.error.is_none() && o.state == SandboxState::Paused));

    tokio::time::sleep(Duration::from_millis(1500)).await;
    let r = c.resume_job(&job).await.expect("resume");
    for o in &r.sandboxes {
        assert!(o.error.is_none() && o.state == SandboxState::Ready, "{o:?}");
    }
    let after = c.get_sandbox(&ids[0]).await.expect("get");
    assert!(after.job_suspended_at.is_none());
    assert!(
        after.expires_at >= before.expires_at + 1000,
        "the lifetime stood still while suspended: {} -> {}",
        before.expires_at,
        after.expires_at
    );
    for (i, id) in ids.iter().enumerate() {
        let r = c
            .exec(id, sh("cat /state"))
            .await
            .expect("exec after resume");
        // Ids sort differently from creation order; each sandbox kept its own file.
        assert!(r.stdout.trim().parse::<usize>().is_ok(), "{i}: {r:?}");
    }
    let unknown = c.suspend_job("no-such-job").await.expect("empty job");
    assert!(unknown.sandboxes.is_empty());
    for id in ids.iter().chain([&other.id]) {
        c.delete_sandbox(id).await.expect("delete");
    }
}

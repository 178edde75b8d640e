//! `GET /v1/events` against a real `dsec serve` and real sandboxes: an OOM kill names its
//! command, a write through the API that finds no space and a command that fills the
//! disk are `disk_full`, a lifetime's end is `expired`
//! with its cause, a delete is `deleted` with the request that asked; a reconnect from an
//! id replays what came after it; `dsec events` prints the same; the audit log has the
//! calls under the same request ids, the refused write too.

use std::time::Duration;

use dsec_client::Client;
use dsec_e2e::{require_root, run_cli, sh, Server};
use dsec_wire::v1::*;
use futures::StreamExt;

fn server() -> &'static Server {
    Server::shared("events")
}

/// Events of `feed` until `done` holds for what was collected (within 60 s).
async fn collect_until(
    feed: &mut futures::stream::BoxStream<'static, Result<Event, dsec_client::ClientError>>,
    done: impl Fn(&[Event]) -> bool,
) -> Vec<Event> {
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !done(&got) {
        match tokio::time::timeout_at(deadline, feed.next()).await {
            Ok(Some(Ok(e))) => got.push(e),
            Ok(Some(Err(e))) => panic!("the stream failed: {e}; so far {got:#?}"),
            Ok(None) => panic!("the stream ended; so far {got:#?}"),
            Err(_) => panic!("events missing after 60 s; so far {got:#?}"),
        }
    }
    got
}

fn has(events: &[Event], kind: EventKind, sandbox: &str) -> bool {
    events
        .iter()
        .any(|e| e.kind == kind && e.sandbox.as_deref() == Some(sandbox))
}

async fn create(c: &Client, resources: Resources, timeout_s: Option<u64>) -> Sandbox {
    c.create_sandbox(CreateSandboxRequest {
        resources,
        timeout_s,
        labels: [("suite".to_string(), "events".to_string())].into(),
        ..Default::default()
    })
    .await
    .expect("create sandbox")
}

#[tokio::test(flavor = "multi_thread")]
async fn oom_disk_full_expiry_and_delete_stream_with_causes_and_replay() {
    if !require_root() {
        return;
    }
    let s = server();
    let c = s.client();
    let mut feed = c
        .events(&EventQuery {
            label: Some("suite=events".into()),
            ..Default::default()
        })
        .await
        .expect("events");

    let hog = create(
        &c,
        Resources {
            memory_mb: Some(64),
            disk_mb: Some(64),
            ..Default::default()
        },
        None,
    )
    .await;
    let r = c
        .exec(
            &hog.id,
            sh("python3 -c 'b = bytearray(512 * 2**20); print(len(b))'"),
        )
        .await
        .expect("exec");
    assert!(r.oom_killed, "{r:?}");
    let e = c
        .write_file(&hog.id, "/work/big.bin", None, vec![7u8; 100 << 20])
        .await
        .expect_err("over the disk");
    assert_eq!(e.code(), Some(dsec_wire::ErrorCode::NoSpace));
    // A command that fills the disk: the node's listing sees it full.
    let r = c
        .exec(&hog.id, sh("dd if=/dev/zero of=/work/fill bs=1M 2>&1"))
        .await
        .expect("exec");
    assert!(r.stdout.contains("No space left"), "{r:?}");
    let brief = create(&c, Resources::default(), Some(1)).await;
    let filled = |e: &Event| {
        e.kind == EventKind::DiskFull && e.cause.as_deref().is_some_and(|c| c.contains("is full"))
    };
    let mut events = collect_until(&mut feed, |got| got.iter().any(filled)).await;
    let sb = c.get_sandbox(&hog.id).await.expect("get");
    assert!(sb.disk_full_since.is_some(), "{sb:?}");
    c.delete_sandbox(&hog.id).await.expect("delete");
    events.extend(
        collect_until(&mut feed, |got| {
            has(got, EventKind::Deleted, &hog.id) && has(got, EventKind::Expired, &brief.id)
        })
        .await,
    );
    let of = |kind: EventKind, id: &str| -> Event {
        events
            .iter()
            .find(|e| e.kind == kind && e.sandbox.as_deref() == Some(id))
            .cloned()
            .unwrap_or_else(|| panic!("no {kind} event of {id}: {events:#?}"))
    };
    let oom = of(EventKind::OomKilled, &hog.id);
    assert!(
        oom.command
            .as_deref()
            .unwrap_or_default()
            .contains("bytearray"),
        "{oom:?}"
    );
    assert!(
        oom.cause.as_deref().unwrap_or_default().contains("64 MiB"),
        "{oom:?}"
    );
    // The refused upload says which file did not fit. (The node's disk listing may have
    // seen the disk full while the upload's part was still on it: its own event can come
    // first, so look for the upload's by its cause.)
    of(EventKind::DiskFull, &hog.id);
    assert!(
        events.iter().any(|e| e.kind == EventKind::DiskFull
            && e.sandbox.as_deref() == Some(hog.id.as_str())
            && e.cause
                .as_deref()
                .is_some_and(|c| c.contains("/work/big.bin"))),
        "no disk_full event naming /work/big.bin: {events:#?}"
    );
    let by_command = events.iter().find(|e| filled(e)).expect("collected");
    assert!(
        by_command
            .cause
            .as_deref()
            .unwrap_or_default()
            .contains("64 MiB"),
        "{by_command:?}"
    );
    let expired = of(EventKind::Expired, &brief.id);
    assert!(expired.cause.is_some(), "{expired:?}");
    let deleted = of(EventKind::Deleted, &hog.id);
    assert!(deleted.request_id.is_some(), "{deleted:?}");
    for kind in [EventKind::Created, EventKind::Ready] {
        of(kind, &hog.id);
    }
    for w in events.windows(2) {
        assert!(w[0].id < w[1].id, "ids grow: {events:#?}");
    }

    // A reconnect from the OOM kill's id replays what came after it, the same events.
    let mut again = c
        .events(&EventQuery {
            after: Some(oom.id),
            label: Some("suite=events".into()),
            ..Default::default()
        })
        .await
        .expect("events again");
    let after: Vec<Event> = events.iter().filter(|e| e.id > oom.id).cloned().collect();
    let replayed = collect_until(&mut again, |got| got.len() >= after.len()).await;
    assert_eq!(replayed, after);

    // The CLI prints the same, one JSON event per line, and ends (no --follow).
    let (code, out, err) = run_cli(
        &s.url,
        &s.key,
        &[
            "--json",
            "events",
            "--sandbox",
            &hog.id,
            "--kind",
            "oom_killed,deleted",
        ],
    );
    assert_eq!(code, Some(0), "{err}");
    let printed: Vec<Event> = out
        .lines()
        .map(|l| serde_json::from_str(l).expect("an event per line"))
        .collect();
    assert_eq!(printed, vec![oom.clone(), deleted.clone()]);
    let (code, out, err) = run_cli(&s.url, &s.key, &["events", "--sandbox", &hog.id]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.contains("oom_killed") && out.contains("bytearray"),
        "{out}"
    );
    let (code, _, err) = run_cli(&s.url, &s.key, &["events", "--kind", "exploded"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("unknown event kind"), "{err}");

    // The audit log has the delete, under the same request id as its event, and the
    // refused write.
    let audit = c
        .audit(&AuditQuery {
            sandbox: Some(hog.id.clone()),
            ..Default::default()
        })
        .await
        .expect("audit");
    let delete = audit
        .entries
        .iter()
        .find(|e| e.method == "DELETE")
        .unwrap_or_else(|| panic!("no DELETE audited: {audit:#?}"));
    assert_eq!(delete.request_id, deleted.request_id);
    assert_eq!(delete.tenant.as_deref(), Some("default"));
    assert!(
        audit.entries.iter().any(|e| e.method == "PUT"
            && e.status == 507
            && e.error.as_deref() == Some("no_space")),
        "{audit:#?}"
    );
    let (code, out, err) = run_cli(&s.url, &s.key, &["audit", "--sandbox", &hog.id]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("DELETE") && out.contains(&hog.id), "{out}");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_request_id_reaches_the_agent_and_the_command() {
    if !require_root() {
        return;
    }
    let s = server();
    let c = s.client();
    let sb = create(&c, Resources::default(), None).await;
    let http = reqwest::Client::new();
    let exec = |rid: &'static str, body: serde_json::Value| {
        let req = http
            .post(format!("{}/v1/sandboxes/{}/exec", s.url, sb.id))
            .header("x-api-key", &s.key)
            .header("x-request-id", rid)
            .json(&body);
        async move {
            let resp = req.send().await.expect("exec");
            assert_eq!(
                resp.headers()["x-request-id"].to_str().ok(),
                Some(rid),
                "the answer names the request"
            );
            resp.json::<ExecResult>().await.expect("exec result")
        }
    };
    let r = exec(
        "trace-me-1",
        serde_json::json!({"cmd": "echo $DSEC_REQUEST_ID"}),
    )
    .await;
    assert_eq!(r.stdout, "trace-me-1\n");
    // A recorded exec (kept by the agent under its own key) carries it too.
    let r = exec(
        "trace-me-2",
        serde_json::json!({"cmd": "echo $DSEC_REQUEST_ID", "request_id": "call-1"}),
    )
    .await;
    assert_eq!(r.stdout, "trace-me-2\n");
    // The caller's own variable wins.
    let r = exec(
        "trace-me-3",
        serde_json::json!({"cmd": "echo $DSEC_REQUEST_ID", "env": {"DSEC_REQUEST_ID": "mine"}}),
    )
    .await;
    assert_eq!(r.stdout, "mine\n");
    // A process it starts, recorded or not.
    for (rid, body) in [
        (
            "trace-proc-1",
            serde_json::json!({"cmd": "echo $DSEC_REQUEST_ID > /tmp/p1"}),
        ),
        (
            "trace-proc-2",
            serde_json::json!({"cmd": "echo $DSEC_REQUEST_ID > /tmp/p2", "request_id": "proc-call"}),
        ),
    ] {
        let resp = http
            .post(format!("{}/v1/sandboxes/{}/processes", s.url, sb.id))
            .header("x-api-key", &s.key)
            .header("x-request-id", rid)
            .json(&body)
            .send()
            .await
            .expect("start process");
        assert!(resp.status().is_success(), "{:?}", resp.text().await);
    }
    for (file, want) in [("/tmp/p1", "trace-proc-1\n"), ("/tmp/p2", "trace-proc-2\n")] {
        let got = dsec_e2e::wait_until(Duration::from_secs(10), || async {
            let r = c.exec(&sb.id, sh(&format!("cat {file}"))).await.ok()?;
            (r.stdout == want).then_some(())
        })
        .await;
        assert!(got.is_some(), "{file} never held {want:?}");
    }
    c.delete_sandbox(&sb.id).await.expect("delete");
}

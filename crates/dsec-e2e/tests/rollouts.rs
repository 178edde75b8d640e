//! RL rollouts on preemptible trainers (#32): calls with request ids run once, a retry
//! gets the first call's outcome (or attaches to it while it runs, from its first byte),
//! also across a `kill -9` of the server; the call log lists every such call in order.

use std::time::{Duration, Instant};

use futures::StreamExt;
use sha2::Digest as _;

use dsec_client::Client;
use dsec_e2e::{require_root, sh, Server};
use dsec_wire::v1::*;
use dsec_wire::ErrorCode;

fn with_id(cmd: &str, rid: &str) -> ExecRequest {
    ExecRequest {
        request_id: Some(rid.into()),
        ..sh(cmd)
    }
}

/// The command a trainer must not run twice: it appends to a file, slowly.
const APPEND: &str = "sleep 3; echo done >> /root/f; echo done";

/// Sends `req` and hangs up after `after`, as a trainer that died mid-call.
async fn call_and_die(c: &Client, id: &str, req: ExecRequest, after: Duration) {
    let (c, id) = (c.clone(), id.to_string());
    let call = tokio::spawn(async move { c.exec(&id, req).await });
    tokio::time::sleep(after).await;
    call.abort();
    assert!(call.await.is_err(), "the call was cut off, not finished");
}

/// The contents of `path` in sandbox `id` ("" if it is missing).
async fn contents(c: &Client, id: &str, path: &str) -> String {
    c.exec(id, sh(&format!("cat {path} 2>/dev/null")))
        .await
        .expect("cat")
        .stdout
}

/// A client of the shared server and a new default sandbox on it.
async fn fresh_sandbox() -> (Client, Sandbox) {
    let c = Server::shared("rollouts").client();
    let sb = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect("create");
    (c, sb)
}

async fn lines_of_f(c: &Client, id: &str) -> String {
    contents(c, id, "/root/f").await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_retry_after_the_client_died_gets_the_first_outcome_and_runs_nothing() {
    if !require_root() {
        return;
    }
    let (c, sb) = fresh_sandbox().await;
    call_and_die(
        &c,
        &sb.id,
        with_id(APPEND, "step-1"),
        Duration::from_millis(700),
    )
    .await;

    // The retry attaches to the running command and gets its result.
    let r = c
        .exec(&sb.id, with_id(APPEND, "step-1"))
        .await
        .expect("retry");
    assert_eq!((r.stdout.as_str(), r.exit.exit_code), ("done\n", Some(0)));
    assert_eq!(lines_of_f(&c, &sb.id).await, "done\n", "ran once");
    // A third try answers from the record at once, running nothing.
    let t = Instant::now();
    let again = c
        .exec(&sb.id, with_id(APPEND, "step-1"))
        .await
        .expect("third");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    assert_eq!(again.stdout, "done\n");
    assert_eq!(again.exit, r.exit);
    assert_eq!(lines_of_f(&c, &sb.id).await, "done\n", "still once");
    // So does a stream, replaying the output.
    let events: Vec<ExecEvent> = c
        .exec_stream(&sb.id, with_id(APPEND, "step-1"))
        .await
        .expect("stream retry")
        .map(|e| e.expect("event"))
        .collect()
        .await;
    assert!(
        events.contains(&ExecEvent::Stdout {
            data: "done\n".into()
        }),
        "{events:?}"
    );
    assert!(
        matches!(events.last(), Some(ExecEvent::Exit { exit, .. }) if exit.exit_code == Some(0)),
        "{events:?}"
    );

    // The same id with another body is a conflict; so is the id on another sandbox.
    let e = c
        .exec(&sb.id, with_id("echo other", "step-1"))
        .await
        .expect_err("conflict");
    assert_eq!(e.code(), Some(ErrorCode::Conflict), "{e}");
    let other = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect("create");
    let e = c
        .exec(&other.id, with_id(APPEND, "step-1"))
        .await
        .expect_err("another sandbox's id");
    assert_eq!(e.code(), Some(ErrorCode::Conflict), "{e}");
    assert_eq!(lines_of_f(&c, &other.id).await, "", "nothing ran there");
    // Ids over 256 bytes are refused before anything runs.
    let e = c
        .exec(&sb.id, with_id("true", &"x".repeat(257)))
        .await
        .expect_err("long id");
    assert_eq!(e.code(), Some(ErrorCode::BadRequest), "{e}");

    // More calls, one failing; the log lists them all in order with their outcomes.
    c.exec(&sb.id, with_id("echo two", "step-2"))
        .await
        .expect("step 2");
    let r = c
        .exec(&sb.id, with_id("echo oops >&2; exit 3", "step-3"))
        .await
        .expect("step 3");
    assert_eq!(r.exit.exit_code, Some(3));
    let log = c
        .call_log(
            &sb.id,
            &CallLogQuery {
                output: true,
                ..CallLogQuery::default()
            },
        )
        .await
        .expect("log");
    let seen: Vec<(&str, CallState, Option<i32>)> = log
        .calls
        .iter()
        .map(|c| {
            (
                c.request_id.as_str(),
                c.state,
                c.exit.as_ref().and_then(|e| e.exit_code),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            ("step-1", CallState::Done, Some(0)),
            ("step-2", CallState::Done, Some(0)),
            ("step-3", CallState::Done, Some(3)),
        ]
    );
    assert_eq!(log.calls[2].stderr.as_deref(), Some("oops\n"));
    assert_eq!(log.calls[0].args["cmd"], APPEND);
    assert!(log
        .calls
        .iter()
        .all(|c| c.ended_at_ms >= Some(c.started_at_ms)));
    let page = c
        .call_log(
            &sb.id,
            &CallLogQuery {
                after: Some(1),
                limit: Some(1),
                ..CallLogQuery::default()
            },
        )
        .await
        .expect("page");
    assert_eq!(page.calls.len(), 1);
    assert_eq!(page.calls[0].request_id, "step-2");
    assert_eq!(page.next_after, Some(2));
    for id in [sb.id, other.id] {
        c.delete_sandbox(&id).await.expect("delete");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stream_retry_attaches_from_the_first_byte() {
    if !require_root() {
        return;
    }
    let (c, sb) = fresh_sandbox().await;
    let req = with_id(
        "for i in 1 2 3 4; do echo $i; sleep 0.4; done; echo x >> /root/f",
        "stream-1",
    );
    let mut first = c.exec_stream(&sb.id, req.clone()).await.expect("stream");
    // Read until the first line, then hang up.
    loop {
        match first.next().await.expect("event").expect("ok") {
            ExecEvent::Stdout { data } if data.contains('1') => break,
            _ => {}
        }
    }
    drop(first);
    let events: Vec<ExecEvent> = c
        .exec_stream(&sb.id, req)
        .await
        .expect("attach")
        .map(|e| e.expect("event"))
        .collect()
        .await;
    let out: String = events
        .iter()
        .filter_map(|e| match e {
            ExecEvent::Stdout { data } => Some(data.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(out, "1\n2\n3\n4\n", "{events:?}");
    assert!(matches!(events.first(), Some(ExecEvent::Started { .. })));
    assert!(matches!(events.last(), Some(ExecEvent::Exit { .. })));
    assert_eq!(lines_of_f(&c, &sb.id).await, "x\n");
    c.delete_sandbox(&sb.id).await.expect("delete");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_call_survives_a_kill_9_of_the_server_and_its_retry_runs_nothing() {
    if !require_root() {
        return;
    }
    let seed = Server::shared("rollouts");
    let mut s = Server::start_with(
        "rollouts-restart",
        true,
        &["--cgroup-parent", "dsec-rollouts-restart"],
    )
    .await
    .expect("server");
    s.ensure_base(Some(seed)).await.expect("base image");
    let c = s.client();
    let sb = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect("create");
    // One call ended before the crash, one is in flight when it comes, and an upload is
    // still arriving.
    c.exec(&sb.id, with_id("echo before", "pre"))
        .await
        .expect("pre");
    let (uc, uid) = (c.clone(), sb.id.clone());
    let upload = tokio::spawn(async move {
        let body =
            futures::stream::iter([Ok::<_, std::io::Error>(bytes::Bytes::from_static(b"half"))])
                .chain(futures::stream::pending());
        let body = dsec_client::UploadBody::from_stream(body);
        uc.write_file_recorded(&uid, "/root/u", None, body, Some("up-1"))
            .await
    });
    let arriving = dsec_e2e::wait_until(Duration::from_secs(20), || {
        let (c, id) = (c.clone(), sb.id.clone());
        async move {
            let log = c.call_log(&id, &CallLogQuery::default()).await.ok()?;
            log.calls
                .iter()
                .any(|r| r.request_id == "up-1" && r.state == CallState::Running)
                .then_some(())
        }
    })
    .await;
    assert!(arriving.is_some(), "the upload is on its way");
    call_and_die(
        &c,
        &sb.id,
        with_id(APPEND, "in-flight"),
        Duration::from_millis(700),
    )
    .await;
    s.kill();
    assert!(
        upload.await.expect("join").is_err(),
        "the upload died with the server"
    );
    s.spawn().await.expect("restart");
    let c = s.client();
    let r = c
        .exec(&sb.id, with_id(APPEND, "in-flight"))
        .await
        .expect("retry after the restart");
    assert_eq!((r.stdout.as_str(), r.exit.exit_code), ("done\n", Some(0)));
    assert_eq!(lines_of_f(&c, &sb.id).await, "done\n", "ran once");
    // The upload wrote nothing: its retry writes, once.
    assert_eq!(contents(&c, &sb.id, "/root/u").await, "");
    for _ in 0..2 {
        let w = c
            .write_file_recorded(&sb.id, "/root/u", None, "whole", Some("up-1"))
            .await
            .expect("retry of the upload");
        assert_eq!(w.bytes, 5);
    }
    assert_eq!(contents(&c, &sb.id, "/root/u").await, "whole");
    let r = c
        .exec(&sb.id, with_id("echo before", "pre"))
        .await
        .expect("pre again");
    assert_eq!(r.stdout, "before\n");
    let log = c
        .call_log(&sb.id, &CallLogQuery::default())
        .await
        .expect("log");
    let ids: Vec<_> = log.calls.iter().map(|c| c.request_id.as_str()).collect();
    assert_eq!(ids, ["pre", "in-flight", "up-1"]);
    assert!(log.calls.iter().all(|c| c.state == CallState::Done));
    c.delete_sandbox(&sb.id).await.expect("delete");
    let e = c
        .call_log(&sb.id, &CallLogQuery::default())
        .await
        .expect_err("gone");
    assert_eq!(e.code(), Some(ErrorCode::NotFound), "{e}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fork_into_8_shares_one_captured_layer_and_keeps_writes_apart() {
    if !require_root() {
        return;
    }
    let s = Server::shared("rollouts");
    let c = s.client();
    let src = c
        .create_sandbox(CreateSandboxRequest {
            env: [("ROLLOUT".to_string(), "base".to_string())].into(),
            workdir: Some("/tmp".into()),
            labels: [("task".to_string(), "t1".to_string())].into(),
            ..CreateSandboxRequest::default()
        })
        .await
        .expect("create");
    // The prepared state: a repository and 8 MiB of dependencies.
    let r = c
        .exec(
            &src.id,
            sh("mkdir -p /work/repo && echo hello > /work/repo/a \
                && dd if=/dev/urandom of=/work/repo/blob bs=1M count=8 status=none \
                && sha256sum /work/repo/blob > /work/sum && echo ok"),
        )
        .await
        .expect("setup");
    assert_eq!(r.stdout, "ok\n", "{}", r.stderr);

    let e = c
        .fork_sandbox(&src.id, &ForkRequest::default())
        .await
        .expect_err("count 0");
    assert_eq!(e.code(), Some(ErrorCode::BadRequest), "{e}");
    let e = c
        .fork_sandbox(
            &src.id,
            &ForkRequest {
                count: MAX_FORKS + 1,
                ..ForkRequest::default()
            },
        )
        .await
        .expect_err("too many");
    assert_eq!(e.code(), Some(ErrorCode::BadRequest), "{e}");

    // The layer store: what a capture adds to the node.
    let layers = s.state_dir.join("images");
    let before = dsec_e2e::dir_bytes(&layers);
    let forked = c
        .fork_sandbox(
            &src.id,
            &ForkRequest {
                count: 8,
                ..ForkRequest::default()
            },
        )
        .await
        .expect("fork");
    let grown = dsec_e2e::dir_bytes(&layers).saturating_sub(before);
    assert_eq!(forked.sandboxes.len(), 8);
    // Captured once: 8 copies would be 64 MiB.
    assert!(grown < 24 << 20, "the layer store grew {grown} bytes");
    assert!(forked.captured_layer.is_some());
    for f in &forked.sandboxes {
        assert_eq!(f.image, forked.image);
        assert_eq!(f.labels.get("task").map(String::as_str), Some("t1"));
        assert_eq!(
            f.labels.get(FORK_OF_LABEL).map(String::as_str),
            Some(src.id.as_str())
        );
        let r = c
            .exec(
                &f.id,
                sh("cat /work/repo/a; sha256sum -c /work/sum >/dev/null && echo ok; echo $ROLLOUT; pwd"),
            )
            .await
            .expect("exec in a fork");
        assert_eq!(r.stdout, "hello\nok\nbase\n/tmp\n", "{}", r.stderr);
    }
    let ids: Vec<String> = forked.sandboxes.iter().map(|f| f.id.clone()).collect();
    // A write in one fork is the fork's alone.
    c.exec(&ids[0], sh("echo mine > /work/repo/a"))
        .await
        .expect("write");
    for id in [&ids[1], &src.id] {
        let r = c.exec(id, sh("cat /work/repo/a")).await.expect("read");
        assert_eq!(r.stdout, "hello\n", "{id}");
    }
    // The source goes; its forks keep working.
    c.delete_sandbox(&src.id).await.expect("delete the source");
    let r = c
        .exec(&ids[2], sh("cat /work/repo/a"))
        .await
        .expect("fork after the source went");
    assert_eq!(r.stdout, "hello\n");
    // Forks of forks carry both captures.
    c.exec(&ids[3], sh("echo three > /work/f3"))
        .await
        .expect("write");
    let grand = c
        .fork_sandbox(
            &ids[3],
            &ForkRequest {
                count: 2,
                env: [("ROLLOUT".to_string(), "grand".to_string())].into(),
                ..ForkRequest::default()
            },
        )
        .await
        .expect("fork of a fork");
    for g in &grand.sandboxes {
        let r = c
            .exec(&g.id, sh("cat /work/repo/a /work/f3; echo $ROLLOUT"))
            .await
            .expect("exec");
        assert_eq!(r.stdout, "hello\nthree\ngrand\n");
        c.delete_sandbox(&g.id).await.expect("delete");
    }
    // A capture whose image was deleted (and its layer collected) does not stop the next
    // fork: that one captures everything since the create.
    let once = c
        .fork_sandbox(
            &ids[4],
            &ForkRequest {
                count: 1,
                ..ForkRequest::default()
            },
        )
        .await
        .expect("fork");
    c.delete_sandbox(&once.sandboxes[0].id)
        .await
        .expect("delete");
    c.delete_image(&once.image)
        .await
        .expect("delete the capture");
    c.exec(&ids[4], sh("echo later > /work/later"))
        .await
        .expect("write");
    let again = c
        .fork_sandbox(
            &ids[4],
            &ForkRequest {
                count: 1,
                ..ForkRequest::default()
            },
        )
        .await
        .expect("fork after the capture went");
    let r = c
        .exec(&again.sandboxes[0].id, sh("cat /work/repo/a /work/later"))
        .await
        .expect("exec");
    assert_eq!(r.stdout, "hello\nlater\n");
    c.delete_sandbox(&again.sandboxes[0].id)
        .await
        .expect("delete");
    for id in &ids {
        c.delete_sandbox(id).await.expect("delete");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn session_commands_and_process_starts_run_once_per_request_id() {
    if !require_root() {
        return;
    }
    let (c, sb) = fresh_sandbox().await;
    let session = c
        .create_session(&sb.id, CreateSessionRequest::default())
        .await
        .expect("session");
    let run = |command: &str, rid: &str| SessionRunRequest {
        command: command.into(),
        timeout_s: Some(30.0),
        request_id: Some(rid.into()),
    };
    let slow = "sleep 2; echo s >> /root/s; echo ok";
    // The caller goes away mid-command: the command runs on (a session command whose
    // caller leaves is otherwise interrupted) and its result is recorded.
    {
        let (c, id, sess) = (c.clone(), sb.id.clone(), session.session.clone());
        let req = run(slow, "sess-1");
        let call = tokio::spawn(async move { c.run_in_session(&id, &sess, req).await });
        tokio::time::sleep(Duration::from_millis(500)).await;
        call.abort();
        let _ = call.await;
    }
    let r = c
        .run_in_session(&sb.id, &session.session, run(slow, "sess-1"))
        .await
        .expect("retry");
    assert_eq!((r.output.as_str(), r.exit_code), ("ok\n", 0));
    let again = c
        .run_in_session(&sb.id, &session.session, run(slow, "sess-1"))
        .await
        .expect("third");
    assert_eq!(again, r);
    assert_eq!(contents(&c, &sb.id, "/root/s").await, "s\n", "ran once");
    let e = c
        .run_in_session(&sb.id, &session.session, run("true", "sess-1"))
        .await
        .expect_err("conflict");
    assert_eq!(e.code(), Some(ErrorCode::Conflict), "{e}");

    // A retried process start starts one process.
    let start = StartProcessRequest {
        tag: Some("once".into()),
        request_id: Some("proc-1".into()),
        ..dsec_e2e::background(Command::Shell("sleep 300".into()))
    };
    let p1 = c.start_process(&sb.id, start.clone()).await.expect("start");
    let p2 = c.start_process(&sb.id, start).await.expect("retry");
    assert_eq!(p1.pid, p2.pid);
    let listed = c.list_processes(&sb.id).await.expect("list");
    let tagged = listed
        .processes
        .iter()
        .filter(|p| p.tag.as_deref() == Some("once"))
        .count();
    assert_eq!(tagged, 1);

    let log = c
        .call_log(
            &sb.id,
            &CallLogQuery {
                output: true,
                ..CallLogQuery::default()
            },
        )
        .await
        .expect("log");
    let kinds: Vec<(&str, &str)> = log
        .calls
        .iter()
        .map(|c| (c.request_id.as_str(), c.kind.as_str()))
        .collect();
    assert_eq!(
        kinds,
        [("sess-1", "session_run"), ("proc-1", "process_start")]
    );
    assert!(log.calls.iter().all(|c| c.state == CallState::Done));
    assert_eq!(
        log.calls[1].reply.as_ref().and_then(|r| r["pid"].as_u64()),
        Some(u64::from(p1.pid)),
        "{:?}",
        log.calls[1].reply
    );
    c.delete_sandbox(&sb.id).await.expect("delete");
}

#[tokio::test(flavor = "multi_thread")]
async fn file_writes_and_tar_uploads_are_written_once_per_request_id() {
    if !require_root() {
        return;
    }
    let (c, sb) = fresh_sandbox().await;
    let write = |body: &'static str| {
        c.write_file_recorded(&sb.id, "/root/w", Some(0o600), body, Some("write-1"))
    };
    let first = write("first").await.expect("write");
    assert_eq!(first.bytes, 5);
    // The sandbox changes the file; a retry of the write must not put it back.
    c.exec(&sb.id, sh("echo changed > /root/w"))
        .await
        .expect("change");
    assert_eq!(write("first").await.expect("retry"), first);
    assert_eq!(contents(&c, &sb.id, "/root/w").await, "changed\n");
    let e = write("other").await.expect_err("other bytes, same id");
    assert_eq!(e.code(), Some(ErrorCode::Conflict), "{e}");

    // An upload that breaks off wrote nothing, so its retry writes.
    let broken = futures::stream::iter([
        Ok::<_, std::io::Error>(bytes::Bytes::from_static(b"half")),
        Err(std::io::Error::other("the trainer died")),
    ]);
    c.write_file_recorded(
        &sb.id,
        "/root/b",
        None,
        dsec_client::UploadBody::from_stream(broken),
        Some("write-2"),
    )
    .await
    .expect_err("broken upload");
    let done = c
        .write_file_recorded(&sb.id, "/root/b", None, "whole", Some("write-2"))
        .await
        .expect("retry of a broken upload");
    assert_eq!(done.bytes, 5);
    assert_eq!(contents(&c, &sb.id, "/root/b").await, "whole");

    // A tar upload, the same.
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(3);
    h.set_mode(0o644);
    h.set_entry_type(tar::EntryType::Regular);
    b.append_data(&mut h, "t.txt", &b"tar"[..]).expect("entry");
    let archive = b.into_inner().expect("tar");
    let up = c
        .upload_tar_recorded(&sb.id, "/root/t", archive.clone(), Some("tar-1"))
        .await
        .expect("upload");
    c.exec(&sb.id, sh("rm /root/t/t.txt")).await.expect("rm");
    let again = c
        .upload_tar_recorded(&sb.id, "/root/t", archive, Some("tar-1"))
        .await
        .expect("retry");
    assert_eq!(again, up);
    assert_eq!(contents(&c, &sb.id, "/root/t/t.txt").await, "", "not again");

    let log = c
        .call_log(&sb.id, &CallLogQuery::default())
        .await
        .expect("log");
    let kinds: Vec<(&str, &str)> = log
        .calls
        .iter()
        .map(|c| (c.request_id.as_str(), c.kind.as_str()))
        .collect();
    assert_eq!(
        kinds,
        [
            ("write-1", "file_write"),
            ("write-2", "file_write"),
            ("tar-1", "tar_upload")
        ]
    );
    let sha_of_first = format!("{:x}", sha2::Sha256::digest(b"first"));
    assert_eq!(
        log.calls[0].body_sha256.as_deref(),
        Some(sha_of_first.as_str())
    );
    c.delete_sandbox(&sb.id).await.expect("delete");
}

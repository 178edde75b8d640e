//! A silent agent (issue #31, defect 4): the node enforces deadlines itself, marks a
//! sandbox whose agent stopped answering `unhealthy` with a cause (record, list filter,
//! `/metrics`), and sets it `ready` again when the agent answers. The agent is stopped
//! from the host with SIGSTOP, as a tracer attached to it would leave it.

use std::path::Path;
use std::time::{Duration, Instant};

use dsec_e2e::{require_root, sh, wait_until, Server};
use dsec_wire::v1::*;
use dsec_wire::ErrorCode;
use futures::StreamExt;

/// Host pid of a sandbox's agent, from its run directory's `runtime.json`.
fn agent_pid(run_dir: &Path, id: &str) -> i32 {
    let path = run_dir.join("sandboxes").join(id).join("runtime.json");
    let text = std::fs::read_to_string(&path).expect("runtime.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("runtime.json is JSON");
    v["pid"].as_i64().expect("pid") as i32
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: kill with a pid and a signal.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill({pid}, {sig})");
}

/// Stopped (`T`) per /proc/PID/stat.
fn stopped(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| Some(s[s.rfind(')')? + 2..].starts_with('T')))
        .unwrap_or(false)
}

async fn state_of(c: &dsec_client::Client, id: &str) -> Sandbox {
    c.get_sandbox(id).await.expect("get")
}

async fn wait_state(c: &dsec_client::Client, id: &str, want: SandboxState) -> Sandbox {
    let got = wait_until(Duration::from_secs(20), || async {
        let sb = state_of(c, id).await;
        (sb.state == want).then_some(sb)
    })
    .await;
    match got {
        Some(sb) => sb,
        None => panic!("{id} never became {want:?}: {:?}", state_of(c, id).await),
    }
}

/// Ids the sandbox list returns for `?state=STATE`.
async fn listed(s: &Server, state: &str) -> Vec<String> {
    let body: SandboxList = reqwest::Client::new()
        .get(format!("{}/v1/sandboxes?state={state}", s.url))
        .header("x-api-key", &s.key)
        .send()
        .await
        .expect("list")
        .json()
        .await
        .expect("list body");
    body.sandboxes.into_iter().map(|s| s.id).collect()
}

async fn metric(s: &Server, name: &str) -> f64 {
    let text = reqwest::Client::new()
        .get(format!("{}/metrics", s.url))
        .header("x-api-key", &s.key)
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("metrics body");
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{name} missing from /metrics:\n{text}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stopped_agent_times_out_turns_unhealthy_and_recovers() {
    if !require_root() {
        return;
    }
    let s = Server::start_with("liveness", true, &["--cgroup-parent", "dsec-liveness"])
        .await
        .expect("server");
    s.ensure_base(None).await.expect("base");
    let c = s.client();
    let sb = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect("create");
    let id = sb.id.clone();
    c.write_file(&id, "/tmp/f", None, b"hello".to_vec())
        .await
        .expect("write");
    let pid = agent_pid(&s.run_dir, &id);
    let marks_before = metric(&s, "dsec_sandbox_unhealthy_total").await;

    // 1. An exec with timeout_s answers `timeout` on time although the agent never does.
    signal(pid, libc::SIGSTOP);
    assert!(
        wait_until(Duration::from_secs(5), || async {
            stopped(pid).then_some(())
        })
        .await
        .is_some(),
        "agent {pid} did not stop"
    );
    let t0 = Instant::now();
    let e = c
        .exec(
            &id,
            ExecRequest {
                timeout_s: Some(2.0),
                ..sh("sleep 60")
            },
        )
        .await
        .expect_err("a stopped agent cannot finish an exec");
    let took = t0.elapsed();
    assert_eq!(e.code(), Some(ErrorCode::Timeout), "{e}");
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(8),
        "timeout answered after {took:?}"
    );

    // 2. The sandbox turns unhealthy with a cause, in the record, the list filter and
    // /metrics; calls now fail at once instead of hanging.
    let bad = wait_state(&c, &id, SandboxState::Unhealthy).await;
    let cause = bad.unhealthy_cause.clone().unwrap_or_default();
    assert!(cause.contains("ping"), "cause: {cause:?}");
    assert!(bad.unhealthy_since.is_some(), "{bad:?}");
    assert_eq!(listed(&s, "unhealthy").await, vec![id.clone()]);
    assert!(!listed(&s, "ready").await.contains(&id));
    assert_eq!(metric(&s, "dsec_sandboxes_unhealthy").await, 1.0);
    assert!(metric(&s, "dsec_sandbox_unhealthy_total").await >= marks_before + 1.0);
    let t0 = Instant::now();
    let e = c.exec(&id, sh("true")).await.expect_err("unhealthy");
    assert_eq!(e.code(), Some(ErrorCode::AgentUnavailable), "{e}");
    assert!(e.to_string().contains("unhealthy"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());

    // 3. SIGCONT: it goes back to ready by itself, and exec works.
    signal(pid, libc::SIGCONT);
    let good = wait_state(&c, &id, SandboxState::Ready).await;
    assert_eq!(good.unhealthy_cause, None, "{good:?}");
    let r = c
        .exec(&id, sh("echo ok"))
        .await
        .expect("exec after SIGCONT");
    assert_eq!(r.stdout, "ok\n");
    assert_eq!(metric(&s, "dsec_sandboxes_unhealthy").await, 0.0);

    // 4. Calls without a timeout of their own fail in bounded time too: a file read and
    // a streamed exec against a freshly stopped agent.
    signal(pid, libc::SIGSTOP);
    assert!(
        wait_until(Duration::from_secs(5), || async {
            stopped(pid).then_some(())
        })
        .await
        .is_some(),
        "agent {pid} did not stop"
    );
    let t0 = Instant::now();
    let read = async {
        match c.read_file(&id, "/tmp/f", 0, None).await {
            Ok((_, mut body)) => {
                while let Some(chunk) = body.next().await {
                    chunk?;
                }
                Ok(())
            }
            Err(e) => Err(e),
        }
    };
    let stream = async {
        let mut events = c.exec_stream(&id, sh("echo hi")).await?;
        while let Some(ev) = events.next().await {
            if let ExecEvent::Error { error } = ev? {
                return Ok(Some(error));
            }
        }
        Ok::<_, dsec_client::ClientError>(None)
    };
    let (read, stream) = tokio::time::timeout(Duration::from_secs(30), async {
        tokio::join!(read, stream)
    })
    .await
    .expect("calls against a stopped agent hung");
    let took = t0.elapsed();
    let e = read.expect_err("a stopped agent cannot serve a read");
    assert_eq!(e.code(), Some(ErrorCode::AgentUnavailable), "{e}");
    match stream {
        Ok(Some(error)) => assert_eq!(error.code, ErrorCode::AgentUnavailable, "{error:?}"),
        Err(e) => assert_eq!(e.code(), Some(ErrorCode::AgentUnavailable), "{e}"),
        Ok(None) => panic!("the stream ended without an error"),
    }
    // The watchdog's worst case for a second call on the same agent: its first ping
    // (3 s of silence + 3 s) ends inconclusive when the other call's marks the sandbox
    // unhealthy, and its next check, 6 s later, finds it so: 12 s, plus scheduling.
    assert!(took < Duration::from_secs(15), "failed only after {took:?}");
    wait_state(&c, &id, SandboxState::Unhealthy).await;
    signal(pid, libc::SIGCONT);
    wait_state(&c, &id, SandboxState::Ready).await;
    let (_, mut body) = c.read_file(&id, "/tmp/f", 0, None).await.expect("read");
    let mut got = Vec::new();
    while let Some(chunk) = body.next().await {
        got.extend_from_slice(&chunk.expect("chunk"));
    }
    assert_eq!(got, b"hello");
    c.delete_sandbox(&id).await.expect("delete");
}

/// A paused sandbox's agent is frozen with it: a call outstanding across the pause is
/// not taken for a dead agent, and the sandbox stays `paused`, not `unhealthy`.
#[tokio::test(flavor = "multi_thread")]
async fn a_paused_sandbox_is_not_marked_unhealthy() {
    if !require_root() {
        return;
    }
    // Its own cgroup parent: a node owns its parent, and the tests run at once.
    let s = Server::start_with(
        "liveness-pause",
        true,
        &["--cgroup-parent", "dsec-liveness-pause"],
    )
    .await
    .expect("server");
    s.ensure_base(None).await.expect("base");
    let c = s.client();
    let sb = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect("create");
    let id = sb.id.clone();
    let slow = {
        let c = c.clone();
        let id = id.clone();
        tokio::spawn(async move { c.exec(&id, sh("sleep 2; echo done")).await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    c.pause_sandbox(&id).await.expect("pause");
    // Past the first check and a ping's timeout: the watchdog has looked.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let sb = state_of(&c, &id).await;
    assert_eq!(sb.state, SandboxState::Paused, "{sb:?}");
    assert_eq!(metric(&s, "dsec_sandbox_unhealthy_total").await, 0.0);
    c.resume_sandbox(&id).await.expect("resume");
    let r = slow.await.expect("join").expect("exec across a pause");
    assert_eq!(r.stdout, "done\n");
    assert_eq!(state_of(&c, &id).await.state, SandboxState::Ready);
    c.delete_sandbox(&id).await.expect("delete");
}

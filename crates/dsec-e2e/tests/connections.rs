//! Node <-> agent connections carry one request after another: the node keeps one idle
//! connection per sandbox, so sequential requests neither pile up connections on either
//! side nor leave any behind after a delete, requests with input still get a connection
//! of their own, and concurrent requests each get one. And the agent reads SIGCHLD from
//! a signalfd: blocked in the agent, never in what it starts.

use std::collections::HashSet;
use std::time::Duration;

use dsec_e2e::{host, require_root, sh, wait_until, Server};
use dsec_wire::v1::*;

fn server() -> &'static Server {
    Server::shared("connections")
}

/// Unix sockets among `pid`'s open descriptors (its connections to agents among them).
fn unix_sockets(pid: i32) -> usize {
    let unix: HashSet<String> = std::fs::read_to_string("/proc/net/unix")
        .expect("/proc/net/unix")
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().nth(6).map(str::to_string))
        .collect();
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fd dir")
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|t| {
            let t = t.to_string_lossy().into_owned();
            Some(t.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .filter(|inode| unix.contains(inode))
        .count()
}

// One test: the socket counts are of the whole node, so nothing else may run meanwhile.
#[tokio::test(flavor = "multi_thread")]
async fn connections_and_child_signals() {
    if !require_root() {
        return;
    }
    sequential_requests_share_one_connection_and_none_outlive_the_sandbox().await;
    sigchld_is_blocked_in_the_agent_only().await;
}

async fn sequential_requests_share_one_connection_and_none_outlive_the_sandbox() {
    let s = server();
    let pid = s.pid().expect("server pid");
    let c = s.client();
    let before = unix_sockets(pid);
    let sb = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect("create");
    for i in 0..30 {
        let r = c
            .exec(&sb.id, sh(&format!("echo {i}")))
            .await
            .expect("exec");
        assert_eq!(r.stdout, format!("{i}\n"), "{r:?}");
        c.stat_file(&sb.id, "/etc/hostname").await.expect("stat");
    }
    // The agent (PID 1 inside) holds its listener and the one connection the node kept
    // for the next request: not one per request, and not none.
    let agent = agent_on_host(&sb.id);
    let agent_sockets = unix_sockets(agent);
    assert_eq!(agent_sockets, 2, "agent sockets after 60 requests");
    let node = unix_sockets(pid);
    assert!(
        node <= before + 1,
        "node unix sockets: {before} before the sandbox, {node} after 60 requests"
    );

    // A request with input gets a connection that ends with it; the next one works.
    let mut with_input = sh("cat");
    with_input.stdin = Some("piped".into());
    let r = c.exec(&sb.id, with_input).await.expect("exec with stdin");
    assert_eq!(r.stdout, "piped", "{r:?}");
    let r = c.exec(&sb.id, sh("echo after")).await.expect("exec");
    assert_eq!(r.stdout, "after\n", "{r:?}");

    // Concurrent requests each get a connection, and each its own answer.
    let runs: Vec<_> = (0..8)
        .map(|i| {
            let c = c.clone();
            let id = sb.id.clone();
            tokio::spawn(async move { c.exec(&id, sh(&format!("sleep 0.2; echo {i}"))).await })
        })
        .collect();
    for (i, run) in runs.into_iter().enumerate() {
        let r = run.await.expect("join").expect("concurrent exec");
        assert_eq!(r.stdout, format!("{i}\n"), "{r:?}");
    }
    let node = unix_sockets(pid);
    assert!(
        node <= before + 1,
        "node unix sockets after concurrent requests: {node} (before: {before})"
    );

    c.delete_sandbox(&sb.id).await.expect("delete");
    let settled = wait_until(Duration::from_secs(5), || async {
        (unix_sockets(pid) <= before).then_some(())
    })
    .await;
    assert!(
        settled.is_some(),
        "node unix sockets after the delete: {} (before: {before})",
        unix_sockets(pid)
    );
}

/// The host pid of the sandbox's init (PID 1 inside), the agent.
fn agent_on_host(id: &str) -> i32 {
    host::processes(id)
        .into_iter()
        .find(|p| {
            std::fs::read_to_string(format!("/proc/{p}/status")).is_ok_and(|st| {
                st.lines()
                    .any(|l| l.starts_with("NSpid:") && l.ends_with("\t1"))
            })
        })
        .expect("the sandbox's init on the host")
}

/// `SigBlk` of a process as a mask.
fn sigblk(status: &str) -> u64 {
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("SigBlk:"))
        .unwrap_or_else(|| panic!("no SigBlk in {status}"));
    u64::from_str_radix(hex.trim(), 16).expect("SigBlk hex")
}

async fn sigchld_is_blocked_in_the_agent_only() {
    let c = server().client();
    let sb = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect("create");
    let sigchld_bit = 1u64 << (libc::SIGCHLD - 1);
    c.exec(&sb.id, sh("true")).await.expect("exec");
    // Read from the host while the agent is idle: a command that reads /proc/1/status
    // itself races the agent's spawn, whose thread blocks every signal around the vfork
    // until it is back from it (the child may run before its parent resumes).
    let agent = agent_on_host(&sb.id);
    for task in std::fs::read_dir(format!("/proc/{agent}/task")).expect("agent threads") {
        let task = task.expect("task").path();
        let Ok(status) = std::fs::read_to_string(task.join("status")) else {
            continue; // a thread that just ended
        };
        let name = std::fs::read_to_string(task.join("comm")).unwrap_or_default();
        let mask = sigblk(&status);
        if name.trim() == "detach-old-root" {
            continue; // blocks everything by design, and is gone after the first start
        }
        assert_eq!(
            mask,
            sigchld_bit,
            "agent thread {} ({}) blocks SIGCHLD and nothing else",
            task.display(),
            name.trim()
        );
    }
    let own = c
        .exec(&sb.id, sh("cat /proc/self/status"))
        .await
        .expect("exec");
    assert_eq!(sigblk(&own.stdout), 0, "an exec'd command blocks nothing");
    let session = c
        .create_session(&sb.id, CreateSessionRequest::default())
        .await
        .expect("session");
    let r = c
        .run_in_session(
            &sb.id,
            &session.session,
            SessionRunRequest {
                command: "cat /proc/self/status".into(),
                timeout_s: None,
                request_id: None,
            },
        )
        .await
        .expect("session run");
    assert_eq!(sigblk(&r.output), 0, "a session's command blocks nothing");
    // Children are still reaped promptly: many short execs in a row each see their exit.
    for _ in 0..20 {
        let r = c.exec(&sb.id, sh("exit 3")).await.expect("exec");
        assert_eq!(r.exit.exit_code, Some(3), "{r:?}");
    }
    c.delete_sandbox(&sb.id).await.expect("delete");
}

//! Restart of `dsec serve` (SIGKILL, as in a crash) with 20 live sandboxes: all are
//! re-adopted with their processes and files, and still usable afterwards.

use std::collections::BTreeMap;
use std::time::Duration;

use dsec_e2e::{host, require_root, sh, Server};
use dsec_wire::v1::*;

#[tokio::test(flavor = "multi_thread")]
async fn restart_readopts_20_live_sandboxes() {
    if !require_root() {
        return;
    }
    let seed = Server::shared("restart-seed");
    // Its own cgroup parent: the seed server beside it holds the default one.
    let mut s = Server::start_with("restart", true, &["--cgroup-parent", "dsec-restart"])
        .await
        .expect("server");
    s.ensure_base(Some(seed)).await.expect("base image");
    let c = s.client();
    let mut ids = Vec::new();
    for i in 0..20 {
        let sb = c
            .create_sandbox(CreateSandboxRequest::default())
            .await
            .expect("create");
        // A background process and a file: state that must survive the restart.
        let r = c
            .exec(
                &sb.id,
                sh(&format!(
                    "echo {i} > /root/n; setsid -f sleep 1000; echo started"
                )),
            )
            .await
            .expect("exec");
        assert_eq!(r.stdout, "started\n");
        ids.push(sb.id);
    }
    let sess = c
        .create_session(&ids[0], CreateSessionRequest::default())
        .await
        .expect("session");
    c.run_in_session(
        &ids[0],
        &sess.session,
        SessionRunRequest {
            command: "export KEEP=yes; cd /tmp".into(),
            timeout_s: None,
            request_id: None,
        },
    )
    .await
    .expect("session run");
    // One sandbox paused, one committed once: both must carry over the restart.
    c.pause_sandbox(&ids[1]).await.expect("pause");
    c.commit_sandbox(&ids[2], "e2e/restart-c1")
        .await
        .expect("commit before restart");
    let pids_before: Vec<Vec<i32>> = ids.iter().map(|id| host::processes(id)).collect();

    s.kill();
    // Sandboxes keep running while the server is down.
    for (id, before) in ids.iter().zip(&pids_before) {
        assert_eq!(
            &host::processes(id),
            before,
            "{id} changed while the server was down"
        );
    }
    s.spawn().await.expect("restart");
    let c = s.client();
    let listed = c.list_sandboxes(BTreeMap::new()).await.expect("list");
    assert_eq!(listed.sandboxes.len(), 20);
    // The paused one is still paused (its cgroup stayed frozen) and resumes.
    assert_eq!(
        c.get_sandbox(&ids[1]).await.expect("get").state,
        SandboxState::Paused
    );
    let e = c.exec(&ids[1], sh("true")).await.expect_err("paused");
    assert_eq!(e.code(), Some(dsec_wire::ErrorCode::Paused));
    c.resume_sandbox(&ids[1])
        .await
        .expect("resume after restart");
    for (i, id) in ids.iter().enumerate() {
        let sb = c.get_sandbox(id).await.expect("get");
        assert_eq!(sb.state, SandboxState::Ready, "{id}");
        let r = c
            .exec(id, sh("cat /root/n; pgrep -c sleep"))
            .await
            .expect("exec after restart");
        assert_eq!(r.stdout, format!("{i}\n1\n"), "{id}");
    }
    let r = c
        .run_in_session(
            &ids[0],
            &sess.session,
            SessionRunRequest {
                command: "echo $KEEP $(pwd)".into(),
                timeout_s: None,
                request_id: None,
            },
        )
        .await
        .expect("session after restart");
    assert_eq!(r.output, "yes /tmp\n");

    // A second commit after the restart: the node lost its disk handle and mounts the
    // sandbox's disk again; the commit is incremental over the first.
    c.exec(&ids[2], sh("echo after > /root/after"))
        .await
        .expect("exec");
    let img = c
        .commit_sandbox(&ids[2], "e2e/restart-c2")
        .await
        .expect("commit after restart");
    let first = c.list_images().await.expect("images").images;
    let c1 = first
        .iter()
        .find(|i| i.name == "e2e/restart-c1")
        .expect("first commit");
    assert_eq!(img.layers.len(), c1.layers.len() + 1);
    let from = c
        .create_sandbox(CreateSandboxRequest {
            image: Some("e2e/restart-c2".into()),
            ..Default::default()
        })
        .await
        .expect("create from commit");
    let r = c
        .exec(&from.id, sh("cat /root/n /root/after"))
        .await
        .expect("exec");
    assert_eq!(r.stdout, "2\nafter\n");
    c.delete_sandbox(&from.id).await.expect("delete");
    for name in ["e2e/restart-c2", "e2e/restart-c1"] {
        c.delete_image(name).await.expect("delete image");
    }
    for id in &ids {
        c.delete_sandbox(id).await.expect("delete");
        assert!(
            host::processes(id).is_empty() && host::cgroup_dirs(id).is_empty(),
            "{id} leaked"
        );
    }
}

/// The pids of `parent`'s children whose command line has `arg` as an argument.
fn children_with_arg(parent: i32, arg: &str) -> Vec<i32> {
    let needle = format!("\0{arg}\0");
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // Field 4, after the parenthesised command name.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<i32>().ok());
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            ppid == Some(parent) && String::from_utf8_lossy(&cmd).contains(&needle)
        })
        .collect()
}

/// Whether `pid` is gone (or only a zombie waiting for its parent).
fn gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => true,
    }
}

/// Inits are forked from the node's zygote; one that dies is replaced on the next create,
/// and it does not outlive its node. Signals the node's launcher ignored (`nohup`, a
/// script's background job) do not reach the commands sandboxes run.
#[tokio::test(flavor = "multi_thread")]
async fn inits_fork_from_a_zygote_that_is_replaced_when_lost_and_dies_with_its_node() {
    if !require_root() {
        return;
    }
    let seed = Server::shared("restart-seed");
    let mut s = Server::start_ignoring(
        "zygote",
        true,
        &["--cgroup-parent", "dsec-zygote"],
        &[libc::SIGHUP, libc::SIGINT, libc::SIGQUIT],
    )
    .await
    .expect("server");
    s.ensure_base(Some(seed)).await.expect("base image");
    let c = s.client();
    let node = s.pid().expect("server pid");
    let zygotes = children_with_arg(node, "zygote");
    assert_eq!(zygotes.len(), 1, "one zygote: {zygotes:?}");
    let first = zygotes[0];

    let a = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect("create");
    let r = c
        .exec(
            &a.id,
            sh("tr '\\0' ' ' < /proc/1/cmdline; echo; sed -n 's/^SigIgn:\\t//p' /proc/self/status"),
        )
        .await
        .expect("exec");
    assert_eq!(r.exit.exit_code, Some(0), "{r:?}");
    let (cmdline, ignored) = r.stdout.split_once('\n').expect("two lines");
    assert_eq!(
        cmdline, "dsec-agent init ",
        "PID 1 is named as an exec'd init"
    );
    // All 64, glibc's own 32 and 33 too (its posix_spawn would leave those ignored).
    let ignored = u64::from_str_radix(ignored.trim(), 16).expect("SigIgn");
    assert_eq!(ignored, 0, "commands ignore no signal: {ignored:x}");
    assert!(
        !s.log().contains("exec'ing init"),
        "forked, not exec'd: {}",
        s.log()
    );

    // A lost zygote is replaced by the next create, which succeeds.
    // SAFETY: kill with a pid and a signal.
    unsafe { libc::kill(first, libc::SIGKILL) };
    let b = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect("create after the zygote died");
    let r = c.exec(&b.id, sh("echo ok")).await.expect("exec");
    assert_eq!(r.stdout, "ok\n");
    let zygotes = children_with_arg(node, "zygote");
    assert_eq!(zygotes.len(), 1, "a new zygote: {zygotes:?}");
    assert_ne!(zygotes[0], first);
    assert!(gone(first), "the old zygote was reaped");
    assert!(
        s.log().contains("zygote lost; restarting it"),
        "{}",
        s.log()
    );

    // The zygote ends with its node (a crash here); the sandboxes do not.
    let second = zygotes[0];
    s.kill();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !gone(second) && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(gone(second), "the zygote outlived its node");
    s.spawn().await.expect("restart");
    let c = s.client();
    for id in [&a.id, &b.id] {
        let r = c
            .exec(id, sh("echo still"))
            .await
            .expect("exec after restart");
        assert_eq!(r.stdout, "still\n");
        c.delete_sandbox(id).await.expect("delete");
        assert!(host::processes(id).is_empty(), "{id} left processes");
    }
}

/// The names the graceful-stop test's node uses, and where it leaves traces.
struct Traces {
    parent: &'static str,
    table: &'static str,
    prefix: &'static str,
}

const STOP: Traces = Traces {
    parent: "dsec-stop",
    table: "dsec_e2e_stop",
    prefix: "dsestop",
};

impl Traces {
    fn args(&self) -> Vec<&'static str> {
        vec![
            "--cgroup-parent",
            self.parent,
            "--nft-table",
            self.table,
            "--link-prefix",
            self.prefix,
            "--sandbox-subnet",
            "10.239.0.0/16",
            "--dns-port",
            "15390",
            "--dns-upstream",
            "127.0.0.1:53",
            "--net-pool",
            "2",
        ]
    }

    /// The node's cgroup parent directories in every hierarchy.
    fn cgroup_parents(&self) -> Vec<String> {
        let mut dirs: Vec<std::path::PathBuf> = std::fs::read_dir("/sys/fs/cgroup")
            .map(|d| d.flatten().map(|e| e.path().join(self.parent)).collect())
            .unwrap_or_default();
        dirs.push(std::path::Path::new("/sys/fs/cgroup").join(self.parent));
        dirs.into_iter()
            .filter(|d| d.is_dir())
            .map(|d| d.display().to_string())
            .collect()
    }

    /// The slot chains (`sN`) of the node's nftables table; `None` without a table.
    fn chains(&self) -> Option<Vec<String>> {
        let out = std::process::Command::new("nft")
            .args(["list", "table", "inet", self.table])
            .output()
            .expect("nft");
        if !out.status.success() {
            return None;
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let mut chains: Vec<String> = text
            .lines()
            .filter_map(|l| l.trim().strip_prefix("chain s")?.strip_suffix(" {"))
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
            .map(|n| format!("s{n}"))
            .collect();
        chains.sort();
        Some(chains)
    }

    /// Host links with the node's prefix.
    fn links(&self) -> Vec<String> {
        let mut links: Vec<String> = std::fs::read_dir("/sys/class/net")
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with(self.prefix))
                    .collect()
            })
            .unwrap_or_default();
        links.sort();
        links
    }

    fn claim_file(&self) -> std::path::PathBuf {
        std::path::Path::new("/run/dsec-claims").join(format!("cgroup parent-{}", self.parent))
    }

    /// Asserts that nothing of the node is left on the host but its state directory.
    fn assert_none(&self, s: &Server, when: &str) {
        let mounted = std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .any(|l| l.split(' ').nth(4) == s.run_dir.to_str());
        assert!(!mounted, "{when}: run directory still mounted");
        assert!(!s.run_dir.exists(), "{when}: run directory left");
        let state = format!("{}/", s.state_dir.display());
        let under_state: Vec<String> = std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .filter(|m| m.starts_with(&state))
            .map(str::to_string)
            .collect();
        assert!(
            under_state.is_empty(),
            "{when}: mounts left under the state directory: {under_state:?}"
        );
        assert_eq!(
            self.cgroup_parents(),
            Vec::<String>::new(),
            "{when}: cgroups left"
        );
        assert_eq!(self.chains(), None, "{when}: nftables table left");
        assert_eq!(self.links(), Vec::<String>::new(), "{when}: links left");
        assert!(!self.claim_file().exists(), "{when}: claim file left");
    }
}

/// A graceful stop (SIGTERM) keeps what live sandboxes need, but no pooled slot; with
/// no sandbox left it leaves nothing of the node on the host; `dsec serve --cleanup`
/// removes every trace after a crash.
#[tokio::test(flavor = "multi_thread")]
async fn a_graceful_stop_leaves_nothing_once_no_sandbox_is_left() {
    if !require_root() {
        return;
    }
    let seed = Server::shared("restart-seed");
    let _ = std::process::Command::new("nft")
        .args(["delete", "table", "inet", STOP.table])
        .stderr(std::process::Stdio::null())
        .status();
    let mut s = Server::start_with("stop", true, &STOP.args())
        .await
        .expect("server");
    s.ensure_base(Some(seed)).await.expect("base image");
    let open = || CreateSandboxRequest {
        network: NetworkPolicy {
            mode: NetworkMode::Open,
            allow: Vec::new(),
        },
        ..Default::default()
    };
    let c = s.client();
    let a = c.create_sandbox(open()).await.expect("create");
    // The pool refills behind the create that took its slot.
    let refilled = dsec_e2e::wait_until(Duration::from_secs(10), || async {
        STOP.chains().filter(|c| c.len() > 1)
    })
    .await;
    assert!(
        refilled.is_some(),
        "the sandbox's chain and the pool's: {:?}",
        STOP.chains()
    );

    // With a live sandbox: what it needs stays, the pool's slots go.
    let status = s.terminate(Duration::from_secs(30)).expect("stopped");
    assert!(status.success(), "{status:?}: {}", s.log());
    assert_eq!(
        STOP.chains().map(|c| c.len()),
        Some(1),
        "only the sandbox's chain"
    );
    assert_eq!(
        STOP.links().len(),
        1,
        "only the sandbox's link: {:?}",
        STOP.links()
    );
    assert!(!host::processes(&a.id).is_empty(), "the sandbox lives on");
    assert!(!STOP.cgroup_parents().is_empty());
    assert!(!STOP.claim_file().exists(), "claim file left");

    s.spawn().await.expect("restart");
    let c = s.client();
    let r = c.exec(&a.id, sh("echo still")).await.expect("exec");
    assert_eq!(r.stdout, "still\n");
    c.delete_sandbox(&a.id).await.expect("delete");
    let status = s.terminate(Duration::from_secs(30)).expect("stopped");
    assert!(status.success(), "{status:?}: {}", s.log());
    STOP.assert_none(&s, "graceful stop with no sandbox");

    // A crash with a live sandbox, then the cleanup.
    s.spawn().await.expect("restart");
    let b = s.client().create_sandbox(open()).await.expect("create");
    s.kill();
    let out = s.cleanup().expect("cleanup");
    assert!(
        out.status.success(),
        "{:?}: {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(host::processes(&b.id).is_empty(), "the sandbox was deleted");
    STOP.assert_none(&s, "dsec serve --cleanup");

    // The same as a cluster node (`dsec node`, which keeps no records).
    s.spawn().await.expect("restart");
    let d = s.client().create_sandbox(open()).await.expect("create");
    s.kill();
    let out = s.cleanup_as("node").expect("node cleanup");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{:?}: {stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains(&d.id), "{stdout}");
    assert!(
        host::processes(&d.id).is_empty(),
        "the sandbox was destroyed"
    );
    STOP.assert_none(&s, "dsec node --cleanup");
}

//! Isolation level `gvisor`: the same agent contract under gVisor's `runsc` (Debian's
//! package), on the platform the node detected: commands see gVisor's kernel, files,
//! sessions, processes, pause and resume work as at the default level, a node restart
//! adopts the sandbox, what the level does not offer is refused up front, and a delete
//! leaves nothing behind.

use dsec_e2e::{host, require_root, sh, Server};
use dsec_wire::v1::*;
use dsec_wire::ErrorCode;

fn runsc_list(run_dir: &std::path::Path) -> String {
    let out = std::process::Command::new("runsc")
        .arg("--root")
        .arg(run_dir.join("gvisor"))
        .arg("list")
        .output()
        .expect("runsc list");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Whether runsc is installed; under CI it must be (the test packages install it).
fn have_runsc() -> bool {
    let found = std::process::Command::new("runsc")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            std::env::var_os("CI").is_none(),
            "runsc is not installed (apt-get install runsc)"
        );
        eprintln!("skipped: runsc is not installed (apt-get install runsc)");
    }
    found
}

#[tokio::test(flavor = "multi_thread")]
async fn a_gvisor_sandbox_keeps_the_agent_contract_survives_a_restart_and_leaves_nothing() {
    if !require_root() || !have_runsc() {
        return;
    }
    let mut s = Server::start_with(
        "gvisor",
        true,
        &["--cgroup-parent", "dsec-gvisor", "--disk-pool", "2"],
    )
    .await
    .expect("server");
    s.ensure_base(None).await.expect("base image");
    let c = s.client();
    let health = c.health().await.expect("health");
    let level = health
        .isolation
        .iter()
        .find(|l| l.isolation == Isolation::Gvisor)
        .unwrap_or_else(|| panic!("health lists gvisor: {:?}", health.isolation));
    let platform = level.platform.clone().unwrap_or_default();
    assert!(
        ["systrap", "ptrace"].contains(&platform.as_str()),
        "{level:?}"
    );

    let sb = c
        .create_sandbox(CreateSandboxRequest {
            isolation: Isolation::Gvisor,
            env: [("TASK".to_string(), "t1".to_string())].into(),
            ..Default::default()
        })
        .await
        .expect("create");
    assert_eq!(sb.isolation, Isolation::Gvisor);
    assert!(runsc_list(&s.run_dir).contains(&sb.id), "runsc runs it");
    // gVisor's kernel answers: its own release, not the host's.
    let r = c
        .exec(
            &sb.id,
            sh("tr '\\0' ' ' < /proc/1/cmdline; echo; hostname; echo $TASK; uname -r; echo hi > /tmp/f; cat /tmp/f"),
        )
        .await
        .expect("exec");
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert!(
        lines[0].starts_with("/.dsec/dsec-agent serve"),
        "{}",
        r.stdout
    );
    assert_eq!(&lines[1..3], [sb.id.as_str(), "t1"], "{r:?}");
    let host_release = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("release");
    assert_ne!(lines[3], host_release.trim(), "gVisor's kernel: {r:?}");
    assert_eq!(lines[4], "hi");

    // PID 1 (the agent) cannot be signalled from inside: gVisor's kernel would deliver
    // a SIGKILL that Linux ignores for a namespace's init.
    let r = c
        .exec(
            &sb.id,
            sh("kill -9 1; echo rc=$?; kill -STOP 1; echo rc=$?"),
        )
        .await
        .expect("exec");
    assert_eq!(r.stdout, "rc=1\nrc=1\n", "{r:?}");
    assert!(r.stderr.contains("Operation not permitted"), "{r:?}");

    // Files.
    c.write_file(&sb.id, "/work/in.txt", None, b"data".to_vec())
        .await
        .expect("upload");
    let r = c
        .exec(&sb.id, sh("cat /work/in.txt; echo more >> /work/in.txt"))
        .await
        .expect("exec");
    assert_eq!(r.stdout, "data");
    let (_, mut body) = c
        .read_file(&sb.id, "/work/in.txt", 0, None)
        .await
        .expect("download");
    let mut bytes = Vec::new();
    while let Some(chunk) = futures::StreamExt::next(&mut body).await {
        bytes.extend_from_slice(&chunk.expect("chunk"));
    }
    assert_eq!(bytes, b"datamore\n");
    // A session keeps its shell's state; a background process runs on.
    let session = c
        .create_session(&sb.id, CreateSessionRequest::default())
        .await
        .expect("session");
    let run = |command: &str| SessionRunRequest {
        command: command.into(),
        timeout_s: Some(30.0),
        request_id: None,
    };
    c.run_in_session(&sb.id, &session.session, run("cd /tmp; export X=42"))
        .await
        .expect("run");
    let p = c
        .start_process(
            &sb.id,
            dsec_e2e::background(Command::Shell("sleep 1000".into())),
        )
        .await
        .expect("process");
    // Pause and resume keep all of it.
    c.pause_sandbox(&sb.id).await.expect("pause");
    c.resume_sandbox(&sb.id).await.expect("resume");
    let r = c
        .run_in_session(&sb.id, &session.session, run("echo $X $(pwd)"))
        .await
        .expect("run");
    assert_eq!(r.output, "42 /tmp\n");
    let listed = c.list_processes(&sb.id).await.expect("processes");
    assert!(
        listed.processes.iter().any(|q| q.pid == p.pid),
        "{listed:?}"
    );

    // A crash of the node: the sandbox is adopted again.
    s.kill();
    s.spawn().await.expect("restart");
    let c = s.client();
    let r = c
        .exec(&sb.id, sh("cat /tmp/f"))
        .await
        .expect("exec after restart");
    assert_eq!(r.stdout, "hi\n");

    // Combinations the level does not offer are refused up front, saying why.
    let err = c
        .create_sandbox(CreateSandboxRequest {
            isolation: Isolation::Gvisor,
            network: NetworkPolicy {
                mode: NetworkMode::Open,
                allow: vec![],
            },
            ..Default::default()
        })
        .await
        .expect_err("network at level gvisor");
    assert_eq!(err.code(), Some(ErrorCode::BadRequest), "{err}");
    assert!(err.to_string().contains("isolation gvisor"), "{err}");

    c.delete_sandbox(&sb.id).await.expect("delete");
    assert!(!runsc_list(&s.run_dir).contains(&sb.id), "runsc forgot it");
    assert!(
        host::mounts(&sb.id).is_empty(),
        "{:?}",
        host::mounts(&sb.id)
    );
    assert!(host::cgroup_dirs(&sb.id).is_empty());
    assert!(host::processes(&sb.id).is_empty());
}

//! Isolation level `oci`: the same agent contract under the node's OCI runtime (runc).

use dsec_e2e::{host, require_root, sh, Server};
use dsec_wire::v1::*;
use dsec_wire::ErrorCode;

fn runc_list(run_dir: &std::path::Path) -> String {
    let out = std::process::Command::new("runc")
        .arg("--root")
        .arg(run_dir.join("oci"))
        .arg("list")
        .output()
        .expect("runc list");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn an_oci_sandbox_keeps_the_agent_contract_survives_a_restart_and_leaves_nothing() {
    if !require_root() {
        return;
    }
    let mut s = Server::start_with(
        "oci",
        true,
        &["--cgroup-parent", "dsec-oci", "--disk-pool", "2"],
    )
    .await
    .expect("server");
    s.ensure_base(None).await.expect("base image");
    let c = s.client();
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            isolation: Isolation::Oci,
            env: [("TASK".to_string(), "t1".to_string())].into(),
            ..Default::default()
        })
        .await
        .expect("create");
    assert_eq!(sb.isolation, Isolation::Oci);
    assert!(runc_list(&s.run_dir).contains(&sb.id), "runc runs it");
    let r = c
        .exec(
            &sb.id,
            sh("tr '\\0' ' ' < /proc/1/cmdline; echo; hostname; echo $TASK; echo hi > /tmp/f; cat /tmp/f"),
        )
        .await
        .expect("exec");
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert!(
        lines[0].starts_with("/.dsec/dsec-agent serve"),
        "{}",
        r.stdout
    );
    assert_eq!(&lines[1..], [sb.id.as_str(), "t1", "hi"]);
    // The agent's socket has no path inside (root there could put a fake agent in its
    // place), and the agent cannot be traced (it runs as root with our capabilities).
    let r = c
        .exec(
            &sb.id,
            sh("ls -A /.dsec; find / -xdev -type s | wc -l; grep -E '^(Uid|CapEff)' /proc/1/status;                 python3 -c 'import ctypes; print(ctypes.CDLL(None).ptrace(16, 1, None, None))'"),
        )
        .await
        .expect("exec");
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(lines[..2], ["dsec-agent", "0"], "{r:?}");
    assert!(lines[2].starts_with("Uid:\t0"), "{r:?}");
    assert_eq!(lines.last().copied(), Some("-1"), "PID 1 traceable: {r:?}");
    // dsec's seccomp policy is in the bundle: a user namespace needs no capability, so
    // only the filter stops it; the filter says so in the process's status too.
    let r = c
        .exec(
            &sb.id,
            sh("unshare --user true; echo rc=$?; grep -E '^Seccomp:' /proc/self/status"),
        )
        .await
        .expect("exec");
    assert!(r.stdout.contains("rc=1"), "{r:?}");
    assert!(r.stderr.contains("Operation not permitted"), "{r:?}");
    assert!(r.stdout.contains("Seccomp:\t2"), "{r:?}");
    // The attack suite's kernel interfaces program: every refusal holds here too,
    // including ioctl commands with their (ignored) high bits set.
    let program = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("attacks/kernel-interfaces.py"),
    )
    .expect("attack program");
    let mut attack = sh("");
    attack.cmd = Command::Argv(vec!["python3".into(), "-c".into(), program]);
    let r = c.exec(&sb.id, attack).await.expect("exec");
    assert_eq!(r.exit.exit_code, Some(0), "{r:?}");
    assert!(!r.stdout.contains("escaped:"), "{}", r.stdout);
    assert!(r.stdout.matches("contained:").count() >= 20, "{}", r.stdout);
    // Commands have their own OOM score from their first instruction on (the child
    // writes it before its exec here: no user namespace), also a child forked at once.
    for _ in 0..10 {
        let r = c
            .exec(&sb.id, sh("cat /proc/self/oom_score_adj; true"))
            .await
            .expect("exec");
        assert_eq!(r.stdout, "500\n", "{r:?}");
    }
    // Files, pause and resume as at the default level.
    c.write_file(&sb.id, "/work/in.txt", None, b"data".to_vec())
        .await
        .expect("upload");
    c.pause_sandbox(&sb.id).await.expect("pause");
    c.resume_sandbox(&sb.id).await.expect("resume");
    let r = c.exec(&sb.id, sh("cat /work/in.txt")).await.expect("exec");
    assert_eq!(r.stdout, "data");

    // A crash of the node: the container is adopted again.
    s.kill();
    s.spawn().await.expect("restart");
    let c = s.client();
    let r = c
        .exec(&sb.id, sh("cat /tmp/f"))
        .await
        .expect("exec after restart");
    assert_eq!(r.stdout, "hi\n");

    // Combinations the level does not offer are refused up front.
    let err = c
        .create_sandbox(CreateSandboxRequest {
            isolation: Isolation::Oci,
            network: NetworkPolicy {
                mode: NetworkMode::Open,
                allow: vec![],
            },
            ..Default::default()
        })
        .await
        .expect_err("network at level oci");
    assert_eq!(err.code(), Some(ErrorCode::BadRequest));

    c.delete_sandbox(&sb.id).await.expect("delete");
    assert!(!runc_list(&s.run_dir).contains(&sb.id), "runc forgot it");
    assert!(
        host::mounts(&sb.id).is_empty(),
        "{:?}",
        host::mounts(&sb.id)
    );
    assert!(host::cgroup_dirs(&sb.id).is_empty());
    assert!(host::processes(&sb.id).is_empty());
}

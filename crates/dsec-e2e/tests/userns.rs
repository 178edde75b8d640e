//! User namespace mode (`dsec serve --userns-base`): root in a sandbox is an unprivileged
//! uid on the host, while files keep their owners inside, through commits, and across
//! stacked layers with deletions and opaque directories.

use std::os::unix::fs::MetadataExt;

use dsec_e2e::{host, require_root, sh, Server};
use dsec_wire::v1::*;

const BASE: u32 = 500_000;

async fn run(c: &dsec_client::Client, id: &str, cmd: &str) -> ExecResult {
    let r = c
        .exec(id, sh(cmd))
        .await
        .unwrap_or_else(|e| panic!("exec {cmd:?}: {e}"));
    assert_eq!(r.exit.exit_code, Some(0), "{cmd}: {r:?}");
    r
}

#[tokio::test(flavor = "multi_thread")]
async fn root_inside_is_unprivileged_outside_and_files_keep_their_owners() {
    if !require_root() {
        return;
    }
    let s = Server::start_with(
        "userns",
        true,
        &[
            "--userns-base",
            &BASE.to_string(),
            "--cgroup-parent",
            "dsec-userns",
            "--disk-pool",
            "2",
        ],
    )
    .await
    .expect("server");
    s.ensure_base(None).await.expect("base image");
    let c = s.client();
    let sb = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect("create");

    // Inside: root, with the image's files owned by root.
    let r = run(
        &c,
        &sb.id,
        "id -u; cat /proc/self/uid_map; stat -c %u /etc/passwd; touch /tmp/mine; stat -c %u /tmp/mine",
    )
    .await;
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(lines[0], "0");
    assert_eq!(
        lines[1].split_whitespace().collect::<Vec<_>>(),
        ["0", &BASE.to_string(), "65536"]
    );
    assert_eq!((lines[2], lines[3]), ("0", "0"));

    // Outside: every process of the sandbox runs as the range's first uid.
    let pids = host::processes(&sb.id);
    assert!(!pids.is_empty());
    for pid in &pids {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
        let uid = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .expect("Uid line");
        assert!(
            uid.split_whitespace().all(|u| u == BASE.to_string()),
            "pid {pid}: Uid {uid}"
        );
    }

    // Files: owners as set inside, a deletion and an opaque directory, through a commit.
    run(
        &c,
        &sb.id,
        "mkdir -p /work && echo hi > /work/f && chown 1000:1001 /work/f && \
         rm /etc/issue && rm -rf /etc/apt && mkdir /etc/apt && echo only > /etc/apt/only",
    )
    .await;
    // The node's own view of the disk holds the ids as inside (0-based), not shifted.
    let committed = c
        .commit_sandbox(&sb.id, "userns-commit")
        .await
        .expect("commit");
    assert_eq!(committed.layers.len(), 2);
    let layer_mnt = s.state_dir.join("images/blobs/sha256").join(format!(
        "{}.erofs",
        committed.layers[1].trim_start_matches("sha256:")
    ));
    assert!(
        layer_mnt.exists(),
        "diff layer blob {}",
        layer_mnt.display()
    );
    let again = c
        .create_sandbox(CreateSandboxRequest {
            image: Some("userns-commit".into()),
            ..Default::default()
        })
        .await
        .expect("create from commit");
    let r = run(
        &c,
        &again.id,
        "stat -c '%u:%g' /work/f; cat /work/f; ls /etc/issue 2>&1 | grep -c 'No such'; ls /etc/apt",
    )
    .await;
    assert_eq!(r.stdout, "1000:1001\nhi\n1\nonly\n");

    // A networked sandbox in the namespace: its interfaces, and /sys without the host's.
    let net = c
        .create_sandbox(CreateSandboxRequest {
            network: NetworkPolicy {
                mode: NetworkMode::Allowlist,
                allow: vec![],
            },
            ..Default::default()
        })
        .await
        .expect("networked");
    let r = run(&c, &net.id, "cat /proc/net/dev; ls /sys | wc -l; id -u").await;
    assert!(r.stdout.contains("eth0:"), "{}", r.stdout);
    assert!(r.stdout.ends_with("0\n0\n"), "{}", r.stdout);

    // The writable disk's files on the host side are 0-based too (what packdiff reads).
    let upper_owner = std::fs::metadata(s.state_dir.join("sandboxes").join(&sb.id))
        .map(|m| m.uid())
        .expect("sandbox dir");
    assert_eq!(upper_owner, 0, "sandbox directory stays the node's");

    for id in [&sb.id, &again.id, &net.id] {
        c.delete_sandbox(id).await.expect("delete");
    }
    for id in [&sb.id, &again.id, &net.id] {
        assert!(host::processes(id).is_empty(), "{id} left processes");
    }
}

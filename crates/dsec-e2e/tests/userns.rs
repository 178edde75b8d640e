//! User namespace mode (`dsec serve --userns-base`): root in a sandbox is an unprivileged
//! uid on the host, while files keep their owners inside, through commits, and across
//! stacked layers with deletions and opaque directories. Each sandbox gets a uid range of
//! its own (kept across a node restart), or shares one per tenant label or per node.

use std::os::unix::fs::MetadataExt;

use dsec_e2e::{host, require_root, sh, Server};
use dsec_wire::v1::*;

const BASE: u32 = 500_000;
const RANGE: u32 = 65_536;

/// The host range (first id) of a sandbox's user namespace, read from its processes'
/// uid map; every process of the sandbox must agree.
fn host_range(id: &str) -> u32 {
    let pids = host::processes(id);
    assert!(!pids.is_empty(), "{id} has no processes");
    let ranges: std::collections::BTreeSet<(u32, u32)> = pids
        .iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/uid_map")).ok())
        .map(|map| {
            let f: Vec<u32> = map
                .split_whitespace()
                .map(|n| n.parse().expect("uid_map number"))
                .collect();
            assert_eq!(
                (f.len(), f[0], f[2]),
                (3, 0, RANGE),
                "{id}: uid_map {map:?}"
            );
            (f[1], f[2])
        })
        .collect();
    assert_eq!(
        ranges.len(),
        1,
        "{id}: processes in several ranges {ranges:?}"
    );
    ranges
        .into_iter()
        .next()
        .map(|(base, _)| base)
        .unwrap_or_default()
}

/// Whether a host process with `uid` (and the same gid, no groups) may signal `pid`.
fn may_signal(uid: u32, pid: i32) -> bool {
    std::process::Command::new("setpriv")
        .args([
            &format!("--reuid={uid}"),
            &format!("--regid={uid}"),
            "--clear-groups",
            "kill",
            "-0",
            &pid.to_string(),
        ])
        .stderr(std::process::Stdio::null())
        .status()
        .expect("setpriv")
        .success()
}

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
    // A range of the node's: one from its base upwards (which one depends on what the
    // node's namespace pool took first).
    let map: Vec<&str> = lines[1].split_whitespace().collect();
    let first: u32 = map[1].parse().expect("host uid");
    assert_eq!((map[0], map[2]), ("0", "65536"), "{map:?}");
    assert!(
        first >= BASE && (first - BASE).is_multiple_of(RANGE),
        "{first}"
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
            uid.split_whitespace().all(|u| u == first.to_string()),
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

    // Each sandbox has a range of its own, from the node's base upwards: root of one
    // sandbox cannot even signal another's processes (it could with one shared range).
    let ranges: Vec<u32> = [&sb.id, &again.id, &net.id]
        .iter()
        .map(|id| host_range(id))
        .collect();
    assert_eq!(ranges[0], first);
    for (i, r) in ranges.iter().enumerate() {
        assert!(*r >= BASE && (r - BASE).is_multiple_of(RANGE), "{r}");
        assert!(
            !ranges[..i].contains(r),
            "range {r} given twice: {ranges:?}"
        );
    }
    let target = host::processes(&sb.id)[0];
    assert!(may_signal(ranges[0], target), "same range: allowed");
    assert!(!may_signal(ranges[1], target), "another sandbox's root");

    // A restarted node keeps the live sandboxes' ranges and hands new ones out elsewhere.
    let mut s = s;
    s.kill();
    s.spawn().await.expect("restart");
    let c = s.client();
    let after = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect("create after restart");
    let fresh = host_range(&after.id);
    assert!(!ranges.contains(&fresh), "range {fresh} given twice");
    run(&c, &after.id, "id -u").await;

    for id in [&sb.id, &again.id, &net.id, &after.id] {
        c.delete_sandbox(id).await.expect("delete");
    }
    for id in [&sb.id, &again.id, &net.id, &after.id] {
        assert!(host::processes(id).is_empty(), "{id} left processes");
    }
}

/// `--userns-scope label:tenant`: sandboxes of one tenant share a range, other tenants and
/// unlabelled sandboxes get their own; `--userns-scope node`: all share the first one.
#[tokio::test(flavor = "multi_thread")]
async fn ranges_are_shared_per_tenant_label_or_per_node_when_configured() {
    if !require_root() {
        return;
    }
    const LABEL_BASE: u32 = 40_000_000;
    let s = Server::start_with(
        "userns-label",
        true,
        &[
            "--userns-base",
            &LABEL_BASE.to_string(),
            "--userns-scope",
            "label:tenant",
            "--cgroup-parent",
            "dsec-userns-label",
            "--no-network",
        ],
    )
    .await
    .expect("server");
    s.ensure_base(None).await.expect("base image");
    let c = s.client();
    let make = |tenant: Option<&str>| {
        let c = c.clone();
        let labels = tenant
            .map(|t| [("tenant".to_string(), t.to_string())].into())
            .unwrap_or_default();
        async move {
            c.create_sandbox(CreateSandboxRequest {
                labels,
                ..Default::default()
            })
            .await
            .expect("create")
            .id
        }
    };
    let a = make(Some("t1")).await;
    let b = make(Some("t1")).await;
    let other = make(Some("t2")).await;
    let plain = make(None).await;
    let (ra, rb, ro, rp) = (
        host_range(&a),
        host_range(&b),
        host_range(&other),
        host_range(&plain),
    );
    assert_eq!(ra, rb, "one tenant, one range");
    assert_eq!(
        std::collections::BTreeSet::from([ra, ro, rp]).len(),
        3,
        "{ra} {ro} {rp}"
    );
    for r in [ra, ro, rp] {
        assert!(
            r >= LABEL_BASE && (r - LABEL_BASE).is_multiple_of(RANGE),
            "{r}"
        );
    }
    assert!(may_signal(ra, host::processes(&b)[0]), "same tenant");
    assert!(!may_signal(ro, host::processes(&a)[0]), "other tenant");
    for id in [&a, &b, &other, &plain] {
        c.delete_sandbox(id).await.expect("delete");
    }

    // Scope node: one range for everything, the first.
    let n = Server::start_with(
        "userns-node",
        true,
        &[
            "--userns-base",
            &LABEL_BASE.to_string(),
            "--userns-scope",
            "node",
            "--cgroup-parent",
            "dsec-userns-node",
            "--no-network",
        ],
    )
    .await
    .expect("node-scope server");
    n.ensure_base(Some(&s)).await.expect("base image");
    let c = n.client();
    let x = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect("x");
    let y = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .expect("y");
    assert_eq!(
        (host_range(&x.id), host_range(&y.id)),
        (LABEL_BASE, LABEL_BASE)
    );
    for id in [&x.id, &y.id] {
        c.delete_sandbox(id).await.expect("delete");
    }

    // A bad scope is refused at start, with the accepted forms named.
    let out = std::process::Command::new(dsec_e2e::dsec_bin())
        .args(["serve", "--userns-scope", "tenant"])
        .output()
        .expect("dsec serve");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("sandbox, node or label:KEY"), "{err}");
}

//! Pooled network namespaces (network mode `none`): a sandbox gets a namespace made
//! ahead, with loopback up and a real `/sys` (it belongs to the sandbox's user
//! namespace); a deleted sandbox's namespace serves another only when nothing of it is
//! left there (no socket, no TCP `TIME_WAIT`).

use dsec_client::Client;
use dsec_e2e::{require_root, sh, Server};
use dsec_wire::v1::*;

async fn run(c: &Client, id: &str, cmd: &str) -> String {
    let r = c
        .exec(id, sh(cmd))
        .await
        .unwrap_or_else(|e| panic!("exec {cmd:?}: {e}"));
    assert_eq!(r.exit.exit_code, Some(0), "{cmd}: {r:?}");
    r.stdout
}

/// The sandbox's network namespace and its loopback's received bytes.
async fn netns_of(c: &Client, id: &str) -> (String, u64) {
    let out = run(
        c,
        id,
        "readlink /proc/self/ns/net; awk '$1 == \"lo:\" {print $2}' /proc/net/dev",
    )
    .await;
    let mut lines = out.lines();
    let ns = lines.next().expect("ns").to_string();
    let rx = lines
        .next()
        .and_then(|l| l.trim().parse().ok())
        .expect("lo rx");
    (ns, rx)
}

#[tokio::test(flavor = "multi_thread")]
async fn namespaces_are_made_ahead_and_reused_only_when_nothing_is_left() {
    if !require_root() {
        return;
    }
    let seed = Server::shared("netns-pool-seed");
    // One entry: which namespace the next create gets follows from the steps below.
    let s = Server::start_with(
        "netns-pool",
        true,
        &["--cgroup-parent", "dsec-netns-pool", "--netns-pool", "1"],
    )
    .await
    .expect("server");
    s.ensure_base(Some(seed)).await.expect("base image");
    let c = s.client();
    let create = || c.create_sandbox(CreateSandboxRequest::default());

    // A: loopback is up, /sys shows the namespace's own interfaces (real sysfs).
    let a = create().await.expect("create a");
    let out = run(
        &c,
        &a.id,
        "ls /sys/class/net; cat /sys/class/net/lo/operstate",
    )
    .await;
    assert_eq!(out, "lo\nunknown\n", "{out}");
    // Traffic that leaves no socket behind: a datagram to a closed port.
    run(
        &c,
        &a.id,
        "python3 -c 'import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\
         .sendto(b\"x\", (\"127.0.0.1\", 9))'",
    )
    .await;
    let (a_ns, a_rx) = netns_of(&c, &a.id).await;
    assert!(a_rx > 0, "loopback carried the datagram");
    c.delete_sandbox(&a.id).await.expect("delete a");

    // B and C take the pool's entries: the one made while A ran and A's own.
    let b = create().await.expect("create b");
    let cc = create().await.expect("create c");
    let (b_ns, b_rx) = netns_of(&c, &b.id).await;
    let (c_ns, c_rx) = netns_of(&c, &cc.id).await;
    assert!(
        b_ns == a_ns || c_ns == a_ns,
        "A's namespace reused: {a_ns} {b_ns} {c_ns}"
    );
    assert_ne!(b_ns, c_ns);
    // What reuse does not reset: loopback's counters.
    let (reused, fresh_rx) = if b_ns == a_ns {
        (b_rx, c_rx)
    } else {
        (c_rx, b_rx)
    };
    assert!(reused >= a_rx);
    assert_eq!(fresh_rx, 0, "a fresh namespace");

    // D leaves a TCP TIME_WAIT (its client closes first): its namespace is not reused.
    let d = create().await.expect("create d");
    let out = run(
        &c,
        &d.id,
        "python3 -c '\nimport socket\ns = socket.socket(); s.bind((\"127.0.0.1\", 0)); s.listen()\n\
         cl = socket.create_connection(s.getsockname()); a, _ = s.accept()\n\
         cl.close(); a.close(); s.close()\n'; grep -o \"tw [0-9]*\" /proc/net/sockstat",
    )
    .await;
    assert_eq!(out, "tw 1\n", "{out}");
    for id in [&b.id, &cc.id, &d.id] {
        c.delete_sandbox(id).await.expect("delete");
    }
    // Whatever the next sandboxes get, it is not D's namespace (for a minute, any
    // namespace of D's would show the TIME_WAIT).
    for _ in 0..3 {
        let e = create().await.expect("create e");
        let out = run(
            &c,
            &e.id,
            "grep -o \"tw [0-9]*\" /proc/net/sockstat; readlink /proc/self/ns/net",
        )
        .await;
        assert!(
            out.starts_with("tw 0\n"),
            "a namespace with a TIME_WAIT was reused: {out}"
        );
        c.delete_sandbox(&e.id).await.expect("delete e");
    }
    drop(s);
}

//! Real namespaces, links and nftables: a slot is wired, reaches what its policy allows
//! through the node, is refused the node itself, and leaves nothing behind.

use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

use dsec_net::{NetConfig, Network};
use dsec_wire::v1::{NetworkMode, NetworkPolicy};
use nix::sched::{setns, CloneFlags};

fn require_root() -> bool {
    dsec_testkit::require_root("network slot tests")
}

/// Runs `f` on a thread inside network namespace `ns`.
fn inside<T: Send>(ns: &OwnedFd, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            setns(ns.as_fd(), CloneFlags::CLONE_NEWNET).expect("setns");
            f()
        })
        .join()
        .expect("thread")
    })
}

fn connect(addr: SocketAddr) -> std::io::Result<TcpStream> {
    TcpStream::connect_timeout(&addr, Duration::from_secs(3))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_is_wired_filtered_and_released() {
    if !require_root() {
        return;
    }
    let cfg = NetConfig {
        subnet: (Ipv4Addr::new(10, 233, 0, 0), 24),
        table: "dsec_slot_test".into(),
        link_prefix: "dst".into(),
        dns_port: 15399,
        upstream: Some("127.0.0.1:9".parse().expect("addr")),
        pool_size: 1,
    };
    let net = Network::start(cfg.clone(), &[]).expect("start");
    let open = NetworkPolicy {
        mode: NetworkMode::Open,
        allow: vec![],
    };
    let lease = net.acquire("a", &open).expect("acquire");
    let link = net.link_name(lease.slot);
    assert!(std::path::Path::new(&format!("/sys/class/net/{link}")).exists());

    // A service on the host, on every address: the sandbox must not reach it.
    let host_srv = TcpListener::bind("0.0.0.0:0").expect("bind");
    let port = host_srv.local_addr().expect("addr").port();
    let gw = lease.gateway;
    let (to_gw, to_dns) = inside(&lease.netns, || {
        let t0 = std::time::Instant::now();
        let r = connect(SocketAddr::from((gw, port)));
        (
            r.map(|_| ()).map_err(|e| (e.kind(), t0.elapsed())),
            connect(SocketAddr::from((gw, 53))).is_ok(),
        )
    });
    let (kind, took) = to_gw.expect_err("the node itself is off limits");
    assert_eq!(kind, std::io::ErrorKind::ConnectionRefused);
    assert!(
        took < Duration::from_secs(1),
        "rejected, not dropped: {took:?}"
    );
    assert!(
        to_dns,
        "DNS (port 53, redirected to the resolver) is reachable"
    );

    // Another sandbox is off limits even in mode open.
    let other = net.acquire("b", &open).expect("acquire b");
    let b_ip = other.ip;
    let to_b = inside(&lease.netns, || {
        connect(SocketAddr::from((b_ip, 22))).map(|_| ())
    });
    assert_eq!(
        to_b.expect_err("sandbox to sandbox").kind(),
        std::io::ErrorKind::ConnectionRefused
    );

    assert_eq!(net.live(), 2);
    net.release("a").expect("release");
    net.release("b").expect("release");
    assert_eq!(net.live(), 0);
    // The links go with the namespaces, once nothing holds them.
    drop(lease);
    drop(other);
    drop(net);
    let gone = (0..100).any(|_| {
        std::thread::sleep(Duration::from_millis(100));
        !std::path::Path::new(&format!("/sys/class/net/{link}")).exists()
    });
    assert!(gone, "link {link} outlived its namespace");
    let out = std::process::Command::new("nft")
        .args(["delete", "table", "inet", "dsec_slot_test"])
        .status()
        .expect("nft");
    assert!(out.success());
    let clean = (0..100).any(|_| {
        std::thread::sleep(Duration::from_millis(100));
        dsec_net::netns::links_with_prefix("dst").is_empty()
    });
    assert!(
        clean,
        "links left: {:?}",
        dsec_net::netns::links_with_prefix("dst")
    );
}

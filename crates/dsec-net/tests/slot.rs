//! Real namespaces, links and nftables: a slot is wired, reaches what its policy allows
//! through the node, is refused the node itself, and leaves nothing behind; a slot with
//! a model link reaches the model gateway at its VIP, and only that, across a restart.

use std::io::ErrorKind;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use dsec_net::{
    Lease, ModelGatewayNet, ModelGatewayTarget, NetConfig, NetError, NetRecord, Network,
    SlotOptions, DEFAULT_MODEL_VIP,
};
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
        model_gateway: None,
    };
    let net = Network::start(cfg.clone(), &[]).expect("start");
    let open = NetworkPolicy {
        mode: NetworkMode::Open,
        allow: vec![],
    };
    let linked = SlotOptions { model_link: true };
    assert!(matches!(
        net.acquire_with("x", &open, linked),
        Err(NetError::NoModelGateway)
    ));
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

fn policy(mode: NetworkMode) -> NetworkPolicy {
    NetworkPolicy {
        mode,
        allow: vec![],
    }
}

/// Connects from inside `lease`'s namespace: `Ok` or the error's kind.
fn reach(lease: &Lease, addr: SocketAddrV4) -> Result<(), ErrorKind> {
    inside(&lease.netns, || {
        connect(SocketAddr::V4(addr))
            .map(drop)
            .map_err(|e| e.kind())
    })
}

/// The address of the next connection `srv` accepts within 3 s.
fn accepted(srv: &TcpListener) -> Option<Ipv4Addr> {
    srv.set_nonblocking(true).expect("nonblocking");
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(3) {
        match srv.accept() {
            Ok((_, SocketAddr::V4(peer))) => return Some(*peer.ip()),
            Ok(_) => return None,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) => panic!("accept: {e}"),
        }
    }
    None
}

/// Starts networking, retrying while the previous instance's resolver sockets (dropped
/// with its aborted tasks) still hold the port.
fn start(cfg: &NetConfig, adopt: &[(String, NetRecord)]) -> std::sync::Arc<Network> {
    let t0 = Instant::now();
    loop {
        match Network::start(cfg.clone(), adopt) {
            Ok(net) => return net,
            Err(NetError::Os { source, .. })
                if source.kind() == ErrorKind::AddrInUse
                    && t0.elapsed() < Duration::from_secs(5) =>
            {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(e) => panic!("start: {e}"),
        }
    }
}

/// Deletes the table and waits until the links with `prefix` are gone.
fn clean_up(table: &str, prefix: &str) {
    let out = std::process::Command::new("nft")
        .args(["delete", "table", "inet", table])
        .status()
        .expect("nft");
    assert!(out.success());
    let clean = (0..100).any(|_| {
        std::thread::sleep(Duration::from_millis(100));
        dsec_net::netns::links_with_prefix(prefix).is_empty()
    });
    assert!(
        clean,
        "links left: {:?}",
        dsec_net::netns::links_with_prefix(prefix)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_linked_slots_reach_a_local_gateway_at_the_vip_and_nothing_more() {
    if !require_root() {
        return;
    }
    // The gateway: on this node, on every address, like `dsec serve --gateway-config`.
    let gw_srv = TcpListener::bind("0.0.0.0:0").expect("bind");
    let port = gw_srv.local_addr().expect("addr").port();
    let other_srv = TcpListener::bind("0.0.0.0:0").expect("bind");
    let other_port = other_srv.local_addr().expect("addr").port();
    let cfg = NetConfig {
        subnet: (Ipv4Addr::new(10, 234, 0, 0), 24),
        table: "dsec_model_test".into(),
        link_prefix: "dsm".into(),
        dns_port: 15398,
        upstream: Some("127.0.0.1:9".parse().expect("addr")),
        pool_size: 1,
        model_gateway: Some(ModelGatewayNet::new(ModelGatewayTarget::Local { port })),
    };
    let net = start(&cfg, &[]);
    let linked = SlotOptions { model_link: true };
    assert!(matches!(
        net.acquire("n", &policy(NetworkMode::None)),
        Err(NetError::Invalid(_))
    ));
    let a = net
        .acquire_with("a", &policy(NetworkMode::None), linked)
        .expect("mode none with a model link");
    let b = net
        .acquire_with("b", &policy(NetworkMode::Allowlist), linked)
        .expect("allowlist with a model link");
    let c = net
        .acquire("c", &policy(NetworkMode::Allowlist))
        .expect("allowlist without");
    assert!(a.model_link && b.model_link && !c.model_link);

    let vip = DEFAULT_MODEL_VIP;
    let vip_other = SocketAddrV4::new(*vip.ip(), 81);
    for l in [&a, &b] {
        assert_eq!(reach(l, vip), Ok(()), "slot {} to the VIP", l.slot);
        // No SNAT on the way in: the gateway sees the sandbox's own address.
        assert_eq!(accepted(&gw_srv), Some(l.ip));
        // The host end at the gateway's port is the same listener: allowed too.
        assert_eq!(reach(l, SocketAddrV4::new(l.gateway, port)), Ok(()));
        assert_eq!(accepted(&gw_srv), Some(l.ip));
        // Nothing else: another port of the VIP, another port of the node.
        assert_eq!(reach(l, vip_other), Err(ErrorKind::ConnectionRefused));
        assert_eq!(
            reach(l, SocketAddrV4::new(l.gateway, other_port)),
            Err(ErrorKind::ConnectionRefused)
        );
    }
    assert_eq!(reach(&c, vip), Err(ErrorKind::ConnectionRefused));
    assert_eq!(
        reach(&c, SocketAddrV4::new(c.gateway, port)),
        Err(ErrorKind::ConnectionRefused)
    );
    assert_eq!(accepted(&other_srv), None);

    // The link is not part of the policy: a new policy keeps it, and only a linked
    // sandbox may go to mode none.
    net.set_policy("b", &policy(NetworkMode::Open))
        .expect("b to open");
    net.set_policy("a", &policy(NetworkMode::Allowlist))
        .expect("a to allowlist");
    net.set_policy("a", &policy(NetworkMode::None))
        .expect("a back to none");
    assert!(matches!(
        net.set_policy("c", &policy(NetworkMode::None)),
        Err(NetError::Invalid(_))
    ));
    assert_eq!(reach(&b, vip), Ok(()));
    assert_eq!(accepted(&gw_srv), Some(b.ip));

    // A restart: the records bring the links back into `model_links`.
    let records: Vec<(String, NetRecord)> = ["a", "b", "c"]
        .iter()
        .map(|id| (id.to_string(), net.record(id).expect("record")))
        .collect();
    assert!(records[0].1.model_link && records[1].1.model_link && !records[2].1.model_link);
    drop(net);
    let net = start(&cfg, &records);
    assert_eq!(net.live(), 3);
    assert_eq!(reach(&a, vip), Ok(()), "after the restart");
    assert_eq!(accepted(&gw_srv), Some(a.ip));
    assert_eq!(reach(&c, vip), Err(ErrorKind::ConnectionRefused));
    assert_eq!(net.record("a"), Some(records[0].1.clone()));

    // Release takes the link out with the rest.
    net.release("a").expect("release");
    assert_eq!(reach(&a, vip), Err(ErrorKind::ConnectionRefused));
    assert_eq!(reach(&b, vip), Ok(()), "b keeps its link");
    assert_eq!(accepted(&gw_srv), Some(b.ip));

    net.release("b").expect("release");
    net.release("c").expect("release");
    drop((a, b, c));
    drop(net);
    clean_up("dsec_model_test", "dsm");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_linked_slots_reach_a_remote_gateway_through_the_vip() {
    if !require_root() {
        return;
    }
    // The "remote" gateway: a namespace of its own behind a veth, outside the sandbox
    // subnet, so traffic to it is forwarded like traffic to another host.
    let gw_link = "dsgwr0";
    let gw_addrs = dsec_net::netns::SlotAddrs {
        host: Ipv4Addr::new(10, 236, 0, 1),
        sandbox: Ipv4Addr::new(10, 236, 0, 2),
    };
    let gw_ns = dsec_net::netns::prepare(gw_link, gw_addrs).expect("gateway namespace");
    let gw_srv = inside(&gw_ns, || TcpListener::bind("0.0.0.0:8443").expect("bind"));
    let gw = SocketAddrV4::new(gw_addrs.sandbox, 8443);
    let cfg = NetConfig {
        subnet: (Ipv4Addr::new(10, 235, 0, 0), 24),
        table: "dsec_modelr_test".into(),
        link_prefix: "dsr".into(),
        dns_port: 15397,
        upstream: Some("127.0.0.1:9".parse().expect("addr")),
        pool_size: 1,
        model_gateway: Some(ModelGatewayNet::new(ModelGatewayTarget::Remote {
            addr: gw,
        })),
    };
    let net = start(&cfg, &[]);
    let a = net
        .acquire_with(
            "a",
            &policy(NetworkMode::None),
            SlotOptions { model_link: true },
        )
        .expect("mode none with a model link");
    let c = net
        .acquire("c", &policy(NetworkMode::Allowlist))
        .expect("allowlist without");

    let vip = DEFAULT_MODEL_VIP;
    assert_eq!(reach(&a, vip), Ok(()));
    // Masqueraded like other egress.
    assert_eq!(accepted(&gw_srv), Some(gw_addrs.host));
    assert_eq!(reach(&a, gw), Ok(()), "the gateway's own address");
    assert_eq!(accepted(&gw_srv), Some(gw_addrs.host));
    assert_eq!(
        reach(&a, SocketAddrV4::new(gw_addrs.sandbox, 22)),
        Err(ErrorKind::ConnectionRefused)
    );
    assert_eq!(
        reach(&a, SocketAddrV4::new(*vip.ip(), 81)),
        Err(ErrorKind::ConnectionRefused)
    );
    assert_eq!(reach(&c, vip), Err(ErrorKind::ConnectionRefused));
    assert_eq!(reach(&c, gw), Err(ErrorKind::ConnectionRefused));
    assert_eq!(accepted(&gw_srv), None);

    net.release("a").expect("release");
    net.release("c").expect("release");
    drop((a, c));
    drop(net);
    drop(gw_srv);
    drop(gw_ns);
    let _ = dsec_net::netns::remove_link(gw_link);
    clean_up("dsec_modelr_test", "dsr");
}

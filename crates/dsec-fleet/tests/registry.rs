//! The registry and the fleet view against real stores: the in-memory store (same
//! engine as the single-node default) and a real etcd, with two "replicas" (registries
//! and views on separate connections).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dsec_fleet::{
    new_boot_id, Capacity, FleetError, FleetView, Heartbeat, Load, NodeEvent, NodeRegistration,
    PlacementConfig, PlacementRequest, Placer, Registry, RegistryConfig, ADMIN_NS, NODES_NS,
};
use dsec_state::{EtcdConfig, EtcdStore, MemStore, StateStore};
use dsec_testkit::Etcd;
use dsec_wire::v1::{Isolation, NetworkMode};
use tokio::sync::mpsc::UnboundedReceiver;

fn reg(name: &str) -> NodeRegistration {
    NodeRegistration {
        name: name.into(),
        url: format!("http://{name}.internal:7070"),
        labels: BTreeMap::from([("pool".to_string(), "onprem".to_string())]),
        isolation: vec![Isolation::Container],
        network_modes: vec![NetworkMode::None, NetworkMode::Open],
        capacity: Capacity {
            cpu_millis: 8000,
            memory_bytes: 16 << 30,
            max_sandboxes: 100,
        },
        load: Load::default(),
        cached_layers: vec![],
        version: "test".into(),
        boot_id: new_boot_id(),
    }
}

async fn wait_until<F: FnMut() -> bool>(within: Duration, what: &str, mut check: F) {
    let end = Instant::now() + within;
    while !check() {
        assert!(
            Instant::now() < end,
            "timed out after {within:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn next_event(rx: &mut UnboundedReceiver<NodeEvent>, within: Duration) -> NodeEvent {
    tokio::time::timeout(within, rx.recv())
        .await
        .unwrap_or_else(|_| panic!("no node event within {within:?}"))
        .expect("the view runs")
}

/// Heartbeats like a node does, until aborted.
fn heartbeat_loop(registry: Registry, hb: Heartbeat) -> tokio::task::JoinHandle<()> {
    let every = registry.config().heartbeat_interval;
    tokio::spawn(async move {
        loop {
            if let Err(e) = registry.heartbeat(hb.clone()).await {
                panic!("heartbeat of {}: {e}", hb.name);
            }
            tokio::time::sleep(every).await;
        }
    })
}

fn beat(r: &NodeRegistration, lease: i64, load: Load) -> Heartbeat {
    Heartbeat {
        name: r.name.clone(),
        boot_id: r.boot_id.clone(),
        lease,
        load,
        cached_layers: None,
    }
}

/// Everything a node's life brings, seen by a second replica: join within 1 s, loads
/// from heartbeats, a duplicate refused, drain surviving re-registration, a stopped
/// node gone within `gone_within` of its last heartbeat, and its return.
async fn node_lifecycle(
    a: Arc<dyn StateStore>,
    b: Arc<dyn StateStore>,
    cfg: RegistryConfig,
    gone_within: Duration,
) {
    let registry = Registry::new(a, cfg);
    let replica = Registry::new(b.clone(), cfg);
    let view = FleetView::start(b);
    let mut events = view.subscribe();
    tokio::time::timeout(Duration::from_secs(5), view.synced())
        .await
        .expect("the view lists the store");
    assert!(view.is_current());

    // Join: the other replica's view has it within 1 s.
    let n1 = reg("n1");
    let t = Instant::now();
    let ticket = registry.register(n1.clone()).await.expect("register");
    assert_eq!(ticket.ttl_ms, cfg.ttl.as_millis() as u64);
    match next_event(&mut events, Duration::from_secs(1)).await {
        NodeEvent::Up {
            node,
            previous_boot_id,
        } => {
            assert_eq!(node.registration, n1);
            assert_eq!(previous_boot_id, None);
        }
        e => panic!("{e:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert_eq!(view.nodes().len(), 1);

    // A heartbeat through the other replica: its load shows within 1 s.
    let load = Load {
        cpu_millis: 1500,
        memory_bytes: 1 << 30,
        sandboxes: 3,
    };
    let layer = format!("sha256:{}", "cd".repeat(32));
    let mut hb = beat(&n1, ticket.lease, load);
    hb.cached_layers = Some(vec![layer.clone()]);
    replica.heartbeat(hb).await.expect("heartbeat");
    wait_until(Duration::from_secs(1), "the new load", || {
        view.node("n1")
            .is_some_and(|n| n.registration.load == load && n.cached.contains(&layer))
    })
    .await;

    // Another process under the same name is refused; nothing changes.
    let imposter = reg("n1");
    match registry.register(imposter.clone()).await {
        Err(FleetError::NameTaken { name, boot_id }) => {
            assert_eq!(
                (name.as_str(), boot_id.as_str()),
                ("n1", n1.boot_id.as_str())
            )
        }
        other => panic!("{other:?}"),
    }
    // The same process registering again (a lost reply) keeps its lease.
    let again = replica.register(n1.clone()).await.expect("same boot id");
    assert_eq!(again.lease, ticket.lease);
    // A heartbeat naming the wrong boot id or lease is told to register.
    let mut wrong = beat(&imposter, ticket.lease, load);
    assert!(matches!(
        registry.heartbeat(wrong.clone()).await,
        Err(FleetError::NotRegistered { .. })
    ));
    wrong.boot_id = n1.boot_id.clone();
    wrong.lease = ticket.lease + 12345;
    let e = registry.heartbeat(wrong).await.expect_err("unknown lease");
    assert!(e.must_register(), "{e}");
    assert_eq!(
        view.node("n1").expect("n1").registration.boot_id,
        n1.boot_id
    );

    // Drain: placement skips it; the flag outlives the registration.
    assert!(registry.drain("n1").await.expect("drain"));
    wait_until(Duration::from_secs(1), "drained", || {
        view.node("n1").is_some_and(|n| n.draining)
    })
    .await;
    let placer = Placer::new(PlacementConfig::default());
    let req = PlacementRequest {
        cpu_millis: 100,
        memory_bytes: 1 << 20,
        ..Default::default()
    };
    assert!(placer.place(&view.nodes(), &req).is_err());

    // Stop heartbeating: gone within `gone_within` of the last heartbeat.
    // Heartbeats keep it alive past its TTL ...
    let beating = heartbeat_loop(registry.clone(), beat(&n1, ticket.lease, load));
    tokio::time::sleep(cfg.ttl + cfg.heartbeat_interval).await;
    assert!(events.try_recv().is_err(), "no event while heartbeating");
    assert!(view.node("n1").is_some());
    // ... until they stop.
    beating.abort();
    let _ = beating.await;
    let stopped = Instant::now();
    match next_event(&mut events, gone_within + Duration::from_secs(2)).await {
        NodeEvent::Down {
            name,
            boot_id,
            lease,
            left,
        } => {
            assert_eq!(
                (name.as_str(), boot_id.as_str(), lease, left),
                ("n1", n1.boot_id.as_str(), ticket.lease, false),
                "a node that stopped heartbeating was lost, not left"
            )
        }
        e => panic!("{e:?}"),
    }
    let took = stopped.elapsed();
    eprintln!("n1 gone from the other replica's view {took:?} after its heartbeats stopped");
    assert!(took <= gone_within, "gone after {took:?}");
    // The last heartbeat was at most an interval (and a call) before the loop stopped.
    assert!(
        took >= cfg.ttl.saturating_sub(cfg.heartbeat_interval * 3 / 2),
        "gone early, after {took:?}"
    );
    assert!(view.nodes().is_empty());
    // Its heartbeats are now told to register again.
    let e = registry
        .heartbeat(beat(&n1, ticket.lease, load))
        .await
        .expect_err("expired");
    assert!(e.must_register(), "{e}");

    // Back with a new boot id: the view reports the restart; still drained.
    let n1b = reg("n1");
    let t2 = replica.register(n1b.clone()).await.expect("register again");
    assert_ne!(t2.lease, ticket.lease);
    match next_event(&mut events, Duration::from_secs(1)).await {
        NodeEvent::Up {
            node,
            previous_boot_id,
        } => {
            assert_eq!(node.registration.boot_id, n1b.boot_id);
            assert_eq!(previous_boot_id.as_deref(), Some(n1.boot_id.as_str()));
            assert!(node.draining, "drain survives re-registration");
        }
        e => panic!("{e:?}"),
    }
    assert!(placer.place(&view.nodes(), &req).is_err());
    assert!(registry.undrain("n1").await.expect("undrain"));
    wait_until(Duration::from_secs(1), "undrained", || {
        view.node("n1").is_some_and(|n| !n.draining)
    })
    .await;
    assert_eq!(
        placer.place(&view.nodes(), &req).expect("placed").node(),
        "n1"
    );
    let listed = replica.list().await.expect("list");
    assert_eq!(listed.len(), 1);
    assert!(!listed[0].draining);

    // Deregistration (shutdown) removes it at once; only with its own boot id and lease.
    replica
        .deregister("n1", &n1.boot_id, t2.lease)
        .await
        .expect("stale deregister is a no-op");
    assert!(view.node("n1").is_some());
    replica
        .deregister("n1", &n1b.boot_id, t2.lease)
        .await
        .expect("deregister");
    match next_event(&mut events, Duration::from_secs(1)).await {
        NodeEvent::Down { name, .. } => assert_eq!(name, "n1"),
        e => panic!("{e:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_lifecycle_on_the_memory_store() {
    let store: Arc<dyn StateStore> = Arc::new(MemStore::new());
    let cfg = RegistryConfig {
        ttl: Duration::from_millis(1500),
        heartbeat_interval: Duration::from_millis(500),
    };
    node_lifecycle(store.clone(), store, cfg, Duration::from_secs(2)).await;
}

async fn etcd_store(etcd: &Etcd, prefix: &str) -> Arc<dyn StateStore> {
    let mut cfg = EtcdConfig::new(etcd.endpoints(), prefix);
    cfg.request_timeout = Duration::from_secs(2);
    Arc::new(EtcdStore::connect(cfg).await.expect("connect to etcd"))
}

/// With the production timing (3 s TTL, 1 s heartbeats), on etcd, a node that stops is
/// gone from another replica's view within 5 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_lifecycle_on_etcd() {
    let Some(etcd) = Etcd::start("a_node_lifecycle_on_etcd") else {
        return;
    };
    let a = etcd_store(&etcd, "/fleet-test").await;
    let b = etcd_store(&etcd, "/fleet-test").await;
    node_lifecycle(a, b, RegistryConfig::default(), Duration::from_secs(5)).await;
}

/// Bad input is refused with a typed error naming the field, and nothing is written.
#[tokio::test]
async fn bad_registrations_write_nothing() {
    let mem = MemStore::new();
    let store: Arc<dyn StateStore> = Arc::new(mem.clone());
    let registry = Registry::new(store.clone(), RegistryConfig::default());
    let cases: Vec<(&str, NodeRegistration)> = vec![
        (
            "name",
            NodeRegistration {
                name: String::new(),
                ..reg("x")
            },
        ),
        (
            "name",
            NodeRegistration {
                name: "a/b".into(),
                ..reg("x")
            },
        ),
        (
            "url",
            NodeRegistration {
                url: "no url".into(),
                ..reg("x")
            },
        ),
        (
            "url",
            NodeRegistration {
                url: "unix:/run/x.sock".into(),
                ..reg("x")
            },
        ),
        (
            "capacity.cpu_millis",
            NodeRegistration {
                capacity: Capacity {
                    cpu_millis: 0,
                    ..reg("x").capacity
                },
                ..reg("x")
            },
        ),
        (
            "capacity.memory_bytes",
            NodeRegistration {
                capacity: Capacity {
                    memory_bytes: 0,
                    ..reg("x").capacity
                },
                ..reg("x")
            },
        ),
        (
            "boot_id",
            NodeRegistration {
                boot_id: String::new(),
                ..reg("x")
            },
        ),
    ];
    for (field, r) in cases {
        match registry.register(r).await {
            Err(FleetError::Invalid(m)) => {
                assert!(m.starts_with(&format!("{field}:")), "{field}: {m}")
            }
            other => panic!("{field}: {other:?}"),
        }
    }
    for bad in ["", "a/b", ".."] {
        assert!(
            matches!(registry.drain(bad).await, Err(FleetError::Invalid(_))),
            "{bad:?}"
        );
    }
    let mut hb = beat(&reg("x"), 1, Load::default());
    hb.cached_layers = Some(vec!["md5:abc".into()]);
    assert!(matches!(
        registry.heartbeat(hb).await,
        Err(FleetError::Invalid(_))
    ));
    assert!(store.list(NODES_NS).await.expect("list").0.is_empty());
    assert!(store.list(ADMIN_NS).await.expect("list").0.is_empty());
}

/// A view started while the store is unreachable keeps trying; once the store is back
/// it lists and follows it. Registrations fail cleanly meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_view_survives_an_unreachable_store() {
    let mem = MemStore::new();
    let store: Arc<dyn StateStore> = Arc::new(mem.clone());
    let registry = Registry::new(store.clone(), RegistryConfig::default());
    mem.set_unavailable(true);
    let view = FleetView::start(store.clone());
    assert!(matches!(
        registry.register(reg("n1")).await,
        Err(FleetError::Store(dsec_state::StateError::Unavailable(_)))
    ));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!view.is_current());
    mem.set_unavailable(false);
    tokio::time::timeout(Duration::from_secs(5), view.synced())
        .await
        .expect("synced once the store is back");
    registry.register(reg("n1")).await.expect("register");
    wait_until(Duration::from_secs(1), "n1 in the view", || {
        view.node("n1").is_some()
    })
    .await;
    assert!(view.is_current());
}

/// Several replicas registering one name for different processes at once: exactly one
/// wins, the others are told the name is taken, and one record exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_registrations_of_one_name_admit_one() {
    let store: Arc<dyn StateStore> = Arc::new(MemStore::new());
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let registry = Registry::new(store.clone(), RegistryConfig::default());
            tokio::spawn(async move { registry.register(reg("n1")).await })
        })
        .collect();
    let mut won = 0;
    for t in tasks {
        match t.await.expect("task") {
            Ok(_) => won += 1,
            Err(FleetError::NameTaken { .. }) => {}
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(won, 1);
    assert_eq!(store.list(NODES_NS).await.expect("list").0.len(), 1);
}

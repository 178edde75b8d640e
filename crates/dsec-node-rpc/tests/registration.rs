//! Nodes registering through API servers over HTTP: the real routes and the real
//! heartbeat loop, two API server replicas on one store.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::IntoResponse;
use dsec_fleet::{
    new_boot_id, Capacity, FleetView, Load, NodeEvent, NodeRegistration, Registry, RegistryConfig,
    NODES_NS,
};
use dsec_node_rpc::registration::{router, Heartbeater, HeartbeaterConfig, Report};
use dsec_state::{LeaseId, MemStore, StateStore};
use dsec_wire::v1::{Isolation, NetworkMode};

const TOKEN: &str = "node-token-for-tests";

fn cfg() -> RegistryConfig {
    RegistryConfig {
        ttl: Duration::from_millis(1500),
        heartbeat_interval: Duration::from_millis(300),
    }
}

fn reg(name: &str) -> NodeRegistration {
    NodeRegistration {
        name: name.into(),
        url: "http://127.0.0.1:7070".into(),
        labels: BTreeMap::new(),
        isolation: vec![Isolation::Container],
        network_modes: vec![NetworkMode::None],
        capacity: Capacity {
            cpu_millis: 4000,
            memory_bytes: 8 << 30,
            max_sandboxes: 50,
        },
        load: Load::default(),
        cached_layers: vec![],
        version: "test".into(),
        boot_id: new_boot_id(),
    }
}

/// An API server replica serving the registration routes; while its flag is set it
/// answers 503 to everything (as a replica whose store connection is broken).
async fn apiserver(store: Arc<dyn StateStore>) -> (String, Arc<AtomicBool>) {
    let down = Arc::new(AtomicBool::new(false));
    let d = down.clone();
    let app = router(Registry::new(store, cfg()), TOKEN.into()).layer(axum::middleware::from_fn(
        move |req: Request, next: Next| {
            let d = d.clone();
            async move {
                if d.load(Ordering::SeqCst) {
                    return StatusCode::SERVICE_UNAVAILABLE.into_response();
                }
                next.run(req).await
            }
        },
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, down)
}

fn closed_port_url() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    format!("http://127.0.0.1:{port}")
}

async fn wait_until<F: FnMut() -> bool>(within: Duration, what: &str, mut check: F) {
    let end = Instant::now() + within;
    while !check() {
        assert!(Instant::now() < end, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A node registers through the first API server that answers, stays alive while the
/// one it uses fails (it moves to the other), registers again when its lease is lost,
/// and is gone at once when it shuts down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_heartbeats_through_any_replica() {
    let store: Arc<dyn StateStore> = Arc::new(MemStore::new());
    let (a, a_down) = apiserver(store.clone()).await;
    let (b, b_down) = apiserver(store.clone()).await;
    let view = FleetView::start(store.clone());
    let mut events = view.subscribe();
    view.synced().await;

    let node = reg("n1");
    let load = Arc::new(AtomicU64::new(0));
    let l = load.clone();
    let hb = Heartbeater::start(
        HeartbeaterConfig::new(vec![closed_port_url(), a.clone(), b.clone()], TOKEN.into()),
        node.clone(),
        move || Report {
            load: Load {
                sandboxes: l.load(Ordering::SeqCst),
                ..Load::default()
            },
            cached_layers: vec![],
        },
    )
    .expect("start");
    let status = hb.status();
    wait_until(Duration::from_secs(3), "registered", || {
        status.borrow().lease.is_some()
    })
    .await;
    assert!(matches!(
        events.recv().await,
        Some(NodeEvent::Up {
            previous_boot_id: None,
            ..
        })
    ));

    // Loads flow through heartbeats.
    load.store(7, Ordering::SeqCst);
    wait_until(Duration::from_secs(2), "load 7 in the view", || {
        view.node("n1")
            .is_some_and(|n| n.registration.load.sandboxes == 7)
    })
    .await;

    // The replica in use fails: the node moves to the other one and its registration
    // outlives two TTLs.
    let used = status.borrow().apiserver.clone().expect("an API server");
    let (other, down) = if used.starts_with(&a) {
        (&b, &a_down)
    } else {
        (&a, &b_down)
    };
    down.store(true, Ordering::SeqCst);
    tokio::time::sleep(cfg().ttl * 2).await;
    assert!(
        status
            .borrow()
            .apiserver
            .as_deref()
            .is_some_and(|u| u.starts_with(other.as_str())),
        "{:?}",
        *status.borrow()
    );
    assert!(view.node("n1").is_some());
    assert!(events.try_recv().is_err(), "no Down while failing over");
    down.store(false, Ordering::SeqCst);

    // Its lease is lost (as after a long partition): it registers again.
    let lease = status.borrow().lease.expect("lease");
    store.revoke_lease(LeaseId(lease)).await.expect("revoke");
    wait_until(Duration::from_secs(3), "registered again", || {
        status.borrow().registrations == 2 && status.borrow().lease.is_some()
    })
    .await;
    assert!(matches!(
        events.recv().await,
        Some(NodeEvent::Down { left: false, .. })
    ));
    match events.recv().await {
        Some(NodeEvent::Up {
            previous_boot_id, ..
        }) => assert_eq!(previous_boot_id.as_deref(), Some(node.boot_id.as_str())),
        e => panic!("{e:?}"),
    }

    // Shutdown deregisters: gone at once, not after a TTL, and said to have left.
    let t = Instant::now();
    hb.shutdown().await;
    assert!(matches!(
        tokio::time::timeout(Duration::from_secs(1), events.recv()).await,
        Ok(Some(NodeEvent::Down { left: true, .. }))
    ));
    assert!(t.elapsed() < cfg().ttl);
}

/// A wrong token or a malformed request is refused and writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_tokens_and_bad_bodies_write_nothing() {
    let store: Arc<dyn StateStore> = Arc::new(MemStore::new());
    let (a, _) = apiserver(store.clone()).await;

    let hb = Heartbeater::start(
        HeartbeaterConfig::new(vec![a.clone()], "stolen-or-wrong".into()),
        reg("n1"),
        Report::default,
    )
    .expect("start");
    let status = hb.status();
    wait_until(Duration::from_secs(3), "an error", || {
        status.borrow().last_error.is_some()
    })
    .await;
    let err = status.borrow().last_error.clone().unwrap_or_default();
    assert!(err.contains("token"), "{err}");
    assert_eq!(status.borrow().lease, None);
    drop(hb);

    let http = reqwest::Client::new();
    let post = |path: &str, body: String, token: &str| {
        http.post(format!("{a}/node/v1{path}"))
            .bearer_auth(token)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let no_name = serde_json::to_string(&NodeRegistration {
        name: String::new(),
        ..reg("x")
    })
    .expect("json");
    let zero_cpu = serde_json::to_string(&NodeRegistration {
        capacity: Capacity {
            cpu_millis: 0,
            ..reg("x").capacity
        },
        ..reg("x")
    })
    .expect("json");
    for (path, body, want) in [
        ("/register", "{".to_string(), "EOF"),
        (
            "/register",
            r#"{"name":"x","extra":1}"#.to_string(),
            "unknown field",
        ),
        ("/register", no_name, "name: empty"),
        ("/register", zero_cpu, "capacity.cpu_millis"),
        ("/heartbeat", r#"{"name":"x"}"#.to_string(), "missing field"),
    ] {
        let r = post(path, body, TOKEN).await.expect("answer");
        assert_eq!(r.status(), 400, "{path}");
        let text = r.text().await.unwrap_or_default();
        assert!(
            text.contains("bad_request") && text.contains(want),
            "{path}: {text}"
        );
    }
    let r = post("/register", "{}".into(), "").await.expect("answer");
    assert_eq!(r.status(), 401);
    assert!(store.list(NODES_NS).await.expect("list").0.is_empty());
}

//! Warm pools over a `FakeNode` and a real redb store, without root: claims, refills,
//! the autoscaler growing under a burst and shrinking when idle, tenant isolation, bad
//! specs and claims, deletion, and a restart that adopts the warm sandboxes.

use std::time::{Duration, Instant};

use dsec_control::{ControlPlane, Principal, SandboxApi};
use dsec_node_api::fake::shell_request;
use dsec_wire::v1::{
    AutoscalePolicy, CreateSandboxRequest, EventKind, EventQuery, Pool, PoolSpec, PoolUpdate,
    QueueOptions, ScaleReason, POOL_LABEL, POOL_ORIGIN_LABEL,
};
use dsec_wire::ErrorCode;

mod common;
use common::{open, tenant_on, Fixture};

fn spec(name: &str, min: u32, max: u32) -> PoolSpec {
    PoolSpec {
        name: name.into(),
        template: CreateSandboxRequest {
            env: [("FROM_POOL".to_string(), "1".to_string())].into(),
            labels: [("team".to_string(), "rl".to_string())].into(),
            ..Default::default()
        },
        min,
        max,
        autoscale: AutoscalePolicy::default(),
        fncall: None,
    }
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn claim(pool: &str) -> CreateSandboxRequest {
    CreateSandboxRequest {
        pool: Some(pool.into()),
        ..Default::default()
    }
}

/// Waits up to `secs` for `pool` of `caller` to satisfy `cond`; its last state.
async fn wait_pool(
    plane: &ControlPlane,
    caller: &Principal,
    pool: &str,
    secs: u64,
    cond: impl Fn(&Pool) -> bool,
) -> Pool {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let p = plane
            .get_pool(caller, pool)
            .await
            .unwrap_or_else(|e| panic!("get pool {pool}: {e:?}"));
        if cond(&p) || Instant::now() > deadline {
            return p;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_takes_a_warm_sandbox_and_the_pool_refills() {
    let fx = Fixture::new().await;
    let me = tenant_on(&fx.plane, "alice").await;
    let p = fx
        .plane
        .create_pool(&me, spec("py", 2, 4))
        .await
        .expect("create pool");
    assert_eq!((p.spec.min, p.target), (2, 2));
    let p = wait_pool(&fx.plane, &me, "py", 10, |p| p.ready == 2).await;
    assert_eq!((p.ready, p.size), (2, 2), "{p:?}");
    let warm_before = fx.node.sandbox_ids();

    let mut req = claim("py");
    req.labels.insert("task".into(), "t-1".into());
    req.timeout_s = Some(120);
    let sb = fx.plane.create_sandbox(&me, req).await.expect("claim");
    assert!(
        warm_before.contains(&sb.id),
        "a warm sandbox was handed out"
    );
    assert_eq!(sb.tenant, "alice");
    assert_eq!(sb.labels.get(POOL_LABEL), None, "no longer a member");
    assert_eq!(
        sb.labels.get(POOL_ORIGIN_LABEL).map(String::as_str),
        Some("py")
    );
    assert_eq!(sb.labels.get("task").map(String::as_str), Some("t-1"));
    assert_eq!(sb.labels.get("team").map(String::as_str), Some("rl"));
    assert!(
        sb.expires_at <= sb.last_active_at + 120_000,
        "the claim's timeout"
    );
    // It is an ordinary sandbox with the pool's environment.
    let r = fx
        .plane
        .exec(&me, &sb.id, shell_request("echo $FROM_POOL"))
        .await
        .expect("exec");
    assert_eq!(r.exit.exit_code, Some(0));

    // The pool makes another behind it.
    let p = wait_pool(&fx.plane, &me, "py", 10, |p| p.ready == 2).await;
    assert_eq!((p.ready, p.claimed), (2, 1), "{p:?}");
    assert_eq!(fx.node.sandbox_ids().len(), 3);
    // Deleting the claimed sandbox leaves the pool alone.
    fx.plane.delete_sandbox(&me, &sb.id).await.expect("delete");
    let p = fx.plane.get_pool(&me, "py").await.expect("get");
    assert_eq!(p.ready, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_grows_the_pool_within_one_window_and_idleness_shrinks_it() {
    let fx = Fixture::new().await;
    let me = tenant_on(&fx.plane, "burst").await;
    let mut s = spec("burst", 10, 80);
    s.autoscale = AutoscalePolicy {
        window_s: 1.0,
        target_queue_wait_ms: 200,
        idle_window_s: 1.0,
        cooldown_s: 0.5,
        ..AutoscalePolicy::default()
    };
    fx.plane.create_pool(&me, s).await.expect("create pool");
    wait_pool(&fx.plane, &me, "burst", 10, |p| p.ready == 10).await;
    // Each new sandbox takes 300 ms: 100 claims against 10 warm ones queue.
    fx.node.set_create_latency(Duration::from_millis(300));
    let started_ms = unix_ms();
    let claims: Vec<_> = (0..100)
        .map(|_| {
            let (plane, me) = (fx.plane.clone(), me.clone());
            tokio::spawn(async move {
                let mut req = claim("burst");
                req.queue = Some(QueueOptions {
                    max_wait_s: Some(60.0),
                    ..Default::default()
                });
                plane.create_sandbox(&me, req).await
            })
        })
        .collect();
    let grown = wait_pool(&fx.plane, &me, "burst", 10, |p| p.target > 10).await;
    let ids: Vec<String> = futures::future::join_all(claims)
        .await
        .into_iter()
        .map(|r| {
            r.expect("join")
                .unwrap_or_else(|e| panic!("claim: {e:?}"))
                .id
        })
        .collect();
    let unique: std::collections::HashSet<&String> = ids.iter().collect();
    assert_eq!(unique.len(), 100, "no sandbox was handed out twice");
    let first_up = grown
        .scale_events
        .iter()
        .find(|e| e.reason == ScaleReason::QueueWait)
        .unwrap_or_else(|| panic!("no scale-up: {grown:?}"));
    assert!(first_up.to >= 20, "x2: {first_up:?}");
    assert!(
        first_up.at.saturating_sub(started_ms) <= 1000 + 500,
        "grew {} ms after the burst began: within one window (1 s) and a tick",
        first_up.at.saturating_sub(started_ms)
    );

    // Nothing claims now: the idle share stays above 40%, so it shrinks to min.
    fx.node.set_create_latency(Duration::ZERO);
    let p = wait_pool(&fx.plane, &me, "burst", 30, |p| {
        p.target == 10 && p.size == 10
    })
    .await;
    assert_eq!((p.target, p.size), (10, 10), "{p:?}");
    assert!(
        p.scale_events.iter().any(|e| e.reason == ScaleReason::Idle),
        "{p:?}"
    );
    assert!(p.scale_events.iter().all(|e| e.to <= 80 && e.to >= 10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_are_per_tenant() {
    let fx = Fixture::new().await;
    let alice = tenant_on(&fx.plane, "alice").await;
    let bob = tenant_on(&fx.plane, "bob").await;
    fx.plane
        .create_pool(&alice, spec("shared-name", 1, 2))
        .await
        .expect("alice's pool");
    wait_pool(&fx.plane, &alice, "shared-name", 10, |p| p.ready == 1).await;
    // Bob does not see alice's pool and cannot claim from it.
    let e = fx
        .plane
        .get_pool(&bob, "shared-name")
        .await
        .expect_err("refused");
    assert_eq!(e.code, ErrorCode::NotFound);
    assert!(fx
        .plane
        .list_pools(&bob)
        .await
        .expect("list")
        .pools
        .is_empty());
    let e = fx
        .plane
        .create_sandbox(&bob, claim("shared-name"))
        .await
        .expect_err("refused");
    assert_eq!(e.code, ErrorCode::NotFound, "{e:?}");
    // His own pool of the same name is his: its sandboxes are his.
    fx.plane
        .create_pool(&bob, spec("shared-name", 1, 2))
        .await
        .expect("bob's pool");
    let sb = fx
        .plane
        .create_sandbox(&bob, claim("shared-name"))
        .await
        .expect("bob claims");
    assert_eq!(sb.tenant, "bob");
    let e = fx
        .plane
        .get_sandbox(&alice, &sb.id)
        .await
        .expect_err("refused");
    assert_eq!(e.code, ErrorCode::NotFound);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_specs_and_claims_are_refused_with_what_is_wrong() {
    let fx = Fixture::new().await;
    let me = tenant_on(&fx.plane, "picky").await;
    let cases: Vec<(PoolSpec, &str)> = vec![
        (spec("x", 5, 2), "min (5) is larger than max (2)"),
        (spec("Bad Name", 1, 2), "is not a pool name"),
        (
            PoolSpec {
                template: CreateSandboxRequest {
                    timeout_s: Some(60),
                    ..Default::default()
                },
                ..spec("t", 1, 2)
            },
            "timeout_s is set by each claim",
        ),
        (
            PoolSpec {
                autoscale: AutoscalePolicy {
                    scale_up_factor: 0.5,
                    ..Default::default()
                },
                ..spec("f", 1, 2)
            },
            "autoscale.scale_up_factor",
        ),
        (
            PoolSpec {
                template: CreateSandboxRequest {
                    image: Some("no-such-image".into()),
                    ..Default::default()
                },
                ..spec("img", 0, 2)
            },
            "",
        ),
    ];
    for (s, words) in cases {
        let name = s.name.clone();
        match fx.plane.create_pool(&me, s).await {
            Err(e) => {
                assert_eq!(e.code, ErrorCode::BadRequest, "{name}: {e:?}");
                assert!(e.message.contains(words), "{name}: {}", e.message);
            }
            // An unknown image is found when the pool makes its first sandbox.
            Ok(p) if name == "img" => assert_eq!(p.target, 0),
            Ok(p) => panic!("{name}: accepted {p:?}"),
        }
    }
    let e = fx
        .plane
        .create_pool(&me, spec("img", 0, 1))
        .await
        .expect_err("refused");
    assert_eq!(e.code, ErrorCode::Conflict, "a second pool of one name");

    // A pool whose image is unknown says so in its status once a claim makes it try.
    let mut req = claim("img");
    req.queue = Some(QueueOptions {
        max_wait_s: Some(0.3),
        ..Default::default()
    });
    let e = fx
        .plane
        .create_sandbox(&me, req)
        .await
        .expect_err("refused");
    assert_eq!(e.code, ErrorCode::Capacity, "{e:?}");
    let p = wait_pool(&fx.plane, &me, "img", 10, |p| p.last_error.is_some()).await;
    assert!(
        p.last_error
            .as_deref()
            .unwrap_or("")
            .contains("no-such-image"),
        "{p:?}"
    );

    // Claims that describe an environment, or forge pool labels.
    fx.plane
        .create_pool(&me, spec("ok", 0, 1))
        .await
        .expect("pool");
    let mut with_image = claim("ok");
    with_image.image = Some("base".into());
    let e = fx
        .plane
        .create_sandbox(&me, with_image)
        .await
        .expect_err("refused");
    assert!(e.message.contains("image: a create from a pool"), "{e:?}");
    let forged = CreateSandboxRequest {
        labels: [(POOL_LABEL.to_string(), "ok".to_string())].into(),
        ..Default::default()
    };
    let e = fx
        .plane
        .create_sandbox(&me, forged)
        .await
        .expect_err("refused");
    assert_eq!(e.code, ErrorCode::BadRequest, "{e:?}");
    let e = fx
        .plane
        .create_sandbox(&me, claim("no-such-pool"))
        .await
        .expect_err("refused");
    assert_eq!(e.code, ErrorCode::NotFound);
    let e = fx
        .plane
        .update_pool(
            &me,
            "ok",
            PoolUpdate {
                min: Some(3),
                ..Default::default()
            },
        )
        .await
        .expect_err("refused");
    assert!(
        e.message.contains("min (3) is larger than max (1)"),
        "{e:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_pool_deletes_its_warm_sandboxes_and_keeps_claimed_ones() {
    let fx = Fixture::new().await;
    let me = tenant_on(&fx.plane, "del").await;
    fx.plane
        .create_pool(&me, spec("gone", 3, 3))
        .await
        .expect("pool");
    wait_pool(&fx.plane, &me, "gone", 10, |p| p.ready == 3).await;
    let kept = fx
        .plane
        .create_sandbox(&me, claim("gone"))
        .await
        .expect("claim");
    wait_pool(&fx.plane, &me, "gone", 10, |p| p.ready == 3).await;
    fx.plane.delete_pool(&me, "gone").await.expect("delete");
    assert_eq!(fx.node.sandbox_ids(), vec![kept.id.clone()]);
    let e = fx.plane.get_pool(&me, "gone").await.expect_err("refused");
    assert_eq!(e.code, ErrorCode::NotFound);
    fx.plane
        .get_sandbox(&me, &kept.id)
        .await
        .expect("the claimed one stays");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_adopts_the_warm_sandboxes() {
    let fx = Fixture::new().await;
    let me = tenant_on(&fx.plane, "restart").await;
    fx.plane
        .create_pool(&me, spec("keep", 2, 4))
        .await
        .expect("pool");
    wait_pool(&fx.plane, &me, "keep", 10, |p| p.ready == 2).await;
    let warm = fx.node.sandbox_ids();
    drop(fx.plane);
    let plane = open(&fx.node, &fx.store).await;
    let p = plane.get_pool(&me, "keep").await.expect("the pool is back");
    assert_eq!(p.ready, 2, "{p:?}");
    // Nothing new was made: the same sandboxes serve claims.
    let sb = plane
        .create_sandbox(&me, claim("keep"))
        .await
        .expect("claim");
    assert!(warm.contains(&sb.id));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_on_an_empty_pool_waits_for_the_next_sandbox_or_its_max_wait() {
    let fx = Fixture::new().await;
    let me = tenant_on(&fx.plane, "wait").await;
    let mut pool_events = fx
        .plane
        .events(
            &me,
            EventQuery {
                kind: Some("pool_scaled,pool_exhausted,queue_timed_out".into()),
                ..Default::default()
            },
        )
        .await
        .expect("events");
    fx.plane
        .create_pool(&me, spec("zero", 0, 1))
        .await
        .expect("pool");
    // A pool at zero makes one as soon as a claim waits.
    let sb = fx
        .plane
        .create_sandbox(&me, claim("zero"))
        .await
        .expect("claim from zero");
    assert_eq!(
        sb.labels.get(POOL_ORIGIN_LABEL).map(String::as_str),
        Some("zero")
    );
    // Claimed sandboxes leave the pool: it makes another.
    wait_pool(&fx.plane, &me, "zero", 10, |p| p.ready == 1).await;
    // A node that makes nothing now: the warm one is claimed, the next claim waits its
    // max_wait_s and gets `capacity`.
    fx.node.stall_creates(true);
    fx.plane
        .create_sandbox(&me, claim("zero"))
        .await
        .expect("the warm one");
    let mut req = claim("zero");
    req.queue = Some(QueueOptions {
        max_wait_s: Some(0.2),
        ..Default::default()
    });
    let started = Instant::now();
    let e = fx
        .plane
        .create_sandbox(&me, req)
        .await
        .expect_err("refused");
    assert_eq!(e.code, ErrorCode::Capacity, "{e:?}");
    assert!(started.elapsed() >= Duration::from_millis(200));
    assert!(e.message.contains("max_wait_s"), "{e:?}");
    fx.node.stall_creates(false);
    let p = wait_pool(&fx.plane, &me, "zero", 10, |p| {
        p.queue_length == 0 && p.ready == 1
    })
    .await;
    assert_eq!(p.queue_length, 0, "the timed-out claim left the queue");

    // The tenant's event stream told it all: the pool grew from zero, claims found it
    // empty twice (once per spell: the second after a warm one was there again), and
    // the last claim's wait ran out.
    let seen = common::events_until(&mut pool_events, |e| e.kind == EventKind::QueueTimedOut).await;
    let of = |k: EventKind| seen.iter().filter(|e| e.kind == k).collect::<Vec<_>>();
    assert!(
        seen.iter()
            .all(|e| e.pool.as_deref() == Some("zero") && e.tenant.as_deref() == Some("wait")),
        "{seen:#?}"
    );
    let scaled = of(EventKind::PoolScaled);
    let cause = scaled
        .first()
        .and_then(|e| e.cause.clone())
        .unwrap_or_default();
    assert!(cause.starts_with("target 0 -> 1: claims wait"), "{seen:#?}");
    assert_eq!(of(EventKind::PoolExhausted).len(), 2, "{seen:#?}");
    let timed_out = of(EventKind::QueueTimedOut)[0]
        .cause
        .clone()
        .unwrap_or_default();
    assert!(timed_out.contains("waited 0.2 s"), "{timed_out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_claim_retried_gets_the_same_sandbox() {
    let fx = Fixture::new().await;
    let me = tenant_on(&fx.plane, "keyed").await;
    fx.plane
        .create_pool(&me, spec("k", 2, 2))
        .await
        .expect("pool");
    wait_pool(&fx.plane, &me, "k", 10, |p| p.ready == 2).await;
    let mut req = claim("k");
    req.idempotency_key = Some("retry-me".into());
    let first = fx
        .plane
        .create_sandbox(&me, req.clone())
        .await
        .expect("claim");
    assert_eq!(first.idempotency_key.as_deref(), Some("retry-me"));
    let again = fx
        .plane
        .create_sandbox(&me, req.clone())
        .await
        .expect("retry");
    assert_eq!(
        again.id, first.id,
        "the retry answers with the first claim's sandbox"
    );
    let p = fx.plane.get_pool(&me, "k").await.expect("get");
    assert_eq!(p.claimed, 1, "{p:?}");
    // The same key with another request is a conflict, and takes nothing.
    let mut other = req.clone();
    other.labels.insert("x".into(), "y".into());
    let e = fx
        .plane
        .create_sandbox(&me, other)
        .await
        .expect_err("refused");
    assert_eq!(e.code, ErrorCode::Conflict, "{e:?}");
    // Deleting the claimed sandbox frees the key: a new claim with it takes another.
    fx.plane
        .delete_sandbox(&me, &first.id)
        .await
        .expect("delete");
    wait_pool(&fx.plane, &me, "k", 10, |p| p.ready == 2).await;
    let next = fx
        .plane
        .create_sandbox(&me, req)
        .await
        .expect("claim again");
    assert_ne!(next.id, first.id);
}

/// Two API server replicas (not sole owners) over one in-memory store and one fake node.
async fn two_replicas() -> (
    std::sync::Arc<dsec_node_api::fake::FakeNode>,
    Vec<std::sync::Arc<ControlPlane>>,
) {
    let store: std::sync::Arc<dyn dsec_state::StateStore> =
        std::sync::Arc::new(dsec_state::MemStore::new());
    let node = std::sync::Arc::new(dsec_node_api::fake::FakeNode::new("fake-1"));
    let mut planes = Vec::new();
    for _ in 0..2 {
        let cfg = dsec_control::ControlConfig {
            sole_owner: false,
            reap_interval: Duration::from_millis(200),
            ..dsec_control::ControlConfig::with_key("k".into())
        };
        planes.push(
            ControlPlane::open(cfg, node.clone(), store.clone())
                .await
                .unwrap_or_else(|e| panic!("open a replica: {e:?}")),
        );
    }
    (node, planes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_two_replicas_a_pool_is_sized_once_and_serves_claims_on_both() {
    use dsec_node_api::NodeApi;
    let (node, planes) = two_replicas().await;
    let (a, b) = (planes[0].clone(), planes[1].clone());
    let me = common::op();
    a.create_pool(me, spec("rep", 3, 3)).await.expect("create");
    // Both replicas serve it; one sizes it: the node holds 3 warm sandboxes, not 6.
    for plane in [&a, &b] {
        let p = wait_pool(plane, me, "rep", 15, |p| p.ready == 3).await;
        assert_eq!(p.ready, 3, "{p:?}");
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        node.list().await.expect("list").len(),
        3,
        "the pool was filled twice"
    );
    // Claims on both replicas get distinct sandboxes, and the owner refills.
    let mut ids = std::collections::HashSet::new();
    for i in 0..4 {
        let p = if i % 2 == 0 { &a } else { &b };
        let sb = p.create_sandbox(me, claim("rep")).await.expect("claim");
        assert!(ids.insert(sb.id.clone()), "{} handed out twice", sb.id);
    }
    let p = wait_pool(&b, me, "rep", 15, |p| p.ready == 3).await;
    assert_eq!(p.ready, 3, "{p:?}");
    // A replica's view of the pool may still count a sandbox the other one just
    // claimed: the node is the truth, once the owner's refill is done.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let n = node.list().await.expect("list").len();
        if n == 7 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{n} sandboxes, not 4 claimed + 3 warm"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A pool deleted on one replica goes on the other.
    b.delete_pool(me, "rep").await.expect("delete");
    let deadline = Instant::now() + Duration::from_secs(5);
    while a.get_pool(me, "rep").await.is_ok() {
        assert!(
            Instant::now() < deadline,
            "the other replica still has the pool"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Claims waiting on a replica that does not size the pool reach the owner's
/// autoscaler (through the waits that replica publishes), so the pool grows for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_waiting_on_another_replica_grow_the_pool() {
    let (node, planes) = two_replicas().await;
    let me = common::op();
    let mut s = spec("remote", 2, 40);
    s.autoscale = AutoscalePolicy {
        window_s: 1.0,
        target_queue_wait_ms: 200,
        cooldown_s: 0.5,
        ..AutoscalePolicy::default()
    };
    planes[0].create_pool(me, s).await.expect("create");
    for plane in &planes {
        wait_pool(plane, me, "remote", 15, |p| p.ready == 2).await;
    }
    // Which replica sizes it (elected within a second).
    let deadline = Instant::now() + Duration::from_secs(10);
    let owner = loop {
        let owners: Vec<bool> = futures::future::join_all(
            planes
                .iter()
                .map(|p| async { p.get_pool(me, "remote").await.map(|p| p.owner) }),
        )
        .await
        .into_iter()
        .map(|r| r.expect("get pool"))
        .collect();
        if owners.iter().filter(|o| **o).count() == 1 {
            break owners.iter().position(|o| *o).expect("owner");
        }
        assert!(Instant::now() < deadline, "no single owner: {owners:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let (sizer, other) = (planes[owner].clone(), planes[1 - owner].clone());
    // Every new sandbox takes 300 ms: 30 claims on the other replica wait.
    node.set_create_latency(Duration::from_millis(300));
    let claims: Vec<_> = (0..30)
        .map(|_| {
            let other = other.clone();
            tokio::spawn(async move {
                let mut req = claim("remote");
                req.queue = Some(QueueOptions {
                    max_wait_s: Some(60.0),
                    ..Default::default()
                });
                other.create_sandbox(me, req).await
            })
        })
        .collect();
    let grown = wait_pool(&sizer, me, "remote", 15, |p| p.target > 2).await;
    assert!(
        grown.target > 2,
        "the owner never saw the other replica's waits: {grown:?}"
    );
    let ids: Vec<String> = futures::future::join_all(claims)
        .await
        .into_iter()
        .map(|r| {
            r.expect("join")
                .unwrap_or_else(|e| panic!("claim: {e:?}"))
                .id
        })
        .collect();
    let unique: std::collections::HashSet<&String> = ids.iter().collect();
    assert_eq!(unique.len(), 30, "no sandbox was handed out twice");
}

/// The replica that sizes a pool dies (its runtime, tasks and lease keep-alive gone):
/// the other takes the pool over once the dead one's lease expires, and refills it.
#[test]
fn a_pool_whose_owner_replica_dies_is_taken_over() {
    let store: std::sync::Arc<dyn dsec_state::StateStore> =
        std::sync::Arc::new(dsec_state::MemStore::new());
    // The in-memory store expires leases from a task on the runtime that granted its
    // first one: a runtime of its own, which outlives both replicas.
    let rt_store = tokio::runtime::Runtime::new().expect("runtime");
    rt_store
        .block_on(store.grant_lease(Duration::from_secs(3600)))
        .expect("lease");
    let node = std::sync::Arc::new(dsec_node_api::fake::FakeNode::new("fake-1"));
    let cfg = dsec_control::ControlConfig {
        sole_owner: false,
        reap_interval: Duration::from_millis(200),
        ..dsec_control::ControlConfig::with_key("k".into())
    };
    let me = common::op();
    let (rt_a, rt_b) = (
        tokio::runtime::Runtime::new().expect("runtime"),
        tokio::runtime::Runtime::new().expect("runtime"),
    );
    let a = rt_a
        .block_on(ControlPlane::open(cfg.clone(), node.clone(), store.clone()))
        .expect("open a");
    let b = rt_b
        .block_on(ControlPlane::open(cfg, node.clone(), store))
        .expect("open b");
    rt_a.block_on(a.create_pool(me, spec("takeover", 2, 2)))
        .expect("create");
    let owner_of = |p: &ControlPlane, rt: &tokio::runtime::Runtime| {
        rt.block_on(p.get_pool(me, "takeover"))
            .map(|p| p.owner)
            .unwrap_or(false)
    };
    let deadline = Instant::now() + Duration::from_secs(15);
    while !(owner_of(&a, &rt_a) || owner_of(&b, &rt_b)) {
        assert!(Instant::now() < deadline, "nobody owns the pool");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (survivor, rt_s, dead, rt_dead) = if owner_of(&a, &rt_a) {
        (b, rt_b, a, rt_a)
    } else {
        (a, rt_a, b, rt_b)
    };
    let p = rt_s.block_on(wait_pool(&survivor, me, "takeover", 15, |p| p.ready == 2));
    assert_eq!(p.ready, 2, "{p:?}");
    drop(dead);
    rt_dead.shutdown_background();
    for _ in 0..2 {
        rt_s.block_on(survivor.create_sandbox(me, claim("takeover")))
            .expect("claim on the survivor");
    }
    let p = rt_s.block_on(wait_pool(&survivor, me, "takeover", 20, |p| {
        p.owner && p.ready == 2
    }));
    assert!(
        p.owner && p.ready == 2,
        "the pool was not taken over: {p:?}"
    );
}

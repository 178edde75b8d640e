//! Two control-plane replicas over one state store and one node: what one does, the
//! other sees (through the store, within a second), and concurrent changes made on both
//! resolve in the store (compare-and-swap), not in either replica's memory. Run over the
//! in-memory store and over a real etcd.

mod common;

use common::op;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dsec_control::{ControlConfig, ControlPlane, SandboxApi};
use dsec_node_api::fake::FakeNode;
use dsec_state::{EtcdConfig, EtcdStore, FaultyStore, MemStore, StateStore};
use dsec_testkit::Etcd;
use dsec_wire::v1::{CreateSandboxRequest, SandboxState};
use dsec_wire::ErrorCode;

type TestResult = Result<(), Box<dyn std::error::Error>>;

struct Pair {
    a: Arc<ControlPlane>,
    b: Arc<ControlPlane>,
    node: Arc<FakeNode>,
}

async fn pair(store: Arc<dyn StateStore>) -> Result<Pair, Box<dyn std::error::Error>> {
    let node = Arc::new(FakeNode::new("fake-1"));
    let cfg = ControlConfig {
        sole_owner: false,
        reap_interval: Duration::from_millis(50),
        ..ControlConfig::with_key("k".into())
    };
    let a = ControlPlane::open(cfg.clone(), node.clone(), store.clone()).await?;
    let b = ControlPlane::open(cfg, node.clone(), store).await?;
    Ok(Pair { a, b, node })
}

/// Polls `f` until it holds, for at most `limit`; the time it took.
async fn within(limit: Duration, mut f: impl AsyncFnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if f().await {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}

async fn one_replica_sees_the_others_changes(p: &Pair) -> TestResult {
    let sb =
        p.a.create_sandbox(op(), CreateSandboxRequest::default())
            .await?;
    // Read-your-writes on any replica: a get goes to the store when its cache misses.
    assert_eq!(
        p.b.get_sandbox(op(), &sb.id).await?.state,
        SandboxState::Ready
    );
    let listed = within(Duration::from_secs(1), async || {
        p.b.list_sandboxes(op(), Default::default())
            .await
            .is_ok_and(|l| l.sandboxes.iter().any(|s| s.id == sb.id))
    })
    .await;
    assert!(listed.is_some(), "b lists a's sandbox within 1 s");

    p.b.pause_sandbox(op(), &sb.id).await?;
    let paused = within(Duration::from_secs(1), async || {
        p.a.get_sandbox(op(), &sb.id)
            .await
            .is_ok_and(|s| s.state == SandboxState::Paused)
    })
    .await;
    assert!(paused.is_some(), "a sees the pause within 1 s");
    p.a.resume_sandbox(op(), &sb.id).await?;
    // A read is as fresh as the replica's watch (within a second); a call is checked
    // against the store, so b can use the sandbox at once.
    p.b.exec(op(), &sb.id, dsec_node_api::fake::shell_request("true"))
        .await?;
    let resumed = within(Duration::from_secs(1), async || {
        p.b.get_sandbox(op(), &sb.id)
            .await
            .is_ok_and(|s| s.state == SandboxState::Ready)
    })
    .await;
    assert!(resumed.is_some(), "b sees the resume within 1 s");

    p.a.delete_sandbox(op(), &sb.id).await?;
    let gone = within(
        Duration::from_secs(1),
        async || matches!(p.b.get_sandbox(op(), &sb.id).await, Err(e) if e.code == ErrorCode::NotFound),
    )
    .await;
    assert!(gone.is_some(), "b forgets the deleted sandbox within 1 s");
    let e =
        p.b.delete_sandbox(op(), &sb.id)
            .await
            .expect_err("deleted twice");
    assert_eq!(e.code, ErrorCode::NotFound);
    Ok(())
}

/// Both replicas may build the sandbox (a create is stored once its node made it), but
/// one wins the key and the other destroys its own: one sandbox per key survives.
async fn a_keyed_create_on_both_replicas_makes_one_sandbox(p: &Pair) -> TestResult {
    let before = p.node.sandbox_ids();
    let mut made = Vec::new();
    for round in 0..10 {
        let req = CreateSandboxRequest {
            idempotency_key: Some(format!("race-{round}")),
            ..Default::default()
        };
        let (x, y) = tokio::join!(
            p.a.create_sandbox(op(), req.clone()),
            p.b.create_sandbox(op(), req.clone())
        );
        let (x, y) = (x?, y?);
        assert_eq!(x.id, y.id, "round {round}: both answers name one sandbox");
        assert_eq!(y.state, SandboxState::Ready);
        made.push(x.id);
        // A different body under the same key is refused on either replica.
        let other = CreateSandboxRequest {
            timeout_s: Some(99),
            ..req
        };
        let e =
            p.b.create_sandbox(op(), other)
                .await
                .expect_err("other body");
        assert_eq!(e.code, ErrorCode::Conflict);
    }
    let mut left: Vec<String> = p
        .node
        .sandbox_ids()
        .into_iter()
        .filter(|id| !before.contains(id))
        .collect();
    left.sort();
    made.sort();
    assert_eq!(left, made, "one sandbox per key on the node");
    // Deleted, the key is free again.
    let req = CreateSandboxRequest {
        idempotency_key: Some("race-0".into()),
        ..Default::default()
    };
    let first = p.a.create_sandbox(op(), req.clone()).await?;
    p.b.delete_sandbox(op(), &first.id).await?;
    let second = p.a.create_sandbox(op(), req).await?;
    assert_ne!(first.id, second.id);
    Ok(())
}

async fn concurrent_pauses_on_both_replicas_pause_once(p: &Pair) -> TestResult {
    let sb =
        p.a.create_sandbox(op(), CreateSandboxRequest::default())
            .await?;
    let (x, y) = tokio::join!(
        p.a.pause_sandbox(op(), &sb.id),
        p.b.pause_sandbox(op(), &sb.id)
    );
    let (x, y) = (x?, y?);
    assert_eq!(x.sandbox.state, SandboxState::Paused);
    assert_eq!(y.sandbox.state, SandboxState::Paused);
    // The loser of the race did not pause (its answer reports no memory change).
    assert!(
        x.memory_before_bytes == 0 || y.memory_before_bytes == 0,
        "only one replica paused the node's sandbox: {x:?} {y:?}"
    );
    let (x, y) = tokio::join!(
        p.a.delete_sandbox(op(), &sb.id),
        p.b.delete_sandbox(op(), &sb.id)
    );
    assert!(x.is_ok() || y.is_ok(), "{x:?} {y:?}");
    assert!(!p.node.sandbox_ids().contains(&sb.id));
    Ok(())
}

async fn all(store: Arc<dyn StateStore>) -> TestResult {
    let p = pair(store).await?;
    one_replica_sees_the_others_changes(&p).await?;
    a_keyed_create_on_both_replicas_makes_one_sandbox(&p).await?;
    concurrent_pauses_on_both_replicas_pause_once(&p).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_records_through_the_in_memory_store() -> TestResult {
    all(Arc::new(MemStore::new())).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_records_through_etcd() -> TestResult {
    let Some(etcd) = Etcd::start("replicas_share_records_through_etcd") else {
        return Ok(());
    };
    let store =
        EtcdStore::connect(EtcdConfig::new(etcd.endpoints(), "/dsec-test/replicas")).await?;
    all(Arc::new(store)).await
}

/// A replica killed in the middle of a keyed create (its runtime, and so its tasks and
/// lease keep-alive, gone): the retry on another replica finds the key, sees the create
/// abandoned once the dead replica's lease expires, undoes it and makes the sandbox.
#[test]
fn a_keyed_create_whose_replica_died_is_taken_over_by_the_retry() -> TestResult {
    let store: Arc<dyn StateStore> = Arc::new(MemStore::new());
    let node = Arc::new(FakeNode::new("fake-1"));
    let cfg = ControlConfig {
        sole_owner: false,
        reap_interval: Duration::from_secs(3600),
        ..ControlConfig::with_key("k".into())
    };
    // Init files make the create store its record (`creating`, claimed) before the node
    // is asked: the creates a takeover is for (a plain one is stored once, made).
    let req = CreateSandboxRequest {
        idempotency_key: Some("step-1/rollout-1".into()),
        files: vec![dsec_wire::v1::InitFile {
            path: "/task.txt".into(),
            content: "fix the bug".into(),
            encoding: Default::default(),
            mode: None,
        }],
        ..Default::default()
    };
    let rt_a = tokio::runtime::Runtime::new()?;
    let rt_b = tokio::runtime::Runtime::new()?;
    // b opens first: the in-memory store expires leases from a task on the runtime
    // that granted its first one, which must outlive a's.
    let b = rt_b.block_on(ControlPlane::open(cfg.clone(), node.clone(), store.clone()))?;
    node.stall_creates(true);
    let a = rt_a.block_on(ControlPlane::open(cfg, node.clone(), store))?;
    let doomed = {
        let (a, req) = (a.clone(), req.clone());
        rt_a.spawn(async move { a.create_sandbox(op(), req).await })
    };
    // The create reached the node: its record and key are stored, claimed by a.
    let started = Instant::now();
    while node.counters.create_calls.load(Ordering::Relaxed) == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "create never reached the node"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // a dies: its tasks go with its runtime, the node's create with them.
    drop(doomed);
    drop(a);
    rt_a.shutdown_background();
    node.stall_creates(false);

    let started = Instant::now();
    let sb = rt_b.block_on(b.create_sandbox(op(), req.clone()))?;
    assert_eq!(sb.state, SandboxState::Ready);
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "taken over within the lease's TTL: {:?}",
        started.elapsed()
    );
    assert_eq!(
        node.sandbox_ids(),
        vec![sb.id.clone()],
        "one sandbox on the node"
    );
    let listed = rt_b.block_on(b.list_sandboxes(op(), Default::default()))?;
    assert_eq!(
        listed.sandboxes.len(),
        1,
        "no record of the abandoned create left"
    );
    // The key now names the new sandbox.
    assert_eq!(rt_b.block_on(b.create_sandbox(op(), req))?.id, sb.id);
    Ok(())
}

/// A create told `unavailable` whose record the store kept anyway: a keyed one's retry
/// (on either replica) gets that sandbox, whole (its record and its node's sandbox), and
/// nothing else is made; an unkeyed one leaves nothing (its record is removed once it
/// shows, its sandbox destroyed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_answered_unavailable_but_stored_is_found_whole_or_leaves_nothing() -> TestResult {
    // Its next transactions are applied but answered `unavailable` when told: an etcd
    // that lost quorum with the proposal in flight and committed it when quorum came back.
    let store = Arc::new(FaultyStore::new(Arc::new(MemStore::new())));
    let p = pair(store.clone()).await?;
    for (retry_on, key) in [(&p.b, "lost-then-b"), (&p.a, "lost-then-a")] {
        let req = CreateSandboxRequest {
            idempotency_key: Some(key.into()),
            ..Default::default()
        };
        store.lose_answers.store(1, Ordering::SeqCst);
        let e =
            p.a.create_sandbox(op(), req.clone())
                .await
                .expect_err("the insert's answer was lost");
        assert_eq!(e.code, ErrorCode::Unavailable, "{e}");
        let sb = retry_on.create_sandbox(op(), req.clone()).await?;
        assert_eq!(sb.state, SandboxState::Ready, "{key}: the retry found it");
        assert_eq!(
            p.node.sandbox_ids(),
            std::slice::from_ref(&sb.id),
            "{key}: one sandbox, the kept one"
        );
        assert_eq!(p.a.create_sandbox(op(), req).await?.id, sb.id, "{key}");
        p.a.delete_sandbox(op(), &sb.id).await?;
    }
    // Unkeyed: the node's sandbox is destroyed and the record goes too.
    store.lose_answers.store(1, Ordering::SeqCst);
    let e =
        p.a.create_sandbox(op(), CreateSandboxRequest::default())
            .await
            .expect_err("the insert's answer was lost");
    assert_eq!(e.code, ErrorCode::Unavailable, "{e}");
    let cleared = within(Duration::from_secs(5), async || {
        let (records, _) = store.inner().list("sandboxes").await.unwrap_or_default();
        records.is_empty() && p.node.sandbox_ids().is_empty()
    })
    .await;
    assert!(cleared.is_some(), "{:?}", p.node.sandbox_ids());
    // Each replica's cache follows the store through its watch, a moment later.
    for c in [&p.a, &p.b] {
        let gone = within(Duration::from_secs(5), async || {
            c.list_sandboxes(op(), Default::default())
                .await
                .is_ok_and(|l| l.sandboxes.is_empty())
        })
        .await;
        let listed = c.list_sandboxes(op(), Default::default()).await?;
        assert!(gone.is_some(), "{:?}", listed.sandboxes);
    }
    Ok(())
}

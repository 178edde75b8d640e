//! What the control plane's integration tests share: principals and a plane over a
//! `FakeNode` and a real redb store. (Each test binary uses part of it.)
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use dsec_control::{ControlConfig, ControlPlane, Principal, Scope};
use dsec_node_api::fake::FakeNode;
use dsec_state::RedbStore;

/// The operator: the bootstrap key's principal (tenant `default`, every scope).
pub fn op() -> &'static dsec_control::Principal {
    static OP: std::sync::OnceLock<dsec_control::Principal> = std::sync::OnceLock::new();
    OP.get_or_init(dsec_control::Principal::bootstrap)
}

/// A principal of tenant `name` with the `sandboxes` scope.
pub fn tenant(name: &str) -> Principal {
    Principal {
        tenant: name.into(),
        key_id: format!("key-of-{name}"),
        scopes: vec![Scope::Sandboxes],
    }
}

/// A principal of tenant `name`, which is created on `plane` first.
pub async fn tenant_on(plane: &ControlPlane, name: &str) -> Principal {
    if let Err(e) = plane
        .iam()
        .create_tenant(name, dsec_iam::Quotas::default())
        .await
    {
        panic!("create tenant {name}: {e}");
    }
    tenant(name)
}

/// A plane (sole owner, reaping every 50 ms) over one fake node and a redb store in a
/// temporary directory.
pub struct Fixture {
    pub node: Arc<FakeNode>,
    pub store: Arc<RedbStore>,
    pub plane: Arc<ControlPlane>,
    pub dir: tempfile::TempDir,
}

impl Fixture {
    pub async fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let store =
            Arc::new(RedbStore::open(&dir.path().join("state.redb")).expect("open the store"));
        let node = Arc::new(FakeNode::new("fake-1"));
        let plane = open(&node, &store).await;
        Self {
            node,
            store,
            plane,
            dir,
        }
    }
}

/// Opens a plane over `node` and `store` (again, for a restart).
pub async fn open(node: &Arc<FakeNode>, store: &Arc<RedbStore>) -> Arc<ControlPlane> {
    let mut cfg = ControlConfig::with_key("k".into());
    cfg.reap_interval = Duration::from_millis(50);
    ControlPlane::open(cfg, node.clone(), store.clone())
        .await
        .unwrap_or_else(|e| panic!("open the plane: {e:?}"))
}

/// The next event of `feed`, within 5 s (a panic names the events `so_far`).
pub async fn next_event(
    feed: &mut dsec_control::EventFeed,
    so_far: &[dsec_wire::v1::Event],
) -> dsec_wire::v1::Event {
    use futures::StreamExt;
    match tokio::time::timeout(Duration::from_secs(5), feed.next()).await {
        Ok(Some(Ok(e))) => e,
        Ok(Some(Err(e))) => panic!("the feed failed: {e:?}; so far {so_far:#?}"),
        Ok(None) => panic!("the feed ended; so far {so_far:#?}"),
        Err(_) => panic!("no event within 5 s; so far {so_far:#?}"),
    }
}

/// The next `n` events of `feed`, each within 5 s.
pub async fn take(feed: &mut dsec_control::EventFeed, n: usize) -> Vec<dsec_wire::v1::Event> {
    let mut got = Vec::new();
    while got.len() < n {
        let e = next_event(feed, &got).await;
        got.push(e);
    }
    got
}

/// The events of `feed` until one passes `last` (each within 5 s), that one included.
pub async fn events_until(
    feed: &mut dsec_control::EventFeed,
    last: impl Fn(&dsec_wire::v1::Event) -> bool,
) -> Vec<dsec_wire::v1::Event> {
    let mut got = Vec::new();
    loop {
        let e = next_event(feed, &got).await;
        let done = last(&e);
        got.push(e);
        if done {
            return got;
        }
    }
}

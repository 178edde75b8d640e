//! The event log over a `FakeNode` and a real redb store: a sandbox's life comes out in
//! order with growing ids and causes; a reconnect replays from an id, also after the
//! store was reopened (its watch history gone); filters and tenants confine what a key
//! sees; events past the window are pruned; and with events off nothing is written.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{op, take, tenant_on};
use dsec_control::{ControlConfig, ControlPlane, SandboxApi};
use dsec_node_api::fake::FakeNode;
use dsec_state::{RedbStore, StateStore};
use dsec_wire::v1::{CreateSandboxRequest, Event, EventKind, EventQuery};
use dsec_wire::ErrorCode;
use futures::StreamExt;

type TestResult = Result<(), Box<dyn std::error::Error>>;

async fn plane_with(
    node: &Arc<FakeNode>,
    store: &Arc<RedbStore>,
    retention_s: u64,
) -> Arc<ControlPlane> {
    let mut cfg = ControlConfig::with_key("k".into());
    cfg.reap_interval = Duration::from_millis(50);
    cfg.events_retention_s = retention_s;
    ControlPlane::open(cfg, node.clone(), store.clone())
        .await
        .unwrap_or_else(|e| panic!("open the plane: {e:?}"))
}

fn kinds(events: &[Event]) -> Vec<EventKind> {
    events.iter().map(|e| e.kind).collect()
}

fn query(after: Option<u64>) -> EventQuery {
    EventQuery {
        after,
        ..Default::default()
    }
}

#[tokio::test]
async fn a_life_streams_in_order_and_replays_after_a_reopen() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("state.redb");
    let node = Arc::new(FakeNode::new("fake-1"));
    let store = Arc::new(RedbStore::open(&path)?);
    let plane = plane_with(&node, &store, 3600).await;

    let mut live = plane.events(op(), query(None)).await?;
    let req = CreateSandboxRequest {
        labels: [("job".to_string(), "e1".to_string())].into(),
        ..Default::default()
    };
    let sb = plane.create_sandbox(op(), req).await?;
    plane.pause_sandbox(op(), &sb.id).await?;
    plane.resume_sandbox(op(), &sb.id).await?;
    dsec_node_api::request_id::scope("req-delete-1".into(), async {
        plane.delete_sandbox(op(), &sb.id).await
    })
    .await?;
    let life = take(&mut live, 5).await;
    assert_eq!(
        kinds(&life),
        [
            EventKind::Created,
            EventKind::Ready,
            EventKind::Paused,
            EventKind::Resumed,
            EventKind::Deleted
        ]
    );
    for w in life.windows(2) {
        assert!(w[0].id < w[1].id, "ids grow: {life:#?}");
    }
    for e in &life {
        assert_eq!(e.sandbox.as_deref(), Some(sb.id.as_str()));
        assert_eq!(e.tenant.as_deref(), Some("default"));
        assert_eq!(e.labels.get("job").map(String::as_str), Some("e1"));
        assert_eq!(e.node.as_deref(), Some("fake-1"));
    }
    assert_eq!(life[4].request_id.as_deref(), Some("req-delete-1"));

    // A reconnect from the second event's id gets the three after it, not the rest.
    let mut again = plane.events(op(), query(Some(life[1].id))).await?;
    let replayed = take(&mut again, 3).await;
    assert_eq!(replayed, life[2..].to_vec());

    // A store opened anew (a copy of the file: the running plane keeps the original
    // locked) has no watch history: the kept events are listed instead.
    drop((live, again));
    let copy = dir.path().join("copy.redb");
    std::fs::copy(&path, &copy)?;
    let store = Arc::new(RedbStore::open(&copy)?);
    let plane = plane_with(&node, &store, 3600).await;
    let mut after_restart = plane.events(op(), query(Some(life[2].id))).await?;
    let replayed = take(&mut after_restart, 2).await;
    assert_eq!(replayed, life[3..].to_vec());
    // ... and it follows on from there.
    let sb2 = plane
        .create_sandbox(op(), CreateSandboxRequest::default())
        .await?;
    let next = take(&mut after_restart, 2).await;
    assert_eq!(kinds(&next), [EventKind::Created, EventKind::Ready]);
    assert_eq!(next[0].sandbox.as_deref(), Some(sb2.id.as_str()));

    // Without following: the kept ones, then the end.
    let all: Vec<Event> = plane
        .events(
            op(),
            EventQuery {
                after: Some(0),
                no_follow: true,
                ..Default::default()
            },
        )
        .await?
        .map(|e| e.expect("event"))
        .collect()
        .await;
    assert_eq!(all.len(), 7, "{all:#?}");
    Ok(())
}

#[tokio::test]
async fn expiry_carries_its_cause() -> TestResult {
    let fx = common::Fixture::new().await;
    let plane = &fx.plane;
    let mut feed = plane
        .events(
            op(),
            EventQuery {
                kind: Some("expired".into()),
                ..Default::default()
            },
        )
        .await?;
    let sb = plane
        .create_sandbox(
            op(),
            CreateSandboxRequest {
                timeout_s: Some(10),
                ..Default::default()
            },
        )
        .await?;
    fx.node.advance(Duration::from_secs(11));
    let expired = take(&mut feed, 1).await;
    assert_eq!(expired[0].kind, EventKind::Expired);
    assert_eq!(expired[0].sandbox.as_deref(), Some(sb.id.as_str()));
    let cause = expired[0].cause.clone().unwrap_or_default();
    assert!(
        cause.contains("timeout") || cause.contains("TTL") || cause.contains("lifetime"),
        "{cause}"
    );
    Ok(())
}

#[tokio::test]
async fn filters_and_tenants_confine_what_a_key_sees() -> TestResult {
    let fx = common::Fixture::new().await;
    let plane = &fx.plane;
    let alice = tenant_on(plane, "alice").await;
    let bob = tenant_on(plane, "bob").await;
    let mut alices = plane.events(&alice, query(None)).await?;
    let mut labelled = plane
        .events(
            op(),
            EventQuery {
                label: Some("team=b".into()),
                kind: Some("ready".into()),
                ..Default::default()
            },
        )
        .await?;
    let a = plane
        .create_sandbox(&alice, CreateSandboxRequest::default())
        .await?;
    let b = plane
        .create_sandbox(
            &bob,
            CreateSandboxRequest {
                labels: [("team".to_string(), "b".to_string())].into(),
                ..Default::default()
            },
        )
        .await?;
    plane.delete_sandbox(&alice, &a.id).await?;
    let seen = take(&mut alices, 3).await;
    assert!(
        seen.iter()
            .all(|e| e.sandbox.as_deref() == Some(a.id.as_str())),
        "alice sees only hers: {seen:#?}"
    );
    let seen = take(&mut labelled, 1).await;
    assert_eq!(
        (seen[0].kind, seen[0].sandbox.as_deref()),
        (EventKind::Ready, Some(b.id.as_str()))
    );

    let e = plane
        .events(
            &alice,
            EventQuery {
                tenant: Some("bob".into()),
                ..Default::default()
            },
        )
        .await
        .err()
        .ok_or("alice may not ask for bob's events")?;
    assert_eq!(e.code, ErrorCode::Forbidden);
    let e = plane
        .events(
            op(),
            EventQuery {
                kind: Some("exploded".into()),
                ..Default::default()
            },
        )
        .await
        .err()
        .ok_or("an unknown kind is refused")?;
    assert_eq!(e.code, ErrorCode::BadRequest);
    assert!(e.message.contains("oom_killed"), "{}", e.message);
    Ok(())
}

#[tokio::test]
async fn events_past_the_window_are_pruned_and_off_writes_none() -> TestResult {
    let dir = tempfile::tempdir()?;
    let node = Arc::new(FakeNode::new("fake-1"));
    let store = Arc::new(RedbStore::open(&dir.path().join("state.redb"))?);
    let plane = plane_with(&node, &store, 1).await;
    plane
        .create_sandbox(op(), CreateSandboxRequest::default())
        .await?;
    assert_eq!(store.list("events").await?.0.len(), 2);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !store.list("events").await?.0.is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "events older than the 1 s window were never pruned"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(plane);

    let dir = tempfile::tempdir()?;
    let store = Arc::new(RedbStore::open(&dir.path().join("state.redb"))?);
    let plane = plane_with(&node, &store, 0).await;
    let sb = plane
        .create_sandbox(op(), CreateSandboxRequest::default())
        .await?;
    plane.delete_sandbox(op(), &sb.id).await?;
    assert!(store.list("events").await?.0.is_empty());
    let e = plane
        .events(op(), query(None))
        .await
        .err()
        .ok_or("events are off")?;
    assert_eq!(e.code, ErrorCode::BadRequest);
    Ok(())
}

#[tokio::test]
async fn a_full_disk_is_an_event_once_and_clears_when_freed() -> TestResult {
    let fx = common::Fixture::new().await;
    let plane = &fx.plane;
    let mut feed = plane
        .events(
            op(),
            EventQuery {
                kind: Some("disk_full".into()),
                ..Default::default()
            },
        )
        .await?;
    let sb = plane
        .create_sandbox(op(), CreateSandboxRequest::default())
        .await?;
    fx.node.set_disk_free(&sb.id, 0);
    let full = take(&mut feed, 1).await;
    assert_eq!(full[0].sandbox.as_deref(), Some(sb.id.as_str()));
    assert!(
        full[0]
            .cause
            .as_deref()
            .unwrap_or_default()
            .contains("full"),
        "{full:?}"
    );
    // The record says so (this replica's cache may take a moment past the event).
    let id = sb.id.as_str();
    let marked = |full: bool| async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let sb = plane.get_sandbox(op(), id).await.expect("get");
            if sb.disk_full_since.is_some() == full {
                return;
            }
            assert!(tokio::time::Instant::now() < deadline, "{sb:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    marked(true).await;
    // Freed: the mark goes (no event); full again: a new event.
    fx.node.set_disk_free(&sb.id, 20);
    marked(false).await;
    fx.node.set_disk_free(&sb.id, 0);
    let again = take(&mut feed, 1).await;
    assert!(again[0].id > full[0].id);
    Ok(())
}

#[tokio::test]
async fn a_tenant_holds_at_most_its_share_of_open_streams() -> TestResult {
    let dir = tempfile::tempdir()?;
    let node = Arc::new(FakeNode::new("fake-1"));
    let store = Arc::new(RedbStore::open(&dir.path().join("state.redb"))?);
    let mut cfg = ControlConfig::with_key("k".into());
    cfg.max_event_streams_per_tenant = 2;
    let plane = ControlPlane::open(cfg, node.clone(), store.clone()).await?;
    let alice = tenant_on(&plane, "alice").await;
    let bob = tenant_on(&plane, "bob").await;
    let first = plane.events(&alice, query(None)).await?;
    let _second = plane.events(&alice, query(None)).await?;
    let e = plane
        .events(&alice, query(None))
        .await
        .err()
        .ok_or("a third stream is refused")?;
    assert_eq!(e.code, ErrorCode::QuotaExceeded, "{}", e.message);
    assert!(e.message.contains("2 event streams"), "{}", e.message);
    // Another tenant has its own share.
    let _bobs = plane.events(&bob, query(None)).await?;
    // A closed stream frees its place.
    drop(first);
    let _third = plane.events(&alice, query(None)).await?;
    Ok(())
}

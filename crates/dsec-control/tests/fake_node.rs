//! The control plane over a `FakeNode`: records, reconciliation at start, failures,
//! idempotent creates and lifetimes, without root or a real sandbox.

mod common;

use common::op;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use dsec_control::{ControlConfig, ControlPlane, SandboxApi};
use dsec_node_api::fake::{sandbox_spec, FakeNode};
use dsec_node_api::{NodeApi, NodeCreateSpec};
use dsec_state::RedbStore;
use dsec_wire::v1::{CreateSandboxRequest, SandboxState};
use dsec_wire::{ApiError, ErrorCode};
use futures::StreamExt;

use dsec_node_api::fake::shell_request as shell;

type TestResult = Result<(), Box<dyn std::error::Error>>;

struct Fixture {
    node: Arc<FakeNode>,
    store: Arc<RedbStore>,
    _dir: tempfile::TempDir,
}

impl Fixture {
    fn new() -> Result<Self, Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let store = Arc::new(RedbStore::open(&dir.path().join("state.redb"))?);
        Ok(Self {
            node: Arc::new(FakeNode::new("fake-1")),
            store,
            _dir: dir,
        })
    }

    async fn plane(&self) -> Result<Arc<ControlPlane>, ApiError> {
        let mut cfg = ControlConfig::with_key("k".into());
        cfg.reap_interval = Duration::from_millis(50);
        ControlPlane::open(cfg, self.node.clone(), self.store.clone()).await
    }
}

fn bytes(b: &'static str) -> dsec_control::ByteStream {
    dsec_node_api::once_bytes(b)
}

#[tokio::test]
async fn a_sandbox_lives_on_its_node_from_create_to_delete() -> TestResult {
    let fx = Fixture::new()?;
    let plane = fx.plane().await?;
    let sb = plane
        .create_sandbox(op(), CreateSandboxRequest::default())
        .await?;
    assert_eq!(sb.state, SandboxState::Ready);
    assert_eq!(fx.node.sandbox_ids(), std::slice::from_ref(&sb.id));

    plane
        .write_file(op(), &sb.id, "/w/f", None, bytes("data"), None)
        .await?;
    let r = plane.exec(op(), &sb.id, shell("cat /w/f")).await?;
    assert_eq!((r.stdout.as_str(), r.exit.exit_code), ("data", Some(0)));
    let events: Vec<_> = plane
        .exec_stream(op(), &sb.id, shell("echo hi"))
        .await?
        .collect()
        .await;
    assert!(
        matches!(events.last(), Some(dsec_wire::v1::ExecEvent::Exit { exit, .. }) if exit.exit_code == Some(0)),
        "{events:?}"
    );

    plane.delete_sandbox(op(), &sb.id).await?;
    assert!(fx.node.sandbox_ids().is_empty());
    let e = plane.get_sandbox(op(), &sb.id).await.expect_err("deleted");
    assert_eq!(e.code, ErrorCode::NotFound);
    Ok(())
}

#[tokio::test]
async fn a_failed_node_create_leaves_no_record_and_no_sandbox() -> TestResult {
    let fx = Fixture::new()?;
    let plane = fx.plane().await?;
    fx.node
        .fail_next_create(ApiError::new(ErrorCode::Failed, "mount failed"));
    let e = plane
        .create_sandbox(op(), CreateSandboxRequest::default())
        .await
        .expect_err("node refused");
    assert_eq!(e.code, ErrorCode::Failed);
    fx.node.set_max_sandboxes(1);
    plane
        .create_sandbox(op(), CreateSandboxRequest::default())
        .await?;
    let e = plane
        .create_sandbox(op(), CreateSandboxRequest::default())
        .await
        .expect_err("node full");
    assert_eq!(e.code, ErrorCode::Capacity, "retryable, as the node said");
    let list = plane.list_sandboxes(op(), Default::default()).await?;
    assert_eq!(list.sandboxes.len(), 1, "only the admitted one is recorded");
    assert_eq!(fx.node.sandbox_ids().len(), 1);
    Ok(())
}

#[tokio::test]
async fn a_restart_destroys_unrecorded_sandboxes_and_fails_vanished_ones() -> TestResult {
    let fx = Fixture::new()?;
    let (kept, vanished) = {
        let plane = fx.plane().await?;
        let a = plane
            .create_sandbox(op(), CreateSandboxRequest::default())
            .await?;
        let b = plane
            .create_sandbox(op(), CreateSandboxRequest::default())
            .await?;
        (a.id, b.id)
    };
    // While the control plane is down: one sandbox disappears from the node, and one
    // appears that no record knows (a create cut off before its record was written).
    fx.node.destroy(&vanished).await?;
    let stray = NodeCreateSpec {
        id: "sb-stray".into(),
        ..sandbox_spec(&fx.node.list().await.expect("node lists")[0].id)
    };
    fx.node.adopt(stray);

    let plane = fx.plane().await?;
    assert_eq!(
        fx.node.sandbox_ids(),
        std::slice::from_ref(&kept),
        "the stray one is gone"
    );
    assert_eq!(
        plane.get_sandbox(op(), &kept).await?.state,
        SandboxState::Ready
    );
    let gone = plane.get_sandbox(op(), &vanished).await?;
    assert_eq!(gone.state, SandboxState::Failed);
    assert!(gone
        .failure
        .unwrap_or_default()
        .contains("no longer running"));
    let r = plane.exec(op(), &kept, shell("echo still")).await?;
    assert_eq!(r.stdout, "still\n");
    Ok(())
}

#[tokio::test]
async fn a_keyed_create_retried_finds_the_first_and_a_different_body_conflicts() -> TestResult {
    let fx = Fixture::new()?;
    let plane = fx.plane().await?;
    let req = CreateSandboxRequest {
        idempotency_key: Some("step-7/rollout-3".into()),
        ..Default::default()
    };
    let first = plane.create_sandbox(op(), req.clone()).await?;
    let again = plane.create_sandbox(op(), req.clone()).await?;
    assert_eq!(first.id, again.id);
    assert_eq!(fx.node.counters.creates.load(Ordering::Relaxed), 1);
    let other = CreateSandboxRequest {
        timeout_s: Some(77),
        ..req
    };
    let e = plane
        .create_sandbox(op(), other)
        .await
        .expect_err("other body");
    assert_eq!(e.code, ErrorCode::Conflict);
    assert_eq!(fx.node.sandbox_ids().len(), 1);
    Ok(())
}

#[tokio::test]
async fn a_lifetime_ends_on_the_node_and_leaves_an_expired_answer() -> TestResult {
    let fx = Fixture::new()?;
    let plane = fx.plane().await?;
    let sb = plane
        .create_sandbox(
            op(),
            CreateSandboxRequest {
                timeout_s: Some(1),
                ..Default::default()
            },
        )
        .await?;
    // The node keeps the clock (the fake one moves when told): its sandbox goes first,
    // then the record.
    fx.node.advance(Duration::from_secs(2));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let e = loop {
        if let Err(e) = plane.get_sandbox(op(), &sb.id).await {
            break e;
        }
        assert!(tokio::time::Instant::now() < deadline, "not reaped in 10 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(e.code, ErrorCode::Expired);
    assert!(fx.node.sandbox_ids().is_empty());
    Ok(())
}

#[tokio::test]
async fn an_unreachable_node_fails_calls_with_a_retryable_code() -> TestResult {
    let fx = Fixture::new()?;
    let plane = fx.plane().await?;
    let sb = plane
        .create_sandbox(op(), CreateSandboxRequest::default())
        .await?;
    fx.node.set_down(true);
    let e = plane
        .exec(op(), &sb.id, shell("true"))
        .await
        .expect_err("down");
    assert_eq!(e.code, ErrorCode::AgentUnavailable);
    // A delete the node refuses changes nothing: the sandbox stays ready, for a retry.
    let e = plane.delete_sandbox(op(), &sb.id).await.expect_err("down");
    assert_eq!(e.code, ErrorCode::AgentUnavailable);
    fx.node.set_down(false);
    assert_eq!(
        plane.get_sandbox(op(), &sb.id).await?.state,
        SandboxState::Ready
    );
    plane.exec(op(), &sb.id, shell("true")).await?;
    plane.delete_sandbox(op(), &sb.id).await?;
    assert!(fx.node.sandbox_ids().is_empty());
    let e = plane.get_sandbox(op(), &sb.id).await.expect_err("deleted");
    assert_eq!(e.code, ErrorCode::NotFound);
    Ok(())
}

#[tokio::test]
async fn timeout_changes_and_job_suspends_reach_the_nodes_clock() -> TestResult {
    let fx = Fixture::new()?;
    let plane = fx.plane().await?;
    let job = |n: &str| CreateSandboxRequest {
        timeout_s: Some(10),
        labels: [("job".to_string(), n.to_string())].into(),
        ..Default::default()
    };
    let extended = plane.create_sandbox(op(), job("a")).await?;
    let held = plane.create_sandbox(op(), job("b")).await?;
    let plain = plane.create_sandbox(op(), job("c")).await?;
    plane
        .set_timeout(
            op(),
            &extended.id,
            dsec_wire::v1::SetTimeoutRequest { timeout_s: 100 },
        )
        .await?;
    plane.suspend_job(op(), "b").await?;
    let ended = fx.node.advance(Duration::from_secs(20));
    assert_eq!(
        ended,
        vec![plain.id.clone()],
        "only the unchanged lifetime ended"
    );
    plane.resume_job(op(), "b").await?;
    let ended = fx.node.advance(Duration::from_secs(9));
    assert!(
        ended.is_empty(),
        "the held clock resumed where it stopped: {ended:?}"
    );
    let ended = fx.node.advance(Duration::from_secs(2));
    assert_eq!(ended, vec![held.id.clone()]);
    let e = plane.get_sandbox(op(), &extended.id).await;
    assert!(e.is_ok(), "the extended one lives on: {e:?}");
    Ok(())
}

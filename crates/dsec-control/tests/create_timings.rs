//! A create over a `FakeNode` (which times none of its own phases): its request id reaches
//! the node; its phases are in the answer when asked, back to back and adding up to the
//! total; the record keeps them; the histograms count each create once per phase.

mod common;

use std::sync::Arc;

use common::op;
use dsec_control::{ControlConfig, ControlPlane, SandboxApi};
use dsec_node_api::fake::FakeNode;
use dsec_state::RedbStore;
use dsec_wire::v1::CreateSandboxRequest;

type TestResult = Result<(), Box<dyn std::error::Error>>;

#[tokio::test]
async fn a_create_reports_its_phases_and_counts_them() -> TestResult {
    let dir = tempfile::tempdir()?;
    let store = Arc::new(RedbStore::open(&dir.path().join("state.redb"))?);
    let node = Arc::new(FakeNode::new("fake-1"));
    let plane = ControlPlane::open(ControlConfig::with_key("k".into()), node, store)
        .await
        .map_err(|e| format!("open the plane: {e:?}"))?;

    let asked = plane
        .create_sandbox(
            op(),
            CreateSandboxRequest {
                timings: true,
                ..CreateSandboxRequest::default()
            },
        )
        .await?;
    let t = asked.timings.clone().ok_or("timings asked for")?;
    let names: Vec<&str> = t.phases.iter().map(|p| p.phase.as_str()).collect();
    assert_eq!(
        names,
        [
            "validate",
            "placement",
            "images",
            "store",
            "node_call",
            "commit"
        ]
    );
    for w in t.phases.windows(2) {
        assert!(
            (w[0].start_ms + w[0].ms - w[1].start_ms).abs() < 1e-6,
            "{t:?}"
        );
    }
    let sum: f64 = t.phases.iter().map(|p| p.ms).sum();
    assert!((sum - t.total_ms).abs() < 1e-6, "{t:?}");

    // Not asked: none in the answer; the record has them (up to its write).
    let plain = plane
        .create_sandbox(op(), CreateSandboxRequest::default())
        .await?;
    assert_eq!(plain.timings, None);
    let kept = plane.get_sandbox(op(), &plain.id).await?.timings;
    let kept = kept.ok_or("the record keeps them")?;
    assert_eq!(
        kept.phases.last().map(|p| p.phase.as_str()),
        Some("node_call")
    );

    let stats = plane.create_phase_stats(op()).await?;
    assert_eq!(stats.total.count, 2);
    let commit = stats
        .phases
        .iter()
        .find(|h| h.phase == "commit")
        .ok_or("commit counted")?;
    assert_eq!(commit.count, 2);
    assert_eq!(commit.counts.iter().sum::<u64>(), 2);
    Ok(())
}

#[tokio::test]
async fn the_request_id_goes_with_the_create_to_the_node() -> TestResult {
    let dir = tempfile::tempdir()?;
    let store = Arc::new(RedbStore::open(&dir.path().join("state.redb"))?);
    let node = Arc::new(FakeNode::new("fake-1"));
    let plane = ControlPlane::open(ControlConfig::with_key("k".into()), node.clone(), store)
        .await
        .map_err(|e| format!("open the plane: {e:?}"))?;
    // The create runs in a task of its own (it finishes if its caller leaves): the id
    // is carried there.
    let id: Arc<str> = Arc::from("trainer-1:step-9");
    let sb = dsec_node_api::request_id::scope(
        id,
        plane.create_sandbox(op(), CreateSandboxRequest::default()),
    )
    .await?;
    assert_eq!(
        node.create_request_id(&sb.id).as_deref(),
        Some("trainer-1:step-9")
    );
    Ok(())
}

//! The watchdog over a `FakeNode`, on tokio's paused clock: what marks a sandbox
//! `unhealthy` and what must not.

mod common;

use common::op;
use std::sync::Arc;
use std::time::Duration;

use dsec_control::{ControlConfig, ControlPlane, SandboxApi};
use dsec_node_api::fake::FakeNode;
use dsec_state::MemStore;
use dsec_wire::v1::{CreateSandboxRequest, SandboxState};

use dsec_node_api::fake::shell_request as shell;

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// A ping in flight when the sandbox is paused, answered only after a resume that set
/// the state `ready` before the agent thawed, must not mark the sandbox `unhealthy`.
///
/// Timeline (the watchdog's first ping goes out after 3 s of silence and gives up 3 s
/// later): the exec is silent for 20 s; ping at 3 s (it takes 2 s); pause at 4 s; resume
/// asked at 5.5 s (state `ready` at once), the agent thaws at 6.5 s and answers the ping
/// then, after its 6 s deadline.
#[tokio::test(start_paused = true)]
async fn a_ping_overlapping_a_pause_and_resume_does_not_mark_the_sandbox_unhealthy() -> TestResult {
    let node = Arc::new(FakeNode::new("fake-1"));
    node.set_ping_latency(Duration::from_secs(2));
    node.freeze_on_pause(Duration::from_secs(1));
    let plane = ControlPlane::open(
        ControlConfig::with_key("k".into()),
        node.clone(),
        Arc::new(MemStore::new()),
    )
    .await?;
    let sb = plane
        .create_sandbox(op(), CreateSandboxRequest::default())
        .await?;
    let start = tokio::time::Instant::now();

    let exec = tokio::spawn({
        let (plane, id) = (plane.clone(), sb.id.clone());
        async move { plane.exec(op(), &id, shell("sleep 20")).await }
    });
    tokio::time::sleep_until(start + Duration::from_secs(4)).await;
    plane.pause_sandbox(op(), &sb.id).await?;
    tokio::time::sleep_until(start + Duration::from_millis(5500)).await;
    let resumed = plane.resume_sandbox(op(), &sb.id).await?;
    assert_eq!(resumed.state, SandboxState::Ready);
    assert!(
        start.elapsed() >= Duration::from_millis(6500),
        "the thaw took its time"
    );

    let r = exec.await??;
    assert_eq!(r.exit.exit_code, Some(0), "{r:?}");
    let after = plane.get_sandbox(op(), &sb.id).await?;
    assert_eq!(after.state, SandboxState::Ready, "{after:?}");
    Ok(())
}

/// The check still works: an agent frozen for good while its sandbox reads `ready` is
/// found out and the call fails with `agent_unavailable`.
#[tokio::test(start_paused = true)]
async fn an_agent_that_never_answers_marks_its_sandbox_unhealthy() -> TestResult {
    let node = Arc::new(FakeNode::new("fake-1"));
    node.set_ping_latency(Duration::from_secs(3600));
    let plane = ControlPlane::open(
        ControlConfig::with_key("k".into()),
        node.clone(),
        Arc::new(MemStore::new()),
    )
    .await?;
    let sb = plane
        .create_sandbox(op(), CreateSandboxRequest::default())
        .await?;
    let start = tokio::time::Instant::now();
    let err = match plane.exec(op(), &sb.id, shell("sleep 20")).await {
        Ok(r) => return Err(format!("exec answered {r:?}").into()),
        Err(e) => e,
    };
    assert_eq!(err.code, dsec_wire::ErrorCode::AgentUnavailable, "{err:?}");
    assert!(
        start.elapsed() < Duration::from_secs(7),
        "{:?}",
        start.elapsed()
    );
    let after = plane.get_sandbox(op(), &sb.id).await?;
    assert_eq!(after.state, SandboxState::Unhealthy, "{after:?}");
    Ok(())
}

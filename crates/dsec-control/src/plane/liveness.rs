//! Deadlines on agent calls and the health of agents.
//!
//! A sandbox's agent can stop answering while its sandbox runs: stopped (SIGSTOP, a
//! tracer), hung, or starved of CPU. Its callers must not hang with it, so every agent
//! call runs under [`ControlPlane::guarded`]:
//! - a hard deadline where the call has one: an exec or session command with a timeout
//!   answers `timeout` at its timeout plus a grace (the agent's own timeout answer
//!   normally comes first), other short calls (files, stat, sessions, process start)
//!   after [`CALL_DEADLINE`];
//! - a watchdog for every call and stream: once a call is silent for
//!   [`FIRST_CHECK`], and then at doubling intervals up to [`MAX_CHECK`], the agent is
//!   pinged on a second connection. A ping unanswered within [`PING_TIMEOUT`] marks the
//!   sandbox `unhealthy` with the cause and fails the call with `agent_unavailable`.
//!
//! So an idle sandbox costs nothing (no timer, no ping): agents are checked only while
//! a call to them is outstanding and silent. An `unhealthy` sandbox fails calls at once;
//! a recovery task pings it (every [`RECOVER_MAX`] at most) and sets it `ready` again
//! when it answers. Only a `ready` sandbox is marked: a paused (frozen) one's agent
//! cannot answer and is not checked, and a ping during which the sandbox was seen
//! paused proves nothing either way.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::time::Duration;

use dsec_wire::v1::SandboxState;
use dsec_wire::{ApiError, ErrorCode};

use super::{now_ms, ApiResult, ControlPlane};

/// How long a call may be silent before its agent is first pinged.
pub const FIRST_CHECK: Duration = Duration::from_secs(3);
/// Longest interval between pings while a call stays silent and the agent answers.
pub const MAX_CHECK: Duration = Duration::from_secs(30);
/// How long a ping may take before the agent counts as unresponsive.
pub const PING_TIMEOUT: Duration = Duration::from_secs(3);
/// Grace over an exec's own `timeout_s` before the node answers `timeout` itself.
pub const EXEC_GRACE: Duration = Duration::from_secs(3);
/// Grace over a session command's `timeout_s`: the agent interrupts it, kills its group
/// 2 s later and gives up on its output 5 s after that.
pub const SESSION_GRACE: Duration = Duration::from_secs(10);
/// Deadline of calls without a timeout of their own (file operations, stat, session and
/// process management): generous, but finite.
pub const CALL_DEADLINE: Duration = Duration::from_secs(300);
/// How often a ping in flight looks at its sandbox's state (see [`ControlPlane::ping`]).
const PING_STATE_POLL: Duration = Duration::from_millis(100);
/// Longest interval between pings of an `unhealthy` sandbox.
pub const RECOVER_MAX: Duration = Duration::from_secs(5);

/// A hard deadline of one call and the error it answers with.
#[derive(Debug, Clone)]
pub(super) struct Limit {
    after: Duration,
    error: ApiError,
}

impl Limit {
    /// An exec with the agent-side timeout `timeout_ms`.
    pub(super) fn exec(timeout_ms: u64) -> Self {
        Self::past_timeout(timeout_ms, EXEC_GRACE)
    }

    /// A session command with the agent-side timeout `timeout_ms`.
    pub(super) fn session(timeout_ms: u64) -> Self {
        Self::past_timeout(timeout_ms, SESSION_GRACE)
    }

    fn past_timeout(timeout_ms: u64, grace: Duration) -> Self {
        Self {
            after: Duration::from_millis(timeout_ms) + grace,
            error: ApiError::new(
                ErrorCode::Timeout,
                format!(
                    "the command did not finish within its timeout_s ({:.1}s), and the sandbox's agent did not answer within {}s more; its agent is being checked",
                    timeout_ms as f64 / 1000.0,
                    grace.as_secs()
                ),
            ),
        }
    }

    /// Any other short call.
    pub(super) fn call() -> Self {
        Self {
            after: CALL_DEADLINE,
            error: ApiError::new(
                ErrorCode::Timeout,
                format!(
                    "the sandbox's agent did not answer within {}s",
                    CALL_DEADLINE.as_secs()
                ),
            ),
        }
    }

    /// A deadline for a stream that started now.
    pub(super) fn deadline(&self) -> (tokio::time::Instant, ApiError) {
        (tokio::time::Instant::now() + self.after, self.error.clone())
    }
}

pub(super) fn unhealthy_error(id: &str, cause: &str) -> ApiError {
    ApiError::new(
        ErrorCode::AgentUnavailable,
        format!(
            "sandbox {id} is unhealthy: {cause}; calls work again once its agent answers (the sandbox then goes back to ready), or delete it"
        ),
    )
}

/// Watches one sandbox's agent while a call to it is outstanding.
#[derive(Debug, Clone)]
pub(super) struct Watchdog {
    plane: std::sync::Weak<ControlPlane>,
    id: String,
}

impl Watchdog {
    /// Resolves only when the agent is found unresponsive (or already `unhealthy`):
    /// pings it after [`FIRST_CHECK`] of silence, then at doubling intervals.
    pub(super) async fn dead(&self) -> ApiError {
        let mut wait = FIRST_CHECK;
        loop {
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(MAX_CHECK);
            let Some(plane) = self.plane.upgrade() else {
                return std::future::pending().await;
            };
            if let Err(e) = plane.check_agent(&self.id).await {
                return e;
            }
        }
    }
}

impl ControlPlane {
    pub(super) fn watchdog(&self, id: &str) -> Watchdog {
        Watchdog {
            plane: self.me.clone(),
            id: id.to_string(),
        }
    }

    /// Runs `call`, an agent call of sandbox `id`, under `limit` and the watchdog.
    pub(super) async fn guarded<T>(
        &self,
        id: &str,
        limit: Option<Limit>,
        call: impl Future<Output = ApiResult<T>>,
    ) -> ApiResult<T> {
        tokio::pin!(call);
        let hard = async {
            match &limit {
                Some(l) => {
                    tokio::time::sleep(l.after).await;
                    l.error.clone()
                }
                None => std::future::pending().await,
            }
        };
        let watchdog = self.watchdog(id);
        tokio::select! {
            r = &mut call => r,
            e = hard => {
                // The call's connection goes with `call`; find out in the background
                // whether the agent itself is gone, so the next caller is told at once.
                let watchdog = watchdog.clone();
                tokio::spawn(async move {
                    if let Some(plane) = watchdog.plane.upgrade() {
                        let _ = plane.check_agent(&watchdog.id).await;
                    }
                });
                Err(e)
            }
            e = watchdog.dead() => Err(e),
        }
    }

    /// Whether sandbox `id`'s agent answers: `Err` when it is `unhealthy` or becomes so
    /// now. Sandboxes in any state but `ready` are not pinged (a paused one cannot
    /// answer; a deleted or failed one is not the watchdog's business).
    pub(super) async fn check_agent(&self, id: &str) -> ApiResult<()> {
        let (state, cause) = match self.records.get(id) {
            Some(sb) => (sb.state, sb.unhealthy_cause.clone()),
            None => return Ok(()),
        };
        match state {
            SandboxState::Unhealthy => {
                return Err(unhealthy_error(id, cause.as_deref().unwrap_or("")));
            }
            SandboxState::Ready => {}
            _ => return Ok(()),
        }
        match self.ping(id, SandboxState::Ready).await {
            Ok(()) => Ok(()),
            Err(cause) => {
                if self.mark_unhealthy(id, &cause).await {
                    Err(unhealthy_error(id, &cause))
                } else {
                    // Paused or deleted meanwhile: the silence is explained.
                    Ok(())
                }
            }
        }
    }

    /// Pings sandbox `id`'s agent, which is in state `state`; `Err` says what went
    /// wrong. The ping is given up as `Ok` (nothing learned) once the sandbox is seen
    /// in another state: a pause freezes the agent, and a resume sets the state `ready`
    /// before the agent is thawed and answers, so a ping that overlapped a pause and
    /// resume could time out while the state reads `ready` again.
    async fn ping(&self, id: &str, state: SandboxState) -> Result<(), String> {
        // A node that is not live says nothing of the agent: the reaper marks its
        // sandboxes `lost`.
        let Some(node) = self.records.get(id).and_then(|sb| self.node_of(&sb).ok()) else {
            return Ok(());
        };
        let ping = node.ping(id);
        tokio::pin!(ping);
        let deadline = tokio::time::Instant::now() + PING_TIMEOUT;
        loop {
            let poll = (tokio::time::Instant::now() + PING_STATE_POLL).min(deadline);
            tokio::select! {
                r = &mut ping => return r.map_err(|e| e.message),
                () = tokio::time::sleep_until(poll) => {}
            }
            if self.records.get(id).map(|s| s.state) != Some(state) {
                return Ok(());
            }
            if poll == deadline {
                return Err(format!(
                    "its agent did not answer a ping within {}s (stopped, hung or starved of CPU)",
                    PING_TIMEOUT.as_secs()
                ));
            }
        }
    }

    /// Marks a `ready` sandbox `unhealthy` and starts its recovery; false if it was not
    /// `ready` (paused, deleted, already unhealthy).
    async fn mark_unhealthy(&self, id: &str, cause: &str) -> bool {
        let since = now_ms();
        let marked = self
            .records
            .update(id, |sb| {
                if sb.state != SandboxState::Ready {
                    return Ok(false);
                }
                sb.state = SandboxState::Unhealthy;
                sb.unhealthy_cause = Some(cause.to_string());
                sb.unhealthy_since = Some(since);
                Ok(true)
            })
            .await;
        match marked {
            Ok(Some((_, true))) => {}
            Ok(Some((sb, false))) => return sb.state == SandboxState::Unhealthy,
            Ok(None) => return false,
            Err(e) => {
                tracing::warn!(%id, error = %e.message, "could not store the unhealthy state");
                return false;
            }
        }
        self.unhealthy_marks.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(%id, cause, "sandbox unhealthy: its agent does not answer");
        self.spawn_recovery(id);
        true
    }

    /// Pings an `unhealthy` sandbox until its agent answers (then it is `ready` again)
    /// or it leaves that state (deleted, failed).
    pub(super) fn spawn_recovery(&self, id: &str) {
        let plane = self.me.clone();
        let id = id.to_string();
        tokio::spawn(async move {
            let mut wait = Duration::from_millis(500);
            loop {
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(RECOVER_MAX);
                let Some(plane) = plane.upgrade() else { return };
                if plane.records.get(&id).map(|s| s.state) != Some(SandboxState::Unhealthy) {
                    return;
                }
                if plane.ping(&id, SandboxState::Unhealthy).await.is_err() {
                    continue;
                }
                let now = now_ms();
                let recovered = plane
                    .records
                    .update(&id, |sb| {
                        if sb.state != SandboxState::Unhealthy {
                            return Ok(false);
                        }
                        sb.state = SandboxState::Ready;
                        sb.unhealthy_cause = None;
                        sb.unhealthy_since = None;
                        sb.last_active_at = now;
                        Ok(true)
                    })
                    .await;
                if let Ok(Some((_, true))) = recovered {
                    tracing::info!(%id, "sandbox healthy again: its agent answers");
                }
                return;
            }
        });
    }

    /// Sandboxes `unhealthy` now.
    pub(super) fn unhealthy_count(&self) -> u64 {
        self.records.count(|s| s.state == SandboxState::Unhealthy) as u64
    }
}

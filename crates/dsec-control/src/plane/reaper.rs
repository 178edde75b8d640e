//! The reaper: the node ends lifetimes (TTL, idle timeout) on its own; this pass turns
//! what it ended into `expired` tombstones, removes records left past their lifetime,
//! marks sandboxes whose init died `failed`, and forgets old tombstones.

use std::sync::atomic::Ordering;

use super::*;

use dsec_node_api::lifetime;

/// How long past its end a lifetime must be before a record without a sandbox on its
/// node is removed (the node's own reaper ends sandboxes on time; this is the rest).
const LAPSE_GRACE_MS: u64 = 5_000;
/// How often old tombstones are looked for.
const TOMBSTONE_PRUNE_MS: u64 = 60_000;

impl ControlPlane {
    pub(super) fn spawn_reaper(self: Arc<Self>) {
        let weak = Arc::downgrade(&self);
        let interval = self.cfg.reap_interval;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            loop {
                tick.tick().await;
                let Some(plane) = weak.upgrade() else { return };
                plane.reap_once().await;
            }
        });
    }

    /// One pass: turn the sandboxes the node ended (lifetime or idle timeout: the node
    /// owns lifetimes) into `expired` tombstones, remove records whose lifetime is over
    /// and whose sandbox the node no longer has, mark dead ones failed, forget old
    /// tombstones. Every step is safe on several replicas at once (conditional writes,
    /// idempotent destroys).
    pub(super) async fn reap_once(&self) {
        let now = now_ms();
        let on_node = self.node.list().await;
        for ended in on_node.iter().filter(|s| s.ended.is_some()) {
            let reason = ended.ended.clone().unwrap_or_default();
            if let Ok(Some(sb)) = self.records.find(&ended.id).await {
                tracing::info!(id = %sb.id, %reason, "the node ended the sandbox's lifetime");
                let tombstone = records::Tombstone { reason, at: now };
                if let Err(e) = self.records.remove(&sb, Some(tombstone)).await {
                    tracing::warn!(id = %sb.id, error = %e.message, "recording the end failed; will retry");
                    continue;
                }
            }
            // Forgets the node's stub.
            let _ = self.node.destroy(&ended.id).await;
        }
        let held =
            |s: &Sandbox| s.job_suspended_at.is_some() && self.cfg.job_suspend_stops_lifetime;
        let known: std::collections::HashSet<&str> =
            on_node.iter().map(|s| s.id.as_str()).collect();
        // Past its lifetime with nothing left on the node (a failed sandbox, a delete that
        // failed midway): the record goes, with its answer. `creating` ones belong to a
        // create in flight.
        let lapsed = self.records.filter(|s| {
            s.state != SandboxState::Creating
                && !held(s)
                && now >= s.expires_at.saturating_add(LAPSE_GRACE_MS)
                && !known.contains(s.id.as_str())
        });
        for sb in lapsed {
            tracing::info!(id = %sb.id, "removing the record of a sandbox past its lifetime");
            if let Err(e) = self.remove(&sb.id, Some(lifetime::TTL_ENDED)).await {
                tracing::warn!(id = %sb.id, error = %e.message, "reaping failed; will retry");
            }
        }
        // Creates whose replica died midway (replicas sharing the store only).
        for sb in self.records.filter(|s| s.state == SandboxState::Creating) {
            if matches!(self.records.abandoned(&sb).await, Ok(true)) {
                tracing::info!(id = %sb.id, "undoing a create whose replica is gone");
                if self.node.destroy(&sb.id).await.is_ok() {
                    let _ = self.records.remove(&sb, None).await;
                }
            }
        }
        let alive: HashMap<String, bool> = on_node
            .into_iter()
            .filter(|s| s.ended.is_none())
            .map(|s| (s.id, s.alive))
            .collect();
        let died = self.records.filter(|s| {
            matches!(
                s.state,
                SandboxState::Ready | SandboxState::Paused | SandboxState::Unhealthy
            ) && alive.get(&s.id) == Some(&false)
        });
        for sb in died {
            let marked = self
                .records
                .update(&sb.id, |s| {
                    if !matches!(
                        s.state,
                        SandboxState::Ready | SandboxState::Paused | SandboxState::Unhealthy
                    ) {
                        return Ok(false);
                    }
                    s.state = SandboxState::Failed;
                    s.failure = Some("the sandbox's init process exited".into());
                    Ok(true)
                })
                .await;
            if let Ok(Some((_, true))) = marked {
                tracing::warn!(id = %sb.id, "sandbox died");
            }
        }
        if now.saturating_sub(self.tombstones_pruned_at.load(Ordering::Relaxed))
            > TOMBSTONE_PRUNE_MS
        {
            self.tombstones_pruned_at.store(now, Ordering::Relaxed);
            self.records.prune_tombstones(now, TOMBSTONE_TTL_MS).await;
        }
    }

    /// Destroys a sandbox and forgets it; with `expired_reason`, remembers why.
    pub(super) async fn remove(&self, id: &str, expired_reason: Option<&str>) -> ApiResult<()> {
        let (sb, _) = self
            .change(id, |sb| {
                let stopping = sb.state == SandboxState::Stopping;
                sb.state = SandboxState::Stopping;
                Ok(!stopping)
            })
            .await?;
        self.node.destroy(id).await?;
        let tombstone = expired_reason.map(|reason| records::Tombstone {
            reason: reason.to_string(),
            at: now_ms(),
        });
        self.records.remove(&sb, tombstone).await
    }
}

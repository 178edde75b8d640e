//! The reaper: ends lifetimes (TTL, idle timeout) and remembers why, as tombstones.

use std::sync::atomic::Ordering;

use super::*;

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

    /// One reaper pass: delete sandboxes past their lifetime or idle timeout, mark dead
    /// ones failed, forget old tombstones.
    pub(super) async fn reap_once(&self) {
        let now = now_ms();
        let candidates: Vec<(String, &'static str)> = self
            .records
            .filter(|_| true)
            .iter()
            // Every state but `creating`: a lifetime ends whatever the sandbox is doing (a
            // delete that failed midway, `stopping`, is retried here). A create is in
            // flight in this process (a start resolves every earlier one) and ends on its
            // own; the next pass reaps it if its lifetime is over by then.
            .filter(|s| s.state != SandboxState::Creating)
            .filter_map(|s| {
                if s.job_suspended_at.is_some() && self.cfg.job_suspend_stops_lifetime {
                    // A suspended job's clock is stopped (a preempted trainer must find
                    // its rollouts when it comes back).
                    None
                } else if now >= s.expires_at {
                    Some((s.id.clone(), "lifetime (timeout_s) ended"))
                } else if s.state == SandboxState::Ready
                    && s.idle_timeout_s
                        .is_some_and(|t| now.saturating_sub(s.last_active_at) >= t * 1000)
                {
                    Some((s.id.clone(), "idle timeout reached"))
                } else {
                    None
                }
            })
            .collect();
        for (id, reason) in candidates {
            tracing::info!(%id, reason, "reaping sandbox");
            if let Err(e) = self.remove(&id, Some(reason)).await {
                tracing::warn!(%id, error = %e.message, "reaping failed; will retry");
            }
        }
        let alive: HashMap<String, bool> = self
            .node
            .list()
            .await
            .into_iter()
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

//! The reaper: ends lifetimes (TTL, idle timeout) and remembers why, as tombstones.

use super::*;

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
            .lock()
            .values()
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
        let died: Vec<Sandbox> = {
            let mut recs = self.lock();
            recs.values_mut()
                .filter(|s| {
                    matches!(
                        s.state,
                        SandboxState::Ready | SandboxState::Paused | SandboxState::Unhealthy
                    ) && alive.get(&s.id) == Some(&false)
                })
                .map(|s| {
                    s.state = SandboxState::Failed;
                    s.failure = Some("the sandbox's init process exited".into());
                    s.clone()
                })
                .collect()
        };
        for sb in died {
            tracing::warn!(id = %sb.id, "sandbox died");
            let _ = self.persist(&sb).await;
        }
        let expired: Vec<String> = self
            .tombstones
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(_, t)| now.saturating_sub(t.at) > TOMBSTONE_TTL_MS)
            .map(|(k, _)| k.clone())
            .collect();
        for id in expired {
            self.tombstones
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&id);
            let _ = self.unstore(NS_TOMBSTONES, &id).await;
        }
    }

    /// Destroys a sandbox and forgets it; with `expired_reason`, remembers why.
    pub(super) async fn remove(&self, id: &str, expired_reason: Option<&str>) -> ApiResult<()> {
        {
            let mut recs = self.lock();
            let Some(sb) = recs.get_mut(id) else {
                return Err(self.missing(id));
            };
            sb.state = SandboxState::Stopping;
        }
        self.node.destroy(id).await?;
        if let Some(reason) = expired_reason {
            let t = Tombstone {
                reason: reason.to_string(),
                at: now_ms(),
            };
            let bytes = serde_json::to_vec(&t).map_err(internal)?;
            self.stored(self.store.put(NS_TOMBSTONES, id, &bytes, Expect::Any))
                .await?;
            self.tombstones
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(id.to_string(), t);
        }
        self.unstore(NS_SANDBOXES, id).await?;
        self.lock().remove(id);
        Ok(())
    }
}

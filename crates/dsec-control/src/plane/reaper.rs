//! The reaper: nodes end lifetimes (TTL, idle timeout) on their own; this pass turns
//! what they ended into `expired` tombstones, destroys sandboxes left without a record,
//! marks sandboxes whose init died `failed` and those whose node is gone `lost` (and
//! back when it returns), removes records left past their lifetime, and forgets old
//! tombstones.

use std::sync::atomic::Ordering;

use super::*;

use dsec_node_api::lifetime;

/// How long past its end a lifetime must be before a record without a sandbox on its
/// node is removed (the node's own reaper ends sandboxes on time; this is the rest).
const LAPSE_GRACE_MS: u64 = 5_000;
/// How old a record must be before its sandbox's absence from its node makes it `lost`.
const LOST_GRACE_MS: u64 = 60_000;
/// How long a sandbox may be seen on its node without a record before it is destroyed:
/// a create stores its record once its node made it, within the store's request
/// timeout, or gives up and destroys it.
pub(super) const ORPHAN_GRACE_MS: u64 = 15_000;
/// How old a node's sandbox must be before the reaper looks for its record (most creates
/// store theirs sooner: no store read for them).
const UNRECORDED_MIN_AGE_MS: u64 = 1_000;
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

    /// One pass over every live node: turn the sandboxes a node ended (lifetime or idle
    /// timeout: nodes own lifetimes) into `expired` tombstones, destroy sandboxes that
    /// have had no record for a grace period, mark dead ones failed, and sandboxes whose
    /// node is gone (or no longer runs them) `lost` (back when the node returns with
    /// them); then remove records whose lifetime is over and whose sandbox is gone, undo
    /// creates whose replica died, forget old tombstones. Every step is safe on several
    /// replicas at once (conditional writes, idempotent destroys).
    pub(super) async fn reap_once(&self) {
        let now = now_ms();
        let listed = futures::future::join_all(self.nodes.live().into_iter().map(
            |(name, node)| async move {
                let listing = node.list().await;
                (name, node, listing)
            },
        ))
        .await;
        // Node name -> the ids it holds (ended stubs included).
        let mut known: HashMap<String, std::collections::HashSet<String>> = HashMap::new();
        for (name, node, listing) in listed {
            match listing {
                Ok(sandboxes) => {
                    self.reap_node(&name, &*node, &sandboxes, now).await;
                    known.insert(name, sandboxes.into_iter().map(|s| s.id).collect());
                }
                Err(e) => tracing::warn!(node = %name, error = %e.message,
                    "listing the node's sandboxes failed; its records stay as they are"),
            }
        }
        self.mark_lost(now).await;
        self.count_uncharged().await;
        let held =
            |s: &Sandbox| s.job_suspended_at.is_some() && self.cfg.job_suspend_stops_lifetime;
        let on_node = |s: &Sandbox| {
            let node = if self.nodes.is_single() {
                known.values().next()
            } else {
                known.get(&s.node)
            };
            node.map(|ids| ids.contains(&s.id))
        };
        // Past its lifetime with nothing left on its node (a failed sandbox, a delete that
        // failed midway, a node that is gone): the record goes, with its answer.
        // `creating` ones belong to a create in flight.
        let lapsed = self.records.filter(|s| {
            s.state != SandboxState::Creating
                && !held(s)
                && now >= s.expires_at.saturating_add(LAPSE_GRACE_MS)
                && (on_node(s) == Some(false) || s.state == SandboxState::Lost)
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
                // A node that is gone destroys the sandbox as an orphan when it is back.
                let undone = match self.node_of(&sb) {
                    Ok(node) => node.destroy(&sb.id).await.is_ok(),
                    Err(_) => true,
                };
                if undone {
                    let _ = self.records.remove(&sb, None).await;
                }
            }
        }
        if now.saturating_sub(self.tombstones_pruned_at.load(Ordering::Relaxed))
            > TOMBSTONE_PRUNE_MS
        {
            self.tombstones_pruned_at.store(now, Ordering::Relaxed);
            self.records.prune_tombstones(now, TOMBSTONE_TTL_MS).await;
        }
        self.events.prune(now, false).await;
    }

    /// The part of a pass for live node `name`, which listed `sandboxes` at `listed_at`.
    async fn reap_node(
        &self,
        name: &str,
        node: &dyn NodeApi,
        sandboxes: &[dsec_node_api::NodeSandbox],
        listed_at: u64,
    ) {
        for ended in sandboxes.iter().filter(|s| s.ended.is_some()) {
            let reason = ended.ended.clone().unwrap_or_default();
            if let Ok(Some(sb)) = self.records.find(&ended.id).await {
                tracing::info!(id = %sb.id, %reason, "the node ended the sandbox's lifetime");
                let tombstone = records::Tombstone {
                    reason,
                    at: listed_at,
                    tenant: sb.tenant.clone(),
                };
                if let Err(e) = self.records.remove(&sb, Some(tombstone)).await {
                    tracing::warn!(id = %sb.id, error = %e.message, "recording the end failed; will retry");
                    continue;
                }
            }
            // Forgets the node's stub.
            let _ = node.destroy(&ended.id).await;
        }
        let running: HashMap<&str, bool> = sandboxes
            .iter()
            .filter(|s| s.ended.is_none())
            .map(|s| (s.id.as_str(), s.alive))
            .collect();
        // Sandboxes seen without a record for the grace: a create whose record was never
        // written (its replica died), or a sandbox deleted while its node was gone.
        let mut unrecorded = Vec::new();
        for sb in sandboxes
            .iter()
            .filter(|s| s.ended.is_none() && s.age_ms >= UNRECORDED_MIN_AGE_MS)
        {
            if self.records.get(&sb.id).is_none()
                && matches!(self.records.find(&sb.id).await, Ok(None))
            {
                unrecorded.push((sb.id.clone(), sb.age_ms));
            }
        }
        let orphans: Vec<String> = {
            let mut seen = self.unrecorded.lock().unwrap_or_else(|p| p.into_inner());
            let on_this_node: std::collections::HashSet<&str> =
                sandboxes.iter().map(|s| s.id.as_str()).collect();
            let still_unrecorded: std::collections::HashSet<&str> =
                unrecorded.iter().map(|(id, _)| id.as_str()).collect();
            // Forget what this node no longer has, or has a record for now.
            seen.retain(|id, _| {
                !on_this_node.contains(id.as_str()) || still_unrecorded.contains(id.as_str())
            });
            // Measured on the node's own clock (its sandbox's age): no skew matters.
            unrecorded
                .into_iter()
                .filter(|(id, age_ms)| {
                    let first = *seen.entry(id.clone()).or_insert(*age_ms);
                    age_ms.saturating_sub(first) >= ORPHAN_GRACE_MS
                })
                .map(|(id, _)| id)
                .collect()
        };
        for id in orphans {
            tracing::info!(%id, node = %name, "destroying a sandbox without a record");
            let _ = node.destroy(&id).await;
            self.unrecorded
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&id);
        }
        let single = self.nodes.is_single();
        let mine = |s: &Sandbox| single || s.node == name;
        // Back from `lost`: the node returned still running it.
        for sb in self
            .records
            .filter(|s| mine(s) && s.state == SandboxState::Lost)
        {
            let Some(&alive) = running.get(sb.id.as_str()) else {
                continue;
            };
            let back = self
                .records
                .update(&sb.id, |s| {
                    if s.state != SandboxState::Lost {
                        return Ok(false);
                    }
                    s.state = if alive {
                        s.lost_from.take().unwrap_or(SandboxState::Ready)
                    } else {
                        s.failure = Some(
                            "the sandbox's init process exited while its node was gone".into(),
                        );
                        SandboxState::Failed
                    };
                    s.lost_since = None;
                    s.lost_from = None;
                    Ok(true)
                })
                .await;
            if let Ok(Some((sb, true))) = back {
                tracing::info!(id = %sb.id, node = %name, state = ?sb.state, "sandbox is back with its node");
            }
        }
        let was_running = |s: &Sandbox| {
            matches!(
                s.state,
                SandboxState::Ready | SandboxState::Paused | SandboxState::Unhealthy
            )
        };
        for sb in self.records.filter(|s| mine(s) && was_running(s)) {
            let change = match running.get(sb.id.as_str()) {
                Some(true) => continue,
                Some(false) => Some(SandboxState::Failed),
                // Not on its node at all: the node restarted without it. Records made
                // after the listing began may not be in it.
                None if sb.created_at.saturating_add(LOST_GRACE_MS) < listed_at => {
                    Some(SandboxState::Lost)
                }
                None => None,
            };
            let Some(to) = change else { continue };
            let marked = self
                .records
                .update(&sb.id, |s| {
                    if !was_running(s) {
                        return Ok(false);
                    }
                    if to == SandboxState::Failed {
                        s.failure = Some("the sandbox's init process exited".into());
                    } else {
                        s.lost_from = Some(s.state);
                        s.lost_since = Some(listed_at);
                    }
                    s.state = to;
                    Ok(true)
                })
                .await;
            if let Ok(Some((_, true))) = marked {
                tracing::warn!(id = %sb.id, node = %name, state = ?to, "sandbox died or is gone from its node");
            }
        }
        // Disks that filled up, or were freed, since the last pass (the record's change
        // writes the `disk_full` event).
        for listed in sandboxes.iter().filter(|s| s.ended.is_none()) {
            let Some(free) = listed.disk_free_mb else {
                continue;
            };
            let full = free == 0;
            let known = self.records.get(&listed.id);
            if known.is_none_or(|sb| sb.disk_full_since.is_some() == full) {
                continue;
            }
            let changed = self
                .records
                .update(&listed.id, |s| {
                    if s.disk_full_since.is_some() == full {
                        return Ok(false);
                    }
                    s.disk_full_since = full.then_some(listed_at);
                    Ok(true)
                })
                .await;
            if full && matches!(changed, Ok(Some((_, true)))) {
                tracing::info!(id = %listed.id, node = %name, "sandbox's disk is full");
            }
        }
    }

    /// Marks `lost` the sandboxes whose node is not live (its heartbeats stopped).
    async fn mark_lost(&self, now: u64) {
        let gone = |s: &Sandbox| {
            matches!(
                s.state,
                SandboxState::Ready | SandboxState::Paused | SandboxState::Unhealthy
            ) && self.nodes.get(&s.node).is_none()
        };
        for sb in self.records.filter(gone) {
            let marked = self
                .records
                .update(&sb.id, |s| {
                    if !gone(s) {
                        return Ok(false);
                    }
                    s.lost_from = Some(s.state);
                    s.lost_since = Some(now);
                    s.state = SandboxState::Lost;
                    Ok(true)
                })
                .await;
            if let Ok(Some((_, true))) = marked {
                tracing::warn!(id = %sb.id, node = %sb.node, "sandbox lost: its node stopped heartbeating");
            }
        }
    }

    /// Counts in their tenant's usage the sandboxes created while it had no quotas (they
    /// charged nothing), once it has some: a quota set on a tenant with sandboxes
    /// running sees them within a pass.
    async fn count_uncharged(&self) {
        // Each tenant looked up once per pass, not once per record.
        let mut limited: HashMap<String, bool> = HashMap::new();
        let uncharged = self.records.uncharged(|s| match limited.get(&s.tenant) {
            Some(&l) => l,
            None => {
                let l = self
                    .iam
                    .cached_tenant(&s.tenant)
                    .is_some_and(|t| t.quotas != dsec_iam::Quotas::default());
                limited.insert(s.tenant.clone(), l);
                l
            }
        });
        for sb in uncharged {
            match self.records.charge_late(&sb.id).await {
                Ok(true) => {
                    tracing::info!(id = %sb.id, tenant = %sb.tenant, "counted a sandbox created before its tenant's quotas")
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(id = %sb.id, error = %e.message, "counting a sandbox in its tenant's usage failed")
                }
            }
        }
    }

    /// Destroys a sandbox and forgets it; with `expired_reason`, remembers why.
    ///
    /// The node destroys it first and one store write then removes the record (with its
    /// idempotency key, quota usage and tombstone): a destroy that fails changes nothing,
    /// for the caller or the reaper to retry. Only a record still `creating` (a create in
    /// flight, on this or another replica) is marked `stopping` first, so that create's
    /// finishing write fails instead of bringing it back.
    pub(super) async fn remove(&self, id: &str, expired_reason: Option<&str>) -> ApiResult<()> {
        let mut sb = self.record(id).await?;
        if sb.state == SandboxState::Creating {
            sb = self
                .change(id, |sb| {
                    let stopping = sb.state == SandboxState::Stopping;
                    sb.state = SandboxState::Stopping;
                    Ok(!stopping)
                })
                .await?
                .0;
        }
        match self.node_of(&sb) {
            Ok(node) => node.destroy(id).await?,
            // Its node destroys it as an orphan when it is back.
            Err(_) => {
                tracing::info!(%id, node = %sb.node, "removing the record of a sandbox whose node is gone")
            }
        }
        self.nodes.release(id);
        let tombstone = expired_reason.map(|reason| records::Tombstone {
            reason: reason.to_string(),
            at: now_ms(),
            tenant: sb.tenant.clone(),
        });
        self.records.remove(&sb, tombstone).await?;
        // Room for a create waiting for capacity.
        self.queue.grant_next();
        Ok(())
    }
}

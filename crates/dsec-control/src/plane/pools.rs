//! Warm pools: a pool's spec lives in the store (`pools/<tenant>/<name>`); its members
//! are ordinary sandbox records of its tenant labelled [`POOL_LABEL`]; a task per pool
//! keeps it at the autoscaler's target ([`crate::autoscale`]); a create naming the pool
//! claims a warm member, or waits in the pool's queue (first come, first served) until
//! one is ready or its wait is over (`capacity`).
//!
//! A claim is one conditional record write (the label goes, the caller's lifetime and
//! labels come), so two claims never get one sandbox, on this replica or another.
//! Claimed sandboxes are ordinary sandboxes of the tenant: they never go back.
//!
//! On API server replicas sharing nodes, every replica knows every pool (it lists the
//! specs every [`SYNC_EVERY`]) and serves claims and calls from the warm members its
//! records cache shows; one replica per pool, the *owner*, sizes it (autoscaler, makes
//! and deletes members). The owner is elected with a key bound to its replica lease
//! (`pool-owners/<tenant>/<name>`): when the replica dies, the key goes with its lease
//! and another takes the pool over. Claims stay conditional record writes, so two
//! replicas never hand out one sandbox; a warm member lent to a call on two replicas at
//! once runs both calls, each in its own view.

use std::collections::VecDeque;
use std::time::Instant;

use dsec_wire::v1::{Pool, PoolList, PoolSpec, PoolUpdate, POOL_LABEL, POOL_ORIGIN_LABEL};

use super::*;
use crate::autoscale::{Autoscaler, Inputs};

/// Store namespace of pool specs: `<tenant>/<name>` -> [`StoredPool`].
const NS_POOLS: &str = "pools";
/// How often a pool's task looks at it when nothing wakes it.
const TICK: Duration = Duration::from_millis(100);
/// A claim wakes its pool's refill at once when fewer than 1/this of the pool's target
/// stay warm; above that the refill waits for the next [`TICK`].
const REFILL_AT_ONCE_BELOW: u32 = 4;
/// Least time between two refills of a pool with warm sandboxes to spare.
const GENTLE_REFILL_GAP: Duration = Duration::from_millis(50);
/// How often a pool's warm members are checked against their records.
const RECONCILE_EVERY: Duration = Duration::from_secs(1);
/// Members one pool makes at once.
const MAX_PARALLEL_CREATES: u32 = 4;
/// How long a claim waits for a warm sandbox unless it says.
const DEFAULT_CLAIM_WAIT_S: f64 = 30.0;
/// First and longest pause after a failed create of a member.
const BACKOFF_MIN: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// Longest pool name.
const MAX_NAME: usize = 63;
/// Store namespace of pool owners on replicas: `<tenant>/<name>` -> the owner's lease
/// id, bound to that lease.
const NS_POOL_OWNERS: &str = "pool-owners";
/// Waits of the replicas that do not size a pool (see [`ReplicaWaits`]).
const NS_POOL_WAITS: &str = "pool-waits";
/// Published waits older than this are not counted (their replica stopped publishing).
const REMOTE_WAITS_FRESH_MS: u64 = 5000;
/// How often replicas look for pools made, changed or deleted on others.
const SYNC_EVERY: Duration = Duration::from_secs(1);

/// A pool as the store keeps it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct StoredPool {
    spec: PoolSpec,
    tenant: String,
    created_at: u64,
}

/// This API server's pools, by (tenant, name).
#[derive(Debug, Default)]
pub(super) struct Pools {
    by_key: std::sync::Mutex<HashMap<(String, String), Arc<PoolRt>>>,
}

impl Pools {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Arc<PoolRt>>> {
        self.by_key.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn get(&self, tenant: &str, name: &str) -> ApiResult<Arc<PoolRt>> {
        self.lock()
            .get(&(tenant.to_string(), name.to_string()))
            .cloned()
            .ok_or_else(|| no_pool(name))
    }
}

impl Drop for Pools {
    fn drop(&mut self) {
        for pool in self.lock().values() {
            pool.stop();
        }
    }
}

fn no_pool(name: &str) -> ApiError {
    ApiError::new(ErrorCode::NotFound, format!("pool {name:?} not found"))
}

/// Why a warm member could not be claimed.
enum Take {
    /// It is no longer a warm member (or the write failed): try another.
    Gone(ApiError),
    /// The create's idempotency key belongs to an earlier attempt.
    KeyTaken(records::IdemEntry),
}

/// One pool at run time.
#[derive(Debug)]
pub(super) struct PoolRt {
    tenant: String,
    created_at: u64,
    state: std::sync::Mutex<PoolState>,
    /// Wakes the pool's task (a claim, a member made, a change of spec).
    changed: tokio::sync::Notify,
    task: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// This replica sizes the pool (always for a sole owner).
    owner: std::sync::atomic::AtomicBool,
}

#[derive(Debug)]
pub(super) struct PoolState {
    spec: PoolSpec,
    scaler: Autoscaler,
    /// Warm members, oldest first.
    ready: VecDeque<String>,
    /// Members being made.
    creating: u32,
    /// Members running a function call (fncall pools; back to `ready` after it).
    busy: u32,
    /// Calls each member served so far (fncall pools).
    calls: HashMap<String, u32>,
    /// Calls served by the pool.
    calls_served: u64,
    /// Members lent to calls here (fncall pools), which the records still show warm.
    lent: std::collections::HashSet<String>,
    /// Claims waiting, first come first.
    waiters: VecDeque<Waiter>,
    next_waiter: u64,
    claimed: u64,
    last_error: Option<String>,
    /// No member is made before this (after failures).
    next_create_at: Instant,
    backoff: Duration,
    deleted: bool,
    /// Waits of the claims and calls this replica served (count, sum ms), all time: what
    /// a replica that does not size the pool tells the one that does.
    served_waits: (u64, u64),
    /// What this replica last published of its waits (not the owner).
    published: Option<ReplicaWaits>,
    /// On the owner: each other replica's last published waits, by its key.
    remote: HashMap<String, ReplicaWaits>,
    /// A claim here found no warm member since the pool last had one
    /// (`pool_exhausted` is written once per spell).
    exhausted: bool,
}

/// A replica's waits on one pool it does not size, published to the store (key
/// `pool-waits/<tenant>/<pool>/<lease>`, bound to the replica's lease) for the owner's
/// autoscaler, which otherwise sees only the claims it serves itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct ReplicaWaits {
    /// Claims and calls served (all time) and the sum of their waits, ms.
    served: u64,
    served_ms: u64,
    /// Claims waiting when published, and the sum of their waits so far, ms.
    waiting: u32,
    waiting_ms: u64,
    /// When published, ms since the epoch.
    at_ms: u64,
}

#[derive(Debug)]
struct Waiter {
    seq: u64,
    since: Instant,
    /// Served before lower levels; `low` never grows the pool.
    priority: Priority,
    tx: tokio::sync::oneshot::Sender<String>,
}

impl PoolRt {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn name(&self) -> String {
        self.lock().spec.name.clone()
    }

    fn stop(&self) {
        if let Some(t) = self.task.lock().unwrap_or_else(|p| p.into_inner()).take() {
            t.abort();
        }
    }

    /// A warm member for the first waiting claim, else for the warm list.
    pub(super) fn offer(&self, mut id: String) {
        let mut st = self.lock();
        // The highest level first, then the oldest.
        while let Some(at) = st
            .waiters
            .iter()
            .enumerate()
            .min_by_key(|(_, w)| (w.priority, w.seq))
            .map(|(i, _)| i)
        {
            let Some(w) = st.waiters.remove(at) else {
                break;
            };
            match w.tx.send(id.clone()) {
                Ok(()) => {
                    if st.spec.fncall.is_some() {
                        st.busy += 1;
                        st.lent.insert(id);
                    }
                    return;
                }
                Err(back) => id = back,
            }
        }
        st.ready.push_back(id);
        st.exhausted = false;
    }

    /// The pool's call policy, if it serves function calls.
    pub(super) fn fncall(&self) -> Option<dsec_wire::v1::FnCallPolicy> {
        self.lock().spec.fncall.clone()
    }

    /// Takes back member `id` after a call that waited `waited_ms` for it: warm again
    /// if it is `healthy` and has calls left, else forgotten (the caller deletes it and
    /// the pool makes another). Returns whether it stays.
    pub(super) fn give_back(&self, id: String, healthy: bool, waited_ms: Option<u64>) -> bool {
        let keep = {
            let mut st = self.lock();
            st.busy = st.busy.saturating_sub(1);
            st.lent.remove(&id);
            st.calls_served += 1;
            if let Some(ms) = waited_ms {
                st.scaler.served(now_ms(), ms);
                st.served_waits.0 += 1;
                st.served_waits.1 += ms;
            }
            let max = st.spec.fncall.as_ref().map_or(1, |f| f.max_calls);
            let served = st.calls.get(&id).copied().unwrap_or(0) + 1;
            if healthy && served < max && !st.deleted {
                st.calls.insert(id.clone(), served);
                true
            } else {
                st.calls.remove(&id);
                false
            }
        };
        if keep {
            self.offer(id);
        }
        self.changed.notify_one();
        keep
    }

    fn status(&self) -> Pool {
        let st = self.lock();
        let now = now_ms();
        let ready = st.ready.len() as u32;
        Pool {
            spec: st.spec.clone(),
            tenant: self.tenant.clone(),
            created_at: self.created_at,
            target: st.scaler.target(),
            size: ready + st.creating + st.busy,
            ready,
            busy: st.busy,
            calls: st.calls_served,
            creating: st.creating,
            claimed: st.claimed,
            queue_length: st.waiters.len() as u32,
            queue_wait_ms: st.scaler.queue_wait_ms(now),
            scale_events: st.scaler.events().cloned().collect(),
            inputs_age_s: st.scaler.inputs_age_ms(now) as f64 / 1000.0,
            // Only the owner's autoscaler runs (replicas): its inputs are the owner's.
            stale: self.owner.load(std::sync::atomic::Ordering::Relaxed) && st.scaler.stale(now),
            owner: self.owner.load(std::sync::atomic::Ordering::Relaxed),
            last_error: st.last_error.clone(),
        }
    }
}

/// Refuses a pool spec that cannot work.
fn check_spec(spec: &PoolSpec) -> ApiResult<()> {
    let bad = |m: String| Err(ApiError::new(ErrorCode::BadRequest, m));
    let name_ok = !spec.name.is_empty()
        && spec.name.len() <= MAX_NAME
        && spec
            .name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
        && spec
            .name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphanumeric());
    if !name_ok {
        return bad(format!(
            "name: {:?} is not a pool name ([a-z0-9][a-z0-9._-]*, at most {MAX_NAME} bytes)",
            spec.name
        ));
    }
    check_bounds(spec.min, spec.max)?;
    check_policy(&spec.autoscale)?;
    let t = &spec.template;
    if t.pool.is_some() || t.queue.is_some() {
        return bad("template: a pool's sandboxes cannot name a pool or a queue".into());
    }
    if t.idempotency_key.is_some() {
        return bad("template: idempotency_key is per create, not per pool".into());
    }
    if t.timeout_s.is_some() {
        return bad(
            "template: timeout_s is set by each claim (a warm sandbox lives as long as its pool)"
                .into(),
        );
    }
    if let Some(f) = &spec.fncall {
        if f.max_calls == 0 {
            return bad("fncall.max_calls must be at least 1".into());
        }
        if t.isolation != Isolation::default() {
            return bad(
                "fncall: a pool serving calls runs container sandboxes (leave isolation unset)"
                    .into(),
            );
        }
        if t.filesystem != FilesystemPolicy::default() {
            return bad("fncall: filesystem rules are not supported for calls yet (each call may write anywhere in its own throw-away view)".into());
        }
    }
    let flat = validate::flatten_environment(t.clone())?;
    validate::create(&flat)
}

fn check_bounds(min: u32, max: u32) -> ApiResult<()> {
    if min > max {
        return Err(ApiError::new(
            ErrorCode::BadRequest,
            format!("min ({min}) is larger than max ({max})"),
        ));
    }
    if max > 10_000 {
        return Err(ApiError::new(
            ErrorCode::BadRequest,
            format!("max: at most 10000 sandboxes per pool, got {max}"),
        ));
    }
    Ok(())
}

fn check_policy(p: &dsec_wire::v1::AutoscalePolicy) -> ApiResult<()> {
    let positive = [
        ("window_s", p.window_s),
        ("idle_window_s", p.idle_window_s),
        ("stale_after_s", p.stale_after_s),
    ];
    for (field, v) in positive {
        if !v.is_finite() || v <= 0.0 || v > 86_400.0 {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                format!("autoscale.{field} must be in (0, 86400], got {v}"),
            ));
        }
    }
    let checks = [
        (
            "cooldown_s",
            p.cooldown_s.is_finite() && (0.0..=86_400.0).contains(&p.cooldown_s),
            "[0, 86400]",
        ),
        (
            "scale_up_factor",
            p.scale_up_factor.is_finite() && p.scale_up_factor > 1.0 && p.scale_up_factor <= 16.0,
            "(1, 16]",
        ),
        (
            "idle_ratio",
            p.idle_ratio.is_finite() && (0.0..1.0).contains(&p.idle_ratio),
            "[0, 1)",
        ),
        (
            "scale_down_fraction",
            p.scale_down_fraction.is_finite()
                && p.scale_down_fraction > 0.0
                && p.scale_down_fraction <= 1.0,
            "(0, 1]",
        ),
    ];
    for (field, ok, range) in checks {
        if !ok {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                format!("autoscale.{field} must be in {range}"),
            ));
        }
    }
    Ok(())
}

/// Refuses a claim that also describes an environment (the pool's is used).
pub(super) fn check_claim(req: &CreateSandboxRequest) -> ApiResult<()> {
    let set: [(&str, bool); 12] = [
        ("image", req.image.is_some()),
        ("layers", !req.layers.is_empty()),
        ("environment", req.environment.is_some()),
        ("resources", req.resources != Resources::default()),
        ("network", req.network != NetworkPolicy::default()),
        ("filesystem", req.filesystem != FilesystemPolicy::default()),
        ("isolation", req.isolation != Isolation::default()),
        ("env", !req.env.is_empty()),
        ("workdir", req.workdir.is_some()),
        ("user", req.user.is_some()),
        ("files", !req.files.is_empty()),
        ("qos", req.qos != Qos::default()),
    ];
    if let Some((field, _)) = set.iter().find(|(_, s)| *s) {
        return Err(ApiError::new(
            ErrorCode::BadRequest,
            format!("{field}: a create from a pool takes the pool's environment; leave it unset"),
        ));
    }
    if let Some(t) = req.timeout_s {
        if t == 0 || t > MAX_TIMEOUT_S {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                format!("timeout_s must be in [1, {MAX_TIMEOUT_S}]"),
            ));
        }
    }
    if let Some(w) = req.queue.and_then(|q| q.max_wait_s) {
        if !w.is_finite() || !(0.0..=3600.0).contains(&w) {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                format!("queue.max_wait_s must be in [0, 3600], got {w}"),
            ));
        }
    }
    validate::create(req)
}

impl ControlPlane {
    /// Ids of the warm members of `tenant`'s pool `name` in the records cache.
    fn warm_members(&self, tenant: &str, name: &str) -> Vec<String> {
        self.records
            .filter(|s| {
                s.tenant == tenant
                    && s.state == SandboxState::Ready
                    && s.labels.get(POOL_LABEL).map(String::as_str) == Some(name)
            })
            .into_iter()
            .map(|s| s.id)
            .collect()
    }

    /// Loads the stored pools with their warm members and starts their tasks (at open).
    pub(super) async fn load_pools(&self) -> ApiResult<()> {
        let (entries, _) = self.store.list(NS_POOLS).await.map_err(store_err)?;
        for e in entries {
            let stored: StoredPool = match serde_json::from_slice(&e.value) {
                Ok(p) => p,
                Err(err) => {
                    tracing::warn!(key = %e.key, error = %err, "skipping an unreadable pool");
                    continue;
                }
            };
            let name = stored.spec.name.clone();
            let warm = self.warm_members(&stored.tenant, &name);
            tracing::info!(pool = %name, tenant = %stored.tenant, warm = warm.len(), "pool loaded");
            self.start_pool(stored, warm.into());
        }
        if !self.cfg.sole_owner {
            tokio::spawn(sync_pools(self.me.clone()));
        }
        Ok(())
    }

    /// Replicas: starts the pools made on others, takes changes of their specs, and ends
    /// the pools deleted there.
    async fn sync_pools_once(&self) -> ApiResult<()> {
        let (entries, _) = self.store.list(NS_POOLS).await.map_err(store_err)?;
        let mut stored_keys = std::collections::HashSet::new();
        for e in entries {
            let Ok(stored) = serde_json::from_slice::<StoredPool>(&e.value) else {
                continue;
            };
            let key = (stored.tenant.clone(), stored.spec.name.clone());
            stored_keys.insert(key.clone());
            let known = self.pools.lock().get(&key).cloned();
            match known {
                None => {
                    tracing::info!(pool = %stored.spec.name, tenant = %stored.tenant, "pool made on another replica");
                    self.start_pool(stored, VecDeque::new());
                }
                Some(pool) => {
                    let changed = {
                        let mut st = pool.lock();
                        let changed = st.spec != stored.spec;
                        if changed {
                            let _ = st.scaler.reconfigure(
                                stored.spec.min,
                                stored.spec.max,
                                stored.spec.autoscale.clone(),
                                now_ms(),
                            );
                            st.spec = stored.spec;
                        }
                        changed
                    };
                    if changed {
                        pool.changed.notify_one();
                    }
                }
            }
        }
        let gone: Vec<Arc<PoolRt>> = {
            let mut pools = self.pools.lock();
            let keys: Vec<(String, String)> = pools
                .keys()
                .filter(|k| !stored_keys.contains(*k))
                .cloned()
                .collect();
            keys.iter().filter_map(|k| pools.remove(k)).collect()
        };
        for pool in gone {
            tracing::info!(pool = %pool.name(), tenant = %pool.tenant, "pool deleted on another replica");
            pool.stop();
            self.forget_waits(&pool.tenant, &pool.name()).await;
            let mut st = pool.lock();
            st.deleted = true;
            st.waiters.clear();
            st.ready.clear();
        }
        Ok(())
    }

    /// Whether this replica sizes `pool`: a sole owner always; a replica when the pool's
    /// owner key is (or now becomes) bound to its lease.
    async fn elect(&self, pool: &PoolRt) -> bool {
        let key = format!("{}/{}", pool.tenant, pool.name());
        self.elect_owner(NS_POOL_OWNERS, &key).await
    }

    /// Whether this plane owns `ns/key` (a pool, a batch): a sole owner always; a
    /// replica when the key is (or now becomes) bound to its lease, so it goes when the
    /// replica dies and a survivor takes it.
    pub(super) async fn elect_owner(&self, ns: &str, key: &str) -> bool {
        if self.cfg.sole_owner {
            return true;
        }
        let Some(lease) = self.records.replica_lease() else {
            return false;
        };
        let me = lease.0.to_string();
        let txn = dsec_state::Txn {
            checks: vec![(ns.into(), key.into(), dsec_state::Expect::Absent)],
            ops: vec![dsec_state::Op::Put {
                ns: ns.into(),
                key: key.into(),
                value: me.clone().into_bytes(),
                lease: Some(lease),
            }],
        };
        match self.store.txn(txn).await {
            Ok(_) => true,
            Err(dsec_state::StateError::Conflict { .. }) => matches!(
                self.store.get(ns, key).await,
                Ok(Some(e)) if e.value == me.as_bytes()
            ),
            Err(e) => {
                tracing::warn!(ns, key, error = %e, "electing an owner");
                false
            }
        }
    }

    /// Drops this replica's published waits of a deleted pool.
    async fn forget_waits(&self, tenant: &str, name: &str) {
        if let Some(lease) = self.records.replica_lease() {
            let key = format!("{tenant}/{name}/{lease}");
            let _ = self
                .store
                .delete(NS_POOL_WAITS, &key, dsec_state::Expect::Any)
                .await;
        }
    }

    /// Replicas: one that does not size `pool` publishes its waits (when they changed);
    /// the owner reads the others' and feeds their served waits to its autoscaler and
    /// keeps their waiting claims for its next inputs.
    async fn exchange_waits(&self, pool: &PoolRt, owner: bool) {
        let Some(lease) = self.records.replica_lease() else {
            return;
        };
        let prefix = format!("{}/{}/", pool.tenant, pool.name());
        if !owner {
            let waits = {
                let st = pool.lock();
                let now = Instant::now();
                let growing = st.waiters.iter().filter(|w| w.priority != Priority::Low);
                let (waiting, waiting_ms) = growing.fold((0u32, 0u64), |(n, ms), w| {
                    (n + 1, ms + now.duration_since(w.since).as_millis() as u64)
                });
                ReplicaWaits {
                    served: st.served_waits.0,
                    served_ms: st.served_waits.1,
                    waiting,
                    waiting_ms,
                    at_ms: now_ms(),
                }
            };
            let unchanged = pool.lock().published.is_some_and(|p| {
                (p.served, p.waiting) == (waits.served, waits.waiting)
                    && waits.waiting == 0
                    && now_ms().saturating_sub(p.at_ms) < REMOTE_WAITS_FRESH_MS / 2
            });
            if unchanged {
                return;
            }
            let Ok(value) = serde_json::to_vec(&waits) else {
                return;
            };
            let txn = dsec_state::Txn {
                checks: Vec::new(),
                ops: vec![dsec_state::Op::Put {
                    ns: NS_POOL_WAITS.into(),
                    key: format!("{prefix}{lease}"),
                    value,
                    lease: Some(lease),
                }],
            };
            match self.store.txn(txn).await {
                Ok(_) => pool.lock().published = Some(waits),
                Err(e) => {
                    tracing::debug!(pool = %pool.name(), error = %e, "publishing the pool's waits")
                }
            }
            return;
        }
        let Ok((entries, _)) = self.store.list(NS_POOL_WAITS).await else {
            return;
        };
        let mine = format!("{prefix}{lease}");
        let now = now_ms();
        let mut st = pool.lock();
        let mut seen = std::collections::HashSet::new();
        for e in entries {
            if !e.key.starts_with(&prefix) || e.key == mine {
                continue;
            }
            let Ok(waits) = serde_json::from_slice::<ReplicaWaits>(&e.value) else {
                continue;
            };
            let last = st.remote.get(&e.key).copied().unwrap_or_default();
            // Counters only grow; a smaller one is a replica that started again.
            let (new, new_ms) = if waits.served >= last.served {
                (
                    waits.served - last.served,
                    waits.served_ms.saturating_sub(last.served_ms),
                )
            } else {
                (waits.served, waits.served_ms)
            };
            if let Some(avg) = new_ms.checked_div(new) {
                for _ in 0..new.min(1000) {
                    st.scaler.served(now, avg);
                }
            }
            seen.insert(e.key.clone());
            st.remote.insert(e.key, waits);
        }
        st.remote.retain(|k, _| seen.contains(k));
    }

    /// A replica that does not own `pool`: takes the warm members its records show
    /// (made by the owner) into the pool's list, handing them to waiting claims first.
    fn follow_pool(&self, pool: &PoolRt) {
        let live = self.warm_members(&pool.tenant, &pool.name());
        let fresh: Vec<String> = {
            let mut st = pool.lock();
            let set: std::collections::HashSet<&String> = live.iter().collect();
            st.ready.retain(|id| set.contains(id));
            live.iter()
                .filter(|id| !st.ready.contains(id) && !st.lent.contains(*id))
                .cloned()
                .collect()
        };
        for id in fresh {
            pool.offer(id);
        }
    }

    fn start_pool(&self, stored: StoredPool, ready: VecDeque<String>) -> Arc<PoolRt> {
        let spec = stored.spec;
        let pool = Arc::new(PoolRt {
            tenant: stored.tenant.clone(),
            created_at: stored.created_at,
            state: std::sync::Mutex::new(PoolState {
                scaler: Autoscaler::new(spec.min, spec.max, spec.autoscale.clone(), now_ms()),
                spec: spec.clone(),
                ready,
                creating: 0,
                busy: 0,
                calls: HashMap::new(),
                calls_served: 0,
                lent: Default::default(),
                waiters: VecDeque::new(),
                next_waiter: 0,
                claimed: 0,
                last_error: None,
                next_create_at: Instant::now(),
                backoff: BACKOFF_MIN,
                deleted: false,
                served_waits: (0, 0),
                published: None,
                remote: HashMap::new(),
                exhausted: false,
            }),
            changed: tokio::sync::Notify::new(),
            task: Default::default(),
            owner: std::sync::atomic::AtomicBool::new(self.cfg.sole_owner),
        });
        let task = tokio::spawn(run_pool(self.me.clone(), pool.clone()));
        *pool.task.lock().unwrap_or_else(|p| p.into_inner()) = Some(task);
        self.pools
            .lock()
            .insert((stored.tenant, spec.name), pool.clone());
        pool
    }

    pub(super) async fn create_pool_to_end(&self, tenant: &str, spec: PoolSpec) -> ApiResult<Pool> {
        check_spec(&spec)?;
        let stored = StoredPool {
            spec,
            tenant: tenant.to_string(),
            created_at: now_ms(),
        };
        let key = format!("{tenant}/{}", stored.spec.name);
        let value = serde_json::to_vec(&stored).map_err(internal)?;
        match self
            .store
            .put(NS_POOLS, &key, &value, dsec_state::Expect::Absent)
            .await
        {
            Ok(_) => {}
            Err(dsec_state::StateError::Conflict { .. }) => {
                return Err(ApiError::new(
                    ErrorCode::Conflict,
                    format!("pool {:?} already exists", stored.spec.name),
                ))
            }
            Err(e) => return Err(store_err(e)),
        }
        Ok(self.start_pool(stored, VecDeque::new()).status())
    }

    pub(super) fn list_pools_of(&self, tenant: &str) -> PoolList {
        let mut pools: Vec<Pool> = self
            .pools
            .lock()
            .iter()
            .filter(|((t, _), _)| t == tenant)
            .map(|(_, p)| p.status())
            .collect();
        pools.sort_by(|a, b| a.spec.name.cmp(&b.spec.name));
        PoolList { pools }
    }

    pub(super) fn pool_status(&self, tenant: &str, name: &str) -> ApiResult<Pool> {
        Ok(self.pools.get(tenant, name)?.status())
    }

    pub(super) async fn update_pool_to_end(
        &self,
        tenant: &str,
        name: &str,
        update: PoolUpdate,
    ) -> ApiResult<Pool> {
        let pool = self.pools.get(tenant, name)?;
        let mut spec = pool.lock().spec.clone();
        spec.min = update.min.unwrap_or(spec.min);
        spec.max = update.max.unwrap_or(spec.max);
        if let Some(p) = update.autoscale {
            spec.autoscale = p;
        }
        check_bounds(spec.min, spec.max)?;
        check_policy(&spec.autoscale)?;
        let stored = StoredPool {
            spec: spec.clone(),
            tenant: tenant.to_string(),
            created_at: pool.created_at,
        };
        let value = serde_json::to_vec(&stored).map_err(internal)?;
        self.store
            .put(
                NS_POOLS,
                &format!("{tenant}/{name}"),
                &value,
                dsec_state::Expect::Any,
            )
            .await
            .map_err(store_err)?;
        let scaled = {
            let mut st = pool.lock();
            let scaled =
                st.scaler
                    .reconfigure(spec.min, spec.max, spec.autoscale.clone(), now_ms());
            st.spec = spec;
            scaled.map(|e| scaled_event(tenant, &st.spec, &e))
        };
        if let Some(event) = scaled {
            self.events.emit(event).await;
        }
        pool.changed.notify_one();
        Ok(pool.status())
    }

    /// Deletes a pool: its waiting claims fail, its warm members are deleted (claimed
    /// ones are the tenant's and stay).
    pub(super) async fn delete_pool_to_end(&self, tenant: &str, name: &str) -> ApiResult<()> {
        let pool = self.pools.get(tenant, name)?;
        self.store
            .delete(
                NS_POOLS,
                &format!("{tenant}/{name}"),
                dsec_state::Expect::Any,
            )
            .await
            .map_err(store_err)?;
        self.pools
            .lock()
            .remove(&(tenant.to_string(), name.to_string()));
        pool.stop();
        if !self.cfg.sole_owner {
            let _ = self
                .store
                .delete(
                    NS_POOL_OWNERS,
                    &format!("{tenant}/{name}"),
                    dsec_state::Expect::Any,
                )
                .await;
            self.forget_waits(tenant, name).await;
        }
        let warm: Vec<String> = {
            let mut st = pool.lock();
            st.deleted = true;
            // Dropping the senders fails the waiting claims.
            st.waiters.clear();
            st.calls.clear();
            st.ready.drain(..).collect()
        };
        for id in warm {
            if let Err(e) = self.remove(&id, None).await {
                tracing::warn!(%id, error = %e.message, "deleting a warm sandbox of a deleted pool");
            }
        }
        Ok(())
    }

    /// A create naming a pool: claims a warm member, waiting for one at most the
    /// request's `queue.max_wait_s`.
    pub(super) async fn claim_to_end(
        &self,
        tenant: &str,
        req: CreateSandboxRequest,
    ) -> ApiResult<Sandbox> {
        check_claim(&req)?;
        let name = req.pool.clone().unwrap_or_default();
        let pool = self.pools.get(tenant, &name)?;
        // A retry of a keyed claim that was served answers with its sandbox.
        if let Some(key) = &req.idempotency_key {
            if let Some(first) = self.records.idempotency(tenant, key).await? {
                if let Some(found) = self.first_attempt(&first, &req).await? {
                    return Ok(found);
                }
            }
        }
        let max_wait = req
            .queue
            .and_then(|q| q.max_wait_s)
            .unwrap_or(DEFAULT_CLAIM_WAIT_S);
        if pool.lock().spec.fncall.is_some() {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                format!("pool {name:?} serves function calls (POST /v1/fncall); its sandboxes cannot be claimed"),
            ));
        }
        let start = Instant::now();
        loop {
            let priority = req.queue.unwrap_or_default().priority;
            let id = acquire(self, &pool, &name, start, max_wait, priority).await?;
            match self.take_member(tenant, &name, &id, &req).await {
                Ok(sb) => {
                    let waited = start.elapsed().as_millis() as u64;
                    let mut st = pool.lock();
                    // A low claim takes spare capacity only: its wait never grows the pool.
                    if priority != Priority::Low {
                        st.scaler.served(now_ms(), waited);
                        st.served_waits.0 += 1;
                        st.served_waits.1 += waited;
                    }
                    st.claimed += 1;
                    return Ok(sb);
                }
                // Gone meanwhile (deleted, expired, failed): the next one.
                Err(Take::Gone(e)) => {
                    tracing::info!(pool = %name, %id, error = %e.message, "a warm sandbox could not be claimed; taking another");
                }
                // An earlier attempt with the key holds it: the member stays warm.
                Err(Take::KeyTaken(first)) => {
                    pool.offer(id);
                    return match self.first_attempt(&first, &req).await? {
                        Some(found) => Ok(found),
                        None => Err(ApiError::new(
                            ErrorCode::Conflict,
                            "idempotency_key: its first attempt is going away; retry",
                        )),
                    };
                }
            }
        }
    }

    /// Makes warm member `id` of pool `name` the caller's sandbox: one conditional record
    /// write (with the create's idempotency key, if any), then its node's clock.
    async fn take_member(
        &self,
        tenant: &str,
        name: &str,
        id: &str,
        req: &CreateSandboxRequest,
    ) -> Result<Sandbox, Take> {
        let now = now_ms();
        let timeout_s = req.timeout_s.unwrap_or(DEFAULT_TIMEOUT_S);
        let change = |sb: &mut Sandbox| {
            if sb.state != SandboxState::Ready
                || sb.labels.get(POOL_LABEL).map(String::as_str) != Some(name)
            {
                return Err(ApiError::new(
                    ErrorCode::Conflict,
                    format!("sandbox {id} is no longer a warm member of pool {name:?}"),
                ));
            }
            sb.labels.remove(POOL_LABEL);
            sb.labels.extend(req.labels.clone());
            sb.labels
                .insert(POOL_ORIGIN_LABEL.to_string(), name.to_string());
            sb.expires_at = now + timeout_s * 1000;
            sb.idle_timeout_s = req.idle_timeout_s;
            sb.auto_resume = req.auto_resume;
            sb.last_active_at = now;
            sb.idempotency_key = req.idempotency_key.clone();
            Ok(true)
        };
        let written = match &req.idempotency_key {
            None => self.records.update(id, change).await.map_err(Take::Gone)?,
            Some(key) => {
                let entry = records::IdemEntry {
                    id: id.to_string(),
                    digest: Some(hex::encode(idempotency::request_digest(req))),
                };
                match self
                    .records
                    .update_keyed(id, (tenant, key, entry), change)
                    .await
                {
                    Ok(w) => w,
                    Err(records::InsertError::KeyTaken(first)) => {
                        return Err(Take::KeyTaken(first))
                    }
                    Err(records::InsertError::Store(e)) => return Err(Take::Gone(e)),
                }
            }
        };
        let Some((sb, _)) = written else {
            return Err(Take::Gone(ApiError::new(
                ErrorCode::NotFound,
                format!("sandbox {id} is gone"),
            )));
        };
        let node = self.node_of(&sb).map_err(Take::Gone)?;
        if let Err(e) = node
            .set_lifetime(id, lifecycle::node_lifetime(&sb, now, false))
            .await
        {
            // Claimed but its clock unknown: it must not stay.
            let _ = self.remove(id, None).await;
            return Err(Take::Gone(e));
        }
        Ok(sb)
    }

    /// Makes one member of `pool` and offers it.
    async fn make_member(&self, pool: &PoolRt) {
        let (mut req, name, fncall) = {
            let st = pool.lock();
            (
                st.spec.template.clone(),
                st.spec.name.clone(),
                st.spec.fncall.is_some(),
            )
        };
        req.labels.insert(POOL_LABEL.to_string(), name.clone());
        if fncall {
            req.labels
                .insert(dsec_wire::v1::FNCALL_LABEL.to_string(), name.clone());
        }
        req.timeout_s = Some(MAX_TIMEOUT_S);
        let made = self.create_sandbox_to_end(&pool.tenant, req).await;
        let orphan = {
            let mut st = pool.lock();
            st.creating = st.creating.saturating_sub(1);
            match &made {
                Ok(_) => {
                    st.last_error = None;
                    st.backoff = BACKOFF_MIN;
                }
                Err(e) => {
                    tracing::warn!(pool = %name, error = %e.message, "making a warm sandbox failed");
                    st.last_error = Some(e.message.clone());
                    st.next_create_at = Instant::now() + st.backoff;
                    st.backoff = (st.backoff * 2).min(BACKOFF_MAX);
                }
            }
            st.deleted
        };
        if let Ok(sb) = made {
            if orphan {
                let _ = self.remove(&sb.id, None).await;
            } else {
                pool.offer(sb.id);
            }
        }
        pool.changed.notify_one();
    }

    /// Drops warm members whose record is gone or changed (deleted, expired, failed).
    fn reconcile_pool(&self, pool: &PoolRt) {
        let live: std::collections::HashSet<String> = self
            .warm_members(&pool.tenant, &pool.name())
            .into_iter()
            .collect();
        let mut st = pool.lock();
        st.ready.retain(|id| live.contains(id));
        st.calls.retain(|id, _| live.contains(id));
    }
}

/// Takes a warm member of `pool` off its list, waiting first come, first served until
/// `max_wait` seconds after `start` (then `capacity`).
pub(super) async fn acquire(
    plane: &ControlPlane,
    pool: &PoolRt,
    name: &str,
    start: Instant,
    max_wait: f64,
    priority: Priority,
) -> ApiResult<String> {
    let deadline = start + Duration::from_secs_f64(max_wait);
    let mut exhausted = None;
    let (id, waiting, low) = {
        let mut st = pool.lock();
        if st.deleted {
            return Err(no_pool(name));
        }
        match st.ready.pop_front() {
            Some(id) => {
                st.exhausted = false;
                if st.spec.fncall.is_some() {
                    st.busy += 1;
                    st.lent.insert(id.clone());
                }
                let low = (st.ready.len() as u32) * REFILL_AT_ONCE_BELOW < st.scaler.target();
                (Some(id), None, low)
            }
            None => {
                if !std::mem::replace(&mut st.exhausted, true) {
                    exhausted = Some(format!(
                        "a claim found no warm sandbox and waits (up to {max_wait} s); \
                         {} being made, target {}, max {}",
                        st.creating,
                        st.scaler.target(),
                        st.spec.max
                    ));
                }
                let (tx, rx) = tokio::sync::oneshot::channel();
                let seq = st.next_waiter;
                st.next_waiter += 1;
                st.waiters.push_back(Waiter {
                    seq,
                    since: start,
                    priority,
                    tx,
                });
                (None, Some((seq, rx)), true)
            }
        }
    };
    // A pool with warm sandboxes to spare refills on its next tick, not in the middle of
    // the claim that took one (a refill is a create on the same cores as the claim's
    // record write); one running low, or a claim left waiting, wakes it now.
    if low {
        pool.changed.notify_one();
    }
    if let Some(cause) = exhausted {
        plane.emit_later(events::about_pool(
            &pool.tenant,
            name,
            EventKind::PoolExhausted,
            cause,
        ));
    }
    let Some((seq, mut rx)) = waiting else {
        return id.ok_or_else(|| no_pool(name));
    };
    match tokio::time::timeout_at(deadline.into(), &mut rx).await {
        Ok(Ok(id)) => Ok(id),
        Ok(Err(_)) => Err(no_pool(name)),
        Err(_) => {
            pool.lock().waiters.retain(|w| w.seq != seq);
            // Handed one between the timeout and the removal.
            rx.try_recv().map_err(|_| {
                let event = events::about_pool(
                    &pool.tenant,
                    name,
                    EventKind::QueueTimedOut,
                    format!(
                        "a claim waited {max_wait} s for a warm sandbox at priority {}",
                        format!("{priority:?}").to_lowercase()
                    ),
                );
                plane.emit_later(event);
                ApiError::new(
                    ErrorCode::Capacity,
                    format!(
                        "pool {name:?} had no warm sandbox within {max_wait} s \
                         (queue.max_wait_s); it is growing"
                    ),
                )
            })
        }
    }
}

/// The `pool_scaled` event of a change of `spec`'s target.
fn scaled_event(tenant: &str, spec: &PoolSpec, e: &dsec_wire::v1::ScaleEvent) -> Event {
    use dsec_wire::v1::ScaleReason;
    let why = match e.reason {
        ScaleReason::QueueWait => format!(
            "claims waited more than {} ms on average over {} s",
            spec.autoscale.target_queue_wait_ms, spec.autoscale.window_s
        ),
        ScaleReason::Idle => format!(
            "more than {:.0}% of it stayed idle for {} s",
            spec.autoscale.idle_ratio * 100.0,
            spec.autoscale.idle_window_s
        ),
        ScaleReason::FromZero => "claims wait on a pool scaled to zero".to_string(),
        ScaleReason::Bounds => format!("its bounds changed to [{}, {}]", spec.min, spec.max),
    };
    events::about_pool(
        tenant,
        &spec.name,
        EventKind::PoolScaled,
        format!("target {} -> {}: {why}", e.from, e.to),
    )
}

/// A pool's task: observes it, lets the autoscaler set the target, and makes or deletes
/// members to meet it.
async fn run_pool(plane: Weak<ControlPlane>, pool: Arc<PoolRt>) {
    let mut reconciled = Instant::now();
    loop {
        tokio::select! {
            _ = pool.changed.notified() => {}
            _ = tokio::time::sleep(TICK) => {}
        }
        let Some(plane) = plane.upgrade() else { return };
        if reconciled.elapsed() >= RECONCILE_EVERY {
            plane.reconcile_pool(&pool);
            let owner = plane.elect(&pool).await;
            if owner != pool.owner.swap(owner, std::sync::atomic::Ordering::Relaxed) {
                tracing::info!(pool = %pool.name(), owner, "pool ownership changed on this replica");
            }
            if !plane.cfg.sole_owner {
                plane.exchange_waits(&pool, owner).await;
            }
            reconciled = Instant::now();
        }
        if !pool.owner.load(std::sync::atomic::Ordering::Relaxed) {
            // Another replica sizes it: serve what it made.
            plane.follow_pool(&pool);
            continue;
        }
        let (make, surplus) = {
            let mut st = pool.lock();
            if st.deleted {
                return;
            }
            st.waiters.retain(|w| !w.tx.is_closed());
            let now = Instant::now();
            let ready = st.ready.len() as u32;
            // Low claims and calls take spare capacity only: they do not grow the pool.
            let growing = || st.waiters.iter().filter(|w| w.priority != Priority::Low);
            let fresh_from = now_ms().saturating_sub(REMOTE_WAITS_FRESH_MS);
            let (remote_waiting, remote_waiting_ms) = st
                .remote
                .values()
                .filter(|w| w.at_ms >= fresh_from)
                .fold((0, 0), |(n, ms), w| (n + w.waiting, ms + w.waiting_ms));
            let inputs = Inputs {
                size: ready + st.creating + st.busy,
                idle: ready,
                waiting: growing().count() as u32 + remote_waiting,
                waiting_ms: growing()
                    .map(|w| now.duration_since(w.since).as_millis() as u64)
                    .sum::<u64>()
                    + remote_waiting_ms,
            };
            if st.scaler.stale(now_ms()) {
                tracing::warn!(pool = %st.spec.name, age_ms = st.scaler.inputs_age_ms(now_ms()),
                    "the pool's autoscaler inputs were stale (its task was held up)");
            }
            if let Some(e) = st.scaler.observe(now_ms(), inputs) {
                tracing::info!(pool = %st.spec.name, from = e.from, to = e.to, reason = ?e.reason, "pool scaled");
                plane.emit_later(scaled_event(&pool.tenant, &st.spec, &e));
            }
            let target = st.scaler.target();
            // With warm sandboxes to spare and nobody waiting, refill one at a time: a
            // refill is a whole create on the cores the claimed sandboxes work on. A
            // pool running low (or growing) makes all it lacks at once.
            let gentle = inputs.waiting == 0 && ready * REFILL_AT_ONCE_BELOW >= target;
            let parallel = if gentle { 1 } else { MAX_PARALLEL_CREATES };
            let make = if now >= st.next_create_at {
                target
                    .saturating_sub(inputs.size)
                    .min(parallel.saturating_sub(st.creating))
            } else {
                0
            };
            st.creating += make;
            if gentle && make > 0 {
                st.next_create_at = st.next_create_at.max(now + GENTLE_REFILL_GAP);
            }
            let excess = inputs.size.saturating_sub(target).min(ready) as usize;
            let surplus: Vec<String> = (0..excess).filter_map(|_| st.ready.pop_back()).collect();
            (make, surplus)
        };
        for _ in 0..make {
            let (plane, pool) = (plane.clone(), pool.clone());
            tokio::spawn(async move { plane.make_member(&pool).await });
        }
        for id in surplus {
            let plane = plane.clone();
            tokio::spawn(async move {
                if let Err(e) = plane.remove(&id, None).await {
                    tracing::warn!(%id, error = %e.message, "deleting a surplus warm sandbox");
                }
            });
        }
    }
}

/// Replicas: [`ControlPlane::sync_pools_once`] every [`SYNC_EVERY`].
async fn sync_pools(plane: Weak<ControlPlane>) {
    loop {
        tokio::time::sleep(SYNC_EVERY).await;
        let Some(plane) = plane.upgrade() else { return };
        if let Err(e) = plane.sync_pools_once().await {
            tracing::warn!(error = %e.message, "listing pools made on other replicas");
        }
    }
}

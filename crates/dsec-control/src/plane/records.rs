//! Sandbox records, tombstones and idempotency keys: the state store is their source of
//! truth. [`Records`] is this replica's cache of it, filled by a list and kept fresh by a
//! watch, and every change is written through with compare-and-swap, so any number of
//! API server replicas can serve the same sandboxes:
//! - a change is `update`: read the cached record and its revision, apply the change,
//!   write it if the revision still holds; on a conflict, read the store and try again;
//! - a create is one transaction that checks the sandbox id and its idempotency key are
//!   free; a retry on another replica finds the key taken and the first sandbox;
//! - a removal deletes the record and its key, and may leave a tombstone, at once.
//!
//! Quotas ride on the same transactions: a create's record is stored together with its
//! tenant's usage record, reserved by [`dsec_iam::Iam::reserve`] (a compare-and-swap on
//! the usage: of replicas racing for the last unit of a quota, one wins and the others
//! reserve again and are refused), and a removal gives back what its record says it
//! reserved, in the transaction that deletes it (guarded by the record's revision, so
//! two removals cannot both give it back). Records written before quotas existed
//! reserved nothing and give nothing back. Idempotency keys are per tenant.
//!
//! Activity (`last_active_at`) is kept here only (a write per call would cost too much):
//! the cache keeps the newest it saw, and writes carry it when something else changes.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsec_iam::{Iam, IamError, Quotas, Usage, DEFAULT_TENANT};
use dsec_state::{Entry, Expect, Op, Revision, StateError, StateStore, Txn, WatchEvent};
use dsec_wire::v1::{EventKind, Sandbox, SandboxState};
use dsec_wire::{ApiError, ErrorCode};
use futures::StreamExt;
use sha2::Digest;

use super::events::{self, EventLog};
use super::{internal, store_err, NS_SANDBOXES, NS_TOMBSTONES};

/// Namespace of idempotency keys: hash of the key -> [`IdemEntry`].
pub(super) const NS_IDEMPOTENCY: &str = "idempotency";
/// Namespace of what a create asked for beyond its record (the request's env, workdir
/// and user, for forks): sandbox id -> [`Launch`]. Written with the record (only when
/// there is something to keep), deleted with it; never shown to clients.
const NS_LAUNCH: &str = "launch";
/// Namespace of creates in flight: sandbox id -> the replica making it, on that
/// replica's lease (gone when the replica is).
const NS_CREATING: &str = "creating";
/// How long a dead replica's creates stay claimed.
const REPLICA_LEASE_TTL: Duration = Duration::from_secs(5);
/// How often a conflicting write is retried before giving up.
const CAS_ATTEMPTS: usize = 32;
/// How long a transaction whose answer was lost may still be applied: etcd commits a
/// proposal it held when quorum returns (well within its own request timeout of ~7 s).
const IN_DOUBT_SETTLE: Duration = Duration::from_secs(30);
/// How often creates given up on are looked for in the store.
const GIVE_UP_TICK: Duration = Duration::from_millis(500);

/// Persisted record of a sandbox (the API view plus what create needs to remember).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Record {
    sandbox: Sandbox,
    /// What its create reserved of its tenant's quotas (given back when it is removed);
    /// absent in records written before quotas existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    charged: Option<Usage>,
}

/// What a sandbox's create asked for that its record does not show: a fork of it asks
/// for the same.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(super) struct Launch {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
}

impl Launch {
    /// Whether there is nothing to keep.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// What a create stores beside its record, in the same transaction.
#[derive(Debug, Clone, Default)]
pub(super) struct Extras {
    /// What its create asked for that the record does not show.
    pub launch: Launch,
    /// The write of its model gateway token's record (deleted with it).
    pub model_token: Option<Op>,
}

/// Why a removed sandbox is gone (`expired` answers name it).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(super) struct Tombstone {
    pub reason: String,
    pub at: u64,
    /// The sandbox's tenant (only it is told `expired`; others get `not_found`). Set by
    /// [`Records::remove`].
    #[serde(default = "default_tenant")]
    pub tenant: String,
}

fn default_tenant() -> String {
    DEFAULT_TENANT.into()
}

/// What an idempotency key points at.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(super) struct IdemEntry {
    /// The sandbox the first create made.
    pub id: String,
    /// Hex SHA-256 of that create's request; `None` for keys of records written before
    /// keys were stored (compared by the record's fields instead).
    pub digest: Option<String>,
}

/// A create could not claim its id or idempotency key.
#[derive(Debug)]
pub(super) enum InsertError {
    /// The key belongs to an earlier create.
    KeyTaken(IdemEntry),
    /// The store failed, or the tenant's quota refused the sandbox.
    Store(ApiError),
}

impl InsertError {
    /// The error of an insert that had no key to find taken.
    pub fn into_api(self) -> ApiError {
        match self {
            Self::Store(e) => e,
            Self::KeyTaken(first) => internal(format!("sandbox id or key taken by {}", first.id)),
        }
    }
}

#[derive(Debug, Clone)]
struct Cached {
    sb: Sandbox,
    rev: Revision,
    charged: Option<Usage>,
}

#[derive(Debug, Default)]
struct Cache {
    sandboxes: HashMap<String, Cached>,
    /// Records deleted by this replica at a revision the watch may not have passed yet:
    /// an older put seen later must not bring them back.
    deleted: HashMap<String, Revision>,
    /// The newest revision the watch has applied.
    seen: Revision,
    /// (tenant, idempotency key) -> the id of the cached record that holds it.
    by_key: HashMap<(String, String), String>,
}

impl Cache {
    /// Takes a stored version of a record unless the cache holds a newer one.
    fn offer(&mut self, sb: Sandbox, rev: Revision, charged: Option<Usage>) -> bool {
        if self.deleted.get(&sb.id).is_some_and(|&d| d >= rev) {
            return false;
        }
        match self.sandboxes.get_mut(&sb.id) {
            Some(c) if c.rev >= rev => false,
            Some(c) => {
                let active = c.sb.last_active_at.max(sb.last_active_at);
                c.sb = sb;
                c.sb.last_active_at = active;
                c.rev = rev;
                c.charged = charged;
                true
            }
            None => {
                if let Some(key) = &sb.idempotency_key {
                    self.by_key
                        .insert((sb.tenant.clone(), key.clone()), sb.id.clone());
                }
                self.sandboxes
                    .insert(sb.id.clone(), Cached { sb, rev, charged });
                true
            }
        }
    }

    /// Drops record `id` (and its key from the index).
    fn drop_record(&mut self, id: &str) {
        let Some(c) = self.sandboxes.remove(id) else {
            return;
        };
        if let Some(key) = c.sb.idempotency_key {
            let k = (c.sb.tenant, key);
            if self.by_key.get(&k).is_some_and(|held| held == id) {
                self.by_key.remove(&k);
            }
        }
    }

    fn forget(&mut self, id: &str, rev: Revision) {
        if self.sandboxes.get(id).is_some_and(|c| c.rev < rev) {
            self.drop_record(id);
        }
        // `seen` may be this very revision with its other events still coming (one
        // transaction, or one etcd batch, changes many keys at one revision).
        if rev >= self.seen {
            self.deleted.insert(id.to_string(), rev);
        }
    }
}

/// This replica's view of the sandbox records (see the module doc).
#[derive(Debug)]
pub(super) struct Records {
    store: Arc<dyn StateStore>,
    cache: Mutex<Cache>,
    /// Woken whenever the cache changes (waiters for another replica's create).
    changed: tokio::sync::Notify,
    watcher: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Creates that failed whose records must go once the store answers (see
    /// [`Records::give_up`]), and the task that removes them.
    given_up: Mutex<Vec<GivenUp>>,
    /// Wakes the remover when `given_up` gains an entry (it sleeps while it is empty).
    given_up_added: Arc<tokio::sync::Notify>,
    remover: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// This replica's lease, when creates must be claimed (several replicas share the
    /// store): a create in flight holds `creating/<id>` on it.
    lease: Option<Arc<ReplicaLease>>,
    /// Quotas, charged in the transactions that insert and remove records.
    iam: Arc<Iam>,
    /// The event log: a record's change writes its event in the same transaction.
    events: Arc<EventLog>,
}

/// A create that failed: its record, if one is stored (or is stored later by a
/// transaction whose answer was lost), is removed.
#[derive(Debug)]
struct GivenUp {
    sb: Sandbox,
    /// Until when a lost transaction may still store the record: it is looked for until
    /// then, even after a removal found nothing.
    settle_at: std::time::Instant,
    /// When to look next.
    next_at: std::time::Instant,
}

/// A replica's lease, kept alive by a task; renewed with a new lease if it was lost.
#[derive(Debug)]
struct ReplicaLease {
    id: std::sync::atomic::AtomicI64,
    keeper: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl ReplicaLease {
    fn get(&self) -> dsec_state::LeaseId {
        dsec_state::LeaseId(self.id.load(std::sync::atomic::Ordering::Relaxed))
    }
}

impl Drop for ReplicaLease {
    fn drop(&mut self) {
        if let Some(t) = self.keeper.lock().unwrap_or_else(|p| p.into_inner()).take() {
            t.abort();
        }
    }
}

/// Keeps the replica's lease alive (a third of its TTL apart); grants a new one if it
/// expired (an outage longer than the TTL: creates in flight lose their claim).
async fn keep_lease(store: Arc<dyn StateStore>, lease: std::sync::Weak<ReplicaLease>) {
    loop {
        tokio::time::sleep(REPLICA_LEASE_TTL / 3).await;
        let Some(l) = lease.upgrade() else { return };
        match store.keep_alive(l.get()).await {
            Ok(()) => {}
            Err(StateError::LeaseExpired(_)) => {
                match store.grant_lease(REPLICA_LEASE_TTL).await {
                    Ok(new) => {
                        tracing::warn!("this replica's lease expired (store unreachable too long); took a new one");
                        l.id.store(new.0, std::sync::atomic::Ordering::Relaxed);
                    }
                    Err(e) => tracing::warn!(error = %e, "renewing this replica's lease failed"),
                }
            }
            Err(e) => tracing::warn!(error = %e, "keeping this replica's lease alive failed"),
        }
    }
}

impl Drop for Records {
    fn drop(&mut self) {
        for task in [&self.watcher, &self.remover] {
            if let Some(task) = task.lock().unwrap_or_else(|p| p.into_inner()).take() {
                task.abort();
            }
        }
    }
}

/// Removes the records of creates given up on ([`Records::give_up`]) as the store lets it;
/// idle (no timer) while there are none.
async fn remove_given_up(records: std::sync::Weak<Records>, added: Arc<tokio::sync::Notify>) {
    loop {
        let idle = match records.upgrade() {
            Some(r) => r
                .given_up
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_empty(),
            None => return,
        };
        if idle {
            // An entry queued since the check left a permit: this returns at once.
            added.notified().await;
        }
        tokio::time::sleep(GIVE_UP_TICK).await;
        let Some(r) = records.upgrade() else { return };
        let now = std::time::Instant::now();
        let due: Vec<Sandbox> = r
            .given_up
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|g| g.next_at <= now)
            .map(|g| g.sb.clone())
            .collect();
        for sb in due {
            let removed = r.remove(&sb, None).await;
            let mut given_up = r.given_up.lock().unwrap_or_else(|p| p.into_inner());
            let Some(i) = given_up.iter().position(|g| g.sb.id == sb.id) else {
                continue;
            };
            match removed {
                Ok(()) if given_up[i].settle_at <= now => {
                    tracing::info!(id = %sb.id, "removed what a failed create left");
                    given_up.swap_remove(i);
                }
                // Removed (or not there yet): look once more when nothing can store it.
                Ok(()) => given_up[i].next_at = given_up[i].settle_at,
                Err(e) => {
                    tracing::debug!(id = %sb.id, error = %e, "a failed create's record cannot be removed yet");
                    given_up[i].next_at = now + GIVE_UP_TICK;
                }
            }
        }
    }
}

fn decode(entry: &Entry) -> Option<(Sandbox, Option<Usage>)> {
    match serde_json::from_slice::<Record>(&entry.value) {
        Ok(r) => Some((r.sandbox, r.charged)),
        Err(e) => {
            tracing::warn!(id = %entry.key, error = %e, "ignoring an unreadable sandbox record");
            None
        }
    }
}

fn encode(sb: &Sandbox, charged: Option<Usage>) -> ApiResult<Vec<u8>> {
    serde_json::to_vec(&Record {
        sandbox: sb.clone(),
        charged,
    })
    .map_err(internal)
}

type ApiResult<T> = Result<T, ApiError>;

/// The store key of `tenant`'s idempotency key (hashed: any characters, fixed length).
/// Keys are per tenant: another tenant's create with the same key is a different
/// create. `default`'s keys hash as they did before tenants existed.
pub(super) fn idem_key(tenant: &str, key: &str) -> String {
    let mut h = sha2::Sha256::new();
    if tenant != DEFAULT_TENANT {
        h.update(tenant.as_bytes());
        h.update([0]);
    }
    h.update(key.as_bytes());
    hex::encode(h.finalize())
}

fn is_conflict(e: &StateError) -> bool {
    matches!(e, StateError::Conflict { .. })
}

/// A short jittered pause before retrying a write another replica won.
async fn backoff(attempt: usize) {
    use rand::Rng;
    let cap = 1u64 << attempt.min(5);
    let ms = rand::thread_rng().gen_range(0..=cap);
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

impl Records {
    /// This replica's lease (replicas sharing nodes; `None` for a sole owner): keys put
    /// with it go when the replica does.
    pub fn replica_lease(&self) -> Option<dsec_state::LeaseId> {
        self.lease.as_ref().map(|l| l.get())
    }

    /// Loads every record and starts the watch that keeps them fresh. With
    /// `claim_creates` (replicas share the store), creates in flight are claimed on a
    /// lease of this replica, so another can tell a create whose replica died.
    pub async fn open(
        store: Arc<dyn StateStore>,
        claim_creates: bool,
        iam: Arc<Iam>,
        events: Arc<EventLog>,
    ) -> ApiResult<Arc<Self>> {
        let lease = if claim_creates {
            let id = store
                .grant_lease(REPLICA_LEASE_TTL)
                .await
                .map_err(store_err)?;
            let lease = Arc::new(ReplicaLease {
                id: std::sync::atomic::AtomicI64::new(id.0),
                keeper: Mutex::new(None),
            });
            let task = tokio::spawn(keep_lease(store.clone(), Arc::downgrade(&lease)));
            *lease.keeper.lock().unwrap_or_else(|p| p.into_inner()) = Some(task);
            Some(lease)
        } else {
            None
        };
        let (entries, rev) = store.list(NS_SANDBOXES).await.map_err(store_err)?;
        let mut cache = Cache {
            seen: rev,
            ..Cache::default()
        };
        for e in &entries {
            if let Some((sb, charged)) = decode(e) {
                cache.offer(sb, e.rev, charged);
            }
        }
        let records = Arc::new(Self {
            store,
            cache: Mutex::new(cache),
            changed: tokio::sync::Notify::new(),
            watcher: Mutex::new(None),
            given_up: Mutex::new(Vec::new()),
            given_up_added: Arc::new(tokio::sync::Notify::new()),
            remover: Mutex::new(None),
            lease,
            iam,
            events,
        });
        let task = tokio::spawn(watch(Arc::downgrade(&records), rev));
        *records.watcher.lock().unwrap_or_else(|p| p.into_inner()) = Some(task);
        let task = tokio::spawn(remove_given_up(
            Arc::downgrade(&records),
            records.given_up_added.clone(),
        ));
        *records.remover.lock().unwrap_or_else(|p| p.into_inner()) = Some(task);
        Ok(records)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The cached record of `id`.
    pub fn get(&self, id: &str) -> Option<Sandbox> {
        self.lock().sandboxes.get(id).map(|c| c.sb.clone())
    }

    /// The record of `id`: cached, else read from the store (another replica may have
    /// made it a moment ago, before this one's watch saw it).
    pub async fn find(&self, id: &str) -> ApiResult<Option<Sandbox>> {
        if let Some(sb) = self.get(id) {
            return Ok(Some(sb));
        }
        self.fetch(id).await.map(|c| c.map(|c| c.sb))
    }

    /// The record of `id` as the store has it now (and the cache after).
    pub async fn fetch_fresh(&self, id: &str) -> ApiResult<Option<Sandbox>> {
        self.fetch(id).await.map(|c| c.map(|c| c.sb))
    }

    /// Reads `id` from the store into the cache.
    async fn fetch(&self, id: &str) -> ApiResult<Option<Cached>> {
        let entry = self.store.get(NS_SANDBOXES, id).await.map_err(store_err)?;
        let mut cache = self.lock();
        match entry.as_ref().and_then(|e| decode(e).map(|d| (d, e.rev))) {
            Some(((sb, charged), rev)) => {
                cache.offer(sb, rev, charged);
                Ok(cache.sandboxes.get(id).cloned())
            }
            None => {
                cache.drop_record(id);
                Ok(None)
            }
        }
    }

    /// Cached records that `keep` selects.
    pub fn filter(&self, keep: impl Fn(&Sandbox) -> bool) -> Vec<Sandbox> {
        self.lock()
            .sandboxes
            .values()
            .filter(|c| keep(&c.sb))
            .map(|c| c.sb.clone())
            .collect()
    }

    /// How many cached records `keep` selects.
    pub fn count(&self, keep: impl Fn(&Sandbox) -> bool) -> usize {
        self.lock()
            .sandboxes
            .values()
            .filter(|c| keep(&c.sb))
            .count()
    }

    /// Replaces the cached record of `id` without writing it (a create in flight shows
    /// `ready` to its own calls before it is stored so).
    pub fn cache_only(&self, sb: &Sandbox) {
        if let Some(c) = self.lock().sandboxes.get_mut(&sb.id) {
            c.sb = sb.clone();
        }
    }

    /// Notes activity on `id` (kept in this replica's cache only).
    pub fn touch(&self, id: &str, at: u64) {
        if let Some(c) = self.lock().sandboxes.get_mut(id) {
            c.sb.last_active_at = c.sb.last_active_at.max(at);
        }
    }

    /// Changes record `id` with `change` (which may run several times, each on the
    /// newest version; it returns whether it changed anything) and writes it if it did.
    /// `Ok(None)` if there is no record; else the record after, and whether it changed.
    pub async fn update(
        &self,
        id: &str,
        change: impl FnMut(&mut Sandbox) -> ApiResult<bool>,
    ) -> ApiResult<Option<(Sandbox, bool)>> {
        self.write(id, change, false, None)
            .await
            .map_err(InsertError::into_api)
    }

    /// [`Records::update`] that also claims `tenant`'s idempotency `key` for the record
    /// in the same transaction (a warm sandbox claimed by a keyed create):
    /// [`InsertError::KeyTaken`] when an earlier create holds the key.
    pub async fn update_keyed(
        &self,
        id: &str,
        (tenant, key, entry): (&str, &str, IdemEntry),
        change: impl FnMut(&mut Sandbox) -> ApiResult<bool>,
    ) -> Result<Option<(Sandbox, bool)>, InsertError> {
        let value = serde_json::to_vec(&entry).map_err(|e| InsertError::Store(internal(e)))?;
        self.write(id, change, false, Some((tenant, key, value)))
            .await
    }

    /// [`Records::update`] for the last write of a create: drops the create's claim in
    /// the same transaction (one store write, not two).
    pub async fn complete_create(
        &self,
        id: &str,
        change: impl FnMut(&mut Sandbox) -> ApiResult<bool>,
    ) -> ApiResult<Option<(Sandbox, bool)>> {
        self.write(id, change, true, None)
            .await
            .map_err(InsertError::into_api)
    }

    async fn write(
        &self,
        id: &str,
        mut change: impl FnMut(&mut Sandbox) -> ApiResult<bool>,
        end_claim: bool,
        key: Option<(&str, &str, Vec<u8>)>,
    ) -> Result<Option<(Sandbox, bool)>, InsertError> {
        let store = InsertError::Store;
        let mut current = self.lock().sandboxes.get(id).cloned();
        // Whether `current` was read from the store now (not this replica's cache).
        let mut fresh = current.is_none();
        if fresh {
            current = self.fetch(id).await.map_err(store)?;
        }
        for _ in 0..CAS_ATTEMPTS {
            let Some(Cached { sb, rev, charged }) = current else {
                return Ok(None);
            };
            let mut next = sb.clone();
            let verdict = change(&mut next);
            // A refusal or a no-op decided on the cache may be a moment behind another
            // replica's write (a create it just finished): decide again on the store's.
            if !fresh && self.lease.is_some() && !matches!(verdict, Ok(true)) {
                current = self.fetch(id).await.map_err(store)?;
                fresh = true;
                continue;
            }
            if !verdict.map_err(store)? {
                return Ok(Some((next, false)));
            }
            let mut txn = Txn {
                checks: vec![(NS_SANDBOXES.into(), id.to_string(), Expect::Rev(rev))],
                ops: vec![Op::Put {
                    ns: NS_SANDBOXES.into(),
                    key: id.to_string(),
                    value: encode(&next, charged).map_err(store)?,
                    lease: None,
                }],
            };
            if let Some(op) = events::transition(&sb, &next).and_then(|e| self.events.op(&e)) {
                txn.ops.push(op);
            }
            if end_claim && self.lease.is_some() {
                txn.ops.push(Op::Delete {
                    ns: NS_CREATING.into(),
                    key: id.to_string(),
                });
            }
            if let Some((tenant, key, value)) = &key {
                let stored_key = idem_key(tenant, key);
                txn.checks
                    .push((NS_IDEMPOTENCY.into(), stored_key.clone(), Expect::Absent));
                txn.ops.push(Op::Put {
                    ns: NS_IDEMPOTENCY.into(),
                    key: stored_key,
                    value: value.clone(),
                    lease: None,
                });
            }
            match self.store.txn(txn).await {
                Ok(written) => {
                    self.lock().offer(next.clone(), written, charged);
                    self.changed.notify_waiters();
                    return Ok(Some((next, true)));
                }
                Err(StateError::Conflict { ns, .. }) if ns == NS_IDEMPOTENCY => {
                    let Some((tenant, key, _)) = &key else {
                        break;
                    };
                    if let Some(first) = self.idempotency(tenant, key).await.map_err(store)? {
                        return Err(InsertError::KeyTaken(first));
                    }
                    // Its sandbox went meanwhile: try again.
                    current = self.fetch(id).await.map_err(store)?;
                    fresh = true;
                }
                Err(e) if is_conflict(&e) => {
                    current = self.fetch(id).await.map_err(store)?;
                    fresh = true;
                }
                Err(e) => return Err(store(store_err(e))),
            }
        }
        Err(store(ApiError::new(
            ErrorCode::Conflict,
            format!("sandbox {id} is being changed by other requests: retry"),
        )))
    }

    /// Cached records that charged nothing at their create (their tenant had no quotas
    /// then) and that `keep` selects.
    pub fn uncharged(&self, mut keep: impl FnMut(&Sandbox) -> bool) -> Vec<Sandbox> {
        self.lock()
            .sandboxes
            .values()
            .filter(|c| c.charged.is_none() && keep(&c.sb))
            .map(|c| c.sb.clone())
            .collect()
    }

    /// Counts record `id`, which charged nothing at its create, in its tenant's usage
    /// now: the record and the usage change in one transaction, and the record then
    /// gives its charge back when it is removed. False if it is gone or charged already
    /// (another replica got there first).
    pub async fn charge_late(&self, id: &str) -> ApiResult<bool> {
        let cached = self.lock().sandboxes.get(id).cloned();
        let mut current = match cached {
            Some(c) => Some(c),
            None => self.fetch(id).await?,
        };
        let Some(tenant) = current.as_ref().map(|c| c.sb.tenant.clone()) else {
            return Ok(false);
        };
        let _usage = self.iam.lock_usage(&tenant).await;
        for attempt in 0..CAS_ATTEMPTS {
            let Some(Cached { sb, rev, charged }) = current.take() else {
                return Ok(false);
            };
            if charged.is_some() {
                return Ok(false);
            }
            let charge = Usage::sandbox(
                (sb.resources.cpu * 1000.0).round() as u64,
                sb.resources.memory_mb,
            );
            let quota = self.iam.count(&sb.tenant, charge).await?;
            let mut txn = Txn {
                checks: vec![(NS_SANDBOXES.into(), id.to_string(), Expect::Rev(rev))],
                ops: vec![Op::Put {
                    ns: NS_SANDBOXES.into(),
                    key: id.to_string(),
                    value: encode(&sb, Some(charge))?,
                    lease: None,
                }],
            };
            let lost_race = |e: &StateError| quota.lost_race(e);
            quota.clone().add_to(&mut txn);
            match self.store.txn(txn).await {
                Ok(written) => {
                    self.lock().offer(sb, written, Some(charge));
                    return Ok(true);
                }
                Err(e) if lost_race(&e) => {
                    backoff(attempt).await;
                    current = self.fetch(id).await?;
                }
                Err(e) if is_conflict(&e) => current = self.fetch(id).await?,
                Err(e) => return Err(store_err(e)),
            }
        }
        Err(ApiError::new(
            ErrorCode::Conflict,
            format!("sandbox {id}: counting it in its tenant's usage was contended: retry"),
        ))
    }

    /// Writes a record as it is (no check of what the store holds): for records this
    /// replica alone is changing, such as a create in flight.
    pub async fn put(&self, sb: &Sandbox) -> ApiResult<()> {
        let (charged, before) = match self.lock().sandboxes.get(&sb.id) {
            Some(c) => (c.charged, Some(c.sb.clone())),
            None => (None, None),
        };
        let mut ops = vec![Op::Put {
            ns: NS_SANDBOXES.into(),
            key: sb.id.clone(),
            value: encode(sb, charged)?,
            lease: None,
        }];
        let event = before.and_then(|b| events::transition(&b, sb));
        ops.extend(event.and_then(|e| self.events.op(&e)));
        let rev = self
            .store
            .txn(Txn {
                checks: Vec::new(),
                ops,
            })
            .await
            .map_err(store_err)?;
        self.lock().offer(sb.clone(), rev, charged);
        self.changed.notify_waiters();
        Ok(())
    }

    /// Stores a new record, claiming its id and (if given) its idempotency key, and
    /// reserving `charge` of its tenant's quotas, in one transaction. A quota that
    /// refuses it is `quota_exceeded` (nothing written), unless the key is taken: then
    /// the earlier create is the answer ([`InsertError::KeyTaken`]), full quota or not.
    pub async fn insert(
        &self,
        sb: &Sandbox,
        key: Option<(&str, IdemEntry)>,
        charge: Usage,
        extras: &Extras,
    ) -> Result<(), InsertError> {
        let launch = &extras.launch;
        // A tenant without quotas (as this replica's cache has it: a quota set elsewhere
        // a moment ago may be missed for that moment) is not charged: its creates neither
        // queue on the usage lock nor contend for the usage record across replicas, so a
        // create stays one commit. Its sandboxes release nothing either, so usage counts
        // only sandboxes created while a quota was set.
        let unlimited = self
            .iam
            .cached_tenant(&sb.tenant)
            .is_some_and(|t| !t.disabled && t.quotas == Quotas::default());
        let mut base = Txn {
            checks: vec![(NS_SANDBOXES.into(), sb.id.clone(), Expect::Absent)],
            ops: vec![Op::Put {
                ns: NS_SANDBOXES.into(),
                key: sb.id.clone(),
                value: encode(sb, (!unlimited).then_some(charge)).map_err(InsertError::Store)?,
                lease: None,
            }],
        };
        if !launch.is_empty() {
            base.ops.push(Op::Put {
                ns: NS_LAUNCH.into(),
                key: sb.id.clone(),
                value: serde_json::to_vec(launch).map_err(|e| InsertError::Store(internal(e)))?,
                lease: None,
            });
        }
        if let Some(op) = &extras.model_token {
            base.ops.push(op.clone());
        }
        let mut told = vec![events::about(sb, EventKind::Created)];
        // Stored whole (made on its node before its record was written): ready too.
        if sb.state == SandboxState::Ready {
            told.push(events::about(sb, EventKind::Ready));
        }
        base.ops.extend(self.events.ops(&told));
        // A record stored `creating` is claimed while its create runs (one stored `ready`
        // is made already).
        if let Some(lease) = self
            .lease
            .as_ref()
            .filter(|_| sb.state == SandboxState::Creating)
        {
            base.ops.push(Op::Put {
                ns: NS_CREATING.into(),
                key: sb.id.clone(),
                value: Vec::new(),
                lease: Some(lease.get()),
            });
        }
        if let Some((key, entry)) = &key {
            let value = serde_json::to_vec(entry).map_err(|e| InsertError::Store(internal(e)))?;
            let stored_key = idem_key(&sb.tenant, key);
            base.checks
                .push((NS_IDEMPOTENCY.into(), stored_key.clone(), Expect::Absent));
            base.ops.push(Op::Put {
                ns: NS_IDEMPOTENCY.into(),
                key: stored_key,
                value,
                lease: None,
            });
        }
        // This replica's creates of the tenant queue here rather than race each other
        // for the usage record; only other replicas' win a race.
        let _usage = match unlimited {
            true => None,
            false => Some(self.iam.lock_usage(&sb.tenant).await),
        };
        for attempt in 0..CAS_ATTEMPTS {
            let quota = match unlimited {
                true => None,
                false => Some(self.iam.reserve(&sb.tenant, charge).await),
            };
            let quota = match quota {
                None => None,
                Some(Ok(q)) => Some(q),
                Some(Err(e)) => {
                    if let (IamError::QuotaExceeded { .. }, Some((key, _))) = (&e, &key) {
                        if let Some(first) = self
                            .idempotency(&sb.tenant, key)
                            .await
                            .map_err(InsertError::Store)?
                        {
                            return Err(InsertError::KeyTaken(first));
                        }
                    }
                    return Err(InsertError::Store(e.into()));
                }
            };
            let mut txn = base.clone();
            let lost_race = |e: &StateError| quota.as_ref().is_some_and(|q| q.lost_race(e));
            if let Some(q) = quota.clone() {
                q.add_to(&mut txn);
            }
            match self.store.txn(txn).await {
                Ok(rev) => {
                    let charged = quota.is_some().then_some(charge);
                    self.lock().offer(sb.clone(), rev, charged);
                    self.changed.notify_waiters();
                    return Ok(());
                }
                Err(e) if lost_race(&e) => {
                    // Another replica changed the usage first: reserve again.
                    backoff(attempt).await;
                }
                Err(StateError::Conflict { ns, .. }) if ns == NS_IDEMPOTENCY => {
                    let Some((key, _)) = &key else { break };
                    match self
                        .idempotency(&sb.tenant, key)
                        .await
                        .map_err(InsertError::Store)?
                    {
                        Some(first) => return Err(InsertError::KeyTaken(first)),
                        // Its sandbox was removed meanwhile: claim it again.
                        None => continue,
                    }
                }
                Err(e) => {
                    // The store may apply it yet (etcd does once quorum returns). A
                    // keyed record stored `ready` (its sandbox made) may: a retry with
                    // the key then finds a whole sandbox (if it never lands, the node's
                    // reaper destroys the sandbox as an orphan). Anything else the
                    // caller is told failed must go.
                    let whole = key.is_some() && sb.state == SandboxState::Ready;
                    if matches!(e, StateError::Unavailable(_)) && !whole {
                        self.queue_give_up(sb, IN_DOUBT_SETTLE);
                    }
                    return Err(InsertError::Store(store_err(e)));
                }
            }
        }
        Err(InsertError::Store(ApiError::new(
            ErrorCode::Conflict,
            format!("sandbox {} could not be stored: retry", sb.id),
        )))
    }

    /// Gives up on a create whose caller is told it failed: its record, claim and key go
    /// (and its reservation is given back), now or, if the store cannot be written now,
    /// once it can. A keyed retry waiting on the record then finds it gone and creates.
    pub async fn give_up(&self, sb: &Sandbox) {
        if let Err(e) = self.remove(sb, None).await {
            tracing::warn!(id = %sb.id, error = %e, "a failed create's record stays until the store answers");
            self.queue_give_up(sb, Duration::ZERO);
        }
    }

    /// If this replica gave up on the create of `id`, removes its record now (a keyed
    /// retry found it before the removal task did) and says how that went; `None`
    /// otherwise. The removal task keeps looking until the create's answer settles.
    pub async fn remove_if_given_up(&self, id: &str) -> Option<ApiResult<()>> {
        let sb = self
            .given_up
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|g| g.sb.id == id)
            .map(|g| g.sb.clone())?;
        Some(self.remove(&sb, None).await)
    }

    fn queue_give_up(&self, sb: &Sandbox, settle: Duration) {
        let now = std::time::Instant::now();
        self.given_up
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(GivenUp {
                sb: sb.clone(),
                settle_at: now + settle,
                next_at: now,
            });
        self.given_up_added.notify_one();
    }

    /// Drops this replica's claim on a create that ended (either way).
    pub async fn finish_create(&self, id: &str) {
        if self.lease.is_some() {
            let _ = self.store.delete(NS_CREATING, id, Expect::Any).await;
        }
    }

    /// Whether `sb`, `creating`, was abandoned: the replica making it is gone (its
    /// claim went with its lease). Never true where creates are not claimed.
    pub async fn abandoned(&self, sb: &Sandbox) -> ApiResult<bool> {
        if self.lease.is_none() || sb.state != SandboxState::Creating {
            return Ok(false);
        }
        let claimed = self
            .store
            .get(NS_CREATING, &sb.id)
            .await
            .map_err(store_err)?
            .is_some();
        if claimed {
            return Ok(false);
        }
        // The claim and the record are written together: a record read before it was
        // finished may be stale.
        Ok(self
            .fetch(&sb.id)
            .await?
            .is_some_and(|c| c.sb.state == SandboxState::Creating))
    }

    /// Whether this replica's cache holds a record with `tenant`'s idempotency `key` (a
    /// record stored a moment ago by another replica may not be in it yet).
    pub fn key_cached(&self, tenant: &str, key: &str) -> bool {
        self.lock()
            .by_key
            .contains_key(&(tenant.to_string(), key.to_string()))
    }

    /// What `tenant`'s idempotency key points at, if it is taken.
    pub async fn idempotency(&self, tenant: &str, key: &str) -> ApiResult<Option<IdemEntry>> {
        let Some(entry) = self
            .store
            .get(NS_IDEMPOTENCY, &idem_key(tenant, key))
            .await
            .map_err(store_err)?
        else {
            return Ok(None);
        };
        serde_json::from_slice(&entry.value)
            .map(Some)
            .map_err(internal)
    }

    /// Claims the idempotency keys of records stored before keys had entries of their
    /// own: one list of the keys, then a write only for each key missing from it (a
    /// start costs nothing more once every key has its entry).
    pub async fn adopt_missing_keys(&self) -> ApiResult<()> {
        let keyed = self.filter(|s| s.idempotency_key.is_some());
        if keyed.is_empty() {
            return Ok(());
        }
        let (entries, _) = self.store.list(NS_IDEMPOTENCY).await.map_err(store_err)?;
        let stored: std::collections::HashSet<String> =
            entries.into_iter().map(|e| e.key).collect();
        for sb in keyed {
            if let Some(key) = &sb.idempotency_key {
                if !stored.contains(&idem_key(&sb.tenant, key)) {
                    self.adopt_key(&sb.tenant, key, &sb.id).await?;
                }
            }
        }
        Ok(())
    }

    /// Claims an idempotency key for an existing record; a key already taken is left as
    /// it is.
    async fn adopt_key(&self, tenant: &str, key: &str, id: &str) -> ApiResult<()> {
        let entry = IdemEntry {
            id: id.to_string(),
            digest: None,
        };
        let value = serde_json::to_vec(&entry).map_err(internal)?;
        match self
            .store
            .put(
                NS_IDEMPOTENCY,
                &idem_key(tenant, key),
                &value,
                Expect::Absent,
            )
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if is_conflict(&e) => Ok(()),
            Err(e) => Err(store_err(e)),
        }
    }

    /// Deletes record `id` and its idempotency key, giving back what it reserved of its
    /// tenant's quotas; with a tombstone, remembers why. Removing a record that is gone
    /// already changes nothing (and gives nothing back twice).
    pub async fn remove(&self, sb: &Sandbox, tombstone: Option<Tombstone>) -> ApiResult<()> {
        let mut leftovers = vec![Op::Delete {
            ns: NS_LAUNCH.into(),
            key: sb.id.clone(),
        }];
        if let Some(token) = &sb.model_token_id {
            leftovers.push(dsec_iam::Iam::delete_model_token_op(token));
        }
        if self.lease.is_some() {
            leftovers.push(Op::Delete {
                ns: NS_CREATING.into(),
                key: sb.id.clone(),
            });
        }
        let mut removed = events::about(sb, EventKind::Deleted);
        if sb.state == SandboxState::Creating {
            removed.cause = Some("its create failed or was abandoned".into());
        }
        if let Some(t) = &tombstone {
            removed.kind = EventKind::Expired;
            removed.cause = Some(t.reason.clone());
        }
        let removed = self.events.op(&removed);
        if let Some(mut t) = tombstone {
            t.tenant = sb.tenant.clone();
            leftovers.push(Op::Put {
                ns: NS_TOMBSTONES.into(),
                key: sb.id.clone(),
                value: serde_json::to_vec(&t).map_err(internal)?,
                lease: None,
            });
        }
        // The record as this replica knows it: its revision guards the removal (a stale
        // one fails the check, and the store is read), and what it reserved is fixed at
        // its create. A record that reserved nothing takes no usage lock.
        let mut current = self
            .lock()
            .sandboxes
            .get(&sb.id)
            .map(|c| (c.rev, c.charged));
        let _usage = match current {
            Some((_, None)) => None,
            _ => Some(self.iam.lock_usage(&sb.tenant).await),
        };
        if current.is_none() {
            current = self.stored(&sb.id).await?;
        }
        let mut done = None;
        for attempt in 0..CAS_ATTEMPTS {
            let Some((rev, charged)) = current else {
                // Gone already (another removal won): only the leftovers go, and the key
                // only if it is still this sandbox's (read: a create may have claimed the
                // freed key meanwhile; then it is left alone).
                let mut ops = leftovers.clone();
                if let Some(key) = &sb.idempotency_key {
                    if self
                        .idempotency(&sb.tenant, key)
                        .await?
                        .is_some_and(|e| e.id == sb.id)
                    {
                        ops.push(Op::Delete {
                            ns: NS_IDEMPOTENCY.into(),
                            key: idem_key(&sb.tenant, key),
                        });
                    }
                }
                let rev = self
                    .store
                    .txn(Txn {
                        checks: Vec::new(),
                        ops,
                    })
                    .await
                    .map_err(store_err)?;
                done = Some(rev);
                break;
            };
            let mut txn = Txn {
                checks: vec![(NS_SANDBOXES.into(), sb.id.clone(), Expect::Rev(rev))],
                ops: vec![Op::Delete {
                    ns: NS_SANDBOXES.into(),
                    key: sb.id.clone(),
                }],
            };
            // While its record is there, the key is the record's: the two are stored and
            // deleted together.
            if let Some(key) = &sb.idempotency_key {
                txn.ops.push(Op::Delete {
                    ns: NS_IDEMPOTENCY.into(),
                    key: idem_key(&sb.tenant, key),
                });
            }
            txn.ops.extend(leftovers.iter().cloned());
            txn.ops.extend(removed.clone());
            if let Some(charged) = charged {
                self.iam
                    .release(&sb.tenant, charged)
                    .await
                    .map_err(ApiError::from)?
                    .add_to(&mut txn);
            }
            match self.store.txn(txn).await {
                Ok(rev) => {
                    done = Some(rev);
                    break;
                }
                // The record changed, or another replica changed the usage: again.
                Err(e) if is_conflict(&e) => {
                    backoff(attempt).await;
                    current = self.stored(&sb.id).await?;
                }
                Err(e) => return Err(store_err(e)),
            }
        }
        let Some(rev) = done else {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!(
                    "sandbox {} is being changed by other requests: retry",
                    sb.id
                ),
            ));
        };
        self.lock().forget(&sb.id, rev.max(1));
        self.lock().drop_record(&sb.id);
        self.changed.notify_waiters();
        Ok(())
    }

    /// The revision of record `id` in the store and what it reserved, if it is there.
    async fn stored(&self, id: &str) -> ApiResult<Option<(Revision, Option<Usage>)>> {
        let entry = self.store.get(NS_SANDBOXES, id).await.map_err(store_err)?;
        Ok(entry.map(|e| (e.rev, decode(&e).and_then(|(_, c)| c))))
    }

    /// What sandbox `id`'s create asked for beyond its record (empty when nothing).
    pub async fn launch(&self, id: &str) -> ApiResult<Launch> {
        match self.store.get(NS_LAUNCH, id).await.map_err(store_err)? {
            Some(e) => serde_json::from_slice(&e.value).map_err(internal),
            None => Ok(Launch::default()),
        }
    }

    /// Why `id` was removed, if a tombstone says.
    pub async fn tombstone(&self, id: &str) -> Option<Tombstone> {
        let entry = self.store.get(NS_TOMBSTONES, id).await.ok()??;
        serde_json::from_slice(&entry.value).ok()
    }

    /// Deletes tombstones older than `max_age_ms`.
    pub async fn prune_tombstones(&self, now: u64, max_age_ms: u64) {
        let Ok((entries, _)) = self.store.list(NS_TOMBSTONES).await else {
            return;
        };
        for e in entries {
            let old = serde_json::from_slice::<Tombstone>(&e.value)
                .map_or(true, |t| now.saturating_sub(t.at) > max_age_ms);
            if old {
                let _ = self
                    .store
                    .delete(NS_TOMBSTONES, &e.key, Expect::Rev(e.rev))
                    .await;
            }
        }
    }

    /// Waits until the cache changes or `timeout` passes.
    pub async fn changed(&self, timeout: Duration) {
        let _ = tokio::time::timeout(timeout, self.changed.notified()).await;
    }

    /// Applies one watched change.
    fn apply(&self, event: WatchEvent) {
        let mut cache = self.lock();
        let rev = event.rev();
        match event {
            WatchEvent::Put(entry) => {
                if let Some((sb, charged)) = decode(&entry) {
                    cache.offer(sb, entry.rev, charged);
                }
            }
            WatchEvent::Delete { key, rev } => cache.forget(&key, rev),
        }
        cache.seen = cache.seen.max(rev);
        let seen = cache.seen;
        // Deletes at `seen` stay until the watch is past it (its other events may be
        // deletes that a stale local put must not undo).
        cache.deleted.retain(|_, r| *r >= seen);
        drop(cache);
        self.changed.notify_waiters();
    }

    /// Replaces the cache with a fresh list (after the watch lost its history).
    fn relist(&self, entries: Vec<Entry>, rev: Revision) {
        let mut cache = self.lock();
        let listed: std::collections::HashSet<&str> =
            entries.iter().map(|e| e.key.as_str()).collect();
        let gone: Vec<String> = cache
            .sandboxes
            .iter()
            .filter(|(id, c)| !listed.contains(id.as_str()) && c.rev <= rev)
            .map(|(id, _)| id.clone())
            .collect();
        for id in gone {
            cache.drop_record(&id);
        }
        for e in &entries {
            if let Some((sb, charged)) = decode(e) {
                cache.offer(sb, e.rev, charged);
            }
        }
        cache.seen = cache.seen.max(rev);
        drop(cache);
        self.changed.notify_waiters();
    }
}

/// Keeps `records` fresh: watches the sandbox namespace from `rev`, lists again when the
/// store's history is gone, and retries (with a growing pause) while it is unavailable.
async fn watch(records: std::sync::Weak<Records>, mut rev: Revision) {
    let mut pause = Duration::from_millis(100);
    loop {
        let Some(store) = records.upgrade().map(|r| r.store.clone()) else {
            return;
        };
        let mut stream = match store.watch(NS_SANDBOXES, rev).await {
            Ok(s) => s,
            Err(e) => {
                rev = match recover(&records, &store, e, rev).await {
                    Some(r) => r,
                    None => return,
                };
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        drop(store);
        while let Some(event) = stream.next().await {
            let Some(r) = records.upgrade() else { return };
            match event {
                Ok(ev) => {
                    pause = Duration::from_millis(100);
                    rev = rev.max(ev.rev());
                    r.apply(ev);
                }
                Err(e) => {
                    let store = r.store.clone();
                    drop(r);
                    rev = match recover(&records, &store, e, rev).await {
                        Some(r) => r,
                        None => return,
                    };
                    break;
                }
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(2));
    }
}

/// After a watch error: on `Compacted`, lists again and returns the list's revision;
/// otherwise keeps `rev`. `None` when the records are gone.
async fn recover(
    records: &std::sync::Weak<Records>,
    store: &Arc<dyn StateStore>,
    error: StateError,
    rev: Revision,
) -> Option<Revision> {
    if error != StateError::Compacted {
        tracing::warn!(%error, "watching sandbox records failed; retrying");
        return Some(rev);
    }
    match store.list(NS_SANDBOXES).await {
        Ok((entries, listed)) => {
            records.upgrade()?.relist(entries, listed);
            Some(listed)
        }
        Err(e) => {
            tracing::warn!(error = %e, "listing sandbox records failed; retrying");
            Some(rev)
        }
    }
}

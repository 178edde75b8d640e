//! The embedded engine behind [`RedbStore`] (a redb file) and [`MemStore`] (redb over
//! memory): one implementation of the semantics, so the in-memory store the control
//! plane's tests use behaves exactly like the single-node default.
//!
//! Layout: table `kv` maps `ns/key` to `[mod revision: u64 LE][lease: i64 LE][value]`
//! (lease 0: none); table `meta` holds the store's revision under `rev`.
//!
//! Watch is in-process (redb is single-process): committed changes go to a bounded
//! history and a broadcast channel. History does not survive a reopen, so a watch from
//! before the open reports [`StateError::Compacted`].
//!
//! Leases are an in-process table with deadlines and are not persisted: the only holder
//! of an embedded store's lease is the process that opened it, so when that process
//! stops its claims end with it. Opening a store deletes every key still bound to a
//! lease (what expiry would have done).

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::StreamExt;
use redb::{ReadableTable, TableHandle};
use tokio::sync::broadcast;

use crate::{
    backend, check_key, check_ns, check_txn, expect_check, holds, Entry, Expect, LeaseId, Op,
    Revision, StateError, StateStore, Txn, WatchEvent, WatchStream,
};

const KV: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("kv");
const META: redb::TableDefinition<&str, u64> = redb::TableDefinition::new("meta");
/// The table of stores written before revisions existed: plain values, migrated on open.
const LEGACY: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("state");
const REV: &str = "rev";
const HEADER: usize = 16;
/// Changes kept for watches that start in the past.
const HISTORY: usize = 10_000;
/// Changes a live watcher may fall behind before it gets [`StateError::Compacted`].
const WATCH_BUFFER: usize = 4096;

fn full_key(ns: &str, key: &str) -> String {
    format!("{ns}/{key}")
}

fn encode(rev: Revision, lease: Option<LeaseId>, value: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + value.len());
    out.extend_from_slice(&rev.to_le_bytes());
    out.extend_from_slice(&lease.map_or(0, |l| l.0).to_le_bytes());
    out.extend_from_slice(value);
    out
}

/// A stored record: (mod revision, lease, value).
fn decode(key: &str, raw: &[u8]) -> Result<(Revision, Option<LeaseId>, Vec<u8>), StateError> {
    if raw.len() < HEADER {
        return Err(StateError::Corrupt(format!(
            "record {key:?} is {} bytes, shorter than its header",
            raw.len()
        )));
    }
    let mut rev = [0u8; 8];
    rev.copy_from_slice(&raw[..8]);
    let mut lease = [0u8; 8];
    lease.copy_from_slice(&raw[8..HEADER]);
    let lease = i64::from_le_bytes(lease);
    Ok((
        u64::from_le_bytes(rev),
        (lease != 0).then_some(LeaseId(lease)),
        raw[HEADER..].to_vec(),
    ))
}

/// The revision and lease of a key, if present.
fn current(
    kv: &redb::Table<&str, &[u8]>,
    full: &str,
) -> Result<Option<(Revision, Option<LeaseId>)>, StateError> {
    match kv.get(full).map_err(backend)? {
        Some(v) => decode(full, v.value()).map(|(r, l, _)| Some((r, l))),
        None => Ok(None),
    }
}

/// A queued write.
#[derive(Debug)]
enum Write {
    Txn(Txn),
    /// Deletes those of `keys` (full keys) still bound to `lease`: its revocation.
    DropLease {
        lease: LeaseId,
        keys: Vec<String>,
    },
}

/// What an applied write did: the store's revision after it, and per op whether it
/// changed a key (a delete of an absent key does not).
#[derive(Debug, Clone)]
struct Outcome {
    rev: Revision,
    changed: Vec<bool>,
}

/// Writes waiting for a commit, and how far commits have got.
#[derive(Debug, Default)]
struct Batch {
    /// Queued writes with their sequence numbers, in order.
    queue: Vec<(u64, Write)>,
    /// The sequence number of the next write.
    next: u64,
    /// Every write numbered below this has been committed (or has failed).
    done_below: u64,
    /// A caller is committing a batch now.
    committing: bool,
    /// Results of finished writes, taken by their callers.
    results: HashMap<u64, Result<Outcome, StateError>>,
}

#[derive(Debug)]
struct Lease {
    ttl: Duration,
    deadline: Instant,
    /// Full keys bound to it.
    keys: BTreeSet<String>,
}

#[derive(Debug, Default)]
struct Leases {
    live: HashMap<LeaseId, Lease>,
    /// The expiry task runs (it stops when no lease is left).
    reaper: bool,
}

impl Leases {
    fn alive(&self, id: LeaseId) -> bool {
        self.live
            .get(&id)
            .is_some_and(|l| l.deadline > Instant::now())
    }
}

/// Committed changes for watchers.
#[derive(Debug)]
struct Hub {
    /// Recent changes `(ns, event)` in revision order.
    history: VecDeque<(String, WatchEvent)>,
    /// Every change above this revision is in `history`.
    floor: Revision,
    tx: broadcast::Sender<Arc<(String, WatchEvent)>>,
}

#[derive(Debug)]
struct Core {
    db: redb::Database,
    batch: Mutex<Batch>,
    committed: Condvar,
    leases: Mutex<Leases>,
    hub: Mutex<Hub>,
    next_lease: AtomicI64,
    unavailable: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Core {
    fn open(db: redb::Database) -> Result<Arc<Self>, StateError> {
        let tx = db.begin_write().map_err(backend)?;
        let rev;
        {
            let mut kv = tx.open_table(KV).map_err(backend)?;
            let mut meta = tx.open_table(META).map_err(backend)?;
            let mut r = meta.get(REV).map_err(backend)?.map_or(0, |v| v.value());
            // Stores from before revisions: their values move over at one revision.
            let mut legacy: Vec<(String, Vec<u8>)> = Vec::new();
            if tx
                .list_tables()
                .map_err(backend)?
                .any(|t| t.name() == LEGACY.name())
            {
                let t = tx.open_table(LEGACY).map_err(backend)?;
                for e in t.iter().map_err(backend)? {
                    let (k, v) = e.map_err(backend)?;
                    legacy.push((k.value().to_string(), v.value().to_vec()));
                }
            }
            if !legacy.is_empty() {
                r += 1;
                for (k, v) in &legacy {
                    kv.insert(k.as_str(), encode(r, None, v).as_slice())
                        .map_err(backend)?;
                }
            }
            // Leases ended with the process that held them.
            let mut leased = Vec::new();
            for e in kv.iter().map_err(backend)? {
                let (k, v) = e.map_err(backend)?;
                let (_, lease, _) = decode(k.value(), v.value())?;
                if lease.is_some() {
                    leased.push(k.value().to_string());
                }
            }
            if !leased.is_empty() {
                r += 1;
                for k in &leased {
                    kv.remove(k.as_str()).map_err(backend)?;
                }
            }
            meta.insert(REV, r).map_err(backend)?;
            rev = r;
        }
        // Only now: deleting it must commit with the migration.
        tx.delete_table(LEGACY).map_err(backend)?;
        tx.commit().map_err(backend)?;
        let (btx, _) = broadcast::channel(WATCH_BUFFER);
        Ok(Arc::new(Self {
            db,
            batch: Mutex::new(Batch::default()),
            committed: Condvar::new(),
            leases: Mutex::new(Leases::default()),
            hub: Mutex::new(Hub {
                history: VecDeque::new(),
                floor: rev,
                tx: btx,
            }),
            next_lease: AtomicI64::new(1),
            unavailable: AtomicBool::new(false),
        }))
    }

    fn up(&self) -> Result<(), StateError> {
        if self.unavailable.load(Ordering::SeqCst) {
            return Err(StateError::Unavailable(
                "the in-memory store was told to fail".into(),
            ));
        }
        Ok(())
    }

    /// Queues `write` and returns once it is durable: the first caller to find no commit
    /// under way commits everything queued; the others wait for it. So N concurrent
    /// writers pay for about two fsyncs instead of N.
    fn write(&self, write: Write) -> Result<Outcome, StateError> {
        let mut batch = lock(&self.batch);
        let seq = batch.next;
        batch.next += 1;
        batch.queue.push((seq, write));
        loop {
            if batch.done_below > seq {
                return batch.results.remove(&seq).unwrap_or_else(|| {
                    Err(StateError::Backend("a write's result went missing".into()))
                });
            }
            if batch.committing {
                batch = self
                    .committed
                    .wait(batch)
                    .unwrap_or_else(|p| p.into_inner());
                continue;
            }
            batch.committing = true;
            let writes = std::mem::take(&mut batch.queue);
            drop(batch);
            let results = self.commit(&writes);
            batch = lock(&self.batch);
            batch.committing = false;
            if let Some((last, _)) = writes.last() {
                batch.done_below = last + 1;
            }
            match results {
                Ok(results) => {
                    for ((s, _), r) in writes.iter().zip(results) {
                        batch.results.insert(*s, r);
                    }
                }
                Err(e) => {
                    for (s, _) in &writes {
                        batch.results.insert(*s, Err(e.clone()));
                    }
                }
            }
            self.committed.notify_all();
        }
    }

    /// Applies `writes` in order in one durable transaction, each at its own revision,
    /// and publishes the changes once durable. The lease table stays locked throughout,
    /// so a lease cannot end between the check that it lives and the binding of its keys.
    fn commit(
        &self,
        writes: &[(u64, Write)],
    ) -> Result<Vec<Result<Outcome, StateError>>, StateError> {
        let mut leases = lock(&self.leases);
        let tx = self.db.begin_write().map_err(backend)?;
        let mut results = Vec::with_capacity(writes.len());
        let mut events: Vec<(String, WatchEvent)> = Vec::new();
        // (full key, lease it left, lease it joined), applied once durable.
        let mut bindings: Vec<(String, Option<LeaseId>, Option<LeaseId>)> = Vec::new();
        {
            let mut kv = tx.open_table(KV).map_err(backend)?;
            let mut meta = tx.open_table(META).map_err(backend)?;
            let mut rev = meta.get(REV).map_err(backend)?.map_or(0, |v| v.value());
            for (_, w) in writes {
                let next = rev + 1;
                let mut changed = Vec::new();
                match w {
                    Write::Txn(t) => {
                        let mut failed = None;
                        for (ns, key, expect) in &t.checks {
                            let found = current(&kv, &full_key(ns, key))?.map(|(r, _)| r);
                            if !holds(*expect, found) {
                                failed = Some(StateError::Conflict {
                                    ns: ns.clone(),
                                    key: key.clone(),
                                    expected: *expect,
                                    found,
                                });
                                break;
                            }
                        }
                        if failed.is_none() {
                            failed = t.ops.iter().find_map(|op| match op {
                                Op::Put { lease: Some(l), .. } if !leases.alive(*l) => {
                                    Some(StateError::LeaseExpired(*l))
                                }
                                _ => None,
                            });
                        }
                        if let Some(e) = failed {
                            results.push(Err(e));
                            continue;
                        }
                        for op in &t.ops {
                            let (ns, key) = op.target();
                            let full = full_key(ns, key);
                            let old = current(&kv, &full)?;
                            match op {
                                Op::Put { value, lease, .. } => {
                                    kv.insert(
                                        full.as_str(),
                                        encode(next, *lease, value).as_slice(),
                                    )
                                    .map_err(backend)?;
                                    bindings.push((full, old.and_then(|(_, l)| l), *lease));
                                    events.push((
                                        ns.to_string(),
                                        WatchEvent::Put(Entry {
                                            key: key.to_string(),
                                            value: value.clone(),
                                            rev: next,
                                        }),
                                    ));
                                    changed.push(true);
                                }
                                Op::Delete { .. } => {
                                    if let Some((_, l)) = old {
                                        kv.remove(full.as_str()).map_err(backend)?;
                                        bindings.push((full, l, None));
                                        events.push((
                                            ns.to_string(),
                                            WatchEvent::Delete {
                                                key: key.to_string(),
                                                rev: next,
                                            },
                                        ));
                                    }
                                    changed.push(old.is_some());
                                }
                            }
                        }
                    }
                    Write::DropLease { lease, keys } => {
                        for full in keys {
                            let bound = current(&kv, full)?.is_some_and(|(_, l)| l == Some(*lease));
                            if bound {
                                kv.remove(full.as_str()).map_err(backend)?;
                                let (ns, key) = full.split_once('/').unwrap_or(("", full));
                                events.push((
                                    ns.to_string(),
                                    WatchEvent::Delete {
                                        key: key.to_string(),
                                        rev: next,
                                    },
                                ));
                            }
                            changed.push(bound);
                        }
                    }
                }
                if changed.iter().any(|c| *c) {
                    rev = next;
                }
                results.push(Ok(Outcome { rev, changed }));
            }
            meta.insert(REV, rev).map_err(backend)?;
        }
        tx.commit().map_err(backend)?;
        for (full, left, joined) in bindings {
            if let Some(l) = left.and_then(|l| leases.live.get_mut(&l)) {
                l.keys.remove(&full);
            }
            if let Some(l) = joined.and_then(|l| leases.live.get_mut(&l)) {
                l.keys.insert(full);
            }
        }
        drop(leases);
        self.publish(events);
        Ok(results)
    }

    fn publish(&self, events: Vec<(String, WatchEvent)>) {
        if events.is_empty() {
            return;
        }
        let mut hub = lock(&self.hub);
        for e in events {
            // No receiver is not an error: nobody watches.
            let _ = hub.tx.send(Arc::new(e.clone()));
            hub.history.push_back(e);
            if hub.history.len() > HISTORY {
                if let Some((_, old)) = hub.history.pop_front() {
                    hub.floor = old.rev();
                }
            }
        }
    }

    fn get(&self, ns: &str, key: &str) -> Result<Option<Entry>, StateError> {
        let tx = self.db.begin_read().map_err(backend)?;
        let kv = tx.open_table(KV).map_err(backend)?;
        let full = full_key(ns, key);
        let Some(v) = kv.get(full.as_str()).map_err(backend)? else {
            return Ok(None);
        };
        let (rev, _, value) = decode(&full, v.value())?;
        Ok(Some(Entry {
            key: key.to_string(),
            value,
            rev,
        }))
    }

    fn list(&self, ns: &str) -> Result<(Vec<Entry>, Revision), StateError> {
        let tx = self.db.begin_read().map_err(backend)?;
        let kv = tx.open_table(KV).map_err(backend)?;
        let meta = tx.open_table(META).map_err(backend)?;
        let rev = meta.get(REV).map_err(backend)?.map_or(0, |v| v.value());
        let prefix = format!("{ns}/");
        // '0' is the byte after '/', so this range is exactly the namespace.
        let end = format!("{ns}0");
        let mut out = Vec::new();
        for e in kv.range(prefix.as_str()..end.as_str()).map_err(backend)? {
            let (k, v) = e.map_err(backend)?;
            let (r, _, value) = decode(k.value(), v.value())?;
            out.push(Entry {
                key: k.value()[prefix.len()..].to_string(),
                value,
                rev: r,
            });
        }
        Ok((out, rev))
    }

    /// Ends `lease` now and deletes its keys.
    fn drop_lease(&self, lease: LeaseId) -> Result<(), StateError> {
        let keys = match lock(&self.leases).live.remove(&lease) {
            Some(l) => l.keys.into_iter().collect::<Vec<_>>(),
            None => return Ok(()),
        };
        if keys.is_empty() {
            return Ok(());
        }
        self.write(Write::DropLease { lease, keys }).map(drop)
    }

    /// Ends expired leases until none is left, then stops (a grant starts it again).
    async fn reap(me: Weak<Self>) {
        /// Lets the next grant start a reaper if this one ends any other way (its
        /// runtime shut down).
        struct Stopped(Weak<Core>, bool);
        impl Drop for Stopped {
            fn drop(&mut self) {
                if self.1 {
                    return;
                }
                if let Some(core) = self.0.upgrade() {
                    lock(&core.leases).reaper = false;
                }
            }
        }
        let mut stopped = Stopped(me.clone(), false);
        loop {
            let Some(core) = me.upgrade() else { return };
            let (expired, next) = {
                let mut leases = lock(&core.leases);
                if leases.live.is_empty() {
                    leases.reaper = false;
                    stopped.1 = true;
                    return;
                }
                let now = Instant::now();
                let expired: Vec<LeaseId> = leases
                    .live
                    .iter()
                    .filter(|(_, l)| l.deadline <= now)
                    .map(|(id, _)| *id)
                    .collect();
                let next = leases
                    .live
                    .values()
                    .filter(|l| l.deadline > now)
                    .map(|l| l.deadline - now)
                    .min()
                    .unwrap_or(Duration::ZERO);
                (expired, next)
            };
            for id in expired {
                let c = core.clone();
                let done = tokio::task::spawn_blocking(move || c.drop_lease(id)).await;
                if let Ok(Err(e)) = done {
                    tracing::warn!(lease = %id, error = %e, "deleting an expired lease's keys failed");
                }
            }
            drop(core);
            // Woken often enough that a new shorter lease is not missed by much.
            tokio::time::sleep(next.clamp(Duration::from_millis(10), Duration::from_millis(100)))
                .await;
        }
    }
}

/// Runs `call` on the blocking pool (a write waits for an fsync, which must not stall a
/// runtime worker and every request queued on it).
async fn blocking<T: Send + 'static>(
    core: &Arc<Core>,
    call: impl FnOnce(&Core) -> Result<T, StateError> + Send + 'static,
) -> Result<T, StateError> {
    core.up()?;
    let core = core.clone();
    tokio::task::spawn_blocking(move || call(&core))
        .await
        .map_err(backend)?
}

#[async_trait]
impl StateStore for Arc<Core> {
    async fn get(&self, ns: &str, key: &str) -> Result<Option<Entry>, StateError> {
        check_key(ns, key)?;
        let (ns, key) = (ns.to_string(), key.to_string());
        blocking(self, move |c| c.get(&ns, &key)).await
    }

    async fn delete(&self, ns: &str, key: &str, expect: Expect) -> Result<bool, StateError> {
        let txn = Txn {
            checks: expect_check(ns, key, expect),
            ops: vec![Op::Delete {
                ns: ns.into(),
                key: key.into(),
            }],
        };
        check_txn(&txn)?;
        let out = blocking(self, move |c| c.write(Write::Txn(txn))).await?;
        Ok(out.changed.first().copied().unwrap_or(false))
    }

    async fn txn(&self, txn: Txn) -> Result<Revision, StateError> {
        check_txn(&txn)?;
        let out = blocking(self, move |c| c.write(Write::Txn(txn))).await?;
        Ok(out.rev)
    }

    async fn list(&self, ns: &str) -> Result<(Vec<Entry>, Revision), StateError> {
        check_ns(ns)?;
        let ns = ns.to_string();
        blocking(self, move |c| c.list(&ns)).await
    }

    async fn watch(&self, ns: &str, after: Revision) -> Result<WatchStream, StateError> {
        check_ns(ns)?;
        self.up()?;
        let (backlog, rx) = {
            let hub = lock(&self.hub);
            if after < hub.floor {
                return Err(StateError::Compacted);
            }
            let backlog: Vec<WatchEvent> = hub
                .history
                .iter()
                .filter(|(n, e)| n == ns && e.rev() > after)
                .map(|(_, e)| e.clone())
                .collect();
            // Subscribed under the lock that publishing takes: nothing falls between.
            (backlog, hub.tx.subscribe())
        };
        let ns = ns.to_string();
        let live = futures::stream::unfold(Some(rx), move |rx| {
            let ns = ns.clone();
            async move {
                let mut rx = rx?;
                loop {
                    match rx.recv().await {
                        Ok(e) if e.0 == ns && e.1.rev() > after => {
                            return Some((Ok(e.1.clone()), Some(rx)))
                        }
                        Ok(_) => continue,
                        Err(broadcast::error::RecvError::Lagged(_)) => {
                            return Some((Err(StateError::Compacted), None))
                        }
                        Err(broadcast::error::RecvError::Closed) => return None,
                    }
                }
            }
        });
        Ok(futures::stream::iter(backlog.into_iter().map(Ok))
            .chain(live)
            .boxed())
    }

    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId, StateError> {
        self.up()?;
        if ttl.is_zero() {
            return Err(StateError::Invalid("a lease's TTL must be positive".into()));
        }
        let id = LeaseId(self.next_lease.fetch_add(1, Ordering::Relaxed));
        let start = {
            let mut leases = lock(&self.leases);
            leases.live.insert(
                id,
                Lease {
                    ttl,
                    deadline: Instant::now() + ttl,
                    keys: BTreeSet::new(),
                },
            );
            !std::mem::replace(&mut leases.reaper, true)
        };
        if start {
            tokio::spawn(Core::reap(Arc::downgrade(self)));
        }
        Ok(id)
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<(), StateError> {
        blocking(self, move |c| {
            let mut leases = lock(&c.leases);
            match leases.live.get_mut(&lease) {
                Some(l) if l.deadline > Instant::now() => {
                    l.deadline = Instant::now() + l.ttl;
                    Ok(())
                }
                _ => Err(StateError::LeaseExpired(lease)),
            }
        })
        .await
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StateError> {
        blocking(self, move |c| c.drop_lease(lease)).await
    }
}

/// The embedded store: one redb file. See the module docs for watch and leases.
///
/// Writes are group-committed: concurrent writes queue up while one commit is being made
/// durable, and the next commit takes the whole queue, so N concurrent writers pay for
/// about two fsyncs instead of N. Each call still returns only once its own write is
/// durable. The store's revision and each key's revision are stored, so they survive a
/// reopen.
#[derive(Debug, Clone)]
pub struct RedbStore(Arc<Core>);

impl RedbStore {
    /// Opens or creates the store at `path`.
    pub fn open(path: &Path) -> Result<Self, StateError> {
        let db = redb::Database::create(path).map_err(backend)?;
        Ok(Self(Core::open(db)?))
    }
}

/// An in-memory store with [`RedbStore`]'s semantics (it is the same engine over a
/// memory backend), for tests that need no disk or root.
#[derive(Debug, Clone)]
pub struct MemStore(Arc<Core>);

impl MemStore {
    /// An empty store.
    ///
    /// # Panics
    /// If memory for it cannot be had.
    pub fn new() -> Self {
        let core = redb::Database::builder()
            .create_with_backend(redb::backends::InMemoryBackend::new())
            .map_err(backend)
            .and_then(Core::open);
        match core {
            Ok(core) => Self(core),
            // A fresh database in memory has nothing to fail on but allocation.
            Err(e) => panic!("creating an in-memory store: {e}"),
        }
    }

    /// While `true`, every call fails with [`StateError::Unavailable`] (as a store that
    /// cannot be reached), so callers' retries can be tested. Open watch streams go on.
    pub fn set_unavailable(&self, unavailable: bool) {
        self.0.unavailable.store(unavailable, Ordering::SeqCst);
    }
}

impl Default for MemStore {
    fn default() -> Self {
        Self::new()
    }
}

macro_rules! delegate {
    ($t:ty) => {
        #[async_trait]
        impl StateStore for $t {
            async fn get(&self, ns: &str, key: &str) -> Result<Option<Entry>, StateError> {
                self.0.get(ns, key).await
            }
            async fn put(
                &self,
                ns: &str,
                key: &str,
                value: &[u8],
                expect: Expect,
            ) -> Result<Revision, StateError> {
                StateStore::put(&self.0, ns, key, value, expect).await
            }
            async fn delete(
                &self,
                ns: &str,
                key: &str,
                expect: Expect,
            ) -> Result<bool, StateError> {
                StateStore::delete(&self.0, ns, key, expect).await
            }
            async fn txn(&self, txn: Txn) -> Result<Revision, StateError> {
                self.0.txn(txn).await
            }
            async fn list(&self, ns: &str) -> Result<(Vec<Entry>, Revision), StateError> {
                StateStore::list(&self.0, ns).await
            }
            async fn watch(&self, ns: &str, after: Revision) -> Result<WatchStream, StateError> {
                self.0.watch(ns, after).await
            }
            async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId, StateError> {
                self.0.grant_lease(ttl).await
            }
            async fn keep_alive(&self, lease: LeaseId) -> Result<(), StateError> {
                self.0.keep_alive(lease).await
            }
            async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StateError> {
                self.0.revoke_lease(lease).await
            }
        }
    };
}
delegate!(RedbStore);
delegate!(MemStore);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conformance;

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn mem_store_conforms() {
        conformance::run_all(Arc::new(MemStore::new())).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn redb_store_conforms() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = RedbStore::open(&dir.path().join("state.redb")).expect("open");
        conformance::run_all(Arc::new(store)).await;
    }

    #[tokio::test]
    async fn mem_store_can_be_made_unavailable() {
        let s = MemStore::new();
        s.put("ns", "k", b"1", Expect::Any).await.expect("put");
        s.set_unavailable(true);
        assert!(matches!(
            s.get("ns", "k").await,
            Err(StateError::Unavailable(_))
        ));
        assert!(matches!(
            s.put("ns", "k", b"2", Expect::Any).await,
            Err(StateError::Unavailable(_))
        ));
        assert!(matches!(
            s.watch("ns", 0).await,
            Err(StateError::Unavailable(_))
        ));
        s.set_unavailable(false);
        assert_eq!(s.get("ns", "k").await.expect("get").expect("k").value, b"1");
    }

    /// Opens the store at `path` once the previous handle is really gone: a lease reaper
    /// on another worker may hold the core for the instant of one check after the last
    /// handle dropped, and redb refuses a second open of a file still open.
    async fn reopen(path: &Path) -> RedbStore {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match RedbStore::open(path) {
                Ok(s) => return s,
                Err(e) if Instant::now() < deadline => {
                    tracing::debug!(error = %e, "store still open; retrying");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(e) => panic!("reopen: {e}"),
            }
        }
    }

    /// Revisions, values and key revisions survive a reopen; leased keys do not (their
    /// holder was this process); a watch from before the reopen is told to re-list.
    #[tokio::test(flavor = "multi_thread")]
    async fn redb_revisions_survive_reopen_and_leased_keys_do_not() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.redb");
        let (ra, rb, last) = {
            let s = RedbStore::open(&path).expect("open");
            let ra = s.put("sb", "a", b"1", Expect::Any).await.expect("put");
            let rb = s.put("sb", "b", b"2", Expect::Any).await.expect("put");
            let lease = s.grant_lease(Duration::from_secs(60)).await.expect("grant");
            s.txn(Txn {
                checks: vec![],
                ops: vec![Op::Put {
                    ns: "sb".into(),
                    key: "leased".into(),
                    value: b"x".to_vec(),
                    lease: Some(lease),
                }],
            })
            .await
            .expect("leased put");
            let (_, last) = s.list("sb").await.expect("list");
            (ra, rb, last)
        };
        let s = reopen(&path).await;
        let (list, rev) = s.list("sb").await.expect("list");
        assert_eq!(
            list,
            vec![
                Entry {
                    key: "a".into(),
                    value: b"1".to_vec(),
                    rev: ra
                },
                Entry {
                    key: "b".into(),
                    value: b"2".to_vec(),
                    rev: rb
                },
            ]
        );
        assert!(rev > last, "the leased key's deletion took a revision");
        assert!(matches!(
            s.watch("sb", ra).await,
            Err(StateError::Compacted)
        ));
        let mut w = s.watch("sb", rev).await.expect("watch from the list");
        let r = s.put("sb", "c", b"3", Expect::Rev(0)).await;
        assert!(matches!(r, Err(StateError::Conflict { .. })), "{r:?}");
        let r = s.put("sb", "c", b"3", Expect::Absent).await.expect("put");
        assert!(r > rev);
        assert_eq!(
            conformance::next_event(&mut w).await.expect("event").rev(),
            r
        );
        // The next reopen goes on from there.
        drop(w);
        drop(s);
        let s = reopen(&path).await;
        assert_eq!(s.list("sb").await.expect("list").1, r);
    }

    /// A store written before revisions existed (plain values in table `state`) opens
    /// with its records intact.
    #[tokio::test]
    async fn a_store_from_before_revisions_is_migrated() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.redb");
        {
            let db = redb::Database::create(&path).expect("create");
            let tx = db.begin_write().expect("tx");
            {
                let mut t = tx.open_table(LEGACY).expect("table");
                t.insert("sandboxes/a", &b"{}"[..]).expect("insert");
                t.insert("tombstones/b", &b"[]"[..]).expect("insert");
            }
            tx.commit().expect("commit");
        }
        let s = RedbStore::open(&path).expect("open");
        let (list, rev) = s.list("sandboxes").await.expect("list");
        assert_eq!(list.len(), 1);
        assert_eq!(
            (list[0].key.as_str(), list[0].value.as_slice()),
            ("a", &b"{}"[..])
        );
        assert_eq!(list[0].rev, rev);
        assert_eq!(s.list("tombstones").await.expect("list").0.len(), 1);
        drop(s);
        // Migrated once: a reopen changes nothing.
        let s = reopen(&path).await;
        assert_eq!(s.list("sandboxes").await.expect("list").1, rev);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_writers_are_all_durable_in_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.redb");
        {
            let s = Arc::new(RedbStore::open(&path).expect("open"));
            let tasks: Vec<_> = (0..16)
                .map(|t| {
                    let s = s.clone();
                    tokio::spawn(async move {
                        for i in 0..50 {
                            let key = format!("{t}-{i}");
                            s.put("sb", &key, key.as_bytes(), Expect::Any)
                                .await
                                .expect("put");
                            // Each writer's own order holds: a put then its delete.
                            if i % 2 == 0 {
                                s.delete("sb", &key, Expect::Any).await.expect("delete");
                            }
                        }
                    })
                })
                .collect();
            for t in tasks {
                t.await.expect("join");
            }
        }
        let s = reopen(&path).await;
        let (list, rev) = s.list("sb").await.expect("list");
        assert_eq!(rev, 16 * 75, "one revision per write");
        assert_eq!(list.len(), 16 * 25);
        assert!(list.iter().all(|e| e.key.as_bytes() == e.value.as_slice()));
        assert!(list.iter().all(|e| e
            .key
            .rsplit('-')
            .next()
            .and_then(|i| i.parse::<u32>().ok())
            .is_some_and(|i| i % 2 == 1)));
    }
}

//! [`FaultyStore`]: another store behind a wrapper that counts the calls made through it
//! and fails them on request (a transaction applied but answered `unavailable`, lists
//! that fail, watches that break), for tests of what callers do when the store fails and
//! for benchmarks that count store round trips.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;

use crate::{Entry, Expect, LeaseId, Op, Revision, StateError, StateStore, Txn, WatchStream};

/// The calls made through one or more [`FaultyStore`]s.
#[derive(Debug, Default)]
pub struct StoreCalls {
    /// `get`, `list`, and transactions of checks alone: each a round trip, no commit.
    pub reads: AtomicU64,
    /// `put`, `delete` and transactions that change something: each one commit.
    pub writes: AtomicU64,
    /// `list` calls (also counted as reads).
    pub lists: AtomicU64,
}

impl StoreCalls {
    /// (reads, writes) so far.
    pub fn now(&self) -> (u64, u64) {
        (
            self.reads.load(Ordering::Relaxed),
            self.writes.load(Ordering::Relaxed),
        )
    }
}

/// A store that passes every call to another, counting it, unless told to fail it.
#[derive(Debug)]
pub struct FaultyStore {
    inner: Arc<dyn StateStore>,
    calls: Arc<StoreCalls>,
    /// The next this many transactions (and puts and deletes) are applied, then answered
    /// [`StateError::Unavailable`]: an etcd that lost quorum with the proposal in flight
    /// and committed it when quorum came back.
    pub lose_answers: AtomicUsize,
    /// The next this many lists fail as unavailable.
    pub fail_lists: AtomicUsize,
    /// While set, opening a watch fails as unavailable.
    pub fail_watches: AtomicBool,
    /// Bumped by [`FaultyStore::break_watches`]: open watches end.
    breaker: tokio::sync::watch::Sender<u64>,
}

impl FaultyStore {
    /// Wraps `inner`, with a count of its own.
    pub fn new(inner: Arc<dyn StateStore>) -> Self {
        Self::counting_into(inner, Arc::default())
    }

    /// Wraps `inner`, adding its calls to `calls` (shared by several wrappers).
    pub fn counting_into(inner: Arc<dyn StateStore>, calls: Arc<StoreCalls>) -> Self {
        Self {
            inner,
            calls,
            lose_answers: AtomicUsize::new(0),
            fail_lists: AtomicUsize::new(0),
            fail_watches: AtomicBool::new(false),
            breaker: tokio::sync::watch::channel(0).0,
        }
    }

    /// The wrapped store (calls to it are neither counted nor failed).
    pub fn inner(&self) -> Arc<dyn StateStore> {
        self.inner.clone()
    }

    /// The calls counted so far.
    pub fn calls(&self) -> &StoreCalls {
        &self.calls
    }

    /// Ends every open watch with [`StateError::Compacted`] (as etcd does when the
    /// history a watch needs is gone).
    pub fn break_watches(&self) {
        self.breaker.send_modify(|g| *g += 1);
    }

    fn count(&self, counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Takes one from `budget` if it is not zero.
    fn take(budget: &AtomicUsize) -> bool {
        budget
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }

    fn answer<T>(&self, applied: Result<T, StateError>) -> Result<T, StateError> {
        let applied = applied?;
        if Self::take(&self.lose_answers) {
            return Err(StateError::Unavailable("the answer was lost".into()));
        }
        Ok(applied)
    }
}

#[async_trait]
impl StateStore for FaultyStore {
    async fn get(&self, ns: &str, key: &str) -> Result<Option<Entry>, StateError> {
        self.count(&self.calls.reads);
        self.inner.get(ns, key).await
    }

    async fn put(
        &self,
        ns: &str,
        key: &str,
        value: &[u8],
        expect: Expect,
    ) -> Result<Revision, StateError> {
        self.count(&self.calls.writes);
        self.answer(self.inner.put(ns, key, value, expect).await)
    }

    async fn delete(&self, ns: &str, key: &str, expect: Expect) -> Result<bool, StateError> {
        self.count(&self.calls.writes);
        self.answer(self.inner.delete(ns, key, expect).await)
    }

    async fn txn(&self, txn: Txn) -> Result<Revision, StateError> {
        // A transaction of checks alone writes nothing (etcd serves it as a read).
        let writes = txn
            .ops
            .iter()
            .any(|o| matches!(o, Op::Put { .. } | Op::Delete { .. }));
        self.count(match writes {
            true => &self.calls.writes,
            false => &self.calls.reads,
        });
        self.answer(self.inner.txn(txn).await)
    }

    async fn list(&self, ns: &str) -> Result<(Vec<Entry>, Revision), StateError> {
        self.count(&self.calls.reads);
        self.count(&self.calls.lists);
        if Self::take(&self.fail_lists) {
            return Err(StateError::Unavailable("told to fail".into()));
        }
        self.inner.list(ns).await
    }

    async fn watch(&self, ns: &str, after: Revision) -> Result<WatchStream, StateError> {
        if self.fail_watches.load(Ordering::SeqCst) {
            return Err(StateError::Unavailable("told to fail".into()));
        }
        let mut broken = self.breaker.subscribe();
        broken.borrow_and_update();
        let inner = self.inner.watch(ns, after).await?;
        let broken = async move {
            let _ = broken.changed().await;
        };
        Ok(inner
            .take_until(broken)
            .chain(futures::stream::once(async { Err(StateError::Compacted) }))
            .boxed())
    }

    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId, StateError> {
        self.inner.grant_lease(ttl).await
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<(), StateError> {
        self.inner.keep_alive(lease).await
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StateError> {
        self.inner.revoke_lease(lease).await
    }
}

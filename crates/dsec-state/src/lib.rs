//! Control-plane state: the [`StateStore`] trait and its three implementations.
//!
//! A store holds opaque byte values under `(namespace, key)`. Every change gets a
//! store-wide [`Revision`] (strictly increasing; etcd's `mod_revision`), and each entry
//! carries the revision of its last change, so callers can compare-and-swap
//! ([`Expect`]), apply several changes atomically ([`Txn`]), follow a namespace from a
//! revision on ([`StateStore::watch`]) and tie keys to the liveness of their writer
//! (leases). Writes are durable before they return.
//!
//! - [`RedbStore`]: one redb file, the single-node default.
//! - [`MemStore`]: the same engine over memory, for tests of the control plane (and a way
//!   to make it fail, to test retries).
//! - [`EtcdStore`]: etcd v3, for a cluster of stateless API servers.
//! - [`FaultyStore`]: any of them behind a wrapper that counts calls and fails them on
//!   request, for tests and benchmarks.
//!
//! All three pass one conformance suite (`conformance`, under `cfg(test)` or the
//! `conformance` feature).

use std::fmt::Debug;
use std::time::Duration;

use async_trait::async_trait;
use futures::stream::BoxStream;

#[cfg(any(test, feature = "conformance"))]
#[doc(hidden)]
pub mod conformance;
mod etcd;
mod faulty;
mod local;

pub use etcd::{EtcdConfig, EtcdStore};
pub use faulty::{FaultyStore, StoreCalls};
pub use local::{MemStore, RedbStore};

/// A store-wide revision: every change of the store gets the next one (etcd's
/// `mod_revision`). `0` is "before any change".
pub type Revision = u64;

/// The largest value a store accepts, and the most a request's values may add up to.
/// etcd refuses requests over 1.5 MiB by default; 1 MiB leaves room for keys and framing.
pub const MAX_VALUE_BYTES: usize = 1 << 20;
/// The longest key or namespace.
pub const MAX_KEY_BYTES: usize = 1024;
/// The most checks, and the most operations, one [`Txn`] may hold (etcd's default
/// `--max-txn-ops`).
pub const MAX_TXN_OPS: usize = 128;

/// A lease: keys written with it are deleted when it is revoked or expires.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(pub i64);

impl std::fmt::Display for LeaseId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:x}", self.0)
    }
}

/// A stored value with the revision of its last change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The key, without its namespace.
    pub key: String,
    /// The value.
    pub value: Vec<u8>,
    /// The revision that last changed this key.
    pub rev: Revision,
}

/// What a write expects of a key's current state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// Anything: an unconditional write.
    Any,
    /// The key does not exist.
    Absent,
    /// The key exists and was last changed at this revision.
    Rev(Revision),
}

/// One change in a [`Txn`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Sets a value; with a lease, the key goes when the lease does (a put without one
    /// detaches the key from any earlier lease).
    Put {
        /// Namespace.
        ns: String,
        /// Key.
        key: String,
        /// Value.
        value: Vec<u8>,
        /// The lease the key is bound to.
        lease: Option<LeaseId>,
    },
    /// Deletes a key; nothing happens if it is absent.
    Delete {
        /// Namespace.
        ns: String,
        /// Key.
        key: String,
    },
}

impl Op {
    /// The namespace and key this operation changes.
    pub fn target(&self) -> (&str, &str) {
        match self {
            Op::Put { ns, key, .. } | Op::Delete { ns, key } => (ns, key),
        }
    }
}

/// An atomic multi-key change: if every check holds, every op is applied at one new
/// revision; otherwise nothing is written and the call fails with
/// [`StateError::Conflict`]. A key may be changed by at most one op.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Txn {
    /// `(namespace, key, expectation)` that must all hold.
    pub checks: Vec<(String, String, Expect)>,
    /// The changes, applied in order.
    pub ops: Vec<Op>,
}

/// A change seen by a watch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WatchEvent {
    /// A key was set; `rev` of the entry is the revision of this change.
    Put(Entry),
    /// A key was deleted at `rev`.
    Delete {
        /// The key, without its namespace.
        key: String,
        /// The revision of the deletion.
        rev: Revision,
    },
}

impl WatchEvent {
    /// The revision of this change.
    pub fn rev(&self) -> Revision {
        match self {
            WatchEvent::Put(e) => e.rev,
            WatchEvent::Delete { rev, .. } => *rev,
        }
    }
}

/// The stream [`StateStore::watch`] returns.
pub type WatchStream = BoxStream<'static, Result<WatchEvent, StateError>>;

/// A state store operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    /// An [`Expect`] did not hold: nothing was written. `found` is the key's revision
    /// when the check failed (`None`: absent), where the store could tell cheaply.
    #[error("conflict on {ns}/{key}: expected {expected:?}, found {found:?}")]
    Conflict {
        /// Namespace of the failed check.
        ns: String,
        /// Key of the failed check.
        key: String,
        /// What the check expected.
        expected: Expect,
        /// The key's revision (`None`: absent), if known.
        found: Option<Revision>,
    },
    /// A watch asked for changes the store no longer keeps (or fell too far behind):
    /// list again and watch from the list's revision.
    #[error("the store's history before the asked revision is gone (compacted)")]
    Compacted,
    /// The lease expired or was revoked (or never existed).
    #[error("lease {0} expired or is unknown")]
    LeaseExpired(LeaseId),
    /// The store cannot be reached now; retrying may succeed. A write that failed so
    /// may or may not have been applied.
    #[error("state store unavailable: {0}")]
    Unavailable(String),
    /// The request is malformed (empty key, '/' in a namespace, value too large, ...).
    #[error("invalid state store request: {0}")]
    Invalid(String),
    /// Stored data could not be decoded.
    #[error("state store data is corrupt: {0}")]
    Corrupt(String),
    /// The backend failed; the message says how.
    #[error("state store: {0}")]
    Backend(String),
}

pub(crate) fn backend<E: std::fmt::Display>(e: E) -> StateError {
    StateError::Backend(e.to_string())
}

/// Durable, revisioned key-value state shared by control-plane replicas.
#[async_trait]
pub trait StateStore: Send + Sync + Debug + 'static {
    /// Reads a key.
    async fn get(&self, ns: &str, key: &str) -> Result<Option<Entry>, StateError>;

    /// Writes a key if `expect` holds (else [`StateError::Conflict`]); returns the
    /// revision of the write.
    async fn put(
        &self,
        ns: &str,
        key: &str,
        value: &[u8],
        expect: Expect,
    ) -> Result<Revision, StateError> {
        self.txn(Txn {
            checks: expect_check(ns, key, expect),
            ops: vec![Op::Put {
                ns: ns.into(),
                key: key.into(),
                value: value.to_vec(),
                lease: None,
            }],
        })
        .await
    }

    /// Deletes a key if `expect` holds (else [`StateError::Conflict`]); `false` if the
    /// key was absent.
    async fn delete(&self, ns: &str, key: &str, expect: Expect) -> Result<bool, StateError>;

    /// Applies `txn` atomically (see [`Txn`]); returns the store's revision after it
    /// (unchanged if the ops changed nothing, e.g. deleted absent keys).
    async fn txn(&self, txn: Txn) -> Result<Revision, StateError>;

    /// Every entry of a namespace, ordered by key, as of one revision, which is returned:
    /// a [`StateStore::watch`] from it misses nothing and repeats nothing.
    async fn list(&self, ns: &str) -> Result<(Vec<Entry>, Revision), StateError>;

    /// Every change of `ns` with a revision above `after`, in revision order, then live
    /// changes as they happen. [`StateError::Compacted`] (at once or in the stream) if
    /// some of that history is gone: list again. The stream ends after an error.
    async fn watch(&self, ns: &str, after: Revision) -> Result<WatchStream, StateError>;

    /// Grants a lease that expires `ttl` after the last keep-alive (etcd rounds up to
    /// whole seconds).
    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId, StateError>;

    /// Restarts a lease's TTL; [`StateError::LeaseExpired`] if it is gone.
    async fn keep_alive(&self, lease: LeaseId) -> Result<(), StateError>;

    /// Ends a lease and deletes its keys; ending an unknown lease is not an error.
    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StateError>;
}

/// The check a single-key write with `expect` makes.
pub(crate) fn expect_check(ns: &str, key: &str, expect: Expect) -> Vec<(String, String, Expect)> {
    match expect {
        Expect::Any => Vec::new(),
        e => vec![(ns.into(), key.into(), e)],
    }
}

/// Refuses a namespace that is empty, holds '/' or is too long.
pub(crate) fn check_ns(ns: &str) -> Result<(), StateError> {
    if ns.is_empty() {
        return Err(StateError::Invalid("empty namespace".into()));
    }
    if ns.contains('/') {
        return Err(StateError::Invalid(format!("namespace {ns:?} holds '/'")));
    }
    if ns.len() > MAX_KEY_BYTES {
        return Err(StateError::Invalid(format!(
            "namespace longer than {MAX_KEY_BYTES} bytes"
        )));
    }
    Ok(())
}

/// Refuses an empty or too long key, or a bad namespace.
pub(crate) fn check_key(ns: &str, key: &str) -> Result<(), StateError> {
    check_ns(ns)?;
    if key.is_empty() {
        return Err(StateError::Invalid(format!("empty key in {ns}")));
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(StateError::Invalid(format!(
            "key in {ns} longer than {MAX_KEY_BYTES} bytes"
        )));
    }
    Ok(())
}

/// Refuses a malformed transaction: bad keys, too many checks or ops, a key changed
/// twice, values over [`MAX_VALUE_BYTES`] in all.
pub(crate) fn check_txn(txn: &Txn) -> Result<(), StateError> {
    if txn.checks.len() > MAX_TXN_OPS || txn.ops.len() > MAX_TXN_OPS {
        return Err(StateError::Invalid(format!(
            "a transaction holds at most {MAX_TXN_OPS} checks and {MAX_TXN_OPS} operations"
        )));
    }
    for (ns, key, _) in &txn.checks {
        check_key(ns, key)?;
    }
    let mut seen = std::collections::HashSet::new();
    let mut bytes = 0usize;
    for op in &txn.ops {
        let (ns, key) = op.target();
        check_key(ns, key)?;
        if !seen.insert((ns, key)) {
            return Err(StateError::Invalid(format!(
                "{ns}/{key} is changed twice in one transaction"
            )));
        }
        if let Op::Put { value, .. } = op {
            bytes = bytes.saturating_add(value.len());
        }
    }
    if bytes > MAX_VALUE_BYTES {
        return Err(StateError::Invalid(format!(
            "values of {bytes} bytes: the limit is {MAX_VALUE_BYTES} bytes per request"
        )));
    }
    Ok(())
}

/// How an [`Expect`] compares with a key's current revision (`None`: absent).
pub(crate) fn holds(expect: Expect, found: Option<Revision>) -> bool {
    match expect {
        Expect::Any => true,
        Expect::Absent => found.is_none(),
        Expect::Rev(r) => found == Some(r),
    }
}

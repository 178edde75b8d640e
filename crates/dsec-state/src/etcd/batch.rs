//! Group commit for [`EtcdStore`]: transactions that arrive while [`MAX_IN_FLIGHT`]
//! others are on their way to etcd wait, and go together as one etcd transaction when
//! one of those returns.
//!
//! Alone, a transaction goes at once. Under load (a trainer's burst of creates), N
//! transactions cost one round trip, one HTTP/2 request, one raft entry and one watch
//! response instead of N: each create stays one logical write, but etcd and the API
//! server do a fraction of the work. A batch holds only transactions on disjoint keys
//! (in arrival order: the first that overlaps ends the batch), none that puts with a
//! lease (etcd answers a lost lease for the whole request), and stays within etcd's
//! per-request limits. When a batch's checks fail, its members whose own checks held are
//! sent again alone, so each transaction keeps its own all-or-nothing outcome. One that
//! waited longer than the request timeout is answered `Unavailable` unsent.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::{EtcdStore, Sent};
use crate::{holds, Op, Revision, StateError, Txn, MAX_TXN_OPS, MAX_VALUE_BYTES};

/// Batches (or lone transactions) on their way to etcd at once, per store.
pub(super) const MAX_IN_FLIGHT: usize = 4;

/// What a transaction's caller gets: the revision and, per op, whether it changed a key.
pub(super) type Outcome = Result<(Revision, Vec<bool>), StateError>;

/// A transaction waiting for a batch.
struct Pending {
    txn: Txn,
    reply: oneshot::Sender<Outcome>,
    /// When it was submitted.
    since: Instant,
}

#[derive(Default)]
struct Queue {
    waiting: VecDeque<Pending>,
    in_flight: usize,
}

/// The queue of one store (shared by its clones).
#[derive(Default)]
pub(super) struct Batcher {
    queue: Mutex<Queue>,
    /// etcd transactions sent (a batch counts once).
    sent: AtomicU64,
    /// Transactions submitted.
    submitted: AtomicU64,
}

/// When a submitted transaction goes.
enum Turn {
    /// At once, by its caller.
    Now(Txn),
    /// In a batch: its answer comes here.
    Later(oneshot::Receiver<Outcome>),
}

/// Holds one of the [`MAX_IN_FLIGHT`] places; giving it back starts what waits.
struct Slot {
    batcher: Arc<Batcher>,
    store: EtcdStore,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.batcher.lock().in_flight -= 1;
        self.batcher.start_waiting(&self.store);
    }
}

/// Whether `txn` may share an etcd request with others.
fn batchable(txn: &Txn) -> bool {
    !txn.ops
        .iter()
        .any(|op| matches!(op, Op::Put { lease: Some(_), .. }))
}

/// The keys `txn` checks or changes.
fn keys(txn: &Txn) -> impl Iterator<Item = (&str, &str)> {
    txn.checks
        .iter()
        .map(|(ns, key, _)| (ns.as_str(), key.as_str()))
        .chain(txn.ops.iter().map(Op::target))
}

fn value_bytes(txn: &Txn) -> usize {
    txn.ops
        .iter()
        .map(|op| match op {
            Op::Put { value, .. } => value.len(),
            Op::Delete { .. } => 0,
        })
        .sum()
}

/// Takes the longest prefix of `waiting` that can go as one etcd transaction: disjoint
/// keys, at most [`MAX_TXN_OPS`] checks and ops, at most [`MAX_VALUE_BYTES`] of values.
fn take_batch(waiting: &mut VecDeque<Pending>) -> Vec<Pending> {
    let n = {
        // Borrowed from the queue: no key is copied while its lock is held.
        let mut keys_taken: HashSet<(&str, &str)> = HashSet::new();
        let (mut checks, mut ops, mut bytes) = (0usize, 0usize, 0usize);
        let mut n = 0;
        for p in waiting.iter() {
            let t = &p.txn;
            let fits = checks + t.checks.len() <= MAX_TXN_OPS
                && ops + t.ops.len() <= MAX_TXN_OPS
                && bytes + value_bytes(t) <= MAX_VALUE_BYTES;
            let disjoint = keys(t).all(|k| !keys_taken.contains(&k));
            if n > 0 && !(fits && disjoint && batchable(t)) {
                break;
            }
            keys_taken.extend(keys(t));
            checks += t.checks.len();
            ops += t.ops.len();
            bytes += value_bytes(t);
            n += 1;
            if !batchable(t) {
                break;
            }
        }
        n
    };
    waiting.drain(..n).collect()
}

/// Answers the transactions that waited longer than a request may take (etcd is
/// slow or gone): they were not sent, so nothing of them was applied.
fn expire(waiting: &mut VecDeque<Pending>, timeout: Duration) {
    while let Some(p) = waiting.front() {
        if p.since.elapsed() < timeout {
            return;
        }
        if let Some(p) = waiting.pop_front() {
            let _ = p.reply.send(Err(StateError::Unavailable(format!(
                "etcd took no transaction for {timeout:?}; this one was not sent"
            ))));
        }
    }
}

/// One transaction holding the checks and ops of `members`, in order.
fn merge(members: &[Pending]) -> Txn {
    let mut txn = Txn::default();
    for p in members {
        txn.checks.extend(p.txn.checks.iter().cloned());
        txn.ops.extend(p.txn.ops.iter().cloned());
    }
    txn
}

impl Batcher {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// etcd transactions sent and transactions submitted, since the store was made.
    pub(super) fn counts(&self) -> (u64, u64) {
        (
            self.sent.load(Ordering::Relaxed),
            self.submitted.load(Ordering::Relaxed),
        )
    }

    /// Runs `txn` (already checked) on `store`: at once when a place is free and nothing
    /// waits, else in the next batch.
    pub(super) async fn submit(self: &Arc<Self>, store: &EtcdStore, txn: Txn) -> Outcome {
        self.submitted.fetch_add(1, Ordering::Relaxed);
        let waiting = {
            let mut q = self.lock();
            if q.in_flight < MAX_IN_FLIGHT && q.waiting.is_empty() {
                q.in_flight += 1;
                Turn::Now(txn)
            } else {
                let (reply, rx) = oneshot::channel();
                q.waiting.push_back(Pending {
                    txn,
                    reply,
                    since: Instant::now(),
                });
                Turn::Later(rx)
            }
        };
        match waiting {
            Turn::Now(txn) => {
                let _slot = Slot {
                    batcher: self.clone(),
                    store: store.clone(),
                };
                self.alone(store, &txn).await
            }
            Turn::Later(rx) => rx.await.unwrap_or_else(|_| {
                Err(StateError::Unavailable(
                    "the batch this transaction waited for was dropped".into(),
                ))
            }),
        }
    }

    /// Starts batches of waiting transactions while places are free.
    fn start_waiting(self: &Arc<Self>, store: &EtcdStore) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            // The runtime is going away: the waiting callers see their batch dropped.
            return;
        };
        loop {
            let batch = {
                let mut q = self.lock();
                expire(&mut q.waiting, store.timeout);
                if q.in_flight >= MAX_IN_FLIGHT || q.waiting.is_empty() {
                    return;
                }
                q.in_flight += 1;
                take_batch(&mut q.waiting)
            };
            let slot = Slot {
                batcher: self.clone(),
                store: store.clone(),
            };
            rt.spawn(async move {
                let slot = slot;
                slot.batcher.run(&slot.store, batch).await;
            });
        }
    }

    /// Sends `txn` as an etcd transaction of its own.
    async fn alone(&self, store: &EtcdStore, txn: &Txn) -> Outcome {
        self.sent.fetch_add(1, Ordering::Relaxed);
        store.send_txn(txn).await.and_then(|s| s.into_outcome(txn))
    }

    /// Sends `batch` as one transaction and answers each member.
    async fn run(&self, store: &EtcdStore, batch: Vec<Pending>) {
        if let [_] = batch.as_slice() {
            let Some(p) = batch.into_iter().next() else {
                return;
            };
            let _ = p.reply.send(self.alone(store, &p.txn).await);
            return;
        }
        let merged = merge(&batch);
        self.sent.fetch_add(1, Ordering::Relaxed);
        match store.send_txn(&merged).await {
            Ok(Sent::Applied { rev, changed }) => {
                let mut changed = changed.into_iter();
                for p in batch {
                    let mine: Vec<bool> = changed.by_ref().take(p.txn.ops.len()).collect();
                    let _ = p.reply.send(Ok((rev, mine)));
                }
            }
            Ok(Sent::Refused { found }) => {
                // Some member's checks failed: it gets its conflict; the others go again
                // alone (their keys may have changed since, which they then see).
                let mut found = found.into_iter();
                let mut again = Vec::new();
                for p in batch {
                    let mine: Vec<Option<Revision>> =
                        found.by_ref().take(p.txn.checks.len()).collect();
                    let held = p
                        .txn
                        .checks
                        .iter()
                        .zip(&mine)
                        .all(|((_, _, e), f)| holds(*e, *f));
                    if held {
                        again.push(p);
                    } else {
                        let out = Sent::Refused { found: mine }.into_outcome(&p.txn);
                        let _ = p.reply.send(out);
                    }
                }
                let alone = again.into_iter().map(|p| async move {
                    let _ = p.reply.send(self.alone(store, &p.txn).await);
                });
                futures::future::join_all(alone).await;
            }
            Err(e) => {
                for p in batch {
                    let _ = p.reply.send(Err(e.clone()));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Expect, LeaseId};

    fn put(key: &str, bytes: usize) -> Txn {
        Txn {
            checks: vec![("r".into(), key.into(), Expect::Absent)],
            ops: vec![Op::Put {
                ns: "r".into(),
                key: key.into(),
                value: vec![0; bytes],
                lease: None,
            }],
        }
    }

    fn queue(txns: Vec<Txn>) -> VecDeque<Pending> {
        txns.into_iter()
            .map(|txn| Pending {
                txn,
                reply: oneshot::channel().0,
                since: Instant::now(),
            })
            .collect()
    }

    fn names(b: &[Pending]) -> Vec<String> {
        b.iter()
            .map(|p| p.txn.ops[0].target().1.to_string())
            .collect()
    }

    #[test]
    fn a_batch_takes_disjoint_transactions_in_order_and_stops_at_the_first_overlap() {
        let mut q = queue(vec![put("a", 1), put("b", 1), put("a", 1), put("c", 1)]);
        assert_eq!(names(&take_batch(&mut q)), ["a", "b"]);
        assert_eq!(names(&take_batch(&mut q)), ["a", "c"]);
        assert!(q.is_empty());
    }

    #[test]
    fn a_batch_stays_within_etcds_request_limits() {
        let mut q = queue((0..200).map(|i| put(&format!("k{i}"), 10)).collect());
        assert_eq!(take_batch(&mut q).len(), MAX_TXN_OPS);
        let mut q = queue(
            (0..4)
                .map(|i| put(&format!("k{i}"), MAX_VALUE_BYTES / 3))
                .collect(),
        );
        assert_eq!(take_batch(&mut q).len(), 3);
        // One transaction over no limit but its own goes alone.
        let mut q = queue(vec![put("big", MAX_VALUE_BYTES), put("small", 1)]);
        assert_eq!(names(&take_batch(&mut q)), ["big"]);
    }

    #[test]
    fn transactions_that_waited_past_the_timeout_are_answered_unsent() {
        let (reply, mut rx) = oneshot::channel();
        let mut q = VecDeque::from([Pending {
            txn: put("old", 1),
            reply,
            since: Instant::now() - Duration::from_secs(6),
        }]);
        q.extend(queue(vec![put("new", 1)]));
        expire(&mut q, Duration::from_secs(5));
        assert_eq!(names(&take_batch(&mut q)), ["new"]);
        assert!(matches!(rx.try_recv(), Ok(Err(StateError::Unavailable(_)))));
    }

    #[test]
    fn a_put_with_a_lease_goes_alone() {
        let mut leased = put("n", 1);
        if let Op::Put { lease, .. } = &mut leased.ops[0] {
            *lease = Some(LeaseId(7));
        }
        let mut q = queue(vec![put("a", 1), leased.clone(), put("b", 1)]);
        assert_eq!(names(&take_batch(&mut q)), ["a"]);
        assert_eq!(names(&take_batch(&mut q)), ["n"]);
        assert_eq!(names(&take_batch(&mut q)), ["b"]);
    }

    #[test]
    fn a_merged_transaction_keeps_each_members_checks_and_ops_in_order() {
        let q = queue(vec![put("a", 1), put("b", 2)]);
        let b: Vec<Pending> = q.into_iter().collect();
        let m = merge(&b);
        assert_eq!(m.checks.len(), 2);
        assert_eq!(
            m.ops.iter().map(|o| o.target().1).collect::<Vec<_>>(),
            ["a", "b"]
        );
        assert!(crate::check_txn(&m).is_ok());
    }
}

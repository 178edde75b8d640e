//! The conformance suite every [`StateStore`] passes: [`run_all`] against a fresh
//! store. Each check uses its own namespaces. Failures panic (these are tests).

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;

use crate::{
    Entry, Expect, LeaseId, Op, Revision, StateError, StateStore, Txn, WatchEvent, WatchStream,
    MAX_VALUE_BYTES,
};

/// Runs every check against `store`, which must be empty.
pub async fn run_all(store: Arc<dyn StateStore>) {
    let s = store.as_ref();
    crud_and_revisions(s).await;
    namespaces_are_separate(s).await;
    compare_and_swap(s).await;
    transactions_are_all_or_nothing(s).await;
    invalid_requests_are_refused(s).await;
    list_is_a_snapshot_to_watch_from(s).await;
    watch_replays_then_follows(s).await;
    leases_revoke_and_keep_alive(s).await;
    a_lease_expires_without_keep_alive(s).await;
    concurrent_compare_and_swap_loses_no_update(store).await;
}

/// Polls `check` until it holds or `within` passes.
pub async fn wait_until<F, Fut>(within: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = Instant::now() + within;
    while !check().await {
        assert!(Instant::now() < end, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The next event of `w`, failing after 10 s.
pub async fn next_event(w: &mut WatchStream) -> Result<WatchEvent, StateError> {
    tokio::time::timeout(Duration::from_secs(10), w.next())
        .await
        .expect("a watch event within 10 s")
        .expect("the watch stream goes on")
}

fn put_op(ns: &str, key: &str, value: &[u8], lease: Option<LeaseId>) -> Op {
    Op::Put {
        ns: ns.into(),
        key: key.into(),
        value: value.to_vec(),
        lease,
    }
}

async fn crud_and_revisions(s: &dyn StateStore) {
    let ns = "crud";
    assert_eq!(s.get(ns, "a").await.expect("get"), None);
    let r1 = s.put(ns, "a", b"1", Expect::Any).await.expect("put");
    assert!(r1 > 0);
    let e = s.get(ns, "a").await.expect("get").expect("present");
    assert_eq!(
        e,
        Entry {
            key: "a".into(),
            value: b"1".to_vec(),
            rev: r1
        }
    );
    let r2 = s.put(ns, "a", b"2", Expect::Any).await.expect("put");
    assert!(r2 > r1, "revisions strictly increase");
    let r3 = s
        .put(ns, "b/with/slashes", b"", Expect::Any)
        .await
        .expect("put");
    assert!(r3 > r2);
    let (list, rev) = s.list(ns).await.expect("list");
    assert_eq!(rev, r3);
    let keys: Vec<(&str, &[u8], Revision)> = list
        .iter()
        .map(|e| (e.key.as_str(), e.value.as_slice(), e.rev))
        .collect();
    assert_eq!(
        keys,
        vec![("a", &b"2"[..], r2), ("b/with/slashes", &b""[..], r3)]
    );
    assert!(s.delete(ns, "a", Expect::Any).await.expect("delete"));
    assert!(!s.delete(ns, "a", Expect::Any).await.expect("delete absent"));
    assert_eq!(s.get(ns, "a").await.expect("get"), None);
    let (list, rev) = s.list(ns).await.expect("list");
    assert_eq!(list.len(), 1);
    assert!(rev > r3, "a delete takes a revision");
    // A value of exactly the limit is accepted.
    let big = vec![7u8; MAX_VALUE_BYTES];
    s.put(ns, "big", &big, Expect::Any)
        .await
        .expect("1 MiB value");
    let got = s.get(ns, "big").await.expect("get").expect("present");
    assert_eq!(got.value.len(), MAX_VALUE_BYTES);
}

async fn namespaces_are_separate(s: &dyn StateStore) {
    s.put("sep", "k", b"1", Expect::Any).await.expect("put");
    s.put("sep0", "k", b"2", Expect::Any).await.expect("put");
    s.put("se", "p", b"3", Expect::Any).await.expect("put");
    s.put("sepx", "k", b"4", Expect::Any).await.expect("put");
    let (list, _) = s.list("sep").await.expect("list");
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].value, b"1");
    assert_eq!(s.list("empty-ns").await.expect("list").0, vec![]);
}

async fn compare_and_swap(s: &dyn StateStore) {
    let ns = "cas";
    let r1 = s.put(ns, "k", b"1", Expect::Absent).await.expect("create");
    match s.put(ns, "k", b"x", Expect::Absent).await {
        Err(StateError::Conflict {
            ns: n, key, found, ..
        }) => {
            assert_eq!((n.as_str(), key.as_str()), (ns, "k"));
            assert!(found.is_none() || found == Some(r1), "found {found:?}");
        }
        other => panic!("create over an existing key: {other:?}"),
    }
    assert!(matches!(
        s.put(ns, "k", b"x", Expect::Rev(r1 + 1000)).await,
        Err(StateError::Conflict { .. })
    ));
    assert!(matches!(
        s.put(ns, "missing", b"x", Expect::Rev(r1)).await,
        Err(StateError::Conflict { .. })
    ));
    assert_eq!(s.get(ns, "missing").await.expect("get"), None);
    assert_eq!(s.get(ns, "k").await.expect("get").expect("k").value, b"1");
    let r2 = s.put(ns, "k", b"2", Expect::Rev(r1)).await.expect("swap");
    assert!(r2 > r1);
    assert!(matches!(
        s.delete(ns, "k", Expect::Rev(r1)).await,
        Err(StateError::Conflict { .. })
    ));
    assert!(matches!(
        s.delete(ns, "k", Expect::Absent).await,
        Err(StateError::Conflict { .. })
    ));
    assert!(s.delete(ns, "k", Expect::Rev(r2)).await.expect("delete"));
    assert!(!s
        .delete(ns, "k", Expect::Absent)
        .await
        .expect("delete of an absent key expected absent"));
}

async fn transactions_are_all_or_nothing(s: &dyn StateStore) {
    let (a, b) = ("txn-a", "txn-b");
    let r0 = s.put(a, "x", b"0", Expect::Any).await.expect("put");
    // A failing check: nothing is written, not even the ops before it.
    let failing = Txn {
        checks: vec![
            (a.into(), "x".into(), Expect::Rev(r0)),
            (b.into(), "y".into(), Expect::Rev(r0)),
        ],
        ops: vec![put_op(a, "x", b"1", None), put_op(b, "y", b"1", None)],
    };
    match s.txn(failing).await {
        Err(StateError::Conflict { ns, key, found, .. }) => {
            assert_eq!((ns.as_str(), key.as_str(), found), (b, "y", None));
        }
        other => panic!("failing txn: {other:?}"),
    }
    assert_eq!(s.get(a, "x").await.expect("get").expect("x").value, b"0");
    assert_eq!(s.get(b, "y").await.expect("get"), None);
    // All checks hold: every op lands at one revision.
    let rev = s
        .txn(Txn {
            checks: vec![
                (a.into(), "x".into(), Expect::Rev(r0)),
                (b.into(), "y".into(), Expect::Absent),
            ],
            ops: vec![
                put_op(a, "x", b"1", None),
                put_op(b, "y", b"1", None),
                Op::Delete {
                    ns: a.into(),
                    key: "never-there".into(),
                },
            ],
        })
        .await
        .expect("txn");
    assert!(rev > r0);
    assert_eq!(s.get(a, "x").await.expect("get").expect("x").rev, rev);
    assert_eq!(s.get(b, "y").await.expect("get").expect("y").rev, rev);
    let rev2 = s
        .txn(Txn {
            checks: vec![],
            ops: vec![
                Op::Delete {
                    ns: a.into(),
                    key: "x".into(),
                },
                put_op(b, "z", b"2", None),
            ],
        })
        .await
        .expect("txn");
    assert!(rev2 > rev);
    assert_eq!(s.get(a, "x").await.expect("get"), None);
    // A key changed twice is refused before anything is written.
    let twice = Txn {
        checks: vec![],
        ops: vec![put_op(b, "w", b"1", None), put_op(b, "w", b"2", None)],
    };
    assert!(matches!(s.txn(twice).await, Err(StateError::Invalid(_))));
    assert_eq!(s.get(b, "w").await.expect("get"), None);
}

async fn invalid_requests_are_refused(s: &dyn StateStore) {
    let invalid = |r: Result<Revision, StateError>| matches!(r, Err(StateError::Invalid(_)));
    assert!(invalid(s.put("inv", "", b"x", Expect::Any).await));
    assert!(invalid(s.put("", "k", b"x", Expect::Any).await));
    assert!(invalid(s.put("in/v", "k", b"x", Expect::Any).await));
    let over = vec![0u8; MAX_VALUE_BYTES + 1];
    match s.put("inv", "k", &over, Expect::Any).await {
        Err(StateError::Invalid(msg)) => assert!(msg.contains("limit"), "{msg}"),
        other => panic!("oversized value: {other:?}"),
    }
    // Two values that together pass the limit.
    let half = vec![0u8; MAX_VALUE_BYTES / 2 + 1];
    assert!(invalid(
        s.txn(Txn {
            checks: vec![],
            ops: vec![
                put_op("inv", "h1", &half, None),
                put_op("inv", "h2", &half, None)
            ],
        })
        .await
    ));
    assert!(matches!(
        s.get("in/v", "k").await,
        Err(StateError::Invalid(_))
    ));
    assert!(matches!(s.list("in/v").await, Err(StateError::Invalid(_))));
    assert!(matches!(
        s.delete("inv", "", Expect::Any).await,
        Err(StateError::Invalid(_))
    ));
    assert_eq!(s.list("inv").await.expect("list").0, vec![]);
}

async fn list_is_a_snapshot_to_watch_from(s: &dyn StateStore) {
    let ns = "snap";
    s.put(ns, "a", b"1", Expect::Any).await.expect("put");
    let (list, rev) = s.list(ns).await.expect("list");
    assert_eq!(list.len(), 1);
    let mut w = s.watch(ns, rev).await.expect("watch");
    let r2 = s.put(ns, "b", b"2", Expect::Any).await.expect("put");
    // Nothing from before the list's revision, then the new change.
    match next_event(&mut w).await.expect("event") {
        WatchEvent::Put(e) => assert_eq!((e.key.as_str(), e.rev), ("b", r2)),
        other => panic!("{other:?}"),
    }
}

async fn watch_replays_then_follows(s: &dyn StateStore) {
    let ns = "watch";
    let (_, start) = s.list(ns).await.expect("list");
    let r1 = s.put(ns, "a", b"1", Expect::Any).await.expect("put");
    s.put("watch-other", "a", b"x", Expect::Any)
        .await
        .expect("put elsewhere");
    let r2 = s.put(ns, "a", b"2", Expect::Any).await.expect("put");
    assert!(s.delete(ns, "a", Expect::Any).await.expect("delete"));
    // From before all of them: replayed in order, other namespaces left out.
    let mut w = s.watch(ns, start).await.expect("watch");
    let e1 = next_event(&mut w).await.expect("e1");
    assert_eq!(
        e1,
        WatchEvent::Put(Entry {
            key: "a".into(),
            value: b"1".to_vec(),
            rev: r1
        })
    );
    assert_eq!(next_event(&mut w).await.expect("e2").rev(), r2);
    let e3 = next_event(&mut w).await.expect("e3");
    let r3 = match e3 {
        WatchEvent::Delete { ref key, rev } => {
            assert_eq!(key, "a");
            rev
        }
        other => panic!("{other:?}"),
    };
    assert!(r3 > r2);
    // Then live changes, including a transaction's, in order.
    let rt = s
        .txn(Txn {
            checks: vec![],
            ops: vec![put_op(ns, "t1", b"", None), put_op(ns, "t2", b"", None)],
        })
        .await
        .expect("txn");
    let got = [
        next_event(&mut w).await.expect("t1"),
        next_event(&mut w).await.expect("t2"),
    ];
    let mut keys: Vec<(String, Revision)> = got
        .iter()
        .map(|e| match e {
            WatchEvent::Put(e) => (e.key.clone(), e.rev),
            other => panic!("{other:?}"),
        })
        .collect();
    keys.sort();
    assert_eq!(keys, vec![("t1".into(), rt), ("t2".into(), rt)]);
    // From the middle: only what came after.
    let mut w2 = s.watch(ns, r2).await.expect("watch");
    assert_eq!(next_event(&mut w2).await.expect("delete").rev(), r3);
}

async fn leases_revoke_and_keep_alive(s: &dyn StateStore) {
    let ns = "lease";
    let lease = s.grant_lease(Duration::from_secs(30)).await.expect("grant");
    s.txn(Txn {
        checks: vec![],
        ops: vec![
            put_op(ns, "held", b"1", Some(lease)),
            put_op(ns, "detached", b"1", Some(lease)),
        ],
    })
    .await
    .expect("put with lease");
    // A put without the lease detaches the key from it.
    s.put(ns, "detached", b"2", Expect::Any).await.expect("put");
    s.keep_alive(lease).await.expect("keep alive");
    let (_, rev) = s.list(ns).await.expect("list");
    let mut w = s.watch(ns, rev).await.expect("watch");
    s.revoke_lease(lease).await.expect("revoke");
    assert_eq!(s.get(ns, "held").await.expect("get"), None);
    assert_eq!(
        s.get(ns, "detached")
            .await
            .expect("get")
            .expect("kept")
            .value,
        b"2"
    );
    match next_event(&mut w).await.expect("event") {
        WatchEvent::Delete { key, rev: r } => {
            assert_eq!(key, "held");
            assert!(r > rev);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        s.keep_alive(lease).await,
        Err(StateError::LeaseExpired(lease))
    );
    assert!(matches!(
        s.txn(Txn {
            checks: vec![],
            ops: vec![put_op(ns, "late", b"1", Some(lease))],
        })
        .await,
        Err(StateError::LeaseExpired(_))
    ));
    assert_eq!(s.get(ns, "late").await.expect("get"), None);
    s.revoke_lease(lease).await.expect("revoking twice is fine");
}

async fn a_lease_expires_without_keep_alive(s: &dyn StateStore) {
    let ns = "expiry";
    let kept = s.grant_lease(Duration::from_secs(1)).await.expect("grant");
    let lapsed = s.grant_lease(Duration::from_secs(1)).await.expect("grant");
    s.txn(Txn {
        checks: vec![],
        ops: vec![
            put_op(ns, "kept", b"", Some(kept)),
            put_op(ns, "lapsed", b"", Some(lapsed)),
        ],
    })
    .await
    .expect("put");
    let start = Instant::now();
    let mut gone = false;
    // Keep one alive until the other is gone (etcd may round a TTL up to 2 s).
    while start.elapsed() < Duration::from_secs(10) {
        s.keep_alive(kept).await.expect("keep alive");
        if s.get(ns, "lapsed").await.expect("get").is_none() {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(gone, "the key of a lease not kept alive is deleted");
    assert!(
        start.elapsed() >= Duration::from_millis(900),
        "not before the TTL"
    );
    assert!(s.get(ns, "kept").await.expect("get").is_some());
    assert_eq!(
        s.keep_alive(lapsed).await,
        Err(StateError::LeaseExpired(lapsed))
    );
    s.revoke_lease(kept).await.expect("revoke");
    assert_eq!(s.get(ns, "kept").await.expect("get"), None);
}

async fn concurrent_compare_and_swap_loses_no_update(store: Arc<dyn StateStore>) {
    let ns = "counter";
    store.put(ns, "n", b"0", Expect::Absent).await.expect("put");
    let (tasks, each) = (8, 10);
    let mut handles = Vec::new();
    for _ in 0..tasks {
        let s = store.clone();
        handles.push(tokio::spawn(async move {
            for _ in 0..each {
                loop {
                    let e = s.get(ns, "n").await.expect("get").expect("n");
                    let n: u64 = std::str::from_utf8(&e.value)
                        .expect("utf8")
                        .parse()
                        .expect("number");
                    match s
                        .put(ns, "n", (n + 1).to_string().as_bytes(), Expect::Rev(e.rev))
                        .await
                    {
                        Ok(_) => break,
                        Err(StateError::Conflict { .. }) => continue,
                        Err(e) => panic!("increment: {e}"),
                    }
                }
            }
        }));
    }
    for h in handles {
        h.await.expect("task");
    }
    let e = store.get(ns, "n").await.expect("get").expect("n");
    assert_eq!(e.value, (tasks * each).to_string().as_bytes());
}

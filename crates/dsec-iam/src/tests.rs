//! The cache's recovery from a broken watch (history compacted, store unavailable), on a
//! MemStore whose watches can be broken on demand.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dsec_state::{Entry, LeaseId, MemStore, Revision, WatchStream};
use futures::StreamExt;

use super::*;

/// A MemStore whose open watches end with `Compacted` when `break_watches` is called, and
/// whose next `fail_lists` lists fail as unavailable.
#[derive(Debug)]
struct Breakable {
    inner: MemStore,
    breaker: tokio::sync::watch::Sender<u64>,
    fail_lists: AtomicUsize,
    lists: AtomicUsize,
    fail_watches: std::sync::atomic::AtomicBool,
}

impl Breakable {
    fn new() -> Self {
        Breakable {
            inner: MemStore::new(),
            breaker: tokio::sync::watch::channel(0).0,
            fail_lists: AtomicUsize::new(0),
            lists: AtomicUsize::new(0),
            fail_watches: Default::default(),
        }
    }

    fn break_watches(&self) {
        self.breaker.send_modify(|g| *g += 1);
    }
}

#[async_trait::async_trait]
impl StateStore for Breakable {
    async fn get(&self, ns: &str, key: &str) -> Result<Option<Entry>, StateError> {
        self.inner.get(ns, key).await
    }
    async fn delete(&self, ns: &str, key: &str, expect: Expect) -> Result<bool, StateError> {
        self.inner.delete(ns, key, expect).await
    }
    async fn txn(&self, txn: Txn) -> Result<Revision, StateError> {
        self.inner.txn(txn).await
    }
    async fn list(&self, ns: &str) -> Result<(Vec<Entry>, Revision), StateError> {
        self.lists.fetch_add(1, Ordering::SeqCst);
        let fail = self
            .fail_lists
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if fail {
            return Err(StateError::Unavailable("told to fail".into()));
        }
        self.inner.list(ns).await
    }
    async fn watch(&self, ns: &str, after: Revision) -> Result<WatchStream, StateError> {
        if self.fail_watches.load(Ordering::SeqCst) {
            return Err(StateError::Unavailable("told to fail".into()));
        }
        let mut rx = self.breaker.subscribe();
        rx.borrow_and_update();
        let inner = self.inner.watch(ns, after).await?;
        let broken = async move {
            let _ = rx.changed().await;
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

async fn eventually(what: &str, f: impl Fn() -> bool) {
    let end = Instant::now() + Duration::from_secs(2);
    while !f() {
        assert!(Instant::now() < end, "not within 2 s: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compacted_watch_relists_and_misses_nothing() {
    let store = Arc::new(Breakable::new());
    let dyn_store: Arc<dyn StateStore> = store.clone();
    let follower = Iam::new(dyn_store.clone(), None).await.expect("iam");
    let writer = Iam::new(Arc::new(store.inner.clone()), None)
        .await
        .expect("iam");
    writer
        .create_tenant("t", Quotas::default())
        .await
        .expect("tenant");
    let k = writer
        .create_key("t", "", &[Scope::Read], None)
        .await
        .expect("key");
    eventually("the key arrives", || follower.authenticate(&k.key).is_ok()).await;

    // The watches break as compacted, and the first relists fail: the follower backs
    // off, relists, and sees what changed meanwhile.
    let lists = store.lists.load(Ordering::SeqCst);
    store.fail_lists.store(2, Ordering::SeqCst);
    store.break_watches();
    writer.revoke_key(&k.info.key_id).await.expect("revoke");
    eventually("the revocation arrives after relisting", || {
        follower.authenticate(&k.key).is_err()
    })
    .await;
    assert!(
        store.lists.load(Ordering::SeqCst) >= lists + 3,
        "relisted after two failures"
    );
    // And it follows live changes again.
    let k2 = writer
        .create_key("t", "", &[Scope::Read], None)
        .await
        .expect("key");
    eventually("a later key arrives", || {
        follower.authenticate(&k2.key).is_ok()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_that_cannot_follow_the_store_fails_closed() {
    let store = Arc::new(Breakable::new());
    let mut cfg = IamConfig::new(Some("boot".into()));
    cfg.max_stale = Some(Duration::from_millis(200));
    let r = Iam::with_config(store.clone(), cfg).await.expect("iam");
    r.create_tenant("t", Quotas::default())
        .await
        .expect("tenant");
    let k = r
        .create_key("t", "", &[Scope::Read], None)
        .await
        .expect("key");
    r.authenticate(&k.key).expect("fresh");
    store.fail_watches.store(true, Ordering::SeqCst);
    store.break_watches();
    eventually("stored keys are refused", || {
        matches!(
            r.authenticate(&k.key),
            Err(IamError::Store(StateError::Unavailable(_)))
        )
    })
    .await;
    r.authenticate("boot")
        .expect("the bootstrap key needs no store");
    assert_eq!(
        r.authenticate("dsec_nonsense"),
        Err(IamError::Unauthenticated)
    );
    store.fail_watches.store(false, Ordering::SeqCst);
    eventually("following again", || r.authenticate(&k.key).is_ok()).await;
}

#[test]
fn older_news_never_replaces_newer() {
    let t = |disabled| Tenant {
        disabled,
        ..Tenant::implicit_default()
    };
    let entry = |tenant: &Tenant, rev| Entry {
        key: tenant.name.clone(),
        value: encode(tenant),
        rev,
    };
    let mut c = Cache::default();
    c.put(Kind::Tenants, &entry(&t(true), 5));
    c.put(Kind::Tenants, &entry(&t(false), 4));
    assert!(
        c.tenants[DEFAULT_TENANT].0.disabled,
        "rev 4 is older than 5"
    );
    // A listing as of rev 3 keeps what was written after it.
    c.replace(Kind::Tenants, &[entry(&t(false), 2)], 3);
    assert!(c.tenants[DEFAULT_TENANT].0.disabled);
    // A listing as of rev 6 is the truth.
    c.replace(Kind::Tenants, &[], 6);
    assert!(c.tenants.is_empty());
    // A record that does not decode drops the key (a key that cannot be checked fails).
    c.put(
        Kind::Keys,
        &Entry {
            key: "k".into(),
            value: b"not json".to_vec(),
            rev: 7,
        },
    );
    assert!(c.keys.is_empty());
}

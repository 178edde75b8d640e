//! The cache's recovery from a broken watch (history compacted, store unavailable), on a
//! MemStore whose watches can be broken on demand.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use dsec_state::{Entry, FaultyStore, MemStore};

use super::*;

/// A MemStore whose open watches can be broken (they end `Compacted`) and whose next lists
/// can be made to fail.
fn breakable() -> Arc<FaultyStore> {
    Arc::new(FaultyStore::new(Arc::new(MemStore::new())))
}

/// Applies one store operation (a minted token's record, its deletion).
async fn apply(store: &Arc<dyn StateStore>, op: Op) {
    store
        .txn(Txn {
            checks: vec![],
            ops: vec![op],
        })
        .await
        .expect("the store takes the operation");
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
    let store = breakable();
    let dyn_store: Arc<dyn StateStore> = store.clone();
    let follower = Iam::new(dyn_store.clone(), None).await.expect("iam");
    let writer = Iam::new(store.inner(), None).await.expect("iam");
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
    let lists = store.calls().lists.load(Ordering::SeqCst);
    store.fail_lists.store(2, Ordering::SeqCst);
    store.break_watches();
    writer.revoke_key(&k.info.key_id).await.expect("revoke");
    eventually("the revocation arrives after relisting", || {
        follower.authenticate(&k.key).is_err()
    })
    .await;
    assert!(
        store.calls().lists.load(Ordering::SeqCst) >= lists + 3,
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
    let store = breakable();
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_token_works_once_stored_and_stops_when_deleted_on_every_replica() {
    let store: Arc<dyn StateStore> = Arc::new(MemStore::new());
    let minter = Iam::new(store.clone(), None).await.expect("iam");
    let gateway = Iam::new(store.clone(), None).await.expect("iam");
    minter
        .create_tenant("t", Quotas::default())
        .await
        .expect("tenant");
    let access = dsec_wire::v1::ModelAccess {
        models: vec!["policy".into()],
        budget_tokens: Some(1000),
        ..Default::default()
    };
    let (minted, op) = minter.mint_model_token("t", "sb-1", access.clone());
    // Not stored yet: refused.
    assert!(matches!(
        gateway.authenticate_model_token(&minted.token),
        Err(IamError::Unauthenticated)
    ));
    apply(&store, op).await;
    eventually("the token arrives at the other replica", || {
        gateway.authenticate_model_token(&minted.token).is_ok()
    })
    .await;
    let grant = gateway
        .authenticate_model_token(&minted.token)
        .expect("grant");
    assert_eq!(
        (grant.tenant.as_str(), grant.sandbox.as_str(), &grant.access),
        ("t", "sb-1", &access)
    );
    // A wrong secret, an API key, garbage: refused.
    // The last hex digit changed (to another digit, whatever it was).
    let last = if minted.token.ends_with('0') {
        '1'
    } else {
        '0'
    };
    let wrong = format!("{}{last}", &minted.token[..minted.token.len() - 1]);
    for bad in [wrong.as_str(), "dsec_abc", "", "dsgw_"] {
        assert!(gateway.authenticate_model_token(bad).is_err(), "{bad:?}");
    }
    // A disabled tenant's tokens stop.
    minter.set_disabled("t", true).await.expect("disable");
    eventually("disabled", || {
        matches!(
            gateway.authenticate_model_token(&minted.token),
            Err(IamError::TenantDisabled(_))
        )
    })
    .await;
    minter.set_disabled("t", false).await.expect("enable");
    // Deleted with its sandbox: refused everywhere.
    apply(&store, Iam::delete_model_token_op(&minted.record.token_id)).await;
    eventually("the deletion arrives", || {
        matches!(
            gateway.authenticate_model_token(&minted.token),
            Err(IamError::Unauthenticated)
        )
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_spending_is_shared_between_gateways_and_outlives_a_restart() {
    let store: Arc<dyn StateStore> = Arc::new(MemStore::new());
    let ms = Arc::new(std::sync::atomic::AtomicU64::new(1_000_000));
    let at = ms.clone();
    let a = Arc::new(
        Iam::with_config(
            store.clone(),
            IamConfig {
                clock: Arc::new(move || at.load(Ordering::SeqCst)),
                ..IamConfig::new(None)
            },
        )
        .await
        .expect("iam"),
    );
    let b = Arc::new(Iam::new(store.clone(), None).await.expect("iam"));
    let access = dsec_wire::v1::ModelAccess {
        models: vec!["policy".into()],
        budget_tokens: Some(1000),
        ..Default::default()
    };
    let mut ids = Vec::new();
    for sb in ["sb-1", "sb-2"] {
        let (minted, op) = a.mint_model_token(DEFAULT_TENANT, sb, access.clone());
        apply(&store, op).await;
        ids.push(minted.record.token_id);
    }
    let (t1, t2) = (ids[0].clone(), ids[1].clone());
    eventually("both replicas know the tokens", || {
        [&a, &b]
            .iter()
            .all(|iam| iam.model_token_exists(&t1) && iam.model_token_exists(&t2))
    })
    .await;
    let mine = |pairs: &[(&str, u64)]| -> BTreeMap<String, u64> {
        pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    };
    let of = |m: &HashMap<String, u64>, id: &str| m.get(id).copied();

    let ga = ModelSpendLedger::new(a.clone(), "gw");
    let gb = ModelSpendLedger::new(b.clone(), "gw");
    assert_ne!(
        ga.id(),
        gb.id(),
        "each gateway process writes its own record"
    );
    assert!(ga
        .exchange(&mine(&[(&t1, 10)]))
        .await
        .expect("a")
        .is_empty());
    let seen = gb.exchange(&mine(&[(&t1, 5), (&t2, 7)])).await.expect("b");
    assert_eq!((of(&seen, &t1), of(&seen, &t2)), (Some(10), None));
    let seen = ga.exchange(&mine(&[(&t1, 12)])).await.expect("a");
    assert_eq!((of(&seen, &t1), of(&seen, &t2)), (Some(5), Some(7)));

    // a restarts: a new record of its own, and its earlier run still counts.
    let ga2 = ModelSpendLedger::new(a.clone(), "gw");
    let seen = ga2.exchange(&BTreeMap::new()).await.expect("a2");
    assert_eq!((of(&seen, &t1), of(&seen, &t2)), (Some(17), Some(7)));
    assert!(
        store
            .get(MODEL_SPENDING_NS, ga2.id())
            .await
            .expect("get")
            .is_none(),
        "nothing spent: no record"
    );

    // t1's sandbox is deleted: its spending no longer counts, and the earlier run's
    // record (t1 only) is removed once it is old enough; b's (t2 is live) stays.
    apply(&store, Iam::delete_model_token_op(&t1)).await;
    eventually("a no longer knows t1", || !a.model_token_exists(&t1)).await;
    let seen = ga2.exchange(&BTreeMap::new()).await.expect("a2");
    assert_eq!((of(&seen, &t1), of(&seen, &t2)), (None, Some(7)));
    let record = |id: String| {
        let store = store.clone();
        async move { store.get(MODEL_SPENDING_NS, &id).await.expect("get") }
    };
    assert!(
        record(ga.id().into()).await.is_some(),
        "too recent to remove"
    );
    ms.fetch_add(model_spending::ABANDONED_AFTER_MS, Ordering::SeqCst);
    ga2.exchange(&BTreeMap::new()).await.expect("a2");
    assert!(record(ga.id().into()).await.is_none(), "abandoned: removed");
    assert!(record(gb.id().into()).await.is_some(), "t2 is live");
    // A gateway that holds nothing any more removes its own.
    gb.exchange(&BTreeMap::new()).await.expect("b");
    assert!(record(gb.id().into()).await.is_none());
}

//! IAM against real stores: every scenario runs on a `MemStore` and on a real etcd
//! (`dsec_testkit::Etcd`; fails under `CI=true` if etcd is missing), with two `Iam`
//! instances over one store standing for two API server replicas.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dsec_iam::{
    Iam, IamConfig, IamError, QuotaKind, Quotas, Scope, Usage, DEFAULT_TENANT, KEYS_NS, TENANTS_NS,
    USAGE_NS,
};
use dsec_state::{EtcdConfig, EtcdStore, Expect, MemStore, Op, StateError, StateStore, Txn};
use dsec_wire::ErrorCode;

type Store = Arc<dyn StateStore>;

/// Runs a scenario on one MemStore seen by two replicas, and on one real etcd with a
/// connection per replica.
macro_rules! on_both_stores {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn mem() {
                let s: super::Store = std::sync::Arc::new(dsec_state::MemStore::new());
                super::$name(s.clone(), s).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn etcd() {
                let test = concat!(stringify!($name), "::etcd");
                let Some(etcd) = dsec_testkit::Etcd::start(test) else {
                    return;
                };
                let a = super::etcd_store(&etcd).await;
                let b = super::etcd_store(&etcd).await;
                super::$name(a, b).await;
            }
        }
    )*};
}

on_both_stores!(
    quota_race_admits_exactly_the_quota,
    rate_quota_admits_the_burst_then_the_rate,
    revocation_reaches_the_other_replica_within_a_second,
    bad_input_is_refused_and_writes_nothing,
    keys_are_stored_hashed,
    a_reservation_commits_with_the_callers_record_or_not_at_all,
    the_bootstrap_key_is_the_default_admin_and_never_stored,
    creates_holding_the_usage_lock_never_conflict_on_one_replica,
);

async fn etcd_store(etcd: &dsec_testkit::Etcd) -> Store {
    let cfg = EtcdConfig::new(etcd.endpoints(), "/dsec-iam-test");
    Arc::new(EtcdStore::connect(cfg).await.expect("connect to etcd"))
}

/// Polls `f` every 5 ms until it is true or `within` has passed; the time it took.
async fn wait_until<F, Fut>(within: Duration, mut f: F) -> Option<Duration>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if f().await {
            return Some(start.elapsed());
        }
        if start.elapsed() > within {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn iam(store: &Store) -> Arc<Iam> {
    Arc::new(Iam::new(store.clone(), None).await.expect("iam"))
}

/// A test clock both replicas share (unix ms), moved by hand.
fn shared_clock(start: u64) -> (Arc<AtomicU64>, IamConfig) {
    let now = Arc::new(AtomicU64::new(start));
    let n = now.clone();
    let mut cfg = IamConfig::new(None);
    cfg.clock = Arc::new(move || n.load(Ordering::SeqCst));
    (now, cfg)
}

/// Every IAM entry and the store's revision: what "nothing written" compares.
async fn snapshot(store: &Store) -> Vec<(String, Vec<dsec_state::Entry>, u64)> {
    let mut out = Vec::new();
    for ns in [TENANTS_NS, KEYS_NS, USAGE_NS] {
        let (entries, rev) = store.list(ns).await.expect("list");
        out.push((ns.to_string(), entries, rev));
    }
    out
}

async fn quota_race_admits_exactly_the_quota(a: Store, b: Store) {
    let (ra, rb) = (iam(&a).await, iam(&b).await);
    let quotas = Quotas {
        max_sandboxes: Some(20),
        ..Quotas::default()
    };
    ra.create_tenant("racers", quotas).await.expect("tenant");
    // The tenant reaches replica b by its watch.
    assert!(
        wait_until(Duration::from_secs(1), || async {
            rb.cached_tenant("racers").is_some()
        })
        .await
        .is_some(),
        "the tenant reached replica b"
    );
    let mut tasks = Vec::new();
    for i in 0..60 {
        let r = if i % 2 == 0 { ra.clone() } else { rb.clone() };
        tasks.push(tokio::spawn(async move {
            r.reserve_now("racers", Usage::sandbox(100, 64)).await
        }));
    }
    let (mut ok, mut exceeded) = (0, 0);
    for t in tasks {
        match t.await.expect("task") {
            Ok(_) => ok += 1,
            Err(IamError::QuotaExceeded {
                which: QuotaKind::MaxSandboxes,
                limit: 20,
                used: 20,
                ..
            }) => exceeded += 1,
            Err(e) => panic!("unexpected: {e}"),
        }
    }
    assert_eq!((ok, exceeded), (20, 40));
    let want = Usage {
        sandboxes: 20,
        cpu_millis: 2000,
        memory_mb: 1280,
    };
    assert_eq!(rb.usage("racers").await.expect("usage"), want);
    // The wire error clients see.
    let e = ra
        .reserve_now("racers", Usage::sandbox(1, 1))
        .await
        .expect_err("full");
    let api = e.to_api_error();
    assert_eq!(api.code, ErrorCode::QuotaExceeded);
    assert_eq!(api.code.http_status(), 429);
    assert!(api.message.contains("max_sandboxes"), "{}", api.message);
    // Releases from both replicas bring it back, never below zero.
    let mut tasks = Vec::new();
    for i in 0..25 {
        let r = if i % 2 == 0 { ra.clone() } else { rb.clone() };
        tasks.push(tokio::spawn(async move {
            r.release_now("racers", Usage::sandbox(100, 64)).await
        }));
    }
    for t in tasks {
        t.await.expect("task").expect("release");
    }
    assert_eq!(ra.usage("racers").await.expect("usage"), Usage::default());
    ra.reserve_now("racers", Usage::sandbox(1, 1))
        .await
        .expect("room again");
}

async fn rate_quota_admits_the_burst_then_the_rate(a: Store, b: Store) {
    let (now, cfg) = shared_clock(1_000_000);
    let ra = Arc::new(Iam::with_config(a, cfg.clone()).await.expect("iam"));
    let rb = Arc::new(Iam::with_config(b, cfg).await.expect("iam"));
    let quotas = Quotas {
        creates_per_second: Some(4),
        creates_burst: Some(6),
        ..Quotas::default()
    };
    ra.create_tenant("bursty", quotas).await.expect("tenant");
    wait_until(Duration::from_secs(1), || async {
        rb.cached_tenant("bursty").is_some()
    })
    .await
    .expect("the tenant reached replica b");
    let round = |n: usize| {
        let (ra, rb) = (ra.clone(), rb.clone());
        async move {
            let tasks: Vec<_> = (0..n)
                .map(|i| {
                    let r = if i % 2 == 0 { ra.clone() } else { rb.clone() };
                    tokio::spawn(async move { r.reserve_now("bursty", Usage::sandbox(0, 0)).await })
                })
                .collect();
            let mut ok = 0;
            for t in tasks {
                match t.await.expect("task") {
                    Ok(_) => ok += 1,
                    Err(IamError::QuotaExceeded {
                        which: QuotaKind::CreatesPerSecond,
                        limit: 4,
                        retry_after: Some(d),
                        ..
                    }) => assert!(d <= Duration::from_millis(250), "{d:?}"),
                    Err(e) => panic!("unexpected: {e}"),
                }
            }
            ok
        }
    };
    // The burst at once, then nothing more at the same instant.
    assert_eq!(round(20).await, 6);
    assert_eq!(round(5).await, 0);
    // 500 ms later: two tokens at 4/s.
    now.fetch_add(500, Ordering::SeqCst);
    assert_eq!(round(10).await, 2);
    // After a long quiet spell the bucket holds the burst, no more.
    now.fetch_add(60_000, Ordering::SeqCst);
    assert_eq!(round(20).await, 6);
    // Releases give back sandboxes, not creates.
    ra.release_now(
        "bursty",
        Usage {
            sandboxes: 14,
            ..Usage::default()
        },
    )
    .await
    .expect("release");
    assert_eq!(round(3).await, 0);
}

async fn revocation_reaches_the_other_replica_within_a_second(a: Store, b: Store) {
    let (ra, rb) = (iam(&a).await, iam(&b).await);
    ra.create_tenant("acme", Quotas::default())
        .await
        .expect("tenant");
    let k = ra
        .create_key("acme", "ci", &[Scope::Sandboxes], None)
        .await
        .expect("key");
    // The writer's own replica knows it at once; the other within a second.
    let p = ra.authenticate(&k.key).expect("own replica");
    assert_eq!(
        (p.tenant.as_str(), p.scopes.as_slice()),
        ("acme", &[Scope::Sandboxes][..])
    );
    let took = wait_until(Duration::from_secs(1), || async {
        rb.authenticate(&k.key).is_ok()
    })
    .await;
    assert!(took.is_some(), "the new key reached replica b within 1 s");

    ra.revoke_key(&k.info.key_id).await.expect("revoke");
    assert_eq!(ra.authenticate(&k.key), Err(IamError::Unauthenticated));
    let took = wait_until(Duration::from_secs(1), || async {
        rb.authenticate(&k.key) == Err(IamError::Unauthenticated)
    })
    .await;
    assert!(
        took.is_some(),
        "the revocation reached replica b within 1 s"
    );
    // Revoking again is not an error and changes nothing.
    let again = rb.revoke_key(&k.info.key_id).await.expect("revoke again");
    assert_eq!(
        again.revoked_at,
        ra.get_key(&k.info.key_id).await.expect("get").revoked_at
    );
    assert!(matches!(
        rb.rotate_key(&k.info.key_id, Duration::ZERO).await,
        Err(IamError::KeyRevoked(_))
    ));

    // Rotation with a grace: both keys work until it ends; at once: only the new one.
    let k2 = rb
        .create_key("acme", "deploy", &[Scope::Read, Scope::Images], None)
        .await
        .expect("key");
    let k3 = ra
        .rotate_key(&k2.info.key_id, Duration::from_secs(3600))
        .await
        .expect("rotate");
    assert_eq!(k3.info.scopes, vec![Scope::Read, Scope::Images]);
    assert_eq!(
        (k3.info.tenant.as_str(), k3.info.name.as_str()),
        ("acme", "deploy")
    );
    wait_until(Duration::from_secs(1), || async {
        rb.authenticate(&k3.key).is_ok()
    })
    .await
    .expect("the rotated key reached replica b");
    rb.authenticate(&k2.key)
        .expect("the old key works during the grace");
    let k4 = rb
        .rotate_key(&k3.info.key_id, Duration::ZERO)
        .await
        .expect("rotate");
    assert_eq!(rb.authenticate(&k3.key), Err(IamError::Unauthenticated));
    wait_until(Duration::from_secs(1), || async {
        ra.authenticate(&k3.key).is_err() && ra.authenticate(&k4.key).is_ok()
    })
    .await
    .expect("the rotation reached replica a");

    // Disabling the tenant stops its keys everywhere, with a clear error; enabling
    // brings them back.
    ra.set_disabled("acme", true).await.expect("disable");
    wait_until(Duration::from_secs(1), || async {
        rb.authenticate(&k4.key) == Err(IamError::TenantDisabled("acme".into()))
    })
    .await
    .expect("the disabled tenant reached replica b within 1 s");
    assert_eq!(
        rb.reserve("acme", Usage::sandbox(1, 1)).await,
        Err(IamError::TenantDisabled("acme".into()))
    );
    assert_eq!(
        IamError::TenantDisabled("acme".into()).to_api_error().code,
        ErrorCode::Forbidden
    );
    rb.set_disabled("acme", false).await.expect("enable");
    wait_until(Duration::from_secs(1), || async {
        ra.authenticate(&k4.key).is_ok()
    })
    .await
    .expect("enabled again on replica a");

    let keys = ra.list_keys("acme").await.expect("list");
    let ids: Vec<_> = keys.iter().map(|k| k.key_id.as_str()).collect();
    for k in [&k, &k2, &k3, &k4] {
        assert!(ids.contains(&k.info.key_id.as_str()));
    }
    assert_eq!(keys.iter().filter(|k| k.revoked_at.is_none()).count(), 1);
}

async fn bad_input_is_refused_and_writes_nothing(a: Store, b: Store) {
    let (ra, rb) = (iam(&a).await, iam(&b).await);
    ra.create_tenant("taken", Quotas::default())
        .await
        .expect("tenant");
    let k = ra
        .create_key("taken", "k", &[Scope::Read], None)
        .await
        .expect("key");
    ra.reserve_now("taken", Usage::sandbox(1, 1))
        .await
        .expect("usage");
    let before = snapshot(&a).await;

    for bad in [
        "",
        "UPPER",
        "has_underscore",
        "-lead",
        "trail-",
        "a/b",
        "dots.no",
        &"x".repeat(64),
    ] {
        let e = rb
            .create_tenant(bad, Quotas::default())
            .await
            .expect_err(bad);
        assert!(
            matches!(e, IamError::InvalidTenantName { .. }),
            "{bad:?}: {e}"
        );
        assert_eq!(e.to_api_error().code, ErrorCode::BadRequest);
    }
    let e = rb
        .create_tenant("taken", Quotas::default())
        .await
        .expect_err("dup");
    assert_eq!(e, IamError::TenantExists("taken".into()));
    assert_eq!(e.to_api_error().code, ErrorCode::Conflict);
    assert_eq!(
        rb.create_tenant(DEFAULT_TENANT, Quotas::default()).await,
        Err(IamError::TenantExists(DEFAULT_TENANT.into()))
    );
    let burst_without_rate = Quotas {
        creates_burst: Some(5),
        ..Quotas::default()
    };
    assert!(matches!(
        rb.create_tenant("fresh", burst_without_rate.clone()).await,
        Err(IamError::Invalid(_))
    ));
    assert!(matches!(
        rb.set_quotas("taken", burst_without_rate).await,
        Err(IamError::Invalid(_))
    ));

    let unknown = IamError::UnknownTenant("ghost".into());
    assert_eq!(unknown.to_api_error().code, ErrorCode::NotFound);
    assert_eq!(rb.get_tenant("ghost").await, Err(unknown.clone()));
    assert_eq!(
        rb.set_quotas("ghost", Quotas::default()).await.map(|_| ()),
        Err(unknown.clone())
    );
    assert_eq!(
        rb.set_disabled("ghost", true).await.map(|_| ()),
        Err(unknown.clone())
    );
    assert_eq!(
        rb.create_key("ghost", "k", &[Scope::Read], None)
            .await
            .map(|_| ()),
        Err(unknown.clone())
    );
    assert_eq!(
        rb.list_keys("ghost").await.map(|_| ()),
        Err(unknown.clone())
    );
    assert_eq!(
        rb.reserve_now("ghost", Usage::sandbox(1, 1))
            .await
            .map(|_| ()),
        Err(unknown)
    );
    assert!(matches!(
        rb.create_key("taken", "k", &[], None).await,
        Err(IamError::Invalid(_))
    ));
    assert!(matches!(
        rb.create_key("taken", "bad\nname", &[Scope::Read], None)
            .await,
        Err(IamError::Invalid(_))
    ));
    assert!(matches!(
        rb.create_key("taken", &"n".repeat(129), &[Scope::Read], None)
            .await,
        Err(IamError::Invalid(_))
    ));
    assert!(matches!(
        rb.create_key("taken", "k", &[Scope::Read], Some(1)).await,
        Err(IamError::Invalid(_))
    ));
    for id in ["aaaaaaaaaaaa", "nope", "", &k.key] {
        let e = rb.revoke_key(id).await.expect_err(id);
        assert!(matches!(e, IamError::UnknownKey(_)), "{id:?}: {e}");
        assert_eq!(e.to_api_error().code, ErrorCode::NotFound);
        assert!(matches!(
            rb.rotate_key(id, Duration::ZERO).await,
            Err(IamError::UnknownKey(_))
        ));
    }
    let huge = Usage {
        cpu_millis: u64::MAX,
        ..Usage::default()
    };
    assert!(matches!(
        rb.reserve_now("taken", huge).await,
        Err(IamError::Invalid(_))
    ));
    for bad in [
        "",
        "x",
        "dsec_",
        &k.key[..k.key.len() - 1],
        &format!("{}0", k.key),
    ] {
        assert_eq!(
            rb.authenticate(bad),
            Err(IamError::Unauthenticated),
            "{bad:?}"
        );
    }
    assert_eq!(
        IamError::Unauthenticated.to_api_error().code.http_status(),
        401
    );

    assert_eq!(snapshot(&a).await, before, "a refused call wrote something");
}

async fn keys_are_stored_hashed(a: Store, _b: Store) {
    let r = iam(&a).await;
    r.create_tenant("vault", Quotas::default())
        .await
        .expect("tenant");
    let k1 = r
        .create_key("vault", "one", &[Scope::Admin], None)
        .await
        .expect("key");
    let k2 = r
        .rotate_key(&k1.info.key_id, Duration::from_secs(60))
        .await
        .expect("rotate");
    let mut hashes = Vec::new();
    for k in [&k1, &k2] {
        let secret = k.key.rsplit('_').next().expect("secret");
        assert_eq!(secret.len(), 64);
        assert!(k.key.starts_with(&format!("dsec_{}_", k.info.key_id)));
        let (entries, _) = a.list(KEYS_NS).await.expect("list");
        for ns in [TENANTS_NS, KEYS_NS, USAGE_NS] {
            let (entries, _) = a.list(ns).await.expect("list");
            for e in entries {
                let text = String::from_utf8_lossy(&e.value);
                assert!(!text.contains(secret), "{ns}/{} holds a secret", e.key);
            }
        }
        let stored = entries
            .iter()
            .find(|e| e.key == k.info.key_id)
            .expect("stored");
        let v: serde_json::Value = serde_json::from_slice(&stored.value).expect("json");
        let want = sha256_hex(secret);
        assert_eq!(v["secret_sha256"], serde_json::Value::String(want.clone()));
        hashes.push(want);
        // Listing never shows the secret or its hash.
        let listed =
            serde_json::to_string(&r.list_keys("vault").await.expect("list")).expect("json");
        assert!(!listed.contains(secret) && !listed.contains(&hashes[hashes.len() - 1]));
    }
    assert_ne!(hashes[0], hashes[1]);
    assert!(!format!("{k1:?}").contains(k1.key.rsplit('_').next().expect("secret")));
}

fn sha256_hex(s: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(s.as_bytes()))
}

async fn a_reservation_commits_with_the_callers_record_or_not_at_all(a: Store, b: Store) {
    let (ra, rb) = (iam(&a).await, iam(&b).await);
    let quotas = Quotas {
        max_sandboxes: Some(5),
        ..Quotas::default()
    };
    ra.create_tenant("atomic", quotas).await.expect("tenant");
    let record = |id: &str| Op::Put {
        ns: "sandboxes".into(),
        key: id.into(),
        value: b"{}".to_vec(),
        lease: None,
    };
    let mut txn = Txn {
        checks: vec![("sandboxes".into(), "sb-1".into(), Expect::Absent)],
        ops: vec![record("sb-1")],
    };
    ra.reserve("atomic", Usage::sandbox(500, 256))
        .await
        .expect("reserve")
        .add_to(&mut txn);
    a.txn(txn).await.expect("commit");
    assert_eq!(rb.usage("atomic").await.expect("usage").sandboxes, 1);

    // The caller's own check fails: no usage is taken.
    let mut txn = Txn {
        checks: vec![("sandboxes".into(), "sb-1".into(), Expect::Absent)],
        ops: vec![record("sb-1b")],
    };
    let q = rb
        .reserve("atomic", Usage::sandbox(500, 256))
        .await
        .expect("reserve");
    q.clone().add_to(&mut txn);
    let e = b.txn(txn).await.expect_err("sb-1 exists");
    assert!(!q.lost_race(&e), "{e}");
    assert_eq!(ra.usage("atomic").await.expect("usage").sandboxes, 1);
    assert!(b.get("sandboxes", "sb-1b").await.expect("get").is_none());

    // Another replica reserves in between: the stale reservation loses, and says so.
    let stale = rb
        .reserve("atomic", Usage::sandbox(500, 256))
        .await
        .expect("reserve");
    ra.reserve_now("atomic", Usage::sandbox(500, 256))
        .await
        .expect("reserve");
    let mut txn = Txn {
        checks: vec![("sandboxes".into(), "sb-2".into(), Expect::Absent)],
        ops: vec![record("sb-2")],
    };
    stale.clone().add_to(&mut txn);
    let e = b.txn(txn).await.expect_err("stale");
    assert!(stale.lost_race(&e), "{e}");
    assert!(matches!(e, StateError::Conflict { .. }));
    assert_eq!(ra.usage("atomic").await.expect("usage").sandboxes, 2);

    // Releasing with the record's delete, in one txn.
    let mut txn = Txn {
        checks: Vec::new(),
        ops: vec![Op::Delete {
            ns: "sandboxes".into(),
            key: "sb-1".into(),
        }],
    };
    rb.release("atomic", Usage::sandbox(500, 256))
        .await
        .expect("release")
        .add_to(&mut txn);
    b.txn(txn).await.expect("commit");
    assert_eq!(
        ra.usage("atomic").await.expect("usage"),
        Usage::sandbox(500, 256)
    );
}

async fn the_bootstrap_key_is_the_default_admin_and_never_stored(a: Store, b: Store) {
    let boot = "the-operators-key".to_string();
    let ra = Iam::new(a.clone(), Some(boot.clone())).await.expect("iam");
    let rb = Iam::new(b, Some(boot.clone())).await.expect("iam");
    for r in [&ra, &rb] {
        let p = r.authenticate(&boot).expect("bootstrap");
        assert_eq!(p.tenant, DEFAULT_TENANT);
        assert!(p.is_cluster_admin());
        assert!(Scope::ALL.iter().all(|s| p.scopes.contains(s)));
        assert_eq!(
            r.authenticate("the-operators-keY"),
            Err(IamError::Unauthenticated)
        );
        assert_eq!(r.authenticate(""), Err(IamError::Unauthenticated));
    }
    // The implicit default tenant: listed, unlimited, not stored.
    let tenants = ra.list_tenants().await.expect("list");
    assert_eq!(tenants.len(), 1);
    assert_eq!(tenants[0].name, DEFAULT_TENANT);
    for ns in [TENANTS_NS, KEYS_NS, USAGE_NS] {
        assert!(
            a.list(ns).await.expect("list").0.is_empty(),
            "{ns} was written"
        );
    }
    // Keys of default work; disabling default stops them but not the bootstrap key.
    let k = ra
        .create_key(DEFAULT_TENANT, "ops", &[Scope::Admin], None)
        .await
        .expect("key");
    assert!(ra.authenticate(&k.key).expect("key").is_cluster_admin());
    ra.set_disabled(DEFAULT_TENANT, true)
        .await
        .expect("disable");
    wait_until(Duration::from_secs(1), || async {
        rb.authenticate(&k.key).is_err()
    })
    .await
    .expect("disabled on b");
    rb.authenticate(&boot)
        .expect("the bootstrap key still works");
    // Without a bootstrap key, none is accepted (an empty one is none).
    let none = Iam::new(a.clone(), Some(String::new())).await.expect("iam");
    assert_eq!(none.authenticate(""), Err(IamError::Unauthenticated));
    assert_eq!(none.authenticate(&boot), Err(IamError::Unauthenticated));
}

/// The MemStore-only check that the cache follows a store that was unavailable a while.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_store_was_unavailable_catches_up() {
    let mem = MemStore::new();
    let a: Store = Arc::new(mem.clone());
    let r = iam(&a).await;
    mem.set_unavailable(true);
    assert!(matches!(
        r.create_tenant("later", Quotas::default()).await,
        Err(IamError::Store(StateError::Unavailable(_)))
    ));
    assert_eq!(
        IamError::Store(StateError::Unavailable("x".into()))
            .to_api_error()
            .code,
        ErrorCode::Capacity
    );
    mem.set_unavailable(false);
    let other = iam(&a).await;
    other
        .create_tenant("later", Quotas::default())
        .await
        .expect("tenant");
    wait_until(Duration::from_secs(1), || async {
        r.cached_tenant("later").is_some()
    })
    .await
    .expect("caught up");
}

/// The control plane's create path: lock the tenant's usage, reserve, commit the record
/// and the reservation in one txn. On one replica no txn loses a race.
async fn creates_holding_the_usage_lock_never_conflict_on_one_replica(a: Store, _b: Store) {
    let r = iam(&a).await;
    let quotas = Quotas {
        max_sandboxes: Some(10),
        ..Quotas::default()
    };
    r.create_tenant("locked", quotas).await.expect("tenant");
    let tasks: Vec<_> = (0..30)
        .map(|i| {
            let (r, a) = (r.clone(), a.clone());
            tokio::spawn(async move {
                let _guard = r.lock_usage("locked").await;
                let q = r.reserve("locked", Usage::sandbox(10, 10)).await?;
                let id = format!("sb-{i}");
                let mut txn = Txn {
                    checks: vec![("sandboxes".into(), id.clone(), Expect::Absent)],
                    ops: vec![Op::Put {
                        ns: "sandboxes".into(),
                        key: id,
                        value: b"{}".to_vec(),
                        lease: None,
                    }],
                };
                q.add_to(&mut txn);
                a.txn(txn).await.map_err(IamError::Store)
            })
        })
        .collect();
    let mut ok = 0;
    for t in tasks {
        match t.await.expect("task") {
            Ok(_) => ok += 1,
            Err(IamError::QuotaExceeded { .. }) => {}
            Err(e) => panic!("a create lost a race or failed: {e}"),
        }
    }
    assert_eq!(ok, 10);
    assert_eq!(a.list("sandboxes").await.expect("list").0.len(), 10);
    assert_eq!(r.usage("locked").await.expect("usage").sandboxes, 10);
}

/// Expiry and the end of a rotation's grace follow the clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_expire_and_graces_end_on_time() {
    let (now, cfg) = shared_clock(5_000_000);
    let store: Store = Arc::new(MemStore::new());
    let r = Iam::with_config(store, cfg).await.expect("iam");
    r.create_tenant("clocked", Quotas::default())
        .await
        .expect("tenant");
    let short = r
        .create_key("clocked", "", &[Scope::Read], Some(5_001_000))
        .await
        .expect("key");
    let old = r
        .create_key("clocked", "", &[Scope::Read], None)
        .await
        .expect("key");
    let new = r
        .rotate_key(&old.info.key_id, Duration::from_secs(10))
        .await
        .expect("rotate");
    r.authenticate(&short.key).expect("not expired yet");
    now.fetch_add(1_000, Ordering::SeqCst);
    assert_eq!(r.authenticate(&short.key), Err(IamError::Unauthenticated));
    r.authenticate(&old.key).expect("in its grace");
    now.fetch_add(9_000, Ordering::SeqCst);
    assert_eq!(r.authenticate(&old.key), Err(IamError::Unauthenticated));
    r.authenticate(&new.key).expect("the new key");
    assert!(matches!(
        r.rotate_key(&short.info.key_id, Duration::ZERO).await,
        Err(IamError::KeyRevoked(_))
    ));
}

/// After etcd restarts, each replica's watches resume: a revocation made then still
/// reaches the other replica within a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn revocation_after_an_etcd_restart_reaches_the_other_replica() {
    let test = "revocation_after_an_etcd_restart_reaches_the_other_replica";
    let Some(mut etcd) = dsec_testkit::Etcd::start(test) else {
        return;
    };
    let (a, b) = (etcd_store(&etcd).await, etcd_store(&etcd).await);
    let (ra, rb) = (iam(&a).await, iam(&b).await);
    ra.create_tenant("phoenix", Quotas::default())
        .await
        .expect("tenant");
    let k = ra
        .create_key("phoenix", "", &[Scope::Read], None)
        .await
        .expect("key");
    wait_until(Duration::from_secs(1), || async {
        rb.authenticate(&k.key).is_ok()
    })
    .await
    .expect("the key reached replica b");

    etcd.restart(0);
    // Revoke as soon as etcd answers again.
    let end = Instant::now() + Duration::from_secs(15);
    loop {
        match ra.revoke_key(&k.info.key_id).await {
            Ok(_) => break,
            Err(IamError::Store(StateError::Unavailable(_))) if Instant::now() < end => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("revoke: {e}"),
        }
    }
    let took = wait_until(Duration::from_secs(1), || async {
        rb.authenticate(&k.key).is_err()
    })
    .await;
    assert!(
        took.is_some(),
        "the revocation reached replica b within 1 s of the write"
    );
    // Still following afterwards.
    let k2 = ra
        .create_key("phoenix", "", &[Scope::Read], None)
        .await
        .expect("key");
    wait_until(Duration::from_secs(1), || async {
        rb.authenticate(&k2.key).is_ok()
    })
    .await
    .expect("a later key reached replica b");
}

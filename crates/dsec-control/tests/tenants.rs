//! Tenants on the control plane: quotas charged in the record's own transaction and
//! enforced across two replicas on one store (in memory and real etcd), the rate quota,
//! and isolation (another tenant's sandbox answers `not_found`, exactly as an unknown id,
//! and is left as it was).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dsec_control::{ControlConfig, ControlPlane, SandboxApi};
use dsec_iam::{Iam, IamConfig, Quotas, Usage};
use dsec_node_api::fake::{shell_request, FakeNode};
use dsec_node_api::NodeApi;
use dsec_state::{EtcdConfig, EtcdStore, MemStore, StateStore};
use dsec_testkit::Etcd;
use dsec_wire::v1::{
    CreateSandboxRequest, CreateSessionRequest, MkdirRequest, SandboxState, SetTimeoutRequest,
};
use dsec_wire::ErrorCode;

type TestResult = Result<(), Box<dyn std::error::Error>>;

mod common;
use common::tenant;

struct Pair {
    a: Arc<ControlPlane>,
    b: Arc<ControlPlane>,
    node: Arc<FakeNode>,
}

/// Two replicas over `store` and one fake node; each has its own IAM (as two API server
/// processes do), reading `clock` when given.
async fn pair(
    store: Arc<dyn StateStore>,
    clock: Option<Arc<AtomicU64>>,
) -> Result<Pair, Box<dyn std::error::Error>> {
    let node = Arc::new(FakeNode::new("fake-1"));
    let mut planes = Vec::new();
    for _ in 0..2 {
        let mut iam_cfg = IamConfig::new(Some("k".into()));
        if let Some(c) = &clock {
            let c = c.clone();
            iam_cfg.clock = Arc::new(move || c.load(Ordering::Relaxed));
        }
        let iam = Arc::new(Iam::with_config(store.clone(), iam_cfg).await?);
        let cfg = ControlConfig {
            sole_owner: false,
            reap_interval: Duration::from_millis(200),
            iam: Some(iam),
            ..ControlConfig::with_key("k".into())
        };
        planes.push(ControlPlane::open(cfg, node.clone(), store.clone()).await?);
    }
    let b = planes.pop().ok_or("no replica")?;
    let a = planes.pop().ok_or("no replica")?;
    Ok(Pair { a, b, node })
}

fn small() -> CreateSandboxRequest {
    let mut req = CreateSandboxRequest::default();
    req.resources.cpu = Some(0.5);
    req.resources.memory_mb = Some(64);
    req
}

/// 60 concurrent creates, half on each replica, against a quota of 20 sandboxes: exactly
/// 20 are admitted (records and node sandboxes), the other 40 are `quota_exceeded` and
/// leave nothing; deleting the 20 gives the usage back to zero.
async fn quota_race(p: &Pair) -> TestResult {
    p.a.iam()
        .create_tenant(
            "racer",
            Quotas {
                max_sandboxes: Some(20),
                ..Quotas::default()
            },
        )
        .await?;
    let caller = tenant("racer");
    let creates_before = p.node.counters.creates.load(Ordering::Relaxed);
    let tasks: Vec<_> = (0..60)
        .map(|i| {
            let plane = if i % 2 == 0 { p.a.clone() } else { p.b.clone() };
            let caller = caller.clone();
            tokio::spawn(async move { plane.create_sandbox(&caller, small()).await })
        })
        .collect();
    let mut admitted = Vec::new();
    let mut refused = 0;
    for t in tasks {
        match t.await? {
            Ok(sb) => admitted.push(sb),
            Err(e) if e.code == ErrorCode::QuotaExceeded => refused += 1,
            Err(e) => return Err(format!("unexpected create error: {e:?}").into()),
        }
    }
    assert_eq!(admitted.len(), 20, "exactly the quota is admitted");
    assert_eq!(refused, 40);
    assert_eq!(
        p.node.counters.creates.load(Ordering::Relaxed) - creates_before,
        20,
        "a refused create never reaches the node"
    );
    // Replica b lists from its cache, which the store's watch fills within a moment
    // (the other replica's creates included).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let listed = p.b.list_sandboxes(&caller, Default::default()).await?;
        if listed.sandboxes.len() == 20 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "b lists {} of the 20",
            listed.sandboxes.len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        p.a.iam().usage("racer").await?,
        Usage {
            sandboxes: 20,
            cpu_millis: 20 * 500,
            memory_mb: 20 * 64,
        }
    );
    // Full: one more is refused on either replica.
    for plane in [&p.a, &p.b] {
        let e = plane
            .create_sandbox(&caller, small())
            .await
            .expect_err("over quota");
        assert_eq!(e.code, ErrorCode::QuotaExceeded, "{e:?}");
    }
    let deletes: Vec<_> = admitted
        .iter()
        .enumerate()
        .map(|(i, sb)| {
            let plane = if i % 2 == 0 { p.b.clone() } else { p.a.clone() };
            let (caller, id) = (caller.clone(), sb.id.clone());
            tokio::spawn(async move { plane.delete_sandbox(&caller, &id).await })
        })
        .collect();
    for d in deletes {
        d.await??;
    }
    assert_eq!(p.a.iam().usage("racer").await?, Usage::default());
    assert!(
        p.node.sandbox_ids().is_empty(),
        "{:?}",
        p.node.sandbox_ids()
    );
    // Room again.
    let sb = p.b.create_sandbox(&caller, small()).await?;
    p.a.delete_sandbox(&caller, &sb.id).await?;
    assert_eq!(p.b.iam().usage("racer").await?, Usage::default());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_race_across_replicas_in_memory() -> TestResult {
    quota_race(&pair(Arc::new(MemStore::new()), None).await?).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_race_across_replicas_through_etcd() -> TestResult {
    let Some(etcd) = Etcd::start("quota_race_across_replicas_through_etcd") else {
        return Ok(());
    };
    let store = EtcdStore::connect(EtcdConfig::new(etcd.endpoints(), "/dsec-test/quota")).await?;
    quota_race(&pair(Arc::new(store), None).await?).await
}

/// The creates-per-second bucket (2/s, burst 2), on a clock the test moves: a burst,
/// then one create per half second, never more than the burst after a long pause; a
/// refusal names the rate quota and creates nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rate_quota_holds_across_replicas() -> TestResult {
    let clock = Arc::new(AtomicU64::new(1_000_000));
    let p = pair(Arc::new(MemStore::new()), Some(clock.clone())).await?;
    p.a.iam()
        .create_tenant(
            "rated",
            Quotas {
                creates_per_second: Some(2),
                creates_burst: Some(2),
                ..Quotas::default()
            },
        )
        .await?;
    let caller = tenant("rated");
    let burst = |n: usize| {
        let (a, b, caller) = (p.a.clone(), p.b.clone(), caller.clone());
        async move {
            let tasks: Vec<_> = (0..n)
                .map(|i| {
                    let plane = if i % 2 == 0 { a.clone() } else { b.clone() };
                    let caller = caller.clone();
                    tokio::spawn(async move { plane.create_sandbox(&caller, small()).await })
                })
                .collect();
            let mut ok = 0;
            for t in tasks {
                match t.await.map_err(|e| e.to_string())? {
                    Ok(_) => ok += 1,
                    Err(e) if e.code == ErrorCode::QuotaExceeded => {
                        assert!(e.message.contains("creates_per_second"), "{e:?}");
                    }
                    Err(e) => return Err(format!("{e:?}")),
                }
            }
            Ok::<usize, String>(ok)
        }
    };
    let before = p.node.counters.creates.load(Ordering::Relaxed);
    assert_eq!(burst(6).await?, 2, "the burst");
    clock.fetch_add(500, Ordering::Relaxed);
    assert_eq!(burst(3).await?, 1, "one token in half a second at 2/s");
    clock.fetch_add(60_000, Ordering::Relaxed);
    assert_eq!(burst(5).await?, 2, "a long pause refills only the burst");
    assert_eq!(p.node.counters.creates.load(Ordering::Relaxed) - before, 5);
    assert_eq!(p.a.iam().usage("rated").await?.sandboxes, 5);
    Ok(())
}

/// Every call of tenant B on tenant A's sandbox answers `not_found` with the words an
/// unknown id gets, and changes nothing; B's list does not show it; B's keyed create with
/// A's idempotency key makes B's own sandbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tenants_sandbox_is_not_found_and_untouched() -> TestResult {
    let p = pair(Arc::new(MemStore::new()), None).await?;
    for t in ["alice", "bob"] {
        p.a.iam().create_tenant(t, Quotas::default()).await?;
    }
    let (alice, bob) = (tenant("alice"), tenant("bob"));
    let req = CreateSandboxRequest {
        idempotency_key: Some("shared-key".into()),
        labels: [("job".to_string(), "j1".to_string())].into(),
        ..small()
    };
    let sb = p.a.create_sandbox(&alice, req.clone()).await?;
    assert_eq!(sb.tenant, "alice");
    let before = p.a.get_sandbox(&alice, &sb.id).await?;
    let destroys = p.node.counters.destroys.load(Ordering::Relaxed);
    for plane in [&p.a, &p.b] {
        for id in [sb.id.as_str(), "sb-guessed00000"] {
            let unknown = format!("sandbox {id} not found");
            let calls: Vec<(&str, Result<(), dsec_wire::ApiError>)> = vec![
                ("get", plane.get_sandbox(&bob, id).await.map(drop)),
                (
                    "exec",
                    plane
                        .exec(&bob, id, shell_request("touch /x"))
                        .await
                        .map(drop),
                ),
                (
                    "exec_stream",
                    plane
                        .exec_stream(&bob, id, shell_request("true"))
                        .await
                        .map(drop),
                ),
                (
                    "read_file",
                    plane
                        .read_file(&bob, id, "/etc/hostname", 0, None)
                        .await
                        .map(drop),
                ),
                (
                    "write_file",
                    plane
                        .write_file(
                            &bob,
                            id,
                            "/x",
                            None,
                            dsec_node_api::once_bytes(b"x".to_vec()),
                            None,
                        )
                        .await
                        .map(drop),
                ),
                (
                    "list_files",
                    plane.list_files(&bob, id, "/").await.map(drop),
                ),
                (
                    "mkdir",
                    plane
                        .mkdir(&bob, id, MkdirRequest { path: "/d".into() })
                        .await
                        .map(drop),
                ),
                (
                    "download_tar",
                    plane.download_tar(&bob, id, "/").await.map(drop),
                ),
                (
                    "create_session",
                    plane
                        .create_session(&bob, id, CreateSessionRequest::default())
                        .await
                        .map(drop),
                ),
                (
                    "list_processes",
                    plane.list_processes(&bob, id).await.map(drop),
                ),
                ("pause", plane.pause_sandbox(&bob, id).await.map(drop)),
                ("resume", plane.resume_sandbox(&bob, id).await.map(drop)),
                (
                    "set_timeout",
                    plane
                        .set_timeout(&bob, id, SetTimeoutRequest { timeout_s: 5 })
                        .await
                        .map(drop),
                ),
                ("delete", plane.delete_sandbox(&bob, id).await),
            ];
            for (what, res) in calls {
                let e = res.expect_err(what);
                assert_eq!(e.code, ErrorCode::NotFound, "{what} on {id}: {e:?}");
                assert_eq!(
                    e.message, unknown,
                    "{what} on {id}: same words as an unknown id"
                );
            }
        }
        let listed = plane.list_sandboxes(&bob, Default::default()).await?;
        assert!(listed.sandboxes.is_empty(), "{listed:?}");
        let job = plane.suspend_job(&bob, "j1").await?;
        assert!(job.sandboxes.is_empty(), "{job:?}");
    }
    let after = p.a.get_sandbox(&alice, &sb.id).await?;
    assert_eq!(after.state, SandboxState::Ready);
    assert_eq!(after.expires_at, before.expires_at);
    assert_eq!(p.node.counters.destroys.load(Ordering::Relaxed), destroys);
    let ran = p.b.exec(&alice, &sb.id, shell_request("true")).await?;
    assert_eq!(
        ran.exit.exit_code,
        Some(0),
        "alice still uses it, on either replica"
    );
    // Keys are per tenant: bob's create with alice's key is bob's own sandbox.
    let bobs = p.b.create_sandbox(&bob, req).await?;
    assert_ne!(bobs.id, sb.id);
    assert_eq!(bobs.tenant, "bob");
    let node_has = p.node.list().await?;
    assert!(node_has.iter().any(|s| s.id == sb.id));
    Ok(())
}

/// A sandbox whose lifetime its node ended gives its tenant's quota back when the reaper
/// turns it into an `expired` tombstone: the tenant can create again, and the usage
/// counts only what is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_sandbox_gives_its_quota_back() -> TestResult {
    let p = pair(Arc::new(MemStore::new()), None).await?;
    p.a.iam()
        .create_tenant(
            "short",
            Quotas {
                max_sandboxes: Some(2),
                ..Quotas::default()
            },
        )
        .await?;
    let caller = tenant("short");
    let brief = CreateSandboxRequest {
        timeout_s: Some(60),
        ..small()
    };
    let ending = p.a.create_sandbox(&caller, brief).await?;
    let staying = p.b.create_sandbox(&caller, small()).await?;
    let e =
        p.a.create_sandbox(&caller, small())
            .await
            .expect_err("full");
    assert_eq!(e.code, ErrorCode::QuotaExceeded);
    // The node's clock passes the first one's lifetime; its reaper ends it.
    assert_eq!(
        p.node.advance(Duration::from_secs(61)),
        vec![ending.id.clone()]
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match p.b.get_sandbox(&caller, &ending.id).await {
            Err(e) if e.code == ErrorCode::Expired => break,
            other => assert!(
                tokio::time::Instant::now() < deadline,
                "still {other:?}: the reaper records the end"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        p.a.iam().usage("short").await?,
        Usage {
            sandboxes: 1,
            cpu_millis: 500,
            memory_mb: 64,
        },
        "the expired sandbox's share is given back once"
    );
    let again = p.a.create_sandbox(&caller, small()).await?;
    for id in [&staying.id, &again.id] {
        p.b.delete_sandbox(&caller, id).await?;
    }
    assert_eq!(p.a.iam().usage("short").await?, Usage::default());
    Ok(())
}

/// Sandboxes a tenant created while it had no quotas charged nothing. Once a quota is
/// set, the reaper counts them (on whichever replica gets there first, once), so the
/// quota holds against what runs, and their deletes give their share back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxes_from_before_a_quota_count_against_it() -> TestResult {
    let p = pair(Arc::new(MemStore::new()), None).await?;
    p.a.iam().create_tenant("late", Quotas::default()).await?;
    let caller = tenant("late");
    let mut made = Vec::new();
    for plane in [&p.a, &p.b, &p.a] {
        made.push(plane.create_sandbox(&caller, small()).await?);
    }
    assert_eq!(
        p.a.iam().usage("late").await?,
        Usage::default(),
        "without quotas nothing is charged"
    );
    let quotas = Quotas {
        max_sandboxes: Some(3),
        ..Quotas::default()
    };
    p.a.iam().set_quotas("late", quotas.clone()).await?;
    let usage = |n: u64| Usage {
        sandboxes: n,
        cpu_millis: n * 500,
        memory_mb: n * 64,
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while p.a.iam().usage("late").await? != usage(3) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the reaper counts the 3 running sandboxes: {:?}",
            p.a.iam().usage("late").await?
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Both replicas' passes run on: each sandbox stays counted once.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(p.a.iam().usage("late").await?, usage(3));
    // Once replica b knows the quota, the tenant is full there too.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while p.b.iam().cached_tenant("late").map(|t| t.quotas) != Some(quotas.clone()) {
        assert!(tokio::time::Instant::now() < deadline, "b sees the quota");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let e =
        p.b.create_sandbox(&caller, small())
            .await
            .expect_err("full");
    assert_eq!(e.code, ErrorCode::QuotaExceeded);
    p.b.delete_sandbox(&caller, &made[0].id).await?;
    assert_eq!(
        p.a.iam().usage("late").await?,
        usage(2),
        "its share is given back"
    );
    let again = p.b.create_sandbox(&caller, small()).await?;
    assert_eq!(p.a.iam().usage("late").await?, usage(3));
    for sb in made.iter().skip(1).chain([&again]) {
        p.a.delete_sandbox(&caller, &sb.id).await?;
    }
    assert_eq!(p.a.iam().usage("late").await?, usage(0));
    assert!(p.node.sandbox_ids().is_empty());
    Ok(())
}

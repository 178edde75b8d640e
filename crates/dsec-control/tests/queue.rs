//! The capacity queue over a `FakeNode` with a sandbox limit: creates that name `queue`
//! wait for room instead of failing, high before low, tenants in turn (one tenant's
//! flood does not starve the others), a wait that runs out answers `capacity`, `GET
//! /v1/queue` shows the levels; and in a warm pool, a low claim never grows the pool.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dsec_control::{ControlPlane, Principal, SandboxApi};
use dsec_wire::v1::{
    AutoscalePolicy, CreateSandboxRequest, EventQuery, PoolSpec, Priority, QueueOptions,
};
use dsec_wire::ErrorCode;

mod common;
use common::{op, tenant_on, Fixture};

fn queued(priority: Priority, max_wait_s: f64) -> CreateSandboxRequest {
    CreateSandboxRequest {
        queue: Some(QueueOptions {
            priority,
            max_wait_s: Some(max_wait_s),
        }),
        ..Default::default()
    }
}

async fn waiting(plane: &ControlPlane, want: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let q = plane.queue_status(op()).await.expect("queue");
        let n: u32 = q.levels.iter().map(|l| l.waiting).sum();
        if n >= want {
            return;
        }
        assert!(Instant::now() < deadline, "never {want} waiting: {q:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn high_goes_before_low_and_a_wait_that_runs_out_is_capacity() {
    let fx = Fixture::new().await;
    let plane = fx.plane.clone();
    fx.node.set_max_sandboxes(2);
    let mut live = Vec::new();
    for _ in 0..2 {
        live.push(
            plane
                .create_sandbox(op(), CreateSandboxRequest::default())
                .await
                .expect("fill")
                .id,
        );
    }
    // Without a queue, a full node refuses at once.
    let e = plane
        .create_sandbox(op(), CreateSandboxRequest::default())
        .await
        .expect_err("full");
    assert_eq!(e.code, ErrorCode::Capacity);
    // With a short wait: `capacity` when it runs out, and an event says so.
    let mut timeouts = plane
        .events(
            op(),
            EventQuery {
                kind: Some("queue_timed_out".into()),
                ..Default::default()
            },
        )
        .await
        .expect("events");
    let t = Instant::now();
    let e = plane
        .create_sandbox(op(), queued(Priority::Medium, 0.3))
        .await
        .expect_err("full");
    assert_eq!(e.code, ErrorCode::Capacity, "{e:?}");
    assert!(e.message.contains("max_wait_s"), "{e:?}");
    let seen = common::events_until(&mut timeouts, |_| true).await;
    let cause = seen[0].cause.clone().unwrap_or_default();
    assert!(
        cause.contains("waited 0.3 s for capacity at priority medium"),
        "{seen:?}"
    );
    assert_eq!(seen[0].tenant.as_deref(), Some("default"));
    assert!(
        t.elapsed() >= Duration::from_millis(300),
        "{:?}",
        t.elapsed()
    );

    let served: Arc<Mutex<Vec<(Priority, String)>>> = Arc::default();
    let mut tasks = Vec::new();
    for (i, p) in [Priority::Low; 4]
        .into_iter()
        .chain([Priority::High; 4])
        .enumerate()
    {
        let (pl, served) = (plane.clone(), served.clone());
        tasks.push(tokio::spawn(async move {
            let sb = pl
                .create_sandbox(op(), queued(p, 60.0))
                .await
                .expect("served");
            served.lock().expect("lock").push((p, sb.id));
        }));
        if i == 3 {
            waiting(&plane, 4).await; // the lows wait first
        }
    }
    waiting(&plane, 8).await;
    let q = plane.queue_status(op()).await.expect("queue");
    let by = |p: Priority| q.levels.iter().find(|l| l.priority == p).map(|l| l.waiting);
    assert_eq!(
        (by(Priority::High), by(Priority::Medium), by(Priority::Low)),
        (Some(4), Some(0), Some(4)),
        "{q:?}"
    );
    // Room for one at a time: each delete lets the next waiter in.
    let mut freed = 0;
    while served.lock().expect("lock").len() < 8 {
        let id = live.pop().expect("something to delete");
        plane.delete_sandbox(op(), &id).await.expect("delete");
        freed += 1;
        let want = freed;
        let deadline = Instant::now() + Duration::from_secs(10);
        while served.lock().expect("lock").len() < want {
            assert!(
                Instant::now() < deadline,
                "nobody was served after a delete"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let newest = served
            .lock()
            .expect("lock")
            .last()
            .map(|(_, id)| id.clone());
        live.extend(newest);
    }
    for t in tasks {
        t.await.expect("task");
    }
    let order: Vec<Priority> = served
        .lock()
        .expect("lock")
        .iter()
        .map(|(p, _)| *p)
        .collect();
    assert_eq!(
        order,
        [[Priority::High; 4], [Priority::Low; 4]].concat(),
        "high always before low"
    );
    let q = plane.queue_status(op()).await.expect("queue");
    let served_at = |p: Priority| q.levels.iter().find(|l| l.priority == p).map(|l| l.served);
    assert_eq!(
        (served_at(Priority::High), served_at(Priority::Low)),
        (Some(4), Some(4))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_tenants_flood_does_not_starve_the_others() {
    let fx = Fixture::new().await;
    let plane = fx.plane.clone();
    let (a, b, c) = (
        tenant_on(&plane, "flood").await,
        tenant_on(&plane, "calm-b").await,
        tenant_on(&plane, "calm-c").await,
    );
    fx.node.set_max_sandboxes(2);
    let mut fillers = Vec::new();
    for _ in 0..2 {
        fillers.push(
            plane
                .create_sandbox(op(), CreateSandboxRequest::default())
                .await
                .expect("fill")
                .id,
        );
    }
    // Each served create holds its room for 20 ms, then gives it back.
    let waits: Arc<Mutex<Vec<(String, f64)>>> = Arc::default();
    let spawn =
        |who: Principal, plane: Arc<ControlPlane>, waits: Arc<Mutex<Vec<(String, f64)>>>| {
            tokio::spawn(async move {
                let t = Instant::now();
                let sb = plane
                    .create_sandbox(&who, queued(Priority::Medium, 120.0))
                    .await
                    .expect("served");
                waits
                    .lock()
                    .expect("lock")
                    .push((who.tenant.clone(), t.elapsed().as_secs_f64() * 1000.0));
                tokio::time::sleep(Duration::from_millis(20)).await;
                plane.delete_sandbox(&who, &sb.id).await.expect("delete");
            })
        };
    let mut tasks = Vec::new();
    for _ in 0..40 {
        tasks.push(spawn(a.clone(), plane.clone(), waits.clone()));
    }
    waiting(&plane, 40).await;
    for _ in 0..5 {
        tasks.push(spawn(b.clone(), plane.clone(), waits.clone()));
        tasks.push(spawn(c.clone(), plane.clone(), waits.clone()));
    }
    waiting(&plane, 50).await;
    // A non-admin key sees its own tenant's line only.
    let q = plane.queue_status(&b).await.expect("queue");
    let medium = q
        .levels
        .iter()
        .find(|l| l.priority == Priority::Medium)
        .expect("medium");
    assert_eq!(medium.waiting, 50, "{q:?}");
    assert!(medium.tenants.iter().all(|t| t.tenant == "calm-b"), "{q:?}");
    for id in fillers {
        plane.delete_sandbox(op(), &id).await.expect("delete");
    }
    for t in tasks {
        t.await.expect("task");
    }
    let waits = waits.lock().expect("lock").clone();
    let of = |name: &str| {
        let mut v: Vec<f64> = waits
            .iter()
            .filter(|(t, _)| t == name)
            .map(|(_, w)| *w)
            .collect();
        v.sort_by(f64::total_cmp);
        v
    };
    let (flood, calm) = (of("flood"), [of("calm-b"), of("calm-c")].concat());
    assert_eq!((flood.len(), calm.len()), (40, 10));
    let calm_max = calm.iter().copied().fold(0.0, f64::max);
    let flood_p50 = flood[flood.len() / 2];
    // Tenants take turns: the calm tenants' last create is served before half the
    // flood's, which came first.
    assert!(
        calm_max < flood_p50,
        "calm tenants waited up to {calm_max:.0} ms, the flood's median {flood_p50:.0} ms"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_low_claim_takes_spare_warm_sandboxes_but_never_grows_the_pool() {
    let fx = Fixture::new().await;
    let plane = fx.plane.clone();
    let spec = PoolSpec {
        name: "spare".into(),
        template: CreateSandboxRequest::default(),
        min: 0,
        max: 4,
        autoscale: AutoscalePolicy {
            window_s: 0.5,
            cooldown_s: 0.0,
            ..Default::default()
        },
        fncall: None,
    };
    plane.create_pool(op(), spec).await.expect("pool");
    let claim = |p: Priority, wait: f64| CreateSandboxRequest {
        pool: Some("spare".into()),
        queue: Some(QueueOptions {
            priority: p,
            max_wait_s: Some(wait),
        }),
        ..Default::default()
    };
    let e = plane
        .create_sandbox(op(), claim(Priority::Low, 1.0))
        .await
        .expect_err("no spare sandbox");
    assert_eq!(e.code, ErrorCode::Capacity, "{e:?}");
    let p = plane.get_pool(op(), "spare").await.expect("pool");
    assert_eq!(
        (p.target, p.size),
        (0, 0),
        "a low claim grew the pool: {p:?}"
    );
    // A medium claim grows it from zero; once warm sandboxes are spare, a low one takes one.
    plane
        .create_sandbox(op(), claim(Priority::Medium, 10.0))
        .await
        .expect("medium claim");
    plane
        .update_pool(
            op(),
            "spare",
            dsec_wire::v1::PoolUpdate {
                min: Some(2),
                ..Default::default()
            },
        )
        .await
        .expect("min 2");
    let deadline = Instant::now() + Duration::from_secs(10);
    while plane.get_pool(op(), "spare").await.expect("pool").ready < 1 {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    plane
        .create_sandbox(op(), claim(Priority::Low, 5.0))
        .await
        .expect("low claim on spare capacity");
}

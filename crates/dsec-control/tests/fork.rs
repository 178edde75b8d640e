//! Fork on the control plane over a `FakeNode`: bad counts, a fork the tenant's quota
//! cannot hold (refused before anything is captured), and what forks carry over.

mod common;

use std::sync::atomic::Ordering;

use common::{tenant, Fixture};
use dsec_control::{Principal, SandboxApi, Scope};
use dsec_iam::Quotas;
use dsec_wire::v1::{CreateSandboxRequest, ForkRequest, FORK_OF_LABEL, MAX_FORKS};
use dsec_wire::{ApiError, ErrorCode};

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn small() -> CreateSandboxRequest {
    let mut req = CreateSandboxRequest::default();
    req.resources.cpu = Some(0.5);
    req.resources.memory_mb = Some(64);
    req.labels.insert("task".into(), "t1".into());
    req
}

#[tokio::test]
async fn forks_are_refused_up_front_when_the_count_or_the_quota_is_wrong() -> TestResult {
    let fx = Fixture::new().await;
    fx.plane
        .iam()
        .create_tenant(
            "grpo",
            Quotas {
                max_sandboxes: Some(4),
                ..Quotas::default()
            },
        )
        .await?;
    // Forking captures an image: the key needs both scopes.
    let caller = Principal {
        scopes: vec![Scope::Sandboxes, Scope::Images],
        ..tenant("grpo")
    };
    let src = fx.plane.create_sandbox(&caller, small()).await?;
    let fork = |count: u32| ForkRequest {
        count,
        ..ForkRequest::default()
    };

    for bad in [0, MAX_FORKS + 1] {
        let e = fx
            .plane
            .fork_sandbox(&caller, &src.id, fork(bad))
            .await
            .expect_err("bad count");
        assert_eq!(e.code, ErrorCode::BadRequest, "{e:?}");
    }
    // 1 runs, the quota is 4: a fork into 4 cannot fit and captures nothing.
    let commits = fx.node.counters.commits.load(Ordering::Relaxed);
    let creates = fx.node.counters.creates.load(Ordering::Relaxed);
    let e = fx
        .plane
        .fork_sandbox(&caller, &src.id, fork(4))
        .await
        .expect_err("over the quota");
    assert_eq!(e.code, ErrorCode::QuotaExceeded, "{e:?}");
    assert!(e.message.contains("fork into 4"), "{}", e.message);
    assert_eq!(fx.node.counters.commits.load(Ordering::Relaxed), commits);
    assert_eq!(fx.node.counters.creates.load(Ordering::Relaxed), creates);

    // One fork that cannot be made undoes the others: all or none.
    fx.node
        .fail_next_create(ApiError::new(ErrorCode::Capacity, "injected"));
    let e = fx
        .plane
        .fork_sandbox(&caller, &src.id, fork(3))
        .await
        .expect_err("one create failed");
    assert_eq!(e.code, ErrorCode::Capacity, "{e:?}");
    assert!(e.message.contains("none is kept"), "{}", e.message);
    assert_eq!(fx.node.sandbox_ids(), vec![src.id.clone()]);
    assert_eq!(fx.plane.iam().usage("grpo").await?.sandboxes, 1);

    // A fork into 3 fits: the forks carry the source's files, labels and size.
    fx.plane
        .write_file(
            &caller,
            &src.id,
            "/w/prepared",
            None,
            dsec_node_api::once_bytes(b"state".to_vec()),
            None,
        )
        .await?;
    let forked = fx.plane.fork_sandbox(&caller, &src.id, fork(3)).await?;
    assert_eq!(forked.sandboxes.len(), 3);
    // One capture each: the undone fork's and this one's.
    assert_eq!(
        fx.node.counters.commits.load(Ordering::Relaxed),
        commits + 2
    );
    for f in &forked.sandboxes {
        assert_eq!(f.labels.get(FORK_OF_LABEL), Some(&src.id));
        assert_eq!(f.labels.get("task").map(String::as_str), Some("t1"));
        assert_eq!(f.resources.memory_mb, 64);
        assert_eq!(f.image, forked.image);
        let files = fx.node.sandbox_files(&f.id).ok_or("fork's files")?;
        assert_eq!(
            files.get("/w/prepared").map(Vec::as_slice),
            Some(&b"state"[..])
        );
    }
    // Now full: even a fork into 1 is refused.
    let e = fx
        .plane
        .fork_sandbox(&caller, &src.id, fork(1))
        .await
        .expect_err("full");
    assert_eq!(e.code, ErrorCode::QuotaExceeded, "{e:?}");
    // Another tenant cannot fork it at all.
    let other = common::tenant_on(&fx.plane, "other").await;
    let e = fx
        .plane
        .fork_sandbox(&other, &src.id, fork(1))
        .await
        .expect_err("not theirs");
    assert_eq!(e.code, ErrorCode::NotFound, "{e:?}");
    Ok(())
}

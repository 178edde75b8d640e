//! Warm pools: time to interactive (create -> `exec true` done) when the create claims a
//! warm sandbox of a pool, against a cold create, on one server in one run; and the
//! claim's own round trip against `GET /v1/health`'s (the HTTP floor), so that the
//! difference is the server's time for a claim.

use std::time::{Duration, Instant};

use anyhow::bail;
use dsec_e2e::Server;
use dsec_wire::v1::{AutoscalePolicy, CreateSandboxRequest, PoolSpec};

use crate::{argv_true, on_one_thread, Stats};

/// The rows: claim + exec, cold create + exec, claim alone, health alone (claims back to
/// back, the pool refilling meanwhile), then claim alone and health alone on a node at
/// rest.
pub async fn claim_vs_cold(server: &Server, n: usize) -> anyhow::Result<Vec<Stats>> {
    let c = server.client();
    let spec = PoolSpec {
        name: "bench-pool".into(),
        template: CreateSandboxRequest::default(),
        min: n as u32 + 2,
        max: n as u32 + 2,
        autoscale: AutoscalePolicy::default(),
        fncall: None,
    };
    let _ = c.delete_pool(&spec.name).await;
    c.create_pool(&spec).await?;
    let warm = |want: u32| {
        let c = c.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(300);
            loop {
                let p = c.get_pool("bench-pool").await?;
                if p.ready >= want {
                    return anyhow::Ok(());
                }
                if Instant::now() > deadline {
                    bail!("the pool never had {want} warm sandboxes: {p:?}");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    warm(n as u32 + 2).await?;
    let (claim_exec, claim_only, health, cold) = on_one_thread(c.clone(), move |c| async move {
        let (mut claim_exec, mut claim_only, mut health, mut cold) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut claimed = Vec::new();
        for _ in 0..n {
            let t = Instant::now();
            c.health().await?;
            health.push(t.elapsed().as_secs_f64() * 1000.0);
            let t = Instant::now();
            let sb = c
                .create_sandbox(CreateSandboxRequest {
                    pool: Some("bench-pool".into()),
                    ..Default::default()
                })
                .await?;
            claim_only.push(t.elapsed().as_secs_f64() * 1000.0);
            let r = c.exec(&sb.id, argv_true()).await?;
            claim_exec.push(t.elapsed().as_secs_f64() * 1000.0);
            if r.exit.exit_code != Some(0) {
                bail!("exec true failed: {r:?}");
            }
            claimed.push(sb.id);
        }
        for _ in 0..n {
            let t = Instant::now();
            let sb = c.create_sandbox(CreateSandboxRequest::default()).await?;
            let r = c.exec(&sb.id, argv_true()).await?;
            cold.push(t.elapsed().as_secs_f64() * 1000.0);
            if r.exit.exit_code != Some(0) {
                bail!("exec true failed: {r:?}");
            }
            c.delete_sandbox(&sb.id).await?;
        }
        for id in claimed {
            c.delete_sandbox(&id).await?;
        }
        Ok((claim_exec, claim_only, health, cold))
    })?;
    // Claims one at a time on a node at rest: each waits for the pool's refill of the
    // last to be done, so the claim's own server time shows, not a refill's create
    // sharing the cores.
    warm(n as u32 + 2).await?;
    let (spaced, spaced_health) = on_one_thread(c.clone(), move |c| async move {
        let (mut spaced, mut health) = (Vec::new(), Vec::new());
        let mut claimed = Vec::new();
        for _ in 0..n {
            let deadline = Instant::now() + Duration::from_secs(30);
            while c.get_pool("bench-pool").await?.creating > 0 && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            let t = Instant::now();
            c.health().await?;
            health.push(t.elapsed().as_secs_f64() * 1000.0);
            let t = Instant::now();
            let sb = c
                .create_sandbox(CreateSandboxRequest {
                    pool: Some("bench-pool".into()),
                    ..Default::default()
                })
                .await?;
            spaced.push(t.elapsed().as_secs_f64() * 1000.0);
            claimed.push(sb.id);
        }
        for id in claimed {
            c.delete_sandbox(&id).await?;
        }
        Ok((spaced, health))
    })?;
    c.delete_pool("bench-pool").await?;
    Ok(vec![
        Stats {
            name: "dsec create + exec true".into(),
            samples: cold,
            note: Some("cold: a new sandbox per create".into()),
        },
        Stats {
            name: "pool claim + exec true".into(),
            samples: claim_exec,
            note: Some("a warm sandbox of a pool".into()),
        },
        Stats {
            name: "pool claim alone".into(),
            samples: claim_only,
            note: Some("POST /v1/sandboxes {pool}".into()),
        },
        Stats {
            name: "GET /v1/health".into(),
            samples: health,
            note: Some("the HTTP round trip floor".into()),
        },
        Stats {
            name: "pool claim alone, node at rest".into(),
            samples: spaced,
            note: Some("one claim at a time, after the last refill".into()),
        },
        Stats {
            name: "GET /v1/health, node at rest".into(),
            samples: spaced_health,
            note: Some("the floor, measured beside those claims".into()),
        },
    ])
}

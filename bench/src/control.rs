//! The control plane alone (issue #25): creates through `ControlPlane` replicas onto an
//! in-process `FakeNode` (sandboxes that cost nothing), so what is measured is the
//! control plane and its state store. Two replicas over one real etcd (the cluster) and,
//! in the same run, one plane over redb (`dsec serve`'s store) as the baseline: keyed
//! creates (an idempotency key each, as a trainer sends them) with 64 in flight, their
//! sustained rate, latency, and the store writes each create and delete costs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dsec_control::{ControlConfig, ControlPlane, SandboxApi};
use dsec_node_api::fake::FakeNode;
use dsec_state::{EtcdConfig, EtcdStore, RedbStore, StateStore};
use dsec_wire::v1::CreateSandboxRequest;
use futures::StreamExt;

use crate::{record, Stats};

const IN_FLIGHT: usize = 64;

/// The store's current revision (every write moves it by one).
async fn revision(store: &dyn StateStore) -> anyhow::Result<u64> {
    Ok(store.list("bench-revision").await?.1)
}

struct Row {
    name: &'static str,
    rate: f64,
    latency: Stats,
    writes_per_create: f64,
    writes_per_delete: f64,
}

async fn run(
    name: &'static str,
    store: Arc<dyn StateStore>,
    replicas: usize,
    n: usize,
) -> anyhow::Result<Row> {
    let node = Arc::new(FakeNode::new("sim"));
    let cfg = ControlConfig {
        sole_owner: replicas == 1,
        // Lifetimes are the node's; the pass has nothing to do here.
        reap_interval: Duration::from_secs(3600),
        ..ControlConfig::with_key("bench".into())
    };
    let mut planes = Vec::new();
    for _ in 0..replicas {
        planes.push(ControlPlane::open(cfg.clone(), node.clone(), store.clone()).await?);
    }
    let before = revision(store.as_ref()).await?;
    let start = Instant::now();
    let results: Vec<anyhow::Result<(String, f64)>> = futures::stream::iter(0..n)
        .map(|i| {
            let plane = planes[i % replicas].clone();
            async move {
                let t = Instant::now();
                let sb = plane
                    .create_sandbox(CreateSandboxRequest {
                        idempotency_key: Some(format!("{name}-{i}")),
                        ..Default::default()
                    })
                    .await
                    .map_err(|e| anyhow::anyhow!("create: {}", e.message))?;
                Ok((sb.id, t.elapsed().as_secs_f64() * 1000.0))
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .collect()
        .await;
    let elapsed = start.elapsed().as_secs_f64();
    let mut ids = Vec::new();
    let mut samples = Vec::new();
    for r in results {
        let (id, ms) = r?;
        ids.push(id);
        samples.push(ms);
    }
    let created = revision(store.as_ref()).await?;
    futures::stream::iter(ids.iter().enumerate())
        .map(|(i, id)| {
            let plane = planes[i % replicas].clone();
            async move { plane.delete_sandbox(id).await }
        })
        .buffer_unordered(IN_FLIGHT)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow::anyhow!("delete: {}", e.message))?;
    let deleted = revision(store.as_ref()).await?;
    Ok(Row {
        name,
        rate: n as f64 / elapsed,
        latency: Stats {
            name: name.into(),
            samples,
            note: None,
        },
        writes_per_create: (created - before) as f64 / n as f64,
        writes_per_delete: (deleted - created) as f64 / n as f64,
    })
}

/// Prints (and records) the control-plane table.
pub fn section(quick: bool) -> anyhow::Result<()> {
    let n = if quick { 1_000 } else { 4_000 };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        println!("\n## control plane alone: {n} keyed creates, {IN_FLIGHT} in flight, onto an in-process fake node\n");
        let dir = std::env::temp_dir().join("dsec-bench-control");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let redb: Arc<dyn StateStore> = Arc::new(RedbStore::open(&dir.join("state.redb"))?);
        let mut rows = vec![run("redb, 1 plane (dsec serve)", redb, 1, n).await?];
        match dsec_testkit::Etcd::start("bench-control-plane") {
            Some(etcd) => {
                let store: Arc<dyn StateStore> =
                    Arc::new(EtcdStore::connect(EtcdConfig::new(etcd.endpoints(), "/bench")).await?);
                rows.push(run("etcd, 2 replicas (cluster)", store, 2, n).await?);
            }
            None => println!("(etcd is not installed: the cluster row is missing)\n"),
        }
        let _ = std::fs::remove_dir_all(&dir);
        println!("| store | creates/s | p50 ms | p99 ms | store writes per create | per delete |");
        println!("|---|---|---|---|---|---|");
        let mut json = Vec::new();
        for r in &rows {
            println!(
                "| {} | {:.0} | {:.2} | {:.2} | {:.1} | {:.1} |",
                r.name,
                r.rate,
                r.latency.pct(50.0),
                r.latency.pct(99.0),
                r.writes_per_create,
                r.writes_per_delete
            );
            json.push(serde_json::json!({"store": r.name, "creates_per_s": r.rate,
                "p50_ms": r.latency.pct(50.0), "p99_ms": r.latency.pct(99.0),
                "writes_per_create": r.writes_per_create, "writes_per_delete": r.writes_per_delete}));
        }
        record("control plane alone", serde_json::Value::Array(json));
        Ok(())
    })
}

//! Creation throughput sustained over a fixed time, and teardown: delete latency and
//! what is left on the host afterwards.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dsec_client::Client;
use dsec_e2e::{host, Server};
use dsec_wire::v1::CreateSandboxRequest;

use crate::{Churn, Stats};

/// Runs create -> exec true -> delete in `workers` loops for `secs` seconds.
pub async fn sustained(server: &Server, workers: usize, secs: u64) -> Churn {
    sustained_on(|_| server.client(), workers, secs).await
}

/// [`sustained`] against any API: worker `i` uses the client `client(i)` makes (several
/// API servers of a cluster, one per worker in turn).
pub async fn sustained_on(client: impl Fn(usize) -> Client, workers: usize, secs: u64) -> Churn {
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let cpu = crate::HostCpu::now();
    let mut tasks = Vec::new();
    for i in 0..workers {
        let (c, stop) = (client(i), stop.clone());
        tasks.push(tokio::spawn(async move {
            let (mut cycles, mut errors) = (Vec::new(), BTreeMap::<String, usize>::new());
            while !stop.load(Ordering::Relaxed) {
                match crate::cycle(&c, CreateSandboxRequest::default()).await {
                    Ok(cy) => cycles.push(cy),
                    Err(e) => {
                        let why: String = format!("{e:#}").chars().take(160).collect();
                        *errors.entry(why).or_default() += 1;
                    }
                }
            }
            (cycles, errors)
        }));
    }
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.store(true, Ordering::Relaxed);
    let (mut all, mut errors) = (Vec::new(), BTreeMap::<String, usize>::new());
    for t in tasks {
        if let Ok((s, e)) = t.await {
            all.extend(s);
            for (why, k) in e {
                *errors.entry(why).or_default() += k;
            }
        }
    }
    let failed = errors.values().sum();
    let mut churn = Churn::new(
        format!("sustained c{workers}"),
        workers,
        all,
        failed,
        start.elapsed().as_secs_f64(),
        cpu.elapsed_ms(),
    );
    churn.errors = errors;
    churn
}

/// What a teardown run measured.
#[derive(Debug)]
pub struct Teardown {
    /// Delete latency.
    pub delete: Stats,
    /// Host mounts, cgroups and processes still naming a deleted sandbox.
    pub leftovers: usize,
    /// State directories of deleted sandboxes still present.
    pub dirs: usize,
}

/// Creates `n` sandboxes (each ran a command), deletes them one by one, timing each
/// delete, then scans the host for anything left of them.
pub async fn teardown(server: &Server, n: usize) -> anyhow::Result<Teardown> {
    let c = server.client();
    let mut ids = Vec::new();
    for _ in 0..n {
        let sb = c.create_sandbox(CreateSandboxRequest::default()).await?;
        c.exec(&sb.id, dsec_e2e::sh("echo hi > /tmp/x")).await?;
        ids.push(sb.id);
    }
    let mut samples = Vec::new();
    for id in &ids {
        let t = Instant::now();
        c.delete_sandbox(id).await?;
        samples.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    let mut leftovers = 0;
    let mut dirs = 0;
    for id in &ids {
        leftovers +=
            host::mounts(id).len() + host::cgroup_dirs(id).len() + host::processes(id).len();
        dirs += usize::from(server.state_dir.join("sandboxes").join(id).exists());
    }
    Ok(Teardown {
        delete: Stats {
            name: "delete".into(),
            samples,
            note: Some(format!("{n} sandboxes that each ran a command")),
        },
        leftovers,
        dirs,
    })
}

/// What a burst against a full node did.
#[derive(Debug)]
pub struct Backlog {
    /// Creates attempted at once.
    pub attempted: usize,
    /// Admitted.
    pub admitted: usize,
    /// Refused with `capacity`.
    pub refused: usize,
    /// Any other error.
    pub other: usize,
    /// Median time to a refusal, ms.
    pub refusal_p50_ms: f64,
    /// Records, mounts, cgroups or processes left after deleting the admitted ones.
    pub leftovers: usize,
}

/// A node admitting `cap` sandboxes gets `attempted` creates at once: the rest must be
/// refused cleanly (`capacity`, fast) and nothing may stay behind.
pub async fn backlog(main: &Server, cap: usize, attempted: usize) -> anyhow::Result<Backlog> {
    let s = Server::start_with(
        "bench-backlog",
        false,
        &[
            "--max-sandboxes",
            &cap.to_string(),
            "--cgroup-parent",
            "dsec-bench-backlog",
            "--disk-pool",
            "4",
        ],
    )
    .await?;
    s.ensure_base(Some(main)).await?;
    s.delete_all().await;
    let c = s.client();
    let results = futures::future::join_all((0..attempted).map(|_| {
        let c = c.clone();
        async move {
            let t = Instant::now();
            let r = c.create_sandbox(CreateSandboxRequest::default()).await;
            (r, t.elapsed().as_secs_f64() * 1000.0)
        }
    }))
    .await;
    let (mut admitted, mut refused, mut other) = (Vec::new(), Vec::new(), 0);
    for (r, ms) in results {
        match r {
            Ok(sb) => admitted.push(sb.id),
            Err(e) if e.code() == Some(dsec_wire::ErrorCode::Capacity) => refused.push(ms),
            Err(_) => other += 1,
        }
    }
    let listed = c.list_sandboxes(Default::default()).await?.sandboxes.len();
    for id in &admitted {
        c.delete_sandbox(id).await?;
    }
    let mut leftovers = listed.saturating_sub(admitted.len());
    for id in &admitted {
        leftovers +=
            host::mounts(id).len() + host::cgroup_dirs(id).len() + host::processes(id).len();
    }
    leftovers += c.list_sandboxes(Default::default()).await?.sandboxes.len();
    let refusal = Stats {
        name: "refusal".into(),
        samples: refused.clone(),
        note: None,
    };
    Ok(Backlog {
        attempted,
        admitted: admitted.len(),
        refused: refused.len(),
        other,
        refusal_p50_ms: refusal.pct(50.0),
        leftovers,
    })
}

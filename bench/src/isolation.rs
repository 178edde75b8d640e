//! What each isolation level costs (#28): time to interactive (create, then `exec
//! true`), the round trip of `exec true` in a live sandbox, and the host memory of an
//! idle sandbox (its cgroup's charge), for dsec's container, `oci` (runc) and `gvisor`
//! (runsc, on the platform the node detected), on one server. Rounds alternate between
//! the levels so all see the same machine; a level the node does not offer is left out
//! with its reason.

use std::time::Instant;

use anyhow::bail;
use dsec_e2e::Server;
use dsec_wire::v1::{CreateSandboxRequest, Isolation};

use crate::{argv_true, on_one_thread, Stats};

/// The levels the server offers, each with what the table calls it.
async fn levels(server: &Server) -> anyhow::Result<Vec<(Isolation, String)>> {
    let health = server.client().health().await?;
    let mut out = Vec::new();
    for level in [Isolation::Container, Isolation::Oci, Isolation::Gvisor] {
        match health.isolation.iter().find(|l| l.isolation == level) {
            Some(l) => out.push((
                level,
                match (&l.runtime, &l.platform) {
                    (_, Some(p)) => format!("{level:?} ({p})").to_lowercase(),
                    (Some(r), None) => format!(
                        "{} ({})",
                        format!("{level:?}").to_lowercase(),
                        r.rsplit('/').next().unwrap_or(r)
                    ),
                    (None, None) => format!("{level:?}").to_lowercase(),
                },
            )),
            None => {
                println!("isolation {level:?}: not offered by this node (runtime not installed)")
            }
        }
    }
    Ok(out)
}

/// Host memory the sandbox's cgroup holds (bytes), v1 or v2.
fn cgroup_memory(parent: &str, id: &str) -> Option<u64> {
    [
        format!("/sys/fs/cgroup/memory/{parent}/{id}/memory.usage_in_bytes"),
        format!("/sys/fs/cgroup/{parent}/{id}/memory.current"),
    ]
    .iter()
    .find_map(|p| std::fs::read_to_string(p).ok())
    .and_then(|s| s.trim().parse().ok())
}

/// `n` rounds per level: create + `exec true`, then 5 more `exec true`, then its
/// memory once idle; alternating levels.
pub async fn costs(base: &Server, n: usize) -> anyhow::Result<Vec<Stats>> {
    let parent = "dsec-bench-isolation";
    let server = Server::start_with(
        "bench-isolation",
        true,
        &["--cgroup-parent", parent, "--disk-pool", "4"],
    )
    .await?;
    server.ensure_base(Some(base)).await?;
    let levels = levels(&server).await?;
    let rounds = n + 1;
    let names: Vec<String> = levels.iter().map(|(_, name)| name.clone()).collect();
    let client = server.client();
    let per_level = on_one_thread(client, move |c| async move {
        let mut out: Vec<(Vec<f64>, Vec<f64>, Vec<f64>)> =
            levels.iter().map(|_| Default::default()).collect();
        for round in 0..rounds {
            for (i, (level, _)) in levels.iter().enumerate() {
                let t = Instant::now();
                let sb = c
                    .create_sandbox(CreateSandboxRequest {
                        isolation: *level,
                        ..Default::default()
                    })
                    .await?;
                let r = c.exec(&sb.id, argv_true()).await?;
                let tti = t.elapsed().as_secs_f64() * 1000.0;
                if r.exit.exit_code != Some(0) {
                    bail!("exec true failed at {level:?}: {r:?}");
                }
                let mut trips = Vec::new();
                for _ in 0..5 {
                    let t = Instant::now();
                    c.exec(&sb.id, argv_true()).await?;
                    trips.push(t.elapsed().as_secs_f64() * 1000.0);
                }
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                let mem = cgroup_memory(parent, &sb.id);
                c.delete_sandbox(&sb.id).await?;
                // The first round warms caches up.
                if round > 0 {
                    out[i].0.push(tti);
                    out[i].1.extend(trips);
                    if let Some(bytes) = mem {
                        out[i].2.push(bytes as f64 / (1 << 20) as f64);
                    }
                }
            }
        }
        Ok(out)
    })?;
    let mut rows = Vec::new();
    for (name, (tti, trips, mem)) in names.iter().zip(per_level) {
        let mem_note = match mem.is_empty() {
            true => "memory: no cgroup figure".to_string(),
            false => {
                let mut m = mem.clone();
                m.sort_by(f64::total_cmp);
                format!("idle memory p50 {:.1} MiB", m[m.len() / 2])
            }
        };
        rows.push(Stats {
            name: format!("create + exec true, {name}"),
            samples: tti,
            note: Some(mem_note),
        });
        rows.push(Stats {
            name: format!("exec true round trip, {name}"),
            samples: trips,
            note: None,
        });
    }
    Ok(rows)
}

//! The warm-pool autoscaler under a step load: claimers that each claim a sandbox, hold it
//! for a while and delete it, 1 of them, then 8 (the step up), then 1 again (the step
//! down). The pool's size, target and queue wait are sampled every 250 ms and drawn as an
//! SVG (`autoscale-trace-<target>ms.svg` beside the benchmark's JSON). Short policy windows (2 s
//! window and cooldown, 6 s idle window) make the whole trace fit in under a minute; the
//! rules are the production ones.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dsec_e2e::Server;
use dsec_wire::v1::{AutoscalePolicy, CreateSandboxRequest, PoolSpec, QueueOptions};

/// One sample.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    pub t_s: f64,
    pub claimers: usize,
    pub target: u32,
    pub size: u32,
    pub ready: u32,
    pub queue_length: u32,
    pub queue_wait_ms: f64,
}

/// Phases of the load: (seconds, claimers).
const STEPS: [(u64, usize); 3] = [(6, 1), (20, 8), (24, 1)];
/// How long a claimer holds its sandbox.
const HOLD: Duration = Duration::from_millis(400);

/// Runs the trace with the policy's wait target `target_ms`.
pub async fn trace(server: &Server, target_ms: u64) -> anyhow::Result<Vec<Sample>> {
    let c = server.client();
    let spec = PoolSpec {
        name: "bench-trace".into(),
        template: CreateSandboxRequest::default(),
        min: 1,
        max: 16,
        autoscale: AutoscalePolicy {
            window_s: 2.0,
            target_queue_wait_ms: target_ms,
            cooldown_s: 2.0,
            idle_window_s: 6.0,
            ..Default::default()
        },
        fncall: None,
    };
    let _ = c.delete_pool(&spec.name).await;
    c.create_pool(&spec).await?;
    while c.get_pool(&spec.name).await?.ready < 1 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let want = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = Vec::new();
    for i in 0..STEPS.iter().map(|s| s.1).max().unwrap_or(1) {
        let (c, want, stop) = (c.clone(), want.clone(), stop.clone());
        workers.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                if i >= want.load(Ordering::Relaxed) {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                let req = CreateSandboxRequest {
                    pool: Some("bench-trace".into()),
                    queue: Some(QueueOptions {
                        max_wait_s: Some(60.0),
                        ..Default::default()
                    }),
                    ..Default::default()
                };
                if let Ok(sb) = c.create_sandbox(req).await {
                    tokio::time::sleep(HOLD).await;
                    let _ = c.delete_sandbox(&sb.id).await;
                }
            }
        }));
    }
    let start = Instant::now();
    let mut samples = Vec::new();
    let mut phase_end = Duration::ZERO;
    for (secs, claimers) in STEPS {
        want.store(claimers, Ordering::Relaxed);
        phase_end += Duration::from_secs(secs);
        while start.elapsed() < phase_end {
            let p = c.get_pool("bench-trace").await?;
            samples.push(Sample {
                t_s: start.elapsed().as_secs_f64(),
                claimers,
                target: p.target,
                size: p.size,
                ready: p.ready,
                queue_length: p.queue_length,
                queue_wait_ms: p.queue_wait_ms,
            });
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        let _ = w.await;
    }
    c.delete_pool("bench-trace").await?;
    Ok(samples)
}

/// Prints a row every ~2 s, records the samples, and writes the SVG to `svg`.
pub fn report(samples: &[Sample], target_ms: u64, svg: &std::path::Path) -> anyhow::Result<()> {
    println!(
        "\n## warm pool autoscaler under a step load (1 -> 8 -> 1 claimers), wait target {target_ms} ms\n"
    );
    println!("| t (s) | claimers | target | size | ready | queue | queue wait (ms, window avg) |");
    println!("|---|---|---|---|---|---|---|");
    let mut next = 0.0;
    for s in samples {
        if s.t_s >= next {
            println!(
                "| {:.1} | {} | {} | {} | {} | {} | {:.0} |",
                s.t_s, s.claimers, s.target, s.size, s.ready, s.queue_length, s.queue_wait_ms
            );
            next += 2.0;
        }
    }
    crate::record(
        &format!("autoscaler trace, wait target {target_ms} ms"),
        serde_json::Value::Array(
            samples
                .iter()
                .map(|s| {
                    serde_json::json!({"t_s": s.t_s, "claimers": s.claimers, "target": s.target,
                        "size": s.size, "ready": s.ready, "queue_length": s.queue_length,
                        "queue_wait_ms": s.queue_wait_ms})
                })
                .collect(),
        ),
    );
    let t: Vec<f64> = samples.iter().map(|s| s.t_s).collect();
    let col = |f: &dyn Fn(&Sample) -> f64| samples.iter().map(f).collect::<Vec<f64>>();
    let panels = vec![
        crate::plot::TimePanel {
            title: "warm pool under a step load: size follows the load".into(),
            unit: "sandboxes / claimers".into(),
            series: vec![
                ("claimers (load)".into(), col(&|s| s.claimers as f64)),
                ("target".into(), col(&|s| f64::from(s.target))),
                ("size".into(), col(&|s| f64::from(s.size))),
                ("ready (warm)".into(), col(&|s| f64::from(s.ready))),
            ],
        },
        crate::plot::TimePanel {
            title: format!("queue wait of claims (the autoscaler's input; target {target_ms} ms)"),
            unit: "ms".into(),
            series: vec![
                (
                    "queue wait, window average".into(),
                    col(&|s| s.queue_wait_ms),
                ),
                ("target".into(), col(&|_| target_ms as f64)),
            ],
        },
    ];
    std::fs::write(svg, crate::plot::timeseries_svg(&t, &panels))?;
    println!("\nSVG: {}", svg.display());
    Ok(())
}

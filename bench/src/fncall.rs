//! Function calls: throughput and latency of one short program per call at concurrency
//! 1, 8 and 32, three ways in one run on one server: `POST /v1/fncall` on a pool made for
//! calls (a throw-away view of a warm sandbox per call), a fresh sandbox per call
//! (create, exec, delete), and exec in already-running sandboxes (no isolation between
//! calls: the floor). Programs: `true` (the platform's own cost per call),
//! `python3 -c 'print(1)'`, and a small C++ program
//! compiled and run (on the cpp image, when `DSEC_CPP_TAR` is there). Also the reset
//! between two calls (the teardown of a call's namespaces) and the set-up of a call's
//! view, as the agent measures them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use dsec_e2e::Server;
use dsec_wire::v1::{
    AutoscalePolicy, CreateSandboxRequest, ExecRequest, FnCallPolicy, FnCallRequest, FnCallStatus,
    PoolSpec,
};

/// What one call runs.
#[derive(Debug, Clone)]
pub struct Program {
    /// Row label.
    pub name: &'static str,
    /// The image it needs.
    pub image: &'static str,
    /// As an exec (a shell line).
    pub shell: String,
    /// As a call: code and language.
    pub code: String,
    pub language: &'static str,
}

/// The programs: `true` (what a call costs the platform itself), python always, C++
/// when the cpp image is there.
pub fn programs() -> Vec<Program> {
    let mut v = vec![Program {
        name: "sh: true",
        image: "base",
        shell: "true".into(),
        code: "true".into(),
        language: "sh",
    }];
    v.push(Program {
        name: "python3 -c 'print(1)'",
        image: "base",
        shell: "python3 -c 'print(1)'".into(),
        code: "print(1)".into(),
        language: "python",
    });
    if cpp_tar().exists() {
        let src = r#"#include <cstdio>
int main() { long s = 0; for (int i = 0; i < 1000; i++) s += i; std::printf("%ld\n", s); }"#;
        v.push(Program {
            name: "C++ compile + run",
            image: "cpp",
            shell: format!(
                "mkdir -p /tmp/b && cat > /tmp/b/m.cpp <<'EOF'\n{src}\nEOF\n\
                 g++ -std=c++17 -O2 -o /tmp/b/m /tmp/b/m.cpp && /tmp/b/m"
            ),
            code: src.into(),
            language: "cpp",
        });
    }
    v
}

fn cpp_tar() -> std::path::PathBuf {
    std::env::var_os("DSEC_CPP_TAR")
        .map(Into::into)
        .unwrap_or_else(|| "/var/cache/dsec/cpp-bookworm.tar".into())
}

/// Imports the cpp image once.
pub async fn ensure_cpp(server: &Server) -> anyhow::Result<()> {
    let c = server.client();
    if c.list_images()
        .await?
        .images
        .iter()
        .any(|i| i.name == "cpp")
    {
        return Ok(());
    }
    c.import_image(dsec_wire::v1::ImportImageRequest {
        name: "cpp".into(),
        source: cpp_tar().display().to_string(),
        flatten: false,
    })
    .await
    .context("importing the cpp image")?;
    Ok(())
}

/// One measured mode at one concurrency.
#[derive(Debug, Clone)]
pub struct Run {
    pub program: &'static str,
    pub mode: &'static str,
    pub concurrency: usize,
    pub calls_per_s: f64,
    pub latencies_ms: Vec<f64>,
}

/// Resets and set-ups of the calls measured (microseconds), by program and concurrency.
#[derive(Debug, Default, Clone)]
pub struct Phases {
    pub rows: Vec<PhaseRow>,
}

/// The phases of one program's calls at one concurrency.
#[derive(Debug, Default, Clone)]
pub struct PhaseRow {
    pub program: &'static str,
    pub concurrency: usize,
    pub teardown_us: Vec<f64>,
    pub setup_us: Vec<f64>,
}

/// Runs `calls` calls of `f` on `concurrency` workers; returns calls/s and latencies.
async fn drive<F, Fut>(concurrency: usize, calls: usize, f: F) -> anyhow::Result<(f64, Vec<f64>)>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send,
{
    let f = Arc::new(f);
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let (f, next) = (f.clone(), next.clone());
        workers.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= calls {
                    return anyhow::Ok(lat);
                }
                let t = Instant::now();
                f(i).await?;
                lat.push(t.elapsed().as_secs_f64() * 1000.0);
            }
        }));
    }
    let mut all = Vec::new();
    for w in workers {
        all.extend(w.await??);
    }
    let secs = started.elapsed().as_secs_f64();
    Ok((calls as f64 / secs, all))
}

async fn wait_ready(c: &dsec_client::Client, pool: &str, want: u32) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let p = c.get_pool(pool).await?;
        if p.ready >= want {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("pool {pool} never had {want} warm sandboxes: {p:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Measures `program` at each concurrency, the three ways.
pub async fn measure(
    server: &Server,
    program: &Program,
    levels: &[usize],
    calls_per_level: impl Fn(usize) -> usize,
) -> anyhow::Result<(Vec<Run>, Phases)> {
    let c = server.client();
    let max_c = levels.iter().copied().max().unwrap_or(1);
    let template = CreateSandboxRequest {
        image: Some(program.image.into()),
        ..Default::default()
    };
    let pool = format!("bench-fncall-{}", program.language);
    let _ = c.delete_pool(&pool).await;
    c.create_pool(&PoolSpec {
        name: pool.clone(),
        template: template.clone(),
        min: max_c as u32,
        max: max_c as u32,
        autoscale: AutoscalePolicy::default(),
        fncall: Some(FnCallPolicy::default()),
    })
    .await?;
    wait_ready(&c, &pool, max_c as u32).await?;
    // Running sandboxes for the exec rows (one per worker).
    let mut running = Vec::new();
    for _ in 0..max_c {
        running.push(c.create_sandbox(template.clone()).await?.id);
    }
    let running = Arc::new(running);
    let mut phases = Phases::default();
    let mut runs = Vec::new();
    for &level in levels {
        let row = Arc::new(std::sync::Mutex::new(PhaseRow {
            program: program.name,
            concurrency: level,
            ..Default::default()
        }));
        let calls = calls_per_level(level);
        // FnCall.
        let (cc, pool_name, prog, ph) = (c.clone(), pool.clone(), program.clone(), row.clone());
        let (rate, lat) = drive(level, calls, move |_| {
            let (c, pool, prog, ph) = (cc.clone(), pool_name.clone(), prog.clone(), ph.clone());
            async move {
                let mut req: FnCallRequest =
                    serde_json::from_value(serde_json::json!({"pool": pool}))?;
                req.code = Some(prog.code.clone());
                req.language = Some(prog.language.into());
                req.timeout_s = 60.0;
                req.compile_timeout_s = 60.0;
                req.max_wait_s = Some(600.0);
                let r = c.fncall(&req).await?;
                if r.status != FnCallStatus::Finished || r.exit_code != Some(0) {
                    bail!("call failed: {r:?}");
                }
                let mut p = ph.lock().unwrap_or_else(|e| e.into_inner());
                p.teardown_us.push(r.teardown_us as f64);
                p.setup_us.push(r.setup_us as f64);
                Ok(())
            }
        })
        .await?;
        phases
            .rows
            .push(row.lock().unwrap_or_else(|e| e.into_inner()).clone());
        runs.push(Run {
            program: program.name,
            mode: "fncall",
            concurrency: level,
            calls_per_s: rate,
            latencies_ms: lat,
        });
        // A fresh sandbox per call.
        let (cc, tpl, shell) = (c.clone(), template.clone(), program.shell.clone());
        let (rate, lat) = drive(level, calls, move |_| {
            let (c, tpl, shell) = (cc.clone(), tpl.clone(), shell.clone());
            async move {
                let sb = c.create_sandbox(tpl).await?;
                let r = c.exec(&sb.id, exec(&shell)).await;
                c.delete_sandbox(&sb.id).await?;
                let r = r?;
                if r.exit.exit_code != Some(0) {
                    bail!("exec failed: {r:?}");
                }
                Ok(())
            }
        })
        .await?;
        runs.push(Run {
            program: program.name,
            mode: "fresh sandbox",
            concurrency: level,
            calls_per_s: rate,
            latencies_ms: lat,
        });
        // Exec in running sandboxes.
        let (cc, ids, shell) = (c.clone(), running.clone(), program.shell.clone());
        let (rate, lat) = drive(level, calls, move |i| {
            let (c, id, shell) = (cc.clone(), ids[i % level].clone(), shell.clone());
            async move {
                let r = c.exec(&id, exec(&shell)).await?;
                if r.exit.exit_code != Some(0) {
                    bail!("exec failed: {r:?}");
                }
                Ok(())
            }
        })
        .await?;
        runs.push(Run {
            program: program.name,
            mode: "exec (no isolation)",
            concurrency: level,
            calls_per_s: rate,
            latencies_ms: lat,
        });
    }
    for id in running.iter() {
        let _ = c.delete_sandbox(id).await;
    }
    c.delete_pool(&pool).await?;
    Ok((runs, phases))
}

fn exec(shell: &str) -> ExecRequest {
    dsec_e2e::sh(shell)
}

fn pct(v: &[f64], p: f64) -> f64 {
    crate::Stats {
        name: String::new(),
        samples: v.to_vec(),
        note: None,
    }
    .pct(p)
}

/// Prints (and records) the throughput table and the reset line.
pub fn print(runs: &[Run], phases: &Phases) {
    let title = "function calls: throughput and latency (fncall vs a fresh sandbox vs exec)";
    println!("\n## {title}\n");
    println!(
        "| program | concurrency | mode | calls/s | p50 ms | p99 ms | calls/s vs fresh sandbox |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut json = Vec::new();
    for r in runs {
        let fresh = runs
            .iter()
            .find(|f| {
                f.program == r.program
                    && f.concurrency == r.concurrency
                    && f.mode == "fresh sandbox"
            })
            .map_or(f64::NAN, |f| f.calls_per_s);
        let (p50, p99) = (pct(&r.latencies_ms, 50.0), pct(&r.latencies_ms, 99.0));
        println!(
            "| {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.2}x |",
            r.program,
            r.concurrency,
            r.mode,
            r.calls_per_s,
            p50,
            p99,
            r.calls_per_s / fresh
        );
        json.push(serde_json::json!({
            "program": r.program, "concurrency": r.concurrency, "mode": r.mode,
            "calls_per_s": r.calls_per_s, "p50_ms": p50, "p99_ms": p99,
            "vs_fresh": r.calls_per_s / fresh,
        }));
    }
    crate::record(title, serde_json::Value::Array(json));
    println!("\nreset between calls (the teardown of a call's namespaces) and set-up of a call's view, as the agent measures them (target: reset p50 <= 2 ms)\n");
    println!(
        "| program | concurrency | reset p50 ms | reset p99 ms | set-up p50 ms | set-up p99 ms |"
    );
    println!("|---|---|---|---|---|---|");
    let mut json = Vec::new();
    for r in &phases.rows {
        let ms = |v: &[f64], p: f64| pct(v, p) / 1000.0;
        let row = (
            ms(&r.teardown_us, 50.0),
            ms(&r.teardown_us, 99.0),
            ms(&r.setup_us, 50.0),
            ms(&r.setup_us, 99.0),
        );
        println!(
            "| {} | {} | {:.2} | {:.2} | {:.2} | {:.2} |",
            r.program, r.concurrency, row.0, row.1, row.2, row.3
        );
        json.push(serde_json::json!({"program": r.program, "concurrency": r.concurrency,
            "reset_p50_ms": row.0, "reset_p99_ms": row.1, "setup_p50_ms": row.2, "setup_p99_ms": row.3}));
    }
    crate::record("function call reset", serde_json::Value::Array(json));
}

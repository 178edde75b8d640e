//! Density and preemption measurements (issue #6): CPU protection of a latency-sensitive
//! sandbox from best-effort ones, job suspend/resume with memory reclaim, and the host
//! cost of an idle sandbox.

use std::time::Instant;

use anyhow::{bail, Context};
use dsec_client::Client;
use dsec_e2e::{sh, Server};
use dsec_wire::v1::{
    Command, CreateSandboxRequest, CreateSessionRequest, Qos, StartProcessRequest, JOB_LABEL,
};

use crate::Stats;

/// A loop of 1 ms of CPU work then 1 ms of sleep; prints each step's time in ms.
const STEP_LOOP: &str = r#"
import json, time, sys
steps = []
for _ in range(int(sys.argv[1])):
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.001:
        pass
    time.sleep(0.001)
    steps.append((time.perf_counter() - t0) * 1000)
print(json.dumps(steps))
"#;

async fn step_times(c: &Client, id: &str, steps: usize) -> anyhow::Result<Vec<f64>> {
    let cmd = format!("python3 -c '{STEP_LOOP}' {steps}");
    let r = c.exec(id, sh(&cmd)).await?;
    if r.exit.exit_code != Some(0) {
        bail!("step loop failed: {r:?}");
    }
    serde_json::from_str(r.stdout.trim()).context("step loop output")
}

async fn hogs(c: &Client, qos: Qos, n: usize) -> anyhow::Result<Vec<String>> {
    let mut ids = Vec::new();
    for _ in 0..n {
        let sb = c
            .create_sandbox(CreateSandboxRequest {
                qos,
                ..Default::default()
            })
            .await?;
        c.start_process(
            &sb.id,
            StartProcessRequest {
                tag: Some("hog".into()),
                ..dsec_e2e::background(Command::Shell("while :; do :; done".into()))
            },
        )
        .await?;
        ids.push(sb.id);
    }
    Ok(ids)
}

/// Per-step time of a latency-sensitive loop alone, next to CPU hogs of equal class
/// (unprotected), and next to best-effort hogs (SCHED_IDLE + lowest weight).
pub async fn cpu_protection(server: &Server, steps: usize) -> anyhow::Result<Vec<Stats>> {
    let c = server.client();
    let cores = std::thread::available_parallelism()
        .map(|p| p.get())
        .unwrap_or(2);
    let ls = c.create_sandbox(CreateSandboxRequest::default()).await?;
    step_times(&c, &ls.id, 20).await?; // warm the interpreter's files
    let mut rows = vec![Stats {
        name: "alone".into(),
        samples: step_times(&c, &ls.id, steps).await?,
        note: Some("1 ms work + 1 ms sleep per step".into()),
    }];
    for (qos, name) in [
        (Qos::LatencySensitive, "unprotected: hogs latency_sensitive"),
        (Qos::BestEffort, "protected: hogs best_effort (SCHED_IDLE)"),
    ] {
        // Overcommitted, as a dense node is: four spinning sandboxes per core.
        let ids = hogs(&c, qos, 4 * cores).await?;
        rows.push(Stats {
            name: name.into(),
            samples: step_times(&c, &ls.id, steps).await?,
            note: Some(format!("{} sandboxes spinning ({cores} cores)", 4 * cores)),
        });
        for id in ids {
            c.delete_sandbox(&id).await?;
        }
    }
    c.delete_sandbox(&ls.id).await?;
    Ok(rows)
}

/// One row of the job table.
pub struct JobRow {
    pub sandboxes: usize,
    pub suspend_ms: f64,
    pub resume_ms: f64,
    pub memory_before: u64,
    pub memory_after: u64,
    pub exec_after_resume: Stats,
}

/// Suspends and resumes a job of `n` sandboxes that each hold 16 MiB of page cache.
pub async fn job_suspend_resume(server: &Server, n: usize) -> anyhow::Result<JobRow> {
    let c = server.client();
    let job = format!("bench-{}", std::process::id());
    let mut ids = Vec::new();
    for _ in 0..n {
        let sb = c
            .create_sandbox(CreateSandboxRequest {
                labels: [(JOB_LABEL.to_string(), job.clone())].into(),
                ..Default::default()
            })
            .await?;
        let r = c
            .exec(
                &sb.id,
                sh("dd if=/dev/zero of=/tmp/cache bs=1M count=16 conv=fsync status=none && cat /tmp/cache >/dev/null"),
            )
            .await?;
        if r.exit.exit_code != Some(0) {
            bail!("filling page cache failed: {r:?}");
        }
        ids.push(sb.id);
    }
    let t = Instant::now();
    let suspended = c.suspend_job(&job).await?;
    let suspend_ms = t.elapsed().as_secs_f64() * 1000.0;
    if let Some(o) = suspended.sandboxes.iter().find(|o| o.error.is_some()) {
        bail!("suspend failed: {o:?}");
    }
    let memory_before = suspended
        .sandboxes
        .iter()
        .map(|o| o.memory_before_bytes)
        .sum();
    let memory_after = suspended
        .sandboxes
        .iter()
        .map(|o| o.memory_after_bytes)
        .sum();
    let t = Instant::now();
    let resumed = c.resume_job(&job).await?;
    let resume_ms = t.elapsed().as_secs_f64() * 1000.0;
    if let Some(o) = resumed.sandboxes.iter().find(|o| o.error.is_some()) {
        bail!("resume failed: {o:?}");
    }
    let mut exec = Vec::new();
    for id in &ids {
        let t = Instant::now();
        c.exec(id, crate::argv_true()).await?;
        exec.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    for id in &ids {
        c.delete_sandbox(id).await?;
    }
    Ok(JobRow {
        sandboxes: n,
        suspend_ms,
        resume_ms,
        memory_before,
        memory_after,
        exec_after_resume: Stats {
            name: "exec true after resume".into(),
            samples: exec,
            note: None,
        },
    })
}

fn mem_available() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// Host cost of an idle sandbox with one open shell session: memory, processes, threads,
/// fds.
pub async fn idle_cost(server: &Server, n: usize) -> anyhow::Result<(f64, f64, f64, f64, Stats)> {
    let c = server.client();
    let before = mem_available();
    let mut ids = Vec::new();
    for _ in 0..n {
        let sb = c.create_sandbox(CreateSandboxRequest::default()).await?;
        c.create_session(&sb.id, CreateSessionRequest::default())
            .await?;
        ids.push(sb.id);
    }
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let after = mem_available();
    let procs: usize = ids
        .iter()
        .map(|id| dsec_e2e::host::processes(id).len())
        .sum();
    let threads: usize = ids
        .iter()
        .flat_map(|id| dsec_e2e::host::processes(id))
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/status")).ok())
        .filter_map(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Threads:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
        })
        .sum();
    let fds: usize = ids
        .iter()
        .flat_map(|id| dsec_e2e::host::processes(id))
        .filter_map(|pid| std::fs::read_dir(format!("/proc/{pid}/fd")).ok())
        .map(|d| d.count())
        .sum();
    let mut exec = Vec::new();
    for id in &ids {
        let t = Instant::now();
        c.exec(id, crate::argv_true()).await?;
        exec.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    for id in &ids {
        c.delete_sandbox(id).await?;
    }
    let per = |x: f64| x / n as f64;
    Ok((
        per(before.saturating_sub(after) as f64) / (1 << 20) as f64,
        per(procs as f64),
        per(threads as f64),
        per(fds as f64),
        Stats {
            name: format!("exec true with {n} idle sandboxes"),
            samples: exec,
            note: None,
        },
    ))
}

/// What the density run found.
pub struct Density {
    /// Sandboxes running at the end (each with an open shell session).
    pub sandboxes: usize,
    /// Why creating stopped: the target was reached, or the node's refusal.
    pub stopped: String,
    /// Wall time to create them all, seconds.
    pub create_secs: f64,
    /// Host memory per sandbox, MiB.
    pub mib_per_sandbox: f64,
    /// `exec true` across the running sandboxes.
    pub exec: Stats,
}

/// Starts idle sandboxes (each with an open shell session) until `target` run or the node
/// refuses, then measures exec latency across them, and removes them all.
pub async fn density(server: &Server, target: usize) -> anyhow::Result<Density> {
    let c = server.client();
    let before = mem_available();
    let started = Instant::now();
    let mut ids = Vec::new();
    let mut stopped = format!("target of {target} reached");
    while ids.len() < target {
        // Four creates in flight: the node admits concurrently, as a trainer would ask.
        let batch = (target - ids.len()).min(4);
        let results = futures_join(&c, batch).await;
        let mut refused = None;
        for r in results {
            match r {
                Ok(id) => ids.push(id),
                Err(e) => refused = Some(e),
            }
        }
        if let Some(e) = refused {
            stopped = format!("node refused: {e}");
            break;
        }
    }
    let create_secs = started.elapsed().as_secs_f64();
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let after = mem_available();
    let mut exec = Vec::new();
    for id in ids.iter().step_by((ids.len() / 200).max(1)) {
        let t = Instant::now();
        c.exec(id, crate::argv_true()).await?;
        exec.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    let n = ids.len();
    let chunks: Vec<Vec<String>> = ids.chunks(8).map(|c| c.to_vec()).collect();
    for chunk in chunks {
        let tasks: Vec<_> = chunk
            .into_iter()
            .map(|id| {
                let c = c.clone();
                tokio::spawn(async move { c.delete_sandbox(&id).await })
            })
            .collect();
        for t in tasks {
            t.await??;
        }
    }
    Ok(Density {
        sandboxes: n,
        stopped,
        create_secs,
        mib_per_sandbox: before.saturating_sub(after) as f64 / (1 << 20) as f64 / n.max(1) as f64,
        exec: Stats {
            name: format!("exec true with {n} sandboxes"),
            samples: exec,
            note: None,
        },
    })
}

async fn futures_join(c: &Client, n: usize) -> Vec<Result<String, String>> {
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let c = c.clone();
            tokio::spawn(async move {
                let sb = c
                    .create_sandbox(CreateSandboxRequest::default())
                    .await
                    .map_err(|e| e.to_string())?;
                c.create_session(&sb.id, CreateSessionRequest::default())
                    .await
                    .map_err(|e| e.to_string())?;
                Ok::<_, String>(sb.id)
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap_or_else(|e| Err(e.to_string())));
    }
    out
}

/// What the idle CPU run measured.
pub struct IdleCpu {
    /// Idle sandboxes that were running.
    pub sandboxes: usize,
    /// Length of the measurement, s.
    pub secs: f64,
    /// CPU of `dsec serve` and its helper processes (not those in sandboxes), ms.
    pub server_ms: f64,
    /// Processes in the sandboxes (the agents).
    pub sandbox_processes: usize,
    /// CPU of all the sandboxes' processes (agents and whatever else runs in them), ms.
    pub sandboxes_ms: f64,
    /// Busy CPU of the whole host over the same time, ms (all cores).
    pub host_ms: f64,
}

/// User + system CPU of `pid` (all its threads), ms.
pub(crate) fn proc_cpu_ms(pid: i32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the `(comm)` field, which may hold spaces: state is field 3, utime 14, stime 15.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf with a constant name.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Some(ticks as f64 * 1000.0 / hz)
}

/// `pid` and its descendants outside the sandboxes' cgroup parent (the server's own
/// helpers: netns holder, lazy-image servers).
fn server_tree(pid: i32) -> Vec<i32> {
    let parent = format!("/{}/", dsec_e2e::TEST_CGROUP_PARENT);
    let mut children: std::collections::HashMap<i32, Vec<i32>> = Default::default();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let ppid = std::fs::read_to_string(format!("/proc/{p}/status"))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("PPid:"))
                    .and_then(|v| v.trim().parse::<i32>().ok())
            });
        if let Some(pp) = ppid {
            children.entry(pp).or_default().push(p);
        }
    }
    let mut out = Vec::new();
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        let in_sandbox = std::fs::read_to_string(format!("/proc/{p}/cgroup"))
            .is_ok_and(|cg| cg.contains(&parent));
        if in_sandbox {
            continue;
        }
        out.push(p);
        todo.extend(children.get(&p).into_iter().flatten());
    }
    out
}

/// Processes in the sandboxes (in a cgroup below the node's cgroup parent).
fn sandbox_pids() -> Vec<i32> {
    let parent = format!("/{}/", dsec_e2e::TEST_CGROUP_PARENT);
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<i32>().ok())
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/cgroup"))
                .is_ok_and(|cg| cg.contains(&parent))
        })
        .collect()
}

/// CPU an idle node spends: starts `n` sandboxes (no session, no call in flight), lets
/// the node settle, then measures the CPU of the server and of the sandboxes over
/// `secs`, and removes them.
pub async fn idle_cpu(server: &Server, n: usize, secs: u64) -> anyhow::Result<IdleCpu> {
    let c = server.client();
    let pid = server.pid().context("the server is not running")?;
    let mut ids = Vec::new();
    let res = async {
        while ids.len() < n {
            let batch = (n - ids.len()).min(4);
            let tasks: Vec<_> = (0..batch)
                .map(|_| {
                    let c = c.clone();
                    tokio::spawn(
                        async move { c.create_sandbox(CreateSandboxRequest::default()).await },
                    )
                })
                .collect();
            for t in tasks {
                ids.push(t.await??.id);
            }
        }
        crate::HostCpu::settle(std::time::Duration::from_secs(30)).await;
        let (tree, inside) = (server_tree(pid), sandbox_pids());
        let cpu = |pids: &[i32]| pids.iter().filter_map(|p| proc_cpu_ms(*p)).sum::<f64>();
        let (s0, b0, host) = (cpu(&tree), cpu(&inside), crate::HostCpu::now());
        let t = Instant::now();
        tokio::time::sleep(std::time::Duration::from_secs(secs)).await;
        let (s1, b1, host_ms) = (cpu(&tree), cpu(&inside), host.elapsed_ms());
        Ok::<_, anyhow::Error>(IdleCpu {
            sandboxes: ids.len(),
            secs: t.elapsed().as_secs_f64(),
            server_ms: s1 - s0,
            sandbox_processes: inside.len(),
            sandboxes_ms: b1 - b0,
            host_ms,
        })
    }
    .await;
    for chunk in ids.chunks(8) {
        let tasks: Vec<_> = chunk
            .iter()
            .map(|id| {
                let (c, id) = (c.clone(), id.clone());
                tokio::spawn(async move { c.delete_sandbox(&id).await })
            })
            .collect();
        for t in tasks {
            t.await??;
        }
    }
    res
}

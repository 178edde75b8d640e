//! What each isolation level costs (#28): time to interactive (create, then `exec
//! true`), the round trip of `exec true` in a live sandbox, and the host memory of an
//! idle sandbox (its cgroup's charge), for dsec's container, `oci` (runc), `gvisor`
//! (runsc, on the platform the node detected) and `microvm` (QEMU, TCG or KVM), on one
//! server. Rounds alternate between the levels so all see the same machine; a level the
//! node does not offer is left out with its reason. A microVM's create is also broken
//! down: QEMU's start, the guest kernel's boot, the guest init's setup (both as the
//! guest's console reports them) and the agent's answer. Each round also pauses and
//! resumes the sandbox: a freeze at the other levels, a snapshot saved to a file (QEMU
//! ended) and restored for a microVM; the table gives both times, the memory the paused
//! sandbox still holds and the snapshot's size. Last, microVM density: host memory per
//! idle microVM with free page reporting and without ([`microvm_density`]).

use std::time::Instant;

use anyhow::bail;
use dsec_e2e::Server;
use dsec_wire::v1::{CreateSandboxRequest, Isolation};

use crate::{argv_true, on_one_thread, Stats};

/// The levels the server offers, each with what the table calls it.
async fn levels(server: &Server) -> anyhow::Result<Vec<(Isolation, String)>> {
    let health = server.client().health().await?;
    let mut out = Vec::new();
    for level in [
        Isolation::Container,
        Isolation::Oci,
        Isolation::Gvisor,
        Isolation::Microvm,
    ] {
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

/// One level's pause figures: pause ms, resume + `exec true` ms, snapshot MiB, memory
/// held while paused MiB.
type PauseSamples = (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>);

/// A microVM's boot as its console tells it: (kernel ms, init ms), from the agent's line
/// `guest ready in <init> ms (kernel uptime <seconds> ...)`.
fn guest_boot(run_dir: &std::path::Path, id: &str) -> Option<(f64, f64)> {
    let console = run_dir.join("sandboxes").join(id).join("vm/console.log");
    let text = std::fs::read_to_string(console).ok()?;
    let line = text.lines().find(|l| l.contains("guest ready in"))?;
    let init: f64 = line
        .split("guest ready in ")
        .nth(1)?
        .split(' ')
        .next()?
        .parse()
        .ok()?;
    let uptime: f64 = line
        .split("kernel uptime ")
        .nth(1)?
        .split(' ')
        .next()?
        .parse()
        .ok()?;
    Some((uptime * 1000.0 - init, init))
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
    let run_dir = server.run_dir.clone();
    let state_dir = server.state_dir.clone();
    let (per_level, boot, pauses) = on_one_thread(client, move |c| async move {
        let mut out: Vec<(Vec<f64>, Vec<f64>, Vec<f64>)> =
            levels.iter().map(|_| Default::default()).collect();
        // A microVM's phases: vmm, kernel, init, agent (ms).
        let mut boot: [Vec<f64>; 4] = Default::default();
        // Per level: pause ms, resume + exec ms, snapshot MiB, memory while paused MiB.
        let mut pauses: Vec<PauseSamples> = levels.iter().map(|_| Default::default()).collect();
        for round in 0..rounds {
            for (i, (level, _)) in levels.iter().enumerate() {
                let t = Instant::now();
                let sb = c
                    .create_sandbox(CreateSandboxRequest {
                        isolation: *level,
                        timings: true,
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
                let guest = guest_boot(&run_dir, &sb.id);
                // Pause and resume (a microVM: saved to a file and restored).
                let t = Instant::now();
                c.pause_sandbox(&sb.id).await?;
                let paused_ms = t.elapsed().as_secs_f64() * 1000.0;
                let snapshot = std::fs::metadata(
                    state_dir
                        .join("sandboxes")
                        .join(&sb.id)
                        .join("vm-snapshot.bin"),
                )
                .map(|m| m.len())
                .ok();
                let paused_mem = cgroup_memory(parent, &sb.id);
                let t = Instant::now();
                c.resume_sandbox(&sb.id).await?;
                c.exec(&sb.id, argv_true()).await?;
                let resumed_ms = t.elapsed().as_secs_f64() * 1000.0;
                let phases = sb
                    .timings
                    .as_ref()
                    .map(|t| t.phases.clone())
                    .unwrap_or_default();
                let phase = |name: &str| phases.iter().find(|p| p.phase == name).map(|p| p.ms);
                c.delete_sandbox(&sb.id).await?;
                if round > 0 {
                    pauses[i].0.push(paused_ms);
                    pauses[i].1.push(resumed_ms);
                    if let Some(b) = snapshot {
                        pauses[i].2.push(b as f64 / (1 << 20) as f64);
                    }
                    if let Some(b) = paused_mem {
                        pauses[i].3.push(b as f64 / (1 << 20) as f64);
                    }
                }
                if *level == Isolation::Microvm && round > 0 {
                    if let (Some(vmm), Some((kernel, init)), Some(agent)) =
                        (phase("vmm"), guest, phase("agent"))
                    {
                        boot[0].push(vmm);
                        boot[1].push(kernel);
                        boot[2].push(init);
                        boot[3].push(agent);
                    }
                }
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
        Ok((out, boot, pauses))
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
    let p50 = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied()
    };
    for (name, (pause, resume, snap, held)) in names.iter().zip(pauses) {
        let mut note = match p50(&held) {
            Some(m) => format!("memory while paused p50 {m:.1} MiB"),
            None => "memory: no cgroup figure".to_string(),
        };
        if let Some(m) = p50(&snap) {
            note.push_str(&format!("; snapshot p50 {m:.1} MiB"));
        }
        rows.push(Stats {
            name: format!("pause, {name}"),
            samples: pause,
            note: Some(note),
        });
        rows.push(Stats {
            name: format!("resume + exec true, {name}"),
            samples: resume,
            note: None,
        });
    }
    let names = [
        "QEMU start (to its sockets)",
        "guest kernel (to init)",
        "guest init (modules, disks, overlay)",
        "agent answers (node's first ping)",
    ];
    for (name, samples) in names.iter().zip(boot) {
        if !samples.is_empty() {
            rows.push(Stats {
                name: format!("microvm boot: {name}"),
                samples,
                note: None,
            });
        }
    }
    Ok(rows)
}

/// Proportional set size of `pid` in bytes (its shared libraries split among sharers).
fn pss_bytes(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    let kb: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("Pss:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb << 10)
}

/// The processes of a sandbox's cgroup (v1 memory hierarchy or v2).
fn cgroup_pids(parent: &str, id: &str) -> Vec<u32> {
    [
        format!("/sys/fs/cgroup/memory/{parent}/{id}/cgroup.procs"),
        format!("/sys/fs/cgroup/{parent}/{id}/cgroup.procs"),
    ]
    .iter()
    .find_map(|p| std::fs::read_to_string(p).ok())
    .map(|s| s.lines().filter_map(|l| l.trim().parse().ok()).collect())
    .unwrap_or_default()
}

/// One density run's figures per microVM, MiB: (PSS after boot, charge after boot, PSS
/// after the command, charge after the command).
type DensitySamples = (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>);

/// How long the microVMs idle before their memory is read: free page reporting hands
/// pages back 2 s after the guest frees them, in batches.
const SETTLE: std::time::Duration = std::time::Duration::from_secs(10);

/// Host memory per idle microVM, with free page reporting (the default) and without
/// (`--microvm-no-free-page-reporting`), each on a server of its own: `n` microVMs
/// (512 MiB guests, the default) are read once idle after their boot, then again idle
/// after each ran a command that used 256 MiB and exited (a build or an install does
/// that). Prints the table and the microVMs a 24 GiB node would hold at that memory.
pub async fn microvm_density(base: &Server, n: usize) -> anyhow::Result<()> {
    let mut results: Vec<(&str, DensitySamples)> = Vec::new();
    for (mode, flags) in [
        ("on (default)", &[][..]),
        ("off", &["--microvm-no-free-page-reporting"][..]),
    ] {
        let parent = "dsec-bench-vm-density";
        let mut args = vec!["--cgroup-parent", parent, "--disk-pool", "2"];
        args.extend_from_slice(flags);
        let server = Server::start_with("bench-vm-density", true, &args).await?;
        server.ensure_base(Some(base)).await?;
        if !levels(&server)
            .await?
            .iter()
            .any(|(l, _)| *l == Isolation::Microvm)
        {
            println!("microVM density: this node offers no microVMs (QEMU or a kernel missing)");
            return Ok(());
        }
        let client = server.client();
        let samples = on_one_thread(client, move |c| async move {
            let mut ids = Vec::new();
            for _ in 0..n {
                let sb = c
                    .create_sandbox(CreateSandboxRequest {
                        isolation: Isolation::Microvm,
                        ..Default::default()
                    })
                    .await?;
                ids.push(sb.id);
            }
            let read = |ids: &[String]| {
                let mut pss = Vec::new();
                let mut charge = Vec::new();
                for id in ids {
                    let p: u64 = cgroup_pids(parent, id)
                        .into_iter()
                        .filter_map(pss_bytes)
                        .sum();
                    pss.push(p as f64 / (1 << 20) as f64);
                    if let Some(b) = cgroup_memory(parent, id) {
                        charge.push(b as f64 / (1 << 20) as f64);
                    }
                }
                (pss, charge)
            };
            tokio::time::sleep(SETTLE).await;
            let (boot_pss, boot_charge) = read(&ids);
            for id in &ids {
                let r = c
                    .exec(
                        id,
                        dsec_e2e::sh("python3 -c 'b = bytearray(256 << 20); b[::4096] = b\"x\" * (len(b) // 4096)'"),
                    )
                    .await?;
                if r.exit.exit_code != Some(0) {
                    bail!("the 256 MiB command failed: {r:?}");
                }
            }
            tokio::time::sleep(SETTLE).await;
            let (used_pss, used_charge) = read(&ids);
            for id in &ids {
                c.delete_sandbox(id).await?;
            }
            Ok((boot_pss, boot_charge, used_pss, used_charge))
        })?;
        results.push((mode, samples));
        drop(server);
    }
    let p50 = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    println!("\n## microVM density: host memory per idle microVM ({n} per run, 512 MiB guests)\n");
    println!("| free page reporting | idle after boot: QEMU PSS MiB | cgroup charge MiB | idle after a 256 MiB command: QEMU PSS MiB | cgroup charge MiB | microVMs per 24 GiB at that PSS |");
    println!("|---|---|---|---|---|---|");
    let mut json = Vec::new();
    for (mode, (bp, bc, up, uc)) in &results {
        let per_node = (24.0 * 1024.0 / p50(up)).floor();
        println!(
            "| {mode} | {:.1} | {:.1} | {:.1} | {:.1} | {per_node:.0} |",
            p50(bp),
            p50(bc),
            p50(up),
            p50(uc)
        );
        json.push(
            serde_json::json!({"free_page_reporting": mode, "boot_pss_mib": p50(bp),
            "boot_charge_mib": p50(bc), "used_pss_mib": p50(up), "used_charge_mib": p50(uc)}),
        );
    }
    crate::record("microvm density", serde_json::Value::Array(json));
    Ok(())
}

//! `dsec-bench`: dsec against the container runtimes a user would otherwise pick, in one
//! run on one machine, on the same root file system (the base image's EROFS layer).
//!
//! Measured intervals:
//! - **create → first exec**: dsec `POST /v1/sandboxes` + `POST /exec true` over HTTP,
//!   vs `crun run` / `runc run` of `true` (which create, run and delete a container);
//! - **exec round trip** on a running sandbox: dsec `POST /exec true` vs `crun exec`.
//!
//! The process runs in a private mount namespace with the cgroup2 mount hidden: crun 1.8
//! refuses this host's hybrid cgroup layout otherwise (PROBE.md). dsec does not need it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Parser;
use dsec_e2e::{sh, Server};
use dsec_wire::v1::{CreateSandboxRequest, ExecRequest};

mod autoscale_trace;
mod burst;
mod churn;
mod cluster;
mod control;
mod events;
mod files;
mod fncall;
mod gateway;
mod images;
mod isolation;
mod lifecycle;
mod network;
mod peers;
mod placement;
mod plot;
mod pools;
mod provision;
mod pull;
mod rollouts;
mod startup;

/// Command line.
#[derive(Debug, Parser)]
#[command(about = "dsec vs crun/runc, side by side")]
struct Args {
    /// Fewer iterations (a smoke run in well under a minute).
    #[arg(long)]
    quick: bool,
    /// Iterations per measurement (default 40, quick 10).
    #[arg(long)]
    iterations: Option<usize>,
    /// Write every table as JSON here (default: target/dsec-bench/results.json).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Run only these sections (comma-separated): runtimes, exec (its exec table alone), network, concurrency,
    /// sustained, backlog, teardown, cpu, job, idle, idle-cpu, density, files, provision, burst, pools, fncall, autoscale,
    /// rollouts (recording a call's outcome on exec; fork into 16 vs commit + creates),
    /// events (time to interactive with events on and off, on two fresh servers),
    /// isolation (time to interactive, exec round trip and idle memory per isolation level, pause and resume, and host memory per idle microVM with free page reporting and without),
    /// placement (simulated, needs neither root nor a server), control-plane (2 API servers
    /// over etcd and 100 simulated nodes; needs etcd, not root), registry-pull (a
    /// multi-layer pull from a local docker-registry, serial vs parallel layer downloads;
    /// no server), cluster (a real 3-node cluster on this machine vs dsec serve; needs
    /// etcd), images (cold pull of a ~500 MB image to the first command and a Dockerfile
    /// build, cold and cached, vs podman; needs podman, docker-registry and skopeo),
    /// gateway (the model gateway's added latency over a fake upstream; no server).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Containers in the burst section (default 256, quick 48).
    #[arg(long)]
    burst_n: Option<usize>,
    /// Distinct images in the burst section (at most 26; default 16, quick 4).
    #[arg(long)]
    burst_images: Option<usize>,
    /// Bandwidth of the burst's emulated remote store, MiB/s.
    #[arg(long, default_value_t = 100)]
    store_mibps: u64,
    /// First-byte latency of the burst's emulated remote store, ms.
    #[arg(long, default_value_t = 5)]
    store_latency_ms: u64,
    /// Length of the sustained run, s (default 60, quick 10; the cluster section's two
    /// runs: 30 each, quick 5).
    #[arg(long)]
    sustained_secs: Option<u64>,
    /// Idle sandboxes in the idle-cpu section (default 500, quick 100).
    #[arg(long)]
    idle_cpu_n: Option<usize>,
    /// Length of the idle-cpu measurement, s (default 60, quick 10).
    #[arg(long)]
    idle_cpu_secs: Option<u64>,
    /// Chunk size of the burst's layers in the store, KiB (`dsec serve --chunk-kib`).
    #[arg(long, default_value_t = 64)]
    chunk_kib: u64,
}

/// Summary of one measurement, in milliseconds.
#[derive(Debug, Clone)]
pub(crate) struct Stats {
    pub(crate) name: String,
    pub(crate) samples: Vec<f64>,
    pub(crate) note: Option<String>,
}

impl Stats {
    pub(crate) fn pct(&self, p: f64) -> f64 {
        if self.samples.is_empty() {
            return f64::NAN;
        }
        let mut s = self.samples.clone();
        s.sort_by(|a, b| a.total_cmp(b));
        let idx = ((p / 100.0) * (s.len() - 1) as f64).round() as usize;
        s[idx.min(s.len() - 1)]
    }
    fn na(name: &str, why: String) -> Self {
        Stats {
            name: name.into(),
            samples: vec![],
            note: Some(why),
        }
    }
}

fn enter_private_mount_ns() -> anyhow::Result<()> {
    use nix::mount::{mount, umount2, MntFlags, MsFlags};
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).context("unshare mount namespace")?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .context("make / private")?;
    if Path::new("/sys/fs/cgroup/unified").exists() {
        let _ = umount2("/sys/fs/cgroup/unified", MntFlags::MNT_DETACH);
    }
    Ok(())
}

/// Runs `cmd` with stdout discarded; milliseconds.
fn time_cmd(cmd: &mut Command) -> anyhow::Result<f64> {
    time_output(cmd.stdout(Stdio::null())).map(|(ms, _)| ms)
}

/// Runs `cmd` with stdout read through a pipe; milliseconds and the bytes it wrote.
fn time_output(cmd: &mut Command) -> anyhow::Result<(f64, usize)> {
    let t = Instant::now();
    let out = cmd.stderr(Stdio::piped()).output()?;
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    if !out.status.success() {
        bail!(
            "{:?} failed: {}",
            cmd,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok((ms, out.stdout.len()))
}

/// Bytes `cat` writes in the exec round-trip table of a large output.
const CAT_BYTES: usize = 1 << 20;
/// Where the `cat` payload is, in a dsec sandbox (uploaded) and in the crun container
/// (bound from the bundle): a directory every Debian root has.
const CAT_DIR: &str = "/mnt";
/// The payload's file name in [`CAT_DIR`].
const CAT_FILE_NAME: &str = "payload.txt";

/// [`CAT_BYTES`] of text (numbered lines), so that dsec's JSON result carries it as it is.
fn cat_payload() -> Vec<u8> {
    let mut out = Vec::with_capacity(CAT_BYTES + 64);
    let mut line = 0u64;
    while out.len() < CAT_BYTES {
        out.extend_from_slice(
            format!("{line:08} the quick brown fox jumps over the lazy dog\n").as_bytes(),
        );
        line += 1;
    }
    out.truncate(CAT_BYTES);
    out
}

/// The payload's path inside the sandbox or container.
fn cat_path() -> String {
    format!("{CAT_DIR}/{CAT_FILE_NAME}")
}

/// The libc-free no-op's path inside the sandbox or container.
fn nop_path() -> String {
    format!("{CAT_DIR}/{}", startup::NOP_FILE_NAME)
}

/// An OCI bundle whose root is the base image's EROFS layer, mounted read-only.
struct Bundle {
    dir: PathBuf,
    rootfs: PathBuf,
}

impl Bundle {
    fn new(dir: &Path, blob: &Path) -> anyhow::Result<Self> {
        use nix::mount::{mount, MsFlags};
        let _ = std::fs::remove_dir_all(dir);
        let rootfs = dir.join("rootfs");
        std::fs::create_dir_all(&rootfs)?;
        mount(
            Some(blob),
            &rootfs,
            Some("erofs"),
            MsFlags::MS_RDONLY,
            None::<&str>,
        )
        .with_context(|| format!("mounting {}", blob.display()))?;
        let bundle = Bundle {
            dir: dir.to_path_buf(),
            rootfs,
        };
        std::fs::create_dir_all(bundle.payload_dir())?;
        std::fs::write(bundle.payload_dir().join(CAT_FILE_NAME), cat_payload())?;
        let nop = bundle.payload_dir().join(startup::NOP_FILE_NAME);
        std::fs::write(&nop, startup::nop_elf())?;
        std::fs::set_permissions(&nop, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
        Ok(bundle)
    }

    /// A host directory holding the `cat` payload; `crun exec` sees it at [`CAT_DIR`].
    fn payload_dir(&self) -> PathBuf {
        self.dir.join("payload")
    }

    /// Writes config.json (from `crun spec`) running `args`; with `payload`, the payload
    /// directory is bound read-only at [`CAT_DIR`].
    fn configure(&self, args: &[&str], payload: bool) -> anyhow::Result<()> {
        let cfg = self.dir.join("config.json");
        let _ = std::fs::remove_file(&cfg);
        let st = Command::new("crun")
            .arg("spec")
            .current_dir(&self.dir)
            .status()?;
        if !st.success() {
            bail!("crun spec failed");
        }
        let mut spec: serde_json::Value = serde_json::from_slice(&std::fs::read(&cfg)?)?;
        spec["process"]["terminal"] = false.into();
        spec["process"]["args"] = serde_json::json!(args);
        spec["root"]["path"] = self.rootfs.display().to_string().into();
        spec["root"]["readonly"] = true.into();
        if payload {
            if let Some(mounts) = spec["mounts"].as_array_mut() {
                mounts.push(serde_json::json!({
                    "destination": CAT_DIR, "type": "bind",
                    "source": self.payload_dir(), "options": ["rbind", "ro"],
                }));
            }
        }
        std::fs::write(&cfg, serde_json::to_vec_pretty(&spec)?)?;
        Ok(())
    }
}

impl Drop for Bundle {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.rootfs, nix::mount::MntFlags::MNT_DETACH);
    }
}

fn runtime_run(runtime: &str, bundle: &Bundle, n: usize) -> Stats {
    let name = format!("{runtime} run true");
    if Command::new(runtime).arg("--version").output().is_err() {
        return Stats::na(&name, format!("{runtime} not installed"));
    }
    let mut samples = Vec::new();
    for i in 0..n + 2 {
        let id = format!("dsec-bench-{runtime}-{}-{i}", std::process::id());
        let r = time_cmd(
            Command::new(runtime)
                .args(["run", "--bundle"])
                .arg(&bundle.dir)
                .arg(&id),
        );
        match r {
            Ok(ms) if i >= 2 => samples.push(ms), // two warm-up runs
            Ok(_) => {}
            Err(e) => return Stats::na(&name, format!("{e:#}")),
        }
    }
    Stats {
        name,
        samples,
        note: Some("create+start+run+delete of a container".into()),
    }
}

/// `crun run true` on a root like a dsec sandbox's: a fresh overlayfs (the EROFS layer +
/// an empty upper) per run. The overlay is mounted before the timer starts, so crun gets
/// the mount for free; what it pays is the first use of a new overlay instance.
fn crun_run_overlay(bundle: &Bundle, n: usize) -> Stats {
    use nix::mount::{mount, umount2, MntFlags, MsFlags};
    let name = "crun run true (overlay root)".to_string();
    if Command::new("crun").arg("--version").output().is_err() {
        return Stats::na(&name, "crun not installed".into());
    }
    let base = bundle.dir.join("overlay-runs");
    let mut samples = Vec::new();
    for i in 0..n + 2 {
        let run = base.join(i.to_string());
        let (upper, work, root) = (run.join("upper"), run.join("work"), run.join("rootfs"));
        for d in [&upper, &work, &root] {
            if let Err(e) = std::fs::create_dir_all(d) {
                return Stats::na(&name, format!("mkdir: {e}"));
            }
        }
        let opts = format!(
            "lowerdir={},upperdir={},workdir={}",
            bundle.rootfs.display(),
            upper.display(),
            work.display()
        );
        if let Err(e) = mount(
            Some("overlay"),
            &root,
            Some("overlay"),
            MsFlags::MS_NODEV,
            Some(opts.as_str()),
        ) {
            return Stats::na(&name, format!("mount overlay: {e}"));
        }
        let cfg = run.join("config.json");
        let mut spec: serde_json::Value = match std::fs::read(bundle.dir.join("config.json"))
            .map_err(anyhow::Error::from)
            .and_then(|b| serde_json::from_slice(&b).map_err(anyhow::Error::from))
        {
            Ok(v) => v,
            Err(e) => return Stats::na(&name, format!("{e:#}")),
        };
        spec["root"]["path"] = root.display().to_string().into();
        spec["root"]["readonly"] = false.into();
        let _ = std::fs::write(&cfg, serde_json::to_vec(&spec).unwrap_or_default());
        let id = format!("dsec-bench-ovl-{}-{i}", std::process::id());
        let r = time_cmd(
            Command::new("crun")
                .args(["run", "--bundle"])
                .arg(&run)
                .arg(&id),
        );
        let _ = umount2(&root, MntFlags::MNT_DETACH);
        let _ = std::fs::remove_dir_all(&run);
        match r {
            Ok(ms) if i >= 2 => samples.push(ms),
            Ok(_) => {}
            Err(e) => return Stats::na(&name, format!("{e:#}")),
        }
    }
    Stats {
        name,
        samples,
        note: Some("like a dsec root: fresh overlay (mounted untimed)".into()),
    }
}

/// What [`crun_exec`] measured.
struct CrunExec {
    exec_true: Stats,
    exec_nop: Stats,
    exec_cat: Stats,
}

/// `crun exec true` and of the libc-free no-op (`n` times each) and `crun exec cat` of
/// the payload (`n_cat` times, its output read by the bench) in one running container.
fn crun_exec(bundle: &Bundle, n: usize, n_cat: usize) -> CrunExec {
    let (name, nop_name, cat_name) = (
        "crun exec true",
        "crun exec static no-op",
        "crun exec cat 1 MiB",
    );
    let na = |why: String| CrunExec {
        exec_true: Stats::na(name, why.clone()),
        exec_nop: Stats::na(nop_name, why.clone()),
        exec_cat: Stats::na(cat_name, why),
    };
    let id = format!("dsec-bench-exec-{}", std::process::id());
    if let Err(e) = bundle.configure(&["sleep", "3600"], true) {
        return na(format!("{e:#}"));
    }
    let started = Command::new("crun")
        .args(["run", "--detach", "--bundle"])
        .arg(&bundle.dir)
        .arg(&id)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !matches!(started, Ok(s) if s.success()) {
        return na("crun run --detach failed".into());
    }
    let delete = || {
        let _ = Command::new("crun")
            .args(["delete", "--force", &id])
            .stdout(Stdio::null())
            .status();
    };
    let (mut samples, mut nop) = (Vec::new(), Vec::new());
    let nop_path = nop_path();
    for i in 0..n + 2 {
        let timed = time_cmd(Command::new("crun").args(["exec", &id, "true"])).and_then(|t| {
            time_cmd(Command::new("crun").args(["exec", &id, &nop_path])).map(|n| (t, n))
        });
        match timed {
            Ok((t, n)) if i >= 2 => {
                samples.push(t);
                nop.push(n);
            }
            Ok(_) => {}
            Err(e) => {
                delete();
                return na(format!("{e:#}"));
            }
        }
    }
    let path = cat_path();
    let mut cat = Vec::new();
    let mut cat_error = None;
    for i in 0..n_cat + 2 {
        match time_output(Command::new("crun").args(["exec", &id, "cat", &path])) {
            Ok((ms, len)) if len != CAT_BYTES => {
                cat_error = Some(format!(
                    "cat wrote {len} bytes, not {CAT_BYTES} ({ms:.1} ms)"
                ));
                break;
            }
            Ok((ms, _)) if i >= 2 => cat.push(ms),
            Ok(_) => {}
            Err(e) => {
                cat_error = Some(format!("{e:#}"));
                break;
            }
        }
    }
    delete();
    let cat = match cat_error {
        Some(why) => Stats::na(cat_name, why),
        None => Stats {
            name: cat_name.into(),
            samples: cat,
            note: Some("stdout read through a pipe by the caller".into()),
        },
    };
    CrunExec {
        exec_true: Stats {
            name: name.into(),
            samples,
            note: None,
        },
        exec_nop: Stats {
            name: nop_name.into(),
            samples: nop,
            note: Some("a libc-free ELF that exits at once (no dynamic loader, no cpuid)".into()),
        },
        exec_cat: cat,
    }
}

/// The floor: spawning and reaping `program` directly on the host (posix_spawn via std).
fn spawn_floor(name: &str, program: &Path, n: usize, note: &str) -> Stats {
    let mut samples = Vec::new();
    for i in 0..n + 5 {
        let t = Instant::now();
        let ok = Command::new(program)
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if !ok {
            return Stats::na(name, format!("could not run {}", program.display()));
        }
        if i >= 5 {
            samples.push(t.elapsed().as_secs_f64() * 1000.0);
        }
    }
    Stats {
        name: name.into(),
        samples,
        note: Some(note.into()),
    }
}

/// The floors of the exec table: `/bin/true` and the libc-free no-op spawned on the host.
fn spawn_floors(bundle: &Bundle, n: usize) -> [Stats; 2] {
    [
        spawn_floor(
            "host spawn /bin/true",
            Path::new("/bin/true"),
            n,
            "floor: no sandbox, no RPC",
        ),
        spawn_floor(
            "host spawn static no-op",
            &bundle.payload_dir().join(startup::NOP_FILE_NAME),
            n,
            "floor of execve alone: no sandbox, no RPC, no libc start-up",
        ),
    ]
}

/// The floor of a large output: spawning `cat` of the payload on the host and reading
/// its stdout through a pipe.
fn host_cat(bundle: &Bundle, n: usize) -> Stats {
    let name = "host spawn cat 1 MiB";
    let path = bundle.payload_dir().join(CAT_FILE_NAME);
    let mut samples = Vec::new();
    for i in 0..n + 2 {
        match time_output(Command::new("cat").arg(&path)) {
            Ok((_, len)) if len != CAT_BYTES => {
                return Stats::na(name, format!("cat wrote {len} bytes, not {CAT_BYTES}"))
            }
            Ok((ms, _)) if i >= 2 => samples.push(ms),
            Ok(_) => {}
            Err(e) => return Stats::na(name, format!("{e:#}")),
        }
    }
    Stats {
        name: name.into(),
        samples,
        note: Some("floor: no sandbox, no RPC; stdout through a pipe".into()),
    }
}

/// What [`python_sdk`] times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SdkMode {
    /// `Sandbox.create` + `exec(["true"])`, one sandbox after another.
    TimeToInteractive,
    /// `exec(["true"])` on one running sandbox.
    Exec,
    /// `await AsyncSandbox.exec(["true"])` on one running sandbox.
    AsyncExec,
}

/// The Python SDK, timed by `bench/sdk_tti.py` in the venv named by `DSEC_PY_VENV`
/// (which scripts/bench prepares).
fn python_sdk(server: &Server, n: usize, mode: SdkMode) -> Stats {
    let (name, note, arg) = match mode {
        SdkMode::TimeToInteractive => (
            "dsec via Python SDK",
            "Sandbox.create + exec(['true']), sequential (kill untimed)",
            "tti",
        ),
        SdkMode::Exec => (
            "dsec exec true via Python SDK",
            "Sandbox.exec(['true']) on a running sandbox",
            "exec",
        ),
        SdkMode::AsyncExec => (
            "dsec exec true via Python SDK (asyncio)",
            "await AsyncSandbox.exec(['true']) on a running sandbox",
            "aexec",
        ),
    };
    let Some(venv) = std::env::var_os("DSEC_PY_VENV") else {
        return Stats::na(name, "DSEC_PY_VENV not set (scripts/bench sets it)".into());
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("sdk_tti.py");
    let out = Command::new(Path::new(&venv).join("bin/python"))
        .arg(&script)
        .args([&server.url, &server.key, &n.to_string(), arg])
        .output();
    match out {
        Ok(o) if o.status.success() => match serde_json::from_slice::<Vec<f64>>(&o.stdout) {
            Ok(samples) => Stats {
                name: name.into(),
                samples,
                note: Some(note.into()),
            },
            Err(e) => Stats::na(name, format!("bad output: {e}")),
        },
        Ok(o) => Stats::na(name, String::from_utf8_lossy(&o.stderr).trim().to_string()),
        Err(e) => Stats::na(name, format!("python: {e}")),
    }
}

/// `workers` asyncio tasks of one Python process looping `AsyncSandbox.create` ->
/// `exec(["true"])` -> `kill` until `total` were attempted (`bench/sdk_tti.py conc`);
/// the error names the concurrency and why nothing was measured.
fn python_sdk_concurrency(
    server: &Server,
    workers: usize,
    total: usize,
) -> Result<Churn, (usize, String)> {
    let na = |why: String| (workers, why);
    let venv = std::env::var_os("DSEC_PY_VENV")
        .ok_or_else(|| na("DSEC_PY_VENV not set (scripts/bench sets it)".into()))?;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("sdk_tti.py");
    let cpu = HostCpu::now();
    let out = Command::new(Path::new(&venv).join("bin/python"))
        .arg(&script)
        .args([
            &server.url,
            &server.key,
            &total.to_string(),
            "conc",
            &workers.to_string(),
        ])
        .output()
        .map_err(|e| na(format!("python: {e}")))?;
    let cpu_ms = cpu.elapsed_ms();
    if !out.status.success() {
        return Err(na(String::from_utf8_lossy(&out.stderr).trim().to_string()));
    }
    let run: serde_json::Value =
        serde_json::from_slice(&out.stdout).map_err(|e| na(format!("bad output: {e}")))?;
    let bad = || na(format!("bad output: {run}"));
    let mut cycles = Vec::new();
    for c in run["cycles"].as_array().ok_or_else(bad)? {
        let ms = |i: usize| c[i].as_f64().ok_or_else(bad);
        cycles.push(Cycle {
            create_ms: ms(0)?,
            tti_ms: ms(1)?,
            delete_ms: ms(2)?,
        });
    }
    let failed = run["failed"].as_u64().ok_or_else(bad)? as usize;
    let secs = run["secs"].as_f64().ok_or_else(bad)?;
    Ok(Churn::new(
        format!("sdk c{workers}"),
        workers,
        cycles,
        failed,
        secs,
        cpu_ms,
    ))
}

/// One create -> exec true -> delete cycle as a client sees it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cycle {
    /// Time to interactive: the create call until the exec's result is back.
    pub tti_ms: f64,
    /// The create call alone (the first part of `tti_ms`).
    pub create_ms: f64,
    /// The delete call that follows.
    pub delete_ms: f64,
}

/// One create -> exec `true` -> delete cycle (see [`Cycle`] for what is timed).
pub(crate) async fn cycle(
    c: &dsec_client::Client,
    req: CreateSandboxRequest,
) -> anyhow::Result<Cycle> {
    let t = Instant::now();
    let sb = c.create_sandbox(req).await?;
    let create_ms = t.elapsed().as_secs_f64() * 1000.0;
    let r = c.exec(&sb.id, argv_true()).await;
    let tti_ms = t.elapsed().as_secs_f64() * 1000.0;
    let t = Instant::now();
    let deleted = c.delete_sandbox(&sb.id).await;
    let delete_ms = t.elapsed().as_secs_f64() * 1000.0;
    let r = r?;
    if r.exit.exit_code != Some(0) {
        bail!("exec true failed: {r:?}");
    }
    deleted?;
    Ok(Cycle {
        tti_ms,
        create_ms,
        delete_ms,
    })
}

pub(crate) fn argv_true() -> ExecRequest {
    ExecRequest {
        cmd: dsec_wire::v1::Command::Argv(vec!["true".into()]),
        ..sh("")
    }
}

async fn dsec_measurements(server: &Server, n: usize) -> anyhow::Result<(Stats, Stats, DsecExec)> {
    HostCpu::settle(std::time::Duration::from_secs(10)).await;
    let (create_exec, create_only) = on_one_thread(server.client(), move |c| async move {
        let mut create_exec = Vec::new();
        let mut create_only = Vec::new();
        for i in 0..n + 2 {
            let t = Instant::now();
            let sb = c.create_sandbox(CreateSandboxRequest::default()).await?;
            let created = t.elapsed();
            let r = c.exec(&sb.id, argv_true()).await?;
            let total = t.elapsed();
            if r.exit.exit_code != Some(0) {
                bail!("exec true failed: {r:?}");
            }
            c.delete_sandbox(&sb.id).await?;
            if i >= 2 {
                create_exec.push(total.as_secs_f64() * 1000.0);
                create_only.push(created.as_secs_f64() * 1000.0);
            }
        }
        Ok((create_exec, create_only))
    })?;
    let exec = dsec_exec_round_trip(server, n).await?;
    Ok((
        Stats {
            name: "dsec create + exec true".into(),
            samples: create_exec,
            note: Some("HTTP API, until the exec returns".into()),
        },
        Stats {
            name: "dsec create (ready)".into(),
            samples: create_only,
            note: Some("HTTP API, agent answering".into()),
        },
        exec,
    ))
}

/// What [`dsec_exec_round_trip`] measured.
struct DsecExec {
    /// `exec true`.
    exec_true: Stats,
    /// `exec` of the libc-free no-op.
    exec_nop: Stats,
    /// `exec cat` of the payload.
    exec_cat: Stats,
    /// The same path without a process: a stat.
    call: Stats,
}

/// `exec true` (`n * 5` times) and `exec cat` of the payload (`n * 2` times) on one
/// running sandbox, and the same path without a process (a stat).
async fn dsec_exec_round_trip(server: &Server, n: usize) -> anyhow::Result<DsecExec> {
    let c = server.client();
    let sb = c.create_sandbox(CreateSandboxRequest::default()).await?;
    let uploaded = c.write_file(&sb.id, &cat_path(), None, cat_payload()).await;
    if let Err(e) = uploaded {
        c.delete_sandbox(&sb.id).await?;
        bail!("uploading the cat payload: {e}");
    }
    let uploaded = c
        .write_file(&sb.id, &nop_path(), Some(0o755), startup::nop_elf())
        .await;
    if let Err(e) = uploaded {
        c.delete_sandbox(&sb.id).await?;
        bail!("uploading the static no-op: {e}");
    }
    // The create took a disk and a network namespace from the node's pools: let their
    // refill finish first, it is not part of an exec.
    HostCpu::settle(std::time::Duration::from_secs(10)).await;
    let id = sb.id.clone();
    // A client of its own: a clone would share the pool, whose connection's task lives on
    // the bench's runtime.
    let timed = on_one_thread(server.client(), move |c| async move {
        let nop_cmd = ExecRequest {
            cmd: dsec_wire::v1::Command::Argv(vec![nop_path()]),
            ..sh("")
        };
        let (mut exec, mut nop) = (Vec::new(), Vec::new());
        for i in 0..(n * 5) + 5 {
            let t = Instant::now();
            c.exec(&id, argv_true()).await?;
            let t_nop = Instant::now();
            let r = c.exec(&id, nop_cmd.clone()).await?;
            let nop_ms = t_nop.elapsed().as_secs_f64() * 1000.0;
            if r.exit.exit_code != Some(0) {
                bail!("the static no-op failed: {:?} {}", r.exit, r.stderr);
            }
            if i >= 5 {
                exec.push((t_nop - t).as_secs_f64() * 1000.0);
                nop.push(nop_ms);
            }
        }
        let cat_cmd = ExecRequest {
            cmd: dsec_wire::v1::Command::Argv(vec!["cat".into(), cat_path()]),
            ..sh("")
        };
        let mut cat = Vec::new();
        for i in 0..(n * 2) + 2 {
            let t = Instant::now();
            let r = c.exec(&id, cat_cmd.clone()).await?;
            let ms = t.elapsed().as_secs_f64() * 1000.0;
            if r.stdout.len() != CAT_BYTES || r.exit.exit_code != Some(0) {
                bail!(
                    "cat wrote {} bytes, not {CAT_BYTES}: {:?} {}",
                    r.stdout.len(),
                    r.exit,
                    r.stderr
                );
            }
            if i >= 2 {
                cat.push(ms);
            }
        }
        // The same path without a process: what an exec costs beyond spawning its command.
        let mut call = Vec::new();
        for i in 0..(n * 5) + 5 {
            let t = Instant::now();
            c.stat_file(&id, "/etc/hostname").await?;
            if i >= 5 {
                call.push(t.elapsed().as_secs_f64() * 1000.0);
            }
        }
        Ok((exec, nop, cat, call))
    });
    c.delete_sandbox(&sb.id).await?;
    let (exec, nop, cat, call) = timed?;
    Ok(DsecExec {
        exec_true: Stats {
            name: "dsec exec true".into(),
            samples: exec,
            note: Some("HTTP API on a running sandbox".into()),
        },
        exec_nop: Stats {
            name: "dsec exec static no-op".into(),
            samples: nop,
            note: Some("the same ELF as crun's: what dsec adds to an execve".into()),
        },
        exec_cat: Stats {
            name: "dsec exec cat 1 MiB".into(),
            samples: cat,
            note: Some("HTTP API, stdout in the JSON result".into()),
        },
        call: Stats {
            name: "dsec agent call, no process".into(),
            samples: call,
            note: Some("stat of a file: HTTP + node + agent, the RPC part of an exec".into()),
        },
    })
}

/// Prints the exec round-trip tables (and the exec target against this machine's own
/// start-up cost of a program); returns the first table's rows.
fn print_exec_tables(
    bundle: &Bundle,
    dsec: DsecExec,
    crun: CrunExec,
    sdk: [Stats; 2],
    n: usize,
) -> Vec<Stats> {
    let [spawn_true, spawn_nop] = spawn_floors(bundle, n * 5);
    let [sdk_exec, sdk_aexec] = sdk;
    let target = format!(
        "targets: dsec exec true {:.2} ms (< 1 ms); host spawn of /bin/true alone {:.2} ms; \
         dsec exec static no-op {:.2} ms, host spawn of it {:.2} ms",
        dsec.exec_true.pct(50.0),
        spawn_true.pct(50.0),
        dsec.exec_nop.pct(50.0),
        spawn_nop.pct(50.0),
    );
    let exec = vec![
        crun.exec_true,
        dsec.exec_true,
        sdk_exec,
        sdk_aexec,
        dsec.call,
        spawn_true,
        crun.exec_nop,
        dsec.exec_nop,
        spawn_nop,
    ];
    print_table(
        "exec round trip on a running sandbox",
        &exec,
        "crun exec true",
    );
    println!("\n{target}");
    let cat = vec![crun.exec_cat, dsec.exec_cat, host_cat(bundle, n * 2)];
    print_table(
        "exec round trip with 1 MiB of output (cat of a file)",
        &cat,
        "crun exec cat 1 MiB",
    );
    exec
}

/// Runs a sequential client loop on its own thread with a single-threaded runtime, as a
/// simple client program would: the request future and its HTTP connection then share
/// one thread. On the bench's shared multi-threaded runtime each response instead hops
/// between threads (connection task -> waiting future -> connection task), several
/// cross-CPU wake-ups that cost ~0.1 ms per request on this VM and are the load
/// generator's, not the server's. Blocks the calling thread until the loop ends.
fn on_one_thread<T, F, Fut>(client: dsec_client::Client, f: F) -> anyhow::Result<T>
where
    T: Send + 'static,
    F: FnOnce(dsec_client::Client) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(f(client))
    })
    .join()
    .map_err(|_| anyhow::anyhow!("measurement thread panicked"))?
}

/// One concurrency level: `workers` tasks each loop create -> exec true -> delete until
/// `total` sandboxes were attempted.
async fn concurrent_tti(server: &Server, workers: usize, total: usize) -> Churn {
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let start = Instant::now();
    let cpu = HostCpu::now();
    let mut tasks = Vec::new();
    for _ in 0..workers {
        let c = server.client();
        let next = next.clone();
        tasks.push(tokio::spawn(async move {
            let mut cycles = Vec::new();
            let mut failures = 0;
            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < total {
                match cycle(&c, CreateSandboxRequest::default()).await {
                    Ok(cy) => cycles.push(cy),
                    Err(_) => failures += 1,
                }
            }
            (cycles, failures)
        }));
    }
    let mut all = Vec::new();
    let mut failures = 0;
    for t in tasks {
        match t.await {
            Ok((s, f)) => {
                all.extend(s);
                failures += f;
            }
            Err(_) => failures += 1,
        }
    }
    Churn::new(
        format!("c{workers}"),
        workers,
        all,
        failures,
        start.elapsed().as_secs_f64(),
        cpu.elapsed_ms(),
    )
}

/// Busy CPU time of the whole host (all cores, every process and kernel thread), from
/// `/proc/stat`: what a churn run costs, load generator included.
pub(crate) struct HostCpu(Option<u64>);

impl HostCpu {
    fn busy_ticks() -> Option<u64> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let line = stat.lines().next()?.strip_prefix("cpu ")?;
        let v: Vec<u64> = line
            .split_whitespace()
            .filter_map(|x| x.parse().ok())
            .collect();
        // user nice system idle iowait irq softirq steal: busy is all but idle and iowait.
        Some(v.iter().take(8).sum::<u64>() - v.get(3)? - v.get(4)?)
    }

    /// Starts counting.
    pub(crate) fn now() -> Self {
        Self(Self::busy_ticks())
    }

    /// Waits, at most `max`, until the host is nearly idle (under 30 ms of CPU in a
    /// 200 ms window, all cores): a latency measurement should not share the CPU with
    /// background work the server just started, such as refilling its disk and network
    /// namespace pools after it started or handed a sandbox out.
    pub(crate) async fn settle(max: std::time::Duration) {
        let end = Instant::now() + max;
        while Instant::now() < end {
            let cpu = Self::now();
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            if cpu.elapsed_ms() < 30.0 {
                return;
            }
        }
    }

    /// Busy milliseconds since [`HostCpu::now`] (NaN if /proc/stat is unreadable).
    pub(crate) fn elapsed_ms(&self) -> f64 {
        // SAFETY: sysconf with a constant name.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        match (self.0, Self::busy_ticks()) {
            (Some(a), Some(b)) => b.saturating_sub(a) as f64 * 1000.0 / hz,
            _ => f64::NAN,
        }
    }
}

/// What a run of create -> exec -> delete loops measured.
#[derive(Debug)]
pub(crate) struct Churn {
    /// Workers (the concurrency).
    pub workers: usize,
    /// Time to interactive of the completed cycles.
    pub tti: Stats,
    /// Create latency (the first part of the time to interactive).
    pub create: Stats,
    /// Delete latency of the completed cycles.
    pub delete: Stats,
    /// Failed creates, execs or deletes.
    pub failed: usize,
    /// Why they failed (the error's message, at most 160 characters) and how often, where
    /// the run kept it.
    pub errors: std::collections::BTreeMap<String, usize>,
    /// Wall time of the run.
    pub secs: f64,
    /// Busy host CPU over the run, ms (all cores).
    pub cpu_ms: f64,
}

impl Churn {
    pub(crate) fn new(
        name: String,
        workers: usize,
        cycles: Vec<Cycle>,
        failed: usize,
        secs: f64,
        cpu_ms: f64,
    ) -> Self {
        Self {
            workers,
            tti: Stats {
                name: name.clone(),
                samples: cycles.iter().map(|c| c.tti_ms).collect(),
                note: None,
            },
            create: Stats {
                name: format!("{name} create"),
                samples: cycles.iter().map(|c| c.create_ms).collect(),
                note: None,
            },
            delete: Stats {
                name: format!("{name} delete"),
                samples: cycles.iter().map(|c| c.delete_ms).collect(),
                note: None,
            },
            failed,
            errors: Default::default(),
            secs,
            cpu_ms,
        }
    }

    /// Busy host CPU per completed cycle, ms.
    pub(crate) fn cpu_per_cycle(&self) -> f64 {
        self.cpu_ms / self.ok().max(1) as f64
    }

    /// Completed cycles.
    pub(crate) fn ok(&self) -> usize {
        self.tti.samples.len()
    }

    /// Completed cycles per second.
    pub(crate) fn rate(&self) -> f64 {
        self.ok() as f64 / self.secs
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({"concurrency": self.workers, "ok": self.ok(), "failed": self.failed,
            "secs": self.secs, "cycles_per_s": self.rate(),
            "p50_ms": self.tti.pct(50.0), "p99_ms": self.tti.pct(99.0), "max_ms": self.tti.pct(100.0),
            "create_p50_ms": self.create.pct(50.0), "create_p99_ms": self.create.pct(99.0),
            "delete_p50_ms": self.delete.pct(50.0), "delete_p99_ms": self.delete.pct(99.0),
            "host_cpu_ms_per_cycle": self.cpu_per_cycle()})
    }
}

fn print_concurrency(title: &str, rows: &[Result<Churn, (usize, String)>]) {
    record(
        title,
        rows.iter()
            .map(|r| match r {
                Ok(c) => c.json(),
                Err((workers, why)) => serde_json::json!({"concurrency": workers, "na": why}),
            })
            .collect(),
    );
    println!("\n## {title}\n");
    println!("| concurrency | sandboxes | ok | p50 ms | p99 ms | max ms | delete p50 ms | delete p99 ms | cycles/s | host CPU ms/cycle |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        let r = match r {
            Ok(r) => r,
            Err((workers, why)) => {
                println!("| {workers} | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a | {why} |");
                continue;
            }
        };
        let n = r.ok();
        println!(
            "| {} | {} | {:.1}% | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.0} | {:.1} |",
            r.workers,
            n + r.failed,
            100.0 * n as f64 / (n + r.failed).max(1) as f64,
            r.tti.pct(50.0),
            r.tti.pct(99.0),
            r.tti.pct(100.0),
            r.delete.pct(50.0),
            r.delete.pct(99.0),
            r.rate(),
            r.cpu_per_cycle()
        );
    }
}

/// Every table printed, for the JSON report.
static REPORT: std::sync::Mutex<Vec<serde_json::Value>> = std::sync::Mutex::new(Vec::new());
/// Every printed table's samples, drawn into one SVG at the end.
static PLOTS: std::sync::Mutex<Vec<plot::Panel>> = std::sync::Mutex::new(Vec::new());

pub(crate) fn record(title: &str, rows: serde_json::Value) {
    REPORT
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(serde_json::json!({"table": title, "rows": rows}));
}

fn stats_json(rows: &[Stats]) -> serde_json::Value {
    rows.iter()
        .map(|r| {
            let v = |p: f64| {
                if r.samples.is_empty() {
                    None
                } else {
                    Some(r.pct(p))
                }
            };
            serde_json::json!({"name": r.name, "n": r.samples.len(), "p50_ms": v(50.0),
                "p95_ms": v(95.0), "p99_ms": v(99.0), "min_ms": v(0.0), "max_ms": v(100.0),
                "note": r.note})
        })
        .collect()
}

fn print_table(title: &str, rows: &[Stats], baseline: &str) {
    print_table_vs(title, rows, &format!("p50 vs {baseline}"), &|_| {
        baseline.to_string()
    });
}

/// [`print_table`] with a baseline of its own for each row (by name: `baseline(row)`),
/// the ratio column headed `header`.
fn print_table_vs(title: &str, rows: &[Stats], header: &str, baseline: &dyn Fn(&Stats) -> String) {
    record(title, stats_json(rows));
    PLOTS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(plot::Panel {
            title: title.to_string(),
            series: rows
                .iter()
                .map(|r| (r.name.clone(), r.samples.clone()))
                .collect(),
        });
    println!("\n## {title}\n");
    println!("| measurement | n | p50 ms | p95 ms | p99 ms | min ms | max ms | {header} | note |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        let base = rows
            .iter()
            .find(|b| b.name == baseline(r) && !b.samples.is_empty())
            .map(|b| b.pct(50.0));
        if r.samples.is_empty() {
            println!(
                "| {} | 0 | n/a | n/a | n/a | n/a | n/a | n/a | {} |",
                r.name,
                r.note.clone().unwrap_or_default()
            );
            continue;
        }
        let ratio = match base {
            Some(b) if b.is_finite() => format!("{:.2}x", r.pct(50.0) / b),
            _ => "n/a".into(),
        };
        println!(
            "| {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {} | {} |",
            r.name,
            r.samples.len(),
            r.pct(50.0),
            r.pct(95.0),
            r.pct(99.0),
            r.pct(0.0),
            r.pct(100.0),
            ratio,
            r.note.clone().unwrap_or_default()
        );
    }
}

/// Workspace provisioning: EROFS layer mount vs tar.gz extraction (see `provision`).
async fn provision_section(server: &Server, n: usize) -> anyhow::Result<()> {
    println!("\n## provisioning a workspace: EROFS layer vs tar.gz extraction (cold cache)\n");
    let Some((dir, tar)) = provision::workspace_paths() else {
        println!("n/a: DSEC_BENCH_WORKSPACE and DSEC_BENCH_WORKSPACE_TAR unset (scripts/bench builds them)");
        return Ok(());
    };
    let c = server.client();
    let name = "bench/workspace";
    let have = c
        .list_images()
        .await?
        .images
        .into_iter()
        .find(|i| i.name == name);
    let image = match have {
        Some(i) => i,
        None => {
            c.import_image(dsec_wire::v1::ImportImageRequest {
                name: name.into(),
                source: dir.display().to_string(),
                flatten: false,
            })
            .await?
        }
    };
    let blob = server.state_dir.join(format!(
        "images/blobs/sha256/{}.erofs",
        image.digest.trim_start_matches("sha256:")
    ));
    let scratch = server.state_dir.join("bench-provision");
    let (ws, ways) =
        tokio::task::spawn_blocking(move || provision::compare(&blob, &tar, &scratch, n)).await??;
    let mib = |b: u64| b as f64 / 1048576.0;
    println!(
        "workspace: {} paths, {:.0} MiB of files; tar.gz {:.0} MiB; EROFS layer (lz4hc) {:.0} MiB\n",
        ws.files, mib(ws.bytes), mib(ws.tar_gz_bytes), mib(ws.erofs_bytes)
    );
    println!("| way | n | p50 ms | time vs tar.gz | p50 MiB written | written vs tar.gz |");
    println!("|---|---|---|---|---|---|");
    let p50 = |v: &[f64]| {
        Stats {
            name: String::new(),
            samples: v.to_vec(),
            note: None,
        }
        .pct(50.0)
    };
    let p50_bytes = |v: &[u64]| {
        let mut s = v.to_vec();
        s.sort_unstable();
        s.get(s.len() / 2).copied().unwrap_or(0)
    };
    let (tar_ms, tar_w) = (p50(&ways[0].ms), p50_bytes(&ways[0].written));
    let mut rows = Vec::new();
    for (i, w) in ways.iter().enumerate() {
        let (ms, wr) = (p50(&w.ms), p50_bytes(&w.written));
        let ratio_w = match (i, wr) {
            (0, _) => "baseline".to_string(),
            (_, 0) => "no writes".to_string(),
            _ => format!("{:.1}x fewer", tar_w as f64 / wr as f64),
        };
        println!(
            "| {} | {} | {:.0} | {:.2}x | {:.1} | {} |",
            w.name,
            w.ms.len(),
            ms,
            ms / tar_ms,
            mib(wr),
            ratio_w
        );
        rows.push(serde_json::json!({"way": w.name, "n": w.ms.len(), "p50_ms": ms, "p50_bytes_written": wr,
            "time_vs_tar": ms / tar_ms, "samples_ms": w.ms, "samples_written": w.written}));
    }
    record(
        "provisioning a workspace",
        serde_json::json!({"files": ws.files, "bytes": ws.bytes,
        "tar_gz_bytes": ws.tar_gz_bytes, "erofs_bytes": ws.erofs_bytes, "ways": rows}),
    );
    Ok(())
}

async fn burst_section(
    n: usize,
    m: usize,
    throttle: dsec_e2e::blobserver::Throttle,
    chunk_kib: u64,
) -> anyhow::Result<()> {
    println!("\n## burst: {n} containers over {m} images, each reading a sample of its image\n");
    let Some((dir, _)) = provision::workspace_paths() else {
        println!("n/a: DSEC_BENCH_WORKSPACE unset (scripts/bench builds it)");
        return Ok(());
    };
    let cache = std::env::var_os("DSEC_BENCH_BURST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| dir.with_file_name("bench-burst"));
    let workers = 8;
    let b = burst::burst(
        &dir.join("venv"),
        &cache,
        n,
        m,
        workers,
        throttle,
        chunk_kib,
    )
    .await?;
    let mib = |x: u64| x as f64 / 1048576.0;
    println!(
        "{} images, {:.0} MiB of files in all; each container reads its image's sample ({:.1}% of \
         its bytes) and one more file; {} at a time; store: {} MiB/s shared link, {} ms first byte, \
         {} KiB chunks\n",
        b.images, mib(b.image_bytes), b.read_share * 100.0, b.workers,
        b.throttle.bytes_per_sec >> 20, b.throttle.latency.as_millis(), b.chunk_kib
    );
    println!("| mode | wall s | vs local | vs on-demand | container p50 ms | p99 ms | failed | fetched MiB | written MiB |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let local = b.modes.first().map(|m| m.wall_s).unwrap_or(f64::NAN);
    let lazy = b.modes.get(1).map(|m| m.wall_s).unwrap_or(f64::NAN);
    let mut rows = Vec::new();
    for m in &b.modes {
        println!(
            "| {} | {:.1} | {:.2}x | {:.2}x | {:.0} | {:.0} | {} | {:.0} | {:.0} |",
            m.name,
            m.wall_s,
            m.wall_s / local,
            m.wall_s / lazy,
            m.container_ms.pct(50.0),
            m.container_ms.pct(99.0),
            m.failed,
            mib(m.fetched),
            mib(m.written)
        );
        rows.push(
            serde_json::json!({"mode": m.name, "wall_s": m.wall_s, "vs_local": m.wall_s / local,
            "vs_on_demand": m.wall_s / lazy, "container_p50_ms": m.container_ms.pct(50.0),
            "container_p99_ms": m.container_ms.pct(99.0), "failed": m.failed,
            "fetched_bytes": m.fetched, "written_bytes": m.written}),
        );
    }
    if let (Some(l), Some(p), Some(t)) = (b.modes.get(1), b.modes.get(2), b.modes.last()) {
        println!(
            "\ntargets: on-demand {:.2}x local cold, {:.2}x with prefetch lists (<= 1.1x); docker-like eager \
             {:.2}x on-demand (>= 1.7x); on-demand writes {:.0}% of docker-like eager's bytes (<= 45%)",
            l.wall_s / local, p.wall_s / local, t.wall_s / l.wall_s,
            100.0 * l.written as f64 / t.written.max(1) as f64
        );
    }
    record(
        "burst",
        serde_json::json!({"n": b.n, "images": b.images, "workers": b.workers,
        "image_bytes": b.image_bytes, "read_share": b.read_share,
        "store_bytes_per_sec": b.throttle.bytes_per_sec, "chunk_kib": b.chunk_kib, "store_latency_ms": b.throttle.latency.as_millis() as u64,
        "modes": rows}),
    );
    Ok(())
}

/// Writes every recorded table as JSON; returns where.
fn write_json(args: &Args, n: usize) -> anyhow::Result<PathBuf> {
    let path = args
        .json
        .clone()
        .unwrap_or_else(|| dsec_e2e::target_dir().join("dsec-bench/results.json"));
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tables = std::mem::take(&mut *REPORT.lock().unwrap_or_else(|p| p.into_inner()));
    let report = serde_json::json!({
        "iterations": n,
        "quick": args.quick,
        "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
        "cpus": std::thread::available_parallelism().map(|p| p.get()).unwrap_or(0),
        "tables": tables,
    });
    std::fs::write(&path, serde_json::to_vec_pretty(&report)?)?;
    println!("\nJSON: {}", path.display());
    Ok(path)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let n = args.iterations.unwrap_or(if args.quick { 10 } else { 40 });
    // Sections that need no server (nor root): run first; alone, they are the whole run.
    const SIMULATED: [&str; 4] = ["placement", "control-plane", "registry-pull", "gateway"];
    if args.only.is_empty() || args.only.iter().any(|o| o == "placement") {
        placement::section(args.quick);
    }
    if args.only.is_empty() || args.only.iter().any(|o| o == "control-plane") {
        control::section(args.quick)?;
    }
    if args.only.is_empty() || args.only.iter().any(|o| o == "registry-pull") {
        pull::section(args.quick)?;
    }
    if args.only.is_empty() || args.only.iter().any(|o| o == "gateway") {
        gateway::section(args.quick)?;
    }
    if !args.only.is_empty() && args.only.iter().all(|o| SIMULATED.contains(&o.as_str())) {
        return write_json(&args, n).map(drop);
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("run as root (scripts/bench)");
    }
    // Before any thread exists: everything this process starts shares the namespace.
    enter_private_mount_ns()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let server = Server::start("bench", false).await?;
        server.ensure_base(None).await?;
        server.delete_all().await;
        let images = server.client().list_images().await?;
        let digest = images.images.iter().find(|i| i.name == "base").context("base image")?.digest.clone();
        let blob = server.state_dir.join(format!("images/blobs/sha256/{}.erofs", digest.trim_start_matches("sha256:")));
        let bundle = Bundle::new(&std::env::temp_dir().join("dsec-bench-bundle"), &blob)?;
        bundle.configure(&["true"], false)?;

        println!("# dsec benchmark ({} iterations, {} cores, kernel {})", n, std::thread::available_parallelism().map(|p| p.get()).unwrap_or(0),
            std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim());
        println!("{}", startup::machine_line());
        record("machine", serde_json::json!([{
            "cpuid_us": startup::cpuid_us(), "idle": startup::idle_policy(),
        }]));
        let want = |section: &str| args.only.is_empty() || args.only.iter().any(|o| o == section);
        let (mut tti, mut exec) = (Vec::new(), Vec::new());
        if want("runtimes") {
            let crun = runtime_run("crun", &bundle, n);
            let crun_ovl = crun_run_overlay(&bundle, n);
            let runc = runtime_run("runc", &bundle, n);
            let (dsec_tti, dsec_create, dsec_exec) = dsec_measurements(&server, n).await?;
            let crun_exec = crun_exec(&bundle, n * 5, n * 2);
            let podman = peers::podman(&bundle.rootfs, n.min(20));
            let bwrap = peers::bwrap(&bundle.rootfs, n);
            let floor = peers::raw_floor(&bundle.rootfs, n);
            let sdk = python_sdk(&server, n, SdkMode::TimeToInteractive);
            let sdk_exec = python_sdk(&server, n * 5, SdkMode::Exec);
            let sdk_aexec = python_sdk(&server, n * 5, SdkMode::AsyncExec);
            // Issue #8's targets, each against the peer measured in this run.
            let ratio = |peer: &Stats, v: f64| if peer.samples.is_empty() { "n/a".to_string() } else { format!("{v:.2}x") };
            let d = dsec_tti.pct(50.0);
            let targets = format!("targets: dsec create + exec true {d:.2} ms = {} crun run true (<= 1.0x); podman run true / dsec = {} (>= 20x)",
                ratio(&crun, d / crun.pct(50.0)), ratio(&podman, podman.pct(50.0) / d));
            tti = vec![crun, crun_ovl, runc, podman, bwrap, floor, dsec_tti, sdk, dsec_create];
            print_table("time to interactive (create -> first command done)", &tti, "crun run true");
            println!("\n{targets}");
            exec = print_exec_tables(&bundle, dsec_exec, crun_exec, [sdk_exec, sdk_aexec], n);
        } else if want("exec") {
            // The exec tables alone (part of `runtimes`), for quick before/after runs.
            let dsec_exec = dsec_exec_round_trip(&server, n).await?;
            let sdk_exec = python_sdk(&server, n * 5, SdkMode::Exec);
            let sdk_aexec = python_sdk(&server, n * 5, SdkMode::AsyncExec);
            let crun_exec = crun_exec(&bundle, n * 5, n * 2);
            exec = print_exec_tables(&bundle, dsec_exec, crun_exec, [sdk_exec, sdk_aexec], n);
        }
        if want("pools") {
            let rows = pools::claim_vs_cold(&server, n).await?;
            print_table("warm pool claim vs cold create (time to interactive)", &rows, "dsec create + exec true");
            let (claim, floor) = (rows[2].pct(50.0), rows[3].pct(50.0));
            let (rest, rest_floor) = (rows[4].pct(50.0), rows[5].pct(50.0));
            println!("\nserver time of a claim (claim p50 - health p50): {:.2} ms back to back while the pool refills, {:.2} ms on a node at rest (target <= 1 ms)", claim - floor, rest - rest_floor);
        }
        if want("rollouts") {
            let rows = rollouts::record_overhead(&server, n).await?;
            print_table("exec round trip with and without a recorded outcome", &rows, "exec true");
            println!(
                "\ntarget: recording costs <= 3% of exec p50: {:+.1}%",
                (rows[1].pct(50.0) / rows[0].pct(50.0) - 1.0) * 100.0
            );
            let groups = rollouts::fork_vs_creates(&server, if args.quick { 1 } else { 3 }).await?;
            rollouts::print_groups(&groups);
        }
        if want("events") {
            let rows = events::overhead(&server, n).await?;
            print_table("time to interactive with events and traces off and on", &rows, "create + exec true, events off");
            println!(
                "\ntarget: events, and events with traces, cost <= 3% of time to interactive (p50): {:+.1}%, {:+.1}%",
                (rows[1].pct(50.0) / rows[0].pct(50.0) - 1.0) * 100.0,
                (rows[2].pct(50.0) / rows[0].pct(50.0) - 1.0) * 100.0
            );
        }
        if want("isolation") {
            let rows = isolation::costs(&server, n).await?;
            print_table(
                "isolation levels: time to interactive, exec round trip, idle memory",
                &rows,
                "create + exec true, container",
            );
            isolation::microvm_density(&server, if args.quick { 2 } else { 8 }).await?;
        }
        if want("autoscale") {
            let dir = dsec_e2e::target_dir().join("dsec-bench");
            std::fs::create_dir_all(&dir)?;
            // The default-like target (refills keep up on this node: the pool stays
            // small), then one below a create's time here (the pool has to grow).
            for target_ms in [200, 5] {
                let samples = autoscale_trace::trace(&server, target_ms).await?;
                let svg = dir.join(format!("autoscale-trace-{target_ms}ms.svg"));
                autoscale_trace::report(&samples, target_ms, &svg)?;
            }
        }
        if want("fncall") {
            let mut runs = Vec::new();
            let mut phases = fncall::Phases::default();
            if fncall::programs().iter().any(|p| p.image == "cpp") {
                fncall::ensure_cpp(&server).await?;
            }
            for prog in fncall::programs() {
                let quick = n < 20;
                let per_level = move |c: usize| {
                    if prog.language == "cpp" {
                        if quick { c.max(4) } else { (2 * c).max(8) }
                    } else {
                        (4 * c).max(n)
                    }
                };
                let (r, p) = fncall::measure(&server, &prog, &[1, 8, 32], per_level).await?;
                runs.extend(r);
                phases.rows.extend(p.rows);
            }
            fncall::print(&runs, &phases);
        }
        if want("network") {
            let net = network::tti_by_mode(&server, n).await?;
            print_table("time to interactive by network mode (create -> exec true)", &net, "network none");
            let ns = network::tti_by_userns(&server, n).await?;
            print_table("time to interactive with and without the user namespace", &ns, "no user namespace");
        }
        let (mut conc, mut sdk_conc) = (Vec::new(), Vec::new());
        let levels: &[usize] = if args.quick { &[1, 8, 32] } else { &[1, 8, 32, 128] };
        for workers in levels.iter().copied().filter(|_| want("concurrency")) {
            let total = if args.quick { 32 } else { 160 }.max(workers * 2);
            conc.push(Ok(concurrent_tti(&server, workers, total).await));
            sdk_conc.push(python_sdk_concurrency(&server, workers, total));
        }
        if !conc.is_empty() {
            print_concurrency("time to interactive under concurrency (create -> exec true -> delete loops)", &conc);
            print_concurrency(
                "time to interactive under concurrency through the Python SDK (asyncio tasks in one process)",
                &sdk_conc,
            );
        }
        if want("sustained") {
            let secs = args.sustained_secs.unwrap_or(if args.quick { 10 } else { 60 });
            let r = churn::sustained(&server, 32, secs).await;
            println!("\n## sustained creation: create -> exec true -> delete loops for {secs} s\n");
            println!("| concurrency | s | cycles | failed | cycles/s | p50 ms | p99 ms | create p50 ms | create p99 ms | delete p50 ms | delete p99 ms | host CPU ms/cycle |");
            println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
            println!("| {} | {:.0} | {} | {} | {:.0} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.1} |", r.workers, r.secs, r.ok(), r.failed,
                r.rate(), r.tti.pct(50.0), r.tti.pct(99.0), r.create.pct(50.0), r.create.pct(99.0),
                r.delete.pct(50.0), r.delete.pct(99.0), r.cpu_per_cycle());
            record("sustained creation", serde_json::json!([r.json()]));
        }
        if want("backlog") {
            let b = churn::backlog(&server, 20, 60).await?;
            println!("\n## a full node under a burst ({} creates at once, room for 20)\n", b.attempted);
            println!("| admitted | refused (capacity) | other errors | refusal p50 ms | left behind |");
            println!("|---|---|---|---|---|");
            println!("| {} | {} | {} | {:.2} | {} |", b.admitted, b.refused, b.other, b.refusal_p50_ms, b.leftovers);
            record("backlog", serde_json::json!([{"attempted": b.attempted, "admitted": b.admitted,
                "refused": b.refused, "other": b.other, "refusal_p50_ms": b.refusal_p50_ms,
                "leftovers": b.leftovers}]));
        }
        if want("teardown") {
            let t = churn::teardown(&server, if args.quick { 20 } else { 100 }).await?;
            println!("\n## teardown\n");
            println!("| deletes | p50 ms | p99 ms | max ms | mounts+cgroups+processes left | state dirs left |");
            println!("|---|---|---|---|---|---|");
            println!("| {} | {:.2} | {:.2} | {:.2} | {} | {} |", t.delete.samples.len(), t.delete.pct(50.0),
                t.delete.pct(99.0), t.delete.pct(100.0), t.leftovers, t.dirs);
            record("teardown", serde_json::json!([{"deletes": t.delete.samples.len(),
                "p50_ms": t.delete.pct(50.0), "p99_ms": t.delete.pct(99.0), "max_ms": t.delete.pct(100.0),
                "leftovers": t.leftovers, "dirs_left": t.dirs}]));
        }

        if want("cpu") {
            let steps = if args.quick { 300 } else { 1000 };
            let protection = lifecycle::cpu_protection(&server, steps).await?;
            print_table("CPU protection: step time of a latency-sensitive loop (1 ms work, 1 ms sleep)", &protection, "alone");
            let core = server.client().health().await?.capacity.is_some_and(|c| c.core_scheduling);
            println!("\ncore scheduling: {}", if core {
                "on (each sandbox has its own cookie)"
            } else {
                "n/a: this kernel has no CONFIG_SCHED_CORE (dsec uses it where present)"
            });
        }
        if want("job") {
            let job_n = if args.quick { 20 } else { 100 };
            let job = lifecycle::job_suspend_resume(&server, job_n).await?;
            println!("\n## job suspend/resume ({} sandboxes, 16 MiB page cache each)\n", job.sandboxes);
            println!("| suspend ms | resume ms | memory before MiB | memory after MiB | returned | exec after resume p50 ms |");
            println!("|---|---|---|---|---|---|");
            println!("| {:.0} | {:.0} | {:.0} | {:.0} | {:.0}% | {:.2} |", job.suspend_ms, job.resume_ms,
                job.memory_before as f64 / 1048576.0, job.memory_after as f64 / 1048576.0,
                100.0 * (1.0 - job.memory_after as f64 / job.memory_before.max(1) as f64), job.exec_after_resume.pct(50.0));
        }
        if want("idle") {
            let idle_n = if args.quick { 50 } else { 200 };
            let (mib, procs, threads, fds, idle_exec) = lifecycle::idle_cost(&server, idle_n).await?;
            println!("\n## cost of an idle sandbox (with one open shell session), {idle_n} sandboxes\n");
            println!("| host memory MiB | processes | threads | fds | exec true p50 ms | exec true p99 ms |");
            println!("|---|---|---|---|---|---|");
            println!("| {mib:.2} | {procs:.1} | {threads:.1} | {fds:.1} | {:.2} | {:.2} |", idle_exec.pct(50.0), idle_exec.pct(99.0));
        }
        if want("idle-cpu") {
            let n = args.idle_cpu_n.unwrap_or(if args.quick { 100 } else { 500 });
            let secs = args.idle_cpu_secs.unwrap_or(if args.quick { 10 } else { 60 });
            let r = lifecycle::idle_cpu(&server, n, secs).await?;
            let pct = |ms: f64| 100.0 * ms / (r.secs * 1000.0);
            println!("\n## CPU of an idle node: {} sandboxes without sessions or calls, {:.0} s\n", r.sandboxes, r.secs);
            println!("| sandboxes | their processes | dsec serve ms | sandboxes ms | host busy ms | dsec serve % of a core | sandboxes % of a core |");
            println!("|---|---|---|---|---|---|---|");
            println!("| {} | {} | {:.0} | {:.0} | {:.0} | {:.2} | {:.2} |", r.sandboxes, r.sandbox_processes, r.server_ms, r.sandboxes_ms,
                r.host_ms, pct(r.server_ms), pct(r.sandboxes_ms));
            record("idle cpu", serde_json::json!([{"sandboxes": r.sandboxes, "processes": r.sandbox_processes, "secs": r.secs,
                "server_ms": r.server_ms, "sandboxes_ms": r.sandboxes_ms, "host_ms": r.host_ms}]));
        }
        if want("density") {
            let target = if args.quick { 300 } else { 1000 };
            let d = lifecycle::density(&server, target).await?;
            println!("\n## density: idle sandboxes with a shell session each ({})\n", d.stopped);
            println!("| sandboxes | created in s | host memory MiB per sandbox | exec true p50 ms | exec true p99 ms |");
            println!("|---|---|---|---|---|");
            println!("| {} | {:.1} | {:.2} | {:.2} | {:.2} |", d.sandboxes, d.create_secs, d.mib_per_sandbox, d.exec.pct(50.0), d.exec.pct(99.0));
        }

        if want("files") {
            let n = if args.quick { 5000 } else { 20000 };
            let rows = files::churn(&server, n).await?;
            println!("\n## file churn: creating {n} files fresh and right after deleting {n}\n");
            println!("| where | fresh us/file | after a delete us/file | slowdown |");
            println!("|---|---|---|---|");
            for r in &rows {
                println!("| {} | {:.1} | {:.1} | {:.1}x |", r.name, r.fresh_us, r.after_delete_us, r.after_delete_us / r.fresh_us);
            }
            record("file churn", rows.iter().map(|r| serde_json::json!({"where": r.name,
                "fresh_us": r.fresh_us, "after_delete_us": r.after_delete_us})).collect());
        }
        if want("cluster") {
            let n = args.iterations.unwrap_or(if args.quick { 10 } else { 100 });
            let secs = args.sustained_secs.unwrap_or(if args.quick { 5 } else { 30 });
            cluster::section(&server, n, secs).await?;
        }
        if want("provision") {
            provision_section(&server, if args.quick { 1 } else { 5 }).await?;
        }
        if want("burst") {
            let n = args.burst_n.unwrap_or(if args.quick { 48 } else { 256 });
            let throttle = dsec_e2e::blobserver::Throttle {
                bytes_per_sec: args.store_mibps << 20,
                latency: std::time::Duration::from_millis(args.store_latency_ms),
            };
            let images = args.burst_images.unwrap_or(if args.quick { 4 } else { 16 });
            burst_section(n, images, throttle, args.chunk_kib).await?;
        }

        if want("images") {
            images::section(&server, args.quick).await?;
        }

        let left = server.client().list_sandboxes(Default::default()).await?.sandboxes.len();
        // Sandbox cgroups are the subdirectories (the parent also holds control files).
        let cgroups = std::fs::read_dir(
            Path::new("/sys/fs/cgroup/memory").join(dsec_e2e::TEST_CGROUP_PARENT),
        )
            .map(|d| d.flatten().filter(|e| e.path().is_dir()).count())
            .unwrap_or(0);
        println!("\nleft behind after the run: {left} sandboxes, {cgroups} sandbox cgroups (v1 memory hierarchy)");
        let path = write_json(&args, n)?;
        let panels = std::mem::take(&mut *PLOTS.lock().unwrap_or_else(|p| p.into_inner()));
        if !panels.is_empty() {
            let svg = path.with_extension("svg");
            std::fs::write(&svg, plot::svg(&panels))?;
            println!("latency distributions: {}", svg.display());
        }
        let _ = (&tti, &exec);
        drop(bundle);
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(())
}

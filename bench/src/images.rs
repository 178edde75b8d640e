//! Images (issue #26): dsec against podman, measured side by side in one run.
//!
//! **Cold pull to first command.** A multi-layer image of about 500 MB (gzip): the Debian
//! base rootfs ($DSEC_BASE_TAR) as its bottom layer and [`NOISE_LAYERS`] layers of
//! incompressible data (`--quick`: one, ~190 MB), pushed to a local docker-registry on
//! loopback. Every sample
//! starts with nothing of the image on the machine and ends when `true`'s answer is back:
//! - dsec: a fresh `dsec serve` state (empty image store; the server started and its
//!   pools filled untimed), `POST /v1/images/pull`, a create of the image, `exec true`;
//! - podman: fresh storage (`--root`/`--runroot` in a temp directory, initialised
//!   untimed), `podman pull` then `podman run --rm IMAGE true`;
//! - dsec on a shared blob store that already holds the image (a node pulled it into the
//!   store before, untimed): a fresh node state on that store creates a sandbox naming
//!   the image and execs `true`, with `--lazy-layers` (layers served on demand) and with
//!   whole layers copied from the store.
//!
//! **Dockerfile build, 5 steps, cold and cached.** `FROM base`, a `RUN` writing 50 MiB,
//! `COPY` of a context of [`CONTEXT_FILES`] small files, `WORKDIR`, `ENV`, a `RUN` over
//! the copied files. dsec: `dsec image build --no-cache -f Dockerfile CONTEXT NAME`
//! against a fresh server (base imported untimed), then the same without `--no-cache`;
//! podman: `podman build` on fresh storage (base `podman import`ed untimed), then again.
//!
//! After the tables, where the time went: a dsec pull by phase and by layer (from its
//! progress events), a cold build by step (each tool's step announcements, timed as they
//! arrive).
//!
//! Rows are interleaved (one sample of each per round). Everything the section starts is
//! stopped by pid (servers, registry) and its directories, podman storage and mounts are
//! removed; what is left is reported.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use dsec_client::Client;
use dsec_e2e::Server;
use dsec_testkit::{oci_layout, Registry};
use dsec_wire::v1::{CreateSandboxRequest, ImportEvent, PullImageRequest};
use futures::StreamExt;

use crate::{argv_true, print_table, print_table_vs, time_cmd, HostCpu, Stats};

/// Layers of incompressible data above the base layer (`--quick`: one).
const NOISE_LAYERS: usize = 4;
const QUICK_NOISE_LAYERS: usize = 1;
/// Files per noise layer, each [`FILE_BYTES`].
const FILES_PER_LAYER: usize = 25;
const FILE_BYTES: usize = 4 << 20;
/// Repository and tag of the image in the registry.
const REPO: &str = "bench/images";
const TAG: &str = "v1";
/// Cgroup parent of the section's servers (one runs at a time).
const CGROUP: &str = "dsec-bench-images";
/// Prefix of the section's server names (`/tmp/dsec-e2e/NAME`, `/run/dsec-e2e/NAME`).
const SERVER_PREFIX: &str = "bench-images";
/// Small files in the build context.
const CONTEXT_FILES: usize = 2000;
/// Rounds (each a sample of every row), full run and `--quick`.
const ROUNDS: usize = 3;
const QUICK_ROUNDS: usize = 1;
/// Longest wait for the host to go quiet before a sample.
const SETTLE: Duration = Duration::from_secs(30);

/// The Dockerfile of the build table: 5 steps.
const DOCKERFILE: &str = r#"FROM base
RUN mkdir -p /opt/gen && i=0 && while [ $i -lt 50 ]; do head -c 1048576 /dev/urandom > /opt/gen/blob-$i; i=$((i+1)); done
COPY src/ /opt/src/
WORKDIR /opt/src
ENV BENCH_STAGE=checked
RUN find . -type f | sort | xargs cat | sha256sum > /opt/src.sha256 && find . -type f | wc -l > /opt/src.count
"#;

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

/// The section's temporary directory: mounts under it are detached before it goes.
struct Scratch(tempfile::TempDir);

impl Scratch {
    fn new() -> anyhow::Result<Self> {
        Ok(Self(
            tempfile::Builder::new()
                .prefix("dsec-bench-images-")
                .tempdir()
                .context("the images section's temp directory")?,
        ))
    }

    fn path(&self) -> &Path {
        self.0.path()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        dsec_e2e::unmount_under(self.0.path());
    }
}

/// A layer tar of [`FILES_PER_LAYER`] files of xorshift noise under `/opt/data/layer-N`.
fn noise_layer(dir: &Path, n: usize) -> anyhow::Result<PathBuf> {
    let path = dir.join(format!("noise-{n}.tar"));
    let file = std::fs::File::create(&path).with_context(|| format!("{}", path.display()))?;
    let mut b = tar::Builder::new(std::io::BufWriter::new(file));
    let header = |size: usize, mode: u32, kind: tar::EntryType| {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_size(size as u64);
        h.set_mode(mode);
        h.set_mtime(0);
        h.set_uid(0);
        h.set_gid(0);
        h.set_cksum();
        h
    };
    for d in ["opt/data/".to_string(), format!("opt/data/layer-{n}/")] {
        let mut h = header(0, 0o755, tar::EntryType::Directory);
        b.append_data(&mut h, d, std::io::empty())?;
    }
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15 ^ (n as u64 + 1);
    let mut buf = vec![0u8; FILE_BYTES];
    for f in 0..FILES_PER_LAYER {
        for word in buf.chunks_exact_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            word.copy_from_slice(&x.to_le_bytes());
        }
        let mut h = header(FILE_BYTES, 0o644, tar::EntryType::Regular);
        b.append_data(
            &mut h,
            format!("opt/data/layer-{n}/file-{f:02}.bin"),
            buf.as_slice(),
        )?;
    }
    b.into_inner()?
        .into_inner()
        .map_err(|e| e.into_error())
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// The image in a registry on loopback.
struct RegistryImage {
    registry: Registry,
    /// `127.0.0.1:PORT/bench/images:v1`.
    reference: String,
    /// Bytes of its layer blobs as the registry serves them (gzip).
    compressed: u64,
    /// Layers.
    layers: usize,
}

/// Builds the image (the base and `noise_layers` layers of noise) in `dir`, pushes it
/// (gzip) to a new registry and removes the local copies. `None` if docker-registry or
/// skopeo is missing.
fn seed_image(dir: &Path, noise_layers: usize) -> anyhow::Result<Option<RegistryImage>> {
    let base = dsec_e2e::base_tar();
    if !base.is_file() {
        bail!(
            "{} missing: run scripts/build-base-image.sh",
            base.display()
        );
    }
    let Some(registry) = Registry::start("bench images") else {
        return Ok(None);
    };
    let work = dir.join("seed");
    std::fs::create_dir_all(&work)?;
    let mut tars = vec![base];
    for n in 0..noise_layers {
        tars.push(noise_layer(&work, n)?);
    }
    let refs: Vec<&Path> = tars.iter().map(PathBuf::as_path).collect();
    let layout = oci_layout(&work.join("layout"), &refs, "amd64", &[]);
    registry.seed(&layout, &format!("{REPO}:{TAG}"), "gzip");
    std::fs::remove_dir_all(&work)?;
    let (manifest, _) = registry.manifest(REPO, TAG);
    let sizes: Vec<u64> = manifest["layers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|l| l["size"].as_u64())
        .collect();
    Ok(Some(RegistryImage {
        reference: format!("{}/{REPO}:{TAG}", registry.addr()),
        compressed: sizes.iter().sum(),
        layers: sizes.len(),
        registry,
    }))
}

/// Flags of every server of the section: no network, small pools, this registry.
fn node_args<'a>(registry: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "--cgroup-parent",
        CGROUP,
        "--no-network",
        "--disk-pool",
        "2",
        "--netns-pool",
        "2",
        "--allow-registry",
        registry,
        "--insecure-registry",
        registry,
    ];
    args.extend_from_slice(extra);
    args
}

/// A fresh server (its state directory wiped first), started and settled.
async fn fresh_node(role: &str, args: &[&str]) -> anyhow::Result<Server> {
    let s = Server::start_with(&format!("{SERVER_PREFIX}-{role}"), true, args).await?;
    HostCpu::settle(SETTLE).await;
    Ok(s)
}

/// Deletes the server's sandboxes and stops it (SIGTERM: with no sandbox left a node
/// leaves nothing on the host but its state directory); `dsec serve --cleanup` if the
/// stop was not clean. Dropping it then removes its directories.
async fn stop(mut s: Server) {
    s.delete_all().await;
    let clean = matches!(s.terminate(Duration::from_secs(60)), Some(st) if st.success());
    if !clean {
        match s.cleanup() {
            Ok(o) if o.status.success() => {}
            Ok(o) => eprintln!(
                "images: dsec serve --cleanup failed: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            ),
            Err(e) => eprintln!("images: {e:#}"),
        }
    }
    drop(s);
}

/// Runs `f` on `s`, then stops `s` whatever `f` returned.
async fn with_node<T>(
    s: Server,
    f: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    let r = f.await;
    stop(s).await;
    r
}

/// Creates a sandbox of `image` and runs `true` in it; the sandbox's id once `true`'s
/// answer is back.
async fn first_command(c: &Client, image: &str) -> anyhow::Result<String> {
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            image: Some(image.to_string()),
            ..Default::default()
        })
        .await
        .with_context(|| format!("create of {image}"))?;
    let r = c.exec(&sb.id, argv_true()).await;
    match r {
        Ok(r) if r.exit.exit_code == Some(0) => Ok(sb.id),
        Ok(r) => {
            let _ = c.delete_sandbox(&sb.id).await;
            bail!("exec true failed: {r:?}")
        }
        Err(e) => {
            let _ = c.delete_sandbox(&sb.id).await;
            Err(e.into())
        }
    }
}

/// Where a pull's time went, from its progress events: each interval between two events
/// counts for the phase the later one reports.
#[derive(Debug, Default)]
struct Phases {
    /// Milliseconds per phase (`resolving`, `downloading`, `extracting`, `building`,
    /// `hashing`, `storing`).
    total: std::collections::BTreeMap<String, f64>,
    /// Milliseconds extracting (data into the EROFS image) and building (its metadata)
    /// per converted layer, bottom first (a layer starts where `extracting` follows
    /// another phase).
    layers: Vec<(f64, f64)>,
    /// The phase of the last event.
    last: String,
}

impl Phases {
    fn add(&mut self, phase: &str, ms: f64) {
        *self.total.entry(phase.to_string()).or_default() += ms;
        match phase {
            "extracting" => {
                if self.last != "extracting" {
                    self.layers.push((0.0, 0.0));
                }
                if let Some(l) = self.layers.last_mut() {
                    l.0 += ms;
                }
            }
            "building" => {
                if let Some(l) = self.layers.last_mut() {
                    l.1 += ms;
                }
            }
            _ => {}
        }
        self.last = phase.to_string();
    }
}

/// `POST /v1/images/pull` of `reference` until its `Done`; where the time went.
async fn pull(c: &Client, reference: &str) -> anyhow::Result<Phases> {
    let t = Instant::now();
    let mut events = c
        .pull_image_stream(PullImageRequest {
            reference: reference.to_string(),
            name: None,
            insecure: true,
        })
        .await?;
    let (mut phases, mut last) = (Phases::default(), 0.0);
    while let Some(ev) = events.next().await {
        let now = ms_since(t);
        match ev? {
            ImportEvent::Done { .. } => {
                phases.add("done", now - last);
                return Ok(phases);
            }
            ImportEvent::Error { error } => {
                bail!("pull of {reference}: {:?}: {}", error.code, error.message)
            }
            ImportEvent::Progress { phase, .. } => phases.add(&phase, now - last),
        }
        last = now;
    }
    bail!("the pull of {reference} ended without a result")
}

/// One dsec pull sample.
struct PullSample {
    /// Pull + create + exec `true`, ms.
    total: f64,
    /// The pull alone, ms.
    pulled: f64,
    phases: Phases,
}

/// dsec, fresh state: pull + create + exec `true`.
async fn dsec_pull_sample(image: &RegistryImage) -> anyhow::Result<PullSample> {
    let addr = image.registry.addr();
    let s = fresh_node("pull", &node_args(&addr, &[])).await?;
    let c = s.client();
    with_node(s, async {
        let t = Instant::now();
        let phases = pull(&c, &image.reference).await?;
        let pulled = ms_since(t);
        let id = first_command(&c, &image.reference).await?;
        let total = ms_since(t);
        c.delete_sandbox(&id).await?;
        Ok::<_, anyhow::Error>(PullSample {
            total,
            pulled,
            phases,
        })
    })
    .await
}

/// dsec, fresh state on a shared blob store that holds the image: create + exec `true`.
async fn dsec_store_sample(image: &RegistryImage, store: &str, lazy: bool) -> anyhow::Result<f64> {
    let addr = image.registry.addr();
    let mut extra = vec!["--blob-store", store];
    if lazy {
        extra.extend(["--lazy-layers", "--prefetch-window-s", "0"]);
    }
    let role = if lazy { "lazy" } else { "store" };
    let s = fresh_node(role, &node_args(&addr, &extra)).await?;
    let c = s.client();
    with_node(s, async {
        let t = Instant::now();
        let id = first_command(&c, &image.reference).await?;
        let total = ms_since(t);
        c.delete_sandbox(&id).await?;
        Ok::<_, anyhow::Error>(total)
    })
    .await
}

/// Pulls the image into the shared blob store `store` through a node of its own
/// (untimed), so that later nodes on the store find its layers and name there.
async fn fill_store(image: &RegistryImage, store: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(store)?;
    let addr = image.registry.addr();
    let store_flag = store.display().to_string();
    let s = fresh_node("fill", &node_args(&addr, &["--blob-store", &store_flag])).await?;
    let c = s.client();
    with_node(s, async { pull(&c, &image.reference).await }).await?;
    if !store.join("refs").is_dir() {
        bail!("the pull left no refs in {}", store.display());
    }
    Ok(())
}

/// Podman with all of its state (storage, run root, libpod tmp) in one directory,
/// removed (its mounts detached first) when dropped.
struct Podman {
    dir: PathBuf,
}

impl Podman {
    /// Fresh storage in `parent/name`, initialised (untimed).
    fn fresh(parent: &Path, name: &str) -> anyhow::Result<Self> {
        let dir = parent.join(name);
        if dir.exists() {
            dsec_e2e::unmount_under(&dir);
            std::fs::remove_dir_all(&dir)?;
        }
        std::fs::create_dir_all(&dir)?;
        let p = Podman { dir };
        time_cmd(p.cmd().args(["images", "-q"]))?;
        Ok(p)
    }

    fn cmd(&self) -> Command {
        let mut c = Command::new("podman");
        c.arg("--root")
            .arg(self.dir.join("root"))
            .arg("--runroot")
            .arg(self.dir.join("runroot"))
            .arg("--tmpdir")
            .arg(self.dir.join("tmp"))
            .args(["--storage-driver", "overlay"])
            .args(["--cgroup-manager", "cgroupfs"])
            .args(["--events-backend", "none"]);
        c
    }

    /// `podman run --rm IMAGE ARGS...` (runc, no network); its stdout.
    fn run(&self, image: &str, args: &[&str]) -> anyhow::Result<String> {
        let out = self
            .cmd()
            .args(["run", "--rm", "--network", "none", "--runtime", "runc"])
            .arg(image)
            .args(args)
            .output()?;
        if !out.status.success() {
            bail!(
                "podman run {image} failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        dsec_e2e::unmount_under(&self.dir);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// podman, fresh storage: `podman pull` + `podman run --rm IMAGE true`. Total and pull ms.
fn podman_pull_sample(dir: &Path, image: &RegistryImage) -> anyhow::Result<(f64, f64)> {
    let p = Podman::fresh(dir, "podman-pull")?;
    let t = Instant::now();
    time_cmd(
        p.cmd()
            .args(["pull", "--quiet", "--tls-verify=false"])
            .arg(&image.reference),
    )?;
    let pulled = ms_since(t);
    p.run(&image.reference, &["true"])?;
    Ok((ms_since(t), pulled))
}

/// One row's samples, or why it has none.
struct Row {
    name: &'static str,
    note: String,
    samples: Vec<f64>,
    /// A part of each sample (the pull), for the note.
    parts: Vec<f64>,
    error: Option<String>,
}

impl Row {
    fn new(name: &'static str, note: impl Into<String>) -> Self {
        Row {
            name,
            note: note.into(),
            samples: Vec::new(),
            parts: Vec::new(),
            error: None,
        }
    }

    /// Whether to take another sample (no error so far).
    fn live(&self) -> bool {
        self.error.is_none()
    }

    fn add(&mut self, r: anyhow::Result<f64>) {
        match r {
            Ok(ms) => self.samples.push(ms),
            Err(e) => {
                eprintln!("images: {}: {e:#}", self.name);
                self.error = Some(format!("{e:#}"));
            }
        }
    }

    fn add_with_part(&mut self, r: anyhow::Result<(f64, f64)>) {
        if let Ok((_, part)) = &r {
            self.parts.push(*part);
        }
        self.add(r.map(|(ms, _)| ms));
    }

    fn stats(self, part: &str) -> Stats {
        if let Some(why) = self.error {
            return Stats::na(self.name, why);
        }
        let note = if self.parts.is_empty() {
            self.note
        } else {
            let parts = Stats {
                name: String::new(),
                samples: self.parts,
                note: None,
            };
            format!("{}; {part} p50 {:.0} ms of it", self.note, parts.pct(50.0))
        };
        Stats {
            name: self.name.into(),
            samples: self.samples,
            note: Some(note),
        }
    }
}

/// Whether `podman` runs here.
fn have_podman() -> bool {
    Command::new("podman")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Table 1: cold pull to the first command.
async fn pull_table(scratch: &Path, image: &RegistryImage, rounds: usize) -> anyhow::Result<()> {
    let mib = image.compressed as f64 / 1048576.0;
    let mut dsec = Row::new(
        "dsec pull + create + exec true",
        "fresh dsec serve (empty image store): POST /v1/images/pull, create, exec",
    );
    let mut podman = Row::new(
        "podman pull + run true",
        "fresh --root/--runroot: podman pull, podman run --rm (runc, network none)",
    );
    let mut lazy = Row::new(
        "dsec --lazy-layers, layers in the shared store",
        "fresh node state on a --blob-store holding the image: create naming it, exec \
         (layers served on demand, no prefetch list)",
    );
    let mut whole = Row::new(
        "dsec, layers in the shared store (whole)",
        "fresh node state on a --blob-store holding the image: create naming it, exec \
         (each layer copied whole into the node's cache first)",
    );
    let store = scratch.join("blob-store");
    if let Err(e) = fill_store(image, &store).await {
        let why = format!("filling the shared store: {e:#}");
        lazy.error = Some(why.clone());
        whole.error = Some(why);
    }
    let store_flag = store.display().to_string();
    if !have_podman() {
        podman.error = Some("podman not installed".into());
    }
    let mut phases: Vec<Phases> = Vec::new();
    for _ in 0..rounds {
        if dsec.live() {
            let r = dsec_pull_sample(image).await.map(|s| {
                phases.push(s.phases);
                (s.total, s.pulled)
            });
            dsec.add_with_part(r);
        }
        if podman.live() {
            HostCpu::settle(SETTLE).await;
            podman.add_with_part(podman_pull_sample(scratch, image));
        }
        if lazy.live() {
            lazy.add(dsec_store_sample(image, &store_flag, true).await);
        }
        if whole.live() {
            whole.add(dsec_store_sample(image, &store_flag, false).await);
        }
    }
    let _ = std::fs::remove_dir_all(&store);
    let rows = vec![
        podman.stats("pull"),
        dsec.stats("pull"),
        lazy.stats(""),
        whole.stats(""),
    ];
    let title = format!(
        "cold pull to first command: {} layers, {mib:.0} MiB gzip, from a registry on loopback",
        image.layers
    );
    print_table(&title, &rows, "podman pull + run true");
    let p50 = |name: &str| {
        rows.iter()
            .find(|r| r.name == name && !r.samples.is_empty())
            .map(|r| r.pct(50.0))
    };
    let speedup = |name: &str| match (p50("podman pull + run true"), p50(name)) {
        (Some(p), Some(d)) => format!("{:.2}x", p / d),
        _ => "n/a".into(),
    };
    println!(
        "\ntargets (issue #26): podman / dsec to the first command {} (>= 2x); with the layers \
         in a shared store, lazy {}, whole layers {}",
        speedup("dsec pull + create + exec true"),
        speedup("dsec --lazy-layers, layers in the shared store"),
        speedup("dsec, layers in the shared store (whole)"),
    );
    print_phases(&phases);
    Ok(())
}

/// The median of `v` (NaN if empty).
fn median(v: Vec<f64>) -> f64 {
    Stats {
        name: String::new(),
        samples: v,
        note: None,
    }
    .pct(50.0)
}

/// Where a dsec pull's time went, by phase and by layer (medians over the rounds).
fn print_phases(rounds: &[Phases]) {
    if rounds.is_empty() {
        return;
    }
    let order = [
        "resolving",
        "downloading",
        "extracting",
        "building",
        "hashing",
        "storing",
        "done",
    ];
    let mut names: Vec<&str> = order.to_vec();
    for p in rounds.iter().flat_map(|r| r.total.keys()) {
        if !names.contains(&p.as_str()) {
            names.push(p);
        }
    }
    let mut cells = Vec::new();
    let mut json = serde_json::Map::new();
    for name in names {
        let v: Vec<f64> = rounds
            .iter()
            .filter_map(|r| r.total.get(name).copied())
            .collect();
        if v.is_empty() {
            continue;
        }
        let ms = median(v);
        cells.push(format!("{name} {:.1} s", ms / 1000.0));
        json.insert(name.to_string(), ms.into());
    }
    let layers = rounds.iter().map(|r| r.layers.len()).max().unwrap_or(0);
    let mut per_layer = Vec::new();
    for i in 0..layers {
        let part = |f: fn(&(f64, f64)) -> f64| {
            median(
                rounds
                    .iter()
                    .filter_map(|r| r.layers.get(i).map(f))
                    .collect(),
            )
        };
        let (x, b) = (part(|l| l.0), part(|l| l.1));
        per_layer.push(format!("{:.1} + {:.1}", x / 1000.0, b / 1000.0));
        json.insert(
            format!("layer {} extracting+building", i + 1),
            serde_json::json!([x, b]),
        );
    }
    println!(
        "\ndsec pull by phase (its progress events; p50 of {} round(s)): {}",
        rounds.len(),
        cells.join(", ")
    );
    println!(
        "extracting + building (the EROFS metadata) per layer, bottom (the base rootfs) first, s: {}",
        per_layer.join("; ")
    );
    crate::record("dsec pull by phase (ms)", serde_json::Value::Object(json));
}

/// The build context: [`CONTEXT_FILES`] small text files under `src/` and the Dockerfile.
fn build_context(dir: &Path) -> anyhow::Result<PathBuf> {
    let ctx = dir.join("context");
    for i in 0..CONTEXT_FILES {
        let d = ctx.join(format!("src/d{:02}", i / 50));
        if i % 50 == 0 {
            std::fs::create_dir_all(&d)?;
        }
        let mut text = String::new();
        for line in 0..(20 + i % 40) {
            text.push_str(&format!("file {i} line {line}: the quick brown fox\n"));
        }
        std::fs::write(d.join(format!("f{i:04}.txt")), text)?;
    }
    std::fs::write(ctx.join("Dockerfile"), DOCKERFILE)?;
    Ok(ctx)
}

/// What the last step of the build wrote: the number of files copied.
fn check_count(out: &str, who: &str) -> anyhow::Result<()> {
    if out.trim() != CONTEXT_FILES.to_string() {
        bail!(
            "{who}: the built image counts {:?} files, not {CONTEXT_FILES}",
            out.trim()
        );
    }
    Ok(())
}

/// dsec: a fresh server with the base image (untimed), `dsec image build --no-cache`,
/// then the same build again (cached). Cold and cached ms.
async fn dsec_build_sample(main: &Server, ctx: &Path) -> anyhow::Result<(StepTimes, f64)> {
    let s = Server::start_with(
        &format!("{SERVER_PREFIX}-build"),
        true,
        &[
            "--cgroup-parent",
            CGROUP,
            "--no-network",
            "--disk-pool",
            "2",
            "--netns-pool",
            "2",
        ],
    )
    .await?;
    let (url, key, c) = (s.url.clone(), s.key.clone(), s.client());
    with_node(s, async {
        import_base(main, &c).await?;
        let build = |no_cache: bool| {
            let mut cmd = Command::new(dsec_e2e::dsec_bin());
            cmd.env("DSEC_URL", &url)
                .env("DSEC_API_KEY", &key)
                .args(["image", "build"]);
            if no_cache {
                cmd.arg("--no-cache");
            }
            cmd.arg("-f")
                .arg(ctx.join("Dockerfile"))
                .arg(ctx)
                .arg("bench-build");
            cmd
        };
        HostCpu::settle(SETTLE).await;
        let cold =
            time_steps(&mut build(true), dsec_step).context("dsec image build --no-cache")?;
        HostCpu::settle(SETTLE).await;
        let cached = time_steps(&mut build(false), dsec_step)
            .context("dsec image build (cached)")?
            .total;
        let sb = c
            .create_sandbox(CreateSandboxRequest {
                image: Some("bench-build".into()),
                ..Default::default()
            })
            .await?;
        let r = c.exec(&sb.id, dsec_e2e::sh("cat /opt/src.count")).await;
        c.delete_sandbox(&sb.id).await?;
        check_count(&r?.stdout, "dsec")?;
        Ok::<_, anyhow::Error>((cold, cached))
    })
    .await
}

/// Imports the main server's base image into the server of `c` (its EROFS layer file,
/// not the tarball: quick).
async fn import_base(main: &Server, c: &Client) -> anyhow::Result<()> {
    let images = main.client().list_images().await?;
    let digest = &images
        .images
        .iter()
        .find(|i| i.name == "base")
        .context("the main server has no base image")?
        .digest;
    let blob = main.state_dir.join(format!(
        "images/blobs/sha256/{}.erofs",
        digest.trim_start_matches("sha256:")
    ));
    c.import_image(dsec_wire::v1::ImportImageRequest {
        name: "base".into(),
        source: blob.display().to_string(),
        flatten: false,
    })
    .await?;
    Ok(())
}

/// podman: fresh storage with the base rootfs imported as `base` (untimed), `podman
/// build`, then the same build again (cached). Cold and cached ms.
fn podman_build_sample(dir: &Path, ctx: &Path) -> anyhow::Result<(StepTimes, f64)> {
    let p = Podman::fresh(dir, "podman-build")?;
    time_cmd(
        p.cmd()
            .arg("import")
            .arg(dsec_e2e::base_tar())
            .arg("localhost/base:latest"),
    )
    .context("podman import of the base rootfs")?;
    let build = || {
        let mut cmd = p.cmd();
        cmd.args([
            "build",
            "--runtime",
            "runc",
            "--network",
            "none",
            "--pull=never",
        ])
        .args(["-t", "bench-build", "-f"])
        .arg(ctx.join("Dockerfile"))
        .arg(ctx);
        cmd
    };
    let cold = time_steps(&mut build(), podman_step).context("podman build (cold)")?;
    let cached = time_steps(&mut build(), podman_step)
        .context("podman build (cached)")?
        .total;
    check_count(
        &p.run("localhost/bench-build", &["cat", "/opt/src.count"])?,
        "podman",
    )?;
    Ok((cold, cached))
}

/// Table 2: the Dockerfile build, cold and cached.
async fn build_table(main: &Server, scratch: &Path, rounds: usize) -> anyhow::Result<()> {
    let ctx = build_context(scratch)?;
    let mut dsec_cold = Row::new(
        "dsec image build, cold",
        "fresh dsec serve with base: dsec image build --no-cache -f Dockerfile CONTEXT NAME",
    );
    let mut dsec_cached = Row::new(
        "dsec image build, cached",
        "the same build again on that server (every step from the cache)",
    );
    let mut podman_cold = Row::new(
        "podman build, cold",
        "fresh --root with base (podman import, untimed): podman build (runc, network none)",
    );
    let mut podman_cached = Row::new(
        "podman build, cached",
        "the same build again on that storage (--layers cache)",
    );
    if !have_podman() {
        podman_cold.error = Some("podman not installed".into());
        podman_cached.error = Some("podman not installed".into());
    }
    let (mut dsec_steps, mut podman_steps) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        if dsec_cold.live() && dsec_cached.live() {
            let r = dsec_build_sample(main, &ctx).await;
            dsec_cached.add(
                r.as_ref()
                    .map(|r| r.1)
                    .map_err(|e| anyhow::anyhow!("{e:#}")),
            );
            dsec_cold.add(r.map(|(cold, _)| {
                dsec_steps.push(cold.steps);
                cold.total
            }));
        }
        if podman_cold.live() && podman_cached.live() {
            HostCpu::settle(SETTLE).await;
            let r = podman_build_sample(scratch, &ctx);
            podman_cached.add(
                r.as_ref()
                    .map(|r| r.1)
                    .map_err(|e| anyhow::anyhow!("{e:#}")),
            );
            podman_cold.add(r.map(|(cold, _)| {
                podman_steps.push(cold.steps);
                cold.total
            }));
        }
    }
    let _ = std::fs::remove_dir_all(&ctx);
    let rows = vec![
        podman_cold.stats(""),
        dsec_cold.stats(""),
        podman_cached.stats(""),
        dsec_cached.stats(""),
    ];
    print_table_vs(
        &format!(
            "Dockerfile build, 5 steps (RUN 50 MiB, COPY {CONTEXT_FILES} files, WORKDIR, ENV, RUN): \
             cold and cached"
        ),
        &rows,
        "p50 vs podman (same mode)",
        &|r: &Stats| {
            if r.name.ends_with("cold") {
                "podman build, cold".into()
            } else {
                "podman build, cached".into()
            }
        },
    );
    print_steps(&podman_steps, &dsec_steps);
    Ok(())
}

/// A command's wall time and the build steps it announced, each timed from its
/// announcement to the next one (the last to the command's exit).
struct StepTimes {
    total: f64,
    /// Label (the instruction as the tool printed it) and ms.
    steps: Vec<(String, f64)>,
}

/// Label given to the time before the first step (context upload, base lookup).
const START: &str = "(before the first step: context, base)";
/// Label given to what follows the last step's announcement line of a finished build.
const FINISH: &str = "(commit of the result, tag)";

/// The step a line of `dsec image build` announces (`[stage] step N/M: TEXT`, stderr),
/// or its end (`built NAME ...`, stdout).
fn dsec_step(line: &str) -> Option<String> {
    if line.starts_with("built ") {
        return Some(FINISH.into());
    }
    let (_, rest) = line.split_once("] step ")?;
    let (_, text) = rest.split_once(": ")?;
    Some(text.trim_end_matches(" (cached)").trim().to_string())
}

/// The step a line of `podman build` announces (`STEP N/M: TEXT`), or its end
/// (`COMMIT NAME`).
fn podman_step(line: &str) -> Option<String> {
    if line.starts_with("COMMIT ") {
        return Some(FINISH.into());
    }
    let rest = line.strip_prefix("STEP ")?;
    let (_, text) = rest.split_once(": ")?;
    Some(text.trim().to_string())
}

/// The lines `r` yields, each with the ms since `t` it arrived at.
fn timed_lines(r: impl std::io::Read, t: Instant) -> Vec<(f64, String)> {
    use std::io::BufRead;
    std::io::BufReader::new(r)
        .lines()
        .map_while(Result::ok)
        .map(|l| (ms_since(t), l))
        .collect()
}

/// Runs `cmd` (stdout and stderr read as they come) and times the steps `step` finds in
/// its lines.
fn time_steps(cmd: &mut Command, step: fn(&str) -> Option<String>) -> anyhow::Result<StepTimes> {
    use std::process::Stdio;
    let t = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {cmd:?}"))?;
    let stderr = child.stderr.take().context("no stderr pipe")?;
    let errs = std::thread::spawn(move || timed_lines(stderr, t));
    let outs = match child.stdout.take() {
        Some(stdout) => timed_lines(stdout, t),
        None => Vec::new(),
    };
    let errs = errs
        .join()
        .map_err(|_| anyhow::anyhow!("the stderr reader panicked"))?;
    let status = child.wait()?;
    let total = ms_since(t);
    if !status.success() {
        let tail: Vec<&str> = errs
            .iter()
            .rev()
            .take(10)
            .map(|(_, l)| l.as_str())
            .collect();
        bail!(
            "{cmd:?} failed ({status}): {}",
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    let mut marks: Vec<(f64, String)> = vec![(0.0, START.to_string())];
    let mut found: Vec<(f64, String)> = outs
        .into_iter()
        .chain(errs)
        .filter_map(|(ms, l)| step(&l).map(|s| (ms, s)))
        .collect();
    found.sort_by(|a, b| a.0.total_cmp(&b.0));
    marks.extend(found);
    let steps = marks
        .iter()
        .enumerate()
        .map(|(i, (ms, label))| {
            let end = marks.get(i + 1).map_or(total, |next| next.0);
            (label.clone(), end - ms)
        })
        .collect();
    Ok(StepTimes { total, steps })
}

/// Where a cold build's time went, step by step (median over the rounds), podman and
/// dsec side by side; steps one tool does not have (FROM, ENV: dsec folds them into the
/// image config) show `-`.
fn print_steps(podman: &[Vec<(String, f64)>], dsec: &[Vec<(String, f64)>]) {
    if podman.is_empty() && dsec.is_empty() {
        return;
    }
    let mut labels: Vec<String> = Vec::new();
    for (label, _) in podman.iter().chain(dsec).flatten() {
        if !labels.contains(label) {
            labels.push(label.clone());
        }
    }
    // The end last.
    labels.retain(|l| l != FINISH);
    labels.push(FINISH.into());
    let p50 = |rounds: &[Vec<(String, f64)>], label: &str| {
        let v: Vec<f64> = rounds
            .iter()
            .filter_map(|r| {
                let ms: Vec<f64> = r
                    .iter()
                    .filter(|(l, _)| l == label)
                    .map(|(_, ms)| *ms)
                    .collect();
                (!ms.is_empty()).then(|| ms.iter().sum())
            })
            .collect();
        (!v.is_empty()).then(|| median(v))
    };
    let cell = |v: Option<f64>| v.map_or("-".to_string(), |ms| format!("{ms:.0}"));
    println!("\n## cold Dockerfile build by step (p50 ms; each step from its announcement to the next)\n");
    println!("| step | podman | dsec |");
    println!("|---|---|---|");
    let mut rows = Vec::new();
    for label in &labels {
        let (p, d) = (p50(podman, label), p50(dsec, label));
        let shown: String = label.chars().take(70).collect();
        let shown = shown.replace('|', "\\|");
        println!("| `{shown}` | {} | {} |", cell(p), cell(d));
        rows.push(serde_json::json!({"step": label, "podman_ms": p, "dsec_ms": d}));
    }
    crate::record(
        "cold Dockerfile build by step",
        serde_json::Value::Array(rows),
    );
}

/// What the section's names left on the host: mounts, cgroup parents, processes.
fn leftovers(scratch: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let scratch = scratch.display().to_string();
    for needle in [scratch.as_str(), SERVER_PREFIX] {
        out.extend(
            dsec_e2e::host::mounts(needle)
                .into_iter()
                .map(|m| format!("mount {m}")),
        );
    }
    for root in std::fs::read_dir("/sys/fs/cgroup")
        .into_iter()
        .flatten()
        .flatten()
    {
        let dir = root.path().join(CGROUP);
        if dir.exists() {
            out.push(format!("cgroup {}", dir.display()));
        }
    }
    let roots = [
        std::env::temp_dir().join("dsec-e2e"),
        PathBuf::from(dsec_e2e::TEST_RUN_ROOT),
    ];
    for root in roots {
        for e in std::fs::read_dir(root).into_iter().flatten().flatten() {
            if e.file_name().to_string_lossy().starts_with(SERVER_PREFIX) {
                out.push(format!("directory {}", e.path().display()));
            }
        }
    }
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmd);
        if cmd.contains(&scratch) || cmd.contains(&format!("/{SERVER_PREFIX}-")) {
            out.push(format!(
                "process {}: {}",
                e.file_name().to_string_lossy(),
                cmd.replace('\0', " ")
            ));
        }
    }
    out
}

/// Runs the section: both tables.
pub(crate) async fn section(main: &Server, quick: bool) -> anyhow::Result<()> {
    let rounds = if quick { QUICK_ROUNDS } else { ROUNDS };
    let scratch = Scratch::new()?;
    println!("\n# images (issue #26): {rounds} round(s), every row sampled once per round");
    let prep = Instant::now();
    let noise = if quick {
        QUICK_NOISE_LAYERS
    } else {
        NOISE_LAYERS
    };
    let image = match seed_image(scratch.path(), noise)? {
        Some(image) => image,
        None => {
            println!("\nn/a: docker-registry or skopeo missing (scripts/bench installs them)");
            return Ok(());
        }
    };
    println!(
        "image {}: {} layers, {:.0} MiB gzip (seeded in {:.0} s)",
        image.reference,
        image.layers,
        image.compressed as f64 / 1048576.0,
        prep.elapsed().as_secs_f64()
    );
    pull_table(scratch.path(), &image, rounds).await?;
    drop(image);
    build_table(main, scratch.path(), rounds).await?;
    let left = leftovers(scratch.path());
    drop(scratch);
    if left.is_empty() {
        println!("\nleft behind by the images section: nothing");
    } else {
        println!("\nleft behind by the images section:");
        for l in left {
            println!("- {l}");
        }
    }
    Ok(())
}

//! The burst: N containers over M distinct images, each reading a sample of its image and
//! exiting, with images held in four ways, side by side in one run:
//!
//! - **local**: every layer already in the node's cache (a node that has the images);
//! - **on-demand**: `--lazy-layers`, layers fetched in chunks from the store as read;
//! - **eager, whole layer**: dsec without `--lazy-layers`, downloading each EROFS layer
//!   whole from the store before the first sandbox of it starts;
//! - **eager, tar.gz + extract**: what a `docker pull` does: download the image's
//!   tar.gz, keep it, extract it to disk, then run containers (crun) on an overlay of it.
//!
//! The store is a directory served over HTTP on loopback, throttled to one link of fixed
//! bandwidth with a first-byte latency (see `dsec_e2e::blobserver`). Images: a Python
//! virtualenv split into 16 environments (the common part plus two or three of its large
//! packages each: 120-280 MB), each with the file list its "task" reads: whole subpackages
//! (as importing one reads its modules) picked at random until they hold about 7% of the
//! image's bytes, the same for every container of the image (every rollout of a task
//! imports the same things), plus one file of its own per container. The base OS layer is in every node's cache in every mode (all
//! images share it), so only the environments move.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{bail, Context};
use dsec_e2e::blobserver::{BlobServer, Throttle};
use dsec_e2e::{dir_bytes, sh, Server};
use dsec_wire::v1::{CreateSandboxRequest, ImportImageRequest};

use crate::Stats;

/// Share of an image's bytes that every container of it reads.
const SAMPLE_SHARE: f64 = 0.07;

/// One environment image.
#[derive(Debug, Clone)]
struct Env {
    /// dsec image name, `burst/env-XX`.
    name: String,
    /// Its tree (`opt/env/...`, `srv/burst/...`).
    dir: PathBuf,
    /// Regular files: path inside the sandbox, size.
    files: Vec<(String, u64)>,
    bytes: u64,
}

/// What one mode did.
#[derive(Debug)]
pub(crate) struct Mode {
    pub(crate) name: &'static str,
    pub(crate) wall_s: f64,
    pub(crate) container_ms: Stats,
    pub(crate) failed: usize,
    pub(crate) fetched: u64,
    pub(crate) written: u64,
}

impl Mode {
    /// A mode's row from its burst's (wall seconds, container times, failures).
    fn new(
        name: &'static str,
        (wall_s, samples, failed): (f64, Vec<f64>, usize),
        fetched: u64,
        written: u64,
    ) -> Self {
        Self {
            name,
            wall_s,
            container_ms: Stats {
                name: String::new(),
                samples,
                note: None,
            },
            failed,
            fetched,
            written,
        }
    }
}

/// The whole result.
#[derive(Debug)]
pub(crate) struct Burst {
    pub(crate) n: usize,
    pub(crate) images: usize,
    pub(crate) workers: usize,
    pub(crate) image_bytes: u64,
    pub(crate) read_share: f64,
    pub(crate) throttle: Throttle,
    pub(crate) chunk_kib: u64,
    pub(crate) modes: Vec<Mode>,
}

fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let st = cmd.status().with_context(|| format!("{cmd:?}"))?;
    if !st.success() {
        bail!("{cmd:?} failed: {st}");
    }
    Ok(())
}

/// Regular files under `root`, as absolute paths inside the image, with sizes.
fn files_of(root: &Path) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(e.path()),
                Ok(t) if t.is_file() => {
                    let rel = e.path().strip_prefix(root).map(Path::to_path_buf);
                    let name = rel.map(|r| format!("/{}", r.display())).unwrap_or_default();
                    // The sampled paths go through xargs: keep to plain names.
                    if !name.is_empty()
                        && !name.contains(|c: char| c.is_whitespace() || "'\"\\".contains(c))
                    {
                        out.push((name, e.metadata().map(|m| m.len()).unwrap_or(0)));
                    }
                }
                _ => {}
            }
        }
    }
    out.sort();
    out
}

/// The unit a task reads whole: below `site-packages`, the first two levels of the path
/// (`.../site-packages/pandas/core`); elsewhere, the file's directory.
fn subpackage(path: &str) -> String {
    let parent = path.rsplit_once('/').map(|(d, _)| d).unwrap_or("");
    match parent.split_once("/site-packages/") {
        Some((root, rest)) => {
            let top: Vec<&str> = rest.splitn(3, '/').take(2).collect();
            format!("{root}/site-packages/{}", top.join("/"))
        }
        None => parent.to_string(),
    }
}

/// A small deterministic generator (xorshift), so every run samples the same files.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// The package groups that tell environments apart (prefixes of site-packages entries).
const GROUPS: [&[&str]; 6] = [
    &["scipy"],
    &["pandas"],
    &["sympy", "mpmath"],
    &["django", "sqlparse", "asgiref"],
    &["numpy"],
    &["sqlalchemy", "greenlet"],
];

/// Builds (once, cached in `cache`) `m` environments from the virtualenv at `venv`: each
/// has the packages outside [`GROUPS`] plus two or three groups, and its sample list.
fn prepare_envs(venv: &Path, cache: &Path, m: usize) -> anyhow::Result<Vec<Env>> {
    let site = std::fs::read_dir(venv.join("lib"))?
        .flatten()
        .map(|e| e.path().join("site-packages"))
        .find(|p| p.is_dir())
        .context("no lib/python*/site-packages in the benchmark workspace")?;
    let mut combos: Vec<Vec<usize>> = Vec::new();
    for a in 0..GROUPS.len() {
        for b in a + 1..GROUPS.len() {
            combos.push(vec![a, b]);
        }
    }
    for a in 0..GROUPS.len() {
        for b in a + 1..GROUPS.len() {
            for c in b + 1..GROUPS.len() {
                combos.push(vec![a, b, c]);
            }
        }
    }
    if m > combos.len() {
        bail!("at most {} environments", combos.len());
    }
    let group_of = |name: &str| {
        let lower = name.to_ascii_lowercase();
        GROUPS
            .iter()
            .position(|g| g.iter().any(|p| lower.starts_with(p)))
    };
    let mut envs = Vec::new();
    for (i, combo) in combos.into_iter().take(m).enumerate() {
        let dir = cache.join(format!("env-{i:02}"));
        let name = format!("burst/env-{i:02}");
        if !dir.join("srv/burst/sample.txt").exists() {
            let _ = std::fs::remove_dir_all(&dir);
            let env_root = dir.join("opt/env");
            std::fs::create_dir_all(&env_root)?;
            // Hard links: the trees share the workspace's data on disk.
            for e in std::fs::read_dir(venv)?.flatten() {
                if e.file_name() != "lib" {
                    run(Command::new("cp")
                        .arg("-a")
                        .arg("-l")
                        .arg(e.path())
                        .arg(&env_root))?;
                }
            }
            let rel_site = site.strip_prefix(venv)?;
            let dest_site = env_root.join(rel_site);
            std::fs::create_dir_all(&dest_site)?;
            for e in std::fs::read_dir(&site)?.flatten() {
                let keep = match group_of(&e.file_name().to_string_lossy()) {
                    Some(g) => combo.contains(&g),
                    None => true,
                };
                if keep {
                    run(Command::new("cp")
                        .arg("-a")
                        .arg("-l")
                        .arg(e.path())
                        .arg(&dest_site))?;
                }
            }
            // The sample: whole subpackages (`site-packages/pandas/core/**`, as importing
            // one reads its modules), picked at random until they hold the share of the
            // image's bytes.
            let files = files_of(&dir);
            let total: u64 = files.iter().map(|f| f.1).sum();
            let mut by_dir: std::collections::BTreeMap<String, Vec<&(String, u64)>> =
                Default::default();
            for f in &files {
                by_dir.entry(subpackage(&f.0)).or_default().push(f);
            }
            let mut dirs: Vec<&Vec<&(String, u64)>> = by_dir.values().collect();
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (i as u64 + 1));
            for k in (1..dirs.len()).rev() {
                dirs.swap(k, (rng.next() % (k as u64 + 1)) as usize);
            }
            let (mut sample, mut got) = (Vec::new(), 0u64);
            for d in dirs {
                if got as f64 >= total as f64 * SAMPLE_SHARE {
                    break;
                }
                // Large shared objects are mapped, not read whole: leave them out.
                for f in d.iter().filter(|f| f.1 <= 4 << 20) {
                    got += f.1;
                    sample.push(f.0.clone());
                }
            }
            std::fs::create_dir_all(dir.join("srv/burst"))?;
            std::fs::write(dir.join("srv/burst/id"), format!("{name}\n"))?;
            std::fs::write(
                dir.join("srv/burst/sample.txt.part"),
                sample.join("\n") + "\n",
            )?;
            std::fs::rename(
                dir.join("srv/burst/sample.txt.part"),
                dir.join("srv/burst/sample.txt"),
            )?;
        }
        let files = files_of(&dir);
        let bytes = files.iter().map(|f| f.1).sum();
        envs.push(Env {
            name,
            dir,
            files,
            bytes,
        });
    }
    Ok(envs)
}

/// Makes sure the store at `store` holds every environment (imported on `publisher`,
/// which then has them all in its cache) and its tar.gz under `tars/`.
async fn publish(publisher: &Server, store: &Path, envs: &[Env]) -> anyhow::Result<()> {
    let c = publisher.client();
    for e in envs {
        let ref_file = store.join(format!("refs/{}/@ref.json", e.name));
        if !ref_file.exists() {
            let _ = c.delete_image(&e.name).await;
            c.import_image(ImportImageRequest {
                name: e.name.clone(),
                source: e.dir.display().to_string(),
                flatten: false,
            })
            .await
            .with_context(|| format!("importing {}", e.name))?;
        }
        let tar = store.join(format!("tars/{}.tar.gz", e.name.replace('/', "-")));
        if !tar.exists() {
            std::fs::create_dir_all(store.join("tars"))?;
            let part = tar.with_extension("part");
            run(Command::new("tar")
                .arg("-czf")
                .arg(&part)
                .arg("-C")
                .arg(&e.dir)
                .arg("."))?;
            std::fs::rename(&part, &tar)?;
        }
    }
    Ok(())
}

fn drop_caches() {
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
    let _ = std::fs::write("/proc/sys/vm/drop_caches", "3");
}

/// The command a container runs: its image's sample, then one file of its own.
fn task(env: &Env, k: usize) -> String {
    let own = &env.files[(k * 7919) % env.files.len()].0;
    format!("xargs cat < /srv/burst/sample.txt > /dev/null && cat {own} > /dev/null")
}

/// Container `k` of the burst uses environment `k % m` (the images interleave, as a
/// burst of many tasks does).
async fn dsec_burst(
    server: &Server,
    envs: &[Env],
    n: usize,
    workers: usize,
) -> (f64, Vec<f64>, usize) {
    let next = Arc::new(Mutex::new(0usize));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..workers {
        let (c, next, envs) = (server.client(), next.clone(), envs.to_vec());
        tasks.push(tokio::spawn(async move {
            let (mut times, mut failed) = (Vec::new(), 0);
            loop {
                let k = {
                    let mut g = next.lock().unwrap_or_else(|e| e.into_inner());
                    *g += 1;
                    *g - 1
                };
                if k >= n {
                    return (times, failed);
                }
                let env = &envs[k % envs.len()];
                let t = Instant::now();
                let req = CreateSandboxRequest {
                    image: Some("base".into()),
                    layers: vec![env.name.clone()],
                    ..Default::default()
                };
                let ok = match c.create_sandbox(req).await {
                    Ok(sb) => {
                        let out = c.exec(&sb.id, sh(&task(env, k))).await;
                        let _ = c.delete_sandbox(&sb.id).await;
                        matches!(out, Ok(o) if o.exit.exit_code == Some(0))
                    }
                    Err(_) => false,
                };
                if ok {
                    times.push(t.elapsed().as_secs_f64() * 1000.0);
                } else {
                    failed += 1;
                }
            }
        }));
    }
    let (mut all, mut failed) = (Vec::new(), 0);
    for t in tasks {
        if let Ok((times, f)) = t.await {
            all.extend(times);
            failed += f;
        } else {
            failed += 1;
        }
    }
    (started.elapsed().as_secs_f64(), all, failed)
}

/// Node flags shared by the burst's nodes (no networking, own cgroup parent).
fn node_args(store: &str, parent: &str, lazy: bool) -> Vec<String> {
    let mut a: Vec<String> = [
        "--blob-store",
        store,
        "--cgroup-parent",
        parent,
        "--disk-pool",
        "2",
        "--no-network",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if lazy {
        // Lists recorded during the burst are saved soon after it, for the next node.
        a.extend(["--lazy-layers", "--prefetch-window-s", "5"].map(String::from));
    }
    a
}

async fn start_node(name: &str, fresh: bool, args: &[String]) -> anyhow::Result<Server> {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Server::start_with(name, fresh, &args).await
}

/// The base layer's file (relative to a state directory) of the image `server` lists.
async fn base_blob(server: &Server) -> anyhow::Result<String> {
    let digest = server
        .client()
        .list_images()
        .await?
        .images
        .into_iter()
        .find(|i| i.name == "base")
        .context("no base image")?
        .digest;
    Ok(format!(
        "images/blobs/sha256/{}.erofs",
        digest.trim_start_matches("sha256:")
    ))
}

/// Hard-links `from`'s base layer into `to`'s cache (every mode has the shared base).
async fn seed_base(from: &Server, to: &Server) -> anyhow::Result<()> {
    let file = base_blob(from).await?;
    let dest = to.state_dir.join(&file);
    if !dest.exists() {
        std::fs::hard_link(from.state_dir.join(&file), &dest)
            .or_else(|_| std::fs::copy(from.state_dir.join(&file), &dest).map(|_| ()))?;
    }
    Ok(())
}

/// The docker-pull way: per image, download the tar.gz (kept, as a content store keeps
/// it) and extract it, once, the first container of the image waiting for it; each
/// container is a `crun run` on a fresh overlay of the tree over the base layer.
fn eager_tar_burst(
    store_url: &str,
    base_root: &Path,
    scratch: &Path,
    envs: &[Env],
    n: usize,
    workers: usize,
) -> anyhow::Result<(f64, Vec<f64>, usize)> {
    use nix::mount::{mount, umount2, MntFlags, MsFlags};
    let store: Arc<dyn dsec_blob::BlobStore> = Arc::from(dsec_blob::open(store_url)?);
    std::fs::create_dir_all(scratch)?;
    // config.json from `crun spec`, root and args filled in per container.
    run(Command::new("crun").arg("spec").current_dir(scratch))?;
    let spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(scratch.join("config.json"))?)?;
    let pulled: Arc<Vec<Mutex<Option<PathBuf>>>> =
        Arc::new(envs.iter().map(|_| Mutex::new(None)).collect());
    let next = Arc::new(Mutex::new(0usize));
    let started = Instant::now();
    let results: Vec<(Vec<f64>, usize)> = std::thread::scope(|s| {
        let mut handles = Vec::new();
        for w in 0..workers {
            let (store, pulled, next, spec) =
                (store.clone(), pulled.clone(), next.clone(), spec.clone());
            handles.push(s.spawn(move || {
                let (mut times, mut failed) = (Vec::new(), 0usize);
                loop {
                    let k = {
                        let mut g = next.lock().unwrap_or_else(|e| e.into_inner());
                        *g += 1;
                        *g - 1
                    };
                    if k >= n {
                        return (times, failed);
                    }
                    let i = k % envs.len();
                    let env = &envs[i];
                    let t = Instant::now();
                    let once = || -> anyhow::Result<()> {
                        let tree = {
                            let mut slot = pulled[i].lock().unwrap_or_else(|e| e.into_inner());
                            if slot.is_none() {
                                let key = format!("tars/{}.tar.gz", env.name.replace('/', "-"));
                                let tgz = scratch.join(format!("pull-{i:02}.tar.gz"));
                                store.download(&key, &tgz)?;
                                let tree = scratch.join(format!("pull-{i:02}"));
                                std::fs::create_dir_all(&tree)?;
                                run(Command::new("tar")
                                    .arg("-xzf")
                                    .arg(&tgz)
                                    .arg("-C")
                                    .arg(&tree))?;
                                *slot = Some(tree);
                            }
                            slot.clone().context("pulled")?
                        };
                        let run_dir = scratch.join(format!("run-{w}-{k}"));
                        let (upper, work, root) = (
                            run_dir.join("upper"),
                            run_dir.join("work"),
                            run_dir.join("rootfs"),
                        );
                        for d in [&upper, &work, &root] {
                            std::fs::create_dir_all(d)?;
                        }
                        let opts = format!(
                            "lowerdir={}:{},upperdir={},workdir={}",
                            tree.display(),
                            base_root.display(),
                            upper.display(),
                            work.display()
                        );
                        mount(
                            Some("overlay"),
                            &root,
                            Some("overlay"),
                            MsFlags::MS_NODEV,
                            Some(opts.as_str()),
                        )?;
                        let mut spec = spec.clone();
                        spec["process"]["terminal"] = false.into();
                        spec["process"]["args"] = serde_json::json!(["sh", "-c", task(env, k)]);
                        spec["root"]["path"] = root.display().to_string().into();
                        spec["root"]["readonly"] = false.into();
                        std::fs::write(run_dir.join("config.json"), serde_json::to_vec(&spec)?)?;
                        let id = format!("dsec-burst-{}-{k}", std::process::id());
                        let r = run(Command::new("crun")
                            .args(["run", "--bundle"])
                            .arg(&run_dir)
                            .arg(&id)
                            .stdout(std::process::Stdio::null()));
                        let _ = umount2(&root, MntFlags::MNT_DETACH);
                        let _ = std::fs::remove_dir_all(&run_dir);
                        r
                    };
                    match once() {
                        Ok(()) => times.push(t.elapsed().as_secs_f64() * 1000.0),
                        Err(e) => {
                            if failed == 0 {
                                eprintln!("eager tar.gz container {k}: {e:#}");
                            }
                            failed += 1;
                        }
                    }
                }
            }));
        }
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or((Vec::new(), n)))
            .collect()
    });
    let wall = started.elapsed().as_secs_f64();
    let (mut all, mut failed) = (Vec::new(), 0);
    for (t, f) in results {
        all.extend(t);
        failed += f;
    }
    Ok((wall, all, failed))
}

/// Runs the burst; `venv` is the benchmark workspace's virtualenv, `cache` where the
/// environments and the store live between runs.
pub(crate) async fn burst(
    venv: &Path,
    cache: &Path,
    n: usize,
    m: usize,
    workers: usize,
    throttle: Throttle,
    chunk_kib: u64,
) -> anyhow::Result<Burst> {
    // The chunk size is fixed at upload: one store (and publishing node) per size.
    let store_dir = cache.join(format!("store-{chunk_kib}k"));
    std::fs::create_dir_all(&store_dir)?;
    let (v, c) = (venv.to_path_buf(), cache.to_path_buf());
    let envs = tokio::task::spawn_blocking(move || prepare_envs(&v, &c, m)).await??;
    let store_path = store_dir.display().to_string();

    // The local node imports the environments (so it holds every layer) and publishes them.
    let mut publisher_args = node_args(&store_path, "dsec-burst-l", false);
    publisher_args.extend(["--chunk-kib".to_string(), chunk_kib.to_string()]);
    let local = start_node(
        &format!("bench-burst-local-{chunk_kib}k"),
        false,
        &publisher_args,
    )
    .await?;
    local.ensure_base(None).await?;
    publish(&local, &store_dir, &envs).await?;
    local.delete_all().await;
    let server = BlobServer::start_with(&store_dir, Some(throttle))?;
    let mut modes = Vec::new();

    // Local.
    drop_caches();
    let run = dsec_burst(&local, &envs, n, workers).await;
    modes.push(Mode::new("local (layers in the node cache)", run, 0, 0));

    // On-demand, then eager whole layers: fresh nodes on the throttled store.
    // Prefetch lists of an earlier run would make the cold mode warm.
    for e in std::fs::read_dir(store_dir.join("blobs/sha256"))?.flatten() {
        if e.file_name().to_string_lossy().ends_with(".prefetch.json") {
            std::fs::remove_file(e.path())?;
        }
    }
    for (name, lazy, node) in [
        (
            "on-demand, cold (dsec --lazy-layers)",
            true,
            "bench-burst-lazy",
        ),
        (
            "on-demand, prefetch lists from an earlier node",
            true,
            "bench-burst-prefetch",
        ),
        (
            "eager: whole EROFS layer before start (dsec)",
            false,
            "bench-burst-eager",
        ),
    ] {
        let node = start_node(node, true, &node_args(&server.url, "dsec-burst-x", lazy)).await?;
        seed_base(&local, &node).await?;
        let images = node.state_dir.join("images");
        let before = (server.served_bytes(), dir_bytes(&images.join("blobs")));
        drop_caches();
        let run = dsec_burst(&node, &envs, n, workers).await;
        let written =
            dir_bytes(&images.join("chunks")) + dir_bytes(&images.join("blobs")) - before.1;
        modes.push(Mode::new(
            name,
            run,
            server.served_bytes() - before.0,
            written,
        ));
        if node.state_dir.ends_with("bench-burst-lazy/state") {
            // Untimed: the cold node saves each layer's list 5 s after its first read.
            let lists = || {
                std::fs::read_dir(store_dir.join("blobs/sha256"))
                    .map(|d| {
                        d.flatten()
                            .filter(|e| e.file_name().to_string_lossy().ends_with(".prefetch.json"))
                            .count()
                    })
                    .unwrap_or(0)
            };
            let deadline = Instant::now() + std::time::Duration::from_secs(30);
            while lists() < envs.len() && Instant::now() < deadline {
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
        }
        drop(node);
    }

    // Eager the docker way, with crun.
    let base_root = std::env::temp_dir().join("dsec-bench-burst-base");
    std::fs::create_dir_all(&base_root)?;
    let base_blob = local.state_dir.join(base_blob(&local).await?);
    nix::mount::mount(
        Some(&base_blob),
        &base_root,
        Some("erofs"),
        nix::mount::MsFlags::MS_RDONLY,
        None::<&str>,
    )
    .context("mounting the base layer for crun")?;
    let scratch = local.state_dir.join("bench-burst-pull");
    let _ = std::fs::remove_dir_all(&scratch);
    let before = server.served_bytes();
    drop_caches();
    let (url, br, sc, ev) = (
        server.url.clone(),
        base_root.clone(),
        scratch.clone(),
        envs.clone(),
    );
    let r = tokio::task::spawn_blocking(move || eager_tar_burst(&url, &br, &sc, &ev, n, workers))
        .await?;
    let written = dir_bytes(&scratch);
    let _ = nix::mount::umount2(&base_root, nix::mount::MntFlags::MNT_DETACH);
    let _ = std::fs::remove_dir_all(&scratch);
    modes.push(Mode::new(
        "eager: tar.gz pulled + extracted, crun run (docker-like)",
        r?,
        server.served_bytes() - before,
        written,
    ));

    let image_bytes = envs.iter().map(|e| e.bytes).sum();
    let read: u64 = envs
        .iter()
        .map(|e| {
            let sample: HashMap<&str, u64> =
                e.files.iter().map(|(p, s)| (p.as_str(), *s)).collect();
            std::fs::read_to_string(e.dir.join("srv/burst/sample.txt"))
                .unwrap_or_default()
                .lines()
                .filter_map(|l| sample.get(l))
                .sum::<u64>()
        })
        .sum();
    Ok(Burst {
        n,
        images: envs.len(),
        workers,
        image_bytes,
        read_share: read as f64 / image_bytes.max(1) as f64,
        throttle,
        chunk_kib,
        modes,
    })
}

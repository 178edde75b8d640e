//! [`LocalNode`]: the node runtime in-process, over the container backend and the local
//! image store.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};

use dsec_cgroups::{CgroupRoot, CgroupVersion};
use dsec_image::ImageStore;
use dsec_wire::v1::{Image, ImageConfig};

use crate::admission::Admission;
use crate::backend::{Backend, Layers, RuntimeRecord};
use crate::container::ContainerBackend;
use crate::lifetimes::{now_ms, Lifetimes};
use crate::{AgentConn, NodeApi, NodeConfig, NodeCreateSpec, NodeError, NodeSandbox};
use bytes::Bytes;
use dsec_node_api::{is_unary, ByteStream, EventStream, ImportSource, NodeResult};
use dsec_wire::agent::{ExecSpec, FileInfo, Reply, Request};
use dsec_wire::v1::{ExecResult, NodeCapacity, WriteResult};
use dsec_wire::{ApiError, ErrorCode};

/// The node runtime of this machine.
#[derive(Debug)]
pub struct LocalNode {
    cfg: NodeConfig,
    cgroup_version: CgroupVersion,
    images: Arc<ImageStore>,
    backend: Arc<dyn Backend>,
    sandboxes: Mutex<HashMap<String, RuntimeRecord>>,
    /// One idle agent connection per sandbox ([`LocalNode::reuse`](crate::LocalNode)), for the sandboxes whose
    /// agent said at create that it keeps connections (others are absent). Entries are
    /// added and removed only with `sandboxes` locked too (taken first), so that no
    /// connection is kept for a removed sandbox; taking one out needs only this lock.
    idle_conns: Mutex<HashMap<String, Option<AgentConn>>>,
    admission: Admission,
    /// Turns of deletes (`NodeConfig::delete_concurrency`; `None`: no limit).
    delete_turns: Option<tokio::sync::Semaphore>,
    /// The host-wide names this node owns while it runs.
    claims: crate::claims::HostClaims,
    /// Lifetimes of the sandboxes, and stubs of those whose lifetime ended.
    pub(crate) lifetimes: Arc<Lifetimes>,
    /// Registry pulls, one at a time per reference.
    puller: dsec_registry::Puller,
    /// Calls with request ids, their outcomes and the sandboxes' call logs.
    pub(crate) journal: Arc<crate::calls::CallJournal>,
    /// This node, for the tasks it spawns (a recorded call's driver).
    pub(crate) me: std::sync::Weak<LocalNode>,
}

/// Sandboxes whose lifetime ended torn down at once by the reaper (deletes take turns
/// too, see `NodeConfig::delete_concurrency`).
const REAP_PARALLELISM: usize = 16;

fn join_err(e: tokio::task::JoinError) -> NodeError {
    NodeError::Io {
        op: "blocking task",
        path: String::new(),
        source: std::io::Error::other(e),
    }
}

impl LocalNode {
    /// Opens the node: prepares directories, then re-adopts live sandboxes and cleans up
    /// whatever an earlier run left half-done.
    pub async fn open(cfg: NodeConfig) -> Result<Arc<Self>, NodeError> {
        // Before anything is cleaned up: another node's sandboxes must not look like ours.
        // It may wait for a node that is still exiting: off the async workers.
        let parent = cfg.cgroup_parent.clone();
        let claims = tokio::task::spawn_blocking(move || {
            crate::claims::HostClaims::acquire(
                std::path::Path::new(crate::claims::CLAIMS_DIR),
                &[("cgroup parent", parent.as_str(), "--cgroup-parent")],
            )
        })
        .await
        .map_err(join_err)??;
        for d in [&cfg.state_dir, &cfg.run_dir] {
            std::fs::create_dir_all(d).map_err(NodeError::io("mkdir", d))?;
        }
        let run_dir_mount = cfg
            .run_dir_tmpfs
            .then(|| crate::rundir::prepare(&cfg.run_dir))
            .transpose()?;
        if let Some((path, mb)) = &cfg.swap_file {
            crate::swap::ensure(path, *mb)?;
        }
        let cgroups = CgroupRoot::detect()?;
        if cfg.cgroup_favor_dynmods {
            use dsec_cgroups::dynmods::{favor_dynmods, DynmodsOutcome};
            match favor_dynmods() {
                Ok(DynmodsOutcome::Enabled(at)) => tracing::info!(
                    mount = %at.display(),
                    "cgroup2 remounted with favordynmods (cheap cgroup joins; --keep-cgroup-mount leaves it alone)"
                ),
                Ok(DynmodsOutcome::AlreadyOn(_)) => {}
                Ok(DynmodsOutcome::NoCgroup2) => tracing::info!(
                    "no cgroup2 mount for favordynmods: cgroup joins may wait for RCU grace periods"
                ),
                Err(e) => {
                    tracing::warn!(error = %e, "favordynmods not set; cgroup joins may wait for RCU grace periods")
                }
            }
        }
        let shared = match &cfg.blob_store {
            Some(url) => {
                let store = dsec_blob::open(url).map_err(dsec_image::ImageError::Shared)?;
                tracing::info!(store = %store.url(), cache_limit = ?cfg.layer_cache_bytes, "shared blob store");
                Some(Arc::from(store))
            }
            None => None,
        };
        let images = Arc::new(ImageStore::open_with(
            cfg.images_dir(),
            dsec_image::StoreOptions {
                shared,
                cache_limit: cfg.layer_cache_bytes,
                ref_ttl: cfg.ref_ttl,
                chunk_size: cfg.chunk_size,
                lazy: match (cfg.lazy_chunk_cache_bytes, &cfg.blob_store) {
                    (Some(limit), Some(spec)) => Some(dsec_image::LazyLayers {
                        chunk_cache_limit: limit,
                        store_spec: spec.clone(),
                        launcher: match &cfg.lazy_launcher {
                            Some(l) => l.clone(),
                            None => dsec_lazy::Launcher {
                                program: std::env::current_exe().map_err(NodeError::io(
                                    "locate",
                                    std::path::Path::new("this executable"),
                                ))?,
                                args: vec!["lazy-serve".into()],
                            },
                        },
                        opts: dsec_lazy::LazyOptions {
                            prefetch_window: cfg.lazy_prefetch_window,
                            ..Default::default()
                        },
                    }),
                    _ => None,
                },
            },
        )?);
        let backend: Arc<dyn Backend> =
            Arc::new(ContainerBackend::new(cfg.clone(), cgroups.clone())?);
        // Sandbox inits are re-parented to us when their intermediate process exits, so
        // that we can reap them (and notice their death) instead of the host's init.
        // SAFETY: prctl with integer arguments.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };

        let b = backend.clone();
        let recovered = tokio::task::spawn_blocking(move || b.recover())
            .await
            .map_err(join_err)??;
        let mut refs: HashMap<String, usize> = HashMap::new();
        let mut table = HashMap::new();
        for rec in recovered {
            for d in rec.layer_digests() {
                *refs.entry(d).or_default() += 1;
            }
            table.insert(rec.id.clone(), rec);
        }
        for (digest, n) in &refs {
            images.set_refcount(digest, *n)?;
        }
        images.cleanup_unused(&refs.keys().cloned().collect::<HashSet<_>>())?;
        let lifetimes = Arc::new(Lifetimes::open(&cfg, table.keys())?);
        let mut kept: HashSet<String> = table.keys().cloned().collect();
        kept.extend(lifetimes.stubs().into_iter().map(|s| s.id));
        let (journal, pending) =
            crate::calls::CallJournal::open(&cfg.state_dir, &kept, cfg.max_recorded_calls)?;
        let node = Arc::new_cyclic(|me| Self {
            journal: Arc::new(journal),
            me: me.clone(),
            puller: dsec_registry::Puller::new(images.clone(), cfg.registry.clone()),
            lifetimes,
            admission: Admission::new(cfg.admission),
            delete_turns: (cfg.delete_concurrency > 0)
                .then(|| tokio::sync::Semaphore::new(cfg.delete_concurrency)),
            claims,
            cfg,
            cgroup_version: cgroups.version(),
            images,
            backend,
            sandboxes: Mutex::new(table),
            idle_conns: Mutex::new(HashMap::new()),
        });
        node.clone().spawn_reaper();
        node.clone().spawn_lifetime_reaper();
        // Calls that were running when the node stopped: their commands ran on in the
        // sandboxes; learn how they ended.
        for p in pending {
            node.redrive(p);
        }
        if let Some(guard) = run_dir_mount {
            guard.disarm();
        }
        Ok(node)
    }

    /// Reaps sandbox inits that are our children when they exit.
    fn spawn_reaper(self: Arc<Self>) {
        let weak = Arc::downgrade(&self);
        tokio::spawn(async move {
            let Ok(mut sigchld) =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child())
            else {
                return;
            };
            let mut tick = tokio::time::interval(std::time::Duration::from_secs(2));
            loop {
                tokio::select! {
                    _ = sigchld.recv() => {}
                    _ = tick.tick() => {}
                }
                let Some(node) = weak.upgrade() else { return };
                let pids: Vec<i32> = node.lock().values().map(|r| r.pid).collect();
                for pid in pids {
                    // Only reap pids we track, so other child processes (image builds)
                    // keep their own wait semantics.
                    let _ = nix::sys::wait::waitpid(
                        nix::unistd::Pid::from_raw(pid),
                        Some(nix::sys::wait::WaitPidFlag::WNOHANG),
                    );
                }
            }
        });
    }

    /// Ends the sandboxes whose lifetime ran out, every `reap_interval`.
    fn spawn_lifetime_reaper(self: Arc<Self>) {
        let weak = Arc::downgrade(&self);
        let interval = self
            .cfg
            .reap_interval
            .max(std::time::Duration::from_millis(10));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(node) = weak.upgrade() else { return };
                node.reap_lifetimes().await;
            }
        });
    }

    /// One pass of the lifetime reaper: each sandbox whose TTL or idle timeout ran out
    /// becomes a stub (kept on disk first), then is torn down; a teardown that failed
    /// (or that a restart cut off) is tried again on the next pass.
    pub async fn reap_lifetimes(&self) {
        let now = now_ms();
        for (id, reason) in self.lifetimes.due(now) {
            let Some(rec) = self.lock().get(&id).cloned() else {
                continue;
            };
            let listed = NodeSandbox {
                id: id.clone(),
                image_digest: rec.image_digest.clone(),
                pid: rec.pid,
                alive: false,
                disk_mb: rec.disk_mb,
                disk_free_mb: None,
                ip: None,
                age_ms: 0,
                idle_ms: 0,
                ttl_left_ms: None,
                ended: None,
                timings: Vec::new(),
            };
            if self.lifetimes.end(&id, reason, listed) {
                tracing::info!(%id, reason, "sandbox's lifetime ended");
            }
        }
        let pending: Vec<String> = {
            let recs = self.lock();
            self.lifetimes
                .stubs()
                .into_iter()
                .map(|s| s.id)
                .filter(|id| recs.contains_key(id))
                .collect()
        };
        use futures::StreamExt;
        futures::stream::iter(pending)
            .for_each_concurrent(REAP_PARALLELISM, |id| async move {
                if let Err(e) = self.teardown(&id).await {
                    tracing::warn!(%id, error = %e.message, "ending a sandbox failed; will retry");
                }
            })
            .await;
    }

    /// Tears a sandbox down and releases what it held (its lifetime is the caller's).
    async fn teardown(&self, id: &str) -> NodeResult<()> {
        // Creates and deletes share the CPU; with every delete torn down at once, a
        // closed loop of create -> exec -> delete spends as long in creates as in deletes
        // (Little's law: the cycle is shared where the work waits). A few at a time, the
        // rest wait here, asleep: creates get the CPU and the queue forms among deletes.
        // The sandbox is not even killed before its turn: dying is most of a delete's
        // work (the processes' memory, mounts and namespaces), and many dying at once
        // hold the kernel's locks creates need.
        let _turn = match &self.delete_turns {
            Some(turns) => Some(turns.acquire().await.map_err(|e| NodeError::Io {
                op: "wait for a delete turn",
                path: String::new(),
                source: std::io::Error::other(e),
            })?),
            None => None,
        };
        let rec = self.lock().get(id).cloned();
        let backend = self.backend.clone();
        let id2 = id.to_string();
        tokio::task::spawn_blocking(move || {
            let _bg = crate::priority::Background::enter();
            backend.destroy(&id2)
        })
        .await
        .map_err(join_err)??;
        if let Some(rec) = rec {
            let _ = nix::sys::wait::waitpid(
                nix::unistd::Pid::from_raw(rec.pid),
                Some(nix::sys::wait::WaitPidFlag::WNOHANG),
            );
            // Two teardowns of one sandbox (the reaper's and a destroy) may overlap:
            // only the one that removes the record gives its layers back.
            let (removed, idle) = {
                let mut recs = self.lock();
                (recs.remove(id), self.idle_lock().remove(id))
            };
            drop(idle);
            if removed.is_some() {
                for d in rec.layer_digests() {
                    self.images.release(&d).map_err(NodeError::from)?;
                }
            }
        }
        Ok(())
    }

    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, RuntimeRecord>> {
        self.sandboxes.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn idle_lock(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<String, Option<AgentConn>>> {
        self.idle_conns.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs an image-store call on a blocking thread: with a shared blob store it may
    /// wait on the network.
    async fn blocking<T, F>(&self, f: F) -> Result<T, NodeError>
    where
        F: FnOnce(Arc<ImageStore>) -> Result<T, dsec_image::ImageError> + Send + 'static,
        T: Send + 'static,
    {
        let images = self.images.clone();
        tokio::task::spawn_blocking(move || f(images))
            .await
            .map_err(join_err)?
            .map_err(NodeError::from)
    }

    /// Requested CPU (millicores) and number of the sandboxes with a runtime record.
    fn load(&self) -> (u64, usize) {
        let table = self.lock();
        (table.values().map(|r| r.cpu_millis).sum(), table.len())
    }

    /// `NotFound` unless the sandbox is on this node (without copying its record).
    pub(crate) fn known(&self, id: &str) -> Result<(), NodeError> {
        if self.lock().contains_key(id) {
            Ok(())
        } else {
            Err(NodeError::NotFound(id.to_string()))
        }
    }

    pub(crate) fn record(&self, id: &str) -> Result<RuntimeRecord, NodeError> {
        self.lock()
            .get(id)
            .cloned()
            .ok_or_else(|| NodeError::NotFound(id.to_string()))
    }

    /// The backend sandboxes run on.
    pub(crate) fn backend(&self) -> Arc<dyn Backend> {
        self.backend.clone()
    }

    /// The image store.
    pub fn images(&self) -> &ImageStore {
        &self.images
    }

    /// A graceful stop, once no request is served any more: ends the node's helper
    /// processes and pools. Live sandboxes keep what they need (run directory, cgroups,
    /// nftables table, links) for the next start to adopt; with none left, nothing of
    /// the node stays on the host but its state directory. The claim file goes either
    /// way (the lock itself is released when the node exits). Returns whether sandboxes
    /// were left running.
    pub fn shutdown(&self) -> bool {
        let empty = self.lock().is_empty();
        self.backend.shutdown(empty);
        if empty {
            crate::rundir::remove(&self.cfg.run_dir);
            // No sandbox uses a layer now: the idle mounts kept for the next sandbox go.
            match self.images.unmount_idle() {
                Ok(gone) => tracing::debug!(layers = gone.len(), "idle layer mounts removed"),
                Err(e) => tracing::warn!(error = %e, "removing idle layer mounts"),
            }
        }
        self.claims.remove_files();
        !empty
    }
}

/// `stream`, the sandbox counting as busy (not idle) until it is dropped.
fn while_active<T: Send + 'static>(
    stream: futures::stream::BoxStream<'static, T>,
    active: crate::lifetimes::Activity,
) -> futures::stream::BoxStream<'static, T> {
    use futures::StreamExt;
    stream
        .map(move |item| {
            let _ = &active;
            item
        })
        .boxed()
}

/// Writes an uploaded archive to `path`.
async fn receive(path: &Path, mut body: ByteStream) -> NodeResult<()> {
    use futures::StreamExt;
    use tokio::io::AsyncWriteExt;
    let io = |e| NodeError::io("write upload", path)(e);
    let mut file = tokio::fs::File::create(path).await.map_err(io)?;
    while let Some(chunk) = body.next().await {
        file.write_all(&chunk?).await.map_err(io)?;
    }
    file.flush().await.map_err(io)?;
    Ok(())
}

/// Resolves the sandbox's image and extra layer images into one stack (a layer named
/// twice stays only at its topmost place, which gives the same tree) and takes a mount
/// reference on each layer (downloading layers only the shared store holds).
fn mount_layers(
    images: &ImageStore,
    spec: &NodeCreateSpec,
) -> Result<Layers, dsec_image::ImageError> {
    let base = images.resolve(&spec.image)?;
    let mut digests = base.layers.clone();
    for name in &spec.layers {
        digests.extend(images.resolve(name)?.layers);
    }
    let stack = dsec_image::dedup_layers(&digests);
    let digest = if spec.layers.is_empty() {
        base.digest
    } else {
        dsec_image::image_digest(&stack)
    };
    let mut mounted = Vec::with_capacity(stack.len());
    let mut files = Vec::with_capacity(stack.len());
    for d in stack {
        let acquired = images
            .acquire(&d)
            .and_then(|mnt| match images.layer_file(&d) {
                Ok(file) => Ok((mnt, file)),
                Err(e) => {
                    let _ = images.release(&d);
                    Err(e)
                }
            });
        match acquired {
            Ok((mnt, file)) => {
                mounted.push((d, mnt));
                files.push(file);
            }
            Err(e) => {
                for (d, _) in &mounted {
                    let _ = images.release(d);
                }
                return Err(e);
            }
        }
    }
    Ok(Layers {
        digest,
        layers: mounted,
        files,
    })
}

#[async_trait::async_trait]
impl NodeApi for LocalNode {
    fn name(&self) -> &str {
        &self.cfg.name
    }

    fn cgroup_version(&self) -> &'static str {
        match self.cgroup_version {
            CgroupVersion::V1 => "v1",
            CgroupVersion::V2 => "v2",
        }
    }

    fn isolation_levels(&self) -> Vec<dsec_wire::v1::IsolationLevel> {
        use dsec_wire::v1::{Isolation, IsolationLevel};
        let mut levels = vec![IsolationLevel {
            isolation: Isolation::Container,
            runtime: None,
            platform: None,
        }];
        if let Some(bin) = &self.cfg.oci_runtime {
            levels.push(IsolationLevel {
                isolation: Isolation::Oci,
                runtime: Some(bin.display().to_string()),
                platform: None,
            });
        }
        if let Some(g) = &self.cfg.gvisor {
            levels.push(IsolationLevel {
                isolation: Isolation::Gvisor,
                runtime: Some(g.runsc.display().to_string()),
                platform: Some(g.platform.clone()),
            });
        }
        if let Some(m) = &self.cfg.microvm {
            // The same QEMU runs both kinds of machine.
            for isolation in [Isolation::Microvm, Isolation::Vm] {
                levels.push(IsolationLevel {
                    isolation,
                    runtime: Some(m.vmm.qemu.display().to_string()),
                    platform: Some(m.vmm.accel.name().to_string()),
                });
            }
        }
        levels
    }

    async fn create(&self, spec: NodeCreateSpec) -> NodeResult<NodeSandbox> {
        // The lifetime counts from when the node got the create.
        let received = now_ms();
        let mut timeline = dsec_node_api::Timeline::start();
        if self.lifetimes.check(&spec.id).is_err() {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!("sandbox {} exists (ended, not destroyed yet)", spec.id),
            ));
        }
        let (live_cpu, live) = self.load();
        let _ticket = self.admission.admit(spec.cpu_millis, live_cpu, live)?;
        timeline.mark("admit");
        let layers = {
            let spec = spec.clone();
            self.blocking(move |images| mount_layers(&images, &spec))
                .await?
        };
        timeline.mark("layers");
        let backend = self.backend.clone();
        let spec2 = spec.clone();
        let layers2 = layers.clone();
        let res = tokio::task::spawn_blocking(move || {
            let r = backend.create(&spec2, &layers2, &mut timeline);
            r.map(|rec| (rec, timeline))
        })
        .await
        .map_err(join_err)
        .and_then(|r| r);
        let (rec, mut timeline) = match res {
            Ok(done) => done,
            Err(e) => {
                for (d, _) in &layers.layers {
                    let _ = self.images.release(d);
                }
                return Err(e.into());
            }
        };
        self.lock().insert(rec.id.clone(), rec.clone());
        if let Err(e) = self.lifetimes.start(&rec.id, spec.lifetime, received) {
            let _ = self.destroy(&rec.id).await;
            return Err(e.into());
        }
        // Ready means the agent answers.
        // For an agent that keeps connections, the ping's connection carries the first
        // request too.
        let ping = async {
            let mut conn = self.agent(&rec.id)?;
            let reply = conn
                .request(&dsec_wire::agent::Request::Ping)
                .await
                .map_err(|e| NodeError::Create {
                    id: rec.id.clone(),
                    reason: e.message,
                })?;
            if let dsec_wire::agent::Reply::Pong { version, .. } = reply {
                if version >= dsec_wire::agent::KEEPS_CONNECTIONS_SINCE {
                    let recs = self.lock();
                    if recs.contains_key(&rec.id) {
                        self.idle_lock().insert(rec.id.clone(), Some(conn));
                    }
                }
            }
            Ok::<_, NodeError>(())
        };
        if let Err(e) = ping.await {
            let _ = self.destroy(&rec.id).await;
            return Err(e.into());
        }
        timeline.mark("agent");
        let created = NodeSandbox {
            ip: self.backend.address(&rec),
            id: rec.id,
            image_digest: rec.image_digest,
            pid: rec.pid,
            alive: true,
            disk_mb: rec.disk_mb,
            disk_free_mb: None,
            age_ms: 0,
            idle_ms: 0,
            ttl_left_ms: None,
            ended: None,
            timings: timeline.finish().phases,
        };
        // Ended already (a TTL of 0): the reaper tears it down; the caller sees its stub.
        Ok(self
            .lifetimes
            .listed(created.clone(), now_ms())
            .unwrap_or(created))
    }

    async fn destroy(&self, id: &str) -> NodeResult<()> {
        self.lifetimes.forget(id);
        self.teardown(id).await?;
        self.journal.forget(id);
        Ok(())
    }

    async fn set_lifetime(&self, id: &str, lifetime: dsec_node_api::Lifetime) -> NodeResult<()> {
        self.lifetimes.check(id)?;
        self.known(id)?;
        self.lifetimes.set(id, lifetime)
    }

    async fn list(&self) -> NodeResult<Vec<NodeSandbox>> {
        let recs: Vec<RuntimeRecord> = self.lock().values().cloned().collect();
        let now = now_ms();
        let mut listed: Vec<NodeSandbox> = recs
            .into_iter()
            .filter_map(|r| {
                let sb = NodeSandbox {
                    alive: self.backend.is_alive(&r),
                    ip: self.backend.address(&r),
                    disk_free_mb: self.backend.disk_free_mb(&r.id),
                    id: r.id,
                    image_digest: r.image_digest,
                    pid: r.pid,
                    disk_mb: r.disk_mb,
                    age_ms: 0,
                    idle_ms: 0,
                    ttl_left_ms: None,
                    ended: None,
                    timings: Vec::new(),
                };
                self.lifetimes.listed(sb, now)
            })
            .collect();
        listed.extend(self.lifetimes.stubs());
        Ok(listed)
    }

    async fn pause(&self, id: &str) -> NodeResult<(u64, u64)> {
        self.lifetimes.check(id)?;
        self.known(id)?;
        let backend = self.backend.clone();
        let id2 = id.to_string();
        let r = tokio::task::spawn_blocking(move || backend.pause(&id2))
            .await
            .map_err(join_err)?
            .map_err(ApiError::from)?;
        self.lifetimes.set_paused(id, true);
        Ok(r)
    }

    async fn resume(&self, id: &str) -> NodeResult<()> {
        let _active = self.lifetimes.activity(id)?;
        self.known(id)?;
        let backend = self.backend.clone();
        let id2 = id.to_string();
        let changed = tokio::task::spawn_blocking(move || backend.resume(&id2))
            .await
            .map_err(join_err)?
            .map_err(ApiError::from)?;
        if let Some(rec) = changed {
            // A connection kept from before is to a process that is gone.
            if let Some(slot) = self.idle_lock().get_mut(id) {
                slot.take();
            }
            self.lock().insert(id.to_string(), rec);
        }
        self.lifetimes.set_paused(id, false);
        Ok(())
    }

    async fn commit(
        &self,
        id: &str,
        name: &str,
        previous_diffs: Vec<String>,
        config: dsec_wire::v1::ImageConfig,
    ) -> NodeResult<(Image, Option<String>)> {
        let _active = self.lifetimes.activity(id)?;
        let rec = self.record(id)?;
        let backend = self.backend.clone();
        let images = self.images.clone();
        let (id, name) = (id.to_string(), name.to_string());
        tokio::task::spawn_blocking(move || {
            let stack = rec.layer_digests();
            let mut out = None;
            backend.with_upper(&id, &mut |upper| {
                // Beside the upper: the node's, out of the sandbox's view.
                let clean_index = upper.parent().map(|d| d.join("dsec-clean-files"));
                let (img, stats, diff) = images.commit_upper(
                    &name,
                    &dsec_image::packdiff::UpperCommit {
                        upper,
                        stack: &stack,
                        previous_diffs: &previous_diffs,
                        clean_index: clean_index.as_deref(),
                    },
                    config.clone(),
                    &format!("sandbox {id}"),
                )?;
                tracing::info!(%id, image = %img.name, copied = stats.copied,
                    unchanged = stats.unchanged, whiteouts = stats.whiteouts,
                    new_layer = diff.is_some(), "sandbox committed");
                out = Some((img, diff));
                Ok(())
            })?;
            out.ok_or_else(|| NodeError::NotFound(id.clone()))
        })
        .await
        .map_err(join_err)?
        .map_err(ApiError::from)
    }

    async fn set_network(&self, id: &str, policy: dsec_wire::v1::NetworkPolicy) -> NodeResult<()> {
        let _active = self.lifetimes.activity(id)?;
        self.known(id)?;
        let backend = self.backend.clone();
        let id = id.to_string();
        tokio::task::spawn_blocking(move || backend.set_network(&id, &policy))
            .await
            .map_err(join_err)?
            .map_err(ApiError::from)
    }

    async fn screenshot(&self, id: &str) -> NodeResult<Bytes> {
        let _active = self.lifetimes.activity(id)?;
        self.known(id)?;
        let backend = self.backend.clone();
        let id = id.to_string();
        tokio::task::spawn_blocking(move || backend.screenshot(&id))
            .await
            .map_err(join_err)?
            .map(Bytes::from)
            .map_err(ApiError::from)
    }

    async fn send_input(&self, id: &str, events: Vec<dsec_wire::v1::InputEvent>) -> NodeResult<()> {
        let _active = self.lifetimes.activity(id)?;
        self.known(id)?;
        let backend = self.backend.clone();
        let id = id.to_string();
        tokio::task::spawn_blocking(move || backend.send_input(&id, &events))
            .await
            .map_err(join_err)?
            .map_err(ApiError::from)
    }

    async fn ping(&self, id: &str) -> NodeResult<()> {
        // Not activity: the control plane's watchdog must not keep a sandbox alive.
        self.lifetimes.check(id)?;
        self.agent_ping(id).await
    }

    async fn call(&self, id: &str, req: Request) -> NodeResult<Reply> {
        if !is_unary(&req) {
            return Err(ApiError::new(
                ErrorCode::Internal,
                "a streaming agent request was sent as a plain call",
            ));
        }
        let _active = self.lifetimes.agent_activity(id)?;
        self.agent_call(id, &req).await
    }

    async fn exec(&self, id: &str, spec: ExecSpec, stdin: Option<Bytes>) -> NodeResult<ExecResult> {
        let _active = self.lifetimes.agent_activity(id)?;
        self.exec_to_exit(id, spec, stdin).await
    }

    async fn exec_stream(
        &self,
        id: &str,
        spec: ExecSpec,
        stdin: Option<Bytes>,
    ) -> NodeResult<EventStream> {
        let active = self.lifetimes.agent_activity(id)?;
        let events = self.exec_events(id, spec, stdin).await?;
        Ok(while_active(events, active))
    }

    async fn exec_recorded(
        &self,
        id: &str,
        request_id: &str,
        spec: ExecSpec,
        stdin: Option<Bytes>,
    ) -> NodeResult<ExecResult> {
        let _active = self.lifetimes.agent_activity(id)?;
        self.recorded_exec(id, request_id, spec, stdin).await
    }

    async fn exec_stream_recorded(
        &self,
        id: &str,
        request_id: &str,
        spec: ExecSpec,
        stdin: Option<Bytes>,
    ) -> NodeResult<EventStream> {
        let active = self.lifetimes.agent_activity(id)?;
        let events = self
            .recorded_exec_events(id, request_id, spec, stdin)
            .await?;
        Ok(while_active(events, active))
    }

    async fn call_recorded(&self, id: &str, request_id: &str, req: Request) -> NodeResult<Reply> {
        let _active = self.lifetimes.agent_activity(id)?;
        self.recorded_call(id, request_id, req).await
    }

    async fn upload_recorded(
        &self,
        id: &str,
        request_id: &str,
        req: Request,
        body: ByteStream,
    ) -> NodeResult<WriteResult> {
        let _active = self.lifetimes.agent_activity(id)?;
        self.recorded_upload(id, request_id, req, body).await
    }

    async fn call_log(
        &self,
        id: &str,
        query: &dsec_wire::v1::CallLogQuery,
    ) -> NodeResult<dsec_wire::v1::CallLog> {
        self.lifetimes.check(id)?;
        self.record(id)?;
        let journal = self.journal.clone();
        let (id, query) = (id.to_string(), query.clone());
        tokio::task::spawn_blocking(move || journal.log(&id, &query))
            .await
            .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?
    }

    async fn process_output(
        &self,
        id: &str,
        pid: u32,
        stdout_offset: u64,
        stderr_offset: u64,
        follow: bool,
    ) -> NodeResult<EventStream> {
        let req = Request::ProcessOutput {
            pid,
            stdout_offset,
            stderr_offset,
            follow,
        };
        let active = self.lifetimes.agent_activity(id)?;
        let events = self.output_events(id, req).await?;
        Ok(while_active(events, active))
    }

    async fn process_stdin(&self, id: &str, pid: u32, data: Bytes, close: bool) -> NodeResult<()> {
        let _active = self.lifetimes.agent_activity(id)?;
        self.stdin(id, pid, data, close).await
    }

    async fn read_file(
        &self,
        id: &str,
        path: &str,
        offset: u64,
        length: Option<u64>,
    ) -> NodeResult<(FileInfo, ByteStream)> {
        let req = Request::FileRead {
            path: path.to_string(),
            offset,
            length,
        };
        let active = self.lifetimes.agent_activity(id)?;
        let (info, body) = self.file_read(id, req).await?;
        Ok((info, while_active(body, active)))
    }

    async fn write_file(
        &self,
        id: &str,
        path: &str,
        mode: Option<u32>,
        body: ByteStream,
    ) -> NodeResult<WriteResult> {
        let req = Request::FileWrite {
            path: path.to_string(),
            mode,
            create_parents: true,
        };
        let _active = self.lifetimes.agent_activity(id)?;
        self.upload(id, req, body).await
    }

    async fn download_tar(&self, id: &str, path: &str) -> NodeResult<ByteStream> {
        let active = self.lifetimes.agent_activity(id)?;
        let body = self.tar_download(id, path).await?;
        Ok(while_active(body, active))
    }

    async fn upload_tar(&self, id: &str, path: &str, body: ByteStream) -> NodeResult<WriteResult> {
        let req = Request::TarUpload {
            path: path.to_string(),
        };
        let _active = self.lifetimes.agent_activity(id)?;
        self.upload(id, req, body).await
    }

    async fn image(&self, name: &str) -> NodeResult<Image> {
        let name = name.to_string();
        Ok(self
            .blocking(move |images| images.image_info(&name))
            .await?)
    }

    async fn capacity(&self) -> NodeCapacity {
        let (cpu, n) = self.load();
        let c = self.admission.capacity(cpu, n);
        NodeCapacity {
            cpu_millis_allocatable: c.cpu_millis_allocatable,
            cpu_millis_requested: c.cpu_millis_requested,
            memory_available_bytes: c.memory_available_bytes,
            memory_reserve_bytes: c.memory_reserve_bytes,
            sandboxes: c.sandboxes as u64,
            max_sandboxes: c.max_sandboxes as u64,
            core_scheduling: c.core_scheduling,
        }
    }

    async fn list_images(&self) -> NodeResult<Vec<Image>> {
        Ok(self.blocking(|images| images.list()).await?)
    }

    async fn import_image(
        &self,
        name: &str,
        source: ImportSource,
        flatten: bool,
        progress: Option<crate::ImportProgressSink>,
    ) -> NodeResult<Image> {
        // An upload is received into the store's tmp/ first: importers read archives by
        // random access. The directory goes when the import ends, whatever its outcome.
        let (source, upload) = match source {
            ImportSource::NodePath(path) => (path, None),
            ImportSource::Archive(body) => {
                let dir = self.blocking(|images| images.upload_dir()).await?;
                let path = dir.path().join("upload");
                receive(&path, body).await?;
                (path, Some(dir))
            }
        };
        let images = self.images.clone();
        let name = name.to_string();
        let img = tokio::task::spawn_blocking(move || {
            let report = |p: dsec_image::ImportProgress| {
                if let Some(sink) = &progress {
                    sink(dsec_wire::v1::ImportEvent::Progress {
                        phase: p.phase.as_str().to_string(),
                        bytes_done: p.bytes_done,
                        bytes_total: p.bytes_total,
                    });
                }
            };
            let img = match &upload {
                Some(_) => images.import_uploaded(&name, &source, flatten, &report),
                None => images.import_path(&name, &source, flatten, &report),
            };
            drop(upload);
            img
        })
        .await
        .map_err(join_err)?
        .map_err(NodeError::from)?;
        Ok(img)
    }

    async fn pull_image(
        &self,
        req: &dsec_wire::v1::PullImageRequest,
        progress: Option<crate::ImportProgressSink>,
    ) -> NodeResult<Image> {
        let sink: dsec_registry::Progress = match progress {
            Some(p) => p,
            None => Arc::new(|_| {}),
        };
        self.puller
            .pull(req, sink)
            .await
            .map_err(|e| ApiError::from(&*e))
    }

    async fn gc_images(
        &self,
        req: &dsec_wire::v1::GcRequest,
    ) -> NodeResult<dsec_wire::v1::GcResult> {
        let req = req.clone();
        Ok(self
            .blocking(move |images| {
                let min_age = std::time::Duration::from_secs(req.older_than_s);
                let (removed, freed_bytes) = images.gc_prefix("build-cache/", min_age)?;
                let trim = images.trim_cache()?;
                let shared = if req.shared_store {
                    let grace = std::time::Duration::from_secs(req.shared_grace_s.unwrap_or(3600));
                    images.gc_shared(grace)?
                } else {
                    Default::default()
                };
                Ok(dsec_wire::v1::GcResult {
                    removed,
                    freed_bytes,
                    evicted: trim.evicted,
                    evicted_bytes: trim.freed_bytes,
                    shared_deleted: shared.deleted,
                    shared_freed_bytes: shared.freed_bytes,
                })
            })
            .await?)
    }

    async fn layer_stats(&self) -> NodeResult<dsec_wire::v1::LayerStatsList> {
        let images = self.images.clone();
        let stats = tokio::task::spawn_blocking(move || images.lazy_stats())
            .await
            .map_err(join_err)?
            .map_err(NodeError::from)?;
        let node = dsec_wire::v1::LazyNodeStats {
            fetched_bytes: stats.layers.iter().map(|l| l.1.fetched_bytes).sum(),
            cached_bytes: stats.layers.iter().map(|l| l.1.cached_bytes).sum(),
            prefetched_chunks: stats.layers.iter().map(|l| l.1.prefetched_chunks).sum(),
            faults: stats.layers.iter().map(|l| l.1.faults).sum(),
            chunk_cache_bytes: stats.chunk_cache_bytes,
        };
        let lazy = stats
            .layers
            .into_iter()
            .map(|(hex, s)| dsec_wire::v1::LazyLayerStats {
                digest: format!("sha256:{hex}"),
                fetched_bytes: s.fetched_bytes,
                fetched_chunks: s.fetched_chunks,
                cached_bytes: s.cached_bytes,
                faults: s.faults,
                mean_fetch_us: s.fetch_micros.checked_div(s.fetched_chunks).unwrap_or(0),
                fetch_us_total: s.fetch_micros,
                fetch_latency_ms: dsec_lazy::FETCH_BUCKETS_MS
                    .iter()
                    .copied()
                    .chain([u64::MAX])
                    .zip(s.fetch_buckets.iter().copied())
                    .collect(),
                prefetched_chunks: s.prefetched_chunks,
                last_fault: s
                    .last_fault
                    .map(|(at_ms, message)| dsec_wire::v1::LayerFault { at_ms, message }),
            })
            .collect();
        Ok(dsec_wire::v1::LayerStatsList { lazy, node })
    }

    async fn tag_image(
        &self,
        source: &str,
        name: &str,
        config: Option<ImageConfig>,
    ) -> NodeResult<Image> {
        let (source, name) = (source.to_string(), name.to_string());
        Ok(self
            .blocking(move |images| images.tag(&source, &name, config))
            .await?)
    }

    async fn remove_image(&self, name: &str) -> NodeResult<()> {
        let name = name.to_string();
        Ok(self
            .blocking(move |images| images.remove(&name).map(|_| ()))
            .await?)
    }
}

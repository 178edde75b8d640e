//! The container backend: the node starts `dsec-agent init`, which builds the sandbox
//! around itself (see `dsec-container`) and becomes its PID 1.
//!
//! Per sandbox, on the host: `state_dir/sandboxes/ID/disk/` (the image of a size-limited
//! ext4 with the overlay's `upper` and `work`, mounted detached (held by an fd, handed to
//! init) or at `disk/mnt`; a node without disk limits has plain `upper/` and `work/`
//! directories there instead), `run_dir/sandboxes/ID/{runtime.json,agent.sock,agent.log,
//! rootfs}`, and cgroup `dsec/ID`. Nothing else: the overlay lives in the sandbox's mount
//! namespace, the shared layer mount belongs to the image store.
//!
//! What describes a running sandbox (its record, socket, log and root mount point) lives
//! in the run directory (a tmpfs such as `/run`): it dies with the host as the sandbox
//! does, and a create touches the state file system only to move a pooled disk in.

use std::fs;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dsec_cgroups::{Cgroup, CgroupRoot, Limits};
use dsec_node_api::Timeline;
use dsec_wire::init::{
    InitSpec, DISK_FD, FIRST_LAYER_FD, LISTEN_FD, MNTNS_FD, NETNS_FD, STATUS_FD, USERNS_FD,
};
use dsec_wire::v1::{Isolation, NetworkMode, NetworkPolicy, Qos};
use nix::fcntl::OFlag;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

use crate::backend::{Backend, Layers, RuntimeRecord};
use crate::userns::{UidRanges, UserNs, UsernsConfig, UsernsRecord, UsernsScope, RANGE_SIZE};
use crate::{NodeConfig, NodeCreateSpec, NodeError};

/// Default parent of every sandbox cgroup (`dsec serve --cgroup-parent`).
pub const CGROUP_PARENT: &str = "dsec";
/// Most layers a sandbox may stack in user namespace mode (each is one fd handed to init).
pub const MAX_USERNS_LAYERS: usize = 48;
/// CPU weight (cgroup v2 units, default 100) of a latency-sensitive sandbox.
pub const WEIGHT_LATENCY_SENSITIVE: u64 = 200;
/// CPU weight of a best-effort sandbox (which also runs `SCHED_IDLE`).
pub const WEIGHT_BEST_EFFORT: u64 = 1;
/// CPU weight (the default) of a sandbox whose processes did not die within
/// [`LOW_PRIORITY_KILL`] at the lowest weight.
pub const WEIGHT_DYING: u64 = 100;
/// How long a deleted sandbox's processes get to die at the lowest CPU weight.
pub const LOW_PRIORITY_KILL: Duration = Duration::from_millis(200);

/// The container backend.
#[derive(Debug)]
pub struct ContainerBackend {
    cfg: NodeConfig,
    cgroups: CgroupRoot,
    /// Disk maker, when sandboxes get size-limited disks.
    disks: Option<dsec_disk::Disks>,
    /// Disks of live sandboxes created by this process (a restarted node has none: it
    /// releases the disks it finds by directory).
    held_disks: std::sync::Mutex<std::collections::HashMap<String, dsec_disk::Disk>>,
    /// Open cgroup handles of live sandboxes (opening one resolves every hierarchy).
    open: std::sync::Mutex<std::collections::HashMap<String, std::sync::Arc<Cgroup>>>,
    /// Sandbox networking, once a networked sandbox needed it.
    network: std::sync::Mutex<Option<std::sync::Arc<dsec_net::Network>>>,
    /// User namespaces, when the node maps root away.
    userns: Option<Userns>,
    /// The warm agent inits are forked from.
    zygote: crate::zygote::Zygote,
    /// Namespaces made ahead for network mode `none`.
    nspool: crate::nspool::NetnsPool,
    /// Pooled namespaces live sandboxes hold, to go back to the pool when they are
    /// deleted.
    lent: std::sync::Mutex<std::collections::HashMap<String, crate::nspool::Lent>>,
    /// The mount namespace user-namespaced inits start from (see `mntns`); without it
    /// they start from the host's.
    skeleton: Option<crate::mntns::Skeleton>,
    /// Isolation level `microvm`, when the node has QEMU and a guest kernel.
    microvms: Option<crate::microvm::MicroVms>,
}

/// The node's user namespace state.
#[derive(Debug)]
struct Userns {
    cfg: UsernsConfig,
    /// Ranges held by live sandboxes (and by the namespace pool).
    ranges: std::sync::Arc<std::sync::Mutex<UidRanges>>,
    /// The one namespace of scope `node`, made at start.
    shared: Option<UserNs>,
}

fn create_err(id: &str, reason: impl std::fmt::Display) -> NodeError {
    NodeError::Create {
        id: id.to_string(),
        reason: reason.to_string(),
    }
}

impl ContainerBackend {
    /// A backend over the host's cgroup hierarchy. Starts the disk pool, first releasing
    /// pooled disks an earlier run left.
    pub fn new(cfg: NodeConfig, cgroups: CgroupRoot) -> Result<Self, NodeError> {
        let userns = match &cfg.userns {
            Some(u) => Some(Userns::start(u)?),
            None => None,
        };
        if userns.is_some() {
            // Init, an unprivileged host uid then, walks to its root mount point in the
            // run directory (search only; nothing is listed).
            for sandboxes in [
                cfg.state_dir.join("sandboxes"),
                cfg.run_dir.join("sandboxes"),
            ] {
                fs::DirBuilder::new()
                    .recursive(true)
                    .create(&sandboxes)
                    .map_err(NodeError::io("mkdir", &sandboxes))?;
                fs::set_permissions(&sandboxes, fs::Permissions::from_mode(0o711))
                    .map_err(NodeError::io("chmod", &sandboxes))?;
            }
        }
        let skeleton = match &userns {
            Some(_) => {
                let dir = cfg.run_dir.join("skeleton");
                let made = fs::DirBuilder::new()
                    .recursive(true)
                    .create(&dir)
                    .and_then(|()| crate::mntns::Skeleton::create(&dir));
                match made {
                    Ok(sk) => Some(sk),
                    Err(e) => {
                        tracing::warn!(error = %e, "no skeleton mount namespace; inits copy the host's");
                        None
                    }
                }
            }
            None => None,
        };
        let disks = match cfg.disk {
            Some(d) => Some(dsec_disk::Disks::open(dsec_disk::DiskConfig {
                root: cfg.disks_dir(),
                default_mb: d.default_mb,
                pool_size: d.pool_size,
                mount_mode: None,
            })?),
            None => None,
        };
        let zygote = crate::zygote::Zygote::new(&cfg.agent_bin, cfg.run_dir.join("zygote.log"));
        // Pooled namespaces hold uid ranges: at most a quarter of them. A node whose
        // sandboxes share one user namespace makes theirs at create.
        let nspool = match &userns {
            Some(u) if u.shared.is_some() => crate::nspool::NetnsPool::start(0, None),
            Some(u) => crate::nspool::NetnsPool::start(
                cfg.netns_pool.min(u.cfg.usable_ranges() as usize / 4),
                Some(u.ranges.clone()),
            ),
            None => crate::nspool::NetnsPool::start(cfg.netns_pool, None),
        };
        let microvms = match &cfg.microvm {
            Some(m) => Some(crate::microvm::MicroVms::new(
                m.clone(),
                cfg.agent_bin.clone(),
                cfg.state_dir.join("vm"),
            )?),
            None => None,
        };
        Ok(Self {
            microvms,
            zygote,
            nspool,
            lent: Default::default(),
            cfg,
            cgroups,
            disks,
            held_disks: Default::default(),
            open: Default::default(),
            network: Default::default(),
            userns,
            skeleton,
        })
    }

    /// The node's networking, started now (with `adopt`) if it is not yet.
    fn network(
        &self,
        adopt: &[(String, dsec_net::NetRecord)],
    ) -> Result<std::sync::Arc<dsec_net::Network>, NodeError> {
        let mut net = self.network.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = net.as_ref() {
            return Ok(n.clone());
        }
        let cfg = self.cfg.network.clone().ok_or_else(|| {
            NodeError::Unsupported(
                "network: this node gives sandboxes no network (dsec serve --no-network)".into(),
            )
        })?;
        let started = dsec_net::Network::start(cfg, adopt)?;
        *net = Some(started.clone());
        Ok(started)
    }

    /// The node's networking if it is running.
    fn network_if_started(&self) -> Option<std::sync::Arc<dsec_net::Network>> {
        self.network
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn handles(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, std::sync::Arc<Cgroup>>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lent_map(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, crate::nspool::Lent>> {
        self.lent.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn disks_held(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, dsec_disk::Disk>> {
        self.held_disks.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn cgroup(&self, id: &str) -> Result<std::sync::Arc<Cgroup>, NodeError> {
        if let Some(cg) = self.handles().get(id) {
            return Ok(cg.clone());
        }
        let cg = std::sync::Arc::new(Cgroup::open(&self.cgroups, &self.cgroup_path(id))?);
        self.handles().insert(id.to_string(), cg.clone());
        Ok(cg)
    }

    /// The host path of a sandbox's upper directory (on its disk, mounted again if a
    /// restart lost the mount).
    fn upper_dir(&self, id: &str) -> Result<PathBuf, NodeError> {
        let Some(disks) = &self.disks else {
            return Ok(self.cfg.sandbox_dir(id).join("upper"));
        };
        let mut held = self.disks_held();
        if !held.contains_key(id) {
            // Lost with a restart: mount the sandbox's disk once more.
            let disk = disks.reopen(&self.cfg.sandbox_dir(id).join("disk"))?;
            held.insert(id.to_string(), disk);
        }
        let root = held
            .get(id)
            .map(|d| d.root())
            .ok_or_else(|| NodeError::NotFound(id.to_string()))?;
        // The caller's copy runs without the lock (it may take long). A concurrent delete
        // closes the disk and fails the copy, which is what a commit of a deleted sandbox
        // should do.
        drop(held);
        Ok(dsec_disk::upper_dir(&root))
    }

    /// Kills a sandbox's processes (an OCI one's runtime container first) and removes its
    /// cgroup.
    fn kill_and_remove_cgroup(
        &self,
        id: &str,
        cached: Option<std::sync::Arc<Cgroup>>,
    ) -> Result<(), NodeError> {
        let run = self.cfg.sandbox_run_dir(id);
        if run.join("bundle").exists() {
            // Isolation levels oci and gvisor: the runtime's container, then its root
            // mount. (A gVisor sandbox has its socket directory.)
            if crate::gvisor::socket_dir(&run).exists() {
                if let Some(g) = &self.cfg.gvisor {
                    g.delete(&crate::gvisor::state_dir(&self.cfg.run_dir), id);
                }
            } else if let Some(bin) = &self.cfg.oci_runtime {
                crate::oci::delete(bin, &crate::oci::state_dir(&self.cfg.run_dir), id);
            }
            let _ = nix::mount::umount2(&run.join("rootfs"), nix::mount::MntFlags::MNT_DETACH);
        }
        let cgroup = match cached {
            Some(cg) => Ok(cg),
            None => Cgroup::open(&self.cgroups, &self.cgroup_path(id)).map(std::sync::Arc::new),
        };
        match cgroup {
            Ok(cg) => {
                // The dying processes tear down their memory, mounts and namespaces in
                // their own time slices: at the lowest weight, after the creates. Not for
                // long: next to busy neighbours a process at that weight (or a
                // best-effort one) may not run for seconds, and it has to run to die.
                let weight = |w| Limits {
                    cpu_weight: Some(w),
                    ..Limits::default()
                };
                let _ = cg.set_limits(&weight(1));
                if let Err(e) = cg.kill_all_timeout(LOW_PRIORITY_KILL) {
                    tracing::debug!(%id, error = %e, "slow to die at the lowest weight; raising it");
                    let _ = cg.set_limits(&weight(WEIGHT_DYING));
                }
                cg.destroy()?
            }
            Err(dsec_cgroups::CgroupError::NotFound(_)) => {}
            Err(e) => return Err(e.into()),
        }
        if run.join("bundle").exists() {
            remove_runtime_cgroups(&self.cgroup_path(id));
        }
        Ok(())
    }

    fn cgroup_path(&self, id: &str) -> String {
        format!("{}/{id}", self.cfg.cgroup_parent)
    }

    fn create_inner(
        &self,
        spec: &NodeCreateSpec,
        layers: &Layers,
        timeline: &mut Timeline,
    ) -> Result<RuntimeRecord, NodeError> {
        if spec.isolation.is_machine() {
            return self.create_microvm(spec, layers, timeline);
        }
        let started = Instant::now();
        let id = &spec.id;
        let dir = self.cfg.sandbox_dir(id);
        let run = self.cfg.sandbox_run_dir(id);
        // With a user namespace and no skeleton (it could not be made), init mounts the
        // root at run/rootfs as the namespace's root, an unprivileged host uid: it must
        // be able to walk there (search only; nothing is listed). `sandboxes/` itself
        // gets that mode once, at start.
        let mode = if self.userns.is_some() { 0o711 } else { 0o700 };
        let mut builder = fs::DirBuilder::new();
        builder.recursive(true).mode(mode);
        builder.create(&run).map_err(NodeError::io("mkdir", &run))?;
        builder.create(&dir).map_err(NodeError::io("mkdir", &dir))?;
        let mut disk_fd = None;
        let (upper, work, disk_mb) = match (&self.disks, spec.disk_mb) {
            (Some(disks), size) => {
                let size = size.unwrap_or(disks.default_mb());
                let disk = disks.provision(size, &dir.join("disk"))?;
                // A detached disk reaches init as fd DISK_FD: name it as init sees it.
                let root = match disk.mount_fd() {
                    Some(fd) => {
                        disk_fd = Some(fd.as_raw_fd());
                        PathBuf::from(format!("/proc/self/fd/{DISK_FD}"))
                    }
                    None => disk.root(),
                };
                self.disks_held().insert(id.clone(), disk);
                (
                    dsec_disk::upper_dir(&root),
                    dsec_disk::work_dir(&root),
                    Some(size),
                )
            }
            (None, Some(_)) => return Err(NodeError::Unsupported(
                "resources.disk_mb: this node runs without disk limits (dsec serve --disk-mb 0)"
                    .into(),
            )),
            (None, None) => (dir.join("upper"), dir.join("work"), None),
        };
        // A user-namespaced init gets everything it mounts as an fd: it starts from the
        // skeleton and assembles its root there, not in the run directory.
        let skeleton = self
            .skeleton
            .as_ref()
            .filter(|_| self.userns.is_some() && spec.isolation == Isolation::Container);
        // A disk comes with its upper and work directories; plain ones are made here.
        let mut dirs = Vec::new();
        if skeleton.is_none() {
            dirs.push(run.join("rootfs"));
        }
        if disk_mb.is_none() {
            dirs.extend([upper.clone(), work.clone()]);
        }
        for p in &dirs {
            fs::DirBuilder::new()
                .mode(0o755)
                .create(p)
                .map_err(NodeError::io("mkdir", p))?;
        }
        timeline.mark("disk");
        // User namespace mode: init gets idmapped clones of the layers and of the mount
        // holding upper and work, never the node's own views of them.
        let mut lower_dirs: Vec<String> = layers
            .layers
            .iter()
            .rev()
            .map(|(_, mnt)| mnt.display().to_string())
            .collect();
        let (mut upper, mut work) = (upper, work);
        let mut layer_fds: Vec<OwnedFd> = Vec::new();
        let mut upper_clone: Option<OwnedFd> = None;
        let mut userns_rec = None;
        // Network mode none: namespaces made ahead, when the pool has some.
        let made_ahead = match (spec.isolation, &spec.network.mode) {
            (Isolation::Container, NetworkMode::None) if !spec.model_link => self.nspool.take(
                id,
                &self
                    .userns
                    .as_ref()
                    .map(|u| u.cfg.group_of(id, &spec.labels))
                    .unwrap_or_default(),
            ),
            _ => None,
        };
        let own_ns;
        let userns = match self
            .userns
            .as_ref()
            .filter(|_| spec.isolation == Isolation::Container)
        {
            Some(u) => {
                let pooled = made_ahead
                    .as_ref()
                    .and_then(|(lent, rec)| Some((lent.userns.as_ref()?, rec.clone()?)));
                match pooled {
                    Some((ns, rec)) => {
                        userns_rec = Some(rec);
                        Some(ns)
                    }
                    None => {
                        let (rec, ns) = u.namespace_for(spec, &self.nspool)?;
                        userns_rec = Some(rec);
                        own_ns = ns;
                        own_ns.as_ref().or(u.shared.as_ref())
                    }
                }
            }
            None => None,
        };
        if let Some(ns) = userns {
            if layers.layers.len() > MAX_USERNS_LAYERS {
                return Err(NodeError::Unsupported(format!(
                    "{} layers: a user-namespaced sandbox stacks at most {MAX_USERNS_LAYERS}",
                    layers.layers.len()
                )));
            }
            let idmap = |e: std::io::Error| create_err(id, format!("idmapped mount: {e}"));
            for (_, mnt) in &layers.layers {
                layer_fds.push(ns.idmapped_clone(mnt).map_err(idmap)?);
            }
            lower_dirs = (0..layer_fds.len())
                .rev()
                .map(|i| format!("/proc/self/fd/{}", FIRST_LAYER_FD + i as i32))
                .collect();
            let held = self.disks_held();
            let clone = match held.get(id).and_then(|d| d.mount_fd()) {
                Some(fd) => ns.idmapped_clone_fd(fd),
                None => ns.idmapped_clone(upper.parent().unwrap_or(&dir)),
            };
            drop(held);
            let clone = clone.map_err(idmap)?;
            disk_fd = Some(clone.as_raw_fd());
            let inside = PathBuf::from(format!("/proc/self/fd/{DISK_FD}"));
            upper = inside.join(upper.file_name().unwrap_or_default());
            work = inside.join(work.file_name().unwrap_or_default());
            upper_clone = Some(clone);
        }
        timeline.mark("namespaces");
        let limits = Limits {
            cpu_millis: Some(spec.cpu_millis),
            memory_bytes: Some(spec.memory_bytes),
            // Under gVisor the limit inside is RLIMIT_NPROC; the host's must leave the
            // Sentry room to work (see `gvisor::host_pids_max`).
            pids_max: Some(match spec.isolation {
                Isolation::Gvisor => crate::gvisor::host_pids_max(spec.pids_max),
                _ => spec.pids_max,
            }),
            cpu_weight: Some(match spec.qos {
                Qos::LatencySensitive => WEIGHT_LATENCY_SENSITIVE,
                Qos::BestEffort => WEIGHT_BEST_EFFORT,
            }),
        };
        let cgroup = Cgroup::create(&self.cgroups, &self.cgroup_path(id), &limits)?;
        timeline.mark("cgroup");
        if matches!(spec.isolation, Isolation::Oci | Isolation::Gvisor) {
            let rec = self.create_oci(spec, layers, &run, &upper, &work, disk_mb)?;
            timeline.mark("init");
            self.handles()
                .insert(id.clone(), std::sync::Arc::new(cgroup));
            write_record(&run, &rec)?;
            return Ok(rec);
        }

        // A sandbox with model access has a slot whatever its mode: in mode `none` it
        // reaches the model gateway and nothing else.
        let lease = match (&spec.network.mode, spec.model_link) {
            (NetworkMode::None, false) => None,
            (_, model_link) => Some(self.network(&[])?.acquire_with(
                id,
                &spec.network,
                dsec_net::SlotOptions { model_link },
            )?),
        };
        timeline.mark("network");
        let socket = self.cfg.agent_socket(id);
        let listener = UnixListener::bind(&socket).map_err(NodeError::io("bind", &socket))?;
        let init = InitSpec {
            sandbox_id: id.clone(),
            // overlayfs wants the topmost layer first.
            lower_dirs,
            upper_dir: upper.display().to_string(),
            work_dir: work.display().to_string(),
            disk_fd: disk_fd.map(|_| DISK_FD),
            netns_fd: (lease.is_some() || made_ahead.is_some()).then_some(NETNS_FD),
            userns_fd: userns.map(|_| USERNS_FD),
            mntns_fd: skeleton.map(|_| MNTNS_FD),
            writable_paths: spec.writable_paths.clone(),
            tcp_bind: spec.tcp_bind.clone(),
            tcp_connect: spec.tcp_connect.clone(),
            resolv_conf: lease.as_ref().map(|l| dsec_net::resolv_conf(l.gateway)),
            sched_idle: spec.qos == Qos::BestEffort,
            core_sched: crate::admission::core_scheduling_available(),
            rootfs: match skeleton {
                Some(_) => crate::mntns::STAGE.to_string(),
                None => run.join("rootfs").display().to_string(),
            },
            cgroup_procs: cgroup
                .procs_paths()
                .iter()
                .map(|p| p.display().to_string())
                .collect(),
            env: spec.env.clone(),
            workdir: spec.workdir.clone(),
            user: spec.user.clone(),
            fncall: spec.labels.contains_key(dsec_wire::v1::FNCALL_LABEL),
        };
        let prepared = Instant::now();
        let fds = InitFds {
            listen: listener.as_raw_fd(),
            disk: disk_fd,
            netns: lease
                .as_ref()
                .map(|l| l.netns.as_raw_fd())
                .or(made_ahead.as_ref().map(|(lent, _)| lent.netns.as_raw_fd())),
            userns: userns.map(|ns| ns.fd().as_raw_fd()),
            mntns: skeleton.map(|sk| sk.fd().as_raw_fd()),
            layers: layer_fds.iter().map(|f| f.as_raw_fd()).collect(),
        };
        let (pid, start_time) = self.spawn_init(id, &init, &fds, &run)?;
        drop(listener);
        drop(layer_fds);
        drop(upper_clone);
        let pooled_netns = made_ahead.is_some();
        if let Some((lent, _)) = made_ahead {
            // Back to the pool at delete (see `NetnsPool::give_back`).
            self.lent_map().insert(id.clone(), lent);
        }
        // Init holds the namespace now.
        let net = lease.map(|l| dsec_net::NetRecord {
            slot: l.slot,
            policy: spec.network.clone(),
            model_link: l.model_link,
            tap: false,
        });
        tracing::debug!(%id, prepare_us = (prepared - started).as_micros() as u64,
            init_us = prepared.elapsed().as_micros() as u64, pooled_netns, "sandbox started");
        self.handles()
            .insert(id.clone(), std::sync::Arc::new(cgroup));
        let mut rec = self.record(spec, layers, (pid, start_time), disk_mb);
        rec.net = net;
        rec.userns = userns_rec;
        write_record(&run, &rec)?;
        timeline.mark("init");
        Ok(rec)
    }

    /// Starts `dsec-agent init` and waits for its `pid`/`ready` report.
    fn spawn_init(
        &self,
        id: &str,
        init: &InitSpec,
        fds: &InitFds,
        run: &Path,
    ) -> Result<(i32, u64), NodeError> {
        let (status_r, status_w): (OwnedFd, OwnedFd) = nix::unistd::pipe2(OFlag::O_CLOEXEC)
            .map_err(|e| create_err(id, format!("pipe: {e}")))?;
        let log_path = run.join("agent.log");
        let log = fs::File::create(&log_path).map_err(NodeError::io("create", &log_path))?;
        // (host fd, number in init).
        let mut pairs: Vec<(RawFd, i32)> =
            vec![(fds.listen, LISTEN_FD), (status_w.as_raw_fd(), STATUS_FD)];
        pairs.extend(fds.disk.map(|f| (f, DISK_FD)));
        pairs.extend(fds.netns.map(|f| (f, NETNS_FD)));
        pairs.extend(fds.userns.map(|f| (f, USERNS_FD)));
        pairs.extend(fds.mntns.map(|f| (f, MNTNS_FD)));
        pairs.extend(
            fds.layers
                .iter()
                .enumerate()
                .map(|(i, f)| (*f, FIRST_LAYER_FD + i as i32)),
        );
        // One more, init's stderr, goes to the zygote.
        const MAX_FDS: usize = dsec_wire::init::ZYGOTE_MAX_FDS - 1;
        if pairs.len() > MAX_FDS {
            return Err(create_err(id, "too many descriptors for init"));
        }
        // Forked from the warm zygote; exec'd when the zygote cannot take it.
        let mut forked = pairs.clone();
        forked.push((log.as_raw_fd(), 2));
        let (child, report) = match self.zygote.fork_init(init, &forked) {
            Ok(pid) => {
                drop((log, status_w));
                let report =
                    read_status(&status_r, self.cfg.create_timeout).map_err(|e| create_err(id, e));
                (Exec::Forked(pid), report)
            }
            Err(e) => {
                tracing::warn!(%id, error = %e, "zygote unavailable; exec'ing init");
                let (pid, report) = self.exec_init(id, init, &pairs, log, status_w, &status_r)?;
                (Exec::Spawned(pid), report)
            }
        };
        // One that never reported (spec not taken, status timed out) may still be
        // running: kill it, so no half-built sandbox outlives the failed create.
        if report.is_err() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.pid()),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        // The intermediate process exits right after its fork (or failed): a spawned one
        // is ours to reap, a forked one the zygote's (the kernel reaps it).
        if let Exec::Spawned(pid) = child {
            let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None);
        }
        let report = report?;
        let mut pid = None;
        let mut ready = false;
        for line in report.lines() {
            if let Some(p) = line.strip_prefix("pid ") {
                pid = p.trim().parse::<i32>().ok();
            } else if line == "ready" {
                ready = true;
            } else if let Some(msg) = line.strip_prefix("error invalid ") {
                // The request named something the image lacks (init says so).
                return Err(NodeError::Unsupported(msg.to_string()));
            } else if let Some(msg) = line.strip_prefix("error ") {
                return Err(create_err(id, msg));
            }
        }
        let Some(pid) = pid else {
            let log = fs::read_to_string(&log_path).unwrap_or_default();
            return Err(create_err(
                id,
                format!("init did not start: {}", log.trim()),
            ));
        };
        if !ready {
            return Err(create_err(id, "init exited before the sandbox was ready"));
        }
        let start =
            pid_start_time(pid).ok_or_else(|| create_err(id, "init died right after start"))?;
        protect_agent(id, pid, fds.userns.is_none());
        Ok((pid, start))
    }

    /// Execs `dsec-agent init` with the spec on its stdin (when the zygote is not
    /// available). Returns its pid and its status report.
    fn exec_init(
        &self,
        id: &str,
        init: &InitSpec,
        pairs: &[(RawFd, i32)],
        log: fs::File,
        status_w: OwnedFd,
        status_r: &OwnedFd,
    ) -> Result<(i32, Result<String, NodeError>), NodeError> {
        let (stdin_r, stdin_w): (OwnedFd, OwnedFd) = nix::unistd::pipe2(OFlag::O_CLOEXEC)
            .map_err(|e| create_err(id, format!("pipe: {e}")))?;
        let devnull = fs::OpenOptions::new()
            .write(true)
            .open("/dev/null")
            .map_err(NodeError::io("open", Path::new("/dev/null")))?;
        // argv[0] without the host path: /proc/1/cmdline is readable inside.
        let child = crate::spawn::spawn(
            &self.cfg.agent_bin,
            &["dsec-agent", "init"],
            &crate::spawn::SpawnFds {
                stdin: stdin_r.as_raw_fd(),
                stdout: devnull.as_raw_fd(),
                stderr: log.as_raw_fd(),
                fixed: pairs,
            },
        )
        .map_err(|e| create_err(id, format!("start {}: {e}", self.cfg.agent_bin.display())))?;
        drop((stdin_r, devnull, log, status_w));
        let json = serde_json::to_vec(init).map_err(|e| create_err(id, e))?;
        let sent = fs::File::from(stdin_w)
            .write_all(&json)
            .map_err(|e| create_err(id, format!("send init spec: {e}")));
        let report = sent.and_then(|()| {
            read_status(status_r, self.cfg.create_timeout).map_err(|e| create_err(id, e))
        });
        Ok((child, report))
    }

    /// The microVM level and the record of `id`, if `id` is a microVM.
    fn microvm_of(&self, id: &str) -> Option<(&crate::microvm::MicroVms, RuntimeRecord)> {
        let vms = self.microvms.as_ref()?;
        let rec = self.read_record(id)?;
        rec.isolation.is_machine().then_some((vms, rec))
    }

    /// The VM directory of full VM `id`, whose QEMU runs (not saved by a pause).
    fn screen_of(&self, id: &str) -> Result<PathBuf, NodeError> {
        let rec = self
            .read_record(id)
            .ok_or_else(|| NodeError::NotFound(id.to_string()))?;
        if rec.isolation != Isolation::Vm {
            return Err(NodeError::Unsupported(format!(
                "sandbox {id} has no screen: only isolation vm has one"
            )));
        }
        if crate::microvm::MicroVms::is_saved(&self.cfg.sandbox_dir(id)) {
            return Err(NodeError::Unsupported(format!(
                "sandbox {id} is paused: resume it first"
            )));
        }
        Ok(self.cfg.sandbox_run_dir(id).join("vm"))
    }

    /// Isolation levels `microvm` and `vm` (see `microvm.rs`): QEMU in the sandbox's cgroup.
    fn create_microvm(
        &self,
        spec: &NodeCreateSpec,
        layers: &Layers,
        timeline: &mut Timeline,
    ) -> Result<RuntimeRecord, NodeError> {
        let vms = self.microvms.as_ref().ok_or_else(|| {
            NodeError::Unsupported(format!(
                "isolation {}: this node has no virtual machines (apt-get install \
                     qemu-system-x86 linux-image-cloud-amd64; see dsec serve --help)",
                if spec.isolation == Isolation::Vm {
                    "vm"
                } else {
                    "microvm"
                }
            ))
        })?;
        crate::microvm::MicroVms::check(spec)?;
        let id = &spec.id;
        let (dir, run) = (self.cfg.sandbox_dir(id), self.cfg.sandbox_run_dir(id));
        let mut builder = fs::DirBuilder::new();
        builder.recursive(true).mode(0o700);
        builder.create(&run).map_err(NodeError::io("mkdir", &run))?;
        builder.create(&dir).map_err(NodeError::io("mkdir", &dir))?;
        let limits = Limits {
            cpu_millis: Some(spec.cpu_millis),
            memory_bytes: Some(
                spec.memory_bytes
                    .max(crate::microvm::min_guest_mib(spec.isolation) << 20)
                    .saturating_add(crate::microvm::VMM_OVERHEAD_BYTES),
            ),
            pids_max: Some(crate::microvm::VMM_PIDS_MAX),
            cpu_weight: Some(match spec.qos {
                Qos::LatencySensitive => WEIGHT_LATENCY_SENSITIVE,
                Qos::BestEffort => WEIGHT_BEST_EFFORT,
            }),
        };
        let cgroup = Cgroup::create(&self.cgroups, &self.cgroup_path(id), &limits)?;
        let procs = cgroup.procs_paths();
        self.handles()
            .insert(id.clone(), std::sync::Arc::new(cgroup));
        timeline.mark("cgroup");
        let home = crate::microvm::Home {
            run: &run,
            state: &dir,
            procs: &procs,
        };
        // A networked microVM's link is a tap on the host under the same rules as a
        // container's veth; the guest configures its own address.
        let lease = match spec.network.mode {
            NetworkMode::None => None,
            _ => Some(self.network(&[])?.acquire_tap(id, &spec.network)?),
        };
        timeline.mark("network");
        let started = vms.start(
            spec,
            &layers.files,
            &home,
            self.disks.as_ref(),
            lease.as_ref(),
            timeline,
        )?;
        let pid_start_time = pid_start_time(started.pid)
            .ok_or_else(|| create_err(id, "QEMU died right after its guest started"))?;
        let rec = RuntimeRecord {
            id: id.clone(),
            image_digest: layers.digest.clone(),
            pid: started.pid,
            pid_start_time,
            cgroup: self.cgroup_path(id),
            agent_socket: started.socket,
            disk_mb: Some(started.disk_mb),
            cpu_millis: spec.cpu_millis,
            layers: layers.layers.iter().map(|(d, _)| d.clone()).collect(),
            net: lease.and_then(|_| self.network_if_started().and_then(|n| n.record(id))),
            isolation: spec.isolation,
            userns: None,
        };
        write_record(&run, &rec)?;
        Ok(rec)
    }

    fn remove_dirs(&self, id: &str) -> Result<(), NodeError> {
        // The disk first: removing the directory must not walk into it. Nothing runs in
        // the sandbox any more (its cgroup is gone), so a lightly used disk can go back
        // to the pool.
        let held = self.disks_held().remove(id);
        match (&self.disks, held) {
            (Some(disks), Some(disk)) => {
                disks.recycle(disk)?;
            }
            (None, Some(disk)) => dsec_disk::release(disk)?,
            (_, None) => dsec_disk::release_dir(&self.cfg.sandbox_dir(id).join("disk"))?,
        }
        for d in [self.cfg.sandbox_run_dir(id), self.cfg.sandbox_dir(id)] {
            match fs::remove_dir_all(&d) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(NodeError::Io {
                        op: "remove",
                        path: d.display().to_string(),
                        source: e,
                    })
                }
            }
        }
        Ok(())
    }
}

/// Removes what an OCI runtime made of cgroup `path` in hierarchies the node does not
/// manage (runsc makes it in every v1 hierarchy, blkio, cpuset, devices, name=systemd,
/// and does not always remove them). Empty by now: its processes are gone.
fn remove_runtime_cgroups(path: &str) {
    let Ok(roots) = fs::read_dir("/sys/fs/cgroup") else {
        return;
    };
    for root in roots.flatten() {
        let dir = root.path().join(path);
        if dir.is_dir() {
            if let Err(e) = fs::remove_dir(&dir) {
                tracing::debug!(dir = %dir.display(), error = %e, "removing a runtime's cgroup");
            }
        }
    }
}

/// The runtime of a sandbox at level `oci` or `gvisor`.
#[derive(Debug, Clone, Copy)]
enum Runtime<'a> {
    /// An OCI runtime binary (runc).
    Oci(&'a std::path::PathBuf),
    /// gVisor.
    Gvisor(&'a crate::gvisor::Gvisor),
}

impl ContainerBackend {
    /// Isolation levels `oci` and `gvisor`: mount the root on the host, write the bundle, let the
    /// runtime start the agent in the sandbox's cgroup.
    fn create_oci(
        &self,
        spec: &NodeCreateSpec,
        layers: &Layers,
        run: &Path,
        upper: &Path,
        work: &Path,
        disk_mb: Option<u64>,
    ) -> Result<RuntimeRecord, NodeError> {
        let id = &spec.id;
        let gvisor = spec.isolation == Isolation::Gvisor;
        let level = if gvisor { "gvisor" } else { "oci" };
        let runtime = if gvisor {
            Runtime::Gvisor(self.cfg.gvisor.as_ref().ok_or_else(|| {
                NodeError::Unsupported(
                    "isolation gvisor: this node has no runsc (apt-get install runsc, or dsec serve --gvisor-runtime)".into(),
                )
            })?)
        } else {
            Runtime::Oci(self.cfg.oci_runtime.as_ref().ok_or_else(|| {
                NodeError::Unsupported(
                    "isolation oci: this node has no OCI runtime (dsec serve --oci-runtime)".into(),
                )
            })?)
        };
        if spec.network.mode != NetworkMode::None
            || spec.model_link
            || !spec.writable_paths.is_empty()
            || spec.tcp_bind.is_some()
            || spec.tcp_connect.is_some()
        {
            return Err(NodeError::Unsupported(format!(
                "isolation {level}: network modes, model access and file or TCP rules need isolation container"
            )));
        }
        // The node's own view of the disk (a detached one through its fd).
        let (upper, work) = match self.disks_held().get(id) {
            Some(d) => (
                dsec_disk::upper_dir(&d.root()),
                dsec_disk::work_dir(&d.root()),
            ),
            None => (upper.to_path_buf(), work.to_path_buf()),
        };
        let lower: Vec<String> = layers
            .layers
            .iter()
            .rev()
            .map(|(_, mnt)| mnt.display().to_string())
            .collect();
        let rootfs = run.join("rootfs");
        let opts = format!(
            "lowerdir={},upperdir={},workdir={}",
            lower.join(":"),
            upper.display(),
            work.display()
        );
        nix::mount::mount(
            Some("overlay"),
            &rootfs,
            Some("overlay"),
            nix::mount::MsFlags::MS_NODEV,
            Some(opts.as_str()),
        )
        .map_err(|e| create_err(id, format!("mount root: {e}")))?;
        let bundle = run.join("bundle");
        fs::create_dir_all(&bundle).map_err(NodeError::io("mkdir", &bundle))?;
        let socket_dir = crate::gvisor::socket_dir(run);
        let listen = match runtime {
            Runtime::Oci(_) => crate::oci::AgentListen::Fd,
            Runtime::Gvisor(_) => {
                fs::create_dir_all(&socket_dir).map_err(NodeError::io("mkdir", &socket_dir))?;
                crate::oci::AgentListen::HostDir(&socket_dir)
            }
        };
        let config = crate::oci::bundle_config(
            spec,
            &rootfs,
            &self.cfg.agent_bin,
            &self.cgroup_path(id),
            listen,
        );
        let path = bundle.join("config.json");
        fs::write(&path, config.to_string()).map_err(NodeError::io("write", &path))?;
        let (pid, socket) = match runtime {
            Runtime::Oci(bin) => {
                let socket = self.cfg.agent_socket(id);
                let listener =
                    UnixListener::bind(&socket).map_err(NodeError::io("bind", &socket))?;
                let state = crate::oci::state_dir(&self.cfg.run_dir);
                let pid = crate::oci::start(bin, &state, &bundle, id, &listener)
                    .map_err(|e| create_err(id, e))?;
                (pid, socket)
            }
            Runtime::Gvisor(g) => {
                let socket = socket_dir.join("agent.sock");
                let state = crate::gvisor::state_dir(&self.cfg.run_dir);
                let pid = g
                    .start(&state, &bundle, id, &socket)
                    .map_err(|e| create_err(id, e))?;
                (pid, socket)
            }
        };
        let start_time =
            pid_start_time(pid).ok_or_else(|| create_err(id, "sandbox died right after start"))?;
        // runc's init is our agent; runsc's pid is its Sentry, which serves the agent's
        // system calls (gVisor keeps the Sentry out of the OOM killer's way itself).
        if !gvisor {
            protect_agent(id, pid, true);
        }
        let mut rec = self.record(spec, layers, (pid, start_time), disk_mb);
        rec.agent_socket = socket;
        Ok(rec)
    }

    /// The runtime record of a sandbox just started (no network; the caller adds it).
    fn record(
        &self,
        spec: &NodeCreateSpec,
        layers: &Layers,
        (pid, pid_start_time): (i32, u64),
        disk_mb: Option<u64>,
    ) -> RuntimeRecord {
        RuntimeRecord {
            id: spec.id.clone(),
            image_digest: layers.digest.clone(),
            pid,
            pid_start_time,
            cgroup: self.cgroup_path(&spec.id),
            agent_socket: self.cfg.agent_socket(&spec.id),
            disk_mb,
            layers: layers.layers.iter().map(|(d, _)| d.clone()).collect(),
            cpu_millis: spec.cpu_millis,
            net: None,
            isolation: spec.isolation,
            userns: None,
        }
    }
}

impl Userns {
    /// Checks that the kernel can make the namespaces; scope `node` makes its one now.
    fn start(cfg: &UsernsConfig) -> Result<Self, NodeError> {
        if cfg.usable_ranges() == 0 {
            return Err(NodeError::Unsupported(format!(
                "user namespaces: no range of {RANGE_SIZE} ids fits from {} (--userns-ranges {})",
                cfg.base, cfg.ranges
            )));
        }
        let probe = UserNs::create(cfg.base, RANGE_SIZE).map_err(|e| {
            NodeError::Unsupported(format!("user namespace {}+{RANGE_SIZE}: {e}", cfg.base))
        })?;
        Ok(Self {
            cfg: cfg.clone(),
            ranges: std::sync::Arc::new(std::sync::Mutex::new(UidRanges::new(cfg))),
            shared: (cfg.scope == UsernsScope::Node).then_some(probe),
        })
    }

    fn ranges(&self) -> std::sync::MutexGuard<'_, UidRanges> {
        self.ranges.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The range for a new sandbox, and its namespace when it gets one of its own
    /// (`None`: the node's shared one).
    fn namespace_for(
        &self,
        spec: &NodeCreateSpec,
        pool: &crate::nspool::NetnsPool,
    ) -> Result<(UsernsRecord, Option<UserNs>), NodeError> {
        let group = self.cfg.group_of(&spec.id, &spec.labels);
        let rec = loop {
            match self.ranges().acquire(&spec.id, &group) {
                Ok(rec) => break rec,
                // Ranges the pool holds go to sandboxes first.
                Err(_) if pool.give_back_one() => continue,
                Err(e) => return Err(NodeError::Capacity(e.to_string())),
            }
        };
        if self.shared.is_some() {
            return Ok((rec, None));
        }
        // The caller's cleanup (destroy) gives the range back if this fails.
        let ns = UserNs::create(rec.base, rec.size)
            .map_err(|e| create_err(&spec.id, format!("user namespace: {e}")))?;
        Ok((rec, Some(ns)))
    }

    /// Marks a re-adopted sandbox's range taken. Records from before per-sandbox
    /// ranges name none: those sandboxes ran in the node's one namespace, whose range
    /// their init's uid map shows.
    fn adopt(&self, rec: &RuntimeRecord) {
        let range = rec.userns.clone().or_else(|| {
            let (base, size) = crate::userns::range_of(rec.pid)?;
            Some(UsernsRecord {
                base,
                size,
                group: "node".into(),
            })
        });
        if let Some(range) = range {
            self.ranges().adopt(&rec.id, &range);
        }
    }
}

impl ContainerBackend {
    /// A sandbox's runtime record, if it has a readable one. A record an older node wrote
    /// in the state directory is moved to the run directory, where this one keeps it.
    fn read_record(&self, id: &str) -> Option<RuntimeRecord> {
        let read = |dir: &Path| -> Option<RuntimeRecord> {
            let bytes = fs::read(dir.join(RECORD_FILE)).ok()?;
            serde_json::from_slice(&bytes).ok()
        };
        let run = self.cfg.sandbox_run_dir(id);
        if let Some(rec) = read(&run) {
            return Some(rec);
        }
        let legacy = self.cfg.sandbox_dir(id);
        let rec = read(&legacy)?;
        let moved = fs::create_dir_all(&run)
            .map_err(NodeError::io("mkdir", &run))
            .and_then(|()| write_record(&run, &rec));
        match moved {
            Ok(()) => {
                let _ = fs::remove_file(legacy.join(RECORD_FILE));
            }
            Err(e) => {
                tracing::warn!(%id, error = %e, "moving the runtime record to the run directory")
            }
        }
        Some(rec)
    }
}

/// The name of a sandbox's runtime record in its run directory.
const RECORD_FILE: &str = "runtime.json";

/// Writes a sandbox's runtime record atomically.
fn write_record(dir: &Path, rec: &RuntimeRecord) -> Result<(), NodeError> {
    let json = serde_json::to_vec_pretty(rec).map_err(|e| create_err(&rec.id, e))?;
    let rec_path = dir.join(RECORD_FILE);
    let tmp = dir.join(format!("{RECORD_FILE}.tmp"));
    fs::write(&tmp, json).map_err(NodeError::io("write", &tmp))?;
    fs::rename(&tmp, &rec_path).map_err(NodeError::io("rename", &rec_path))
}

/// How an init was started.
#[derive(Debug, Clone, Copy)]
enum Exec {
    /// Forked by the zygote (its child; the kernel reaps it).
    Forked(i32),
    /// Spawned by the node (its child; the node reaps it).
    Spawned(i32),
}

impl Exec {
    fn pid(self) -> i32 {
        match self {
            Exec::Forked(p) | Exec::Spawned(p) => p,
        }
    }
}

/// Host fds init inherits, at fixed numbers.
#[derive(Debug, Clone)]
struct InitFds {
    /// The agent's listening socket.
    listen: RawFd,
    /// The mount holding upper and work, when detached or idmapped.
    disk: Option<RawFd>,
    /// The prepared network namespace, if any.
    netns: Option<RawFd>,
    /// The user namespace, if any.
    userns: Option<RawFd>,
    /// The skeleton mount namespace, if init starts from it.
    mntns: Option<RawFd>,
    /// Idmapped layer mounts, bottom first (user namespace mode).
    layers: Vec<RawFd>,
}

/// Reads the status pipe until EOF or the deadline.
fn read_status(fd: &OwnedFd, timeout: Duration) -> Result<String, String> {
    let deadline = Instant::now() + timeout;
    let mut out = Vec::new();
    let mut file = fs::File::from(fd.try_clone().map_err(|e| e.to_string())?);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("init did not report within {timeout:?}"));
        }
        let ms = u16::try_from(left.as_millis()).unwrap_or(u16::MAX);
        let mut fds = [PollFd::new(std::os::fd::AsFd::as_fd(fd), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(ms)) {
            Ok(0) => continue,
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(format!("poll status pipe: {e}")),
        }
        let mut buf = [0u8; 512];
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("read status pipe: {e}")),
        }
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// Start time (clock ticks since boot) of a pid, or `None` if it does not exist.
pub fn pid_start_time(pid: i32) -> Option<u64> {
    let fields = crate::procstat::fields(pid)?;
    fields.get(crate::procstat::at(22))?.parse().ok()
}

impl Backend for ContainerBackend {
    fn create(
        &self,
        spec: &NodeCreateSpec,
        layers: &Layers,
        timeline: &mut Timeline,
    ) -> Result<RuntimeRecord, NodeError> {
        let res = self.create_inner(spec, layers, timeline);
        if res.is_err() {
            if let Err(e) = self.destroy(&spec.id) {
                tracing::warn!(id = %spec.id, error = %e, "cleanup after failed create");
            }
        }
        res
    }

    fn destroy(&self, id: &str) -> Result<(), NodeError> {
        if let Some(vms) = &self.microvms {
            vms.close_channel(id);
        }
        let cached = self.handles().remove(id);
        let lent = self.lent_map().remove(id);
        if let (Some(u), None) = (&self.userns, &lent) {
            // Its processes die with the cgroup below, before any new create can take the
            // lock: the range is free for reuse.
            u.ranges().release(id);
        }
        let emptied = self.kill_and_remove_cgroup(id, cached);
        if let Some(lent) = lent {
            match &emptied {
                // No process of the sandbox is left: its namespaces may serve another.
                Ok(()) => {
                    self.nspool.give_back(id, lent);
                }
                Err(_) => {
                    if let Some(u) = &self.userns {
                        u.ranges().release(id);
                    }
                }
            }
        }
        if let Some(vms) = &self.microvms {
            vms.reap(id);
            vms.forget(id);
        }
        emptied?;
        if let Some(net) = self.network_if_started() {
            net.release(id)?;
        }
        self.remove_dirs(id)
    }

    fn recover(&self) -> Result<Vec<RuntimeRecord>, NodeError> {
        // A sandbox may have left a state directory (its disk), a run directory (its
        // record and socket), or both.
        let mut ids = std::collections::BTreeSet::new();
        for root in [
            self.cfg.state_dir.join("sandboxes"),
            self.cfg.run_dir.join("sandboxes"),
        ] {
            match fs::read_dir(&root) {
                Ok(e) => ids.extend(
                    e.filter_map(Result::ok)
                        .map(|e| e.file_name().to_string_lossy().into_owned()),
                ),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(NodeError::Io {
                        op: "read_dir",
                        path: root.display().to_string(),
                        source: e,
                    })
                }
            }
        }
        let mut alive = Vec::new();
        for id in ids {
            match self.read_record(&id) {
                Some(rec)
                    if self.is_alive(&rec)
                        && (rec.agent_socket.exists()
                            || (rec.isolation.is_machine()
                                && crate::microvm::MicroVms::is_saved(
                                    &self.cfg.sandbox_dir(&id),
                                ))) =>
                {
                    tracing::info!(%id, pid = rec.pid, "re-adopting live sandbox");
                    if rec.isolation.is_machine() {
                        match &self.microvms {
                            // One paused to its snapshot has no QEMU to talk to.
                            Some(_)
                                if crate::microvm::MicroVms::is_saved(
                                    &self.cfg.sandbox_dir(&id),
                                ) => {}
                            Some(vms) => vms.adopt(&id, &self.cfg.sandbox_run_dir(&id))?,
                            None => {
                                tracing::warn!(%id, "a live microVM, but this node runs none now: deleting it");
                                self.destroy(&id)?;
                                continue;
                            }
                        }
                    }
                    alive.push(rec);
                }
                _ => {
                    tracing::info!(%id, "cleaning up dead or half-created sandbox");
                    self.destroy(&id)?;
                }
            }
        }
        if let Some(u) = &self.userns {
            for rec in alive.iter().filter(|r| r.isolation == Isolation::Container) {
                u.adopt(rec);
            }
        }
        let networked: Vec<(String, dsec_net::NetRecord)> = alive
            .iter()
            .filter_map(|r| r.net.clone().map(|n| (r.id.clone(), n)))
            .collect();
        if !networked.is_empty() {
            self.network(&networked)?;
        }
        // Cgroups with no sandbox directory: left by a crash between cgroup creation and
        // the directory, or by an earlier cleanup that failed.
        let known: std::collections::HashSet<&str> = alive.iter().map(|r| r.id.as_str()).collect();
        for child in Cgroup::list_children(&self.cgroups, &self.cfg.cgroup_parent)? {
            let id = child.rsplit('/').next().unwrap_or(&child).to_string();
            if !known.contains(id.as_str()) {
                tracing::info!(cgroup = %child, "removing orphaned cgroup");
                self.destroy(&id)?;
            }
        }
        Ok(alive)
    }

    fn is_alive(&self, rec: &RuntimeRecord) -> bool {
        if rec.isolation.is_machine()
            && (crate::microvm::MicroVms::is_saved(&self.cfg.sandbox_dir(&rec.id))
                || self
                    .microvms
                    .as_ref()
                    .is_some_and(|v| v.still_running(&rec.id)))
        {
            // Paused to its snapshot (no process), or a QEMU this node started and that
            // runs: a restore's new QEMU is alive before the record names it.
            return true;
        }
        pid_start_time(rec.pid) == Some(rec.pid_start_time) && !is_zombie(rec.pid)
    }

    fn shutdown(&self, empty: bool) {
        self.zygote.stop();
        self.nspool.stop();
        let net = self.network_if_started();
        if let Some(n) = &net {
            n.stop_pool();
        }
        if !empty {
            return;
        }
        match (&net, &self.cfg.network) {
            (Some(n), _) => {
                n.shutdown();
            }
            // Not started in this run: an earlier run's table and links may be there.
            (None, Some(cfg)) => dsec_net::remove_traces(cfg),
            (None, None) => {}
        }
        match Cgroup::remove_parent(&self.cgroups, &self.cfg.cgroup_parent) {
            Ok(kept) if kept.is_empty() => {}
            Ok(kept) => tracing::warn!(?kept, "cgroup parent still in use; kept"),
            Err(e) => tracing::warn!(error = %e, "removing the cgroup parent"),
        }
    }

    fn pause(&self, id: &str) -> Result<(u64, u64), NodeError> {
        if let Some((vms, _)) = self.microvm_of(id) {
            // Saved to disk and ended: nothing of it stays in memory.
            let cg = self.cgroup(id)?;
            let before = cg.memory_usage()?;
            let (run, state) = (self.cfg.sandbox_run_dir(id), self.cfg.sandbox_dir(id));
            let procs = cg.procs_paths();
            let home = crate::microvm::Home {
                run: &run,
                state: &state,
                procs: &procs,
            };
            let size = vms.save(id, &home)?;
            let _ = cg.reclaim();
            let after = cg.memory_usage()?;
            tracing::info!(%id, before, after, snapshot_bytes = size, "microVM saved and ended");
            return Ok((before, after));
        }
        let cg = self.cgroup(id)?;
        cg.freeze()?;
        let before = cg.memory_usage()?;
        cg.reclaim()?;
        let after = cg.memory_usage()?;
        tracing::info!(%id, before, after, "sandbox paused");
        Ok((before, after))
    }

    fn resume(&self, id: &str) -> Result<Option<RuntimeRecord>, NodeError> {
        if let Some((vms, mut rec)) = self.microvm_of(id) {
            let (run, state) = (self.cfg.sandbox_run_dir(id), self.cfg.sandbox_dir(id));
            if !crate::microvm::MicroVms::is_saved(&state) {
                // Paused before snapshots, or never paused: a thaw is all it needs.
                self.cgroup(id)?.thaw()?;
                return Ok(None);
            }
            let procs = self.cgroup(id)?.procs_paths();
            let home = crate::microvm::Home {
                run: &run,
                state: &state,
                procs: &procs,
            };
            let pid = vms.restore(id, &home)?;
            rec.pid = pid;
            rec.pid_start_time = pid_start_time(pid)
                .ok_or_else(|| create_err(id, "QEMU died right after its restore"))?;
            write_record(&run, &rec)?;
            return Ok(Some(rec));
        }
        self.cgroup(id)?.thaw()?;
        Ok(None)
    }

    fn with_upper(
        &self,
        id: &str,
        f: &mut dyn FnMut(&Path) -> Result<(), NodeError>,
    ) -> Result<(), NodeError> {
        /// Thaws what this commit froze on every way out, a panic in the copy included.
        struct Thaw<'a>(Option<&'a Cgroup>, &'a str);
        impl Drop for Thaw<'_> {
            fn drop(&mut self) {
                if let Some(cg) = self.0.take() {
                    if let Err(e) = cg.thaw() {
                        tracing::warn!(id = %self.1, error = %e, "thawing a sandbox after its commit");
                    }
                }
            }
        }
        if self
            .read_record(id)
            .is_some_and(|r| r.isolation.is_machine())
        {
            return Err(NodeError::Unsupported(format!(
                "sandbox {id} is a microVM: its files are on its own disk, inside the guest; \
                 commit and job suspend do not support microVMs yet"
            )));
        }
        let upper = self.upper_dir(id)?;
        let cg = self.cgroup(id)?;
        let froze_here = !cg.is_frozen()?;
        if froze_here {
            cg.freeze()?;
        }
        let mut thaw = Thaw(froze_here.then_some(&*cg), id);
        let res = f(&upper);
        if let Some(cg) = thaw.0.take() {
            cg.thaw()?;
        }
        res
    }

    fn oom_kill_count(&self, id: &str) -> Result<u64, NodeError> {
        let host = self.cgroup(id)?.oom_kill_count()?;
        // A microVM's own kernel kills inside the guest, out of the host cgroup's sight.
        let guest = self
            .microvms
            .as_ref()
            .and_then(|v| v.guest_oom_kills(id, &self.cfg.sandbox_run_dir(id)))
            .unwrap_or(0);
        Ok(host + guest)
    }

    fn disk_free_mb(&self, id: &str) -> Option<u64> {
        let free = self.disks_held().get(id)?.free_bytes();
        free.ok().map(|b| b >> 20)
    }

    fn set_network(&self, id: &str, policy: &NetworkPolicy) -> Result<(), NodeError> {
        let net = self.network_if_started().filter(|n| n.record(id).is_some());
        let Some(net) = net else {
            return Err(NodeError::Unsupported(format!(
                "sandbox {id} was created with network mode none; its network cannot change"
            )));
        };
        net.set_policy(id, policy)?;
        // Keep the record true for a restart.
        let mut rec = self
            .read_record(id)
            .ok_or_else(|| NodeError::NotFound(id.to_string()))?;
        rec.net = net.record(id);
        write_record(&self.cfg.sandbox_run_dir(id), &rec)
    }

    fn screenshot(&self, id: &str) -> Result<Vec<u8>, NodeError> {
        let dir = self.screen_of(id)?;
        Ok(dsec_vmm::screen::screenshot(&dir)?)
    }

    fn send_input(&self, id: &str, events: &[dsec_wire::v1::InputEvent]) -> Result<(), NodeError> {
        let dir = self.screen_of(id)?;
        Ok(dsec_vmm::screen::send_input(&dir, events)?)
    }

    fn address(&self, rec: &RuntimeRecord) -> Option<std::net::Ipv4Addr> {
        let subnet = self.cfg.network.as_ref()?.subnet;
        rec.net
            .as_ref()
            .map(|n| dsec_net::slot_addrs(subnet, n.slot).sandbox)
    }
}

/// The OOM killer takes a sandbox's commands before its agent (where the node may lower
/// a score; see `dsec_container::harden::protect_from_oom`). `unkillable`: -1000, for
/// an agent whose children set their own score before their exec (not in a user
/// namespace; see `dsec-agent`'s `spawn`).
fn protect_agent(id: &str, pid: i32, unkillable: bool) {
    if let Err(e) = dsec_container::harden::protect_from_oom(pid, unkillable) {
        tracing::debug!(%id, pid, error = %e, "agent keeps the node's OOM score");
    }
}

fn is_zombie(pid: i32) -> bool {
    crate::procstat::fields(pid)
        .is_none_or(|f| f.get(crate::procstat::at(3)).is_some_and(|s| s == "Z"))
}

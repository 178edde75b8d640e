//! Isolation level `microvm`: each sandbox is a QEMU `microvm` with a kernel of its own.
//!
//! The node boots Debian's cloud kernel with an initramfs it builds around the static
//! agent (`dsec_vmm::guest`, built on the first microVM and kept). The sandbox's EROFS
//! layers are attached read-only as virtio disks, the very files the containers mount;
//! its writable layer is a sparse ext4 disk of the requested size. The agent is the
//! guest's init and serves the same protocol over a virtio-serial port, which the node
//! reaches through a unix socket like every other level's (`dsec_vmm::channel`).
//!
//! QEMU runs in the sandbox's cgroup, so delete, pause (freeze), CPU weight and the
//! node's accounting are the container backend's. Guest memory is the sandbox's memory
//! limit; the cgroup allows QEMU's own overhead on top.
//!
//! Isolation level `vm` is the same machinery with a full machine (`q35`, PCI devices, a
//! VGA screen and a keyboard, [`MachineKind::Full`]): the initramfs mounts the same root,
//! then hands the machine to the image's own init (systemd), with the agent installed as
//! its service. Everything the node does to a microVM (channel, snapshot, adoption,
//! reaping) it does to a VM alike.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use dsec_node_api::{NodeCreateSpec, Timeline};
use dsec_vmm::channel::Channel;
use dsec_vmm::guest::{GuestAssets, GuestKernel};
use dsec_vmm::qemu::{Machine, MachineFiles, MachineKind, Vmm};
use dsec_wire::v1::Isolation;
use dsec_wire::vm::GuestSpec;

use crate::NodeError;

/// Host memory a microVM's QEMU may use beyond its guest's memory: the translation
/// cache under TCG (bounded: `MachineKind::tcg_cache_mib`, at most 128 MiB), a full
/// machine's video memory (16 MiB), QEMU's heap and its mapping of the kernel.
pub const VMM_OVERHEAD_BYTES: u64 = 256 << 20;
/// Smallest guest: the kernel and the agent need about 60 MiB.
pub const MIN_GUEST_MIB: u64 = 128;
/// Smallest full VM: a whole system (systemd, its services) on top of the kernel.
pub const MIN_FULL_GUEST_MIB: u64 = 512;
/// The image's init a full VM hands its machine to.
pub const SYSTEM_INIT: &str = "/sbin/init";

/// The smallest guest memory of a sandbox of `isolation`, in MiB.
pub fn min_guest_mib(isolation: Isolation) -> u64 {
    match isolation {
        Isolation::Vm => MIN_FULL_GUEST_MIB,
        _ => MIN_GUEST_MIB,
    }
}
/// Writable disk of a microVM when the request names none and the node has no disk
/// limits (then the disk is made with `mkfs.ext4`).
pub const DEFAULT_DISK_MB: u64 = 1024;
/// How long a snapshot's save or restore may take.
pub const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(120);
/// How long the guest gets to see its host go away before it is stopped (so that it
/// waits for a new hello when it runs again; the channel reconnects if it did not).
const SETTLE_BEFORE_SAVE: Duration = Duration::from_millis(200);
/// Where a paused microVM's state is kept, in its state directory.
pub const SNAPSHOT_FILE: &str = "vm-snapshot.bin";
/// How long a delete waits for a killed QEMU to be reaped.
const REAP_WAIT: Duration = Duration::from_secs(5);
/// Host processes and threads of one QEMU (vCPU and I/O threads).
pub const VMM_PIDS_MAX: u64 = 64;

/// How a node runs microVMs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MicroVmConfig {
    /// QEMU and its accelerator.
    pub vmm: Vmm,
    /// The guest kernel.
    pub kernel: GuestKernel,
    /// How long a guest may take from QEMU's start to its agent's handshake.
    pub boot_timeout: Duration,
}

/// The microVM level's state on a node: the guest's initramfs (built on first use), the
/// runtime that carries the agent channels, and the channel of each live microVM.
#[derive(Debug)]
pub struct MicroVms {
    cfg: MicroVmConfig,
    agent: PathBuf,
    assets_dir: PathBuf,
    assets: OnceLock<Result<GuestAssets, String>>,
    /// Dropped with `shutdown_background` (see `Drop`): the node drops its backend from
    /// within its own runtime, where a blocking shutdown panics.
    rt: Option<tokio::runtime::Runtime>,
    channels: Mutex<HashMap<String, Channel>>,
    /// QEMUs this node process started (it reaps them; adopted ones are not its children).
    children: Mutex<HashMap<String, std::process::Child>>,
    /// OOM kills in each microVM's guest, counted from its console.
    oom: Mutex<HashMap<String, dsec_vmm::qemu::OomCounter>>,
}

/// Where a microVM lives on the host.
#[derive(Debug, Clone, Copy)]
pub struct Home<'a> {
    /// The sandbox's run directory (sockets, console, the VM's files).
    pub run: &'a Path,
    /// Its state directory (the writable disk, the initramfs).
    pub state: &'a Path,
    /// The `cgroup.procs` files QEMU joins.
    pub procs: &'a [PathBuf],
}

/// What [`MicroVms::start`] started.
#[derive(Debug)]
pub struct Started {
    /// QEMU's pid.
    pub pid: i32,
    /// The agent's socket on the host.
    pub socket: PathBuf,
    /// Size of the writable disk in MiB.
    pub disk_mb: u64,
}

impl MicroVms {
    /// The level's state, with the static agent at `agent` and the initramfs kept in
    /// `assets_dir`.
    pub fn new(cfg: MicroVmConfig, agent: PathBuf, assets_dir: PathBuf) -> Result<Self, NodeError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("vm-channels")
            .enable_all()
            .build()
            .map_err(NodeError::io(
                "start",
                Path::new("the microVM channel runtime"),
            ))?;
        Ok(Self {
            cfg,
            agent,
            assets_dir,
            assets: OnceLock::new(),
            rt: Some(rt),
            channels: Mutex::new(HashMap::new()),
            children: Mutex::new(HashMap::new()),
            oom: Mutex::new(HashMap::new()),
        })
    }

    /// The level's configuration.
    pub fn config(&self) -> &MicroVmConfig {
        &self.cfg
    }

    fn assets(&self) -> Result<&GuestAssets, NodeError> {
        self.assets
            .get_or_init(|| {
                GuestAssets::prepare(self.cfg.kernel.clone(), &self.agent, &self.assets_dir)
                    .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| NodeError::Unsupported(format!("isolation microvm and vm: {e}")))
    }

    fn channels(&self) -> std::sync::MutexGuard<'_, HashMap<String, Channel>> {
        self.channels.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Refuses what a microVM (or a full VM) cannot do, before anything is made.
    pub fn check(spec: &NodeCreateSpec) -> Result<(), NodeError> {
        let level = level_name(spec.isolation);
        let refuse = |what: &str| {
            Err(NodeError::Unsupported(format!(
                "isolation {level}: {what} is not supported yet"
            )))
        };
        if spec.model_link {
            return refuse("model access");
        }
        if !spec.writable_paths.is_empty() {
            return refuse("filesystem.writable");
        }
        if spec.tcp_bind.is_some() || spec.tcp_connect.is_some() {
            return refuse("TCP port rules");
        }
        Ok(())
    }

    /// Starts sandbox `spec`'s machine on `layer_files` (bottom first) in `home`. Waits until the guest's agent
    /// answered. On failure QEMU is left for the caller's cleanup (it is in the cgroup).
    pub fn start(
        &self,
        spec: &NodeCreateSpec,
        layer_files: &[PathBuf],
        home: &Home<'_>,
        disks: Option<&dsec_disk::Disks>,
        net: Option<&dsec_net::TapLease>,
        timeline: &mut Timeline,
    ) -> Result<Started, NodeError> {
        let (run, state, procs) = (home.run, home.state, home.procs);
        let id = &spec.id;
        let fail = |reason: String| NodeError::Create {
            id: id.clone(),
            reason,
        };
        let assets = self.assets()?;
        let kind = match spec.isolation {
            Isolation::Vm => MachineKind::Full,
            _ => MachineKind::Micro,
        };
        let vm_dir = run.join("vm");
        std::fs::create_dir_all(&vm_dir).map_err(NodeError::io("mkdir", &vm_dir))?;
        let disk_mb = spec
            .disk_mb
            .or(disks.map(|d| d.default_mb()))
            .unwrap_or(DEFAULT_DISK_MB);
        let disk = state.join("vm-disk.img");
        match disks {
            // The template every sandbox disk of this size is copied from.
            Some(d) => d.image(disk_mb, &disk)?,
            None => make_disk(&disk, disk_mb).map_err(|e| fail(format!("writable disk: {e}")))?,
        }
        let initrd = state.join("vm-initrd.img");
        let guest = GuestSpec {
            sandbox_id: id.clone(),
            layers: layer_files.len(),
            disk: true,
            env: spec.env.clone(),
            workdir: spec.workdir.clone(),
            user: spec.user.clone(),
            pids_max: spec.pids_max,
            net: net.map(|l| dsec_wire::vm::GuestNet {
                address: l.ip,
                prefix_len: l.prefix_len,
                gateway: l.gateway,
                resolv_conf: dsec_net::resolv_conf(l.gateway),
            }),
            system_init: (kind == MachineKind::Full).then(|| SYSTEM_INIT.to_string()),
        };
        assets
            .write_sandbox_initrd(&guest, &initrd)
            .map_err(|e| fail(format!("initramfs: {e}")))?;
        timeline.mark("disk");
        let machine = Machine {
            kind,
            dir: &vm_dir,
            // A full machine boots the compressed image through its real-mode setup,
            // which finds the VGA card (the text console); the ELF a microVM jumps into
            // would leave the screen to a dummy console.
            kernel: match kind {
                MachineKind::Micro => &assets.boot_image,
                MachineKind::Full => &self.cfg.kernel.image,
            },
            initrd: &initrd,
            memory_mib: (spec.memory_bytes >> 20).max(min_guest_mib(spec.isolation)),
            cpus: guest_cpus(spec.cpu_millis),
            layers: layer_files,
            disk: Some(&disk),
            tap: net.map(|l| l.ifname.as_str()),
        };
        let child = self
            .cfg
            .vmm
            .launch(&machine, procs)
            .map_err(|e| fail(e.to_string()))?;
        let pid = child.id() as i32;
        self.children
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.clone(), child);
        timeline.mark("vmm");
        let socket = run.join("agent.sock");
        self.open_channel(id, &vm_dir, &socket)?;
        let ready = self.channels().get(id.as_str()).map(|c| c.ready_waiter());
        // Waited in slices, to notice a QEMU that ended (a guest that panicked) at once.
        let deadline = std::time::Instant::now() + self.cfg.boot_timeout;
        let mut alive = true;
        let mut up = false;
        while let Some(w) = &ready {
            if w.wait(Duration::from_millis(100)) {
                up = true;
                break;
            }
            alive = self.still_running(id);
            if !alive || std::time::Instant::now() > deadline {
                break;
            }
        }
        if !up {
            let console = dsec_vmm::qemu::console_tail(&vm_dir, 15);
            return Err(fail(if alive {
                format!(
                    "the guest did not start its agent within {:?}; its console ends with:\n{console}",
                    self.cfg.boot_timeout
                )
            } else {
                format!("the VM stopped while booting; its console ends with:\n{console}")
            }));
        }
        timeline.mark("boot");
        Ok(Started {
            pid,
            socket,
            disk_mb,
        })
    }

    /// Whether the QEMU this process started for `id` still runs.
    pub fn still_running(&self, id: &str) -> bool {
        let mut children = self.children.lock().unwrap_or_else(|p| p.into_inner());
        children
            .get_mut(id)
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    fn open_channel(&self, id: &str, vm_dir: &Path, socket: &Path) -> Result<(), NodeError> {
        let rt = self.rt.as_ref().ok_or_else(|| {
            NodeError::Unsupported("isolation microvm and vm: the node is stopping".into())
        })?;
        let channel = Channel::start(
            rt.handle(),
            MachineFiles::in_dir(vm_dir).agent_port,
            socket.to_path_buf(),
        )
        .map_err(NodeError::io("agent channel", socket))?;
        self.channels().insert(id.to_string(), channel);
        Ok(())
    }

    /// Carries the channel of a microVM found alive after a node restart.
    pub fn adopt(&self, id: &str, run: &Path) -> Result<(), NodeError> {
        self.open_channel(id, &run.join("vm"), &run.join("agent.sock"))
    }

    /// Closes a microVM's channel (before its QEMU is killed with its cgroup).
    pub fn close_channel(&self, id: &str) {
        self.channels().remove(id);
    }

    /// Processes its guest killed for memory (its kernel's OOM killer or the agent's
    /// memory guard, as its console tells), if `run` is a microVM's run directory.
    pub fn guest_oom_kills(&self, id: &str, run: &Path) -> Option<u64> {
        let dir = run.join("vm");
        let mut counters = self.oom.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(counter) = counters.get_mut(id) {
            return counter.update(&dir).ok();
        }
        // Not counted yet: a container (no console) keeps no entry, on every exec.
        let mut counter = dsec_vmm::qemu::OomCounter::default();
        let n = counter.update(&dir).ok()?;
        counters.insert(id.to_string(), counter);
        Some(n)
    }

    /// Forgets what it counted of a deleted microVM.
    pub fn forget(&self, id: &str) {
        self.oom
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
    }

    /// Reaps the QEMU of `id` if this process started it, once its cgroup's kill ended
    /// it (a frozen QEMU dies only when thawed: waited for a bounded time, never for
    /// ever).
    pub fn reap(&self, id: &str) {
        let child = self
            .children
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        let Some(mut child) = child else { return };
        let _ = child.kill();
        let deadline = std::time::Instant::now() + REAP_WAIT;
        while std::time::Instant::now() < deadline {
            match child.try_wait() {
                Ok(None) => std::thread::sleep(Duration::from_millis(5)),
                // Exited, or already reaped by the node's reaper.
                _ => return,
            }
        }
        tracing::warn!(%id, pid = child.id(), "QEMU outlived its sandbox's delete");
    }
}

impl MicroVms {
    /// Pauses a microVM to its state directory: the whole machine is saved to
    /// [`SNAPSHOT_FILE`] and its QEMU ends, so a paused microVM holds no memory. Returns
    /// the snapshot's size.
    pub fn save(&self, id: &str, home: &Home<'_>) -> Result<u64, NodeError> {
        let fail = |e: dsec_vmm::VmmError| NodeError::Create {
            id: id.to_string(),
            reason: format!("snapshot: {e}"),
        };
        self.close_channel(id);
        std::thread::sleep(SETTLE_BEFORE_SAVE);
        let snapshot = home.state.join(SNAPSHOT_FILE);
        let saved = dsec_vmm::qemu::save(&home.run.join("vm"), &snapshot, SNAPSHOT_TIMEOUT);
        match saved {
            Ok(size) => {
                self.reap(id);
                Ok(size)
            }
            Err(e) => {
                // The machine may still run: give it its channel back.
                let _ = std::fs::remove_file(&snapshot);
                let _ = self.adopt(id, home.run);
                Err(fail(e))
            }
        }
    }

    /// Whether `id` is paused to a snapshot.
    pub fn is_saved(state: &Path) -> bool {
        state.join(SNAPSHOT_FILE).exists()
    }

    /// Starts a paused microVM again from its snapshot, QEMU in the cgroups of `procs`;
    /// returns the new QEMU's pid once the agent answers. The snapshot is removed then
    /// (the machine has moved on from it).
    pub fn restore(&self, id: &str, home: &Home<'_>) -> Result<i32, NodeError> {
        let fail = |reason: String| NodeError::Create {
            id: id.to_string(),
            reason,
        };
        let vm_dir = home.run.join("vm");
        let snapshot = home.state.join(SNAPSHOT_FILE);
        let child = self
            .cfg
            .vmm
            .restore(&vm_dir, &snapshot, home.procs, SNAPSHOT_TIMEOUT)
            .map_err(|e| fail(format!("restore: {e}")))?;
        let pid = child.id() as i32;
        self.children
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.to_string(), child);
        self.adopt(id, home.run)?;
        let ready = self.channels().get(id).map(|c| c.ready_waiter());
        if !ready.is_some_and(|w| w.wait(self.cfg.boot_timeout)) {
            return Err(fail(format!(
                "the restored guest's agent did not answer within {:?}",
                self.cfg.boot_timeout
            )));
        }
        let _ = std::fs::remove_file(&snapshot);
        Ok(pid)
    }
}

impl Drop for MicroVms {
    fn drop(&mut self) {
        // Channels first (their tasks end), then the runtime, without blocking.
        self.channels().clear();
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// vCPUs for a CPU limit in millicores (at least one; the cgroup enforces the limit).
/// The level's name in messages.
fn level_name(isolation: Isolation) -> &'static str {
    match isolation {
        Isolation::Vm => "vm",
        _ => "microvm",
    }
}

fn guest_cpus(cpu_millis: u64) -> u32 {
    let host = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
    cpu_millis.div_ceil(1000).clamp(1, host) as u32
}

/// Makes a sparse ext4 image of `mb` MiB at `path`.
fn make_disk(path: &Path, mb: u64) -> std::io::Result<()> {
    let f = std::fs::File::create(path)?;
    f.set_len(mb << 20)?;
    drop(f);
    let out = std::process::Command::new("mkfs.ext4")
        .args([
            "-q",
            "-F",
            "-m",
            "0",
            "-E",
            "lazy_itable_init=1,lazy_journal_init=1,nodiscard",
        ])
        .arg(path)
        .output()?;
    if !out.status.success() {
        return Err(std::io::Error::other(format!(
            "mkfs.ext4: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

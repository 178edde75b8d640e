//! cgroup v1/v2 abstraction for dsec sandboxes.
//!
//! Every sandbox gets one cgroup, named by a relative path such as `dsec/<sandbox-id>`.
//! On **cgroup v2** (a unified hierarchy at `/sys/fs/cgroup` whose `cgroup.controllers` lists
//! `memory`) that is one directory; on **cgroup v1** it is one directory per controller
//! hierarchy (`/sys/fs/cgroup/{cpu,cpuacct,memory,pids,freezer}/dsec/<id>`).
//!
//! The design follows youki's `libcgroups` in miniature: a [`CgroupManager`] trait with one
//! implementation per version ([`v1::V1Manager`], [`v2::V2Manager`]) and a [`Cgroup`] handle
//! that dispatches over an enum of the two.
//!
//! ```no_run
//! use dsec_cgroups::{Cgroup, CgroupRoot, Limits};
//! # fn main() -> Result<(), dsec_cgroups::CgroupError> {
//! let root = CgroupRoot::detect()?;
//! let limits = Limits { cpu_millis: Some(500), memory_bytes: Some(256 << 20), pids_max: Some(64), cpu_weight: None };
//! let cg = Cgroup::create(&root, "dsec/sb-1", &limits)?;
//! // ... the sandbox init writes "0" into each of cg.procs_paths() ...
//! cg.destroy()?;
//! # Ok(()) }
//! ```

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub mod dynmods;
pub mod v1;
pub mod v2;

mod util;

pub use util::{cpu_quota_us, parse_flat_keyed, CPU_PERIOD_US};

/// Where cgroupfs is mounted on a normal system.
pub const DEFAULT_MOUNT_ROOT: &str = "/sys/fs/cgroup";

/// Default bound for [`Cgroup::kill_all`], [`Cgroup::destroy`], [`Cgroup::freeze`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors of this crate. Every I/O error names the path that failed.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// A filesystem operation on a cgroupfs path failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was attempted (`read`, `write`, `mkdir`, `rmdir`, ...).
        op: &'static str,
        /// The path that failed.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Neither a usable cgroup v2 nor v1 layout was found.
    #[error(
        "no usable cgroup hierarchy under {}: neither cgroup.controllers listing memory (v2) \
         nor memory/memory.limit_in_bytes (v1)",
        .0.display()
    )]
    Unsupported(PathBuf),
    /// A required v1 controller hierarchy is not mounted.
    #[error("cgroup v1 controller {controller} not mounted at {}", path.display())]
    MissingController {
        /// Controller name (`memory`, `cpu`, `pids`).
        controller: &'static str,
        /// Where it was expected.
        path: PathBuf,
    },
    /// The relative cgroup path is not acceptable.
    #[error("invalid cgroup path {path:?}: {reason}")]
    InvalidPath {
        /// The path as given.
        path: String,
        /// Why it was rejected.
        reason: &'static str,
    },
    /// [`Cgroup::open`] of a cgroup that does not exist.
    #[error("cgroup does not exist: {}", .0.display())]
    NotFound(PathBuf),
    /// A cgroupfs file had unexpected content.
    #[error("unexpected content in {}: {content:?}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// What was read (possibly truncated).
        content: String,
    },
    /// A bounded wait ran out.
    #[error("timed out after {timeout:?} waiting for {what} in {}", path.display())]
    Timeout {
        /// The cgroup directory.
        path: PathBuf,
        /// What was awaited.
        what: String,
        /// The bound.
        timeout: Duration,
    },
}

/// Result alias of this crate.
pub type Result<T, E = CgroupError> = std::result::Result<T, E>;

/// cgroup version in use for sandbox cgroups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CgroupVersion {
    /// Legacy: one hierarchy per controller.
    V1,
    /// Unified hierarchy.
    V2,
}

impl fmt::Display for CgroupVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CgroupVersion::V1 => f.write_str("v1"),
            CgroupVersion::V2 => f.write_str("v2"),
        }
    }
}

/// Detect the cgroup version under [`DEFAULT_MOUNT_ROOT`].
pub fn detect() -> Result<CgroupVersion> {
    detect_at(Path::new(DEFAULT_MOUNT_ROOT))
}

/// Detect the cgroup version under `mount_root`.
///
/// v2 iff `<root>/cgroup.controllers` exists and lists `memory`; else v1 iff
/// `<root>/memory/memory.limit_in_bytes` exists; else [`CgroupError::Unsupported`].
pub fn detect_at(mount_root: &Path) -> Result<CgroupVersion> {
    let controllers = mount_root.join("cgroup.controllers");
    match std::fs::read_to_string(&controllers) {
        Ok(s) if s.split_whitespace().any(|c| c == "memory") => return Ok(CgroupVersion::V2),
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(util::io_err("read", &controllers, e)),
    }
    if mount_root.join("memory/memory.limit_in_bytes").exists() {
        return Ok(CgroupVersion::V1);
    }
    Err(CgroupError::Unsupported(mount_root.to_path_buf()))
}

/// Where cgroupfs lives and which version to drive. Cheap to clone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupRoot {
    mount_root: PathBuf,
    version: CgroupVersion,
    /// The v1 hierarchies, probed on first use.
    v1_layout: std::sync::OnceLock<v1::Layout>,
}

impl CgroupRoot {
    /// Detect the version under `/sys/fs/cgroup`.
    pub fn detect() -> Result<Self> {
        Self::detect_at(DEFAULT_MOUNT_ROOT)
    }

    /// Detect the version under another mount root (tests, unusual layouts).
    pub fn detect_at(mount_root: impl Into<PathBuf>) -> Result<Self> {
        let mount_root = mount_root.into();
        let version = detect_at(&mount_root)?;
        Ok(Self {
            mount_root,
            version,
            v1_layout: std::sync::OnceLock::new(),
        })
    }

    /// Use a given root and version without probing.
    pub fn new(mount_root: impl Into<PathBuf>, version: CgroupVersion) -> Self {
        Self {
            mount_root: mount_root.into(),
            version,
            v1_layout: std::sync::OnceLock::new(),
        }
    }

    /// The cgroupfs mount root (`/sys/fs/cgroup`).
    pub fn mount_root(&self) -> &Path {
        &self.mount_root
    }

    /// The cgroup version driven.
    pub fn version(&self) -> CgroupVersion {
        self.version
    }
}

/// Resource limits of one sandbox cgroup. `None` leaves the current value untouched
/// (a fresh cgroup is unlimited).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    /// CPU bandwidth in thousandths of a core (1000 = one core), enforced as a CFS quota over
    /// a 100 ms period (v1 `cpu.cfs_quota_us`, v2 `cpu.max`). Values below 10 are raised to 10
    /// (the kernel's 1 ms minimum quota).
    pub cpu_millis: Option<u64>,
    /// Memory limit in bytes. Swap is disabled where the kernel allows it
    /// (v1 `memory.memsw.limit_in_bytes` = the same value if present, v2 `memory.swap.max` = 0).
    pub memory_bytes: Option<u64>,
    /// Maximum number of tasks (processes and threads).
    pub pids_max: Option<u64>,
    /// Relative CPU weight under contention, in cgroup v2 units (1..=10000, default 100);
    /// v1 `cpu.shares` gets `weight * 1024 / 100` (at least 2).
    pub cpu_weight: Option<u64>,
}

/// Operations one cgroup version implements. [`Cgroup`] dispatches to the right one; use it
/// rather than the implementations directly.
pub trait CgroupManager: fmt::Debug + Send + Sync {
    /// Create the cgroup directories (and missing parents), preparing parents as the version needs.
    fn create_dirs(&self) -> Result<()>;
    /// Whether the cgroup exists.
    fn exists(&self) -> bool;
    /// Apply limits.
    fn apply(&self, limits: &Limits) -> Result<()>;
    /// Every `cgroup.procs` file a process must be written to in order to join.
    fn procs_paths(&self) -> Vec<PathBuf>;
    /// PIDs in this cgroup and its descendants, sorted and deduplicated.
    fn pids(&self) -> Result<Vec<i32>>;
    /// Whether a process is in the cgroup itself (descendants not looked at): one read
    /// per hierarchy, no directory listing.
    fn has_own_pids(&self) -> Result<bool>;
    /// Send SIGKILL to every process, once (no waiting). `pids` is what [`Self::pids`]
    /// just listed; a version with a kill-all file does not need it.
    fn signal_kill(&self, pids: &[i32]) -> Result<()>;
    /// Remove the cgroup directories (descendants first). Missing directories are fine.
    fn remove_dirs(&self) -> Result<()>;
    /// Current memory usage in bytes.
    fn memory_usage(&self) -> Result<u64>;
    /// The file whose `oom_kill` line counts OOM kills in this cgroup.
    fn oom_events_path(&self) -> Result<PathBuf>;
    /// Asks the kernel to reclaim as much of the cgroup's memory as it can (page cache;
    /// anonymous memory only where there is swap), without killing anything.
    fn reclaim(&self) -> Result<()>;
    /// Freeze (`true`) or thaw (`false`), waiting until the state is reached.
    fn set_frozen(&self, frozen: bool, timeout: Duration) -> Result<()>;
    /// Whether the cgroup is frozen (a freeze still under way is not).
    fn is_frozen(&self) -> Result<bool>;
    /// The directory of this cgroup for `controller` (v2: the one unified directory).
    fn path_for(&self, controller: &str) -> Option<PathBuf>;
    /// All directories of this cgroup, one per hierarchy.
    fn dirs(&self) -> Vec<PathBuf>;
}

#[derive(Debug)]
enum AnyManager {
    V1(v1::V1Manager),
    V2(v2::V2Manager),
}

impl AnyManager {
    fn inner(&self) -> &dyn CgroupManager {
        match self {
            AnyManager::V1(m) => m,
            AnyManager::V2(m) => m,
        }
    }
}

/// Handle for one sandbox cgroup (all its hierarchies). Dropping it does **not** remove the
/// cgroup; call [`Cgroup::destroy`].
#[derive(Debug)]
pub struct Cgroup {
    rel_path: String,
    version: CgroupVersion,
    manager: AnyManager,
    /// The OOM counter file, opened on first use: the counter is read around every exec,
    /// and a `pread` on an open file is one syscall instead of five.
    oom_events: std::sync::OnceLock<std::fs::File>,
}

impl Cgroup {
    fn handle(root: &CgroupRoot, rel_path: &str) -> Result<Self> {
        let rel = util::validate_rel_path(rel_path)?;
        let manager = match root.version {
            CgroupVersion::V1 => {
                let layout = match root.v1_layout.get() {
                    Some(layout) => layout,
                    None => {
                        let layout = v1::Layout::probe(root.mount_root())?;
                        root.v1_layout.get_or_init(|| layout)
                    }
                };
                AnyManager::V1(v1::V1Manager::with_layout(layout, &rel))
            }
            CgroupVersion::V2 => AnyManager::V2(v2::V2Manager::new(root.mount_root(), &rel)),
        };
        Ok(Self {
            rel_path: rel,
            version: root.version,
            manager,
            oom_events: std::sync::OnceLock::new(),
        })
    }

    /// Create the cgroup `rel_path` (e.g. `dsec/<sandbox-id>`; parents such as `dsec` are
    /// created if missing) and apply `limits`. If it already exists it is reused and the limits
    /// are applied again.
    pub fn create(root: &CgroupRoot, rel_path: &str, limits: &Limits) -> Result<Self> {
        let cg = Self::handle(root, rel_path)?;
        cg.manager.inner().create_dirs()?;
        cg.manager.inner().apply(limits)?;
        tracing::debug!(cgroup = %cg.rel_path, version = %cg.version, ?limits, "cgroup created");
        Ok(cg)
    }

    /// Open an existing cgroup (re-adoption after a daemon restart).
    /// Fails with [`CgroupError::NotFound`] if it does not exist.
    pub fn open(root: &CgroupRoot, rel_path: &str) -> Result<Self> {
        let cg = Self::handle(root, rel_path)?;
        if !cg.manager.inner().exists() {
            let p = cg
                .manager
                .inner()
                .dirs()
                .into_iter()
                .next()
                .unwrap_or_default();
            return Err(CgroupError::NotFound(p));
        }
        Ok(cg)
    }

    /// Relative path of this cgroup (`dsec/<id>`).
    pub fn rel_path(&self) -> &str {
        &self.rel_path
    }

    /// Version driven.
    pub fn version(&self) -> CgroupVersion {
        self.version
    }

    /// The directory of this cgroup in the hierarchy of `controller` (`memory`, `pids`, ...);
    /// on v2 the unified directory for every controller. `None` if that hierarchy is not used.
    pub fn path_for(&self, controller: &str) -> Option<PathBuf> {
        self.manager.inner().path_for(controller)
    }

    /// Every directory of this cgroup (one per hierarchy on v1, one on v2).
    pub fn dirs(&self) -> Vec<PathBuf> {
        self.manager.inner().dirs()
    }

    /// Change limits of an existing cgroup.
    pub fn set_limits(&self, limits: &Limits) -> Result<()> {
        self.manager.inner().apply(limits)
    }

    /// The `cgroup.procs` files to write a pid to (or `0` for "myself") to join this cgroup,
    /// one per hierarchy.
    pub fn procs_paths(&self) -> Vec<PathBuf> {
        self.manager.inner().procs_paths()
    }

    /// Move process `pid` into this cgroup (all hierarchies).
    pub fn add_pid(&self, pid: i32) -> Result<()> {
        let s = pid.to_string();
        for p in self.procs_paths() {
            util::write_file(&p, &s)?;
        }
        Ok(())
    }

    /// PIDs in this cgroup and its descendants (sorted, deduplicated).
    pub fn pids(&self) -> Result<Vec<i32>> {
        self.manager.inner().pids()
    }

    /// SIGKILL every process and wait (up to [`DEFAULT_TIMEOUT`]) until the cgroup is empty.
    pub fn kill_all(&self) -> Result<()> {
        self.kill_all_timeout(DEFAULT_TIMEOUT)
    }

    /// [`Cgroup::kill_all`] with an explicit bound.
    pub fn kill_all_timeout(&self, timeout: Duration) -> Result<()> {
        let m = self.manager.inner();
        if !m.exists() {
            return Ok(());
        }
        let deadline = std::time::Instant::now() + timeout;
        let mut sleep = Duration::from_millis(1);
        loop {
            // A full walk (descendants too) decides; while the killed processes exit only
            // the cgroup's own `cgroup.procs` is polled, which lists no directories.
            let pids = m.pids()?;
            if pids.is_empty() {
                return Ok(());
            }
            m.signal_kill(&pids)?;
            // A frozen task (v1 freezer) dies only once thawed; killed first, it never
            // runs user code again.
            let _ = m.set_frozen(false, Duration::from_millis(200));
            loop {
                if std::time::Instant::now() >= deadline {
                    let path = m.dirs().into_iter().next().unwrap_or_default();
                    return Err(CgroupError::Timeout {
                        path,
                        what: format!("{} process(es) to exit: {pids:?}", pids.len()),
                        timeout,
                    });
                }
                std::thread::sleep(sleep);
                sleep = (sleep * 2).min(Duration::from_millis(20));
                if !m.has_own_pids()? {
                    break;
                }
            }
        }
    }

    /// Kill every process, then remove the cgroup in every hierarchy (descendants first).
    /// Idempotent: a cgroup that is already gone is fine. Parents (`dsec`) are kept.
    pub fn destroy(&self) -> Result<()> {
        self.kill_all()?;
        self.manager.inner().remove_dirs()?;
        tracing::debug!(cgroup = %self.rel_path, "cgroup destroyed");
        Ok(())
    }

    /// Reclaims what memory the kernel can take back from the cgroup (meant for a frozen
    /// one): v2 `memory.reclaim`; v1 squeezes `memory.limit_in_bytes` down in steps until
    /// the kernel refuses, then restores it. Nothing is killed either way.
    pub fn reclaim(&self) -> Result<()> {
        self.manager.inner().reclaim()
    }

    /// Current memory usage in bytes (v1 `memory.usage_in_bytes`, v2 `memory.current`).
    pub fn memory_usage(&self) -> Result<u64> {
        self.manager.inner().memory_usage()
    }

    /// How many processes the OOM killer killed in this cgroup
    /// (v1 `oom_kill` of `memory.oom_control`, v2 `oom_kill` of `memory.events`).
    pub fn oom_kill_count(&self) -> Result<u64> {
        use std::os::unix::fs::FileExt;
        let path = self.manager.inner().oom_events_path()?;
        let file = match self.oom_events.get() {
            Some(f) => f,
            None => {
                let f = std::fs::File::open(&path).map_err(|e| util::io_err("open", &path, e))?;
                self.oom_events.get_or_init(|| f)
            }
        };
        let mut buf = [0u8; 512];
        let n = file
            .read_at(&mut buf, 0)
            .map_err(|e| util::io_err("read", &path, e))?;
        let text = String::from_utf8_lossy(&buf[..n]);
        util::parse_flat_keyed(&text, "oom_kill").ok_or_else(|| CgroupError::Parse {
            path,
            content: util::truncate(&text),
        })
    }

    /// Freeze every process; returns once the cgroup is frozen (bounded by [`DEFAULT_TIMEOUT`]).
    pub fn freeze(&self) -> Result<()> {
        self.manager.inner().set_frozen(true, DEFAULT_TIMEOUT)
    }

    /// Thaw a frozen cgroup; returns once it is thawed.
    pub fn thaw(&self) -> Result<()> {
        self.manager.inner().set_frozen(false, DEFAULT_TIMEOUT)
    }

    /// Whether every process is frozen (v1 `freezer.state` FROZEN, v2 `frozen 1` in
    /// `cgroup.events`).
    pub fn is_frozen(&self) -> Result<bool> {
        self.manager.inner().is_frozen()
    }

    /// Removes the parent cgroup `parent` (e.g. `dsec`) in every hierarchy where it is
    /// empty (no child cgroup, no process); returns the directories that stay (some
    /// sandbox still uses them). Only `parent` itself goes, not its own parents.
    pub fn remove_parent(root: &CgroupRoot, parent: &str) -> Result<Vec<PathBuf>> {
        let parent = util::validate_rel_path(parent)?;
        let dirs: Vec<PathBuf> = match root.version {
            CgroupVersion::V1 => v1::hierarchy_dirs(root.mount_root())
                .into_iter()
                .map(|(_, d)| d.join(&parent))
                .collect(),
            CgroupVersion::V2 => vec![root.mount_root().join(&parent)],
        };
        let mut kept = Vec::new();
        for dir in dirs {
            match std::fs::remove_dir(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY | libc::ENOTEMPTY)) => {
                    kept.push(dir)
                }
                Err(e) => return Err(util::io_err("rmdir", &dir, e)),
            }
        }
        kept.sort();
        kept.dedup();
        Ok(kept)
    }

    /// Relative paths (`<parent>/<name>`) of the child cgroups of `parent` (e.g. `dsec`),
    /// across all hierarchies, sorted. Used to find leftover sandbox cgroups after a crash.
    /// A missing parent yields an empty list.
    pub fn list_children(root: &CgroupRoot, parent: &str) -> Result<Vec<String>> {
        let parent = util::validate_rel_path(parent)?;
        let bases: Vec<PathBuf> = match root.version {
            CgroupVersion::V1 => v1::hierarchy_dirs(root.mount_root())
                .into_iter()
                .map(|(_, d)| d.join(&parent))
                .collect(),
            CgroupVersion::V2 => vec![root.mount_root().join(&parent)],
        };
        let mut out = std::collections::BTreeSet::new();
        for base in bases {
            for name in util::subdirs(&base)? {
                out.insert(format!("{parent}/{name}"));
            }
        }
        Ok(out.into_iter().collect())
    }
}

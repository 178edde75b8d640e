//! cgroup v1: one directory per controller hierarchy (`<root>/<controller>/<rel>`).
//!
//! Used hierarchies: `memory`, `cpu`, `pids` (required) and `cpuacct`, `freezer` (used when
//! mounted). Co-mounted hierarchies (`cpu -> cpu,cpuacct` symlinks) are detected by
//! canonical path and used once.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::util::{self, read_file, read_u64, write_file};

/// Lowest limit the v1 reclaim squeeze tries.
const RECLAIM_FLOOR: u64 = 1 << 20;
/// How long a freeze may stay FREEZING before FROZEN is written again.
const FREEZE_RETRY: Duration = Duration::from_millis(50);
use crate::{CgroupError, CgroupManager, Limits, Result};

/// Controllers whose hierarchy must be mounted.
pub const REQUIRED: [&str; 3] = ["memory", "cpu", "pids"];
/// Controllers used when mounted.
pub const OPTIONAL: [&str; 2] = ["cpuacct", "freezer"];

/// Mounted v1 hierarchies among [`REQUIRED`] and [`OPTIONAL`] under `mount_root`, deduplicated
/// by canonical path: `(controller, hierarchy root)`.
pub fn hierarchy_dirs(mount_root: &Path) -> Vec<(&'static str, PathBuf)> {
    let mut out: Vec<(&'static str, PathBuf)> = Vec::new();
    let mut seen: Vec<PathBuf> = Vec::new();
    for c in REQUIRED.iter().chain(OPTIONAL.iter()) {
        let dir = mount_root.join(c);
        if !dir.join("cgroup.procs").exists() {
            continue;
        }
        let canon = std::fs::canonicalize(&dir).unwrap_or_else(|_| dir.clone());
        if seen.contains(&canon) {
            continue;
        }
        seen.push(canon);
        out.push((c, dir));
    }
    out
}

/// One hierarchy of a v1 cgroup.
#[derive(Debug, Clone)]
struct Hier {
    /// Controllers available in this hierarchy (among the ones we use).
    controllers: Vec<&'static str>,
    /// The cgroup's directory in it.
    dir: PathBuf,
}

/// cgroup v1 implementation of [`CgroupManager`].
#[derive(Debug, Clone)]
pub struct V1Manager {
    hiers: Vec<Hier>,
}

/// The mounted hierarchies and which of our controllers each one holds. Fixed while the
/// host runs, so a [`crate::CgroupRoot`] probes it once (the probe canonicalises every
/// controller's directory: dozens of syscalls per cgroup handle otherwise).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout(Vec<(Vec<&'static str>, PathBuf)>);

impl Layout {
    /// Reads the layout under `mount_root`; fails if a [`REQUIRED`] hierarchy is missing.
    pub fn probe(mount_root: &Path) -> Result<Self> {
        for req in REQUIRED {
            let dir = mount_root.join(req);
            if !dir.join("cgroup.procs").exists() {
                return Err(CgroupError::MissingController {
                    controller: req,
                    path: dir,
                });
            }
        }
        let mut out = Vec::new();
        for (c, hroot) in hierarchy_dirs(mount_root) {
            // Which of our controllers live in this hierarchy: those whose dir canonicalises to it.
            let canon = std::fs::canonicalize(&hroot).unwrap_or_else(|_| hroot.clone());
            let controllers = REQUIRED
                .iter()
                .chain(OPTIONAL.iter())
                .copied()
                .filter(|o| {
                    let d = mount_root.join(o);
                    *o == c
                        || std::fs::canonicalize(&d)
                            .map(|x| x == canon)
                            .unwrap_or(false)
                })
                .collect();
            out.push((controllers, hroot));
        }
        Ok(Self(out))
    }
}

impl V1Manager {
    /// Handle for `<mount_root>/<controller>/<rel>`; fails if a [`REQUIRED`] hierarchy is missing.
    pub fn new(mount_root: &Path, rel: &str) -> Result<Self> {
        Ok(Self::with_layout(&Layout::probe(mount_root)?, rel))
    }

    /// Handle for `rel` in every hierarchy of `layout`.
    pub fn with_layout(layout: &Layout, rel: &str) -> Self {
        let hiers = layout
            .0
            .iter()
            .map(|(controllers, root)| Hier {
                controllers: controllers.clone(),
                dir: root.join(rel),
            })
            .collect();
        Self { hiers }
    }

    fn dir_of(&self, controller: &'static str) -> Result<&Path> {
        self.hiers
            .iter()
            .find(|h| h.controllers.contains(&controller))
            .map(|h| h.dir.as_path())
            .ok_or_else(|| CgroupError::MissingController {
                controller,
                path: PathBuf::from(controller),
            })
    }

    fn freezer_state_path(&self) -> Option<PathBuf> {
        self.dir_of("freezer").ok().map(|d| d.join("freezer.state"))
    }

    /// `freezer.state`, or why there is none.
    fn freezer_state(&self) -> Result<PathBuf> {
        self.freezer_state_path()
            .ok_or_else(|| CgroupError::MissingController {
                controller: "freezer",
                path: self
                    .hiers
                    .first()
                    .map(|h| h.dir.clone())
                    .unwrap_or_default(),
            })
    }
}

impl CgroupManager for V1Manager {
    fn create_dirs(&self) -> Result<()> {
        for h in &self.hiers {
            std::fs::create_dir_all(&h.dir).map_err(|e| util::io_err("mkdir", &h.dir, e))?;
        }
        Ok(())
    }

    fn exists(&self) -> bool {
        self.hiers.iter().any(|h| h.dir.is_dir())
    }

    fn apply(&self, limits: &Limits) -> Result<()> {
        if let Some(m) = limits.cpu_millis {
            let d = self.dir_of("cpu")?;
            write_file(
                &d.join("cpu.cfs_period_us"),
                &util::CPU_PERIOD_US.to_string(),
            )?;
            write_file(
                &d.join("cpu.cfs_quota_us"),
                &util::cpu_quota_us(m).to_string(),
            )?;
        }
        if let Some(bytes) = limits.memory_bytes {
            let d = self.dir_of("memory")?;
            let memsw = d.join("memory.memsw.limit_in_bytes");
            let has_memsw = memsw.exists();
            // memsw must stay >= limit at every step: open it up, set the limit, pin memsw to it.
            if has_memsw {
                write_file(&memsw, "-1")?;
            }
            write_file(&d.join("memory.limit_in_bytes"), &bytes.to_string())?;
            if has_memsw {
                write_file(&memsw, &bytes.to_string())?;
            }
        }
        if let Some(p) = limits.pids_max {
            let d = self.dir_of("pids")?;
            write_file(&d.join("pids.max"), &p.to_string())?;
        }
        if let Some(w) = limits.cpu_weight {
            let shares = (w.clamp(1, 10_000) * 1024 / 100).max(2);
            write_file(&self.dir_of("cpu")?.join("cpu.shares"), &shares.to_string())?;
        }
        Ok(())
    }

    fn procs_paths(&self) -> Vec<PathBuf> {
        self.hiers
            .iter()
            .map(|h| h.dir.join("cgroup.procs"))
            .collect()
    }

    fn pids(&self) -> Result<Vec<i32>> {
        let mut out = Vec::new();
        for h in &self.hiers {
            util::tree_pids(&h.dir, &mut out)?;
        }
        out.sort_unstable();
        out.dedup();
        Ok(out)
    }

    fn has_own_pids(&self) -> Result<bool> {
        for h in &self.hiers {
            if util::has_procs(&h.dir)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    fn signal_kill(&self, pids: &[i32]) -> Result<()> {
        util::kill_pids(pids);
        // Frozen tasks die only once thawed.
        if let Some(state) = self.freezer_state_path() {
            if let Ok(s) = std::fs::read_to_string(&state) {
                if s.trim() != "THAWED" {
                    write_file(&state, "THAWED")?;
                }
            }
        }
        Ok(())
    }

    fn remove_dirs(&self) -> Result<()> {
        for h in &self.hiers {
            util::remove_tree(&h.dir)?;
        }
        Ok(())
    }

    fn memory_usage(&self) -> Result<u64> {
        read_u64(&self.dir_of("memory")?.join("memory.usage_in_bytes"))
    }

    fn oom_events_path(&self) -> Result<PathBuf> {
        Ok(self.dir_of("memory")?.join("memory.oom_control"))
    }

    fn reclaim(&self) -> Result<()> {
        let dir = self.dir_of("memory")?;
        let limit_path = dir.join("memory.limit_in_bytes");
        let original = read_file(&limit_path)?.trim().to_string();
        // With swap on the host, let this cgroup swap for the squeeze: open memsw (kept
        // equal to the limit otherwise, i.e. no swap) and make it prefer swapping anon.
        let memsw = dir.join("memory.memsw.limit_in_bytes");
        let swappiness = dir.join("memory.swappiness");
        let swap = util::swap_free() > 0 && memsw.exists();
        let saved = if swap {
            let m = read_file(&memsw)?.trim().to_string();
            let s = read_file(&swappiness)?.trim().to_string();
            write_file(&memsw, "-1")?;
            write_file(&swappiness, "100")?;
            Some((m, s))
        } else {
            None
        };
        let mut target = read_u64(&dir.join("memory.usage_in_bytes"))?;
        // Each lower limit makes the kernel reclaim down to it; EBUSY means it cannot
        // (anonymous memory without swap) and leaves the limit as it was.
        while target > RECLAIM_FLOOR {
            target /= 2;
            if std::fs::write(&limit_path, target.max(RECLAIM_FLOOR).to_string()).is_err() {
                break;
            }
        }
        write_file(&limit_path, &original)?;
        if let Some((m, s)) = saved {
            // RAM + swap in use is at most the old limit, so memsw fits back under it.
            write_file(&memsw, &m)?;
            write_file(&swappiness, &s)?;
        }
        Ok(())
    }

    fn set_frozen(&self, frozen: bool, timeout: Duration) -> Result<()> {
        let state = self.freezer_state()?;
        let want = if frozen { "FROZEN" } else { "THAWED" };
        write_file(&state, want)?;
        let mut asked = Instant::now();
        util::wait_until(&state, want, timeout, || {
            // Reading freezer.state also advances FREEZING -> FROZEN in the kernel.
            if read_file(&state)?.trim() == want {
                return Ok(true);
            }
            // The kernel wakes each task once to freeze it; one that missed it (a child
            // being forked as the freeze began) keeps the cgroup FREEZING until FROZEN is
            // written again, the retry the v1 freezer documents.
            if frozen && asked.elapsed() >= FREEZE_RETRY {
                write_file(&state, want)?;
                asked = Instant::now();
            }
            Ok(false)
        })
    }

    fn is_frozen(&self) -> Result<bool> {
        let state = self.freezer_state()?;
        Ok(read_file(&state)?.trim() == "FROZEN")
    }

    fn path_for(&self, controller: &str) -> Option<PathBuf> {
        self.hiers
            .iter()
            .find(|h| h.controllers.contains(&controller))
            .map(|h| h.dir.clone())
    }

    fn dirs(&self) -> Vec<PathBuf> {
        self.hiers.iter().map(|h| h.dir.clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fake_tree_detects_hierarchies() {
        let t = std::env::temp_dir().join(format!("dsec-cg-v1-{}", std::process::id()));
        for c in ["memory", "cpu", "pids", "freezer"] {
            std::fs::create_dir_all(t.join(c)).ok();
            std::fs::write(t.join(c).join("cgroup.procs"), "").ok();
        }
        // cpuacct co-mounted with cpu.
        #[cfg(unix)]
        std::os::unix::fs::symlink("cpu", t.join("cpuacct")).ok();
        let hs = hierarchy_dirs(&t);
        let names: Vec<_> = hs.iter().map(|(c, _)| *c).collect();
        assert_eq!(names, vec!["memory", "cpu", "pids", "freezer"]);
        let m = V1Manager::new(&t, "dsec/x");
        assert!(m.is_ok(), "{m:?}");
        if let Ok(m) = m {
            assert_eq!(m.path_for("cpuacct"), Some(t.join("cpu/dsec/x")));
            assert_eq!(m.procs_paths().len(), 4);
        }
        std::fs::remove_dir_all(&t).ok();
    }

    #[test]
    fn missing_required() {
        let t = std::env::temp_dir().join(format!("dsec-cg-v1-miss-{}", std::process::id()));
        std::fs::create_dir_all(t.join("memory")).ok();
        std::fs::write(t.join("memory/cgroup.procs"), "").ok();
        let r = V1Manager::new(&t, "dsec/x");
        assert!(
            matches!(
                r,
                Err(CgroupError::MissingController {
                    controller: "cpu",
                    ..
                })
            ),
            "{r:?}"
        );
        std::fs::remove_dir_all(&t).ok();
    }
}

//! cgroup v2: one directory in the unified hierarchy (`<root>/<rel>`).
//!
//! Parents get `+cpu +memory +pids` in `cgroup.subtree_control` (those of them the parent
//! offers in `cgroup.controllers`), so the leaf has the controllers' interface files.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::util::{self, read_file, read_keyed, read_u64, write_file};
use crate::{CgroupManager, Limits, Result};

/// Controllers enabled for sandbox cgroups.
pub const CONTROLLERS: [&str; 3] = ["cpu", "memory", "pids"];

/// The `cgroup.subtree_control` line that enables those of `wanted` which `available`
/// (a `cgroup.controllers` content) offers and `enabled` (a `cgroup.subtree_control` content)
/// does not have yet; `None` if nothing is to do.
pub fn subtree_control_line(available: &str, enabled: &str, wanted: &[&str]) -> Option<String> {
    let avail: Vec<&str> = available.split_whitespace().collect();
    let on: Vec<&str> = enabled.split_whitespace().collect();
    let add: Vec<String> = wanted
        .iter()
        .filter(|c| avail.contains(c) && !on.contains(c))
        .map(|c| format!("+{c}"))
        .collect();
    if add.is_empty() {
        None
    } else {
        Some(add.join(" "))
    }
}

/// The `cpu.max` value for `cpu_millis` thousandths of a core.
pub fn cpu_max_value(cpu_millis: u64) -> String {
    format!("{} {}", util::cpu_quota_us(cpu_millis), util::CPU_PERIOD_US)
}

/// cgroup v2 implementation of [`CgroupManager`].
#[derive(Debug, Clone)]
pub struct V2Manager {
    mount_root: PathBuf,
    rel: String,
    dir: PathBuf,
}

impl V2Manager {
    /// Handle for `<mount_root>/<rel>` (`rel` already validated).
    pub fn new(mount_root: &Path, rel: &str) -> Self {
        Self {
            mount_root: mount_root.to_path_buf(),
            rel: rel.to_string(),
            dir: mount_root.join(rel),
        }
    }

    fn enable_controllers(dir: &Path) -> Result<()> {
        let available = read_file(&dir.join("cgroup.controllers"))?;
        let sc = dir.join("cgroup.subtree_control");
        let enabled = read_file(&sc)?;
        if let Some(line) = subtree_control_line(&available, &enabled, &CONTROLLERS) {
            write_file(&sc, &line)?;
        }
        Ok(())
    }
}

impl CgroupManager for V2Manager {
    fn create_dirs(&self) -> Result<()> {
        let mut cur = self.mount_root.clone();
        for comp in self.rel.split('/') {
            Self::enable_controllers(&cur)?;
            cur.push(comp);
            match std::fs::create_dir(&cur) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(util::io_err("mkdir", &cur, e)),
            }
        }
        Ok(())
    }

    fn exists(&self) -> bool {
        self.dir.is_dir()
    }

    fn apply(&self, limits: &Limits) -> Result<()> {
        if let Some(m) = limits.cpu_millis {
            write_file(&self.dir.join("cpu.max"), &cpu_max_value(m))?;
        }
        if let Some(bytes) = limits.memory_bytes {
            write_file(&self.dir.join("memory.max"), &bytes.to_string())?;
            let swap = self.dir.join("memory.swap.max");
            if swap.exists() {
                write_file(&swap, "0")?;
            }
        }
        if let Some(p) = limits.pids_max {
            write_file(&self.dir.join("pids.max"), &p.to_string())?;
        }
        if let Some(w) = limits.cpu_weight {
            write_file(
                &self.dir.join("cpu.weight"),
                &w.clamp(1, 10_000).to_string(),
            )?;
        }
        Ok(())
    }

    fn procs_paths(&self) -> Vec<PathBuf> {
        vec![self.dir.join("cgroup.procs")]
    }

    fn pids(&self) -> Result<Vec<i32>> {
        let mut out = Vec::new();
        util::tree_pids(&self.dir, &mut out)?;
        out.sort_unstable();
        out.dedup();
        Ok(out)
    }

    fn has_own_pids(&self) -> Result<bool> {
        util::has_procs(&self.dir)
    }

    fn signal_kill(&self, pids: &[i32]) -> Result<()> {
        let kill = self.dir.join("cgroup.kill");
        if kill.exists() {
            write_file(&kill, "1")
        } else {
            util::kill_pids(pids);
            Ok(())
        }
    }

    fn remove_dirs(&self) -> Result<()> {
        util::remove_tree(&self.dir)
    }

    fn memory_usage(&self) -> Result<u64> {
        read_u64(&self.dir.join("memory.current"))
    }

    fn oom_events_path(&self) -> Result<PathBuf> {
        Ok(self.dir.join("memory.events"))
    }

    fn reclaim(&self) -> Result<()> {
        // Sandboxes run with memory.swap.max = 0; open it for the reclaim so anonymous
        // memory can go to swap where the host has some, and close it again after
        // (pages already swapped stay there until touched).
        let swap_max = self.dir.join("memory.swap.max");
        let swap = util::swap_free() > 0 && swap_max.exists();
        if swap {
            write_file(&swap_max, "max")?;
        }
        let res = reclaim_now(&self.dir);
        if swap {
            write_file(&swap_max, "0")?;
        }
        res
    }
    fn set_frozen(&self, frozen: bool, timeout: Duration) -> Result<()> {
        write_file(
            &self.dir.join("cgroup.freeze"),
            if frozen { "1" } else { "0" },
        )?;
        let events = self.dir.join("cgroup.events");
        let want = u64::from(frozen);
        util::wait_until(
            &events,
            if frozen { "frozen 1" } else { "frozen 0" },
            timeout,
            || Ok(read_keyed(&events, "frozen")? == want),
        )
    }

    fn is_frozen(&self) -> Result<bool> {
        Ok(read_keyed(&self.dir.join("cgroup.events"), "frozen")? == 1)
    }

    fn path_for(&self, _controller: &str) -> Option<PathBuf> {
        Some(self.dir.clone())
    }

    fn dirs(&self) -> Vec<PathBuf> {
        vec![self.dir.clone()]
    }
}

/// `memory.reclaim` of as much as the cgroup uses.
fn reclaim_now(dir: &Path) -> Result<()> {
    let usage = read_u64(&dir.join("memory.current"))?;
    // EAGAIN: less than asked could be reclaimed, which is expected.
    match std::fs::write(dir.join("memory.reclaim"), usage.to_string()) {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => Ok(()),
        Err(e) => Err(util::io_err("write", &dir.join("memory.reclaim"), e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subtree_line() {
        assert_eq!(
            subtree_control_line(
                "cpuset cpu io memory hugetlb pids rdma misc",
                "",
                &CONTROLLERS
            )
            .as_deref(),
            Some("+cpu +memory +pids")
        );
        assert_eq!(
            subtree_control_line("cpu memory pids", "memory", &CONTROLLERS).as_deref(),
            Some("+cpu +pids")
        );
        assert_eq!(
            subtree_control_line("cpu memory pids", "cpu memory pids", &CONTROLLERS),
            None
        );
        assert_eq!(
            subtree_control_line("memory", "", &CONTROLLERS).as_deref(),
            Some("+memory")
        );
    }

    #[test]
    fn cpu_max() {
        assert_eq!(cpu_max_value(1000), "100000 100000");
        assert_eq!(cpu_max_value(500), "50000 100000");
        assert_eq!(cpu_max_value(2000), "200000 100000");
    }

    #[test]
    fn fake_tree_create_and_apply() {
        // A plain directory tree standing in for cgroupfs: checks paths and values written.
        let t = std::env::temp_dir().join(format!("dsec-cg-v2-{}", std::process::id()));
        std::fs::create_dir_all(&t).ok();
        std::fs::write(t.join("cgroup.controllers"), "cpu io memory pids").ok();
        std::fs::write(t.join("cgroup.subtree_control"), "").ok();
        // Pre-create the intermediate like the kernel would populate it.
        std::fs::create_dir_all(t.join("dsec")).ok();
        std::fs::write(t.join("dsec/cgroup.controllers"), "cpu memory pids").ok();
        std::fs::write(t.join("dsec/cgroup.subtree_control"), "cpu memory pids").ok();
        let m = V2Manager::new(&t, "dsec/sb1");
        assert!(m.create_dirs().is_ok());
        assert_eq!(
            std::fs::read_to_string(t.join("cgroup.subtree_control"))
                .ok()
                .as_deref(),
            Some("+cpu +memory +pids")
        );
        std::fs::write(t.join("dsec/sb1/memory.swap.max"), "max").ok();
        let lim = Limits {
            cpu_millis: Some(1500),
            memory_bytes: Some(1 << 20),
            pids_max: Some(7),
            cpu_weight: None,
        };
        assert!(m.apply(&lim).is_ok());
        let rd = |f: &str| std::fs::read_to_string(t.join("dsec/sb1").join(f)).unwrap_or_default();
        assert_eq!(rd("cpu.max"), "150000 100000");
        assert_eq!(rd("memory.max"), "1048576");
        assert_eq!(rd("memory.swap.max"), "0");
        assert_eq!(rd("pids.max"), "7");
        assert_eq!(m.procs_paths(), vec![t.join("dsec/sb1/cgroup.procs")]);
        std::fs::remove_dir_all(&t).ok();
    }
}

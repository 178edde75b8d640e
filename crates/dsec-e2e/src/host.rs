//! Scans of the host for what a sandbox may leave behind: mounts, cgroups, processes,
//! directories.

use std::path::Path;

/// Cgroup parents a node may use (`dsec`, and the `dsec*` ones tests pass with
/// `--cgroup-parent`) under a hierarchy root.
fn parents(root: &Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(root)
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("dsec"))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

/// Cgroup directories named after the sandbox, in any hierarchy (v1 and v2), under any
/// `dsec*` parent.
pub fn cgroup_dirs(id: &str) -> Vec<String> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir("/sys/fs/cgroup") else {
        return out;
    };
    let roots = entries
        .flatten()
        .map(|e| e.path())
        .chain([Path::new("/sys/fs/cgroup").to_path_buf()]);
    for root in roots {
        for parent in parents(&root) {
            let candidate = parent.join(id);
            if candidate.exists() {
                out.push(candidate.display().to_string());
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// Mount points (in this mount namespace) whose path or source mention the sandbox.
pub fn mounts(id: &str) -> Vec<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(id))
        .map(str::to_string)
        .collect()
}

/// Host pids whose cgroup membership mentions the sandbox.
pub fn processes(id: &str) -> Vec<i32> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in entries.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if let Ok(cg) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) {
            // `/dsec/ID` or `/dsec-something/ID`, the id as a whole path component.
            let hit = cg.lines().any(|l| {
                l.rsplit(':').next().is_some_and(|path| {
                    let mut parts = path.rsplit('/');
                    parts.next() == Some(id) && parts.next().is_some_and(|p| p.starts_with("dsec"))
                })
            });
            if hit {
                out.push(pid);
            }
        }
    }
    out
}

/// SIGKILLs every process in the sandbox's cgroups and removes them (test cleanup).
pub fn kill_sandbox_cgroup(id: &str) {
    for pid in processes(id) {
        // SAFETY: kill with a pid we read from /proc.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    for _ in 0..50 {
        if processes(id).is_empty() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    for d in cgroup_dirs(id) {
        let _ = std::fs::remove_dir(d);
    }
}

/// Loop devices whose backing file mentions the sandbox (its disk image).
pub fn loop_devices(id: &str) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let backing = std::fs::read_to_string(e.path().join("loop/backing_file")).ok()?;
            backing
                .contains(id)
                .then(|| format!("{}: {}", e.file_name().to_string_lossy(), backing.trim()))
        })
        .collect()
}

/// Processes of sandbox `id` (seen from the host) whose command line mentions `needle`.
pub fn processes_running(id: &str, needle: &str) -> Vec<i32> {
    processes(id)
        .into_iter()
        .filter(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            String::from_utf8_lossy(&cmd).contains(needle)
        })
        .collect()
}

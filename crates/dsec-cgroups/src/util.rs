//! Small helpers shared by the v1 and v2 implementations: file I/O with path-carrying
//! errors, parsing, quota arithmetic.

use std::io;
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant};

use crate::{CgroupError, Result};

/// CFS period used for CPU limits: 100 ms.
pub const CPU_PERIOD_US: u64 = 100_000;

/// CFS quota in microseconds per [`CPU_PERIOD_US`] for `cpu_millis` thousandths of a core.
/// Clamped to the kernel minimum of 1000 µs (1 ms).
pub fn cpu_quota_us(cpu_millis: u64) -> u64 {
    cpu_millis.saturating_mul(CPU_PERIOD_US / 1000).max(1000)
}

/// Value of `key` in a flat-keyed cgroup file (`key value` per line), such as v1
/// `memory.oom_control`, v2 `memory.events`, `cgroup.events`, `pids.events`.
pub fn parse_flat_keyed(content: &str, key: &str) -> Option<u64> {
    content.lines().find_map(|line| {
        let mut it = line.split_whitespace();
        if it.next() == Some(key) {
            it.next().and_then(|v| v.parse().ok())
        } else {
            None
        }
    })
}

pub(crate) fn io_err(op: &'static str, path: &Path, source: io::Error) -> CgroupError {
    CgroupError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

pub(crate) fn read_file(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| io_err("read", path, e))
}

pub(crate) fn write_file(path: &Path, value: &str) -> Result<()> {
    std::fs::write(path, value).map_err(|e| io_err("write", path, e))
}

pub(crate) fn read_u64(path: &Path) -> Result<u64> {
    let s = read_file(path)?;
    s.trim().parse().map_err(|_| CgroupError::Parse {
        path: path.to_path_buf(),
        content: truncate(&s),
    })
}

pub(crate) fn read_keyed(path: &Path, key: &str) -> Result<u64> {
    let s = read_file(path)?;
    parse_flat_keyed(&s, key).ok_or_else(|| CgroupError::Parse {
        path: path.to_path_buf(),
        content: truncate(&s),
    })
}

pub(crate) fn truncate(s: &str) -> String {
    s.chars().take(200).collect()
}

/// Check a relative cgroup path: non-empty, relative, plain components only.
/// Returns it normalised (no leading/trailing/double slashes).
pub(crate) fn validate_rel_path(rel: &str) -> Result<String> {
    let bad = |reason| CgroupError::InvalidPath {
        path: rel.to_string(),
        reason,
    };
    if rel.is_empty() {
        return Err(bad("empty"));
    }
    if rel.starts_with('/') {
        return Err(bad("must be relative"));
    }
    let mut parts = Vec::new();
    for c in Path::new(rel).components() {
        match c {
            Component::Normal(s) => {
                let s = s.to_str().ok_or_else(|| bad("not UTF-8"))?;
                if s.contains(['\n', '\0']) {
                    return Err(bad("control character"));
                }
                parts.push(s);
            }
            Component::CurDir => {}
            _ => return Err(bad("only plain components allowed (no `..`)")),
        }
    }
    if parts.is_empty() {
        return Err(bad("empty"));
    }
    Ok(parts.join("/"))
}

/// Parse a `cgroup.procs` file.
pub(crate) fn parse_pids(path: &Path, content: &str) -> Result<Vec<i32>> {
    content
        .split_whitespace()
        .map(|t| {
            t.parse().map_err(|_| CgroupError::Parse {
                path: path.to_path_buf(),
                content: truncate(content),
            })
        })
        .collect()
}

/// Names of the subdirectories of `dir` (child cgroups). Missing `dir` yields nothing.
///
/// A directory's link count is 2 plus its subdirectories on cgroupfs (kernfs) as on most
/// file systems (those that do not count report 1): a count of 2 means no child cgroups
/// without listing the directory, whose dozens of control files make a listing the
/// costliest step of a teardown.
pub(crate) fn subdirs(dir: &Path) -> Result<Vec<String>> {
    use std::os::unix::fs::MetadataExt;
    match std::fs::symlink_metadata(dir) {
        Ok(m) if m.is_dir() && m.nlink() == 2 => return Ok(Vec::new()),
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err("stat", dir, e)),
    }
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err("read_dir", dir, e)),
    };
    let mut out = Vec::new();
    for ent in rd {
        let ent = ent.map_err(|e| io_err("read_dir", dir, e))?;
        let ft = ent
            .file_type()
            .map_err(|e| io_err("stat", &ent.path(), e))?;
        if ft.is_dir() {
            if let Some(n) = ent.file_name().to_str() {
                out.push(n.to_string());
            }
        }
    }
    out.sort();
    Ok(out)
}

/// `dir` and all directories below it, deepest first.
pub(crate) fn tree_post_order(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    fn walk(d: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
        for name in subdirs(d)? {
            walk(&d.join(name), out)?;
        }
        out.push(d.to_path_buf());
        Ok(())
    }
    if dir.is_dir() {
        walk(dir, &mut out)?;
    }
    Ok(out)
}

/// Whether `dir`'s own `cgroup.procs` lists a process (a missing cgroup has none).
pub(crate) fn has_procs(dir: &Path) -> Result<bool> {
    let procs = dir.join("cgroup.procs");
    match std::fs::read(&procs) {
        Ok(s) => Ok(s.iter().any(u8::is_ascii_digit)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io_err("read", &procs, e)),
    }
}

/// PIDs of `dir`'s `cgroup.procs` and those of every descendant.
pub(crate) fn tree_pids(dir: &Path, out: &mut Vec<i32>) -> Result<()> {
    for d in tree_post_order(dir)? {
        let procs = d.join("cgroup.procs");
        match std::fs::read_to_string(&procs) {
            Ok(s) => out.extend(parse_pids(&procs, &s)?),
            // Removed concurrently.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err("read", &procs, e)),
        }
    }
    Ok(())
}

/// Remove `dir` and its descendant cgroups, deepest first, retrying EBUSY briefly
/// (a cgroup can stay busy for a moment after its last task exited).
pub(crate) fn remove_tree(dir: &Path) -> Result<()> {
    for d in tree_post_order(dir)? {
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            match std::fs::remove_dir(&d) {
                Ok(()) => break,
                Err(e) if e.kind() == io::ErrorKind::NotFound => break,
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(io_err("rmdir", &d, e)),
            }
        }
    }
    Ok(())
}

/// SIGKILL each pid; already-gone processes are fine.
pub(crate) fn kill_pids(pids: &[i32]) {
    for &pid in pids {
        if pid > 0 {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// Poll `check` until it returns true or `timeout` passes.
pub(crate) fn wait_until(
    path: &Path,
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> Result<bool>,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let mut sleep = Duration::from_micros(500);
    loop {
        if check()? {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(CgroupError::Timeout {
                path: path.to_path_buf(),
                what: what.to_string(),
                timeout,
            });
        }
        std::thread::sleep(sleep);
        sleep = (sleep * 2).min(Duration::from_millis(20));
    }
}

/// Free swap on the host in bytes (`SwapFree` of /proc/meminfo; 0 without swap).
pub(crate) fn swap_free() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("SwapFree:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quota() {
        assert_eq!(cpu_quota_us(1000), 100_000);
        assert_eq!(cpu_quota_us(500), 50_000);
        assert_eq!(cpu_quota_us(2500), 250_000);
        assert_eq!(cpu_quota_us(1), 1000);
        assert_eq!(cpu_quota_us(0), 1000);
        assert_eq!(cpu_quota_us(u64::MAX), u64::MAX);
    }

    #[test]
    fn flat_keyed_v1_oom_control() {
        let s = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n";
        assert_eq!(parse_flat_keyed(s, "oom_kill"), Some(3));
        assert_eq!(parse_flat_keyed(s, "under_oom"), Some(0));
        assert_eq!(parse_flat_keyed(s, "oom"), None);
    }

    #[test]
    fn flat_keyed_v2_memory_events() {
        let s = "low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\noom_group_kill 0\n";
        assert_eq!(parse_flat_keyed(s, "oom_kill"), Some(1));
        assert_eq!(parse_flat_keyed(s, "oom"), Some(2));
        assert_eq!(parse_flat_keyed(s, "max"), Some(12));
        assert_eq!(
            parse_flat_keyed("populated 1\nfrozen 0\n", "frozen"),
            Some(0)
        );
        assert_eq!(parse_flat_keyed("", "frozen"), None);
    }

    #[test]
    fn rel_paths() {
        assert_eq!(
            validate_rel_path("dsec/abc").ok().as_deref(),
            Some("dsec/abc")
        );
        assert_eq!(
            validate_rel_path("dsec//abc/").ok().as_deref(),
            Some("dsec/abc")
        );
        assert_eq!(validate_rel_path("./dsec").ok().as_deref(), Some("dsec"));
        for bad in ["", "/dsec", "dsec/../x", "..", ".", "a/\nb"] {
            assert!(validate_rel_path(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn pids_parse() {
        let p = Path::new("/x/cgroup.procs");
        assert_eq!(parse_pids(p, "1\n22\n333\n").ok(), Some(vec![1, 22, 333]));
        assert_eq!(parse_pids(p, "").ok(), Some(vec![]));
        assert!(parse_pids(p, "1\nx\n").is_err());
    }
}

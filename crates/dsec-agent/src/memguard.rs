//! The guest's memory-pressure guard: a microVM's sandbox fills its memory, and the guard
//! kills the command holding the most, before the guest thrashes.
//!
//! A guest has no swap, and its programs' code is page cache read back from the layer
//! disks. Filled with anonymous memory, the kernel evicts that code over and over before
//! its OOM killer gives up on reclaim; under TCG each refault is an emulated disk read,
//! and the guest crawls for minutes. A container's cgroup has the same trait, but there
//! the host's kernel pages at full speed. The guard watches the kernel's pressure stall
//! information (a PSI trigger on `/proc/pressure/memory`): when every runnable task of
//! the guest stalls on memory for [`STALL_US`] of a [`WINDOW_US`] window while little is
//! left ([`low_on_memory`]), it SIGKILLs the process with the highest `oom_score` of
//! those holding at least an eighth of the guest's memory ([`MIN_SHARE`]), as the OOM
//! killer would, only sooner; with none that large it leaves the guest to its kernel.
//! The agent (PID 1) is never a candidate.
//!
//! Below the guard, the kernel's own thrashing prevention ([`protect_working_set`]): with
//! the multi-generational LRU on, kswapd calls the OOM killer when it cannot keep the
//! last [`MIN_TTL_MS`] of the working set, rather than evicting it. The two are
//! independent; whichever sees the full guest first ends its largest process.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::time::Duration;

/// Full stall (every task waiting on memory) in a window that wakes the guard, in µs.
const STALL_US: u64 = 150_000;
/// The window of [`STALL_US`], in µs (the kernel takes 0.5 s to 10 s).
const WINDOW_US: u64 = 1_000_000;
/// After a kill, the time the victim's memory takes to come back before the next look.
const SETTLE: Duration = Duration::from_millis(500);

/// The working set (pages used within this many ms) the kernel keeps rather than evict;
/// the kernel's documentation finds 1000 ms removes the lags of thrashing.
pub const MIN_TTL_MS: u64 = 1000;

/// Turns on the multi-generational LRU with a minimum time to live of [`MIN_TTL_MS`], so
/// that a guest filled with anonymous memory meets the OOM killer instead of evicting
/// its programs' code forever. Needs the guest's `/sys`; returns what was missing on a
/// kernel without it (built without `CONFIG_LRU_GEN`).
pub fn protect_working_set() -> std::io::Result<()> {
    let dir = std::path::Path::new("/sys/kernel/mm/lru_gen");
    std::fs::write(dir.join("enabled"), "y")?;
    std::fs::write(dir.join("min_ttl_ms"), MIN_TTL_MS.to_string())
}

/// A registered PSI trigger: readiness (`POLLPRI`) means the stall threshold was crossed.
pub struct Guard {
    psi: std::fs::File,
}

impl Guard {
    /// Registers the trigger; needs `CAP_SYS_RESOURCE` on kernels before 6.2, so call it
    /// before the thread drops its capabilities.
    pub fn arm() -> std::io::Result<Guard> {
        let mut psi = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/proc/pressure/memory")?;
        psi.write_all(format!("full {STALL_US} {WINDOW_US}\0").as_bytes())?;
        Ok(Guard { psi })
    }

    /// Waits for pressure and acts on it, for the guest's life.
    pub fn run(self) {
        let fd = self.psi.as_raw_fd();
        loop {
            let mut pfd = libc::pollfd {
                fd,
                events: libc::POLLPRI,
                revents: 0,
            };
            // SAFETY: one valid pollfd, for the call's duration.
            let n = unsafe { libc::poll(&mut pfd, 1, -1) };
            if n < 0 {
                if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                eprintln!(
                    "dsec-agent: memory guard: poll: {}",
                    std::io::Error::last_os_error()
                );
                return;
            }
            if pfd.revents & libc::POLLERR != 0 {
                eprintln!("dsec-agent: memory guard: the pressure monitor is gone");
                return;
            }
            if pfd.revents & libc::POLLPRI == 0 {
                continue;
            }
            let Some(total_kib) = low_on_memory() else {
                continue;
            };
            // Only a process holding a real share of the memory is the cause: after the
            // kernel's own OOM kill, the stall that woke the guard is over, and the
            // highest score left may be a shell.
            if let Some((pid, score)) = worst_process(total_kib / MIN_SHARE) {
                // SAFETY: a plain kill(2).
                if unsafe { libc::kill(pid, libc::SIGKILL) } == 0 {
                    // The node counts these lines as the sandbox's OOM kills.
                    eprintln!(
                        "{}{pid} (oom_score {score}): the guest stalled with its memory full",
                        dsec_wire::vm::MEMORY_GUARD_KILLED
                    );
                }
            }
            std::thread::sleep(SETTLE);
        }
    }
}

/// A victim holds at least this fraction (1/N) of the guest's memory, resident.
const MIN_SHARE: u64 = 8;

/// The guest's memory in KiB if less than a sixteenth of it (and under 32 MiB) is
/// available: a stall with plenty left is reclaim or I/O, not a full guest.
fn low_on_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let total = kib_field(&info, "MemTotal:")?;
    let available = kib_field(&info, "MemAvailable:")?;
    (available < (total / 16).max(32 * 1024)).then_some(total)
}

/// A `Name:   123 kB` field of a /proc file, in KiB.
fn kib_field(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// `PF_KTHREAD` in `/proc/<pid>/stat`'s flags.
const PF_KTHREAD: u64 = 0x0020_0000;

/// The user process with the highest `oom_score` among those with at least `min_rss_kib`
/// resident (not PID 1, not a kernel thread, not one made unkillable), with its score.
fn worst_process(min_rss_kib: u64) -> Option<(libc::pid_t, u64)> {
    let mut worst: Option<(libc::pid_t, u64)> = None;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        if pid == 1 || is_kernel_thread(pid) {
            continue;
        }
        let read = |file: &str| std::fs::read_to_string(format!("/proc/{pid}/{file}"));
        if read("oom_score_adj").is_ok_and(|a| a.trim() == "-1000") {
            continue;
        }
        let rss = read("status")
            .ok()
            .and_then(|s| kib_field(&s, "VmRSS:"))
            .unwrap_or(0);
        if rss < min_rss_kib {
            continue;
        }
        let Some(score) = read("oom_score")
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
        else {
            continue;
        };
        if worst.is_none_or(|(_, s)| score > s) {
            worst = Some((pid, score));
        }
    }
    worst
}

/// Whether `pid` is a kernel thread (a process gone meanwhile counts as one: skipped).
fn is_kernel_thread(pid: libc::pid_t) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return true;
    };
    // The fields after the command name, which may hold spaces and parentheses.
    let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
        return true;
    };
    // state ppid pgrp session tty_nr tpgid flags: flags is the seventh.
    rest.split_whitespace()
        .nth(6)
        .and_then(|f| f.parse::<u64>().ok())
        .is_none_or(|flags| flags & PF_KTHREAD != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_threads_are_told_from_processes() {
        assert!(!is_kernel_thread(std::process::id() as libc::pid_t));
        // kthreadd is PID 2 where the test runs in the host's PID namespace.
        if std::fs::read_to_string("/proc/2/comm").is_ok_and(|c| c.trim() == "kthreadd") {
            assert!(is_kernel_thread(2));
        }
    }

    #[test]
    fn the_worst_process_is_never_pid_1() {
        let (pid, _) = worst_process(0).expect("some process");
        assert_ne!(pid, 1);
    }

    #[test]
    fn a_process_holding_little_is_no_victim() {
        // Nothing here holds a terabyte.
        assert_eq!(worst_process(1 << 30), None);
        assert_eq!(kib_field("MemTotal:  2048 kB\n", "MemTotal:"), Some(2048));
    }
}

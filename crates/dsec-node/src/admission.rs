//! Admission: whether the node takes one more sandbox. CPU is admitted by what sandboxes
//! request times an overcommit ratio (most sandboxes idle most of the time); memory by
//! what the host actually has available, minus a reserve for the node itself. A refusal
//! is a retryable `capacity` error naming the resource.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::NodeError;

/// How long a `MemAvailable` reading is reused. Reading /proc/meminfo walks every block
/// device (each sandbox disk is a loop device), which cost ~1.4% of the node's CPU under
/// create churn when done per create; memory does not move far in this time.
const MEMORY_READING_TTL: Duration = Duration::from_millis(50);

/// How much the node admits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdmissionConfig {
    /// Requested CPU may add up to this many times the host's CPUs.
    pub cpu_overcommit: f64,
    /// Host memory kept free for the node: no sandbox is admitted below it.
    pub memory_reserve_bytes: u64,
    /// At most this many sandboxes (0: no count limit).
    pub max_sandboxes: usize,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            // Sandboxes idle most of the time (the report: 90% use at most 5% of what they
            // ask for), so CPU only bounds a node's count loosely; memory is what fills it.
            cpu_overcommit: 1000.0,
            memory_reserve_bytes: 512 << 20,
            max_sandboxes: 0,
        }
    }
}

/// Current capacity and load, for placement.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Capacity {
    /// Requested CPU the node admits in total, in millicores.
    pub cpu_millis_allocatable: u64,
    /// Requested CPU of live and starting sandboxes.
    pub cpu_millis_requested: u64,
    /// Host memory available now (`MemAvailable`).
    pub memory_available_bytes: u64,
    /// Memory kept free for the node.
    pub memory_reserve_bytes: u64,
    /// Live and starting sandboxes.
    pub sandboxes: usize,
    /// Count limit (0: none).
    pub max_sandboxes: usize,
    /// Whether sandboxes get core-scheduling cookies (see [`core_scheduling_available`]).
    pub core_scheduling: bool,
}

/// Whether the kernel does core scheduling (`CONFIG_SCHED_CORE`): then each sandbox gets
/// its own cookie and never shares a core's SMT siblings with another sandbox. Probed
/// once by asking for this process's cookie.
pub fn core_scheduling_available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        let mut cookie: u64 = 0;
        // SAFETY: PR_SCHED_CORE_GET writes one u64 to the pointer we pass.
        let r = unsafe {
            libc::prctl(
                62,                 // PR_SCHED_CORE
                0 as libc::c_ulong, // PR_SCHED_CORE_GET
                0 as libc::c_ulong, // this process
                0 as libc::c_ulong, // PIDTYPE_PID
                &mut cookie as *mut u64,
            )
        };
        r == 0
    })
}

/// Tracks what starting sandboxes hold between the check and their runtime record.
#[derive(Debug, Default)]
pub struct Admission {
    cfg: AdmissionConfig,
    pending: Mutex<(u64, usize)>,
    /// The last `MemAvailable` reading and when it was taken.
    memory: Mutex<Option<(Instant, u64)>>,
}

/// A place held for a starting sandbox; dropped when it is running or failed.
#[derive(Debug)]
pub struct Ticket<'a> {
    admission: &'a Admission,
    cpu_millis: u64,
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        let mut p = self.admission.lock();
        p.0 = p.0.saturating_sub(self.cpu_millis);
        p.1 = p.1.saturating_sub(1);
    }
}

fn host_cpus() -> u64 {
    std::thread::available_parallelism()
        .map(|p| p.get() as u64)
        .unwrap_or(1)
}

/// `MemAvailable` from /proc/meminfo, in bytes.
pub fn memory_available() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

impl Admission {
    /// An admission policy.
    pub fn new(cfg: AdmissionConfig) -> Self {
        Self {
            cfg,
            pending: Mutex::new((0, 0)),
            memory: Mutex::new(None),
        }
    }

    /// `MemAvailable`, read at most every [`MEMORY_READING_TTL`].
    fn memory_available(&self) -> u64 {
        let mut m = self.memory.lock().unwrap_or_else(|p| p.into_inner());
        match *m {
            Some((at, bytes)) if at.elapsed() < MEMORY_READING_TTL => bytes,
            _ => {
                let bytes = memory_available();
                *m = Some((Instant::now(), bytes));
                bytes
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (u64, usize)> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Capacity given the live sandboxes' requested CPU and count.
    pub fn capacity(&self, live_cpu_millis: u64, live: usize) -> Capacity {
        let p = *self.lock();
        Capacity {
            cpu_millis_allocatable: (host_cpus() as f64 * 1000.0 * self.cfg.cpu_overcommit) as u64,
            cpu_millis_requested: live_cpu_millis + p.0,
            memory_available_bytes: self.memory_available(),
            memory_reserve_bytes: self.cfg.memory_reserve_bytes,
            sandboxes: live + p.1,
            max_sandboxes: self.cfg.max_sandboxes,
            core_scheduling: core_scheduling_available(),
        }
    }

    /// Admits a sandbox requesting `cpu_millis`, or says which resource is exhausted.
    pub fn admit(
        &self,
        cpu_millis: u64,
        live_cpu_millis: u64,
        live: usize,
    ) -> Result<Ticket<'_>, NodeError> {
        let mut p = self.lock();
        let allocatable = (host_cpus() as f64 * 1000.0 * self.cfg.cpu_overcommit) as u64;
        let requested = live_cpu_millis + p.0;
        if requested + cpu_millis > allocatable {
            return Err(NodeError::Capacity(format!(
                "CPU: {requested} of {allocatable} millicores requested (overcommit {}x), {cpu_millis} more do not fit",
                self.cfg.cpu_overcommit
            )));
        }
        let available = self.memory_available();
        if available < self.cfg.memory_reserve_bytes {
            return Err(NodeError::Capacity(format!(
                "memory: {} MiB available, {} MiB are kept for the node",
                available >> 20,
                self.cfg.memory_reserve_bytes >> 20
            )));
        }
        if self.cfg.max_sandboxes > 0 && live + p.1 >= self.cfg.max_sandboxes {
            return Err(NodeError::Capacity(format!(
                "sandboxes: the node runs at most {}",
                self.cfg.max_sandboxes
            )));
        }
        p.0 += cpu_millis;
        p.1 += 1;
        Ok(Ticket {
            admission: self,
            cpu_millis,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_up_to_the_overcommitted_cpu_and_the_count_then_refuses() {
        let a = Admission::new(AdmissionConfig {
            cpu_overcommit: 1.0,
            memory_reserve_bytes: 0,
            max_sandboxes: 3,
        });
        let cpus = host_cpus() * 1000;
        let t1 = a.admit(cpus, 0, 0).expect("all CPUs");
        assert!(matches!(a.admit(1, 0, 0), Err(NodeError::Capacity(m)) if m.starts_with("CPU")));
        drop(t1);
        let _t = a.admit(1, 0, 0).expect("released on drop");
        assert!(
            matches!(a.admit(1, 0, 2), Err(NodeError::Capacity(m)) if m.starts_with("sandboxes"))
        );
        let none = Admission::new(AdmissionConfig {
            memory_reserve_bytes: u64::MAX,
            ..Default::default()
        });
        assert!(
            matches!(none.admit(1, 0, 0), Err(NodeError::Capacity(m)) if m.starts_with("memory"))
        );
    }
}

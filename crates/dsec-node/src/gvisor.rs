//! Isolation level `gvisor`: the sandbox runs under gVisor's `runsc`, whose kernel in
//! user space (the Sentry) serves the sandbox's system calls, so code inside never
//! reaches the host kernel's system call table directly. The node prepares the root as
//! for level `oci` (its layers and disk under overlayfs, mounted on the host) and writes a
//! bundle whose process is `dsec-agent serve`.
//!
//! `runsc` passes no descriptors to the container (`runc --preserve-fds` has no
//! counterpart), so the agent binds its socket itself, in a host directory of the
//! sandbox's run directory mounted inside; `--host-uds=create` lets gVisor's gofer make
//! that socket a host one the node connects to. Code inside, root there, could remove it
//! and bind its own: it would then answer for its own sandbox only, which it can do
//! anyway (it can kill the agent). The node waits for the socket to appear before its
//! first ping.
//!
//! The platform (how system calls are intercepted) is chosen at the node's start:
//! `systrap` where this runsc has it, else `ptrace`; `kvm` only when asked for (it needs
//! a `/dev/kvm` that runs stock guests).
//!
//! gVisor's own file overlay is off (`--overlay2=none`): writes land in the sandbox's
//! host disk, under its size limit, and commits and file transfers see them.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// How long a sandbox's agent may take to bind its socket after `runsc run` returned.
const SOCKET_WAIT: Duration = Duration::from_secs(30);

/// Host tasks (threads and stub processes) a gVisor sandbox may hold per task inside:
/// on the ptrace platform one process inside costs about ten on the host (measured: 64
/// processes inside, 673 host tasks).
const HOST_TASKS_PER_TASK: u64 = 12;
/// Host tasks of the Sentry and gofer themselves (about 33 at rest).
const HOST_TASKS_BASE: u64 = 256;

/// The host pids limit of a gVisor sandbox whose processes inside are limited to
/// `pids_max` (by `RLIMIT_NPROC`, which gVisor's kernel enforces): with room for the
/// Sentry, which dies when it cannot make a thread, so the host limit must never be
/// what stops a fork inside.
pub fn host_pids_max(pids_max: u64) -> u64 {
    pids_max
        .saturating_mul(HOST_TASKS_PER_TASK)
        .saturating_add(HOST_TASKS_BASE)
}

/// The `runsc` a node runs gVisor sandboxes with, and its platform.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gvisor {
    /// The `runsc` binary.
    pub runsc: PathBuf,
    /// `systrap`, `ptrace` or `kvm`.
    pub platform: String,
}

impl Gvisor {
    /// Checks `runsc` and picks its platform: `requested` if this runsc has it, else the
    /// best it has (`systrap`, then `ptrace`). The error says what is missing.
    pub fn detect(runsc: PathBuf, requested: Option<&str>) -> Result<Self, String> {
        let out = Command::new(&runsc)
            .args(["help", "platforms"])
            .output()
            .map_err(|e| format!("{}: {e}", runsc.display()))?;
        let listed = String::from_utf8_lossy(&out.stdout);
        let platforms: Vec<&str> = listed.split_whitespace().collect();
        let platform = match requested {
            Some(p) if platforms.contains(&p) => p.to_string(),
            Some(p) => {
                return Err(format!(
                    "{} has no platform {p:?}; it has: {}",
                    runsc.display(),
                    platforms.join(", ")
                ))
            }
            None => ["systrap", "ptrace"]
                .into_iter()
                .find(|p| platforms.contains(p))
                .ok_or_else(|| {
                    format!(
                        "{} lists no usable platform (systrap, ptrace): {listed:?}",
                        runsc.display()
                    )
                })?
                .to_string(),
        };
        Ok(Self { runsc, platform })
    }

    /// `runsc` with the node's state directory and the flags every call shares.
    fn command(&self, state: &Path) -> Command {
        let mut c = Command::new(&self.runsc);
        c.arg("--root").arg(state);
        c
    }

    /// Starts the bundle at `bundle` as container `id`; returns the sandbox's pid once
    /// its agent listens on `socket`.
    pub fn start(
        &self,
        state: &Path,
        bundle: &Path,
        id: &str,
        socket: &Path,
    ) -> Result<i32, String> {
        let log_path = bundle.join("output.log");
        let log = std::fs::File::create(&log_path).map_err(|e| format!("create log: {e}"))?;
        let log_err = log.try_clone().map_err(|e| format!("log: {e}"))?;
        let status = self
            .command(state)
            .arg(format!("--platform={}", self.platform))
            .args([
                "--host-uds=create",
                "--network=none",
                "--overlay2=none",
                "--oci-seccomp",
                "run",
                "--detach",
                "--bundle",
            ])
            .arg(bundle)
            .arg(id)
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .status()
            .map_err(|e| format!("start {}: {e}", self.runsc.display()))?;
        if !status.success() {
            let msg = std::fs::read_to_string(&log_path).unwrap_or_default();
            return Err(format!("{} run: {}", self.runsc.display(), msg.trim()));
        }
        let out = self
            .command(state)
            .args(["state", id])
            .output()
            .map_err(|e| format!("state: {e}"))?;
        let pid = serde_json::from_slice::<serde_json::Value>(&out.stdout)
            .ok()
            .and_then(|v| v.get("pid").and_then(|p| p.as_i64()))
            .and_then(|p| i32::try_from(p).ok())
            .filter(|p| *p > 0)
            .ok_or_else(|| "runsc reported no pid".to_string())?;
        // The socket file appears at the agent's bind, before its listen: wait until a
        // connection is taken (the agent reads its end as a client that left).
        let deadline = Instant::now() + SOCKET_WAIT;
        while std::os::unix::net::UnixStream::connect(socket).is_err() {
            if Instant::now() > deadline {
                let msg = std::fs::read_to_string(&log_path).unwrap_or_default();
                return Err(format!(
                    "the agent did not bind its socket within {}s under gVisor: {}",
                    SOCKET_WAIT.as_secs(),
                    msg.trim()
                ));
            }
            // SAFETY: signal 0 only checks that our own child's pid exists.
            if unsafe { libc::kill(pid, 0) } != 0 {
                let msg = std::fs::read_to_string(&log_path).unwrap_or_default();
                return Err(format!(
                    "the gVisor sandbox exited at start: {}",
                    msg.trim()
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(pid)
    }

    /// Removes container `id` (killing what is left of it). One runsc does not know is
    /// fine.
    pub fn delete(&self, state: &Path, id: &str) {
        let _ = self
            .command(state)
            .args(["delete", "--force", id])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// runsc's state directory for this node.
pub fn state_dir(run_dir: &Path) -> PathBuf {
    run_dir.join("gvisor")
}

/// The host directory a gVisor sandbox's agent binds its socket in.
pub fn socket_dir(sandbox_run_dir: &Path) -> PathBuf {
    sandbox_run_dir.join("agent-dir")
}

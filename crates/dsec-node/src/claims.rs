//! Host-wide names a node owns alone: its cgroup parent. Its nftables table and link
//! prefix are host-wide too but not claimed yet: two networked nodes on one host need
//! distinct `--nft-table`, `--link-prefix`, `--sandbox-subnet` and `--dns-port`.
//!
//! A node destroys what it finds under its own names without a record (that is how it
//! cleans up after a crash), so a second `dsec serve` on the same names would kill the
//! first one's sandboxes. Each name is claimed with an exclusive `flock` on a file under
//! [`CLAIMS_DIR`]; the kernel drops the lock when the process exits, however it exits.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::NodeError;

/// Where the claim files live: the same for every node on the host.
pub const CLAIMS_DIR: &str = "/run/dsec-claims";

/// The claims of one running node; released on drop.
#[derive(Debug)]
pub struct HostClaims {
    _files: Vec<File>,
}

impl HostClaims {
    /// Claims every `(kind, name)` under `dir`, or fails naming the process that holds
    /// one already and the flag that picks another name.
    pub fn acquire(dir: &Path, names: &[(&str, &str, &str)]) -> Result<Self, NodeError> {
        std::fs::create_dir_all(dir).map_err(NodeError::io("mkdir", dir))?;
        let mut files = Vec::new();
        for (kind, name, flag) in names {
            files.push(claim(dir, kind, name, flag)?);
        }
        Ok(Self { _files: files })
    }
}

/// How long a claim waits for a holder that is exiting (a node just killed: the kernel
/// drops its locks only once its teardown reaches the file table).
const EXITING_HOLDER_GRACE: Duration = Duration::from_secs(30);

fn claim(dir: &Path, kind: &str, name: &str, flag: &str) -> Result<File, NodeError> {
    // Names may hold '/' (a nested cgroup parent).
    let path: PathBuf = dir.join(format!("{kind}-{}", name.replace('/', "%2F")));
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(NodeError::io("open", &path))?;
    let deadline = Instant::now() + EXITING_HOLDER_GRACE;
    let mut told = false;
    loop {
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            break;
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(NodeError::Io {
                op: "flock",
                path: path.display().to_string(),
                source: err,
            });
        }
        let mut holder = String::new();
        let _ = file.rewind();
        let _ = file.read_to_string(&mut holder);
        let holder_pid = holder.trim().parse::<i32>().ok();
        // A holder on its way out (or one that has not written its pid yet) releases the
        // lock in moments: wait for it rather than fail a restart that follows a kill.
        let going = holder_pid.is_none_or(process_is_exiting);
        if going && Instant::now() < deadline {
            if !told {
                tracing::info!(%kind, %name, holder = ?holder_pid, "waiting for an exiting node to release its claim");
                told = true;
            }
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        let holder = match holder_pid {
            None => "another process".to_string(),
            Some(pid) => format!("process {pid}"),
        };
        return Err(NodeError::Unsupported(format!(
            "{kind} {name:?} belongs to another dsec node ({holder}): a node destroys \
             what it finds there without a record, so two cannot share it; give this one \
             its own {flag}"
        )));
    }
    let mut write_pid = || -> std::io::Result<()> {
        file.set_len(0)?;
        file.rewind()?;
        write!(file, "{}", std::process::id())
    };
    write_pid().map_err(NodeError::io("write", &path))?;
    Ok(file)
}

/// Whether `pid` is gone or tearing down (`PF_EXITING`, a zombie or dead task): the lock
/// it holds is about to go.
fn process_is_exiting(pid: i32) -> bool {
    use crate::procstat::{at, fields};
    const PF_EXITING: u64 = 0x4;
    let Some(f) = fields(pid) else {
        return true;
    };
    let state = f.get(at(3)).map_or("", String::as_str);
    let flags = f
        .get(at(9))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    matches!(state, "Z" | "X" | "x") || flags & PF_EXITING != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_claimed_once_until_released() {
        let dir = tempfile::tempdir().expect("tempdir");
        let first = HostClaims::acquire(
            dir.path(),
            &[("cgroup parent", "dsec/a", "--cgroup-parent")],
        )
        .expect("first claim");
        let err = HostClaims::acquire(
            dir.path(),
            &[
                ("cgroup parent", "other", "--cgroup-parent"),
                ("cgroup parent", "dsec/a", "--cgroup-parent"),
            ],
        )
        .expect_err("second claim of the same name");
        let msg = err.to_string();
        assert!(msg.contains("\"dsec/a\""), "{msg}");
        assert!(
            msg.contains(&format!("process {}", std::process::id())),
            "{msg}"
        );
        assert!(msg.contains("--cgroup-parent"), "{msg}");
        // A failed acquire releases what it took: "other" is free again.
        HostClaims::acquire(dir.path(), &[("cgroup parent", "other", "--cgroup-parent")])
            .expect("other is free");
        drop(first);
        HostClaims::acquire(
            dir.path(),
            &[("cgroup parent", "dsec/a", "--cgroup-parent")],
        )
        .expect("released on drop");
    }

    #[test]
    fn exiting_and_vanished_holders_are_told_from_live_ones() {
        let mut live = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("spawn sleep");
        let pid = live.id() as i32;
        assert!(
            !process_is_exiting(pid),
            "a sleeping process is not exiting"
        );
        live.kill().expect("kill");
        // Not reaped yet: a zombie, whose locks are already gone.
        let zombie = wait_for(|| process_is_exiting(pid));
        assert!(zombie, "a killed, unreaped child counts as exiting");
        live.wait().expect("reap");
        assert!(
            process_is_exiting(pid),
            "a pid that is gone counts as exiting"
        );
    }

    #[test]
    fn a_claim_waits_for_a_holder_that_lets_go() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("cgroup parent-x");
        // util-linux flock holds the lock without writing a pid (like a node that has
        // locked but not yet written), then exits.
        let mut holder = std::process::Command::new("flock")
            .arg(&file)
            .args(["sleep", "0.5"])
            .spawn()
            .expect("spawn flock");
        assert!(
            wait_for(|| {
                let f = File::open(&file);
                f.is_ok_and(|f| unsafe {
                    // SAFETY: flock probe on a descriptor we own.
                    libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) != 0
                })
            }),
            "the holder never took the lock"
        );
        let started = Instant::now();
        let claims = HostClaims::acquire(dir.path(), &[("cgroup parent", "x", "--cgroup-parent")])
            .expect("claim once the holder let go");
        assert!(
            started.elapsed() >= Duration::from_millis(100),
            "the claim cannot have been taken while the holder held it"
        );
        let _ = holder.wait();
        let pid = std::fs::read_to_string(&file).expect("read claim");
        assert_eq!(pid, std::process::id().to_string());
        drop(claims);
    }

    fn wait_for(mut f: impl FnMut() -> bool) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if f() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }
}

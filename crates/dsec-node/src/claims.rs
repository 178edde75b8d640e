//! Host-wide names a node owns alone: its cgroup parent. Its nftables table and link
//! prefix are host-wide too but not claimed yet: two networked nodes on one host need
//! distinct `--nft-table`, `--link-prefix`, `--sandbox-subnet` and `--dns-port`.
//!
//! A node destroys what it finds under its own names without a record (that is how it
//! cleans up after a crash), so a second `dsec serve` on the same names would kill the
//! first one's sandboxes. Each name is claimed with an exclusive `flock` on a file under
//! [`CLAIMS_DIR`]; the kernel drops the lock when the process exits, however it exits.
//! Or rather when every process holding the locked descriptor does: a claim that is held
//! is checked against the processes that really hold it, and those that outlived a dead
//! node (helpers it cloned) are killed if they are dsec's, named otherwise.

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
    files: Vec<(PathBuf, File)>,
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
        Ok(Self { files })
    }

    /// Removes the claim files (a graceful stop), still holding their locks until drop:
    /// a node waiting on a removed file finds it gone once it locks it and claims anew.
    pub fn remove_files(&self) {
        for (path, _) in &self.files {
            if let Err(e) = std::fs::remove_file(path) {
                tracing::warn!(path = %path.display(), error = %e, "removing a claim file");
            }
        }
    }
}

/// Whether `file` is still the one at `path` (a stopping node removes its claim file
/// before it lets go of the lock).
fn still_at(file: &File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), std::fs::metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// How long a claim waits for a holder that is exiting (a node just killed: the kernel
/// drops its locks only once its teardown reaches the file table).
const EXITING_HOLDER_GRACE: Duration = Duration::from_secs(30);

/// How long processes may hold the lock without their pid in the file: a node writes it
/// a moment after it locks, so holders still unnamed after this are not the node that
/// took the lock but processes that inherited it (helpers it cloned) and outlived it.
const LEFTOVER_GRACE: Duration = Duration::from_secs(1);

fn claim(dir: &Path, kind: &str, name: &str, flag: &str) -> Result<(PathBuf, File), NodeError> {
    // Names may hold '/' (a nested cgroup parent).
    let path: PathBuf = dir.join(format!("{kind}-{}", name.replace('/', "%2F")));
    let open = || {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(NodeError::io("open", &path))
    };
    let mut file = open()?;
    let deadline = Instant::now() + EXITING_HOLDER_GRACE;
    let mut told = false;
    // When processes that never wrote the claim were first seen holding it.
    let mut strangers_since: Option<Instant> = None;
    loop {
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            if still_at(&file, &path) {
                break;
            }
            // Removed by the node that held it as it stopped: claim the new file.
            file = open()?;
            continue;
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
        let recorded = holder.trim().parse::<i32>().ok();
        // The processes that really hold the lock, not the pid the file names: that one
        // may be dead, its lock kept by processes it cloned.
        let holders: Vec<i32> = lock_holders(&file)
            .into_iter()
            .filter(|p| !process_is_exiting(*p))
            .collect();
        if let Some(pid) = recorded.filter(|p| holders.contains(p)) {
            return Err(taken(kind, name, flag, &format!("process {pid}")));
        }
        let now = Instant::now();
        if holders.is_empty() {
            // A holder on its way out releases the lock in moments: wait for it rather
            // than fail a restart that follows a kill.
            if now < deadline {
                if !told {
                    tracing::info!(%kind, %name, holder = ?recorded, "waiting for an exiting node to release its claim");
                    told = true;
                }
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            let holder = match recorded {
                None => "another process".to_string(),
                Some(pid) => format!("process {pid}"),
            };
            return Err(taken(kind, name, flag, &holder));
        }
        // Held by processes that did not write the claim: a node between its lock and
        // its write, for a moment; after that, leftovers of a node that is gone.
        let since = *strangers_since.get_or_insert(now);
        if now < since + LEFTOVER_GRACE {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        let (ours, others): (Vec<i32>, Vec<i32>) =
            holders.iter().partition(|p| is_dsec_process(**p));
        if !others.is_empty() {
            let named: Vec<String> = others
                .iter()
                .map(|p| format!("process {p} ({})", comm(*p)))
                .collect();
            return Err(NodeError::Unsupported(format!(
                "{kind} {name:?} is locked by {}, which is not a dsec node (its claim file \
                 {} names {}): stop it, or give this node its own {flag}",
                named.join(", "),
                path.display(),
                recorded.map_or("no process".to_string(), |p| format!("process {p}")),
            )));
        }
        for pid in ours {
            tracing::warn!(%kind, %name, pid, comm = %comm(pid), dead_node = ?recorded,
                "killing a leftover of a dsec node that is gone, which still holds its claim");
            // SAFETY: kill with a pid and a signal.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        strangers_since = None;
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut write_pid = || -> std::io::Result<()> {
        file.set_len(0)?;
        file.rewind()?;
        write!(file, "{}", std::process::id())
    };
    write_pid().map_err(NodeError::io("write", &path))?;
    Ok((path, file))
}

fn taken(kind: &str, name: &str, flag: &str, holder: &str) -> NodeError {
    NodeError::Unsupported(format!(
        "{kind} {name:?} belongs to another dsec node ({holder}): a node destroys what it \
         finds there without a record, so two cannot share it; give this one its own {flag}"
    ))
}

/// The processes holding the `flock` on `file`'s inode: those with a descriptor of the
/// locked open file (its `fdinfo` lists the lock), which are the process that locked it
/// and whoever inherited that descriptor. A process that merely opened the file (a node
/// waiting for it) is not one.
fn lock_holders(file: &File) -> Vec<i32> {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = file.metadata() else {
        return Vec::new();
    };
    let (dev, ino) = (meta.dev(), meta.ino());
    // Only descriptors whose link names our file are looked at further: a stat through
    // any other (a file on a hung FUSE mount) could block.
    let Ok(name) = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())) else {
        return Vec::new();
    };
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        let holds = fds.flatten().any(|fd| {
            let same = std::fs::read_link(fd.path()).is_ok_and(|l| l == name)
                && std::fs::metadata(fd.path()).is_ok_and(|m| m.dev() == dev && m.ino() == ino);
            same && std::fs::read_to_string(format!(
                "/proc/{pid}/fdinfo/{}",
                fd.file_name().to_string_lossy()
            ))
            .is_ok_and(|info| {
                info.lines()
                    .any(|l| l.starts_with("lock:") && l.contains("FLOCK"))
            })
        });
        if holds {
            out.push(pid);
        }
    }
    out
}

/// Whether `pid` runs a dsec program (`dsec serve` and the helpers it clones, which
/// share its executable; `dsec-agent`).
fn is_dsec_process(pid: i32) -> bool {
    std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|exe| {
        exe.file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("dsec"))
    })
}

/// A process's command name, for messages.
fn comm(pid: i32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|c| c.trim().to_string())
        .unwrap_or_else(|_| "gone".into())
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
    fn a_removed_claim_file_is_claimed_anew() {
        let dir = tempfile::tempdir().expect("tempdir");
        let names = [("cgroup parent", "r", "--cgroup-parent")];
        let first = HostClaims::acquire(dir.path(), &names).expect("first");
        first.remove_files();
        assert!(!dir.path().join("cgroup parent-r").exists());
        // The stopping node still holds the lock on the removed file: no matter.
        let second = HostClaims::acquire(dir.path(), &names).expect("claimed anew");
        drop(first);
        assert!(
            HostClaims::acquire(dir.path(), &names).is_err(),
            "the new claim holds"
        );
        drop(second);
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

    /// A claim file locked and naming a pid that is dead, its lock held only by a child
    /// running `exe` that inherited the locked descriptor (as a helper the node cloned
    /// would). Returns the child.
    fn dead_nodes_claim(file: &Path, exe: &Path) -> std::process::Child {
        use std::os::unix::process::CommandExt;
        let mut gone = std::process::Command::new("true").spawn().expect("true");
        gone.wait().expect("reap");
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(file)
            .expect("open claim");
        // SAFETY: flock on a descriptor we own.
        assert_eq!(unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) }, 0);
        write!(f, "{}", gone.id()).expect("write pid");
        let fd = f.as_raw_fd();
        let mut cmd = std::process::Command::new(exe);
        cmd.arg("30");
        // SAFETY: fcntl is async-signal-safe; it only clears close-on-exec.
        unsafe {
            cmd.pre_exec(move || {
                let flags = libc::fcntl(fd, libc::F_GETFD);
                if flags < 0 || libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        // A copy just written may be busy for a moment (another test's fork holds it).
        let mut tries = 0;
        let child = loop {
            match cmd.spawn() {
                Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) && tries < 50 => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(10));
                }
                other => break other.expect("spawn holder"),
            }
        };
        drop(f);
        assert_eq!(
            lock_holders(&File::open(file).expect("open")),
            [child.id() as i32]
        );
        child
    }

    #[test]
    fn a_leftover_of_a_dead_node_holding_its_claim_is_killed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let exe = dir.path().join("dsec-leftover");
        std::fs::copy("/bin/sleep", &exe).expect("copy sleep");
        let mut leftover = dead_nodes_claim(&dir.path().join("cgroup parent-y"), &exe);
        let claims = HostClaims::acquire(dir.path(), &[("cgroup parent", "y", "--cgroup-parent")])
            .expect("claimed once the leftover is killed");
        let status = leftover.wait().expect("reap");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
        let pid = std::fs::read_to_string(dir.path().join("cgroup parent-y")).expect("read");
        assert_eq!(pid, std::process::id().to_string());
        drop(claims);
    }

    #[test]
    fn a_claim_held_by_a_stranger_names_it_and_leaves_it_alone() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut stranger =
            dead_nodes_claim(&dir.path().join("cgroup parent-z"), Path::new("/bin/sleep"));
        let err = HostClaims::acquire(dir.path(), &[("cgroup parent", "z", "--cgroup-parent")])
            .expect_err("held by a live process that is no dsec node");
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("process {} (sleep)", stranger.id()))
                && msg.contains("not a dsec node"),
            "{msg}"
        );
        assert!(
            stranger.try_wait().expect("try_wait").is_none(),
            "the stranger was left alone"
        );
        stranger.kill().expect("kill");
        stranger.wait().expect("reap");
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

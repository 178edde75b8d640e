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
    // SAFETY: flock on a descriptor we own.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(NodeError::Io {
                op: "flock",
                path: path.display().to_string(),
                source: err,
            });
        }
        let mut holder = String::new();
        let _ = file.read_to_string(&mut holder);
        let holder = match holder.trim() {
            "" => "another process".to_string(),
            pid => format!("process {pid}"),
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
}

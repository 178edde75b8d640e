//! The node's run directory lives in memory.
//!
//! It holds what only matters while the host is up: each sandbox's agent socket, agent
//! log, runtime record and root mount point. Every create makes a handful of these files
//! and every delete removes them, so on a disk file system the churn pays for inode
//! allocation and freeing (on ext4 without a journal, each new inode also scans for
//! recently deleted ones): 13-20% of a create/delete cycle's CPU on a host whose `/run`
//! is not a tmpfs. [`ensure_tmpfs`] mounts a tmpfs there when the directory is
//! on disk and empty; a directory already in memory, or one holding files of an earlier
//! run (whose live sandboxes must stay reachable), is left as it is.

use std::path::{Path, PathBuf};

use nix::mount::{mount, MsFlags};
use nix::sys::statfs::{statfs, FsType, TMPFS_MAGIC};

/// ramfs's magic number (linux/magic.h; nix does not name it).
const RAMFS_MAGIC: FsType = FsType(0x8584_58f6);

use crate::NodeError;

/// What [`ensure_tmpfs`] found or did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunDirOutcome {
    /// The directory was on a tmpfs or ramfs already.
    InMemory,
    /// A tmpfs was mounted on it.
    Mounted,
    /// It is on disk and holds an earlier run's files, so it stays there.
    KeptOnDisk(PathBuf),
}

/// Mounts a private tmpfs (mode 0755 like `/run`: sandbox inits in user namespaces walk
/// through it to their mount points; no devices, no set-id) on `dir` unless it is in
/// memory already or not empty. `dir` must exist.
pub fn ensure_tmpfs(dir: &Path) -> Result<RunDirOutcome, NodeError> {
    let fs = statfs(dir).map_err(|e| NodeError::io("statfs", dir)(e.into()))?;
    let kind = fs.filesystem_type();
    if kind == TMPFS_MAGIC || kind == RAMFS_MAGIC {
        return Ok(RunDirOutcome::InMemory);
    }
    let mut entries = std::fs::read_dir(dir).map_err(NodeError::io("list", dir))?;
    if entries.next().is_some() {
        return Ok(RunDirOutcome::KeptOnDisk(dir.to_path_buf()));
    }
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    mount(
        Some("dsec-run"),
        dir,
        Some("tmpfs"),
        flags,
        Some("mode=0755"),
    )
    .map_err(|e| NodeError::io("mount a tmpfs on", dir)(e.into()))?;
    // Mounts the node makes below stay the node's: nothing propagates to or from peers.
    mount(
        None::<&str>,
        dir,
        None::<&str>,
        MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(|e| NodeError::io("make private", dir)(e.into()))?;
    Ok(RunDirOutcome::Mounted)
}

/// [`ensure_tmpfs`] at node start, with what it did logged; the guard unmounts a tmpfs
/// it mounted unless the start completes.
pub fn prepare(dir: &Path) -> Result<UnmountOnFailure, NodeError> {
    let outcome = ensure_tmpfs(dir)?;
    match &outcome {
        RunDirOutcome::Mounted => tracing::info!(
            dir = %dir.display(),
            "run directory on a tmpfs (--run-dir-on-disk leaves it on disk)"
        ),
        RunDirOutcome::KeptOnDisk(dir) => tracing::warn!(
            dir = %dir.display(),
            "run directory is on disk and holds an earlier run's files: left there; \
             creates and deletes are slower than on a tmpfs"
        ),
        RunDirOutcome::InMemory => {}
    }
    Ok(UnmountOnFailure::new(dir, &outcome))
}

/// Unmounts a run directory's tmpfs that this start mounted, unless [`disarm`]ed: a node
/// that fails to open leaves no mount behind.
///
/// [`disarm`]: UnmountOnFailure::disarm
#[derive(Debug)]
pub struct UnmountOnFailure(Option<PathBuf>);

impl UnmountOnFailure {
    /// Guards `dir` when [`ensure_tmpfs`] mounted it (`outcome` is `Mounted`).
    pub fn new(dir: &Path, outcome: &RunDirOutcome) -> Self {
        Self((*outcome == RunDirOutcome::Mounted).then(|| dir.to_path_buf()))
    }

    /// The node opened: the tmpfs stays.
    pub fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for UnmountOnFailure {
    fn drop(&mut self) {
        if let Some(dir) = self.0.take() {
            // Nothing ran from it yet: it was empty when mounted.
            let _ = nix::mount::umount2(&dir, nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

/// Removes a run directory no sandbox uses any more (a graceful stop with none left,
/// `dsec serve --cleanup`): the tmpfs the node mounted there with everything on it, or,
/// on a directory it did not mount, the entries the node makes; then the directory if it
/// is empty. Returns whether it is gone.
pub fn remove(dir: &Path) -> bool {
    if is_our_tmpfs(dir) {
        if let Err(e) = nix::mount::umount2(dir, nix::mount::MntFlags::MNT_DETACH) {
            tracing::warn!(dir = %dir.display(), error = %e, "unmounting the run directory");
            return false;
        }
    } else {
        let _ = std::fs::remove_file(dir.join("zygote.log"));
        for sub in ["skeleton", "sandboxes", "oci"] {
            let _ = std::fs::remove_dir(dir.join(sub));
        }
    }
    match std::fs::remove_dir(dir) {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "run directory kept");
            false
        }
    }
}

/// Whether `dir` is a mount point of the tmpfs [`ensure_tmpfs`] mounts (source
/// `dsec-run`).
fn is_our_tmpfs(dir: &Path) -> bool {
    let Ok(dir) = dir.canonicalize() else {
        return false;
    };
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let target = dir.to_string_lossy().replace(' ', "\\040");
    info.lines().any(|l| {
        let mut halves = l.splitn(2, " - ");
        let (Some(left), Some(right)) = (halves.next(), halves.next()) else {
            return false;
        };
        let mut r = right.split(' ');
        left.split(' ').nth(4) == Some(target.as_str())
            && r.next() == Some("tmpfs")
            && r.next() == Some("dsec-run")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fs_type(dir: &Path) -> FsType {
        statfs(dir).expect("statfs").filesystem_type()
    }

    #[test]
    fn an_empty_disk_directory_gets_a_tmpfs_and_a_full_one_is_left_alone() {
        if !dsec_testkit::require_root("rundir") {
            return;
        }
        // /var/tmp is on disk on most hosts (this one's /tmp and /run are too).
        let base = PathBuf::from(format!("/var/tmp/dsec-rundir-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let (empty, full) = (base.join("empty"), base.join("full"));
        std::fs::create_dir_all(&empty).expect("mkdir");
        std::fs::create_dir_all(&full).expect("mkdir");
        std::fs::write(full.join("agent.sock"), b"").expect("write");
        let on_disk = fs_type(&base);
        if on_disk == TMPFS_MAGIC {
            // The checkout itself is in memory: there is nothing to move.
            assert_eq!(
                ensure_tmpfs(&empty).expect("ensure"),
                RunDirOutcome::InMemory
            );
            return;
        }

        assert_eq!(
            ensure_tmpfs(&full).expect("ensure"),
            RunDirOutcome::KeptOnDisk(full.clone())
        );
        assert_eq!(fs_type(&full), on_disk);
        assert!(
            full.join("agent.sock").exists(),
            "nothing of an earlier run is hidden"
        );

        assert_eq!(
            ensure_tmpfs(&empty).expect("ensure"),
            RunDirOutcome::Mounted
        );
        assert_eq!(fs_type(&empty), TMPFS_MAGIC);
        // A restarted node finds it in memory and mounts nothing more.
        assert_eq!(
            ensure_tmpfs(&empty).expect("ensure"),
            RunDirOutcome::InMemory
        );
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
        let line = mounts
            .lines()
            .find(|l| l.split(' ').nth(4) == Some(empty.to_str().expect("utf-8")))
            .expect("the tmpfs is in the mount table");
        assert!(line.contains("nosuid") && line.contains("nodev"), "{line}");
        assert!(!line.contains("shared:"), "private: {line}");
        // A start that got no further: the guard takes the mount away again.
        drop(UnmountOnFailure::new(&empty, &RunDirOutcome::Mounted));
        assert_eq!(fs_type(&empty), on_disk);
        // One that opened keeps it; one that found it in memory never unmounts.
        let outcome = ensure_tmpfs(&empty).expect("ensure");
        UnmountOnFailure::new(&empty, &outcome).disarm();
        drop(UnmountOnFailure::new(&empty, &RunDirOutcome::InMemory));
        assert_eq!(fs_type(&empty), TMPFS_MAGIC);
        // A stop with no sandbox left takes the tmpfs, whatever is on it, and the
        // directory away; on a directory it did not mount, only its own entries.
        std::fs::create_dir_all(empty.join("sandboxes/x")).expect("mkdir");
        assert!(remove(&empty), "the tmpfs and its directory go");
        assert!(!empty.exists());
        assert!(
            !remove(&full),
            "a directory with an earlier run's files stays"
        );
        assert!(full.join("agent.sock").exists());
        std::fs::remove_dir_all(&base).expect("cleanup");
    }
}

//! The node's user namespace for sandboxes (`dsec serve --userns-base`): uid and gid 0..N
//! inside map to an unprivileged host range, so root in a sandbox is nobody on the host.
//! Layers and writable disks reach a sandbox as idmapped mounts for this namespace, so
//! files keep their owners (0 on disk is 0 inside) while the host sees the range.

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const OPEN_TREE_CLONE: libc::c_uint = 1;
const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;

/// `struct mount_attr` of `mount_setattr(2)`.
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// A user namespace mapping `0..size` inside to `base..base+size` on the host.
#[derive(Debug)]
pub struct UserNs {
    fd: OwnedFd,
    /// First host uid/gid of the range.
    pub base: u32,
    /// Number of ids mapped.
    pub size: u32,
}

impl UserNs {
    /// Makes the namespace: a short-lived helper process unshares it, the node writes its
    /// maps, keeps a handle and lets the helper go.
    pub fn create(base: u32, size: u32) -> io::Result<Self> {
        if size == 0 || base == 0 || base.checked_add(size).is_none() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("user namespace range {base}+{size}: base and size must be > 0"),
            ));
        }
        let ours = std::fs::read_link("/proc/self/ns/user")?;
        let mut cmd = Command::new("sleep");
        cmd.arg("10")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: unshare is async-signal-safe; the child is single-threaded here.
        unsafe {
            cmd.pre_exec(|| {
                if libc::unshare(libc::CLONE_NEWUSER) != 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn()?;
        let pid = child.id();
        let made = (|| {
            // The helper unshares before it execs; wait until it has.
            let deadline = Instant::now() + Duration::from_secs(5);
            while std::fs::read_link(format!("/proc/{pid}/ns/user"))? == ours {
                if Instant::now() > deadline {
                    return Err(io::Error::other("helper did not enter its user namespace"));
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            for map in ["uid_map", "gid_map"] {
                File::options()
                    .write(true)
                    .open(format!("/proc/{pid}/{map}"))?
                    .write_all(format!("0 {base} {size}\n").as_bytes())?;
            }
            File::open(format!("/proc/{pid}/ns/user")).map(OwnedFd::from)
        })();
        let _ = child.kill();
        let _ = child.wait();
        Ok(Self {
            fd: made?,
            base,
            size,
        })
    }

    /// The namespace, to hand to a sandbox's init.
    pub fn fd(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.fd.as_fd()
    }

    /// A detached clone of the mount at `path` that shows its files through this
    /// namespace's mapping.
    pub fn idmapped_clone(&self, path: &Path) -> io::Result<OwnedFd> {
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path with NUL"))?;
        self.clone_at(libc::AT_FDCWD, &c, 0)
    }

    /// Like [`UserNs::idmapped_clone`], for a mount held by an fd (a detached mount).
    pub fn idmapped_clone_fd(&self, mount: BorrowedFd<'_>) -> io::Result<OwnedFd> {
        self.clone_at(mount.as_raw_fd(), c"", libc::AT_EMPTY_PATH as libc::c_uint)
    }

    fn clone_at(
        &self,
        dirfd: i32,
        path: &std::ffi::CStr,
        flags: libc::c_uint,
    ) -> io::Result<OwnedFd> {
        // SAFETY: open_tree with a valid dirfd/path pair; the result is checked and owned.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_open_tree,
                dirfd,
                path.as_ptr(),
                OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint | flags,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: open_tree returned a new fd that nothing else owns.
        let tree = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let attr = MountAttr {
            attr_set: MOUNT_ATTR_IDMAP,
            attr_clr: 0,
            propagation: 0,
            userns_fd: self.fd.as_raw_fd() as u64,
        };
        // SAFETY: mount_setattr on the detached tree with a mount_attr of the right size.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_mount_setattr,
                tree.as_raw_fd(),
                c"".as_ptr(),
                libc::AT_EMPTY_PATH as libc::c_uint,
                &attr as *const MountAttr,
                std::mem::size_of::<MountAttr>(),
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(tree)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clone_shows_files_through_the_mapping() {
        if !nix::unistd::geteuid().is_root() {
            assert!(std::env::var("CI").is_err(), "CI=true: needs root");
            return;
        }
        let ns = UserNs::create(300_000, 65_536).expect("userns");
        let dir = std::env::temp_dir().join(format!("dsec-userns-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::write(dir.join("f"), b"x").expect("file");
        std::os::unix::fs::chown(dir.join("f"), Some(1000), Some(1000)).expect("chown");
        let tree = ns.idmapped_clone(&dir).expect("clone");
        let meta = std::fs::metadata(format!("/proc/self/fd/{}/f", tree.as_raw_fd()))
            .expect("stat through the clone");
        use std::os::unix::fs::MetadataExt;
        assert_eq!((meta.uid(), meta.gid()), (301_000, 301_000));
        let again = ns
            .idmapped_clone_fd(std::os::fd::AsFd::as_fd(&tree))
            .map(|_| ());
        // A clone of an idmapped mount cannot be idmapped a second time.
        assert!(again.is_err());
        drop(tree);
        std::fs::remove_dir_all(&dir).expect("cleanup");
        assert!(UserNs::create(0, 10).is_err());
    }
}

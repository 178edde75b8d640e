//! The skeleton mount namespace user-namespaced inits start from.
//!
//! A sandbox's init unshares its mount namespace, which copies every mount of the
//! namespace it is in, builds its root and then detaches the copy of the old root. From
//! the host's namespace that is every host mount (tens here, hundreds on a busy node)
//! copied under the kernel's global `namespace_sem`, walked, detached and freed again,
//! once per create, while other creates queue on that lock. Init instead first joins this
//! namespace, made once at node start: an empty read-only tmpfs root with non-recursive
//! binds of the host's `/dev` (the device nodes a user namespace may not make but may
//! bind), `/proc` and `/sys` (a user namespace may mount a new proc or sysfs only where
//! one is fully visible already), and an empty [`STAGE`] directory to mount on. Init
//! needs nothing else of the host's tree: its layers, disk and namespaces come as fds,
//! and it joins its cgroups before switching.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Where, in the skeleton, init mounts its staging tmpfs and assembles its root.
pub const STAGE: &str = "/stage";

/// A mount namespace holding only the skeleton; it lives as long as this value.
#[derive(Debug)]
pub struct Skeleton {
    fd: OwnedFd,
}

impl Skeleton {
    /// Makes the skeleton on a thread of its own, which unshares its mount namespace,
    /// mounts the skeleton's tmpfs on `dir` (an existing directory, untouched in the
    /// host's namespace), pivots into it and exits, leaving the namespace to the fd.
    pub fn create(dir: &Path) -> io::Result<Self> {
        let dir = CString::new(dir.as_os_str().as_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path with NUL"))?;
        std::thread::Builder::new()
            .name("dsec-mntns".into())
            .spawn(move || build(&dir))?
            .join()
            .map_err(|_| io::Error::other("skeleton thread panicked"))?
            .map(|fd| Self { fd })
    }

    /// The namespace, to hand to a sandbox's init.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

fn check(op: &str, rc: libc::c_int) -> io::Result<()> {
    if rc == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    Err(io::Error::new(e.kind(), format!("skeleton: {op}: {e}")))
}

fn mount(
    src: &std::ffi::CStr,
    target: &std::ffi::CStr,
    fstype: Option<&std::ffi::CStr>,
    flags: libc::c_ulong,
    data: Option<&std::ffi::CStr>,
) -> io::Result<()> {
    // SAFETY: mount(2) with NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            fstype.map_or(std::ptr::null(), |f| f.as_ptr()),
            flags,
            data.map_or(std::ptr::null(), |d| d.as_ptr().cast()),
        )
    };
    check("mount", rc)
}

/// Runs on its own thread: everything here changes that thread's namespace and root only.
fn build(dir: &std::ffi::CStr) -> io::Result<OwnedFd> {
    // SAFETY: unshare of the calling thread's mount namespace (and so its fs_struct);
    // the rest of the process keeps the host's.
    check("unshare", unsafe { libc::unshare(libc::CLONE_NEWNS) })?;
    mount(c"none", c"/", None, libc::MS_REC | libc::MS_PRIVATE, None)?;
    mount(
        c"tmpfs",
        dir,
        Some(c"tmpfs"),
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        Some(c"size=16k,mode=0755"),
    )?;
    // SAFETY: chdir into the directory just mounted on.
    check("chdir", unsafe { libc::chdir(dir.as_ptr()) })?;
    for (sub, host) in [
        (c"dev", Some(c"/dev")),
        (c"proc", Some(c"/proc")),
        (c"sys", Some(c"/sys")),
        (c"stage", None),
    ] {
        // SAFETY: mkdir of a relative name in the fresh tmpfs.
        check("mkdir", unsafe { libc::mkdir(sub.as_ptr(), 0o755) })?;
        if let Some(host) = host {
            // Not recursive: only the file system itself, none of the host's mounts
            // beneath it (a proc or sysfs with nothing over it is fully visible).
            mount(host, sub, None, libc::MS_BIND, None)?;
        }
    }
    // SAFETY: pivot_root(".", ".") then detaching the old root, stacked on top, leaves
    // the tmpfs as this namespace's root; chdir to it.
    unsafe {
        check(
            "pivot_root",
            libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) as libc::c_int,
        )?;
        check(
            "detach old root",
            libc::umount2(c".".as_ptr(), libc::MNT_DETACH),
        )?;
        check("chdir", libc::chdir(c"/".as_ptr()))?;
    }
    // Nothing may be created in it: every init of the node starts from this tmpfs.
    mount(
        c"none",
        c"/",
        None,
        libc::MS_REMOUNT
            | libc::MS_BIND
            | libc::MS_RDONLY
            | libc::MS_NOSUID
            | libc::MS_NODEV
            | libc::MS_NOEXEC,
        None,
    )?;
    // SAFETY: open of the thread's own namespace file; the fd is checked and owned.
    let fd = unsafe {
        libc::open(
            c"/proc/thread-self/ns/mnt".as_ptr(),
            libc::O_RDONLY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new fd nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn require_root() -> bool {
        dsec_testkit::require_root("mount namespace tests")
    }

    /// The mounts a thread sees after joining the skeleton: (mount point, fs type, options).
    fn mounts_inside(sk: &Skeleton) -> Vec<(String, String, String)> {
        let fd = sk.fd().try_clone_to_owned().expect("dup");
        std::thread::spawn(move || {
            // SAFETY: unshare the thread's fs_struct so it may switch mount namespace.
            assert_eq!(unsafe { libc::unshare(libc::CLONE_FS) }, 0);
            nix::sched::setns(&fd, nix::sched::CloneFlags::CLONE_NEWNS).expect("setns");
            let info = std::fs::read_to_string("/proc/thread-self/mountinfo").expect("mountinfo");
            info.lines()
                .map(|l| {
                    let f: Vec<&str> = l.split(' ').collect();
                    let dash = f.iter().position(|x| *x == "-").expect("separator");
                    (f[4].to_string(), f[dash + 1].to_string(), f[5].to_string())
                })
                .collect()
        })
        .join()
        .expect("thread")
    }

    #[test]
    fn the_skeleton_holds_a_read_only_root_and_three_binds_only() {
        if !require_root() {
            return;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let sk = Skeleton::create(dir.path()).expect("skeleton");
        let mounts = mounts_inside(&sk);
        let points: Vec<&str> = mounts.iter().map(|(p, _, _)| p.as_str()).collect();
        assert_eq!(points, ["/", "/dev", "/proc", "/sys"], "{mounts:?}");
        let types: Vec<&str> = mounts.iter().map(|(_, t, _)| t.as_str()).collect();
        assert_eq!(
            (types[0], types[2], types[3]),
            ("tmpfs", "proc", "sysfs"),
            "{mounts:?}"
        );
        assert!(mounts[0].2.split(',').any(|o| o == "ro"), "{mounts:?}");
        // The host's namespace never saw the tmpfs.
        let host = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
        let shown = dir.path().display().to_string();
        assert!(!host
            .lines()
            .any(|l| l.split(' ').nth(4) == Some(shown.as_str())));
        // And the thread that made it changed nothing of this process.
        assert_eq!(
            std::fs::read_link("/proc/self/root").expect("root"),
            Path::new("/")
        );
    }
}

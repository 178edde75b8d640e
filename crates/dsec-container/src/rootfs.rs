//! The sandbox's root file system: overlayfs over the shared read-only layers, a minimal
//! `/dev`, `/proc` with sensitive paths masked, read-only `/sys`, then `pivot_root`.
//!
//! All mounts are made inside the sandbox's own mount namespace, so they vanish with it:
//! the node never has per-sandbox mounts to clean up.

use std::fs;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sys::stat::{makedev, mknod, Mode, SFlag};

use crate::InitSpec;

/// A mount or file operation of the root file system failed.
#[derive(Debug, thiserror::Error)]
#[error("{op} {path}: {source}")]
pub struct RootfsError {
    /// What was attempted.
    pub op: &'static str,
    /// The path it was attempted on.
    pub path: String,
    /// OS error.
    pub source: std::io::Error,
}

fn err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(nix::Error) -> RootfsError + 'a {
    move |e| RootfsError {
        op,
        path: path.display().to_string(),
        source: e.into(),
    }
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> RootfsError + 'a {
    move |source| RootfsError {
        op,
        path: path.display().to_string(),
        source,
    }
}

/// Device nodes created in `/dev`: name, major, minor.
pub const DEVICES: &[(&str, u64, u64)] = &[
    ("null", 1, 3),
    ("zero", 1, 5),
    ("full", 1, 7),
    ("random", 1, 8),
    ("urandom", 1, 9),
    ("tty", 5, 0),
];

/// Paths hidden from the sandbox (a directory gets an empty read-only tmpfs, a file is
/// covered with `/dev/null`). They leak host or kernel information, or crash kernels when
/// read in bulk (`grep -r /`).
pub const MASKED_PATHS: &[&str] = &[
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/proc/kallsyms",
    "/proc/kmsg",
    "/proc/kpagecgroup",
    "/proc/kpagecount",
    "/proc/kpageflags",
    "/proc/pagetypeinfo",
    "/proc/sysrq-trigger",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
    "/sys/kernel/debug",
    "/sys/kernel/tracing",
];

/// Paths made read-only inside the sandbox.
pub const READONLY_PATHS: &[&str] = &["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys"];

/// Paths of [`MASKED_PATHS`] and [`READONLY_PATHS`] that a user-namespaced sandbox gets
/// as they are, saving a mount each: files only the host's root may open (mode 0400 or
/// 0200, owned by host uid 0, which the sandbox's user namespace does not map, so its
/// root has neither the owner's rights nor capabilities over them) and directories whose
/// files only the host's root may write. `/proc/sys` is not one of them: the network
/// and other namespaces' settings there belong to the sandbox's root.
pub const HOST_ROOT_ONLY: &[&str] = &[
    "/proc/kmsg",
    "/proc/kpagecgroup",
    "/proc/kpagecount",
    "/proc/kpageflags",
    "/proc/pagetypeinfo",
    "/proc/sysrq-trigger",
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
];

/// The old root, being detached on a thread of its own: unmounting it waits for an RCU
/// grace period (the kernel's `namespace_unlock`) after it is already off the tree,
/// milliseconds on a busy host, which the rest of the boot and the first round trip with
/// the node overlap. [`OldRoot::wait`], or [`OldRoot::defer`] to the first
/// [`old_root_gone`], before the sandbox runs anything.
#[must_use = "the old root must be gone before the sandbox runs anything"]
#[derive(Debug)]
pub struct OldRoot(Option<std::thread::JoinHandle<Result<(), RootfsError>>>);

/// Where the old root init left detaching is (see [`OldRoot::defer`]).
#[derive(Debug)]
enum Detach {
    /// Gone (or never deferred: an agent that is not a sandbox's init).
    Done,
    /// Still detaching.
    Pending(OldRoot),
    /// The detach failed: the sandbox must not run anything.
    Failed(String),
}

static DEFERRED: std::sync::Mutex<Detach> = std::sync::Mutex::new(Detach::Done);

/// Returns once the old root is detached (at once after the first call). Everything
/// that starts a process in the sandbox calls it first; an error (the detach failed)
/// is returned on every call.
pub fn old_root_gone() -> Result<(), RootfsError> {
    let mut state = DEFERRED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    *state = match std::mem::replace(&mut *state, Detach::Done) {
        Detach::Pending(old) => match old.wait() {
            Ok(()) => Detach::Done,
            Err(e) => Detach::Failed(e.to_string()),
        },
        settled => settled,
    };
    match &*state {
        Detach::Failed(why) => Err(detach_failed(why.clone())),
        _ => Ok(()),
    }
}

/// The error of a failed old-root detach.
fn detach_failed(why: String) -> RootfsError {
    RootfsError {
        op: "detach old root",
        path: "/".into(),
        source: std::io::Error::other(why),
    }
}

impl OldRoot {
    /// Leaves the wait to the first [`old_root_gone`] (the sandbox's PID 1 answers the
    /// node meanwhile, and starts no process before that call).
    pub fn defer(self) {
        *DEFERRED
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Detach::Pending(self);
    }

    /// Waits until the old root is detached.
    pub fn wait(self) -> Result<(), RootfsError> {
        match self.0 {
            Some(t) => t
                .join()
                .unwrap_or_else(|_| Err(detach_failed("detaching thread panicked".into()))),
            None => Ok(()),
        }
    }
}

/// Builds the root and pivots into it. Must run in a fresh mount namespace and, for the
/// `/proc` mount to show the sandbox's own processes, in its new pid namespace.
pub fn build(spec: &InitSpec) -> Result<OldRoot, RootfsError> {
    let root = PathBuf::from(&spec.rootfs);
    // Nothing we mount may propagate back to the host.
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(err("make-rprivate", Path::new("/")))?;

    let (mut lower, mut upper, mut work) = (
        spec.lower_dirs.clone(),
        spec.upper_dir.clone(),
        spec.work_dir.clone(),
    );
    let mut root = root;
    if spec.userns_fd.is_some() {
        // overlayfs in a user namespace clones its layers privately, which it may only
        // do for mounts of the mounter's own mount namespace: attach the idmapped trees
        // the node handed over (`/proc/self/fd/N`) in a staging tmpfs first, and mount
        // the root one level down. The staging mounts go with the old root at the pivot.
        mount(
            Some("tmpfs"),
            &root,
            Some("tmpfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some("size=64k,mode=0700"),
        )
        .map_err(err("mount staging tmpfs", &root))?;
        for p in lower.iter_mut().chain([&mut upper, &mut work]) {
            *p = attach_fd_path(&root, p)?;
        }
        root = root.join("root");
        fs::create_dir(&root).map_err(io_err("mkdir", &root))?;
    }
    let mut opts = format!(
        "lowerdir={},upperdir={},workdir={}",
        lower.join(":"),
        upper,
        work
    );
    // A sandbox's writes do not outlive the host (its record is on a tmpfs), so the
    // overlay never syncs its upper: a delete does not wait for a journal commit and
    // writeback of files about to be removed, and fsync inside the sandbox is free.
    opts.push_str(",volatile");
    if spec.userns_fd.is_some() {
        // In a user namespace overlayfs cannot use trusted.* xattrs: its own metadata
        // (opaque directories, ...) is user.overlay.*, which layers carry too.
        opts.push_str(",userxattr");
    }
    // nodev: device nodes shipped in an image or created in the upper are inert; the
    // sandbox's devices live on the separate /dev tmpfs below.
    mount(
        Some("overlay"),
        &root,
        Some("overlay"),
        MsFlags::MS_NODEV,
        Some(opts.as_str()),
    )
    .map_err(err("mount overlay", &root))?;

    mount_proc(&root)?;
    mount_dev(&root)?;
    let sys = ensure_dir(&root, "sys")?;
    let ro = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    match mount(Some("sysfs"), &sys, Some("sysfs"), ro, None::<&str>) {
        Ok(()) => {}
        // sysfs needs the network namespace to belong to the mounter's user namespace;
        // a user-namespaced sandbox in a node-prepared network namespace gets an empty,
        // read-only /sys instead of a view of the host's.
        Err(nix::Error::EPERM) if spec.userns_fd.is_some() => {
            mount(Some("tmpfs"), &sys, Some("tmpfs"), ro, Some("size=0"))
                .map_err(err("mount /sys tmpfs", &sys))?
        }
        Err(e) => return Err(err("mount sysfs", &sys)(e)),
    }
    let tmp = ensure_dir(&root, "tmp")?;
    // Only when it differs: a chmod copies /tmp up into the sandbox's disk.
    if fs::symlink_metadata(&tmp)
        .ok()
        .map(|m| m.permissions().mode() & 0o7777)
        != Some(0o1777)
    {
        let _ = fs::set_permissions(&tmp, fs::Permissions::from_mode(0o1777));
    }

    let old_root = pivot(&root)?;
    if let Some(conf) = &spec.resolv_conf {
        write_resolv_conf(conf)?;
    }
    mask_paths(spec.userns_fd.is_some())?;
    Ok(old_root)
}

/// Points the sandbox at the node's resolver. Runs after the pivot, so a symlink the
/// image put at /etc/resolv.conf can only lead elsewhere inside the sandbox; it is
/// replaced by a plain file.
fn write_resolv_conf(conf: &str) -> Result<(), RootfsError> {
    let etc = Path::new("/etc");
    fs::create_dir_all(etc).map_err(io_err("mkdir", etc))?;
    let p = Path::new("/etc/resolv.conf");
    match fs::remove_file(p) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err("remove", p)(e)),
    }
    fs::write(p, conf).map_err(io_err("write", p))
}

/// For a path `/proc/self/fd/N[/rest]`, attaches the detached mount of fd N at
/// `staging/fdN` (once) and returns `staging/fdN[/rest]`; other paths are returned as
/// they are.
fn attach_fd_path(staging: &Path, path: &str) -> Result<String, RootfsError> {
    let Some(tail) = path.strip_prefix("/proc/self/fd/") else {
        return Ok(path.to_string());
    };
    let (num, rest) = tail.split_once('/').unwrap_or((tail, ""));
    let Ok(fd) = num.parse::<i32>() else {
        return Ok(path.to_string());
    };
    let at = staging.join(format!("fd{fd}"));
    if !at.exists() {
        fs::create_dir(&at).map_err(io_err("mkdir", &at))?;
        let c = std::ffi::CString::new(at.as_os_str().as_encoded_bytes())
            .map_err(|_| io_err("attach", &at)(std::io::ErrorKind::InvalidInput.into()))?;
        const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
        // SAFETY: move_mount of the detached tree held by fd onto a directory we made.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_move_mount,
                fd,
                c"".as_ptr(),
                libc::AT_FDCWD,
                c.as_ptr(),
                MOVE_MOUNT_F_EMPTY_PATH,
            )
        };
        if rc != 0 {
            return Err(io_err("attach layer", &at)(std::io::Error::last_os_error()));
        }
    }
    Ok(if rest.is_empty() {
        at.display().to_string()
    } else {
        at.join(rest).display().to_string()
    })
}

fn ensure_dir(root: &Path, rel: &str) -> Result<PathBuf, RootfsError> {
    let p = root.join(rel);
    // A symlink planted in a writable layer must not redirect our mounts to the host:
    // refuse anything that is not a real directory.
    match fs::symlink_metadata(&p) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(RootfsError {
                op: "expect directory",
                path: p.display().to_string(),
                source: std::io::Error::from_raw_os_error(libc::ENOTDIR),
            })
        }
        Err(_) => fs::create_dir_all(&p).map_err(io_err("mkdir", &p))?,
    }
    Ok(p)
}

fn mount_proc(root: &Path) -> Result<(), RootfsError> {
    let proc_dir = ensure_dir(root, "proc")?;
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mount(Some("proc"), &proc_dir, Some("proc"), flags, None::<&str>)
        .map_err(err("mount proc", &proc_dir))
}

fn mount_dev(root: &Path) -> Result<(), RootfsError> {
    let dev = ensure_dir(root, "dev")?;
    mount(
        Some("tmpfs"),
        &dev,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_STRICTATIME,
        Some("mode=755,size=65536k"),
    )
    .map_err(err("mount /dev tmpfs", &dev))?;
    for (name, major, minor) in DEVICES {
        let p = dev.join(name);
        match mknod(
            &p,
            SFlag::S_IFCHR,
            Mode::from_bits_truncate(0o666),
            makedev(*major, *minor),
        ) {
            Ok(()) => {
                // mknod honours the umask; devices must be world-usable.
                fs::set_permissions(&p, fs::Permissions::from_mode(0o666))
                    .map_err(io_err("chmod", &p))?;
            }
            // A user namespace may not make device nodes: bind the host's instead (the
            // host's /dev is still reachable until the pivot).
            Err(nix::Error::EPERM) => {
                fs::write(&p, b"").map_err(io_err("create", &p))?;
                let host = Path::new("/dev").join(name);
                mount(
                    Some(&host),
                    &p,
                    None::<&str>,
                    MsFlags::MS_BIND,
                    None::<&str>,
                )
                .map_err(err("bind device", &p))?;
            }
            Err(e) => return Err(err("mknod", &p)(e)),
        }
    }
    let pts = dev.join("pts");
    fs::create_dir(&pts).map_err(io_err("mkdir", &pts))?;
    mount(
        Some("devpts"),
        &pts,
        Some("devpts"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620,gid=5"),
    )
    .map_err(err("mount devpts", &pts))?;
    let shm = dev.join("shm");
    fs::create_dir(&shm).map_err(io_err("mkdir", &shm))?;
    mount(
        Some("shm"),
        &shm,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some("mode=1777,size=65536k"),
    )
    .map_err(err("mount /dev/shm", &shm))?;
    for (link, target) in [
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        let p = dev.join(link);
        symlink(target, &p).map_err(io_err("symlink", &p))?;
    }
    Ok(())
}

fn pivot(root: &Path) -> Result<OldRoot, RootfsError> {
    nix::unistd::chdir(root).map_err(err("chdir", root))?;
    // pivot_root(".", ".") stacks the old root on top of the new one; detaching it then
    // leaves only the new root, with no directory needed for the old one. Root and
    // working directory are the new root already: path walks from either start below
    // the stacked old root, which only a mount-point lookup of "." (the umount) reaches.
    nix::unistd::pivot_root(".", ".").map_err(err("pivot_root", root))?;
    let detach =
        || umount2(".", MntFlags::MNT_DETACH).map_err(err("detach old root", Path::new("/")));
    // The thread shares this process's root and working directory, and has its
    // privileges until it ends (capabilities and seccomp filters are per thread). It
    // takes no signals: the agent reads SIGCHLD from a signalfd, which only sees signals
    // that every thread blocks.
    match std::thread::Builder::new()
        .name("detach-old-root".into())
        .spawn(move || {
            block_all_signals();
            detach()
        }) {
        Ok(t) => Ok(OldRoot(Some(t))),
        // No thread: detach here and wait.
        Err(_) => detach().map(|()| OldRoot(None)),
    }
}

/// Blocks every signal on the calling thread.
fn block_all_signals() {
    // SAFETY: sigfillset initialises a set we own; pthread_sigmask only reads it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut set);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// Hides [`MASKED_PATHS`] of the `/proc` (and `/sys`) in view; `userns`: leaves alone
/// the paths only the host's root could read anyway.
pub fn mask_paths(userns: bool) -> Result<(), RootfsError> {
    let wanted = |p: &&&str| !(userns && HOST_ROOT_ONLY.contains(p));
    // Directories are hidden under one empty read-only tmpfs, bound over each of them: a
    // file system per directory would cost a superblock to set up and tear down each.
    let mut empty: Option<&Path> = None;
    for p in MASKED_PATHS.iter().filter(wanted) {
        let path = Path::new(p);
        let Ok(meta) = fs::symlink_metadata(path) else {
            continue;
        };
        if meta.is_dir() {
            match empty {
                // The superblock is read-only, so every bind of it is too.
                Some(first) => mount(
                    Some(first),
                    path,
                    None::<&str>,
                    MsFlags::MS_BIND,
                    None::<&str>,
                ),
                None => mount(
                    Some("tmpfs"),
                    path,
                    Some("tmpfs"),
                    MsFlags::MS_RDONLY
                        | MsFlags::MS_NOSUID
                        | MsFlags::MS_NODEV
                        | MsFlags::MS_NOEXEC,
                    Some("size=0"),
                ),
            }
            .map_err(err("mask dir", path))?;
            empty.get_or_insert(path);
        } else {
            mount(
                Some("/dev/null"),
                path,
                None::<&str>,
                MsFlags::MS_BIND,
                None::<&str>,
            )
            .map_err(err("mask file", path))?;
        }
    }
    for p in READONLY_PATHS.iter().filter(wanted) {
        let path = Path::new(p);
        if fs::symlink_metadata(path).is_err() {
            continue;
        }
        mount(
            Some(path),
            path,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REC,
            None::<&str>,
        )
        .map_err(err("bind read-only path", path))?;
        let flags = MsFlags::MS_BIND
            | MsFlags::MS_REMOUNT
            | MsFlags::MS_RDONLY
            | MsFlags::MS_NOSUID
            | MsFlags::MS_NODEV
            | MsFlags::MS_NOEXEC;
        mount(None::<&str>, path, None::<&str>, flags, None::<&str>)
            .map_err(err("remount read-only", path))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn host_root_only_paths_are_masked_ones_and_only_root_may_use_them_here() {
        for p in HOST_ROOT_ONLY {
            assert!(
                MASKED_PATHS.contains(p) || READONLY_PATHS.contains(p),
                "{p} is neither masked nor read-only"
            );
            assert!(!Path::new(p).starts_with("/proc/sys"), "{p}");
        }
        // The premise, on this kernel: files owned by root with no rights for anyone else
        // (a directory: nothing beneath it writable by anyone but root).
        let mut checked = 0;
        let mut stack: Vec<PathBuf> = HOST_ROOT_ONLY.iter().map(PathBuf::from).collect();
        while let Some(p) = stack.pop() {
            let Ok(m) = fs::symlink_metadata(&p) else {
                continue;
            };
            if m.file_type().is_symlink() {
                continue;
            }
            assert_eq!(m.uid(), 0, "{} not root's", p.display());
            if m.is_dir() {
                if let Ok(rd) = fs::read_dir(&p) {
                    stack.extend(rd.filter_map(Result::ok).map(|e| e.path()));
                }
            } else {
                let mode = m.mode() & 0o7777;
                let others = if HOST_ROOT_ONLY.contains(&p.to_str().unwrap_or_default()) {
                    0o077
                } else {
                    0o022
                };
                assert_eq!(mode & others, 0, "{} mode {mode:o}", p.display());
            }
            checked += 1;
        }
        assert!(checked > 5, "only {checked} paths found");
    }
}

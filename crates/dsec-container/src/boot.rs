//! The boot sequence: join cgroups, unshare namespaces, fork PID 1, build the root,
//! harden, report.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::fd::{FromRawFd, OwnedFd};

use nix::sched::{setns, unshare, CloneFlags};
use nix::unistd::{fork, ForkResult};

use crate::{harden, net, rootfs, InitSpec};

/// A step of the boot sequence failed; the message names the step and path.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// Joining a cgroup failed.
    #[error("join cgroup {path}: {source}")]
    JoinCgroup {
        /// The cgroup.procs file.
        path: String,
        /// OS error.
        source: std::io::Error,
    },
    /// A namespace could not be created.
    #[error("unshare namespaces: {0}")]
    Unshare(nix::Error),
    /// Joining the user namespace or taking its root identity failed.
    #[error("join user namespace: {0}")]
    JoinUserns(nix::Error),
    /// Joining the prepared network namespace failed.
    #[error("join network namespace: {0}")]
    JoinNetns(nix::Error),
    /// Joining the node's skeleton mount namespace failed.
    #[error("join skeleton mount namespace: {0}")]
    JoinMntns(nix::Error),
    /// fork failed.
    #[error("fork: {0}")]
    Fork(nix::Error),
    /// Building the root file system failed.
    #[error("rootfs: {0}")]
    Rootfs(#[from] rootfs::RootfsError),
    /// Dropping privileges or installing seccomp failed.
    #[error("harden: {0}")]
    Harden(#[from] harden::HardenError),
    /// Setting up the network namespace failed.
    #[error("network: {0}")]
    Net(std::io::Error),
    /// Setting the hostname failed.
    #[error("sethostname: {0}")]
    Hostname(nix::Error),
    /// Switching to the best-effort scheduling class failed.
    #[error("SCHED_IDLE: {0}")]
    Sched(std::io::Error),
}

/// Namespaces every container sandbox gets.
pub const NAMESPACES: CloneFlags = CloneFlags::CLONE_NEWNS
    .union(CloneFlags::CLONE_NEWUTS)
    .union(CloneFlags::CLONE_NEWIPC)
    .union(CloneFlags::CLONE_NEWNET)
    .union(CloneFlags::CLONE_NEWCGROUP)
    .union(CloneFlags::CLONE_NEWPID);

/// Turns the calling process into the sandbox's PID 1, with its privileges dropped
/// ([`harden::apply`]) unless `spec.fncall` (then the caller applies them).
///
/// The old root may still be detaching when this returns: wait for it, or defer the
/// wait to [`rootfs::old_root_gone`], before starting anything in the sandbox.
///
/// Writes `pid <host-pid>` to `status` from the intermediate process, which then exits;
/// returns in the new PID 1 once the sandbox is built (the caller writes `ready` and
/// starts serving). Errors are returned in the child (or the intermediate process if they
/// happen before the fork); the caller reports them on `status` and exits.
pub fn boot(spec: &InitSpec, status: &OwnedFd) -> Result<rootfs::OldRoot, BootError> {
    for path in &spec.cgroup_procs {
        join_cgroup(path)?;
    }
    if spec.sched_idle {
        best_effort()?;
    }
    if spec.core_sched {
        own_core_cookie()?;
    }
    // The network namespace first: it may belong to the host's user namespace (a
    // networked sandbox's), whose privileges init gives up when it joins the sandbox's;
    // a pooled one of network mode none belongs to the sandbox's own.
    let namespaces = match spec.netns_fd {
        Some(fd) => {
            // SAFETY: the node handed this fd to init for exactly this purpose; it is
            // owned here and closed right after joining.
            let ns = unsafe { OwnedFd::from_raw_fd(fd) };
            setns(&ns, CloneFlags::CLONE_NEWNET).map_err(BootError::JoinNetns)?;
            NAMESPACES.difference(CloneFlags::CLONE_NEWNET)
        }
        None => NAMESPACES,
    };
    if let Some(fd) = spec.mntns_fd {
        // While init still holds the host's privileges: the skeleton belongs to the
        // host's user namespace. The namespace unshared below is a copy of it.
        // SAFETY: the node handed this fd to init for exactly this purpose; owned here.
        let ns = unsafe { OwnedFd::from_raw_fd(fd) };
        setns(&ns, CloneFlags::CLONE_NEWNS).map_err(BootError::JoinMntns)?;
    }
    if let Some(fd) = spec.userns_fd {
        join_userns(fd)?;
    }
    unshare(namespaces).map_err(BootError::Unshare)?;
    // SAFETY: the process is single-threaded here (init runs this before any thread or
    // runtime starts), so the child may run arbitrary code after fork.
    match unsafe { fork() }.map_err(BootError::Fork)? {
        ForkResult::Parent { child } => {
            let line = format!("pid {}\n", child.as_raw());
            // SAFETY: `status` is a valid open fd for the duration of this call.
            let _ = nix::unistd::write(status, line.as_bytes());
            // The intermediate process has no further role; the sandbox's PID 1 is
            // re-parented to the node (a child subreaper) or the host's init.
            std::process::exit(0);
        }
        ForkResult::Child => {}
    }
    let old_root = rootfs::build(spec)?;
    if let Some(fd) = spec.disk_fd {
        // The overlay holds the disk now; the raw disk root must not stay reachable
        // through PID 1's fds.
        // SAFETY: closing an fd the node handed to us for this purpose only.
        unsafe { libc::close(fd) };
    }
    if spec.userns_fd.is_some() {
        // Likewise the idmapped layer trees (fds FIRST_LAYER_FD and up).
        // SAFETY: close_range on fds handed to us for the mounts, now held by them.
        unsafe {
            libc::syscall(
                libc::SYS_close_range,
                dsec_wire::init::FIRST_LAYER_FD,
                libc::c_uint::MAX,
                0,
            )
        };
    }
    nix::unistd::sethostname(&spec.sandbox_id).map_err(BootError::Hostname)?;
    if spec.netns_fd.is_none() {
        // A prepared namespace has loopback up already (and every link change takes
        // the kernel's RTNL lock, which creates should not queue on needlessly).
        net::loopback_up().map_err(BootError::Net)?;
    }
    if !spec.fncall {
        harden::apply()?;
    }
    Ok(old_root)
}

/// Joins the sandbox's user namespace and becomes its root (uid and gid 0 inside, the
/// start of the node's range outside), with no supplementary groups left from the host.
/// The namespaces made afterwards belong to it, so init keeps full capabilities over
/// them while holding none over the host.
fn join_userns(fd: i32) -> Result<(), BootError> {
    // SAFETY: the node handed this fd to init for exactly this purpose; owned here.
    let ns = unsafe { OwnedFd::from_raw_fd(fd) };
    setns(&ns, CloneFlags::CLONE_NEWUSER).map_err(BootError::JoinUserns)?;
    drop(ns);
    // SAFETY: setgroups/setresgid/setresuid with constant arguments.
    unsafe {
        if libc::setgroups(0, std::ptr::null()) != 0
            || libc::setresgid(0, 0, 0) != 0
            || libc::setresuid(0, 0, 0) != 0
        {
            return Err(BootError::JoinUserns(nix::Error::last()));
        }
    }
    Ok(())
}

fn join_cgroup(path: &str) -> Result<(), BootError> {
    let res = OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|mut f| f.write_all(b"0"));
    res.map_err(|source| BootError::JoinCgroup {
        path: path.to_string(),
        source,
    })
}

/// `prctl(PR_SCHED_CORE, ...)` constants (linux/prctl.h).
const PR_SCHED_CORE: libc::c_int = 62;
const PR_SCHED_CORE_CREATE: libc::c_ulong = 1;
const PR_SCHED_CORE_SCOPE_THREAD_GROUP: libc::c_ulong = 1;

/// Gives this process a new core-scheduling cookie; every process it forks inherits it,
/// so the whole sandbox shares one cookie that no other sandbox has.
fn own_core_cookie() -> Result<(), BootError> {
    // SAFETY: prctl with integer arguments only.
    let r = unsafe {
        libc::prctl(
            PR_SCHED_CORE,
            PR_SCHED_CORE_CREATE,
            0 as libc::c_ulong,
            PR_SCHED_CORE_SCOPE_THREAD_GROUP,
            0 as libc::c_ulong,
        )
    };
    if r != 0 {
        return Err(BootError::Sched(std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Makes this process, and so every process of the sandbox, `SCHED_IDLE`. With
/// `RLIMIT_NICE` at 0 and no `CAP_SYS_NICE`, nothing inside can switch back.
fn best_effort() -> Result<(), BootError> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler and setrlimit on this process with valid arguments.
    unsafe {
        if libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) != 0 {
            return Err(BootError::Sched(std::io::Error::last_os_error()));
        }
        let zero = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::setrlimit(libc::RLIMIT_NICE, &zero) != 0 {
            return Err(BootError::Sched(std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

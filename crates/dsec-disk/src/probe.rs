//! Picks the mount mode: detached if this kernel's overlayfs takes an upper layer on a
//! detached mount (checked by doing it, in a throwaway mount namespace), else attached.

use std::ffi::CString;
use std::fs;
use std::os::unix::ffi::OsStrExt;

use crate::{release, upper_dir, work_dir, DiskError, MountMode, Shared};

pub(crate) fn mount_mode(shared: &Shared) -> Result<MountMode, DiskError> {
    let dir = shared
        .cfg
        .root
        .join(format!("probe-{:016x}", rand::random::<u64>()));
    let disk = match shared.make(shared.cfg.default_mb, &dir, MountMode::Detached) {
        Ok(d) => d,
        Err(e) => {
            tracing::info!(error = %e, "no detached mounts; disks are mounted on the host");
            return Ok(MountMode::Attached);
        }
    };
    let works = overlay_on(&disk.root(), &dir);
    release(disk)?;
    Ok(if works {
        MountMode::Detached
    } else {
        tracing::info!("overlayfs rejects detached upper layers; disks are mounted on the host");
        MountMode::Attached
    })
}

/// Tries an overlay with its upper on `root` in a child's private mount namespace.
fn overlay_on(root: &std::path::Path, dir: &std::path::Path) -> bool {
    let (lower, target) = (dir.join("lower"), dir.join("target"));
    if fs::create_dir(&lower).is_err() || fs::create_dir(&target).is_err() {
        return false;
    }
    let opts = format!(
        "lowerdir={},upperdir={},workdir={}",
        lower.display(),
        upper_dir(root).display(),
        work_dir(root).display()
    );
    let (Ok(opts), Ok(target), Ok(fstype), Ok(slash)) = (
        CString::new(opts),
        CString::new(target.as_os_str().as_bytes()),
        CString::new("overlay"),
        CString::new("/"),
    ) else {
        return false;
    };
    // SAFETY: the child only makes raw syscalls (unshare, mount, _exit) on data prepared
    // before the fork, which is safe in a multi-threaded parent.
    match unsafe { nix::unistd::fork() } {
        // SAFETY: raw syscalls with NUL-terminated strings prepared before the fork.
        Ok(nix::unistd::ForkResult::Child) => unsafe {
            let ok = libc::unshare(libc::CLONE_NEWNS) == 0
                && libc::mount(
                    std::ptr::null(),
                    slash.as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                ) == 0
                && libc::mount(
                    fstype.as_ptr(),
                    target.as_ptr(),
                    fstype.as_ptr(),
                    0,
                    opts.as_ptr().cast(),
                ) == 0;
            libc::_exit(if ok { 0 } else { 1 })
        },
        Ok(nix::unistd::ForkResult::Parent { child }) => matches!(
            nix::sys::wait::waitpid(child, None),
            Ok(nix::sys::wait::WaitStatus::Exited(_, 0))
        ),
        Err(_) => false,
    }
}

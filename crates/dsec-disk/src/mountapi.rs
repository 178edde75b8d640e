//! Detached mounts through the new mount API (`fsopen`/`fsconfig`/`fsmount`, Linux 5.2+):
//! a mounted file system that is held by a file descriptor and attached to no mount
//! namespace. Nothing copies it when a sandbox unshares its mount namespace, and it goes
//! away by itself when the last holder closes it.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::DiskError;

const FSOPEN_CLOEXEC: libc::c_uint = 1;
const FSCONFIG_SET_FLAG: libc::c_uint = 0;
const FSCONFIG_SET_STRING: libc::c_uint = 1;
const FSCONFIG_CMD_CREATE: libc::c_uint = 6;
const FSMOUNT_CLOEXEC: libc::c_uint = 1;
const MOUNT_ATTR_NOSUID: libc::c_uint = 0x2;
const MOUNT_ATTR_NODEV: libc::c_uint = 0x4;

fn os_err(op: &'static str) -> DiskError {
    DiskError::Os {
        op,
        source: std::io::Error::last_os_error(),
    }
}

fn cstr(s: &str) -> CString {
    // Keys and values here are our own constants and /dev paths: never contain NUL.
    CString::new(s).unwrap_or_default()
}

fn fsconfig(fs: RawFd, cmd: libc::c_uint, key: Option<&str>, value: Option<&str>) -> bool {
    let key = key.map(cstr);
    let value = value.map(cstr);
    // SAFETY: fsconfig with a valid fs-context fd and NUL-terminated strings (or NULL)
    // that outlive the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fs,
            cmd,
            key.as_ref().map_or(std::ptr::null(), |k| k.as_ptr()),
            value.as_ref().map_or(std::ptr::null(), |v| v.as_ptr()),
            0,
        )
    };
    rc == 0
}

/// Mounts the ext4 on `device` nosuid+nodev without attaching it anywhere.
pub fn mount_detached_ext4(device: &str, flags: &[&str]) -> Result<OwnedFd, DiskError> {
    let fstype = cstr("ext4");
    // SAFETY: fsopen with a NUL-terminated name; returns a new fd or -1.
    let fs = unsafe { libc::syscall(libc::SYS_fsopen, fstype.as_ptr(), FSOPEN_CLOEXEC) };
    if fs < 0 {
        return Err(os_err("fsopen ext4"));
    }
    // SAFETY: `fs` is a new fd that we own.
    let fs = unsafe { OwnedFd::from_raw_fd(fs as RawFd) };
    if !fsconfig(
        fs.as_raw_fd(),
        FSCONFIG_SET_STRING,
        Some("source"),
        Some(device),
    ) {
        return Err(os_err("fsconfig source"));
    }
    for flag in flags {
        if !fsconfig(fs.as_raw_fd(), FSCONFIG_SET_FLAG, Some(flag), None) {
            return Err(os_err("fsconfig flag"));
        }
    }
    if !fsconfig(fs.as_raw_fd(), FSCONFIG_CMD_CREATE, None, None) {
        return Err(os_err("fsconfig create (mount ext4)"));
    }
    // SAFETY: fsmount on a created fs context; returns a new fd or -1.
    let mnt = unsafe {
        libc::syscall(
            libc::SYS_fsmount,
            fs.as_raw_fd(),
            FSMOUNT_CLOEXEC,
            MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
        )
    };
    if mnt < 0 {
        return Err(os_err("fsmount"));
    }
    // SAFETY: `mnt` is a new fd that we own.
    Ok(unsafe { OwnedFd::from_raw_fd(mnt as RawFd) })
}

//! The `posix_spawn` attributes every process dsec starts begins with: an empty signal
//! mask and SIGPIPE at its default (the Rust runtime ignores it, and ignored signals
//! survive exec). Only SIGPIPE is defaulted: handled signals reset on exec by
//! themselves, and defaulting the full set costs ~64 `rt_sigaction` calls per spawn.
//! Also the file actions, and the `posix_spawn` call itself, shared by the node (init)
//! and the agent (commands).

use std::ffi::{CStr, CString};
use std::os::fd::RawFd;

/// Initialised `posix_spawnattr_t`, destroyed on drop.
pub struct SpawnAttr(libc::posix_spawnattr_t);

impl std::fmt::Debug for SpawnAttr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SpawnAttr")
    }
}

impl SpawnAttr {
    /// Empty mask, SIGPIPE defaulted, plus `extra_flags` (`POSIX_SPAWN_SETSID`,
    /// `POSIX_SPAWN_SETPGROUP`, ...). With `POSIX_SPAWN_SETPGROUP` the child leads a new
    /// process group.
    pub fn new(extra_flags: libc::c_short) -> Self {
        // SAFETY: the attr is initialised before use; the sets are plain values.
        unsafe {
            let mut attr: libc::posix_spawnattr_t = std::mem::zeroed();
            libc::posix_spawnattr_init(&mut attr);
            let mut sigdef: libc::sigset_t = std::mem::zeroed();
            let mut empty: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut sigdef);
            libc::sigaddset(&mut sigdef, libc::SIGPIPE);
            libc::sigemptyset(&mut empty);
            libc::posix_spawnattr_setsigdefault(&mut attr, &sigdef);
            libc::posix_spawnattr_setsigmask(&mut attr, &empty);
            if extra_flags & libc::POSIX_SPAWN_SETPGROUP as libc::c_short != 0 {
                libc::posix_spawnattr_setpgroup(&mut attr, 0);
            }
            let base =
                (libc::POSIX_SPAWN_SETSIGDEF | libc::POSIX_SPAWN_SETSIGMASK) as libc::c_short;
            libc::posix_spawnattr_setflags(&mut attr, base | extra_flags);
            Self(attr)
        }
    }

    /// The attributes, for `posix_spawn`.
    pub fn as_ptr(&self) -> *const libc::posix_spawnattr_t {
        &self.0
    }
}

impl Drop for SpawnAttr {
    fn drop(&mut self) {
        // SAFETY: initialised in `new`, destroyed once.
        unsafe { libc::posix_spawnattr_destroy(&mut self.0) };
    }
}

/// Initialised `posix_spawn_file_actions_t`, destroyed on drop. An action that cannot be
/// recorded (out of memory, a bad number) makes [`spawn`] fail instead of starting a
/// process without it: a missing close would leak a descriptor into a sandbox.
pub struct FileActions {
    actions: libc::posix_spawn_file_actions_t,
    failed: Option<i32>,
}

impl std::fmt::Debug for FileActions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileActions")
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

impl Default for FileActions {
    fn default() -> Self {
        Self::new()
    }
}

impl FileActions {
    /// No actions yet.
    pub fn new() -> Self {
        // SAFETY: a zeroed struct initialised by its init function.
        unsafe {
            let mut actions: libc::posix_spawn_file_actions_t = std::mem::zeroed();
            let rc = libc::posix_spawn_file_actions_init(&mut actions);
            Self {
                actions,
                failed: (rc != 0).then_some(rc),
            }
        }
    }

    fn record(&mut self, rc: i32) {
        if rc != 0 {
            self.failed.get_or_insert(rc);
        }
    }

    /// The child's `to` becomes a copy of the parent's `from`.
    pub fn dup2(&mut self, from: RawFd, to: RawFd) {
        // SAFETY: initialised actions; plain integers.
        let rc = unsafe { libc::posix_spawn_file_actions_adddup2(&mut self.actions, from, to) };
        self.record(rc);
    }

    /// The child opens `path` at `fd`.
    pub fn open(&mut self, fd: RawFd, path: &CStr, flags: i32, mode: libc::mode_t) {
        // SAFETY: initialised actions; glibc copies the path.
        let rc = unsafe {
            libc::posix_spawn_file_actions_addopen(
                &mut self.actions,
                fd,
                path.as_ptr(),
                flags,
                mode,
            )
        };
        self.record(rc);
    }

    /// The child closes `fd` (no error if it is not open).
    pub fn close(&mut self, fd: RawFd) {
        // SAFETY: initialised actions; a plain integer.
        let rc = unsafe { libc::posix_spawn_file_actions_addclose(&mut self.actions, fd) };
        self.record(rc);
    }

    /// The child closes every descriptor from `fd` up.
    pub fn close_from(&mut self, fd: RawFd) {
        // SAFETY: initialised actions; a plain integer.
        let rc = unsafe { libc::posix_spawn_file_actions_addclosefrom_np(&mut self.actions, fd) };
        self.record(rc);
    }

    /// The child changes to `dir` before the exec.
    pub fn chdir(&mut self, dir: &CStr) {
        // SAFETY: initialised actions; glibc copies the path.
        let rc =
            unsafe { libc::posix_spawn_file_actions_addchdir_np(&mut self.actions, dir.as_ptr()) };
        self.record(rc);
    }
}

impl Drop for FileActions {
    fn drop(&mut self) {
        // SAFETY: initialised in `new`, destroyed once.
        unsafe { libc::posix_spawn_file_actions_destroy(&mut self.actions) };
    }
}

/// `posix_spawn` of `exe` with `argv` (argv[0] included) and `env` (`KEY=VALUE`); returns
/// the child's pid, which the caller reaps.
pub fn spawn(
    exe: &CStr,
    argv: &[CString],
    env: &[CString],
    actions: &FileActions,
    attr: &SpawnAttr,
) -> std::io::Result<libc::pid_t> {
    if let Some(rc) = actions.failed {
        return Err(std::io::Error::from_raw_os_error(rc));
    }
    let pointers = |strings: &[CString]| -> Vec<*mut libc::c_char> {
        strings
            .iter()
            .map(|s| s.as_ptr() as *mut libc::c_char)
            .chain([std::ptr::null_mut()])
            .collect()
    };
    let (argv_p, env_p) = (pointers(argv), pointers(env));
    let mut pid: libc::pid_t = 0;
    // SAFETY: every pointer is valid (and the arrays null-terminated) for the call;
    // posix_spawn does not write through argv or env.
    let rc = unsafe {
        libc::posix_spawn(
            &mut pid,
            exe.as_ptr(),
            &actions.actions,
            attr.as_ptr(),
            argv_p.as_ptr(),
            env_p.as_ptr(),
        )
    };
    if rc != 0 {
        return Err(std::io::Error::from_raw_os_error(rc));
    }
    Ok(pid)
}

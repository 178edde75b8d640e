//! The `posix_spawn` attributes every process dsec starts begins with: an empty signal
//! mask and SIGPIPE at its default (the Rust runtime ignores it, and ignored signals
//! survive exec). Only SIGPIPE is defaulted: handled signals reset on exec by
//! themselves, and defaulting the full set costs ~64 `rt_sigaction` calls per spawn.

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

//! Signal dispositions through the raw `rt_sigaction` system call: libc's wrapper hides
//! the signals it reserves (32 and 33), which a process inherits all the same.

/// The kernel's `struct sigaction` on x86_64 and aarch64.
#[repr(C)]
struct KernelSigaction {
    handler: usize,
    flags: u64,
    restorer: usize,
    mask: u64,
}

/// Size of the kernel's signal set, in bytes.
const SIGSET_SIZE: usize = 8;

/// Whether `sig` is ignored (`SIG_IGN`) now.
pub fn is_ignored(sig: i32) -> bool {
    let mut old = KernelSigaction {
        handler: 0,
        flags: 0,
        restorer: 0,
        mask: 0,
    };
    // SAFETY: rt_sigaction reading into a kernel-layout struct we own.
    let r = unsafe {
        libc::syscall(
            libc::SYS_rt_sigaction,
            sig,
            std::ptr::null::<KernelSigaction>(),
            &mut old as *mut KernelSigaction,
            SIGSET_SIZE,
        )
    };
    r == 0 && old.handler == libc::SIG_IGN
}

/// Sets `sig` to its default action with `flags` (`SA_NOCLDWAIT` for SIGCHLD, or 0).
pub fn set_default(sig: i32, flags: libc::c_int) -> std::io::Result<()> {
    let dfl = KernelSigaction {
        handler: libc::SIG_DFL,
        flags: flags as u64,
        restorer: 0,
        mask: 0,
    };
    // SAFETY: installing SIG_DFL (no handler, so no restorer is needed).
    let r = unsafe {
        libc::syscall(
            libc::SYS_rt_sigaction,
            sig,
            &dfl as *const KernelSigaction,
            std::ptr::null_mut::<KernelSigaction>(),
            SIGSET_SIZE,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ignored_signal_is_seen_and_reset_to_its_default() {
        // SAFETY: setting SIGUSR2's disposition; nothing else in these tests uses it.
        unsafe { libc::signal(libc::SIGUSR2, libc::SIG_IGN) };
        assert!(is_ignored(libc::SIGUSR2));
        set_default(libc::SIGUSR2, 0).expect("reset");
        assert!(!is_ignored(libc::SIGUSR2));
        assert!(
            set_default(libc::SIGKILL, 0).is_err(),
            "SIGKILL cannot change"
        );
    }
}

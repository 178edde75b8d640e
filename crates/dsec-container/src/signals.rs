//! Signal dispositions through the raw `rt_sigaction` system call (init's reset, the
//! zygote's reaping, the spawned child's defaults): libc's wrapper hides
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

/// `rt_sigaction(sig, new, old)`; returns the raw result.
fn rt_sigaction(sig: i32, new: Option<&KernelSigaction>, old: Option<&mut KernelSigaction>) -> i64 {
    let new = new.map_or(std::ptr::null(), |n| n as *const KernelSigaction);
    let old = old.map_or(std::ptr::null_mut(), |o| o as *mut KernelSigaction);
    // SAFETY: kernel-layout structs we own (or null), with the kernel's sigset size; a
    // new action is only ever SIG_DFL, which needs no handler and no restorer.
    unsafe { libc::syscall(libc::SYS_rt_sigaction, sig, new, old, SIGSET_SIZE) }
}

/// Whether `sig` is ignored (`SIG_IGN`) now.
pub fn is_ignored(sig: i32) -> bool {
    let mut old = KernelSigaction {
        handler: 0,
        flags: 0,
        restorer: 0,
        mask: 0,
    };
    rt_sigaction(sig, None, Some(&mut old)) == 0 && old.handler == libc::SIG_IGN
}

/// Sets `sig` to its default action with `flags` (`SA_NOCLDWAIT` for SIGCHLD, or 0).
pub fn set_default(sig: i32, flags: libc::c_int) -> std::io::Result<()> {
    let dfl = KernelSigaction {
        handler: libc::SIG_DFL,
        flags: flags as u64,
        restorer: 0,
        mask: 0,
    };
    if rt_sigaction(sig, Some(&dfl), None) != 0 {
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

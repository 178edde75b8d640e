//! More peers on the same root file system as the crun/runc rows: bubblewrap, podman
//! (with runc: Debian's crun refuses this host's hybrid cgroup setup), and the floor, a
//! raw unshare + pivot_root + exec of `/bin/true` with nothing else.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use crate::{time_cmd, Stats};

fn repeat(
    name: &str,
    n: usize,
    note: &str,
    mut once: impl FnMut() -> anyhow::Result<f64>,
) -> Stats {
    let mut samples = Vec::new();
    for i in 0..n + 2 {
        match once() {
            Ok(ms) if i >= 2 => samples.push(ms),
            Ok(_) => {}
            Err(e) => return Stats::na(name, format!("{e:#}")),
        }
    }
    Stats {
        name: name.into(),
        samples,
        note: Some(note.into()),
    }
}

/// `bwrap` with every namespace, the root read-only, fresh /proc, /dev and /tmp.
pub fn bwrap(rootfs: &Path, n: usize) -> Stats {
    if Command::new("bwrap").arg("--version").output().is_err() {
        return Stats::na("bwrap true", "bubblewrap not installed".into());
    }
    repeat(
        "bwrap true",
        n,
        "all namespaces, ro root, own /proc /dev /tmp",
        || {
            time_cmd(
                Command::new("bwrap")
                    .arg("--ro-bind")
                    .arg(rootfs)
                    .args(["/", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"])
                    .args(["--unshare-all", "--die-with-parent", "/bin/true"]),
            )
        },
    )
}

/// `podman run --rm` of the same root (an overlay on it, `:O`), no network.
pub fn podman(rootfs: &Path, n: usize) -> Stats {
    if Command::new("podman").arg("--version").output().is_err() {
        return Stats::na("podman run true", "podman not installed".into());
    }
    let root = format!("{}:O", rootfs.display());
    repeat(
        "podman run true",
        n,
        "podman run --rm --network none --runtime runc --rootfs ROOT:O",
        || {
            time_cmd(Command::new("podman").args([
                "run",
                "--rm",
                "--network",
                "none",
                "--runtime",
                "runc",
                "--rootfs",
                &root,
                "/bin/true",
            ]))
        },
    )
}

/// The floor: fork, unshare mount/pid/uts/ipc/net namespaces, fork PID 1, pivot into the
/// root and exec `/bin/true`; timed until it is reaped. The children make raw syscalls on
/// strings prepared before the fork (the bench is multi-threaded: no allocation after it).
pub fn raw_floor(rootfs: &Path, n: usize) -> Stats {
    let Ok(root) = std::ffi::CString::new(rootfs.as_os_str().as_encoded_bytes()) else {
        return Stats::na("raw unshare+pivot_root+exec", "root path with NUL".into());
    };
    repeat(
        "raw unshare+pivot_root+exec",
        n,
        "floor: namespaces, pivot_root, exec; no cgroup, no overlay",
        || {
            let t = Instant::now();
            // SAFETY: fork; the child only makes async-signal-safe syscalls on memory
            // prepared before the fork, then execs or _exits.
            let pid = unsafe { libc::fork() };
            if pid < 0 {
                anyhow::bail!("fork: {}", std::io::Error::last_os_error());
            }
            if pid == 0 {
                // SAFETY: see above.
                unsafe { floor_child(&root) }
            }
            let mut status = 0;
            // SAFETY: waiting for the child we forked.
            if unsafe { libc::waitpid(pid, &mut status, 0) } != pid
                || !libc::WIFEXITED(status)
                || libc::WEXITSTATUS(status) != 0
            {
                anyhow::bail!("floor program failed (status {status:#x})");
            }
            Ok(t.elapsed().as_secs_f64() * 1000.0)
        },
    )
}

/// # Safety
/// Only between fork and exec in a child of [`raw_floor`].
unsafe fn floor_child(root: &std::ffi::CStr) -> ! {
    // SAFETY: raw syscalls with valid, pre-made strings; never returns.
    unsafe {
        let flags = libc::CLONE_NEWNS
            | libc::CLONE_NEWPID
            | libc::CLONE_NEWUTS
            | libc::CLONE_NEWIPC
            | libc::CLONE_NEWNET;
        if libc::unshare(flags) != 0 {
            libc::_exit(2);
        }
        let pid1 = libc::fork();
        if pid1 < 0 {
            libc::_exit(3);
        }
        if pid1 > 0 {
            let mut status = 0;
            libc::waitpid(pid1, &mut status, 0);
            libc::_exit(if libc::WIFEXITED(status) {
                libc::WEXITSTATUS(status)
            } else {
                4
            });
        }
        let slash = c"/";
        let dot = c".";
        if libc::mount(
            std::ptr::null(),
            slash.as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        ) != 0
            || libc::chdir(root.as_ptr()) != 0
            || libc::syscall(libc::SYS_pivot_root, dot.as_ptr(), dot.as_ptr()) != 0
            || libc::umount2(dot.as_ptr(), libc::MNT_DETACH) != 0
        {
            libc::_exit(5);
        }
        let prog = c"/bin/true";
        let argv = [prog.as_ptr(), std::ptr::null()];
        libc::execv(prog.as_ptr(), argv.as_ptr());
        libc::_exit(6)
    }
}

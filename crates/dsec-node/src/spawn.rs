//! Starting a sandbox's init (and the zygote) from the node with a vfork-style child
//! ([`dsec_container::spawnattr`]).
//!
//! `std::process::Command` with a `pre_exec` hook must `fork` the node: with a
//! multi-threaded server of tens of MiB, the fork copies its page tables, and every page
//! the node then writes takes a copy-on-write fault plus a TLB shootdown on the other
//! CPUs. Under create churn that was a quarter of the node's CPU. The only things init
//! needs from the hook (descriptors at fixed numbers, nothing else inherited, a new
//! session) are all recorded file actions or flags, so the child shares the node's
//! memory until it execs and nothing is copied.

use std::ffi::{CString, OsStr};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;

use dsec_container::spawnattr::{FileActions, SpawnAttr};
use std::path::Path;

/// What the spawned process gets as stdin, stdout and stderr, and at fixed numbers.
#[derive(Debug)]
pub struct SpawnFds<'a> {
    /// Descriptor for fd 0.
    pub stdin: RawFd,
    /// Descriptor for fd 1.
    pub stdout: RawFd,
    /// Descriptor for fd 2.
    pub stderr: RawFd,
    /// `(descriptor in the node, number in the child)`, numbers above 2. Every other
    /// descriptor is closed in the child, close-on-exec or not.
    pub fixed: &'a [(RawFd, i32)],
}

fn cstring(bytes: &[u8]) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL byte"))
}

/// Spawns `exe` with `argv` (`argv[0]` included) and the node's environment in a new
/// session, with the descriptors of `fds`. Returns the child's pid; the caller reaps it.
pub fn spawn(exe: &Path, argv: &[&str], fds: &SpawnFds<'_>) -> io::Result<libc::pid_t> {
    let exe_c = cstring(exe.as_os_str().as_bytes())?;
    let argv_c = argv
        .iter()
        .map(|a| cstring(a.as_bytes()))
        .collect::<io::Result<Vec<_>>>()?;
    let env_c = std::env::vars_os()
        .map(|(k, v)| {
            let mut kv = k.as_bytes().to_vec();
            kv.push(b'=');
            kv.extend_from_slice(OsStr::as_bytes(&v));
            cstring(&kv)
        })
        .collect::<io::Result<Vec<_>>>()?;
    // Copies above every target number, made here: no dup2 in the child can then clobber
    // a source still to be moved. They are close-on-exec and closed again below.
    let above = fds.fixed.iter().map(|(_, n)| *n).max().unwrap_or(2) + 1;
    let copies = fds
        .fixed
        .iter()
        .map(|(src, _)| {
            // SAFETY: F_DUPFD_CLOEXEC on a descriptor we were handed; the result is owned.
            let fd = unsafe { libc::fcntl(*src, libc::F_DUPFD_CLOEXEC, above) };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: fd was just created by fcntl and belongs to nobody else.
            Ok(unsafe { OwnedFd::from_raw_fd(fd) })
        })
        .collect::<io::Result<Vec<_>>>()?;

    // A sandbox must not share the node's session (POSIX_SPAWN_SETSID): a terminal's ^C
    // to `dsec serve` must not reach sandboxes.
    let attr = SpawnAttr::new(libc::POSIX_SPAWN_SETSID);
    let mut actions = FileActions::new();
    // Standard streams first: their sources may sit at numbers that targets reuse.
    for (src, n) in [(fds.stdin, 0), (fds.stdout, 1), (fds.stderr, 2)] {
        actions.dup2(src, n);
    }
    for (copy, (_, n)) in copies.iter().zip(fds.fixed) {
        actions.dup2(copy.as_raw_fd(), *n);
    }
    // Nothing else crosses into the sandbox: not even descriptors the node itself
    // inherited without close-on-exec from whoever started it (closing a number that is
    // not open is no error).
    for n in 3..above {
        if !fds.fixed.iter().any(|(_, t)| *t == n) {
            actions.close(n);
        }
    }
    actions.close_from(above);
    dsec_container::spawnattr::spawn(&exe_c, &argv_c, &env_c, &actions, &attr)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// The child sees exactly the fixed descriptors at their numbers (even when a source
    /// sits at another target's number), plus its standard streams.
    #[test]
    fn fixed_descriptors_land_at_their_numbers_and_nothing_else_leaks() {
        let (out_r, out_w) = nix::unistd::pipe().expect("pipe");
        let devnull = std::fs::File::open("/dev/null").expect("devnull");
        let a = std::fs::File::open("/etc/hostname").expect("a");
        let b = std::fs::File::open("/etc/passwd").expect("b");
        // A descriptor without close-on-exec that is not handed over must not leak.
        // SAFETY: F_DUPFD on an open file; closed at the end.
        let leak = unsafe { libc::fcntl(a.as_raw_fd(), libc::F_DUPFD, 100) };
        assert!(leak >= 100);
        let fixed = [(a.as_raw_fd(), 7), (b.as_raw_fd(), 3)];
        let pid = spawn(
            Path::new("/bin/sh"),
            &[
                "sh",
                "-c",
                "ls /proc/self/fd; readlink /proc/self/fd/3 /proc/self/fd/7",
            ],
            &SpawnFds {
                stdin: devnull.as_raw_fd(),
                stdout: out_w.as_raw_fd(),
                stderr: devnull.as_raw_fd(),
                fixed: &fixed,
            },
        )
        .expect("spawn");
        drop(out_w);
        let mut text = String::new();
        std::fs::File::from(out_r)
            .read_to_string(&mut text)
            .expect("read");
        let mut status = 0;
        // SAFETY: waitpid on our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert_eq!(status, 0, "{text}");
        let lines: Vec<&str> = text.lines().collect();
        // 0-3 and 7, plus 4: the directory `ls` itself opened to list them.
        let mut fds: Vec<&str> = lines
            .iter()
            .copied()
            .take_while(|l| !l.starts_with('/'))
            .collect();
        fds.sort();
        assert_eq!(fds, ["0", "1", "2", "3", "4", "7"], "{text}");
        assert_eq!(
            &lines[lines.len() - 2..],
            ["/etc/passwd", "/etc/hostname"],
            "{text}"
        );
        // SAFETY: closing our own dup.
        unsafe { libc::close(leak) };
    }

    #[test]
    fn a_missing_program_is_an_error_not_a_child() {
        let devnull = std::fs::File::open("/dev/null").expect("devnull");
        let fd = devnull.as_raw_fd();
        let err = spawn(
            Path::new("/nonexistent/dsec-agent"),
            &["dsec-agent"],
            &SpawnFds {
                stdin: fd,
                stdout: fd,
                stderr: fd,
                fixed: &[],
            },
        )
        .expect_err("must fail");
        assert_eq!(err.raw_os_error(), Some(libc::ENOENT));
    }
}

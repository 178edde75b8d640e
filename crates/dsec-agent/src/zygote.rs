//! `dsec-agent zygote`: a warm agent process the node forks sandbox inits from.
//!
//! Exec'ing the agent for every sandbox pays for the exec, the dynamic set-up of a fresh
//! process (page faults, libc start-up: glibc probes the CPU's caches with dozens of
//! `cpuid`s, each a hypervisor exit in a VM) and its exit, about 0.8 ms of CPU per create.
//! The zygote pays that once: it waits on fd [`ZYGOTE_FD`] (a `SOCK_SEQPACKET` socket)
//! for a [`ZygoteRequest`] with its descriptors, forks, and the child places the
//! descriptors at the numbers an exec'd init has and runs the same [`crate::init::run`].
//!
//! The zygote stays single-threaded (so the child may run anything after `fork`), holds
//! nothing but its socket, and exits when the node closes the other end. Its children are
//! reaped by the kernel (`SA_NOCLDWAIT`); each child restores the default before it forks
//! the sandbox's PID 1.
//!
//! A forked child names itself `dsec-agent init` (its `/proc/PID/cmdline`), as an exec'd
//! one is. Forked children share the zygote's address-space layout (as every Android app shares
//! its zygote's); the agent's memory is not readable from inside a sandbox (PID 1 is not
//! dumpable), and every command the agent starts is exec'd with a fresh layout.

use std::io::IoSliceMut;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use dsec_wire::init::{
    ZygoteReply, ZygoteRequest, STATUS_FD, ZYGOTE_FD, ZYGOTE_MAX_FDS, ZYGOTE_MAX_REQUEST,
};
use nix::sys::socket::{recvmsg, send, ControlMessageOwned, MsgFlags};

/// Highest descriptor number a request may ask for.
const MAX_TARGET_FD: i32 = 1024;

/// Serves fork requests until the node closes the socket.
pub fn zygote() -> Result<(), Box<dyn std::error::Error>> {
    // SAFETY: the node starts the zygote with its request socket at this number.
    let sock = unsafe { OwnedFd::from_raw_fd(ZYGOTE_FD) };
    set_child_reaping(true)?;
    let name = InitName::prepare();
    let mut buf = vec![0u8; ZYGOTE_MAX_REQUEST];
    loop {
        let (len, fds, truncated) = match receive(&sock, &mut buf) {
            Ok(r) => r,
            Err(nix::Error::EINTR) => continue,
            Err(e) => return Err(format!("receive request: {e}").into()),
        };
        if len == 0 && fds.is_empty() {
            // The node is gone (or shut us down): nothing more will come.
            return Ok(());
        }
        let reply = match parse(&buf[..len], fds.len(), truncated) {
            Ok(req) => fork_init(&req, &fds, name),
            Err(message) => ZygoteReply::Error { message },
        };
        // The child has its copies; the zygote keeps nothing of a sandbox.
        drop(fds);
        let json = serde_json::to_vec(&reply)?;
        if let Err(e) = send(sock.as_raw_fd(), &json, MsgFlags::MSG_NOSIGNAL) {
            return Err(format!("send reply: {e}").into());
        }
    }
}

/// One message: its length, its descriptors, and whether anything was cut off.
fn receive(sock: &OwnedFd, buf: &mut [u8]) -> nix::Result<(usize, Vec<OwnedFd>, bool)> {
    let mut iov = [IoSliceMut::new(buf)];
    let mut space = nix::cmsg_space!([RawFd; ZYGOTE_MAX_FDS]);
    let msg = recvmsg::<()>(
        sock.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    let mut fds = Vec::new();
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(raw) = c {
            // SAFETY: the kernel just installed these descriptors for us.
            fds.extend(
                raw.into_iter()
                    .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
            );
        }
    }
    let truncated = msg
        .flags
        .intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC);
    Ok((msg.bytes, fds, truncated))
}

/// A well-formed request whose descriptor list matches what came with it.
fn parse(bytes: &[u8], fd_count: usize, truncated: bool) -> Result<ZygoteRequest, String> {
    if truncated {
        return Err(format!(
            "request cut off: at most {ZYGOTE_MAX_REQUEST} bytes and {ZYGOTE_MAX_FDS} descriptors"
        ));
    }
    let req: ZygoteRequest =
        serde_json::from_slice(bytes).map_err(|e| format!("invalid request: {e}"))?;
    if req.fds.len() != fd_count {
        return Err(format!(
            "request names {} descriptors, {fd_count} came with it",
            req.fds.len()
        ));
    }
    let mut seen = std::collections::HashSet::new();
    for &n in &req.fds {
        if !(2..=MAX_TARGET_FD).contains(&n) || !seen.insert(n) {
            return Err(format!(
                "descriptor number {n}: numbers must be unique, 2 to {MAX_TARGET_FD}"
            ));
        }
    }
    if !seen.contains(&STATUS_FD) {
        return Err("no status pipe in the request".into());
    }
    Ok(req)
}

fn fork_init(req: &ZygoteRequest, fds: &[OwnedFd], name: InitName) -> ZygoteReply {
    // SAFETY: the zygote is single-threaded, so the child may run arbitrary code.
    match unsafe { nix::unistd::fork() } {
        Ok(nix::unistd::ForkResult::Parent { child }) => ZygoteReply::Forked {
            pid: child.as_raw(),
        },
        Ok(nix::unistd::ForkResult::Child) => {
            let code = match child(req, fds, name) {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("dsec-agent: {e}");
                    1
                }
            };
            std::process::exit(code)
        }
        Err(e) => ZygoteReply::Error {
            message: format!("fork: {e}"),
        },
    }
}

/// In the forked child: become what an exec'd init is, then run it.
fn child(
    req: &ZygoteRequest,
    fds: &[OwnedFd],
    name: InitName,
) -> Result<(), Box<dyn std::error::Error>> {
    set_child_reaping(false)?;
    name.apply();
    // Its own session, as the node gives an exec'd init.
    nix::unistd::setsid()?;
    place(fds, &req.fds)?;
    // SAFETY: `place` put the status pipe at this number; owned by init from here on.
    let status = unsafe { OwnedFd::from_raw_fd(STATUS_FD) };
    crate::init::run(&req.spec, status)
}

/// The command line an exec'd init has.
static INIT_CMDLINE: &[u8] = b"dsec-agent\0init\0";

/// `struct prctl_mm_map` (linux/prctl.h).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct PrctlMmMap {
    start_code: u64,
    end_code: u64,
    start_data: u64,
    end_data: u64,
    start_brk: u64,
    brk: u64,
    start_stack: u64,
    arg_start: u64,
    arg_end: u64,
    env_start: u64,
    env_end: u64,
    auxv: *mut u64,
    auxv_size: u32,
    exe_fd: u32,
}

/// Makes a forked child's `/proc/PID/cmdline` read `dsec-agent init`, as for an exec'd
/// init, so `ps` on the host and in the sandbox tells sandbox inits from the zygote. Uses
/// `PR_SET_MM_MAP` (which needs no capability unless the executable changes, unlike the
/// single-field `PR_SET_MM` calls), with every other field as it is. Prepared once in the
/// zygote (a child's layout is the zygote's); cosmetic: failures are ignored.
#[derive(Debug, Clone, Copy)]
struct InitName {
    map: Option<PrctlMmMap>,
}

impl InitName {
    /// Reads the zygote's layout and puts the new command line on its heap (the kernel
    /// reads command lines from anonymous memory only; every child inherits it).
    fn prepare() -> Self {
        let map = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|stat| {
                // Fields after the parenthesised command name, numbered from 3 (state).
                let (_, rest) = stat.rsplit_once(')')?;
                let fields: Vec<u64> = rest
                    .split_whitespace()
                    .map(|f| f.parse().unwrap_or(0))
                    .collect();
                let field = |n: usize| fields.get(n - 3).copied().unwrap_or(0);
                let cmdline: &'static [u8] = Box::leak(INIT_CMDLINE.to_vec().into_boxed_slice());
                let start = cmdline.as_ptr() as u64;
                Some(PrctlMmMap {
                    start_code: field(26),
                    end_code: field(27),
                    start_data: field(45),
                    end_data: field(46),
                    start_brk: field(47),
                    brk: 0,
                    start_stack: field(28),
                    arg_start: start,
                    arg_end: start + cmdline.len() as u64,
                    env_start: field(50),
                    env_end: field(51),
                    auxv: std::ptr::null_mut(),
                    auxv_size: 0,
                    exe_fd: u32::MAX,
                })
            });
        Self { map }
    }

    /// In a forked child: switch the command line (the break as it is now).
    fn apply(self) {
        const PR_SET_MM_MAP: libc::c_ulong = 14;
        let Some(mut map) = self.map else {
            return;
        };
        // SAFETY: brk(0) only reports the current break.
        map.brk = unsafe { libc::syscall(libc::SYS_brk, 0) } as u64;
        // SAFETY: PR_SET_MM_MAP reads `map` (its size passed along); the new argument
        // range was leaked, so it lives as long as the process.
        unsafe {
            libc::prctl(
                libc::PR_SET_MM,
                PR_SET_MM_MAP,
                &map as *const PrctlMmMap,
                std::mem::size_of::<PrctlMmMap>(),
                0,
            )
        };
    }
}

/// Puts `fds[i]` at number `targets[i]` and closes every other descriptor above 2 (the
/// zygote's socket among them). stdin and stdout stay the zygote's `/dev/null`.
fn place(fds: &[OwnedFd], targets: &[i32]) -> std::io::Result<()> {
    let above = targets.iter().copied().max().unwrap_or(2) + 1;
    // Copies above every target first, so no dup2 clobbers a source still to be moved.
    let mut copies = Vec::with_capacity(fds.len());
    for fd in fds {
        // SAFETY: F_DUPFD on a descriptor we own; the copy is closed below.
        let c = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD, above) };
        if c < 0 {
            return Err(std::io::Error::last_os_error());
        }
        copies.push(c);
    }
    for (&c, &n) in copies.iter().zip(targets) {
        // dup2 leaves the new number without close-on-exec, as an exec'd init has it.
        nix::unistd::dup2(c, n)?;
    }
    for n in 3..above {
        if !targets.contains(&n) {
            // SAFETY: closing numbers that are not handed to init (not open is no error).
            unsafe { libc::close(n) };
        }
    }
    // SAFETY: closes every descriptor from `above` up, the originals and copies included.
    // None is used again: the child leaves through `process::exit`, so the zygote's
    // OwnedFds are never dropped here.
    unsafe {
        libc::syscall(
            libc::SYS_close_range,
            above as libc::c_uint,
            libc::c_uint::MAX,
            0,
        )
    };
    Ok(())
}

/// With `on`, exited children are reaped by the kernel (no zombies, no waiting);
/// without, SIGCHLD is back to its default.
fn set_child_reaping(on: bool) -> std::io::Result<()> {
    let flags = if on { libc::SA_NOCLDWAIT } else { 0 };
    crate::signals::set_default(libc::SIGCHLD, flags)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec_json() -> serde_json::Value {
        serde_json::json!({
            "sandbox_id": "t", "lower_dirs": [], "upper_dir": "/u", "work_dir": "/w",
            "rootfs": "/r", "cgroup_procs": [], "env": {}, "workdir": "/"
        })
    }

    #[test]
    fn requests_are_checked_before_anything_forks() {
        let req = |fds: serde_json::Value| {
            serde_json::to_vec(&serde_json::json!({"fds": fds, "spec": spec_json()})).expect("json")
        };
        assert!(parse(&req(serde_json::json!([3, 4, 2])), 3, false).is_ok());
        let err = |b: &[u8], n, t| parse(b, n, t).expect_err("refused");
        assert!(err(&req(serde_json::json!([3, 4])), 3, false).contains("2 descriptors, 3"));
        assert!(err(&req(serde_json::json!([3, 3, 4])), 3, false).contains("unique"));
        assert!(err(&req(serde_json::json!([1, 4])), 2, false).contains("number 1"));
        assert!(err(&req(serde_json::json!([4, 5000])), 2, false).contains("5000"));
        assert!(err(&req(serde_json::json!([3])), 1, false).contains("status pipe"));
        assert!(err(&req(serde_json::json!([3, 4])), 2, true).contains("cut off"));
        assert!(err(b"{", 0, false).contains("invalid request"));
    }
}

//! The call helper and each call's PID 1.
//!
//! The helper is forked by init before init drops its privileges (`init.rs`), so it keeps
//! `CAP_SYS_ADMIN` over the sandbox's own user namespace, which a call needs to make its
//! namespaces and mounts. It holds nothing but its socket to the agent, is not dumpable
//! (nothing in the sandbox can trace it or read its memory), stays single-threaded, and
//! for each request clones a call's PID 1 into new mount, PID and IPC namespaces. That
//! process ([`call_init`]) builds the call's view ([`dsec_container::callroot`]), drops
//! privileges exactly as the sandbox's init does, writes the input files, runs the
//! command, and when the command ends kills everything else in its namespace, reads the
//! files asked for and reports on the result pipe. Its exit takes the namespaces, and
//! with them every trace of the call, away.

use std::collections::BTreeMap;
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::Instant;

use dsec_wire::agent::FetchedFile;
use dsec_wire::Base64Bytes;
use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use serde::{Deserialize, Serialize};

use crate::sys;

/// Descriptors of one call, in the order they travel: setup pipe (read end), result
/// pipe (write end), the command's stdin (read end), stdout and stderr (write ends).
pub const CALL_FDS: usize = 5;

/// Most bytes of a call's setup (its input files ride in it).
const SETUP_LIMIT: u64 = 16 * 1024 * 1024;

/// What the agent tells a call's PID 1, on the setup pipe (JSON).
#[derive(Debug, Serialize, Deserialize)]
pub struct CallSetup {
    /// Program and arguments.
    pub argv: Vec<String>,
    /// The whole environment.
    pub env: BTreeMap<String, String>,
    /// Absolute working directory.
    pub cwd: String,
    /// Who runs it: uid, gid, supplementary groups (`None`: root).
    pub user: Option<(u32, u32, Vec<u32>)>,
    /// Files to write first: absolute path and bytes.
    pub files: Vec<(String, Base64Bytes)>,
    /// Files to read back: the key the caller used and the absolute path.
    pub fetch: Vec<(String, String)>,
    /// Most bytes read back together.
    pub fetch_limit: u64,
    /// `RLIMIT_AS` of the command, bytes.
    pub memory_limit: Option<u64>,
}

/// What a call's PID 1 reports on the result pipe (JSON).
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct CallOutcome {
    /// The command's exit code.
    pub exit_code: Option<i32>,
    /// The signal that killed it.
    pub signal: Option<i32>,
    /// The command never started (see [`dsec_wire::agent::CallResult::setup_error`]).
    pub setup_error: Option<String>,
    /// The sandbox should be replaced.
    pub anomaly: Option<String>,
    /// Files read back.
    pub files: BTreeMap<String, FetchedFile>,
    /// From the clone to the command's start, microseconds.
    pub setup_us: u64,
    /// From the command's end to every other process of the call reaped, microseconds.
    pub reap_us: u64,
}

/// Forks the call helper. Call it while the process is single-threaded (the child runs
/// arbitrary code) and still privileged. Returns the agent's end of its socket.
pub fn start() -> std::io::Result<OwnedFd> {
    let (agent_end, helper_end) = nix::sys::socket::socketpair(
        nix::sys::socket::AddressFamily::Unix,
        nix::sys::socket::SockType::SeqPacket,
        None,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
    )?;
    // SAFETY: the caller guarantees a single thread, so the child may run anything.
    match unsafe { nix::unistd::fork() }? {
        nix::unistd::ForkResult::Parent { .. } => Ok(agent_end),
        nix::unistd::ForkResult::Child => {
            drop(agent_end);
            let code = match serve(helper_end) {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("dsec-agent call helper: {e}");
                    1
                }
            };
            std::process::exit(code)
        }
    }
}

/// Sets SIGCHLD's disposition: `auto_reap` makes the kernel reap children (the helper's
/// calls); otherwise the default (a call's PID 1 waits for its own).
fn child_reaping(auto_reap: bool) -> std::io::Result<()> {
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
    let flags = if auto_reap {
        SaFlags::SA_NOCLDWAIT
    } else {
        SaFlags::empty()
    };
    let action = SigAction::new(SigHandler::SigDfl, flags, SigSet::empty());
    // SAFETY: installing the default disposition runs no handler code.
    unsafe { sigaction(Signal::SIGCHLD, &action) }
        .map(drop)
        .map_err(std::io::Error::from)
}

/// Whether this process runs in a user namespace other than the host's.
fn in_user_namespace() -> bool {
    std::fs::read_to_string("/proc/self/uid_map")
        .map(|m| m.split_whitespace().collect::<Vec<_>>() != ["0", "0", "4294967295"])
        .unwrap_or(true)
}

/// The helper's loop: one clone per request until the agent closes its end.
fn serve(sock: OwnedFd) -> Result<(), Box<dyn std::error::Error>> {
    let keep = sock.as_raw_fd();
    // Nothing of init's but the socket: not the agent's listener, not the status pipe.
    // SAFETY: close_range on descriptor ranges that exclude the one kept.
    unsafe {
        libc::syscall(libc::SYS_close_range, 3, (keep - 1).max(2), 0);
        libc::syscall(libc::SYS_close_range, keep + 1, libc::c_uint::MAX, 0);
        libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
        libc::prctl(libc::PR_SET_NAME, c"dsec-callhelper".as_ptr(), 0, 0, 0);
    }
    child_reaping(true)?;
    let userns = in_user_namespace();
    let mut byte = [0u8; 1];
    loop {
        let fds = {
            let mut iov = [IoSliceMut::new(&mut byte)];
            let mut space = nix::cmsg_space!([RawFd; CALL_FDS]);
            let msg = match recvmsg::<()>(
                sock.as_raw_fd(),
                &mut iov,
                Some(&mut space),
                MsgFlags::MSG_CMSG_CLOEXEC,
            ) {
                Ok(m) => m,
                Err(nix::Error::EINTR) => continue,
                Err(e) => return Err(format!("receive: {e}").into()),
            };
            let mut fds: Vec<OwnedFd> = Vec::new();
            for c in msg.cmsgs()? {
                if let ControlMessageOwned::ScmRights(raw) = c {
                    // SAFETY: descriptors just received are ours alone.
                    fds.extend(
                        raw.into_iter()
                            .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                    );
                }
            }
            if msg.bytes == 0 && fds.is_empty() {
                return Ok(()); // the agent is gone
            }
            fds
        };
        let reply: i32 = match <[OwnedFd; CALL_FDS]>::try_from(fds) {
            Err(_) => -libc::EINVAL,
            Ok(fds) => {
                let flags = libc::CLONE_NEWNS | libc::CLONE_NEWPID | libc::CLONE_NEWIPC;
                // SAFETY: a fork-like clone (no new stack, no shared memory) of a
                // single-threaded process: the child may run anything.
                let pid = unsafe {
                    libc::syscall(
                        libc::SYS_clone,
                        (flags | libc::SIGCHLD) as libc::c_ulong,
                        0,
                        0,
                        0,
                        0,
                    )
                };
                if pid == 0 {
                    drop(sock);
                    call_init(fds, userns)
                }
                if pid < 0 {
                    -std::io::Error::last_os_error()
                        .raw_os_error()
                        .unwrap_or(libc::EIO)
                } else {
                    pid as i32
                }
            }
        };
        if let Err(e) = sendmsg::<()>(
            sock.as_raw_fd(),
            &[IoSlice::new(&reply.to_le_bytes())],
            &[],
            MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            return Err(format!("reply: {e}").into());
        }
    }
}

/// Asks the helper (at `sock`) to start a call with `fds` (see [`CALL_FDS`]); returns the
/// call's PID 1 as the agent sees it. Blocks for the helper's clone (a fraction of a ms).
pub fn request(sock: &OwnedFd, fds: [RawFd; CALL_FDS]) -> std::io::Result<i32> {
    let cmsg = [ControlMessage::ScmRights(&fds)];
    sendmsg::<()>(
        sock.as_raw_fd(),
        &[IoSlice::new(&[1u8])],
        &cmsg,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )?;
    let mut buf = [0u8; 4];
    let n = loop {
        match nix::sys::socket::recv(sock.as_raw_fd(), &mut buf, MsgFlags::empty()) {
            Err(nix::Error::EINTR) => continue,
            other => break other?,
        }
    };
    if n != 4 {
        return Err(std::io::Error::other("the call helper is gone"));
    }
    let pid = i32::from_le_bytes(buf);
    if pid <= 0 {
        return Err(std::io::Error::from_raw_os_error(-pid));
    }
    Ok(pid)
}

/// The call's PID 1: runs the call and reports; never returns.
fn call_init(fds: [OwnedFd; CALL_FDS], userns: bool) -> ! {
    let started = Instant::now();
    let [setup, result, stdin, stdout, stderr] = fds;
    let mut outcome = CallOutcome::default();
    if let Err(anomaly) = run_call(
        &mut outcome,
        setup,
        [stdin, stdout, stderr],
        userns,
        started,
    ) {
        outcome.anomaly = Some(anomaly);
    }
    let mut result = std::fs::File::from(result);
    let _ = serde_json::to_vec(&outcome).map(|json| result.write_all(&json));
    drop(result);
    // SAFETY: ending the process without running anything else of the helper's.
    unsafe { libc::_exit(0) }
}

/// Runs the call. An `Err` is an anomaly (the sandbox itself misbehaves); mistakes of
/// the call's own go to `outcome.setup_error`.
fn run_call(
    outcome: &mut CallOutcome,
    setup: OwnedFd,
    stdio: [OwnedFd; 3],
    userns: bool,
    started: Instant,
) -> Result<(), String> {
    child_reaping(false).map_err(|e| format!("SIGCHLD: {e}"))?;
    let mut raw = Vec::new();
    std::fs::File::from(setup)
        .take(SETUP_LIMIT)
        .read_to_end(&mut raw)
        .map_err(|e| format!("reading the call's setup: {e}"))?;
    let setup: CallSetup =
        serde_json::from_slice(&raw).map_err(|e| format!("the call's setup: {e}"))?;
    dsec_container::callroot::enter(userns).map_err(|e| format!("call root: {e}"))?;
    dsec_container::harden::apply().map_err(|e| format!("dropping privileges: {e}"))?;
    if let Err(e) = write_files(&setup) {
        outcome.setup_error = Some(e);
        return Ok(());
    }
    let [stdin, stdout, stderr] = stdio;
    let Some(program) = setup.argv.first() else {
        outcome.setup_error = Some("empty command".into());
        return Ok(());
    };
    let mut cmd = Command::new(program);
    cmd.args(&setup.argv[1..])
        .env_clear()
        .envs(&setup.env)
        .current_dir(&setup.cwd)
        .stdin(Stdio::from(stdin))
        .stdout(Stdio::from(stdout))
        .stderr(Stdio::from(stderr));
    let user = setup.user.clone();
    let memory = setup.memory_limit;
    // SAFETY: the hook runs only async-signal-safe system calls on data allocated before
    // the fork.
    unsafe {
        cmd.pre_exec(move || {
            if let Some(bytes) = memory {
                let lim = libc::rlimit {
                    rlim_cur: bytes,
                    rlim_max: bytes,
                };
                if libc::setrlimit(libc::RLIMIT_AS, &lim) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            sys::try_write(
                c"/proc/self/oom_score_adj",
                crate::spawn::COMMAND_OOM_SCORE_ADJ.as_bytes(),
            );
            if let Some((uid, gid, groups)) = &user {
                sys::switch_user(*uid, *gid, groups)?;
            }
            Ok(())
        });
    }
    let child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            outcome.setup_error = Some(format!("starting {program} in {}: {e}", setup.cwd));
            return Ok(());
        }
    };
    // Only the command holds the call's pipes now.
    drop(cmd);
    outcome.setup_us = started.elapsed().as_micros() as u64;
    let main = child.id() as i32;
    loop {
        let mut status = 0;
        // SAFETY: waitpid with a valid status pointer.
        let pid = unsafe { libc::waitpid(-1, &mut status, 0) };
        if pid == main {
            if libc::WIFEXITED(status) {
                outcome.exit_code = Some(libc::WEXITSTATUS(status));
            } else if libc::WIFSIGNALED(status) {
                outcome.signal = Some(libc::WTERMSIG(status));
            }
            break;
        }
        if pid < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return Err("the call's command was not found among its children".into());
        }
    }
    let ended = Instant::now();
    // Everything else of the call: as PID 1 of its namespace, kill(-1) reaches exactly
    // the call's other processes; orphans are re-parented here, so waiting until no
    // child is left means none is.
    // SAFETY: plain system calls.
    unsafe {
        libc::kill(-1, libc::SIGKILL);
        loop {
            let pid = libc::waitpid(-1, std::ptr::null_mut(), 0);
            if pid < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                break;
            }
        }
    }
    outcome.reap_us = ended.elapsed().as_micros() as u64;
    fetch_files(&setup, outcome);
    Ok(())
}

/// Writes the call's input files (parents created, owned by the call's user).
fn write_files(setup: &CallSetup) -> Result<(), String> {
    use std::os::unix::fs::chown;
    for (path, data) in &setup.files {
        let p = std::path::Path::new(path);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| format!("creating {}: {e}", parent.display()))?;
        }
        std::fs::write(p, &data.0).map_err(|e| format!("writing {path}: {e}"))?;
        if let Some((uid, gid, _)) = &setup.user {
            chown(p, Some(*uid), Some(*gid)).map_err(|e| format!("chown {path}: {e}"))?;
        }
    }
    Ok(())
}

/// Reads the files asked for: regular files only (a FIFO would block, a device never
/// end), at most `fetch_limit` bytes together.
fn fetch_files(setup: &CallSetup, outcome: &mut CallOutcome) {
    use std::os::unix::fs::OpenOptionsExt;
    let mut left = setup.fetch_limit;
    for (key, path) in &setup.fetch {
        let read = || -> Result<Vec<u8>, String> {
            let f = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
                .open(path)
                .map_err(|e| e.to_string())?;
            let meta = f.metadata().map_err(|e| e.to_string())?;
            if !meta.is_file() {
                return Err("not a regular file".into());
            }
            if meta.len() > left {
                return Err(format!(
                    "{} bytes: over what is left of the {} byte limit of fetched files",
                    meta.len(),
                    setup.fetch_limit
                ));
            }
            let mut data = Vec::new();
            f.take(left + 1)
                .read_to_end(&mut data)
                .map_err(|e| e.to_string())?;
            if data.len() as u64 > left {
                return Err("grew past the limit of fetched files".into());
            }
            Ok(data)
        };
        let entry = match read() {
            Ok(data) => {
                left -= data.len() as u64;
                FetchedFile {
                    data: Some(Base64Bytes(data)),
                    error: None,
                }
            }
            Err(e) => FetchedFile {
                data: None,
                error: Some(e),
            },
        };
        outcome.files.insert(key.clone(), entry);
    }
}

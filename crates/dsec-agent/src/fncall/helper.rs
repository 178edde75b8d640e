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
    /// The command's timeout, ms.
    pub timeout_ms: u64,
    /// The compile step: argv and timeout (ms).
    pub compile: Option<(Vec<String>, u64)>,
    /// Output kept of the compile step, per stream.
    pub compile_output_limit: usize,
}

/// What a call's PID 1 reports on the result pipe (JSON).
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct CallOutcome {
    /// The compile step, if any.
    pub compile: Option<CompiledStep>,
    /// Whether the command ran.
    pub ran: bool,
    /// How the command ended.
    pub run: StepEnd,
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

/// How long the agent waits on the helper (sending a request, or for its answer): a
/// helper stopped or stuck must not hang the agent's one thread.
const HELPER_TIMEOUT_S: i64 = 5;

/// Forks the call helper. Call it while the process is single-threaded (the child runs
/// arbitrary code) and still privileged. Returns the agent's end of its socket.
pub fn start() -> std::io::Result<OwnedFd> {
    use nix::sys::socket::{setsockopt, sockopt};
    let (agent_end, helper_end) = nix::sys::socket::socketpair(
        nix::sys::socket::AddressFamily::Unix,
        nix::sys::socket::SockType::SeqPacket,
        None,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
    )?;
    let limit = nix::sys::time::TimeVal::new(HELPER_TIMEOUT_S, 0);
    setsockopt(&agent_end, sockopt::ReceiveTimeout, &limit)?;
    setsockopt(&agent_end, sockopt::SendTimeout, &limit)?;
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
    outcome.setup_us = started.elapsed().as_micros() as u64;
    if let Some((argv, timeout_ms)) = &setup.compile {
        let out = memfd(c"compile-stdout")?;
        let err = memfd(c"compile-stderr")?;
        let stdio = [
            Stdio::null(),
            Stdio::from(out.try_clone().map_err(|e| e.to_string())?),
            Stdio::from(err.try_clone().map_err(|e| e.to_string())?),
        ];
        let limits = Limits {
            memory: setup.memory_limit,
            file_size: Some(COMPILE_FILE_SIZE),
        };
        let end = match run_step(&setup, argv, stdio, *timeout_ms, limits)? {
            Ok(end) => end,
            Err(e) => {
                outcome.setup_error = Some(e);
                return Ok(());
            }
        };
        let ok = end.exit_code == Some(0) && !end.timed_out;
        outcome.compile = Some(CompiledStep {
            end,
            stdout: Base64Bytes(tail(out, setup.compile_output_limit)),
            stderr: Base64Bytes(tail(err, setup.compile_output_limit)),
        });
        if !ok {
            return Ok(());
        }
    }
    let [stdin, stdout, stderr] = stdio;
    let stdio = [Stdio::from(stdin), Stdio::from(stdout), Stdio::from(stderr)];
    let limits = Limits {
        memory: setup.memory_limit,
        file_size: None,
    };
    match run_step(&setup, &setup.argv, stdio, setup.timeout_ms, limits)? {
        Ok(end) => {
            outcome.ran = true;
            outcome.reap_us = end.reap_us;
            outcome.run = end;
        }
        Err(e) => {
            outcome.setup_error = Some(e);
            return Ok(());
        }
    }
    if !outcome.run.timed_out {
        fetch_files(&setup, outcome);
    }
    Ok(())
}

/// Largest file a compile step may write (its output, the program it makes).
const COMPILE_FILE_SIZE: u64 = 256 * 1024 * 1024;

/// Resource limits of a step's processes.
#[derive(Debug, Clone, Copy)]
struct Limits {
    /// `RLIMIT_AS`, bytes.
    memory: Option<u64>,
    /// `RLIMIT_FSIZE`, bytes.
    file_size: Option<u64>,
}

/// How one step of a call ended.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct StepEnd {
    /// Exit code, when it exited.
    pub exit_code: Option<i32>,
    /// The signal that ended it.
    pub signal: Option<i32>,
    /// Its timeout killed it.
    pub timed_out: bool,
    /// Wall time, ms.
    pub duration_ms: u64,
    /// From its end to every other process of the call reaped, microseconds.
    pub reap_us: u64,
}

/// A compile step's end and output.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct CompiledStep {
    /// How it ended.
    pub end: StepEnd,
    /// The last bytes of its stdout.
    pub stdout: Base64Bytes,
    /// The last bytes of its stderr.
    pub stderr: Base64Bytes,
}

fn memfd(name: &std::ffi::CStr) -> Result<std::fs::File, String> {
    // SAFETY: memfd_create with a valid C string; the new fd is ours alone.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(format!("memfd: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: as above.
    Ok(std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// The last `limit` bytes of `f`.
fn tail(mut f: std::fs::File, limit: usize) -> Vec<u8> {
    use std::io::Seek;
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let from = len.saturating_sub(limit as u64);
    let mut out = Vec::new();
    if f.seek(std::io::SeekFrom::Start(from)).is_ok() {
        let _ = f.take(limit as u64).read_to_end(&mut out);
    }
    out
}

/// Kills every other process of the call's PID namespace and reaps them all: as its
/// PID 1, kill(-1) reaches exactly the call's processes, and orphans are re-parented
/// here, so once no child is left none is.
fn kill_all_and_reap() {
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
}

/// Runs `argv` to its end or its timeout, then kills what is left of the call. The outer
/// `Err` is an anomaly; the inner one, a step that could not start.
fn run_step(
    setup: &CallSetup,
    argv: &[String],
    stdio: [Stdio; 3],
    timeout_ms: u64,
    limits: Limits,
) -> Result<Result<StepEnd, String>, String> {
    let Some(program) = argv.first() else {
        return Ok(Err("empty command".into()));
    };
    let started = Instant::now();
    let [stdin, stdout, stderr] = stdio;
    let mut cmd = Command::new(program);
    cmd.args(&argv[1..])
        .env_clear()
        .envs(&setup.env)
        .current_dir(&setup.cwd)
        .stdin(stdin)
        .stdout(stdout)
        .stderr(stderr);
    let user = setup.user.clone();
    // SAFETY: the hook runs only async-signal-safe system calls on data allocated before
    // the fork.
    unsafe {
        cmd.pre_exec(move || {
            for (resource, value) in [
                (libc::RLIMIT_AS, limits.memory),
                (libc::RLIMIT_FSIZE, limits.file_size),
            ] {
                if let Some(v) = value {
                    let lim = libc::rlimit {
                        rlim_cur: v,
                        rlim_max: v,
                    };
                    if libc::setrlimit(resource, &lim) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
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
        Err(e) => return Ok(Err(format!("starting {program} in {}: {e}", setup.cwd))),
    };
    // Only the step holds its pipes now.
    drop(cmd);
    let main = child.id() as i32;
    // SAFETY: pidfd_open with integer arguments; the child is not reaped yet.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, main, 0) } as i32;
    if pidfd < 0 {
        let e = std::io::Error::last_os_error();
        kill_all_and_reap();
        return Err(format!("pidfd of the call's command: {e}"));
    }
    // SAFETY: a new descriptor, ours alone.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    let deadline = started + std::time::Duration::from_millis(timeout_ms);
    let mut end = StepEnd::default();
    'wait: loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            end.timed_out = true;
            end.signal = Some(libc::SIGKILL);
            break;
        }
        let mut pfd = libc::pollfd {
            fd: pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // Wakes at the command's end, or every 100 ms to reap the call's other exited
        // processes, which are re-parented here.
        let ms = left.as_millis().clamp(1, 100) as i32;
        // SAFETY: poll on one valid pollfd.
        unsafe { libc::poll(&mut pfd, 1, ms) };
        loop {
            let mut status = 0;
            // SAFETY: waitpid with a valid status pointer.
            let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
            if pid <= 0 {
                break;
            }
            if pid == main {
                if libc::WIFEXITED(status) {
                    end.exit_code = Some(libc::WEXITSTATUS(status));
                } else if libc::WIFSIGNALED(status) {
                    end.signal = Some(libc::WTERMSIG(status));
                }
                break 'wait;
            }
        }
    }
    let ended = Instant::now();
    kill_all_and_reap();
    end.reap_us = ended.elapsed().as_micros() as u64;
    end.duration_ms = started.elapsed().as_millis() as u64;
    Ok(Ok(end))
}

/// Creates the missing directories of `dir`, each owned by the call's user (so that
/// a call that is not root may write where its files were put).
fn create_parents(dir: &std::path::Path, user: Option<(u32, u32)>) -> Result<(), String> {
    if dir.as_os_str().is_empty() || dir.exists() {
        return Ok(());
    }
    if let Some(parent) = dir.parent() {
        create_parents(parent, user)?;
    }
    match std::fs::create_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Ok(()),
        Err(e) => return Err(format!("creating {}: {e}", dir.display())),
    }
    if let Some((uid, gid)) = user {
        std::os::unix::fs::chown(dir, Some(uid), Some(gid))
            .map_err(|e| format!("chown {}: {e}", dir.display()))?;
    }
    Ok(())
}

/// Writes the call's input files (parents created, owned by the call's user).
fn write_files(setup: &CallSetup) -> Result<(), String> {
    use std::os::unix::fs::chown;
    let owner = setup.user.as_ref().map(|(uid, gid, _)| (*uid, *gid));
    for (path, data) in &setup.files {
        let p = std::path::Path::new(path);
        if let Some(parent) = p.parent() {
            create_parents(parent, owner)?;
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

//! `Call`: function calls (FnCall), each in a throw-away view of the sandbox.
//!
//! A sandbox created for calls has a call helper ([`helper`]) next to the agent. For each
//! call the agent hands the helper five pipes; the helper clones the call's PID 1 into new
//! namespaces, which builds the view, runs the command and reports on the result pipe.
//! The agent feeds stdin and the setup, keeps the last bytes of the output like an exec,
//! enforces the timeout by killing the call's PID 1 (the kernel then kills everything in
//! its PID namespace), and waits on a pidfd until that process is gone: only then is the
//! namespace empty and the call over. What the call left (files, processes, IPC objects,
//! environment) cannot reach the next one, so there is no reset step to get wrong; what
//! is measured as the reset is that teardown.

pub mod helper;

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::rc::Rc;
use std::time::{Duration, Instant};

use dsec_wire::agent::{
    CallResult, CallSpec, CompileResult, ExitInfo, Reply, CALL_FETCH_LIMIT, CALL_INPUT_LIMIT,
    CALL_OUTPUT_LIMIT,
};
use dsec_wire::{ApiError, Base64Bytes};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::mpsc;

use crate::conn::DataKind;
use crate::error::bad_request;
use crate::exec::{pipe_reader, TaskGuard};
use crate::fdio::{FdReader, FdWriter};
use crate::ring::Ring;
use crate::server::Agent;
use crate::spawn::{identity_env, resolve_cwd, switch_to};
use crate::sys;

/// Longest a call may ask for.
pub const MAX_CALL_TIMEOUT_MS: u64 = 24 * 3600 * 1000;

/// How long a killed call's PID 1 may take to be gone before the sandbox is reported as
/// misbehaving (something in its namespace would not die).
const TEARDOWN_LIMIT: Duration = Duration::from_secs(5);

/// How long past its timeouts a call's PID 1 may take before the agent kills it.
const BACKSTOP_GRACE_MS: u64 = 2000;

/// Most bytes of a call's report (its fetched files ride in it, base64).
const RESULT_LIMIT: usize = 4 * 1024 * 1024;

/// The agent's end of the call helper's socket.
#[derive(Debug)]
pub struct CallHelper(pub OwnedFd);

/// Handles a `Call` request.
pub async fn call(agent: &Rc<Agent>, spec: CallSpec) -> Reply {
    match run(agent, spec).await {
        Ok(result) => Reply::Called(result),
        Err(e) => Reply::Error(e),
    }
}

fn absolute(cwd: &std::path::Path, path: &str) -> Result<String, ApiError> {
    if path.is_empty() || path.contains('\0') {
        return Err(bad_request(format!("invalid file path {path:?}")));
    }
    Ok(cwd.join(path).display().to_string())
}

async fn run(agent: &Rc<Agent>, spec: CallSpec) -> Result<CallResult, ApiError> {
    let Some(helper) = agent.cfg.call_helper.as_ref() else {
        return Err(bad_request(
            "this sandbox does not serve function calls (create it in a pool with fncall)",
        ));
    };
    if agent.cfg.landlock.is_some() {
        // Calls do not apply the sandbox's Landlock rules: refuse rather than bypass them.
        return Err(bad_request(
            "this sandbox has filesystem rules, which function calls do not support",
        ));
    }
    let argv = spec.cmd.to_argv();
    if argv.first().is_none_or(|p| p.is_empty()) {
        return Err(bad_request("empty command"));
    }
    let compile_ms = spec.compile.as_ref().map_or(0, |c| c.timeout_ms);
    for ms in [
        Some(spec.timeout_ms),
        spec.compile.as_ref().map(|c| c.timeout_ms),
    ]
    .into_iter()
    .flatten()
    {
        if ms == 0 || ms > MAX_CALL_TIMEOUT_MS {
            return Err(bad_request(format!(
                "timeouts must be within 1..={MAX_CALL_TIMEOUT_MS} ms"
            )));
        }
    }
    if spec
        .compile
        .as_ref()
        .is_some_and(|c| c.cmd.to_argv().first().is_none_or(|p| p.is_empty()))
    {
        return Err(bad_request("empty compile command"));
    }
    let input: usize = spec.stdin.as_ref().map_or(0, Base64Bytes::len)
        + spec.files.values().map(Base64Bytes::len).sum::<usize>();
    if input > CALL_INPUT_LIMIT {
        return Err(bad_request(format!(
            "stdin and files carry {input} bytes; a call takes at most {CALL_INPUT_LIMIT}"
        )));
    }
    let identity = agent.cfg.identity(spec.user.as_deref())?;
    let mut env = agent.cfg.default_env.clone();
    for (k, v) in identity_env(identity.as_ref()) {
        env.insert(k.to_string(), v);
    }
    env.extend(spec.env.clone());
    let cwd = resolve_cwd(&agent.cfg, spec.cwd.as_deref());
    let mut files = Vec::with_capacity(spec.files.len());
    for (path, data) in &spec.files {
        files.push((absolute(&cwd, path)?, data.clone()));
    }
    let mut fetch = Vec::with_capacity(spec.fetch.len());
    for path in &spec.fetch {
        fetch.push((path.clone(), absolute(&cwd, path)?));
    }
    let setup = helper::CallSetup {
        argv,
        env,
        cwd: cwd.display().to_string(),
        user: switch_to(identity.as_ref()),
        files,
        fetch,
        fetch_limit: CALL_FETCH_LIMIT,
        memory_limit: spec.memory_limit_bytes,
        timeout_ms: spec.timeout_ms,
        compile: spec
            .compile
            .as_ref()
            .map(|c| (c.cmd.to_argv(), c.timeout_ms)),
        compile_output_limit: (CALL_OUTPUT_LIMIT / 4) as usize,
    };
    let setup = serde_json::to_vec(&setup).map_err(|e| crate::error::internal(e.to_string()))?;
    let limit = spec
        .output_limit
        .unwrap_or(CALL_OUTPUT_LIMIT)
        .min(CALL_OUTPUT_LIMIT) as usize;

    let started = Instant::now();
    let io = |e: std::io::Error| crate::error::internal(format!("call pipes: {e}"));
    let (setup_r, setup_w) = sys::pipe().map_err(io)?;
    let (result_r, result_w) = sys::pipe().map_err(io)?;
    let (stdin_r, stdin_w) = sys::pipe().map_err(io)?;
    let (out_r, out_w) = sys::pipe().map_err(io)?;
    let (err_r, err_w) = sys::pipe().map_err(io)?;
    let pid = match helper::request(
        &helper.0,
        [
            setup_r.as_raw_fd(),
            result_w.as_raw_fd(),
            stdin_r.as_raw_fd(),
            out_w.as_raw_fd(),
            err_w.as_raw_fd(),
        ],
    ) {
        Ok(pid) => pid,
        Err(e) => {
            return Ok(CallResult {
                anomaly: Some(format!("the call helper did not start the call: {e}")),
                ..CallResult::default()
            })
        }
    };
    drop((setup_r, result_w, stdin_r, out_w, err_w));
    // The call's PID 1 waits for its setup, so it is alive here and the pidfd is its.
    // SAFETY: pidfd_open with integer arguments.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if raw < 0 {
        let e = std::io::Error::last_os_error();
        let _ = sys::kill(pid, libc::SIGKILL);
        return Ok(CallResult {
            anomaly: Some(format!("pidfd of the call: {e}")),
            ..CallResult::default()
        });
    }
    // SAFETY: a new descriptor, ours alone.
    let pidfd = unsafe { OwnedFd::from_raw_fd(raw as i32) };
    let kill = |pidfd: &OwnedFd| {
        // SAFETY: pidfd_send_signal on a pidfd we own.
        unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                pidfd.as_raw_fd(),
                libc::SIGKILL,
                0,
                0,
            )
        };
    };
    let guard = KillOnDrop(Some(pidfd));

    let mut tasks = TaskGuard::default();
    let (tx, mut rx) = mpsc::channel::<(DataKind, Vec<u8>)>(8);
    tasks
        .0
        .push(pipe_reader(out_r, DataKind::Stdout, tx.clone()).map_err(io)?);
    tasks
        .0
        .push(pipe_reader(err_r, DataKind::Stderr, tx).map_err(io)?);
    let setup_w = FdWriter::new(setup_w).map_err(io)?;
    tasks.0.push(tokio::task::spawn_local(async move {
        let _ = setup_w.write_all(&setup).await;
    }));
    let stdin = spec.stdin.map(|b| b.0).unwrap_or_default();
    let stdin_w = FdWriter::new(stdin_w).map_err(io)?;
    tasks.0.push(tokio::task::spawn_local(async move {
        let _ = stdin_w.write_all(&stdin).await;
    }));
    let result_r = FdReader::new(result_r).map_err(io)?;
    let report = async {
        let mut all = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match result_r.read(&mut buf).await {
                Ok(0) | Err(_) => return all,
                Ok(n) => {
                    if all.len() + n > RESULT_LIMIT {
                        return all;
                    }
                    all.extend_from_slice(&buf[..n]);
                }
            }
        }
    };
    tokio::pin!(report);
    let ring = || Ring::with_budget(limit, agent.output.clone());
    let (mut out, mut err) = (ring(), ring());
    // The call's PID 1 enforces the timeouts; this is the backstop for one that hangs.
    let deadline = tokio::time::sleep(Duration::from_millis(
        spec.timeout_ms + compile_ms + BACKSTOP_GRACE_MS,
    ));
    tokio::pin!(deadline);
    let mut timed_out = false;
    let mut readers_done = false;
    let mut report_bytes = None;
    while report_bytes.is_none() {
        tokio::select! {
            msg = rx.recv(), if !readers_done => match msg {
                Some((kind, data)) => {
                    agent.room_for_output(data.len());
                    if kind == DataKind::Stdout { out.push(&data) } else { err.push(&data) }
                }
                None => readers_done = true,
            },
            bytes = &mut report => report_bytes = Some(bytes),
            () = &mut deadline, if !timed_out => {
                timed_out = true;
                if let Some(fd) = &guard.0 { kill(fd) }
            }
        }
    }
    let ended = Instant::now();
    // The report comes at the very end (or the pipe closes when PID 1 dies): wait for
    // PID 1 to be gone, which the kernel allows only once its namespace is empty.
    let gone = match &guard.0 {
        Some(fd) => wait_exit(fd).await,
        None => true,
    };
    let teardown = ended.elapsed();
    let mut guard = guard;
    if gone {
        guard.0 = None;
    }
    // Every writer is gone with the namespace: the rest of the output is buffered.
    while !readers_done {
        match tokio::time::timeout(Duration::from_secs(1), rx.recv()).await {
            Ok(Some((kind, data))) => {
                if kind == DataKind::Stdout {
                    out.push(&data)
                } else {
                    err.push(&data)
                }
            }
            _ => readers_done = true,
        }
    }
    drop(tasks);
    let outcome: helper::CallOutcome = match report_bytes.as_deref() {
        Some(b) if !b.is_empty() => {
            serde_json::from_slice(b).unwrap_or_else(|e| helper::CallOutcome {
                anomaly: Some(format!("unreadable call report: {e}")),
                ..Default::default()
            })
        }
        _ if timed_out => helper::CallOutcome {
            ran: true,
            run: helper::StepEnd {
                signal: Some(libc::SIGKILL),
                timed_out: true,
                duration_ms: started.elapsed().as_millis() as u64,
                ..Default::default()
            },
            ..Default::default()
        },
        _ => helper::CallOutcome {
            anomaly: Some("the call's PID 1 died without a report".into()),
            ..Default::default()
        },
    };
    let mut anomaly = outcome.anomaly;
    if !gone {
        anomaly.get_or_insert_with(|| "a process of the call outlived it".into());
    }
    let run = outcome.run;
    let timed_out = timed_out || run.timed_out;
    let compile = outcome.compile.map(|c| CompileResult {
        exit: ExitInfo {
            exit_code: c.end.exit_code,
            signal: c.end.signal,
            duration_ms: c.end.duration_ms,
            timed_out: c.end.timed_out,
            stdout_bytes: c.stdout.len() as u64,
            stderr_bytes: c.stderr.len() as u64,
            ..ExitInfo::default()
        },
        stdout: c.stdout,
        stderr: c.stderr,
    });
    let mut result = CallResult {
        compile,
        ran: outcome.ran,
        exit: ExitInfo {
            exit_code: if timed_out { None } else { run.exit_code },
            signal: if timed_out {
                Some(libc::SIGKILL)
            } else {
                run.signal
            },
            duration_ms: if outcome.ran { run.duration_ms } else { 0 },
            timed_out,
            stdout_bytes: out.total(),
            stderr_bytes: err.total(),
            stdout_truncated: out.truncated(),
            stderr_truncated: err.truncated(),
        },
        stdout: Base64Bytes(ring_bytes(&out)),
        stderr: Base64Bytes(ring_bytes(&err)),
        files: outcome.files,
        setup_error: outcome.setup_error,
        anomaly,
        setup_us: outcome.setup_us,
        teardown_us: outcome.reap_us + teardown.as_micros() as u64,
    };
    if timed_out {
        result.files.clear();
    }
    Ok(result)
}

fn ring_bytes(r: &Ring) -> Vec<u8> {
    let (_, a, b) = r.slices_from(0);
    [a, b].concat()
}

/// Waits until the process behind `pidfd` has exited, at most [`TEARDOWN_LIMIT`] (after
/// killing it halfway).
async fn wait_exit(pidfd: &OwnedFd) -> bool {
    let Ok(dup) = pidfd.try_clone() else {
        return false;
    };
    // SAFETY: the AsyncFd owns the duplicate until it is dropped; nothing else closes it.
    let Ok(fd) = (unsafe { AsyncFd::register_with_interest(dup, Interest::READABLE) }) else {
        return false;
    };
    let wait = async {
        let _ = fd.readable().await;
    };
    if tokio::time::timeout(TEARDOWN_LIMIT / 2, wait).await.is_ok() {
        return true;
    }
    // SAFETY: pidfd_send_signal on a pidfd we own.
    unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            libc::SIGKILL,
            0,
            0,
        )
    };
    tokio::time::timeout(TEARDOWN_LIMIT / 2, async {
        let _ = fd.readable().await;
    })
    .await
    .is_ok()
}

/// Kills the call's PID 1 (and so the whole call) if the request ends early.
struct KillOnDrop(Option<OwnedFd>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(fd) = &self.0 {
            // SAFETY: pidfd_send_signal on a pidfd we own.
            unsafe {
                libc::syscall(
                    libc::SYS_pidfd_send_signal,
                    fd.as_raw_fd(),
                    libc::SIGKILL,
                    0,
                    0,
                )
            };
        }
    }
}

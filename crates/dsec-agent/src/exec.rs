//! `Exec`: run one command and report its output and exit.
//!
//! Flow: spawn (own process group) → `Started` (streams only) → output → `Exited`. Without `stream` the
//! last `output_limit` bytes of each stream are kept in a [`Ring`] (the pipes keep being
//! drained, so memory stays bounded whatever the command writes) and sent after exit; with
//! `stream` chunks are forwarded as they are read, with back-pressure on the child.
//!
//! The command's exit ends the exec: the pipes are then drained until EOF or for at most
//! [`EXIT_GRACE`], since a left-over background child may hold them open forever. Then
//! whatever is left of the command's process group is killed, as on a timeout or when the
//! node disconnects: an exec leaves nothing running (a fork bomb that outlived its
//! command would hold the sandbox's pids limit). Background processes are for commands
//! that should outlive their start.

use std::cell::Cell;
use std::os::fd::OwnedFd;
use std::rc::Rc;
use std::time::{Duration, Instant};

use dsec_wire::agent::{ExecSpec, ExitInfo, Reply, DEFAULT_OUTPUT_LIMIT};
use dsec_wire::frame::Frame;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::conn::{DataKind, FrameReader, FrameWriter};
use crate::fdio::{FdReader, FdWriter};
use crate::reaper::Exit;
use crate::ring::Ring;
use crate::server::Agent;
use crate::spawn::spawn_piped;
use crate::sys;

/// How long the pipes may stay silent after the main process exited before the exec ends.
pub const EXIT_GRACE: Duration = Duration::from_millis(100);

/// Upper bound on draining after exit (a left-over child may write forever).
pub const EXIT_DRAIN_MAX: Duration = Duration::from_secs(1);

/// Size of one pipe read once output flows.
pub const READ_CHUNK: usize = 64 * 1024;

/// Size of a pipe's first read.
const FIRST_READ: usize = 4 * 1024;

/// Spawns a task that reads `fd` until EOF and sends the chunks, tagged with `kind`.
pub fn pipe_reader(
    fd: OwnedFd,
    kind: DataKind,
    tx: mpsc::Sender<(DataKind, Vec<u8>)>,
) -> std::io::Result<JoinHandle<()>> {
    let rd = FdReader::new(fd)?;
    Ok(tokio::task::spawn_local(async move {
        // Most commands write little or nothing: start small (the buffer is zeroed, and in
        // a fresh sandbox its pages are new) and grow once a read fills it.
        let mut buf = vec![0u8; FIRST_READ];
        loop {
            match rd.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if n == buf.len() && buf.len() < READ_CHUNK {
                        buf.resize(READ_CHUNK, 0);
                    }
                    if tx.send((kind, buf[..n].to_vec())).await.is_err() {
                        break;
                    }
                }
            }
        }
    }))
}

/// Converts a reaped status into wire form (counters filled in by the caller).
pub fn exit_info(exit: Option<Exit>, started: Instant, timed_out: bool) -> ExitInfo {
    ExitInfo {
        exit_code: exit.and_then(|e| e.code),
        signal: exit.and_then(|e| e.signal),
        duration_ms: started.elapsed().as_millis() as u64,
        timed_out,
        ..ExitInfo::default()
    }
}

/// Aborts tasks when dropped (also when the handler future itself is dropped).
#[derive(Debug, Default)]
pub struct TaskGuard(pub Vec<JoinHandle<()>>);

impl Drop for TaskGuard {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// Handles an `Exec` request.
pub async fn exec(
    agent: &Rc<Agent>,
    spec: ExecSpec,
    rd: &mut FrameReader,
    wr: &mut FrameWriter,
) -> std::io::Result<()> {
    let argv = spec.cmd.to_argv();
    let limit =
        usize::try_from(spec.output_limit.unwrap_or(DEFAULT_OUTPUT_LIMIT)).unwrap_or(usize::MAX);
    let started = Instant::now();
    let child = agent
        .cfg
        .identity(spec.user.as_deref())
        .and_then(|identity| {
            spawn_piped(
                &agent.cfg,
                &argv,
                &spec.env,
                spec.cwd.as_deref(),
                spec.stdin,
                identity.as_ref(),
            )
        });
    let child = match child {
        Ok(c) => c,
        Err(err) => {
            if spec.stdin {
                rd.drain_input().await;
            }
            return wr.error(err).await;
        }
    };
    let pid = child.pid as i32;
    let exit_rx = agent.reaper.watch(pid);
    // From here on, make sure the group dies if we bail out early.
    let kill_guard = KillOnDrop(Cell::new(Some(pid)));

    let (tx, mut rx) = mpsc::channel::<(DataKind, Vec<u8>)>(8);
    let mut tasks = TaskGuard::default();
    for (fd, kind) in [
        (child.stdout, DataKind::Stdout),
        (child.stderr, DataKind::Stderr),
    ] {
        tasks.0.push(pipe_reader(fd, kind, tx.clone())?);
    }
    drop(tx);
    let stdin = match child.stdin {
        Some(fd) => Some(FdWriter::new(fd)?),
        None => None,
    };

    let timed_out = Rc::new(Cell::new(false));
    if let Some(ms) = spec.timeout_ms {
        let flag = timed_out.clone();
        tasks.0.push(tokio::task::spawn_local(async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            flag.set(true);
            let _ = sys::killpg(pid, libc::SIGKILL);
        }));
    }

    // Only a stream reports the start: for a whole-result exec it would cost the node a
    // wake-up and a frame it throws away.
    if spec.stream {
        wr.reply(&Reply::Started { pid: pid as u32 }).await?;
    }

    // Input side: stdin frames, then watch for the node going away.
    let input = async {
        if let Some(stdin) = stdin {
            let mut stdin = Some(stdin);
            loop {
                match rd.next().await {
                    Ok(Some(Frame::Data(d))) => {
                        if let Some(w) = &stdin {
                            if w.write_all(&d).await.is_err() {
                                stdin = None; // EPIPE: the child stopped reading.
                            }
                        }
                    }
                    Ok(Some(Frame::Eof)) => break,
                    Ok(Some(_)) => continue,
                    Ok(None) | Err(_) => return,
                }
            }
            drop(stdin);
        }
        rd.closed().await;
    };
    tokio::pin!(input);

    // Kept on the sandbox's output budget, with background processes and sessions: an
    // `output_limit` of gigabytes cannot grow the agent past it.
    let ring = || Ring::with_budget(if spec.stream { 0 } else { limit }, agent.output.clone());
    let mut out = ring();
    let mut err = ring();
    let mut exit: Option<Option<Exit>> = None;
    let mut readers_done = false;
    let mut exit_rx = exit_rx;
    let grace = tokio::time::sleep(Duration::from_secs(3600));
    tokio::pin!(grace);
    let mut disconnected = false;
    let mut drain_until = None;
    loop {
        tokio::select! {
            biased;
            msg = rx.recv(), if !readers_done => match msg {
                Some((kind, data)) => {
                    if let Some(hard) = drain_until {
                        let next = (tokio::time::Instant::now() + EXIT_GRACE).min(hard);
                        grace.as_mut().reset(next);
                    }
                    if !spec.stream {
                        agent.room_for_output(data.len());
                    }
                    if kind == DataKind::Stdout { out.push(&data) } else { err.push(&data) }
                    if spec.stream && wr.data(kind, &data).await.is_err() {
                        disconnected = true;
                        break;
                    }
                }
                None => {
                    readers_done = true;
                    if exit.is_some() { break; }
                }
            },
            st = &mut exit_rx, if exit.is_none() => {
                exit = Some(st.ok());
                if readers_done { break; }
                let now = tokio::time::Instant::now();
                drain_until = Some(now + EXIT_DRAIN_MAX);
                grace.as_mut().reset(now + EXIT_GRACE);
            },
            () = &mut grace, if exit.is_some() => break,
            () = &mut input, if !disconnected => {
                disconnected = true;
                break;
            }
        }
    }
    drop(tasks);
    if disconnected {
        if exit.is_none() {
            tracing::debug!(pid, "node disconnected during exec; killing group");
        }
        return Ok(()); // kill_guard kills the group
    }
    // What is left of the group dies before the caller hears of the exit.
    drop(kill_guard);
    let mut info = exit_info(exit.flatten(), started, timed_out.get());
    info.stdout_bytes = out.total();
    info.stderr_bytes = err.total();
    if spec.stream {
        return wr.reply(&Reply::Exited(info)).await;
    }
    info.stdout_truncated = out.truncated();
    info.stderr_truncated = err.truncated();
    let (_, out_a, out_b) = out.slices_from(0);
    let (_, err_a, err_b) = err.slices_from(0);
    // The output and the exit in one go: the node wakes once for a small result.
    let parts = [
        (DataKind::Stdout, out_a),
        (DataKind::Stdout, out_b),
        (DataKind::Stderr, err_a),
        (DataKind::Stderr, err_b),
    ];
    wr.data_then(&parts, Some(&Reply::Exited(info))).await
}

/// Kills a process group on drop. The leader has been reaped by then, but its pid stays
/// the group's id while any member lives, and is only handed out again after the pid
/// space wrapped around.
#[derive(Debug)]
struct KillOnDrop(Cell<Option<i32>>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(pid) = self.0.get() {
            let _ = sys::killpg(pid, libc::SIGKILL);
        }
    }
}

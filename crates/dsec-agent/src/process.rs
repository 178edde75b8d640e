//! Background processes: start, list, signal, resize, stdin, and re-attachable output.
//!
//! Each process leads its own process group. Its stdout and stderr (or the merged output
//! of its PTY) are drained continuously into per-stream [`Ring`]s that know the absolute
//! offset of every byte, so a client that disconnected can re-attach from the offset it
//! got to. Exited processes stay listed; beyond [`MAX_EXITED`] the oldest are forgotten.
//!
//! Kept execs ([`exec_kept`]) are processes of this table too, found by the node's key
//! rather than listed: a command that must outlive its connection (a call with a request
//! id) and be attached to again, from its first kept byte, by whoever asks next.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, OwnedFd};
use std::process::Stdio;
use std::rc::Rc;
use std::time::{Duration, Instant};

use dsec_wire::agent::{
    ExecSpec, ExitInfo, ProcessInfo, ProcessSpec, PtySize, Reply, DEFAULT_OUTPUT_LIMIT,
};
use dsec_wire::frame::{Frame, DATA_CHUNK};
use tokio::sync::{mpsc, Notify};

use crate::conn::{DataKind, FrameReader, FrameWriter};
use crate::error::{bad_request, conflict, internal, not_found, ApiResult};
use crate::exec::{exit_info, pipe_reader, TaskGuard, EXIT_DRAIN_MAX, EXIT_GRACE};
use crate::fdio::FdWriter;
use crate::reaper::Exit;
use crate::ring::Ring;
use crate::server::Agent;
use crate::spawn::{spawn, SpawnSpec};
use crate::sys;

/// Exited processes kept in the table.
pub const MAX_EXITED: usize = 256;

/// Exited kept execs remembered (their node records each outcome as it ends: these only
/// bridge a node that restarted meanwhile).
pub const MAX_EXITED_KEPT: usize = 64;

#[derive(Debug)]
struct ProcState {
    out: Ring,
    err: Ring,
    /// Set once the process exited and its output was drained.
    exit: Option<ExitInfo>,
}

/// One background process.
#[derive(Debug)]
pub struct Proc {
    pid: u32,
    seq: u64,
    spec: ProcessSpec,
    state: RefCell<ProcState>,
    changed: Notify,
    stdin: tokio::sync::Mutex<Option<FdWriter>>,
    master: Option<OwnedFd>,
    timed_out: Cell<bool>,
    /// The node's key of a kept exec: unlisted, and its group dies with it.
    kept: Option<String>,
}

impl Proc {
    fn info(&self) -> ProcessInfo {
        let st = self.state.borrow();
        ProcessInfo {
            pid: self.pid,
            tag: self.spec.tag.clone(),
            cmd: self.spec.cmd.clone(),
            pty: self.spec.pty.is_some(),
            exit: st.exit.clone(),
            stdout_bytes: st.out.total(),
            stderr_bytes: st.err.total(),
        }
    }
}

/// The process table.
#[derive(Debug, Default)]
pub struct ProcessTable {
    map: RefCell<HashMap<u32, Rc<Proc>>>,
    exited: RefCell<VecDeque<u32>>,
    /// Kept execs by key, running or exited.
    kept: RefCell<HashMap<String, u32>>,
    exited_kept: RefCell<VecDeque<u32>>,
    seq: Cell<u64>,
}

impl ProcessTable {
    /// All known processes, oldest first (kept execs are not listed).
    pub fn list(&self) -> Vec<ProcessInfo> {
        let mut v: Vec<Rc<Proc>> = self
            .map
            .borrow()
            .values()
            .filter(|p| p.kept.is_none())
            .cloned()
            .collect();
        v.sort_by_key(|p| p.seq);
        v.iter().map(|p| p.info()).collect()
    }

    fn get(&self, pid: u32) -> ApiResult<Rc<Proc>> {
        self.map
            .borrow()
            .get(&pid)
            .cloned()
            .ok_or_else(|| not_found(format!("no process {pid}")))
    }

    fn insert(&self, p: Rc<Proc>) {
        let pid = p.pid;
        let key = p.kept.clone();
        let old = self.map.borrow_mut().insert(pid, p);
        if let Some(old) = old {
            // The pid came round again: the old process is long gone.
            self.exited.borrow_mut().retain(|x| *x != pid);
            self.exited_kept.borrow_mut().retain(|x| *x != pid);
            if let Some(old_key) = &old.kept {
                self.kept.borrow_mut().remove(old_key);
            }
        }
        if let Some(key) = key {
            self.kept.borrow_mut().insert(key, pid);
        }
    }

    /// The kept exec of `key`, running or exited.
    fn kept(&self, key: &str) -> Option<Rc<Proc>> {
        let pid = *self.kept.borrow().get(key)?;
        self.map.borrow().get(&pid).cloned()
    }

    fn mark_exited(&self, p: &Proc) {
        let (queue, cap) = match p.kept {
            Some(_) => (&self.exited_kept, MAX_EXITED_KEPT),
            None => (&self.exited, MAX_EXITED),
        };
        let mut exited = queue.borrow_mut();
        exited.push_back(p.pid);
        while exited.len() > cap {
            if let Some(old) = exited.pop_front() {
                if let Some(gone) = self.map.borrow_mut().remove(&old) {
                    if let Some(key) = &gone.kept {
                        self.kept.borrow_mut().remove(key);
                    }
                }
            }
        }
    }

    /// Releases the kept output of exited processes, oldest first, until `budget` has
    /// `need` bytes available or none is left. Their totals stay; reading gets nothing
    /// more, marked truncated.
    pub fn release_exited_output(&self, budget: &crate::ring::Budget, need: usize) {
        let map = self.map.borrow();
        // Kept execs last: their output is what a node that restarted still has to record.
        let exited = self.exited.borrow();
        let exited_kept = self.exited_kept.borrow();
        for pid in exited.iter().chain(exited_kept.iter()) {
            if budget.available() >= need {
                return;
            }
            if let Some(p) = map.get(pid) {
                let mut st = p.state.borrow_mut();
                st.out.release();
                st.err.release();
            }
        }
    }

    fn next_seq(&self) -> u64 {
        let s = self.seq.get() + 1;
        self.seq.set(s);
        s
    }
}

/// Handles `ProcessStart`.
pub fn start(agent: &Rc<Agent>, spec: ProcessSpec) -> ApiResult<ProcessInfo> {
    Ok(start_proc(agent, spec, None, true)?.info())
}

/// Starts a process; a kept one (`kept`: its key) is unlisted and its group dies with it.
fn start_proc(
    agent: &Rc<Agent>,
    spec: ProcessSpec,
    kept: Option<String>,
    stdin_piped: bool,
) -> ApiResult<Rc<Proc>> {
    let argv = spec.cmd.to_argv();
    let limit =
        usize::try_from(spec.output_limit.unwrap_or(DEFAULT_OUTPUT_LIMIT)).unwrap_or(usize::MAX);
    let ierr = |what: &str, e: std::io::Error| internal(format!("{what}: {e}"));
    let identity = agent.cfg.identity(spec.user.as_deref())?;
    let (pid, master, out_fd, err_fd, stdin_fd) = if let Some(size) = spec.pty {
        let (master, slave) = sys::openpty(size.rows, size.cols).map_err(|e| ierr("openpty", e))?;
        let s1 = slave.try_clone().map_err(|e| ierr("dup pty", e))?;
        let s2 = slave.try_clone().map_err(|e| ierr("dup pty", e))?;
        let child = spawn(
            &agent.cfg,
            SpawnSpec {
                argv: &argv,
                env: &spec.env,
                cwd: spec.cwd.as_deref(),
                stdin: Stdio::from(slave),
                stdout: Stdio::from(s1),
                stderr: Stdio::from(s2),
                ctty: true,
                fd3: None,
                fallback_env: &[("TERM", "xterm-256color")],
                identity: identity.as_ref(),
            },
        )?;
        let rd = master.try_clone().map_err(|e| ierr("dup pty", e))?;
        let wr = master.try_clone().map_err(|e| ierr("dup pty", e))?;
        let pid = child.id();
        drop(child);
        (pid, Some(master), Some(rd), None, Some(wr))
    } else {
        // The exec path's spawn (vfork semantics: std's would fork the whole agent).
        let piped = crate::spawn::spawn_piped(
            &agent.cfg,
            &argv,
            &spec.env,
            spec.cwd.as_deref(),
            stdin_piped,
            identity.as_ref(),
        )?;
        (
            piped.pid,
            None,
            Some(piped.stdout),
            Some(piped.stderr),
            piped.stdin,
        )
    };
    let exit_rx = agent.reaper.watch(pid as i32);
    let started = Instant::now();

    let stdin = stdin_fd
        .map(FdWriter::new)
        .transpose()
        .map_err(|e| ierr("stdin", e))?;
    let proc_ = Rc::new(Proc {
        pid,
        seq: agent.procs.next_seq(),
        spec,
        state: RefCell::new(ProcState {
            out: Ring::with_budget(limit, agent.output.clone()),
            err: Ring::with_budget(limit, agent.output.clone()),
            exit: None,
        }),
        changed: Notify::new(),
        stdin: tokio::sync::Mutex::new(stdin),
        master,
        timed_out: Cell::new(false),
        kept,
    });

    let (tx, mut rx) = mpsc::channel::<(DataKind, Vec<u8>)>(8);
    let mut tasks = TaskGuard::default();
    for (fd, kind) in [(out_fd, DataKind::Stdout), (err_fd, DataKind::Stderr)] {
        if let Some(fd) = fd {
            match pipe_reader(fd, kind, tx.clone()) {
                Ok(t) => tasks.0.push(t),
                Err(e) => {
                    let _ = sys::killpg(pid as i32, libc::SIGKILL);
                    return Err(ierr("output pipe", e));
                }
            }
        }
    }
    drop(tx);
    if let Some(ms) = proc_.spec.timeout_ms {
        let p = proc_.clone();
        tasks.0.push(tokio::task::spawn_local(async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            p.timed_out.set(true);
            let _ = sys::killpg(p.pid as i32, libc::SIGKILL);
        }));
    }
    agent.procs.insert(proc_.clone());
    let started_proc = proc_.clone();
    let agent2 = agent.clone();
    tokio::task::spawn_local(async move {
        let p = proc_;
        let mut exit_rx = exit_rx;
        let mut exit: Option<Option<Exit>> = None;
        let grace = tokio::time::sleep(Duration::from_secs(3600));
        tokio::pin!(grace);
        let mut drain_until = None;
        let mut readers_done = false;
        loop {
            tokio::select! {
                biased;
                msg = rx.recv(), if !readers_done => match msg {
                    Some((kind, data)) => {
                        agent2.room_for_output(data.len());
                        {
                            let mut st = p.state.borrow_mut();
                            if kind == DataKind::Stdout { st.out.push(&data) } else { st.err.push(&data) }
                        }
                        p.changed.notify_waiters();
                        if let Some(hard) = drain_until {
                            grace.as_mut().reset((tokio::time::Instant::now() + EXIT_GRACE).min(hard));
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
            }
        }
        drop(tasks);
        if p.kept.is_some() {
            // As for an exec: nothing of it outlives it.
            let _ = sys::killpg(p.pid as i32, libc::SIGKILL);
        }
        let mut info = exit_info(exit.flatten(), started, p.timed_out.get());
        {
            let mut st = p.state.borrow_mut();
            info.stdout_bytes = st.out.total();
            info.stderr_bytes = st.err.total();
            info.stdout_truncated = st.out.truncated();
            info.stderr_truncated = st.err.truncated();
            st.exit = Some(info);
        }
        *p.stdin.lock().await = None;
        p.changed.notify_waiters();
        agent2.procs.mark_exited(&p);
    });
    Ok(started_proc)
}

/// Handles `ProcessOutput`.
pub async fn output(
    agent: &Agent,
    pid: u32,
    stdout_offset: u64,
    stderr_offset: u64,
    follow: bool,
    rd: &mut FrameReader,
    wr: &mut FrameWriter,
) -> std::io::Result<()> {
    let p = match agent.procs.get(pid) {
        Ok(p) => p,
        Err(e) => return wr.error(e).await,
    };
    let (mut out_at, mut err_at, start) = {
        let st = p.state.borrow();
        let o = stdout_offset.min(st.out.total());
        let e = stderr_offset.min(st.err.total());
        let os = o.max(st.out.start());
        let es = e.max(st.err.start());
        (
            os,
            es,
            Reply::OutputStart {
                stdout_offset: os,
                stderr_offset: es,
                stdout_truncated: os > o,
                stderr_truncated: es > e,
            },
        )
    };
    wr.reply(&start).await?;
    let closed = rd.closed();
    tokio::pin!(closed);
    loop {
        // Register for wake-ups before looking, so no change is missed.
        let changed = p.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        send_new_output(&p, &mut out_at, &mut err_at, wr).await?;
        let exit = p.state.borrow().exit.clone();
        if let Some(info) = exit {
            // Everything up to the end has been sent (the rings no longer change).
            return wr.reply(&Reply::Exited(info)).await;
        }
        if !follow {
            return wr
                .reply(&Reply::OutputEnd {
                    stdout_offset: out_at,
                    stderr_offset: err_at,
                })
                .await;
        }
        tokio::select! {
            () = &mut changed => {}
            () = &mut closed => return Ok(()),
        }
    }
}

/// Sends `p`'s output kept from offsets `out_at`/`err_at` up to now, and moves them on
/// (past what a ring overran, if a slow reader fell behind: it goes on from where data
/// exists).
async fn send_new_output(
    p: &Proc,
    out_at: &mut u64,
    err_at: &mut u64,
    wr: &mut FrameWriter,
) -> std::io::Result<()> {
    loop {
        let (o, e) = {
            let st = p.state.borrow();
            (
                st.out.read_from(*out_at, DATA_CHUNK),
                st.err.read_from(*err_at, DATA_CHUNK),
            )
        };
        if o.1.is_empty() && e.1.is_empty() {
            return Ok(());
        }
        *out_at = o.0 + o.1.len() as u64;
        *err_at = e.0 + e.1.len() as u64;
        if !o.1.is_empty() {
            wr.data(DataKind::Stdout, &o.1).await?;
        }
        if !e.1.is_empty() {
            wr.data(DataKind::Stderr, &e.1).await?;
        }
    }
}

/// Handles `ProcessStdin`: `Data` frames until `Eof` go to the process's stdin.
pub async fn stdin(
    agent: &Agent,
    pid: u32,
    close: bool,
    rd: &mut FrameReader,
    wr: &mut FrameWriter,
) -> std::io::Result<()> {
    let p = match agent.procs.get(pid) {
        Ok(p) if p.state.borrow().exit.is_some() => {
            rd.drain_input().await;
            return wr
                .error(conflict(format!("process {pid} has exited")))
                .await;
        }
        Ok(p) => p,
        Err(e) => {
            rd.drain_input().await;
            return wr.error(e).await;
        }
    };
    let mut guard = p.stdin.lock().await;
    let mut failure = None;
    if guard.is_none() {
        failure = Some(conflict(format!("stdin of process {pid} is closed")));
    }
    loop {
        match rd.next().await {
            Ok(Some(Frame::Data(d))) => {
                if failure.is_none() {
                    if let Some(w) = guard.as_ref() {
                        if let Err(e) = w.write_all(&d).await {
                            failure = Some(conflict(format!("writing stdin of {pid}: {e}")));
                        }
                    }
                }
            }
            Ok(Some(Frame::Eof)) => break,
            Ok(Some(_)) => continue,
            Ok(None) | Err(_) => return Ok(()),
        }
    }
    if let Some(e) = failure {
        return wr.error(e).await;
    }
    if close {
        if p.master.is_some() {
            // A terminal has no "close" short of hanging up: send end-of-file (^D).
            if let Some(w) = guard.as_ref() {
                let _ = w.write_all(&[4]).await;
            }
        } else {
            *guard = None;
        }
    }
    wr.reply(&Reply::Ok).await
}

/// Handles `ProcessSignal`: the signal goes to the process's group.
pub fn signal(agent: &Agent, pid: u32, sig: i32) -> ApiResult<()> {
    let p = agent.procs.get(pid)?;
    if !(0..=64).contains(&sig) {
        return Err(bad_request(format!("invalid signal number {sig}")));
    }
    if p.state.borrow().exit.is_some() {
        return Err(conflict(format!("process {pid} has exited")));
    }
    sys::killpg(pid as i32, sig).map_err(|e| bad_request(format!("signal {sig} to {pid}: {e}")))
}

/// Handles `ProcessResize`.
pub fn resize(agent: &Agent, pid: u32, size: PtySize) -> ApiResult<()> {
    let p = agent.procs.get(pid)?;
    let Some(master) = &p.master else {
        return Err(bad_request(format!("process {pid} has no pty")));
    };
    sys::set_winsize(master.as_fd(), size.rows, size.cols)
        .map_err(|e| internal(format!("resize pty of {pid}: {e}")))
}

/// Handles `ExecKept`: starts the command kept under `key`, or attaches to it, and sends
/// its output from the first kept byte (live with `stream`, else once it exited). The
/// node going away ends only this attachment, never the command.
pub async fn exec_kept(
    agent: &Rc<Agent>,
    key: String,
    spec: Option<ExecSpec>,
    stream: bool,
    rd: &mut FrameReader,
    wr: &mut FrameWriter,
) -> std::io::Result<()> {
    let has_input = spec.as_ref().is_some_and(|s| s.stdin);
    let (p, feed) = match (agent.procs.kept(&key), spec) {
        (Some(p), _) => (p, false),
        (None, None) => {
            if has_input {
                rd.drain_input().await;
            }
            return wr
                .error(not_found(format!("no command is kept under key {key:?}")))
                .await;
        }
        (None, Some(spec)) => {
            let stdin = spec.stdin;
            let pspec = ProcessSpec {
                cmd: spec.cmd,
                env: spec.env,
                cwd: spec.cwd,
                pty: None,
                tag: None,
                output_limit: spec.output_limit,
                timeout_ms: spec.timeout_ms,
                user: spec.user,
            };
            // No input: /dev/null, as for an exec.
            match start_proc(agent, pspec, Some(key), stdin) {
                Ok(p) => (p, stdin),
                Err(e) => {
                    if has_input {
                        rd.drain_input().await;
                    }
                    return wr.error(e).await;
                }
            }
        }
    };
    // Only a stream reports the start (a whole result is one send, as an exec's).
    if stream {
        wr.reply(&Reply::Started { pid: p.pid }).await?;
    }

    // Input side: the first request's stdin goes to the command (and is closed after, or
    // when the node goes away mid-input); an attachment's is discarded. Then watch for the
    // node going away.
    let fed = p.clone();
    let input = async move {
        if feed {
            let mut stdin = fed.stdin.lock().await;
            loop {
                match rd.next().await {
                    Ok(Some(Frame::Data(d))) => {
                        if let Some(w) = stdin.as_ref() {
                            if w.write_all(&d).await.is_err() {
                                *stdin = None; // EPIPE: the command stopped reading.
                            }
                        }
                    }
                    Ok(Some(Frame::Eof)) => break,
                    Ok(Some(_)) => continue,
                    Ok(None) | Err(_) => {
                        *stdin = None;
                        return;
                    }
                }
            }
            *stdin = None;
        } else if has_input && !rd.drain_input().await {
            return;
        }
        rd.closed().await;
    };
    tokio::pin!(input);

    let (mut out_at, mut err_at) = (0u64, 0u64);
    loop {
        // Register for wake-ups before looking, so no change is missed.
        let changed = p.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        if stream {
            send_new_output(&p, &mut out_at, &mut err_at, wr).await?;
        }
        let exit = p.state.borrow().exit.clone();
        if let Some(info) = exit {
            if stream {
                return wr.reply(&Reply::Exited(info)).await;
            }
            // The kept output and the exit in one go, as an exec sends them.
            let kept: [Vec<u8>; 4] = {
                let st = p.state.borrow();
                let (_, oa, ob) = st.out.slices_from(0);
                let (_, ea, eb) = st.err.slices_from(0);
                [oa.to_vec(), ob.to_vec(), ea.to_vec(), eb.to_vec()]
            };
            let parts = [
                (DataKind::Stdout, kept[0].as_slice()),
                (DataKind::Stdout, kept[1].as_slice()),
                (DataKind::Stderr, kept[2].as_slice()),
                (DataKind::Stderr, kept[3].as_slice()),
            ];
            return wr.data_then(&parts, Some(&Reply::Exited(info))).await;
        }
        tokio::select! {
            () = &mut changed => {}
            () = &mut input => return Ok(()),
        }
    }
}

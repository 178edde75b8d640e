//! Persistent bash sessions.
//!
//! A session is one `bash --noprofile --norc` (non-interactive: no prompts, no job-control
//! messages) in its own process group, with stdout and stderr on one pipe and an extra
//! *marker pipe* on fd 3. Each command is sent to the shell's stdin as:
//!
//! ```text
//! __dsec_ret() { return "$1"; }
//! __dsec_run() { __dsec_ret "${__dsec_rc:-0}"; eval "$__dsec_cmd"; }
//! IFS= read -r -d '' __dsec_cmd <<'__DSEC_<token>'
//! <command>
//! __DSEC_<token>
//! trap 'return 130' INT; __dsec_run </dev/null 3>&-; __dsec_rc=$?; trap : INT; printf '%s' '<token>'; printf '%s %s\n' '<token>' "$__dsec_rc" >&3
//! ```
//!
//! The command runs in the shell itself (no subshell), so `cd`, `export` and variables
//! persist; `$?` is the previous command's status. It is evaluated inside a function so
//! that an interrupt can abort the whole command list (the INT trap `return`s from it,
//! like Ctrl-C in a terminal), which also means a top-level `declare`/`local` is local to
//! that command. It cannot read the control stream (its stdin is `/dev/null`) nor touch fd 3.
//! The end of a command is the `<token> <status>` line on fd 3; the output is everything
//! on the output pipe before the token (so output without a trailing newline is exact).
//! The token is fresh random for every command, so output cannot spoof it.
//!
//! Interrupt: SIGINT goes to the shell's whole process group, like Ctrl-C in a terminal:
//! the foreground processes die, the shell's trap aborts the command (status 130) and the
//! shell keeps its state. Background jobs (`cmd &`) ignore SIGINT and survive. On timeout
//! the agent interrupts, then SIGKILLs the group's other members after [`KILL_AFTER`] (a
//! command that ignores SIGINT); if the shell still does not answer, the session is killed
//! after [`ABANDON_AFTER`] and removed. A command whose caller goes away (the node closes
//! the connection: its client disconnected or gave up) is stopped the same way, at once:
//! nothing keeps changing the sandbox behind the back of a caller that stopped waiting.
//! The session and its state stay.
//!
//! Output: the last [`SESSION_OUTPUT_LIMIT`] bytes, fewer when their JSON form (NUL and
//! other control bytes take six bytes each) would not fit in one reply frame; `truncated`
//! says so.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsRawFd, OwnedFd};
use std::process::Stdio;
use std::rc::Rc;
use std::time::{Duration, Instant};

use dsec_wire::agent::{Reply, SessionInfo, SessionResult};
use dsec_wire::frame::MAX_FRAME;
use tokio::sync::oneshot;

use crate::conn::FrameReader;
use crate::error::{bad_request, conflict, internal, not_found, ApiResult};
use crate::fdio::{FdReader, FdWriter};
use crate::reaper::Exit;
use crate::ring::Lease;
use crate::server::Agent;
use crate::spawn::{spawn, SpawnSpec};
use crate::sys;

/// Cap on the output kept for one command (the tail is kept).
pub const SESSION_OUTPUT_LIMIT: usize = 4 * 1024 * 1024;

/// Most bytes the output may take as a JSON string in the reply: one frame, less room
/// for the rest of the reply.
pub const SESSION_OUTPUT_JSON_LIMIT: usize = MAX_FRAME - 16 * 1024;

/// After an interrupt, SIGKILL the command's processes if it has not finished by then.
pub const KILL_AFTER: Duration = Duration::from_secs(2);

/// After an interrupt, give up on the shell and kill the session after this long.
pub const ABANDON_AFTER: Duration = Duration::from_secs(5);

/// How long to wait for the output token once the status line arrived (the command may
/// have redirected the shell's stdout for good).
const TOKEN_WAIT: Duration = Duration::from_millis(500);

/// The I/O of an idle session, taken by the command that runs.
#[derive(Debug)]
struct SessionIo {
    stdin: FdWriter,
    out: FdReader,
    marker: FdReader,
    exit: oneshot::Receiver<Exit>,
}

/// One shell session.
#[derive(Debug)]
pub struct Session {
    id: String,
    pid: i32,
    busy: Cell<bool>,
    io: RefCell<Option<SessionIo>>,
}

/// The session table.
#[derive(Debug, Default)]
pub struct Sessions {
    map: RefCell<HashMap<String, Rc<Session>>>,
}

impl Sessions {
    /// Open sessions, sorted by id.
    pub fn list(&self) -> Vec<SessionInfo> {
        let mut v: Vec<SessionInfo> = self
            .map
            .borrow()
            .values()
            .map(|s| SessionInfo {
                session: s.id.clone(),
                pid: s.pid as u32,
                busy: s.busy.get(),
            })
            .collect();
        v.sort_by(|a, b| a.session.cmp(&b.session));
        v
    }

    fn get(&self, id: &str) -> ApiResult<Rc<Session>> {
        self.map
            .borrow()
            .get(id)
            .cloned()
            .ok_or_else(|| not_found(format!("no session {id:?}")))
    }

    fn remove(&self, id: &str, pid: i32) {
        let mut map = self.map.borrow_mut();
        if map.get(id).is_some_and(|s| s.pid == pid) {
            map.remove(id);
        }
    }
}

/// Handles `SessionCreate`.
pub fn create(
    agent: &Agent,
    id: String,
    env: BTreeMap<String, String>,
    cwd: Option<String>,
    user: Option<String>,
) -> ApiResult<Reply> {
    if id.is_empty() {
        return Err(bad_request("session id must not be empty"));
    }
    if agent.sessions.map.borrow().contains_key(&id) {
        return Err(conflict(format!("session {id:?} already exists")));
    }
    let identity = agent.cfg.identity(user.as_deref())?;
    let pipe_err = |e: std::io::Error| internal(format!("creating session pipes: {e}"));
    let (out_r, out_w) = sys::pipe().map_err(pipe_err)?;
    let (mark_r, mark_w) = sys::pipe().map_err(pipe_err)?;
    let out_w2 = out_w.try_clone().map_err(pipe_err)?;
    let argv = [
        "bash".to_string(),
        "--noprofile".to_string(),
        "--norc".to_string(),
    ];
    let mut child = spawn(
        &agent.cfg,
        SpawnSpec {
            argv: &argv,
            env: &env,
            cwd: cwd.as_deref(),
            stdin: Stdio::piped(),
            stdout: Stdio::from(out_w),
            stderr: Stdio::from(out_w2),
            ctty: false,
            fd3: Some(mark_w.as_raw_fd()),
            fallback_env: &[],
            identity: identity.as_ref(),
        },
    )?;
    drop(mark_w);
    let pid = child.id() as i32;
    let exit = agent.reaper.watch(pid);
    let setup = || -> std::io::Result<SessionIo> {
        let mut stdin = child
            .stdin
            .take()
            .ok_or_else(|| std::io::Error::other("no stdin pipe"))?;
        // Until the first command, an interrupt must not kill the shell. The pipe is new
        // and empty, so this small blocking write cannot block.
        std::io::Write::write_all(&mut stdin, b"trap : INT\n")?;
        Ok(SessionIo {
            stdin: FdWriter::new(OwnedFd::from(stdin))?,
            out: FdReader::new(out_r)?,
            marker: FdReader::new(mark_r)?,
            exit,
        })
    };
    let io = match setup() {
        Ok(io) => io,
        Err(e) => {
            let _ = sys::killpg(pid, libc::SIGKILL);
            return Err(internal(format!("setting up session: {e}")));
        }
    };
    let session = Rc::new(Session {
        id: id.clone(),
        pid,
        busy: Cell::new(false),
        io: RefCell::new(Some(io)),
    });
    agent.sessions.map.borrow_mut().insert(id.clone(), session);
    tracing::debug!(session = %id, pid, "session created");
    Ok(Reply::SessionCreated {
        session: id,
        pid: pid as u32,
    })
}

/// `sig` to every process in the session's group except the shell itself.
fn signal_members(shell: i32, sig: i32) {
    for (pid, state, pgrp) in sys::proc_groups() {
        if pgrp == shell && pid != shell && state != 'Z' {
            let _ = sys::kill(pid, sig);
        }
    }
}

/// Handles `SessionInterrupt` (a no-op when no command runs).
pub fn interrupt(agent: &Agent, id: &str) -> ApiResult<()> {
    let s = agent.sessions.get(id)?;
    if s.busy.get() {
        let _ = sys::killpg(s.pid, libc::SIGINT);
    }
    Ok(())
}

/// Handles `SessionClose`: kills the shell and its process group.
pub fn close(agent: &Agent, id: &str) -> ApiResult<()> {
    let s = agent.sessions.get(id)?;
    let _ = sys::killpg(s.pid, libc::SIGKILL);
    agent.sessions.remove(id, s.pid);
    Ok(())
}

/// Clears the busy flag when the run ends, however it ends.
struct BusyGuard<'a>(&'a Session);

impl Drop for BusyGuard<'_> {
    fn drop(&mut self) {
        self.0.busy.set(false);
    }
}

fn script(command: &str, token: &str) -> String {
    let nl = if command.ends_with('\n') { "" } else { "\n" };
    format!(
        "__dsec_ret() {{ return \"$1\"; }}\n\
         __dsec_run() {{ __dsec_ret \"${{__dsec_rc:-0}}\"; eval \"$__dsec_cmd\"; }}\n\
         IFS= read -r -d '' __dsec_cmd <<'{token}'\n{command}{nl}{token}\n\
         trap 'return 130' INT; __dsec_run </dev/null 3>&-; __dsec_rc=$?; trap : INT; \
         printf '%s' '{token}'; printf '%s %s\\n' '{token}' \"$__dsec_rc\" >&3\n"
    )
}

/// Appends to the kept output, keeping at most `2 * cap` bytes before trimming to `cap`.
/// Its memory is held on `lease` (the sandbox's output budget, shared with every
/// process's rings): short of it, a shorter tail is kept, in no more memory than the
/// lease covers (but always the new bytes and the end of the old ones, where a token
/// split over two reads begins).
fn keep(out: &mut Vec<u8>, data: &[u8], dropped: &mut bool, lease: &mut Lease) {
    if out.len() + data.len() > 2 * SESSION_OUTPUT_LIMIT {
        trim_to(out, SESSION_OUTPUT_LIMIT, dropped);
    }
    out.extend_from_slice(data);
    let cap = out.capacity();
    let granted = lease.hold(cap);
    if granted < cap {
        trim_to(out, (granted / 2).max(data.len() + 128), dropped);
        out.shrink_to(granted);
        lease.hold(out.capacity());
    }
}

/// Keeps the last `n` bytes of `out`.
fn trim_to(out: &mut Vec<u8>, n: usize, dropped: &mut bool) {
    if out.len() > n {
        let cut = out.len() - n;
        out.drain(..cut);
        *dropped = true;
    }
}

/// Bytes `b` takes inside a JSON string (as serde_json escapes it).
fn json_len(b: u8) -> usize {
    match b {
        b'"' | b'\\' | b'\n' | b'\r' | b'\t' | 0x08 | 0x0c => 2,
        0..=0x1f => 6,
        _ => 1,
    }
}

/// The longest tail of `text` whose JSON string form takes at most `limit` bytes, and
/// whether anything was cut.
fn fit_json(text: String, limit: usize) -> (String, bool) {
    let bytes = text.as_bytes();
    let mut size = 0;
    let mut cut = None;
    for (i, &b) in bytes.iter().enumerate().rev() {
        size += json_len(b);
        if size > limit {
            cut = Some(i + 1);
            break;
        }
    }
    match cut {
        None => (text, false),
        Some(mut at) => {
            while !text.is_char_boundary(at) {
                at += 1;
            }
            (text[at..].to_string(), true)
        }
    }
}

/// Handles `SessionRun`. `rd` is watched for the node going away.
pub async fn run(
    agent: &Agent,
    id: &str,
    command: &str,
    timeout_ms: Option<u64>,
    rd: &mut FrameReader,
) -> ApiResult<SessionResult> {
    if command.contains('\0') {
        return Err(bad_request("command contains a NUL byte"));
    }
    let s = agent.sessions.get(id)?;
    if s.busy.get() {
        return Err(conflict(format!(
            "session {id:?} is already running a command"
        )));
    }
    let Some(mut io) = s.io.borrow_mut().take() else {
        return Err(conflict(format!("session {id:?} has exited")));
    };
    s.busy.set(true);
    let _busy = BusyGuard(&s);
    let started = Instant::now();
    let token = format!("__DSEC_{:032x}", rand::random::<u128>());

    let input = script(command, &token);
    if let Err(e) = io.stdin.write_all(input.as_bytes()).await {
        agent.sessions.remove(id, s.pid);
        let _ = sys::killpg(s.pid, libc::SIGKILL);
        return Err(conflict(format!("session {id:?} has exited ({e})")));
    }

    let mut output: Vec<u8> = Vec::new();
    let mut lease = Lease::new(agent.output.clone());
    let mut dropped = false;
    let mut token_at: Option<usize> = None;
    let mut marker_buf: Vec<u8> = Vec::new();
    let mut status: Option<i32> = None;
    let mut shell_exit: Option<Exit> = None;
    let mut out_eof = false;
    let mut marker_eof = false;
    let mut timed_out = false;
    let mut stage = 0u8; // 0 running, 1 interrupted, 2 killed members
    let mut obuf = vec![0u8; 64 * 1024];
    let mut mbuf = vec![0u8; 4096];
    let deadline =
        timeout_ms.map(|ms| tokio::time::Instant::from_std(started) + Duration::from_millis(ms));
    let far = tokio::time::Instant::now() + Duration::from_secs(30 * 24 * 3600);
    let timer = tokio::time::sleep_until(deadline.unwrap_or(far));
    tokio::pin!(timer);
    let mut interrupted_at: Option<tokio::time::Instant> = None;
    let token_wait = tokio::time::sleep_until(far);
    tokio::pin!(token_wait);
    // Armed by the timeout, or at once when the caller goes away.
    let mut armed = deadline.is_some();
    let mut caller_gone = false;
    let closed = rd.closed();
    tokio::pin!(closed);

    loop {
        if token_at.is_some() && status.is_some() {
            break;
        }
        if marker_eof && (out_eof || shell_exit.is_some()) {
            break;
        }
        tokio::select! {
            r = io.out.read(&mut obuf), if !out_eof && token_at.is_none() => match r {
                Ok(0) | Err(_) => out_eof = true,
                Ok(n) => {
                    let before = output.len();
                    agent.room_for_output(n);
                    keep(&mut output, &obuf[..n], &mut dropped, &mut lease);
                    let trimmed = before + n - output.len();
                    let from = before.saturating_sub(trimmed).saturating_sub(token.len());
                    if let Some(i) = find(&output[from..], token.as_bytes()) {
                        token_at = Some(from + i);
                    }
                }
            },
            r = io.marker.read(&mut mbuf), if !marker_eof && status.is_none() => match r {
                Ok(0) | Err(_) => {
                    marker_eof = true;
                    token_wait.as_mut().reset(tokio::time::Instant::now() + TOKEN_WAIT);
                }
                Ok(n) => {
                    marker_buf.extend_from_slice(&mbuf[..n]);
                    while let Some(nl) = marker_buf.iter().position(|b| *b == b'\n') {
                        let line: Vec<u8> = marker_buf.drain(..=nl).collect();
                        let line = String::from_utf8_lossy(&line);
                        if let Some(rest) = line.trim_end().strip_prefix(token.as_str()) {
                            status = rest.trim().parse().ok().or(Some(-1));
                            token_wait.as_mut().reset(tokio::time::Instant::now() + TOKEN_WAIT);
                        }
                    }
                }
            },
            r = &mut io.exit, if shell_exit.is_none() => {
                shell_exit = Some(r.unwrap_or(Exit { code: None, signal: None }));
            },
            () = &mut token_wait, if status.is_some() || marker_eof => break,
            () = &mut closed, if !caller_gone => {
                caller_gone = true;
                tracing::debug!(session = %id, "caller went away; stopping the command");
                if stage == 0 {
                    armed = true;
                    timer.as_mut().reset(tokio::time::Instant::now());
                }
            },
            () = &mut timer, if armed && stage < 3 => {
                let now = tokio::time::Instant::now();
                match stage {
                    0 => {
                        timed_out = !caller_gone;
                        let _ = sys::killpg(s.pid, libc::SIGINT);
                        interrupted_at = Some(now);
                        timer.as_mut().reset(now + KILL_AFTER);
                        stage = 1;
                    }
                    1 => {
                        signal_members(s.pid, libc::SIGKILL);
                        let _ = sys::kill(s.pid, libc::SIGINT);
                        let base = interrupted_at.unwrap_or(now);
                        timer.as_mut().reset(base + ABANDON_AFTER);
                        stage = 2;
                    }
                    _ => {
                        // The shell itself is stuck: give up on the session.
                        let _ = sys::killpg(s.pid, libc::SIGKILL);
                        stage = 3;
                    }
                }
            }
        }
    }

    if marker_eof && shell_exit.is_none() {
        // The shell is going away; its status is on the way.
        if let Ok(Ok(e)) = tokio::time::timeout(Duration::from_secs(1), &mut io.exit).await {
            shell_exit = Some(e);
        }
    }
    let end = token_at.unwrap_or(output.len());
    let begin = end.saturating_sub(SESSION_OUTPUT_LIMIT);
    dropped |= begin > 0;
    let (text, cut) = fit_json(
        String::from_utf8_lossy(&output[begin..end]).into_owned(),
        SESSION_OUTPUT_JSON_LIMIT,
    );
    dropped |= cut;
    let alive = status.is_some() && !marker_eof && shell_exit.is_none();
    let exit_code = match (status, shell_exit) {
        (Some(c), _) if alive => c,
        (_, Some(Exit { code: Some(c), .. })) => c,
        (
            _,
            Some(Exit {
                signal: Some(sig), ..
            }),
        ) => 128 + sig,
        (Some(c), _) => c,
        (None, _) => -1,
    };
    if alive {
        *s.io.borrow_mut() = Some(io);
    } else {
        // The shell is gone (exit, kill, or abandoned): drop the session.
        let _ = sys::killpg(s.pid, libc::SIGKILL);
        agent.sessions.remove(id, s.pid);
    }
    Ok(SessionResult {
        output: text,
        exit_code,
        timed_out,
        truncated: dropped,
        duration_ms: started.elapsed().as_millis() as u64,
    })
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json_size(s: &str) -> usize {
        serde_json::to_string(s).expect("json").len() - 2
    }

    #[test]
    fn output_is_cut_to_fit_its_json_form() {
        let limit = 1000;
        for text in [
            "plain text\n".repeat(500),
            "\0".repeat(2000),
            "\"\\".repeat(2000),
            "é\u{1}x".repeat(700),
            "\u{fffd}".repeat(2000),
        ] {
            let (kept, cut) = fit_json(text.clone(), limit);
            assert!(cut, "{:?}", &text[..10]);
            assert!(text.ends_with(&kept));
            assert!(json_size(&kept) <= limit, "{}", json_size(&kept));
            // The longest such tail: one more character would not fit.
            let longer = &text[..text.len() - kept.len()];
            let next = longer.chars().last().expect("a character before");
            let more = format!("{next}{kept}");
            assert!(json_size(&more) > limit, "{}", json_size(&more));
        }
        let small = "fits \0 \"quoted\"".to_string();
        assert_eq!(fit_json(small.clone(), limit), (small, false));
    }

    #[test]
    fn kept_output_stays_within_the_sandbox_budget() {
        let budget = crate::ring::Budget::new(1 << 20, 64 << 10);
        // Another holder has most of it.
        let mut other = Lease::new(budget.clone());
        assert_eq!(other.hold(900 << 10), 900 << 10);
        let mut lease = Lease::new(budget.clone());
        let (mut out, mut dropped) = (Vec::new(), false);
        let chunk: Vec<u8> = (0..64 << 10).map(|i| (i % 251) as u8).collect();
        for _ in 0..160 {
            keep(&mut out, &chunk, &mut dropped, &mut lease);
            assert!(out.capacity() <= 256 << 10, "{}", out.capacity());
            assert!(budget.held() <= (1 << 20) + (64 << 10), "{}", budget.held());
        }
        assert!(dropped);
        assert!(out.ends_with(&chunk), "the newest bytes are kept");
        // Once the other holder lets go, the output may grow to its own cap.
        drop(other);
        for _ in 0..160 {
            keep(&mut out, &chunk, &mut dropped, &mut lease);
        }
        assert!(out.len() > 512 << 10, "{}", out.len());
        drop(lease);
        assert_eq!(budget.held(), 0);
    }
}

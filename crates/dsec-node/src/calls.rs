//! The record of calls that carried a request id: what a node keeps of each, so that a
//! retry (a trainer replaying its trajectory after a preemption) gets the first call's
//! outcome instead of running it again, and each sandbox's call log.
//!
//! A sandbox's record is `STATE_DIR/calls/ID/`:
//! - `log.jsonl`: a line when a call starts, one when it ends (appended, not synced:
//!   it outlives the node's process, as the sandbox does, not the machine). An exec's
//!   start is written once its request went out, while the agent starts it (a node
//!   killed in that moment leaves the command kept in the agent under its request id,
//!   and a retry attaches to it); another call's before its request goes out;
//! - `SEQ.stdout` and `SEQ.stderr`: the kept output of each ended call.
//!
//! The node loads every record when it opens and drives each call still running to its
//! end again (the agent kept the command under its request id:
//! [`Request::ExecKept`](dsec_wire::agent::Request::ExecKept)). A record goes with its
//! sandbox. Bounds: the node's `max_recorded_calls` calls (default
//! [`MAX_CALLS_PER_SANDBOX`](dsec_wire::v1::MAX_CALLS_PER_SANDBOX); more are refused,
//! `no_space`) and
//! [`MAX_CALL_OUTPUT_BYTES`] of output (the oldest calls' is dropped first, and says so).
//!
//! Request ids are the node's to check across sandboxes too: an id one sandbox used is
//! refused on another (a trajectory replayed into the wrong sandbox).

use std::collections::{HashMap, HashSet, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use dsec_wire::agent::{ExitInfo, Reply};
use dsec_wire::v1::{
    CallLog, CallLogQuery, CallRecord, CallState, ExecResult, CALL_LOG_MAX_PAGE, CALL_LOG_PAGE,
    MAX_CALL_OUTPUT_BYTES,
};
use dsec_wire::{ApiError, ErrorCode};

use crate::events::lossy_text;
use crate::NodeError;

/// Directory of the records, in the state directory.
const CALLS_DIR: &str = "calls";
/// A sandbox's log, in its record's directory.
const LOG_FILE: &str = "log.jsonl";

/// One line of `log.jsonl`.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "line", rename_all = "snake_case")]
enum Line {
    Start(StartLine),
    End(EndLine),
    /// The call failed before its command started: forgotten, a retry runs it.
    Abandon {
        seq: u64,
    },
    /// Its kept output was dropped for newer calls'.
    Dropped {
        seq: u64,
    },
}

/// A call as it started.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct StartLine {
    pub seq: u64,
    pub request_id: String,
    pub kind: String,
    /// SHA-256 of what it asks for: a retry must ask for the same.
    pub digest: String,
    pub args: serde_json::Value,
    pub started_at_ms: u64,
    /// The sandbox's OOM-kill count when it started, for its verdict.
    pub oom_before: u64,
}

/// How a call ended.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct EndLine {
    pub seq: u64,
    pub ended_at_ms: u64,
    pub state: CallState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit: Option<ExitInfo>,
    #[serde(default)]
    pub oom_killed: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ApiError>,
    /// A call answered by one agent reply (a session command, a process start) kept it
    /// as `SEQ.reply`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reply: bool,
    /// SHA-256 of an upload's body (a file write, a tar upload): a retry must send the
    /// same bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_digest: Option<String>,
}

/// What a waiter sees of a call: `None` while it runs.
pub(crate) type Ended = Option<Arc<EndLine>>;

#[derive(Debug)]
struct Slot {
    digest: String,
    oom_before: u64,
    ended: watch::Sender<Ended>,
}

#[derive(Debug)]
struct SandboxCalls {
    dir: PathBuf,
    file: File,
    slots: HashMap<String, Slot>,
    next_seq: u64,
    /// (seq, bytes) of the calls whose output is on disk, oldest first.
    kept_output: VecDeque<(u64, u64)>,
    output_bytes: u64,
}

#[derive(Debug, Default)]
struct Inner {
    sandboxes: HashMap<String, SandboxCalls>,
    /// Request id -> the sandbox it belongs to.
    owners: HashMap<String, String>,
}

impl SandboxCalls {
    /// Appends `line` to the log, in one write: lines are never interleaved, and a
    /// crash cuts at most the last one (dropped when the log is read).
    fn append(&mut self, line: &Line) -> std::io::Result<()> {
        let mut bytes = serde_json::to_vec(line).map_err(std::io::Error::other)?;
        bytes.push(b'\n');
        self.file.write_all(&bytes)
    }
}

/// The records of one node's sandboxes.
#[derive(Debug)]
pub(crate) struct CallJournal {
    root: PathBuf,
    inner: Mutex<Inner>,
    /// Calls a sandbox's record keeps.
    max_calls: usize,
}

/// A call that was running when the node stopped: to be driven to its end again.
#[derive(Debug)]
pub(crate) struct Pending {
    pub sandbox: String,
    pub start: StartLine,
}

impl Pending {
    /// Its kind, and the ticket to end it with.
    pub(crate) fn into_ticket(self) -> (String, Ticket) {
        let ticket = Ticket {
            sandbox: self.sandbox,
            seq: self.start.seq,
            request_id: self.start.request_id,
            oom_before: self.start.oom_before,
            unwritten: None,
        };
        (self.start.kind, ticket)
    }
}

/// A new call: [`CallJournal::started`] once its request is on its way (or before, for
/// a call the agent would run twice), then [`CallJournal::end`] or
/// [`CallJournal::abandon`] it.
#[derive(Debug, Clone)]
pub(crate) struct Ticket {
    pub sandbox: String,
    /// Its place in the sandbox's log: 0 until [`CallJournal::started`] wrote its start.
    pub seq: u64,
    pub request_id: String,
    pub oom_before: u64,
    /// Its start line, until written.
    unwritten: Option<Box<StartLine>>,
}

/// What [`CallJournal::begin`] found.
#[derive(Debug)]
pub(crate) enum Begin {
    /// A call not seen before.
    New(Ticket),
    /// A retry: wait for `ended`, then read [`CallJournal::result`].
    Known {
        oom_before: u64,
        ended: watch::Receiver<Ended>,
    },
}

fn conflict(msg: String) -> ApiError {
    ApiError::new(ErrorCode::Conflict, msg)
}

fn io_error(what: &str, path: &Path, e: std::io::Error) -> ApiError {
    ApiError::new(
        ErrorCode::Internal,
        format!("call record: {what} {}: {e}", path.display()),
    )
}

/// Unix time in milliseconds.
pub(crate) fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The lines of a log; a line cut off by a crash (the last) is skipped.
fn read_lines(path: &Path) -> std::io::Result<Vec<Line>> {
    let text = std::fs::read(path)?;
    Ok(text
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .filter_map(|l| serde_json::from_slice(l).ok())
        .collect())
}

fn output_path(dir: &Path, seq: u64, stream: &str) -> PathBuf {
    dir.join(format!("{seq}.{stream}"))
}

impl CallJournal {
    /// Loads the records of the sandboxes `keep` names, removes the others', and returns
    /// the calls that were running.
    pub(crate) fn open(
        state_dir: &Path,
        keep: &HashSet<String>,
        max_calls: usize,
    ) -> Result<(Self, Vec<Pending>), NodeError> {
        let root = state_dir.join(CALLS_DIR);
        std::fs::create_dir_all(&root).map_err(NodeError::io("mkdir", &root))?;
        let mut inner = Inner::default();
        let mut pending = Vec::new();
        for entry in std::fs::read_dir(&root).map_err(NodeError::io("read_dir", &root))? {
            let dir = entry.map_err(NodeError::io("read_dir", &root))?.path();
            let Some(id) = dir.file_name().and_then(|n| n.to_str()).map(str::to_string) else {
                continue;
            };
            if !keep.contains(&id) {
                let _ = std::fs::remove_dir_all(&dir);
                continue;
            }
            match Self::load(&dir) {
                Ok((calls, running)) => {
                    for start in running {
                        pending.push(Pending {
                            sandbox: id.clone(),
                            start,
                        });
                    }
                    for rid in calls.slots.keys() {
                        inner.owners.insert(rid.clone(), id.clone());
                    }
                    inner.sandboxes.insert(id, calls);
                }
                Err(e) => {
                    tracing::warn!(sandbox = %id, error = %e, "unreadable call record; removed");
                    let _ = std::fs::remove_dir_all(&dir);
                }
            }
        }
        Ok((
            Self {
                root,
                inner: Mutex::new(inner),
                max_calls,
            },
            pending,
        ))
    }

    /// One sandbox's record, and its calls still running.
    fn load(dir: &Path) -> std::io::Result<(SandboxCalls, Vec<StartLine>)> {
        let log = dir.join(LOG_FILE);
        // A last line cut off by a crash would glue onto the next one: cut it first.
        let bytes = std::fs::read(&log)?;
        let whole = bytes.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
        if whole < bytes.len() {
            let f = OpenOptions::new().write(true).open(&log)?;
            f.set_len(whole as u64)?;
        }
        let mut starts: Vec<StartLine> = Vec::new();
        let mut ends: HashMap<u64, EndLine> = HashMap::new();
        let mut gone: HashSet<u64> = HashSet::new();
        let mut dropped: HashSet<u64> = HashSet::new();
        for line in read_lines(&log)? {
            match line {
                Line::Start(s) => starts.push(s),
                Line::End(e) => {
                    ends.insert(e.seq, e);
                }
                Line::Abandon { seq } => {
                    gone.insert(seq);
                }
                Line::Dropped { seq } => {
                    dropped.insert(seq);
                }
            }
        }
        let mut calls = SandboxCalls {
            dir: dir.to_path_buf(),
            file: OpenOptions::new().append(true).open(&log)?,
            slots: HashMap::new(),
            next_seq: starts.iter().map(|s| s.seq).max().unwrap_or(0) + 1,
            kept_output: VecDeque::new(),
            output_bytes: 0,
        };
        let mut running = Vec::new();
        for start in starts {
            if gone.contains(&start.seq) {
                continue;
            }
            let end = ends.remove(&start.seq).map(Arc::new);
            let output_dropped = dropped.contains(&start.seq);
            if end.is_some() && !output_dropped {
                let bytes: u64 = ["stdout", "stderr", "reply"]
                    .iter()
                    .filter_map(|s| std::fs::metadata(output_path(dir, start.seq, s)).ok())
                    .map(|m| m.len())
                    .sum();
                calls.kept_output.push_back((start.seq, bytes));
                calls.output_bytes += bytes;
            }
            if end.is_none() {
                running.push(start.clone());
            }
            calls.slots.insert(
                start.request_id,
                Slot {
                    digest: start.digest,
                    oom_before: start.oom_before,
                    ended: watch::channel(end).0,
                },
            );
        }
        Ok((calls, running))
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records the start of call `request_id` on `sandbox`, or finds it: a retry with a
    /// different `digest`, or an id another sandbox used, is a `conflict`.
    pub(crate) fn begin(
        &self,
        sandbox: &str,
        request_id: &str,
        kind: &str,
        digest: String,
        args: serde_json::Value,
        oom_before: u64,
    ) -> Result<Begin, ApiError> {
        let mut inner = self.lock();
        if let Some(owner) = inner.owners.get(request_id) {
            if owner != sandbox {
                return Err(conflict(format!(
                    "request_id {request_id:?} belongs to a call on sandbox {owner}, not \
                     {sandbox}: request ids name one call on one sandbox"
                )));
            }
        }
        if !inner.sandboxes.contains_key(sandbox) {
            let dir = self.root.join(sandbox);
            std::fs::create_dir_all(&dir).map_err(|e| io_error("mkdir", &dir, e))?;
            let log = dir.join(LOG_FILE);
            let file = OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log)
                .map_err(|e| io_error("open", &log, e))?;
            inner.sandboxes.insert(
                sandbox.to_string(),
                SandboxCalls {
                    dir,
                    file,
                    slots: HashMap::new(),
                    next_seq: 1,
                    kept_output: VecDeque::new(),
                    output_bytes: 0,
                },
            );
        }
        let Inner { sandboxes, owners } = &mut *inner;
        let Some(calls) = sandboxes.get_mut(sandbox) else {
            return Err(ApiError::new(ErrorCode::Internal, "call record vanished"));
        };
        if let Some(slot) = calls.slots.get(request_id) {
            if slot.digest != digest {
                return Err(conflict(format!(
                    "request_id {request_id:?} was used for a different call on sandbox \
                     {sandbox}: retry with the same body, or use a new id for a new call"
                )));
            }
            return Ok(Begin::Known {
                oom_before: slot.oom_before,
                ended: slot.ended.subscribe(),
            });
        }
        if calls.slots.len() >= self.max_calls {
            return Err(ApiError::new(
                ErrorCode::NoSpace,
                format!(
                    "sandbox {sandbox} has recorded {} calls, as many as its record keeps: \
                     send further calls without a request id",
                    self.max_calls
                ),
            ));
        }
        let start = StartLine {
            seq: 0,
            request_id: request_id.to_string(),
            kind: kind.to_string(),
            digest: digest.clone(),
            args,
            started_at_ms: unix_ms(),
            oom_before,
        };
        calls.slots.insert(
            request_id.to_string(),
            Slot {
                digest,
                oom_before,
                ended: watch::channel(None).0,
            },
        );
        owners.insert(request_id.to_string(), sandbox.to_string());
        Ok(Begin::New(Ticket {
            sandbox: sandbox.to_string(),
            seq: 0,
            request_id: request_id.to_string(),
            oom_before,
            unwritten: Some(Box::new(start)),
        }))
    }

    /// Sets what a new call's start line shows and the OOM-kill count its verdict is
    /// measured from, before [`CallJournal::started`] writes it (an exec's are read once
    /// its request went out). A retry that attached meanwhile keeps the count it read.
    pub(crate) fn set_start(&self, ticket: &mut Ticket, args: serde_json::Value, oom_before: u64) {
        let Some(start) = ticket.unwritten.as_mut() else {
            return;
        };
        start.args = args;
        start.oom_before = oom_before;
        ticket.oom_before = oom_before;
        if let Some(slot) = self
            .lock()
            .sandboxes
            .get_mut(&ticket.sandbox)
            .and_then(|c| c.slots.get_mut(&ticket.request_id))
        {
            slot.oom_before = oom_before;
        }
    }

    /// Writes a new call's start to its sandbox's log, where it takes the next place
    /// (`ticket.seq`): the log's order is the order calls started in. An exec's is written
    /// once its request went out, while the agent starts it: a node that dies before
    /// writing it leaves the command kept under its request id in the agent, and a retry
    /// attaches to it instead of running it again.
    pub(crate) fn started(&self, ticket: &mut Ticket) -> Result<(), ApiError> {
        let Some(mut start) = ticket.unwritten.take() else {
            return Ok(());
        };
        let mut inner = self.lock();
        let Some(calls) = inner.sandboxes.get_mut(&ticket.sandbox) else {
            return Err(ApiError::new(
                ErrorCode::NotFound,
                format!("sandbox {} went away as the call started", ticket.sandbox),
            ));
        };
        start.seq = calls.next_seq;
        let log = calls.dir.join(LOG_FILE);
        calls
            .append(&Line::Start(*start))
            .map_err(|e| io_error("append", &log, e))?;
        ticket.seq = calls.next_seq;
        calls.next_seq += 1;
        Ok(())
    }

    /// Forgets a call that failed before its command started: a retry runs it. Whoever
    /// waits on it sees it end with `error`.
    pub(crate) fn abandon(&self, ticket: &Ticket, error: &ApiError) {
        let mut inner = self.lock();
        let Inner { sandboxes, owners } = &mut *inner;
        let Some(calls) = sandboxes.get_mut(&ticket.sandbox) else {
            return;
        };
        // A call whose start was never written leaves nothing in the log.
        if ticket.seq != 0 {
            if let Err(e) = calls.append(&Line::Abandon { seq: ticket.seq }) {
                tracing::warn!(sandbox = %ticket.sandbox, error = %e, "call record: append");
            }
        }
        if let Some(slot) = calls.slots.remove(&ticket.request_id) {
            slot.ended.send_replace(Some(Arc::new(EndLine {
                seq: ticket.seq,
                ended_at_ms: unix_ms(),
                state: CallState::Lost,
                exit: None,
                oom_killed: false,
                error: Some(ApiError::new(
                    error.code,
                    format!(
                        "the first call with this request id failed before it started \
                         (retry it): {}",
                        error.message
                    ),
                )),
                reply: false,
                body_digest: None,
            })));
        }
        owners.remove(&ticket.request_id);
    }

    /// Records how a call ended (its kept output first). A sandbox forgotten meanwhile
    /// keeps nothing.
    pub(crate) fn end(&self, ticket: &Ticket, outcome: &Result<ExecResult, ApiError>) {
        if ticket.seq == 0 {
            // Its start could not be written: nothing of it can be kept. Forgotten, a
            // retry runs it (an exec's attaches to its command, kept in the agent).
            let e = ApiError::new(ErrorCode::Internal, "its start could not be logged");
            self.abandon(ticket, &e);
            return;
        }
        let dir = self.root.join(&ticket.sandbox);
        let mut bytes = 0u64;
        if let Ok(r) = outcome {
            for (stream, text) in [("stdout", &r.stdout), ("stderr", &r.stderr)] {
                if text.is_empty() {
                    continue;
                }
                let path = output_path(&dir, ticket.seq, stream);
                match std::fs::write(&path, text.as_bytes()) {
                    Ok(()) => bytes += text.len() as u64,
                    // The sandbox was destroyed meanwhile (its directory went with it).
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
                    Err(e) => {
                        tracing::warn!(path = %path.display(), error = %e, "call record: output")
                    }
                }
            }
        }
        let end = EndLine {
            seq: ticket.seq,
            ended_at_ms: unix_ms(),
            state: match outcome {
                Ok(_) => CallState::Done,
                Err(_) => CallState::Lost,
            },
            exit: outcome.as_ref().ok().map(|r| r.exit.clone()),
            oom_killed: outcome.as_ref().is_ok_and(|r| r.oom_killed),
            error: outcome.as_ref().err().cloned(),
            reply: false,
            body_digest: None,
        };
        self.finish(ticket, end, bytes);
    }

    /// Records how a call answered by one agent reply ended: the reply (kept as
    /// `SEQ.reply`), or the error the agent answered (`Done`), or why its outcome is
    /// unknown (`lost`: the connection failed after the request went out).
    pub(crate) fn end_reply(&self, ticket: &Ticket, outcome: &Result<Reply, ApiError>, lost: bool) {
        self.end_answered(ticket, outcome, lost, None);
    }

    /// Records an upload that was written: the agent's answer and the SHA-256 of the body
    /// it wrote, which a retry's body must match.
    pub(crate) fn end_upload(&self, ticket: &Ticket, written: &Reply, body_digest: String) {
        self.end_answered(ticket, &Ok(written.clone()), false, Some(body_digest));
    }

    fn end_answered(
        &self,
        ticket: &Ticket,
        outcome: &Result<Reply, ApiError>,
        lost: bool,
        body_digest: Option<String>,
    ) {
        if ticket.seq == 0 {
            // Its start could not be written: nothing of it can be kept. Forgotten, a
            // retry runs it (an exec's attaches to its command, kept in the agent).
            let e = ApiError::new(ErrorCode::Internal, "its start could not be logged");
            self.abandon(ticket, &e);
            return;
        }
        let dir = self.root.join(&ticket.sandbox);
        let mut bytes = 0;
        if let Ok(reply) = outcome {
            let path = output_path(&dir, ticket.seq, "reply");
            let json = serde_json::to_vec(reply).unwrap_or_default();
            match std::fs::write(&path, &json) {
                Ok(()) => bytes = json.len() as u64,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
                Err(e) => tracing::warn!(path = %path.display(), error = %e, "call record: reply"),
            }
        }
        let end = EndLine {
            seq: ticket.seq,
            ended_at_ms: unix_ms(),
            state: if lost {
                CallState::Lost
            } else {
                CallState::Done
            },
            exit: None,
            oom_killed: false,
            error: outcome.as_ref().err().cloned(),
            reply: outcome.is_ok(),
            body_digest,
        };
        self.finish(ticket, end, bytes);
    }

    /// Appends `end` (its kept output `bytes` long), drops the oldest output beyond the
    /// bound, and tells whoever waits.
    fn finish(&self, ticket: &Ticket, end: EndLine, bytes: u64) {
        let mut inner = self.lock();
        let Some(calls) = inner.sandboxes.get_mut(&ticket.sandbox) else {
            return;
        };
        if let Err(e) = calls.append(&Line::End(end.clone())) {
            tracing::warn!(sandbox = %ticket.sandbox, error = %e, "call record: append");
        }
        if bytes > 0 {
            calls.kept_output.push_back((ticket.seq, bytes));
            calls.output_bytes += bytes;
        }
        // Only the oldest kept output is touched here: this runs at the end of every
        // call, so nothing in it may grow with the number of calls recorded.
        while calls.output_bytes > MAX_CALL_OUTPUT_BYTES {
            let Some((seq, n)) = calls.kept_output.pop_front() else {
                break;
            };
            calls.output_bytes -= n;
            for stream in ["stdout", "stderr", "reply"] {
                let _ = std::fs::remove_file(output_path(&calls.dir, seq, stream));
            }
            let _ = calls.append(&Line::Dropped { seq });
        }
        if let Some(slot) = calls.slots.get(&ticket.request_id) {
            slot.ended.send_replace(Some(Arc::new(end)));
        }
    }

    /// The recorded result of ended call `seq`: its exit and kept output, or its error.
    pub(crate) fn result(&self, sandbox: &str, end: &EndLine) -> Result<ExecResult, ApiError> {
        if let Some(e) = &end.error {
            return Err(e.clone());
        }
        let Some(exit) = end.exit.clone() else {
            return Err(ApiError::new(
                ErrorCode::Internal,
                "call record: an ended call without its exit",
            ));
        };
        let dir = self.root.join(sandbox);
        Ok(ExecResult {
            stdout: read_output(&dir, end.seq, "stdout"),
            stderr: read_output(&dir, end.seq, "stderr"),
            exit,
            oom_killed: end.oom_killed,
        })
    }

    /// The recorded reply of ended call `end` (answered by one agent reply), or its error.
    pub(crate) fn reply(&self, sandbox: &str, end: &EndLine) -> Result<Reply, ApiError> {
        if let Some(e) = &end.error {
            return Err(e.clone());
        }
        let path = output_path(&self.root.join(sandbox), end.seq, "reply");
        let bytes = std::fs::read(&path).map_err(|e| {
            ApiError::new(
                ErrorCode::Expired,
                format!("this call's recorded answer was dropped for newer calls' ({e})"),
            )
        })?;
        serde_json::from_slice(&bytes)
            .map_err(|e| io_error("parse", &path, std::io::Error::other(e)))
    }

    /// A page of `sandbox`'s call log.
    pub(crate) fn log(&self, sandbox: &str, q: &CallLogQuery) -> Result<CallLog, ApiError> {
        let dir = self.root.join(sandbox);
        let path = dir.join(LOG_FILE);
        let lines = match read_lines(&path) {
            Ok(lines) => lines,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(io_error("read", &path, e)),
        };
        let mut records: Vec<CallRecord> = Vec::new();
        let mut at: HashMap<u64, usize> = HashMap::new();
        let mut replied: HashSet<u64> = HashSet::new();
        let after = q.after.unwrap_or(0);
        for line in lines {
            match line {
                Line::Start(s) => {
                    if s.seq <= after || q.request_id.as_ref().is_some_and(|r| *r != s.request_id) {
                        continue;
                    }
                    at.insert(s.seq, records.len());
                    records.push(CallRecord {
                        seq: s.seq,
                        request_id: s.request_id,
                        kind: s.kind,
                        args: s.args,
                        started_at_ms: s.started_at_ms,
                        ended_at_ms: None,
                        state: CallState::Running,
                        exit: None,
                        oom_killed: false,
                        error: None,
                        output_dropped: false,
                        stdout: None,
                        stderr: None,
                        reply: None,
                        body_sha256: None,
                    });
                }
                Line::End(e) => {
                    if e.reply {
                        replied.insert(e.seq);
                    }
                    if let Some(r) = at.get(&e.seq).map(|i| &mut records[*i]) {
                        r.ended_at_ms = Some(e.ended_at_ms);
                        r.state = e.state;
                        r.exit = e.exit;
                        r.oom_killed = e.oom_killed;
                        r.error = e.error;
                        r.body_sha256 = e.body_digest;
                    }
                }
                Line::Abandon { seq } => {
                    if let Some(i) = at.remove(&seq) {
                        records[i].seq = 0;
                    }
                }
                Line::Dropped { seq } => {
                    if let Some(r) = at.get(&seq).map(|i| &mut records[*i]) {
                        r.output_dropped = true;
                    }
                }
            }
        }
        records.retain(|r| r.seq != 0);
        let limit = q.limit.unwrap_or(CALL_LOG_PAGE).clamp(1, CALL_LOG_MAX_PAGE) as usize;
        let more = records.len() > limit;
        records.truncate(limit);
        if q.output {
            for r in &mut records {
                if r.state != CallState::Done || r.output_dropped {
                    continue;
                }
                if replied.contains(&r.seq) {
                    r.reply = std::fs::read(output_path(&dir, r.seq, "reply"))
                        .ok()
                        .and_then(|b| serde_json::from_slice(&b).ok());
                } else {
                    r.stdout = Some(read_output(&dir, r.seq, "stdout"));
                    r.stderr = Some(read_output(&dir, r.seq, "stderr"));
                }
            }
        }
        Ok(CallLog {
            next_after: if more {
                records.last().map(|r| r.seq)
            } else {
                None
            },
            calls: records,
        })
    }

    /// Forgets `sandbox`'s record (it was destroyed).
    pub(crate) fn forget(&self, sandbox: &str) {
        let removed = {
            let mut inner = self.lock();
            let removed = inner.sandboxes.remove(sandbox);
            if let Some(calls) = &removed {
                for rid in calls.slots.keys() {
                    inner.owners.remove(rid);
                }
            }
            removed
        };
        // Waiters see their call's sender go: the sandbox is gone.
        drop(removed);
        let dir = self.root.join(sandbox);
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(path = %dir.display(), error = %e, "removing a call record");
            }
        }
    }
}

fn read_output(dir: &Path, seq: u64, stream: &str) -> String {
    std::fs::read(output_path(dir, seq, stream))
        .map(lossy_text)
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsec_wire::v1::MAX_CALLS_PER_SANDBOX;

    #[test]
    fn a_full_record_refuses_new_ids_with_no_space_and_still_answers_retries() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (j, _) = CallJournal::open(tmp.path(), &HashSet::new(), 2).expect("open");
        for rid in ["a", "b"] {
            let Begin::New(t) = begin(&j, "sb", rid, rid).expect("begin") else {
                panic!("new");
            };
            j.end(&t, &Ok(exec_result("", 0)));
        }
        let e = begin(&j, "sb", "c", "c").expect_err("full");
        assert_eq!(e.code, ErrorCode::NoSpace);
        assert!(e.message.contains("without a request id"), "{}", e.message);
        assert!(matches!(begin(&j, "sb", "a", "a"), Ok(Begin::Known { .. })));
        // Another sandbox has a record of its own.
        assert!(matches!(begin(&j, "sb2", "c", "c"), Ok(Begin::New(_))));
    }

    fn exec_result(out: &str, code: i32) -> ExecResult {
        ExecResult {
            stdout: out.into(),
            stderr: String::new(),
            exit: ExitInfo {
                exit_code: Some(code),
                stdout_bytes: out.len() as u64,
                ..ExitInfo::default()
            },
            oom_killed: false,
        }
    }

    /// Begins a call, and logs its start if it is new.
    fn begin(j: &CallJournal, sb: &str, rid: &str, digest: &str) -> Result<Begin, ApiError> {
        match j.begin(sb, rid, "exec", digest.into(), serde_json::json!({}), 0)? {
            Begin::New(mut t) => {
                j.started(&mut t)?;
                Ok(Begin::New(t))
            }
            known => Ok(known),
        }
    }

    #[test]
    fn the_log_orders_calls_as_they_started_and_an_unlogged_call_leaves_nothing() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let keep: HashSet<String> = ["sb".to_string()].into();
        let (j, _) = CallJournal::open(tmp.path(), &keep, MAX_CALLS_PER_SANDBOX).expect("open");
        let new = |rid: &str| match j.begin("sb", rid, "exec", rid.into(), serde_json::json!({}), 0)
        {
            Ok(Begin::New(t)) => t,
            other => panic!("a new call: {other:?}"),
        };
        let (mut first, mut second, never) = (new("a"), new("b"), new("c"));
        // A retry of a call whose start is not written yet waits for it.
        assert!(matches!(begin(&j, "sb", "a", "a"), Ok(Begin::Known { .. })));
        j.started(&mut second).expect("start b");
        j.started(&mut first).expect("start a");
        assert_eq!((second.seq, first.seq), (1, 2));
        j.end(&first, &Ok(exec_result("", 0)));
        // Ended before its start was written (the log could not take it): forgotten.
        j.end(&never, &Ok(exec_result("", 0)));
        assert!(matches!(begin(&j, "sb", "c", "c"), Ok(Begin::New(_))));
        let log = j.log("sb", &CallLogQuery::default()).expect("log");
        let ids: Vec<_> = log
            .calls
            .iter()
            .map(|c| (c.seq, c.request_id.as_str()))
            .collect();
        assert_eq!(ids, [(1, "b"), (2, "a"), (3, "c")]);
        drop(j);
        let (_j, pending) =
            CallJournal::open(tmp.path(), &keep, MAX_CALLS_PER_SANDBOX).expect("reopen");
        let running: Vec<_> = pending
            .iter()
            .map(|p| p.start.request_id.as_str())
            .collect();
        assert_eq!(running, ["b", "c"]);
    }

    #[test]
    fn a_retry_finds_the_call_and_a_reopened_journal_keeps_it() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let keep: HashSet<String> = ["sb-1".to_string()].into();
        let (j, pending) =
            CallJournal::open(tmp.path(), &keep, MAX_CALLS_PER_SANDBOX).expect("open");
        assert!(pending.is_empty());
        let Begin::New(t) = begin(&j, "sb-1", "r1", "d1").expect("begin") else {
            panic!("a new call");
        };
        let Begin::New(t2) = begin(&j, "sb-1", "r2", "d2").expect("begin") else {
            panic!("a new call");
        };
        // Same id, other body: conflict; same id on another sandbox: conflict.
        let e = begin(&j, "sb-1", "r1", "other").expect_err("conflict");
        assert_eq!(e.code, ErrorCode::Conflict);
        let e = begin(&j, "sb-2", "r1", "d1").expect_err("conflict");
        assert_eq!(e.code, ErrorCode::Conflict);
        j.end(&t, &Ok(exec_result("done\n", 0)));
        let Begin::Known { ended, .. } = begin(&j, "sb-1", "r1", "d1").expect("retry") else {
            panic!("a known call");
        };
        let end = ended.borrow().clone().expect("ended");
        let r = j.result("sb-1", &end).expect("result");
        assert_eq!(r.stdout, "done\n");
        drop(j);

        // A cut-off last line (a crash mid-append) is dropped; r2 is still running.
        let log = tmp.path().join(CALLS_DIR).join("sb-1").join(LOG_FILE);
        let mut f = OpenOptions::new().append(true).open(&log).expect("log");
        f.write_all(b"{\"line\":\"end\",\"se").expect("write");
        drop(f);
        let (j, pending) =
            CallJournal::open(tmp.path(), &keep, MAX_CALLS_PER_SANDBOX).expect("reopen");
        assert_eq!(pending.len(), 1);
        assert_eq!(pending[0].start.request_id, "r2");
        let Begin::Known { ended, .. } = begin(&j, "sb-1", "r1", "d1").expect("retry") else {
            panic!("a known call");
        };
        let end = ended.borrow().clone().expect("ended");
        assert_eq!(j.result("sb-1", &end).expect("result").stdout, "done\n");
        j.end(&t2, &Ok(exec_result("", 3)));
        let log = j.log("sb-1", &CallLogQuery::default()).expect("log");
        let ids: Vec<_> = log.calls.iter().map(|c| c.request_id.as_str()).collect();
        assert_eq!(ids, ["r1", "r2"]);
        assert_eq!(
            log.calls[1].exit.as_ref().and_then(|e| e.exit_code),
            Some(3)
        );
        let page = j
            .log(
                "sb-1",
                &CallLogQuery {
                    limit: Some(1),
                    output: true,
                    ..CallLogQuery::default()
                },
            )
            .expect("page");
        assert_eq!(page.calls.len(), 1);
        assert_eq!(page.next_after, Some(1));
        assert_eq!(page.calls[0].stdout.as_deref(), Some("done\n"));

        // A sandbox not kept loses its record; a forgotten one frees its ids.
        j.forget("sb-1");
        assert!(matches!(begin(&j, "sb-2", "r1", "d1"), Ok(Begin::New(_))));
        drop(j);
        let (_j, pending) =
            CallJournal::open(tmp.path(), &HashSet::new(), MAX_CALLS_PER_SANDBOX).expect("reopen");
        assert!(pending.is_empty());
        assert!(!tmp.path().join(CALLS_DIR).join("sb-2").exists());
    }

    #[test]
    fn an_abandoned_call_runs_again_on_retry() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (j, _) =
            CallJournal::open(tmp.path(), &HashSet::new(), MAX_CALLS_PER_SANDBOX).expect("open");
        let Begin::New(t) = begin(&j, "sb", "r", "d").expect("begin") else {
            panic!("new");
        };
        j.abandon(&t, &ApiError::new(ErrorCode::AgentUnavailable, "down"));
        assert!(matches!(begin(&j, "sb", "r", "d"), Ok(Begin::New(_))));
    }

    #[test]
    fn an_upload_keeps_its_answer_and_body_digest_across_a_reopen() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let keep: HashSet<String> = ["sb".to_string()].into();
        let (j, _) = CallJournal::open(tmp.path(), &keep, MAX_CALLS_PER_SANDBOX).expect("open");
        let Begin::New(mut t) = j
            .begin(
                "sb",
                "w",
                "file_write",
                "d".into(),
                serde_json::json!({}),
                0,
            )
            .expect("begin")
        else {
            panic!("new");
        };
        j.started(&mut t).expect("started");
        j.end_upload(&t, &Reply::Written { bytes: 5 }, "abc".into());
        drop(j);
        let (j, pending) =
            CallJournal::open(tmp.path(), &keep, MAX_CALLS_PER_SANDBOX).expect("reopen");
        assert!(pending.is_empty());
        let Begin::Known { ended, .. } = j
            .begin(
                "sb",
                "w",
                "file_write",
                "d".into(),
                serde_json::json!({}),
                0,
            )
            .expect("retry")
        else {
            panic!("known");
        };
        let end = ended.borrow().clone().expect("ended");
        assert_eq!(end.body_digest.as_deref(), Some("abc"));
        assert!(matches!(
            j.reply("sb", &end),
            Ok(Reply::Written { bytes: 5 })
        ));
        let log = j.log("sb", &CallLogQuery::default()).expect("log");
        assert_eq!(log.calls[0].body_sha256.as_deref(), Some("abc"));
    }
}

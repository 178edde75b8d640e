//! Recorded execs: [`LocalNode`]'s side of calls with request ids.
//!
//! A new call's command starts as a kept exec in the agent
//! ([`Request::ExecKept`], keyed by the request id) and a driver task of the node follows
//! it to its exit and records the outcome in the [`CallJournal`](crate::calls), whether
//! or not its caller is still there. The caller waits for that outcome, or (a stream)
//! attaches to the command in the agent and gets its output from the first byte. A
//! retry of a call that ended gets the record; of one that runs, the same as its first
//! caller. After a restart the node drives the calls that were running again: the agent
//! kept their commands, so it attaches and records how they ended.

use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use sha2::{Digest, Sha256};
use tokio::sync::{oneshot, watch};

use dsec_node_api::EventStream;
use dsec_wire::agent::{ExecSpec, Reply, Request};
use dsec_wire::frame::{Frame, DATA_CHUNK};
use dsec_wire::v1::{ExecEvent, ExecResult};
use dsec_wire::{ApiError, ErrorCode};

use crate::agent_ops::{event_stream, read_exec_result, unexpected, OomWitness};
use crate::calls::{Begin, Ended, Pending, Ticket};
use crate::LocalNode;

/// How often a driver whose connection broke attaches to its command again.
const REATTACH_TRIES: u32 = 3;

/// A recorded call's outcome, for its first caller.
type Outcome = Result<ExecResult, ApiError>;

/// The digest (what a retry must repeat) and the logged arguments of an exec.
fn exec_call(spec: &ExecSpec, stdin: Option<&[u8]>) -> (String, serde_json::Value) {
    let mut spec = spec.clone();
    spec.stream = false;
    spec.stdin = stdin.is_some();
    let json = serde_json::to_vec(&spec).unwrap_or_default();
    let mut h = Sha256::new();
    h.update(&json);
    h.update([0]);
    if let Some(b) = stdin {
        h.update(b);
    }
    let digest = format!("{:x}", h.finalize());
    let mut args = serde_json::to_value(&spec).unwrap_or_default();
    if let Some(o) = args.as_object_mut() {
        o.remove("stream");
        o.remove("stdin");
        o.insert(
            "stdin_bytes".into(),
            serde_json::Value::from(stdin.map_or(0, <[u8]>::len)),
        );
    }
    (digest, args)
}

fn sandbox_gone(id: &str) -> ApiError {
    ApiError::new(
        ErrorCode::NotFound,
        format!("sandbox {id} went away while the call ran"),
    )
}

/// A call's recorded outcome replayed as a stream.
fn replay(r: ExecResult) -> EventStream {
    let mut events = Vec::with_capacity(3);
    if !r.stdout.is_empty() {
        events.push(ExecEvent::Stdout { data: r.stdout });
    }
    if !r.stderr.is_empty() {
        events.push(ExecEvent::Stderr { data: r.stderr });
    }
    events.push(ExecEvent::Exit {
        exit: r.exit,
        oom_killed: r.oom_killed,
    });
    futures::stream::iter(events).boxed()
}

impl LocalNode {
    /// Runs (once) or finds the exec recorded under `request_id`, to its exit.
    pub(crate) async fn recorded_exec(
        &self,
        id: &str,
        request_id: &str,
        spec: ExecSpec,
        stdin: Option<Bytes>,
    ) -> Outcome {
        match self.begin_exec(id, request_id, &spec, stdin.as_deref())? {
            Begin::Known { ended, .. } => self.wait_recorded(id, ended).await,
            Begin::New(ticket) => {
                let first = self.start_recorded(id, ticket, spec, stdin).await?;
                first.await.map_err(|_| sandbox_gone(id))?
            }
        }
    }

    /// [`LocalNode::recorded_exec`] as a stream, from the command's first byte.
    pub(crate) async fn recorded_exec_events(
        &self,
        id: &str,
        request_id: &str,
        spec: ExecSpec,
        stdin: Option<Bytes>,
    ) -> Result<EventStream, ApiError> {
        match self.begin_exec(id, request_id, &spec, stdin.as_deref())? {
            Begin::Known {
                ended, oom_before, ..
            } => {
                let end = ended.borrow().clone();
                match end {
                    Some(end) => Ok(replay(self.journal.result(id, &end)?)),
                    None => {
                        self.attach_events(id, request_id, oom_before, Some(ended))
                            .await
                    }
                }
            }
            Begin::New(ticket) => {
                let oom_before = ticket.oom_before;
                let ended = self.journal.watch(id, request_id);
                // The driver records the outcome; this caller follows the command.
                let _first = self.start_recorded(id, ticket, spec, stdin).await?;
                self.attach_events(id, request_id, oom_before, ended).await
            }
        }
    }

    fn begin_exec(
        &self,
        id: &str,
        request_id: &str,
        spec: &ExecSpec,
        stdin: Option<&[u8]>,
    ) -> Result<Begin, ApiError> {
        self.record(id)?;
        let (digest, args) = exec_call(spec, stdin);
        let oom_before = self.backend().oom_kill_count(id).unwrap_or(u64::MAX);
        self.journal
            .begin(id, request_id, "exec", digest, args, oom_before)
    }

    async fn wait_recorded(&self, id: &str, mut ended: watch::Receiver<Ended>) -> Outcome {
        let end = match ended.wait_for(Option::is_some).await {
            Ok(end) => end.clone(),
            Err(_) => return Err(sandbox_gone(id)),
        };
        match end {
            Some(end) => self.journal.result(id, &end),
            None => Err(sandbox_gone(id)),
        }
    }

    /// Starts a new call's command in the agent and its driver; the receiver gets the
    /// outcome. A call whose command did not start is forgotten (a retry runs it).
    async fn start_recorded(
        &self,
        id: &str,
        ticket: Ticket,
        mut spec: ExecSpec,
        stdin: Option<Bytes>,
    ) -> Result<oneshot::Receiver<Outcome>, ApiError> {
        spec.stream = false;
        spec.stdin = stdin.is_some();
        let req = Request::ExecKept {
            key: ticket.request_id.clone(),
            spec: Some(spec),
            stream: false,
        };
        let keeps = req.keeps_connection();
        let started = async {
            let mut conn = self.agent(id)?;
            conn.send(&Frame::json(&req)).await?;
            if let Some(stdin) = &stdin {
                for piece in stdin.chunks(DATA_CHUNK) {
                    conn.send(&Frame::Data(piece.to_vec())).await?;
                }
                conn.send(&Frame::Eof).await?;
            }
            conn.flush().await?;
            match conn.recv_reply().await? {
                Reply::Started { .. } => Ok(conn),
                other => Err(unexpected(other)),
            }
        }
        .await;
        let conn = match started {
            Ok(conn) => conn,
            Err(e) => {
                self.journal.abandon(&ticket, &e);
                return Err(e);
            }
        };
        let (tx, rx) = oneshot::channel();
        self.spawn_driver(ticket, Some(conn), Some(tx), keeps);
        Ok(rx)
    }

    /// Drives a call that was running when the node stopped to its end.
    pub(crate) fn redrive(&self, p: Pending) {
        let ticket = Ticket {
            sandbox: p.sandbox,
            seq: p.start.seq,
            request_id: p.start.request_id,
            oom_before: p.start.oom_before,
        };
        self.spawn_driver(ticket, None, None, true);
    }

    /// Follows a call's command to its exit (attaching to it in the agent when `conn` is
    /// `None` or breaks) and records how it ended.
    fn spawn_driver(
        &self,
        ticket: Ticket,
        conn: Option<crate::AgentConn>,
        first: Option<oneshot::Sender<Outcome>>,
        keeps: bool,
    ) {
        let me = self.me.clone();
        let oom = OomWitness {
            backend: self.backend(),
            id: ticket.sandbox.clone(),
            before: ticket.oom_before,
        };
        // The sandbox is busy while its command runs: not idle, whoever waits.
        let activity = self.lifetimes.activity(&ticket.sandbox).ok();
        let journal = self.journal.clone();
        tokio::spawn(async move {
            let _activity = activity;
            let id = ticket.sandbox.clone();
            let mut conn = conn;
            let mut tries = 0;
            let outcome = loop {
                let attached = match conn.take() {
                    Some(c) => Ok(c),
                    None => match me.upgrade() {
                        Some(node) => node
                            .attach_kept(&id, &ticket.request_id, false)
                            .await
                            .map(|(c, _)| c),
                        None => return,
                    },
                };
                let read = match attached {
                    Ok(c) => read_exec_result(c, &oom).await,
                    Err(e) => Err(e),
                };
                match read {
                    Ok((result, c)) => {
                        if keeps {
                            if let Some(node) = me.upgrade() {
                                node.reuse(&id, c);
                            }
                        }
                        break Ok(result);
                    }
                    Err(e) => {
                        let sandbox_here = me.upgrade().is_some_and(|n| n.record(&id).is_ok());
                        if e.code == ErrorCode::NotFound || !sandbox_here || tries >= REATTACH_TRIES
                        {
                            break Err(ApiError::new(
                                e.code,
                                format!("the call's outcome was lost: {}", e.message),
                            ));
                        }
                        tries += 1;
                        tokio::time::sleep(Duration::from_millis(200 * u64::from(tries))).await;
                    }
                }
            };
            journal.end(&ticket, &outcome);
            if let Some(first) = first {
                let _ = first.send(outcome);
            }
        });
    }

    /// Attaches to the command kept under `key`: a connection whose next frames are its
    /// output (live with `stream`) and exit.
    async fn attach_kept(
        &self,
        id: &str,
        key: &str,
        stream: bool,
    ) -> Result<(crate::AgentConn, u32), ApiError> {
        let mut conn = self.agent(id)?;
        conn.send_request(&Request::ExecKept {
            key: key.to_string(),
            spec: None,
            stream,
        })
        .await?;
        match conn.recv_reply().await? {
            Reply::Started { pid } => Ok((conn, pid)),
            other => Err(unexpected(other)),
        }
    }

    /// A stream of a running call's command from its first byte. If the agent no longer
    /// has it (it ended and was recorded meanwhile), the record is replayed.
    async fn attach_events(
        &self,
        id: &str,
        request_id: &str,
        oom_before: u64,
        ended: Option<watch::Receiver<Ended>>,
    ) -> Result<EventStream, ApiError> {
        let oom = OomWitness {
            backend: self.backend(),
            id: id.to_string(),
            before: oom_before,
        };
        match self.attach_kept(id, request_id, true).await {
            Ok((conn, pid)) => Ok(
                futures::stream::once(async move { ExecEvent::Started { pid } })
                    .chain(event_stream(conn, Some(oom)))
                    .boxed(),
            ),
            Err(e) if e.code == ErrorCode::NotFound => match ended {
                Some(ended) => Ok(replay(self.wait_recorded(id, ended).await?)),
                None => Err(e),
            },
            Err(e) => Err(e),
        }
    }
}

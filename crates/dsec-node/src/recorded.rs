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

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use sha2::{Digest, Sha256};
use tokio::sync::watch;

use dsec_node_api::{ByteStream, EventStream};
use dsec_wire::agent::{ExecSpec, Reply, Request};
use dsec_wire::frame::{Frame, DATA_CHUNK};
use dsec_wire::v1::{ExecEvent, ExecResult, WriteResult};
use dsec_wire::{ApiError, ErrorCode};

use crate::agent_ops::{event_stream, internal, unexpected, OomWitness};
use crate::calls::{Begin, Ended, Pending, Ticket};
use crate::events::lossy_text;
use crate::LocalNode;

/// How often a driver whose connection broke attaches to its command again.
const REATTACH_TRIES: u32 = 3;

/// A recorded call's outcome.
type Outcome = Result<ExecResult, ApiError>;

/// A future run to its end even if its caller goes away: polled in place while the
/// caller waits (no task, no hand-off), given a task of its own if the caller's future is
/// dropped first.
struct FinishOnDrop<T: Send + 'static>(Option<Pin<Box<dyn Future<Output = T> + Send>>>);

impl<T: Send + 'static> FinishOnDrop<T> {
    fn new(f: impl Future<Output = T> + Send + 'static) -> Self {
        Self(Some(Box::pin(f)))
    }

    async fn run(mut self) -> Option<T> {
        let out = self.0.as_mut()?.await;
        self.0 = None;
        Some(out)
    }
}

impl<T: Send + 'static> Drop for FinishOnDrop<T> {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            tokio::spawn(f);
        }
    }
}

/// How reading a kept exec's result failed.
enum KeptError {
    /// The agent answered an error before anything of the command: it started nothing
    /// (or, attaching, does not know the key).
    Refused(ApiError),
    /// The connection failed: the command may still run in the agent.
    Broken(ApiError),
}

/// Reads a kept exec's output and exit from `conn` (its request sent).
async fn read_kept(
    mut conn: crate::AgentConn,
    oom: &OomWitness,
) -> Result<(ExecResult, crate::AgentConn), KeptError> {
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    let mut began = false;
    loop {
        match conn.recv_some().await.map_err(KeptError::Broken)? {
            Frame::Stdout(b) => {
                began = true;
                stdout.extend_from_slice(&b);
            }
            Frame::Stderr(b) => {
                began = true;
                stderr.extend_from_slice(&b);
            }
            Frame::Json(bytes) => match serde_json::from_slice::<Reply>(&bytes) {
                Ok(Reply::Started { .. }) => began = true,
                Ok(Reply::Exited(exit)) => {
                    let result = ExecResult {
                        stdout: lossy_text(stdout),
                        stderr: lossy_text(stderr),
                        exit,
                        oom_killed: oom.killed(),
                    };
                    return Ok((result, conn));
                }
                Ok(Reply::Error(e)) if !began => return Err(KeptError::Refused(e)),
                Ok(other) => return Err(KeptError::Broken(unexpected(other))),
                Err(e) => return Err(KeptError::Broken(internal(e))),
            },
            Frame::Data(_) | Frame::Eof => {}
        }
    }
}

fn lost(e: ApiError) -> ApiError {
    ApiError::new(
        e.code,
        format!("the call's outcome was lost: {}", e.message),
    )
}

/// An exec as its call record knows it: its spec (`stream` off, `stdin` saying whether
/// it has some) serialized once, for the digest now and the logged arguments once the
/// request went out.
struct ExecCall {
    /// What a retry must repeat.
    digest: String,
    json: Vec<u8>,
    stdin_bytes: usize,
}

impl ExecCall {
    /// `spec` must have `stream` off and `stdin` set as the agent is sent it.
    fn new(spec: &ExecSpec, stdin: Option<&[u8]>) -> Self {
        let json = serde_json::to_vec(spec).unwrap_or_default();
        let mut h = Sha256::new();
        h.update(&json);
        h.update([0]);
        if let Some(b) = stdin {
            h.update(b);
        }
        Self {
            digest: format!("{:x}", h.finalize()),
            json,
            stdin_bytes: stdin.map_or(0, <[u8]>::len),
        }
    }

    /// The arguments its log line shows.
    fn args(&self) -> serde_json::Value {
        let mut args: serde_json::Value = serde_json::from_slice(&self.json).unwrap_or_default();
        if let Some(o) = args.as_object_mut() {
            o.remove("stream");
            o.remove("stdin");
            o.insert("stdin_bytes".into(), self.stdin_bytes.into());
        }
        args
    }
}

/// The spec of a recorded exec as the agent is sent it.
fn kept_spec(mut spec: ExecSpec, stdin: Option<&[u8]>) -> ExecSpec {
    spec.stream = false;
    spec.stdin = stdin.is_some();
    spec
}

/// The digest (what a retry must ask for again) and the logged arguments of a call that
/// is one agent request.
fn request_call(req: &Request) -> Result<(String, serde_json::Value), ApiError> {
    let json = serde_json::to_vec(req).map_err(internal)?;
    let digest = format!("{:x}", Sha256::digest(&json));
    let args = serde_json::to_value(req).unwrap_or_default();
    Ok((digest, args))
}

/// A recorded upload whose caller went away before it ended: forgotten (the agent
/// drops an upload that breaks off, so nothing was written), and a retry runs it.
struct ForgetOnDrop {
    journal: std::sync::Arc<crate::calls::CallJournal>,
    ticket: Option<Ticket>,
}

impl ForgetOnDrop {
    fn disarm(mut self) -> Option<Ticket> {
        self.ticket.take()
    }
}

impl Drop for ForgetOnDrop {
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            let e = ApiError::new(
                ErrorCode::AgentUnavailable,
                "the upload's caller went away before it was written",
            );
            self.journal.abandon(&ticket, &e);
        }
    }
}

/// SHA-256 (hex) of everything `body` sends.
async fn hash_stream(mut body: ByteStream) -> Result<String, ApiError> {
    let mut hasher = Sha256::new();
    while let Some(chunk) = body.next().await {
        hasher.update(chunk?);
    }
    Ok(format!("{:x}", hasher.finalize()))
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
        let spec = kept_spec(spec, stdin.as_deref());
        let call = ExecCall::new(&spec, stdin.as_deref());
        match self.begin_exec(id, request_id, &call)? {
            Begin::Known { ended, .. } => self.wait_recorded(id, ended).await,
            Begin::New(mut ticket) => {
                let keeps = stdin.is_none();
                let conn = self.send_kept(id, &ticket, spec, stdin, false).await?;
                self.log_exec_start(&mut ticket, &call);
                // The call ends here, recorded, whether or not this caller stays.
                let drive = self.drive(ticket, Some(conn), keeps);
                FinishOnDrop::new(drive)
                    .run()
                    .await
                    .unwrap_or_else(|| Err(sandbox_gone(id)))
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
        let spec = kept_spec(spec, stdin.as_deref());
        let call = ExecCall::new(&spec, stdin.as_deref());
        match self.begin_exec(id, request_id, &call)? {
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
            Begin::New(mut ticket) => {
                // This caller's connection starts the command and follows it; a driver
                // attaches once it runs and records the outcome.
                let mut conn = self.send_kept(id, &ticket, spec, stdin, true).await?;
                self.log_exec_start(&mut ticket, &call);
                let oom = OomWitness {
                    backend: self.backend(),
                    id: id.to_string(),
                    before: ticket.oom_before,
                };
                let pid = match conn.recv_reply().await {
                    Ok(Reply::Started { pid }) => pid,
                    Ok(other) => {
                        let e = unexpected(other);
                        self.journal.abandon(&ticket, &e);
                        return Err(e);
                    }
                    Err(e) => {
                        // It may run: the driver finds out.
                        tokio::spawn(self.drive(ticket, None, true));
                        return Err(e);
                    }
                };
                tokio::spawn(self.drive(ticket, None, true));
                Ok(
                    futures::stream::once(async move { ExecEvent::Started { pid } })
                        .chain(event_stream(conn, Some(oom)))
                        .boxed(),
                )
            }
        }
    }

    /// Runs (once) or finds the call recorded under `request_id` that one agent reply
    /// answers: a session command or a process start. It runs to its end (its connection
    /// kept open, so a session command is not interrupted) whether or not its caller
    /// stays.
    pub(crate) async fn recorded_call(
        &self,
        id: &str,
        request_id: &str,
        req: Request,
    ) -> Result<Reply, ApiError> {
        let kind = match &req {
            Request::SessionRun { .. } => "session_run",
            Request::ProcessStart(_) => "process_start",
            _ => {
                return Err(ApiError::new(
                    ErrorCode::BadRequest,
                    "only execs, session commands and process starts take a request id",
                ))
            }
        };
        self.known(id)?;
        let (digest, args) = request_call(&req)?;
        // The request id goes to the agent, not into the journal's digest: a retry with
        // another id is the same call.
        let req = crate::agent_ops::traced_request(req);
        let mut ticket = match self.journal.begin(id, request_id, kind, digest, args, 0)? {
            Begin::Known { ended, .. } => {
                let end = self.wait_ended(id, ended).await?;
                return self.journal.reply(id, &end);
            }
            Begin::New(ticket) => ticket,
        };
        // The agent would run it again: logged before it is sent.
        if let Err(e) = self.journal.started(&mut ticket) {
            self.journal.abandon(&ticket, &e);
            return Err(e);
        }
        // A connection that cannot be had sent nothing: a retry may run it.
        let mut conn = match self.agent(id) {
            Ok(conn) => conn,
            Err(e) => {
                let e = ApiError::from(e);
                self.journal.abandon(&ticket, &e);
                return Err(e);
            }
        };
        let me = self.me.clone();
        let journal = self.journal.clone();
        let activity = self.lifetimes.activity(id).ok();
        let call = async move {
            let _activity = activity;
            let sent = conn.send_request(&req).await;
            let outcome = match sent {
                Ok(()) => conn.recv_reply().await,
                Err(e) => Err(e),
            };
            // An answer of the agent (even an error) is the call's outcome; a connection
            // that failed once the request went out leaves it unknown.
            let lost = match &outcome {
                Ok(_) => false,
                Err(e) => matches!(e.code, ErrorCode::AgentUnavailable | ErrorCode::Internal),
            };
            journal.end_reply(&ticket, &outcome, lost);
            if outcome.is_ok() && req.keeps_connection() {
                if let Some(node) = me.upgrade() {
                    node.reuse(&ticket.sandbox, conn);
                }
            }
            outcome
        };
        FinishOnDrop::new(call)
            .run()
            .await
            .unwrap_or_else(|| Err(sandbox_gone(id)))
    }

    /// Runs (once) or finds the upload recorded under `request_id`: a file write or a
    /// tar upload ([`Request::FileWrite`], [`Request::TarUpload`]). Uploads are all or
    /// nothing, so only a written one is recorded; one that failed or broke off wrote
    /// nothing and is forgotten, and a retry runs it. A retry of a written one must send
    /// the same bytes (compared by SHA-256 as they arrive) and gets the first answer
    /// without writing again; other bytes under the same id are a `conflict`.
    pub(crate) async fn recorded_upload(
        &self,
        id: &str,
        request_id: &str,
        req: Request,
        body: ByteStream,
    ) -> Result<WriteResult, ApiError> {
        let kind = match &req {
            Request::FileWrite { .. } => "file_write",
            Request::TarUpload { .. } => "tar_upload",
            _ => {
                return Err(ApiError::new(
                    ErrorCode::BadRequest,
                    "only file writes and tar uploads are recorded uploads",
                ))
            }
        };
        self.known(id)?;
        let (digest, args) = request_call(&req)?;
        let mut ticket = loop {
            let ended =
                match self
                    .journal
                    .begin(id, request_id, kind, digest.clone(), args.clone(), 0)?
                {
                    Begin::New(ticket) => break ticket,
                    Begin::Known { ended, .. } => ended,
                };
            // A first upload that is still arriving (its caller may be gone) either
            // ends written or is forgotten; then this one runs.
            let end = self.wait_ended(id, ended).await?;
            if !end.reply {
                continue;
            }
            let sent = hash_stream(body).await?;
            if end.body_digest.as_deref() != Some(sent.as_str()) {
                return Err(ApiError::new(
                    ErrorCode::Conflict,
                    format!(
                        "request_id {request_id:?} was used for an upload of other bytes on \
                         sandbox {id}: retry with the same body, or use a new id"
                    ),
                ));
            }
            return match self.journal.reply(id, &end)? {
                Reply::Written { bytes } => Ok(WriteResult { bytes }),
                other => Err(unexpected(other)),
            };
        };
        if let Err(e) = self.journal.started(&mut ticket) {
            self.journal.abandon(&ticket, &e);
            return Err(e);
        }
        let hasher = std::sync::Arc::new(std::sync::Mutex::new(Sha256::new()));
        let fed = hasher.clone();
        let body = body
            .inspect(move |chunk| {
                if let Ok(bytes) = chunk {
                    fed.lock().unwrap_or_else(|e| e.into_inner()).update(bytes);
                }
            })
            .boxed();
        let pending = ForgetOnDrop {
            journal: self.journal.clone(),
            ticket: Some(ticket),
        };
        let outcome = self.upload(id, req, body).await;
        let Some(ticket) = pending.disarm() else {
            return outcome;
        };
        match &outcome {
            Ok(w) => {
                let digest = std::mem::take(&mut *hasher.lock().unwrap_or_else(|e| e.into_inner()));
                let body_digest = format!("{:x}", digest.finalize());
                self.journal
                    .end_upload(&ticket, &Reply::Written { bytes: w.bytes }, body_digest);
            }
            Err(e) => self.journal.abandon(&ticket, e),
        }
        outcome
    }

    /// The end of a recorded call, once it has one.
    async fn wait_ended(
        &self,
        id: &str,
        mut ended: watch::Receiver<Ended>,
    ) -> Result<std::sync::Arc<crate::calls::EndLine>, ApiError> {
        match ended.wait_for(Option::is_some).await {
            Ok(end) => end.clone().ok_or_else(|| sandbox_gone(id)),
            Err(_) => Err(sandbox_gone(id)),
        }
    }

    /// Begins an exec's record. Its arguments and the sandbox's OOM-kill count are read
    /// once its request went out ([`LocalNode::log_exec_start`]), while the agent starts
    /// it, not before.
    fn begin_exec(&self, id: &str, request_id: &str, call: &ExecCall) -> Result<Begin, ApiError> {
        self.known(id)?;
        self.journal.begin(
            id,
            request_id,
            "exec",
            call.digest.clone(),
            serde_json::Value::Null,
            u64::MAX,
        )
    }

    /// [`LocalNode::log_start`] for an exec: its arguments, and the OOM-kill count its
    /// verdict is measured from (read before the command can have allocated anything:
    /// the agent has not forked it yet).
    fn log_exec_start(&self, ticket: &mut Ticket, call: &ExecCall) {
        let oom_before = self
            .backend()
            .oom_kill_count(&ticket.sandbox)
            .unwrap_or(u64::MAX);
        self.journal.set_start(ticket, call.args(), oom_before);
        self.log_start(ticket);
    }

    async fn wait_recorded(&self, id: &str, ended: watch::Receiver<Ended>) -> Outcome {
        let end = self.wait_ended(id, ended).await?;
        self.journal.result(id, &end)
    }

    /// Logs the start of an exec whose request went out. One that cannot be logged still
    /// runs (its command is on its way); it is forgotten when it ends, and a retry
    /// attaches to its command in the agent.
    fn log_start(&self, ticket: &mut Ticket) {
        if let Err(e) = self.journal.started(ticket) {
            tracing::warn!(sandbox = %ticket.sandbox, error = %e.message, "call record: start");
        }
    }

    /// Sends a new call's command to the agent as a kept exec (its stdin too). A call
    /// whose request could not be sent is forgotten (a retry runs it; the agent keeps one
    /// command per key, so a request that did arrive is attached to, not run again).
    async fn send_kept(
        &self,
        id: &str,
        ticket: &Ticket,
        spec: ExecSpec,
        stdin: Option<Bytes>,
        stream: bool,
    ) -> Result<crate::AgentConn, ApiError> {
        let req = Request::ExecKept {
            key: ticket.request_id.clone(),
            spec: Some(crate::agent_ops::traced(spec)),
            stream,
        };
        let sent = async {
            let mut conn = self.agent(id)?;
            conn.send(&Frame::json(&req)).await?;
            if let Some(stdin) = &stdin {
                for piece in stdin.chunks(DATA_CHUNK) {
                    conn.send(&Frame::Data(piece.to_vec())).await?;
                }
                conn.send(&Frame::Eof).await?;
            }
            conn.flush().await?;
            Ok::<_, ApiError>(conn)
        }
        .await;
        sent.inspect_err(|e| self.journal.abandon(ticket, e))
    }

    /// Drives a call that was running when the node stopped to its end.
    pub(crate) fn redrive(&self, p: Pending) {
        let (kind, ticket) = p.into_ticket();
        if kind == "file_write" || kind == "tar_upload" {
            // The agent dropped the upload with the node's connection: nothing was
            // written, and a retry runs it.
            let e = ApiError::new(
                ErrorCode::AgentUnavailable,
                "the node stopped before the upload ended",
            );
            self.journal.abandon(&ticket, &e);
            return;
        }
        if kind != "exec" {
            // A session command or process start whose reply the stopped node never
            // read: the agent keeps no such answer.
            let e = ApiError::new(
                ErrorCode::AgentUnavailable,
                format!("the call's outcome was lost: the node stopped before its {kind} answered"),
            );
            self.journal.end_reply(&ticket, &Err(e), true);
            return;
        }
        tokio::spawn(self.drive(ticket, None, true));
    }

    /// Follows a call's command to its exit (on `conn`, whose request this driver sent,
    /// or attached to it in the agent, also after `conn` breaks) and records how it ended.
    fn drive(
        &self,
        ticket: Ticket,
        conn: Option<crate::AgentConn>,
        keeps: bool,
    ) -> impl Future<Output = Outcome> + Send + 'static {
        let me = self.me.clone();
        let oom = OomWitness {
            backend: self.backend(),
            id: ticket.sandbox.clone(),
            before: ticket.oom_before,
        };
        // The sandbox is busy while its command runs: not idle, whoever waits.
        let activity = self.lifetimes.activity(&ticket.sandbox).ok();
        let journal = self.journal.clone();
        async move {
            let _activity = activity;
            let id = ticket.sandbox.clone();
            let sent_here = conn.is_some();
            let mut conn = conn;
            let mut tries = 0;
            let outcome = loop {
                let attached = match conn.take() {
                    Some(c) => Ok(c),
                    None => match me.upgrade() {
                        Some(node) => node.send_attach(&id, &ticket.request_id, false).await,
                        None => return Err(sandbox_gone(&id)),
                    },
                };
                let read = match attached {
                    Ok(c) => read_kept(c, &oom).await,
                    Err(e) => Err(KeptError::Broken(e)),
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
                    // Its own request refused: nothing ran, a retry may run it.
                    Err(KeptError::Refused(e)) if sent_here && tries == 0 => {
                        journal.abandon(&ticket, &e);
                        return Err(e);
                    }
                    Err(KeptError::Refused(e)) => break Err(lost(e)),
                    Err(KeptError::Broken(e)) => {
                        let here = me.upgrade().is_some_and(|n| n.known(&id).is_ok());
                        if !here || tries >= REATTACH_TRIES {
                            break Err(lost(e));
                        }
                        tries += 1;
                        tokio::time::sleep(Duration::from_millis(200 * u64::from(tries))).await;
                    }
                }
            };
            journal.end(&ticket, &outcome);
            outcome
        }
    }

    /// Sends an attachment to the command kept under `key`.
    async fn send_attach(
        &self,
        id: &str,
        key: &str,
        stream: bool,
    ) -> Result<crate::AgentConn, ApiError> {
        let mut conn = self.agent(id)?;
        conn.send_request(&Request::ExecKept {
            key: key.to_string(),
            spec: None,
            stream,
        })
        .await?;
        Ok(conn)
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
        let mut conn = self.send_attach(id, request_id, true).await?;
        match conn.recv_reply().await {
            Ok(Reply::Started { pid }) => {
                Ok(
                    futures::stream::once(async move { ExecEvent::Started { pid } })
                        .chain(event_stream(conn, Some(oom)))
                        .boxed(),
                )
            }
            Ok(Reply::Error(e)) if e.code == ErrorCode::NotFound => match ended {
                Some(ended) => Ok(replay(self.wait_recorded(id, ended).await?)),
                None => Err(e),
            },
            Ok(other) => Err(unexpected(other)),
            Err(e) => Err(e),
        }
    }
}

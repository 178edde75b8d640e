//! The agent operations of [`LocalNode`]: each [`dsec_node_api::NodeApi`] call that
//! reaches into a sandbox, carried out over the frame protocol on an [`AgentConn`].
//!
//! This module owns the frame choreography (request, input as `Data` frames then `Eof`,
//! replies and output frames) and connection reuse; nothing above the node sees a frame.
//! An exec's OOM verdict is read here too (the cgroup's OOM counter before and after), so
//! it arrives with the exit. Deadlines and the watchdog are the caller's: dropping a
//! future or stream of this module drops its connection, which stops the command or
//! transfer in the sandbox.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use dsec_node_api::{ByteStream, EventStream};
use dsec_wire::agent::{ExecSpec, FileInfo, Reply, Request};
use dsec_wire::frame::{Frame, DATA_CHUNK};
use dsec_wire::v1::{ExecResult, WriteResult};
use dsec_wire::{ApiError, ErrorCode};

use crate::backend::Backend;
use crate::events::{error_event, lossy_text, Converted, EventConverter};
use crate::{AgentConn, LocalNode, NodeError};

/// How long a refused upload's answer is waited for once the upload itself broke off.
const AGENT_ANSWER_GRACE: Duration = Duration::from_millis(50);

/// Why sending an upload stopped.
enum PumpError {
    /// The body (the client's upload) failed.
    Body(ApiError),
    /// Sending to the agent failed.
    Agent(ApiError),
}

pub(crate) fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError::new(ErrorCode::Internal, e.to_string())
}

pub(crate) fn unexpected(reply: Reply) -> ApiError {
    match reply {
        Reply::Error(e) => e,
        other => internal(format!("unexpected agent reply: {other:?}")),
    }
}

fn closed_early() -> ApiError {
    ApiError::new(ErrorCode::AgentUnavailable, "agent closed the stream early")
}

/// Counts OOM kills of one sandbox, for an exec's verdict.
#[derive(Clone)]
pub(crate) struct OomWitness {
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) id: String,
    pub(crate) before: u64,
}

impl OomWitness {
    /// Whether the memory limit killed a process since the witness was made. A shell
    /// reports its OOM-killed child as exit 137, not as a signal: the cgroup's counter is
    /// the reliable witness.
    pub(crate) fn killed(&self) -> bool {
        self.backend
            .oom_kill_count(&self.id)
            .map(|n| n > self.before)
            .unwrap_or(false)
    }
}

impl LocalNode {
    /// A connection to a sandbox's agent: the idle one kept by [`LocalNode::reuse`] if it
    /// is still good, else a new one.
    pub(crate) fn agent(&self, id: &str) -> Result<AgentConn, NodeError> {
        // A kept connection exists only while the sandbox's record does.
        let idle = self.idle_lock().get_mut(id).and_then(Option::take);
        if let Some(conn) = idle.filter(AgentConn::is_reusable) {
            return Ok(conn);
        }
        let rec = self.record(id)?;
        let stream = crate::agent_conn::connect_now(&rec.agent_socket).map_err(|source| {
            NodeError::Agent {
                id: id.to_string(),
                source,
            }
        })?;
        Ok(AgentConn::new(stream))
    }

    /// Hands back a connection whose last request
    /// [`keeps_connection`](Request::keeps_connection) and whose reply was read to its
    /// end, for the sandbox's next request.
    pub(crate) fn reuse(&self, id: &str, conn: AgentConn) {
        let recs = self.lock();
        // Kept only for a sandbox still here whose agent keeps connections; the one
        // replaced (or this one) is closed outside the locks.
        let closed = match self.idle_lock().get_mut(id) {
            Some(slot) if recs.contains_key(id) => slot.replace(conn),
            _ => Some(conn),
        };
        drop(recs);
        drop(closed);
    }

    pub(crate) fn oom_witness(&self, id: &str) -> OomWitness {
        let backend = self.backend();
        let before = backend.oom_kill_count(id).unwrap_or(u64::MAX);
        OomWitness {
            backend,
            id: id.to_string(),
            before,
        }
    }

    /// One request and its reply.
    pub(crate) async fn agent_call(&self, id: &str, req: &Request) -> Result<Reply, ApiError> {
        let mut conn = self.agent(id)?;
        let reply = match req {
            Request::ProcessStart(_) => conn.request(&traced_request(req.clone())).await?,
            _ => conn.request(req).await?,
        };
        if req.keeps_connection() {
            self.reuse(id, conn);
        }
        Ok(reply)
    }

    /// Sends an exec request and its stdin.
    async fn start_exec(
        &self,
        id: &str,
        spec: ExecSpec,
        stdin: Option<Bytes>,
    ) -> Result<(AgentConn, bool), ApiError> {
        let request = Request::Exec(traced(spec));
        let mut conn = self.agent(id)?;
        conn.send(&Frame::json(&request)).await?;
        if let Some(stdin) = &stdin {
            for piece in stdin.chunks(DATA_CHUNK) {
                conn.send(&Frame::Data(piece.to_vec())).await?;
            }
            conn.send(&Frame::Eof).await?;
        }
        conn.flush().await?;
        Ok((conn, request.keeps_connection()))
    }

    /// Runs an exec to its exit and collects its output.
    pub(crate) async fn exec_to_exit(
        &self,
        id: &str,
        mut spec: ExecSpec,
        stdin: Option<Bytes>,
    ) -> Result<ExecResult, ApiError> {
        spec.stream = false;
        spec.stdin = stdin.is_some();
        let oom = self.oom_witness(id);
        let (conn, keeps) = self.start_exec(id, spec, stdin).await?;
        let (result, conn) = read_exec_result(conn, &oom).await?;
        // The exchange is complete: the connection can carry the next.
        if keeps {
            self.reuse(id, conn);
        }
        Ok(result)
    }

    /// Starts an exec whose output streams.
    pub(crate) async fn exec_events(
        &self,
        id: &str,
        mut spec: ExecSpec,
        stdin: Option<Bytes>,
    ) -> Result<EventStream, ApiError> {
        spec.stream = true;
        spec.stdin = stdin.is_some();
        let oom = self.oom_witness(id);
        let (conn, _) = self.start_exec(id, spec, stdin).await?;
        Ok(event_stream(conn, Some(oom)))
    }

    /// A background process's output.
    pub(crate) async fn output_events(
        &self,
        id: &str,
        req: Request,
    ) -> Result<EventStream, ApiError> {
        let mut conn = self.agent(id)?;
        conn.send_request(&req).await?;
        Ok(event_stream(conn, None))
    }

    /// Writes to a background process's stdin.
    pub(crate) async fn stdin(
        &self,
        id: &str,
        pid: u32,
        data: Bytes,
        close: bool,
    ) -> Result<(), ApiError> {
        let mut conn = self.agent(id)?;
        conn.send(&Frame::json(&Request::ProcessStdin { pid, close }))
            .await?;
        pump(&mut conn, dsec_node_api::once_bytes(data)).await?;
        match conn.recv_reply().await? {
            Reply::Ok => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    /// A file's metadata, then its bytes.
    pub(crate) async fn file_read(
        &self,
        id: &str,
        req: Request,
    ) -> Result<(FileInfo, ByteStream), ApiError> {
        let mut conn = self.agent(id)?;
        conn.send_request(&req).await?;
        match conn.recv_reply().await? {
            Reply::File(info) => Ok((info, data_stream(conn))),
            other => Err(unexpected(other)),
        }
    }

    /// Sends `req`, then `body` as Data frames, and returns the agent's byte count.
    pub(crate) async fn upload(
        &self,
        id: &str,
        req: Request,
        body: ByteStream,
    ) -> Result<WriteResult, ApiError> {
        let mut conn = self.agent(id)?;
        conn.send(&Frame::json(&req)).await?;
        match pump(&mut conn, body).await {
            Ok(()) => {}
            // The agent stopped reading, most likely because it refused (e.g. no space):
            // prefer its reason.
            Err(PumpError::Agent(e)) => {
                if let Ok(Reply::Error(agent_err)) | Err(agent_err) = conn.recv_reply().await {
                    return Err(agent_err);
                }
                return Err(e);
            }
            // The upload itself broke off (its client went away). The agent still waits
            // for data, so waiting for its answer would hang: take one only if it is
            // already there, and drop the connection, which makes the agent remove its
            // temporary file.
            Err(PumpError::Body(e)) => {
                let answered = tokio::time::timeout(AGENT_ANSWER_GRACE, conn.recv_reply()).await;
                if let Ok(Ok(Reply::Error(agent_err))) = answered {
                    return Err(agent_err);
                }
                return Err(e);
            }
        }
        match conn.recv_reply().await? {
            Reply::Written { bytes } => Ok(WriteResult { bytes }),
            other => Err(unexpected(other)),
        }
    }

    /// A tar of `path`, its first frame read before answering.
    pub(crate) async fn tar_download(&self, id: &str, path: &str) -> Result<ByteStream, ApiError> {
        let mut conn = self.agent(id)?;
        conn.send_request(&Request::TarDownload {
            path: path.to_string(),
        })
        .await?;
        // The agent's first frame says whether the path can be archived at all: an error
        // then is answered as such, before any byte goes out.
        let first = match conn.recv().await? {
            Some(Frame::Json(j)) => match serde_json::from_slice::<Reply>(&j) {
                Ok(other) => return Err(unexpected(other)),
                Err(e) => return Err(internal(format!("bad agent reply: {e}"))),
            },
            Some(Frame::Eof) => return Ok(futures::stream::empty().boxed()),
            Some(Frame::Data(b)) => Bytes::from(b),
            Some(_) => return Err(internal("unexpected frame in data stream")),
            None => return Err(closed_early()),
        };
        Ok(futures::stream::once(async move { Ok(first) })
            .chain(data_stream(conn))
            .boxed())
    }

    /// Pings the agent; the error says what went wrong.
    pub(crate) async fn agent_ping(&self, id: &str) -> Result<(), ApiError> {
        let unavailable = |what: String| ApiError::new(ErrorCode::AgentUnavailable, what);
        let mut conn = self
            .agent(id)
            .map_err(|e| unavailable(format!("cannot connect to its agent: {e}")))?;
        match conn.request(&Request::Ping).await {
            Ok(Reply::Pong { .. }) => {
                self.reuse(id, conn);
                Ok(())
            }
            Ok(other) => Err(unavailable(format!(
                "its agent answered a ping with {other:?}"
            ))),
            Err(e) => Err(unavailable(format!(
                "its agent failed a ping: {}",
                e.message
            ))),
        }
    }
}

/// `spec` with the id of the request being served ([`dsec_wire::agent::REQUEST_ID_ENV`])
/// and its trace context ([`dsec_wire::agent::TRACEPARENT_ENV`]) in its environment,
/// unless the caller set those variables.
pub(crate) fn traced(mut spec: ExecSpec) -> ExecSpec {
    add_request_env(&mut spec.env);
    spec
}

/// `req` with the request's id and trace context in its command's environment, for the
/// requests that start one outside [`traced`]'s execs (a process start).
pub(crate) fn traced_request(req: Request) -> Request {
    match req {
        Request::ProcessStart(mut spec) => {
            add_request_env(&mut spec.env);
            Request::ProcessStart(spec)
        }
        other => other,
    }
}

fn add_request_env(env: &mut std::collections::BTreeMap<String, String>) {
    use dsec_node_api::request_id;
    if let Some(id) = request_id::current() {
        env.entry(dsec_wire::agent::REQUEST_ID_ENV.to_string())
            .or_insert_with(|| id.to_string());
    }
    if let Some(tp) = request_id::traceparent() {
        env.entry(dsec_wire::agent::TRACEPARENT_ENV.to_string())
            .or_insert_with(|| tp.to_string());
    }
}

/// Reads an exec's output and exit from `conn` (its request sent): its result, and the
/// connection, free for the next request if the request keeps it.
pub(crate) async fn read_exec_result(
    mut conn: AgentConn,
    oom: &OomWitness,
) -> Result<(ExecResult, AgentConn), ApiError> {
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    loop {
        match conn.recv_some().await? {
            Frame::Stdout(b) => stdout.extend_from_slice(&b),
            Frame::Stderr(b) => stderr.extend_from_slice(&b),
            Frame::Json(bytes) => {
                match serde_json::from_slice::<Reply>(&bytes).map_err(internal)? {
                    Reply::Started { .. } => {}
                    Reply::Exited(exit) => {
                        let result = ExecResult {
                            stdout: lossy_text(stdout),
                            stderr: lossy_text(stderr),
                            exit,
                            oom_killed: oom.killed(),
                        };
                        return Ok((result, conn));
                    }
                    other => return Err(unexpected(other)),
                }
            }
            Frame::Data(_) | Frame::Eof => {}
        }
    }
}

/// Sends `body` as Data frames then Eof on `conn`.
async fn pump(conn: &mut AgentConn, mut body: ByteStream) -> Result<(), PumpError> {
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(PumpError::Body)?;
        for piece in chunk.chunks(DATA_CHUNK) {
            conn.send(&Frame::Data(piece.to_vec()))
                .await
                .map_err(PumpError::Agent)?;
        }
    }
    conn.send(&Frame::Eof).await.map_err(PumpError::Agent)?;
    conn.flush().await.map_err(PumpError::Agent)
}

impl From<PumpError> for ApiError {
    fn from(e: PumpError) -> Self {
        match e {
            PumpError::Body(e) | PumpError::Agent(e) => e,
        }
    }
}

/// Turns the Data frames of `conn` (until Eof) into a byte stream.
fn data_stream(mut conn: AgentConn) -> ByteStream {
    let (tx, rx) = mpsc::channel::<Result<Bytes, ApiError>>(8);
    tokio::spawn(async move {
        loop {
            let received = tokio::select! {
                r = conn.recv() => r,
                // The reader went away: dropping the connection stops the transfer.
                () = tx.closed() => return,
            };
            let item = match received {
                Ok(Some(Frame::Data(b))) => Ok(Bytes::from(b)),
                Ok(Some(Frame::Eof)) => return,
                Ok(Some(Frame::Json(j))) => match serde_json::from_slice::<Reply>(&j) {
                    Ok(Reply::Error(e)) => Err(e),
                    _ => Err(internal("unexpected frame in data stream")),
                },
                Ok(Some(_)) => Err(internal("unexpected frame in data stream")),
                Ok(None) => Err(closed_early()),
                Err(e) => Err(e),
            };
            let stop = item.is_err();
            if tx.send(item).await.is_err() || stop {
                return;
            }
        }
    });
    ReceiverStream::new(rx).boxed()
}

/// Converts the frames of an exec or output stream into events; `oom` (an exec's) gives
/// the exit its OOM verdict.
pub(crate) fn event_stream(mut conn: AgentConn, oom: Option<OomWitness>) -> EventStream {
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(async move {
        let mut conv = EventConverter::default();
        loop {
            let received = tokio::select! {
                r = conn.recv() => r,
                // The caller went away while the command is silent (`sleep 300`):
                // dropping the connection stops the exec too.
                () = tx.closed() => return,
            };
            let frame = match received {
                Ok(Some(f)) => f,
                Ok(None) => {
                    let _ = tx
                        .send(error_event("agent closed the stream early".into()))
                        .await;
                    return;
                }
                Err(error) => {
                    let _ = tx.send(dsec_wire::v1::ExecEvent::Error { error }).await;
                    return;
                }
            };
            let (events, done) =
                match conv.frame(frame, || oom.as_ref().is_some_and(OomWitness::killed)) {
                    Converted::Events(e) => (e, false),
                    Converted::Done(e) => (e, true),
                };
            for ev in events {
                // The caller went away: dropping the connection stops the exec.
                if tx.send(ev).await.is_err() {
                    return;
                }
            }
            if done {
                return;
            }
        }
    });
    ReceiverStream::new(rx).boxed()
}

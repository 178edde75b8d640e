//! [`ControlPlane`]: records, lifetimes and API-to-agent translation.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use bytes::Bytes;
use dsec_node::{AgentConn, NodeApi, NodeCreateSpec};
use dsec_state::{Entry, Expect, StateError, StateStore};
use dsec_wire::agent::{self, ExecSpec, ProcessSpec, Reply, Request};
use dsec_wire::frame::{Frame, DATA_CHUNK};
use dsec_wire::v1::*;
use dsec_wire::{ApiError, ErrorCode};
use futures::StreamExt;
use rand::Rng;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::api::{ApiResult, ByteStream, EventStream, ImportStream, SandboxApi};
use crate::convert::{error_event, Converted, EventConverter};
use crate::validate;

mod liveness;
use liveness::{Limit, Watchdog};

const NS_SANDBOXES: &str = "sandboxes";
const NS_TOMBSTONES: &str = "tombstones";
/// Sandboxes a job suspend or resume works on at once.
const JOB_PARALLELISM: usize = 8;
/// How long `expired` is remembered for a sandbox the reaper removed.
const TOMBSTONE_TTL_MS: u64 = 24 * 3600 * 1000;

/// Defaults and knobs of the control plane.
#[derive(Debug, Clone)]
pub struct ControlConfig {
    /// The API key requests must carry.
    pub api_key: String,
    /// Default CPU limit, cores.
    pub default_cpu: f64,
    /// Default memory limit, MiB.
    pub default_memory_mb: u64,
    /// Default process limit.
    pub default_pids: u64,
    /// Image used when a create names none.
    pub default_image: String,
    /// How often the reaper looks for expired sandboxes.
    pub reap_interval: Duration,
    /// Whether a job suspend stops its sandboxes' lifetimes (so a preempted trainer finds
    /// them when it is back). When false, lifetimes run on and expire as usual.
    pub job_suspend_stops_lifetime: bool,
}

impl ControlConfig {
    /// Defaults with the given key.
    pub fn with_key(api_key: String) -> Self {
        Self {
            api_key,
            default_cpu: 1.0,
            default_memory_mb: 512,
            default_pids: 512,
            default_image: "base".into(),
            reap_interval: Duration::from_secs(1),
            job_suspend_stops_lifetime: true,
        }
    }
}

/// Persisted record of a sandbox (the API view plus what create needs to remember).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Record {
    sandbox: Sandbox,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Tombstone {
    reason: String,
    at: u64,
}

/// The control plane over one node.
#[derive(Debug)]
pub struct ControlPlane {
    cfg: ControlConfig,
    node: Arc<dyn NodeApi>,
    store: Arc<dyn StateStore>,
    /// Cache of the store's sandbox records (the store is written on every change).
    records: Mutex<HashMap<String, Sandbox>>,
    tombstones: Mutex<HashMap<String, Tombstone>>,
    /// Digest of the create request behind each idempotency key used since start.
    fingerprints: Mutex<HashMap<String, [u8; 32]>>,
    /// Times a sandbox became `unhealthy` since the start.
    unhealthy_marks: std::sync::atomic::AtomicU64,
    /// This plane itself, for the tasks of [`ControlPlane::to_end`].
    me: Weak<ControlPlane>,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Why streaming a body to the agent stopped.
enum PumpError {
    /// The body (the client's upload) failed.
    Body(ApiError),
    /// Sending to the agent failed.
    Agent(ApiError),
}

impl From<PumpError> for ApiError {
    fn from(e: PumpError) -> Self {
        match e {
            PumpError::Body(e) | PumpError::Agent(e) => e,
        }
    }
}

/// How long an upload whose body broke off waits for an answer the agent may already
/// have sent.
const AGENT_ANSWER_GRACE: Duration = Duration::from_millis(50);

fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError::new(ErrorCode::Internal, e.to_string())
}

fn new_id() -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::thread_rng();
    let suffix: String = (0..12)
        .map(|_| ALPHABET[rng.gen_range(0..ALPHABET.len())] as char)
        .collect();
    format!("sb-{suffix}")
}

fn unexpected(reply: Reply) -> ApiError {
    ApiError::new(
        ErrorCode::Internal,
        format!("unexpected agent reply: {reply:?}"),
    )
}

fn ms_from_s(field: &str, s: Option<f64>) -> ApiResult<Option<u64>> {
    s.map(|v| validate::seconds(field, v)).transpose()
}

impl ControlPlane {
    /// Opens the control plane: loads records, reconciles them with what the node runs
    /// (records without a sandbox fail, sandboxes without a record are destroyed), and
    /// starts the lifetime reaper.
    pub async fn open(
        cfg: ControlConfig,
        node: Arc<dyn NodeApi>,
        store: Arc<dyn StateStore>,
    ) -> ApiResult<Arc<Self>> {
        let mut records = HashMap::new();
        for Entry {
            key: id,
            value: bytes,
            ..
        } in store.list(NS_SANDBOXES).await.map_err(internal)?.0
        {
            match serde_json::from_slice::<Record>(&bytes) {
                Ok(r) => {
                    records.insert(id, r.sandbox);
                }
                Err(e) => tracing::warn!(%id, error = %e, "dropping unreadable sandbox record"),
            }
        }
        let mut tombstones = HashMap::new();
        for Entry {
            key: id,
            value: bytes,
            ..
        } in store.list(NS_TOMBSTONES).await.map_err(internal)?.0
        {
            if let Ok(t) = serde_json::from_slice::<Tombstone>(&bytes) {
                tombstones.insert(id, t);
            }
        }
        let running: HashMap<String, bool> = node
            .list()
            .await
            .into_iter()
            .map(|s| (s.id, s.alive))
            .collect();
        for (id, alive) in &running {
            if !records.contains_key(id) {
                tracing::info!(%id, "destroying sandbox without a record");
                node.destroy(id).await.map_err(ApiError::from)?;
            } else if !alive {
                tracing::info!(%id, "sandbox died while the server was down");
            }
        }
        let now = now_ms();
        let plane = Arc::new_cyclic(|me| Self {
            cfg,
            node,
            store,
            records: Mutex::new(HashMap::new()),
            tombstones: Mutex::new(tombstones),
            fingerprints: Mutex::new(HashMap::new()),
            unhealthy_marks: Default::default(),
            me: me.clone(),
        });
        for (id, mut sb) in records {
            match running.get(&id) {
                // Still `creating`: the server died before the create answered, so nobody
                // was told of this sandbox, and whether its initial files were placed is
                // unknown. Whatever the node holds of it goes, and the record with it: a
                // retry with the same idempotency key makes a new sandbox, and no record
                // stays `creating` with no create to finish it.
                _ if sb.state == SandboxState::Creating => {
                    tracing::info!(%id, "removing half-created sandbox");
                    match plane.node.destroy(&id).await {
                        Ok(()) => {
                            plane.unstore(NS_SANDBOXES, &id).await?;
                            continue;
                        }
                        // Kept, failed, for a delete or its lifetime's end to retry.
                        Err(e) => {
                            tracing::warn!(%id, error = %e, "removing half-created sandbox failed");
                            sb.state = SandboxState::Failed;
                            sb.failure = Some(format!(
                                "the server stopped while the sandbox was being created, \
                                 and removing it failed: {e}"
                            ));
                        }
                    }
                }
                Some(true) => {
                    // Activity is not persisted (it would cost a write per call): a restart
                    // counts as activity.
                    sb.last_active_at = now;
                }
                _ => {
                    sb.state = SandboxState::Failed;
                    sb.failure
                        .get_or_insert_with(|| "sandbox is no longer running on its node".into());
                    let _ = plane.node.destroy(&id).await;
                }
            }
            plane.persist(&sb).await?;
            plane.lock().insert(id, sb);
        }
        // An agent found unresponsive before the restart is checked again.
        let unhealthy: Vec<String> = plane
            .lock()
            .values()
            .filter(|s| s.state == SandboxState::Unhealthy)
            .map(|s| s.id.clone())
            .collect();
        for id in unhealthy {
            plane.spawn_recovery(&id);
        }
        plane.clone().spawn_reaper();
        Ok(plane)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Sandbox>> {
        self.records.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn persist(&self, sb: &Sandbox) -> ApiResult<()> {
        let bytes = serde_json::to_vec(&Record {
            sandbox: sb.clone(),
        })
        .map_err(internal)?;
        self.stored(self.store.put(NS_SANDBOXES, &sb.id, &bytes, Expect::Any))
            .await
            .map(drop)
    }

    /// Awaits a state store call (a write returns once it is durable; the stores keep
    /// their fsyncs off the runtime's workers).
    async fn stored<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, StateError>>,
    ) -> ApiResult<T> {
        call.await.map_err(internal)
    }

    /// Runs a state-changing call on its own task and waits for it. The call runs to its
    /// end even if the caller goes away: an HTTP client that times out or is killed in the
    /// middle of a create (a preempted trainer) must not leave a half-made sandbox, stuck in
    /// `creating`, with processes and mounts nobody owns. A create finished that way is an
    /// ordinary sandbox: found again by its idempotency key or labels, or reaped at the end
    /// of its lifetime.
    async fn to_end<T, F, Fut>(&self, call: F) -> ApiResult<T>
    where
        F: FnOnce(Arc<Self>) -> Fut,
        Fut: std::future::Future<Output = ApiResult<T>> + Send + 'static,
        T: Send + 'static,
    {
        let me = self
            .me
            .upgrade()
            .ok_or_else(|| internal("the control plane is shutting down"))?;
        tokio::spawn(call(me)).await.map_err(internal)?
    }

    /// Forgets a sandbox's record in the store.
    async fn unstore(&self, ns: &'static str, id: &str) -> ApiResult<()> {
        self.stored(self.store.delete(ns, id, Expect::Any))
            .await
            .map(drop)
    }

    fn spawn_reaper(self: Arc<Self>) {
        let weak = Arc::downgrade(&self);
        let interval = self.cfg.reap_interval;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            loop {
                tick.tick().await;
                let Some(plane) = weak.upgrade() else { return };
                plane.reap_once().await;
            }
        });
    }

    /// One reaper pass: delete sandboxes past their lifetime or idle timeout, mark dead
    /// ones failed, forget old tombstones.
    async fn reap_once(&self) {
        let now = now_ms();
        let candidates: Vec<(String, &'static str)> = self
            .lock()
            .values()
            // Every state but `creating`: a lifetime ends whatever the sandbox is doing (a
            // delete that failed midway, `stopping`, is retried here). A create is in
            // flight in this process (a start resolves every earlier one) and ends on its
            // own; the next pass reaps it if its lifetime is over by then.
            .filter(|s| s.state != SandboxState::Creating)
            .filter_map(|s| {
                if s.job_suspended_at.is_some() && self.cfg.job_suspend_stops_lifetime {
                    // A suspended job's clock is stopped (a preempted trainer must find
                    // its rollouts when it comes back).
                    None
                } else if now >= s.expires_at {
                    Some((s.id.clone(), "lifetime (timeout_s) ended"))
                } else if s.state == SandboxState::Ready
                    && s.idle_timeout_s
                        .is_some_and(|t| now.saturating_sub(s.last_active_at) >= t * 1000)
                {
                    Some((s.id.clone(), "idle timeout reached"))
                } else {
                    None
                }
            })
            .collect();
        for (id, reason) in candidates {
            tracing::info!(%id, reason, "reaping sandbox");
            if let Err(e) = self.remove(&id, Some(reason)).await {
                tracing::warn!(%id, error = %e.message, "reaping failed; will retry");
            }
        }
        let alive: HashMap<String, bool> = self
            .node
            .list()
            .await
            .into_iter()
            .map(|s| (s.id, s.alive))
            .collect();
        let died: Vec<Sandbox> = {
            let mut recs = self.lock();
            recs.values_mut()
                .filter(|s| {
                    matches!(
                        s.state,
                        SandboxState::Ready | SandboxState::Paused | SandboxState::Unhealthy
                    ) && alive.get(&s.id) == Some(&false)
                })
                .map(|s| {
                    s.state = SandboxState::Failed;
                    s.failure = Some("the sandbox's init process exited".into());
                    s.clone()
                })
                .collect()
        };
        for sb in died {
            tracing::warn!(id = %sb.id, "sandbox died");
            let _ = self.persist(&sb).await;
        }
        let expired: Vec<String> = self
            .tombstones
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(_, t)| now.saturating_sub(t.at) > TOMBSTONE_TTL_MS)
            .map(|(k, _)| k.clone())
            .collect();
        for id in expired {
            self.tombstones
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&id);
            let _ = self.unstore(NS_TOMBSTONES, &id).await;
        }
    }

    /// Destroys a sandbox and forgets it; with `expired_reason`, remembers why.
    async fn remove(&self, id: &str, expired_reason: Option<&str>) -> ApiResult<()> {
        {
            let mut recs = self.lock();
            let Some(sb) = recs.get_mut(id) else {
                return Err(self.missing(id));
            };
            sb.state = SandboxState::Stopping;
        }
        self.node.destroy(id).await.map_err(ApiError::from)?;
        if let Some(reason) = expired_reason {
            let t = Tombstone {
                reason: reason.to_string(),
                at: now_ms(),
            };
            let bytes = serde_json::to_vec(&t).map_err(internal)?;
            self.stored(self.store.put(NS_TOMBSTONES, id, &bytes, Expect::Any))
                .await?;
            self.tombstones
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(id.to_string(), t);
        }
        self.unstore(NS_SANDBOXES, id).await?;
        self.lock().remove(id);
        Ok(())
    }

    /// The error for an id with no record: `expired` if the reaper removed it.
    fn missing(&self, id: &str) -> ApiError {
        if let Some(t) = self
            .tombstones
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
        {
            return ApiError::new(
                ErrorCode::Expired,
                format!("sandbox {id} expired and was removed: {}", t.reason),
            );
        }
        ApiError::new(ErrorCode::NotFound, format!("sandbox {id} not found"))
    }

    /// Checks that a sandbox can take calls, and records the activity.
    fn ready(&self, id: &str) -> ApiResult<()> {
        let mut recs = self.lock();
        let Some(sb) = recs.get_mut(id) else {
            drop(recs);
            return Err(self.missing(id));
        };
        match sb.state {
            SandboxState::Ready => {
                sb.last_active_at = now_ms();
                Ok(())
            }
            SandboxState::Creating => Err(ApiError::new(
                ErrorCode::Conflict,
                format!("sandbox {id} is still being created"),
            )),
            SandboxState::Paused => Err(ApiError::new(
                ErrorCode::Paused,
                format!(
                    "sandbox {id} is paused: resume it (POST /v1/sandboxes/{id}/resume) or create sandboxes with auto_resume"
                ),
            )),
            SandboxState::Stopping => Err(ApiError::new(
                ErrorCode::Conflict,
                format!("sandbox {id} is being deleted"),
            )),
            SandboxState::Failed => Err(ApiError::new(
                ErrorCode::Failed,
                format!(
                    "sandbox {id} failed: {}",
                    sb.failure.clone().unwrap_or_default()
                ),
            )),
            SandboxState::Unhealthy => Err(liveness::unhealthy_error(
                id,
                sb.unhealthy_cause.as_deref().unwrap_or_default(),
            )),
        }
    }

    async fn conn(&self, id: &str) -> ApiResult<AgentConn> {
        if let Err(e) = self.ready(id) {
            let auto = self.lock().get(id).is_some_and(|s| s.auto_resume);
            if e.code != ErrorCode::Paused || !auto {
                return Err(e);
            }
            self.resume_sandbox(id).await?;
            self.ready(id)?;
        }
        self.node.connect(id).await.map_err(ApiError::from)
    }

    /// The sandbox `id` once it is past `creating` (its first create may still be running).
    async fn await_created(&self, id: &str) -> ApiResult<Sandbox> {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let sb = self.get_sandbox(id).await?;
            if sb.state != SandboxState::Creating || std::time::Instant::now() > deadline {
                return Ok(sb);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The defaults of an image with `layers` stacked on it: their configs applied bottom
    /// first (env merged, later workdir/user/entrypoint/cmd win). An unknown name fails
    /// when `strict`, else it is skipped.
    async fn stack_config(
        &self,
        image: &str,
        layers: &[String],
        strict: bool,
    ) -> ApiResult<ImageConfig> {
        let mut config = ImageConfig::default();
        for name in std::iter::once(image).chain(layers.iter().map(String::as_str)) {
            let c = match self.node.image(name).await {
                Ok(img) => img.config,
                Err(e) if strict => return Err(e.into()),
                Err(_) => continue,
            };
            config.env.extend(c.env);
            config.workdir = c.workdir.or(config.workdir);
            config.user = c.user.or(config.user);
            if !c.entrypoint.is_empty() {
                config.entrypoint = c.entrypoint;
            }
            if !c.cmd.is_empty() {
                config.cmd = c.cmd;
            }
        }
        Ok(config)
    }

    /// Ids of the sandboxes labelled `job=<job>`, sorted.
    fn job_members(&self, job: &str) -> ApiResult<Vec<String>> {
        if job.is_empty() || job.len() > 256 {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                "job must be 1 to 256 characters",
            ));
        }
        let mut ids: Vec<String> = self
            .lock()
            .values()
            .filter(|s| s.labels.get(JOB_LABEL).map(String::as_str) == Some(job))
            .map(|s| s.id.clone())
            .collect();
        ids.sort();
        Ok(ids)
    }

    fn job_outcome(&self, id: String, error: ApiError) -> JobSandboxOutcome {
        let state = self
            .lock()
            .get(&id)
            .map(|s| s.state)
            .unwrap_or(SandboxState::Failed);
        JobSandboxOutcome {
            id,
            state,
            error: Some(error),
            memory_before_bytes: 0,
            memory_after_bytes: 0,
        }
    }

    fn job_result(job: &str, mut sandboxes: Vec<JobSandboxOutcome>) -> JobResult {
        sandboxes.sort_by(|a, b| a.id.cmp(&b.id));
        JobResult {
            job: job.to_string(),
            sandboxes,
        }
    }

    /// Moves a sandbox from `from` to `to` under the records lock; any other state is
    /// answered the way `ready` answers it.
    fn transition(&self, id: &str, from: SandboxState, to: SandboxState) -> ApiResult<bool> {
        let mut recs = self.lock();
        let Some(sb) = recs.get_mut(id) else {
            drop(recs);
            return Err(self.missing(id));
        };
        if sb.state == to {
            return Ok(false);
        }
        if sb.state != from {
            drop(recs);
            self.ready(id)?;
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!("sandbox {id} cannot go from {from:?} to {to:?}"),
            ));
        }
        sb.state = to;
        Ok(true)
    }

    async fn call(&self, id: &str, req: Request) -> ApiResult<Reply> {
        self.call_within(id, req, Some(Limit::call())).await
    }

    /// [`ControlPlane::call`] with its own deadline (`None`: the watchdog only).
    async fn call_within(&self, id: &str, req: Request, limit: Option<Limit>) -> ApiResult<Reply> {
        self.guarded(id, limit, async {
            let mut conn = self.conn(id).await?;
            let reply = conn.request(&req).await?;
            if req.keeps_connection() {
                self.node.reuse(id, conn);
            }
            Ok(reply)
        })
        .await
    }

    async fn call_ok(&self, id: &str, req: Request) -> ApiResult<()> {
        match self.call(id, req).await? {
            Reply::Ok => Ok(()),
            other => Err(unexpected(other)),
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

    /// Sends `req`, then `body` as Data frames, and returns the agent's byte count.
    async fn upload(mut conn: AgentConn, req: Request, body: ByteStream) -> ApiResult<WriteResult> {
        conn.send(&Frame::json(&req)).await?;
        match Self::pump(&mut conn, body).await {
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

    /// Turns the Data frames of `conn` (until Eof) into a byte stream; `watchdog` ends it
    /// when the agent stops answering.
    fn data_stream(mut conn: AgentConn, watchdog: Watchdog) -> ByteStream {
        let (tx, rx) = mpsc::channel::<Result<Bytes, ApiError>>(8);
        tokio::spawn(async move {
            loop {
                let received = tokio::select! {
                    r = conn.recv() => r,
                    e = watchdog.dead() => Err(e),
                };
                let item = match received {
                    Ok(Some(Frame::Data(b))) => Ok(Bytes::from(b)),
                    Ok(Some(Frame::Eof)) => return,
                    Ok(Some(Frame::Json(j))) => match serde_json::from_slice::<Reply>(&j) {
                        Ok(Reply::Error(e)) => Err(e),
                        _ => Err(internal("unexpected frame in data stream")),
                    },
                    Ok(Some(_)) => Err(internal("unexpected frame in data stream")),
                    Ok(None) => Err(ApiError::new(
                        ErrorCode::AgentUnavailable,
                        "agent closed the stream early",
                    )),
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

    /// Converts the frames of an exec or output stream into events. The stream ends with
    /// an error event when the agent stops answering, or at `limit` (an exec's timeout).
    fn event_stream(
        &self,
        id: &str,
        mut conn: AgentConn,
        oom_before: u64,
        limit: Option<Limit>,
    ) -> EventStream {
        let (tx, rx) = mpsc::channel::<ExecEvent>(16);
        let node = self.node.clone();
        let watchdog = self.watchdog(id);
        let id = id.to_string();
        tokio::spawn(async move {
            let mut conv = EventConverter::default();
            let (deadline, late) = match limit.map(|l| l.deadline()) {
                Some((at, e)) => (Some(at), Some(e)),
                None => (None, None),
            };
            loop {
                let received = tokio::select! {
                    r = conn.recv() => r,
                    // The caller went away while the command is silent (`sleep 300`):
                    // dropping the connection stops the exec too.
                    () = tx.closed() => return,
                    e = watchdog.dead() => Err(e),
                    () = sleep_until_some(deadline) => Err(late.clone().unwrap_or_else(|| internal("deadline"))),
                };
                let frame = match received {
                    Ok(Some(f)) => f,
                    Ok(None) => {
                        let _ = tx
                            .send(error_event("agent closed the stream early".into()))
                            .await;
                        return;
                    }
                    Err(e) => {
                        let _ = tx.send(ExecEvent::Error { error: e }).await;
                        return;
                    }
                };
                let oom = oom_check(&node, &id, oom_before, &frame).await;
                let (events, done) = match conv.frame(frame, || oom) {
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

    fn exec_spec(req: &ExecRequest, stream: bool) -> ApiResult<ExecSpec> {
        validate::exec(req)?;
        Ok(ExecSpec {
            cmd: req.cmd.clone(),
            env: req.env.clone(),
            cwd: req.cwd.clone(),
            stdin: req.stdin.is_some(),
            timeout_ms: ms_from_s("timeout_s", req.timeout_s)?,
            stream,
            output_limit: req.output_limit,
            user: req.user.clone(),
        })
    }

    async fn start_exec(
        &self,
        id: &str,
        req: &ExecRequest,
        stream: bool,
    ) -> ApiResult<(AgentConn, u64, bool)> {
        let request = Request::Exec(Self::exec_spec(req, stream)?);
        let mut conn = self.conn(id).await?;
        let oom_before = self.node.oom_kill_count(id).await.unwrap_or(0);
        conn.send(&Frame::json(&request)).await?;
        if let Some(stdin) = &req.stdin {
            for piece in stdin.as_bytes().chunks(DATA_CHUNK) {
                conn.send(&Frame::Data(piece.to_vec())).await?;
            }
            conn.send(&Frame::Eof).await?;
        }
        conn.flush().await?;
        Ok((conn, oom_before, request.keeps_connection()))
    }

    /// Runs an exec to its exit and collects its output.
    async fn exec_to_exit(&self, id: &str, req: &ExecRequest) -> ApiResult<ExecResult> {
        let (mut conn, oom_before, keeps) = self.start_exec(id, req, false).await?;
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        loop {
            match conn.recv_some().await? {
                Frame::Stdout(b) => stdout.extend_from_slice(&b),
                Frame::Stderr(b) => stderr.extend_from_slice(&b),
                Frame::Json(bytes) => {
                    match serde_json::from_slice::<Reply>(&bytes).map_err(internal)? {
                        Reply::Started { .. } => {}
                        Reply::Exited(exit) => {
                            // The exchange is complete: the connection can carry the next.
                            if keeps {
                                self.node.reuse(id, conn);
                            }
                            // A shell reports its OOM-killed child as exit 137, not as a
                            // signal: the cgroup's OOM counter is the reliable witness.
                            let oom_killed = self
                                .node
                                .oom_kill_count(id)
                                .await
                                .map(|n| n > oom_before)
                                .unwrap_or(false);
                            return Ok(ExecResult {
                                stdout: crate::convert::lossy_text(stdout),
                                stderr: crate::convert::lossy_text(stderr),
                                exit,
                                oom_killed,
                            });
                        }
                        Reply::Error(e) => return Err(e),
                        other => return Err(unexpected(other)),
                    }
                }
                Frame::Data(_) | Frame::Eof => {}
            }
        }
    }

    async fn place_files(&self, id: &str, files: &[InitFile]) -> ApiResult<()> {
        for f in files {
            let bytes = match f.encoding {
                ContentEncoding::Utf8 => f.content.as_bytes().to_vec(),
                ContentEncoding::Base64 => base64::engine::general_purpose::STANDARD
                    .decode(&f.content)
                    .map_err(|e| {
                        ApiError::new(
                            ErrorCode::BadRequest,
                            format!("files: {}: invalid base64: {e}", f.path),
                        )
                    })?,
            };
            let req = Request::FileWrite {
                path: f.path.clone(),
                mode: f.mode,
                create_parents: true,
            };
            let body: ByteStream = futures::stream::iter([Ok(Bytes::from(bytes))]).boxed();
            self.guarded(id, Some(Limit::call()), async {
                let conn = self.node.connect(id).await.map_err(ApiError::from)?;
                Self::upload(conn, req, body).await
            })
            .await?;
        }
        Ok(())
    }
}

/// Idempotent creates: a retry must be the same request as the first.
impl ControlPlane {
    fn fingerprints(&self) -> std::sync::MutexGuard<'_, HashMap<String, [u8; 32]>> {
        self.fingerprints.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records the digest of a keyed create (under the records lock, before any retry can
    /// find the record), forgetting keys of sandboxes that are gone.
    fn remember_request(&self, req: &CreateSandboxRequest, recs: &HashMap<String, Sandbox>) {
        let Some(key) = &req.idempotency_key else {
            return;
        };
        let mut fps = self.fingerprints();
        if fps.len() > 2 * recs.len() + 1024 {
            fps.retain(|k, _| {
                recs.values()
                    .any(|s| s.idempotency_key.as_deref() == Some(k.as_str()))
            });
        }
        fps.insert(key.clone(), request_digest(req));
    }

    /// `conflict` when a create reusing the key of sandbox `first` asks for something
    /// else: by the request's digest when this server saw the first one, else by what
    /// the sandbox's record says (image, layers, resources, labels, policies).
    fn same_request(&self, first: &str, req: &CreateSandboxRequest) -> ApiResult<()> {
        let Some(key) = &req.idempotency_key else {
            return Ok(());
        };
        let known = self.fingerprints().get(key).copied();
        let same = match known {
            Some(digest) => digest == request_digest(req),
            None => match self.lock().get(first) {
                Some(rec) => self.record_matches(rec, req),
                None => true,
            },
        };
        if same {
            return Ok(());
        }
        Err(ApiError::new(
            ErrorCode::Conflict,
            format!(
                "idempotency_key {key:?} belongs to sandbox {first}, created by a different \
                 request: retry with the same body, or use a new key for a new sandbox"
            ),
        ))
    }

    fn record_matches(&self, rec: &Sandbox, req: &CreateSandboxRequest) -> bool {
        let image = req.image.as_deref().unwrap_or(&self.cfg.default_image);
        let r = &req.resources;
        rec.image == image
            && rec.layers == req.layers
            && rec.backend == req.backend
            && rec.resources.cpu == r.cpu.unwrap_or(self.cfg.default_cpu)
            && rec.resources.memory_mb == r.memory_mb.unwrap_or(self.cfg.default_memory_mb)
            && rec.resources.pids == r.pids.unwrap_or(self.cfg.default_pids)
            && rec.labels == req.labels
            && rec.network == req.network
            && rec.filesystem == req.filesystem
            && rec.isolation == req.isolation
            && rec.qos == req.qos
            && rec.auto_resume == req.auto_resume
            && rec.idle_timeout_s == req.idle_timeout_s
    }

    /// `bad_request` (the create is undone by the caller) when the sandbox's default user
    /// names a user or group its image does not have: every command would fail.
    async fn check_user(&self, id: &str, user: Option<&str>) -> ApiResult<()> {
        let Some(user) = user else {
            return Ok(());
        };
        let (u, g) = user
            .split_once(':')
            .map_or((user, None), |(u, g)| (u, Some(g)));
        let named = |s: &str| s.parse::<u32>().is_err();
        let passwd = if named(u) {
            self.small_file(id, "/etc/passwd").await?
        } else {
            None
        };
        let group = match g {
            Some(g) if named(g) => self.small_file(id, "/etc/group").await?,
            _ => None,
        };
        validate::user_known(user, passwd.as_deref(), group.as_deref())
    }

    /// A small text file of the sandbox (`None` if it does not exist).
    async fn small_file(&self, id: &str, path: &str) -> ApiResult<Option<String>> {
        const LIMIT: usize = 16 << 20;
        let (_, mut stream) = match self.read_file(id, path, 0, None).await {
            Ok(v) => v,
            Err(e) if e.code == ErrorCode::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let mut text = Vec::new();
        while let Some(chunk) = stream.next().await {
            text.extend_from_slice(&chunk?);
            if text.len() > LIMIT {
                break;
            }
        }
        Ok(Some(String::from_utf8_lossy(&text).into_owned()))
    }
}

/// SHA-256 of a create request's JSON (maps are ordered, so equal requests hash equal).
fn request_digest(req: &CreateSandboxRequest) -> [u8; 32] {
    use sha2::Digest;
    let json = serde_json::to_vec(req).unwrap_or_default();
    sha2::Sha256::digest(&json).into()
}

/// Sleeps until `at`; never ends without one.
async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Whether the memory limit killed a process while this exec ran.
async fn oom_check(node: &Arc<dyn NodeApi>, id: &str, before: u64, frame: &Frame) -> bool {
    let Frame::Json(bytes) = frame else {
        return false;
    };
    match serde_json::from_slice::<Reply>(bytes) {
        Ok(Reply::Exited(_)) => node
            .oom_kill_count(id)
            .await
            .map(|n| n > before)
            .unwrap_or(false),
        _ => false,
    }
}

/// The state-changing calls. Each runs on its own task through [`ControlPlane::to_end`],
/// so it finishes even if its caller goes away.
impl ControlPlane {
    async fn create_sandbox_to_end(&self, req: CreateSandboxRequest) -> ApiResult<Sandbox> {
        let req = validate::flatten_environment(req)?;
        validate::create(&req)?;
        let now = now_ms();
        let id = new_id();
        let image = req
            .image
            .clone()
            .unwrap_or_else(|| self.cfg.default_image.clone());
        let cpu = req.resources.cpu.unwrap_or(self.cfg.default_cpu);
        let memory_mb = req
            .resources
            .memory_mb
            .unwrap_or(self.cfg.default_memory_mb);
        let pids = req.resources.pids.unwrap_or(self.cfg.default_pids);
        let timeout_s = req.timeout_s.unwrap_or(DEFAULT_TIMEOUT_S);
        // The images' own defaults, bottom first; unknown names fail here, before any
        // record exists.
        let config = self.stack_config(&image, &req.layers, true).await?;
        let mut sb = Sandbox {
            id: id.clone(),
            state: SandboxState::Creating,
            image: image.clone(),
            auto_resume: req.auto_resume,
            qos: req.qos,
            idempotency_key: req.idempotency_key.clone(),
            layers: req.layers.clone(),
            image_digest: String::new(),
            backend: req.backend,
            resources: EffectiveResources {
                cpu,
                memory_mb,
                pids,
                disk_mb: None,
            },
            labels: req.labels.clone(),
            created_at: now,
            expires_at: now + timeout_s * 1000,
            idle_timeout_s: req.idle_timeout_s,
            last_active_at: now,
            failure: None,
            unhealthy_cause: None,
            unhealthy_since: None,
            node: self.node.name().to_string(),
            job_suspended_at: None,
            committed_layers: Vec::new(),
            network: req.network.clone(),
            ip: None,
            filesystem: req.filesystem.clone(),
            isolation: req.isolation,
        };
        // A retried create finds its first attempt (the check and the insert under one
        // lock, so concurrent retries cannot both create).
        let existing = {
            let mut recs = self.lock();
            let found = req.idempotency_key.as_ref().and_then(|k| {
                recs.values()
                    .find(|s| s.idempotency_key.as_ref() == Some(k))
                    .map(|s| s.id.clone())
            });
            if found.is_none() {
                recs.insert(id.clone(), sb.clone());
                self.remember_request(&req, &recs);
            }
            found
        };
        if let Some(first) = existing {
            self.same_request(&first, &req)?;
            return self.await_created(&first).await;
        }
        let mut env = BTreeMap::from([
            (
                "PATH".to_string(),
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_string(),
            ),
            ("HOME".to_string(), "/root".to_string()),
            ("LANG".to_string(), "C.UTF-8".to_string()),
            ("TERM".to_string(), "xterm".to_string()),
            ("HOSTNAME".to_string(), id.clone()),
        ]);
        env.extend(config.env);
        env.extend(req.env.clone());
        let workdir = req
            .workdir
            .clone()
            .or(config.workdir)
            .unwrap_or_else(|| "/".into());
        let user = req
            .user
            .clone()
            .or(config.user)
            .filter(|u| u != "root" && u != "0");
        let spec_user = user.clone();
        let spec = NodeCreateSpec {
            id: id.clone(),
            image,
            layers: req.layers.clone(),
            cpu_millis: (cpu * 1000.0).round() as u64,
            memory_bytes: memory_mb * 1024 * 1024,
            pids_max: pids,
            disk_mb: req.resources.disk_mb,
            qos: req.qos,
            env,
            workdir,
            user,
            network: req.network.clone(),
            writable_paths: req.filesystem.writable.clone(),
            tcp_bind: req.filesystem.tcp_bind.clone(),
            tcp_connect: req.filesystem.tcp_connect.clone(),
            isolation: req.isolation,
            labels: req.labels.clone(),
        };
        // The `creating` record is made durable while the node builds the sandbox: a
        // crash before it is written leaves a sandbox without a record, which the next
        // start destroys, as it does one still `creating`.
        let (persisted, created) = tokio::join!(self.persist(&sb), self.node.create(spec));
        let created = match (persisted, created) {
            (Ok(()), Ok(c)) => c,
            (persisted, created) => {
                self.lock().remove(&id);
                if persisted.is_ok() {
                    let _ = self.unstore(NS_SANDBOXES, &id).await;
                }
                let err = match created {
                    Ok(_) => {
                        let _ = self.node.destroy(&id).await;
                        persisted.err()
                    }
                    Err(e) => Some(e.into()),
                };
                return Err(err.unwrap_or_else(|| internal("create failed without an error")));
            }
        };
        sb.image_digest = created.image_digest;
        sb.resources.disk_mb = created.disk_mb;
        sb.ip = created.ip.map(|ip| ip.to_string());
        sb.state = SandboxState::Ready;
        self.lock().insert(id.clone(), sb.clone());
        if let Err(e) = self.place_files(&id, &req.files).await {
            let _ = self.remove(&id, None).await;
            return Err(e);
        }
        if let Err(e) = self.check_user(&id, spec_user.as_deref()).await {
            let _ = self.remove(&id, None).await;
            return Err(e);
        }
        self.persist(&sb).await?;
        Ok(sb)
    }

    async fn delete_sandbox_to_end(&self, id: &str) -> ApiResult<()> {
        self.remove(id, None).await
    }

    async fn pause_sandbox_to_end(&self, id: &str) -> ApiResult<PauseResult> {
        if !self.transition(id, SandboxState::Ready, SandboxState::Paused)? {
            let sandbox = self.get_sandbox(id).await?;
            return Ok(PauseResult {
                sandbox,
                memory_before_bytes: 0,
                memory_after_bytes: 0,
            });
        }
        let (before, after) = match self.node.pause(id).await {
            Ok(v) => v,
            Err(e) => {
                // Whatever froze runs again; the sandbox stays usable.
                let _ = self.node.resume(id).await;
                let _ = self.transition(id, SandboxState::Paused, SandboxState::Ready);
                return Err(e.into());
            }
        };
        let sandbox = self.get_sandbox(id).await?;
        self.persist(&sandbox).await?;
        Ok(PauseResult {
            sandbox,
            memory_before_bytes: before,
            memory_after_bytes: after,
        })
    }

    async fn resume_sandbox_to_end(&self, id: &str) -> ApiResult<Sandbox> {
        if self.transition(id, SandboxState::Paused, SandboxState::Ready)? {
            if let Err(e) = self.node.resume(id).await {
                let _ = self.transition(id, SandboxState::Ready, SandboxState::Paused);
                return Err(e.into());
            }
            if let Some(sb) = self.lock().get_mut(id) {
                let now = now_ms();
                sb.last_active_at = now;
                // A job suspend stopped the clock: the lifetime goes on where it stopped.
                if let Some(at) = sb.job_suspended_at.take() {
                    if self.cfg.job_suspend_stops_lifetime {
                        sb.expires_at += now.saturating_sub(at);
                    }
                }
            }
            let sandbox = self.get_sandbox(id).await?;
            self.persist(&sandbox).await?;
            return Ok(sandbox);
        }
        self.get_sandbox(id).await
    }

    async fn gc_images_to_end(&self, req: GcRequest) -> ApiResult<GcResult> {
        self.node.gc_images(&req).await.map_err(ApiError::from)
    }

    async fn build_image_to_end(&self, req: BuildRequest) -> ApiResult<BuildResult> {
        crate::build::build(self, self.node.as_ref(), req).await
    }

    async fn commit_sandbox_to_end(&self, id: &str, req: CommitRequest) -> ApiResult<Image> {
        let sb = self.get_sandbox(id).await?;
        // Still files while the copy runs: pause a running sandbox, resume it after.
        let paused_here = match sb.state {
            SandboxState::Ready => {
                self.pause_sandbox(id).await?;
                true
            }
            SandboxState::Paused => false,
            _ => {
                self.ready(id)?;
                false
            }
        };
        // An image removed since the create does not stop a commit of its files.
        let config = self.stack_config(&sb.image, &sb.layers, false).await?;
        let res = self
            .node
            .commit(id, &req.name, sb.committed_layers.clone(), config)
            .await
            .map_err(ApiError::from);
        if paused_here {
            self.resume_sandbox(id).await?;
        }
        let (img, diff) = res?;
        // An empty diff added no layer: nothing to remember.
        let updated = diff.and_then(|diff| {
            let mut recs = self.lock();
            recs.get_mut(id).map(|rec| {
                rec.committed_layers.retain(|d| *d != diff);
                rec.committed_layers.push(diff);
                rec.clone()
            })
        });
        if let Some(rec) = updated {
            self.persist(&rec).await?;
        }
        Ok(img)
    }

    async fn suspend_job_to_end(&self, job: &str) -> ApiResult<JobResult> {
        let ids = self.job_members(job)?;
        let outcomes = futures::stream::iter(ids)
            .map(|id| async move {
                match self.pause_sandbox(&id).await {
                    Ok(p) => {
                        let mut sb = p.sandbox;
                        if let Some(rec) = self.lock().get_mut(&id) {
                            rec.job_suspended_at.get_or_insert_with(now_ms);
                            sb = rec.clone();
                        }
                        let error = self.persist(&sb).await.err();
                        JobSandboxOutcome {
                            id,
                            state: sb.state,
                            error,
                            memory_before_bytes: p.memory_before_bytes,
                            memory_after_bytes: p.memory_after_bytes,
                        }
                    }
                    Err(error) => self.job_outcome(id, error),
                }
            })
            .buffer_unordered(JOB_PARALLELISM)
            .collect::<Vec<_>>()
            .await;
        Ok(Self::job_result(job, outcomes))
    }

    async fn resume_job_to_end(&self, job: &str) -> ApiResult<JobResult> {
        let ids = self.job_members(job)?;
        let outcomes = futures::stream::iter(ids)
            .map(|id| async move {
                match self.resume_sandbox(&id).await {
                    Ok(sb) => JobSandboxOutcome {
                        id,
                        state: sb.state,
                        error: None,
                        memory_before_bytes: 0,
                        memory_after_bytes: 0,
                    },
                    Err(error) => self.job_outcome(id, error),
                }
            })
            .buffer_unordered(JOB_PARALLELISM)
            .collect::<Vec<_>>()
            .await;
        Ok(Self::job_result(job, outcomes))
    }

    async fn set_network_to_end(&self, id: &str, policy: NetworkPolicy) -> ApiResult<Sandbox> {
        validate::network(&policy)?;
        self.ready(id)?;
        self.node.set_network(id, policy.clone()).await?;
        let sb = {
            let mut recs = self.lock();
            let sb = recs.get_mut(id).ok_or_else(|| self.missing(id))?;
            sb.network = policy;
            sb.clone()
        };
        self.persist(&sb).await?;
        Ok(sb)
    }

    async fn set_timeout_to_end(&self, id: &str, req: SetTimeoutRequest) -> ApiResult<Sandbox> {
        if req.timeout_s == 0 || req.timeout_s > MAX_TIMEOUT_S {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                format!("timeout_s must be in [1, {MAX_TIMEOUT_S}]"),
            ));
        }
        self.ready(id)?;
        let sb = {
            let mut recs = self.lock();
            let sb = recs.get_mut(id).ok_or_else(|| {
                ApiError::new(ErrorCode::NotFound, format!("sandbox {id} not found"))
            })?;
            sb.expires_at = now_ms() + req.timeout_s * 1000;
            sb.clone()
        };
        self.persist(&sb).await?;
        Ok(sb)
    }

    async fn import_image_to_end(&self, req: ImportImageRequest) -> ApiResult<Image> {
        let source = import_source(&req)?;
        self.node
            .import_image(&req.name, &source, req.flatten, None)
            .await
            .map_err(ApiError::from)
    }

    async fn delete_image_to_end(&self, name: &str) -> ApiResult<()> {
        self.node.remove_image(name).await.map_err(ApiError::from)
    }
}

#[async_trait::async_trait]
impl SandboxApi for ControlPlane {
    fn authenticate(&self, key: Option<&str>) -> ApiResult<()> {
        match key {
            Some(k) if crate::auth::keys_equal(k, &self.cfg.api_key) => Ok(()),
            Some(_) => Err(ApiError::new(ErrorCode::Unauthorized, "invalid API key")),
            None => Err(ApiError::new(
                ErrorCode::Unauthorized,
                "missing API key: send it in the x-api-key header (or Authorization: Bearer)",
            )),
        }
    }

    async fn health(&self) -> ApiResult<Health> {
        let c = self.node.capacity().await;
        let sandboxes = self.lock().len() as u64;
        Ok(Health {
            unhealthy_sandboxes: self.unhealthy_count(),
            unhealthy_marks_total: self
                .unhealthy_marks
                .load(std::sync::atomic::Ordering::Relaxed),
            status: "ok".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            node: self.node.name().into(),
            cgroup: self.node.cgroup_version().into(),
            sandboxes,
            capacity: Some(NodeCapacity {
                cpu_millis_allocatable: c.cpu_millis_allocatable,
                cpu_millis_requested: c.cpu_millis_requested,
                memory_available_bytes: c.memory_available_bytes,
                memory_reserve_bytes: c.memory_reserve_bytes,
                sandboxes: c.sandboxes as u64,
                max_sandboxes: c.max_sandboxes as u64,
                core_scheduling: c.core_scheduling,
            }),
        })
    }

    async fn create_sandbox(&self, req: CreateSandboxRequest) -> ApiResult<Sandbox> {
        self.to_end(move |me| async move { me.create_sandbox_to_end(req).await })
            .await
    }

    async fn get_sandbox(&self, id: &str) -> ApiResult<Sandbox> {
        let found = self.lock().get(id).cloned();
        found.ok_or_else(|| self.missing(id))
    }

    async fn list_sandboxes(&self, labels: BTreeMap<String, String>) -> ApiResult<SandboxList> {
        let mut sandboxes: Vec<Sandbox> = self
            .lock()
            .values()
            .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(v)))
            .cloned()
            .collect();
        sandboxes.sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.id.cmp(&b.id)));
        Ok(SandboxList { sandboxes })
    }

    async fn delete_sandbox(&self, id: &str) -> ApiResult<()> {
        let id = id.to_string();
        self.to_end(move |me| async move { me.delete_sandbox_to_end(&id).await })
            .await
    }

    async fn pause_sandbox(&self, id: &str) -> ApiResult<PauseResult> {
        let id = id.to_string();
        self.to_end(move |me| async move { me.pause_sandbox_to_end(&id).await })
            .await
    }

    async fn resume_sandbox(&self, id: &str) -> ApiResult<Sandbox> {
        let id = id.to_string();
        self.to_end(move |me| async move { me.resume_sandbox_to_end(&id).await })
            .await
    }

    async fn gc_images(&self, req: GcRequest) -> ApiResult<GcResult> {
        self.to_end(move |me| async move { me.gc_images_to_end(req).await })
            .await
    }

    async fn build_image(&self, req: BuildRequest) -> ApiResult<BuildResult> {
        self.to_end(move |me| async move { me.build_image_to_end(req).await })
            .await
    }

    async fn commit_sandbox(&self, id: &str, req: CommitRequest) -> ApiResult<Image> {
        let id = id.to_string();
        self.to_end(move |me| async move { me.commit_sandbox_to_end(&id, req).await })
            .await
    }

    async fn suspend_job(&self, job: &str) -> ApiResult<JobResult> {
        let job = job.to_string();
        self.to_end(move |me| async move { me.suspend_job_to_end(&job).await })
            .await
    }

    async fn resume_job(&self, job: &str) -> ApiResult<JobResult> {
        let job = job.to_string();
        self.to_end(move |me| async move { me.resume_job_to_end(&job).await })
            .await
    }

    async fn set_network(&self, id: &str, policy: NetworkPolicy) -> ApiResult<Sandbox> {
        let id = id.to_string();
        self.to_end(move |me| async move { me.set_network_to_end(&id, policy).await })
            .await
    }

    async fn set_timeout(&self, id: &str, req: SetTimeoutRequest) -> ApiResult<Sandbox> {
        let id = id.to_string();
        self.to_end(move |me| async move { me.set_timeout_to_end(&id, req).await })
            .await
    }

    async fn exec(&self, id: &str, req: ExecRequest) -> ApiResult<ExecResult> {
        let limit = ms_from_s("timeout_s", req.timeout_s)?.map(Limit::exec);
        self.guarded(id, limit, self.exec_to_exit(id, &req)).await
    }

    async fn exec_stream(&self, id: &str, req: ExecRequest) -> ApiResult<EventStream> {
        let limit = ms_from_s("timeout_s", req.timeout_s)?.map(Limit::exec);
        let (conn, oom_before, _) = self
            .guarded(id, limit.clone(), self.start_exec(id, &req, true))
            .await?;
        Ok(self.event_stream(id, conn, oom_before, limit))
    }

    async fn create_session(&self, id: &str, req: CreateSessionRequest) -> ApiResult<SessionInfo> {
        validate::env(&req.env)?;
        let session = req
            .session
            .unwrap_or_else(|| format!("s-{:08x}", rand::thread_rng().gen::<u32>()));
        if session.is_empty()
            || session.len() > 128
            || !session
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                "session id must be 1-128 characters of [A-Za-z0-9._-]",
            ));
        }
        match self
            .call(
                id,
                Request::SessionCreate {
                    session,
                    env: req.env,
                    cwd: req.cwd,
                    user: req.user,
                },
            )
            .await?
        {
            Reply::SessionCreated { session, pid } => Ok(SessionInfo {
                session,
                pid,
                busy: false,
            }),
            other => Err(unexpected(other)),
        }
    }

    async fn list_sessions(&self, id: &str) -> ApiResult<SessionList> {
        match self.call(id, Request::SessionList).await? {
            Reply::Sessions { sessions } => Ok(SessionList { sessions }),
            other => Err(unexpected(other)),
        }
    }

    async fn run_in_session(
        &self,
        id: &str,
        session: &str,
        req: SessionRunRequest,
    ) -> ApiResult<SessionResult> {
        let timeout_ms = ms_from_s("timeout_s", req.timeout_s)?;
        let r = Request::SessionRun {
            session: session.to_string(),
            command: req.command,
            timeout_ms,
        };
        // Without a timeout the command may run as long as it likes: the watchdog only.
        match self
            .call_within(id, r, timeout_ms.map(Limit::session))
            .await?
        {
            Reply::SessionResult(res) => Ok(res),
            other => Err(unexpected(other)),
        }
    }

    async fn interrupt_session(&self, id: &str, session: &str) -> ApiResult<()> {
        self.call_ok(
            id,
            Request::SessionInterrupt {
                session: session.to_string(),
            },
        )
        .await
    }

    async fn close_session(&self, id: &str, session: &str) -> ApiResult<()> {
        self.call_ok(
            id,
            Request::SessionClose {
                session: session.to_string(),
            },
        )
        .await
    }

    async fn start_process(&self, id: &str, req: StartProcessRequest) -> ApiResult<ProcessInfo> {
        let as_exec = ExecRequest {
            cmd: req.cmd.clone(),
            env: req.env.clone(),
            cwd: req.cwd.clone(),
            stdin: None,
            timeout_s: req.timeout_s,
            output_limit: None,
            user: req.user.clone(),
        };
        validate::exec(&as_exec)?;
        let spec = ProcessSpec {
            cmd: req.cmd,
            env: req.env,
            cwd: req.cwd,
            pty: req.pty,
            tag: req.tag,
            output_limit: None,
            timeout_ms: ms_from_s("timeout_s", req.timeout_s)?,
            user: req.user,
        };
        match self.call(id, Request::ProcessStart(spec)).await? {
            Reply::ProcessStarted(info) => Ok(info),
            other => Err(unexpected(other)),
        }
    }

    async fn list_processes(&self, id: &str) -> ApiResult<ProcessList> {
        match self.call(id, Request::ProcessList).await? {
            Reply::Processes { processes } => Ok(ProcessList { processes }),
            other => Err(unexpected(other)),
        }
    }

    async fn process_output(
        &self,
        id: &str,
        pid: u32,
        stdout_offset: u64,
        stderr_offset: u64,
        follow: bool,
    ) -> ApiResult<EventStream> {
        let conn = self
            .guarded(id, Some(Limit::call()), async {
                let mut conn = self.conn(id).await?;
                conn.send_request(&Request::ProcessOutput {
                    pid,
                    stdout_offset,
                    stderr_offset,
                    follow,
                })
                .await?;
                Ok(conn)
            })
            .await?;
        Ok(self.event_stream(id, conn, u64::MAX, None))
    }

    async fn process_stdin(&self, id: &str, pid: u32, req: StdinRequest) -> ApiResult<()> {
        self.guarded(id, Some(Limit::call()), async {
            let mut conn = self.conn(id).await?;
            conn.send(&Frame::json(&Request::ProcessStdin {
                pid,
                close: req.close,
            }))
            .await?;
            let body: ByteStream =
                futures::stream::iter([Ok(Bytes::from(req.data.into_bytes()))]).boxed();
            Self::pump(&mut conn, body).await?;
            match conn.recv_reply().await? {
                Reply::Ok => Ok(()),
                other => Err(unexpected(other)),
            }
        })
        .await
    }

    async fn signal_process(&self, id: &str, pid: u32, req: SignalRequest) -> ApiResult<()> {
        let signal = validate::signal(&req.signal)?;
        self.call_ok(id, Request::ProcessSignal { pid, signal })
            .await
    }

    async fn resize_process(&self, id: &str, pid: u32, size: PtySize) -> ApiResult<()> {
        if size.rows == 0 || size.cols == 0 {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                "rows and cols must be positive",
            ));
        }
        self.call_ok(id, Request::ProcessResize { pid, size }).await
    }

    async fn read_file(
        &self,
        id: &str,
        path: &str,
        offset: u64,
        length: Option<u64>,
    ) -> ApiResult<(FileInfo, ByteStream)> {
        validate::sandbox_path("path", path)?;
        validate::read_range(offset, length)?;
        let (info, conn) = self
            .guarded(id, Some(Limit::call()), async {
                let mut conn = self.conn(id).await?;
                conn.send_request(&Request::FileRead {
                    path: path.to_string(),
                    offset,
                    length,
                })
                .await?;
                match conn.recv_reply().await? {
                    Reply::File(info) => Ok((info, conn)),
                    other => Err(unexpected(other)),
                }
            })
            .await?;
        Ok((info, Self::data_stream(conn, self.watchdog(id))))
    }

    async fn write_file(
        &self,
        id: &str,
        path: &str,
        mode: Option<u32>,
        body: ByteStream,
    ) -> ApiResult<WriteResult> {
        validate::sandbox_path("path", path)?;
        let req = Request::FileWrite {
            path: path.to_string(),
            mode,
            create_parents: true,
        };
        // As long as the client sends: the watchdog only.
        self.guarded(id, None, async {
            Self::upload(self.conn(id).await?, req, body).await
        })
        .await
    }

    async fn list_files(&self, id: &str, path: &str) -> ApiResult<FileList> {
        validate::sandbox_path("path", path)?;
        match self
            .call(
                id,
                Request::FileList {
                    path: path.to_string(),
                },
            )
            .await?
        {
            Reply::Entries { entries } => Ok(FileList { entries }),
            other => Err(unexpected(other)),
        }
    }

    async fn stat_file(&self, id: &str, path: &str) -> ApiResult<FileInfo> {
        validate::sandbox_path("path", path)?;
        match self
            .call(
                id,
                Request::FileStat {
                    path: path.to_string(),
                },
            )
            .await?
        {
            Reply::File(info) => Ok(info),
            other => Err(unexpected(other)),
        }
    }

    async fn mkdir(&self, id: &str, req: MkdirRequest) -> ApiResult<()> {
        validate::sandbox_path("path", &req.path)?;
        self.call_ok(id, Request::FileMkdir { path: req.path })
            .await
    }

    async fn remove_file(&self, id: &str, path: &str, recursive: bool) -> ApiResult<()> {
        validate::sandbox_path("path", path)?;
        self.call_ok(
            id,
            Request::FileRemove {
                path: path.to_string(),
                recursive,
            },
        )
        .await
    }

    async fn rename_file(&self, id: &str, req: RenameRequest) -> ApiResult<()> {
        validate::sandbox_path("from", &req.from)?;
        validate::sandbox_path("to", &req.to)?;
        self.call_ok(
            id,
            Request::FileRename {
                from: req.from,
                to: req.to,
            },
        )
        .await
    }

    async fn download_tar(&self, id: &str, path: &str) -> ApiResult<ByteStream> {
        validate::sandbox_path("path", path)?;
        let (first, conn) = self
            .guarded(id, Some(Limit::call()), async {
                let mut conn = self.conn(id).await?;
                conn.send_request(&Request::TarDownload {
                    path: path.to_string(),
                })
                .await?;
                // The agent's first frame says whether the path can be archived at all:
                // an error then is answered as such, before any 200 goes out.
                let first = match conn.recv().await? {
                    Some(Frame::Json(j)) => match serde_json::from_slice::<Reply>(&j) {
                        Ok(Reply::Error(e)) => return Err(e),
                        Ok(other) => return Err(unexpected(other)),
                        Err(e) => return Err(internal(format!("bad agent reply: {e}"))),
                    },
                    Some(Frame::Eof) => None,
                    Some(Frame::Data(b)) => Some(Bytes::from(b)),
                    Some(_) => return Err(internal("unexpected frame in data stream")),
                    None => {
                        return Err(ApiError::new(
                            ErrorCode::AgentUnavailable,
                            "agent closed the stream early",
                        ))
                    }
                };
                Ok((first, conn))
            })
            .await?;
        let Some(first) = first else {
            return Ok(futures::stream::empty().boxed());
        };
        let rest = Self::data_stream(conn, self.watchdog(id));
        Ok(futures::stream::once(async move { Ok(first) })
            .chain(rest)
            .boxed())
    }

    async fn upload_tar(&self, id: &str, path: &str, body: ByteStream) -> ApiResult<WriteResult> {
        validate::sandbox_path("path", path)?;
        let req = Request::TarUpload {
            path: path.to_string(),
        };
        self.guarded(id, None, async {
            Self::upload(self.conn(id).await?, req, body).await
        })
        .await
    }

    async fn list_images(&self) -> ApiResult<ImageList> {
        let mut images = self.node.list_images().await.map_err(ApiError::from)?;
        images.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(ImageList { images })
    }

    async fn import_image(&self, req: ImportImageRequest) -> ApiResult<Image> {
        self.to_end(move |me| async move { me.import_image_to_end(req).await })
            .await
    }

    async fn import_image_stream(&self, req: ImportImageRequest) -> ApiResult<ImportStream> {
        let source = import_source(&req)?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let progress_tx = tx.clone();
        let sink: dsec_node::ImportProgressSink = Arc::new(move |ev| {
            let _ = progress_tx.send(ev);
        });
        let node = self.node.clone();
        // The import runs to its end even if the client goes away: it then either stores
        // the image or leaves nothing behind.
        tokio::spawn(async move {
            let end = match node
                .import_image(&req.name, &source, req.flatten, Some(sink))
                .await
            {
                Ok(image) => ImportEvent::Done { image },
                Err(e) => ImportEvent::Error {
                    error: ApiError::from(e),
                },
            };
            let _ = tx.send(end);
        });
        Ok(Box::pin(
            tokio_stream::wrappers::UnboundedReceiverStream::new(rx),
        ))
    }

    async fn layer_stats(&self) -> ApiResult<LayerStatsList> {
        self.node.layer_stats().await.map_err(ApiError::from)
    }

    async fn delete_image(&self, name: &str) -> ApiResult<()> {
        let name = name.to_string();
        self.to_end(move |me| async move { me.delete_image_to_end(&name).await })
            .await
    }
}

/// Keeps `agent` in the dependency graph explicit for readers: the protocol version this
/// control plane speaks.
pub const AGENT_PROTOCOL: u32 = agent::PROTOCOL_VERSION;

/// The source path of an import request: absolute, on the server.
fn import_source(req: &ImportImageRequest) -> ApiResult<PathBuf> {
    let source = PathBuf::from(&req.source);
    if !source.is_absolute() {
        return Err(ApiError::new(
            ErrorCode::BadRequest,
            format!(
                "source {:?} must be an absolute path on the server",
                req.source
            ),
        ));
    }
    if let Err(e) = std::fs::metadata(&source) {
        let why = match e.kind() {
            std::io::ErrorKind::NotFound => "does not exist".to_string(),
            std::io::ErrorKind::PermissionDenied => "is not readable by the server".to_string(),
            _ => format!("cannot be read: {e}"),
        };
        return Err(ApiError::new(
            ErrorCode::BadRequest,
            format!(
                "source {:?} {why}: give a directory, tar, OCI layout or .erofs file on \
                 the server",
                req.source
            ),
        ));
    }
    Ok(source)
}

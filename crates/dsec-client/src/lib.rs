//! Rust client of the dsec `/v1` HTTP API.
//!
//! [`Client`] has one async method per route, named like the methods of the server's
//! `SandboxApi` trait and taking the same wire types from [`dsec_wire::v1`]. Streams are
//! streamed both ways: exec output arrives event by event ([`Client::exec_stream`]), file
//! and tar transfers never sit in memory whole. Convenience helpers copy files and whole
//! directories between the local disk and a sandbox ([`Client::write_file_from_path`],
//! [`Client::read_file_to_path`], [`Client::upload_dir`], [`Client::download_dir`]).
//!
//! ```no_run
//! # async fn demo() -> Result<(), dsec_client::ClientError> {
//! use dsec_client::Client;
//! use dsec_wire::v1::{Command, CreateSandboxRequest, ExecRequest};
//!
//! let client = Client::from_env()?;
//! let sb = client.create_sandbox(CreateSandboxRequest::default()).await?;
//! let req = ExecRequest {
//!     cmd: Command::Shell("echo hi".into()),
//!     env: Default::default(),
//!     cwd: None,
//!     stdin: None,
//!     timeout_s: None,
//!     output_limit: None,
//!     user: None,
//!     request_id: None,
//! };
//! let out = client.exec(&sb.id, req).await?;
//! assert_eq!(out.stdout, "hi\n");
//! client.delete_sandbox(&sb.id).await?;
//! # Ok(()) }
//! ```

#[cfg(feature = "admin")]
mod admin;
mod error;
mod files;
mod ndjson;
mod sse;
pub use sse::SseDecoder;

use std::collections::BTreeMap;

use bytes::Bytes;
use dsec_wire::error::ErrorBody;
use dsec_wire::v1::{
    BuildRequest, BuildResult, ClusterNode, ClusterNodeList, CommitRequest, CreateSandboxRequest,
    CreateSessionRequest, ExecRequest, ExecResult, FileInfo, FileList, GcRequest, GcResult, Health,
    Image, ImageList, ImportEvent, ImportImageRequest, InputEvent, InputRequest, JobResult,
    MkdirRequest, NetworkPolicy, PauseResult, Pool, PoolList, PoolSpec, PoolUpdate, ProcessInfo,
    ProcessList, PtySize, RenameRequest, Sandbox, SandboxList, SessionInfo, SessionList,
    SessionResult, SessionRunRequest, SetTimeoutRequest, SignalRequest, StartProcessRequest,
    StdinRequest, WriteResult, API_KEY_HEADER,
};
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use reqwest::{header, Method, RequestBuilder, Response, Url};
use serde::de::DeserializeOwned;
use serde::Serialize;

pub use error::ClientError;
pub use files::UploadBody;
pub use ndjson::NdjsonDecoder;

/// Server URL used when `DSEC_URL` is unset.
pub const DEFAULT_URL: &str = "http://127.0.0.1:7070";
/// Where `dsec serve` writes its API key; read when neither `DSEC_API_KEY` nor
/// `DSEC_API_KEY_FILE` is set.
pub const DEFAULT_API_KEY_FILE: &str = "/var/lib/dsec/api-key";
/// Response header of `GET /files` carrying the [`FileInfo`] as JSON.
pub const FILE_INFO_HEADER: &str = "x-dsec-file-info";

/// Exec/process output as it arrives; ends after `Exit`, `End` or `Error`.
pub type EventStream = BoxStream<'static, Result<dsec_wire::v1::ExecEvent, ClientError>>;
/// Downloaded bytes (file contents, tar archives) as they arrive.
pub type ByteStream = BoxStream<'static, Result<Bytes, ClientError>>;

/// A client of one dsec server. Cheap to clone (the connection pool is shared).
#[derive(Debug, Clone)]
pub struct Client {
    base_url: Url,
    api_key: Option<String>,
    http: reqwest::Client,
}

impl Client {
    /// A client for the server at `base_url` (e.g. `http://127.0.0.1:7070`), sending
    /// `api_key` with every request when given.
    pub fn new(base_url: &str, api_key: Option<String>) -> Result<Self, ClientError> {
        let base_url = Url::parse(base_url)
            .map_err(|e| ClientError::Config(format!("invalid server URL {base_url:?}: {e}")))?;
        if base_url.cannot_be_a_base() || !matches!(base_url.scheme(), "http" | "https") {
            return Err(ClientError::Config(format!(
                "invalid server URL {base_url}: expected http://HOST:PORT"
            )));
        }
        // Loading the system's root certificates costs ~3 ms of CPU per client (a third
        // of a CLI command); a plain-HTTP server needs none.
        let http = reqwest::Client::builder()
            .connect_timeout(std::time::Duration::from_secs(10))
            .tls_built_in_root_certs(base_url.scheme() == "https")
            .build()?;
        Ok(Self {
            base_url,
            api_key: api_key.filter(|k| !k.is_empty()),
            http,
        })
    }

    /// A client configured from the environment: `DSEC_URL` (default [`DEFAULT_URL`]) and
    /// the key from [`api_key_from_env`].
    pub fn from_env() -> Result<Self, ClientError> {
        let url = std::env::var("DSEC_URL")
            .ok()
            .filter(|u| !u.is_empty())
            .unwrap_or_else(|| DEFAULT_URL.to_owned());
        Self::new(&url, api_key_from_env()?)
    }

    /// The server URL.
    pub fn base_url(&self) -> &Url {
        &self.base_url
    }

    /// Whether an API key is configured.
    pub fn has_api_key(&self) -> bool {
        self.api_key.is_some()
    }

    // ------------------------------------------------------------ plumbing

    /// `base_url` + `/v1/` + the percent-encoded segments.
    fn url(&self, segments: &[&str]) -> Url {
        let mut url = self.base_url.clone();
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty().push("v1").extend(segments);
        }
        url
    }

    fn request(&self, method: Method, segments: &[&str]) -> RequestBuilder {
        let rb = self.http.request(method, self.url(segments));
        match &self.api_key {
            Some(key) => rb.header(API_KEY_HEADER, key),
            None => rb,
        }
    }

    /// Sends the request; a non-2xx answer becomes [`ClientError::Api`] (or
    /// [`ClientError::Decode`] when the body is not an error body).
    async fn send(rb: RequestBuilder) -> Result<Response, ClientError> {
        let resp = rb.send().await?;
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        let body = resp.bytes().await?;
        match serde_json::from_slice::<ErrorBody>(&body) {
            Ok(b) => Err(ClientError::Api(b.error)),
            Err(_) => {
                let text = String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned();
                Err(ClientError::Decode(format!(
                    "HTTP {status} without an error body: {text}"
                )))
            }
        }
    }

    async fn json<T: DeserializeOwned>(rb: RequestBuilder) -> Result<T, ClientError> {
        let body = Self::send(rb).await?.bytes().await?;
        serde_json::from_slice(&body).map_err(|e| {
            ClientError::Decode(format!("decoding {}: {e}", std::any::type_name::<T>()))
        })
    }

    async fn unit(rb: RequestBuilder) -> Result<(), ClientError> {
        Self::send(rb).await.map(drop)
    }

    fn get(&self, segments: &[&str]) -> RequestBuilder {
        self.request(Method::GET, segments)
    }

    fn post<B: Serialize>(&self, segments: &[&str], body: &B) -> RequestBuilder {
        self.request(Method::POST, segments).json(body)
    }

    fn delete(&self, segments: &[&str]) -> RequestBuilder {
        self.request(Method::DELETE, segments)
    }

    fn byte_stream(resp: Response) -> ByteStream {
        resp.bytes_stream().map_err(ClientError::from).boxed()
    }

    // ------------------------------------------------------------ health, sandboxes

    /// `GET /v1/health` (needs no key).
    pub async fn health(&self) -> Result<Health, ClientError> {
        Self::json(self.get(&["health"])).await
    }

    /// `POST /v1/sandboxes`: returns once the sandbox is ready.
    pub async fn create_sandbox(&self, req: CreateSandboxRequest) -> Result<Sandbox, ClientError> {
        Self::json(self.post(&["sandboxes"], &req)).await
    }

    /// `GET /v1/sandboxes/{id}`.
    pub async fn get_sandbox(&self, id: &str) -> Result<Sandbox, ClientError> {
        Self::json(self.get(&["sandboxes", id])).await
    }

    /// `GET /v1/sandboxes?label=k=v...`: sandboxes carrying all of `labels`.
    pub async fn list_sandboxes(
        &self,
        labels: BTreeMap<String, String>,
    ) -> Result<SandboxList, ClientError> {
        let query: Vec<(&str, String)> = labels
            .iter()
            .map(|(k, v)| ("label", format!("{k}={v}")))
            .collect();
        Self::json(self.get(&["sandboxes"]).query(&query)).await
    }

    /// `DELETE /v1/sandboxes/{id}`.
    pub async fn delete_sandbox(&self, id: &str) -> Result<(), ClientError> {
        Self::unit(self.delete(&["sandboxes", id])).await
    }

    /// `POST /v1/sandboxes/{id}/timeout`: the sandbox now expires `timeout_s` from now.
    pub async fn set_timeout(
        &self,
        id: &str,
        req: SetTimeoutRequest,
    ) -> Result<Sandbox, ClientError> {
        Self::json(self.post(&["sandboxes", id, "timeout"], &req)).await
    }

    /// `PUT /v1/sandboxes/{id}/network`: replaces its network policy.
    pub async fn set_network(
        &self,
        id: &str,
        policy: &NetworkPolicy,
    ) -> Result<Sandbox, ClientError> {
        Self::json(
            self.request(Method::PUT, &["sandboxes", id, "network"])
                .json(policy),
        )
        .await
    }

    /// `GET /v1/sandboxes/{id}/screen`: a full VM's screen, as PNG.
    pub async fn screenshot(&self, id: &str) -> Result<Vec<u8>, ClientError> {
        let resp = Self::send(self.get(&["sandboxes", id, "screen"])).await?;
        Ok(resp.bytes().await?.to_vec())
    }

    /// `POST /v1/sandboxes/{id}/input`: types `events` into a full VM's keyboard.
    pub async fn send_input(&self, id: &str, events: Vec<InputEvent>) -> Result<(), ClientError> {
        Self::send(
            self.request(Method::POST, &["sandboxes", id, "input"])
                .json(&InputRequest { events }),
        )
        .await
        .map(drop)
    }

    /// `POST /v1/sandboxes/{id}/pause`: freezes it and reclaims its memory.
    pub async fn pause_sandbox(&self, id: &str) -> Result<PauseResult, ClientError> {
        Self::json(self.request(Method::POST, &["sandboxes", id, "pause"])).await
    }

    /// `POST /v1/sandboxes/{id}/resume`.
    pub async fn resume_sandbox(&self, id: &str) -> Result<Sandbox, ClientError> {
        Self::json(self.request(Method::POST, &["sandboxes", id, "resume"])).await
    }

    /// `POST /v1/sandboxes/{id}/commit`: its files as a new image (only what changed
    /// since its last commit is stored).
    pub async fn commit_sandbox(&self, id: &str, name: &str) -> Result<Image, ClientError> {
        let req = CommitRequest {
            name: name.to_string(),
        };
        Self::json(self.post(&["sandboxes", id, "commit"], &req)).await
    }

    // ------------------------------------------------------------ warm pools

    /// `POST /v1/pools`: a warm pool of the key's tenant.
    pub async fn create_pool(&self, spec: &PoolSpec) -> Result<Pool, ClientError> {
        Self::json(self.post(&["pools"], spec)).await
    }

    /// `GET /v1/pools`.
    pub async fn list_pools(&self) -> Result<PoolList, ClientError> {
        Self::json(self.get(&["pools"])).await
    }

    /// `GET /v1/pools/{name}`.
    pub async fn get_pool(&self, name: &str) -> Result<Pool, ClientError> {
        Self::json(self.get(&["pools", name])).await
    }

    /// `PATCH /v1/pools/{name}`: new sizes or autoscale policy.
    pub async fn update_pool(&self, name: &str, update: &PoolUpdate) -> Result<Pool, ClientError> {
        Self::json(self.request(Method::PATCH, &["pools", name]).json(update)).await
    }

    /// `DELETE /v1/pools/{name}`: the pool and its warm sandboxes (claimed ones stay).
    pub async fn delete_pool(&self, name: &str) -> Result<(), ClientError> {
        Self::unit(self.delete(&["pools", name])).await
    }

    /// `GET /v1/queue`: creates waiting for capacity, by priority level.
    pub async fn queue_status(&self) -> Result<dsec_wire::v1::QueueStatus, ClientError> {
        Self::json(self.get(&["queue"])).await
    }

    /// `GET /v1/events`: the events `query` selects, as they happen (after a replay of
    /// the kept ones after `query.after`); with `no_follow`, only the replay. The stream
    /// ends when the server ends it or the connection fails (reconnect with `after` set
    /// to the last id seen).
    pub async fn events(
        &self,
        query: &dsec_wire::v1::EventQuery,
    ) -> Result<BoxStream<'static, Result<dsec_wire::v1::Event, ClientError>>, ClientError> {
        let resp = Self::send(self.get(&["events"]).query(query)).await?;
        Ok(sse::events(resp))
    }

    /// `GET /v1/audit`: the audit entries `query` selects (admin keys).
    pub async fn audit(
        &self,
        query: &dsec_wire::v1::AuditQuery,
    ) -> Result<dsec_wire::v1::AuditList, ClientError> {
        Self::json(self.get(&["audit"]).query(query)).await
    }

    /// `POST /v1/fncall`: runs one function call in a member of a pool made for calls.
    pub async fn fncall(
        &self,
        req: &dsec_wire::v1::FnCallRequest,
    ) -> Result<dsec_wire::v1::FnCallResponse, ClientError> {
        Self::json(self.post(&["fncall"], req)).await
    }

    /// `PUT /v1/inputs/{key}`: stores an input (bytes, a stream or a file, streamed) that
    /// tasks of later batches name as `{"blob": key}`.
    pub async fn put_input(
        &self,
        key: &str,
        body: impl Into<UploadBody>,
    ) -> Result<dsec_wire::v1::InputObject, ClientError> {
        let mut segments = vec!["inputs"];
        segments.extend(key.split('/'));
        let answered = files::Answered::default();
        let rb = self
            .request(Method::PUT, &segments)
            .header(header::CONTENT_TYPE, "application/octet-stream")
            .body(body.into().into_reqwest(&answered));
        let answer = Self::json(rb).await;
        answered.set();
        answer
    }

    /// `POST /v1/batches`: submits a batch; it runs in the server.
    pub async fn submit_batch(
        &self,
        spec: &dsec_wire::v1::BatchSpec,
    ) -> Result<dsec_wire::v1::Batch, ClientError> {
        Self::json(self.post(&["batches"], spec)).await
    }

    /// `GET /v1/batches`.
    pub async fn list_batches(&self) -> Result<dsec_wire::v1::BatchList, ClientError> {
        Self::json(self.get(&["batches"])).await
    }

    /// `GET /v1/batches/{id}`.
    pub async fn get_batch(&self, id: &str) -> Result<dsec_wire::v1::Batch, ClientError> {
        Self::json(self.get(&["batches", id])).await
    }

    /// `DELETE /v1/batches/{id}`: cancels a running batch.
    pub async fn cancel_batch(&self, id: &str) -> Result<dsec_wire::v1::Batch, ClientError> {
        Self::json(self.request(Method::DELETE, &["batches", id])).await
    }

    /// `DELETE /v1/batches/{id}?purge=true`: forgets an ended batch, its tasks and what
    /// it wrote to the blob store.
    pub async fn purge_batch(&self, id: &str) -> Result<(), ClientError> {
        Self::unit(
            self.request(Method::DELETE, &["batches", id])
                .query(&[("purge", "true")]),
        )
        .await
    }

    /// `GET /v1/batches/{id}/tasks`: one page of tasks.
    pub async fn batch_tasks(
        &self,
        id: &str,
        query: &dsec_wire::v1::TaskListQuery,
    ) -> Result<dsec_wire::v1::TaskList, ClientError> {
        Self::json(self.get(&["batches", id, "tasks"]).query(query)).await
    }

    /// Every task of batch `id` (all pages).
    pub async fn all_batch_tasks(
        &self,
        id: &str,
    ) -> Result<Vec<dsec_wire::v1::TaskStatus>, ClientError> {
        let mut out = Vec::new();
        let mut query = dsec_wire::v1::TaskListQuery::default();
        loop {
            let page = self.batch_tasks(id, &query).await?;
            out.extend(page.tasks);
            match page.next {
                Some(next) => query.after = Some(next),
                None => return Ok(out),
            }
        }
    }

    /// `GET /v1/batches/{id}/manifest`.
    pub async fn batch_manifest(&self, id: &str) -> Result<dsec_wire::v1::Manifest, ClientError> {
        Self::json(self.get(&["batches", id, "manifest"])).await
    }

    /// `GET /v1/batches/{id}/tasks/{task}/output?path=`: a collected output's bytes, or
    /// (`path` `None`) the task's error snapshot as JSON.
    pub async fn batch_output(
        &self,
        id: &str,
        task: &str,
        path: Option<&str>,
    ) -> Result<Bytes, ClientError> {
        let mut rb = self.get(&["batches", id, "tasks", task, "output"]);
        if let Some(p) = path {
            rb = rb.query(&[("path", p)]);
        }
        let resp = Self::send(rb).await?;
        resp.bytes().await.map_err(ClientError::from)
    }

    /// `POST /v1/jobs/{job}/suspend`: pauses every sandbox labelled `job=<job>`.
    pub async fn suspend_job(&self, job: &str) -> Result<JobResult, ClientError> {
        Self::json(self.request(Method::POST, &["jobs", job, "suspend"])).await
    }

    /// `POST /v1/jobs/{job}/resume`.
    pub async fn resume_job(&self, job: &str) -> Result<JobResult, ClientError> {
        Self::json(self.request(Method::POST, &["jobs", job, "resume"])).await
    }

    /// `GET /v1/nodes`: the nodes the server places sandboxes on.
    pub async fn list_nodes(&self) -> Result<ClusterNodeList, ClientError> {
        Self::json(self.get(&["nodes"])).await
    }

    /// `POST /v1/nodes/{name}/drain` (`drain`) or `/undrain`.
    pub async fn drain_node(&self, name: &str, drain: bool) -> Result<ClusterNode, ClientError> {
        let verb = if drain { "drain" } else { "undrain" };
        Self::json(self.request(Method::POST, &["nodes", name, verb])).await
    }

    // ------------------------------------------------------------ exec, sessions

    /// `POST /v1/sandboxes/{id}/exec`: runs a command to completion.
    pub async fn exec(&self, id: &str, req: ExecRequest) -> Result<ExecResult, ClientError> {
        Self::json(self.post(&["sandboxes", id, "exec"], &req)).await
    }

    /// `POST /v1/sandboxes/{id}/exec/stream`: output events as they happen.
    pub async fn exec_stream(
        &self,
        id: &str,
        req: ExecRequest,
    ) -> Result<EventStream, ClientError> {
        let resp = Self::send(self.post(&["sandboxes", id, "exec", "stream"], &req)).await?;
        Ok(ndjson::events(resp))
    }

    /// `POST /v1/sandboxes/{id}/fork`: `req.count` sandboxes with its files.
    pub async fn fork_sandbox(
        &self,
        id: &str,
        req: &dsec_wire::v1::ForkRequest,
    ) -> Result<dsec_wire::v1::ForkResult, ClientError> {
        Self::json(self.post(&["sandboxes", id, "fork"], req)).await
    }

    /// `GET /v1/sandboxes/{id}/log`: a page of the calls that carried a request id.
    pub async fn call_log(
        &self,
        id: &str,
        query: &dsec_wire::v1::CallLogQuery,
    ) -> Result<dsec_wire::v1::CallLog, ClientError> {
        Self::json(self.get(&["sandboxes", id, "log"]).query(query)).await
    }

    /// `POST /v1/sandboxes/{id}/sessions`.
    pub async fn create_session(
        &self,
        id: &str,
        req: CreateSessionRequest,
    ) -> Result<SessionInfo, ClientError> {
        Self::json(self.post(&["sandboxes", id, "sessions"], &req)).await
    }

    /// `GET /v1/sandboxes/{id}/sessions`.
    pub async fn list_sessions(&self, id: &str) -> Result<SessionList, ClientError> {
        Self::json(self.get(&["sandboxes", id, "sessions"])).await
    }

    /// `POST /v1/sandboxes/{id}/sessions/{session}/run`.
    pub async fn run_in_session(
        &self,
        id: &str,
        session: &str,
        req: SessionRunRequest,
    ) -> Result<SessionResult, ClientError> {
        Self::json(self.post(&["sandboxes", id, "sessions", session, "run"], &req)).await
    }

    /// `POST /v1/sandboxes/{id}/sessions/{session}/interrupt`.
    pub async fn interrupt_session(&self, id: &str, session: &str) -> Result<(), ClientError> {
        Self::unit(self.request(
            Method::POST,
            &["sandboxes", id, "sessions", session, "interrupt"],
        ))
        .await
    }

    /// `DELETE /v1/sandboxes/{id}/sessions/{session}`.
    pub async fn close_session(&self, id: &str, session: &str) -> Result<(), ClientError> {
        Self::unit(self.delete(&["sandboxes", id, "sessions", session])).await
    }

    // ------------------------------------------------------------ processes

    /// `POST /v1/sandboxes/{id}/processes`: starts a background process.
    pub async fn start_process(
        &self,
        id: &str,
        req: StartProcessRequest,
    ) -> Result<ProcessInfo, ClientError> {
        Self::json(self.post(&["sandboxes", id, "processes"], &req)).await
    }

    /// `GET /v1/sandboxes/{id}/processes`.
    pub async fn list_processes(&self, id: &str) -> Result<ProcessList, ClientError> {
        Self::json(self.get(&["sandboxes", id, "processes"])).await
    }

    /// `GET /v1/sandboxes/{id}/processes/{pid}/output`: output from the given offsets;
    /// with `follow`, until the process exits, else up to now (ending with `End`).
    pub async fn process_output(
        &self,
        id: &str,
        pid: u32,
        stdout_offset: u64,
        stderr_offset: u64,
        follow: bool,
    ) -> Result<EventStream, ClientError> {
        let pid = pid.to_string();
        let query = [
            ("stdout_offset", stdout_offset.to_string()),
            ("stderr_offset", stderr_offset.to_string()),
            ("follow", follow.to_string()),
        ];
        let rb = self
            .get(&["sandboxes", id, "processes", &pid, "output"])
            .query(&query);
        Ok(ndjson::events(Self::send(rb).await?))
    }

    /// `POST /v1/sandboxes/{id}/processes/{pid}/stdin`.
    pub async fn process_stdin(
        &self,
        id: &str,
        pid: u32,
        req: StdinRequest,
    ) -> Result<(), ClientError> {
        let pid = pid.to_string();
        Self::unit(self.post(&["sandboxes", id, "processes", &pid, "stdin"], &req)).await
    }

    /// `POST /v1/sandboxes/{id}/processes/{pid}/signal`.
    pub async fn signal_process(
        &self,
        id: &str,
        pid: u32,
        req: SignalRequest,
    ) -> Result<(), ClientError> {
        let pid = pid.to_string();
        Self::unit(self.post(&["sandboxes", id, "processes", &pid, "signal"], &req)).await
    }

    /// `POST /v1/sandboxes/{id}/processes/{pid}/resize`.
    pub async fn resize_process(
        &self,
        id: &str,
        pid: u32,
        size: PtySize,
    ) -> Result<(), ClientError> {
        let pid = pid.to_string();
        Self::unit(self.post(&["sandboxes", id, "processes", &pid, "resize"], &size)).await
    }

    // ------------------------------------------------------------ files

    /// `GET /v1/sandboxes/{id}/files?path=&offset=&length=`: the file's metadata and its
    /// bytes (from `offset`, at most `length`) as a stream.
    pub async fn read_file(
        &self,
        id: &str,
        path: &str,
        offset: u64,
        length: Option<u64>,
    ) -> Result<(FileInfo, ByteStream), ClientError> {
        let mut query = vec![("path", path.to_owned()), ("offset", offset.to_string())];
        if let Some(len) = length {
            query.push(("length", len.to_string()));
        }
        let resp = Self::send(self.get(&["sandboxes", id, "files"]).query(&query)).await?;
        let header = resp.headers().get(FILE_INFO_HEADER).ok_or_else(|| {
            ClientError::Decode(format!("response lacks the {FILE_INFO_HEADER} header"))
        })?;
        let info: FileInfo = serde_json::from_slice(header.as_bytes())
            .map_err(|e| ClientError::Decode(format!("decoding {FILE_INFO_HEADER}: {e}")))?;
        Ok((info, Self::byte_stream(resp)))
    }

    /// `PUT /v1/sandboxes/{id}/files?path=&mode=`: writes `body` (bytes, a stream or a
    /// `tokio::fs::File`, streamed) as the file at `path`, creating parents.
    pub async fn write_file(
        &self,
        id: &str,
        path: &str,
        mode: Option<u32>,
        body: impl Into<UploadBody>,
    ) -> Result<WriteResult, ClientError> {
        self.write_file_recorded(id, path, mode, body, None).await
    }

    /// [`Client::write_file`] recorded under `request_id`: a retry with the same id and
    /// bytes gets the first write's answer without writing again.
    pub async fn write_file_recorded(
        &self,
        id: &str,
        path: &str,
        mode: Option<u32>,
        body: impl Into<UploadBody>,
        request_id: Option<&str>,
    ) -> Result<WriteResult, ClientError> {
        let mut query = vec![("path", path.to_owned())];
        if let Some(m) = mode {
            query.push(("mode", format!("0{m:o}")));
        }
        if let Some(rid) = request_id {
            query.push(("request_id", rid.to_owned()));
        }
        let answered = files::Answered::default();
        let rb = self
            .request(Method::PUT, &["sandboxes", id, "files"])
            .query(&query)
            .header(header::CONTENT_TYPE, "application/octet-stream")
            .body(body.into().into_reqwest(&answered));
        let answer = Self::json(rb).await;
        // The answer is in: a body the server stopped reading early stops too.
        answered.set();
        answer
    }

    /// `GET /v1/sandboxes/{id}/files/list?path=`.
    pub async fn list_files(&self, id: &str, path: &str) -> Result<FileList, ClientError> {
        Self::json(
            self.get(&["sandboxes", id, "files", "list"])
                .query(&[("path", path)]),
        )
        .await
    }

    /// `GET /v1/sandboxes/{id}/files/stat?path=`.
    pub async fn stat_file(&self, id: &str, path: &str) -> Result<FileInfo, ClientError> {
        Self::json(
            self.get(&["sandboxes", id, "files", "stat"])
                .query(&[("path", path)]),
        )
        .await
    }

    /// `POST /v1/sandboxes/{id}/files/mkdir`: creates the directory with its parents.
    pub async fn mkdir(&self, id: &str, req: MkdirRequest) -> Result<(), ClientError> {
        Self::unit(self.post(&["sandboxes", id, "files", "mkdir"], &req)).await
    }

    /// `DELETE /v1/sandboxes/{id}/files?path=&recursive=`.
    pub async fn remove_file(
        &self,
        id: &str,
        path: &str,
        recursive: bool,
    ) -> Result<(), ClientError> {
        let query = [
            ("path", path.to_owned()),
            ("recursive", recursive.to_string()),
        ];
        Self::unit(self.delete(&["sandboxes", id, "files"]).query(&query)).await
    }

    /// `POST /v1/sandboxes/{id}/files/rename`.
    pub async fn rename_file(&self, id: &str, req: RenameRequest) -> Result<(), ClientError> {
        Self::unit(self.post(&["sandboxes", id, "files", "rename"], &req)).await
    }

    /// `GET /v1/sandboxes/{id}/files/tar?path=`: a tar stream of the directory.
    pub async fn download_tar(&self, id: &str, path: &str) -> Result<ByteStream, ClientError> {
        let rb = self
            .get(&["sandboxes", id, "files", "tar"])
            .query(&[("path", path)]);
        Ok(Self::byte_stream(Self::send(rb).await?))
    }

    /// `PUT /v1/sandboxes/{id}/files/tar?path=`: extracts the tar `body` (streamed) into
    /// the directory `path`.
    pub async fn upload_tar(
        &self,
        id: &str,
        path: &str,
        body: impl Into<UploadBody>,
    ) -> Result<WriteResult, ClientError> {
        self.upload_tar_recorded(id, path, body, None).await
    }

    /// [`Client::upload_tar`] recorded under `request_id`, as
    /// [`Client::write_file_recorded`] is.
    pub async fn upload_tar_recorded(
        &self,
        id: &str,
        path: &str,
        body: impl Into<UploadBody>,
        request_id: Option<&str>,
    ) -> Result<WriteResult, ClientError> {
        let mut query = vec![("path", path)];
        if let Some(rid) = request_id {
            query.push(("request_id", rid));
        }
        let answered = files::Answered::default();
        let rb = self
            .request(Method::PUT, &["sandboxes", id, "files", "tar"])
            .query(&query)
            .header(header::CONTENT_TYPE, "application/x-tar")
            .body(body.into().into_reqwest(&answered));
        let answer = Self::json(rb).await;
        // The answer is in: a body the server stopped reading early stops too.
        answered.set();
        answer
    }

    // ------------------------------------------------------------ images

    /// `GET /v1/images`.
    pub async fn list_images(&self) -> Result<ImageList, ClientError> {
        Self::json(self.get(&["images"])).await
    }

    /// `POST /v1/images`: imports a directory or tarball found on the server's host.
    pub async fn import_image(&self, req: ImportImageRequest) -> Result<Image, ClientError> {
        Self::json(self.post(&["images"], &req)).await
    }

    /// `POST /v1/images/import/stream`: the import with its progress events; the last
    /// is `Done` or `Error`.
    pub async fn import_image_stream(
        &self,
        req: ImportImageRequest,
    ) -> Result<BoxStream<'static, Result<ImportEvent, ClientError>>, ClientError> {
        let resp = Self::send(self.post(&["images", "import", "stream"], &req)).await?;
        Ok(ndjson::events(resp))
    }

    /// `POST /v1/images/pull`: pulls an image from an OCI registry, with its progress
    /// events; the last is `Done` or `Error`.
    pub async fn pull_image_stream(
        &self,
        req: dsec_wire::v1::PullImageRequest,
    ) -> Result<BoxStream<'static, Result<ImportEvent, ClientError>>, ClientError> {
        let resp = Self::send(self.post(&["images", "pull"], &req)).await?;
        Ok(ndjson::events(resp))
    }

    /// `POST /v1/images/build/dockerfile`: builds the Dockerfile of the build context
    /// `context` (a tar archive, streamed from here), with its steps, output and warnings
    /// as events; the last is `Done` or `Error`.
    pub async fn build_dockerfile(
        &self,
        req: &dsec_wire::v1::DockerfileBuildRequest,
        context: impl Into<UploadBody>,
    ) -> Result<BoxStream<'static, Result<dsec_wire::v1::BuildEvent, ClientError>>, ClientError>
    {
        let answered = files::Answered::default();
        let rb = self
            .request(Method::POST, &["images", "build", "dockerfile"])
            .query(&req.to_query())
            .header(header::CONTENT_TYPE, "application/x-tar")
            .body(context.into().into_reqwest(&answered));
        let resp = Self::send(rb).await;
        answered.set();
        Ok(ndjson::events(resp?))
    }

    /// `POST /v1/images/upload?name=`: imports the archive `body` (a rootfs tar, compressed
    /// or not, a `docker save` or OCI archive, or an EROFS image), streamed from here.
    pub async fn upload_image(
        &self,
        name: &str,
        flatten: bool,
        body: impl Into<UploadBody>,
    ) -> Result<Image, ClientError> {
        let query = [("name", name.to_owned()), ("flatten", flatten.to_string())];
        let answered = files::Answered::default();
        let rb = self
            .request(Method::POST, &["images", "upload"])
            .query(&query)
            .header(header::CONTENT_TYPE, "application/octet-stream")
            .body(body.into().into_reqwest(&answered));
        let answer = Self::json(rb).await;
        answered.set();
        answer
    }

    /// `GET /v1/images/layers`: on-demand accounting of the node's layers.
    pub async fn layer_stats(&self) -> Result<dsec_wire::v1::LayerStatsList, ClientError> {
        Self::json(self.get(&["images", "layers"])).await
    }

    /// `POST /v1/images/gc`: drops build-cache entries, trims the layer cache, and
    /// optionally sweeps the shared store (see [`GcRequest`]).
    pub async fn gc_images(&self, req: &GcRequest) -> Result<GcResult, ClientError> {
        Self::json(self.post(&["images", "gc"], req)).await
    }

    /// `POST /v1/images/build`: an image from a base and steps (each a cached layer).
    pub async fn build_image(&self, req: BuildRequest) -> Result<BuildResult, ClientError> {
        Self::json(self.post(&["images", "build"], &req)).await
    }

    /// `GET /v1/images/{name}`.
    pub async fn get_image(&self, name: &str) -> Result<Image, ClientError> {
        Self::json(self.get(&["images", name])).await
    }

    /// `DELETE /v1/images/{name}`.
    pub async fn delete_image(&self, name: &str) -> Result<(), ClientError> {
        Self::unit(self.delete(&["images", name])).await
    }
}

/// The API key from the environment: `DSEC_API_KEY`, else the contents of the file named
/// by `DSEC_API_KEY_FILE` (an error if unreadable), else of [`DEFAULT_API_KEY_FILE`] if it
/// exists and is readable, else none.
pub fn api_key_from_env() -> Result<Option<String>, ClientError> {
    if let Some(key) = std::env::var("DSEC_API_KEY")
        .ok()
        .filter(|k| !k.trim().is_empty())
    {
        return Ok(Some(key.trim().to_owned()));
    }
    if let Some(path) = std::env::var_os("DSEC_API_KEY_FILE").filter(|p| !p.is_empty()) {
        let text = std::fs::read_to_string(&path).map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!(
                    "reading DSEC_API_KEY_FILE {}: {e}",
                    std::path::Path::new(&path).display()
                ),
            )
        })?;
        return Ok(Some(text.trim().to_owned()).filter(|k| !k.is_empty()));
    }
    Ok(std::fs::read_to_string(DEFAULT_API_KEY_FILE)
        .ok()
        .map(|t| t.trim().to_owned())
        .filter(|k| !k.is_empty()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_joined_and_encoded() {
        let c = Client::new("http://127.0.0.1:7070", None).expect("client");
        assert_eq!(
            c.url(&["health"]).as_str(),
            "http://127.0.0.1:7070/v1/health"
        );
        assert_eq!(
            c.url(&["images", "a/b c"]).as_str(),
            "http://127.0.0.1:7070/v1/images/a%2Fb%20c"
        );
        let c = Client::new("http://h:1/prefix/", None).expect("client");
        assert_eq!(c.url(&["health"]).as_str(), "http://h:1/prefix/v1/health");
    }

    #[test]
    fn bad_urls_are_config_errors() {
        assert!(matches!(
            Client::new("not a url", None),
            Err(ClientError::Config(_))
        ));
        assert!(matches!(
            Client::new("mailto:x@y", None),
            Err(ClientError::Config(_))
        ));
    }
}

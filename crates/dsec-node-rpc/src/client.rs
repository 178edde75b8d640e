//! [`RemoteNode`]: a [`NodeApi`] that calls a node's internal API over HTTP.

use base64::Engine;
use bytes::{Bytes, BytesMut};
use futures::{StreamExt, TryStreamExt};
use reqwest::{Method, RequestBuilder, Response};
use serde::de::DeserializeOwned;

use dsec_node_api::{
    ByteStream, EventStream, ImportProgressSink, ImportSource, NodeApi, NodeCreateSpec, NodeResult,
    NodeSandbox,
};
use dsec_wire::agent::{ExecSpec, FileInfo, Reply, Request};
use dsec_wire::error::ErrorBody;
use dsec_wire::v1::{
    ExecEvent, ExecResult, GcRequest, GcResult, Image, ImageConfig, ImportEvent, LayerStatsList,
    NetworkPolicy, NodeCapacity, WriteResult,
};
use dsec_wire::{ApiError, ErrorCode};

use crate::{
    CommitCall, CommitReply, ExecCall, NodeInfo, PauseReply, TagCall, FILE_INFO_HEADER, PREFIX,
};

/// A node reached over its internal API.
#[derive(Debug, Clone)]
pub struct RemoteNode {
    base: String,
    token: String,
    http: reqwest::Client,
    info: NodeInfo,
}

/// The node could not be reached or answered something that is not its API.
fn unreachable(base: &str, e: impl std::fmt::Display) -> ApiError {
    ApiError::new(
        ErrorCode::AgentUnavailable,
        format!("node at {base} unreachable: {e}"),
    )
}

impl RemoteNode {
    /// Connects to the node at `base` (`http://host:port`), checking the token.
    pub async fn connect(base: &str, token: &str) -> NodeResult<Self> {
        let mut node = Self::known(
            base,
            token,
            NodeInfo {
                name: String::new(),
                cgroup_version: String::new(),
            },
        )?;
        node.info = node.json(node.req(Method::GET, "/info")).await?;
        Ok(node)
    }

    /// The node at `base` as its registration describes it (`info`), without asking it:
    /// a cluster's API server dials every registered node this way, and the first call
    /// finds out whether it answers.
    pub fn known(base: &str, token: &str, info: NodeInfo) -> NodeResult<Self> {
        let http = reqwest::Client::builder()
            .tcp_nodelay(true)
            .pool_idle_timeout(std::time::Duration::from_secs(90))
            .connect_timeout(std::time::Duration::from_secs(2))
            .build()
            .map_err(|e| unreachable(base, e))?;
        Ok(Self {
            base: base.trim_end_matches('/').to_string(),
            token: token.to_string(),
            http,
            info,
        })
    }

    fn req(&self, method: Method, path: &str) -> RequestBuilder {
        let req = self
            .http
            .request(method, format!("{}{PREFIX}{path}", self.base))
            .bearer_auth(&self.token);
        // The API request this call serves, for the node's log, and its trace context,
        // which the node's span and commands continue.
        use dsec_node_api::request_id;
        let req = match request_id::current() {
            Some(id) => req.header(request_id::HEADER, &*id),
            None => req,
        };
        match request_id::traceparent() {
            Some(tp) => req.header(request_id::TRACEPARENT_HEADER, &*tp),
            None => req,
        }
    }

    fn sandbox(&self, method: Method, id: &str, rest: &str) -> RequestBuilder {
        self.req(method, &format!("/sandboxes/{}{rest}", encode(id)))
    }

    /// Sends and returns the response if it is a success, else the node's error.
    async fn send(&self, req: RequestBuilder) -> NodeResult<Response> {
        let resp = req.send().await.map_err(|e| unreachable(&self.base, e))?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status();
        let body = resp.bytes().await.unwrap_or_default();
        Err(match serde_json::from_slice::<ErrorBody>(&body) {
            Ok(b) => b.error,
            Err(_) => ApiError::new(
                if status.is_client_error() {
                    ErrorCode::BadRequest
                } else {
                    ErrorCode::Internal
                },
                format!(
                    "node answered {status}: {}",
                    String::from_utf8_lossy(&body[..body.len().min(500)])
                ),
            ),
        })
    }

    async fn json<T: DeserializeOwned>(&self, req: RequestBuilder) -> NodeResult<T> {
        let resp = self.send(req).await?;
        resp.json()
            .await
            .map_err(|e| unreachable(&self.base, format!("bad reply: {e}")))
    }

    async fn empty(&self, req: RequestBuilder) -> NodeResult<()> {
        self.send(req).await.map(drop)
    }

    /// Reads an import's or pull's NDJSON answer to its end: progress goes to `progress`,
    /// the last event is the image or the error.
    async fn image_result(
        &self,
        resp: Response,
        progress: Option<ImportProgressSink>,
        what: &str,
    ) -> NodeResult<Image> {
        let mut events = self.events_of(resp, |error| ImportEvent::Error { error });
        while let Some(ev) = events.next().await {
            match ev {
                ImportEvent::Done { image } => return Ok(image),
                ImportEvent::Error { error } => return Err(error),
                progress_event => {
                    if let Some(sink) = &progress {
                        sink(progress_event);
                    }
                }
            }
        }
        Err(unreachable(
            &self.base,
            format!("{what} ended without a result"),
        ))
    }

    fn bytes_of(&self, resp: Response) -> ByteStream {
        let base = self.base.clone();
        resp.bytes_stream()
            .map_err(move |e| unreachable(&base, format!("transfer broke off: {e}")))
            .boxed()
    }

    fn events_of<T: DeserializeOwned + Send + 'static>(
        &self,
        resp: Response,
        broken: fn(ApiError) -> T,
    ) -> futures::stream::BoxStream<'static, T> {
        let base = self.base.clone();
        let mut bytes = resp.bytes_stream();
        let mut buf = BytesMut::new();
        let mut done = false;
        futures::stream::poll_fn(move |cx| {
            use std::task::Poll;
            loop {
                if done {
                    return Poll::Ready(None);
                }
                if let Some(pos) = buf.iter().position(|&b| b == b'\n') {
                    let line = buf.split_to(pos + 1);
                    let line = &line[..pos];
                    if line.iter().all(u8::is_ascii_whitespace) {
                        continue;
                    }
                    return Poll::Ready(Some(match serde_json::from_slice(line) {
                        Ok(ev) => ev,
                        Err(e) => {
                            done = true;
                            broken(unreachable(&base, format!("bad event: {e}")))
                        }
                    }));
                }
                match bytes.poll_next_unpin(cx) {
                    Poll::Ready(Some(Ok(chunk))) => buf.extend_from_slice(&chunk),
                    Poll::Ready(Some(Err(e))) => {
                        done = true;
                        return Poll::Ready(Some(broken(unreachable(
                            &base,
                            format!("stream broke off: {e}"),
                        ))));
                    }
                    Poll::Ready(None) => {
                        done = true;
                        if buf.iter().all(u8::is_ascii_whitespace) {
                            return Poll::Ready(None);
                        }
                        return Poll::Ready(Some(broken(unreachable(
                            &base,
                            "stream ended inside an event",
                        ))));
                    }
                    Poll::Pending => return Poll::Pending,
                }
            }
        })
        .boxed()
    }

    fn exec_call(spec: ExecSpec, stdin: Option<Bytes>, request_id: Option<&str>) -> ExecCall {
        ExecCall {
            spec,
            stdin_b64: stdin.map(|b| base64::engine::general_purpose::STANDARD.encode(b)),
            request_id: request_id.map(str::to_string),
        }
    }
}

/// Percent-encodes a path segment (ids are plain, but nothing here assumes it).
fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn upload_body(body: ByteStream) -> reqwest::Body {
    reqwest::Body::wrap_stream(body)
}

#[async_trait::async_trait]
impl NodeApi for RemoteNode {
    fn name(&self) -> &str {
        &self.info.name
    }

    fn cgroup_version(&self) -> &'static str {
        if self.info.cgroup_version == "v1" {
            "v1"
        } else {
            "v2"
        }
    }

    async fn create(&self, spec: NodeCreateSpec) -> NodeResult<NodeSandbox> {
        self.json(self.req(Method::POST, "/sandboxes").json(&spec))
            .await
    }

    async fn destroy(&self, id: &str) -> NodeResult<()> {
        self.empty(self.sandbox(Method::DELETE, id, "")).await
    }

    async fn list(&self) -> NodeResult<Vec<NodeSandbox>> {
        self.json(self.req(Method::GET, "/sandboxes")).await
    }

    async fn pause(&self, id: &str) -> NodeResult<(u64, u64)> {
        let r: PauseReply = self.json(self.sandbox(Method::POST, id, "/pause")).await?;
        Ok((r.before, r.after))
    }

    async fn resume(&self, id: &str) -> NodeResult<()> {
        self.empty(self.sandbox(Method::POST, id, "/resume")).await
    }

    async fn commit(
        &self,
        id: &str,
        name: &str,
        previous_diffs: Vec<String>,
        config: ImageConfig,
    ) -> NodeResult<(Image, Option<String>)> {
        let call = CommitCall {
            name: name.to_string(),
            previous_diffs,
            config,
        };
        let r: CommitReply = self
            .json(self.sandbox(Method::POST, id, "/commit").json(&call))
            .await?;
        Ok((r.image, r.diff))
    }

    async fn set_network(&self, id: &str, policy: NetworkPolicy) -> NodeResult<()> {
        self.empty(self.sandbox(Method::PUT, id, "/network").json(&policy))
            .await
    }

    async fn screenshot(&self, id: &str) -> NodeResult<Bytes> {
        let resp = self.send(self.sandbox(Method::GET, id, "/screen")).await?;
        resp.bytes()
            .await
            .map_err(|e| unreachable(&self.base, format!("screenshot: {e}")))
    }

    async fn send_input(&self, id: &str, events: Vec<dsec_wire::v1::InputEvent>) -> NodeResult<()> {
        let req = dsec_wire::v1::InputRequest { events };
        self.empty(self.sandbox(Method::POST, id, "/input").json(&req))
            .await
    }

    async fn set_lifetime(&self, id: &str, lifetime: dsec_node_api::Lifetime) -> NodeResult<()> {
        self.empty(self.sandbox(Method::PUT, id, "/lifetime").json(&lifetime))
            .await
    }

    async fn capacity(&self) -> NodeCapacity {
        match self.json(self.req(Method::GET, "/capacity")).await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(node = %self.base, error = %e.message, "reading the node's capacity failed");
                NodeCapacity {
                    cpu_millis_allocatable: 0,
                    cpu_millis_requested: 0,
                    memory_available_bytes: 0,
                    memory_reserve_bytes: 0,
                    sandboxes: 0,
                    max_sandboxes: 0,
                    core_scheduling: false,
                }
            }
        }
    }

    async fn ping(&self, id: &str) -> NodeResult<()> {
        self.empty(self.sandbox(Method::POST, id, "/ping")).await
    }

    async fn call(&self, id: &str, req: Request) -> NodeResult<Reply> {
        self.json(self.sandbox(Method::POST, id, "/call").json(&req))
            .await
    }

    async fn call_recorded(&self, id: &str, request_id: &str, req: Request) -> NodeResult<Reply> {
        self.json(
            self.sandbox(Method::POST, id, "/call")
                .query(&[("request_id", request_id)])
                .json(&req),
        )
        .await
    }

    async fn upload_recorded(
        &self,
        id: &str,
        request_id: &str,
        req: Request,
        body: ByteStream,
    ) -> NodeResult<WriteResult> {
        let (route, mut query) = match req {
            Request::FileWrite { path, mode, .. } => {
                let mut query = vec![("path", path)];
                if let Some(m) = mode {
                    query.push(("mode", m.to_string()));
                }
                ("/file", query)
            }
            Request::TarUpload { path } => ("/tar", vec![("path", path)]),
            _ => {
                return Err(ApiError::new(
                    ErrorCode::BadRequest,
                    "only file writes and tar uploads are recorded uploads",
                ))
            }
        };
        query.push(("request_id", request_id.to_string()));
        let req = self
            .sandbox(Method::PUT, id, route)
            .query(&query)
            .body(upload_body(body));
        self.json(req).await
    }

    async fn exec(&self, id: &str, spec: ExecSpec, stdin: Option<Bytes>) -> NodeResult<ExecResult> {
        let call = Self::exec_call(spec, stdin, None);
        self.json(self.sandbox(Method::POST, id, "/exec").json(&call))
            .await
    }

    async fn exec_stream(
        &self,
        id: &str,
        spec: ExecSpec,
        stdin: Option<Bytes>,
    ) -> NodeResult<EventStream> {
        let call = Self::exec_call(spec, stdin, None);
        let resp = self
            .send(self.sandbox(Method::POST, id, "/exec-stream").json(&call))
            .await?;
        Ok(self.events_of(resp, |error| ExecEvent::Error { error }))
    }

    async fn exec_recorded(
        &self,
        id: &str,
        request_id: &str,
        spec: ExecSpec,
        stdin: Option<Bytes>,
    ) -> NodeResult<ExecResult> {
        let call = Self::exec_call(spec, stdin, Some(request_id));
        self.json(self.sandbox(Method::POST, id, "/exec").json(&call))
            .await
    }

    async fn exec_stream_recorded(
        &self,
        id: &str,
        request_id: &str,
        spec: ExecSpec,
        stdin: Option<Bytes>,
    ) -> NodeResult<EventStream> {
        let call = Self::exec_call(spec, stdin, Some(request_id));
        let resp = self
            .send(self.sandbox(Method::POST, id, "/exec-stream").json(&call))
            .await?;
        Ok(self.events_of(resp, |error| ExecEvent::Error { error }))
    }

    async fn call_log(
        &self,
        id: &str,
        query: &dsec_wire::v1::CallLogQuery,
    ) -> NodeResult<dsec_wire::v1::CallLog> {
        self.json(self.sandbox(Method::POST, id, "/log").json(query))
            .await
    }

    async fn process_output(
        &self,
        id: &str,
        pid: u32,
        stdout_offset: u64,
        stderr_offset: u64,
        follow: bool,
    ) -> NodeResult<EventStream> {
        let req = self
            .sandbox(Method::GET, id, &format!("/processes/{pid}/output"))
            .query(&[
                ("stdout_offset", stdout_offset.to_string()),
                ("stderr_offset", stderr_offset.to_string()),
                ("follow", follow.to_string()),
            ]);
        let resp = self.send(req).await?;
        Ok(self.events_of(resp, |error| ExecEvent::Error { error }))
    }

    async fn process_stdin(&self, id: &str, pid: u32, data: Bytes, close: bool) -> NodeResult<()> {
        let req = self
            .sandbox(Method::POST, id, &format!("/processes/{pid}/stdin"))
            .query(&[("close", close.to_string())])
            .body(data);
        self.empty(req).await
    }

    async fn read_file(
        &self,
        id: &str,
        path: &str,
        offset: u64,
        length: Option<u64>,
    ) -> NodeResult<(FileInfo, ByteStream)> {
        let mut query = vec![("path", path.to_string()), ("offset", offset.to_string())];
        if let Some(l) = length {
            query.push(("length", l.to_string()));
        }
        let resp = self
            .send(self.sandbox(Method::GET, id, "/file").query(&query))
            .await?;
        let info = resp
            .headers()
            .get(FILE_INFO_HEADER)
            .and_then(|v| {
                base64::engine::general_purpose::STANDARD
                    .decode(v.as_bytes())
                    .ok()
            })
            .and_then(|json| serde_json::from_slice::<FileInfo>(&json).ok())
            .ok_or_else(|| unreachable(&self.base, "file reply without its file info"))?;
        Ok((info, self.bytes_of(resp)))
    }

    async fn write_file(
        &self,
        id: &str,
        path: &str,
        mode: Option<u32>,
        body: ByteStream,
    ) -> NodeResult<WriteResult> {
        let mut query = vec![("path", path.to_string())];
        if let Some(m) = mode {
            query.push(("mode", m.to_string()));
        }
        let req = self
            .sandbox(Method::PUT, id, "/file")
            .query(&query)
            .body(upload_body(body));
        self.json(req).await
    }

    async fn download_tar(&self, id: &str, path: &str) -> NodeResult<ByteStream> {
        let resp = self
            .send(
                self.sandbox(Method::GET, id, "/tar")
                    .query(&[("path", path)]),
            )
            .await?;
        Ok(self.bytes_of(resp))
    }

    async fn upload_tar(&self, id: &str, path: &str, body: ByteStream) -> NodeResult<WriteResult> {
        let req = self
            .sandbox(Method::PUT, id, "/tar")
            .query(&[("path", path)])
            .body(upload_body(body));
        self.json(req).await
    }

    async fn list_images(&self) -> NodeResult<Vec<Image>> {
        self.json(self.req(Method::GET, "/images")).await
    }

    async fn image(&self, name: &str) -> NodeResult<Image> {
        self.json(self.req(Method::GET, "/image").query(&[("name", name)]))
            .await
    }

    async fn import_image(
        &self,
        name: &str,
        source: ImportSource,
        flatten: bool,
        progress: Option<ImportProgressSink>,
    ) -> NodeResult<Image> {
        let body = match source {
            ImportSource::Archive(body) => body,
            ImportSource::NodePath(path) => {
                return Err(ApiError::new(
                    ErrorCode::BadRequest,
                    format!(
                        "{} is a path on the API server, and its nodes are other machines: \
                         send the file instead (`dsec image import --upload`, the SDK's \
                         upload_image, POST /v1/images/upload)",
                        path.display()
                    ),
                ))
            }
        };
        let req = self
            .req(Method::POST, "/images/import")
            .query(&[("name", name.to_string()), ("flatten", flatten.to_string())])
            .body(upload_body(body));
        let resp = self.send(req).await?;
        self.image_result(resp, progress, "import").await
    }

    async fn pull_image(
        &self,
        req: &dsec_wire::v1::PullImageRequest,
        progress: Option<ImportProgressSink>,
    ) -> NodeResult<Image> {
        let resp = self
            .send(self.req(Method::POST, "/images/pull").json(req))
            .await?;
        self.image_result(resp, progress, "pull").await
    }

    async fn remove_image(&self, name: &str) -> NodeResult<()> {
        self.empty(self.req(Method::DELETE, "/image").query(&[("name", name)]))
            .await
    }

    async fn gc_images(&self, req: &GcRequest) -> NodeResult<GcResult> {
        self.json(self.req(Method::POST, "/images/gc").json(req))
            .await
    }

    async fn layer_stats(&self) -> NodeResult<LayerStatsList> {
        self.json(self.req(Method::GET, "/layer-stats")).await
    }

    async fn tag_image(
        &self,
        source: &str,
        name: &str,
        config: Option<ImageConfig>,
    ) -> NodeResult<Image> {
        let call = TagCall {
            source: source.to_string(),
            name: name.to_string(),
            config,
        };
        self.json(self.req(Method::POST, "/images/tag").json(&call))
            .await
    }
}

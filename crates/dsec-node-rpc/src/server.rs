//! Serves a [`NodeApi`] over HTTP to API servers holding the node token.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use base64::Engine;
use bytes::Bytes;
use futures::{Stream, StreamExt};
use serde::Deserialize;

use dsec_node_api::{ByteStream, ImportSource, NodeApi, NodeCreateSpec, NodeSandbox};
use dsec_wire::error::ErrorBody;
use dsec_wire::v1::{GcRequest, ImportEvent, NetworkPolicy};
use dsec_wire::{ApiError, ErrorCode};

use crate::{
    CommitCall, CommitReply, ExecCall, NodeInfo, PauseReply, TagCall, FILE_INFO_HEADER, PREFIX,
};

/// A node's error on its way back to the API server.
#[derive(Debug)]
struct RpcError(ApiError);

impl From<ApiError> for RpcError {
    fn from(e: ApiError) -> Self {
        Self(e)
    }
}

impl IntoResponse for RpcError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.0.code.http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, Json(ErrorBody { error: self.0 })).into_response()
    }
}

type RpcResult<T> = Result<T, RpcError>;

fn bad_request(msg: impl Into<String>) -> RpcError {
    RpcError(ApiError::new(ErrorCode::BadRequest, msg))
}

/// Largest JSON request body.
const MAX_JSON_BODY: usize = 64 << 20;

struct Rpc {
    node: Arc<dyn NodeApi>,
    token: String,
}

/// The node's internal API: every route of [`crate`] over `node`, for callers that
/// present `token`.
pub fn router(node: Arc<dyn NodeApi>, token: String) -> Router {
    let rpc = Arc::new(Rpc { node, token });
    let routes = Router::new()
        .route("/info", get(info))
        .route("/capacity", get(capacity))
        .route("/sandboxes", get(list).post(create))
        .route("/sandboxes/{id}", axum::routing::delete(destroy))
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/sandboxes/{id}/resume", post(resume))
        .route("/sandboxes/{id}/ping", post(ping))
        .route("/sandboxes/{id}/commit", post(commit))
        .route("/sandboxes/{id}/network", put(set_network))
        .route("/sandboxes/{id}/screen", get(screenshot))
        .route("/sandboxes/{id}/input", post(send_input))
        .route("/sandboxes/{id}/lifetime", put(set_lifetime))
        .route("/sandboxes/{id}/call", post(call))
        .route("/sandboxes/{id}/exec", post(exec))
        .route("/sandboxes/{id}/exec-stream", post(exec_stream))
        .route("/sandboxes/{id}/log", post(call_log))
        .route(
            "/sandboxes/{id}/processes/{pid}/output",
            get(process_output),
        )
        .route("/sandboxes/{id}/processes/{pid}/stdin", post(process_stdin))
        .route("/sandboxes/{id}/file", get(read_file).put(write_file))
        .route("/sandboxes/{id}/tar", get(download_tar).put(upload_tar))
        .route("/images", get(list_images))
        .route("/image", get(image).delete(remove_image))
        .route("/images/import", post(import_image))
        .route("/images/pull", post(pull_image))
        .route("/images/tag", post(tag_image))
        .route("/images/gc", post(gc_images))
        .route("/layer-stats", get(layer_stats))
        .fallback(|| async { RpcError(ApiError::new(ErrorCode::NotFound, "no such node route")) })
        .layer(axum::middleware::from_fn_with_state(
            rpc.clone(),
            authenticate,
        ))
        // JSON bodies carry an exec's whole stdin (base64): the public API's limits
        // apply before a call gets here.
        .layer(axum::extract::DefaultBodyLimit::max(MAX_JSON_BODY))
        .layer(axum::middleware::from_fn(request_ids))
        .with_state(rpc);
    Router::new().nest(PREFIX, routes)
}

/// The API server's request id (its `x-request-id`) and trace context (`traceparent`),
/// carried by the task serving the call: its span (`node_call`, a child of the API
/// server's when spans are exported) names the request, and the commands it runs get
/// both in their environment.
async fn request_ids(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use dsec_node_api::request_id;
    use tracing::Instrument;
    let headers = req.headers();
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let id = header(request_id::HEADER).filter(|v| request_id::acceptable(v));
    let incoming =
        header(request_id::TRACEPARENT_HEADER).filter(|v| dsec_telemetry::valid_traceparent(v));
    let Some(id) = id else {
        return next.run(req).await;
    };
    let span = tracing::info_span!("node_call", request_id = %id, path = %req.uri().path());
    if let Some(tp) = &incoming {
        dsec_telemetry::set_parent(&span, tp);
    }
    let traceparent = dsec_telemetry::traceparent(&span).or(incoming);
    request_id::scope_traced(id.into(), traceparent.map(Into::into), next.run(req))
        .instrument(span)
        .await
}

/// Refuses a request without the node token (compared in constant time).
async fn authenticate(State(rpc): State<Arc<Rpc>>, req: Request, next: Next) -> Response {
    if !token_ok(&req, &rpc.token) {
        return RpcError(ApiError::new(
            ErrorCode::Unauthorized,
            "missing or wrong node token",
        ))
        .into_response();
    }
    next.run(req).await
}

/// Whether `req` presents `token` (`Authorization: Bearer`), compared in constant time.
pub(crate) fn token_ok(req: &Request, token: &str) -> bool {
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    constant_time_eq(presented.as_bytes(), token.as_bytes())
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A request body as a [`ByteStream`].
fn body_stream(body: Body) -> ByteStream {
    body.into_data_stream()
        .map(|r| {
            r.map_err(|e| {
                ApiError::new(
                    ErrorCode::BadRequest,
                    format!("the request body broke off: {e}"),
                )
            })
        })
        .boxed()
}

/// A response streaming `bytes`; an error mid-stream cuts the body, so the caller sees
/// a broken transfer, never a short file taken for whole.
fn bytes_response(bytes: ByteStream) -> Response {
    let body = Body::from_stream(bytes.map(|r| r.map_err(std::io::Error::other)));
    ([(header::CONTENT_TYPE, "application/octet-stream")], body).into_response()
}

/// A response of one JSON line per item.
fn ndjson_response<T: serde::Serialize + Send + 'static>(
    items: impl Stream<Item = T> + Send + 'static,
) -> Response {
    let body = Body::from_stream(items.map(|item| {
        let mut line = serde_json::to_vec(&item).map_err(std::io::Error::other)?;
        line.push(b'\n');
        Ok::<_, std::io::Error>(Bytes::from(line))
    }));
    ([(header::CONTENT_TYPE, "application/x-ndjson")], body).into_response()
}

fn decode_stdin(b64: Option<String>) -> RpcResult<Option<Bytes>> {
    b64.map(|s| {
        base64::engine::general_purpose::STANDARD
            .decode(s)
            .map(Bytes::from)
            .map_err(|e| bad_request(format!("stdin_b64 is not base64: {e}")))
    })
    .transpose()
}

async fn info(State(rpc): State<Arc<Rpc>>) -> Json<NodeInfo> {
    Json(NodeInfo {
        name: rpc.node.name().to_string(),
        cgroup_version: rpc.node.cgroup_version().to_string(),
    })
}

async fn capacity(State(rpc): State<Arc<Rpc>>) -> impl IntoResponse {
    Json(rpc.node.capacity().await)
}

async fn list(State(rpc): State<Arc<Rpc>>) -> RpcResult<Json<Vec<NodeSandbox>>> {
    Ok(Json(rpc.node.list().await?))
}

async fn create(
    State(rpc): State<Arc<Rpc>>,
    Json(spec): Json<NodeCreateSpec>,
) -> RpcResult<impl IntoResponse> {
    Ok(Json(rpc.node.create(spec).await?))
}

async fn destroy(State(rpc): State<Arc<Rpc>>, Path(id): Path<String>) -> RpcResult<StatusCode> {
    rpc.node.destroy(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn pause(State(rpc): State<Arc<Rpc>>, Path(id): Path<String>) -> RpcResult<Json<PauseReply>> {
    let (before, after) = rpc.node.pause(&id).await?;
    Ok(Json(PauseReply { before, after }))
}

async fn resume(State(rpc): State<Arc<Rpc>>, Path(id): Path<String>) -> RpcResult<StatusCode> {
    rpc.node.resume(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn ping(State(rpc): State<Arc<Rpc>>, Path(id): Path<String>) -> RpcResult<StatusCode> {
    rpc.node.ping(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn commit(
    State(rpc): State<Arc<Rpc>>,
    Path(id): Path<String>,
    Json(c): Json<CommitCall>,
) -> RpcResult<Json<CommitReply>> {
    let (image, diff) = rpc
        .node
        .commit(&id, &c.name, c.previous_diffs, c.config)
        .await?;
    Ok(Json(CommitReply { image, diff }))
}

async fn set_network(
    State(rpc): State<Arc<Rpc>>,
    Path(id): Path<String>,
    Json(policy): Json<NetworkPolicy>,
) -> RpcResult<StatusCode> {
    rpc.node.set_network(&id, policy).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn screenshot(
    State(rpc): State<Arc<Rpc>>,
    Path(id): Path<String>,
) -> RpcResult<impl IntoResponse> {
    let png = rpc.node.screenshot(&id).await?;
    Ok((
        [(header::CONTENT_TYPE, HeaderValue::from_static("image/png"))],
        png,
    ))
}

async fn send_input(
    State(rpc): State<Arc<Rpc>>,
    Path(id): Path<String>,
    Json(req): Json<dsec_wire::v1::InputRequest>,
) -> RpcResult<StatusCode> {
    rpc.node.send_input(&id, req.events).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn set_lifetime(
    State(rpc): State<Arc<Rpc>>,
    Path(id): Path<String>,
    Json(lifetime): Json<dsec_node_api::Lifetime>,
) -> RpcResult<StatusCode> {
    rpc.node.set_lifetime(&id, lifetime).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize)]
struct CallQuery {
    #[serde(default)]
    request_id: Option<String>,
}

async fn call(
    State(rpc): State<Arc<Rpc>>,
    Path(id): Path<String>,
    Query(q): Query<CallQuery>,
    Json(req): Json<dsec_wire::agent::Request>,
) -> RpcResult<impl IntoResponse> {
    if !dsec_node_api::is_unary(&req) {
        return Err(bad_request("this request streams: use its own route"));
    }
    let reply = match &q.request_id {
        Some(rid) => rpc.node.call_recorded(&id, rid, req).await?,
        None => rpc.node.call(&id, req).await?,
    };
    Ok(Json(reply))
}

async fn exec(
    State(rpc): State<Arc<Rpc>>,
    Path(id): Path<String>,
    Json(c): Json<ExecCall>,
) -> RpcResult<impl IntoResponse> {
    let stdin = decode_stdin(c.stdin_b64)?;
    let result = match &c.request_id {
        Some(rid) => rpc.node.exec_recorded(&id, rid, c.spec, stdin).await?,
        None => rpc.node.exec(&id, c.spec, stdin).await?,
    };
    Ok(Json(result))
}

async fn call_log(
    State(rpc): State<Arc<Rpc>>,
    Path(id): Path<String>,
    Json(q): Json<dsec_wire::v1::CallLogQuery>,
) -> RpcResult<impl IntoResponse> {
    Ok(Json(rpc.node.call_log(&id, &q).await?))
}

async fn exec_stream(
    State(rpc): State<Arc<Rpc>>,
    Path(id): Path<String>,
    Json(c): Json<ExecCall>,
) -> RpcResult<Response> {
    let stdin = decode_stdin(c.stdin_b64)?;
    let events = match &c.request_id {
        Some(rid) => {
            rpc.node
                .exec_stream_recorded(&id, rid, c.spec, stdin)
                .await?
        }
        None => rpc.node.exec_stream(&id, c.spec, stdin).await?,
    };
    Ok(ndjson_response(events))
}

#[derive(Deserialize)]
struct OutputQuery {
    #[serde(default)]
    stdout_offset: u64,
    #[serde(default)]
    stderr_offset: u64,
    #[serde(default)]
    follow: bool,
}

async fn process_output(
    State(rpc): State<Arc<Rpc>>,
    Path((id, pid)): Path<(String, u32)>,
    Query(q): Query<OutputQuery>,
) -> RpcResult<Response> {
    let events = rpc
        .node
        .process_output(&id, pid, q.stdout_offset, q.stderr_offset, q.follow)
        .await?;
    Ok(ndjson_response(events))
}

#[derive(Deserialize)]
struct StdinQuery {
    #[serde(default)]
    close: bool,
}

async fn process_stdin(
    State(rpc): State<Arc<Rpc>>,
    Path((id, pid)): Path<(String, u32)>,
    Query(q): Query<StdinQuery>,
    data: Bytes,
) -> RpcResult<StatusCode> {
    rpc.node.process_stdin(&id, pid, data, q.close).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize)]
struct FileQuery {
    path: String,
    #[serde(default)]
    offset: u64,
    length: Option<u64>,
    mode: Option<u32>,
    /// A recorded upload's request id.
    request_id: Option<String>,
}

async fn read_file(
    State(rpc): State<Arc<Rpc>>,
    Path(id): Path<String>,
    Query(q): Query<FileQuery>,
) -> RpcResult<Response> {
    let (info, bytes) = rpc.node.read_file(&id, &q.path, q.offset, q.length).await?;
    let json = serde_json::to_vec(&info)
        .map_err(|e| RpcError(ApiError::new(ErrorCode::Internal, e.to_string())))?;
    let value = base64::engine::general_purpose::STANDARD.encode(json);
    let mut resp = bytes_response(bytes);
    if let Ok(v) = HeaderValue::from_str(&value) {
        resp.headers_mut().insert(FILE_INFO_HEADER, v);
    }
    Ok(resp)
}

async fn write_file(
    State(rpc): State<Arc<Rpc>>,
    Path(id): Path<String>,
    Query(q): Query<FileQuery>,
    body: Body,
) -> RpcResult<impl IntoResponse> {
    let written = match q.request_id {
        Some(rid) => {
            let req = dsec_wire::agent::Request::FileWrite {
                path: q.path,
                mode: q.mode,
                create_parents: true,
            };
            rpc.node
                .upload_recorded(&id, &rid, req, body_stream(body))
                .await?
        }
        None => {
            rpc.node
                .write_file(&id, &q.path, q.mode, body_stream(body))
                .await?
        }
    };
    Ok(Json(written))
}

#[derive(Deserialize)]
struct PathQuery {
    path: String,
}

#[derive(Deserialize)]
struct TarUploadQuery {
    path: String,
    /// A recorded upload's request id.
    request_id: Option<String>,
}

async fn download_tar(
    State(rpc): State<Arc<Rpc>>,
    Path(id): Path<String>,
    Query(q): Query<PathQuery>,
) -> RpcResult<Response> {
    Ok(bytes_response(rpc.node.download_tar(&id, &q.path).await?))
}

async fn upload_tar(
    State(rpc): State<Arc<Rpc>>,
    Path(id): Path<String>,
    Query(q): Query<TarUploadQuery>,
    body: Body,
) -> RpcResult<impl IntoResponse> {
    let body = body_stream(body);
    let written = match q.request_id {
        Some(rid) => {
            let req = dsec_wire::agent::Request::TarUpload { path: q.path };
            rpc.node.upload_recorded(&id, &rid, req, body).await?
        }
        None => rpc.node.upload_tar(&id, &q.path, body).await?,
    };
    Ok(Json(written))
}

async fn list_images(State(rpc): State<Arc<Rpc>>) -> RpcResult<impl IntoResponse> {
    Ok(Json(rpc.node.list_images().await?))
}

#[derive(Deserialize)]
struct NameQuery {
    name: String,
}

async fn image(
    State(rpc): State<Arc<Rpc>>,
    Query(q): Query<NameQuery>,
) -> RpcResult<impl IntoResponse> {
    Ok(Json(rpc.node.image(&q.name).await?))
}

async fn remove_image(
    State(rpc): State<Arc<Rpc>>,
    Query(q): Query<NameQuery>,
) -> RpcResult<StatusCode> {
    rpc.node.remove_image(&q.name).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Imports the archive in the body; answers with NDJSON progress ending in `done` or
/// `error`. The import runs to its end even if the caller goes away.
async fn import_image(
    State(rpc): State<Arc<Rpc>>,
    Query(q): Query<HashMap<String, String>>,
    body: Body,
) -> RpcResult<Response> {
    let name = q
        .get("name")
        .cloned()
        .ok_or_else(|| bad_request("name is required"))?;
    let flatten = q.get("flatten").is_some_and(|v| v == "true");
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let progress_tx = tx.clone();
    let sink: dsec_node_api::ImportProgressSink = Arc::new(move |ev| {
        let _ = progress_tx.send(ev);
    });
    let node = rpc.node.clone();
    let source = ImportSource::Archive(body_stream(body));
    tokio::spawn(async move {
        let end = match node.import_image(&name, source, flatten, Some(sink)).await {
            Ok(image) => ImportEvent::Done { image },
            Err(error) => ImportEvent::Error { error },
        };
        let _ = tx.send(end);
    });
    Ok(ndjson_response(tokio_stream_unbounded(rx)))
}

/// Pulls the image the JSON body names; answers with NDJSON progress ending in `done` or
/// `error`. The pull runs to its end even if the caller goes away.
async fn pull_image(
    State(rpc): State<Arc<Rpc>>,
    Json(req): Json<dsec_wire::v1::PullImageRequest>,
) -> RpcResult<Response> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let progress_tx = tx.clone();
    let sink: dsec_node_api::ImportProgressSink = Arc::new(move |ev| {
        let _ = progress_tx.send(ev);
    });
    let node = rpc.node.clone();
    tokio::spawn(async move {
        let end = match node.pull_image(&req, Some(sink)).await {
            Ok(image) => ImportEvent::Done { image },
            Err(error) => ImportEvent::Error { error },
        };
        let _ = tx.send(end);
    });
    Ok(ndjson_response(tokio_stream_unbounded(rx)))
}

fn tokio_stream_unbounded<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<T>,
) -> impl Stream<Item = T> + Send + 'static {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

async fn tag_image(
    State(rpc): State<Arc<Rpc>>,
    Json(t): Json<TagCall>,
) -> RpcResult<impl IntoResponse> {
    Ok(Json(
        rpc.node.tag_image(&t.source, &t.name, t.config).await?,
    ))
}

async fn gc_images(
    State(rpc): State<Arc<Rpc>>,
    Json(req): Json<GcRequest>,
) -> RpcResult<impl IntoResponse> {
    Ok(Json(rpc.node.gc_images(&req).await?))
}

async fn layer_stats(State(rpc): State<Arc<Rpc>>) -> RpcResult<impl IntoResponse> {
    Ok(Json(rpc.node.layer_stats().await?))
}

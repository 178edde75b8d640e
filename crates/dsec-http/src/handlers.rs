//! One handler per `/v1` route: extract, call [`SandboxApi`], respond. No logic lives here
//! beyond decoding query strings and encoding streams.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use bytes::Bytes;
use dsec_control::{ByteStream, SandboxApi};
use dsec_wire::v1::{
    CommitRequest, CreateSandboxRequest, CreateSessionRequest, ExecRequest, FileInfo,
    FnCallRequest, ImportImageRequest, MkdirRequest, NetworkPolicy, PoolSpec, PoolUpdate, PtySize,
    RenameRequest, SandboxState, SessionRunRequest, SetTimeoutRequest, SignalRequest,
    StartProcessRequest, StdinRequest,
};
use dsec_wire::{ApiError, ErrorCode};
use futures::StreamExt;
use serde::Deserialize;

use crate::error::HttpError;
use crate::extract::{Json, Path, Query};
use crate::HttpOptions;

/// Header of `GET /files` that carries the file's [`FileInfo`] as JSON (ASCII-only).
pub const FILE_INFO_HEADER: &str = "x-dsec-file-info";

/// Content type of exec/process event streams.
pub const NDJSON: &str = "application/x-ndjson";

type Api = crate::Scoped;
type HttpResult<T> = Result<T, HttpError>;

// ---------------------------------------------------------------- responses

fn json<T: serde::Serialize>(v: T) -> Response {
    axum::Json(v).into_response()
}

fn created<T: serde::Serialize>(v: T) -> Response {
    (StatusCode::CREATED, axum::Json(v)).into_response()
}

fn no_content(_: ()) -> Response {
    StatusCode::NO_CONTENT.into_response()
}

/// NDJSON, one event per line ([`dsec_wire::v1::ExecEvent`] or
/// [`dsec_wire::v1::ImportEvent`]); each event is its own body chunk, so hyper flushes it
/// as soon as it is produced.
fn ndjson<E: serde::Serialize + Send + 'static>(
    events: futures::stream::BoxStream<'static, E>,
) -> Response {
    let body = Body::from_stream(events.map(|ev| {
        let mut line = serde_json::to_vec(&ev).unwrap_or_else(|e| {
            // Unreachable for these plain types; keep the stream well-formed anyway.
            format!(r#"{{"type":"error","error":{{"code":"internal","message":"{e}"}}}}"#)
                .into_bytes()
        });
        line.push(b'\n');
        Ok::<_, Infallible>(Bytes::from(line))
    }));
    ([(header::CONTENT_TYPE, NDJSON)], body).into_response()
}

/// A streamed binary body; a mid-stream error aborts the response.
fn bytes_body(stream: ByteStream, content_type: &'static str) -> Response {
    (
        [(header::CONTENT_TYPE, content_type)],
        Body::from_stream(stream),
    )
        .into_response()
}

/// After an upload is answered early (e.g. `no_space`), how long and how much of the
/// unread rest of its body is still read and thrown away. Closing at once would make the
/// kernel reset the connection, and a client still sending would see the reset instead
/// of the answer; this "lingering close" gives it time to read the answer first. The
/// dsec clients stop sending once they have the answer, which ends the linger at once;
/// the limits are for clients that send everything before they read.
const LINGER_TIME: std::time::Duration = std::time::Duration::from_secs(5);
const LINGER_BYTES: usize = 1 << 30;

/// The request body as the trait's [`ByteStream`], not buffered and not size-limited.
/// A task feeds it, so that when the consumer stops early the task can linger (above).
/// A body that brings no data for `idle` ends with a `timeout` error.
fn body_stream(body: Body, idle: std::time::Duration) -> ByteStream {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, ApiError>>(4);
    tokio::spawn(async move {
        let mut data = body.into_data_stream();
        loop {
            let item = match tokio::time::timeout(idle, data.next()).await {
                Ok(Some(item)) => item,
                Ok(None) => return,
                Err(_) => {
                    let stalled = ApiError::new(
                        ErrorCode::Timeout,
                        format!("upload stalled: no data for {} s", idle.as_secs()),
                    );
                    let _ = tx.send(Err(stalled)).await;
                    return;
                }
            };
            let item = item.map_err(|e| {
                ApiError::new(ErrorCode::BadRequest, format!("reading request body: {e}"))
            });
            if tx.send(item).await.is_err() {
                let mut thrown = 0usize;
                let _ = tokio::time::timeout(LINGER_TIME, async {
                    while let Some(Ok(chunk)) = data.next().await {
                        thrown += chunk.len();
                        if thrown > LINGER_BYTES {
                            break;
                        }
                    }
                })
                .await;
                return;
            }
        }
    });
    futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    })
    .boxed()
}

/// JSON with every non-ASCII character escaped as `\uXXXX`, so it fits in a header value
/// that any client can read as a string.
fn ascii_json<T: serde::Serialize>(v: &T) -> Result<String, serde_json::Error> {
    let s = serde_json::to_string(v)?;
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut buf = [0u16; 2];
            for unit in c.encode_utf16(&mut buf) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------- query strings

/// `?path=` of the file routes.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PathQuery {
    /// Path inside the sandbox.
    pub path: String,
}

/// `GET /files?path=&offset=&length=`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadQuery {
    /// Path inside the sandbox.
    pub path: String,
    /// First byte to read.
    #[serde(default)]
    pub offset: u64,
    /// Bytes to read; to the end when absent.
    #[serde(default)]
    pub length: Option<u64>,
}

/// `PUT /files?path=&mode=`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WriteQuery {
    /// Path inside the sandbox.
    pub path: String,
    /// Permission bits; see [`parse_mode`].
    #[serde(default)]
    pub mode: Option<String>,
    /// Record the write under this id (or send the `Idempotency-Key` header).
    #[serde(default)]
    pub request_id: Option<String>,
}

/// `PUT /files/tar?path=&request_id=`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TarUploadQuery {
    /// Directory inside the sandbox.
    pub path: String,
    /// Record the upload under this id (or send the `Idempotency-Key` header).
    #[serde(default)]
    pub request_id: Option<String>,
}

/// `DELETE /files?path=&recursive=`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RemoveQuery {
    /// Path inside the sandbox.
    pub path: String,
    /// Remove directories with their contents.
    #[serde(default)]
    pub recursive: bool,
}

/// `GET /processes/{pid}/output?stdout_offset=&stderr_offset=&follow=`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct OutputQuery {
    /// Stdout offset to start from.
    #[serde(default)]
    pub stdout_offset: u64,
    /// Stderr offset to start from.
    #[serde(default)]
    pub stderr_offset: u64,
    /// Keep streaming until the process exits.
    #[serde(default)]
    pub follow: bool,
}

/// Parses a file mode: octal when written with a leading `0` or `0o` (`0644`, `0o755`),
/// decimal otherwise (`420`). Permission bits only (at most `0o777`, as for a create's
/// init files): setuid, setgid and sticky are refused.
pub fn parse_mode(s: &str) -> Result<u32, HttpError> {
    let parsed = if let Some(oct) = s.strip_prefix("0o").or_else(|| s.strip_prefix("0O")) {
        u32::from_str_radix(oct, 8)
    } else if s.len() > 1 && s.starts_with('0') {
        u32::from_str_radix(&s[1..], 8)
    } else {
        s.parse::<u32>()
    };
    match parsed {
        Ok(m) if m <= 0o777 => Ok(m),
        Ok(m) if m <= 0o7777 => Err(HttpError::bad_request(format!(
            "mode {m:#o} has bits beyond the permissions 0o777 (setuid, setgid, sticky): \
             give permission bits only"
        ))),
        _ => Err(HttpError::bad_request(format!(
            "invalid mode {s:?}: expected octal like 0644 or a decimal number up to 511"
        ))),
    }
}

/// Turns repeated `label=k=v` query pairs into a map; any other key, or a label without
/// `=`, is a `bad_request`.
pub fn parse_labels(pairs: Vec<(String, String)>) -> Result<BTreeMap<String, String>, HttpError> {
    let mut labels = BTreeMap::new();
    for (key, value) in pairs {
        if key != "label" {
            return Err(HttpError::bad_request(format!(
                "unknown query parameter {key:?}; only label=KEY=VALUE (and state=STATE on the sandbox list) is accepted"
            )));
        }
        let Some((k, v)) = value.split_once('=') else {
            return Err(HttpError::bad_request(format!(
                "label filter {value:?} must be KEY=VALUE"
            )));
        };
        labels.insert(k.to_owned(), v.to_owned());
    }
    Ok(labels)
}

// ---------------------------------------------------------------- fallbacks

/// Most of a refused request's body read before the answer (see [`drain`]).
const DRAIN_LIMIT: usize = 1 << 20;
/// Longest wait for that body.
const DRAIN_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Reads (and drops) a small body of a request answered without it, so the client has
/// sent it all when the answer comes: a server that answers and closes while the client
/// still writes makes the client fail on a broken pipe instead of reading the answer.
async fn drain(body: Body) {
    let _ = tokio::time::timeout(DRAIN_WAIT, axum::body::to_bytes(body, DRAIN_LIMIT)).await;
}

/// Unknown route.
pub async fn not_found(method: Method, uri: Uri, body: Body) -> HttpError {
    drain(body).await;
    HttpError::new(
        ErrorCode::NotFound,
        format!("no route for {method} {}", uri.path()),
    )
}

/// Known path, wrong method.
pub async fn method_not_allowed(method: Method, uri: Uri, body: Body) -> HttpError {
    drain(body).await;
    HttpError::new(
        ErrorCode::MethodNotAllowed,
        format!("method {method} is not supported on {}", uri.path()),
    )
}

// ---------------------------------------------------------------- health, sandboxes

/// `GET /v1/health` (no API key needed).
pub async fn health(State(api): State<Arc<dyn SandboxApi>>) -> HttpResult<Response> {
    Ok(json(api.health().await?))
}

/// `GET /v1/openapi.json` (no API key needed): the [`crate::openapi`] document.
pub async fn openapi() -> Response {
    static DOCUMENT: std::sync::OnceLock<bytes::Bytes> = std::sync::OnceLock::new();
    let body = DOCUMENT.get_or_init(|| {
        serde_json::to_vec_pretty(&crate::openapi::document())
            .map(bytes::Bytes::from)
            .unwrap_or_default()
    });
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        body.clone(),
    )
        .into_response()
}

/// `GET /v1/utilization`: the last hour of samples of what the fleet holds.
pub async fn utilization(api: Api) -> HttpResult<Response> {
    Ok(json(api.utilization().await?))
}

/// `GET /v1/whoami`: the caller's tenant, key id and scopes.
pub async fn whoami(api: Api) -> HttpResult<Response> {
    let p = api.caller();
    Ok(json(dsec_wire::v1::Whoami {
        tenant: p.tenant.clone(),
        key_id: p.key_id.clone(),
        scopes: p.scopes.iter().map(|s| s.as_str().to_string()).collect(),
        cluster_admin: p.is_cluster_admin(),
    }))
}

/// `POST /v1/sandboxes`.
pub async fn create_sandbox(
    api: Api,
    Json(req): Json<CreateSandboxRequest>,
) -> HttpResult<Response> {
    Ok(created(api.create_sandbox(req).await?))
}

/// `GET /v1/sandboxes?label=k=v...`.
pub async fn list_sandboxes(
    api: Api,
    Query(pairs): Query<Vec<(String, String)>>,
) -> HttpResult<Response> {
    // `state=S` (repeatable: any of them) beside the label filters.
    let (states, labels): (Vec<_>, Vec<_>) = pairs.into_iter().partition(|(k, _)| k == "state");
    let states = states
        .into_iter()
        .map(|(_, v)| {
            serde_json::from_value::<SandboxState>(serde_json::Value::String(v.clone())).map_err(
                |_| {
                    HttpError::bad_request(format!(
                        "unknown state {v:?}; one of creating, ready, paused, stopping, failed, unhealthy"
                    ))
                },
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut list = api.list_sandboxes(parse_labels(labels)?).await?;
    if !states.is_empty() {
        list.sandboxes.retain(|s| states.contains(&s.state));
    }
    Ok(json(list))
}

/// `GET /v1/sandboxes/{id}`.
pub async fn get_sandbox(api: Api, Path(id): Path<String>) -> HttpResult<Response> {
    Ok(json(api.get_sandbox(&id).await?))
}

/// `DELETE /v1/sandboxes/{id}`.
///
/// With an `Idempotency-Key` (a retried delete), a sandbox that is gone already answers
/// as the first delete did: the record of a delete goes with its sandbox.
pub async fn delete_sandbox(
    api: Api,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> HttpResult<Response> {
    match api.delete_sandbox(&id).await {
        Ok(()) => Ok(no_content(())),
        Err(e)
            if headers.contains_key(dsec_wire::v1::IDEMPOTENCY_KEY_HEADER)
                && matches!(e.code, ErrorCode::NotFound | ErrorCode::Expired) =>
        {
            Ok(no_content(()))
        }
        Err(e) => Err(e.into()),
    }
}

/// `POST /v1/sandboxes/{id}/timeout`.
pub async fn set_timeout(
    api: Api,
    Path(id): Path<String>,
    Json(req): Json<SetTimeoutRequest>,
) -> HttpResult<Response> {
    Ok(json(api.set_timeout(&id, req).await?))
}

/// `PUT /v1/sandboxes/{id}/network`.
pub async fn set_network(
    api: Api,
    Path(id): Path<String>,
    Json(policy): Json<NetworkPolicy>,
) -> HttpResult<Response> {
    Ok(json(api.set_network(&id, policy).await?))
}

/// `GET /v1/sandboxes/{id}/screen`: a full VM's screen, as PNG.
pub async fn screenshot(api: Api, Path(id): Path<String>) -> HttpResult<Response> {
    let png = api.screenshot(&id).await?;
    Ok((
        [(header::CONTENT_TYPE, HeaderValue::from_static("image/png"))],
        png,
    )
        .into_response())
}

/// `POST /v1/sandboxes/{id}/input`: keyboard and pointer input to a full VM.
pub async fn send_input(
    api: Api,
    Path(id): Path<String>,
    Json(req): Json<dsec_wire::v1::InputRequest>,
) -> HttpResult<Response> {
    api.send_input(&id, req).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `POST /v1/sandboxes/{id}/pause`.
pub async fn pause_sandbox(api: Api, Path(id): Path<String>) -> HttpResult<Response> {
    Ok(json(api.pause_sandbox(&id).await?))
}

/// `POST /v1/sandboxes/{id}/resume`.
pub async fn resume_sandbox(api: Api, Path(id): Path<String>) -> HttpResult<Response> {
    Ok(json(api.resume_sandbox(&id).await?))
}

/// `POST /v1/sandboxes/{id}/commit`.
pub async fn commit_sandbox(
    api: Api,
    Path(id): Path<String>,
    Json(req): Json<CommitRequest>,
) -> HttpResult<Response> {
    Ok(created(api.commit_sandbox(&id, req).await?))
}

/// `POST /v1/pools`.
pub async fn create_pool(api: Api, Json(spec): Json<PoolSpec>) -> HttpResult<Response> {
    Ok(created(api.create_pool(spec).await?))
}

/// `GET /v1/pools`.
pub async fn list_pools(api: Api) -> HttpResult<Response> {
    Ok(json(api.list_pools().await?))
}

/// `GET /v1/pools/{name}`.
pub async fn get_pool(api: Api, Path(name): Path<String>) -> HttpResult<Response> {
    Ok(json(api.get_pool(&name).await?))
}

/// `PATCH /v1/pools/{name}`.
pub async fn update_pool(
    api: Api,
    Path(name): Path<String>,
    Json(update): Json<PoolUpdate>,
) -> HttpResult<Response> {
    Ok(json(api.update_pool(&name, update).await?))
}

/// `DELETE /v1/pools/{name}`.
pub async fn delete_pool(api: Api, Path(name): Path<String>) -> HttpResult<Response> {
    Ok(no_content(api.delete_pool(&name).await?))
}

/// `GET /v1/events?after=&sandbox=&tenant=&kind=&label=&no_follow=`: Server-Sent
/// Events, each with its id (`Last-Event-ID` on a reconnect replays from there) and its
/// kind as the SSE event name; a comment every 15 s keeps idle connections open. An
/// error after the stream began is a last event named `error` holding the error.
pub async fn events(
    api: Api,
    headers: HeaderMap,
    Query(mut q): Query<dsec_wire::v1::EventQuery>,
) -> HttpResult<Response> {
    use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
    if q.after.is_none() {
        if let Some(last) = headers.get("last-event-id") {
            let last = last
                .to_str()
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok());
            q.after = Some(last.ok_or_else(|| {
                ApiError::new(
                    ErrorCode::BadRequest,
                    "Last-Event-ID must be an event id (a number)",
                )
            })?);
        }
    }
    let feed = api.events(q).await?;
    let sse = feed.map(|item| {
        Ok::<_, std::convert::Infallible>(match item {
            Ok(event) => SseEvent::default()
                .id(event.id.to_string())
                .event(event.kind.as_str())
                .json_data(&event)
                .unwrap_or_else(|_| SseEvent::default().comment("unencodable event")),
            Err(error) => SseEvent::default()
                .event("error")
                .json_data(&error)
                .unwrap_or_else(|_| SseEvent::default().comment("stream failed")),
        })
    });
    Ok(Sse::new(sse)
        .keep_alive(KeepAlive::new().interval(std::time::Duration::from_secs(15)))
        .into_response())
}

/// `GET /v1/queue`.
pub async fn queue_status(api: Api) -> HttpResult<Response> {
    Ok(json(api.queue_status().await?))
}

/// `POST /v1/fncall`.
pub async fn fncall(api: Api, Json(req): Json<FnCallRequest>) -> HttpResult<Response> {
    Ok(json(api.fncall(req).await?))
}

/// `PUT /v1/inputs/{key}`: the body (streamed) is the input's bytes.
pub async fn put_input(
    api: Api,
    Extension(opts): Extension<HttpOptions>,
    Path(key): Path<String>,
    body: Body,
) -> HttpResult<Response> {
    let body = body_stream(body, opts.upload_idle_timeout);
    Ok(created(api.put_input(&key, body).await?))
}

/// `POST /v1/batches`.
pub async fn submit_batch(
    api: Api,
    Json(spec): Json<dsec_wire::v1::BatchSpec>,
) -> HttpResult<Response> {
    Ok(created(api.submit_batch(spec).await?))
}

/// `GET /v1/batches`.
pub async fn list_batches(api: Api) -> HttpResult<Response> {
    Ok(json(api.list_batches().await?))
}

/// `GET /v1/batches/{id}`.
pub async fn get_batch(api: Api, Path(id): Path<String>) -> HttpResult<Response> {
    Ok(json(api.get_batch(&id).await?))
}

/// `?purge=` of a batch delete.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct PurgeQuery {
    /// Forget the (ended) batch and its data instead of cancelling it.
    #[serde(default)]
    purge: bool,
}

/// `DELETE /v1/batches/{id}`: cancels it; with `?purge=true`, forgets an ended one.
pub async fn cancel_batch(
    api: Api,
    Path(id): Path<String>,
    Query(q): Query<PurgeQuery>,
) -> HttpResult<Response> {
    if q.purge {
        return Ok(no_content(api.purge_batch(&id).await?));
    }
    Ok(json(api.cancel_batch(&id).await?))
}

/// `GET /v1/batches/{id}/tasks?state=&after=&limit=`.
pub async fn batch_tasks(
    api: Api,
    Path(id): Path<String>,
    Query(q): Query<dsec_wire::v1::TaskListQuery>,
) -> HttpResult<Response> {
    Ok(json(api.batch_tasks(&id, q).await?))
}

/// `GET /v1/batches/{id}/manifest`.
pub async fn batch_manifest(api: Api, Path(id): Path<String>) -> HttpResult<Response> {
    Ok(json(api.batch_manifest(&id).await?))
}

/// `?path=` of a batch output.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct BatchOutputQuery {
    /// The output's path in the sandbox; absent: the error snapshot.
    #[serde(default)]
    path: Option<String>,
}

/// `GET /v1/batches/{id}/tasks/{task}/output?path=`.
pub async fn batch_output(
    api: Api,
    Path((id, task)): Path<(String, String)>,
    Query(q): Query<BatchOutputQuery>,
) -> HttpResult<Response> {
    let (size, stream) = api.batch_output(&id, &task, q.path.as_deref()).await?;
    let kind = if q.path.is_some() {
        "application/octet-stream"
    } else {
        "application/json"
    };
    let headers = [
        (header::CONTENT_TYPE, HeaderValue::from_static(kind)),
        (header::CONTENT_LENGTH, HeaderValue::from(size)),
    ];
    Ok((headers, Body::from_stream(stream)).into_response())
}

/// `POST /v1/jobs/{job}/suspend`.
pub async fn suspend_job(api: Api, Path(job): Path<String>) -> HttpResult<Response> {
    Ok(json(api.suspend_job(&job).await?))
}

/// `POST /v1/jobs/{job}/resume`.
pub async fn resume_job(api: Api, Path(job): Path<String>) -> HttpResult<Response> {
    Ok(json(api.resume_job(&job).await?))
}

/// `GET /v1/nodes`.
pub async fn list_nodes(api: Api) -> HttpResult<Response> {
    Ok(json(api.list_nodes().await?))
}

/// `POST /v1/nodes/{name}/drain`.
pub async fn drain_node(api: Api, Path(name): Path<String>) -> HttpResult<Response> {
    Ok(json(api.drain_node(&name, true).await?))
}

/// `POST /v1/nodes/{name}/undrain`.
pub async fn undrain_node(api: Api, Path(name): Path<String>) -> HttpResult<Response> {
    Ok(json(api.drain_node(&name, false).await?))
}

// ---------------------------------------------------------------- exec, sessions

/// A call's request id: the body's `request_id` or the `Idempotency-Key` header (both,
/// and different, is `bad_request`).
fn request_id(headers: &HeaderMap, body: &mut Option<String>) -> Result<(), HttpError> {
    let Some(value) = headers.get(dsec_wire::v1::IDEMPOTENCY_KEY_HEADER) else {
        return Ok(());
    };
    let bad = |msg: String| HttpError(ApiError::new(ErrorCode::BadRequest, msg));
    let key = value
        .to_str()
        .map_err(|_| bad("Idempotency-Key must be visible ASCII".into()))?;
    match body {
        Some(rid) if rid != key => Err(bad(format!(
            "request_id {rid:?} and Idempotency-Key {key:?} differ: give one, or the same"
        ))),
        _ => {
            *body = Some(key.to_string());
            Ok(())
        }
    }
}

/// `POST /v1/sandboxes/{id}/exec`.
pub async fn exec(
    api: Api,
    Path(id): Path<String>,
    headers: HeaderMap,
    Json(mut req): Json<ExecRequest>,
) -> HttpResult<Response> {
    request_id(&headers, &mut req.request_id)?;
    let result = api.exec(&id, req).await?;
    Ok((
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        crate::json::exec_result(&result),
    )
        .into_response())
}

/// `POST /v1/sandboxes/{id}/exec/stream` (NDJSON).
pub async fn exec_stream(
    api: Api,
    Path(id): Path<String>,
    headers: HeaderMap,
    Json(mut req): Json<ExecRequest>,
) -> HttpResult<Response> {
    request_id(&headers, &mut req.request_id)?;
    Ok(ndjson(api.exec_stream(&id, req).await?))
}

/// `POST /v1/sandboxes/{id}/fork`.
pub async fn fork_sandbox(
    api: Api,
    Path(id): Path<String>,
    Json(req): Json<dsec_wire::v1::ForkRequest>,
) -> HttpResult<Response> {
    Ok(created(api.fork_sandbox(&id, req).await?))
}

/// `GET /v1/sandboxes/{id}/log?after=&limit=&output=&request_id=`.
pub async fn call_log(
    api: Api,
    Path(id): Path<String>,
    Query(q): Query<dsec_wire::v1::CallLogQuery>,
) -> HttpResult<Response> {
    Ok(json(api.call_log(&id, q).await?))
}

/// `POST /v1/sandboxes/{id}/sessions`.
pub async fn create_session(
    api: Api,
    Path(id): Path<String>,
    Json(req): Json<CreateSessionRequest>,
) -> HttpResult<Response> {
    Ok(created(api.create_session(&id, req).await?))
}

/// `GET /v1/sandboxes/{id}/sessions`.
pub async fn list_sessions(api: Api, Path(id): Path<String>) -> HttpResult<Response> {
    Ok(json(api.list_sessions(&id).await?))
}

/// `POST /v1/sandboxes/{id}/sessions/{session}/run`.
pub async fn run_in_session(
    api: Api,
    Path((id, session)): Path<(String, String)>,
    headers: HeaderMap,
    Json(mut req): Json<SessionRunRequest>,
) -> HttpResult<Response> {
    request_id(&headers, &mut req.request_id)?;
    Ok(json(api.run_in_session(&id, &session, req).await?))
}

/// `POST /v1/sandboxes/{id}/sessions/{session}/interrupt`.
pub async fn interrupt_session(
    api: Api,
    Path((id, session)): Path<(String, String)>,
) -> HttpResult<Response> {
    Ok(no_content(api.interrupt_session(&id, &session).await?))
}

/// `DELETE /v1/sandboxes/{id}/sessions/{session}`.
pub async fn close_session(
    api: Api,
    Path((id, session)): Path<(String, String)>,
) -> HttpResult<Response> {
    Ok(no_content(api.close_session(&id, &session).await?))
}

// ---------------------------------------------------------------- processes

/// `POST /v1/sandboxes/{id}/processes`.
pub async fn start_process(
    api: Api,
    Path(id): Path<String>,
    headers: HeaderMap,
    Json(mut req): Json<StartProcessRequest>,
) -> HttpResult<Response> {
    request_id(&headers, &mut req.request_id)?;
    Ok(created(api.start_process(&id, req).await?))
}

/// `GET /v1/sandboxes/{id}/processes`.
pub async fn list_processes(api: Api, Path(id): Path<String>) -> HttpResult<Response> {
    Ok(json(api.list_processes(&id).await?))
}

/// `GET /v1/sandboxes/{id}/processes/{pid}/output` (NDJSON).
pub async fn process_output(
    api: Api,
    Path((id, pid)): Path<(String, u32)>,
    Query(q): Query<OutputQuery>,
) -> HttpResult<Response> {
    let events = api.process_output(&id, pid, q.stdout_offset, q.stderr_offset, q.follow);
    Ok(ndjson(events.await?))
}

/// `POST /v1/sandboxes/{id}/processes/{pid}/stdin`.
pub async fn process_stdin(
    api: Api,
    Path((id, pid)): Path<(String, u32)>,
    Json(req): Json<StdinRequest>,
) -> HttpResult<Response> {
    Ok(no_content(api.process_stdin(&id, pid, req).await?))
}

/// `POST /v1/sandboxes/{id}/processes/{pid}/signal`.
pub async fn signal_process(
    api: Api,
    Path((id, pid)): Path<(String, u32)>,
    Json(req): Json<SignalRequest>,
) -> HttpResult<Response> {
    Ok(no_content(api.signal_process(&id, pid, req).await?))
}

/// `POST /v1/sandboxes/{id}/processes/{pid}/resize`.
pub async fn resize_process(
    api: Api,
    Path((id, pid)): Path<(String, u32)>,
    Json(size): Json<PtySize>,
) -> HttpResult<Response> {
    Ok(no_content(api.resize_process(&id, pid, size).await?))
}

// ---------------------------------------------------------------- files

/// `GET /v1/sandboxes/{id}/files?path=&offset=&length=`: the bytes, with the
/// [`FileInfo`] in the `x-dsec-file-info` header.
pub async fn read_file(
    api: Api,
    Path(id): Path<String>,
    Query(q): Query<ReadQuery>,
) -> HttpResult<Response> {
    let (info, stream): (FileInfo, _) = api.read_file(&id, &q.path, q.offset, q.length).await?;
    let info_json = ascii_json(&info)
        .map_err(|e| HttpError::new(ErrorCode::Internal, format!("encoding file info: {e}")))?;
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    if let Ok(v) = HeaderValue::from_str(&info_json) {
        headers.insert(HeaderName::from_static(FILE_INFO_HEADER), v);
    }
    if q.offset == 0 && q.length.is_none() {
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(info.size));
    }
    Ok((headers, Body::from_stream(stream)).into_response())
}

/// `PUT /v1/sandboxes/{id}/files?path=&mode=&request_id=`: the body (streamed) is the
/// file's bytes.
pub async fn write_file(
    api: Api,
    Extension(opts): Extension<HttpOptions>,
    Path(id): Path<String>,
    headers: HeaderMap,
    Query(mut q): Query<WriteQuery>,
    body: Body,
) -> HttpResult<Response> {
    let mode = q.mode.as_deref().map(parse_mode).transpose()?;
    request_id(&headers, &mut q.request_id)?;
    let body = body_stream(body, opts.upload_idle_timeout);
    let written = api
        .write_file(&id, &q.path, mode, body, q.request_id.as_deref())
        .await?;
    Ok(json(written))
}

/// `DELETE /v1/sandboxes/{id}/files?path=&recursive=`.
pub async fn remove_file(
    api: Api,
    Path(id): Path<String>,
    Query(q): Query<RemoveQuery>,
) -> HttpResult<Response> {
    Ok(no_content(
        api.remove_file(&id, &q.path, q.recursive).await?,
    ))
}

/// `GET /v1/sandboxes/{id}/files/list?path=`.
pub async fn list_files(
    api: Api,
    Path(id): Path<String>,
    Query(q): Query<PathQuery>,
) -> HttpResult<Response> {
    Ok(json(api.list_files(&id, &q.path).await?))
}

/// `GET /v1/sandboxes/{id}/files/stat?path=`.
pub async fn stat_file(
    api: Api,
    Path(id): Path<String>,
    Query(q): Query<PathQuery>,
) -> HttpResult<Response> {
    Ok(json(api.stat_file(&id, &q.path).await?))
}

/// `POST /v1/sandboxes/{id}/files/mkdir`.
pub async fn mkdir(
    api: Api,
    Path(id): Path<String>,
    Json(req): Json<MkdirRequest>,
) -> HttpResult<Response> {
    Ok(no_content(api.mkdir(&id, req).await?))
}

/// `POST /v1/sandboxes/{id}/files/rename`.
pub async fn rename_file(
    api: Api,
    Path(id): Path<String>,
    Json(req): Json<RenameRequest>,
) -> HttpResult<Response> {
    Ok(no_content(api.rename_file(&id, req).await?))
}

/// `GET /v1/sandboxes/{id}/files/tar?path=`: a streamed tar of the directory.
pub async fn download_tar(
    api: Api,
    Path(id): Path<String>,
    Query(q): Query<PathQuery>,
) -> HttpResult<Response> {
    Ok(bytes_body(
        api.download_tar(&id, &q.path).await?,
        "application/x-tar",
    ))
}

/// `PUT /v1/sandboxes/{id}/files/tar?path=&request_id=`: the (streamed) tar body is
/// extracted there.
pub async fn upload_tar(
    api: Api,
    Extension(opts): Extension<HttpOptions>,
    Path(id): Path<String>,
    headers: HeaderMap,
    Query(mut q): Query<TarUploadQuery>,
    body: Body,
) -> HttpResult<Response> {
    request_id(&headers, &mut q.request_id)?;
    let body = body_stream(body, opts.upload_idle_timeout);
    let written = api
        .upload_tar(&id, &q.path, body, q.request_id.as_deref())
        .await?;
    Ok(json(written))
}

// ---------------------------------------------------------------- images

/// `GET /v1/images`.
pub async fn list_images(api: Api) -> HttpResult<Response> {
    Ok(json(api.list_images().await?))
}

/// `POST /v1/images`.
pub async fn import_image(api: Api, Json(req): Json<ImportImageRequest>) -> HttpResult<Response> {
    Ok(created(api.import_image(req).await?))
}

/// Query of `POST /v1/images/upload`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UploadImageQuery {
    /// Name to give the image.
    pub name: String,
    /// Store a multi-layer (docker/OCI) image as one layer.
    #[serde(default)]
    pub flatten: bool,
}

/// `POST /v1/images/upload?name=`: imports the archive in the body (a rootfs tar,
/// compressed or not, a `docker save` or OCI archive, or an EROFS image).
pub async fn upload_image(
    api: Api,
    Extension(opts): Extension<HttpOptions>,
    Query(q): Query<UploadImageQuery>,
    body: Body,
) -> HttpResult<Response> {
    let body = body_stream(body, opts.upload_idle_timeout);
    Ok(created(api.upload_image(&q.name, q.flatten, body).await?))
}

/// `POST /v1/images/import/stream` (NDJSON progress, then `done` or `error`).
pub async fn import_image_stream(
    api: Api,
    Json(req): Json<ImportImageRequest>,
) -> HttpResult<Response> {
    Ok(ndjson(api.import_image_stream(req).await?))
}

/// `POST /v1/images/pull` (NDJSON progress, then `done` or `error`).
pub async fn pull_image(
    api: Api,
    Json(req): Json<dsec_wire::v1::PullImageRequest>,
) -> HttpResult<Response> {
    Ok(ndjson(api.pull_image_stream(req).await?))
}

/// `GET /v1/images/layers`.
pub async fn layer_stats(api: Api) -> HttpResult<Response> {
    Ok(json(api.layer_stats().await?))
}

/// `GET /metrics`: Prometheus text (see [`crate::metrics`]). A cluster's API server adds
/// a series per node for a key that may list nodes (a cluster admin's); a single node
/// (its capacity in the health already) asks its node nothing more.
pub async fn metrics(api: Api) -> HttpResult<Response> {
    let (health, layers) = (api.health().await?, api.layer_stats().await?);
    let nodes = match health.capacity {
        Some(_) => None,
        None => api.list_nodes().await.ok(),
    };
    let mut text = crate::metrics::render(&health, &layers, nodes.as_ref());
    // The key's tenant's pools (an API without pools has none to show).
    if let Ok(pools) = api.list_pools().await {
        crate::metrics::render_pools(&mut text, &pools);
    }
    if let Ok(stats) = api.create_phase_stats().await {
        crate::metrics::render_create_phases(&mut text, &stats);
    }
    Ok((
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response())
}

/// `POST /v1/images/gc`.
pub async fn gc_images(
    api: Api,
    Json(req): Json<dsec_wire::v1::GcRequest>,
) -> HttpResult<Response> {
    Ok(json(api.gc_images(req).await?))
}

/// `POST /v1/images/build`.
pub async fn build_image(
    api: Api,
    Json(req): Json<dsec_wire::v1::BuildRequest>,
) -> HttpResult<Response> {
    Ok(created(api.build_image(req).await?))
}

/// Largest build context `POST /v1/images/build/dockerfile` takes, in bytes.
pub const MAX_BUILD_CONTEXT: u64 = 8 << 30;

/// `POST /v1/images/build/dockerfile?name=&dockerfile=&target=&build_arg=K=V...`: the
/// body (the build context, a tar) is spooled to an unnamed temp file first, then the
/// build streams NDJSON [`dsec_wire::v1::BuildEvent`]s (`done` or `error` last).
pub async fn build_dockerfile(
    api: Api,
    Extension(opts): Extension<HttpOptions>,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> HttpResult<Response> {
    use tokio::io::AsyncWriteExt;
    let too_large = || {
        ApiError::new(
            ErrorCode::PayloadTooLarge,
            format!(
                "the build context is larger than {} GiB: leave out what the build does not \
                 need (.dockerignore)",
                MAX_BUILD_CONTEXT >> 30
            ),
        )
    };
    // A body that says it is over the cap is refused before a byte of it is spooled.
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BUILD_CONTEXT) {
        return Err(too_large().into());
    }
    let pairs: Vec<(String, String)> =
        url::form_urlencoded::parse(uri.query().unwrap_or("").as_bytes())
            .into_owned()
            .collect();
    let req = dsec_wire::v1::DockerfileBuildRequest::from_query(pairs)
        .map_err(|e| ApiError::new(ErrorCode::BadRequest, e))?;
    let spool_err = |e: std::io::Error| {
        ApiError::new(
            ErrorCode::NoSpace,
            format!("spooling the build context: {e}"),
        )
    };
    let file = tempfile::tempfile().map_err(spool_err)?;
    let mut out = tokio::fs::File::from_std(file);
    let mut stream = body_stream(body, opts.upload_idle_timeout);
    let mut size = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        size += chunk.len() as u64;
        if size > MAX_BUILD_CONTEXT {
            return Err(too_large().into());
        }
        out.write_all(&chunk).await.map_err(spool_err)?;
    }
    out.flush().await.map_err(spool_err)?;
    let file = out.into_std().await;
    Ok(ndjson(api.build_dockerfile(req, file).await?))
}

/// `GET /v1/images/{name}`.
pub async fn get_image(api: Api, Path(name): Path<String>) -> HttpResult<Response> {
    Ok(json(api.get_image(&name).await?))
}

/// `DELETE /v1/images/{name}`.
pub async fn delete_image(api: Api, Path(name): Path<String>) -> HttpResult<Response> {
    Ok(no_content(api.delete_image(&name).await?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes() {
        assert_eq!(parse_mode("0644").ok(), Some(0o644));
        assert_eq!(parse_mode("0o755").ok(), Some(0o755));
        assert_eq!(parse_mode("420").ok(), Some(0o644));
        assert_eq!(parse_mode("0").ok(), Some(0));
        assert!(parse_mode("0999").is_err());
        assert!(parse_mode("04755").is_err(), "setuid");
        assert!(parse_mode("0o1777").is_err(), "sticky");
        assert_eq!(parse_mode("0777").ok(), Some(0o777));
        assert!(parse_mode("99999").is_err());
        assert!(parse_mode("rw").is_err());
    }

    #[test]
    fn ascii_json_escapes_non_ascii() {
        let s = ascii_json(&"héllo 🦀").expect("serializes");
        assert!(s.is_ascii());
        let back: String = serde_json::from_str(&s).expect("parses");
        assert_eq!(back, "héllo 🦀");
    }
}

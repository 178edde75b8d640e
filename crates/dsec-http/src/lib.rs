//! HTTP transport of dsec: an axum [`Router`] that serves the `/v1` API by calling a
//! [`SandboxApi`].
//!
//! Like Firecracker's API server, HTTP never reaches the core: each handler extracts its
//! inputs, calls one trait method and turns the result into a response. Everything
//! HTTP-specific lives here and nowhere else:
//!
//! - **Auth**: every route except `GET /v1/health` passes the key from `x-api-key` (or
//!   `Authorization: Bearer KEY`) to [`SandboxApi::authenticate`], checks the scope the
//!   route needs ([`dsec_iam::required_scope`]) and makes the handler's calls as the
//!   principal (its tenant) through a [`Scoped`] handle.
//! - **Errors**: one `IntoResponse` ([`error::HttpError`]) maps an [`ApiError`] to the status
//!   of its code and the body `{"error":{"code":"...","message":"..."}}`. Malformed JSON,
//!   query strings and path parameters are `bad_request` in the same shape; unknown routes
//!   are `not_found`.
//! - **Bodies**: JSON bodies up to 64 MiB; file and tar uploads are streamed to the API
//!   without a size limit; downloads are streamed back.
//! - **Streams**: exec and process output are NDJSON (`application/x-ndjson`), one
//!   [`dsec_wire::v1::ExecEvent`] per line, each flushed as it happens.
//! - **Safety net**: a panic in a handler becomes a 500 `internal` error instead of taking
//!   the server down; every request is traced with `tracing`.
//!
//! [`ApiError`]: dsec_wire::ApiError

pub mod admin;
pub mod audit;
pub mod e2b;
pub mod error;
pub mod extract;
pub mod gateway;
pub mod handlers;
pub mod json;
pub mod metrics;
pub mod openapi;
mod sandboxfusion;
pub mod scoped;
mod swerex;
pub mod terminal;
mod ui;

use std::any::Any;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::Router;
use dsec_control::SandboxApi;
use dsec_wire::ErrorCode;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::trace::TraceLayer;

pub use error::HttpError;
pub use handlers::{FILE_INFO_HEADER, NDJSON};
pub use scoped::Scoped;

/// Largest accepted JSON request body (64 MiB; inline files in a create request count).
pub const JSON_BODY_LIMIT: usize = 64 * 1024 * 1024;

/// Transport settings of the API server.
#[derive(Debug, Clone)]
pub struct HttpOptions {
    /// An upload body that brings no data for this long is aborted (`timeout`).
    pub upload_idle_timeout: Duration,
    /// A connection silent for this long is probed (TCP keepalive); one whose peer does
    /// not answer, or leaves sent data unacknowledged, for about twice this long is
    /// closed, and what its requests started (a streamed command) is stopped.
    pub tcp_keepalive: Duration,
    /// Where state-changing calls are recorded ([`audit`]); `None`: nowhere.
    pub audit: Option<Arc<audit::AuditLog>>,
}

impl Default for HttpOptions {
    fn default() -> Self {
        Self {
            upload_idle_timeout: Duration::from_secs(60),
            tcp_keepalive: Duration::from_secs(60),
            audit: None,
        }
    }
}

/// Probes sent after `idle` of silence before a peer counts as gone.
const KEEPALIVE_PROBES: u32 = 4;

/// Turns on keepalive probes and the matching user timeout for an accepted connection.
fn watch_peer(tcp: &tokio::net::TcpStream, idle: Duration) -> std::io::Result<()> {
    let interval = (idle / KEEPALIVE_PROBES).max(Duration::from_secs(1));
    let sock = socket2::SockRef::from(tcp);
    sock.set_tcp_keepalive(
        &socket2::TcpKeepalive::new()
            .with_time(idle)
            .with_interval(interval)
            .with_retries(KEEPALIVE_PROBES),
    )?;
    // Keepalive only runs while nothing is in flight; this covers a stream being written
    // to a peer that no longer acknowledges.
    sock.set_tcp_user_timeout(Some(idle + interval * KEEPALIVE_PROBES))
}

/// Builds the router for the whole `/v1` API on top of `api`, with default options.
pub fn router(api: Arc<dyn SandboxApi>) -> Router {
    router_with(api, HttpOptions::default())
}

/// Builds the router for the whole `/v1` API on top of `api`.
pub fn router_with(api: Arc<dyn SandboxApi>, opts: HttpOptions) -> Router {
    use handlers as h;

    // Streamed uploads are not size-limited here; the API enforces disk quotas.
    let unlimited = || DefaultBodyLimit::disable();

    let authed = Router::new()
        .route("/whoami", get(h::whoami))
        .route("/utilization", get(h::utilization))
        .route("/sandboxes", post(h::create_sandbox).get(h::list_sandboxes))
        .route(
            "/sandboxes/{id}",
            get(h::get_sandbox).delete(h::delete_sandbox),
        )
        .route("/sandboxes/{id}/timeout", post(h::set_timeout))
        .route("/sandboxes/{id}/network", put(h::set_network))
        .route("/sandboxes/{id}/screen", get(h::screenshot))
        .route("/sandboxes/{id}/input", post(h::send_input))
        .route("/sandboxes/{id}/pause", post(h::pause_sandbox))
        .route("/sandboxes/{id}/resume", post(h::resume_sandbox))
        .route("/sandboxes/{id}/commit", post(h::commit_sandbox))
        .route("/pools", post(h::create_pool).get(h::list_pools))
        .route(
            "/pools/{name}",
            get(h::get_pool)
                .patch(h::update_pool)
                .delete(h::delete_pool),
        )
        .route("/fncall", post(h::fncall))
        .route("/queue", get(h::queue_status))
        .route("/events", get(h::events))
        .route("/audit", get(audit::audit_query))
        .route("/inputs/{*key}", put(h::put_input).layer(unlimited()))
        .route("/batches", post(h::submit_batch).get(h::list_batches))
        .route("/batches/{id}", get(h::get_batch).delete(h::cancel_batch))
        .route("/batches/{id}/tasks", get(h::batch_tasks))
        .route("/batches/{id}/manifest", get(h::batch_manifest))
        .route("/batches/{id}/tasks/{task}/output", get(h::batch_output))
        .route("/jobs/{job}/suspend", post(h::suspend_job))
        .route("/jobs/{job}/resume", post(h::resume_job))
        .route("/nodes", get(h::list_nodes))
        .route("/nodes/{name}/drain", post(h::drain_node))
        .route("/nodes/{name}/undrain", post(h::undrain_node))
        .route("/sandboxes/{id}/terminal", get(terminal::terminal))
        .route("/sandboxes/{id}/exec", post(h::exec))
        .route("/sandboxes/{id}/exec/stream", post(h::exec_stream))
        .route("/sandboxes/{id}/log", get(h::call_log))
        .route("/sandboxes/{id}/fork", post(h::fork_sandbox))
        .route(
            "/sandboxes/{id}/sessions",
            post(h::create_session).get(h::list_sessions),
        )
        .route(
            "/sandboxes/{id}/sessions/{session}",
            axum::routing::delete(h::close_session),
        )
        .route(
            "/sandboxes/{id}/sessions/{session}/run",
            post(h::run_in_session),
        )
        .route(
            "/sandboxes/{id}/sessions/{session}/interrupt",
            post(h::interrupt_session),
        )
        .route(
            "/sandboxes/{id}/processes",
            post(h::start_process).get(h::list_processes),
        )
        .route(
            "/sandboxes/{id}/processes/{pid}/output",
            get(h::process_output),
        )
        .route(
            "/sandboxes/{id}/processes/{pid}/stdin",
            post(h::process_stdin),
        )
        .route(
            "/sandboxes/{id}/processes/{pid}/signal",
            post(h::signal_process),
        )
        .route(
            "/sandboxes/{id}/processes/{pid}/resize",
            post(h::resize_process),
        )
        .route(
            "/sandboxes/{id}/files",
            get(h::read_file)
                .put(h::write_file)
                .delete(h::remove_file)
                .layer(unlimited()),
        )
        .route("/sandboxes/{id}/files/list", get(h::list_files))
        .route("/sandboxes/{id}/files/stat", get(h::stat_file))
        .route("/sandboxes/{id}/files/mkdir", post(h::mkdir))
        .route("/sandboxes/{id}/files/rename", post(h::rename_file))
        .route(
            "/sandboxes/{id}/files/tar",
            get(h::download_tar).put(h::upload_tar).layer(unlimited()),
        )
        .route("/images", get(h::list_images).post(h::import_image))
        .route("/images/build", post(h::build_image))
        .route("/images/build/dockerfile", post(h::build_dockerfile))
        .route("/images/import/stream", post(h::import_image_stream))
        .route("/images/pull", post(h::pull_image))
        .route("/images/upload", post(h::upload_image).layer(unlimited()))
        .route("/images/gc", post(h::gc_images))
        .route("/images/layers", get(h::layer_stats))
        .route("/images/{name}", get(h::get_image).delete(h::delete_image))
        .route_layer(middleware::from_fn_with_state(
            api.clone(),
            extract::require_api_key,
        ));

    let v1 = Router::new()
        .route("/health", get(h::health))
        .route("/openapi.json", get(h::openapi))
        .merge(authed);
    // SWE-ReX sends its token as X-API-Key, the header dsec reads too.
    let swerex = swerex::routes().route_layer(middleware::from_fn_with_state(
        api.clone(),
        extract::require_api_key,
    ));

    let sandboxfusion = sandboxfusion::routes()
        .route_layer(middleware::from_fn_with_state(
            api.clone(),
            extract::require_api_key,
        ))
        .merge(sandboxfusion::public_routes());

    let metrics = Router::new()
        .route("/metrics", get(h::metrics))
        .route_layer(middleware::from_fn_with_state(
            api.clone(),
            extract::require_api_key,
        ));

    Router::new()
        .nest("/v1", v1)
        .merge(metrics)
        .merge(swerex)
        .merge(sandboxfusion)
        .merge(e2b::routes(api.clone()))
        .merge(ui::routes())
        .fallback(h::not_found)
        .method_not_allowed_fallback(h::method_not_allowed)
        .layer(DefaultBodyLimit::max(JSON_BODY_LIMIT))
        .layer(middleware::from_fn(json_errors))
        .layer(axum::Extension(opts))
        .layer(
            TraceLayer::new_for_http().make_span_with(
                |_: &axum::http::Request<axum::body::Body>| tracing::Span::current(),
            ),
        )
        .layer(middleware::from_fn(request_ids))
        .layer(CatchPanicLayer::custom(panic_response))
        .with_state(api)
}

/// Gives every request an id: the caller's `x-request-id` when it is plain enough to
/// log, else a fresh one. The task serving it carries it (log spans, error answers, a
/// remote node's call) and the answer's `x-request-id` header returns it.
///
/// It also opens the request's span (`request`: method, path, id), a child of the
/// caller's `traceparent` when spans are exported, and carries the trace context on
/// (to a remote node, and into the commands the request runs).
async fn request_ids(req: axum::extract::Request, next: middleware::Next) -> Response {
    use dsec_node_api::request_id;
    use tracing::Instrument;
    let id: Arc<str> = req
        .headers()
        .get(request_id::HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|v| request_id::acceptable(v))
        .map(Arc::from)
        .unwrap_or_else(|| Arc::from(request_id::generate()));
    let incoming = req
        .headers()
        .get(request_id::TRACEPARENT_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|v| dsec_telemetry::valid_traceparent(v))
        .map(str::to_string);
    let span = tracing::info_span!(
        "request",
        method = %req.method(),
        uri = %req.uri().path(),
        request_id = %id,
    );
    if let Some(tp) = &incoming {
        dsec_telemetry::set_parent(&span, tp);
    }
    let traceparent = dsec_telemetry::traceparent(&span).or(incoming);
    let mut resp = request_id::scope_traced(id.clone(), traceparent.map(Arc::from), next.run(req))
        .instrument(span)
        .await;
    if let Ok(v) = axum::http::HeaderValue::from_str(&id) {
        resp.headers_mut().insert(request_id::HEADER, v);
    }
    resp
}

/// Serves [`router`] on `listener` until `shutdown` completes, then drains open requests.
pub async fn serve(
    listener: tokio::net::TcpListener,
    api: Arc<dyn SandboxApi>,
    opts: HttpOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with(listener, api, opts, Router::new(), shutdown).await
}

/// [`serve`] with `extra` routes beside the API (a cluster's node registration).
pub async fn serve_with(
    listener: tokio::net::TcpListener,
    api: Arc<dyn SandboxApi>,
    opts: HttpOptions,
    extra: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "dsec API listening");
    }
    use axum::serve::ListenerExt;
    let idle = opts.tcp_keepalive;
    let listener = listener.tap_io(move |tcp| {
        if let Err(e) = watch_peer(tcp, idle) {
            tracing::debug!(error = %e, "TCP keepalive not set");
        }
    });
    let audit = opts.audit.clone();
    let mut app = extra.merge(router_with(api.clone(), opts));
    if let Some(log) = audit {
        app = with_audit(app, log, api);
    }
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<std::net::SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown)
    .await
}

/// `app` with every state-changing call to it recorded in `log` (see [`audit`]).
pub fn with_audit(app: Router, log: Arc<audit::AuditLog>, api: Arc<dyn SandboxApi>) -> Router {
    app.layer(middleware::from_fn_with_state(
        audit::Audited { log, api },
        audit::audit_calls,
    ))
}

/// Largest plain-text error body [`json_errors`] rewraps (axum's rejections are short).
const PLAIN_ERROR_LIMIT: usize = 64 * 1024;

/// Gives every error answer a JSON body in its front's shape: axum's own rejections
/// (a body over the limit, a malformed multipart form, a missing content type) are
/// plain text, which the SWE-ReX and E2B clients cannot read as an error.
async fn json_errors(req: axum::extract::Request, next: middleware::Next) -> Response {
    let path = req.uri().path().to_owned();
    let resp = next.run(req).await;
    let status = resp.status();
    let is_json = resp
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return resp;
    }
    let code = match status.as_u16() {
        413 => ErrorCode::PayloadTooLarge,
        404 => ErrorCode::NotFound,
        405 => ErrorCode::MethodNotAllowed,
        401 => ErrorCode::Unauthorized,
        403 => ErrorCode::Forbidden,
        429 => ErrorCode::QuotaExceeded,
        s if s >= 500 => ErrorCode::Internal,
        _ => ErrorCode::BadRequest,
    };
    let text = match axum::body::to_bytes(resp.into_body(), PLAIN_ERROR_LIMIT).await {
        Ok(b) => String::from_utf8_lossy(&b).trim().to_owned(),
        Err(_) => String::new(),
    };
    let message = if text.is_empty() {
        status.canonical_reason().unwrap_or("error").to_owned()
    } else {
        text
    };
    let body = if path.starts_with("/swerex/") || path.starts_with("/sandboxfusion/") {
        serde_json::json!({"detail": message, "code": code})
    } else if path.starts_with("/e2b/") {
        serde_json::json!({"code": status.as_u16(), "message": message})
    } else {
        return HttpError::new(code, message).into_response();
    };
    (status, axum::Json(body)).into_response()
}

/// Turns a handler panic into a 500 `internal` error with the panic message.
fn panic_response(panic: Box<dyn Any + Send + 'static>) -> Response {
    let detail = if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else {
        "unknown panic".to_owned()
    };
    tracing::error!(%detail, "request handler panicked");
    HttpError::new(
        ErrorCode::Internal,
        format!("internal error: handler panicked: {detail}"),
    )
    .into_response()
}

#[cfg(test)]
mod tests;

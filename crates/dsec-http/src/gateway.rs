//! HTTP front of the model gateway ([`dsec_gateway::Gateway`]): OpenAI's routes under
//! `/v1`, each mapped onto one call of the gateway, and its answers (streams chunk by
//! chunk) written back. Errors of the transport itself (a body over the limit, an
//! unknown route, a panic) are answered in OpenAI's error shape too, so the `openai`
//! SDKs raise their typed exceptions for them. Accepted sockets send small writes at
//! once (`TCP_NODELAY`): an SSE chunk must not wait for the next. `GET /metrics` (for a
//! caller with a configured gateway key; a sandbox token gets 403) gives the gateway's
//! counters in Prometheus text; `GET /v1/usage` each caller's usage (a sandbox token
//! sees only its own, and so its budget left).

use std::future::Future;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use dsec_gateway::openai::{self, ErrorKind};
use dsec_gateway::{
    CallOptions, Gateway, GatewayStats, HistogramSnapshot, ModelTraffic, Reply, ReplyBody, Route,
    RouteTraffic, UpstreamStatus, STATUS_CLASSES,
};
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::trace::TraceLayer;

use crate::metrics::{label, HistogramSeries, PromText};

type Gw = State<Arc<Gateway>>;

/// The gateway's routes.
pub fn gateway_router(gateway: Arc<Gateway>) -> Router {
    let limit = gateway.config().max_body_bytes;
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{*id}", get(get_model))
        .route("/v1/usage", get(usage))
        .route("/v1/usage/tenants", get(tenant_usage))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn(openai_errors))
        .layer(TraceLayer::new_for_http())
        .layer(CatchPanicLayer::custom(panic_reply))
        .with_state(gateway)
}

/// A handler's panic as a 500 in OpenAI's shape (the gateway goes on serving).
fn panic_reply(_panic: Box<dyn std::any::Any + Send + 'static>) -> Response {
    tracing::error!("a gateway handler panicked");
    reply(openai::error(
        500,
        "internal error: the gateway's handler panicked",
        ErrorKind::Api,
        None,
    ))
}

/// Serves [`gateway_router`] on `listener` until `shutdown` completes.
pub async fn serve_gateway(
    listener: tokio::net::TcpListener,
    gateway: Arc<Gateway>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "dsec model gateway listening");
    }
    use axum::serve::ListenerExt;
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY not set");
        }
    });
    axum::serve(listener, gateway_router(gateway))
        .with_graceful_shutdown(shutdown)
        .await
}

/// The caller's key: `Authorization: Bearer KEY` (what the `openai` SDKs send).
fn bearer(headers: &HeaderMap) -> Option<String> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, key) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| key.trim().to_string())
        .filter(|k| !k.is_empty())
}

async fn chat_completions(State(gw): Gw, headers: HeaderMap, body: Bytes) -> Response {
    forward(&gw, &headers, Route::ChatCompletions, body).await
}

async fn completions(State(gw): Gw, headers: HeaderMap, body: Bytes) -> Response {
    forward(&gw, &headers, Route::Completions, body).await
}

async fn embeddings(State(gw): Gw, headers: HeaderMap, body: Bytes) -> Response {
    forward(&gw, &headers, Route::Embeddings, body).await
}

async fn forward(gw: &Gateway, headers: &HeaderMap, route: Route, body: Bytes) -> Response {
    let options = CallOptions {
        no_cache: no_cache(headers),
    };
    reply(
        gw.handle(bearer(headers).as_deref(), route, body, options)
            .await,
    )
}

/// Whether the caller opted out of the cache (`Cache-Control: no-cache` or `no-store`).
fn no_cache(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::CACHE_CONTROL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|d| d.trim().to_ascii_lowercase())
        .any(|d| d == "no-cache" || d == "no-store")
}

async fn list_models(State(gw): Gw, headers: HeaderMap) -> Response {
    reply(gw.list_models(bearer(&headers).as_deref()))
}

async fn get_model(State(gw): Gw, headers: HeaderMap, Path(id): Path<String>) -> Response {
    reply(gw.get_model(bearer(&headers).as_deref(), &id))
}

/// `GET /v1/usage[?caller=NAME]`: every caller's usage for a configured key, its own
/// for a sandbox token ([`Gateway::usage`]).
async fn usage(State(gw): Gw, headers: HeaderMap, Query(q): Query<UsageQuery>) -> Response {
    reply(gw.usage(bearer(&headers).as_deref(), q.caller.as_deref()))
}

#[derive(Debug, serde::Deserialize)]
struct UsageQuery {
    caller: Option<String>,
}

async fn tenant_usage(State(gw): Gw, headers: HeaderMap, Query(q): Query<TenantQuery>) -> Response {
    reply(gw.tenant_usage(bearer(&headers).as_deref(), q.tenant.as_deref()))
}

#[derive(Debug, serde::Deserialize)]
struct TenantQuery {
    tenant: Option<String>,
}

async fn metrics(State(gw): Gw, headers: HeaderMap) -> Response {
    if let Err(r) = gw.authorize(bearer(&headers).as_deref()) {
        return reply(*r);
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        render_metrics(&gw.stats(), &gw.traffic(), &gw.upstreams()),
    )
        .into_response()
}

/// The gateway's counters in the Prometheus text format (version 0.0.4): `s`, and the
/// requests, latencies and tokens per model of `traffic`, and each upstream's health.
pub fn render_metrics(
    s: &GatewayStats,
    traffic: &[ModelTraffic],
    upstreams: &[UpstreamStatus],
) -> String {
    let mut out = String::new();
    let mut p = PromText::new(&mut out);
    let c = &s.cache;
    p.family(
        "dsec_gateway_cache_total",
        "counter",
        "Requests by how the response cache took part (x-dsec-cache).",
        [
            ("{result=\"hit\"}", c.hits),
            ("{result=\"miss\"}", c.misses),
            ("{result=\"coalesced\"}", c.coalesced),
            ("{result=\"bypass\"}", c.bypassed),
        ],
    );
    p.family(
        "dsec_gateway_cache_evictions_total",
        "counter",
        "Cached answers removed to make room.",
        [("", c.evictions)],
    );
    p.family(
        "dsec_gateway_cache_entries",
        "gauge",
        "Answers in the response cache.",
        [("", c.entries)],
    );
    p.family(
        "dsec_gateway_cache_bytes",
        "gauge",
        "Bytes the cached answers take.",
        [("", c.bytes)],
    );
    p.family(
        "dsec_gateway_limited_total",
        "counter",
        "Requests refused (429) by a caller's limit or used-up token budget.",
        [
            ("{limit=\"requests\"}", s.limited_requests),
            ("{limit=\"tokens\"}", s.limited_tokens),
            ("{limit=\"concurrency\"}", s.limited_concurrency),
            ("{limit=\"budget\"}", s.limited_budget),
        ],
    );
    p.family(
        "dsec_gateway_token_callers",
        "gauge",
        "Callers of sandbox tokens held (used since the last sweep of gone tokens).",
        [("", s.token_callers)],
    );
    p.family(
        "dsec_gateway_timeouts_total",
        "counter",
        "Requests over their time limit (504, or a stream ended with an error event).",
        [("", s.timed_out)],
    );
    render_traffic(&mut p, traffic);
    render_upstreams(&mut p, upstreams);
    out
}

/// Per upstream (labels `model` and `upstream`, its URL): in rotation or not, requests
/// in flight, errors by kind.
fn render_upstreams(p: &mut PromText<'_>, upstreams: &[UpstreamStatus]) {
    let labels: Vec<String> = upstreams
        .iter()
        .map(|u| {
            format!(
                "model=\"{}\",upstream=\"{}\"",
                label(&u.model),
                label(&u.url)
            )
        })
        .collect();
    p.family(
        "dsec_gateway_upstream_healthy",
        "gauge",
        "1 while an upstream is in rotation, 0 while ejected after a failed connect or probe.",
        upstreams
            .iter()
            .zip(&labels)
            .map(|(u, l)| (format!("{{{l}}}"), u64::from(u.healthy))),
    );
    p.family(
        "dsec_gateway_upstream_in_flight",
        "gauge",
        "Requests in flight at an upstream.",
        upstreams
            .iter()
            .zip(&labels)
            .map(|(u, l)| (format!("{{{l}}}"), u.in_flight)),
    );
    p.family(
        "dsec_gateway_upstream_errors_total",
        "counter",
        "Upstream failures by kind: connect, status (a 5xx answer), transport, probe.",
        upstreams.iter().zip(&labels).flat_map(|(u, l)| {
            [
                ("connect", u.connect_errors),
                ("status", u.status_errors),
                ("transport", u.transport_errors),
                ("probe", u.probe_errors),
            ]
            .map(|(kind, n)| (format!("{{{l},kind=\"{kind}\"}}"), n))
        }),
    );
}

/// The families per model and route: requests by status class, their times, the
/// first chunk's delay of streams, tokens.
fn render_traffic(p: &mut PromText<'_>, traffic: &[ModelTraffic]) {
    // Label sets, without braces: per model, and per model and route.
    let models: Vec<String> = traffic
        .iter()
        .map(|m| format!("model=\"{}\"", label(&m.model)))
        .collect();
    let routes: Vec<(String, &RouteTraffic)> = traffic
        .iter()
        .zip(&models)
        .flat_map(|(m, model)| {
            m.routes
                .iter()
                .map(move |r| (format!("{model},route=\"{}\"", r.route.as_str()), r))
        })
        .collect();
    p.family(
        "dsec_gateway_requests_total",
        "counter",
        "Requests for a configured model, by route and status class (a stream counts when it ends).",
        routes.iter().flat_map(|(labels, r)| {
            STATUS_CLASSES
                .iter()
                .zip(r.codes)
                .filter(|&(_, n)| n > 0)
                .map(move |(code, n)| (format!("{{{labels},code=\"{code}\"}}"), n))
        }),
    );
    p.histogram(
        "dsec_gateway_request_duration_seconds",
        "Time to the whole answer (a stream: to its end or its caller leaving).",
        routes
            .iter()
            .map(|(labels, r)| histogram(labels, &r.duration)),
    );
    p.histogram(
        "dsec_gateway_ttft_seconds",
        "Streams: time from the request to the first event reaching the caller.",
        traffic
            .iter()
            .zip(&models)
            .filter(|(m, _)| m.ttft.count > 0)
            .map(|(m, labels)| histogram(labels, &m.ttft)),
    );
    p.family(
        "dsec_gateway_tokens_total",
        "counter",
        "Model tokens the upstreams' usage reported, by direction.",
        traffic.iter().zip(&models).flat_map(|(m, labels)| {
            [
                (format!("{{{labels},dir=\"prompt\"}}"), m.prompt_tokens),
                (
                    format!("{{{labels},dir=\"completion\"}}"),
                    m.completion_tokens,
                ),
            ]
        }),
    );
}

fn histogram<'a>(
    labels: &'a str,
    h: &'a HistogramSnapshot,
) -> HistogramSeries<'a, impl Iterator<Item = (f64, u64)> + 'a> {
    HistogramSeries {
        labels,
        buckets: h.buckets(),
        sum: h.sum_s,
        count: h.count,
    }
}

async fn not_found() -> Response {
    reply(openai::error(
        404,
        "no such route: the gateway serves /v1/chat/completions, /v1/completions, \
         /v1/embeddings, /v1/models, /v1/usage and /v1/usage/tenants",
        ErrorKind::InvalidRequest,
        Some("unknown_url"),
    ))
}

/// A gateway [`Reply`] as an HTTP response.
fn reply(r: Reply) -> Response {
    let status = StatusCode::from_u16(r.status).unwrap_or(StatusCode::BAD_GATEWAY);
    let mut builder = Response::builder().status(status);
    for (name, value) in &r.headers {
        builder = builder.header(name.as_str(), value.as_str());
    }
    let body = match r.body {
        ReplyBody::Full(b) => Body::from(b),
        ReplyBody::Stream(s) => Body::from_stream(s),
    };
    builder
        .body(body)
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// Gives axum's own error answers (a body over the limit, a wrong method) OpenAI's
/// JSON error shape.
async fn openai_errors(req: axum::extract::Request, next: middleware::Next) -> Response {
    let resp = next.run(req).await;
    let status = resp.status();
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return resp;
    }
    let text = match axum::body::to_bytes(resp.into_body(), 64 * 1024).await {
        Ok(b) => String::from_utf8_lossy(&b).trim().to_owned(),
        Err(_) => String::new(),
    };
    let message = match (status.as_u16(), text.is_empty()) {
        (413, _) => "the request body is over the gateway's limit".to_owned(),
        (_, true) => status.canonical_reason().unwrap_or("error").to_owned(),
        (_, false) => text,
    };
    let kind = if status.is_server_error() {
        ErrorKind::Api
    } else {
        ErrorKind::InvalidRequest
    };
    let mut r = reply(openai::error(status.as_u16(), message, kind, None));
    *r.status_mut() = status;
    r
}

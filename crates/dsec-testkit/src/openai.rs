//! [`FakeOpenAi`]: an OpenAI-compatible upstream for the model gateway's tests, with
//! answers derived from the prompt (so identical requests get identical answers) and
//! counters of what it was asked, how many requests it held at once, and how many
//! streams its callers cut off.
//!
//! Routes: `POST /v1/chat/completions` (whole or streamed as SSE, with the usage chunk
//! when `stream_options.include_usage`), `POST /v1/completions`, `POST /v1/embeddings`
//! (floats, or base64 little-endian f32 as the `openai` SDK asks by default),
//! `GET /v1/models`, `GET /_fake/stats` and `POST /_fake/reset` (counters back to zero).
//!
//! A prompt may carry directives, `[fake latency_ms=300 chunks=5 chunk_ms=20 fail=503]`:
//! wait before answering, split a stream into that many chunks with a pause between
//! them, or answer that HTTP status with an OpenAI error.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use serde_json::{json, Value};

/// What a [`FakeOpenAi`] was asked and did.
#[derive(Debug, Default)]
pub struct FakeStats {
    /// Requests per route path.
    pub requests: Mutex<BTreeMap<String, u64>>,
    /// Requests being answered now.
    pub in_flight: AtomicU64,
    /// The most answered at once.
    pub max_in_flight: AtomicU64,
    /// Streams whose caller went away before their end.
    pub cancelled: AtomicU64,
    /// Streams sent to their end.
    pub completed: AtomicU64,
    /// The `Authorization` header of the last request.
    pub last_auth: Mutex<Option<String>>,
    /// The `model` of the last request.
    pub last_model: Mutex<Option<String>>,
    /// The body of the last request (to check what a proxy changed in it).
    pub last_body: Mutex<Option<Value>>,
}

impl FakeStats {
    /// Requests to `path` (`/v1/chat/completions`, ...) so far.
    pub fn count(&self, path: &str) -> u64 {
        self.requests
            .lock()
            .map(|r| r.get(path).copied().unwrap_or(0))
            .unwrap_or(0)
    }

    /// Requests to every route so far.
    pub fn total(&self) -> u64 {
        self.requests.lock().map(|r| r.values().sum()).unwrap_or(0)
    }

    /// Sets the counters back to zero (the high-water mark to what is in flight now).
    pub fn reset(&self) {
        if let Ok(mut r) = self.requests.lock() {
            r.clear();
        }
        self.max_in_flight
            .store(self.in_flight.load(Ordering::Relaxed), Ordering::Relaxed);
        self.cancelled.store(0, Ordering::Relaxed);
        self.completed.store(0, Ordering::Relaxed);
    }

    fn snapshot(&self) -> Value {
        let requests = self.requests.lock().map(|r| r.clone()).unwrap_or_default();
        json!({
            "requests": requests,
            "in_flight": self.in_flight.load(Ordering::Relaxed),
            "max_in_flight": self.max_in_flight.load(Ordering::Relaxed),
            "cancelled": self.cancelled.load(Ordering::Relaxed),
            "completed": self.completed.load(Ordering::Relaxed),
        })
    }
}

/// A running fake upstream on a loopback port. Drop stops it.
#[derive(Debug)]
pub struct FakeOpenAi {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its counters.
    pub stats: Arc<FakeStats>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeOpenAi {
    /// Starts one serving `models` on `127.0.0.1` (a free port), on the current tokio
    /// runtime.
    pub async fn start(models: &[&str]) -> std::io::Result<Self> {
        Self::start_on(
            "127.0.0.1:0".parse().map_err(std::io::Error::other)?,
            models,
        )
        .await
    }

    /// [`FakeOpenAi::start`] on `addr`.
    pub async fn start_on(addr: SocketAddr, models: &[&str]) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let stats = Arc::new(FakeStats::default());
        let state = Fake {
            stats: stats.clone(),
            models: models.iter().map(|m| m.to_string()).collect(),
        };
        let app = Router::new()
            .route("/v1/chat/completions", post(chat))
            .route("/v1/completions", post(completions))
            .route("/v1/embeddings", post(embeddings))
            .route("/v1/models", get(list_models))
            .route("/_fake/stats", get(stats_route))
            .route("/_fake/reset", post(reset_route))
            .with_state(state);
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self { addr, stats, task })
    }

    /// Its base URL, as an OpenAI client takes it (`http://127.0.0.1:PORT/v1`).
    pub fn url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }
}

impl Drop for FakeOpenAi {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[derive(Debug, Clone)]
struct Fake {
    stats: Arc<FakeStats>,
    models: Vec<String>,
}

/// Directives found in a prompt.
#[derive(Debug, Default)]
struct Directives {
    latency_ms: u64,
    chunks: Option<usize>,
    chunk_ms: u64,
    fail: Option<u16>,
}

fn directives(text: &str) -> Directives {
    let mut d = Directives::default();
    let Some(start) = text.find("[fake ") else {
        return d;
    };
    let rest = &text[start + 6..];
    let inner = &rest[..rest.find(']').unwrap_or(rest.len())];
    for pair in inner.split_whitespace() {
        let Some((k, v)) = pair.split_once('=') else {
            continue;
        };
        match k {
            "latency_ms" => d.latency_ms = v.parse().unwrap_or(0),
            "chunks" => d.chunks = v.parse().ok(),
            "chunk_ms" => d.chunk_ms = v.parse().unwrap_or(0),
            "fail" => d.fail = v.parse().ok(),
            _ => {}
        }
    }
    d
}

/// Counts a request in flight while alive.
struct Held(Arc<FakeStats>);

impl Held {
    fn new(stats: &Arc<FakeStats>, path: &str, headers: &HeaderMap, body: &Value) -> Self {
        if let Ok(mut r) = stats.requests.lock() {
            *r.entry(path.to_string()).or_default() += 1;
        }
        if let Ok(mut a) = stats.last_auth.lock() {
            *a = headers
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
        }
        if let Ok(mut m) = stats.last_model.lock() {
            *m = body["model"].as_str().map(str::to_string);
        }
        if let Ok(mut b) = stats.last_body.lock() {
            *b = Some(body.clone());
        }
        let now = stats.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        stats.max_in_flight.fetch_max(now, Ordering::Relaxed);
        Held(stats.clone())
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

fn failure(status: u16) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        status,
        Json(json!({"error": {"message": "the fake was told to fail", "type": "api_error", "param": null, "code": "fake_failure"}})),
    )
        .into_response()
}

fn words(text: &str) -> u64 {
    text.split_whitespace().count() as u64
}

async fn chat(State(f): State<Fake>, headers: HeaderMap, Json(body): Json<Value>) -> Response {
    let held = Held::new(&f.stats, "/v1/chat/completions", &headers, &body);
    let prompt = body["messages"]
        .as_array()
        .and_then(|m| m.last())
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default()
        .to_string();
    let d = directives(&prompt);
    tokio::time::sleep(Duration::from_millis(d.latency_ms)).await;
    if let Some(status) = d.fail {
        return failure(status);
    }
    let model = body["model"].as_str().unwrap_or_default().to_string();
    let content = format!("echo: {prompt}");
    let usage = json!({
        "prompt_tokens": words(&prompt),
        "completion_tokens": words(&content),
        "total_tokens": words(&prompt) + words(&content),
    });
    if body["stream"].as_bool() != Some(true) {
        drop(held);
        return Json(json!({
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop", "logprobs": null}],
            "usage": usage,
        }))
        .into_response();
    }
    let include_usage = body["stream_options"]["include_usage"].as_bool() == Some(true);
    let pieces = split(&content, d.chunks);
    let chunk = |delta: Value, finish: Value| {
        let mut c = json!({
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null}],
        });
        if include_usage {
            c["usage"] = Value::Null;
        }
        format!("data: {c}\n\n")
    };
    let mut events = vec![chunk(
        json!({"role": "assistant", "content": ""}),
        Value::Null,
    )];
    events.extend(
        pieces
            .iter()
            .map(|p| chunk(json!({"content": p}), Value::Null)),
    );
    events.push(chunk(json!({}), json!("stop")));
    if include_usage {
        let u = json!({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": model, "choices": [], "usage": usage});
        events.push(format!("data: {u}\n\n"));
    }
    events.push("data: [DONE]\n\n".to_string());
    sse(events, d.chunk_ms, held)
}

/// `text` in `n` pieces (default: a word each), together `text` again.
fn split(text: &str, n: Option<usize>) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let n = n
        .unwrap_or_else(|| words(text) as usize)
        .clamp(1, chars.len().max(1));
    let per = chars.len().div_ceil(n).max(1);
    chars.chunks(per).map(|c| c.iter().collect()).collect()
}

/// Sends `events` with `gap_ms` between them, counting the stream cancelled if its
/// caller goes away first.
fn sse(events: Vec<String>, gap_ms: u64, held: Held) -> Response {
    struct Ending {
        held: Held,
        done: bool,
    }
    impl Drop for Ending {
        fn drop(&mut self) {
            let counter = if self.done {
                &self.held.0.completed
            } else {
                &self.held.0.cancelled
            };
            counter.fetch_add(1, Ordering::Relaxed);
        }
    }
    let ending = Ending { held, done: false };
    let stream = futures::stream::unfold(
        (events.into_iter(), ending, true),
        move |(mut it, mut ending, first)| async move {
            let event = it.next()?;
            if !first && gap_ms > 0 {
                tokio::time::sleep(Duration::from_millis(gap_ms)).await;
            }
            if event.starts_with("data: [DONE]") {
                ending.done = true;
            }
            Some((Ok::<_, std::io::Error>(event), (it, ending, false)))
        },
    );
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

async fn completions(
    State(f): State<Fake>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let _held = Held::new(&f.stats, "/v1/completions", &headers, &body);
    let prompt = body["prompt"].as_str().unwrap_or_default().to_string();
    let d = directives(&prompt);
    tokio::time::sleep(Duration::from_millis(d.latency_ms)).await;
    if let Some(status) = d.fail {
        return failure(status);
    }
    let text = format!("echo: {prompt}");
    Json(json!({
        "id": "cmpl-fake",
        "object": "text_completion",
        "created": 0,
        "model": body["model"],
        "choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": null}],
        "usage": {"prompt_tokens": words(&prompt), "completion_tokens": words(&text), "total_tokens": words(&prompt) + words(&text)},
    }))
    .into_response()
}

/// A deterministic 4-dimensional vector of `text`.
fn vector(text: &str) -> [f32; 4] {
    let mut v = [0f32; 4];
    for (i, b) in text.bytes().enumerate() {
        v[i % 4] += f32::from(b) / 255.0;
    }
    v
}

async fn embeddings(
    State(f): State<Fake>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let _held = Held::new(&f.stats, "/v1/embeddings", &headers, &body);
    let inputs: Vec<String> = match &body["input"] {
        Value::String(s) => vec![s.clone()],
        Value::Array(items) => items
            .iter()
            .map(|i| i.as_str().map_or_else(|| i.to_string(), str::to_string))
            .collect(),
        other => vec![other.to_string()],
    };
    let base64 = body["encoding_format"].as_str() == Some("base64");
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, text)| {
            let v = vector(text);
            let embedding = if base64 {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                json!(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(v)
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    let tokens: u64 = inputs.iter().map(|t| words(t)).sum();
    Json(json!({
        "object": "list",
        "data": data,
        "model": body["model"],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
    .into_response()
}

async fn list_models(State(f): State<Fake>) -> Response {
    let data: Vec<Value> = f
        .models
        .iter()
        .map(|m| json!({"id": m, "object": "model", "created": 0, "owned_by": "fake"}))
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

async fn stats_route(State(f): State<Fake>) -> Response {
    Json(f.stats.snapshot()).into_response()
}

async fn reset_route(State(f): State<Fake>) -> Response {
    f.stats.reset();
    Json(f.stats.snapshot()).into_response()
}

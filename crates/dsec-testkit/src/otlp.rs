//! [`OtlpCollector`]: an OpenTelemetry collector stub for the tracing tests. It takes
//! `POST /v1/traces` in the OTLP/HTTP JSON encoding (what `--otlp-endpoint` sends) and
//! keeps every span it received, with the service that sent it.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use serde_json::Value;

/// One span as a collector received it.
#[derive(Debug, Clone, PartialEq)]
pub struct ReceivedSpan {
    /// `service.name` of the resource that sent it.
    pub service: String,
    /// Span name.
    pub name: String,
    /// Trace id (32 lowercase hex digits).
    pub trace_id: String,
    /// Span id (16 hex digits).
    pub span_id: String,
    /// Parent span id; empty for a root span.
    pub parent_span_id: String,
    /// String, integer, float and boolean attributes, as text.
    pub attributes: BTreeMap<String, String>,
}

/// A running collector stub; stops when dropped.
pub struct OtlpCollector {
    addr: SocketAddr,
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for OtlpCollector {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl OtlpCollector {
    /// Starts one on an ephemeral loopback port.
    pub async fn start() -> std::io::Result<Self> {
        let spans = Arc::new(Mutex::new(Vec::new()));
        let app = Router::new()
            .route("/v1/traces", post(receive))
            .with_state(spans.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self { addr, spans, task })
    }

    /// Its base URL (`http://127.0.0.1:PORT`), as `--otlp-endpoint` takes it.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.spans.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

fn text_of(value: &Value) -> String {
    for key in ["stringValue", "intValue", "doubleValue", "boolValue"] {
        match value.get(key) {
            Some(Value::String(s)) => return s.clone(),
            Some(other) if !other.is_null() => return other.to_string(),
            _ => {}
        }
    }
    value.to_string()
}

fn attributes(list: &Value) -> BTreeMap<String, String> {
    list.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|kv| Some((kv["key"].as_str()?.to_string(), text_of(&kv["value"]))))
                .collect()
        })
        .unwrap_or_default()
}

async fn receive(State(spans): State<Arc<Mutex<Vec<ReceivedSpan>>>>, body: Bytes) -> StatusCode {
    let Ok(doc) = serde_json::from_slice::<Value>(&body) else {
        return StatusCode::BAD_REQUEST;
    };
    let empty = Vec::new();
    let mut got = Vec::new();
    for rs in doc["resourceSpans"].as_array().unwrap_or(&empty) {
        let resource = attributes(&rs["resource"]["attributes"]);
        let service = resource.get("service.name").cloned().unwrap_or_default();
        for ss in rs["scopeSpans"].as_array().unwrap_or(&empty) {
            for sp in ss["spans"].as_array().unwrap_or(&empty) {
                let field = |k: &str| sp[k].as_str().unwrap_or("").to_string();
                got.push(ReceivedSpan {
                    service: service.clone(),
                    name: field("name"),
                    trace_id: field("traceId"),
                    span_id: field("spanId"),
                    parent_span_id: field("parentSpanId"),
                    attributes: attributes(&sp["attributes"]),
                });
            }
        }
    }
    if let Ok(mut s) = spans.lock() {
        s.extend(got);
    }
    StatusCode::OK
}

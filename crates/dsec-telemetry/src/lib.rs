//! Logs and traces of dsec's daemons.
//!
//! - [`init`] installs the process's `tracing` subscriber: log lines on stderr (filtered
//!   by `RUST_LOG`, default `info`) and, given an OTLP endpoint, every span at `info` or
//!   above exported over OTLP/HTTP (JSON encoding) to a collector, under the daemon's
//!   service name. Export runs on a thread of its own, in batches: a slow or absent
//!   collector costs dropped spans, never a request's time.
//! - [`traceparent`] and [`set_parent`] carry W3C trace context
//!   (`00-<trace id>-<span id>-<flags>`): the HTTP edge continues a caller's trace, a
//!   node continues its API server's, and the commands a request runs see it in their
//!   `TRACEPARENT`. Without an exporter, a caller's trace context is passed through as
//!   it came ([`valid_traceparent`]), so a trainer's trace still reaches its commands.

use std::collections::HashMap;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing::level_filters::LevelFilter;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

/// The header, and the environment variable of commands, that carry trace context.
pub const TRACEPARENT_HEADER: &str = "traceparent";

/// What [`init`] refuses.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The endpoint is not an `http://` URL.
    #[error(
        "OTLP endpoint {0:?}: give an http:// URL of an OTLP/HTTP collector, such as \
         http://127.0.0.1:4318 (https is not built in: run a collector beside the server)"
    )]
    Endpoint(String),
    /// The exporter could not be built.
    #[error("building the OTLP exporter: {0}")]
    Exporter(String),
}

/// The process's telemetry, as [`init`] installed it.
#[derive(Debug, Default)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Whether spans are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Sends the spans not sent yet and stops the exporter. Blocks (up to the
    /// exporter's timeout): call it off the async runtime's threads, at exit.
    pub fn shutdown(&self) {
        if let Some(p) = &self.provider {
            if let Err(e) = p.shutdown() {
                tracing::warn!(error = %e, "flushing spans to the OTLP collector");
            }
        }
    }
}

/// The URL spans are posted to: `endpoint` as given when it names a path, else its
/// `/v1/traces` (the OTLP/HTTP convention for a collector's base URL).
pub fn traces_url(endpoint: &str) -> Result<String, TelemetryError> {
    let bad = || TelemetryError::Endpoint(endpoint.to_string());
    let rest = endpoint.strip_prefix("http://").ok_or_else(bad)?;
    let (host, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    if host.is_empty() || host.contains(char::is_whitespace) {
        return Err(bad());
    }
    Ok(match path {
        "" | "/" => format!("http://{host}/v1/traces"),
        _ => endpoint.to_string(),
    })
}

/// Installs the subscriber of a daemon named `service` (`dsec-serve`, `dsec-node`, ...):
/// logs to stderr, and spans to `otlp_endpoint` when given. A second call (a test
/// process starting two servers) keeps the first subscriber.
pub fn init(service: &str, otlp_endpoint: Option<&str>) -> Result<Telemetry, TelemetryError> {
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        );
    let Some(endpoint) = otlp_endpoint else {
        let _ = tracing_subscriber::registry().with(logs).try_init();
        return Ok(Telemetry::default());
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpJson)
        .with_endpoint(traces_url(endpoint)?)
        .build()
        .map_err(|e| TelemetryError::Exporter(e.to_string()))?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            Resource::builder()
                .with_service_name(service.to_string())
                .build(),
        )
        .build();
    let tracer = provider.tracer("dsec");
    // Only dsec's own spans: the exporter's HTTP client is traced too, and exporting
    // its spans would feed the exporter forever.
    // No busy/idle timing (a clock read at every poll of every instrumented future) and
    // no thread or source location attributes: what a span says is its own fields.
    let spans = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_tracked_inactivity(false)
        .with_threads(false)
        .with_location(false)
        .with_filter(
            Targets::new()
                .with_default(LevelFilter::INFO)
                .with_target("hyper", LevelFilter::OFF)
                .with_target("hyper_util", LevelFilter::OFF)
                .with_target("reqwest", LevelFilter::OFF)
                .with_target("h2", LevelFilter::OFF)
                .with_target("opentelemetry", LevelFilter::OFF)
                .with_target("opentelemetry_sdk", LevelFilter::OFF)
                .with_target("opentelemetry_otlp", LevelFilter::OFF),
        );
    let _ = tracing_subscriber::registry()
        .with(logs)
        .with(spans)
        .try_init();
    Ok(Telemetry {
        provider: Some(provider),
    })
}

/// The W3C `traceparent` of `span`, when spans are exported (else `None`).
pub fn traceparent(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| {
        format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        )
    })
}

/// Makes `span` (not entered yet) a child of the remote span `traceparent` names;
/// `false` when it names none.
pub fn set_parent(span: &tracing::Span, traceparent: &str) -> bool {
    if !valid_traceparent(traceparent) {
        return false;
    }
    let carrier = HashMap::from([(TRACEPARENT_HEADER.to_string(), traceparent.to_string())]);
    let cx = TraceContextPropagator::new().extract(&carrier);
    if !cx.span().span_context().is_valid() {
        return false;
    }
    let _ = span.set_parent(cx);
    true
}

/// Whether `value` is a W3C trace context of version `00`: `00-` then 32 and 16
/// lowercase hex digits (neither all zero) and 2 of flags, dash-separated.
pub fn valid_traceparent(value: &str) -> bool {
    let parts: Vec<&str> = value.split('-').collect();
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let nonzero = |s: &str| s.bytes().any(|b| b != b'0');
    matches!(parts.as_slice(), [v, t, s, f]
        if *v == "00" && hex(t, 32) && hex(s, 16) && hex(f, 2) && nonzero(t) && nonzero(s))
}

/// The trace id of a valid `traceparent`.
pub fn trace_id(traceparent: &str) -> Option<&str> {
    valid_traceparent(traceparent).then(|| &traceparent[3..35])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(
            traces_url("http://127.0.0.1:4318").ok().as_deref(),
            Some("http://127.0.0.1:4318/v1/traces")
        );
        assert_eq!(
            traces_url("http://c:4318/").ok().as_deref(),
            Some("http://c:4318/v1/traces")
        );
        assert_eq!(
            traces_url("http://c:4318/custom/traces").ok().as_deref(),
            Some("http://c:4318/custom/traces")
        );
        assert!(traces_url("https://c:4318").is_err());
        assert!(traces_url("c:4318").is_err());
        assert!(traces_url("http:///v1/traces").is_err());
    }

    #[test]
    fn traceparents() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert!(valid_traceparent(tp));
        assert_eq!(trace_id(tp), Some("4bf92f3577b34da6a3ce929d0e0e4736"));
        assert!(!valid_traceparent(
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01"
        ));
        assert!(!valid_traceparent(
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        ));
        assert!(!valid_traceparent(
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"
        ));
        assert!(!valid_traceparent("00-4bf92f35-00f067aa0ba902b7-01"));
        assert!(!valid_traceparent(""));
        // No exporter installed here: a span has no trace context of its own.
        assert_eq!(traceparent(&tracing::info_span!("s")), None);
    }
}

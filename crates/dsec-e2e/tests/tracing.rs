//! Traces (#29): `dsec serve --otlp-endpoint` exports its spans to a collector (our
//! stub, `dsec_testkit::OtlpCollector`), continues a caller's W3C trace context, and
//! hands the trace on to the commands a request runs (`TRACEPARENT`, beside
//! `DSEC_REQUEST_ID`).

use std::time::Duration;

use dsec_e2e::{require_root, wait_until, Server};
use dsec_testkit::{OtlpCollector, ReceivedSpan};
use serde_json::{json, Value};

/// A caller's trace: trace id, then its span id.
const CALLER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

async fn post(
    server: &Server,
    path: &str,
    body: Value,
    headers: &[(&str, &str)],
) -> anyhow::Result<Value> {
    let mut req = reqwest::Client::new()
        .post(format!("{}{path}", server.url))
        .header("x-api-key", &server.key)
        .json(&body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await?;
    let status = resp.status();
    let body: Value = resp.json().await?;
    anyhow::ensure!(status.is_success(), "{path}: {status} {body}");
    Ok(body)
}

/// The spans received so far of request `request_id` (the `request` span carries it).
fn request_span(spans: &[ReceivedSpan], request_id: &str) -> Option<ReceivedSpan> {
    spans
        .iter()
        .find(|s| {
            s.name == "request"
                && s.attributes.get("request_id").map(String::as_str) == Some(request_id)
        })
        .cloned()
}

#[tokio::test]
async fn spans_reach_the_collector_and_the_trace_reaches_the_commands() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let collector = OtlpCollector::start().await?;
    let endpoint = collector.url();
    let server = Server::start_with("otlp", true, &["--otlp-endpoint", &endpoint]).await?;
    server.ensure_base(None).await?;

    // A create that continues the caller's trace.
    let caller = format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01");
    let sb = post(
        &server,
        "/v1/sandboxes",
        json!({"image": "base"}),
        &[("traceparent", &caller), ("x-request-id", "trace-create-1")],
    )
    .await?;
    let id = sb["id"].as_str().unwrap_or_default().to_string();

    // A command run under that trace sees it; one run without a caller's trace sees the
    // server's own, the trace of its request span.
    let echo = json!({"cmd": "echo $TRACEPARENT $DSEC_REQUEST_ID"});
    let path = format!("/v1/sandboxes/{id}/exec");
    let traced = post(&server, &path, echo.clone(), &[("traceparent", &caller)]).await?;
    let own = post(&server, &path, echo, &[("x-request-id", "trace-exec-2")]).await?;
    let traced_out = traced["stdout"].as_str().unwrap_or_default().to_string();
    let own_out = own["stdout"].as_str().unwrap_or_default().to_string();

    // The batch exporter sends within seconds.
    let spans = wait_until(Duration::from_secs(30), || {
        let spans = collector.spans();
        let done = request_span(&spans, "trace-create-1").is_some()
            && request_span(&spans, "trace-exec-2").is_some()
            && spans.iter().any(|s| s.name == "create_sandbox");
        async move { done.then_some(spans) }
    })
    .await;
    let Some(spans) = spans else {
        anyhow::bail!(
            "the collector did not get the spans: {:#?}\nserver log:\n{}",
            collector.spans(),
            server.log()
        );
    };
    assert!(
        spans.iter().all(|s| s.service == "dsec-serve"),
        "{spans:#?}"
    );

    // The create's request span is a child of the caller's span, in the caller's trace,
    // and the control plane's create span is its child, with the sandbox and phases.
    let create = request_span(&spans, "trace-create-1").expect("create request span");
    assert_eq!(create.trace_id, CALLER_TRACE, "{create:?}");
    assert_eq!(create.parent_span_id, CALLER_SPAN, "{create:?}");
    let inner = spans
        .iter()
        .find(|s| s.name == "create_sandbox" && s.trace_id == CALLER_TRACE)
        .expect("create_sandbox span in the caller's trace");
    assert_eq!(inner.parent_span_id, create.span_id, "{inner:?}");
    assert_eq!(inner.attributes.get("sandbox"), Some(&id), "{inner:?}");
    let phases = inner.attributes.get("phases").cloned().unwrap_or_default();
    assert!(phases.contains("init="), "{phases}");

    // The command under the caller's trace got a traceparent of that trace.
    let tp = traced_out.split_whitespace().next().unwrap_or_default();
    assert_eq!(
        dsec_telemetry::trace_id(tp),
        Some(CALLER_TRACE),
        "{traced_out:?}"
    );
    // The other got its request's trace (the server's own) and its request id.
    let exec = request_span(&spans, "trace-exec-2").expect("exec request span");
    assert!(exec.parent_span_id.is_empty(), "a root: {exec:?}");
    let mut words = own_out.split_whitespace();
    let (tp, rid) = (words.next().unwrap_or_default(), words.next());
    assert_eq!(
        dsec_telemetry::trace_id(tp),
        Some(exec.trace_id.as_str()),
        "{own_out:?}"
    );
    assert_eq!(rid, Some("trace-exec-2"));
    assert!(
        spans
            .iter()
            .any(|s| s.name == "exec" && s.trace_id == exec.trace_id),
        "the control plane's exec span: {spans:#?}"
    );
    server.delete_all().await;
    Ok(())
}

//! The model gateway's HTTP front in front of a fake OpenAI-compatible upstream (real
//! sockets on loopback): every route, streams passed through chunk by chunk, failover
//! past an upstream that cannot be reached, OpenAI-shaped errors for bad input, and a
//! caller that goes away mid-stream cutting the upstream request too.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dsec_gateway::{Gateway, GatewayConfig, ModelConfig, UpstreamConfig};
use dsec_testkit::openai::FakeOpenAi;
use futures::StreamExt;
use serde_json::{json, Value};

const KEY: &str = "gw-test-key";

struct Setup {
    fake: FakeOpenAi,
    base: String,
    client: reqwest::Client,
    _stop: tokio::sync::oneshot::Sender<()>,
}

fn upstream(url: String, model: Option<&str>) -> UpstreamConfig {
    UpstreamConfig {
        url,
        model: model.map(str::to_string),
        ..UpstreamConfig::default()
    }
}

async fn setup() -> Setup {
    let fake = FakeOpenAi::start(&["real-policy"])
        .await
        .expect("fake upstream");
    // A port nothing listens on: connecting fails at once.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = l.local_addr().expect("addr").port();
        drop(l);
        format!("http://127.0.0.1:{port}/v1")
    };
    let mut models = BTreeMap::new();
    models.insert(
        "policy".to_string(),
        ModelConfig {
            upstreams: vec![upstream(fake.url(), Some("real-policy"))],
        },
    );
    models.insert(
        "failover".to_string(),
        ModelConfig {
            upstreams: vec![upstream(dead, None), upstream(fake.url(), None)],
        },
    );
    let config = GatewayConfig {
        api_keys: vec![KEY.into()],
        models,
        max_body_bytes: 64 * 1024,
        connect_timeout_s: 2.0,
    };
    let gateway = Arc::new(Gateway::new(config).expect("gateway"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}/v1", listener.local_addr().expect("addr"));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(dsec_http::gateway::serve_gateway(
        listener,
        gateway,
        async move {
            let _ = stopped.await;
        },
    ));
    Setup {
        fake,
        base,
        client: reqwest::Client::new(),
        _stop: stop,
    }
}

impl Setup {
    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let resp = self
            .client
            .post(format!("{}{path}", self.base))
            .bearer_auth(KEY)
            .json(&body)
            .send()
            .await
            .expect("send");
        let status = resp.status().as_u16();
        (status, resp.json().await.expect("json answer"))
    }
}

fn chat(model: &str, prompt: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_pass_through_with_the_upstreams_name_and_key_kept_here() {
    let s = setup().await;
    let (status, r) = s
        .post("/chat/completions", chat("policy", "hello there"))
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["choices"][0]["message"]["content"], "echo: hello there");
    assert_eq!(
        s.fake.stats.last_model.lock().expect("lock").as_deref(),
        Some("real-policy"),
        "the upstream sees its own name for the model"
    );
    assert_eq!(
        *s.fake.stats.last_auth.lock().expect("lock"),
        None,
        "the caller's key never reaches the upstream"
    );

    let (status, r) = s
        .post("/completions", json!({"model": "policy", "prompt": "abc"}))
        .await;
    assert_eq!(
        (status, r["choices"][0]["text"].as_str()),
        (200, Some("echo: abc"))
    );
    let (status, r) = s
        .post(
            "/embeddings",
            json!({"model": "policy", "input": ["a", "b"], "encoding_format": "base64"}),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["data"].as_array().map(Vec::len), Some(2));
    assert!(
        r["data"][0]["embedding"].is_string(),
        "base64 passes through"
    );

    let models: Value = s
        .client
        .get(format!("{}/models", s.base))
        .bearer_auth(KEY)
        .send()
        .await
        .expect("models")
        .json()
        .await
        .expect("json");
    let ids: Vec<&str> = models["data"]
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, ["failover", "policy"]);

    // An upstream that cannot be connected to is skipped.
    for _ in 0..3 {
        let (status, r) = s.post("/chat/completions", chat("failover", "x")).await;
        assert_eq!(status, 200, "{r}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_arrives_chunk_by_chunk_and_a_caller_leaving_cuts_the_upstream() {
    let s = setup().await;
    let mut body = chat("policy", "one two three four [fake chunks=4 chunk_ms=150]");
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let resp = s
        .client
        .post(format!("{}/chat/completions", s.base))
        .bearer_auth(KEY)
        .json(&body)
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("text/event-stream")
    );
    // Chunks arrive as the upstream sends them, not all at the end.
    let start = Instant::now();
    let mut arrivals = Vec::new();
    let mut text = String::new();
    let mut chunks = resp.bytes_stream();
    while let Some(chunk) = chunks.next().await {
        text.push_str(&String::from_utf8_lossy(&chunk.expect("chunk")));
        arrivals.push(start.elapsed());
    }
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert!(text.contains("\"usage\":{"), "{text}");
    let spread = arrivals.last().copied().unwrap_or_default() - arrivals[0];
    assert!(
        arrivals.len() >= 3 && spread >= Duration::from_millis(300),
        "{} pieces over {spread:?}",
        arrivals.len()
    );
    assert_eq!(s.fake.stats.completed.load(Ordering::Relaxed), 1);

    // A caller that reads one piece and leaves: the upstream's stream is cut too.
    body["messages"][0]["content"] = json!("slow stream [fake chunks=20 chunk_ms=200]");
    let resp = s
        .client
        .post(format!("{}/chat/completions", s.base))
        .bearer_auth(KEY)
        .json(&body)
        .send()
        .await
        .expect("send");
    let mut chunks = resp.bytes_stream();
    chunks.next().await.expect("a first piece").expect("chunk");
    drop(chunks);
    let deadline = Instant::now() + Duration::from_secs(3);
    while s.fake.stats.cancelled.load(Ordering::Relaxed) == 0 {
        assert!(
            Instant::now() < deadline,
            "the upstream stream was never cut"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_openai_shaped_errors() {
    let s = setup().await;
    let send = |req: reqwest::RequestBuilder| async move {
        let resp = req.send().await.expect("send");
        let status = resp.status().as_u16();
        let body: Value = resp.json().await.expect("a JSON error");
        (status, body)
    };
    let url = format!("{}/chat/completions", s.base);
    let cases = [
        (
            s.client.post(&url).json(&chat("policy", "x")),
            401,
            "invalid_api_key",
        ),
        (
            s.client
                .post(&url)
                .bearer_auth("wrong")
                .json(&chat("policy", "x")),
            401,
            "invalid_api_key",
        ),
        (
            s.client
                .post(&url)
                .bearer_auth(KEY)
                .json(&chat("nope", "x")),
            404,
            "model_not_found",
        ),
        (
            s.client.post(&url).bearer_auth(KEY).body("{not json"),
            400,
            "",
        ),
        (
            s.client
                .post(&url)
                .bearer_auth(KEY)
                .json(&chat("policy", &"x".repeat(100 * 1024))),
            413,
            "",
        ),
        (
            s.client.get(format!("{}/nowhere", s.base)).bearer_auth(KEY),
            404,
            "unknown_url",
        ),
    ];
    for (req, want_status, want_code) in cases {
        let (status, body) = send(req).await;
        assert_eq!(status, want_status, "{body}");
        assert!(body["error"]["message"].is_string(), "{body}");
        assert!(body["error"]["type"].is_string(), "{body}");
        if !want_code.is_empty() {
            assert_eq!(body["error"]["code"], want_code, "{body}");
        }
    }
    // An upstream's own error passes through, status and body.
    let (status, body) = s
        .post("/chat/completions", chat("policy", "[fake fail=503]"))
        .await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "fake_failure");
    assert_eq!(
        s.fake.stats.total(),
        1,
        "only the last request reached the upstream"
    );
}

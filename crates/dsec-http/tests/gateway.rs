//! The model gateway's HTTP front in front of a fake OpenAI-compatible upstream (real
//! sockets on loopback): every route, streams passed through chunk by chunk, failover
//! past an upstream that cannot be reached, OpenAI-shaped errors for bad input, a
//! caller that goes away mid-stream cutting the upstream request too, and the limits of
//! caller keys (429s with their retry headers, the concurrency cap, time limits), and
//! the response cache with the coalescing of identical requests, and sandbox tokens
//! granted by a token authority (their models, their budget).

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dsec_gateway::{
    ApiKey, Gateway, GatewayConfig, Grant, Limits, ModelConfig, TokenAuthority, TokenError,
    UpstreamConfig,
};
use dsec_testkit::openai::FakeOpenAi;
use futures::StreamExt;
use serde_json::{json, Value};

const KEY: &str = "gw-test-key";

struct Setup {
    fake: FakeOpenAi,
    gateway: Arc<Gateway>,
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
    setup_with(Vec::new()).await
}

/// A key with `limits`.
fn limited(key: &str, limits: Limits) -> ApiKey {
    ApiKey {
        key: key.into(),
        name: Some(key.into()),
        limits,
    }
}

/// The gateway with [`KEY`] and `keys`.
async fn setup_with(keys: Vec<ApiKey>) -> Setup {
    setup_full(keys, None).await
}

/// One sandbox token, `sandbox-token`, with `grant`.
#[derive(Debug)]
struct OneToken(Grant);

impl TokenAuthority for OneToken {
    fn grant(&self, bearer: &str) -> Result<Grant, TokenError> {
        if bearer == "sandbox-token" {
            Ok(self.0.clone())
        } else {
            Err(TokenError::Unknown)
        }
    }

    fn is_live(&self, token_id: &str) -> bool {
        token_id == self.0.id
    }
}

/// The gateway with [`KEY`] and `keys`, and sandbox tokens from `authority`.
async fn setup_full(keys: Vec<ApiKey>, authority: Option<Arc<dyn TokenAuthority>>) -> Setup {
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
    let mut api_keys = vec![ApiKey::from(KEY)];
    api_keys.extend(keys);
    let config = GatewayConfig {
        api_keys,
        models,
        max_body_bytes: 64 * 1024,
        connect_timeout_s: 2.0,
        ..GatewayConfig::default()
    };
    let mut gateway = Gateway::new(config).expect("gateway");
    if let Some(authority) = authority {
        gateway = gateway.with_authority(authority);
    }
    let gateway = Arc::new(gateway);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}/v1", listener.local_addr().expect("addr"));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(dsec_http::gateway::serve_gateway(
        listener,
        gateway.clone(),
        async move {
            let _ = stopped.await;
        },
    ));
    Setup {
        fake,
        gateway,
        base,
        client: reqwest::Client::new(),
        _stop: stop,
    }
}

impl Setup {
    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let (status, _, body) = self.post_as(KEY, path, body).await;
        (status, body)
    }

    /// Posts `body` with `key`: the status, the headers and the JSON answer.
    async fn post_as(
        &self,
        key: &str,
        path: &str,
        body: Value,
    ) -> (u16, reqwest::header::HeaderMap, Value) {
        let resp = self
            .client
            .post(format!("{}{path}", self.base))
            .bearer_auth(key)
            .json(&body)
            .send()
            .await
            .expect("send");
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        (status, headers, resp.json().await.expect("json answer"))
    }

    /// Posts a streamed chat with `key`: the status and the whole SSE text.
    async fn stream_as(&self, key: &str, mut body: Value) -> (u16, String) {
        body["stream"] = json!(true);
        let resp = self
            .client
            .post(format!("{}/chat/completions", self.base))
            .bearer_auth(key)
            .json(&body)
            .send()
            .await
            .expect("send");
        let status = resp.status().as_u16();
        (status, resp.text().await.expect("the stream"))
    }
}

fn header<'a>(headers: &'a reqwest::header::HeaderMap, name: &str) -> &'a str {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
}

/// Waits until `cond` holds, failing after `secs` seconds.
async fn wait_until(secs: u64, what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !cond() {
        assert!(Instant::now() < deadline, "never happened: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
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

    // An upstream that cannot be connected to is skipped (distinct prompts: none is
    // answered from the cache).
    for i in 0..3 {
        let (status, r) = s
            .post("/chat/completions", chat("failover", &format!("x{i}")))
            .await;
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
    wait_until(3, "the upstream stream cut", || {
        s.fake.stats.cancelled.load(Ordering::Relaxed) > 0
    })
    .await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_a_rate_limit_the_answer_is_a_429_with_both_retry_headers() {
    let s = setup_with(vec![
        limited(
            "rpm",
            Limits {
                rpm: Some(60),
                burst: Some(1),
                ..Limits::default()
            },
        ),
        limited(
            "tpm",
            Limits {
                tpm: Some(10),
                ..Limits::default()
            },
        ),
    ])
    .await;
    let (status, _, r) = s
        .post_as("rpm", "/chat/completions", chat("policy", "x"))
        .await;
    assert_eq!(status, 200, "{r}");
    let (status, headers, r) = s
        .post_as("rpm", "/chat/completions", chat("policy", "x"))
        .await;
    assert_eq!(status, 429, "{r}");
    assert_eq!(r["error"]["code"], "rate_limit_exceeded", "{r}");
    assert_eq!(r["error"]["type"], "requests", "{r}");
    assert_eq!(header(&headers, "retry-after"), "1");
    let ms: u64 = header(&headers, "retry-after-ms").parse().expect("ms");
    assert!((1..=1000).contains(&ms), "one request a second: {ms} ms");
    // Other keys are not affected.
    let (status, r) = s.post("/chat/completions", chat("policy", "x")).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(
        s.fake.stats.total(),
        2,
        "a refused request never went upstream"
    );

    // Tokens are charged after the call, from its usage: this one costs more than the
    // 10 a minute the key has, so the next waits, and longer than the 60 s a 429 asks.
    let (status, _, r) = s
        .post_as(
            "tpm",
            "/chat/completions",
            chat("policy", &"word ".repeat(100)),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    let (status, headers, r) = s
        .post_as("tpm", "/chat/completions", chat("policy", "x"))
        .await;
    assert_eq!(status, 429, "{r}");
    assert_eq!(
        (r["error"]["type"].as_str(), r["error"]["code"].as_str()),
        (Some("tokens"), Some("rate_limit_exceeded"))
    );
    assert_eq!(header(&headers, "retry-after"), "60");
    assert_eq!(header(&headers, "retry-after-ms"), "60000");
    let stats = s.gateway.stats();
    assert_eq!((stats.limited_requests, stats.limited_tokens), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_is_charged_from_a_usage_chunk_the_caller_never_sees() {
    let s = setup_with(vec![limited(
        "tpm",
        Limits {
            tpm: Some(10),
            ..Limits::default()
        },
    )])
    .await;
    let (status, text) = s
        .stream_as(
            "tpm",
            chat("policy", "one two three four five [fake chunks=3]"),
        )
        .await;
    assert_eq!(status, 200, "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert!(text.contains("echo"), "{text}");
    assert!(
        !text.contains("\"choices\":[]") && !text.contains("\"total_tokens\""),
        "the usage chunk the gateway asked for is not passed on: {text}"
    );
    let (status, _, r) = s
        .post_as("tpm", "/chat/completions", chat("policy", "x"))
        .await;
    assert_eq!(status, 429, "the stream's usage was charged: {r}");
    assert_eq!(r["error"]["type"], "tokens");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_concurrency_cap_holds_at_the_upstream() {
    let s = setup_with(vec![limited(
        "two",
        Limits {
            max_concurrency: Some(2),
            ..Limits::default()
        },
    )])
    .await;
    let s = Arc::new(s);
    let mut calls = Vec::new();
    for i in 0..5 {
        let s = s.clone();
        calls.push(tokio::spawn(async move {
            let body = chat("policy", &format!("call {i} [fake latency_ms=300]"));
            let mut refused = 0;
            loop {
                let (status, headers, r) =
                    s.post_as("two", "/chat/completions", body.clone()).await;
                match status {
                    200 => return refused,
                    429 => {
                        assert_eq!(r["error"]["code"], "rate_limit_exceeded", "{r}");
                        let ms: u64 = header(&headers, "retry-after-ms").parse().expect("ms");
                        assert!(ms > 0 && !header(&headers, "retry-after").is_empty());
                        refused += 1;
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                    }
                    other => panic!("{other}: {r}"),
                }
            }
        }));
    }
    let mut refused = 0;
    for c in calls {
        refused += c.await.expect("call");
    }
    assert_eq!(s.fake.stats.count("/v1/chat/completions"), 5);
    assert_eq!(
        s.fake.stats.max_in_flight.load(Ordering::Relaxed),
        2,
        "never more than 2 at once at the upstream"
    );
    assert!(refused >= 1, "5 at once over a cap of 2");
    assert_eq!(s.gateway.stats().limited_concurrency, refused);
    // Every permit came back: two at once still pass.
    let (a, b) = tokio::join!(
        s.post_as("two", "/chat/completions", chat("policy", "a")),
        s.post_as("two", "/chat/completions", chat("policy", "b"))
    );
    assert_eq!((a.0, b.0), (200, 200));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_over_its_time_limit_answers_504_or_ends_its_stream_with_an_error() {
    let s = setup_with(vec![limited(
        "quick",
        Limits {
            timeout_s: Some(0.5),
            max_concurrency: Some(1),
            ..Limits::default()
        },
    )])
    .await;
    let start = Instant::now();
    let (status, headers, r) = s
        .post_as(
            "quick",
            "/chat/completions",
            chat("policy", "[fake latency_ms=10000]"),
        )
        .await;
    assert_eq!(status, 504, "{r}");
    assert_eq!(r["error"]["code"], "timeout", "{r}");
    assert_eq!(header(&headers, "x-should-retry"), "false");
    assert!(
        start.elapsed() < Duration::from_secs(8),
        "{:?}",
        start.elapsed()
    );

    // Once streaming, the stream ends with an SSE error event (no [DONE]), and the
    // upstream's stream is cut.
    let (status, text) = s
        .stream_as(
            "quick",
            chat("policy", "slow [fake chunks=50 chunk_ms=100]"),
        )
        .await;
    assert_eq!(status, 200, "{text}");
    let last = text.trim_end().rsplit("\n\n").next().unwrap_or_default();
    assert!(last.starts_with("data: {\"error\""), "{text}");
    assert!(last.contains("\"code\":\"timeout\""), "{text}");
    assert!(!text.contains("[DONE]"), "{text}");
    wait_until(3, "the upstream stream cut", || {
        s.fake.stats.cancelled.load(Ordering::Relaxed) > 0
    })
    .await;
    assert_eq!(s.gateway.stats().timed_out, 2);
    // The permit of each came back (max_concurrency 1).
    let (status, _, r) = s
        .post_as("quick", "/chat/completions", chat("policy", "x"))
        .await;
    assert_eq!(status, 200, "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deterministic_requests_are_cached_and_identical_ones_share_one_call() {
    let s = setup_with(vec![
        limited("other", Limits::default()),
        limited(
            "tpm30",
            Limits {
                tpm: Some(30),
                ..Limits::default()
            },
        ),
        limited(
            "rpm2",
            Limits {
                rpm: Some(2),
                ..Limits::default()
            },
        ),
    ])
    .await;
    let chats = || s.fake.stats.count("/v1/chat/completions");
    let ask = |key: &'static str, body: Value| {
        let s = &s;
        async move {
            let (status, headers, r) = s.post_as(key, "/chat/completions", body).await;
            assert_eq!(status, 200, "{r}");
            (header(&headers, "x-dsec-cache").to_string(), r)
        }
    };
    let (used, first) = ask(KEY, chat("policy", "cache me")).await;
    assert_eq!((used.as_str(), chats()), ("miss", 1));
    // The same request, its fields in another order, with `user` and `stream: false`.
    let same = json!({"stream": false, "user": "u", "temperature": 0.0,
        "messages": [{"content": "cache me", "role": "user"}], "model": "policy"});
    let (used, second) = ask(KEY, same).await;
    assert_eq!((used.as_str(), chats()), ("hit", 1));
    assert_eq!(first, second);
    // Opted out, not deterministic, streamed, or another caller: upstream.
    let resp = s
        .client
        .post(format!("{}/chat/completions", s.base))
        .bearer_auth(KEY)
        .header("cache-control", "no-cache")
        .json(&chat("policy", "cache me"))
        .send()
        .await
        .expect("send");
    assert_eq!(header(resp.headers(), "x-dsec-cache"), "bypass");
    assert_eq!(chats(), 2);
    let mut warm = chat("policy", "cache me");
    warm["temperature"] = json!(0.7);
    assert_eq!(ask(KEY, warm).await.0, "bypass");
    let (status, text) = s.stream_as(KEY, chat("policy", "cache me")).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(ask("other", chat("policy", "cache me")).await.0, "miss");
    assert_eq!(chats(), 5);
    // Embeddings are deterministic: cached too.
    let emb = json!({"model": "policy", "input": ["a"], "encoding_format": "float"});
    let (s1, h1, e1) = s.post_as(KEY, "/embeddings", emb.clone()).await;
    let (s2, h2, e2) = s.post_as(KEY, "/embeddings", emb).await;
    assert_eq!((s1, s2), (200, 200));
    assert_eq!(
        (header(&h1, "x-dsec-cache"), header(&h2, "x-dsec-cache")),
        ("miss", "hit")
    );
    assert_eq!(e1, e2);
    assert_eq!(s.fake.stats.count("/v1/embeddings"), 1);

    // A hit costs no tokens: a key with 30 a minute asks a 5-token answer once, then
    // ten times from the cache, and is still not in debt.
    assert_eq!(ask("tpm30", chat("policy", "cache me")).await.0, "miss");
    for _ in 0..10 {
        assert_eq!(ask("tpm30", chat("policy", "cache me")).await.0, "hit");
    }
    assert_eq!(ask("tpm30", chat("policy", "fresh")).await.0, "miss");

    // A hit counts against the requests per minute.
    assert_eq!(ask("rpm2", chat("policy", "r")).await.0, "miss");
    assert_eq!(ask("rpm2", chat("policy", "r")).await.0, "hit");
    let (status, _, r) = s
        .post_as("rpm2", "/chat/completions", chat("policy", "r"))
        .await;
    assert_eq!(status, 429, "{r}");

    // Ten identical requests at once: one call upstream.
    let before = chats();
    let slow = chat("policy", "together [fake latency_ms=500]");
    let answers = futures::future::join_all((0..10).map(|_| ask(KEY, slow.clone()))).await;
    assert_eq!(chats(), before + 1);
    let kinds: Vec<&str> = answers.iter().map(|(u, _)| u.as_str()).collect();
    assert_eq!(
        kinds.iter().filter(|k| **k == "miss").count(),
        1,
        "{kinds:?}"
    );
    assert!(
        kinds
            .iter()
            .all(|k| matches!(*k, "miss" | "coalesced" | "hit")),
        "{kinds:?}"
    );
    assert!(answers.iter().all(|(_, r)| *r == answers[0].1));

    let metrics = s
        .client
        .get(format!("{}/metrics", s.base.trim_end_matches("/v1")))
        .bearer_auth(KEY)
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    let stats = s.gateway.stats().cache;
    assert!(stats.hits >= 3 && stats.misses >= 4, "{stats:?}");
    assert!(
        metrics.contains(&format!(
            "dsec_gateway_cache_total{{result=\"hit\"}} {}",
            stats.hits
        )),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_call_ends_when_every_caller_waiting_on_it_has_gone() {
    let s = setup().await;
    let body = chat("policy", "abandoned [fake latency_ms=30000]");
    let send = || {
        let req = s
            .client
            .post(format!("{}/chat/completions", s.base))
            .bearer_auth(KEY)
            .json(&body);
        tokio::spawn(async move { req.send().await })
    };
    let (a, b) = (send(), send());
    wait_until(5, "one call upstream, both requests on it", || {
        let c = s.gateway.stats().cache;
        c.misses == 1 && c.coalesced == 1 && s.fake.stats.in_flight.load(Ordering::Relaxed) == 1
    })
    .await;
    // The first caller leaves: the call goes on for the second.
    a.abort();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(s.fake.stats.in_flight.load(Ordering::Relaxed), 1);
    // The second leaves too: the call upstream is closed.
    b.abort();
    wait_until(5, "the upstream call closed", || {
        s.fake.stats.in_flight.load(Ordering::Relaxed) == 0
    })
    .await;
    assert_eq!(s.fake.stats.count("/v1/chat/completions"), 1, "one call");
    // The flight is gone: the same request now starts a call of its own.
    let c = send();
    wait_until(5, "a second call upstream", || {
        s.fake.stats.count("/v1/chat/completions") == 2
    })
    .await;
    c.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_token_calls_its_models_until_its_budget_is_spent() {
    let grant = Grant {
        id: "tok1".into(),
        name: "acme/sb-1".into(),
        models: Some(vec!["policy".into()]),
        budget_tokens: Some(30),
        ..Grant::default()
    };
    let s = setup_full(Vec::new(), Some(Arc::new(OneToken(grant)))).await;
    let tok = "sandbox-token";
    let get = |path: &str, key: &str| {
        let req = s
            .client
            .get(format!("{}{path}", s.base.trim_end_matches("/v1")))
            .bearer_auth(key);
        async move {
            let resp = req.send().await.expect("send");
            (resp.status().as_u16(), resp.text().await.expect("text"))
        }
    };
    let (status, list) = get("/v1/models", tok).await;
    assert_eq!(status, 200);
    let list: Value = serde_json::from_str(&list).expect("json");
    assert_eq!(list["data"].as_array().map(Vec::len), Some(1), "{list}");
    assert_eq!(list["data"][0]["id"], "policy");
    assert_eq!(get("/v1/models/failover", tok).await.0, 404);
    let (status, _, r) = s
        .post_as(tok, "/chat/completions", chat("failover", "x"))
        .await;
    assert_eq!(
        (status, r["error"]["code"].as_str()),
        (404, Some("model_not_found"))
    );
    assert_eq!(
        get("/metrics", tok).await.0,
        403,
        "the counters are the operator's"
    );

    // 20 words of prompt and 21 of answer: past the budget of 30 in one call (its
    // completion clamped to 30 tokens, which the fake ignores).
    let (status, _, r) = s
        .post_as(tok, "/chat/completions", chat("policy", &"w ".repeat(20)))
        .await;
    assert_eq!(status, 200, "{r}");
    let calls = s.fake.stats.total();
    let (status, headers, r) = s
        .post_as(tok, "/chat/completions", chat("policy", "more"))
        .await;
    assert_eq!(status, 429, "{r}");
    assert_eq!(
        (r["error"]["type"].as_str(), r["error"]["code"].as_str()),
        (Some("insufficient_quota"), Some("insufficient_quota"))
    );
    assert_eq!(header(&headers, "x-should-retry"), "false");
    assert_eq!(header(&headers, "retry-after"), "");
    assert_eq!(s.fake.stats.total(), calls, "not sent upstream");
    // The operator's key is another caller.
    assert_eq!(
        s.post("/chat/completions", chat("policy", "more")).await.0,
        200
    );
    let (status, metrics) = get("/metrics", KEY).await;
    assert_eq!(status, 200);
    assert!(
        metrics.contains("dsec_gateway_limited_total{limit=\"budget\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("dsec_gateway_token_callers 1"),
        "{metrics}"
    );
}

/// The value of the sample `series` (name and labels) in Prometheus text.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_have_latency_histograms_and_usage_is_per_caller() {
    let grant = Grant {
        id: "tok1".into(),
        name: "acme/sb-1".into(),
        budget_tokens: Some(10_000),
        ..Grant::default()
    };
    let s = setup_full(Vec::new(), Some(Arc::new(OneToken(grant)))).await;
    let tok = "sandbox-token";
    let get = |path: &str, key: &str| {
        let req = s
            .client
            .get(format!("{}{path}", s.base.trim_end_matches("/v1")))
            .bearer_auth(key);
        async move {
            let resp = req.send().await.expect("send");
            (resp.status().as_u16(), resp.text().await.expect("text"))
        }
    };
    let own = |text: String| -> Value { serde_json::from_str(&text).expect("json") };

    let (status, first) = get("/v1/usage", tok).await;
    assert_eq!(status, 200, "{first}");
    let first = own(first);
    assert_eq!(
        (first["caller"].as_str(), first["requests"].as_u64()),
        (Some("acme/sb-1"), Some(0))
    );
    assert_eq!(first["budget_left"], 10_000);

    // Two calls and a stream as the token, one call as the operator.
    for prompt in ["a b c", "d e"] {
        let (status, _, r) = s
            .post_as(tok, "/chat/completions", chat("policy", prompt))
            .await;
        assert_eq!(status, 200, "{r}");
    }
    let (status, text) = s.stream_as(tok, chat("policy", "f g h")).await;
    assert_eq!(status, 200);
    assert!(text.contains("[DONE]"), "{text}");
    let (status, r) = s.post("/chat/completions", chat("policy", "x")).await;
    assert_eq!(status, 200, "{r}");

    // A sandbox token sees only its own usage, its budget going down.
    let (status, mine) = get("/v1/usage?caller=gw-test", tok).await;
    assert_eq!(status, 200);
    let mine = own(mine);
    assert_eq!(mine["caller"], "acme/sb-1");
    assert_eq!(mine["kind"], "token");
    assert_eq!(mine["requests"], 3);
    assert!(mine["prompt_tokens"].as_u64() > Some(0), "{mine}");
    assert!(mine["completion_tokens"].as_u64() > Some(0), "{mine}");
    let spent = mine["spent_tokens"].as_u64().expect("spent");
    assert!(spent > 0);
    assert_eq!(mine["budget_left"].as_u64(), Some(10_000 - spent));
    assert!(mine["data"].is_null(), "not the list: {mine}");

    // The operator sees every caller, or the one it names.
    let (status, all) = get("/v1/usage", KEY).await;
    assert_eq!(status, 200);
    let all = own(all);
    let data = all["data"].as_array().expect("list");
    assert_eq!(data.len(), 2, "{all}");
    assert_eq!(data[0]["kind"], "key");
    assert_eq!(data[0]["requests"], 1);
    assert_eq!(data[0]["budget_left"], Value::Null);
    assert_eq!(data[1]["caller"], "acme/sb-1");
    let (_, named) = get("/v1/usage?caller=tok1", KEY).await;
    let named = own(named);
    assert_eq!(named["data"].as_array().map(Vec::len), Some(1), "{named}");
    assert_eq!(named["data"][0]["token_id"], "tok1");
    assert_eq!(get("/v1/usage", "nobody").await.0, 401);
    let (status, tenants) = get("/v1/usage/tenants", KEY).await;
    assert_eq!(status, 200, "{tenants}");
    assert_eq!(own(tenants)["object"], "list");
    assert_eq!(get("/v1/usage/tenants", tok).await.0, 403, "operators only");

    // Metrics: counts per model and route that match the calls.
    let (status, m) = get("/metrics", KEY).await;
    assert_eq!(status, 200);
    let l = "model=\"policy\",route=\"chat_completions\"";
    assert_eq!(
        sample(
            &m,
            &format!("dsec_gateway_requests_total{{{l},code=\"2xx\"}}")
        ),
        Some(4.0),
        "{m}"
    );
    let d = "dsec_gateway_request_duration_seconds";
    assert_eq!(sample(&m, &format!("{d}_count{{{l}}}")), Some(4.0), "{m}");
    assert_eq!(
        sample(&m, &format!("{d}_bucket{{{l},le=\"+Inf\"}}")),
        Some(4.0)
    );
    assert!(sample(&m, &format!("{d}_sum{{{l}}}")) > Some(0.0));
    let t = "dsec_gateway_ttft_seconds";
    assert_eq!(
        sample(&m, &format!("{t}_count{{model=\"policy\"}}")),
        Some(1.0),
        "one stream: {m}"
    );
    assert_eq!(
        sample(&m, &format!("{t}_bucket{{model=\"policy\",le=\"+Inf\"}}")),
        Some(1.0)
    );
    let prompt = |v: &Value| v["prompt_tokens"].as_u64().unwrap_or(0);
    let completion = |v: &Value| v["completion_tokens"].as_u64().unwrap_or(0);
    assert_eq!(
        sample(
            &m,
            "dsec_gateway_tokens_total{model=\"policy\",dir=\"prompt\"}"
        ),
        Some((prompt(&data[0]) + prompt(&data[1])) as f64)
    );
    assert_eq!(
        sample(
            &m,
            "dsec_gateway_tokens_total{model=\"policy\",dir=\"completion\"}"
        ),
        Some((completion(&data[0]) + completion(&data[1])) as f64)
    );
    // No requests for "failover": no series for it but its tokens (zero).
    assert!(!m.contains("route=\"embeddings\""), "{m}");
    // Each upstream's health: in rotation, nothing in flight, no errors yet.
    let up = format!(
        "model=\"policy\",upstream=\"{}\"",
        s.fake.url().trim_end_matches('/')
    );
    assert_eq!(
        sample(&m, &format!("dsec_gateway_upstream_healthy{{{up}}}")),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        sample(&m, &format!("dsec_gateway_upstream_in_flight{{{up}}}")),
        Some(0.0)
    );
    assert_eq!(
        sample(
            &m,
            &format!("dsec_gateway_upstream_errors_total{{{up},kind=\"connect\"}}")
        ),
        Some(0.0)
    );
    let types: Vec<&str> = m.lines().filter(|l| l.starts_with("# TYPE")).collect();
    let mut unique = types.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(types.len(), unique.len(), "each family declared once");
}

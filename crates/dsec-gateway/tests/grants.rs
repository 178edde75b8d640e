//! Sandbox tokens: callers granted by a [`TokenAuthority`] (here an in-memory map) in
//! front of the fake OpenAI upstream, through [`Gateway::handle`]: the token works and
//! stops working when forgotten, its callers are swept, its models are its only ones,
//! its limits are its own, and its budget is spent, clamped and then refused.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use dsec_gateway::limits::Clock;
use dsec_gateway::{
    openai, CallOptions, Gateway, GatewayConfig, Grant, LedgerError, Limits, ModelConfig, Reply,
    ReplyBody, Route, SpendLedger, TokenAuthority, TokenError, UpstreamConfig,
};
use dsec_testkit::openai::FakeOpenAi;
use futures::future::BoxFuture;
use futures::StreamExt;
use serde_json::{json, Value};

const KEY: &str = "operator-key";

/// Grants by bearer (`secret-<id>`).
#[derive(Debug, Default)]
struct Authority {
    grants: Mutex<HashMap<String, Grant>>,
    stale: AtomicBool,
}

impl Authority {
    fn add(&self, grant: Grant) -> String {
        let bearer = format!("secret-{}", grant.id);
        self.grants
            .lock()
            .expect("lock")
            .insert(bearer.clone(), grant);
        bearer
    }

    fn forget(&self, id: &str) {
        self.grants
            .lock()
            .expect("lock")
            .remove(&format!("secret-{id}"));
    }
}

impl TokenAuthority for Authority {
    fn grant(&self, bearer: &str) -> Result<Grant, TokenError> {
        if self.stale.load(Ordering::SeqCst) {
            return Err(TokenError::Unavailable("the store is out of reach".into()));
        }
        let grants = self.grants.lock().expect("lock");
        let grant = grants.get(bearer).cloned().ok_or(TokenError::Unknown)?;
        if grant.name.starts_with("disabled/") {
            return Err(TokenError::Denied("its tenant is disabled".into()));
        }
        Ok(grant)
    }

    fn is_live(&self, token_id: &str) -> bool {
        self.grants
            .lock()
            .expect("lock")
            .contains_key(&format!("secret-{token_id}"))
    }
}

fn grant(id: &str, models: Option<&[&str]>) -> Grant {
    Grant {
        id: id.into(),
        name: format!("tenant/{id}"),
        models: models.map(|m| m.iter().map(|s| s.to_string()).collect()),
        ..Grant::default()
    }
}

struct Setup {
    fake: FakeOpenAi,
    gateway: Gateway,
    authority: Arc<Authority>,
    ms: Arc<AtomicU64>,
}

async fn setup() -> Setup {
    setup_with(Limits::default()).await
}

/// The gateway with `default_limits`.
async fn setup_with(default_limits: Limits) -> Setup {
    setup_config(GatewayConfig {
        default_limits,
        ..GatewayConfig::default()
    })
    .await
}

/// The gateway with `config`'s limits (its keys and models are the test's).
async fn setup_config(limits: GatewayConfig) -> Setup {
    let fake = FakeOpenAi::start(&["policy", "other"])
        .await
        .expect("fake upstream");
    let mut models = BTreeMap::new();
    for m in ["policy", "other"] {
        models.insert(
            m.to_string(),
            ModelConfig {
                upstreams: vec![UpstreamConfig {
                    url: fake.url(),
                    ..UpstreamConfig::default()
                }],
            },
        );
    }
    let config = GatewayConfig {
        api_keys: vec![KEY.into()],
        models,
        ..limits
    };
    let ms = Arc::new(AtomicU64::new(1_000_000));
    let at = ms.clone();
    let clock: Clock = Arc::new(move || Duration::from_millis(at.load(Ordering::SeqCst)));
    let authority = Arc::new(Authority::default());
    let gateway = Gateway::with_clock(config, clock)
        .expect("gateway")
        .with_authority(authority.clone());
    Setup {
        fake,
        gateway,
        authority,
        ms,
    }
}

fn chat(model: &str, prompt: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": prompt}]})
}

type Headers = Vec<(String, String)>;

fn header<'a>(headers: &'a Headers, name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

/// The whole body of a reply, a stream read to its end.
async fn body_of(r: Reply) -> Bytes {
    match r.body {
        ReplyBody::Full(b) => b,
        ReplyBody::Stream(mut s) => {
            let mut all = Vec::new();
            while let Some(piece) = s.next().await {
                all.extend_from_slice(&piece.expect("piece"));
            }
            Bytes::from(all)
        }
    }
}

impl Setup {
    /// A chat with `body` as `bearer`: the reply.
    async fn handle(&self, bearer: &str, body: Value) -> Reply {
        self.gateway
            .handle(
                Some(bearer),
                Route::ChatCompletions,
                Bytes::from(body.to_string()),
                CallOptions::default(),
            )
            .await
    }

    /// A chat with `body` as `bearer`: the status, the JSON answer (null for a stream)
    /// and the headers.
    async fn call(&self, bearer: &str, body: Value) -> (u16, Value, Headers) {
        let r = self.handle(bearer, body).await;
        let (status, headers) = (r.status, r.headers.clone());
        let value = serde_json::from_slice(&body_of(r).await).unwrap_or(Value::Null);
        (status, value, headers)
    }

    fn chats(&self) -> u64 {
        self.fake.stats.count("/v1/chat/completions")
    }

    fn last_body(&self) -> Value {
        self.fake
            .stats
            .last_body
            .lock()
            .expect("lock")
            .clone()
            .unwrap_or_default()
    }

    fn tick(&self, d: Duration) {
        self.ms.fetch_add(d.as_millis() as u64, Ordering::SeqCst);
    }
}

fn model_ids(r: Reply) -> Vec<String> {
    let ReplyBody::Full(b) = r.body else {
        panic!("a list is whole");
    };
    let v: Value = serde_json::from_slice(&b).expect("json");
    v["data"]
        .as_array()
        .expect("data")
        .iter()
        .filter_map(|m| m["id"].as_str().map(str::to_string))
        .collect()
}

#[tokio::test]
async fn a_token_calls_while_its_authority_knows_it() {
    let s = setup().await;
    let tok = s.authority.add(grant("a", None));
    let (status, r, _) = s.call(&tok, chat("policy", "hi")).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["choices"][0]["message"]["content"], "echo: hi");
    assert_eq!(s.gateway.token_callers(), 1);
    // Configured keys still work first; an unknown bearer is a 401.
    assert_eq!(s.call(KEY, chat("policy", "hi")).await.0, 200);
    let (status, r, _) = s.call("secret-nobody", chat("policy", "hi")).await;
    assert_eq!(
        (status, r["error"]["code"].as_str()),
        (401, Some("invalid_api_key"))
    );

    // A token only known while the store is out of reach: 503, which SDKs retry; a
    // disabled tenant's: 403.
    s.authority.stale.store(true, Ordering::SeqCst);
    let (status, r, _) = s.call(&tok, chat("policy", "hi")).await;
    assert_eq!(status, 503, "{r}");
    s.authority.stale.store(false, Ordering::SeqCst);
    let off = s.authority.add(grant("b", None));
    s.authority.add(Grant {
        name: "disabled/b".into(),
        ..grant("b", None)
    });
    let (status, r, _) = s.call(&off, chat("policy", "hi")).await;
    assert_eq!(
        (status, r["error"]["code"].as_str()),
        (403, Some("permission_denied"))
    );

    // The operator's counters are not a sandbox's to read.
    assert!(s.gateway.authorize(Some(KEY)).is_ok());
    assert_eq!(
        s.gateway.authorize(Some(&tok)).map_err(|r| r.status),
        Err(403)
    );
    assert_eq!(
        s.gateway.authorize(Some("x")).map_err(|r| r.status),
        Err(401)
    );

    // Revoked (its sandbox deleted): 401 at once, and its caller is swept out.
    s.authority.forget("a");
    let before = s.chats();
    let (status, r, _) = s.call(&tok, chat("policy", "hi")).await;
    assert_eq!(
        (status, r["error"]["code"].as_str()),
        (401, Some("invalid_api_key"))
    );
    assert_eq!(s.chats(), before);
    s.tick(Duration::from_secs(1));
    let _ = s.call(&tok, chat("policy", "hi")).await;
    assert_eq!(s.gateway.token_callers(), 0, "its caller was dropped");
    assert_eq!(s.gateway.stats().token_callers, 0);
}

#[tokio::test]
async fn a_token_calls_only_its_models_and_sees_only_them() {
    let s = setup().await;
    let tok = s.authority.add(grant("a", Some(&["policy", "gone"])));
    assert_eq!(s.call(&tok, chat("policy", "hi")).await.0, 200);
    // A model it was not given answers exactly as one that does not exist, before any
    // limit or upstream.
    let before = s.chats();
    let r = s.handle(&tok, chat("other", "hi")).await;
    let want = openai::model_not_found("other");
    assert_eq!(r.status, 404);
    assert_eq!(r.headers, want.headers);
    assert_eq!(body_of(r).await, body_of(want).await);
    let unknown = s.handle(&tok, chat("nope", "hi")).await;
    assert_eq!(
        body_of(unknown).await,
        body_of(openai::model_not_found("nope")).await
    );
    assert_eq!(s.chats(), before, "nothing went upstream");

    // The list is what it may call and the configuration serves ("gone" is not).
    assert_eq!(model_ids(s.gateway.list_models(Some(&tok))), ["policy"]);
    assert_eq!(
        model_ids(s.gateway.list_models(Some(KEY))),
        ["other", "policy"]
    );
    let all = s.authority.add(grant("all", None));
    assert_eq!(
        model_ids(s.gateway.list_models(Some(&all))),
        ["other", "policy"]
    );
    assert_eq!(s.gateway.get_model(Some(&tok), "policy").status, 200);
    let r = s.gateway.get_model(Some(&tok), "other");
    assert_eq!(r.status, 404);
    assert_eq!(
        body_of(r).await,
        body_of(openai::model_not_found("other")).await
    );
    assert_eq!(s.gateway.list_models(Some("nobody")).status, 401);
}

#[tokio::test]
async fn a_tokens_rate_limit_is_its_own() {
    let s = setup().await;
    let slow = s.authority.add(Grant {
        limits: Limits {
            rpm: Some(1),
            ..Limits::default()
        },
        ..grant("slow", None)
    });
    let free = s.authority.add(grant("free", None));
    assert_eq!(s.call(&slow, chat("policy", "1")).await.0, 200);
    let (status, r, reply) = s.call(&slow, chat("policy", "2")).await;
    assert_eq!(
        (status, r["error"]["code"].as_str()),
        (429, Some("rate_limit_exceeded"))
    );
    assert_eq!(header(&reply, "retry-after"), Some("60"));
    for i in 0..5 {
        assert_eq!(s.call(&free, chat("policy", &i.to_string())).await.0, 200);
    }
    assert_eq!(s.call(KEY, chat("policy", "k")).await.0, 200);
    s.tick(Duration::from_secs(60));
    assert_eq!(s.call(&slow, chat("policy", "3")).await.0, 200, "refilled");
    assert_eq!(s.gateway.stats().limited_requests, 1);
}

#[tokio::test]
async fn what_a_grant_leaves_unset_comes_from_the_default_limits() {
    let s = setup_with(Limits {
        rpm: Some(1),
        max_concurrency: Some(8),
        ..Limits::default()
    })
    .await;
    let plain = s.authority.add(grant("plain", None));
    let own = s.authority.add(Grant {
        limits: Limits {
            rpm: Some(600),
            ..Limits::default()
        },
        ..grant("own", None)
    });
    assert_eq!(s.call(&plain, chat("policy", "1")).await.0, 200);
    let (status, r, _) = s.call(&plain, chat("policy", "2")).await;
    assert_eq!(status, 429, "the default rpm of 1: {r}");
    for i in 0..5 {
        let (status, r, _) = s.call(&own, chat("policy", &i.to_string())).await;
        assert_eq!(status, 200, "its own rpm: {r}");
    }
}

#[tokio::test]
async fn a_budget_is_spent_clamped_and_then_refused_for_good() {
    let s = setup().await;
    let tok = s.authority.add(Grant {
        budget_tokens: Some(100),
        ..grant("b", None)
    });
    // The fake's usage: a token per word of the prompt and of "echo: " + the prompt.
    // A request naming max_tokens above the budget is lowered to it.
    let mut body = chat("policy", "one two three four");
    body["max_tokens"] = json!(1000);
    assert_eq!(s.call(&tok, body).await.0, 200);
    assert_eq!(s.last_body()["max_tokens"], 100);
    // 9 spent: 91 left. Naming none, it gets max_tokens; naming
    // max_completion_tokens, that one is lowered.
    assert_eq!(s.call(&tok, chat("policy", "a b c d")).await.0, 200);
    assert_eq!(s.last_body()["max_tokens"], 91);
    let mut body = chat("policy", "x");
    body["max_completion_tokens"] = json!(500);
    assert_eq!(s.call(&tok, body).await.0, 200);
    let sent = s.last_body();
    assert_eq!(sent["max_completion_tokens"], 82);
    assert!(sent.get("max_tokens").is_none(), "{sent}");

    // A stream is charged from its usage too: 79 left, then a 79-word prompt (and a
    // stream's answer) spends the rest.
    let mut long = chat("policy", &"w ".repeat(79));
    long["stream"] = json!(true);
    let (status, _, _) = s.call(&tok, long).await;
    assert_eq!(status, 200);

    let before = s.chats();
    let (status, r, reply) = s.call(&tok, chat("policy", "more")).await;
    assert_eq!(status, 429, "{r}");
    assert_eq!(r["error"]["code"], "insufficient_quota", "{r}");
    assert_eq!(r["error"]["type"], "insufficient_quota", "{r}");
    assert_eq!(header(&reply, "x-should-retry"), Some("false"));
    assert_eq!(header(&reply, "retry-after"), None);
    assert_eq!(header(&reply, "retry-after-ms"), None);
    assert_eq!(s.chats(), before, "a refused request never went upstream");
    s.tick(Duration::from_secs(3600));
    assert_eq!(
        s.call(&tok, chat("policy", "later")).await.0,
        429,
        "for good"
    );
    assert_eq!(s.gateway.stats().limited_budget, 2);

    // A grant that changes (a larger budget) keeps what was spent.
    s.authority.add(Grant {
        budget_tokens: Some(200),
        ..grant("b", None)
    });
    assert_eq!(s.call(&tok, chat("policy", "again")).await.0, 200);
    let left = s.last_body()["max_tokens"].as_u64().expect("clamped");
    assert!(left < 100, "{left} of 200 left: the first 100 stayed spent");
}

#[tokio::test]
async fn a_cache_hit_spends_budget_but_no_call() {
    let s = setup().await;
    let tok = s.authority.add(Grant {
        budget_tokens: Some(10_000),
        ..grant("c", None)
    });
    let mut body = chat("policy", "same words here");
    body["temperature"] = json!(0);
    // 3 + 4 = 7 tokens; 10000 left is plenty (no clamp): miss, then 9 hits of 7 each.
    let mut used = Vec::new();
    for _ in 0..10 {
        let (status, _, r) = s.call(&tok, body.clone()).await;
        assert_eq!(status, 200);
        used.push(header(&r, "x-dsec-cache").unwrap_or_default().to_string());
    }
    assert_eq!(used[0], "miss");
    assert!(used[1..].iter().all(|u| u == "hit"), "{used:?}");
    assert_eq!(s.chats(), 1);
    // 70 spent: a fresh request may now spend 9930 at most.
    let mut fresh = chat("policy", "fresh");
    fresh["max_tokens"] = json!(1_000_000);
    assert_eq!(s.call(&tok, fresh).await.0, 200);
    assert_eq!(s.last_body()["max_tokens"], 9930);
}

#[tokio::test]
async fn callers_of_gone_tokens_do_not_pile_up() {
    let s = setup().await;
    let tokens: Vec<String> = (0..1100)
        .map(|i| s.authority.add(grant(&format!("t{i}"), None)))
        .collect();
    for t in &tokens[..1024] {
        assert_eq!(s.gateway.list_models(Some(t)).status, 200);
    }
    assert_eq!(s.gateway.token_callers(), 1024);
    // 1000 sandboxes deleted; nothing refused yet, so no sweep.
    for i in 0..1000 {
        s.authority.forget(&format!("t{i}"));
    }
    assert_eq!(s.gateway.token_callers(), 1024);
    // One more caller past the high-water mark sweeps the gone ones out.
    assert_eq!(s.gateway.list_models(Some(&tokens[1024])).status, 200);
    assert_eq!(s.gateway.token_callers(), 25);
    // And once a minute anyway.
    for t in &tokens[1025..1050] {
        assert_eq!(s.gateway.list_models(Some(t)).status, 200);
    }
    assert_eq!(s.gateway.token_callers(), 50);
    for i in 1025..1050 {
        s.authority.forget(&format!("t{i}"));
    }
    s.tick(Duration::from_secs(60));
    assert_eq!(s.gateway.list_models(Some(&tokens[1050])).status, 200);
    assert_eq!(s.gateway.token_callers(), 26);
}

/// The JSON of a whole reply.
fn json_of(r: Reply) -> Value {
    let ReplyBody::Full(b) = r.body else {
        panic!("usage is whole");
    };
    serde_json::from_slice(&b).expect("json")
}

#[tokio::test]
async fn usage_is_counted_per_caller_and_traffic_per_model() {
    let s = setup().await;
    let a = s.authority.add(Grant {
        // Big enough not to clamp (a clamp would change the cache key).
        budget_tokens: Some(100_000),
        ..grant("a", None)
    });
    let b = s.authority.add(Grant {
        limits: Limits {
            rpm: Some(1),
            ..Limits::default()
        },
        ..grant("b", None)
    });
    // a: a call, the same as a stream, and a deterministic one twice (the second from
    // the cache).
    let (status, r, _) = s.call(&a, chat("policy", "one two three")).await;
    assert_eq!(status, 200, "{r}");
    let prompt = r["usage"]["prompt_tokens"].as_u64().expect("prompt");
    let completion = r["usage"]["completion_tokens"]
        .as_u64()
        .expect("completion");
    assert!(prompt > 0 && completion > 0, "{r}");
    let mut streamed = chat("policy", "one two three");
    streamed["stream"] = json!(true);
    let (status, _, _) = s.call(&a, streamed).await;
    assert_eq!(status, 200);
    let mut det = chat("policy", "one two three");
    det["temperature"] = json!(0);
    for cache in ["miss", "hit"] {
        let (status, _, headers) = s.call(&a, det.clone()).await;
        assert_eq!(status, 200);
        assert_eq!(header(&headers, "x-dsec-cache"), Some(cache));
    }
    // b: one call, then over its requests per minute.
    assert_eq!(s.call(&b, chat("policy", "x")).await.0, 200);
    assert_eq!(s.call(&b, chat("policy", "x")).await.0, 429);
    // Not counted: a model it may not call, a bad body, an unknown bearer.
    assert_eq!(s.call(&a, chat("nope", "x")).await.0, 404);
    assert_eq!(s.call("secret-nobody", chat("policy", "x")).await.0, 401);

    // The operator sees every caller: the key, then the tokens by name.
    let all = s.gateway.usage_by_caller();
    let names: Vec<(&str, Option<&str>)> = all
        .iter()
        .map(|u| (u.caller.as_str(), u.token_id.as_deref()))
        .collect();
    assert_eq!(names.len(), 3);
    assert!(names[0].0.starts_with("key-") && names[0].1.is_none());
    assert_eq!(
        &names[1..],
        [("tenant/a", Some("a")), ("tenant/b", Some("b"))]
    );
    let ua = &all[1];
    assert_eq!(ua.requests, 4, "the 404 is not counted");
    assert_eq!(
        (ua.prompt_tokens, ua.completion_tokens),
        (3 * prompt, 3 * completion),
        "three calls upstream; the hit used none"
    );
    assert_eq!((ua.cached_answers, ua.limited), (1, 0));
    assert_eq!(
        ua.spent_tokens,
        4 * (prompt + completion),
        "the hit spends budget"
    );
    assert_eq!(ua.budget_tokens, Some(100_000));
    assert_eq!(ua.budget_left, Some(100_000 - ua.spent_tokens));
    let ub = &all[2];
    assert_eq!((ub.requests, ub.limited, ub.budget_tokens), (2, 1, None));

    // A token sees only its own, whatever it asks for.
    let own = json_of(s.gateway.usage(Some(&a), Some("tenant/b")));
    assert_eq!(own["caller"], "tenant/a");
    assert_eq!(own["kind"], "token");
    assert_eq!(own["token_id"], "a");
    assert_eq!(own["requests"], 4);
    assert_eq!(own["budget_left"], json!(ua.budget_left));
    let own_b = json_of(s.gateway.usage(Some(&b), None));
    assert_eq!(own_b["budget_tokens"], Value::Null);
    assert_eq!(own_b["budget_left"], Value::Null);
    // The operator may filter by name or token id.
    for filter in ["tenant/b", "b"] {
        let list = json_of(s.gateway.usage(Some(KEY), Some(filter)));
        assert_eq!(list["data"].as_array().map(Vec::len), Some(1), "{list}");
        assert_eq!(list["data"][0]["caller"], "tenant/b");
    }
    assert_eq!(s.gateway.usage(Some("secret-nobody"), None).status, 401);
    assert_eq!(s.gateway.usage(None, None).status, 401);

    // Per model: requests by class, times, the stream's first chunk, tokens.
    let traffic = s.gateway.traffic();
    let policy = traffic
        .iter()
        .find(|m| m.model == "policy")
        .expect("policy");
    assert_eq!(policy.routes.len(), 1);
    let chat_route = &policy.routes[0];
    assert_eq!(chat_route.route, Route::ChatCompletions);
    assert_eq!(chat_route.codes, [0, 5, 0, 1, 0], "6 answered, the 429 too");
    assert_eq!(chat_route.duration.count, 6);
    assert_eq!(policy.ttft.count, 1, "one stream");
    assert_eq!(
        (policy.prompt_tokens, policy.completion_tokens),
        (3 * prompt + 1, 3 * completion + completion_of_x(&s).await),
    );
    let other = traffic.iter().find(|m| m.model == "other").expect("other");
    assert!(other.routes.is_empty() && other.ttft.count == 0);

    // A token gone is swept out with its usage.
    s.authority.forget("b");
    s.tick(Duration::from_secs(2));
    assert_eq!(s.call(&b, chat("policy", "x")).await.0, 401);
    let all = s.gateway.usage_by_caller();
    assert_eq!(all.len(), 2);
    assert_eq!(all[1].caller, "tenant/a");
}

/// Completion tokens of a chat saying "x" (as the key, not counted above).
async fn completion_of_x(s: &Setup) -> u64 {
    let r = s
        .gateway
        .handle(
            Some(KEY),
            Route::ChatCompletions,
            Bytes::from(chat("policy", "x").to_string()),
            CallOptions { no_cache: true },
        )
        .await;
    let v: Value = serde_json::from_slice(&body_of(r).await).expect("json");
    v["usage"]["completion_tokens"]
        .as_u64()
        .expect("completion")
}

#[tokio::test]
async fn a_tenants_tokens_share_its_limits_and_other_tenants_are_not_held_back() {
    let s = setup_config(GatewayConfig {
        tenant_limits: BTreeMap::from([(
            "acme".to_string(),
            Limits {
                rpm: Some(60),
                burst: Some(2),
                ..Limits::default()
            },
        )]),
        default_tenant_limits: Some(Limits {
            max_concurrency: Some(1),
            ..Limits::default()
        }),
        ..GatewayConfig::default()
    })
    .await;
    let of = |id: &str, tenant: &str| Grant {
        tenant: Some(tenant.into()),
        ..grant(id, None)
    };
    // Each token of acme may make 10 a minute; acme's tokens together only 2 at once.
    let own = Limits {
        rpm: Some(600),
        burst: Some(10),
        ..Limits::default()
    };
    let a1 = s.authority.add(Grant {
        limits: own,
        ..of("a1", "acme")
    });
    let a2 = s.authority.add(Grant {
        limits: own,
        ..of("a2", "acme")
    });
    assert_eq!(s.call(&a1, chat("policy", "1")).await.0, 200);
    assert_eq!(s.call(&a2, chat("policy", "2")).await.0, 200);
    let (status, r, headers) = s.call(&a1, chat("policy", "3")).await;
    assert_eq!(status, 429, "{r}");
    let message = r["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("tenant acme") && message.contains("RPM"),
        "{message}"
    );
    assert_eq!(
        header(&headers, "retry-after"),
        Some("1"),
        "60 a minute: one a second"
    );
    let chats = s.chats();
    // A refusal by the tenant's limits takes nothing from the token's own: after a
    // second, a1 has its 8 left and acme one more.
    s.tick(Duration::from_secs(1));
    assert_eq!(s.call(&a1, chat("policy", "4")).await.0, 200);
    assert_eq!(s.chats(), chats + 1);

    // Another tenant, with the default shared limits (one at once), is not held back
    // by acme's bucket; a tenant-less token has none.
    let b = s.authority.add(of("b1", "globex"));
    let free = s.authority.add(grant("free", None));
    assert_eq!(s.call(&b, chat("policy", "5")).await.0, 200);
    assert_eq!(s.call(&free, chat("policy", "6")).await.0, 200);
    // globex's one-at-once: a stream held open keeps its second request out.
    let held = s
        .handle(&b, json!({"model": "policy", "stream": true, "messages": [{"role": "user", "content": "slow"}]}))
        .await;
    assert_eq!(held.status, 200);
    let b2 = s.authority.add(of("b2", "globex"));
    let (status, r, _) = s.call(&b2, chat("policy", "7")).await;
    assert_eq!(status, 429, "{r}");
    assert!(
        r["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("tenant globex") && m.contains("at once")),
        "{r}"
    );
    drop(held);
    assert_eq!(s.call(&b2, chat("policy", "8")).await.0, 200);
}

#[tokio::test]
async fn a_tenants_usage_sums_its_tokens_and_outlives_them() {
    let s = setup().await;
    let of = |id: &str, tenant: &str| Grant {
        tenant: Some(tenant.into()),
        ..grant(id, None)
    };
    let a1 = s.authority.add(of("a1", "acme"));
    let a2 = s.authority.add(of("a2", "acme"));
    let b1 = s.authority.add(of("b1", "globex"));
    let free = s.authority.add(grant("free", None));
    for (bearer, prompt) in [(&a1, "one"), (&a2, "two"), (&a2, "three"), (&b1, "four")] {
        assert_eq!(s.call(bearer, chat("policy", prompt)).await.0, 200);
    }
    assert_eq!(s.call(&free, chat("policy", "five")).await.0, 200);
    // A cached answer counts for the tenant too.
    let det = json!({"model": "policy", "temperature": 0, "messages": [{"role": "user", "content": "same"}]});
    assert_eq!(s.call(&a1, det.clone()).await.0, 200);
    assert_eq!(s.call(&a1, det).await.0, 200);

    let callers = s.gateway.usage_by_caller();
    let of_token = |id: &str| {
        callers
            .iter()
            .find(|u| u.token_id.as_deref() == Some(id))
            .cloned()
            .expect("listed")
    };
    assert_eq!(of_token("a2").tenant.as_deref(), Some("acme"));
    assert_eq!(of_token("free").tenant, None);
    let sum = |ids: &[&str], f: fn(&dsec_gateway::CallerUsage) -> u64| -> u64 {
        ids.iter().map(|id| f(&of_token(id))).sum()
    };

    let tenants = s.gateway.usage_by_tenant(None);
    let names: Vec<&str> = tenants.iter().map(|t| t.tenant.as_str()).collect();
    assert_eq!(names, ["acme", "globex"], "a tenant-less token is in none");
    let acme = &tenants[0];
    assert_eq!((acme.requests, acme.tokens_held), (5, 2));
    assert_eq!(acme.cached_answers, 1);
    assert_eq!(acme.prompt_tokens, sum(&["a1", "a2"], |u| u.prompt_tokens));
    assert_eq!(
        acme.completion_tokens,
        sum(&["a1", "a2"], |u| u.completion_tokens)
    );
    assert!(acme.completion_tokens > 0);
    assert_eq!(tenants[1].requests, 1);

    // The tokens go (their sandboxes deleted): the tenant's usage stays.
    s.authority.forget("a1");
    s.authority.forget("a2");
    s.tick(Duration::from_secs(61));
    assert_eq!(
        s.call(&a1, chat("policy", "gone")).await.0,
        401,
        "refused, and the callers of gone tokens are swept"
    );
    assert!(s
        .gateway
        .usage_by_caller()
        .iter()
        .all(|u| u.tenant.as_deref() != Some("acme")));
    let acme_after = s.gateway.usage_by_tenant(Some("acme"));
    assert_eq!(acme_after.len(), 1);
    assert_eq!(acme_after[0].requests, 5);
    assert_eq!(acme_after[0].tokens_held, 0);

    // Over HTTP's shape: operators only.
    let r = s.gateway.tenant_usage(Some(KEY), Some("globex"));
    assert_eq!(r.status, 200);
    let v: Value = serde_json::from_slice(&body_of(r).await).expect("json");
    assert_eq!(v["data"][0]["tenant"], "globex");
    assert_eq!(v["data"][0]["requests"], 1);
    assert_eq!(s.gateway.tenant_usage(Some(&b1), None).status, 403);
    assert_eq!(s.gateway.tenant_usage(None, None).status, 401);
}

/// A spend ledger in memory: each gateway's totals by replica name.
#[derive(Debug, Default)]
struct MemLedger {
    records: Mutex<HashMap<String, BTreeMap<String, u64>>>,
}

/// One gateway's handle on a [`MemLedger`].
#[derive(Debug)]
struct Replica(Arc<MemLedger>, &'static str);

impl SpendLedger for Replica {
    fn exchange<'a>(
        &'a self,
        mine: &'a BTreeMap<String, u64>,
    ) -> BoxFuture<'a, Result<HashMap<String, u64>, LedgerError>> {
        let mut records = self.0.records.lock().expect("lock");
        records.insert(self.1.to_string(), mine.clone());
        let mut others: HashMap<String, u64> = HashMap::new();
        for (_, spent) in records.iter().filter(|(r, _)| r.as_str() != self.1) {
            for (id, n) in spent {
                *others.entry(id.clone()).or_default() += n;
            }
        }
        Box::pin(std::future::ready(Ok(others)))
    }
}

#[tokio::test]
async fn a_budget_holds_across_gateways_sharing_a_ledger_and_across_a_restart() {
    let s = setup().await;
    let ledger = Arc::new(MemLedger::default());
    let replica = |g: Gateway, name| g.with_spend_ledger(Arc::new(Replica(ledger.clone(), name)));
    let another = || {
        Gateway::new(s.gateway.config().clone())
            .expect("gateway")
            .with_authority(s.authority.clone())
    };
    let a = replica(another(), "a");
    let b = replica(another(), "b");
    let tok = s.authority.add(Grant {
        budget_tokens: Some(20),
        ..grant("shared", None)
    });
    async fn call(g: &Gateway, tok: &str, prompt: &str) -> u16 {
        let body = Bytes::from(chat("policy", prompt).to_string());
        g.handle(
            Some(tok),
            Route::ChatCompletions,
            body,
            CallOptions::default(),
        )
        .await
        .status
    }
    let spent = |g: &Gateway| {
        g.usage_by_caller()
            .iter()
            .find(|u| u.token_id.as_deref() == Some("shared"))
            .map(|u| (u.spent_tokens, u.budget_left))
    };
    // 9 tokens each (4 words in, "echo:" and 4 out): each gateway alone sees its own.
    assert_eq!(call(&a, &tok, "one two three four").await, 200);
    assert_eq!(call(&b, &tok, "five six seven eight").await, 200);
    assert_eq!(spent(&a), Some((9, Some(11))));
    assert_eq!(spent(&b), Some((9, Some(11))));
    for g in [&a, &b, &a] {
        g.exchange_spending().await.expect("exchange");
    }
    assert_eq!(spent(&a), Some((18, Some(2))), "b's spending counts at a");
    assert_eq!(spent(&b), Some((18, Some(2))));
    // a spends past the budget; after an exchange neither answers.
    assert_eq!(call(&a, &tok, "x").await, 200);
    assert_eq!(call(&a, &tok, "y").await, 429);
    assert_eq!(call(&b, &tok, "z").await, 200, "b has not heard yet");
    for g in [&a, &b] {
        g.exchange_spending().await.expect("exchange");
    }
    assert_eq!(call(&b, &tok, "z").await, 429);

    // A gateway that restarts (a new replica on the same ledger) starts from it.
    drop(a);
    let a2 = replica(another(), "a-restarted");
    a2.exchange_spending().await.expect("exchange");
    assert_eq!(
        call(&a2, &tok, "again").await,
        429,
        "the budget survived the restart"
    );

    // Without a ledger nothing is exchanged, and no task is started.
    assert!(another().exchange_spending().await.is_ok());
    assert!(another()
        .start_spend_ledger(Duration::from_secs(1))
        .is_none());
    let task = a2.start_spend_ledger(Duration::from_millis(10));
    assert!(task.is_some());
}

//! The model gateway's core: an OpenAI-compatible front door for the models that code in
//! sandboxes (tool-using agents, LLM judges) calls.
//!
//! [`Gateway::handle`] takes one request of an OpenAI route (chat completions,
//! completions, embeddings) with the caller's bearer key and answers a [`Reply`]: the
//! upstream's answer passed through (a stream chunk by chunk, never buffered), or an
//! error in OpenAI's shape. Upstreams are configured per public model name
//! ([`GatewayConfig`]); their keys stay here, never in a sandbox. A request goes to the
//! upstream of its model with the fewest requests in flight, and to the next one when an
//! upstream cannot be reached.
//!
//! Callers are the configured keys and, with a [`TokenAuthority`], sandbox tokens
//! ([`grants`]): the authority says per token which models it may call (any other
//! answers as a model that does not exist), its limits and its budget of model tokens.
//!
//! Each caller has its limits ([`limits`]): requests and model tokens per minute,
//! requests in flight, and the time a request may take. Over a limit the answer is a
//! 429 in OpenAI's shape with `retry-after` and `retry-after-ms`, which the SDKs wait
//! out and retry; past its time a request answers 504 (or, once streaming, ends with an
//! SSE error event). Tokens are charged from the upstream's `usage`; a stream is made to
//! report it (`stream_options.include_usage`), the extra chunk dropped again ([`sse`]).
//! A token past its budget answers 429 `insufficient_quota` with `x-should-retry:
//! false`, for good; before that a completion's `max_tokens` is lowered to what is left.
//!
//! Deterministic requests (`temperature: 0` or a `seed`, not streamed; embeddings) are
//! answered from a cache when an identical one was answered before, and identical ones
//! at the same moment share one call upstream ([`cache`]). The `x-dsec-cache` header
//! says which: `hit`, `miss`, `coalesced` or `bypass`. A hit counts against a caller's
//! requests per minute and its budget, not its tokens per minute.
//!
//! What passes is counted without a lock on the request path ([`Gateway::traffic`]:
//! request times and first-chunk delays as histograms, status classes and tokens, per
//! public model and route) and per caller ([`Gateway::usage`], `GET /v1/usage`: its
//! requests, tokens, cached answers, refusals and budget left).
//!
//! There is no HTTP server here: `dsec-http::gateway` maps routes onto this, as the
//! `/v1` API maps onto `SandboxApi`.

pub mod cache;
pub mod config;
pub mod grants;
pub mod ledger;
pub mod limits;
pub mod openai;
mod sse;
mod upstream;
mod usage;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::stream::{BoxStream, StreamExt};

use cache::{Answer, Cache, CacheUse, Lookup};
pub use cache::{CacheConfig, CacheStats};
pub use config::{ApiKey, ConfigError, GatewayConfig, Limits, ModelConfig, UpstreamConfig};
use grants::TokenCallers;
pub use grants::{Grant, TokenAuthority, TokenError};
pub use ledger::{LedgerError, SpendLedger};
use limits::{Admission, CallerLimits, Clock, Limited, Refusal};
use openai::ErrorKind;
pub use upstream::UpstreamStatus;
use upstream::Upstreams;
pub use usage::{
    CallerKind, CallerUsage, HistogramSnapshot, ModelTraffic, RouteTraffic, TenantUsage,
    LATENCY_BUCKETS_S, STATUS_CLASSES,
};
use usage::{Tally, Traffic, UsageCounters};

/// An OpenAI route the gateway forwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// `POST /v1/chat/completions`.
    ChatCompletions,
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/embeddings`.
    Embeddings,
}

impl Route {
    /// Every route, in the order of [`Route::index`].
    pub const ALL: [Route; 3] = [
        Route::ChatCompletions,
        Route::Completions,
        Route::Embeddings,
    ];

    /// Its place in [`Route::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// Its name as a metrics label: `chat_completions`, `completions`, `embeddings`.
    pub fn as_str(self) -> &'static str {
        match self {
            Route::ChatCompletions => "chat_completions",
            Route::Completions => "completions",
            Route::Embeddings => "embeddings",
        }
    }

    /// Its path below the base URL (`/v1`).
    pub fn path(self) -> &'static str {
        match self {
            Route::ChatCompletions => "/chat/completions",
            Route::Completions => "/completions",
            Route::Embeddings => "/embeddings",
        }
    }
}

/// What a caller asked of a request beyond its body.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CallOptions {
    /// `Cache-Control: no-cache` (or `no-store`): the request neither uses the cache nor
    /// joins an identical request in flight, and its answer is not stored.
    pub no_cache: bool,
}

/// The response header saying how the cache took part.
pub const CACHE_HEADER: &str = "x-dsec-cache";

/// A body streamed to the caller as it arrives from the upstream.
pub type ByteStream = BoxStream<'static, Result<Bytes, std::io::Error>>;

/// The body of a [`Reply`].
pub enum ReplyBody {
    /// All of it.
    Full(Bytes),
    /// Passed through as the upstream sends it (an SSE stream, a large answer).
    Stream(ByteStream),
}

impl std::fmt::Debug for ReplyBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReplyBody::Full(b) => f.debug_tuple("Full").field(&b.len()).finish(),
            ReplyBody::Stream(_) => f.write_str("Stream"),
        }
    }
}

/// What the gateway answers a request.
#[derive(Debug)]
pub struct Reply {
    /// HTTP status.
    pub status: u16,
    /// Response headers (content type first).
    pub headers: Vec<(String, String)>,
    /// Response body.
    pub body: ReplyBody,
}

/// What the gateway has done since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GatewayStats {
    /// Requests refused by a requests-per-minute limit.
    pub limited_requests: u64,
    /// Requests refused by a tokens-per-minute limit.
    pub limited_tokens: u64,
    /// Requests refused by a concurrency limit.
    pub limited_concurrency: u64,
    /// Requests refused because the caller's token budget is used up.
    pub limited_budget: u64,
    /// Requests over their time limit (a 504, or a stream ended with an error).
    pub timed_out: u64,
    /// Callers of sandbox tokens held now ([`Gateway::token_callers`]).
    pub token_callers: u64,
    /// The response cache's counters.
    pub cache: CacheStats,
}

/// The live counters behind [`GatewayStats`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    limited_requests: AtomicU64,
    limited_tokens: AtomicU64,
    limited_concurrency: AtomicU64,
    limited_budget: AtomicU64,
    timed_out: AtomicU64,
}

impl Counters {
    fn refused(&self, limit: Limited) {
        let c = match limit {
            Limited::Requests => &self.limited_requests,
            Limited::Tokens => &self.limited_tokens,
            Limited::Concurrency => &self.limited_concurrency,
            Limited::Budget => &self.limited_budget,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn timed_out(&self) {
        self.timed_out.fetch_add(1, Ordering::Relaxed);
    }

    fn snapshot(&self) -> GatewayStats {
        GatewayStats {
            limited_requests: self.limited_requests.load(Ordering::Relaxed),
            limited_tokens: self.limited_tokens.load(Ordering::Relaxed),
            limited_concurrency: self.limited_concurrency.load(Ordering::Relaxed),
            limited_budget: self.limited_budget.load(Ordering::Relaxed),
            timed_out: self.timed_out.load(Ordering::Relaxed),
            token_callers: 0,
            cache: CacheStats::default(),
        }
    }
}

/// A caller key's or token's holder: its name, the models it may call, and where it
/// stands against its limits.
#[derive(Debug)]
pub(crate) struct Caller {
    name: String,
    /// A sandbox token's id; `None` for a configured key.
    token_id: Option<String>,
    /// Its requests, tokens, cached answers and refusals.
    usage: Arc<UsageCounters>,
    /// Whose cached answers it shares: its name, apart for tokens and keys.
    scope: String,
    limits: Arc<CallerLimits>,
    config: Limits,
    /// The tenant whose shared limits it counts against too, and those limits.
    tenant: Option<(String, Limits)>,
    /// A token's tenant, limits or not (its usage counts there too).
    tenant_name: Option<String>,
    /// The models it may call; `None`: all.
    models: Option<BTreeSet<String>>,
}

impl Caller {
    fn may_call(&self, model: &str) -> bool {
        self.models.as_ref().is_none_or(|m| m.contains(model))
    }
}

/// The limits' clock, kept for callers made later.
struct DebugClock(Clock);

impl std::fmt::Debug for DebugClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Clock")
    }
}

/// The gateway: configured models, their upstreams, and the keys allowed to call them
/// with their limits.
#[derive(Debug)]
pub struct Gateway {
    config: GatewayConfig,
    /// The configured keys' digests ([`GatewayConfig::key_digests`]).
    key_digests: Vec<config::KeyDigest>,
    upstreams: Arc<Upstreams>,
    callers: Vec<Arc<Caller>>,
    tokens: Option<Arc<TokenCallers>>,
    ledger: Option<Arc<dyn SpendLedger>>,
    clock: DebugClock,
    counters: Arc<Counters>,
    cache: Arc<Cache>,
    traffic: Traffic,
}

impl Gateway {
    /// A gateway over `config` (checked first).
    pub fn new(config: GatewayConfig) -> Result<Self, ConfigError> {
        Self::with_clock(config, limits::monotonic_clock())
    }

    /// [`Gateway::new`] with the limits reading `clock`.
    pub fn with_clock(config: GatewayConfig, clock: Clock) -> Result<Self, ConfigError> {
        config.check()?;
        let upstreams = Arc::new(Upstreams::new(&config)?);
        let callers = config
            .api_keys
            .iter()
            .enumerate()
            .map(|(i, key)| {
                let limits = config.limits_of(i);
                let name = key.caller_name();
                Arc::new(Caller {
                    scope: format!("key:{name}"),
                    name,
                    token_id: None,
                    usage: Arc::default(),
                    limits: Arc::new(CallerLimits::with_budget(limits, None, 0, clock.clone())),
                    config: limits,
                    tenant: None,
                    tenant_name: None,
                    models: None,
                })
            })
            .collect();
        let cache = Arc::new(Cache::new(config.cache, clock.clone()));
        let traffic = Traffic::new(config.models.keys());
        Ok(Self {
            key_digests: config.key_digests(),
            config,
            upstreams,
            callers,
            tokens: None,
            ledger: None,
            clock: DebugClock(clock),
            counters: Arc::default(),
            cache,
            traffic,
        })
    }

    /// This gateway also answering bearers that are not configured keys, when
    /// `authority` grants them (sandbox tokens; see [`grants`]). A configured key is
    /// always checked first.
    pub fn with_authority(mut self, authority: Arc<dyn TokenAuthority>) -> Self {
        self.tokens = Some(Arc::new(TokenCallers::new(authority, self.clock.0.clone())));
        self
    }

    /// Callers of sandbox tokens held now: those used since the last sweep, or live.
    pub fn token_callers(&self) -> usize {
        self.tokens.as_ref().map_or(0, |t| t.len())
    }

    /// This gateway sharing what sandbox tokens spend through `ledger` (see [`ledger`]),
    /// so their budgets hold across replicas and restarts. Only with an authority.
    pub fn with_spend_ledger(mut self, ledger: Arc<dyn SpendLedger>) -> Self {
        self.ledger = Some(ledger);
        self
    }

    /// One exchange with the spend ledger: stores what this gateway charged each
    /// budgeted token held and takes in what the others charged. Nothing without a
    /// ledger.
    pub async fn exchange_spending(&self) -> Result<(), LedgerError> {
        let (Some(tokens), Some(ledger)) = (&self.tokens, &self.ledger) else {
            return Ok(());
        };
        exchange(tokens, ledger.as_ref()).await
    }

    /// Exchanges with the spend ledger now and then every `every`, on the current
    /// tokio runtime, until the gateway is dropped (`None`: no ledger). A failed
    /// exchange is logged and tried again at the next.
    pub fn start_spend_ledger(&self, every: Duration) -> Option<tokio::task::JoinHandle<()>> {
        let (Some(tokens), Some(ledger)) = (&self.tokens, &self.ledger) else {
            return None;
        };
        let (tokens, ledger) = (Arc::downgrade(tokens), ledger.clone());
        Some(tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut failing = false;
            loop {
                tick.tick().await;
                let Some(tokens) = tokens.upgrade() else {
                    return;
                };
                match exchange(&tokens, ledger.as_ref()).await {
                    Ok(()) if failing => {
                        failing = false;
                        tracing::info!("the spend ledger answers again");
                    }
                    Ok(()) => {}
                    Err(e) if !failing => {
                        failing = true;
                        tracing::warn!(error = %e, "budgets count this gateway's spending only until the ledger answers");
                    }
                    Err(_) => {}
                }
            }
        }))
    }

    /// Starts probing the upstreams' health on the current tokio runtime, every
    /// `health_check_interval_s` until the gateway is dropped (`None`: probes are off).
    /// Without it, only failed connects take an upstream out of rotation.
    pub fn start_health_checks(&self) -> Option<tokio::task::JoinHandle<()>> {
        self.upstreams.spawn_probes()
    }

    /// Every upstream's health and load.
    pub fn upstreams(&self) -> Vec<UpstreamStatus> {
        self.upstreams.status()
    }

    /// Its configuration.
    pub fn config(&self) -> &GatewayConfig {
        &self.config
    }

    /// What it has done since it started.
    pub fn stats(&self) -> GatewayStats {
        GatewayStats {
            cache: self.cache.stats(),
            token_callers: self.token_callers() as u64,
            ..self.counters.snapshot()
        }
    }

    /// Per configured model, what it has carried since the gateway started: request
    /// times and status classes per route, the first chunk's delay of streams, tokens.
    pub fn traffic(&self) -> Vec<ModelTraffic> {
        self.traffic.snapshot()
    }

    /// The usage of every caller held: the configured keys, then the sandbox tokens
    /// used since their last sweep, by name.
    pub fn usage_by_caller(&self) -> Vec<CallerUsage> {
        let mut all: Vec<CallerUsage> = self.callers.iter().map(|c| CallerUsage::of(c)).collect();
        if let Some(tokens) = &self.tokens {
            let mut held: Vec<CallerUsage> =
                tokens.all().iter().map(|c| CallerUsage::of(c)).collect();
            held.sort_by(|a, b| (&a.caller, &a.token_id).cmp(&(&b.caller, &b.token_id)));
            all.extend(held);
        }
        all
    }

    /// Each tenant's usage through its sandbox tokens since the gateway started (gone
    /// tokens included), by tenant; only `tenant`'s if given.
    pub fn usage_by_tenant(&self, tenant: Option<&str>) -> Vec<TenantUsage> {
        self.tokens
            .as_ref()
            .map_or_else(Vec::new, |t| t.tenant_usage(tenant))
    }

    /// `GET /v1/usage/tenants` (configured keys only): [`Gateway::usage_by_tenant`] as
    /// `{"object": "list", "data": [...]}`.
    pub fn tenant_usage(&self, bearer: Option<&str>, tenant: Option<&str>) -> Reply {
        if let Err(r) = self.authorize(bearer) {
            return *r;
        }
        let data = self.usage_by_tenant(tenant);
        openai::json(200, &serde_json::json!({"object": "list", "data": data}))
    }

    /// `GET /v1/usage`: for a configured key, every caller's usage (`{"object": "list",
    /// "data": [...]}`), only those named `caller` (a name or a token id) if given; for
    /// a sandbox token, its own ([`CallerUsage`]), whatever `caller` says.
    pub fn usage(&self, bearer: Option<&str>, caller: Option<&str>) -> Reply {
        let Some(key) = bearer else {
            return *no_key();
        };
        if self.find_key(key).is_some() {
            let data: Vec<CallerUsage> = self
                .usage_by_caller()
                .into_iter()
                .filter(|u| {
                    caller.is_none_or(|c| u.caller == c || u.token_id.as_deref() == Some(c))
                })
                .collect();
            return openai::json(200, &serde_json::json!({"object": "list", "data": data}));
        }
        match self.caller(bearer) {
            Ok(c) => openai::json(200, &serde_json::json!(CallerUsage::of(&c))),
            Err(reply) => *reply,
        }
    }

    /// Checks the caller's bearer key: a configured key, else a token its authority
    /// grants. The error is the answer to give.
    fn caller(&self, bearer: Option<&str>) -> Result<Arc<Caller>, Box<Reply>> {
        let key = bearer.ok_or_else(no_key)?;
        if let Some(caller) = self.find_key(key).and_then(|i| self.callers.get(i)) {
            return Ok(caller.clone());
        }
        let Some(tokens) = &self.tokens else {
            return Err(Box::new(token_refused(TokenError::Unknown)));
        };
        tokens
            .caller(key, &self.config)
            .map_err(|e| Box::new(token_refused(e)))
    }

    /// Checks that the bearer is one of the configured keys (an operator's): what only
    /// they may see, such as the counters of every caller. A sandbox token gets a 403.
    /// The error is the answer to give.
    pub fn authorize(&self, bearer: Option<&str>) -> Result<(), Box<Reply>> {
        let key = bearer.ok_or_else(no_key)?;
        if self.find_key(key).is_some() {
            return Ok(());
        }
        if self.tokens.as_ref().is_some_and(|t| t.knows(key)) {
            return Err(Box::new(openai::error(
                403,
                "a sandbox token may not read this: ask with one of the gateway's configured keys",
                ErrorKind::PermissionDenied,
                Some("permission_denied"),
            )));
        }
        Err(Box::new(token_refused(TokenError::Unknown)))
    }

    /// The index of `key` among the configured keys (their digests made once).
    fn find_key(&self, key: &str) -> Option<usize> {
        config::find_digest(&self.key_digests, key)
    }

    /// Whether `caller` may call `model`: a configured one, and one it was given.
    fn serves(&self, caller: &Caller, model: &str) -> bool {
        self.config.models.contains_key(model) && caller.may_call(model)
    }

    /// Answers a request of `route` with JSON `body`, from a caller holding `bearer`.
    pub async fn handle(
        &self,
        bearer: Option<&str>,
        route: Route,
        body: Bytes,
        options: CallOptions,
    ) -> Reply {
        let started = std::time::Instant::now();
        let caller = match self.caller(bearer) {
            Ok(c) => c,
            Err(reply) => return *reply,
        };
        let request = match openai::RequestView::parse(&body) {
            Ok(r) => r,
            Err(message) => {
                return openai::error(400, message, ErrorKind::InvalidRequest, None);
            }
        };
        if !self.serves(&caller, &request.model) {
            return openai::model_not_found(&request.model);
        }
        let mut tally = self
            .traffic
            .model(&request.model)
            .map(|m| Tally::new(m.clone(), route, caller.usage.clone(), started));
        let reply = self
            .answer(&caller, route, request, body, options, &mut tally)
            .await;
        if let Some(t) = &mut tally {
            t.set_status(reply.status);
        }
        reply
    }

    /// [`Gateway::handle`] for a request of a model `caller` may call, counted in
    /// `tally` (taken by a stream, which counts when it ends).
    async fn answer(
        &self,
        caller: &Caller,
        route: Route,
        mut request: openai::RequestView,
        body: Bytes,
        options: CallOptions,
        tally: &mut Option<Tally>,
    ) -> Reply {
        let mut admission = match caller.limits.admit() {
            Ok(a) => a,
            Err(refusal) => {
                caller.usage.limited();
                self.counters.refused(refusal.limit);
                tracing::debug!(caller = %caller.name, limit = ?refusal.limit, wait = ?refusal.retry_after, "over a limit");
                return refused(caller, refusal);
            }
        };
        admission.add_bytes(body.len());
        // A completion may not spend more than the budget has left (before the cache
        // key is made: the key is of what goes upstream).
        let unnamed_below = match route {
            Route::ChatCompletions => Some(openai::UNNAMED_COMPLETION_CLAMP),
            Route::Completions => Some(openai::COMPLETIONS_DEFAULT_MAX_TOKENS),
            Route::Embeddings => None,
        };
        let body = match (admission.budget_left(), unnamed_below) {
            (Some(left), Some(below)) if request.clamp_completion(left, below) => {
                request.to_bytes()
            }
            _ => body,
        };
        let deadline = caller
            .limits
            .timeout()
            .map(|limit| (tokio::time::Instant::now() + limit, limit));
        let cacheable = self.cache.config().enabled()
            && !options.no_cache
            && cache::eligible(route, &request.members(cache::ELIGIBILITY_FIELDS));
        if !cacheable {
            self.cache.bypassed();
            let mut reply = self
                .pass_through(route, request, body, admission, deadline, tally)
                .await;
            reply
                .headers
                .push((CACHE_HEADER.into(), CacheUse::Bypass.as_str().into()));
            return reply;
        }
        let key = match request.to_map() {
            Ok(body) => cache::key(&caller.scope, route, &request.model, &body),
            Err(message) => {
                admission.forgive();
                return openai::error(400, message, ErrorKind::InvalidRequest, None);
            }
        };
        let (mut waiter, used) = match self.cache.lookup(key) {
            Lookup::Hit(answer) => {
                caller.usage.cached_answer();
                admission.answered_without_call(answer_tokens(&answer));
                return answer_reply(&answer, CacheUse::Hit);
            }
            Lookup::Wait(waiter) => (waiter, CacheUse::Coalesced),
            Lookup::Lead(leader) => {
                let upstreams = self.upstreams.clone();
                let model = request.model.clone();
                let call =
                    async move { answer_of(upstreams.forward(&model, route, request, body).await) };
                (leader.start(call), CacheUse::Miss)
            }
        };
        let answer = match deadline {
            None => waiter.answer().await,
            Some((at, limit)) => match tokio::time::timeout_at(at, waiter.answer()).await {
                Ok(answer) => answer,
                Err(_) => {
                    // Dropping the waiter aborts the call if no one else waits on it.
                    self.counters.timed_out();
                    return openai::timed_out(limit);
                }
            },
        };
        let Some(answer) = answer else {
            admission.forgive();
            return openai::error(
                502,
                "the call upstream ended without an answer",
                ErrorKind::Api,
                Some("upstream_error"),
            );
        };
        // The tokens are the leader's to pay; those who waited used none upstream (but
        // spent their budget on the answer).
        if let (CacheUse::Miss, Some(usage), Some(t)) = (used, answer.usage, tally.as_mut()) {
            t.set_usage(usage);
        }
        if used == CacheUse::Coalesced && (200..300).contains(&answer.status) {
            caller.usage.cached_answer();
        }
        match (used, answer.usage) {
            (CacheUse::Miss, Some(tokens)) => admission.record_usage(tokens.total),
            (CacheUse::Miss, None) if (200..300).contains(&answer.status) => {
                admission.add_bytes(answer.body.len());
            }
            (CacheUse::Miss, _) => admission.forgive(),
            _ => admission.answered_without_call(answer_tokens(&answer)),
        }
        answer_reply(&answer, used)
    }

    /// Sends a request upstream without the cache, and meters its answer: tokens
    /// charged from its usage, a stream passed through [`sse::Metered`].
    async fn pass_through(
        &self,
        route: Route,
        mut request: openai::RequestView,
        body: Bytes,
        mut admission: Admission,
        deadline: Option<(tokio::time::Instant, std::time::Duration)>,
        tally: &mut Option<Tally>,
    ) -> Reply {
        // Tokens are charged from the usage a stream reports only when asked to.
        let strip_usage = route != Route::Embeddings && request.ask_stream_usage();
        let body = if strip_usage {
            request.to_bytes()
        } else {
            body
        };
        let model = request.model.clone();
        let forward = self.upstreams.forward(&model, route, request, body);
        let reply = match deadline {
            None => forward.await,
            Some((at, limit)) => match tokio::time::timeout_at(at, forward).await {
                Ok(reply) => reply,
                Err(_) => {
                    // Dropping the forward closed the upstream request; the admission
                    // charges an estimate of what it cost.
                    self.counters.timed_out();
                    return openai::timed_out(limit);
                }
            },
        };
        let ok = (200..300).contains(&reply.status);
        let body = match reply.body {
            ReplyBody::Full(b) => {
                if !ok {
                    admission.forgive();
                } else if let Some(tokens) = openai::usage_of(&b) {
                    admission.record_usage(tokens.total);
                    if let Some(t) = tally {
                        t.set_usage(tokens);
                    }
                } else {
                    admission.add_bytes(b.len());
                }
                ReplyBody::Full(b)
            }
            ReplyBody::Stream(s) => {
                if !ok {
                    admission.forgive();
                }
                if let Some(t) = tally {
                    t.set_status(reply.status);
                }
                let metered = sse::Metered::new(
                    s,
                    sse::SseScanner::new(strip_usage),
                    admission,
                    deadline,
                    self.counters.clone(),
                    tally.take(),
                );
                ReplyBody::Stream(metered.boxed())
            }
        };
        Reply {
            status: reply.status,
            headers: reply.headers,
            body,
        }
    }

    /// `GET /v1/models`: the public model names the caller may call.
    pub fn list_models(&self, bearer: Option<&str>) -> Reply {
        let caller = match self.caller(bearer) {
            Ok(c) => c,
            Err(reply) => return *reply,
        };
        let data: Vec<serde_json::Value> = self
            .config
            .models
            .keys()
            .filter(|m| caller.may_call(m))
            .map(|m| model_entry(m))
            .collect();
        openai::json(200, &serde_json::json!({"object": "list", "data": data}))
    }

    /// `GET /v1/models/{id}`: 404 for a model the caller may not call, as for one that
    /// does not exist.
    pub fn get_model(&self, bearer: Option<&str>, id: &str) -> Reply {
        let caller = match self.caller(bearer) {
            Ok(c) => c,
            Err(reply) => return *reply,
        };
        if !self.serves(&caller, id) {
            return openai::model_not_found(id);
        }
        openai::json(200, &model_entry(id))
    }
}

/// An upstream's whole answer as a flight shares it. Flights carry only requests that
/// do not stream, whose answers come whole.
fn answer_of(reply: Reply) -> Answer {
    match reply.body {
        ReplyBody::Full(body) => Answer {
            usage: (200..300)
                .contains(&reply.status)
                .then(|| openai::usage_of(&body))
                .flatten(),
            status: reply.status,
            headers: reply.headers,
            body,
        },
        ReplyBody::Stream(_) => {
            let error = openai::error(
                502,
                "the upstream streamed an answer to a request that did not ask for a stream",
                ErrorKind::Api,
                Some("upstream_error"),
            );
            let body = match error.body {
                ReplyBody::Full(b) => b,
                ReplyBody::Stream(_) => Bytes::new(),
            };
            Answer {
                status: error.status,
                headers: error.headers,
                body,
                usage: None,
            }
        }
    }
}

/// A shared or stored answer as the caller's, saying how the cache took part.
fn answer_reply(answer: &Answer, used: CacheUse) -> Reply {
    let mut headers = answer.headers.clone();
    headers.push((CACHE_HEADER.into(), used.as_str().into()));
    Reply {
        status: answer.status,
        headers,
        body: ReplyBody::Full(answer.body.clone()),
    }
}

/// The tokens an answer that came without a call is worth to a budget: its usage, else
/// a quarter token per byte; nothing for an error.
fn answer_tokens(answer: &Answer) -> u64 {
    if !(200..300).contains(&answer.status) {
        return 0;
    }
    answer
        .usage
        .map_or_else(|| (answer.body.len() as u64).div_ceil(4), |u| u.total)
}

/// The 401 for a request without a key.
fn no_key() -> Box<Reply> {
    Box::new(openai::error(
        401,
        "no API key: send Authorization: Bearer KEY",
        ErrorKind::InvalidRequest,
        Some("invalid_api_key"),
    ))
}

/// The answer for a bearer that is neither a configured key nor a granted token.
fn token_refused(e: TokenError) -> Reply {
    match e {
        TokenError::Unknown => openai::error(
            401,
            e.to_string(),
            ErrorKind::InvalidRequest,
            Some("invalid_api_key"),
        ),
        TokenError::Denied(m) => openai::error(
            403,
            m,
            ErrorKind::PermissionDenied,
            Some("permission_denied"),
        ),
        TokenError::Unavailable(m) => {
            openai::error(503, m, ErrorKind::Api, Some("auth_unavailable"))
        }
    }
}

/// The 429 for a caller over one of its limits.
fn refused(caller: &Caller, refusal: Refusal) -> Reply {
    let wait = refusal.retry_after.min(openai::MAX_RETRY_AFTER);
    // A limit the caller shares with its tenant's other tokens is named as the tenant's.
    let (who, limits) = match (&caller.tenant, refusal.shared) {
        (Some((tenant, limits)), true) => (format!("tenant {tenant}"), limits),
        _ => (caller.name.clone(), &caller.config),
    };
    let (what, limit, kind) = match refusal.limit {
        Limited::Budget => {
            return openai::insufficient_quota(format!(
                "{} has used up its budget of {} model tokens ({} spent); no more \
                 requests will be answered",
                caller.name,
                caller.limits.budget().unwrap_or(0),
                caller.limits.spent_in_all()
            ));
        }
        Limited::Requests => (
            "requests per minute (RPM)",
            limits.rpm.map(u64::from),
            ErrorKind::Requests,
        ),
        Limited::Tokens => ("tokens per minute (TPM)", limits.tpm, ErrorKind::Tokens),
        Limited::Concurrency => (
            "requests at once",
            limits.max_concurrency.map(u64::from),
            ErrorKind::Requests,
        ),
    };
    openai::rate_limited(
        format!(
            "rate limit reached for {who} on {what}: limit {}. Please try again in {:.3}s.",
            limit.unwrap_or(0),
            wait.as_secs_f64()
        ),
        kind,
        wait,
    )
}

/// One exchange of `tokens`' spending with `ledger`.
async fn exchange(tokens: &TokenCallers, ledger: &dyn SpendLedger) -> Result<(), LedgerError> {
    let mine = tokens.spent_here();
    let elsewhere = ledger.exchange(&mine).await?;
    tokens.set_spent_elsewhere(elsewhere);
    Ok(())
}

fn model_entry(id: &str) -> serde_json::Value {
    serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "dsec"})
}

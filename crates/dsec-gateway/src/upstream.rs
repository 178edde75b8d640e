//! The upstreams of each model: one HTTP client for all, the requests in flight per
//! upstream, and forwarding with failover. A request goes to the upstream with the
//! fewest in flight (ties rotate, so equal upstreams share the load); one that cannot
//! be connected to is skipped for the next. Once an upstream answered, its answer (an
//! error too) is the caller's: a request that reached a model is never sent twice.
//!
//! Health: an upstream that cannot be connected to is ejected, passively, for a second,
//! doubling on each failure in a row up to [`MAX_EJECTION`]; a probe (`GET {url}/models`,
//! every `health_check_interval_s`) that fails ejects it too, and one that answers
//! (below 500) brings it back at once. Ejected upstreams are tried last, not never: with
//! all of a model's upstreams down a request still tries each before failing.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};

use crate::config::{ConfigError, GatewayConfig};
use crate::openai::{self, ErrorKind, RequestView};
use crate::{Reply, ReplyBody, Route};

/// Upstream response headers a caller may need (rate limits, retry hints).
const PASSED_HEADERS: &[&str] = &[
    "content-type",
    "retry-after",
    "retry-after-ms",
    "x-should-retry",
    "x-request-id",
    "openai-processing-ms",
    "x-ratelimit-limit-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-requests",
    "x-ratelimit-reset-tokens",
];

/// The first ejection of an upstream that failed; each further failure in a row doubles it.
const FIRST_EJECTION: Duration = Duration::from_secs(1);
/// The longest an upstream stays ejected without a probe or a request bringing it back.
const MAX_EJECTION: Duration = Duration::from_secs(30);

/// What the gateway knows of one upstream's health (see [`crate::Gateway::upstreams`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct UpstreamStatus {
    /// The public model it serves.
    pub model: String,
    /// Its base URL.
    pub url: String,
    /// Whether it is in rotation (not ejected after a failed connect or probe).
    pub healthy: bool,
    /// Requests in flight there now.
    pub in_flight: u64,
    /// Requests that could not connect to it.
    pub connect_errors: u64,
    /// Answers with a 5xx status.
    pub status_errors: u64,
    /// Requests that failed after connecting (a reset, a broken answer).
    pub transport_errors: u64,
    /// Probes that failed.
    pub probe_errors: u64,
}

/// Ejection state: until when, and how long the next one lasts.
#[derive(Debug, Default)]
struct Ejection {
    until: Option<Instant>,
    next: Duration,
}

#[derive(Debug, Default)]
struct Health {
    /// Whether `ejection` holds anything: the request path reads this, not the lock.
    marked: AtomicBool,
    ejection: Mutex<Ejection>,
    connect_errors: AtomicU64,
    status_errors: AtomicU64,
    transport_errors: AtomicU64,
    probe_errors: AtomicU64,
}

impl Health {
    fn ejected(&self, now: Instant) -> bool {
        if !self.marked.load(Ordering::Acquire) {
            return false;
        }
        let e = self.ejection.lock().unwrap_or_else(|p| p.into_inner());
        e.until.is_some_and(|until| now < until)
    }

    /// Out of rotation for the next ejection's length, which then doubles.
    fn eject(&self, now: Instant) -> Duration {
        let mut e = self.ejection.lock().unwrap_or_else(|p| p.into_inner());
        let length = e.next.max(FIRST_EJECTION);
        e.until = Some(now + length);
        e.next = (length * 2).min(MAX_EJECTION);
        self.marked.store(true, Ordering::Release);
        length
    }

    /// Back in rotation; the next failure starts from the first ejection again.
    fn restore(&self) -> bool {
        if !self.marked.load(Ordering::Acquire) {
            return false;
        }
        let mut e = self.ejection.lock().unwrap_or_else(|p| p.into_inner());
        let was = e.until.is_some();
        *e = Ejection::default();
        self.marked.store(false, Ordering::Release);
        was
    }
}

#[derive(Debug)]
struct Upstream {
    /// Base URL without a trailing `/`.
    base: String,
    /// The URL of each route ([`Route::index`]), parsed once (`None` if it does not
    /// parse: the request fails as it did when parsed per request).
    urls: [Option<reqwest::Url>; 3],
    /// The model's name there, when it differs.
    served: Option<String>,
    key: Option<String>,
    in_flight: AtomicUsize,
    health: Health,
}

/// Counts a request in flight at an upstream until dropped (the answer's stream ended or
/// its caller went away).
#[derive(Debug)]
struct InFlight(Arc<Upstream>);

impl InFlight {
    fn new(up: &Arc<Upstream>) -> Self {
        up.in_flight.fetch_add(1, Ordering::Relaxed);
        Self(up.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Every model's upstreams.
#[derive(Debug)]
pub(crate) struct Upstreams {
    client: reqwest::Client,
    models: HashMap<String, Vec<Arc<Upstream>>>,
    turn: AtomicUsize,
    /// Between probes; zero for none.
    probe_every: Duration,
    /// How long a probe may take.
    probe_timeout: Duration,
}

impl Upstreams {
    pub(crate) fn new(config: &GatewayConfig) -> Result<Self, ConfigError> {
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs_f64(config.connect_timeout_s))
            .tcp_nodelay(true)
            .build()
            .map_err(|e| ConfigError::Invalid(format!("the upstream HTTP client: {e}")))?;
        let mut models = HashMap::new();
        for (name, model) in &config.models {
            let mut ups = Vec::with_capacity(model.upstreams.len());
            for u in &model.upstreams {
                let base = u.url.trim_end_matches('/').to_string();
                let urls =
                    Route::ALL.map(|r| reqwest::Url::parse(&format!("{base}{}", r.path())).ok());
                ups.push(Arc::new(Upstream {
                    urls,
                    base,
                    served: u.model.clone(),
                    key: u.api_key()?,
                    in_flight: AtomicUsize::new(0),
                    health: Health::default(),
                }));
            }
            models.insert(name.clone(), ups);
        }
        let probe_timeout =
            Duration::from_secs_f64(config.connect_timeout_s) + Duration::from_secs(5);
        Ok(Self {
            client,
            models,
            turn: AtomicUsize::new(0),
            probe_every: Duration::from_secs_f64(config.health_check_interval_s),
            probe_timeout,
        })
    }

    /// `model`'s upstreams: those in rotation first, fewest in flight first among them.
    fn ordered(&self, model: &str) -> Vec<Arc<Upstream>> {
        let Some(ups) = self.models.get(model) else {
            return Vec::new();
        };
        let n = ups.len();
        if n == 1 {
            return vec![ups[0].clone()];
        }
        let now = Instant::now();
        let turn = self.turn.fetch_add(1, Ordering::Relaxed);
        let mut order: Vec<(bool, usize, usize, Arc<Upstream>)> = ups
            .iter()
            .enumerate()
            .map(|(i, u)| {
                (
                    u.health.ejected(now),
                    u.in_flight.load(Ordering::Relaxed),
                    (i + n - turn % n) % n,
                    u.clone(),
                )
            })
            .collect();
        order.sort_by_key(|(ejected, load, rank, _)| (*ejected, *load, *rank));
        order.into_iter().map(|(_, _, _, u)| u).collect()
    }

    /// Every upstream's health, by model and then in configured order.
    pub(crate) fn status(&self) -> Vec<UpstreamStatus> {
        let now = Instant::now();
        let mut models: Vec<_> = self.models.iter().collect();
        models.sort_by(|a, b| a.0.cmp(b.0));
        models
            .into_iter()
            .flat_map(|(model, ups)| {
                ups.iter().map(move |u| UpstreamStatus {
                    model: model.clone(),
                    url: u.base.clone(),
                    healthy: !u.health.ejected(now),
                    in_flight: u.in_flight.load(Ordering::Relaxed) as u64,
                    connect_errors: u.health.connect_errors.load(Ordering::Relaxed),
                    status_errors: u.health.status_errors.load(Ordering::Relaxed),
                    transport_errors: u.health.transport_errors.load(Ordering::Relaxed),
                    probe_errors: u.health.probe_errors.load(Ordering::Relaxed),
                })
            })
            .collect()
    }

    /// Probes every upstream now and then every `health_check_interval_s`, on the
    /// current tokio runtime, until the gateway is dropped. `None` when probes are off.
    pub(crate) fn spawn_probes(self: &Arc<Self>) -> Option<tokio::task::JoinHandle<()>> {
        if self.probe_every.is_zero() {
            return None;
        }
        let weak: Weak<Self> = Arc::downgrade(self);
        let every = self.probe_every;
        Some(tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(me) = weak.upgrade() else { return };
                me.probe_all().await;
            }
        }))
    }

    /// One probe of every upstream, all at once.
    async fn probe_all(&self) {
        let probes = self
            .models
            .iter()
            .flat_map(|(model, ups)| ups.iter().map(move |u| self.probe(model, u)));
        futures::future::join_all(probes).await;
    }

    async fn probe(&self, model: &str, up: &Upstream) {
        let mut req = self
            .client
            .get(format!("{}/models", up.base))
            .timeout(self.probe_timeout);
        if let Some(key) = &up.key {
            req = req.bearer_auth(key);
        }
        let failure = match req.send().await {
            Ok(resp) if resp.status().as_u16() < 500 => None,
            Ok(resp) => Some(format!("answered {}", resp.status())),
            Err(e) => Some(e.to_string()),
        };
        match failure {
            None => {
                if up.health.restore() {
                    tracing::info!(upstream = %up.base, model, "upstream answers its probe: back in rotation");
                }
            }
            Some(why) => {
                up.health.probe_errors.fetch_add(1, Ordering::Relaxed);
                let was_ejected = up.health.ejected(Instant::now());
                up.health.eject(Instant::now());
                if !was_ejected {
                    tracing::warn!(upstream = %up.base, model, error = %why, "upstream failed its probe: out of rotation");
                }
            }
        }
    }

    /// Sends the request to `model`'s upstreams until one answers.
    pub(crate) async fn forward(
        &self,
        public: &str,
        route: Route,
        request: RequestView,
        body: Bytes,
    ) -> Reply {
        let mut unreachable = Vec::new();
        for up in self.ordered(public) {
            let counted = InFlight::new(&up);
            let mut req = match &up.urls[route.index()] {
                Some(url) => self.client.post(url.clone()),
                None => self.client.post(format!("{}{}", up.base, route.path())),
            }
            .header("content-type", "application/json")
            .body(request.body_for(up.served.as_deref(), &body));
            if let Some(key) = &up.key {
                req = req.bearer_auth(key);
            }
            match req.send().await {
                Ok(resp) => {
                    if resp.status().is_server_error() {
                        up.health.status_errors.fetch_add(1, Ordering::Relaxed);
                    } else {
                        up.health.restore();
                    }
                    return pass_through(resp, request.stream, counted).await;
                }
                Err(e) if e.is_connect() => {
                    up.health.connect_errors.fetch_add(1, Ordering::Relaxed);
                    let out_for = up.health.eject(Instant::now());
                    tracing::warn!(upstream = %up.base, model = public, error = %e, ?out_for, "upstream unreachable: out of rotation, trying the next");
                    unreachable.push(up.base.clone());
                }
                Err(e) => {
                    up.health.transport_errors.fetch_add(1, Ordering::Relaxed);
                    return openai::error(
                        502,
                        format!("the upstream of model {public:?} failed: {e}"),
                        ErrorKind::Api,
                        Some("upstream_error"),
                    );
                }
            }
        }
        openai::error(
            502,
            format!(
                "no upstream of model {public:?} could be reached (tried {})",
                unreachable.join(", ")
            ),
            ErrorKind::Api,
            Some("upstream_unavailable"),
        )
    }
}

/// The upstream's answer as the caller's: its status and the headers worth keeping; a
/// stream passed through chunk by chunk (the upstream request ends when the caller
/// drops it), any other body whole.
async fn pass_through(resp: reqwest::Response, stream: bool, counted: InFlight) -> Reply {
    let status = resp.status().as_u16();
    let headers: Vec<(String, String)> = PASSED_HEADERS
        .iter()
        .filter_map(|name| {
            let v = resp.headers().get(*name)?.to_str().ok()?;
            Some(((*name).to_string(), v.to_string()))
        })
        .collect();
    let body = if stream && status == 200 {
        let chunks = resp
            .bytes_stream()
            .map_err(std::io::Error::other)
            .map(move |chunk| {
                let _counted = &counted;
                chunk
            });
        ReplyBody::Stream(chunks.boxed())
    } else {
        match resp.bytes().await {
            Ok(b) => ReplyBody::Full(b),
            Err(e) => {
                return openai::error(
                    502,
                    format!("reading the upstream's answer: {e}"),
                    ErrorKind::Api,
                    Some("upstream_error"),
                )
            }
        }
    };
    Reply {
        status,
        headers,
        body,
    }
}

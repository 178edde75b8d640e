//! The upstreams of each model: one HTTP client for all, the requests in flight per
//! upstream, and forwarding with failover. A request goes to the upstream with the
//! fewest in flight (ties rotate, so equal upstreams share the load); one that cannot
//! be connected to is skipped for the next. Once an upstream answered, its answer (an
//! error too) is the caller's: a request that reached a model is never sent twice.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

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
                }));
            }
            models.insert(name.clone(), ups);
        }
        Ok(Self {
            client,
            models,
            turn: AtomicUsize::new(0),
        })
    }

    /// `model`'s upstreams, fewest in flight first.
    fn ordered(&self, model: &str) -> Vec<Arc<Upstream>> {
        let Some(ups) = self.models.get(model) else {
            return Vec::new();
        };
        let n = ups.len();
        let turn = self.turn.fetch_add(1, Ordering::Relaxed);
        let mut order: Vec<(usize, usize, Arc<Upstream>)> = ups
            .iter()
            .enumerate()
            .map(|(i, u)| {
                (
                    u.in_flight.load(Ordering::Relaxed),
                    (i + n - turn % n) % n,
                    u.clone(),
                )
            })
            .collect();
        order.sort_by_key(|(load, rank, _)| (*load, *rank));
        order.into_iter().map(|(_, _, u)| u).collect()
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
                Ok(resp) => return pass_through(resp, request.stream, counted).await,
                Err(e) if e.is_connect() => {
                    tracing::warn!(upstream = %up.base, model = public, error = %e, "upstream unreachable: trying the next");
                    unreachable.push(up.base.clone());
                }
                Err(e) => {
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

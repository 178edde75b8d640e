//! What the gateway has carried: per public model and route, how long requests took
//! (histograms with fixed buckets), their status classes, the first chunk's delay of
//! streams and the model tokens the upstreams reported ([`Traffic`], for `/metrics`);
//! and per caller, its requests, tokens, cached answers and refusals ([`CallerUsage`],
//! for `/v1/usage`).
//!
//! The hot path takes no lock and allocates nothing: the models are fixed when the
//! gateway starts, so their counters are made then, found by name in a map that is
//! only read afterwards; a caller's counters live in its caller. Each request carries a
//! [`Tally`] that writes its figures with relaxed atomics when it is dropped, for a
//! stream when the stream ends or its caller goes away.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::openai::UsageTokens;
use crate::Route;

/// Upper bounds of the latency histograms' buckets, seconds (a last one, `+Inf`,
/// catches the rest): from a cache hit (ms) to a long generation (minutes).
pub const LATENCY_BUCKETS_S: [f64; 15] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// [`LATENCY_BUCKETS_S`] in µs, what samples are compared with.
const LATENCY_BUCKETS_US: [u64; 15] = [
    5_000,
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    30_000_000,
    60_000_000,
    120_000_000,
    300_000_000,
];

const BUCKETS: usize = LATENCY_BUCKETS_US.len() + 1;

/// A latency histogram of atomics: a count per bucket (not cumulative) and the sum.
#[derive(Debug, Default)]
pub(crate) struct Histogram {
    counts: [AtomicU64; BUCKETS],
    sum_us: AtomicU64,
}

/// The bucket a sample of `us` falls in: the first whose bound is at least it
/// (Prometheus' `le`), the last for any above every bound.
fn bucket_of(us: u64) -> usize {
    LATENCY_BUCKETS_US.partition_point(|&bound| bound < us)
}

impl Histogram {
    pub(crate) fn observe(&self, took: Duration) {
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        self.counts[bucket_of(us)].fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
    }

    fn snapshot(&self) -> HistogramSnapshot {
        let counts: Vec<u64> = self
            .counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect();
        HistogramSnapshot {
            count: counts.iter().sum(),
            counts,
            sum_s: self.sum_us.load(Ordering::Relaxed) as f64 / 1e6,
        }
    }
}

/// A latency histogram at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    /// Samples per bucket of [`LATENCY_BUCKETS_S`], not cumulative, then those above
    /// every bound.
    pub counts: Vec<u64>,
    /// Sum of the samples, seconds.
    pub sum_s: f64,
    /// Number of samples.
    pub count: u64,
}

impl HistogramSnapshot {
    /// `(upper bound, samples in that bucket)`, the last bound `f64::INFINITY`.
    pub fn buckets(&self) -> impl Iterator<Item = (f64, u64)> + '_ {
        LATENCY_BUCKETS_S
            .iter()
            .copied()
            .chain(std::iter::once(f64::INFINITY))
            .zip(self.counts.iter().copied())
    }
}

/// The status classes requests are counted by: `1xx` to `5xx`.
pub const STATUS_CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

fn class_of(status: u16) -> usize {
    usize::from(status / 100).clamp(1, 5) - 1
}

#[derive(Debug, Default)]
struct RouteCounters {
    duration: Histogram,
    codes: [AtomicU64; STATUS_CLASSES.len()],
}

/// One configured model's counters.
#[derive(Debug, Default)]
pub(crate) struct ModelCounters {
    routes: [RouteCounters; Route::ALL.len()],
    ttft: Histogram,
    prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
}

/// The counters of every configured model, made at start.
#[derive(Debug, Default)]
pub(crate) struct Traffic {
    models: BTreeMap<String, Arc<ModelCounters>>,
}

impl Traffic {
    pub(crate) fn new<'a>(models: impl IntoIterator<Item = &'a String>) -> Self {
        Self {
            models: models
                .into_iter()
                .map(|m| (m.clone(), Arc::default()))
                .collect(),
        }
    }

    pub(crate) fn model(&self, name: &str) -> Option<&Arc<ModelCounters>> {
        self.models.get(name)
    }

    pub(crate) fn snapshot(&self) -> Vec<ModelTraffic> {
        self.models
            .iter()
            .map(|(model, c)| ModelTraffic {
                model: model.clone(),
                routes: Route::ALL
                    .iter()
                    .zip(&c.routes)
                    .map(|(&route, r)| RouteTraffic {
                        route,
                        codes: std::array::from_fn(|i| r.codes[i].load(Ordering::Relaxed)),
                        duration: r.duration.snapshot(),
                    })
                    .filter(|r| r.codes.iter().any(|&n| n > 0))
                    .collect(),
                ttft: c.ttft.snapshot(),
                prompt_tokens: c.prompt_tokens.load(Ordering::Relaxed),
                completion_tokens: c.completion_tokens.load(Ordering::Relaxed),
            })
            .collect()
    }
}

/// What one configured model has carried since the gateway started
/// ([`crate::Gateway::traffic`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelTraffic {
    /// Its public name.
    pub model: String,
    /// Per route that had requests.
    pub routes: Vec<RouteTraffic>,
    /// Streams: time from the request to the first event reaching the caller.
    pub ttft: HistogramSnapshot,
    /// Prompt tokens the upstreams' `usage` reported.
    pub prompt_tokens: u64,
    /// Completion tokens the upstreams' `usage` reported.
    pub completion_tokens: u64,
}

/// Requests of one model on one route.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteTraffic {
    /// The route.
    pub route: Route,
    /// Answers by status class ([`STATUS_CLASSES`]).
    pub codes: [u64; STATUS_CLASSES.len()],
    /// Time to the whole answer (a stream: to its end, or to its caller leaving).
    pub duration: HistogramSnapshot,
}

/// A caller's live counters, and its tenant's (which every count goes to as well).
#[derive(Debug, Default)]
pub(crate) struct UsageCounters {
    requests: AtomicU64,
    prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    cached_answers: AtomicU64,
    limited: AtomicU64,
    /// The counters of the caller's tenant, if it has one.
    tenant: Option<Arc<UsageCounters>>,
}

impl UsageCounters {
    /// Counters that also count into `tenant`'s.
    pub(crate) fn of_tenant(tenant: Arc<UsageCounters>) -> Self {
        Self {
            tenant: Some(tenant),
            ..Self::default()
        }
    }

    /// `self` and its tenant's.
    fn each(&self) -> impl Iterator<Item = &UsageCounters> {
        std::iter::once(self).chain(self.tenant.as_deref())
    }

    fn request(&self) {
        for c in self.each() {
            c.requests.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn tokens(&self, u: UsageTokens) {
        for c in self.each() {
            c.prompt_tokens.fetch_add(u.prompt, Ordering::Relaxed);
            c.completion_tokens
                .fetch_add(u.completion, Ordering::Relaxed);
        }
    }

    pub(crate) fn cached_answer(&self) {
        for c in self.each() {
            c.cached_answers.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(crate) fn limited(&self) {
        for c in self.each() {
            c.limited.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// One tenant's usage through its sandbox tokens since the gateway started: the sum
/// over its tokens, those gone included. The JSON items of `GET /v1/usage/tenants`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TenantUsage {
    /// The tenant.
    pub tenant: String,
    /// Its tokens' callers held now (used since the last sweep of gone tokens).
    pub tokens_held: u64,
    /// Requests for models its tokens may call, refused ones included.
    pub requests: u64,
    /// Prompt tokens the upstreams reported.
    pub prompt_tokens: u64,
    /// Completion tokens the upstreams reported.
    pub completion_tokens: u64,
    /// Answers from the cache or from an identical request's call.
    pub cached_answers: u64,
    /// Requests refused by a limit (its tokens' or the tenant's shared ones) or a
    /// used-up budget.
    pub limited: u64,
}

impl TenantUsage {
    pub(crate) fn of(tenant: &str, u: &UsageCounters, tokens_held: u64) -> Self {
        Self {
            tenant: tenant.to_string(),
            tokens_held,
            requests: u.requests.load(Ordering::Relaxed),
            prompt_tokens: u.prompt_tokens.load(Ordering::Relaxed),
            completion_tokens: u.completion_tokens.load(Ordering::Relaxed),
            cached_answers: u.cached_answers.load(Ordering::Relaxed),
            limited: u.limited.load(Ordering::Relaxed),
        }
    }
}

/// Which kind of caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CallerKind {
    /// One of the configured `api_keys`.
    Key,
    /// A sandbox token ([`crate::grants`]).
    Token,
}

/// One caller's usage since the gateway started (for a token: since its caller was
/// made; a token gone is swept out with its caller). The JSON of `GET /v1/usage`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CallerUsage {
    /// A configured key's name, or a token's grant name (`tenant/sandbox`).
    pub caller: String,
    /// `key` or `token`.
    pub kind: CallerKind,
    /// A token's id (never its secret).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_id: Option<String>,
    /// A token's tenant, if its grant names one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Requests for models it may call, refused ones included.
    pub requests: u64,
    /// Prompt tokens the upstreams reported for its calls.
    pub prompt_tokens: u64,
    /// Completion tokens the upstreams reported for its calls.
    pub completion_tokens: u64,
    /// Answers from the cache or from an identical request's call.
    pub cached_answers: u64,
    /// Requests refused by one of its limits or its used-up budget (429).
    pub limited: u64,
    /// Model tokens charged to it: reported usage, estimates for streams that gave
    /// none, and cached answers; what its budget is counted against (with a spend
    /// ledger, what other gateways charged to it too).
    pub spent_tokens: u64,
    /// Its budget of model tokens, `null` for none.
    pub budget_tokens: Option<u64>,
    /// What is left of it, `null` for no budget.
    pub budget_left: Option<u64>,
}

impl CallerUsage {
    pub(crate) fn of(caller: &crate::Caller) -> Self {
        let u = &caller.usage;
        let spent = caller.limits.spent_in_all();
        let budget = caller.limits.budget();
        Self {
            caller: caller.name.clone(),
            kind: if caller.token_id.is_some() {
                CallerKind::Token
            } else {
                CallerKind::Key
            },
            token_id: caller.token_id.clone(),
            tenant: caller.tenant_name.clone(),
            requests: u.requests.load(Ordering::Relaxed),
            prompt_tokens: u.prompt_tokens.load(Ordering::Relaxed),
            completion_tokens: u.completion_tokens.load(Ordering::Relaxed),
            cached_answers: u.cached_answers.load(Ordering::Relaxed),
            limited: u.limited.load(Ordering::Relaxed),
            spent_tokens: spent,
            budget_tokens: budget,
            budget_left: budget.map(|b| b.saturating_sub(spent)),
        }
    }
}

/// One request's figures, written to its model's and its caller's counters when it is
/// dropped: when the answer is whole, or when a stream ends or is dropped.
#[derive(Debug)]
pub(crate) struct Tally {
    model: Arc<ModelCounters>,
    route: usize,
    caller: Arc<UsageCounters>,
    started: Instant,
    status: u16,
    usage: Option<UsageTokens>,
    first_seen: bool,
}

impl Tally {
    /// A request of `route` to `model` by `caller`, started at `started`; it counts as
    /// one of the caller's requests now.
    pub(crate) fn new(
        model: Arc<ModelCounters>,
        route: Route,
        caller: Arc<UsageCounters>,
        started: Instant,
    ) -> Self {
        caller.request();
        Self {
            model,
            route: route.index(),
            caller,
            started,
            status: 500,
            usage: None,
            first_seen: false,
        }
    }

    /// The status answered.
    pub(crate) fn set_status(&mut self, status: u16) {
        self.status = status;
    }

    /// The usage the upstream reported.
    pub(crate) fn set_usage(&mut self, usage: UsageTokens) {
        self.usage = Some(usage);
    }

    /// A stream's first event reached the caller (counted once).
    pub(crate) fn first_chunk(&mut self) {
        if !self.first_seen {
            self.first_seen = true;
            self.model.ttft.observe(self.started.elapsed());
        }
    }
}

impl Drop for Tally {
    fn drop(&mut self) {
        let route = &self.model.routes[self.route];
        route.duration.observe(self.started.elapsed());
        route.codes[class_of(self.status)].fetch_add(1, Ordering::Relaxed);
        if let Some(u) = self.usage {
            let m = &self.model;
            m.prompt_tokens.fetch_add(u.prompt, Ordering::Relaxed);
            m.completion_tokens
                .fetch_add(u.completion, Ordering::Relaxed);
            self.caller.tokens(u);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_fall_in_the_first_bucket_whose_bound_holds_them() {
        assert_eq!(bucket_of(0), 0);
        assert_eq!(bucket_of(5_000), 0, "a bound holds its own value (le)");
        assert_eq!(bucket_of(5_001), 1);
        assert_eq!(bucket_of(999_999), 7);
        assert_eq!(bucket_of(1_000_000), 7);
        assert_eq!(bucket_of(300_000_000), 14);
        assert_eq!(bucket_of(300_000_001), 15, "above every bound: +Inf");
        assert_eq!(bucket_of(u64::MAX), 15);
        for (s, us) in LATENCY_BUCKETS_S.iter().zip(LATENCY_BUCKETS_US) {
            assert_eq!((s * 1e6).round() as u64, us);
        }

        let h = Histogram::default();
        for ms in [1, 5, 7, 700, 400_000] {
            h.observe(Duration::from_millis(ms));
        }
        h.observe(Duration::MAX);
        let s = h.snapshot();
        assert_eq!(s.count, 6);
        let buckets: Vec<(f64, u64)> = s.buckets().filter(|&(_, n)| n > 0).collect();
        assert_eq!(
            buckets,
            [(0.005, 2), (0.01, 1), (1.0, 1), (f64::INFINITY, 2)]
        );
        assert_eq!(s.buckets().count(), LATENCY_BUCKETS_S.len() + 1);
    }

    #[test]
    fn statuses_are_counted_by_class() {
        assert_eq!(
            [100, 200, 204, 301, 404, 429, 500, 504].map(class_of),
            [0, 1, 1, 2, 3, 3, 4, 4]
        );
        assert_eq!(class_of(0), 0);
        assert_eq!(class_of(999), 4);
    }

    #[test]
    fn a_tally_writes_its_request_when_dropped() {
        let traffic = Traffic::new(&["m".to_string()]);
        let model = traffic.model("m").expect("configured").clone();
        let caller = Arc::new(UsageCounters::default());
        let mut t = Tally::new(
            model.clone(),
            Route::Embeddings,
            caller.clone(),
            Instant::now(),
        );
        assert_eq!(caller.requests.load(Ordering::Relaxed), 1);
        t.set_status(200);
        t.set_usage(UsageTokens {
            total: 7,
            prompt: 3,
            completion: 4,
        });
        t.first_chunk();
        t.first_chunk();
        assert_eq!(traffic.snapshot()[0].routes, [], "nothing until dropped");
        drop(t);
        let mut t = Tally::new(model, Route::Embeddings, caller.clone(), Instant::now());
        t.set_status(429);
        drop(t);
        let snap = &traffic.snapshot()[0];
        assert_eq!(snap.routes.len(), 1);
        assert_eq!(snap.routes[0].route, Route::Embeddings);
        assert_eq!(snap.routes[0].codes, [0, 1, 0, 1, 0]);
        assert_eq!(snap.routes[0].duration.count, 2);
        assert_eq!(snap.ttft.count, 1, "the first chunk is timed once");
        assert_eq!((snap.prompt_tokens, snap.completion_tokens), (3, 4));
        assert_eq!(caller.prompt_tokens.load(Ordering::Relaxed), 3);
        assert_eq!(caller.completion_tokens.load(Ordering::Relaxed), 4);
        assert_eq!(caller.requests.load(Ordering::Relaxed), 2);
        assert!(traffic.model("other").is_none());
    }
}

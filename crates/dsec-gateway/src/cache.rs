//! The response cache and the coalescing of identical requests ("flights").
//!
//! Only deterministic requests are eligible: chat completions and completions that do
//! not stream and have `temperature: 0` or a `seed`, and embeddings; a caller opts out
//! with `Cache-Control: no-cache`. The key is the SHA-256 of the caller's name (keys of
//! one name share answers; other callers never see them, so the cache is no timing
//! side channel between tenants), the route, the public model and the body as
//! canonical JSON (keys sorted, integral numbers written as integers) without `stream`,
//! `stream_options` and `user`.
//!
//! Only 200s are stored, each at most `max_entry_bytes`, all together at most
//! `max_bytes` (least recently used out first), each for `ttl_s`.
//!
//! A request whose key has a call upstream in flight waits for that call's answer
//! instead of making its own. The call runs in a task of its own, so the request that
//! started it may go away while others wait; when every request waiting on it has gone,
//! the task is aborted, which closes the upstream request.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use serde::Deserialize;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use tokio::sync::watch;
use tokio::task::AbortHandle;

use crate::limits::Clock;
use crate::Route;

/// Cache sizes by default: 256 MiB in all.
pub const DEFAULT_MAX_BYTES: u64 = 256 << 20;
/// The longest answer stored by default (1 MiB).
pub const DEFAULT_MAX_ENTRY_BYTES: u64 = 1 << 20;
/// How long an answer is kept by default (10 minutes).
pub const DEFAULT_TTL_S: f64 = 600.0;

/// Bytes an entry costs beyond its body and headers (its key, the maps' nodes).
const ENTRY_OVERHEAD: u64 = 128;

/// The `cache:` section of the configuration.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheConfig {
    /// Bytes all stored answers may take; 0 turns the cache and coalescing off.
    #[serde(default = "default_max_bytes")]
    pub max_bytes: u64,
    /// The longest answer stored (bytes).
    #[serde(default = "default_max_entry_bytes")]
    pub max_entry_bytes: u64,
    /// Seconds an answer is kept.
    #[serde(default = "default_ttl")]
    pub ttl_s: f64,
}

fn default_max_bytes() -> u64 {
    DEFAULT_MAX_BYTES
}

fn default_max_entry_bytes() -> u64 {
    DEFAULT_MAX_ENTRY_BYTES
}

fn default_ttl() -> f64 {
    DEFAULT_TTL_S
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            max_bytes: DEFAULT_MAX_BYTES,
            max_entry_bytes: DEFAULT_MAX_ENTRY_BYTES,
            ttl_s: DEFAULT_TTL_S,
        }
    }
}

impl CacheConfig {
    /// Whether it caches at all.
    pub fn enabled(&self) -> bool {
        self.max_bytes > 0
    }

    /// Checks the values; the error says what to fix.
    pub fn check(&self) -> Result<(), String> {
        if !(self.ttl_s.is_finite() && self.ttl_s > 0.0) {
            return Err("cache.ttl_s: must be a positive number of seconds".into());
        }
        if self.max_entry_bytes == 0 {
            return Err("cache.max_entry_bytes: must be above 0".into());
        }
        Ok(())
    }
}

/// A cache key: the SHA-256 described in the module docs.
pub type Key = [u8; 32];

/// The members of a request body [`eligible`] reads.
pub const ELIGIBILITY_FIELDS: &[&str] = &["stream", "temperature", "seed"];

/// Whether a request of `route` with `body` (its [`ELIGIBILITY_FIELDS`] at least) may
/// be answered from the cache.
pub fn eligible(route: Route, body: &Map<String, Value>) -> bool {
    // A flight shares a whole answer: streams pass through instead.
    if body.get("stream").and_then(Value::as_bool) == Some(true) {
        return false;
    }
    match route {
        Route::Embeddings => true,
        Route::ChatCompletions | Route::Completions => {
            let greedy = body
                .get("temperature")
                .and_then(Value::as_f64)
                .is_some_and(|t| t == 0.0);
            let seeded = body.get("seed").is_some_and(|s| !s.is_null());
            greedy || seeded
        }
    }
}

/// The cache key of a request (see the module docs).
pub fn key(scope: &str, route: Route, model: &str, body: &Map<String, Value>) -> Key {
    let mut text = Vec::with_capacity(256);
    let mut fields: Vec<(&String, &Value)> = body
        .iter()
        .filter(|(k, _)| !matches!(k.as_str(), "stream" | "stream_options" | "user"))
        .collect();
    fields.sort_by(|a, b| a.0.cmp(b.0));
    text.push(b'{');
    for (i, (k, v)) in fields.into_iter().enumerate() {
        if i > 0 {
            text.push(b',');
        }
        canonical_string(k, &mut text);
        text.push(b':');
        canonical(v, &mut text);
    }
    text.push(b'}');
    let mut h = Sha256::new();
    for part in [scope.as_bytes(), route.path().as_bytes(), model.as_bytes()] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part);
    }
    h.update(&text);
    h.finalize().into()
}

fn canonical_string(s: &str, out: &mut Vec<u8>) {
    // Writing a string into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

/// `v` as canonical JSON: object keys sorted, integral numbers as integers.
fn canonical(v: &Value, out: &mut Vec<u8>) {
    match v {
        Value::Null | Value::Bool(_) => out.extend_from_slice(v.to_string().as_bytes()),
        Value::Number(n) => {
            let integral = n
                .as_f64()
                .filter(|f| f.fract() == 0.0 && f.abs() < 9.0e15)
                .filter(|_| n.is_f64());
            match integral {
                Some(f) => out.extend_from_slice((f as i64).to_string().as_bytes()),
                None => out.extend_from_slice(n.to_string().as_bytes()),
            }
        }
        Value::String(s) => canonical_string(s, out),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                canonical(item, out);
            }
            out.push(b']');
        }
        Value::Object(map) => {
            let mut fields: Vec<(&String, &Value)> = map.iter().collect();
            fields.sort_by(|a, b| a.0.cmp(b.0));
            out.push(b'{');
            for (i, (k, v)) in fields.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                canonical_string(k, out);
                out.push(b':');
                canonical(v, out);
            }
            out.push(b'}');
        }
    }
}

/// An upstream's whole answer, as stored and as shared by a flight.
#[derive(Debug, Clone)]
pub struct Answer {
    /// HTTP status.
    pub status: u16,
    /// The headers passed on.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Bytes,
    /// The tokens its `usage` reported.
    pub usage: Option<crate::openai::UsageTokens>,
}

impl Answer {
    fn size(&self) -> u64 {
        let headers: usize = self.headers.iter().map(|(n, v)| n.len() + v.len()).sum();
        (self.body.len() + headers) as u64 + ENTRY_OVERHEAD
    }
}

/// How the cache took part in an answer (the `x-dsec-cache` header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheUse {
    /// Answered from the cache.
    Hit,
    /// Asked upstream, stored if it was a 200.
    Miss,
    /// Waited for an identical request's call upstream.
    Coalesced,
    /// Not eligible, opted out, or the cache is off.
    Bypass,
}

impl CacheUse {
    /// The header's value.
    pub fn as_str(self) -> &'static str {
        match self {
            CacheUse::Hit => "hit",
            CacheUse::Miss => "miss",
            CacheUse::Coalesced => "coalesced",
            CacheUse::Bypass => "bypass",
        }
    }
}

/// The cache's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Answers from the cache.
    pub hits: u64,
    /// Eligible requests that went upstream.
    pub misses: u64,
    /// Requests that waited for an identical one's call.
    pub coalesced: u64,
    /// Requests that did not use the cache.
    pub bypassed: u64,
    /// Answers removed to make room (not those past their TTL).
    pub evictions: u64,
    /// Answers stored now.
    pub entries: u64,
    /// Bytes they take.
    pub bytes: u64,
}

#[derive(Debug)]
struct Entry {
    answer: Arc<Answer>,
    size: u64,
    expires: Duration,
    /// Its place in `Inner::lru`.
    used: u64,
}

/// A call upstream that requests are waiting on.
#[derive(Debug)]
struct Flight {
    answer: watch::Receiver<Option<Arc<Answer>>>,
    /// The requests waiting (guarded by the cache's lock).
    waiters: usize,
    task: Option<AbortHandle>,
}

#[derive(Debug, Default)]
struct Inner {
    entries: HashMap<Key, Entry>,
    /// Use order: tick -> key, least recent first.
    lru: BTreeMap<u64, Key>,
    tick: u64,
    bytes: u64,
    flights: HashMap<Key, Flight>,
}

impl Inner {
    fn remove(&mut self, key: &Key) {
        if let Some(e) = self.entries.remove(key) {
            self.lru.remove(&e.used);
            self.bytes -= e.size;
        }
    }
}

#[derive(Debug, Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    coalesced: AtomicU64,
    bypassed: AtomicU64,
    evictions: AtomicU64,
}

/// The response cache and its flights; see the module docs.
pub struct Cache {
    config: CacheConfig,
    clock: Clock,
    inner: Mutex<Inner>,
    counters: Counters,
}

impl std::fmt::Debug for Cache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cache")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// What a lookup found.
#[derive(Debug)]
pub enum Lookup {
    /// A stored answer.
    Hit(Arc<Answer>),
    /// A call in flight to wait for.
    Wait(Waiter),
    /// Nothing: the caller is to start the call ([`Leader::start`]).
    Lead(Leader),
}

/// The right to start a flight's call.
#[derive(Debug)]
pub struct Leader {
    waiter: Waiter,
    done: watch::Sender<Option<Arc<Answer>>>,
}

/// A request waiting on a flight. Dropping the last one aborts the flight's call.
#[derive(Debug)]
pub struct Waiter {
    cache: Arc<Cache>,
    key: Key,
    answer: watch::Receiver<Option<Arc<Answer>>>,
}

impl Cache {
    /// A cache of `config` whose TTLs read `clock`.
    pub fn new(config: CacheConfig, clock: Clock) -> Self {
        Self {
            config,
            clock,
            inner: Mutex::default(),
            counters: Counters::default(),
        }
    }

    /// Its configuration.
    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts a request that did not use the cache.
    pub fn bypassed(&self) {
        self.counters.bypassed.fetch_add(1, Ordering::Relaxed);
    }

    /// Its counters.
    pub fn stats(&self) -> CacheStats {
        let (entries, bytes) = {
            let inner = self.lock();
            (inner.entries.len() as u64, inner.bytes)
        };
        CacheStats {
            hits: self.counters.hits.load(Ordering::Relaxed),
            misses: self.counters.misses.load(Ordering::Relaxed),
            coalesced: self.counters.coalesced.load(Ordering::Relaxed),
            bypassed: self.counters.bypassed.load(Ordering::Relaxed),
            evictions: self.counters.evictions.load(Ordering::Relaxed),
            entries,
            bytes,
        }
    }

    /// The stored answer for `key`, else the flight to wait on, else the right to start
    /// one.
    pub fn lookup(self: &Arc<Self>, key: Key) -> Lookup {
        let now = (self.clock)();
        let mut inner = self.lock();
        if let Some(e) = inner.entries.get(&key) {
            if e.expires > now {
                let answer = e.answer.clone();
                let old = e.used;
                inner.tick += 1;
                let tick = inner.tick;
                inner.lru.remove(&old);
                inner.lru.insert(tick, key);
                if let Some(e) = inner.entries.get_mut(&key) {
                    e.used = tick;
                }
                drop(inner);
                self.counters.hits.fetch_add(1, Ordering::Relaxed);
                return Lookup::Hit(answer);
            }
            inner.remove(&key);
        }
        if let Some(flight) = inner.flights.get_mut(&key) {
            flight.waiters += 1;
            let answer = flight.answer.clone();
            drop(inner);
            self.counters.coalesced.fetch_add(1, Ordering::Relaxed);
            return Lookup::Wait(Waiter {
                cache: self.clone(),
                key,
                answer,
            });
        }
        let (done, answer) = watch::channel(None);
        inner.flights.insert(
            key,
            Flight {
                answer: answer.clone(),
                waiters: 1,
                task: None,
            },
        );
        drop(inner);
        self.counters.misses.fetch_add(1, Ordering::Relaxed);
        Lookup::Lead(Leader {
            waiter: Waiter {
                cache: self.clone(),
                key,
                answer,
            },
            done,
        })
    }

    /// Stores `answer` under `key` if it is a 200 that fits, evicting the least
    /// recently used answers to make room.
    fn store(&self, key: Key, answer: &Arc<Answer>) {
        let size = answer.size();
        if answer.status != 200 || size > self.config.max_entry_bytes + ENTRY_OVERHEAD {
            return;
        }
        if size > self.config.max_bytes {
            return;
        }
        let ttl = Duration::try_from_secs_f64(self.config.ttl_s).unwrap_or(Duration::MAX);
        let expires = (self.clock)().saturating_add(ttl);
        let mut inner = self.lock();
        inner.remove(&key);
        let mut evicted = 0;
        while inner.bytes + size > self.config.max_bytes {
            let Some((_, oldest)) = inner.lru.pop_first() else {
                break;
            };
            if let Some(e) = inner.entries.remove(&oldest) {
                inner.bytes -= e.size;
                evicted += 1;
            }
        }
        inner.tick += 1;
        let used = inner.tick;
        inner.lru.insert(used, key);
        inner.bytes += size;
        inner.entries.insert(
            key,
            Entry {
                answer: answer.clone(),
                size,
                expires,
                used,
            },
        );
        drop(inner);
        self.counters
            .evictions
            .fetch_add(evicted, Ordering::Relaxed);
    }

    /// The end of `key`'s flight: stores its answer, and lets its waiters see it.
    fn land(&self, key: Key, answer: Arc<Answer>, done: &watch::Sender<Option<Arc<Answer>>>) {
        self.store(key, &answer);
        {
            let mut inner = self.lock();
            // Only this flight: one that was aborted was removed, and a new one for the
            // same key is not this one's to end.
            if inner
                .flights
                .get(&key)
                .is_some_and(|f| f.answer.same_channel(&done.subscribe()))
            {
                inner.flights.remove(&key);
            }
        }
        done.send_replace(Some(answer));
    }
}

impl Leader {
    /// Starts the flight's call, `call`, in a task of its own; answers the leader's
    /// place among its waiters.
    pub fn start<F>(self, call: F) -> Waiter
    where
        F: Future<Output = Answer> + Send + 'static,
    {
        let Leader { waiter, done } = self;
        let cache = waiter.cache.clone();
        let key = waiter.key;
        let task = tokio::spawn(async move {
            let answer = Arc::new(call.await);
            cache.land(key, answer, &done);
        });
        let mut inner = waiter.cache.lock();
        if let Some(f) = inner.flights.get_mut(&key) {
            if f.answer.same_channel(&waiter.answer) {
                f.task = Some(task.abort_handle());
            }
        }
        drop(inner);
        waiter
    }
}

impl Waiter {
    /// The flight's answer, once it has landed; `None` if its call ended without one
    /// (it panicked).
    pub async fn answer(&mut self) -> Option<Arc<Answer>> {
        match self.answer.wait_for(Option::is_some).await {
            Ok(a) => a.clone(),
            Err(_) => None,
        }
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let mut inner = self.cache.lock();
        let Some(flight) = inner.flights.get_mut(&self.key) else {
            return;
        };
        if !flight.answer.same_channel(&self.answer) {
            return;
        }
        flight.waiters = flight.waiters.saturating_sub(1);
        if flight.waiters == 0 {
            if let Some(task) = flight.task.take() {
                task.abort();
            }
            inner.flights.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use serde_json::json;

    use super::*;
    use crate::limits::tests::manual_clock;

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => Map::new(),
        }
    }

    #[test]
    fn the_key_ignores_field_order_numbers_format_stream_and_user() {
        let a = obj(
            json!({"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}),
        );
        let b = obj(
            json!({"messages": [{"content": "hi", "role": "user"}], "max_tokens": 5.0, "user": "u1", "stream": false, "stream_options": null, "temperature": 0.0, "model": "m"}),
        );
        let k = |scope: &str, route: Route, model: &str, body: &Map<String, Value>| {
            key(scope, route, model, body)
        };
        assert_eq!(
            k("t", Route::ChatCompletions, "m", &a),
            k("t", Route::ChatCompletions, "m", &b)
        );
        let c = obj(
            json!({"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "hi!"}], "max_tokens": 5}),
        );
        let base = k("t", Route::ChatCompletions, "m", &a);
        for other in [
            k("t", Route::ChatCompletions, "m", &c),
            k("u", Route::ChatCompletions, "m", &a),
            k("t", Route::Completions, "m", &a),
            k("t", Route::ChatCompletions, "m2", &a),
            // Length-prefixed parts: moving a byte from one part to the next is a
            // different key.
            k("tC", Route::ChatCompletions, "m", &a),
        ] {
            assert_ne!(base, other);
        }
        assert_eq!(
            {
                let mut v = Vec::new();
                canonical(
                    &json!({"b": [1.5, 2.0, -0.0, 1e300], "a": {"y": null, "x": "é\"\n"}}),
                    &mut v,
                );
                String::from_utf8(v).expect("utf-8")
            },
            r#"{"a":{"x":"é\"\n","y":null},"b":[1.5,2,0,1e+300]}"#
        );
    }

    #[test]
    fn only_deterministic_requests_are_eligible() {
        let chat = Route::ChatCompletions;
        assert!(eligible(chat, &obj(json!({"temperature": 0}))));
        assert!(eligible(chat, &obj(json!({"temperature": 0.0}))));
        assert!(eligible(chat, &obj(json!({"seed": 7, "temperature": 1}))));
        assert!(
            !eligible(chat, &obj(json!({}))),
            "temperature defaults to 1"
        );
        assert!(!eligible(chat, &obj(json!({"temperature": 0.2}))));
        assert!(!eligible(chat, &obj(json!({"seed": null}))));
        assert!(!eligible(
            chat,
            &obj(json!({"temperature": 0, "stream": true}))
        ));
        assert!(eligible(Route::Completions, &obj(json!({"seed": 1}))));
        assert!(eligible(Route::Embeddings, &obj(json!({"input": "x"}))));
        assert!(!eligible(
            Route::Embeddings,
            &obj(json!({"input": "x", "stream": true}))
        ));
    }

    fn answer(status: u16, body_len: usize) -> Answer {
        Answer {
            status,
            headers: Vec::new(),
            body: Bytes::from(vec![b'x'; body_len]),
            usage: Some(crate::openai::UsageTokens {
                total: 1,
                ..Default::default()
            }),
        }
    }

    fn k(n: u8) -> Key {
        [n; 32]
    }

    /// Stores `a` under `key` through a flight, as a request would.
    async fn fill(cache: &Arc<Cache>, key: Key, a: Answer) {
        match cache.lookup(key) {
            Lookup::Lead(leader) => {
                let mut w = leader.start(async move { a });
                w.answer().await.expect("an answer");
            }
            other => panic!("expected to lead: {other:?}"),
        }
    }

    #[tokio::test]
    async fn answers_are_kept_by_bytes_least_recently_used_out_and_for_their_ttl() {
        let (clock, ms) = manual_clock();
        let each = 1000 + ENTRY_OVERHEAD;
        let cache = Arc::new(Cache::new(
            CacheConfig {
                max_bytes: 3 * each,
                max_entry_bytes: 2000,
                ttl_s: 10.0,
            },
            clock,
        ));
        for n in 1..=3 {
            fill(&cache, k(n), answer(200, 1000)).await;
        }
        assert_eq!(cache.stats().bytes, 3 * each);
        // 1 is used, so 2 is the least recently used when 4 needs room.
        assert!(matches!(cache.lookup(k(1)), Lookup::Hit(_)));
        fill(&cache, k(4), answer(200, 1000)).await;
        let s = cache.stats();
        assert_eq!((s.entries, s.bytes, s.evictions), (3, 3 * each, 1));
        assert!(matches!(cache.lookup(k(1)), Lookup::Hit(_)));
        assert!(matches!(cache.lookup(k(4)), Lookup::Hit(_)));
        assert!(matches!(cache.lookup(k(2)), Lookup::Lead(_)), "evicted");
        // Too big, or not a 200: not stored.
        fill(&cache, k(5), answer(200, 3000)).await;
        fill(&cache, k(6), answer(500, 10)).await;
        assert!(matches!(cache.lookup(k(5)), Lookup::Lead(_)));
        assert!(matches!(cache.lookup(k(6)), Lookup::Lead(_)));
        // Past the TTL: gone, and its bytes with it.
        ms.fetch_add(10_001, Ordering::SeqCst);
        assert!(matches!(cache.lookup(k(1)), Lookup::Lead(_)));
        assert_eq!(cache.stats().bytes, 2 * each);
        let s = cache.stats();
        assert_eq!(s.hits, 3);
    }

    #[tokio::test]
    async fn identical_requests_share_one_call_which_ends_when_the_last_waiter_goes() {
        let (clock, _) = manual_clock();
        let cache = Arc::new(Cache::new(CacheConfig::default(), clock));
        // A call that never ends by itself, noting when it is dropped (aborted).
        let dropped = Arc::new(AtomicBool::new(false));
        struct NoteDrop(Arc<AtomicBool>);
        impl Drop for NoteDrop {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let note = NoteDrop(dropped.clone());
        let Lookup::Lead(leader) = cache.lookup(k(1)) else {
            panic!("the first leads");
        };
        let lead = leader.start(async move {
            let _note = note;
            std::future::pending::<Answer>().await
        });
        let Lookup::Wait(second) = cache.lookup(k(1)) else {
            panic!("the second waits");
        };
        // The leader leaves: the call goes on for the one still waiting.
        drop(lead);
        tokio::task::yield_now().await;
        assert!(!dropped.load(Ordering::SeqCst));
        drop(second);
        // The last one gone: the call is aborted, and the next request leads anew.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !dropped.load(Ordering::SeqCst) {
            assert!(std::time::Instant::now() < deadline, "never aborted");
            tokio::task::yield_now().await;
        }
        assert!(matches!(cache.lookup(k(1)), Lookup::Lead(_)));

        // A flight that lands: every waiter gets the same answer, and it is stored.
        let Lookup::Lead(leader) = cache.lookup(k(2)) else {
            panic!("leads");
        };
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let mut lead = leader.start(async move {
            let _ = rx.await;
            answer(200, 5)
        });
        let mut waiters: Vec<Waiter> = (0..3)
            .map(|_| match cache.lookup(k(2)) {
                Lookup::Wait(w) => w,
                other => panic!("expected to wait: {other:?}"),
            })
            .collect();
        let _ = tx.send(());
        let first = lead.answer().await.expect("answer");
        for w in &mut waiters {
            let a = w.answer().await.expect("answer");
            assert!(Arc::ptr_eq(&a, &first));
        }
        assert!(matches!(cache.lookup(k(2)), Lookup::Hit(_)));
        let s = cache.stats();
        assert_eq!((s.misses, s.coalesced, s.hits), (3, 4, 1));
    }
}

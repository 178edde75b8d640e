//! Per-caller limits: requests per minute, model tokens per minute, requests in flight
//! and the time a request may take. Checked before a request goes upstream, the
//! answer to a refusal being a 429 with the wait in `retry-after` (see
//! [`crate::openai::rate_limited`]).
//!
//! - Requests: a token bucket refilling `rpm / 60` a second up to `burst` (default
//!   `rpm`); a request takes one.
//! - Tokens: a bucket refilling `tpm / 60` a second up to `tpm`, charged *after* a call
//!   with the tokens its `usage` reports, so it may go into debt; a caller in debt is
//!   refused until it is paid back. A smooth bucket, not a fixed window: no double
//!   bursts at window edges, and the exact wait is known.
//! - Concurrency: a semaphore; the permit lives in the [`Admission`], which the answer
//!   holds until its body (a stream too) has ended or was dropped.
//! - Budget (sandbox tokens, [`crate::grants`]): the model tokens spent in all, charged
//!   as the tokens bucket is and also for answers from the cache; once spent reaches
//!   the budget every request is refused, for good.
//!
//! Time comes from a [`Clock`], so tests move it by hand.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::Limits;

/// Monotonic time since some fixed origin (replaceable in tests).
pub type Clock = Arc<dyn Fn() -> Duration + Send + Sync>;

/// The process's monotonic clock.
pub fn monotonic_clock() -> Clock {
    let origin = Instant::now();
    Arc::new(move || origin.elapsed())
}

/// A token bucket whose level may go below zero (a debt).
#[derive(Debug, Clone)]
pub(crate) struct Bucket {
    level: f64,
    /// Refill per second.
    rate: f64,
    burst: f64,
    at: Duration,
}

impl Bucket {
    /// A full bucket.
    pub(crate) fn new(rate: f64, burst: f64, now: Duration) -> Self {
        Self {
            level: burst,
            rate,
            burst,
            at: now,
        }
    }

    fn refill(&mut self, now: Duration) {
        if now > self.at {
            let gained = (now - self.at).as_secs_f64() * self.rate;
            self.level = (self.level + gained).min(self.burst);
            self.at = now;
        }
    }

    /// The wait until the level is `want`, zero if it is.
    fn wait_for(&self, want: f64) -> Duration {
        if self.level >= want {
            return Duration::ZERO;
        }
        Duration::try_from_secs_f64((want - self.level) / self.rate).unwrap_or(Duration::MAX)
    }

    /// Takes `n` if the bucket holds that many; else the wait until it does.
    pub(crate) fn take(&mut self, now: Duration, n: f64) -> Result<(), Duration> {
        self.refill(now);
        if self.level >= n {
            self.level -= n;
            Ok(())
        } else {
            Err(self.wait_for(n))
        }
    }

    /// Ok unless the bucket is in debt; else the wait until it is not.
    pub(crate) fn check(&mut self, now: Duration) -> Result<(), Duration> {
        self.refill(now);
        if self.level >= 0.0 {
            Ok(())
        } else {
            Err(self.wait_for(0.0))
        }
    }

    /// Puts back `n` taken before (up to the burst).
    pub(crate) fn give(&mut self, now: Duration, n: f64) {
        self.refill(now);
        self.level = (self.level + n).min(self.burst);
    }

    /// Takes `n` whatever the level (it may go into debt).
    pub(crate) fn charge(&mut self, now: Duration, n: f64) {
        self.refill(now);
        self.level -= n;
    }
}

/// Which limit refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limited {
    /// Requests per minute.
    Requests,
    /// Model tokens per minute.
    Tokens,
    /// Requests in flight at once.
    Concurrency,
    /// The token budget, used up (never paid back).
    Budget,
}

/// A request refused by a limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    /// Which limit.
    pub limit: Limited,
    /// Whether it is one the caller shares with its tenant's other tokens.
    pub shared: bool,
    /// How long until a retry may pass (for concurrency, a guess: the caller's usual
    /// request time).
    pub retry_after: Duration,
}

/// The wait suggested for a concurrency refusal before any request has finished.
const CONCURRENCY_WAIT: Duration = Duration::from_secs(1);

#[derive(Debug)]
struct State {
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
    /// Moving average of request times, seconds.
    typical_s: Option<f64>,
    /// Model tokens spent through this gateway (counted against the budget).
    spent: u64,
    /// Model tokens other gateways (replicas, this one's earlier runs) have charged to
    /// the same budget, as the spend ledger last said (counted against it too).
    elsewhere: u64,
}

/// One caller's limits and where it stands against them.
pub(crate) struct CallerLimits {
    limits: Limits,
    budget: Option<u64>,
    /// Limits shared with other callers (a tenant's, over its sandbox tokens): a
    /// request is let in only if they let it in too, and is charged to them as well.
    shared: Option<Arc<CallerLimits>>,
    clock: Clock,
    state: Mutex<State>,
    in_flight: Option<Arc<Semaphore>>,
}

impl std::fmt::Debug for CallerLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallerLimits")
            .field("limits", &self.limits)
            .field("budget", &self.budget)
            .finish_non_exhaustive()
    }
}

impl CallerLimits {
    /// Limits without a budget.
    #[cfg(test)]
    pub(crate) fn new(limits: Limits, clock: Clock) -> Self {
        Self::with_budget(limits, None, 0, clock)
    }

    /// Limits, and a budget of model tokens of which `spent` are spent already.
    pub(crate) fn with_budget(
        limits: Limits,
        budget: Option<u64>,
        spent: u64,
        clock: Clock,
    ) -> Self {
        let now = clock();
        let requests = limits.rpm.map(|rpm| {
            let burst = limits.burst.unwrap_or(rpm);
            Bucket::new(f64::from(rpm) / 60.0, f64::from(burst), now)
        });
        let tokens = limits
            .tpm
            .map(|tpm| Bucket::new(tpm as f64 / 60.0, tpm as f64, now));
        let in_flight = limits
            .max_concurrency
            .map(|n| Arc::new(Semaphore::new(n as usize)));
        Self {
            limits,
            budget,
            shared: None,
            clock,
            state: Mutex::new(State {
                requests,
                tokens,
                typical_s: None,
                spent,
                elsewhere: 0,
            }),
            in_flight,
        }
    }

    /// These limits, and `shared` ones on top (see [`CallerLimits::shared`]).
    pub(crate) fn sharing(mut self, shared: Option<Arc<CallerLimits>>) -> Self {
        self.shared = shared;
        self
    }

    /// Its limits.
    pub(crate) fn limits(&self) -> Limits {
        self.limits
    }

    /// The time a request may take, if limited.
    pub(crate) fn timeout(&self) -> Option<Duration> {
        self.limits
            .timeout_s
            .and_then(|s| Duration::try_from_secs_f64(s).ok())
    }

    /// The budget of model tokens, if any.
    pub(crate) fn budget(&self) -> Option<u64> {
        self.budget
    }

    /// Model tokens spent so far through this gateway.
    pub(crate) fn spent(&self) -> u64 {
        self.state().spent
    }

    /// Model tokens spent so far against the budget: here and elsewhere.
    pub(crate) fn spent_in_all(&self) -> u64 {
        let state = self.state();
        state.spent.saturating_add(state.elsewhere)
    }

    /// What other gateways have charged to this budget, as the ledger says.
    pub(crate) fn set_spent_elsewhere(&self, tokens: u64) {
        self.state().elsewhere = tokens;
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Lets a request in, or says which limit refuses it and for how long. Nothing is
    /// taken from a caller that is refused, nor from the limits it shares (a request
    /// the shared limits refuse gives back what the caller's own took).
    pub(crate) fn admit(self: &Arc<Self>) -> Result<Admission, Refusal> {
        let mut own = self.admit_own()?;
        if let Some(shared) = &self.shared {
            match shared.admit_own() {
                Ok(a) => own.shared = Some(Box::new(a)),
                Err(refusal) => {
                    own.give_back();
                    return Err(Refusal {
                        shared: true,
                        ..refusal
                    });
                }
            }
        }
        Ok(own)
    }

    fn admit_own(self: &Arc<Self>) -> Result<Admission, Refusal> {
        let now = (self.clock)();
        let mut state = self.state();
        let spent = state.spent.saturating_add(state.elsewhere);
        let budget_left = match self.budget {
            None => None,
            Some(budget) if spent >= budget => {
                return Err(Refusal {
                    limit: Limited::Budget,
                    shared: false,
                    retry_after: Duration::ZERO,
                });
            }
            Some(budget) => Some(budget - spent),
        };
        if let Some(tokens) = &mut state.tokens {
            tokens.check(now).map_err(|wait| Refusal {
                limit: Limited::Tokens,
                shared: false,
                retry_after: wait,
            })?;
        }
        let permit = match &self.in_flight {
            None => None,
            Some(sem) => Some(sem.clone().try_acquire_owned().map_err(|_| {
                Refusal {
                    limit: Limited::Concurrency,
                    shared: false,
                    retry_after: state
                        .typical_s
                        .and_then(|s| Duration::try_from_secs_f64(s).ok())
                        .unwrap_or(CONCURRENCY_WAIT),
                }
            })?),
        };
        if let Some(requests) = &mut state.requests {
            requests.take(now, 1.0).map_err(|wait| Refusal {
                limit: Limited::Requests,
                shared: false,
                retry_after: wait,
            })?;
        }
        Ok(Admission {
            caller: self.clone(),
            shared: None,
            took_request: state.requests.is_some(),
            _permit: permit,
            started: now,
            usage: None,
            bytes: 0,
            charge: true,
            without_call: 0,
            budget_left,
        })
    }

    /// Charges `tokens` to the tokens bucket and `spent` to the budget; learns the
    /// request's time if it was a call upstream (not a cache hit, nor refused there),
    /// which is what a request waiting for a concurrency permit waits on.
    fn settle(&self, tokens: u64, spent: u64, started: Duration, learn: bool) {
        let now = (self.clock)();
        let mut state = self.state();
        if let Some(bucket) = &mut state.tokens {
            bucket.charge(now, tokens as f64);
        }
        state.spent = state.spent.saturating_add(spent);
        if learn {
            let took = now.saturating_sub(started).as_secs_f64();
            state.typical_s = Some(match state.typical_s {
                None => took,
                Some(avg) => 0.8 * avg + 0.2 * took,
            });
        }
    }
}

/// A request let in: holds its concurrency permit, and charges its tokens when dropped
/// (the `usage` it reported, else an estimate of a quarter token per byte sent and
/// received, as for a stream its caller cut short).
#[derive(Debug)]
pub(crate) struct Admission {
    caller: Arc<CallerLimits>,
    /// The admission of the limits the caller shares, charged as this one is.
    shared: Option<Box<Admission>>,
    /// Whether a request was taken from the caller's requests bucket.
    took_request: bool,
    _permit: Option<OwnedSemaphorePermit>,
    started: Duration,
    usage: Option<u64>,
    bytes: u64,
    charge: bool,
    /// Tokens of an answer that came without a call (the cache), charged to the budget.
    without_call: u64,
    budget_left: Option<u64>,
}

impl Admission {
    /// Undoes the admission of a request that is not let in after all: its request
    /// goes back to the bucket, nothing is charged.
    fn give_back(&mut self) {
        self.charge = false;
        if self.took_request {
            let now = (self.caller.clock)();
            if let Some(requests) = &mut self.caller.state().requests {
                requests.give(now, 1.0);
            }
        }
    }

    /// The tokens the upstream reported the request used.
    pub(crate) fn record_usage(&mut self, tokens: u64) {
        self.usage = Some(tokens);
    }

    /// Counts bytes of the request or its answer toward the estimate.
    pub(crate) fn add_bytes(&mut self, n: usize) {
        self.bytes = self.bytes.saturating_add(n as u64);
    }

    /// Charges no tokens for this request (the upstream refused it, or never saw it),
    /// nor learns its time.
    pub(crate) fn forgive(&mut self) {
        self.charge = false;
    }

    /// Answered without a call upstream (from the cache, or another request's call),
    /// with an answer worth `tokens`: nothing is charged to the tokens per minute, which
    /// protect the upstream, but `tokens` are to the budget, which is what the caller
    /// may consume.
    pub(crate) fn answered_without_call(&mut self, tokens: u64) {
        self.charge = false;
        self.without_call = tokens;
    }

    /// What was left of the budget when the request was let in (`None`: no budget).
    pub(crate) fn budget_left(&self) -> Option<u64> {
        self.budget_left
    }

    /// Tokens it will be charged when dropped.
    pub(crate) fn tokens(&self) -> u64 {
        if !self.charge {
            return 0;
        }
        self.usage.unwrap_or(self.bytes.div_ceil(4))
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        if let Some(shared) = &mut self.shared {
            // The shared limits are charged what this caller is (they drop after).
            shared.usage = self.usage;
            shared.bytes = self.bytes;
            shared.charge = self.charge;
            shared.without_call = self.without_call;
        }
        let tokens = self.tokens();
        let spent = if self.charge {
            tokens
        } else {
            self.without_call
        };
        self.caller.settle(tokens, spent, self.started, self.charge);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;

    /// A clock moved by hand, in ms.
    pub(crate) fn manual_clock() -> (Clock, Arc<AtomicU64>) {
        let ms = Arc::new(AtomicU64::new(1_000_000));
        let c = ms.clone();
        (
            Arc::new(move || Duration::from_millis(c.load(Ordering::SeqCst))),
            ms,
        )
    }

    fn limits(rpm: Option<u32>, burst: Option<u32>, tpm: Option<u64>) -> Limits {
        Limits {
            rpm,
            burst,
            tpm,
            ..Limits::default()
        }
    }

    #[test]
    fn a_bucket_refills_at_its_rate_up_to_its_burst() {
        let t = |ms: u64| Duration::from_millis(ms);
        let mut b = Bucket::new(2.0, 3.0, t(0));
        for _ in 0..3 {
            b.take(t(0), 1.0).expect("the burst");
        }
        assert_eq!(b.take(t(0), 1.0), Err(t(500)), "one more in 1/rate");
        assert_eq!(b.take(t(250), 1.0), Err(t(250)));
        b.take(t(500), 1.0).expect("refilled");
        // A long pause fills it to the burst, no more.
        b.take(t(100_000), 3.0).expect("full");
        assert!(b.take(t(100_000), 1.0).is_err());
        // Debt: a charge may take it below zero; it is refused until paid back.
        let mut b = Bucket::new(10.0, 10.0, t(0));
        b.check(t(0)).expect("not in debt");
        b.charge(t(0), 40.0);
        assert_eq!(b.check(t(0)), Err(t(3000)), "30 tokens of debt at 10/s");
        assert_eq!(b.check(t(2000)), Err(t(1000)));
        b.check(t(3000)).expect("paid back");
    }

    #[test]
    fn shared_limits_refusing_give_back_what_the_callers_own_took() {
        let (clock, _ms) = manual_clock();
        let tenant = Arc::new(CallerLimits::new(
            Limits {
                max_concurrency: Some(1),
                ..limits(Some(60), Some(2), Some(600))
            },
            clock.clone(),
        ));
        let token = |rpm| {
            Arc::new(
                CallerLimits::new(limits(Some(rpm), Some(1), None), clock.clone())
                    .sharing(Some(tenant.clone())),
            )
        };
        let (a, b) = (token(60), token(60));
        let mut first = a.admit().expect("in");
        first.record_usage(100);
        let refused = b.admit().expect_err("the tenant's one at once");
        assert_eq!(
            (refused.limit, refused.shared),
            (Limited::Concurrency, true)
        );
        // b's own request went back: its bucket (burst 1) still lets one in.
        drop(b.admit_own().expect("b's own bucket is full"));
        drop(first);
        // The tenant was charged a's usage too, and took its request.
        assert_eq!(tenant.state().tokens.as_ref().map(|t| t.level), Some(500.0));
        drop(
            token(60)
                .admit()
                .expect("the tenant's second request of its burst"),
        );
        let refused = token(60).admit().expect_err("the tenant's burst is used");
        assert_eq!((refused.limit, refused.shared), (Limited::Requests, true));
        let refused = a.admit().expect_err("a's own bucket is empty");
        assert!(!refused.shared, "{refused:?}");
    }

    #[test]
    fn rpm_with_burst_one_lets_one_in_per_interval() {
        let (clock, ms) = manual_clock();
        let caller = Arc::new(CallerLimits::new(limits(Some(120), Some(1), None), clock));
        drop(caller.admit().expect("first"));
        let refused = caller.admit().expect_err("the burst is 1");
        assert_eq!(refused.limit, Limited::Requests);
        assert_eq!(refused.retry_after, Duration::from_millis(500), "120/min");
        ms.fetch_add(499, Ordering::SeqCst);
        assert!(caller.admit().is_err());
        ms.fetch_add(1, Ordering::SeqCst);
        drop(caller.admit().expect("refilled after 500 ms"));
    }

    #[test]
    fn tokens_are_charged_after_the_call_and_a_caller_in_debt_waits() {
        let (clock, ms) = manual_clock();
        let caller = Arc::new(CallerLimits::new(limits(None, None, Some(600)), clock));
        let mut a = caller.admit().expect("in");
        // Admitted while another call is out: nothing is charged before the answer.
        let mut b = caller.admit().expect("not in debt yet");
        a.record_usage(1000);
        drop(a);
        b.record_usage(100);
        drop(b);
        // 600 - 1100 = 500 in debt at 10/s: 50 s.
        let refused = caller.admit().expect_err("in debt");
        assert_eq!(refused.limit, Limited::Tokens);
        assert_eq!(refused.retry_after, Duration::from_secs(50));
        ms.fetch_add(50_000, Ordering::SeqCst);
        let mut c = caller.admit().expect("paid back");
        // No usage reported (a stream cut short): a quarter token per byte.
        c.add_bytes(4000);
        assert_eq!(c.tokens(), 1000);
        drop(c);
        assert!(caller.admit().is_err());
        // Forgiven (the upstream refused the call): nothing charged.
        ms.fetch_add(100_000, Ordering::SeqCst);
        let mut d = caller.admit().expect("in");
        d.record_usage(5000);
        d.forgive();
        drop(d);
        drop(caller.admit().expect("not charged"));
    }

    #[test]
    fn a_budget_is_spent_by_calls_and_cached_answers_and_then_refuses() {
        let (clock, ms) = manual_clock();
        let caller = Arc::new(CallerLimits::with_budget(
            limits(None, None, Some(600)),
            Some(100),
            10,
            clock,
        ));
        let mut a = caller.admit().expect("in");
        assert_eq!(a.budget_left(), Some(90));
        a.record_usage(50);
        drop(a);
        // From the cache: the budget pays, the tokens per minute do not.
        let mut hit = caller.admit().expect("in");
        assert_eq!(hit.budget_left(), Some(40));
        hit.answered_without_call(40);
        drop(hit);
        assert_eq!(caller.spent(), 100);
        let refused = caller.admit().expect_err("used up");
        assert_eq!(
            (refused.limit, refused.retry_after),
            (Limited::Budget, Duration::ZERO)
        );
        ms.fetch_add(3_600_000, Ordering::SeqCst);
        assert_eq!(caller.admit().expect_err("for good").limit, Limited::Budget);
        // Without a budget, an answer from the cache costs nothing.
        let unbudgeted = Arc::new(CallerLimits::new(limits(None, None, Some(60)), {
            let (c, _) = manual_clock();
            c
        }));
        let mut hit = unbudgeted.admit().expect("in");
        assert_eq!(hit.budget_left(), None);
        hit.answered_without_call(1000);
        drop(hit);
        drop(
            unbudgeted
                .admit()
                .expect("a hit costs no tokens per minute"),
        );
    }

    #[test]
    fn concurrency_permits_live_as_long_as_the_admission() {
        let (clock, ms) = manual_clock();
        let caller = Arc::new(CallerLimits::new(
            Limits {
                max_concurrency: Some(2),
                rpm: Some(600),
                ..Limits::default()
            },
            clock,
        ));
        let a = caller.admit().expect("1");
        let b = caller.admit().expect("2");
        let refused = caller.admit().expect_err("a third at once");
        assert_eq!(refused.limit, Limited::Concurrency);
        assert_eq!(
            refused.retry_after, CONCURRENCY_WAIT,
            "no request time known yet"
        );
        ms.fetch_add(300, Ordering::SeqCst);
        drop(a);
        let c = caller.admit().expect("a permit came back");
        let refused = caller.admit().expect_err("full again");
        assert!(
            (refused.retry_after.as_secs_f64() - 0.3).abs() < 1e-6,
            "the wait suggested is the usual request time: {:?}",
            refused.retry_after
        );
        // A request that never went upstream (a cache hit) teaches nothing.
        ms.fetch_add(5000, Ordering::SeqCst);
        let mut hit = b;
        hit.forgive();
        drop(hit);
        let d = caller.admit().expect("the hit's permit came back");
        let refused = caller.admit().expect_err("c and d hold both");
        assert!((refused.retry_after.as_secs_f64() - 0.3).abs() < 1e-6);
        drop((c, d));
        // A refusal took nothing: of the burst of 600, a and b took 2, 300 ms at 10 a
        // second gave 3 back (up to the burst), c took 1, 5 s filled it up again, d
        // took 1: 599 more.
        for _ in 0..599 {
            drop(caller.admit().expect("within the burst"));
        }
        assert_eq!(
            caller.admit().expect_err("burst used").limit,
            Limited::Requests
        );
    }
}

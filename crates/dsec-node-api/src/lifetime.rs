//! Sandbox lifetimes as a node keeps them: a TTL and an idle timeout, counted by the
//! node's own clock, and [`Clocks`], the bookkeeping every node implementation shares
//! (the local node with its monotonic clock, `FakeNode` with a clock the test moves).
//!
//! Durations are relative to when the node receives them, never wall-clock instants: a
//! node's clock may be minutes off the API servers'. Times in [`Clocks`] are
//! milliseconds of the node's monotonic clock, passed in by the caller.

/// Reason of a sandbox whose TTL ran out.
pub const TTL_ENDED: &str = "lifetime (timeout_s) ended";
/// Reason of a sandbox idle for its whole idle timeout.
pub const IDLE_TIMEOUT: &str = "idle timeout reached";

/// How long a sandbox may live.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Lifetime {
    /// Time to live, from when the node receives this lifetime (not counting time held);
    /// `None`: no limit.
    #[serde(default)]
    pub ttl_ms: Option<u64>,
    /// The sandbox ends after this long without activity while it runs (not while it is
    /// paused or held); `None`: never for idleness.
    #[serde(default)]
    pub idle_timeout_ms: Option<u64>,
    /// The clock is stopped (a suspended job): neither the TTL nor the idle timeout ends
    /// the sandbox, and what is left of the TTL (`ttl_ms`) stays as it is.
    #[serde(default)]
    pub held: bool,
}

/// One sandbox's lifetime bookkeeping. The persistent part serializes (a node keeps it
/// with the sandbox, so that a restart keeps the remaining TTL); activity does not (a
/// restart counts as activity).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Clocks {
    /// The lifetime last set.
    pub lifetime: Lifetime,
    /// When it was set.
    pub set_at_ms: u64,
    /// When the sandbox was created.
    pub created_at_ms: u64,
    /// Whether the sandbox is paused (the idle timeout does not run).
    #[serde(default)]
    pub paused: bool,
    /// Last activity.
    #[serde(skip)]
    last_active_ms: u64,
    /// Operations under way (the sandbox is not idle meanwhile).
    #[serde(skip)]
    busy: u32,
}

impl Clocks {
    /// A sandbox created at `now` with `lifetime`.
    pub fn new(lifetime: Lifetime, now: u64) -> Self {
        Self {
            lifetime,
            set_at_ms: now,
            created_at_ms: now,
            paused: false,
            last_active_ms: now,
            busy: 0,
        }
    }

    /// Clocks read back from where a node kept them, at `now`: the restart is activity.
    pub fn adopted(mut self, now: u64) -> Self {
        self.last_active_ms = now;
        self.busy = 0;
        // Kept by an earlier boot (the node's clock started again): count from now.
        if self.set_at_ms > now || self.created_at_ms > now {
            self.set_at_ms = now;
            self.created_at_ms = now;
        }
        self
    }

    /// Replaces the lifetime, counted from `now`.
    pub fn set(&mut self, lifetime: Lifetime, now: u64) {
        self.lifetime = lifetime;
        self.set_at_ms = now;
    }

    /// Records activity at `now`.
    pub fn touch(&mut self, now: u64) {
        self.last_active_ms = self.last_active_ms.max(now);
    }

    /// An operation starts at `now`; [`Clocks::end_op`] ends it.
    pub fn begin_op(&mut self, now: u64) {
        self.busy = self.busy.saturating_add(1);
        self.touch(now);
    }

    /// An operation ends at `now`.
    pub fn end_op(&mut self, now: u64) {
        self.busy = self.busy.saturating_sub(1);
        self.touch(now);
    }

    /// Age at `now`.
    pub fn age_ms(&self, now: u64) -> u64 {
        now.saturating_sub(self.created_at_ms)
    }

    /// Time since the last activity at `now` (0 while an operation is under way).
    pub fn idle_ms(&self, now: u64) -> u64 {
        if self.busy > 0 {
            0
        } else {
            now.saturating_sub(self.last_active_ms)
        }
    }

    /// What is left of the TTL at `now`.
    pub fn ttl_left_ms(&self, now: u64) -> Option<u64> {
        let ttl = self.lifetime.ttl_ms?;
        if self.lifetime.held {
            return Some(ttl);
        }
        Some(ttl.saturating_sub(now.saturating_sub(self.set_at_ms)))
    }

    /// Why the sandbox ends at `now`, if it does.
    pub fn due(&self, now: u64) -> Option<&'static str> {
        if self.lifetime.held {
            return None;
        }
        if self.ttl_left_ms(now) == Some(0) {
            return Some(TTL_ENDED);
        }
        match self.lifetime.idle_timeout_ms {
            Some(t) if !self.paused && self.idle_ms(now) >= t && self.busy == 0 => {
                Some(IDLE_TIMEOUT)
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn life(ttl: u64, idle: Option<u64>, held: bool) -> Lifetime {
        Lifetime {
            ttl_ms: Some(ttl),
            idle_timeout_ms: idle,
            held,
        }
    }

    #[test]
    fn ttl_runs_out_and_a_new_lifetime_counts_from_when_it_is_set() {
        let mut c = Clocks::new(life(1000, None, false), 5000);
        assert_eq!(c.due(5999), None);
        assert_eq!(c.ttl_left_ms(5400), Some(600));
        assert_eq!(c.due(6000), Some(TTL_ENDED));
        c.set(life(1000, None, false), 5900);
        assert_eq!(c.due(6000), None);
        assert_eq!(c.due(6900), Some(TTL_ENDED));
        assert_eq!(Clocks::new(Lifetime::default(), 0).due(u64::MAX), None);
    }

    #[test]
    fn idle_timeout_needs_no_activity_no_operation_and_a_running_sandbox() {
        let mut c = Clocks::new(life(100_000, Some(1000), false), 0);
        c.touch(800);
        assert_eq!(c.due(1500), None);
        assert_eq!(c.due(1800), Some(IDLE_TIMEOUT));
        c.begin_op(1900);
        assert_eq!((c.due(5000), c.idle_ms(5000)), (None, 0));
        c.end_op(5000);
        assert_eq!(c.due(5999), None);
        c.paused = true;
        assert_eq!(c.due(9000), None);
        c.paused = false;
        assert_eq!(c.due(9000), Some(IDLE_TIMEOUT));
    }

    #[test]
    fn held_stops_both_clocks_and_keeps_what_is_left() {
        let mut c = Clocks::new(life(1000, Some(500), false), 0);
        c.set(life(400, Some(500), true), 600);
        assert_eq!(
            (c.due(1_000_000), c.ttl_left_ms(1_000_000)),
            (None, Some(400))
        );
        c.set(life(400, Some(500), false), 1_000_000);
        c.touch(1_000_000);
        assert_eq!(c.due(1_000_399), None);
        assert_eq!(c.due(1_000_400), Some(TTL_ENDED));
    }

    #[test]
    fn adopted_clocks_keep_the_ttl_and_count_the_restart_as_activity() {
        let c = Clocks::new(life(10_000, Some(1000), false), 1000);
        let json = serde_json::to_string(&c).expect("serialize");
        let back: Clocks = serde_json::from_str(&json).expect("parse");
        let back = back.adopted(5000);
        assert_eq!(back.ttl_left_ms(5000), Some(6000));
        assert_eq!(back.age_ms(5000), 4000);
        assert_eq!(back.due(5500), None, "the restart was activity");
        // Kept by an earlier boot: the node's clock is behind them.
        let old = serde_json::from_str::<Clocks>(&json)
            .expect("parse")
            .adopted(10);
        assert_eq!(old.ttl_left_ms(10), Some(10_000));
    }
}

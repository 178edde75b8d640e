//! The warm-pool autoscaler: a pool's target size from its queue wait and idleness,
//! decided on a clock the caller passes (ms), with no I/O, so that every rule is tested
//! on a clock the test moves.
//!
//! Rules (every number is the pool's [`AutoscalePolicy`]):
//! - up: the average wait of claims over the window (those served in it and those still
//!   waiting, counted so far) above `target_queue_wait_ms` multiplies the target by
//!   `scale_up_factor`;
//! - down: an idle share (warm sandboxes over the pool's size) above `idle_ratio` for
//!   all of `idle_window_s` removes `scale_down_fraction` of the idle sandboxes (at
//!   least one);
//! - from zero: a claim waiting on a pool whose target is 0 makes it 1 at once;
//! - the target stays within `[min, max]`, and no rule fires within `cooldown_s` of the
//!   last change.

use std::collections::VecDeque;

use dsec_wire::v1::{AutoscalePolicy, ScaleEvent, ScaleReason};

/// Scale events kept for the pool's status.
const EVENTS_KEPT: usize = 32;

/// What the pool looks like at one tick.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Inputs {
    /// Sandboxes it holds (warm, in the making, and in use for reusing pools).
    pub size: u32,
    /// Of those, warm and unused.
    pub idle: u32,
    /// Claims waiting now.
    pub waiting: u32,
    /// Sum of how long each waiting claim has waited so far, ms.
    pub waiting_ms: u64,
}

/// One pool's autoscaler.
#[derive(Debug, Clone)]
pub struct Autoscaler {
    policy: AutoscalePolicy,
    min: u32,
    max: u32,
    target: u32,
    /// (when served, how long it waited) of the claims served in the window, ms.
    served: VecDeque<(u64, u64)>,
    /// Since when the idle share has been above the policy's.
    idle_since: Option<u64>,
    last_scale_at: Option<u64>,
    /// When the inputs were last given.
    inputs_at: u64,
    /// The last inputs.
    last: Inputs,
    events: VecDeque<ScaleEvent>,
}

fn ms(s: f64) -> u64 {
    (s * 1000.0).max(0.0) as u64
}

impl Autoscaler {
    /// An autoscaler at `now` whose target starts at `min`.
    pub fn new(min: u32, max: u32, policy: AutoscalePolicy, now: u64) -> Self {
        Self {
            policy,
            min,
            max,
            target: min,
            served: VecDeque::new(),
            idle_since: None,
            last_scale_at: None,
            inputs_at: now,
            last: Inputs::default(),
            events: VecDeque::new(),
        }
    }

    /// The size wanted now.
    pub fn target(&self) -> u32 {
        self.target
    }

    /// The policy.
    pub fn policy(&self) -> &AutoscalePolicy {
        &self.policy
    }

    /// New bounds and policy at `now`; a target outside the bounds moves into them (a
    /// [`ScaleReason::Bounds`] event).
    pub fn reconfigure(
        &mut self,
        min: u32,
        max: u32,
        policy: AutoscalePolicy,
        now: u64,
    ) -> Option<ScaleEvent> {
        self.min = min;
        self.max = max;
        self.policy = policy;
        let to = self.target.clamp(min, max);
        (to != self.target).then(|| self.scale(to, ScaleReason::Bounds, now))
    }

    /// A claim was served at `now` after waiting `wait_ms`.
    pub fn served(&mut self, now: u64, wait_ms: u64) {
        self.served.push_back((now, wait_ms));
    }

    /// Average wait over the window at `now` of the claims served in it and of those
    /// waiting per the last inputs, ms (0 without any).
    pub fn queue_wait_ms(&self, now: u64) -> f64 {
        let from = now.saturating_sub(ms(self.policy.window_s));
        let (mut n, mut sum) = (u64::from(self.last.waiting), self.last.waiting_ms);
        for &(at, wait) in &self.served {
            if at >= from {
                n += 1;
                sum += wait;
            }
        }
        if n == 0 {
            0.0
        } else {
            sum as f64 / n as f64
        }
    }

    /// How old the inputs are at `now`, ms.
    pub fn inputs_age_ms(&self, now: u64) -> u64 {
        now.saturating_sub(self.inputs_at)
    }

    /// Whether the inputs are older than the policy allows (an alarm) at `now`.
    pub fn stale(&self, now: u64) -> bool {
        self.inputs_age_ms(now) > ms(self.policy.stale_after_s)
    }

    /// The latest scale events, oldest first.
    pub fn events(&self) -> impl Iterator<Item = &ScaleEvent> {
        self.events.iter()
    }

    /// The pool as it is at `now`; returns the scale event this causes, if any.
    pub fn observe(&mut self, now: u64, inputs: Inputs) -> Option<ScaleEvent> {
        self.inputs_at = now;
        self.last = inputs;
        let window = ms(self.policy.window_s);
        while self
            .served
            .front()
            .is_some_and(|&(at, _)| at + window < now)
        {
            self.served.pop_front();
        }
        // The idle clock runs whether or not a cooldown holds the target.
        let idle_share = if inputs.size == 0 {
            0.0
        } else {
            f64::from(inputs.idle) / f64::from(inputs.size)
        };
        if idle_share > self.policy.idle_ratio && inputs.waiting == 0 {
            self.idle_since.get_or_insert(now);
        } else {
            self.idle_since = None;
        }
        if self.target == 0 && inputs.waiting > 0 && self.max > 0 {
            return Some(self.scale(1, ScaleReason::FromZero, now));
        }
        if self
            .last_scale_at
            .is_some_and(|at| now < at + ms(self.policy.cooldown_s))
        {
            return None;
        }
        if self.queue_wait_ms(now) > self.policy.target_queue_wait_ms as f64 {
            let grown = (f64::from(self.target) * self.policy.scale_up_factor).ceil() as u32;
            let to = grown.max(self.target + 1).min(self.max);
            if to > self.target {
                return Some(self.scale(to, ScaleReason::QueueWait, now));
            }
            return None;
        }
        if self
            .idle_since
            .is_some_and(|since| now >= since + ms(self.policy.idle_window_s))
        {
            let cut =
                ((f64::from(inputs.idle) * self.policy.scale_down_fraction).ceil() as u32).max(1);
            let to = self.target.saturating_sub(cut).max(self.min);
            if to < self.target {
                self.idle_since = Some(now);
                return Some(self.scale(to, ScaleReason::Idle, now));
            }
        }
        None
    }

    fn scale(&mut self, to: u32, reason: ScaleReason, now: u64) -> ScaleEvent {
        let event = ScaleEvent {
            at: now,
            from: self.target,
            to,
            reason,
        };
        self.target = to;
        self.last_scale_at = Some(now);
        if self.events.len() == EVENTS_KEPT {
            self.events.pop_front();
        }
        self.events.push_back(event.clone());
        event
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> AutoscalePolicy {
        AutoscalePolicy {
            window_s: 1.0,
            target_queue_wait_ms: 500,
            scale_up_factor: 2.0,
            idle_ratio: 0.4,
            idle_window_s: 2.0,
            scale_down_fraction: 0.25,
            cooldown_s: 3.0,
            stale_after_s: 30.0,
        }
    }

    fn at(size: u32, idle: u32) -> Inputs {
        Inputs {
            size,
            idle,
            ..Default::default()
        }
    }

    #[test]
    fn long_waits_double_the_target_up_to_max_once_per_cooldown() {
        let mut a = Autoscaler::new(2, 5, policy(), 0);
        a.served(100, 900);
        a.served(200, 300);
        let e = a.observe(300, at(2, 0)).expect("avg 600 ms > 500 ms");
        assert_eq!((e.from, e.to, e.reason), (2, 4, ScaleReason::QueueWait));
        a.served(400, 2000);
        assert_eq!(a.observe(500, at(4, 0)), None, "cooldown");
        // Past the cooldown, still waiting: 4 * 2 = 8, capped at 5.
        let e = a.observe(
            3400,
            Inputs {
                size: 4,
                idle: 0,
                waiting: 2,
                waiting_ms: 1400,
            },
        );
        assert_eq!(e.map(|e| e.to), Some(5));
        a.served(6500, 5000);
        assert_eq!(a.observe(6600, at(5, 0)), None, "at max");
        assert_eq!(a.target(), 5);
    }

    #[test]
    fn waits_outside_the_window_do_not_count() {
        let mut a = Autoscaler::new(1, 8, policy(), 0);
        a.served(0, 5000);
        assert_eq!(a.observe(1500, at(1, 0)), None);
        assert_eq!(a.queue_wait_ms(1500), 0.0);
        a.served(1600, 100);
        a.served(1700, 200);
        assert_eq!(a.queue_wait_ms(1700), 150.0);
    }

    #[test]
    fn a_lasting_idle_share_removes_a_quarter_of_the_idle_down_to_min() {
        let mut a = Autoscaler::new(2, 16, policy(), 0);
        a.reconfigure(12, 16, policy(), 0);
        assert_eq!(a.target(), 12, "bounds moved the target");
        // Cooldown of the bounds change ends at 3000; idle from 0.
        assert_eq!(a.observe(0, at(12, 10)), None);
        assert_eq!(a.observe(1000, at(12, 10)), None);
        a.reconfigure(2, 16, policy(), 1000);
        let e = a.observe(3000, at(12, 10)).expect("idle 10/12 for 3 s");
        // ceil(10 * 0.25) = 3.
        assert_eq!((e.from, e.to, e.reason), (12, 9, ScaleReason::Idle));
        // The idle window starts again, and the cooldown holds it meanwhile.
        assert_eq!(a.observe(5000, at(9, 9)), None);
        let e = a.observe(6000, at(9, 9)).expect("idle again");
        assert_eq!(e.to, 6);
    }

    #[test]
    fn a_busy_moment_resets_the_idle_clock() {
        let mut a = Autoscaler::new(1, 16, policy(), 0);
        a.reconfigure(8, 16, policy(), 0);
        a.reconfigure(1, 16, policy(), 0);
        a.observe(3000, at(8, 8));
        a.observe(4000, at(8, 2)); // 25%: not idle
        assert_eq!(a.observe(5500, at(8, 8)), None, "idle for 1.5 s only");
        assert!(a.observe(7500, at(8, 8)).is_some());
    }

    #[test]
    fn the_target_never_leaves_min_and_max() {
        let mut a = Autoscaler::new(3, 4, policy(), 0);
        for t in (0..60_000).step_by(500) {
            a.observe(t, at(4, 4));
            assert!((3..=4).contains(&a.target()));
        }
        assert_eq!(a.target(), 3);
    }

    #[test]
    fn a_claim_on_a_pool_at_zero_scales_it_to_one_at_once() {
        let mut a = Autoscaler::new(0, 4, policy(), 0);
        assert_eq!(a.observe(10, at(0, 0)), None);
        let e = a.observe(
            20,
            Inputs {
                waiting: 1,
                ..Default::default()
            },
        );
        assert_eq!(
            e.map(|e| (e.to, e.reason)),
            Some((1, ScaleReason::FromZero))
        );
        let mut none = Autoscaler::new(0, 0, policy(), 0);
        assert_eq!(
            none.observe(
                20,
                Inputs {
                    waiting: 1,
                    ..Default::default()
                }
            ),
            None
        );
    }

    #[test]
    fn inputs_go_stale_without_observations() {
        let mut a = Autoscaler::new(1, 2, policy(), 1000);
        assert!(!a.stale(31_000));
        assert!(a.stale(31_001));
        a.observe(31_001, at(1, 1));
        assert!(!a.stale(31_001));
        assert_eq!(a.inputs_age_ms(32_001), 1000);
    }

    #[test]
    fn events_are_kept_up_to_a_bound() {
        let mut p = policy();
        p.cooldown_s = 0.0;
        let mut a = Autoscaler::new(0, 1, p.clone(), 0);
        for t in 0..100u64 {
            a.reconfigure(t as u32 % 2, t as u32 % 2, p.clone(), t);
        }
        assert_eq!(a.events().count(), EVENTS_KEPT);
    }
}

//! [`Timeline`]: a create's phases as it goes, back to back, for
//! [`dsec_wire::v1::CreateTimings`]. Each [`Timeline::mark`] ends the phase that ran
//! since the last mark, so the phases cover the whole create without gaps.

use std::time::{Duration, Instant};

use dsec_wire::v1::{CreateTimings, PhaseTiming};

/// The phases of one create so far.
#[derive(Debug, Clone)]
pub struct Timeline {
    started: Instant,
    last: Instant,
    phases: Vec<PhaseTiming>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

impl Timeline {
    /// A timeline starting now.
    pub fn start() -> Self {
        Self::starting_at(Instant::now())
    }

    /// A timeline that started at `started`.
    pub fn starting_at(started: Instant) -> Self {
        Self {
            started,
            last: started,
            phases: Vec::new(),
        }
    }

    /// Ends phase `phase`: the time since the last mark (or the start).
    pub fn mark(&mut self, phase: &str) {
        let now = Instant::now();
        self.phases.push(PhaseTiming {
            phase: phase.to_string(),
            start_ms: ms(self.last - self.started),
            ms: ms(now - self.last),
        });
        self.last = now;
    }

    /// Ends a phase spent in a call that timed its own phases (`inner`, on its own
    /// clock): they go in as they are, and what the call took beyond them as `rest`
    /// (the round trip).
    pub fn nest(&mut self, inner: &[PhaseTiming], rest: &str) {
        let now = Instant::now();
        let base = ms(self.last - self.started);
        let took = ms(now - self.last);
        let mut inside = 0.0;
        for p in inner {
            self.phases.push(PhaseTiming {
                phase: p.phase.clone(),
                start_ms: base + p.start_ms,
                ms: p.ms,
            });
            inside += p.ms;
        }
        self.phases.push(PhaseTiming {
            phase: rest.to_string(),
            start_ms: base + inside.min(took),
            ms: (took - inside).max(0.0),
        });
        self.last = now;
    }

    /// The phases and their total (from the start to the last mark).
    pub fn finish(self) -> CreateTimings {
        CreateTimings {
            total_ms: ms(self.last - self.started),
            phases: self.phases,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_are_back_to_back_and_add_up_to_the_total() {
        let mut t = Timeline::start();
        std::thread::sleep(Duration::from_millis(2));
        t.mark("one");
        std::thread::sleep(Duration::from_millis(3));
        let inner = [
            PhaseTiming {
                phase: "a".into(),
                start_ms: 0.0,
                ms: 1.0,
            },
            PhaseTiming {
                phase: "b".into(),
                start_ms: 1.0,
                ms: 0.5,
            },
        ];
        t.nest(&inner, "rest");
        t.mark("last");
        let done = t.finish();
        let names: Vec<&str> = done.phases.iter().map(|p| p.phase.as_str()).collect();
        assert_eq!(names, ["one", "a", "b", "rest", "last"]);
        let sum: f64 = done.phases.iter().map(|p| p.ms).sum();
        assert!(
            (sum - done.total_ms).abs() < 1e-6,
            "{sum} vs {}",
            done.total_ms
        );
        assert!(done.phases[0].ms >= 2.0);
        assert!(
            done.phases[3].ms >= 1.4,
            "the round trip beyond a and b: {done:?}"
        );
        for w in done.phases.windows(2) {
            assert!(
                (w[0].start_ms + w[0].ms - w[1].start_ms).abs() < 1e-6,
                "{done:?}"
            );
        }
    }
}

//! Creates' phases since the start: a histogram per phase and one of whole creates
//! ([`CreatePhaseStats`] for `/metrics`), and the log line of a slow create with its
//! phases.

use std::collections::BTreeMap;
use std::sync::Mutex;

use dsec_wire::v1::{CreatePhaseStats, CreateTimings, PhaseHistogram, CREATE_PHASE_BUCKETS_S};

#[derive(Debug, Default, Clone)]
struct Histogram {
    counts: Vec<u64>,
    sum_s: f64,
    count: u64,
}

impl Histogram {
    fn observe(&mut self, seconds: f64) {
        if self.counts.is_empty() {
            self.counts = vec![0; CREATE_PHASE_BUCKETS_S.len() + 1];
        }
        let bucket = CREATE_PHASE_BUCKETS_S.partition_point(|&bound| bound < seconds);
        self.counts[bucket] += 1;
        self.sum_s += seconds;
        self.count += 1;
    }

    fn snapshot(&self, phase: &str) -> PhaseHistogram {
        PhaseHistogram {
            phase: phase.to_string(),
            counts: if self.counts.is_empty() {
                vec![0; CREATE_PHASE_BUCKETS_S.len() + 1]
            } else {
                self.counts.clone()
            },
            sum_s: self.sum_s,
            count: self.count,
        }
    }
}

#[derive(Debug, Default)]
struct Hists {
    total: Histogram,
    phases: BTreeMap<String, Histogram>,
}

/// The histograms of creates' phases (one lock taken per create).
#[derive(Debug, Default)]
pub(crate) struct CreateStats {
    hists: Mutex<Hists>,
}

impl CreateStats {
    /// Counts the create `id` that took `t`, and logs it when it took over `slow_ms`.
    pub(crate) fn record(&self, id: &str, t: &CreateTimings, slow_ms: u64) {
        {
            let mut h = self.hists.lock().unwrap_or_else(|e| e.into_inner());
            h.total.observe(t.total_ms / 1000.0);
            for p in &t.phases {
                h.phases
                    .entry(p.phase.clone())
                    .or_default()
                    .observe(p.ms / 1000.0);
            }
        }
        if slow_ms > 0 && t.total_ms > slow_ms as f64 {
            let phases: Vec<String> = t
                .phases
                .iter()
                .map(|p| format!("{}={:.1}ms", p.phase, p.ms))
                .collect();
            tracing::warn!(%id, total_ms = format!("{:.1}", t.total_ms), phases = %phases.join(" "), "slow create");
        }
    }

    /// The histograms now.
    pub(crate) fn snapshot(&self) -> CreatePhaseStats {
        let h = self.hists.lock().unwrap_or_else(|e| e.into_inner());
        CreatePhaseStats {
            total: h.total.snapshot("total"),
            phases: h.phases.iter().map(|(name, x)| x.snapshot(name)).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsec_wire::v1::PhaseTiming;

    #[test]
    fn each_phase_and_the_total_get_a_sample_per_create() {
        let stats = CreateStats::default();
        let t = CreateTimings {
            total_ms: 30.0,
            phases: vec![
                PhaseTiming {
                    phase: "placement".into(),
                    start_ms: 0.0,
                    ms: 0.2,
                },
                PhaseTiming {
                    phase: "init".into(),
                    start_ms: 0.2,
                    ms: 29.8,
                },
            ],
        };
        stats.record("sb-1", &t, 1);
        stats.record("sb-2", &t, 0);
        let s = stats.snapshot();
        assert_eq!(s.total.count, 2);
        assert!((s.total.sum_s - 0.06).abs() < 1e-9);
        let names: Vec<&str> = s.phases.iter().map(|p| p.phase.as_str()).collect();
        assert_eq!(names, ["init", "placement"]);
        // 0.2 ms falls in the first bucket (0.5 ms), 29.8 ms in the 50 ms one.
        assert_eq!(s.phases[1].counts[0], 2);
        assert_eq!(s.phases[0].counts[6], 2);
        assert_eq!(s.phases[0].counts.len(), CREATE_PHASE_BUCKETS_S.len() + 1);
    }
}

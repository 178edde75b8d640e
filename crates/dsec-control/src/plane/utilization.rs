//! The utilization ring of `GET /v1/utilization`: every
//! [`UTILIZATION_INTERVAL_S`](dsec_wire::v1::UTILIZATION_INTERVAL_S) the plane counts its
//! sandboxes by state and sums what its live nodes offer and hold, keeping the last
//! hour in memory (each replica its own: samples are cheap to take again, and not worth
//! a store write each).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsec_wire::v1::{
    SandboxState, Utilization, UtilizationSample, UTILIZATION_INTERVAL_S, UTILIZATION_SAMPLES,
};

use super::now_ms;
use super::ControlPlane;

/// The last hour of samples.
#[derive(Debug, Default)]
pub(crate) struct UtilizationRing(Mutex<VecDeque<UtilizationSample>>);

impl UtilizationRing {
    /// Adds a sample, dropping the oldest past [`UTILIZATION_SAMPLES`].
    pub(crate) fn push(&self, sample: UtilizationSample) {
        let mut ring = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if ring.len() == UTILIZATION_SAMPLES {
            ring.pop_front();
        }
        ring.push_back(sample);
    }

    /// The samples, oldest first.
    pub(crate) fn snapshot(&self) -> Utilization {
        let ring = self.0.lock().unwrap_or_else(|e| e.into_inner());
        Utilization {
            interval_s: UTILIZATION_INTERVAL_S,
            samples: ring.iter().cloned().collect(),
        }
    }
}

impl ControlPlane {
    /// Samples now, then every interval, while the plane lives.
    pub(super) fn spawn_utilization_sampler(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(UTILIZATION_INTERVAL_S));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                tick.tick().await;
                let Some(plane) = weak.upgrade() else { return };
                let sample = plane.sample_utilization().await;
                plane.utilization.push(sample);
            }
        });
    }

    async fn sample_utilization(&self) -> UtilizationSample {
        let mut s = UtilizationSample {
            at_ms: now_ms(),
            sandboxes: self.records.count(|_| true) as u64,
            ready: self.records.count(|r| r.state == SandboxState::Ready) as u64,
            paused: self.records.count(|r| r.state == SandboxState::Paused) as u64,
            ..Default::default()
        };
        match self.nodes.describe().await {
            Ok(list) => {
                for n in list.nodes.iter().filter(|n| n.live) {
                    s.nodes += 1;
                    s.cpu_millis_requested += n.cpu_millis_used;
                    s.cpu_millis_allocatable += n.cpu_millis;
                    s.memory_available_bytes += n.memory_bytes.saturating_sub(n.memory_bytes_used);
                }
            }
            Err(e) => tracing::debug!(error = %e.message, "utilization: no node listing"),
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_keeps_the_last_hour_oldest_first() {
        let ring = UtilizationRing::default();
        for i in 0..(UTILIZATION_SAMPLES as u64 + 5) {
            ring.push(UtilizationSample {
                at_ms: i,
                ..Default::default()
            });
        }
        let u = ring.snapshot();
        assert_eq!(u.interval_s, UTILIZATION_INTERVAL_S);
        assert_eq!(u.samples.len(), UTILIZATION_SAMPLES);
        assert_eq!(u.samples[0].at_ms, 5);
        assert_eq!(
            u.samples.last().map(|s| s.at_ms),
            Some(UTILIZATION_SAMPLES as u64 + 4)
        );
    }
}

//! Placement strategies side by side in a simulated fleet (the benchmark's "load
//! imbalance" and "placement throughput" rows). Deterministic for a seed; no store.
//!
//! The fleet: nodes of 16, 32, 48 or 64 cores (at random), each admitting 4x its cores
//! in requested CPU and 8 GiB of memory per core. Sandboxes ask for 100, 250, 500 or
//! 1000 millicores and 256 MiB to 2 GiB, independently at random; 20,000 of them fill
//! 100 nodes to about 60%.
//!
//! What the placers know is what API servers know: node loads as of the last
//! heartbeat (refreshed every `refresh_every` placements), plus their own in-flight
//! reservations (held for `hold` placements: the time a create takes), but not the
//! other replicas'.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use dsec_wire::v1::{Isolation, NetworkMode};

use crate::node::{Capacity, Load, NodeRegistration, NodeStatus};
use crate::placement::{PlacementConfig, PlacementRequest, Placer, Reservation, Rng, Strategy};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// A simulation.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// The strategy every replica uses.
    pub strategy: Strategy,
    /// `d` of sample-d.
    pub d: usize,
    /// Nodes in the fleet.
    pub nodes: usize,
    /// Sandboxes placed (none ends).
    pub placements: usize,
    /// API server replicas placing in turn, each with its own reservations.
    pub replicas: usize,
    /// Placements between two refreshes of the nodes' loads (1: always exact).
    pub refresh_every: usize,
    /// Placements a reservation is held for (0: released at once).
    pub hold: usize,
    /// Seed of the fleet, the requests and the placers.
    pub seed: u64,
}

impl SimConfig {
    /// 100 nodes, 20,000 placements, one replica with exact loads.
    pub fn exact(strategy: Strategy, seed: u64) -> Self {
        Self {
            strategy,
            d: 2,
            nodes: 100,
            placements: 20_000,
            replicas: 1,
            refresh_every: 1,
            hold: 0,
            seed,
        }
    }

    /// As [`SimConfig::exact`], but two replicas placing 2,000 sandboxes per heartbeat
    /// (2,000 creates/s, heartbeats every second), each create in flight for 100
    /// placements (50 ms).
    pub fn stale(strategy: Strategy, seed: u64) -> Self {
        Self {
            replicas: 2,
            refresh_every: 2_000,
            hold: 100,
            ..Self::exact(strategy, seed)
        }
    }
}

/// What a simulation measured.
#[derive(Debug, Clone, PartialEq)]
pub struct SimResult {
    /// Coefficient of variation (standard deviation / mean) of the nodes' utilization
    /// (the fuller of CPU and memory) at the end.
    pub cv: f64,
    /// Mean utilization.
    pub mean: f64,
    /// Highest utilization of a node.
    pub max: f64,
    /// Placements that failed (no capacity, or refused by 4 nodes in a row).
    pub refused: usize,
    /// Placements a node's own admission refused (stale loads), each retried elsewhere.
    pub node_refusals: usize,
}

/// A fleet of `n` heterogeneous nodes.
pub fn fleet(n: usize, seed: u64) -> Vec<Arc<NodeStatus>> {
    let mut rng = Rng::new(seed);
    (0..n)
        .map(|i| {
            let cores = [16u64, 32, 48, 64][rng.below(4)];
            let reg = NodeRegistration {
                name: format!("node-{i:03}"),
                url: format!("http://10.0.{}.{}:7070", i / 250, i % 250 + 1),
                labels: Default::default(),
                isolation: vec![Isolation::Container],
                network_modes: vec![NetworkMode::None, NetworkMode::Allowlist, NetworkMode::Open],
                capacity: Capacity {
                    cpu_millis: cores * 4000,
                    memory_bytes: cores * 8 * GIB,
                    max_sandboxes: cores * 16,
                },
                load: Load::default(),
                cached_layers: vec![],
                version: String::new(),
                boot_id: format!("boot-{i}"),
            };
            Arc::new(NodeStatus::new(reg, i as i64 + 1, false))
        })
        .collect()
}

fn request(rng: &mut Rng) -> PlacementRequest<'static> {
    PlacementRequest {
        cpu_millis: [100, 250, 500, 1000][rng.below(4)],
        memory_bytes: [256 * MIB, 512 * MIB, GIB, 2 * GIB][rng.below(4)],
        ..Default::default()
    }
}

fn with_load(n: &NodeStatus, load: Load) -> Arc<NodeStatus> {
    let mut n = n.clone();
    n.registration.load = load;
    Arc::new(n)
}

/// Runs one simulation.
pub fn imbalance(cfg: &SimConfig) -> SimResult {
    let mut view = fleet(cfg.nodes, cfg.seed);
    let index: HashMap<String, usize> = view
        .iter()
        .enumerate()
        .map(|(i, n)| (n.name().to_string(), i))
        .collect();
    let mut truth = vec![Load::default(); view.len()];
    let placers: Vec<Placer> = (0..cfg.replicas.max(1))
        .map(|r| {
            Placer::new(PlacementConfig {
                strategy: cfg.strategy,
                d: cfg.d,
                seed: Some(cfg.seed ^ (r as u64 + 1).wrapping_mul(0x9E37_79B9)),
                ..Default::default()
            })
        })
        .collect();
    let mut rng = Rng::new(cfg.seed.wrapping_add(1));
    // Reservations in flight, with the placement after which they end.
    let mut held: std::collections::VecDeque<(usize, Reservation)> = Default::default();
    let mut refused = 0;
    let mut node_refusals = 0;
    let refresh = cfg.refresh_every.max(1);
    for i in 0..cfg.placements {
        let req = request(&mut rng);
        let want = Load {
            cpu_millis: req.cpu_millis,
            memory_bytes: req.memory_bytes,
            sandboxes: 1,
        };
        let placer = &placers[i % placers.len()];
        // As the API server does: a node's own admission may refuse a stale placement;
        // then it tries another node, up to 3 times.
        let mut exclude: Vec<String> = Vec::new();
        loop {
            let r = match placer.place(
                &view,
                &PlacementRequest {
                    exclude: &exclude,
                    ..req
                },
            ) {
                Ok(r) => r,
                Err(_) => {
                    refused += 1;
                    break;
                }
            };
            let idx = index[r.node()];
            let after = truth[idx].plus(want);
            let c = view[idx].registration.capacity;
            if after.cpu_millis > c.cpu_millis
                || after.memory_bytes > c.memory_bytes
                || after.sandboxes > c.max_sandboxes
            {
                node_refusals += 1;
                if exclude.len() == 3 {
                    refused += 1;
                    break;
                }
                exclude.push(r.node().to_string());
                continue;
            }
            truth[idx] = after;
            if refresh == 1 {
                view[idx] = with_load(&view[idx], truth[idx]);
            }
            if cfg.hold > 0 {
                held.push_back((i + cfg.hold, r));
            }
            break;
        }
        while held.front().is_some_and(|(end, _)| *end <= i) {
            held.pop_front();
        }
        if refresh > 1 && (i + 1) % refresh == 0 {
            for (n, t) in view.iter_mut().zip(&truth) {
                *n = with_load(n, *t);
            }
        }
    }
    let utils: Vec<f64> = view
        .iter()
        .zip(&truth)
        .map(|(n, t)| {
            let c = &n.registration.capacity;
            (t.cpu_millis as f64 / c.cpu_millis as f64)
                .max(t.memory_bytes as f64 / c.memory_bytes as f64)
        })
        .collect();
    let mean = utils.iter().sum::<f64>() / utils.len().max(1) as f64;
    let var = utils.iter().map(|u| (u - mean).powi(2)).sum::<f64>() / utils.len().max(1) as f64;
    SimResult {
        cv: if mean > 0.0 { var.sqrt() / mean } else { 0.0 },
        mean,
        max: utils.iter().copied().fold(0.0, f64::max),
        refused,
        node_refusals,
    }
}

/// What a throughput run measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Throughput {
    /// Placements (place and release) per second on one thread.
    pub per_sec: f64,
    /// Median time of one placement, µs.
    pub p50_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
}

/// Times `placements` placements (each released at once) on a fleet of `nodes` nodes.
pub fn throughput(strategy: Strategy, nodes: usize, placements: usize, seed: u64) -> Throughput {
    let view = fleet(nodes, seed);
    let placer = Placer::new(PlacementConfig {
        strategy,
        seed: Some(seed),
        ..Default::default()
    });
    let mut rng = Rng::new(seed.wrapping_add(1));
    let mut samples = Vec::with_capacity(placements);
    let start = Instant::now();
    for _ in 0..placements {
        let req = request(&mut rng);
        let t = Instant::now();
        let r = placer.place(&view, &req);
        drop(r);
        samples.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let total = start.elapsed().as_secs_f64();
    samples.sort_by(f64::total_cmp);
    let pct = |p: f64| {
        samples
            .get(((samples.len().saturating_sub(1)) as f64 * p).round() as usize)
            .copied()
            .unwrap_or(f64::NAN)
    };
    Throughput {
        per_sec: placements as f64 / total.max(1e-9),
        p50_us: pct(0.5),
        p99_us: pct(0.99),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simulations_are_deterministic_and_fill_the_fleet() {
        let a = imbalance(&SimConfig::exact(Strategy::SampleD, 3));
        let b = imbalance(&SimConfig::exact(Strategy::SampleD, 3));
        assert_eq!(a, b);
        assert_eq!((a.refused, a.node_refusals), (0, 0));
        assert!((0.4..0.8).contains(&a.mean), "{a:?}");
    }

    #[test]
    fn sample_d_balances_better_than_random_and_does_not_herd() {
        for seed in 1..4 {
            let random = imbalance(&SimConfig::exact(Strategy::Random, seed));
            let d2 = imbalance(&SimConfig::exact(Strategy::SampleD, seed));
            assert!(d2.cv < random.cv / 2.0, "{d2:?} vs {random:?}");
            // With stale loads, least-loaded sends a heartbeat's worth of creates to
            // the same few nodes; sample-d stays close to its exact-load spread.
            let stale_ll = imbalance(&SimConfig::stale(Strategy::LeastLoaded, seed));
            let stale_d2 = imbalance(&SimConfig::stale(Strategy::SampleD, seed));
            assert!(stale_d2.cv < stale_ll.cv, "{stale_d2:?} vs {stale_ll:?}");
            assert!(stale_ll.node_refusals > 100 * (stale_d2.node_refusals + 1));
        }
    }

    #[test]
    fn throughput_is_measured() {
        let t = throughput(Strategy::SampleD, 100, 2000, 1);
        assert!(t.per_sec > 0.0 && t.p50_us <= t.p99_us, "{t:?}");
    }
}

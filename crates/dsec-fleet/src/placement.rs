//! Placement: which live node gets a new sandbox. Pure and synchronous: the caller hands
//! in the nodes (from [`FleetView::nodes`](crate::FleetView::nodes)); no store, no I/O.
//!
//! 1. **Filter**: not draining, runs the request's isolation level and network mode, not
//!    in the request's `exclude` list (nodes that already refused it), and still has room
//!    for it: its heartbeat load plus this placer's in-flight reservations plus the
//!    request stay within capacity × overcommit and `max_sandboxes`.
//! 2. **Pools**: nodes in an overflow pool are candidates only for requests marked
//!    eligible (their image is in the shared store), and only when the primary pools'
//!    utilization has passed the threshold (or the primary pools have no room at all).
//! 3. **Choose** ([`Strategy`]): sample `d` candidates and take the lowest score (the
//!    default), or one at random, or the lowest of all. The score is the node's fullest
//!    resource after the placement, `max((load + in-flight + request) / (capacity ×
//!    overcommit))` over CPU and memory, minus a bonus for the share of the request's
//!    layers the node has cached.
//! 4. **Reserve**: the chosen node's in-flight load grows by the request at once, so the
//!    next placements (before the node's next heartbeat) see it. The [`Reservation`]
//!    gives it back when dropped, i.e. when the create has ended either way.
//!
//! Sampling (rather than taking the least loaded) is what keeps several API server
//! replicas, each with its own in-flight view and loads up to a heartbeat old, from all
//! sending their next sandboxes to the same node (see [`crate::sim`]).

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use dsec_wire::v1::{Isolation, NetworkMode};

use crate::node::{Load, NodeStatus};

/// How a node is chosen among the candidates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Strategy {
    /// `d` candidates at random, the lowest score of them (power of d choices).
    #[default]
    SampleD,
    /// One candidate at random.
    Random,
    /// The lowest score of all candidates.
    LeastLoaded,
}

impl Strategy {
    /// The name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::SampleD => "sample-d",
            Strategy::Random => "random",
            Strategy::LeastLoaded => "least-loaded",
        }
    }
}

/// How placement decides.
#[derive(Debug, Clone, PartialEq)]
pub struct PlacementConfig {
    /// How a node is chosen.
    pub strategy: Strategy,
    /// Candidates sampled by [`Strategy::SampleD`] (default 2).
    pub d: usize,
    /// Requested CPU admitted per unit of a node's reported CPU capacity (default 1:
    /// nodes report capacity with their own overcommit applied).
    pub cpu_overcommit: f64,
    /// The same for memory (default 1).
    pub memory_overcommit: f64,
    /// Subtracted from the score of a node caching all of the request's layers
    /// (proportionally for some; default 0.1, i.e. worth 10% of a node's capacity).
    pub cache_bonus: f64,
    /// Pools that take overflow only (e.g. `cloud`); every other pool is primary.
    pub overflow_pools: BTreeSet<String>,
    /// Utilization of the primary pools above which eligible requests may overflow
    /// (default 0.8).
    pub overflow_threshold: f64,
    /// Seed of the sampling (default: drawn at random); for reproducible simulations.
    pub seed: Option<u64>,
}

impl Default for PlacementConfig {
    fn default() -> Self {
        Self {
            strategy: Strategy::SampleD,
            d: 2,
            cpu_overcommit: 1.0,
            memory_overcommit: 1.0,
            cache_bonus: 0.1,
            overflow_pools: BTreeSet::new(),
            overflow_threshold: 0.8,
            seed: None,
        }
    }
}

/// What a new sandbox needs.
#[derive(Debug, Clone, Copy, Default)]
pub struct PlacementRequest<'a> {
    /// Requested CPU, millicores.
    pub cpu_millis: u64,
    /// Requested memory, bytes.
    pub memory_bytes: u64,
    /// Its isolation level.
    pub isolation: Isolation,
    /// Its network mode.
    pub network: NetworkMode,
    /// Digests of its image's layers (for the cache bonus).
    pub layers: &'a [String],
    /// Its image is in the shared store, so an overflow node can fetch it.
    pub overflow_eligible: bool,
    /// Nodes not to use (they refused this request already).
    pub exclude: &'a [String],
}

/// Why no node was chosen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// No node is registered and alive.
    #[error("no node is alive")]
    NoNodes,
    /// No live node runs this isolation level with this network mode.
    #[error("no live node runs isolation {isolation:?} with network mode {network:?}")]
    Unsupported {
        /// The request's isolation level.
        isolation: Isolation,
        /// The request's network mode.
        network: NetworkMode,
    },
    /// Every node that could run it is full, drained or excluded: retry later.
    #[error("no node has room for the sandbox ({0})")]
    NoCapacity(String),
}

impl PlacementError {
    /// Whether asking again later may succeed (API error `capacity`): all but
    /// [`PlacementError::Unsupported`]. Even that may change when a node joins, but a
    /// client should not spin on it.
    pub fn retryable(&self) -> bool {
        !matches!(self, PlacementError::Unsupported { .. })
    }
}

/// A small, fast generator (xorshift64*); placement needs spread, not secrecy.
#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        // splitmix64 of the seed: no zero state, and nearby seeds diverge.
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Self((z ^ (z >> 31)) | 1)
    }

    pub(crate) fn random_seed() -> u64 {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0),
        );
        h.finish()
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }
}

#[derive(Debug)]
struct State {
    inflight: HashMap<String, Load>,
    rng: Rng,
}

#[derive(Debug)]
struct Inner {
    cfg: PlacementConfig,
    state: Mutex<State>,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Places sandboxes and tracks this API server's in-flight reservations. Cheap to clone
/// (clones share the reservations); one per API server process.
#[derive(Debug, Clone)]
pub struct Placer {
    inner: Arc<Inner>,
}

/// A placement: the chosen node, whose in-flight load holds the request until this is
/// dropped (or [`Reservation::release`]d). Keep it until the node has answered the
/// create: by then the node's own load includes the sandbox, or the create failed.
#[derive(Debug)]
pub struct Reservation {
    inner: Arc<Inner>,
    node: String,
    load: Load,
}

impl Reservation {
    /// The chosen node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Gives the reservation back (the same as dropping it).
    pub fn release(self) {}
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut s = self.inner.lock();
        if let Some(l) = s.inflight.get_mut(&self.node) {
            *l = l.minus(self.load);
            if *l == Load::default() {
                s.inflight.remove(&self.node);
            }
        }
    }
}

/// One filtered node.
struct Candidate {
    idx: usize,
    overflow: bool,
    score: f64,
}

fn ratio(used: u64, cap: u64, overcommit: f64) -> f64 {
    used as f64 / (cap as f64 * overcommit).max(1.0)
}

impl Placer {
    /// A placer with `cfg` (a `d` of 0 counts as 1).
    pub fn new(cfg: PlacementConfig) -> Self {
        let seed = cfg.seed.unwrap_or_else(Rng::random_seed);
        Self {
            inner: Arc::new(Inner {
                cfg,
                state: Mutex::new(State {
                    inflight: HashMap::new(),
                    rng: Rng::new(seed),
                }),
            }),
        }
    }

    /// Its configuration.
    pub fn config(&self) -> &PlacementConfig {
        &self.inner.cfg
    }

    /// The in-flight load this placer has reserved on `node`.
    pub fn inflight(&self, node: &str) -> Load {
        self.inner
            .lock()
            .inflight
            .get(node)
            .copied()
            .unwrap_or_default()
    }

    /// Chooses a node for `req` among `nodes` (the live nodes) and reserves the request
    /// on it. See the module docs.
    pub fn place(
        &self,
        nodes: &[Arc<NodeStatus>],
        req: &PlacementRequest<'_>,
    ) -> Result<Reservation, PlacementError> {
        let cfg = &self.inner.cfg;
        let mut state = self.inner.lock();
        let want = Load {
            cpu_millis: req.cpu_millis,
            memory_bytes: req.memory_bytes,
            sandboxes: 1,
        };
        // Primary pools' use and capacity, for the overflow rule.
        let (mut p_cpu, mut p_cpu_cap, mut p_mem, mut p_mem_cap) = (0f64, 0f64, 0f64, 0f64);
        let mut supported = false;
        let mut excluded = 0usize;
        let mut candidates: Vec<Candidate> = Vec::new();
        for (idx, n) in nodes.iter().enumerate() {
            let r = &n.registration;
            let overflow = cfg.overflow_pools.contains(r.pool());
            let used = r
                .load
                .plus(state.inflight.get(&r.name).copied().unwrap_or_default());
            if !overflow && !n.draining {
                p_cpu += used.cpu_millis as f64;
                p_cpu_cap += r.capacity.cpu_millis as f64 * cfg.cpu_overcommit;
                p_mem += used.memory_bytes as f64;
                p_mem_cap += r.capacity.memory_bytes as f64 * cfg.memory_overcommit;
            }
            if !r.isolation.contains(&req.isolation) || !r.network_modes.contains(&req.network) {
                continue;
            }
            supported = true;
            if n.draining {
                continue;
            }
            if req.exclude.contains(&r.name) {
                excluded += 1;
                continue;
            }
            let after = used.plus(want);
            let cpu = ratio(after.cpu_millis, r.capacity.cpu_millis, cfg.cpu_overcommit);
            let mem = ratio(
                after.memory_bytes,
                r.capacity.memory_bytes,
                cfg.memory_overcommit,
            );
            let count_ok =
                r.capacity.max_sandboxes == 0 || after.sandboxes <= r.capacity.max_sandboxes;
            if cpu > 1.0 || mem > 1.0 || !count_ok {
                continue;
            }
            let cached = if req.layers.is_empty() {
                0.0
            } else {
                req.layers.iter().filter(|l| n.cached.contains(*l)).count() as f64
                    / req.layers.len() as f64
            };
            candidates.push(Candidate {
                idx,
                overflow,
                score: cpu.max(mem) - cfg.cache_bonus * cached,
            });
        }
        if nodes.is_empty() {
            return Err(PlacementError::NoNodes);
        }
        if !supported {
            return Err(PlacementError::Unsupported {
                isolation: req.isolation,
                network: req.network,
            });
        }
        let primary_util = if p_cpu_cap > 0.0 && p_mem_cap > 0.0 {
            (p_cpu / p_cpu_cap).max(p_mem / p_mem_cap)
        } else {
            f64::INFINITY
        };
        let primary_room = candidates.iter().any(|c| !c.overflow);
        let overflow_ok =
            req.overflow_eligible && (primary_util >= cfg.overflow_threshold || !primary_room);
        let any_overflow = candidates.iter().any(|c| c.overflow);
        candidates.retain(|c| !c.overflow || overflow_ok);
        if candidates.is_empty() {
            let why = if any_overflow {
                "the primary pools are full and the image is not in the shared store, so it \
                 may not overflow"
                    .to_string()
            } else if excluded > 0 {
                format!("{excluded} node(s) already refused it, the others are full or drained")
            } else {
                "every node that runs it is full or drained".to_string()
            };
            return Err(PlacementError::NoCapacity(why));
        }
        let pick = match cfg.strategy {
            Strategy::Random => state.rng.below(candidates.len()),
            Strategy::LeastLoaded => lowest(&candidates, 0..candidates.len()),
            Strategy::SampleD => {
                let d = cfg.d.max(1);
                if d >= candidates.len() {
                    lowest(&candidates, 0..candidates.len())
                } else {
                    // A partial Fisher-Yates shuffle: d distinct candidates.
                    for i in 0..d {
                        let j = i + state.rng.below(candidates.len() - i);
                        candidates.swap(i, j);
                    }
                    lowest(&candidates, 0..d)
                }
            }
        };
        let node = nodes[candidates[pick].idx].registration.name.clone();
        let slot = state.inflight.entry(node.clone()).or_default();
        *slot = slot.plus(want);
        drop(state);
        Ok(Reservation {
            inner: self.inner.clone(),
            node,
            load: want,
        })
    }
}

/// The index (into `c`) of the lowest score among `range`.
fn lowest(c: &[Candidate], range: std::ops::Range<usize>) -> usize {
    let mut best = range.start;
    for i in range {
        if c[i].score < c[best].score {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::node::tests::reg;
    use crate::node::{Capacity, POOL_LABEL};

    const GIB: u64 = 1 << 30;

    fn node(name: &str, cpu: u64, mem_gib: u64, load: Load) -> Arc<NodeStatus> {
        let mut r = reg(name);
        r.capacity = Capacity {
            cpu_millis: cpu,
            memory_bytes: mem_gib * GIB,
            max_sandboxes: 0,
        };
        r.load = load;
        Arc::new(NodeStatus::new(r, 1, false))
    }

    fn with(n: Arc<NodeStatus>, f: impl FnOnce(&mut NodeStatus)) -> Arc<NodeStatus> {
        let mut n = (*n).clone();
        f(&mut n);
        n.cached = n.registration.cached_layers.iter().cloned().collect();
        Arc::new(n)
    }

    fn small() -> PlacementRequest<'static> {
        PlacementRequest {
            cpu_millis: 1000,
            memory_bytes: GIB,
            ..Default::default()
        }
    }

    fn placer(strategy: Strategy) -> Placer {
        Placer::new(PlacementConfig {
            strategy,
            seed: Some(7),
            ..Default::default()
        })
    }

    fn load(cpu: u64, mem_gib: u64, n: u64) -> Load {
        Load {
            cpu_millis: cpu,
            memory_bytes: mem_gib * GIB,
            sandboxes: n,
        }
    }

    #[test]
    fn filters_drained_unsupported_full_and_excluded_nodes() {
        let ok = node("ok", 8000, 16, Load::default());
        let drained = with(node("drained", 8000, 16, Load::default()), |n| {
            n.draining = true
        });
        let oci_only = with(node("oci", 8000, 16, Load::default()), |n| {
            n.registration.isolation = vec![Isolation::Oci]
        });
        let no_open = with(node("closed", 8000, 16, Load::default()), |n| {
            n.registration.network_modes = vec![NetworkMode::None]
        });
        let full_cpu = node("fullcpu", 8000, 16, load(7500, 0, 1));
        let full_mem = node("fullmem", 8000, 16, load(0, 16, 1));
        let full_count = with(node("fullcount", 8000, 16, load(0, 0, 3)), |n| {
            n.registration.capacity.max_sandboxes = 3
        });
        let excluded = node("excluded", 8000, 16, Load::default());
        let nodes = vec![
            drained, oci_only, no_open, full_cpu, full_mem, full_count, excluded, ok,
        ];
        let exclude = vec!["excluded".to_string()];
        let p = placer(Strategy::LeastLoaded);
        for _ in 0..20 {
            let req = PlacementRequest {
                network: NetworkMode::Open,
                exclude: &exclude,
                ..small()
            };
            let r = p.place(&nodes, &req).expect("placed");
            assert_eq!(r.node(), "ok");
        }
    }

    #[test]
    fn errors_say_why() {
        let p = placer(Strategy::SampleD);
        assert_eq!(p.place(&[], &small()).err(), Some(PlacementError::NoNodes));
        let nodes = vec![node("a", 8000, 16, Load::default())];
        let oci = PlacementRequest {
            isolation: Isolation::Oci,
            ..small()
        };
        let e = p.place(&nodes, &oci).expect_err("refused");
        assert!(matches!(e, PlacementError::Unsupported { .. }) && !e.retryable());
        let huge = PlacementRequest {
            cpu_millis: 9000,
            ..small()
        };
        let e = p.place(&nodes, &huge).expect_err("refused");
        assert!(
            matches!(e, PlacementError::NoCapacity(_)) && e.retryable(),
            "{e}"
        );
        let exclude = vec!["a".to_string()];
        let e = p
            .place(
                &nodes,
                &PlacementRequest {
                    exclude: &exclude,
                    ..small()
                },
            )
            .expect_err("refused");
        assert!(e.to_string().contains("already refused"), "{e}");
        let drained = vec![with(nodes[0].clone(), |n| n.draining = true)];
        assert!(matches!(
            p.place(&drained, &small()),
            Err(PlacementError::NoCapacity(_))
        ));
    }

    #[test]
    fn in_flight_reservations_count_until_released() {
        let nodes = vec![node("a", 4000, 16, Load::default())];
        let p = placer(Strategy::SampleD);
        let held: Vec<Reservation> = (0..4)
            .map(|_| p.place(&nodes, &small()).expect("room"))
            .collect();
        assert_eq!(p.inflight("a"), load(4000, 4, 4));
        // Full now, although the (stale) heartbeat load says empty.
        assert!(matches!(
            p.place(&nodes, &small()),
            Err(PlacementError::NoCapacity(_))
        ));
        let mut held = held.into_iter();
        held.next().expect("one").release();
        drop(held.next());
        assert_eq!(p.inflight("a"), load(2000, 2, 2));
        let again = p.place(&nodes, &small()).expect("room again");
        drop(again);
        drop(held);
        assert_eq!(p.inflight("a"), Load::default());
        // Clones share reservations: one per API server.
        let q = p.clone();
        let _r = q.place(&nodes, &small()).expect("room");
        assert_eq!(p.inflight("a"), load(1000, 1, 1));
    }

    #[test]
    fn in_flight_reservations_spread_a_burst() {
        // Loads are stale (no heartbeat during the burst): only reservations spread it.
        let nodes: Vec<_> = (0..4)
            .map(|i| node(&format!("n{i}"), 100_000, 1000, Load::default()))
            .collect();
        let p = placer(Strategy::LeastLoaded);
        let held: Vec<_> = (0..40)
            .map(|_| p.place(&nodes, &small()).expect("room"))
            .collect();
        for n in &nodes {
            assert_eq!(p.inflight(n.name()).sandboxes, 10, "{}", n.name());
        }
        drop(held);
    }

    #[test]
    fn sample_d_picks_the_lower_of_its_samples() {
        // With d = all nodes, sample-d is least-loaded.
        let nodes = vec![
            node("busy", 8000, 16, load(6000, 1, 6)),
            node("idle", 8000, 16, load(1000, 1, 1)),
            node("mid", 8000, 16, load(3000, 1, 3)),
        ];
        let p = Placer::new(PlacementConfig {
            d: 3,
            seed: Some(1),
            ..Default::default()
        });
        for _ in 0..5 {
            assert_eq!(p.place(&nodes, &small()).expect("room").node(), "idle");
        }
        // With d = 2 the busiest node never wins over any other.
        let p = Placer::new(PlacementConfig {
            d: 2,
            seed: Some(2),
            ..Default::default()
        });
        let mut seen = BTreeMap::new();
        for _ in 0..300 {
            let r = p.place(&nodes, &small()).expect("room");
            *seen.entry(r.node().to_string()).or_insert(0) += 1;
        }
        assert_eq!(seen.get("busy"), None, "{seen:?}");
        assert!(seen["idle"] > seen["mid"], "{seen:?}");
    }

    #[test]
    fn the_score_weighs_the_fuller_resource_and_overcommit() {
        // "cpu" has CPU to spare but little memory; "mem" the reverse but less so.
        let nodes = vec![
            node("cpu", 8000, 16, load(0, 12, 1)),
            node("mem", 8000, 16, load(4000, 0, 1)),
        ];
        let p = placer(Strategy::LeastLoaded);
        assert_eq!(p.place(&nodes, &small()).expect("room").node(), "mem");
        // Overcommit makes room beyond the reported capacity.
        let full = vec![node("a", 4000, 16, load(4000, 0, 4))];
        assert!(p.place(&full, &small()).is_err());
        let oc = Placer::new(PlacementConfig {
            cpu_overcommit: 2.0,
            ..Default::default()
        });
        assert_eq!(oc.place(&full, &small()).expect("room").node(), "a");
    }

    #[test]
    fn cached_layers_earn_a_bonus() {
        let layer = format!("sha256:{}", "ab".repeat(32));
        let nodes = vec![
            node("cold", 8000, 16, load(1000, 1, 1)),
            with(node("warm", 8000, 16, load(1400, 1, 1)), |n| {
                n.registration.cached_layers = vec![layer.clone()]
            }),
        ];
        let layers = vec![layer.clone()];
        let p = placer(Strategy::LeastLoaded);
        let req = PlacementRequest {
            layers: &layers,
            ..small()
        };
        assert_eq!(p.place(&nodes, &req).expect("room").node(), "warm");
        // Without the layer in the request, the emptier node wins.
        assert_eq!(p.place(&nodes, &small()).expect("room").node(), "cold");
    }

    fn pooled(name: &str, pool: &str, used_cpu: u64) -> Arc<NodeStatus> {
        with(node(name, 10_000, 100, load(used_cpu, 0, 1)), |n| {
            n.registration.labels.insert(POOL_LABEL.into(), pool.into());
        })
    }

    #[test]
    fn overflow_only_past_the_threshold_and_only_when_eligible() {
        let p = Placer::new(PlacementConfig {
            overflow_pools: ["cloud".to_string()].into(),
            strategy: Strategy::LeastLoaded,
            ..Default::default()
        });
        let eligible = PlacementRequest {
            overflow_eligible: true,
            ..small()
        };
        // Primary at 70%: even an eligible request stays on prem (the busier node).
        let under = vec![
            pooled("onprem", "onprem", 7000),
            pooled("cloud", "cloud", 0),
        ];
        assert_eq!(p.place(&under, &eligible).expect("room").node(), "onprem");
        // Primary at 85%: eligible requests go to the emptier cloud node ...
        let over = vec![
            pooled("onprem", "onprem", 8500),
            pooled("cloud", "cloud", 0),
        ];
        assert_eq!(p.place(&over, &eligible).expect("room").node(), "cloud");
        // ... others stay on prem while it has room ...
        assert_eq!(p.place(&over, &small()).expect("room").node(), "onprem");
        // ... and get `capacity` when it is full, although the cloud has room.
        let full = vec![
            pooled("onprem", "onprem", 9500),
            pooled("cloud", "cloud", 0),
        ];
        let e = p.place(&full, &small()).expect_err("refused");
        assert!(e.to_string().contains("shared store"), "{e}");
        assert_eq!(p.place(&full, &eligible).expect("room").node(), "cloud");
        // The threshold is configurable.
        let low = Placer::new(PlacementConfig {
            overflow_pools: ["cloud".to_string()].into(),
            overflow_threshold: 0.5,
            strategy: Strategy::LeastLoaded,
            ..Default::default()
        });
        assert_eq!(low.place(&under, &eligible).expect("room").node(), "cloud");
    }

    #[test]
    fn in_flight_reservations_count_toward_the_primary_utilization() {
        let p = Placer::new(PlacementConfig {
            overflow_pools: ["cloud".to_string()].into(),
            strategy: Strategy::LeastLoaded,
            ..Default::default()
        });
        let nodes = vec![
            pooled("onprem", "onprem", 7000),
            pooled("cloud", "cloud", 0),
        ];
        let eligible = PlacementRequest {
            overflow_eligible: true,
            ..small()
        };
        let first = p.place(&nodes, &eligible).expect("room");
        assert_eq!(first.node(), "onprem");
        // 7000 + 1000 in flight = 80%: the next one overflows.
        assert_eq!(p.place(&nodes, &eligible).expect("room").node(), "cloud");
    }

    #[test]
    fn random_and_sample_d_use_every_node() {
        let nodes: Vec<_> = (0..5)
            .map(|i| node(&format!("n{i}"), 1_000_000, 1000, Load::default()))
            .collect();
        for s in [Strategy::Random, Strategy::SampleD] {
            let p = placer(s);
            let mut seen = BTreeSet::new();
            let mut held = Vec::new();
            for _ in 0..200 {
                let r = p.place(&nodes, &small()).expect("room");
                seen.insert(r.node().to_string());
                held.push(r);
            }
            assert_eq!(seen.len(), 5, "{s:?}");
        }
    }

    #[test]
    fn the_generator_is_uniform_enough() {
        let mut r = Rng::new(42);
        let mut counts = [0u32; 10];
        for _ in 0..100_000 {
            counts[r.below(10)] += 1;
        }
        assert!(
            counts.iter().all(|c| (9_000..11_000).contains(c)),
            "{counts:?}"
        );
    }
}

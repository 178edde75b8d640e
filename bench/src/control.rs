//! The control plane alone (issue #25): 100 simulated nodes (`FakeNode`: sandboxes that
//! cost nothing), registered and heartbeating through the API servers' registration
//! endpoints as real nodes do, so that each replica's `FleetNodes` (`FleetView` +
//! `Placer`) places over them; two `ControlPlane` replicas (`open_on`), each serving
//! the public API on loopback (`dsec_http`), on one real etcd member. What is measured
//! is the control plane, its API server and its store.
//!
//! Keyed creates (an idempotency key each, as the Python SDK sends them) of
//! heterogeneous sizes, 64 in flight, alternating between the replicas: their sustained
//! rate and latency, the store calls each create and delete makes (counted in a wrapper
//! of the planes' store), the CPU the run costs, and the spread of the nodes' load at
//! the end. Baselines in the same run: the same cluster driven in-process (no HTTP),
//! on an in-memory store (no etcd), one plane on redb onto one node (`dsec serve`), and
//! etcd alone committing the same number of transactions.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dsec_control::nodes::Dialer;
use dsec_control::{ControlConfig, ControlPlane, FleetNodes, Principal, SandboxApi};
use dsec_fleet::{FleetView, PlacementConfig, Placer, Registry, Strategy};
use dsec_node_api::fake::FakeNode;
use dsec_node_api::NodeApi;
use dsec_node_rpc::registration::{Heartbeater, HeartbeaterConfig, Report};
use dsec_state::{
    EtcdConfig, EtcdStore, Expect, FaultyStore, MemStore, RedbStore, StateStore, StoreCalls,
};
use dsec_wire::v1::{CreateSandboxRequest, Resources};
use dsec_wire::{ApiError, ErrorCode};
use futures::StreamExt;

use crate::{record, HostCpu, Stats};

/// Creates in flight.
pub(crate) const IN_FLIGHT: usize = 64;
const KEY: &str = "bench";
const NODE_TOKEN: &str = "bench-node-token";

/// Store calls the control planes made (their records, keys and claims; not the fleet's
/// registrations and heartbeats, which go to the store unwrapped): a read is a round trip
/// to etcd, a write one commit (a raft round and an fsync).
pub(crate) type Counts = StoreCalls;

/// `store`, its calls counted into `counts`.
fn counted(store: Arc<dyn StateStore>, counts: &Arc<Counts>) -> Arc<dyn StateStore> {
    Arc::new(FaultyStore::counting_into(store, counts.clone()))
}

/// A tiny deterministic generator (splitmix64): the same sizes in every row.
fn mix(i: u64) -> u64 {
    let mut z = i.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Create `i` of a run: keyed, of one of 16 sizes (100-1000 millicores, 256 MiB-2 GiB;
/// the simulated placement section's mix).
fn request(row: &str, i: usize) -> CreateSandboxRequest {
    let h = mix(i as u64);
    CreateSandboxRequest {
        idempotency_key: Some(format!("{row}-{i}")),
        resources: Resources {
            cpu: Some([0.1, 0.25, 0.5, 1.0][(h % 4) as usize]),
            memory_mb: Some([256, 512, 1024, 2048][((h >> 8) % 4) as usize]),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// CPU time of this process (all threads), ms.
fn process_cpu_ms() -> f64 {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a rusage into the buffer it is given.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr()) } != 0 {
        return f64::NAN;
    }
    // SAFETY: getrusage succeeded, so the struct is initialized.
    let ru = unsafe { ru.assume_init() };
    let ms = |t: libc::timeval| t.tv_sec as f64 * 1000.0 + t.tv_usec as f64 / 1000.0;
    ms(ru.ru_utime) + ms(ru.ru_stime)
}

/// CPU time of the processes whose command line names `marker` (etcd: its data
/// directory), ms.
fn processes_cpu_ms(marker: &str) -> f64 {
    // SAFETY: sysconf with a constant name.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return f64::NAN;
    };
    let mut ticks = 0u64;
    for e in dir.flatten() {
        let p = e.path();
        let named = std::fs::read(p.join("cmdline"))
            .is_ok_and(|c| String::from_utf8_lossy(&c).contains(marker));
        let Some(stat) = named
            .then(|| std::fs::read_to_string(p.join("stat")).ok())
            .flatten()
        else {
            continue;
        };
        // After the command name: state is field 3, utime 14 and stime 15.
        if let Some((_, rest)) = stat.rsplit_once(')') {
            let f: Vec<&str> = rest.split_whitespace().collect();
            ticks += f.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
                + f.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        }
    }
    ticks as f64 * 1000.0 / hz
}

/// How a run reaches the planes.
#[derive(Debug, Clone)]
enum Via {
    /// `dsec_client` over HTTP on loopback, one client per API server.
    Http(Vec<dsec_client::Client>),
    /// Calls on the planes themselves.
    InProcess(Vec<Arc<ControlPlane>>),
}

impl Via {
    fn replicas(&self) -> usize {
        match self {
            Via::Http(c) => c.len(),
            Via::InProcess(p) => p.len(),
        }
    }

    async fn create(&self, i: usize, req: CreateSandboxRequest) -> anyhow::Result<String> {
        let n = self.replicas();
        match self {
            Via::Http(c) => Ok(c[i % n].create_sandbox(req).await?.id),
            Via::InProcess(p) => Ok(p[i % n]
                .create_sandbox(&Principal::bootstrap(), req)
                .await
                .map_err(|e| anyhow::anyhow!("create: {}", e.message))?
                .id),
        }
    }

    async fn delete(&self, i: usize, id: &str) -> anyhow::Result<()> {
        let n = self.replicas();
        match self {
            Via::Http(c) => Ok(c[i % n].delete_sandbox(id).await?),
            Via::InProcess(p) => p[i % n]
                .delete_sandbox(&Principal::bootstrap(), id)
                .await
                .map_err(|e| anyhow::anyhow!("delete: {}", e.message)),
        }
    }
}

/// What one row measured.
#[derive(Debug)]
pub(crate) struct Row {
    pub(crate) name: String,
    pub(crate) creates: usize,
    pub(crate) rate: f64,
    pub(crate) latency: Stats,
    pub(crate) reads_per_create: f64,
    pub(crate) writes_per_create: f64,
    pub(crate) reads_per_delete: f64,
    pub(crate) writes_per_delete: f64,
    /// etcd transaction requests per create (writes share requests under load).
    pub(crate) etcd_requests_per_create: Option<f64>,
    /// etcd transaction requests per delete.
    pub(crate) etcd_requests_per_delete: Option<f64>,
    /// CPU of this process per create, ms (planes, HTTP both sides, nodes, client).
    pub(crate) cpu_ms_per_create: f64,
    /// CPU of etcd per create, ms.
    pub(crate) etcd_cpu_ms_per_create: f64,
    /// CPU of the whole host per create, ms (etcd included).
    pub(crate) host_cpu_ms_per_create: f64,
    /// Coefficient of variation of the nodes' utilization after the creates (`None`:
    /// one node).
    pub(crate) cv: Option<f64>,
    /// Nodes that got sandboxes.
    pub(crate) nodes_used: usize,
}

/// `n` creates through `via` with [`IN_FLIGHT`] in flight, then their deletes; `counts`
/// are the planes' store calls and `nodes` the fleet (for the load spread).
async fn run(
    name: &str,
    via: &Via,
    counts: &Counts,
    nodes: &Fleet,
    n: usize,
    etcd: Option<&EtcdSide<'_>>,
) -> anyhow::Result<Row> {
    let (r0, w0) = counts.now();
    let sent0 = etcd.map(EtcdSide::requests);
    let etcd_cpu = || etcd.map_or(0.0, |e| processes_cpu_ms(e.marker));
    let (cpu0, etcd0, host0) = (process_cpu_ms(), etcd_cpu(), HostCpu::now());
    let start = Instant::now();
    let results: Vec<anyhow::Result<(String, f64)>> = futures::stream::iter(0..n)
        .map(|i| async move {
            let t = Instant::now();
            let id = via.create(i, request(name, i)).await?;
            Ok((id, t.elapsed().as_secs_f64() * 1000.0))
        })
        .buffer_unordered(IN_FLIGHT)
        .collect()
        .await;
    let elapsed = start.elapsed().as_secs_f64();
    let (cpu1, etcd1, host) = (process_cpu_ms(), etcd_cpu(), host0.elapsed_ms());
    let (r1, w1) = counts.now();
    let sent1 = etcd.map(EtcdSide::requests);
    let mut ids = Vec::new();
    let mut samples = Vec::new();
    for r in results {
        let (id, ms) = r?;
        ids.push(id);
        samples.push(ms);
    }
    let cv = (nodes.nodes.len() > 1).then(|| nodes.spread().0);
    let nodes_used = nodes.nodes.values().filter(|n| n.requested().2 > 0).count();
    futures::stream::iter(ids.iter().enumerate())
        .map(|(i, id)| via.delete(i, id))
        .buffer_unordered(IN_FLIGHT)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<anyhow::Result<Vec<_>>>()?;
    let (r2, w2) = counts.now();
    let sent2 = etcd.map(EtcdSide::requests);
    let per = |a: u64, b: u64| (b - a) as f64 / n as f64;
    let per_sent = |a: Option<u64>, b: Option<u64>| Some(per(a?, b?));
    Ok(Row {
        name: name.to_string(),
        creates: n,
        rate: n as f64 / elapsed,
        latency: Stats {
            name: name.into(),
            samples,
            note: None,
        },
        reads_per_create: per(r0, r1),
        writes_per_create: per(w0, w1),
        reads_per_delete: per(r1, r2),
        writes_per_delete: per(w1, w2),
        etcd_requests_per_create: per_sent(sent0, sent1),
        etcd_requests_per_delete: per_sent(sent1, sent2),
        cpu_ms_per_create: (cpu1 - cpu0) / n as f64,
        etcd_cpu_ms_per_create: (etcd1 - etcd0) / n as f64,
        host_cpu_ms_per_create: host / n as f64,
        cv,
        nodes_used,
    })
}

/// The simulated nodes, by name.
#[derive(Debug, Clone)]
pub(crate) struct Fleet {
    nodes: BTreeMap<String, Arc<FakeNode>>,
    /// Their registrations (capacity), by name.
    regs: BTreeMap<String, dsec_fleet::NodeRegistration>,
}

impl Fleet {
    /// `n` heterogeneous nodes: 16, 32, 48 or 64 cores (4x admitted), 8 GiB per core,
    /// as in the simulated placement section (`dsec_fleet::sim::fleet`).
    pub(crate) fn new(n: usize) -> Self {
        let regs: BTreeMap<_, _> = dsec_fleet::sim::fleet(n, 1)
            .into_iter()
            .map(|s| {
                let mut r = s.registration.clone();
                r.boot_id = dsec_fleet::new_boot_id();
                r.version = env!("CARGO_PKG_VERSION").into();
                (r.name.clone(), r)
            })
            .collect();
        // Each admits what its registration says it holds, as a real node does.
        let nodes = regs
            .iter()
            .map(|(name, r)| {
                let node = FakeNode::new(name);
                node.set_admission(r.capacity.cpu_millis, r.capacity.memory_bytes);
                node.set_max_sandboxes(r.capacity.max_sandboxes as usize);
                (name.clone(), Arc::new(node))
            })
            .collect();
        Self { nodes, regs }
    }

    /// Connects a plane to the in-process node a registration names.
    fn dialer(&self) -> Dialer {
        let nodes = self.nodes.clone();
        Arc::new(move |reg| {
            nodes
                .get(&reg.name)
                .map(|n| n.clone() as Arc<dyn NodeApi>)
                .ok_or_else(|| ApiError::new(ErrorCode::Internal, "no such simulated node"))
        })
    }

    /// Each node's utilization: the fuller of requested CPU and memory over capacity.
    fn utilization(&self) -> Vec<f64> {
        self.nodes
            .iter()
            .map(|(name, node)| {
                let (cpu, mem, _) = node.requested();
                let c = self.regs[name].capacity;
                (cpu as f64 / c.cpu_millis as f64).max(mem as f64 / c.memory_bytes as f64)
            })
            .collect()
    }

    /// Coefficient of variation of the nodes' utilization, the mean and the highest.
    pub(crate) fn spread(&self) -> (f64, f64, f64) {
        let util = self.utilization();
        let mean = util.iter().sum::<f64>() / util.len().max(1) as f64;
        let var = util.iter().map(|u| (u - mean).powi(2)).sum::<f64>() / util.len().max(1) as f64;
        let max = util.iter().copied().fold(0.0, f64::max);
        let cv = if mean > 0.0 { var.sqrt() / mean } else { 0.0 };
        (cv, mean, max)
    }

    /// Creates the nodes refused (their admission: full).
    fn refusals(&self) -> u64 {
        self.nodes
            .values()
            .map(|n| {
                n.counters.create_calls.load(Ordering::Relaxed)
                    - n.counters.creates.load(Ordering::Relaxed)
            })
            .sum()
    }

    /// Sandboxes on the nodes now.
    #[cfg(test)]
    fn sandboxes(&self) -> usize {
        self.nodes.values().map(|n| n.requested().2 as usize).sum()
    }
}

/// Two (or more) API server replicas over a fleet of simulated nodes.
pub(crate) struct Cluster {
    pub(crate) planes: Vec<Arc<ControlPlane>>,
    pub(crate) urls: Vec<String>,
    pub(crate) counts: Arc<Counts>,
    pub(crate) fleet: Fleet,
    heartbeaters: Vec<Heartbeater>,
    servers: Vec<tokio::task::JoinHandle<std::io::Result<()>>>,
    stop: tokio::sync::watch::Sender<bool>,
}

impl Cluster {
    /// Opens a plane per store in `stores` (one store client per replica, as separate
    /// API servers have), serves each on loopback, and registers `fleet`'s nodes through
    /// them; returns once every replica sees every node live.
    pub(crate) async fn start(
        stores: Vec<Arc<dyn StateStore>>,
        fleet: Fleet,
        strategy: Strategy,
    ) -> anyhow::Result<Self> {
        let counts = Arc::new(Counts::default());
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let mut planes = Vec::new();
        let mut urls = Vec::new();
        let mut servers = Vec::new();
        for store in stores {
            let registry = Registry::new(store.clone(), Default::default());
            let nodes = FleetNodes::new(
                FleetView::start(store.clone()),
                Placer::new(PlacementConfig {
                    strategy,
                    ..Default::default()
                }),
                registry.clone(),
                fleet.dialer(),
            );
            let counted = counted(store, &counts);
            let cfg = ControlConfig {
                sole_owner: false,
                ..ControlConfig::with_key(KEY.into())
            };
            let plane = ControlPlane::open_on(cfg, Arc::new(nodes), counted)
                .await
                .map_err(|e| anyhow::anyhow!("opening a plane: {}", e.message))?;
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            urls.push(format!("http://{}", listener.local_addr()?));
            let mut stopped = stopped.clone();
            servers.push(tokio::spawn(dsec_http::serve_with(
                listener,
                plane.clone(),
                Default::default(),
                dsec_node_rpc::registration::router(registry, NODE_TOKEN.into()),
                async move {
                    let _ = stopped.wait_for(|s| *s).await;
                },
            )));
            planes.push(plane);
        }
        // Each node starts with a different API server, as nodes configured with the
        // list in different orders would.
        let mut heartbeaters = Vec::new();
        for (i, (name, reg)) in fleet.regs.iter().enumerate() {
            let mut apiservers = urls.clone();
            apiservers.rotate_left(i % urls.len());
            let node = fleet.nodes[name].clone();
            let hb = Heartbeater::start(
                HeartbeaterConfig::new(apiservers, NODE_TOKEN.into()),
                reg.clone(),
                move || {
                    let (cpu_millis, memory_bytes, sandboxes) = node.requested();
                    Report {
                        load: dsec_fleet::Load {
                            cpu_millis,
                            memory_bytes,
                            sandboxes,
                        },
                        cached_layers: Vec::new(),
                    }
                },
            )
            .map_err(|e| anyhow::anyhow!("starting a heartbeat: {e}"))?;
            heartbeaters.push(hb);
        }
        let cluster = Self {
            planes,
            urls,
            counts,
            fleet,
            heartbeaters,
            servers,
            stop,
        };
        cluster.wait_live().await?;
        Ok(cluster)
    }

    /// Waits (up to 30 s) until every replica sees every node live.
    async fn wait_live(&self) -> anyhow::Result<()> {
        let want = self.fleet.nodes.len();
        let deadline = Instant::now() + Duration::from_secs(30);
        for plane in &self.planes {
            loop {
                let live = plane
                    .list_nodes(&Principal::bootstrap())
                    .await
                    .map_err(|e| anyhow::anyhow!("listing nodes: {}", e.message))?
                    .nodes
                    .iter()
                    .filter(|n| n.live)
                    .count();
                if live == want {
                    break;
                }
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "only {live} of {want} simulated nodes registered within 30 s"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Ok(())
    }

    /// The planes over HTTP.
    fn http(&self) -> anyhow::Result<Via> {
        Ok(Via::Http(
            self.urls
                .iter()
                .map(|u| dsec_client::Client::new(u, Some(KEY.into())))
                .collect::<Result<_, _>>()?,
        ))
    }

    /// The planes in-process.
    fn in_process(&self) -> Via {
        Via::InProcess(self.planes.clone())
    }

    /// Stops the heartbeats (the leases expire) and the HTTP servers.
    pub(crate) async fn stop(self) {
        drop(self.heartbeaters);
        let _ = self.stop.send(true);
        for s in self.servers {
            let _ = s.await;
        }
    }
}

/// One etcd client per replica, under `prefix`.
async fn etcd_stores(
    endpoints: &[String],
    prefix: &str,
    n: usize,
) -> anyhow::Result<Vec<EtcdStore>> {
    let mut stores = Vec::new();
    for _ in 0..n {
        stores.push(EtcdStore::connect(EtcdConfig::new(endpoints.to_vec(), prefix)).await?);
    }
    Ok(stores)
}

/// The etcd side of a run: its process (by a marker in its command line) and the
/// planes' clients.
struct EtcdSide<'a> {
    marker: &'a str,
    stores: &'a [EtcdStore],
}

impl EtcdSide<'_> {
    /// etcd transaction requests the clients sent so far.
    fn requests(&self) -> u64 {
        self.stores.iter().map(|s| s.txn_counts().0).sum()
    }
}

/// etcd alone: `n` single-put transactions of a record-sized value, 64 in flight, from
/// two clients (what the store can commit, without a control plane); a row per txn.
async fn etcd_alone(etcd: &EtcdSide<'_>, n: usize) -> anyhow::Result<Row> {
    let (stores, marker) = (etcd.stores, etcd.marker);
    let value = vec![b'x'; 1500];
    let sent0 = etcd.requests();
    let (cpu0, etcd0, host0) = (process_cpu_ms(), processes_cpu_ms(marker), HostCpu::now());
    let start = Instant::now();
    let samples: Vec<f64> = futures::stream::iter(0..n)
        .map(|i| {
            let store = &stores[i % stores.len()];
            let value = &value;
            async move {
                let t = Instant::now();
                store
                    .put("bench-put", &format!("k{i}"), value, Expect::Any)
                    .await?;
                anyhow::Ok(t.elapsed().as_secs_f64() * 1000.0)
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<anyhow::Result<_>>()?;
    let elapsed = start.elapsed().as_secs_f64();
    let per = |ms: f64| ms / n as f64;
    let sent = etcd.requests() - sent0;
    Ok(Row {
        name: format!("etcd alone: {n} single-put txns of 1.5 kB (per txn, not per create)"),
        creates: n,
        rate: n as f64 / elapsed,
        latency: Stats {
            name: "etcd put".into(),
            samples,
            note: None,
        },
        reads_per_create: 0.0,
        writes_per_create: 1.0,
        reads_per_delete: f64::NAN,
        writes_per_delete: f64::NAN,
        etcd_requests_per_create: Some(sent as f64 / n as f64),
        etcd_requests_per_delete: None,
        cpu_ms_per_create: per(process_cpu_ms() - cpu0),
        etcd_cpu_ms_per_create: per(processes_cpu_ms(marker) - etcd0),
        host_cpu_ms_per_create: per(host0.elapsed_ms()),
        cv: None,
        nodes_used: 0,
    })
}

/// One plane on redb onto one fake node: `dsec serve`'s control plane and store.
async fn redb_row(n: usize) -> anyhow::Result<Row> {
    let dir = std::env::temp_dir().join("dsec-bench-control");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let counts = Arc::new(Counts::default());
    let store = counted(Arc::new(RedbStore::open(&dir.join("state.redb"))?), &counts);
    let fleet = Fleet::new(1);
    let node = fleet.nodes.values().next().cloned();
    let node = node.ok_or_else(|| anyhow::anyhow!("no node"))?;
    // One node holds every sandbox of the run.
    node.set_admission(u64::MAX, u64::MAX);
    node.set_max_sandboxes(0);
    let cfg = ControlConfig {
        reap_interval: Duration::from_secs(1),
        ..ControlConfig::with_key(KEY.into())
    };
    let plane = ControlPlane::open(cfg, node, store)
        .await
        .map_err(|e| anyhow::anyhow!("opening the plane: {}", e.message))?;
    let row = run(
        "redb, 1 plane, 1 node, in-process (dsec serve)",
        &Via::InProcess(vec![plane]),
        &counts,
        &fleet,
        n,
        None,
    )
    .await;
    let _ = std::fs::remove_dir_all(&dir);
    row
}

/// The nodes' load spread after `n` creates with each placement strategy, through the
/// same two replicas (in-process, on an in-memory store: the rate is the control
/// plane's own, and the loads the replicas see are as stale as the heartbeats, 1 s);
/// one JSON row per strategy.
async fn imbalance(n: usize) -> anyhow::Result<Vec<serde_json::Value>> {
    println!("| strategy | CV of node utilization | mean utilization | fullest node | refused by a node (retried) | failed | creates/s |");
    println!("|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    for strategy in [Strategy::SampleD, Strategy::Random, Strategy::LeastLoaded] {
        let mem: Arc<dyn StateStore> = Arc::new(MemStore::new());
        let cluster = Cluster::start(vec![mem.clone(), mem], Fleet::new(100), strategy).await?;
        let via = cluster.in_process();
        let via = &via;
        let start = Instant::now();
        let failed = futures::stream::iter(0..n)
            .map(|i| async move { via.create(i, request(strategy.name(), i)).await.is_err() })
            .buffer_unordered(IN_FLIGHT)
            .filter(|failed| std::future::ready(*failed))
            .count()
            .await;
        let rate = n as f64 / start.elapsed().as_secs_f64();
        let (cv, mean, max) = cluster.fleet.spread();
        let refused = cluster.fleet.refusals();
        println!(
            "| {} | {cv:.3} | {:.0}% | {:.0}% | {refused} | {failed} | {rate:.0} |",
            strategy.name(),
            mean * 100.0,
            max * 100.0
        );
        rows.push(
            serde_json::json!({"strategy": strategy.name(), "creates": n, "cv": cv,
            "mean_util": mean, "max_util": max, "node_refusals": refused, "failed": failed,
            "creates_per_s": rate}),
        );
        cluster.stop().await;
    }
    Ok(rows)
}

/// Prints (and records) the control-plane table.
pub fn section(quick: bool) -> anyhow::Result<()> {
    let n = if quick { 1_000 } else { 5_000 };
    let fill = if quick { 5_000 } else { 20_000 };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        println!(
            "\n## control plane alone: {n} keyed creates, {IN_FLIGHT} in flight, 2 API servers, 100 simulated nodes\n"
        );
        let mut rows = Vec::new();
        match dsec_testkit::Etcd::start("bench-control-plane") {
            Some(etcd) => {
                let dir = etcd.dir().to_string_lossy().into_owned();
                let stores = etcd_stores(&etcd.endpoints(), "/bench", 2).await?;
                let side = EtcdSide { marker: &dir, stores: &stores };
                let marker = Some(&side);
                let dyn_stores = stores.iter().map(|s| Arc::new(s.clone()) as Arc<dyn StateStore>).collect();
                let cluster = Cluster::start(dyn_stores, Fleet::new(100), Strategy::SampleD).await?;
                let (counts, fleet) = (&cluster.counts, &cluster.fleet);
                let via = cluster.http()?;
                rows.push(run("etcd, 2 API servers over HTTP", &via, counts, fleet, n, marker).await?);
                let via = cluster.in_process();
                rows.push(run("etcd, 2 planes in-process", &via, counts, fleet, n, marker).await?);
                cluster.stop().await;
                let stores = etcd_stores(&etcd.endpoints(), "/bench-put", 2).await?;
                rows.push(etcd_alone(&EtcdSide { marker: &dir, stores: &stores }, 2 * n).await?);
            }
            None => println!("(etcd is not installed: the etcd rows are missing)\n"),
        }
        let mem: Arc<dyn StateStore> = Arc::new(MemStore::new());
        let cluster = Cluster::start(vec![mem.clone(), mem], Fleet::new(100), Strategy::SampleD).await?;
        let (counts, fleet) = (&cluster.counts, &cluster.fleet);
        rows.push(run("memory store, 2 planes in-process", &cluster.in_process(), counts, fleet, n, None).await?);
        cluster.stop().await;
        rows.push(redb_row(n).await?);

        println!("| setup | creates/s | p50 ms | p99 ms | store reads / writes per create | per delete | etcd requests per create / delete | CPU ms per create: bench process / etcd / whole host |");
        println!("|---|---|---|---|---|---|---|---|");
        let mut json = Vec::new();
        for r in &rows {
            let delete = if r.writes_per_delete.is_nan() {
                String::new()
            } else {
                format!("{:.2} / {:.2}", r.reads_per_delete, r.writes_per_delete)
            };
            let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
            let requests = match r.etcd_requests_per_create {
                Some(_) => format!("{} / {}", f(r.etcd_requests_per_create), f(r.etcd_requests_per_delete)),
                None => String::new(),
            };
            println!(
                "| {} | {:.0} | {:.2} | {:.2} | {:.2} / {:.2} | {delete} | {requests} | {:.2} / {:.2} / {:.2} |",
                r.name,
                r.rate,
                r.latency.pct(50.0),
                r.latency.pct(99.0),
                r.reads_per_create,
                r.writes_per_create,
                r.cpu_ms_per_create,
                r.etcd_cpu_ms_per_create,
                r.host_cpu_ms_per_create,
            );
            json.push(serde_json::json!({"setup": r.name, "creates": r.creates, "creates_per_s": r.rate,
                "p50_ms": r.latency.pct(50.0), "p99_ms": r.latency.pct(99.0),
                "reads_per_create": r.reads_per_create, "writes_per_create": r.writes_per_create,
                "reads_per_delete": r.reads_per_delete, "writes_per_delete": r.writes_per_delete,
                "etcd_requests_per_create": r.etcd_requests_per_create, "etcd_requests_per_delete": r.etcd_requests_per_delete,
                "cpu_ms_per_create": r.cpu_ms_per_create, "etcd_cpu_ms_per_create": r.etcd_cpu_ms_per_create,
                "host_cpu_ms_per_create": r.host_cpu_ms_per_create, "cv": r.cv, "nodes_used": r.nodes_used}));
        }
        record("control plane alone", serde_json::Value::Array(json));
        println!(
            "\n## control plane alone: load spread after {fill} creates on the 100 simulated nodes, 2 replicas in-process, memory store\n"
        );
        let rows = imbalance(fill).await?;
        record("control plane load spread", serde_json::Value::Array(rows));
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The benchmark's cluster works end to end on a small scale (so it cannot rot):
    /// 200 keyed creates over HTTP onto 5 simulated nodes on an in-memory store, every
    /// one placed on a registered node, each costing the store writes it should.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_api_servers_place_over_simulated_nodes() -> anyhow::Result<()> {
        let mem: Arc<dyn StateStore> = Arc::new(MemStore::new());
        let cluster =
            Cluster::start(vec![mem.clone(), mem], Fleet::new(5), Strategy::SampleD).await?;
        let via = cluster.http()?;
        let row = run("smoke", &via, &cluster.counts, &cluster.fleet, 200, None).await?;
        assert_eq!(row.latency.samples.len(), 200);
        // A plain keyed create of a tenant without quotas is one commit: its record,
        // `ready`, with its key, once the node made it.
        assert_eq!(row.writes_per_create, 1.0, "{row:?}");
        // A new key is looked up in the replica's cache, not the store.
        assert!(row.reads_per_create < 0.1, "{row:?}");
        // A delete is one commit once its node destroyed it (the record, its key and
        // its claim at once), guarded by the cached revision: no read.
        assert_eq!(row.writes_per_delete, 1.0, "{row:?}");
        assert!(row.reads_per_delete < 0.1, "{row:?}");
        assert!(row.cv.is_some_and(|cv| cv.is_finite()), "{row:?}");
        // Placement saw all five nodes through their registrations.
        assert_eq!(row.nodes_used, 5, "{row:?}");
        assert_eq!(
            cluster.fleet.sandboxes(),
            0,
            "every delete reached its node"
        );
        cluster.stop().await;
        Ok(())
    }
}

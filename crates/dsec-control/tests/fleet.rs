//! The control plane over a fleet: real registrations, view and placement
//! (`dsec_fleet` on an in-memory store) in front of several `FakeNode`s. Placement spreads
//! sandboxes and retries a node's refusal elsewhere; calls go to the sandbox's node; a node
//! that stops heartbeating makes its sandboxes `lost` and they come back with it; a
//! sandbox left without a record on a node is destroyed after the grace.

mod common;

use common::op;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use dsec_control::nodes::Dialer;
use dsec_control::{ControlConfig, ControlPlane, FleetNodes, SandboxApi};
use dsec_fleet::{
    Capacity, FleetView, NodeRegistration, PlacementConfig, Placer, Registry, RegistryConfig,
};
use dsec_node_api::fake::{sandbox_spec, shell_request as shell, FakeNode};
use dsec_node_api::NodeApi;
use dsec_state::{MemStore, StateStore};
use dsec_wire::v1::{CreateSandboxRequest, Isolation, NetworkMode, SandboxState};
use dsec_wire::ErrorCode;

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// Three fake nodes registered with a registry on one in-memory store, and a plane over
/// them.
struct Cluster {
    store: Arc<MemStore>,
    registry: Registry,
    nodes: BTreeMap<String, Arc<FakeNode>>,
    /// Node name -> (boot id, lease) of its registration.
    leases: std::sync::Mutex<HashMap<String, (String, i64)>>,
    /// Node name -> its pool label and CPU capacity, where not the defaults.
    shapes: HashMap<String, (String, u64)>,
}

impl Cluster {
    async fn new(names: &[&str]) -> Result<Self, Box<dyn std::error::Error>> {
        Self::with_pools(&names.iter().map(|n| (*n, "", 64_000)).collect::<Vec<_>>()).await
    }

    /// Nodes given as (name, pool label or "", CPU capacity in millicores).
    async fn with_pools(nodes: &[(&str, &str, u64)]) -> Result<Self, Box<dyn std::error::Error>> {
        let names: Vec<&str> = nodes.iter().map(|(n, _, _)| *n).collect();
        let store = Arc::new(MemStore::new());
        // Leases outlive the test: a node goes down only when a test deregisters it.
        let registry = Registry::new(
            store.clone(),
            RegistryConfig {
                ttl: Duration::from_secs(600),
                heartbeat_interval: Duration::from_secs(1),
            },
        );
        let cluster = Self {
            store,
            registry,
            nodes: names
                .iter()
                .map(|n| (n.to_string(), Arc::new(FakeNode::new(n))))
                .collect(),
            leases: Default::default(),
            shapes: nodes
                .iter()
                .map(|(n, pool, cpu)| (n.to_string(), (pool.to_string(), *cpu)))
                .collect(),
        };
        for n in names {
            cluster.up(n).await?;
        }
        Ok(cluster)
    }

    /// Registers node `name` (again: a new boot id, as a restarted node).
    async fn up(&self, name: &str) -> Result<(), Box<dyn std::error::Error>> {
        let boot_id = dsec_fleet::new_boot_id();
        let (pool, cpu_millis) = self.shapes[name].clone();
        let labels = match pool.as_str() {
            "" => BTreeMap::new(),
            pool => BTreeMap::from([(dsec_fleet::POOL_LABEL.to_string(), pool.to_string())]),
        };
        let ticket = self
            .registry
            .register(NodeRegistration {
                name: name.to_string(),
                url: format!("http://{name}.invalid:7070"),
                labels,
                isolation: vec![Isolation::Container],
                network_modes: vec![NetworkMode::None],
                capacity: Capacity {
                    cpu_millis,
                    memory_bytes: 64 << 30,
                    max_sandboxes: 0,
                },
                load: Default::default(),
                cached_layers: Vec::new(),
                version: "test".into(),
                boot_id: boot_id.clone(),
            })
            .await?;
        self.leases
            .lock()
            .map_err(|_| "poisoned")?
            .insert(name.to_string(), (boot_id, ticket.lease));
        Ok(())
    }

    /// Ends node `name`'s registration, as when its heartbeats stop.
    async fn down(&self, name: &str) -> TestResult {
        let (boot, lease) = self
            .leases
            .lock()
            .map_err(|_| "poisoned")?
            .remove(name)
            .ok_or("registered")?;
        self.registry.deregister(name, &boot, lease).await?;
        Ok(())
    }

    /// Reports `load` for node `name`, as its heartbeat does.
    async fn heartbeat(&self, name: &str, load: dsec_fleet::Load) -> TestResult {
        let (boot_id, lease) = self
            .leases
            .lock()
            .map_err(|_| "poisoned")?
            .get(name)
            .cloned()
            .ok_or("registered")?;
        self.registry
            .heartbeat(dsec_fleet::Heartbeat {
                name: name.to_string(),
                boot_id,
                lease,
                load,
                cached_layers: None,
            })
            .await?;
        Ok(())
    }

    fn node(&self, name: &str) -> Arc<FakeNode> {
        self.nodes[name].clone()
    }

    async fn plane(&self) -> Result<Arc<ControlPlane>, Box<dyn std::error::Error>> {
        self.plane_with(PlacementConfig {
            seed: Some(7),
            ..Default::default()
        })
        .await
    }

    async fn plane_with(
        &self,
        placement: PlacementConfig,
    ) -> Result<Arc<ControlPlane>, Box<dyn std::error::Error>> {
        let fakes = self.nodes.clone();
        let dial: Dialer = Arc::new(move |reg| {
            fakes
                .get(&reg.name)
                .map(|n| n.clone() as Arc<dyn NodeApi>)
                .ok_or_else(|| dsec_wire::ApiError::new(ErrorCode::Internal, "unknown fake"))
        });
        let store: Arc<dyn StateStore> = self.store.clone();
        let fleet = FleetNodes::new(
            FleetView::start(store.clone()),
            Placer::new(placement),
            self.registry.clone(),
            dial,
        );
        let mut cfg = ControlConfig::with_key("k".into());
        cfg.reap_interval = Duration::from_millis(50);
        cfg.sole_owner = false;
        Ok(ControlPlane::open_on(cfg, Arc::new(fleet), store).await?)
    }
}

/// Waits (up to 10 s) until sandbox `id` is in `state`.
async fn wait_state(plane: &ControlPlane, id: &str, state: SandboxState) -> TestResult {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let sb = plane.get_sandbox(op(), id).await?;
        if sb.state == state {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!("{id} stayed {:?}, wanted {state:?}", sb.state).into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn sandboxes_spread_over_the_nodes_and_calls_go_to_their_node() -> TestResult {
    let cluster = Cluster::new(&["n1", "n2", "n3"]).await?;
    let plane = cluster.plane().await?;
    let mut on: HashMap<String, Vec<String>> = HashMap::new();
    for _ in 0..30 {
        let sb = plane
            .create_sandbox(op(), CreateSandboxRequest::default())
            .await?;
        assert_eq!(sb.state, SandboxState::Ready);
        assert!(
            cluster.node(&sb.node).sandbox_ids().contains(&sb.id),
            "{} runs on the node its record names ({})",
            sb.id,
            sb.node
        );
        on.entry(sb.node.clone()).or_default().push(sb.id);
    }
    assert_eq!(on.len(), 3, "every node got sandboxes: {on:?}");
    // An exec reaches the sandbox's own node.
    for (name, ids) in &on {
        let before = cluster.node(name).counters.execs.load(Ordering::Relaxed);
        let out = plane.exec(op(), &ids[0], shell("echo hi")).await?;
        assert_eq!(out.exit.exit_code, Some(0));
        let after = cluster.node(name).counters.execs.load(Ordering::Relaxed);
        assert_eq!(after, before + 1, "the exec ran on {name}");
    }
    // `GET /v1/nodes` lists them; drain stops placements on one.
    let listed = plane.list_nodes(op()).await?;
    assert_eq!(listed.nodes.len(), 3);
    assert!(listed.nodes.iter().all(|n| n.live && !n.draining));
    let drained = plane.drain_node(op(), "n1", true).await?;
    assert!(drained.draining);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    // The drain reaches placement through the view's watch.
    loop {
        let sb = plane
            .create_sandbox(op(), CreateSandboxRequest::default())
            .await?;
        let n1_before = on.get("n1").map_or(0, Vec::len);
        if sb.node != "n1" {
            // Ten more in a row avoid it.
            for _ in 0..10 {
                let sb = plane
                    .create_sandbox(op(), CreateSandboxRequest::default())
                    .await?;
                assert_ne!(sb.node, "n1", "a drained node gets no new sandbox");
            }
            assert_eq!(cluster.node("n1").sandbox_ids().len(), n1_before);
            break;
        }
        on.entry(sb.node).or_default().push(sb.id);
        assert!(
            tokio::time::Instant::now() < deadline,
            "the drain took effect"
        );
    }
    plane.drain_node(op(), "n1", false).await?;
    assert_eq!(
        plane
            .drain_node(op(), "nope", false)
            .await
            .err()
            .map(|e| e.code),
        Some(ErrorCode::NotFound)
    );
    Ok(())
}

#[tokio::test]
async fn a_node_that_refuses_sends_the_sandbox_elsewhere_and_a_full_cluster_says_capacity(
) -> TestResult {
    let cluster = Cluster::new(&["n1", "n2"]).await?;
    // n1 holds one sandbox at most; n2 none at all: placement does not know, the nodes'
    // own admission refuses.
    cluster.node("n1").set_max_sandboxes(1);
    cluster.node("n2").set_max_sandboxes(1);
    cluster.node("n2").adopt(sandbox_spec("sb-filler"));
    // n1 reports half its CPU taken, so placement prefers n2, which refuses.
    cluster
        .heartbeat(
            "n1",
            dsec_fleet::Load {
                cpu_millis: 32_000,
                ..Default::default()
            },
        )
        .await?;
    // (The plane's view starts with that load.)
    let plane = cluster.plane().await?;
    let sb = plane
        .create_sandbox(op(), CreateSandboxRequest::default())
        .await?;
    assert_eq!(sb.node, "n1");
    assert_eq!(
        cluster
            .node("n2")
            .counters
            .create_calls
            .load(Ordering::Relaxed),
        1,
        "n2 was asked first and refused"
    );
    assert_eq!(cluster.node("n1").sandbox_ids(), vec![sb.id.clone()]);
    // Both full: `capacity`, and nothing left behind.
    let err = plane
        .create_sandbox(op(), CreateSandboxRequest::default())
        .await
        .err()
        .ok_or("a full cluster refuses")?;
    assert_eq!(err.code, ErrorCode::Capacity, "{}", err.message);
    assert_eq!(
        plane
            .list_sandboxes(op(), Default::default())
            .await?
            .sandboxes
            .len(),
        1
    );
    assert_eq!(cluster.node("n1").sandbox_ids().len(), 1);
    assert_eq!(
        cluster.node("n2").sandbox_ids(),
        vec!["sb-filler".to_string()]
    );
    Ok(())
}

#[tokio::test]
async fn sandboxes_of_a_node_that_goes_are_lost_and_come_back_with_it() -> TestResult {
    let cluster = Cluster::new(&["n1", "n2"]).await?;
    let plane = cluster.plane().await?;
    let mut on_n1 = Vec::new();
    while on_n1.len() < 2 {
        let sb = plane
            .create_sandbox(op(), CreateSandboxRequest::default())
            .await?;
        if sb.node == "n1" {
            on_n1.push(sb.id);
        }
    }
    cluster.down("n1").await?;
    for id in &on_n1 {
        wait_state(&plane, id, SandboxState::Lost).await?;
    }
    let lost = plane.get_sandbox(op(), &on_n1[0]).await?;
    assert_eq!(lost.lost_from, Some(SandboxState::Ready));
    assert!(lost.lost_since.is_some());
    let err = plane
        .exec(op(), &on_n1[0], shell("true"))
        .await
        .err()
        .ok_or("a lost sandbox takes no calls")?;
    assert_eq!(err.code, ErrorCode::Lost, "{}", err.message);
    // New sandboxes go to the live node.
    for _ in 0..5 {
        let sb = plane
            .create_sandbox(op(), CreateSandboxRequest::default())
            .await?;
        assert_eq!(sb.node, "n2");
    }
    // One is given up while its node is gone: the record goes at once.
    plane.delete_sandbox(op(), &on_n1[1]).await?;
    assert_eq!(
        plane
            .get_sandbox(op(), &on_n1[1])
            .await
            .err()
            .map(|e| e.code),
        Some(ErrorCode::NotFound)
    );
    // The node returns (restarted, still running both): the kept one is back, the
    // given-up one is an orphan the reaper destroys once past the grace.
    cluster.up("n1").await?;
    wait_state(&plane, &on_n1[0], SandboxState::Ready).await?;
    let back = plane.get_sandbox(op(), &on_n1[0]).await?;
    assert_eq!((back.lost_from, back.lost_since), (None, None));
    assert_eq!(
        plane
            .exec(op(), &on_n1[0], shell("true"))
            .await?
            .exit
            .exit_code,
        Some(0)
    );
    assert!(cluster.node("n1").sandbox_ids().contains(&on_n1[1]));
    // The node's clock runs 1 s per 50 ms of the test: the reaper, which passes every
    // 50 ms, destroys the orphan once it saw it without a record for 15 s of node time.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut node_time = Duration::ZERO;
    while cluster.node("n1").sandbox_ids().contains(&on_n1[1]) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the orphan was destroyed"
        );
        cluster.node("n1").advance(Duration::from_secs(1));
        node_time += Duration::from_secs(1);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        node_time >= Duration::from_secs(15),
        "an orphan has a grace of 15 s: destroyed after {node_time:?}"
    );
    assert!(
        cluster.node("n1").sandbox_ids().contains(&on_n1[0]),
        "the sandbox with a record stays"
    );
    Ok(())
}

/// A primary pool fills to its threshold (80% by default) before an overflow pool gets
/// anything; past it, creates go to the overflow pool; deleted, they free the primary
/// again. (The rule's corners are unit tests of `dsec_fleet::placement`.)
#[tokio::test]
async fn creates_overflow_to_the_cloud_pool_only_past_80_percent_of_the_primary() -> TestResult {
    // The primary holds 10 one-core sandboxes; the overflow pool many more.
    let cluster =
        Cluster::with_pools(&[("prem", "onprem", 10_000), ("cloud", "cloud", 64_000)]).await?;
    let plane = cluster
        .plane_with(PlacementConfig {
            seed: Some(7),
            overflow_pools: ["cloud".to_string()].into(),
            ..Default::default()
        })
        .await?;
    let one_core = || CreateSandboxRequest {
        resources: dsec_wire::v1::Resources {
            cpu: Some(1.0),
            ..Default::default()
        },
        ..Default::default()
    };
    let mut placed = Vec::new();
    for i in 0..12 {
        if i == 8 {
            // The primary's heartbeat reports what it holds (placements count their
            // reservations meanwhile).
            cluster
                .heartbeat(
                    "prem",
                    dsec_fleet::Load {
                        sandboxes: 8,
                        cpu_millis: 8_000,
                        ..Default::default()
                    },
                )
                .await?;
        }
        let sb = plane.create_sandbox(op(), one_core()).await?;
        placed.push((sb.id, sb.node));
    }
    let nodes: Vec<&str> = placed.iter().map(|(_, n)| n.as_str()).collect();
    // Until 8 of 10 cores are taken, the primary; from then on, the overflow pool.
    assert_eq!(nodes[..8], ["prem"; 8], "{nodes:?}");
    assert_eq!(nodes[8..], ["cloud"; 4], "{nodes:?}");
    assert_eq!(cluster.node("prem").sandbox_ids().len(), 8);
    // Room on the primary again (its heartbeat says so once the reservations lapse):
    // new work goes back to it.
    for (id, _) in placed.iter().filter(|(_, n)| n == "prem").take(4) {
        plane.delete_sandbox(op(), id).await?;
    }
    cluster
        .heartbeat(
            "prem",
            dsec_fleet::Load {
                sandboxes: 4,
                cpu_millis: 4_000,
                ..Default::default()
            },
        )
        .await?;
    let back = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let sb = plane.create_sandbox(op(), one_core()).await?;
        plane.delete_sandbox(op(), &sb.id).await?;
        if sb.node == "prem" {
            break;
        }
        assert!(
            tokio::time::Instant::now() < back,
            "work returns to the primary"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// Sandboxes created and deleted at once (an RL step's create -> exec -> delete) give
/// their placement's reservation back with the delete: 30 such cycles on a node of 2
/// cores all find room (a reservation kept for its whole linger made the node look full
/// after a few, and placement answered `capacity` with the node empty).
#[tokio::test]
async fn sandboxes_created_and_deleted_at_once_do_not_fill_the_node() -> TestResult {
    let cluster = Cluster::with_pools(&[("small", "", 2_000)]).await?;
    let plane = cluster.plane().await?;
    for i in 0..30 {
        let sb = plane
            .create_sandbox(op(), CreateSandboxRequest::default())
            .await
            .map_err(|e| format!("cycle {i}: {e}"))?;
        plane.exec(op(), &sb.id, shell("true")).await?;
        plane.delete_sandbox(op(), &sb.id).await?;
    }
    assert!(cluster.node("small").sandbox_ids().is_empty());
    Ok(())
}

/// Two API server replicas watch the same nodes come and go: each change is one event
/// (written by whichever replica got there first), a node that shut down `left`, one
/// whose registration lapsed `lost`, one that registered `joined` with what it is; and
/// tenants do not see node events.
#[tokio::test]
async fn nodes_joining_leaving_and_lost_are_events_once_across_replicas() -> TestResult {
    use dsec_wire::v1::{EventKind, EventQuery};
    let cluster = Cluster::new(&["n1", "n2"]).await?;
    let (a, b) = (cluster.plane().await?, cluster.plane().await?);
    let alice = common::tenant_on(&a, "alice").await;
    let mut on_a = a.events(op(), EventQuery::default()).await?;
    let mut on_b = b.events(op(), EventQuery::default()).await?;
    let mut alices = a.events(&alice, EventQuery::default()).await?;

    cluster.down("n2").await?;
    cluster.up("n2").await?;
    let (_, lease) = cluster.leases.lock().map_err(|_| "poisoned")?["n2"].clone();
    // Its lease lapses without a word from the node.
    cluster
        .store
        .revoke_lease(dsec_state::LeaseId(lease))
        .await?;

    let seen_a = common::take(&mut on_a, 3).await;
    let seen_b = common::take(&mut on_b, 3).await;
    assert_eq!(seen_a, seen_b, "both replicas stream the same events");
    let kinds: Vec<EventKind> = seen_a.iter().map(|e| e.kind).collect();
    assert_eq!(
        kinds,
        [
            EventKind::NodeLeft,
            EventKind::NodeJoined,
            EventKind::NodeLost
        ]
    );
    assert!(seen_a
        .iter()
        .all(|e| e.node.as_deref() == Some("n2") && e.tenant.is_none()));
    let cause = |i: usize| seen_a[i].cause.clone().unwrap_or_default();
    assert!(cause(0).contains("deregistered"), "{}", cause(0));
    assert!(cause(1).starts_with("restarted"), "{}", cause(1));
    assert!(cause(1).contains("64000 millicores"), "{}", cause(1));
    assert!(cause(2).contains("stopped heartbeating"), "{}", cause(2));

    // A tenant's stream has none of them (and meanwhile the slower replica has had
    // its try at writing each).
    use futures::StreamExt;
    let nothing = tokio::time::timeout(Duration::from_millis(500), alices.next()).await;
    assert!(nothing.is_err(), "alice sees no node events: {nothing:?}");

    // Once each: a replay of everything kept holds no second copy.
    let kept = common::take(
        &mut a
            .events(
                op(),
                EventQuery {
                    after: Some(0),
                    no_follow: true,
                    kind: Some("node_joined,node_left,node_lost".into()),
                    ..Default::default()
                },
            )
            .await?,
        3,
    )
    .await;
    assert_eq!(kept, seen_a);
    let mut rest = a
        .events(
            op(),
            EventQuery {
                after: Some(seen_a[2].id),
                no_follow: true,
                ..Default::default()
            },
        )
        .await?;
    let extra: Vec<_> = rest.by_ref().collect().await;
    assert!(extra.is_empty(), "no duplicates: {extra:?}");
    Ok(())
}

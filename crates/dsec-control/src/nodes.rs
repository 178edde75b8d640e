//! The nodes a control plane drives, behind [`NodeSet`]: one fixed node ([`SingleNode`]:
//! `dsec serve`, `dsec apiserver --node`) or the registered nodes of a cluster
//! ([`FleetNodes`]: `dsec apiserver` on etcd), and which of them gets a new sandbox.
//!
//! A sandbox's record names its node; calls on the sandbox go to that node while it is
//! live. A node that stops heartbeating is not live: its sandboxes are `lost` until it
//! comes back (see the plane's reaper).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use dsec_fleet::{
    FleetView, NodeEvent, NodeRegistration, NodeStatus, PlacementError, PlacementRequest, Placer,
    Registry, Reservation,
};
use dsec_node_api::NodeApi;
use dsec_wire::v1::{ClusterNode, ClusterNodeList, Isolation, NetworkMode};
use dsec_wire::{ApiError, ErrorCode};

use crate::api::ApiResult;

/// What a new sandbox needs of its node.
#[derive(Debug, Clone, Copy)]
pub struct Placement<'a> {
    /// Requested CPU, millicores.
    pub cpu_millis: u64,
    /// Requested memory, bytes.
    pub memory_bytes: u64,
    /// Its isolation level.
    pub isolation: Isolation,
    /// Its network mode.
    pub network: NetworkMode,
    /// Nodes that refused it already (their own admission said `capacity`).
    pub exclude: &'a [String],
}

/// A chosen node. The placement's reservation (a fleet's in-flight load) is held until
/// this is dropped: keep it until the node has answered the create.
pub struct Placed {
    /// The node's name (what the record keeps).
    pub name: String,
    /// The node.
    pub node: Arc<dyn NodeApi>,
    reservation: Option<(Reservation, Lingering)>,
}

/// How long a placement's reservation outlives the create: until the node's heartbeats
/// (every second, with a load read every half second) report the sandbox. Released at
/// once, sequential creates would all see the same stale load and pile onto one node.
pub const RESERVATION_LINGER: std::time::Duration = std::time::Duration::from_secs(2);

/// The reservations of sandboxes made a moment ago, by sandbox id: each is kept until
/// the node's heartbeats count the sandbox ([`RESERVATION_LINGER`]) or the sandbox is
/// deleted, whichever comes first. (Kept for their whole linger, the reservations of
/// sandboxes created and deleted at once added up to far more than the nodes hold, and
/// placement answered `capacity` with the nodes all but empty.)
#[derive(Debug, Clone, Default)]
pub struct Lingering(Arc<Mutex<HashMap<String, Reservation>>>);

impl Lingering {
    /// Gives back the reservation of sandbox `id`, if it still holds one.
    pub fn release(&self, id: &str) {
        let r = self.0.lock().unwrap_or_else(|p| p.into_inner()).remove(id);
        drop(r);
    }
}

impl Placed {
    /// Keeps the reservation for sandbox `id` (made) until [`RESERVATION_LINGER`] from
    /// now or its delete, whichever comes first.
    pub fn linger(self, id: &str) {
        let Some((r, lingering)) = self.reservation else {
            return;
        };
        lingering
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.to_string(), r);
        let id = id.to_string();
        tokio::spawn(async move {
            tokio::time::sleep(RESERVATION_LINGER).await;
            lingering.release(&id);
        });
    }
}

impl std::fmt::Debug for Placed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Placed").field("name", &self.name).finish()
    }
}

/// The nodes a control plane drives.
#[async_trait::async_trait]
pub trait NodeSet: Send + Sync + std::fmt::Debug {
    /// Waits until the set knows its nodes (a fleet's first listing of the store): until
    /// then every node would look gone.
    async fn synced(&self) {}

    /// Whether this is one fixed node, driven by this control plane alone.
    fn is_single(&self) -> bool;

    /// Node `name` if it is live now.
    fn get(&self, name: &str) -> Option<Arc<dyn NodeApi>>;

    /// The live nodes, by name.
    fn live(&self) -> Vec<(String, Arc<dyn NodeApi>)>;

    /// A live node for operations that any node serves (images: with a shared blob
    /// store every node sees the cluster's images).
    fn any(&self) -> ApiResult<Arc<dyn NodeApi>> {
        self.live()
            .into_iter()
            .next()
            .map(|(_, n)| n)
            .ok_or_else(no_nodes)
    }

    /// Chooses a node for a new sandbox and reserves it there.
    fn place(&self, req: &Placement<'_>) -> ApiResult<Placed>;

    /// Sandbox `id` is being deleted: what its placement still reserves is given back.
    fn release(&self, _id: &str) {}

    /// Every node, live or drained, for `GET /v1/nodes`.
    async fn describe(&self) -> ApiResult<ClusterNodeList>;

    /// Stops (`true`) or restarts new placements on node `name`.
    async fn drain(&self, name: &str, drain: bool) -> ApiResult<ClusterNode>;

    /// The nodes that join and go from now on (`None`: a fixed node, which does
    /// neither).
    fn membership(&self) -> Option<tokio::sync::mpsc::UnboundedReceiver<NodeEvent>> {
        None
    }
}

fn no_nodes() -> ApiError {
    ApiError::new(
        ErrorCode::Capacity,
        "no node is alive: start `dsec node --apiserver ...` on a machine",
    )
}

/// One fixed node.
#[derive(Debug)]
pub struct SingleNode {
    node: Arc<dyn NodeApi>,
}

impl SingleNode {
    /// The set of just `node`.
    pub fn new(node: Arc<dyn NodeApi>) -> Self {
        Self { node }
    }
}

#[async_trait::async_trait]
impl NodeSet for SingleNode {
    fn is_single(&self) -> bool {
        true
    }

    /// The node, whatever the name: records written under an earlier `--node-name` still
    /// find it.
    fn get(&self, _name: &str) -> Option<Arc<dyn NodeApi>> {
        Some(self.node.clone())
    }

    fn live(&self) -> Vec<(String, Arc<dyn NodeApi>)> {
        vec![(self.node.name().to_string(), self.node.clone())]
    }

    fn place(&self, req: &Placement<'_>) -> ApiResult<Placed> {
        let name = self.node.name().to_string();
        if req.exclude.contains(&name) {
            return Err(ApiError::new(
                ErrorCode::Capacity,
                format!("node {name} has no room for the sandbox"),
            ));
        }
        Ok(Placed {
            name,
            node: self.node.clone(),
            reservation: None,
        })
    }

    async fn describe(&self) -> ApiResult<ClusterNodeList> {
        let c = self.node.capacity().await;
        Ok(ClusterNodeList {
            nodes: vec![ClusterNode {
                name: self.node.name().to_string(),
                url: String::new(),
                labels: Default::default(),
                live: true,
                draining: false,
                cpu_millis: c.cpu_millis_allocatable,
                memory_bytes: c.memory_available_bytes,
                max_sandboxes: c.max_sandboxes,
                cpu_millis_used: c.cpu_millis_requested,
                memory_bytes_used: 0,
                sandboxes: c.sandboxes,
                version: env!("CARGO_PKG_VERSION").into(),
                boot_id: String::new(),
            }],
        })
    }

    async fn drain(&self, _name: &str, _drain: bool) -> ApiResult<ClusterNode> {
        Err(ApiError::new(
            ErrorCode::BadRequest,
            "this server runs one node of its own: drain applies to a cluster's nodes \
             (`dsec apiserver --etcd ...`)",
        ))
    }
}

/// Connects to a registered node (a `RemoteNode` over its internal API, in the binary).
pub type Dialer = Arc<dyn Fn(&NodeRegistration) -> ApiResult<Arc<dyn NodeApi>> + Send + Sync>;

/// The registered nodes of a cluster: a watch-fed [`FleetView`] of the live ones, a
/// [`Placer`] choosing among them, and a connection per node made on first use (again
/// when the node restarts at another address).
pub struct FleetNodes {
    view: FleetView,
    placer: Placer,
    registry: Registry,
    dial: Dialer,
    /// Node name → its connection.
    conns: Mutex<HashMap<String, Conn>>,
    /// Reservations of sandboxes made a moment ago.
    lingering: Lingering,
}

/// A connection to a node, and the URL and boot id it was dialed for.
struct Conn {
    url: String,
    boot_id: String,
    node: Arc<dyn NodeApi>,
}

impl std::fmt::Debug for FleetNodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FleetNodes")
            .field("live", &self.view.nodes().len())
            .finish()
    }
}

impl FleetNodes {
    /// The fleet `view` shows, placed by `placer`, drained through `registry`, each node
    /// reached through `dial`.
    pub fn new(view: FleetView, placer: Placer, registry: Registry, dial: Dialer) -> Self {
        Self {
            view,
            placer,
            registry,
            dial,
            conns: Mutex::new(HashMap::new()),
            lingering: Lingering::default(),
        }
    }

    /// The connection to a live node (`None`, as if it were gone, when it cannot be
    /// dialed).
    fn conn(&self, status: &NodeStatus) -> Option<Arc<dyn NodeApi>> {
        let r = &status.registration;
        let mut conns = self.conns.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = conns.get(&r.name) {
            if c.url == r.url && c.boot_id == r.boot_id {
                return Some(c.node.clone());
            }
        }
        let node = match (self.dial)(r) {
            Ok(node) => node,
            Err(e) => {
                tracing::warn!(node = %r.name, error = %e.message, "dialing the node failed");
                return None;
            }
        };
        conns.insert(
            r.name.clone(),
            Conn {
                url: r.url.clone(),
                boot_id: r.boot_id.clone(),
                node: node.clone(),
            },
        );
        Some(node)
    }
}

fn cluster_node(n: &NodeStatus, live: bool) -> ClusterNode {
    let r = &n.registration;
    ClusterNode {
        name: r.name.clone(),
        url: r.url.clone(),
        labels: r.labels.clone(),
        live,
        draining: n.draining,
        cpu_millis: r.capacity.cpu_millis,
        memory_bytes: r.capacity.memory_bytes,
        max_sandboxes: r.capacity.max_sandboxes,
        cpu_millis_used: r.load.cpu_millis,
        memory_bytes_used: r.load.memory_bytes,
        sandboxes: r.load.sandboxes,
        version: r.version.clone(),
        boot_id: r.boot_id.clone(),
    }
}

fn fleet_error(e: dsec_fleet::FleetError) -> ApiError {
    let code = match &e {
        dsec_fleet::FleetError::Invalid(_) => ErrorCode::BadRequest,
        dsec_fleet::FleetError::Store(dsec_state::StateError::Unavailable(_)) => {
            ErrorCode::Unavailable
        }
        _ => ErrorCode::Internal,
    };
    ApiError::new(code, e.to_string())
}

#[async_trait::async_trait]
impl NodeSet for FleetNodes {
    async fn synced(&self) {
        self.view.synced().await
    }

    fn is_single(&self) -> bool {
        false
    }

    fn membership(&self) -> Option<tokio::sync::mpsc::UnboundedReceiver<NodeEvent>> {
        Some(self.view.subscribe())
    }

    fn get(&self, name: &str) -> Option<Arc<dyn NodeApi>> {
        self.view.node(name).and_then(|s| self.conn(&s))
    }

    fn live(&self) -> Vec<(String, Arc<dyn NodeApi>)> {
        self.view
            .nodes()
            .iter()
            .filter_map(|s| Some((s.name().to_string(), self.conn(s)?)))
            .collect()
    }

    fn release(&self, id: &str) {
        self.lingering.release(id);
    }

    fn place(&self, req: &Placement<'_>) -> ApiResult<Placed> {
        let nodes = self.view.nodes();
        let request = PlacementRequest {
            cpu_millis: req.cpu_millis,
            memory_bytes: req.memory_bytes,
            isolation: req.isolation,
            network: req.network,
            layers: &[],
            // Every node of a cluster shares the blob store, so any may fetch the image.
            overflow_eligible: true,
            exclude: req.exclude,
        };
        match self.placer.place(&nodes, &request) {
            Ok(reservation) => {
                let status = nodes
                    .iter()
                    .find(|n| n.name() == reservation.node())
                    .ok_or_else(|| ApiError::new(ErrorCode::Internal, "placed on no node"))?;
                let node = self.conn(status).ok_or_else(|| {
                    ApiError::new(
                        ErrorCode::Capacity,
                        format!("node {} cannot be dialed", status.name()),
                    )
                })?;
                Ok(Placed {
                    name: status.name().to_string(),
                    node,
                    reservation: Some((reservation, self.lingering.clone())),
                })
            }
            Err(PlacementError::NoNodes) => Err(no_nodes()),
            Err(e @ PlacementError::Unsupported { .. }) => {
                Err(ApiError::new(ErrorCode::BadRequest, e.to_string()))
            }
            Err(e) => Err(ApiError::new(ErrorCode::Capacity, e.to_string())),
        }
    }

    async fn describe(&self) -> ApiResult<ClusterNodeList> {
        let live: std::collections::HashSet<String> = self
            .view
            .nodes()
            .iter()
            .map(|n| n.name().to_string())
            .collect();
        let mut nodes: Vec<ClusterNode> = self
            .registry
            .list()
            .await
            .map_err(fleet_error)?
            .iter()
            .map(|n| cluster_node(n, live.contains(n.name())))
            .collect();
        nodes.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(ClusterNodeList { nodes })
    }

    async fn drain(&self, name: &str, drain: bool) -> ApiResult<ClusterNode> {
        if drain {
            self.registry.drain(name).await.map_err(fleet_error)?;
        } else {
            self.registry.undrain(name).await.map_err(fleet_error)?;
        }
        let listed = self.registry.list().await.map_err(fleet_error)?;
        match listed.iter().find(|n| n.name() == name) {
            Some(n) => Ok(cluster_node(n, self.view.node(name).is_some())),
            None => Err(ApiError::new(
                ErrorCode::NotFound,
                format!(
                    "node {name} is not registered{}",
                    if drain {
                        " (it is drained anyway, from the moment it joins)"
                    } else {
                        ""
                    }
                ),
            )),
        }
    }
}

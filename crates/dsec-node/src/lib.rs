//! The node runtime ("edge"): everything that runs sandboxes on one machine.
//!
//! [`NodeApi`] is what the control plane sees of a node: create, destroy, list, connect
//! to a sandbox's agent, images. [`LocalNode`] implements it in-process (the single-node
//! `dsec serve`); a remote implementation over HTTP changes transport, not logic.
//!
//! Architecture invariants:
//! - the node is the source of truth for what runs on its machine; each sandbox's
//!   directory holds a `runtime.json` with which a restarted node re-adopts it;
//! - each sandbox writes to its own size-limited disk (`dsec-disk`) unless the node
//!   runs without disk limits;
//! - each backend sits behind [`backend::Backend`]; only `container` exists today;
//! - the overlay lives in the sandbox's own mount namespace; the only per-sandbox
//!   host mount is its disk, under the sandbox's directory; shared layer mounts are refcounted by the image store.

pub mod admission;
pub mod agent_conn;
pub mod backend;
pub mod claims;
pub mod config;
pub mod container;
pub mod error;
pub mod local;
pub mod mntns;
pub mod nspool;
pub mod oci;
pub mod priority;
mod procstat;
pub mod rundir;
pub mod spawn;
pub mod swap;
pub mod userns;
pub mod zygote;

use std::collections::BTreeMap;

pub use agent_conn::AgentConn;
pub use config::{DiskSettings, NodeConfig};
pub use error::NodeError;
pub use local::LocalNode;

use dsec_wire::v1::Image;

/// What the control plane asks a node to create.
#[derive(Debug, Clone)]
pub struct NodeCreateSpec {
    /// Sandbox id (already validated, unique).
    pub id: String,
    /// Image name or digest.
    pub image: String,
    /// More images stacked on top of `image`, in order (each may have several layers).
    pub layers: Vec<String>,
    /// CPU limit in millicores.
    pub cpu_millis: u64,
    /// Memory limit in bytes.
    pub memory_bytes: u64,
    /// Process limit.
    pub pids_max: u64,
    /// Writable-layer size in MiB; `None` takes the node's default.
    pub disk_mb: Option<u64>,
    /// CPU class.
    pub qos: dsec_wire::v1::Qos,
    /// Environment of commands.
    pub env: BTreeMap<String, String>,
    /// Default working directory.
    pub workdir: String,
    /// Default user of commands (name or `UID[:GID]`); `None`: root.
    pub user: Option<String>,
    /// Network policy.
    pub network: dsec_wire::v1::NetworkPolicy,
    /// Commands may write only beneath these paths, when not empty.
    pub writable_paths: Vec<String>,
    /// Commands may bind only these TCP ports, when set.
    pub tcp_bind: Option<Vec<u16>>,
    /// Commands may connect only to these TCP ports, when set.
    pub tcp_connect: Option<Vec<u16>>,
    /// Isolation level.
    pub isolation: dsec_wire::v1::Isolation,
    /// The sandbox's labels (a label may name the tenant whose uid range it shares).
    pub labels: BTreeMap<String, String>,
}

/// A sandbox as the node knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSandbox {
    /// Sandbox id.
    pub id: String,
    /// Digest of its image layer.
    pub image_digest: String,
    /// Host pid of its init (the agent).
    pub pid: i32,
    /// Whether its init is still running.
    pub alive: bool,
    /// Size of its writable layer in MiB, if the node limits disk.
    pub disk_mb: Option<u64>,
    /// Its IPv4 address, when it is networked.
    pub ip: Option<std::net::Ipv4Addr>,
}

/// The node as the control plane sees it.
/// Receives the progress of an image import, as wire `Progress` events.
pub type ImportProgressSink = std::sync::Arc<dyn Fn(dsec_wire::v1::ImportEvent) + Send + Sync>;

#[async_trait::async_trait]
pub trait NodeApi: Send + Sync + std::fmt::Debug + 'static {
    /// Node name.
    fn name(&self) -> &str;
    /// `v1` or `v2`.
    fn cgroup_version(&self) -> &'static str;
    /// Creates a sandbox; returns once its agent answers.
    async fn create(&self, spec: NodeCreateSpec) -> Result<NodeSandbox, NodeError>;
    /// Destroys a sandbox and releases everything it held. Idempotent.
    async fn destroy(&self, id: &str) -> Result<(), NodeError>;
    /// Sandboxes on this node.
    async fn list(&self) -> Vec<NodeSandbox>;
    /// A connection to a sandbox's agent: the idle one kept by [`NodeApi::reuse`] if it
    /// is still good, else a new one.
    async fn connect(&self, id: &str) -> Result<AgentConn, NodeError>;
    /// Hands back a connection whose last request
    /// [`keeps_connection`](dsec_wire::agent::Request::keeps_connection) and whose reply
    /// was read to its end, for the sandbox's next request. The default closes it.
    fn reuse(&self, id: &str, conn: AgentConn) {
        let _ = (id, conn);
    }
    /// Freezes a sandbox and reclaims its memory; returns its memory use before and after.
    async fn pause(&self, id: &str) -> Result<(u64, u64), NodeError>;
    /// Thaws a paused sandbox.
    async fn resume(&self, id: &str) -> Result<(), NodeError>;
    /// packdiff: stores the sandbox's writable layer as a new layer and names the image
    /// `name` = its layer stack + `previous_diffs` (layers of its earlier commits) + it.
    /// Returns the image and the new layer, `None` when nothing changed since the last
    /// commit (the image then adds no layer). The sandbox should be paused meanwhile.
    async fn commit(
        &self,
        id: &str,
        name: &str,
        previous_diffs: Vec<String>,
        config: dsec_wire::v1::ImageConfig,
    ) -> Result<(Image, Option<String>), NodeError>;
    /// Replaces a networked sandbox's policy.
    async fn set_network(
        &self,
        id: &str,
        policy: dsec_wire::v1::NetworkPolicy,
    ) -> Result<(), NodeError>;
    /// Number of OOM kills in the sandbox so far.
    async fn oom_kill_count(&self, id: &str) -> Result<u64, NodeError>;
    /// Capacity and load, for placement.
    async fn capacity(&self) -> admission::Capacity;
    /// Images on this node.
    async fn list_images(&self) -> Result<Vec<Image>, NodeError>;
    /// One image by name or digest.
    async fn image(&self, name: &str) -> Result<Image, NodeError>;
    /// Imports an image from a path on this machine, reporting progress to `progress`.
    async fn import_image(
        &self,
        name: &str,
        source: &std::path::Path,
        flatten: bool,
        progress: Option<ImportProgressSink>,
    ) -> Result<Image, NodeError>;
    /// Removes an image name.
    async fn remove_image(&self, name: &str) -> Result<(), NodeError>;
    /// Removes build-cache refs older than `req.older_than_s` and the layers only they
    /// used, trims the layer cache to its limit and, if asked, sweeps the shared store.
    async fn gc_images(
        &self,
        req: &dsec_wire::v1::GcRequest,
    ) -> Result<dsec_wire::v1::GcResult, NodeError>;
    /// Accounting of the layers this node serves on demand.
    async fn layer_stats(&self) -> Result<dsec_wire::v1::LayerStatsList, NodeError>;
    /// Names `source`'s layers and config `name` too.
    async fn tag_image(&self, source: &str, name: &str) -> Result<Image, NodeError>;
}

//! The backend trait: how one kind of sandbox (container, microVM, ...) is created,
//! found again after a node restart, and destroyed. The node's lifecycle code is the same
//! for all of them.

use std::path::PathBuf;

use crate::{NodeCreateSpec, NodeError};

/// A running sandbox as its backend tracks it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RuntimeRecord {
    /// Sandbox id.
    pub id: String,
    /// Image layer digest (holds one reference on its shared mount).
    pub image_digest: String,
    /// Host pid of the sandbox's init.
    pub pid: i32,
    /// Start time of that pid (field 22 of /proc/PID/stat), to detect pid reuse.
    pub pid_start_time: u64,
    /// Relative cgroup path.
    pub cgroup: String,
    /// The agent's socket.
    pub agent_socket: PathBuf,
    /// Size of the sandbox's disk in MiB, if it has one.
    #[serde(default)]
    pub disk_mb: Option<u64>,
    /// Requested CPU in millicores (for admission).
    #[serde(default)]
    pub cpu_millis: u64,
    /// Digests of the layers it stacks, bottom first (each holds one mount reference);
    /// empty in records from before multi-layer images: then `image_digest` is the layer.
    #[serde(default)]
    pub layers: Vec<String>,
    /// Its network slot and policy, when it is networked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net: Option<dsec_net::NetRecord>,
    /// Its isolation level.
    #[serde(default)]
    pub isolation: dsec_wire::v1::Isolation,
    /// The host uid range of its user namespace, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub userns: Option<crate::userns::UsernsRecord>,
}

impl RuntimeRecord {
    /// The layers whose mounts this sandbox holds, bottom first.
    pub fn layer_digests(&self) -> Vec<String> {
        if self.layers.is_empty() {
            vec![self.image_digest.clone()]
        } else {
            self.layers.clone()
        }
    }
}

/// The read-only layers of a sandbox: the image digest and each layer's digest and mount
/// point, bottom first.
#[derive(Debug, Clone)]
pub struct Layers {
    /// Digest naming the whole stack.
    pub digest: String,
    /// `(layer digest, mount point)`, bottom first.
    pub layers: Vec<(String, std::path::PathBuf)>,
    /// Each layer's EROFS file, bottom first (what a microVM attaches as a disk).
    pub files: Vec<std::path::PathBuf>,
}

/// One kind of sandbox.
pub trait Backend: Send + Sync + std::fmt::Debug + 'static {
    /// Creates and starts a sandbox on the mounted `layers`, marking its phases on
    /// `timeline` (`disk`, `namespaces`, `cgroup`, `network`, `init`, as it has them).
    /// Blocking; called on a blocking thread. Everything is released on failure (but
    /// the layer references).
    fn create(
        &self,
        spec: &NodeCreateSpec,
        layers: &Layers,
        timeline: &mut dsec_node_api::Timeline,
    ) -> Result<RuntimeRecord, NodeError>;
    /// Kills a sandbox and removes its resources (not the image reference). Idempotent.
    /// Works on a paused sandbox too.
    fn destroy(&self, id: &str) -> Result<(), NodeError>;
    /// Stops every process of a sandbox and reclaims its memory; returns memory use
    /// (bytes) before and after the reclaim.
    fn pause(&self, id: &str) -> Result<(u64, u64), NodeError>;
    /// Lets a paused sandbox run again. Returns its new record when resuming changed it
    /// (a microVM restored from its snapshot runs in a new process).
    fn resume(&self, id: &str) -> Result<Option<RuntimeRecord>, NodeError>;
    /// Runs `f` with the host path of the sandbox's writable (overlayfs upper) directory,
    /// the sandbox's processes stopped meanwhile (a running sandbox runs on afterwards; a
    /// paused one stays paused). Stopped, not paused: its memory is not reclaimed, as the
    /// copy reads the pages it has just written.
    fn with_upper(
        &self,
        id: &str,
        f: &mut dyn FnMut(&std::path::Path) -> Result<(), NodeError>,
    ) -> Result<(), NodeError>;
    /// After a node restart: the sandboxes still alive (to adopt); everything else that
    /// this backend left behind is cleaned up.
    fn recover(&self) -> Result<Vec<RuntimeRecord>, NodeError>;
    /// A graceful stop: ends the backend's helpers (zygote, pools). With `empty` (no
    /// sandbox left) it also removes what it keeps on the host for sandboxes (nftables
    /// table, links, cgroup parent); otherwise that stays for the next start to adopt.
    fn shutdown(&self, empty: bool) {
        let _ = empty;
    }
    /// Whether the sandbox's init still runs.
    fn is_alive(&self, rec: &RuntimeRecord) -> bool;
    /// OOM kills in the sandbox so far.
    fn oom_kill_count(&self, id: &str) -> Result<u64, NodeError>;
    /// Replaces a networked sandbox's policy.
    fn set_network(&self, id: &str, policy: &dsec_wire::v1::NetworkPolicy)
        -> Result<(), NodeError>;
    /// The address of a networked sandbox.
    fn address(&self, rec: &RuntimeRecord) -> Option<std::net::Ipv4Addr>;
    /// A full VM's screen, as PNG.
    fn screenshot(&self, id: &str) -> Result<Vec<u8>, NodeError> {
        Err(NodeError::Unsupported(format!(
            "sandbox {id} has no screen: only isolation vm has one"
        )))
    }
    /// Types `events` into a full VM's keyboard.
    fn send_input(&self, id: &str, events: &[dsec_wire::v1::InputEvent]) -> Result<(), NodeError> {
        let _ = events;
        self.screenshot(id).map(drop)
    }
    /// Free space on the sandbox's writable disk, in MiB, where it has one of its own.
    fn disk_free_mb(&self, _id: &str) -> Option<u64> {
        None
    }
}

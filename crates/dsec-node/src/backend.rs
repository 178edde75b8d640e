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
}

/// One kind of sandbox.
pub trait Backend: Send + Sync + std::fmt::Debug + 'static {
    /// Creates and starts a sandbox from an image whose layer is mounted at `lower`.
    /// Blocking; called on a blocking thread. Everything is released on failure.
    fn create(
        &self,
        spec: &NodeCreateSpec,
        digest: &str,
        lower: &std::path::Path,
    ) -> Result<RuntimeRecord, NodeError>;
    /// Kills a sandbox and removes its resources (not the image reference). Idempotent.
    fn destroy(&self, id: &str) -> Result<(), NodeError>;
    /// After a node restart: the sandboxes still alive (to adopt); everything else that
    /// this backend left behind is cleaned up.
    fn recover(&self) -> Result<Vec<RuntimeRecord>, NodeError>;
    /// Whether the sandbox's init still runs.
    fn is_alive(&self, rec: &RuntimeRecord) -> bool;
    /// OOM kills in the sandbox so far.
    fn oom_kill_count(&self, id: &str) -> Result<u64, NodeError>;
}

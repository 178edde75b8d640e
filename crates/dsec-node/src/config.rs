//! Node configuration.

use std::path::PathBuf;

/// Where the node keeps things and how it starts sandboxes.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// Node name (reported in the API).
    pub name: String,
    /// Persistent state: images, sandbox upper directories, runtime records.
    pub state_dir: PathBuf,
    /// Volatile state: agent sockets.
    pub run_dir: PathBuf,
    /// The `dsec-agent` binary started as each sandbox's init.
    pub agent_bin: PathBuf,
    /// How long a create may take before it is abandoned.
    pub create_timeout: std::time::Duration,
    /// Per-sandbox disks; `None` lets sandboxes write to the node's disk without limit.
    pub disk: Option<DiskSettings>,
    /// How many sandboxes the node admits.
    pub admission: crate::admission::AdmissionConfig,
    /// A swap file (path, MiB) the node keeps active, so pause can reclaim anonymous
    /// memory; `None` uses whatever swap the host has (often none).
    pub swap_file: Option<(PathBuf, u64)>,
    /// Sandbox networking (modes `allowlist`, `open`); `None` allows only mode `none`.
    /// Started on first use, so a node whose sandboxes never network touches neither
    /// nftables nor the host's forwarding setting.
    pub network: Option<dsec_net::NetConfig>,
    /// Parent cgroup of this node's sandboxes (relative to each hierarchy's root). It
    /// belongs to this node alone: on start, sandboxes under it that the node does not
    /// know are destroyed.
    pub cgroup_parent: String,
    /// Add `favordynmods` to the host's cgroup2 mount at start (see
    /// `dsec_cgroups::dynmods`): joining a cgroup then never waits for an RCU grace period.
    pub cgroup_favor_dynmods: bool,
    /// Mount a tmpfs on the run directory at start when it is on disk and empty (see
    /// [`crate::rundir`]).
    pub run_dir_tmpfs: bool,
    /// Network namespaces (with their user namespaces) kept ready for creates of network
    /// mode `none` (see [`crate::nspool`]); 0 lets each init make its own.
    pub netns_pool: usize,
    /// Sandbox deletes torn down at once (0: no limit); further deletes wait their turn,
    /// so a burst of deletes does not take the CPU from creates (see `LocalNode::destroy`).
    pub delete_concurrency: usize,
    /// Run sandboxes in user namespaces, each mapping ids 0..65535 to a host range of
    /// the node's (`None`: sandboxes' root is the host's root, with fewer capabilities).
    pub userns: Option<crate::userns::UsernsConfig>,
    /// OCI runtime for sandboxes of isolation level `oci` (`None`: level unavailable).
    pub oci_runtime: Option<PathBuf>,
    /// gVisor's `runsc` for sandboxes of isolation level `gvisor` (`None`: level
    /// unavailable), and the platform it runs them on.
    pub gvisor: Option<crate::gvisor::Gvisor>,
    /// QEMU and the guest kernel for sandboxes of isolation level `microvm` (`None`:
    /// level unavailable).
    pub microvm: Option<crate::microvm::MicroVmConfig>,
    /// The cluster's shared blob store (a directory path, `s3://...`, `http(s)://...`;
    /// see `dsec-blob`); `None`: the node's image directory is the only store.
    pub blob_store: Option<String>,
    /// Size limit of the node's layer cache in bytes (with a shared store; `None`: none).
    pub layer_cache_bytes: Option<u64>,
    /// Serve layers from the shared store on demand, fetching chunks as sandboxes read
    /// them, with a chunk cache of this many bytes (`None`: download layers whole).
    pub lazy_chunk_cache_bytes: Option<u64>,
    /// How long after a lazy layer's first read its reads are recorded as its prefetch
    /// list (zero: no recording).
    pub lazy_prefetch_window: std::time::Duration,
    /// Chunk size of the chunk index uploaded with each layer (0: 256 KiB).
    pub chunk_size: u64,
    /// How long a ref read from the shared store serves before it is read again.
    pub ref_ttl: std::time::Duration,
    /// How to start the lazy layer server; `None`: this executable's `lazy-serve`.
    pub lazy_launcher: Option<dsec_lazy::Launcher>,
    /// How often the node ends sandboxes whose lifetime ran out (see
    /// [`DEFAULT_REAP_INTERVAL`]).
    pub reap_interval: std::time::Duration,
    /// How the node pulls from OCI registries (credentials, limits).
    pub registry: dsec_registry::RegistryConfig,
    /// Calls a sandbox's record keeps (calls with a request id); beyond them new ids are
    /// refused (`no_space`) and calls without one still run. Each costs the node a few
    /// hundred bytes of memory while its sandbox lives.
    pub max_recorded_calls: usize,
}

/// The default [`NodeConfig::reap_interval`].
pub const DEFAULT_REAP_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

/// Size-limited sandbox disks (see `dsec-disk`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskSettings {
    /// Size of a sandbox's disk when its create names none, in MiB.
    pub default_mb: u64,
    /// Mounted disks of the default size kept ready.
    pub pool_size: usize,
}

impl Default for DiskSettings {
    fn default() -> Self {
        Self {
            default_mb: 10 * 1024,
            pool_size: 32,
        }
    }
}

impl NodeConfig {
    /// Directory of disk templates and the disk pool.
    pub fn disks_dir(&self) -> PathBuf {
        self.state_dir.join("disks")
    }
    /// Directory holding the image store.
    pub fn images_dir(&self) -> PathBuf {
        self.state_dir.join("images")
    }
    /// Directory of one sandbox's persistent state.
    pub fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.state_dir.join("sandboxes").join(id)
    }
    /// Directory of one sandbox's volatile state (its agent socket).
    pub fn sandbox_run_dir(&self, id: &str) -> PathBuf {
        self.run_dir.join("sandboxes").join(id)
    }
    /// The agent socket of a sandbox.
    pub fn agent_socket(&self, id: &str) -> PathBuf {
        self.sandbox_run_dir(id).join("agent.sock")
    }
}

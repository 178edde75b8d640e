//! Command-line syntax: the clap definitions and the small value parsers they use.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

/// dsec: sandboxes for AI-agent training.
#[derive(Debug, Parser)]
#[command(name = "dsec", version, about, propagate_version = true)]
pub struct Cli {
    /// Server URL.
    #[arg(long, global = true, env = "DSEC_URL", default_value = dsec_client::DEFAULT_URL)]
    pub url: String,
    /// API key (default: $DSEC_API_KEY_FILE or /var/lib/dsec/api-key if readable).
    #[arg(long, global = true, env = "DSEC_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Machine-readable JSON output.
    #[arg(long, global = true)]
    pub json: bool,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Top-level commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the dsec server (API + node) on this machine.
    Serve(Box<ServeArgs>),
    /// Run only the node runtime, serving its internal API to API servers. Takes
    /// `serve`'s node flags; `--listen` is the internal API's address. With `--apiserver`
    /// it joins a cluster (registers and heartbeats). `dsec node ls|drain|undrain` manage
    /// a cluster's nodes through an API server.
    #[command(args_conflicts_with_subcommands = true)]
    Node(Box<NodeArgs>),
    /// Run only the public API (the `/v1` API, the E2B and SWE-ReX fronts, `/metrics`):
    /// over one node (`--node`), or over the nodes that register with it (`--etcd`).
    Apiserver(Box<ApiserverArgs>),
    /// Create, inspect, use and remove sandboxes.
    #[command(subcommand, visible_alias = "sb")]
    Sandbox(SandboxCommand),
    /// Manage images.
    #[command(subcommand)]
    Image(ImageCommand),
    /// Warm pools: sandboxes made ahead of demand, claimed by `sandbox create --pool`.
    #[command(subcommand)]
    Pool(PoolCommand),
    /// Run one function call in a pool made with `pool create --fncall`: prints its
    /// output and exits with its exit code.
    Fncall(FnCallArgs),
    /// Show the creates waiting for capacity, by priority level.
    Queue,
    /// Show what happened to sandboxes and nodes (created, ready, paused, expired,
    /// oom_killed, disk_full, deleted, ...) with causes; --follow streams new events.
    Events(EventsArgs),
    /// Show the audit log: who (key, tenant) made which state-changing call, on which
    /// sandbox, when, with which result; refused calls included (admin keys).
    Audit(AuditArgs),
    /// Submit a batch job (YAML or JSON; see docs/batches.md): prints its id, or with
    /// --wait follows it and exits 1 if a task failed.
    Submit(SubmitArgs),
    /// Inspect, follow and cancel batch jobs, and fetch their outputs.
    #[command(subcommand)]
    Batch(BatchCommand),
    /// Suspend or resume every sandbox of a job (sandboxes labelled job=NAME).
    #[command(subcommand)]
    Job(JobCommand),
    /// Manage tenants and their quotas (admin keys).
    #[command(subcommand)]
    Tenant(crate::iam::TenantCommand),
    /// Manage API keys: create, list, revoke, rotate (admin keys).
    #[command(subcommand)]
    Key(crate::iam::KeyCommand),
    /// Run the model gateway: an OpenAI-compatible proxy (chat completions, completions,
    /// embeddings, models) in front of the inference upstreams of its configuration,
    /// whose keys stay with it. See docs/gateway.md.
    Gateway(GatewayArgs),
    /// The lazy layer server `dsec serve --lazy-layers` starts (internal).
    #[command(hide = true)]
    LazyServe {
        /// Its configuration (`dsec_lazy::ServeConfig` as JSON).
        config: String,
    },
}

/// `dsec events`.
#[derive(Debug, Args)]
pub struct EventsArgs {
    /// Keep streaming new events (resuming after a dropped connection) until interrupted.
    #[arg(long, short)]
    pub follow: bool,
    /// Start after this event id (printed with --json); default: every kept event, or
    /// with --follow only new ones.
    #[arg(long)]
    pub after: Option<u64>,
    /// Only this sandbox's events.
    #[arg(long)]
    pub sandbox: Option<String>,
    /// Only this tenant's events (cluster admins).
    #[arg(long)]
    pub tenant: Option<String>,
    /// Only these kinds (comma-separated or repeated), e.g. oom_killed,disk_full.
    #[arg(long, value_delimiter = ',')]
    pub kind: Vec<String>,
    /// Only sandboxes with these labels (KEY=VALUE, comma-separated or repeated).
    #[arg(long, value_delimiter = ',')]
    pub label: Vec<String>,
}

/// `dsec audit`.
#[derive(Debug, Args)]
pub struct AuditArgs {
    /// Only entries from this many seconds ago on (default: the newest entries).
    #[arg(long)]
    pub since_s: Option<u64>,
    /// Only this tenant's calls (cluster admins).
    #[arg(long)]
    pub tenant: Option<String>,
    /// Only calls on this sandbox.
    #[arg(long)]
    pub sandbox: Option<String>,
    /// Only this key's calls.
    #[arg(long)]
    pub key_id: Option<String>,
    /// Only refused or failed calls.
    #[arg(long)]
    pub failed: bool,
    /// At most this many entries.
    #[arg(long)]
    pub limit: Option<usize>,
}

/// `dsec gateway`.
#[derive(Debug, Args)]
pub struct GatewayArgs {
    /// Its configuration (YAML: api_keys, and per model its upstreams).
    #[arg(long)]
    pub config: PathBuf,
    /// Address to serve on. In a cluster, nodes forward their sandboxes' model address
    /// here (`dsec node --model-gateway`): an address they reach, not loopback.
    #[arg(long, default_value = "127.0.0.1:8090")]
    pub listen: std::net::SocketAddr,
    /// etcd endpoints of the cluster (`http://HOST:PORT`, comma-separated): the gateway
    /// then also accepts the tokens of sandboxes created with `model_access`, as the API
    /// servers mint them (and stops accepting one when its sandbox is deleted).
    #[arg(long, value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Prefix of every key in etcd (as the API servers were given).
    #[arg(long, default_value = "/dsec")]
    pub etcd_prefix: String,
}

/// `dsec node`.
#[derive(Debug, Args)]
pub struct NodeArgs {
    /// Manage a cluster's nodes instead of running one.
    #[command(subcommand)]
    pub command: Option<NodeCommand>,
    /// File holding the token API servers must present (created, mode 0600, with a
    /// random token when missing). Default: STATE_DIR/node-token. In a cluster, every
    /// node and API server shares one.
    #[arg(long)]
    pub node_token_file: Option<PathBuf>,
    /// API servers to register with and heartbeat to (`http://HOST:PORT`,
    /// comma-separated; tried in turn): the node joins their cluster.
    #[arg(long, value_delimiter = ',')]
    pub apiserver: Vec<String>,
    /// The URL API servers reach this node's internal API at. Default:
    /// `http://` + --listen (which must then not be a wildcard address).
    #[arg(long)]
    pub advertise_url: Option<String>,
    /// A label of this node (`pool=onprem`; repeatable). `pool` names its placement pool.
    #[arg(long = "label", value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    /// A `dsec gateway` (IP:PORT, reachable from this node) that this node's sandboxes
    /// with model access reach at the model address (--model-address).
    #[arg(long)]
    pub model_gateway: Option<std::net::SocketAddrV4>,
    /// The node's flags, as `dsec serve` takes them.
    #[command(flatten)]
    pub serve: ServeArgs,
}

/// `dsec node ls|drain|undrain`.
#[derive(Debug, Subcommand)]
pub enum NodeCommand {
    /// List the cluster's nodes.
    #[command(visible_alias = "list")]
    Ls,
    /// Stop placing new sandboxes on a node; its sandboxes keep running.
    Drain {
        /// Node name.
        name: String,
    },
    /// Place new sandboxes on a drained node again.
    Undrain {
        /// Node name.
        name: String,
    },
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("label {s:?} must be KEY=VALUE")),
    }
}

/// `dsec apiserver`.
#[derive(Debug, Args)]
pub struct ApiserverArgs {
    /// Export spans over OTLP/HTTP (JSON) to this collector (`http://HOST:4318`; a URL
    /// with a path is used as given). Off by default.
    #[arg(long, env = "DSEC_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:7070")]
    pub listen: SocketAddr,
    /// A create slower than this (ms) is logged with its phases (0: none).
    #[arg(long, default_value_t = 2000)]
    pub slow_create_ms: u64,
    /// How long events (`GET /v1/events`, `dsec events`) are kept, in seconds; 0 keeps
    /// none and turns the event stream off.
    #[arg(long, default_value_t = dsec_wire::v1::DEFAULT_EVENTS_RETENTION_S)]
    pub events_retention_s: u64,
    /// Directory of the audit log (every state-changing call, refused ones included;
    /// `GET /v1/audit`, `dsec audit`). Default: STATE_DIR/audit.
    #[arg(long)]
    pub audit_dir: Option<PathBuf>,
    /// An audit file is rotated at this size (MiB).
    #[arg(long, default_value_t = 16)]
    pub audit_file_mb: u64,
    /// Audit files kept, the current one included; 0 keeps no audit log.
    #[arg(long, default_value_t = 8)]
    pub audit_files: usize,
    /// Directory of the API server's state (its API key and, without --etcd, records).
    #[arg(long, default_value = "/var/lib/dsec-apiserver")]
    pub state_dir: PathBuf,
    /// etcd endpoints (`http://HOST:PORT`, comma-separated) holding the cluster's
    /// records: then any number of API servers may serve the same sandboxes. Without
    /// it, records are kept in STATE_DIR (one API server).
    #[arg(long, value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Prefix of every key in etcd (several clusters may share one etcd).
    #[arg(long, default_value = "/dsec")]
    pub etcd_prefix: String,
    /// File holding the API key clients must present (created, mode 0600, with a
    /// random key when missing; replicas share one). Default: STATE_DIR/api-key.
    #[arg(long)]
    pub api_key_file: Option<PathBuf>,
    /// Internal API of the one node to drive (`http://HOST:PORT` of `dsec node
    /// --listen`). Without it (and with --etcd), the API server drives the nodes that
    /// register with it (`dsec node --apiserver`).
    #[arg(long)]
    pub node: Option<String>,
    /// File holding the node token (`dsec node` prints where it keeps it); nodes present
    /// it to register, and the API server presents it to nodes.
    #[arg(long)]
    pub node_token_file: PathBuf,
    /// A pool of nodes (their `pool` label) that takes sandboxes only when the other
    /// pools are over --overflow-threshold (repeatable; e.g. `cloud`).
    #[arg(long = "overflow-pool")]
    pub overflow_pools: Vec<String>,
    /// Utilization of the primary pools above which sandboxes overflow.
    #[arg(long, default_value_t = 0.8)]
    pub overflow_threshold: f64,
    /// An upload that brings no data for this long ends with `timeout`.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub upload_idle_timeout_s: u64,
    /// TCP keepalive of client connections, seconds of silence.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub tcp_keepalive_s: u64,
    /// Job suspend leaves the sandboxes' lifetimes running.
    #[arg(long)]
    pub job_suspend_keeps_lifetime: bool,
    /// Where batches keep inputs, outputs and error snapshots: a directory, file://,
    /// s3:// or http(s)://. Replicas must share one. Default: a directory in --state-dir.
    #[arg(long)]
    pub batch_store: Option<String>,
    /// The models of the cluster's `dsec gateway` (comma-separated public names):
    /// sandboxes may then be created with `model_access` to them. Needs --etcd (the
    /// gateway reads the tokens from it) and nodes run with --model-gateway.
    #[arg(long, value_delimiter = ',', requires = "etcd")]
    pub model_gateway_models: Vec<String>,
    /// The address sandboxes call the model gateway at, as the nodes' --model-address.
    #[arg(long, default_value = "169.254.169.250:80")]
    pub model_address: std::net::SocketAddrV4,
}

/// `dsec job ...`.
#[derive(Debug, Subcommand)]
pub enum JobCommand {
    /// Pause every sandbox of the job and stop their lifetimes (trainer preempted).
    Suspend {
        /// Job name (the value of the sandboxes' `job` label).
        job: String,
    },
    /// Resume them; lifetimes continue where they stopped.
    Resume {
        /// Job name.
        job: String,
    },
}

/// `--qos` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum QosArg {
    /// Normal scheduling, double CPU weight.
    LatencySensitive,
    /// SCHED_IDLE, lowest CPU weight.
    BestEffort,
}

/// `--network` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum NetworkArg {
    /// Loopback only.
    None,
    /// Only the --allow destinations; DNS answers only for allowed names.
    Allowlist,
    /// Anywhere but the node, other sandboxes and link-local addresses.
    Open,
}

impl NetworkArg {
    /// The policy these flags ask for.
    pub fn policy(self, allow: Vec<String>) -> dsec_wire::v1::NetworkPolicy {
        use dsec_wire::v1::NetworkMode;
        let mode = match self {
            NetworkArg::None if allow.is_empty() => NetworkMode::None,
            // --allow alone means an allowlist.
            NetworkArg::None | NetworkArg::Allowlist => NetworkMode::Allowlist,
            NetworkArg::Open => NetworkMode::Open,
        };
        dsec_wire::v1::NetworkPolicy { mode, allow }
    }
}

/// `dsec serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Export spans over OTLP/HTTP (JSON) to this collector (`http://HOST:4318`; a URL
    /// with a path is used as given). Off by default.
    #[arg(long, env = "DSEC_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:7070")]
    pub listen: SocketAddr,
    /// Persistent state: database, images, API key.
    #[arg(long, default_value = "/var/lib/dsec")]
    pub state_dir: PathBuf,
    /// Runtime state: sandbox roots, sockets, agent logs. Volatile: when it is on disk
    /// and empty at start, the node mounts a tmpfs on it (like `/run` on most hosts).
    #[arg(long, default_value = "/run/dsec")]
    pub run_dir: PathBuf,
    /// Keep the run directory on disk even when it is not on a tmpfs.
    #[arg(long)]
    pub run_dir_on_disk: bool,
    /// Network namespaces kept ready for sandboxes of network mode none (0: each
    /// sandbox makes its own while it starts).
    #[arg(long, default_value_t = 16)]
    pub netns_pool: usize,
    /// Sandbox deletes torn down at once; further deletes wait their turn, so a burst
    /// of deletes cannot take the CPU from creates (0: no limit).
    #[arg(long, default_value_t = 4)]
    pub delete_concurrency: usize,
    /// The in-sandbox agent binary (default: found next to this executable).
    #[arg(long)]
    pub agent_bin: Option<PathBuf>,
    /// Node name reported by the API (default: the host name).
    #[arg(long)]
    pub node_name: Option<String>,
    /// Default size of a sandbox's writable disk in MiB (each sandbox gets its own
    /// size-limited file system); 0 lets sandboxes write to the node's disk unlimited.
    #[arg(long, default_value_t = 10240)]
    pub disk_mb: u64,
    /// An upload (file or tar) that sends no data for this many seconds is aborted, its
    /// partial file removed: a client that vanished without closing its connection (a
    /// preempted machine) must not hold it forever.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub upload_idle_timeout_s: u64,
    /// API connections silent for this many seconds are probed (TCP keepalive); a client
    /// that does not answer for about twice as long is dropped, and a command it was
    /// streaming is stopped.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub tcp_keepalive_s: u64,
    /// Sandboxes' requested CPU may add up to this many times the host's CPUs (most
    /// sandboxes idle; memory is what really fills a node).
    #[arg(long, default_value_t = 1000.0)]
    pub cpu_overcommit: f64,
    /// Host memory (MiB) kept free for the node: below it creates answer `capacity`.
    #[arg(long, default_value_t = 512)]
    pub memory_reserve_mb: u64,
    /// A swap file the node creates (if missing) and keeps on, so that pausing a sandbox
    /// also takes back its anonymous memory (sandboxes never swap otherwise).
    #[arg(long, requires = "swap_mb")]
    pub swap_file: Option<PathBuf>,
    /// Size of --swap-file in MiB.
    #[arg(long, requires = "swap_file")]
    pub swap_mb: Option<u64>,
    /// Let sandboxes of a suspended job expire as usual (by default a job suspend stops
    /// their lifetimes until the job resumes).
    #[arg(long)]
    pub job_suspend_keeps_lifetime: bool,
    /// Where batches keep inputs, outputs and error snapshots: a directory, file://,
    /// s3:// or http(s)://. Default: the --blob-store if given, else a directory in
    /// --state-dir.
    #[arg(long)]
    pub batch_store: Option<String>,
    /// Most sandboxes on this node (0: no count limit).
    #[arg(long, default_value_t = 0)]
    pub max_sandboxes: usize,
    /// Calls with a request id a sandbox's record keeps (each a few hundred bytes of the
    /// node's memory while the sandbox lives); beyond them new request ids are refused
    /// with `no_space` (the Python SDK then sends its calls without one).
    #[arg(long, default_value_t = dsec_wire::v1::MAX_CALLS_PER_SANDBOX as u64,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub max_recorded_calls: u64,
    /// Disks of the default size kept formatted and mounted for fast creates (deleted
    /// sandboxes' lightly used disks refill it, up to twice this many).
    #[arg(long, default_value_t = 32)]
    pub disk_pool: usize,
    /// Run the model gateway in this process with this configuration (YAML, as `dsec
    /// gateway --config` takes it; see docs/gateway.md). Sandboxes created with
    /// `model_access` then call its models with a token of their own, which their tenant's
    /// keys mint and their delete revokes.
    #[arg(long)]
    pub gateway_config: Option<PathBuf>,
    /// With --gateway-config: where the gateway serves callers outside sandboxes (trainers,
    /// judges), with the configuration's api_keys or a sandbox's token.
    #[arg(long, default_value = "127.0.0.1:8090")]
    pub gateway_listen: SocketAddr,
    /// With --gateway-config: the port sandboxes' model address is redirected to (the
    /// gateway listens on it on every address; links other than sandboxes' and loopback
    /// are refused it, as the resolver port is).
    #[arg(long, default_value_t = 15380)]
    pub gateway_sandbox_port: u16,
    /// A create slower than this (ms) is logged with its phases (0: none).
    #[arg(long, default_value_t = 2000)]
    pub slow_create_ms: u64,
    /// How long events (`GET /v1/events`, `dsec events`) are kept, in seconds; 0 keeps
    /// none and turns the event stream off.
    #[arg(long, default_value_t = dsec_wire::v1::DEFAULT_EVENTS_RETENTION_S)]
    pub events_retention_s: u64,
    /// Directory of the audit log (every state-changing call, refused ones included;
    /// `GET /v1/audit`, `dsec audit`). Default: STATE_DIR/audit.
    #[arg(long)]
    pub audit_dir: Option<PathBuf>,
    /// An audit file is rotated at this size (MiB).
    #[arg(long, default_value_t = 16)]
    pub audit_file_mb: u64,
    /// Audit files kept, the current one included; 0 keeps no audit log.
    #[arg(long, default_value_t = 8)]
    pub audit_files: usize,
    /// The address code in a sandbox calls the model gateway at (its OPENAI_BASE_URL is
    /// http://ADDRESS/v1): link-local, answered by this node and nowhere else.
    #[arg(long, default_value = "169.254.169.250:80")]
    pub model_address: std::net::SocketAddrV4,
    /// Give sandboxes no network at all (only mode `none`); nftables and the host's
    /// forwarding setting are then never touched.
    #[arg(long)]
    pub no_network: bool,
    /// Subnet for networked sandboxes, one /30 each.
    #[arg(long, default_value = "10.231.0.0/16", value_parser = parse_subnet)]
    pub sandbox_subnet: (std::net::Ipv4Addr, u8),
    /// Upstream DNS resolver for sandboxes (default: first nameserver of /etc/resolv.conf).
    #[arg(long)]
    pub dns_upstream: Option<SocketAddr>,
    /// Port of the node's filtering resolver (sandboxes' port 53 is redirected to it).
    #[arg(long, default_value_t = 15353)]
    pub dns_port: u16,
    /// nftables table (family inet) this node owns.
    #[arg(long, default_value = "dsec")]
    pub nft_table: String,
    /// Prefix of the host ends of sandbox links.
    #[arg(long, default_value = "dsv")]
    pub link_prefix: String,
    /// Parent cgroup of the sandboxes; one per node on a host (a node destroys the
    /// sandboxes under it that it does not know).
    #[arg(long, default_value = "dsec", value_parser = parse_cgroup_parent)]
    pub cgroup_parent: String,
    /// Leave the host's cgroup2 mount options alone. By default the node adds
    /// `favordynmods` (keeping every other option): without it each sandbox's join of its
    /// cgroup may wait for an RCU grace period, 10-20 ms.
    #[arg(long)]
    pub keep_cgroup_mount: bool,
    /// Remove every trace of this node from the host and exit instead of serving: deletes
    /// every sandbox (with `dsec serve`, its record too; with `dsec node`, the API
    /// servers' records of them turn `lost`), then its run directory, cgroup parent, nftables
    /// table and links, and claim file. Images, the API key and the state database stay
    /// in --state-dir. Fails while a node runs on these names.
    #[arg(long)]
    pub cleanup: bool,
    /// Sandboxes run in user namespaces whose ids 0..65535 map to a host range of
    /// 65536 ids cut from N upwards, so root in a sandbox is nobody on the host. Layers
    /// and disks are idmapped, so files keep their owners. Pick ids no user has in
    /// /etc/subuid.
    #[arg(long, default_value_t = 1_000_000_000)]
    pub userns_base: u32,
    /// Who shares a uid range: `sandbox` (each its own), `label:KEY` (sandboxes with the
    /// same value of label KEY, e.g. a tenant; those without it get their own) or `node`
    /// (all sandboxes share the first range).
    #[arg(long, default_value = "sandbox")]
    pub userns_scope: dsec_node::userns::UsernsScope,
    /// How many ranges of 65536 ids from --userns-base the node may use (at most what
    /// fits below 2^32): creates beyond that many ranges in use are refused.
    #[arg(long, default_value_t = 16_384)]
    pub userns_ranges: u32,
    /// Run sandboxes without a user namespace (root inside is host root, with a reduced
    /// capability set): for kernels without idmapped mounts.
    #[arg(long)]
    pub no_userns: bool,
    /// OCI runtime for sandboxes created with isolation `oci` (default: runc from PATH,
    /// if installed; runsc for gVisor).
    #[arg(long)]
    pub oci_runtime: Option<PathBuf>,
    /// gVisor's runsc for sandboxes created with isolation `gvisor` (default: runsc from
    /// PATH, if installed).
    #[arg(long)]
    pub gvisor_runtime: Option<PathBuf>,
    /// The gVisor platform: systrap, ptrace or kvm (default: systrap where runsc has it,
    /// else ptrace).
    #[arg(long)]
    pub gvisor_platform: Option<String>,
    /// QEMU for sandboxes created with isolation `microvm` (default:
    /// qemu-system-x86_64 from PATH, if installed).
    #[arg(long)]
    pub microvm_qemu: Option<PathBuf>,
    /// The microVMs' guest kernel, `vmlinuz-<release>` with its modules in
    /// /lib/modules/<release> (default: the newest in /boot, a -cloud- one first).
    #[arg(long)]
    pub microvm_kernel: Option<PathBuf>,
    /// How microVMs run: tcg (QEMU's translator, anywhere) or kvm (a /dev/kvm that runs
    /// stock guests). Default tcg: KVM is used only when asked for.
    #[arg(long, value_parser = ["tcg", "kvm"])]
    pub microvm_accel: Option<String>,
    /// How long a microVM's or VM's guest may take to boot to its agent.
    #[arg(long, default_value = "90s", value_parser = humantime::parse_duration)]
    pub microvm_boot_timeout: std::time::Duration,
    /// Give microVM guests no free page reporting: the memory a guest frees stays with
    /// its QEMU (for comparison; by default it goes back to the host).
    #[arg(long)]
    pub microvm_no_free_page_reporting: bool,
    /// Network namespaces kept prepared for fast creates.
    #[arg(long, default_value_t = 8)]
    pub net_pool: usize,
    /// Blob store the nodes of a cluster share for image layers and names: a directory
    /// (e.g. an NFS mount), s3://BUCKET/PREFIX (credentials, region and endpoint from
    /// AWS_* variables or ?endpoint=URL&region=R), or http(s)://HOST/PREFIX. Imports
    /// upload to it; layers are fetched from it on first use. Default: none (this node's
    /// image directory is the only store).
    #[arg(long)]
    pub blob_store: Option<String>,
    /// Size limit of this node's layer cache in MiB, with --blob-store: least recently
    /// used layers that no sandbox mounts are evicted (0: no limit).
    #[arg(long, default_value_t = 0, requires = "blob_store")]
    pub layer_cache_mb: u64,
    /// With --blob-store, do not download a layer whole: serve it on demand, fetching
    /// 256 KiB chunks as sandboxes read them (a FUSE file under the image store that EROFS
    /// mounts), verified against the chunk index the uploading node wrote.
    #[arg(long, requires = "blob_store")]
    pub lazy_layers: bool,
    /// Size limit of the on-demand chunk cache in MiB (kept across restarts).
    #[arg(long, default_value_t = 10240)]
    pub chunk_cache_mb: u64,
    /// With --blob-store: a name read from the store serves this many milliseconds before
    /// it is read again, so creates do not each read the store; names re-pointed or
    /// removed on other nodes are seen within this time (0: read on every create).
    #[arg(long, default_value_t = 1000)]
    pub ref_cache_ms: u64,
    /// With --blob-store: chunk size, in KiB, of the chunk index uploaded with each layer
    /// (what --lazy-layers nodes fetch and verify; a multiple of 4). Smaller fetches less
    /// beyond what sandboxes read, larger needs fewer requests to a high-latency store.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(4..=16384))]
    pub chunk_kib: u64,
    /// With --lazy-layers: a layer's reads in this many seconds after its first read are
    /// saved to the shared store as its prefetch list, which nodes that add the layer
    /// later fetch ahead of reads (0: record nothing; lists others wrote still replay).
    #[arg(long, default_value_t = 30)]
    pub prefetch_window_s: u64,
    /// Credentials for pulls from OCI registries: a JSON file (mode 0600) mapping a
    /// registry host as references name it (`host[:port]`; Docker Hub: `docker.io`) to
    /// `{"username": .., "password": ..}` (basic auth, or exchanged for a bearer token when
    /// the registry asks for one) or `{"token": ..}` (a bearer token sent as is).
    /// Registries not listed are pulled from anonymously.
    #[arg(long)]
    pub registry_auth: Option<PathBuf>,
    /// A registry (`host[:port]` as references name it) the server may pull from;
    /// repeatable. Without any, pulls may reach every registry whose host is a public
    /// name or address (loopback, private, link-local, CGNAT and ULA addresses refused).
    /// With some, only the registries named, plus every public one if `public` is one
    /// of them. A private registry must be named to be reached.
    #[arg(long = "allow-registry", value_name = "HOST[:PORT]")]
    pub allow_registry: Vec<String>,
    /// A registry (`host[:port]`) the server speaks plain HTTP to (no TLS); repeatable.
    /// Pulls of a reference to it, and creates naming one, use HTTP.
    #[arg(long = "insecure-registry", value_name = "HOST[:PORT]")]
    pub insecure_registry: Vec<String>,
}

/// One `--run` or `--copy` of `dsec image build`, in command-line order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BuildArg {
    /// `--run CMD`.
    Run(String),
    /// `--copy SRC:DEST`.
    Copy(String),
}

/// `--run` and `--copy` values of `dsec image build` interleaved as they were given.
pub fn build_order(m: &clap::ArgMatches) -> Vec<BuildArg> {
    let mut steps: Vec<(usize, BuildArg)> = Vec::new();
    for (id, make) in [
        ("runs", BuildArg::Run as fn(String) -> BuildArg),
        ("copies", BuildArg::Copy as fn(String) -> BuildArg),
    ] {
        if let (Some(idx), Some(vals)) = (m.indices_of(id), m.get_many::<String>(id)) {
            steps.extend(idx.zip(vals.cloned().map(make)));
        }
    }
    steps.sort_by_key(|(i, _)| *i);
    steps.into_iter().map(|(_, s)| s).collect()
}

fn parse_cgroup_parent(s: &str) -> Result<String, String> {
    let ok = !s.is_empty()
        && s.split('/').all(|c| {
            !c.is_empty()
                && c != "."
                && c != ".."
                && c.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        });
    ok.then(|| s.to_string())
        .ok_or_else(|| format!("{s:?}: a relative cgroup path of [A-Za-z0-9._-] components"))
}

fn parse_subnet(s: &str) -> Result<(std::net::Ipv4Addr, u8), String> {
    let (ip, len) = s
        .split_once('/')
        .ok_or_else(|| format!("{s:?}: expected ADDRESS/PREFIX"))?;
    let ip: std::net::Ipv4Addr = ip
        .parse()
        .map_err(|_| format!("{ip:?}: not an IPv4 address"))?;
    let len: u8 = len
        .parse()
        .ok()
        .filter(|l| (8..=30).contains(l))
        .ok_or_else(|| format!("{len:?}: prefix length must be 8-30"))?;
    let mask = u32::MAX << (32 - len);
    Ok((std::net::Ipv4Addr::from(u32::from(ip) & mask), len))
}

/// `dsec sandbox ...`.
#[derive(Debug, Subcommand)]
pub enum SandboxCommand {
    /// Create a sandbox and print its id.
    Create(Box<CreateArgs>),
    /// List sandboxes.
    #[command(visible_alias = "list")]
    Ls {
        /// Only sandboxes with this label (repeatable; all must match).
        #[arg(long = "label", value_name = "K=V", value_parser = parse_key_value)]
        labels: Vec<(String, String)>,
    },
    /// Show one sandbox.
    Get {
        /// Sandbox id.
        id: String,
    },
    /// Remove sandboxes.
    #[command(visible_alias = "delete")]
    Rm {
        /// Sandbox ids.
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Run a command, streaming its output; exits with the command's exit code.
    Exec(ExecArgs),
    /// An interactive line-based shell session in a sandbox.
    Shell {
        /// Sandbox id.
        id: String,
        /// Interrupt a command after this long (e.g. 30s, 5m).
        #[arg(long, value_parser = parse_duration)]
        timeout: Option<Duration>,
    },
    /// Copy files or directories: one side is ID:/path, the other a local path.
    Cp {
        /// Source: LOCAL or ID:/PATH.
        #[arg(value_parser = parse_cp_side)]
        src: CpSide,
        /// Destination: LOCAL or ID:/PATH.
        #[arg(value_parser = parse_cp_side)]
        dst: CpSide,
    },
    /// Print the output of a background process.
    Logs {
        /// Sandbox id.
        id: String,
        /// Process id inside the sandbox.
        pid: u32,
        /// Keep streaming until the process exits.
        #[arg(short, long)]
        follow: bool,
    },
    /// Save a sandbox's files as a new image (its layers + what it changed); a second
    /// commit stores only what changed since the first.
    Commit {
        /// Sandbox id.
        id: String,
        /// Name of the new image.
        name: String,
    },
    /// Replace a sandbox's network policy (allowlist <-> open; not for mode none).
    Network {
        /// Sandbox id.
        id: String,
        /// New mode.
        #[arg(long, value_enum, default_value_t = NetworkArg::Allowlist)]
        mode: NetworkArg,
        /// Allowed destination (repeatable).
        #[arg(long = "allow", value_name = "DEST")]
        allow: Vec<String>,
    },
    /// Save a full VM's screen as PNG (isolation vm).
    Screen {
        /// Sandbox id.
        id: String,
        /// Where to write it (`-`: standard output).
        #[arg(short, long, default_value = "screen.png")]
        output: PathBuf,
    },
    /// Type into a full VM's keyboard (isolation vm): text, then key chords, in the
    /// order given.
    Type {
        /// Sandbox id.
        id: String,
        /// Text to type (US layout; `\n` in the shell's quoting is Enter).
        #[arg(long)]
        text: Option<String>,
        /// A key or a chord, keys joined by `+` (`ret`, `ctrl+c`, `ctrl+alt+f2`;
        /// repeatable, after the text).
        #[arg(long = "keys", value_name = "CHORD")]
        keys: Vec<String>,
    },
    /// Click a full VM's pointer at pixel (X, Y) of its screen (isolation vm).
    Click {
        /// Sandbox id.
        id: String,
        /// Column, from the left (a screenshot's pixels).
        x: u32,
        /// Row, from the top.
        y: u32,
        /// The button.
        #[arg(long, value_enum, default_value = "left")]
        button: ClickButton,
        /// Clicks in a row (2: a double click).
        #[arg(long, default_value_t = 1)]
        count: u8,
    },
    /// Turn a full VM's mouse wheel (isolation vm): positive scrolls down.
    Scroll {
        /// Sandbox id.
        id: String,
        /// Notches.
        #[arg(allow_hyphen_values = true)]
        dy: i32,
    },
    /// Freeze sandboxes and give their memory back (processes and state survive).
    Pause {
        /// Sandbox ids.
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Let paused sandboxes run again.
    Resume {
        /// Sandbox ids.
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Set a sandbox's remaining lifetime (e.g. 3600, 90m, 2h).
    Timeout {
        /// Sandbox id.
        id: String,
        /// New remaining lifetime.
        #[arg(value_parser = parse_duration)]
        duration: Duration,
    },
}

/// `dsec sandbox create`.
#[derive(Debug, Args)]
pub struct CreateArgs {
    /// Image name or sha256: digest (server default: base).
    #[arg(long)]
    pub image: Option<String>,
    /// An image stacked on top (repeatable, bottom first): workspace, toolkits.
    #[arg(long = "layer", value_name = "IMAGE")]
    pub layers: Vec<String>,
    /// CPU limit in cores (server default: 1).
    #[arg(long)]
    pub cpu: Option<f64>,
    /// Memory limit in MiB (server default: 512).
    #[arg(long)]
    pub memory_mb: Option<u64>,
    /// Process limit (server default: 512).
    #[arg(long)]
    pub pids: Option<u64>,
    /// When paused, resume on the next command instead of answering `paused`.
    #[arg(long)]
    pub auto_resume: bool,
    /// CPU class: best-effort sandboxes run SCHED_IDLE and yield to everything else.
    #[arg(long, value_enum, default_value_t = QosArg::LatencySensitive)]
    pub qos: QosArg,
    /// Writable disk size in MiB (server default: 10240).
    #[arg(long)]
    pub disk_mb: Option<u64>,
    /// Network mode (default none: loopback only).
    #[arg(long, value_enum, default_value_t = NetworkArg::None)]
    pub network: NetworkArg,
    /// Allowed destination (repeatable; implies --network allowlist): NAME, *.SUFFIX,
    /// IP or CIDR, each with an optional :PORT.
    #[arg(long = "allow", value_name = "DEST")]
    pub allow: Vec<String>,
    /// Commands may write only beneath this path (repeatable; Landlock).
    #[arg(long = "writable", value_name = "PATH")]
    pub writable: Vec<String>,
    /// Commands may bind TCP sockets only to this port (repeatable; Landlock).
    #[arg(long = "tcp-bind", value_name = "PORT")]
    pub tcp_bind: Vec<u16>,
    /// Commands may connect TCP sockets only to this port (repeatable; Landlock).
    #[arg(long = "tcp-connect", value_name = "PORT")]
    pub tcp_connect: Vec<u16>,
    /// Run under the node's OCI runtime (runc) instead of dsec's container.
    #[arg(long, conflicts_with_all = ["gvisor", "microvm", "vm"])]
    pub oci: bool,
    /// Run under gVisor (the node's runsc): system calls served by gVisor's kernel.
    #[arg(long, conflicts_with_all = ["microvm", "vm"])]
    pub gvisor: bool,
    /// Run in a QEMU microVM with a kernel of its own (networks none, allowlist or open;
    /// no file or TCP rules yet).
    #[arg(long, conflicts_with = "vm")]
    pub microvm: bool,
    /// Run in a full virtual machine (QEMU q35 with a screen and a keyboard) that boots
    /// the image's own init (systemd); the agent runs as its service (network none).
    #[arg(long)]
    pub vm: bool,
    /// Lifetime (e.g. 3600, 90m, 1h; server default: 1h).
    #[arg(long, value_parser = parse_duration)]
    pub timeout: Option<Duration>,
    /// Delete after this long without API activity.
    #[arg(long, value_parser = parse_duration)]
    pub idle_timeout: Option<Duration>,
    /// Environment variable for every command (repeatable).
    #[arg(long = "env", short = 'e', value_name = "K=V", value_parser = parse_key_value)]
    pub env: Vec<(String, String)>,
    /// Label (repeatable).
    #[arg(long = "label", short = 'l', value_name = "K=V", value_parser = parse_key_value)]
    pub labels: Vec<(String, String)>,
    /// Local file to place in the sandbox before it is ready (repeatable).
    #[arg(long = "file", value_name = "LOCAL:/REMOTE", value_parser = parse_file_mapping)]
    pub files: Vec<(PathBuf, String)>,
    /// Default working directory for commands.
    #[arg(long)]
    pub workdir: Option<String>,
    /// Default user of commands (a name in the image, or UID[:GID]; default: the
    /// image's user, else root).
    #[arg(long)]
    pub user: Option<String>,
    /// Claim a warm sandbox of this pool (`dsec pool`) instead of making one; the
    /// environment is the pool's.
    #[arg(long)]
    pub pool: Option<String>,
    /// Wait at most this long for a warm sandbox (with --pool), or for room on a full
    /// node (without: the create waits in the capacity queue instead of failing).
    /// Server default: 30s.
    #[arg(long, value_parser = parse_duration)]
    pub max_wait: Option<Duration>,
    /// Place among waiting creates: high, medium (default) or low (low takes only spare
    /// warm sandboxes of a pool, and never grows it). Implies waiting.
    #[arg(long, value_parser = parse_priority)]
    pub priority: Option<dsec_wire::v1::Priority>,
    /// A model of the server's model gateway code in the sandbox may call (repeatable):
    /// the sandbox gets its own token in OPENAI_API_KEY and the gateway's URL in
    /// OPENAI_BASE_URL.
    #[arg(long = "model", value_name = "NAME")]
    pub models: Vec<String>,
    /// With --model: model tokens the sandbox may spend in all.
    #[arg(long, requires = "models")]
    pub model_budget: Option<u64>,
    /// With --model: model requests per minute.
    #[arg(long, requires = "models")]
    pub model_rpm: Option<u32>,
}

fn parse_priority(s: &str) -> Result<dsec_wire::v1::Priority, String> {
    serde_json::from_value(serde_json::Value::String(s.to_string()))
        .map_err(|_| format!("{s:?}: one of high, medium, low"))
}

/// `dsec fncall`.
#[derive(Debug, clap::Args)]
pub struct FnCallArgs {
    /// The pool (created with --fncall).
    #[arg(long)]
    pub pool: String,
    /// Run this file's code with --language instead of a command.
    #[arg(long, value_name = "FILE", requires = "language")]
    pub code_file: Option<std::path::PathBuf>,
    /// Language of --code-file: python, bash, sh, cpp or c.
    #[arg(long)]
    pub language: Option<String>,
    /// Kill the call after this long (default 10s).
    #[arg(long, value_parser = parse_duration)]
    pub timeout: Option<Duration>,
    /// Pass this process's stdin to the call.
    #[arg(long)]
    pub stdin: bool,
    /// The command to run (argv), after `--`.
    #[arg(last = true)]
    pub command: Vec<String>,
}

/// `dsec submit`.
#[derive(Debug, Args)]
pub struct SubmitArgs {
    /// The job file. Inputs given as `{file: PATH}` (relative to it) are uploaded first.
    pub file: PathBuf,
    /// Follow the batch to its end.
    #[arg(long)]
    pub wait: bool,
}

/// `dsec batch ...`: batch jobs.
#[derive(Debug, Subcommand)]
pub enum BatchCommand {
    /// List the tenant's batches.
    Ls,
    /// A batch's state and counts per task state.
    Get {
        /// Batch id.
        id: String,
    },
    /// Follow a batch to its end.
    Wait {
        /// Batch id.
        id: String,
    },
    /// A batch's tasks.
    Tasks {
        /// Batch id.
        id: String,
        /// Only tasks in this state (pending, creating, initialized, running,
        /// collecting, finalized, failed).
        #[arg(long)]
        state: Option<String>,
    },
    /// The batch's manifest (JSON): images, layers, commands, input digests, nodes.
    Manifest {
        /// Batch id.
        id: String,
    },
    /// A task's collected output (--path), or its error snapshot.
    Output {
        /// Batch id.
        id: String,
        /// Task id.
        task: String,
        /// The output's path in the sandbox; without it, the error snapshot.
        #[arg(long)]
        path: Option<String>,
        /// Write to this file instead of stdout.
        #[arg(short, long)]
        out: Option<PathBuf>,
    },
    /// Cancel a running batch.
    Cancel {
        /// Batch id.
        id: String,
    },
    /// Forget an ended batch: its tasks, outputs and snapshots.
    Rm {
        /// Batch id.
        id: String,
    },
    /// Upload a file as input KEY (tasks name it `{blob: KEY}`).
    PutInput {
        /// Key, a relative path (`sets/a.txt`).
        key: String,
        /// The file.
        file: PathBuf,
    },
}

/// `dsec pool ...`: warm pools.
#[derive(Debug, Subcommand)]
pub enum PoolCommand {
    /// Create a warm pool: sandboxes of one environment made ahead of demand, which
    /// `dsec sandbox create --pool NAME` claims at once. The environment flags are
    /// `dsec sandbox create`'s.
    Create {
        /// Pool name ([a-z0-9][a-z0-9._-]*).
        name: String,
        /// Fewest sandboxes to keep (default 1).
        #[arg(long)]
        min: Option<u32>,
        /// Most sandboxes to keep (default 32).
        #[arg(long)]
        max: Option<u32>,
        /// The autoscale policy as JSON (fields of `autoscale` in `POST /v1/pools`).
        #[arg(long, value_name = "JSON")]
        autoscale: Option<String>,
        /// The pool serves function calls (`dsec fncall`) instead of claims.
        #[arg(long)]
        fncall: bool,
        /// With --fncall: calls one sandbox serves before it is replaced (default 1000).
        #[arg(long, requires = "fncall")]
        max_calls: Option<u32>,
        /// The environment of its sandboxes.
        #[command(flatten)]
        template: Box<CreateArgs>,
    },
    /// List the pools.
    #[command(visible_alias = "list")]
    Ls,
    /// Show one pool: sizes, queue, scale events.
    Get {
        /// Pool name.
        name: String,
    },
    /// Change a pool's bounds or autoscale policy.
    Set {
        /// Pool name.
        name: String,
        /// New minimum.
        #[arg(long)]
        min: Option<u32>,
        /// New maximum.
        #[arg(long)]
        max: Option<u32>,
        /// New autoscale policy as JSON (replaces the whole policy).
        #[arg(long, value_name = "JSON")]
        autoscale: Option<String>,
    },
    /// Delete a pool and its warm sandboxes (claimed ones stay).
    #[command(visible_alias = "delete")]
    Rm {
        /// Pool name.
        name: String,
    },
}

/// `dsec sandbox exec`.
#[derive(Debug, Args)]
pub struct ExecArgs {
    /// Sandbox id.
    pub id: String,
    /// Extra environment variable (repeatable).
    #[arg(long = "env", short = 'e', value_name = "K=V", value_parser = parse_key_value)]
    pub env: Vec<(String, String)>,
    /// Working directory.
    #[arg(long)]
    pub cwd: Option<String>,
    /// Kill the command after this long (e.g. 30s, 5m).
    #[arg(long, value_parser = parse_duration)]
    pub timeout: Option<Duration>,
    /// Send this program's stdin (UTF-8 text, read to EOF) to the command.
    #[arg(long)]
    pub stdin: bool,
    /// Run as this user (a name in the sandbox, or UID[:GID]; default: the sandbox's).
    #[arg(long, short = 'u')]
    pub user: Option<String>,
    /// The command and its arguments (after `--`).
    #[arg(last = true, required = true, value_name = "CMD")]
    pub cmd: Vec<String>,
}

/// `dsec image ...`.
#[derive(Debug, Subcommand)]
pub enum ImageCommand {
    /// Build an image in dsec sandboxes, each step a layer cached by (parent image, step),
    /// so a rebuild redoes only what changed: from a Dockerfile (`dsec image build [-f
    /// Dockerfile] CONTEXT NAME`), or from a base and shell steps (`dsec image build NAME
    /// --from base --run CMD ...`).
    Build {
        /// The build context directory (a Dockerfile build, NAME follows), or the NAME of
        /// the result of a --run/--copy build.
        #[arg(value_name = "CONTEXT|NAME")]
        first: String,
        /// Name of the result of a Dockerfile build.
        #[arg(value_name = "NAME")]
        second: Option<String>,
        /// The Dockerfile (default: CONTEXT/Dockerfile); it may be outside the context.
        #[arg(long, short = 'f', value_name = "DOCKERFILE")]
        file: Option<PathBuf>,
        /// A Dockerfile ARG value (repeatable).
        #[arg(long = "build-arg", value_name = "NAME=VALUE")]
        build_args: Vec<String>,
        /// The stage of the Dockerfile to build (default: the last).
        #[arg(long)]
        target: Option<String>,
        /// Run every step again instead of taking layers from the build cache.
        #[arg(long)]
        no_cache: bool,
        /// Network of RUN steps: none (default) or open (the internet, never the node or
        /// other sandboxes).
        #[arg(long, value_name = "MODE")]
        network: Option<String>,
        /// Image to start from.
        #[arg(long, default_value = "base")]
        from: String,
        /// A shell command (repeatable; steps keep their command-line order).
        #[arg(
            long = "run",
            value_name = "CMD",
            required_unless_present_any = ["copies", "second", "file"]
        )]
        runs: Vec<String>,
        /// Local files or a directory to place in the image (repeatable): SRC:DEST copies
        /// the file SRC, or the contents of directory SRC, into directory DEST.
        #[arg(long = "copy", value_name = "SRC:DEST")]
        copies: Vec<String>,
        /// `runs` and `copies` in command-line order (filled in by `main`).
        #[arg(skip)]
        order: Vec<BuildArg>,
    },
    /// Drop `dsec image build`'s cache (and the layers only it used), trim the node's
    /// layer cache to its limit, and with --shared sweep the shared blob store.
    Gc {
        /// Keep build-cache entries younger than this (e.g. 24h; default: drop all).
        #[arg(long, value_parser = parse_duration)]
        older_than: Option<Duration>,
        /// Also delete layers no image uses from the shared blob store.
        #[arg(long)]
        shared: bool,
        /// With --shared, keep layers written less than this long ago (default 1h).
        #[arg(long, value_parser = parse_duration, requires = "shared")]
        shared_grace: Option<Duration>,
    },
    /// Import an image from a directory or .tar/.tar.gz on the server's machine.
    Import {
        /// Name to give the image (e.g. python:3.11).
        name: String,
        /// A root file system (directory, .tar, .tar.gz), a `docker save` archive or an
        /// OCI layout (made absolute; must be readable by the server).
        source: PathBuf,
        /// Store a docker/OCI image as one layer instead of one layer per image layer.
        #[arg(long)]
        flatten: bool,
        /// Send the file from this machine instead of naming a path on the server (a
        /// tar, .tar.gz, `docker save` or OCI archive, or .erofs; a directory must be
        /// tarred first). Needed for an API server whose node is another machine.
        #[arg(long)]
        upload: bool,
    },
    /// Pull an image from an OCI registry (the server's node fetches it, with the
    /// credentials of its --registry-auth file). Layers already pulled are reused.
    Pull {
        /// `[REGISTRY[:PORT]/]REPOSITORY[:TAG][@sha256:DIGEST]` (no registry: Docker Hub;
        /// no tag: latest).
        reference: String,
        /// Name to give the image (default: the reference, `@` written `:`).
        #[arg(long)]
        name: Option<String>,
        /// The registry speaks plain HTTP (no TLS).
        #[arg(long)]
        insecure_registry: bool,
    },
    /// List images.
    #[command(visible_alias = "list")]
    Ls,
    /// Remove an image.
    #[command(visible_alias = "delete")]
    Rm {
        /// Image name.
        name: String,
    },
}

/// One side of `dsec sandbox cp`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CpSide {
    /// A path on this machine.
    Local(PathBuf),
    /// A path in a sandbox.
    Remote {
        /// Sandbox id.
        id: String,
        /// Absolute path inside it.
        path: String,
    },
}

/// Parses `LOCAL` or `ID:/PATH`. A string starting with `/` or `.`, or without `:`, is
/// local; otherwise the part before the first `:` is a sandbox id.
pub fn parse_cp_side(s: &str) -> Result<CpSide, String> {
    if s.is_empty() {
        return Err("empty path".into());
    }
    if s.starts_with('/') || s.starts_with('.') {
        return Ok(CpSide::Local(PathBuf::from(s)));
    }
    match s.split_once(':') {
        Some((id, _)) if id.contains('/') => Ok(CpSide::Local(PathBuf::from(s))),
        Some((id, path)) => {
            if path.is_empty() {
                return Err(format!("{s:?}: missing path after {id}:"));
            }
            if !path.starts_with('/') {
                return Err(format!(
                    "{s:?}: the sandbox path must be absolute ({id}:/{path})"
                ));
            }
            Ok(CpSide::Remote {
                id: id.to_owned(),
                path: path.to_owned(),
            })
        }
        None => Ok(CpSide::Local(PathBuf::from(s))),
    }
}

/// Parses `KEY=VALUE` (the value may contain `=`; the key must be non-empty).
pub fn parse_key_value(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("{s:?}: expected KEY=VALUE")),
    }
}

/// Parses `LOCAL:/REMOTE` for `--file` (split at the first `:` followed by `/`).
pub fn parse_file_mapping(s: &str) -> Result<(PathBuf, String), String> {
    match s.find(":/") {
        Some(i) if i > 0 => Ok((PathBuf::from(&s[..i]), s[i + 1..].to_owned())),
        _ => Err(format!("{s:?}: expected LOCAL:/ABSOLUTE/REMOTE/PATH")),
    }
}

/// Parses a duration: plain seconds (`90`, `1.5`) or numbers with units `ms`, `s`, `m`,
/// `h`, `d`, possibly combined (`1h30m`).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let err = || format!("{s:?}: expected a duration like 90, 90s, 15m, 1h or 1h30m");
    let s = s.trim();
    if s.is_empty() {
        return Err(err());
    }
    let mut total = 0f64;
    let mut rest = s;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if num_len == 0 {
            return Err(err());
        }
        let value: f64 = rest[..num_len].parse().map_err(|_| err())?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let factor = match &rest[..unit_len] {
            "" if num_len == s.len() => 1.0,
            "ms" => 0.001,
            "s" | "sec" | "secs" => 1.0,
            "m" | "min" | "mins" => 60.0,
            "h" | "hr" | "hour" | "hours" => 3600.0,
            "d" | "day" | "days" => 86400.0,
            _ => return Err(err()),
        };
        rest = &rest[unit_len..];
        total += value * factor;
    }
    Duration::try_from_secs_f64(total).map_err(|_| err())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("dsec").chain(args.iter().copied()))
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("90"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("15m"), Ok(Duration::from_secs(900)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2d"), Ok(Duration::from_secs(172_800)));
        for bad in ["", "h", "1x", "1h 30m", "-5", "5 s", "1..2"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} should fail");
        }
    }

    #[test]
    fn key_values() {
        assert_eq!(parse_key_value("A=b"), Ok(("A".into(), "b".into())));
        assert_eq!(parse_key_value("A=b=c"), Ok(("A".into(), "b=c".into())));
        assert_eq!(parse_key_value("A="), Ok(("A".into(), String::new())));
        assert!(parse_key_value("A").is_err());
        assert!(parse_key_value("=b").is_err());
    }

    #[test]
    fn file_mappings() {
        assert_eq!(
            parse_file_mapping("./a.py:/work/a.py"),
            Ok(("./a.py".into(), "/work/a.py".into()))
        );
        assert_eq!(
            parse_file_mapping("/x/y:/z"),
            Ok(("/x/y".into(), "/z".into()))
        );
        assert!(parse_file_mapping("a.py").is_err());
        assert!(parse_file_mapping("a.py:rel").is_err());
        assert!(parse_file_mapping(":/z").is_err());
    }

    #[test]
    fn cp_sides() {
        let remote = |id: &str, path: &str| CpSide::Remote {
            id: id.into(),
            path: path.into(),
        };
        assert_eq!(
            parse_cp_side("sb-123:/work/out"),
            Ok(remote("sb-123", "/work/out"))
        );
        assert_eq!(parse_cp_side("./a:b"), Ok(CpSide::Local("./a:b".into())));
        assert_eq!(parse_cp_side("/tmp/x"), Ok(CpSide::Local("/tmp/x".into())));
        assert_eq!(
            parse_cp_side("file.txt"),
            Ok(CpSide::Local("file.txt".into()))
        );
        assert_eq!(
            parse_cp_side("dir/a:b"),
            Ok(CpSide::Local("dir/a:b".into()))
        );
        assert!(parse_cp_side("sb:").is_err());
        assert!(parse_cp_side("sb:rel/path").is_err());
    }

    #[test]
    fn create_parses() {
        let cli = parse(&[
            "sandbox",
            "create",
            "--image",
            "python:3.11",
            "--cpu",
            "0.5",
            "--memory-mb",
            "1024",
            "--timeout",
            "15m",
            "--env",
            "A=1",
            "-e",
            "B=2",
            "--label",
            "team=rl",
            "--file",
            "./x.py:/work/x.py",
            "--qos",
            "best-effort",
            "--layer",
            "ws",
            "--layer",
            "tools",
            "--disk-mb",
            "2048",
            "--json",
        ])
        .expect("parses");
        assert!(cli.json);
        let Command::Sandbox(SandboxCommand::Create(a)) = cli.command else {
            panic!("wrong command: {:?}", cli.command)
        };
        assert_eq!(a.image.as_deref(), Some("python:3.11"));
        assert_eq!(a.cpu, Some(0.5));
        assert_eq!(a.memory_mb, Some(1024));
        assert_eq!(a.timeout, Some(Duration::from_secs(900)));
        assert_eq!(a.env, [("A".into(), "1".into()), ("B".into(), "2".into())]);
        assert_eq!(a.labels, [("team".into(), "rl".into())]);
        assert_eq!(a.files, [("./x.py".into(), "/work/x.py".into())]);
        assert_eq!(a.qos, QosArg::BestEffort);
        assert_eq!(a.layers, ["ws", "tools"]);
        assert_eq!(a.disk_mb, Some(2048));
        assert!(parse(&["sandbox", "create", "--timeout", "soon"]).is_err());
        assert!(parse(&["sandbox", "create", "--qos", "fast"]).is_err());
        assert!(parse(&["sandbox", "create", "--env", "NOEQUALS"]).is_err());
    }

    #[test]
    fn exec_parses_command_after_dashes() {
        let cli = parse(&[
            "sandbox",
            "exec",
            "sb1",
            "--cwd",
            "/w",
            "--timeout",
            "30s",
            "--",
            "ls",
            "-l",
            "--all",
        ])
        .expect("parses");
        let Command::Sandbox(SandboxCommand::Exec(a)) = cli.command else {
            panic!("wrong command")
        };
        assert_eq!(a.id, "sb1");
        assert_eq!(a.cwd.as_deref(), Some("/w"));
        assert_eq!(a.timeout, Some(Duration::from_secs(30)));
        assert_eq!(a.cmd, ["ls", "-l", "--all"]);
        assert!(!a.stdin);
        assert!(parse(&["sandbox", "exec", "sb1"]).is_err());
    }

    #[test]
    fn cp_and_logs_and_timeout_parse() {
        let cli = parse(&["sb", "cp", "./local", "abc:/remote"]).expect("parses");
        let Command::Sandbox(SandboxCommand::Cp { src, dst }) = cli.command else {
            panic!("wrong command")
        };
        assert_eq!(src, CpSide::Local("./local".into()));
        assert_eq!(
            dst,
            CpSide::Remote {
                id: "abc".into(),
                path: "/remote".into()
            }
        );

        let cli = parse(&["sandbox", "logs", "abc", "42", "-f"]).expect("parses");
        assert!(matches!(
            cli.command,
            Command::Sandbox(SandboxCommand::Logs {
                pid: 42,
                follow: true,
                ..
            })
        ));
        let cli = parse(&["sandbox", "timeout", "abc", "2h"]).expect("parses");
        assert!(matches!(
            cli.command,
            Command::Sandbox(SandboxCommand::Timeout { duration, .. }) if duration == Duration::from_secs(7200)
        ));
        assert!(parse(&["sandbox", "logs", "abc", "notapid"]).is_err());
    }

    #[test]
    fn serve_defaults() {
        let cli = parse(&["serve"]).expect("parses");
        let Command::Serve(a) = cli.command else {
            panic!("wrong command")
        };
        assert_eq!(a.listen, "127.0.0.1:7070".parse().expect("addr"));
        assert_eq!(a.state_dir, PathBuf::from("/var/lib/dsec"));
        assert_eq!(a.run_dir, PathBuf::from("/run/dsec"));
        assert!(a.agent_bin.is_none() && a.node_name.is_none());
    }

    #[test]
    fn node_and_apiserver_parse() {
        let cli = parse(&[
            "node",
            "--listen",
            "127.0.0.1:7071",
            "--state-dir",
            "/tmp/n1",
        ])
        .expect("parses");
        let Command::Node(a) = cli.command else {
            panic!("wrong command")
        };
        assert_eq!(a.serve.listen, "127.0.0.1:7071".parse().expect("addr"));
        assert!(a.node_token_file.is_none());
        assert!(parse(&["apiserver"]).is_err(), "--node is required");
        let cli = parse(&[
            "apiserver",
            "--node",
            "http://127.0.0.1:7071",
            "--node-token-file",
            "/tmp/n1/node-token",
        ])
        .expect("parses");
        assert!(matches!(cli.command, Command::Apiserver(_)));
    }

    #[test]
    fn global_flags_anywhere() {
        let cli = parse(&[
            "image",
            "ls",
            "--json",
            "--url",
            "http://h:1",
            "--api-key",
            "k",
        ])
        .expect("parses");
        assert!(cli.json);
        assert_eq!(cli.url, "http://h:1");
        assert_eq!(cli.api_key.as_deref(), Some("k"));
    }

    #[test]
    fn clap_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}

/// A mouse button, as `dsec sandbox click --button` names it.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum ClickButton {
    /// The primary button.
    Left,
    /// The secondary button.
    Right,
    /// The wheel button.
    Middle,
}

impl From<ClickButton> for dsec_wire::v1::MouseButton {
    fn from(b: ClickButton) -> Self {
        match b {
            ClickButton::Left => Self::Left,
            ClickButton::Right => Self::Right,
            ClickButton::Middle => Self::Middle,
        }
    }
}

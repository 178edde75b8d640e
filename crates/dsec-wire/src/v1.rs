//! The public HTTP/JSON API, version 1 (`/v1/...`).
//!
//! Request bodies reject unknown fields so a typo is an error, not a silent default.
//! Times are unix milliseconds; durations name their unit in the field name.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use crate::agent::{
    Command, ExitInfo, FileInfo, FileKind, ProcessInfo, PtySize, SessionInfo, SessionResult,
};
use crate::error::ApiError;

mod audit;
mod batches;
mod calls;
mod events;
mod fncall;
mod models;
mod pools;
pub use audit::*;
pub use batches::*;
pub use calls::*;
pub use events::*;
pub use fncall::*;
pub use models::*;
pub use pools::*;

/// Header that carries the API key (`Authorization: Bearer KEY` is accepted too).
pub const API_KEY_HEADER: &str = "x-api-key";

/// Default sandbox lifetime when the caller gives none: one hour.
pub const DEFAULT_TIMEOUT_S: u64 = 3600;
/// Longest lifetime one call may ask for: 7 days.
pub const MAX_TIMEOUT_S: u64 = 7 * 24 * 3600;

/// Sandbox backend. Only `container` exists today.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// Linux namespaces + cgroups, run by the node directly.
    #[default]
    Container,
}

/// Network mode of a sandbox.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum NetworkMode {
    /// Own network namespace with only loopback.
    #[default]
    None,
    /// Egress only to the destinations of [`NetworkPolicy::allow`]; DNS answers only for
    /// allowed names. Everything else is rejected at once.
    Allowlist,
    /// Egress to anywhere but the node itself, other sandboxes and link-local addresses
    /// (cloud metadata).
    Open,
}

/// File rules for the commands a sandbox runs (Landlock). The files API is not bound by
/// them: the platform can always place and fetch files.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct FilesystemPolicy {
    /// When not empty, commands may create, change or delete files only beneath these
    /// absolute paths (which must exist at create) and write to devices in `/dev`;
    /// everything else is read-only to them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub writable: Vec<String>,
    /// When set, commands may bind TCP sockets only to these ports (Landlock ABI 4+).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_bind: Option<Vec<u16>>,
    /// When set, commands may connect TCP sockets only to these ports, on any address
    /// the network policy allows (loopback included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_connect: Option<Vec<u16>>,
}

/// A sandbox's network: its mode and, for `allowlist`, what it may reach.
///
/// On the wire either a bare mode (`"none"`) or `{"mode": "allowlist", "allow": [...]}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(from = "NetworkPolicyRepr")]
pub struct NetworkPolicy {
    /// Mode.
    pub mode: NetworkMode,
    /// Allowed destinations (mode `allowlist`), each parsed by [`AllowRule::parse`]:
    /// `pypi.org`, `*.pythonhosted.org:443`, `10.0.0.0/8`, `192.0.2.7:80`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<String>,
}

#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(untagged)]
enum NetworkPolicyRepr {
    Mode(NetworkMode),
    Full {
        mode: NetworkMode,
        #[serde(default)]
        allow: Vec<String>,
    },
}

impl From<NetworkPolicyRepr> for NetworkPolicy {
    fn from(r: NetworkPolicyRepr) -> Self {
        match r {
            NetworkPolicyRepr::Mode(mode) => Self {
                mode,
                allow: Vec::new(),
            },
            NetworkPolicyRepr::Full { mode, allow } => Self { mode, allow },
        }
    }
}

/// What an allow rule names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllowTarget {
    /// This DNS name exactly (lower case, no trailing dot).
    Name(String),
    /// Any name strictly below this suffix (`*.example.com`: `a.example.com`, not
    /// `example.com`).
    Suffix(String),
    /// An IPv4 network: address and prefix length.
    Cidr(std::net::Ipv4Addr, u8),
}

/// One parsed entry of [`NetworkPolicy::allow`]: a target and an optional port (TCP
/// and UDP). No port means every port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowRule {
    /// What may be reached.
    pub target: AllowTarget,
    /// The one port allowed, or all when `None`.
    pub port: Option<u16>,
}

impl AllowRule {
    /// Parses `name`, `*.suffix`, `a.b.c.d`, `a.b.c.d/len`, each optionally followed by
    /// `:port`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let (host, port) = match s.rsplit_once(':') {
            Some((h, p)) => {
                let port: u16 = p
                    .parse()
                    .ok()
                    .filter(|p| *p != 0)
                    .ok_or_else(|| format!("{s:?}: port must be 1-65535"))?;
                (h, Some(port))
            }
            None => (s, None),
        };
        let target = if let Some((ip, len)) = host.split_once('/') {
            let ip: std::net::Ipv4Addr = ip
                .parse()
                .map_err(|_| format!("{s:?}: not an IPv4 network"))?;
            let len: u8 = len
                .parse()
                .ok()
                .filter(|l| *l <= 32)
                .ok_or_else(|| format!("{s:?}: prefix length must be 0-32"))?;
            let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
            AllowTarget::Cidr(std::net::Ipv4Addr::from(u32::from(ip) & mask), len)
        } else if let Ok(ip) = host.parse::<std::net::Ipv4Addr>() {
            AllowTarget::Cidr(ip, 32)
        } else if let Some(suffix) = host.strip_prefix("*.") {
            AllowTarget::Suffix(dns_name(suffix).ok_or_else(|| bad_name(s))?)
        } else {
            AllowTarget::Name(dns_name(host).ok_or_else(|| bad_name(s))?)
        };
        Ok(Self { target, port })
    }

    /// Whether a DNS name (any case, trailing dot or not) is covered by this rule.
    pub fn matches_name(&self, name: &str) -> bool {
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        match &self.target {
            AllowTarget::Name(n) => *n == name,
            AllowTarget::Suffix(sfx) => name
                .strip_suffix(sfx.as_str())
                .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
            AllowTarget::Cidr(..) => false,
        }
    }
}

fn bad_name(s: &str) -> String {
    format!("{s:?}: expected a DNS name, *.suffix, IPv4 address or CIDR, with an optional :port")
}

/// A DNS name in canonical form (lower case, no trailing dot), or `None` if it is not
/// one: labels of 1-63 letters, digits, `-` and `_`, at most 253 characters.
fn dns_name(s: &str) -> Option<String> {
    let s = s.trim_end_matches('.').to_ascii_lowercase();
    let ok = !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        });
    ok.then_some(s)
}

/// The isolation boundary of a sandbox.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Isolation {
    /// dsec's own container: namespaces, cgroups, seccomp, user namespace.
    #[default]
    Container,
    /// The node's installed OCI runtime (runc, runsc, ...) runs the sandbox, with the same
    /// agent inside.
    Oci,
    /// gVisor (`runsc`): the sandbox's system calls are served by gVisor's own kernel in
    /// user space, not the host's; the same agent inside. Network mode `none` only, no
    /// file or TCP rules, no user namespace.
    Gvisor,
    /// A QEMU `microvm`: the sandbox has a guest kernel of its own, its layers attached
    /// read-only as virtio disks, a writable disk, and the same agent as the guest's init.
    /// Networks through a tap under the same rules; no file or TCP rules, no model access.
    Microvm,
    /// A full machine (QEMU `q35`, a VGA screen and a keyboard) that boots the image's
    /// own init (systemd): the image's layers and a writable disk as its root, the agent
    /// a service of that system, root in the guest. Network mode `none` only for now.
    Vm,
}

impl Isolation {
    /// Whether the sandbox is a virtual machine (its own kernel, run by QEMU).
    pub fn is_machine(self) -> bool {
        matches!(self, Isolation::Microvm | Isolation::Vm)
    }
}

/// An isolation level a node offers, as `GET /v1/health` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct IsolationLevel {
    /// The level.
    pub isolation: Isolation,
    /// The runtime binary that runs it (`oci`, `gvisor`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<String>,
    /// How it intercepts system calls (`gvisor`: `systrap`, `ptrace` or `kvm`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<String>,
}

/// How a sandbox's processes compete for CPU.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Qos {
    /// Normal scheduling with a doubled CPU weight: an agent waiting on this sandbox gets
    /// its answer first.
    #[default]
    LatencySensitive,
    /// Every process runs `SCHED_IDLE` with the lowest CPU weight: it uses only CPU that
    /// nothing else wants (rollouts in bulk, builds).
    BestEffort,
}

/// Resource limits. Absent fields take the node's defaults.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct Resources {
    /// CPU limit in cores (e.g. 0.5, 2). Default 1.
    #[serde(default)]
    pub cpu: Option<f64>,
    /// Memory limit in MiB. Default 512.
    #[serde(default)]
    pub memory_mb: Option<u64>,
    /// Maximum number of processes/threads. Default 512.
    #[serde(default)]
    pub pids: Option<u64>,
    /// Size of the writable layer (everything the sandbox writes) in MiB. Writes past it
    /// fail with `ENOSPC` inside and `no_space` through the API. Default: the node's
    /// (10240 with `dsec serve`'s defaults).
    #[serde(default)]
    pub disk_mb: Option<u64>,
}

/// Encoding of an inline file's `content`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum ContentEncoding {
    /// UTF-8 text.
    #[default]
    Utf8,
    /// Base64 of arbitrary bytes.
    Base64,
}

/// A file to place in the sandbox before it is reported ready.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct InitFile {
    /// Absolute path inside the sandbox; parents are created.
    pub path: String,
    /// File content.
    pub content: String,
    /// How `content` is encoded.
    #[serde(default)]
    pub encoding: ContentEncoding,
    /// Permission bits; default 0o644.
    #[serde(default)]
    pub mode: Option<u32>,
}

/// `POST /v1/sandboxes`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateSandboxRequest {
    /// Image name (`base`, `debian:bookworm`, ...) or `sha256:` digest. Default `base`.
    /// A name that starts with a registry host (see [`registry_image_name`]) and is not
    /// in the catalog is pulled from that registry first.
    #[serde(default)]
    pub image: Option<String>,
    /// More images stacked on top of `image`, bottom first (a workspace, toolkits): the
    /// sandbox's root is all their layers composed with overlayfs, files of later images
    /// winning. Their configs' env and workdir apply in the same order.
    #[serde(default)]
    pub layers: Vec<String>,
    /// Backend; default `container`.
    #[serde(default)]
    pub backend: Backend,
    /// Resource limits.
    #[serde(default)]
    pub resources: Resources,
    /// Lifetime in seconds from creation; default [`DEFAULT_TIMEOUT_S`].
    #[serde(default)]
    pub timeout_s: Option<u64>,
    /// Delete the sandbox after this many seconds without API activity.
    #[serde(default)]
    pub idle_timeout_s: Option<u64>,
    /// Environment variables for every command in the sandbox.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Free-form labels, filterable in list.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Files to place before the sandbox is ready.
    #[serde(default)]
    pub files: Vec<InitFile>,
    /// Network; default `none` (loopback only).
    #[serde(default)]
    pub network: NetworkPolicy,
    /// File rules for the commands it runs; default none.
    #[serde(default)]
    pub filesystem: FilesystemPolicy,
    /// Isolation level; default `container`.
    #[serde(default)]
    pub isolation: Isolation,
    /// Default working directory for commands; default `/`.
    #[serde(default)]
    pub workdir: Option<String>,
    /// When paused, resume on the next call that needs the sandbox running, instead of
    /// answering `paused`.
    #[serde(default)]
    pub auto_resume: bool,
    /// CPU class; default `latency_sensitive`.
    #[serde(default)]
    pub qos: Qos,
    /// Makes retries safe: a create with the key of a live sandbox answers that sandbox
    /// (once it is past `creating`) instead of making another. Up to 128 characters.
    #[serde(default)]
    pub idempotency_key: Option<String>,
    /// User commands run as unless they name one (a name from the image's `/etc/passwd`,
    /// or `UID[:GID]`); default: the image's configured user, else root.
    #[serde(default)]
    pub user: Option<String>,
    /// The environment as one object (base image, layers, env, workdir, user): the same
    /// as the top-level `image`, `layers`, `env`, `workdir` and `user`, which must then be
    /// left unset.
    #[serde(default)]
    pub environment: Option<Environment>,
    /// Claim a warm sandbox of this pool of the caller's tenant (see [`PoolSpec`])
    /// instead of making one: the environment is the pool's, so `image`, `layers`,
    /// `environment`, `resources`, `network`, `filesystem`, `isolation`, `env`, `workdir`,
    /// `user`, `files` and `qos` must be left unset. `labels`, `timeout_s`,
    /// `idle_timeout_s` and `auto_resume` apply to the claimed sandbox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// How long this create may wait for capacity (a warm sandbox of its pool) and at
    /// which priority.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<QueueOptions>,
    /// Models the sandbox may call through the model gateway (see [`ModelAccess`]): a
    /// token of its own and the gateway's URL in its environment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_access: Option<ModelAccess>,
    /// Whether the answer carries the create's phases ([`Sandbox::timings`]); the
    /// sandbox's record keeps them either way.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub timings: bool,
}

/// One phase of a create, on the create's own clock.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct PhaseTiming {
    /// The phase: on the server `validate`, `placement`, `images`, `store`,
    /// `node_call` (the node round trip beyond the node's own phases), `files`,
    /// `commit`; on the node `admit`, `layers`, `disk`, `namespaces`, `rootfs`,
    /// `network`, `cgroup`, `init`, `agent` (a microVM: `cgroup`, `disk`, `vmm`, `boot`,
    /// `agent`).
    pub phase: String,
    /// Milliseconds from the create's start to this phase's.
    pub start_ms: f64,
    /// Its length in milliseconds.
    pub ms: f64,
}

/// Where a create's time went: its phases in order, back to back.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct CreateTimings {
    /// From the server taking the request to the sandbox being ready, ms.
    pub total_ms: f64,
    /// The phases, in order; their lengths add up to `total_ms`.
    pub phases: Vec<PhaseTiming>,
}

/// Upper bounds (seconds) of the buckets of create phase histograms; a last one,
/// `+Inf`, takes the rest.
pub const CREATE_PHASE_BUCKETS_S: [f64; 15] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Creates' phases since the server started: one histogram per phase, and `total`
/// (`GET /metrics` as `dsec_create_phase_seconds` and `dsec_create_seconds`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct CreatePhaseStats {
    /// Whole creates.
    pub total: PhaseHistogram,
    /// Per phase, by name.
    pub phases: Vec<PhaseHistogram>,
}

/// One histogram of [`CreatePhaseStats`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct PhaseHistogram {
    /// The phase (`total` for whole creates).
    pub phase: String,
    /// Samples per bucket of [`CREATE_PHASE_BUCKETS_S`], not cumulative, then those above
    /// every bound.
    pub counts: Vec<u64>,
    /// Sum of the samples, seconds.
    pub sum_s: f64,
    /// Samples.
    pub count: u64,
}

/// Priority of a create or call that waits for capacity.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    /// Served before every other level.
    High,
    /// The default.
    #[default]
    Medium,
    /// Served only from spare capacity.
    Low,
}

/// `GET /v1/queue`: creates waiting for capacity, by priority level.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct QueueStatus {
    /// High, medium, low.
    pub levels: Vec<QueueLevel>,
}

/// One priority level of the capacity queue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct QueueLevel {
    /// The level.
    pub priority: Priority,
    /// Creates waiting at this level (all tenants').
    pub waiting: u32,
    /// The longest wait at this level now, ms.
    pub oldest_wait_ms: u64,
    /// Creates served after waiting, since the server started.
    pub served: u64,
    /// Waiters by tenant (only the caller's, unless the key is an admin's).
    pub tenants: Vec<QueueTenant>,
}

/// A tenant's waiters at one level.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct QueueTenant {
    /// The tenant.
    pub tenant: String,
    /// Its creates waiting.
    pub waiting: u32,
    /// Its longest wait now, ms.
    pub oldest_wait_ms: u64,
}

/// Waiting for capacity.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct QueueOptions {
    /// The priority level.
    #[serde(default)]
    pub priority: Priority,
    /// The longest wait, seconds, after which the create fails with `capacity`.
    /// Default: 30 for a pool claim.
    #[serde(default)]
    pub max_wait_s: Option<f64>,
}

/// A sandbox's environment: an OS base plus workspace and toolkit layers, and defaults.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct Environment {
    /// Base image name or digest.
    pub base: String,
    /// Images stacked on the base, bottom first.
    #[serde(default)]
    pub layers: Vec<String>,
    /// Environment variables of commands.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Default working directory.
    #[serde(default)]
    pub workdir: Option<String>,
    /// Default user.
    #[serde(default)]
    pub user: Option<String>,
}

/// `POST /v1/sandboxes/{id}/pause`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct PauseResult {
    /// The sandbox, now `paused`.
    pub sandbox: Sandbox,
    /// Its memory use (bytes) when frozen, before reclaim.
    pub memory_before_bytes: u64,
    /// Its memory use after the kernel took back what it could.
    pub memory_after_bytes: u64,
}

/// Lifecycle state of a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    /// Being set up.
    Creating,
    /// The agent answers; commands may run.
    Ready,
    /// Frozen: its processes do not run and its memory was given back where the kernel
    /// could; `resume` continues it where it stopped.
    Paused,
    /// Being torn down.
    Stopping,
    /// Creation failed or the sandbox died; `failure` says why.
    Failed,
    /// Running, but its agent stopped answering (stopped, hung or starved);
    /// `unhealthy_cause` says what the node saw. Calls answer `agent_unavailable` at
    /// once instead of hanging; the sandbox goes back to `ready` when the agent answers
    /// again. Delete works as usual.
    Unhealthy,
    /// Its node stopped heartbeating (died, restarted, cut off): calls answer `lost`.
    /// It goes back to its state before when the node returns still running it; delete
    /// removes the record (and the node destroys the sandbox if it comes back).
    Lost,
}

/// Effective resource limits of a sandbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct EffectiveResources {
    /// CPU limit in cores.
    pub cpu: f64,
    /// Memory limit in MiB.
    pub memory_mb: u64,
    /// Process limit.
    pub pids: u64,
    /// Size of the writable layer in MiB; absent when the node does not limit disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_mb: Option<u64>,
}

fn default_tenant() -> String {
    "default".into()
}

/// A sandbox as the API reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Sandbox {
    /// Sandbox id (also its hostname).
    pub id: String,
    /// The tenant that owns it (the key that created it); records written before tenants
    /// existed belong to `default`.
    #[serde(default = "default_tenant")]
    pub tenant: String,
    /// Lifecycle state.
    pub state: SandboxState,
    /// Image name as requested.
    pub image: String,
    /// The create's idempotency key, if it had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// CPU class.
    #[serde(default)]
    pub qos: Qos,
    /// Resume on use when paused (see [`CreateSandboxRequest::auto_resume`]).
    #[serde(default)]
    pub auto_resume: bool,
    /// Images stacked on top of it, as requested.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<String>,
    /// Digest of the image, or of the whole layer stack when `layers` is not empty.
    pub image_digest: String,
    /// Backend.
    pub backend: Backend,
    /// Effective limits.
    pub resources: EffectiveResources,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Creation time (unix ms).
    pub created_at: u64,
    /// When the sandbox will be deleted (unix ms).
    pub expires_at: u64,
    /// Idle timeout in seconds, if any.
    pub idle_timeout_s: Option<u64>,
    /// Last API activity (unix ms).
    pub last_active_at: u64,
    /// Why the sandbox failed, for `failed`.
    pub failure: Option<String>,
    /// What the node saw of its agent, for `unhealthy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unhealthy_cause: Option<String>,
    /// Since when it is `unhealthy` (unix ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unhealthy_since: Option<u64>,
    /// Since when it is `lost` (unix ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lost_since: Option<u64>,
    /// The state it had when it became `lost`, and goes back to when its node returns
    /// still running it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lost_from: Option<SandboxState>,
    /// Since when its writable disk is full (unix ms): writes in it fail with `ENOSPC`.
    /// Cleared once space is freed. Seen by the node's listing (each reaper pass).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_full_since: Option<u64>,
    /// Node that runs it.
    pub node: String,
    /// Set while its job is suspended (`POST /v1/jobs/{job}/suspend`): unix ms of the
    /// suspend. Its lifetime is stopped meanwhile and resumes with the job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_suspended_at: Option<u64>,
    /// Layers its commits added so far, bottom first: the next commit stores only what
    /// changed since the last one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub committed_layers: Vec<String>,
    /// Its network policy (replace it with `PUT /v1/sandboxes/{id}/network`).
    #[serde(default)]
    pub network: NetworkPolicy,
    /// Its IPv4 address, when its mode is not `none`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip: Option<String>,
    /// Its file rules.
    #[serde(default)]
    pub filesystem: FilesystemPolicy,
    /// Its isolation level.
    #[serde(default)]
    pub isolation: Isolation,
    /// What it may call through the model gateway, when created with `model_access`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_access: Option<ModelAccess>,
    /// The public id of its model gateway token (the token itself is only in its
    /// environment, `OPENAI_API_KEY`); the token is deleted with the sandbox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_token_id: Option<String>,
    /// Where its create's time went (a sandbox made by this version's create; a fork's
    /// or a pool member's made by theirs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timings: Option<CreateTimings>,
}

/// One step of an image build.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum BuildStep {
    /// A shell command that must exit 0.
    Run(String),
    /// A file to place (UTF-8 content).
    File {
        /// Absolute path in the image.
        path: String,
        /// Its content.
        content: String,
    },
    /// Files and directories to place: a tar archive (base64) unpacked into `dest`
    /// (created with its parents). `dsec image build --copy SRC:DEST` makes it from
    /// local files.
    Copy {
        /// Absolute directory in the image.
        dest: String,
        /// The tar archive, base64.
        tar: String,
    },
}

/// `POST /v1/images/build`: an image from a base and steps, one layer per step, each
/// cached by (parent image, step).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct BuildRequest {
    /// Name of the result.
    pub name: String,
    /// Image to start from.
    pub base: String,
    /// Steps, in order.
    pub steps: Vec<BuildStep>,
    /// Per-step time limit in seconds; default 1800.
    #[serde(default)]
    pub step_timeout_s: Option<f64>,
}

/// `POST /v1/images/gc`: drops build-cache layers, trims the node's layer cache to its
/// limit and, if asked, deletes layers no image uses from the shared store.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct GcRequest {
    /// Keep build-cache entries younger than this many seconds (default 0: drop all).
    #[serde(default)]
    pub older_than_s: u64,
    /// Also delete from the shared blob store the layers no image there uses.
    #[serde(default)]
    pub shared_store: bool,
    /// ... of those, only the ones written more than this many seconds ago (default 3600;
    /// an import on another node uploads its layers before naming them).
    #[serde(default)]
    pub shared_grace_s: Option<u64>,
}

/// `GET /v1/images/layers`: how this node holds each layer it uses.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct LayerStatsList {
    /// Layers served on demand (with `--lazy-layers`), by digest.
    pub lazy: Vec<LazyLayerStats>,
    /// The node's totals over them.
    #[serde(default)]
    pub node: LazyNodeStats,
}

/// A node's on-demand loading in total.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct LazyNodeStats {
    /// Bytes fetched from the blob store (each written once to the chunk cache).
    pub fetched_bytes: u64,
    /// Bytes served from the chunk cache.
    pub cached_bytes: u64,
    /// Chunks fetched ahead of reads from prefetch lists.
    pub prefetched_chunks: u64,
    /// Reads answered with EIO.
    pub faults: u64,
    /// Bytes the chunk cache holds on the node's disk now.
    pub chunk_cache_bytes: u64,
}

/// Accounting of one layer served on demand.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct LazyLayerStats {
    /// `sha256:<hex>`.
    pub digest: String,
    /// Bytes fetched from the blob store (and written to the chunk cache).
    pub fetched_bytes: u64,
    /// Chunks fetched.
    pub fetched_chunks: u64,
    /// Bytes served from the chunk cache.
    pub cached_bytes: u64,
    /// Reads answered with EIO (store down, timeout, corrupt chunk).
    pub faults: u64,
    /// Mean fetch latency of a chunk, microseconds.
    pub mean_fetch_us: u64,
    /// Sum of all chunk fetch latencies, microseconds.
    #[serde(default)]
    pub fetch_us_total: u64,
    /// Fetch latency histogram: (upper bound in ms, fetches at most that slow but slower
    /// than the previous bound); the last bound is `u64::MAX`.
    #[serde(default)]
    pub fetch_latency_ms: Vec<(u64, u64)>,
    /// Chunks fetched ahead of reads from the layer's prefetch list.
    #[serde(default)]
    pub prefetched_chunks: u64,
    /// The last fault, if any: when (unix ms) and what.
    #[serde(default)]
    pub last_fault: Option<LayerFault>,
}

/// A fault of an on-demand layer: a read answered with EIO.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct LayerFault {
    /// Unix milliseconds.
    pub at_ms: u64,
    /// What went wrong (store error, timeout, digest mismatch).
    pub message: String,
}

/// What a GC removed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct GcResult {
    /// Build-cache refs removed.
    pub removed: Vec<String>,
    /// Bytes of their layers deleted (layers other images or sandboxes use stay).
    pub freed_bytes: u64,
    /// Layers evicted from the node's cache (the shared store still holds them).
    #[serde(default)]
    pub evicted: Vec<String>,
    /// Bytes those took.
    #[serde(default)]
    pub evicted_bytes: u64,
    /// Layers deleted from the shared store.
    #[serde(default)]
    pub shared_deleted: Vec<String>,
    /// Bytes those took.
    #[serde(default)]
    pub shared_freed_bytes: u64,
}

/// What a build did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct BuildResult {
    /// The built image.
    pub image: Image,
    /// Per step: whether its layer came from the cache.
    pub cached: Vec<bool>,
}

/// `POST /v1/images/build/dockerfile`: an image from a Dockerfile. The body is the build
/// context as a tar archive (it holds the Dockerfile); the request travels in the query
/// string ([`DockerfileBuildRequest::to_query`]). The answer is NDJSON [`BuildEvent`]s.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct DockerfileBuildRequest {
    /// Name of the result.
    pub name: String,
    /// Path of the Dockerfile inside the context; default `Dockerfile`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dockerfile: Option<String>,
    /// Stage to build (`--target`); default the last one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// `--build-arg NAME=VALUE`s.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub build_args: BTreeMap<String, String>,
    /// Network of `RUN` steps; default `none`. `open` lets them reach the internet
    /// (package installs), never the node or other sandboxes.
    #[serde(default)]
    pub network: NetworkMode,
    /// Run every step again instead of taking layers from the build cache.
    #[serde(default)]
    pub no_cache: bool,
    /// Time limit of one `RUN` in seconds; default 1800.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_timeout_s: Option<f64>,
}

impl DockerfileBuildRequest {
    /// The query-string pairs of this request (`build_arg=NAME=VALUE` once per arg).
    pub fn to_query(&self) -> Vec<(String, String)> {
        let mut q = vec![("name".to_string(), self.name.clone())];
        let mut opt = |k: &str, v: &Option<String>| {
            if let Some(v) = v {
                q.push((k.to_string(), v.clone()));
            }
        };
        opt("dockerfile", &self.dockerfile);
        opt("target", &self.target);
        opt(
            "step_timeout_s",
            &self.step_timeout_s.map(|t| t.to_string()),
        );
        if self.network != NetworkMode::None {
            let mode = serde_json::to_value(self.network)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string));
            opt("network", &mode);
        }
        if self.no_cache {
            q.push(("no_cache".to_string(), "true".to_string()));
        }
        for (k, v) in &self.build_args {
            q.push(("build_arg".to_string(), format!("{k}={v}")));
        }
        q
    }

    /// The request from query-string pairs ([`DockerfileBuildRequest::to_query`]); the
    /// error says which pair is wrong.
    pub fn from_query(pairs: Vec<(String, String)>) -> Result<Self, String> {
        let mut r = DockerfileBuildRequest::default();
        let mut named = false;
        for (k, v) in pairs {
            match k.as_str() {
                "name" => {
                    r.name = v;
                    named = true;
                }
                "dockerfile" => r.dockerfile = Some(v),
                "target" => r.target = Some(v),
                "step_timeout_s" => {
                    let t: f64 = v
                        .parse()
                        .map_err(|_| format!("step_timeout_s: not a number: {v:?}"))?;
                    r.step_timeout_s = Some(t);
                }
                "network" => {
                    r.network = serde_json::from_value(serde_json::Value::String(v.clone()))
                        .map_err(|_| format!("network: {v:?} is not none, allowlist or open"))?;
                }
                "no_cache" => {
                    r.no_cache = match v.as_str() {
                        "true" | "1" | "" => true,
                        "false" | "0" => false,
                        _ => return Err(format!("no_cache: {v:?} is not true or false")),
                    }
                }
                "build_arg" => {
                    let (name, value) = v
                        .split_once('=')
                        .ok_or_else(|| format!("build_arg: {v:?} is not NAME=VALUE"))?;
                    if name.is_empty() {
                        return Err(format!("build_arg: {v:?} has no name"));
                    }
                    r.build_args.insert(name.to_string(), value.to_string());
                }
                other => return Err(format!("unknown query parameter {other:?}")),
            }
        }
        if !named {
            return Err("name: missing".to_string());
        }
        Ok(r)
    }
}

/// One line of a Dockerfile build's NDJSON answer. The last line is `done` or `error`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum BuildEvent {
    /// Something to tell the user (an ignored instruction, an unused build arg).
    Warning {
        /// The message (naming its Dockerfile line).
        message: String,
    },
    /// A step begins (or was found in the cache).
    Step {
        /// 1-based number of the step among all steps of the build.
        step: usize,
        /// Steps in the build.
        steps: usize,
        /// Stage it belongs to (its name, else its index).
        stage: String,
        /// Dockerfile line of its instruction.
        line: usize,
        /// The instruction as written.
        text: String,
        /// Its layer came from the build cache.
        cached: bool,
    },
    /// Output of the running `RUN`.
    Output {
        /// `stdout` or `stderr`.
        stream: String,
        /// Text (UTF-8; invalid sequences replaced).
        data: String,
    },
    /// The build finished; the last line.
    Done {
        /// The built image.
        image: Image,
        /// Steps in the build.
        steps: usize,
        /// Of those, how many came from the cache.
        cached: usize,
    },
    /// The build failed and named nothing; the last line.
    Error {
        /// Why (a step's failure names its Dockerfile line and output tail).
        error: ApiError,
    },
}

/// `POST /v1/sandboxes/{id}/commit`: the sandbox's files as a new image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct CommitRequest {
    /// Name of the new image (its layers: the sandbox's, then one per commit).
    pub name: String,
}

/// `POST /v1/sandboxes/{id}/fork`: `count` new sandboxes whose files equal the source's
/// at the moment of the call. The source's changes are captured once, as a layer all
/// forks share read-only (the source is frozen meanwhile and then runs on); its env,
/// workdir, user, resources, network and file policy, isolation and QoS carry over
/// unless overridden here. Processes do not carry over: a container fork starts with
/// none (no checkpoint/restore here).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    /// How many, 1 to [`MAX_FORKS`] (and within the tenant's quota).
    pub count: u32,
    /// Labels of the forks; default: the source's (without the server's own).
    #[serde(default)]
    pub labels: Option<BTreeMap<String, String>>,
    /// Environment variables added to (or replacing) the source's.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory; default: the source's.
    #[serde(default)]
    pub workdir: Option<String>,
    /// Default user of commands; default: the source's.
    #[serde(default)]
    pub user: Option<String>,
    /// Lifetime of each fork in seconds; default [`DEFAULT_TIMEOUT_S`].
    #[serde(default)]
    pub timeout_s: Option<u64>,
    /// Resource limits; unset fields take the source's.
    #[serde(default)]
    pub resources: Resources,
}

/// Most forks one call makes.
pub const MAX_FORKS: u32 = 256;

/// Label the server sets on a fork: the id of the sandbox it was forked from.
pub const FORK_OF_LABEL: &str = "dsec-fork-of";

/// Answer to [`ForkRequest`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ForkResult {
    /// The forks, ready.
    pub sandboxes: Vec<Sandbox>,
    /// The image the forks were made from: the source's layers and the captured one.
    pub image: String,
    /// The captured layer (the source's changes since its create or last commit);
    /// `None` when nothing had changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub captured_layer: Option<String>,
}

/// Label that names a sandbox's job.
pub const JOB_LABEL: &str = "job";

/// What happened to one sandbox in a job suspend or resume.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct JobSandboxOutcome {
    /// Sandbox id.
    pub id: String,
    /// Its state afterwards.
    pub state: SandboxState,
    /// Why it could not be suspended or resumed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ApiError>,
    /// Memory use before and after reclaim (suspend only).
    #[serde(default)]
    pub memory_before_bytes: u64,
    /// See `memory_before_bytes`.
    #[serde(default)]
    pub memory_after_bytes: u64,
}

/// `POST /v1/jobs/{job}/suspend` and `.../resume`: one outcome per sandbox labelled
/// `job=<job>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct JobResult {
    /// The job.
    pub job: String,
    /// Per sandbox, ordered by id.
    pub sandboxes: Vec<JobSandboxOutcome>,
}

/// `GET /v1/sandboxes`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct SandboxList {
    /// Sandboxes, oldest first.
    pub sandboxes: Vec<Sandbox>,
}

/// `POST /v1/sandboxes/{id}/timeout`: the sandbox now expires `timeout_s` from now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct SetTimeoutRequest {
    /// New remaining lifetime in seconds.
    pub timeout_s: u64,
}

/// `POST /v1/sandboxes/{id}/exec` (and `/exec/stream`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    /// Argv array or shell string.
    pub cmd: Command,
    /// Extra environment variables.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Text fed to stdin (then closed).
    #[serde(default)]
    pub stdin: Option<String>,
    /// Kill the process tree after this many seconds.
    #[serde(default)]
    pub timeout_s: Option<f64>,
    /// Cap on recorded output per stream, bytes.
    #[serde(default)]
    pub output_limit: Option<u64>,
    /// User to run as: a name from the sandbox's `/etc/passwd`, or `UID[:GID]`; default:
    /// the sandbox's user.
    #[serde(default)]
    pub user: Option<String>,
    /// Makes the call safe to retry (see [`CallRecord`]): a retry with the same id gets
    /// the first call's outcome, or attaches to it while it runs, and never runs the
    /// command again. The `Idempotency-Key` header says the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
}

/// Result of a non-streaming exec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ExecResult {
    /// Stdout (lossy UTF-8; the last `output_limit` bytes if truncated).
    pub stdout: String,
    /// Stderr.
    pub stderr: String,
    /// How the process ended.
    #[serde(flatten)]
    pub exit: ExitInfo,
    /// True if the sandbox's memory limit killed the process.
    pub oom_killed: bool,
}

/// One line of an NDJSON exec or process-output stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ExecEvent {
    /// The process started.
    Started {
        /// Pid inside the sandbox.
        pid: u32,
    },
    /// Stdout chunk (UTF-8; invalid sequences replaced).
    Stdout {
        /// Text.
        data: String,
    },
    /// Stderr chunk.
    Stderr {
        /// Text.
        data: String,
    },
    /// The process ended; last event.
    Exit {
        /// Exit details.
        #[serde(flatten)]
        exit: ExitInfo,
        /// True if the memory limit killed it.
        oom_killed: bool,
    },
    /// Output position at the end of a non-following read of a running process.
    End {
        /// Next stdout offset.
        stdout_offset: u64,
        /// Next stderr offset.
        stderr_offset: u64,
    },
    /// The stream failed.
    Error {
        /// Why.
        error: ApiError,
    },
}

/// `POST /v1/sandboxes/{id}/sessions`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateSessionRequest {
    /// Session id; generated if absent.
    #[serde(default)]
    pub session: Option<String>,
    /// Environment for the shell.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Initial working directory.
    #[serde(default)]
    pub cwd: Option<String>,
    /// User to run as: a name from the sandbox's `/etc/passwd`, or `UID[:GID]`; default:
    /// the sandbox's user.
    #[serde(default)]
    pub user: Option<String>,
}

/// `POST /v1/sandboxes/{id}/sessions/{session}/run`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct SessionRunRequest {
    /// Command line for the session's bash.
    pub command: String,
    /// Interrupt after this many seconds; the session stays usable.
    #[serde(default)]
    pub timeout_s: Option<f64>,
    /// Makes the call safe to retry, as an exec's (see [`CallRecord`]); the
    /// `Idempotency-Key` header says the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
}

/// `GET /v1/sandboxes/{id}/sessions`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct SessionList {
    /// Open sessions.
    pub sessions: Vec<SessionInfo>,
}

/// `POST /v1/sandboxes/{id}/processes`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct StartProcessRequest {
    /// Argv array or shell string.
    pub cmd: Command,
    /// Extra environment variables.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Run under a PTY of this size.
    #[serde(default)]
    pub pty: Option<PtySize>,
    /// Caller's label.
    #[serde(default)]
    pub tag: Option<String>,
    /// Kill after this many seconds.
    #[serde(default)]
    pub timeout_s: Option<f64>,
    /// User to run as: a name from the sandbox's `/etc/passwd`, or `UID[:GID]`; default:
    /// the sandbox's user.
    #[serde(default)]
    pub user: Option<String>,
    /// Makes the start safe to retry: one process per request id (see [`CallRecord`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
}

/// `GET /v1/sandboxes/{id}/processes`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ProcessList {
    /// Processes.
    pub processes: Vec<ProcessInfo>,
}

/// `POST /v1/sandboxes/{id}/processes/{pid}/signal`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct SignalRequest {
    /// Signal name (`SIGINT`, `TERM`) or number.
    pub signal: String,
}

/// `POST /v1/sandboxes/{id}/processes/{pid}/stdin`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct StdinRequest {
    /// Text to write.
    #[serde(default)]
    pub data: String,
    /// Close stdin afterwards.
    #[serde(default)]
    pub close: bool,
}

/// `POST /v1/sandboxes/{id}/input`: keyboard and pointer input to a full VM (isolation
/// `vm`), sent in order, as a person at its keyboard and mouse would.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct InputRequest {
    /// The events, in order.
    pub events: Vec<InputEvent>,
}

/// One input event for a full VM's keyboard or pointer (a tablet: absolute positions).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum InputEvent {
    /// Types text key by key on a US keyboard layout (shift for capitals and symbols;
    /// `\n` is Enter, `\t` Tab). Printable ASCII only.
    Text {
        /// What to type.
        text: String,
    },
    /// Presses keys together and releases them in reverse order: one key (`"ret"`) or a
    /// chord (`["ctrl", "alt", "f2"]`). Names are QEMU's key codes: letters, digits,
    /// `f1`..`f12`, `ret`, `esc`, `tab`, `spc`, `backspace`, `delete`, `up`, `down`,
    /// `left`, `right`, `home`, `end`, `pgup`, `pgdn`, `ctrl`, `alt`, `shift`, `meta_l`
    /// and the rest of QEMU's list; `enter`, `escape`, `space`, `control` and `super`
    /// are accepted too.
    Keys {
        /// The keys, pressed in this order.
        keys: Vec<String>,
    },
    /// Moves the pointer to pixel (`x`, `y`) of the screen: a screenshot's coordinates,
    /// origin top left.
    Move {
        /// Column, from 0.
        x: u32,
        /// Row, from 0.
        y: u32,
    },
    /// Clicks a mouse button (`count` 2 is a double click), at (`x`, `y`) when given:
    /// the pointer moves there first.
    Click {
        /// The button; left when absent.
        #[serde(default)]
        button: MouseButton,
        /// Column to click at.
        x: Option<u32>,
        /// Row to click at.
        y: Option<u32>,
        /// Clicks in a row, 1 to 3; 1 when absent.
        count: Option<u8>,
    },
    /// Presses (`down: true`) or releases a mouse button where the pointer is: a drag is
    /// a press, moves and a release.
    Button {
        /// The button.
        button: MouseButton,
        /// Pressed or released.
        down: bool,
    },
    /// Turns the mouse wheel by `dy` notches: positive scrolls down, negative up.
    Scroll {
        /// Notches, at most 100 either way.
        dy: i32,
    },
}

/// A mouse button.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum MouseButton {
    /// The primary button.
    #[default]
    Left,
    /// The secondary button.
    Right,
    /// The wheel button.
    Middle,
}

/// `GET /v1/sandboxes/{id}/files/list`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct FileList {
    /// Entries sorted by name.
    pub entries: Vec<FileInfo>,
}

/// `POST /v1/sandboxes/{id}/files/mkdir`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct MkdirRequest {
    /// Directory to create with parents.
    pub path: String,
}

/// `POST /v1/sandboxes/{id}/files/rename`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RenameRequest {
    /// Source.
    pub from: String,
    /// Destination.
    pub to: String,
}

/// `PUT /v1/sandboxes/{id}/files` answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct WriteResult {
    /// Bytes written.
    pub bytes: u64,
}

/// An image known to the node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Image {
    /// Name (`base`, `python:3.11`).
    pub name: String,
    /// `sha256:` digest: of the EROFS layer for a one-layer image, else of the layer list.
    pub digest: String,
    /// Total size of its EROFS blobs in bytes.
    pub size_bytes: u64,
    /// Import time (unix ms).
    pub created_at: u64,
    /// Where it was imported from.
    pub source: String,
    /// Digests of its EROFS layers, bottom first.
    #[serde(default)]
    pub layers: Vec<String>,
    /// Defaults for sandboxes made from it (from an OCI image's config).
    #[serde(default, skip_serializing_if = "ImageConfig::is_empty")]
    pub config: ImageConfig,
}

/// Defaults an image gives its sandboxes; a create request's own values win.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ImageConfig {
    /// Environment variables.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Working directory of commands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    /// User commands run as (recorded; commands run as root today).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// OCI `Entrypoint` (recorded for callers).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub entrypoint: Vec<String>,
    /// OCI `Cmd` (recorded for callers).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cmd: Vec<String>,
    /// OCI `Labels` (a Dockerfile's `LABEL`s).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

impl ImageConfig {
    /// Whether nothing is set.
    pub fn is_empty(&self) -> bool {
        self == &Self::default()
    }
}

/// `GET /v1/images`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ImageList {
    /// Images sorted by name.
    pub images: Vec<Image>,
}

/// `POST /v1/images`: import from a path on the server's machine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ImportImageRequest {
    /// Name to give the image.
    pub name: String,
    /// On the server host: a root file system (directory, `.tar`, `.tar.gz`/`.tgz`), a
    /// `docker save` archive or an OCI image layout (directory or tar), or an `.erofs` file.
    pub source: String,
    /// Store a multi-layer (docker/OCI) image as one layer.
    #[serde(default)]
    pub flatten: bool,
}

/// `POST /v1/images/pull`: pull an image from an OCI registry (answered with
/// [`ImportEvent`] lines, like `/v1/images/import/stream`, with two more phases:
/// `resolving` the manifest and `downloading` a layer blob).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct PullImageRequest {
    /// What to pull: `[REGISTRY[:PORT]/]REPOSITORY[:TAG][@sha256:DIGEST]` (no registry:
    /// Docker Hub; no tag or digest: `latest`).
    pub reference: String,
    /// Name to give the image; default: `reference` as given, `@` written `:`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Speak plain HTTP to the registry (one without TLS, e.g. on loopback).
    #[serde(default)]
    pub insecure: bool,
}

/// The catalog name of `image` if it is a registry reference a create pulls on first use;
/// `None` for a plain catalog name.
///
/// A registry reference names its registry: its first `/`-separated part holds a `.` or
/// a `:` or is `localhost` (Docker's rule: `ghcr.io/org/app:v1`,
/// `registry:5000/app@sha256:...`, `localhost/app`). `python:3.12` or `org/app` name no
/// registry and are catalog names (Docker Hub's images are `docker.io/library/python:3.12`).
/// The catalog name is the reference with `@` written `:`, what a pull without `name`
/// stores.
pub fn registry_image_name(image: &str) -> Option<String> {
    let (host, rest) = image.split_once('/')?;
    let names_registry = host.contains('.') || host.contains(':') || host == "localhost";
    (names_registry && !rest.is_empty()).then(|| image.replace('@', ":"))
}

/// One line of the NDJSON answer of `POST /v1/images/import/stream`.
// A handful of events per import: the size of the one `Done` does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ImportEvent {
    /// Work done so far in the current phase.
    Progress {
        /// `extracting` (bytes of the source read), `building` (bytes of the layer
        /// written), `hashing`, `storing` (also uploading to a shared store); a pull
        /// also reports `resolving` (the manifest) and `downloading` (bytes of a layer
        /// blob).
        phase: String,
        /// Bytes processed in this phase.
        bytes_done: u64,
        /// Bytes this phase will process, when known.
        #[serde(default)]
        bytes_total: Option<u64>,
    },
    /// The import finished; the last line.
    Done {
        /// The stored image.
        image: Image,
    },
    /// The import failed and left nothing behind; the last line.
    Error {
        /// Why.
        error: ApiError,
    },
}

/// The WebSocket subprotocol of `GET /v1/sandboxes/{id}/terminal`: the client sends
/// [`TerminalInput`]s as JSON text messages, the server sends [`ExecEvent`]s.
pub const TERMINAL_PROTOCOL: &str = "dsec.terminal.v1";

/// A browser cannot set headers on a WebSocket: it may offer its API key as a second
/// subprotocol, this prefix then the key in unpadded base64url (as Kubernetes does with
/// bearer tokens). The server never selects it.
pub const KEY_PROTOCOL_PREFIX: &str = "dsec.key.";

/// Query of `GET /v1/sandboxes/{id}/terminal`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct TerminalQuery {
    /// Columns of the PTY; default 120.
    #[serde(default)]
    pub cols: Option<u16>,
    /// Rows of the PTY; default 32.
    #[serde(default)]
    pub rows: Option<u16>,
    /// Shell command to run on it; default an interactive `bash` (else `sh`).
    #[serde(default)]
    pub cmd: Option<String>,
    /// User to run it as; default the sandbox's.
    #[serde(default)]
    pub user: Option<String>,
}

/// A message from a terminal's client.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum TerminalInput {
    /// Keys typed: written to the PTY.
    Stdin {
        /// The text.
        data: String,
    },
    /// The window changed size.
    Resize {
        /// Columns.
        cols: u16,
        /// Rows.
        rows: u16,
    },
    /// A signal for the shell (`INT`, `TERM`, ...).
    Signal {
        /// Signal name or number.
        signal: String,
    },
}

/// Seconds between two samples of [`Utilization`].
pub const UTILIZATION_INTERVAL_S: u64 = 10;
/// Samples [`Utilization`] keeps: an hour.
pub const UTILIZATION_SAMPLES: usize = 360;

/// `GET /v1/utilization`: what the fleet held, sampled every
/// [`UTILIZATION_INTERVAL_S`] over the last hour by the API server answering (each
/// replica samples on its own, from its start).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Utilization {
    /// Seconds between samples.
    pub interval_s: u64,
    /// Oldest first.
    pub samples: Vec<UtilizationSample>,
}

/// One sample of [`Utilization`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct UtilizationSample {
    /// When (unix ms).
    pub at_ms: u64,
    /// Sandboxes of every tenant, in any state.
    pub sandboxes: u64,
    /// Of them, ready.
    pub ready: u64,
    /// Of them, paused.
    pub paused: u64,
    /// Live nodes.
    pub nodes: u64,
    /// CPU the sandboxes asked for (thousandths of a CPU), over all live nodes.
    pub cpu_millis_requested: u64,
    /// CPU the nodes offer (thousandths of a CPU).
    pub cpu_millis_allocatable: u64,
    /// Memory the nodes have free, bytes.
    pub memory_available_bytes: u64,
}

/// `GET /v1/whoami`: the caller as its key makes it (the console reads it at sign-in).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Whoami {
    /// The key's tenant.
    pub tenant: String,
    /// The key's id.
    pub key_id: String,
    /// What the key may do: `read`, `sandboxes`, `images`, `admin`.
    pub scopes: Vec<String>,
    /// An admin key of the default tenant: sees and manages every tenant.
    pub cluster_admin: bool,
}

/// `GET /v1/health`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Health {
    /// Always `ok` when answered.
    pub status: String,
    /// Server version.
    pub version: String,
    /// Node name.
    pub node: String,
    /// `v1` or `v2`.
    pub cgroup: String,
    /// Live sandboxes.
    pub sandboxes: u64,
    /// Sandboxes in state `unhealthy` now (their agents do not answer).
    #[serde(default)]
    pub unhealthy_sandboxes: u64,
    /// Times since the server started that a sandbox became `unhealthy`.
    #[serde(default)]
    pub unhealthy_marks_total: u64,
    /// What the node admits and holds now, for placement.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<NodeCapacity>,
    /// The isolation levels the node offers (a single node's server).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub isolation: Vec<IsolationLevel>,
}

/// A node's capacity and load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct NodeCapacity {
    /// Requested CPU the node admits in total (CPUs x overcommit), millicores.
    pub cpu_millis_allocatable: u64,
    /// Requested CPU of its sandboxes, millicores.
    pub cpu_millis_requested: u64,
    /// Host memory available now.
    pub memory_available_bytes: u64,
    /// Memory the node keeps free for itself; below it nothing is admitted.
    pub memory_reserve_bytes: u64,
    /// Sandboxes on the node (running and starting).
    pub sandboxes: u64,
    /// Most sandboxes it runs (0: no count limit).
    pub max_sandboxes: u64,
    /// Whether each sandbox gets its own core-scheduling cookie (kernels with
    /// `CONFIG_SCHED_CORE`): no two sandboxes then share a core's SMT siblings.
    #[serde(default)]
    pub core_scheduling: bool,
}

#[cfg(test)]
mod network_tests {
    use super::*;

    #[test]
    fn allow_rules_parse_and_match() {
        let r = AllowRule::parse("PyPI.org:443").expect("name");
        assert_eq!(r.target, AllowTarget::Name("pypi.org".into()));
        assert_eq!(r.port, Some(443));
        assert!(r.matches_name("pypi.org."));
        assert!(!r.matches_name("evil-pypi.org"));
        let r = AllowRule::parse("*.pythonhosted.org").expect("suffix");
        assert!(r.matches_name("files.pythonhosted.org"));
        assert!(!r.matches_name("pythonhosted.org"));
        assert!(!r.matches_name("xpythonhosted.org"));
        let r = AllowRule::parse("10.1.2.3/8:80").expect("cidr");
        assert_eq!(
            r.target,
            AllowTarget::Cidr(std::net::Ipv4Addr::new(10, 0, 0, 0), 8)
        );
        assert_eq!(
            AllowRule::parse("192.0.2.7").expect("ip").target,
            AllowTarget::Cidr(std::net::Ipv4Addr::new(192, 0, 2, 7), 32)
        );
        for bad in [
            "",
            "a..b",
            "x:0",
            "x:70000",
            "1.2.3.4/33",
            "*.",
            "a b",
            "http://x",
            "::1",
        ] {
            assert!(AllowRule::parse(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn network_policy_takes_a_bare_mode_or_an_object() {
        let p: NetworkPolicy = serde_json::from_str("\"open\"").expect("mode");
        assert_eq!(p.mode, NetworkMode::Open);
        let p: NetworkPolicy =
            serde_json::from_str(r#"{"mode":"allowlist","allow":["pypi.org:443"]}"#)
                .expect("object");
        assert_eq!(p.allow, vec!["pypi.org:443".to_string()]);
        let back: NetworkPolicy =
            serde_json::from_str(&serde_json::to_string(&p).expect("ser")).expect("de");
        assert_eq!(back, p);
        assert!(serde_json::from_str::<NetworkPolicy>("\"bridge\"").is_err());
    }
}

/// A node of the cluster as `GET /v1/nodes` reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ClusterNode {
    /// Its unique name.
    pub name: String,
    /// Base URL of its internal API.
    pub url: String,
    /// Its labels (`pool=onprem`).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Whether the answering API server sees it live now (its registration's lease is
    /// held by heartbeats).
    pub live: bool,
    /// No new sandboxes are placed on it; its sandboxes keep running.
    pub draining: bool,
    /// Requested CPU it admits in total, millicores.
    pub cpu_millis: u64,
    /// Memory it admits in total, bytes.
    pub memory_bytes: u64,
    /// Most sandboxes it runs (0: no count limit).
    pub max_sandboxes: u64,
    /// Requested CPU of its sandboxes at its last heartbeat, millicores.
    pub cpu_millis_used: u64,
    /// Requested memory of its sandboxes at its last heartbeat, bytes.
    pub memory_bytes_used: u64,
    /// Its sandboxes at its last heartbeat.
    pub sandboxes: u64,
    /// Its dsec version.
    #[serde(default)]
    pub version: String,
    /// Drawn when its process started: changes when it restarts.
    #[serde(default)]
    pub boot_id: String,
}

/// `GET /v1/nodes`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ClusterNodeList {
    /// The nodes, by name.
    pub nodes: Vec<ClusterNode>,
}

#[cfg(test)]
mod image_name_tests {
    use super::*;

    #[test]
    fn registry_references_name_their_registry() {
        let r = registry_image_name;
        assert_eq!(
            r("ghcr.io/org/app:v1").as_deref(),
            Some("ghcr.io/org/app:v1")
        );
        assert_eq!(
            r("127.0.0.1:5000/app@sha256:ab").as_deref(),
            Some("127.0.0.1:5000/app:sha256:ab")
        );
        assert_eq!(r("localhost/app").as_deref(), Some("localhost/app"));
        for plain in ["base", "python:3.12", "org/app", "sha256:ab", "my.host/"] {
            assert_eq!(r(plain), None, "{plain}");
        }
    }
}

#[cfg(test)]
mod dockerfile_build_query_tests {
    use super::*;

    #[test]
    fn a_build_request_survives_its_query_string() {
        let req = DockerfileBuildRequest {
            name: "task:1".into(),
            dockerfile: Some("docker/Dockerfile".into()),
            target: Some("test".into()),
            build_args: [
                ("PY".to_string(), "3.12".to_string()),
                ("EMPTY".to_string(), String::new()),
                ("EQ".to_string(), "a=b".to_string()),
            ]
            .into(),
            network: NetworkMode::Open,
            no_cache: true,
            step_timeout_s: Some(90.5),
        };
        assert_eq!(DockerfileBuildRequest::from_query(req.to_query()), Ok(req));
        let minimal = DockerfileBuildRequest {
            name: "x".into(),
            ..Default::default()
        };
        assert_eq!(minimal.to_query(), [("name".to_string(), "x".to_string())]);
    }

    #[test]
    fn bad_queries_say_which_pair_is_wrong() {
        let q = |pairs: &[(&str, &str)]| {
            DockerfileBuildRequest::from_query(
                pairs
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            )
        };
        assert!(q(&[]).expect_err("refused").contains("name"));
        assert!(q(&[("name", "x"), ("build_arg", "NOEQ")])
            .expect_err("refused")
            .contains("NOEQ"));
        assert!(q(&[("name", "x"), ("network", "wide")])
            .expect_err("refused")
            .contains("wide"));
        assert!(q(&[("name", "x"), ("colour", "red")])
            .expect_err("refused")
            .contains("colour"));
    }
}

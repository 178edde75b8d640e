//! Warm pools (`/v1/pools`): sandboxes of one environment made ahead of demand, which a
//! create naming the pool claims at once, and the autoscaler that sizes them on queue
//! wait.

use serde::{Deserialize, Serialize};

use super::CreateSandboxRequest;

/// Label every warm (unclaimed) member of a pool carries: the pool's name. A claim
/// removes it.
pub const POOL_LABEL: &str = "dsec-pool";
/// Label a claimed sandbox keeps: the pool it came from.
pub const POOL_ORIGIN_LABEL: &str = "dsec-pool-origin";

/// How a pool's autoscaler works. Every field has the default named in its doc.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields, default)]
pub struct AutoscalePolicy {
    /// The window over which queue wait is averaged, seconds. Default 10.
    pub window_s: f64,
    /// The pool grows when the average wait of claims over the window exceeds this, ms.
    /// Default 500.
    pub target_queue_wait_ms: u64,
    /// Growth factor of one scale-up. Default 2.
    pub scale_up_factor: f64,
    /// The pool shrinks when more than this share of its sandboxes stays idle (warm,
    /// unclaimed) for `idle_window_s`. Default 0.4.
    pub idle_ratio: f64,
    /// How long the idle share must stay above `idle_ratio`, seconds. Default 120.
    pub idle_window_s: f64,
    /// One scale-down removes this share of the idle sandboxes (at least one). Default
    /// 0.25.
    pub scale_down_fraction: f64,
    /// No scaling for this long after a scale event, seconds. Default 30.
    pub cooldown_s: f64,
    /// The autoscaler's inputs are stale (an alarm: metric and log) when older than
    /// this, seconds. Default 30.
    pub stale_after_s: f64,
}

impl Default for AutoscalePolicy {
    fn default() -> Self {
        Self {
            window_s: 10.0,
            target_queue_wait_ms: 500,
            scale_up_factor: 2.0,
            idle_ratio: 0.4,
            idle_window_s: 120.0,
            scale_down_fraction: 0.25,
            cooldown_s: 30.0,
            stale_after_s: 30.0,
        }
    }
}

/// `POST /v1/pools`: a warm pool of the caller's tenant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct PoolSpec {
    /// Name, unique within the tenant: `[a-z0-9][a-z0-9._-]*`, at most 63 bytes.
    pub name: String,
    /// The environment of every sandbox of the pool, as a create would ask for it
    /// (image, layers, resources, network, user, env, workdir, files, labels, ...).
    /// Not: `timeout_s` (a warm sandbox lives as long as its pool), `pool`,
    /// `idempotency_key`.
    #[serde(default)]
    pub template: CreateSandboxRequest,
    /// Fewest sandboxes the pool keeps (warm and in the making). Default 1.
    #[serde(default = "default_min")]
    pub min: u32,
    /// Most sandboxes the pool keeps. Default 32.
    #[serde(default = "default_max")]
    pub max: u32,
    /// The autoscaler's policy.
    #[serde(default)]
    pub autoscale: AutoscalePolicy,
    /// Set for a pool whose sandboxes serve function calls (`POST /v1/fncall`) instead
    /// of being claimed by creates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fncall: Option<super::FnCallPolicy>,
}

fn default_min() -> u32 {
    1
}

fn default_max() -> u32 {
    32
}

/// `PATCH /v1/pools/{name}`: new sizes or policy (the environment stays).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct PoolUpdate {
    /// New minimum.
    #[serde(default)]
    pub min: Option<u32>,
    /// New maximum.
    #[serde(default)]
    pub max: Option<u32>,
    /// New autoscale policy (replaces the whole policy).
    #[serde(default)]
    pub autoscale: Option<AutoscalePolicy>,
}

/// Why the autoscaler changed a pool's target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum ScaleReason {
    /// The average queue wait over the window was above the target.
    QueueWait,
    /// The idle share stayed above the policy's for the idle window.
    Idle,
    /// Claims wait on a pool whose target was zero.
    FromZero,
    /// The pool's bounds changed (`PATCH`).
    Bounds,
}

/// One change of a pool's target size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ScaleEvent {
    /// When (unix ms).
    pub at: u64,
    /// Target before.
    pub from: u32,
    /// Target after.
    pub to: u32,
    /// Why.
    pub reason: ScaleReason,
}

/// A pool and its state, as this API server sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Pool {
    /// What the pool was created with (and updated to).
    pub spec: PoolSpec,
    /// Its tenant.
    pub tenant: String,
    /// When it was created (unix ms).
    pub created_at: u64,
    /// The size the autoscaler wants now, within `[min, max]`.
    pub target: u32,
    /// Sandboxes the pool holds: warm, in the making and running calls.
    pub size: u32,
    /// Warm sandboxes, ready to be claimed (or to run a call).
    pub ready: u32,
    /// Sandboxes running a function call (pools with `fncall`).
    #[serde(default)]
    pub busy: u32,
    /// Sandboxes being made.
    pub creating: u32,
    /// Claims served since this API server started.
    pub claimed: u64,
    /// Function calls served since this API server started.
    #[serde(default)]
    pub calls: u64,
    /// Claims waiting for a warm sandbox.
    pub queue_length: u32,
    /// Average wait of claims over the autoscale window (served ones and those still
    /// waiting), ms.
    pub queue_wait_ms: f64,
    /// The latest scale events, oldest first (at most 32).
    pub scale_events: Vec<ScaleEvent>,
    /// Age of the autoscaler's inputs, seconds.
    pub inputs_age_s: f64,
    /// Whether the inputs are older than the policy's `stale_after_s` (an alarm).
    pub stale: bool,
    /// Whether this API server sizes the pool (always on `dsec serve`; on replicas
    /// sharing nodes, the one elected for it).
    #[serde(default)]
    pub owner: bool,
    /// The last failure to make a sandbox for the pool, if the latest attempt failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// `GET /v1/pools`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct PoolList {
    /// The caller's tenant's pools, by name.
    pub pools: Vec<Pool>,
}

//! [`ControlPlane`]: the public API over a set of nodes and a state store.
//!
//! This file owns the records (the cache of the store's sandbox records, persisting,
//! state checks) and the [`SandboxApi`] implementation, which validates each call and
//! hands it to its owner:
//! - `lifecycle`: create, delete, pause, resume, commit, network and timeout changes;
//! - `calls`: agent calls (exec, sessions, processes, files) and their streams;
//! - `liveness`: deadlines on agent calls, the watchdog, `unhealthy` sandboxes;
//! - `reaper`: lifetimes (TTL, idle timeout) and `expired` tombstones;
//! - `jobs`: job suspend and resume;
//! - `idempotency`: keyed creates;
//! - `images`: image import, build, delete, gc.
//! - `pull`: image pulls from OCI registries (the node pulls; progress streamed).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use bytes::Bytes;
use dsec_node_api::{ImportProgressSink, ImportSource, NodeApi, NodeCreateSpec, Timeline};
use dsec_state::StateStore;
use dsec_wire::agent::{self, ExecSpec, ProcessSpec, Reply, Request};
use dsec_wire::v1::*;
use dsec_wire::{ApiError, ErrorCode};
use futures::StreamExt;
use rand::Rng;
use tracing::Instrument as _;

use crate::api::{ApiResult, ByteStream, EventStream, ImportStream, Principal, SandboxApi};
use crate::nodes::{NodeSet, Placement, SingleNode};
use crate::validate;

mod batches;
mod calls;
mod events;
mod fncall;
mod fork;
mod idempotency;
mod images;
mod jobs;
mod lifecycle;
mod liveness;
mod pools;
mod pull;
mod queue;
pub(crate) use pull::ensure_image;
mod reaper;
mod records;
mod utilization;
use liveness::Limit;

const NS_SANDBOXES: &str = "sandboxes";
const NS_TOMBSTONES: &str = "tombstones";
/// Sandboxes a job suspend or resume works on at once.
const JOB_PARALLELISM: usize = 8;
/// How long `expired` is remembered for a sandbox the reaper removed.
const TOMBSTONE_TTL_MS: u64 = 24 * 3600 * 1000;

/// Defaults and knobs of the control plane.
#[derive(Debug, Clone)]
pub struct ControlConfig {
    /// The bootstrap API key: the `admin` key of tenant `default` with every scope
    /// (see [`dsec_iam`]); other keys are made with the admin API.
    pub api_key: String,
    /// The IAM to authenticate and charge quotas with; it must be over the store the
    /// plane is opened on. `None`: [`ControlPlane::open_on`] makes one over that store
    /// with `api_key` as the bootstrap key.
    pub iam: Option<Arc<dsec_iam::Iam>>,
    /// Default CPU limit, cores.
    pub default_cpu: f64,
    /// Default memory limit, MiB.
    pub default_memory_mb: u64,
    /// Default process limit.
    pub default_pids: u64,
    /// Whether this control plane is the only one driving its node (`dsec serve`): it
    /// then reconciles at start, destroying what the node runs without a record and
    /// creates a crash interrupted. API server replicas sharing nodes must not (a
    /// sandbox another replica is creating has no record yet).
    pub sole_owner: bool,
    /// Image used when a create names none.
    pub default_image: String,
    /// How often the reaper looks for expired sandboxes.
    pub reap_interval: Duration,
    /// Whether a job suspend stops its sandboxes' lifetimes (so a preempted trainer finds
    /// them when it is back). When false, lifetimes run on and expire as usual.
    pub job_suspend_stops_lifetime: bool,
    /// Where batches keep their inputs, outputs and error snapshots; without one,
    /// batches are refused. Replicas must share it.
    pub batch_store: Option<Arc<dyn dsec_blob::BlobStore>>,
    /// The model gateway sandboxes created with `model_access` call; without one, such
    /// creates are refused.
    pub model_gateway: Option<ModelGatewayLink>,
    /// A create that takes longer (ms) is logged with its phases; 0 logs none.
    pub slow_create_ms: u64,
    /// How long events are kept for `GET /v1/events` (s); 0 writes none.
    pub events_retention_s: u64,
    /// Event streams one tenant may hold open here at once.
    pub max_event_streams_per_tenant: usize,
}

/// How sandboxes reach the model gateway (issue #30).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelGatewayLink {
    /// The URL put in a sandbox's `OPENAI_BASE_URL`, as the sandbox reaches the gateway
    /// (the node redirects it there): it ends in `/v1`.
    pub base_url: String,
    /// The gateway's public model names: a create asking for another is refused. Empty:
    /// not checked here (the gateway answers `model_not_found` for unknown ones).
    pub models: Vec<String>,
}

impl ControlConfig {
    /// Defaults with the given key.
    pub fn with_key(api_key: String) -> Self {
        Self {
            api_key,
            iam: None,
            default_cpu: 1.0,
            default_memory_mb: 512,
            default_pids: 512,
            sole_owner: true,
            default_image: "base".into(),
            reap_interval: Duration::from_secs(1),
            job_suspend_stops_lifetime: true,
            batch_store: None,
            model_gateway: None,
            slow_create_ms: 2000,
            events_retention_s: DEFAULT_EVENTS_RETENTION_S,
            max_event_streams_per_tenant: dsec_wire::v1::DEFAULT_MAX_EVENT_STREAMS_PER_TENANT,
        }
    }
}

/// The control plane over a set of nodes.
#[derive(Debug)]
pub struct ControlPlane {
    cfg: ControlConfig,
    /// The nodes: a sandbox's calls go to the node its record names.
    nodes: Arc<dyn NodeSet>,
    /// The sandbox records: the store's, cached and kept fresh by a watch.
    records: Arc<records::Records>,
    /// Tenants, keys and quotas, on the same store as the records (a create's quota
    /// reservation commits in the same transaction as its record).
    iam: Arc<dsec_iam::Iam>,
    /// Times a sandbox became `unhealthy` since the start.
    unhealthy_marks: std::sync::atomic::AtomicU64,
    /// When the reaper last looked for old tombstones (ms since the epoch).
    tombstones_pruned_at: std::sync::atomic::AtomicU64,
    /// Node sandboxes the reaper found without a record, and their age (on their node's
    /// clock) when it first did: destroyed once that lasted [`reaper::ORPHAN_GRACE_MS`].
    unrecorded: std::sync::Mutex<HashMap<String, u64>>,
    /// The state store the records, IAM and pool specs live in.
    store: Arc<dyn StateStore>,
    /// Warm pools and their tasks.
    pools: pools::Pools,
    /// Creates waiting for capacity.
    queue: queue::CapacityQueue,
    /// Batches run by this plane.
    batches: batches::Batches,
    /// This plane itself, for the tasks of [`ControlPlane::to_end`].
    me: Weak<ControlPlane>,
    /// Creates' phases since the start.
    create_stats: crate::create_stats::CreateStats,
    /// The event log (`GET /v1/events`).
    events: Arc<events::EventLog>,
    utilization: utilization::UtilizationRing,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError::new(ErrorCode::Internal, e.to_string())
}

/// A state store error as the API answers it: a store without quorum (or out of reach)
/// is `unavailable` (retryable), anything else `internal`.
fn store_err(e: dsec_state::StateError) -> ApiError {
    match e {
        dsec_state::StateError::Unavailable(_) => {
            ApiError::new(ErrorCode::Unavailable, e.to_string())
        }
        e => internal(e),
    }
}

fn new_id() -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::thread_rng();
    let suffix: String = (0..12)
        .map(|_| ALPHABET[rng.gen_range(0..ALPHABET.len())] as char)
        .collect();
    format!("sb-{suffix}")
}

fn unexpected(reply: Reply) -> ApiError {
    ApiError::new(
        ErrorCode::Internal,
        format!("unexpected agent reply: {reply:?}"),
    )
}

fn ms_from_s(field: &str, s: Option<f64>) -> ApiResult<Option<u64>> {
    s.map(|v| validate::seconds(field, v)).transpose()
}

impl ControlPlane {
    /// Opens the control plane: loads records (and keeps them fresh from the store),
    /// reconciles them with what the node runs when it is the node's [sole
    /// owner](ControlConfig::sole_owner) (records without a sandbox fail, sandboxes
    /// without a record are destroyed), and starts the lifetime reaper.
    pub async fn open(
        cfg: ControlConfig,
        node: Arc<dyn NodeApi>,
        store: Arc<dyn StateStore>,
    ) -> ApiResult<Arc<Self>> {
        Self::open_on(cfg, Arc::new(SingleNode::new(node)), store).await
    }

    /// [`ControlPlane::open`] over a set of nodes (a cluster's). It waits until the set
    /// knows its nodes, so that none looks gone.
    pub async fn open_on(
        cfg: ControlConfig,
        nodes: Arc<dyn NodeSet>,
        store: Arc<dyn StateStore>,
    ) -> ApiResult<Arc<Self>> {
        let iam = match &cfg.iam {
            Some(iam) => iam.clone(),
            None => Arc::new(
                dsec_iam::Iam::new(store.clone(), Some(cfg.api_key.clone()))
                    .await
                    .map_err(ApiError::from)?,
            ),
        };
        let events = Arc::new(events::EventLog::new(
            store.clone(),
            cfg.events_retention_s.saturating_mul(1000),
        ));
        let records =
            records::Records::open(store.clone(), !cfg.sole_owner, iam.clone(), events.clone())
                .await?;
        nodes.synced().await;
        let plane = Arc::new_cyclic(|me| Self {
            cfg,
            nodes,
            records,
            iam,
            unhealthy_marks: Default::default(),
            tombstones_pruned_at: Default::default(),
            unrecorded: Default::default(),
            store,
            pools: Default::default(),
            queue: Default::default(),
            batches: Default::default(),
            me: me.clone(),
            create_stats: Default::default(),
            events,
            utilization: Default::default(),
        });
        plane.records.adopt_missing_keys().await?;
        if plane.cfg.sole_owner {
            plane.reconcile().await?;
        }
        // An agent found unresponsive before the restart is checked again.
        for sb in plane.records.filter(|s| s.state == SandboxState::Unhealthy) {
            plane.spawn_recovery(&sb.id);
        }
        plane.load_pools().await?;
        tokio::spawn(queue::run_queue(plane.me.clone()));
        plane.clone().spawn_reaper();
        plane.spawn_batch_sync();
        plane.spawn_utilization_sampler();
        if let Some(membership) = plane.nodes.membership() {
            tokio::spawn(events::follow_membership(plane.events.clone(), membership));
        }
        Ok(plane)
    }

    /// Tenants, keys and quotas: serve the admin API over it
    /// (`dsec_http::admin::admin_router`).
    pub fn iam(&self) -> &Arc<dsec_iam::Iam> {
        &self.iam
    }

    /// Makes records and the node agree after a start (sole owner only): a sandbox
    /// without a record is destroyed, a record without a live sandbox fails, and a
    /// create a crash interrupted is undone.
    async fn reconcile(&self) -> ApiResult<()> {
        let node = self.nodes.any()?;
        let listed = node.list().await?;
        // Sandboxes whose lifetime the node ended are the reaper's: it turns them into
        // `expired` answers.
        let ended: std::collections::HashSet<String> = listed
            .iter()
            .filter(|s| s.ended.is_some())
            .map(|s| s.id.clone())
            .collect();
        let running: HashMap<String, bool> = listed
            .into_iter()
            .filter(|s| s.ended.is_none())
            .map(|s| (s.id, s.alive))
            .collect();
        for (id, alive) in &running {
            if self.records.find(id).await?.is_none() {
                tracing::info!(%id, "destroying sandbox without a record");
                node.destroy(id).await?;
            } else if !alive {
                tracing::info!(%id, "sandbox died while the server was down");
            }
        }
        let now = now_ms();
        for mut sb in self.records.filter(|s| !ended.contains(&s.id)) {
            let id = sb.id.clone();
            match running.get(&id) {
                // Still `creating`: the server died before the create answered, so nobody
                // was told of this sandbox, and whether its initial files were placed is
                // unknown. Whatever the node holds of it goes, and the record with it: a
                // retry with the same idempotency key makes a new sandbox, and no record
                // stays `creating` with no create to finish it.
                _ if sb.state == SandboxState::Creating => {
                    tracing::info!(%id, "removing half-created sandbox");
                    match node.destroy(&id).await {
                        Ok(()) => {
                            self.records.remove(&sb, None).await?;
                            continue;
                        }
                        // Kept, failed, for a delete or its lifetime's end to retry.
                        Err(e) => {
                            tracing::warn!(%id, error = %e, "removing half-created sandbox failed");
                            sb.state = SandboxState::Failed;
                            sb.failure = Some(format!(
                                "the server stopped while the sandbox was being created, \
                                 and removing it failed: {e}"
                            ));
                        }
                    }
                }
                Some(true) => {
                    // Activity is not persisted (it would cost a write per call): a restart
                    // counts as activity.
                    sb.last_active_at = now;
                }
                _ => {
                    sb.state = SandboxState::Failed;
                    sb.failure
                        .get_or_insert_with(|| "sandbox is no longer running on its node".into());
                    let _ = node.destroy(&id).await;
                }
            }
            self.records.put(&sb).await?;
        }
        Ok(())
    }

    /// Runs a state-changing call on its own task and waits for it. The call runs to its
    /// end even if the caller goes away: an HTTP client that times out or is killed in the
    /// middle of a create (a preempted trainer) must not leave a half-made sandbox, stuck in
    /// `creating`, with processes and mounts nobody owns. A create finished that way is an
    /// ordinary sandbox: found again by its idempotency key or labels, or reaped at the end
    /// of its lifetime.
    async fn to_end<T, F, Fut>(&self, call: F) -> ApiResult<T>
    where
        F: FnOnce(Arc<Self>) -> Fut,
        Fut: std::future::Future<Output = ApiResult<T>> + Send + 'static,
        T: Send + 'static,
    {
        let me = self
            .me
            .upgrade()
            .ok_or_else(|| internal("the control plane is shutting down"))?;
        // The task serves the caller's request: its id and span go with it.
        let request = dsec_node_api::request_id::served();
        let work = dsec_node_api::request_id::carry(request, call(me));
        tokio::spawn(tracing::Instrument::instrument(
            work,
            tracing::Span::current(),
        ))
        .await
        .map_err(internal)?
    }

    /// The error for an id with no record: `expired` if a tombstone says it was reaped.
    async fn missing(&self, id: &str) -> ApiError {
        if let Some(t) = self.records.tombstone(id).await {
            return ApiError::new(
                ErrorCode::Expired,
                format!("sandbox {id} expired and was removed: {}", t.reason),
            );
        }
        ApiError::new(ErrorCode::NotFound, format!("sandbox {id} not found"))
    }

    /// `not_found`, worded exactly as for an id that does not exist, unless `caller`'s
    /// tenant owns sandbox `id` (or no sandbox `id` exists: the call then answers as it
    /// does for any unknown id). Every call on a sandbox checks this first, before it
    /// changes anything. A sandbox's tenant never changes, so the check holds for the
    /// rest of the call.
    async fn owned(&self, caller: &Principal, id: &str) -> ApiResult<()> {
        let tenant = match self.records.find(id).await? {
            Some(sb) => Some(sb.tenant),
            None => self.records.tombstone(id).await.map(|t| t.tenant),
        };
        match tenant {
            Some(t) if t != caller.tenant => Err(ApiError::new(
                ErrorCode::NotFound,
                format!("sandbox {id} not found"),
            )),
            _ => Ok(()),
        }
    }

    /// `GET /files` of sandbox `id`, whoever owns it (callers check that first).
    async fn read_file_of(
        &self,
        id: &str,
        path: &str,
        offset: u64,
        length: Option<u64>,
    ) -> ApiResult<(FileInfo, ByteStream)> {
        validate::sandbox_path("path", path)?;
        validate::read_range(offset, length)?;
        let (info, bytes) = self
            .guarded(id, Some(Limit::call()), async {
                let node = self.usable(id).await?;
                node.read_file(id, path, offset, length).await
            })
            .await?;
        Ok((info, self.watched(id, bytes, None, Err)))
    }

    /// The record of `id`, or the error saying why there is none. A cached record
    /// still `creating` is read again from the store: another replica's create may have
    /// finished a moment ago, before this replica's watch saw it.
    async fn record(&self, id: &str) -> ApiResult<Sandbox> {
        let found = match self.records.get(id) {
            Some(sb) if sb.state != SandboxState::Creating => Some(sb),
            _ => self.records.fetch_fresh(id).await?,
        };
        match found {
            Some(sb) => Ok(sb),
            None => Err(self.missing(id).await),
        }
    }

    /// Checks that a sandbox can take calls, and records the activity. A refusal is
    /// checked against the store first (the cache may be a moment behind another
    /// replica's resume or create).
    async fn ready(&self, id: &str) -> ApiResult<Sandbox> {
        let mut sb = self.record(id).await?;
        if sb.state != SandboxState::Ready {
            sb = match self.records.fetch_fresh(id).await? {
                Some(sb) => sb,
                None => return Err(self.missing(id).await),
            };
        }
        if sb.state == SandboxState::Ready {
            self.records.touch(id, now_ms());
            return Ok(sb);
        }
        Err(state_error(&sb))
    }

    /// The node running `sb`, or `lost` when it is not live.
    fn node_of(&self, sb: &Sandbox) -> ApiResult<Arc<dyn NodeApi>> {
        self.nodes
            .get(&sb.node)
            .ok_or_else(|| lost_error(&sb.id, &sb.node))
    }

    /// The node running sandbox `id` (see [`ControlPlane::node_of`]).
    async fn node_for(&self, id: &str) -> ApiResult<Arc<dyn NodeApi>> {
        let sb = self.record(id).await?;
        self.node_of(&sb)
    }

    /// Moves a sandbox from `from` to `to` in the store (compare-and-swap: of concurrent
    /// transitions on any replicas, one wins); false if it was in `to` already. Any other
    /// state is answered the way `ready` answers it.
    async fn transition(&self, id: &str, from: SandboxState, to: SandboxState) -> ApiResult<bool> {
        self.change(id, |sb| {
            if sb.state == to {
                return Ok(false);
            }
            if sb.state != from {
                if sb.state == SandboxState::Ready {
                    return Err(ApiError::new(
                        ErrorCode::Conflict,
                        format!("sandbox {id} cannot go from {from:?} to {to:?}"),
                    ));
                }
                return Err(state_error(sb));
            }
            sb.state = to;
            Ok(true)
        })
        .await
        .map(|(_, changed)| changed)
    }

    /// Changes record `id` with `change` (see [`records::Records::update`]); the answer
    /// for a missing id is `not_found` or `expired`.
    async fn change(
        &self,
        id: &str,
        change: impl FnMut(&mut Sandbox) -> ApiResult<bool>,
    ) -> ApiResult<(Sandbox, bool)> {
        match self.records.update(id, change).await? {
            Some(v) => Ok(v),
            None => Err(self.missing(id).await),
        }
    }
}

/// `forbidden` unless `caller` is a cluster admin: nodes are the operator's.
fn operator(caller: &Principal) -> ApiResult<()> {
    if caller.is_cluster_admin() {
        return Ok(());
    }
    Err(ApiError::new(
        ErrorCode::Forbidden,
        "nodes are managed by the cluster's operator (an admin key of the default tenant)",
    ))
}

/// Why a sandbox in `sb.state` cannot take calls.
fn state_error(sb: &Sandbox) -> ApiError {
    let id = &sb.id;
    match sb.state {
        SandboxState::Ready => ApiError::new(ErrorCode::Conflict, format!("sandbox {id} is ready")),
        SandboxState::Creating => ApiError::new(
            ErrorCode::Conflict,
            format!("sandbox {id} is still being created"),
        ),
        SandboxState::Paused => ApiError::new(
            ErrorCode::Paused,
            format!(
                "sandbox {id} is paused: resume it (POST /v1/sandboxes/{id}/resume) or create sandboxes with auto_resume"
            ),
        ),
        SandboxState::Stopping => ApiError::new(
            ErrorCode::Conflict,
            format!("sandbox {id} is being deleted"),
        ),
        SandboxState::Failed => ApiError::new(
            ErrorCode::Failed,
            format!(
                "sandbox {id} failed: {}",
                sb.failure.clone().unwrap_or_default()
            ),
        ),
        SandboxState::Unhealthy => liveness::unhealthy_error(
            id,
            sb.unhealthy_cause.as_deref().unwrap_or_default(),
        ),
        SandboxState::Lost => lost_error(id, &sb.node),
    }
}

/// The answer for a sandbox whose node is not live.
fn lost_error(id: &str, node: &str) -> ApiError {
    ApiError::new(
        ErrorCode::Lost,
        format!(
            "sandbox {id} is lost: its node {node} stopped heartbeating; it is back if the \
             node returns still running it (delete it to give up on it)"
        ),
    )
}

#[async_trait::async_trait]
impl SandboxApi for ControlPlane {
    fn authenticate(&self, key: Option<&str>) -> ApiResult<Principal> {
        match key {
            Some(k) => self.iam.authenticate(k).map_err(ApiError::from),
            None => Err(ApiError::new(
                ErrorCode::Unauthorized,
                "missing API key: send it in the x-api-key header (or Authorization: Bearer)",
            )),
        }
    }

    async fn health(&self) -> ApiResult<Health> {
        let sandboxes = self.records.count(|_| true) as u64;
        let (node, cgroup, capacity, isolation) = if self.nodes.is_single() {
            let n = self.nodes.any()?;
            (
                n.name().to_string(),
                n.cgroup_version().to_string(),
                Some(n.capacity().await),
                n.isolation_levels(),
            )
        } else {
            let live = self.nodes.live().len();
            (
                format!("cluster of {live} live nodes"),
                String::new(),
                None,
                Vec::new(),
            )
        };
        Ok(Health {
            unhealthy_sandboxes: self.unhealthy_count(),
            unhealthy_marks_total: self
                .unhealthy_marks
                .load(std::sync::atomic::Ordering::Relaxed),
            status: "ok".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            node,
            cgroup,
            sandboxes,
            capacity,
            isolation,
        })
    }

    async fn create_sandbox(
        &self,
        caller: &Principal,
        req: CreateSandboxRequest,
    ) -> ApiResult<Sandbox> {
        // Labels the server sets, and what sets them.
        const RESERVED: [(&str, &str); 6] = [
            (FORK_OF_LABEL, "forks"),
            (POOL_LABEL, "warm pools"),
            (POOL_ORIGIN_LABEL, "warm pools"),
            (FNCALL_LABEL, "warm pools"),
            (BATCH_LABEL, "batches"),
            (BATCH_TASK_LABEL, "batches"),
        ];
        for k in req.labels.keys() {
            if let Some((_, owner)) = RESERVED.iter().find(|(label, _)| label == k) {
                return Err(ApiError::new(
                    ErrorCode::BadRequest,
                    format!("labels: {k:?} is set by {owner} only"),
                ));
            }
        }
        self.create_unchecked(&caller.tenant, req).await
    }

    async fn create_pool(&self, caller: &Principal, spec: PoolSpec) -> ApiResult<Pool> {
        let tenant = caller.tenant.clone();
        self.to_end(move |me| async move { me.create_pool_to_end(&tenant, spec).await })
            .await
    }

    async fn list_pools(&self, caller: &Principal) -> ApiResult<PoolList> {
        Ok(self.list_pools_of(&caller.tenant))
    }

    async fn get_pool(&self, caller: &Principal, name: &str) -> ApiResult<Pool> {
        self.pool_status(&caller.tenant, name)
    }

    async fn update_pool(
        &self,
        caller: &Principal,
        name: &str,
        update: PoolUpdate,
    ) -> ApiResult<Pool> {
        let (tenant, name) = (caller.tenant.clone(), name.to_string());
        self.to_end(move |me| async move { me.update_pool_to_end(&tenant, &name, update).await })
            .await
    }

    async fn delete_pool(&self, caller: &Principal, name: &str) -> ApiResult<()> {
        let (tenant, name) = (caller.tenant.clone(), name.to_string());
        self.to_end(move |me| async move { me.delete_pool_to_end(&tenant, &name).await })
            .await
    }

    async fn events(
        &self,
        caller: &Principal,
        query: EventQuery,
    ) -> ApiResult<crate::api::EventFeed> {
        if !self.events.enabled() {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                "events are off on this server (--events-retention-s 0)",
            ));
        }
        let mut filter = query
            .filter()
            .map_err(|e| ApiError::new(ErrorCode::BadRequest, e))?;
        if !caller.is_cluster_admin() {
            match &filter.tenant {
                Some(t) if *t != caller.tenant => {
                    return Err(ApiError::new(
                        ErrorCode::Forbidden,
                        format!("this key sees only tenant {}'s events", caller.tenant),
                    ))
                }
                _ => filter.tenant = Some(caller.tenant.clone()),
            }
        }
        let slot = self
            .events
            .stream_slot(&caller.tenant, self.cfg.max_event_streams_per_tenant)?;
        let feed = self
            .events
            .stream(filter, query.after, !query.no_follow)
            .await?;
        // The slot is given back when the stream is dropped (the client went away).
        Ok(futures::StreamExt::boxed(futures::StreamExt::map(
            feed,
            move |e| {
                let _held = &slot;
                e
            },
        )))
    }

    async fn queue_status(&self, caller: &Principal) -> ApiResult<QueueStatus> {
        Ok(self
            .queue
            .status(&caller.tenant, caller.allows(crate::api::Scope::Admin)))
    }

    async fn fncall(&self, caller: &Principal, req: FnCallRequest) -> ApiResult<FnCallResponse> {
        let tenant = caller.tenant.clone();
        self.to_end(move |me| async move { me.fncall_to_end(&tenant, req).await })
            .await
    }

    async fn put_input(
        &self,
        caller: &Principal,
        key: &str,
        body: ByteStream,
    ) -> ApiResult<InputObject> {
        self.put_input_of(&caller.tenant, key, body).await
    }

    async fn submit_batch(&self, caller: &Principal, spec: BatchSpec) -> ApiResult<Batch> {
        self.submit_batch_of(caller, spec).await
    }

    async fn list_batches(&self, caller: &Principal) -> ApiResult<BatchList> {
        self.batches_of(&caller.tenant).await
    }

    async fn get_batch(&self, caller: &Principal, id: &str) -> ApiResult<Batch> {
        self.batch_of(&caller.tenant, id).await
    }

    async fn batch_tasks(
        &self,
        caller: &Principal,
        id: &str,
        query: TaskListQuery,
    ) -> ApiResult<TaskList> {
        self.batch_tasks_of(&caller.tenant, id, query).await
    }

    async fn batch_manifest(&self, caller: &Principal, id: &str) -> ApiResult<Manifest> {
        self.batch_manifest_of(&caller.tenant, id).await
    }

    async fn batch_output(
        &self,
        caller: &Principal,
        id: &str,
        task: &str,
        path: Option<&str>,
    ) -> ApiResult<(u64, ByteStream)> {
        self.batch_output_of(&caller.tenant, id, task, path).await
    }

    async fn cancel_batch(&self, caller: &Principal, id: &str) -> ApiResult<Batch> {
        self.cancel_batch_of(&caller.tenant, id).await
    }

    async fn purge_batch(&self, caller: &Principal, id: &str) -> ApiResult<()> {
        self.purge_batch_of(&caller.tenant, id).await
    }

    async fn get_sandbox(&self, caller: &Principal, id: &str) -> ApiResult<Sandbox> {
        self.owned(caller, id).await?;
        self.record(id).await
    }

    async fn list_sandboxes(
        &self,
        caller: &Principal,
        labels: BTreeMap<String, String>,
    ) -> ApiResult<SandboxList> {
        let mut sandboxes = self.records.filter(|s| {
            s.tenant == caller.tenant && labels.iter().all(|(k, v)| s.labels.get(k) == Some(v))
        });
        sandboxes.sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.id.cmp(&b.id)));
        Ok(SandboxList { sandboxes })
    }

    async fn delete_sandbox(&self, caller: &Principal, id: &str) -> ApiResult<()> {
        self.owned(caller, id).await?;
        let id = id.to_string();
        self.to_end(move |me| async move { me.delete_sandbox_to_end(&id).await })
            .await
    }

    async fn fork_sandbox(
        &self,
        caller: &Principal,
        id: &str,
        req: ForkRequest,
    ) -> ApiResult<ForkResult> {
        self.owned(caller, id).await?;
        // The capture is an image, as a commit's.
        caller.require(dsec_iam::Scope::Images)?;
        let (id, tenant) = (id.to_string(), caller.tenant.clone());
        self.to_end(move |me| async move { me.fork_sandbox_to_end(&tenant, &id, req).await })
            .await
    }

    async fn pause_sandbox(&self, caller: &Principal, id: &str) -> ApiResult<PauseResult> {
        self.owned(caller, id).await?;
        let id = id.to_string();
        self.to_end(move |me| async move { me.pause_sandbox_to_end(&id).await })
            .await
    }

    async fn resume_sandbox(&self, caller: &Principal, id: &str) -> ApiResult<Sandbox> {
        self.owned(caller, id).await?;
        let id = id.to_string();
        self.to_end(move |me| async move { me.resume_sandbox_to_end(&id).await })
            .await
    }

    async fn gc_images(&self, caller: &Principal, req: GcRequest) -> ApiResult<GcResult> {
        caller.require(dsec_iam::Scope::Images)?;
        self.to_end(move |me| async move { me.gc_images_to_end(req).await })
            .await
    }

    async fn build_image(&self, caller: &Principal, req: BuildRequest) -> ApiResult<BuildResult> {
        caller.require(dsec_iam::Scope::Images)?;
        let caller = caller.clone();
        self.to_end(move |me| async move { me.build_image_to_end(&caller, req).await })
            .await
    }

    async fn commit_sandbox(
        &self,
        caller: &Principal,
        id: &str,
        req: CommitRequest,
    ) -> ApiResult<Image> {
        self.owned(caller, id).await?;
        // The image it makes is cluster-wide, like any other.
        caller.require(dsec_iam::Scope::Images)?;
        let id = id.to_string();
        self.to_end(move |me| async move { me.commit_sandbox_to_end(&id, req).await })
            .await
    }

    async fn suspend_job(&self, caller: &Principal, job: &str) -> ApiResult<JobResult> {
        let job = job.to_string();
        let tenant = caller.tenant.clone();
        self.to_end(move |me| async move { me.suspend_job_to_end(&tenant, &job).await })
            .await
    }

    async fn resume_job(&self, caller: &Principal, job: &str) -> ApiResult<JobResult> {
        let job = job.to_string();
        let tenant = caller.tenant.clone();
        self.to_end(move |me| async move { me.resume_job_to_end(&tenant, &job).await })
            .await
    }

    async fn set_network(
        &self,
        caller: &Principal,
        id: &str,
        policy: NetworkPolicy,
    ) -> ApiResult<Sandbox> {
        self.owned(caller, id).await?;
        let id = id.to_string();
        self.to_end(move |me| async move { me.set_network_to_end(&id, policy).await })
            .await
    }

    async fn screenshot(&self, caller: &Principal, id: &str) -> ApiResult<Bytes> {
        self.owned(caller, id).await?;
        self.guarded(id, Some(Limit::call()), async {
            self.usable(id).await?.screenshot(id).await
        })
        .await
    }

    async fn send_input(
        &self,
        caller: &Principal,
        id: &str,
        req: dsec_wire::v1::InputRequest,
    ) -> ApiResult<()> {
        self.owned(caller, id).await?;
        // Typing is paced (a few ms a key): no call limit on a long text.
        self.guarded(id, None, async {
            self.usable(id).await?.send_input(id, req.events).await
        })
        .await
    }

    async fn set_timeout(
        &self,
        caller: &Principal,
        id: &str,
        req: SetTimeoutRequest,
    ) -> ApiResult<Sandbox> {
        self.owned(caller, id).await?;
        let id = id.to_string();
        self.to_end(move |me| async move { me.set_timeout_to_end(&id, req).await })
            .await
    }

    async fn exec(&self, caller: &Principal, id: &str, req: ExecRequest) -> ApiResult<ExecResult> {
        self.owned(caller, id).await?;
        let limit = ms_from_s("timeout_s", req.timeout_s)?.map(Limit::exec);
        let spec = Self::exec_spec(&req, false)?;
        let stdin = req.stdin.map(Bytes::from);
        let result = self
            .guarded(id, limit, async {
                let node = self.usable(id).await?;
                match &req.request_id {
                    Some(rid) => node.exec_recorded(id, rid, spec, stdin).await,
                    None => node.exec(id, spec, stdin).await,
                }
            })
            .instrument(tracing::info_span!("exec", sandbox = %id))
            .await?;
        let request_id = dsec_node_api::request_id::current();
        self.note_exit(id, &req.cmd, &result.exit, result.oom_killed, request_id);
        Ok(result)
    }

    async fn exec_stream(
        &self,
        caller: &Principal,
        id: &str,
        req: ExecRequest,
    ) -> ApiResult<EventStream> {
        self.owned(caller, id).await?;
        let limit = ms_from_s("timeout_s", req.timeout_s)?.map(Limit::exec);
        let spec = Self::exec_spec(&req, true)?;
        let stdin = req.stdin.map(Bytes::from);
        let events = self
            .guarded(id, limit.clone(), async {
                let node = self.usable(id).await?;
                match &req.request_id {
                    Some(rid) => node.exec_stream_recorded(id, rid, spec, stdin).await,
                    None => node.exec_stream(id, spec, stdin).await,
                }
            })
            .instrument(tracing::info_span!("exec_stream", sandbox = %id))
            .await?;
        let me = self.me.clone();
        let (sandbox, command) = (id.to_string(), req.cmd.clone());
        let request_id = dsec_node_api::request_id::current();
        let events = events
            .inspect(move |event| {
                if let (ExecEvent::Exit { exit, oom_killed }, Some(me)) = (event, me.upgrade()) {
                    me.note_exit(&sandbox, &command, exit, *oom_killed, request_id.clone());
                }
            })
            .boxed();
        Ok(self.watched(id, events, limit, |error| ExecEvent::Error { error }))
    }

    async fn call_log(
        &self,
        caller: &Principal,
        id: &str,
        query: CallLogQuery,
    ) -> ApiResult<CallLog> {
        self.owned(caller, id).await?;
        let node = self.node_of(&self.ready(id).await.or_else(|e| {
            // A paused sandbox's log is readable: it is the node's, not the agent's.
            match self.records.get(id) {
                Some(sb) if e.code == ErrorCode::Paused => Ok(sb),
                _ => Err(e),
            }
        })?)?;
        node.call_log(id, &query).await
    }

    async fn create_session(
        &self,
        caller: &Principal,
        id: &str,
        req: CreateSessionRequest,
    ) -> ApiResult<SessionInfo> {
        self.owned(caller, id).await?;
        validate::env(&req.env)?;
        let session = req
            .session
            .unwrap_or_else(|| format!("s-{:08x}", rand::thread_rng().gen::<u32>()));
        if session.is_empty()
            || session.len() > 128
            || !session
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                "session id must be 1-128 characters of [A-Za-z0-9._-]",
            ));
        }
        match self
            .call(
                id,
                Request::SessionCreate {
                    session,
                    env: req.env,
                    cwd: req.cwd,
                    user: req.user,
                },
            )
            .await?
        {
            Reply::SessionCreated { session, pid } => Ok(SessionInfo {
                session,
                pid,
                busy: false,
            }),
            other => Err(unexpected(other)),
        }
    }

    async fn list_sessions(&self, caller: &Principal, id: &str) -> ApiResult<SessionList> {
        self.owned(caller, id).await?;
        match self.call(id, Request::SessionList).await? {
            Reply::Sessions { sessions } => Ok(SessionList { sessions }),
            other => Err(unexpected(other)),
        }
    }

    async fn run_in_session(
        &self,
        caller: &Principal,
        id: &str,
        session: &str,
        req: SessionRunRequest,
    ) -> ApiResult<SessionResult> {
        self.owned(caller, id).await?;
        let timeout_ms = ms_from_s("timeout_s", req.timeout_s)?;
        let r = Request::SessionRun {
            session: session.to_string(),
            command: req.command,
            timeout_ms,
        };
        // Without a timeout the command may run as long as it likes: the watchdog only.
        let reply = match &req.request_id {
            Some(rid) => {
                validate::request_id(rid)?;
                self.call_recorded(id, rid, r, timeout_ms.map(Limit::session))
                    .await?
            }
            None => {
                self.call_within(id, r, timeout_ms.map(Limit::session))
                    .await?
            }
        };
        match reply {
            Reply::SessionResult(res) => Ok(res),
            other => Err(unexpected(other)),
        }
    }

    async fn interrupt_session(
        &self,
        caller: &Principal,
        id: &str,
        session: &str,
    ) -> ApiResult<()> {
        self.owned(caller, id).await?;
        self.call_ok(
            id,
            Request::SessionInterrupt {
                session: session.to_string(),
            },
        )
        .await
    }

    async fn close_session(&self, caller: &Principal, id: &str, session: &str) -> ApiResult<()> {
        self.owned(caller, id).await?;
        self.call_ok(
            id,
            Request::SessionClose {
                session: session.to_string(),
            },
        )
        .await
    }

    async fn start_process(
        &self,
        caller: &Principal,
        id: &str,
        req: StartProcessRequest,
    ) -> ApiResult<ProcessInfo> {
        self.owned(caller, id).await?;
        let as_exec = ExecRequest {
            cmd: req.cmd.clone(),
            env: req.env.clone(),
            cwd: req.cwd.clone(),
            stdin: None,
            timeout_s: req.timeout_s,
            output_limit: None,
            user: req.user.clone(),
            request_id: None,
        };
        validate::exec(&as_exec)?;
        let spec = ProcessSpec {
            cmd: req.cmd,
            env: req.env,
            cwd: req.cwd,
            pty: req.pty,
            tag: req.tag,
            output_limit: None,
            timeout_ms: ms_from_s("timeout_s", req.timeout_s)?,
            user: req.user,
        };
        let start = Request::ProcessStart(spec);
        let reply = match &req.request_id {
            Some(rid) => {
                validate::request_id(rid)?;
                self.call_recorded(id, rid, start, Some(Limit::call()))
                    .await?
            }
            None => self.call(id, start).await?,
        };
        match reply {
            Reply::ProcessStarted(info) => Ok(info),
            other => Err(unexpected(other)),
        }
    }

    async fn list_processes(&self, caller: &Principal, id: &str) -> ApiResult<ProcessList> {
        self.owned(caller, id).await?;
        match self.call(id, Request::ProcessList).await? {
            Reply::Processes { processes } => Ok(ProcessList { processes }),
            other => Err(unexpected(other)),
        }
    }

    async fn process_output(
        &self,
        caller: &Principal,
        id: &str,
        pid: u32,
        stdout_offset: u64,
        stderr_offset: u64,
        follow: bool,
    ) -> ApiResult<EventStream> {
        self.owned(caller, id).await?;
        let events = self
            .guarded(id, Some(Limit::call()), async {
                let node = self.usable(id).await?;
                node.process_output(id, pid, stdout_offset, stderr_offset, follow)
                    .await
            })
            .await?;
        Ok(self.watched(id, events, None, |error| ExecEvent::Error { error }))
    }

    async fn process_stdin(
        &self,
        caller: &Principal,
        id: &str,
        pid: u32,
        req: StdinRequest,
    ) -> ApiResult<()> {
        self.owned(caller, id).await?;
        self.guarded(id, Some(Limit::call()), async {
            let node = self.usable(id).await?;
            node.process_stdin(id, pid, Bytes::from(req.data.into_bytes()), req.close)
                .await
        })
        .await
    }

    async fn signal_process(
        &self,
        caller: &Principal,
        id: &str,
        pid: u32,
        req: SignalRequest,
    ) -> ApiResult<()> {
        self.owned(caller, id).await?;
        let signal = validate::signal(&req.signal)?;
        self.call_ok(id, Request::ProcessSignal { pid, signal })
            .await
    }

    async fn resize_process(
        &self,
        caller: &Principal,
        id: &str,
        pid: u32,
        size: PtySize,
    ) -> ApiResult<()> {
        self.owned(caller, id).await?;
        if size.rows == 0 || size.cols == 0 {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                "rows and cols must be positive",
            ));
        }
        self.call_ok(id, Request::ProcessResize { pid, size }).await
    }

    async fn read_file(
        &self,
        caller: &Principal,
        id: &str,
        path: &str,
        offset: u64,
        length: Option<u64>,
    ) -> ApiResult<(FileInfo, ByteStream)> {
        self.owned(caller, id).await?;
        self.read_file_of(id, path, offset, length).await
    }

    async fn write_file(
        &self,
        caller: &Principal,
        id: &str,
        path: &str,
        mode: Option<u32>,
        body: ByteStream,
        request_id: Option<&str>,
    ) -> ApiResult<WriteResult> {
        self.owned(caller, id).await?;
        validate::sandbox_path("path", path)?;
        if let Some(rid) = request_id {
            validate::request_id(rid)?;
        }
        // As long as the client sends: the watchdog only.
        let written = self
            .guarded(id, None, async {
                let node = self.usable(id).await?;
                match request_id {
                    Some(rid) => {
                        let req = Request::FileWrite {
                            path: path.to_string(),
                            mode,
                            create_parents: true,
                        };
                        node.upload_recorded(id, rid, req, body).await
                    }
                    None => node.write_file(id, path, mode, body).await,
                }
            })
            .await;
        self.note_no_space(id, path, &written);
        written
    }

    async fn list_files(&self, caller: &Principal, id: &str, path: &str) -> ApiResult<FileList> {
        self.owned(caller, id).await?;
        validate::sandbox_path("path", path)?;
        match self
            .call(
                id,
                Request::FileList {
                    path: path.to_string(),
                },
            )
            .await?
        {
            Reply::Entries { entries } => Ok(FileList { entries }),
            other => Err(unexpected(other)),
        }
    }

    async fn stat_file(&self, caller: &Principal, id: &str, path: &str) -> ApiResult<FileInfo> {
        self.owned(caller, id).await?;
        validate::sandbox_path("path", path)?;
        match self
            .call(
                id,
                Request::FileStat {
                    path: path.to_string(),
                },
            )
            .await?
        {
            Reply::File(info) => Ok(info),
            other => Err(unexpected(other)),
        }
    }

    async fn mkdir(&self, caller: &Principal, id: &str, req: MkdirRequest) -> ApiResult<()> {
        self.owned(caller, id).await?;
        validate::sandbox_path("path", &req.path)?;
        self.call_ok(id, Request::FileMkdir { path: req.path })
            .await
    }

    async fn remove_file(
        &self,
        caller: &Principal,
        id: &str,
        path: &str,
        recursive: bool,
    ) -> ApiResult<()> {
        self.owned(caller, id).await?;
        validate::sandbox_path("path", path)?;
        self.call_ok(
            id,
            Request::FileRemove {
                path: path.to_string(),
                recursive,
            },
        )
        .await
    }

    async fn rename_file(&self, caller: &Principal, id: &str, req: RenameRequest) -> ApiResult<()> {
        self.owned(caller, id).await?;
        validate::sandbox_path("from", &req.from)?;
        validate::sandbox_path("to", &req.to)?;
        self.call_ok(
            id,
            Request::FileRename {
                from: req.from,
                to: req.to,
            },
        )
        .await
    }

    async fn download_tar(
        &self,
        caller: &Principal,
        id: &str,
        path: &str,
    ) -> ApiResult<ByteStream> {
        self.owned(caller, id).await?;
        validate::sandbox_path("path", path)?;
        let bytes = self
            .guarded(id, Some(Limit::call()), async {
                let node = self.usable(id).await?;
                node.download_tar(id, path).await
            })
            .await?;
        Ok(self.watched(id, bytes, None, Err))
    }

    async fn upload_tar(
        &self,
        caller: &Principal,
        id: &str,
        path: &str,
        body: ByteStream,
        request_id: Option<&str>,
    ) -> ApiResult<WriteResult> {
        self.owned(caller, id).await?;
        validate::sandbox_path("path", path)?;
        if let Some(rid) = request_id {
            validate::request_id(rid)?;
        }
        let written = self
            .guarded(id, None, async {
                let node = self.usable(id).await?;
                match request_id {
                    Some(rid) => {
                        let req = Request::TarUpload {
                            path: path.to_string(),
                        };
                        node.upload_recorded(id, rid, req, body).await
                    }
                    None => node.upload_tar(id, path, body).await,
                }
            })
            .await;
        self.note_no_space(id, path, &written);
        written
    }

    async fn list_images(&self, caller: &Principal) -> ApiResult<ImageList> {
        // Images are cluster-wide: any key may see them.
        let _ = caller;
        let mut images = self.nodes.any()?.list_images().await?;
        images.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(ImageList { images })
    }

    async fn get_image(&self, caller: &Principal, name: &str) -> ApiResult<Image> {
        let _ = caller;
        self.nodes.any()?.image(name).await
    }

    async fn import_image(&self, caller: &Principal, req: ImportImageRequest) -> ApiResult<Image> {
        caller.require(dsec_iam::Scope::Images)?;
        self.to_end(move |me| async move { me.import_image_to_end(req).await })
            .await
    }

    async fn import_image_stream(
        &self,
        caller: &Principal,
        req: ImportImageRequest,
    ) -> ApiResult<ImportStream> {
        caller.require(dsec_iam::Scope::Images)?;
        let source = images::import_source(&req)?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let progress_tx = tx.clone();
        let sink: ImportProgressSink = Arc::new(move |ev| {
            let _ = progress_tx.send(ev);
        });
        let node = self.nodes.any()?;
        // The import runs to its end even if the client goes away: it then either stores
        // the image or leaves nothing behind.
        tokio::spawn(async move {
            let end = match node
                .import_image(
                    &req.name,
                    ImportSource::NodePath(source),
                    req.flatten,
                    Some(sink),
                )
                .await
            {
                Ok(image) => ImportEvent::Done { image },
                Err(e) => ImportEvent::Error { error: e },
            };
            let _ = tx.send(end);
        });
        Ok(Box::pin(
            tokio_stream::wrappers::UnboundedReceiverStream::new(rx),
        ))
    }

    async fn pull_image_stream(
        &self,
        caller: &Principal,
        req: PullImageRequest,
    ) -> ApiResult<ImportStream> {
        caller.require(dsec_iam::Scope::Images)?;
        pull::pull_stream(self.nodes.any()?, req).await
    }

    async fn build_dockerfile(
        &self,
        caller: &Principal,
        req: DockerfileBuildRequest,
        context: std::fs::File,
    ) -> ApiResult<crate::api::BuildStream> {
        caller.require(dsec_iam::Scope::Images)?;
        let me = self
            .me
            .upgrade()
            .ok_or_else(|| internal("the control plane is shutting down"))?;
        let node = self.nodes.any()?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let caller = caller.clone();
        // The build stops at its next step once the client is gone (the stream dropped),
        // and deletes its sandboxes on every path.
        tokio::spawn(async move {
            let end = match crate::build::dockerfile::build(
                &*me,
                &caller,
                node,
                req,
                context,
                tx.clone(),
            )
            .await
            {
                Ok(b) => BuildEvent::Done {
                    image: b.image,
                    steps: b.steps,
                    cached: b.cached,
                },
                Err(error) => BuildEvent::Error { error },
            };
            let _ = tx.send(end);
        });
        Ok(Box::pin(
            tokio_stream::wrappers::UnboundedReceiverStream::new(rx),
        ))
    }

    async fn upload_image(
        &self,
        caller: &Principal,
        name: &str,
        flatten: bool,
        body: ByteStream,
    ) -> ApiResult<Image> {
        caller.require(dsec_iam::Scope::Images)?;
        // Not run to its end without the caller: the body is the caller's connection.
        self.nodes
            .any()?
            .import_image(name, ImportSource::Archive(body), flatten, None)
            .await
    }

    async fn layer_stats(&self, caller: &Principal) -> ApiResult<LayerStatsList> {
        // Images are cluster-wide: any key may see them.
        let _ = caller;
        self.nodes.any()?.layer_stats().await
    }

    async fn utilization(&self, caller: &Principal) -> ApiResult<dsec_wire::v1::Utilization> {
        // Counts over every tenant, no names: any key may see them, as the health.
        let _ = caller;
        Ok(self.utilization.snapshot())
    }

    async fn create_phase_stats(
        &self,
        caller: &Principal,
    ) -> ApiResult<dsec_wire::v1::CreatePhaseStats> {
        // Counts over every tenant's creates, no names: any key may see them, as the
        // rest of /metrics.
        let _ = caller;
        Ok(self.create_stats.snapshot())
    }

    async fn list_nodes(&self, caller: &Principal) -> ApiResult<ClusterNodeList> {
        operator(caller)?;
        self.nodes.describe().await
    }

    async fn drain_node(
        &self,
        caller: &Principal,
        name: &str,
        drain: bool,
    ) -> ApiResult<ClusterNode> {
        operator(caller)?;
        let node = self.nodes.drain(name, drain).await?;
        let kind = match drain {
            true => EventKind::NodeDrained,
            false => EventKind::NodeUndrained,
        };
        self.events.emit(events::about_node(name, kind, None)).await;
        Ok(node)
    }

    async fn delete_image(&self, caller: &Principal, name: &str) -> ApiResult<()> {
        caller.require(dsec_iam::Scope::Images)?;
        let name = name.to_string();
        self.to_end(move |me| async move { me.delete_image_to_end(&name).await })
            .await
    }
}

/// Keeps `agent` in the dependency graph explicit for readers: the protocol version this
/// control plane speaks.
pub const AGENT_PROTOCOL: u32 = agent::PROTOCOL_VERSION;

//! Batch jobs: many tasks, each run in a sandbox of its own, with inputs placed from the
//! blob store and outputs collected to it, verified (see [`dsec_wire::v1::BatchSpec`]).
//!
//! State lives in the store: the batch under `batches/<id>` (written last at submit, so
//! a batch is seen whole or not at all), each task under `batch-tasks.<id>/<task>`. Every
//! step of a task is a compare-and-swap on its key, written *before* the step acts, so a
//! runner that restarts (or a replica that takes a batch over) finds each task where it
//! was and knows what may be left of it:
//!
//! - `creating`, `initialized`, `running`: the attempt was interrupted. Its sandbox
//!   (found by label, `dsec-batch-task=<task>.<attempt>`) is deleted first, then the task
//!   goes back to `pending` for a new attempt, not counted as a failure. The old
//!   attempt's sandbox is gone before the new one starts, so a command never runs twice
//!   at once.
//! - `collecting`: the agent's hashes (phase one) are in the record; outputs already in
//!   the blob store are hashed again and kept if they match, the rest are copied again
//!   from the sandbox if it is alive, else the attempt starts over.
//!
//! A batch is run by one runner: the sole owner's, or on API server replicas the one
//! whose lease holds `batch-owners/<id>` (the survivor takes over when it dies).

use std::collections::BTreeSet;
use std::io::Write;

use dsec_blob::BlobStore;
use serde::{Deserialize, Serialize};
use sha2::Digest;
use tokio_util::sync::CancellationToken;

use super::*;

mod runner;

pub(super) const NS_BATCHES: &str = "batches";
const NS_BATCH_OWNERS: &str = "batch-owners";
/// Tasks running at once when the spec does not say.
const DEFAULT_PARALLELISM: u32 = 8;
const DEFAULT_TASK_TIMEOUT_S: u64 = 600;
/// Lifetime a task's sandbox gets beyond its command's timeout, for the collection.
const COLLECT_MARGIN_S: u64 = 600;
const DEFAULT_RETRIES: u32 = 2;
/// How long a task's create waits for capacity before it is tried again.
const CREATE_MAX_WAIT_S: f64 = 120.0;
/// Pause before a create that found no capacity is tried again.
const REQUEUE_DELAY: Duration = Duration::from_secs(1);
/// Bytes read from the blob store per request when an input is placed.
const INPUT_CHUNK: u64 = 4 << 20;
/// How often replicas look for batches to run or cancel.
const SYNC_INTERVAL: Duration = Duration::from_secs(1);

/// The running batches of this plane: their cancel handles.
pub(super) type Batches = std::sync::Mutex<HashMap<String, CancellationToken>>;

/// A batch as stored.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct StoredBatch {
    id: String,
    name: Option<String>,
    /// Who submitted it: every sandbox call of its tasks is made as them.
    principal: Principal,
    state: BatchState,
    created_at_ms: u64,
    ended_at_ms: Option<u64>,
    total: u64,
    parallelism: u32,
    priority: Priority,
    template: CreateSandboxRequest,
    image: Option<String>,
    image_digest: Option<String>,
    layers: Vec<String>,
}

/// A task as stored: what it runs, where it is, and phase one of its collection.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct StoredTask {
    spec: ResolvedTask,
    status: TaskStatus,
    /// The agent's sha256 and size of each output of the attempt being collected.
    #[serde(default)]
    hashed: BTreeMap<String, (String, u64)>,
}

/// A task record and the store revision it was read at.
struct TaskRec {
    task: StoredTask,
    rev: dsec_state::Revision,
}

/// What a runner of one batch carries to its tasks.
struct BatchCtx {
    batch: StoredBatch,
    store: Arc<dyn BlobStore>,
    cancel: CancellationToken,
}

/// Why a task's worker stops before its task ends: the record changed under it (another
/// runner has it) or the store is out of reach (a later runner picks it up).
#[derive(Debug)]
struct Stop(String);

type Step = Result<(), Stop>;

fn tasks_ns(batch: &str) -> String {
    format!("batch-tasks.{batch}")
}

fn new_batch_id() -> String {
    format!("bt-{}", &new_id()[3..])
}

fn hex_sha256(data: &[u8]) -> String {
    format!("{:x}", sha2::Sha256::digest(data))
}

fn bad(msg: String) -> ApiError {
    ApiError::new(ErrorCode::BadRequest, msg)
}

/// Key of a tenant's uploaded input `key` in the blob store.
fn input_key(tenant: &str, key: &str) -> String {
    format!("tenants/{tenant}/inputs/{key}")
}

/// Prefix of everything a batch writes to the blob store.
fn batch_prefix(b: &StoredBatch) -> String {
    format!("tenants/{}/batches/{}", b.principal.tenant, b.id)
}

/// Runs blocking blob-store work off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> dsec_blob::Result<T> + Send + 'static,
) -> ApiResult<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(internal)?
        .map_err(blob_err)
}

fn blob_err(e: dsec_blob::BlobError) -> ApiError {
    match e {
        dsec_blob::BlobError::NotFound { .. } => ApiError::new(ErrorCode::NotFound, e.to_string()),
        dsec_blob::BlobError::InvalidKey { .. } => bad(e.to_string()),
        e => ApiError::new(ErrorCode::Unavailable, format!("blob store: {e}")),
    }
}

impl ControlPlane {
    fn batch_store(&self) -> ApiResult<Arc<dyn BlobStore>> {
        self.cfg.batch_store.clone().ok_or_else(|| {
            ApiError::new(
                ErrorCode::BadRequest,
                "batches need a blob store: this server has none (dsec serve keeps one in \
                 its state directory, or uses --blob-store)",
            )
        })
    }

    /// `PUT /v1/inputs/{key}`: stores an input for later batches of the caller's tenant.
    pub(super) async fn put_input_of(
        &self,
        tenant: &str,
        key: &str,
        mut body: ByteStream,
    ) -> ApiResult<InputObject> {
        let store = self.batch_store()?;
        let full = input_key(tenant, key);
        dsec_blob::validate_key(&full).map_err(blob_err)?;
        let mut tmp = tempfile::NamedTempFile::new().map_err(internal)?;
        let mut hasher = sha2::Sha256::new();
        let mut bytes = 0u64;
        while let Some(chunk) = body.next().await {
            let chunk = chunk?;
            hasher.update(&chunk);
            bytes += chunk.len() as u64;
            tmp.write_all(&chunk).map_err(internal)?;
        }
        tmp.flush().map_err(internal)?;
        let path = tmp.into_temp_path();
        let up = full.clone();
        blocking(move || store.upload(&up, &path)).await?;
        Ok(InputObject {
            key: key.to_string(),
            sha256: format!("{:x}", hasher.finalize()),
            bytes,
        })
    }

    /// `POST /v1/batches`: checks the whole spec, stores inputs and tasks, then the
    /// batch, and starts it.
    pub(super) async fn submit_batch_of(
        &self,
        principal: &Principal,
        spec: BatchSpec,
    ) -> ApiResult<Batch> {
        let store = self.batch_store()?;
        let parallelism = spec.parallelism.unwrap_or(DEFAULT_PARALLELISM);
        if parallelism == 0 || parallelism > MAX_PARALLELISM {
            return Err(bad(format!(
                "parallelism must be in [1, {MAX_PARALLELISM}], got {parallelism}"
            )));
        }
        if spec.tasks.is_empty() {
            return Err(bad("a batch needs at least one task".into()));
        }
        if spec.tasks.len() > MAX_BATCH_TASKS {
            return Err(bad(format!(
                "{} tasks: a batch holds at most {MAX_BATCH_TASKS}",
                spec.tasks.len()
            )));
        }
        if let Some(name) = &spec.name {
            if name.len() > 256 {
                return Err(bad("name: at most 256 bytes".into()));
            }
        }
        let mut template = spec.template.clone();
        for k in template.labels.keys() {
            if k == BATCH_LABEL || k == BATCH_TASK_LABEL {
                return Err(bad(format!("template.labels: {k:?} is set by batches")));
            }
        }
        if template.pool.is_none() {
            // Checked like any create (the image, limits, policy) before a task runs.
            validate::create(&template)?;
        }
        template.idempotency_key = None;
        let (image, image_digest, layers) = self.batch_image(principal, &template).await?;

        let id = new_batch_id();
        let batch = StoredBatch {
            id: id.clone(),
            name: spec.name.clone(),
            principal: principal.clone(),
            state: BatchState::Running,
            created_at_ms: now_ms(),
            ended_at_ms: None,
            total: spec.tasks.len() as u64,
            parallelism,
            priority: spec.priority,
            template,
            image,
            image_digest,
            layers,
        };
        let tasks = self.resolve_tasks(&batch, &spec, &store).await?;
        let ns = tasks_ns(&id);
        for chunk in tasks.chunks(dsec_state::MAX_TXN_OPS) {
            let mut ops = Vec::with_capacity(chunk.len());
            for t in chunk {
                ops.push(dsec_state::Op::Put {
                    ns: ns.clone(),
                    key: t.status.id.clone(),
                    value: serde_json::to_vec(t).map_err(internal)?,
                    lease: None,
                });
            }
            self.apply(ops).await?;
        }
        let value = serde_json::to_vec(&batch).map_err(internal)?;
        self.store
            .put(NS_BATCHES, &id, &value, dsec_state::Expect::Absent)
            .await
            .map_err(store_err)?;
        tracing::info!(batch = %id, tenant = %principal.tenant, tasks = batch.total, "batch submitted");
        let counts = counts_of(tasks.iter().map(|t| t.status.state));
        let view = batch_view(&batch, counts);
        self.start_batch_if_owner(&id).await;
        Ok(view)
    }

    /// The image a batch's tasks run, its digest and layers (for the manifest).
    async fn batch_image(
        &self,
        principal: &Principal,
        template: &CreateSandboxRequest,
    ) -> ApiResult<(Option<String>, Option<String>, Vec<String>)> {
        let name = match &template.pool {
            Some(pool) => self.get_pool(principal, pool).await?.spec.template.image,
            None => template.image.clone(),
        };
        let name = name.unwrap_or_else(|| self.cfg.default_image.clone());
        match self.nodes.any()?.image(&name).await {
            Ok(img) => Ok((Some(name), Some(img.digest), img.layers)),
            Err(e) if e.code == ErrorCode::ImageNotFound || e.code == ErrorCode::NotFound => {
                Err(ApiError::new(
                    ErrorCode::ImageNotFound,
                    format!("template: image {name:?} not found"),
                ))
            }
            // A cluster whose nodes do not all hold the image still runs the batch.
            Err(_) => Ok((Some(name), None, Vec::new())),
        }
    }

    /// Each task with the batch's defaults applied and its inputs in the blob store.
    async fn resolve_tasks(
        &self,
        batch: &StoredBatch,
        spec: &BatchSpec,
        store: &Arc<dyn BlobStore>,
    ) -> ApiResult<Vec<StoredTask>> {
        let d = &spec.defaults;
        let mut seen = BTreeSet::new();
        // Uploaded inputs are hashed once however many tasks name them.
        let mut digests: HashMap<String, InputDigest> = HashMap::new();
        let mut out = Vec::with_capacity(spec.tasks.len());
        for t in &spec.tasks {
            let at = |msg: String| bad(format!("task {:?}: {msg}", t.id));
            let within =
                |e: ApiError| ApiError::new(e.code, format!("task {:?}: {}", t.id, e.message));
            if !valid_task_id(&t.id) {
                return Err(at("ids are 1-128 of [A-Za-z0-9._-]".into()));
            }
            if !seen.insert(t.id.as_str()) {
                return Err(at("id used twice".into()));
            }
            let command = t
                .command
                .as_ref()
                .or(d.command.as_ref())
                .ok_or_else(|| at("no command (none in the task or the defaults)".into()))?
                .to_argv();
            if command.is_empty() || command[0].is_empty() {
                return Err(at("empty command".into()));
            }
            let mut env = d.env.clone();
            env.extend(t.env.clone());
            validate::env(&env).map_err(within)?;
            let outputs = t.outputs.clone().unwrap_or_else(|| d.outputs.clone());
            if outputs.len() > MAX_TASK_FILES || t.inputs.len() > MAX_TASK_FILES {
                return Err(at(format!("at most {MAX_TASK_FILES} inputs and outputs")));
            }
            let mut unique = BTreeSet::new();
            for p in &outputs {
                sandbox_file_path("outputs", p).map_err(within)?;
                if !unique.insert(p) {
                    return Err(at(format!("output {p} named twice")));
                }
            }
            let timeout_s = t
                .timeout_s
                .or(d.timeout_s)
                .unwrap_or(DEFAULT_TASK_TIMEOUT_S);
            if timeout_s == 0 || timeout_s > MAX_TIMEOUT_S {
                return Err(at(format!("timeout_s must be in [1, {MAX_TIMEOUT_S}]")));
            }
            let retries = t.retries.or(d.retries).unwrap_or(DEFAULT_RETRIES);
            if retries > 10 {
                return Err(at("retries: at most 10".into()));
            }
            let mut inputs = BTreeMap::new();
            for (path, input) in &t.inputs {
                sandbox_file_path("inputs", path).map_err(within)?;
                let in_path = |e: ApiError| {
                    within(ApiError::new(
                        e.code,
                        format!("input {path}: {}", e.message),
                    ))
                };
                let digest = match input {
                    InputRef::Blob(key) => match digests.get(key) {
                        Some(d) => d.clone(),
                        None => {
                            let d = self
                                .uploaded_input(&batch.principal.tenant, key, store)
                                .await
                                .map_err(in_path)?;
                            digests.insert(key.clone(), d.clone());
                            d
                        }
                    },
                    InputRef::Data(data) => self
                        .inline_input(batch, &data.0, store)
                        .await
                        .map_err(in_path)?,
                    InputRef::Text(text) => self
                        .inline_input(batch, text.as_bytes(), store)
                        .await
                        .map_err(in_path)?,
                };
                inputs.insert(path.clone(), digest);
            }
            out.push(StoredTask {
                spec: ResolvedTask {
                    command,
                    env,
                    cwd: t.cwd.clone().or_else(|| d.cwd.clone()),
                    inputs,
                    outputs,
                    timeout_s,
                    retries,
                },
                status: TaskStatus::new(&t.id),
                hashed: BTreeMap::new(),
            });
        }
        Ok(out)
    }

    /// The digest of an uploaded input, which must exist.
    async fn uploaded_input(
        &self,
        tenant: &str,
        key: &str,
        store: &Arc<dyn BlobStore>,
    ) -> ApiResult<InputDigest> {
        let full = input_key(tenant, key);
        dsec_blob::validate_key(&full).map_err(blob_err)?;
        let s = store.clone();
        let k = full.clone();
        let (sha256, bytes) = blocking(move || hash_blob(&s, &k)).await?.ok_or_else(|| {
            ApiError::new(
                ErrorCode::NotFound,
                format!("blob {key:?} not found (upload it with PUT /v1/inputs/{key})"),
            )
        })?;
        Ok(InputDigest {
            key: full,
            sha256,
            bytes,
        })
    }

    /// Stores an inline input under the batch, by content.
    async fn inline_input(
        &self,
        batch: &StoredBatch,
        data: &[u8],
        store: &Arc<dyn BlobStore>,
    ) -> ApiResult<InputDigest> {
        if data.len() > MAX_INLINE_INPUT {
            return Err(ApiError::new(
                ErrorCode::PayloadTooLarge,
                format!(
                    "{} bytes inline: at most {MAX_INLINE_INPUT} (upload larger inputs with \
                     PUT /v1/inputs/{{key}})",
                    data.len()
                ),
            ));
        }
        let sha256 = hex_sha256(data);
        let key = format!("{}/inputs/{sha256}", batch_prefix(batch));
        let (s, k, d) = (store.clone(), key.clone(), data.to_vec());
        blocking(move || match s.head(&k)? {
            Some(_) => Ok(()),
            None => s.put(&k, &d),
        })
        .await?;
        Ok(InputDigest {
            key,
            sha256,
            bytes: data.len() as u64,
        })
    }

    /// Applies `ops` (at most [`dsec_state::MAX_TXN_OPS`]) in one transaction.
    async fn apply(&self, ops: Vec<dsec_state::Op>) -> ApiResult<()> {
        self.store
            .txn(dsec_state::Txn {
                checks: Vec::new(),
                ops,
            })
            .await
            .map(|_| ())
            .map_err(store_err)
    }

    /// Batch `id` as stored, and the revision it was read at.
    async fn read_batch(&self, id: &str) -> ApiResult<(StoredBatch, dsec_state::Revision)> {
        let entry = self
            .store
            .get(NS_BATCHES, id)
            .await
            .map_err(store_err)?
            .ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("batch {id} not found")))?;
        let batch = serde_json::from_slice(&entry.value).map_err(internal)?;
        Ok((batch, entry.rev))
    }

    /// Batch `id` of `tenant` (another tenant's is not found).
    async fn stored_batch(&self, tenant: &str, id: &str) -> ApiResult<StoredBatch> {
        let (batch, _) = self.read_batch(id).await?;
        if batch.principal.tenant != tenant {
            return Err(ApiError::new(
                ErrorCode::NotFound,
                format!("batch {id} not found"),
            ));
        }
        Ok(batch)
    }

    async fn stored_tasks(&self, id: &str) -> ApiResult<Vec<TaskRec>> {
        let (entries, _) = self.store.list(&tasks_ns(id)).await.map_err(store_err)?;
        let mut out = Vec::with_capacity(entries.len());
        for e in entries {
            let task: StoredTask = serde_json::from_slice(&e.value).map_err(internal)?;
            out.push(TaskRec { task, rev: e.rev });
        }
        out.sort_by(|a, b| a.task.status.id.cmp(&b.task.status.id));
        Ok(out)
    }

    /// `GET /v1/batches/{id}`.
    pub(super) async fn batch_of(&self, tenant: &str, id: &str) -> ApiResult<Batch> {
        let batch = self.stored_batch(tenant, id).await?;
        let tasks = self.stored_tasks(id).await?;
        Ok(batch_view(
            &batch,
            counts_of(tasks.iter().map(|t| t.task.status.state)),
        ))
    }

    /// `GET /v1/batches`.
    pub(super) async fn batches_of(&self, tenant: &str) -> ApiResult<BatchList> {
        let (entries, _) = self.store.list(NS_BATCHES).await.map_err(store_err)?;
        let mut batches = Vec::new();
        for e in entries {
            let Ok(b) = serde_json::from_slice::<StoredBatch>(&e.value) else {
                continue;
            };
            if b.principal.tenant == tenant {
                let tasks = self.stored_tasks(&b.id).await?;
                batches.push(batch_view(
                    &b,
                    counts_of(tasks.iter().map(|t| t.task.status.state)),
                ));
            }
        }
        batches.sort_by_key(|b| std::cmp::Reverse(b.created_at_ms));
        Ok(BatchList { batches })
    }

    /// `GET /v1/batches/{id}/tasks?state=&after=&limit=`.
    pub(super) async fn batch_tasks_of(
        &self,
        tenant: &str,
        id: &str,
        query: TaskListQuery,
    ) -> ApiResult<TaskList> {
        self.stored_batch(tenant, id).await?;
        let state = match &query.state {
            Some(s) => Some(TaskState::parse(s).ok_or_else(|| {
                bad(format!(
                    "state {s:?}: one of pending, creating, initialized, running, \
                     collecting, finalized, failed"
                ))
            })?),
            None => None,
        };
        let limit = query.limit.unwrap_or(1000).clamp(1, 10_000);
        let mut tasks: Vec<TaskStatus> = self
            .stored_tasks(id)
            .await?
            .into_iter()
            .map(|t| t.task.status)
            .filter(|t| state.is_none_or(|s| t.state == s))
            .filter(|t| {
                query
                    .after
                    .as_ref()
                    .is_none_or(|a| t.id.as_str() > a.as_str())
            })
            .take(limit + 1)
            .collect();
        let next = if tasks.len() > limit {
            tasks.truncate(limit);
            tasks.last().map(|t| t.id.clone())
        } else {
            None
        };
        Ok(TaskList { tasks, next })
    }

    /// `GET /v1/batches/{id}/manifest`.
    pub(super) async fn batch_manifest_of(&self, tenant: &str, id: &str) -> ApiResult<Manifest> {
        let batch = self.stored_batch(tenant, id).await?;
        let recs = self.stored_tasks(id).await?;
        let counts = counts_of(recs.iter().map(|t| t.task.status.state));
        let tasks = recs
            .into_iter()
            .map(|r| ManifestTask {
                spec: r.task.spec,
                status: r.task.status,
            })
            .collect();
        Ok(Manifest {
            batch: batch_view(&batch, counts),
            template: batch.template,
            layers: batch.layers,
            tasks,
        })
    }

    /// `GET /v1/batches/{id}/tasks/{task}/output?path=`: a collected output's bytes
    /// (or, with `snapshot`, the error snapshot's JSON).
    pub(super) async fn batch_output_of(
        &self,
        tenant: &str,
        id: &str,
        task: &str,
        path: Option<&str>,
    ) -> ApiResult<(u64, ByteStream)> {
        self.stored_batch(tenant, id).await?;
        let entry = self
            .store
            .get(&tasks_ns(id), task)
            .await
            .map_err(store_err)?
            .ok_or_else(|| {
                ApiError::new(
                    ErrorCode::NotFound,
                    format!("batch {id} has no task {task:?}"),
                )
            })?;
        let rec: StoredTask = serde_json::from_slice(&entry.value).map_err(internal)?;
        let key = match path {
            Some(p) => rec
                .status
                .outputs
                .get(p)
                .map(|o| o.key.clone())
                .ok_or_else(|| {
                    ApiError::new(
                        ErrorCode::NotFound,
                        format!(
                            "task {task:?} has no collected output {p} (state {})",
                            rec.status.state.as_str()
                        ),
                    )
                })?,
            None => rec.status.error_snapshot.clone().ok_or_else(|| {
                ApiError::new(
                    ErrorCode::NotFound,
                    format!("task {task:?} has no error snapshot"),
                )
            })?,
        };
        let store = self.batch_store()?;
        let (s, k) = (store.clone(), key.clone());
        let size = blocking(move || s.head(&k))
            .await?
            .ok_or_else(|| {
                ApiError::new(
                    ErrorCode::NotFound,
                    format!("{key} is gone from the blob store"),
                )
            })?
            .size;
        Ok((size, blob_chunks(store, key, size)))
    }

    /// `DELETE /v1/batches/{id}?purge=true`: forgets an ended batch: its tasks, its
    /// record, and everything it wrote to the blob store (inputs given inline, outputs,
    /// snapshots; uploaded inputs stay). A running batch must be cancelled first.
    pub(super) async fn purge_batch_of(&self, tenant: &str, id: &str) -> ApiResult<()> {
        let batch = self.stored_batch(tenant, id).await?;
        if batch.ended_at_ms.is_none() {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!(
                    "batch {id} is still running: cancel it (DELETE without purge) and purge \
                     it once it has ended"
                ),
            ));
        }
        let store = self.batch_store()?;
        let prefix = format!("{}/", batch_prefix(&batch));
        blocking(move || {
            for obj in store.list(&prefix)? {
                store.delete(&obj.key)?;
            }
            Ok(())
        })
        .await?;
        let ns = tasks_ns(id);
        let (entries, _) = self.store.list(&ns).await.map_err(store_err)?;
        for chunk in entries.chunks(dsec_state::MAX_TXN_OPS) {
            let ops = chunk
                .iter()
                .map(|e| dsec_state::Op::Delete {
                    ns: ns.clone(),
                    key: e.key.clone(),
                })
                .collect();
            self.apply(ops).await?;
        }
        self.store
            .delete(NS_BATCHES, id, dsec_state::Expect::Any)
            .await
            .map_err(store_err)?;
        tracing::info!(batch = %id, tenant, "batch purged");
        Ok(())
    }

    /// `DELETE /v1/batches/{id}`: cancels a running batch (its running tasks' sandboxes
    /// are deleted, and tasks not finished fail with `cancelled`).
    pub(super) async fn cancel_batch_of(&self, tenant: &str, id: &str) -> ApiResult<Batch> {
        loop {
            let (mut batch, rev) = self.read_batch(id).await?;
            if batch.principal.tenant != tenant {
                return Err(ApiError::new(
                    ErrorCode::NotFound,
                    format!("batch {id} not found"),
                ));
            }
            if batch.state != BatchState::Running {
                break;
            }
            batch.state = BatchState::Cancelled;
            let value = serde_json::to_vec(&batch).map_err(internal)?;
            match self
                .store
                .put(NS_BATCHES, id, &value, dsec_state::Expect::Rev(rev))
                .await
            {
                Ok(_) => break,
                Err(dsec_state::StateError::Conflict { .. }) => continue,
                Err(e) => return Err(store_err(e)),
            }
        }
        if let Some(token) = self.batches.lock().map_err(internal)?.get(id) {
            token.cancel();
        }
        self.batch_of(tenant, id).await
    }

    /// Starts the runners of unfinished batches this plane owns (all, for a sole
    /// owner), and cancels those cancelled elsewhere; every [`SYNC_INTERVAL`].
    pub(super) fn spawn_batch_sync(&self) {
        let me = self.me.clone();
        tokio::spawn(async move {
            loop {
                let Some(plane) = me.upgrade() else {
                    return;
                };
                if let Err(e) = plane.sync_batches_once().await {
                    tracing::debug!(error = %e.message, "looking for batches to run");
                }
                drop(plane);
                tokio::time::sleep(SYNC_INTERVAL).await;
            }
        });
    }

    async fn sync_batches_once(&self) -> ApiResult<()> {
        if self.cfg.batch_store.is_none() {
            return Ok(());
        }
        let (entries, _) = self.store.list(NS_BATCHES).await.map_err(store_err)?;
        for e in entries {
            let Ok(b) = serde_json::from_slice::<StoredBatch>(&e.value) else {
                continue;
            };
            if b.ended_at_ms.is_some() {
                continue;
            }
            let running = self.batches.lock().map_err(internal)?.get(&b.id).cloned();
            match running {
                Some(token) if b.state == BatchState::Cancelled => token.cancel(),
                Some(_) => {}
                None => self.start_batch_if_owner(&b.id).await,
            }
        }
        Ok(())
    }
}

/// Checks a declared input or output path: absolute, plain, not the root.
fn sandbox_file_path(field: &str, p: &str) -> ApiResult<()> {
    let invalid = |why: &str| {
        Err(ApiError::new(
            ErrorCode::InvalidPath,
            format!("{field}: {p:?} {why}"),
        ))
    };
    if !p.starts_with('/') {
        return invalid("is not an absolute path in the sandbox");
    }
    if p.split('/').any(|c| c == "..") {
        return invalid("leaves the sandbox (`..`)");
    }
    if p.trim_end_matches('/').is_empty() {
        return invalid("is the root, not a file");
    }
    validate::sandbox_path(field, p)
}

/// sha256 and size of blob `key`, read in chunks; `None` if absent.
fn hash_blob(store: &Arc<dyn BlobStore>, key: &str) -> dsec_blob::Result<Option<(String, u64)>> {
    let Some(info) = store.head(key)? else {
        return Ok(None);
    };
    let mut hasher = sha2::Sha256::new();
    let mut pos = 0;
    while pos < info.size {
        let chunk = store.get_range(key, pos..(pos + INPUT_CHUNK).min(info.size))?;
        if chunk.is_empty() {
            break;
        }
        pos += chunk.len() as u64;
        hasher.update(&chunk);
    }
    Ok(Some((format!("{:x}", hasher.finalize()), pos)))
}

/// Blob `key` of `size` bytes as a stream of chunks.
fn blob_chunks(store: Arc<dyn BlobStore>, key: String, size: u64) -> ByteStream {
    futures::stream::unfold(0u64, move |pos| {
        let (s, k) = (store.clone(), key.clone());
        async move {
            if pos >= size {
                return None;
            }
            let range = pos..(pos + INPUT_CHUNK).min(size);
            match blocking(move || s.get_range(&k, range)).await {
                Ok(chunk) if !chunk.is_empty() => {
                    let next = pos + chunk.len() as u64;
                    Some((Ok(Bytes::from(chunk)), next))
                }
                Ok(_) => Some((Err(internal("the blob shrank while read")), size)),
                Err(e) => Some((Err(e), size)),
            }
        }
    })
    .boxed()
}

fn counts_of(states: impl Iterator<Item = TaskState>) -> BTreeMap<TaskState, u64> {
    let mut counts: BTreeMap<TaskState, u64> = TaskState::ALL.iter().map(|s| (*s, 0)).collect();
    for s in states {
        *counts.entry(s).or_default() += 1;
    }
    counts
}

fn batch_view(b: &StoredBatch, counts: BTreeMap<TaskState, u64>) -> Batch {
    Batch {
        id: b.id.clone(),
        name: b.name.clone(),
        tenant: b.principal.tenant.clone(),
        state: b.state,
        created_at_ms: b.created_at_ms,
        ended_at_ms: b.ended_at_ms,
        total: b.total,
        counts,
        parallelism: b.parallelism,
        priority: b.priority,
        image: b.image.clone(),
        image_digest: b.image_digest.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn declared_paths_stay_in_the_sandbox() {
        assert!(sandbox_file_path("outputs", "/out/result.json").is_ok());
        for bad in ["out/x", "/out/../../etc/passwd", "/", "//", "/a/.."] {
            let e = sandbox_file_path("outputs", bad).expect_err(bad);
            assert_eq!(e.code, ErrorCode::InvalidPath, "{bad}: {}", e.message);
        }
    }

    #[test]
    fn counts_name_every_state() {
        let c = counts_of([TaskState::Failed, TaskState::Failed, TaskState::Pending].into_iter());
        assert_eq!(c.len(), TaskState::ALL.len());
        assert_eq!(c[&TaskState::Failed], 2);
        assert_eq!(c[&TaskState::Finalized], 0);
    }
}

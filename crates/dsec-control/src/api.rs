//! The public API as a transport-free trait.
//!
//! Every method corresponds to one `/v1` route. Errors are [`ApiError`]s with stable
//! codes; transports map them onto their own status codes exactly once.
//!
//! Every call but `health` is made on behalf of a caller: the [`Principal`] that
//! [`SandboxApi::authenticate`] returned for the request's key (its tenant and scopes).
//! A transport checks the scope a route needs ([`dsec_iam::required_scope`]) and passes
//! the principal; the implementation confines it to its tenant's sandboxes, answering
//! `not_found` for any other tenant's, exactly as for an id that does not exist.
//! Images are cluster-wide: every tenant lists and uses the same ones, and changing them
//! needs the `images` scope. Nodes are the operator's: listing and draining them needs a
//! cluster admin ([`Principal::is_cluster_admin`]).

use std::collections::BTreeMap;

use dsec_wire::v1::{
    Batch, BatchList, BatchSpec, BuildEvent, BuildRequest, BuildResult, CallLog, CallLogQuery,
    ClusterNode, ClusterNodeList, CommitRequest, CreateSandboxRequest, CreateSessionRequest,
    DockerfileBuildRequest, Event, EventQuery, ExecRequest, ExecResult, FileInfo, FileList,
    FnCallRequest, FnCallResponse, ForkRequest, ForkResult, GcRequest, GcResult, Health, Image,
    ImageList, ImportEvent, ImportImageRequest, InputObject, JobResult, LayerStatsList, Manifest,
    MkdirRequest, NetworkPolicy, PauseResult, Pool, PoolList, PoolSpec, PoolUpdate, ProcessInfo,
    ProcessList, PtySize, PullImageRequest, QueueStatus, RenameRequest, Sandbox, SandboxList,
    SessionInfo, SessionList, SessionResult, SessionRunRequest, SetTimeoutRequest, SignalRequest,
    StartProcessRequest, StdinRequest, TaskList, TaskListQuery, WriteResult,
};
use dsec_wire::{ApiError, ErrorCode};
use futures::stream::BoxStream;

pub use dsec_iam::{Principal, Scope};

// Streams of bytes (file contents, tar archives) and of exec/process events (the last
// item is `Exit`, `End` or `Error`): the same types the node seam uses, so a node's
// stream passes through unchanged.
pub use dsec_node_api::{ByteStream, EventStream};

/// Progress of an image import; the last item is `Done` or `Error`.
pub type ImportStream = BoxStream<'static, ImportEvent>;

/// Progress of a Dockerfile build; the last item is `Done` or `Error`.
pub type BuildStream = BoxStream<'static, BuildEvent>;

/// Result type of the API.
pub type ApiResult<T> = Result<T, ApiError>;

/// Fleet events (`GET /v1/events`): replayed ones, then live ones; an error ends it.
pub type EventFeed = BoxStream<'static, ApiResult<Event>>;

/// The dsec API. Implemented by the control plane; called by transports.
#[async_trait::async_trait]
pub trait SandboxApi: Send + Sync + 'static {
    /// Who an API key acts for (`unauthorized` if it is missing, unknown or revoked);
    /// `None` when the request carried none.
    fn authenticate(&self, key: Option<&str>) -> ApiResult<Principal>;

    /// `GET /v1/health`.
    async fn health(&self) -> ApiResult<Health>;

    /// `POST /v1/sandboxes`: returns once the sandbox is ready.
    async fn create_sandbox(
        &self,
        caller: &Principal,
        req: CreateSandboxRequest,
    ) -> ApiResult<Sandbox>;
    /// `GET /v1/sandboxes/{id}`.
    async fn get_sandbox(&self, caller: &Principal, id: &str) -> ApiResult<Sandbox>;

    /// Creates a warm pool of the caller's tenant.
    async fn create_pool(&self, _caller: &Principal, _spec: PoolSpec) -> ApiResult<Pool> {
        Err(no_pools())
    }

    /// The caller's tenant's pools.
    async fn list_pools(&self, _caller: &Principal) -> ApiResult<PoolList> {
        Err(no_pools())
    }

    /// One pool of the caller's tenant.
    async fn get_pool(&self, _caller: &Principal, _name: &str) -> ApiResult<Pool> {
        Err(no_pools())
    }

    /// Changes a pool's sizes or autoscale policy.
    async fn update_pool(
        &self,
        _caller: &Principal,
        _name: &str,
        _update: PoolUpdate,
    ) -> ApiResult<Pool> {
        Err(no_pools())
    }

    /// Deletes a pool and its warm sandboxes.
    async fn delete_pool(&self, _caller: &Principal, _name: &str) -> ApiResult<()> {
        Err(no_pools())
    }

    /// `GET /v1/events`: the events `query` selects that the caller may see (a cluster
    /// admin every one, another key its tenant's sandboxes').
    async fn events(&self, _caller: &Principal, _query: EventQuery) -> ApiResult<EventFeed> {
        Err(ApiError::new(
            ErrorCode::BadRequest,
            "this server keeps no events",
        ))
    }

    /// `GET /v1/queue`: creates waiting for capacity, by level (an admin's key sees
    /// every tenant's waiters, another key its tenant's).
    async fn queue_status(&self, _caller: &Principal) -> ApiResult<QueueStatus> {
        Ok(QueueStatus::default())
    }

    /// `POST /v1/fncall`: runs one function call in a member of the caller's pool.
    async fn fncall(&self, _caller: &Principal, _req: FnCallRequest) -> ApiResult<FnCallResponse> {
        Err(no_pools())
    }

    /// `PUT /v1/inputs/{key}`: stores an input for the caller's batches.
    async fn put_input(
        &self,
        _caller: &Principal,
        _key: &str,
        _body: ByteStream,
    ) -> ApiResult<InputObject> {
        Err(no_batches())
    }
    /// `POST /v1/batches`: submits a batch and starts it.
    async fn submit_batch(&self, _caller: &Principal, _spec: BatchSpec) -> ApiResult<Batch> {
        Err(no_batches())
    }
    /// `GET /v1/batches`: the caller's batches, newest first.
    async fn list_batches(&self, _caller: &Principal) -> ApiResult<BatchList> {
        Err(no_batches())
    }
    /// `GET /v1/batches/{id}`: a batch and its tasks' counts.
    async fn get_batch(&self, _caller: &Principal, _id: &str) -> ApiResult<Batch> {
        Err(no_batches())
    }
    /// `GET /v1/batches/{id}/tasks`: its tasks, paged.
    async fn batch_tasks(
        &self,
        _caller: &Principal,
        _id: &str,
        _query: TaskListQuery,
    ) -> ApiResult<TaskList> {
        Err(no_batches())
    }
    /// `GET /v1/batches/{id}/manifest`: what ran, on what, where.
    async fn batch_manifest(&self, _caller: &Principal, _id: &str) -> ApiResult<Manifest> {
        Err(no_batches())
    }
    /// `GET /v1/batches/{id}/tasks/{task}/output?path=`: a collected output's bytes;
    /// without `path`, the task's error snapshot.
    async fn batch_output(
        &self,
        _caller: &Principal,
        _id: &str,
        _task: &str,
        _path: Option<&str>,
    ) -> ApiResult<(u64, ByteStream)> {
        Err(no_batches())
    }
    /// `DELETE /v1/batches/{id}`: cancels a running batch.
    async fn cancel_batch(&self, _caller: &Principal, _id: &str) -> ApiResult<Batch> {
        Err(no_batches())
    }
    /// `DELETE /v1/batches/{id}?purge=true`: forgets an ended batch and its data.
    async fn purge_batch(&self, _caller: &Principal, _id: &str) -> ApiResult<()> {
        Err(no_batches())
    }
    /// `GET /v1/sandboxes?label=k=v`: sandboxes whose labels include all of `labels`.
    async fn list_sandboxes(
        &self,
        caller: &Principal,
        labels: BTreeMap<String, String>,
    ) -> ApiResult<SandboxList>;
    /// `DELETE /v1/sandboxes/{id}`.
    async fn delete_sandbox(&self, caller: &Principal, id: &str) -> ApiResult<()>;
    /// `POST /v1/sandboxes/{id}/timeout`.
    async fn set_timeout(
        &self,
        caller: &Principal,
        id: &str,
        req: SetTimeoutRequest,
    ) -> ApiResult<Sandbox>;
    /// `PUT /v1/sandboxes/{id}/network`: replaces a networked sandbox's policy (between
    /// `allowlist` and `open`; a sandbox created with `none` has no network to change).
    async fn set_network(
        &self,
        caller: &Principal,
        id: &str,
        policy: NetworkPolicy,
    ) -> ApiResult<Sandbox>;
    /// `GET /v1/sandboxes/{id}/screen`: a full VM's screen, as PNG.
    async fn screenshot(&self, _caller: &Principal, id: &str) -> ApiResult<bytes::Bytes> {
        Err(dsec_node_api::no_screen(id))
    }
    /// `POST /v1/sandboxes/{id}/input`: types into a full VM's keyboard, in order.
    async fn send_input(
        &self,
        _caller: &Principal,
        id: &str,
        _req: dsec_wire::v1::InputRequest,
    ) -> ApiResult<()> {
        Err(dsec_node_api::no_screen(id))
    }
    /// `POST /v1/sandboxes/{id}/pause`: freeze and reclaim memory. Idempotent.
    async fn pause_sandbox(&self, caller: &Principal, id: &str) -> ApiResult<PauseResult>;
    /// `POST /v1/sandboxes/{id}/resume`. Idempotent.
    async fn resume_sandbox(&self, caller: &Principal, id: &str) -> ApiResult<Sandbox>;
    /// `POST /v1/images/gc`: drops build-cache entries and the layers only they used.
    async fn gc_images(&self, caller: &Principal, req: GcRequest) -> ApiResult<GcResult>;
    /// `POST /v1/images/build`: an image from a base and steps, each a cached layer.
    async fn build_image(&self, caller: &Principal, req: BuildRequest) -> ApiResult<BuildResult>;
    /// `POST /v1/sandboxes/{id}/commit`: its files as a new image (packdiff).
    async fn commit_sandbox(
        &self,
        caller: &Principal,
        id: &str,
        req: CommitRequest,
    ) -> ApiResult<Image>;
    /// `POST /v1/sandboxes/{id}/fork`: `count` sandboxes with its files (see
    /// [`ForkRequest`]).
    async fn fork_sandbox(
        &self,
        _caller: &Principal,
        _id: &str,
        _req: ForkRequest,
    ) -> ApiResult<ForkResult> {
        Err(ApiError::new(
            ErrorCode::BadRequest,
            "this server cannot fork sandboxes",
        ))
    }
    /// `POST /v1/jobs/{job}/suspend`: pauses every sandbox labelled `job=<job>` and stops
    /// their lifetimes. Idempotent; reports each sandbox's outcome.
    async fn suspend_job(&self, caller: &Principal, job: &str) -> ApiResult<JobResult>;
    /// `POST /v1/jobs/{job}/resume`: resumes them; lifetimes continue where they stopped.
    async fn resume_job(&self, caller: &Principal, job: &str) -> ApiResult<JobResult>;

    /// `POST /v1/sandboxes/{id}/exec`.
    async fn exec(&self, caller: &Principal, id: &str, req: ExecRequest) -> ApiResult<ExecResult>;
    /// `POST /v1/sandboxes/{id}/exec/stream` (NDJSON of [`dsec_wire::v1::ExecEvent`]).
    async fn exec_stream(
        &self,
        caller: &Principal,
        id: &str,
        req: ExecRequest,
    ) -> ApiResult<EventStream>;

    /// `GET /v1/sandboxes/{id}/log`: the calls that carried a request id, oldest first.
    async fn call_log(
        &self,
        _caller: &Principal,
        _id: &str,
        _query: CallLogQuery,
    ) -> ApiResult<CallLog> {
        Err(ApiError::new(
            ErrorCode::BadRequest,
            "this server keeps no call logs",
        ))
    }

    /// `POST /v1/sandboxes/{id}/sessions`.
    async fn create_session(
        &self,
        caller: &Principal,
        id: &str,
        req: CreateSessionRequest,
    ) -> ApiResult<SessionInfo>;
    /// `GET /v1/sandboxes/{id}/sessions`.
    async fn list_sessions(&self, caller: &Principal, id: &str) -> ApiResult<SessionList>;
    /// `POST /v1/sandboxes/{id}/sessions/{session}/run`.
    async fn run_in_session(
        &self,
        caller: &Principal,
        id: &str,
        session: &str,
        req: SessionRunRequest,
    ) -> ApiResult<SessionResult>;
    /// `POST /v1/sandboxes/{id}/sessions/{session}/interrupt`.
    async fn interrupt_session(&self, caller: &Principal, id: &str, session: &str)
        -> ApiResult<()>;
    /// `DELETE /v1/sandboxes/{id}/sessions/{session}`.
    async fn close_session(&self, caller: &Principal, id: &str, session: &str) -> ApiResult<()>;

    /// `POST /v1/sandboxes/{id}/processes`.
    async fn start_process(
        &self,
        caller: &Principal,
        id: &str,
        req: StartProcessRequest,
    ) -> ApiResult<ProcessInfo>;
    /// `GET /v1/sandboxes/{id}/processes`.
    async fn list_processes(&self, caller: &Principal, id: &str) -> ApiResult<ProcessList>;
    /// `GET /v1/sandboxes/{id}/processes/{pid}/output`.
    async fn process_output(
        &self,
        caller: &Principal,
        id: &str,
        pid: u32,
        stdout_offset: u64,
        stderr_offset: u64,
        follow: bool,
    ) -> ApiResult<EventStream>;
    /// `POST /v1/sandboxes/{id}/processes/{pid}/stdin`.
    async fn process_stdin(
        &self,
        caller: &Principal,
        id: &str,
        pid: u32,
        req: StdinRequest,
    ) -> ApiResult<()>;
    /// `POST /v1/sandboxes/{id}/processes/{pid}/signal`.
    async fn signal_process(
        &self,
        caller: &Principal,
        id: &str,
        pid: u32,
        req: SignalRequest,
    ) -> ApiResult<()>;
    /// `POST /v1/sandboxes/{id}/processes/{pid}/resize`.
    async fn resize_process(
        &self,
        caller: &Principal,
        id: &str,
        pid: u32,
        size: PtySize,
    ) -> ApiResult<()>;

    /// `GET /v1/sandboxes/{id}/files?path=&offset=&length=`.
    async fn read_file(
        &self,
        caller: &Principal,
        id: &str,
        path: &str,
        offset: u64,
        length: Option<u64>,
    ) -> ApiResult<(FileInfo, ByteStream)>;
    /// `PUT /v1/sandboxes/{id}/files?path=&mode=`: the body is the file's bytes. With a
    /// `request_id` the write is recorded: a retry with the same bytes gets its answer
    /// without writing again.
    async fn write_file(
        &self,
        caller: &Principal,
        id: &str,
        path: &str,
        mode: Option<u32>,
        body: ByteStream,
        request_id: Option<&str>,
    ) -> ApiResult<WriteResult>;
    /// `GET /v1/sandboxes/{id}/files/list?path=`.
    async fn list_files(&self, caller: &Principal, id: &str, path: &str) -> ApiResult<FileList>;
    /// `GET /v1/sandboxes/{id}/files/stat?path=`.
    async fn stat_file(&self, caller: &Principal, id: &str, path: &str) -> ApiResult<FileInfo>;
    /// `POST /v1/sandboxes/{id}/files/mkdir`.
    async fn mkdir(&self, caller: &Principal, id: &str, req: MkdirRequest) -> ApiResult<()>;
    /// `DELETE /v1/sandboxes/{id}/files?path=&recursive=`.
    async fn remove_file(
        &self,
        caller: &Principal,
        id: &str,
        path: &str,
        recursive: bool,
    ) -> ApiResult<()>;
    /// `POST /v1/sandboxes/{id}/files/rename`.
    async fn rename_file(&self, caller: &Principal, id: &str, req: RenameRequest) -> ApiResult<()>;
    /// `GET /v1/sandboxes/{id}/files/tar?path=`: a tar stream of the directory.
    async fn download_tar(&self, caller: &Principal, id: &str, path: &str)
        -> ApiResult<ByteStream>;
    /// `PUT /v1/sandboxes/{id}/files/tar?path=`: extract the tar body into the directory,
    /// recorded under `request_id` as [`SandboxApi::write_file`] is.
    async fn upload_tar(
        &self,
        caller: &Principal,
        id: &str,
        path: &str,
        body: ByteStream,
        request_id: Option<&str>,
    ) -> ApiResult<WriteResult>;

    /// `GET /v1/images`.
    async fn list_images(&self, caller: &Principal) -> ApiResult<ImageList>;
    /// `GET /v1/images/{name}`: one image, `image_not_found` if there is none of that
    /// name. The default finds it in the list.
    async fn get_image(&self, caller: &Principal, name: &str) -> ApiResult<Image> {
        self.list_images(caller)
            .await?
            .images
            .into_iter()
            .find(|i| i.name == name)
            .ok_or_else(|| {
                ApiError::new(
                    dsec_wire::ErrorCode::ImageNotFound,
                    format!("image not found: {name}"),
                )
            })
    }
    /// `POST /v1/images`.
    async fn import_image(&self, caller: &Principal, req: ImportImageRequest) -> ApiResult<Image>;
    /// `POST /v1/images/import/stream`: the import with its progress. Bad requests fail
    /// before the stream starts; a failed import ends it with `Error`. The default runs
    /// [`SandboxApi::import_image`] and reports only its end.
    async fn import_image_stream(
        &self,
        caller: &Principal,
        req: ImportImageRequest,
    ) -> ApiResult<ImportStream> {
        let end = match self.import_image(caller, req).await {
            Ok(image) => ImportEvent::Done { image },
            Err(error) => ImportEvent::Error { error },
        };
        Ok(Box::pin(futures::stream::once(async move { end })))
    }
    /// `POST /v1/images/pull`: pulls an image from an OCI registry, with progress (the
    /// events of an import). Bad requests fail before the stream starts; a failed pull
    /// ends it with `Error` and keeps nothing.
    async fn pull_image_stream(
        &self,
        caller: &Principal,
        req: PullImageRequest,
    ) -> ApiResult<ImportStream> {
        let _ = (caller, req);
        Err(ApiError::new(
            dsec_wire::ErrorCode::BadRequest,
            "this server does not pull images",
        ))
    }
    /// `POST /v1/images/upload?name=`: imports an archive sent as the request body (a
    /// rootfs tar, compressed or not, a `docker save` or OCI archive, or an EROFS image).
    async fn upload_image(
        &self,
        caller: &Principal,
        name: &str,
        flatten: bool,
        body: ByteStream,
    ) -> ApiResult<Image> {
        let _ = (caller, name, flatten, body);
        Err(ApiError::new(
            dsec_wire::ErrorCode::BadRequest,
            "this server does not take image uploads",
        ))
    }
    /// `POST /v1/images/build/dockerfile`: builds the Dockerfile of the build context
    /// `context` (a tar archive in a file the call owns), streaming its steps and output.
    /// Bad requests fail before the stream starts; a failed build ends it with `Error`
    /// and names nothing.
    async fn build_dockerfile(
        &self,
        caller: &Principal,
        req: DockerfileBuildRequest,
        context: std::fs::File,
    ) -> ApiResult<BuildStream> {
        let _ = (caller, req, context);
        Err(ApiError::new(
            dsec_wire::ErrorCode::BadRequest,
            "this server does not build Dockerfiles",
        ))
    }
    /// `DELETE /v1/images/{name}`.
    async fn delete_image(&self, caller: &Principal, name: &str) -> ApiResult<()>;
    /// `GET /v1/utilization`: the last hour of samples of what the fleet holds.
    async fn utilization(&self, caller: &Principal) -> ApiResult<dsec_wire::v1::Utilization> {
        let _ = caller;
        Ok(dsec_wire::v1::Utilization::default())
    }
    /// Creates' phases since the start (for `GET /metrics`).
    async fn create_phase_stats(
        &self,
        caller: &Principal,
    ) -> ApiResult<dsec_wire::v1::CreatePhaseStats> {
        let _ = caller;
        Ok(dsec_wire::v1::CreatePhaseStats::default())
    }
    /// `GET /v1/images/layers`: on-demand accounting of this node's layers.
    async fn layer_stats(&self, caller: &Principal) -> ApiResult<LayerStatsList> {
        let _ = caller;
        Ok(LayerStatsList::default())
    }

    /// `GET /v1/nodes`: the nodes this server places sandboxes on.
    async fn list_nodes(&self, caller: &Principal) -> ApiResult<ClusterNodeList> {
        let _ = caller;
        Ok(ClusterNodeList::default())
    }
    /// `POST /v1/nodes/{name}/drain` (`drain`) and `/undrain`: stop or restart new
    /// placements on a node; its sandboxes keep running.
    async fn drain_node(
        &self,
        caller: &Principal,
        name: &str,
        drain: bool,
    ) -> ApiResult<ClusterNode> {
        let _ = (caller, drain);
        Err(ApiError::new(
            dsec_wire::ErrorCode::NotFound,
            format!("node {name} not found"),
        ))
    }
}

/// What an API without batches answers.
fn no_batches() -> ApiError {
    ApiError::new(ErrorCode::BadRequest, "this server runs no batches")
}

/// What an API without warm pools answers.
fn no_pools() -> ApiError {
    ApiError::new(ErrorCode::BadRequest, "this server has no warm pools")
}

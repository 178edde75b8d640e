//! [`Scoped`]: a request's handle on the API, bound to the [`Principal`] its key
//! authenticated as. Handlers of every front (`/v1`, E2B, SWE-ReX) take one instead of
//! the bare [`SandboxApi`], so each call is made on behalf of the request's caller
//! without passing it by hand; the middleware that authenticates a request
//! ([`crate::extract::require_api_key`]) checks the route's scope and stores the
//! principal for it.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use dsec_control::{ApiResult, ByteStream, EventStream, ImportStream, Principal, SandboxApi};
use dsec_wire::v1::{Batch, BatchList, BatchSpec, InputObject, Manifest, TaskList, TaskListQuery};
use dsec_wire::v1::{
    BuildRequest, BuildResult, ClusterNode, ClusterNodeList, CommitRequest, CreateSandboxRequest,
    CreateSessionRequest, DockerfileBuildRequest, ExecRequest, ExecResult, FileInfo, FileList,
    FnCallRequest, FnCallResponse, GcRequest, GcResult, Health, Image, ImageList,
    ImportImageRequest, JobResult, LayerStatsList, MkdirRequest, NetworkPolicy, PauseResult, Pool,
    PoolList, PoolSpec, PoolUpdate, ProcessInfo, ProcessList, PtySize, PullImageRequest,
    RenameRequest, Sandbox, SandboxList, SessionInfo, SessionList, SessionResult,
    SessionRunRequest, SetTimeoutRequest, SignalRequest, StartProcessRequest, StdinRequest,
    WriteResult,
};
use dsec_wire::{ApiError, ErrorCode};

use crate::error::HttpError;

/// The API as one authenticated caller sees it.
#[derive(Clone)]
pub struct Scoped {
    api: Arc<dyn SandboxApi>,
    caller: Principal,
}

impl std::fmt::Debug for Scoped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scoped")
            .field("caller", &self.caller)
            .finish_non_exhaustive()
    }
}

impl FromRequestParts<Arc<dyn SandboxApi>> for Scoped {
    type Rejection = HttpError;

    async fn from_request_parts(
        parts: &mut Parts,
        api: &Arc<dyn SandboxApi>,
    ) -> Result<Self, HttpError> {
        // Set by the authenticating middleware; a route without it is a wiring bug, and
        // is refused rather than served as nobody.
        let caller = parts
            .extensions
            .get::<Principal>()
            .cloned()
            .ok_or_else(|| {
                HttpError(ApiError::new(
                    ErrorCode::Unauthorized,
                    "this route was not authenticated",
                ))
            })?;
        Ok(Scoped::new(api.clone(), caller))
    }
}

impl Scoped {
    /// `api` as `caller`.
    pub fn new(api: Arc<dyn SandboxApi>, caller: Principal) -> Self {
        Scoped { api, caller }
    }

    /// Who the calls are made for.
    pub fn caller(&self) -> &Principal {
        &self.caller
    }

    /// [`SandboxApi::utilization`] as this caller.
    pub async fn utilization(&self) -> ApiResult<dsec_wire::v1::Utilization> {
        self.api.utilization(&self.caller).await
    }

    /// [`SandboxApi::health`] (the same for every caller).
    pub async fn health(&self) -> ApiResult<Health> {
        self.api.health().await
    }

    /// [`SandboxApi::create_sandbox`] as this caller.
    pub async fn create_sandbox(&self, req: CreateSandboxRequest) -> ApiResult<Sandbox> {
        self.api.create_sandbox(&self.caller, req).await
    }

    /// [`SandboxApi::get_sandbox`] as this caller.
    pub async fn get_sandbox(&self, id: &str) -> ApiResult<Sandbox> {
        self.api.get_sandbox(&self.caller, id).await
    }

    /// [`SandboxApi::list_sandboxes`] as this caller.
    pub async fn list_sandboxes(&self, labels: BTreeMap<String, String>) -> ApiResult<SandboxList> {
        self.api.list_sandboxes(&self.caller, labels).await
    }

    /// [`SandboxApi::delete_sandbox`] as this caller.
    pub async fn delete_sandbox(&self, id: &str) -> ApiResult<()> {
        self.api.delete_sandbox(&self.caller, id).await
    }

    /// [`SandboxApi::set_timeout`] as this caller.
    pub async fn set_timeout(&self, id: &str, req: SetTimeoutRequest) -> ApiResult<Sandbox> {
        self.api.set_timeout(&self.caller, id, req).await
    }

    /// [`SandboxApi::set_network`] as this caller.
    pub async fn set_network(&self, id: &str, policy: NetworkPolicy) -> ApiResult<Sandbox> {
        self.api.set_network(&self.caller, id, policy).await
    }

    /// [`SandboxApi::screenshot`] as this caller.
    pub async fn screenshot(&self, id: &str) -> ApiResult<bytes::Bytes> {
        self.api.screenshot(&self.caller, id).await
    }

    /// [`SandboxApi::send_input`] as this caller.
    pub async fn send_input(&self, id: &str, req: dsec_wire::v1::InputRequest) -> ApiResult<()> {
        self.api.send_input(&self.caller, id, req).await
    }

    /// [`SandboxApi::pause_sandbox`] as this caller.
    pub async fn pause_sandbox(&self, id: &str) -> ApiResult<PauseResult> {
        self.api.pause_sandbox(&self.caller, id).await
    }

    /// [`SandboxApi::resume_sandbox`] as this caller.
    pub async fn resume_sandbox(&self, id: &str) -> ApiResult<Sandbox> {
        self.api.resume_sandbox(&self.caller, id).await
    }

    /// [`SandboxApi::gc_images`] as this caller.
    pub async fn gc_images(&self, req: GcRequest) -> ApiResult<GcResult> {
        self.api.gc_images(&self.caller, req).await
    }

    /// [`SandboxApi::build_image`] as this caller.
    pub async fn build_image(&self, req: BuildRequest) -> ApiResult<BuildResult> {
        self.api.build_image(&self.caller, req).await
    }

    /// [`SandboxApi::build_dockerfile`] as this caller.
    pub async fn build_dockerfile(
        &self,
        req: DockerfileBuildRequest,
        context: std::fs::File,
    ) -> ApiResult<dsec_control::api::BuildStream> {
        self.api.build_dockerfile(&self.caller, req, context).await
    }

    /// [`SandboxApi::commit_sandbox`] as this caller.
    pub async fn commit_sandbox(&self, id: &str, req: CommitRequest) -> ApiResult<Image> {
        self.api.commit_sandbox(&self.caller, id, req).await
    }

    /// [`SandboxApi::create_pool`] as this caller.
    pub async fn create_pool(&self, spec: PoolSpec) -> ApiResult<Pool> {
        self.api.create_pool(&self.caller, spec).await
    }

    /// [`SandboxApi::list_pools`] as this caller.
    pub async fn list_pools(&self) -> ApiResult<PoolList> {
        self.api.list_pools(&self.caller).await
    }

    /// [`SandboxApi::get_pool`] as this caller.
    pub async fn get_pool(&self, name: &str) -> ApiResult<Pool> {
        self.api.get_pool(&self.caller, name).await
    }

    /// [`SandboxApi::update_pool`] as this caller.
    pub async fn update_pool(&self, name: &str, update: PoolUpdate) -> ApiResult<Pool> {
        self.api.update_pool(&self.caller, name, update).await
    }

    /// [`SandboxApi::delete_pool`] as this caller.
    pub async fn delete_pool(&self, name: &str) -> ApiResult<()> {
        self.api.delete_pool(&self.caller, name).await
    }

    /// [`SandboxApi::events`] as this caller.
    pub async fn events(
        &self,
        query: dsec_wire::v1::EventQuery,
    ) -> ApiResult<dsec_control::api::EventFeed> {
        self.api.events(&self.caller, query).await
    }

    /// [`SandboxApi::queue_status`] as this caller.
    pub async fn queue_status(&self) -> ApiResult<dsec_wire::v1::QueueStatus> {
        self.api.queue_status(&self.caller).await
    }

    /// [`SandboxApi::fncall`] as this caller.
    pub async fn fncall(&self, req: FnCallRequest) -> ApiResult<FnCallResponse> {
        self.api.fncall(&self.caller, req).await
    }

    /// [`SandboxApi::put_input`] as this caller.
    pub async fn put_input(&self, key: &str, body: ByteStream) -> ApiResult<InputObject> {
        self.api.put_input(&self.caller, key, body).await
    }

    /// [`SandboxApi::submit_batch`] as this caller.
    pub async fn submit_batch(&self, spec: BatchSpec) -> ApiResult<Batch> {
        self.api.submit_batch(&self.caller, spec).await
    }

    /// [`SandboxApi::list_batches`] as this caller.
    pub async fn list_batches(&self) -> ApiResult<BatchList> {
        self.api.list_batches(&self.caller).await
    }

    /// [`SandboxApi::get_batch`] as this caller.
    pub async fn get_batch(&self, id: &str) -> ApiResult<Batch> {
        self.api.get_batch(&self.caller, id).await
    }

    /// [`SandboxApi::batch_tasks`] as this caller.
    pub async fn batch_tasks(&self, id: &str, query: TaskListQuery) -> ApiResult<TaskList> {
        self.api.batch_tasks(&self.caller, id, query).await
    }

    /// [`SandboxApi::batch_manifest`] as this caller.
    pub async fn batch_manifest(&self, id: &str) -> ApiResult<Manifest> {
        self.api.batch_manifest(&self.caller, id).await
    }

    /// [`SandboxApi::batch_output`] as this caller.
    pub async fn batch_output(
        &self,
        id: &str,
        task: &str,
        path: Option<&str>,
    ) -> ApiResult<(u64, ByteStream)> {
        self.api.batch_output(&self.caller, id, task, path).await
    }

    /// [`SandboxApi::cancel_batch`] as this caller.
    pub async fn cancel_batch(&self, id: &str) -> ApiResult<Batch> {
        self.api.cancel_batch(&self.caller, id).await
    }

    /// [`SandboxApi::purge_batch`] as this caller.
    pub async fn purge_batch(&self, id: &str) -> ApiResult<()> {
        self.api.purge_batch(&self.caller, id).await
    }

    /// [`SandboxApi::suspend_job`] as this caller.
    pub async fn suspend_job(&self, job: &str) -> ApiResult<JobResult> {
        self.api.suspend_job(&self.caller, job).await
    }

    /// [`SandboxApi::resume_job`] as this caller.
    pub async fn resume_job(&self, job: &str) -> ApiResult<JobResult> {
        self.api.resume_job(&self.caller, job).await
    }

    /// [`SandboxApi::exec`] as this caller.
    pub async fn exec(&self, id: &str, req: ExecRequest) -> ApiResult<ExecResult> {
        self.api.exec(&self.caller, id, req).await
    }

    /// [`SandboxApi::exec_stream`] as this caller.
    pub async fn exec_stream(&self, id: &str, req: ExecRequest) -> ApiResult<EventStream> {
        self.api.exec_stream(&self.caller, id, req).await
    }

    /// [`SandboxApi::fork_sandbox`] as this caller.
    pub async fn fork_sandbox(
        &self,
        id: &str,
        req: dsec_wire::v1::ForkRequest,
    ) -> ApiResult<dsec_wire::v1::ForkResult> {
        self.api.fork_sandbox(&self.caller, id, req).await
    }

    /// [`SandboxApi::call_log`] as this caller.
    pub async fn call_log(
        &self,
        id: &str,
        query: dsec_wire::v1::CallLogQuery,
    ) -> ApiResult<dsec_wire::v1::CallLog> {
        self.api.call_log(&self.caller, id, query).await
    }

    /// [`SandboxApi::create_session`] as this caller.
    pub async fn create_session(
        &self,
        id: &str,
        req: CreateSessionRequest,
    ) -> ApiResult<SessionInfo> {
        self.api.create_session(&self.caller, id, req).await
    }

    /// [`SandboxApi::list_sessions`] as this caller.
    pub async fn list_sessions(&self, id: &str) -> ApiResult<SessionList> {
        self.api.list_sessions(&self.caller, id).await
    }

    /// [`SandboxApi::run_in_session`] as this caller.
    pub async fn run_in_session(
        &self,
        id: &str,
        session: &str,
        req: SessionRunRequest,
    ) -> ApiResult<SessionResult> {
        self.api
            .run_in_session(&self.caller, id, session, req)
            .await
    }

    /// [`SandboxApi::interrupt_session`] as this caller.
    pub async fn interrupt_session(&self, id: &str, session: &str) -> ApiResult<()> {
        self.api.interrupt_session(&self.caller, id, session).await
    }

    /// [`SandboxApi::close_session`] as this caller.
    pub async fn close_session(&self, id: &str, session: &str) -> ApiResult<()> {
        self.api.close_session(&self.caller, id, session).await
    }

    /// [`SandboxApi::start_process`] as this caller.
    pub async fn start_process(
        &self,
        id: &str,
        req: StartProcessRequest,
    ) -> ApiResult<ProcessInfo> {
        self.api.start_process(&self.caller, id, req).await
    }

    /// [`SandboxApi::list_processes`] as this caller.
    pub async fn list_processes(&self, id: &str) -> ApiResult<ProcessList> {
        self.api.list_processes(&self.caller, id).await
    }

    /// [`SandboxApi::process_output`] as this caller.
    pub async fn process_output(
        &self,
        id: &str,
        pid: u32,
        stdout_offset: u64,
        stderr_offset: u64,
        follow: bool,
    ) -> ApiResult<EventStream> {
        self.api
            .process_output(&self.caller, id, pid, stdout_offset, stderr_offset, follow)
            .await
    }

    /// [`SandboxApi::process_stdin`] as this caller.
    pub async fn process_stdin(&self, id: &str, pid: u32, req: StdinRequest) -> ApiResult<()> {
        self.api.process_stdin(&self.caller, id, pid, req).await
    }

    /// [`SandboxApi::signal_process`] as this caller.
    pub async fn signal_process(&self, id: &str, pid: u32, req: SignalRequest) -> ApiResult<()> {
        self.api.signal_process(&self.caller, id, pid, req).await
    }

    /// [`SandboxApi::resize_process`] as this caller.
    pub async fn resize_process(&self, id: &str, pid: u32, size: PtySize) -> ApiResult<()> {
        self.api.resize_process(&self.caller, id, pid, size).await
    }

    /// [`SandboxApi::read_file`] as this caller.
    pub async fn read_file(
        &self,
        id: &str,
        path: &str,
        offset: u64,
        length: Option<u64>,
    ) -> ApiResult<(FileInfo, ByteStream)> {
        self.api
            .read_file(&self.caller, id, path, offset, length)
            .await
    }

    /// [`SandboxApi::write_file`] as this caller.
    pub async fn write_file(
        &self,
        id: &str,
        path: &str,
        mode: Option<u32>,
        body: ByteStream,
        request_id: Option<&str>,
    ) -> ApiResult<WriteResult> {
        self.api
            .write_file(&self.caller, id, path, mode, body, request_id)
            .await
    }

    /// [`SandboxApi::list_files`] as this caller.
    pub async fn list_files(&self, id: &str, path: &str) -> ApiResult<FileList> {
        self.api.list_files(&self.caller, id, path).await
    }

    /// [`SandboxApi::stat_file`] as this caller.
    pub async fn stat_file(&self, id: &str, path: &str) -> ApiResult<FileInfo> {
        self.api.stat_file(&self.caller, id, path).await
    }

    /// [`SandboxApi::mkdir`] as this caller.
    pub async fn mkdir(&self, id: &str, req: MkdirRequest) -> ApiResult<()> {
        self.api.mkdir(&self.caller, id, req).await
    }

    /// [`SandboxApi::remove_file`] as this caller.
    pub async fn remove_file(&self, id: &str, path: &str, recursive: bool) -> ApiResult<()> {
        self.api
            .remove_file(&self.caller, id, path, recursive)
            .await
    }

    /// [`SandboxApi::rename_file`] as this caller.
    pub async fn rename_file(&self, id: &str, req: RenameRequest) -> ApiResult<()> {
        self.api.rename_file(&self.caller, id, req).await
    }

    /// [`SandboxApi::download_tar`] as this caller.
    pub async fn download_tar(&self, id: &str, path: &str) -> ApiResult<ByteStream> {
        self.api.download_tar(&self.caller, id, path).await
    }

    /// [`SandboxApi::upload_tar`] as this caller.
    pub async fn upload_tar(
        &self,
        id: &str,
        path: &str,
        body: ByteStream,
        request_id: Option<&str>,
    ) -> ApiResult<WriteResult> {
        self.api
            .upload_tar(&self.caller, id, path, body, request_id)
            .await
    }

    /// [`SandboxApi::list_images`] as this caller.
    pub async fn list_images(&self) -> ApiResult<ImageList> {
        self.api.list_images(&self.caller).await
    }

    /// [`SandboxApi::get_image`] as this caller.
    pub async fn get_image(&self, name: &str) -> ApiResult<Image> {
        self.api.get_image(&self.caller, name).await
    }

    /// [`SandboxApi::import_image`] as this caller.
    pub async fn import_image(&self, req: ImportImageRequest) -> ApiResult<Image> {
        self.api.import_image(&self.caller, req).await
    }

    /// [`SandboxApi::import_image_stream`] as this caller.
    pub async fn import_image_stream(&self, req: ImportImageRequest) -> ApiResult<ImportStream> {
        self.api.import_image_stream(&self.caller, req).await
    }

    /// [`SandboxApi::pull_image_stream`] as this caller.
    pub async fn pull_image_stream(&self, req: PullImageRequest) -> ApiResult<ImportStream> {
        self.api.pull_image_stream(&self.caller, req).await
    }

    /// [`SandboxApi::upload_image`] as this caller.
    pub async fn upload_image(
        &self,
        name: &str,
        flatten: bool,
        body: ByteStream,
    ) -> ApiResult<Image> {
        self.api
            .upload_image(&self.caller, name, flatten, body)
            .await
    }

    /// [`SandboxApi::delete_image`] as this caller.
    pub async fn delete_image(&self, name: &str) -> ApiResult<()> {
        self.api.delete_image(&self.caller, name).await
    }

    /// [`SandboxApi::create_phase_stats`] as this caller.
    pub async fn create_phase_stats(&self) -> ApiResult<dsec_wire::v1::CreatePhaseStats> {
        self.api.create_phase_stats(&self.caller).await
    }

    /// [`SandboxApi::layer_stats`] as this caller.
    pub async fn layer_stats(&self) -> ApiResult<LayerStatsList> {
        self.api.layer_stats(&self.caller).await
    }

    /// [`SandboxApi::list_nodes`] as this caller.
    pub async fn list_nodes(&self) -> ApiResult<ClusterNodeList> {
        self.api.list_nodes(&self.caller).await
    }

    /// [`SandboxApi::drain_node`] as this caller.
    pub async fn drain_node(&self, name: &str, drain: bool) -> ApiResult<ClusterNode> {
        self.api.drain_node(&self.caller, name, drain).await
    }
}

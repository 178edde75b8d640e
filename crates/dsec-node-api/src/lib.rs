//! The seam between the control plane and a node: [`NodeApi`], the operations a node
//! offers on the sandboxes it runs, with the types they take and return.
//!
//! Everything here is an operation, never a connection: the control plane asks a node to
//! create a sandbox, run a command, read a file, and gets results and streams back. How
//! the node reaches the sandbox's agent (a unix socket and frames today, virtio-serial in
//! a microVM, an internal HTTP API for a remote node) stays behind the trait, so the same
//! control plane drives a node in its own process (`dsec_node::LocalNode`), a node on
//! another machine, or `fake::FakeNode` (feature `fake`) in unit tests.
//!
//! Architecture invariants:
//! - no kernel crate: the control plane links this crate, not `dsec-node`;
//! - errors are [`ApiError`]s (a stable code and a message): what a remote node sends
//!   back over the wire is the same value a local one returns;
//! - streams end with the outcome: an exec's last event carries its exit and whether the
//!   memory limit killed a process meanwhile, so no second call is needed.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use futures::stream::BoxStream;

use dsec_wire::agent::{ExecSpec, Reply, Request};
use dsec_wire::v1::{
    CallLog, CallLogQuery, ExecEvent, ExecResult, FileInfo, GcRequest, GcResult, Image,
    ImageConfig, ImportEvent, Isolation, LayerStatsList, NetworkPolicy, NodeCapacity, Qos,
    WriteResult,
};
use dsec_wire::ApiError;

#[cfg(feature = "fake")]
pub mod fake;
pub mod lifetime;
pub mod request_id;
pub mod timeline;
pub use timeline::Timeline;

pub use lifetime::Lifetime;

/// Result of a node operation.
pub type NodeResult<T> = Result<T, ApiError>;

/// Bytes streamed to or from a sandbox (file and tar transfers).
pub type ByteStream = BoxStream<'static, Result<Bytes, ApiError>>;

/// Events of a command: output chunks, then its exit (or an error event).
pub type EventStream = BoxStream<'static, ExecEvent>;

/// Receives the progress of an image import, as wire `Progress` events.
pub type ImportProgressSink = Arc<dyn Fn(ImportEvent) + Send + Sync>;

/// What the control plane asks a node to create.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct NodeCreateSpec {
    /// Sandbox id (already validated, unique).
    pub id: String,
    /// Image name or digest.
    pub image: String,
    /// More images stacked on top of `image`, in order (each may have several layers).
    pub layers: Vec<String>,
    /// CPU limit in millicores.
    pub cpu_millis: u64,
    /// Memory limit in bytes.
    pub memory_bytes: u64,
    /// Process limit.
    pub pids_max: u64,
    /// Writable-layer size in MiB; `None` takes the node's default.
    pub disk_mb: Option<u64>,
    /// CPU class.
    pub qos: Qos,
    /// Environment of commands.
    pub env: BTreeMap<String, String>,
    /// Default working directory.
    pub workdir: String,
    /// Default user of commands (name or `UID[:GID]`); `None`: root.
    pub user: Option<String>,
    /// Network policy.
    pub network: NetworkPolicy,
    /// Commands may write only beneath these paths, when not empty.
    pub writable_paths: Vec<String>,
    /// Commands may bind only these TCP ports, when set.
    pub tcp_bind: Option<Vec<u16>>,
    /// Commands may connect only to these TCP ports, when set.
    pub tcp_connect: Option<Vec<u16>>,
    /// Isolation level.
    pub isolation: Isolation,
    /// The sandbox's labels (a label may name the tenant whose uid range it shares).
    pub labels: BTreeMap<String, String>,
    /// How long it may live; the node ends it when this runs out (default: no limit).
    #[serde(default)]
    pub lifetime: Lifetime,
    /// Whether its network reaches the model gateway (it was created with
    /// `model_access`): the gateway's address answers it whatever its policy.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub model_link: bool,
}

/// A sandbox as the node knows it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct NodeSandbox {
    /// Sandbox id.
    pub id: String,
    /// Digest of its image layer.
    pub image_digest: String,
    /// Host pid of its init (the agent); 0 where the node has no such notion.
    pub pid: i32,
    /// Whether its init is still running.
    pub alive: bool,
    /// Size of its writable layer in MiB, if the node limits disk.
    pub disk_mb: Option<u64>,
    /// Free space left on that layer, in MiB (only in [`NodeApi::list`], where the node
    /// can tell): 0 when a write would fail with `ENOSPC`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_free_mb: Option<u64>,
    /// Its IPv4 address, when it is networked.
    pub ip: Option<std::net::Ipv4Addr>,
    /// Milliseconds since the node created it (or adopted it, when it has no earlier
    /// record), by the node's own monotonic clock; for an ended one, its age when it ended.
    #[serde(default)]
    pub age_ms: u64,
    /// Milliseconds since its last activity (0 while an operation is under way).
    #[serde(default)]
    pub idle_ms: u64,
    /// What is left of its TTL (frozen while held); `None`: no TTL, or it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_left_ms: Option<u64>,
    /// Why the node ended it ([`lifetime::TTL_ENDED`], [`lifetime::IDLE_TIMEOUT`]): an
    /// ended sandbox is a stub, nothing of it runs; it stays listed until
    /// [`NodeApi::destroy`] forgets it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended: Option<String>,
    /// The node's phases of the create that made it, on the node's clock from when it
    /// got the create (only in [`NodeApi::create`]'s answer).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub timings: Vec<dsec_wire::v1::PhaseTiming>,
}

/// Where an image to import comes from.
pub enum ImportSource {
    /// A directory, tar, OCI layout or `.erofs` file on the node's own disk (the embedded
    /// single node, where server and node are one machine).
    NodePath(std::path::PathBuf),
    /// An archive (a rootfs tar or a `docker save`/OCI archive) streamed to the node.
    Archive(ByteStream),
}

impl std::fmt::Debug for ImportSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ImportSource::NodePath(p) => f.debug_tuple("NodePath").field(p).finish(),
            ImportSource::Archive(_) => f.write_str("Archive(..)"),
        }
    }
}

/// The operations of one node, as the control plane sees them.
///
/// Calls name sandboxes by id; an id the node does not run answers `not_found`, and so
/// does an ended one (its lifetime ran out). Agent operations have no deadline of their
/// own: the caller bounds them (and drops the future or stream to cancel, which stops
/// the command or transfer in the sandbox).
///
/// Lifetimes are the node's: it ends a sandbox whose TTL or idle timeout ran out (see
/// [`Lifetime`]) and lists it as ended until the control plane destroys it. Every
/// operation on a sandbox counts as activity but `ping`, `pause`, `list` and `destroy`.
#[async_trait::async_trait]
pub trait NodeApi: Send + Sync + std::fmt::Debug + 'static {
    /// Node name.
    fn name(&self) -> &str;
    /// `v1` or `v2`.
    fn cgroup_version(&self) -> &'static str;
    /// The isolation levels it offers.
    fn isolation_levels(&self) -> Vec<dsec_wire::v1::IsolationLevel> {
        vec![dsec_wire::v1::IsolationLevel {
            isolation: dsec_wire::v1::Isolation::Container,
            runtime: None,
            platform: None,
        }]
    }

    // ---- lifecycle ----

    /// Creates a sandbox; returns once its agent answers.
    async fn create(&self, spec: NodeCreateSpec) -> NodeResult<NodeSandbox>;
    /// Destroys a sandbox and releases everything it held; forgets an ended one's stub.
    /// Idempotent.
    async fn destroy(&self, id: &str) -> NodeResult<()>;
    /// Sandboxes on this node, the ended ones (see [`NodeSandbox::ended`]) included. An
    /// error (a node that does not answer) is never an empty list: callers reconcile
    /// records against it.
    async fn list(&self) -> NodeResult<Vec<NodeSandbox>>;
    /// Replaces a sandbox's lifetime, counted from now (see [`Lifetime`]). Counts as
    /// activity. An ended or unknown sandbox answers `not_found`.
    async fn set_lifetime(&self, id: &str, lifetime: Lifetime) -> NodeResult<()>;
    /// Freezes a sandbox and reclaims its memory; returns its memory use before and after.
    async fn pause(&self, id: &str) -> NodeResult<(u64, u64)>;
    /// Thaws a paused sandbox.
    async fn resume(&self, id: &str) -> NodeResult<()>;
    /// Stores the sandbox's writable layer as a new layer and names the image `name` =
    /// its layer stack + `previous_diffs` (layers of its earlier commits) + it. Returns
    /// the image and the new layer, `None` when nothing changed since the last commit (the
    /// image then adds no layer). The sandbox should be paused meanwhile.
    async fn commit(
        &self,
        id: &str,
        name: &str,
        previous_diffs: Vec<String>,
        config: ImageConfig,
    ) -> NodeResult<(Image, Option<String>)>;
    /// Replaces a networked sandbox's policy.
    async fn set_network(&self, id: &str, policy: NetworkPolicy) -> NodeResult<()>;
    /// A full VM's screen (isolation `vm`), as PNG.
    async fn screenshot(&self, id: &str) -> NodeResult<Bytes> {
        Err(no_screen(id))
    }
    /// Sends `events` to a full VM's keyboard and pointer (isolation `vm`), in order.
    async fn send_input(&self, id: &str, events: Vec<dsec_wire::v1::InputEvent>) -> NodeResult<()> {
        let _ = events;
        Err(no_screen(id))
    }
    /// Capacity and load, for placement.
    async fn capacity(&self) -> NodeCapacity;

    // ---- agent operations ----

    /// Whether the sandbox's agent answers; the error says why not.
    async fn ping(&self, id: &str) -> NodeResult<()>;
    /// One request/reply exchange without input or output streams: sessions (create,
    /// list, run, interrupt, close), processes (start, list, signal, resize) and file
    /// operations (list, stat, mkdir, remove, rename). A request that streams
    /// ([`Request::Exec`], file and tar transfers, process output and stdin) has its own
    /// method and is refused here with `bad_request`.
    async fn call(&self, id: &str, req: Request) -> NodeResult<Reply>;
    /// Runs a command to its exit and returns its kept output. `stdin`, when given, is
    /// the command's whole input.
    async fn exec(&self, id: &str, spec: ExecSpec, stdin: Option<Bytes>) -> NodeResult<ExecResult>;
    /// Starts a command and streams its output as it comes; the last event is its exit
    /// or an error. Dropping the stream stops the command.
    async fn exec_stream(
        &self,
        id: &str,
        spec: ExecSpec,
        stdin: Option<Bytes>,
    ) -> NodeResult<EventStream>;
    /// [`NodeApi::exec`] as a call recorded under `request_id` (see
    /// [`dsec_wire::v1::CallRecord`]): it runs once; a retry gets its recorded result, or
    /// waits for it while it runs; a retry asking for something else, or from another
    /// sandbox, is `conflict`. The command outlives its caller. The default refuses: a
    /// node that keeps no records.
    async fn exec_recorded(
        &self,
        id: &str,
        request_id: &str,
        spec: ExecSpec,
        stdin: Option<Bytes>,
    ) -> NodeResult<ExecResult> {
        let _ = (id, request_id, spec, stdin);
        Err(no_call_records())
    }
    /// [`NodeApi::exec_recorded`] streamed: a retry of a running call attaches to it and
    /// gets its output from the first byte; of an ended one, its recorded output.
    /// Dropping the stream leaves the command running.
    async fn exec_stream_recorded(
        &self,
        id: &str,
        request_id: &str,
        spec: ExecSpec,
        stdin: Option<Bytes>,
    ) -> NodeResult<EventStream> {
        let _ = (id, request_id, spec, stdin);
        Err(no_call_records())
    }
    /// [`NodeApi::call`] recorded under `request_id`, for a session command or a process
    /// start: it runs once; a retry gets the recorded reply (or waits for it); it runs to
    /// its end if its caller goes away.
    async fn call_recorded(&self, id: &str, request_id: &str, req: Request) -> NodeResult<Reply> {
        let _ = (id, request_id, req);
        Err(no_call_records())
    }
    /// An upload ([`Request::FileWrite`] or [`Request::TarUpload`] with `body`) recorded
    /// under `request_id`: written once; a retry with the same bytes gets the recorded
    /// answer, one with other bytes is a `conflict`; one that broke off wrote nothing and
    /// is forgotten.
    async fn upload_recorded(
        &self,
        id: &str,
        request_id: &str,
        req: Request,
        body: ByteStream,
    ) -> NodeResult<WriteResult> {
        let _ = (id, request_id, req, body);
        Err(no_call_records())
    }
    /// A page of the sandbox's log of recorded calls.
    async fn call_log(&self, id: &str, query: &CallLogQuery) -> NodeResult<CallLog> {
        let _ = (id, query);
        Err(no_call_records())
    }
    /// A background process's output from the given offsets; with `follow`, until it
    /// exits (the last event is its exit).
    async fn process_output(
        &self,
        id: &str,
        pid: u32,
        stdout_offset: u64,
        stderr_offset: u64,
        follow: bool,
    ) -> NodeResult<EventStream>;
    /// Writes `data` to a background process's stdin; `close` closes it after.
    async fn process_stdin(&self, id: &str, pid: u32, data: Bytes, close: bool) -> NodeResult<()>;
    /// A file's metadata and its bytes from `offset` (at most `length`). An error the
    /// file has (missing, a directory, out of range) is answered before any byte.
    async fn read_file(
        &self,
        id: &str,
        path: &str,
        offset: u64,
        length: Option<u64>,
    ) -> NodeResult<(FileInfo, ByteStream)>;
    /// Writes a file from `body` (parents created), atomically: a body that breaks off
    /// leaves the old file, if any, as it was.
    async fn write_file(
        &self,
        id: &str,
        path: &str,
        mode: Option<u32>,
        body: ByteStream,
    ) -> NodeResult<WriteResult>;
    /// A tar of `path`; an error (missing path) is answered before any byte.
    async fn download_tar(&self, id: &str, path: &str) -> NodeResult<ByteStream>;
    /// Extracts the tar `body` under `path`, all or nothing.
    async fn upload_tar(&self, id: &str, path: &str, body: ByteStream) -> NodeResult<WriteResult>;

    // ---- images ----

    /// Images on this node.
    async fn list_images(&self) -> NodeResult<Vec<Image>>;
    /// One image by name or digest.
    async fn image(&self, name: &str) -> NodeResult<Image>;
    /// Imports an image, reporting progress to `progress`.
    async fn import_image(
        &self,
        name: &str,
        source: ImportSource,
        flatten: bool,
        progress: Option<ImportProgressSink>,
    ) -> NodeResult<Image>;
    /// Pulls `req.reference` from its OCI registry and stores it as an image (layers
    /// converted once per layer blob; a failed pull keeps nothing). The node talks to the
    /// registry with its own credentials (`--registry-auth`). The default refuses: a node
    /// that cannot pull.
    async fn pull_image(
        &self,
        req: &dsec_wire::v1::PullImageRequest,
        progress: Option<ImportProgressSink>,
    ) -> NodeResult<Image> {
        let _ = (req, progress);
        Err(ApiError::new(
            dsec_wire::ErrorCode::BadRequest,
            "this node cannot pull images from registries",
        ))
    }
    /// Removes an image name.
    async fn remove_image(&self, name: &str) -> NodeResult<()>;
    /// Removes build-cache refs older than `req.older_than_s` and the layers only they
    /// used, trims the layer cache to its limit and, if asked, sweeps the shared store.
    async fn gc_images(&self, req: &GcRequest) -> NodeResult<GcResult>;
    /// Accounting of the layers this node serves on demand.
    async fn layer_stats(&self) -> NodeResult<LayerStatsList>;
    /// Names `source`'s layers `name` too, with `source`'s config or, when given,
    /// `config` (a Dockerfile build's final ENV, CMD, LABELs...).
    async fn tag_image(
        &self,
        source: &str,
        name: &str,
        config: Option<ImageConfig>,
    ) -> NodeResult<Image>;
}

/// What a node answers for the screen or keyboard of a sandbox that has none.
pub fn no_screen(id: &str) -> ApiError {
    ApiError::new(
        dsec_wire::ErrorCode::BadRequest,
        format!("sandbox {id} has no screen: only isolation vm has one"),
    )
}

/// What a node that keeps no call records answers to a call with a request id.
pub fn no_call_records() -> ApiError {
    ApiError::new(
        dsec_wire::ErrorCode::BadRequest,
        "this node keeps no call records: send the call without a request id",
    )
}

/// Whether `req` is a plain request/reply exchange ([`NodeApi::call`] takes it).
pub fn is_unary(req: &Request) -> bool {
    !matches!(
        req,
        Request::Exec(_)
            | Request::ExecKept { .. }
            | Request::FileRead { .. }
            | Request::FileWrite { .. }
            | Request::TarDownload { .. }
            | Request::TarUpload { .. }
            | Request::ProcessOutput { .. }
            | Request::ProcessStdin { .. }
    )
}

/// A stream of one chunk.
pub fn once_bytes(bytes: impl Into<Bytes>) -> ByteStream {
    use futures::StreamExt;
    futures::stream::iter([Ok(bytes.into())]).boxed()
}

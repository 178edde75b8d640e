//! The OpenAPI 3.1 document of `/v1`, served at `GET /v1/openapi.json`.
//!
//! Its schemas are the JSON Schemas (2020-12, the dialect of OpenAPI 3.1) that schemars
//! derives from the wire types themselves, so a field added to a request or a response
//! is in the document the next build. What schemars cannot see, the routes, is the table
//! in [`operations`]: method, path, summary, and which wire type goes in and comes out.
//! Tests keep that table and the router equal (every route of the router is in it, with
//! the same methods), and the checked-in `docs/openapi.json` equal to what this builds.
//!
//! The document covers the `/v1` API and the admin API of tenants and keys. The other
//! fronts (E2B, SWE-ReX, SandboxFusion, the model gateway) speak other projects' APIs and
//! `/metrics` speaks Prometheus; they are documented by those projects.

use std::collections::BTreeMap;

use dsec_iam::{api as iam_api, KeyInfo, NewKey, Tenant, Usage};
use dsec_wire::v1::*;
use schemars::generate::SchemaSettings;
use schemars::{JsonSchema, Schema, SchemaGenerator};
use serde_json::{json, Map, Value};

/// Builds the schema of one type (a `$ref` into `components/schemas` for named types).
type SchemaFn = fn(&mut SchemaGenerator) -> Schema;

fn schema_of<T: JsonSchema>(g: &mut SchemaGenerator) -> Schema {
    g.subschema_for::<T>()
}

/// What a request carries in its body.
#[derive(Clone, Copy)]
enum RequestBody {
    None,
    Json(SchemaFn),
    /// Raw bytes of this media type, streamed.
    Bytes(&'static str, &'static str),
}

/// What a successful answer carries.
#[derive(Clone, Copy)]
enum Answer {
    /// A JSON value, with this status.
    Json(u16, SchemaFn),
    /// `204 No Content`.
    NoContent,
    /// Newline-delimited JSON: one value of this type per line, each flushed.
    Ndjson(SchemaFn),
    /// Server-Sent Events whose data is a value of this type.
    Sse(SchemaFn),
    /// Raw bytes of this media type, streamed.
    Bytes(&'static str, &'static str),
    /// Another answer by query (`batch_output`: bytes, or the error snapshot as JSON).
    BytesOrJson(&'static str, SchemaFn),
    /// Either of two answers (`DELETE /v1/batches/{id}`: the batch, or 204 with purge).
    JsonOrNoContent(SchemaFn),
    /// A WebSocket: the client's messages, then the server's.
    WebSocket(SchemaFn, SchemaFn),
}

/// One operation of the API.
#[derive(Clone, Copy)]
struct Operation {
    method: &'static str,
    path: &'static str,
    id: &'static str,
    tag: &'static str,
    summary: &'static str,
    query: Option<SchemaFn>,
    body: RequestBody,
    answer: Answer,
    public: bool,
    /// Takes `Idempotency-Key` (a request id the call is recorded and replayed under).
    idempotent: bool,
    /// Takes `Last-Event-ID` (an SSE reconnect).
    last_event_id: bool,
}

fn op(
    method: &'static str,
    path: &'static str,
    id: &'static str,
    summary: &'static str,
) -> Operation {
    Operation {
        method,
        path,
        id,
        tag: tag_of(path),
        summary,
        query: None,
        body: RequestBody::None,
        answer: Answer::NoContent,
        public: false,
        idempotent: false,
        last_event_id: false,
    }
}

/// The tag of a path: its first segment after `/v1`, with sandbox sub-resources named
/// by theirs (`/v1/sandboxes/{id}/files/...` is `files`).
fn tag_of(path: &str) -> &'static str {
    let segs: Vec<&str> = path.trim_start_matches("/v1/").split('/').collect();
    let sub = |s: &str| match s {
        "exec" | "log" => "commands",
        "sessions" => "sessions",
        "processes" => "processes",
        "files" => "files",
        "screen" | "input" => "screen",
        _ => "sandboxes",
    };
    match segs.as_slice() {
        ["sandboxes", _, rest, ..] => sub(rest),
        ["sandboxes", ..] => "sandboxes",
        ["pools", ..] => "pools",
        ["fncall"] | ["queue"] => "fncall",
        ["inputs", ..] | ["batches", ..] => "batches",
        ["jobs", ..] => "jobs",
        ["nodes", ..] => "nodes",
        ["images", ..] => "images",
        ["events"] => "events",
        ["utilization"] => "nodes",
        ["audit"] => "audit",
        ["tenants", ..] => "tenants",
        ["keys", ..] => "keys",
        _ => "system",
    }
}

impl Operation {
    fn query<T: JsonSchema>(mut self) -> Self {
        self.query = Some(schema_of::<T>);
        self
    }
    fn body<T: JsonSchema>(mut self) -> Self {
        self.body = RequestBody::Json(schema_of::<T>);
        self
    }
    fn bytes_in(mut self, media: &'static str, what: &'static str) -> Self {
        self.body = RequestBody::Bytes(media, what);
        self
    }
    fn ok<T: JsonSchema>(mut self) -> Self {
        self.answer = Answer::Json(200, schema_of::<T>);
        self
    }
    fn created<T: JsonSchema>(mut self) -> Self {
        self.answer = Answer::Json(201, schema_of::<T>);
        self
    }
    fn ndjson<T: JsonSchema>(mut self) -> Self {
        self.answer = Answer::Ndjson(schema_of::<T>);
        self
    }
    fn answer(mut self, answer: Answer) -> Self {
        self.answer = answer;
        self
    }
    fn public(mut self) -> Self {
        self.public = true;
        self
    }
    fn idempotent(mut self) -> Self {
        self.idempotent = true;
        self
    }
    fn last_event_id(mut self) -> Self {
        self.last_event_id = true;
        self
    }
}

/// Query of `GET /v1/sandboxes` (the handler reads the pairs as they come).
#[derive(serde::Deserialize, JsonSchema)]
#[allow(dead_code)]
struct ListSandboxesQuery {
    #[serde(default)]
    /// `key=value`: only sandboxes with this label (repeat: all of them).
    label: Vec<String>,
    /// Only sandboxes in this state (repeat: any of them).
    #[serde(default)]
    state: Vec<SandboxState>,
}

/// Query of `POST /v1/images/build/dockerfile`
/// ([`DockerfileBuildRequest::from_query`] reads it).
#[derive(serde::Deserialize, JsonSchema)]
#[allow(dead_code)]
struct DockerfileBuildQuery {
    /// Name of the result.
    name: String,
    /// Path of the Dockerfile inside the context; default `Dockerfile`.
    dockerfile: Option<String>,
    /// Stage to build (`--target`); default the last one.
    target: Option<String>,
    /// `NAME=VALUE` (repeat for each `--build-arg`).
    #[serde(default)]
    build_arg: Vec<String>,
    /// Network of `RUN` steps; default `none`.
    network: Option<NetworkMode>,
    /// Run every step again instead of taking layers from the build cache.
    no_cache: Option<bool>,
    /// Time limit of one `RUN` in seconds; default 1800.
    step_timeout_s: Option<f64>,
}

/// Every operation of `/v1` and of the admin API, in the order of the router.
#[rustfmt::skip]
fn operations() -> Vec<Operation> {
    use crate::handlers::{
        BatchOutputQuery, OutputQuery, PathQuery, PurgeQuery, ReadQuery, RemoveQuery,
        TarUploadQuery, UploadImageQuery, WriteQuery,
    };
    const TAR: &str = "application/x-tar";
    const OCTETS: &str = "application/octet-stream";
    vec![
        op("get", "/v1/health", "health", "Health and capacity of the service").public().ok::<Health>(),
        op("get", "/v1/openapi.json", "openapi", "This document").public().answer(Answer::Json(200, schema_of::<Value>)),
        op("get", "/v1/whoami", "whoami", "The caller: its key's tenant, id and scopes").ok::<Whoami>(),
        op("get", "/v1/utilization", "utilization", "The last hour of what the fleet holds, sampled every 10 s").ok::<Utilization>(),
        // Sandboxes.
        op("post", "/v1/sandboxes", "createSandbox", "Create a sandbox").body::<CreateSandboxRequest>().created::<Sandbox>(),
        op("get", "/v1/sandboxes", "listSandboxes", "List sandboxes, by label and state").query::<ListSandboxesQuery>().ok::<SandboxList>(),
        op("get", "/v1/sandboxes/{id}", "getSandbox", "A sandbox's record").ok::<Sandbox>(),
        op("delete", "/v1/sandboxes/{id}", "deleteSandbox", "Delete a sandbox (with Idempotency-Key, a retry of a delete that is done succeeds)").idempotent(),
        op("post", "/v1/sandboxes/{id}/timeout", "setTimeout", "Change a sandbox's time to live").body::<SetTimeoutRequest>().ok::<Sandbox>(),
        op("put", "/v1/sandboxes/{id}/network", "setNetwork", "Replace a sandbox's network policy").body::<NetworkPolicy>().ok::<Sandbox>(),
        op("get", "/v1/sandboxes/{id}/screen", "screenshot", "A full VM's screen (isolation vm)").answer(Answer::Bytes("image/png", "The screen as PNG.")),
        op("post", "/v1/sandboxes/{id}/input", "sendInput", "Type and point on a full VM (isolation vm): text, key chords, pointer moves, clicks and scrolls, in order").body::<InputRequest>(),
        op("post", "/v1/sandboxes/{id}/pause", "pauseSandbox", "Pause a sandbox (freeze, then reclaim its memory)").ok::<PauseResult>(),
        op("post", "/v1/sandboxes/{id}/resume", "resumeSandbox", "Resume a paused sandbox").ok::<Sandbox>(),
        op("post", "/v1/sandboxes/{id}/commit", "commitSandbox", "Save a sandbox's filesystem as an image").body::<CommitRequest>().created::<Image>(),
        // Pools, function calls, batches.
        op("post", "/v1/pools", "createPool", "Create a pool of warm sandboxes").body::<PoolSpec>().created::<Pool>(),
        op("get", "/v1/pools", "listPools", "List pools").ok::<PoolList>(),
        op("get", "/v1/pools/{name}", "getPool", "A pool").ok::<Pool>(),
        op("patch", "/v1/pools/{name}", "updatePool", "Resize or retune a pool").body::<PoolUpdate>().ok::<Pool>(),
        op("delete", "/v1/pools/{name}", "deletePool", "Delete a pool and its idle sandboxes"),
        op("post", "/v1/fncall", "fncall", "Run code in a pooled sandbox and return its result").body::<FnCallRequest>().ok::<FnCallResponse>(),
        op("get", "/v1/queue", "queueStatus", "The admission queue: waiting creates by priority and tenant").ok::<QueueStatus>(),
        op("get", "/v1/events", "events", "Lifecycle events (Server-Sent Events): replay from an id, then follow").query::<EventQuery>().last_event_id().answer(Answer::Sse(schema_of::<Event>)),
        op("get", "/v1/audit", "audit", "Query the audit log of state-changing calls (admin keys)").query::<AuditQuery>().ok::<AuditList>(),
        op("put", "/v1/inputs/{key}", "putInput", "Store an input object for batches (the body is its bytes)").bytes_in(OCTETS, "The input's bytes.").created::<InputObject>(),
        op("post", "/v1/batches", "submitBatch", "Submit a batch of tasks").body::<BatchSpec>().created::<Batch>(),
        op("get", "/v1/batches", "listBatches", "List batches").ok::<BatchList>(),
        op("get", "/v1/batches/{id}", "getBatch", "A batch and its counts").ok::<Batch>(),
        op("delete", "/v1/batches/{id}", "cancelBatch", "Cancel a batch; with purge=true, forget an ended one (204)").query::<PurgeQuery>().answer(Answer::JsonOrNoContent(schema_of::<Batch>)),
        op("get", "/v1/batches/{id}/tasks", "batchTasks", "A page of a batch's tasks").query::<TaskListQuery>().ok::<TaskList>(),
        op("get", "/v1/batches/{id}/manifest", "batchManifest", "A batch's manifest: every task's outputs and digests").ok::<Manifest>(),
        op("get", "/v1/batches/{id}/tasks/{task}/output", "batchOutput", "A task's output file (path=), or its error snapshot").query::<BatchOutputQuery>().answer(Answer::BytesOrJson(OCTETS, schema_of::<ErrorSnapshot>)),
        op("post", "/v1/jobs/{job}/suspend", "suspendJob", "Pause every sandbox of a job (labelled job=...)").ok::<JobResult>(),
        op("post", "/v1/jobs/{job}/resume", "resumeJob", "Resume every sandbox of a job").ok::<JobResult>(),
        op("get", "/v1/nodes", "listNodes", "The cluster's nodes").ok::<ClusterNodeList>(),
        op("post", "/v1/nodes/{name}/drain", "drainNode", "Stop placing sandboxes on a node").ok::<ClusterNode>(),
        op("post", "/v1/nodes/{name}/undrain", "undrainNode", "Place sandboxes on a node again").ok::<ClusterNode>(),
        // Commands.
        op("get", "/v1/sandboxes/{id}/terminal", "terminal", "A shell on a PTY, over a WebSocket (the console's terminal)").query::<TerminalQuery>().answer(Answer::WebSocket(schema_of::<TerminalInput>, schema_of::<ExecEvent>)),
        op("post", "/v1/sandboxes/{id}/exec", "exec", "Run a command and wait for its result").idempotent().body::<ExecRequest>().ok::<ExecResult>(),
        op("post", "/v1/sandboxes/{id}/exec/stream", "execStream", "Run a command, streaming its output (NDJSON)").idempotent().body::<ExecRequest>().ndjson::<ExecEvent>(),
        op("get", "/v1/sandboxes/{id}/log", "callLog", "The log of recorded calls (request ids) of a sandbox").query::<CallLogQuery>().ok::<CallLog>(),
        op("post", "/v1/sandboxes/{id}/fork", "forkSandbox", "Fork a sandbox into copies").body::<ForkRequest>().created::<ForkResult>(),
        op("post", "/v1/sandboxes/{id}/sessions", "createSession", "Start a shell session").body::<CreateSessionRequest>().created::<SessionInfo>(),
        op("get", "/v1/sandboxes/{id}/sessions", "listSessions", "List shell sessions").ok::<SessionList>(),
        op("delete", "/v1/sandboxes/{id}/sessions/{session}", "closeSession", "Close a session"),
        op("post", "/v1/sandboxes/{id}/sessions/{session}/run", "runInSession", "Run a command in a session's shell").idempotent().body::<SessionRunRequest>().ok::<SessionResult>(),
        op("post", "/v1/sandboxes/{id}/sessions/{session}/interrupt", "interruptSession", "Interrupt what a session runs (Ctrl-C)"),
        op("post", "/v1/sandboxes/{id}/processes", "startProcess", "Start a background process (optionally on a PTY)").idempotent().body::<StartProcessRequest>().created::<ProcessInfo>(),
        op("get", "/v1/sandboxes/{id}/processes", "listProcesses", "List processes started through the API").ok::<ProcessList>(),
        op("get", "/v1/sandboxes/{id}/processes/{pid}/output", "processOutput", "A process's output from offsets, optionally following it (NDJSON)").query::<OutputQuery>().ndjson::<ExecEvent>(),
        op("post", "/v1/sandboxes/{id}/processes/{pid}/stdin", "processStdin", "Write to a process's stdin").body::<StdinRequest>(),
        op("post", "/v1/sandboxes/{id}/processes/{pid}/signal", "signalProcess", "Send a signal to a process").body::<SignalRequest>(),
        op("post", "/v1/sandboxes/{id}/processes/{pid}/resize", "resizeProcess", "Resize a process's PTY").body::<PtySize>(),
        // Files.
        op("get", "/v1/sandboxes/{id}/files", "readFile", "Read a file (bytes; its FileInfo in the x-dsec-file-info header)").query::<ReadQuery>().answer(Answer::Bytes(OCTETS, "The file's bytes (from offset, up to length).")),
        op("put", "/v1/sandboxes/{id}/files", "writeFile", "Write a file (the body is its bytes, streamed)").idempotent().query::<WriteQuery>().bytes_in(OCTETS, "The file's bytes.").ok::<WriteResult>(),
        op("delete", "/v1/sandboxes/{id}/files", "removeFile", "Remove a file or directory").query::<RemoveQuery>(),
        op("get", "/v1/sandboxes/{id}/files/list", "listFiles", "List a directory").query::<PathQuery>().ok::<FileList>(),
        op("get", "/v1/sandboxes/{id}/files/stat", "statFile", "A file's metadata").query::<PathQuery>().ok::<FileInfo>(),
        op("post", "/v1/sandboxes/{id}/files/mkdir", "mkdir", "Make a directory").body::<MkdirRequest>(),
        op("post", "/v1/sandboxes/{id}/files/rename", "renameFile", "Rename a file or directory").body::<RenameRequest>(),
        op("get", "/v1/sandboxes/{id}/files/tar", "downloadTar", "A directory as a tar (streamed)").query::<PathQuery>().answer(Answer::Bytes(TAR, "A tar of the directory.")),
        op("put", "/v1/sandboxes/{id}/files/tar", "uploadTar", "Extract a tar into a directory (streamed)").idempotent().query::<TarUploadQuery>().bytes_in(TAR, "A tar, extracted under path.").ok::<WriteResult>(),
        // Images.
        op("get", "/v1/images", "listImages", "List images").ok::<ImageList>(),
        op("post", "/v1/images", "importImage", "Import an image from a rootfs tar or a registry reference").body::<ImportImageRequest>().created::<Image>(),
        op("post", "/v1/images/build", "buildImage", "Build an image from steps").body::<BuildRequest>().created::<BuildResult>(),
        op("post", "/v1/images/build/dockerfile", "buildDockerfile", "Build a Dockerfile (the body is the build context, a tar); progress as NDJSON").query::<DockerfileBuildQuery>().bytes_in(TAR, "The build context.").ndjson::<BuildEvent>(),
        op("post", "/v1/images/import/stream", "importImageStream", "Import an image, streaming progress (NDJSON)").body::<ImportImageRequest>().ndjson::<ImportEvent>(),
        op("post", "/v1/images/pull", "pullImage", "Pull an image from a registry, streaming progress (NDJSON)").body::<PullImageRequest>().ndjson::<ImportEvent>(),
        op("post", "/v1/images/upload", "uploadImage", "Import the archive in the body (rootfs tar, docker save, OCI archive or EROFS)").query::<UploadImageQuery>().bytes_in(OCTETS, "The archive, compressed or not.").created::<Image>(),
        op("post", "/v1/images/gc", "gcImages", "Collect unused layers").body::<GcRequest>().ok::<GcResult>(),
        op("get", "/v1/images/layers", "layerStats", "Layers and their on-demand fetch statistics per node").ok::<LayerStatsList>(),
        op("get", "/v1/images/{name}", "getImage", "An image").ok::<Image>(),
        op("delete", "/v1/images/{name}", "deleteImage", "Delete an image"),
        // Tenants and keys (admin keys).
        op("get", "/v1/tenants", "listTenants", "Every tenant (cluster admin)").ok::<Vec<Tenant>>(),
        op("post", "/v1/tenants", "createTenant", "Create a tenant (cluster admin)").body::<iam_api::CreateTenant>().created::<Tenant>(),
        op("get", "/v1/tenants/{tenant}", "getTenant", "A tenant").ok::<Tenant>(),
        op("patch", "/v1/tenants/{tenant}", "updateTenant", "Change a tenant's quotas or disable it (cluster admin)").body::<iam_api::UpdateTenant>().ok::<Tenant>(),
        op("get", "/v1/tenants/{tenant}/usage", "tenantUsage", "What a tenant holds against its quotas").ok::<Usage>(),
        op("get", "/v1/tenants/{tenant}/keys", "listKeys", "A tenant's keys, without secrets").ok::<Vec<KeyInfo>>(),
        op("post", "/v1/tenants/{tenant}/keys", "createKey", "Create a key (its secret is shown this once)").body::<iam_api::CreateKey>().created::<NewKey>(),
        op("get", "/v1/keys/{key_id}", "getKey", "A key, without secret").ok::<KeyInfo>(),
        op("delete", "/v1/keys/{key_id}", "revokeKey", "Revoke a key now").ok::<KeyInfo>(),
        op("post", "/v1/keys/{key_id}/rotate", "rotateKey", "A new key; the old one keeps working for grace_s").query::<iam_api::RotateKey>().created::<NewKey>(),
    ]
}

/// The error answer every operation may give.
fn error_response() -> Value {
    json!({
        "description": "An error: its stable code and a message. The status follows the \
                        code (bad_request 400, unauthorized 401, forbidden 403, not_found \
                        404, conflict 409, quota_exceeded 429, ...).",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
    })
}

/// Resolves `schema` to an object schema (following one `$ref` into `defs`).
fn resolve<'a>(schema: &'a Value, defs: &'a Map<String, Value>) -> &'a Value {
    schema
        .get("$ref")
        .and_then(Value::as_str)
        .and_then(|r| r.strip_prefix("#/components/schemas/"))
        .and_then(|name| defs.get(name))
        .unwrap_or(schema)
}

/// The query parameters of a query-string type: one per property.
fn query_parameters(schema: &Value, defs: &Map<String, Value>) -> Vec<Value> {
    let schema = resolve(schema, defs);
    let required: Vec<&str> = schema
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let Some(props) = schema.get("properties").and_then(Value::as_object) else {
        return Vec::new();
    };
    props
        .iter()
        .map(|(name, prop)| {
            let mut prop = prop.clone();
            let description = prop
                .as_object_mut()
                .and_then(|p| p.remove("description"))
                .unwrap_or(Value::Null);
            let mut p = json!({
                "name": name,
                "in": "query",
                "required": required.contains(&name.as_str()),
                "schema": prop,
            });
            if let Value::String(d) = description {
                p["description"] = Value::String(d);
            }
            p
        })
        .collect()
}

/// The path parameters of `path` (`{name}` segments).
fn path_parameters(path: &str) -> Vec<Value> {
    path.split('/')
        .filter_map(|seg| seg.strip_prefix('{')?.strip_suffix('}'))
        .map(|name| {
            let (schema, description) = match name {
                "pid" => (json!({"type": "integer", "minimum": 0}), "Process id (inside the sandbox)."),
                "key" => (json!({"type": "string"}), "The input's key; may contain slashes."),
                "id" => (json!({"type": "string"}), "Id of the sandbox (or the batch)."),
                _ => (json!({"type": "string"}), "Name or id."),
            };
            json!({"name": name, "in": "path", "required": true, "schema": schema, "description": description})
        })
        .collect()
}

fn media(schema: Value) -> Value {
    json!({"schema": schema})
}

fn operation_object(o: &Operation, g: &mut SchemaGenerator, defs: &Map<String, Value>) -> Value {
    let to_value = |s: Schema| s.to_value();
    let mut parameters = path_parameters(o.path);
    if let Some(q) = o.query {
        parameters.extend(query_parameters(&to_value(q(g)), defs));
    }
    if o.idempotent {
        parameters.push(json!({
            "name": "Idempotency-Key", "in": "header", "required": false,
            "schema": {"type": "string"},
            "description": "Record the call under this request id: a retry with the same id \
                            answers as the first call did instead of running again."
        }));
    }
    if o.last_event_id {
        parameters.push(json!({
            "name": "Last-Event-ID", "in": "header", "required": false,
            "schema": {"type": "string"},
            "description": "Replay events after this id (as `after`), sent by an SSE client \
                            on a reconnect."
        }));
    }
    let mut responses = Map::new();
    match o.answer {
        Answer::Json(status, s) => {
            let desc = if status == 201 { "Created." } else { "OK." };
            responses.insert(status.to_string(), json!({"description": desc, "content": {"application/json": media(to_value(s(g)))}}));
        }
        Answer::NoContent => {
            responses.insert("204".into(), json!({"description": "Done."}));
        }
        Answer::Ndjson(s) => {
            responses.insert("200".into(), json!({
                "description": "A stream of JSON values, one per line (each one the item schema), flushed as they happen.",
                "content": {"application/x-ndjson": {"schema": {"type": "string"}, "x-item-schema": to_value(s(g))}}
            }));
        }
        Answer::Sse(s) => {
            responses.insert("200".into(), json!({
                "description": "Server-Sent Events: each with its id and its kind as the event name, its data one value of the item schema. A comment every 15 s keeps the connection open; an error after the stream began is a last event named `error` holding an ApiError.",
                "content": {"text/event-stream": {"schema": {"type": "string"}, "x-item-schema": to_value(s(g))}}
            }));
        }
        Answer::Bytes(media_type, what) => {
            responses.insert("200".into(), json!({
                "description": what,
                "content": {media_type: media(json!({"type": "string", "contentMediaType": media_type}))}
            }));
        }
        Answer::BytesOrJson(media_type, s) => {
            responses.insert("200".into(), json!({
                "description": "The output's bytes when a path is given; else the task's error snapshot.",
                "content": {
                    media_type: media(json!({"type": "string", "contentMediaType": media_type})),
                    "application/json": media(to_value(s(g))),
                }
            }));
        }
        Answer::WebSocket(client, server) => {
            responses.insert(
                "101".into(),
                json!({
                    "description": format!(
                        "Switching Protocols: a WebSocket of subprotocol {TERMINAL_PROTOCOL}. The \
                         client sends x-client-message (JSON text; a binary message is stdin), the \
                         server x-server-message (JSON text) until the shell exits or either \
                         side closes; the shell is killed then. A browser, which cannot set \
                         headers, offers its key as a second subprotocol: {KEY_PROTOCOL_PREFIX} \
                         and the key in unpadded base64url."
                    ),
                    "x-client-message": to_value(client(g)),
                    "x-server-message": to_value(server(g)),
                }),
            );
        }
        Answer::JsonOrNoContent(s) => {
            responses.insert("200".into(), json!({"description": "OK.", "content": {"application/json": media(to_value(s(g)))}}));
            responses.insert("204".into(), json!({"description": "Done (purge)."}));
        }
    }
    responses.insert("default".into(), error_response());
    let mut object = json!({
        "operationId": o.id,
        "summary": o.summary,
        "tags": [o.tag],
        "parameters": parameters,
        "responses": responses,
    });
    match o.body {
        RequestBody::None => {}
        RequestBody::Json(s) => {
            object["requestBody"] =
                json!({"required": true, "content": {"application/json": media(to_value(s(g)))}});
        }
        RequestBody::Bytes(media_type, what) => {
            object["requestBody"] = json!({
                "required": true,
                "description": what,
                "content": {media_type: media(json!({"type": "string", "contentMediaType": media_type}))}
            });
        }
    }
    if o.public {
        object["security"] = json!([]);
    } else {
        let scope = dsec_iam::required_scope(o.method, o.path);
        object["x-dsec-scope"] = json!(scope.as_str());
        object["description"] = json!(format!("Needs a key with the `{scope}` scope."));
    }
    object
}

/// Builds the document.
pub fn document() -> Value {
    let ops = operations();
    let mut g = SchemaSettings::draft2020_12()
        .with(|s| s.definitions_path = "/components/schemas".into())
        .into_generator();
    // Naming every schema first lets the query parameters be read out of their types'.
    for o in &ops {
        operation_object(o, &mut g, &Map::new());
    }
    g.subschema_for::<crate::error::Answer<'static>>();
    let defs = g.definitions().clone();
    let mut paths: BTreeMap<String, Map<String, Value>> = BTreeMap::new();
    for o in &ops {
        let object = operation_object(o, &mut g, &defs);
        paths
            .entry(o.path.to_string())
            .or_default()
            .insert(o.method.to_string(), object);
    }
    json!({
        "openapi": "3.1.0",
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "info": {
            "title": "dsec",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "The API of dsec, an elastic sandbox platform for training \
                            and evaluating AI agents. Every call but the health and \
                            this document needs an API key (x-api-key, or \
                            Authorization: Bearer). Every answer carries its request \
                            id in x-request-id (send one to choose it). Times are unix \
                            milliseconds; durations name their unit.",
            "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"}
        },
        "security": [{"apiKey": []}, {"bearer": []}],
        "tags": TAGS.iter().map(|(name, d)| json!({"name": name, "description": d})).collect::<Vec<_>>(),
        "paths": paths,
        "components": {
            "securitySchemes": {
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
                "bearer": {"type": "http", "scheme": "bearer"}
            },
            "schemas": defs,
        }
    })
}

/// The tags, in the order a reader meets them.
const TAGS: &[(&str, &str)] = &[
    ("system", "Health, and this document."),
    (
        "sandboxes",
        "Create, inspect, pause, resume, commit and delete sandboxes.",
    ),
    (
        "commands",
        "Run commands: wait for the result, or stream the output.",
    ),
    (
        "sessions",
        "Shell sessions that keep their state between commands.",
    ),
    ("processes", "Background processes and PTYs."),
    (
        "screen",
        "A full VM's screen (screenshots) and keyboard (typed input).",
    ),
    (
        "files",
        "Read, write, list and move files; tars in and out.",
    ),
    ("images", "Import, pull, build, list and collect images."),
    ("pools", "Pools of warm sandboxes."),
    (
        "fncall",
        "Function calls on pooled sandboxes, and the admission queue.",
    ),
    (
        "batches",
        "Batches of tasks with inputs and collected outputs.",
    ),
    ("jobs", "Suspend and resume every sandbox of a job."),
    ("nodes", "The cluster's nodes: list, drain, undrain."),
    ("events", "Lifecycle events as Server-Sent Events."),
    ("audit", "The audit log of state-changing calls."),
    ("tenants", "Tenants and their quotas (admin keys)."),
    ("keys", "API keys (admin keys)."),
];

/// `(method, path)` of every documented operation, paths as the router writes them.
pub fn documented_routes() -> Vec<(&'static str, String)> {
    operations()
        .iter()
        .map(|o| (o.method, o.path.replace("{key}", "{*key}")))
        .collect()
}

//! envd, E2B's in-sandbox daemon, served by the node: `/health`, `/files` (download,
//! upload as octet-stream or multipart), and the `process.Process` and
//! `filesystem.Filesystem` Connect services. Processes are dsec background processes, so
//! `Connect` re-attaches and input, signals and PTY resizes reach them by pid.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{FromRequest, Multipart, Path, Query, Request};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine;
use dsec_control::{ByteStream, SandboxApi};
use dsec_wire::agent::{FileInfo, FileKind, ProcessInfo};
use dsec_wire::v1::{
    Command, ExecEvent, MkdirRequest, PtySize, RenameRequest, SignalRequest, StartProcessRequest,
    StdinRequest,
};
use dsec_wire::{ApiError, ErrorCode};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};

use super::{connect, rest, rfc3339, run_as_root, sandbox_id, DEFAULT_USER};

type Api = crate::Scoped;
const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// The most entries one `ListDir` gathers before it answers `bad_request`.
const LIST_DIR_MAX_ENTRIES: usize = 100_000;

pub(super) fn routes() -> Router<Arc<dyn SandboxApi>> {
    let cache = Arc::new(DefaultsCache::default());
    Router::new()
        .route("/health", get(health))
        .route(
            "/files",
            get(download)
                .post(upload)
                .layer(axum::extract::DefaultBodyLimit::disable()),
        )
        .route("/process.Process/{method}", post(process))
        .route("/filesystem.Filesystem/{method}", post(filesystem))
        .layer(axum::Extension(cache))
}

/// A method of an envd service that dsec does not serve.
fn not_served(service: &str, method: &str) -> ApiError {
    ApiError::new(
        ErrorCode::NotFound,
        format!("{service}/{method} is not served by dsec"),
    )
}

fn bad(m: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::BadRequest, m)
}

/// The user a request acts as: `Authorization: Basic base64("NAME:")`, else E2B's default.
/// The user a call names (Basic auth's user name), if any.
fn named_user(h: &HeaderMap) -> Option<String> {
    h.get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Basic "))
        .and_then(|b| B64.decode(b.trim()).ok())
        .and_then(|b| String::from_utf8(b).ok())
        .and_then(|s| s.split(':').next().map(str::to_string))
        .filter(|u| !u.is_empty())
}

/// What envd applies when a call names no user or working directory: a template's final
/// USER and WORKDIR (E2B's finalize makes them the sandbox's defaults), else E2B's `user`
/// in its home.
#[derive(Debug, Clone)]
struct Defaults {
    user: String,
    workdir: Option<String>,
}

/// Sandbox id -> its [`Defaults`], which never change in a sandbox's life. One per router
/// (an `Extension` of the envd routes), bounded: emptied when full; a miss costs a record
/// and an image lookup.
#[derive(Debug, Default)]
pub(super) struct DefaultsCache(std::sync::Mutex<std::collections::HashMap<String, Defaults>>);

type Cache = axum::Extension<Arc<DefaultsCache>>;

impl DefaultsCache {
    const MAX: usize = 65_536;

    fn get(&self, id: &str) -> Option<Defaults> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
    }

    fn put(&self, id: &str, d: Defaults) {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() >= Self::MAX {
            map.clear();
        }
        map.insert(id.to_string(), d);
    }
}

async fn defaults(api: &Api, cache: &DefaultsCache, id: &str) -> Result<Defaults, ApiError> {
    if let Some(d) = cache.get(id) {
        return Ok(d);
    }
    let sb = api.get_sandbox(id).await?;
    let mut d = Defaults {
        user: DEFAULT_USER.to_string(),
        workdir: None,
    };
    if sb.image.starts_with(super::template::IMAGE_PREFIX) {
        let img = api.get_image(&sb.image).await?;
        if let Some(u) = img.config.user.clone().filter(|u| !u.is_empty()) {
            d.user = u;
        }
        d.workdir = img.config.workdir.clone().filter(|w| !w.is_empty());
    }
    cache.put(id, d.clone());
    Ok(d)
}

/// The user of a call: the one it names, else the sandbox's default.
async fn user_of(
    api: &Api,
    cache: &DefaultsCache,
    id: &str,
    named: Option<String>,
) -> Result<String, ApiError> {
    match named {
        Some(u) => Ok(u),
        None => Ok(defaults(api, cache, id).await?.user),
    }
}

fn home(user: &str) -> String {
    if user == "root" {
        "/root".into()
    } else {
        format!("/home/{user}")
    }
}

/// envd resolves relative paths against the user's home.
fn resolve(path: &str, user: &str) -> String {
    if path.starts_with('/') {
        path.to_string()
    } else if path.is_empty() || path == "." {
        home(user)
    } else {
        format!("{}/{}", home(user), path.trim_start_matches("./"))
    }
}

/// Gives `path` to `user` (files the API writes belong to root otherwise).
async fn chown(api: &crate::Scoped, id: &str, path: &str, user: &str) -> Result<(), ApiError> {
    if user == "root" {
        return Ok(());
    }
    let argv = vec!["chown".into(), user.into(), path.into()];
    let r = run_as_root(api, id, Command::Argv(argv)).await?;
    if r.exit.exit_code != Some(0) {
        // The caller's user (Basic auth or `username`) that the sandbox lacks, most
        // likely: say so as the caller's mistake.
        return Err(ApiError::new(
            ErrorCode::BadRequest,
            format!(
                "giving {path} to user {user:?} failed ({}): name a user that exists in \
                 the sandbox",
                r.stderr.trim()
            ),
        ));
    }
    Ok(())
}

/// 204 while the sandbox runs; 502 once it is gone, as E2B's proxy answers (the SDK's
/// `is_running` reads exactly that).
async fn health(api: Api, headers: HeaderMap) -> Response {
    let Ok(id) = sandbox_id(&headers) else {
        return StatusCode::NO_CONTENT.into_response();
    };
    match api.get_sandbox(&id).await {
        Ok(sb) if sb.state == dsec_wire::v1::SandboxState::Ready => {
            StatusCode::NO_CONTENT.into_response()
        }
        Ok(_) | Err(_) => (StatusCode::BAD_GATEWAY, "sandbox not running").into_response(),
    }
}

// ---------------------------------------------------------------------------- /files

#[derive(Debug, Deserialize)]
struct FileQuery {
    #[serde(default)]
    path: Option<String>,
    #[serde(default)]
    username: Option<String>,
}

fn files_error(e: ApiError) -> Response {
    rest::error(e)
}

async fn download(
    api: Api,
    cache: Cache,
    headers: HeaderMap,
    Query(q): Query<FileQuery>,
) -> Response {
    let r = async {
        let id = sandbox_id(&headers)?;
        let user = user_of(
            &api,
            &cache,
            &id,
            q.username.clone().or_else(|| named_user(&headers)),
        )
        .await?;
        let path = resolve(
            q.path.as_deref().ok_or_else(|| bad("path is required"))?,
            &user,
        );
        let (info, body) = api.read_file(&id, &path, 0, None).await?;
        let stream = body.map(|r| r.map_err(|e| std::io::Error::other(e.message)));
        Ok::<_, ApiError>(
            (
                [
                    (header::CONTENT_TYPE, "application/octet-stream".to_string()),
                    (header::CONTENT_LENGTH, info.size.to_string()),
                ],
                axum::body::Body::from_stream(stream),
            )
                .into_response(),
        )
    }
    .await;
    r.unwrap_or_else(files_error)
}

fn write_info(path: &str) -> Value {
    let name = path.rsplit('/').next().unwrap_or(path);
    json!({"name": name, "type": "file", "path": path})
}

/// Writes one file as `user`, creating its parent directories like envd does.
async fn write_one(
    api: &crate::Scoped,
    id: &str,
    path: &str,
    user: &str,
    data: ByteStream,
) -> Result<Value, ApiError> {
    if let Some((parent, _)) = path.rsplit_once('/') {
        if !parent.is_empty() {
            api.mkdir(
                id,
                MkdirRequest {
                    path: parent.into(),
                },
            )
            .await?;
        }
    }
    api.write_file(id, path, None, data, None).await?;
    chown(api, id, path, user).await?;
    Ok(write_info(path))
}

async fn upload(api: Api, cache: Cache, Query(q): Query<FileQuery>, req: Request) -> Response {
    let r = async {
        let headers = req.headers().clone();
        let id = sandbox_id(&headers)?;
        let user = user_of(
            &api,
            &cache,
            &id,
            q.username.clone().or_else(|| named_user(&headers)),
        )
        .await?;
        let ctype = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        if headers.get(header::CONTENT_ENCODING).is_some() {
            return Err(bad(
                "compressed uploads are not supported (send without gzip)",
            ));
        }
        let mut written = Vec::new();
        if ctype.starts_with("multipart/form-data") {
            let mut form = Multipart::from_request(req, &())
                .await
                .map_err(|e| bad(format!("multipart: {e}")))?;
            while let Some(field) = form
                .next_field()
                .await
                .map_err(|e| bad(format!("multipart: {e}")))?
            {
                // The part's file name is its path; a lone file may take `?path=`.
                let name = field
                    .file_name()
                    .map(str::to_string)
                    .or_else(|| q.path.clone())
                    .ok_or_else(|| bad("a multipart file part has no file name"))?;
                let path = resolve(&name, &user);
                let data = field
                    .bytes()
                    .await
                    .map_err(|e| bad(format!("multipart: {e}")))?;
                let body: ByteStream = futures::stream::iter([Ok(data)]).boxed();
                written.push(write_one(&api, &id, &path, &user, body).await?);
            }
        } else {
            let path = resolve(
                q.path.as_deref().ok_or_else(|| bad("path is required"))?,
                &user,
            );
            let stream = req
                .into_body()
                .into_data_stream()
                .map(|r| r.map_err(|e| bad(format!("reading the upload: {e}"))))
                .boxed();
            written.push(write_one(&api, &id, &path, &user, stream).await?);
        }
        Ok(Json(written).into_response())
    }
    .await;
    r.unwrap_or_else(files_error)
}

// ---------------------------------------------------------------------------- helpers

/// The pid a `ProcessSelector` (`{"pid": N}` or `{"tag": "..."}`) names.
async fn selected_pid(api: &crate::Scoped, id: &str, sel: &Value) -> Result<u32, ApiError> {
    if let Some(pid) = sel.get("pid").and_then(Value::as_u64) {
        return u32::try_from(pid).map_err(|_| bad("pid out of range"));
    }
    if let Some(tag) = sel.get("tag").and_then(Value::as_str) {
        let list = api.list_processes(id).await?;
        return list
            .processes
            .iter()
            .find(|p| p.tag.as_deref() == Some(tag) && p.exit.is_none())
            .map(|p| p.pid)
            .ok_or_else(|| {
                ApiError::new(ErrorCode::NotFound, format!("no process tagged {tag:?}"))
            });
    }
    Err(bad("process selector needs pid or tag"))
}

fn argv(cmd: &Command) -> Vec<String> {
    match cmd {
        Command::Argv(a) => a.clone(),
        Command::Shell(s) => vec!["/bin/sh".into(), "-c".into(), s.clone()],
    }
}

fn process_config(p: &ProcessInfo) -> Value {
    let a = argv(&p.cmd);
    json!({
        "config": {"cmd": a.first().cloned().unwrap_or_default(), "args": &a[a.len().min(1)..], "envs": {}},
        "pid": p.pid,
        "tag": p.tag,
    })
}

/// Process output events as envd `ProcessEvent`s, from the given offsets, until exit.
/// A PTY's output is `data.pty`, a pipe's `data.stdout` / `data.stderr`.
async fn event_stream(
    api: crate::Scoped,
    id: String,
    pid: u32,
    offsets: (u64, u64),
    pty: bool,
) -> Result<futures::stream::BoxStream<'static, Result<Value, ApiError>>, ApiError> {
    let wrap = "event";
    let out_key = if pty { "pty" } else { "stdout" };
    let events = api
        .process_output(&id, pid, offsets.0, offsets.1, true)
        .await?;
    let start = futures::stream::once(async move { Ok(json!({wrap: {"start": {"pid": pid}}})) });
    let rest = events.filter_map(move |ev| async move {
        match ev {
            ExecEvent::Stdout { data } => Some(Ok(
                json!({wrap: {"data": {out_key: B64.encode(data.as_bytes())}}}),
            )),
            ExecEvent::Stderr { data } => Some(Ok(
                json!({wrap: {"data": {"stderr": B64.encode(data.as_bytes())}}}),
            )),
            ExecEvent::Exit { exit, .. } => {
                let (code, status) = match (exit.exit_code, exit.signal) {
                    (Some(c), _) => (c, format!("exit status {c}")),
                    // Go's names, as envd reports them.
                    (None, Some(9)) => (-1, "signal: killed".to_string()),
                    (None, Some(15)) => (-1, "signal: terminated".to_string()),
                    (None, Some(2)) => (-1, "signal: interrupt".to_string()),
                    (None, Some(s)) => (-1, format!("signal: {s}")),
                    (None, None) => (-1, "exited".to_string()),
                };
                Some(Ok(json!({wrap: {"end": {
                    "exitCode": code, "exited": true, "status": status,
                }}})))
            }
            ExecEvent::Error { error } => Some(Err(error)),
            _ => None,
        }
    });
    Ok(start.chain(rest).boxed())
}

// ---------------------------------------------------------------------------- process

async fn process(
    api: Api,
    cache: Cache,
    Path(method): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let ctype = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    let streaming = ctype.is_some_and(|c| c.starts_with("application/connect+"));
    let msg = match connect::request(ctype, &body) {
        Ok(m) => m,
        Err(e) => return connect::unary(Err(e)),
    };
    let id = match sandbox_id(&headers) {
        Ok(id) => id,
        Err(e) => return connect::unary(Err(e)),
    };
    if streaming {
        let r = match method.as_str() {
            "Start" => match defaults(&api, &cache, &id).await {
                Ok(d) => {
                    let user = named_user(&headers).unwrap_or_else(|| d.user.clone());
                    start(api, id, &user, d.workdir, &msg).await
                }
                Err(e) => Err(e),
            },
            "Connect" => reattach(api, id, &msg).await,
            other => Err(not_served("process.Process (streaming)", other)),
        };
        return match r {
            Ok(s) => connect::stream(s),
            Err(e) => connect::stream(futures::stream::iter([Err(e)]).boxed()),
        };
    }
    let r = async {
        match method.as_str() {
            "List" => {
                let list = api.list_processes(&id).await?;
                let running: Vec<Value> = list
                    .processes
                    .iter()
                    .filter(|p| p.exit.is_none())
                    .map(process_config)
                    .collect();
                Ok(json!({"processes": running}))
            }
            "SendInput" => {
                let pid = selected_pid(&api, &id, &msg["process"]).await?;
                let input = &msg["input"];
                let data = input["stdin"]
                    .as_str()
                    .or(input["pty"].as_str())
                    .unwrap_or("");
                let bytes = B64.decode(data).map_err(|e| bad(format!("input: {e}")))?;
                let text = String::from_utf8(bytes).map_err(|_| bad("input must be UTF-8 text"))?;
                api.process_stdin(
                    &id,
                    pid,
                    StdinRequest {
                        data: text,
                        close: false,
                    },
                )
                .await?;
                Ok(json!({}))
            }
            "CloseStdin" => {
                let pid = selected_pid(&api, &id, &msg["process"]).await?;
                api.process_stdin(
                    &id,
                    pid,
                    StdinRequest {
                        data: String::new(),
                        close: true,
                    },
                )
                .await?;
                Ok(json!({}))
            }
            "SendSignal" => {
                let pid = selected_pid(&api, &id, &msg["process"]).await?;
                let sig = match &msg["signal"] {
                    Value::String(s) => s.trim_start_matches("SIGNAL_").to_string(),
                    Value::Number(n) => match n.as_u64() {
                        Some(9) => "SIGKILL".into(),
                        Some(15) => "SIGTERM".into(),
                        _ => n.to_string(),
                    },
                    _ => return Err(bad("signal is required")),
                };
                api.signal_process(&id, pid, SignalRequest { signal: sig })
                    .await?;
                Ok(json!({}))
            }
            "Update" => {
                let pid = selected_pid(&api, &id, &msg["process"]).await?;
                let size = &msg["pty"]["size"];
                let (cols, rows) = (size["cols"].as_u64(), size["rows"].as_u64());
                if let (Some(cols), Some(rows)) = (cols, rows) {
                    api.resize_process(
                        &id,
                        pid,
                        PtySize {
                            cols: cols.min(u16::MAX as u64) as u16,
                            rows: rows.min(u16::MAX as u64) as u16,
                        },
                    )
                    .await?;
                }
                Ok(json!({}))
            }
            other => Err(not_served("process.Process", other)),
        }
    }
    .await;
    connect::unary(r)
}

async fn start(
    api: crate::Scoped,
    id: String,
    user: &str,
    default_cwd: Option<String>,
    msg: &Value,
) -> Result<futures::stream::BoxStream<'static, Result<Value, ApiError>>, ApiError> {
    let p = &msg["process"];
    let cmd = p["cmd"]
        .as_str()
        .filter(|c| !c.is_empty())
        .ok_or_else(|| bad("process.cmd is required"))?;
    let mut argv = vec![cmd.to_string()];
    if let Some(args) = p["args"].as_array() {
        argv.extend(args.iter().filter_map(Value::as_str).map(str::to_string));
    }
    let env = p["envs"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_string())))
                .collect()
        })
        .unwrap_or_default();
    let cwd = p["cwd"]
        .as_str()
        .filter(|c| !c.is_empty())
        .map(|c| resolve(c, user));
    let pty = msg["pty"]["size"].as_object().map(|s| PtySize {
        cols: s
            .get("cols")
            .and_then(Value::as_u64)
            .unwrap_or(80)
            .min(u16::MAX as u64) as u16,
        rows: s
            .get("rows")
            .and_then(Value::as_u64)
            .unwrap_or(24)
            .min(u16::MAX as u64) as u16,
    });
    let info = api
        .start_process(
            &id,
            StartProcessRequest {
                cmd: Command::Argv(argv),
                env,
                cwd: Some(cwd.or(default_cwd).unwrap_or_else(|| home(user))),
                pty,
                tag: msg["tag"].as_str().map(str::to_string),
                timeout_s: None,
                user: Some(user.to_string()),
                request_id: None,
            },
        )
        .await?;
    event_stream(api, id, info.pid, (0, 0), info.pty).await
}

/// `Connect`: the running process's output from now on, then its end.
async fn reattach(
    api: crate::Scoped,
    id: String,
    msg: &Value,
) -> Result<futures::stream::BoxStream<'static, Result<Value, ApiError>>, ApiError> {
    let pid = selected_pid(&api, &id, &msg["process"]).await?;
    let list = api.list_processes(&id).await?;
    let p = list
        .processes
        .iter()
        .find(|p| p.pid == pid)
        .ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("process {pid} not found")))?;
    let offsets = (p.stdout_bytes, p.stderr_bytes);
    event_stream(api, id, pid, offsets, p.pty).await
}

// ---------------------------------------------------------------------------- filesystem

fn entry(f: &FileInfo) -> Value {
    let kind = match f.kind {
        FileKind::Dir => "FILE_TYPE_DIRECTORY",
        FileKind::File => "FILE_TYPE_FILE",
        FileKind::Symlink => "FILE_TYPE_SYMLINK",
        FileKind::Other => "FILE_TYPE_UNSPECIFIED",
    };
    let mut perms = String::with_capacity(10);
    perms.push(match f.kind {
        FileKind::Dir => 'd',
        FileKind::Symlink => 'L',
        _ => '-',
    });
    for shift in [6u32, 3, 0] {
        let bits = (f.mode >> shift) & 7;
        perms.push(if bits & 4 != 0 { 'r' } else { '-' });
        perms.push(if bits & 2 != 0 { 'w' } else { '-' });
        perms.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    json!({
        "name": f.name,
        "type": kind,
        "path": f.path,
        "size": f.size.to_string(),
        "mode": f.mode & 0o7777,
        "permissions": perms,
        "owner": f.uid.to_string(),
        "group": f.gid.to_string(),
        "modifiedTime": rfc3339(u64::try_from(f.mtime.max(0)).unwrap_or(0) * 1000),
        "symlinkTarget": f.symlink_target,
    })
}

async fn filesystem(
    api: Api,
    cache: Cache,
    Path(method): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let ctype = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    let r = async {
        let msg = connect::request(ctype, &body)?;
        let id = sandbox_id(&headers)?;
        let user = user_of(&api, &cache, &id, named_user(&headers)).await?;
        let path = |key: &str| -> Result<String, ApiError> {
            msg[key]
                .as_str()
                .map(|p| resolve(p, &user))
                .ok_or_else(|| bad(format!("{key} is required")))
        };
        match method.as_str() {
            "Stat" => {
                let f = api.stat_file(&id, &path("path")?).await?;
                Ok(json!({"entry": entry(&f)}))
            }
            "MakeDir" => {
                let p = path("path")?;
                if api.stat_file(&id, &p).await.is_ok() {
                    return Err(ApiError::new(
                        ErrorCode::Conflict,
                        format!("{p} already exists"),
                    ));
                }
                api.mkdir(&id, MkdirRequest { path: p.clone() }).await?;
                chown(&api, &id, &p, &user).await?;
                let f = api.stat_file(&id, &p).await?;
                Ok(json!({"entry": entry(&f)}))
            }
            "Move" => {
                let (from, to) = (path("source")?, path("destination")?);
                api.rename_file(
                    &id,
                    RenameRequest {
                        from,
                        to: to.clone(),
                    },
                )
                .await?;
                let f = api.stat_file(&id, &to).await?;
                Ok(json!({"entry": entry(&f)}))
            }
            "ListDir" => {
                let p = path("path")?;
                let depth = msg["depth"].as_u64().unwrap_or(1).max(1);
                let mut out = Vec::new();
                let mut level = vec![p];
                // A walk ends where the tree does: a depth of 2^64 once spun here without
                // an await, holding a runtime thread (and the server with it).
                for _ in 0..depth {
                    if level.is_empty() {
                        break;
                    }
                    let mut next = Vec::new();
                    for dir in level {
                        if out.len() > LIST_DIR_MAX_ENTRIES {
                            return Err(ApiError::new(
                                ErrorCode::BadRequest,
                                format!(
                                    "ListDir: more than {LIST_DIR_MAX_ENTRIES} entries; \
                                     list a smaller tree or ask for less depth"
                                ),
                            ));
                        }
                        for f in api.list_files(&id, &dir).await?.entries {
                            if f.kind == FileKind::Dir {
                                next.push(f.path.clone());
                            }
                            out.push(entry(&f));
                        }
                    }
                    level = next;
                }
                Ok(json!({"entries": out}))
            }
            "Remove" => {
                api.remove_file(&id, &path("path")?, true).await?;
                Ok(json!({}))
            }
            other => Err(not_served("filesystem.Filesystem", other)),
        }
    }
    .await;
    connect::unary(r)
}

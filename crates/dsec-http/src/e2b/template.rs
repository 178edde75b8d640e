//! E2B's template-build API, as the `e2b` SDK's `Template.build` drives it: register a
//! build (`POST /v3/templates`), upload each COPY's files (`GET /templates/{id}/files/{hash}`
//! answers an upload URL; `PUT` there), start it (`POST /v2/templates/{id}/builds/{bid}`)
//! and poll its status and logs (`GET .../status?logsOffset=`); plus alias and tag lookups.
//!
//! A template build is a dsec Dockerfile build: the E2B steps become a Dockerfile with
//! E2B's semantics (commands through `bash -l -c`, a `user` made after the base, `USER`
//! making missing users, COPY owned by the current user, ENV expanded against the build
//! env), and the uploaded tars its context. The result is the image
//! `e2b-template/ALIAS:BUILD_ID`, tagged `e2b-template/ALIAS:TAG` per tag once ready; its
//! labels keep the build id, resources and start/ready commands, so templates live in the
//! image catalog (cluster-wide, durable) and a create finds them there. Build records
//! (status, logs) and uploaded files live on the API server that took the build.

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Path, Query};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use base64::Engine;
use dsec_wire::v1::{BuildEvent, DockerfileBuildRequest, Image, NetworkMode};
use dsec_wire::{ApiError, ErrorCode};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};

use super::rest::error;
use super::rfc3339;

type Api = crate::Scoped;

/// Image name prefix of built templates.
pub(super) const IMAGE_PREFIX: &str = "e2b-template/";
/// Labels of a template image.
pub(super) const LABEL_BUILD: &str = "e2b.build-id";
pub(super) const LABEL_CPU: &str = "e2b.cpu-count";
pub(super) const LABEL_MEMORY: &str = "e2b.memory-mb";
pub(super) const LABEL_START: &str = "e2b.start-cmd-b64";
pub(super) const LABEL_READY: &str = "e2b.ready-cmd-b64";
/// Tag of a template built without one.
pub(super) const DEFAULT_TAG: &str = "default";
/// Largest upload of one COPY's files.
const MAX_UPLOAD: u64 = 8 << 30;
/// Log entries kept per build.
const MAX_LOG_ENTRIES: usize = 20_000;
/// Builds remembered (the oldest finished ones go first).
const MAX_BUILDS: usize = 1_000;
/// How long an upload URL stays valid.
const UPLOAD_TTL: Duration = Duration::from_secs(3600);

/// Build records and uploaded files of this API server.
#[derive(Default)]
pub struct Templates {
    inner: Mutex<State>,
}

#[derive(Default)]
struct State {
    builds: HashMap<String, BuildRecord>,
    /// Upload token -> (file to write, made at).
    uploads: HashMap<String, (PathBuf, Instant)>,
}

struct BuildRecord {
    tenant: String,
    template: String,
    tags: Vec<String>,
    cpu: Option<u64>,
    memory_mb: Option<u64>,
    status: &'static str,
    logs: Vec<Value>,
    reason: Option<Value>,
    finished: Option<Instant>,
}

impl Templates {
    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        let mut g = match self.inner.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        f(&mut g)
    }

    fn log(&self, build: &str, level: &str, step: Option<&str>, message: String) {
        self.with(|s| {
            if let Some(b) = s.builds.get_mut(build) {
                if b.logs.len() < MAX_LOG_ENTRIES {
                    let mut e = json!({
                        "timestamp": rfc3339(now_ms()),
                        "level": level,
                        "message": message,
                    });
                    if let Some(step) = step {
                        e["step"] = json!(step);
                    }
                    b.logs.push(e);
                }
            }
        });
    }

    fn finish(&self, build: &str, result: Result<(), (String, String)>) {
        self.with(|s| {
            if let Some(b) = s.builds.get_mut(build) {
                b.finished = Some(Instant::now());
                match result {
                    Ok(()) => b.status = "ready",
                    Err((message, step)) => {
                        b.status = "error";
                        b.reason = Some(json!({"message": message, "step": step}));
                    }
                }
            }
        });
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::BadRequest, msg)
}

fn not_found(msg: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::NotFound, msg)
}

/// `[namespace/]alias[:tag]` -> (alias, tag); E2B's rules (lowercased, `default` = none).
pub(super) fn parse_name(name: &str) -> Result<(String, Option<String>), ApiError> {
    let name = name.trim().to_ascii_lowercase();
    let (head, tag) = match name.split_once(':') {
        Some((a, t)) => (a, Some(t)),
        None => (name.as_str(), None),
    };
    let alias = head.rsplit_once('/').map_or(head, |(_, n)| n);
    let ok_alias = !alias.is_empty()
        && alias.len() <= 64
        && alias
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-' || c == b'_');
    if !ok_alias {
        return Err(bad(format!(
            "template name {alias:?}: use a-z, 0-9, - and _ (at most 64)"
        )));
    }
    let tag = match tag {
        None | Some("default") => None,
        Some(t) => {
            let ok = !t.is_empty()
                && t.len() <= 40
                && t.bytes()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || b"-_.".contains(&c));
            if !ok {
                return Err(bad(format!(
                    "template tag {t:?}: use a-z, 0-9, -, _ and . (at most 40)"
                )));
            }
            Some(t.to_string())
        }
    };
    Ok((alias.to_string(), tag))
}

/// The catalog name of template `alias` at `tag` (a tag or a build id).
pub(super) fn image_name(alias: &str, tag: &str) -> String {
    format!("{IMAGE_PREFIX}{alias}:{tag}")
}

fn is_uuid(s: &str) -> bool {
    uuid::Uuid::parse_str(s).is_ok()
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct RequestBuild {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    alias: Option<String>,
    #[serde(default)]
    tags: Option<Vec<String>>,
    #[serde(default)]
    cpu_count: Option<u64>,
    #[serde(default, rename = "memoryMB")]
    memory_mb: Option<u64>,
}

/// `POST /v3/templates`.
pub(super) async fn request_build(
    api: Api,
    Extension(t): Extension<Arc<Templates>>,
    Json(req): Json<RequestBuild>,
) -> Response {
    let r = (|| {
        let name = req.name.or(req.alias).ok_or_else(|| bad("name: missing"))?;
        let (alias, tag) = parse_name(&name)?;
        let mut tags: Vec<String> = tag.into_iter().collect();
        for extra in req.tags.unwrap_or_default() {
            let (_, t) = parse_name(&format!("{alias}:{extra}"))?;
            let t = t.unwrap_or_else(|| DEFAULT_TAG.to_string());
            if is_uuid(&t) {
                return Err(bad(format!("tag {t:?}: a tag may not be a build id")));
            }
            if !tags.contains(&t) {
                tags.push(t);
            }
        }
        if tags.is_empty() {
            tags.push(DEFAULT_TAG.to_string());
        }
        let build_id = uuid::Uuid::new_v4().to_string();
        t.with(|s| {
            if s.builds.len() >= MAX_BUILDS {
                let oldest = s
                    .builds
                    .iter()
                    .filter_map(|(id, b)| b.finished.map(|f| (f, id.clone())))
                    .min();
                if let Some((_, id)) = oldest {
                    s.builds.remove(&id);
                }
            }
            s.builds.insert(
                build_id.clone(),
                BuildRecord {
                    tenant: api.caller().tenant.clone(),
                    template: alias.clone(),
                    tags: tags.clone(),
                    cpu: req.cpu_count,
                    memory_mb: req.memory_mb,
                    status: "waiting",
                    logs: Vec::new(),
                    reason: None,
                    finished: None,
                },
            );
        });
        Ok((
            StatusCode::ACCEPTED,
            Json(json!({
                "templateID": alias,
                "buildID": build_id,
                "public": false,
                "names": [name],
                "tags": tags,
                "aliases": [alias],
            })),
        )
            .into_response())
    })();
    r.unwrap_or_else(error)
}

/// Where the uploaded files of `hash` live for `tenant`.
fn files_path(tenant: &str, hash: &str) -> PathBuf {
    use sha2::Digest;
    let t = hex::encode(sha2::Sha256::digest(tenant.as_bytes()));
    std::env::temp_dir()
        .join("dsec-e2b-files")
        .join(&t[..16])
        .join(format!("{hash}.tar"))
}

fn valid_hash(hash: &str) -> bool {
    hash.len() == 64
        && hash
            .bytes()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
}

/// `GET /templates/{id}/files/{hash}`: whether the files are here, and where to upload
/// them (a URL carrying its own one-time token: the SDK sends no key there).
pub(super) async fn file_link(
    api: Api,
    Extension(t): Extension<Arc<Templates>>,
    headers: HeaderMap,
    Path((_template, hash)): Path<(String, String)>,
) -> Response {
    if !valid_hash(&hash) {
        return error(bad(format!("invalid files hash {hash:?}")));
    }
    let path = files_path(&api.caller().tenant, &hash);
    let present = path.is_file();
    let token = hex::encode(rand_bytes());
    t.with(|s| {
        s.uploads.retain(|_, (_, at)| at.elapsed() < UPLOAD_TTL);
        s.uploads.insert(token.clone(), (path, Instant::now()));
    });
    let host = headers
        .get(axum::http::header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("127.0.0.1");
    let scheme = headers
        .get("x-forwarded-proto")
        .and_then(|h| h.to_str().ok())
        .unwrap_or("http");
    (
        StatusCode::CREATED,
        Json(json!({
            "present": present,
            "url": format!("{scheme}://{host}/e2b/template-files/{token}"),
        })),
    )
        .into_response()
}

fn rand_bytes() -> [u8; 24] {
    use rand::RngCore;
    let mut b = [0u8; 24];
    rand::thread_rng().fill_bytes(&mut b);
    b
}

/// `PUT /e2b/template-files/{token}`: the files of one COPY (a tar, gzip or plain).
pub(super) async fn upload(
    Extension(t): Extension<Arc<Templates>>,
    Path(token): Path<String>,
    body: Body,
) -> Response {
    let dest = t.with(|s| s.uploads.remove(&token));
    let Some((dest, at)) = dest.filter(|(_, at)| at.elapsed() < UPLOAD_TTL) else {
        return error(not_found("unknown or expired upload URL"));
    };
    let _ = at;
    let r = async {
        use tokio::io::AsyncWriteExt;
        let dir = dest.parent().ok_or_else(|| bad("bad upload path"))?;
        let io = |e: std::io::Error| ApiError::new(ErrorCode::NoSpace, format!("upload: {e}"));
        tokio::fs::create_dir_all(dir).await.map_err(io)?;
        let tmp = dir.join(format!(".{}.part", hex::encode(rand_bytes())));
        let mut out = tokio::fs::File::create(&tmp).await.map_err(io)?;
        let mut stream = body.into_data_stream();
        let mut size = 0u64;
        let res: Result<(), ApiError> = async {
            while let Some(chunk) = stream.next().await {
                let chunk = chunk.map_err(|e| bad(format!("reading the upload: {e}")))?;
                size += chunk.len() as u64;
                if size > MAX_UPLOAD {
                    return Err(ApiError::new(
                        ErrorCode::PayloadTooLarge,
                        format!("an upload is at most {} GiB", MAX_UPLOAD >> 30),
                    ));
                }
                out.write_all(&chunk).await.map_err(io)?;
            }
            out.flush().await.map_err(io)?;
            tokio::fs::rename(&tmp, &dest).await.map_err(io)
        }
        .await;
        if res.is_err() {
            let _ = tokio::fs::remove_file(&tmp).await;
        }
        res
    }
    .await;
    match r {
        Ok(()) => StatusCode::OK.into_response(),
        Err(e) => error(e),
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct StartBuild {
    #[serde(default)]
    from_image: Option<String>,
    #[serde(default)]
    from_template: Option<String>,
    #[serde(default)]
    from_image_registry: Option<Value>,
    #[serde(default)]
    force: bool,
    #[serde(default)]
    steps: Vec<TemplateStep>,
    #[serde(default)]
    start_cmd: Option<String>,
    #[serde(default)]
    ready_cmd: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct TemplateStep {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    files_hash: Option<String>,
    #[serde(default)]
    force: bool,
}

/// `POST /v2/templates/{id}/builds/{bid}`: starts the build on a task of its own.
pub(super) async fn start_build(
    api: Api,
    Extension(t): Extension<Arc<Templates>>,
    Path((template, build)): Path<(String, String)>,
    Json(req): Json<StartBuild>,
) -> Response {
    let tenant = api.caller().tenant.clone();
    let rec = t.with(|s| match s.builds.get_mut(&build) {
        Some(b) if b.tenant == tenant && b.template == template => {
            if b.status != "waiting" {
                return Err(bad("build is not in waiting state"));
            }
            b.status = "building";
            Ok((b.tags.clone(), b.cpu, b.memory_mb))
        }
        _ => Err(not_found(format!(
            "build {build:?} of template {template:?} not found"
        ))),
    });
    let (tags, cpu, memory_mb) = match rec {
        Ok(v) => v,
        Err(e) => return error(e),
    };
    let plan = plan(&req, &template, &build, &tenant, cpu, memory_mb);
    let (dockerfile, steps_of_line, hashes) = match plan {
        Ok(v) => v,
        Err(e) => {
            t.finish(&build, Err((e.message.clone(), "base".into())));
            return error(e);
        }
    };
    let no_cache = req.force || req.steps.iter().any(|s| s.force);
    tokio::spawn(run_build(
        api,
        t,
        template,
        build,
        tags,
        dockerfile,
        steps_of_line,
        hashes,
        no_cache,
    ));
    StatusCode::ACCEPTED.into_response()
}

/// A Dockerfile value in double quotes.
fn quoted(v: &str) -> String {
    let mut s = String::with_capacity(v.len() + 2);
    s.push('"');
    for c in v.chars() {
        if c == '"' || c == '\\' {
            s.push('\\');
        }
        s.push(c);
    }
    s.push('"');
    s
}

fn one_line(what: &str, v: &str) -> Result<(), ApiError> {
    if v.contains(['\n', '\r']) {
        return Err(bad(format!("{what} {v:?}: no line breaks")));
    }
    Ok(())
}

/// The source path of a COPY inside its upload: `src` up to its last `/` before a glob.
fn copy_root(src: &str) -> String {
    let src = src.trim_start_matches("./");
    let glob = src.find(['*', '?', '[', '{']);
    let head = match glob {
        Some(i) => src[..i].rsplit_once('/').map_or("", |(h, _)| h),
        None => src.trim_end_matches('/'),
    };
    if head.is_empty() || head == "." {
        String::new()
    } else {
        head.to_string()
    }
}

type Planned = (String, Vec<String>, Vec<String>);

/// The Dockerfile of an E2B build, the E2B step of each of its lines (`base`, or a
/// 1-based step number), and the upload hashes its COPYs read.
fn plan(
    req: &StartBuild,
    template: &str,
    build: &str,
    tenant: &str,
    cpu: Option<u64>,
    memory_mb: Option<u64>,
) -> Result<Planned, ApiError> {
    if req.from_image_registry.is_some() {
        return Err(bad(
            "fromImageRegistry: registry credentials go in the server's --registry-auth file",
        ));
    }
    let from = match (&req.from_image, &req.from_template) {
        (Some(i), None) if !i.is_empty() => match i.as_str() {
            // E2B's default base image is dsec's.
            "e2bdev/base" | "e2bdev/base:latest" => "base".to_string(),
            other => other.to_string(),
        },
        (None, Some(t)) if !t.is_empty() => {
            let (alias, tag) = parse_name(t)?;
            image_name(&alias, tag.as_deref().unwrap_or(DEFAULT_TAG))
        }
        _ => return Err(bad("give exactly one of fromImage and fromTemplate")),
    };
    one_line("fromImage", &from)?;
    let mut lines: Vec<(String, String)> = Vec::new();
    let mut push = |step: &str, line: String| lines.push((step.to_string(), line));
    let base = "base";
    push(base, format!("FROM {from}"));
    let make_user = |name: &str| {
        let cmd = format!(
            "id -u {name} >/dev/null 2>&1 || useradd --create-home --shell /bin/bash {name}"
        );
        format!(
            "RUN {}",
            serde_json::to_string(&["/bin/sh", "-c", &cmd]).unwrap_or_default()
        )
    };
    // E2B's user phase: commands run as `user` from the first step on.
    push(base, "USER root".into());
    push(base, make_user("user"));
    push(base, "USER user".into());
    let mut user = "user".to_string();
    let mut hashes = Vec::new();
    for (i, s) in req.steps.iter().enumerate() {
        let n = (i + 1).to_string();
        let arg = |k: usize| s.args.get(k).map(String::as_str).unwrap_or("");
        match s.kind.as_str() {
            "RUN" => {
                let as_user = arg(1);
                if !as_user.is_empty() {
                    check_user(as_user)?;
                    push(&n, format!("USER {as_user}"));
                }
                let argv = ["/bin/bash", "-l", "-c", arg(0)];
                push(
                    &n,
                    format!("RUN {}", serde_json::to_string(&argv).unwrap_or_default()),
                );
                if !as_user.is_empty() {
                    push(&n, format!("USER {user}"));
                }
            }
            "ENV" => {
                if s.args.len() % 2 != 0 || s.args.is_empty() {
                    return Err(bad(format!("step {n}: ENV takes name/value pairs")));
                }
                let mut line = "ENV".to_string();
                for kv in s.args.chunks(2) {
                    let (k, v) = (&kv[0], &kv[1]);
                    let ok =
                        !k.is_empty() && k.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_');
                    if !ok {
                        return Err(bad(format!("step {n}: ENV name {k:?}")));
                    }
                    one_line("ENV value", v)?;
                    line.push_str(&format!(" {k}={}", quoted(v)));
                }
                push(&n, line);
            }
            "WORKDIR" => {
                let p = arg(0);
                if p.is_empty() {
                    return Err(bad(format!("step {n}: WORKDIR needs a path")));
                }
                one_line("WORKDIR", p)?;
                push(&n, format!("WORKDIR {p}"));
            }
            "USER" => {
                let name = arg(0);
                check_user(name)?;
                if name != "root" && !name.chars().all(|c| c.is_ascii_digit() || c == ':') {
                    push(&n, "USER root".into());
                    push(&n, make_user(name));
                }
                push(&n, format!("USER {name}"));
                user = name.to_string();
            }
            "COPY" => {
                let hash = s
                    .files_hash
                    .as_deref()
                    .filter(|h| valid_hash(h))
                    .ok_or_else(|| bad(format!("step {n}: COPY without a valid filesHash")))?;
                if !files_path(tenant, hash).is_file() {
                    return Err(bad(format!(
                        "step {n}: the files of {:?} (hash {hash}) were not uploaded",
                        arg(0)
                    )));
                }
                let (src, dest, owner, mode) = (arg(0), arg(1), arg(2), arg(3));
                if dest.is_empty() {
                    return Err(bad(format!("step {n}: COPY needs a destination")));
                }
                let root = copy_root(src);
                let source = if root.is_empty() {
                    format!("h/{hash}/")
                } else {
                    format!("h/{hash}/{root}")
                };
                let owner = if owner.is_empty() {
                    user.as_str()
                } else {
                    owner
                };
                let mut line = "COPY".to_string();
                if !matches!(owner, "root" | "0" | "root:root" | "0:0") {
                    check_user(owner)?;
                    let owner = if owner.contains(':') {
                        owner.to_string()
                    } else {
                        format!("{owner}:")
                    };
                    line.push_str(&format!(" --chown={owner}"));
                }
                if !mode.is_empty() {
                    if !mode.bytes().all(|c| (b'0'..=b'7').contains(&c)) || mode.len() > 4 {
                        return Err(bad(format!("step {n}: COPY mode {mode:?}")));
                    }
                    line.push_str(&format!(" --chmod={mode}"));
                }
                line.push(' ');
                line.push_str(&serde_json::to_string(&[source.as_str(), dest]).unwrap_or_default());
                push(&n, line);
                if !hashes.contains(&hash.to_string()) {
                    hashes.push(hash.to_string());
                }
            }
            other => return Err(bad(format!("step {n}: unknown step type {other:?}"))),
        }
    }
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let mut labels = vec![format!("{LABEL_BUILD}={}", quoted(build))];
    if let Some(c) = cpu {
        labels.push(format!("{LABEL_CPU}={}", quoted(&c.to_string())));
    }
    if let Some(m) = memory_mb {
        labels.push(format!("{LABEL_MEMORY}={}", quoted(&m.to_string())));
    }
    if let Some(start) = req.start_cmd.as_deref().filter(|s| !s.is_empty()) {
        labels.push(format!("{LABEL_START}={}", quoted(&b64(start))));
        // E2B's default check when a start command has none.
        let ready = req
            .ready_cmd
            .as_deref()
            .filter(|s| !s.is_empty())
            .unwrap_or("sleep 20");
        labels.push(format!("{LABEL_READY}={}", quoted(&b64(ready))));
    } else if let Some(ready) = req.ready_cmd.as_deref().filter(|s| !s.is_empty()) {
        labels.push(format!("{LABEL_READY}={}", quoted(&b64(ready))));
    }
    push("finalize", format!("LABEL {}", labels.join(" ")));
    let _ = template;
    let (steps, text): (Vec<String>, Vec<String>) = lines.into_iter().unzip();
    Ok((text.join("\n") + "\n", steps, hashes))
}

fn check_user(u: &str) -> Result<(), ApiError> {
    let ok = !u.is_empty()
        && u.len() <= 64
        && u.bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"_-.:".contains(&c));
    if ok {
        Ok(())
    } else {
        Err(bad(format!("user {u:?}: use letters, digits, _ - . and :")))
    }
}

/// The build context: the Dockerfile, and each upload's entries under `h/HASH/`.
fn context_tar(tenant: &str, dockerfile: &str, hashes: &[String]) -> Result<std::fs::File, String> {
    let file = tempfile::tempfile().map_err(|e| format!("temp file: {e}"))?;
    let mut b = tar::Builder::new(std::io::BufWriter::new(file));
    let mut h = tar::Header::new_gnu();
    h.set_size(dockerfile.len() as u64);
    h.set_mode(0o644);
    h.set_cksum();
    b.append_data(&mut h, "Dockerfile", dockerfile.as_bytes())
        .map_err(|e| e.to_string())?;
    for hash in hashes {
        let path = files_path(tenant, hash);
        let mut f = std::fs::File::open(&path).map_err(|e| format!("upload {hash}: {e}"))?;
        let mut magic = [0u8; 2];
        let gz = f.read_exact(&mut magic).is_ok() && magic == [0x1f, 0x8b];
        f.seek(SeekFrom::Start(0)).map_err(|e| e.to_string())?;
        let reader: Box<dyn Read> = if gz {
            Box::new(flate2::read::GzDecoder::new(f))
        } else {
            Box::new(f)
        };
        let mut a = tar::Archive::new(reader);
        let dir = format!("h/{hash}");
        let mut dh = tar::Header::new_gnu();
        dh.set_entry_type(tar::EntryType::Directory);
        dh.set_mode(0o755);
        dh.set_size(0);
        dh.set_cksum();
        b.append_data(&mut dh, &dir, std::io::empty())
            .map_err(|e| e.to_string())?;
        for entry in a.entries().map_err(|e| format!("upload {hash}: {e}"))? {
            let mut entry = entry.map_err(|e| format!("upload {hash}: {e}"))?;
            let name = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
            let clean: Vec<&str> = name
                .split('/')
                .filter(|c| !c.is_empty() && *c != ".")
                .collect();
            if clean.contains(&"..") {
                return Err(format!(
                    "upload {hash}: entry {name:?} leaves its directory"
                ));
            }
            if clean.is_empty() {
                continue;
            }
            let mut header = entry.header().clone();
            let target = format!("{dir}/{}", clean.join("/"));
            match header.entry_type() {
                tar::EntryType::Link => {
                    // Hard links name their target inside the same upload.
                    let link = entry
                        .link_name_bytes()
                        .map(|l| String::from_utf8_lossy(&l).into_owned())
                        .unwrap_or_default();
                    let link = link.trim_start_matches("./").trim_start_matches('/');
                    b.append_link(&mut header, &target, format!("{dir}/{link}"))
                        .map_err(|e| e.to_string())?;
                }
                tar::EntryType::Symlink => {
                    let link = entry
                        .link_name_bytes()
                        .map(|l| String::from_utf8_lossy(&l).into_owned())
                        .unwrap_or_default();
                    b.append_link(&mut header, &target, link)
                        .map_err(|e| e.to_string())?;
                }
                _ => {
                    b.append_data(&mut header, &target, &mut entry)
                        .map_err(|e| e.to_string())?;
                }
            }
        }
    }
    let mut file = b
        .into_inner()
        .map_err(|e| e.to_string())?
        .into_inner()
        .map_err(|e| e.to_string())?;
    file.flush().map_err(|e| e.to_string())?;
    file.seek(SeekFrom::Start(0)).map_err(|e| e.to_string())?;
    Ok(file)
}

#[allow(clippy::too_many_arguments)]
async fn run_build(
    api: Api,
    t: Arc<Templates>,
    template: String,
    build: String,
    tags: Vec<String>,
    dockerfile: String,
    steps_of_line: Vec<String>,
    hashes: Vec<String>,
    no_cache: bool,
) {
    let tenant = api.caller().tenant.clone();
    let (df, hs) = (dockerfile.clone(), hashes.clone());
    let ctx = tokio::task::spawn_blocking(move || context_tar(&tenant, &df, &hs)).await;
    let ctx = match ctx {
        Ok(Ok(f)) => f,
        Ok(Err(e)) => return t.finish(&build, Err((e, "base".into()))),
        Err(e) => return t.finish(&build, Err((e.to_string(), "base".into()))),
    };
    let req = DockerfileBuildRequest {
        name: image_name(&template, &build),
        network: NetworkMode::Open,
        no_cache,
        ..Default::default()
    };
    let mut step = "base".to_string();
    let mut events = match api.build_dockerfile(req, ctx).await {
        Ok(s) => s,
        Err(e) => return t.finish(&build, Err((e.message, step))),
    };
    let mut end = Err(("the build ended without a result".to_string(), step.clone()));
    while let Some(ev) = events.next().await {
        match ev {
            BuildEvent::Step {
                line, text, cached, ..
            } => {
                step = steps_of_line
                    .get(line.saturating_sub(1))
                    .cloned()
                    .unwrap_or_else(|| "base".into());
                let c = if cached { " (cached)" } else { "" };
                t.log(&build, "info", Some(&step), format!("{text}{c}"));
            }
            BuildEvent::Output { data, stream } => {
                let level = if stream == "stderr" { "warn" } else { "info" };
                for l in data.lines() {
                    t.log(&build, level, Some(&step), l.to_string());
                }
            }
            BuildEvent::Warning { message } => t.log(&build, "warn", None, message),
            BuildEvent::Done { image, .. } => {
                end = tag(&api, &template, &image, &tags).await;
                break;
            }
            BuildEvent::Error { error } => {
                t.log(&build, "error", Some(&step), error.message.clone());
                end = Err((error.message, step.clone()));
                break;
            }
        }
    }
    if end.is_ok() {
        t.log(
            &build,
            "info",
            Some("finalize"),
            format!("template {template} is ready"),
        );
    }
    t.finish(&build, end);
}

/// Names the built image `e2b-template/ALIAS:TAG` for each tag: a Dockerfile build of
/// a bare `FROM` (no step: a catalog write with the same layers and config).
async fn tag(
    api: &Api,
    template: &str,
    image: &Image,
    tags: &[String],
) -> Result<(), (String, String)> {
    for tag in tags {
        let dockerfile = format!("FROM {}\n", image.name);
        let ctx = context_tar("", &dockerfile, &[]).map_err(|e| (e, "finalize".to_string()))?;
        let req = DockerfileBuildRequest {
            name: image_name(template, tag),
            ..Default::default()
        };
        let mut events = api
            .build_dockerfile(req, ctx)
            .await
            .map_err(|e| (e.message, "finalize".to_string()))?;
        while let Some(ev) = events.next().await {
            match ev {
                BuildEvent::Done { .. } => break,
                BuildEvent::Error { error } => return Err((error.message, "finalize".into())),
                _ => {}
            }
        }
    }
    Ok(())
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct StatusQuery {
    #[serde(default)]
    logs_offset: Option<usize>,
    #[serde(default)]
    limit: Option<usize>,
    #[serde(default)]
    level: Option<String>,
}

fn level_rank(l: &str) -> u8 {
    match l {
        "debug" => 0,
        "info" => 1,
        "warn" => 2,
        _ => 3,
    }
}

/// `GET /templates/{id}/builds/{bid}/status`.
pub(super) async fn status(
    api: Api,
    Extension(t): Extension<Arc<Templates>>,
    Path((template, build)): Path<(String, String)>,
    Query(q): Query<StatusQuery>,
) -> Response {
    let tenant = api.caller().tenant.clone();
    let min = q.level.as_deref().map_or(0, level_rank);
    let r = t.with(|s| {
        let b = s
            .builds
            .get(&build)
            .filter(|b| b.tenant == tenant && b.template == template)
            .ok_or_else(|| bad(format!("Build '{build}' not found")))?;
        let entries: Vec<&Value> = b
            .logs
            .iter()
            .filter(|e| level_rank(e["level"].as_str().unwrap_or("info")) >= min)
            .collect();
        let from = q.logs_offset.unwrap_or(0).min(entries.len());
        let limit = q.limit.unwrap_or(100).clamp(1, 100);
        let page: Vec<&Value> = entries[from..].iter().take(limit).copied().collect();
        let mut v = json!({
            "templateID": template,
            "buildID": build,
            "status": b.status,
            "logs": [],
            "logEntries": page,
        });
        if let Some(r) = &b.reason {
            v["reason"] = r.clone();
        }
        Ok::<_, ApiError>(v)
    });
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => error(e),
    }
}

/// Built template images of `alias` (all tags and build ids).
async fn images_of(api: &Api, alias: &str) -> Result<Vec<(String, Image)>, ApiError> {
    let prefix = format!("{IMAGE_PREFIX}{alias}:");
    Ok(api
        .list_images()
        .await?
        .images
        .into_iter()
        .filter_map(|i| {
            i.name
                .strip_prefix(&prefix)
                .map(str::to_string)
                .map(|tag| (tag, i))
        })
        .collect())
}

/// `GET /templates/aliases/{alias}`.
pub(super) async fn alias(api: Api, Path(name): Path<String>) -> Response {
    let r = async {
        let (alias, tag) = parse_name(&name)?;
        let images = images_of(&api, &alias).await?;
        if images.is_empty() {
            return Err(not_found(format!("template '{alias}' not found")));
        }
        if let Some(tag) = tag {
            if !images.iter().any(|(t, _)| *t == tag) {
                return Err(not_found(format!(
                    "tag '{tag}' does not exist for template '{alias}'"
                )));
            }
        }
        Ok(Json(json!({"templateID": alias, "public": false})).into_response())
    }
    .await;
    r.unwrap_or_else(error)
}

/// `GET /templates/{name}/tags`.
pub(super) async fn tags(api: Api, Path(name): Path<String>) -> Response {
    let r = async {
        let (alias, _) = parse_name(&name)?;
        let images = images_of(&api, &alias).await?;
        if images.is_empty() {
            return Err(not_found(format!("template '{alias}' not found")));
        }
        let list: Vec<Value> = images
            .iter()
            .filter(|(tag, _)| !is_uuid(tag))
            .map(|(tag, img)| {
                json!({
                    "tag": tag,
                    "buildID": img.config.labels.get(LABEL_BUILD).cloned().unwrap_or_default(),
                    "createdAt": rfc3339(img.created_at),
                })
            })
            .collect();
        Ok(Json(list).into_response())
    }
    .await;
    r.unwrap_or_else(error)
}

/// The built template image `name` (`alias[:tag]` or `alias:BUILD_ID`) names, `None`
/// when it names no template (a plain dsec image, then). A template whose tag has no
/// ready build is `not_found` "tag ... does not exist" (Harbor waits on that).
pub(super) async fn resolve(api: &Api, name: &str) -> Result<Option<Image>, ApiError> {
    let Ok((alias, tag)) = parse_name(name) else {
        return Ok(None);
    };
    let tag = tag.unwrap_or_else(|| DEFAULT_TAG.to_string());
    // Point lookups first (the template's build, then a plain image of that name); only
    // a name that is neither lists the images, to tell a missing tag from no template.
    if let Some(img) = found(api.get_image(&format!("{IMAGE_PREFIX}{alias}:{tag}")).await)? {
        return Ok(Some(img));
    }
    if found(api.get_image(name).await)?.is_some() {
        return Ok(None);
    }
    if images_of(api, &alias).await?.is_empty() {
        return Ok(None);
    }
    Err(not_found(format!(
        "tag '{tag}' does not exist for template '{alias}'"
    )))
}

/// An image lookup's answer with "no such image" as `None`.
fn found(res: Result<Image, ApiError>) -> Result<Option<Image>, ApiError> {
    match res {
        Ok(img) => Ok(Some(img)),
        Err(e) if e.code == dsec_wire::ErrorCode::ImageNotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// The resources a template was built with (unset: the server's defaults).
pub(super) fn resources(img: &Image) -> dsec_wire::v1::Resources {
    let label = |k: &str| img.config.labels.get(k).and_then(|v| v.parse::<u64>().ok());
    dsec_wire::v1::Resources {
        cpu: label(LABEL_CPU).map(|c| c as f64),
        memory_mb: label(LABEL_MEMORY),
        ..Default::default()
    }
}

/// Longest a create waits for a template's ready command.
const READY_TIMEOUT: Duration = Duration::from_secs(600);

/// Starts the template's start command in sandbox `id` and waits for its ready command
/// to succeed (as the template's user, in its workdir).
pub(super) async fn start(api: &Api, id: &str, img: &Image) -> Result<(), ApiError> {
    let decode = |k: &str| {
        img.config.labels.get(k).and_then(|v| {
            base64::engine::general_purpose::STANDARD
                .decode(v)
                .ok()
                .and_then(|b| String::from_utf8(b).ok())
        })
    };
    let (start_cmd, ready_cmd) = (decode(LABEL_START), decode(LABEL_READY));
    let shell = |c: &str| {
        dsec_wire::v1::Command::Argv(vec![
            "/bin/bash".into(),
            "-l".into(),
            "-c".into(),
            c.to_string(),
        ])
    };
    let user = img.config.user.clone();
    let cwd = img.config.workdir.clone();
    if let Some(cmd) = &start_cmd {
        api.start_process(
            id,
            dsec_wire::v1::StartProcessRequest {
                cmd: shell(cmd),
                env: Default::default(),
                cwd: cwd.clone(),
                pty: None,
                tag: Some("e2b-start-cmd".into()),
                timeout_s: None,
                user: user.clone(),
                request_id: None,
            },
        )
        .await?;
    }
    let Some(ready) = ready_cmd else {
        return Ok(());
    };
    let started = Instant::now();
    loop {
        let r = api
            .exec(
                id,
                dsec_wire::v1::ExecRequest {
                    cmd: shell(&ready),
                    env: Default::default(),
                    cwd: cwd.clone(),
                    stdin: None,
                    timeout_s: Some(READY_TIMEOUT.as_secs_f64()),
                    output_limit: Some(64 << 10),
                    user: user.clone(),
                    request_id: None,
                },
            )
            .await?;
        if r.exit.exit_code == Some(0) {
            return Ok(());
        }
        if started.elapsed() > READY_TIMEOUT {
            return Err(ApiError::new(
                ErrorCode::Timeout,
                format!(
                    "the template's ready command {ready:?} did not succeed in {} s",
                    READY_TIMEOUT.as_secs()
                ),
            ));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_like_e2b() {
        assert_eq!(parse_name("My-Env").ok(), Some(("my-env".into(), None)));
        assert_eq!(
            parse_name("team/env:v1.2").ok(),
            Some(("env".into(), Some("v1.2".into())))
        );
        assert_eq!(parse_name("env:default").ok(), Some(("env".into(), None)));
        assert!(parse_name("bad name").is_err());
        assert!(parse_name("env:Bad/Tag").is_err());
    }

    #[test]
    fn copy_roots_strip_globs() {
        assert_eq!(copy_root("app"), "app");
        assert_eq!(copy_root("app/"), "app");
        assert_eq!(copy_root("app/*.txt"), "app");
        assert_eq!(copy_root("*.py"), "");
        assert_eq!(copy_root("."), "");
        assert_eq!(copy_root("./src/**/x"), "src");
    }

    #[test]
    fn steps_become_a_dockerfile_with_e2b_semantics() {
        let req: StartBuild = serde_json::from_value(json!({
            "fromImage": "e2bdev/base",
            "steps": [
                {"type": "ENV", "args": ["A", "say \"hi\" $HOME"], "force": false},
                {"type": "RUN", "args": ["echo 1 && echo 2", "root"], "force": false},
                {"type": "WORKDIR", "args": ["/work"], "force": false},
                {"type": "USER", "args": ["agent"], "force": false},
            ],
            "startCmd": "serve",
        }))
        .expect("parses");
        let (df, steps, hashes) = plan(&req, "t", "b", "tenant", Some(2), None).expect("plans");
        let lines: Vec<&str> = df.lines().collect();
        assert_eq!(lines[0], "FROM base");
        assert!(lines.contains(&r#"ENV A="say \"hi\" $HOME""#), "{df}");
        assert!(
            lines.contains(&r#"RUN ["/bin/bash","-l","-c","echo 1 && echo 2"]"#),
            "{df}"
        );
        assert!(lines.contains(&"USER agent"), "{df}");
        assert_eq!(steps.len(), lines.len());
        assert_eq!(steps[0], "base");
        assert_eq!(steps.last().map(String::as_str), Some("finalize"));
        assert!(hashes.is_empty());
        // Parsed and planned by the real front end.
        let parsed = dsec_dockerfile::parse(&df).expect("parses");
        let planned = dsec_dockerfile::plan(&parsed, &Default::default(), None).expect("plans");
        let target = planned.target().expect("a stage");
        assert_eq!(target.config.user.as_deref(), Some("agent"));
        assert_eq!(target.config.workdir.as_deref(), Some("/work"));
        assert!(target.config.labels.contains_key(LABEL_START));
    }
}

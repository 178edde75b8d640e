//! E2B's REST API (the control-plane half): sandboxes created from templates, listed by
//! metadata, killed, timed out, paused, resumed and connected to.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{Path, Query};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use dsec_control::SandboxApi;
use dsec_wire::v1::{
    Command, CreateSandboxRequest, NetworkMode, NetworkPolicy, Sandbox, SandboxState,
    SetTimeoutRequest,
};
use dsec_wire::{ApiError, ErrorCode};
use serde::Deserialize;
use serde_json::{json, Value};

use super::{rfc3339, run_as_root, DEFAULT_USER, ENVD_VERSION, META_PREFIX, TEMPLATE_LABEL};

type Api = crate::Scoped;

/// E2B's default sandbox lifetime when a create names none.
const DEFAULT_TIMEOUT_S: u64 = 15;

pub(super) fn routes() -> Router<Arc<dyn SandboxApi>> {
    Router::new()
        .route("/sandboxes", post(create).get(list))
        .route("/v2/sandboxes", post(create).get(list))
        .route("/sandboxes/{id}", get(detail).delete(kill))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route(
            "/sandboxes/{id}/network",
            axum::routing::put(update_network),
        )
        .route("/sandboxes/{id}/refreshes", post(refresh))
        .route("/sandboxes/{id}/connect", post(connect))
        .route("/v2/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/sandboxes/{id}/resume", post(resume))
        .route("/v3/templates", post(super::template::request_build))
        .route(
            "/templates/{id}/files/{hash}",
            get(super::template::file_link),
        )
        .route(
            "/v2/templates/{id}/builds/{build}",
            post(super::template::start_build),
        )
        .route(
            "/templates/{id}/builds/{build}/status",
            get(super::template::status),
        )
        .route("/templates/aliases/{alias}", get(super::template::alias))
        .route("/templates/{id}/tags", get(super::template::tags))
}

/// An E2B error answer: the HTTP status and `{"code": status, "message"}`.
pub(super) fn error(e: ApiError) -> Response {
    let status =
        StatusCode::from_u16(e.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        status,
        Json(json!({"code": status.as_u16(), "message": e.message})),
    )
        .into_response()
}

fn answer(r: Result<Response, ApiError>) -> Response {
    r.unwrap_or_else(error)
}

fn metadata(sb: &Sandbox) -> Value {
    let m: BTreeMap<&str, &str> = sb
        .labels
        .iter()
        .filter_map(|(k, v)| k.strip_prefix(META_PREFIX).map(|k| (k, v.as_str())))
        .collect();
    json!(m)
}

fn template(sb: &Sandbox) -> String {
    sb.labels
        .get(TEMPLATE_LABEL)
        .cloned()
        .unwrap_or_else(|| sb.image.clone())
}

fn state(sb: &Sandbox) -> &'static str {
    if sb.state == SandboxState::Paused {
        "paused"
    } else {
        "running"
    }
}

/// The `Sandbox` answer of create, connect and resume.
fn created(sb: &Sandbox, token: Option<&str>) -> Value {
    json!({
        "templateID": template(sb),
        "sandboxID": sb.id,
        "clientID": "dsec",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": token,
        "domain": null,
        "alias": template(sb),
    })
}

/// `ListedSandbox` (and, with the token, `SandboxDetail`).
fn listed(sb: &Sandbox, token: Option<&str>) -> Value {
    let mut v = json!({
        "templateID": template(sb),
        "alias": template(sb),
        "sandboxID": sb.id,
        "clientID": "dsec",
        "startedAt": rfc3339(sb.created_at),
        "endAt": rfc3339(sb.expires_at),
        "cpuCount": sb.resources.cpu.ceil().max(1.0) as u64,
        "memoryMB": sb.resources.memory_mb,
        "diskSizeMB": sb.resources.disk_mb.unwrap_or(0),
        "state": state(sb),
        "envdVersion": ENVD_VERSION,
        "metadata": metadata(sb),
    });
    if let Some(t) = token {
        v["envdAccessToken"] = json!(t);
    }
    v
}

fn api_key(h: &HeaderMap) -> Option<String> {
    h.get(dsec_wire::v1::API_KEY_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: String,
    #[serde(default)]
    timeout: Option<u64>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
    #[serde(default)]
    auto_resume: Option<Value>,
    #[serde(default, rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    #[serde(default)]
    network: Option<EgressRules>,
}

/// E2B's egress rules: the `network` of a create, and the body of
/// `PUT /sandboxes/{id}/network` (which replaces them: what it omits is cleared). Its
/// ingress and DNS settings (`allowPublicTraffic`, `maskRequestHost`, `httpsPorts`,
/// `dnsServers`) have no dsec counterpart and are ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct EgressRules {
    #[serde(default)]
    allow_out: Option<Vec<String>>,
    #[serde(default)]
    deny_out: Option<Vec<String>>,
    #[serde(default)]
    rules: Option<Value>,
    #[serde(default)]
    egress_proxy: Option<Value>,
}

/// What denies every destination in E2B's `denyOut`.
const DENY_ALL: &[&str] = &["0.0.0.0/0", "::/0"];

/// The dsec network of E2B egress settings. E2B allows everything unless `denyOut`
/// says otherwise, and `allowOut` wins over `denyOut`; `allow_internet_access: false`
/// denies everything. dsec has allow lists, not deny lists: `denyOut` must be empty
/// (open) or deny everything (an allow list of `allowOut`, empty: no egress at all);
/// no internet and no allowed destinations is mode `none`.
fn egress_policy(
    allow_internet: bool,
    rules: Option<&EgressRules>,
) -> Result<NetworkPolicy, ApiError> {
    let empty = EgressRules::default();
    let r = rules.unwrap_or(&empty);
    let set = |v: &Option<Value>| {
        v.as_ref()
            .is_some_and(|v| !v.is_null() && *v != Value::Object(Default::default()))
    };
    if set(&r.rules) || set(&r.egress_proxy) {
        return Err(ApiError::new(
            ErrorCode::BadRequest,
            "network: per-domain transform rules and egress proxies are not supported by dsec",
        ));
    }
    let allow = r.allow_out.clone().unwrap_or_default();
    let deny = r.deny_out.clone().unwrap_or_default();
    let deny_all = deny.iter().any(|d| DENY_ALL.contains(&d.trim()));
    if !deny.is_empty() && !deny_all {
        return Err(ApiError::new(
            ErrorCode::BadRequest,
            format!(
                "network: dsec cannot deny some destinations and allow the rest (denyOut \
                 {deny:?}); deny all (\"0.0.0.0/0\") and list what is allowed in allowOut"
            ),
        ));
    }
    let (mode, allow) = match (allow_internet && !deny_all, allow.is_empty()) {
        (true, _) => (NetworkMode::Open, Vec::new()),
        (false, true) if !allow_internet => (NetworkMode::None, Vec::new()),
        (false, _) => (NetworkMode::Allowlist, allow),
    };
    Ok(NetworkPolicy { mode, allow })
}

/// `PUT /sandboxes/{id}/network`: replaces the sandbox's egress rules. A sandbox made
/// without network (`allow_internet_access: false` and nothing allowed) keeps none:
/// dsec does not add a network to a running sandbox.
async fn update_network(api: Api, Path(id): Path<String>, Json(b): Json<EgressRules>) -> Response {
    answer(
        async {
            let policy = egress_policy(true, Some(&b))?;
            api.set_network(&id, policy).await?;
            Ok(StatusCode::NO_CONTENT.into_response())
        }
        .await,
    )
}

/// The commands that give an image E2B's `user` (uid 1000, home /home/user) when it has
/// none.
const ENSURE_USER: &str = "id -u user >/dev/null 2>&1 || { \
    grep -q '^user:' /etc/group || echo 'user:x:1000:' >> /etc/group; \
    echo 'user:x:1000:1000::/home/user:/bin/bash' >> /etc/passwd; }; \
    mkdir -p /home/user && chown user:user /home/user";

async fn create(api: Api, headers: HeaderMap, Json(req): Json<NewSandbox>) -> Response {
    answer(
        async {
            let template = req.template_id.clone();
            let mut labels: BTreeMap<String, String> = req
                .metadata
                .unwrap_or_default()
                .into_iter()
                .map(|(k, v)| (format!("{META_PREFIX}{k}"), v))
                .collect();
            labels.insert(TEMPLATE_LABEL.into(), template.clone());
            // A built template (`alias[:tag]`, `alias:BUILD_ID`) or a plain dsec image.
            let built = super::template::resolve(&api, &template).await?;
            let (image, resources) = match &built {
                Some(img) => (img.name.clone(), super::template::resources(img)),
                None => (template, Default::default()),
            };
            let sb = api
                .create_sandbox(CreateSandboxRequest {
                    image: Some(image),
                    resources,
                    timeout_s: Some(req.timeout.unwrap_or(DEFAULT_TIMEOUT_S)),
                    env: req.env_vars.unwrap_or_default(),
                    labels,
                    // E2B's `user` may not exist before ENSURE_USER makes it below, and
                    // a create validates its user; envd names its user on every call.
                    user: None,
                    // A template's WORKDIR (E2B's finalize makes it the default).
                    workdir: Some(
                        built
                            .as_ref()
                            .and_then(|img| img.config.workdir.clone())
                            .filter(|w| !w.is_empty())
                            .unwrap_or_else(|| format!("/home/{DEFAULT_USER}")),
                    ),
                    auto_resume: req.auto_resume.is_some_and(|v| v != Value::Bool(false)),
                    network: egress_policy(
                        req.allow_internet_access == Some(true),
                        req.network.as_ref(),
                    )?,
                    ..Default::default()
                })
                .await?;
            let setup = run_as_root(&api, &sb.id, Command::Shell(ENSURE_USER.into())).await;
            match setup {
                Ok(r) if r.exit.exit_code == Some(0) => {}
                other => {
                    let _ = api.delete_sandbox(&sb.id).await;
                    // The template's own lack (no shell, no writable /etc/passwd) is the
                    // caller's to fix; an unreachable agent or a timeout is not.
                    let (code, why) = match other {
                        Ok(r) => (
                            ErrorCode::BadRequest,
                            format!("exit {:?}: {}", r.exit.exit_code, r.stderr.trim()),
                        ),
                        Err(e) if e.code.http_status() >= 500 => (e.code, e.message),
                        Err(e) => (ErrorCode::BadRequest, e.message),
                    };
                    return Err(ApiError::new(
                        code,
                        format!(
                            "template {:?} cannot host an E2B sandbox: making its user \
                             {DEFAULT_USER:?} (uid 1000) failed ({why}); an E2B template \
                             needs /bin/sh and a writable /etc/passwd",
                            req.template_id
                        ),
                    ));
                }
            }
            if let Some(img) = &built {
                if let Err(e) = super::template::start(&api, &sb.id, img).await {
                    let _ = api.delete_sandbox(&sb.id).await;
                    return Err(e);
                }
            }
            let token = api_key(&headers);
            Ok((StatusCode::CREATED, Json(created(&sb, token.as_deref()))).into_response())
        }
        .await,
    )
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ListQuery {
    #[serde(default)]
    metadata: Option<String>,
    #[serde(default)]
    state: Option<String>,
    #[serde(default)]
    limit: Option<usize>,
    #[serde(default)]
    next_token: Option<String>,
}

async fn list(api: Api, Query(q): Query<ListQuery>) -> Response {
    answer(
        async {
            // `metadata` is itself a query string of URL-quoted pairs.
            let mut filter = BTreeMap::new();
            if let Some(m) = q.metadata.as_deref() {
                for (k, v) in url::form_urlencoded::parse(m.as_bytes()) {
                    let k = percent_decode(&k);
                    let v = percent_decode(&v);
                    filter.insert(format!("{META_PREFIX}{k}"), v);
                }
            }
            let states: Vec<&str> = q
                .state
                .as_deref()
                .map(|s| s.split(',').collect())
                .unwrap_or_default();
            let mut all: Vec<Sandbox> = api
                .list_sandboxes(filter)
                .await?
                .sandboxes
                .into_iter()
                .filter(|s| matches!(s.state, SandboxState::Ready | SandboxState::Paused))
                .filter(|s| states.is_empty() || states.contains(&state(s)))
                .collect();
            all.sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.id.cmp(&b.id)));
            // Pages: `nextToken` is the id the next page starts after.
            if let Some(after) = q.next_token.as_deref() {
                if let Some(pos) = all.iter().position(|s| s.id == after) {
                    all.drain(..=pos);
                }
            }
            let limit = q.limit.unwrap_or(1000).clamp(1, 1000);
            let next = (all.len() > limit).then(|| all[limit - 1].id.clone());
            all.truncate(limit);
            let body: Vec<Value> = all.iter().map(|s| listed(s, None)).collect();
            let mut resp = Json(body).into_response();
            if let Some(n) = next.and_then(|n| HeaderValue::from_str(&n).ok()) {
                resp.headers_mut().insert("x-next-token", n);
            }
            Ok(resp)
        }
        .await,
    )
}

/// `%XX` escapes (the SDK quotes metadata keys and values before form-encoding them).
fn percent_decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s)
        .decode_utf8_lossy()
        .into_owned()
}

async fn detail(api: Api, headers: HeaderMap, Path(id): Path<String>) -> Response {
    answer(
        async {
            let sb = api.get_sandbox(&id).await?;
            Ok(Json(listed(&sb, api_key(&headers).as_deref())).into_response())
        }
        .await,
    )
}

async fn kill(api: Api, Path(id): Path<String>) -> Response {
    answer(
        api.delete_sandbox(&id)
            .await
            .map(|()| StatusCode::NO_CONTENT.into_response()),
    )
}

#[derive(Debug, Deserialize)]
struct TimeoutBody {
    timeout: u64,
}

/// The body of `connect` (v2: every field optional).
#[derive(Debug, Deserialize)]
struct ConnectBody {
    #[serde(default)]
    timeout: Option<u64>,
}

async fn set_timeout(api: Api, Path(id): Path<String>, Json(b): Json<TimeoutBody>) -> Response {
    answer(
        api.set_timeout(
            &id,
            SetTimeoutRequest {
                timeout_s: b.timeout,
            },
        )
        .await
        .map(|_| StatusCode::NO_CONTENT.into_response()),
    )
}

async fn refresh(api: Api, Path(id): Path<String>) -> Response {
    answer(
        api.get_sandbox(&id)
            .await
            .map(|_| StatusCode::NO_CONTENT.into_response()),
    )
}

/// Resumes a paused sandbox (and sets its timeout); answers its `Sandbox`.
async fn connect(
    api: Api,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Option<Json<ConnectBody>>,
) -> Response {
    answer(
        async {
            let mut sb = api.get_sandbox(&id).await?;
            let resumed = sb.state == SandboxState::Paused;
            if resumed {
                sb = api.resume_sandbox(&id).await?;
            }
            if let Some(timeout_s) = body.and_then(|Json(b)| b.timeout) {
                sb = api
                    .set_timeout(&id, SetTimeoutRequest { timeout_s })
                    .await?;
            }
            let status = if resumed {
                StatusCode::CREATED
            } else {
                StatusCode::OK
            };
            Ok((status, Json(created(&sb, api_key(&headers).as_deref()))).into_response())
        }
        .await,
    )
}

async fn pause(api: Api, Path(id): Path<String>) -> Response {
    answer(
        api.pause_sandbox(&id)
            .await
            .map(|_| StatusCode::NO_CONTENT.into_response()),
    )
}

async fn resume(api: Api, headers: HeaderMap, Path(id): Path<String>) -> Response {
    answer(api.resume_sandbox(&id).await.map(|sb| {
        (
            StatusCode::CREATED,
            [(header::CONTENT_TYPE, "application/json")],
            created(&sb, api_key(&headers).as_deref()).to_string(),
        )
            .into_response()
    }))
}

//! Node registration over HTTP: [`router`] is what an API server serves to nodes (they
//! never hold store credentials: the API server writes their registration for them),
//! and [`Heartbeater`] is the node's side, which registers and then heartbeats through
//! any of a list of API servers, failing over between them.
//!
//! Routes, under [`PREFIX`], all requiring the node token:
//!
//! | route | body | answer |
//! |---|---|---|
//! | `POST /register` | [`NodeRegistration`] | [`RegistrationTicket`]; 409 `conflict` while another live node holds the name |
//! | `POST /heartbeat` | [`Heartbeat`] | 204; 410 `expired`: register again |
//! | `POST /deregister` | [`Deregister`] | 204 |
//!
//! Bad input is 400 `bad_request` naming the field; a store failure 500 (the node tries
//! another API server).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use dsec_fleet::{FleetError, Heartbeat, Load, NodeRegistration, RegistrationTicket, Registry};
use dsec_wire::error::ErrorBody;
use dsec_wire::{ApiError, ErrorCode};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::server::token_ok;
use crate::PREFIX;

/// `POST /deregister`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Deregister {
    /// The node.
    pub name: String,
    /// Its boot id.
    pub boot_id: String,
    /// Its lease.
    pub lease: i64,
}

struct Reg {
    registry: Registry,
    token: String,
}

struct RegError(ApiError);

impl From<FleetError> for RegError {
    fn from(e: FleetError) -> Self {
        let code = match &e {
            FleetError::Invalid(_) => ErrorCode::BadRequest,
            FleetError::NameTaken { .. } => ErrorCode::Conflict,
            FleetError::LeaseExpired { .. } | FleetError::NotRegistered { .. } => {
                ErrorCode::Expired
            }
            FleetError::Corrupt { .. } | FleetError::Store(_) => ErrorCode::Internal,
        };
        Self(ApiError::new(code, e.to_string()))
    }
}

impl IntoResponse for RegError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.0.code.http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, Json(ErrorBody { error: self.0 })).into_response()
    }
}

/// The registration routes an API server serves to nodes presenting `token`, over
/// `registry`. Merge it into the API server's router.
pub fn router(registry: Registry, token: String) -> Router {
    let state = Arc::new(Reg { registry, token });
    let routes = Router::new()
        .route("/register", post(register))
        .route("/heartbeat", post(heartbeat))
        .route("/deregister", post(deregister))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            authenticate,
        ))
        .layer(axum::extract::DefaultBodyLimit::max(256 << 10))
        .with_state(state);
    Router::new().nest(PREFIX, routes)
}

async fn authenticate(State(s): State<Arc<Reg>>, req: Request, next: Next) -> Response {
    if !token_ok(&req, &s.token) {
        return RegError(ApiError::new(
            ErrorCode::Unauthorized,
            "missing or wrong node token",
        ))
        .into_response();
    }
    next.run(req).await
}

/// A JSON body, with a 400 naming what is wrong if it does not parse.
fn body<T: serde::de::DeserializeOwned>(
    b: Result<Json<T>, axum::extract::rejection::JsonRejection>,
) -> Result<T, RegError> {
    b.map(|Json(v)| v)
        .map_err(|e| RegError(ApiError::new(ErrorCode::BadRequest, e.body_text())))
}

async fn register(
    State(s): State<Arc<Reg>>,
    b: Result<Json<NodeRegistration>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<RegistrationTicket>, RegError> {
    let reg = body(b)?;
    let name = reg.name.clone();
    let ticket = s.registry.register(reg).await?;
    tracing::info!(node = %name, lease = ticket.lease, "node registered");
    Ok(Json(ticket))
}

async fn heartbeat(
    State(s): State<Arc<Reg>>,
    b: Result<Json<Heartbeat>, axum::extract::rejection::JsonRejection>,
) -> Result<StatusCode, RegError> {
    s.registry.heartbeat(body(b)?).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn deregister(
    State(s): State<Arc<Reg>>,
    b: Result<Json<Deregister>, axum::extract::rejection::JsonRejection>,
) -> Result<StatusCode, RegError> {
    let d = body(b)?;
    s.registry.deregister(&d.name, &d.boot_id, d.lease).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// What a node reports in each heartbeat.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Its load now.
    pub load: Load,
    /// Its most used cached layers (at most [`dsec_fleet::MAX_CACHED_LAYERS`]; more
    /// are cut).
    pub cached_layers: Vec<String>,
}

/// The [`Heartbeater`]'s state, for logs and readiness.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeartbeatStatus {
    /// The lease of the current registration (`None`: not registered now).
    pub lease: Option<i64>,
    /// The API server that answered last.
    pub apiserver: Option<String>,
    /// Registrations made (1 after the first; more after a lost lease).
    pub registrations: u64,
    /// The last failure, if the last call failed.
    pub last_error: Option<String>,
}

/// Where and how a node heartbeats.
#[derive(Debug, Clone)]
pub struct HeartbeaterConfig {
    /// Base URLs of the API servers (`http://10.0.0.1:8080`), tried in turn.
    pub apiservers: Vec<String>,
    /// The node token.
    pub token: String,
    /// How long one call may take before the next API server is tried (default 1 s:
    /// well within the lease TTL).
    pub request_timeout: Duration,
}

impl HeartbeaterConfig {
    /// `apiservers` with `token` and a 1 s request timeout.
    pub fn new(apiservers: Vec<String>, token: String) -> Self {
        Self {
            apiservers,
            token,
            request_timeout: Duration::from_secs(1),
        }
    }
}

/// The node's registration loop: registers, heartbeats at the interval the API server
/// gave, registers again when told its lease is gone, and moves to the next API server
/// when one fails or does not answer in time. Dropping it stops the loop (the lease
/// then expires); [`Heartbeater::shutdown`] deregisters first.
#[derive(Debug)]
pub struct Heartbeater {
    task: tokio::task::JoinHandle<()>,
    status: watch::Receiver<HeartbeatStatus>,
    shared: Arc<Loop>,
}

impl Drop for Heartbeater {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type ReportFn = dyn Fn() -> Report + Send + Sync;

struct Loop {
    cfg: HeartbeaterConfig,
    registration: NodeRegistration,
    report: Box<ReportFn>,
    http: reqwest::Client,
    /// Index of the API server to call next, and the current lease.
    at: std::sync::Mutex<(usize, Option<i64>)>,
}

impl std::fmt::Debug for Loop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loop")
            .field("apiservers", &self.cfg.apiservers)
            .field("node", &self.registration.name)
            .finish_non_exhaustive()
    }
}

/// How a call went.
enum Outcome<T> {
    Ok(T),
    /// The API server says: register again.
    Expired,
    /// Refused for good reason (bad input, wrong token, name held): the message.
    Refused(String),
    /// The API server failed or did not answer: try another.
    Failed(String),
}

impl Loop {
    fn url(&self, path: &str) -> (usize, String) {
        let i = self.at.lock().unwrap_or_else(|p| p.into_inner()).0;
        let base = self.cfg.apiservers[i % self.cfg.apiservers.len()].trim_end_matches('/');
        (i, format!("{base}{PREFIX}{path}"))
    }

    fn fail_over(&self, from: usize) {
        let mut at = self.at.lock().unwrap_or_else(|p| p.into_inner());
        if at.0 == from {
            at.0 = (from + 1) % self.cfg.apiservers.len();
        }
    }

    async fn call<B: Serialize, T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
        want_body: bool,
    ) -> (String, Outcome<Option<T>>) {
        let (i, url) = self.url(path);
        let resp = self
            .http
            .post(&url)
            .bearer_auth(&self.cfg.token)
            .json(body)
            .timeout(self.cfg.request_timeout)
            .send()
            .await;
        let out = match resp {
            Err(e) => Outcome::Failed(format!("{url}: {e}")),
            Ok(r) if r.status().is_success() => {
                if !want_body {
                    Outcome::Ok(None)
                } else {
                    match r.json::<T>().await {
                        Ok(v) => Outcome::Ok(Some(v)),
                        Err(e) => Outcome::Failed(format!("{url}: bad answer: {e}")),
                    }
                }
            }
            Ok(r) => {
                let status = r.status().as_u16();
                let msg = r
                    .json::<ErrorBody>()
                    .await
                    .map(|b| b.error.message)
                    .unwrap_or_else(|_| format!("HTTP {status}"));
                match status {
                    410 => Outcome::Expired,
                    400 | 401 | 409 => Outcome::Refused(format!("{url}: {msg}")),
                    _ => Outcome::Failed(format!("{url}: {msg}")),
                }
            }
        };
        if matches!(out, Outcome::Failed(_)) {
            self.fail_over(i);
        }
        (url, out)
    }
}

impl Heartbeater {
    /// Starts registering `registration` (its load and cached layers are taken from
    /// `report` at each call) through `cfg.apiservers`.
    ///
    /// # Errors
    /// `cfg.apiservers` is empty, or the HTTP client cannot be built.
    pub fn start(
        cfg: HeartbeaterConfig,
        registration: NodeRegistration,
        report: impl Fn() -> Report + Send + Sync + 'static,
    ) -> Result<Self, String> {
        if cfg.apiservers.is_empty() {
            return Err("no API server URLs to register with".into());
        }
        let http = reqwest::Client::builder()
            .tcp_nodelay(true)
            .build()
            .map_err(|e| format!("HTTP client: {e}"))?;
        let shared = Arc::new(Loop {
            cfg,
            registration,
            report: Box::new(report),
            http,
            at: std::sync::Mutex::new((0, None)),
        });
        let (tx, status) = watch::channel(HeartbeatStatus::default());
        let task = tokio::spawn(run(shared.clone(), tx));
        Ok(Self {
            task,
            status,
            shared,
        })
    }

    /// The loop's state now; `changed()` on it waits for the next change.
    pub fn status(&self) -> watch::Receiver<HeartbeatStatus> {
        self.status.clone()
    }

    /// Stops heartbeating and deregisters (best effort: if no API server answers, the
    /// lease expires on its own).
    pub async fn shutdown(self) {
        self.task.abort();
        let lease = self.shared.at.lock().unwrap_or_else(|p| p.into_inner()).1;
        if let Some(lease) = lease {
            let d = Deregister {
                name: self.shared.registration.name.clone(),
                boot_id: self.shared.registration.boot_id.clone(),
                lease,
            };
            for _ in 0..self.shared.cfg.apiservers.len() {
                if let (_, Outcome::Ok(_)) = self
                    .shared
                    .call::<_, serde_json::Value>("/deregister", &d, false)
                    .await
                {
                    return;
                }
            }
        }
    }
}

async fn run(l: Arc<Loop>, tx: watch::Sender<HeartbeatStatus>) {
    let mut interval = Duration::from_secs(1);
    let mut sent_layers: Option<Vec<String>> = None;
    let mut failures = 0u32;
    // Rounds through the list of API servers since the last success.
    let mut rounds = 1usize;
    loop {
        let lease = l.at.lock().unwrap_or_else(|p| p.into_inner()).1;
        let mut report = (l.report)();
        report.cached_layers.truncate(dsec_fleet::MAX_CACHED_LAYERS);
        let (url, wait) = match lease {
            None => {
                let mut reg = l.registration.clone();
                reg.load = report.load;
                reg.cached_layers = report.cached_layers.clone();
                let (url, out) = l
                    .call::<_, RegistrationTicket>("/register", &reg, true)
                    .await;
                match out {
                    Outcome::Ok(Some(t)) => {
                        l.at.lock().unwrap_or_else(|p| p.into_inner()).1 = Some(t.lease);
                        interval = Duration::from_millis(t.heartbeat_ms.max(100));
                        sent_layers = Some(report.cached_layers);
                        tracing::info!(apiserver = %url, lease = t.lease, "node registered");
                        tx.send_modify(|s| {
                            s.lease = Some(t.lease);
                            s.registrations += 1;
                            s.apiserver = Some(url.clone());
                            s.last_error = None;
                        });
                        (url, Ok(interval))
                    }
                    Outcome::Ok(None) | Outcome::Expired => (url, Err("unexpected answer".into())),
                    Outcome::Refused(m) | Outcome::Failed(m) => (url, Err(m)),
                }
            }
            Some(lease) => {
                let layers = (sent_layers.as_ref() != Some(&report.cached_layers))
                    .then(|| report.cached_layers.clone());
                let hb = Heartbeat {
                    name: l.registration.name.clone(),
                    boot_id: l.registration.boot_id.clone(),
                    lease,
                    load: report.load,
                    cached_layers: layers.clone(),
                };
                let (url, out) = l
                    .call::<_, serde_json::Value>("/heartbeat", &hb, false)
                    .await;
                match out {
                    Outcome::Ok(_) => {
                        if let Some(layers) = layers {
                            sent_layers = Some(layers);
                        }
                        tx.send_if_modified(|s| {
                            let changed =
                                s.last_error.is_some() || s.apiserver.as_deref() != Some(&url);
                            s.last_error = None;
                            s.apiserver = Some(url.clone());
                            changed
                        });
                        (url, Ok(interval))
                    }
                    Outcome::Expired => {
                        tracing::warn!(apiserver = %url, "node lease lost; registering again");
                        l.at.lock().unwrap_or_else(|p| p.into_inner()).1 = None;
                        tx.send_modify(|s| s.lease = None);
                        (url, Ok(Duration::ZERO))
                    }
                    Outcome::Refused(m) | Outcome::Failed(m) => (url, Err(m)),
                }
            }
        };
        match wait {
            Ok(d) => {
                failures = 0;
                rounds = 1;
                tokio::time::sleep(d).await;
            }
            Err(m) => {
                failures += 1;
                tracing::warn!(apiserver = %url, error = %m, "node registration call failed");
                tx.send_modify(|s| s.last_error = Some(m));
                // The next API server at once, once round the list; then back off (up
                // to the heartbeat interval, so a lease outlives a short outage).
                if failures as usize >= l.cfg.apiservers.len() * rounds {
                    rounds += 1;
                    let backoff = Duration::from_millis(100 * u64::from(failures.min(10)));
                    tokio::time::sleep(backoff.min(interval)).await;
                }
            }
        }
    }
}

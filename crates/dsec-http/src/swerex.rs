//! SWE-ReX front: the routes of `swerex-remote` (SWE-ReX's in-sandbox server) for every
//! sandbox at `/swerex/{sandbox_id}/...`, so `RemoteRuntime(host=".../swerex/ID",
//! port=None, auth_token=KEY)` from the `swe-rex` package drives a dsec sandbox unchanged.
//! Each call translates to [`SandboxApi`]; the agent keeps its one protocol.
//!
//! Semantics follow SWE-ReX's `LocalRuntime`: `check: raise` turns a non-zero exit into a
//! `NonZeroExitCodeError`, timeouts into `CommandTimeoutError`, unknown sessions into
//! `SessionDoesNotExistError`; such runtime errors travel as HTTP 511 with a
//! `swerexception` body that the client re-raises. `X-Request-ID` makes a retried request
//! answer the first one's response. `upload` with `unzip` extracts the zip inside the
//! sandbox with its python3 (so a hostile archive stays inside). `close` ends nothing:
//! the sandbox lives until it is deleted through the dsec API. Interactive commands
//! (`is_interactive_command`, `expect`) are not supported.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{Multipart, Path};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use dsec_control::SandboxApi;
use dsec_wire::v1::{Command, CreateSessionRequest, ExecRequest, SandboxState, SessionRunRequest};
use dsec_wire::{ApiError, ErrorCode};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};

type Api = crate::Scoped;

/// Largest `upload` body (the form is read into memory).
const UPLOAD_LIMIT: usize = 512 << 20;
/// Largest file `read_file` returns (SWE-ReX sends it as one JSON string).
const READ_LIMIT: usize = 64 << 20;

/// The routes, relative to the server root.
pub fn routes() -> Router<Arc<dyn SandboxApi>> {
    Router::new()
        .route("/swerex/{id}/", get(root))
        .route("/swerex/{id}/is_alive", get(is_alive))
        .route("/swerex/{id}/create_session", post(create_session))
        .route("/swerex/{id}/run_in_session", post(run_in_session))
        .route("/swerex/{id}/close_session", post(close_session))
        .route("/swerex/{id}/execute", post(execute))
        .route("/swerex/{id}/read_file", post(read_file))
        .route("/swerex/{id}/write_file", post(write_file))
        .route(
            "/swerex/{id}/upload",
            // Directories arrive zipped in one form field, held in memory.
            post(upload).layer(axum::extract::DefaultBodyLimit::max(UPLOAD_LIMIT)),
        )
        .route("/swerex/{id}/close", post(close))
}

/// What a SWE-ReX route answers: a JSON body, a runtime exception (511), or a plain
/// HTTP error with `detail` (FastAPI's shape).
enum Answer {
    Ok(Value),
    Raise(&'static str, String),
    Http(ApiError),
}

impl From<ApiError> for Answer {
    fn from(e: ApiError) -> Self {
        Answer::Http(e)
    }
}

impl Answer {
    fn into_parts(self) -> (StatusCode, Value) {
        match self {
            Answer::Ok(v) => (StatusCode::OK, v),
            Answer::Raise(class, message) => (
                StatusCode::from_u16(511).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                json!({"swerexception": {
                    "message": message, "class_path": class, "traceback": "", "extra_info": {}
                }}),
            ),
            Answer::Http(e) => (
                StatusCode::from_u16(e.code.http_status())
                    .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                json!({"detail": e.message, "code": e.code}),
            ),
        }
    }
}

/// Recent answers by (sandbox, X-Request-ID): a retry gets the first answer again.
static RECENT: Mutex<VecDeque<(String, StatusCode, Value)>> = Mutex::new(VecDeque::new());
const RECENT_MAX: usize = 1024;

async fn answer<F>(id: &str, headers: &HeaderMap, f: F) -> Response
where
    F: std::future::Future<Output = Result<Value, Answer>>,
{
    let key = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(|r| format!("{id}/{r}"));
    if let Some(k) = &key {
        let recent = RECENT.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, status, body)) = recent.iter().find(|(rk, _, _)| rk == k) {
            return (*status, axum::Json(body.clone())).into_response();
        }
    }
    let (status, body) = f.await.map_or_else(|a| a, Answer::Ok).into_parts();
    if let Some(k) = key {
        let mut recent = RECENT.lock().unwrap_or_else(|p| p.into_inner());
        if recent.len() >= RECENT_MAX {
            recent.pop_front();
        }
        recent.push_back((k, status, body.clone()));
    }
    (status, axum::Json(body)).into_response()
}

/// The JSON body as `T`, or a `bad_request` answer.
fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, Answer> {
    serde_json::from_slice(body)
        .map_err(|e| Answer::Http(ApiError::new(ErrorCode::BadRequest, e.to_string())))
}

fn raise(class: &'static str, message: String) -> Result<Value, Answer> {
    Err(Answer::Raise(class, message))
}

async fn root(Path(_id): Path<String>) -> Response {
    axum::Json(json!({"message": "hello world"})).into_response()
}

async fn is_alive(api: Api, Path(id): Path<String>) -> Response {
    let (alive, message) = match api.get_sandbox(&id).await {
        Ok(sb) if sb.state == SandboxState::Ready => (true, String::new()),
        Ok(sb) => (false, format!("sandbox {id} is {:?}", sb.state)),
        Err(e) => return Answer::Http(e).into_response_plain(),
    };
    axum::Json(json!({"is_alive": alive, "message": message})).into_response()
}

impl Answer {
    fn into_response_plain(self) -> Response {
        let (status, body) = self.into_parts();
        (status, axum::Json(body)).into_response()
    }
}

#[derive(Deserialize)]
struct CreateSession {
    #[serde(default = "default_session")]
    session: String,
    #[serde(default)]
    startup_source: Vec<String>,
}

fn default_session() -> String {
    "default".into()
}

async fn create_session(
    api: Api,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    answer(&id, &headers, async {
        let req: CreateSession = parse(&body)?;
        let sessions = api.list_sessions(&id).await?;
        if sessions.sessions.iter().any(|s| s.session == req.session) {
            return raise(
                "swerex.exceptions.SessionExistsError",
                format!("session {} already exists", req.session),
            );
        }
        let create = CreateSessionRequest {
            session: Some(req.session.clone()),
            env: Default::default(),
            cwd: None,
            user: None,
        };
        api.create_session(&id, create).await?;
        let mut output = String::new();
        for file in &req.startup_source {
            let run = SessionRunRequest {
                command: format!("source {}", shell_quote(file)),
                timeout_s: Some(60.0),
                request_id: None,
            };
            output.push_str(&api.run_in_session(&id, &req.session, run).await?.output);
        }
        Ok(json!({"output": output, "session_type": "bash"}))
    })
    .await
}

#[derive(Deserialize)]
#[serde(tag = "action_type")]
enum Action {
    #[serde(rename = "bash")]
    Bash(BashAction),
    #[serde(rename = "bash_interrupt")]
    Interrupt(InterruptAction),
}

#[derive(Deserialize)]
struct BashAction {
    command: String,
    #[serde(default = "default_session")]
    session: String,
    #[serde(default)]
    timeout: Option<f64>,
    #[serde(default)]
    is_interactive_command: bool,
    #[serde(default = "default_check")]
    check: String,
    #[serde(default)]
    error_msg: String,
}

fn default_check() -> String {
    "raise".into()
}

#[derive(Deserialize)]
struct InterruptAction {
    #[serde(default = "default_session")]
    session: String,
}

/// A `not_found` about a session, as SWE-ReX's `SessionDoesNotExistError`.
fn missing_session(session: &str) -> impl FnOnce(ApiError) -> Answer + '_ {
    move |e| {
        if e.code == ErrorCode::NotFound && e.message.contains("session") {
            Answer::Raise(
                "swerex.exceptions.SessionDoesNotExistError",
                format!("session {session:?} does not exist"),
            )
        } else {
            e.into()
        }
    }
}

fn observation(output: &str, exit_code: Option<i32>) -> Value {
    json!({
        "output": output, "exit_code": exit_code, "failure_reason": "",
        "expect_string": "", "session_type": "bash"
    })
}

async fn run_in_session(
    api: Api,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    answer(&id, &headers, async {
        let a = match parse::<Action>(&body)? {
            Action::Interrupt(a) => {
                api.interrupt_session(&id, &a.session)
                    .await
                    .map_err(missing_session(&a.session))?;
                return Ok(observation("", None));
            }
            Action::Bash(a) => a,
        };
        if a.is_interactive_command {
            return raise(
                "builtins.NotImplementedError",
                "interactive commands are not supported by dsec's SWE-ReX front".into(),
            );
        }
        let run = SessionRunRequest {
            command: a.command.clone(),
            timeout_s: a.timeout,
            request_id: swerex_request_id(&headers),
        };
        let r = api
            .run_in_session(&id, &a.session, run)
            .await
            .map_err(missing_session(&a.session))?;
        if r.timed_out {
            return raise(
                "swerex.exceptions.CommandTimeoutError",
                format!(
                    "timeout after {} seconds while running command {:?}",
                    a.timeout.unwrap_or_default(),
                    a.command
                ),
            );
        }
        if a.check == "raise" && r.exit_code != 0 {
            let mut msg = format!(
                "Command {:?} failed with exit code {}. Here is the output:\n{:?}",
                a.command, r.exit_code, r.output
            );
            if !a.error_msg.is_empty() {
                msg = format!("{}: {msg}", a.error_msg);
            }
            return raise("swerex.exceptions.NonZeroExitCodeError", msg);
        }
        Ok(observation(
            &r.output,
            (a.check != "ignore").then_some(r.exit_code),
        ))
    })
    .await
}

#[derive(Deserialize)]
struct CloseSession {
    #[serde(default = "default_session")]
    session: String,
}

async fn close_session(
    api: Api,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    answer(&id, &headers, async {
        let req: CloseSession = parse(&body)?;
        api.close_session(&id, &req.session)
            .await
            .map_err(missing_session(&req.session))?;
        Ok(json!({"session_type": "bash"}))
    })
    .await
}

#[derive(Deserialize)]
#[serde(untagged)]
enum CommandLine {
    Argv(Vec<String>),
    Line(String),
}

#[derive(Deserialize)]
struct ExecuteRequest {
    command: CommandLine,
    #[serde(default)]
    timeout: Option<f64>,
    #[serde(default)]
    shell: bool,
    #[serde(default)]
    check: bool,
    #[serde(default)]
    error_msg: String,
    #[serde(default)]
    env: Option<std::collections::BTreeMap<String, String>>,
    #[serde(default)]
    cwd: Option<String>,
    #[serde(default)]
    merge_output_streams: bool,
}

/// `subprocess.run` semantics: a list is argv (joined into one line with `shell`), a
/// string is a shell line with `shell` and a program name without.
fn to_command(c: CommandLine, shell: bool, merge: bool) -> Command {
    let line = match (c, shell) {
        (CommandLine::Line(l), true) => l,
        (CommandLine::Argv(a), true) => a.join(" "),
        (CommandLine::Line(l), false) => shell_quote(&l),
        (CommandLine::Argv(a), false) => {
            if !merge {
                return Command::Argv(a);
            }
            a.iter()
                .map(|s| shell_quote(s))
                .collect::<Vec<_>>()
                .join(" ")
        }
    };
    if merge {
        Command::Shell(format!("{{ {line}\n}} 2>&1"))
    } else {
        Command::Shell(line)
    }
}

/// The `X-Request-ID` a SWE-ReX client sends with a call (and its retries), when it is
/// a usable request id.
fn swerex_request_id(headers: &HeaderMap) -> Option<String> {
    let id = format!("swerex.{}", headers.get("x-request-id")?.to_str().ok()?);
    dsec_wire::v1::check_request_id(&id).ok()?;
    Some(id)
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

async fn execute(api: Api, Path(id): Path<String>, headers: HeaderMap, body: Bytes) -> Response {
    answer(&id, &headers, async {
        let req: ExecuteRequest = parse(&body)?;
        let exec = ExecRequest {
            cmd: to_command(req.command, req.shell, req.merge_output_streams),
            env: req.env.unwrap_or_default(),
            cwd: req.cwd,
            stdin: None,
            timeout_s: req.timeout,
            output_limit: None,
            user: None,
            // SWE-ReX's client sends one `X-Request-ID` for a call and all its retries:
            // the call runs once.
            request_id: swerex_request_id(&headers),
        };
        let r = api.exec(&id, exec).await?;
        if r.exit.timed_out {
            return raise(
                "swerex.exceptions.CommandTimeoutError",
                format!(
                    "Timeout ({}s) exceeded while running command",
                    req.timeout.unwrap_or_default()
                ),
            );
        }
        let code = r.exit.exit_code.unwrap_or(-1);
        if req.check && code != 0 {
            let mut msg = format!(
                "Command failed with exit code {code}. Stdout:\n{:?}\nStderr:\n{:?}",
                r.stdout, r.stderr
            );
            if !req.error_msg.is_empty() {
                msg = format!("{}: {msg}", req.error_msg);
            }
            return raise("swerex.exceptions.NonZeroExitCodeError", msg);
        }
        Ok(json!({"stdout": r.stdout, "stderr": r.stderr, "exit_code": r.exit.exit_code}))
    })
    .await
}

#[derive(Deserialize)]
struct ReadFile {
    path: String,
}

async fn read_file(api: Api, Path(id): Path<String>, headers: HeaderMap, body: Bytes) -> Response {
    answer(&id, &headers, async {
        let req: ReadFile = parse(&body)?;
        let (_, mut stream) = match api.read_file(&id, &req.path, 0, None).await {
            Ok(v) => v,
            Err(e) if e.code == ErrorCode::NotFound => {
                return raise(
                    "builtins.FileNotFoundError",
                    format!("No such file or directory: {:?}", req.path),
                )
            }
            Err(e) => return Err(e.into()),
        };
        let mut content = Vec::new();
        while let Some(chunk) = stream.next().await {
            content.extend_from_slice(&chunk?);
            if content.len() > READ_LIMIT {
                return Err(Answer::Http(ApiError::new(
                    ErrorCode::PayloadTooLarge,
                    format!("{} is larger than {READ_LIMIT} bytes", req.path),
                )));
            }
        }
        Ok(json!({"content": String::from_utf8_lossy(&content)}))
    })
    .await
}

#[derive(Deserialize)]
struct WriteFile {
    content: String,
    path: String,
}

/// Writes `data` to `path`, recorded under `request_id` when given.
async fn write_bytes(
    api: &crate::Scoped,
    id: &str,
    path: &str,
    data: Bytes,
    request_id: Option<&str>,
) -> Result<(), ApiError> {
    let body = futures::stream::iter([Ok::<_, ApiError>(data)]).boxed();
    api.write_file(id, path, None, body, request_id)
        .await
        .map(|_| ())
}

async fn write_file(api: Api, Path(id): Path<String>, headers: HeaderMap, body: Bytes) -> Response {
    answer(&id, &headers, async {
        let req: WriteFile = parse(&body)?;
        // A retried write (one X-Request-ID) is written once.
        let rid = swerex_request_id(&headers);
        write_bytes(
            &api,
            &id,
            &req.path,
            Bytes::from(req.content),
            rid.as_deref(),
        )
        .await?;
        Ok(json!({}))
    })
    .await
}

async fn upload(
    api: Api,
    Path(id): Path<String>,
    headers: HeaderMap,
    mut form: Multipart,
) -> Response {
    let (mut file, mut target, mut unzip) = (None, None, false);
    loop {
        match form.next_field().await {
            Ok(Some(field)) => {
                let name = field.name().unwrap_or_default().to_string();
                let data = match field.bytes().await {
                    Ok(d) => d,
                    Err(e) => {
                        return Answer::Http(ApiError::new(ErrorCode::BadRequest, e.to_string()))
                            .into_response_plain()
                    }
                };
                match name.as_str() {
                    "file" => file = Some(data),
                    "target_path" => target = Some(String::from_utf8_lossy(&data).into_owned()),
                    "unzip" => unzip = data.eq_ignore_ascii_case(b"true"),
                    _ => {}
                }
            }
            Ok(None) => break,
            Err(e) => {
                return Answer::Http(ApiError::new(ErrorCode::BadRequest, e.to_string()))
                    .into_response_plain()
            }
        }
    }
    answer(&id, &headers, async {
        let (Some(file), Some(target)) = (file, target) else {
            return Err(Answer::Http(ApiError::new(
                ErrorCode::BadRequest,
                "upload needs the form fields file and target_path",
            )));
        };
        if !unzip {
            let rid = swerex_request_id(&headers);
            write_bytes(&api, &id, &target, file, rid.as_deref()).await?;
            return Ok(json!({}));
        }
        let tmp = format!("/tmp/.dsec-swerex-{:016x}.zip", rand_suffix());
        write_bytes(&api, &id, &tmp, file, None).await?;
        let script = "import sys, zipfile\nzipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])";
        let exec = ExecRequest {
            cmd: Command::Argv(vec![
                "python3".into(),
                "-c".into(),
                script.into(),
                tmp.clone(),
                target.clone(),
            ]),
            env: Default::default(),
            cwd: None,
            stdin: None,
            timeout_s: Some(600.0),
            output_limit: None,
            user: None,
            request_id: None,
        };
        let r = api.exec(&id, exec).await;
        let _ = api.remove_file(&id, &tmp, false).await;
        let r = r?;
        if r.exit.exit_code != Some(0) {
            return raise(
                "builtins.RuntimeError",
                format!(
                    "unzip into {target} failed (needs python3 in the sandbox): {}",
                    r.stderr
                ),
            );
        }
        Ok(json!({}))
    })
    .await
}

fn rand_suffix() -> u64 {
    use std::time::{SystemTime, UNIX_EPOCH};
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
        ^ u64::from(std::process::id())
}

async fn close(Path(id): Path<String>, headers: HeaderMap) -> Response {
    answer(&id, &headers, async { Ok(json!({})) }).await
}

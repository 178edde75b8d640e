//! SandboxFusion front: `POST /sandboxfusion/{pool}/run_code` and `GET
//! /sandboxfusion/{pool}/v1/ping`, so the `sandbox-fusion` client and verl's reward code
//! (which post to `.../run_code`) run code in a dsec pool made for function calls,
//! unchanged. Set the client's endpoint to `http://dsec:KEY@HOST:PORT/sandboxfusion/POOL`:
//! it sends no headers of its own, and HTTP clients turn the URL's password into
//! `Authorization: Basic`, which dsec reads as the API key.
//!
//! Each request is one [`SandboxApi::fncall`]: the code is written to
//! [`dsec_wire::v1::CODE_DIR`], which is also the working directory (relative `files`
//! and `fetch_files` land there, as in SandboxFusion's temporary directory). Answers
//! have SandboxFusion's shape and are always HTTP 200: `Success` when every step
//! finished with exit code 0, `Failed` on a non-zero exit, a compile error or a timeout
//! (`TimeLimitExceeded`, `return_code` null), `SandboxError` (with `message`) when dsec
//! could not run it at all (no such pool, a language the pool does not support, no
//! capacity). A command killed by a signal reports `-signal`, as SandboxFusion's asyncio
//! runner does. Fetched files that do not exist are left out.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::Path;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use dsec_control::SandboxApi;
use dsec_wire::v1::{FnCallRequest, FnCallResponse, FnCallStatus, CODE_DIR};
use dsec_wire::Base64Bytes;
use serde::Deserialize;
use serde_json::{json, Value};

type Api = crate::Scoped;

/// The authenticated route, relative to the server root.
pub fn routes() -> Router<Arc<dyn SandboxApi>> {
    Router::new().route("/sandboxfusion/{pool}/run_code", post(run_code))
}

/// The health check (no key: load balancers probe it).
pub fn public_routes() -> Router<Arc<dyn SandboxApi>> {
    Router::new().route("/sandboxfusion/{pool}/v1/ping", get(ping))
}

async fn ping() -> Json<&'static str> {
    Json("pong")
}

fn ten() -> f64 {
    10.0
}

fn python() -> String {
    "python".into()
}

/// SandboxFusion's `RunCodeRequest` (unknown fields are ignored, as its server does).
#[derive(Debug, Deserialize)]
struct RunCode {
    code: String,
    /// Required by SandboxFusion; python when missing.
    #[serde(default = "python")]
    language: String,
    #[serde(default = "ten")]
    compile_timeout: f64,
    #[serde(default = "ten")]
    run_timeout: f64,
    /// MiB; -1 (the default) is no limit.
    #[serde(default, rename = "memory_limit_MB")]
    memory_limit_mb: Option<i64>,
    #[serde(default)]
    stdin: Option<String>,
    /// Path to base64 content; null values and names with `IGNORE_THIS_FILE` are skipped.
    #[serde(default)]
    files: BTreeMap<String, Option<String>>,
    #[serde(default)]
    fetch_files: Vec<String>,
}

fn sandbox_error(message: String) -> Response {
    Json(sandbox_error_value(message)).into_response()
}

async fn run_code(api: Api, Path(pool): Path<String>, body: axum::body::Bytes) -> Response {
    let req: RunCode = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return (
                axum::http::StatusCode::UNPROCESSABLE_ENTITY,
                Json(json!({"detail": format!("invalid request: {e}")})),
            )
                .into_response()
        }
    };
    let mut files = BTreeMap::new();
    for (path, content) in req.files {
        let Some(content) = content else { continue };
        if path.contains("IGNORE_THIS_FILE") {
            continue;
        }
        match serde_json::from_value::<Base64Bytes>(Value::String(content)) {
            Ok(bytes) => {
                files.insert(path, bytes);
            }
            Err(e) => return sandbox_error(format!("files[{path:?}]: {e}")),
        }
    }
    let call = FnCallRequest {
        pool,
        command: None,
        code: Some(req.code),
        language: Some(req.language),
        stdin: req.stdin,
        files,
        fetch_files: req.fetch_files,
        env: BTreeMap::new(),
        cwd: Some(CODE_DIR.into()),
        timeout_s: req.run_timeout,
        compile_timeout_s: req.compile_timeout,
        memory_limit_mb: req.memory_limit_mb.filter(|mb| *mb > 0).map(|mb| mb as u64),
        max_wait_s: None,
        priority: Default::default(),
    };
    match api.fncall(call).await {
        Ok(r) => Json(answer(r)).into_response(),
        Err(e) => sandbox_error(e.message),
    }
}

/// SandboxFusion's `CommandRunResult`.
fn step(
    timed_out: bool,
    duration_ms: u64,
    exit_code: Option<i32>,
    signal: Option<i32>,
    stdout: String,
    stderr: String,
) -> Value {
    let (status, code) = if timed_out {
        ("TimeLimitExceeded", None)
    } else {
        ("Finished", exit_code.or(signal.map(|s| -s)))
    };
    json!({
        "status": status,
        "execution_time": duration_ms as f64 / 1000.0,
        "return_code": code,
        "stdout": stdout,
        "stderr": stderr,
    })
}

fn answer(r: FnCallResponse) -> Value {
    if r.status == FnCallStatus::SetupError {
        let mut v = sandbox_error_value(r.error.unwrap_or_default());
        v["executor_pod_name"] = json!(r.sandbox_id);
        return v;
    }
    let mut failed = false;
    let compile = r.compile.map(|c| {
        failed |= c.timed_out || c.exit_code != Some(0);
        step(
            c.timed_out,
            c.duration_ms,
            c.exit_code,
            c.signal,
            c.stdout,
            c.stderr,
        )
    });
    let run = (r.status != FnCallStatus::CompileError).then(|| {
        let timed_out = r.status == FnCallStatus::TimedOut;
        failed |= timed_out || r.exit_code != Some(0);
        step(
            timed_out,
            r.duration_ms,
            r.exit_code,
            r.signal,
            r.stdout,
            r.stderr,
        )
    });
    let files: BTreeMap<String, Base64Bytes> = r
        .files
        .into_iter()
        .filter_map(|(path, f)| f.data.map(|d| (path, d)))
        .collect();
    json!({
        "status": if failed { "Failed" } else { "Success" },
        "message": "",
        "compile_result": compile,
        "run_result": run,
        "executor_pod_name": r.sandbox_id,
        "files": files,
    })
}

fn sandbox_error_value(message: String) -> Value {
    json!({
        "status": "SandboxError",
        "message": message,
        "compile_result": null,
        "run_result": null,
        "executor_pod_name": null,
        "files": {},
    })
}

//! Function calls (`POST /v1/fncall`): a call borrows a warm member of a pool made for
//! calls (no record write: the member stays the pool's), runs in it through the agent's
//! `Call` (a throw-away view of the sandbox, see `dsec_agent::fncall`) and gives it back.
//! A member that served its `max_calls`, or whose call reported an anomaly (a process
//! that would not die, a helper gone), timed out, was SIGKILLed (the OOM killer's
//! signal) or failed at the node, is deleted instead and the pool makes another. Waiting for a free member is the pool's queue, which its
//! autoscaler watches like claims.

use std::time::Instant;

use dsec_wire::agent::{CallResult, CallSpec, Command, CompileSpec};
use dsec_wire::v1::{
    language_run, FnCallCompile, FnCallRequest, FnCallResponse, FnCallStatus, LANGUAGES,
};

use super::pools::acquire;
use super::*;

/// Longest timeout a call may ask for, seconds.
const MAX_CALL_TIMEOUT_S: f64 = 3600.0;
/// How long a call waits for a free member unless it says.
const DEFAULT_CALL_WAIT_S: f64 = 30.0;
/// Attempts on members that turn out gone before the call fails.
const ATTEMPTS: usize = 3;

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::BadRequest, msg)
}

/// The agent request for `req`, or why it is invalid.
pub(super) fn call_spec(req: &FnCallRequest) -> ApiResult<CallSpec> {
    for (field, t) in [
        ("timeout_s", req.timeout_s),
        ("compile_timeout_s", req.compile_timeout_s),
    ] {
        if !t.is_finite() || t <= 0.0 || t > MAX_CALL_TIMEOUT_S {
            return Err(bad(format!(
                "{field} must be in (0, {MAX_CALL_TIMEOUT_S}], got {t}"
            )));
        }
    }
    if let Some(w) = req.max_wait_s {
        if !w.is_finite() || !(0.0..=3600.0).contains(&w) {
            return Err(bad(format!("max_wait_s must be in [0, 3600], got {w}")));
        }
    }
    if let Some(mb) = req.memory_limit_mb {
        if !(1..=1 << 20).contains(&mb) {
            return Err(bad(format!(
                "memory_limit_mb must be in [1, 1048576], got {mb}"
            )));
        }
    }
    let mut files = req.files.clone();
    let mut compile = None;
    let cmd = match (&req.command, &req.code) {
        (Some(_), Some(_)) => return Err(bad("give either command or code, not both")),
        (None, None) => return Err(bad("give a command, or code and its language")),
        (Some(cmd), None) => {
            if req.language.is_some() {
                return Err(bad("language goes with code, not with command"));
            }
            if cmd.to_argv().first().is_none_or(|p| p.is_empty()) {
                return Err(bad("command: empty"));
            }
            cmd.clone()
        }
        (None, Some(code)) => {
            let lang = req.language.as_deref().ok_or_else(|| {
                bad(format!(
                    "language: required with code (one of {})",
                    LANGUAGES.join(", ")
                ))
            })?;
            let how = language_run(lang).ok_or_else(|| {
                bad(format!(
                    "language: {lang:?} is not supported (one of {})",
                    LANGUAGES.join(", ")
                ))
            })?;
            files.insert(how.file, code.as_str().into());
            compile = how.compile.map(|argv| CompileSpec {
                cmd: Command::Argv(argv),
                timeout_ms: (req.compile_timeout_s * 1000.0).ceil() as u64,
            });
            Command::Argv(how.run)
        }
    };
    for path in files.keys().chain(&req.fetch_files) {
        if path.is_empty() || path.contains('\0') {
            return Err(bad(format!("invalid file path {path:?}")));
        }
    }
    let input: usize =
        files.values().map(|f| f.len()).sum::<usize>() + req.stdin.as_ref().map_or(0, String::len);
    if input > dsec_wire::agent::CALL_INPUT_LIMIT {
        return Err(bad(format!(
            "stdin, code and files carry {input} bytes; a call takes at most {}",
            dsec_wire::agent::CALL_INPUT_LIMIT
        )));
    }
    Ok(CallSpec {
        cmd,
        env: req.env.clone(),
        cwd: req.cwd.clone(),
        user: None,
        stdin: req.stdin.as_deref().map(Into::into),
        files,
        fetch: req.fetch_files.clone(),
        timeout_ms: (req.timeout_s * 1000.0).ceil() as u64,
        memory_limit_bytes: req.memory_limit_mb.map(|mb| mb << 20),
        output_limit: None,
        compile,
    })
}

fn response(r: CallResult, sandbox_id: String) -> FnCallResponse {
    let compile = r.compile.map(|c| FnCallCompile {
        exit_code: c.exit.exit_code,
        signal: c.exit.signal,
        timed_out: c.exit.timed_out,
        stdout: c.stdout.to_text(),
        stderr: c.stderr.to_text(),
        duration_ms: c.exit.duration_ms,
    });
    let status = if r.setup_error.is_some() {
        FnCallStatus::SetupError
    } else if compile.is_some() && !r.ran {
        FnCallStatus::CompileError
    } else if r.exit.timed_out {
        FnCallStatus::TimedOut
    } else {
        FnCallStatus::Finished
    };
    FnCallResponse {
        status,
        compile,
        exit_code: r.exit.exit_code,
        signal: r.exit.signal,
        stdout: r.stdout.to_text(),
        stderr: r.stderr.to_text(),
        stdout_truncated: r.exit.stdout_truncated,
        stderr_truncated: r.exit.stderr_truncated,
        duration_ms: r.exit.duration_ms,
        files: r.files,
        error: r.setup_error,
        sandbox_id,
        setup_us: r.setup_us,
        teardown_us: r.teardown_us,
    }
}

impl ControlPlane {
    /// Runs one function call in a member of the caller's pool `req.pool`.
    pub(super) async fn fncall_to_end(
        &self,
        tenant: &str,
        req: FnCallRequest,
    ) -> ApiResult<FnCallResponse> {
        let spec = call_spec(&req)?;
        let name = req.pool.clone();
        let pool = self.pools.get(tenant, &name)?;
        if pool.fncall().is_none() {
            return Err(bad(format!(
                "pool {name:?} does not serve function calls (create it with fncall)"
            )));
        }
        let max_wait = req.max_wait_s.unwrap_or(DEFAULT_CALL_WAIT_S);
        let start = Instant::now();
        let mut last_err = None;
        for _ in 0..ATTEMPTS {
            let id = acquire(self, &pool, &name, start, max_wait, req.priority).await?;
            let waited =
                (req.priority != Priority::Low).then(|| start.elapsed().as_millis() as u64);
            // The agent ends the command at its timeouts; past them (and a grace) the
            // agent itself is stuck: the call fails here and goes to another member.
            let limit =
                Limit::exec(spec.timeout_ms + spec.compile.as_ref().map_or(0, |c| c.timeout_ms));
            let ran = match self.records.get(&id) {
                Some(sb) => match self.node_of(&sb) {
                    Ok(node) => {
                        let call = node.call(&id, Request::Call(spec.clone()));
                        self.guarded(&id, Some(limit), call).await
                    }
                    Err(e) => Err(e),
                },
                None => Err(ApiError::new(
                    ErrorCode::NotFound,
                    format!("sandbox {id} is gone"),
                )),
            };
            let outcome = match ran {
                Ok(Reply::Called(r)) => Ok(r),
                Ok(Reply::Error(e)) | Err(e) => Err(e),
                Ok(other) => Err(ApiError::new(
                    ErrorCode::Internal,
                    format!("unexpected agent reply to a call: {other:?}"),
                )),
            };
            let healthy = matches!(&outcome, Ok(r) if r.anomaly.is_none() && !suspect(r));
            if !pool.give_back(id.clone(), healthy, waited) {
                if let Ok(r) = &outcome {
                    if let Some(why) = &r.anomaly {
                        tracing::warn!(pool = %name, %id, anomaly = %why, "replacing a sandbox after a call");
                    }
                }
                let me = self.me.clone();
                let gone = id.clone();
                tokio::spawn(async move {
                    if let Some(me) = me.upgrade() {
                        if let Err(e) = me.remove(&gone, None).await {
                            tracing::warn!(id = %gone, error = %e.message, "deleting a used call sandbox");
                        }
                    }
                });
            }
            match outcome {
                Ok(r) => {
                    if r.anomaly.is_some() && r.exit.exit_code.is_none() && r.exit.signal.is_none()
                    {
                        // The call never ran: try it on another member.
                        last_err = r.anomaly.clone();
                        continue;
                    }
                    return Ok(response(r, id));
                }
                Err(e) if e.code == ErrorCode::BadRequest => return Err(e),
                Err(e) => {
                    tracing::info!(pool = %name, %id, error = %e.message, "a call's sandbox failed; trying another");
                    last_err = Some(e.message);
                }
            }
        }
        Err(ApiError::new(
            ErrorCode::Unavailable,
            format!(
                "pool {name:?}: the call failed on {ATTEMPTS} sandboxes; last: {}",
                last_err.unwrap_or_default()
            ),
        ))
    }
}

/// Whether a call that ended without an anomaly still leaves its sandbox suspect, so it
/// is replaced: a timeout (of the command or its compile step), or a SIGKILL, which is
/// what the memory limit's OOM killer sends. The reset would clean up after either, but
/// a sandbox that hit its limits is not worth the risk.
fn suspect(r: &CallResult) -> bool {
    const SIGKILL: i32 = 9;
    let compile_timed_out = r.compile.as_ref().is_some_and(|c| c.exit.timed_out);
    r.exit.timed_out || compile_timed_out || r.exit.signal == Some(SIGKILL)
}

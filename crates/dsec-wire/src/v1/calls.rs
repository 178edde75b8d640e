//! Recorded calls: what a sandbox's node keeps of each call that carried a request id,
//! and the sandbox's call log (`GET /v1/sandboxes/{id}/log`).
//!
//! A call with a request id (in its body, or the `Idempotency-Key` header) runs once: a
//! retry with the same id gets the recorded outcome without running anything, attaches
//! to the first call while it still runs (a stream then starts from its first byte), and
//! answers `conflict` if its body differs. Records live as long as the sandbox, survive
//! restarts of its node, and are bounded (see [`MAX_CALLS_PER_SANDBOX`]).

use serde::{Deserialize, Serialize};

use super::ExitInfo;
use crate::error::ApiError;

/// Header that carries a call's request id (the body's `request_id` says the same; both,
/// and different, is `bad_request`).
pub const IDEMPOTENCY_KEY_HEADER: &str = "idempotency-key";

/// Longest request id, in bytes.
pub const MAX_REQUEST_ID_BYTES: usize = 256;

/// Calls recorded per sandbox by default (a node's `--max-recorded-calls`); a call with a
/// new request id beyond them is refused (`no_space`), calls without one still run.
pub const MAX_CALLS_PER_SANDBOX: usize = 65_536;

/// Kept output of a sandbox's recorded calls, in bytes; beyond it the oldest calls'
/// output is dropped (their records stay and say so).
pub const MAX_CALL_OUTPUT_BYTES: u64 = 64 * 1024 * 1024;

/// Whether `id` is a usable request id: 1 to [`MAX_REQUEST_ID_BYTES`] bytes, no control
/// characters. The error says what is wrong.
pub fn check_request_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > MAX_REQUEST_ID_BYTES {
        return Err(format!(
            "request_id must be 1 to {MAX_REQUEST_ID_BYTES} bytes (got {})",
            id.len()
        ));
    }
    if id.chars().any(char::is_control) {
        return Err("request_id must not contain control characters".into());
    }
    Ok(())
}

/// Where a recorded call is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum CallState {
    /// Still running: a retry attaches to it.
    Running,
    /// Ended; `exit` (a command) or `error` says how.
    Done,
    /// Its outcome could not be learnt (the sandbox's agent no longer knew the command
    /// when its node came back); a retry answers the same, never runs it again.
    Lost,
}

/// One recorded call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct CallRecord {
    /// Its place in the sandbox's log, from 1.
    pub seq: u64,
    /// The caller's request id.
    pub request_id: String,
    /// What it was: `exec`, `session_run`, `process_start`, `file_write` or `tar_upload`.
    pub kind: String,
    /// Its arguments as the node ran them (stdin as `stdin_bytes`, its length).
    pub args: serde_json::Value,
    /// When it started, unix milliseconds.
    pub started_at_ms: u64,
    /// When it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at_ms: Option<u64>,
    /// Where it is.
    pub state: CallState,
    /// How its command ended, with the byte counts of its output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit: Option<ExitInfo>,
    /// True if the sandbox's memory limit killed a process meanwhile.
    #[serde(default)]
    pub oom_killed: bool,
    /// Why it failed, when it failed without an exit (or why it was lost).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ApiError>,
    /// True if its kept output was dropped for newer calls' (see
    /// [`MAX_CALL_OUTPUT_BYTES`]): a retry then gets its exit without its output.
    #[serde(default)]
    pub output_dropped: bool,
    /// Its kept stdout, when asked for (`?output=true`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdout: Option<String>,
    /// Its kept stderr, when asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stderr: Option<String>,
    /// The answer of a call that is not a command's run (a session command's result, a
    /// started process), when output is asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reply: Option<serde_json::Value>,
    /// SHA-256 (hex) of the body an upload (a file write, a tar upload) wrote.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_sha256: Option<String>,
}

/// A page of a sandbox's call log, oldest first.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct CallLog {
    /// The calls.
    pub calls: Vec<CallRecord>,
    /// Pass as `after` for the next page; absent on the last.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_after: Option<u64>,
}

/// `GET /v1/sandboxes/{id}/log` query.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct CallLogQuery {
    /// Calls after this `seq` (default: from the first).
    #[serde(default)]
    pub after: Option<u64>,
    /// At most this many (default 100, at most 1000).
    #[serde(default)]
    pub limit: Option<u32>,
    /// Include each call's kept output.
    #[serde(default)]
    pub output: bool,
    /// Only the call with this request id.
    #[serde(default)]
    pub request_id: Option<String>,
}

/// Default page size of the call log.
pub const CALL_LOG_PAGE: u32 = 100;
/// Largest page of the call log.
pub const CALL_LOG_MAX_PAGE: u32 = 1000;

//! Function calls (`POST /v1/fncall`): one short command or program run in a warm
//! sandbox of a pool made for calls, in a throw-away view of it (see
//! [`crate::agent::CallSpec`]): no sandbox is created per call, and no call sees what
//! another left.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::agent::{Command, FetchedFile};
use crate::Base64Bytes;

/// Label of every sandbox of a pool that serves calls (set by the server; a create may
/// not name it).
pub const FNCALL_LABEL: &str = "dsec-fncall";

/// How a pool serves function calls (`PoolSpec.fncall`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FnCallPolicy {
    /// Calls one sandbox serves before it is replaced by a fresh one. Default 1000.
    pub max_calls: u32,
}

impl Default for FnCallPolicy {
    fn default() -> Self {
        Self { max_calls: 1000 }
    }
}

/// Languages a call may give as `code`, and how each runs.
pub const LANGUAGES: &[&str] = &["python", "bash", "sh"];

/// Where a call's `code` is written (in the call's private view).
pub const CODE_DIR: &str = "/tmp/fncall";

/// The file a language's code is written to and the command that runs it, or `None` for
/// a language not in [`LANGUAGES`].
pub fn language_command(language: &str) -> Option<(String, Vec<String>)> {
    let (file, interpreter) = match language {
        "python" | "python3" => ("main.py", "python3"),
        "bash" => ("main.sh", "bash"),
        "sh" => ("main.sh", "sh"),
        _ => return None,
    };
    let path = format!("{CODE_DIR}/{file}");
    Some((path.clone(), vec![interpreter.to_string(), path]))
}

fn default_timeout_s() -> f64 {
    10.0
}

/// `POST /v1/fncall`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FnCallRequest {
    /// The pool (of the caller's tenant, created with `fncall`) whose sandbox runs it.
    pub pool: String,
    /// What to run: argv or a shell line. Exactly one of `command` and `code`.
    #[serde(default)]
    pub command: Option<Command>,
    /// A program's source, run by `language`'s interpreter.
    #[serde(default)]
    pub code: Option<String>,
    /// The language of `code`: one of [`LANGUAGES`].
    #[serde(default)]
    pub language: Option<String>,
    /// Standard input (text); none: empty.
    #[serde(default)]
    pub stdin: Option<String>,
    /// Files written before it runs, path to base64 content (relative paths are taken
    /// from the working directory).
    #[serde(default)]
    pub files: BTreeMap<String, Base64Bytes>,
    /// Regular files returned after it ran (at most 512 KiB together).
    #[serde(default)]
    pub fetch_files: Vec<String>,
    /// Extra environment variables.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory; default: the pool's.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Kill it (and all it started) after this many seconds. Default 10.
    #[serde(default = "default_timeout_s")]
    pub timeout_s: f64,
    /// Address-space limit of each of its processes, MiB; default: only the pool's
    /// memory limit.
    #[serde(default)]
    pub memory_limit_mb: Option<u64>,
    /// How long to wait for a free sandbox of the pool, seconds; default 30. Past it the
    /// call fails with `capacity`.
    #[serde(default)]
    pub max_wait_s: Option<f64>,
}

/// How a call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FnCallStatus {
    /// The command ran and exited (any exit code, or a signal).
    Finished,
    /// It ran out of time and was killed.
    TimedOut,
    /// It could not start: an input file could not be written, or its working directory
    /// or program is missing (`error` says which).
    SetupError,
}

/// Answer of `POST /v1/fncall`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FnCallResponse {
    /// How it ended.
    pub status: FnCallStatus,
    /// Its exit code, when it exited.
    pub exit_code: Option<i32>,
    /// The signal that ended it, if one did.
    pub signal: Option<i32>,
    /// Standard output (lossy UTF-8; the last MiB).
    pub stdout: String,
    /// Standard error (lossy UTF-8; the last MiB).
    pub stderr: String,
    /// Output beyond the kept MiB was dropped.
    #[serde(default)]
    pub stdout_truncated: bool,
    /// Likewise for stderr.
    #[serde(default)]
    pub stderr_truncated: bool,
    /// Wall time of the call in the sandbox, ms.
    pub duration_ms: u64,
    /// The files asked for.
    #[serde(default)]
    pub files: BTreeMap<String, FetchedFile>,
    /// Why it could not start (`setup_error`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The sandbox that ran it.
    pub sandbox_id: String,
    /// Time to set up the call's private view, microseconds.
    pub setup_us: u64,
    /// Time to tear it down after the command ended (the reset), microseconds.
    pub teardown_us: u64,
}

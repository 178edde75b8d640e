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
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
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
pub const LANGUAGES: &[&str] = &["python", "bash", "sh", "cpp", "c"];

/// Where a call's `code` is written (in the call's private view).
pub const CODE_DIR: &str = "/tmp/fncall";

/// How a language's code runs: the file it is written to, the compile step (if any)
/// and the command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LanguageRun {
    /// Where the code is written.
    pub file: String,
    /// The compiler's argv, for compiled languages.
    pub compile: Option<Vec<String>>,
    /// The command that runs it.
    pub run: Vec<String>,
}

/// How `language`'s code runs, or `None` for one not in [`LANGUAGES`]. C++ is
/// `g++ -std=c++17 -O2`, C `gcc -std=c11 -O2` (the image must have them).
pub fn language_run(language: &str) -> Option<LanguageRun> {
    let dir = CODE_DIR;
    let interpreted = |file: &str, interpreter: &str| LanguageRun {
        file: format!("{dir}/{file}"),
        compile: None,
        run: vec![interpreter.to_string(), format!("{dir}/{file}")],
    };
    let compiled = |file: &str, compiler: &[&str]| {
        let mut argv: Vec<String> = compiler.iter().map(|s| s.to_string()).collect();
        argv.extend([
            "-o".to_string(),
            format!("{dir}/main"),
            format!("{dir}/{file}"),
        ]);
        LanguageRun {
            file: format!("{dir}/{file}"),
            compile: Some(argv),
            run: vec![format!("{dir}/main")],
        }
    };
    Some(match language {
        "python" | "python3" => interpreted("main.py", "python3"),
        "bash" => interpreted("main.sh", "bash"),
        "sh" => interpreted("main.sh", "sh"),
        "cpp" | "c++" => compiled("main.cpp", &["g++", "-std=c++17", "-O2"]),
        "c" => compiled("main.c", &["gcc", "-std=c11", "-O2"]),
        _ => return None,
    })
}

fn default_timeout_s() -> f64 {
    10.0
}

/// `POST /v1/fncall`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
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
    /// For a compiled language: the compiler's timeout, seconds. Default 10.
    #[serde(default = "default_timeout_s")]
    pub compile_timeout_s: f64,
    /// Address-space limit of each of its processes, MiB; default: only the pool's
    /// memory limit.
    #[serde(default)]
    pub memory_limit_mb: Option<u64>,
    /// How long to wait for a free sandbox of the pool, seconds; default 30. Past it the
    /// call fails with `capacity`.
    #[serde(default)]
    pub max_wait_s: Option<f64>,
    /// Its place among waiting calls: `high` before `medium` (the default) before `low`;
    /// a `low` call never grows the pool (it runs only on spare warm sandboxes).
    #[serde(default)]
    pub priority: super::Priority,
}

/// How a call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum FnCallStatus {
    /// The command ran and exited (any exit code, or a signal).
    Finished,
    /// It ran out of time and was killed.
    TimedOut,
    /// Its code did not compile (or the compiler ran out of time): see `compile`.
    CompileError,
    /// It could not start: an input file could not be written, or its working directory
    /// or program is missing (`error` says which).
    SetupError,
}

/// The compile step of a call in a compiled language.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct FnCallCompile {
    /// Exit code of the compiler, when it exited.
    pub exit_code: Option<i32>,
    /// The signal that ended it.
    pub signal: Option<i32>,
    /// Its timeout killed it.
    pub timed_out: bool,
    /// Its standard output (the last 256 KiB).
    pub stdout: String,
    /// Its standard error (the last 256 KiB).
    pub stderr: String,
    /// Its wall time, ms.
    pub duration_ms: u64,
}

/// Answer of `POST /v1/fncall`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct FnCallResponse {
    /// How it ended.
    pub status: FnCallStatus,
    /// The compile step, for a compiled language.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compile: Option<FnCallCompile>,
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

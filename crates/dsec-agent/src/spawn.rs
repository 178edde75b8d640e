//! Building and spawning child processes with `std::process::Command`.
//!
//! Every child becomes the leader of a new session and process group (so timeouts and
//! signals can address the whole tree with `killpg`), starts with default signal
//! dispositions and an empty mask, and gets exactly the environment the request asks for
//! (the agent's defaults plus the request's additions).

use std::collections::BTreeMap;
use std::io;
use std::os::fd::RawFd;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use dsec_wire::ApiError;

use crate::error::{bad_request, io_err};
use crate::{sys, AgentConfig};

/// What to spawn.
#[derive(Debug)]
pub struct SpawnSpec<'a> {
    /// Program and arguments.
    pub argv: &'a [String],
    /// Request environment, added to the configured defaults.
    pub env: &'a BTreeMap<String, String>,
    /// Requested working directory (absolute, or relative to the default).
    pub cwd: Option<&'a str>,
    /// Standard input.
    pub stdin: Stdio,
    /// Standard output.
    pub stdout: Stdio,
    /// Standard error.
    pub stderr: Stdio,
    /// Make fd 0 (a PTY slave) the controlling terminal.
    pub ctty: bool,
    /// A descriptor to place at fd 3 in the child.
    pub fd3: Option<RawFd>,
    /// Environment entries set only if neither defaults nor request set them.
    pub fallback_env: &'a [(&'a str, &'a str)],
}

/// The working directory a request asks for.
pub fn resolve_cwd(cfg: &AgentConfig, cwd: Option<&str>) -> PathBuf {
    let base = PathBuf::from(&cfg.default_cwd);
    match cwd {
        None | Some("") => base,
        Some(c) => base.join(c),
    }
}

/// Spawns the child. Errors name the program and working directory.
pub fn spawn(cfg: &AgentConfig, spec: SpawnSpec<'_>) -> Result<Child, ApiError> {
    let Some(program) = spec.argv.first().filter(|p| !p.is_empty()) else {
        return Err(bad_request("empty command"));
    };
    let cwd = resolve_cwd(cfg, spec.cwd);
    let mut cmd = Command::new(program);
    cmd.args(&spec.argv[1..])
        .env_clear()
        .envs(&cfg.default_env)
        .envs(spec.env)
        .current_dir(&cwd)
        .stdin(spec.stdin)
        .stdout(spec.stdout)
        .stderr(spec.stderr);
    for (k, v) in spec.fallback_env {
        if !cfg.default_env.contains_key(*k) && !spec.env.contains_key(*k) {
            cmd.env(k, v);
        }
    }
    if !cfg.default_env.contains_key("PATH") && !spec.env.contains_key("PATH") {
        cmd.env("PATH", crate::DEFAULT_PATH);
    }
    let ctty = spec.ctty;
    let fd3 = spec.fd3;
    // SAFETY: the closure only makes async-signal-safe syscalls (see sys::child_setup) and
    // captures plain integers.
    unsafe {
        cmd.pre_exec(move || sys::child_setup(ctty, fd3));
    }
    cmd.spawn().map_err(|err| spawn_error(&err, program, &cwd))
}

fn spawn_error(err: &io::Error, program: &str, cwd: &std::path::Path) -> ApiError {
    let what = if err.raw_os_error() == Some(libc::ENOENT) {
        if cwd.is_dir() {
            format!("executable not found: {program}")
        } else {
            format!(
                "working directory not found: {} (spawning {program})",
                cwd.display()
            )
        }
    } else {
        format!("spawning {program} in {}: {err}", cwd.display())
    };
    let mut e = io_err(err, "spawn", program);
    e.message = what;
    e
}

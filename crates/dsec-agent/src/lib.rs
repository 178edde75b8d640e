//! dsec-agent: the only dsec code inside a sandbox.
//!
//! The agent serves the node <-> agent protocol of [`dsec_wire::agent`] on a unix socket:
//! a connection carries one request at a time. It runs commands ([`exec`]), persistent bash
//! sessions ([`session`]), background processes with re-attachable output ([`process`]),
//! and file and tar transfers confined to the sandbox root ([`files`], [`tar`],
//! [`pathsafe`]).
//!
//! Architecture: a single-threaded tokio runtime (thousands of idle sandboxes per node must
//! stay cheap) with a `LocalSet`, so shared state is `Rc`/`RefCell`. Children are spawned
//! with `std::process::Command` and reaped by one central [`reaper`], because as PID 1 the
//! agent must reap every orphan too.

use std::collections::BTreeMap;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;

pub mod conn;
pub mod error;
pub mod exec;
pub mod fdio;
pub mod files;
pub mod fncall;
pub mod pathsafe;
pub mod process;
pub mod reaper;
pub mod ring;
pub mod server;
pub mod session;
pub mod spawn;
pub mod sys;
pub mod tar;
pub mod users;
pub mod vm_channel;

pub use error::AgentError;

/// Most output the agent keeps of a sandbox together: background processes (exited
/// ones included), running execs (their `output_limit` per stream, then nothing) and
/// session commands, beyond [`KEPT_OUTPUT_FLOOR`] each. The agent runs in the sandbox's
/// cgroup, so what it keeps is charged to the sandbox's memory. Short of it, the output
/// of the longest exited processes goes first, then rings and session outputs keep
/// shorter tails (marked truncated).
pub const KEPT_OUTPUT_LIMIT: usize = 64 * 1024 * 1024;

/// Output every background process's stream may keep whatever the others hold.
pub const KEPT_OUTPUT_FLOOR: usize = 64 * 1024;

/// The `PATH` given to processes when the configuration names none.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Configuration of one agent.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Directory that every file operation is confined to (`/` inside a sandbox).
    /// Processes are not chrooted: they see the real file system, which inside a sandbox
    /// is the same tree.
    pub root: PathBuf,
    /// Environment of every process, session and exec (requests add to it).
    pub default_env: BTreeMap<String, String>,
    /// Working directory when a request names none; relative request paths are resolved
    /// against it too.
    pub default_cwd: String,
    /// True when the agent is PID 1 of the sandbox and must reap orphans.
    pub is_init: bool,
    /// Landlock ruleset every command is confined by (the sandbox's writable paths).
    pub landlock: Option<std::sync::Arc<std::os::fd::OwnedFd>>,
    /// User commands run as when the request names none (`None`: root).
    pub default_user: Option<String>,
    /// The call helper of a sandbox that serves function calls ([`fncall`]).
    pub call_helper: Option<std::sync::Arc<fncall::CallHelper>>,
}

impl AgentConfig {
    /// Who a command runs as: `requested`, else the default user, looked up in the
    /// sandbox's files at each call (commands may add users). `None`: root, no switch.
    pub fn identity(
        &self,
        requested: Option<&str>,
    ) -> Result<Option<users::Identity>, dsec_wire::ApiError> {
        match requested.or(self.default_user.as_deref()) {
            None => Ok(None),
            Some(spec) => users::resolve(&self.root, spec).map(Some),
        }
    }
}

impl Default for AgentConfig {
    fn default() -> Self {
        let mut default_env = BTreeMap::new();
        default_env.insert("PATH".to_string(), DEFAULT_PATH.to_string());
        default_env.insert("HOME".to_string(), "/root".to_string());
        default_env.insert("LANG".to_string(), "C.UTF-8".to_string());
        Self {
            root: PathBuf::from("/"),
            default_env,
            default_cwd: "/".to_string(),
            is_init: false,
            landlock: None,
            default_user: None,
            call_helper: None,
        }
    }
}

/// Serves the agent protocol on `listener` forever, on a current-thread tokio runtime.
///
/// Returns only if the agent cannot start (runtime, root directory, signal handler) or the
/// listener fails for good.
pub fn run(listener: UnixListener, cfg: AgentConfig) -> Result<(), AgentError> {
    // Before the runtime's threads exist, so that they inherit it (see `reaper`).
    reaper::block_sigchld().map_err(AgentError::Signal)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(AgentError::Runtime)?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, server::serve(listener, cfg))
}

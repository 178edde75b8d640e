//! Building and spawning child processes with `std::process::Command`.
//!
//! Every child becomes the leader of a new session and process group (so timeouts and
//! signals can address the whole tree with `killpg`), starts with default signal
//! dispositions and an empty mask, and gets exactly the environment the request asks for
//! (the agent's defaults plus the request's additions).
//!
//! Every child gets [`COMMAND_OOM_SCORE_ADJ`], so that when the sandbox runs out of
//! memory the kernel kills commands, not the agent (which the node puts at -1000 where it
//! may), and no command keeps the agent's -1000. The child writes it itself before its
//! exec, so nothing it runs ever has the agent's score. Where it may not (in a user
//! namespace: before the exec the child still shares or copies the agent's non-dumpable
//! memory, whose `/proc` files belong to the host's root), the agent writes it right
//! after the exec, and a program that forks in its first microseconds may leave a child
//! with the agent's score; the node therefore lowers the agent to -1000 only where the
//! child can write (see `dsec_container::harden::protect_from_oom`).

use std::collections::BTreeMap;
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use dsec_container::spawnattr::{FileActions, SpawnAttr};
use dsec_wire::ApiError;

use crate::error::{bad_request, io_err, pids_exhausted};
use crate::users::Identity;
use crate::{sys, AgentConfig};

/// `oom_score_adj` of every command: above the agent's (0 or -1000), so that the OOM
/// killer picks commands first. Commands may raise it, or lower it to the floor they
/// inherit (0 unless the node's own is lower).
pub const COMMAND_OOM_SCORE_ADJ: &str = "500";

/// Where a child writes its own score before its exec.
const OWN_OOM_SCORE: &std::ffi::CStr = c"/proc/self/oom_score_adj";

/// Gives a just exec'd child [`COMMAND_OOM_SCORE_ADJ`] (no error if it already exited).
fn command_oom_score(pid: u32) {
    if let Err(e) = std::fs::write(format!("/proc/{pid}/oom_score_adj"), COMMAND_OOM_SCORE_ADJ) {
        tracing::debug!(pid, error = %e, "setting a command's OOM score");
    }
}

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
    /// Run as this user (root when `None`).
    pub identity: Option<&'a Identity>,
}

/// `HOME`, `USER` and `LOGNAME` of a non-root identity: they replace the defaults (root's)
/// unless the request sets them.
pub(crate) fn identity_env(identity: Option<&Identity>) -> Vec<(&'static str, String)> {
    match identity {
        Some(id) if !id.is_root() => vec![
            ("HOME", id.home.clone()),
            ("USER", id.name.clone()),
            ("LOGNAME", id.name.clone()),
        ],
        _ => Vec::new(),
    }
}

/// The identity to switch to in the child, if any (root needs no switch).
pub(crate) fn switch_to(identity: Option<&Identity>) -> Option<(u32, u32, Vec<u32>)> {
    identity
        .filter(|id| !id.is_root())
        .map(|id| (id.uid, id.gid, id.groups.clone()))
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
    root_settled()?;
    let cwd = resolve_cwd(cfg, spec.cwd);
    let mut cmd = Command::new(program);
    cmd.args(&spec.argv[1..])
        .env_clear()
        .envs(&cfg.default_env)
        .envs(identity_env(spec.identity))
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
    let landlock = cfg.landlock.as_ref().map(|r| r.as_raw_fd());
    let user = switch_to(spec.identity);
    if !ctty && fd3.is_none() && landlock.is_none() && user.is_none() {
        // The common case (exec, background processes without a PTY): a new process group
        // is all the tree-kill needs, and without a pre_exec hook std can use
        // posix_spawn (vfork semantics) instead of fork, which is most of an exec's cost.
        // Handlers reset on exec; std resets SIGPIPE and the signal mask.
        cmd.process_group(0);
    } else {
        // SAFETY: the closure only makes async-signal-safe syscalls (see sys::child_setup)
        // and captures plain integers.
        unsafe {
            cmd.pre_exec(move || {
                // First, while still root (after a user switch the file is not ours).
                sys::try_write(OWN_OOM_SCORE, COMMAND_OOM_SCORE_ADJ.as_bytes());
                sys::child_setup(ctty, fd3)?;
                if let Some(fd) = landlock {
                    // Confined while still root (restricting needs no privilege then).
                    dsec_container::landlock::restrict_self(fd)?;
                }
                match &user {
                    Some((uid, gid, groups)) => sys::switch_user(*uid, *gid, groups),
                    None => Ok(()),
                }
            });
        }
    }
    let child = cmd
        .spawn()
        .map_err(|err| spawn_error(&err, program, &cwd))?;
    // std returns once the child has exec'd (it waits for the exec's outcome); where the
    // child could not write its score, this does.
    command_oom_score(child.id());
    Ok(child)
}

/// Nothing starts in the sandbox before init's old root is gone (a no-op in an agent
/// that is not a sandbox's init).
fn root_settled() -> Result<(), ApiError> {
    dsec_container::rootfs::old_root_gone()
        .map_err(|e| ApiError::new(dsec_wire::ErrorCode::Internal, format!("sandbox root: {e}")))
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
    } else if err.raw_os_error() == Some(libc::E2BIG) {
        // The caller's own input: say which limit, and the way around it.
        return bad_request(format!(
            "spawning {program}: arguments and environment are over the kernel's limit \
             (E2BIG: at most 128 KiB per string, about 2 MiB in all); pass large data \
             through stdin or a file"
        ));
    } else if err.raw_os_error() == Some(libc::EAGAIN) {
        return pids_exhausted(&format!("spawning {program}"));
    } else {
        format!("spawning {program} in {}: {err}", cwd.display())
    };
    let mut e = io_err(err, "spawn", program);
    e.message = what;
    e
}

/// A child started by [`spawn_piped`]: its pid and the parent's ends of its pipes.
#[derive(Debug)]
pub struct Piped {
    /// Process id (also its process group id).
    pub pid: u32,
    /// Write end of its stdin, if stdin was piped.
    pub stdin: Option<OwnedFd>,
    /// Read end of its stdout.
    pub stdout: OwnedFd,
    /// Read end of its stderr.
    pub stderr: OwnedFd,
}

/// [`spawn_piped`] for a sandbox with file rules or a command of another user: [`spawn`]
/// forks, confines the child with the Landlock ruleset and/or switches its user, and
/// execs (the vfork-style child has no place for those steps).
fn spawn_piped_forked(
    cfg: &AgentConfig,
    argv: &[String],
    env: &BTreeMap<String, String>,
    cwd: Option<&str>,
    stdin_piped: bool,
    identity: Option<&Identity>,
) -> Result<Piped, ApiError> {
    let mut child = spawn(
        cfg,
        SpawnSpec {
            argv,
            env,
            cwd,
            stdin: if stdin_piped {
                Stdio::piped()
            } else {
                Stdio::null()
            },
            stdout: Stdio::piped(),
            stderr: Stdio::piped(),
            ctty: false,
            fd3: None,
            fallback_env: &[],
            identity,
        },
    )?;
    let program = argv.first().map(String::as_str).unwrap_or_default();
    let missing = || io_err(&io::Error::other("pipe missing"), "spawn", program);
    let stdout = child.stdout.take().map(OwnedFd::from).ok_or_else(missing)?;
    let stderr = child.stderr.take().map(OwnedFd::from).ok_or_else(missing)?;
    // The agent reaps its children itself (waitpid(-1)); the handle is not waited on.
    Ok(Piped {
        pid: child.id(),
        stdin: child.stdin.take().map(OwnedFd::from),
        stdout,
        stderr,
    })
}

/// The agent's own read-only `/dev/null` (close-on-exec), opened at the first use: a
/// child without input gets it dup'ed to fd 0 instead of looking the path up itself,
/// on the exec path while the agent waits (vfork). `None` if it cannot be opened.
fn dev_null() -> Option<RawFd> {
    static NULL: std::sync::OnceLock<Option<OwnedFd>> = std::sync::OnceLock::new();
    NULL.get_or_init(|| std::fs::File::open("/dev/null").ok().map(OwnedFd::from))
        .as_ref()
        .map(AsRawFd::as_raw_fd)
}

fn pipe_cloexec() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two fds into the array on success.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both fds were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Looks `program` up in the child's PATH (as execvp would in the child).
fn resolve_program(program: &str, path: Option<&str>) -> Option<PathBuf> {
    if program.contains('/') {
        return Some(PathBuf::from(program));
    }
    let path = path.unwrap_or(crate::DEFAULT_PATH);
    path.split(':')
        .filter(|d| !d.is_empty())
        .map(|d| PathBuf::from(d).join(program))
        .find(|p| {
            let Ok(c) = CString::new(p.as_os_str().as_bytes()) else {
                return false;
            };
            // SAFETY: access with a valid C string.
            unsafe { libc::access(c.as_ptr(), libc::X_OK) == 0 }
        })
}

fn cstr(s: &str) -> Result<CString, ApiError> {
    CString::new(s).map_err(|_| bad_request("arguments and environment must not contain NUL bytes"))
}

/// Spawns a child with piped stdout/stderr (and stdin if `stdin_piped`, else /dev/null)
/// in a new process group, with [`dsec_container::spawnattr::spawn`] (vfork semantics:
/// no page-table copy of the agent, about ten system calls in the child). This is the
/// exec hot path; std's `Command` would fall back to fork in a static binary because it
/// finds `posix_spawn_file_actions_addchdir_np` by dlsym.
pub fn spawn_piped(
    cfg: &AgentConfig,
    argv: &[String],
    env: &BTreeMap<String, String>,
    cwd: Option<&str>,
    stdin_piped: bool,
    identity: Option<&Identity>,
) -> Result<Piped, ApiError> {
    let Some(program) = argv.first().filter(|p| !p.is_empty()) else {
        return Err(bad_request("empty command"));
    };
    root_settled()?;
    if cfg.landlock.is_some() || switch_to(identity).is_some() {
        return spawn_piped_forked(cfg, argv, env, cwd, stdin_piped, identity);
    }
    let cwd = resolve_cwd(cfg, cwd);
    let mut full_env: BTreeMap<&str, &str> = cfg
        .default_env
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    full_env.extend(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    full_env.entry("PATH").or_insert(crate::DEFAULT_PATH);
    let not_found = || {
        let err = io::Error::from_raw_os_error(libc::ENOENT);
        spawn_error(&err, program, &cwd)
    };
    let exe = resolve_program(program, full_env.get("PATH").copied()).ok_or_else(not_found)?;
    let exe_c =
        CString::new(exe.as_os_str().as_bytes()).map_err(|_| bad_request("NUL in program path"))?;
    let argv_c = argv
        .iter()
        .map(|a| cstr(a))
        .collect::<Result<Vec<_>, _>>()?;
    let env_c = full_env
        .iter()
        .map(|(k, v)| cstr(&format!("{k}={v}")))
        .collect::<Result<Vec<_>, _>>()?;
    let cwd_c = CString::new(cwd.as_os_str().as_bytes()).map_err(|_| bad_request("NUL in cwd"))?;
    let io_fail = |e: io::Error| io_err(&e, "creating pipes for", program);
    let (out_r, out_w) = pipe_cloexec().map_err(io_fail)?;
    let (err_r, err_w) = pipe_cloexec().map_err(io_fail)?;
    let stdin_pipe = if stdin_piped {
        Some(pipe_cloexec().map_err(io_fail)?)
    } else {
        None
    };

    let attr = SpawnAttr::new(libc::POSIX_SPAWN_SETPGROUP as libc::c_short);
    let mut actions = FileActions::new();
    match (&stdin_pipe, dev_null()) {
        (Some((r, _)), _) => actions.dup2(r.as_raw_fd(), 0),
        (None, Some(null)) => actions.dup2(null, 0),
        (None, None) => actions.open(0, c"/dev/null", libc::O_RDONLY, 0),
    }
    actions.dup2(out_w.as_raw_fd(), 1);
    actions.dup2(err_w.as_raw_fd(), 2);
    actions.chdir(&cwd_c);
    actions.try_write(OWN_OOM_SCORE, COMMAND_OOM_SCORE_ADJ.as_bytes());
    let pid = dsec_container::spawnattr::spawn(&exe_c, &argv_c, &env_c, &actions, &attr)
        .map_err(|e| spawn_error(&e, program, &cwd))?;
    // The vfork-style child has exec'd: the agent runs again only then.
    command_oom_score(pid as u32);
    Ok(Piped {
        pid: pid as u32,
        stdin: stdin_pipe.map(|(_, w)| w),
        stdout: out_r,
        stderr: err_r,
    })
}

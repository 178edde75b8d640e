//! `dsec-agent init`: the sandbox's PID 1.
//!
//! Started by the node (or forked by `dsec-agent zygote`, see `zygote.rs`) with the
//! [`InitSpec`] on stdin (or in the zygote request), the agent's listening socket on fd
//! [`LISTEN_FD`] and a status pipe on fd [`STATUS_FD`]. Builds the sandbox around itself
//! with [`dsec_container::boot`], reports `ready` (or `error ...`) on the status pipe and
//! then serves the agent protocol for the sandbox's whole life.

use std::io::Read;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixListener;

use dsec_agent::AgentConfig;
use dsec_wire::init::{InitSpec, LISTEN_FD, STATUS_FD};

fn report(status: &OwnedFd, line: &str) {
    let _ = nix::unistd::write(status, format!("{line}\n").as_bytes());
}

/// Runs an exec'd init (spec on stdin); returns only on failure (after reporting it on
/// the status pipe).
pub fn init() -> Result<(), Box<dyn std::error::Error>> {
    // SAFETY: the node guarantees fd 4 is the write end of the status pipe, owned by us.
    let status = unsafe { OwnedFd::from_raw_fd(STATUS_FD) };
    let mut raw = Vec::new();
    if let Err(e) = std::io::stdin().read_to_end(&mut raw) {
        report(&status, &format!("error reading init spec: {e}"));
        return Err(e.into());
    }
    let spec: InitSpec = match serde_json::from_slice(&raw) {
        Ok(s) => s,
        Err(e) => {
            report(&status, &format!("error invalid init spec: {e}"));
            return Err(e.into());
        }
    };
    run(&spec, status)
}

/// Builds the sandbox described by `spec` around this process and serves it as its PID 1
/// (the listener and `status` at their fixed numbers); returns only on failure.
pub fn run(spec: &InitSpec, status: OwnedFd) -> Result<(), Box<dyn std::error::Error>> {
    unignore_signals();
    let old_root = match dsec_container::boot(spec, &status) {
        Ok(old_root) => old_root,
        Err(e) => {
            report(&status, &format!("error {e}"));
            return Err(e.into());
        }
    };
    let call_helper = if spec.fncall {
        // The helper is forked before init drops its privileges (it makes each call's
        // namespaces) and while init is single-threaded: the old root's detach thread
        // ends first.
        let started = old_root
            .wait()
            .map_err(|e| e.to_string())
            .and_then(|()| {
                dsec_agent::fncall::helper::start().map_err(|e| format!("call helper: {e}"))
            })
            .and_then(|sock| {
                dsec_container::harden::apply()
                    .map(|()| sock)
                    .map_err(|e| e.to_string())
            });
        match started {
            Ok(sock) => Some(std::sync::Arc::new(dsec_agent::fncall::CallHelper(sock))),
            Err(e) => {
                report(&status, &format!("error {e}"));
                return Err(e.into());
            }
        }
    } else {
        // Every process start waits for it first (`spawn.rs`).
        old_root.defer();
        None
    };
    // Now PID 1 inside the sandbox. Nothing we start may inherit the listener or the pipe.
    for fd in [LISTEN_FD, STATUS_FD] {
        // SAFETY: fcntl on fds we own.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
    // SAFETY: the node guarantees fd 3 is a bound, listening unix socket, owned by us.
    let listener = unsafe { UnixListener::from_raw_fd(LISTEN_FD) };
    // stdin was the spec pipe; point it at /dev/null inside the sandbox.
    if let Ok(null) = std::fs::File::open("/dev/null") {
        let _ = nix::unistd::dup2(std::os::fd::AsRawFd::as_raw_fd(&null), 0);
    }
    let rules = dsec_container::landlock::Rules {
        writable: &spec.writable_paths,
        tcp_bind: spec.tcp_bind.as_deref(),
        tcp_connect: spec.tcp_connect.as_deref(),
    };
    let landlock =
        if rules.writable.is_empty() && rules.tcp_bind.is_none() && rules.tcp_connect.is_none() {
            None
        } else {
            match dsec_container::landlock::ruleset(&rules) {
                Ok(r) => Some(std::sync::Arc::new(r)),
                Err(e) => {
                    // A path the request named that the image lacks is the caller's to
                    // fix: `invalid` tells the node to answer bad_request.
                    let line = if e.kind() == std::io::ErrorKind::NotFound {
                        format!(
                            "error invalid filesystem.writable: {e}: name directories or \
                             files that exist in the image"
                        )
                    } else {
                        format!("error filesystem: {e}")
                    };
                    report(&status, &line);
                    return Err(e.into());
                }
            }
        };
    let cfg = AgentConfig {
        root: "/".into(),
        default_env: spec.env.clone(),
        default_cwd: spec.workdir.clone(),
        is_init: true,
        landlock,
        default_user: spec.user.clone(),
        call_helper,
    };
    report(&status, "ready");
    drop(status);
    dsec_agent::run(listener, cfg)?;
    Ok(())
}

/// Resets every signal the node's own launcher left ignored (`nohup` ignores SIGHUP, a
/// background job in a script SIGINT and SIGQUIT) to its default: ignored signals cross
/// `exec`, so every command in the sandbox would otherwise inherit them, and a command
/// that ignores SIGINT cannot be interrupted. SIGPIPE stays as the agent runtime set it;
/// the commands it starts get it back at its default.
fn unignore_signals() {
    for sig in 1..=64 {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP || sig == libc::SIGPIPE {
            continue;
        }
        if crate::signals::is_ignored(sig) {
            let _ = crate::signals::set_default(sig, 0);
        }
    }
}

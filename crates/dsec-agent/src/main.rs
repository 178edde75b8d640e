//! The `dsec-agent` binary.
//!
//! Subcommands:
//! - `serve`: bind a unix socket and serve the agent protocol (tests, debugging, or an
//!   agent started by a container runtime).
//!
//! - `init`: PID 1 of a container sandbox: `dsec-container` builds the sandbox around the
//!   process, then it serves with `is_init = true`.
//!
//! - `zygote`: a warm agent the node keeps running and forks inits from (`zygote.rs`).
//!
//! - `vm-init`: PID 1 of a microVM guest, or a full VM's initramfs (`vm.rs`).
//! - `vm-service`: the agent as a full VM's system service (`vm.rs`).

use std::collections::BTreeMap;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::process::ExitCode;

mod init;
mod memguard;
mod vm;
use dsec_container::signals;
mod zygote;

use clap::{Args, Parser, Subcommand};
use dsec_agent::AgentConfig;

/// The dsec in-sandbox agent.
#[derive(Debug, Parser)]
#[command(name = "dsec-agent", version, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Serve the agent protocol on a unix socket.
    Serve(ServeArgs),
    /// Run as a container sandbox's PID 1 (started by the node; see `init.rs`).
    Init,
    /// Fork sandbox inits on the node's request (started by the node; see `zygote.rs`).
    Zygote,
    /// Run as a microVM guest's PID 1 (the kernel starts it from the initramfs; see `vm.rs`).
    VmInit,
    /// Serve as a full VM's system service (its unit is installed by `vm-init`).
    VmService,
}

/// Options of `serve` (shared with a future `init`).
#[derive(Debug, Args)]
struct ServeArgs {
    /// Path of the unix socket to listen on (a stale file there is removed).
    #[arg(
        long,
        required_unless_present = "listen_fd",
        conflicts_with = "listen_fd"
    )]
    socket: Option<PathBuf>,
    /// Serve on this inherited, bound and listening unix socket instead (how the node
    /// starts the agent under an OCI runtime: the socket's path is on the host only).
    #[arg(long)]
    listen_fd: Option<i32>,
    /// Directory that file operations are confined to.
    #[arg(long, default_value = "/")]
    root: PathBuf,
    /// Default working directory of processes and of relative paths.
    #[arg(long, default_value = "/")]
    cwd: String,
    /// Extra environment for every process, as KEY=VALUE (repeatable).
    #[arg(long = "env", value_parser = parse_env)]
    env: Vec<(String, String)>,
    /// Default user of commands (name or UID[:GID]; default root).
    #[arg(long)]
    user: Option<String>,
}

impl ServeArgs {
    /// The agent configuration these options describe.
    fn config(&self) -> AgentConfig {
        let mut cfg = AgentConfig {
            root: self.root.clone(),
            default_cwd: self.cwd.clone(),
            is_init: std::process::id() == 1,
            default_user: self.user.clone(),
            ..AgentConfig::default()
        };
        let extra: BTreeMap<String, String> = self.env.iter().cloned().collect();
        cfg.default_env.extend(extra);
        cfg
    }
}

fn parse_env(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

fn serve(args: &ServeArgs) -> Result<(), Box<dyn std::error::Error>> {
    let listener = match (&args.socket, args.listen_fd) {
        (_, Some(fd)) => inherited_listener(fd)?,
        (Some(socket), None) => {
            match std::fs::remove_file(socket) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(format!("removing stale socket {}: {e}", socket.display()).into())
                }
            }
            UnixListener::bind(socket).map_err(|e| format!("binding {}: {e}", socket.display()))?
        }
        (None, None) => return Err("--socket or --listen-fd is required".into()),
    };
    dsec_agent::run(listener, args.config())?;
    Ok(())
}

/// Takes over the listening socket at `fd` (checked to be one), close-on-exec from here:
/// no command may inherit it.
fn inherited_listener(fd: i32) -> Result<UnixListener, Box<dyn std::error::Error>> {
    if fd < 3 {
        return Err(format!("--listen-fd {fd}: not a socket of ours").into());
    }
    // SAFETY: fcntl on a descriptor number; an unopened one fails with EBADF.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } != 0 {
        return Err(format!("--listen-fd {fd}: {}", std::io::Error::last_os_error()).into());
    }
    let mut listening: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `listening`.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ACCEPTCONN,
            (&mut listening as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if rc != 0 || listening == 0 {
        return Err(format!("--listen-fd {fd}: not a listening socket").into());
    }
    // SAFETY: the descriptor is open, a listening socket, and handed to us to own.
    Ok(unsafe { <UnixListener as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

/// Makes this process non-dumpable: nothing in the sandbox may ptrace the agent, read or
/// write its memory through `/proc/PID/mem`, or open its descriptors through
/// `/proc/PID/fd`, at any isolation level (under `oci` the agent is `serve`, started by
/// the runtime as root with the same capabilities as the code it serves). First thing,
/// before any request can be read; inherited by the forks of `zygote` and `init`, reset
/// by every command's own `execve`.
fn not_dumpable() -> std::io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn main() -> ExitCode {
    if let Err(e) = not_dumpable() {
        eprintln!("dsec-agent: PR_SET_DUMPABLE: {e}");
        return ExitCode::FAILURE;
    }
    // A guest kernel passes init the command line's words it does not know, before
    // ours: as a guest's PID 1, `vm-init` anywhere is the mode.
    if std::process::id() == 1 && std::env::args().skip(1).any(|a| a == "vm-init") {
        tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_max_level(tracing::Level::INFO)
            .init();
        return match vm::vm_init() {
            Ok(()) => ExitCode::FAILURE,
            Err(e) => vm::fail(&e),
        };
    }
    let cli = Cli::parse();
    // `init` is on every sandbox's start path: a fixed level, no EnvFilter to parse.
    let fmt = tracing_subscriber::fmt().with_writer(std::io::stderr);
    match (&cli.cmd, std::env::var("DSEC_LOG")) {
        (Cmd::Serve(_), Ok(spec)) => fmt
            .with_env_filter(tracing_subscriber::EnvFilter::new(spec))
            .init(),
        _ => fmt.with_max_level(tracing::Level::INFO).init(),
    }
    let res = match &cli.cmd {
        Cmd::Serve(args) => serve(args),
        Cmd::Init => init::init(),
        Cmd::Zygote => zygote::zygote(),
        Cmd::VmInit => match vm::vm_init() {
            Ok(()) => Err("the agent ended".into()),
            Err(e) => vm::fail(&e),
        },
        Cmd::VmService => vm::vm_service(),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dsec-agent: {e}");
            ExitCode::FAILURE
        }
    }
}

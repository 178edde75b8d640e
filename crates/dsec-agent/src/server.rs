//! The accept loop and request dispatch.
//!
//! [`Agent`] holds the state shared by all connections: configuration, the sandbox root,
//! the reaper, the session table and the process table. Each accepted connection is
//! handled by one local task that reads the request frame and answers it.

use std::os::unix::net::UnixListener as StdUnixListener;
use std::rc::Rc;
use std::time::Duration;

use dsec_wire::agent::{Reply, Request, PROTOCOL_VERSION};
use dsec_wire::frame::Frame;
use std::os::unix::net::UnixStream;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use crate::conn::{self, FrameReader, FrameWriter};
use crate::error::{bad_request, AgentError};
use crate::pathsafe::Root;
use crate::process::ProcessTable;
use crate::reaper::{ChildSignals, Reaper};
use crate::ring::Budget;
use crate::session::Sessions;
use crate::{exec, files, fncall, process, session, tar, AgentConfig};

/// State shared by all connections of one agent.
#[derive(Debug)]
pub struct Agent {
    /// The configuration.
    pub cfg: AgentConfig,
    /// The sandbox root for file operations.
    pub root: Root,
    /// The child reaper.
    pub reaper: Rc<Reaper>,
    /// Open shell sessions.
    pub sessions: Sessions,
    /// Background processes.
    pub procs: ProcessTable,
    /// What all output rings may hold together ([`crate::KEPT_OUTPUT_LIMIT`]).
    pub output: Rc<Budget>,
}

impl Agent {
    /// Makes room for `need` bytes of output if the budget is short: the kept output of
    /// exited processes goes, oldest first.
    pub fn room_for_output(&self, need: usize) {
        if self.output.available() < need {
            self.procs.release_exited_output(&self.output, need);
        }
    }
}

/// Serves connections until the listener fails. Must run inside a `LocalSet`, with
/// SIGCHLD blocked in every thread ([`crate::run`] sees to both).
pub async fn serve(listener: StdUnixListener, cfg: AgentConfig) -> Result<(), AgentError> {
    let root = Root::new(&cfg.root, &cfg.default_cwd).map_err(|source| AgentError::Root {
        path: cfg.root.clone(),
        source,
    })?;
    // Watch SIGCHLD before any child can exist (it is blocked since `run`; one that is
    // already pending shows on the descriptor).
    let sigchld = ChildSignals::new().map_err(AgentError::Signal)?;
    let reaper = Reaper::new();
    tokio::task::spawn_local(reaper.clone().run(sigchld));

    listener
        .set_nonblocking(true)
        .map_err(AgentError::Listener)?;
    // Accepted sockets go straight to a read-only registration (`conn::split`): taking
    // them from tokio's listener would register each for both directions first.
    // SAFETY: the listener is the AsyncFd's own, open until it is dropped.
    let listener = unsafe { AsyncFd::register_with_interest(listener, Interest::READABLE) }
        .map_err(|e| AgentError::Listener(e.into()))?;
    let agent = Rc::new(Agent {
        cfg,
        root,
        reaper,
        sessions: Sessions::default(),
        procs: ProcessTable::default(),
        output: Budget::new(crate::KEPT_OUTPUT_LIMIT, crate::KEPT_OUTPUT_FLOOR),
    });
    tracing::info!(pid = std::process::id(), "agent serving");
    loop {
        match accept(&listener).await {
            Ok(stream) => {
                tokio::task::spawn_local(handle(agent.clone(), stream));
            }
            Err(err) => {
                // EMFILE and friends: back off instead of spinning.
                tracing::warn!(%err, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// The next connection.
async fn accept(listener: &AsyncFd<StdUnixListener>) -> std::io::Result<UnixStream> {
    loop {
        let mut ready = listener.readable().await?;
        if let Ok(accepted) = ready.try_io(|l| l.get_ref().accept()) {
            return accepted.map(|(stream, _)| stream);
        }
    }
}

/// Handles one connection: requests one after another while each
/// [`Request::keeps_connection`], until the node closes its side.
async fn handle(agent: Rc<Agent>, stream: UnixStream) {
    let (mut rd, mut wr) = match conn::split(stream) {
        Ok(halves) => halves,
        Err(err) => {
            tracing::warn!(error = %err, "taking over a node connection");
            return;
        }
    };
    loop {
        let req = match rd.next().await {
            Ok(Some(Frame::Json(bytes))) => match serde_json::from_slice::<Request>(&bytes) {
                Ok(req) => req,
                Err(err) => {
                    let _ = wr
                        .error(bad_request(format!("invalid request: {err}")))
                        .await;
                    break;
                }
            },
            Ok(Some(_)) => {
                let _ = wr.error(bad_request("expected a JSON request frame")).await;
                break;
            }
            Ok(None) => return,
            Err(err) => {
                let _ = wr
                    .error(bad_request(format!("reading request: {err}")))
                    .await;
                break;
            }
        };
        tracing::debug!(?req, "request");
        let again = req.keeps_connection();
        dispatch(&agent, req, &mut rd, &mut wr).await;
        if !again {
            break;
        }
    }
    wr.finish().await;
}

async fn dispatch(agent: &Rc<Agent>, req: Request, rd: &mut FrameReader, wr: &mut FrameWriter) {
    // Write errors mean the node went away; there is nobody left to tell.
    let _ = match req {
        Request::Ping => {
            wr.reply(&Reply::Pong {
                version: PROTOCOL_VERSION,
                pid: std::process::id(),
            })
            .await
        }
        Request::Exec(spec) => exec::exec(agent, spec, rd, wr).await,
        Request::ExecKept { key, spec, stream } => {
            process::exec_kept(agent, key, spec, stream, rd, wr).await
        }
        Request::SessionCreate {
            session,
            env,
            cwd,
            user,
        } => {
            let r = session::create(agent, session, env, cwd, user);
            respond(wr, r).await
        }
        Request::SessionRun {
            session,
            command,
            timeout_ms,
        } => {
            let r = session::run(agent, &session, &command, timeout_ms, rd).await;
            respond(wr, r.map(Reply::SessionResult)).await
        }
        Request::SessionInterrupt { session } => {
            respond(wr, session::interrupt(agent, &session).map(|()| Reply::Ok)).await
        }
        Request::SessionClose { session } => {
            respond(wr, session::close(agent, &session).map(|()| Reply::Ok)).await
        }
        Request::SessionList => {
            wr.reply(&Reply::Sessions {
                sessions: agent.sessions.list(),
            })
            .await
        }
        Request::ProcessStart(spec) => {
            respond(wr, process::start(agent, spec).map(Reply::ProcessStarted)).await
        }
        Request::ProcessList => {
            wr.reply(&Reply::Processes {
                processes: agent.procs.list(),
            })
            .await
        }
        Request::ProcessOutput {
            pid,
            stdout_offset,
            stderr_offset,
            follow,
        } => process::output(agent, pid, stdout_offset, stderr_offset, follow, rd, wr).await,
        Request::ProcessStdin { pid, close } => process::stdin(agent, pid, close, rd, wr).await,
        Request::ProcessSignal { pid, signal } => {
            respond(wr, process::signal(agent, pid, signal).map(|()| Reply::Ok)).await
        }
        Request::ProcessResize { pid, size } => {
            respond(wr, process::resize(agent, pid, size).map(|()| Reply::Ok)).await
        }
        Request::FileRead {
            path,
            offset,
            length,
        } => files::read(agent, &path, offset, length, wr).await,
        Request::FileWrite {
            path,
            mode,
            create_parents,
        } => files::write(agent, &path, mode, create_parents, rd, wr).await,
        Request::FileList { path } => respond(wr, files::list(agent, &path)).await,
        Request::FileStat { path } => respond(wr, files::stat(agent, &path)).await,
        Request::FileHash { path } => respond(wr, files::hash(agent, &path).await).await,
        Request::FileMkdir { path } => respond(wr, files::mkdir(agent, &path)).await,
        Request::FileRemove { path, recursive } => {
            respond(wr, files::remove(agent, &path, recursive)).await
        }
        Request::FileRename { from, to } => respond(wr, files::rename(agent, &from, &to)).await,
        Request::TarDownload { path } => tar::download(agent, &path, wr).await,
        Request::TarUpload { path } => tar::upload(agent, &path, rd, wr).await,
        Request::Call(spec) => {
            // A node that goes away takes the call with it (dropping it kills the call).
            let reply = tokio::select! {
                reply = fncall::call(agent, spec) => Some(reply),
                () = rd.closed() => None,
            };
            match reply {
                Some(reply) => wr.reply(&reply).await,
                None => Ok(()),
            }
        }
    };
}

/// Sends a reply or the error that replaced it.
pub async fn respond(
    wr: &mut FrameWriter,
    r: Result<Reply, dsec_wire::ApiError>,
) -> std::io::Result<()> {
    match r {
        Ok(reply) => wr.reply(&reply).await,
        Err(err) => wr.error(err).await,
    }
}

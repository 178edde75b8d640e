//! The node's side of `dsec-agent zygote`: one warm agent process that sandbox inits are
//! forked from instead of exec'd (see the agent's `zygote.rs` for why).
//!
//! The zygote is started at node start and again after it died; a request it cannot take
//! (it died mid-way, or will not start) falls back to exec'ing init. It exits when the
//! node closes its end of the socket, the node's exit included, and holds nothing a
//! restart would have to clean up.

use std::fs;
use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use dsec_wire::init::{InitSpec, ZygoteReply, ZygoteRequest, ZYGOTE_FD, ZYGOTE_MAX_FDS};
use nix::sys::socket::{
    recv, sendmsg, setsockopt, socketpair, sockopt, AddressFamily, ControlMessage, MsgFlags,
    SockFlag, SockType,
};

/// How long the node waits for the zygote to answer a request (a fork takes well under a
/// millisecond; only a stuck zygote takes this long).
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the zygote did not fork an init.
#[derive(Debug, thiserror::Error)]
pub enum ZygoteError {
    /// The zygote could not be reached or started (it is restarted on the next request).
    #[error("zygote: {0}")]
    Io(#[from] io::Error),
    /// The zygote refused the request; it is still running.
    #[error("zygote refused: {0}")]
    Refused(String),
}

/// A running zygote.
#[derive(Debug)]
struct Running {
    sock: OwnedFd,
    pid: libc::pid_t,
}

impl Running {
    /// Kills and reaps the zygote.
    fn stop(self) {
        let pid = nix::unistd::Pid::from_raw(self.pid);
        drop(self.sock);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        let _ = nix::sys::wait::waitpid(pid, None);
    }
}

/// The node's zygote: started on demand, restarted when it died.
#[derive(Debug)]
pub struct Zygote {
    agent_bin: PathBuf,
    log: PathBuf,
    running: Mutex<Option<Running>>,
}

impl Zygote {
    /// A zygote of `agent_bin`, logging to `log`; started now (a failure to start is
    /// logged and retried on first use).
    pub fn new(agent_bin: &Path, log: PathBuf) -> Self {
        let z = Self {
            agent_bin: agent_bin.to_path_buf(),
            log,
            running: Mutex::new(None),
        };
        let mut running = z.lock();
        match z.start() {
            Ok(r) => *running = Some(r),
            Err(e) => tracing::warn!(error = %e, "zygote did not start; inits are exec'd"),
        }
        drop(running);
        z
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Running>> {
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn start(&self) -> io::Result<Running> {
        let (ours, theirs) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )?;
        let timeout = nix::sys::time::TimeVal::new(REPLY_TIMEOUT.as_secs() as _, 0);
        setsockopt(&ours, sockopt::ReceiveTimeout, &timeout)?;
        setsockopt(&ours, sockopt::SendTimeout, &timeout)?;
        if let Some(dir) = self.log.parent() {
            fs::create_dir_all(dir)?;
        }
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let devnull = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null")?;
        let pid = crate::spawn::spawn(
            &self.agent_bin,
            &["dsec-agent", "zygote"],
            &crate::spawn::SpawnFds {
                stdin: devnull.as_raw_fd(),
                stdout: devnull.as_raw_fd(),
                stderr: log.as_raw_fd(),
                fixed: &[(theirs.as_raw_fd(), ZYGOTE_FD)],
            },
        )?;
        tracing::debug!(pid, "zygote started");
        Ok(Running { sock: ours, pid })
    }

    /// Forks an init for `spec` with `fds` (`(descriptor here, number in init)`; number 2
    /// is its stderr). Returns the child's pid; it reports on its status pipe as an
    /// exec'd init does. A zygote that died is restarted once for the request.
    pub fn fork_init(&self, spec: &InitSpec, fds: &[(RawFd, i32)]) -> Result<i32, ZygoteError> {
        if fds.len() > ZYGOTE_MAX_FDS {
            return Err(ZygoteError::Refused(format!(
                "{} descriptors, at most {ZYGOTE_MAX_FDS}",
                fds.len()
            )));
        }
        let req = ZygoteRequest {
            fds: fds.iter().map(|(_, n)| *n).collect(),
            spec: spec.clone(),
        };
        let json = serde_json::to_vec(&req).map_err(io::Error::other)?;
        let raw: Vec<RawFd> = fds.iter().map(|(f, _)| *f).collect();
        let mut running = self.lock();
        let mut last = None;
        for _ in 0..2 {
            let r = match running.take() {
                Some(r) => r,
                None => self.start()?,
            };
            match request(&r.sock, &json, &raw) {
                Ok(ZygoteReply::Forked { pid }) => {
                    *running = Some(r);
                    return Ok(pid);
                }
                Ok(ZygoteReply::Error { message }) => {
                    *running = Some(r);
                    return Err(ZygoteError::Refused(message));
                }
                Err(e) => {
                    tracing::warn!(pid = r.pid, error = %e, "zygote lost; restarting it");
                    r.stop();
                    last = Some(e);
                }
            }
        }
        Err(last
            .unwrap_or_else(|| io::Error::other("zygote unavailable"))
            .into())
    }
}

impl Zygote {
    /// Kills the zygote for good (a graceful stop); a later request would start another.
    pub fn stop(&self) {
        if let Some(r) = self.lock().take() {
            r.stop();
        }
    }
}

impl Drop for Zygote {
    fn drop(&mut self) {
        if let Some(r) = self.lock().take() {
            r.stop();
        }
    }
}

/// Sends one request and reads its reply.
fn request(sock: &OwnedFd, json: &[u8], fds: &[RawFd]) -> io::Result<ZygoteReply> {
    let iov = [IoSlice::new(json)];
    let cmsg = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &cmsg };
    sendmsg::<()>(sock.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None)?;
    let mut buf = [0u8; 4096];
    let n = recv(sock.as_raw_fd(), &mut buf, MsgFlags::empty())?;
    if n == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "zygote closed its socket",
        ));
    }
    serde_json::from_slice(&buf[..n]).map_err(io::Error::other)
}

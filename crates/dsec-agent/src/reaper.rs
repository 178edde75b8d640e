//! The central child reaper.
//!
//! As PID 1 of a sandbox the agent must reap every child, including orphans re-parented to
//! it, so it cannot use `tokio::process` (whose own reaper would race with ours). Instead a
//! single task waits for SIGCHLD and loops `waitpid(-1, WNOHANG)`, handing each exit status
//! to the waiter registered for that pid. A status that arrives before anybody registered
//! (or for an orphan) is kept in a small bounded map of unclaimed statuses.
//!
//! SIGCHLD is blocked in every thread of the agent and read from a `signalfd`
//! ([`ChildSignals`]): a child's exit then makes one descriptor readable, instead of
//! interrupting the reactor's wait to run a handler that writes to tokio's self-pipe,
//! which the reactor then wakes again to read (an exec's exit costs two fewer wake-ups).
//!
//! Everything runs on the agent's single thread, so a child spawned and registered without
//! an `.await` in between can never be reaped before it is registered.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::rc::Rc;

use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use tokio::io::unix::AsyncFd;
use tokio::sync::oneshot;

/// Most unclaimed statuses kept (oldest dropped first).
const MAX_UNCLAIMED: usize = 1024;

/// How a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exit {
    /// Exit code for a normal exit.
    pub code: Option<i32>,
    /// Signal number if killed by a signal.
    pub signal: Option<i32>,
}

#[derive(Debug, Default)]
struct Inner {
    waiters: HashMap<i32, oneshot::Sender<Exit>>,
    unclaimed: HashMap<i32, Exit>,
    order: VecDeque<i32>,
}

/// Delivers child exit statuses to registered waiters.
#[derive(Debug, Default)]
pub struct Reaper {
    inner: RefCell<Inner>,
}

impl Reaper {
    /// A reaper with no waiters.
    pub fn new() -> Rc<Self> {
        Rc::new(Self::default())
    }

    /// Registers interest in `pid`'s exit. Call right after spawning, before any `.await`.
    pub fn watch(&self, pid: i32) -> oneshot::Receiver<Exit> {
        let (tx, rx) = oneshot::channel();
        let mut inner = self.inner.borrow_mut();
        if let Some(exit) = inner.unclaimed.remove(&pid) {
            inner.order.retain(|p| *p != pid);
            let _ = tx.send(exit);
        } else {
            inner.waiters.insert(pid, tx);
        }
        rx
    }

    /// Reaps every child that has exited so far.
    pub fn reap(&self) {
        loop {
            match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, code)) => self.deliver(
                    pid.as_raw(),
                    Exit {
                        code: Some(code),
                        signal: None,
                    },
                ),
                Ok(WaitStatus::Signaled(pid, sig, _core)) => self.deliver(
                    pid.as_raw(),
                    Exit {
                        code: None,
                        signal: Some(sig as i32),
                    },
                ),
                Ok(WaitStatus::StillAlive) => break,
                Ok(_) => continue,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(_) => break, // ECHILD: no children left
            }
        }
    }

    fn deliver(&self, pid: i32, exit: Exit) {
        let mut inner = self.inner.borrow_mut();
        if let Some(tx) = inner.waiters.remove(&pid) {
            let _ = tx.send(exit);
            return;
        }
        tracing::trace!(pid, ?exit, "reaped unclaimed child");
        inner.unclaimed.insert(pid, exit);
        inner.order.push_back(pid);
        while inner.order.len() > MAX_UNCLAIMED {
            if let Some(old) = inner.order.pop_front() {
                inner.unclaimed.remove(&old);
            }
        }
    }

    /// Runs forever: reaps on every SIGCHLD.
    pub async fn run(self: Rc<Self>, sigchld: ChildSignals) {
        loop {
            self.reap();
            if let Err(err) = sigchld.wait().await {
                tracing::error!(%err, "reading SIGCHLD; children are no longer reaped");
                break;
            }
        }
    }
}

/// The signal set holding only SIGCHLD.
fn sigchld_set() -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset initialise a set we own.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGCHLD);
        set
    }
}

/// Blocks SIGCHLD on the calling thread; threads it starts afterwards inherit the mask.
/// Call before the runtime (and any other thread that could take the signal) exists:
/// a process-directed SIGCHLD delivered to a thread that does not block it is discarded
/// (its default action is to ignore it), and the [`ChildSignals`] descriptor never sees it.
/// Children get an empty mask back before they exec (`spawnattr`, `sys::child_setup`, std).
pub fn block_sigchld() -> io::Result<()> {
    let set = sigchld_set();
    // SAFETY: pthread_sigmask with a valid set and no old-set output.
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    Ok(())
}

/// SIGCHLD as a readable descriptor (a `signalfd`); needs [`block_sigchld`] first.
#[derive(Debug)]
pub struct ChildSignals {
    fd: AsyncFd<OwnedFd>,
}

impl ChildSignals {
    /// Opens the descriptor and registers it with the runtime's reactor.
    pub fn new() -> io::Result<Self> {
        let set = sigchld_set();
        // SAFETY: signalfd with a new descriptor (-1) and a valid set.
        let raw = unsafe { libc::signalfd(-1, &set, libc::SFD_NONBLOCK | libc::SFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a descriptor signalfd just returned, owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: the AsyncFd owns `fd` until it is dropped, and deregisters it before
        // closing it.
        let fd = unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)? };
        Ok(Self { fd })
    }

    /// Waits until at least one SIGCHLD arrived since the last call, and consumes them all
    /// (signals coalesce: one may stand for many exits, so the caller reaps in a loop).
    pub async fn wait(&self) -> io::Result<()> {
        loop {
            let mut guard = self.fd.readable().await?;
            let mut got = false;
            loop {
                let mut info = std::mem::MaybeUninit::<libc::signalfd_siginfo>::uninit();
                let size = std::mem::size_of::<libc::signalfd_siginfo>();
                // SAFETY: reading at most one siginfo into a buffer of its size.
                let n = unsafe { libc::read(self.fd.as_raw_fd(), info.as_mut_ptr().cast(), size) };
                if n > 0 {
                    got = true;
                    continue;
                }
                let err = io::Error::last_os_error();
                match err.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    Some(libc::EAGAIN) => {
                        guard.clear_ready();
                        break;
                    }
                    _ => return Err(err),
                }
            }
            if got {
                return Ok(());
            }
        }
    }
}

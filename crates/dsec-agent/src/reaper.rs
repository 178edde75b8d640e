//! The central child reaper.
//!
//! As PID 1 of a sandbox the agent must reap every child, including orphans re-parented to
//! it, so it cannot use `tokio::process` (whose own reaper would race with ours). Instead a
//! single task waits for SIGCHLD and loops `waitpid(-1, WNOHANG)`, handing each exit status
//! to the waiter registered for that pid. A status that arrives before anybody registered
//! (or for an orphan) is kept in a small bounded map of unclaimed statuses.
//!
//! Everything runs on the agent's single thread, so a child spawned and registered without
//! an `.await` in between can never be reaped before it is registered.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;

use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use tokio::signal::unix::Signal;
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
    pub async fn run(self: Rc<Self>, mut sigchld: Signal) {
        loop {
            self.reap();
            if sigchld.recv().await.is_none() {
                break;
            }
        }
    }
}

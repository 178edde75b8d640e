//! The capacity queue: creates that name `queue` wait here when every node is full,
//! instead of failing with `capacity`.
//!
//! Three levels, served strictly in order (high, medium, low); within a level, tenants
//! take turns (round-robin over the tenants that wait, first come first served within
//! one tenant), so one tenant's burst cannot starve another. One waiter at a time is
//! *granted* a try: when capacity may have been freed (a sandbox removed, or every
//! [`TRY_EVERY`] in case a node freed some on its own); its create either succeeds, and
//! the next waiter is granted at once, or meets a full node again, and goes back to the
//! head of its tenant's line. A waiter whose `max_wait_s` runs out gets `capacity`.
//!
//! Waiting claims of warm pools are the pools' own queues (`pools.rs`); they follow the
//! same levels, and a low claim never grows its pool (low priority fills only spare
//! warm capacity).

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use dsec_wire::v1::{Priority, QueueLevel, QueueStatus, QueueTenant};

use super::*;

/// How often a waiter is granted a try when nothing freed capacity.
pub(super) const TRY_EVERY: Duration = Duration::from_millis(200);

/// How long a create waits for capacity unless it says.
const DEFAULT_WAIT_S: f64 = 30.0;

fn level_index(p: Priority) -> usize {
    match p {
        Priority::High => 0,
        Priority::Medium => 1,
        Priority::Low => 2,
    }
}

const LEVELS: [Priority; 3] = [Priority::High, Priority::Medium, Priority::Low];

#[derive(Debug)]
struct Ticket {
    seq: u64,
    since: Instant,
    grant: tokio::sync::oneshot::Sender<()>,
}

#[derive(Debug, Default)]
struct Level {
    /// Tenants with waiters, in turn order.
    turns: VecDeque<String>,
    waiting: HashMap<String, VecDeque<Ticket>>,
}

#[derive(Debug, Default)]
struct State {
    levels: [Level; 3],
    next_seq: u64,
    /// A granted waiter is trying its create.
    trying: bool,
    /// Creates served after waiting, per level.
    served: [u64; 3],
}

/// The waiting creates.
#[derive(Debug, Default)]
pub(super) struct CapacityQueue {
    state: std::sync::Mutex<State>,
}

impl CapacityQueue {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a waiter (at the head of its tenant's line when `front`: a granted try that
    /// met a full node again keeps its place).
    fn enqueue(
        &self,
        priority: Priority,
        tenant: &str,
        since: Instant,
        front: bool,
    ) -> (u64, tokio::sync::oneshot::Receiver<()>) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let mut st = self.lock();
        let seq = st.next_seq;
        st.next_seq += 1;
        let level = &mut st.levels[level_index(priority)];
        let line = level.waiting.entry(tenant.to_string()).or_default();
        let ticket = Ticket {
            seq,
            since,
            grant: tx,
        };
        if front {
            line.push_front(ticket);
        } else {
            line.push_back(ticket);
        }
        if !level.turns.iter().any(|t| t == tenant) {
            level.turns.push_back(tenant.to_string());
        }
        (seq, rx)
    }

    /// Removes a waiter that gave up (its wait ran out).
    fn withdraw(&self, priority: Priority, tenant: &str, seq: u64) {
        let mut st = self.lock();
        let level = &mut st.levels[level_index(priority)];
        if let Some(line) = level.waiting.get_mut(tenant) {
            line.retain(|t| t.seq != seq);
            if line.is_empty() {
                level.waiting.remove(tenant);
                level.turns.retain(|t| t != tenant);
            }
        }
    }

    /// Grants the next waiter a try, unless one is trying: the highest level with
    /// waiters, the tenant whose turn it is, its oldest waiter.
    pub(super) fn grant_next(&self) {
        let mut st = self.lock();
        if st.trying {
            return;
        }
        for level in st.levels.iter_mut() {
            while let Some(tenant) = level.turns.pop_front() {
                let Some(line) = level.waiting.get_mut(&tenant) else {
                    continue;
                };
                let mut granted = false;
                while let Some(t) = line.pop_front() {
                    if t.grant.send(()).is_ok() {
                        granted = true;
                        break;
                    }
                }
                if line.is_empty() {
                    level.waiting.remove(&tenant);
                } else {
                    level.turns.push_back(tenant);
                }
                if granted {
                    st.trying = true;
                    return;
                }
            }
        }
    }

    /// The granted try is over: `served` if its create went through (then the next
    /// waiter tries at once: there may be room for more).
    fn tried(&self, served: Option<Priority>) {
        {
            let mut st = self.lock();
            st.trying = false;
            if let Some(p) = served {
                st.served[level_index(p)] += 1;
            }
        }
        if served.is_some() {
            self.grant_next();
        }
    }

    /// Whether anyone waits.
    pub(super) fn is_empty(&self) -> bool {
        self.lock()
            .levels
            .iter()
            .all(|l| l.waiting.values().all(VecDeque::is_empty))
    }

    /// Each level: its waiters (by tenant: only `tenant`'s unless `all`), the oldest
    /// wait, and the creates it served.
    pub(super) fn status(&self, tenant: &str, all: bool) -> QueueStatus {
        let st = self.lock();
        let now = Instant::now();
        let levels = LEVELS
            .iter()
            .zip(st.levels.iter())
            .zip(st.served)
            .map(|((p, level), served)| {
                let mut tenants: Vec<QueueTenant> = level
                    .waiting
                    .iter()
                    .filter(|(t, line)| !line.is_empty() && (all || *t == tenant))
                    .map(|(t, line)| QueueTenant {
                        tenant: t.clone(),
                        waiting: line.len() as u32,
                        oldest_wait_ms: line
                            .iter()
                            .map(|w| now.duration_since(w.since).as_millis() as u64)
                            .max()
                            .unwrap_or(0),
                    })
                    .collect();
                tenants.sort_by(|a, b| a.tenant.cmp(&b.tenant));
                QueueLevel {
                    priority: *p,
                    waiting: level.waiting.values().map(|l| l.len() as u32).sum(),
                    oldest_wait_ms: level
                        .waiting
                        .values()
                        .flatten()
                        .map(|w| now.duration_since(w.since).as_millis() as u64)
                        .max()
                        .unwrap_or(0),
                    served,
                    tenants,
                }
            })
            .collect();
        QueueStatus { levels }
    }
}

/// Marks the granted try over when dropped, so that a try that fails in any way (or
/// whose caller went away) lets the next one go.
struct Trying<'a> {
    queue: &'a CapacityQueue,
    served: Option<Priority>,
}

impl Drop for Trying<'_> {
    fn drop(&mut self) {
        self.queue.tried(self.served);
    }
}

impl ControlPlane {
    /// A plain create with `queue`: made now if there is room, else after waiting its
    /// turn for capacity (at most `queue.max_wait_s`).
    pub(super) async fn create_queued_to_end(
        &self,
        tenant: &str,
        req: CreateSandboxRequest,
    ) -> ApiResult<Sandbox> {
        let opts = req.queue.unwrap_or_default();
        let max_wait = opts.max_wait_s.unwrap_or(DEFAULT_WAIT_S);
        if !max_wait.is_finite() || !(0.0..=3600.0).contains(&max_wait) {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                format!("queue.max_wait_s must be in [0, 3600], got {max_wait}"),
            ));
        }
        let start = Instant::now();
        let deadline = start + Duration::from_secs_f64(max_wait);
        // Nobody waits: try at once. Otherwise take a place in line behind them.
        let mut front = false;
        if self.queue.is_empty() {
            match self.create_sandbox_to_end(tenant, req.clone()).await {
                Err(e) if e.code == ErrorCode::Capacity => {}
                other => return other,
            }
        }
        loop {
            // Grants come from removals, the periodic try and served creates; a waiter
            // never grants itself (its own try just met a full node).
            let (seq, mut rx) = self.queue.enqueue(opts.priority, tenant, start, front);
            match tokio::time::timeout_at(deadline.into(), &mut rx).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return Err(internal("the capacity queue dropped a waiter")),
                Err(_) => {
                    self.queue.withdraw(opts.priority, tenant, seq);
                    if rx.try_recv().is_err() {
                        let mut event = events::about_tenant(tenant, EventKind::QueueTimedOut);
                        event.cause = Some(format!(
                            "a create waited {max_wait} s for capacity at priority {}; every node stayed full",
                            format!("{:?}", opts.priority).to_lowercase()
                        ));
                        self.emit_later(event);
                        return Err(ApiError::new(
                            ErrorCode::Capacity,
                            format!(
                                "no capacity within {max_wait} s (queue.max_wait_s) at \
                                 priority {:?}",
                                opts.priority
                            ),
                        ));
                    }
                    // Granted between the timeout and the withdrawal: try once more.
                }
            }
            let mut trying = Trying {
                queue: &self.queue,
                served: None,
            };
            match self.create_sandbox_to_end(tenant, req.clone()).await {
                Err(e) if e.code == ErrorCode::Capacity && Instant::now() < deadline => {
                    front = true;
                }
                Ok(sb) => {
                    trying.served = Some(opts.priority);
                    return Ok(sb);
                }
                other => return other,
            }
        }
    }
}

/// Grants a waiter a try every [`TRY_EVERY`] while anyone waits (capacity a node freed
/// on its own, or on another replica, is found this way).
pub(super) async fn run_queue(plane: Weak<ControlPlane>) {
    loop {
        tokio::time::sleep(TRY_EVERY).await;
        let Some(plane) = plane.upgrade() else { return };
        if !plane.queue.is_empty() {
            plane.queue.grant_next();
        }
    }
}

//! The event log behind `GET /v1/events`: events are keys of namespace `events` in the
//! state store, written in the transaction of the change they tell of (see
//! [`dsec_wire::v1::Event`]), so every API server replica streams the same ones with
//! the same ids (the revision that wrote them).
//!
//! A stream replays the kept events after an id (a watch of the namespace from that
//! revision; a list when the store no longer has that history, as after a restart of
//! the embedded store) and then follows the watch. Keys are
//! `<unix ms, 13 digits>-<random>-<n>`, so the oldest sort first; [`EventLog::prune`]
//! deletes those past the retention window and the oldest beyond [`MAX_EVENTS_KEPT`].
//!
//! An event's id is `revision * EVENTS_PER_TXN + n`: a transaction may carry a few
//! events (a create stored whole is `created` and `ready`), and ids still grow.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use dsec_state::{Entry, Op, Revision, StateError, StateStore, Txn, WatchEvent};
use dsec_wire::v1::{Event, EventFilter, EventKind, Sandbox, SandboxState, MAX_EVENTS_KEPT};
use dsec_wire::ApiError;
use futures::StreamExt;
use rand::Rng;

use super::{internal, now_ms, store_err};

/// Namespace of events: `<unix ms>-<random>-<n>` -> [`Event`] (without its id).
pub(super) const NS_EVENTS: &str = "events";
/// Namespace of the marks of events that every replica sees but one writes (a node's
/// join or loss): `<kind>/<what>` -> the unix ms it was written; pruned with the events.
const NS_MARKS: &str = "event-marks";
/// How often the reaper looks for events past the window, at most (more often for a
/// window shorter than twice this).
const PRUNE_EVERY_MS: u64 = 30_000;
/// Most events one transaction carries.
const EVENTS_PER_TXN: u64 = 8;

/// The id of event `n` of the transaction that wrote revision `rev`.
fn event_id(rev: Revision, n: u64) -> u64 {
    rev.saturating_mul(EVENTS_PER_TXN).saturating_add(n)
}

/// The revision whose transaction wrote event `id`.
fn revision_of(id: u64) -> Revision {
    id / EVENTS_PER_TXN
}

pub(crate) use crate::api::EventFeed;

impl super::ControlPlane {
    /// Writes `event` off the caller's path (an event never holds up, or fails, the call
    /// that caused it); nothing when events are off.
    pub(super) fn emit_later(&self, event: Event) {
        if !self.events.enabled() {
            return;
        }
        let log = self.events.clone();
        tokio::spawn(async move { log.emit(event).await });
    }
}

/// Writes and streams the event log.
#[derive(Debug)]
pub(crate) struct EventLog {
    store: Arc<dyn StateStore>,
    /// How long events are kept (ms); 0: no events are written.
    retention_ms: u64,
    /// Most events kept.
    max_kept: usize,
    /// When [`EventLog::prune`] last ran (ms since the epoch).
    pruned_at: AtomicU64,
    /// Streams open now, by tenant.
    open_streams: Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>>,
}

/// One open stream of a tenant's; dropping it frees the place.
pub(super) struct StreamSlot {
    tenant: String,
    open: Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>>,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = open.get_mut(&self.tenant) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.remove(&self.tenant);
            }
        }
    }
}

impl EventLog {
    /// An event log on `store` keeping events for `retention_ms` (0: off).
    pub fn new(store: Arc<dyn StateStore>, retention_ms: u64) -> Self {
        Self {
            store,
            retention_ms,
            max_kept: MAX_EVENTS_KEPT,
            pruned_at: AtomicU64::new(0),
            open_streams: Default::default(),
        }
    }

    /// A place for one more stream of `tenant`'s, if it holds fewer than `max`.
    pub(super) fn stream_slot(&self, tenant: &str, max: usize) -> Result<StreamSlot, ApiError> {
        let mut open = self.open_streams.lock().unwrap_or_else(|p| p.into_inner());
        let n = open.entry(tenant.to_string()).or_default();
        if *n >= max {
            return Err(ApiError::new(
                dsec_wire::ErrorCode::QuotaExceeded,
                format!(
                    "tenant {tenant} has {max} event streams open on this server, its most; close one (or filter one stream instead of opening many)"
                ),
            ));
        }
        *n += 1;
        Ok(StreamSlot {
            tenant: tenant.to_string(),
            open: self.open_streams.clone(),
        })
    }

    /// Whether events are written at all.
    pub fn enabled(&self) -> bool {
        self.retention_ms > 0
    }

    /// The op that stores `event` in a transaction of the change it tells of (its only
    /// event); `None` when events are off.
    pub fn op(&self, event: &Event) -> Option<Op> {
        self.ops(std::slice::from_ref(event)).pop()
    }

    /// The ops that store `events`, in this order, in one transaction (at most
    /// [`EVENTS_PER_TXN`]; more are dropped); none when events are off.
    pub fn ops(&self, events: &[Event]) -> Vec<Op> {
        if !self.enabled() {
            return Vec::new();
        }
        let tag = rand::thread_rng().gen::<u64>();
        events
            .iter()
            .take(EVENTS_PER_TXN as usize)
            .enumerate()
            .filter_map(|(n, event)| {
                Some(Op::Put {
                    ns: NS_EVENTS.into(),
                    key: format!("{:013}-{tag:016x}-{n}", event.at_ms),
                    value: serde_json::to_vec(event).ok()?,
                    lease: None,
                })
            })
            .collect()
    }

    /// Stores an event that no other write carries (an OOM kill, a node's). A failure
    /// is logged: an event is never worth failing the call that caused it.
    pub async fn emit(&self, event: Event) {
        let Some(op) = self.op(&event) else { return };
        let txn = Txn {
            checks: Vec::new(),
            ops: vec![op],
        };
        if let Err(e) = self.store.txn(txn).await {
            tracing::warn!(kind = %event.kind, sandbox = ?event.sandbox, error = %e, "writing an event failed");
        }
    }

    /// Stores an event that every API server replica sees happen (a node's watch
    /// shows it joined or went), once: the first replica to write `mark` writes the
    /// event in the same transaction; the others find the mark and write nothing.
    pub async fn emit_once(&self, mark: &str, event: Event) {
        let Some(op) = self.op(&event) else { return };
        let txn = Txn {
            checks: vec![(
                NS_MARKS.into(),
                mark.to_string(),
                dsec_state::Expect::Absent,
            )],
            ops: vec![
                Op::Put {
                    ns: NS_MARKS.into(),
                    key: mark.to_string(),
                    value: event.at_ms.to_string().into_bytes(),
                    lease: None,
                },
                op,
            ],
        };
        match self.store.txn(txn).await {
            Ok(_) => {}
            Err(StateError::Conflict { .. }) => {
                tracing::debug!(%mark, "another replica wrote the event");
            }
            Err(e) => {
                tracing::warn!(kind = %event.kind, node = ?event.node, error = %e, "writing an event failed")
            }
        }
    }

    /// The events `filter` passes: those kept after `after` first (none when `None`),
    /// then, if `follow`, live ones until the stream is dropped.
    pub async fn stream(
        self: &Arc<Self>,
        filter: EventFilter,
        after: Option<u64>,
        follow: bool,
    ) -> Result<EventFeed, ApiError> {
        let from = match after {
            Some(rev) => rev,
            // Live only: from the store's revision now (an empty transaction's).
            None if follow => {
                let now = self.store.txn(Txn::default()).await.map_err(store_err)?;
                event_id(now, EVENTS_PER_TXN - 1)
            }
            None => return Ok(futures::stream::empty().boxed()),
        };
        if !follow {
            let (kept, _) = self.kept_after(from).await?;
            let events: Vec<Result<Event, ApiError>> = kept
                .into_iter()
                .filter(|e| filter.matches(e))
                .map(Ok)
                .collect();
            return Ok(futures::stream::iter(events).boxed());
        }
        let state = Follow {
            log: self.clone(),
            filter,
            last: from,
            pending: std::collections::VecDeque::new(),
            watch: None,
        };
        Ok(futures::stream::unfold(Some(state), |state| async move {
            let mut state = state?;
            match state.next().await {
                Ok(event) => Some((Ok(event), Some(state))),
                Err(e) => Some((Err(e), None)),
            }
        })
        .boxed())
    }

    /// Every kept event with an id above `after`, oldest first, and the last id the
    /// list's revision allows.
    async fn kept_after(&self, after: u64) -> Result<(Vec<Event>, Revision), ApiError> {
        let (entries, rev) = self.store.list(NS_EVENTS).await.map_err(store_err)?;
        let mut events: Vec<Event> = entries
            .iter()
            .filter(|e| e.rev >= revision_of(after))
            .filter_map(decode)
            .filter(|e| e.id > after)
            .collect();
        events.sort_by_key(|e| e.id);
        Ok((events, event_id(rev, EVENTS_PER_TXN - 1)))
    }

    /// Deletes events past the window and the oldest beyond the cap (at most every
    /// [`PRUNE_EVERY_MS`] or half the window; `force` skips that wait).
    pub async fn prune(&self, now: u64, force: bool) {
        if !self.enabled() {
            return;
        }
        let last = self.pruned_at.load(Ordering::Relaxed);
        let every = (self.retention_ms / 2).clamp(100, PRUNE_EVERY_MS);
        if !force && now.saturating_sub(last) < every {
            return;
        }
        self.pruned_at.store(now, Ordering::Relaxed);
        let cutoff = now.saturating_sub(self.retention_ms);
        self.prune_marks(cutoff).await;
        let Ok((entries, _)) = self.store.list(NS_EVENTS).await else {
            return;
        };
        let over = entries.len().saturating_sub(self.max_kept);
        // Keys sort oldest first.
        let old: Vec<&Entry> = entries
            .iter()
            .enumerate()
            .filter(|(i, e)| *i < over || key_ms(&e.key).is_none_or(|ms| ms < cutoff))
            .map(|(_, e)| e)
            .collect();
        self.delete_all(NS_EVENTS, &old).await;
    }

    /// Deletes the marks written before `cutoff` (their events are past the window).
    async fn prune_marks(&self, cutoff: u64) {
        let Ok((marks, _)) = self.store.list(NS_MARKS).await else {
            return;
        };
        let old: Vec<&Entry> = marks
            .iter()
            .filter(|e| {
                std::str::from_utf8(&e.value)
                    .ok()
                    .and_then(|v| v.parse::<u64>().ok())
                    .is_none_or(|ms| ms < cutoff)
            })
            .collect();
        self.delete_all(NS_MARKS, &old).await;
    }

    /// Deletes `entries` of `ns`, a transaction per [`dsec_state::MAX_TXN_OPS`].
    async fn delete_all(&self, ns: &str, entries: &[&Entry]) {
        for chunk in entries.chunks(dsec_state::MAX_TXN_OPS) {
            let ops = chunk
                .iter()
                .map(|e| Op::Delete {
                    ns: ns.into(),
                    key: e.key.clone(),
                })
                .collect();
            if let Err(e) = self
                .store
                .txn(Txn {
                    checks: Vec::new(),
                    ops,
                })
                .await
            {
                tracing::warn!(error = %e, %ns, "pruning failed; will retry");
                return;
            }
        }
    }
}

/// A following stream: replays, then watches.
struct Follow {
    log: Arc<EventLog>,
    filter: EventFilter,
    /// The last event id delivered (or skipped).
    last: u64,
    /// Replayed events not yet delivered.
    pending: std::collections::VecDeque<Event>,
    watch: Option<dsec_state::WatchStream>,
}

impl Follow {
    /// The next event the filter passes.
    async fn next(&mut self) -> Result<Event, ApiError> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                self.last = self.last.max(event.id);
                if self.filter.matches(&event) {
                    return Ok(event);
                }
                continue;
            }
            let watch = match &mut self.watch {
                Some(w) => w,
                // The watch starts at the transaction of `last` (it may hold more).
                None => match self
                    .log
                    .store
                    .watch(NS_EVENTS, revision_of(self.last).saturating_sub(1))
                    .await
                {
                    Ok(w) => self.watch.insert(w),
                    Err(StateError::Compacted) => {
                        self.relist().await?;
                        continue;
                    }
                    Err(e) => return Err(store_err(e)),
                },
            };
            match watch.next().await {
                Some(Ok(WatchEvent::Put(entry))) => {
                    let Some(event) = decode(&entry) else {
                        continue;
                    };
                    if event.id <= self.last {
                        continue;
                    }
                    self.last = event.id;
                    if self.filter.matches(&event) {
                        return Ok(event);
                    }
                }
                // Pruned.
                Some(Ok(WatchEvent::Delete { .. })) => {}
                // Fell behind the store's history: what is kept is listed instead.
                Some(Err(StateError::Compacted)) => {
                    self.watch = None;
                    self.relist().await?;
                }
                Some(Err(e)) => return Err(store_err(e)),
                None => return Err(internal("the event watch ended")),
            }
        }
    }

    /// Queues the kept events after `last`; the watch then resumes after the list's
    /// revision (the list holds every key as of it).
    async fn relist(&mut self) -> Result<(), ApiError> {
        let (kept, listed) = self.log.kept_after(self.last).await?;
        self.pending.extend(kept);
        self.last = self.last.max(listed);
        Ok(())
    }
}

fn decode(entry: &Entry) -> Option<Event> {
    let mut event: Event = serde_json::from_slice(&entry.value).ok()?;
    let n = entry.key.rsplit_once('-')?.1.parse::<u64>().ok()?;
    event.id = event_id(entry.rev, n.min(EVENTS_PER_TXN - 1));
    Some(event)
}

/// The unix ms a key starts with.
fn key_ms(key: &str) -> Option<u64> {
    key.split_once('-')?.0.parse().ok()
}

/// An event of `kind` at now, naming the request in scope, about nothing yet.
fn event(kind: EventKind) -> Event {
    Event {
        id: 0,
        at_ms: now_ms(),
        kind,
        sandbox: None,
        tenant: None,
        node: None,
        pool: None,
        labels: Default::default(),
        cause: None,
        command: None,
        request_id: dsec_node_api::request_id::current().map(|id| id.to_string()),
    }
}

/// An event about `sb` at now, naming the request in scope.
pub(super) fn about(sb: &Sandbox, kind: EventKind) -> Event {
    Event {
        sandbox: Some(sb.id.clone()),
        tenant: Some(sb.tenant.clone()),
        node: (!sb.node.is_empty()).then(|| sb.node.clone()),
        labels: sb.labels.clone(),
        ..event(kind)
    }
}

/// An event about node `name`.
pub(super) fn about_node(name: &str, kind: EventKind, cause: Option<String>) -> Event {
    Event {
        node: Some(name.to_string()),
        cause,
        ..event(kind)
    }
}

/// Writes `node_joined`, `node_lost` and `node_left` as the fleet's watch shows nodes
/// come and go, until the plane (the watch) ends. Every replica sees each change; the
/// event's mark (kind, node, lease) makes one of them write it.
pub(super) async fn follow_membership(
    log: Arc<EventLog>,
    mut changes: tokio::sync::mpsc::UnboundedReceiver<dsec_fleet::NodeEvent>,
) {
    use dsec_fleet::NodeEvent;
    while let Some(change) = changes.recv().await {
        let (name, lease, kind, cause) = match change {
            NodeEvent::Up {
                node,
                previous_boot_id,
            } => {
                let r = &node.registration;
                let what = match previous_boot_id {
                    Some(b) if b == r.boot_id => {
                        "registered again after its registration lapsed (same process)".to_string()
                    }
                    Some(b) => format!("restarted (boot id was {b})"),
                    None => "registered".to_string(),
                };
                let cause = format!(
                    "{what}: boot id {}, version {}, {} millicores, {} MiB, at {}",
                    r.boot_id,
                    r.version,
                    r.capacity.cpu_millis,
                    r.capacity.memory_bytes >> 20,
                    r.url
                );
                (r.name.clone(), node.lease, EventKind::NodeJoined, cause)
            }
            NodeEvent::Down {
                name,
                boot_id,
                lease,
                left: true,
            } => (
                name,
                lease,
                EventKind::NodeLeft,
                format!("shut down (boot id {boot_id}): it deregistered"),
            ),
            NodeEvent::Down {
                name,
                boot_id,
                lease,
                left: false,
            } => (
                name,
                lease,
                EventKind::NodeLost,
                format!(
                    "stopped heartbeating (boot id {boot_id}): its registration lapsed; its sandboxes are lost until it is back"
                ),
            ),
        };
        let mark = format!("{kind}/{name}/{lease:x}");
        log.emit_once(&mark, about_node(&name, kind, Some(cause)))
            .await;
    }
}

/// An event about tenant `tenant`, no sandbox (yet): a create that never made one.
pub(super) fn about_tenant(tenant: &str, kind: EventKind) -> Event {
    Event {
        tenant: Some(tenant.to_string()),
        ..event(kind)
    }
}

/// An event about warm pool `name` of `tenant`.
pub(super) fn about_pool(tenant: &str, name: &str, kind: EventKind, cause: String) -> Event {
    Event {
        pool: Some(name.to_string()),
        cause: Some(cause),
        ..about_tenant(tenant, kind)
    }
}

/// The event a record's change from `before` to `after` tells of, if any.
pub(super) fn transition(before: &Sandbox, after: &Sandbox) -> Option<Event> {
    use SandboxState as S;
    if before.state == after.state {
        if before.disk_full_since.is_none() && after.disk_full_since.is_some() {
            let mut event = about(after, EventKind::DiskFull);
            event.cause = Some(match after.resources.disk_mb {
                Some(mb) => format!("its disk ({mb} MiB) is full: writes fail with ENOSPC"),
                None => "its disk is full: writes fail with ENOSPC".into(),
            });
            return Some(event);
        }
        return None;
    }
    let (kind, cause) = match (before.state, after.state) {
        (S::Paused, S::Ready) => (EventKind::Resumed, None),
        (S::Unhealthy, S::Ready) => (EventKind::Recovered, None),
        (S::Lost, S::Ready | S::Paused | S::Unhealthy) => (EventKind::Found, None),
        (_, S::Ready) => (EventKind::Ready, None),
        (_, S::Paused) => (EventKind::Paused, None),
        (_, S::Failed) => (EventKind::Failed, after.failure.clone()),
        (_, S::Unhealthy) => (EventKind::Unhealthy, after.unhealthy_cause.clone()),
        (_, S::Lost) => (
            EventKind::Lost,
            Some(format!("node {} stopped heartbeating", after.node)),
        ),
        (_, S::Creating | S::Stopping) => return None,
    };
    let mut event = about(after, kind);
    event.cause = cause;
    Some(event)
}

/// The command of an exec, as an event names it.
pub(super) fn command_text(cmd: &dsec_wire::v1::Command) -> String {
    match cmd {
        dsec_wire::v1::Command::Shell(s) => s.clone(),
        dsec_wire::v1::Command::Argv(argv) => argv.join(" "),
    }
}

//! [`FleetView`]: an API server's in-memory view of the live nodes, fed by a watch.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use dsec_state::{Entry, StateError, StateStore, WatchEvent};
use futures::StreamExt;
use tokio::sync::mpsc;

use crate::node::{AdminRecord, NodeRecord, NodeStatus};
use crate::registry::{ADMIN_NS, NODES_NS};

/// A snapshot of the live nodes, ordered by name.
pub type Nodes = Arc<Vec<Arc<NodeStatus>>>;

/// A node came or went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeEvent {
    /// A node registered: new, or back after it was gone.
    Up {
        /// The node as registered.
        node: Arc<NodeStatus>,
        /// The boot id it had when this view last saw it, if it did. Equal to the new
        /// one: the same process lost its lease and registered again (its sandboxes
        /// may well be alive); different: the node restarted.
        previous_boot_id: Option<String>,
    },
    /// A node's registration ended: it stopped heartbeating (its lease expired), shut
    /// down, or was replaced by a restarted process (then an `Up` follows).
    Down {
        /// The node.
        name: String,
        /// The boot id of the registration that ended.
        boot_id: String,
        /// The lease of the registration that ended.
        lease: i64,
        /// It deregistered (shut down) rather than stopped heartbeating.
        left: bool,
    },
}

#[derive(Debug, Default)]
struct Shared {
    nodes: RwLock<Nodes>,
    subscribers: Mutex<Vec<mpsc::UnboundedSender<NodeEvent>>>,
    current: AtomicBool,
    synced: tokio::sync::Notify,
    synced_once: AtomicBool,
}

impl Shared {
    fn emit(&self, events: Vec<NodeEvent>) {
        if events.is_empty() {
            return;
        }
        let mut subs = self.subscribers.lock().unwrap_or_else(|p| p.into_inner());
        subs.retain(|tx| events.iter().all(|e| tx.send(e.clone()).is_ok()));
    }
}

/// The watcher's own state.
#[derive(Debug, Default)]
struct Local {
    nodes: BTreeMap<String, Arc<NodeStatus>>,
    drained: BTreeSet<String>,
    /// Boot ids of nodes that went, for `NodeEvent::Up::previous_boot_id`.
    gone: HashMap<String, String>,
    /// Nodes whose record says they are leaving (name -> lease).
    leaving: HashMap<String, i64>,
}

fn decode(e: &Entry) -> Option<NodeRecord> {
    match serde_json::from_slice::<NodeRecord>(&e.value) {
        Ok(r) if r.registration.name == e.key => Some(r),
        Ok(r) => {
            tracing::warn!(key = %e.key, name = %r.registration.name, "node record under another name; ignored");
            None
        }
        Err(err) => {
            tracing::warn!(key = %e.key, error = %err, "corrupt node record; ignored");
            None
        }
    }
}

fn draining(e: &Entry) -> bool {
    serde_json::from_slice::<AdminRecord>(&e.value).is_ok_and(|a| a.draining)
}

impl Local {
    /// Sets node `name` to `rec` (or removes it), with the events that makes.
    fn set_node(&mut self, name: &str, rec: Option<NodeRecord>, events: &mut Vec<NodeEvent>) {
        let old = self.nodes.remove(name);
        let left = old
            .as_ref()
            .is_some_and(|o| self.leaving.get(name) == Some(&o.lease));
        match &rec {
            Some(r) if r.leaving => {
                self.leaving.insert(name.to_string(), r.lease);
            }
            _ => {
                self.leaving.remove(name);
            }
        }
        let new = rec.map(|r| {
            let draining = self.drained.contains(name);
            Arc::new(NodeStatus::new(r.registration, r.lease, draining))
        });
        match (&old, &new) {
            (Some(o), Some(n))
                if o.registration.boot_id == n.registration.boot_id && o.lease == n.lease => {}
            (Some(o), _) => {
                events.push(NodeEvent::Down {
                    name: name.to_string(),
                    boot_id: o.registration.boot_id.clone(),
                    lease: o.lease,
                    left,
                });
                self.gone
                    .insert(name.to_string(), o.registration.boot_id.clone());
            }
            (None, _) => {}
        }
        if let Some(n) = new {
            let renewed = old.as_ref().is_some_and(|o| {
                o.registration.boot_id == n.registration.boot_id && o.lease == n.lease
            });
            if !renewed {
                events.push(NodeEvent::Up {
                    node: n.clone(),
                    previous_boot_id: self.gone.remove(name),
                });
            }
            self.nodes.insert(name.to_string(), n);
        }
    }

    fn set_drained(&mut self, name: &str, drained: bool) {
        if drained {
            self.drained.insert(name.to_string());
        } else {
            self.drained.remove(name);
        }
        if let Some(n) = self.nodes.get_mut(name) {
            if n.draining != drained {
                let mut s = (**n).clone();
                s.draining = drained;
                *n = Arc::new(s);
            }
        }
    }

    /// Replaces everything with a fresh listing.
    fn relist(&mut self, admin: Vec<Entry>, nodes: Vec<Entry>, events: &mut Vec<NodeEvent>) {
        let drained: BTreeSet<String> = admin
            .iter()
            .filter(|e| draining(e))
            .map(|e| e.key.clone())
            .collect();
        for name in self.drained.clone() {
            if !drained.contains(&name) {
                self.set_drained(&name, false);
            }
        }
        for name in drained {
            self.set_drained(&name, true);
        }
        let mut listed: BTreeMap<String, NodeRecord> = BTreeMap::new();
        for e in &nodes {
            if let Some(r) = decode(e) {
                listed.insert(e.key.clone(), r);
            }
        }
        let known: Vec<String> = self.nodes.keys().cloned().collect();
        for name in known {
            if !listed.contains_key(&name) {
                self.set_node(&name, None, events);
            }
        }
        for (name, rec) in listed {
            self.set_node(&name, Some(rec), events);
        }
    }

    fn snapshot(&self) -> Nodes {
        Arc::new(self.nodes.values().cloned().collect())
    }
}

/// An API server's view of the live nodes: listed from the store, then kept fresh by a
/// watch (changes show within milliseconds; loads are as fresh as the nodes' last
/// heartbeat). On a compacted watch it lists again; while the store is unreachable it
/// keeps the last view and retries with backoff, then lists again (nodes that went
/// meanwhile are reported [`NodeEvent::Down`]). Dropping it stops its task.
#[derive(Debug)]
pub struct FleetView {
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FleetView {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FleetView {
    /// Starts watching `store` (on the current tokio runtime).
    pub fn start(store: Arc<dyn StateStore>) -> Self {
        let shared = Arc::new(Shared::default());
        let task = tokio::spawn(run(store, shared.clone()));
        Self { shared, task }
    }

    /// The live nodes now (cheap: a shared snapshot).
    pub fn nodes(&self) -> Nodes {
        self.shared
            .nodes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// One live node.
    pub fn node(&self, name: &str) -> Option<Arc<NodeStatus>> {
        let nodes = self.nodes();
        nodes
            .binary_search_by(|n| n.name().cmp(name))
            .ok()
            .map(|i| nodes[i].clone())
    }

    /// Every [`NodeEvent`] from now on, in order (unbounded: events are rare, and none
    /// may be missed). Nodes already live when the view first lists are reported `Up`
    /// to subscribers that subscribed before that.
    pub fn subscribe(&self) -> mpsc::UnboundedReceiver<NodeEvent> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.shared
            .subscribers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(tx);
        rx
    }

    /// Waits until the view has listed the store once.
    pub async fn synced(&self) {
        loop {
            let notified = self.shared.synced.notified();
            if self.shared.synced_once.load(Ordering::SeqCst) {
                return;
            }
            notified.await;
        }
    }

    /// Whether the watch runs now (`false` while the store is unreachable: the view
    /// may be stale).
    pub fn is_current(&self) -> bool {
        self.shared.current.load(Ordering::SeqCst)
    }
}

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

async fn run(store: Arc<dyn StateStore>, shared: Arc<Shared>) {
    let mut local = Local::default();
    let mut backoff = BACKOFF_MIN;
    loop {
        let err = follow(&*store, &shared, &mut local, &mut backoff).await;
        shared.current.store(false, Ordering::SeqCst);
        match err {
            StateError::Compacted => {
                tracing::debug!("node watch compacted; listing again");
            }
            e => {
                tracing::warn!(error = %e, retry_in = ?backoff, "node watch failed");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
        }
    }
}

fn publish(shared: &Shared, local: &Local, events: Vec<NodeEvent>) {
    *shared.nodes.write().unwrap_or_else(|p| p.into_inner()) = local.snapshot();
    shared.emit(events);
}

/// Lists both namespaces, then applies their watches until one fails.
async fn follow(
    store: &dyn StateStore,
    shared: &Shared,
    local: &mut Local,
    backoff: &mut Duration,
) -> StateError {
    let listed = async {
        let (admin, arev) = store.list(ADMIN_NS).await?;
        let (nodes, nrev) = store.list(NODES_NS).await?;
        let aw = store.watch(ADMIN_NS, arev).await?;
        let nw = store.watch(NODES_NS, nrev).await?;
        Ok::<_, StateError>((admin, nodes, aw, nw))
    };
    let (admin, nodes, aw, nw) = match listed.await {
        Ok(l) => l,
        Err(e) => return e,
    };
    let mut events = Vec::new();
    local.relist(admin, nodes, &mut events);
    publish(shared, local, events);
    shared.current.store(true, Ordering::SeqCst);
    shared.synced_once.store(true, Ordering::SeqCst);
    shared.synced.notify_waiters();
    *backoff = BACKOFF_MIN;
    let mut changes = futures::stream::select(aw.map(|e| (true, e)), nw.map(|e| (false, e)));
    while let Some((is_admin, change)) = changes.next().await {
        let change = match change {
            Ok(c) => c,
            Err(e) => return e,
        };
        let mut events = Vec::new();
        match (is_admin, change) {
            (true, WatchEvent::Put(e)) => local.set_drained(&e.key, draining(&e)),
            (true, WatchEvent::Delete { key, .. }) => local.set_drained(&key, false),
            (false, WatchEvent::Put(e)) => {
                let rec = decode(&e);
                local.set_node(&e.key, rec, &mut events);
            }
            (false, WatchEvent::Delete { key, .. }) => local.set_node(&key, None, &mut events),
        }
        publish(shared, local, events);
    }
    StateError::Unavailable("the node watch ended".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::tests::reg;

    fn entry(key: &str, value: Vec<u8>) -> Entry {
        Entry {
            key: key.into(),
            value,
            rev: 1,
        }
    }

    fn node_entry(r: &crate::NodeRegistration, lease: i64) -> Entry {
        let rec = NodeRecord {
            registration: r.clone(),
            lease,
            leaving: false,
        };
        entry(&r.name, serde_json::to_vec(&rec).expect("json"))
    }

    fn names(events: &[NodeEvent]) -> Vec<String> {
        events
            .iter()
            .map(|e| match e {
                NodeEvent::Up {
                    node,
                    previous_boot_id,
                } => format!("up {} {}", node.name(), previous_boot_id.is_some()),
                NodeEvent::Down { name, .. } => format!("down {name}"),
            })
            .collect()
    }

    /// A relist (after a compacted watch or an outage) reports what changed meanwhile.
    #[test]
    fn a_relist_reports_what_changed_meanwhile() {
        let (n1, n2, n3) = (reg("n1"), reg("n2"), reg("n3"));
        let mut local = Local::default();
        let mut ev = Vec::new();
        local.relist(
            vec![],
            vec![node_entry(&n1, 1), node_entry(&n2, 2)],
            &mut ev,
        );
        assert_eq!(names(&ev), ["up n1 false", "up n2 false"]);
        // Meanwhile: n1 went, n2 restarted, n3 joined, n3 was drained.
        let mut n2b = n2.clone();
        n2b.boot_id = crate::new_boot_id();
        let drained = entry(
            "n3",
            serde_json::to_vec(&AdminRecord { draining: true }).expect("json"),
        );
        let mut ev = Vec::new();
        local.relist(
            vec![drained],
            vec![node_entry(&n2b, 4), node_entry(&n3, 5)],
            &mut ev,
        );
        assert_eq!(
            names(&ev),
            ["down n1", "down n2", "up n2 true", "up n3 false"]
        );
        let snap = local.snapshot();
        assert_eq!(snap.len(), 2);
        assert!(snap[1].draining && !snap[0].draining);
        // A load change alone is no event; an unreadable record is ignored.
        let mut busy = n3.clone();
        busy.load.sandboxes = 4;
        let mut ev = Vec::new();
        local.relist(
            vec![],
            vec![
                node_entry(&n2b, 4),
                node_entry(&busy, 5),
                entry("n4", b"{".to_vec()),
            ],
            &mut ev,
        );
        assert!(ev.is_empty(), "{ev:?}");
        let snap = local.snapshot();
        assert_eq!(snap[1].registration.load.sandboxes, 4);
        assert!(!snap[1].draining, "undrained by the relist");
        // Back after being gone: the previous boot id is remembered.
        let mut ev = Vec::new();
        local.relist(vec![], vec![node_entry(&n1, 9)], &mut ev);
        assert_eq!(names(&ev), ["down n2", "down n3", "up n1 true"]);
    }
}

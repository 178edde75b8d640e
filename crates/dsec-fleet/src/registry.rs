//! [`Registry`]: node registration, heartbeats and drain flags in the store.

use std::sync::Arc;
use std::time::Duration;

use dsec_state::{Entry, Expect, LeaseId, Op, StateError, StateStore, Txn};
use serde::{Deserialize, Serialize};

use crate::node::{
    check_boot_id, check_cached_layers, check_name, AdminRecord, Load, NodeRecord,
    NodeRegistration, NodeStatus,
};
use crate::FleetError;

/// Namespace of node records (on leases).
pub const NODES_NS: &str = "nodes";
/// Namespace of operator flags (drain), without leases.
pub const ADMIN_NS: &str = "node-admin";

/// Lease timing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegistryConfig {
    /// How long a node's registration lives after its last heartbeat (whole seconds on
    /// etcd; default 3 s, so a stopped node is gone within about 3.5 s).
    pub ttl: Duration,
    /// How often nodes are told to heartbeat (default 1 s).
    pub heartbeat_interval: Duration,
}

impl Default for RegistryConfig {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(3),
            heartbeat_interval: Duration::from_secs(1),
        }
    }
}

/// What a node gets back from [`Registry::register`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegistrationTicket {
    /// The node's lease: every heartbeat names it.
    pub lease: i64,
    /// The lease's TTL, ms.
    pub ttl_ms: u64,
    /// How often to heartbeat, ms.
    pub heartbeat_ms: u64,
}

/// A node's heartbeat.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Heartbeat {
    /// The node.
    pub name: String,
    /// Its boot id (as registered).
    pub boot_id: String,
    /// Its lease (from the ticket).
    pub lease: i64,
    /// Its load now.
    pub load: Load,
    /// Its cached layers now, if they changed since the last report (`None`: unchanged).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_layers: Option<Vec<String>>,
}

/// Node registration, heartbeats and drain flags: what an API server does for nodes.
/// Stateless (every replica can serve any node); cheap to clone.
#[derive(Debug, Clone)]
pub struct Registry {
    store: Arc<dyn StateStore>,
    cfg: RegistryConfig,
}

fn decode_node(e: &Entry) -> Result<NodeRecord, FleetError> {
    serde_json::from_slice(&e.value).map_err(|err| FleetError::Corrupt {
        key: format!("{NODES_NS}/{}", e.key),
        why: err.to_string(),
    })
}

fn encode<T: Serialize>(v: &T) -> Result<Vec<u8>, FleetError> {
    serde_json::to_vec(v).map_err(|e| FleetError::Invalid(format!("encoding: {e}")))
}

/// How many times a write that lost a race is tried again.
const ATTEMPTS: usize = 4;

impl Registry {
    /// A registry on `store`.
    pub fn new(store: Arc<dyn StateStore>, cfg: RegistryConfig) -> Self {
        Self { store, cfg }
    }

    /// Its timing.
    pub fn config(&self) -> RegistryConfig {
        self.cfg
    }

    fn ticket(&self, lease: LeaseId) -> RegistrationTicket {
        RegistrationTicket {
            lease: lease.0,
            ttl_ms: self.cfg.ttl.as_millis() as u64,
            heartbeat_ms: self.cfg.heartbeat_interval.as_millis() as u64,
        }
    }

    /// Registers a node on a new lease; it must [`heartbeat`](Self::heartbeat) within the
    /// TTL and every interval after. Refused with [`FleetError::NameTaken`] while another
    /// live node (another boot id) holds the name. The same node (same boot id)
    /// registering again while its lease lives (a lost reply, another replica) keeps its
    /// lease. Bad input is refused before anything is written.
    pub async fn register(&self, reg: NodeRegistration) -> Result<RegistrationTicket, FleetError> {
        reg.validate()?;
        for _ in 0..ATTEMPTS {
            match self.store.get(NODES_NS, &reg.name).await? {
                Some(e) => {
                    let old = decode_node(&e);
                    let old = match old {
                        Ok(o) => o,
                        Err(err) => {
                            // Unreadable: the name is not held by anything we can tell.
                            tracing::warn!(node = %reg.name, error = %err, "replacing a corrupt node record");
                            self.store
                                .delete(NODES_NS, &reg.name, Expect::Rev(e.rev))
                                .await
                                .ok();
                            continue;
                        }
                    };
                    if old.registration.boot_id != reg.boot_id {
                        return Err(FleetError::NameTaken {
                            name: reg.name,
                            boot_id: old.registration.boot_id,
                        });
                    }
                    let lease = LeaseId(old.lease);
                    match self.store.keep_alive(lease).await {
                        Ok(()) => {}
                        // About to vanish: wait for it, then register anew.
                        Err(StateError::LeaseExpired(_)) => {
                            tokio::time::sleep(Duration::from_millis(200)).await;
                            continue;
                        }
                        Err(e) => return Err(e.into()),
                    }
                    let rec = NodeRecord {
                        registration: reg.clone(),
                        lease: lease.0,
                        leaving: false,
                    };
                    match self.put_node(&rec, Expect::Rev(e.rev)).await {
                        Ok(()) => return Ok(self.ticket(lease)),
                        Err(FleetError::Store(StateError::Conflict { .. }))
                        | Err(FleetError::Store(StateError::LeaseExpired(_))) => continue,
                        Err(e) => return Err(e),
                    }
                }
                None => {
                    let lease = self.store.grant_lease(self.cfg.ttl).await?;
                    let rec = NodeRecord {
                        registration: reg.clone(),
                        lease: lease.0,
                        leaving: false,
                    };
                    match self.put_node(&rec, Expect::Absent).await {
                        Ok(()) => return Ok(self.ticket(lease)),
                        Err(e) => {
                            // Nothing may outlive a failed registration: the lease holds
                            // no key now (or expires on its own if this fails too).
                            if let Err(r) = self.store.revoke_lease(lease).await {
                                tracing::debug!(error = %r, "revoking an unused lease");
                            }
                            match e {
                                FleetError::Store(StateError::Conflict { .. }) => continue,
                                e => return Err(e),
                            }
                        }
                    }
                }
            }
        }
        Err(FleetError::Store(StateError::Unavailable(format!(
            "node {} kept changing while registering it",
            reg.name
        ))))
    }

    async fn put_node(&self, rec: &NodeRecord, expect: Expect) -> Result<(), FleetError> {
        let value = encode(rec)?;
        let name = &rec.registration.name;
        self.store
            .txn(Txn {
                checks: match expect {
                    Expect::Any => vec![],
                    e => vec![(NODES_NS.into(), name.clone(), e)],
                },
                ops: vec![Op::Put {
                    ns: NODES_NS.into(),
                    key: name.clone(),
                    value,
                    lease: Some(LeaseId(rec.lease)),
                }],
            })
            .await?;
        Ok(())
    }

    /// Keeps a node's lease alive and records its load (and cached layers, if given).
    /// [`FleetError::must_register`] errors tell the node to register again.
    pub async fn heartbeat(&self, hb: Heartbeat) -> Result<(), FleetError> {
        check_name(&hb.name)?;
        check_boot_id(&hb.boot_id)?;
        if let Some(c) = &hb.cached_layers {
            check_cached_layers(c)?;
        }
        let lease = LeaseId(hb.lease);
        let expired = || FleetError::LeaseExpired {
            name: hb.name.clone(),
        };
        match self.store.keep_alive(lease).await {
            Ok(()) => {}
            Err(StateError::LeaseExpired(_)) => return Err(expired()),
            Err(e) => return Err(e.into()),
        }
        for _ in 0..ATTEMPTS {
            let not_registered = || FleetError::NotRegistered {
                name: hb.name.clone(),
            };
            let Some(e) = self.store.get(NODES_NS, &hb.name).await? else {
                return Err(not_registered());
            };
            let mut rec = decode_node(&e)?;
            if rec.lease != hb.lease || rec.registration.boot_id != hb.boot_id {
                return Err(not_registered());
            }
            let cached_same = hb
                .cached_layers
                .as_ref()
                .is_none_or(|c| *c == rec.registration.cached_layers);
            if rec.registration.load == hb.load && cached_same {
                return Ok(());
            }
            rec.registration.load = hb.load;
            if let Some(c) = &hb.cached_layers {
                rec.registration.cached_layers = c.clone();
            }
            match self.put_node(&rec, Expect::Rev(e.rev)).await {
                Ok(()) => return Ok(()),
                Err(FleetError::Store(StateError::Conflict { .. })) => continue,
                Err(FleetError::Store(StateError::LeaseExpired(_))) => return Err(expired()),
                Err(e) => return Err(e),
            }
        }
        // Lost every race: the lease is alive, the load waits for the next beat.
        Ok(())
    }

    /// Ends a node's registration (it is shutting down): its record goes at once, marked
    /// `leaving` first so watchers know it left rather than was lost. Nothing happens
    /// unless the node is registered with this boot id and lease.
    pub async fn deregister(
        &self,
        name: &str,
        boot_id: &str,
        lease: i64,
    ) -> Result<(), FleetError> {
        check_name(name)?;
        check_boot_id(boot_id)?;
        if let Some(e) = self.store.get(NODES_NS, name).await? {
            let mut rec = decode_node(&e)?;
            if rec.lease == lease && rec.registration.boot_id == boot_id {
                rec.leaving = true;
                // Best effort: a lost race (a last heartbeat) only makes the end look
                // like a loss.
                if let Err(err) = self.put_node(&rec, Expect::Rev(e.rev)).await {
                    tracing::debug!(node = %name, error = %err, "marking a node leaving");
                }
                self.store.revoke_lease(LeaseId(lease)).await?;
            }
        }
        Ok(())
    }

    /// Stops new placements on `name` (its sandboxes keep running). The flag outlives
    /// the node's registrations until [`undrain`](Self::undrain). Returns whether the
    /// node is registered now (a name that is not may be a typo; it is drained anyway,
    /// so a node can be drained before it joins).
    pub async fn drain(&self, name: &str) -> Result<bool, FleetError> {
        check_name(name)?;
        let value = encode(&AdminRecord { draining: true })?;
        self.store.put(ADMIN_NS, name, &value, Expect::Any).await?;
        Ok(self.store.get(NODES_NS, name).await?.is_some())
    }

    /// Lets placements reach `name` again. Returns whether it was drained.
    pub async fn undrain(&self, name: &str) -> Result<bool, FleetError> {
        check_name(name)?;
        Ok(self.store.delete(ADMIN_NS, name, Expect::Any).await?)
    }

    /// Every registered node, read from the store now (for `dsec node ls`; placement
    /// uses the [`FleetView`](crate::FleetView)).
    pub async fn list(&self) -> Result<Vec<NodeStatus>, FleetError> {
        let (admin, _) = self.store.list(ADMIN_NS).await?;
        let (nodes, _) = self.store.list(NODES_NS).await?;
        let drained: std::collections::BTreeSet<String> = admin
            .into_iter()
            .filter(|e| serde_json::from_slice::<AdminRecord>(&e.value).is_ok_and(|a| a.draining))
            .map(|e| e.key)
            .collect();
        nodes
            .iter()
            .map(|e| {
                let rec = decode_node(e)?;
                let draining = drained.contains(&e.key);
                Ok(NodeStatus::new(rec.registration, rec.lease, draining))
            })
            .collect()
    }
}

//! The cluster's nodes, as the API servers see them.
//!
//! - [`Registry`]: what an API server does for nodes: [`Registry::register`] writes a
//!   node's [`NodeRegistration`] into the store on a lease of its own,
//!   [`Registry::heartbeat`] keeps that lease alive and records the node's load,
//!   [`Registry::deregister`] ends it, [`Registry::drain`] / [`Registry::undrain`] set an
//!   operator flag that outlives registrations. Nodes never hold store credentials: they
//!   call an API server (any replica), which calls the registry.
//! - [`FleetView`]: each API server's in-memory view of the live nodes, fed by a watch on
//!   the store (fresh within milliseconds of a write), with [`NodeEvent`]s when a node
//!   goes (its lease expired: it stopped heartbeating) or comes (back).
//! - [`Placer`]: chooses a node for a new sandbox among the view's nodes (sample-d
//!   over a load score, in-flight reservations, pools and overflow). Pure: no store.
//! - [`sim`]: placement strategies side by side in a simulated fleet (the benchmark).
//!
//! Store layout: `nodes/<name>` holds the node's record on its lease (gone when the node
//! stops heartbeating for [`RegistryConfig::ttl`]); `node-admin/<name>` holds the drain
//! flag, without a lease.

use dsec_state::StateError;

mod node;
pub mod placement;
mod registry;
pub mod sim;
mod view;

pub use node::{
    check_name, new_boot_id, Capacity, Load, NodeRegistration, NodeStatus, DEFAULT_POOL,
    MAX_CACHED_LAYERS, MAX_LABELS, MAX_NAME_BYTES, POOL_LABEL,
};
pub use placement::{
    PlacementConfig, PlacementError, PlacementRequest, Placer, Reservation, Strategy,
};
pub use registry::{Heartbeat, RegistrationTicket, Registry, RegistryConfig, ADMIN_NS, NODES_NS};
pub use view::{FleetView, NodeEvent, Nodes};

/// A registry operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FleetError {
    /// A field of the request is malformed (the message names it); nothing was written.
    #[error("invalid node request: {0}")]
    Invalid(String),
    /// Another live node (another boot id) holds this name. A restarted node gets its
    /// name back once its old registration expires (one TTL after it stopped).
    #[error(
        "node name {name:?} is held by a live node with boot id {boot_id}; if that was \
         this node before a restart, its registration expires within the lease TTL"
    )]
    NameTaken {
        /// The name.
        name: String,
        /// The boot id of the holder.
        boot_id: String,
    },
    /// The node's lease expired (or was revoked): it must register again.
    #[error("the lease of node {name:?} expired: register again")]
    LeaseExpired {
        /// The node.
        name: String,
    },
    /// No registration of this node with this lease and boot id: register again.
    #[error("node {name:?} is not registered with this lease and boot id: register again")]
    NotRegistered {
        /// The node.
        name: String,
    },
    /// A stored record could not be decoded.
    #[error("stored node record {key:?} is corrupt: {why}")]
    Corrupt {
        /// Its key.
        key: String,
        /// What is wrong.
        why: String,
    },
    /// The store failed (see [`StateError::Unavailable`] for the retryable case).
    #[error(transparent)]
    Store(#[from] StateError),
}

impl FleetError {
    /// Whether the node should register again (its registration is gone).
    pub fn must_register(&self) -> bool {
        matches!(
            self,
            FleetError::LeaseExpired { .. } | FleetError::NotRegistered { .. }
        )
    }
}

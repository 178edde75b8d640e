//! The dsec control plane.
//!
//! [`SandboxApi`] is the whole public API as one trait: the HTTP transport (`dsec-http`)
//! turns requests into calls on it and never sees the node. [`ControlPlane`] implements
//! it over a set of nodes ([`NodeSet`]: one [`dsec_node_api::NodeApi`], or a cluster's) and a [`dsec_state::StateStore`]: it validates
//! requests, keeps sandbox records and lifetimes, and turns API calls into node
//! operations under deadlines and the agent watchdog. It links no kernel crate: the node
//! runtime (`dsec-node`) is behind the `NodeApi` seam.

pub mod api;
pub mod auth;
pub mod autoscale;
pub mod build;
mod create_stats;
pub mod nodes;
pub mod plane;
mod validate;

pub use api::{
    ApiResult, ByteStream, EventFeed, EventStream, ImportStream, Principal, SandboxApi, Scope,
};
pub use nodes::{FleetNodes, NodeSet, SingleNode};
pub use plane::{ControlConfig, ControlPlane, ModelGatewayLink};

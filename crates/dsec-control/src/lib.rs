//! The dsec control plane.
//!
//! [`SandboxApi`] is the whole public API as one trait: the HTTP transport (`dsec-http`)
//! turns requests into calls on it and never sees the node. [`ControlPlane`] implements
//! it over a [`dsec_node_api::NodeApi`] and a [`dsec_state::StateStore`]: it validates
//! requests, keeps sandbox records and lifetimes, and turns API calls into node
//! operations under deadlines and the agent watchdog. It links no kernel crate: the node
//! runtime (`dsec-node`) is behind the `NodeApi` seam.

pub mod api;
pub mod auth;
pub mod build;
pub mod plane;
mod validate;

pub use api::{ApiResult, ByteStream, EventStream, ImportStream, SandboxApi};
pub use plane::{ControlConfig, ControlPlane};

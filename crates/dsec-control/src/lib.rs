//! The dsec control plane.
//!
//! [`SandboxApi`] is the whole public API as one trait: the HTTP transport (`dsec-http`)
//! turns requests into calls on it and never sees the node. [`ControlPlane`] implements
//! it over a [`dsec_node::NodeApi`] and a [`dsec_state::StateStore`]: it validates
//! requests, keeps sandbox records and lifetimes, and translates API calls into the agent
//! protocol on connections the node opens.

pub mod api;
pub mod auth;
pub mod build;
mod convert;
pub mod plane;
mod validate;

pub use api::{ApiResult, ByteStream, EventStream, ImportStream, SandboxApi};
pub use plane::{ControlConfig, ControlPlane};

//! The dsec control plane.
//!
//! [`SandboxApi`] is the whole public API as one trait: the HTTP transport (`dsec-http`)
//! turns requests into calls on it and never sees the node, and the control plane
//! implements it on top of a node trait.

pub mod api;

pub use api::{ByteStream, EventStream, SandboxApi};

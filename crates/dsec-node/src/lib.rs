//! The node runtime ("edge"): everything that runs sandboxes on one machine.
//!
//! [`NodeApi`] (crate `dsec-node-api`) is what the control plane sees of a node: the
//! sandbox lifecycle, agent operations (exec, sessions, processes, files, tar) and
//! images. [`LocalNode`] implements it in-process (the single-node `dsec serve`); a
//! remote implementation over HTTP changes transport, not logic.
//!
//! Architecture invariants:
//! - the node is the source of truth for what runs on its machine; each sandbox's
//!   directory holds a `runtime.json` with which a restarted node re-adopts it;
//! - the node owns its sandboxes' lifetimes (TTL, idle timeout): it ends them itself
//!   and lists them as ended until the control plane destroys them (see `lifetimes`);
//! - each sandbox writes to its own size-limited disk (`dsec-disk`) unless the node
//!   runs without disk limits;
//! - each backend sits behind [`backend::Backend`]; only `container` exists today;
//! - the overlay lives in the sandbox's own mount namespace; the only per-sandbox
//!   host mount is its disk, under the sandbox's directory; shared layer mounts are refcounted by the image store.

pub mod admission;
pub mod agent_conn;
mod agent_ops;
pub mod backend;
mod calls;
pub mod claims;
pub mod config;
pub mod container;
pub mod error;
pub mod events;
pub mod gvisor;
mod lifetimes;
pub mod local;
pub mod microvm;
pub mod mntns;
pub mod nspool;
pub mod oci;
pub mod priority;
mod procstat;
mod recorded;
pub mod rundir;
pub mod spawn;
pub mod swap;
pub mod userns;
pub mod zygote;

pub use agent_conn::AgentConn;
pub use config::{DiskSettings, NodeConfig};
pub use error::NodeError;
pub use local::LocalNode;

// The seam's types: the control plane sees the node only through these.
pub use dsec_node_api::{
    ImportProgressSink, ImportSource, Lifetime, NodeApi, NodeCreateSpec, NodeResult, NodeSandbox,
};

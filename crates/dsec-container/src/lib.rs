//! Builds a container sandbox around the calling process.
//!
//! `dsec-agent init` calls [`boot`] first thing, single-threaded, with the node's
//! [`InitSpec`]. On return the process is PID 1 of fresh pid, mount, uts, ipc, net and
//! cgroup namespaces, its root is an overlayfs of the image layers plus the sandbox's upper
//! directory, it holds only the capabilities in [`harden::KEPT_CAPS`], no_new_privs is
//! set and the default seccomp filter is installed. The host file system, the node's
//! socket directory and the agent binary are not reachable from inside.
//!
//! Architecture invariant: this crate runs inside the sandbox-to-be and must not start
//! threads before [`boot`] forks; it does no async work.

pub mod boot;
pub mod bpf;
pub mod callroot;
pub mod harden;
pub mod landlock;
pub mod net;
pub mod policy;
pub mod rootfs;
pub mod signals;
pub mod spawnattr;

pub use boot::{boot, BootError};
pub use dsec_wire::init::InitSpec;

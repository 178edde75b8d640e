//! Wire types of dsec.
//!
//! This crate owns every type that crosses a process boundary:
//! - [`v1`]: the public HTTP/JSON API served by `dsec serve` (and later the apiserver);
//! - [`agent`]: the node <-> in-sandbox agent protocol, and its frame codec ([`frame`]);
//! - [`vm`]: what a microVM's guest init is told, and the handshake on its agent channel.
//!
//! Architecture invariant: no I/O here. Types are plain serde structs; the codec works on
//! byte buffers. Transports (axum, unix sockets) live in other crates.

pub mod agent;
pub mod b64;
pub mod error;
pub mod frame;
pub mod init;
pub mod v1;
pub mod vm;

pub use b64::Base64Bytes;
pub use error::{ApiError, ErrorCode};

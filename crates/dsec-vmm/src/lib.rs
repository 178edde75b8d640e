//! QEMU microVMs for dsec.
//!
//! - [`guest`]: the guest kernel (Debian's, from `/boot`) and the initramfs the node
//!   builds around the static agent;
//! - [`qemu`]: the machine's command line and its QEMU process;
//! - [`channel`]: the host side of the agent channel, a unix socket like every other
//!   level's, carried over the VM's virtio-serial port;
//! - [`cpio`]: the initramfs archive format;
//! - [`screen`]: a full machine's screen (screenshots) and keyboard (typed input).
//!
//! The node's microVM backend (`dsec-node`'s `microvm.rs`) puts these together.

pub mod channel;
pub mod cpio;
pub mod guest;
pub mod qemu;
pub mod qmp;
pub mod screen;

/// Errors of setting up or starting a microVM.
#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    /// The host lacks something microVMs need (QEMU, a kernel, a static agent).
    #[error("microvm setup: {0}")]
    Setup(String),
    /// QEMU did not start the machine.
    #[error("microvm start: {0}")]
    Start(String),
    /// A file of the VM.
    #[error("microvm: {0}")]
    Io(#[from] std::io::Error),
    /// Input the machine's keyboard cannot type.
    #[error("{0}")]
    Input(String),
}

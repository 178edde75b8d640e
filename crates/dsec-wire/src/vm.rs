//! The host <-> guest contract of a microVM sandbox.
//!
//! The node boots the guest with an initramfs whose `/init` is `dsec-agent vm-init`, and
//! appends the sandbox's [`GuestSpec`] to it as [`SPEC_PATH`]. The agent channel is one
//! virtio-serial port named [`AGENT_PORT`]: a plain byte stream with no framing that the
//! host may drop and connect again (a node restart). Each host connection starts with a
//! handshake, the host's [`HELLO`] line answered by the guest's [`READY`] line (both
//! carry the host's nonce, so a stale answer is never taken for a fresh one), and then
//! carries a yamux session in which every stream is one agent connection.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Name of the virtio-serial port of the agent channel.
pub const AGENT_PORT: &str = "dsec.agent";
/// Where the sandbox's spec is in the guest's initramfs.
pub const SPEC_PATH: &str = "/dsec/spec.json";
/// Where the guest finds the modules only a full machine loads (its pointer's), one path
/// per line in load order, in its initramfs.
pub const FULL_MACHINE_MODULES_ORDER: &str = "/modules.full";
/// First word of the host's handshake line (`HELLO <nonce>\n`).
pub const HELLO: &str = "dsec-hello";
/// First word of the guest's answer (`READY <nonce>\n`).
pub const READY: &str = "dsec-ready";
/// Longest handshake line either side sends.
pub const MAX_HANDSHAKE_LINE: usize = 128;
/// Serial number of the `index`th read-only layer disk, bottom first (how the guest finds
/// it: virtio device names follow probe order, not the command line's).
pub fn layer_serial(index: usize) -> String {
    format!("dsec-layer{index}")
}
/// Serial number of the writable disk.
pub const DISK_SERIAL: &str = "dsec-disk";

/// Start of the console line the guest agent's memory guard prints for each process it
/// kills (followed by the pid).
pub const MEMORY_GUARD_KILLED: &str = "dsec-agent: memory guard killed pid ";

/// Console lines that tell a process of the guest was killed for memory: the guest
/// kernel's OOM killer (`... Killed process N (name) ...`, global or of a cgroup) and the
/// agent's memory guard. The node counts them as the sandbox's OOM kills.
pub const OOM_KILL_MARKERS: &[&str] = &["Killed process ", MEMORY_GUARD_KILLED];

/// What the guest's init needs to build the sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuestSpec {
    /// Sandbox id; becomes the hostname.
    pub sandbox_id: String,
    /// Number of read-only EROFS layer disks (serials `layer_serial(0..layers)`).
    pub layers: usize,
    /// Whether a writable ext4 disk (serial [`DISK_SERIAL`]) holds the overlay's upper
    /// directory; without one the upper directory is in guest memory.
    pub disk: bool,
    /// Environment of every process.
    pub env: BTreeMap<String, String>,
    /// Default working directory.
    pub workdir: String,
    /// Default user (name or UID[:GID]).
    pub user: Option<String>,
    /// Process limit of everything the agent starts (a pids cgroup in the guest).
    pub pids_max: u64,
    /// The guest's network: its one virtio NIC, a tap on the host behind the node's
    /// nftables rules. `None`: no NIC, loopback only (network mode `none`).
    #[serde(default)]
    pub net: Option<GuestNet>,
    /// The image's init to hand the machine to once its root is mounted (a full VM:
    /// `/sbin/init`); the agent then runs as that system's service
    /// ([`AGENT_SERVICE`]). `None`: the agent stays the guest's init (a microVM).
    #[serde(default)]
    pub system_init: Option<String>,
}

/// Where a full VM's root holds the agent the node booted it with, its service runs.
pub const AGENT_INSTALL_DIR: &str = "/usr/lib/dsec";
/// The systemd unit of the agent in a full VM (started early, restarted if it exits).
pub const AGENT_SERVICE: &str = "dsec-agent.service";

/// How the guest configures its NIC ([`GUEST_IFNAME`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuestNet {
    /// The guest's address.
    pub address: std::net::Ipv4Addr,
    /// Its network's prefix length.
    pub prefix_len: u8,
    /// Default gateway (the tap's host end).
    pub gateway: std::net::Ipv4Addr,
    /// The guest's `/etc/resolv.conf` (the node's resolver, as a container's).
    pub resolv_conf: String,
}

/// The guest's name for its NIC (the kernel's first Ethernet device; no udev renames).
pub const GUEST_IFNAME: &str = "eth0";

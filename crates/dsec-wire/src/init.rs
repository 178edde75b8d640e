//! The node -> sandbox-init contract.
//!
//! The node starts `dsec-agent init` with an [`InitSpec`] as JSON on stdin, the agent's
//! listening socket as fd 3, a status pipe as fd 4 and, with a detached disk, its mount
//! as fd 5. Init reports on the status pipe, one
//! line each: `pid <host-pid>` (the sandbox's PID 1 as the host sees it), then either
//! `ready` or `error <message>`.
//!
//! Usually init is not exec'd but forked from `dsec-agent zygote`, a warm copy of the
//! agent the node keeps running: the node sends it a [`ZygoteRequest`] on a
//! `SOCK_SEQPACKET` socket (fd [`ZYGOTE_FD`] in the zygote) with the descriptors as
//! `SCM_RIGHTS`, and gets a [`ZygoteReply`] back. The forked child sees exactly what an
//! exec'd init sees: the same descriptors at the same numbers.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// File descriptor number of the agent's listening socket in `dsec-agent init`.
pub const LISTEN_FD: i32 = 3;
/// File descriptor number of the status pipe in `dsec-agent init`.
pub const STATUS_FD: i32 = 4;
/// File descriptor number of the sandbox disk's detached mount, when there is one.
pub const DISK_FD: i32 = 5;
/// File descriptor number of a prepared network namespace, when the sandbox has one.
pub const NETNS_FD: i32 = 6;
/// File descriptor number of the user namespace the sandbox joins, when it has one.
pub const USERNS_FD: i32 = 7;
/// File descriptor number of the mount namespace init starts from, when it is given one.
pub const MNTNS_FD: i32 = 8;
/// First file descriptor number of the layer mounts handed to init (user namespace mode:
/// idmapped clones of the layers, one fd each, bottom first from this number on).
pub const FIRST_LAYER_FD: i32 = 9;

/// File descriptor number of the request socket in `dsec-agent zygote`.
pub const ZYGOTE_FD: i32 = 3;
/// Largest [`ZygoteRequest`] the zygote takes, in bytes of JSON.
pub const ZYGOTE_MAX_REQUEST: usize = 256 << 10;
/// Most descriptors one [`ZygoteRequest`] carries.
pub const ZYGOTE_MAX_FDS: usize = 64;

/// Fork an init: sent with one `SCM_RIGHTS` descriptor per entry of `fds`, in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ZygoteRequest {
    /// The number each passed descriptor gets in the child (2 is its stderr; stdin and
    /// stdout are `/dev/null`).
    pub fds: Vec<i32>,
    /// What the child builds.
    pub spec: InitSpec,
}

/// The zygote's answer to a [`ZygoteRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ZygoteReply {
    /// The child runs; it reports on its status pipe as an exec'd init would.
    Forked {
        /// Host pid of the child (the intermediate process; it exits once it forked the
        /// sandbox's PID 1).
        pid: i32,
    },
    /// Nothing was started.
    Error {
        /// Why.
        message: String,
    },
}

/// Everything init needs to build the sandbox around itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InitSpec {
    /// Sandbox id; becomes the hostname.
    pub sandbox_id: String,
    /// Host paths of the read-only layer mounts, topmost first (overlayfs `lowerdir` order).
    pub lower_dirs: Vec<String>,
    /// Host path of the sandbox's writable upper directory.
    pub upper_dir: String,
    /// Host path of overlayfs's work directory (same file system as `upper_dir`).
    pub work_dir: String,
    /// Set when the disk holding `upper_dir` and `work_dir` is a detached mount passed as
    /// fd [`DISK_FD`] (the paths then start with `/proc/self/fd/5/`). Init closes it once
    /// the overlay is mounted.
    #[serde(default)]
    pub disk_fd: Option<i32>,
    /// Set when the sandbox joins a prepared network namespace, passed as fd
    /// [`NETNS_FD`] (loopback already up), instead of making one with only loopback. Init
    /// closes it after joining.
    #[serde(default)]
    pub netns_fd: Option<i32>,
    /// Set when the sandbox runs in a user namespace, passed as fd [`USERNS_FD`]: init
    /// joins it (becoming its root) before making the other namespaces, and the layers,
    /// upper and work directories are idmapped mounts for it.
    #[serde(default)]
    pub userns_fd: Option<i32>,
    /// Set when init starts from the node's skeleton mount namespace, passed as fd
    /// [`MNTNS_FD`]: init joins it (before the user namespace) so that the namespace it
    /// unshares copies a handful of mounts, not the host's whole tree. `rootfs` is then
    /// a path in the skeleton.
    #[serde(default)]
    pub mntns_fd: Option<i32>,
    /// Commands may write only beneath these paths (Landlock), when not empty.
    #[serde(default)]
    pub writable_paths: Vec<String>,
    /// Commands may bind TCP sockets only to these ports, when set.
    #[serde(default)]
    pub tcp_bind: Option<Vec<u16>>,
    /// Commands may connect TCP sockets only to these ports, when set.
    #[serde(default)]
    pub tcp_connect: Option<Vec<u16>>,
    /// Contents for `/etc/resolv.conf` (networked sandboxes: the node's resolver).
    #[serde(default)]
    pub resolv_conf: Option<String>,
    /// Give the sandbox its own core-scheduling cookie, so its tasks never share a
    /// physical core's SMT siblings with another sandbox (kernels with `CONFIG_SCHED_CORE`).
    #[serde(default)]
    pub core_sched: bool,
    /// Run every process of the sandbox `SCHED_IDLE` (best-effort QoS).
    #[serde(default)]
    pub sched_idle: bool,
    /// Path of the (empty) directory where the root file system is assembled: on the
    /// host, or in the skeleton when `mntns_fd` is set.
    pub rootfs: String,
    /// `cgroup.procs` files to join before unsharing the cgroup namespace.
    pub cgroup_procs: Vec<String>,
    /// Environment for commands run by the agent.
    pub env: BTreeMap<String, String>,
    /// Default working directory of commands.
    pub workdir: String,
    /// Default user of commands (name or `UID[:GID]`); `None`: root.
    #[serde(default)]
    pub user: Option<String>,
    /// The sandbox serves function calls: `boot` returns before it drops privileges, so
    /// that init can first start the call helper (which makes each call's namespaces),
    /// and init drops them itself right after.
    #[serde(default)]
    pub fncall: bool,
}

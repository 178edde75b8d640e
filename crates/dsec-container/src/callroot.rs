//! The root of one function call: a throw-away view of a running sandbox.
//!
//! A call runs in new mount, PID and IPC namespaces made by the agent's call helper (see
//! `dsec_agent::fncall`). [`enter`] turns the calling process, the call's PID 1, into the
//! root of that view: an overlay whose lower layer is the sandbox's root and whose upper
//! layer is on a fresh tmpfs, a fresh `/proc` of the call's PID namespace (masked as the
//! sandbox's is), the sandbox's `/dev` with a fresh `/dev/shm`, and its read-only `/sys`.
//! Everything the call writes lands on the tmpfs, so when its last process exits the
//! namespaces and their mounts go with it and the next call sees the sandbox as it was:
//! there is nothing to reset.

use std::fs;
use std::path::Path;

use nix::mount::{mount, umount2, MntFlags, MsFlags};

use crate::rootfs::{mask_paths, RootfsError};

/// Where the call's scratch tmpfs is mounted while the view is built (hidden by the
/// pivot: it is the old root's).
const SCRATCH: &str = "/tmp";

/// Size of the scratch tmpfs that holds the call's writes (charged to the sandbox's
/// memory like any tmpfs page).
pub const SCRATCH_SIZE: &str = "size=1g";

fn err<'a>(op: &'static str, path: &'a str) -> impl FnOnce(nix::Error) -> RootfsError + 'a {
    move |e| RootfsError {
        op,
        path: path.to_string(),
        source: e.into(),
    }
}

fn mkdir(path: &str) -> Result<(), RootfsError> {
    match fs::create_dir(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(source) => Err(RootfsError {
            op: "mkdir",
            path: path.to_string(),
            source,
        }),
    }
}

/// Builds the call's view and pivots into it. The caller is PID 1 of a new PID namespace
/// and alone in a new mount namespace, with `CAP_SYS_ADMIN` over both; `userns` says
/// whether the sandbox runs in a user namespace (overlayfs then keeps its metadata in
/// `user.*` xattrs, as the sandbox's own root does).
pub fn enter(userns: bool) -> Result<(), RootfsError> {
    let nosuid_nodev = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    mount(
        Some("tmpfs"),
        SCRATCH,
        Some("tmpfs"),
        nosuid_nodev,
        Some(format!("mode=0700,{SCRATCH_SIZE}").as_str()),
    )
    .map_err(err("mount scratch tmpfs", SCRATCH))?;
    let (upper, work, root) = ("/tmp/u", "/tmp/w", "/tmp/r");
    for d in [upper, work, root] {
        mkdir(d)?;
    }
    let mut opts = format!("lowerdir=/,upperdir={upper},workdir={work},volatile");
    if userns {
        opts.push_str(",userxattr");
    }
    mount(
        Some("overlay"),
        root,
        Some("overlay"),
        MsFlags::MS_NODEV,
        Some(opts.as_str()),
    )
    .map_err(err("mount call overlay", root))?;
    let proc_dir = "/tmp/r/proc";
    mount(
        Some("proc"),
        proc_dir,
        Some("proc"),
        nosuid_nodev | MsFlags::MS_NOEXEC,
        None::<&str>,
    )
    .map_err(err("mount proc", proc_dir))?;
    for (from, to) in [("/dev", "/tmp/r/dev"), ("/sys", "/tmp/r/sys")] {
        mount(
            Some(from),
            to,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REC,
            None::<&str>,
        )
        .map_err(err("bind", to))?;
    }
    let shm = "/tmp/r/dev/shm";
    mount(
        Some("shm"),
        shm,
        Some("tmpfs"),
        nosuid_nodev | MsFlags::MS_NOEXEC,
        Some("mode=1777,size=65536k"),
    )
    .map_err(err("mount /dev/shm", shm))?;
    nix::unistd::chdir(root).map_err(err("chdir", root))?;
    nix::unistd::pivot_root(".", ".").map_err(err("pivot_root", root))?;
    umount2(".", MntFlags::MNT_DETACH).map_err(err("detach old root", "/"))?;
    nix::unistd::chdir(Path::new("/")).map_err(err("chdir", "/"))?;
    mask_paths(userns)
}

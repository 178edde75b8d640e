//! `favordynmods`: making moves of processes between cgroups cheap.
//!
//! Every write to a `cgroup.procs` file takes the kernel's global
//! `cgroup_threadgroup_rwsem` for writing. That lock is a per-CPU rwsem: unless writers
//! are frequent, its write side first waits for an RCU grace period, which was 10-20 ms
//! (p90 of a sandbox init's cgroup join) on the development VM: the largest single wait
//! of a create. The cgroup2 mount option `favordynmods` keeps the lock in its slow-reader
//! mode (forks and exits pay an atomic operation instead) or, on newer kernels, moves
//! writers to a per-process lock; either way the grace period is gone. It is global (one
//! lock for all hierarchies, v1 included), so setting it on the cgroup2 mount is enough.
//!
//! The remount keeps every other option of the mount: its per-mount flags (`nosuid`,
//! `relatime`, ...) and its file system options (`nsdelegate`,
//! `memory_recursiveprot`, ...), which a bare `-o remount,favordynmods` would clear.

use std::path::{Path, PathBuf};

use nix::mount::MsFlags;

use crate::{CgroupError, Result};

/// The mount option.
pub const FAVOR_DYNMODS: &str = "favordynmods";

/// A cgroup2 mount as `/proc/self/mountinfo` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cgroup2Mount {
    /// Where it is mounted.
    pub target: PathBuf,
    /// Per-mount options (`rw,nosuid,relatime`).
    pub mount_options: Vec<String>,
    /// File system options (`rw,nsdelegate,favordynmods`).
    pub fs_options: Vec<String>,
}

impl Cgroup2Mount {
    /// Whether moves are already favoured.
    pub fn favors_dynmods(&self) -> bool {
        self.fs_options.iter().any(|o| o == FAVOR_DYNMODS)
    }
}

/// What [`favor_dynmods`] found or did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DynmodsOutcome {
    /// The option was set on this mount now.
    Enabled(PathBuf),
    /// The mount had it already.
    AlreadyOn(PathBuf),
    /// No cgroup2 file system is mounted (a pure v1 host): nothing to set it on.
    NoCgroup2,
}

/// The first cgroup2 mount in `mountinfo` text.
pub fn find_cgroup2(mountinfo: &str) -> Option<Cgroup2Mount> {
    let split = |o: &str| o.split(',').map(str::to_string).collect();
    dsec_mountinfo::parse(mountinfo)
        .into_iter()
        .find(|m| m.fs_type == "cgroup2")
        .map(|m| Cgroup2Mount {
            target: m.mount_point,
            mount_options: split(&m.mount_options),
            fs_options: split(&m.super_options),
        })
}

/// The `mount(2)` flags and data that remount `m` with its options plus `add`.
fn remount_args(m: &Cgroup2Mount, add: &str) -> (MsFlags, String) {
    let mut flags = MsFlags::MS_REMOUNT;
    for o in &m.mount_options {
        flags |= match o.as_str() {
            "ro" => MsFlags::MS_RDONLY,
            "nosuid" => MsFlags::MS_NOSUID,
            "nodev" => MsFlags::MS_NODEV,
            "noexec" => MsFlags::MS_NOEXEC,
            "noatime" => MsFlags::MS_NOATIME,
            "nodiratime" => MsFlags::MS_NODIRATIME,
            "relatime" => MsFlags::MS_RELATIME,
            "strictatime" => MsFlags::MS_STRICTATIME,
            _ => MsFlags::empty(),
        };
    }
    let mut data: Vec<&str> = m
        .fs_options
        .iter()
        .map(String::as_str)
        .filter(|o| *o != "rw" && *o != "ro")
        .collect();
    if !data.contains(&add) {
        data.push(add);
    }
    (flags, data.join(","))
}

/// Remounts `m` with its options plus `add`.
fn remount_adding(m: &Cgroup2Mount, add: &str) -> Result<()> {
    let (flags, data) = remount_args(m, add);
    nix::mount::mount(
        None::<&str>,
        &m.target,
        None::<&str>,
        flags,
        Some(data.as_str()),
    )
    .map_err(|e| CgroupError::Io {
        op: "remount",
        path: m.target.clone(),
        source: e.into(),
    })
}

fn mountinfo() -> Result<String> {
    let path = Path::new("/proc/self/mountinfo");
    std::fs::read_to_string(path).map_err(|e| crate::util::io_err("read", path, e))
}

/// Sets `favordynmods` on the host's cgroup2 mount unless it is there already.
pub fn favor_dynmods() -> Result<DynmodsOutcome> {
    let Some(m) = find_cgroup2(&mountinfo()?) else {
        return Ok(DynmodsOutcome::NoCgroup2);
    };
    if m.favors_dynmods() {
        return Ok(DynmodsOutcome::AlreadyOn(m.target));
    }
    remount_adding(&m, FAVOR_DYNMODS)?;
    Ok(DynmodsOutcome::Enabled(m.target))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SYSTEMD: &str = "\
24 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
30 24 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
";
    const HYBRID: &str = "\
31 25 0:27 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
42 31 0:39 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
";

    #[test]
    fn finds_the_cgroup2_mount_and_keeps_every_option_on_remount() {
        let m = find_cgroup2(SYSTEMD).expect("cgroup2");
        assert_eq!(m.target, Path::new("/sys/fs/cgroup"));
        assert!(!m.favors_dynmods());
        let (flags, data) = remount_args(&m, FAVOR_DYNMODS);
        assert_eq!(
            flags,
            MsFlags::MS_REMOUNT
                | MsFlags::MS_NOSUID
                | MsFlags::MS_NODEV
                | MsFlags::MS_NOEXEC
                | MsFlags::MS_RELATIME
        );
        assert_eq!(data, "nsdelegate,memory_recursiveprot,favordynmods");

        let m = find_cgroup2(HYBRID).expect("cgroup2 beside v1");
        assert_eq!(m.target, Path::new("/sys/fs/cgroup/unified"));
        assert_eq!(remount_args(&m, FAVOR_DYNMODS).1, "favordynmods");
        assert!(find_cgroup2("42 31 0:39 / /x rw - cgroup cgroup rw,memory\n").is_none());
        let on = find_cgroup2("1 2 0:3 / /a\\040b rw - cgroup2 none rw,favordynmods\n");
        let on = on.expect("escaped target");
        assert_eq!(on.target, Path::new("/a b"));
        assert!(on.favors_dynmods());
    }

    /// On the host: afterwards the mount has the option and every option it had before.
    #[test]
    fn the_host_mount_ends_up_with_the_option_and_loses_none() {
        if !dsec_testkit::require_root("favordynmods") {
            return;
        }
        let Some(before) = find_cgroup2(&mountinfo().expect("mountinfo")) else {
            assert!(favor_dynmods().expect("no-op") == DynmodsOutcome::NoCgroup2);
            return;
        };
        let outcome = favor_dynmods().expect("favordynmods");
        assert!(matches!(
            outcome,
            DynmodsOutcome::Enabled(_) | DynmodsOutcome::AlreadyOn(_)
        ));
        // The remount itself, even where the option was on already (idempotent).
        remount_adding(&before, FAVOR_DYNMODS).expect("remount");
        let after = find_cgroup2(&mountinfo().expect("mountinfo")).expect("still mounted");
        assert!(after.favors_dynmods(), "{after:?}");
        for o in before.fs_options.iter().chain(&before.mount_options) {
            let kept = after.fs_options.contains(o) || after.mount_options.contains(o);
            assert!(kept, "option {o} lost: {before:?} -> {after:?}");
        }
    }
}

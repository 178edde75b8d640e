//! Privilege reduction of the sandbox's PID 1 (inherited by everything it starts):
//! capabilities cut to [`KEPT_CAPS`], no_new_privs, and the default seccomp filter from
//! `resources/seccomp-default.json` (policy as data; see its snapshot test).

use std::collections::HashSet;

use caps::{CapSet, Capability};

/// Capabilities a sandbox keeps: what a root user needs to administer files and users
/// inside its own tree (Docker's default set without `MKNOD`, `NET_RAW`, `AUDIT_WRITE`).
/// Everything else, notably `SYS_ADMIN`, `NET_ADMIN`, `SYS_PTRACE`, `SYS_MODULE`,
/// `MKNOD`, leaves the bounding set, so no process in the sandbox can regain it.
pub const KEPT_CAPS: &[Capability] = &[
    Capability::CAP_CHOWN,
    Capability::CAP_DAC_OVERRIDE,
    Capability::CAP_FOWNER,
    Capability::CAP_FSETID,
    Capability::CAP_KILL,
    Capability::CAP_SETGID,
    Capability::CAP_SETUID,
    Capability::CAP_SETPCAP,
    Capability::CAP_SETFCAP,
    Capability::CAP_NET_BIND_SERVICE,
    Capability::CAP_SYS_CHROOT,
];

/// The default seccomp policy, as data.
pub const SECCOMP_POLICY_JSON: &str = include_str!("../resources/seccomp-default.json");

/// Dropping privileges failed.
#[derive(Debug, thiserror::Error)]
pub enum HardenError {
    /// A capability operation failed.
    #[error("capabilities: {0}")]
    Caps(#[from] caps::errors::CapsError),
    /// prctl(PR_SET_NO_NEW_PRIVS) failed.
    #[error("no_new_privs: {0}")]
    NoNewPrivs(std::io::Error),
    /// prctl(PR_SET_DUMPABLE) failed.
    #[error("dumpable: {0}")]
    Dumpable(std::io::Error),
    /// The seccomp policy did not compile.
    #[error("seccomp policy: {0}")]
    SeccompCompile(String),
    /// Installing the seccomp filter failed.
    #[error("seccomp install: {0}")]
    SeccompInstall(String),
}

/// Drops capabilities, sets no_new_privs and installs the seccomp filters.
pub fn apply() -> Result<(), HardenError> {
    drop_capabilities()?;
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(HardenError::NoNewPrivs(std::io::Error::last_os_error()));
    }
    // The agent is the sandbox's PID 1 and runs as root like the code it serves: without
    // this, any process inside could ptrace it (same uid), stop it, or read its memory
    // through /proc/1/mem. Programs it starts are dumpable again after their execve.
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } != 0 {
        return Err(HardenError::Dumpable(std::io::Error::last_os_error()));
    }
    for filter in compile_seccomp()? {
        seccompiler::apply_filter(&filter)
            .map_err(|e| HardenError::SeccompInstall(e.to_string()))?;
    }
    Ok(())
}

fn drop_capabilities() -> Result<(), HardenError> {
    let keep: HashSet<Capability> = KEPT_CAPS.iter().copied().collect();
    for cap in caps::all() {
        if !keep.contains(&cap) {
            caps::drop(None, CapSet::Bounding, cap)?;
        }
    }
    caps::clear(None, CapSet::Ambient)?;
    caps::clear(None, CapSet::Inheritable)?;
    caps::set(None, CapSet::Effective, &keep)?;
    caps::set(None, CapSet::Permitted, &keep)?;
    Ok(())
}

/// Compiles the default policy into BPF programs, in installation order.
pub fn compile_seccomp() -> Result<Vec<seccompiler::BpfProgram>, HardenError> {
    let arch = seccompiler::TargetArch::x86_64;
    let mut map = seccompiler::compile_from_json(SECCOMP_POLICY_JSON.as_bytes(), arch)
        .map_err(|e| HardenError::SeccompCompile(e.to_string()))?;
    let mut out = Vec::new();
    for name in ["deny_eperm", "deny_enosys"] {
        let prog = map
            .remove(name)
            .ok_or_else(|| HardenError::SeccompCompile(format!("filter {name} missing")))?;
        out.push(prog);
    }
    Ok(out)
}

/// Syscall names the default policy denies, sorted (for review and snapshot tests).
pub fn denied_syscalls() -> Vec<String> {
    let doc: serde_json::Value = serde_json::from_str(SECCOMP_POLICY_JSON).unwrap_or_default();
    let mut names: Vec<String> = ["deny_eperm", "deny_enosys"]
        .iter()
        .flat_map(|f| doc[f]["filter"].as_array().cloned().unwrap_or_default())
        .filter_map(|r| {
            let name = r["syscall"].as_str()?.to_string();
            Some(if r.get("args").is_some() {
                format!("{name}(filtered)")
            } else {
                name
            })
        })
        .collect();
    names.sort();
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_compiles() {
        let progs = compile_seccomp().expect("policy compiles");
        assert_eq!(progs.len(), 2);
        assert!(progs.iter().all(|p| !p.is_empty()));
    }

    /// Snapshot of the policy: a change to the denied set must be deliberate.
    #[test]
    fn denied_set_snapshot() {
        let expected = "_sysctl acct add_key adjtimex bpf clock_adjtime clock_settime \
            clone(filtered) clone3 delete_module finit_module fsconfig fsmount fsopen fspick \
            init_module io_uring_enter io_uring_register io_uring_setup ioperm iopl kcmp \
            kexec_file_load kexec_load keyctl lookup_dcookie mbind migrate_pages mount \
            mount_setattr move_mount move_pages name_to_handle_at nfsservctl open_by_handle_at \
            open_tree perf_event_open pivot_root quotactl quotactl_fd reboot request_key \
            set_mempolicy setns settimeofday swapoff swapon sysfs syslog umount2 unshare \
            uselib userfaultfd ustat vhangup";
        let expected: Vec<&str> = expected.split_whitespace().collect();
        assert_eq!(denied_syscalls(), expected);
    }

    #[test]
    fn kept_caps_exclude_dangerous_ones() {
        for cap in [
            Capability::CAP_SYS_ADMIN,
            Capability::CAP_NET_ADMIN,
            Capability::CAP_SYS_MODULE,
            Capability::CAP_SYS_PTRACE,
            Capability::CAP_MKNOD,
            Capability::CAP_SYS_RAWIO,
            Capability::CAP_BPF,
        ] {
            assert!(!KEPT_CAPS.contains(&cap), "{cap} must be dropped");
        }
    }
}

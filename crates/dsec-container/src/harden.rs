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

/// The default policy as an OCI runtime spec's `linux.seccomp` (for isolation level
/// `oci`): everything allowed but the policy's rules, each answered with its filter's
/// errno. Argument conditions carry over (`masked_eq` becomes `SCMP_CMP_MASKED_EQ` with
/// the mask as `value` and the expected bits as `valueTwo`).
pub fn oci_seccomp() -> Result<serde_json::Value, HardenError> {
    let bad = |what: String| HardenError::SeccompCompile(format!("OCI translation: {what}"));
    let doc: serde_json::Value =
        serde_json::from_str(SECCOMP_POLICY_JSON).map_err(|e| bad(e.to_string()))?;
    let mut syscalls = Vec::new();
    for filter in ["deny_eperm", "deny_enosys"] {
        let f = &doc[filter];
        let errno = f["filter_action"]["errno"]
            .as_u64()
            .ok_or_else(|| bad(format!("{filter}: filter_action is not an errno")))?;
        for rule in f["filter"].as_array().into_iter().flatten() {
            let name = rule["syscall"]
                .as_str()
                .ok_or_else(|| bad(format!("{filter}: rule without a syscall")))?;
            let mut args = Vec::new();
            for a in rule["args"].as_array().into_iter().flatten() {
                let (index, val) = (a["index"].as_u64(), a["val"].as_u64());
                let (Some(index), Some(val)) = (index, val) else {
                    return Err(bad(format!("{name}: argument without index or val")));
                };
                let cond = match &a["op"] {
                    serde_json::Value::String(op) => {
                        let op = match op.as_str() {
                            "eq" => "SCMP_CMP_EQ",
                            "ne" => "SCMP_CMP_NE",
                            "lt" => "SCMP_CMP_LT",
                            "le" => "SCMP_CMP_LE",
                            "gt" => "SCMP_CMP_GT",
                            "ge" => "SCMP_CMP_GE",
                            other => return Err(bad(format!("{name}: operator {other}"))),
                        };
                        serde_json::json!({"index": index, "value": val, "op": op})
                    }
                    serde_json::Value::Object(o) => {
                        let mask = o
                            .get("masked_eq")
                            .and_then(serde_json::Value::as_u64)
                            .ok_or_else(|| bad(format!("{name}: operator {o:?}")))?;
                        serde_json::json!({
                            "index": index, "value": mask, "valueTwo": val,
                            "op": "SCMP_CMP_MASKED_EQ"
                        })
                    }
                    other => return Err(bad(format!("{name}: operator {other}"))),
                };
                args.push(cond);
            }
            let mut entry = serde_json::json!({
                "names": [name], "action": "SCMP_ACT_ERRNO", "errnoRet": errno
            });
            if !args.is_empty() {
                entry["args"] = serde_json::Value::Array(args);
            }
            syscalls.push(entry);
        }
    }
    Ok(serde_json::json!({
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64"],
        "syscalls": syscalls,
    }))
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
    fn the_oci_form_denies_the_same_set() {
        let oci = oci_seccomp().expect("translates");
        assert_eq!(oci["defaultAction"], "SCMP_ACT_ALLOW");
        let rules = oci["syscalls"].as_array().expect("syscalls");
        let mut names: Vec<String> = rules
            .iter()
            .map(|r| {
                let n = r["names"][0].as_str().expect("name").to_string();
                if r.get("args").is_some() {
                    format!("{n}(filtered)")
                } else {
                    n
                }
            })
            .collect();
        names.sort();
        assert_eq!(names, denied_syscalls());
        let clone = rules
            .iter()
            .find(|r| r["names"][0] == "clone")
            .expect("clone rule");
        assert_eq!(clone["args"][0]["op"], "SCMP_CMP_MASKED_EQ");
        assert_eq!(clone["args"][0]["value"], 0x1000_0000u64);
        assert_eq!(clone["args"][0]["valueTwo"], 0x1000_0000u64);
        assert_eq!(clone["errnoRet"], 1);
        let clone3 = rules
            .iter()
            .find(|r| r["names"][0] == "clone3")
            .expect("clone3 rule");
        assert_eq!(
            clone3["errnoRet"], 38,
            "clone3 must look absent so libc falls back"
        );
    }

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
            init_module io_uring_enter io_uring_register io_uring_setup \
            ioctl(filtered) ioctl(filtered) ioctl(filtered) ioctl(filtered) ioctl(filtered) \
            ioperm iopl kcmp \
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

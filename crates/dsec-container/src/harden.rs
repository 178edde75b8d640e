//! Privilege reduction of the sandbox's PID 1 (inherited by everything it starts):
//! capabilities cut to [`KEPT_CAPS`], no_new_privs, and the default seccomp policy from
//! `resources/seccomp-default.json` (policy as data; see its snapshot tests).
//!
//! The policy is three filters, installed in this order:
//! - `allow`: an allowlist. A system call not on it fails with ENOSYS, as if the kernel
//!   lacked it (so libraries fall back), including every call newer than the list.
//!   Built as a binary search by [`crate::allowlist`] from the calls' numbers in
//!   `resources/seccomp-allowed.txt`.
//! - `deny_eperm`: calls refused with EPERM, some by argument (namespace flags of
//!   `clone`, extent-swapping and terminal-injecting ioctls, `AF_VSOCK` sockets).
//! - `deny_enosys`: calls refused with ENOSYS: `clone3` (its flags live in memory a
//!   filter cannot read) and the rest of the kernel's table that `allow` leaves out.
//!
//! The kernel runs every filter and keeps the most severe answer; among errnos, the
//! filter installed last wins, so EPERM of `deny_eperm` beats ENOSYS of `allow`.

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

/// Its filters that refuse calls.
const DENY_FILTERS: [&str; 2] = ["deny_eperm", "deny_enosys"];

/// The allowlist's calls with their x86_64 numbers (`NAME NUMBER` lines).
pub const ALLOWED_NUMBERS: &str = include_str!("../resources/seccomp-allowed.txt");

/// Compiles the default policy into BPF programs, in installation order: the allowlist
/// as a binary search ([`crate::allowlist`]), the deny filters through seccompiler.
pub fn compile_seccomp() -> Result<Vec<seccompiler::BpfProgram>, HardenError> {
    let bad = |what: String| HardenError::SeccompCompile(what);
    let mut doc: serde_json::Value =
        serde_json::from_str(SECCOMP_POLICY_JSON).map_err(|e| bad(e.to_string()))?;
    let allow = doc
        .as_object_mut()
        .and_then(|m| m.remove("allow"))
        .ok_or_else(|| bad("filter allow missing".into()))?;
    let errno = allow["default_action"]["errno"]
        .as_u64()
        .ok_or_else(|| bad("allow: default_action is not an errno".into()))?;
    let mut out = vec![crate::allowlist::program(
        &allowed_calls(&allow)?,
        errno as u32,
    )];
    let arch = seccompiler::TargetArch::x86_64;
    let mut map = seccompiler::compile_from_json(doc.to_string().as_bytes(), arch)
        .map_err(|e| bad(e.to_string()))?;
    for name in DENY_FILTERS {
        let prog = map
            .remove(name)
            .ok_or_else(|| bad(format!("filter {name} missing")))?;
        out.push(prog);
    }
    Ok(out)
}

/// The calls of the `allow` filter, numbered from [`ALLOWED_NUMBERS`], with their
/// argument rules (each one `eq` test of a 32-bit argument).
fn allowed_calls(
    allow: &serde_json::Value,
) -> Result<Vec<crate::allowlist::AllowedCall>, HardenError> {
    let bad = |what: String| HardenError::SeccompCompile(format!("allow: {what}"));
    let numbers: std::collections::HashMap<&str, u32> = ALLOWED_NUMBERS
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (name, nr) = l.split_once(' ')?;
            Some((name, nr.trim().parse().ok()?))
        })
        .collect();
    let mut calls: Vec<crate::allowlist::AllowedCall> = Vec::new();
    for rule in allow["filter"].as_array().into_iter().flatten() {
        let name = rule["syscall"].as_str().unwrap_or_default();
        let nr = *numbers
            .get(name)
            .ok_or_else(|| bad(format!("{name} has no number in seccomp-allowed.txt")))?;
        let when = match rule["args"].as_array() {
            None => None,
            Some(args) => {
                let [a] = args.as_slice() else {
                    return Err(bad(format!("{name}: one argument test per rule")));
                };
                let (index, val) = (a["index"].as_u64(), a["val"].as_u64());
                match (index, val, a["type"].as_str(), a["op"].as_str()) {
                    (Some(i), Some(v), Some("dword"), Some("eq")) if i < 6 && v <= 0xffff_ffff => {
                        Some((i as u8, v as u32))
                    }
                    _ => return Err(bad(format!("{name}: only dword eq tests"))),
                }
            }
        };
        match calls.iter_mut().find(|c| c.nr == nr) {
            // An unconditional rule allows the call whatever other rules say.
            Some(c) => match when {
                Some(w) if !c.when.is_empty() => c.when.push(w),
                _ => c.when.clear(),
            },
            None => calls.push(crate::allowlist::AllowedCall {
                nr,
                when: when.into_iter().collect(),
            }),
        }
    }
    Ok(calls)
}

/// The default policy as an OCI runtime spec's `linux.seccomp` (for isolation level
/// `oci`): everything allowed but the deny filters' rules, each answered with its
/// filter's errno. The allowlist does not carry over: libseccomp drops a rule that
/// refuses some arguments of a call another rule allows (tested with runc 1.1.5), so
/// "allow ioctl but these commands" has no form under a refusing default. Argument
/// conditions carry over as `SCMP_CMP_MASKED_EQ` on the compared bits: a 32-bit
/// argument (`dword`) is compared on its low 32 bits only, as the kernel reads it (a
/// plain 64-bit compare is dodged by setting the high bits).
pub fn oci_seccomp() -> Result<serde_json::Value, HardenError> {
    let doc: serde_json::Value =
        serde_json::from_str(SECCOMP_POLICY_JSON).map_err(|e| oci_bad(e.to_string()))?;
    let mut syscalls = Vec::new();
    for filter in DENY_FILTERS {
        let errno = filter_errno(&doc, filter, "filter_action")?;
        for rule in doc[filter]["filter"].as_array().into_iter().flatten() {
            let (name, args) = oci_rule(filter, rule)?;
            let mut entry = serde_json::json!({
                "names": [name], "action": "SCMP_ACT_ERRNO", "errnoRet": errno
            });
            if !args.is_empty() {
                entry["args"] = serde_json::Value::Array(args);
            }
            syscalls.push(entry);
        }
    }
    // Calls the allowlist admits for some arguments only (personality): refused, but
    // for those arguments. libseccomp keeps an argument rule that allows under one that
    // refuses (tested with runc 1.1.5), not the other way round.
    let allow = doc["allow"]["filter"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let errno = filter_errno(&doc, "allow", "default_action")?;
    let mut only_filtered: Vec<&str> = Vec::new();
    for rule in &allow {
        let name = rule["syscall"].as_str().unwrap_or_default();
        let filtered = |r: &serde_json::Value| r["syscall"] == name && r.get("args").is_some();
        if allow.iter().filter(|r| r["syscall"] == name).all(filtered)
            && !only_filtered.contains(&name)
        {
            only_filtered.push(name);
        }
    }
    for name in only_filtered {
        syscalls.push(serde_json::json!({
            "names": [name], "action": "SCMP_ACT_ERRNO", "errnoRet": errno
        }));
        for rule in allow.iter().filter(|r| r["syscall"] == name) {
            let (_, args) = oci_rule("allow", rule)?;
            syscalls.push(serde_json::json!({
                "names": [name], "action": "SCMP_ACT_ALLOW", "args": args
            }));
        }
    }
    Ok(serde_json::json!({
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64"],
        "syscalls": syscalls,
    }))
}

fn oci_bad(what: String) -> HardenError {
    HardenError::SeccompCompile(format!("OCI translation: {what}"))
}

/// The errno of a filter's `filter_action` or `default_action`.
fn filter_errno(doc: &serde_json::Value, filter: &str, action: &str) -> Result<u64, HardenError> {
    doc[filter][action]["errno"]
        .as_u64()
        .ok_or_else(|| oci_bad(format!("{filter}: {action} is not an errno")))
}

/// A rule's syscall name and its argument conditions in OCI form.
fn oci_rule(
    filter: &str,
    rule: &serde_json::Value,
) -> Result<(String, Vec<serde_json::Value>), HardenError> {
    let name = rule["syscall"]
        .as_str()
        .ok_or_else(|| oci_bad(format!("{filter}: rule without a syscall")))?;
    let mut args = Vec::new();
    for a in rule["args"].as_array().into_iter().flatten() {
        let (index, val) = (a["index"].as_u64(), a["val"].as_u64());
        let (Some(index), Some(val)) = (index, val) else {
            return Err(oci_bad(format!("{name}: argument without index or val")));
        };
        let width = match a["type"].as_str() {
            Some("dword") => u64::from(u32::MAX),
            Some("qword") => u64::MAX,
            other => return Err(oci_bad(format!("{name}: argument type {other:?}"))),
        };
        // Only equality is used (and only equality keeps its meaning under a mask);
        // anything else must be translated deliberately.
        let mask = match &a["op"] {
            serde_json::Value::String(op) if op == "eq" => width,
            serde_json::Value::Object(o) => o
                .get("masked_eq")
                .and_then(serde_json::Value::as_u64)
                .map(|m| m & width)
                .ok_or_else(|| oci_bad(format!("{name}: operator {o:?}")))?,
            other => return Err(oci_bad(format!("{name}: operator {other}"))),
        };
        args.push(serde_json::json!({
            "index": index, "value": mask, "valueTwo": val & mask,
            "op": "SCMP_CMP_MASKED_EQ"
        }));
    }
    Ok((name.to_string(), args))
}

/// Syscall names the default policy denies, sorted (for review and snapshot tests).
pub fn denied_syscalls() -> Vec<String> {
    rule_names(&DENY_FILTERS)
}

/// Syscall names on the default policy's allowlist, sorted, each once.
pub fn allowed_syscalls() -> Vec<String> {
    let mut names: Vec<String> = rule_names(&["allow"])
        .into_iter()
        .map(|n| n.trim_end_matches("(filtered)").to_string())
        .collect();
    names.sort();
    names.dedup();
    names
}

/// The rules of some filters by syscall name (`name(filtered)` for argument rules).
fn rule_names(filters: &[&str]) -> Vec<String> {
    let doc: serde_json::Value = serde_json::from_str(SECCOMP_POLICY_JSON).unwrap_or_default();
    let mut names: Vec<String> = filters
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
        // Besides the refusals, personality is refused but for the allowlist's values.
        let (personality, rules): (Vec<_>, Vec<_>) =
            rules.iter().partition(|r| r["names"][0] == "personality");
        assert_eq!(personality[0]["action"], "SCMP_ACT_ERRNO");
        assert!(personality[0].get("args").is_none());
        assert_eq!(personality.len(), 6);
        assert!(personality[1..]
            .iter()
            .all(|r| r["action"] == "SCMP_ACT_ALLOW" && r["args"][0]["valueTwo"].is_u64()));
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
        // A 32-bit argument is compared on its low half only: the kernel ignores the
        // high half of an ioctl command, so a full 64-bit compare could be dodged.
        let tiocsti = rules
            .iter()
            .find(|r| r["names"][0] == "ioctl" && r["args"][0]["valueTwo"] == 0x5412)
            .expect("TIOCSTI rule");
        assert_eq!(tiocsti["args"][0]["op"], "SCMP_CMP_MASKED_EQ");
        assert_eq!(tiocsti["args"][0]["value"], 0xffff_ffffu64);
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
        assert_eq!(progs.len(), 3);
        assert!(progs.iter().all(|p| !p.is_empty()));
    }

    /// Snapshot of the allowlist (`resources/seccomp-allowed.txt`): a call added to it
    /// must be added there too, deliberately.
    #[test]
    fn allowed_set_snapshot() {
        let expected: Vec<&str> = ALLOWED_NUMBERS
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.split_whitespace().next())
            .collect();
        assert_eq!(allowed_syscalls(), expected);
        for must in [
            "read",
            "execve",
            "clone",
            "ioctl",
            "socket",
            "landlock_restrict_self",
        ] {
            assert!(expected.contains(&must), "{must}");
        }
    }

    /// The allowlist's numbers are the kernel's: seccompiler's table gives each name the
    /// same number (its filter for the name alone tests that number).
    #[test]
    fn allowlist_numbers_match_seccompilers_table() {
        for line in ALLOWED_NUMBERS.lines().filter(|l| !l.starts_with('#')) {
            let (name, nr) = line.split_once(' ').expect("NAME NUMBER");
            let nr: u32 = nr.parse().expect("number");
            let json = format!(
                r#"{{"f": {{"default_action": "allow", "filter_action": {{"errno": 1}},
                   "filter": [{{"syscall": "{name}"}}]}}}}"#
            );
            let map =
                seccompiler::compile_from_json(json.as_bytes(), seccompiler::TargetArch::x86_64)
                    .expect("compiles");
            let tested: Vec<u32> = map["f"]
                .iter()
                .filter(|i| i.code == 0x15)
                .map(|i| i.k)
                .collect();
            assert!(tested.contains(&nr), "{name}: {nr} not in {tested:?}");
        }
    }

    /// The allowlist filter in a real process: allowed calls work, calls off the list
    /// and personality values off the list fail with ENOSYS, calls the deny filters
    /// refuse fail with EPERM.
    #[test]
    fn the_installed_policy_answers_as_written() {
        let progs = compile_seccomp().expect("compiles");
        assert!(
            progs[0].len() < 1000,
            "allowlist of {} instructions",
            progs[0].len()
        );
        // SAFETY: fork in a test; the child makes system calls only and leaves with _exit.
        match unsafe { libc::fork() } {
            // SAFETY: raw system calls with constant arguments, then _exit.
            0 => unsafe {
                let code = (|| {
                    libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
                    for p in &progs {
                        if seccompiler::apply_filter(p).is_err() {
                            return 10;
                        }
                    }
                    let errno = || *libc::__errno_location();
                    if libc::syscall(libc::SYS_getppid) <= 0 {
                        return 11;
                    }
                    if libc::syscall(libc::SYS_personality, 0xffff_ffffu64) < 0 {
                        return 12;
                    }
                    if libc::syscall(libc::SYS_personality, 0x0040000u64) >= 0 || errno() != 38 {
                        return 13;
                    }
                    if libc::syscall(libc::SYS_modify_ldt, 0, 0, 0) >= 0 || errno() != 38 {
                        return 14;
                    }
                    if libc::syscall(libc::SYS_unshare, 0) >= 0 || errno() != 1 {
                        return 15;
                    }
                    if libc::syscall(libc::SYS_clone3, 0, 0) >= 0 || errno() != 38 {
                        return 16;
                    }
                    0
                })();
                libc::_exit(code)
            },
            pid => {
                let mut status = 0;
                // SAFETY: waiting for our own child.
                unsafe { libc::waitpid(pid, &mut status, 0) };
                assert!(libc::WIFEXITED(status), "child status {status:#x}");
                assert_eq!(libc::WEXITSTATUS(status), 0, "failed check");
            }
        }
    }

    /// Nothing is both allowed and refused outright: a call on the allowlist is refused
    /// only for some arguments.
    #[test]
    fn allowed_and_denied_calls_overlap_only_by_argument() {
        let allowed = allowed_syscalls();
        for denied in denied_syscalls() {
            match denied.strip_suffix("(filtered)") {
                Some(name) => assert!(allowed.iter().any(|a| a == name), "{name}"),
                None => assert!(!allowed.contains(&denied), "{denied} allowed and denied"),
            }
        }
    }

    /// Snapshot of the policy: a change to the denied set must be deliberate.
    #[test]
    fn denied_set_snapshot() {
        let expected = "_sysctl acct add_key adjtimex afs_syscall bpf clock_adjtime \
            clock_settime clone(filtered) clone3 create_module delete_module epoll_ctl_old \
            epoll_wait_old fanotify_init finit_module fsconfig fsmount fsopen fspick \
            get_kernel_syms get_mempolicy getpmsg init_module io_uring_enter \
            io_uring_register io_uring_setup \
            ioctl(filtered) ioctl(filtered) ioctl(filtered) ioctl(filtered) ioctl(filtered) \
            ioperm iopl kcmp kexec_file_load kexec_load keyctl listmount lookup_dcookie \
            lsm_get_self_attr lsm_list_modules lsm_set_self_attr mbind migrate_pages \
            modify_ldt mount mount_setattr move_mount move_pages name_to_handle_at \
            nfsservctl open_by_handle_at open_tree perf_event_open pidfd_getfd pivot_root \
            process_madvise putpmsg query_module quotactl quotactl_fd reboot request_key \
            security set_mempolicy set_mempolicy_home_node setdomainname sethostname setns \
            settimeofday socket(filtered) statmount swapoff swapon sysfs syslog tuxcall \
            umount2 unshare uretprobe uselib userfaultfd ustat vhangup vserver";
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

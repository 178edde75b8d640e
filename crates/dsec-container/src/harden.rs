//! Privilege reduction of the sandbox's PID 1 (inherited by everything it starts):
//! capabilities cut to [`KEPT_CAPS`], no_new_privs, and the default seccomp policy from
//! `resources/seccomp-default.json` (policy as data; see its snapshot tests).
//!
//! The policy is written as three filters, as if installed in this order:
//! - `allow`: an allowlist. A system call not on it fails with ENOSYS, as if the kernel
//!   lacked it (so libraries fall back), including every call newer than the list.

//! - `deny_eperm`: calls refused with EPERM, some by argument (namespace flags of
//!   `clone`, extent-swapping and terminal-injecting ioctls, `AF_VSOCK` sockets).
//! - `deny_enosys`: calls refused with ENOSYS: `clone3` (its flags live in memory a
//!   filter cannot read) and the rest of the kernel's table that `allow` leaves out.
//!
//! The kernel runs every filter and keeps the most severe answer; among errnos, the
//! filter installed last wins, so EPERM of `deny_eperm` beats ENOSYS of `allow`. The
//! agent installs them merged into one program with the same answers, a binary search
//! over call numbers ([`crate::bpf`], numbers from `resources/syscalls-x86_64.txt`).

use std::collections::HashSet;

use caps::{CapSet, Capability};

use crate::policy::{DENY_FILTERS, SECCOMP_POLICY_JSON};

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
    seccompiler::apply_filter(&seccomp_program())
        .map_err(|e| HardenError::SeccompInstall(e.to_string()))?;
    Ok(())
}

/// Makes `pid`, a sandbox's agent, the last process the OOM killer picks: its
/// `oom_score_adj` becomes -1000 (never killed) if `unkillable`, else -941. Written
/// through the legacy `oom_adj` file (-17 is -1000, -16 is -941), which leaves the floor
/// that children inherit (`oom_score_adj_min`) where it was: the commands the agent
/// starts get a positive score back (see `dsec-agent`'s `spawn`) and cannot lower
/// themselves below that floor. -1000 only where every command sets its score before
/// its exec: in a user namespace the agent sets it just after, and a child forked in
/// that window keeps the agent's score, which must not make it unkillable. Lowering a
/// score needs `CAP_SYS_RESOURCE` on the host: without it this fails with `EACCES`, and
/// the agent stays at the node's score (still below its commands').
pub fn protect_from_oom(pid: i32, unkillable: bool) -> std::io::Result<()> {
    let adj = if unkillable { "-17" } else { "-16" };
    std::fs::write(format!("/proc/{pid}/oom_adj"), adj)
}

/// The policy's program as the build compiled it (`build.rs`: nothing is parsed or
/// compiled at sandbox start).
pub fn seccomp_program() -> seccompiler::BpfProgram {
    const BPF: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/seccomp.bpf"));
    BPF.chunks_exact(8)
        .map(|i| seccompiler::sock_filter {
            code: u16::from_le_bytes([i[0], i[1]]),
            jt: i[2],
            jf: i[3],
            k: u32::from_le_bytes([i[4], i[5], i[6], i[7]]),
        })
        .collect()
}

/// Compiles the policy now (what the build did for [`seccomp_program`]).
pub fn compile_seccomp() -> Result<seccompiler::BpfProgram, HardenError> {
    crate::policy::compile().map_err(HardenError::SeccompCompile)
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

/// The default policy as an OCI runtime spec's `linux.seccomp` (for isolation level
/// `oci`): everything allowed but the deny filters' rules, each answered with its
/// filter's errno. The allowlist does not carry over: libseccomp drops a rule that
/// refuses some arguments of a call another rule allows (tested with runc 1.1.5), so
/// "allow ioctl but these commands" has no form under a refusing default. Argument
/// conditions carry over as `SCMP_CMP_MASKED_EQ` on the compared bits: a 32-bit
/// argument (`dword`) is compared on its low 32 bits only, as the kernel reads it (a
/// plain 64-bit compare is dodged by setting the high bits).
pub fn oci_seccomp() -> Result<serde_json::Value, HardenError> {
    let doc: serde_json::Value = serde_json::from_str(SECCOMP_POLICY_JSON)
        .map_err(|e| HardenError::SeccompCompile(e.to_string()))?;
    let mut syscalls = Vec::new();
    for filter in DENY_FILTERS {
        let errno = crate::policy::filter_errno(&doc, filter, "filter_action")
            .map_err(HardenError::SeccompCompile)?;
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
    let errno = crate::policy::filter_errno(&doc, "allow", "default_action")
        .map_err(HardenError::SeccompCompile)?;
    // Argument rules by call, for calls the allowlist has no unconditional rule for.
    let mut filtered: std::collections::BTreeMap<&str, Vec<&serde_json::Value>> =
        Default::default();
    for rule in &allow {
        filtered
            .entry(rule["syscall"].as_str().unwrap_or_default())
            .or_default()
            .push(rule);
    }
    filtered.retain(|_, rules| rules.iter().all(|r| r.get("args").is_some()));
    for (name, rules) in filtered {
        syscalls.push(serde_json::json!({
            "names": [name], "action": "SCMP_ACT_ERRNO", "errnoRet": errno
        }));
        for rule in rules {
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

/// A rule's syscall name and its argument conditions in OCI form.
fn oci_rule(
    filter: &str,
    rule: &serde_json::Value,
) -> Result<(String, Vec<serde_json::Value>), HardenError> {
    let (name, tests) =
        crate::policy::parse_rule(filter, rule).map_err(HardenError::SeccompCompile)?;
    let args = tests
        .iter()
        .map(|t| {
            serde_json::json!({
                "index": t.index, "value": t.mask, "valueTwo": t.value,
                "op": "SCMP_CMP_MASKED_EQ"
            })
        })
        .collect();
    Ok((name, args))
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
        let prog = compile_seccomp().expect("policy compiles");
        assert!(
            !prog.is_empty() && prog.len() < 1500,
            "{} instructions",
            prog.len()
        );
        // What the build compiled is what the policy compiles to now.
        assert_eq!(seccomp_program(), prog);
    }

    /// The merged program answers every call as the policy's three filters, compiled rule
    /// by rule by seccompiler and installed in order, would (the kernel keeps the most
    /// severe answer, and among errnos the last filter's).
    #[test]
    fn the_program_answers_as_the_three_filters_would() {
        let prog = compile_seccomp().expect("compiles");
        let mut filters = seccompiler::compile_from_json(
            SECCOMP_POLICY_JSON.as_bytes(),
            seccompiler::TargetArch::x86_64,
        )
        .expect("seccompiler compiles the policy");
        let stack: Vec<_> = ["allow", "deny_eperm", "deny_enosys"]
            .iter()
            .map(|f| filters.remove(*f).expect("filter"))
            .collect();
        let arch = 62 | 0x8000_0000 | 0x4000_0000;
        let stacked = |nr, args| {
            let mut answer = 0x7fff_0000u32;
            for f in stack.iter().rev() {
                let r = crate::bpf::tests::run(f, arch, nr, args).0;
                if ((r & 0xffff_0000) as i32) < ((answer & 0xffff_0000) as i32) {
                    answer = r;
                }
            }
            answer
        };
        // Every argument value any test names, and its neighbours and high-bit twins.
        let doc: serde_json::Value = serde_json::from_str(SECCOMP_POLICY_JSON).expect("json");
        let mut probes = vec![[0u64; 6], [u64::MAX; 6]];
        for f in ["allow", "deny_eperm", "deny_enosys"] {
            for rule in doc[f]["filter"].as_array().into_iter().flatten() {
                for t in crate::policy::parse_rule(f, rule).expect("rule").1 {
                    for v in [t.value, t.value | 1 << 32, t.value ^ 1, t.value | !t.mask] {
                        let mut args = [0u64; 6];
                        args[usize::from(t.index)] = v;
                        probes.push(args);
                    }
                }
            }
        }
        for nr in 0..500u32 {
            for args in &probes {
                assert_eq!(
                    crate::bpf::tests::run(&prog, arch, nr, *args).0,
                    stacked(nr, *args),
                    "nr {nr} args {args:x?}"
                );
            }
        }
    }

    /// Snapshot of the allowlist (`resources/seccomp-allowed.txt`): a call added to it
    /// must be added there too, deliberately.
    #[test]
    fn allowed_set_snapshot() {
        let expected: Vec<&str> = include_str!("../resources/seccomp-allowed.txt")
            .split_whitespace()
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

    /// The numbers are the kernel's: seccompiler's table gives each name the same number
    /// (its filter for the name alone tests that number).
    #[test]
    fn syscall_numbers_match_seccompilers_table() {
        for line in crate::policy::SYSCALL_NUMBERS
            .lines()
            .filter(|l| !l.starts_with('#'))
        {
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

    /// The policy in a real process: allowed calls work, calls off the list and
    /// personality values off the list fail with ENOSYS, calls the deny filters refuse
    /// fail with EPERM.
    #[test]
    fn the_installed_policy_answers_as_written() {
        let prog = compile_seccomp().expect("compiles");
        // SAFETY: fork in a test; the child makes system calls only and leaves with _exit.
        match unsafe { libc::fork() } {
            // SAFETY: raw system calls with constant arguments, then _exit.
            0 => unsafe {
                let code = (|| {
                    libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
                    if seccompiler::apply_filter(&prog).is_err() {
                        return 10;
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

//! The default seccomp policy (`resources/seccomp-default.json`, three filters written
//! as if installed in order: `allow`, `deny_eperm`, `deny_enosys`) compiled into one BPF
//! program with the same answers ([`crate::bpf`]). Pure: the build script includes this
//! file to compile the policy once, at build time.

use crate::bpf::{ArgTest, CallRule, Verdict};

/// The default seccomp policy, as data.
pub const SECCOMP_POLICY_JSON: &str = include_str!("../resources/seccomp-default.json");

/// Its filters that refuse calls, in precedence order (the last installed first).
pub const DENY_FILTERS: [&str; 2] = ["deny_eperm", "deny_enosys"];

/// x86_64 system call numbers (`NAME NUMBER` lines).
pub const SYSCALL_NUMBERS: &str = include_str!("../resources/syscalls-x86_64.txt");

/// Compiles the policy into one BPF program ([`crate::bpf`]) that answers every
/// call as the policy's three filters installed in order would: the kernel keeps the
/// most severe answer, and among errnos the last filter's. So per call: `deny_enosys`,
/// then `deny_eperm`, then the allowlist decide.
pub fn compile() -> Result<seccompiler::BpfProgram, String> {
    let doc: serde_json::Value =
        serde_json::from_str(SECCOMP_POLICY_JSON).map_err(|e| e.to_string())?;
    let numbers: std::collections::HashMap<&str, u32> = SYSCALL_NUMBERS
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (name, nr) = l.split_once(' ')?;
            Some((name, nr.trim().parse().ok()?))
        })
        .collect();
    let default = Verdict::Errno(filter_errno(&doc, "allow", "default_action")? as u16);
    // Per call number: its rule so far, and whether an unconditional rule settled it.
    let mut rules: std::collections::BTreeMap<u32, (CallRule, bool)> = Default::default();
    for filter in ["deny_enosys", "deny_eperm", "allow"] {
        let verdict = match filter {
            "allow" => Verdict::Allow,
            f => Verdict::Errno(filter_errno(&doc, f, "filter_action")? as u16),
        };
        for r in doc[filter]["filter"].as_array().into_iter().flatten() {
            let (name, tests) = parse_rule(filter, r)?;
            let nr = *numbers
                .get(name.as_str())
                .ok_or_else(|| format!("{name}: no number in syscalls-x86_64.txt"))?;
            let (call, settled) = rules.entry(nr).or_insert_with(|| {
                let call = CallRule {
                    nr,
                    tests: vec![],
                    otherwise: default,
                };
                (call, false)
            });
            if *settled {
                continue;
            }
            match tests.as_slice() {
                [] => {
                    call.otherwise = verdict;
                    // A refusal ends the call's rule; an allowance ends it too (later
                    // tests of the allowlist could only allow).
                    *settled = true;
                }
                [test] => call.tests.push((*test, verdict)),
                _ => return Err(format!("{name}: one argument test per rule")),
            }
        }
    }
    let calls: Vec<CallRule> = rules.into_values().map(|(c, _)| c).collect();
    crate::bpf::program(&calls, default)
}

/// The errno of a filter's `filter_action` or `default_action`.
pub fn filter_errno(doc: &serde_json::Value, filter: &str, action: &str) -> Result<u64, String> {
    doc[filter][action]["errno"]
        .as_u64()
        .ok_or_else(|| format!("{filter}: {action} is not an errno"))
}

/// A rule's syscall name and its argument tests.
pub fn parse_rule(
    filter: &str,
    rule: &serde_json::Value,
) -> Result<(String, Vec<ArgTest>), String> {
    let name = rule["syscall"]
        .as_str()
        .ok_or_else(|| format!("{filter}: rule without a syscall"))?;
    let mut tests = Vec::new();
    for a in rule["args"].as_array().into_iter().flatten() {
        let (index, val) = (a["index"].as_u64(), a["val"].as_u64());
        let (Some(index @ 0..6), Some(val)) = (index, val) else {
            return Err(format!("{name}: argument without index or val"));
        };
        let (width, qword) = match a["type"].as_str() {
            Some("dword") => (u64::from(u32::MAX), false),
            Some("qword") => (u64::MAX, true),
            other => return Err(format!("{name}: argument type {other:?}")),
        };
        // Only equality is used (and only equality keeps its meaning under a mask);
        // anything else must be translated deliberately.
        let mask = match &a["op"] {
            serde_json::Value::String(op) if op == "eq" => width,
            serde_json::Value::Object(o) => o
                .get("masked_eq")
                .and_then(serde_json::Value::as_u64)
                .map(|m| m & width)
                .ok_or_else(|| format!("{name}: operator {o:?}"))?,
            other => return Err(format!("{name}: operator {other}")),
        };
        tests.push(ArgTest {
            index: index as u8,
            mask,
            value: val & mask,
            qword,
        });
    }
    Ok((name.to_string(), tests))
}

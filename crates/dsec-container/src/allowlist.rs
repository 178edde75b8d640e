//! The seccomp allowlist as a binary search over call numbers.
//!
//! A filter compiled rule by rule (as seccompiler does) tests calls one after another.
//! The kernel runs a new filter once per call number when it is installed (to cache the
//! calls it always allows), so a 300-call chain cost ~0.6 ms per sandbox start, and
//! every call it cannot cache (those with argument rules) walked the chain. This filter
//! finds a number in ~8 comparisons instead. The calls are those of the policy's `allow`
//! filter; their x86_64 numbers come from `resources/seccomp-allowed.txt`.

use seccompiler::{sock_filter, BpfProgram};

/// `AUDIT_ARCH_X86_64`.
const AUDIT_ARCH_X86_64: u32 = 62 | 0x8000_0000 | 0x4000_0000;
const RET_ALLOW: u32 = 0x7fff_0000;
const RET_ERRNO: u32 = 0x0005_0000;
/// `BPF_LD | BPF_W | BPF_ABS`.
const LD_ABS: u16 = 0x20;
/// `BPF_JMP | BPF_JEQ | BPF_K`.
const JEQ: u16 = 0x15;
/// `BPF_JMP | BPF_JGE | BPF_K`.
const JGE: u16 = 0x35;
/// `BPF_JMP | BPF_JA`.
const JA: u16 = 0x05;
/// `BPF_RET | BPF_K`.
const RET: u16 = 0x06;
/// Offsets in `struct seccomp_data`.
const NR: u32 = 0;
const ARCH: u32 = 4;
const ARGS: u32 = 16;
/// Calls tested one by one at the bottom of the search.
const LEAF: usize = 4;

/// A call on the allowlist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowedCall {
    /// Its number.
    pub nr: u32,
    /// Allowed only when one of these (argument index, value of its low 32 bits) holds;
    /// empty: always.
    pub when: Vec<(u8, u32)>,
}

fn op(code: u16, jt: u8, jf: u8, k: u32) -> sock_filter {
    sock_filter { code, jt, jf, k }
}

/// The filter: calls in `calls` are allowed (subject to their argument rules), any
/// other call, and any call of another architecture, fails with `errno`.
pub fn program(calls: &[AllowedCall], errno: u32) -> BpfProgram {
    let mut calls = calls.to_vec();
    calls.sort_by_key(|c| c.nr);
    calls.dedup_by_key(|c| c.nr);
    let refuse = RET_ERRNO | (errno & 0xffff);
    let mut prog = vec![
        op(LD_ABS, 0, 0, ARCH),
        op(JEQ, 1, 0, AUDIT_ARCH_X86_64),
        op(RET, 0, 0, refuse),
        op(LD_ABS, 0, 0, NR),
    ];
    prog.extend(search(&calls, refuse));
    prog
}

/// Code that allows or refuses the call whose number is in the accumulator.
fn search(calls: &[AllowedCall], refuse: u32) -> Vec<sock_filter> {
    if calls.len() <= LEAF {
        return leaf(calls, refuse);
    }
    let mid = calls.len() / 2;
    let (low, high) = (search(&calls[..mid], refuse), search(&calls[mid..], refuse));
    // nr >= pivot: the jump over `low`; else: `low`, right after that jump.
    let mut out = vec![op(JGE, 0, 1, calls[mid].nr), op(JA, 0, 0, low.len() as u32)];
    out.extend(low);
    out.extend(high);
    out
}

/// A test per call, then the refusal and the allowance, then argument checks.
fn leaf(calls: &[AllowedCall], refuse: u32) -> Vec<sock_filter> {
    let n = calls.len();
    let allow_at = n + 1;
    let mut blocks: Vec<sock_filter> = Vec::new();
    let mut tests = Vec::with_capacity(n);
    for (i, call) in calls.iter().enumerate() {
        let target = if call.when.is_empty() {
            allow_at
        } else {
            let start = n + 2 + blocks.len();
            let len = 2 * call.when.len() + 2;
            for (j, (index, value)) in call.when.iter().enumerate() {
                // Low half of the argument (little-endian); then to the block's allow.
                blocks.push(op(LD_ABS, 0, 0, ARGS + 8 * u32::from(*index)));
                let to_allow = len - (2 * j + 2) - 1;
                blocks.push(op(JEQ, to_allow as u8, 0, *value));
            }
            blocks.push(op(RET, 0, 0, refuse));
            blocks.push(op(RET, 0, 0, RET_ALLOW));
            start
        };
        tests.push(op(JEQ, (target - (i + 1)) as u8, 0, call.nr));
    }
    let mut out = tests;
    out.push(op(RET, 0, 0, refuse));
    out.push(op(RET, 0, 0, RET_ALLOW));
    out.extend(blocks);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the filter on one call, as the kernel would.
    fn run(prog: &[sock_filter], arch: u32, nr: u32, args: [u64; 6]) -> u32 {
        let word = |off: u32| -> u32 {
            match off {
                NR => nr,
                ARCH => arch,
                o if o >= ARGS => {
                    let i = ((o - ARGS) / 8) as usize;
                    if (o - ARGS).is_multiple_of(8) {
                        args[i] as u32
                    } else {
                        (args[i] >> 32) as u32
                    }
                }
                o => panic!("load of offset {o}"),
            }
        };
        let (mut pc, mut acc) = (0usize, 0u32);
        loop {
            let i = &prog[pc];
            pc += 1;
            match i.code {
                LD_ABS => acc = word(i.k),
                JEQ => pc += usize::from(if acc == i.k { i.jt } else { i.jf }),
                JGE => pc += usize::from(if acc >= i.k { i.jt } else { i.jf }),
                JA => pc += i.k as usize,
                RET => return i.k,
                c => panic!("opcode {c:#x}"),
            }
        }
    }

    #[test]
    fn every_number_gets_its_answer() {
        // Every 3rd number up to 400, one with argument rules.
        let mut calls: Vec<AllowedCall> = (0..400)
            .step_by(3)
            .map(|nr| AllowedCall { nr, when: vec![] })
            .collect();
        calls[10].when = vec![(0, 8), (0, 0xffff_ffff), (2, 5)];
        let gated = calls[10].nr;
        let prog = program(&calls, 38);
        assert!(prog.len() < 4096);
        let refuse = RET_ERRNO | 38;
        for nr in 0..1000u32 {
            let want = if nr < 400 && nr % 3 == 0 && nr != gated {
                RET_ALLOW
            } else {
                refuse
            };
            assert_eq!(run(&prog, AUDIT_ARCH_X86_64, nr, [0; 6]), want, "nr {nr}");
        }
        let allowed = |args| run(&prog, AUDIT_ARCH_X86_64, gated, args);
        assert_eq!(allowed([8, 0, 0, 0, 0, 0]), RET_ALLOW);
        assert_eq!(allowed([0xffff_ffff, 0, 0, 0, 0, 0]), RET_ALLOW);
        assert_eq!(allowed([9, 0, 5, 0, 0, 0]), RET_ALLOW);
        assert_eq!(allowed([9, 0, 4, 0, 0, 0]), refuse);
        // Only the low half counts, as the kernel reads a 32-bit argument.
        assert_eq!(allowed([(1 << 32) | 8, 0, 0, 0, 0, 0]), RET_ALLOW);
        // x32 numbers and other architectures.
        assert_eq!(run(&prog, AUDIT_ARCH_X86_64, 0x4000_0003, [0; 6]), refuse);
        assert_eq!(run(&prog, 0x4000_0003, 3, [0; 6]), refuse);
        // The search is shallow: no path is longer than ~30 instructions.
        let longest = (0..1000u32)
            .map(|nr| {
                let (mut pc, mut steps) = (0usize, 0);
                let mut acc = 0u32;
                loop {
                    let i = &prog[pc];
                    pc += 1;
                    steps += 1;
                    match i.code {
                        LD_ABS => acc = if i.k == ARCH { AUDIT_ARCH_X86_64 } else { nr },
                        JEQ => pc += usize::from(if acc == i.k { i.jt } else { i.jf }),
                        JGE => pc += usize::from(if acc >= i.k { i.jt } else { i.jf }),
                        JA => pc += i.k as usize,
                        _ => break steps,
                    }
                }
            })
            .max();
        assert!(longest.is_some_and(|l| l <= 30), "{longest:?}");
    }
}

//! The seccomp policy as one BPF program: a binary search over call numbers, then each
//! call's argument tests.
//!
//! A filter compiled rule by rule (as seccompiler does) tests calls one after another.
//! The kernel runs a new filter once per call number when it is installed (to cache the
//! calls it always allows), so the policy's three rule-by-rule filters cost ~0.8 ms per
//! sandbox start, and every call it cannot cache (those with argument rules) walked
//! the chains. This program finds a number's run of same-answer numbers in ~7
//! comparisons; the policy's three filters are merged into it by [`crate::policy`]
//! with their precedence kept.

use seccompiler::{sock_filter, BpfProgram};

/// `AUDIT_ARCH_X86_64`.
const AUDIT_ARCH_X86_64: u32 = 62 | 0x8000_0000 | 0x4000_0000;
const RET_ALLOW: u32 = 0x7fff_0000;
const RET_ERRNO: u32 = 0x0005_0000;
const RET_KILL_PROCESS: u32 = 0x8000_0000;
/// `BPF_LD | BPF_W | BPF_ABS`.
const LD_ABS: u16 = 0x20;
/// `BPF_ALU | BPF_AND | BPF_K`.
const AND: u16 = 0x54;
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

/// What a call gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// It runs.
    Allow,
    /// It fails with this errno.
    Errno(u16),
}

impl Verdict {
    fn ret(self) -> sock_filter {
        let k = match self {
            Verdict::Allow => RET_ALLOW,
            Verdict::Errno(e) => RET_ERRNO | u32::from(e),
        };
        op(RET, 0, 0, k)
    }
}

/// `(argument & mask) == value`; a 32-bit argument (`qword: false`) is compared on its
/// low half only, as the kernel reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArgTest {
    /// Argument index, 0..6.
    pub index: u8,
    /// Bits compared.
    pub mask: u64,
    /// Their expected value.
    pub value: u64,
    /// Whether the high half counts.
    pub qword: bool,
}

/// One call: the first test that holds decides, else `otherwise`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallRule {
    /// Its number.
    pub nr: u32,
    /// Tests in order, each with the verdict it gives when it holds.
    pub tests: Vec<(ArgTest, Verdict)>,
    /// The verdict when no test holds.
    pub otherwise: Verdict,
}

fn op(code: u16, jt: u8, jf: u8, k: u32) -> sock_filter {
    sock_filter { code, jt, jf, k }
}

/// A run of call numbers from its start up to the next run's: one verdict for all, or
/// one call with argument tests.
#[derive(Debug, Clone, Copy)]
enum Run<'a> {
    Ret(Verdict),
    Call(&'a CallRule),
}

/// The program: calls in `calls` get their rule's verdict, every other call `default`,
/// and a call of another architecture kills the process (32-bit calls would dodge the
/// numbers).
pub fn program(calls: &[CallRule], default: Verdict) -> Result<BpfProgram, String> {
    let mut calls = calls.to_vec();
    calls.sort_by_key(|c| c.nr);
    if calls.windows(2).any(|w| w[0].nr == w[1].nr) {
        return Err("a call number with two rules".into());
    }
    // Numbers 0..2^32 as runs: consecutive numbers with the same verdict are one run
    // (81 runs for the default policy's 375 calls), so the search is over runs.
    let mut runs: Vec<(u32, Run)> = Vec::new();
    fn push<'a>(runs: &mut Vec<(u32, Run<'a>)>, start: u32, run: Run<'a>) {
        if let (Run::Ret(v), Some((_, Run::Ret(last)))) = (run, runs.last()) {
            if v == *last {
                return;
            }
        }
        runs.push((start, run));
    }
    let mut next: u64 = 0;
    for call in &calls {
        if u64::from(call.nr) > next {
            push(&mut runs, next as u32, Run::Ret(default));
        }
        let run = if call.tests.is_empty() {
            Run::Ret(call.otherwise)
        } else {
            Run::Call(call)
        };
        push(&mut runs, call.nr, run);
        next = u64::from(call.nr) + 1;
    }
    if next <= u64::from(u32::MAX) {
        push(&mut runs, next as u32, Run::Ret(default));
    }
    let mut prog = vec![
        op(LD_ABS, 0, 0, ARCH),
        op(JEQ, 1, 0, AUDIT_ARCH_X86_64),
        op(RET, 0, 0, RET_KILL_PROCESS),
        op(LD_ABS, 0, 0, NR),
    ];
    prog.extend(search(&runs));
    if prog.len() > 4096 {
        return Err(format!("{} instructions (at most 4096)", prog.len()));
    }
    Ok(prog)
}

/// Code that decides the call whose number is in the accumulator, known to be in the
/// first run or after it.
fn search(runs: &[(u32, Run)]) -> Vec<sock_filter> {
    match runs {
        [] => vec![],
        [(_, Run::Ret(v))] => vec![v.ret()],
        [(_, Run::Call(call))] => block(call),
        _ => {
            let mid = runs.len() / 2;
            let (low, high) = (search(&runs[..mid]), search(&runs[mid..]));
            // nr >= the middle run's start: the jump over `low`; else `low`, right after.
            let mut out = vec![op(JGE, 0, 1, runs[mid].0), op(JA, 0, 0, low.len() as u32)];
            out.extend(low);
            out.extend(high);
            out
        }
    }
}

/// A call's argument tests, each followed by its verdict, then `otherwise`.
fn block(call: &CallRule) -> Vec<sock_filter> {
    let mut out = Vec::new();
    for (test, verdict) in &call.tests {
        let half = |offset: u32, mask: u32, value: u32, on_miss: u8| {
            let mut code = vec![op(LD_ABS, 0, 0, offset)];
            if mask != u32::MAX {
                code.push(op(AND, 0, 0, mask));
            }
            code.push(op(JEQ, 0, on_miss, value));
            code
        };
        let low = ARGS + 8 * u32::from(test.index);
        let (mask_hi, value_hi) = ((test.mask >> 32) as u32, (test.value >> 32) as u32);
        // The high half matters only for a 64-bit test with high bits in the mask.
        let high = (test.qword && mask_hi != 0).then(|| half(low + 4, mask_hi, value_hi, 1));
        let high_len = high.as_ref().map_or(0, Vec::len);
        // A miss skips the rest of this test: its high half and its verdict.
        out.extend(half(
            low,
            test.mask as u32,
            test.value as u32,
            (high_len + 1) as u8,
        ));
        out.extend(high.into_iter().flatten());
        out.push(verdict.ret());
    }
    out.push(call.otherwise.ret());
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Runs a classic BPF program (the opcodes seccomp filters use) on one call, as the
    /// kernel would; returns the verdict and the instructions run.
    pub(crate) fn run(prog: &[sock_filter], arch: u32, nr: u32, args: [u64; 6]) -> (u32, usize) {
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
        let (mut pc, mut acc, mut steps) = (0usize, 0u32, 0usize);
        loop {
            let i = &prog[pc];
            pc += 1;
            steps += 1;
            let jump = |holds: bool| usize::from(if holds { i.jt } else { i.jf });
            match i.code {
                LD_ABS => acc = word(i.k),
                AND => acc &= i.k,
                JEQ => pc += jump(acc == i.k),
                JGE => pc += jump(acc >= i.k),
                0x25 => pc += jump(acc > i.k),
                0x45 => pc += jump(acc & i.k != 0),
                JA => pc += i.k as usize,
                RET => return (i.k, steps),
                c => panic!("opcode {c:#x}"),
            }
        }
    }

    #[test]
    fn every_number_gets_its_verdict() {
        // Every 3rd number up to 400; some with argument tests.
        let mut calls: Vec<CallRule> = (0..400)
            .step_by(3)
            .map(|nr| CallRule {
                nr,
                tests: vec![],
                otherwise: Verdict::Allow,
            })
            .collect();
        let dword = |index, value| ArgTest {
            index,
            mask: u64::from(u32::MAX),
            value,
            qword: false,
        };
        calls[10].tests = vec![
            (dword(0, 8), Verdict::Allow),
            (dword(0, 0xffff_ffff), Verdict::Allow),
            (dword(2, 5), Verdict::Allow),
        ];
        calls[10].otherwise = Verdict::Errno(38);
        calls[11].tests = vec![(
            ArgTest {
                index: 1,
                mask: 0x1_1000_0000,
                value: 0x1_0000_0000,
                qword: true,
            },
            Verdict::Errno(1),
        )];
        let (gated, masked) = (calls[10].nr, calls[11].nr);
        let prog = program(&calls, Verdict::Errno(38)).expect("program");
        let refuse = RET_ERRNO | 38;
        let verdict = |nr, args| run(&prog, AUDIT_ARCH_X86_64, nr, args).0;
        for nr in 0..1000u32 {
            let want = if nr < 400 && nr % 3 == 0 && nr != gated {
                RET_ALLOW
            } else {
                refuse
            };
            assert_eq!(verdict(nr, [0; 6]), want, "nr {nr}");
        }
        assert_eq!(verdict(gated, [8, 0, 0, 0, 0, 0]), RET_ALLOW);
        assert_eq!(verdict(gated, [0xffff_ffff, 0, 0, 0, 0, 0]), RET_ALLOW);
        assert_eq!(verdict(gated, [9, 0, 5, 0, 0, 0]), RET_ALLOW);
        assert_eq!(verdict(gated, [9, 0, 4, 0, 0, 0]), refuse);
        // A 32-bit test ignores the high half, as the kernel does.
        assert_eq!(verdict(gated, [(1 << 32) | 8, 0, 0, 0, 0, 0]), RET_ALLOW);
        // A 64-bit masked test needs both halves.
        assert_eq!(
            verdict(masked, [0, 0x1_0000_0000, 0, 0, 0, 0]),
            RET_ERRNO | 1
        );
        assert_eq!(
            verdict(masked, [0, 0x1_2000_0000, 0, 0, 0, 0]),
            RET_ERRNO | 1
        );
        assert_eq!(verdict(masked, [0, 0x1_1000_0000, 0, 0, 0, 0]), RET_ALLOW);
        assert_eq!(verdict(masked, [0, 0x0_0000_0000, 0, 0, 0, 0]), RET_ALLOW);
        // x32 numbers are not on the list; other architectures are killed.
        assert_eq!(verdict(0x4000_0003, [0; 6]), refuse);
        assert_eq!(run(&prog, 0x4000_0003, 3, [0; 6]).0, RET_KILL_PROCESS);
        // The search is shallow: no path is longer than ~30 instructions.
        let longest = (0..1000u32)
            .map(|nr| run(&prog, AUDIT_ARCH_X86_64, nr, [0; 6]).1)
            .max();
        assert!(longest.is_some_and(|l| l <= 30), "{longest:?}");
        // Numbers far past the list, up to the last one.
        assert_eq!(verdict(u32::MAX, [0; 6]), refuse);
        let all = [CallRule {
            nr: u32::MAX,
            tests: vec![],
            otherwise: Verdict::Allow,
        }];
        let edge = program(&all, Verdict::Errno(1)).expect("program");
        assert_eq!(run(&edge, AUDIT_ARCH_X86_64, u32::MAX, [0; 6]).0, RET_ALLOW);
        assert_eq!(run(&edge, AUDIT_ARCH_X86_64, 7, [0; 6]).0, RET_ERRNO | 1);
        // Two rules for one number are refused.
        let twice = [calls[0].clone(), calls[0].clone()];
        assert!(program(&twice, Verdict::Allow).is_err());
    }
}

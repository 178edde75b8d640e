//! Hostile input: a Dockerfile or `.dockerignore` comes from the API caller, so no text
//! may panic the parser, the planner or the matcher, or make them run away. Inputs are
//! seeded mutations of real files and plain noise (deterministic: a failure names its
//! seed and replays).

use std::collections::BTreeMap;

use dsec_dockerfile::{parse, plan, Ignore};

const SEEDS: &[&str] = &[
    "# escape=`\nARG BASE=python:3.11-slim\nFROM ${BASE} AS build\nENV A=1 B=\"two words\"\nRUN apt-get update && \\\n    apt-get install -y git\nWORKDIR /src\nCOPY --chown=1000:1000 . .\nRUN [\"pip\", \"install\", \"-e\", \".\"]\nFROM build\nCOPY --from=build /src /app\nUSER 1000\nCMD [\"python\", \"-m\", \"app\"]\n",
    "FROM scratch\nADD rootfs.tar.gz /\nLABEL a=b c=\"d e\"\nEXPOSE 80/tcp 8000-8010\nSTOPSIGNAL SIGTERM\nHEALTHCHECK --interval=5s CMD true\nSHELL [\"/bin/bash\", \"-c\"]\nENTRYPOINT echo ${X:-y} ${Z:+w}\n",
];
const IGNORES: &[&str] = &[
    "# comment\n*.pyc\n**/node_modules\n!keep.pyc\n/build\nsrc/**/tmp?/[a-c]*\n!src/**/tmp1/a.txt\n",
];
/// Characters that matter to the grammar, to splice in.
const SPICE: &[&str] = &[
    "\\", "`", "$", "${", "}", ":-", ":+", ":?", "\"", "'", "[", "]", "\n", "\r\n", " ", "=",
    "--from=", "AS ", "FROM ", "ARG ", "#", "**", "!", "/", "..", "\t", "é", "\u{0}",
];

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// A mutation of `base`: spliced grammar characters, dropped and doubled spans.
fn mutate(rng: &mut Rng, base: &str) -> String {
    let mut chars: Vec<char> = base.chars().collect();
    for _ in 0..1 + rng.below(8) {
        let at = rng.below(chars.len() + 1);
        match rng.below(3) {
            0 => {
                let s = SPICE[rng.below(SPICE.len())];
                chars.splice(at..at, s.chars());
            }
            1 => {
                let end = (at + rng.below(12)).min(chars.len());
                chars.drain(at..end);
            }
            _ => {
                let end = (at + rng.below(40)).min(chars.len());
                let span: Vec<char> = chars[at..end].to_vec();
                chars.splice(at..at, span);
            }
        }
    }
    chars.into_iter().collect()
}

/// Printable-ish noise with the grammar's characters over-represented.
fn noise(rng: &mut Rng) -> String {
    (0..rng.below(400))
        .map(|_| {
            if rng.below(3) == 0 {
                SPICE[rng.below(SPICE.len())].to_string()
            } else {
                char::from(32 + rng.below(95) as u8).to_string()
            }
        })
        .collect()
}

#[test]
fn no_dockerfile_panics_the_parser_or_the_planner() {
    let args: BTreeMap<String, String> = [("BASE".to_string(), "debian".to_string())].into();
    for seed in 1..3_000u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let text = match seed % 3 {
            0 => noise(&mut rng),
            _ => {
                let base = SEEDS[rng.below(SEEDS.len())];
                mutate(&mut rng, base)
            }
        };
        let outcome = std::panic::catch_unwind(|| {
            if let Ok(df) = parse(&text) {
                let _ = plan(&df, &args, None);
                let _ = plan(&df, &BTreeMap::new(), Some("build"));
            }
        });
        assert!(outcome.is_ok(), "seed {seed} panicked on {text:?}");
    }
}

#[test]
fn no_dockerignore_panics_the_matcher() {
    let paths = [
        "a.pyc",
        "src/x/tmp1/a.txt",
        "build/out",
        "node_modules",
        "",
        ".",
        "a/../b",
    ];
    for seed in 1..3_000u64 {
        let mut rng = Rng(seed.wrapping_mul(0xd1b5_4a32_d192_ed03) | 1);
        let text = match seed % 3 {
            0 => noise(&mut rng),
            _ => mutate(&mut rng, IGNORES[0]),
        };
        let outcome = std::panic::catch_unwind(|| {
            if let Ok(ignore) = Ignore::parse(&text) {
                for p in paths {
                    let _ = ignore.is_ignored(p, false);
                    let _ = ignore.is_ignored(p, true);
                }
            }
        });
        assert!(outcome.is_ok(), "seed {seed} panicked on {text:?}");
    }
}

/// Patterns that backtracking matchers take exponential time on stay fast.
#[test]
fn pathological_globs_match_in_bounded_time() {
    let pattern = "a*".repeat(30) + "b";
    let ignore =
        Ignore::parse(&format!("{pattern}\n{}\n", "**/".repeat(30) + "x")).expect("valid patterns");
    let path = "a".repeat(60);
    let deep = "d/".repeat(60) + "y";
    let started = std::time::Instant::now();
    assert!(!ignore.is_ignored(&path, false));
    assert!(!ignore.is_ignored(&deep, false));
    assert!(
        started.elapsed() < std::time::Duration::from_secs(2),
        "matching took {:?}",
        started.elapsed()
    );
}

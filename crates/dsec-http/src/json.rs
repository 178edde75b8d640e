//! JSON for responses that carry a command's output: the same bytes serde_json writes,
//! written faster.
//!
//! serde_json escapes a string one byte at a time (about 1 ms per MiB of output on the
//! VMs dsec is measured on, more than the rest of a large exec's work in the node).
//! [`escape_into`] skips eight bytes at a time while none of them needs an escape, the
//! test serde_json's own reader uses; what it writes is byte for byte what serde_json
//! writes (tested against it).

use dsec_wire::v1::ExecResult;
use serde::Serialize;

/// `0x0101..01`: one in every byte of a word.
const ONES: u64 = u64::MAX / 255;
/// `0x8080..80`: the high bit of every byte of a word.
const HIGHS: u64 = ONES << 7;

/// The high bit of each byte of `word` that may need an escape (a control character, `"`
/// or `\`). The lowest set bit always marks one that does: a false mark needs a borrow
/// from a true one below it.
#[inline]
fn escape_mask(word: u64) -> u64 {
    let ctrl = word.wrapping_sub(ONES * 0x20) & !word;
    let quote = word ^ (ONES * u64::from(b'"'));
    let quote = quote.wrapping_sub(ONES) & !quote;
    let backslash = word ^ (ONES * u64::from(b'\\'));
    let backslash = backslash.wrapping_sub(ONES) & !backslash;
    (ctrl | quote | backslash) & HIGHS
}

/// The escape of `byte` as serde_json writes it, if it needs one.
#[inline]
fn escape_of(byte: u8) -> Option<&'static [u8]> {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    /// `\u00XX` for every control character (those without a short form use it).
    static LONG: [[u8; 6]; 32] = {
        let mut table = [[0u8; 6]; 32];
        let mut b = 0;
        while b < 32 {
            table[b] = [b'\\', b'u', b'0', b'0', HEX[b >> 4], HEX[b & 15]];
            b += 1;
        }
        table
    };
    Some(match byte {
        b'"' => b"\\\"",
        b'\\' => b"\\\\",
        0x08 => b"\\b",
        b'\t' => b"\\t",
        b'\n' => b"\\n",
        0x0c => b"\\f",
        b'\r' => b"\\r",
        0..=0x1f => &LONG[byte as usize],
        _ => return None,
    })
}

/// The first byte at or after `from` that needs an escape.
#[inline]
fn next_escape(bytes: &[u8], mut from: usize) -> Option<usize> {
    while let Some(chunk) = bytes.get(from..from + 8) {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        let mask = escape_mask(u64::from_le_bytes(word));
        if mask != 0 {
            return Some(from + (mask.trailing_zeros() / 8) as usize);
        }
        from += 8;
    }
    let tail = bytes.get(from..)?;
    tail.iter()
        .position(|&b| escape_of(b).is_some())
        .map(|at| from + at)
}

/// Appends `text` to `out` as a JSON string literal, quotes included.
pub fn escape_into(out: &mut Vec<u8>, text: &str) {
    let bytes = text.as_bytes();
    // Room for an escaped line break every 8 bytes without growing.
    out.reserve(bytes.len() + bytes.len() / 8 + 2);
    out.push(b'"');
    // Bytes before `start` are written: runs without escapes are copied whole.
    let mut start = 0;
    let mut from = 0;
    while let Some(at) = next_escape(bytes, from) {
        if let Some(esc) = escape_of(bytes[at]) {
            out.extend_from_slice(&bytes[start..at]);
            out.extend_from_slice(esc);
            start = at + 1;
        }
        from = at + 1;
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}

/// An [`ExecResult`] as JSON: what `serde_json::to_vec` writes, with the output escaped by
/// [`escape_into`].
pub fn exec_result(result: &ExecResult) -> Vec<u8> {
    /// Everything but the output, in the order [`ExecResult`] declares it.
    #[derive(Serialize)]
    struct Rest<'a> {
        #[serde(flatten)]
        exit: &'a dsec_wire::v1::ExitInfo,
        oom_killed: bool,
    }
    let rest = serde_json::to_vec(&Rest {
        exit: &result.exit,
        oom_killed: result.oom_killed,
    })
    // Plain integers and booleans: serialising them cannot fail.
    .unwrap_or_else(|_| b"{}".to_vec());
    let mut out = Vec::with_capacity(result.stdout.len() + result.stderr.len() + rest.len() + 32);
    out.extend_from_slice(b"{\"stdout\":");
    escape_into(&mut out, &result.stdout);
    out.extend_from_slice(b",\"stderr\":");
    escape_into(&mut out, &result.stderr);
    match rest.strip_prefix(b"{") {
        Some(fields) if fields != b"}" => {
            out.push(b',');
            out.extend_from_slice(fields);
        }
        _ => out.push(b'}'),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsec_wire::v1::ExitInfo;

    fn escaped(text: &str) -> String {
        let mut out = Vec::new();
        escape_into(&mut out, text);
        String::from_utf8(out).expect("escaped text is UTF-8")
    }

    #[test]
    fn every_character_class_is_escaped_as_serde_json_does() {
        let mut cases: Vec<String> = vec![
            String::new(),
            "plain".into(),
            "exactly8".into(),
            "line\n".repeat(100),
            "\"quoted\" and \\back\\slashed\\".into(),
            "tab\there\r\n\u{8}\u{c}\u{0}\u{1f}\u{7f}".into(),
            "ünïcödé ✓ 🦀 and \u{2028}\u{2029}".into(),
        ];
        // Every byte value a string can hold, at every offset within a word.
        let all: String = (0u32..0x80).filter_map(char::from_u32).collect();
        for shift in 0..8 {
            cases.push(format!("{}{all}{}", "x".repeat(shift), "é".repeat(shift)));
        }
        // Pseudo-random mixes of escapes, ASCII and multi-byte characters.
        let alphabet: Vec<char> = "ab\n\"\\\t\u{1}é€🦀 z".chars().collect();
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for len in 0..200 {
            let s: String = (0..len)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    alphabet[(seed % alphabet.len() as u64) as usize]
                })
                .collect();
            cases.push(s);
        }
        for case in &cases {
            let want = serde_json::to_string(case).expect("serde_json");
            assert_eq!(escaped(case), want, "for {case:?}");
        }
    }

    #[test]
    fn an_exec_result_is_the_json_serde_writes() {
        let results = [
            ExecResult {
                stdout: "hello\n".into(),
                stderr: String::new(),
                exit: ExitInfo {
                    exit_code: Some(0),
                    duration_ms: 3,
                    stdout_bytes: 6,
                    ..ExitInfo::default()
                },
                oom_killed: false,
            },
            ExecResult {
                stdout: "x".repeat(100_000) + "\"\\\u{0}",
                stderr: "Traceback:\n\tboom ✗\n".into(),
                exit: ExitInfo {
                    exit_code: None,
                    signal: Some(9),
                    duration_ms: 120_000,
                    timed_out: true,
                    stdout_bytes: u64::MAX,
                    stderr_bytes: 21,
                    stdout_truncated: true,
                    stderr_truncated: false,
                },
                oom_killed: true,
            },
        ];
        for r in &results {
            let ours = exec_result(r);
            assert_eq!(
                String::from_utf8_lossy(&ours),
                serde_json::to_string(r).expect("serde_json"),
            );
            let back: ExecResult = serde_json::from_slice(&ours).expect("parses");
            assert_eq!(&back, r);
        }
    }
}

//! Source wildcards: Go's `filepath.Match` on one path component, as Docker matches
//! COPY sources: `*` (any run), `?` (one character), `[a-z]` / `[^a-z]` classes, `\`
//! escapes. Patterns are compiled first, so a malformed one is an error even where it
//! would not be reached (Go reports `ErrBadPattern` the same way).

/// One element of a compiled component pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    Lit(char),
    /// `?`
    One,
    /// `*`
    Star,
    /// `[...]`
    Class {
        negated: bool,
        ranges: Vec<(char, char)>,
    },
}

/// A compiled pattern for one path component.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern(Vec<Tok>);

/// Whether a component has unescaped wildcard characters (`*`, `?`, `[`). One without
/// is looked up as a literal name, backslashes included, as Docker does.
pub fn has_wildcards(component: &str) -> bool {
    let mut chars = component.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                chars.next();
            }
            '*' | '?' | '[' => return true,
            _ => {}
        }
    }
    false
}

impl Pattern {
    /// Compiles one component's pattern; the error says what is malformed.
    pub fn compile(pattern: &str) -> Result<Pattern, &'static str> {
        let cs: Vec<char> = pattern.chars().collect();
        let mut out = Vec::new();
        let mut i = 0;
        while i < cs.len() {
            let c = cs[i];
            i += 1;
            match c {
                '*' => out.push(Tok::Star),
                '?' => out.push(Tok::One),
                '\\' => {
                    let n = *cs.get(i).ok_or("trailing backslash")?;
                    out.push(Tok::Lit(n));
                    i += 1;
                }
                '[' => {
                    let (tok, next) = class(&cs, i)?;
                    out.push(tok);
                    i = next;
                }
                c => out.push(Tok::Lit(c)),
            }
        }
        Ok(Pattern(out))
    }

    /// Whether the pattern matches all of `name` (one component: no `/`).
    pub fn matches(&self, name: &str) -> bool {
        let s: Vec<char> = name.chars().collect();
        let t = &self.0;
        // Greedy matching with one backtrack point: every token but `*` consumes exactly
        // one character, so retrying from the last star is complete, and O(len x tokens).
        let (mut ti, mut si) = (0, 0);
        let mut star: Option<(usize, usize)> = None;
        while si < s.len() {
            match t.get(ti) {
                Some(Tok::Star) => {
                    star = Some((ti, si));
                    ti += 1;
                }
                Some(tok) if one(tok, s[si]) => {
                    ti += 1;
                    si += 1;
                }
                _ => match star {
                    Some((st, ss)) => {
                        star = Some((st, ss + 1));
                        ti = st + 1;
                        si = ss + 1;
                    }
                    None => return false,
                },
            }
        }
        t[ti..].iter().all(|tok| *tok == Tok::Star)
    }
}

/// Whether a single-character token matches `c`.
fn one(tok: &Tok, c: char) -> bool {
    match tok {
        Tok::Lit(l) => *l == c,
        Tok::One => c != '/',
        Tok::Class { negated, ranges } => {
            ranges.iter().any(|(lo, hi)| (lo..=hi).contains(&&c)) != *negated
        }
        Tok::Star => false,
    }
}

/// A `[...]` class starting after the `[` at `i`, as Go parses it: `^` negates, `-`
/// and `]` must be escaped where they would start a range bound, the class is not
/// empty. Returns the token and the index after `]`.
fn class(cs: &[char], mut i: usize) -> Result<(Tok, usize), &'static str> {
    let negated = cs.get(i) == Some(&'^');
    if negated {
        i += 1;
    }
    let mut ranges = Vec::new();
    loop {
        if cs.get(i) == Some(&']') && !ranges.is_empty() {
            return Ok((Tok::Class { negated, ranges }, i + 1));
        }
        let (lo, next) = class_char(cs, i)?;
        i = next;
        let hi = if cs.get(i) == Some(&'-') {
            let (hi, next) = class_char(cs, i + 1)?;
            i = next;
            if hi < lo {
                return Err("bad range in [ class");
            }
            hi
        } else {
            lo
        };
        ranges.push((lo, hi));
    }
}

/// One (possibly escaped) character of a class at `i`, and the index after it.
fn class_char(cs: &[char], i: usize) -> Result<(char, usize), &'static str> {
    match cs.get(i) {
        None => Err("unterminated [ class"),
        Some('-') | Some(']') => Err("unescaped - or ] in [ class"),
        Some('\\') => cs
            .get(i + 1)
            .map(|c| (*c, i + 2))
            .ok_or("unterminated [ class"),
        Some(c) => Ok((*c, i + 1)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(pattern: &str, name: &str) -> bool {
        Pattern::compile(pattern)
            .unwrap_or_else(|e| panic!("{pattern:?}: {e}"))
            .matches(name)
    }

    #[test]
    fn go_match_table() {
        // From Go's path/filepath match_test.go (the cases without '/').
        let cases = [
            ("abc", "abc", true),
            ("*", "abc", true),
            ("*c", "abc", true),
            ("a*", "a", true),
            ("a*", "abc", true),
            ("a*", "ab", true),
            ("a*b*c*d*e*", "axbxcxdxe", true),
            ("a*b*c*d*e*", "axbxcxdxexxx", true),
            ("a*b?c*x", "abxbbxdbxebxczzx", true),
            ("a*b?c*x", "abxbbxdbxebxczzy", false),
            ("ab[c]", "abc", true),
            ("ab[b-d]", "abc", true),
            ("ab[e-g]", "abc", false),
            ("ab[^c]", "abc", false),
            ("ab[^b-d]", "abc", false),
            ("ab[^e-g]", "abc", true),
            ("a\\*b", "a*b", true),
            ("a\\*b", "ab", false),
            ("a?b", "a☺b", true),
            ("a[^a]b", "a☺b", true),
            ("a???b", "a☺b", false),
            ("a[^a][^a][^a]b", "a☺b", false),
            ("[a-ζ]*", "α", true),
            ("*[a-ζ]", "A", false),
            ("[\\-]", "-", true),
            ("[x\\-]", "x", true),
            ("[x\\-]", "-", true),
            ("[x\\-]", "z", false),
            ("[\\-x]", "x", true),
            ("[\\-x]", "-", true),
            ("[\\-x]", "a", false),
            ("*x", "xxx", true),
            ("*.py", "main.py", true),
            ("*.py", "main.pyc", false),
            ("*", "", true),
            ("", "", true),
            ("", "a", false),
        ];
        for (p, s, want) in cases {
            assert_eq!(m(p, s), want, "{p:?} on {s:?}");
        }
    }

    #[test]
    fn bad_patterns() {
        for p in [
            "[]a]", "[-]", "[x-]", "[-x]", "\\", "[", "[^", "[\\", "a[", "[a-b-c]", "[z-a]",
        ] {
            assert!(Pattern::compile(p).is_err(), "{p:?} should not compile");
        }
    }

    #[test]
    fn wildcard_detection() {
        assert!(has_wildcards("*.py"));
        assert!(has_wildcards("a?"));
        assert!(has_wildcards("[ab]"));
        assert!(!has_wildcards("plain.txt"));
        assert!(!has_wildcards("a\\*b"));
        assert!(has_wildcards("a\\\\*"));
    }

    #[test]
    fn pathological_patterns_are_fast() {
        let p = "a*".repeat(50) + "b";
        let s = "a".repeat(5000);
        let start = std::time::Instant::now();
        assert!(!m(&p, &s));
        assert!(start.elapsed() < std::time::Duration::from_secs(2));
    }
}

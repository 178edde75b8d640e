//! `.dockerignore` matching with Docker's rules (moby/patternmatcher), which differ from
//! `.gitignore`'s:
//! - a pattern matches the whole path from the context root (`*.pyc` is only top-level
//!   `.pyc` files; `**/*.pyc` is all of them);
//! - globs are Go's `filepath.Match` (`*` and `?` stop at `/`, `[a-z]`, `[^a]`, `\`
//!   escapes) plus `**`, any number of directories;
//! - patterns are cleaned (`./a/` is `a`, a leading `/` is dropped), lines starting with
//!   `#` are comments, `!` makes an exception;
//! - a pattern that matches a directory matches everything under it, and the last rule
//!   matching a path or one of its parents decides.
//!
//! The builder walks the context with [`Ignore::is_ignored`]; it should send the
//! Dockerfile and `.dockerignore` whatever they say, as Docker does.

/// A parsed `.dockerignore`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ignore {
    rules: Vec<Rule>,
}

/// One line of a `.dockerignore`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Rule {
    /// A `!` line: re-includes what it matches.
    exception: bool,
    /// The cleaned pattern.
    pattern: String,
    glob: Vec<Tok>,
}

/// A `.dockerignore` pattern that does not parse (Docker refuses the build for it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(".dockerignore line {line}: {message} in {pattern:?}")]
pub struct IgnoreError {
    /// 1-based line.
    pub line: usize,
    /// The line's pattern.
    pub pattern: String,
    /// What is wrong.
    pub message: String,
}

impl Ignore {
    /// Parses `.dockerignore` text. A pattern that is not a valid glob is an error
    /// rather than being skipped: skipping it would send files meant to stay out.
    pub fn parse(text: &str) -> Result<Ignore, IgnoreError> {
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        let mut rules = Vec::new();
        for (i, raw) in text.split('\n').enumerate() {
            let raw = raw.strip_suffix('\r').unwrap_or(raw);
            if raw.starts_with('#') {
                continue;
            }
            let mut p = raw.trim();
            if p.is_empty() {
                continue;
            }
            let err = |message: &str| IgnoreError {
                line: i + 1,
                pattern: p.to_string(),
                message: message.to_string(),
            };
            let exception = p.starts_with('!');
            if exception {
                p = p[1..].trim();
                if p.is_empty() {
                    return Err(err("\"!\" without a pattern"));
                }
            }
            let mut pattern = clean(p);
            if pattern.len() > 1 && pattern.starts_with('/') {
                pattern.remove(0);
            }
            let glob = compile(&pattern).map_err(err)?;
            rules.push(Rule {
                exception,
                pattern,
                glob,
            });
        }
        Ok(Ignore { rules })
    }

    /// The cleaned patterns, `!` first for exceptions, in order.
    pub fn patterns(&self) -> Vec<String> {
        self.rules
            .iter()
            .map(|r| {
                if r.exception {
                    format!("!{}", r.pattern)
                } else {
                    r.pattern.clone()
                }
            })
            .collect()
    }

    /// Docker's verdict on one path (relative to the context, `/`-separated; cleaned
    /// here): the last rule that matches it or one of its parent directories decides.
    pub fn matches(&self, path: &str) -> bool {
        let p = clean_query(path);
        self.last_rule(&p).is_some_and(|i| !self.rules[i].exception)
    }

    /// Whether the context walk leaves `relative_path` out. For a file, [`matches`].
    /// For a directory, true only when it is excluded and no later exception could
    /// re-include anything under it (then the walk can skip the whole subtree); an
    /// excluded directory that an exception keeps open is walked, and its entries get
    /// their own verdicts (Docker keeps walking there too). The context root is never
    /// ignored.
    ///
    /// [`matches`]: Ignore::matches
    pub fn is_ignored(&self, relative_path: &str, is_dir: bool) -> bool {
        let p = clean_query(relative_path);
        if p == "." || p == "/" {
            return false;
        }
        let Some(k) = self.last_rule(&p) else {
            return false;
        };
        if self.rules[k].exception {
            return false;
        }
        if !is_dir {
            return true;
        }
        !self.rules[k + 1..]
            .iter()
            .any(|r| r.exception && could_match_under(&r.pattern, &p))
    }

    /// Index of the last rule matching `p` (cleaned) or one of its parents.
    fn last_rule(&self, p: &str) -> Option<usize> {
        let prefixes: Vec<&str> = p
            .match_indices('/')
            .map(|(i, _)| &p[..i])
            .chain(std::iter::once(p))
            .collect();
        let chars: Vec<Vec<char>> = prefixes.iter().map(|q| q.chars().collect()).collect();
        self.rules
            .iter()
            .rposition(|r| chars.iter().any(|q| glob_match(&r.glob, q)))
    }
}

/// Whether `pattern` could match some path strictly under the directory `dir`: it must
/// match `dir` segment by segment and go deeper; a `**` could match anything.
fn could_match_under(pattern: &str, dir: &str) -> bool {
    let psegs: Vec<&str> = pattern.split('/').collect();
    let dsegs: Vec<&str> = dir.split('/').collect();
    for (i, d) in dsegs.iter().enumerate() {
        let Some(p) = psegs.get(i) else {
            return false;
        };
        if p.contains("**") {
            return true;
        }
        match compile(p) {
            Ok(g) => {
                if !glob_match(&g, &d.chars().collect::<Vec<_>>()) {
                    return false;
                }
            }
            // A segment that does not stand alone (an escaped `/`...): assume it could.
            Err(_) => return true,
        }
    }
    psegs.len() > dsegs.len()
}

/// A query path cleaned like the patterns (`./a//b/` is `a/b`, a leading `/` dropped).
fn clean_query(path: &str) -> String {
    let c = clean(path);
    match c.strip_prefix('/') {
        Some("") => "/".to_string(),
        Some(rest) => rest.to_string(),
        None => c,
    }
}

/// Go's `path.Clean`: `.` removed, `..` resolved where it can be, `//` collapsed, no
/// trailing `/`; empty is `.`.
fn clean(p: &str) -> String {
    let rooted = p.starts_with('/');
    let mut out: Vec<&str> = Vec::new();
    for seg in p.split('/') {
        match seg {
            "" | "." => {}
            ".." => match out.last() {
                Some(&l) if l != ".." => {
                    out.pop();
                }
                _ if rooted => {}
                _ => out.push(".."),
            },
            s => out.push(s),
        }
    }
    match (rooted, out.is_empty()) {
        (true, _) => format!("/{}", out.join("/")),
        (false, true) => ".".to_string(),
        (false, false) => out.join("/"),
    }
}

/// One element of a compiled pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    Lit(char),
    /// `?`: one character but `/`.
    One,
    /// `*`: any run without `/`.
    Star,
    /// `**` before `/` or inside a name: `(.*/)?`, any number of directories.
    Dirs,
    /// `**` at the end: anything.
    Rest,
    /// `[...]`
    Class {
        negated: bool,
        ranges: Vec<(char, char)>,
    },
}

/// Compiles a pattern the way patternmatcher turns it into a regular expression.
fn compile(pattern: &str) -> Result<Vec<Tok>, &'static str> {
    let cs: Vec<char> = pattern.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < cs.len() {
        let c = cs[i];
        i += 1;
        match c {
            '*' if cs.get(i) == Some(&'*') => {
                i += 1;
                if cs.get(i) == Some(&'/') {
                    i += 1;
                }
                out.push(if i == cs.len() { Tok::Rest } else { Tok::Dirs });
            }
            '*' => out.push(Tok::Star),
            '?' => out.push(Tok::One),
            '\\' => match cs.get(i) {
                Some(&n) => {
                    out.push(Tok::Lit(n));
                    i += 1;
                }
                None => return Err("trailing backslash"),
            },
            '[' => {
                let (tok, next) = class(&cs, i)?;
                out.push(tok);
                i = next;
            }
            c => out.push(Tok::Lit(c)),
        }
    }
    Ok(out)
}

/// A `[...]` class starting after the `[` at `i`; returns it and the index after `]`.
fn class(cs: &[char], mut i: usize) -> Result<(Tok, usize), &'static str> {
    let negated = cs.get(i) == Some(&'^');
    if negated {
        i += 1;
    }
    let mut ranges = Vec::new();
    let mut first = true;
    loop {
        let lo = match cs.get(i) {
            None => return Err("unterminated [ class"),
            Some(']') if !first => return Ok((Tok::Class { negated, ranges }, i + 1)),
            Some('\\') => {
                i += 1;
                *cs.get(i).ok_or("unterminated [ class")?
            }
            Some(&c) => c,
        };
        i += 1;
        first = false;
        let hi = if cs.get(i) == Some(&'-') && cs.get(i + 1).is_some_and(|c| *c != ']') {
            let hi = match cs[i + 1] {
                '\\' => {
                    i += 1;
                    *cs.get(i + 1).ok_or("unterminated [ class")?
                }
                c => c,
            };
            i += 2;
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

/// Whether the compiled pattern matches all of `s`. Dynamic programming over (token,
/// position), one row per token from the last: O(tokens x chars) whatever the pattern
/// (`a*a*a*...b` or `**/**/...` took exponential time backtracking, and a `.dockerignore`
/// is the caller's input).
fn glob_match(t: &[Tok], s: &[char]) -> bool {
    let m = s.len();
    // next[j]: whether the tokens after the current one match s[j..].
    let mut next: Vec<bool> = (0..=m).map(|j| j == m).collect();
    let mut cur = vec![false; m + 1];
    for tok in t.iter().rev() {
        // For `Dirs`: whether some '/' at k >= j has the rest matching s[k+1..].
        let mut slash_then_rest = false;
        for j in (0..=m).rev() {
            let c = s.get(j);
            cur[j] = match tok {
                Tok::Lit(l) => c == Some(l) && next[j + 1],
                Tok::One => c.is_some_and(|c| *c != '/') && next[j + 1],
                Tok::Class { negated, ranges } => {
                    c.is_some_and(|c| {
                        ranges.iter().any(|(lo, hi)| (lo..=hi).contains(&c)) != *negated
                    }) && next[j + 1]
                }
                // Zero characters, or one that is not '/' and the star again.
                Tok::Star => next[j] || (c.is_some_and(|c| *c != '/') && cur[j + 1]),
                Tok::Rest => next[j] || (c.is_some() && cur[j + 1]),
                Tok::Dirs => {
                    if c == Some(&'/') && next[j + 1] {
                        slash_then_rest = true;
                    }
                    next[j] || slash_then_rest
                }
            };
        }
        std::mem::swap(&mut next, &mut cur);
    }
    next[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ig(text: &str) -> Ignore {
        Ignore::parse(text).expect("valid .dockerignore")
    }

    #[test]
    fn clean_like_go() {
        let cases = [
            ("", "."),
            (".", "."),
            ("./", "."),
            ("a/", "a"),
            ("./a", "a"),
            ("a//b", "a/b"),
            ("a/./b", "a/b"),
            ("a/../b", "b"),
            ("../a", "../a"),
            ("a/../../b", "../b"),
            ("/", "/"),
            ("/..", "/"),
            ("/a/../..", "/"),
            ("/a/b/", "/a/b"),
        ];
        for (input, want) in cases {
            assert_eq!(clean(input), want, "clean({input:?})");
        }
    }

    #[test]
    fn patterns_are_cleaned() {
        let i = ig("# comment\n\n  /build/  \n./dist\n! keep\n #not-a-comment\nx/../y\n");
        assert_eq!(
            i.patterns(),
            ["build", "dist", "!keep", "#not-a-comment", "y"]
        );
    }

    #[test]
    fn matching_table() {
        // (patterns, path, is_dir, ignored)
        let cases: &[(&str, &str, bool, bool)] = &[
            // `*.pyc` is top-level only.
            ("*.pyc", "a.pyc", false, true),
            ("*.pyc", "src/a.pyc", false, false),
            ("**/*.pyc", "src/a.pyc", false, true),
            ("**/*.pyc", "a.pyc", false, true),
            ("**/*.pyc", "a/b/c/d.pyc", false, true),
            ("**/*.pyc\n!keep.pyc", "keep.pyc", false, false),
            ("**/*.pyc\n!keep.pyc", "sub/keep.pyc", false, true),
            ("**/*.pyc\n!**/keep.pyc", "sub/keep.pyc", false, false),
            // Last matching rule wins.
            ("!keep.pyc\n*.pyc", "keep.pyc", false, true),
            // `**/node_modules` anywhere, and everything beneath.
            ("**/node_modules", "node_modules", true, true),
            ("**/node_modules", "web/app/node_modules", true, true),
            (
                "**/node_modules",
                "web/node_modules/x/index.js",
                false,
                true,
            ),
            ("**/node_modules", "web/node_modules_x", true, false),
            // Leading `/` is the context root.
            ("/build", "build", true, true),
            ("/build", "build/out/x.o", false, true),
            ("/build", "src/build", true, false),
            ("build/", "build/x", false, true),
            // `*` and `?` do not cross `/`.
            ("src/*.rs", "src/main.rs", false, true),
            ("src/*.rs", "src/bin/main.rs", false, false),
            ("*", "anything", false, true),
            ("*", "dir/file", false, true),
            ("?.txt", "a.txt", false, true),
            ("?.txt", "ab.txt", false, false),
            ("*/?", "a/b", false, true),
            // `**` forms.
            ("**", "a/b/c", false, true),
            ("docs/**", "docs/a/b.md", false, true),
            ("docs/**", "docs", true, false),
            ("a/**/b", "a/b", false, true),
            ("a/**/b", "a/x/y/b", false, true),
            ("a/**/b", "a/x/yb", false, false),
            ("a**b", "ab", false, true),
            ("a**b", "ax/b", false, true),
            // Classes and escapes.
            ("[a-c].log", "b.log", false, true),
            ("[a-c].log", "d.log", false, false),
            ("[^a-c].log", "d.log", false, true),
            ("[^a-c].log", "a.log", false, false),
            ("[]].txt", "].txt", false, true),
            ("file[0-9]", "file7", false, true),
            ("\\*.txt", "*.txt", false, true),
            ("\\*.txt", "a.txt", false, false),
            ("\\#x", "#x", false, true),
            // Queries are cleaned.
            ("a/b", "./a/b", false, true),
            ("a/b", "/a//b/", false, true),
            // The root is never ignored.
            ("*", ".", true, false),
            ("*", "", true, false),
            // No rule: kept.
            ("", "x", false, false),
            ("*.md", "README.txt", false, false),
            ("Dockerfile.*", "Dockerfile", false, false),
        ];
        for (patterns, path, is_dir, want) in cases {
            assert_eq!(
                ig(patterns).is_ignored(path, *is_dir),
                *want,
                "patterns {patterns:?}, path {path:?} (dir: {is_dir})"
            );
        }
    }

    #[test]
    fn directory_excluded_with_exception_beneath() {
        let i = ig("build\n!build/keep/**\n!build/notes.txt");
        // The directory is excluded, but the walk must go in.
        assert!(i.matches("build"));
        assert!(!i.is_ignored("build", true));
        assert!(i.is_ignored("build/tmp.o", false));
        assert!(!i.is_ignored("build/notes.txt", false));
        assert!(!i.is_ignored("build/keep", true));
        assert!(!i.is_ignored("build/keep/a/b", false));
        // A directory beside the exception can be skipped whole.
        assert!(i.is_ignored("build/tmp", true));
        assert!(i.is_ignored("build/tmp/x", false));
    }

    #[test]
    fn exception_directory_reincludes_contents() {
        let i = ig("docs\n!docs/api");
        assert!(!i.is_ignored("docs", true));
        assert!(i.is_ignored("docs/guide.md", false));
        assert!(!i.is_ignored("docs/api", true));
        assert!(!i.is_ignored("docs/api/index.html", false));
        // A later exclusion closes it again.
        let i = ig("docs\n!docs/api\ndocs/api/private");
        assert!(i.is_ignored("docs/api/private/key", false));
        assert!(!i.is_ignored("docs/api/public", false));
    }

    #[test]
    fn exceptions_before_the_exclusion_do_not_open_it() {
        let i = ig("!build/keep\nbuild");
        assert!(i.is_ignored("build", true));
        assert!(i.is_ignored("build/keep", false));
    }

    #[test]
    fn wildcard_exceptions_keep_the_walk_open() {
        let i = ig("vendor\n!**/LICENSE");
        assert!(!i.is_ignored("vendor", true));
        assert!(i.is_ignored("vendor/lib.go", false));
        assert!(!i.is_ignored("vendor/x/LICENSE", false));
        let i = ig("out\n!*/keep");
        assert!(!i.is_ignored("out", true));
        assert!(!i.is_ignored("out/keep", false));
        // An exception that cannot reach under `out/sub` lets the walk skip it.
        assert!(i.is_ignored("out/sub", true));
        // An exception at the excluded directory's own depth does not keep it open.
        let i = ig("cache\n!src");
        assert!(i.is_ignored("cache", true));
    }

    #[test]
    fn everything_but() {
        let i = ig("*\n!src\n!Cargo.toml");
        assert!(i.is_ignored("target", true));
        assert!(i.is_ignored("README.md", false));
        assert!(!i.is_ignored("src", true));
        assert!(!i.is_ignored("src/lib.rs", false));
        assert!(!i.is_ignored("Cargo.toml", false));
    }

    #[test]
    fn bad_patterns_name_their_line() {
        let cases = [
            ("ok\n[abc", 2, "unterminated [ class"),
            ("a\\", 1, "trailing backslash"),
            ("x\n\n!", 3, "\"!\" without a pattern"),
            ("[z-a]", 1, "bad range in [ class"),
        ];
        for (text, line, message) in cases {
            let e = Ignore::parse(text).expect_err(text);
            assert_eq!((e.line, e.message.as_str()), (line, message), "{text:?}");
            assert!(e
                .to_string()
                .starts_with(&format!(".dockerignore line {line}: ")));
        }
    }

    #[test]
    fn crlf_and_bom() {
        let i = ig("\u{feff}*.log\r\n!keep.log\r\n");
        assert!(i.is_ignored("a.log", false));
        assert!(!i.is_ignored("keep.log", false));
    }
}

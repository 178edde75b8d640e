//! Variable substitution in Dockerfile words, as Docker's (BuildKit's) shell lexer does
//! it: `$VAR`, `${VAR}`, `${VAR:-word}`, `${VAR:+word}`, `${VAR:?msg}` (and the forms
//! without the colon, which test "set" instead of "set and not empty"), single quotes
//! (literal), double quotes (substitution, `\"` `\$` `\\` escapes), and the escape
//! character outside quotes (`\$X` is a literal `$X`). Quotes and escape characters are
//! removed from the result. An undefined variable is empty.
//!
//! This module owns only the lexer; which instruction is substituted with which
//! variables is the planner's business ([`mod@crate::plan`]).

use std::collections::BTreeMap;

/// Variables in effect for a substitution (name -> value). A name that is absent is
/// unset; a name with an empty value is set.
pub type Vars = BTreeMap<String, String>;

/// Why a word could not be substituted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubstError {
    /// `'` without its closing quote.
    #[error("unterminated single quote")]
    UnterminatedSingleQuote,
    /// `"` without its closing quote.
    #[error("unterminated double quote")]
    UnterminatedDoubleQuote,
    /// `${` without its closing `}`.
    #[error("missing '}}' in ${{...}}")]
    MissingBrace,
    /// `${}`, `${:x}`, `${{x}`.
    #[error("bad substitution")]
    BadSubstitution,
    /// A `${VAR<op>...}` operator other than `-`, `+`, `?` (with or without `:`).
    #[error("unsupported operator `{0}` in ${{...}}")]
    UnsupportedModifier(String),
    /// `${VAR:?message}` (or `${VAR?message}`) on an unset (or empty) variable.
    #[error("{name}: {message}")]
    Required {
        /// The variable.
        name: String,
        /// The message of the expression.
        message: String,
    },
}

/// Substitutes `word` as one word (Docker's `ProcessWord`): quotes are removed,
/// whitespace is kept.
pub fn expand(word: &str, vars: &Vars, escape: char) -> Result<String, SubstError> {
    let mut lx = Lexer::new(word, vars, escape);
    let (out, _) = lx.process(None)?;
    Ok(out)
}

/// Substitutes `word` and splits the result into words at whitespace that is neither
/// quoted nor escaped (Docker's `ProcessWords`, used for `EXPOSE`): `$PORTS` holding
/// `"80 443"` gives two words, `"$PORTS"` one.
pub fn expand_words(word: &str, vars: &Vars, escape: char) -> Result<Vec<String>, SubstError> {
    let mut lx = Lexer::new(word, vars, escape);
    let (_, words) = lx.process(None)?;
    Ok(words.finish())
}

/// Words being collected while lexing (for [`expand_words`]).
#[derive(Debug, Default)]
struct Words {
    done: Vec<String>,
    cur: String,
    in_word: bool,
}

impl Words {
    /// An unquoted character: whitespace ends the word.
    fn add_char(&mut self, c: char) {
        if c.is_whitespace() {
            self.end();
        } else {
            self.cur.push(c);
            self.in_word = true;
        }
    }

    /// An unquoted expansion: split like unquoted text.
    fn add_expanded(&mut self, s: &str) {
        s.chars().for_each(|c| self.add_char(c));
    }

    /// A quoted or escaped piece: never split, and `""` still makes a word.
    fn add_raw(&mut self, s: &str) {
        self.cur.push_str(s);
        self.in_word = true;
    }

    fn end(&mut self) {
        if self.in_word {
            self.done.push(std::mem::take(&mut self.cur));
            self.in_word = false;
        }
    }

    fn finish(mut self) -> Vec<String> {
        self.end();
        self.done
    }
}

struct Lexer<'a> {
    chars: Vec<char>,
    pos: usize,
    vars: &'a Vars,
    escape: char,
}

impl<'a> Lexer<'a> {
    fn new(word: &str, vars: &'a Vars, escape: char) -> Self {
        Lexer {
            chars: word.chars().collect(),
            pos: 0,
            vars,
            escape,
        }
    }

    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).copied()
    }

    fn next(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.pos += 1;
        Some(c)
    }

    /// Lexes up to the end, or up to `stop` (consumed; an error if never found).
    fn process(&mut self, stop: Option<char>) -> Result<(String, Words), SubstError> {
        let mut out = String::new();
        let mut words = Words::default();
        loop {
            let Some(c) = self.peek() else {
                if stop.is_some() {
                    return Err(SubstError::MissingBrace);
                }
                break;
            };
            if Some(c) == stop {
                self.pos += 1;
                break;
            }
            match c {
                '\'' => {
                    let s = self.single_quoted()?;
                    words.add_raw(&s);
                    out.push_str(&s);
                }
                '"' => {
                    let s = self.double_quoted()?;
                    words.add_raw(&s);
                    out.push_str(&s);
                }
                '$' => {
                    let s = self.dollar()?;
                    words.add_expanded(&s);
                    out.push_str(&s);
                }
                _ => {
                    self.pos += 1;
                    if c == self.escape {
                        // The escape character quotes the next one; alone at the end it
                        // is dropped.
                        let Some(n) = self.next() else { break };
                        words.add_raw(n.encode_utf8(&mut [0; 4]));
                        out.push(n);
                    } else {
                        words.add_char(c);
                        out.push(c);
                    }
                }
            }
        }
        Ok((out, words))
    }

    /// `'...'`: everything literal up to the next `'`.
    fn single_quoted(&mut self) -> Result<String, SubstError> {
        self.pos += 1;
        let mut s = String::new();
        loop {
            match self.next() {
                None => return Err(SubstError::UnterminatedSingleQuote),
                Some('\'') => return Ok(s),
                Some(c) => s.push(c),
            }
        }
    }

    /// `"..."`: substitutes `$`, and the escape character quotes only `"`, `$` and
    /// itself (otherwise it stays).
    fn double_quoted(&mut self) -> Result<String, SubstError> {
        self.pos += 1;
        let mut s = String::new();
        loop {
            match self.peek() {
                None => return Err(SubstError::UnterminatedDoubleQuote),
                Some('"') => {
                    self.pos += 1;
                    return Ok(s);
                }
                Some('$') => s.push_str(&self.dollar()?),
                Some(c) => {
                    self.pos += 1;
                    if c == self.escape {
                        match self.peek() {
                            Some(n) if n == '"' || n == '$' || n == self.escape => {
                                self.pos += 1;
                                s.push(n);
                            }
                            _ => s.push(c),
                        }
                    } else {
                        s.push(c);
                    }
                }
            }
        }
    }

    /// `$NAME`, `${NAME}`, `${NAME<op>word}`; the cursor is on the `$`.
    fn dollar(&mut self) -> Result<String, SubstError> {
        self.pos += 1;
        if self.peek() != Some('{') {
            let name = self.name();
            if name.is_empty() {
                return Ok("$".to_string());
            }
            return Ok(self.get(&name).unwrap_or_default());
        }
        self.pos += 1;
        match self.peek() {
            None => return Err(SubstError::MissingBrace),
            Some('{' | '}' | ':') => return Err(SubstError::BadSubstitution),
            Some(_) => {}
        }
        let name = self.name();
        let (colon, op) = match self.next() {
            None => return Err(SubstError::MissingBrace),
            Some('}') => return Ok(self.get(&name).unwrap_or_default()),
            Some(':') => match self.next() {
                None => return Err(SubstError::MissingBrace),
                Some(op) => (true, op),
            },
            Some(op) => (false, op),
        };
        if !matches!(op, '-' | '+' | '?') {
            let op = if colon {
                format!(":{op}")
            } else {
                op.to_string()
            };
            return Err(SubstError::UnsupportedModifier(op));
        }
        let (word, _) = self.process(Some('}'))?;
        let value = self.get(&name);
        // With the colon an empty value counts as unset.
        let set = match &value {
            Some(v) => !colon || !v.is_empty(),
            None => false,
        };
        Ok(match op {
            '-' if set => value.unwrap_or_default(),
            '-' => word,
            '+' if set => word,
            '+' => String::new(),
            _ if set => value.unwrap_or_default(),
            _ => {
                let message = if word.is_empty() {
                    "is not set".to_string()
                } else {
                    word
                };
                return Err(SubstError::Required { name, message });
            }
        })
    }

    /// A variable name: letters, digits and `_`; or a positional (`$1`) or special
    /// parameter (`$@`, `$$`, ...), which Docker never defines.
    fn name(&mut self) -> String {
        let mut name = String::new();
        match self.peek() {
            Some(c) if c.is_ascii_digit() => {
                while let Some(d) = self.peek().filter(char::is_ascii_digit) {
                    name.push(d);
                    self.pos += 1;
                }
                return name;
            }
            Some(c @ ('@' | '*' | '#' | '?' | '-' | '$' | '!')) => {
                self.pos += 1;
                name.push(c);
                return name;
            }
            _ => {}
        }
        while let Some(c) = self.peek().filter(|c| c.is_alphanumeric() || *c == '_') {
            name.push(c);
            self.pos += 1;
        }
        name
    }

    fn get(&self, name: &str) -> Option<String> {
        self.vars.get(name).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars() -> Vars {
        [
            ("A", "alpha"),
            ("EMPTY", ""),
            ("SP", "x  y"),
            ("PORTS", "80 443/udp"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    #[test]
    fn expands_like_docker() {
        let cases: &[(&str, &str)] = &[
            ("plain", "plain"),
            ("$A", "alpha"),
            ("${A}", "alpha"),
            ("${A}beta", "alphabeta"),
            ("$Abeta", ""),
            ("pre-$A-post", "pre-alpha-post"),
            ("$UNDEFINED", ""),
            ("${UNDEFINED}", ""),
            ("a${UNDEFINED}b", "ab"),
            ("${A:-d}", "alpha"),
            ("${X:-d}", "d"),
            ("${EMPTY:-d}", "d"),
            ("${EMPTY-d}", ""),
            ("${X-d}", "d"),
            ("${A:+b}", "b"),
            ("${X:+b}", ""),
            ("${EMPTY:+b}", ""),
            ("${EMPTY+b}", "b"),
            ("${X+b}", ""),
            ("${A:?must}", "alpha"),
            ("${X:-$A}", "alpha"),
            ("${X:-${Y:-deep}}", "deep"),
            ("${X:-a b}", "a b"),
            ("${X:-\"q}\"}", "q}"),
            ("${X:-a\\}b}", "a}b"),
            ("\\$A", "$A"),
            ("\\${A}", "${A}"),
            ("\\\\$A", "\\alpha"),
            ("a\\ b", "a b"),
            ("trailing\\", "trailing"),
            ("'$A'", "$A"),
            ("'a\\b'", "a\\b"),
            ("\"$A\"", "alpha"),
            ("\"\\$A\"", "$A"),
            ("\"a\\\"b\"", "a\"b"),
            ("\"a\\nb\"", "a\\nb"),
            ("\"a\\\\b\"", "a\\b"),
            ("\"x y\"", "x y"),
            ("\"\"", ""),
            ("$", "$"),
            ("a$", "a$"),
            ("$-", ""),
            ("$1", ""),
            ("$12x", "x"),
            ("${1}", ""),
            ("$$", ""),
            ("100%", "100%"),
            ("$SP", "x  y"),
            ("é$A", "éalpha"),
        ];
        for (input, want) in cases {
            assert_eq!(
                expand(input, &vars(), '\\').as_deref(),
                Ok(*want),
                "input {input:?}"
            );
        }
    }

    #[test]
    fn backtick_escape() {
        let v = vars();
        assert_eq!(expand("`$A", &v, '`').as_deref(), Ok("$A"));
        assert_eq!(
            expand("C:\\dir\\$A", &v, '`').as_deref(),
            Ok("C:\\dir\\alpha")
        );
        assert_eq!(expand("\"`\"\"", &v, '`').as_deref(), Ok("\""));
    }

    #[test]
    fn errors() {
        let cases: &[(&str, SubstError)] = &[
            ("'open", SubstError::UnterminatedSingleQuote),
            ("\"open", SubstError::UnterminatedDoubleQuote),
            ("\"open\\", SubstError::UnterminatedDoubleQuote),
            ("${", SubstError::MissingBrace),
            ("${A", SubstError::MissingBrace),
            ("${A:", SubstError::MissingBrace),
            ("${A:-x", SubstError::MissingBrace),
            ("${}", SubstError::BadSubstitution),
            ("${:a}", SubstError::BadSubstitution),
            ("${{A}}", SubstError::BadSubstitution),
            ("${A#x}", SubstError::UnsupportedModifier("#".into())),
            ("${A:=x}", SubstError::UnsupportedModifier(":=".into())),
            (
                "${X:?needed}",
                SubstError::Required {
                    name: "X".into(),
                    message: "needed".into(),
                },
            ),
            (
                "${EMPTY:?}",
                SubstError::Required {
                    name: "EMPTY".into(),
                    message: "is not set".into(),
                },
            ),
            (
                "${X?}",
                SubstError::Required {
                    name: "X".into(),
                    message: "is not set".into(),
                },
            ),
        ];
        for (input, want) in cases {
            assert_eq!(
                expand(input, &vars(), '\\').as_ref(),
                Err(want),
                "input {input:?}"
            );
        }
        // `${EMPTY?}` tests only "set".
        assert_eq!(expand("${EMPTY?}", &vars(), '\\').as_deref(), Ok(""));
    }

    #[test]
    fn words() {
        let cases: &[(&str, &[&str])] = &[
            ("$PORTS", &["80", "443/udp"]),
            ("\"$PORTS\"", &["80 443/udp"]),
            ("8080 $PORTS", &["8080", "80", "443/udp"]),
            ("a\\ b c", &["a b", "c"]),
            ("\"\"", &[""]),
            ("$UNDEFINED", &[]),
            ("  ", &[]),
            ("x${A}y", &["xalphay"]),
        ];
        for (input, want) in cases {
            assert_eq!(
                expand_words(input, &vars(), '\\'),
                Ok(want.iter().map(|s| s.to_string()).collect::<Vec<_>>()),
                "input {input:?}"
            );
        }
    }
}

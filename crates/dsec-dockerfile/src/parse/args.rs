//! Arguments of single instructions: leading `--flags`, exec (JSON) vs shell forms,
//! heredoc detection, Docker's word splitting, `ARG`/`ENV`/`LABEL` lists, COPY/ADD and
//! HEALTHCHECK arguments. Values stay as written; [`super`] decides what each
//! instruction takes.

use super::{ArgDecl, Command, CopyArgs, Healthcheck, Raw};
use crate::ErrorKind;

/// Leading `--flag` words (Docker's `extractBuilderFlags`): quotes in them are removed,
/// `--` alone ends them.
pub(super) fn extract_flags(line: &str, escape: char) -> (Vec<String>, &str) {
    let mut flags = Vec::new();
    let mut rest = line;
    loop {
        let t = rest.trim_start();
        if !t.starts_with("--") {
            return (flags, t);
        }
        let mut word = String::new();
        let mut quote = None;
        let mut end = t.len();
        let mut chars = t.char_indices();
        while let Some((i, c)) = chars.next() {
            match quote {
                None if c.is_whitespace() => {
                    end = i;
                    break;
                }
                None if c == '"' || c == '\'' => quote = Some(c),
                Some(q) if c == q => quote = None,
                _ if c == escape => {
                    if let Some((_, n)) = chars.next() {
                        word.push(n);
                    }
                }
                _ => word.push(c),
            }
        }
        rest = &t[end..];
        if word == "--" {
            return (flags, rest.trim_start());
        }
        flags.push(word.trim_start_matches('-').to_string());
    }
}

/// How a flag takes its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FlagType {
    /// `--name=value`
    Str,
    /// `--name`, `--name=true|false`
    Bool,
}

/// Checks `flags` against `known` (name, type) and returns the values by name (a
/// `Bool` flag that is set has the value `"true"`).
pub(super) fn check_flags(
    keyword: &str,
    flags: &[String],
    known: &[(&str, FlagType)],
) -> Result<Vec<(String, String)>, ErrorKind> {
    let mut out: Vec<(String, String)> = Vec::new();
    for f in flags {
        let (name, value) = match f.split_once('=') {
            Some((n, v)) => (n, Some(v)),
            None => (f.as_str(), None),
        };
        let Some((_, ty)) = known.iter().find(|(k, _)| *k == name) else {
            return Err(ErrorKind::UnknownFlag {
                instruction: keyword.to_string(),
                flag: name.to_string(),
            });
        };
        if out.iter().any(|(n, _)| n == name) {
            return Err(ErrorKind::Syntax(format!("duplicate flag --{name}")));
        }
        let value = match (ty, value) {
            (FlagType::Str, Some(v)) => v.to_string(),
            (FlagType::Str, None) => {
                return Err(ErrorKind::Syntax(format!("flag --{name} needs a value")))
            }
            (FlagType::Bool, None) => "true".to_string(),
            (FlagType::Bool, Some(v)) if v.eq_ignore_ascii_case("true") => "true".to_string(),
            (FlagType::Bool, Some(v)) if v.eq_ignore_ascii_case("false") => "false".to_string(),
            (FlagType::Bool, Some(v)) => {
                return Err(ErrorKind::Invalid(format!(
                    "flag --{name} takes true or false, not {v:?}"
                )))
            }
        };
        out.push((name.to_string(), value));
    }
    Ok(out)
}

pub(super) fn flag(flags: &[(String, String)], name: &str) -> Option<String> {
    flags
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.clone())
}

/// `[...]` as a JSON array of strings, else `None`.
pub(super) fn json_array(rest: &str) -> Option<Vec<String>> {
    if !rest.starts_with('[') {
        return None;
    }
    serde_json::from_str(rest).ok()
}

/// RUN/CMD/ENTRYPOINT arguments: a JSON array of strings is the exec form, anything else
/// the shell form (like Docker, which also takes a broken JSON array as a shell command:
/// that gets a warning).
pub(super) fn parse_command(
    kw: &str,
    rest: &str,
    warn: &mut impl FnMut(String),
) -> Result<Command, ErrorKind> {
    if rest.is_empty() {
        return Err(ErrorKind::MissingArguments(kw.to_string()));
    }
    if let Some(argv) = json_array(rest) {
        return Ok(Command::Exec(argv));
    }
    if rest.starts_with('[') {
        warn(format!(
            "{kw} is not a valid JSON array of strings, so it runs as a shell command"
        ));
    }
    Ok(Command::Shell(rest.to_string()))
}

/// Whether a shell command has a heredoc (`<<EOF`, `<<-EOF`, `<<'EOF'`, `2<<EOF`) at the
/// start of an unquoted word; `<<<` (a here-string) is not one.
pub(super) fn has_heredoc(s: &str) -> bool {
    let cs: Vec<char> = s.chars().collect();
    let mut quote: Option<char> = None;
    let mut word_start = true;
    let mut i = 0;
    while i < cs.len() {
        let c = cs[i];
        if let Some(q) = quote {
            if c == q {
                quote = None;
            } else if c == '\\' && q == '"' {
                i += 1;
            }
            i += 1;
            continue;
        }
        if c.is_whitespace() {
            word_start = true;
            i += 1;
            continue;
        }
        if word_start {
            let mut j = i;
            while cs.get(j).is_some_and(char::is_ascii_digit) {
                j += 1;
            }
            if cs.get(j) == Some(&'<') && cs.get(j + 1) == Some(&'<') {
                let mut k = j + 2;
                if cs.get(k) == Some(&'-') {
                    k += 1;
                }
                if cs.get(k).is_some_and(|c| *c != '<' && !c.is_whitespace()) {
                    return true;
                }
            }
        }
        word_start = false;
        match c {
            '\'' | '"' => quote = Some(c),
            '\\' => i += 1,
            _ => {}
        }
        i += 1;
    }
    false
}

/// Splits at unquoted whitespace, keeping quotes and escapes (Docker's `parseWords`).
pub(super) fn words(rest: &str, escape: char) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut quote: Option<char> = None;
    let mut chars = rest.chars().peekable();
    while let Some(c) = chars.next() {
        match quote {
            None if c.is_whitespace() => {
                if in_word {
                    out.push(std::mem::take(&mut word));
                    in_word = false;
                }
                continue;
            }
            None => {
                if c == '"' || c == '\'' {
                    quote = Some(c);
                }
            }
            Some(q) if c == q => quote = None,
            Some(_) => {}
        }
        in_word = true;
        word.push(c);
        if c == escape && quote != Some('\'') {
            match chars.next() {
                Some(n) => word.push(n),
                // An escape character at the very end is dropped.
                None => {
                    word.pop();
                }
            }
        }
    }
    if in_word {
        out.push(word);
    }
    out
}

/// `ARG NAME[=DEFAULT] ...`
pub(super) fn parse_args(rest: &str, escape: char) -> Result<Vec<ArgDecl>, ErrorKind> {
    let ws = words(rest, escape);
    if ws.is_empty() {
        return Err(ErrorKind::MissingArguments("ARG".into()));
    }
    ws.into_iter()
        .map(|w| {
            let (name, default) = match w.split_once('=') {
                Some((n, d)) => (n.to_string(), Some(d.to_string())),
                None => (w, None),
            };
            if name.is_empty() {
                return Err(ErrorKind::Syntax("ARG needs a name before '='".into()));
            }
            Ok(ArgDecl { name, default })
        })
        .collect()
}

/// `ENV`/`LABEL` arguments: `k=v k2="v 2"`, or the legacy `k v w` (one key, the rest of
/// the line its value).
pub(super) fn parse_key_values(
    kw: &str,
    rest: &str,
    escape: char,
) -> Result<Vec<(String, String)>, ErrorKind> {
    let ws = words(rest, escape);
    let Some(first) = ws.first() else {
        return Err(ErrorKind::MissingArguments(kw.to_string()));
    };
    if !first.contains('=') {
        return match rest.split_once(char::is_whitespace) {
            Some((k, v)) => Ok(vec![(k.to_string(), v.trim_start().to_string())]),
            None => Err(ErrorKind::Syntax(format!(
                "{kw} needs NAME=VALUE (or NAME VALUE)"
            ))),
        };
    }
    ws.iter()
        .map(|w| match w.split_once('=') {
            Some(("", _)) => Err(ErrorKind::Syntax(format!("{kw} names cannot be empty"))),
            Some((k, v)) => Ok((k.to_string(), v.to_string())),
            None => Err(ErrorKind::Syntax(format!(
                "{kw}: no '=' in {w:?}; use NAME=VALUE for every pair"
            ))),
        })
        .collect()
}

/// COPY/ADD flags and sources + destination (JSON array or whitespace-separated).
pub(super) fn parse_copy(kw: &str, flags: &[String], rest: &str) -> Result<CopyArgs, ErrorKind> {
    for f in flags {
        let name = f.split_once('=').map_or(f.as_str(), |(n, _)| n);
        match (kw, name) {
            ("ADD", "checksum") => {
                return Err(ErrorKind::Unsupported(
                    "ADD --checksum (ADD takes only local sources)".into(),
                ))
            }
            ("ADD", "keep-git-dir") => {
                return Err(ErrorKind::Unsupported("ADD of a git repository".into()))
            }
            (_, "parents" | "exclude") => {
                return Err(ErrorKind::Unsupported(format!("{kw} --{name}")))
            }
            _ => {}
        }
    }
    let mut known = vec![
        ("chown", FlagType::Str),
        ("chmod", FlagType::Str),
        // Only changes how BuildKit stacks the layer, not its content.
        ("link", FlagType::Bool),
    ];
    if kw == "COPY" {
        known.push(("from", FlagType::Str));
    }
    let flags = check_flags(kw, flags, &known)?;
    let mut items = match json_array(rest) {
        Some(items) => items,
        None => {
            let items: Vec<String> = rest.split_whitespace().map(str::to_string).collect();
            if items.iter().any(|i| i.starts_with("<<")) {
                return Err(ErrorKind::Unsupported(format!("a heredoc (<<EOF) in {kw}")));
            }
            items
        }
    };
    if items.len() < 2 {
        return Err(ErrorKind::Syntax(format!(
            "{kw} needs at least one source and a destination"
        )));
    }
    let dest = items.pop().unwrap_or_default();
    Ok(CopyArgs {
        from: flag(&flags, "from"),
        chown: flag(&flags, "chown"),
        chmod: flag(&flags, "chmod"),
        sources: items,
        dest,
    })
}

/// `HEALTHCHECK [flags] CMD command` or `HEALTHCHECK NONE`.
pub(super) fn parse_healthcheck(
    raw: &Raw,
    warn: &mut impl FnMut(String),
) -> Result<Healthcheck, ErrorKind> {
    let kw = "HEALTHCHECK";
    let flags = check_flags(
        kw,
        &raw.flags,
        &[
            ("interval", FlagType::Str),
            ("timeout", FlagType::Str),
            ("start-period", FlagType::Str),
            ("start-interval", FlagType::Str),
            ("retries", FlagType::Str),
        ],
    )?;
    let (word, rest) = raw
        .rest
        .split_once(char::is_whitespace)
        .unwrap_or((raw.rest.as_str(), ""));
    let rest = rest.trim();
    let test = match word.to_ascii_uppercase().as_str() {
        "" => return Err(ErrorKind::MissingArguments(kw.into())),
        "NONE" => {
            if !flags.is_empty() || !rest.is_empty() {
                return Err(ErrorKind::Syntax(
                    "HEALTHCHECK NONE takes no flags or arguments".into(),
                ));
            }
            vec!["NONE".to_string()]
        }
        "CMD" => match parse_command("HEALTHCHECK CMD", rest, warn)? {
            Command::Exec(argv) if argv.is_empty() => {
                return Err(ErrorKind::MissingArguments("HEALTHCHECK CMD".into()))
            }
            Command::Exec(argv) => std::iter::once("CMD".to_string()).chain(argv).collect(),
            Command::Shell(s) => vec!["CMD-SHELL".to_string(), s],
        },
        other => {
            return Err(ErrorKind::Syntax(format!(
                "HEALTHCHECK takes CMD or NONE, not {other:?}"
            )))
        }
    };
    let duration = |name: &str| -> Result<Option<u64>, ErrorKind> {
        flag(&flags, name)
            .map(|v| {
                parse_duration(&v).ok_or_else(|| {
                    ErrorKind::Invalid(format!("--{name}: {v:?} is not a duration like 30s"))
                })
            })
            .transpose()
    };
    let retries = flag(&flags, "retries")
        .map(|v| {
            v.parse::<u32>().map_err(|_| {
                ErrorKind::Invalid(format!("--retries: {v:?} is not a non-negative number"))
            })
        })
        .transpose()?;
    Ok(Healthcheck {
        test,
        interval_ns: duration("interval")?,
        timeout_ns: duration("timeout")?,
        start_period_ns: duration("start-period")?,
        start_interval_ns: duration("start-interval")?,
        retries,
    })
}

/// A non-negative Go duration (`1h30m`, `1.5s`, `500ms`, `0`) in nanoseconds.
pub(crate) fn parse_duration(s: &str) -> Option<u64> {
    if s == "0" {
        return Some(0);
    }
    let mut total: f64 = 0.0;
    let mut rest = s;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (num, after) = rest.split_at(num_len);
        if num.is_empty() || num == "." {
            return None;
        }
        let n: f64 = num.parse().ok()?;
        let unit_len = after
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(after.len());
        let (unit, after) = after.split_at(unit_len);
        let scale = match unit {
            "ns" => 1.0,
            "us" | "µs" | "μs" => 1e3,
            "ms" => 1e6,
            "s" => 1e9,
            "m" => 60e9,
            "h" => 3600e9,
            _ => return None,
        };
        total += n * scale;
        rest = after;
    }
    (total <= u64::MAX as f64).then_some(total.round() as u64)
}

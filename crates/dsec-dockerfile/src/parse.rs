//! Dockerfile text -> [`Dockerfile`]: parser directives (`# escape=`), comments, line
//! continuations, instruction names (any case), `--flags`, exec (JSON) vs shell forms and
//! `key=value` lists, following Docker's (BuildKit's) parser. Values stay unsubstituted:
//! substitution needs the build args, so it belongs to [`mod@crate::plan`].
//!
//! What dsec cannot build is refused here, with the line: ONBUILD, RUN flags (`--mount`,
//! `--network`...), heredocs, unknown instructions and flags. VOLUME and MAINTAINER are
//! accepted with no effect and reported as [`Warning`]s.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::{DockerfileError, ErrorKind, Warning};

/// A parsed Dockerfile.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dockerfile {
    /// The escape character: `\`, or `` ` `` with `# escape=``.
    pub escape: char,
    /// `ARG`s before the first `FROM` (usable in `FROM` lines; each is an
    /// [`InstructionKind::Arg`]).
    pub global_args: Vec<Instruction>,
    /// The stages, in file order (at least one).
    pub stages: Vec<Stage>,
    /// Accepted instructions that have no effect (VOLUME, MAINTAINER) or look wrong.
    pub warnings: Vec<Warning>,
}

/// One `FROM` and the instructions up to the next one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stage {
    /// Line of the `FROM`.
    pub line: usize,
    /// Text of the `FROM` instruction.
    pub text: String,
    /// The base: an image reference or an earlier stage's name (unsubstituted).
    pub image: String,
    /// `AS name`, lowercased.
    pub name: Option<String>,
    /// `--platform=...` (unsubstituted).
    pub platform: Option<String>,
    /// The stage's instructions after its `FROM`.
    pub instructions: Vec<Instruction>,
}

/// One instruction.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Instruction {
    /// 1-based line where it starts.
    pub line: usize,
    /// Its text, continuation lines joined (for messages).
    pub text: String,
    /// What it says.
    pub kind: InstructionKind,
}

/// What an instruction says; strings are as written (unsubstituted).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum InstructionKind {
    /// `ARG NAME[=DEFAULT] ...`
    Arg(Vec<ArgDecl>),
    /// `ENV k=v ...` or `ENV k v`.
    Env(Vec<(String, String)>),
    /// `LABEL k=v ...`
    Label(Vec<(String, String)>),
    /// `RUN ...`
    Run(Command),
    /// `CMD ...`
    Cmd(Command),
    /// `ENTRYPOINT ...`
    Entrypoint(Command),
    /// `SHELL ["exe", "arg"...]`
    Shell(Vec<String>),
    /// `WORKDIR path`
    Workdir(String),
    /// `USER user[:group]`
    User(String),
    /// `COPY [--from] [--chown] [--chmod] src... dest`
    Copy(CopyArgs),
    /// `ADD [--chown] [--chmod] src... dest` (local sources; tars are extracted).
    Add(CopyArgs),
    /// `EXPOSE port[/proto] ...`
    Expose(Vec<String>),
    /// `STOPSIGNAL signal`
    StopSignal(String),
    /// `HEALTHCHECK ...` (kept as image metadata).
    Healthcheck(Healthcheck),
}

/// One name of an `ARG`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArgDecl {
    /// The variable.
    pub name: String,
    /// Its default (unsubstituted), if any.
    pub default: Option<String>,
}

/// A command of RUN, CMD or ENTRYPOINT.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// JSON form: run as is, no shell, no substitution.
    Exec(Vec<String>),
    /// Shell form: given to the `SHELL` in effect (`/bin/sh -c` by default).
    Shell(String),
}

/// Arguments of COPY and ADD (unsubstituted).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyArgs {
    /// `--from=STAGE|INDEX|IMAGE` (COPY only).
    pub from: Option<String>,
    /// `--chown=user[:group]`
    pub chown: Option<String>,
    /// `--chmod=MODE` (octal)
    pub chmod: Option<String>,
    /// Sources, at least one.
    pub sources: Vec<String>,
    /// Destination.
    pub dest: String,
}

/// A `HEALTHCHECK`, as the image config holds it (Docker's `Healthcheck`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Healthcheck {
    /// `["NONE"]`, `["CMD", argv...]` or `["CMD-SHELL", command]`.
    pub test: Vec<String>,
    /// `--interval`, in nanoseconds.
    pub interval_ns: Option<u64>,
    /// `--timeout`, in nanoseconds.
    pub timeout_ns: Option<u64>,
    /// `--start-period`, in nanoseconds.
    pub start_period_ns: Option<u64>,
    /// `--start-interval`, in nanoseconds.
    pub start_interval_ns: Option<u64>,
    /// `--retries`.
    pub retries: Option<u32>,
}

/// Every Dockerfile instruction name (those dsec refuses included).
const INSTRUCTIONS: [&str; 18] = [
    "ADD",
    "ARG",
    "CMD",
    "COPY",
    "ENTRYPOINT",
    "ENV",
    "EXPOSE",
    "FROM",
    "HEALTHCHECK",
    "LABEL",
    "MAINTAINER",
    "ONBUILD",
    "RUN",
    "SHELL",
    "STOPSIGNAL",
    "USER",
    "VOLUME",
    "WORKDIR",
];

/// Parses Dockerfile text. Errors name the line of the offending instruction.
pub fn parse(text: &str) -> Result<Dockerfile, DockerfileError> {
    let (escape, lines) = logical_lines(text)?;
    let mut df = Dockerfile {
        escape,
        global_args: Vec::new(),
        stages: Vec::new(),
        warnings: Vec::new(),
    };
    let mut names = BTreeSet::new();
    for l in lines {
        let err = |kind| DockerfileError::at(l.line, &l.text, kind);
        let raw = split_instruction(&l.text, escape).map_err(err)?;
        if raw.keyword == "FROM" {
            let stage = parse_from(&raw, &l).map_err(err)?;
            if let Some(name) = &stage.name {
                if !names.insert(name.clone()) {
                    return Err(err(ErrorKind::Stage(format!(
                        "duplicate stage name {name:?}"
                    ))));
                }
            }
            df.stages.push(stage);
            continue;
        }
        if df.stages.is_empty()
            && raw.keyword != "ARG"
            && INSTRUCTIONS.contains(&raw.keyword.as_str())
        {
            return Err(err(ErrorKind::BeforeFrom(raw.keyword)));
        }
        let kind = parse_instruction(&raw, escape, l.line, &mut df.warnings).map_err(err)?;
        let Some(kind) = kind else { continue };
        let instr = Instruction {
            line: l.line,
            text: l.text.clone(),
            kind,
        };
        match df.stages.last_mut() {
            Some(stage) => stage.instructions.push(instr),
            None => df.global_args.push(instr),
        }
    }
    if df.stages.is_empty() {
        return Err(DockerfileError::NoFrom);
    }
    Ok(df)
}

/// One instruction with its continuation lines joined.
#[derive(Debug)]
struct Logical {
    line: usize,
    text: String,
}

/// Splits the text into instructions: reads the parser directives at the top, drops
/// comments and blank lines, joins continuation lines (escape character at the end of a
/// line; comment and blank lines inside a continuation are skipped, as Docker does).
fn logical_lines(text: &str) -> Result<(char, Vec<Logical>), DockerfileError> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let lines: Vec<&str> = text
        .split('\n')
        .map(|l| l.strip_suffix('\r').unwrap_or(l))
        .collect();
    let mut escape = '\\';
    let mut seen = BTreeSet::new();
    let mut directives = true;
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let (line, raw) = (i + 1, lines[i]);
        i += 1;
        if directives {
            match directive(raw) {
                Some((name, value)) => {
                    let err = |m: String| DockerfileError::at(line, raw, ErrorKind::Directive(m));
                    if !seen.insert(name.clone()) {
                        return Err(err(format!("only one {name} directive may be used")));
                    }
                    if name == "escape" {
                        escape = match value.as_str() {
                            "\\" => '\\',
                            "`" => '`',
                            _ => return Err(err(format!("escape must be ` or \\, not {value:?}"))),
                        };
                    }
                    continue;
                }
                None => directives = false,
            }
        }
        let t = raw.trim_start();
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        let (first, mut cont) = continuation(t, escape);
        let mut acc = first.to_string();
        while cont && i < lines.len() {
            let next = lines[i];
            i += 1;
            let nt = next.trim_start();
            if nt.is_empty() || nt.starts_with('#') {
                continue;
            }
            let (piece, c) = continuation(next, escape);
            acc.push_str(piece);
            cont = c;
        }
        acc = acc.trim().to_string();
        if !acc.is_empty() {
            out.push(Logical { line, text: acc });
        }
    }
    Ok((escape, out))
}

/// `# name=value` with a known directive name (lowercased), else `None` (which ends the
/// directives, as an unknown one does in Docker).
fn directive(line: &str) -> Option<(String, String)> {
    let rest = line.strip_prefix('#')?.trim_start_matches([' ', '\t']);
    let name_len = rest
        .char_indices()
        .find(|(i, c)| !(c.is_ascii_alphabetic() || (*i > 0 && c.is_ascii_digit())))
        .map_or(rest.len(), |(i, _)| i);
    let (name, rest) = rest.split_at(name_len);
    let value = rest
        .trim_start_matches([' ', '\t'])
        .strip_prefix('=')?
        .trim_matches([' ', '\t']);
    let name = name.to_ascii_lowercase();
    let known = matches!(name.as_str(), "escape" | "syntax" | "check");
    (known && !value.is_empty()).then(|| (name, value.to_string()))
}

/// The line without a trailing escape character (and the blanks after it), and whether
/// it had one.
fn continuation(line: &str, escape: char) -> (&str, bool) {
    let t = line.trim_end_matches([' ', '\t']);
    match t.strip_suffix(escape) {
        Some(s) => (s, true),
        None => (line, false),
    }
}

/// An instruction split into keyword, flags and the rest.
#[derive(Debug)]
struct Raw {
    /// Uppercased.
    keyword: String,
    /// `--name[=value]` words, without the `--`, quotes removed.
    flags: Vec<String>,
    rest: String,
}

fn split_instruction(text: &str, escape: char) -> Result<Raw, ErrorKind> {
    let (word, rest) = text.split_once(char::is_whitespace).unwrap_or((text, ""));
    let keyword = word.to_ascii_uppercase();
    let (flags, rest) = extract_flags(rest, escape);
    Ok(Raw {
        keyword,
        flags,
        rest: rest.trim().to_string(),
    })
}

/// Leading `--flag` words (Docker's `extractBuilderFlags`): quotes in them are removed,
/// `--` alone ends them.
fn extract_flags(line: &str, escape: char) -> (Vec<String>, &str) {
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
enum FlagType {
    /// `--name=value`
    Str,
    /// `--name`, `--name=true|false`
    Bool,
}

/// Checks `flags` against `known` (name, type) and returns the values by name (a
/// `Bool` flag that is set has the value `"true"`).
fn check_flags(
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

fn flag(flags: &[(String, String)], name: &str) -> Option<String> {
    flags
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.clone())
}

fn parse_from(raw: &Raw, l: &Logical) -> Result<Stage, ErrorKind> {
    let flags = check_flags("FROM", &raw.flags, &[("platform", FlagType::Str)])?;
    let words: Vec<&str> = raw.rest.split_whitespace().collect();
    let (image, name) = match words.as_slice() {
        [] => return Err(ErrorKind::MissingArguments("FROM".into())),
        [image] => (*image, None),
        [image, as_, name] if as_.eq_ignore_ascii_case("as") => (*image, Some(*name)),
        _ => {
            return Err(ErrorKind::Syntax(
                "FROM takes IMAGE or IMAGE AS NAME".to_string(),
            ))
        }
    };
    let name = match name {
        Some(n) => {
            let n = n.to_ascii_lowercase();
            if !valid_stage_name(&n) {
                return Err(ErrorKind::Stage(format!(
                    "invalid stage name {n:?}: it must start with a letter and have only \
                     letters, digits, '-', '_' and '.'"
                )));
            }
            Some(n)
        }
        None => None,
    };
    Ok(Stage {
        line: l.line,
        text: l.text.clone(),
        image: image.to_string(),
        name,
        platform: flag(&flags, "platform"),
        instructions: Vec::new(),
    })
}

/// Docker's stage-name rule: `^[a-z][a-z0-9-_.]*$`.
fn valid_stage_name(n: &str) -> bool {
    let mut cs = n.chars();
    cs.next().is_some_and(|c| c.is_ascii_lowercase())
        && cs.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "-_.".contains(c))
}

/// Parses one instruction other than FROM; `None` for the ones with no effect (which
/// leave a warning).
fn parse_instruction(
    raw: &Raw,
    escape: char,
    line: usize,
    warnings: &mut Vec<Warning>,
) -> Result<Option<InstructionKind>, ErrorKind> {
    let kw = raw.keyword.as_str();
    let rest = raw.rest.as_str();
    let no_flags = || check_flags(kw, &raw.flags, &[]);
    let non_empty = || {
        if rest.is_empty() {
            Err(ErrorKind::MissingArguments(kw.to_string()))
        } else {
            Ok(rest.to_string())
        }
    };
    let mut warn = |message: String| {
        warnings.push(Warning {
            line: Some(line),
            message,
        })
    };
    let kind = match kw {
        "ARG" => {
            no_flags()?;
            InstructionKind::Arg(parse_args(rest, escape)?)
        }
        "ENV" => {
            no_flags()?;
            InstructionKind::Env(parse_key_values(kw, rest, escape)?)
        }
        "LABEL" => {
            no_flags()?;
            InstructionKind::Label(parse_key_values(kw, rest, escape)?)
        }
        "RUN" => {
            if let Some(f) = raw.flags.first() {
                let name = f.split_once('=').map_or(f.as_str(), |(n, _)| n);
                return Err(ErrorKind::Unsupported(format!("RUN --{name}")));
            }
            let cmd = parse_command(kw, rest, &mut warn)?;
            match &cmd {
                Command::Exec(argv) if argv.is_empty() => {
                    return Err(ErrorKind::MissingArguments(kw.to_string()))
                }
                Command::Shell(s) if has_heredoc(s) => {
                    return Err(ErrorKind::Unsupported("a heredoc (<<EOF) in RUN".into()))
                }
                _ => {}
            }
            InstructionKind::Run(cmd)
        }
        "CMD" => {
            no_flags()?;
            InstructionKind::Cmd(parse_command(kw, rest, &mut warn)?)
        }
        "ENTRYPOINT" => {
            no_flags()?;
            InstructionKind::Entrypoint(parse_command(kw, rest, &mut warn)?)
        }
        "SHELL" => {
            no_flags()?;
            non_empty()?;
            match json_array(rest) {
                Some(argv) if !argv.is_empty() => InstructionKind::Shell(argv),
                _ => {
                    return Err(ErrorKind::Syntax(
                        "SHELL takes a non-empty JSON array, e.g. [\"/bin/bash\", \"-c\"]".into(),
                    ))
                }
            }
        }
        "WORKDIR" => {
            no_flags()?;
            InstructionKind::Workdir(non_empty()?)
        }
        "USER" => {
            no_flags()?;
            InstructionKind::User(non_empty()?)
        }
        "STOPSIGNAL" => {
            no_flags()?;
            InstructionKind::StopSignal(non_empty()?)
        }
        "EXPOSE" => {
            no_flags()?;
            non_empty()?;
            InstructionKind::Expose(rest.split_whitespace().map(str::to_string).collect())
        }
        "COPY" => InstructionKind::Copy(parse_copy(kw, &raw.flags, rest)?),
        "ADD" => InstructionKind::Add(parse_copy(kw, &raw.flags, rest)?),
        "HEALTHCHECK" => InstructionKind::Healthcheck(parse_healthcheck(raw, &mut warn)?),
        "VOLUME" => {
            no_flags()?;
            non_empty()?;
            warn("VOLUME has no effect in dsec builds (no volume is created)".into());
            return Ok(None);
        }
        "MAINTAINER" => {
            no_flags()?;
            non_empty()?;
            warn("MAINTAINER is deprecated and ignored; use LABEL maintainer=...".into());
            return Ok(None);
        }
        "ONBUILD" => return Err(ErrorKind::Unsupported("ONBUILD".into())),
        _ => return Err(ErrorKind::UnknownInstruction(raw.keyword.clone())),
    };
    Ok(Some(kind))
}

/// `[...]` as a JSON array of strings, else `None`.
fn json_array(rest: &str) -> Option<Vec<String>> {
    if !rest.starts_with('[') {
        return None;
    }
    serde_json::from_str(rest).ok()
}

/// RUN/CMD/ENTRYPOINT arguments: a JSON array of strings is the exec form, anything else
/// the shell form (like Docker, which also takes a broken JSON array as a shell command:
/// that gets a warning).
fn parse_command(
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
fn has_heredoc(s: &str) -> bool {
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
fn words(rest: &str, escape: char) -> Vec<String> {
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
fn parse_args(rest: &str, escape: char) -> Result<Vec<ArgDecl>, ErrorKind> {
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
fn parse_key_values(
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
fn parse_copy(kw: &str, flags: &[String], rest: &str) -> Result<CopyArgs, ErrorKind> {
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
fn parse_healthcheck(raw: &Raw, warn: &mut impl FnMut(String)) -> Result<Healthcheck, ErrorKind> {
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

#[cfg(test)]
mod tests;

//! Dockerfile text -> [`Dockerfile`]: parser directives (`# escape=`), comments, line
//! continuations, instruction names (any case), `--flags`, exec (JSON) vs shell forms and
//! `key=value` lists, following Docker's (BuildKit's) parser. Values stay unsubstituted:
//! substitution needs the build args, so it belongs to [`mod@crate::plan`].
//!
//! The arguments of single instructions are parsed in `args`.
//!
//! What dsec cannot build is refused here, with the line: ONBUILD, RUN flags (`--mount`,
//! `--network`...), heredocs, unknown instructions and flags. VOLUME and MAINTAINER are
//! accepted with no effect and reported as [`Warning`]s.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::{DockerfileError, ErrorKind, Warning};

mod args;

use args::*;

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
        let raw = split_instruction(&l.text, escape);
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

fn split_instruction(text: &str, escape: char) -> Raw {
    let (word, rest) = text.split_once(char::is_whitespace).unwrap_or((text, ""));
    let (flags, rest) = extract_flags(rest, escape);
    Raw {
        keyword: word.to_ascii_uppercase(),
        flags,
        rest: rest.trim().to_string(),
    }
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

#[cfg(test)]
mod tests;

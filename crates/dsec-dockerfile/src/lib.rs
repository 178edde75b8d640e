//! Dockerfile front end of dsec image builds: text in, a build plan out. No I/O.
//!
//! - [`parse()`] (module [`mod@parse`]): Dockerfile text -> [`Dockerfile`] (stages and
//!   instructions, unsubstituted), refusing what dsec cannot build;
//! - [`subst`]: Docker's variable substitution (`$VAR`, `${VAR:-word}`, quotes, escapes);
//! - [`plan()`] (module [`mod@plan`]): [`Dockerfile`] + build args + target -> [`Plan`]: the
//!   stages the target needs, each a base and ordered [`Step`]s (run, copy, mkdir) with
//!   their cache-key input, and the final [`ImageConfig`];
//! - [`ignore`]: `.dockerignore` matching ([`Ignore`]).
//!
//! The builder (dsec-control) turns a plan into sandbox runs and layer commits.
//!
//! The parser is our own: the crates.io `dockerfile-parser` crate (0.9) hardcodes `\` as
//! the line continuation (no `# escape=` directive), reports byte spans instead of line
//! numbers, and pulls in pest and an old snafu; the grammar is small enough to own.
//!
//! Every error about an instruction names its line (1-based, where the instruction
//! starts) and its text: `Dockerfile line 7: ONBUILD is not supported (in "ONBUILD RUN
//! make")`.

pub mod ignore;
pub mod parse;
pub mod plan;
pub mod subst;

pub use ignore::{Ignore, IgnoreError};
pub use parse::{
    parse, ArgDecl, Command, CopyArgs, Dockerfile, Healthcheck, Instruction, InstructionKind, Stage,
};
pub use plan::{
    plan, plan_with, Base, CacheKey, CopyFrom, CopyStep, ImageConfig, Plan, PlanOptions,
    PlannedStage, RunStep, Step, StepKind,
};
pub use subst::SubstError;

/// Longest instruction text quoted in an error message.
const MAX_QUOTED: usize = 120;

/// A Dockerfile that cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DockerfileError {
    /// An instruction (or parser directive) that is wrong or not supported.
    #[error("Dockerfile line {line}: {kind} (in {:?})", shorten(text))]
    At {
        /// 1-based line where the instruction starts.
        line: usize,
        /// The instruction, its continuation lines joined.
        text: String,
        /// What is wrong.
        kind: ErrorKind,
    },
    /// No `FROM` at all.
    #[error("Dockerfile has no FROM instruction")]
    NoFrom,
    /// The build target names no stage.
    #[error("target stage {0:?} is not in the Dockerfile")]
    UnknownTarget(String),
}

impl DockerfileError {
    pub(crate) fn at(line: usize, text: &str, kind: ErrorKind) -> Self {
        DockerfileError::At {
            line,
            text: text.to_string(),
            kind,
        }
    }

    /// The line the error is about, if any.
    pub fn line(&self) -> Option<usize> {
        match self {
            DockerfileError::At { line, .. } => Some(*line),
            _ => None,
        }
    }
}

fn shorten(text: &str) -> String {
    match text.char_indices().nth(MAX_QUOTED) {
        Some((i, _)) => format!("{}...", &text[..i]),
        None => text.to_string(),
    }
}

/// What is wrong with an instruction.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ErrorKind {
    /// A Dockerfile feature dsec does not build (ONBUILD, RUN --mount, heredocs, ADD of
    /// URLs...).
    #[error("{0} is not supported")]
    Unsupported(String),
    /// Not a Dockerfile instruction.
    #[error("unknown instruction {0}")]
    UnknownInstruction(String),
    /// An instruction with nothing after it.
    #[error("{0} requires at least one argument")]
    MissingArguments(String),
    /// A `--flag` the instruction does not have.
    #[error("unknown flag --{flag} for {instruction}")]
    UnknownFlag {
        /// The instruction.
        instruction: String,
        /// The flag, without `--`.
        flag: String,
    },
    /// Something other than ARG before the first FROM.
    #[error("{0} before the first FROM (only ARG may come before it)")]
    BeforeFrom(String),
    /// A bad `# escape=` (or duplicated) parser directive.
    #[error("parser directive: {0}")]
    Directive(String),
    /// A bad stage name or stage reference.
    #[error("{0}")]
    Stage(String),
    /// A value that does not parse (port, mode, duration, signal...).
    #[error("{0}")]
    Invalid(String),
    /// Malformed arguments.
    #[error("{0}")]
    Syntax(String),
    /// Variable substitution failed.
    #[error("variable substitution: {0}")]
    Substitution(#[from] SubstError),
}

/// Something in the Dockerfile that the build accepts but ignores or doubts (VOLUME,
/// MAINTAINER, unused build args...), for the caller to show.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Warning {
    /// The line it is about, if it is about one.
    pub line: Option<usize>,
    /// What to tell the user.
    pub message: String,
}

impl std::fmt::Display for Warning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.line {
            Some(line) => write!(f, "Dockerfile line {line}: {}", self.message),
            None => write!(f, "Dockerfile: {}", self.message),
        }
    }
}

//! How a Dockerfile is evaluated into steps: ARG scoping, substitution of each
//! instruction, WORKDIR/COPY path resolution, `--from` resolution, and the checks on
//! ports, signals and sources. [`super`] holds the types and the entry points.

use std::collections::{BTreeMap, BTreeSet};

use super::*;
use crate::parse::InstructionKind as I;
use crate::parse::{ArgDecl, Command, CopyArgs, Dockerfile, Instruction};
use crate::subst::{expand, expand_words, Vars};
use crate::{DockerfileError, ErrorKind, Warning};

/// Args Docker defines without an `ARG`: usable in `FROM`, and in a stage once declared
/// with `ARG NAME` (no default).
pub(super) const PLATFORM_ARGS: [&str; 8] = [
    "TARGETPLATFORM",
    "TARGETOS",
    "TARGETARCH",
    "TARGETVARIANT",
    "BUILDPLATFORM",
    "BUILDOS",
    "BUILDARCH",
    "BUILDVARIANT",
];

/// Values of [`PLATFORM_ARGS`] for this build: dsec builds for the platform it runs on.
pub(super) fn platform_vars() -> Vars {
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        a => a,
    };
    let variant = if arch == "arm" { "v7" } else { "" };
    let platform = if variant.is_empty() {
        format!("linux/{arch}")
    } else {
        format!("linux/{arch}/{variant}")
    };
    let mut v = Vars::new();
    for side in ["TARGET", "BUILD"] {
        v.insert(format!("{side}PLATFORM"), platform.clone());
        v.insert(format!("{side}OS"), "linux".to_string());
        v.insert(format!("{side}ARCH"), arch.to_string());
        v.insert(format!("{side}VARIANT"), variant.to_string());
    }
    v
}

pub(super) struct Planner<'a> {
    df: &'a Dockerfile,
    opts: &'a PlanOptions,
    /// Global ARGs (declared before the first FROM) and their values.
    globals: BTreeMap<String, Option<String>>,
    /// Variables of `FROM` lines: platform args and global ARGs with a value.
    from_vars: Vars,
    /// Planned stages by Dockerfile index (indices refer to Dockerfile positions).
    pub(super) done: Vec<Option<PlannedStage>>,
    /// Stages being planned (guards against reference cycles).
    active: Vec<bool>,
    /// Build args that an ARG declared.
    pub(super) consumed: BTreeSet<String>,
    pub(super) warnings: Vec<Warning>,
}

fn at(instr: &Instruction, kind: ErrorKind) -> DockerfileError {
    DockerfileError::at(instr.line, &instr.text, kind)
}

impl<'a> Planner<'a> {
    pub(super) fn new(df: &'a Dockerfile, opts: &'a PlanOptions) -> Result<Self, DockerfileError> {
        let mut p = Planner {
            df,
            opts,
            globals: BTreeMap::new(),
            from_vars: platform_vars(),
            done: vec![None; df.stages.len()],
            active: vec![false; df.stages.len()],
            consumed: BTreeSet::new(),
            warnings: Vec::new(),
        };
        for a in &opts.build_args {
            if PLATFORM_ARGS.contains(&a.0.as_str()) {
                p.from_vars.insert(a.0.clone(), a.1.clone());
            }
        }
        for instr in &df.global_args {
            let I::Arg(decls) = &instr.kind else { continue };
            for d in decls {
                let value = match (opts.build_args.get(&d.name), &d.default) {
                    (Some(v), _) => {
                        p.consumed.insert(d.name.clone());
                        Some(v.clone())
                    }
                    (None, Some(def)) => Some(
                        expand(def, &p.from_vars, df.escape).map_err(|e| at(instr, e.into()))?,
                    ),
                    (None, None) => p.from_vars.get(&d.name).cloned(),
                };
                match &value {
                    Some(v) => p.from_vars.insert(d.name.clone(), v.clone()),
                    None => p.from_vars.remove(&d.name),
                };
                p.globals.insert(d.name.clone(), value);
            }
        }
        Ok(p)
    }

    /// Plans stage `i` (and, first, the stages it needs) unless done.
    pub(super) fn stage(&mut self, i: usize) -> Result<(), DockerfileError> {
        if self.done[i].is_some() {
            return Ok(());
        }
        let df = self.df;
        let st = &df.stages[i];
        let from_err = |kind| DockerfileError::at(st.line, &st.text, kind);
        if self.active[i] {
            return Err(from_err(ErrorKind::Stage(
                "stages refer to each other".into(),
            )));
        }
        self.active[i] = true;
        let image =
            expand(&st.image, &self.from_vars, df.escape).map_err(|e| from_err(e.into()))?;
        if image.is_empty() {
            return Err(from_err(ErrorKind::Syntax(format!(
                "FROM {} is empty after substitution",
                st.image
            ))));
        }
        let platform = match &st.platform {
            Some(p) => Some(expand(p, &self.from_vars, df.escape).map_err(|e| from_err(e.into()))?)
                .filter(|p| !p.is_empty()),
            None => None,
        };
        let want = image.to_ascii_lowercase();
        let base_stage = df.stages[..i]
            .iter()
            .position(|s| s.name.as_deref() == Some(want.as_str()));
        let (base, config) = match base_stage {
            Some(j) => {
                self.stage(j)?;
                let config = self.done[j].as_ref().map(|s| s.config.clone());
                (Base::Stage(j), config.unwrap_or_default())
            }
            None => {
                let config = self.opts.base_configs.get(&image).cloned();
                (Base::Image(image), config.unwrap_or_default())
            }
        };
        let mut s = StageState::new(config);
        for instr in &st.instructions {
            self.apply(&mut s, i, instr)?;
        }
        self.active[i] = false;
        self.done[i] = Some(PlannedStage {
            index: i,
            name: st.name.clone(),
            line: st.line,
            base,
            platform,
            steps: s.steps,
            config: s.config,
        });
        Ok(())
    }

    /// Applies one instruction of stage `i` to its state.
    fn apply(
        &mut self,
        s: &mut StageState,
        i: usize,
        instr: &Instruction,
    ) -> Result<(), DockerfileError> {
        let esc = self.df.escape;
        let vars = s.vars();
        let x = |w: &str| expand(w, &vars, esc).map_err(|e| at(instr, e.into()));
        let step = |kind| Step {
            line: instr.line,
            text: instr.text.clone(),
            kind,
        };
        match &instr.kind {
            I::Arg(decls) => {
                for d in decls {
                    self.declare(s, d, instr)?;
                }
            }
            I::Env(kvs) => {
                // Every pair sees the variables from before the instruction.
                let kvs = kvs
                    .iter()
                    .map(|(k, v)| Ok((x(k)?, x(v)?)))
                    .collect::<Result<Vec<_>, DockerfileError>>()?;
                for (k, v) in kvs {
                    if k.is_empty() {
                        return Err(at(
                            instr,
                            ErrorKind::Syntax("ENV names cannot be empty".into()),
                        ));
                    }
                    s.config.set_env(&k, &v);
                }
            }
            I::Label(kvs) => {
                for (k, v) in kvs {
                    let k = x(k)?;
                    if k.is_empty() {
                        return Err(at(
                            instr,
                            ErrorKind::Syntax("LABEL names cannot be empty".into()),
                        ));
                    }
                    let v = x(v)?;
                    s.config.labels.insert(k, v);
                }
            }
            I::Run(cmd) => {
                let run = RunStep {
                    cmd: s.argv(cmd),
                    env: s.run_env(),
                    workdir: s.workdir.clone(),
                    user: s.config.user.clone(),
                };
                s.steps.push(step(StepKind::Run(run)));
            }
            I::Cmd(cmd) => {
                s.config.cmd = Some(s.argv(cmd));
                s.cmd_set = true;
            }
            I::Entrypoint(cmd) => {
                s.config.entrypoint = Some(s.argv(cmd));
                if !s.cmd_set {
                    s.config.cmd = None;
                }
            }
            I::Shell(argv) => s.config.shell = Some(argv.clone()),
            I::Workdir(w) => {
                let w = x(w)?;
                if w.is_empty() {
                    return Err(at(
                        instr,
                        ErrorKind::Syntax("WORKDIR is empty after substitution".into()),
                    ));
                }
                let path = resolve(&s.workdir, &w);
                // A directory already in effect exists; `/` always does.
                if path != s.workdir && path != "/" {
                    s.steps.push(step(StepKind::Mkdir {
                        path: path.clone(),
                        user: s.config.user.clone(),
                    }));
                }
                s.workdir = path.clone();
                s.config.workdir = Some(path);
            }
            I::User(u) => {
                let u = x(u)?;
                if u.is_empty() {
                    return Err(at(
                        instr,
                        ErrorKind::Syntax("USER is empty after substitution".into()),
                    ));
                }
                s.config.user = Some(u);
            }
            I::Copy(args) => {
                let c = self.copy(s, i, instr, args, false, &vars)?;
                s.steps.push(step(StepKind::Copy(c)));
            }
            I::Add(args) => {
                let c = self.copy(s, i, instr, args, true, &vars)?;
                s.steps.push(step(StepKind::Copy(c)));
            }
            I::Expose(ports) => {
                for p in ports {
                    let words = expand_words(p, &vars, esc).map_err(|e| at(instr, e.into()))?;
                    for w in words {
                        let ps = parse_ports(&w).ok_or_else(|| {
                            at(instr, ErrorKind::Invalid(format!(
                                "invalid port {w:?}: use PORT, PORT/PROTO or FIRST-LAST/PROTO (tcp, udp, sctp)"
                            )))
                        })?;
                        s.config.exposed_ports.extend(ps);
                    }
                }
            }
            I::StopSignal(sig) => {
                let sig = x(sig)?;
                if !valid_signal(&sig) {
                    return Err(at(
                        instr,
                        ErrorKind::Invalid(format!("invalid signal {sig:?}")),
                    ));
                }
                s.config.stop_signal = Some(sig);
            }
            I::Healthcheck(h) => s.config.healthcheck = Some(h.clone()),
        }
        Ok(())
    }

    /// `ARG` in a stage: a build arg wins, then the default, then the global ARG of the
    /// same name, then a platform arg; otherwise declared without a value.
    fn declare(
        &mut self,
        s: &mut StageState,
        d: &ArgDecl,
        instr: &Instruction,
    ) -> Result<(), DockerfileError> {
        let value = if let Some(v) = self.opts.build_args.get(&d.name) {
            self.consumed.insert(d.name.clone());
            Some(v.clone())
        } else if let Some(def) = &d.default {
            Some(expand(def, &s.vars(), self.df.escape).map_err(|e| at(instr, e.into()))?)
        } else if let Some(g) = self.globals.get(&d.name) {
            g.clone()
        } else if PLATFORM_ARGS.contains(&d.name.as_str()) {
            self.from_vars.get(&d.name).cloned()
        } else {
            None
        };
        match s.args.iter_mut().find(|(n, _)| *n == d.name) {
            Some(a) => a.1 = value,
            None => s.args.push((d.name.clone(), value)),
        }
        Ok(())
    }

    /// A COPY/ADD step (substituted, `--from` resolved, dest made absolute).
    fn copy(
        &mut self,
        s: &StageState,
        i: usize,
        instr: &Instruction,
        args: &CopyArgs,
        add: bool,
        vars: &Vars,
    ) -> Result<CopyStep, DockerfileError> {
        let kw = if add { "ADD" } else { "COPY" };
        let esc = self.df.escape;
        let x = |w: &str| expand(w, vars, esc).map_err(|e| at(instr, e.into()));
        let invalid = |m: String| at(instr, ErrorKind::Invalid(m));
        let from = match &args.from {
            None => CopyFrom::Context,
            Some(f) => {
                let f = x(f)?;
                self.copy_from(i, instr, &f)?
            }
        };
        let mut sources = Vec::with_capacity(args.sources.len());
        for src in &args.sources {
            let src = x(src)?;
            if src.is_empty() {
                return Err(invalid(format!("{kw} source is empty after substitution")));
            }
            if let Some(what) = remote_source(&src) {
                return Err(at(
                    instr,
                    ErrorKind::Unsupported(format!(
                        "{kw} from {what} ({src}); download it in a RUN step"
                    )),
                ));
            }
            sources.push(src);
        }
        let dest = x(&args.dest)?;
        if dest.is_empty() {
            return Err(invalid(format!(
                "{kw} destination is empty after substitution"
            )));
        }
        let dir = dest == "." || dest.ends_with('/') || dest.ends_with("/.");
        let mut dest = resolve(&s.workdir, &dest);
        if dir && !dest.ends_with('/') {
            dest.push('/');
        }
        let chown = match &args.chown {
            Some(c) => Some(x(c)?).filter(|c| !c.is_empty()),
            None => None,
        };
        let chmod = match &args.chmod {
            Some(m) => {
                let m = x(m)?;
                let mode = u32::from_str_radix(&m, 8).ok().filter(|m| *m <= 0o7777);
                Some(mode.ok_or_else(|| {
                    invalid(format!("--chmod={m}: use an octal mode from 0 to 7777"))
                })?)
            }
            None => None,
        };
        Ok(CopyStep {
            from,
            sources,
            dest,
            chown,
            chmod,
            extract_tars: add,
        })
    }

    /// `--from=`: a stage index, an earlier stage's name, or else an image.
    fn copy_from(
        &mut self,
        i: usize,
        instr: &Instruction,
        f: &str,
    ) -> Result<CopyFrom, DockerfileError> {
        let stage_err = |m: String| at(instr, ErrorKind::Stage(m));
        if f.is_empty() {
            return Err(stage_err("--from is empty after substitution".into()));
        }
        let j = if f.bytes().all(|b| b.is_ascii_digit()) {
            match f.parse::<usize>() {
                Ok(j) if j < i => j,
                _ if i == 0 => {
                    return Err(stage_err(format!(
                        "--from={f}: the first stage has no earlier stage to copy from"
                    )))
                }
                _ => {
                    return Err(stage_err(format!(
                        "--from={f}: the index of an earlier stage is 0 to {}",
                        i - 1
                    )))
                }
            }
        } else {
            let want = f.to_ascii_lowercase();
            match self
                .df
                .stages
                .iter()
                .position(|s| s.name.as_deref() == Some(want.as_str()))
            {
                Some(j) if j < i => j,
                Some(_) => {
                    return Err(stage_err(format!(
                        "--from={f}: a stage can only copy from an earlier stage"
                    )))
                }
                None => return Ok(CopyFrom::Image(f.to_string())),
            }
        };
        self.stage(j)?;
        Ok(CopyFrom::Stage(j))
    }
}

/// What is being built in one stage.
struct StageState {
    config: ImageConfig,
    /// ARGs declared in this stage, in order, with their values.
    args: Vec<(String, Option<String>)>,
    /// Whether this stage set CMD (an ENTRYPOINT after that keeps it).
    cmd_set: bool,
    /// Absolute working directory.
    workdir: String,
    steps: Vec<Step>,
}

impl StageState {
    fn new(mut config: ImageConfig) -> Self {
        if config.get_env("PATH").is_none() {
            config.set_env("PATH", DEFAULT_PATH);
        }
        let workdir = match config.workdir.as_deref() {
            Some(w) if !w.is_empty() => resolve("/", w),
            _ => "/".to_string(),
        };
        StageState {
            config,
            args: Vec::new(),
            cmd_set: false,
            workdir,
            steps: Vec::new(),
        }
    }

    /// Variables for substitution: ARGs with a value, overridden by ENV.
    fn vars(&self) -> Vars {
        let mut v: Vars = self
            .args
            .iter()
            .filter_map(|(k, v)| Some((k.clone(), v.clone()?)))
            .collect();
        v.extend(self.config.env.iter().cloned());
        v
    }

    /// Environment of a RUN: ENV, then ARGs with a value that ENV does not shadow.
    fn run_env(&self) -> Vec<(String, String)> {
        let mut env = self.config.env.clone();
        for (k, v) in &self.args {
            if let Some(v) = v {
                if self.config.get_env(k).is_none() {
                    env.push((k.clone(), v.clone()));
                }
            }
        }
        env
    }

    /// A command's argv: exec form as is, shell form with the `SHELL` in effect.
    fn argv(&self, cmd: &Command) -> Vec<String> {
        match cmd {
            Command::Exec(argv) => argv.clone(),
            Command::Shell(line) => {
                let mut argv = match &self.config.shell {
                    Some(sh) => sh.clone(),
                    None => DEFAULT_SHELL.iter().map(|s| s.to_string()).collect(),
                };
                argv.push(line.clone());
                argv
            }
        }
    }
}

/// `p` made absolute against `dir` and cleaned (`.`/`..`/`//` resolved, no trailing
/// `/` except for the root).
pub(super) fn resolve(dir: &str, p: &str) -> String {
    let joined = if p.starts_with('/') {
        p.to_string()
    } else {
        format!("{dir}/{p}")
    };
    let mut parts: Vec<&str> = Vec::new();
    for seg in joined.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            s => parts.push(s),
        }
    }
    format!("/{}", parts.join("/"))
}

/// Why a COPY/ADD source is not a local path: `Some("a URL")`, `Some("a git
/// repository")`, or `None` for a local path.
pub(super) fn remote_source(src: &str) -> Option<&'static str> {
    let lower = src.to_ascii_lowercase();
    if lower.starts_with("git@")
        || lower.starts_with("git://")
        || (lower.ends_with(".git") && lower.contains("://"))
    {
        return Some("a git repository");
    }
    if lower.contains("://") {
        return Some("a URL");
    }
    None
}

/// `80`, `80/udp`, `8000-8002/tcp` -> `["80/tcp"]`, ..., one entry per port.
fn parse_ports(spec: &str) -> Option<Vec<String>> {
    let (ports, proto) = match spec.split_once('/') {
        Some((p, proto)) => (p, proto.to_ascii_lowercase()),
        None => (spec, "tcp".to_string()),
    };
    if !matches!(proto.as_str(), "tcp" | "udp" | "sctp") {
        return None;
    }
    let num = |s: &str| -> Option<u16> {
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        s.parse().ok()
    };
    let (first, last) = match ports.split_once('-') {
        Some((a, b)) => (num(a)?, num(b)?),
        None => {
            let p = num(ports)?;
            (p, p)
        }
    };
    if first > last {
        return None;
    }
    Some((first..=last).map(|p| format!("{p}/{proto}")).collect())
}

/// A signal as Docker's `STOPSIGNAL` takes it: a number from 1 to 64 or a name, with or
/// without `SIG`.
fn valid_signal(sig: &str) -> bool {
    if let Ok(n) = sig.parse::<u32>() {
        return (1..=64).contains(&n);
    }
    let upper = sig.to_ascii_uppercase();
    let name = upper.strip_prefix("SIG").unwrap_or(&upper);
    const NAMES: &[&str] = &[
        "ABRT", "ALRM", "BUS", "CHLD", "CLD", "CONT", "FPE", "HUP", "ILL", "INT", "IO", "IOT",
        "KILL", "PIPE", "POLL", "PROF", "PWR", "QUIT", "SEGV", "STKFLT", "STOP", "SYS", "TERM",
        "TRAP", "TSTP", "TTIN", "TTOU", "UNUSED", "URG", "USR1", "USR2", "VTALRM", "WINCH", "XCPU",
        "XFSZ", "RTMIN", "RTMAX",
    ];
    if NAMES.contains(&name) {
        return true;
    }
    // RTMIN+n, RTMAX-n
    let rt = |prefix: &str, sep: char| {
        name.strip_prefix(prefix)
            .and_then(|r| r.strip_prefix(sep))
            .and_then(|n| n.parse::<u32>().ok())
            .is_some_and(|n| (1..=15).contains(&n))
    };
    rt("RTMIN", '+') || rt("RTMAX", '-')
}

//! [`Dockerfile`] + build args + target -> [`Plan`]: which stages the target needs, and
//! for each its base and ordered [`Step`]s with every variable substituted, the way
//! Docker (BuildKit) evaluates a Dockerfile: ARG scoping (global ARGs only in `FROM`
//! unless redeclared in the stage), build args over ARG defaults, ENV over ARG, `SHELL`
//! for shell forms, `WORKDIR` relative to the previous one, `ENTRYPOINT` dropping an
//! inherited `CMD`. Steps that change files are [`StepKind::Run`], [`StepKind::Copy`]
//! and [`StepKind::Mkdir`]; everything else accumulates in the stage's [`ImageConfig`].
//!
//! Variables from the base image's `ENV` (e.g. `PATH`) are known only if the caller
//! passes that image's config in [`PlanOptions::base_configs`]: a builder plans once,
//! fetches [`Plan::base_images`], and plans again with their configs. Without one the
//! base counts as empty, except that `PATH` gets Docker's default.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::parse::{Dockerfile, Healthcheck};
use crate::{DockerfileError, Warning};

mod eval;

use eval::{Planner, PLATFORM_ARGS};

/// The shell of shell-form commands when no `SHELL` is set.
pub const DEFAULT_SHELL: [&str; 2] = ["/bin/sh", "-c"];
/// `PATH` of a stage whose base image sets none (Docker's default).
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// Version of the [`CacheKey`] layout: bumped when the meaning of a step changes.
pub const CACHE_KEY_VERSION: u32 = 1;

/// What to plan for.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanOptions {
    /// `--build-arg k=v`: override ARG defaults (values are used verbatim).
    pub build_args: BTreeMap<String, String>,
    /// The stage to build, by name; default the last one.
    pub target: Option<String>,
    /// Configs of base images by reference as written in `FROM` (after substitution):
    /// their env, workdir, user, shell, cmd... are inherited.
    pub base_configs: BTreeMap<String, ImageConfig>,
}

/// The stages to build, dependencies first; the last one is the target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// Needed stages in Dockerfile order (never empty). [`Base::Stage`] and
    /// [`CopyFrom::Stage`] index this list.
    pub stages: Vec<PlannedStage>,
    /// Things to tell the user (no-op instructions, unused build args...).
    pub warnings: Vec<Warning>,
}

impl Plan {
    /// The stage the build produces.
    pub fn target(&self) -> Option<&PlannedStage> {
        self.stages.last()
    }

    /// Distinct base image references of the planned stages (not `scratch`), whose
    /// configs the builder may pass back in [`PlanOptions::base_configs`].
    pub fn base_images(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for s in &self.stages {
            if let Base::Image(r) = &s.base {
                if r != "scratch" && !out.contains(r) {
                    out.push(r.clone());
                }
            }
        }
        out
    }
}

/// One stage to build.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedStage {
    /// Position of the stage in the Dockerfile (0-based).
    pub index: usize,
    /// `AS name`.
    pub name: Option<String>,
    /// Line of its `FROM`.
    pub line: usize,
    /// What it starts from.
    pub base: Base,
    /// `FROM --platform=...`, substituted (dsec builds for its own platform; the builder
    /// decides what to do with another).
    pub platform: Option<String>,
    /// What to do, in order.
    pub steps: Vec<Step>,
    /// The image config at the end of the stage.
    pub config: ImageConfig,
}

/// The start of a stage.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Base {
    /// An image reference (`scratch` is the empty image).
    Image(String),
    /// An earlier stage, by index in [`Plan::stages`].
    Stage(usize),
}

/// One step of a stage.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Step {
    /// Line of the instruction it comes from.
    pub line: usize,
    /// That instruction as written (for progress output).
    pub text: String,
    /// What to do.
    pub kind: StepKind,
}

/// What a step does to the file system.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum StepKind {
    /// Run a command in the stage's file system.
    Run(RunStep),
    /// Copy files in.
    Copy(CopyStep),
    /// Create a directory with its parents (for `WORKDIR`), mode 0755.
    Mkdir {
        /// Absolute path.
        path: String,
        /// Owner: the `USER` in effect (root when `None`), as BuildKit does.
        user: Option<String>,
    },
}

/// A `RUN`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunStep {
    /// The argv: the exec form as written, or the `SHELL` in effect plus the command.
    pub cmd: Vec<String>,
    /// Environment: the stage's ENV (in order), then the ARGs in effect that ENV does
    /// not shadow.
    pub env: Vec<(String, String)>,
    /// Absolute working directory.
    pub workdir: String,
    /// `USER` in effect (`user[:group]`); root when `None`.
    pub user: Option<String>,
}

/// A `COPY` or `ADD`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyStep {
    /// Where the sources are.
    pub from: CopyFrom,
    /// Source paths as written after substitution (may hold wildcards), relative to the
    /// context or the source root.
    pub sources: Vec<String>,
    /// Absolute destination; a trailing `/` (or a `.` destination) means "into this
    /// directory".
    pub dest: String,
    /// `--chown=user[:group]`.
    pub chown: Option<String>,
    /// `--chmod`, as a mode.
    pub chmod: Option<u32>,
    /// `ADD`: a local tar archive (plain or compressed) is extracted into `dest`.
    pub extract_tars: bool,
}

/// The source of a copy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum CopyFrom {
    /// The build context (filtered by `.dockerignore`).
    Context,
    /// An earlier stage's result, by index in [`Plan::stages`].
    Stage(usize),
    /// An image reference.
    Image(String),
}

/// The input of a step's cache key: the builder keys a layer by (parent digest, this).
/// It holds the substituted instruction and the env, user and workdir it runs under, so
/// it changes iff the step's effect could. What it cannot hold the builder must add: the
/// content digest of copied context files, and for [`CopyFrom::Stage`] that stage's
/// result digest (the index is zeroed here: it is only a position in this plan).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheKey {
    /// [`CACHE_KEY_VERSION`].
    pub version: u32,
    /// The step, minus the line.
    pub step: StepKind,
}

impl Step {
    /// This step's cache-key input.
    pub fn cache_key(&self) -> CacheKey {
        let mut step = self.kind.clone();
        if let StepKind::Copy(CopyStep {
            from: CopyFrom::Stage(i),
            ..
        }) = &mut step
        {
            *i = 0;
        }
        CacheKey {
            version: CACHE_KEY_VERSION,
            step,
        }
    }
}

/// Image config (the OCI/Docker `config` fields a Dockerfile sets), at the end of a
/// stage or of a base image.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ImageConfig {
    /// Environment, in order.
    pub env: Vec<(String, String)>,
    /// Working directory.
    pub workdir: Option<String>,
    /// User.
    pub user: Option<String>,
    /// Entrypoint.
    pub entrypoint: Option<Vec<String>>,
    /// Cmd.
    pub cmd: Option<Vec<String>>,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Shell of shell forms (`SHELL`).
    pub shell: Option<Vec<String>>,
    /// Exposed ports, `port/proto`.
    pub exposed_ports: BTreeSet<String>,
    /// Stop signal.
    pub stop_signal: Option<String>,
    /// Health check.
    pub healthcheck: Option<Healthcheck>,
}

impl ImageConfig {
    /// The value of `name` in [`ImageConfig::env`].
    pub fn get_env(&self, name: &str) -> Option<&str> {
        self.env
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Sets `name`, in place if it is already there.
    pub fn set_env(&mut self, name: &str, value: &str) {
        match self.env.iter_mut().find(|(k, _)| k == name) {
            Some(kv) => kv.1 = value.to_string(),
            None => self.env.push((name.to_string(), value.to_string())),
        }
    }
}

/// Plans the build of `target` (default: the last stage) with `build_args`; base images
/// count as having an empty config (see [`plan_with`]).
pub fn plan(
    df: &Dockerfile,
    build_args: &BTreeMap<String, String>,
    target: Option<&str>,
) -> Result<Plan, DockerfileError> {
    plan_with(
        df,
        &PlanOptions {
            build_args: build_args.clone(),
            target: target.map(str::to_string),
            base_configs: BTreeMap::new(),
        },
    )
}

/// Plans with all [`PlanOptions`]. Stages the target does not need are dropped, and
/// errors in them are not reported (as with BuildKit).
pub fn plan_with(df: &Dockerfile, opts: &PlanOptions) -> Result<Plan, DockerfileError> {
    let target = match &opts.target {
        None => df
            .stages
            .len()
            .checked_sub(1)
            .ok_or(DockerfileError::NoFrom)?,
        Some(t) => {
            let want = t.to_ascii_lowercase();
            df.stages
                .iter()
                .position(|s| s.name.as_deref() == Some(want.as_str()))
                .ok_or_else(|| DockerfileError::UnknownTarget(t.clone()))?
        }
    };
    let mut p = Planner::new(df, opts)?;
    p.stage(target)?;

    // Renumber the needed stages (in file order) and their references.
    let mut stages: Vec<PlannedStage> = p.done.into_iter().flatten().collect();
    let order: Vec<usize> = stages.iter().map(|s| s.index).collect();
    let pos = |old: usize| order.iter().position(|i| *i == old).unwrap_or(old);
    for s in &mut stages {
        if let Base::Stage(j) = &mut s.base {
            *j = pos(*j);
        }
        for step in &mut s.steps {
            if let StepKind::Copy(CopyStep {
                from: CopyFrom::Stage(j),
                ..
            }) = &mut step.kind
            {
                *j = pos(*j);
            }
        }
    }

    let mut warnings = df.warnings.clone();
    warnings.extend(p.warnings);
    for name in opts.build_args.keys() {
        if !p.consumed.contains(name) && !PLATFORM_ARGS.contains(&name.as_str()) {
            warnings.push(Warning {
                line: None,
                message: format!("build arg {name} is not used by any ARG of the built stages"),
            });
        }
    }
    Ok(Plan { stages, warnings })
}

#[cfg(test)]
mod tests;

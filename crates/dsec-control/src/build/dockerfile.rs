//! `dsec image build -f Dockerfile CONTEXT NAME`: a Dockerfile built on dsec sandboxes.
//!
//! The front end (`dsec-dockerfile`) turns the Dockerfile into a plan: stages, each a
//! base and ordered steps. Here each stage runs in a build sandbox of its own tenant:
//! `RUN` is an exec (argv, env, workdir and user of the step), `COPY`/`ADD` a tar
//! (`dsec-build-context`) uploaded at `/`, `WORKDIR` a mkdir; `FROM scratch` stands on
//! an empty image made on first use. Every step is committed
//! as one layer and cached under a name derived from (parent image digest, the step's
//! cache key, and what it copies: the content digest of context files, the digest of a
//! source stage or image), so a rebuild redoes only what changed. The result is tagged
//! with the target stage's config (ENV, WORKDIR, USER, ENTRYPOINT, CMD, LABEL).
//!
//! Nothing is named `req.name` unless every step succeeded; every sandbox the build
//! made is deleted on every path. A build whose client went away stops at the next
//! step.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Seek, SeekFrom};
use std::sync::Arc;

use dsec_build_context::{has_wildcards, Context, Limits, Pattern};
use dsec_dockerfile::{Base, CopyFrom, CopyStep, PlanOptions, PlannedStage, Step, StepKind};
use dsec_node_api::{ImportSource, NodeApi};
use dsec_wire::agent::FileKind;
use dsec_wire::v1::*;
use dsec_wire::{ApiError, ErrorCode};
use futures::StreamExt;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc::UnboundedSender;

use crate::api::{ApiResult, ByteStream, Principal, SandboxApi};
use crate::build::{build_sandbox_request, Held};

/// Largest Dockerfile read from the context.
const MAX_DOCKERFILE: u64 = 1 << 20;
/// Most steps one build may have (all stages).
pub const MAX_STEPS: usize = 256;
/// Default time limit of one `RUN`.
const STEP_TIMEOUT_S: f64 = 1800.0;
/// Characters of a failed `RUN`'s output quoted in the error.
const OUTPUT_TAIL: usize = 2000;
/// Symlinks followed when resolving a `COPY --from` source.
const MAX_SYMLINKS: usize = 16;
/// The empty image a `FROM scratch` stage stands on (made on first use, a build-cache
/// ref like the steps').
const SCRATCH_IMAGE: &str = "build-cache/scratch";

/// What a finished build made.
#[derive(Debug)]
pub struct Built {
    /// The image named `req.name`.
    pub image: Image,
    /// Steps in the build.
    pub steps: usize,
    /// Of those, taken from the build cache.
    pub cached: usize,
}

/// Builds `req` from the context tar `context` for `caller`, reporting steps, output
/// and warnings to `events` (not `Done`/`Error`: the caller sends the end).
pub async fn build(
    api: &dyn SandboxApi,
    caller: &Principal,
    node: Arc<dyn NodeApi>,
    req: DockerfileBuildRequest,
    context: std::fs::File,
    events: UnboundedSender<BuildEvent>,
) -> ApiResult<Built> {
    check_name(&req.name)?;
    let held = Held::default();
    let mut b = Builder {
        api,
        caller,
        node,
        events,
        sandboxes: &held,
        req,
    };
    let res = held.keep_alive(api, caller, b.run(context)).await;
    for id in held.take_all() {
        let _ = api.delete_sandbox(caller, &id).await;
    }
    res
}

/// The build's result name must be a name a create can use.
fn check_name(name: &str) -> ApiResult<()> {
    if name.is_empty() || name.starts_with("build-cache/") {
        return Err(bad(format!(
            "name: {name:?} is not a name to give a built image"
        )));
    }
    Ok(())
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::BadRequest, msg)
}

/// An error about the instruction of `step`.
fn at(step: &Step, code: ErrorCode, msg: impl std::fmt::Display) -> ApiError {
    ApiError::new(
        code,
        format!("Dockerfile line {} ({}): {msg}", step.line, step.text),
    )
}

struct Builder<'a> {
    api: &'a dyn SandboxApi,
    caller: &'a Principal,
    node: Arc<dyn NodeApi>,
    events: UnboundedSender<BuildEvent>,
    /// Every sandbox this build created and has not deleted yet.
    sandboxes: &'a Held,
    req: DockerfileBuildRequest,
}

/// An image a stage stands on: its catalog name and digest.
#[derive(Debug, Clone)]
struct Layered {
    name: String,
    digest: String,
}

impl Builder<'_> {
    async fn run(&mut self, context: std::fs::File) -> ApiResult<Built> {
        let dockerfile_path = self
            .req
            .dockerfile
            .clone()
            .unwrap_or_else(|| "Dockerfile".to_string());
        let (text, context) = tokio::task::spawn_blocking(move || {
            let text = read_member(&context, &dockerfile_path)?;
            let ctx = Context::open(context, true, &Limits::default())
                .map_err(|e| bad(format!("build context: {e}")))?;
            Ok::<_, ApiError>((text, ctx))
        })
        .await
        .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))??;
        let context = Arc::new(context);

        let df = dsec_dockerfile::parse(&text).map_err(|e| bad(e.to_string()))?;
        let mut opts = PlanOptions {
            build_args: self.req.build_args.clone(),
            target: self.req.target.clone(),
            base_configs: BTreeMap::new(),
        };
        let first = dsec_dockerfile::plan_with(&df, &opts).map_err(|e| bad(e.to_string()))?;
        // Base images: pulled if they are registry references, their configs planned in.
        let mut bases: HashMap<String, Layered> = HashMap::new();
        for r in first.base_images() {
            let (layered, config) = self.ensure(&r).await?;
            opts.base_configs.insert(r.clone(), from_wire(&config));
            bases.insert(r, layered);
        }
        let plan = dsec_dockerfile::plan_with(&df, &opts).map_err(|e| bad(e.to_string()))?;
        for w in &plan.warnings {
            self.emit(BuildEvent::Warning {
                message: w.to_string(),
            });
        }
        let steps: usize = plan.stages.iter().map(|s| s.steps.len()).sum();
        if steps > MAX_STEPS {
            return Err(bad(format!(
                "the build has {steps} steps; at most {MAX_STEPS}"
            )));
        }

        let mut results: Vec<Layered> = Vec::with_capacity(plan.stages.len());
        let (mut number, mut cached) = (0usize, 0usize);
        for stage in &plan.stages {
            let base = match &stage.base {
                Base::Image(r) if r == "scratch" => self.scratch().await?,
                Base::Image(r) => bases
                    .get(r)
                    .cloned()
                    .ok_or_else(|| bad(format!("base image {r} was not resolved")))?,
                Base::Stage(i) => results
                    .get(*i)
                    .cloned()
                    .ok_or_else(|| bad(format!("stage {i} is not built yet")))?,
            };
            if let Some(p) = &stage.platform {
                if p != "linux/amd64" && !p.contains('$') {
                    self.emit(BuildEvent::Warning {
                        message: format!(
                            "Dockerfile line {}: --platform={p} ignored: dsec builds for \
                             linux/amd64",
                            stage.line
                        ),
                    });
                }
            }
            let mut run = StageRun {
                parent: base,
                sandbox: None,
            };
            for step in &stage.steps {
                number += 1;
                if self.events.is_closed() {
                    return Err(ApiError::new(
                        ErrorCode::Failed,
                        "build cancelled: the client went away",
                    ));
                }
                let hit = self
                    .step(stage, step, number, steps, &mut run, &results, &context)
                    .await?;
                cached += usize::from(hit);
            }
            if let Some(id) = run.sandbox.take() {
                self.delete(&id).await;
            }
            results.push(run.parent);
        }
        let (Some(target), Some(last)) = (plan.target(), results.last()) else {
            return Err(bad("the Dockerfile has no stage to build"));
        };
        let image = self
            .node
            .tag_image(&last.name, &self.req.name, Some(to_wire(&target.config)))
            .await?;
        Ok(Built {
            image,
            steps,
            cached,
        })
    }

    fn emit(&self, ev: BuildEvent) {
        let _ = self.events.send(ev);
    }

    /// The catalog name, digest and config of image reference `r`, pulled first if it is
    /// a registry reference.
    async fn ensure(&self, r: &str) -> ApiResult<(Layered, ImageConfig)> {
        let name = crate::plane::ensure_image(&*self.node, r.to_string()).await?;
        let img = self
            .node
            .image(&name)
            .await
            .map_err(|e| ApiError::new(e.code, format!("base image {r}: {}", e.message)))?;
        Ok((
            Layered {
                name,
                digest: img.digest,
            },
            img.config,
        ))
    }

    /// The empty image of `FROM scratch`: one layer holding only `/` (0755, root). Its
    /// build sandboxes have no shell, so `RUN` fails there as with Docker; COPY, ADD and
    /// WORKDIR work (the agent does them), and the sandbox's mount points (`/dev`,
    /// `/proc`, `/sys`, `/tmp`) end up in the image as empty directories.
    async fn scratch(&self) -> ApiResult<Layered> {
        if let Ok(img) = self.node.image(SCRATCH_IMAGE).await {
            return Ok(Layered {
                name: SCRATCH_IMAGE.into(),
                digest: img.digest,
            });
        }
        let tar = empty_root_tar()
            .map_err(|e| ApiError::new(ErrorCode::Internal, format!("scratch image: {e}")))?;
        let body: ByteStream =
            futures::stream::once(async move { Ok(bytes::Bytes::from(tar)) }).boxed();
        let img = self
            .node
            .import_image(SCRATCH_IMAGE, ImportSource::Archive(body), false, None)
            .await?;
        Ok(Layered {
            name: SCRATCH_IMAGE.into(),
            digest: img.digest,
        })
    }

    async fn delete(&mut self, id: &str) {
        let _ = self.api.delete_sandbox(self.caller, id).await;
        self.sandboxes.remove(id);
    }

    /// A new build sandbox of `image` (tracked for deletion).
    async fn sandbox_of(&mut self, image: &str) -> ApiResult<String> {
        let sb = self
            .api
            .create_sandbox(
                self.caller,
                CreateSandboxRequest {
                    network: NetworkPolicy {
                        mode: self.req.network,
                        allow: Vec::new(),
                    },
                    ..build_sandbox_request(image, &self.req.name)
                },
            )
            .await?;
        self.sandboxes.add(&sb.id);
        Ok(sb.id)
    }

    /// Runs (or finds in the cache) one step; true when cached.
    #[allow(clippy::too_many_arguments)]
    async fn step(
        &mut self,
        stage: &PlannedStage,
        step: &Step,
        number: usize,
        steps: usize,
        run: &mut StageRun,
        results: &[Layered],
        context: &Arc<Context>,
    ) -> ApiResult<bool> {
        // What the step copies decides its key as much as the instruction does.
        let mut prepared: Option<PreparedCopy> = None;
        let extra = match &step.kind {
            StepKind::Copy(c) => match &c.from {
                CopyFrom::Context => {
                    let p = prepare_context_copy(context, c, false, step).await?;
                    let digest = p.digest.clone();
                    prepared = Some(p);
                    digest
                }
                CopyFrom::Stage(i) => results
                    .get(*i)
                    .map(|l| l.digest.clone())
                    .ok_or_else(|| at(step, ErrorCode::BadRequest, "source stage not built"))?,
                CopyFrom::Image(r) => self.ensure(r).await?.0.digest,
            },
            _ => String::new(),
        };
        let name = step_cache_name(&run.parent.digest, step, &extra);
        let stage_name = stage
            .name
            .clone()
            .unwrap_or_else(|| stage.index.to_string());
        let announce = |cached: bool| BuildEvent::Step {
            step: number,
            steps,
            stage: stage_name.clone(),
            line: step.line,
            text: step.text.clone(),
            cached,
        };
        if !self.req.no_cache {
            if let Ok(img) = self.node.image(&name).await {
                self.emit(announce(true));
                // The build sandbox (if any) is behind the cached image now.
                if let Some(id) = run.sandbox.take() {
                    self.delete(&id).await;
                }
                run.parent = Layered {
                    name,
                    digest: img.digest,
                };
                return Ok(true);
            }
        }
        self.emit(announce(false));
        let id = match run.sandbox.clone() {
            Some(id) => id,
            None => {
                let id = self.sandbox_of(&run.parent.name).await?;
                run.sandbox = Some(id.clone());
                id
            }
        };
        match &step.kind {
            StepKind::Run(r) => self.run_step(&id, step, r).await?,
            StepKind::Mkdir { path, user } => self.mkdir_step(&id, step, path, user).await?,
            StepKind::Copy(c) => match &c.from {
                CopyFrom::Context => {
                    let mut p = prepared
                        .take()
                        .ok_or_else(|| at(step, ErrorCode::Internal, "copy not prepared"))?;
                    if needs_dest_kind(c) && self.is_dir(&id, &c.dest).await {
                        p = prepare_context_copy(context, c, true, step).await?;
                    }
                    self.put(&id, step, c, p).await?;
                }
                CopyFrom::Stage(i) => {
                    let source = results[*i].name.clone();
                    self.copy_from_image(&id, step, c, &source).await?;
                }
                CopyFrom::Image(r) => {
                    let source = self.ensure(r).await?.0.name;
                    self.copy_from_image(&id, step, c, &source).await?;
                }
            },
        }
        let img = self
            .api
            .commit_sandbox(self.caller, &id, CommitRequest { name: name.clone() })
            .await?;
        run.parent = Layered {
            name,
            digest: img.digest,
        };
        Ok(false)
    }

    async fn run_step(
        &mut self,
        id: &str,
        step: &Step,
        r: &dsec_dockerfile::RunStep,
    ) -> ApiResult<()> {
        let req = ExecRequest {
            cmd: dsec_wire::agent::Command::Argv(r.cmd.clone()),
            env: r.env.iter().cloned().collect(),
            cwd: Some(r.workdir.clone()),
            stdin: None,
            timeout_s: Some(self.req.step_timeout_s.unwrap_or(STEP_TIMEOUT_S)),
            output_limit: None,
            user: r.user.clone(),
            request_id: None,
        };
        let mut events = self
            .api
            .exec_stream(self.caller, id, req)
            .await
            .map_err(|e| at(step, e.code, format!("RUN could not start: {}", e.message)))?;
        let mut tail = String::new();
        let keep = |tail: &mut String, data: &str| {
            tail.push_str(data);
            if tail.len() > 2 * OUTPUT_TAIL {
                let cut = tail.len() - OUTPUT_TAIL;
                let cut = (cut..tail.len())
                    .find(|i| tail.is_char_boundary(*i))
                    .unwrap_or(tail.len());
                tail.drain(..cut);
            }
        };
        while let Some(ev) = events.next().await {
            match ev {
                ExecEvent::Stdout { data } => {
                    keep(&mut tail, &data);
                    self.emit(BuildEvent::Output {
                        stream: "stdout".into(),
                        data,
                    });
                }
                ExecEvent::Stderr { data } => {
                    keep(&mut tail, &data);
                    self.emit(BuildEvent::Output {
                        stream: "stderr".into(),
                        data,
                    });
                }
                ExecEvent::Exit { exit, oom_killed } => {
                    if exit.exit_code == Some(0) {
                        return Ok(());
                    }
                    let how = match (exit.exit_code, exit.signal) {
                        _ if exit.timed_out => "timed out".to_string(),
                        _ if oom_killed => "killed: out of memory".to_string(),
                        (Some(c), _) => format!("exit code {c}"),
                        (None, Some(s)) => format!("killed by signal {s}"),
                        (None, None) => "ended without an exit code".to_string(),
                    };
                    let tail = last_chars(&tail, OUTPUT_TAIL);
                    return Err(at(
                        step,
                        ErrorCode::Failed,
                        format!("RUN failed: {how}; output ends:\n{tail}"),
                    ));
                }
                ExecEvent::Error { error } => {
                    return Err(at(
                        step,
                        error.code,
                        format!("RUN failed: {}", error.message),
                    ))
                }
                _ => {}
            }
        }
        Err(at(step, ErrorCode::Failed, "RUN ended without an exit"))
    }

    async fn mkdir_step(
        &mut self,
        id: &str,
        step: &Step,
        path: &str,
        user: &Option<String>,
    ) -> ApiResult<()> {
        match self.api.stat_file(self.caller, id, path).await {
            Ok(info) if info.kind == FileKind::Dir => return Ok(()),
            Ok(_) => {
                return Err(at(
                    step,
                    ErrorCode::BadRequest,
                    format!("{path} exists and is not a directory"),
                ))
            }
            Err(_) => {}
        }
        self.api
            .mkdir(self.caller, id, MkdirRequest { path: path.into() })
            .await?;
        if let Some(user) = user.as_deref().filter(|u| !is_root(u)) {
            self.chown(id, step, user, &[path.to_string()]).await?;
        }
        Ok(())
    }

    async fn is_dir(&self, id: &str, path: &str) -> bool {
        matches!(self.api.stat_file(self.caller, id, path).await,
                 Ok(info) if info.kind == FileKind::Dir)
    }

    /// Uploads a prepared copy at `/` and applies `--chown`.
    async fn put(&mut self, id: &str, step: &Step, c: &CopyStep, p: PreparedCopy) -> ApiResult<()> {
        if p.paths.is_empty() {
            return Ok(());
        }
        let file = tokio::fs::File::from_std(p.tar);
        let body: ByteStream = tokio_util::io::ReaderStream::new(file)
            .map(|r| r.map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string())))
            .boxed();
        self.api
            .upload_tar(self.caller, id, "/", body, None)
            .await
            .map_err(|e| at(step, e.code, e.message))?;
        if let Some(owner) = c.chown.as_deref().filter(|o| !is_root(o)) {
            self.chown(id, step, owner, &p.paths).await?;
        }
        Ok(())
    }

    /// `chown -h OWNER` of `paths`, with the image's own chown (names resolve in its
    /// `/etc/passwd`).
    async fn chown(
        &mut self,
        id: &str,
        step: &Step,
        owner: &str,
        paths: &[String],
    ) -> ApiResult<()> {
        let mut stdin = String::new();
        for p in paths {
            stdin.push_str(p);
            stdin.push('\0');
        }
        let r = self
            .api
            .exec(
                self.caller,
                id,
                ExecRequest {
                    cmd: dsec_wire::agent::Command::Argv(vec![
                        "xargs".into(),
                        "-0".into(),
                        "chown".into(),
                        "-h".into(),
                        owner.into(),
                    ]),
                    env: Default::default(),
                    cwd: Some("/".into()),
                    stdin: Some(stdin),
                    timeout_s: Some(600.0),
                    output_limit: None,
                    user: Some("0:0".into()),
                    request_id: None,
                },
            )
            .await?;
        if r.exit.exit_code != Some(0) {
            return Err(at(
                step,
                ErrorCode::Failed,
                format!(
                    "--chown={owner} failed (the image needs xargs and chown): {}",
                    last_chars(&r.stderr, OUTPUT_TAIL)
                ),
            ));
        }
        Ok(())
    }

    /// `COPY --from=<stage or image>`: each source read from a sandbox of `source`.
    async fn copy_from_image(
        &mut self,
        id: &str,
        step: &Step,
        c: &CopyStep,
        source: &str,
    ) -> ApiResult<()> {
        let from = self.sandbox_of(source).await?;
        let res = self.copy_from_sandbox(id, step, c, &from).await;
        self.delete(&from).await;
        res
    }

    async fn copy_from_sandbox(
        &mut self,
        id: &str,
        step: &Step,
        c: &CopyStep,
        from: &str,
    ) -> ApiResult<()> {
        let mut matched = Vec::new();
        for src in &c.sources {
            matched.extend(self.expand_source(from, step, src).await?);
        }
        let many = matched.len() > 1;
        let dest_is_dir = many
            || (c.sources.len() == 1 && !c.dest.ends_with('/') && self.is_dir(id, &c.dest).await);
        for written in matched {
            let (path, info) = self.resolve_source(from, step, &written).await?;
            let stream = self
                .api
                .download_tar(self.caller, from, &path)
                .await
                .map_err(|e| at(step, e.code, e.message))?;
            let tar = spool(stream)
                .await
                .map_err(|e| at(step, e.code, e.message))?;
            // A directory's tar holds its contents; a file's holds it under its name.
            let inner = match info.kind {
                FileKind::Dir => ".".to_string(),
                _ => info.name.clone(),
            };
            // A file reached through a symlink keeps the name the source was written
            // with, as Docker names it: `COPY --from=s /d/link /out/` makes `/out/link`.
            let written_name = written.rsplit('/').next().unwrap_or_default();
            let into_dir = dest_is_dir || c.dest.ends_with('/');
            let (dest, dest_is_dir) =
                if info.kind != FileKind::Dir && into_dir && written_name != info.name {
                    (
                        format!("{}/{written_name}", c.dest.trim_end_matches('/')),
                        false,
                    )
                } else {
                    (c.dest.clone(), dest_is_dir)
                };
            let sub = CopyStep {
                from: CopyFrom::Context,
                sources: vec![inner],
                dest,
                chown: c.chown.clone(),
                chmod: c.chmod,
                extract_tars: false,
            };
            let p = tokio::task::spawn_blocking(move || {
                let ctx =
                    Context::open(tar, false, &Limits::default()).map_err(|e| e.to_string())?;
                copy_to_temp(&ctx, &sub, dest_is_dir)
            })
            .await
            .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?
            .map_err(|e| at(step, ErrorCode::BadRequest, e))?;
            self.put(id, step, c, p).await?;
        }
        Ok(())
    }

    /// The absolute paths a `COPY --from` source names in sandbox `from`: the source
    /// itself, or, with wildcards in it (Go's `filepath.Match` per component, as Docker
    /// matches), every existing match in name order. No match is an error.
    async fn expand_source(&self, from: &str, step: &Step, src: &str) -> ApiResult<Vec<String>> {
        let clean = normalize_abs(src);
        let comps: Vec<&str> = clean.split('/').filter(|c| !c.is_empty()).collect();
        if !comps.iter().any(|c| has_wildcards(c)) {
            return Ok(vec![clean]);
        }
        let mut current = vec![String::new()];
        for comp in comps {
            let mut next = Vec::new();
            if has_wildcards(comp) {
                let pattern = Pattern::compile(comp).map_err(|reason| {
                    at(
                        step,
                        ErrorCode::BadRequest,
                        format!("invalid source pattern {src:?}: {reason}"),
                    )
                })?;
                for dir in &current {
                    let list_at = if dir.is_empty() { "/" } else { dir.as_str() };
                    // Not a directory (or gone): nothing under it matches.
                    let Ok(list) = self.api.list_files(self.caller, from, list_at).await else {
                        continue;
                    };
                    next.extend(
                        list.entries
                            .iter()
                            .filter(|e| pattern.matches(&e.name))
                            .map(|e| format!("{dir}/{}", e.name)),
                    );
                }
            } else {
                for dir in &current {
                    let path = format!("{dir}/{comp}");
                    if self.api.stat_file(self.caller, from, &path).await.is_ok() {
                        next.push(path);
                    }
                }
            }
            current = next;
            if current.is_empty() {
                break;
            }
        }
        if current.is_empty() {
            return Err(at(
                step,
                ErrorCode::BadRequest,
                format!("no source files were specified: {src:?} matches nothing"),
            ));
        }
        current.sort();
        Ok(current)
    }

    /// The path `src` names in sandbox `from`, symlinks followed, and its metadata.
    async fn resolve_source(
        &self,
        from: &str,
        step: &Step,
        src: &str,
    ) -> ApiResult<(String, FileInfo)> {
        let mut path = normalize_abs(src);
        for _ in 0..MAX_SYMLINKS {
            let info = self
                .api
                .stat_file(self.caller, from, &path)
                .await
                .map_err(|e| at(step, e.code, format!("source {src}: {}", e.message)))?;
            match (&info.kind, &info.symlink_target) {
                (FileKind::Symlink, Some(target)) => {
                    path = if target.starts_with('/') {
                        normalize_abs(target)
                    } else {
                        let parent = path.rsplit_once('/').map_or("", |(p, _)| p);
                        normalize_abs(&format!("{parent}/{target}"))
                    };
                }
                _ => return Ok((path, info)),
            }
        }
        Err(at(
            step,
            ErrorCode::BadRequest,
            format!("source {src}: too many levels of symlinks"),
        ))
    }
}

/// The build sandbox of a stage and the image its next step stands on.
struct StageRun {
    parent: Layered,
    sandbox: Option<String>,
}

/// A copy made into a temp tar, ready to upload.
struct PreparedCopy {
    tar: std::fs::File,
    digest: String,
    paths: Vec<String>,
}

/// Whether where a copy lands depends on whether its destination is a directory: one
/// plain source to a destination without a trailing `/`.
fn needs_dest_kind(c: &CopyStep) -> bool {
    c.sources.len() == 1 && !c.dest.ends_with('/') && !c.sources[0].contains(['*', '?', '['])
}

async fn prepare_context_copy(
    context: &Arc<Context>,
    c: &CopyStep,
    dest_is_dir: bool,
    step: &Step,
) -> ApiResult<PreparedCopy> {
    let (ctx, c) = (context.clone(), c.clone());
    tokio::task::spawn_blocking(move || copy_to_temp(&ctx, &c, dest_is_dir))
        .await
        .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?
        .map_err(|e| at(step, ErrorCode::BadRequest, e))
}

fn copy_to_temp(ctx: &Context, c: &CopyStep, dest_is_dir: bool) -> Result<PreparedCopy, String> {
    let mut tar = tempfile::tempfile().map_err(|e| format!("temp file: {e}"))?;
    let out = ctx
        .copy(c, dest_is_dir, (0, 0), &mut tar)
        .map_err(|e| e.to_string())?;
    tar.seek(SeekFrom::Start(0))
        .map_err(|e| format!("temp file: {e}"))?;
    Ok(PreparedCopy {
        tar,
        digest: out.digest,
        paths: out.paths,
    })
}

/// A tar of one entry, the root directory (0755, root:root, mtime 0): the content of the
/// scratch image.
fn empty_root_tar() -> std::io::Result<Vec<u8>> {
    let mut h = tar::Header::new_ustar();
    h.set_entry_type(tar::EntryType::Directory);
    h.set_mode(0o755);
    h.set_mtime(0);
    h.set_size(0);
    h.set_uid(0);
    h.set_gid(0);
    // `./`: set_path refuses a name that cleans to nothing.
    if let Some(u) = h.as_ustar_mut() {
        u.name[..2].copy_from_slice(b"./");
    }
    h.set_cksum();
    let mut b = tar::Builder::new(Vec::new());
    b.append(&h, std::io::empty())?;
    b.into_inner()
}

/// Writes a tar stream into an unnamed temp file.
async fn spool(mut stream: ByteStream) -> ApiResult<std::fs::File> {
    use tokio::io::AsyncWriteExt;
    let file = tempfile::tempfile()
        .map_err(|e| ApiError::new(ErrorCode::Internal, format!("temp file: {e}")))?;
    let mut out = tokio::fs::File::from_std(file);
    while let Some(chunk) = stream.next().await {
        out.write_all(&chunk?)
            .await
            .map_err(|e| ApiError::new(ErrorCode::NoSpace, format!("temp file: {e}")))?;
    }
    out.flush()
        .await
        .map_err(|e| ApiError::new(ErrorCode::Internal, format!("temp file: {e}")))?;
    let mut file = out.into_std().await;
    file.seek(SeekFrom::Start(0))
        .map_err(|e| ApiError::new(ErrorCode::Internal, format!("temp file: {e}")))?;
    Ok(file)
}

/// The text of member `path` of the tar `file` (the Dockerfile), read whatever
/// `.dockerignore` says.
fn read_member(file: &std::fs::File, path: &str) -> ApiResult<String> {
    let want = clean_rel(path);
    let mut f = file;
    f.seek(SeekFrom::Start(0))
        .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
    let mut archive = tar::Archive::new(f);
    let entries = archive
        .entries()
        .map_err(|e| bad(format!("build context: not a tar archive: {e}")))?;
    let mut found = None;
    for entry in entries {
        let entry = entry.map_err(|e| bad(format!("build context: reading tar: {e}")))?;
        let name = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        if clean_rel(&name) != want {
            continue;
        }
        if entry.header().entry_type() != tar::EntryType::Regular
            && entry.header().entry_type() != tar::EntryType::Continuous
        {
            return Err(bad(format!("{path} in the build context is not a file")));
        }
        let mut text = String::new();
        entry
            .take(MAX_DOCKERFILE + 1)
            .read_to_string(&mut text)
            .map_err(|e| bad(format!("{path}: {e}")))?;
        if text.len() as u64 > MAX_DOCKERFILE {
            return Err(bad(format!("{path} is larger than {MAX_DOCKERFILE} bytes")));
        }
        // A later member of the same name replaces an earlier one.
        found = Some(text);
    }
    let mut f = file;
    f.seek(SeekFrom::Start(0))
        .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
    found.ok_or_else(|| bad(format!("the build context has no {path}")))
}

/// `./a//b/` -> `a/b`.
fn clean_rel(p: &str) -> String {
    p.split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect::<Vec<_>>()
        .join("/")
}

/// An absolute path with `.`, `..` and doubled slashes resolved lexically.
fn normalize_abs(p: &str) -> String {
    let mut out: Vec<&str> = Vec::new();
    for c in p.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            c => out.push(c),
        }
    }
    format!("/{}", out.join("/"))
}

fn is_root(user: &str) -> bool {
    matches!(
        user,
        "root" | "0" | "0:0" | "root:root" | "root:0" | "0:root"
    )
}

fn last_chars(s: &str, n: usize) -> &str {
    if n == 0 {
        return "";
    }
    match s.char_indices().rev().nth(n - 1) {
        Some((i, _)) => &s[i..],
        None => s,
    }
}

/// The build-cache name of `step` on top of the image `parent_digest`; `extra` is what
/// the step copies (a content digest, a source image digest) or empty.
fn step_cache_name(parent_digest: &str, step: &Step, extra: &str) -> String {
    let mut h = Sha256::new();
    h.update(b"dockerfile\n");
    h.update(parent_digest.as_bytes());
    h.update(b"\n");
    h.update(serde_json::to_vec(&step.cache_key()).unwrap_or_default());
    h.update(b"\n");
    h.update(extra.as_bytes());
    format!("build-cache/{}", &hex::encode(h.finalize())[..32])
}

/// An image's config as the planner sees it.
fn from_wire(c: &ImageConfig) -> dsec_dockerfile::ImageConfig {
    dsec_dockerfile::ImageConfig {
        env: c.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        workdir: c.workdir.clone(),
        user: c.user.clone(),
        entrypoint: (!c.entrypoint.is_empty()).then(|| c.entrypoint.clone()),
        cmd: (!c.cmd.is_empty()).then(|| c.cmd.clone()),
        labels: c.labels.clone(),
        ..Default::default()
    }
}

/// A stage's final config as the image config dsec keeps.
fn to_wire(c: &dsec_dockerfile::ImageConfig) -> ImageConfig {
    ImageConfig {
        env: c.env.iter().cloned().collect(),
        workdir: c.workdir.clone(),
        user: c.user.clone(),
        entrypoint: c.entrypoint.clone().unwrap_or_default(),
        cmd: c.cmd.clone().unwrap_or_default(),
        labels: c.labels.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_normalize() {
        assert_eq!(normalize_abs("a/../b//c/."), "/b/c");
        assert_eq!(normalize_abs("/../.."), "/");
        assert_eq!(clean_rel("./docker/Dockerfile"), "docker/Dockerfile");
        assert_eq!(last_chars("héllo", 3), "llo");
        assert_eq!(last_chars("hi", 5), "hi");
    }

    #[test]
    fn configs_round_trip() {
        let wire = ImageConfig {
            env: [("PATH".to_string(), "/bin".to_string())].into(),
            workdir: Some("/app".into()),
            user: Some("1000".into()),
            entrypoint: vec!["/bin/sh".into()],
            cmd: vec![],
            labels: [("a".to_string(), "b".to_string())].into(),
        };
        assert_eq!(to_wire(&from_wire(&wire)), wire);
    }
}

//! Dockerfile builds (`dsec_control::build::dockerfile`) over a `FakeNode`: the build
//! cache, failures, a client that goes away, refusals before any sandbox, `FROM scratch`
//! and `COPY --from`, without root. The fake keeps files in memory (images carry them),
//! so each test checks what the built image holds as well as what the node was asked.

mod common;

use std::io::{Seek, SeekFrom, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::op;
use dsec_control::build::dockerfile::{self, MAX_STEPS};
use dsec_control::{ControlConfig, ControlPlane, SandboxApi};
use dsec_node_api::fake::{shell_request, FakeNode};
use dsec_node_api::NodeApi;
use dsec_state::RedbStore;
use dsec_wire::v1::{BuildEvent, CreateSandboxRequest, DockerfileBuildRequest, Image};
use dsec_wire::{ApiError, ErrorCode};
use futures::StreamExt;

struct Fixture {
    node: Arc<FakeNode>,
    plane: Arc<ControlPlane>,
    _dir: tempfile::TempDir,
}

impl Fixture {
    /// A plane over a fake node that has the image `base` (no files) and
    /// `base-with-etc` (a few).
    async fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let store =
            Arc::new(RedbStore::open(&dir.path().join("state.redb")).expect("open the store"));
        let node = Arc::new(FakeNode::new("fake-1"));
        node.add_image_with_files("base-with-etc", &[("/etc/os-release", b"ID=fake\n")]);
        let mut cfg = ControlConfig::with_key("k".into());
        cfg.reap_interval = Duration::from_millis(50);
        let plane = ControlPlane::open(cfg, node.clone(), store)
            .await
            .unwrap_or_else(|e| panic!("open the plane: {e:?}"));
        Self {
            node,
            plane,
            _dir: dir,
        }
    }

    /// Builds `dockerfile` with the other `files` as its context, naming the result
    /// `name`, through the plane (as `POST /v1/images/build/dockerfile` does): every
    /// event but the last, and the result.
    async fn build(
        &self,
        name: &str,
        dockerfile: &str,
        files: &[(&str, &str)],
    ) -> (Vec<BuildEvent>, Result<Built, ApiError>) {
        self.build_context(name, context(dockerfile, files)).await
    }

    /// [`Fixture::build`] of a context made by the test.
    async fn build_context(
        &self,
        name: &str,
        context: std::fs::File,
    ) -> (Vec<BuildEvent>, Result<Built, ApiError>) {
        let stream = self
            .plane
            .build_dockerfile(op(), request(name), context)
            .await
            .unwrap_or_else(|e| panic!("the build did not start: {e:?}"));
        let mut events: Vec<BuildEvent> = stream.collect().await;
        let end = match events.pop() {
            Some(BuildEvent::Done {
                image,
                steps,
                cached,
            }) => Ok(Built {
                image,
                steps,
                cached,
            }),
            Some(BuildEvent::Error { error }) => Err(error),
            other => panic!("the build ended with {other:?}"),
        };
        (events, end)
    }

    /// What the node was asked so far.
    fn counts(&self) -> Counts {
        let c = &self.node.counters;
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Counts {
            create_calls: n(&c.create_calls),
            creates: n(&c.creates),
            commits: n(&c.commits),
            imports: n(&c.imports),
            uploads: n(&c.tar_uploads),
            downloads: n(&c.tar_downloads),
            execs: n(&c.execs),
        }
    }

    /// Nothing of a build is left: no sandbox on the node, no record in the plane.
    async fn assert_no_sandbox_left(&self) {
        assert_eq!(
            self.node.sandbox_ids(),
            Vec::<String>::new(),
            "node sandboxes"
        );
        let listed = self
            .plane
            .list_sandboxes(op(), Default::default())
            .await
            .unwrap_or_else(|e| panic!("list: {e:?}"));
        assert!(listed.sandboxes.is_empty(), "records: {listed:?}");
    }

    /// The regular files of image `name` as text.
    fn files_of(&self, name: &str) -> Vec<(String, String)> {
        self.node
            .image_files(name)
            .unwrap_or_else(|| panic!("no image {name}"))
            .into_iter()
            .map(|(p, b)| (p, String::from_utf8_lossy(&b).into_owned()))
            .collect()
    }
}

/// A finished build, from its `Done` event.
#[derive(Debug)]
struct Built {
    image: Image,
    steps: usize,
    cached: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Counts {
    create_calls: u64,
    creates: u64,
    commits: u64,
    imports: u64,
    uploads: u64,
    downloads: u64,
    execs: u64,
}

impl std::ops::Sub for Counts {
    type Output = Counts;
    fn sub(self, o: Counts) -> Counts {
        Counts {
            create_calls: self.create_calls - o.create_calls,
            creates: self.creates - o.creates,
            commits: self.commits - o.commits,
            imports: self.imports - o.imports,
            uploads: self.uploads - o.uploads,
            downloads: self.downloads - o.downloads,
            execs: self.execs - o.execs,
        }
    }
}

fn request(name: &str) -> DockerfileBuildRequest {
    DockerfileBuildRequest {
        name: name.into(),
        ..Default::default()
    }
}

/// A build context as the client sends it: a tar (in an unnamed temp file) holding
/// `Dockerfile` at its root and `files` (paths relative to the context).
fn context(dockerfile: &str, files: &[(&str, &str)]) -> std::fs::File {
    context_with_links(dockerfile, files, &[])
}

/// [`context`] with symlinks too (path, target).
fn context_with_links(
    dockerfile: &str,
    files: &[(&str, &str)],
    links: &[(&str, &str)],
) -> std::fs::File {
    let mut file = tempfile::tempfile().expect("temp file");
    {
        let mut tar = tar::Builder::new(&mut file);
        let header = |kind, mode, size| {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(kind);
            h.set_mode(mode);
            h.set_mtime(1_700_000_000);
            h.set_size(size);
            h
        };
        for (path, text) in std::iter::once(&("Dockerfile", dockerfile)).chain(files) {
            let mut h = header(tar::EntryType::Regular, 0o644, text.len() as u64);
            tar.append_data(&mut h, path, text.as_bytes())
                .unwrap_or_else(|e| panic!("tar {path}: {e}"));
        }
        for (path, target) in links {
            let mut h = header(tar::EntryType::Symlink, 0o777, 0);
            tar.append_link(&mut h, path, target)
                .unwrap_or_else(|e| panic!("tar {path}: {e}"));
        }
        tar.finish().expect("tar end");
    }
    file.flush().expect("flush");
    file.seek(SeekFrom::Start(0)).expect("rewind");
    file
}

/// The `cached` flag of each step event, in order.
fn cached_flags(events: &[BuildEvent]) -> Vec<bool> {
    events
        .iter()
        .filter_map(|e| match e {
            BuildEvent::Step { cached, .. } => Some(*cached),
            _ => None,
        })
        .collect()
}

fn file(path: &str, text: &str) -> (String, String) {
    (path.to_string(), text.to_string())
}

const APP: &str = "FROM base
RUN echo one > /one
WORKDIR /app
COPY msg .
RUN cat msg > out
";

#[tokio::test]
async fn a_rebuild_takes_every_step_from_the_cache_and_a_change_reruns_from_its_copy() {
    let fx = Fixture::new().await;

    // First build: every step runs, in one build sandbox, and is committed.
    let before = fx.counts();
    let (events, res) = fx
        .build("demo", APP, &[("msg", "hello\n"), ("other", "x")])
        .await;
    let first = res.unwrap_or_else(|e| panic!("first build: {e:?}"));
    assert_eq!((first.steps, first.cached), (4, 0));
    assert_eq!(cached_flags(&events), [false; 4]);
    assert_eq!(first.image.name, "demo");
    assert_eq!(first.image.config.workdir.as_deref(), Some("/app"));
    let ran = fx.counts() - before;
    assert_eq!(
        (ran.creates, ran.commits, ran.uploads, ran.execs),
        (1, 4, 1, 2),
        "one build sandbox, a commit per step, one COPY, two RUNs"
    );
    assert_eq!(
        fx.files_of("demo"),
        [
            file("/app/msg", "hello\n"),
            file("/app/out", "hello\n"),
            file("/one", "one\n"),
        ]
    );
    fx.assert_no_sandbox_left().await;

    // The same context again: every step is a cache hit, nothing runs.
    let before = fx.counts();
    let (events, res) = fx
        .build("demo", APP, &[("msg", "hello\n"), ("other", "x")])
        .await;
    let again = res.unwrap_or_else(|e| panic!("second build: {e:?}"));
    assert_eq!((again.steps, again.cached), (4, 4));
    assert_eq!(cached_flags(&events), [true; 4]);
    assert_eq!(
        fx.counts() - before,
        Counts {
            create_calls: 0,
            creates: 0,
            commits: 0,
            imports: 0,
            uploads: 0,
            downloads: 0,
            execs: 0,
        },
        "a cached build asks the node for nothing but images"
    );
    assert_eq!(again.image.digest, first.image.digest);

    // One context file changed: the steps before its COPY are cached, the COPY and
    // everything after it run again.
    let before = fx.counts();
    let (events, res) = fx
        .build("demo", APP, &[("msg", "bye\n"), ("other", "x")])
        .await;
    let changed = res.unwrap_or_else(|e| panic!("third build: {e:?}"));
    assert_eq!((changed.steps, changed.cached), (4, 2));
    assert_eq!(cached_flags(&events), [true, true, false, false]);
    let ran = fx.counts() - before;
    assert_eq!(
        (ran.creates, ran.commits, ran.uploads, ran.execs),
        (1, 2, 1, 1)
    );
    assert_ne!(changed.image.digest, first.image.digest);
    assert_eq!(
        fx.files_of("demo"),
        [
            file("/app/msg", "bye\n"),
            file("/app/out", "bye\n"),
            file("/one", "one\n"),
        ]
    );
    fx.assert_no_sandbox_left().await;

    // A sandbox of the result starts with its files.
    let sb = fx
        .plane
        .create_sandbox(
            op(),
            CreateSandboxRequest {
                image: Some("demo".into()),
                ..Default::default()
            },
        )
        .await
        .unwrap_or_else(|e| panic!("create: {e:?}"));
    let r = fx
        .plane
        .exec(op(), &sb.id, shell_request("cat /app/out /one"))
        .await
        .unwrap_or_else(|e| panic!("exec: {e:?}"));
    assert_eq!(r.stdout, "bye\none\n");
}

#[tokio::test]
async fn a_failing_run_names_its_line_names_nothing_and_leaves_no_sandbox() {
    let fx = Fixture::new().await;
    let before = fx.counts();
    let (events, res) = fx
        .build(
            "broken",
            "FROM base\nRUN echo start\n\nRUN exit 3\nRUN echo never\n",
            &[],
        )
        .await;
    let e = res.expect_err("exit 3 fails the build");
    assert_eq!(e.code, ErrorCode::Failed);
    assert!(
        e.message.contains("Dockerfile line 4 (RUN exit 3)") && e.message.contains("exit code 3"),
        "{}",
        e.message
    );
    assert!(
        events.iter().any(|e| matches!(e,
            BuildEvent::Output { stream, data } if stream == "stdout" && data == "start\n")),
        "the first RUN's output is forwarded: {events:?}"
    );
    assert_eq!(cached_flags(&events), [false, false], "no third step");
    assert!(fx.node.image_files("broken").is_none(), "nothing named");
    let ran = fx.counts() - before;
    assert_eq!((ran.creates, ran.commits), (1, 1));
    fx.assert_no_sandbox_left().await;

    // A failing `COPY --from` holds two sandboxes (the stage's and the source's): both
    // go.
    let before = fx.counts();
    let (_, res) = fx
        .build(
            "broken",
            "FROM base AS src\nRUN echo x > /x\nFROM base\nRUN true\nCOPY --from=src /missing /m\n",
            &[],
        )
        .await;
    let e = res.expect_err("no such source");
    assert!(
        e.message
            .contains("Dockerfile line 5 (COPY --from=src /missing /m)"),
        "{}",
        e.message
    );
    assert_eq!((fx.counts() - before).creates, 3);
    assert!(fx.node.image_files("broken").is_none(), "nothing named");
    fx.assert_no_sandbox_left().await;
}

#[tokio::test]
async fn a_client_gone_before_the_build_stops_it_before_any_sandbox() {
    let fx = Fixture::new().await;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    drop(rx);
    let node: Arc<dyn NodeApi> = fx.node.clone();
    let e = dockerfile::build(
        &*fx.plane,
        op(),
        node,
        request("gone"),
        context(APP, &[("msg", "hello\n")]),
        tx,
    )
    .await
    .expect_err("nobody listens");
    assert_eq!(e.code, ErrorCode::Failed);
    assert!(e.message.contains("cancelled"), "{}", e.message);
    assert_eq!(fx.counts().create_calls, 0);
    assert!(fx.node.image_files("gone").is_none());
    fx.assert_no_sandbox_left().await;
}

#[tokio::test]
async fn a_client_gone_during_the_build_stops_it_at_the_next_step() {
    let fx = Fixture::new().await;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let node: Arc<dyn NodeApi> = fx.node.clone();
    // The first step's sandbox waits on the node until the client is gone.
    fx.node.stall_creates(true);
    let plane = fx.plane.clone();
    let build = tokio::spawn(async move {
        dockerfile::build(
            &*plane,
            op(),
            node,
            request("gone"),
            context("FROM base\nRUN echo 1\nRUN echo 2\nRUN echo 3\n", &[]),
            tx,
        )
        .await
    });
    let first = tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .expect("the first step within 5 s");
    assert!(
        matches!(first, Some(BuildEvent::Step { step: 1, .. })),
        "{first:?}"
    );
    drop(rx);
    fx.node.stall_creates(false);
    let e = tokio::time::timeout(Duration::from_secs(5), build)
        .await
        .expect("the build ends within 5 s")
        .unwrap_or_else(|e| panic!("the build task: {e}"))
        .expect_err("nobody listens");
    assert!(e.message.contains("cancelled"), "{}", e.message);
    let c = fx.counts();
    assert_eq!(
        (c.creates, c.execs, c.commits),
        (1, 1, 1),
        "the step under way finished; none after it ran"
    );
    assert!(fx.node.image_files("gone").is_none(), "nothing named");
    fx.assert_no_sandbox_left().await;
}

#[tokio::test]
async fn an_unsupported_instruction_is_refused_before_any_sandbox() {
    let fx = Fixture::new().await;
    let (events, res) = fx
        .build(
            "onbuild",
            "FROM base\nRUN true\nONBUILD RUN echo later\n",
            &[],
        )
        .await;
    let e = res.expect_err("ONBUILD is not built");
    assert_eq!(e.code, ErrorCode::BadRequest);
    assert!(
        e.message.contains("line 3") && e.message.contains("ONBUILD"),
        "{}",
        e.message
    );
    assert!(cached_flags(&events).is_empty(), "no step: {events:?}");
    assert_eq!(fx.counts().create_calls, 0);
    assert!(fx.node.image_files("onbuild").is_none());
}

#[tokio::test]
async fn from_scratch_imports_its_empty_base_once_and_copies_into_it() {
    let fx = Fixture::new().await;
    let df = "FROM scratch\nCOPY hello.txt /hello.txt\n";
    let (_, res) = fx.build("tiny", df, &[("hello.txt", "hi\n")]).await;
    let built = res.unwrap_or_else(|e| panic!("scratch build: {e:?}"));
    assert_eq!((built.steps, built.cached), (1, 0));
    assert_eq!(
        fx.counts().imports,
        1,
        "build-cache/scratch made on first use"
    );
    assert_eq!(fx.files_of("build-cache/scratch"), []);
    assert_eq!(fx.files_of("tiny"), [file("/hello.txt", "hi\n")]);

    // Another scratch build (other content, so its COPY runs) stands on the same base.
    let (_, res) = fx.build("tiny-2", df, &[("hello.txt", "bye\n")]).await;
    let built = res.unwrap_or_else(|e| panic!("second scratch build: {e:?}"));
    assert_eq!((built.steps, built.cached), (1, 0));
    assert_eq!(fx.counts().imports, 1, "the scratch image is reused");
    assert_eq!(fx.files_of("tiny-2"), [file("/hello.txt", "bye\n")]);
    fx.assert_no_sandbox_left().await;
}

#[tokio::test]
async fn a_build_of_too_many_steps_is_refused_up_front() {
    let fx = Fixture::new().await;
    let mut df = String::from("FROM base\n");
    for i in 0..=MAX_STEPS {
        df.push_str(&format!("RUN echo {i}\n"));
    }
    let (events, res) = fx.build("huge", &df, &[]).await;
    let e = res.expect_err("too many steps");
    assert_eq!(e.code, ErrorCode::BadRequest);
    assert!(
        e.message
            .contains(&format!("{} steps; at most {MAX_STEPS}", MAX_STEPS + 1)),
        "{}",
        e.message
    );
    assert!(cached_flags(&events).is_empty(), "no step: {events:?}");
    assert_eq!(fx.counts().create_calls, 0);
    assert!(fx.node.image_files("huge").is_none());
}

#[tokio::test]
async fn copy_from_a_stage_takes_its_matches_out_of_a_sandbox_of_that_stage() {
    let fx = Fixture::new().await;
    let df = "FROM base-with-etc AS build
RUN echo built > /artifact
RUN echo other > /b
FROM base
COPY --from=build /art* /out/
COPY --from=build /etc /etc-copy
";
    let before = fx.counts();
    let (_, res) = fx.build("two-stages", df, &[]).await;
    let built = res.unwrap_or_else(|e| panic!("two-stage build: {e:?}"));
    assert_eq!((built.steps, built.cached), (4, 0));
    let ran = fx.counts() - before;
    assert_eq!(
        (ran.creates, ran.downloads),
        (4, 2),
        "a sandbox per stage and per COPY --from; one download per matched source"
    );
    assert_eq!(
        fx.files_of("two-stages"),
        [
            file("/etc-copy/os-release", "ID=fake\n"),
            file("/out/artifact", "built\n"),
        ],
        "the final stage holds what it copied, not the first stage's files"
    );
    fx.assert_no_sandbox_left().await;
}

/// Docker names a `COPY --from` source that is a symlink by the source as written and
/// copies what it leads to (BuildKit's `fsutil` copy: `prepareTargetDir(srcFollowed,
/// src, ...)` joins `filepath.Base(src)` onto a directory destination), as dsec's own
/// context copies do ("a key names the copy, what it leads to is copied",
/// `dsec-build-context`): `COPY --from=src /d/link /out/` makes `/out/link`, not
/// `/out/real`.
#[tokio::test]
async fn copy_from_a_symlink_into_a_directory_keeps_the_links_name() {
    let fx = Fixture::new().await;
    let df = "FROM base AS src\nCOPY d /d\nFROM base\nCOPY --from=src /d/link /out/\n";
    let ctx = context_with_links(df, &[("d/real", "real\n")], &[("d/link", "real")]);
    let (_, res) = fx.build_context("linked", ctx).await;
    res.unwrap_or_else(|e| panic!("build: {e:?}"));
    assert_eq!(
        fx.files_of("linked"),
        [file("/out/link", "real\n")],
        "the copy is named as the source was written"
    );
}

//! Hostile Dockerfile builds through the real CLI, API and server:
//! - `RUN` fork bombs: a loop of background jobs fails at the build sandbox's pids limit,
//!   a bomb that never ends is stopped by the step timeout, a classic bomb that detaches
//!   from its `RUN` is killed before the next step; each names its Dockerfile line;
//! - a `RUN` that fills its disk fails at the build sandbox's disk size (`--disk-mb`), and
//!   one that fills it and carries on still builds;
//! - a build context over the 8 GiB cap is refused from its declared length before
//!   anything is spooled, and a context tar whose headers claim more than it holds is
//!   refused as such;
//! - `kill -9` of the server while a `RUN` runs: the restarted server names nothing, the
//!   killed build's `RUN` no longer runs, and the same build then succeeds.
//!
//! After every case the build's result is not named, no sandbox labelled `dsec-build`
//! is left, nothing runs under the server's cgroup parent, and the server still creates
//! and runs sandboxes.
//!
//! The cases on the shared server take turns ([`SERIAL`]): "nothing runs under the
//! cgroup parent" must not see another case's sandboxes.

use std::path::Path;
use std::time::{Duration, Instant};

use dsec_e2e::{host, require_root, sh, wait_until, Server};
use dsec_wire::v1::*;
use dsec_wire::{ApiError, ErrorCode};
use futures::StreamExt;

/// Cgroup parent of this file's shared server (its own, so that what runs under it is
/// this file's doing).
const PARENT: &str = "dsec-dfh";
/// Each sandbox's writable disk on the servers of this file, in MiB: what bounds a `RUN`
/// that fills its disk (a Dockerfile build cannot ask for another size). The default
/// (10 GiB) would take tens of seconds and 10 GB of the host's disk to fill.
const DISK_MB: &str = "256";

fn server() -> &'static Server {
    Server::shared_with(
        "dockerfile-hostile",
        &["--cgroup-parent", PARENT, "--disk-mb", DISK_MB],
    )
}

/// Taken by every case on the shared server.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Runs the CLI against the shared server: (exit code, stdout, stderr).
fn dsec(args: &[&str]) -> (Option<i32>, String, String) {
    let s = server();
    dsec_e2e::run_cli(&s.url, &s.key, args)
}

fn write(dir: &Path, rel: &str, content: &str) {
    let p = dir.join(rel);
    std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
    std::fs::write(p, content).expect("write");
}

/// A build context (tar) holding `files`.
fn context_tar(files: &[(&str, &str)]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, content) in files {
        let mut h = tar::Header::new_gnu();
        h.set_size(content.len() as u64);
        h.set_mode(0o644);
        b.append_data(&mut h, name, content.as_bytes())
            .unwrap_or_else(|e| panic!("tar {name}: {e}"));
    }
    b.into_inner().unwrap_or_else(|e| panic!("tar: {e}"))
}

/// How an API build ended.
struct Outcome {
    /// The image, steps and cached steps; or the error event.
    result: Result<(Image, usize, usize), ApiError>,
    /// Everything the `RUN`s printed.
    output: String,
    elapsed: Duration,
}

/// Builds `req` from `tar` through the API and waits for its last event.
async fn build(c: &dsec_client::Client, req: &DockerfileBuildRequest, tar: Vec<u8>) -> Outcome {
    let t0 = Instant::now();
    let mut events = c
        .build_dockerfile(req, tar)
        .await
        .unwrap_or_else(|e| panic!("build {}: {e}", req.name));
    let mut output = String::new();
    while let Some(ev) = events.next().await {
        match ev.unwrap_or_else(|e| panic!("build {} event: {e}", req.name)) {
            BuildEvent::Output { data, .. } => output.push_str(&data),
            BuildEvent::Done {
                image,
                steps,
                cached,
            } => {
                return Outcome {
                    result: Ok((image, steps, cached)),
                    output,
                    elapsed: t0.elapsed(),
                }
            }
            BuildEvent::Error { error } => {
                return Outcome {
                    result: Err(error),
                    output,
                    elapsed: t0.elapsed(),
                }
            }
            _ => {}
        }
    }
    panic!("build {}: the stream ended without done or error", req.name)
}

async fn image_named(c: &dsec_client::Client, name: &str) -> bool {
    c.list_images()
        .await
        .unwrap_or_else(|e| panic!("images: {e}"))
        .images
        .iter()
        .any(|i| i.name == name)
}

/// Ids of the sandboxes of the build of `name` still there.
async fn build_sandboxes(c: &dsec_client::Client, name: &str) -> Vec<String> {
    let labels = [("dsec-build".to_string(), name.to_string())].into();
    c.list_sandboxes(labels)
        .await
        .unwrap_or_else(|e| panic!("list: {e}"))
        .sandboxes
        .into_iter()
        .map(|s| s.id)
        .collect()
}

/// The build of `name` failed as it should have: nothing named, no build sandbox left.
async fn assert_left_nothing(c: &dsec_client::Client, name: &str) {
    assert!(!image_named(c, name).await, "{name} was named");
    let left = build_sandboxes(c, name).await;
    assert!(left.is_empty(), "build sandboxes of {name} left: {left:?}");
}

/// The server answers, and a new sandbox is created and runs a command.
async fn assert_healthy(c: &dsec_client::Client) {
    let h = c.health().await.unwrap_or_else(|e| panic!("health: {e}"));
    assert_eq!(h.status, "ok", "{h:?}");
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            labels: [("suite".to_string(), "dockerfile-hostile".to_string())].into(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("create after the hostile build: {e}"));
    let r = c
        .exec(&sb.id, sh("echo alive; cat /etc/debian_version >/dev/null"))
        .await
        .unwrap_or_else(|e| panic!("exec after the hostile build: {e}"));
    assert_eq!(r.exit.exit_code, Some(0), "{r:?}");
    assert_eq!(r.stdout, "alive\n");
    c.delete_sandbox(&sb.id)
        .await
        .unwrap_or_else(|e| panic!("delete {}: {e}", sb.id));
}

/// Sandbox cgroups (`sb-*`) under cgroup parent `parent`, in any hierarchy.
fn sandbox_cgroups(parent: &str) -> Vec<String> {
    let mut roots: Vec<std::path::PathBuf> = std::fs::read_dir("/sys/fs/cgroup")
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    roots.push("/sys/fs/cgroup".into());
    let mut out: Vec<String> = roots
        .iter()
        .flat_map(|r| std::fs::read_dir(r.join(parent)).into_iter().flatten())
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("sb-"))
        .map(|e| e.path().display().to_string())
        .collect();
    out.sort();
    out
}

/// Host pids in a cgroup at or below `parent`.
fn processes_under(parent: &str) -> Vec<i32> {
    let prefix = format!("/{parent}/");
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
                .unwrap_or_default()
                .lines()
                .any(|l| l.rsplit(':').next().is_some_and(|p| p.starts_with(&prefix)))
        })
        .collect()
}

/// Once no sandbox exists on the server of cgroup parent `parent`: no sandbox cgroup and
/// no process is left under it (a bomb's children included).
async fn assert_host_clean(parent: &str) {
    let clean = wait_until(Duration::from_secs(15), || async {
        (sandbox_cgroups(parent).is_empty() && processes_under(parent).is_empty()).then_some(())
    })
    .await;
    assert!(
        clean.is_some(),
        "left under cgroup parent {parent}: cgroups {:?}, processes {:?}",
        sandbox_cgroups(parent),
        processes_under(parent)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn fork_bombs_in_run_steps_are_contained_and_name_their_line() {
    if !require_root() {
        return;
    }
    let _turn = SERIAL.lock().await;
    let c = server().client();

    // Background jobs until the pids limit: the shell cannot fork and fails the step.
    let dir = tempfile::tempdir().expect("tempdir");
    let ctx = dir.path();
    write(
        ctx,
        "Dockerfile",
        "FROM base\nRUN echo before > /before\n\
         RUN for i in $(seq 1 2000); do sleep 1000 & done; wait\nRUN echo never > /never\n",
    );
    let name = "e2e/dfh-bomb-jobs";
    let t0 = Instant::now();
    let (code, _, stderr) = dsec(&["image", "build", ctx.to_str().expect("utf-8"), name]);
    let took = t0.elapsed();
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("error: Dockerfile line 3"), "{stderr}");
    assert!(stderr.contains("RUN failed"), "{stderr}");
    assert!(stderr.contains("Cannot fork"), "{stderr}");
    assert!(took < Duration::from_secs(60), "took {took:?}");
    assert_left_nothing(&c, name).await;
    assert_host_clean(PARENT).await;
    assert_healthy(&c).await;

    // A bomb that never ends (bash retries failed forks): the step timeout stops it.
    let name = "e2e/dfh-bomb-forever";
    let req = DockerfileBuildRequest {
        name: name.into(),
        step_timeout_s: Some(5.0),
        ..Default::default()
    };
    let tar = context_tar(&[(
        "Dockerfile",
        "FROM base\nRUN echo before > /before\n\
         RUN [\"bash\", \"-c\", \"bomb() { bomb | bomb & }; while :; do bomb; done\"]\n\
         RUN echo never > /never\n",
    )]);
    let out = build(&c, &req, tar).await;
    let err = out
        .result
        .expect_err("a bomb that never ends must fail its build");
    assert_eq!(err.code, ErrorCode::Failed, "{err:?}");
    assert!(
        err.message.starts_with("Dockerfile line 3 (RUN [\"bash\""),
        "{}",
        err.message
    );
    assert!(err.message.contains("timed out"), "{}", err.message);
    assert!(
        out.elapsed < Duration::from_secs(45),
        "a 5 s step timeout took {:?}",
        out.elapsed
    );
    assert_left_nothing(&c, name).await;
    assert_host_clean(PARENT).await;
    assert_healthy(&c).await;

    // The classic bomb forks itself into the background and its shell exits 0 at once,
    // so the step succeeds, as with Docker; what it left running is killed with its
    // process group and gone before the next step has waited 30 s.
    let name = "e2e/dfh-bomb-detached";
    let tar = context_tar(&[(
        "Dockerfile",
        "FROM base\nRUN [\"bash\", \"-c\", \":(){ :|:& };:\"]\n\
         RUN n=0; while [ \"$(ls /proc | grep -c '^[0-9]')\" -gt 16 ]; do n=$((n+1)); \
         if [ $n -gt 300 ]; then echo the bomb still runs; exit 9; fi; sleep 0.1; done; \
         echo contained > /contained\n",
    )]);
    let req = DockerfileBuildRequest {
        name: name.into(),
        no_cache: true,
        step_timeout_s: Some(60.0),
        ..Default::default()
    };
    let out = build(&c, &req, tar).await;
    let (image, steps, _) = out
        .result
        .unwrap_or_else(|e| panic!("detached bomb: {e:?}\n{}", out.output));
    assert_eq!((image.name.as_str(), steps), (name, 2));
    assert!(build_sandboxes(&c, name).await.is_empty());
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            image: Some(name.into()),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("create from {name}: {e}"));
    let r = c
        .exec(&sb.id, sh("cat /contained"))
        .await
        .unwrap_or_else(|e| panic!("exec: {e}"));
    assert_eq!(r.stdout, "contained\n", "{r:?}");
    c.delete_sandbox(&sb.id)
        .await
        .unwrap_or_else(|e| panic!("delete: {e}"));
    c.delete_image(name)
        .await
        .unwrap_or_else(|e| panic!("delete image: {e}"));
    assert_host_clean(PARENT).await;
    assert_healthy(&c).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_that_fills_its_disk_fails_at_the_disk_size_and_leaves_nothing() {
    if !require_root() {
        return;
    }
    let _turn = SERIAL.lock().await;
    let c = server().client();
    let dir = tempfile::tempdir().expect("tempdir");
    let ctx = dir.path();
    let ctx_s = ctx.to_str().expect("utf-8");

    // Writes until ENOSPC: the step fails there, after about --disk-mb.
    write(
        ctx,
        "Dockerfile",
        "FROM base\nRUN echo before > /before\nRUN dd if=/dev/zero of=/big bs=1M\nRUN true\n",
    );
    let name = "e2e/dfh-disk-full";
    let t0 = Instant::now();
    let (code, _, stderr) = dsec(&["image", "build", ctx_s, name]);
    let took = t0.elapsed();
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("error: Dockerfile line 3 (RUN dd if=/dev/zero of=/big bs=1M)"),
        "{stderr}"
    );
    assert!(stderr.contains("exit code 1"), "{stderr}");
    assert!(stderr.contains("No space left on device"), "{stderr}");
    assert!(took < Duration::from_secs(60), "took {took:?}");
    assert_left_nothing(&c, name).await;
    assert_host_clean(PARENT).await;
    assert_healthy(&c).await;

    // Fills the disk and shrugs: the full layer is committed, the next step (in the same
    // build sandbox, on the same full disk) removes the file, and the image runs.
    write(
        ctx,
        "Dockerfile",
        "FROM base\nRUN yes > /f || true; test \"$(stat -c %s /f)\" -gt $((128 << 20))\n\
         RUN rm /f && echo done > /done\n",
    );
    let name = "e2e/dfh-disk-full-ok";
    let (code, stdout, stderr) = dsec(&["image", "build", "--no-cache", ctx_s, name]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.starts_with(&format!("built {name} ")), "{stdout}");
    assert!(build_sandboxes(&c, name).await.is_empty());
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            image: Some(name.into()),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("create from {name}: {e}"));
    let r = c
        .exec(&sb.id, sh("test ! -e /f && cat /done && df -k / | tail -1"))
        .await
        .unwrap_or_else(|e| panic!("exec: {e}"));
    assert_eq!(r.exit.exit_code, Some(0), "{r:?}");
    assert!(r.stdout.starts_with("done\n"), "{r:?}");
    c.delete_sandbox(&sb.id)
        .await
        .unwrap_or_else(|e| panic!("delete: {e}"));
    c.delete_image(name)
        .await
        .unwrap_or_else(|e| panic!("delete image: {e}"));
    assert_host_clean(PARENT).await;
    assert_healthy(&c).await;
}

/// Sends a Dockerfile build whose headers declare a `declared`-byte body, then only
/// `first`; returns the answer's status and body (the server must answer without the
/// rest).
fn post_declaring(url: &str, key: &str, name: &str, declared: u64, first: &[u8]) -> (u16, String) {
    use std::io::{Read, Write};
    let addr = url.trim_start_matches("http://");
    let mut tcp =
        std::net::TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    tcp.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap_or_else(|e| panic!("read timeout: {e}"));
    let head = format!(
        "POST /v1/images/build/dockerfile?name={name} HTTP/1.1\r\nHost: {addr}\r\n\
         x-api-key: {key}\r\nContent-Type: application/x-tar\r\n\
         Content-Length: {declared}\r\n\r\n"
    );
    tcp.write_all(head.as_bytes())
        .and_then(|()| tcp.write_all(first))
        .unwrap_or_else(|e| panic!("send: {e}"));
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let status: u16 = head
                .split_whitespace()
                .nth(1)
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| panic!("no status in {head:?}"));
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or_else(|| panic!("no content-length in {head:?}"));
            if buf.len() >= end + 4 + len {
                let body = String::from_utf8_lossy(&buf[end + 4..end + 4 + len]).into_owned();
                return (status, body);
            }
        }
        let n = tcp
            .read(&mut chunk)
            .unwrap_or_else(|e| panic!("no answer in 20 s to a body declared too large: {e}"));
        assert!(
            n > 0,
            "connection closed; got {:?}",
            String::from_utf8_lossy(&buf)
        );
        buf.extend_from_slice(&chunk[..n]);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_build_context_over_the_cap_is_refused_at_once() {
    if !require_root() {
        return;
    }
    let _turn = SERIAL.lock().await;
    let s = server();
    let c = s.client();

    // Declared one byte over 8 GiB: refused from the headers, before the server spools
    // the body (sent here: the start of a real context, and no more).
    let name = "e2e/dfh-huge";
    let start = context_tar(&[("Dockerfile", "FROM base\nRUN true\n")]);
    let (url, key) = (s.url.clone(), s.key.clone());
    let t0 = Instant::now();
    let (status, body) = tokio::task::spawn_blocking(move || {
        post_declaring(&url, &key, "e2e%2Fdfh-huge", (8u64 << 30) + 1, &start)
    })
    .await
    .unwrap_or_else(|e| panic!("request: {e}"));
    let took = t0.elapsed();
    assert_eq!(status, 413, "{body}");
    let v: serde_json::Value =
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("{body}: {e}"));
    assert_eq!(v["error"]["code"], "payload_too_large", "{body}");
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("build context is larger than 8 GiB"), "{body}");
    assert!(took < Duration::from_secs(10), "answered after {took:?}");
    assert_left_nothing(&c, name).await;

    // A context whose tar headers claim a 9 GiB member it does not hold (the body is a
    // few KiB, under the cap): refused as a broken archive before any sandbox.
    let name = "e2e/dfh-lying-tar";
    let mut tar = context_tar(&[("Dockerfile", "FROM base\nCOPY big /big\nRUN true\n")]);
    tar.truncate(tar.len() - 1024); // the end-of-archive blocks
    let mut h = tar::Header::new_gnu();
    h.set_path("big").unwrap_or_else(|e| panic!("path: {e}"));
    h.set_size(9 << 30);
    h.set_mode(0o644);
    h.set_cksum();
    tar.extend_from_slice(h.as_bytes());
    tar.extend_from_slice(&[b'x'; 4096]);
    let req = DockerfileBuildRequest {
        name: name.into(),
        ..Default::default()
    };
    let out = build(&c, &req, tar).await;
    let err = out
        .result
        .expect_err("a context claiming more than it holds must be refused");
    assert_eq!(err.code, ErrorCode::BadRequest, "{err:?}");
    assert!(err.message.contains("build context"), "{}", err.message);
    assert_left_nothing(&c, name).await;
    assert_host_clean(PARENT).await;
    assert_healthy(&c).await;
}

/// The build the crash tests kill: its second `RUN` says `started`, then waits for
/// `/dsec-go` (put there through the API) before it ends.
const SLOW_DOCKERFILE: &str = "FROM base\nRUN echo one > /one\n\
    RUN echo started; while [ ! -e /dsec-go ]; do sleep 0.05; done; rm /dsec-go\n\
    RUN echo after > /after\n";

/// The name of the crash tests' build.
const KILLED: &str = "e2e/dfh-killed";

/// A server of its own (`name`, cgroup parent `parent`) killed with SIGKILL while the
/// slow `RUN` of [`SLOW_DOCKERFILE`] runs, then restarted on the same directories. Returns
/// the server and the ids of the build sandboxes seen before the kill.
async fn killed_mid_build(name: &str, parent: &str) -> (Server, Vec<String>) {
    let seed = server();
    let mut s = Server::start_with(
        name,
        true,
        &["--cgroup-parent", parent, "--disk-mb", DISK_MB],
    )
    .await
    .unwrap_or_else(|e| panic!("server {name}: {e:#}"));
    s.ensure_base(Some(seed))
        .await
        .unwrap_or_else(|e| panic!("base image: {e:#}"));
    let c = s.client();
    let req = DockerfileBuildRequest {
        name: KILLED.into(),
        ..Default::default()
    };
    let mut events = c
        .build_dockerfile(&req, context_tar(&[("Dockerfile", SLOW_DOCKERFILE)]))
        .await
        .unwrap_or_else(|e| panic!("build: {e}"));
    let started = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(ev) = events.next().await {
            match ev.unwrap_or_else(|e| panic!("build event: {e}")) {
                BuildEvent::Output { data, .. } if data.contains("started") => return,
                ev @ (BuildEvent::Done { .. } | BuildEvent::Error { .. }) => {
                    panic!("the build ended before the kill: {ev:?}")
                }
                _ => {}
            }
        }
        panic!("the build stream ended before the slow step started");
    })
    .await;
    assert!(started.is_ok(), "the slow step did not start in 60 s");
    let before = build_sandboxes(&c, KILLED).await;
    assert_eq!(before.len(), 1, "{before:?}");

    s.kill();
    drop(events);
    s.spawn()
        .await
        .unwrap_or_else(|e| panic!("restart after kill -9: {e:#}"));
    (s, before)
}

#[tokio::test(flavor = "multi_thread")]
async fn kill_9_in_the_middle_of_a_build_then_the_same_build_succeeds() {
    if !require_root() {
        return;
    }
    let parent = "dsec-dfh-kill";
    let (s, before) = killed_mid_build("dockerfile-hostile-kill", parent).await;
    let c = s.client();
    assert!(
        !image_named(&c, KILLED).await,
        "the killed build named its image"
    );
    assert_healthy(&c).await;
    // Its RUN does not outlive the server that ran it.
    for id in &before {
        let stopped = wait_until(Duration::from_secs(15), || async {
            host::processes_running(id, "dsec-go")
                .is_empty()
                .then_some(())
        })
        .await;
        assert!(
            stopped.is_some(),
            "the killed build's RUN still runs in {id}: {:?}",
            host::processes_running(id, "dsec-go")
        );
    }
    // The killed build's sandbox idles out on its own (see
    // `kill_9_in_the_middle_of_a_build_leaves_no_build_sandbox`); deleted here so that
    // what follows sees only the new build's, and without waiting.
    for id in build_sandboxes(&c, KILLED).await {
        match c.delete_sandbox(&id).await {
            Ok(()) => {}
            Err(dsec_client::ClientError::Api(e)) if e.code == ErrorCode::NotFound => {}
            Err(e) => panic!("delete {id}: {e}"),
        }
    }

    // The same build again: its first step comes from the cache the killed one filled.
    let req = DockerfileBuildRequest {
        name: KILLED.into(),
        ..Default::default()
    };
    let mut events = c
        .build_dockerfile(&req, context_tar(&[("Dockerfile", SLOW_DOCKERFILE)]))
        .await
        .unwrap_or_else(|e| panic!("build after the restart: {e}"));
    let done = tokio::time::timeout(Duration::from_secs(90), async {
        while let Some(ev) = events.next().await {
            match ev.unwrap_or_else(|e| panic!("build event: {e}")) {
                BuildEvent::Output { data, .. } if data.contains("started") => {
                    let ids = build_sandboxes(&c, KILLED).await;
                    assert_eq!(ids.len(), 1, "{ids:?}");
                    let r = c
                        .exec(&ids[0], sh("touch /dsec-go"))
                        .await
                        .unwrap_or_else(|e| panic!("release the slow step: {e}"));
                    assert_eq!(r.exit.exit_code, Some(0), "{r:?}");
                }
                BuildEvent::Done {
                    image,
                    steps,
                    cached,
                } => return (image, steps, cached),
                BuildEvent::Error { error } => panic!("the rebuild failed: {error:?}"),
                _ => {}
            }
        }
        panic!("the rebuild's stream ended without a result");
    })
    .await;
    let (image, steps, cached) = done.unwrap_or_else(|_| panic!("the rebuild took over 90 s"));
    assert_eq!((image.name.as_str(), steps, cached), (KILLED, 3, 1));
    assert!(build_sandboxes(&c, KILLED).await.is_empty());
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            image: Some(KILLED.into()),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("create from the rebuilt image: {e}"));
    let r = c
        .exec(&sb.id, sh("cat /one /after; test ! -e /dsec-go"))
        .await
        .unwrap_or_else(|e| panic!("exec: {e}"));
    assert_eq!(r.exit.exit_code, Some(0), "{r:?}");
    assert_eq!(r.stdout, "one\nafter\n");
    c.delete_sandbox(&sb.id)
        .await
        .unwrap_or_else(|e| panic!("delete: {e}"));
    assert_host_clean(parent).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn kill_9_in_the_middle_of_a_build_leaves_no_build_sandbox() {
    if !require_root() {
        return;
    }
    let parent = "dsec-dfh-kill2";
    let (s, before) = killed_mid_build("dockerfile-hostile-kill2", parent).await;
    let c = s.client();
    // No build survives its server, so once the restart settles, none of its sandboxes
    // should either.
    let gone = wait_until(Duration::from_secs(30), || async {
        build_sandboxes(&c, KILLED).await.is_empty().then_some(())
    })
    .await;
    let left = build_sandboxes(&c, KILLED).await;
    assert!(
        gone.is_some(),
        "30 s after the restart the killed build's sandboxes {left:?} (before the kill: \
         {before:?}) are still there"
    );
    assert_host_clean(parent).await;
}

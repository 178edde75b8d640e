//! Dockerfile builds (issue #26) through the real CLI and server: a multi-stage
//! Dockerfile with ARG/ENV/WORKDIR/USER/LABEL/CMD, COPY from the context (honoring
//! `.dockerignore`, `--chown`, `--chmod`), `COPY --from` a stage, `ADD` of a local
//! tarball; the image runs with what the Dockerfile said; a rebuild takes every layer
//! from the cache and a changed context file reruns only what depends on it; a failing
//! `RUN` and an unsupported instruction are errors naming their line and leave nothing;
//! `FROM scratch`, wildcards in `COPY --from` and symlinked context sources.

use std::path::Path;

use dsec_e2e::{require_root, sh, Server};
use dsec_wire::v1::*;

fn server() -> &'static Server {
    Server::shared("dockerfile")
}

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

const DOCKERFILE: &str = r#"# syntax=docker/dockerfile:1
ARG BASE=base
FROM ${BASE} AS builder
WORKDIR /src
COPY app/ ./
RUN echo "built $(cat hello.txt)" > out.txt && ls /src > listing

FROM base
ARG GREETING=hi
ENV GREETING=${GREETING} \
    APP_HOME=/opt/app
LABEL org.example.task="demo task"
RUN useradd -m -u 1234 agent
WORKDIR $APP_HOME
COPY --from=builder /src/out.txt /src/listing ./
COPY --chown=agent:agent --chmod=640 data/secret.txt /opt/app/
ADD bundle.tar.gz /opt/bundle/
USER agent
RUN echo "$GREETING from $(whoami) in $(pwd)" > /home/agent/whoami
CMD ["sh", "-c", "cat /home/agent/whoami"]
"#;

async fn sandbox_of(c: &dsec_client::Client, image: &str) -> Sandbox {
    c.create_sandbox(CreateSandboxRequest {
        image: Some(image.into()),
        labels: [("suite".to_string(), "dockerfile".to_string())].into(),
        ..Default::default()
    })
    .await
    .expect("create from the built image")
}

async fn out(c: &dsec_client::Client, id: &str, cmd: &str) -> String {
    let r = c.exec(id, sh(cmd)).await.expect("exec");
    assert_eq!(r.exit.exit_code, Some(0), "{cmd}: {r:?}");
    r.stdout
}

/// Build sandboxes of the build of `name` still there (the two tests build at once).
async fn build_sandboxes_left(c: &dsec_client::Client, name: &str) -> usize {
    let labels = [("dsec-build".to_string(), name.to_string())].into();
    c.list_sandboxes(labels)
        .await
        .expect("list")
        .sandboxes
        .len()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_multi_stage_dockerfile_builds_runs_and_rebuilds_from_cache() {
    if !require_root() {
        return;
    }
    let c = server().client();
    let dir = tempfile::tempdir().expect("tempdir");
    let ctx = dir.path();
    write(ctx, "Dockerfile", DOCKERFILE);
    write(ctx, ".dockerignore", "**/*.log\napp/ignored/\n");
    // Unique per run: the shared server keeps its build cache across runs.
    let token = format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    );
    write(ctx, "app/hello.txt", &format!("world-{token}"));
    write(ctx, "app/debug.log", "left out");
    write(ctx, "app/ignored/x", "left out");
    write(ctx, "data/secret.txt", "s3cret\n");
    write(ctx, "bundle/inside.txt", "from the tarball\n");
    let status = std::process::Command::new("tar")
        .args(["-czf", "bundle.tar.gz", "-C", "bundle", "."])
        .current_dir(ctx)
        .status()
        .expect("tar");
    assert!(status.success());

    let ctx_s = ctx.to_str().expect("utf-8");
    let (code, stdout, stderr) = dsec(&[
        "image",
        "build",
        ctx_s,
        "e2e/df",
        "--build-arg",
        "GREETING=hello",
        "--no-cache",
    ]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.starts_with("built e2e/df sha256:"), "{stdout}");
    assert!(
        stdout.contains("0 of 9 steps from cache"),
        "{stdout}\n{stderr}"
    );
    assert!(stderr.contains("step 1/9"), "{stderr}");

    // The image carries the target stage's config.
    let img = c
        .list_images()
        .await
        .expect("images")
        .images
        .into_iter()
        .find(|i| i.name == "e2e/df")
        .expect("built image listed");
    assert_eq!(
        img.config.env.get("GREETING").map(String::as_str),
        Some("hello")
    );
    assert_eq!(
        img.config.env.get("APP_HOME").map(String::as_str),
        Some("/opt/app")
    );
    assert_eq!(img.config.workdir.as_deref(), Some("/opt/app"));
    assert_eq!(img.config.user.as_deref(), Some("agent"));
    assert_eq!(img.config.cmd, ["sh", "-c", "cat /home/agent/whoami"]);
    assert_eq!(
        img.config
            .labels
            .get("org.example.task")
            .map(String::as_str),
        Some("demo task")
    );

    // Its sandboxes run with what the Dockerfile built.
    let sb = sandbox_of(&c, "e2e/df").await;
    assert_eq!(
        out(&c, &sb.id, "cat /opt/app/out.txt").await,
        format!("built world-{token}\n")
    );
    // .dockerignore kept the log and the ignored directory out of the context.
    assert_eq!(
        out(&c, &sb.id, "cat /opt/app/listing").await,
        "hello.txt\nlisting\nout.txt\n"
    );
    assert_eq!(
        out(
            &c,
            &sb.id,
            "stat -c '%U:%G %a' /opt/app/secret.txt; cat /opt/app/secret.txt"
        )
        .await,
        "agent:agent 640\ns3cret\n"
    );
    assert_eq!(
        out(&c, &sb.id, "cat /opt/bundle/inside.txt").await,
        "from the tarball\n"
    );
    assert_eq!(
        out(&c, &sb.id, "cat /home/agent/whoami").await,
        "hello from agent in /opt/app\n"
    );
    // Commands default to the image's user and workdir.
    assert_eq!(out(&c, &sb.id, "id -un; pwd").await, "agent\n/opt/app\n");
    c.delete_sandbox(&sb.id).await.expect("delete");

    // Same context: every step from the cache, the same layers.
    let (code, stdout, stderr) = dsec(&[
        "image",
        "build",
        ctx_s,
        "e2e/df2",
        "--build-arg",
        "GREETING=hello",
    ]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("9 of 9 steps from cache"), "{stdout}");
    let again = c
        .list_images()
        .await
        .expect("images")
        .images
        .into_iter()
        .find(|i| i.name == "e2e/df2")
        .expect("rebuilt image");
    assert_eq!(again.layers, img.layers);

    // A changed context file: the builder stage's COPY and RUN rerun, and the target's
    // COPY --from of their result; the steps before stay cached.
    write(ctx, "app/hello.txt", &format!("again-{token}"));
    let (code, stdout, stderr) = dsec(&[
        "image",
        "build",
        ctx_s,
        "e2e/df3",
        "--build-arg",
        "GREETING=hello",
    ]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("of 9 steps from cache"), "{stdout}");
    assert!(!stdout.contains("9 of 9"), "{stdout}");
    let sb = sandbox_of(&c, "e2e/df3").await;
    assert_eq!(
        out(&c, &sb.id, "cat /opt/app/out.txt").await,
        format!("built again-{token}\n")
    );
    c.delete_sandbox(&sb.id).await.expect("delete");
    for name in ["e2e/df", "e2e/df2", "e2e/df3"] {
        assert_eq!(build_sandboxes_left(&c, name).await, 0, "{name}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn failing_and_unsupported_dockerfiles_name_their_line_and_leave_nothing() {
    if !require_root() {
        return;
    }
    let c = server().client();
    let dir = tempfile::tempdir().expect("tempdir");
    let ctx = dir.path();
    write(
        ctx,
        "Dockerfile",
        "FROM base\nRUN echo step one > /one\nRUN echo oops >&2; exit 7\nRUN true\n",
    );
    let ctx_s = ctx.to_str().expect("utf-8");
    let (code, _, stderr) = dsec(&["image", "build", ctx_s, "e2e/df-broken"]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("Dockerfile line 3"), "{stderr}");
    assert!(stderr.contains("exit code 7"), "{stderr}");
    assert!(stderr.contains("oops"), "{stderr}");
    let names: Vec<String> = c
        .list_images()
        .await
        .expect("images")
        .images
        .into_iter()
        .map(|i| i.name)
        .collect();
    assert!(!names.contains(&"e2e/df-broken".to_string()), "{names:?}");
    assert_eq!(build_sandboxes_left(&c, "e2e/df-broken").await, 0);

    // Refused before anything runs: the line and instruction are named.
    write(ctx, "Other.Dockerfile", "FROM base\n\nONBUILD RUN make\n");
    let (code, _, stderr) = dsec(&[
        "image",
        "build",
        "-f",
        ctx.join("Other.Dockerfile").to_str().expect("utf-8"),
        ctx_s,
        "e2e/df-onbuild",
    ]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("Dockerfile line 3"), "{stderr}");
    assert!(stderr.contains("ONBUILD"), "{stderr}");

    // A COPY source that is not in the context.
    write(ctx, "Dockerfile", "FROM base\nCOPY missing.txt /x\n");
    let (code, _, stderr) = dsec(&["image", "build", ctx_s, "e2e/df-missing"]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("Dockerfile line 2"), "{stderr}");
    assert!(stderr.contains("missing.txt"), "{stderr}");
    assert_eq!(build_sandboxes_left(&c, "e2e/df-missing").await, 0);
}

/// `FROM scratch` with `COPY --from` by wildcard, and a context source that is a symlink
/// (dereferenced, as Docker does). The scratch image runs nothing of its own, so the
/// result is checked from a sandbox of the base image that copies it in (`COPY --from`
/// of `/`: the source sandbox's `/proc` and `/sys` come along as empty directories).
#[tokio::test(flavor = "multi_thread")]
async fn scratch_stages_wildcard_copy_from_and_symlink_sources() {
    if !require_root() {
        return;
    }
    let c = server().client();
    let dir = tempfile::tempdir().expect("tempdir");
    let ctx = dir.path();
    write(ctx, "conf/real-1.2.conf", "setting=1\n");
    std::os::unix::fs::symlink("real-1.2.conf", ctx.join("conf/current.conf")).expect("symlink");
    write(
        ctx,
        "Dockerfile",
        "FROM base AS libs\n\
         RUN mkdir -p /out/lib && for n in a b c; do echo $n > /out/lib/lib$n.so; done \
         && echo x > /out/lib/notes.txt\n\
         FROM scratch AS tiny\n\
         COPY --from=libs /out/lib/*.so /lib/\n\
         COPY --from=libs /out/*/liba.so /single.so\n\
         COPY conf/current.conf /etc/app.conf\n\
         WORKDIR /work\n\
         FROM base\n\
         COPY --from=tiny / /tiny/\n",
    );
    let ctx_s = ctx.to_str().expect("utf-8");
    let (code, stdout, stderr) = dsec(&["image", "build", ctx_s, "e2e/df-scratch", "--no-cache"]);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    let sb = sandbox_of(&c, "e2e/df-scratch").await;
    assert_eq!(
        out(&c, &sb.id, "cd /tiny && ls lib && cat single.so etc/app.conf && test -d work && test ! -e bin && test ! -L etc/app.conf && [ -z \"$(ls -A proc)\" ] && [ -z \"$(ls -A sys)\" ] && echo ok").await,
        "liba.so\nlibb.so\nlibc.so\na\nsetting=1\nok\n"
    );
    c.delete_sandbox(&sb.id).await.expect("delete");

    // RUN in a scratch stage has no shell: a clear error naming the line.
    write(ctx, "Dockerfile", "FROM scratch\nRUN true\n");
    let (code, _, stderr) = dsec(&["image", "build", ctx_s, "e2e/df-scratch-run"]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("Dockerfile line 2"), "{stderr}");
    // A wildcard that matches nothing.
    write(
        ctx,
        "Dockerfile",
        "FROM base AS a\nFROM base\nCOPY --from=a /etc/*.nothing /x/\n",
    );
    let (code, _, stderr) = dsec(&["image", "build", ctx_s, "e2e/df-nomatch"]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("Dockerfile line 3") && stderr.contains("matches nothing"),
        "{stderr}"
    );
    for name in ["e2e/df-scratch", "e2e/df-scratch-run", "e2e/df-nomatch"] {
        assert_eq!(build_sandboxes_left(&c, name).await, 0, "{name}");
    }
}

use super::eval::{platform_vars, remote_source, resolve};
use super::*;
use crate::parse::parse;
use crate::{ErrorKind, SubstError};

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

fn kv(v: &[(&str, &str)]) -> Vec<(String, String)> {
    v.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn map(v: &[(&str, &str)]) -> BTreeMap<String, String> {
    kv(v).into_iter().collect()
}

fn plan_of(text: &str, build_args: &[(&str, &str)], target: Option<&str>) -> Plan {
    let df = parse(text).expect("parses");
    plan(&df, &map(build_args), target).expect("plans")
}

fn target_of(text: &str) -> PlannedStage {
    let p = plan_of(text, &[], None);
    p.stages.last().cloned().expect("a stage")
}

fn runs(st: &PlannedStage) -> Vec<&RunStep> {
    st.steps
        .iter()
        .filter_map(|s| match &s.kind {
            StepKind::Run(r) => Some(r),
            _ => None,
        })
        .collect()
}

fn copies(st: &PlannedStage) -> Vec<&CopyStep> {
    st.steps
        .iter()
        .filter_map(|s| match &s.kind {
            StepKind::Copy(c) => Some(c),
            _ => None,
        })
        .collect()
}

fn sh(cmd: &str) -> Vec<String> {
    s(&["/bin/sh", "-c", cmd])
}

fn with_path(v: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut e = kv(&[("PATH", DEFAULT_PATH)]);
    e.extend(kv(v));
    e
}

const SWE: &str = r#"FROM python:3.11-slim
ARG DEBIAN_FRONTEND=noninteractive
ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR="off"
RUN apt-get update && \
    apt-get install -y --no-install-recommends git \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /testbed
COPY . .
RUN pip install -e ".[test]"
CMD ["pytest", "-x"]
"#;

#[test]
fn swe_bench_plan() {
    let p = plan_of(SWE, &[], None);
    assert_eq!(p.stages.len(), 1);
    assert!(p.warnings.is_empty(), "{:?}", p.warnings);
    let st = &p.stages[0];
    assert_eq!(st.base, Base::Image("python:3.11-slim".into()));
    assert_eq!((st.index, st.line, &st.name), (0, 1, &None));
    let env = with_path(&[
        ("PYTHONDONTWRITEBYTECODE", "1"),
        ("PIP_NO_CACHE_DIR", "off"),
        ("DEBIAN_FRONTEND", "noninteractive"),
    ]);
    let steps: Vec<(usize, StepKind)> = st.steps.iter().map(|s| (s.line, s.kind.clone())).collect();
    assert_eq!(
        steps,
        vec![
            (
                5,
                StepKind::Run(RunStep {
                    cmd: sh("apt-get update &&     apt-get install -y --no-install-recommends git     && rm -rf /var/lib/apt/lists/*"),
                    env: env.clone(),
                    workdir: "/".into(),
                    user: None,
                })
            ),
            (
                8,
                StepKind::Mkdir {
                    path: "/testbed".into(),
                    user: None
                }
            ),
            (
                9,
                StepKind::Copy(CopyStep {
                    from: CopyFrom::Context,
                    sources: s(&["."]),
                    dest: "/testbed/".into(),
                    chown: None,
                    chmod: None,
                    extract_tars: false,
                })
            ),
            (
                10,
                StepKind::Run(RunStep {
                    cmd: sh("pip install -e \".[test]\""),
                    env,
                    workdir: "/testbed".into(),
                    user: None,
                })
            ),
        ]
    );
    assert_eq!(st.steps[3].text, "RUN pip install -e \".[test]\"");
    // ARGs are not part of the image config; ENV is.
    assert_eq!(
        st.config,
        ImageConfig {
            env: with_path(&[
                ("PYTHONDONTWRITEBYTECODE", "1"),
                ("PIP_NO_CACHE_DIR", "off")
            ]),
            workdir: Some("/testbed".into()),
            cmd: Some(s(&["pytest", "-x"])),
            ..ImageConfig::default()
        }
    );
    assert_eq!(p.base_images(), s(&["python:3.11-slim"]));
    assert_eq!(p.target().map(|t| t.index), Some(0));
}

const MULTI: &str = "\
ARG GO_VERSION=1.22
FROM golang:${GO_VERSION} AS builder
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN go build -o /out/app ./cmd/app

FROM node:20 AS docs
ADD https://example.com/theme.tgz /theme
RUN npm run docs

FROM debian:12-slim AS tools
RUN apt-get install -y ca-certificates

FROM gcr.io/distroless/base
COPY --from=builder /out/app /app
COPY --from=2 /etc/ssl/certs /etc/ssl/certs
COPY --from=busybox:1.36 /bin/busybox /busybox
ENTRYPOINT [\"/app\"]
";

#[test]
fn multi_stage_drops_unused_stages() {
    let p = plan_of(MULTI, &[], None);
    let got: Vec<(usize, Option<&str>, &Base)> = p
        .stages
        .iter()
        .map(|s| (s.index, s.name.as_deref(), &s.base))
        .collect();
    // `docs` is not needed (and its URL ADD is never looked at).
    assert_eq!(
        got,
        vec![
            (0, Some("builder"), &Base::Image("golang:1.22".into())),
            (2, Some("tools"), &Base::Image("debian:12-slim".into())),
            (3, None, &Base::Image("gcr.io/distroless/base".into())),
        ]
    );
    let froms: Vec<&CopyFrom> = copies(&p.stages[2]).iter().map(|c| &c.from).collect();
    // Stage references index the plan's list: builder is 0, tools is 1.
    assert_eq!(
        froms,
        vec![
            &CopyFrom::Stage(0),
            &CopyFrom::Stage(1),
            &CopyFrom::Image("busybox:1.36".into()),
        ]
    );
    let c = copies(&p.stages[0]);
    assert_eq!(
        (c[0].sources.clone(), c[0].dest.as_str()),
        (s(&["go.mod", "go.sum"]), "/src/")
    );
    assert_eq!(
        p.base_images(),
        s(&["golang:1.22", "debian:12-slim", "gcr.io/distroless/base"])
    );
    assert_eq!(p.stages[2].config.entrypoint, Some(s(&["/app"])));

    // A build arg overrides the global ARG in FROM.
    let p = plan_of(MULTI, &[("GO_VERSION", "1.21")], None);
    assert_eq!(p.stages[0].base, Base::Image("golang:1.21".into()));
    assert!(p.warnings.is_empty());
}

#[test]
fn targets() {
    let names = |t: Option<&str>| -> Vec<usize> {
        plan_of(MULTI, &[], t)
            .stages
            .iter()
            .map(|s| s.index)
            .collect()
    };
    assert_eq!(names(Some("builder")), vec![0]);
    assert_eq!(names(Some("TOOLS")), vec![2]);
    let df = parse(MULTI).expect("parses");
    // Errors are reported for the stages that are built.
    let e = plan(&df, &BTreeMap::new(), Some("docs")).expect_err("URL ADD");
    assert_eq!(e.line(), Some(10));
    assert_eq!(
        plan(&df, &BTreeMap::new(), Some("nope")),
        Err(DockerfileError::UnknownTarget("nope".into()))
    );
    assert_eq!(
        DockerfileError::UnknownTarget("nope".into()).to_string(),
        "target stage \"nope\" is not in the Dockerfile"
    );
}

#[test]
fn stage_on_stage_inherits_config() {
    let p = plan_of(
        "FROM python:3.11 AS base\n\
         ENV VIRTUAL_ENV=/venv PATH=/venv/bin:$PATH\n\
         WORKDIR /app\n\
         USER app\n\
         SHELL [\"/bin/bash\", \"-c\"]\n\
         CMD [\"python\"]\n\
         FROM BASE AS test\n\
         RUN pytest\n",
        &[],
        None,
    );
    assert_eq!(p.stages.len(), 2);
    let t = &p.stages[1];
    assert_eq!(t.base, Base::Stage(0));
    let venv_path = format!("/venv/bin:{DEFAULT_PATH}");
    assert_eq!(
        runs(t),
        vec![&RunStep {
            cmd: s(&["/bin/bash", "-c", "pytest"]),
            env: kv(&[("PATH", venv_path.as_str()), ("VIRTUAL_ENV", "/venv")]),
            workdir: "/app".into(),
            user: Some("app".into()),
        }]
    );
    assert_eq!(t.config, p.stages[0].config);
    assert_eq!(t.config.cmd, Some(s(&["python"])));
    // Only stages before count: a later stage's name is an image.
    let p = plan_of(
        "FROM later AS first\nFROM alpine AS later",
        &[],
        Some("first"),
    );
    assert_eq!(p.stages[0].base, Base::Image("later".into()));
}

#[test]
fn base_config_is_inherited() {
    let df = parse(
        "FROM python:3.11-slim\n\
         ENV PATH=/root/.local/bin:$PATH\n\
         RUN echo $LANG\n\
         COPY . .\n\
         WORKDIR app\n\
         ENTRYPOINT [\"python3\", \"-m\", \"app\"]\n",
    )
    .expect("parses");
    let base = ImageConfig {
        env: kv(&[
            ("PATH", "/usr/local/bin:/usr/bin:/bin"),
            ("LANG", "C.UTF-8"),
        ]),
        workdir: Some("/srv".into()),
        user: Some("svc".into()),
        cmd: Some(s(&["python3"])),
        labels: map(&[("from", "base")]),
        ..ImageConfig::default()
    };
    let opts = PlanOptions {
        base_configs: [("python:3.11-slim".to_string(), base)]
            .into_iter()
            .collect(),
        ..PlanOptions::default()
    };
    let p = plan_with(&df, &opts).expect("plans");
    let st = &p.stages[0];
    let env = kv(&[
        ("PATH", "/root/.local/bin:/usr/local/bin:/usr/bin:/bin"),
        ("LANG", "C.UTF-8"),
    ]);
    assert_eq!(
        runs(st),
        vec![&RunStep {
            cmd: sh("echo $LANG"),
            env: env.clone(),
            workdir: "/srv".into(),
            user: Some("svc".into()),
        }]
    );
    assert_eq!(copies(st)[0].dest, "/srv/");
    assert_eq!(
        st.config,
        ImageConfig {
            env,
            workdir: Some("/srv/app".into()),
            user: Some("svc".into()),
            entrypoint: Some(s(&["python3", "-m", "app"])),
            // ENTRYPOINT drops the CMD inherited from the base.
            cmd: None,
            labels: map(&[("from", "base")]),
            ..ImageConfig::default()
        }
    );
    // The WORKDIR is created as the user in effect.
    assert!(st.steps.contains(&Step {
        line: 5,
        text: "WORKDIR app".into(),
        kind: StepKind::Mkdir {
            path: "/srv/app".into(),
            user: Some("svc".into()),
        },
    }));
}

#[test]
fn cmd_and_entrypoint() {
    let cfg = |text: &str| target_of(text).config;
    // CMD then ENTRYPOINT in the same stage: both kept.
    let c = cfg("FROM a\nCMD [\"--help\"]\nENTRYPOINT [\"app\"]");
    assert_eq!(
        (c.entrypoint, c.cmd),
        (Some(s(&["app"])), Some(s(&["--help"])))
    );
    // ENTRYPOINT then CMD.
    let c = cfg("FROM a\nENTRYPOINT app\nCMD serve");
    assert_eq!((c.entrypoint, c.cmd), (Some(sh("app")), Some(sh("serve"))));
    // A CMD from the base stage is dropped by an ENTRYPOINT of this stage.
    let c = cfg("FROM a AS b\nCMD [\"x\"]\nFROM b\nENTRYPOINT [\"y\"]");
    assert_eq!((c.entrypoint, c.cmd), (Some(s(&["y"])), None));
    // ... and kept without one.
    let c = cfg("FROM a AS b\nCMD [\"x\"]\nFROM b\nENV A=1");
    assert_eq!(c.cmd, Some(s(&["x"])));
    // The last CMD wins; `CMD []` is an empty command.
    let c = cfg("FROM a\nCMD one\nCMD []");
    assert_eq!(c.cmd, Some(vec![]));
}

#[test]
fn exec_and_shell_forms_with_shell_changed() {
    let st = target_of(
        "FROM a\n\
         RUN echo 1\n\
         SHELL [\"/bin/bash\", \"-euo\", \"pipefail\", \"-c\"]\n\
         RUN echo $HOME | tee x\n\
         RUN [\"echo\", \"$HOME\"]\n\
         CMD echo 4\n\
         HEALTHCHECK CMD check || exit 1\n",
    );
    let cmds: Vec<Vec<String>> = runs(&st).iter().map(|r| r.cmd.clone()).collect();
    assert_eq!(
        cmds,
        vec![
            sh("echo 1"),
            s(&["/bin/bash", "-euo", "pipefail", "-c", "echo $HOME | tee x"]),
            // Exec form: no shell, no substitution.
            s(&["echo", "$HOME"]),
        ]
    );
    assert_eq!(
        st.config.cmd,
        Some(s(&["/bin/bash", "-euo", "pipefail", "-c", "echo 4"]))
    );
    assert_eq!(
        st.config.shell,
        Some(s(&["/bin/bash", "-euo", "pipefail", "-c"]))
    );
    // A healthcheck's shell form is CMD-SHELL, run by the runtime's shell.
    assert_eq!(
        st.config.healthcheck.map(|h| h.test),
        Some(s(&["CMD-SHELL", "check || exit 1"]))
    );
}

const SCOPES: &str = "\
ARG VERSION=1.0
ARG UNSET_GLOBAL
FROM alpine:${VERSION} AS one
RUN echo before
ARG VERSION
RUN echo after
ARG LOCAL=x-${VERSION}
ARG UNSET_GLOBAL
ARG NOVALUE
ENV LOCAL=env-wins
LABEL v=$VERSION l=$LOCAL n=${NOVALUE:-none} g=${UNSET_GLOBAL-unset}
RUN echo last
FROM alpine AS two
LABEL v=${VERSION:-not-visible} l=${LOCAL:-not-visible}
ARG VERSION
LABEL v2=$VERSION
";

#[test]
fn arg_scoping() {
    let p = plan_of(SCOPES, &[], Some("one"));
    let one = &p.stages[0];
    assert_eq!(one.base, Base::Image("alpine:1.0".into()));
    let envs: Vec<Vec<(String, String)>> = runs(one).iter().map(|r| r.env.clone()).collect();
    assert_eq!(
        envs,
        vec![
            // A global ARG is not visible in the stage until redeclared there.
            with_path(&[]),
            with_path(&[("VERSION", "1.0")]),
            // ENV wins over the ARG of the same name; unset ARGs are not in the env.
            with_path(&[("LOCAL", "env-wins"), ("VERSION", "1.0")]),
        ]
    );
    assert_eq!(
        one.config.labels,
        map(&[
            ("v", "1.0"),
            ("l", "env-wins"),
            ("n", "none"),
            ("g", "unset")
        ])
    );
    // Stage-local ARGs and ENVs do not leak into the next stage.
    let p = plan_of(SCOPES, &[], Some("two"));
    assert_eq!(
        p.stages[0].config.labels,
        map(&[("v", "not-visible"), ("l", "not-visible"), ("v2", "1.0")])
    );
}

#[test]
fn build_args_override_defaults() {
    let p = plan_of(
        SCOPES,
        &[
            ("VERSION", "2.0"),
            ("LOCAL", "from-cli"),
            ("NOPE", "x"),
            ("TARGETARCH", "riscv64"),
        ],
        Some("one"),
    );
    let one = &p.stages[0];
    assert_eq!(one.base, Base::Image("alpine:2.0".into()));
    let last = runs(one)[2];
    assert_eq!(
        last.env,
        with_path(&[("LOCAL", "env-wins"), ("VERSION", "2.0")])
    );
    // The ARG default lost to the build arg, and ENV to... nothing: ENV still wins.
    assert_eq!(
        one.config.labels.get("l").map(String::as_str),
        Some("env-wins")
    );
    // Unused build args are reported (platform args never are).
    let w: Vec<String> = p.warnings.iter().map(|w| w.to_string()).collect();
    assert_eq!(
        w,
        vec!["Dockerfile: build arg NOPE is not used by any ARG of the built stages".to_string()]
    );
    // A build arg reaches a stage ARG without a default.
    let st = target_of("FROM a\nARG TOKEN\nRUN x");
    assert_eq!(runs(&st)[0].env, with_path(&[]));
    let p = plan_of("FROM a\nARG TOKEN\nRUN x", &[("TOKEN", "t")], None);
    assert_eq!(runs(&p.stages[0])[0].env, with_path(&[("TOKEN", "t")]));
    // A build arg overrides an in-stage default, redeclaring replaces the value.
    let p = plan_of(
        "FROM a\nARG A=def\nRUN one\nARG A=again\nRUN two",
        &[],
        None,
    );
    let envs: Vec<&str> = runs(&p.stages[0])
        .iter()
        .map(|r| r.env[1].1.as_str())
        .collect();
    assert_eq!(envs, vec!["def", "again"]);
    let p = plan_of("FROM a\nARG A=def\nRUN one", &[("A", "cli")], None);
    assert_eq!(
        runs(&p.stages[0])[0].env[1],
        ("A".to_string(), "cli".to_string())
    );
}

#[test]
fn global_args() {
    let p = plan_of(
        "ARG REG=docker.io\n\
         ARG IMG=${REG}/library/python\n\
         ARG TAG\n\
         ARG TARGETOS\n\
         FROM ${IMG}:${TAG:-3.12}-$TARGETOS",
        &[],
        None,
    );
    assert_eq!(
        p.stages[0].base,
        Base::Image("docker.io/library/python:3.12-linux".into())
    );
    let p = plan_of("ARG TAG=1\nFROM a:$TAG", &[("TAG", "2")], None);
    assert_eq!(p.stages[0].base, Base::Image("a:2".into()));
}

#[test]
fn platform_args() {
    let host = platform_vars();
    let p = plan_of(
        "FROM --platform=$BUILDPLATFORM golang:1.22 AS build\n\
         ARG TARGETARCH\n\
         ARG TARGETOS\n\
         RUN GOARCH=$TARGETARCH go build\n\
         FROM alpine:$TARGETOS",
        &[],
        Some("build"),
    );
    let st = &p.stages[0];
    assert_eq!(st.platform.as_ref(), host.get("BUILDPLATFORM"));
    assert_eq!(
        runs(st)[0].env,
        with_path(&[
            ("TARGETARCH", host["TARGETARCH"].as_str()),
            ("TARGETOS", "linux"),
        ])
    );
    let p = plan_of("FROM alpine:$TARGETOS", &[("TARGETOS", "plan9")], None);
    assert_eq!(p.stages[0].base, Base::Image("alpine:plan9".into()));
    assert!(p.warnings.is_empty());
    // An empty platform is none.
    let p = plan_of("FROM --platform=$NOPE a", &[], None);
    assert_eq!(p.stages[0].platform, None);
}

#[test]
fn substitution_per_instruction() {
    let st = target_of(
        r#"FROM a
ARG APP=myapp
ARG UID=1000
ENV HOME=/home/$APP A=1 PORTS="9000/udp 9001"
ENV B=$A A=2 C=${A}
WORKDIR $HOME/src
USER ${UID}:${UID}
COPY --chown=$UID:$UID --chmod=0640 ${APP}.conf cfg/
ADD ["${APP}.tar.gz", "/opt/$APP/"]
EXPOSE 8000 ${PORTS}
STOPSIGNAL ${SIG:-SIGTERM}
LABEL "app.name"="$APP" 'literal'='$APP' escaped=\$APP
RUN echo $APP ${HOME}
"#,
    );
    let env = &st.config.env;
    assert_eq!(
        env,
        &with_path(&[
            ("HOME", "/home/myapp"),
            ("A", "2"),
            ("PORTS", "9000/udp 9001"),
            // All pairs of one ENV see the values from before it.
            ("B", "1"),
            ("C", "1"),
        ])
    );
    assert_eq!(st.config.workdir.as_deref(), Some("/home/myapp/src"));
    assert_eq!(st.config.user.as_deref(), Some("1000:1000"));
    assert_eq!(
        copies(&st),
        vec![
            &CopyStep {
                from: CopyFrom::Context,
                sources: s(&["myapp.conf"]),
                dest: "/home/myapp/src/cfg/".into(),
                chown: Some("1000:1000".into()),
                chmod: Some(0o640),
                extract_tars: false,
            },
            &CopyStep {
                from: CopyFrom::Context,
                sources: s(&["myapp.tar.gz"]),
                dest: "/opt/myapp/".into(),
                chown: None,
                chmod: None,
                extract_tars: true,
            },
        ]
    );
    assert_eq!(
        st.config.exposed_ports,
        ["8000/tcp", "9000/udp", "9001/tcp"]
            .into_iter()
            .map(String::from)
            .collect()
    );
    assert_eq!(st.config.stop_signal.as_deref(), Some("SIGTERM"));
    assert_eq!(
        st.config.labels,
        map(&[
            ("app.name", "myapp"),
            ("literal", "$APP"),
            ("escaped", "$APP")
        ])
    );
    // RUN is left to the shell, which gets the variables in its environment.
    let r = runs(&st)[0];
    assert_eq!(r.cmd, sh("echo $APP ${HOME}"));
    assert_eq!(r.user.as_deref(), Some("1000:1000"));
    assert_eq!(r.workdir, "/home/myapp/src");
    assert!(r.env.contains(&("APP".to_string(), "myapp".to_string())));
    assert!(r.env.contains(&("UID".to_string(), "1000".to_string())));
}

#[test]
fn copy_destinations() {
    let cases = [
        (".", "/w/"),
        ("./", "/w/"),
        ("sub", "/w/sub"),
        ("sub/", "/w/sub/"),
        ("sub/.", "/w/sub/"),
        ("/abs", "/abs"),
        ("/abs/", "/abs/"),
        ("../up", "/up"),
        ("..", "/"),
        ("/", "/"),
        ("a//b/../c", "/w/a/c"),
    ];
    for (dest, want) in cases {
        let st = target_of(&format!("FROM a\nWORKDIR /w\nCOPY x {dest}"));
        assert_eq!(copies(&st)[0].dest, want, "COPY x {dest}");
    }
    // Without a WORKDIR the root is the working directory.
    let st = target_of("FROM a\nCOPY x .");
    assert_eq!(copies(&st)[0].dest, "/");
}

#[test]
fn workdir_steps() {
    let st = target_of(
        "FROM a\n\
         WORKDIR /\n\
         WORKDIR app\n\
         WORKDIR app\n\
         WORKDIR /app/app/\n\
         USER nobody\n\
         WORKDIR ../data\n\
         RUN pwd",
    );
    let steps: Vec<(usize, StepKind)> = st.steps.iter().map(|s| (s.line, s.kind.clone())).collect();
    let mk = |p: &str, u: Option<&str>| StepKind::Mkdir {
        path: p.into(),
        user: u.map(Into::into),
    };
    assert_eq!(steps[0], (3, mk("/app", None)));
    assert_eq!(steps[1], (4, mk("/app/app", None)));
    // Line 5 names the directory already in effect: nothing to create.
    assert_eq!(steps[2], (7, mk("/app/data", Some("nobody"))));
    assert_eq!(steps.len(), 4);
    assert_eq!(runs(&st)[0].workdir, "/app/data");
}

#[test]
fn expose_forms() {
    let st = target_of("FROM a\nEXPOSE 80 443/udp 8000-8002 53/UDP 1/sctp");
    let want: BTreeSet<String> = [
        "80/tcp", "443/udp", "8000/tcp", "8001/tcp", "8002/tcp", "53/udp", "1/sctp",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(st.config.exposed_ports, want);
}

#[test]
fn stop_signals() {
    for sig in [
        "SIGTERM",
        "TERM",
        "sigint",
        "9",
        "64",
        "SIGRTMIN+3",
        "RTMAX-1",
        "SIGWINCH",
    ] {
        let st = target_of(&format!("FROM a\nSTOPSIGNAL {sig}"));
        assert_eq!(st.config.stop_signal.as_deref(), Some(sig));
    }
}

/// Every plan error names the line of its instruction.
#[test]
fn plan_errors_name_their_line() {
    let u = |s: &str| ErrorKind::Unsupported(s.into());
    let inv = |s: &str| ErrorKind::Invalid(s.into());
    let stage = |s: &str| ErrorKind::Stage(s.into());
    let syn = |s: &str| ErrorKind::Syntax(s.into());
    let sub = |e: SubstError| ErrorKind::Substitution(e);
    let req = |n: &str, m: &str| {
        sub(SubstError::Required {
            name: n.into(),
            message: m.into(),
        })
    };
    let port = |p: &str| {
        inv(&format!(
            "invalid port {p:?}: use PORT, PORT/PROTO or FIRST-LAST/PROTO (tcp, udp, sctp)"
        ))
    };
    let chmod = |m: &str| inv(&format!("--chmod={m}: use an octal mode from 0 to 7777"));
    let cases: Vec<(&str, usize, ErrorKind)> =
        vec![
        (
            "FROM a\nADD https://example.com/x.tgz /",
            2,
            u("ADD from a URL (https://example.com/x.tgz); download it in a RUN step"),
        ),
        (
            "FROM a\n\nADD git@github.com:a/b.git /src",
            3,
            u("ADD from a git repository (git@github.com:a/b.git); download it in a RUN step"),
        ),
        (
            "FROM a\nADD https://github.com/a/b.git /src",
            2,
            u("ADD from a git repository (https://github.com/a/b.git); download it in a RUN step"),
        ),
        (
            "FROM a\nCOPY http://x/y /",
            2,
            u("COPY from a URL (http://x/y); download it in a RUN step"),
        ),
        (
            "FROM a\nARG U=https://x/y\nADD local $U /",
            3,
            u("ADD from a URL (https://x/y); download it in a RUN step"),
        ),
        ("FROM a\nCOPY --chmod=888 a b", 2, chmod("888")),
        ("FROM a\nCOPY --chmod=u+x a b", 2, chmod("u+x")),
        ("FROM a\nCOPY --chmod=17777 a b", 2, chmod("17777")),
        ("FROM a\nEXPOSE 80/xyz", 2, port("80/xyz")),
        ("FROM a\nEXPOSE abc", 2, port("abc")),
        ("FROM a\nEXPOSE 90-80", 2, port("90-80")),
        ("FROM a\nEXPOSE 70000", 2, port("70000")),
        ("FROM a\nEXPOSE -80", 2, port("-80")),
        ("FROM a\nSTOPSIGNAL SIGFOO", 2, inv("invalid signal \"SIGFOO\"")),
        ("FROM a\nSTOPSIGNAL 0", 2, inv("invalid signal \"0\"")),
        ("FROM a\nSTOPSIGNAL 65", 2, inv("invalid signal \"65\"")),
        ("FROM a\nSTOPSIGNAL RTMIN+99", 2, inv("invalid signal \"RTMIN+99\"")),
        (
            "FROM a AS x\nCOPY --from=x a b",
            2,
            stage("--from=x: a stage can only copy from an earlier stage"),
        ),
        (
            "FROM a AS first\nCOPY --from=Later a b\nFROM b AS later\nFROM first",
            2,
            stage("--from=Later: a stage can only copy from an earlier stage"),
        ),
        (
            "FROM a\nCOPY --from=0 a b",
            2,
            stage("--from=0: the first stage has no earlier stage to copy from"),
        ),
        (
            "FROM a\nFROM b\nCOPY --from=5 a b",
            3,
            stage("--from=5: the index of an earlier stage is 0 to 0"),
        ),
        (
            "FROM a\nFROM b\nCOPY --from=99999999999999999999999 a b",
            3,
            stage("--from=99999999999999999999999: the index of an earlier stage is 0 to 0"),
        ),
        (
            "ARG E\nFROM a\nCOPY --from=$E a b",
            3,
            stage("--from is empty after substitution"),
        ),
        ("ARG B\nFROM ${B}", 2, syn("FROM ${B} is empty after substitution")),
        ("FROM a\nWORKDIR $NOPE", 2, syn("WORKDIR is empty after substitution")),
        ("FROM a\nUSER $NOPE", 2, syn("USER is empty after substitution")),
        ("FROM a\nENV $NOPE=x", 2, syn("ENV names cannot be empty")),
        ("FROM a\nLABEL $NOPE=x", 2, syn("LABEL names cannot be empty")),
        ("FROM a\nCOPY $NOPE /x", 2, inv("COPY source is empty after substitution")),
        ("FROM a\nADD x $NOPE", 2, inv("ADD destination is empty after substitution")),
        // (Unquoted, the blanks would split the ENV pair, as in Docker.)
        ("FROM a\nENV A=\"${B:?must be set}\"", 2, req("B", "must be set")),
        ("FROM a\nENV A=\"open", 2, sub(SubstError::UnterminatedDoubleQuote)),
        ("FROM --platform=${P:?} a", 1, req("P", "is not set")),
        ("ARG A=${X:?no}\nFROM a", 1, req("X", "no")),
        ("FROM ${X:?no}", 1, req("X", "no")),
        ("FROM a\nARG A=${X:?no}", 2, req("X", "no")),
        ("FROM a\nEXPOSE \"80", 2, sub(SubstError::UnterminatedDoubleQuote)),
        ("FROM a\nCOPY --from=${X:?} a b", 2, req("X", "is not set")),
        ("FROM a\nCOPY --chown=${X:?} a b", 2, req("X", "is not set")),
        ("FROM a\nCOPY --chmod=${X:?} a b", 2, req("X", "is not set")),
        ("FROM a\nCOPY ${X:?} b", 2, req("X", "is not set")),
        ("FROM a\nCOPY a ${X:?}", 2, req("X", "is not set")),
        ("FROM a\nSTOPSIGNAL ${X:?}", 2, req("X", "is not set")),
        ("FROM a\nUSER ${X:?}", 2, req("X", "is not set")),
        ("FROM a\nWORKDIR ${X:?}", 2, req("X", "is not set")),
        ("FROM a\nLABEL a=${X:?}", 2, req("X", "is not set")),
        ("FROM a\nLABEL ${X:?}=a", 2, req("X", "is not set")),
        ("FROM a\nENV ${X:?}=1", 2, req("X", "is not set")),
        ("FROM a\nENV A=${X:?}", 2, req("X", "is not set")),
        // An error in a stage that the target needs is reported with that stage's line.
        ("FROM a AS b\nUSER ${X:?}\nFROM b", 2, req("X", "is not set")),
        ("FROM a AS b\nUSER ${X:?}\nFROM c\nCOPY --from=b / /", 2, req("X", "is not set")),
    ];
    for (text, line, kind) in cases {
        let df = parse(text).expect(text);
        let e = plan(&df, &BTreeMap::new(), None).expect_err(text);
        match &e {
            DockerfileError::At {
                line: l, kind: k, ..
            } => {
                assert_eq!((*l, k), (line, &kind), "{text:?}");
            }
            other => panic!("{text:?}: {other:?}"),
        }
        assert!(
            e.to_string()
                .starts_with(&format!("Dockerfile line {line}: ")),
            "{e}"
        );
    }
}

#[test]
fn no_stages() {
    let df = Dockerfile {
        escape: '\\',
        global_args: vec![],
        stages: vec![],
        warnings: vec![],
    };
    assert_eq!(
        plan(&df, &BTreeMap::new(), None),
        Err(DockerfileError::NoFrom)
    );
}

#[test]
fn cache_keys() {
    let key = |text: &str, args: &[(&str, &str)], i: usize| -> CacheKey {
        let p = plan_of(text, args, None);
        p.stages.last().expect("stage").steps[i].cache_key()
    };
    let base = key("FROM a\nENV A=1\nRUN make", &[], 0);
    // Lines and blank lines do not matter.
    assert_eq!(base, key("FROM a\n\n# c\nENV A=1\n\nRUN make", &[], 0));
    assert_eq!(base.version, CACHE_KEY_VERSION);
    // Anything the command runs under does.
    for other in [
        "FROM a\nENV A=2\nRUN make",
        "FROM a\nENV A=1\nRUN make all",
        "FROM a\nENV A=1\nUSER me\nRUN make",
        "FROM a\nENV A=1\nWORKDIR /x\nRUN make",
        "FROM a\nENV A=1\nSHELL [\"/bin/bash\", \"-c\"]\nRUN make",
        "FROM a\nENV A=1\nARG B=1\nRUN make",
    ] {
        let i = other.lines().filter(|l| l.starts_with("WORKDIR")).count();
        assert_ne!(base, key(other, &[], i), "{other}");
    }
    let k1 = key("FROM a\nARG V\nRUN make", &[("V", "1")], 0);
    let k2 = key("FROM a\nARG V\nRUN make", &[("V", "2")], 0);
    assert_ne!(k1, k2);
    // A metadata-only change after the step does not.
    assert_eq!(base, key("FROM a\nENV A=1\nRUN make\nLABEL x=y", &[], 0));
    // A copy from a stage keys on that stage's result (which the builder adds), not on
    // where the stage sits in the plan.
    let k1 = key("FROM a AS b\nFROM c\nCOPY --from=b /x /y", &[], 0);
    let k2 = key(
        "FROM a AS z\nFROM a AS b\nCOPY --from=z / /\nFROM c\nCOPY --from=b /x /y",
        &[],
        0,
    );
    assert_eq!(k1, k2);
    let StepKind::Copy(c) = &k1.step else {
        panic!("{k1:?}")
    };
    assert_eq!(c.from, CopyFrom::Stage(0));
    let img = key("FROM c\nCOPY --from=busybox /x /y", &[], 0);
    assert_ne!(img, k1);
    // It serializes (the builder hashes it).
    let json = serde_json::to_string(&base).expect("serializes");
    let back: CacheKey = serde_json::from_str(&json).expect("deserializes");
    assert_eq!(back, base);
}

#[test]
fn warnings_carry_over_from_parse() {
    let p = plan_of(
        "FROM a\nVOLUME /data\nMAINTAINER x",
        &[("UNUSED", "1")],
        None,
    );
    let lines: Vec<Option<usize>> = p.warnings.iter().map(|w| w.line).collect();
    assert_eq!(lines, vec![Some(2), Some(3), None]);
}

#[test]
fn image_config_env_helpers_and_serde() {
    let mut c = ImageConfig::default();
    c.set_env("A", "1");
    c.set_env("B", "2");
    c.set_env("A", "3");
    assert_eq!(c.env, kv(&[("A", "3"), ("B", "2")]));
    assert_eq!(c.get_env("A"), Some("3"));
    assert_eq!(c.get_env("C"), None);
    // Partial configs deserialize (missing fields default).
    let c: ImageConfig = serde_json::from_str(r#"{"workdir": "/w"}"#).expect("deserializes");
    assert_eq!(c.workdir.as_deref(), Some("/w"));
    let p = plan_of(SWE, &[], None);
    let json = serde_json::to_string(&p).expect("serializes");
    assert_eq!(
        serde_json::from_str::<Plan>(&json).expect("deserializes"),
        p
    );
}

#[test]
fn paths_resolve() {
    let cases = [
        ("/", "a", "/a"),
        ("/a", "b/c", "/a/b/c"),
        ("/a/b", "..", "/a"),
        ("/a", "../../..", "/"),
        ("/a", "/x/./y/", "/x/y"),
        ("/", "", "/"),
    ];
    for (dir, p, want) in cases {
        assert_eq!(resolve(dir, p), want, "{dir} + {p}");
    }
    assert_eq!(remote_source("src/app"), None);
    assert_eq!(remote_source("GIT://host/r"), Some("a git repository"));
    assert_eq!(remote_source("ftp://host/f"), Some("a URL"));
}

use super::*;

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

fn kv(v: &[(&str, &str)]) -> Vec<(String, String)> {
    v.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The instructions of the only stage.
fn instrs(text: &str) -> Vec<InstructionKind> {
    let df = parse(text).expect("parses");
    assert_eq!(df.stages.len(), 1);
    df.stages[0]
        .instructions
        .iter()
        .map(|i| i.kind.clone())
        .collect()
}

fn one(line: &str) -> InstructionKind {
    let mut v = instrs(&format!("FROM scratch\n{line}\n"));
    assert_eq!(v.len(), 1, "{line}");
    v.remove(0)
}

fn err(text: &str) -> DockerfileError {
    parse(text).expect_err(text)
}

const SWE: &str = r#"# A SWE-bench style environment image.
FROM python:3.11-slim

ARG DEBIAN_FRONTEND=noninteractive
ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR="off"

RUN apt-get update && \
    apt-get install -y --no-install-recommends \
        git \
        # build tools for C extensions
        build-essential \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /testbed
COPY . .
run pip install -e ".[test]"
CMD ["pytest", "-x"]
"#;

#[test]
fn swe_bench_dockerfile() {
    let df = parse(SWE).expect("parses");
    assert_eq!(df.escape, '\\');
    assert!(df.global_args.is_empty());
    assert!(df.warnings.is_empty());
    let st = &df.stages[0];
    assert_eq!(
        (st.line, st.image.as_str(), &st.name),
        (2, "python:3.11-slim", &None)
    );
    let got: Vec<(usize, InstructionKind)> = st
        .instructions
        .iter()
        .map(|i| (i.line, i.kind.clone()))
        .collect();
    assert_eq!(
        got,
        vec![
            (
                4,
                InstructionKind::Arg(vec![ArgDecl {
                    name: "DEBIAN_FRONTEND".into(),
                    default: Some("noninteractive".into()),
                }])
            ),
            (
                5,
                InstructionKind::Env(kv(&[
                    ("PYTHONDONTWRITEBYTECODE", "1"),
                    ("PIP_NO_CACHE_DIR", "\"off\""),
                ]))
            ),
            (
                8,
                InstructionKind::Run(Command::Shell(
                    "apt-get update &&     apt-get install -y --no-install-recommends         \
                     git         build-essential     && rm -rf /var/lib/apt/lists/*"
                        .into()
                ))
            ),
            (15, InstructionKind::Workdir("/testbed".into())),
            (
                16,
                InstructionKind::Copy(CopyArgs {
                    from: None,
                    chown: None,
                    chmod: None,
                    sources: s(&["."]),
                    dest: ".".into(),
                })
            ),
            (
                17,
                InstructionKind::Run(Command::Shell("pip install -e \".[test]\"".into()))
            ),
            (
                18,
                InstructionKind::Cmd(Command::Exec(s(&["pytest", "-x"])))
            ),
        ]
    );
    // The text of an instruction has its continuations joined.
    assert!(st.instructions[2].text.starts_with("RUN apt-get update &&"));
}

#[test]
fn continuations_comments_and_blank_lines() {
    let text = [
        "FROM a",
        "RUN echo a \\",
        "",
        "# inside a continuation",
        "   \\",
        "  b",
        "   # indented comment",
        "RUN x \\  ",
        "y",
        "RUN trailing \\",
    ]
    .join("\n");
    let df = parse(&text).expect("parses");
    let got: Vec<(usize, &str)> = df.stages[0]
        .instructions
        .iter()
        .map(|i| (i.line, i.text.as_str()))
        .collect();
    // Continuation lines keep their indentation; a line holding only the escape
    // continues; one at the end of the file is dropped.
    assert_eq!(
        got,
        vec![
            (2, "RUN echo a      b"),
            (8, "RUN x y"),
            (10, "RUN trailing")
        ]
    );
}

#[test]
fn crlf_and_bom() {
    let df = parse("\u{feff}FROM a\r\nRUN x \\\r\n  y\r\n").expect("parses");
    assert_eq!(
        df.stages[0].instructions[0].kind,
        InstructionKind::Run(Command::Shell("x   y".into()))
    );
}

#[test]
fn escape_directive_backtick() {
    let text = [
        "# escape=`",
        "FROM mcr.microsoft.com/windows/servercore",
        "RUN dir C:\\ `",
        "  && echo done",
        "COPY testfile.txt c:\\",
        "ENV A=x`$B",
    ]
    .join("\n");
    let df = parse(&text).expect("parses");
    assert_eq!(df.escape, '`');
    let k: Vec<&InstructionKind> = df.stages[0].instructions.iter().map(|i| &i.kind).collect();
    assert_eq!(
        k[0],
        &InstructionKind::Run(Command::Shell("dir C:\\   && echo done".into()))
    );
    assert_eq!(df.stages[0].instructions[1].line, 5);
    // With ` as escape, a trailing backslash is plain text.
    let InstructionKind::Copy(c) = k[1] else {
        panic!("{:?}", k[1])
    };
    assert_eq!(c.dest, "c:\\");
    assert_eq!(k[2], &InstructionKind::Env(kv(&[("A", "x`$B")])));
}

#[test]
fn directives() {
    let esc = |t: &str| parse(t).expect(t).escape;
    // Case and blanks do not matter.
    assert_eq!(esc("#  ESCAPE = `\nFROM a"), '`');
    assert_eq!(esc("# escape=\\\nFROM a"), '\\');
    // syntax (and check) are read and ignored; they may precede escape.
    assert_eq!(esc("# syntax=docker/dockerfile:1\n# escape=`\nFROM a"), '`');
    // After a comment, a blank line or an instruction it is a comment.
    assert_eq!(esc("# hello\n# escape=`\nFROM a"), '\\');
    assert_eq!(esc("\n# escape=`\nFROM a"), '\\');
    assert_eq!(esc("FROM a\n# escape=`"), '\\');
    // An unknown directive ends the directives too.
    assert_eq!(esc("# foo=bar\n# escape=`\nFROM a"), '\\');
    assert_eq!(esc("# escape=\n# escape=`\nFROM a"), '\\');
    assert_eq!(esc("# check=skip=all\n#escape=`\nFROM a"), '`');
}

#[test]
fn instruction_names_any_case() {
    let k = instrs("FROM a\nrun x\nRuN y\nworkdir /w\nCoPy a b\n");
    assert_eq!(k.len(), 4);
    assert!(matches!(&k[0], InstructionKind::Run(Command::Shell(c)) if c == "x"));
    assert!(matches!(&k[3], InstructionKind::Copy(_)));
    let df = parse("from a AS Build\nfrom build as next").expect("parses");
    assert_eq!(df.stages[0].name.as_deref(), Some("build"));
    assert_eq!(df.stages[1].image, "build");
}

#[test]
fn exec_and_shell_forms() {
    let cases: &[(&str, InstructionKind)] = &[
        (
            "RUN echo hi",
            InstructionKind::Run(Command::Shell("echo hi".into())),
        ),
        (
            "RUN [\"echo\", \"hi there\"]",
            InstructionKind::Run(Command::Exec(s(&["echo", "hi there"]))),
        ),
        (
            "RUN   [ \"a\" ,\"b\\\"c\" ]  ",
            InstructionKind::Run(Command::Exec(s(&["a", "b\"c"]))),
        ),
        ("CMD []", InstructionKind::Cmd(Command::Exec(vec![]))),
        (
            "CMD python -m http.server",
            InstructionKind::Cmd(Command::Shell("python -m http.server".into())),
        ),
        (
            "ENTRYPOINT [\"/entry.sh\"]",
            InstructionKind::Entrypoint(Command::Exec(s(&["/entry.sh"]))),
        ),
        (
            "ENTRYPOINT exec app",
            InstructionKind::Entrypoint(Command::Shell("exec app".into())),
        ),
        (
            "SHELL [\"/bin/bash\", \"-o\", \"pipefail\", \"-c\"]",
            InstructionKind::Shell(s(&["/bin/bash", "-o", "pipefail", "-c"])),
        ),
        // Not JSON of strings: the shell form, as in Docker.
        (
            "CMD [\"a\", 1]",
            InstructionKind::Cmd(Command::Shell("[\"a\", 1]".into())),
        ),
        // A here-string is not a heredoc, nor is << inside quotes or a word.
        (
            "RUN cat <<< hi && echo '<<EOF' \"<<X\" a<<b",
            InstructionKind::Run(Command::Shell(
                "cat <<< hi && echo '<<EOF' \"<<X\" a<<b".into(),
            )),
        ),
    ];
    for (line, want) in cases {
        assert_eq!(&one(line), want, "{line}");
    }
}

#[test]
fn broken_json_warns() {
    let df = parse("FROM a\nCMD ['single', 'quotes']\nRUN [\"ok\"]").expect("parses");
    assert_eq!(
        df.warnings,
        vec![Warning {
            line: Some(2),
            message: "CMD is not a valid JSON array of strings, so it runs as a shell command"
                .into(),
        }]
    );
}

#[test]
fn from_forms() {
    let df = parse(
        "ARG V=3.11\n\
         FROM --platform=$BUILDPLATFORM python:${V} AS Builder\n\
         FROM builder\n\
         FROM scratch as out-1.x_y",
    )
    .expect("parses");
    assert_eq!(df.global_args.len(), 1);
    let st: Vec<(&str, Option<&str>, Option<&str>)> = df
        .stages
        .iter()
        .map(|s| (s.image.as_str(), s.name.as_deref(), s.platform.as_deref()))
        .collect();
    assert_eq!(
        st,
        vec![
            ("python:${V}", Some("builder"), Some("$BUILDPLATFORM")),
            ("builder", None, None),
            ("scratch", Some("out-1.x_y"), None),
        ]
    );
}

#[test]
fn args() {
    assert_eq!(
        one("ARG A B=2 C=\"x y\" D="),
        InstructionKind::Arg(vec![
            ArgDecl {
                name: "A".into(),
                default: None
            },
            ArgDecl {
                name: "B".into(),
                default: Some("2".into())
            },
            ArgDecl {
                name: "C".into(),
                default: Some("\"x y\"".into())
            },
            ArgDecl {
                name: "D".into(),
                default: Some("".into())
            },
        ])
    );
}

#[test]
fn env_and_label_forms() {
    let cases: &[(&str, InstructionKind)] = &[
        (
            "ENV A=1 B=\"two words\" C='$x' D=a\\ b",
            InstructionKind::Env(kv(&[
                ("A", "1"),
                ("B", "\"two words\""),
                ("C", "'$x'"),
                ("D", "a\\ b"),
            ])),
        ),
        // Legacy: one key, the rest of the line.
        (
            "ENV PATH_EXTRA  /opt/bin:/usr/bin and more",
            InstructionKind::Env(kv(&[("PATH_EXTRA", "/opt/bin:/usr/bin and more")])),
        ),
        ("ENV E=", InstructionKind::Env(kv(&[("E", "")]))),
        (
            "ENV Q=\"a \\\" b\"",
            InstructionKind::Env(kv(&[("Q", "\"a \\\" b\"")])),
        ),
        (
            "LABEL org.opencontainers.image.title=\"My app\" version=1.0",
            InstructionKind::Label(kv(&[
                ("org.opencontainers.image.title", "\"My app\""),
                ("version", "1.0"),
            ])),
        ),
        (
            "LABEL description This is my app",
            InstructionKind::Label(kv(&[("description", "This is my app")])),
        ),
    ];
    for (line, want) in cases {
        assert_eq!(&one(line), want, "{line}");
    }
}

#[test]
fn copy_and_add_forms() {
    let c =
        |from: Option<&str>, chown: Option<&str>, chmod: Option<&str>, src: &[&str], d: &str| {
            CopyArgs {
                from: from.map(Into::into),
                chown: chown.map(Into::into),
                chmod: chmod.map(Into::into),
                sources: s(src),
                dest: d.into(),
            }
        };
    let cases: &[(&str, InstructionKind)] = &[
        (
            "COPY a b /dst/",
            InstructionKind::Copy(c(None, None, None, &["a", "b"], "/dst/")),
        ),
        (
            "COPY --from=builder --chown=app:app --chmod=755 /out/bin /usr/local/bin/",
            InstructionKind::Copy(c(
                Some("builder"),
                Some("app:app"),
                Some("755"),
                &["/out/bin"],
                "/usr/local/bin/",
            )),
        ),
        (
            "COPY --link --from=\"0\" x y",
            InstructionKind::Copy(c(Some("0"), None, None, &["x"], "y")),
        ),
        (
            "COPY --link=false -- --odd-name y",
            InstructionKind::Copy(c(None, None, None, &["--odd-name"], "y")),
        ),
        (
            "COPY [\"my file.txt\", \"other\", \"/my dir/\"]",
            InstructionKind::Copy(c(None, None, None, &["my file.txt", "other"], "/my dir/")),
        ),
        (
            "COPY --chown=1000 [\"a\", \"b\"]",
            InstructionKind::Copy(c(None, Some("1000"), None, &["a"], "b")),
        ),
        (
            "ADD --chmod=644 app.tar.gz /opt/",
            InstructionKind::Add(c(None, None, Some("644"), &["app.tar.gz"], "/opt/")),
        ),
    ];
    for (line, want) in cases {
        assert_eq!(&one(line), want, "{line}");
    }
}

#[test]
fn metadata_instructions() {
    let df = parse(
        "FROM a\n\
         EXPOSE 80 443/tcp $P\n\
         STOPSIGNAL SIGINT\n\
         USER app:app\n\
         VOLUME /data\n\
         MAINTAINER me@example.com\n\
         HEALTHCHECK --interval=30s --timeout=1m30s --start-period=500ms --start-interval=1.5s --retries=3 CMD curl -f http://localhost/ || exit 1\n\
         HEALTHCHECK CMD [\"/bin/check\", \"-q\"]\n\
         HEALTHCHECK none",
    )
    .expect("parses");
    let k: Vec<&InstructionKind> = df.stages[0].instructions.iter().map(|i| &i.kind).collect();
    assert_eq!(k[0], &InstructionKind::Expose(s(&["80", "443/tcp", "$P"])));
    assert_eq!(k[1], &InstructionKind::StopSignal("SIGINT".into()));
    assert_eq!(k[2], &InstructionKind::User("app:app".into()));
    assert_eq!(
        k[3],
        &InstructionKind::Healthcheck(Healthcheck {
            test: s(&["CMD-SHELL", "curl -f http://localhost/ || exit 1"]),
            interval_ns: Some(30_000_000_000),
            timeout_ns: Some(90_000_000_000),
            start_period_ns: Some(500_000_000),
            start_interval_ns: Some(1_500_000_000),
            retries: Some(3),
        })
    );
    assert_eq!(
        k[4],
        &InstructionKind::Healthcheck(Healthcheck {
            test: s(&["CMD", "/bin/check", "-q"]),
            interval_ns: None,
            timeout_ns: None,
            start_period_ns: None,
            start_interval_ns: None,
            retries: None,
        })
    );
    let InstructionKind::Healthcheck(none) = k[5] else {
        panic!("{:?}", k[5])
    };
    assert_eq!(none.test, s(&["NONE"]));
    // VOLUME and MAINTAINER are dropped with a warning each.
    assert_eq!(k.len(), 6);
    let w: Vec<(Option<usize>, &str)> = df
        .warnings
        .iter()
        .map(|w| (w.line, w.message.as_str()))
        .collect();
    assert_eq!(
        w,
        vec![
            (
                Some(5),
                "VOLUME has no effect in dsec builds (no volume is created)"
            ),
            (
                Some(6),
                "MAINTAINER is deprecated and ignored; use LABEL maintainer=..."
            ),
        ]
    );
    assert_eq!(
        df.warnings[0].to_string(),
        "Dockerfile line 5: VOLUME has no effect in dsec builds (no volume is created)"
    );
}

/// Every refusal names the line where the instruction starts and quotes it.
#[test]
fn errors_name_their_line() {
    let u = |s: &str| ErrorKind::Unsupported(s.into());
    let syn = |s: &str| ErrorKind::Syntax(s.into());
    let cases: Vec<(&str, usize, ErrorKind)> = vec![
        ("FROM a\nRUN x\n\nONBUILD RUN make", 4, u("ONBUILD")),
        (
            "FROM a\nRUN --mount=type=cache,target=/root/.cache pip install x",
            2,
            u("RUN --mount"),
        ),
        ("FROM a\nRUN --network=none true", 2, u("RUN --network")),
        (
            "FROM a\nRUN --security=insecure true",
            2,
            u("RUN --security"),
        ),
        (
            "FROM a\nRUN cat > /f <<EOF\nhello\nEOF",
            2,
            u("a heredoc (<<EOF) in RUN"),
        ),
        (
            "FROM a\nRUN python - <<'PY'",
            2,
            u("a heredoc (<<EOF) in RUN"),
        ),
        ("FROM a\nRUN bash 2<<-END", 2, u("a heredoc (<<EOF) in RUN")),
        (
            "FROM a\nCOPY <<EOF /etc/conf",
            2,
            u("a heredoc (<<EOF) in COPY"),
        ),
        (
            "FROM a\nADD --checksum=sha256:abc https://x/y.tgz /",
            2,
            u("ADD --checksum (ADD takes only local sources)"),
        ),
        (
            "FROM a\nADD --keep-git-dir=true git@host:r.git /src",
            2,
            u("ADD of a git repository"),
        ),
        ("FROM a\nCOPY --parents a/ b/", 2, u("COPY --parents")),
        ("FROM a\nCOPY --exclude=*.md . /", 2, u("COPY --exclude")),
        (
            "FROM a\n\nFOO bar",
            3,
            ErrorKind::UnknownInstruction("FOO".into()),
        ),
        ("FROM a\nRUN", 2, ErrorKind::MissingArguments("RUN".into())),
        (
            "FROM a\nRUN []",
            2,
            ErrorKind::MissingArguments("RUN".into()),
        ),
        ("FROM a\nCMD", 2, ErrorKind::MissingArguments("CMD".into())),
        (
            "FROM a\nWORKDIR",
            2,
            ErrorKind::MissingArguments("WORKDIR".into()),
        ),
        (
            "FROM a\nUSER",
            2,
            ErrorKind::MissingArguments("USER".into()),
        ),
        (
            "FROM a\nEXPOSE",
            2,
            ErrorKind::MissingArguments("EXPOSE".into()),
        ),
        (
            "FROM a\nSTOPSIGNAL",
            2,
            ErrorKind::MissingArguments("STOPSIGNAL".into()),
        ),
        (
            "FROM a\nVOLUME",
            2,
            ErrorKind::MissingArguments("VOLUME".into()),
        ),
        (
            "FROM a\nMAINTAINER",
            2,
            ErrorKind::MissingArguments("MAINTAINER".into()),
        ),
        ("FROM a\nARG", 2, ErrorKind::MissingArguments("ARG".into())),
        ("FROM a\nENV", 2, ErrorKind::MissingArguments("ENV".into())),
        (
            "FROM a\nLABEL",
            2,
            ErrorKind::MissingArguments("LABEL".into()),
        ),
        (
            "FROM a\nSHELL",
            2,
            ErrorKind::MissingArguments("SHELL".into()),
        ),
        (
            "FROM a\nHEALTHCHECK",
            2,
            ErrorKind::MissingArguments("HEALTHCHECK".into()),
        ),
        (
            "FROM a\nHEALTHCHECK CMD []",
            2,
            ErrorKind::MissingArguments("HEALTHCHECK CMD".into()),
        ),
        (
            "FROM a\nHEALTHCHECK CMD",
            2,
            ErrorKind::MissingArguments("HEALTHCHECK CMD".into()),
        ),
        ("FROM", 1, ErrorKind::MissingArguments("FROM".into())),
        ("FROM a b", 1, syn("FROM takes IMAGE or IMAGE AS NAME")),
        ("FROM a AS b c", 1, syn("FROM takes IMAGE or IMAGE AS NAME")),
        ("FROM a INTO b", 1, syn("FROM takes IMAGE or IMAGE AS NAME")),
        (
            "FROM a AS 1st",
            1,
            ErrorKind::Stage(
                "invalid stage name \"1st\": it must start with a letter and have only letters, \
                 digits, '-', '_' and '.'"
                    .into(),
            ),
        ),
        (
            "FROM a AS b\nFROM c AS B",
            2,
            ErrorKind::Stage("duplicate stage name \"b\"".into()),
        ),
        ("RUN x\nFROM a", 1, ErrorKind::BeforeFrom("RUN".into())),
        (
            "ARG A\nENV B=1\nFROM a",
            2,
            ErrorKind::BeforeFrom("ENV".into()),
        ),
        (
            "VOLUME /x\nFROM a",
            1,
            ErrorKind::BeforeFrom("VOLUME".into()),
        ),
        ("FROM --platform a", 1, syn("flag --platform needs a value")),
        (
            "FROM --plat=x a",
            1,
            ErrorKind::UnknownFlag {
                instruction: "FROM".into(),
                flag: "plat".into(),
            },
        ),
        (
            "FROM a\nCMD --help",
            2,
            ErrorKind::UnknownFlag {
                instruction: "CMD".into(),
                flag: "help".into(),
            },
        ),
        (
            "FROM a\nADD --from=b x y",
            2,
            ErrorKind::UnknownFlag {
                instruction: "ADD".into(),
                flag: "from".into(),
            },
        ),
        (
            "FROM a\nCOPY --from=a --from=b x y",
            2,
            syn("duplicate flag --from"),
        ),
        (
            "FROM a\nCOPY --chown x y",
            2,
            syn("flag --chown needs a value"),
        ),
        (
            "FROM a\nCOPY --link=maybe x y",
            2,
            ErrorKind::Invalid("flag --link takes true or false, not \"maybe\"".into()),
        ),
        (
            "FROM a\nCOPY onlyone",
            2,
            syn("COPY needs at least one source and a destination"),
        ),
        (
            "FROM a\nADD [\"x\"]",
            2,
            syn("ADD needs at least one source and a destination"),
        ),
        (
            "FROM a\nENV ONLYKEY",
            2,
            syn("ENV needs NAME=VALUE (or NAME VALUE)"),
        ),
        (
            "FROM a\nENV A=1 B",
            2,
            syn("ENV: no '=' in \"B\"; use NAME=VALUE for every pair"),
        ),
        ("FROM a\nLABEL =x", 2, syn("LABEL names cannot be empty")),
        ("FROM a\nARG =x", 2, syn("ARG needs a name before '='")),
        (
            "FROM a\nSHELL /bin/bash -c",
            2,
            syn("SHELL takes a non-empty JSON array, e.g. [\"/bin/bash\", \"-c\"]"),
        ),
        (
            "FROM a\nSHELL []",
            2,
            syn("SHELL takes a non-empty JSON array, e.g. [\"/bin/bash\", \"-c\"]"),
        ),
        (
            "FROM a\nHEALTHCHECK NONE x",
            2,
            syn("HEALTHCHECK NONE takes no flags or arguments"),
        ),
        (
            "FROM a\nHEALTHCHECK --retries=1 NONE",
            2,
            syn("HEALTHCHECK NONE takes no flags or arguments"),
        ),
        (
            "FROM a\nHEALTHCHECK RUN x",
            2,
            syn("HEALTHCHECK takes CMD or NONE, not \"RUN\""),
        ),
        (
            "FROM a\nHEALTHCHECK --interval=5 CMD x",
            2,
            ErrorKind::Invalid("--interval: \"5\" is not a duration like 30s".into()),
        ),
        (
            "FROM a\nHEALTHCHECK --retries=-1 CMD x",
            2,
            ErrorKind::Invalid("--retries: \"-1\" is not a non-negative number".into()),
        ),
        (
            "# escape=x\nFROM a",
            1,
            ErrorKind::Directive("escape must be ` or \\, not \"x\"".into()),
        ),
        (
            "# escape=`\n# escape=`\nFROM a",
            2,
            ErrorKind::Directive("only one escape directive may be used".into()),
        ),
    ];
    for (text, line, kind) in cases {
        let e = err(text);
        match &e {
            DockerfileError::At {
                line: l, kind: k, ..
            } => {
                assert_eq!((*l, k), (line, &kind), "{text:?}");
            }
            other => panic!("{text:?}: {other:?}"),
        }
        let shown = e.to_string();
        assert!(
            shown.starts_with(&format!("Dockerfile line {line}: ")),
            "{shown}"
        );
        // The message quotes the instruction.
        let first_word = text.lines().nth(line - 1).unwrap_or_default();
        let first_word = first_word.split_whitespace().next().unwrap_or_default();
        assert!(shown.contains(&format!("(in \"{first_word}")), "{shown}");
    }
}

#[test]
fn error_message_format() {
    let e = err("FROM a\nRUN x\n\n\n\n\nONBUILD RUN make");
    assert_eq!(
        e.to_string(),
        "Dockerfile line 7: ONBUILD is not supported (in \"ONBUILD RUN make\")"
    );
    assert_eq!(e.line(), Some(7));
    // Long instructions are shortened in the message, not in the error.
    let long = format!("FROM a\nFOO {}", "x".repeat(300));
    let e = err(&long);
    assert!(e.to_string().ends_with("...\")"), "{e}");
    let DockerfileError::At { text, .. } = &e else {
        panic!("{e:?}")
    };
    assert_eq!(text.len(), 304);
}

#[test]
fn no_from() {
    assert_eq!(err(""), DockerfileError::NoFrom);
    assert_eq!(err("# only a comment\n\n"), DockerfileError::NoFrom);
    assert_eq!(err("ARG A=1"), DockerfileError::NoFrom);
    assert_eq!(DockerfileError::NoFrom.line(), None);
}

#[test]
fn global_args_before_from() {
    let df = parse("ARG BASE=python\nARG TAG\nFROM ${BASE}:${TAG}\nARG TAG").expect("parses");
    assert_eq!(df.global_args.len(), 2);
    assert_eq!(df.global_args[1].line, 2);
    assert_eq!(df.stages[0].instructions.len(), 1);
}

#[test]
fn words_keep_quotes_and_escapes() {
    let cases: &[(&str, &[&str])] = &[
        ("a b  c", &["a", "b", "c"]),
        ("a=\"x y\" b='p q'", &["a=\"x y\"", "b='p q'"]),
        ("a\\ b c", &["a\\ b", "c"]),
        ("\"unterminated x", &["\"unterminated x"]),
        ("'a\\' b", &["'a\\'", "b"]),
        ("x\\", &["x"]),
        ("\"\"", &["\"\""]),
        ("", &[]),
    ];
    for (input, want) in cases {
        assert_eq!(words(input, '\\'), s(want), "{input:?}");
    }
    assert_eq!(words("a` b", '`'), s(&["a` b"]));
}

#[test]
fn flags_extraction() {
    let cases: &[(&str, &[&str], &str)] = &[
        ("--from=a x y", &["from=a"], "x y"),
        ("--a --b=\"q r\" rest", &["a", "b=q r"], "rest"),
        ("-- --not-a-flag x", &[], "--not-a-flag x"),
        ("-x y", &[], "-x y"),
        ("--only", &["only"], ""),
        ("x --late", &[], "x --late"),
    ];
    for (input, flags, rest) in cases {
        let (f, r) = extract_flags(input, '\\');
        assert_eq!((f, r), (s(flags), *rest), "{input:?}");
    }
}

#[test]
fn heredoc_detection() {
    let cases = [
        ("cat <<EOF", true),
        ("cat <<-EOF", true),
        ("cat <<'EOF'", true),
        ("cat <<\"EOF\"", true),
        ("cat 3<<EOF", true),
        ("cat << EOF", false),
        ("cat <<", false),
        ("cat <<<word", false),
        ("echo '<<EOF'", false),
        ("echo \"a \\\" <<EOF\"", false),
        ("echo a<<EOF", false),
        ("echo \\<<EOF", false),
    ];
    for (input, want) in cases {
        assert_eq!(has_heredoc(input), want, "{input:?}");
    }
}

#[test]
fn durations() {
    let cases = [
        ("0", Some(0)),
        ("1ns", Some(1)),
        ("2us", Some(2_000)),
        ("3µs", Some(3_000)),
        ("4ms", Some(4_000_000)),
        ("1.5s", Some(1_500_000_000)),
        ("2m", Some(120_000_000_000)),
        ("1h1m1s", Some(3_661_000_000_000)),
        (".5s", Some(500_000_000)),
        ("", None),
        ("5", None),
        ("5x", None),
        ("s", None),
        ("-1s", None),
        (".s", None),
        ("1.2.3s", None),
        ("9999999999999h", None),
    ];
    for (input, want) in cases {
        assert_eq!(parse_duration(input), want, "{input:?}");
    }
}

#[test]
fn dockerfile_round_trips_through_serde() {
    let df = parse(SWE).expect("parses");
    let json = serde_json::to_string(&df).expect("serializes");
    let back: Dockerfile = serde_json::from_str(&json).expect("deserializes");
    assert_eq!(back, df);
}

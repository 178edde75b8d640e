//! The attack suite: every program in `attacks/` runs in a fresh, small sandbox next to a
//! neighbour sandbox; each must report only `contained:` outcomes, its sandbox must stay
//! usable, and afterwards the host, the neighbour and the node must be untouched (see
//! `attacks/README.md`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use dsec_e2e::{host, require_root, sh, Server};
use dsec_wire::v1::*;
use futures::StreamExt;

fn attacks_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("attacks")
}

fn reversed(s: &str) -> String {
    s.chars().rev().collect()
}

/// Resident memory of a process in KiB.
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// The end of a microVM sandbox's guest console (its kernel's and its agent's messages),
/// for a failure's message; empty for other levels.
fn guest_console(run_dir: &Path, sandbox: &str) -> String {
    let path = run_dir
        .join("sandboxes")
        .join(sandbox)
        .join("vm/console.log");
    match std::fs::read(&path) {
        Ok(bytes) => {
            let text =
                String::from_utf8_lossy(&bytes[bytes.len().saturating_sub(4000)..]).into_owned();
            format!("\nguest console ({}):\n{text}", path.display())
        }
        Err(_) => String::new(),
    }
}

/// What one attack program did.
#[derive(Debug)]
struct Outcome {
    name: String,
    sandbox: String,
    stdout: String,
    stderr: String,
    exit: ExitInfo,
    stdout_bytes: usize,
    usable_after: bool,
    /// The attack ended its own sandbox (allowed by the level's `may_end_sandbox`).
    ended: bool,
}

/// One isolation set-up the whole suite runs under: every program in `attacks/` runs at
/// every level (one test per level, below).
struct Level {
    /// Server name (and the end of its cgroup parent).
    name: &'static str,
    /// Extra `dsec serve` flags.
    args: &'static [&'static str],
    /// The level the attack sandboxes ask for.
    isolation: Isolation,
    /// Programs that may end their own sandbox at this level (program, why): it must
    /// then be gone without a trace on the host or the neighbour, as with any other
    /// attack, but need not stay usable.
    may_end_sandbox: &'static [(&'static str, &'static str)],
    /// Reports the level is known to give, each a program and the start of its
    /// `escaped:` line: printed with the reason, not failed. Each is in the threat model.
    known_exposures: &'static [(&'static str, &'static str)],
}

/// Every isolation level a sandbox can ask for, with the set-ups worth attacking. The
/// match fails to compile when a level is added, until it is attacked here too.
fn levels() -> Vec<Level> {
    let all = [
        Isolation::Container,
        Isolation::Oci,
        Isolation::Gvisor,
        Isolation::Microvm,
    ];
    all.iter()
        .flat_map(|level| match level {
            Isolation::Container => vec![
                Level {
                    name: "attacks",
                    args: &[],
                    isolation: Isolation::Container,
                    may_end_sandbox: &[],
                    known_exposures: &[],
                },
                // The supported set-up without user namespaces (kernels without idmapped
                // mounts): root inside is host root with a reduced capability set, and
                // the agent is kept only by being non-dumpable and the capability drop.
                Level {
                    name: "attacks-no-userns",
                    args: &["--no-userns"],
                    isolation: Isolation::Container,
                    may_end_sandbox: &[],
                    known_exposures: &[],
                },
            ],
            // The agent is `dsec-agent serve` under runc, root with the code it serves.
            Isolation::Oci => vec![Level {
                name: "attacks-oci",
                args: &[],
                isolation: Isolation::Oci,
                may_end_sandbox: &[],
                known_exposures: &[],
            }],
            // The agent under gVisor's kernel (runsc), root there.
            Isolation::Gvisor => vec![Level {
                name: "attacks-gvisor",
                args: &[],
                isolation: Isolation::Gvisor,
                // Debian 12's runsc (2022) limits no memory inside its kernel: when the
                // sandbox fills its memory, the host cgroup's OOM kill takes the Sentry,
                // and with it the whole sandbox (128 forked interpreters fill it too).
                may_end_sandbox: &[
                    ("memory-balloon.sh", "fills the sandbox's memory"),
                    ("fork-bomb.py", "fills the sandbox's memory"),
                ],
                // That runsc ignores PID 1's non-dumpable flag for these three files:
                // the agent's environment (PATH) and memory map are visible; its memory
                // and execution are not (ptrace and /proc/1/mem are refused).
                known_exposures: &[
                    ("ptrace-agent.py", "escaped: /proc/1/environ readable"),
                    ("ptrace-agent.py", "escaped: /proc/1/maps readable"),
                    ("ptrace-agent.py", "escaped: PID 1's descriptors followed"),
                ],
            }],
            // The agent as a QEMU guest's init (TCG here), root in the guest with a
            // container's privileges; its memory-pressure guard ends a guest filled to
            // its size before the guest thrashes (see `dsec-agent`'s `memguard`).
            Isolation::Microvm => vec![Level {
                name: "attacks-microvm",
                args: &[],
                isolation: Isolation::Microvm,
                may_end_sandbox: &[],
                known_exposures: &[],
            }],
            // A full VM runs the image's own system with its commands as that system's
            // root: the in-guest containment these programs probe is by design not
            // there, and the machine is the boundary. Its host-side checks (host and
            // neighbour untouched) are to come with an attack level of its own.
            Isolation::Vm => vec![],
        })
        .collect()
}

async fn run_level(name: &str) {
    if !require_root() {
        return;
    }
    let level = levels()
        .into_iter()
        .find(|l| l.name == name)
        .unwrap_or_else(|| panic!("no level {name}"));
    if level.isolation == Isolation::Gvisor
        && !std::process::Command::new("runsc")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    {
        assert!(
            std::env::var_os("CI").is_none(),
            "runsc is not installed (apt-get install runsc)"
        );
        eprintln!("skipped: runsc is not installed (apt-get install runsc)");
        return;
    }
    if level.isolation == Isolation::Microvm && !dsec_e2e::have_microvm() {
        return;
    }
    run_suite(&level).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn every_attack_is_contained_and_the_host_and_neighbour_are_untouched() {
    run_level("attacks").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn every_attack_is_contained_without_user_namespaces_too() {
    run_level("attacks-no-userns").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn every_attack_is_contained_at_isolation_oci_too() {
    run_level("attacks-oci").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn every_attack_is_contained_at_isolation_gvisor_too() {
    run_level("attacks-gvisor").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn every_attack_is_contained_at_isolation_microvm_too() {
    run_level("attacks-microvm").await;
}

/// Every level above has its test.
#[test]
fn every_level_has_a_test() {
    let source = include_str!("attacks.rs");
    for level in levels() {
        assert!(
            source.contains(&format!("run_level(\"{}\")", level.name)),
            "no test runs level {}",
            level.name
        );
    }
}

async fn run_suite(level: &Level) {
    let name = level.name;
    let parent = format!("dsec-{name}");
    let mut all = vec!["--disk-pool", "4", "--cgroup-parent", &parent];
    all.extend_from_slice(level.args);
    let s = Server::start_with(name, true, &all).await.expect("server");
    s.ensure_base(None).await.expect("base image");
    let c = s.client();
    let node_pid = {
        let port = s.url.rsplit(':').next().expect("port").to_string();
        let out = std::process::Command::new("sh")
            .args(["-c", &format!("pgrep -f 'dsec serve.*127.0.0.1:{port}'")])
            .output()
            .expect("pgrep");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .and_then(|l| l.trim().parse::<u32>().ok())
            .expect("node pid")
    };
    let node_rss_before = rss_kib(node_pid);

    // Something only the host has, and a neighbour with something only it has.
    let secret = format!("host-secret-{}", std::process::id() as u64 * 7919 + 12345);
    let secret_file = std::env::temp_dir().join(format!("dsec-e2e/{name}/host-secret.txt"));
    std::fs::write(&secret_file, &secret).expect("write host secret");
    let mark = format!("neighbour-mark-{}", std::process::id());
    let neighbour = c
        .create_sandbox(CreateSandboxRequest {
            isolation: level.isolation,
            ..Default::default()
        })
        .await
        .expect("neighbour");
    c.write_file(&neighbour.id, "/data.txt", None, b"neighbour data".to_vec())
        .await
        .expect("neighbour data");
    c.start_process(
        &neighbour.id,
        dsec_e2e::background(dsec_wire::v1::Command::Argv(vec![
            "sh".into(),
            "-c".into(),
            "sleep 3600".into(),
            mark.clone(),
        ])),
    )
    .await
    .expect("neighbour process");

    let api_port = s.url.rsplit(':').next().expect("port").to_string();
    let env = BTreeMap::from([
        ("HOST_SECRET_REV".to_string(), reversed(&secret)),
        ("NEIGHBOUR_MARK_REV".to_string(), reversed(&mark)),
        ("API_PORT".to_string(), api_port),
        (
            "HOST_STATE_DIR".to_string(),
            s.state_dir.display().to_string(),
        ),
        (
            "DSEC_ISOLATION".to_string(),
            serde_json::to_value(level.isolation)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default(),
        ),
    ]);
    let mut programs: Vec<PathBuf> = std::fs::read_dir(attacks_dir())
        .expect("attacks dir")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| matches!(p.extension().and_then(|e| e.to_str()), Some("sh" | "py")))
        .collect();
    programs.sort();
    assert!(programs.len() >= 15, "attack programs: {programs:?}");

    let isolation = level.isolation;
    let may_end = level.may_end_sandbox;
    let outcomes: Vec<Outcome> = futures::stream::iter(programs)
        .map(|path| {
            let (c, env) = (c.clone(), env.clone());
            async move {
                let name = path
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                let text = std::fs::read_to_string(&path).expect("attack program");
                let interpreter = if name.ends_with(".py") {
                    "python3"
                } else {
                    "sh"
                };
                let sb = c
                    .create_sandbox(CreateSandboxRequest {
                        resources: Resources {
                            memory_mb: Some(256),
                            disk_mb: Some(512),
                            pids: Some(128),
                            ..Default::default()
                        },
                        labels: BTreeMap::from([("attack".to_string(), name.clone())]),
                        isolation,
                        ..Default::default()
                    })
                    .await
                    .unwrap_or_else(|e| panic!("create for {name}: {e}"));
                let r = tokio::time::timeout(
                    Duration::from_secs(200),
                    c.exec(
                        &sb.id,
                        ExecRequest {
                            cmd: dsec_wire::v1::Command::Argv(vec![
                                interpreter.into(),
                                "-c".into(),
                                text,
                            ]),
                            env,
                            timeout_s: Some(150.0),
                            ..sh("")
                        },
                    ),
                )
                .await
                .unwrap_or_else(|_| panic!("{name}: no answer in 200 s (agent stopped?)"));
                let r = match r {
                    Ok(r) => r,
                    Err(e) if may_end.iter().any(|(p, _)| *p == name) => {
                        return Outcome {
                            name,
                            sandbox: sb.id,
                            stdout: String::new(),
                            stderr: e.to_string(),
                            exit: ExitInfo::default(),
                            stdout_bytes: 0,
                            usable_after: false,
                            ended: true,
                        };
                    }
                    Err(e) => panic!("run {name}: {e}"),
                };
                let usable_after =
                    tokio::time::timeout(Duration::from_secs(30), c.exec(&sb.id, sh("echo alive")))
                        .await
                        .is_ok_and(|r| r.is_ok_and(|r| r.stdout == "alive\n"));
                Outcome {
                    name,
                    sandbox: sb.id,
                    stdout_bytes: r.stdout.len(),
                    stdout: r.stdout,
                    stderr: r.stderr,
                    exit: r.exit,
                    usable_after,
                    ended: false,
                }
            }
        })
        .buffer_unordered(6)
        .collect()
        .await;

    let mut report = String::new();
    for o in &outcomes {
        if o.ended {
            // It took its own sandbox down: that sandbox is no longer `ready`, and the
            // checks of the host and the neighbour below hold as for every attack.
            let sb = c.get_sandbox(&o.sandbox).await.expect("record");
            assert_ne!(sb.state, SandboxState::Ready, "{}: {sb:?}", o.name);
            report.push_str(&format!(
                "{}: ended its own sandbox ({:?}: {})\n",
                o.name, sb.state, o.stderr
            ));
            continue;
        }
        let lines: Vec<&str> = o
            .stdout
            .lines()
            .filter(|l| l.starts_with("contained:") || l.starts_with("escaped:"))
            .collect();
        report.push_str(&format!("{}: {:?}\n", o.name, lines));
        let known = |l: &str| {
            level
                .known_exposures
                .iter()
                .any(|(p, prefix)| *p == o.name && l.starts_with(prefix))
        };
        assert!(
            !lines.iter().any(|l| l.starts_with("escaped:") && !known(l)),
            "{}: {lines:?}\nstderr: {}",
            o.name,
            o.stderr
        );
        assert!(
            lines.iter().any(|l| l.starts_with("contained:")),
            "{} reported nothing (exit {:?}): stdout tail {:?} stderr {:?}{}",
            o.name,
            o.exit,
            &o.stdout[o.stdout.len().saturating_sub(300)..],
            o.stderr,
            guest_console(&s.run_dir, &o.sandbox)
        );
        assert!(o.usable_after, "{}: sandbox unusable afterwards", o.name);
        if o.name == "yes-flood.sh" {
            // 60 s of `yes` is gigabytes; what reached us is the tail the ring kept.
            let cap = dsec_wire::agent::DEFAULT_OUTPUT_LIMIT as usize;
            assert!(
                o.stdout_bytes <= cap,
                "yes output not capped at {cap}: {} bytes",
                o.stdout_bytes
            );
        }
    }
    eprintln!("{name}:\n{report}");

    // The neighbour: its process, its files, its agent.
    let r = c
        .exec(&neighbour.id, sh("cat /data.txt; echo; pgrep -c -x sleep"))
        .await
        .expect("neighbour exec");
    assert_eq!(r.stdout, "neighbour data\n1\n", "neighbour disturbed");
    // The host: the secret file as it was, the node healthy and not bloated.
    assert_eq!(
        std::fs::read_to_string(&secret_file).expect("secret"),
        secret
    );
    c.health().await.expect("node healthy");
    let node_rss_after = rss_kib(node_pid);
    assert!(
        node_rss_after < node_rss_before + 200 * 1024,
        "node memory grew from {node_rss_before} KiB to {node_rss_after} KiB"
    );
    // Deleting leaves nothing of the attack sandboxes.
    for o in &outcomes {
        c.delete_sandbox(&o.sandbox).await.expect("delete");
    }
    for o in &outcomes {
        let gone = dsec_e2e::wait_until(Duration::from_secs(10), || async {
            (host::processes(&o.sandbox).is_empty() && host::cgroup_dirs(&o.sandbox).is_empty())
                .then_some(())
        })
        .await;
        assert!(
            gone.is_some(),
            "{} left processes {:?} or cgroups {:?}",
            o.name,
            host::processes(&o.sandbox),
            host::cgroup_dirs(&o.sandbox)
        );
    }
    c.delete_sandbox(&neighbour.id)
        .await
        .expect("delete neighbour");
}

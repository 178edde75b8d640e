//! Function calls on a real `dsec serve`: a pool made for calls runs them in its warm
//! sandboxes, and no call sees anything another left behind (a file, a background
//! process, an environment change, a modified system file, a SysV IPC object), while
//! output, exit codes, timeouts, input files, fetched files and bad input behave as
//! documented.

use std::collections::BTreeMap;
use std::time::Duration;

use dsec_e2e::{require_root, wait_until, Server};
use dsec_wire::agent::Command;
use dsec_wire::v1::*;
use dsec_wire::ErrorCode;

fn server() -> &'static Server {
    Server::shared("fncall")
}

fn request(pool: &str, cmd: &str) -> FnCallRequest {
    let mut r: FnCallRequest =
        serde_json::from_value(serde_json::json!({"pool": pool})).expect("defaults");
    r.command = Some(Command::Shell(cmd.into()));
    r
}

/// A pool of `size` call sandboxes, each serving at most `max_calls`, ready.
async fn pool(c: &dsec_client::Client, name: &str, size: u32, max_calls: u32) {
    let spec = PoolSpec {
        name: name.into(),
        template: CreateSandboxRequest {
            env: BTreeMap::from([("POOL_ENV".to_string(), "base".to_string())]),
            ..Default::default()
        },
        min: size,
        max: size,
        autoscale: AutoscalePolicy::default(),
        fncall: Some(FnCallPolicy { max_calls }),
    };
    c.create_pool(&spec).await.expect("create pool");
    wait_until(Duration::from_secs(60), || async {
        let p = c.get_pool(name).await.ok()?;
        (p.ready == size).then_some(())
    })
    .await
    .unwrap_or_else(|| panic!("pool {name} never got {size} warm sandboxes"));
}

async fn call(c: &dsec_client::Client, pool: &str, cmd: &str) -> FnCallResponse {
    c.fncall(&request(pool, cmd)).await.expect("call")
}

#[tokio::test(flavor = "multi_thread")]
async fn nothing_one_call_leaves_reaches_the_next() {
    if !require_root() {
        return;
    }
    let c = server().client();
    // One sandbox, so every call below runs in the same one.
    pool(&c, "iso", 1, 1000).await;
    let first = call(
        &c,
        "iso",
        "echo left > /tmp/left; echo left > /root/left; \
         echo 'export LEAK=1' >> /etc/profile; echo 'evil' >> /etc/passwd; \
         rm -f /etc/hostname; export POOL_ENV=changed; \
         (sleep 300 &) ; nohup sleep 301 >/dev/null 2>&1 & \
         python3 -c 'import sysv_ipc' 2>/dev/null; \
         ipcmk -M 4096 >/dev/null 2>&1; ipcs -m | grep -c '^0x' ; echo done",
    )
    .await;
    assert_eq!(first.status, FnCallStatus::Finished, "{first:?}");
    assert_eq!(first.exit_code, Some(0), "{first:?}");
    assert!(first.stdout.ends_with("done\n"), "{first:?}");
    let second = call(
        &c,
        "iso",
        "ls /tmp/left /root/left 2>&1 | grep -c 'No such' ; grep -c LEAK /etc/profile; \
         grep -c evil /etc/passwd; test -e /etc/hostname && echo hostname-kept; \
         echo env=$POOL_ENV; ps -eo comm= | grep -c '^sleep$'; ipcs -m | grep -c '^0x'; \
         echo pid=$$",
    )
    .await;
    assert_eq!(
        second.sandbox_id, first.sandbox_id,
        "one sandbox serves both"
    );
    let lines: Vec<&str> = second.stdout.lines().collect();
    assert_eq!(
        lines[..7],
        ["2", "0", "0", "hostname-kept", "env=base", "0", "0"],
        "the second call saw the first's traces: {second:?}"
    );
    // Each call is PID 1's child in a PID namespace of its own.
    assert_eq!(lines[7], "pid=2", "{second:?}");
    // The reset is the teardown of the call's namespaces: measured, and small.
    assert!(second.teardown_us > 0 && second.setup_us > 0, "{second:?}");
    c.delete_pool("iso").await.expect("delete");
}

#[tokio::test(flavor = "multi_thread")]
async fn calls_report_output_exit_timeouts_and_files() {
    if !require_root() {
        return;
    }
    let c = server().client();
    pool(&c, "io", 1, 1000).await;
    // Code in a language, stdin, an input file and a fetched file.
    let mut r = request("io", "");
    r.command = None;
    r.code = Some(
        "import sys\nprint(sys.stdin.read().upper())\nprint(open('data.txt').read())\n\
         open('out.txt','w').write('result')\nsys.exit(3)\n"
            .into(),
    );
    r.language = Some("python".into());
    r.stdin = Some("hello".into());
    r.cwd = Some("/work".into());
    r.files.insert("data.txt".into(), "input".into());
    r.fetch_files = vec!["out.txt".into(), "missing.txt".into(), "/dev/zero".into()];
    let out = c.fncall(&r).await.expect("call");
    assert_eq!(out.status, FnCallStatus::Finished, "{out:?}");
    assert_eq!(out.exit_code, Some(3), "{out:?}");
    assert_eq!(out.stdout, "HELLO\ninput\n", "{out:?}");
    assert_eq!(
        out.files["out.txt"].data.as_ref().map(|d| d.to_text()),
        Some("result".into())
    );
    assert!(out.files["missing.txt"].error.is_some(), "{out:?}");
    assert_eq!(
        out.files["/dev/zero"].error.as_deref(),
        Some("not a regular file")
    );
    // stderr and a signal.
    let out = call(&c, "io", "echo oops >&2; kill -9 $$").await;
    assert_eq!((out.exit_code, out.signal), (None, Some(9)), "{out:?}");
    assert_eq!(out.stderr, "oops\n");
    // A timeout kills the call and what it started, and its sandbox is replaced (as one
    // a SIGKILL ended: the OOM killer's signal).
    let mut r = request("io", "echo started; sleep 100 & sleep 100");
    r.timeout_s = 0.5;
    let t = std::time::Instant::now();
    let timed_out = c.fncall(&r).await.expect("call");
    assert_eq!(timed_out.status, FnCallStatus::TimedOut, "{timed_out:?}");
    assert_eq!(timed_out.stdout, "started\n");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    let out = call(&c, "io", "ps -eo comm= | grep -c '^sleep$'").await;
    assert_eq!(out.stdout, "0\n", "{out:?}");
    assert_ne!(
        out.sandbox_id, timed_out.sandbox_id,
        "a timed-out sandbox served again"
    );
    // A missing program is the call's mistake, not the sandbox's.
    let out = c
        .fncall(&FnCallRequest {
            command: Some(Command::Argv(vec!["/no/such/program".into()])),
            ..request("io", "")
        })
        .await
        .expect("call");
    assert_eq!(out.status, FnCallStatus::SetupError, "{out:?}");
    assert!(
        out.error
            .as_deref()
            .unwrap_or("")
            .contains("/no/such/program"),
        "{out:?}"
    );
    // A compiled language on an image without its compiler: the call's setup error.
    let out = c
        .fncall(&FnCallRequest {
            command: None,
            code: Some("int main() {}".into()),
            language: Some("cpp".into()),
            ..request("io", "")
        })
        .await
        .expect("call");
    assert_eq!(out.status, FnCallStatus::SetupError, "{out:?}");
    assert!(
        out.error.as_deref().unwrap_or("").contains("g++"),
        "{out:?}"
    );
    // A memory limit holds.
    let mut r = request("io", "python3 -c 'x = bytearray(512 << 20); print(len(x))'");
    r.memory_limit_mb = Some(128);
    let out = c.fncall(&r).await.expect("call");
    assert_ne!(out.exit_code, Some(0), "{out:?}");
    assert!(out.stderr.contains("MemoryError"), "{out:?}");
    c.delete_pool("io").await.expect("delete");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sandbox_is_replaced_after_max_calls_and_bad_input_is_refused() {
    if !require_root() {
        return;
    }
    let c = server().client();
    pool(&c, "recycle", 1, 2).await;
    let a = call(&c, "recycle", "true").await.sandbox_id;
    let b = call(&c, "recycle", "true").await.sandbox_id;
    assert_eq!(a, b);
    let d = call(&c, "recycle", "true").await.sandbox_id;
    assert_ne!(a, d, "the sandbox that served max_calls was replaced");
    let gone = wait_until(Duration::from_secs(30), || async {
        c.get_sandbox(&a).await.is_err().then_some(())
    })
    .await;
    assert!(gone.is_some(), "the used sandbox was deleted");
    let p = c.get_pool("recycle").await.expect("pool");
    assert_eq!(p.calls, 3, "{p:?}");

    let cases: Vec<(FnCallRequest, &str)> = vec![
        (
            FnCallRequest {
                code: Some("print(1)".into()),
                language: Some("cobol".into()),
                command: None,
                ..request("recycle", "")
            },
            "not supported",
        ),
        (
            FnCallRequest {
                code: Some("x".into()),
                ..request("recycle", "true")
            },
            "either command or code",
        ),
        (
            FnCallRequest {
                timeout_s: -1.0,
                ..request("recycle", "true")
            },
            "timeout_s",
        ),
    ];
    for (req, words) in cases {
        let e = c.fncall(&req).await.expect_err("refused");
        assert_eq!(e.code(), Some(ErrorCode::BadRequest), "{e}");
        assert!(e.to_string().contains(words), "{e}");
    }
    let e = c
        .fncall(&request("nope", "true"))
        .await
        .expect_err("no pool");
    assert_eq!(e.code(), Some(ErrorCode::NotFound), "{e}");
    // A pool for claims does not run calls, and a call pool is not claimed.
    let claims = PoolSpec {
        name: "claims".into(),
        template: CreateSandboxRequest::default(),
        min: 0,
        max: 1,
        autoscale: AutoscalePolicy::default(),
        fncall: None,
    };
    c.create_pool(&claims).await.expect("create");
    let e = c
        .fncall(&request("claims", "true"))
        .await
        .expect_err("refused");
    assert!(
        e.to_string().contains("does not serve function calls"),
        "{e}"
    );
    let e = c
        .create_sandbox(CreateSandboxRequest {
            pool: Some("recycle".into()),
            ..Default::default()
        })
        .await
        .expect_err("refused");
    assert!(e.to_string().contains("serves function calls"), "{e}");
    // Nobody forges the label that gives a sandbox the call helper.
    let e = c
        .create_sandbox(CreateSandboxRequest {
            labels: BTreeMap::from([(FNCALL_LABEL.to_string(), "x".to_string())]),
            ..Default::default()
        })
        .await
        .expect_err("refused");
    assert_eq!(e.code(), Some(ErrorCode::BadRequest), "{e}");
    c.delete_pool("claims").await.expect("delete");
    c.delete_pool("recycle").await.expect("delete");
}

#[tokio::test(flavor = "multi_thread")]
async fn kill_9_of_the_server_mid_call_ends_the_call_and_the_pool_serves_again() {
    if !require_root() {
        return;
    }
    let mut s = Server::start_with(
        "fncall-kill",
        true,
        &["--cgroup-parent", "dsec-fncall-kill"],
    )
    .await
    .unwrap_or_else(|e| panic!("server: {e:#}"));
    s.ensure_base(Some(server()))
        .await
        .unwrap_or_else(|e| panic!("base image: {e:#}"));
    let c = s.client();
    pool(&c, "k", 2, 1000).await;
    let in_flight = {
        let c = c.clone();
        tokio::spawn(async move {
            let mut r = request("k", "echo mid > /tmp/mid; sleep 313");
            r.timeout_s = 600.0;
            c.fncall(&r).await
        })
    };
    let members: Vec<String> = c
        .list_sandboxes(BTreeMap::from([(
            FNCALL_LABEL.to_string(),
            "k".to_string(),
        )]))
        .await
        .expect("list")
        .sandboxes
        .into_iter()
        .map(|sb| sb.id)
        .collect();
    assert_eq!(members.len(), 2, "{members:?}");
    let busy = wait_until(Duration::from_secs(30), || async {
        members
            .iter()
            .find(|id| !dsec_e2e::host::processes_running(id, "sleep 313").is_empty())
            .cloned()
    })
    .await
    .expect("the call never started");

    s.kill();
    assert!(
        in_flight.await.expect("task").is_err(),
        "the call's client sees the server go"
    );
    s.spawn()
        .await
        .unwrap_or_else(|e| panic!("restart after kill -9: {e:#}"));
    // The agent ends a call whose node went away: nothing of it runs on.
    let ended = wait_until(Duration::from_secs(30), || async {
        dsec_e2e::host::processes_running(&busy, "sleep 313")
            .is_empty()
            .then_some(())
    })
    .await;
    assert!(
        ended.is_some(),
        "the call still runs in {busy} after the restart"
    );
    // The restarted server finds its pool and serves calls in clean views.
    let c = s.client();
    wait_until(Duration::from_secs(60), || async {
        let p = c.get_pool("k").await.ok()?;
        (p.ready == 2).then_some(())
    })
    .await
    .expect("the pool is not warm again after the restart");
    for _ in 0..4 {
        let out = call(&c, "k", "cat /tmp/mid 2>/dev/null; echo clean").await;
        assert_eq!(out.stdout, "clean\n", "{out:?}");
    }
    c.delete_pool("k").await.expect("delete");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pool_of_another_user_runs_calls_as_that_user_and_owns_their_files() {
    if !require_root() {
        return;
    }
    let c = server().client();
    let spec = PoolSpec {
        name: "nobody".into(),
        template: CreateSandboxRequest {
            user: Some("nobody".into()),
            ..Default::default()
        },
        min: 1,
        max: 1,
        autoscale: AutoscalePolicy::default(),
        fncall: Some(FnCallPolicy::default()),
    };
    c.create_pool(&spec).await.expect("create pool");
    wait_until(Duration::from_secs(60), || async {
        let p = c.get_pool("nobody").await.ok()?;
        (p.ready == 1).then_some(())
    })
    .await
    .expect("the pool never got warm");
    // The code's directory and files are the call's user's: it may write beside them.
    let mut r = request("nobody", "");
    r.command = None;
    r.code = Some(
        "import os\nprint(os.getuid())\nopen('/tmp/fncall/out.txt', 'w').write('x')\n\
         open('/work/sub/new.txt', 'w').write('y')\n"
            .into(),
    );
    r.language = Some("python".into());
    r.files.insert("/work/sub/input.txt".into(), "in".into());
    r.fetch_files = vec!["/tmp/fncall/out.txt".into()];
    let out = c.fncall(&r).await.expect("call");
    assert_eq!(
        (out.status, out.exit_code),
        (FnCallStatus::Finished, Some(0)),
        "{out:?}"
    );
    assert_eq!(out.stdout, "65534\n", "{out:?}");
    assert!(out.files["/tmp/fncall/out.txt"].data.is_some(), "{out:?}");
    c.delete_pool("nobody").await.expect("delete");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fork_bomb_or_yes_in_a_call_is_contained_and_the_pool_serves_on() {
    if !require_root() {
        return;
    }
    let c = server().client();
    pool(&c, "hostile", 1, 1000).await;
    // A fork bomb runs into the sandbox's pids limit; the timeout ends it, and the
    // call's PID 1 kills and reaps all it made.
    let mut r = request("hostile", "bomb() { bomb | bomb & }; bomb; sleep 30");
    r.timeout_s = 2.0;
    let t = std::time::Instant::now();
    let out = c.fncall(&r).await.expect("fork bomb call");
    assert_eq!(out.status, FnCallStatus::TimedOut, "{out:?}");
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    // `yes` into stdout: the answer keeps the last MiB, flagged truncated.
    let mut r = request("hostile", "yes");
    r.timeout_s = 1.0;
    let out = c.fncall(&r).await.expect("yes call");
    assert_eq!(out.status, FnCallStatus::TimedOut, "{out:?}");
    assert!(out.stdout_truncated, "stdout was not capped");
    assert!(
        out.stdout.len() <= 1024 * 1024 && out.stdout.starts_with("y\n"),
        "{} bytes",
        out.stdout.len()
    );
    // Nothing of either runs on, and the pool answers the next call normally.
    let members = c
        .list_sandboxes(BTreeMap::from([(
            FNCALL_LABEL.to_string(),
            "hostile".to_string(),
        )]))
        .await
        .expect("list")
        .sandboxes;
    for sb in &members {
        let left = wait_until(Duration::from_secs(20), || async {
            let bombs = dsec_e2e::host::processes_running(&sb.id, "bomb");
            let yes = dsec_e2e::host::processes_running(&sb.id, "yes");
            (bombs.is_empty() && yes.is_empty()).then_some(())
        })
        .await;
        assert!(
            left.is_some(),
            "processes of the calls outlived them in {}",
            sb.id
        );
    }
    let out = call(&c, "hostile", "echo fine").await;
    assert_eq!(
        (out.status, out.stdout.as_str()),
        (FnCallStatus::Finished, "fine\n"),
        "{out:?}"
    );
    c.delete_pool("hostile").await.expect("delete");
}

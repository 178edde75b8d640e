//! Persistent bash sessions.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use dsec_wire::agent::{Reply, SessionResult};
use dsec_wire::ErrorCode;
use serde_json::json;

fn create(a: &TestAgent, id: &str) -> u32 {
    match a.reply(&req(json!({"op":"session_create","session":id,"cwd":"/"}))) {
        Reply::SessionCreated { pid, .. } => pid,
        other => panic!("{other:?}"),
    }
}

fn run(a: &TestAgent, id: &str, cmd: &str, timeout_ms: Option<u64>) -> SessionResult {
    match a.reply(&req(
        json!({"op":"session_run","session":id,"command":cmd,"timeout_ms":timeout_ms}),
    )) {
        Reply::SessionResult(r) => r,
        other => panic!("{other:?}"),
    }
}

#[test]
fn state_persists_across_fifty_commands() {
    let a = TestAgent::start();
    create(&a, "s1");
    let r = run(&a, "s1", "cd /tmp && export X=1; Y=2", None);
    assert_eq!(r.exit_code, 0);
    let r = run(&a, "s1", "echo $X $Y; pwd", None);
    assert_eq!(r.output, "1 2\n/tmp\n");
    for i in 0..50 {
        let r = run(
            &a,
            "s1",
            &format!("Y=$((Y+1)); echo -n \"{i}:$Y\"; (exit $((Y % 3)))"),
            None,
        );
        assert_eq!(r.output, format!("{i}:{}", 3 + i), "command {i}");
        assert_eq!(r.exit_code, (3 + i) % 3);
    }
    // $? of the previous command is visible; stderr is merged; no trailing newline kept exact.
    run(&a, "s1", "false", None);
    let r = run(&a, "s1", "echo rc=$?; echo oops >&2; printf tail", None);
    assert_eq!(r.output, "rc=1\noops\ntail");
    // Output that looks like a marker does not confuse the framing.
    let r = run(&a, "s1", "echo __DSEC_deadbeef 0; echo done", None);
    assert_eq!(r.output, "__DSEC_deadbeef 0\ndone\n");
    // Commands cannot eat the control stream.
    let r = run(&a, "s1", "cat; echo after", None);
    assert_eq!(r.output, "after\n");
    // Multi-line commands, quotes and heredocs.
    let r = run(
        &a,
        "s1",
        "f() {\n  echo \"in f: $1\"\n}\nf 'a b'\ncat <<EOF\nhd\nEOF",
        None,
    );
    assert_eq!(r.output, "in f: a b\nhd\n");
    let r = run(&a, "s1", "echo 'unterminated", None);
    assert_eq!(r.exit_code, 2, "{r:?}");
    let r = run(&a, "s1", "echo still alive", None);
    assert_eq!(r.output, "still alive\n");

    match a.reply(&req(json!({"op":"session_list"}))) {
        Reply::Sessions { sessions } => {
            assert_eq!(sessions.len(), 1);
            assert!(!sessions[0].busy);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn timeout_interrupts_and_session_survives() {
    let a = TestAgent::start();
    create(&a, "t");
    run(&a, "t", "export KEEP=yes; cd /tmp", None);
    let t = Instant::now();
    let r = run(&a, "t", "echo before; sleep 100; echo after", Some(500));
    assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
    assert!(r.timed_out);
    assert_eq!(r.exit_code, 130, "{r:?}");
    assert_eq!(r.output, "before\n", "{r:?}");
    let r = run(&a, "t", "echo $KEEP; pwd", None);
    assert_eq!(r.output, "yes\n/tmp\n");
    assert!(!r.timed_out);

    // A loop of builtins in the shell itself is interrupted too.
    let r = run(
        &a,
        "t",
        "n=0; while :; do n=$((n+1)); done; echo never",
        Some(300),
    );
    assert!(r.timed_out);
    assert_eq!(r.exit_code, 130);
    assert_eq!(r.output, "");
    let r = run(&a, "t", "echo $KEEP; [ $n -gt 0 ] && echo counted", None);
    assert_eq!(r.output, "yes\ncounted\n");
    // An interrupt between commands is harmless.
    assert!(matches!(
        a.reply(&req(json!({"op":"session_interrupt","session":"t"}))),
        Reply::Ok
    ));
    assert_eq!(run(&a, "t", "echo fine", None).output, "fine\n");
}

#[test]
fn interrupt_and_conflict() {
    let a = TestAgent::start();
    create(&a, "i");
    let mut c = a.connect(&req(
        json!({"op":"session_run","session":"i","command":"sleep 100"}),
    ));
    // Wait until it is busy.
    assert!(wait_until(Duration::from_secs(3), || {
        match a.reply(&req(json!({"op":"session_list"}))) {
            Reply::Sessions { sessions } => sessions[0].busy,
            _ => false,
        }
    }));
    // A second command is refused while one runs.
    match a.reply(&req(
        json!({"op":"session_run","session":"i","command":"true"}),
    )) {
        Reply::Error(e) => assert_eq!(e.code, ErrorCode::Conflict),
        other => panic!("{other:?}"),
    }
    std::thread::sleep(Duration::from_millis(100));
    assert!(matches!(
        a.reply(&req(json!({"op":"session_interrupt","session":"i"}))),
        Reply::Ok
    ));
    match c.next_reply() {
        Reply::SessionResult(r) => {
            assert_eq!(r.exit_code, 130);
            assert!(!r.timed_out);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(run(&a, "i", "echo ok", None).output, "ok\n");

    // Exit ends the session.
    let r = run(&a, "i", "exit 3", None);
    assert_eq!(r.exit_code, 3);
    match a.reply(&req(
        json!({"op":"session_run","session":"i","command":"true"}),
    )) {
        Reply::Error(e) => assert_eq!(e.code, ErrorCode::NotFound),
        other => panic!("{other:?}"),
    }
}

#[test]
fn close_kills_shell_and_group() {
    let a = TestAgent::start();
    let pid = create(&a, "c") as i32;
    let r = run(&a, "c", "sleep 100 & echo $!", None);
    let bg: i32 = r.output.trim().parse().unwrap();
    assert!(matches!(
        a.reply(&req(json!({"op":"session_close","session":"c"}))),
        Reply::Ok
    ));
    assert!(wait_until(Duration::from_secs(3), || is_dead(pid) && is_dead(bg)));
    match a.reply(&req(json!({"op":"session_close","session":"c"}))) {
        Reply::Error(e) => assert_eq!(e.code, ErrorCode::NotFound),
        other => panic!("{other:?}"),
    }
    match a.reply(&req(json!({"op":"session_create","session":"d"}))) {
        Reply::SessionCreated { .. } => {}
        other => panic!("{other:?}"),
    }
    match a.reply(&req(json!({"op":"session_create","session":"d"}))) {
        Reply::Error(e) => assert_eq!(e.code, ErrorCode::Conflict),
        other => panic!("{other:?}"),
    }
}

#[test]
fn output_whose_json_exceeds_a_frame_comes_back_truncated() {
    let a = TestAgent::start();
    create(&a, "big");
    // NUL bytes take six bytes each as JSON: 5 MB of them would be a 30 MB reply.
    let r = run(&a, "big", "head -c 5000000 /dev/zero", None);
    assert!(r.truncated);
    assert_eq!(r.exit_code, 0);
    assert!(!r.output.is_empty() && r.output.bytes().all(|b| b == 0));
    assert!(serde_json::to_string(&r.output).unwrap().len() <= dsec_wire::frame::MAX_FRAME);
    let r = run(&a, "big", "head -c 6000000 /dev/urandom", None);
    assert!(r.truncated);
    assert_eq!(run(&a, "big", "echo fine", None).output, "fine\n");
}

/// Whether a process whose command line contains `needle` is running.
fn running(needle: &str) -> bool {
    std::fs::read_dir("/proc").unwrap().flatten().any(|e| {
        std::fs::read(e.path().join("cmdline")).is_ok_and(|c| {
            String::from_utf8_lossy(&c)
                .replace('\0', " ")
                .contains(needle)
        })
    })
}

#[test]
fn a_command_whose_caller_goes_away_is_interrupted_and_the_session_stays() {
    let a = TestAgent::start();
    create(&a, "gone");
    run(&a, "gone", "export KEEP=kept", None);
    let marker = a.root().join("late");
    let conn = a.connect(&req(json!({"op":"session_run","session":"gone",
        "command": format!("sleep 3071; touch {}", marker.display())})));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !running("sleep 3071") {
        assert!(Instant::now() < deadline, "the command never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(conn);
    let deadline = Instant::now() + Duration::from_secs(10);
    while running("sleep 3071") {
        assert!(Instant::now() < deadline, "the command outlived its caller");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Idle again, with its state.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match a.reply(&req(
            json!({"op":"session_run","session":"gone","command":"echo $KEEP"}),
        )) {
            Reply::SessionResult(r) => {
                assert_eq!(r.output, "kept\n");
                break;
            }
            Reply::Error(e) if e.code == ErrorCode::Conflict => {
                assert!(Instant::now() < deadline, "still busy: {e:?}");
                std::thread::sleep(Duration::from_millis(20));
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(!marker.exists(), "the rest of the command ran");
}

//! Background processes: output re-attach, stdin, signals, PTY.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use dsec_wire::agent::{ProcessInfo, Reply};
use dsec_wire::frame::Frame;
use dsec_wire::ErrorCode;
use serde_json::json;

fn start(a: &TestAgent, spec: serde_json::Value) -> ProcessInfo {
    let mut v = spec;
    v["op"] = json!("process_start");
    match a.reply(&req(v)) {
        Reply::ProcessStarted(p) => p,
        other => panic!("{other:?}"),
    }
}

/// Reads a ProcessOutput reply: (start reply, stdout, stderr, final reply).
fn output(
    a: &TestAgent,
    pid: u32,
    so: u64,
    se: u64,
    follow: bool,
) -> (Reply, Vec<u8>, Vec<u8>, Reply) {
    let frames = a.call(
        &req(json!({"op":"process_output","pid":pid,"stdout_offset":so,"stderr_offset":se,"follow":follow})),
        None,
    );
    let first = json(&frames[0]);
    let last = json(frames.last().unwrap());
    let (mut o, mut e) = (Vec::new(), Vec::new());
    for f in &frames[1..frames.len() - 1] {
        match f {
            Frame::Stdout(d) => o.extend_from_slice(d),
            Frame::Stderr(d) => e.extend_from_slice(d),
            other => panic!("{other:?}"),
        }
    }
    (first, o, e, last)
}

#[test]
fn reattach_from_offset_and_follow() {
    let a = TestAgent::start();
    let p = start(
        &a,
        json!({"cmd":"for i in 1 2 3 4 5; do echo line$i; echo err$i >&2; sleep 0.1; done","tag":"t1"}),
    );
    std::thread::sleep(Duration::from_millis(250));
    let (first, o, _e, last) = output(&a, p.pid, 0, 0, false);
    assert!(matches!(
        first,
        Reply::OutputStart {
            stdout_offset: 0,
            stdout_truncated: false,
            ..
        }
    ));
    let so = match last {
        Reply::OutputEnd { stdout_offset, .. } => stdout_offset,
        other => panic!("still running expected: {other:?}"),
    };
    assert_eq!(so as usize, o.len());
    assert!(String::from_utf8_lossy(&o).starts_with("line1\n"));
    // Re-attach from where we were and follow to the end.
    let (first, o2, e2, last) = output(&a, p.pid, so, 0, true);
    assert!(matches!(first, Reply::OutputStart { stdout_offset, .. } if stdout_offset == so));
    let mut all = o.clone();
    all.extend_from_slice(&o2);
    assert_eq!(
        String::from_utf8_lossy(&all),
        "line1\nline2\nline3\nline4\nline5\n"
    );
    assert_eq!(
        String::from_utf8_lossy(&e2),
        "err1\nerr2\nerr3\nerr4\nerr5\n"
    );
    match last {
        Reply::Exited(x) => {
            assert_eq!(x.exit_code, Some(0));
            assert_eq!(x.stdout_bytes, 30);
        }
        other => panic!("{other:?}"),
    }
    // After exit: list shows it; output from a mid offset ends with Exited.
    let (_, o3, _, last) = output(&a, p.pid, 24, 1000, false);
    assert_eq!(o3, b"line5\n");
    assert!(matches!(last, Reply::Exited(_)));
    match a.reply(&req(json!({"op":"process_list"}))) {
        Reply::Processes { processes } => {
            let me = processes.iter().find(|x| x.pid == p.pid).unwrap();
            assert_eq!(me.tag.as_deref(), Some("t1"));
            assert!(me.exit.is_some());
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn ring_truncation_is_reported() {
    let a = TestAgent::start();
    let p = start(
        &a,
        json!({"cmd":"head -c 100000 /dev/zero","output_limit":1000}),
    );
    std::thread::sleep(Duration::from_millis(300));
    let (first, o, _, last) = output(&a, p.pid, 0, 0, true);
    match first {
        Reply::OutputStart {
            stdout_offset,
            stdout_truncated,
            ..
        } => {
            assert_eq!(stdout_offset, 99_000);
            assert!(stdout_truncated);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(o.len(), 1000);
    assert!(
        matches!(last, Reply::Exited(ref x) if x.stdout_truncated && x.stdout_bytes == 100_000)
    );
}

#[test]
fn stdin_signal_and_timeout() {
    let a = TestAgent::start();
    let p = start(&a, json!({"cmd":["cat"]}));
    let r = a.call(
        &req(json!({"op":"process_stdin","pid":p.pid})),
        Some(b"hello "),
    );
    assert!(matches!(json(&r[0]), Reply::Ok));
    let r = a.call(
        &req(json!({"op":"process_stdin","pid":p.pid,"close":true})),
        Some(b"world"),
    );
    assert!(matches!(json(&r[0]), Reply::Ok));
    let (_, o, _, last) = output(&a, p.pid, 0, 0, true);
    assert_eq!(o, b"hello world");
    assert!(matches!(last, Reply::Exited(ref x) if x.exit_code == Some(0)));

    let p = start(&a, json!({"cmd":"sleep 100"}));
    assert!(matches!(
        a.reply(&req(json!({"op":"process_signal","pid":p.pid,"signal":15}))),
        Reply::Ok
    ));
    let (_, _, _, last) = output(&a, p.pid, 0, 0, true);
    assert!(
        matches!(last, Reply::Exited(ref x) if x.signal == Some(15)),
        "{last:?}"
    );
    match a.reply(&req(json!({"op":"process_signal","pid":p.pid,"signal":15}))) {
        Reply::Error(e) => assert_eq!(e.code, ErrorCode::Conflict),
        other => panic!("{other:?}"),
    }

    let p = start(&a, json!({"cmd":"sleep 100","timeout_ms":300}));
    let (_, _, _, last) = output(&a, p.pid, 0, 0, true);
    assert!(
        matches!(last, Reply::Exited(ref x) if x.timed_out && x.signal == Some(9)),
        "{last:?}"
    );

    match a.reply(&req(
        json!({"op":"process_signal","pid":999_999,"signal":15}),
    )) {
        Reply::Error(e) => assert_eq!(e.code, ErrorCode::NotFound),
        other => panic!("{other:?}"),
    }
}

#[test]
fn background_survives_client_disconnect() {
    let a = TestAgent::start();
    let p = start(&a, json!({"cmd":"sleep 0.5; echo done"}));
    // Follow, then drop the connection early.
    let mut c = a.connect(&req(
        json!({"op":"process_output","pid":p.pid,"follow":true}),
    ));
    assert!(matches!(c.next_reply(), Reply::OutputStart { .. }));
    drop(c);
    let (_, o, _, last) = output(&a, p.pid, 0, 0, true);
    assert_eq!(o, b"done\n");
    assert!(matches!(last, Reply::Exited(ref x) if x.exit_code == Some(0)));
}

#[test]
fn pty_tty_and_resize() {
    let a = TestAgent::start();
    let p = start(
        &a,
        json!({"cmd":"tty; stty size; read x; stty size; echo got:$x","pty":{"rows":24,"cols":80}}),
    );
    assert!(p.pty);
    let mut text = String::new();
    assert!(
        wait_until(Duration::from_secs(5), || {
            let (_, o, _, _) = output(&a, p.pid, 0, 0, false);
            text = String::from_utf8_lossy(&o).into_owned();
            text.contains("24 80")
        }),
        "{text:?}"
    );
    assert!(text.contains("/dev/pts/"), "{text:?}");
    assert!(matches!(
        a.reply(&req(
            json!({"op":"process_resize","pid":p.pid,"size":{"rows":50,"cols":132}})
        )),
        Reply::Ok
    ));
    let r = a.call(
        &req(json!({"op":"process_stdin","pid":p.pid})),
        Some(b"abc\n"),
    );
    assert!(matches!(json(&r[0]), Reply::Ok));
    let (_, o, e, last) = output(&a, p.pid, 0, 0, true);
    let text = String::from_utf8_lossy(&o);
    assert!(text.contains("50 132"), "{text:?}");
    assert!(text.contains("got:abc"), "{text:?}");
    assert!(e.is_empty());
    assert!(matches!(last, Reply::Exited(ref x) if x.exit_code == Some(0)));

    let q = start(&a, json!({"cmd":["true"]}));
    match a.reply(&req(
        json!({"op":"process_resize","pid":q.pid,"size":{"rows":1,"cols":1}}),
    )) {
        Reply::Error(e) => assert_eq!(e.code, ErrorCode::BadRequest),
        other => panic!("{other:?}"),
    }
}

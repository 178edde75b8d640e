//! Exec and ping over the real socket protocol.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use dsec_wire::agent::{Reply, Request, PROTOCOL_VERSION};
use dsec_wire::ErrorCode;
use serde_json::json;

#[test]
fn ping() {
    let a = TestAgent::start();
    match a.reply(&Request::Ping) {
        Reply::Pong { version, pid } => {
            assert_eq!(version, PROTOCOL_VERSION);
            assert!(pid > 1);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn exec_argv_shell_env_cwd_stdin() {
    let a = TestAgent::start();
    let r = exec_json(
        &a,
        json!({"op":"exec","cmd":["echo","hello","world"]}),
        None,
    );
    assert_eq!(r.out(), "hello world\n");
    assert_eq!(r.exit.exit_code, Some(0));
    assert_eq!(r.exit.stdout_bytes, 12);

    let r = exec_json(
        &a,
        json!({"op":"exec","cmd":"echo $FOO-$DSEC_TEST; pwd; echo err >&2","env":{"FOO":"bar"},"cwd":"/tmp"}),
        None,
    );
    assert_eq!(r.out(), "bar-1\n/tmp\n");
    assert_eq!(r.err(), "err\n");

    let r = exec_json(
        &a,
        json!({"op":"exec","cmd":["cat"],"stdin":true}),
        Some(b"from stdin"),
    );
    assert_eq!(r.out(), "from stdin");

    // Without stdin, the child reads /dev/null.
    let r = exec_json(&a, json!({"op":"exec","cmd":["cat"]}), None);
    assert_eq!(r.out(), "");
    assert_eq!(r.exit.exit_code, Some(0));

    // Large stdin through a pipe while output flows back.
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    let r = exec_json(
        &a,
        json!({"op":"exec","cmd":["cat"],"stdin":true}),
        Some(&big),
    );
    assert_eq!(r.stdout.len(), big.len());
    assert!(r.stdout == big);
}

#[test]
fn exec_errors_exit_codes_and_signals() {
    let a = TestAgent::start();
    let r = exec_json(&a, json!({"op":"exec","cmd":"exit 7"}), None);
    assert_eq!(r.exit.exit_code, Some(7));
    assert_eq!(r.exit.signal, None);

    let r = exec_json(&a, json!({"op":"exec","cmd":"kill -TERM $$"}), None);
    assert_eq!(r.exit.exit_code, None);
    assert_eq!(r.exit.signal, Some(libc::SIGTERM));

    let frames = a.call(
        &req(json!({"op":"exec","cmd":["/definitely/not/here"]})),
        None,
    );
    match json(&frames[0]) {
        Reply::Error(e) => assert_eq!(e.code, ErrorCode::NotFound, "{e:?}"),
        other => panic!("{other:?}"),
    }
    let frames = a.call(
        &req(json!({"op":"exec","cmd":["true"],"cwd":"/no/such/dir"})),
        None,
    );
    match json(&frames[0]) {
        Reply::Error(e) => {
            assert_eq!(e.code, ErrorCode::NotFound);
            assert!(e.message.contains("/no/such/dir"), "{e:?}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn timeout_kills_process_tree() {
    let a = TestAgent::start();
    let t = Instant::now();
    let r = exec_json(
        &a,
        json!({"op":"exec","cmd":"sleep 100 & echo $!; sleep 100","timeout_ms":500,"stream":true}),
        None,
    );
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    assert!(r.exit.timed_out);
    assert_eq!(r.exit.signal, Some(libc::SIGKILL));
    let grandchild: i32 = r.out().trim().parse().unwrap();
    assert!(
        wait_until(Duration::from_secs(3), || is_dead(grandchild)),
        "grandchild {grandchild} survived"
    );
    assert!(is_dead(r.pid.expect("a stream reports its pid") as i32));
}

#[test]
fn background_child_holding_pipe_does_not_hang() {
    let a = TestAgent::start();
    let t = Instant::now();
    let r = exec_json(
        &a,
        json!({"op":"exec","cmd":"sleep 30 & echo started"}),
        None,
    );
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "took {:?}",
        t.elapsed()
    );
    assert_eq!(r.out(), "started\n");
    assert_eq!(r.exit.exit_code, Some(0));
    let _ = exec_json(
        &a,
        json!({"op":"exec","cmd":"pkill -f 'sleep 30' || true"}),
        None,
    );
}

#[test]
fn yes_non_stream_stays_bounded() {
    let a = TestAgent::start();
    let limit = 1024 * 1024u64;
    let r = exec_json(
        &a,
        json!({"op":"exec","cmd":["yes"],"timeout_ms":3000,"output_limit":limit}),
        None,
    );
    assert!(r.exit.timed_out);
    assert!(r.exit.stdout_truncated);
    assert!(
        r.exit.stdout_bytes > 50 * limit,
        "only {} bytes",
        r.exit.stdout_bytes
    );
    assert_eq!(r.stdout.len() as u64, limit);
    assert!(r.stdout.chunks(2).all(|c| c == b"y\n"));
    // Agent memory stayed bounded: check its RSS via /proc.
    let status = std::fs::read_to_string(format!("/proc/{}/status", agent_pid(&a))).unwrap();
    let rss_kb: u64 = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap();
    assert!(rss_kb < 64 * 1024, "agent peak RSS {rss_kb} kB");
}

fn agent_pid(a: &TestAgent) -> u32 {
    match a.reply(&Request::Ping) {
        Reply::Pong { pid, .. } => pid,
        other => panic!("{other:?}"),
    }
}

#[test]
fn streaming_preserves_order_and_is_live() {
    let a = TestAgent::start();
    let mut c = a.connect(&req(
        json!({"op":"exec","cmd":"for i in 1 2 3; do echo $i; sleep 0.2; done","stream":true}),
    ));
    assert!(matches!(c.next_reply(), Reply::Started { .. }));
    let t = Instant::now();
    // The first line arrives long before the command ends.
    match c.next() {
        Some(dsec_wire::frame::Frame::Stdout(d)) => assert_eq!(d, b"1\n"),
        other => panic!("{other:?}"),
    }
    assert!(t.elapsed() < Duration::from_millis(300));
    let rest = c.read_all();
    let mut text = String::from("1\n");
    for f in &rest[..rest.len() - 1] {
        if let dsec_wire::frame::Frame::Stdout(d) = f {
            text.push_str(&String::from_utf8_lossy(d));
        }
    }
    assert_eq!(text, "1\n2\n3\n");
    assert!(matches!(json(rest.last().unwrap()), Reply::Exited(_)));

    // Interleaved stdout/stderr keep their order in stream mode.
    let r = exec_json(
        &a,
        json!({"op":"exec","cmd":"echo a; sleep 0.05; echo b >&2; sleep 0.05; echo c","stream":true}),
        None,
    );
    let order: Vec<(bool, String)> = r
        .frames
        .iter()
        .map(|(o, d)| (*o, String::from_utf8_lossy(d).into_owned()))
        .collect();
    assert_eq!(
        order,
        vec![
            (true, "a\n".into()),
            (false, "b\n".into()),
            (true, "c\n".into())
        ]
    );
}

/// Reads one exec's frames up to and including its `Exited` reply.
fn exec_frames(c: &mut Conn) -> ExecOut {
    let mut frames = Vec::new();
    loop {
        let f = c.next().expect("a frame before Exited");
        let done =
            matches!(&f, dsec_wire::frame::Frame::Json(_)) && matches!(json(&f), Reply::Exited(_));
        frames.push(f);
        if done {
            return parse_exec(frames);
        }
    }
}

#[test]
fn a_connection_carries_requests_one_after_another() {
    let a = TestAgent::start();
    let mut c = a.connect(&req(json!({"op":"exec","cmd":"echo one"})));
    assert_eq!(exec_frames(&mut c).out(), "one\n");
    c.send(&dsec_wire::frame::Frame::json(&Request::Ping));
    assert!(matches!(c.next_reply(), Reply::Pong { .. }));
    c.send(&dsec_wire::frame::Frame::json(&req(
        json!({"op":"exec","cmd":"echo two; echo err >&2","stream":true}),
    )));
    assert!(matches!(c.next_reply(), Reply::Started { .. }));
    let r = exec_frames(&mut c);
    assert_eq!((r.out().as_str(), r.err().as_str()), ("two\n", "err\n"));
    // A request with input is the connection's last.
    c.send(&dsec_wire::frame::Frame::json(&req(
        json!({"op":"exec","cmd":["cat"],"stdin":true}),
    )));
    c.send_data(b"in");
    assert_eq!(exec_frames(&mut c).out(), "in");
    assert_eq!(c.next(), None, "closed after a request with input");
}

#[test]
fn disconnect_kills_exec_group() {
    let a = TestAgent::start();
    let mut c = a.connect(&req(
        json!({"op":"exec","cmd":"echo $$; sleep 100","stream":true}),
    ));
    let pid = match c.next_reply() {
        Reply::Started { pid } => pid as i32,
        other => panic!("{other:?}"),
    };
    let _ = c.next();
    drop(c);
    assert!(
        wait_until(Duration::from_secs(3), || is_dead(pid)),
        "exec survived disconnect"
    );
}

#[test]
fn only_a_streaming_exec_reports_its_start() {
    let a = TestAgent::start();
    let whole = exec_json(&a, json!({"op":"exec","cmd":"echo hi"}), None);
    assert_eq!((whole.pid, whole.out().as_str()), (None, "hi\n"));
    let streamed = exec_json(&a, json!({"op":"exec","cmd":"echo hi","stream":true}), None);
    assert!(streamed.pid.is_some());
    assert_eq!(streamed.out(), "hi\n");
}

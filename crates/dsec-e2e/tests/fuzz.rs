//! A bounded fuzz run over every route of a real `dsec serve`: `/v1`, `/metrics`, the
//! SWE-ReX front and the E2B front (REST and envd). Each request is a valid one with one
//! to three random mutations (a value of another type or out of range, a field removed
//! or added, bytes flipped or cut, a wrong method, content type or id). The run fails on
//! any 5xx for such input, on an error answer that is not JSON, on a body cut off after
//! a 200, on a request that hangs, and on a crash of the server.
//!
//! Deterministic: the seed is printed; `DSEC_FUZZ_SEED` and `DSEC_FUZZ_COUNT` (default
//! 2000 requests) change it. Requests run one at a time, so a failure replays with the
//! same seed; `DSEC_FUZZ_VERBOSE=1` prints each request.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use dsec_e2e::{background, require_root, Server};
use dsec_wire::v1::{Command, CreateSandboxRequest, CreateSessionRequest};
use serde_json::{json, Value};

fn server() -> &'static Server {
    Server::shared("fuzz")
}

/// splitmix64: small, fast and the same everywhere.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// Strings that hostile callers like. None names a large or endless file (the run must
/// stay bounded): no `/`, `/dev/zero`, `/proc`.
const STRINGS: &[&str] = &[
    "",
    "a",
    "0",
    "-1",
    "root",
    "nobody",
    "nosuchuser",
    "1000:1000",
    "../../etc/passwd",
    "/work/../etc/passwd",
    "/etc/passwd",
    "/nonexistent/x",
    "/work/f",
    "relative/path",
    "sb-00000000",
    "\u{0}",
    "a\u{0}b",
    "\u{fffd}\u{1F980}",
    "%00%2e%2e",
    "sha256:0000",
    "SIGKILL",
    "SIGFOO",
    "none",
    "open",
    "allowlist",
    "*.",
    "10.0.0.0/33",
    "base",
    "{}",
    "[]",
];

fn long_string(rng: &mut Rng) -> String {
    let n = *rng.pick(&[300usize, 5000, 140_000]);
    let c = *rng.pick(&['a', '\u{1}', '"', 'é']);
    std::iter::repeat_n(c, n).collect()
}

fn random_value(rng: &mut Rng, depth: usize) -> Value {
    match rng.below(if depth > 2 { 12 } else { 14 }) {
        0 => Value::Null,
        1 => json!(rng.chance(50)),
        2 => json!(*rng.pick(&[0i64, -1, 1, i64::MIN, i64::MAX, 4096, 65536, 36855])),
        3 => json!(*rng.pick(&[u64::MAX, 1 << 53, 1 << 40])),
        4 => json!(*rng.pick(&[1e-300, -0.0, 1e308, 0.001, 2.5, -7.5])),
        5..=8 => json!(*rng.pick(STRINGS)),
        9 => json!(long_string(rng)),
        10 => json!([]),
        11 => json!({}),
        12 => Value::Array(
            (0..rng.below(4))
                .map(|_| random_value(rng, depth + 1))
                .collect(),
        ),
        _ => {
            let mut m = serde_json::Map::new();
            for _ in 0..rng.below(4) {
                m.insert(
                    (*rng.pick(STRINGS)).to_string(),
                    random_value(rng, depth + 1),
                );
            }
            Value::Object(m)
        }
    }
}

/// Every place in a JSON value, as a path of keys and indexes.
fn places(v: &Value, here: &mut Vec<Value>, out: &mut Vec<Vec<Value>>) {
    out.push(here.clone());
    match v {
        Value::Object(m) => {
            for (k, c) in m {
                here.push(json!(k));
                places(c, here, out);
                here.pop();
            }
        }
        Value::Array(a) => {
            for (i, c) in a.iter().enumerate() {
                here.push(json!(i));
                places(c, here, out);
                here.pop();
            }
        }
        _ => {}
    }
}

fn at<'a>(v: &'a mut Value, path: &[Value]) -> Option<&'a mut Value> {
    let mut cur = v;
    for p in path {
        cur = match p {
            Value::String(k) => cur.get_mut(k.as_str())?,
            Value::Number(n) => cur.get_mut(n.as_u64()? as usize)?,
            _ => return None,
        };
    }
    Some(cur)
}

/// One structural mutation of a JSON body.
fn mutate_json(rng: &mut Rng, v: &mut Value) {
    let mut all = Vec::new();
    places(v, &mut Vec::new(), &mut all);
    let path = rng.pick(&all).clone();
    match rng.below(4) {
        // Replace a node with something else.
        0 | 1 => {
            if let Some(node) = at(v, &path) {
                *node = random_value(rng, 0);
            }
        }
        // Remove a field or element.
        2 => {
            if let Some((last, parent)) = path.split_last() {
                match (at(v, parent), last) {
                    (Some(Value::Object(m)), Value::String(k)) => {
                        m.remove(k);
                    }
                    (Some(Value::Array(a)), Value::Number(i)) => {
                        let i = i.as_u64().unwrap_or(0) as usize;
                        if i < a.len() {
                            a.remove(i);
                        }
                    }
                    _ => {}
                }
            }
        }
        // Add a field (unknown or known names).
        _ => {
            let key = (*rng.pick(&[
                "unknown",
                "path",
                "user",
                "mode",
                "timeout_s",
                "cmd",
                "env",
                "pids",
            ]))
            .to_string();
            let val = random_value(rng, 1);
            if let Some(Value::Object(m)) = at(v, &path) {
                m.insert(key, val);
            }
        }
    }
}

/// One byte-level mutation of a serialized body.
fn mutate_bytes(rng: &mut Rng, b: &mut Vec<u8>) {
    match rng.below(5) {
        0 if !b.is_empty() => {
            let n = rng.below(b.len());
            b.truncate(n);
        }
        1 if !b.is_empty() => {
            for _ in 0..1 + rng.below(4) {
                let i = rng.below(b.len());
                b[i] ^= 1 << rng.below(8);
            }
        }
        2 => {
            let i = rng.below(b.len() + 1);
            let junk = *rng.pick(&[
                &b"\0"[..],
                b"\xff\xfe",
                b"{",
                b"]",
                b"\"",
                b"\\u0000",
                b"1e999",
            ]);
            b.splice(i..i, junk.iter().copied());
        }
        3 => {
            *b = rng
                .pick(&[&b"[]"[..], b"", b"null", b"123", b"\"x\"", b"[{}]"])
                .to_vec()
        }
        _ => {
            let deep = rng.below(2) == 0;
            *b = if deep {
                format!("{}{}", "[".repeat(5000), "]".repeat(5000)).into_bytes()
            } else {
                format!(
                    "{{\"a\":{}}}",
                    "{\"a\":".repeat(300) + "1" + &"}".repeat(300)
                )
                .into_bytes()
            };
        }
    }
}

/// How a route takes its body.
#[derive(Clone, Copy, PartialEq)]
enum Body {
    None,
    Json,
    Raw,
}

/// A valid request to start from.
struct Template {
    method: &'static str,
    /// `{sb}`, `{session}`, `{pid}` are filled in.
    path: &'static str,
    query: &'static [(&'static str, &'static str)],
    body: Body,
    json: Value,
    /// Relative weight (slow routes run less often).
    weight: usize,
}

fn templates() -> Vec<Template> {
    use Body::*;
    let t = |method, path, query, body, json, weight| Template {
        method,
        path,
        query,
        body,
        json,
        weight,
    };
    vec![
        t("GET", "/v1/health", &[], None, json!(null), 2),
        t("GET", "/metrics", &[], None, json!(null), 2),
        t(
            "POST",
            "/v1/sandboxes",
            &[],
            Json,
            json!({"image": "base", "resources": {"cpu": 0.5, "memory_mb": 128, "pids": 64, "disk_mb": 128},
                 "timeout_s": 120, "env": {"A": "1"}, "labels": {"fuzz": "1"}, "user": "nobody",
                 "files": [{"path": "/work/i", "content": "x", "mode": 420}], "workdir": "/work",
                 "network": "none", "filesystem": {"writable": ["/work", "/tmp"]}, "idempotency_key": "k"}),
            2,
        ),
        t(
            "GET",
            "/v1/sandboxes",
            &[("label", "fuzz=1")],
            None,
            json!(null),
            2,
        ),
        t("GET", "/v1/sandboxes/{sb}", &[], None, json!(null), 2),
        t("DELETE", "/v1/sandboxes/{sb}", &[], None, json!(null), 1),
        t(
            "POST",
            "/v1/sandboxes/{sb}/timeout",
            &[],
            Json,
            json!({"timeout_s": 600}),
            2,
        ),
        t(
            "PUT",
            "/v1/sandboxes/{sb}/network",
            &[],
            Json,
            json!({"mode": "allowlist", "allow": ["pypi.org:443"]}),
            2,
        ),
        t(
            "POST",
            "/v1/sandboxes/{sb}/pause",
            &[],
            None,
            json!(null),
            1,
        ),
        t(
            "POST",
            "/v1/sandboxes/{sb}/resume",
            &[],
            None,
            json!(null),
            2,
        ),
        t(
            "POST",
            "/v1/sandboxes/{sb}/commit",
            &[],
            Json,
            json!({"name": "fuzz/c"}),
            1,
        ),
        t(
            "POST",
            "/v1/pools",
            &[],
            Json,
            json!({"name": "fzpool", "template": {"image": "base", "env": {"A": "b"}},
                 "min": 0, "max": 2, "autoscale": {"window_s": 1.0, "cooldown_s": 0.5}}),
            2,
        ),
        t("GET", "/v1/pools", &[], None, json!(null), 1),
        t("GET", "/v1/pools/fzpool", &[], None, json!(null), 1),
        t(
            "PATCH",
            "/v1/pools/fzpool",
            &[],
            Json,
            json!({"min": 0, "max": 1, "autoscale": {"idle_ratio": 0.5}}),
            1,
        ),
        t("DELETE", "/v1/pools/fzpool", &[], None, json!(null), 1),
        t(
            "POST",
            "/v1/fncall",
            &[],
            Json,
            json!({"pool": "fzpool", "code": "print(1)", "language": "python",
                 "stdin": "x", "files": {"a.txt": "aGk="}, "fetch_files": ["a.txt"],
                 "timeout_s": 1.0, "max_wait_s": 0.1, "priority": "low"}),
            2,
        ),
        t("GET", "/v1/queue", &[], None, json!(null), 1),
        t(
            "POST",
            "/sandboxfusion/fzpool/run_code",
            &[],
            Json,
            json!({"code": "print(1)", "language": "python", "run_timeout": 1,
                 "memory_limit_MB": 64, "files": {"x": "aGk="}, "fetch_files": ["x"]}),
            2,
        ),
        t(
            "POST",
            "/v1/sandboxes",
            &[],
            Json,
            json!({"pool": "fzpool", "labels": {"k": "v"}, "timeout_s": 60,
                 "queue": {"priority": "high", "max_wait_s": 0.2}}),
            1,
        ),
        t("POST", "/v1/jobs/{job}/suspend", &[], None, json!(null), 1),
        t("POST", "/v1/jobs/{job}/resume", &[], None, json!(null), 1),
        t(
            "POST",
            "/v1/sandboxes/{sb}/exec",
            &[],
            Json,
            json!({"cmd": ["echo", "hi"], "env": {"X": "y"}, "cwd": "/work", "stdin": "in",
                 "timeout_s": 5.0, "output_limit": 4096, "user": "root"}),
            6,
        ),
        t(
            "POST",
            "/v1/sandboxes/{sb}/exec/stream",
            &[],
            Json,
            json!({"cmd": "echo hi; echo err >&2", "timeout_s": 5}),
            4,
        ),
        t(
            "POST",
            "/v1/sandboxes/{sb}/sessions",
            &[],
            Json,
            json!({"session": "fz", "env": {}, "cwd": "/", "user": "root"}),
            2,
        ),
        t(
            "GET",
            "/v1/sandboxes/{sb}/sessions",
            &[],
            None,
            json!(null),
            2,
        ),
        t(
            "DELETE",
            "/v1/sandboxes/{sb}/sessions/{session}",
            &[],
            None,
            json!(null),
            1,
        ),
        t(
            "POST",
            "/v1/sandboxes/{sb}/sessions/{session}/run",
            &[],
            Json,
            json!({"command": "echo $PWD", "timeout_s": 5}),
            4,
        ),
        t(
            "POST",
            "/v1/sandboxes/{sb}/sessions/{session}/interrupt",
            &[],
            None,
            json!(null),
            1,
        ),
        t(
            "POST",
            "/v1/sandboxes/{sb}/processes",
            &[],
            Json,
            json!({"cmd": ["sleep", "1"], "env": {}, "cwd": "/", "pty": {"rows": 24, "cols": 80}, "tag": "t", "timeout_s": 5}),
            3,
        ),
        t(
            "GET",
            "/v1/sandboxes/{sb}/processes",
            &[],
            None,
            json!(null),
            2,
        ),
        t(
            "GET",
            "/v1/sandboxes/{sb}/processes/{pid}/output",
            &[
                ("stdout_offset", "0"),
                ("stderr_offset", "0"),
                ("follow", "false"),
            ],
            None,
            json!(null),
            3,
        ),
        t(
            "POST",
            "/v1/sandboxes/{sb}/processes/{pid}/stdin",
            &[],
            Json,
            json!({"data": "x", "close": false}),
            2,
        ),
        t(
            "POST",
            "/v1/sandboxes/{sb}/processes/{pid}/signal",
            &[],
            Json,
            json!({"signal": "SIGCONT"}),
            2,
        ),
        t(
            "POST",
            "/v1/sandboxes/{sb}/processes/{pid}/resize",
            &[],
            Json,
            json!({"rows": 30, "cols": 100}),
            2,
        ),
        t(
            "GET",
            "/v1/sandboxes/{sb}/files",
            &[("path", "/work/f"), ("offset", "0"), ("length", "10")],
            None,
            json!(null),
            4,
        ),
        t(
            "PUT",
            "/v1/sandboxes/{sb}/files",
            &[("path", "/work/up"), ("mode", "0644")],
            Raw,
            json!("file body"),
            4,
        ),
        t(
            "DELETE",
            "/v1/sandboxes/{sb}/files",
            &[("path", "/work/up"), ("recursive", "false")],
            None,
            json!(null),
            2,
        ),
        t(
            "GET",
            "/v1/sandboxes/{sb}/files/list",
            &[("path", "/work")],
            None,
            json!(null),
            3,
        ),
        t(
            "GET",
            "/v1/sandboxes/{sb}/files/stat",
            &[("path", "/work/f")],
            None,
            json!(null),
            3,
        ),
        t(
            "POST",
            "/v1/sandboxes/{sb}/files/mkdir",
            &[],
            Json,
            json!({"path": "/work/d/e", "parents": true}),
            2,
        ),
        t(
            "POST",
            "/v1/sandboxes/{sb}/files/rename",
            &[],
            Json,
            json!({"from": "/work/up", "to": "/work/up2"}),
            2,
        ),
        t(
            "GET",
            "/v1/sandboxes/{sb}/files/tar",
            &[("path", "/work")],
            None,
            json!(null),
            3,
        ),
        t(
            "PUT",
            "/v1/sandboxes/{sb}/files/tar",
            &[("path", "/work/t")],
            Raw,
            json!("tar"),
            3,
        ),
        t("GET", "/v1/images", &[], None, json!(null), 1),
        t(
            "POST",
            "/v1/images",
            &[],
            Json,
            json!({"name": "fuzz/i", "source": "/nonexistent/x.tar", "flatten": false}),
            2,
        ),
        t(
            "POST",
            "/v1/images/import/stream",
            &[],
            Json,
            json!({"name": "fuzz/i", "source": "/etc/passwd"}),
            2,
        ),
        t(
            "POST",
            "/v1/images/build",
            &[],
            Json,
            json!({"name": "fuzz/b", "base": "nosuchimage", "steps": [{"run": "true"}]}),
            1,
        ),
        t(
            "POST",
            "/v1/images/gc",
            &[],
            Json,
            json!({"older_than_s": 999999999}),
            1,
        ),
        t(
            "POST",
            "/v1/images/upload",
            &[("name", "fuzz/u"), ("flatten", "false")],
            Raw,
            json!("tar"),
            2,
        ),
        t("GET", "/v1/images/layers", &[], None, json!(null), 1),
        t("DELETE", "/v1/images/{image}", &[], None, json!(null), 1),
        // SWE-ReX.
        t("GET", "/swerex/{sb}/", &[], None, json!(null), 1),
        t("GET", "/swerex/{sb}/is_alive", &[], None, json!(null), 2),
        t(
            "POST",
            "/swerex/{sb}/create_session",
            &[],
            Json,
            json!({"session": "sw", "startup_source": []}),
            2,
        ),
        t(
            "POST",
            "/swerex/{sb}/run_in_session",
            &[],
            Json,
            json!({"action_type": "bash", "command": "echo hi", "session": "sw", "timeout": 5, "check": "silent"}),
            3,
        ),
        t(
            "POST",
            "/swerex/{sb}/close_session",
            &[],
            Json,
            json!({"session": "sw"}),
            1,
        ),
        t(
            "POST",
            "/swerex/{sb}/execute",
            &[],
            Json,
            json!({"command": ["echo", "x"], "timeout": 5, "shell": false, "check": false}),
            3,
        ),
        t(
            "POST",
            "/swerex/{sb}/read_file",
            &[],
            Json,
            json!({"path": "/work/f"}),
            2,
        ),
        t(
            "POST",
            "/swerex/{sb}/write_file",
            &[],
            Json,
            json!({"path": "/work/sw", "content": "c"}),
            2,
        ),
        t(
            "POST",
            "/swerex/{sb}/upload",
            &[],
            Raw,
            json!("multipart"),
            2,
        ),
        t("POST", "/swerex/{sb}/close", &[], None, json!(null), 1),
        // E2B REST.
        t(
            "POST",
            "/e2b/sandboxes",
            &[],
            Json,
            json!({"templateID": "base", "timeout": 30, "metadata": {"m": "1"}, "envVars": {"A": "b"}}),
            1,
        ),
        t(
            "GET",
            "/e2b/sandboxes",
            &[("metadata", "m=1")],
            None,
            json!(null),
            1,
        ),
        t(
            "GET",
            "/e2b/v2/sandboxes",
            &[("state", "running")],
            None,
            json!(null),
            1,
        ),
        t("GET", "/e2b/sandboxes/{sb}", &[], None, json!(null), 1),
        t(
            "POST",
            "/e2b/sandboxes/{sb}/timeout",
            &[],
            Json,
            json!({"timeout": 600}),
            1,
        ),
        t(
            "POST",
            "/e2b/sandboxes/{sb}/refreshes",
            &[],
            Json,
            json!({"duration": 60}),
            1,
        ),
        t(
            "POST",
            "/e2b/sandboxes/{sb}/connect",
            &[],
            Json,
            json!({"timeout": 600}),
            1,
        ),
        t(
            "POST",
            "/e2b/sandboxes/{sb}/resume",
            &[],
            Json,
            json!({"timeout": 600}),
            1,
        ),
        // E2B envd.
        t("GET", "/e2b/envd/health", &[], None, json!(null), 1),
        t(
            "GET",
            "/e2b/envd/files",
            &[("path", "/work/f"), ("username", "root")],
            None,
            json!(null),
            2,
        ),
        t(
            "POST",
            "/e2b/envd/files",
            &[("path", "/work/e2b"), ("username", "root")],
            Raw,
            json!("e2b body"),
            2,
        ),
        t(
            "POST",
            "/e2b/envd/process.Process/Start",
            &[],
            Json,
            json!({"process": {"cmd": "/bin/echo", "args": ["hi"], "envs": {}, "cwd": "/"}}),
            2,
        ),
        t(
            "POST",
            "/e2b/envd/process.Process/List",
            &[],
            Json,
            json!({}),
            1,
        ),
        t(
            "POST",
            "/e2b/envd/process.Process/SendSignal",
            &[],
            Json,
            json!({"process": {"pid": 1}, "signal": "SIGNAL_SIGKILL"}),
            1,
        ),
        t(
            "POST",
            "/e2b/envd/process.Process/SendInput",
            &[],
            Json,
            json!({"process": {"pid": 1}, "input": {"stdin": "eA=="}}),
            1,
        ),
        t(
            "POST",
            "/e2b/envd/filesystem.Filesystem/Stat",
            &[],
            Json,
            json!({"path": "/work/f"}),
            2,
        ),
        // Seed 31 found a ListDir (#344) whose depth of 2^64 spun a runtime thread and
        // stopped the whole server (health included).
        t(
            "POST",
            "/e2b/envd/filesystem.Filesystem/ListDir",
            &[],
            Json,
            json!({"path": "/work", "depth": 2}),
            2,
        ),
        t(
            "POST",
            "/e2b/envd/filesystem.Filesystem/MakeDir",
            &[],
            Json,
            json!({"path": "/work/ed"}),
            1,
        ),
        t(
            "POST",
            "/e2b/envd/filesystem.Filesystem/Move",
            &[],
            Json,
            json!({"source": "/work/ed", "destination": "/work/ed2"}),
            1,
        ),
        t(
            "POST",
            "/e2b/envd/filesystem.Filesystem/Remove",
            &[],
            Json,
            json!({"path": "/work/ed2"}),
            1,
        ),
    ]
}

/// Fixed names the templates point at.
struct Fixture {
    sb: String,
    session: String,
    pid: String,
}

/// A raw (already mutated) body for routes that take bytes, not JSON.
fn raw_body(rng: &mut Rng, path: &str) -> (Vec<u8>, String) {
    if path.ends_with("/files/tar") {
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(3);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        let _ = b.append_data(&mut h, "fz.txt", &b"abc"[..]);
        let mut bytes = b.into_inner().unwrap_or_default();
        if rng.chance(70) {
            mutate_bytes(rng, &mut bytes);
        }
        return (bytes, "application/x-tar".into());
    }
    if path.ends_with("/upload") {
        let boundary = "fzb";
        let mut bytes = format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f\"\r\n\r\nabc\r\n\
             --{boundary}\r\nContent-Disposition: form-data; name=\"target_path\"\r\n\r\n/work/swu\r\n\
             --{boundary}\r\nContent-Disposition: form-data; name=\"unzip\"\r\n\r\nfalse\r\n--{boundary}--\r\n"
        )
        .into_bytes();
        if rng.chance(80) {
            mutate_bytes(rng, &mut bytes);
        }
        return (bytes, format!("multipart/form-data; boundary={boundary}"));
    }
    let mut bytes = b"some file body".to_vec();
    if rng.chance(50) {
        mutate_bytes(rng, &mut bytes);
    }
    (bytes, "application/octet-stream".into())
}

fn fill(path: &str, fx: &Fixture, rng: &mut Rng, mutate_ids: bool) -> String {
    let pick = |rng: &mut Rng, real: &str| -> String {
        if mutate_ids && rng.chance(25) {
            let s = *rng.pick(&[
                "sb-00000000",
                "x",
                "%00",
                "..",
                "%2e%2e%2f",
                "99999999999999999999",
                "-1",
                "a%20b",
            ]);
            s.to_string()
        } else {
            real.to_string()
        }
    };
    let mut out = path.to_string();
    if out.contains("{sb}") {
        out = out.replace("{sb}", &pick(rng, &fx.sb));
    }
    if out.contains("{session}") {
        out = out.replace("{session}", &pick(rng, &fx.session));
    }
    if out.contains("{pid}") {
        out = out.replace("{pid}", &pick(rng, &fx.pid));
    }
    out.replace("{job}", &pick(rng, "fuzzjob"))
        .replace("{image}", &pick(rng, "fuzz/nosuch"))
}

fn encode_query(rng: &mut Rng, query: &[(&str, &str)], mutate: bool) -> String {
    let mut pairs: Vec<(String, String)> = query
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    if mutate && !pairs.is_empty() && rng.chance(60) {
        let i = rng.below(pairs.len());
        match rng.below(4) {
            0 => {
                pairs.remove(i);
            }
            1 => {
                pairs[i].1 = (*rng.pick(&[
                    "18446744073709551615",
                    "9223372036854775807",
                    "-1",
                    "1e3",
                    "",
                    "true",
                    "0999",
                    "0o7777",
                    "36855",
                    "/work/../etc/passwd",
                    "/nonexistent",
                    "%00",
                    "\u{0}",
                    "/dev/null",
                ]))
                .to_string();
            }
            2 => pairs.push(("unknown".into(), "1".into())),
            // Long, but within what an HTTP client sends in a URL.
            _ => pairs[i].1 = "q".repeat(*rng.pick(&[300usize, 4000])),
        }
    }
    if pairs.is_empty() {
        return String::new();
    }
    let enc: Vec<String> = pairs
        .iter()
        .map(|(k, v)| {
            let v = percent_encoding::utf8_percent_encode(v, percent_encoding::NON_ALPHANUMERIC);
            format!("{k}={v}")
        })
        .collect();
    format!("?{}", enc.join("&"))
}

/// An error with its sources (`error sending request` alone does not say why).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(&format!(": {s}"));
        source = s.source();
    }
    out
}

fn short(s: &str) -> String {
    s.chars().take(300).collect()
}

/// Why a request failed the run, if it did.
fn judge(status: u16, path: &str, content_type: &str, body: &[u8]) -> Option<String> {
    let allowed_5xx = match status {
        // The front's own protocol: SWE-ReX raises runtime errors as 511.
        511 => path.starts_with("/swerex/"),
        // envd's health of a sandbox that is not running (what the E2B SDK checks).
        502 => path == "/e2b/envd/health",
        // Limits of the sandbox or node, said as such.
        503 | 504 | 507 => true,
        _ => false,
    };
    if status >= 500 && !allowed_5xx {
        return Some(format!(
            "{status}: {}",
            String::from_utf8_lossy(&body[..body.len().min(500)])
        ));
    }
    if status >= 400 && !content_type.starts_with("application/json") {
        return Some(format!(
            "{status} with a non-JSON body ({content_type}): {}",
            String::from_utf8_lossy(&body[..body.len().min(200)])
        ));
    }
    None
}

#[tokio::test(flavor = "multi_thread")]
async fn fuzzed_requests_get_4xx_never_5xx_or_a_cut() {
    if !require_root() {
        return;
    }
    let seed: u64 = std::env::var("DSEC_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(31);
    let count: usize = std::env::var("DSEC_FUZZ_COUNT")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000);
    let verbose = std::env::var_os("DSEC_FUZZ_VERBOSE").is_some();
    println!("fuzz: seed {seed}, {count} requests (DSEC_FUZZ_SEED, DSEC_FUZZ_COUNT)");
    let s = server();
    let c = s.client();
    let make_target = || async {
        let sb = c
            .create_sandbox(CreateSandboxRequest {
                labels: BTreeMap::from([("job".into(), "fuzzjob".into())]),
                auto_resume: true,
                ..Default::default()
            })
            .await
            .expect("target sandbox");
        c.write_file(&sb.id, "/work/f", None, "fuzz target file\n")
            .await
            .expect("write");
        c.create_session(
            &sb.id,
            CreateSessionRequest {
                session: Some("fz".into()),
                env: Default::default(),
                cwd: None,
                user: None,
            },
        )
        .await
        .expect("session");
        let p = c
            .start_process(
                &sb.id,
                // Exited at once: its output (`follow` included) ends.
                background(Command::Argv(vec!["echo".into(), "fuzz".into()])),
            )
            .await
            .expect("process");
        Fixture {
            sb: sb.id,
            session: "fz".into(),
            pid: p.pid.to_string(),
        }
    };
    let mut fx = make_target().await;
    let templates = templates();
    let weighted: Vec<usize> = templates
        .iter()
        .enumerate()
        .flat_map(|(i, t)| std::iter::repeat_n(i, t.weight))
        .collect();
    // A fresh connection per request: a pooled one that the server closes after an
    // answer (say, to a request whose body it did not read) races the next request sent
    // on it, which then fails before reaching the server: not the cut this test looks for.
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(0)
        .build()
        .expect("http client");
    let mut rng = Rng(seed);
    let mut failures = Vec::new();
    let mut statuses: BTreeMap<u16, usize> = BTreeMap::new();
    let started = Instant::now();
    let deadline = started + Duration::from_secs(150);
    let mut done = 0;
    for n in 0..count {
        if Instant::now() > deadline {
            println!("fuzz: time budget spent after {n} requests");
            break;
        }
        let t = &templates[*rng.pick(&weighted)];
        // Most requests mutate the body; the rest the ids, query, method or headers.
        let mutate_ids = rng.chance(15);
        let path = fill(t.path, &fx, &mut rng, mutate_ids);
        let query = encode_query(&mut rng, t.query, true);
        let mut method = t.method;
        if rng.chance(4) {
            method = *rng.pick(&["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]);
        }
        let (mut body, mut ctype) = match t.body {
            Body::None => (Vec::new(), "application/json".to_string()),
            Body::Raw => raw_body(&mut rng, &path),
            Body::Json => {
                let mut v = t.json.clone();
                for _ in 0..1 + rng.below(3) {
                    mutate_json(&mut rng, &mut v);
                }
                let mut b = serde_json::to_vec(&v).unwrap_or_default();
                if rng.chance(20) {
                    mutate_bytes(&mut rng, &mut b);
                }
                (b, "application/json".to_string())
            }
        };
        if t.body == Body::None && rng.chance(10) {
            body = b"{\"unexpected\": true}".to_vec();
        }
        if rng.chance(3) {
            ctype = (*rng.pick(&[
                "text/plain",
                "",
                "application/json; charset=utf-16",
                "multipart/form-data",
            ]))
            .to_string();
        }
        let url = format!("{}{path}{query}", s.url);
        let mut rb = http
            .request(
                reqwest::Method::from_bytes(method.as_bytes()).unwrap_or(reqwest::Method::GET),
                &url,
            )
            .header("x-api-key", &s.key)
            .header("x-access-token", &s.key)
            .header("e2b-sandbox-id", &fx.sb);
        if !ctype.is_empty() {
            rb = rb.header("content-type", &ctype);
        }
        if !body.is_empty() {
            rb = rb.body(body);
        }
        let what: String = format!("#{n} {method} {path}{query}")
            .chars()
            .take(240)
            .collect();
        let sent = Instant::now();
        let outcome = rb.send().await;
        match outcome {
            Err(e) => failures.push(format!("{what}: no answer: {}", short(&error_chain(&e)))),
            Ok(resp) => {
                let status = resp.status().as_u16();
                *statuses.entry(status).or_default() += 1;
                let ct = resp
                    .headers()
                    .get("content-type")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_string();
                match resp.bytes().await {
                    Err(e) => failures.push(format!(
                        "{what}: {status}, then the body broke: {}",
                        short(&e.to_string())
                    )),
                    Ok(b) => {
                        if let Some(why) = judge(status, &path, &ct, &b) {
                            failures.push(format!("{what}: {why}"));
                        }
                        // Created sandboxes (a valid create by chance) go at once.
                        if status == 201 && (path == "/v1/sandboxes" || path == "/e2b/sandboxes") {
                            if let Ok(v) = serde_json::from_slice::<Value>(&b) {
                                let id = v["id"].as_str().or(v["sandboxID"].as_str());
                                if let Some(id) = id.filter(|id| *id != fx.sb) {
                                    let _ = c.delete_sandbox(id).await;
                                }
                            }
                        }
                    }
                }
            }
        }
        if verbose {
            println!("fuzz: {what} ({:.2} s)", sent.elapsed().as_secs_f64());
        }
        if sent.elapsed() > Duration::from_secs(5) {
            println!("fuzz: slow ({:.1} s): {what}", sent.elapsed().as_secs_f64());
        }
        done = n + 1;
        // The target may have been deleted, paused or filled up: make a fresh one.
        if n % 100 == 99 {
            if c.health().await.is_err() {
                failures.push(format!("server unhealthy after #{n}"));
                break;
            }
            let ok = c
                .exec(&fx.sb, dsec_e2e::sh("true"))
                .await
                .is_ok_and(|r| r.exit.exit_code == Some(0));
            if !ok {
                let _ = c.delete_sandbox(&fx.sb).await;
                fx = make_target().await;
            }
        }
    }
    println!(
        "fuzz: {done} requests in {:.1} s, statuses {statuses:?}",
        started.elapsed().as_secs_f64()
    );
    assert!(c.health().await.is_ok(), "the server died:\n{}", s.log());
    let _ = c.delete_sandbox(&fx.sb).await;
    assert!(
        failures.is_empty(),
        "seed {seed}: {} of {done} requests failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

//! What a careless or hostile caller sends (issue #31, defects 8-11): uploads that break
//! off or fill the disk change nothing, user mistakes are 4xx with a stable code, errors
//! come before a 200, and loose inputs are refused. Against a real `dsec serve`.

use std::collections::BTreeMap;
use std::io::Write;
use std::time::Duration;

use dsec_client::{Client, ClientError};
use dsec_e2e::{background, require_root, sh, wait_until, Server};
use dsec_wire::v1::*;
use dsec_wire::ErrorCode;
use serde_json::{json, Value};

fn server() -> &'static Server {
    Server::shared("hostile")
}

async fn create(c: &Client, req: CreateSandboxRequest) -> Sandbox {
    c.create_sandbox(req).await.expect("create sandbox")
}

async fn run(c: &Client, id: &str, cmd: &str) -> ExecResult {
    c.exec(id, sh(cmd))
        .await
        .unwrap_or_else(|e| panic!("exec {cmd:?}: {e}"))
}

fn code(e: ClientError) -> ErrorCode {
    e.code()
        .unwrap_or_else(|| panic!("expected an API error, got {e}"))
}

/// Bytes that do not compress, from a fixed seed.
fn noise(len: usize, mut x: u64) -> Vec<u8> {
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A tar of regular files `(name, bytes)`, in order.
fn tar_of(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, data) in files {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        b.append_data(&mut h, name, *data).expect("tar entry");
    }
    b.into_inner().expect("tar")
}

/// A raw request: (status, content type, body). `None` when the connection broke.
async fn raw(
    s: &Server,
    method: reqwest::Method,
    path: impl std::fmt::Display,
    content_type: &str,
    body: Vec<u8>,
) -> Option<(u16, String, Vec<u8>)> {
    let resp = reqwest::Client::new()
        .request(method, format!("{}{path}", s.url))
        .header("x-api-key", &s.key)
        .header("content-type", content_type)
        .body(body)
        .send()
        .await
        .ok()?;
    let status = resp.status().as_u16();
    let ct = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let body = resp.bytes().await.ok()?.to_vec();
    Some((status, ct, body))
}

fn json_body(b: &[u8]) -> Value {
    serde_json::from_slice(b).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {}",
            String::from_utf8_lossy(&b[..b.len().min(300)])
        )
    })
}

/// Sends `head` and then `body` on a raw connection, then drops it mid-request.
async fn send_and_vanish(addr: &str, head: String, body: &[u8]) {
    let mut conn = std::net::TcpStream::connect(addr).expect("connect");
    conn.write_all(head.as_bytes()).expect("send head");
    conn.write_all(body).expect("send body");
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(conn);
}

/// Waits until `ls -A dir` in the sandbox is exactly `want` (staging directories gone).
async fn listing_becomes(c: &Client, id: &str, dir: &str, want: &str) -> String {
    let got = wait_until(Duration::from_secs(10), || {
        let (c, id) = (c.clone(), id.to_string());
        let cmd = format!("ls -A {dir}");
        let want = want.to_string();
        async move {
            let r = c.exec(&id, sh(&cmd)).await.ok()?;
            (r.stdout == want).then_some(r.stdout)
        }
    })
    .await;
    got.unwrap_or_else(|| format!("<{dir} never became {want:?}>"))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tar_upload_is_all_or_nothing() {
    if !require_root() {
        return;
    }
    let s = server();
    let c = s.client();
    let sb = create(&c, CreateSandboxRequest::default()).await;
    c.write_file(&sb.id, "/work/keep.txt", None, "precious")
        .await
        .expect("write");
    let addr = s.url.trim_start_matches("http://").to_string();
    let head = |path: &str, framing: &str| {
        format!(
            "PUT /v1/sandboxes/{}/files/tar?path={path} HTTP/1.1\r\nHost: {addr}\r\n\
             x-api-key: {}\r\nContent-Type: application/x-tar\r\n{framing}\r\n\r\n",
            sb.id, s.key
        )
    };

    // Cut off inside an entry that replaces an existing file.
    let big = noise(8 << 20, 1);
    let archive = tar_of(&[("keep.txt", &big), ("new.txt", b"new")]);
    let cut = &archive[..4 << 20];
    send_and_vanish(
        &addr,
        head("/work", &format!("Content-Length: {}", archive.len())),
        cut,
    )
    .await;
    // Cut off exactly between two entries: what arrived is a valid archive of the first
    // entry, and still must not land.
    let first = noise(100_000, 2);
    let archive = tar_of(&[("first.bin", &first), ("second.bin", &big)]);
    let boundary = 512 + first.len().div_ceil(512) * 512;
    send_and_vanish(
        &addr,
        head("/work", &format!("Content-Length: {}", archive.len())),
        &archive[..boundary],
    )
    .await;
    // The same as a chunked body, into a directory the upload would create.
    let mut chunk = format!("{boundary:x}\r\n").into_bytes();
    chunk.extend_from_slice(&archive[..boundary]);
    chunk.extend_from_slice(b"\r\n");
    send_and_vanish(
        &addr,
        head("/work/fresh/deep", "Transfer-Encoding: chunked"),
        &chunk,
    )
    .await;
    let listing = listing_becomes(&c, &sb.id, "/work", "keep.txt\n").await;
    assert_eq!(listing, "keep.txt\n", "cut-off uploads left files behind");
    assert_eq!(
        run(&c, &sb.id, "cat /work/keep.txt").await.stdout,
        "precious"
    );

    // A bad entry after good ones: refused, and the good ones do not land either.
    let mut archive = tar_of(&[("ok.txt", b"fine"), ("keep.txt", b"replaced")]);
    archive.truncate(archive.len() - 1024); // drop the end-of-archive blocks
    let mut evil = tar::Header::new_gnu();
    evil.as_old_mut().name[..9].copy_from_slice(b"../escape");
    evil.set_size(0);
    evil.set_mode(0o644);
    evil.set_entry_type(tar::EntryType::Regular);
    evil.set_cksum();
    archive.extend_from_slice(evil.as_bytes());
    archive.extend_from_slice(&[0u8; 1024]);
    let e = c
        .upload_tar(&sb.id, "/work", archive)
        .await
        .expect_err("escaping entry");
    assert_eq!(code(e), ErrorCode::InvalidPath);
    // A file where the destination has a directory: refused before anything moves.
    run(&c, &sb.id, "mkdir /work/adir").await;
    let archive = tar_of(&[("ok.txt", b"fine"), ("adir", b"file over a dir")]);
    let e = c
        .upload_tar(&sb.id, "/work", archive)
        .await
        .expect_err("file over a directory");
    assert_eq!(code(e), ErrorCode::BadRequest);
    let r = run(&c, &sb.id, "ls -A /work; cat /work/keep.txt").await;
    assert_eq!(r.stdout, "adir\nkeep.txt\nprecious");

    // A good one merges: replaces a file, adds beside it, keeps the rest.
    run(&c, &sb.id, "echo mine > /work/adir/own").await;
    let archive = tar_of(&[("keep.txt", b"v2"), ("adir/added", b"a"), ("sub/x", b"x")]);
    c.upload_tar(&sb.id, "/work", archive)
        .await
        .expect("upload");
    let r = run(
        &c,
        &sb.id,
        "ls -A /work /work/adir; cat /work/keep.txt /work/adir/own /work/sub/x",
    )
    .await;
    assert_eq!(
        r.stdout,
        "/work:\nadir\nkeep.txt\nsub\n\n/work/adir:\nadded\nown\nv2mine\nx"
    );
    c.delete_sandbox(&sb.id).await.expect("delete");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tar_that_fills_the_disk_leaves_the_disk_as_it_was() {
    if !require_root() {
        return;
    }
    let s = server();
    let c = s.client();
    let sb = create(
        &c,
        CreateSandboxRequest {
            resources: Resources {
                disk_mb: Some(64),
                ..Default::default()
            },
            ..Default::default()
        },
    )
    .await;
    c.write_file(&sb.id, "/work/keep.txt", None, "precious")
        .await
        .expect("write");
    let used = |r: ExecResult| -> u64 { r.stdout.trim().parse().expect("df number") };
    let before = used(run(&c, &sb.id, "sync; df -k --output=used / | tail -1").await);
    let big = noise(100 << 20, 3);
    let archive = tar_of(&[("keep.txt", b"replaced"), ("big.bin", &big)]);
    let e = c
        .upload_tar(&sb.id, "/work", archive)
        .await
        .expect_err("over the disk");
    assert_eq!(code(e), ErrorCode::NoSpace);
    let listing = listing_becomes(&c, &sb.id, "/work", "keep.txt\n").await;
    assert_eq!(listing, "keep.txt\n");
    assert_eq!(
        run(&c, &sb.id, "cat /work/keep.txt").await.stdout,
        "precious"
    );
    let after = used(run(&c, &sb.id, "sync; df -k --output=used / | tail -1").await);
    assert!(
        after <= before + 1024,
        "the disk kept {} KiB of a refused upload",
        after.saturating_sub(before)
    );
    // And a single-file upload over the limit is just as clean.
    let e = c
        .write_file(&sb.id, "/work/keep.txt", None, noise(100 << 20, 4))
        .await
        .expect_err("over the disk");
    assert_eq!(code(e), ErrorCode::NoSpace);
    let r = run(&c, &sb.id, "ls -A /work; cat /work/keep.txt").await;
    assert_eq!(r.stdout, "keep.txt\nprecious");
    c.delete_sandbox(&sb.id).await.expect("delete");
}

#[tokio::test(flavor = "multi_thread")]
async fn user_mistakes_are_4xx_that_say_what_to_fix() {
    if !require_root() {
        return;
    }
    let s = server();
    let c = s.client();

    // A writable path the image lacks.
    let e = c
        .create_sandbox(CreateSandboxRequest {
            filesystem: FilesystemPolicy {
                writable: vec!["/no/such/dir".into()],
                ..Default::default()
            },
            ..Default::default()
        })
        .await
        .expect_err("missing writable path");
    assert!(e.to_string().contains("/no/such/dir"), "{e}");
    assert_eq!(code(e), ErrorCode::BadRequest);

    // An import of a path that is not there.
    let e = c
        .import_image(ImportImageRequest {
            name: "missing/src".into(),
            source: "/nonexistent/rootfs.tar".into(),
            flatten: false,
        })
        .await
        .expect_err("missing source");
    assert!(e.to_string().contains("does not exist"), "{e}");
    assert_eq!(code(e), ErrorCode::BadRequest);

    let sb = create(
        &c,
        CreateSandboxRequest {
            resources: Resources {
                pids: Some(16),
                ..Default::default()
            },
            ..Default::default()
        },
    )
    .await;
    // Arguments over the kernel's limit, as argv, as a shell line and as env, small
    // enough for one agent message and not.
    for (what, req) in [
        ("1 MB argument", {
            let mut r = sh("true");
            r.cmd = Command::Argv(vec!["echo".into(), "a".repeat(1 << 20)]);
            r
        }),
        ("4 MiB argument", {
            let mut r = sh("true");
            r.cmd = Command::Argv(vec!["echo".into(), "a".repeat(4 << 20)]);
            r
        }),
        (
            "1 MB shell line",
            sh(&format!("echo {}", "a".repeat(1 << 20))),
        ),
        ("many arguments", {
            let mut r = sh("true");
            r.cmd = Command::Argv(
                std::iter::once("echo".to_string())
                    .chain(std::iter::repeat_n("a".repeat(100_000), 40))
                    .collect(),
            );
            r
        }),
        ("1 MB env", {
            let mut r = sh("true");
            r.env = BTreeMap::from([("BIG".into(), "v".repeat(1 << 20))]);
            r
        }),
    ] {
        let e = c.exec(&sb.id, req).await.expect_err(what);
        assert!(e.to_string().contains("E2BIG"), "{what}: {e}");
        assert_eq!(code(e), ErrorCode::BadRequest, "{what}");
    }
    // The same through SWE-ReX's execute.
    let body =
        serde_json::to_vec(&json!({"command": ["echo", "a".repeat(1 << 20)]})).expect("json");
    let (status, _, b) = raw(
        s,
        reqwest::Method::POST,
        format!("/swerex/{}/execute", sb.id),
        "application/json",
        body,
    )
    .await
    .expect("answer");
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&b));
    assert!(json_body(&b)["detail"]
        .as_str()
        .is_some_and(|d| d.contains("E2BIG")));
    // Still fine after all that.
    assert_eq!(run(&c, &sb.id, "echo ok").await.stdout, "ok\n");

    // The sandbox's own process limit: say so, as a conflict, not a 500.
    let mut refused = None;
    for _ in 0..40 {
        let start = c
            .start_process(
                &sb.id,
                background(Command::Argv(vec!["sleep".into(), "600".into()])),
            )
            .await;
        if let Err(e) = start {
            refused = Some(e);
            break;
        }
    }
    let e = refused.expect("the pid limit never refused a spawn");
    assert!(e.to_string().contains("resources.pids"), "{e}");
    assert_eq!(code(e), ErrorCode::Conflict);
    // The agent's own threads for a transfer meet the same limit: the same answer.
    let up = c
        .upload_tar(&sb.id, "/tmp", tar_of(&[("x", b"x")]))
        .await
        .expect_err("no thread for the upload");
    let down = c
        .download_tar(&sb.id, "/etc")
        .await
        .err()
        .expect("no thread for the download");
    for (what, e) in [("upload", up), ("download", down)] {
        assert!(e.to_string().contains("resources.pids"), "{what}: {e}");
        assert_eq!(code(e), ErrorCode::Conflict, "{what}");
    }
    c.delete_sandbox(&sb.id).await.expect("delete");
}

#[tokio::test(flavor = "multi_thread")]
async fn e2b_templates_without_passwd_or_shell() {
    if !require_root() {
        return;
    }
    let s = server();
    let c = s.client();
    // The base image less its /etc/passwd and /etc/group, as an image.
    let sb = create(&c, CreateSandboxRequest::default()).await;
    run(&c, &sb.id, "rm /etc/passwd /etc/group").await;
    c.commit_sandbox(&sb.id, "hostile/nopasswd")
        .await
        .expect("commit");
    c.delete_sandbox(&sb.id).await.expect("delete");
    let e2b_create = |template: &str| {
        raw(
            s,
            reqwest::Method::POST,
            "/e2b/sandboxes",
            "application/json",
            serde_json::to_vec(&json!({"templateID": template, "timeout": 60})).expect("json"),
        )
    };
    let (status, _, b) = e2b_create("hostile/nopasswd").await.expect("answer");
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&b));
    let id = json_body(&b)["sandboxID"]
        .as_str()
        .expect("sandboxID")
        .to_string();
    let mut as_user = sh("id -un; echo $HOME");
    as_user.user = Some("user".into());
    let r = c.exec(&id, as_user).await.expect("exec as user");
    assert_eq!(r.stdout, "user\n/home/user\n");
    c.delete_sandbox(&id).await.expect("delete");

    // An image with no shell at all: the caller's template cannot work; say why.
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("hello.txt"), "hi").expect("write");
    c.import_image(ImportImageRequest {
        name: "hostile/noshell".into(),
        source: dir.path().display().to_string(),
        flatten: false,
    })
    .await
    .expect("import");
    let (status, ct, b) = e2b_create("hostile/noshell").await.expect("answer");
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&b));
    assert!(ct.starts_with("application/json"));
    assert!(json_body(&b)["message"]
        .as_str()
        .is_some_and(|m| m.contains("/bin/sh")));
    let left = c.list_sandboxes(BTreeMap::new()).await.expect("list");
    assert!(
        left.sandboxes.iter().all(|s| s.image != "hostile/noshell"),
        "a refused E2B create left its sandbox"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn errors_are_answered_before_a_200() {
    if !require_root() {
        return;
    }
    let s = server();
    let c = s.client();
    let sb = create(&c, CreateSandboxRequest::default()).await;
    c.write_file(&sb.id, "/work/f", None, "data")
        .await
        .expect("write");
    let get = |q: String| {
        raw(
            s,
            reqwest::Method::GET,
            format!("/v1/sandboxes/{}/{q}", sb.id),
            "application/json",
            Vec::new(),
        )
    };
    let (status, _, b) = get(format!("files?path=/work/f&offset={}", u64::MAX))
        .await
        .expect("an answer, not a cut connection");
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&b));
    assert_eq!(json_body(&b)["error"]["code"], "bad_request");
    let (status, _, b) = get(format!("files?path=/work/f&offset={}", i64::MAX))
        .await
        .expect("answer");
    assert_eq!((status, b.len()), (200, 0));
    let (status, _, b) = get("files/tar?path=/nonexistent".into())
        .await
        .expect("an answer, not a cut connection");
    assert_eq!(status, 404, "{}", String::from_utf8_lossy(&b));
    assert_eq!(json_body(&b)["error"]["code"], "not_found");
    // A file downloads as a tar of itself; an empty directory as an empty tar.
    run(&c, &sb.id, "mkdir /work/empty").await;
    for path in ["/work/f", "/work/empty"] {
        let (status, _, b) = get(format!("files/tar?path={path}")).await.expect("answer");
        assert_eq!(status, 200);
        assert!(tar::Archive::new(&b[..]).entries().is_ok());
    }
    c.delete_sandbox(&sb.id).await.expect("delete");
}

#[tokio::test(flavor = "multi_thread")]
async fn loose_inputs_are_refused() {
    if !require_root() {
        return;
    }
    let s = server();
    let c = s.client();
    let post = |path: &'static str, body: Vec<u8>| {
        raw(s, reqwest::Method::POST, path, "application/json", body)
    };

    // `[]` is not a create request.
    let (status, _, b) = post("/v1/sandboxes", b" [ ]".to_vec())
        .await
        .expect("answer");
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&b));
    assert!(c
        .list_sandboxes(BTreeMap::new())
        .await
        .expect("list")
        .sandboxes
        .iter()
        .all(|s| s.labels.get("t") != Some(&"loose".to_string())));

    let labels = BTreeMap::from([("t".to_string(), "loose".to_string())]);
    // A user the image does not have, or a group.
    for user in ["nosuchuser", "nobody:nosuchgroup"] {
        let e = c
            .create_sandbox(CreateSandboxRequest {
                user: Some(user.into()),
                labels: labels.clone(),
                ..Default::default()
            })
            .await
            .expect_err(user);
        assert!(e.to_string().contains("does not exist"), "{e}");
        assert_eq!(code(e), ErrorCode::BadRequest, "{user}");
    }
    // Known names and bare ids are fine.
    for (user, want) in [("nobody", "nobody"), ("4242:4343", "4242 4343")] {
        let sb = create(
            &c,
            CreateSandboxRequest {
                user: Some(user.into()),
                labels: labels.clone(),
                ..Default::default()
            },
        )
        .await;
        let r = run(
            &c,
            &sb.id,
            "if [ $(id -u) = 4242 ]; then echo $(id -u) $(id -g); else id -un; fi",
        )
        .await;
        assert_eq!(r.stdout.trim(), want);
        c.delete_sandbox(&sb.id).await.expect("delete");
    }
    let left = c.list_sandboxes(labels.clone()).await.expect("list");
    assert!(left.sandboxes.is_empty(), "{:?}", left.sandboxes);

    // Init files: permission bits only.
    for mode in [36855, 0o4755, 0o2755, 0o1777] {
        let e = c
            .create_sandbox(CreateSandboxRequest {
                files: vec![InitFile {
                    path: "/work/x".into(),
                    content: "x".into(),
                    encoding: ContentEncoding::Utf8,
                    mode: Some(mode),
                }],
                labels: labels.clone(),
                ..Default::default()
            })
            .await
            .expect_err("special mode bits");
        assert_eq!(code(e), ErrorCode::BadRequest, "{mode:o}");
    }

    // A CPU limit the kernel cannot enforce as given.
    for cpu in [1e-300, 0.001] {
        let e = c
            .create_sandbox(CreateSandboxRequest {
                resources: Resources {
                    cpu: Some(cpu),
                    ..Default::default()
                },
                labels: labels.clone(),
                ..Default::default()
            })
            .await
            .expect_err("tiny cpu");
        assert_eq!(code(e), ErrorCode::BadRequest, "{cpu}");
    }

    // A known route with a method it does not take.
    let (status, _, b) = raw(
        s,
        reqwest::Method::PATCH,
        "/v1/sandboxes",
        "application/json",
        b"{}".to_vec(),
    )
    .await
    .expect("answer");
    assert_eq!(status, 405);
    assert_eq!(json_body(&b)["error"]["code"], "method_not_allowed");

    // Bodies over the limit: JSON errors in each front's shape.
    let huge = vec![b' '; 65 << 20];
    let (status, ct, b) = post("/swerex/sb-x/execute", huge.clone())
        .await
        .expect("answer");
    assert_eq!(status, 413);
    assert!(ct.starts_with("application/json"), "{ct}");
    assert!(json_body(&b)["detail"].is_string());
    let (status, ct, b) = post("/e2b/sandboxes", huge.clone()).await.expect("answer");
    assert_eq!(status, 413);
    assert!(ct.starts_with("application/json"), "{ct}");
    assert_eq!(json_body(&b)["code"], 413);
    let (status, _, b) = post("/v1/sandboxes", huge).await.expect("answer");
    assert_eq!(status, 413);
    assert_eq!(json_body(&b)["error"]["code"], "payload_too_large");

    // One idempotency key, two different requests: the second is a conflict.
    let first = CreateSandboxRequest {
        idempotency_key: Some("hostile-key".into()),
        labels: labels.clone(),
        ..Default::default()
    };
    let a = create(&c, first.clone()).await;
    let again = create(&c, first.clone()).await;
    assert_eq!(again.id, a.id);
    for other in [
        CreateSandboxRequest {
            env: BTreeMap::from([("X".into(), "1".into())]),
            ..first.clone()
        },
        CreateSandboxRequest {
            labels: BTreeMap::new(),
            ..first.clone()
        },
    ] {
        let e = c
            .create_sandbox(other)
            .await
            .expect_err("same key, other body");
        assert!(e.to_string().contains("hostile-key"), "{e}");
        assert_eq!(code(e), ErrorCode::Conflict);
    }
    c.delete_sandbox(&a.id).await.expect("delete");
}

/// A directory too large to list in one agent reply (the sandbox made it: a listing is
/// the harness's own call) answers `payload_too_large` saying what to do, never a 5xx,
/// and the sandbox goes on answering.
#[tokio::test(flavor = "multi_thread")]
async fn a_listing_too_large_for_one_reply_is_a_4xx() {
    if !require_root() {
        return;
    }
    let c = server().client();
    let sb = create(&c, CreateSandboxRequest::default()).await;
    let long = "n".repeat(90);
    let made = run(
        &c,
        &sb.id,
        &format!("mkdir -p /work/many && cd /work/many && for i in $(seq 20000); do : > {long}-$i; done; ls | wc -l"),
    )
    .await;
    assert_eq!(made.stdout.trim(), "20000", "{made:?}");
    let e = c
        .list_files(&sb.id, "/work/many")
        .await
        .expect_err("too large for one reply");
    let message = e.to_string();
    assert_eq!(code(e), ErrorCode::PayloadTooLarge, "{message}");
    assert!(message.contains("fewer entries"), "{message}");
    assert_eq!(run(&c, &sb.id, "echo ok").await.stdout, "ok\n");
    let small = c
        .list_files(&sb.id, "/work")
        .await
        .expect("a small listing");
    assert_eq!(small.entries.len(), 1);
    let sb_now = c.get_sandbox(&sb.id).await.expect("get");
    assert_eq!(sb_now.state, SandboxState::Ready);
    c.delete_sandbox(&sb.id).await.expect("delete");
}

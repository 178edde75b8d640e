//! Transport-only tests.
//!
//! These exercise HTTP behaviour that needs no sandbox: auth, the error body shape,
//! JSON/query rejections, label parsing, unknown routes, panics and stream encoding. The
//! [`Stub`] API below is a test double that fails (or echoes) everything; end-to-end tests
//! against the real control plane live elsewhere.

use std::collections::BTreeMap;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use bytes::Bytes;
use dsec_control::api::ApiResult;
use dsec_control::{ByteStream, EventStream, Principal};
use dsec_wire::error::ErrorBody;
use dsec_wire::v1::*;
use dsec_wire::ApiError;
use futures::StreamExt;
use tower::ServiceExt;

use super::*;

const KEY: &str = "test-key";
/// A key with only the `read` scope.
const READ_KEY: &str = "read-key";

fn principal(scopes: Vec<dsec_iam::Scope>) -> Principal {
    Principal {
        tenant: "default".into(),
        key_id: "test".into(),
        scopes,
    }
}

/// Test double: accepts [`KEY`], answers health, echoes a few inputs inside errors so the
/// tests can see what the transport decoded, and fails everything else with `not_found`.
struct Stub;

fn stub_err<T>(what: &str) -> ApiResult<T> {
    Err(ApiError::new(ErrorCode::NotFound, format!("stub: {what}")))
}

fn file_info(size: u64) -> FileInfo {
    FileInfo {
        name: "ünï.txt".into(),
        path: "/tmp/ünï.txt".into(),
        kind: FileKind::File,
        size,
        mode: 0o644,
        mtime: 0,
        uid: 0,
        gid: 0,
        symlink_target: None,
    }
}

#[async_trait::async_trait]
impl SandboxApi for Stub {
    fn authenticate(&self, key: Option<&str>) -> ApiResult<Principal> {
        match key {
            Some(KEY) => Ok(principal(dsec_control::Scope::ALL.to_vec())),
            Some(READ_KEY) => Ok(principal(vec![dsec_control::Scope::Read])),
            Some(_) => Err(ApiError::new(ErrorCode::Unauthorized, "invalid API key")),
            None => Err(ApiError::new(ErrorCode::Unauthorized, "missing API key")),
        }
    }
    async fn health(&self) -> ApiResult<Health> {
        Ok(Health {
            status: "ok".into(),
            version: "test".into(),
            node: "stub".into(),
            cgroup: "v2".into(),
            sandboxes: 0,
            unhealthy_sandboxes: 0,
            unhealthy_marks_total: 0,
            capacity: None,
            isolation: Vec::new(),
        })
    }
    async fn create_sandbox(
        &self,
        _caller: &Principal,
        _: CreateSandboxRequest,
    ) -> ApiResult<Sandbox> {
        stub_err("create_sandbox")
    }
    async fn get_sandbox(&self, _caller: &Principal, id: &str) -> ApiResult<Sandbox> {
        if id == "panic" {
            panic!("boom");
        }
        stub_err(&format!("get_sandbox {id}"))
    }
    async fn list_sandboxes(
        &self,
        _caller: &Principal,
        labels: BTreeMap<String, String>,
    ) -> ApiResult<SandboxList> {
        stub_err(&format!("labels {labels:?}"))
    }
    async fn delete_sandbox(&self, _caller: &Principal, _: &str) -> ApiResult<()> {
        Ok(())
    }
    async fn set_timeout(
        &self,
        _caller: &Principal,
        _: &str,
        _: SetTimeoutRequest,
    ) -> ApiResult<Sandbox> {
        stub_err("set_timeout")
    }
    async fn set_network(
        &self,
        _caller: &Principal,
        _: &str,
        _: NetworkPolicy,
    ) -> ApiResult<Sandbox> {
        stub_err("set_network")
    }
    async fn screenshot(&self, _caller: &Principal, _: &str) -> ApiResult<bytes::Bytes> {
        stub_err("screenshot")
    }
    async fn send_input(
        &self,
        _caller: &Principal,
        _: &str,
        _: dsec_wire::v1::InputRequest,
    ) -> ApiResult<()> {
        stub_err("send_input")
    }
    async fn pause_sandbox(&self, _caller: &Principal, _: &str) -> ApiResult<PauseResult> {
        stub_err("pause_sandbox")
    }
    async fn resume_sandbox(&self, _caller: &Principal, _: &str) -> ApiResult<Sandbox> {
        stub_err("resume_sandbox")
    }
    async fn gc_images(&self, _caller: &Principal, _: GcRequest) -> ApiResult<GcResult> {
        stub_err("gc_images")
    }
    async fn build_image(&self, _caller: &Principal, _: BuildRequest) -> ApiResult<BuildResult> {
        stub_err("build_image")
    }
    async fn commit_sandbox(
        &self,
        _caller: &Principal,
        _: &str,
        _: CommitRequest,
    ) -> ApiResult<Image> {
        stub_err("commit_sandbox")
    }
    async fn suspend_job(&self, _caller: &Principal, _: &str) -> ApiResult<JobResult> {
        stub_err("suspend_job")
    }
    async fn resume_job(&self, _caller: &Principal, _: &str) -> ApiResult<JobResult> {
        stub_err("resume_job")
    }
    async fn exec(&self, _caller: &Principal, _: &str, _: ExecRequest) -> ApiResult<ExecResult> {
        stub_err("exec")
    }
    async fn exec_stream(
        &self,
        _caller: &Principal,
        _: &str,
        _: ExecRequest,
    ) -> ApiResult<EventStream> {
        let events = vec![
            ExecEvent::Started { pid: 7 },
            ExecEvent::Stdout {
                data: "hi\n".into(),
            },
            ExecEvent::Exit {
                exit: ExitInfo {
                    exit_code: Some(3),
                    ..Default::default()
                },
                oom_killed: false,
            },
        ];
        Ok(futures::stream::iter(events).boxed())
    }
    async fn create_session(
        &self,
        _caller: &Principal,
        _: &str,
        _: CreateSessionRequest,
    ) -> ApiResult<SessionInfo> {
        stub_err("create_session")
    }
    async fn list_sessions(&self, _caller: &Principal, _: &str) -> ApiResult<SessionList> {
        stub_err("list_sessions")
    }
    async fn run_in_session(
        &self,
        _caller: &Principal,
        _: &str,
        _: &str,
        _: SessionRunRequest,
    ) -> ApiResult<SessionResult> {
        stub_err("run_in_session")
    }
    async fn interrupt_session(&self, _caller: &Principal, _: &str, _: &str) -> ApiResult<()> {
        stub_err("interrupt_session")
    }
    async fn close_session(&self, _caller: &Principal, _: &str, _: &str) -> ApiResult<()> {
        stub_err("close_session")
    }
    async fn start_process(
        &self,
        _caller: &Principal,
        _: &str,
        _: StartProcessRequest,
    ) -> ApiResult<ProcessInfo> {
        stub_err("start_process")
    }
    async fn list_processes(&self, _caller: &Principal, _: &str) -> ApiResult<ProcessList> {
        stub_err("list_processes")
    }
    async fn process_output(
        &self,
        _caller: &Principal,
        _: &str,
        pid: u32,
        so: u64,
        se: u64,
        follow: bool,
    ) -> ApiResult<EventStream> {
        stub_err(&format!("output {pid} {so} {se} {follow}"))
    }
    async fn process_stdin(
        &self,
        _caller: &Principal,
        _: &str,
        _: u32,
        _: StdinRequest,
    ) -> ApiResult<()> {
        stub_err("process_stdin")
    }
    async fn signal_process(
        &self,
        _caller: &Principal,
        _: &str,
        _: u32,
        req: SignalRequest,
    ) -> ApiResult<()> {
        stub_err(&format!("signal {}", req.signal))
    }
    async fn resize_process(
        &self,
        _caller: &Principal,
        _: &str,
        _: u32,
        _: PtySize,
    ) -> ApiResult<()> {
        stub_err("resize_process")
    }
    async fn read_file(
        &self,
        _caller: &Principal,
        _: &str,
        _: &str,
        _: u64,
        _: Option<u64>,
    ) -> ApiResult<(FileInfo, ByteStream)> {
        let chunks = vec![
            Ok(Bytes::from_static(b"hello ")),
            Ok(Bytes::from_static(b"world")),
        ];
        Ok((file_info(11), futures::stream::iter(chunks).boxed()))
    }
    async fn write_file(
        &self,
        _caller: &Principal,
        _: &str,
        path: &str,
        mode: Option<u32>,
        mut body: ByteStream,
        _: Option<&str>,
    ) -> ApiResult<WriteResult> {
        let mut n = 0u64;
        while let Some(chunk) = body.next().await {
            n += chunk?.len() as u64;
        }
        stub_err(&format!("write {path} {mode:?} {n}"))
    }
    async fn list_files(&self, _caller: &Principal, _: &str, _: &str) -> ApiResult<FileList> {
        stub_err("list_files")
    }
    async fn stat_file(&self, _caller: &Principal, _: &str, _: &str) -> ApiResult<FileInfo> {
        stub_err("stat_file")
    }
    async fn mkdir(&self, _caller: &Principal, _: &str, _: MkdirRequest) -> ApiResult<()> {
        stub_err("mkdir")
    }
    async fn remove_file(&self, _caller: &Principal, _: &str, _: &str, _: bool) -> ApiResult<()> {
        stub_err("remove_file")
    }
    async fn rename_file(&self, _caller: &Principal, _: &str, _: RenameRequest) -> ApiResult<()> {
        stub_err("rename_file")
    }
    async fn download_tar(&self, _caller: &Principal, _: &str, _: &str) -> ApiResult<ByteStream> {
        stub_err("download_tar")
    }
    async fn upload_tar(
        &self,
        _caller: &Principal,
        _: &str,
        _: &str,
        _: ByteStream,
        _: Option<&str>,
    ) -> ApiResult<WriteResult> {
        stub_err("upload_tar")
    }
    async fn list_images(&self, _caller: &Principal) -> ApiResult<ImageList> {
        stub_err("list_images")
    }
    async fn import_image(&self, _caller: &Principal, _: ImportImageRequest) -> ApiResult<Image> {
        stub_err("import_image")
    }
    async fn delete_image(&self, _caller: &Principal, name: &str) -> ApiResult<()> {
        stub_err(&format!("delete_image {name}"))
    }
}

fn app() -> Router {
    router(Arc::new(Stub))
}

fn req(method: &str, uri: &str) -> axum::http::request::Builder {
    Request::builder()
        .method(method)
        .uri(uri)
        .header("x-api-key", KEY)
}

async fn send(r: Request<Body>) -> (StatusCode, axum::http::HeaderMap, Bytes) {
    let resp = app().oneshot(r).await.expect("router is infallible");
    let status = resp.status();
    let headers = resp.headers().clone();
    let body = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .expect("body");
    (status, headers, body)
}

/// Sends the request and decodes the error body, checking its shape.
async fn send_err(r: Request<Body>) -> (StatusCode, ApiError) {
    let (status, headers, body) = send(r).await;
    assert_eq!(headers[header::CONTENT_TYPE], "application/json");
    let parsed: ErrorBody = serde_json::from_slice(&body).unwrap_or_else(|e| {
        panic!(
            "not an error body ({e}): {}",
            String::from_utf8_lossy(&body)
        )
    });
    assert_eq!(status.as_u16(), parsed.error.code.http_status());
    (status, parsed.error)
}

fn post_json(uri: &str, json: &str) -> Request<Body> {
    req("POST", uri)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(json.to_owned()))
        .expect("request")
}

#[tokio::test]
async fn health_needs_no_key() {
    let r = Request::get("/v1/health")
        .body(Body::empty())
        .expect("request");
    let (status, _, body) = send(r).await;
    assert_eq!(status, StatusCode::OK);
    let h: Health = serde_json::from_slice(&body).expect("health json");
    assert_eq!(h.status, "ok");
}

#[tokio::test]
async fn missing_or_wrong_key_is_401() {
    let r = Request::get("/v1/sandboxes")
        .body(Body::empty())
        .expect("request");
    let (status, e) = send_err(r).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(e.code, ErrorCode::Unauthorized);
    assert_eq!(e.message, "missing API key");

    let r = Request::get("/v1/images")
        .header("x-api-key", "nope")
        .body(Body::empty())
        .expect("request");
    let (_, e) = send_err(r).await;
    assert_eq!(e.message, "invalid API key");
}

#[tokio::test]
async fn bearer_key_is_accepted() {
    let r = Request::get("/v1/images")
        .header(header::AUTHORIZATION, format!("Bearer {KEY}"))
        .body(Body::empty())
        .expect("request");
    let (_, e) = send_err(r).await;
    assert_eq!(e.message, "stub: list_images");
}

#[tokio::test]
async fn api_errors_keep_code_and_message() {
    let r = req("GET", "/v1/sandboxes/abc")
        .body(Body::empty())
        .expect("request");
    let (status, e) = send_err(r).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(
        e,
        ApiError::new(ErrorCode::NotFound, "stub: get_sandbox abc")
    );
}

#[tokio::test]
async fn unit_results_are_204() {
    let r = req("DELETE", "/v1/sandboxes/abc")
        .body(Body::empty())
        .expect("request");
    let (status, _, body) = send(r).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    assert!(body.is_empty());
}

#[tokio::test]
async fn bad_json_is_bad_request() {
    let (status, e) = send_err(post_json("/v1/sandboxes", "{not json")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(e.code, ErrorCode::BadRequest);
}

#[tokio::test]
async fn unknown_field_is_bad_request_with_serde_message() {
    let (_, e) = send_err(post_json("/v1/sandboxes", r#"{"imag":"base"}"#)).await;
    assert_eq!(e.code, ErrorCode::BadRequest);
    assert!(e.message.contains("unknown field `imag`"), "{}", e.message);
}

#[tokio::test]
async fn wrong_type_is_bad_request() {
    let (_, e) = send_err(post_json(
        "/v1/sandboxes/x/timeout",
        r#"{"timeout_s":"soon"}"#,
    ))
    .await;
    assert_eq!(e.code, ErrorCode::BadRequest);
    assert!(e.message.contains("invalid type"), "{}", e.message);
}

#[tokio::test]
async fn missing_content_type_is_bad_request() {
    let r = req("POST", "/v1/images")
        .body(Body::from(r#"{"name":"a","source":"/b"}"#))
        .expect("request");
    let (status, e) = send_err(r).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        e.message.to_lowercase().contains("content-type"),
        "{}",
        e.message
    );
}

#[tokio::test]
async fn json_body_reaches_the_api() {
    let (_, e) = send_err(post_json(
        "/v1/sandboxes/x/processes/12/signal",
        r#"{"signal":"SIGTERM"}"#,
    ))
    .await;
    assert_eq!(e.message, "stub: signal SIGTERM");
}

#[tokio::test]
async fn bad_pid_is_bad_request() {
    let (status, e) = send_err(post_json(
        "/v1/sandboxes/x/processes/abc/signal",
        r#"{"signal":"TERM"}"#,
    ))
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(e.code, ErrorCode::BadRequest);
}

#[tokio::test]
async fn labels_are_parsed_from_repeated_params() {
    let r = req("GET", "/v1/sandboxes?label=team=a&label=run=x%3Dy")
        .body(Body::empty())
        .expect("request");
    let (_, e) = send_err(r).await;
    assert_eq!(e.message, r#"stub: labels {"run": "x=y", "team": "a"}"#);

    let r = req("GET", "/v1/sandboxes")
        .body(Body::empty())
        .expect("request");
    let (_, e) = send_err(r).await;
    assert_eq!(e.message, "stub: labels {}");
}

#[tokio::test]
async fn label_without_equals_is_bad_request() {
    let r = req("GET", "/v1/sandboxes?label=team")
        .body(Body::empty())
        .expect("request");
    let (_, e) = send_err(r).await;
    assert_eq!(e.code, ErrorCode::BadRequest);
    let r = req("GET", "/v1/sandboxes?colour=red")
        .body(Body::empty())
        .expect("request");
    let (_, e) = send_err(r).await;
    assert_eq!(e.code, ErrorCode::BadRequest);
}

#[tokio::test]
async fn query_errors_are_bad_request() {
    let r = req("GET", "/v1/sandboxes/x/processes/1/output?follow=maybe")
        .body(Body::empty())
        .expect("request");
    let (_, e) = send_err(r).await;
    assert_eq!(e.code, ErrorCode::BadRequest);
    let r = req("GET", "/v1/sandboxes/x/files/stat")
        .body(Body::empty())
        .expect("request");
    let (_, e) = send_err(r).await;
    assert_eq!(e.code, ErrorCode::BadRequest);
    assert!(e.message.contains("path"), "{}", e.message);

    let r = req(
        "GET",
        "/v1/sandboxes/x/processes/1/output?stdout_offset=5&follow=true",
    )
    .body(Body::empty())
    .expect("request");
    let (_, e) = send_err(r).await;
    assert_eq!(e.message, "stub: output 1 5 0 true");
}

#[tokio::test]
async fn unknown_routes_are_not_found_and_unknown_methods_not_allowed_json() {
    let r = req("GET", "/v1/nope").body(Body::empty()).expect("request");
    let (status, e) = send_err(r).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(e.code, ErrorCode::NotFound);
    let r = Request::get("/").body(Body::empty()).expect("request");
    let (_, e) = send_err(r).await;
    assert_eq!(e.code, ErrorCode::NotFound);
    // A route that exists, with a method it does not take.
    let r = req("PATCH", "/v1/sandboxes")
        .body(Body::empty())
        .expect("request");
    let (status, e) = send_err(r).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(e.code, ErrorCode::MethodNotAllowed);
}

#[tokio::test]
async fn panics_become_internal_errors() {
    let r = req("GET", "/v1/sandboxes/panic")
        .body(Body::empty())
        .expect("request");
    let (status, e) = send_err(r).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(e.code, ErrorCode::Internal);
    assert!(e.message.contains("boom"));
}

#[tokio::test]
async fn exec_stream_is_ndjson() {
    let (status, headers, body) = send(post_json(
        "/v1/sandboxes/x/exec/stream",
        r#"{"cmd":["true"]}"#,
    ))
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers[header::CONTENT_TYPE], NDJSON);
    let text = String::from_utf8(body.to_vec()).expect("utf8");
    let events: Vec<ExecEvent> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("event line"))
        .collect();
    assert_eq!(events.len(), 3);
    assert_eq!(events[0], ExecEvent::Started { pid: 7 });
    assert!(matches!(&events[2], ExecEvent::Exit { exit, .. } if exit.exit_code == Some(3)));
    assert!(text.ends_with('\n'));
}

#[tokio::test]
async fn read_file_sends_info_header_and_length() {
    let r = req("GET", "/v1/sandboxes/x/files?path=/tmp/a")
        .body(Body::empty())
        .expect("request");
    let (status, headers, body) = send(r).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(&body[..], b"hello world");
    assert_eq!(headers[header::CONTENT_TYPE], "application/octet-stream");
    assert_eq!(headers[header::CONTENT_LENGTH], "11");
    let info: FileInfo =
        serde_json::from_slice(headers[FILE_INFO_HEADER].as_bytes()).expect("file info header");
    assert_eq!(info, file_info(11));
}

#[tokio::test]
async fn write_file_streams_body_and_parses_mode() {
    let big = vec![7u8; 3 * 1024 * 1024];
    let r = req("PUT", "/v1/sandboxes/x/files?path=/a&mode=0755")
        .body(Body::from(big))
        .expect("request");
    let (_, e) = send_err(r).await;
    assert_eq!(
        e.message,
        format!("stub: write /a Some(493) {}", 3 * 1024 * 1024)
    );

    let r = req("PUT", "/v1/sandboxes/x/files?path=/a&mode=rwx")
        .body(Body::empty())
        .expect("request");
    let (_, e) = send_err(r).await;
    assert_eq!(e.code, ErrorCode::BadRequest);
}

#[tokio::test]
async fn path_segments_are_decoded() {
    let r = req("DELETE", "/v1/images/python%3A3.11")
        .body(Body::empty())
        .expect("request");
    let (_, e) = send_err(r).await;
    assert_eq!(e.message, "stub: delete_image python:3.11");
}

#[tokio::test]
async fn json_bodies_above_axum_default_limit_are_accepted() {
    let content = "x".repeat(3 * 1024 * 1024);
    let body = format!(r#"{{"files":[{{"path":"/a","content":"{content}"}}]}}"#);
    let (_, e) = send_err(post_json("/v1/sandboxes", &body)).await;
    assert_eq!(e.message, "stub: create_sandbox");
}

/// The admin router merges into the main one: its routes answer, the rest are unchanged.
#[tokio::test]
async fn the_admin_router_merges_into_the_main_one() {
    let iam = dsec_iam::Iam::new(Arc::new(dsec_state::MemStore::new()), Some(KEY.into()))
        .await
        .expect("iam");
    let app = app().merge(admin::admin_router(Arc::new(iam)));
    let call = |r: Request<Body>| {
        let app = app.clone();
        async move { app.oneshot(r).await.expect("infallible").status() }
    };
    let tenants = req("GET", "/v1/tenants").body(Body::empty()).expect("req");
    assert_eq!(call(tenants).await, StatusCode::OK);
    let health = req("GET", "/v1/health").body(Body::empty()).expect("req");
    assert_eq!(call(health).await, StatusCode::OK);
    let nowhere = req("GET", "/v1/nowhere").body(Body::empty()).expect("req");
    assert_eq!(call(nowhere).await, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn every_answer_names_its_request_and_errors_carry_the_id() {
    // A caller's plain id is kept, in the header and in the error body.
    let r = req("GET", "/v1/sandboxes/abc")
        .header("x-request-id", "trainer-3:step-41")
        .body(Body::empty())
        .expect("request");
    let (status, headers, body) = send(r).await;
    assert!(status.is_client_error() || status.is_server_error());
    assert_eq!(headers["x-request-id"], "trainer-3:step-41");
    let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(v["error"]["request_id"], "trainer-3:step-41", "{v}");

    // None, or one not fit for a log line: a fresh one, the same in header and body.
    for given in [None, Some("two words"), Some("<script>")] {
        let mut r = req("GET", "/v1/sandboxes/abc");
        if let Some(g) = given {
            r = r.header("x-request-id", g);
        }
        let (_, headers, body) = send(r.body(Body::empty()).expect("request")).await;
        let id = headers["x-request-id"].to_str().expect("ascii").to_string();
        assert!(id.starts_with("req_") && id.len() == 20, "{given:?}: {id}");
        let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(v["error"]["request_id"], id.as_str());
    }

    // Successes and rejections made outside the handlers (no key, unknown routes) too.
    let (status, headers, _) = send(
        Request::get("/v1/health")
            .body(Body::empty())
            .expect("request"),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(headers.contains_key("x-request-id"));
    for r in [
        Request::get("/v1/sandboxes").body(Body::empty()),
        req("GET", "/v1/no-such-route").body(Body::empty()),
    ] {
        let (_, headers, body) = send(r.expect("request")).await;
        let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(
            v["error"]["request_id"].as_str(),
            headers["x-request-id"].to_str().ok(),
            "{v}"
        );
    }
}

#[tokio::test]
async fn every_state_changing_call_is_audited_refused_ones_too() {
    let dir = tempfile::tempdir().expect("dir");
    let log = audit::AuditLog::open(audit::AuditConfig {
        dir: dir.path().to_path_buf(),
        file_bytes: 1 << 20,
        files: 2,
    })
    .expect("audit log");
    let api: Arc<dyn SandboxApi> = Arc::new(Stub);
    let opts = HttpOptions {
        audit: Some(log.clone()),
        ..Default::default()
    };
    let app = with_audit(router_with(api.clone(), opts), log.clone(), api);
    let call = |r: Request<Body>| {
        let app = app.clone();
        async move {
            let resp = app.oneshot(r).await.expect("router is infallible");
            let status = resp.status();
            let body = axum::body::to_bytes(resp.into_body(), usize::MAX)
                .await
                .expect("body");
            (status, body)
        }
    };
    // Answered, refused for the key, refused for the scope, and a read (not audited).
    let (s, _) = call(
        Request::builder()
            .method("DELETE")
            .uri("/v1/sandboxes/sb-7")
            .header("x-api-key", KEY)
            .header("x-request-id", "req-audit-1")
            .body(Body::empty())
            .expect("request"),
    )
    .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, _) = call(
        Request::builder()
            .method("POST")
            .uri("/v1/sandboxes/sb-8/pause")
            .header("x-api-key", "wrong")
            .body(Body::empty())
            .expect("request"),
    )
    .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _) = call(
        Request::builder()
            .method("POST")
            .uri("/v1/sandboxes/sb-9/pause")
            .header("x-api-key", READ_KEY)
            .body(Body::empty())
            .expect("request"),
    )
    .await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let (s, _) = call(
        req("GET", "/v1/sandboxes/sb-7")
            .body(Body::empty())
            .expect("r"),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    let (s, body) = call(req("GET", "/v1/audit").body(Body::empty()).expect("r")).await;
    assert_eq!(s, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    let list: AuditList = serde_json::from_slice(&body).expect("audit list");
    let seen: Vec<String> = list
        .entries
        .iter()
        .map(|e| {
            format!(
                "{} {} {} {:?} {:?}",
                e.method, e.path, e.status, e.error, e.key_id
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            r#"DELETE /v1/sandboxes/sb-7 204 None Some("test")"#,
            r#"POST /v1/sandboxes/sb-8/pause 401 Some("unauthorized") None"#,
            r#"POST /v1/sandboxes/sb-9/pause 403 Some("forbidden") Some("test")"#,
        ]
    );
    assert_eq!(list.entries[0].request_id.as_deref(), Some("req-audit-1"));
    assert_eq!(list.entries[0].sandbox.as_deref(), Some("sb-7"));
    assert_eq!(list.entries[0].tenant.as_deref(), Some("default"));

    // Only admins read it.
    let (s, _) = call(
        Request::builder()
            .uri("/v1/audit")
            .header("x-api-key", READ_KEY)
            .body(Body::empty())
            .expect("request"),
    )
    .await;
    assert_eq!(s, StatusCode::FORBIDDEN);
}

#[tokio::test]
async fn a_last_event_id_that_is_not_an_id_is_bad_request() {
    let (status, e) = send_err(
        req("GET", "/v1/events")
            .header("last-event-id", "../../etc")
            .body(Body::empty())
            .expect("request"),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(e.message.contains("Last-Event-ID"), "{}", e.message);
    let (status, e) = send_err(
        req("GET", "/v1/events?after=-1")
            .body(Body::empty())
            .expect("request"),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{}", e.message);
}

// ---------------------------------------------------------------- OpenAPI

/// The paths given to `.route(...)` in a router's source (string literals only).
fn routed_paths(source: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = source;
    while let Some(at) = rest.find(".route(") {
        rest = &rest[at + ".route(".len()..];
        let trimmed = rest.trim_start();
        if let Some(lit) = trimmed.strip_prefix('"') {
            if let Some(end) = lit.find('"') {
                out.push(lit[..end].to_string());
            }
        }
    }
    out
}

/// A concrete path for a route template (`{x}` -> `x`, `{*key}` -> `a/b`).
fn concrete(template: &str) -> String {
    template
        .split('/')
        .map(|seg| match seg {
            s if s.starts_with("{*") => "a/b".to_string(),
            s if s.starts_with('{') => "7".to_string(),
            s => s.to_string(),
        })
        .collect::<Vec<_>>()
        .join("/")
}

/// Every route of the `/v1` router and of the admin router is in the document with the
/// methods it answers, and the document has nothing the routers do not answer: each
/// path is probed with every method, and a method the router does not take answers 405.
#[tokio::test]
async fn the_openapi_document_has_every_route_with_exactly_its_methods() {
    let iam = dsec_iam::Iam::new(Arc::new(dsec_state::MemStore::new()), Some(KEY.into()))
        .await
        .expect("iam");
    let app = app().merge(admin::admin_router(Arc::new(iam)));
    let mut paths: Vec<String> = routed_paths(include_str!("lib.rs"))
        .into_iter()
        .filter(|p| p != "/metrics")
        .map(|p| format!("/v1{p}"))
        .collect();
    paths.extend(routed_paths(include_str!("admin.rs")));
    assert!(paths.len() > 50, "routes parsed from the source: {paths:?}");
    let documented = openapi::documented_routes();
    let mut routed = Vec::new();
    for path in &paths {
        for method in ["get", "post", "put", "patch", "delete"] {
            // No key: a routed method answers 401 (or 200 when public), never 405.
            let r = Request::builder()
                .method(method.to_uppercase().as_str())
                .uri(concrete(path))
                .body(Body::empty())
                .expect("request");
            let status = app.clone().oneshot(r).await.expect("infallible").status();
            assert_ne!(status, StatusCode::NOT_FOUND, "{method} {path}");
            if status != StatusCode::METHOD_NOT_ALLOWED {
                routed.push((method, path.clone()));
            }
        }
    }
    for r in &routed {
        assert!(
            documented.contains(r),
            "{} {} is routed but not in the OpenAPI document (openapi.rs operations())",
            r.0,
            r.1
        );
    }
    for d in &documented {
        assert!(
            routed.contains(d),
            "{} {} is in the OpenAPI document but not routed",
            d.0,
            d.1
        );
    }
}

/// `docs/openapi.json` is the document the server builds; `DSEC_BLESS_OPENAPI=1` rewrites
/// it after a change of the API.
#[test]
fn docs_openapi_json_is_the_generated_document() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/openapi.json");
    let generated = serde_json::to_string_pretty(&openapi::document()).expect("encodes") + "\n";
    if std::env::var_os("DSEC_BLESS_OPENAPI").is_some() {
        std::fs::write(&path, &generated).expect("writing docs/openapi.json");
    }
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        checked_in == generated,
        "docs/openapi.json is not the document the server builds: run \
         `DSEC_BLESS_OPENAPI=1 cargo test -p dsec-http openapi` and commit it"
    );
}

/// The document is served without a key, and every `$ref` in it names a schema it has.
#[tokio::test]
async fn the_openapi_document_is_served_and_its_refs_resolve() {
    let r = Request::builder()
        .uri("/v1/openapi.json")
        .body(Body::empty())
        .expect("request");
    let (status, headers, body) = send(r).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers[header::CONTENT_TYPE], "application/json");
    let doc: serde_json::Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(doc, openapi::document());
    assert_eq!(doc["openapi"], "3.1.0");
    let schemas = doc["components"]["schemas"].as_object().expect("schemas");
    fn refs<'a>(v: &'a serde_json::Value, out: &mut Vec<&'a str>) {
        match v {
            serde_json::Value::Object(m) => {
                if let Some(serde_json::Value::String(r)) = m.get("$ref") {
                    out.push(r);
                }
                m.values().for_each(|v| refs(v, out));
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| refs(v, out)),
            _ => {}
        }
    }
    let mut all = Vec::new();
    refs(&doc, &mut all);
    assert!(all.len() > 50);
    for r in all {
        let name = r
            .strip_prefix("#/components/schemas/")
            .unwrap_or_else(|| panic!("ref outside the components: {r}"));
        assert!(schemas.contains_key(name), "{r} names no schema");
    }
    // Unique operation ids; path parameters declared.
    let mut ids = std::collections::BTreeSet::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for (method, o) in item.as_object().expect("item") {
            let id = o["operationId"].as_str().expect("operationId");
            assert!(ids.insert(id.to_string()), "{id} twice");
            let declared: Vec<&str> = o["parameters"]
                .as_array()
                .expect("parameters")
                .iter()
                .filter(|p| p["in"] == "path")
                .filter_map(|p| p["name"].as_str())
                .collect();
            for seg in path.split('/').filter(|s| s.starts_with('{')) {
                let name = seg.trim_matches(|c| c == '{' || c == '}');
                assert!(
                    declared.contains(&name),
                    "{method} {path}: {name} undeclared"
                );
            }
        }
    }
}

// ---------------------------------------------------------------- console

/// The console's files are served without a key, each with its type and a policy that
/// allows only the server's own scripts; the page names them.
#[tokio::test]
async fn the_console_is_served_with_a_strict_policy() {
    for (path, kind, needle) in [
        ("/ui", "text/html", "/ui/app.js"),
        ("/ui/", "text/html", "/ui/app.css"),
        ("/ui/app.js", "text/javascript", "/v1/whoami"),
        ("/ui/app.css", "text/css", ".login"),
    ] {
        let r = Request::builder()
            .uri(path)
            .body(Body::empty())
            .expect("request");
        let (status, headers, body) = send(r).await;
        assert_eq!(status, StatusCode::OK, "{path}");
        let ct = headers[header::CONTENT_TYPE].to_str().unwrap_or_default();
        assert!(ct.starts_with(kind), "{path}: {ct}");
        let csp = headers[header::CONTENT_SECURITY_POLICY]
            .to_str()
            .unwrap_or_default();
        assert!(
            csp.contains("script-src 'self'") && !csp.contains("unsafe"),
            "{csp}"
        );
        assert!(String::from_utf8_lossy(&body).contains(needle), "{path}");
    }
    // The page has no inline script for the policy to block.
    let r = Request::builder()
        .uri("/ui")
        .body(Body::empty())
        .expect("request");
    let (_, _, body) = send(r).await;
    let page = String::from_utf8_lossy(&body);
    assert_eq!(page.matches("<script").count(), 1);
    assert!(page.contains("<script src=\"/ui/app.js\"></script>"));
}

/// `GET /v1/whoami` says who the key is; without a key it is `unauthorized`.
#[tokio::test]
async fn whoami_names_the_key() {
    let (status, _, body) = send(req("GET", "/v1/whoami").body(Body::empty()).expect("req")).await;
    assert_eq!(status, StatusCode::OK);
    let who: Whoami = serde_json::from_slice(&body).expect("whoami");
    assert_eq!(
        (who.tenant.as_str(), who.key_id.as_str()),
        ("default", "test")
    );
    assert!(who.cluster_admin && who.scopes.contains(&"admin".to_string()));
    let anonymous = Request::builder()
        .uri("/v1/whoami")
        .body(Body::empty())
        .expect("request");
    let (status, e) = send_err(anonymous).await;
    assert_eq!(
        (status, e.code),
        (StatusCode::UNAUTHORIZED, ErrorCode::Unauthorized)
    );
}

/// A terminal needs a WebSocket and a key with the `sandboxes` scope; a browser's key
/// comes as a subprotocol.
#[tokio::test]
async fn the_terminal_route_checks_its_key_and_needs_a_websocket() {
    use base64::Engine as _;
    let offer = |key: &str| {
        format!(
            "dsec.terminal.v1, dsec.key.{}",
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(key)
        )
    };
    let headers = {
        let mut h = axum::http::HeaderMap::new();
        h.insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            offer(KEY).parse().expect("header"),
        );
        h
    };
    assert_eq!(extract::websocket_key(&headers).as_deref(), Some(KEY));
    assert_eq!(extract::request_key(&headers).as_deref(), Some(KEY));

    // A plain GET with a good key: not a WebSocket.
    let (status, e) = send_err(
        req("GET", "/v1/sandboxes/sb-1/terminal")
            .body(Body::empty())
            .expect("req"),
    )
    .await;
    assert_eq!(
        (status, e.code),
        (StatusCode::BAD_REQUEST, ErrorCode::BadRequest)
    );
    assert!(e.message.contains("WebSocket"), "{}", e.message);
    // A read-only key, offered as a subprotocol: forbidden (a terminal runs commands).
    let r = Request::builder()
        .uri("/v1/sandboxes/sb-1/terminal")
        .header(header::SEC_WEBSOCKET_PROTOCOL, offer(READ_KEY))
        .body(Body::empty())
        .expect("req");
    let (status, e) = send_err(r).await;
    assert_eq!(
        (status, e.code),
        (StatusCode::FORBIDDEN, ErrorCode::Forbidden)
    );
    // A wrong one: unauthorized.
    let r = Request::builder()
        .uri("/v1/sandboxes/sb-1/terminal")
        .header(header::SEC_WEBSOCKET_PROTOCOL, offer("nope"))
        .body(Body::empty())
        .expect("req");
    let (status, _) = send_err(r).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
}

//! Client <-> `dsec-http` round trip against an in-memory fake API.
//!
//! This checks the two transports agree (URLs, auth header, error bodies, NDJSON, file
//! headers, streamed uploads, tar helpers). It is not a test of the control plane: the
//! [`Fake`] below keeps files in a map and answers exec with canned events.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use dsec_client::{Client, ClientError};
use dsec_control::api::ApiResult;
use dsec_control::{ByteStream, EventStream, Principal, SandboxApi};
use dsec_wire::v1::*;
use dsec_wire::{ApiError, ErrorCode};
use futures::StreamExt;

const KEY: &str = "k3y";

#[derive(Default)]
struct Fake {
    files: Mutex<HashMap<String, (Vec<u8>, u32)>>,
}

fn nope<T>() -> ApiResult<T> {
    Err(ApiError::new(ErrorCode::Conflict, "not in the fake"))
}

fn info(path: &str, kind: FileKind, size: u64, mode: u32) -> FileInfo {
    FileInfo {
        name: path.rsplit('/').next().unwrap_or_default().to_owned(),
        path: path.to_owned(),
        kind,
        size,
        mode,
        mtime: 0,
        uid: 0,
        gid: 0,
        symlink_target: None,
    }
}

async fn collect(mut body: ByteStream) -> ApiResult<Vec<u8>> {
    let mut out = Vec::new();
    while let Some(chunk) = body.next().await {
        out.extend_from_slice(&chunk?);
    }
    Ok(out)
}

#[async_trait::async_trait]
impl SandboxApi for Fake {
    fn authenticate(&self, key: Option<&str>) -> ApiResult<Principal> {
        if key == Some(KEY) {
            Ok(Principal {
                tenant: "default".into(),
                key_id: "test".into(),
                scopes: dsec_control::Scope::ALL.to_vec(),
            })
        } else {
            Err(ApiError::new(ErrorCode::Unauthorized, "bad key"))
        }
    }
    async fn health(&self) -> ApiResult<Health> {
        Ok(Health {
            status: "ok".into(),
            version: "t".into(),
            node: "n".into(),
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
        nope()
    }
    async fn get_sandbox(&self, _caller: &Principal, id: &str) -> ApiResult<Sandbox> {
        Err(ApiError::new(
            ErrorCode::NotFound,
            format!("no sandbox {id}"),
        ))
    }
    async fn list_sandboxes(
        &self,
        _caller: &Principal,
        labels: BTreeMap<String, String>,
    ) -> ApiResult<SandboxList> {
        Err(ApiError::new(ErrorCode::BadRequest, format!("{labels:?}")))
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
        nope()
    }
    async fn set_network(
        &self,
        _caller: &Principal,
        _: &str,
        _: NetworkPolicy,
    ) -> ApiResult<Sandbox> {
        nope()
    }
    async fn pause_sandbox(&self, _caller: &Principal, _: &str) -> ApiResult<PauseResult> {
        nope()
    }
    async fn resume_sandbox(&self, _caller: &Principal, _: &str) -> ApiResult<Sandbox> {
        nope()
    }
    async fn gc_images(&self, _caller: &Principal, _: GcRequest) -> ApiResult<GcResult> {
        nope()
    }
    async fn build_image(&self, _caller: &Principal, _: BuildRequest) -> ApiResult<BuildResult> {
        nope()
    }
    async fn commit_sandbox(
        &self,
        _caller: &Principal,
        _: &str,
        _: CommitRequest,
    ) -> ApiResult<Image> {
        nope()
    }
    async fn suspend_job(&self, _caller: &Principal, _: &str) -> ApiResult<JobResult> {
        nope()
    }
    async fn resume_job(&self, _caller: &Principal, _: &str) -> ApiResult<JobResult> {
        nope()
    }
    async fn exec(&self, _caller: &Principal, _: &str, _: ExecRequest) -> ApiResult<ExecResult> {
        nope()
    }
    async fn exec_stream(
        &self,
        _caller: &Principal,
        _: &str,
        req: ExecRequest,
    ) -> ApiResult<EventStream> {
        let text = req.cmd.display();
        let events = vec![
            ExecEvent::Started { pid: 1 },
            ExecEvent::Stdout { data: text.clone() },
            ExecEvent::Stderr {
                data: "line\n".repeat(10_000),
            },
            ExecEvent::Exit {
                exit: ExitInfo {
                    exit_code: Some(text.len() as i32),
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
        nope()
    }
    async fn list_sessions(&self, _caller: &Principal, _: &str) -> ApiResult<SessionList> {
        nope()
    }
    async fn run_in_session(
        &self,
        _caller: &Principal,
        _: &str,
        _: &str,
        _: SessionRunRequest,
    ) -> ApiResult<SessionResult> {
        nope()
    }
    async fn interrupt_session(&self, _caller: &Principal, _: &str, _: &str) -> ApiResult<()> {
        nope()
    }
    async fn close_session(&self, _caller: &Principal, _: &str, _: &str) -> ApiResult<()> {
        nope()
    }
    async fn start_process(
        &self,
        _caller: &Principal,
        _: &str,
        _: StartProcessRequest,
    ) -> ApiResult<ProcessInfo> {
        nope()
    }
    async fn list_processes(&self, _caller: &Principal, _: &str) -> ApiResult<ProcessList> {
        nope()
    }
    async fn process_output(
        &self,
        _caller: &Principal,
        _: &str,
        _: u32,
        _: u64,
        _: u64,
        _: bool,
    ) -> ApiResult<EventStream> {
        nope()
    }
    async fn process_stdin(
        &self,
        _caller: &Principal,
        _: &str,
        _: u32,
        _: StdinRequest,
    ) -> ApiResult<()> {
        nope()
    }
    async fn signal_process(
        &self,
        _caller: &Principal,
        _: &str,
        _: u32,
        _: SignalRequest,
    ) -> ApiResult<()> {
        nope()
    }
    async fn resize_process(
        &self,
        _caller: &Principal,
        _: &str,
        _: u32,
        _: PtySize,
    ) -> ApiResult<()> {
        nope()
    }
    async fn read_file(
        &self,
        _caller: &Principal,
        _: &str,
        path: &str,
        offset: u64,
        length: Option<u64>,
    ) -> ApiResult<(FileInfo, ByteStream)> {
        let (data, mode) = self
            .files
            .lock()
            .expect("lock")
            .get(path)
            .cloned()
            .ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("no file {path}")))?;
        let info = info(path, FileKind::File, data.len() as u64, mode);
        let start = (offset as usize).min(data.len());
        let end = length.map_or(data.len(), |l| (start + l as usize).min(data.len()));
        let chunks: Vec<ApiResult<Bytes>> = data[start..end]
            .chunks(1000)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        Ok((info, futures::stream::iter(chunks).boxed()))
    }
    async fn write_file(
        &self,
        _caller: &Principal,
        _: &str,
        path: &str,
        mode: Option<u32>,
        body: ByteStream,
        _: Option<&str>,
    ) -> ApiResult<WriteResult> {
        let data = collect(body).await?;
        let bytes = data.len() as u64;
        self.files
            .lock()
            .expect("lock")
            .insert(path.to_owned(), (data, mode.unwrap_or(0o644)));
        Ok(WriteResult { bytes })
    }
    async fn list_files(&self, _caller: &Principal, _: &str, _: &str) -> ApiResult<FileList> {
        nope()
    }
    async fn stat_file(&self, _caller: &Principal, _: &str, path: &str) -> ApiResult<FileInfo> {
        let files = self.files.lock().expect("lock");
        match files.get(path) {
            Some((d, m)) => Ok(info(path, FileKind::File, d.len() as u64, *m)),
            None if files.keys().any(|k| k.starts_with(&format!("{path}/"))) => {
                Ok(info(path, FileKind::Dir, 0, 0o755))
            }
            None => Err(ApiError::new(
                ErrorCode::NotFound,
                format!("no file {path}"),
            )),
        }
    }
    async fn mkdir(&self, _caller: &Principal, _: &str, _: MkdirRequest) -> ApiResult<()> {
        nope()
    }
    async fn remove_file(&self, _caller: &Principal, _: &str, _: &str, _: bool) -> ApiResult<()> {
        nope()
    }
    async fn rename_file(&self, _caller: &Principal, _: &str, _: RenameRequest) -> ApiResult<()> {
        nope()
    }
    async fn download_tar(
        &self,
        _caller: &Principal,
        _: &str,
        path: &str,
    ) -> ApiResult<ByteStream> {
        let mut b = tar::Builder::new(Vec::new());
        let prefix = format!("{path}/");
        let files = self.files.lock().expect("lock").clone();
        for (p, (data, mode)) in files.iter().filter(|(p, _)| p.starts_with(&prefix)) {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(*mode);
            h.set_cksum();
            b.append_data(&mut h, &p[prefix.len()..], &data[..])
                .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
        }
        let tar = b
            .into_inner()
            .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
        Ok(futures::stream::iter(vec![Ok(Bytes::from(tar))]).boxed())
    }
    async fn upload_tar(
        &self,
        _caller: &Principal,
        _: &str,
        path: &str,
        body: ByteStream,
        _: Option<&str>,
    ) -> ApiResult<WriteResult> {
        let data = collect(body).await?;
        let mut archive = tar::Archive::new(&data[..]);
        let mut total = 0;
        let bad = |e: std::io::Error| ApiError::new(ErrorCode::BadRequest, e.to_string());
        for entry in archive.entries().map_err(bad)? {
            let mut entry = entry.map_err(bad)?;
            if entry.header().entry_type().is_file() {
                let name = format!("{path}/{}", entry.path().map_err(bad)?.display());
                let mode = entry.header().mode().map_err(bad)?;
                let mut buf = Vec::new();
                std::io::Read::read_to_end(&mut entry, &mut buf).map_err(bad)?;
                total += buf.len() as u64;
                self.files.lock().expect("lock").insert(name, (buf, mode));
            }
        }
        Ok(WriteResult { bytes: total })
    }
    async fn list_images(&self, _caller: &Principal) -> ApiResult<ImageList> {
        Ok(ImageList { images: vec![] })
    }
    async fn import_image(&self, _caller: &Principal, _: ImportImageRequest) -> ApiResult<Image> {
        nope()
    }
    async fn delete_image(&self, _caller: &Principal, name: &str) -> ApiResult<()> {
        Err(ApiError::new(
            ErrorCode::ImageNotFound,
            format!("image {name}"),
        ))
    }
}

async fn start() -> (SocketAddr, Arc<Fake>) {
    let fake = Arc::new(Fake::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let api: Arc<dyn SandboxApi> = fake.clone();
    tokio::spawn(dsec_http::serve(
        listener,
        api,
        dsec_http::HttpOptions::default(),
        std::future::pending(),
    ));
    (addr, fake)
}

fn client(addr: SocketAddr, key: Option<&str>) -> Client {
    Client::new(&format!("http://{addr}"), key.map(str::to_owned)).expect("client")
}

#[tokio::test]
async fn errors_auth_and_json() {
    let (addr, _) = start().await;
    let anon = client(addr, None);
    assert_eq!(anon.health().await.expect("health").status, "ok");
    let e = anon.list_images().await.expect_err("needs key");
    assert_eq!(e.code(), Some(ErrorCode::Unauthorized));

    let c = client(addr, Some(KEY));
    assert!(c.list_images().await.expect("images").images.is_empty());
    let e = c.get_sandbox("sb-1").await.expect_err("missing");
    assert!(matches!(&e, ClientError::Api(a) if a.message == "no sandbox sb-1"));
    let e = c.delete_image("py:3/x").await.expect_err("missing");
    assert!(
        matches!(&e, ClientError::Api(a) if a.message == "image py:3/x"),
        "{e}"
    );
    c.delete_sandbox("x").await.expect("unit result");
    let labels = BTreeMap::from([
        ("a".to_owned(), "1=2".to_owned()),
        ("b c".to_owned(), "&".to_owned()),
    ]);
    let e = c.list_sandboxes(labels.clone()).await.expect_err("echo");
    assert!(
        matches!(&e, ClientError::Api(a) if a.message == format!("{labels:?}")),
        "{e}"
    );
}

#[tokio::test]
async fn connection_refused_is_a_connect_error() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    drop(listener);
    let e = client(addr, None)
        .health()
        .await
        .expect_err("nothing listens");
    assert!(e.is_connect(), "{e:?}");
}

#[tokio::test]
async fn exec_stream_events() {
    let (addr, _) = start().await;
    let c = client(addr, Some(KEY));
    let req = ExecRequest {
        cmd: Command::Shell("echo hi".into()),
        env: BTreeMap::new(),
        cwd: None,
        stdin: None,
        timeout_s: None,
        output_limit: None,
        user: None,
        request_id: None,
    };
    let events: Vec<ExecEvent> = c
        .exec_stream("sb", req)
        .await
        .expect("stream")
        .map(|e| e.expect("event"))
        .collect()
        .await;
    assert_eq!(events.len(), 4);
    assert_eq!(
        events[1],
        ExecEvent::Stdout {
            data: "echo hi".into()
        }
    );
    assert!(matches!(&events[2], ExecEvent::Stderr { data } if data.len() == 50_000));
    assert!(matches!(&events[3], ExecEvent::Exit { exit, .. } if exit.exit_code == Some(7)));
}

#[tokio::test]
async fn files_and_dirs_roundtrip() {
    let (addr, fake) = start().await;
    let c = client(addr, Some(KEY));
    let w = c
        .write_file("sb", "/a/b.txt", Some(0o600), "hello world")
        .await
        .expect("write");
    assert_eq!(w.bytes, 11);
    assert_eq!(fake.files.lock().expect("lock")["/a/b.txt"].1, 0o600);

    let (info, stream) = c
        .read_file("sb", "/a/b.txt", 6, Some(3))
        .await
        .expect("read");
    assert_eq!(info.size, 11);
    let part: Vec<Bytes> = stream.map(|r| r.expect("chunk")).collect().await;
    assert_eq!(part.concat(), b"wor");

    let tmp = tempfile::tempdir().expect("tmp");
    let local = tmp.path().join("big.bin");
    let big: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(&local, &big).expect("write local");
    c.write_file_from_path("sb", &local, "/big.bin", None)
        .await
        .expect("upload file");
    let back = tmp.path().join("back.bin");
    let info = c
        .read_file_to_path("sb", "/big.bin", &back)
        .await
        .expect("download file");
    assert_eq!(info.size, 300_000);
    assert_eq!(std::fs::read(&back).expect("read back"), big);

    let src = tmp.path().join("src");
    std::fs::create_dir_all(src.join("sub")).expect("mkdir");
    std::fs::write(src.join("x"), b"x").expect("write");
    std::fs::write(src.join("sub/y"), &big).expect("write");
    let w = c.upload_dir("sb", &src, "/work").await.expect("upload dir");
    assert_eq!(w.bytes, 300_001);
    assert_eq!(fake.files.lock().expect("lock")["/work/sub/y"].0, big);

    let dst = tmp.path().join("dst");
    c.download_dir("sb", "/work", &dst)
        .await
        .expect("download dir");
    assert_eq!(std::fs::read(dst.join("sub/y")).expect("read"), big);
    assert_eq!(std::fs::read(dst.join("x")).expect("read"), b"x");

    let e = c
        .read_file("sb", "/missing", 0, None)
        .await
        .err()
        .expect("missing");
    assert_eq!(e.code(), Some(ErrorCode::NotFound));
    let e = c
        .upload_dir("sb", &tmp.path().join("nope"), "/w")
        .await
        .expect_err("no local dir");
    assert!(matches!(e, ClientError::Io(_)), "{e:?}");
}

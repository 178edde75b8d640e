//! `dsec node` and `dsec apiserver` as separate processes: the public API served by one
//! process over a node runtime in another, through the internal API and its token.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::Context;
use dsec_client::Client;
use dsec_e2e::{dsec_bin, require_root, sh, wait_until, Server};
use dsec_wire::v1::{CreateSandboxRequest, ExecEvent, ImportImageRequest};
use dsec_wire::ErrorCode;
use futures::StreamExt;

/// A child process killed (by its own pid) when the test ends.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One test at a time: each runs a node on the e2e cgroup parent, which a node claims.
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn spawn(args: &[String], log: &std::path::Path) -> anyhow::Result<Proc> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    let child = Command::new(dsec_bin())
        .args(args)
        .stdout(Stdio::from(log.try_clone()?))
        .stderr(Stdio::from(log))
        .spawn()
        .context("starting dsec")?;
    Ok(Proc(child))
}

#[tokio::test]
async fn the_public_api_works_through_an_apiserver_over_a_separate_node() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let _turn = TURN.lock().await;
    let node = start_node("split").await?;
    let (node_url, token_file, root) = (&node.url, &node.token_file, &node.root);
    // The internal API refuses callers without the node token, users' keys included.
    let refused = reqwest::Client::new()
        .get(format!("{node_url}/node/v1/sandboxes"))
        .bearer_auth(&node.dirs.key)
        .send()
        .await?;
    assert_eq!(refused.status(), 401);

    let api_dir = root.join("apiserver");
    let api_port = free_port()?;
    let mut api = spawn(
        &[
            "apiserver".into(),
            "--listen".into(),
            format!("127.0.0.1:{api_port}"),
            "--state-dir".into(),
            api_dir.display().to_string(),
            "--node".into(),
            node_url.clone(),
            "--node-token-file".into(),
            token_file.display().to_string(),
        ],
        &root.join("apiserver.log"),
    )?;
    let api_url = format!("http://127.0.0.1:{api_port}");
    let client = wait_until(Duration::from_secs(30), || {
        let (url, key_file) = (api_url.clone(), api_dir.join("api-key"));
        async move {
            let key = std::fs::read_to_string(key_file).ok()?;
            let c = Client::new(&url, Some(key.trim().to_string())).ok()?;
            c.health().await.ok().map(|_| c)
        }
    })
    .await
    .context("dsec apiserver did not come up")?;

    // Images reach a remote node as uploads, streamed through the API server.
    let e = client
        .upload_image("junk", false, "not an archive at all")
        .await
        .expect_err("garbage");
    assert_eq!(e.code(), Some(ErrorCode::BadRequest), "{e}");
    let tar = tokio::fs::File::open(dsec_e2e::base_tar()).await?;
    let base = client.upload_image("base", false, tar).await?;
    let images = client.list_images().await?;
    assert_eq!(
        images
            .images
            .iter()
            .map(|i| i.name.as_str())
            .collect::<Vec<_>>(),
        ["base"],
        "the junk upload left nothing"
    );
    assert_eq!(images.images[0].digest, base.digest);
    let sb = client
        .create_sandbox(CreateSandboxRequest::default())
        .await?;
    let r = client.exec(&sb.id, sh("echo via-node; id -u")).await?;
    assert_eq!(r.stdout, "via-node\n0\n", "{r:?}");
    let data: Vec<u8> = (0..4_000_000u32).map(|i| (i % 253) as u8).collect();
    client
        .write_file(&sb.id, "/tmp/blob", None, data.clone())
        .await?;
    let (info, mut body) = client.read_file(&sb.id, "/tmp/blob", 0, None).await?;
    assert_eq!(info.size, data.len() as u64);
    let mut back = Vec::new();
    while let Some(chunk) = body.next().await {
        back.extend_from_slice(&chunk?);
    }
    assert!(back == data, "4 MB round trip through two processes");
    let events: Vec<ExecEvent> = client
        .exec_stream(&sb.id, sh("for i in 1 2 3; do echo $i; done"))
        .await?
        .filter_map(|e| async move { e.ok() })
        .collect()
        .await;
    let out: String = events
        .iter()
        .filter_map(|e| match e {
            ExecEvent::Stdout { data } => Some(data.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(out, "1\n2\n3\n");
    let session = client.create_session(&sb.id, Default::default()).await?;
    client
        .run_in_session(
            &sb.id,
            &session.session,
            dsec_wire::v1::SessionRunRequest {
                command: "cd /tmp && export X=kept".into(),
                timeout_s: None,
            },
        )
        .await?;
    let r = client
        .run_in_session(
            &sb.id,
            &session.session,
            dsec_wire::v1::SessionRunRequest {
                command: "echo $PWD $X".into(),
                timeout_s: None,
            },
        )
        .await?;
    assert_eq!(r.output.trim(), "/tmp kept");
    // A path on the API server means nothing to a remote node: a clear refusal.
    let e = client
        .import_image(ImportImageRequest {
            name: "x".into(),
            source: "/".into(),
            flatten: false,
        })
        .await
        .expect_err("path import through a remote node");
    assert_eq!(e.code(), Some(ErrorCode::BadRequest), "{e}");

    client.delete_sandbox(&sb.id).await?;
    assert!(client
        .list_sandboxes(Default::default())
        .await?
        .sandboxes
        .is_empty());
    // SIGTERM: the node stops cleanly with nothing left to adopt.
    // SAFETY: kill with our own child's pid.
    unsafe { libc::kill(api.0.id() as i32, libc::SIGTERM) };
    let _ = api.0.wait();
    node.stop()
}

/// A `dsec node` process on fresh directories of one test.
struct Node {
    /// Declared (so dropped) before `dirs`: the node dies before its directories go.
    proc: Proc,
    url: String,
    token_file: PathBuf,
    /// The test's directory (`/tmp/dsec-e2e/NAME`), for logs and the API servers'.
    root: PathBuf,
    /// The (stopped) embedded server that made the node's directories fresh. It must
    /// live as long as the node: its drop removes them (state and run directory alike)
    /// and kills the sandboxes a failed test left.
    dirs: Server,
}

impl Node {
    /// Stops the node with SIGTERM and checks it exits cleanly (nothing left to adopt).
    fn stop(mut self) -> anyhow::Result<()> {
        // SAFETY: kill with our own child's pid.
        unsafe { libc::kill(self.proc.0.id() as i32, libc::SIGTERM) };
        let status = self.proc.0.wait()?;
        anyhow::ensure!(status.success(), "dsec node exit: {status:?}");
        Ok(())
    }
}

/// Starts `dsec node` on fresh directories of test `name`.
async fn start_node(name: &str) -> anyhow::Result<Node> {
    // An embedded server's start cleans up after an earlier run of this test.
    let mut dirs = Server::start(name, true).await?;
    dirs.terminate(Duration::from_secs(30))
        .context("the embedded server did not stop")?;
    let root = dirs.state_dir.parent().context("root")?.to_path_buf();
    let port = free_port()?;
    let url = format!("http://127.0.0.1:{port}");
    let proc = spawn(
        &[
            "node".into(),
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--state-dir".into(),
            dirs.state_dir.display().to_string(),
            "--run-dir".into(),
            dirs.run_dir.display().to_string(),
            "--cgroup-parent".into(),
            dsec_e2e::TEST_CGROUP_PARENT.into(),
        ],
        &root.join("node.log"),
    )?;
    let token_file = dirs.state_dir.join("node-token");
    let up = wait_until(Duration::from_secs(30), || {
        let (url, token_file) = (url.clone(), token_file.clone());
        async move {
            let token = std::fs::read_to_string(&token_file).ok()?;
            reqwest::Client::new()
                .get(format!("{url}/node/v1/info"))
                .bearer_auth(token.trim())
                .send()
                .await
                .ok()
                .filter(|r| r.status().is_success())
        }
    })
    .await;
    anyhow::ensure!(up.is_some(), "dsec node did not come up");
    Ok(Node {
        proc,
        url,
        token_file,
        root,
        dirs,
    })
}

/// Ids of the sandboxes the node runs, asked through its internal API.
async fn node_sandboxes(url: &str, token_file: &std::path::Path) -> anyhow::Result<Vec<String>> {
    let token = std::fs::read_to_string(token_file)?;
    let list: Vec<serde_json::Value> = reqwest::Client::new()
        .get(format!("{url}/node/v1/sandboxes"))
        .bearer_auth(token.trim())
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    let mut ids: Vec<String> = list
        .iter()
        .filter_map(|s| s["id"].as_str().map(str::to_string))
        .collect();
    ids.sort();
    Ok(ids)
}

/// Sorted ids of the sandboxes `client` lists.
async fn listed(client: &Client) -> anyhow::Result<Vec<String>> {
    let mut ids: Vec<String> = client
        .list_sandboxes(Default::default())
        .await?
        .sandboxes
        .into_iter()
        .map(|s| s.id)
        .collect();
    ids.sort();
    Ok(ids)
}

#[tokio::test]
async fn two_apiservers_on_etcd_serve_the_same_sandboxes() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let _turn = TURN.lock().await;
    let Some(etcd) = dsec_testkit::Etcd::start("two_apiservers_on_etcd_serve_the_same_sandboxes")
    else {
        return Ok(());
    };
    let node = start_node("split-etcd").await?;
    let key_file = node.root.join("api-key");
    let mut replicas = Vec::new();
    let mut clients = Vec::new();
    for r in ["a", "b"] {
        let dir = node.root.join(format!("apiserver-{r}"));
        let port = free_port()?;
        let proc = spawn(
            &[
                "apiserver".into(),
                "--listen".into(),
                format!("127.0.0.1:{port}"),
                "--state-dir".into(),
                dir.display().to_string(),
                "--etcd".into(),
                etcd.endpoints().join(","),
                "--etcd-prefix".into(),
                "/dsec-e2e-split".into(),
                "--api-key-file".into(),
                key_file.display().to_string(),
                "--node".into(),
                node.url.clone(),
                "--node-token-file".into(),
                node.token_file.display().to_string(),
            ],
            &node.root.join(format!("apiserver-{r}.log")),
        )?;
        replicas.push(proc);
        let url = format!("http://127.0.0.1:{port}");
        let client = wait_until(Duration::from_secs(30), || {
            let (url, key_file) = (url.clone(), key_file.clone());
            async move {
                let key = std::fs::read_to_string(key_file).ok()?;
                let c = Client::new(&url, Some(key.trim().to_string())).ok()?;
                c.health().await.ok().map(|_| c)
            }
        })
        .await
        .with_context(|| format!("apiserver {r} did not come up"))?;
        clients.push(client);
    }
    let (a, b) = (&clients[0], &clients[1]);
    let tar = tokio::fs::File::open(dsec_e2e::base_tar()).await?;
    let base = a.upload_image("base", false, tar).await?;
    let images = b.list_images().await?;
    assert_eq!(images.images.len(), 1, "{images:?}");
    assert_eq!(images.images[0].digest, base.digest, "b lists a's upload");

    // Made on A: B sees it, runs commands in it and changes it at once.
    let sb = a.create_sandbox(CreateSandboxRequest::default()).await?;
    assert_eq!(b.get_sandbox(&sb.id).await?.id, sb.id);
    assert_eq!(listed(b).await?, std::slice::from_ref(&sb.id));
    let r = b.exec(&sb.id, sh("echo from-b")).await?;
    assert_eq!(r.stdout, "from-b\n");
    b.pause_sandbox(&sb.id).await?;
    let seen = wait_until(Duration::from_secs(1), || async {
        let s = a.get_sandbox(&sb.id).await.ok()?;
        (s.state == dsec_wire::v1::SandboxState::Paused).then_some(())
    })
    .await;
    assert!(seen.is_some(), "a sees b's pause within 1 s");
    let e = a.exec(&sb.id, sh("true")).await.expect_err("paused");
    assert_eq!(e.code(), Some(ErrorCode::Paused), "{e}");
    a.resume_sandbox(&sb.id).await?;
    assert_eq!(b.exec(&sb.id, sh("echo again")).await?.stdout, "again\n");

    // A keyed create retried on B (A's answer lost on the way): A's sandbox, not a second.
    let keyed = CreateSandboxRequest {
        idempotency_key: Some("retried".into()),
        ..Default::default()
    };
    let first = a.create_sandbox(keyed.clone()).await?;
    let retried = b.create_sandbox(keyed).await?;
    assert_eq!(retried.id, first.id, "the retry on b returns a's sandbox");
    // Deleted through B: gone for A too, and from the node.
    b.delete_sandbox(&first.id).await?;
    let e = a.get_sandbox(&first.id).await.expect_err("deleted on b");
    assert_eq!(e.code(), Some(ErrorCode::NotFound), "{e}");
    assert_eq!(
        node_sandboxes(&node.url, &node.token_file).await?,
        std::slice::from_ref(&sb.id)
    );

    // The same keyed create sent to both replicas at once: one sandbox.
    for round in 0..3 {
        let req = CreateSandboxRequest {
            idempotency_key: Some(format!("rollout-{round}")),
            ..Default::default()
        };
        let (x, y) = tokio::join!(a.create_sandbox(req.clone()), b.create_sandbox(req));
        let (x, y) = (x?, y?);
        assert_eq!(x.id, y.id, "round {round}");
    }
    let all = listed(a).await?;
    assert_eq!(all.len(), 4, "{all:?}");
    assert_eq!(listed(b).await?, all);
    assert_eq!(node_sandboxes(&node.url, &node.token_file).await?, all);

    // A killed outright (SIGKILL, by its pid): B still serves every sandbox, and its
    // deletes leave the node empty.
    let dead = replicas.remove(0);
    // SAFETY: kill with our own child's pid.
    unsafe { libc::kill(dead.0.id() as i32, libc::SIGKILL) };
    drop(dead); // reaps it
    assert!(a.health().await.is_err(), "a is dead");
    assert_eq!(listed(b).await?, all, "nothing lost with a");
    assert_eq!(
        b.get_sandbox(&sb.id).await?.state,
        dsec_wire::v1::SandboxState::Ready
    );
    assert_eq!(
        b.exec(&sb.id, sh("echo after-a")).await?.stdout,
        "after-a\n"
    );
    for id in &all {
        b.delete_sandbox(id).await?;
    }
    assert!(listed(b).await?.is_empty());
    assert!(node_sandboxes(&node.url, &node.token_file)
        .await?
        .is_empty());
    drop(replicas);
    node.stop()?;
    drop(etcd);
    Ok(())
}

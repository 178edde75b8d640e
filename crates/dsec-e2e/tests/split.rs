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
    spawn_env(args, log, &[])
}

/// [`spawn`] with more environment variables.
fn spawn_env(
    args: &[String],
    log: &std::path::Path,
    env: &[(String, String)],
) -> anyhow::Result<Proc> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    let child = Command::new(dsec_bin())
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
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
    // A private registry the node pulls from with its own credentials.
    let Some(registry) = dsec_testkit::Registry::start_with_auth("split", "node", "pw") else {
        return Ok(());
    };
    let aux = std::env::temp_dir().join("dsec-e2e").join("split-registry");
    let _ = std::fs::remove_dir_all(&aux);
    std::fs::create_dir_all(&aux)?;
    let registry_auth = aux.join("registry-auth.json");
    std::fs::write(
        &registry_auth,
        format!(
            r#"{{"{}": {{"username": "node", "password": "pw"}}}}"#,
            registry.addr()
        ),
    )?;
    std::fs::set_permissions(
        &registry_auth,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )?;
    let marker_tar = aux.join("marker.tar");
    {
        let mut b = tar::Builder::new(std::fs::File::create(&marker_tar)?);
        let mut h = tar::Header::new_gnu();
        let data = b"pulled through the node\n";
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_cksum();
        b.append_data(&mut h, "etc/pulled-marker", &data[..])?;
        b.into_inner()?;
    }
    let layout = dsec_testkit::oci_layout(&aux.join("marker-layout"), &[&marker_tar], "amd64", &[]);
    registry.seed(&layout, "remote/marker:v1", "gzip");
    let auth_arg = registry_auth.display().to_string();
    let node = start_node_with(
        "split",
        &[],
        &[
            "--registry-auth",
            &auth_arg,
            "--allow-registry",
            &registry.addr(),
        ],
    )
    .await?;
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
    let client = api_client(&api_url, &api_dir.join("api-key")).await?;

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
                request_id: None,
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
                request_id: None,
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

    // A pull goes to the node, which fetches from the registry with its credentials; the
    // pulled image stacks on the uploaded base.
    let mut events = client
        .pull_image_stream(dsec_wire::v1::PullImageRequest {
            reference: format!("{}/remote/marker:v1", registry.addr()),
            name: Some("marker".into()),
            insecure: true,
        })
        .await?;
    let mut last = None;
    while let Some(ev) = events.next().await {
        last = Some(ev?);
    }
    assert!(
        matches!(&last, Some(dsec_wire::v1::ImportEvent::Done { image }) if image.name == "marker"),
        "{last:?}"
    );
    let stacked = client
        .create_sandbox(CreateSandboxRequest {
            layers: vec!["marker".into()],
            ..Default::default()
        })
        .await?;
    let r = client
        .exec(&stacked.id, sh("cat /etc/pulled-marker"))
        .await?;
    assert_eq!(r.stdout, "pulled through the node\n", "{r:?}");
    client.delete_sandbox(&stacked.id).await?;

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
    /// Its command line and extra environment, for a restart.
    args: Vec<String>,
    env: Vec<(String, String)>,
}

impl Node {
    /// Kills the node outright (SIGKILL, by its pid), as a machine that dies.
    fn kill(&mut self) {
        // SAFETY: kill with our own child's pid.
        unsafe { libc::kill(self.proc.0.id() as i32, libc::SIGKILL) };
        let _ = self.proc.0.wait();
    }

    /// Starts the node again on the same directories and address.
    fn restart(&mut self) -> anyhow::Result<()> {
        self.proc = spawn_env(&self.args, &self.root.join("node.log"), &self.env)?;
        Ok(())
    }

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
    start_node_with(name, &[], &[]).await
}

/// [`start_node`] with node flags `serve` also takes (`--cgroup-parent` overrides the
/// e2e one) and `node_only` flags.
async fn start_node_with(name: &str, serve: &[&str], node_only: &[&str]) -> anyhow::Result<Node> {
    start_node_env(name, serve, node_only, Vec::new()).await
}

/// [`start_node_with`] with more environment variables for the node process.
async fn start_node_env(
    name: &str,
    serve: &[&str],
    node_only: &[&str],
    env: Vec<(String, String)>,
) -> anyhow::Result<Node> {
    // An embedded server's start cleans up after an earlier run of this test.
    let mut dirs = Server::start_with(name, true, serve).await?;
    dirs.terminate(Duration::from_secs(30))
        .context("the embedded server did not stop")?;
    let root = dirs.state_dir.parent().context("root")?.to_path_buf();
    let port = free_port()?;
    let url = format!("http://127.0.0.1:{port}");
    let mut args: Vec<String> = vec![
        "node".into(),
        "--listen".into(),
        format!("127.0.0.1:{port}"),
        "--state-dir".into(),
        dirs.state_dir.display().to_string(),
        "--run-dir".into(),
        dirs.run_dir.display().to_string(),
    ];
    if !serve.contains(&"--cgroup-parent") {
        args.extend([
            "--cgroup-parent".into(),
            dsec_e2e::TEST_CGROUP_PARENT.into(),
        ]);
    }
    args.extend(serve.iter().chain(node_only).map(|s| s.to_string()));
    let proc = spawn_env(&args, &root.join("node.log"), &env)?;
    let token_file = match node_only.iter().position(|a| *a == "--node-token-file") {
        Some(i) => PathBuf::from(node_only.get(i + 1).context("token file")?),
        None => dirs.state_dir.join("node-token"),
    };
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
        args,
        env,
    })
}

/// The flags of node `i` of a cluster on this machine: its own cgroup parent, subnet,
/// nft table, link prefix, DNS port and uid range; blobs in the shared store `blobs`.
fn cluster_node_flags(i: usize, name: &str, blobs: &str) -> Vec<String> {
    vec![
        "--node-name".into(),
        name.to_string(),
        "--blob-store".into(),
        blobs.to_string(),
        "--cgroup-parent".into(),
        format!("dsec-e2e-{name}"),
        "--sandbox-subnet".into(),
        format!("10.{}.0.0/16", 241 + i),
        "--dns-port".into(),
        (25353 + i).to_string(),
        "--nft-table".into(),
        format!("dsec-e2e-c{i}"),
        "--link-prefix".into(),
        format!("dc{i}"),
        "--userns-base".into(),
        (2_100_000_000u32 + i as u32 * 100_000_000).to_string(),
        "--userns-ranges".into(),
        "512".into(),
    ]
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

/// Starts API server replica `r` over `node`, its records in etcd under `prefix`, and a
/// client of it once it answers.
async fn start_replica(
    node: &Node,
    r: &str,
    etcd: &[String],
    prefix: &str,
    key_file: &std::path::Path,
) -> anyhow::Result<(Proc, Client)> {
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
            etcd.join(","),
            "--etcd-prefix".into(),
            prefix.into(),
            "--api-key-file".into(),
            key_file.display().to_string(),
            "--node".into(),
            node.url.clone(),
            "--node-token-file".into(),
            node.token_file.display().to_string(),
        ],
        &node.root.join(format!("apiserver-{r}.log")),
    )?;
    let url = format!("http://127.0.0.1:{port}");
    let client = api_client(&url, key_file)
        .await
        .with_context(|| format!("apiserver {r}"))?;
    Ok((proc, client))
}

/// A fresh directory for fleet test `name` (`/tmp/dsec-e2e/NAME`) and in it the node
/// token the whole cluster shares.
fn fleet_root(name: &str) -> anyhow::Result<(PathBuf, PathBuf)> {
    let root = std::env::temp_dir().join("dsec-e2e").join(name);
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root)?;
    let token_file = root.join("node-token");
    std::fs::write(&token_file, format!("{:032x}", rand_u128()))?;
    Ok((root, token_file))
}

/// The API server's node list once `n` nodes are live in it.
async fn until_live(client: &Client, n: usize) -> anyhow::Result<dsec_wire::v1::ClusterNodeList> {
    wait_until(Duration::from_secs(15), || async {
        let listed = client.list_nodes().await.ok()?;
        (listed.nodes.iter().filter(|x| x.live).count() == n).then_some(listed)
    })
    .await
    .with_context(|| format!("{n} nodes live"))
}

/// A `dsec apiserver` driving the nodes that register with it (no `--node`), its records
/// in etcd under `prefix`, its files under `root` (key `api-key`, logs); `extra` flags
/// appended. Returns the process, its URL and a client once it answers.
async fn start_fleet_apiserver(
    root: &std::path::Path,
    etcd: &dsec_testkit::Etcd,
    prefix: &str,
    token_file: &std::path::Path,
    extra: &[&str],
) -> anyhow::Result<(Proc, String, Client)> {
    let key_file = root.join("api-key");
    let port = free_port()?;
    let url = format!("http://127.0.0.1:{port}");
    let mut args: Vec<String> = vec![
        "apiserver".into(),
        "--listen".into(),
        format!("127.0.0.1:{port}"),
        "--state-dir".into(),
        root.join("apiserver").display().to_string(),
        "--etcd".into(),
        etcd.endpoints().join(","),
        "--etcd-prefix".into(),
        prefix.into(),
        "--api-key-file".into(),
        key_file.display().to_string(),
        "--node-token-file".into(),
        token_file.display().to_string(),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    let proc = spawn(&args, &root.join("apiserver.log"))?;
    let client = api_client(&url, &key_file).await?;
    Ok((proc, url, client))
}

/// A client of the API server at `url` (key in `key_file`) once it answers.
async fn api_client(url: &str, key_file: &std::path::Path) -> anyhow::Result<Client> {
    wait_until(Duration::from_secs(30), move || async move {
        let key = std::fs::read_to_string(key_file).ok()?;
        let c = Client::new(url, Some(key.trim().to_string())).ok()?;
        c.health().await.ok().map(|_| c)
    })
    .await
    .context("dsec apiserver did not come up")
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
        let (proc, client) =
            start_replica(&node, r, &etcd.endpoints(), "/dsec-e2e-split", &key_file).await?;
        replicas.push(proc);
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

/// Waits (up to `limit`) until sandbox `id` is in `state`; how long it took.
async fn until_state(
    client: &Client,
    id: &str,
    state: dsec_wire::v1::SandboxState,
    limit: Duration,
) -> anyhow::Result<Duration> {
    let started = std::time::Instant::now();
    wait_until(limit, || async {
        let s = client.get_sandbox(id).await.ok()?;
        (s.state == state).then_some(())
    })
    .await
    .with_context(|| format!("{id} did not become {state:?} within {limit:?}"))?;
    Ok(started.elapsed())
}

#[tokio::test]
async fn a_cluster_places_over_its_nodes_and_outlives_losing_one() -> anyhow::Result<()> {
    use dsec_wire::v1::SandboxState;
    if !require_root() {
        return Ok(());
    }
    let _turn = TURN.lock().await;
    let Some(etcd) = dsec_testkit::Etcd::start("a_cluster_places_over_its_nodes") else {
        return Ok(());
    };
    let (root, token_file) = fleet_root("cluster")?;
    // One node token for the whole cluster, one shared blob store.
    let blobs = root.join("blobs");
    let (_api, api_url, client) =
        start_fleet_apiserver(&root, &etcd, "/dsec-e2e-cluster", &token_file, &[]).await?;
    // Two nodes on this machine, each with its own directories, cgroup parent, subnet,
    // nft table, link prefix, DNS port and uid range.
    let blob_arg = blobs.display().to_string();
    let token_arg = token_file.display().to_string();
    let mut nodes = Vec::new();
    for (i, name) in ["cluster-n1", "cluster-n2"].iter().enumerate() {
        let serve = cluster_node_flags(i, name, &blob_arg);
        let serve: Vec<&str> = serve.iter().map(String::as_str).collect();
        let node_only = [
            "--apiserver",
            api_url.as_str(),
            "--node-token-file",
            token_arg.as_str(),
        ];
        nodes.push(start_node_with(name, &serve, &node_only).await?);
    }
    let both = until_live(&client, 2).await?;
    assert_eq!(
        both.nodes
            .iter()
            .map(|n| n.name.as_str())
            .collect::<Vec<_>>(),
        ["cluster-n1", "cluster-n2"]
    );

    // The image, uploaded once, reaches both nodes through the shared blob store.
    let tar = tokio::fs::File::open(dsec_e2e::base_tar()).await?;
    client.upload_image("base", false, tar).await?;
    let mut on: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for _ in 0..6 {
        let sb = client
            .create_sandbox(CreateSandboxRequest::default())
            .await?;
        on.entry(sb.node.clone()).or_default().push(sb.id);
    }
    assert_eq!(on.len(), 2, "sandboxes on both nodes: {on:?}");
    for (i, node) in nodes.iter().enumerate() {
        let name = format!("cluster-n{}", i + 1);
        let mut mine = on[&name].clone();
        mine.sort();
        assert_eq!(node_sandboxes(&node.url, &node.token_file).await?, mine);
        for id in &mine {
            let r = client.exec(id, sh("hostname")).await?;
            assert_eq!(r.stdout.trim(), id.as_str());
        }
    }

    // Node 2 dies: its sandboxes are `lost` within 5 s, new ones go to node 1.
    nodes[1].kill();
    let on_n2 = on["cluster-n2"].clone();
    let took = until_state(
        &client,
        &on_n2[0],
        SandboxState::Lost,
        Duration::from_secs(5),
    )
    .await?;
    for id in &on_n2 {
        until_state(&client, id, SandboxState::Lost, Duration::from_secs(1)).await?;
    }
    let e = client.exec(&on_n2[0], sh("true")).await.expect_err("lost");
    assert_eq!(e.code(), Some(ErrorCode::Lost), "{e}");
    for _ in 0..3 {
        let sb = client
            .create_sandbox(CreateSandboxRequest::default())
            .await?;
        assert_eq!(sb.node, "cluster-n1");
        on.entry(sb.node).or_default().push(sb.id);
    }
    // It comes back (same directories): it adopts its sandboxes, which are usable again.
    nodes[1].restart()?;
    for id in &on_n2 {
        until_state(&client, id, SandboxState::Ready, Duration::from_secs(30)).await?;
        let r = client.exec(id, sh("echo back")).await?;
        assert_eq!(r.stdout, "back\n");
    }
    println!("node loss noticed in {took:?}");
    // Drain: no new sandbox on node 1; undrain: placements reach it again.
    client.drain_node("cluster-n1", true).await?;
    // (It reaches the API server's placement through its watch of the store.)
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let sb = client
            .create_sandbox(CreateSandboxRequest::default())
            .await?;
        let elsewhere = sb.node == "cluster-n2";
        on.entry(sb.node.clone()).or_default().push(sb.id);
        if elsewhere {
            break;
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the drain took effect"
        );
    }
    for _ in 0..3 {
        let sb = client
            .create_sandbox(CreateSandboxRequest::default())
            .await?;
        assert_eq!(sb.node, "cluster-n2", "drained node 1 gets nothing new");
        on.entry(sb.node).or_default().push(sb.id);
    }
    client.drain_node("cluster-n1", false).await?;

    for id in on.values().flatten() {
        client.delete_sandbox(id).await?;
    }
    for node in &nodes {
        assert!(node_sandboxes(&node.url, &node.token_file)
            .await?
            .is_empty());
    }
    for node in nodes {
        node.stop()?;
    }
    // The event log tells the nodes' story: each joined, node 2 was lost and joined
    // again (restarted), node 1 was drained and opened; both left when stopped.
    let story = node_events(&client, 8).await?;
    let of = |name: &str| -> Vec<&str> {
        story
            .iter()
            .filter(|e| e.node.as_deref() == Some(name))
            .map(|e| e.kind.as_str())
            .collect()
    };
    assert_eq!(
        of("cluster-n1"),
        ["node_joined", "node_drained", "node_undrained", "node_left"],
        "{story:#?}"
    );
    assert_eq!(
        of("cluster-n2"),
        ["node_joined", "node_lost", "node_joined", "node_left"],
        "{story:#?}"
    );
    let rejoined = story
        .iter()
        .filter(|e| e.kind == dsec_wire::v1::EventKind::NodeJoined)
        .filter_map(|e| e.cause.as_deref())
        .find(|c| c.starts_with("restarted"));
    anyhow::ensure!(
        rejoined.is_some(),
        "node 2's return says it restarted: {story:#?}"
    );
    drop(etcd);
    Ok(())
}

/// The node events kept (`no_follow` replays), polled until there are `n` (within 10 s:
/// a node's departure is seen through the API server's watch).
async fn node_events(client: &Client, n: usize) -> anyhow::Result<Vec<dsec_wire::v1::Event>> {
    use futures::StreamExt as _;
    let query = dsec_wire::v1::EventQuery {
        after: Some(0),
        kind: Some("node_joined,node_lost,node_left,node_drained,node_undrained".into()),
        no_follow: true,
        ..Default::default()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let events: Vec<_> = client.events(&query).await?.collect().await;
        let events = events.into_iter().collect::<Result<Vec<_>, _>>()?;
        if events.len() >= n || std::time::Instant::now() > deadline {
            return Ok(events);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn rand_u128() -> u128 {
    let mut b = [0u8; 16];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        use std::io::Read;
        let _ = f.read_exact(&mut b);
    }
    u128::from_le_bytes(b)
}

/// A keyed create through `clients[first]`, retried (same key) on the other replica
/// after a transport failure, as the SDK does: how many attempts it took.
async fn create_with_failover(
    clients: &[Client; 2],
    first: usize,
    key: String,
) -> anyhow::Result<(dsec_wire::v1::Sandbox, usize)> {
    let req = CreateSandboxRequest {
        idempotency_key: Some(key),
        ..Default::default()
    };
    let mut at = first;
    for attempt in 1..=6 {
        match clients[at % 2].create_sandbox(req.clone()).await {
            Ok(sb) => return Ok((sb, attempt)),
            Err(dsec_client::ClientError::Http(_)) => at += 1,
            Err(e) if e.code().is_some_and(|c| c.retryable()) => {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
            Err(e) => return Err(e.into()),
        }
    }
    anyhow::bail!("create gave up")
}

#[tokio::test]
async fn killing_an_apiserver_under_create_load_fails_nothing_and_leaves_nothing(
) -> anyhow::Result<()> {
    use futures::stream::{self, StreamExt as _};
    if !require_root() {
        return Ok(());
    }
    let _turn = TURN.lock().await;
    let Some(etcd) = dsec_testkit::Etcd::start("killing_an_apiserver_under_create_load") else {
        return Ok(());
    };
    let node = start_node("split-load").await?;
    let key_file = node.root.join("api-key");
    let (a_proc, a) =
        start_replica(&node, "a", &etcd.endpoints(), "/dsec-e2e-load", &key_file).await?;
    let (_b_proc, b) =
        start_replica(&node, "b", &etcd.endpoints(), "/dsec-e2e-load", &key_file).await?;
    let tar = tokio::fs::File::open(dsec_e2e::base_tar()).await?;
    a.upload_image("base", false, tar).await?;
    const CREATES: usize = 200;
    let clients = [a.clone(), b.clone()];
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    // A is killed outright once a fifth of the creates are done, mid-load.
    let killer = {
        let done = done.clone();
        let pid = a_proc.0.id() as i32;
        tokio::spawn(async move {
            while done.load(std::sync::atomic::Ordering::Relaxed) < CREATES / 5 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            // SAFETY: kill with our own child's pid.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        })
    };
    let results: Vec<anyhow::Result<(dsec_wire::v1::Sandbox, usize)>> = stream::iter(0..CREATES)
        .map(|i| {
            let (clients, done) = (&clients, done.clone());
            async move {
                let r = create_with_failover(clients, i % 2, format!("load-{i}")).await;
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                r
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    killer.await?;
    drop(a_proc);
    let mut ids = Vec::new();
    let mut retried = 0;
    for r in results {
        let (sb, attempts) = r.context("a create failed")?;
        assert_eq!(sb.state, dsec_wire::v1::SandboxState::Ready);
        retried += usize::from(attempts > 1);
        ids.push(sb.id);
    }
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), CREATES, "one sandbox per key, none twice");
    assert!(
        retried > 0,
        "some creates were cut off by the kill and retried"
    );
    // The node runs exactly the recorded sandboxes: nothing half-made stays (a create
    // cut off after its node made the sandbox, before its record was stored, leaves an
    // orphan the reaper destroys once it saw it without a record for 15 s).
    let settled = wait_until(Duration::from_secs(40), || async {
        let on_node = node_sandboxes(&node.url, &node.token_file).await.ok()?;
        (on_node == ids).then_some(())
    })
    .await;
    assert!(
        settled.is_some(),
        "node has {:?} sandboxes, records {}",
        node_sandboxes(&node.url, &node.token_file).await?.len(),
        ids.len()
    );
    assert_eq!(listed(&b).await?, ids);
    println!("{retried} of {CREATES} creates retried on the other replica");
    let deleted: Vec<_> = stream::iter(ids.clone())
        .map(|id| {
            let b = &b;
            async move { b.delete_sandbox(&id).await }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    for d in deleted {
        d?;
    }
    assert!(node_sandboxes(&node.url, &node.token_file)
        .await?
        .is_empty());
    node.stop()?;
    drop(etcd);
    Ok(())
}

#[tokio::test]
async fn etcd_losing_a_member_or_its_quorum_loses_no_record() -> anyhow::Result<()> {
    use std::time::Instant;
    if !require_root() {
        return Ok(());
    }
    let _turn = TURN.lock().await;
    let Some(mut etcd) = dsec_testkit::Etcd::start_cluster("etcd_losing_a_member_or_its_quorum", 3)
    else {
        return Ok(());
    };
    let node = start_node("split-etcd-ha").await?;
    let key_file = node.root.join("api-key");
    let (_a_proc, a) =
        start_replica(&node, "a", &etcd.endpoints(), "/dsec-e2e-ha", &key_file).await?;
    let (_b_proc, b) =
        start_replica(&node, "b", &etcd.endpoints(), "/dsec-e2e-ha", &key_file).await?;
    let tar = tokio::fs::File::open(dsec_e2e::base_tar()).await?;
    a.upload_image("base", false, tar).await?;
    let mut ids = Vec::new();
    for c in [&a, &b, &a] {
        ids.push(
            c.create_sandbox(CreateSandboxRequest::default())
                .await
                .context("a create with 3 members")?
                .id,
        );
    }

    // One member of three dies (the API servers talk to all three). Creates go on: a
    // request caught in flight (the member led, and its followers wait out etcd's own
    // request timeout) answers `unavailable`, and the client retries it with its key, as
    // the SDK does.
    etcd.stop(0);
    let clients = [a.clone(), b.clone()];
    let started = Instant::now();
    let mut attempts = 0;
    for i in 0..3 {
        let (sb, n) = create_with_failover(&clients, i, format!("two-of-three-{i}"))
            .await
            .context("a create with 2 of 3 members")?;
        attempts += n;
        ids.push(sb.id);
    }
    println!(
        "3 creates with 2 of 3 members: {attempts} attempts, {:?}",
        started.elapsed()
    );
    ids.sort();
    // Each replica's list is its cache, which a watch fed through the member's loss.
    for c in [&a, &b] {
        let same = wait_until(Duration::from_secs(10), || async {
            (listed(c).await.ok()? == ids).then_some(())
        })
        .await;
        assert!(same.is_some(), "{:?} vs {ids:?}", listed(c).await?);
    }

    // The majority goes too: a create fails, retryable and in bounded time, and makes
    // nothing; sandboxes that exist still run commands (their records are cached).
    etcd.stop(1);
    let started = Instant::now();
    let refused = tokio::time::timeout(
        Duration::from_secs(60),
        a.create_sandbox(CreateSandboxRequest {
            idempotency_key: Some("during-the-outage".into()),
            ..Default::default()
        }),
    )
    .await
    .context("a create without quorum hangs")?
    .expect_err("no create without quorum");
    assert!(
        refused.code().is_some_and(|c| c.retryable()),
        "without quorum: {refused}"
    );
    println!(
        "a create without quorum fails after {:?}: {refused}",
        started.elapsed()
    );
    let r = b.exec(&ids[0], sh("echo still")).await?;
    assert_eq!(r.stdout, "still\n");

    // All three restart on their data (a full etcd restart): within 5 s of quorum
    // returning both API servers create again, and every record is there.
    etcd.stop(2);
    etcd.start_members(&[0, 1, 2]);
    let back = Instant::now();
    for c in [&a, &b] {
        let sb = wait_until(Duration::from_secs(5), || async {
            c.create_sandbox(CreateSandboxRequest::default()).await.ok()
        })
        .await
        .context("the API answers again within 5 s of quorum returning")?;
        ids.push(sb.id);
    }
    println!("creates again {:?} after quorum returned", back.elapsed());
    // The create cut off by the outage, retried with its key, makes one sandbox.
    let retried = a
        .create_sandbox(CreateSandboxRequest {
            idempotency_key: Some("during-the-outage".into()),
            ..Default::default()
        })
        .await?;
    ids.push(retried.id);
    ids.sort();
    for c in [&a, &b] {
        let same = wait_until(Duration::from_secs(10), || async {
            (listed(c).await.ok()? == ids).then_some(())
        })
        .await;
        assert!(same.is_some(), "{:?} vs {ids:?}", listed(c).await?);
    }
    // The create cut off by the outage kept its sandbox for the retry to find; if its
    // record never landed, the reaper destroys it once it has gone unrecorded for the
    // orphan grace (15 s).
    let settled = wait_until(Duration::from_secs(40), || async {
        let on_node = node_sandboxes(&node.url, &node.token_file).await.ok()?;
        (on_node == ids).then_some(())
    })
    .await;
    assert!(
        settled.is_some(),
        "the node runs exactly the recorded sandboxes: {:?} vs {ids:?}",
        node_sandboxes(&node.url, &node.token_file).await?
    );
    for id in &ids {
        b.delete_sandbox(id).await?;
    }
    assert!(node_sandboxes(&node.url, &node.token_file)
        .await?
        .is_empty());
    node.stop()?;
    drop(etcd);
    Ok(())
}

/// libfaketime, which shifts a process's clock (Debian: `faketime`).
const FAKETIME_LIB: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1";

#[tokio::test]
async fn a_node_whose_clock_is_ten_minutes_off_works_like_any_other() -> anyhow::Result<()> {
    use dsec_wire::v1::SandboxState;
    if !require_root() {
        return Ok(());
    }
    if !std::path::Path::new(FAKETIME_LIB).exists() {
        let why = format!("{FAKETIME_LIB} missing (apt-get install faketime)");
        anyhow::ensure!(std::env::var("CI").as_deref() != Ok("true"), "{why}");
        println!("SKIPPED: {why}");
        return Ok(());
    }
    let _turn = TURN.lock().await;
    let Some(etcd) = dsec_testkit::Etcd::start("a_node_whose_clock_is_ten_minutes_off") else {
        return Ok(());
    };
    let (root, token_file) = fleet_root("skew")?;
    let (_api, api_url, client) =
        start_fleet_apiserver(&root, &etcd, "/dsec-e2e-skew", &token_file, &[]).await?;
    let blobs = root.join("blobs").display().to_string();
    let token_arg = token_file.display().to_string();
    let node_only = [
        "--apiserver",
        api_url.as_str(),
        "--node-token-file",
        token_arg.as_str(),
    ];
    let mut nodes = Vec::new();
    for (i, (name, offset)) in [("skew-n1", None), ("skew-n2", Some("+10m"))]
        .into_iter()
        .enumerate()
    {
        let serve = cluster_node_flags(i, name, &blobs);
        let serve: Vec<&str> = serve.iter().map(String::as_str).collect();
        let env = offset
            .map(|o| {
                vec![
                    ("LD_PRELOAD".to_string(), FAKETIME_LIB.to_string()),
                    ("FAKETIME".to_string(), o.to_string()),
                ]
            })
            .unwrap_or_default();
        nodes.push(start_node_env(name, &serve, &node_only, env).await?);
    }
    // The shifted clock is real: the node's own process sees it.
    let pid = nodes[1].proc.0.id();
    let environ = std::fs::read(format!("/proc/{pid}/environ"))?;
    assert!(String::from_utf8_lossy(&environ).contains("FAKETIME=+10m"));
    until_live(&client, 2).await?;

    // Every sandbox goes to the skewed node (the other is drained).
    client.drain_node("skew-n1", true).await?;
    let tar = tokio::fs::File::open(dsec_e2e::base_tar()).await?;
    client.upload_image("base", false, tar).await?;
    let before = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?;
    let sb = wait_until(Duration::from_secs(5), || async {
        client
            .create_sandbox(CreateSandboxRequest {
                timeout_s: Some(60),
                ..Default::default()
            })
            .await
            .ok()
            .filter(|sb| sb.node == "skew-n2")
    })
    .await
    .context("a sandbox on the skewed node")?;
    // Its times are the API server's, not the node's clock.
    let now_ms = before.as_millis() as u64;
    assert!(
        sb.created_at.abs_diff(now_ms) < 30_000,
        "created_at {} vs now {now_ms}",
        sb.created_at
    );
    assert!(sb.expires_at.abs_diff(now_ms + 60_000) < 30_000);
    // Past several heartbeat leases: both nodes stay live, the sandbox stays ready (its
    // 60 s are counted on the node as a duration, not an instant 10 minutes away).
    tokio::time::sleep(Duration::from_secs(5)).await;
    let listed = client.list_nodes().await?;
    anyhow::ensure!(
        listed.nodes.iter().filter(|n| n.live).count() == 2,
        "both nodes still live: {listed:?}"
    );
    let got = client.get_sandbox(&sb.id).await?;
    assert_eq!(got.state, SandboxState::Ready);
    let r = client.exec(&sb.id, sh("echo fine")).await?;
    assert_eq!(r.stdout, "fine\n");
    client.delete_sandbox(&sb.id).await?;
    assert!(node_sandboxes(&nodes[1].url, &nodes[1].token_file)
        .await?
        .is_empty());
    for node in nodes {
        node.stop()?;
    }
    drop(etcd);
    Ok(())
}

/// Two pools of real nodes: `onprem` (its CPU capacity pinned to the machine's 2 cores
/// with `--cpu-overcommit 1`) and `cloud`, an overflow pool (`--overflow-pool cloud`).
/// Sandboxes of 0.4 cores fill the primary to its 80% threshold before the overflow
/// pool gets any; past it they overflow; with the primary's sandboxes deleted, work
/// returns to it.
#[tokio::test]
async fn creates_overflow_to_a_cloud_pool_only_past_80_percent_of_the_primary() -> anyhow::Result<()>
{
    if !require_root() {
        return Ok(());
    }
    let _turn = TURN.lock().await;
    let Some(etcd) = dsec_testkit::Etcd::start("creates_overflow_to_a_cloud_pool") else {
        return Ok(());
    };
    let (root, token_file) = fleet_root("overflow")?;
    let (_api, api_url, client) = start_fleet_apiserver(
        &root,
        &etcd,
        "/dsec-e2e-overflow",
        &token_file,
        &["--overflow-pool", "cloud", "--overflow-threshold", "0.8"],
    )
    .await?;
    let blobs = root.join("blobs").display().to_string();
    let token_arg = token_file.display().to_string();
    let node_only = [
        "--apiserver",
        api_url.as_str(),
        "--node-token-file",
        token_arg.as_str(),
    ];
    let mut nodes = Vec::new();
    for (i, (name, pool)) in [("pool-prem", "onprem"), ("pool-cloud", "cloud")]
        .into_iter()
        .enumerate()
    {
        let mut serve = cluster_node_flags(i, name, &blobs);
        if pool == "onprem" {
            serve.extend(["--cpu-overcommit".to_string(), "1".to_string()]);
        }
        let serve: Vec<&str> = serve.iter().map(String::as_str).collect();
        let label = format!("pool={pool}");
        let mut node_only = node_only.to_vec();
        node_only.extend(["--label", label.as_str()]);
        nodes.push(start_node_with(name, &serve, &node_only).await?);
    }
    let registered = until_live(&client, 2).await?;
    let prem = registered
        .nodes
        .iter()
        .find(|n| n.name == "pool-prem")
        .context("prem listed")?;
    // The API server's /metrics shows the fleet, a series per node (an admin's key).
    let key = std::fs::read_to_string(root.join("api-key"))?;
    let metrics = reqwest::Client::new()
        .get(format!("{api_url}/metrics"))
        .bearer_auth(key.trim())
        .send()
        .await?
        .error_for_status()?
        .text()
        .await?;
    for series in [
        "dsec_nodes_live 2",
        "dsec_node_live{node=\"pool-prem\",pool=\"onprem\"} 1",
        "dsec_node_live{node=\"pool-cloud\",pool=\"cloud\"} 1",
    ] {
        anyhow::ensure!(metrics.lines().any(|l| l == series), "{series}:\n{metrics}");
    }
    // `--cpu-overcommit 1`: the primary holds its cores' worth of sandboxes.
    let capacity = prem.cpu_millis;
    anyhow::ensure!(
        capacity >= 1_000 && capacity % 1_000 == 0 && capacity <= 64_000,
        "the primary's capacity is its cores: {capacity}"
    );
    let tar = tokio::fs::File::open(dsec_e2e::base_tar()).await?;
    client.upload_image("base", false, tar).await?;
    let small = || CreateSandboxRequest {
        resources: dsec_wire::v1::Resources {
            cpu: Some(0.4),
            memory_mb: Some(64),
            ..Default::default()
        },
        ..Default::default()
    };
    // 0.4 cores each: on 2 cores, four take the primary to 80%, the next ones overflow.
    let fill = (capacity * 8 / 10).div_ceil(400) as usize;
    let mut placed: Vec<(String, String)> = Vec::new();
    for _ in 0..fill + 2 {
        let sb = client.create_sandbox(small()).await?;
        placed.push((sb.id, sb.node));
        // The next placement must see the primary as its node reports it, not this
        // create's reservation on top of that: wait for the heartbeat to count it, then
        // for the reservation to lapse (`RESERVATION_LINGER`, 2 s, which no API shows).
        let on_prem = placed.iter().filter(|(_, n)| n == "pool-prem").count() as u64;
        wait_until(Duration::from_secs(10), || async {
            let listed = client.list_nodes().await.ok()?;
            let prem = listed.nodes.iter().find(|n| n.name == "pool-prem")?;
            (prem.cpu_millis_used == on_prem * 400).then_some(())
        })
        .await
        .context("the primary's heartbeat counts its sandboxes")?;
        tokio::time::sleep(Duration::from_millis(2_200)).await;
    }
    let on: Vec<&str> = placed.iter().map(|(_, n)| n.as_str()).collect();
    assert_eq!(on[..fill], vec!["pool-prem"; fill][..], "{on:?}");
    assert_eq!(on[fill..], ["pool-cloud"; 2], "{on:?}");
    for (i, node) in nodes.iter().enumerate() {
        let mut mine: Vec<String> = placed
            .iter()
            .filter(|(_, n)| *n == ["pool-prem", "pool-cloud"][i])
            .map(|(id, _)| id.clone())
            .collect();
        mine.sort();
        assert_eq!(node_sandboxes(&node.url, &node.token_file).await?, mine);
    }
    let (overflowed, _) = &placed[fill];
    let r = client.exec(overflowed, sh("echo on the cloud")).await?;
    assert_eq!(r.stdout, "on the cloud\n");
    // The primary's sandboxes go: once its heartbeat says so, work returns to it.
    for (id, node) in &placed {
        if node == "pool-prem" {
            client.delete_sandbox(id).await?;
        }
    }
    placed.retain(|(_, n)| n != "pool-prem");
    let back = wait_until(Duration::from_secs(10), || async {
        let sb = client.create_sandbox(small()).await.ok()?;
        let home = sb.node == "pool-prem";
        client.delete_sandbox(&sb.id).await.ok()?;
        home.then_some(())
    })
    .await;
    anyhow::ensure!(back.is_some(), "work returns to the primary");
    for (id, _) in &placed {
        client.delete_sandbox(id).await?;
    }
    for node in &nodes {
        assert!(node_sandboxes(&node.url, &node.token_file)
            .await?
            .is_empty());
    }
    for node in nodes {
        node.stop()?;
    }
    drop(etcd);
    Ok(())
}

/// Traces cross processes: the API server's request span, the node's `node_call` span
/// (its child, sent by another service) and the command's `TRACEPARENT` are one trace,
/// the caller's.
#[tokio::test]
async fn a_trace_crosses_from_the_apiserver_to_the_node_and_its_commands() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let _turn = TURN.lock().await;
    let collector = dsec_testkit::OtlpCollector::start().await?;
    let endpoint = collector.url();
    let node = start_node_with("split-trace", &["--otlp-endpoint", &endpoint], &[]).await?;
    let api_dir = node.root.join("apiserver");
    let api_port = free_port()?;
    let _api = spawn(
        &[
            "apiserver".into(),
            "--listen".into(),
            format!("127.0.0.1:{api_port}"),
            "--state-dir".into(),
            api_dir.display().to_string(),
            "--node".into(),
            node.url.clone(),
            "--node-token-file".into(),
            node.token_file.display().to_string(),
            "--otlp-endpoint".into(),
            endpoint.clone(),
        ],
        &node.root.join("apiserver.log"),
    )?;
    let api_url = format!("http://127.0.0.1:{api_port}");
    let client = api_client(&api_url, &api_dir.join("api-key")).await?;
    let tar = tokio::fs::File::open(dsec_e2e::base_tar()).await?;
    client.upload_image("base", false, tar).await?;
    let sb = client
        .create_sandbox(CreateSandboxRequest::default())
        .await?;

    let (trace, caller_span) = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331");
    let key = std::fs::read_to_string(api_dir.join("api-key"))?;
    let resp = reqwest::Client::new()
        .post(format!("{api_url}/v1/sandboxes/{}/exec", sb.id))
        .header("x-api-key", key.trim())
        .header("x-request-id", "split-trace-1")
        .header("traceparent", format!("00-{trace}-{caller_span}-01"))
        .json(&serde_json::json!({"cmd": "echo $TRACEPARENT"}))
        .send()
        .await?;
    anyhow::ensure!(resp.status().is_success(), "exec: {}", resp.status());
    let out: serde_json::Value = resp.json().await?;
    let stdout = out["stdout"]
        .as_str()
        .unwrap_or_default()
        .trim()
        .to_string();

    let of_request = |s: &dsec_testkit::ReceivedSpan, name: &str| {
        s.name == name
            && s.attributes.get("request_id").map(String::as_str) == Some("split-trace-1")
    };
    let spans = wait_until(Duration::from_secs(30), || {
        let spans = collector.spans();
        let done = spans.iter().any(|s| of_request(s, "request"))
            && spans.iter().any(|s| of_request(s, "node_call"));
        async move { done.then_some(spans) }
    })
    .await
    .with_context(|| format!("spans: {:#?}", collector.spans()))?;
    let request = spans
        .iter()
        .find(|s| of_request(s, "request"))
        .context("request span")?;
    assert_eq!(request.service, "dsec-apiserver");
    assert_eq!(
        (request.trace_id.as_str(), request.parent_span_id.as_str()),
        (trace, caller_span)
    );
    // The node's span of the exec: another service, the same trace, under the API
    // server's span of the request.
    let node_call = spans
        .iter()
        .find(|s| {
            of_request(s, "node_call")
                && s.attributes
                    .get("path")
                    .is_some_and(|p| p.ends_with("/exec"))
        })
        .with_context(|| format!("the node's exec span: {spans:#?}"))?;
    assert_eq!(node_call.service, "dsec-node");
    assert_eq!(node_call.trace_id, trace);
    assert!(
        spans.iter().any(|s| s.span_id == node_call.parent_span_id
            && s.trace_id == trace
            && s.service == "dsec-apiserver"),
        "the node's span has an API server span of the trace as parent: {spans:#?}"
    );
    // The command runs under the node's span of the call.
    assert_eq!(
        stdout,
        format!("00-{trace}-{}-01", node_call.span_id),
        "{spans:#?}"
    );
    client.delete_sandbox(&sb.id).await?;
    Ok(())
}

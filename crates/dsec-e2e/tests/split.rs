//! `dsec node` and `dsec apiserver` as separate processes: the public API served by one
//! process over a node runtime in another, through the internal API and its token.

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
    // Fresh directories for the node (an embedded server's start cleans up after an
    // earlier run of this test).
    let mut embedded = Server::start("split", true).await?;
    embedded
        .terminate(Duration::from_secs(30))
        .context("the embedded server did not stop")?;
    let root = embedded.state_dir.parent().context("root")?.to_path_buf();

    // A private registry the node pulls from with its own credentials.
    let Some(registry) = dsec_testkit::Registry::start_with_auth("split", "node", "pw") else {
        return Ok(());
    };
    let registry_auth = root.join("registry-auth.json");
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
    let marker_tar = root.join("marker.tar");
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
    let layout =
        dsec_testkit::oci_layout(&root.join("marker-layout"), &[&marker_tar], "amd64", &[]);
    registry.seed(&layout, "remote/marker:v1", "gzip");

    let node_port = free_port()?;
    let node_url = format!("http://127.0.0.1:{node_port}");
    let mut node = spawn(
        &[
            "node".into(),
            "--registry-auth".into(),
            registry_auth.display().to_string(),
            "--listen".into(),
            format!("127.0.0.1:{node_port}"),
            "--state-dir".into(),
            embedded.state_dir.display().to_string(),
            "--run-dir".into(),
            embedded.run_dir.display().to_string(),
            "--cgroup-parent".into(),
            dsec_e2e::TEST_CGROUP_PARENT.into(),
        ],
        &root.join("node.log"),
    )?;
    let token_file = embedded.state_dir.join("node-token");
    let info = wait_until(Duration::from_secs(30), || {
        let (url, token_file) = (node_url.clone(), token_file.clone());
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
    anyhow::ensure!(info.is_some(), "dsec node did not come up");
    // The internal API refuses callers without the node token, users' keys included.
    let refused = reqwest::Client::new()
        .get(format!("{node_url}/node/v1/sandboxes"))
        .bearer_auth(&embedded.key)
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
    // SAFETY: as above.
    unsafe { libc::kill(node.0.id() as i32, libc::SIGTERM) };
    let status = node.0.wait()?;
    assert!(status.success(), "dsec node exit: {status:?}");
    Ok(())
}

//! Registry pulls through the whole server: `dsec serve --registry-auth FILE` pulls the
//! base image from a private registry (Debian's docker-registry on loopback, basic auth)
//! with streamed progress, and a sandbox runs on the pulled image; creates naming a
//! reference not pulled yet pull it once however many ask at once; registries not
//! allowed (`--allow-registry`) are refused.

use std::os::unix::fs::PermissionsExt;

use dsec_e2e::{require_root, sh, Server};
use dsec_testkit::{oci_layout, Registry};
use dsec_wire::v1::{CreateSandboxRequest, ImportEvent, PullImageRequest};
use dsec_wire::ErrorCode;
use futures::StreamExt;

async fn pull(
    c: &dsec_client::Client,
    reference: &str,
) -> Result<Vec<ImportEvent>, dsec_client::ClientError> {
    let mut s = c
        .pull_image_stream(PullImageRequest {
            reference: reference.into(),
            name: None,
            insecure: true,
        })
        .await?;
    let mut out = Vec::new();
    while let Some(ev) = s.next().await {
        out.push(ev?);
    }
    Ok(out)
}

#[tokio::test]
async fn server_pulls_from_a_private_registry_and_runs_the_image() {
    if !require_root() {
        return;
    }
    let Some(reg) = Registry::start_with_auth("registry e2e", "ci", "s3cret") else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let base = dsec_e2e::base_tar();
    let layout = oci_layout(
        &dir.path().join("layout"),
        &[&base],
        "amd64",
        &["FROM=registry"],
    );
    reg.seed(&layout, "dsec/base:bookworm", "zstd");

    let auth = dir.path().join("registry-auth.json");
    std::fs::write(
        &auth,
        format!(
            r#"{{"{}": {{"username": "ci", "password": "s3cret"}}}}"#,
            reg.addr()
        ),
    )
    .expect("write the credentials file");
    std::fs::set_permissions(&auth, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let s = Server::start_with(
        "registry",
        true,
        &[
            "--cgroup-parent",
            "dsec-registry",
            "--no-network",
            "--disk-pool",
            "1",
            "--registry-auth",
            &auth.display().to_string(),
            "--allow-registry",
            &reg.addr(),
        ],
    )
    .await
    .expect("server");
    let c = s.client();

    // A reference that does not parse is refused before any stream starts.
    let e = pull(&c, "no spaces/allowed")
        .await
        .expect_err("bad reference");
    assert_eq!(e.code(), Some(ErrorCode::BadRequest), "{e}");

    let reference = format!("{}/dsec/base:bookworm", reg.addr());
    let events = pull(&c, &reference).await.expect("pull stream");
    let phases: Vec<&str> = events
        .iter()
        .filter_map(|e| match e {
            ImportEvent::Progress { phase, .. } => Some(phase.as_str()),
            _ => None,
        })
        .collect();
    for want in [
        "resolving",
        "downloading",
        "extracting",
        "building",
        "storing",
    ] {
        assert!(phases.contains(&want), "no {want} progress in {phases:?}");
    }
    let Some(ImportEvent::Done { image }) = events.last() else {
        panic!("last event is not done: {:?}", events.last());
    };
    assert_eq!(image.name, reference);
    assert_eq!(
        image.config.env.get("FROM").map(String::as_str),
        Some("registry")
    );

    let sb = c
        .create_sandbox(CreateSandboxRequest {
            image: Some(reference.clone()),
            ..Default::default()
        })
        .await
        .expect("create from the pulled image");
    let r = c
        .exec(&sb.id, sh("cat /etc/os-release; echo FROM=$FROM"))
        .await
        .expect("exec");
    assert_eq!(r.exit.exit_code, Some(0), "{r:?}");
    assert!(r.stdout.contains("bookworm"), "{}", r.stdout);
    assert!(
        r.stdout.contains("FROM=registry"),
        "image env applies: {}",
        r.stdout
    );
    c.delete_sandbox(&sb.id).await.expect("delete");

    // A repository the registry does not have: the stream ends with a clear error.
    let missing = format!("{}/dsec/nothing:here", reg.addr());
    let events = pull(&c, &missing).await.expect("stream");
    match events.last() {
        Some(ImportEvent::Error { error }) => {
            assert_eq!(error.code, ErrorCode::ImageNotFound, "{error:?}")
        }
        other => panic!("expected an error, got {other:?}"),
    }
    let names: Vec<String> = c
        .list_images()
        .await
        .expect("list")
        .images
        .into_iter()
        .map(|i| i.name)
        .collect();
    assert!(!names.contains(&missing), "{names:?}");
}

/// The registry's count of `GET path` once it has logged one (it logs a request as it
/// finishes answering, a moment after the client has the bytes).
async fn logged_gets(reg: &Registry, path: &str) -> usize {
    dsec_e2e::wait_until(std::time::Duration::from_secs(10), || async {
        Some(reg.requests("GET", path)).filter(|n| *n > 0)
    })
    .await
    .unwrap_or(0)
}

#[tokio::test]
async fn creates_naming_a_registry_reference_pull_it_once() {
    if !require_root() {
        return;
    }
    let Some(reg) = Registry::start("registry create e2e") else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let layout = oci_layout(
        &dir.path().join("layout"),
        &[&dsec_e2e::base_tar()],
        "amd64",
        &["FROM=create"],
    );
    reg.seed(&layout, "dsec/app:v1", "gzip");
    let (m, _) = reg.manifest("dsec/app", "v1");
    let layer = m["layers"][0]["digest"].as_str().expect("layer digest");
    let s = Server::start_with(
        "registry-create",
        true,
        &[
            "--cgroup-parent",
            "dsec-registry-create",
            "--no-network",
            "--disk-pool",
            "1",
            "--allow-registry",
            &reg.addr(),
            "--insecure-registry",
            &reg.addr(),
        ],
    )
    .await
    .expect("server");
    let c = s.client();
    let small = |image: String| CreateSandboxRequest {
        image: Some(image),
        resources: dsec_wire::v1::Resources {
            cpu: Some(0.1),
            memory_mb: Some(64),
            ..Default::default()
        },
        ..Default::default()
    };

    // 16 creates of a reference no node has: one pull, every create gets a sandbox of it.
    let reference = format!("{}/dsec/app:v1", reg.addr());
    let creates = (0..16).map(|_| c.create_sandbox(small(reference.clone())));
    let sandboxes: Vec<_> = futures::future::join_all(creates)
        .await
        .into_iter()
        .map(|r| r.expect("create naming a registry reference"))
        .collect();
    assert_eq!(
        logged_gets(&reg, &format!("/v2/dsec/app/blobs/{layer}")).await,
        1,
        "the layer was fetched once for 16 creates"
    );
    assert!(sandboxes.iter().all(|sb| sb.image == reference));
    let r = c
        .exec(&sandboxes[0].id, sh("echo FROM=$FROM"))
        .await
        .expect("exec");
    assert!(r.stdout.contains("FROM=create"), "{r:?}");
    for sb in &sandboxes {
        c.delete_sandbox(&sb.id).await.expect("delete");
    }

    // By digest: the catalog name has `:` for `@`.
    let (_, digest) = reg.manifest("dsec/app", "v1");
    let pinned = format!("{}/dsec/app@{digest}", reg.addr());
    let sb = c
        .create_sandbox(small(pinned.clone()))
        .await
        .expect("create by digest");
    assert_eq!(sb.image, pinned.replace('@', ":"));
    c.delete_sandbox(&sb.id).await.expect("delete");

    // Layers may be registry references too: pulled like the image, stacked on it.
    let tool = dsec_testkit::layer_tar(dir.path(), "tool", 4 << 10);
    let tool_layout = oci_layout(&dir.path().join("tool"), &[&tool], "amd64", &[]);
    reg.seed(&tool_layout, "dsec/tool:v1", "zstd");
    let (_, tool_digest) = reg.manifest("dsec/tool", "v1");
    let tool_ref = format!("{}/dsec/tool@{tool_digest}", reg.addr());
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            layers: vec![tool_ref.clone()],
            ..small(reference.clone())
        })
        .await
        .expect("create with a registry layer");
    assert_eq!(sb.layers, vec![tool_ref.replace('@', ":")]);
    let r = c
        .exec(
            &sb.id,
            sh("grep ^ID= /etc/os-release; test -s /data && echo FROM=$FROM"),
        )
        .await
        .expect("exec");
    assert_eq!(r.stdout, "ID=tool\nFROM=create\n", "{r:?}");
    c.delete_sandbox(&sb.id).await.expect("delete");

    // A failed pull fails every create waiting for it, clearly, and leaves nothing.
    let missing = format!("{}/dsec/app:missing", reg.addr());
    let creates = (0..4).map(|_| c.create_sandbox(small(missing.clone())));
    for r in futures::future::join_all(creates).await {
        let e = r.expect_err("no such tag");
        assert_eq!(e.code(), Some(ErrorCode::ImageNotFound), "{e}");
        assert!(
            e.to_string().contains("pulling it from its registry"),
            "{e}"
        );
    }
    assert_eq!(
        logged_gets(&reg, "/v2/dsec/app/manifests/missing").await,
        1,
        "one pull for the 4 failed creates"
    );
    let images = c.list_images().await.expect("list").images;
    assert!(images.iter().all(|i| i.name != missing), "{images:?}");
    let left = c.list_sandboxes(Default::default()).await.expect("list");
    assert!(left.sandboxes.is_empty(), "{left:?}");

    // Registries not named by --allow-registry are refused before any request: a
    // loopback one and (with names given, public ones need `public`) any other.
    for refused in [
        "127.0.0.1:1/x/y:z",
        "169.254.169.254/latest/x:y",
        "8.8.8.8/x/y:z",
    ] {
        let e = c
            .create_sandbox(small(refused.into()))
            .await
            .expect_err("not allowed");
        assert_eq!(e.code(), Some(ErrorCode::Forbidden), "{e}");
        assert!(e.to_string().contains("--allow-registry"), "{e}");
    }
}

//! Registry pulls through the whole server: `dsec serve --registry-auth FILE` pulls the
//! base image from a private registry (Debian's docker-registry on loopback, basic auth)
//! with streamed progress, and a sandbox runs on the pulled image.

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

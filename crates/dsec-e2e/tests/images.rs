//! Image imports through the API: the progress stream the CLI draws its bar from.

use dsec_e2e::{require_root, Server};
use dsec_wire::v1::{ImportEvent, ImportImageRequest};
use dsec_wire::ErrorCode;
use futures::StreamExt;

async fn collect(
    c: &dsec_client::Client,
    name: &str,
    source: &str,
) -> Result<Vec<ImportEvent>, dsec_client::ClientError> {
    let mut s = c
        .import_image_stream(ImportImageRequest {
            name: name.into(),
            source: source.into(),
            flatten: false,
        })
        .await?;
    let mut out = Vec::new();
    while let Some(ev) = s.next().await {
        out.push(ev?);
    }
    Ok(out)
}

#[tokio::test]
async fn import_streams_progress_then_the_image_or_the_error() {
    if !require_root() {
        return;
    }
    let s = Server::start_with(
        "images",
        true,
        &[
            "--cgroup-parent",
            "dsec-images",
            "--no-network",
            "--disk-pool",
            "1",
        ],
    )
    .await
    .expect("server");
    let c = s.client();

    // 24 MiB that does not compress, so building and hashing take measurable time.
    let dir = tempfile::tempdir().expect("tempdir");
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for i in 0..24 {
        let data: Vec<u8> = (0..(1 << 20))
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        std::fs::write(dir.path().join(format!("f{i}")), data).expect("write");
    }
    let events = collect(&c, "stream/test", &dir.path().display().to_string())
        .await
        .expect("import stream");
    let phases: Vec<&str> = events
        .iter()
        .filter_map(|e| match e {
            ImportEvent::Progress { phase, .. } => Some(phase.as_str()),
            _ => None,
        })
        .collect();
    for want in ["building", "hashing", "storing"] {
        assert!(phases.contains(&want), "no {want} progress in {phases:?}");
    }
    let hashed_total = events.iter().find_map(|e| match e {
        ImportEvent::Progress {
            phase,
            bytes_total: Some(t),
            ..
        } if phase == "hashing" => Some(*t),
        _ => None,
    });
    let Some(ImportEvent::Done { image }) = events.last() else {
        panic!("last event is not done: {:?}", events.last());
    };
    assert_eq!(image.name, "stream/test");
    assert_eq!(hashed_total, Some(image.size_bytes));
    let listed = c.list_images().await.expect("list");
    assert!(listed.images.iter().any(|i| i.name == "stream/test"));

    // A source that is not there is the caller's mistake, answered before any stream
    // starts (a 200 then an error event would be an error after the headers).
    let e = collect(&c, "stream/missing", "/nonexistent/rootfs.tar")
        .await
        .expect_err("missing source");
    assert_eq!(e.code(), Some(ErrorCode::BadRequest), "{e}");
    assert!(e.to_string().contains("/nonexistent/rootfs.tar"), "{e}");
    // A relative path is refused before any stream starts.
    let e = collect(&c, "stream/rel", "rootfs.tar")
        .await
        .expect_err("relative source");
    assert_eq!(e.code(), Some(ErrorCode::BadRequest), "{e}");
    let listed = c.list_images().await.expect("list");
    assert_eq!(listed.images.len(), 1, "{:?}", listed.images);
}

//! Two nodes sharing one S3-compatible blob store (moto on loopback): an image imported on
//! one node runs on the other, the second node's layer cache stays within its limit
//! without ever evicting a mounted layer, removals and GC reach the whole cluster, and a
//! corrupt layer in the store is refused with a clear error.

use std::path::Path;
use std::time::Duration;

use dsec_e2e::s3::{server_bin, S3Server};
use dsec_e2e::{dir_bytes, require_root, sh, Server};
use dsec_wire::v1::{CreateSandboxRequest, GcRequest, ImportImageRequest};

fn blobs(state: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(state.join("images/blobs/sha256"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".erofs"))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Image `name` as node `c` lists it.
async fn image(c: &dsec_client::Client, name: &str) -> dsec_wire::v1::Image {
    c.list_images()
        .await
        .expect("list images")
        .images
        .into_iter()
        .find(|i| i.name == name)
        .unwrap_or_else(|| panic!("image {name} not listed"))
}

/// The image names node `c` lists.
async fn image_names(c: &dsec_client::Client) -> Vec<String> {
    c.list_images()
        .await
        .expect("list images")
        .images
        .into_iter()
        .map(|i| i.name)
        .collect()
}

fn create_req(layers: &[&str]) -> CreateSandboxRequest {
    CreateSandboxRequest {
        image: Some("base".into()),
        layers: layers.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_share_images_through_s3() {
    if !require_root() {
        return;
    }
    let Some(bin) = server_bin() else { return };
    let s3 = S3Server::start(&bin).expect("S3 server");
    s3.create_bucket("dsec").expect("bucket");
    // The nodes inherit the credentials.
    for (k, v) in s3.env() {
        std::env::set_var(k, v);
    }
    let store_url = s3.store_url("dsec", "cluster");
    let node_args = |parent: &'static str, cache_mb: &'static str| {
        vec![
            "--blob-store".to_string(),
            store_url.clone(),
            "--layer-cache-mb".into(),
            cache_mb.into(),
            "--cgroup-parent".into(),
            parent.into(),
            "--disk-pool".into(),
            "1".into(),
            "--no-network".into(),
            // Removals and re-points on one node must show on the others at once here.
            "--ref-cache-ms".into(),
            "0".into(),
        ]
    };
    let a_args = node_args("dsec-shared-a", "0");
    let a_args: Vec<&str> = a_args.iter().map(String::as_str).collect();
    let a = Server::start_with("shared-a", true, &a_args)
        .await
        .expect("node a");
    a.ensure_base(None).await.expect("base on a");
    let ca = a.client();

    // A toolkit layer, imported on node A.
    let tool = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(tool.path().join("opt/tool")).expect("mkdir");
    std::fs::write(tool.path().join("opt/tool/hello.txt"), "hello from a\n").expect("write");
    let tool_img = ca
        .import_image(ImportImageRequest {
            name: "toolkit/hello:1".into(),
            source: tool.path().display().to_string(),
            flatten: false,
        })
        .await
        .expect("import tool");

    // Node B starts empty, with a cache far smaller than the base layer.
    let b_args = node_args("dsec-shared-b", "1");
    let b_args: Vec<&str> = b_args.iter().map(String::as_str).collect();
    let b = Server::start_with("shared-b", true, &b_args)
        .await
        .expect("node b");
    let cb = b.client();
    assert!(blobs(&b.state_dir).is_empty());
    let names: Vec<String> = image_names(&cb).await;
    assert!(
        names.contains(&"base".to_string()) && names.contains(&"toolkit/hello:1".to_string()),
        "node b sees {names:?}"
    );

    // B runs a sandbox of A's images: it downloads both layers and keeps them while mounted.
    let sb = cb
        .create_sandbox(create_req(&["toolkit/hello:1"]))
        .await
        .expect("create on b");
    let out = cb
        .exec(
            &sb.id,
            sh("cat /opt/tool/hello.txt; cat /etc/debian_version"),
        )
        .await
        .expect("exec");
    assert_eq!(out.exit.exit_code, Some(0), "{out:?}");
    assert!(out.stdout.starts_with("hello from a\n"), "{out:?}");
    assert_eq!(blobs(&b.state_dir).len(), 2, "both layers cached on b");
    let gc = cb.gc_images(&GcRequest::default()).await.expect("gc on b");
    assert!(gc.evicted.is_empty(), "mounted layers evicted: {gc:?}");
    assert_eq!(blobs(&b.state_dir).len(), 2);

    // Unused, the least recently used go until the cache fits its limit: the base layer
    // (used first) goes, the small toolkit layer fits and stays. A new sandbox fetches
    // the base again.
    cb.delete_sandbox(&sb.id).await.expect("delete");
    let tool_file = format!("{}.erofs", tool_img.digest.trim_start_matches("sha256:"));
    let gc = cb.gc_images(&GcRequest::default()).await.expect("gc on b");
    assert_eq!(gc.evicted.len(), 1, "{gc:?}");
    assert!(gc.evicted_bytes > 1 << 20, "{gc:?}");
    assert_eq!(blobs(&b.state_dir), vec![tool_file.clone()]);
    let sb = cb
        .create_sandbox(create_req(&["toolkit/hello:1"]))
        .await
        .expect("create again on b");
    let out = cb
        .exec(&sb.id, sh("cat /opt/tool/hello.txt"))
        .await
        .expect("exec");
    assert_eq!(out.stdout, "hello from a\n");
    cb.delete_sandbox(&sb.id).await.expect("delete");

    // Node C serves layers on demand: nothing is downloaded whole, and booting a
    // sandbox and reading two files fetches a small part of the base layer.
    let mut c_args = node_args("dsec-shared-c", "0");
    c_args.push("--lazy-layers".into());
    let c_args: Vec<&str> = c_args.iter().map(String::as_str).collect();
    let mut c = Server::start_with("shared-c", true, &c_args)
        .await
        .expect("node c");
    let cc = c.client();
    let sb = cc
        .create_sandbox(create_req(&["toolkit/hello:1"]))
        .await
        .expect("create on c");
    let out = cc
        .exec(&sb.id, sh("cat /opt/tool/hello.txt /etc/debian_version"))
        .await
        .expect("exec on c");
    assert_eq!(out.exit.exit_code, Some(0), "{out:?}");
    assert!(out.stdout.starts_with("hello from a\n"), "{out:?}");
    assert!(
        blobs(&c.state_dir).is_empty(),
        "node c downloaded layers whole"
    );
    let base_size = image(&ca, "base").await.size_bytes;
    let chunks = dir_bytes(&c.state_dir.join("images/chunks"));
    assert!(chunks > 0, "no chunks fetched");
    assert!(
        chunks * 4 < base_size,
        "fetched {chunks} of a {base_size}-byte base layer"
    );
    // The API accounts for it per layer.
    let stats = cc.layer_stats().await.expect("layer stats");
    let base_digest = image(&ca, "base").await.digest;
    let base_stats = stats
        .lazy
        .iter()
        .find(|l| l.digest == base_digest)
        .expect("base served on demand");
    assert!(base_stats.fetched_bytes > 0 && base_stats.fetched_bytes * 4 < base_size);
    assert_eq!(base_stats.faults, 0);
    assert!(base_stats.mean_fetch_us > 0);
    assert_eq!(
        stats.node.fetched_bytes,
        stats.lazy.iter().map(|l| l.fetched_bytes).sum::<u64>()
    );
    assert!(stats.node.chunk_cache_bytes >= stats.node.fetched_bytes);
    assert_eq!(
        base_stats.fetch_latency_ms.iter().map(|b| b.1).sum::<u64>(),
        base_stats.fetched_chunks
    );
    // ... and in Prometheus text, behind the API key.
    let http = reqwest::Client::new();
    let metrics = http
        .get(format!("{}/metrics", c.url))
        .bearer_auth(&c.key)
        .send()
        .await
        .expect("GET /metrics");
    assert!(metrics.status().is_success());
    let text = metrics.text().await.expect("metrics text");
    let series = format!("dsec_lazy_fetched_bytes_total{{layer=\"{base_digest}\"}} ");
    let value: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix(&series)?.parse().ok())
        .unwrap_or_else(|| panic!("no {series} in {text}"));
    assert!(value >= base_stats.fetched_bytes);
    assert!(text.contains("dsec_lazy_fetch_duration_seconds_bucket{"));
    let anonymous = http
        .get(format!("{}/metrics", c.url))
        .send()
        .await
        .expect("GET /metrics");
    assert_eq!(anonymous.status(), reqwest::StatusCode::UNAUTHORIZED);

    // The daemon crashes and restarts: the lazy layer server outlives it, so the running
    // sandbox reads data nobody fetched yet, byte-identical to a local layer's.
    let servers = dsec_e2e::lazy_server_pids(&c.state_dir);
    assert_eq!(servers.len(), 1, "{servers:?}");
    let digest_cmd =
        "find /usr/share/perl5 /usr/share/zoneinfo -type f | sort | xargs cat | sha256sum";
    let sa = ca
        .create_sandbox(create_req(&["toolkit/hello:1"]))
        .await
        .expect("create on a");
    let want = ca.exec(&sa.id, sh(digest_cmd)).await.expect("exec on a");
    assert_eq!(want.exit.exit_code, Some(0), "{want:?}");
    ca.delete_sandbox(&sa.id).await.expect("delete on a");
    let fetched_before = dir_bytes(&c.state_dir.join("images/chunks"));
    c.kill();
    c.spawn().await.expect("restart node c");
    let cc = c.client();
    assert_eq!(
        dsec_e2e::lazy_server_pids(&c.state_dir),
        servers,
        "server replaced"
    );
    assert!(c.log().contains("adopted the running lazy layer server"));
    let got = cc
        .exec(&sb.id, sh(digest_cmd))
        .await
        .expect("exec after restart");
    assert_eq!(got.exit.exit_code, Some(0), "{got:?}");
    assert_eq!(got.stdout, want.stdout);
    assert!(dir_bytes(&c.state_dir.join("images/chunks")) > fetched_before);
    let stats = cc.layer_stats().await.expect("layer stats after restart");
    assert!(stats.lazy.iter().any(|l| l.digest == base_digest));

    // The lazy layer server itself dies: its mount is gone for good. The running sandbox
    // gets EIO for what it had not read (never a hang), the next daemon start says so and
    // starts a new server, and new sandboxes work.
    for pid in &servers {
        // SAFETY: kill with a pid and a signal.
        unsafe { libc::kill(*pid, libc::SIGKILL) };
    }
    let started = std::time::Instant::now();
    let lost = cc
        .exec(
            &sb.id,
            sh("cat /usr/share/common-licenses/GPL-3 /usr/bin/perl* > /dev/null"),
        )
        .await
        .expect("exec after the server died");
    assert_ne!(lost.exit.exit_code, Some(0), "{lost:?}");
    assert!(started.elapsed() < Duration::from_secs(30));
    cc.delete_sandbox(&sb.id).await.expect("delete on c");
    c.kill();
    c.spawn().await.expect("restart node c");
    let cc = c.client();
    assert!(c.log().contains("lazy layer server died"), "{}", c.log());
    let sb = cc
        .create_sandbox(create_req(&["toolkit/hello:1"]))
        .await
        .expect("create on c after a new lazy layer server");
    let got = cc.exec(&sb.id, sh(digest_cmd)).await.expect("exec");
    assert_eq!(got.stdout, want.stdout);
    cc.delete_sandbox(&sb.id).await.expect("delete on c");

    // A removal on A reaches B, also where B holds a local copy of the ref.
    ca.delete_image("toolkit/hello:1")
        .await
        .expect("remove on a");
    let names: Vec<String> = image_names(&cb).await;
    assert!(!names.contains(&"toolkit/hello:1".to_string()), "{names:?}");
    let err = cb
        .create_sandbox(create_req(&["toolkit/hello:1"]))
        .await
        .expect_err("removed image");
    assert!(err.to_string().contains("toolkit/hello:1"), "{err}");
    assert!(
        !blobs(&b.state_dir).contains(&tool_file),
        "the removed image's layer stayed"
    );

    // GC of the shared store deletes the layer no image uses, and only that one.
    let gc = cb
        .gc_images(&GcRequest {
            shared_store: true,
            shared_grace_s: Some(0),
            ..Default::default()
        })
        .await
        .expect("shared gc");
    assert_eq!(gc.shared_deleted, vec![tool_img.digest.clone()], "{gc:?}");
    let store = dsec_blob::open(&store_url).expect("open store");
    let hex = tool_img.digest.trim_start_matches("sha256:");
    assert!(store
        .head(&dsec_image::shared::blob_key(hex))
        .expect("head")
        .is_none());

    // A corrupt layer in the store is refused, not mounted.
    let base = image(&cb, "base").await;
    // Every uploaded layer carries the chunk index on-demand loading verifies against.
    let manifest: dsec_image::shared::LayerManifest = serde_json::from_slice(
        &store
            .get(&dsec_image::shared::manifest_key(
                base.digest.trim_start_matches("sha256:"),
            ))
            .expect("get manifest")
            .expect("manifest in store"),
    )
    .expect("manifest json");
    let index = manifest.chunk_index().expect("chunk index");
    // ... and the chunks of its metadata when they are few enough to fetch up front (in
    // this base image, inodes sit next to their data all over the layer: none listed).
    assert!(
        index.meta.len() * 8 <= index.chunks.len(),
        "{} of {}",
        index.meta.len(),
        index.chunks.len()
    );
    assert_eq!(index.size, manifest.size);
    assert_eq!(
        index.chunks.len() as u64,
        manifest.size.div_ceil(index.chunk_size)
    );

    let base_hex = base.digest.trim_start_matches("sha256:").to_string();
    let key = dsec_image::shared::blob_key(&base_hex);
    let good = store.get(&key).expect("get").expect("base layer in store");
    let mut bad = good.clone();
    bad[4096] ^= 0xff;
    store.put(&key, &bad).expect("corrupt");
    cb.gc_images(&GcRequest::default()).await.expect("gc on b");
    assert!(blobs(&b.state_dir).is_empty());
    let err = cb
        .create_sandbox(create_req(&[]))
        .await
        .expect_err("corrupt layer");
    assert!(err.to_string().contains("digest"), "{err}");
    assert!(blobs(&b.state_dir).is_empty(), "a corrupt layer was kept");
    let tmp_left = std::fs::read_dir(b.state_dir.join("images/tmp"))
        .expect("tmp")
        .count();
    assert_eq!(tmp_left, 0, "a failed download left files");
    store.put(&key, &good).expect("repair");
    let sb = cb.create_sandbox(create_req(&[])).await.expect("create");
    cb.delete_sandbox(&sb.id).await.expect("delete");
}

#[test]
fn serve_refuses_an_unusable_blob_store() {
    if !require_root() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let out = std::process::Command::new(dsec_e2e::dsec_bin())
        .args([
            "serve",
            "--listen",
            "127.0.0.1:1",
            "--blob-store",
            "ftp://x/y",
        ])
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--run-dir")
        .arg(dir.path().join("run"))
        .args(["--cgroup-parent", "dsec-shared-bad", "--no-network"])
        .output()
        .expect("run dsec serve");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown scheme"), "{err}");
}

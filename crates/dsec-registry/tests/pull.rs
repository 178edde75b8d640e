//! Pulls from a real registry (Debian's docker-registry on loopback, seeded with skopeo)
//! into a real image store: what a pull stores is what importing the same image from an
//! OCI layout stores, and every failure leaves the store as it was.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use dsec_image::ImageStore;
use dsec_registry::{Credential, RegistryConfig, RegistryError};
use dsec_testkit::{layer_tar, oci_layout, CutProxy, Registry};
use dsec_wire::v1::{ImportEvent, PullImageRequest};

/// A real registry and a fresh image store for one test.
struct Fixture {
    reg: Registry,
    dir: tempfile::TempDir,
    store: Arc<ImageStore>,
}

impl Fixture {
    /// The fixture of test `t`, its registry wanting basic auth with `auth`'s user and
    /// password if given; `None` where this machine cannot run it and skipping is allowed.
    fn start(t: &str, auth: Option<(&str, &str)>) -> Option<Self> {
        if !dsec_testkit::require_root(t) {
            return None;
        }
        let reg = match auth {
            Some((user, password)) => Registry::start_with_auth(t, user, password)?,
            None => Registry::start(t)?,
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(ImageStore::open(dir.path().join("images")).expect("open store"));
        Some(Self { reg, dir, store })
    }

    /// A layout as [`Fixture::layout`] makes it, pushed to `repo_tag` (layers compressed
    /// with `compression`).
    fn seeded(&self, id: &str, size: usize, repo_tag: &str, compression: &str) -> PathBuf {
        let layout = self.layout(id, "amd64", size);
        self.reg.seed(&layout, repo_tag, compression);
        layout
    }

    /// The default configuration, allowed to pull from this fixture's registry (on
    /// loopback, which only an explicit allow reaches).
    fn config(&self) -> RegistryConfig {
        RegistryConfig {
            allow: dsec_registry::Allow::from_flags(&[self.reg.addr()]).expect("allow"),
            ..Default::default()
        }
    }

    /// `REGISTRY/path`: a reference to this fixture's registry.
    fn reference(&self, path: &str) -> String {
        format!("{}/{path}", self.reg.addr())
    }

    /// Pulls `path` of this fixture's registry into its store.
    async fn pull(
        &self,
        config: &RegistryConfig,
        path: &str,
        name: Option<&str>,
    ) -> (Result<dsec_image::Image, RegistryError>, Events) {
        pull(&self.store, config, self.reference(path), name).await
    }

    /// An OCI layout of one layer `id` for `arch`.
    fn layout(&self, id: &str, arch: &str, size: usize) -> PathBuf {
        let tar = layer_tar(self.dir.path(), id, size);
        oci_layout(
            &self.dir.path().join(format!("layout-{id}")),
            &[&tar],
            arch,
            &[&format!("IMAGE={id}")],
        )
    }

    /// The digest a local import of `layout` stores (in a store of its own).
    fn imported_digest(&self, layout: &Path) -> String {
        let other = ImageStore::open(self.dir.path().join(format!(
            "check-{}",
            layout.file_name().and_then(|n| n.to_str()).unwrap_or("x")
        )))
        .expect("open store");
        other
            .import_oci("check", layout, false, &|_| {})
            .expect("import the layout")
            .digest
    }

    /// Asserts the store holds no image, layer or temp file.
    fn assert_empty(&self) {
        assert!(self.store.list().expect("list").is_empty());
        let root = self.store.root();
        for d in ["blobs/sha256", "tmp"] {
            let left: Vec<_> = std::fs::read_dir(root.join(d))
                .expect("read_dir")
                .flatten()
                .map(|e| e.path())
                .collect();
            assert!(left.is_empty(), "{d} kept {left:?}");
        }
        assert!(
            !root.join("layers/sha256").exists()
                || std::fs::read_dir(root.join("layers/sha256"))
                    .expect("read_dir")
                    .next()
                    .is_none()
        );
    }
}

type Events = Arc<Mutex<Vec<ImportEvent>>>;

async fn pull(
    store: &Arc<ImageStore>,
    config: &RegistryConfig,
    reference: String,
    name: Option<&str>,
) -> (Result<dsec_image::Image, RegistryError>, Events) {
    let events: Events = Arc::default();
    let sink = events.clone();
    let req = PullImageRequest {
        reference,
        name: name.map(str::to_string),
        insecure: true,
    };
    let res = dsec_registry::pull(
        store.clone(),
        config,
        &req,
        Arc::new(move |e| sink.lock().expect("events").push(e)),
    )
    .await;
    (res, events)
}

/// Bytes of blobs the pull downloaded (`downloading` events' largest totals per blob).
fn downloads(events: &Events) -> Vec<u64> {
    events
        .lock()
        .expect("events")
        .iter()
        .filter_map(|e| match e {
            ImportEvent::Progress {
                phase,
                bytes_done: 0,
                bytes_total: Some(t),
            } if phase == "downloading" => Some(*t),
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn pull_by_tag_and_digest_gzip_and_zstd() {
    let Some(fx) = Fixture::start("pull_by_tag_and_digest_gzip_and_zstd", None) else {
        return;
    };
    let layout = fx.seeded("tagged", 300 << 10, "org/app:gz", "gzip");
    fx.reg.seed(&layout, "org/app:zst", "zstd");
    let want = fx.imported_digest(&layout);
    let cfg = fx.config();

    let (img, ev) = fx.pull(&cfg, "org/app:gz", None).await;
    let img = img.expect("pull by tag (gzip)");
    assert_eq!(
        img.name,
        fx.reference("org/app:gz"),
        "the default name is the reference"
    );
    assert_eq!(img.digest, want, "a pull stores what an import stores");
    assert_eq!(
        img.config.env.get("IMAGE").map(String::as_str),
        Some("tagged")
    );
    assert_eq!(downloads(&ev).len(), 2, "config and one layer");

    let (img, _) = fx.pull(&cfg, "org/app:zst", None).await;
    assert_eq!(img.expect("pull by tag (zstd)").digest, want);

    // By digest: the manifest is checked against it, and the layer converted by the
    // first pull is neither downloaded nor converted again (only the config is fetched).
    let (_, manifest_digest) = fx.reg.manifest("org/app", "gz");
    let by_digest = format!("org/app@{manifest_digest}");
    let (img, ev) = fx.pull(&cfg, &by_digest, Some("pinned")).await;
    let img = img.expect("pull by digest");
    assert_eq!(
        (img.name.as_str(), img.digest.as_str()),
        ("pinned", want.as_str())
    );
    assert!(img.source.ends_with(&manifest_digest), "{}", img.source);
    assert_eq!(downloads(&ev).len(), 1, "only the config: {:?}", ev.lock());

    // A digest the registry does not have.
    let missing = format!("org/app@sha256:{}", "0".repeat(64));
    let (res, _) = fx.pull(&cfg, &missing, Some("missing")).await;
    let err = res.expect_err("an unknown digest");
    assert!(matches!(err, RegistryError::NotFound(_)), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn multi_arch_index_picks_linux_amd64() {
    let Some(fx) = Fixture::start("multi_arch_index_picks_linux_amd64", None) else {
        return;
    };
    let amd = fx.layout("amd", "amd64", 4 << 10);
    let arm = fx.layout("arm", "arm64", 4 << 10);
    fx.reg.seed(&amd, "multi:amd64", "gzip");
    fx.reg.seed(&arm, "multi:arm64", "gzip");
    let entry = |tag: &str, arch: &str| {
        let (m, digest) = fx.reg.manifest("multi", tag);
        // The size of the registry's bytes (which the digest is of).
        let raw = fx
            .reg
            .request(
                "GET",
                &format!("/v2/multi/manifests/{digest}"),
                &[("Accept", m["mediaType"].as_str().unwrap_or_default())],
                &[],
            )
            .expect("GET manifest");
        serde_json::json!({
            "mediaType": m["mediaType"], "digest": digest, "size": raw.body.len(),
            "platform": {"os": "linux", "architecture": arch},
        })
    };
    // arm64 first: the pull must choose by platform, not by position.
    let index = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [entry("arm64", "arm64"), entry("amd64", "amd64")],
    });
    fx.reg.put_manifest(
        "multi",
        "latest",
        "application/vnd.oci.image.index.v1+json",
        &serde_json::to_vec(&index).expect("index JSON"),
    );
    let cfg = fx.config();
    let (img, _) = fx.pull(&cfg, "multi", Some("multi")).await;
    let img = img.expect("pull of the index");
    assert_eq!(img.digest, fx.imported_digest(&amd));
    assert_eq!(img.config.env.get("IMAGE").map(String::as_str), Some("amd"));

    // An index without linux/amd64 names what it has.
    let only_arm = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [entry("arm64", "arm64")],
    });
    fx.reg.put_manifest(
        "multi",
        "armonly",
        "application/vnd.oci.image.index.v1+json",
        &serde_json::to_vec(&only_arm).expect("index JSON"),
    );
    let (res, _) = fx.pull(&cfg, "multi:armonly", Some("armonly")).await;
    let err = res.expect_err("no amd64 image").to_string();
    assert!(
        err.contains("no linux/amd64") && err.contains("linux/arm64"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn private_repository_with_basic_auth() {
    let Some(fx) = Fixture::start("private_repository_with_basic_auth", Some(("ci", "right")))
    else {
        return;
    };
    let layout = fx.seeded("private", 4 << 10, "team/private:v1", "gzip");
    let with = |password: &str| {
        let mut cfg = fx.config();
        cfg.credentials.insert(
            &fx.reg.addr(),
            Credential::Basic {
                username: "ci".into(),
                password: password.into(),
            },
        );
        cfg
    };

    for cfg in [fx.config(), with("wrong")] {
        let (res, _) = fx.pull(&cfg, "team/private:v1", None).await;
        let err = res.expect_err("refused");
        assert!(matches!(err, RegistryError::Unauthorized(_)), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("refused access to team/private") && msg.contains("credentials"),
            "{msg}"
        );
        fx.assert_empty();
    }
    let (img, _) = fx.pull(&with("right"), "team/private:v1", None).await;
    assert_eq!(
        img.expect("pull with credentials").digest,
        fx.imported_digest(&layout)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn corrupt_blob_is_rejected_and_nothing_kept() {
    let Some(fx) = Fixture::start("corrupt_blob_is_rejected_and_nothing_kept", None) else {
        return;
    };
    fx.seeded("corrupt", 64 << 10, "bad:v1", "gzip");
    let (m, _) = fx.reg.manifest("bad", "v1");
    let layer = m["layers"][0]["digest"].as_str().expect("layer digest");
    let file = fx.reg.blob_file(layer);
    let mut bytes = std::fs::read(&file).expect("read the stored blob");
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&file, &bytes).expect("corrupt the stored blob");

    let cfg = fx.config();
    let (res, _) = fx.pull(&cfg, "bad:v1", None).await;
    let err = res.expect_err("a corrupt blob");
    assert!(matches!(err, RegistryError::Corrupt(_)), "{err}");
    assert!(err.to_string().contains(layer), "{err}");
    fx.assert_empty();

    // Truncated on disk: the registry serves fewer bytes than the manifest says.
    std::fs::write(&file, &bytes[..mid]).expect("truncate the stored blob");
    let (res, _) = fx.pull(&cfg, "bad:v1", None).await;
    assert!(res.is_err());
    fx.assert_empty();
}

#[tokio::test(flavor = "multi_thread")]
async fn registry_dying_mid_blob_then_retry() {
    let Some(fx) = Fixture::start("registry_dying_mid_blob_then_retry", None) else {
        return;
    };
    let layout = fx.seeded("cut", 2 << 20, "cut:v1", "gzip");
    // Manifest and config (a few KiB) pass; the 2 MiB layer is cut at 256 KiB.
    let proxy = CutProxy::start(fx.reg.port(), 256 << 10);
    proxy.arm(true);
    let reference = format!("{}/cut:v1", proxy.addr());
    let mut cfg = fx.config();
    cfg.allow.named.push(proxy.addr());
    let (res, _) = pull(&fx.store, &cfg, reference.clone(), Some("cut")).await;
    let err = res.expect_err("the transfer was cut");
    assert!(matches!(err, RegistryError::Transport(_)), "{err}");
    assert!(err.to_string().contains("broke off"), "{err}");
    assert!(proxy.passed() >= 256 << 10);
    fx.assert_empty();

    proxy.arm(false);
    let (img, _) = pull(&fx.store, &cfg, reference, Some("cut")).await;
    assert_eq!(img.expect("the retry").digest, fx.imported_digest(&layout));
}

#[tokio::test(flavor = "multi_thread")]
async fn nodes_sharing_a_blob_store_convert_a_layer_once() {
    let Some(fx) = Fixture::start("nodes_sharing_a_blob_store_convert_a_layer_once", None) else {
        return;
    };
    fx.seeded("shared", 64 << 10, "shared:v1", "zstd");
    let shared: Arc<dyn dsec_image::BlobStore> =
        Arc::new(dsec_blob::DirStore::open(fx.dir.path().join("shared")).expect("shared store"));
    let node = |n: &str| {
        Arc::new(
            ImageStore::open_with(
                fx.dir.path().join(n),
                dsec_image::StoreOptions {
                    shared: Some(shared.clone()),
                    ..Default::default()
                },
            )
            .expect("open a node's store"),
        )
    };
    let (a, b) = (node("node-a"), node("node-b"));
    let cfg = fx.config();
    let reference = fx.reference("shared:v1");
    let (img_a, ev) = pull(&a, &cfg, reference.clone(), Some("app")).await;
    let img_a = img_a.expect("pull on node a");
    assert_eq!(downloads(&ev).len(), 2, "config and layer");
    // Node b finds the converted layer in the shared store: it fetches only the config.
    let (img_b, ev) = pull(&b, &cfg, reference, Some("app")).await;
    assert_eq!(img_b.expect("pull on node b").digest, img_a.digest);
    assert_eq!(downloads(&ev).len(), 1, "only the config: {:?}", ev.lock());
}

/// `reg`'s count of `GET path` once it has logged at least `least` (it logs a request
/// as it finishes answering, a moment after the client has the bytes).
fn gets(reg: &Registry, path: &str, least: usize) -> usize {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let n = reg.requests("GET", path);
        if n >= least || std::time::Instant::now() > deadline {
            return n;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_pulls_of_one_reference_pull_once() {
    let Some(fx) = Fixture::start("concurrent_pulls_of_one_reference_pull_once", None) else {
        return;
    };
    let layout = fx.seeded("flight", 1 << 20, "flight:v1", "gzip");
    let (m, _) = fx.reg.manifest("flight", "v1");
    let layer = m["layers"][0]["digest"].as_str().expect("layer digest");
    let puller = Arc::new(dsec_registry::Puller::new(fx.store.clone(), fx.config()));
    let request = |path: &str| PullImageRequest {
        reference: fx.reference(path),
        name: None,
        insecure: true,
    };

    let pulls = (0..16).map(|_| {
        let (puller, req) = (puller.clone(), request("flight:v1"));
        tokio::spawn(async move { puller.pull(&req, Arc::new(|_| {})).await })
    });
    let digests: Vec<String> = futures::future::join_all(pulls)
        .await
        .into_iter()
        .map(|r| r.expect("join").expect("pull").digest)
        .collect();
    assert!(digests.iter().all(|d| *d == fx.imported_digest(&layout)));
    let blob = format!("/v2/flight/blobs/{layer}");
    assert_eq!(
        gets(&fx.reg, &blob, 1),
        1,
        "16 pulls fetched the layer once"
    );
    // One GET was the test's own.
    let manifest = "/v2/flight/manifests/v1";
    assert_eq!(
        gets(&fx.reg, manifest, 2),
        2,
        "16 pulls fetched the manifest once"
    );

    // A pull that fails fails every caller alike and leaves nothing.
    let pulls = (0..8).map(|_| {
        let (puller, req) = (puller.clone(), request("flight:nope"));
        tokio::spawn(async move { puller.pull(&req, Arc::new(|_| {})).await })
    });
    for r in futures::future::join_all(pulls).await {
        let err = r.expect("join").expect_err("no such tag");
        assert!(matches!(*err, RegistryError::NotFound(_)), "{err}");
    }
    assert_eq!(gets(&fx.reg, "/v2/flight/manifests/nope", 1), 1);
    let names: Vec<String> = fx
        .store
        .list()
        .expect("list")
        .into_iter()
        .map(|i| i.name)
        .collect();
    assert_eq!(names, vec![fx.reference("flight:v1")]);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_loopback_registry_needs_an_explicit_allow() {
    let Some(fx) = Fixture::start("a_loopback_registry_needs_an_explicit_allow", None) else {
        return;
    };
    fx.seeded("near", 4 << 10, "near:v1", "gzip");
    let (res, _) = fx.pull(&RegistryConfig::default(), "near:v1", None).await;
    let err = res.expect_err("loopback is not public");
    assert!(matches!(err, RegistryError::Refused(_)), "{err}");
    assert!(
        err.to_string()
            .contains(&format!("--allow-registry {}", fx.reg.addr())),
        "{err}"
    );
    assert_eq!(fx.reg.requests("GET", "/v2/near/manifests/v1"), 0);
    fx.assert_empty();
}

#[tokio::test(flavor = "multi_thread")]
async fn multi_layer_pulls_in_parallel_store_what_serial_pulls_store() {
    let Some(fx) = Fixture::start(
        "multi_layer_pulls_in_parallel_store_what_serial_pulls_store",
        None,
    ) else {
        return;
    };
    let tars: Vec<PathBuf> = (0..5)
        .map(|i| layer_tar(fx.dir.path(), &format!("part{i}"), 200 << 10))
        .collect();
    let refs: Vec<&Path> = tars.iter().map(PathBuf::as_path).collect();
    let layout = oci_layout(&fx.dir.path().join("layout-multi"), &refs, "amd64", &[]);
    fx.reg.seed(&layout, "multi:v1", "gzip");
    let want = fx.imported_digest(&layout);
    for parallel in [1, 3] {
        // A store of its own each time: every layer is downloaded.
        let store = Arc::new(
            ImageStore::open(fx.dir.path().join(format!("store-{parallel}"))).expect("store"),
        );
        let cfg = RegistryConfig {
            parallel_downloads: parallel,
            ..fx.config()
        };
        let (img, ev) = pull(&store, &cfg, fx.reference("multi:v1"), Some("m")).await;
        assert_eq!(
            img.expect("multi-layer pull").digest,
            want,
            "{parallel} at a time"
        );
        assert_eq!(downloads(&ev).len(), 6, "config and 5 layers");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn private_repository_behind_a_token_server() {
    let t = "private_repository_behind_a_token_server";
    if !dsec_testkit::require_root(t) {
        return;
    }
    let tokens = dsec_testkit::TokenServer::start("ci", "right");
    let Some(reg) = Registry::start_with_token(t, &tokens, "ci", "right") else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Arc::new(ImageStore::open(dir.path().join("images")).expect("store"));
    let tar = layer_tar(dir.path(), "token", 8 << 10);
    let layout = oci_layout(&dir.path().join("layout"), &[&tar], "amd64", &[]);
    reg.seed(&layout, "team/app:v1", "gzip");
    let seeded = tokens.issued();
    assert!(seeded > 0, "skopeo's push went through the token server");
    let reference = format!("{}/team/app:v1", reg.addr());
    let with = |password: Option<&str>| {
        let mut cfg = RegistryConfig {
            allow: dsec_registry::Allow::from_flags(&[reg.addr()]).expect("allow"),
            ..Default::default()
        };
        if let Some(p) = password {
            cfg.credentials.insert(
                &reg.addr(),
                Credential::Basic {
                    username: "ci".into(),
                    password: p.into(),
                },
            );
        }
        cfg
    };
    for cfg in [with(None), with(Some("wrong"))] {
        let (res, _) = pull(&store, &cfg, reference.clone(), None).await;
        let err = res.expect_err("no token");
        assert!(matches!(err, RegistryError::Unauthorized(_)), "{err}");
    }
    assert_eq!(tokens.issued(), seeded, "no token for wrong credentials");
    let (img, _) = pull(&store, &with(Some("right")), reference, None).await;
    img.expect("pull with a bearer token");
    assert!(tokens.issued() > seeded, "the pull fetched a token");
}

//! One pull: resolve the reference to a manifest, fetch the config and the layer blobs
//! not converted before, and hand them to the image store.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use dsec_image::oci::{host_arch, pick_platform, Descriptor, Manifest};
use dsec_image::{Image, ImageStore, PulledLayer};
use dsec_wire::v1::{ImportEvent, PullImageRequest};
use futures::StreamExt as _;
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::errors::OciDistributionError;
use oci_client::manifest::OciDescriptor;
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use sha2::{Digest as _, Sha256};
use tokio::io::AsyncWriteExt as _;

use crate::allow::{is_public, Reach};
use crate::egress::{Egress, Permit};
use crate::{
    default_name, parse_reference, Progress, RegistryConfig, RegistryError, Result, CONFIG_LIMIT,
    MANIFEST_LIMIT,
};

const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
/// Progress of a download is reported at most once per this many bytes.
const REPORT_EVERY: u64 = 1 << 20;

/// Turns a client error into ours, saying what was being fetched.
fn client_err(reference: &Reference, what: &str, e: OciDistributionError) -> RegistryError {
    let registry = reference.registry();
    let repo = reference.repository();
    match e {
        OciDistributionError::UnauthorizedError { .. }
        | OciDistributionError::AuthenticationFailure(_) => RegistryError::Unauthorized(format!(
            "registry {registry} refused access to {repo} ({what}): wrong or missing \
             credentials (see --registry-auth)"
        )),
        OciDistributionError::ImageManifestNotFoundError(m) => {
            RegistryError::NotFound(format!("{}: {what} not found: {m}", reference.whole()))
        }
        OciDistributionError::RegistryError { envelope, .. } => {
            let codes: Vec<String> = envelope
                .errors
                .iter()
                .map(|e| format!("{:?}: {}", e.code, e.message))
                .collect();
            let msg = format!("{}: {what}: {}", reference.whole(), codes.join("; "));
            let unknown = envelope.errors.iter().any(|e| {
                use oci_client::errors::OciErrorCode as C;
                matches!(
                    e.code,
                    C::ManifestUnknown | C::NameUnknown | C::BlobUnknown | C::NotFound
                )
            });
            let denied = envelope.errors.iter().any(|e| {
                use oci_client::errors::OciErrorCode as C;
                matches!(e.code, C::Unauthorized | C::Denied)
            });
            if denied {
                RegistryError::Unauthorized(format!(
                    "registry {registry} refused access to {repo} ({what}): wrong or missing \
                     credentials (see --registry-auth)"
                ))
            } else if unknown {
                RegistryError::NotFound(msg)
            } else {
                RegistryError::Unsupported(msg)
            }
        }
        OciDistributionError::ServerError { code: 404, .. } => {
            RegistryError::NotFound(format!("{}: {what} not found", reference.whole()))
        }
        OciDistributionError::ServerError { code, message, .. } if code < 500 => {
            RegistryError::Unsupported(format!(
                "{}: {what}: registry answered {code}: {message}",
                reference.whole()
            ))
        }
        OciDistributionError::DigestError(d) => {
            RegistryError::Corrupt(format!("{}: {what}: {d}", reference.whole()))
        }
        OciDistributionError::RequestError(r) if r.status().is_some_and(|s| s == 401) => {
            RegistryError::Unauthorized(format!(
                "registry {registry} refused access to {repo} ({what}): wrong or missing \
                 credentials (see --registry-auth)"
            ))
        }
        OciDistributionError::RequestError(r) if r.status().is_some_and(|s| s == 404) => {
            RegistryError::NotFound(format!("{}: {what} not found", reference.whole()))
        }
        other => RegistryError::Transport(format!(
            "registry {registry}: fetching {what} of {repo} failed: {}",
            error_chain(&other)
        )),
    }
}

/// `e` and its sources, `: `-separated (reqwest hides the cause in its sources).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let m = c.to_string();
        if !s.contains(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
        cur = c.source();
    }
    s
}

/// The sha256 hex of `d`, which must be a `sha256:` digest.
fn sha256_hex(d: &str, what: &str) -> Result<String> {
    match d.strip_prefix("sha256:") {
        Some(_) => dsec_image::parse_digest(d)
            .map_err(|_| RegistryError::Unsupported(format!("{what}: invalid digest {d:?}"))),
        None => Err(RegistryError::Unsupported(format!(
            "{what}: unsupported digest {d:?} (only sha256)"
        ))),
    }
}

/// The size a descriptor of `reference` states (a registry's manifests always do).
fn size_of(d: &Descriptor, reference: &Reference) -> Result<u64> {
    d.size.ok_or_else(|| {
        RegistryError::Unsupported(format!(
            "{}: descriptor {} has no size",
            reference.whole(),
            d.digest
        ))
    })
}

/// A client for `reference`'s registry; with `proxy`, every request goes through it.
fn client(
    config: &RegistryConfig,
    reference: &Reference,
    insecure: bool,
    proxy: Option<&Egress>,
) -> Result<Client> {
    let protocol = if insecure {
        ClientProtocol::HttpsExcept(vec![reference.resolve_registry().to_string()])
    } else {
        ClientProtocol::Https
    };
    let proxy = proxy.map(Egress::url);
    // Not `Client::new`: on a bad config it falls back to a default client, which
    // would go around the proxy.
    Client::try_from(ClientConfig {
        protocol,
        // Indexes are resolved here (by platform, with the digest checked).
        platform_resolver: None,
        connect_timeout: Some(config.connect_timeout),
        read_timeout: Some(config.read_timeout),
        https_proxy: proxy.clone(),
        http_proxy: proxy,
        no_proxy: None,
        ..Default::default()
    })
    .map_err(|e| RegistryError::Transport(format!("registry client: {e}")))
}

/// Fetches the manifest or index `reference` names, checking its size and (for a
/// reference by digest) its digest. Returns it and its digest.
async fn fetch_manifest(
    client: &Client,
    auth: &RegistryAuth,
    reference: &Reference,
) -> Result<(Manifest, String)> {
    let (bytes, digest) = client
        .pull_manifest_raw(
            reference,
            auth,
            &[OCI_INDEX, OCI_MANIFEST, DOCKER_LIST, DOCKER_MANIFEST],
        )
        .await
        .map_err(|e| client_err(reference, "manifest", e))?;
    if bytes.len() as u64 > MANIFEST_LIMIT {
        return Err(RegistryError::TooLarge {
            what: format!("the manifest of {}", reference.whole()),
            size: bytes.len() as u64,
            limit: MANIFEST_LIMIT,
        });
    }
    let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| {
        RegistryError::Unsupported(format!(
            "{}: the manifest does not parse: {e}",
            reference.whole()
        ))
    })?;
    Ok((m, digest))
}

/// The image manifest of `reference` (an index resolved to this machine's platform), and
/// the manifest's digest.
async fn resolve(
    client: &Client,
    auth: &RegistryAuth,
    reference: &Reference,
) -> Result<(Manifest, String)> {
    let (m, digest) = fetch_manifest(client, auth, reference).await?;
    let Some(entries) = &m.manifests else {
        return Ok((m, digest));
    };
    let pick = pick_platform(entries).map_err(|found| {
        RegistryError::Unsupported(format!(
            "{}: the image index has no linux/{} image (found: {found})",
            reference.whole(),
            host_arch()
        ))
    })?;
    let pick_size = size_of(pick, reference)?;
    if pick_size > MANIFEST_LIMIT {
        return Err(RegistryError::TooLarge {
            what: format!("manifest {}", pick.digest),
            size: pick_size,
            limit: MANIFEST_LIMIT,
        });
    }
    sha256_hex(&pick.digest, "index entry")?;
    // Fetched by digest: the client checks the bytes against it.
    let by_digest = reference.clone_with_digest(pick.digest.clone());
    let (inner, inner_digest) = fetch_manifest(client, auth, &by_digest).await?;
    if inner.manifests.is_some() {
        return Err(RegistryError::Unsupported(format!(
            "{}: image index {} nests another index",
            reference.whole(),
            pick.digest
        )));
    }
    Ok((inner, inner_digest))
}

/// Writes blob `desc` of `reference` to `dest`, checking its size and digest as it
/// arrives. Reports `downloading` progress.
async fn download(
    client: &Client,
    reference: &Reference,
    desc: &Descriptor,
    what: &str,
    dest: &Path,
    progress: &Progress,
) -> Result<()> {
    let want_hex = sha256_hex(&desc.digest, what)?;
    let size = size_of(desc, reference)?;
    // Only the digest and size: `urls` (foreign layers) would send the node elsewhere.
    let oci_desc = OciDescriptor {
        media_type: desc.media_type.clone().unwrap_or_default(),
        digest: desc.digest.clone(),
        size: size as i64,
        urls: None,
        annotations: None,
    };
    let mut stream = client
        .pull_blob_stream(reference, &oci_desc)
        .await
        .map_err(|e| client_err(reference, what, e))?;
    let io_err = |op, e| RegistryError::Io {
        op,
        path: dest.display().to_string(),
        source: e,
    };
    let mut file = tokio::fs::File::create(dest)
        .await
        .map_err(|e| io_err("create", e))?;
    let mut hasher = Sha256::new();
    let mut done = 0u64;
    let mut reported = 0u64;
    let report = |done| {
        progress(ImportEvent::Progress {
            phase: "downloading".into(),
            bytes_done: done,
            bytes_total: Some(size),
        })
    };
    report(0);
    let corrupt = |got: String| {
        RegistryError::Corrupt(format!(
            "{}: {what} {}: {got}; nothing was kept",
            reference.whole(),
            desc.digest
        ))
    };
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            // The client's own digest check ends the stream with an error: say so plainly.
            Err(_) if done == size && hex::encode(hasher.clone().finalize()) != want_hex => {
                break;
            }
            Err(e) => {
                return Err(RegistryError::Transport(format!(
                    "registry {}: download of {what} {} broke off after {done} of {} bytes: \
                     {}; nothing was kept, retry the pull",
                    reference.registry(),
                    desc.digest,
                    size,
                    error_chain(&e)
                )))
            }
        };
        done += chunk.len() as u64;
        if done > size {
            return Err(corrupt(format!(
                "the registry sent more than the manifest's {size} bytes"
            )));
        }
        hasher.update(&chunk);
        file.write_all(&chunk)
            .await
            .map_err(|e| io_err("write", e))?;
        if done - reported >= REPORT_EVERY {
            reported = done;
            report(done);
        }
    }
    file.flush().await.map_err(|e| io_err("write", e))?;
    if done < size {
        return Err(corrupt(format!(
            "truncated: {done} of the manifest's {size} bytes"
        )));
    }
    let got = hex::encode(hasher.finalize());
    if got != want_hex {
        return Err(corrupt(format!("the bytes hash to sha256:{got}")));
    }
    report(done);
    Ok(())
}

pub(crate) async fn pull(
    store: Arc<ImageStore>,
    config: &RegistryConfig,
    req: &PullImageRequest,
    progress: Progress,
) -> Result<Image> {
    let reference = parse_reference(&req.reference)?;
    let name = req
        .name
        .clone()
        .unwrap_or_else(|| default_name(&req.reference));
    dsec_image::validate_name(&name)?;
    let permit: Option<Permit> = match config.allow.check(&reference).await? {
        Reach::Named => None,
        Reach::Public => Some(Arc::new(|a: &SocketAddr| is_public(&a.ip()))),
    };
    pull_guarded(store, config, req, progress, reference, name, permit).await
}

/// A pull of an allowed `reference`; with `permit`, its connections go through an
/// [`Egress`] that lets them reach only the addresses it permits.
async fn pull_guarded(
    store: Arc<ImageStore>,
    config: &RegistryConfig,
    req: &PullImageRequest,
    progress: Progress,
    reference: Reference,
    name: String,
    permit: Option<Permit>,
) -> Result<Image> {
    let egress = match permit {
        Some(p) => Some(
            Egress::start(p)
                .await
                .map_err(|e| RegistryError::Transport(format!("registry egress proxy: {e}")))?,
        ),
        None => None,
    };
    let res = pull_with(
        store,
        config,
        req,
        progress,
        &reference,
        name,
        egress.as_ref(),
    )
    .await;
    match (res, egress.as_ref().and_then(Egress::refused)) {
        // Whatever the client made of the refusal, this is why the pull failed.
        (Err(_), Some(refused)) => Err(RegistryError::Refused(format!(
            "registry {} sent the pull to {refused}, which is not a public address (a \
             redirect or token realm into a private network); an operator who trusts it \
             allows it with `dsec serve --allow-registry {}`",
            reference.registry(),
            reference.registry()
        ))),
        (res, _) => res,
    }
}

async fn pull_with(
    store: Arc<ImageStore>,
    config: &RegistryConfig,
    req: &PullImageRequest,
    progress: Progress,
    reference: &Reference,
    name: String,
    egress: Option<&Egress>,
) -> Result<Image> {
    let reference = reference.clone();
    let insecure = req.insecure || config.insecure.iter().any(|r| r == reference.registry());
    let client = client(config, &reference, insecure, egress)?;
    let auth = config.credentials.for_reference(&reference);
    progress(ImportEvent::Progress {
        phase: "resolving".into(),
        bytes_done: 0,
        bytes_total: None,
    });
    let (manifest, manifest_digest) = resolve(&client, &auth, &reference).await?;
    let whole = reference.whole();
    let (Some(config_desc), Some(layer_descs)) = (manifest.config, manifest.layers) else {
        return Err(RegistryError::Unsupported(format!(
            "{whole}: manifest {manifest_digest} ({}) has no config or no layers",
            manifest.media_type.as_deref().unwrap_or("no media type")
        )));
    };
    if layer_descs.is_empty() {
        return Err(RegistryError::Unsupported(format!(
            "{whole}: manifest {manifest_digest} lists no layers"
        )));
    }
    for (i, l) in layer_descs.iter().enumerate() {
        let media = l.media_type.as_deref().unwrap_or_default();
        if !media.is_empty() && !media.contains("tar") {
            return Err(RegistryError::Unsupported(format!(
                "{whole}: layer {} has media type {}, not a (gzip or zstd) tar",
                i + 1,
                media
            )));
        }
        let size = size_of(l, &reference)?;
        if size > config.layer_limit {
            return Err(RegistryError::TooLarge {
                what: format!("layer {} ({})", i + 1, l.digest),
                size,
                limit: config.layer_limit,
            });
        }
    }
    let config_size = size_of(&config_desc, &reference)?;
    if config_size > CONFIG_LIMIT {
        return Err(RegistryError::TooLarge {
            what: format!("the config of {whole}"),
            size: config_size,
            limit: CONFIG_LIMIT,
        });
    }

    // Everything downloaded goes under the store's tmp/ and is removed with `work`.
    let work = {
        let store = store.clone();
        tokio::task::spawn_blocking(move || store.upload_dir())
            .await
            .map_err(|e| RegistryError::Transport(format!("join: {e}")))??
    };
    let blobs = work.path().join("blobs/sha256");
    std::fs::create_dir_all(&blobs).map_err(|e| RegistryError::Io {
        op: "mkdir",
        path: blobs.display().to_string(),
        source: e,
    })?;

    let config_hex = sha256_hex(&config_desc.digest, "config")?;
    let config_path = blobs.join(&config_hex);
    download(
        &client,
        &reference,
        &config_desc,
        "config",
        &config_path,
        &progress,
    )
    .await?;
    let config_bytes = std::fs::read(&config_path).map_err(|e| RegistryError::Io {
        op: "read",
        path: config_path.display().to_string(),
        source: e,
    })?;
    let (image_config, diff_ids) = dsec_image::parse_config(&config_bytes)?;
    if let Some(ids) = &diff_ids {
        if ids.len() != layer_descs.len() {
            return Err(RegistryError::Unsupported(format!(
                "{whole}: the manifest lists {} layers but the config's rootfs.diff_ids {}",
                layer_descs.len(),
                ids.len()
            )));
        }
    }

    // The layers not converted before, each blob once, downloaded a few at a time.
    let mut layers = Vec::new();
    let mut fetch: Vec<(String, String, &Descriptor, std::path::PathBuf)> = Vec::new();
    for (i, d) in layer_descs.iter().enumerate() {
        let hex = sha256_hex(&d.digest, "layer")?;
        let converted = {
            let (store, hex) = (store.clone(), hex.clone());
            tokio::task::spawn_blocking(move || store.converted_layer(&hex))
                .await
                .map_err(|e| RegistryError::Transport(format!("join: {e}")))?
        };
        if converted.is_some() {
            tracing::debug!(layer = %d.digest, "layer converted before; not downloaded");
        } else if !fetch.iter().any(|(h, ..)| *h == hex) {
            let what = format!("layer {}/{}", i + 1, layer_descs.len());
            fetch.push((hex.clone(), what, d, blobs.join(&hex)));
        }
        layers.push(PulledLayer {
            blob: hex,
            size: size_of(d, &reference)?,
            diff_id: diff_ids.as_ref().and_then(|ids| ids.get(i).cloned()),
        });
    }
    // A plain loop, not a closure: a closure's future here is not `Send` for every
    // lifetime (rust-lang/rust#110338).
    let mut pending = Vec::with_capacity(fetch.len());
    for (_, what, d, dest) in &fetch {
        pending.push(download(&client, &reference, d, what, dest, &progress));
    }
    // The first failure ends the pull; the downloads still running are dropped and
    // their partial files go with `work`.
    let mut downloads =
        futures::stream::iter(pending).buffer_unordered(config.parallel_downloads.max(1));
    while let Some(done) = downloads.next().await {
        done?;
    }
    drop(downloads);

    let label = match reference.digest() {
        Some(_) => whole.clone(),
        None => format!("{whole}@{manifest_digest}"),
    };
    let img = tokio::task::spawn_blocking(move || {
        let report = |p: dsec_image::ImportProgress| {
            progress(ImportEvent::Progress {
                phase: p.phase.as_str().to_string(),
                bytes_done: p.bytes_done,
                bytes_total: p.bytes_total,
            })
        };
        let res = store.import_pulled(&name, work.path(), &layers, image_config, &label, &report);
        drop(work);
        res
    })
    .await
    .map_err(|e| RegistryError::Transport(format!("join: {e}")))??;
    Ok(img)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Credential;

    /// A registry allowed as public may not send its pull anywhere else: here its token
    /// realm (a server on another port, standing in for the metadata endpoint) is not
    /// permitted, and the pull fails naming it with nothing stored; permitted, the same
    /// pull (manifest, token, blobs) goes through the proxy whole.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_public_registry_cannot_send_the_pull_to_an_address_that_is_not() {
        let t = "a_public_registry_cannot_send_the_pull_to_an_address_that_is_not";
        if !dsec_testkit::require_root(t) {
            return;
        }
        let tokens = dsec_testkit::TokenServer::start("ci", "right");
        let Some(reg) = dsec_testkit::Registry::start_with_token(t, &tokens, "ci", "right") else {
            return;
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(ImageStore::open(dir.path().join("images")).expect("store"));
        let tar = dsec_testkit::layer_tar(dir.path(), "egress", 64 << 10);
        let layout = dsec_testkit::oci_layout(&dir.path().join("layout"), &[&tar], "amd64", &[]);
        reg.seed(&layout, "team/app:v1", "gzip");
        let seeded = tokens.issued();

        let mut config = RegistryConfig::default();
        config.credentials.insert(
            &reg.addr(),
            Credential::Basic {
                username: "ci".into(),
                password: "right".into(),
            },
        );
        let req = PullImageRequest {
            reference: format!("{}/team/app:v1", reg.addr()),
            name: Some("egress".into()),
            insecure: true,
        };
        let token_port: u16 = tokens
            .realm()
            .trim_start_matches("http://127.0.0.1:")
            .trim_end_matches("/token")
            .parse()
            .expect("token port");
        let pull = |ports: Vec<u16>| {
            let (store, config, req) = (store.clone(), config.clone(), req.clone());
            async move {
                let reference = parse_reference(&req.reference)?;
                let permit: Permit = Arc::new(move |a: &SocketAddr| {
                    a.ip().is_loopback() && ports.contains(&a.port())
                });
                pull_guarded(
                    store,
                    &config,
                    &req,
                    Arc::new(|_| {}),
                    reference,
                    "egress".into(),
                    Some(permit),
                )
                .await
            }
        };

        let err = pull(vec![reg.port()])
            .await
            .expect_err("realm not permitted");
        let msg = err.to_string();
        assert!(matches!(err, RegistryError::Refused(_)), "{msg}");
        assert!(
            msg.contains(&format!("127.0.0.1:{token_port}"))
                && msg.contains("not a public address"),
            "{msg}"
        );
        assert_eq!(tokens.issued(), seeded, "no token was fetched");
        assert!(store.image_info("egress").is_err(), "nothing stored");

        let img = pull(vec![reg.port(), token_port])
            .await
            .expect("a pull through the proxy");
        assert_eq!(img.name, "egress");
        assert!(tokens.issued() > seeded, "the token came through the proxy");
    }
}

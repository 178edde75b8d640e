//! [`Registry`]: a real OCI registry (Debian's `docker-registry`, the CNCF distribution
//! server) on a free 127.0.0.1 port with its own storage directory, optionally behind
//! htpasswd basic auth; [`oci_layout`] writes an OCI image layout from plain layer tars,
//! which [`Registry::seed`] pushes with `skopeo copy` (compressing the layers as asked);
//! [`CutProxy`] forwards to it and can break a transfer off mid-blob.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sha2::{Digest as _, Sha256};

use crate::unavailable;

/// How long the registry may take to answer after it starts.
const READY_WITHIN: Duration = Duration::from_secs(30);

fn binary(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/sbin")])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// `sha256:<hex>` of `bytes`.
pub fn sha256_digest(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// A running registry. Drop kills exactly the process it started and removes its data.
#[derive(Debug)]
pub struct Registry {
    port: u16,
    child: Option<Child>,
    creds: Option<(String, String)>,
    log: PathBuf,
    // Last: removed after the process is killed.
    dir: tempfile::TempDir,
}

/// One HTTP answer.
#[derive(Debug, Clone)]
pub struct HttpReply {
    /// Status code.
    pub status: u16,
    /// Header lines (`name: value`), names lowercased.
    pub headers: Vec<(String, String)>,
    /// Body.
    pub body: Vec<u8>,
}

impl HttpReply {
    /// The first header named `name` (lowercase).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

impl Registry {
    /// A registry without auth. `None` if `docker-registry` or `skopeo` is missing and
    /// skipping is allowed (see [`crate::unavailable`]); panics otherwise, or if it does
    /// not start.
    pub fn start(test: &str) -> Option<Self> {
        Self::start_inner(test, None, None)
    }

    /// A registry that wants HTTP basic auth with `user` and `password` (htpasswd, bcrypt).
    pub fn start_with_auth(test: &str, user: &str, password: &str) -> Option<Self> {
        Self::start_inner(test, Some((user.to_string(), password.to_string())), None)
    }

    /// A registry that wants bearer tokens of `tokens` (distribution's `auth: token`):
    /// clients get one there with basic auth of `user` and `password`.
    pub fn start_with_token(
        test: &str,
        tokens: &crate::TokenServer,
        user: &str,
        password: &str,
    ) -> Option<Self> {
        let auth = format!(
            "auth:\n  token:\n    realm: {}\n    service: {}\n    issuer: {}\n    \
             rootcertbundle: {}\n",
            tokens.realm(),
            crate::token::SERVICE,
            crate::token::ISSUER,
            tokens.cert().display()
        );
        Self::start_inner(
            test,
            Some((user.to_string(), password.to_string())),
            Some(auth),
        )
    }

    fn start_inner(
        test: &str,
        creds: Option<(String, String)>,
        token_auth: Option<String>,
    ) -> Option<Self> {
        let missing = ["docker-registry", "skopeo"]
            .into_iter()
            .chain(creds.as_ref().map(|_| "htpasswd"))
            .chain(token_auth.as_ref().map(|_| "openssl"))
            .filter(|b| binary(b).is_none())
            .collect::<Vec<_>>();
        let missing = (!missing.is_empty()).then(|| {
            format!(
                "{} (install Debian's docker-registry, skopeo and apache2-utils)",
                missing.join(", ")
            )
        });
        if unavailable(test, missing).is_some() {
            return None;
        }
        let dir = tempfile::Builder::new()
            .prefix("dsec-registry-")
            .tempdir()
            .expect("a temporary directory for the registry");
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let mut config = format!(
            "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\n  \
             delete:\n    enabled: true\nhttp:\n  addr: 127.0.0.1:{port}\n  secret: dsec-test\n",
            dir.path().join("data").display()
        );
        if let Some(auth) = &token_auth {
            config.push_str(auth);
        } else if let Some((user, password)) = &creds {
            let out = Command::new(binary("htpasswd").expect("htpasswd"))
                .args(["-Bbn", user, password])
                .output()
                .expect("running htpasswd");
            assert!(out.status.success(), "htpasswd failed: {out:?}");
            let file = dir.path().join("htpasswd");
            std::fs::write(&file, &out.stdout).expect("writing htpasswd");
            config.push_str(&format!(
                "auth:\n  htpasswd:\n    realm: dsec-test\n    path: {}\n",
                file.display()
            ));
        }
        let cfg = dir.path().join("config.yml");
        std::fs::write(&cfg, config).expect("writing the registry config");
        let log = dir.path().join("registry.log");
        let mut reg = Self {
            port,
            child: None,
            creds,
            log,
            dir,
        };
        reg.spawn();
        Some(reg)
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("registry log file");
        let child = Command::new(binary("docker-registry").expect("docker-registry"))
            .arg("serve")
            .arg(self.dir.path().join("config.yml"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log fd"))
            .stderr(log)
            .spawn()
            .expect("starting docker-registry");
        self.child = Some(child);
        let start = Instant::now();
        loop {
            if let Ok(r) = self.request("GET", "/v2/", &[], &[]) {
                if r.status == 200 || r.status == 401 {
                    return;
                }
            }
            if start.elapsed() > READY_WITHIN {
                panic!(
                    "docker-registry did not answer within {READY_WITHIN:?}; log:\n{}",
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `127.0.0.1:PORT`, the registry part of references to it.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Its port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Where the registry keeps blob `digest` (`sha256:<hex>`) on disk.
    pub fn blob_file(&self, digest: &str) -> PathBuf {
        let hex = digest.trim_start_matches("sha256:");
        self.dir
            .path()
            .join("data/docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }

    /// Pushes the OCI layout `layout` (see [`oci_layout`]) as `repo:tag` with skopeo,
    /// compressing its layers with `compression` (`gzip` or `zstd`).
    pub fn seed(&self, layout: &Path, repo_tag: &str, compression: &str) {
        let mut cmd = Command::new(binary("skopeo").expect("skopeo"));
        cmd.args([
            "copy",
            "--quiet",
            "--dest-tls-verify=false",
            "--dest-compress",
        ])
        .args(["--dest-compress-format", compression]);
        if let Some((u, p)) = &self.creds {
            cmd.arg("--dest-creds").arg(format!("{u}:{p}"));
        }
        let out = cmd
            .arg(format!("oci:{}", layout.display()))
            .arg(format!("docker://{}/{repo_tag}", self.addr()))
            .output()
            .expect("running skopeo");
        assert!(
            out.status.success(),
            "skopeo copy to {repo_tag} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// How many `method` requests for `path` (as sent, e.g. `/v2/app/blobs/sha256:..`)
    /// the registry has answered, from its access log (which it writes as it answers).
    pub fn requests(&self, method: &str, path: &str) -> usize {
        let needle = format!("\"{method} {path} HTTP/");
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(&needle))
            .count()
    }

    /// The manifest (or index) `repo:reference` and its digest.
    pub fn manifest(&self, repo: &str, reference: &str) -> (serde_json::Value, String) {
        let accept = "application/vnd.oci.image.manifest.v1+json, \
                      application/vnd.oci.image.index.v1+json, \
                      application/vnd.docker.distribution.manifest.v2+json, \
                      application/vnd.docker.distribution.manifest.list.v2+json";
        let r = self
            .request(
                "GET",
                &format!("/v2/{repo}/manifests/{reference}"),
                &[("Accept", accept)],
                &[],
            )
            .expect("GET manifest");
        assert_eq!(r.status, 200, "GET manifest {repo}:{reference}: {r:?}");
        let v = serde_json::from_slice(&r.body).expect("manifest JSON");
        (v, sha256_digest(&r.body))
    }

    /// PUTs `body` as manifest `repo:reference` of `media_type` (how a test makes an
    /// image index, which skopeo cannot). Returns its digest.
    pub fn put_manifest(
        &self,
        repo: &str,
        reference: &str,
        media_type: &str,
        body: &[u8],
    ) -> String {
        let r = self
            .request(
                "PUT",
                &format!("/v2/{repo}/manifests/{reference}"),
                &[("Content-Type", media_type)],
                body,
            )
            .expect("PUT manifest");
        assert_eq!(r.status, 201, "PUT manifest {repo}:{reference}: {r:?}");
        sha256_digest(body)
    }

    /// One HTTP/1.0 request to the registry (with its credentials, if any).
    pub fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> std::io::Result<HttpReply> {
        let mut s = TcpStream::connect(("127.0.0.1", self.port))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        let mut req = format!(
            "{method} {path} HTTP/1.0\r\nHost: {}\r\nContent-Length: {}\r\n",
            self.addr(),
            body.len()
        );
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        if let Some((u, p)) = &self.creds {
            req.push_str(&format!(
                "Authorization: Basic {}\r\n",
                base64(&format!("{u}:{p}"))
            ));
        }
        req.push_str("\r\n");
        s.write_all(req.as_bytes())?;
        s.write_all(body)?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw)?;
        let split = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .ok_or_else(|| std::io::Error::other("no end of headers"))?;
        let head = String::from_utf8_lossy(&raw[..split]).to_string();
        let mut lines = head.lines();
        let status = lines
            .next()
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| std::io::Error::other("no status line"))?;
        let headers = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        Ok(HttpReply {
            status,
            headers,
            body: raw[split + 4..].to_vec(),
        })
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn base64(s: &str) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let b = s.as_bytes();
    let mut out = String::new();
    for c in b.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                out.push(T[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// A plain tar with `/etc/os-release` saying `id` and `size` bytes of noise in `/data`
/// (incompressible, so a transfer of it can be cut in the middle).
pub fn layer_tar(dir: &Path, id: &str, size: usize) -> PathBuf {
    let path = dir.join(format!("{id}.tar"));
    let f = std::fs::File::create(&path).expect("create tar");
    let mut b = tar::Builder::new(f);
    let mut add = |name: &str, data: &[u8]| {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_mtime(0);
        h.set_uid(0);
        h.set_gid(0);
        h.set_cksum();
        b.append_data(&mut h, name, data).expect("append");
    };
    add("etc/os-release", format!("ID={id}\n").as_bytes());
    let mut x: u64 = 0x9e3779b97f4a7c15 ^ id.len() as u64 ^ size as u64;
    let noise: Vec<u8> = (0..size)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    add("data", &noise);
    b.into_inner().expect("finish tar");
    path
}

/// Writes an OCI image layout into `dir` (created) with one uncompressed layer per tar
/// file of `layers`, bottom first, for `architecture` (`amd64`, `arm64`, ...), with
/// `env` (`K=V`) in its config, tagged `latest`. Returns the layout's path.
pub fn oci_layout(dir: &Path, layers: &[&Path], architecture: &str, env: &[&str]) -> PathBuf {
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).expect("mkdir blobs");
    let put = |bytes: &[u8]| -> (String, u64) {
        let d = sha256_digest(bytes);
        std::fs::write(blobs.join(d.trim_start_matches("sha256:")), bytes).expect("write blob");
        (d, bytes.len() as u64)
    };
    let mut layer_descs = Vec::new();
    let mut diff_ids = Vec::new();
    for l in layers {
        let bytes = std::fs::read(l).expect("read layer tar");
        let (d, size) = put(&bytes);
        diff_ids.push(d.clone());
        layer_descs.push(serde_json::json!({
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": d, "size": size,
        }));
    }
    let config = serde_json::json!({
        "architecture": architecture, "os": "linux",
        "config": { "Env": env, "WorkingDir": "/" },
        "rootfs": { "type": "layers", "diff_ids": diff_ids },
    });
    let (cd, cs) = put(&serde_json::to_vec(&config).expect("config JSON"));
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": { "mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": cs },
        "layers": layer_descs,
    });
    let (md, ms) = put(&serde_json::to_vec(&manifest).expect("manifest JSON"));
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": md, "size": ms,
            "annotations": { "org.opencontainers.image.ref.name": "latest" },
        }],
    });
    std::fs::write(
        dir.join("index.json"),
        serde_json::to_vec(&index).expect("index JSON"),
    )
    .expect("write index.json");
    std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#)
        .expect("write oci-layout");
    dir.to_path_buf()
}

/// A TCP proxy on 127.0.0.1 in front of `target` that, while armed, breaks off every
/// connection once it has passed `cut_after` bytes from the target back to the client
/// (a registry dying mid-blob). Stops accepting when dropped.
#[derive(Debug)]
pub struct CutProxy {
    port: u16,
    armed: Arc<AtomicBool>,
    cut_after: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    /// Bytes passed from the target to clients, all connections together.
    passed: Arc<AtomicU64>,
}

impl CutProxy {
    /// Starts the proxy (unarmed) in front of `127.0.0.1:target`.
    pub fn start(target: u16, cut_after: u64) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        let port = listener.local_addr().expect("proxy addr").port();
        listener
            .set_nonblocking(true)
            .expect("nonblocking listener");
        let proxy = Self {
            port,
            armed: Arc::new(AtomicBool::new(false)),
            cut_after: Arc::new(AtomicU64::new(cut_after)),
            stop: Arc::new(AtomicBool::new(false)),
            passed: Arc::new(AtomicU64::new(0)),
        };
        let (armed, cut, stop, passed) = (
            proxy.armed.clone(),
            proxy.cut_after.clone(),
            proxy.stop.clone(),
            proxy.passed.clone(),
        );
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((client, _)) => {
                        let _ = client.set_nonblocking(false);
                        let Ok(upstream) = TcpStream::connect(("127.0.0.1", target)) else {
                            continue;
                        };
                        let limit = armed
                            .load(Ordering::SeqCst)
                            .then(|| cut.load(Ordering::SeqCst));
                        pipe(client, upstream, limit, passed.clone());
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        proxy
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Whether new connections are cut.
    pub fn arm(&self, armed: bool) {
        self.armed.store(armed, Ordering::SeqCst);
    }

    /// Bytes passed from the target to clients so far.
    pub fn passed(&self) -> u64 {
        self.passed.load(Ordering::SeqCst)
    }
}

impl Drop for CutProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Copies both ways between `client` and `upstream`; with `limit`, the upstream ->
/// client direction stops after that many bytes and both sockets are shut down.
fn pipe(client: TcpStream, upstream: TcpStream, limit: Option<u64>, passed: Arc<AtomicU64>) {
    let (Ok(mut c2), Ok(mut u2)) = (client.try_clone(), upstream.try_clone()) else {
        return;
    };
    std::thread::spawn(move || {
        let mut c = client;
        let _ = std::io::copy(&mut c, &mut u2);
        let _ = u2.shutdown(Shutdown::Write);
    });
    std::thread::spawn(move || {
        let mut u = upstream;
        let mut buf = [0u8; 16 << 10];
        let mut sent = 0u64;
        loop {
            let n = match u.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let n = match limit {
                Some(l) if sent + n as u64 >= l => {
                    let k = (l - sent) as usize;
                    let _ = c2.write_all(&buf[..k]);
                    passed.fetch_add(k as u64, Ordering::SeqCst);
                    let _ = c2.shutdown(Shutdown::Both);
                    let _ = u.shutdown(Shutdown::Both);
                    return;
                }
                _ => n,
            };
            if c2.write_all(&buf[..n]).is_err() {
                break;
            }
            sent += n as u64;
            passed.fetch_add(n as u64, Ordering::SeqCst);
        }
        let _ = c2.shutdown(Shutdown::Write);
    });
}

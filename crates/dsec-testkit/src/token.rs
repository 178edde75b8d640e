//! [`TokenServer`]: the token server of the registry token flow (`WWW-Authenticate:
//! Bearer realm=...`), for [`crate::Registry::start_with_token`]. It holds an RSA key and
//! a self-signed certificate of it (made with `openssl`), checks a client's basic auth
//! and answers `GET /token?service=..&scope=repository:NAME:ACTIONS` with a JWT (RS256,
//! the certificate in `x5c`) granting what the scopes ask, as distribution's `auth: token`
//! expects.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use base64::Engine as _;

/// The `service` and `issuer` the registry is configured with.
pub const SERVICE: &str = "dsec-test-registry";
/// The token issuer.
pub const ISSUER: &str = "dsec-test-token-server";

/// A running token server. Drop stops it.
#[derive(Debug)]
pub struct TokenServer {
    port: u16,
    dir: tempfile::TempDir,
    issued: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

struct Keys {
    key: PathBuf,
    cert_der: Vec<u8>,
    user: String,
    password: String,
}

impl TokenServer {
    /// Starts one that issues tokens to `user` with `password`. Panics if `openssl`
    /// fails.
    pub fn start(user: &str, password: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("dsec-token-")
            .tempdir()
            .expect("a temporary directory for the token server");
        let key = dir.path().join("key.pem");
        let cert = dir.path().join("cert.pem");
        openssl(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=dsec-test-token",
            "-keyout",
            &key.display().to_string(),
            "-out",
            &cert.display().to_string(),
        ]);
        let cert_der = openssl(&[
            "x509",
            "-in",
            &cert.display().to_string(),
            "-outform",
            "DER",
        ]);
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the token server");
        let port = listener.local_addr().expect("its address").port();
        listener
            .set_nonblocking(true)
            .expect("a non-blocking listener");
        let keys = Arc::new(Keys {
            key,
            cert_der,
            user: user.into(),
            password: password.into(),
        });
        let (issued, stop) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let (n, halt) = (issued.clone(), stop.clone());
        std::thread::spawn(move || {
            while !halt.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((s, _)) => {
                        let (keys, n) = (keys.clone(), n.clone());
                        std::thread::spawn(move || serve(s, &keys, &n));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        Self {
            port,
            dir,
            issued,
            stop,
        }
    }

    /// The realm URL registries send clients to.
    pub fn realm(&self) -> String {
        format!("http://127.0.0.1:{}/token", self.port)
    }

    /// The certificate the registry trusts tokens of.
    pub fn cert(&self) -> PathBuf {
        self.dir.path().join("cert.pem")
    }

    /// Tokens issued so far.
    pub fn issued(&self) -> usize {
        self.issued.load(Ordering::Relaxed)
    }
}

impl Drop for TokenServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn openssl(args: &[&str]) -> Vec<u8> {
    let out = Command::new("openssl")
        .args(args)
        .stderr(Stdio::piped())
        .output()
        .expect("running openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

fn sign(key: &Path, input: &[u8]) -> Vec<u8> {
    let mut child = Command::new("openssl")
        .args(["dgst", "-sha256", "-sign"])
        .arg(key)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("running openssl dgst");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input)
        .expect("writing to openssl");
    let out = child.wait_with_output().expect("openssl dgst");
    assert!(out.status.success(), "openssl dgst failed");
    out.stdout
}

/// `%XX` decoding of a query value.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(v) => {
                        out.push(v);
                        i += 3;
                    }
                    Err(_) => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn serve(s: TcpStream, keys: &Keys, issued: &AtomicUsize) {
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let mut r = BufReader::new(match s.try_clone() {
        Ok(c) => c,
        Err(_) => return,
    });
    let mut line = String::new();
    if r.read_line(&mut line).is_err() {
        return;
    }
    let target = line.split_whitespace().nth(1).unwrap_or("").to_string();
    let mut auth = None;
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.trim().eq_ignore_ascii_case("authorization") {
                auth = Some(v.trim().to_string());
            }
        }
    }
    let want = format!(
        "Basic {}",
        STANDARD.encode(format!("{}:{}", keys.user, keys.password))
    );
    let mut w = s;
    if auth.as_deref() != Some(want.as_str()) {
        let body = r#"{"errors":[{"code":"UNAUTHORIZED","message":"wrong credentials"}]}"#;
        let _ = write!(
            w,
            "HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        return;
    }
    let query = target.split_once('?').map(|(_, q)| q).unwrap_or("");
    let access: Vec<serde_json::Value> = query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .filter(|(k, _)| *k == "scope")
        .filter_map(|(_, v)| {
            let v = unescape(v);
            let mut parts = v.splitn(3, ':');
            let (kind, name, actions) = (parts.next()?, parts.next()?, parts.next()?);
            Some(serde_json::json!({
                "type": kind, "name": name,
                "actions": actions.split(',').collect::<Vec<_>>(),
            }))
        })
        .collect();
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let n = issued.fetch_add(1, Ordering::Relaxed);
    let header = serde_json::json!({
        "alg": "RS256", "typ": "JWT", "x5c": [STANDARD.encode(&keys.cert_der)],
    });
    let claims = serde_json::json!({
        "iss": ISSUER, "sub": keys.user, "aud": SERVICE,
        "exp": now + 300, "nbf": now - 10, "iat": now, "jti": format!("dsec-{n}"),
        "access": access,
    });
    let input = format!(
        "{}.{}",
        URL_SAFE_NO_PAD.encode(header.to_string()),
        URL_SAFE_NO_PAD.encode(claims.to_string())
    );
    let token = format!(
        "{input}.{}",
        URL_SAFE_NO_PAD.encode(sign(&keys.key, input.as_bytes()))
    );
    let body = serde_json::json!({
        "token": token, "access_token": token, "expires_in": 300,
    })
    .to_string();
    let _ = write!(
        w,
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

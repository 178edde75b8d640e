//! An S3-compatible server on loopback for the tests: moto's `moto_server` (from PyPI; the
//! test script installs it into a venv, see `scripts/lib.sh`), found through
//! `DSEC_S3_SERVER` or at `/tmp/dsec-s3/bin/moto_server`. It speaks S3 with signed
//! requests, multipart uploads and range reads, keeping objects in memory.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// Credentials the tests use (moto accepts any).
pub const ACCESS_KEY: &str = "dsec-test";
/// See [`ACCESS_KEY`].
pub const SECRET_KEY: &str = "dsec-test-secret";

/// The S3 server executable, if installed. Under `CI=true` a missing server panics.
pub fn server_bin() -> Option<PathBuf> {
    let p = std::env::var_os("DSEC_S3_SERVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp/dsec-s3/bin/moto_server"));
    if p.is_file() {
        return Some(p);
    }
    let msg = format!(
        "S3 test server {} not found (scripts/test installs it; or set DSEC_S3_SERVER)",
        p.display()
    );
    dsec_testkit::unavailable("S3 tests", Some(msg));
    None
}

/// A running S3 server; killed on drop.
#[derive(Debug)]
pub struct S3Server {
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
    port: u16,
    child: Child,
}

impl S3Server {
    /// Starts `bin` on a free port and waits until it answers.
    pub fn start(bin: &std::path::Path) -> anyhow::Result<Self> {
        let port = crate::free_port()?;
        let mut cmd = Command::new(bin);
        // SAFETY: prctl is async-signal-safe; the server dies with the test process.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let s = S3Server {
            endpoint: format!("http://127.0.0.1:{port}"),
            port,
            child,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while s.raw("GET", "/").is_err() {
            if Instant::now() > deadline {
                bail!("S3 server on port {port} did not come up");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(s)
    }

    /// Creates `bucket` (moto takes unsigned requests).
    pub fn create_bucket(&self, bucket: &str) -> anyhow::Result<()> {
        let status = self.raw("PUT", &format!("/{bucket}"))?;
        if status != 200 {
            bail!("creating bucket {bucket}: HTTP {status}");
        }
        Ok(())
    }

    /// The `--blob-store` URL of `bucket/prefix` on this server.
    pub fn store_url(&self, bucket: &str, prefix: &str) -> String {
        format!(
            "s3://{bucket}/{prefix}?endpoint={}&region=us-east-1",
            self.endpoint
        )
    }

    /// Environment a process needs to sign requests to this server.
    pub fn env(&self) -> [(&'static str, &'static str); 2] {
        [
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
        ]
    }

    /// One bodiless HTTP/1.1 request; returns the status code.
    fn raw(&self, method: &str, path: &str) -> anyhow::Result<u16> {
        let mut c = TcpStream::connect(("127.0.0.1", self.port))?;
        c.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(
            c,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            self.port
        )?;
        let mut head = [0u8; 12];
        c.read_exact(&mut head)?;
        let line = String::from_utf8_lossy(&head);
        line.get(9..12)
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("bad HTTP status line {line:?}"))
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

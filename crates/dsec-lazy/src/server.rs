//! The lazy layer server: a process of its own that owns the FUSE mount, so that a
//! restart of the node daemon leaves sandboxes on lazy layers readable. The daemon talks
//! to it over a unix socket ([`LazyClient`]), one JSON request and one JSON answer per
//! connection; a daemon that starts finds the server an earlier run left and keeps using
//! it. The server lives as long as its mount: it exits when the mount is gone.
//!
//! If the server itself dies, the kernel aborts the FUSE connection and reads of data not
//! yet in the page cache fail with `EIO` (`ENOTCONN` on the files): the next daemon start
//! sees the dead mount, detaches it, logs which layers were lost and starts a new server.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::{
    detach, ChunkCache, ChunkIndex, LayerStats, LazyError, LazyMount, LazyOptions, Result,
};

/// Everything a lazy layer server needs; passed to its process as one JSON argument.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServeConfig {
    /// The FUSE mount point (one file per layer).
    pub dir: PathBuf,
    /// The control socket.
    pub socket: PathBuf,
    /// The chunk cache directory.
    pub chunks: PathBuf,
    /// The chunk cache's size limit in bytes.
    pub chunk_cache_limit: u64,
    /// The blob store, as `dsec_blob::open` takes it.
    pub store: String,
    /// The server's log (appended to).
    pub log: PathBuf,
    /// Fetch behaviour.
    #[serde(default)]
    pub opts: LazyOptions,
}

/// How the daemon starts a server process: `program args.. <ServeConfig as JSON>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launcher {
    /// The executable.
    pub program: PathBuf,
    /// Arguments before the JSON config (a subcommand, say).
    pub args: Vec<OsString>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum Request {
    Hello,
    AddLayer {
        key: String,
        index: ChunkIndex,
        prefetch_key: Option<String>,
    },
    Stats,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "answer", rename_all = "snake_case")]
enum Answer {
    Hello {
        store: String,
        pid: u32,
    },
    Path {
        path: PathBuf,
    },
    Stats {
        layers: Vec<(String, LayerStats)>,
        #[serde(default)]
        chunk_cache_bytes: u64,
    },
    Error {
        message: String,
    },
}

fn other(what: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(what.to_string())
}

/// Whether `dir` is a mount point: its device differs from its parent's. A dead FUSE
/// mount (`ENOTCONN`) counts as mounted.
fn is_mount_point(dir: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let parent = dir.parent().unwrap_or(Path::new("/"));
    match (std::fs::metadata(dir), std::fs::metadata(parent)) {
        (Ok(d), Ok(p)) => d.dev() != p.dev(),
        (Err(e), _) => e.raw_os_error() == Some(libc::ENOTCONN),
        _ => false,
    }
}

/// Runs a lazy layer server until its mount goes away (the calling process's main loop).
pub fn serve(cfg: &ServeConfig) -> Result<()> {
    let store: Arc<dyn dsec_blob::BlobStore> = Arc::from(
        dsec_blob::open(&cfg.store)
            .map_err(|e| LazyError::io("opening the blob store", &cfg.dir, other(e)))?,
    );
    if is_mount_point(&cfg.dir) {
        // A server that died left it; its files are unreadable for good.
        tracing::warn!(dir = %cfg.dir.display(), "detaching a dead lazy layer mount");
        detach(&cfg.dir);
    }
    let cache = Arc::new(ChunkCache::open(&cfg.chunks, cfg.chunk_cache_limit)?);
    let mount = Arc::new(LazyMount::mount(&cfg.dir, store, cache, cfg.opts.clone())?);
    let _ = std::fs::remove_file(&cfg.socket);
    let listener =
        UnixListener::bind(&cfg.socket).map_err(|e| LazyError::io("bind", &cfg.socket, e))?;
    std::fs::set_permissions(&cfg.socket, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| LazyError::io("chmod", &cfg.socket, e))?;
    tracing::info!(dir = %cfg.dir.display(), socket = %cfg.socket.display(), "lazy layer server up");
    let (m, store_name) = (mount.clone(), cfg.store.clone());
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let (m, store_name) = (m.clone(), store_name.clone());
            std::thread::spawn(move || answer(conn, &m, &store_name));
        }
    });
    while mount.is_serving() {
        std::thread::sleep(Duration::from_millis(250));
    }
    tracing::info!(dir = %cfg.dir.display(), "lazy layer mount gone; server exits");
    let _ = std::fs::remove_file(&cfg.socket);
    Ok(())
}

fn answer(conn: UnixStream, mount: &LazyMount, store: &str) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
    let mut line = String::new();
    if BufReader::new(&conn).read_line(&mut line).is_err() {
        return;
    }
    let reply = match serde_json::from_str::<Request>(&line) {
        Err(e) => Answer::Error {
            message: format!("bad request: {e}"),
        },
        Ok(Request::Hello) => Answer::Hello {
            store: store.to_string(),
            pid: std::process::id(),
        },
        Ok(Request::AddLayer {
            key,
            index,
            prefetch_key,
        }) => match mount.add_layer(&key, index, prefetch_key.as_deref()) {
            Ok(path) => Answer::Path { path },
            Err(e) => Answer::Error {
                message: e.to_string(),
            },
        },
        Ok(Request::Stats) => Answer::Stats {
            layers: mount.all_stats(),
            chunk_cache_bytes: mount.chunk_cache_bytes(),
        },
    };
    if let Ok(mut bytes) = serde_json::to_vec(&reply) {
        bytes.push(b'\n');
        let mut conn = &conn;
        let _ = conn.write_all(&bytes);
    }
}

/// What a lazy layer server reports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServerStats {
    /// Accounting of every layer it serves, by digest (hex).
    pub layers: Vec<(String, LayerStats)>,
    /// Bytes its chunk cache holds on the node's disk.
    pub chunk_cache_bytes: u64,
}

/// The daemon's handle on its lazy layer server.
#[derive(Debug, Clone)]
pub struct LazyClient {
    socket: PathBuf,
    dir: PathBuf,
    pid: u32,
    started: bool,
}

impl LazyClient {
    /// Connects to the server at `cfg.socket` (one an earlier daemon started), or starts
    /// one with `launcher` and waits until it answers. Fails if the running server
    /// fetches from another store than `cfg.store`.
    pub fn attach(cfg: &ServeConfig, launcher: &Launcher) -> Result<Self> {
        let mut client = Self {
            socket: cfg.socket.clone(),
            dir: cfg.dir.clone(),
            pid: 0,
            started: false,
        };
        match client.hello() {
            Ok((store, pid)) if store == cfg.store => {
                tracing::info!(pid, "adopted the running lazy layer server");
                client.pid = pid;
                return Ok(client);
            }
            Ok((store, pid)) => {
                return Err(LazyError::io(
                    "attach",
                    &cfg.dir,
                    other(format!(
                        "the lazy layer server running here (pid {pid}) fetches from {store}, \
                         not {}; unmount {} to replace it",
                        cfg.store,
                        cfg.dir.display()
                    )),
                ))
            }
            Err(_) => {}
        }
        let config =
            serde_json::to_string(cfg).map_err(|e| LazyError::io("encode", &cfg.dir, other(e)))?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&cfg.log)
            .map_err(|e| LazyError::io("open", &cfg.log, e))?;
        let log_err = log
            .try_clone()
            .map_err(|e| LazyError::io("dup", &cfg.log, e))?;
        let mut cmd = Command::new(&launcher.program);
        cmd.args(&launcher.args)
            .arg(config)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err);
        // SAFETY: setsid is async-signal-safe; the server leaves the daemon's session so
        // that signals to the daemon's process group do not reach it.
        unsafe {
            cmd.pre_exec(|| {
                libc::setsid();
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| LazyError::io("spawn", &launcher.program, e))?;
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Ok((_, pid)) = client.hello() {
                client.pid = pid;
                client.started = true;
                std::thread::spawn(move || child.wait());
                tracing::info!(pid, "started the lazy layer server");
                return Ok(client);
            }
            let exited = child.try_wait().ok().flatten();
            if exited.is_some() || Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                let log = std::fs::read_to_string(&cfg.log).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(5).collect();
                return Err(LazyError::io(
                    "start the lazy layer server",
                    &cfg.dir,
                    other(format!(
                        "{} ({}): {}",
                        match exited {
                            Some(st) => format!("it exited with {st}"),
                            None => "no answer within 15 s".into(),
                        },
                        cfg.log.display(),
                        tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
                    )),
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn call(&self, req: &Request) -> Result<Answer> {
        let io = |e| LazyError::io("lazy layer server", &self.socket, e);
        let conn = UnixStream::connect(&self.socket).map_err(io)?;
        conn.set_read_timeout(Some(Duration::from_secs(60)))
            .map_err(io)?;
        let mut bytes = serde_json::to_vec(req).map_err(|e| io(other(e)))?;
        bytes.push(b'\n');
        (&conn).write_all(&bytes).map_err(io)?;
        let mut line = String::new();
        BufReader::new(&conn).read_line(&mut line).map_err(io)?;
        match serde_json::from_str::<Answer>(&line).map_err(|e| io(other(e)))? {
            Answer::Error { message } => Err(io(other(message))),
            a => Ok(a),
        }
    }

    fn hello(&self) -> Result<(String, u32)> {
        match self.call(&Request::Hello)? {
            Answer::Hello { store, pid } => Ok((store, pid)),
            a => Err(self.unexpected(a)),
        }
    }

    fn unexpected(&self, a: Answer) -> LazyError {
        LazyError::io(
            "lazy layer server",
            &self.socket,
            other(format!("unexpected answer {a:?}")),
        )
    }

    /// See [`LazyMount::add_layer`].
    pub fn add_layer(
        &self,
        key: &str,
        index: ChunkIndex,
        prefetch_key: Option<&str>,
    ) -> Result<PathBuf> {
        match self.call(&Request::AddLayer {
            key: key.to_string(),
            index,
            prefetch_key: prefetch_key.map(str::to_string),
        })? {
            Answer::Path { path } => Ok(path),
            a => Err(self.unexpected(a)),
        }
    }

    /// Accounting of every layer the server serves, by digest (hex).
    pub fn stats(&self) -> Result<ServerStats> {
        match self.call(&Request::Stats)? {
            Answer::Stats {
                layers,
                chunk_cache_bytes,
            } => Ok(ServerStats {
                layers,
                chunk_cache_bytes,
            }),
            a => Err(self.unexpected(a)),
        }
    }

    /// The mount point.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether [`LazyClient::attach`] started the server (rather than adopting one).
    pub fn started(&self) -> bool {
        self.started
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }
}

//! The audit log: every state-changing call (any method but GET, HEAD and OPTIONS) to any
//! front (`/v1`, the admin routes, E2B, SWE-ReX, SandboxFusion; not nodes' registration)
//! is appended, answered or refused, as one JSON line ([`AuditEntry`]) to this API
//! server's files.
//!
//! Files: `DIR/audit.log`, rotated to `audit.log.1`, `audit.log.2`, ... when it passes
//! `file_bytes`; the oldest beyond `files` is deleted. A writer thread appends (the
//! request only queues its entry) and flushes whenever its queue is empty, so an entry
//! is on disk a moment after its answer. Entries are never rewritten: append-only.
//! `GET /v1/audit` reads them back for admins ([`AuditLog::query`]).

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::extract::{ConnectInfo, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::Response;
use dsec_control::SandboxApi;
use dsec_wire::v1::{AuditEntry, AuditList, AuditQuery, DEFAULT_AUDIT_LIMIT, MAX_AUDIT_LIMIT};
use dsec_wire::ErrorCode;

/// Name of the current file.
const CURRENT: &str = "audit.log";

/// Where and how much to keep.
#[derive(Debug, Clone)]
pub struct AuditConfig {
    /// Directory of the files (created, mode 0700).
    pub dir: PathBuf,
    /// A file is rotated once it is this long.
    pub file_bytes: u64,
    /// Files kept, the current one included (at least 1).
    pub files: usize,
}

/// An open audit log: a queue to its writer thread.
#[derive(Debug)]
pub struct AuditLog {
    cfg: AuditConfig,
    queue: Mutex<mpsc::Sender<Job>>,
}

enum Job {
    Append(Box<AuditEntry>),
    /// Answers once everything queued before is written.
    Flush(mpsc::Sender<()>),
}

impl AuditLog {
    /// Opens (creates) the log in `cfg.dir` and starts its writer.
    pub fn open(cfg: AuditConfig) -> std::io::Result<Arc<Self>> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&cfg.dir)?;
        let file = open_current(&cfg.dir)?;
        let written = file.metadata()?.len();
        let (tx, rx) = mpsc::channel();
        let writer = Writer {
            cfg: cfg.clone(),
            out: BufWriter::new(file),
            written,
        };
        std::thread::Builder::new()
            .name("dsec-audit".into())
            .spawn(move || writer.run(rx))?;
        Ok(Arc::new(Self {
            cfg,
            queue: Mutex::new(tx),
        }))
    }

    /// Queues `entry` for the writer.
    pub fn append(&self, entry: AuditEntry) {
        let sent = self
            .queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(Job::Append(Box::new(entry)));
        if sent.is_err() {
            tracing::error!("the audit writer is gone: an entry was not written");
        }
    }

    /// Waits until every entry queued so far is written.
    pub fn flush(&self) {
        let (tx, rx) = mpsc::channel();
        let sent = self
            .queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(Job::Flush(tx));
        if sent.is_ok() {
            let _ = rx.recv();
        }
    }

    /// The entries `q` selects, oldest first: from `since_ms` on, or the newest ones.
    /// Reads the files (blocking: call it off the async runtime).
    pub fn query(&self, q: &AuditQuery) -> std::io::Result<AuditList> {
        self.flush();
        let limit = q
            .limit
            .unwrap_or(DEFAULT_AUDIT_LIMIT)
            .clamp(1, MAX_AUDIT_LIMIT);
        let mut entries = std::collections::VecDeque::new();
        let mut truncated = false;
        for path in self.files_oldest_first() {
            let file = match File::open(&path) {
                Ok(f) => f,
                // Rotated away meanwhile.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            for line in BufReader::new(file).lines() {
                let Ok(entry) = serde_json::from_str::<AuditEntry>(&line?) else {
                    continue;
                };
                if !q.matches(&entry) {
                    continue;
                }
                if entries.len() == limit {
                    truncated = true;
                    if q.since_ms.is_some() {
                        return Ok(AuditList {
                            entries: entries.into(),
                            truncated,
                        });
                    }
                    entries.pop_front();
                }
                entries.push_back(entry);
            }
        }
        Ok(AuditList {
            entries: entries.into(),
            truncated,
        })
    }

    fn files_oldest_first(&self) -> Vec<PathBuf> {
        let mut files: Vec<PathBuf> = (1..self.cfg.files.max(1))
            .rev()
            .map(|n| rotated(&self.cfg.dir, n))
            .collect();
        files.push(self.cfg.dir.join(CURRENT));
        files
    }
}

fn rotated(dir: &Path, n: usize) -> PathBuf {
    dir.join(format!("{CURRENT}.{n}"))
}

fn open_current(dir: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(dir.join(CURRENT))
}

/// The writer thread's side.
struct Writer {
    cfg: AuditConfig,
    out: BufWriter<File>,
    /// Bytes in the current file.
    written: u64,
}

impl Writer {
    fn run(mut self, rx: mpsc::Receiver<Job>) {
        while let Ok(job) = rx.recv() {
            self.handle(job);
            // Drain what else is queued, then flush once.
            while let Ok(job) = rx.try_recv() {
                self.handle(job);
            }
            if let Err(e) = self.out.flush() {
                tracing::error!(error = %e, "flushing the audit log failed");
            }
        }
        let _ = self.out.flush();
    }

    fn handle(&mut self, job: Job) {
        match job {
            Job::Append(entry) => {
                if let Err(e) = self.write(&entry) {
                    tracing::error!(error = %e, "writing the audit log failed");
                }
            }
            Job::Flush(done) => {
                let _ = self.out.flush();
                let _ = done.send(());
            }
        }
    }

    fn write(&mut self, entry: &AuditEntry) -> std::io::Result<()> {
        let mut line = serde_json::to_vec(entry).map_err(std::io::Error::other)?;
        line.push(b'\n');
        if self.written > 0 && self.written + line.len() as u64 > self.cfg.file_bytes {
            self.rotate()?;
        }
        self.out.write_all(&line)?;
        self.written += line.len() as u64;
        Ok(())
    }

    /// `audit.log` becomes `audit.log.1`, each older one moves up, the oldest beyond
    /// `files` goes.
    fn rotate(&mut self) -> std::io::Result<()> {
        self.out.flush()?;
        let dir = &self.cfg.dir;
        let keep = self.cfg.files.max(1);
        if keep == 1 {
            std::fs::remove_file(dir.join(CURRENT))?;
        } else {
            let _ = std::fs::remove_file(rotated(dir, keep - 1));
            for n in (1..keep - 1).rev() {
                match std::fs::rename(rotated(dir, n), rotated(dir, n + 1)) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                    _ => {}
                }
            }
            std::fs::rename(dir.join(CURRENT), rotated(dir, 1))?;
        }
        self.out = BufWriter::new(open_current(dir)?);
        self.written = 0;
        Ok(())
    }
}

/// What the audit middleware needs.
#[derive(Clone)]
pub(crate) struct Audited {
    pub log: Arc<AuditLog>,
    pub api: Arc<dyn SandboxApi>,
}

/// Middleware: appends an entry for every call that may change something.
pub(crate) async fn audit_calls(
    State(audited): State<Audited>,
    req: axum::extract::Request,
    next: Next,
) -> Response {
    let method = req.method().clone();
    // A WebSocket (a terminal) is a GET that runs commands: it is recorded too.
    let upgrade = req.headers().contains_key(axum::http::header::UPGRADE);
    let read_only =
        !upgrade && (method == Method::GET || method == Method::HEAD || method == Method::OPTIONS);
    // Nodes' registration and heartbeats (node token, not API keys) are not calls of
    // users.
    if read_only || req.uri().path().starts_with("/node/") {
        return next.run(req).await;
    }
    let path = req.uri().path().to_owned();
    let who = audited
        .api
        .authenticate(crate::extract::request_key(req.headers()).as_deref())
        .ok();
    let remote = req
        .extensions()
        .get::<ConnectInfo<std::net::SocketAddr>>()
        .map(|c| c.0.to_string());
    let started = Instant::now();
    let resp = next.run(req).await;
    let status = resp.status();
    let error = resp
        .extensions()
        .get::<ErrorCode>()
        .and_then(|c| serde_json::to_value(c).ok())
        .and_then(|v| v.as_str().map(str::to_owned))
        .or_else(|| {
            (status.is_client_error() || status.is_server_error())
                .then(|| status.as_u16().to_string())
        });
    let request_id = resp
        .headers()
        .get(dsec_node_api::request_id::HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    audited.log.append(AuditEntry {
        at_ms: now_ms(),
        request_id,
        tenant: who.as_ref().map(|p| p.tenant.clone()),
        key_id: who.as_ref().map(|p| p.key_id.clone()),
        method: method.to_string(),
        sandbox: sandbox_of(&path),
        path,
        status: status.as_u16(),
        error,
        duration_ms: started.elapsed().as_millis() as u64,
        remote,
    });
    resp
}

/// The sandbox id a path names (`.../sandboxes/{id}/...` on any front).
fn sandbox_of(path: &str) -> Option<String> {
    let mut parts = path.split('/');
    while let Some(p) = parts.next() {
        if p == "sandboxes" {
            return parts.next().filter(|id| !id.is_empty()).map(str::to_owned);
        }
    }
    None
}

/// `GET /v1/audit`: admins only; a tenant admin sees its tenant's entries.
pub(crate) async fn audit_query(
    api: crate::Scoped,
    axum::Extension(opts): axum::Extension<crate::HttpOptions>,
    crate::extract::Query(mut q): crate::extract::Query<AuditQuery>,
) -> Result<Response, crate::HttpError> {
    use axum::response::IntoResponse;
    let caller = api.caller();
    if !caller.allows(dsec_control::Scope::Admin) {
        return Err(crate::HttpError::new(
            ErrorCode::Forbidden,
            "the audit log is for admin keys",
        ));
    }
    if !caller.is_cluster_admin() {
        match &q.tenant {
            Some(t) if *t != caller.tenant => {
                return Err(crate::HttpError::new(
                    ErrorCode::Forbidden,
                    format!("this key sees only tenant {}'s entries", caller.tenant),
                ))
            }
            _ => q.tenant = Some(caller.tenant.clone()),
        }
    }
    let Some(log) = opts.audit.clone() else {
        return Err(crate::HttpError::new(
            ErrorCode::BadRequest,
            "this server keeps no audit log (--audit-files 0)",
        ));
    };
    let list = tokio::task::spawn_blocking(move || log.query(&q))
        .await
        .map_err(|e| crate::HttpError::new(ErrorCode::Internal, e.to_string()))?
        .map_err(|e| {
            crate::HttpError::new(ErrorCode::Internal, format!("reading the audit log: {e}"))
        })?;
    Ok(axum::Json(list).into_response())
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(at_ms: u64, tenant: &str) -> AuditEntry {
        AuditEntry {
            at_ms,
            request_id: None,
            tenant: Some(tenant.into()),
            key_id: None,
            method: "POST".into(),
            path: "/v1/sandboxes".into(),
            sandbox: None,
            status: 201,
            error: None,
            duration_ms: 1,
            remote: None,
        }
    }

    #[test]
    fn rotation_keeps_the_newest_files_and_queries_read_across_them() {
        let dir = tempfile::tempdir().expect("dir");
        let cfg = AuditConfig {
            dir: dir.path().join("audit"),
            file_bytes: 1000,
            files: 3,
        };
        let log = AuditLog::open(cfg.clone()).expect("open");
        for i in 0..100 {
            log.append(entry(i, if i % 2 == 0 { "a" } else { "b" }));
        }
        log.flush();
        let names: Vec<String> = std::fs::read_dir(&cfg.dir)
            .expect("list")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.len(), 3, "{names:?}");
        for f in [CURRENT, "audit.log.1", "audit.log.2"] {
            let len = std::fs::metadata(cfg.dir.join(f)).expect("file").len();
            assert!(len <= 1000, "{f}: {len}");
        }
        let all = log.query(&AuditQuery::default()).expect("query");
        let times: Vec<u64> = all.entries.iter().map(|e| e.at_ms).collect();
        assert!(times.windows(2).all(|w| w[0] < w[1]), "{times:?}");
        assert_eq!(times.last(), Some(&99));
        assert!(
            times.len() < 100,
            "older files were dropped: {}",
            times.len()
        );

        let newest_b = log
            .query(&AuditQuery {
                tenant: Some("b".into()),
                limit: Some(2),
                ..Default::default()
            })
            .expect("query");
        let times: Vec<u64> = newest_b.entries.iter().map(|e| e.at_ms).collect();
        assert_eq!((times, newest_b.truncated), (vec![97, 99], true));
        let from = log
            .query(&AuditQuery {
                since_ms: Some(90),
                limit: Some(3),
                ..Default::default()
            })
            .expect("query");
        let times: Vec<u64> = from.entries.iter().map(|e| e.at_ms).collect();
        assert_eq!((times, from.truncated), (vec![90, 91, 92], true));

        // Reopened: appends to the current file, does not truncate it.
        drop(log);
        let log = AuditLog::open(cfg).expect("reopen");
        log.append(entry(100, "a"));
        let all = log.query(&AuditQuery::default()).expect("query");
        assert_eq!(all.entries.last().map(|e| e.at_ms), Some(100));
        assert!(all.entries.iter().any(|e| e.at_ms == 99));
    }

    #[test]
    fn the_sandbox_is_read_from_any_front() {
        assert_eq!(
            sandbox_of("/v1/sandboxes/sb-1/exec").as_deref(),
            Some("sb-1")
        );
        assert_eq!(sandbox_of("/e2b/sandboxes/x").as_deref(), Some("x"));
        assert_eq!(sandbox_of("/v1/sandboxes"), None);
        assert_eq!(sandbox_of("/v1/images"), None);
    }
}

//! A blob server on loopback for the tests and benchmarks: a directory served over HTTP
//! with `Range` support (tower-http's `ServeDir`), as a remote store read by range would
//! be. Optionally throttled to emulate a store across a network: every response waits a
//! first-byte latency, and all response bodies together share one link of fixed
//! bandwidth. It counts the body bytes it served. `PUT` stores an object (what nodes do
//! with prefetch lists), parent directories created, written to a temporary name first.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use futures::StreamExt;

/// How a throttled server behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Throttle {
    /// Bandwidth of the link all responses share, bytes per second.
    pub bytes_per_sec: u64,
    /// Wait before each response starts.
    pub latency: Duration,
}

/// The shared link and the byte counter.
#[derive(Debug)]
struct Link {
    throttle: Option<Throttle>,
    /// When the link is free again.
    free_at: tokio::sync::Mutex<tokio::time::Instant>,
    served: AtomicU64,
}

impl Link {
    /// Counts `n` bytes and, throttled, waits until the link has carried them.
    async fn send(&self, n: usize) {
        self.served.fetch_add(n as u64, Ordering::Relaxed);
        let Some(t) = self.throttle else { return };
        let done = {
            let mut free_at = self.free_at.lock().await;
            let start = (*free_at).max(tokio::time::Instant::now());
            *free_at = start + Duration::from_secs_f64(n as f64 / t.bytes_per_sec.max(1) as f64);
            *free_at
        };
        tokio::time::sleep_until(done).await;
    }
}

/// `PUT /KEY`: writes the body under the served directory.
async fn put(root: Arc<std::path::PathBuf>, req: Request) -> Response {
    use axum::http::StatusCode;
    let status = |code: StatusCode| {
        let mut r = Response::new(Body::empty());
        *r.status_mut() = code;
        r
    };
    // Decoded as ServeDir decodes GET paths, so a key reads back where it was written.
    let Ok(key) = percent_encoding::percent_decode_str(req.uri().path().trim_start_matches('/'))
        .decode_utf8()
        .map(|k| k.into_owned())
    else {
        return status(StatusCode::BAD_REQUEST);
    };
    let plain = !key.is_empty()
        && key
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != ".." && !c.contains('\\'));
    if !plain {
        return status(StatusCode::BAD_REQUEST);
    }
    let Ok(body) = axum::body::to_bytes(req.into_body(), 1 << 30).await else {
        return status(StatusCode::PAYLOAD_TOO_LARGE);
    };
    let dest = root.join(&key);
    let tmp = dest.with_extension(format!("part-{}", std::process::id()));
    let written = dest
        .parent()
        .map_or(Ok(()), std::fs::create_dir_all)
        .and_then(|()| std::fs::write(&tmp, &body))
        .and_then(|()| std::fs::rename(&tmp, &dest));
    match written {
        Ok(()) => status(StatusCode::CREATED),
        Err(_) => {
            let _ = std::fs::remove_file(&tmp);
            status(StatusCode::INTERNAL_SERVER_ERROR)
        }
    }
}

async fn shape(State(link): State<Arc<Link>>, req: Request, next: Next) -> Response {
    if let Some(t) = link.throttle {
        tokio::time::sleep(t.latency).await;
    }
    let (parts, body) = next.run(req).await.into_parts();
    let body = body.into_data_stream().then(move |chunk| {
        let link = link.clone();
        async move {
            if let Ok(bytes) = &chunk {
                link.send(bytes.len()).await;
            }
            chunk
        }
    });
    Response::from_parts(parts, Body::from_stream(body))
}

/// A running server; stops when dropped.
#[derive(Debug)]
pub struct BlobServer {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    link: Arc<Link>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl BlobServer {
    /// Serves `root` on a free loopback port from a thread of its own, at full speed.
    pub fn start(root: &Path) -> anyhow::Result<Self> {
        Self::start_with(root, None)
    }

    /// [`BlobServer::start`], throttled as `throttle` says.
    pub fn start_with(root: &Path, throttle: Option<Throttle>) -> anyhow::Result<Self> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr: SocketAddr = listener.local_addr()?;
        let root = root.to_path_buf();
        let put_root = Arc::new(root.clone());
        let link = Arc::new(Link {
            throttle,
            free_at: tokio::sync::Mutex::new(tokio::time::Instant::now()),
            served: AtomicU64::new(0),
        });
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let shared = link.clone();
        std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                    return;
                };
                let serve = tower_http::services::ServeDir::new(root);
                let app = axum::Router::new()
                    .fallback(
                        axum::routing::put(move |req: Request| put(put_root.clone(), req))
                            .fallback_service(serve),
                    )
                    .layer(axum::middleware::from_fn_with_state(shared, shape));
                let _ = axum::serve(listener, app)
                    .with_graceful_shutdown(async {
                        let _ = rx.await;
                    })
                    .await;
            });
        });
        Ok(Self {
            url: format!("http://{addr}"),
            link,
            stop: Some(tx),
        })
    }

    /// Body bytes served so far.
    pub fn served_bytes(&self) -> u64 {
        self.link.served.load(Ordering::Relaxed)
    }
}

impl Drop for BlobServer {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

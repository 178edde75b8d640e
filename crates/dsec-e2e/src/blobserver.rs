//! A blob server on loopback for the tests: a directory served over HTTP with `Range`
//! support (tower-http's `ServeDir`), as a remote store read by range would be.

use std::net::SocketAddr;
use std::path::Path;

/// A running server; stops when dropped.
#[derive(Debug)]
pub struct BlobServer {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl BlobServer {
    /// Serves `root` on a free loopback port from a thread of its own.
    pub fn start(root: &Path) -> anyhow::Result<Self> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr: SocketAddr = listener.local_addr()?;
        let root = root.to_path_buf();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
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
                let app =
                    axum::Router::new().fallback_service(tower_http::services::ServeDir::new(root));
                let _ = axum::serve(listener, app)
                    .with_graceful_shutdown(async {
                        let _ = rx.await;
                    })
                    .await;
            });
        });
        Ok(Self {
            url: format!("http://{addr}"),
            stop: Some(tx),
        })
    }
}

impl Drop for BlobServer {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

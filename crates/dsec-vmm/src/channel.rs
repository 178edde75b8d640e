//! The host side of a microVM's agent channel (the contract is in `dsec_wire::vm`).
//!
//! The node talks to every agent through a unix socket. For a microVM that socket is a
//! listener the channel owns: each connection accepted there becomes one stream of the
//! yamux session carried by the VM's virtio-serial port, and the guest relays the stream
//! to its agent. The rest of the node is the same for every isolation level.
//!
//! A session starts with the handshake (hello and ready, with a fresh nonce). When it
//! ends (the guest rebooted, QEMU died, a snapshot restored the guest elsewhere) the
//! channel connects again and shakes hands anew until it is closed.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use dsec_wire::vm::{HELLO, MAX_HANDSHAKE_LINE, READY};
use futures::future::poll_fn;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot};
use tokio_util::compat::{FuturesAsyncReadCompatExt, TokioAsyncReadCompatExt};
use tokio_util::sync::CancellationToken;

/// How often the channel tries the VM's port again while it cannot connect.
const RECONNECT: Duration = Duration::from_millis(50);
/// How long a connection waits for the guest's answer before it is made anew.
const HANDSHAKE_RETRY: Duration = Duration::from_secs(2);
/// How long a node connection made while no session is up waits for one.
const WAIT_FOR_SESSION: Duration = Duration::from_secs(5);

/// Whether the guest answered the current session's handshake.
#[derive(Debug, Default)]
struct Ready {
    up: Mutex<bool>,
    changed: Condvar,
}

impl Ready {
    fn set(&self, up: bool) {
        *self.up.lock().unwrap_or_else(|p| p.into_inner()) = up;
        self.changed.notify_all();
    }
}

/// Waits for a channel's handshake (see [`Channel::ready_waiter`]).
#[derive(Debug, Clone)]
pub struct ReadyWaiter(Arc<Ready>);

impl ReadyWaiter {
    /// Blocks until the guest has answered the handshake, at most `timeout`; whether it
    /// did.
    pub fn wait(&self, timeout: Duration) -> bool {
        let guard = self.0.up.lock().unwrap_or_else(|p| p.into_inner());
        let (guard, _) = self
            .0
            .changed
            .wait_timeout_while(guard, timeout, |up| !*up)
            .unwrap_or_else(|p| p.into_inner());
        *guard
    }
}

/// One VM's channel: its listener for the node and the task that carries it.
#[derive(Debug)]
pub struct Channel {
    cancel: CancellationToken,
    ready: Arc<Ready>,
    listen: PathBuf,
}

impl Channel {
    /// Starts the channel on `rt`: listens at `listen` (a stale socket there is replaced)
    /// and connects to the VM's port socket `port` until the guest answers.
    pub fn start(rt: &tokio::runtime::Handle, port: PathBuf, listen: PathBuf) -> io::Result<Self> {
        let _ = std::fs::remove_file(&listen);
        let std_listener = std::os::unix::net::UnixListener::bind(&listen)?;
        std_listener.set_nonblocking(true)?;
        let listener = {
            let _entered = rt.enter();
            UnixListener::from_std(std_listener)?
        };
        let cancel = CancellationToken::new();
        let ready = Arc::new(Ready::default());
        let (c, r) = (cancel.clone(), ready.clone());
        rt.spawn(async move {
            tokio::select! {
                () = c.cancelled() => {}
                () = run(port, listener, r.clone()) => {}
            }
            r.set(false);
        });
        Ok(Self {
            cancel,
            ready,
            listen,
        })
    }

    /// Blocks until the guest has answered the handshake, at most `timeout`; whether it
    /// did.
    pub fn wait_ready(&self, timeout: Duration) -> bool {
        self.ready_waiter().wait(timeout)
    }

    /// A handle to wait for the handshake with, without holding the channel.
    pub fn ready_waiter(&self) -> ReadyWaiter {
        ReadyWaiter(self.ready.clone())
    }

    /// The socket the node connects to.
    pub fn socket(&self) -> &Path {
        &self.listen
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        self.cancel.cancel();
        let _ = std::fs::remove_file(&self.listen);
    }
}

/// Node connections waiting for a session, each with when it came.
type Waiting = Vec<(Instant, UnixStream)>;

async fn run(port: PathBuf, listener: UnixListener, ready: Arc<Ready>) {
    let mut waiting = Waiting::new();
    loop {
        match UnixStream::connect(&port).await {
            Ok(stream) => {
                if let Err(e) = session(stream, &listener, &ready, &mut waiting).await {
                    tracing::debug!(port = %port.display(), error = %e, "agent channel session ended");
                }
                ready.set(false);
            }
            Err(e) => {
                tracing::trace!(port = %port.display(), error = %e, "agent channel: port not there yet");
            }
        }
        // Between sessions the node's connections wait for the next one, but not for
        // long: a VM that is gone (QEMU killed) must answer with an error, not leave a
        // request hanging in the listener's backlog.
        let pause = tokio::time::sleep(RECONNECT);
        tokio::pin!(pause);
        loop {
            tokio::select! {
                _ = &mut pause => break,
                accepted = listener.accept() => {
                    if let Ok((local, _)) = accepted {
                        waiting.push((Instant::now(), local));
                    }
                }
            }
        }
        // Those that waited too long are closed: the node reads the end of its stream.
        waiting.retain(|(since, _)| since.elapsed() < WAIT_FOR_SESSION);
    }
}

/// Sends the hello and reads lines until the matching ready.
async fn handshake(stream: &mut UnixStream) -> io::Result<()> {
    let nonce = format!("{:016x}", rand::random::<u64>());
    stream
        .write_all(format!("{HELLO} {nonce}\n").as_bytes())
        .await?;
    let want = format!("{READY} {nonce}");
    let mut line = Vec::with_capacity(MAX_HANDSHAKE_LINE);
    let mut byte = [0u8; 1];
    loop {
        if stream.read(&mut byte).await? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the VM closed the channel during the handshake",
            ));
        }
        match byte[0] {
            b'\n' if line == want.as_bytes() => return Ok(()),
            b'\n' => line.clear(),
            b if line.len() < MAX_HANDSHAKE_LINE => line.push(b),
            _ => line.clear(),
        }
    }
}

/// Carries one session: relays the connections `waiting` for it, then every one
/// accepted on `listener`, each over its own yamux stream, until the session ends.
async fn session(
    mut stream: UnixStream,
    listener: &UnixListener,
    ready: &Ready,
    waiting: &mut Waiting,
) -> io::Result<()> {
    // A guest that does not answer in time gets a fresh connection: one restored from a
    // snapshot may still be in the session before, reading the hello as its frames; a
    // disconnect ends that session, and the next hello finds it waiting.
    tokio::time::timeout(HANDSHAKE_RETRY, handshake(&mut stream))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no handshake answer"))??;
    ready.set(true);
    let mut conn = yamux::Connection::new(
        stream.compat(),
        yamux::Config::default(),
        yamux::Mode::Client,
    );
    let (open_tx, mut open_rx) = mpsc::channel::<oneshot::Sender<yamux::Stream>>(64);
    let mut pending: Option<oneshot::Sender<yamux::Stream>> = None;
    for (_, local) in waiting.drain(..) {
        relay(local, open_tx.clone());
    }
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (local, _) = accepted?;
                relay(local, open_tx.clone());
            }
            ended = poll_fn(|cx| drive(&mut conn, &mut open_rx, &mut pending, cx)) => {
                return ended;
            }
        }
    }
}

/// Relays node connection `local` over a stream of the session that `open_tx` asks.
fn relay(local: UnixStream, open_tx: mpsc::Sender<oneshot::Sender<yamux::Stream>>) {
    tokio::spawn(async move {
        let (tx, rx) = oneshot::channel();
        if open_tx.send(tx).await.is_err() {
            return;
        }
        let Ok(remote) = rx.await else { return };
        let mut remote = remote.compat();
        let mut local = local;
        let _ = tokio::io::copy_bidirectional(&mut local, &mut remote).await;
    });
}

/// Opens the streams asked for and keeps the connection's I/O going; ready when the
/// session ends.
fn drive<T>(
    conn: &mut yamux::Connection<T>,
    open_rx: &mut mpsc::Receiver<oneshot::Sender<yamux::Stream>>,
    pending: &mut Option<oneshot::Sender<yamux::Stream>>,
    cx: &mut Context<'_>,
) -> Poll<io::Result<()>>
where
    T: futures::AsyncRead + futures::AsyncWrite + Unpin,
{
    loop {
        if pending.is_none() {
            if let Poll::Ready(Some(tx)) = open_rx.poll_recv(cx) {
                *pending = Some(tx);
            }
        }
        if pending.is_none() {
            break;
        }
        match conn.poll_new_outbound(cx) {
            Poll::Ready(Ok(s)) => {
                if let Some(tx) = pending.take() {
                    let _ = tx.send(s);
                }
            }
            Poll::Ready(Err(e)) => return Poll::Ready(Err(io::Error::other(e))),
            Poll::Pending => break,
        }
    }
    loop {
        match conn.poll_next_inbound(cx) {
            Poll::Ready(None) => return Poll::Ready(Ok(())),
            Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(io::Error::other(e))),
            // The guest opens no streams of its own.
            Poll::Ready(Some(Ok(_stream))) => continue,
            Poll::Pending => return Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host side against the agent's real guest side over a socket pair standing
    /// for the serial port, relaying to an echo server standing for the agent.
    #[test]
    fn streams_reach_the_guest_side_and_come_back() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("test step");
        let dir = tempfile::tempdir().expect("test step");
        let port = dir.path().join("port.sock");
        let agent = dir.path().join("agent.sock");
        let listen = dir.path().join("listen.sock");
        // The "agent": echoes each connection.
        let agent_listener = std::os::unix::net::UnixListener::bind(&agent).expect("test step");
        std::thread::spawn(move || {
            for c in agent_listener.incoming() {
                let Ok(mut c) = c else { break };
                std::thread::spawn(move || {
                    let mut r = c.try_clone().expect("test step");
                    let _ = std::io::copy(&mut r, &mut c);
                });
            }
        });
        // The "VM": QEMU's chardev listens on the port socket; the guest side serves
        // whatever connects.
        let port_listener = std::os::unix::net::UnixListener::bind(&port).expect("test step");
        port_listener.set_nonblocking(true).expect("test step");
        let agent2 = agent.clone();
        rt.spawn(async move {
            let l = UnixListener::from_std(port_listener).expect("test step");
            loop {
                let (s, _) = l.accept().await.expect("test step");
                let _ = dsec_agent::vm_channel::serve_session(s, &agent2).await;
            }
        });
        let ch = Channel::start(rt.handle(), port, listen.clone()).expect("test step");
        assert!(ch.wait_ready(Duration::from_secs(10)));
        // Several connections at once, each its own stream.
        let threads: Vec<_> = (0..8)
            .map(|i| {
                let listen = listen.clone();
                std::thread::spawn(move || {
                    use std::io::{Read, Write};
                    let mut c =
                        std::os::unix::net::UnixStream::connect(&listen).expect("test step");
                    let msg = vec![i as u8; 300_000];
                    let mut w = c.try_clone().expect("test step");
                    let m2 = msg.clone();
                    let writer = std::thread::spawn(move || {
                        w.write_all(&m2).expect("test step");
                        w.shutdown(std::net::Shutdown::Write).expect("test step");
                    });
                    let mut back = Vec::new();
                    c.read_to_end(&mut back).expect("test step");
                    writer.join().expect("test step");
                    assert_eq!(back, msg);
                })
            })
            .collect();
        for t in threads {
            t.join().expect("test step");
        }
        drop(ch);
        assert!(!listen.exists());
    }

    /// A VM that is gone (nothing at its port): a node connection ends within
    /// `WAIT_FOR_SESSION` instead of waiting in the listener's backlog for good.
    #[test]
    fn a_connection_to_a_gone_vm_ends_instead_of_hanging() {
        use std::io::{Read, Write};
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("test step");
        let dir = tempfile::tempdir().expect("test step");
        let listen = dir.path().join("listen.sock");
        let ch = Channel::start(rt.handle(), dir.path().join("port.sock"), listen.clone())
            .expect("test step");
        let t = Instant::now();
        let mut c = std::os::unix::net::UnixStream::connect(&listen).expect("test step");
        c.set_read_timeout(Some(WAIT_FOR_SESSION * 3))
            .expect("test step");
        c.write_all(b"a request").expect("test step");
        let mut buf = [0u8; 16];
        // Closed with the request unread: an end or a reset, both an error to the node.
        match c.read(&mut buf) {
            Ok(0) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            other => panic!("an end, not {other:?}"),
        }
        assert!(t.elapsed() < WAIT_FOR_SESSION * 2, "{:?}", t.elapsed());
        drop(ch);
    }
}

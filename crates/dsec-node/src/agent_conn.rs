//! One connection to a sandbox's agent, speaking the frame protocol of `dsec_wire::frame`.
//!
//! The request of an exec is on its way before the reactor has seen the socket: the
//! connect is a plain non-blocking `connect(2)` (a unix socket connects at once or
//! refuses), and buffered frames are written straight to the socket, falling back to the
//! reactor only when the socket is full. Waiting for write readiness first would cost a
//! reactor turn per request, which is a tenth of an exec round trip. The socket is a
//! [`QuietStream`], registered for reading only: the agent reading a request does not
//! wake the node.
//!
//! A connection whose last request [`keeps_connection`](Request::keeps_connection) can
//! carry the next one: the node keeps one idle connection per sandbox
//! (`LocalNode::reuse`), which saves both sides a socket, a connect/accept and
//! its teardown per exec.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;

use dsec_uds::{QuietStream, ReadHalf, WriteHalf};
use dsec_wire::agent::{Reply, Request};
use dsec_wire::frame::{Frame, FrameError};
use dsec_wire::{ApiError, ErrorCode};
use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, UnixAddr};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};

/// Buffered output beyond this size is written before more is added.
const WRITE_BUFFER: usize = 64 * 1024;

/// Size of a connection's read buffer: replies are small, and a larger payload is read
/// past the buffer. Idle connections are kept, one per sandbox, so this is per sandbox.
const READ_BUFFER: usize = 8 * 1024;

/// A connected agent stream, carrying one request at a time.
#[derive(Debug)]
pub struct AgentConn {
    reader: BufReader<ReadHalf>,
    writer: WriteHalf,
    /// Frames sent but not yet written to the socket.
    out: Vec<u8>,
}

fn proto_err(e: impl std::fmt::Display) -> ApiError {
    ApiError::new(
        ErrorCode::AgentUnavailable,
        format!("agent connection: {e}"),
    )
}

/// Connects to the unix socket at `path` without waiting on the reactor.
pub fn connect_now(path: &Path) -> std::io::Result<QuietStream> {
    let fd: OwnedFd = socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    let addr = UnixAddr::new(path)?;
    socket::connect(fd.as_raw_fd(), &addr)?;
    QuietStream::from_std(std::os::unix::net::UnixStream::from(fd))
}

impl AgentConn {
    /// Wraps a connected stream.
    pub fn new(stream: QuietStream) -> Self {
        let (r, w) = stream.into_split();
        Self {
            reader: BufReader::with_capacity(READ_BUFFER, r),
            writer: w,
            out: Vec::new(),
        }
    }

    /// Sends a frame (buffered; call [`AgentConn::flush`] or use [`AgentConn::request`]).
    pub async fn send(&mut self, frame: &Frame) -> Result<(), ApiError> {
        // The agent would drop the connection over a frame it cannot take: a request
        // this large (a huge command or environment) is the caller's to shrink.
        if frame.encoded_len() > dsec_wire::frame::MAX_FRAME + 5 {
            return Err(ApiError::new(
                ErrorCode::PayloadTooLarge,
                format!(
                    "request of {} bytes is over the agent's limit of {} bytes per message: \
                     pass large data through stdin or a file",
                    frame.encoded_len(),
                    dsec_wire::frame::MAX_FRAME
                ),
            ));
        }
        if !self.out.is_empty() && self.out.len() + frame.encoded_len() > WRITE_BUFFER {
            self.flush().await?;
        }
        frame.encode(&mut self.out);
        Ok(())
    }

    /// Writes buffered frames: straight to the socket while it takes them, then through
    /// the reactor.
    pub async fn flush(&mut self) -> Result<(), ApiError> {
        self.writer.write_all(&self.out).await.map_err(proto_err)?;
        self.out.clear();
        Ok(())
    }

    /// Sends a request frame and flushes.
    pub async fn send_request(&mut self, req: &Request) -> Result<(), ApiError> {
        self.send(&Frame::json(req)).await?;
        self.flush().await
    }

    /// Receives the next frame; `None` when the agent closed the connection.
    pub async fn recv(&mut self) -> Result<Option<Frame>, ApiError> {
        let mut header = [0u8; 5];
        match self.reader.read_exact(&mut header).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(proto_err(e)),
        }
        let (tag, len) = Frame::parse_header(header).map_err(|e: FrameError| proto_err(e))?;
        let mut payload = vec![0u8; len];
        self.reader
            .read_exact(&mut payload)
            .await
            .map_err(proto_err)?;
        Frame::from_parts(tag, payload).map(Some).map_err(proto_err)
    }

    /// Receives the next frame, which must exist.
    pub async fn recv_some(&mut self) -> Result<Frame, ApiError> {
        self.recv()
            .await?
            .ok_or_else(|| proto_err("agent closed the connection early"))
    }

    /// Receives a JSON reply; an `Error` reply becomes `Err`.
    pub async fn recv_reply(&mut self) -> Result<Reply, ApiError> {
        match self.recv_some().await? {
            Frame::Json(bytes) => match serde_json::from_slice::<Reply>(&bytes) {
                Ok(Reply::Error(e)) => Err(e),
                Ok(reply) => Ok(reply),
                Err(e) => Err(proto_err(format!("bad reply: {e}"))),
            },
            other => Err(proto_err(format!("expected a reply, got {other:?}"))),
        }
    }

    /// Sends a request without input and returns its single reply.
    pub async fn request(&mut self, req: &Request) -> Result<Reply, ApiError> {
        self.send_request(req).await?;
        self.recv_reply().await
    }

    /// Whether this connection can carry a new request: nothing buffered either way, and
    /// the agent has neither closed its side nor sent anything unasked.
    pub fn is_reusable(&self) -> bool {
        if !self.out.is_empty() || !self.reader.buffer().is_empty() {
            return false;
        }
        let mut pfd = libc::pollfd {
            fd: self.writer.as_raw_fd(),
            events: libc::POLLIN | libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: poll on one pollfd we own, without waiting.
        let n = unsafe { libc::poll(&mut pfd, 1, 0) };
        n == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Frames far larger than the socket buffer arrive whole and in order: the direct
    /// write stops when the socket is full and the reactor writes the rest.
    /// A connection to `listener` at `path` and the listener's end of it.
    async fn connected(path: &Path, listener: &tokio::net::UnixListener) -> (AgentConn, AgentConn) {
        let conn = AgentConn::new(connect_now(path).expect("connect"));
        let (peer, _) = listener.accept().await.expect("accept");
        let peer = QuietStream::from_std(peer.into_std().expect("std")).expect("take over");
        (conn, AgentConn::new(peer))
    }

    #[tokio::test]
    async fn frames_beyond_the_socket_buffer_arrive_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("agent.sock");
        let listener = tokio::net::UnixListener::bind(&path).expect("bind");
        let (mut conn, mut peer) = connected(&path, &listener).await;
        let big: Vec<u8> = (0..3 * 1024 * 1024).map(|i| (i % 251) as u8).collect();
        let writer = async {
            conn.send(&Frame::json(&Request::Ping)).await.expect("send");
            for chunk in big.chunks(dsec_wire::frame::DATA_CHUNK) {
                conn.send(&Frame::Data(chunk.to_vec())).await.expect("send");
            }
            conn.send(&Frame::Eof).await.expect("send");
            conn.flush().await.expect("flush");
        };
        let reader = async {
            let mut got = Vec::new();
            assert!(matches!(peer.recv_some().await, Ok(Frame::Json(_))));
            loop {
                match peer.recv_some().await.expect("frame") {
                    Frame::Data(d) => got.extend_from_slice(&d),
                    Frame::Eof => break,
                    other => panic!("unexpected {other:?}"),
                }
            }
            got
        };
        let ((), got) = tokio::join!(writer, reader);
        assert_eq!(got.len(), big.len());
        assert!(got == big, "payload corrupted");
    }

    /// An idle connection is reusable until the agent closes its side or sends
    /// something nobody asked for.
    #[tokio::test]
    async fn reusable_only_while_the_peer_is_silent_and_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("agent.sock");
        let listener = tokio::net::UnixListener::bind(&path).expect("bind");
        let (mut conn, mut peer) = connected(&path, &listener).await;
        assert!(conn.is_reusable(), "fresh connection");
        // A full exchange leaves it reusable.
        let ask = async { conn.request(&Request::Ping).await };
        let answer = async {
            assert!(matches!(peer.recv_some().await, Ok(Frame::Json(_))));
            peer.send(&Frame::json(&Reply::Pong { version: 1, pid: 1 }))
                .await
                .expect("send");
            peer.flush().await.expect("flush");
        };
        let (reply, ()) = tokio::join!(ask, answer);
        assert!(matches!(reply, Ok(Reply::Pong { .. })), "{reply:?}");
        assert!(conn.is_reusable(), "after a full exchange");
        // Unasked bytes: not reusable.
        peer.send(&Frame::Eof).await.expect("send");
        peer.flush().await.expect("flush");
        assert!(!conn.is_reusable(), "peer sent unasked data");
        // A closed peer: not reusable.
        let (mut conn2, peer2) = connected(&path, &listener).await;
        assert!(conn2.is_reusable());
        drop(peer2);
        assert!(!conn2.is_reusable(), "peer closed");
        assert!(conn2.request(&Request::Ping).await.is_err());
    }

    #[test]
    fn connecting_to_nothing_is_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .expect("runtime");
        let err = rt
            .block_on(async { connect_now(&dir.path().join("none.sock")) })
            .expect_err("no listener");
        assert_eq!(err.kind(), std::io::ErrorKind::NotFound);
    }
}

//! One connection to a sandbox's agent, speaking the frame protocol of `dsec_wire::frame`.

use dsec_wire::agent::{Reply, Request};
use dsec_wire::frame::{Frame, FrameError};
use dsec_wire::{ApiError, ErrorCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;

/// A connected agent stream. One request per connection.
#[derive(Debug)]
pub struct AgentConn {
    reader: BufReader<OwnedReadHalf>,
    writer: BufWriter<OwnedWriteHalf>,
}

fn proto_err(e: impl std::fmt::Display) -> ApiError {
    ApiError::new(
        ErrorCode::AgentUnavailable,
        format!("agent connection: {e}"),
    )
}

impl AgentConn {
    /// Wraps a connected stream.
    pub fn new(stream: UnixStream) -> Self {
        let (r, w) = stream.into_split();
        Self {
            reader: BufReader::with_capacity(64 * 1024, r),
            writer: BufWriter::new(w),
        }
    }

    /// Sends a frame (buffered; call [`AgentConn::flush`] or use [`AgentConn::request`]).
    pub async fn send(&mut self, frame: &Frame) -> Result<(), ApiError> {
        self.writer
            .write_all(&frame.to_bytes())
            .await
            .map_err(proto_err)
    }

    /// Flushes buffered frames.
    pub async fn flush(&mut self) -> Result<(), ApiError> {
        self.writer.flush().await.map_err(proto_err)
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
    pub async fn request(mut self, req: &Request) -> Result<Reply, ApiError> {
        self.send_request(req).await?;
        self.recv_reply().await
    }
}

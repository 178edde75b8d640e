//! Frame I/O over one node connection: a [`FrameReader`] and a [`FrameWriter`] on the two
//! halves of a [`QuietStream`] (registered with the reactor for reading only, so the
//! node reading a reply does not wake the agent), so input (stdin, uploads, disconnect
//! detection) and output can proceed concurrently.

use std::io::{self, IoSlice};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use dsec_uds::{QuietStream, ReadHalf, WriteHalf};
use dsec_wire::agent::Reply;
use dsec_wire::frame::{data_header, Frame, DATA_CHUNK, MAX_FRAME};
use dsec_wire::{ApiError, ErrorCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};

use crate::sys;

/// Reads frames from the node.
#[derive(Debug)]
pub struct FrameReader {
    inner: BufReader<ReadHalf>,
}

/// Writes frames to the node.
#[derive(Debug)]
pub struct FrameWriter {
    inner: WriteHalf,
}

/// Which output frame kind to send data as.
pub use dsec_wire::frame::DataKind;

/// Size of a connection's read buffer.
const READ_BUFFER: usize = 8 * 1024;

/// Splits a connection into its reader and writer (registering it with the reactor).
pub fn split(stream: UnixStream) -> io::Result<(FrameReader, FrameWriter)> {
    let (rd, wr) = QuietStream::from_std(stream)?.into_split();
    Ok((
        FrameReader {
            // Requests are small; a bigger payload is read past the buffer. Every
            // connection zeroes its buffer, and a fresh sandbox's first ones fault in
            // new pages for it: 64 KiB cost each create's ping and first exec 16 faults.
            inner: BufReader::with_capacity(READ_BUFFER, rd),
        },
        FrameWriter { inner: wr },
    ))
}

impl FrameReader {
    /// The next frame; `Ok(None)` when the node closed its side at a frame boundary.
    pub async fn next(&mut self) -> io::Result<Option<Frame>> {
        let mut header = [0u8; 5];
        let mut got = 0;
        while got < header.len() {
            let n = self.inner.read(&mut header[got..]).await?;
            if n == 0 {
                if got == 0 {
                    return Ok(None);
                }
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            got += n;
        }
        let (tag, len) = Frame::parse_header(header)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        let mut payload = vec![0u8; len];
        self.inner.read_exact(&mut payload).await?;
        Frame::from_parts(tag, payload)
            .map(Some)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }

    /// Reads and discards input frames up to and including `Eof`. Returns false if the
    /// node went away first.
    pub async fn drain_input(&mut self) -> bool {
        loop {
            match self.next().await {
                Ok(Some(Frame::Eof)) => return true,
                Ok(Some(_)) => continue,
                Ok(None) | Err(_) => return false,
            }
        }
    }

    /// Resolves once the node has fully closed the connection. Extra frames are ignored.
    /// A half-close (the node shut down only its write side) does not count: it is
    /// re-checked every half second until the node closes completely.
    pub async fn closed(&mut self) {
        loop {
            match self.next().await {
                Ok(Some(_)) => continue,
                Ok(None) => break,
                Err(_) => return,
            }
        }
        while !sys::peer_hung_up(self.inner.get_ref().as_raw_fd()) {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

impl FrameWriter {
    /// Sends one frame.
    pub async fn send(&mut self, frame: &Frame) -> io::Result<()> {
        let bytes = frame.to_bytes();
        self.inner.write_all(&bytes).await
    }

    /// Sends a JSON reply.
    pub async fn reply(&mut self, reply: &Reply) -> io::Result<()> {
        self.send(&reply_frame(reply)).await
    }

    /// Sends an error reply.
    pub async fn error(&mut self, err: ApiError) -> io::Result<()> {
        tracing::debug!(code = ?err.code, message = %err.message, "request failed");
        self.reply(&Reply::Error(err)).await
    }

    /// Sends `data` as frames of `kind`, split into chunks of at most `DATA_CHUNK`.
    pub async fn data(&mut self, kind: DataKind, data: &[u8]) -> io::Result<()> {
        self.data_then(&[(kind, data)], None).await
    }

    /// Sends each part as frames of its kind (chunks of at most `DATA_CHUNK`), then
    /// `reply` if given, in as few `sendmsg` calls as the socket allows: each call wakes
    /// the node once, however many frames it carries.
    pub async fn data_then(
        &mut self,
        parts: &[(DataKind, &[u8])],
        reply: Option<&Reply>,
    ) -> io::Result<()> {
        let frames: Vec<([u8; 5], &[u8])> = parts
            .iter()
            .flat_map(|&(kind, data)| data.chunks(DATA_CHUNK).map(move |c| (kind, c)))
            .map(|(kind, chunk)| (data_header(kind, chunk.len()), chunk))
            .collect();
        let reply = reply.map(|r| reply_frame(r).to_bytes());
        let mut slices: Vec<IoSlice<'_>> = frames
            .iter()
            .flat_map(|(header, chunk)| [IoSlice::new(header), IoSlice::new(chunk)])
            .chain(reply.as_deref().map(IoSlice::new))
            .collect();
        let mut rest = &mut slices[..];
        while !rest.is_empty() {
            let n = self.inner.write_vectored(rest).await?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            IoSlice::advance_slices(&mut rest, n);
        }
        Ok(())
    }

    /// Sends an `Eof` frame.
    pub async fn eof(&mut self) -> io::Result<()> {
        self.send(&Frame::Eof).await
    }

    /// Flushes and shuts down the write side.
    pub async fn finish(mut self) {
        let _ = self.inner.flush().await;
        let _ = self.inner.shutdown().await;
    }
}

/// The frame of `reply`, or of an error saying it is too large for one: the node refuses
/// frames over [`MAX_FRAME`] (a directory of tens of thousands of entries would answer
/// so), and an answer it cannot read must not look like a broken agent.
fn reply_frame(reply: &Reply) -> Frame {
    let frame = Frame::json(reply);
    let len = frame.encoded_len() - 5;
    if len <= MAX_FRAME {
        return frame;
    }
    Frame::json(&Reply::Error(ApiError::new(
        ErrorCode::PayloadTooLarge,
        format!(
            "the answer is {len} bytes, over the {} MiB an agent reply may carry: ask for \
             less (a subdirectory, fewer entries)",
            MAX_FRAME >> 20
        ),
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn data_frames_match_the_codec() {
        let (a, b) = UnixStream::pair().expect("pair");
        let (_ra, mut wa) = split(a).expect("split");
        let (mut rb, _wb) = split(b).expect("split");
        let big = vec![7u8; DATA_CHUNK + 10];
        // Write concurrently with reading: the socket buffer is smaller than the data.
        let writer = async {
            wa.data(DataKind::Stderr, &big).await.expect("send");
            wa.data(DataKind::Data, b"x").await.expect("send");
            wa.data(DataKind::Stdout, b"y").await.expect("send");
            wa.eof().await.expect("eof");
        };
        let reader = async {
            let mut frames = Vec::new();
            for _ in 0..5 {
                frames.push(rb.next().await.expect("frame"));
            }
            frames
        };
        let ((), frames) = tokio::join!(writer, reader);
        let want = vec![
            Some(Frame::Stderr(vec![7; DATA_CHUNK])),
            Some(Frame::Stderr(vec![7; 10])),
            Some(Frame::Data(b"x".to_vec())),
            Some(Frame::Stdout(b"y".to_vec())),
            Some(Frame::Eof),
        ];
        assert_eq!(frames, want);
    }

    #[tokio::test]
    async fn output_and_reply_go_out_together_in_order() {
        let (a, b) = UnixStream::pair().expect("pair");
        let (_ra, mut wa) = split(a).expect("split");
        let (mut rb, _wb) = split(b).expect("split");
        // More than the socket holds, so some sendmsg calls take only part of a frame.
        let big: Vec<u8> = (0..3 * DATA_CHUNK + 7).map(|i| (i % 251) as u8).collect();
        let reply = Reply::Pong { version: 2, pid: 1 };
        let writer = async {
            let parts = [
                (DataKind::Stdout, &big[..]),
                (DataKind::Stdout, &b""[..]),
                (DataKind::Stderr, &b"warning\n"[..]),
            ];
            wa.data_then(&parts, Some(&reply)).await.expect("send");
            wa.data_then(&[], Some(&reply)).await.expect("reply alone");
        };
        let reader = async {
            let mut frames = Vec::new();
            for _ in 0..7 {
                frames.push(rb.next().await.expect("frame").expect("open"));
            }
            frames
        };
        let ((), frames) = tokio::join!(writer, reader);
        let mut want: Vec<Frame> = big
            .chunks(DATA_CHUNK)
            .map(|c| Frame::Stdout(c.to_vec()))
            .collect();
        want.push(Frame::Stderr(b"warning\n".to_vec()));
        want.push(Frame::json(&reply));
        want.push(Frame::json(&reply));
        assert_eq!(frames, want);
    }

    #[tokio::test]
    async fn a_reply_over_the_frame_limit_goes_out_as_an_error() {
        let (a, b) = UnixStream::pair().expect("pair");
        let (_ra, mut wa) = split(a).expect("split");
        let (mut rb, _wb) = split(b).expect("split");
        let entry = |i: usize| dsec_wire::agent::FileInfo {
            name: format!("{i:0>200}"),
            path: format!("/many/{i:0>200}"),
            kind: dsec_wire::agent::FileKind::File,
            size: 0,
            mode: 0o644,
            mtime: 0,
            uid: 0,
            gid: 0,
            symlink_target: None,
        };
        let huge = Reply::Entries {
            entries: (0..12_000).map(entry).collect(),
        };
        let writer = async {
            wa.reply(&huge).await.expect("reply");
            wa.data_then(&[], Some(&huge))
                .await
                .expect("reply after data");
        };
        let reader = async {
            let mut frames = Vec::new();
            for _ in 0..2 {
                frames.push(rb.next().await.expect("a frame the node can read"));
            }
            frames
        };
        let ((), frames) = tokio::join!(writer, reader);
        for frame in frames {
            let Some(Frame::Json(json)) = frame else {
                panic!("a JSON frame");
            };
            match serde_json::from_slice::<Reply>(&json).expect("a reply") {
                Reply::Error(e) => {
                    assert_eq!(e.code, ErrorCode::PayloadTooLarge);
                    assert!(e.message.contains("fewer entries"), "{}", e.message);
                }
                other => panic!("an error, not {other:?}"),
            }
        }
    }
}

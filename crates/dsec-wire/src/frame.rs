//! Frame codec of the node <-> agent byte stream.
//!
//! Layout of one frame: `len: u32 big-endian` (bytes after the length field), `tag: u8`,
//! then `len - 1` payload bytes. JSON control messages and raw data travel as separate
//! frames so file contents and process output are never base64-encoded on this hop.
//! Pure functions over buffers; the transports do the reading and writing.

/// Largest payload one frame may carry. Senders split data into frames of at most
/// [`DATA_CHUNK`] bytes; the decoder rejects anything larger than this.
pub const MAX_FRAME: usize = 4 * 1024 * 1024;

/// Size that senders use when chunking data.
pub const DATA_CHUNK: usize = 256 * 1024;

/// One frame on the agent stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// A JSON-encoded [`crate::agent::Request`] or [`crate::agent::Reply`].
    Json(Vec<u8>),
    /// Bytes a process wrote to its stdout (or the merged output of a PTY/session).
    Stdout(Vec<u8>),
    /// Bytes a process wrote to its stderr.
    Stderr(Vec<u8>),
    /// Opaque data: file contents, tar streams, stdin.
    Data(Vec<u8>),
    /// End of a data sequence.
    Eof,
}

const TAG_JSON: u8 = 0;
const TAG_STDOUT: u8 = 1;
const TAG_STDERR: u8 = 2;
const TAG_DATA: u8 = 3;
const TAG_EOF: u8 = 4;

/// The kind of a raw data frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataKind {
    /// [`Frame::Stdout`].
    Stdout,
    /// [`Frame::Stderr`].
    Stderr,
    /// [`Frame::Data`].
    Data,
}

impl DataKind {
    fn tag(self) -> u8 {
        match self {
            DataKind::Stdout => TAG_STDOUT,
            DataKind::Stderr => TAG_STDERR,
            DataKind::Data => TAG_DATA,
        }
    }
}

/// The 5 header bytes of a frame with `tag` and `payload_len` bytes of payload.
fn header(tag: u8, payload_len: usize) -> [u8; 5] {
    let len = u32::try_from(payload_len + 1).unwrap_or(u32::MAX);
    let mut out = [0u8; 5];
    out[..4].copy_from_slice(&len.to_be_bytes());
    out[4] = tag;
    out
}

/// The header of a data frame of `kind` carrying `payload_len` bytes, for senders that
/// write the payload from where it lies (a vectored write) instead of encoding a copy.
pub fn data_header(kind: DataKind, payload_len: usize) -> [u8; 5] {
    header(kind.tag(), payload_len)
}

/// A malformed frame. The stream is unusable after one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The length prefix is zero or exceeds [`MAX_FRAME`].
    #[error("frame length {0} out of range")]
    BadLength(usize),
    /// The tag byte is unknown.
    #[error("unknown frame tag {0}")]
    BadTag(u8),
}

impl Frame {
    /// Builds a JSON frame from a serializable value.
    pub fn json<T: serde::Serialize>(value: &T) -> Self {
        // Serializing our own plain structs to a Vec cannot fail.
        Frame::Json(serde_json::to_vec(value).unwrap_or_default())
    }

    /// Appends the encoded frame to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let (tag, payload): (u8, &[u8]) = match self {
            Frame::Json(b) => (TAG_JSON, b),
            Frame::Stdout(b) => (TAG_STDOUT, b),
            Frame::Stderr(b) => (TAG_STDERR, b),
            Frame::Data(b) => (TAG_DATA, b),
            Frame::Eof => (TAG_EOF, &[]),
        };
        out.extend_from_slice(&header(tag, payload.len()));
        out.extend_from_slice(payload);
    }

    /// Encodes into a fresh buffer.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(5 + self.payload_len());
        self.encode(&mut out);
        out
    }

    /// Length of the encoded frame: header and payload.
    pub fn encoded_len(&self) -> usize {
        5 + self.payload_len()
    }

    fn payload_len(&self) -> usize {
        match self {
            Frame::Json(b) | Frame::Stdout(b) | Frame::Stderr(b) | Frame::Data(b) => b.len(),
            Frame::Eof => 0,
        }
    }

    /// Parses the header of a frame: returns the payload length (without the tag) once
    /// the 5 header bytes are known.
    pub fn parse_header(header: [u8; 5]) -> Result<(u8, usize), FrameError> {
        let len = u32::from_be_bytes([header[0], header[1], header[2], header[3]]) as usize;
        if len == 0 || len > MAX_FRAME + 1 {
            return Err(FrameError::BadLength(len));
        }
        let tag = header[4];
        if tag > TAG_EOF {
            return Err(FrameError::BadTag(tag));
        }
        Ok((tag, len - 1))
    }

    /// Builds a frame from a tag checked by [`Frame::parse_header`] and its payload.
    pub fn from_parts(tag: u8, payload: Vec<u8>) -> Result<Self, FrameError> {
        Ok(match tag {
            TAG_JSON => Frame::Json(payload),
            TAG_STDOUT => Frame::Stdout(payload),
            TAG_STDERR => Frame::Stderr(payload),
            TAG_DATA => Frame::Data(payload),
            TAG_EOF => Frame::Eof,
            other => return Err(FrameError::BadTag(other)),
        })
    }

    /// Decodes one frame from the front of `buf`, draining it; `Ok(None)` if `buf` does
    /// not yet hold a whole frame.
    pub fn decode(buf: &mut Vec<u8>) -> Result<Option<Frame>, FrameError> {
        if buf.len() < 5 {
            return Ok(None);
        }
        let header = [buf[0], buf[1], buf[2], buf[3], buf[4]];
        let (tag, len) = Frame::parse_header(header)?;
        if buf.len() < 5 + len {
            return Ok(None);
        }
        let payload = buf[5..5 + len].to_vec();
        buf.drain(..5 + len);
        Frame::from_parts(tag, payload).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_data_header_is_the_one_encode_writes() {
        for (kind, frame) in [
            (DataKind::Stdout, Frame::Stdout(b"out".to_vec())),
            (DataKind::Stderr, Frame::Stderr(b"err".to_vec())),
            (DataKind::Data, Frame::Data(Vec::new())),
        ] {
            let bytes = frame.to_bytes();
            assert_eq!(data_header(kind, bytes.len() - 5), bytes[..5]);
        }
    }

    #[test]
    fn round_trip_all_kinds() {
        let frames = vec![
            Frame::Json(br#"{"op":"ping"}"#.to_vec()),
            Frame::Stdout(b"out".to_vec()),
            Frame::Stderr(vec![0xff, 0x00]),
            Frame::Data(vec![7; 1000]),
            Frame::Eof,
        ];
        let mut buf = Vec::new();
        for f in &frames {
            f.encode(&mut buf);
        }
        // Feed byte by byte to exercise partial reads.
        let mut partial = Vec::new();
        let mut decoded = Vec::new();
        for b in buf {
            partial.push(b);
            while let Some(f) = Frame::decode(&mut partial).expect("valid frame") {
                decoded.push(f);
            }
        }
        assert_eq!(decoded, frames);
        assert!(partial.is_empty());
    }

    #[test]
    fn rejects_oversized_and_bad_tags() {
        let mut buf = ((MAX_FRAME + 2) as u32).to_be_bytes().to_vec();
        buf.push(0);
        assert_eq!(
            Frame::decode(&mut buf),
            Err(FrameError::BadLength(MAX_FRAME + 2))
        );
        let mut buf = vec![0, 0, 0, 1, 9];
        assert_eq!(Frame::decode(&mut buf), Err(FrameError::BadTag(9)));
        let mut buf = vec![0, 0, 0, 0, 0];
        assert_eq!(Frame::decode(&mut buf), Err(FrameError::BadLength(0)));
    }
}

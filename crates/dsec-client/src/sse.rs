//! Decoding of the Server-Sent Events of `GET /v1/events`: blocks of `field: value`
//! lines ended by a blank line; `data` holds the event's JSON, an `error` event the
//! error that ended the stream; comments (keep-alives) are skipped.

use bytes::BytesMut;
use dsec_wire::v1::Event;
use dsec_wire::ApiError;
use futures::stream::BoxStream;
use futures::StreamExt;

use crate::ClientError;

/// Longest event block accepted, in bytes.
const MAX_BLOCK_BYTES: usize = 1 << 20;

/// Splits an SSE body into events.
#[derive(Debug, Default)]
pub struct SseDecoder {
    buf: BytesMut,
}

impl SseDecoder {
    /// Appends a chunk.
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The next whole event, if one is buffered (a stream error is `Err`).
    pub fn next_event(&mut self) -> Option<Result<Event, ClientError>> {
        loop {
            let Some(end) = block_end(&self.buf) else {
                if self.buf.len() > MAX_BLOCK_BYTES {
                    self.buf.clear();
                    return Some(Err(ClientError::Decode(format!(
                        "an event longer than {MAX_BLOCK_BYTES} bytes"
                    ))));
                }
                return None;
            };
            let block = self.buf.split_to(end);
            if let Some(event) = decode_block(&String::from_utf8_lossy(&block)) {
                return Some(event);
            }
        }
    }
}

/// Where the first block (with its blank line) ends.
fn block_end(buf: &[u8]) -> Option<usize> {
    (0..buf.len()).find_map(|i| {
        if buf[i..].starts_with(b"\n\n") {
            Some(i + 2)
        } else if buf[i..].starts_with(b"\r\n\r\n") {
            Some(i + 4)
        } else {
            None
        }
    })
}

fn decode_block(block: &str) -> Option<Result<Event, ClientError>> {
    let mut name = "message";
    let mut data = String::new();
    for line in block.lines() {
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value);
        match field {
            "event" => name = value,
            "data" => {
                if !data.is_empty() {
                    data.push('\n');
                }
                data.push_str(value);
            }
            _ => {}
        }
    }
    if data.is_empty() {
        return None;
    }
    let bad = |e: serde_json::Error| {
        ClientError::Decode(format!(
            "bad {name} event ({e}): {}",
            &data[..data.len().min(200)]
        ))
    };
    Some(match name {
        "error" => Err(serde_json::from_str::<ApiError>(&data)
            .map(ClientError::Api)
            .unwrap_or_else(bad)),
        _ => serde_json::from_str::<Event>(&data).map_err(bad),
    })
}

/// The events of an SSE response body; an error ends the stream after it is yielded.
pub(crate) fn events(resp: reqwest::Response) -> BoxStream<'static, Result<Event, ClientError>> {
    let state = (resp.bytes_stream().boxed(), SseDecoder::default(), false);
    futures::stream::unfold(state, |(mut body, mut decoder, failed)| async move {
        if failed {
            return None;
        }
        loop {
            if let Some(ev) = decoder.next_event() {
                let failed = ev.is_err();
                return Some((ev, (body, decoder, failed)));
            }
            match body.next().await {
                Some(Ok(chunk)) => decoder.push(&chunk),
                Some(Err(e)) => return Some((Err(ClientError::Http(e)), (body, decoder, true))),
                None => return None,
            }
        }
    })
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_split_across_chunks_comments_and_errors() {
        let text = concat!(
            ": keep-alive\n\n",
            "id: 7\nevent: deleted\ndata: {\"id\":7,\"at_ms\":1,\"kind\":\"deleted\",\"sandbox\":\"sb-1\"}\n\n",
            "event: error\ndata: {\"code\":\"unavailable\",\"message\":\"store gone\"}\n\n",
        );
        let mut d = SseDecoder::default();
        for b in text.as_bytes().chunks(5) {
            d.push(b);
        }
        let first = d.next_event().expect("an event").expect("not an error");
        assert_eq!((first.id, first.sandbox.as_deref()), (7, Some("sb-1")));
        match d.next_event() {
            Some(Err(ClientError::Api(e))) => assert_eq!(e.message, "store gone"),
            other => panic!("{other:?}"),
        }
        assert!(d.next_event().is_none());
    }
}

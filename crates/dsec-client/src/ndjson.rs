//! Decoding of NDJSON event streams (`application/x-ndjson`, one event per line: an
//! `ExecEvent` of exec and process output, an `ImportEvent` of an image import).

use std::marker::PhantomData;

use bytes::{Buf, BytesMut};
use dsec_wire::v1::ExecEvent;
use futures::stream::BoxStream;
use futures::StreamExt;
use serde::de::DeserializeOwned;

use crate::ClientError;

/// Splits bytes that arrive in arbitrary chunks into lines and decodes each line as a `T`
/// (an [`ExecEvent`] by default). Blank lines are skipped.
#[derive(Debug)]
pub struct NdjsonDecoder<T = ExecEvent> {
    buf: BytesMut,
    _event: PhantomData<fn() -> T>,
}

impl<T> Default for NdjsonDecoder<T> {
    fn default() -> Self {
        Self {
            buf: BytesMut::new(),
            _event: PhantomData,
        }
    }
}

impl<T: DeserializeOwned> NdjsonDecoder<T> {
    /// Appends a chunk.
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The next complete line's event, if a whole line is buffered.
    pub fn next_event(&mut self) -> Option<Result<T, ClientError>> {
        loop {
            let pos = self.buf.iter().position(|&b| b == b'\n')?;
            let line = self.buf.split_to(pos + 1);
            if let Some(ev) = decode_line(&line[..pos]) {
                return Some(ev);
            }
        }
    }

    /// At end of input: the event of a final line without a trailing newline, if any.
    pub fn finish(&mut self) -> Option<Result<T, ClientError>> {
        let rest = std::mem::take(&mut self.buf);
        decode_line(rest.chunk())
    }
}

fn decode_line<T: DeserializeOwned>(line: &[u8]) -> Option<Result<T, ClientError>> {
    if line.iter().all(u8::is_ascii_whitespace) {
        return None;
    }
    Some(serde_json::from_slice(line).map_err(|e| {
        let text = String::from_utf8_lossy(&line[..line.len().min(200)]).into_owned();
        ClientError::Decode(format!("bad event line ({e}): {text}"))
    }))
}

struct State<T> {
    body: BoxStream<'static, reqwest::Result<bytes::Bytes>>,
    decoder: NdjsonDecoder<T>,
    done: bool,
}

/// The events of an NDJSON response body. A transport error ends the stream after it is
/// yielded.
pub(crate) fn events<T: DeserializeOwned + Send + 'static>(
    resp: reqwest::Response,
) -> BoxStream<'static, Result<T, ClientError>> {
    let state = State {
        body: resp.bytes_stream().boxed(),
        decoder: NdjsonDecoder::default(),
        done: false,
    };
    futures::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(ev) = st.decoder.next_event() {
                return Some((ev, st));
            }
            if st.done {
                return st.decoder.finish().map(|ev| (ev, st));
            }
            match st.body.next().await {
                Some(Ok(chunk)) => st.decoder.push(&chunk),
                Some(Err(e)) => {
                    st.done = true;
                    st.decoder = NdjsonDecoder::default();
                    return Some((Err(ClientError::Http(e)), st));
                }
                None => st.done = true,
            }
        }
    })
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_split_across_chunks() {
        let text = concat!(
            r#"{"type":"started","pid":4}"#,
            "\n",
            r#"{"type":"stdout","data":"a\nb"}"#,
            "\n\n",
            r#"{"type":"exit","exit_code":0,"signal":null,"duration_ms":5,"timed_out":false,"#,
            r#""stdout_bytes":3,"stderr_bytes":0,"stdout_truncated":false,"stderr_truncated":false,"oom_killed":false}"#
        );
        // Feed one byte at a time: every split point is exercised.
        let mut d = NdjsonDecoder::<ExecEvent>::default();
        let mut events = Vec::new();
        for b in text.as_bytes() {
            d.push(std::slice::from_ref(b));
            while let Some(ev) = d.next_event() {
                events.push(ev.expect("valid event"));
            }
        }
        if let Some(ev) = d.finish() {
            events.push(ev.expect("valid final event"));
        }
        assert_eq!(events.len(), 3);
        assert_eq!(events[0], ExecEvent::Started { pid: 4 });
        assert_eq!(
            events[1],
            ExecEvent::Stdout {
                data: "a\nb".into()
            }
        );
        assert!(
            matches!(&events[2], ExecEvent::Exit { exit, oom_killed: false } if exit.exit_code == Some(0))
        );
        assert!(d.finish().is_none());
    }

    #[test]
    fn garbage_is_a_decode_error() {
        let mut d = NdjsonDecoder::<ExecEvent>::default();
        d.push(b"not json\n");
        assert!(matches!(d.next_event(), Some(Err(ClientError::Decode(_)))));
    }
}

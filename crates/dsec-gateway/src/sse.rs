//! Streamed answers on their way to the caller. [`SseScanner`] cuts the upstream's bytes
//! into SSE events, forwarding each as soon as it is complete (only a partial event is
//! ever held), reads the `usage` an event carries, and drops the usage-only chunk
//! (`"choices": []`) when the gateway asked for it and the caller did not.
//! [`Metered`] wraps a stream with the scanner, the request's [`Admission`] (its
//! concurrency permit lives until the stream ends or is dropped; its tokens are charged
//! then) and its deadline, past which the stream ends with an SSE error event.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures::{Stream, StreamExt};

use crate::limits::Admission;
use crate::openai::{self, ErrorKind, UsageTokens};
use crate::usage::Tally;
use crate::{ByteStream, Counters};

/// Cuts an SSE byte stream into events; see the module docs.
#[derive(Debug, Default)]
pub(crate) struct SseScanner {
    buf: BytesMut,
    /// Where to look for the next event's end in `buf` (what is before was searched).
    scan_from: usize,
    strip_usage_only: bool,
    usage: Option<UsageTokens>,
}

/// Where the event starting at `buf[0]` ends (after its blank line), looking from
/// `from`: events end with `\n\n`, `\r\r` or `\r\n\r\n`, as the SDKs split them.
fn event_end(buf: &[u8], from: usize) -> Option<usize> {
    let mut i = from;
    while i + 1 < buf.len() {
        match (buf[i], buf[i + 1]) {
            (b'\n', b'\n') | (b'\r', b'\r') => return Some(i + 2),
            (b'\r', b'\n') if buf.get(i + 2..i + 4) == Some(b"\r\n") => return Some(i + 4),
            _ => i += 1,
        }
    }
    None
}

/// Whether `event` has a `"usage"` key whose value is an object: only those are worth
/// parsing (with `include_usage` every chunk carries `"usage": null`).
fn has_usage_object(event: &[u8]) -> bool {
    const KEY: &[u8] = b"\"usage\"";
    let mut rest = event;
    while let Some(at) = rest.windows(KEY.len()).position(|w| w == KEY) {
        rest = &rest[at + KEY.len()..];
        let mut after = rest.iter().filter(|b| !b.is_ascii_whitespace());
        if after.next() == Some(&b':') && after.next() == Some(&b'{') {
            return true;
        }
    }
    false
}

/// The `data:` lines of an event, joined with `\n`.
fn event_data(event: &[u8]) -> Vec<u8> {
    let mut data = Vec::new();
    for line in event.split(|b| *b == b'\n' || *b == b'\r') {
        if let Some(rest) = line.strip_prefix(b"data:") {
            if !data.is_empty() {
                data.push(b'\n');
            }
            data.extend_from_slice(rest.strip_prefix(b" ").unwrap_or(rest));
        }
    }
    data
}

impl SseScanner {
    /// A scanner; `strip_usage_only` drops the usage-only chunk.
    pub(crate) fn new(strip_usage_only: bool) -> Self {
        Self {
            strip_usage_only,
            ..Self::default()
        }
    }

    /// The tokens a `usage` seen so far reported.
    pub(crate) fn usage(&self) -> Option<u64> {
        self.usage.map(|u| u.total)
    }

    /// The usage seen so far, in all and split.
    pub(crate) fn usage_tokens(&self) -> Option<UsageTokens> {
        self.usage
    }

    /// Whether to forward `event`; notes its usage.
    fn keep(&mut self, event: &[u8]) -> bool {
        if !has_usage_object(event) {
            return true;
        }
        let Ok(chunk) = serde_json::from_slice::<openai::UsageChunk>(&event_data(event)) else {
            return true;
        };
        let Some(tokens) = chunk.usage.as_ref().and_then(openai::Usage::counted) else {
            return true;
        };
        self.usage = Some(tokens);
        !(self.strip_usage_only && chunk.choices.is_some_and(|c| c.is_empty()))
    }

    /// Takes the next bytes of the stream; answers the complete events among what has
    /// come to forward now (empty when none is complete yet). A piece that starts with
    /// no partial event held (the usual case: upstreams write whole events) is answered
    /// without a copy, only its tail held if it ends mid-event.
    pub(crate) fn push(&mut self, chunk: Bytes) -> Bytes {
        if self.buf.is_empty() {
            let (events, start, all_kept) = self.events(&chunk, 0);
            self.scan_from = (chunk.len() - start).saturating_sub(3);
            self.buf.extend_from_slice(&chunk[start..]);
            return Self::kept(chunk.slice(..start), &events, all_kept);
        }
        let mut buf = std::mem::take(&mut self.buf);
        buf.extend_from_slice(&chunk);
        let (events, start, all_kept) = self.events(&buf, self.scan_from);
        // What is before `start` is whole events. Next time, look for an end from near
        // the tail: a delimiter may straddle two pieces.
        self.scan_from = (buf.len() - start).saturating_sub(3);
        let whole = buf.split_to(start);
        self.buf = buf;
        Self::kept(whole.freeze(), &events, all_kept)
    }

    /// The complete events at the start of `buf` (looking for the first one's end from
    /// `scan_from`), each with whether to forward it; where they end; whether all are
    /// forwarded.
    fn events(&mut self, buf: &[u8], scan_from: usize) -> (Vec<(usize, usize, bool)>, usize, bool) {
        let mut events = Vec::new();
        let mut all_kept = true;
        let mut start = 0;
        while let Some(len) = event_end(&buf[start..], scan_from.saturating_sub(start)) {
            let end = start + len;
            let kept = self.keep(&buf[start..end]);
            all_kept &= kept;
            if !all_kept {
                events.push((start, end, kept));
            } else if events.is_empty() {
                // Spans are only needed once one is dropped: note the kept ones as one.
                events.push((0, end, true));
            } else {
                events[0].1 = end;
            }
            start = end;
        }
        (events, start, all_kept)
    }

    /// `whole` without the events not kept.
    fn kept(whole: Bytes, events: &[(usize, usize, bool)], all_kept: bool) -> Bytes {
        if all_kept {
            return whole;
        }
        let mut out = BytesMut::with_capacity(whole.len());
        for &(s, e, kept) in events {
            if kept {
                out.extend_from_slice(&whole[s..e]);
            }
        }
        out.freeze()
    }

    /// What is left at the end of the stream (an event without its blank line), as is.
    pub(crate) fn finish(&mut self) -> Bytes {
        self.scan_from = 0;
        std::mem::take(&mut self.buf).freeze()
    }
}

/// A streamed answer as the caller receives it; see the module docs.
pub(crate) struct Metered {
    inner: Option<ByteStream>,
    scanner: SseScanner,
    admission: Option<Admission>,
    deadline: Option<(Pin<Box<tokio::time::Sleep>>, Duration)>,
    counters: Arc<Counters>,
    /// The request's figures, written when the stream ends or is dropped.
    tally: Option<Tally>,
}

impl Metered {
    /// `inner` passed through `scanner`, under `admission`, until `deadline` (the
    /// instant, and the limit it came from).
    pub(crate) fn new(
        inner: ByteStream,
        scanner: SseScanner,
        admission: Admission,
        deadline: Option<(tokio::time::Instant, Duration)>,
        counters: Arc<Counters>,
        tally: Option<Tally>,
    ) -> Self {
        Self {
            inner: Some(inner),
            scanner,
            admission: Some(admission),
            deadline: deadline.map(|(at, limit)| (Box::pin(tokio::time::sleep_until(at)), limit)),
            counters,
            tally,
        }
    }

    /// Ends the stream: the upstream's is dropped (closing its request), the tokens
    /// charged and the permit returned.
    fn end(&mut self) {
        self.inner = None;
        self.deadline = None;
        self.admission = None;
        self.tally = None;
    }
}

impl Stream for Metered {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            let Some(inner) = this.inner.as_mut() else {
                return Poll::Ready(None);
            };
            if let Some((sleep, limit)) = &mut this.deadline {
                if sleep.as_mut().poll(cx).is_ready() {
                    let message = format!(
                        "the request did not finish within its time limit ({} s)",
                        limit.as_secs_f64()
                    );
                    this.counters.timed_out();
                    this.end();
                    return Poll::Ready(Some(Ok(openai::stream_error(
                        message,
                        ErrorKind::Api,
                        "timeout",
                    ))));
                }
            }
            match inner.poll_next_unpin(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(chunk))) => {
                    let len = chunk.len();
                    let out = this.scanner.push(chunk);
                    if let Some(a) = &mut this.admission {
                        a.add_bytes(len);
                        if let Some(tokens) = this.scanner.usage() {
                            a.record_usage(tokens);
                        }
                    }
                    if let Some(t) = &mut this.tally {
                        if let Some(usage) = this.scanner.usage_tokens() {
                            t.set_usage(usage);
                        }
                        if !out.is_empty() {
                            t.first_chunk();
                        }
                    }
                    if !out.is_empty() {
                        return Poll::Ready(Some(Ok(out)));
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    this.end();
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(None) => {
                    let rest = this.scanner.finish();
                    this.end();
                    return Poll::Ready((!rest.is_empty()).then_some(Ok(rest)));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const USAGE_ONLY: &str = r#"data: {"id":"c","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}"#;

    fn stream(sep: &str, usage_chunk: bool) -> String {
        let mut events = vec![
            r#"data: {"choices":[{"index":0,"delta":{"content":"a"}}],"usage":null}"#.to_string(),
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"b\\n\\nc\"}}]}".to_string(),
            ": keepalive".to_string(),
        ];
        if usage_chunk {
            events.push(USAGE_ONLY.to_string());
        }
        events.push("data: [DONE]".to_string());
        events
            .iter()
            .map(|e| format!("{e}{sep}{sep}"))
            .collect::<String>()
    }

    /// Feeds `input` in pieces cut at `cuts`, returning what comes out and the pieces
    /// out in which each came.
    fn run(input: &[u8], cuts: &[usize], strip: bool) -> (String, Option<u64>) {
        let mut s = SseScanner::new(strip);
        let mut out = Vec::new();
        let mut last = 0;
        for &cut in cuts.iter().chain(std::iter::once(&input.len())) {
            out.extend_from_slice(&s.push(Bytes::copy_from_slice(&input[last..cut])));
            last = cut;
        }
        out.extend_from_slice(&s.finish());
        (String::from_utf8(out).expect("utf-8"), s.usage())
    }

    #[test]
    fn the_usage_chunk_is_read_and_stripped_wherever_the_stream_is_cut() {
        for sep in ["\n", "\r\n", "\r"] {
            let with = stream(sep, true);
            let without = stream(sep, false);
            let bytes = with.as_bytes();
            // Every single cut, and every pair of cuts a few bytes apart.
            let mut cut_sets: Vec<Vec<usize>> = (0..=bytes.len()).map(|i| vec![i]).collect();
            for i in 0..bytes.len() {
                for gap in 1..4 {
                    if i + gap <= bytes.len() {
                        cut_sets.push(vec![i, i + gap]);
                    }
                }
            }
            for cuts in &cut_sets {
                let (out, usage) = run(bytes, cuts, true);
                assert_eq!(out, without, "sep {sep:?}, cuts {cuts:?}");
                assert_eq!(usage, Some(7), "sep {sep:?}, cuts {cuts:?}");
                let (out, usage) = run(bytes, cuts, false);
                assert_eq!(out, with, "kept when the caller asked: {cuts:?}");
                assert_eq!(usage, Some(7));
            }
            let (out, usage) = run(without.as_bytes(), &[5], true);
            assert_eq!((out.as_str(), usage), (without.as_str(), None));
        }
    }

    #[test]
    fn only_events_with_a_usage_object_are_parsed() {
        assert!(has_usage_object(br#"data: {"usage": {"total_tokens": 1}}"#));
        assert!(has_usage_object(b"data: {\"choices\":[],\"usage\" :\n{}}"));
        assert!(has_usage_object(
            br#"data: {"x": "\"usage\"", "usage":{"total_tokens":1}}"#
        ));
        assert!(!has_usage_object(br#"data: {"choices":[{}],"usage":null}"#));
        assert!(!has_usage_object(br#"data: {"usage""#));
        assert!(!has_usage_object(b"data: [DONE]"));
    }

    #[test]
    fn events_go_out_as_soon_as_they_are_complete() {
        let mut s = SseScanner::new(true);
        assert!(
            s.push(Bytes::copy_from_slice(b"data: {\"choices\":[{}]}\n"))
                .is_empty(),
            "not complete"
        );
        assert_eq!(
            &s.push(Bytes::copy_from_slice(b"\ndata: x"))[..],
            b"data: {\"choices\":[{}]}\n\n"
        );
        assert_eq!(&s.push(Bytes::copy_from_slice(b"\n\n"))[..], b"data: x\n\n");
        // A usage chunk among others, cut out of the middle of one push.
        let mixed = format!("data: 1\n\n{USAGE_ONLY}\n\ndata: 2\n\n");
        assert_eq!(
            &s.push(Bytes::copy_from_slice(mixed.as_bytes()))[..],
            b"data: 1\n\ndata: 2\n\n"
        );
        assert_eq!(s.usage(), Some(7));
        // A usage object that does not parse is forwarded untouched.
        assert_eq!(
            &s.push(Bytes::copy_from_slice(b"data: {\"usage\": oops}\n\n"))[..],
            b"data: {\"usage\": oops}\n\n"
        );
        assert_eq!(&s.finish()[..], b"");
    }
}

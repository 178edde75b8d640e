//! Translation between agent frames and API events.

use dsec_wire::agent::Reply;
use dsec_wire::frame::Frame;
use dsec_wire::v1::ExecEvent;
use dsec_wire::{ApiError, ErrorCode};

/// `bytes` as text: as they are (no copy, and the fast validation) when they are valid
/// UTF-8, else with each invalid sequence replaced by U+FFFD.
pub fn lossy_text(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

/// Turns a byte stream into UTF-8 text chunks without splitting a multi-byte character
/// across chunks (invalid sequences become U+FFFD).
#[derive(Debug, Default)]
pub struct Utf8Chunker {
    carry: Vec<u8>,
}

impl Utf8Chunker {
    /// Adds bytes; returns the text that is complete so far.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.carry.extend_from_slice(bytes);
        let cut = match std::str::from_utf8(&self.carry) {
            Ok(_) => self.carry.len(),
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            Err(_) => self.carry.len(),
        };
        let rest = self.carry.split_off(cut);
        lossy_text(std::mem::replace(&mut self.carry, rest))
    }

    /// Flushes whatever is left.
    pub fn finish(&mut self) -> String {
        lossy_text(std::mem::take(&mut self.carry))
    }
}

/// Per-stream state while converting frames into events.
#[derive(Debug, Default)]
pub struct EventConverter {
    stdout: Utf8Chunker,
    stderr: Utf8Chunker,
}

/// What a frame meant.
#[derive(Debug)]
pub enum Converted {
    /// Events to emit (possibly none).
    Events(Vec<ExecEvent>),
    /// The stream is complete after these events.
    Done(Vec<ExecEvent>),
}

impl EventConverter {
    /// Converts one frame. `oom` says whether the memory limit killed a process meanwhile.
    pub fn frame(&mut self, frame: Frame, oom: impl FnOnce() -> bool) -> Converted {
        match frame {
            Frame::Stdout(b) => Converted::Events(text_event(self.stdout.push(&b), true)),
            Frame::Stderr(b) => Converted::Events(text_event(self.stderr.push(&b), false)),
            Frame::Json(bytes) => {
                let reply = match serde_json::from_slice::<Reply>(&bytes) {
                    Ok(r) => r,
                    Err(e) => {
                        return Converted::Done(vec![error_event(format!("bad agent reply: {e}"))])
                    }
                };
                match reply {
                    Reply::Started { pid } => Converted::Events(vec![ExecEvent::Started { pid }]),
                    Reply::OutputStart { .. } => Converted::Events(vec![]),
                    Reply::Exited(exit) => {
                        let mut ev = self.flush();
                        let oom_killed = oom();
                        ev.push(ExecEvent::Exit { exit, oom_killed });
                        Converted::Done(ev)
                    }
                    Reply::OutputEnd {
                        stdout_offset,
                        stderr_offset,
                    } => {
                        let mut ev = self.flush();
                        ev.push(ExecEvent::End {
                            stdout_offset,
                            stderr_offset,
                        });
                        Converted::Done(ev)
                    }
                    Reply::Error(error) => Converted::Done(vec![ExecEvent::Error { error }]),
                    other => Converted::Done(vec![error_event(format!(
                        "unexpected agent reply {other:?}"
                    ))]),
                }
            }
            Frame::Data(_) | Frame::Eof => Converted::Events(vec![]),
        }
    }

    fn flush(&mut self) -> Vec<ExecEvent> {
        let mut ev = text_event(self.stdout.finish(), true);
        ev.extend(text_event(self.stderr.finish(), false));
        ev
    }
}

fn text_event(text: String, stdout: bool) -> Vec<ExecEvent> {
    if text.is_empty() {
        return vec![];
    }
    vec![if stdout {
        ExecEvent::Stdout { data: text }
    } else {
        ExecEvent::Stderr { data: text }
    }]
}

/// An `Error` event for a broken stream.
pub fn error_event(msg: String) -> ExecEvent {
    ExecEvent::Error {
        error: ApiError::new(ErrorCode::AgentUnavailable, msg),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_split_across_chunks_is_kept_whole() {
        let bytes = "héllo €".as_bytes();
        let mut c = Utf8Chunker::default();
        let mut out = String::new();
        for b in bytes {
            out.push_str(&c.push(&[*b]));
        }
        out.push_str(&c.finish());
        assert_eq!(out, "héllo €");
        let mut c = Utf8Chunker::default();
        assert_eq!(c.push(&[0xff, b'a']), "\u{fffd}a");
    }

    #[test]
    fn lossy_text_keeps_valid_text_and_replaces_only_what_is_invalid() {
        let valid = "tests: 12 passed, 0 failed ✓\n".repeat(1000);
        assert_eq!(lossy_text(valid.clone().into_bytes()), valid);
        let moved = valid.into_bytes();
        let moved_ptr = moved.as_ptr();
        let text = lossy_text(moved);
        assert_eq!(text.as_ptr(), moved_ptr, "valid text is not copied");
        assert_eq!(lossy_text(b"a\xffb\xe2\x82".to_vec()), "a\u{fffd}b\u{fffd}");
        assert_eq!(lossy_text(Vec::new()), "");
    }
}

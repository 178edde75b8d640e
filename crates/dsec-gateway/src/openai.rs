//! OpenAI's side of the wire: the few fields of a request the gateway reads (the rest
//! passes through untouched, so an upstream's extras such as vLLM's `top_k` survive),
//! and answers in OpenAI's error shape, which the `openai` SDKs raise as their typed
//! exceptions (`{"error": {"message", "type", "param", "code"}}`), including the 429s
//! of the limits with the retry headers the SDKs honour.

use std::time::Duration;

use bytes::Bytes;
use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::{Reply, ReplyBody};

/// The `type` of an OpenAI error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The caller's request is wrong (`invalid_request_error`).
    InvalidRequest,
    /// The gateway or an upstream failed (`api_error`).
    Api,
    /// Too many requests (`requests`, as OpenAI's own 429s say of their RPM limit).
    Requests,
    /// Too many model tokens (`tokens`, as OpenAI's own 429s say of their TPM limit).
    Tokens,
    /// A budget used up (`insufficient_quota`, as OpenAI says of an account out of
    /// credit).
    InsufficientQuota,
    /// A caller known but not allowed this (`permission_denied`).
    PermissionDenied,
}

impl ErrorKind {
    fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest => "invalid_request_error",
            ErrorKind::Api => "api_error",
            ErrorKind::Requests => "requests",
            ErrorKind::Tokens => "tokens",
            ErrorKind::InsufficientQuota => "insufficient_quota",
            ErrorKind::PermissionDenied => "permission_denied",
        }
    }
}

/// The longest wait a 429 asks for: the `openai` SDKs before 2.52 honour `retry-after`
/// only up to 60 s (and fall back to their own short backoff above it).
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);

/// A 429 in OpenAI's shape (`code: rate_limit_exceeded`) asking the caller to come back
/// after `wait`: `retry-after` in whole seconds (rounded up, at least 1) and
/// `retry-after-ms`, which the SDKs read first, both at most [`MAX_RETRY_AFTER`].
pub fn rate_limited(message: impl Into<String>, kind: ErrorKind, wait: Duration) -> Reply {
    let wait = wait.clamp(Duration::from_millis(1), MAX_RETRY_AFTER);
    let ms = wait.as_micros().div_ceil(1000);
    let secs = ms.div_ceil(1000).max(1);
    let mut reply = error(429, message, kind, Some("rate_limit_exceeded"));
    reply.headers.push(("retry-after".into(), secs.to_string()));
    reply
        .headers
        .push(("retry-after-ms".into(), ms.to_string()));
    reply
}

/// A 504 for a request over its time limit, with `x-should-retry: false`: the SDKs
/// would retry a 5xx, and the same request would take as long again.
pub fn timed_out(limit: Duration) -> Reply {
    let mut reply = error(
        504,
        format!(
            "the request did not finish within its time limit ({} s)",
            limit.as_secs_f64()
        ),
        ErrorKind::Api,
        Some("timeout"),
    );
    reply
        .headers
        .push(("x-should-retry".into(), "false".into()));
    reply
}

/// A 429 for a caller whose token budget is used up: `type` and `code`
/// `insufficient_quota`, and `x-should-retry: false` with no `retry-after`, so the SDKs
/// raise it at once instead of retrying what will not pass again.
pub fn insufficient_quota(message: impl Into<String>) -> Reply {
    let mut reply = error(
        429,
        message,
        ErrorKind::InsufficientQuota,
        Some("insufficient_quota"),
    );
    reply
        .headers
        .push(("x-should-retry".into(), "false".into()));
    reply
}

/// An SSE event carrying an error, the way to fail a stream whose 200 has gone out:
/// the `openai` SDKs raise `APIError` on a `data:` object with an `error` key.
pub fn stream_error(message: impl Into<String>, kind: ErrorKind, code: &str) -> Bytes {
    let event = serde_json::json!({"error": {
        "message": message.into(),
        "type": kind.as_str(),
        "param": null,
        "code": code,
    }});
    Bytes::from(format!("data: {event}\n\n"))
}

/// An answer with JSON body `value`.
pub fn json(status: u16, value: &Value) -> Reply {
    Reply {
        status,
        headers: vec![("content-type".into(), "application/json".into())],
        body: ReplyBody::Full(Bytes::from(value.to_string())),
    }
}

/// An error answer in OpenAI's shape.
pub fn error(
    status: u16,
    message: impl Into<String>,
    kind: ErrorKind,
    code: Option<&str>,
) -> Reply {
    json(
        status,
        &serde_json::json!({"error": {
            "message": message.into(),
            "type": kind.as_str(),
            "param": null,
            "code": code,
        }}),
    )
}

/// The answer for a model the gateway does not serve to this caller.
pub fn model_not_found(model: &str) -> Reply {
    error(
        404,
        format!("the model {model:?} does not exist or you do not have access to it"),
        ErrorKind::InvalidRequest,
        Some("model_not_found"),
    )
}

/// The `usage` of an answer or of a stream's usage chunk.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Usage {
    /// Prompt and completion tokens.
    #[serde(default)]
    pub total_tokens: Option<u64>,
    /// Prompt tokens.
    #[serde(default)]
    pub prompt_tokens: Option<u64>,
    /// Completion tokens.
    #[serde(default)]
    pub completion_tokens: Option<u64>,
}

impl Usage {
    /// The tokens it reports: `total_tokens`, else prompt plus completion.
    pub fn tokens(&self) -> Option<u64> {
        self.total_tokens
            .or(match (self.prompt_tokens, self.completion_tokens) {
                (None, None) => None,
                (p, c) => Some(p.unwrap_or(0).saturating_add(c.unwrap_or(0))),
            })
    }

    /// Its tokens in all and split, if it reports any.
    pub fn counted(&self) -> Option<UsageTokens> {
        Some(UsageTokens {
            total: self.tokens()?,
            prompt: self.prompt_tokens.unwrap_or(0),
            completion: self.completion_tokens.unwrap_or(0),
        })
    }
}

/// The tokens a `usage` reports: in all (what limits and budgets are charged), and as
/// prompt and completion (0 where not reported).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UsageTokens {
    /// `total_tokens`, else prompt plus completion.
    pub total: u64,
    /// `prompt_tokens`.
    pub prompt: u64,
    /// `completion_tokens`.
    pub completion: u64,
}

/// What the gateway reads of an answer or a stream chunk: its usage, and whether it has
/// choices (the usage-only chunk has `"choices": []`).
#[derive(Debug, Deserialize)]
pub(crate) struct UsageChunk {
    #[serde(default)]
    pub(crate) usage: Option<Usage>,
    #[serde(default)]
    pub(crate) choices: Option<Vec<IgnoredAny>>,
}

/// The tokens a whole JSON answer's `usage` reports.
pub fn usage_tokens(body: &[u8]) -> Option<u64> {
    usage_of(body).map(|u| u.total)
}

/// The tokens a whole JSON answer's `usage` reports, in all and split.
pub fn usage_of(body: &[u8]) -> Option<UsageTokens> {
    serde_json::from_slice::<UsageChunk>(body)
        .ok()?
        .usage?
        .counted()
}

/// Below this many tokens of budget left, a chat request that names no completion limit
/// is given one ([`RequestView::clamp_completion`]); 4096 is within every current
/// model's completion cap.
pub const UNNAMED_COMPLETION_CLAMP: u64 = 4096;

/// `max_tokens` of a (legacy) completions request that names none, at OpenAI and vLLM
/// alike: a clamp above it would raise what the request gets.
pub const COMPLETIONS_DEFAULT_MAX_TOKENS: u64 = 16;

/// What the gateway reads of a request body.
#[derive(Debug, Clone)]
pub struct RequestView {
    /// `model`: the public name.
    pub model: String,
    /// `stream`: the answer is an SSE stream.
    pub stream: bool,
    /// The whole body.
    pub body: Map<String, Value>,
}

impl RequestView {
    /// Parses a request body; the error says what is wrong with it.
    pub fn parse(body: &[u8]) -> Result<Self, String> {
        let value: Value = serde_json::from_slice(body)
            .map_err(|e| format!("the request body is not valid JSON: {e}"))?;
        let Value::Object(body) = value else {
            return Err("the request body must be a JSON object".into());
        };
        let model = match body.get("model") {
            Some(Value::String(m)) if !m.is_empty() => m.clone(),
            Some(_) => return Err("model must be a non-empty string".into()),
            None => return Err("you must provide a model parameter".into()),
        };
        let stream = match body.get("stream") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err("stream must be a boolean".into()),
        };
        Ok(Self {
            model,
            stream,
            body,
        })
    }

    /// Makes a streamed request ask for the usage chunk (`stream_options.include_usage`),
    /// which the limits need to charge tokens. True if it was not asked for, so the
    /// chunk is the gateway's to drop before the caller sees it.
    pub fn ask_stream_usage(&mut self) -> bool {
        if !self.stream {
            return false;
        }
        let options = self
            .body
            .entry("stream_options")
            .or_insert_with(|| Value::Object(Map::new()));
        if !options.is_object() {
            *options = Value::Object(Map::new());
        }
        let Some(options) = options.as_object_mut() else {
            return false;
        };
        if options.get("include_usage") == Some(&Value::Bool(true)) {
            return false;
        }
        options.insert("include_usage".into(), Value::Bool(true));
        true
    }

    /// Keeps a completion within `left` model tokens (what is left of a budget): a
    /// `max_tokens` or `max_completion_tokens` above `left / n` (`n` choices) is lowered
    /// to it. A request naming neither gets `max_tokens` only when that is below
    /// `unnamed_below`: for chat [`UNNAMED_COMPLETION_CLAMP`], since a larger one than
    /// the model's context leaves room for is an error at some upstreams (vLLM checks
    /// prompt plus `max_tokens` against its context) where the unclamped request would
    /// have passed; for completions [`COMPLETIONS_DEFAULT_MAX_TOKENS`], their default.
    /// True if the body changed.
    pub fn clamp_completion(&mut self, left: u64, unnamed_below: u64) -> bool {
        let n = self
            .body
            .get("n")
            .and_then(Value::as_u64)
            .unwrap_or(1)
            .max(1);
        let per = (left / n).max(1);
        let mut named = false;
        let mut changed = false;
        for field in ["max_tokens", "max_completion_tokens"] {
            if let Some(v) = self.body.get(field).and_then(Value::as_u64) {
                named = true;
                if v > per {
                    self.body.insert(field.into(), Value::from(per));
                    changed = true;
                }
            }
        }
        if !named && per < unnamed_below {
            self.body.insert("max_tokens".into(), Value::from(per));
            changed = true;
        }
        changed
    }

    /// The body as JSON text.
    pub fn to_bytes(&self) -> Bytes {
        Bytes::from(serde_json::to_vec(&self.body).unwrap_or_default())
    }

    /// The body to send an upstream that knows the model as `served` (the original
    /// bytes when the name is the same).
    pub fn body_for(&self, served: Option<&str>, original: &Bytes) -> Bytes {
        match served {
            Some(name) if name != self.model => {
                let mut body = self.body.clone();
                body.insert("model".into(), Value::String(name.to_string()));
                Bytes::from(Value::Object(body).to_string())
            }
            _ => original.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header<'a>(r: &'a Reply, name: &str) -> Option<&'a str> {
        r.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    #[test]
    fn a_429_asks_for_a_wait_of_whole_seconds_and_of_ms_at_most_a_minute() {
        for (wait, secs, ms) in [
            (Duration::from_millis(500), "1", "500"),
            (Duration::from_micros(1500), "1", "2"),
            (Duration::ZERO, "1", "1"),
            (Duration::from_millis(2001), "3", "2001"),
            (Duration::from_secs(3600), "60", "60000"),
        ] {
            let r = rate_limited("slow down", ErrorKind::Requests, wait);
            assert_eq!(r.status, 429);
            assert_eq!(header(&r, "retry-after"), Some(secs), "{wait:?}");
            assert_eq!(header(&r, "retry-after-ms"), Some(ms), "{wait:?}");
        }
        let r = timed_out(Duration::from_secs(2));
        assert_eq!(
            (r.status, header(&r, "x-should-retry")),
            (504, Some("false"))
        );
    }

    #[test]
    fn a_request_names_its_model_and_whether_it_streams() {
        let r = RequestView::parse(br#"{"model":"m","stream":true,"top_k":3}"#).expect("parse");
        assert_eq!((r.model.as_str(), r.stream), ("m", true));
        let original = Bytes::from_static(br#"{"model":"m","stream":true,"top_k":3}"#);
        assert_eq!(r.body_for(Some("m"), &original), original);
        let renamed: Value =
            serde_json::from_slice(&r.body_for(Some("real"), &original)).expect("json");
        assert_eq!(renamed["model"], "real");
        assert_eq!(renamed["top_k"], 3, "extras pass through");
        let mut r = RequestView::parse(br#"{"model":"m","stream":true}"#).expect("parse");
        assert!(r.ask_stream_usage(), "asked for by the gateway");
        assert_eq!(r.body["stream_options"]["include_usage"], true);
        assert!(!r.ask_stream_usage(), "already asked");
        let mut r = RequestView::parse(
            br#"{"model":"m","stream":true,"stream_options":{"include_usage":false}}"#,
        )
        .expect("parse");
        assert!(r.ask_stream_usage());
        let mut r = RequestView::parse(br#"{"model":"m","stream_options":{"include_usage":true}}"#)
            .expect("parse");
        assert!(!r.ask_stream_usage(), "not a stream");
        // A budget's clamp lowers what the request names, never raises it.
        let clamp = |body: &[u8], left: u64| {
            let mut r = RequestView::parse(body).expect("parse");
            let changed = r.clamp_completion(left, UNNAMED_COMPLETION_CLAMP);
            (changed, r.body)
        };
        let (changed, b) = clamp(br#"{"model":"m","max_tokens":500}"#, 100);
        assert!(changed);
        assert_eq!(b["max_tokens"], 100);
        let (changed, b) = clamp(br#"{"model":"m","max_completion_tokens":50}"#, 100);
        assert!(!changed);
        assert_eq!(b["max_completion_tokens"], 50);
        assert!(
            !b.contains_key("max_tokens"),
            "one named: the other not added"
        );
        let (_, b) = clamp(
            br#"{"model":"m","max_tokens":500,"max_completion_tokens":500,"n":4}"#,
            100,
        );
        assert_eq!(
            (
                b["max_tokens"].as_u64(),
                b["max_completion_tokens"].as_u64()
            ),
            (Some(25), Some(25))
        );
        let (changed, b) = clamp(br#"{"model":"m"}"#, 10_000);
        assert!(
            !changed && !b.contains_key("max_tokens"),
            "plenty left: untouched"
        );
        let (changed, b) = clamp(br#"{"model":"m","max_tokens":null}"#, 300);
        assert!(changed);
        assert_eq!(b["max_tokens"], 300);
        let (_, b) = clamp(br#"{"model":"m","n":8}"#, 3);
        assert_eq!(b["max_tokens"], 1, "at least one token each");
        // A completion's own default (16) is never raised.
        let mut r = RequestView::parse(br#"{"model":"m","prompt":"p"}"#).expect("parse");
        assert!(!r.clamp_completion(100, COMPLETIONS_DEFAULT_MAX_TOKENS));
        assert!(r.clamp_completion(10, COMPLETIONS_DEFAULT_MAX_TOKENS));
        assert_eq!(r.body["max_tokens"], 10);
        for bad in [
            &b"nope"[..],
            b"[]",
            b"{}",
            br#"{"model":1}"#,
            br#"{"model":"m","stream":"yes"}"#,
        ] {
            assert!(
                RequestView::parse(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}

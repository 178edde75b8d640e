//! OpenAI's side of the wire: the few fields of a request the gateway reads (the rest
//! passes through untouched, so an upstream's extras such as vLLM's `top_k` survive),
//! and answers in OpenAI's error shape, which the `openai` SDKs raise as their typed
//! exceptions (`{"error": {"message", "type", "param", "code"}}`), including the 429s
//! of the limits with the retry headers the SDKs honour.

use std::time::Duration;

use std::borrow::Cow;

use bytes::Bytes;
use serde::de::{IgnoredAny, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
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

/// What the gateway reads of a request body, without decoding all of it: the top-level
/// object's members as spans of the body (a chat's `messages` are checked to be JSON but
/// never decoded), the few fields the gateway reads decoded from their span, and edits
/// (a model renamed for its upstream, `stream_options`, a clamped `max_tokens`) written
/// back by copying the other members' bytes as they came. An unedited body goes
/// upstream as the caller sent it.
///
/// A key given twice counts as serde_json's maps take it: the last one wins, for what
/// the gateway reads and in an edited body (which keeps only that one, where it was);
/// an unedited body passes with both, as it always did.
///
/// Values are checked for JSON syntax and UTF-8 but not decoded, so a body only
/// decoding refuses (a number beyond `f64`, nesting deeper than 128) is left for the
/// upstream to refuse, unless it is a cached request, whose key decodes it all
/// ([`RequestView::to_map`]).
#[derive(Debug, Clone)]
pub struct RequestView {
    /// `model`: the public name.
    pub model: String,
    /// `stream`: the answer is an SSE stream.
    pub stream: bool,
    /// The body as the caller sent it.
    original: Bytes,
    /// The top-level members in their order.
    fields: Vec<Field>,
    /// Whether a member was changed or added.
    edited: bool,
}

/// A top-level member of a request body.
#[derive(Debug, Clone)]
struct Field {
    key: String,
    value: FieldValue,
}

/// A member's JSON text.
#[derive(Debug, Clone)]
enum FieldValue {
    /// As sent: this span of the body.
    Sent(std::ops::Range<usize>),
    /// As the gateway set it.
    Set(String),
}

/// A top-level object's members as raw JSON borrowed from the body.
struct Members<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);

/// An object key, borrowed from the body unless it has escapes.
struct Key<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: serde::de::Error>(self, s: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(s)))
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(s.to_owned())))
            }
        }
        d.deserialize_str(V)
    }
}

impl<'de> Deserialize<'de> for Members<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Members<'de>, A::Error> {
                let mut members = Vec::with_capacity(map.size_hint().unwrap_or(8).min(64));
                while let Some(Key(key)) = map.next_key()? {
                    members.push((key, map.next_value::<&'de RawValue>()?));
                }
                Ok(Members(members))
            }
        }
        d.deserialize_map(V)
    }
}

impl RequestView {
    /// Parses a request body; the error says what is wrong with it.
    pub fn parse(body: &Bytes) -> Result<Self, String> {
        let not_json = |e: serde_json::Error| format!("the request body is not valid JSON: {e}");
        let members = match serde_json::from_slice::<Members<'_>>(body) {
            Ok(m) => m.0,
            Err(e) if body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{') => {
                return Err(not_json(e));
            }
            // JSON of another type, or not JSON at all.
            Err(_) => {
                return Err(match serde_json::from_slice::<IgnoredAny>(body) {
                    Ok(_) => "the request body must be a JSON object".into(),
                    Err(e) => not_json(e),
                })
            }
        };
        let start = body.as_ptr() as usize;
        let fields = members
            .into_iter()
            .map(|(key, raw)| {
                let at = raw.get().as_ptr() as usize - start;
                Field {
                    key: key.into_owned(),
                    value: FieldValue::Sent(at..at + raw.get().len()),
                }
            })
            .collect();
        let mut view = Self {
            model: String::new(),
            stream: false,
            original: body.clone(),
            fields,
            edited: false,
        };
        view.model = match view.raw("model") {
            Some(raw) if raw.starts_with('"') => serde_json::from_str::<String>(raw)
                .ok()
                .filter(|m| !m.is_empty())
                .ok_or("model must be a non-empty string")?,
            Some(_) => return Err("model must be a non-empty string".into()),
            None => return Err("you must provide a model parameter".into()),
        };
        view.stream = match view.raw("stream") {
            None | Some("null") => false,
            Some("true") => true,
            Some("false") => false,
            Some(_) => return Err("stream must be a boolean".into()),
        };
        Ok(view)
    }

    /// The JSON text of member `key` (the last, if given twice).
    fn raw(&self, key: &str) -> Option<&str> {
        let field = self.fields.iter().rev().find(|f| f.key == key)?;
        Some(match &field.value {
            // The span was cut from valid UTF-8 by the parser.
            FieldValue::Sent(span) => std::str::from_utf8(&self.original[span.clone()]).ok()?,
            FieldValue::Set(text) => text,
        })
    }

    /// Member `key`, decoded (`None` if absent).
    pub fn get(&self, key: &str) -> Option<Value> {
        serde_json::from_str(self.raw(key)?).ok()
    }

    /// The members named `keys` that are present, decoded.
    pub fn members(&self, keys: &[&str]) -> Map<String, Value> {
        keys.iter()
            .filter_map(|k| Some(((*k).to_owned(), self.get(k)?)))
            .collect()
    }

    /// Sets member `key` to the JSON text `value`, where it was or else at the end.
    fn set(&mut self, key: &str, value: String) {
        self.edited = true;
        match self.fields.iter_mut().rev().find(|f| f.key == key) {
            Some(f) => f.value = FieldValue::Set(value),
            None => self.fields.push(Field {
                key: key.to_owned(),
                value: FieldValue::Set(value),
            }),
        }
    }

    /// Makes a streamed request ask for the usage chunk (`stream_options.include_usage`),
    /// which the limits need to charge tokens. True if it was not asked for, so the
    /// chunk is the gateway's to drop before the caller sees it.
    pub fn ask_stream_usage(&mut self) -> bool {
        if !self.stream {
            return false;
        }
        let mut options = match self.get("stream_options") {
            Some(Value::Object(o)) => o,
            _ => Map::new(),
        };
        if options.get("include_usage") == Some(&Value::Bool(true)) {
            return false;
        }
        options.insert("include_usage".into(), Value::Bool(true));
        self.set("stream_options", Value::Object(options).to_string());
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
            .get("n")
            .as_ref()
            .and_then(Value::as_u64)
            .unwrap_or(1)
            .max(1);
        let per = (left / n).max(1);
        let mut named = false;
        let mut changed = false;
        for field in ["max_tokens", "max_completion_tokens"] {
            if let Some(v) = self.get(field).as_ref().and_then(Value::as_u64) {
                named = true;
                if v > per {
                    self.set(field, per.to_string());
                    changed = true;
                }
            }
        }
        if !named && per < unnamed_below {
            self.set("max_tokens", per.to_string());
            changed = true;
        }
        changed
    }

    /// The body as it goes upstream: as sent, or with the gateway's edits.
    pub fn to_bytes(&self) -> Bytes {
        if self.edited {
            self.render(None)
        } else {
            self.original.clone()
        }
    }

    /// The body with its edits, and `model` set to `rename` if given: the members in
    /// their order, each key once (the last given), the values not edited copied as
    /// sent.
    fn render(&self, rename: Option<&str>) -> Bytes {
        let keep = self.last_of_each_key();
        let mut out = Vec::with_capacity(self.original.len() + 64);
        out.push(b'{');
        for (field, _) in self.fields.iter().zip(keep).filter(|(_, keep)| *keep) {
            if out.len() > 1 {
                out.push(b',');
            }
            // Writing a string into a Vec cannot fail.
            let _ = serde_json::to_writer(&mut out, &field.key);
            out.push(b':');
            match (&field.value, rename) {
                (_, Some(name)) if field.key == "model" => {
                    let _ = serde_json::to_writer(&mut out, name);
                }
                (FieldValue::Sent(span), _) => out.extend_from_slice(&self.original[span.clone()]),
                (FieldValue::Set(text), _) => out.extend_from_slice(text.as_bytes()),
            }
        }
        out.push(b'}');
        Bytes::from(out)
    }

    /// Per member, whether it is the last of its key.
    fn last_of_each_key(&self) -> Vec<bool> {
        let mut keep = vec![true; self.fields.len()];
        if self.fields.len() <= 16 {
            for (i, f) in self.fields.iter().enumerate() {
                keep[i] = !self.fields[i + 1..].iter().any(|g| g.key == f.key);
            }
        } else {
            let mut seen = std::collections::HashSet::new();
            for (i, f) in self.fields.iter().enumerate().rev() {
                keep[i] = seen.insert(f.key.as_str());
            }
        }
        keep
    }

    /// The body with its edits, decoded whole (for a cache key); the error says what
    /// is wrong with it.
    pub fn to_map(&self) -> Result<Map<String, Value>, String> {
        let keep = self.last_of_each_key();
        let mut map = Map::new();
        for (field, _) in self.fields.iter().zip(keep).filter(|(_, keep)| *keep) {
            let text = match &field.value {
                FieldValue::Sent(span) => &self.original[span.clone()],
                FieldValue::Set(text) => text.as_bytes(),
            };
            let value = serde_json::from_slice(text)
                .map_err(|e| format!("the request body is not valid JSON: {e}"))?;
            map.insert(field.key.clone(), value);
        }
        Ok(map)
    }

    /// The body to send an upstream that knows the model as `served`: `body` (what
    /// [`RequestView::to_bytes`] gave) when the name is the same.
    pub fn body_for(&self, served: Option<&str>, body: &Bytes) -> Bytes {
        match served {
            Some(name) if name != self.model => self.render(Some(name)),
            _ => body.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(body: &[u8]) -> RequestView {
        RequestView::parse(&Bytes::copy_from_slice(body)).expect("parse")
    }

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
    fn an_edited_body_copies_what_it_did_not_edit_as_sent() {
        // Untouched: the very bytes, duplicates and spacing included.
        let sent = br#"{ "model" : "m", "messages": [{"content": "a\u00e9\n"}], "stream": true , "x": 1.50 }"#;
        let r = parse(sent);
        assert_eq!(&r.to_bytes()[..], &sent[..]);
        // Renamed and asked for usage: the other members' text as it came, in order.
        let mut r = parse(sent);
        assert!(r.ask_stream_usage());
        assert_eq!(
            &r.to_bytes()[..],
            br#"{"model":"m","messages":[{"content": "a\u00e9\n"}],"stream":true,"x":1.50,"stream_options":{"include_usage":true}}"#
        );
        assert_eq!(
            &r.body_for(Some("real"), &r.to_bytes())[..],
            br#"{"model":"real","messages":[{"content": "a\u00e9\n"}],"stream":true,"x":1.50,"stream_options":{"include_usage":true}}"#
        );
        // A key given twice: the last wins, read and written (once, where it was).
        let sent = br#"{"model":"a","stream":false,"model":"b","max_tokens":9,"max_tokens":500}"#;
        let mut r = parse(sent);
        assert_eq!((r.model.as_str(), r.stream), ("b", false));
        assert_eq!(&r.to_bytes()[..], &sent[..], "unedited: as sent");
        assert!(r.clamp_completion(100, UNNAMED_COMPLETION_CLAMP));
        assert_eq!(
            &r.to_bytes()[..],
            br#"{"stream":false,"model":"b","max_tokens":100}"#
        );
        assert_eq!(r.to_map().expect("map")["model"], "b");
        // Escaped keys are the keys they spell.
        let r = parse(br#"{"mod\u0065l":"m","str\u0065am":true}"#);
        assert_eq!((r.model.as_str(), r.stream), ("m", true));
        assert_eq!(
            &r.body_for(Some("n"), &r.to_bytes())[..],
            br#"{"model":"n","stream":true}"#
        );
        // What is wrong is said as before.
        let err = |b: &[u8]| RequestView::parse(&Bytes::copy_from_slice(b)).expect_err("bad");
        assert_eq!(err(b"[1]"), "the request body must be a JSON object");
        assert!(err(b"[1").starts_with("the request body is not valid JSON: "));
        assert!(err(br#"{"model":"m","messages":[}"#)
            .starts_with("the request body is not valid JSON: "));
        assert!(err(b"{\"model\":\"m\",\"x\":\"\xff\"}")
            .starts_with("the request body is not valid JSON: "));
        assert!(err(br#"{"model":"m"} x"#).starts_with("the request body is not valid JSON: "));
        assert_eq!(err(br#"{"model":""}"#), "model must be a non-empty string");
        assert_eq!(
            err(br#"{"model":null}"#),
            "model must be a non-empty string"
        );
        assert_eq!(
            err(br#"{"stream":true}"#),
            "you must provide a model parameter"
        );
        assert_eq!(
            err(br#"{"model":"m","stream":1}"#),
            "stream must be a boolean"
        );
    }

    #[test]
    fn a_request_names_its_model_and_whether_it_streams() {
        let r = parse(br#"{"model":"m","stream":true,"top_k":3}"#);
        assert_eq!((r.model.as_str(), r.stream), ("m", true));
        let original = Bytes::from_static(br#"{"model":"m","stream":true,"top_k":3}"#);
        assert_eq!(r.body_for(Some("m"), &original), original);
        let renamed: Value =
            serde_json::from_slice(&r.body_for(Some("real"), &original)).expect("json");
        assert_eq!(renamed["model"], "real");
        assert_eq!(renamed["top_k"], 3, "extras pass through");
        let mut r = parse(br#"{"model":"m","stream":true}"#);
        assert!(r.ask_stream_usage(), "asked for by the gateway");
        assert_eq!(
            r.get("stream_options"),
            Some(json!({"include_usage": true}))
        );
        assert!(!r.ask_stream_usage(), "already asked");
        let mut r =
            parse(br#"{"model":"m","stream":true,"stream_options":{"include_usage":false}}"#);
        assert!(r.ask_stream_usage());
        let mut r = parse(br#"{"model":"m","stream_options":{"include_usage":true}}"#);
        assert!(!r.ask_stream_usage(), "not a stream");
        // A budget's clamp lowers what the request names, never raises it.
        let clamp = |body: &[u8], left: u64| {
            let mut r = parse(body);
            let changed = r.clamp_completion(left, UNNAMED_COMPLETION_CLAMP);
            (changed, r.to_map().expect("map"))
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
        let mut r = parse(br#"{"model":"m","prompt":"p"}"#);
        assert!(!r.clamp_completion(100, COMPLETIONS_DEFAULT_MAX_TOKENS));
        assert!(r.clamp_completion(10, COMPLETIONS_DEFAULT_MAX_TOKENS));
        assert_eq!(r.get("max_tokens"), Some(json!(10)));
        for bad in [
            &b"nope"[..],
            b"[]",
            b"{}",
            br#"{"model":1}"#,
            br#"{"model":"m","stream":"yes"}"#,
        ] {
            assert!(
                RequestView::parse(&Bytes::copy_from_slice(bad)).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}

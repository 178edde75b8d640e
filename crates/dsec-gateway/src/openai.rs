//! OpenAI's side of the wire: the few fields of a request the gateway reads (the rest
//! passes through untouched, so an upstream's extras such as vLLM's `top_k` survive),
//! and answers in OpenAI's error shape, which the `openai` SDKs raise as their typed
//! exceptions (`{"error": {"message", "type", "param", "code"}}`).

use bytes::Bytes;
use serde_json::{Map, Value};

use crate::{Reply, ReplyBody};

/// The `type` of an OpenAI error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The caller's request is wrong (`invalid_request_error`).
    InvalidRequest,
    /// The gateway or an upstream failed (`api_error`).
    Api,
}

impl ErrorKind {
    fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest => "invalid_request_error",
            ErrorKind::Api => "api_error",
        }
    }
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

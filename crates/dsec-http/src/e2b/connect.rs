//! The Connect protocol (connectrpc.com), JSON codec, as envd speaks it: unary calls are a
//! plain JSON body each way (errors: an HTTP status and `{"code","message"}`); streaming
//! calls carry enveloped messages (1 byte of flags, a 4-byte big-endian length, the JSON),
//! the response ending with an end-of-stream envelope (flag 0x02) holding `{}` or
//! `{"error": ...}`.

use axum::body::{Body, Bytes};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use dsec_wire::{ApiError, ErrorCode};
use futures::stream::BoxStream;
use futures::StreamExt;
use serde_json::{json, Value};

/// Flag of the last envelope of a stream.
const END_STREAM: u8 = 0x02;
/// Flag of a compressed envelope (never sent by the SDK: compression is off).
const COMPRESSED: u8 = 0x01;

/// The Connect code and HTTP status of an API error.
pub fn code(e: &ApiError) -> (&'static str, StatusCode) {
    match e.code {
        ErrorCode::BadRequest | ErrorCode::InvalidPath => {
            ("invalid_argument", StatusCode::BAD_REQUEST)
        }
        ErrorCode::Unauthorized => ("unauthenticated", StatusCode::UNAUTHORIZED),
        ErrorCode::NotFound | ErrorCode::Expired | ErrorCode::ImageNotFound => {
            ("not_found", StatusCode::NOT_FOUND)
        }
        ErrorCode::Conflict => ("already_exists", StatusCode::CONFLICT),
        ErrorCode::Capacity
        | ErrorCode::AgentUnavailable
        | ErrorCode::Paused
        | ErrorCode::Lost
        | ErrorCode::Unavailable => ("unavailable", StatusCode::SERVICE_UNAVAILABLE),
        ErrorCode::Timeout => ("deadline_exceeded", StatusCode::GATEWAY_TIMEOUT),
        ErrorCode::NoSpace | ErrorCode::PayloadTooLarge | ErrorCode::QuotaExceeded => {
            ("resource_exhausted", StatusCode::TOO_MANY_REQUESTS)
        }
        ErrorCode::Forbidden => ("permission_denied", StatusCode::FORBIDDEN),
        _ => ("internal", StatusCode::INTERNAL_SERVER_ERROR),
    }
}

/// A unary answer: the message, or the error as Connect encodes it.
pub fn unary(result: Result<Value, ApiError>) -> Response {
    match result {
        Ok(v) => ([(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response(),
        Err(e) => {
            let (c, status) = code(&e);
            (
                status,
                [(header::CONTENT_TYPE, "application/json")],
                json!({"code": c, "message": e.message}).to_string(),
            )
                .into_response()
        }
    }
}

fn envelope(flags: u8, msg: &Value) -> Bytes {
    let body = msg.to_string().into_bytes();
    let mut out = Vec::with_capacity(5 + body.len());
    out.push(flags);
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    Bytes::from(out)
}

/// A server-streaming answer: each item a message; an `Err` item (or the end of the
/// stream) closes it with the end-of-stream envelope.
pub fn stream(messages: BoxStream<'static, Result<Value, ApiError>>) -> Response {
    let body = async_stream_body(messages);
    (
        [(header::CONTENT_TYPE, "application/connect+json")],
        Body::from_stream(body.map(Ok::<_, std::convert::Infallible>)),
    )
        .into_response()
}

fn async_stream_body(
    messages: BoxStream<'static, Result<Value, ApiError>>,
) -> BoxStream<'static, Bytes> {
    futures::stream::unfold(Some(messages), |state| async move {
        let mut messages = state?;
        match messages.next().await {
            Some(Ok(v)) => Some((envelope(0, &v), Some(messages))),
            Some(Err(e)) => {
                let (c, _) = code(&e);
                let end = json!({"error": {"code": c, "message": e.message}});
                Some((envelope(END_STREAM, &end), None))
            }
            None => Some((envelope(END_STREAM, &json!({})), None)),
        }
    })
    .boxed()
}

/// The one request message of a unary (`application/json`) or streaming
/// (`application/connect+json`, enveloped) call.
pub fn request(content_type: Option<&str>, body: &[u8]) -> Result<Value, ApiError> {
    let bad = |m: String| ApiError::new(ErrorCode::BadRequest, m);
    let json_bytes = if content_type.is_some_and(|c| c.starts_with("application/connect+")) {
        if body.len() < 5 {
            return Err(bad("connect stream: no request envelope".into()));
        }
        if body[0] & COMPRESSED != 0 {
            return Err(bad(
                "connect stream: compressed messages are not supported".into()
            ));
        }
        let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
        body.get(5..5 + len)
            .ok_or_else(|| bad("connect stream: truncated request envelope".into()))?
    } else {
        body
    };
    if json_bytes.is_empty() {
        return Ok(json!({}));
    }
    serde_json::from_slice(json_bytes).map_err(|e| bad(format!("request is not JSON: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_round_trip() {
        let msg = json!({"process": {"cmd": "/bin/bash"}});
        let env = envelope(0, &msg);
        assert_eq!(env[0], 0);
        let parsed = request(Some("application/connect+json"), &env).expect("parse");
        assert_eq!(parsed, msg);
        let plain = request(Some("application/json"), msg.to_string().as_bytes()).expect("unary");
        assert_eq!(plain, msg);
        assert!(request(Some("application/connect+json"), &env[..7]).is_err());
        assert_eq!(
            request(Some("application/json"), b"").expect("empty"),
            json!({})
        );
    }
}

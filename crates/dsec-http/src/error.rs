//! The one place where an [`ApiError`] becomes an HTTP response, plus the mapping of axum's
//! extractor rejections onto [`ApiError`]s.
//!
//! Every error the server sends has the status of [`ErrorCode::http_status`] and the body
//! `{"error":{"code":"...","message":"...","request_id":"..."}}`
//! ([`dsec_wire::error::ErrorBody`], with the id of the request it answers), including
//! malformed JSON, malformed query strings, bad path parameters and unknown routes.

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use dsec_wire::{ApiError, ErrorCode};

/// An [`ApiError`] on its way to the client; the only error type handlers return.
#[derive(Debug)]
pub struct HttpError(pub ApiError);

impl HttpError {
    /// Shorthand for `HttpError(ApiError::new(code, message))`.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self(ApiError::new(code, message))
    }

    /// A `bad_request` error.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::BadRequest, message)
    }
}

impl From<ApiError> for HttpError {
    fn from(e: ApiError) -> Self {
        Self(e)
    }
}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.0.code.http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let request_id = dsec_node_api::request_id::current();
        let body = serde_json::to_vec(&Answer {
            error: Inner {
                code: self.0.code,
                message: &self.0.message,
                request_id: request_id.as_deref(),
            },
        })
        .unwrap_or_else(|_| {
            br#"{"error":{"code":"internal","message":"error body serialization failed"}}"#.to_vec()
        });
        let mut resp = (status, body).into_response();
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        // For the audit log.
        resp.extensions_mut().insert(self.0.code);
        resp
    }
}

/// The body of every error answer: the error, and the id of the request it answers
/// (`dsec_wire::error::ErrorBody` with the request id).
#[derive(serde::Serialize, schemars::JsonSchema)]
#[schemars(rename = "ErrorBody")]
pub(crate) struct Answer<'a> {
    /// The error.
    error: Inner<'a>,
}

/// An error: what went wrong, and which request it answers.
#[derive(serde::Serialize, schemars::JsonSchema)]
#[schemars(rename = "Error")]
struct Inner<'a> {
    /// Stable code: clients switch on it.
    code: ErrorCode,
    /// Human-readable explanation, saying what to do where possible.
    message: &'a str,
    /// The id of the request (as in its `x-request-id` header), to name it to whoever
    /// reads the server's log.
    #[serde(skip_serializing_if = "Option::is_none")]
    request_id: Option<&'a str>,
}

/// Code for a rejection: a too-large body is `payload_too_large`, everything else is the
/// caller's fault and `bad_request`.
fn rejection_code(status: StatusCode) -> ErrorCode {
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        ErrorCode::PayloadTooLarge
    } else {
        ErrorCode::BadRequest
    }
}

impl From<JsonRejection> for HttpError {
    fn from(r: JsonRejection) -> Self {
        // body_text() carries serde's message, e.g. "unknown field `x`, expected ...".
        Self::new(rejection_code(r.status()), r.body_text())
    }
}

impl From<QueryRejection> for HttpError {
    fn from(r: QueryRejection) -> Self {
        Self::new(rejection_code(r.status()), r.body_text())
    }
}

impl From<PathRejection> for HttpError {
    fn from(r: PathRejection) -> Self {
        // A path that matched a route but whose parameters do not parse (e.g. a pid that
        // is not a number) is a malformed request.
        let code = if r.status().is_server_error() {
            ErrorCode::Internal
        } else {
            ErrorCode::BadRequest
        };
        Self::new(code, r.body_text())
    }
}

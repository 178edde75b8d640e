//! Typed errors that travel on the wire: a stable machine-readable code plus a message.

use serde::{Deserialize, Serialize};

/// Stable error codes. Clients switch on these; never rename one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The request is malformed or a field is out of range.
    BadRequest,
    /// Missing or invalid API key.
    Unauthorized,
    /// No such sandbox, image, session, process or file.
    NotFound,
    /// The sandbox existed but its lifetime ran out and it was removed.
    Expired,
    /// The sandbox failed (creation error, its init died); the message says why.
    Failed,
    /// The sandbox is not in a state that allows the call (e.g. still creating, stopped).
    Conflict,
    /// The named image is unknown.
    ImageNotFound,
    /// The node has no capacity for the request; retry later or elsewhere.
    Capacity,
    /// The operation did not finish in time.
    Timeout,
    /// A path escapes the sandbox root or is otherwise invalid.
    InvalidPath,
    /// The sandbox's disk or a size limit was exceeded.
    NoSpace,
    /// The request body is too large.
    PayloadTooLarge,
    /// The sandbox is paused.
    Paused,
    /// The in-sandbox agent could not be reached.
    AgentUnavailable,
    /// An unexpected server-side error.
    Internal,
    /// The route exists but not with this HTTP method.
    MethodNotAllowed,
    /// The API key is valid but may not do this (its scopes, or its tenant is disabled).
    Forbidden,
    /// A tenant quota (sandboxes, CPU, memory, creates per second) would be exceeded.
    /// Retryable: it succeeds once usage drops (deletes) or the rate window refills,
    /// so the caller must wait (back off) before retrying, not retry at once.
    QuotaExceeded,
    /// The sandbox's node stopped answering its heartbeats (it died, restarted or lost its
    /// network): the sandbox is `lost`. It comes back if the node returns still running
    /// it; delete removes the record either way.
    Lost,
    /// The cluster's state store cannot be reached or has no quorum (etcd members
    /// down). Retryable: a create retried with the same `idempotency_key` finds what an
    /// earlier attempt made.
    Unavailable,
}

impl ErrorCode {
    /// The HTTP status this code maps to.
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::BadRequest | ErrorCode::InvalidPath => 400,
            ErrorCode::Unauthorized => 401,
            ErrorCode::Forbidden => 403,
            ErrorCode::NotFound | ErrorCode::ImageNotFound => 404,
            ErrorCode::MethodNotAllowed => 405,
            ErrorCode::Conflict | ErrorCode::Paused => 409,
            ErrorCode::Expired => 410,
            ErrorCode::PayloadTooLarge => 413,
            ErrorCode::QuotaExceeded => 429,
            ErrorCode::Lost => 502,
            ErrorCode::NoSpace => 507,
            ErrorCode::Capacity | ErrorCode::Unavailable => 503,
            ErrorCode::Timeout => 504,
            ErrorCode::Failed | ErrorCode::AgentUnavailable | ErrorCode::Internal => 500,
        }
    }

    /// Whether the same request may succeed if retried later.
    pub fn retryable(self) -> bool {
        matches!(
            self,
            ErrorCode::Capacity
                | ErrorCode::Timeout
                | ErrorCode::AgentUnavailable
                | ErrorCode::QuotaExceeded
                | ErrorCode::Unavailable
        )
    }
}

/// The JSON body of every error response: `{"error": {"code": ..., "message": ...}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[error("{code:?}: {message}")]
pub struct ApiError {
    /// Stable code.
    pub code: ErrorCode,
    /// Human-readable explanation, saying what to do where possible.
    pub message: String,
}

impl ApiError {
    /// Builds an error from a code and message.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

/// Envelope used in HTTP error bodies.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ErrorBody {
    /// The error.
    pub error: ApiError,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iam_codes() {
        let json = serde_json::to_string(&[ErrorCode::Forbidden, ErrorCode::QuotaExceeded]);
        assert_eq!(
            json.ok().as_deref(),
            Some(r#"["forbidden","quota_exceeded"]"#)
        );
        assert_eq!(ErrorCode::Forbidden.http_status(), 403);
        assert!(!ErrorCode::Forbidden.retryable());
        assert_eq!(ErrorCode::QuotaExceeded.http_status(), 429);
        assert!(ErrorCode::QuotaExceeded.retryable());
    }

    #[test]
    fn lost_code() {
        let json = serde_json::to_string(&ErrorCode::Lost);
        assert_eq!(json.ok().as_deref(), Some(r#""lost""#));
        assert_eq!(ErrorCode::Lost.http_status(), 502);
        assert!(!ErrorCode::Lost.retryable());
    }
}

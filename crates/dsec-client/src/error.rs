//! The client's error type.

use dsec_wire::{ApiError, ErrorCode};

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server answered with an API error (decoded from its JSON error body).
    #[error("{} ({})", .0.message, code_name(.0.code))]
    Api(ApiError),
    /// The request could not be sent or the response not read (connection refused, reset,
    /// a body stream failed).
    #[error(transparent)]
    Http(#[from] reqwest::Error),
    /// The server's answer did not have the expected shape.
    #[error("unexpected response: {0}")]
    Decode(String),
    /// A local file operation failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The client is misconfigured (e.g. an invalid server URL).
    #[error("invalid configuration: {0}")]
    Config(String),
}

impl ClientError {
    /// The API error code, for [`ClientError::Api`].
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Api(e) => Some(e.code),
            _ => None,
        }
    }

    /// True if the server could not be reached at all (nothing listening, no route).
    pub fn is_connect(&self) -> bool {
        matches!(self, ClientError::Http(e) if e.is_connect())
    }
}

/// The wire name of a code (`not_found`).
fn code_name(code: ErrorCode) -> String {
    serde_json::to_value(code)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_else(|| format!("{code:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_errors_display_message_and_code() {
        let e = ClientError::Api(ApiError::new(ErrorCode::NotFound, "no sandbox abc"));
        assert_eq!(e.to_string(), "no sandbox abc (not_found)");
        assert_eq!(e.code(), Some(ErrorCode::NotFound));
    }
}

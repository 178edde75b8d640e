//! Model access (`model_access` on create): which models behind the model gateway
//! (`dsec gateway`, issue #30) code in a sandbox may call, and within which limits.
//!
//! A sandbox created with `model_access` gets a gateway token of its own, minted with the
//! sandbox and gone with it, and the variables an OpenAI client reads
//! ([`OPENAI_BASE_URL_ENV`], [`OPENAI_API_KEY_ENV`]) in its environment. Its network is
//! opened to the gateway only. The upstreams' own keys never enter the sandbox.

use serde::{Deserialize, Serialize};

use crate::error::{ApiError, ErrorCode};

/// The variable that tells an OpenAI client the gateway's URL.
pub const OPENAI_BASE_URL_ENV: &str = "OPENAI_BASE_URL";
/// The variable that holds the sandbox's gateway token.
pub const OPENAI_API_KEY_ENV: &str = "OPENAI_API_KEY";
/// Most models one sandbox may be given.
pub const MAX_MODELS: usize = 64;
/// Longest model name, in bytes.
pub const MAX_MODEL_NAME_BYTES: usize = 256;

/// What a sandbox may call through the model gateway.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ModelAccess {
    /// The gateway's public model names the sandbox may call (at least one).
    pub models: Vec<String>,
    /// Model tokens (prompt and completion) the sandbox may spend in all; unlimited if
    /// unset. Past it the gateway answers 429 `insufficient_quota`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_tokens: Option<u64>,
    /// Requests per minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rpm: Option<u32>,
    /// Model tokens per minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpm: Option<u64>,
    /// Requests in flight at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrency: Option<u32>,
    /// Seconds one request may take.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<u64>,
}

impl ModelAccess {
    /// Checks the request's shape (the gateway checks that the models exist).
    pub fn validate(&self) -> Result<(), ApiError> {
        let bad = |m: String| Err(ApiError::new(ErrorCode::BadRequest, m));
        if self.models.is_empty() {
            return bad(
                "model_access.models is empty: name the models the sandbox may call".into(),
            );
        }
        if self.models.len() > MAX_MODELS {
            return bad(format!(
                "model_access.models names {} models; at most {MAX_MODELS}",
                self.models.len()
            ));
        }
        for m in &self.models {
            if m.is_empty() || m.len() > MAX_MODEL_NAME_BYTES || m.chars().any(char::is_control) {
                return bad(format!(
                    "model_access.models: {m:?} is not a model name (1 to \
                     {MAX_MODEL_NAME_BYTES} bytes, no control characters)"
                ));
            }
        }
        if self.rpm == Some(0) || self.tpm == Some(0) || self.max_concurrency == Some(0) {
            return bad(
                "model_access: rpm, tpm and max_concurrency must be at least 1 (leave one \
                 unset for no limit)"
                    .into(),
            );
        }
        if let Some(t) = self.timeout_s {
            if !(1..=86_400).contains(&t) {
                return bad(format!(
                    "model_access.timeout_s {t} is out of range (1 to 86400 s)"
                ));
            }
        }
        Ok(())
    }

    /// Whether `model` is one the sandbox may call.
    pub fn allows(&self, model: &str) -> bool {
        self.models.iter().any(|m| m == model)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn access(models: &[&str]) -> ModelAccess {
        ModelAccess {
            models: models.iter().map(|m| m.to_string()).collect(),
            ..ModelAccess::default()
        }
    }

    #[test]
    fn bad_model_access_is_refused_with_what_to_fix() {
        assert!(access(&["policy"]).validate().is_ok());
        for (a, says) in [
            (access(&[]), "empty"),
            (access(&[""]), "not a model name"),
            (access(&["a\nb"]), "not a model name"),
            (
                ModelAccess {
                    rpm: Some(0),
                    ..access(&["m"])
                },
                "at least 1",
            ),
            (
                ModelAccess {
                    timeout_s: Some(0),
                    ..access(&["m"])
                },
                "out of range",
            ),
        ] {
            let e = a.validate().expect_err("refused");
            assert_eq!(e.code, ErrorCode::BadRequest);
            assert!(e.message.contains(says), "{}", e.message);
        }
        let many: Vec<String> = (0..=MAX_MODELS).map(|i| format!("m{i}")).collect();
        let e = ModelAccess {
            models: many,
            ..ModelAccess::default()
        }
        .validate()
        .expect_err("too many");
        assert!(e.message.contains("at most"), "{}", e.message);
    }

    #[test]
    fn unknown_fields_are_refused() {
        let e = serde_json::from_str::<ModelAccess>(r#"{"models": ["m"], "budget": 5}"#);
        assert!(e.is_err());
    }
}

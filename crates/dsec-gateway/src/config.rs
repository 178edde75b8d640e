//! The gateway's configuration: which keys may call it, and per public model name the
//! OpenAI-compatible upstreams that serve it (vLLM, SGLang, a hosted API) with their
//! keys. Read from YAML:
//!
//! ```yaml
//! api_keys: [KEY]                 # callers' bearer keys
//! models:
//!   policy-7b:
//!     upstreams:
//!       - url: http://10.0.0.5:8000/v1
//!         model: Qwen/Qwen2.5-7B-Instruct   # its name there (default: the public one)
//!       - url: https://api.example.com/v1
//!         api_key_env: EXAMPLE_KEY          # or api_key_file: /etc/dsec/example.key
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest, Sha256};

/// Largest request body by default (16 MiB: long multi-turn prompts, batched embeddings).
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 << 20;

/// Seconds to connect to an upstream by default, before trying the next.
pub const DEFAULT_CONNECT_TIMEOUT_S: f64 = 5.0;

/// A configuration that cannot be used, saying what to fix.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The YAML does not parse as a configuration.
    #[error("parsing {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// A value is missing or wrong.
    #[error("{0}")]
    Invalid(String),
}

/// The gateway's configuration (see the module docs for the YAML).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
    /// Bearer keys callers may present. At least one.
    #[serde(default)]
    pub api_keys: Vec<String>,
    /// Public model name -> how it is served.
    #[serde(default)]
    pub models: BTreeMap<String, ModelConfig>,
    /// Largest request body accepted (bytes).
    #[serde(default = "default_max_body")]
    pub max_body_bytes: usize,
    /// Seconds to connect to an upstream before trying the next.
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout_s: f64,
}

fn default_max_body() -> usize {
    DEFAULT_MAX_BODY_BYTES
}

fn default_connect_timeout() -> f64 {
    DEFAULT_CONNECT_TIMEOUT_S
}

/// How one public model is served.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Its upstreams; a request goes to the one with the fewest requests in flight.
    pub upstreams: Vec<UpstreamConfig>,
}

/// One OpenAI-compatible upstream.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    /// Base URL, ending in `/v1` as OpenAI's does (`http://10.0.0.5:8000/v1`).
    pub url: String,
    /// The model's name at this upstream, when it differs from the public one.
    #[serde(default)]
    pub model: Option<String>,
    /// Environment variable holding the upstream's key.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// File holding the upstream's key (trailing whitespace dropped).
    #[serde(default)]
    pub api_key_file: Option<PathBuf>,
}

impl GatewayConfig {
    /// Reads and checks the YAML configuration at `path`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let config: GatewayConfig =
            serde_yaml_ng::from_str(&text).map_err(|e| ConfigError::Parse {
                path: path.to_path_buf(),
                message: e.to_string(),
            })?;
        config.check()?;
        Ok(config)
    }

    /// Checks what parsing cannot: keys, models and URLs.
    pub fn check(&self) -> Result<(), ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        if self.api_keys.is_empty() || self.api_keys.iter().any(|k| k.trim().is_empty()) {
            return invalid(
                "api_keys: give at least one non-empty key (callers send it as \
                 Authorization: Bearer KEY)"
                    .into(),
            );
        }
        if self.models.is_empty() {
            return invalid("models: configure at least one model with its upstreams".into());
        }
        for (name, model) in &self.models {
            if name.is_empty() || name.len() > 256 {
                return invalid(format!("models: {name:?} is not a usable model name"));
            }
            if model.upstreams.is_empty() {
                return invalid(format!("models.{name}: give at least one upstream"));
            }
            for (i, up) in model.upstreams.iter().enumerate() {
                let at = format!("models.{name}.upstreams[{i}]");
                let url = up.url.trim_end_matches('/');
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    return invalid(format!(
                        "{at}.url: {:?} is not an http(s) URL (like http://10.0.0.5:8000/v1)",
                        up.url
                    ));
                }
                if up.api_key_env.is_some() && up.api_key_file.is_some() {
                    return invalid(format!("{at}: give api_key_env or api_key_file, not both"));
                }
            }
        }
        if self.max_body_bytes == 0 {
            return invalid("max_body_bytes: must be above 0".into());
        }
        if !(self.connect_timeout_s.is_finite() && self.connect_timeout_s > 0.0) {
            return invalid("connect_timeout_s: must be a positive number of seconds".into());
        }
        Ok(())
    }

    /// Whether `key` is one of the configured keys (compared by digest, in constant time
    /// for keys of any length).
    pub fn key_allowed(&self, key: &str) -> bool {
        let given = Sha256::digest(key.as_bytes());
        let mut allowed = false;
        for k in &self.api_keys {
            let want = Sha256::digest(k.as_bytes());
            let diff = want
                .iter()
                .zip(given.iter())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b));
            allowed |= diff == 0;
        }
        allowed
    }
}

impl UpstreamConfig {
    /// The upstream's key, read from its environment variable or file.
    pub fn api_key(&self) -> Result<Option<String>, ConfigError> {
        if let Some(var) = &self.api_key_env {
            return match std::env::var(var) {
                Ok(v) if !v.trim().is_empty() => Ok(Some(v.trim().to_string())),
                _ => Err(ConfigError::Invalid(format!(
                    "upstream {}: environment variable {var} is not set",
                    self.url
                ))),
            };
        }
        if let Some(path) = &self.api_key_file {
            let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                path: path.clone(),
                source,
            })?;
            return Ok(Some(text.trim_end().to_string()));
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> Result<GatewayConfig, ConfigError> {
        let dir = tempfile::tempdir().map_err(|e| ConfigError::Invalid(e.to_string()))?;
        let path = dir.path().join("gateway.yaml");
        std::fs::write(&path, yaml).map_err(|e| ConfigError::Invalid(e.to_string()))?;
        GatewayConfig::load(&path)
    }

    #[test]
    fn a_config_names_keys_models_and_upstreams() {
        let c = parse(
            "api_keys: [k1]\nmodels:\n  m:\n    upstreams:\n      - url: http://h:1/v1\n        model: real\n",
        )
        .expect("config");
        assert_eq!(c.models["m"].upstreams[0].model.as_deref(), Some("real"));
        assert_eq!(c.max_body_bytes, DEFAULT_MAX_BODY_BYTES);
        assert!(c.key_allowed("k1"));
        assert!(!c.key_allowed("k2"));
        assert!(!c.key_allowed(""));
    }

    #[test]
    fn bad_configs_say_what_to_fix() {
        for (yaml, says) in [
            ("models: {}\n", "api_keys"),
            ("api_keys: [k]\n", "models"),
            (
                "api_keys: [k]\nmodels:\n  m: {upstreams: []}\n",
                "at least one upstream",
            ),
            (
                "api_keys: [k]\nmodels:\n  m: {upstreams: [{url: ftp://x}]}\n",
                "http(s) URL",
            ),
            (
                "api_keys: [k]\nmodels:\n  m: {upstreams: [{url: http://x, bogus: 1}]}\n",
                "bogus",
            ),
        ] {
            let e = parse(yaml).expect_err(yaml);
            assert!(e.to_string().contains(says), "{yaml}: {e}");
        }
    }
}

//! The gateway's configuration: which keys may call it and within which limits, and per
//! public model name the OpenAI-compatible upstreams that serve it (vLLM, SGLang, a
//! hosted API) with their keys. Read from YAML:
//!
//! ```yaml
//! api_keys:                       # callers' bearer keys
//!   - KEY                         # a plain key: default_limits apply
//!   - key: KEY2
//!     name: team-a                # for logs and the cache's scope (default: a digest)
//!     limits: {rpm: 600, tpm: 200000, max_concurrency: 32, timeout_s: 120}
//! default_limits: {rpm: 60}       # each key's own, for what its limits leave unset
//! tenant_limits:                  # shared by all the sandbox tokens of a tenant
//!   acme: {rpm: 3000, tpm: 2000000, max_concurrency: 256}
//! default_tenant_limits: {max_concurrency: 64}   # each other tenant's, shared likewise
//! cache: {max_bytes: 268435456, max_entry_bytes: 1048576, ttl_s: 600}  # the defaults
//! health_check_interval_s: 5      # probe each upstream's /models (0: never)
//! models:
//!   policy-7b:
//!     upstreams:
//!       - url: http://10.0.0.5:8000/v1
//!         model: Qwen/Qwen2.5-7B-Instruct   # its name there (default: the public one)
//!       - url: https://api.example.com/v1
//!         api_key_env: EXAMPLE_KEY          # or api_key_file: /etc/dsec/example.key
//! ```

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};

use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};
use sha2::{Digest, Sha256};

use crate::cache::CacheConfig;

/// Largest request body by default (16 MiB: long multi-turn prompts, batched embeddings).
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 << 20;

/// Seconds to connect to an upstream by default, before trying the next.
pub const DEFAULT_CONNECT_TIMEOUT_S: f64 = 5.0;

/// Seconds between health probes of each upstream by default.
pub const DEFAULT_HEALTH_CHECK_INTERVAL_S: f64 = 5.0;

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
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
    /// Bearer keys callers may present, each with its limits. At least one.
    #[serde(default)]
    pub api_keys: Vec<ApiKey>,
    /// The limits of a key (and of a sandbox token's grant) for what its own `limits`
    /// leave unset (each caller has its own buckets; these are not shared).
    #[serde(default)]
    pub default_limits: Limits,
    /// Limits a tenant's sandbox tokens share (all of them together, on top of each
    /// token's own), by tenant name. `timeout_s` is not shared: it is per token.
    #[serde(default)]
    pub tenant_limits: BTreeMap<String, Limits>,
    /// The shared limits of every tenant not in `tenant_limits` (none when unset).
    #[serde(default)]
    pub default_tenant_limits: Option<Limits>,
    /// The response cache of deterministic requests (on by default).
    #[serde(default)]
    pub cache: CacheConfig,
    /// Public model name -> how it is served.
    #[serde(default)]
    pub models: BTreeMap<String, ModelConfig>,
    /// Largest request body accepted (bytes).
    #[serde(default = "default_max_body")]
    pub max_body_bytes: usize,
    /// Seconds to connect to an upstream before trying the next.
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout_s: f64,
    /// Seconds between probes of each upstream (`GET {url}/models`); 0 turns them off.
    /// A failed probe takes the upstream out of rotation until one succeeds.
    #[serde(default = "default_health_check_interval")]
    pub health_check_interval_s: f64,
}

impl Default for GatewayConfig {
    /// No keys and no models (not usable until some are added), default sizes.
    fn default() -> Self {
        Self {
            api_keys: Vec::new(),
            default_limits: Limits::default(),
            tenant_limits: BTreeMap::new(),
            default_tenant_limits: None,
            cache: CacheConfig::default(),
            models: BTreeMap::new(),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            connect_timeout_s: DEFAULT_CONNECT_TIMEOUT_S,
            health_check_interval_s: DEFAULT_HEALTH_CHECK_INTERVAL_S,
        }
    }
}

/// A key callers may present, with what it may do. In YAML either the key alone (a
/// string) or `{key, name?, limits?}`.
#[derive(Clone, Default, PartialEq)]
pub struct ApiKey {
    /// The bearer key.
    pub key: String,
    /// Who holds it, for logs and the response cache's scope; keys with the same name
    /// share cached answers. Default: derived from the key's digest.
    pub name: Option<String>,
    /// Its limits; what is unset here comes from `default_limits`.
    pub limits: Limits,
}

impl fmt::Debug for ApiKey {
    /// Never the key itself.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApiKey")
            .field("name", &self.caller_name())
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl From<&str> for ApiKey {
    fn from(key: &str) -> Self {
        Self {
            key: key.to_string(),
            ..Self::default()
        }
    }
}

impl ApiKey {
    /// Its name, or `key-` and the first 8 hex digits of the key's SHA-256.
    pub fn caller_name(&self) -> String {
        match &self.name {
            Some(n) => n.clone(),
            None => {
                let d = Sha256::digest(self.key.as_bytes());
                let hex: String = d.iter().take(4).map(|b| format!("{b:02x}")).collect();
                format!("key-{hex}")
            }
        }
    }
}

/// The map form of an [`ApiKey`].
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ApiKeyFields {
    key: String,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    limits: Limits,
}

impl<'de> Deserialize<'de> for ApiKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = ApiKey;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a key, or a map {key, name, limits}")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ApiKey, E> {
                Ok(ApiKey::from(v))
            }
            fn visit_map<M: MapAccess<'de>>(self, map: M) -> Result<ApiKey, M::Error> {
                let f = ApiKeyFields::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(ApiKey {
                    key: f.key,
                    name: f.name,
                    limits: f.limits,
                })
            }
        }
        d.deserialize_any(KeyVisitor)
    }
}

/// What a caller may do; every limit is off when unset.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Requests per minute, as a token bucket refilling `rpm / 60` a second.
    #[serde(default)]
    pub rpm: Option<u32>,
    /// Requests that may come at once after a quiet spell (default: `rpm`).
    #[serde(default)]
    pub burst: Option<u32>,
    /// Model tokens per minute (prompt and completion, from the upstream's `usage`),
    /// charged after each call; a caller over it waits until it is paid back.
    #[serde(default)]
    pub tpm: Option<u64>,
    /// Requests in flight at once (a stream counts until it ends).
    #[serde(default)]
    pub max_concurrency: Option<u32>,
    /// Seconds a request may take, its whole answer (a stream too) included.
    #[serde(default)]
    pub timeout_s: Option<f64>,
}

impl Limits {
    /// These limits, with what is unset taken from `defaults`.
    pub fn or(self, defaults: &Limits) -> Limits {
        Limits {
            rpm: self.rpm.or(defaults.rpm),
            burst: self.burst.or(if self.rpm.is_some() {
                None
            } else {
                defaults.burst
            }),
            tpm: self.tpm.or(defaults.tpm),
            max_concurrency: self.max_concurrency.or(defaults.max_concurrency),
            timeout_s: self.timeout_s.or(defaults.timeout_s),
        }
    }

    fn check(&self, at: &str) -> Result<(), ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(format!("{at}: {m}")));
        if self.rpm == Some(0) || self.tpm == Some(0) || self.max_concurrency == Some(0) {
            return invalid(
                "rpm, tpm and max_concurrency must be above 0 (leave one out for no limit)".into(),
            );
        }
        if self.burst == Some(0) {
            return invalid("burst must be at least 1".into());
        }
        if let Some(t) = self.timeout_s {
            if !(t.is_finite() && t > 0.0) {
                return invalid("timeout_s must be a positive number of seconds".into());
            }
        }
        Ok(())
    }
}

fn default_max_body() -> usize {
    DEFAULT_MAX_BODY_BYTES
}

fn default_health_check_interval() -> f64 {
    DEFAULT_HEALTH_CHECK_INTERVAL_S
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
        if self.api_keys.is_empty() || self.api_keys.iter().any(|k| k.key.trim().is_empty()) {
            return invalid(
                "api_keys: give at least one non-empty key (callers send it as \
                 Authorization: Bearer KEY)"
                    .into(),
            );
        }
        let mut seen = HashSet::new();
        for (i, k) in self.api_keys.iter().enumerate() {
            if !seen.insert(k.key.as_str()) {
                return invalid(format!("api_keys[{i}]: the same key is listed twice"));
            }
            k.limits.check(&format!("api_keys[{i}].limits"))?;
        }
        for (tenant, limits) in &self.tenant_limits {
            limits.check(&format!("tenant_limits.{tenant}"))?;
        }
        if let Some(limits) = &self.default_tenant_limits {
            limits.check("default_tenant_limits")?;
        }
        for (i, k) in self.api_keys.iter().enumerate() {
            if k.name.as_deref().is_some_and(|n| n.trim().is_empty()) {
                return invalid(format!("api_keys[{i}].name: must not be empty"));
            }
        }
        self.default_limits.check("default_limits")?;
        self.cache.check().map_err(ConfigError::Invalid)?;
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
        if !(self.health_check_interval_s.is_finite() && self.health_check_interval_s >= 0.0) {
            return invalid(
                "health_check_interval_s: must be 0 (no probes) or a positive number of seconds"
                    .into(),
            );
        }
        Ok(())
    }

    /// Whether `key` is one of the configured keys.
    pub fn key_allowed(&self, key: &str) -> bool {
        self.find_key(key).is_some()
    }

    /// The index in `api_keys` of `key` (compared by digest, every entry, in constant
    /// time for keys of any length).
    pub fn find_key(&self, key: &str) -> Option<usize> {
        find_digest(&self.key_digests(), key)
    }

    /// The digest of each of `api_keys`, for [`find_digest`].
    pub fn key_digests(&self) -> Vec<KeyDigest> {
        self.api_keys
            .iter()
            .map(|k| Sha256::digest(k.key.as_bytes()).into())
            .collect()
    }

    /// The limits tenant `tenant`'s sandbox tokens share, if any.
    pub fn tenant_limits_of(&self, tenant: &str) -> Option<Limits> {
        self.tenant_limits
            .get(tenant)
            .or(self.default_tenant_limits.as_ref())
            .copied()
    }

    /// The limits of `api_keys[index]`, its defaults filled in.
    pub fn limits_of(&self, index: usize) -> Limits {
        self.api_keys
            .get(index)
            .map_or(self.default_limits, |k| k.limits.or(&self.default_limits))
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

/// The SHA-256 of a configured key.
pub type KeyDigest = [u8; 32];

/// The index in `digests` ([`GatewayConfig::key_digests`]) of `key`'s digest, compared
/// with every entry in constant time whatever the key's length.
pub fn find_digest(digests: &[KeyDigest], key: &str) -> Option<usize> {
    let given = Sha256::digest(key.as_bytes());
    let mut found = None;
    for (i, want) in digests.iter().enumerate() {
        let diff = want
            .iter()
            .zip(given.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        if diff == 0 {
            found = Some(i);
        }
    }
    found
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
        assert_eq!(
            c.cache,
            CacheConfig::default(),
            "the cache is on by default"
        );
        assert!(c.cache.enabled());
        assert!(c.key_allowed("k1"));
        assert!(!c.key_allowed("k2"));
        assert!(!c.key_allowed(""));
    }

    #[test]
    fn a_key_is_a_string_or_a_map_with_limits() {
        let c = parse(
            "api_keys:\n  - plain\n  - key: k2\n    name: team-a\n    limits: {rpm: 120, burst: 1}\n\
             default_limits: {rpm: 60, tpm: 1000, timeout_s: 30}\n\
             models:\n  m: {upstreams: [{url: http://h/v1}]}\n",
        )
        .expect("config");
        assert_eq!(c.find_key("plain"), Some(0));
        assert_eq!(c.find_key("k2"), Some(1));
        assert_eq!(c.api_keys[1].caller_name(), "team-a");
        assert!(c.api_keys[0].caller_name().starts_with("key-"));
        assert!(
            !format!("{c:?}").contains("plain"),
            "Debug never shows a key"
        );
        // A plain key takes the defaults; a key's own limits win field by field, and
        // its own rpm comes with its own burst (not the default's).
        assert_eq!(c.limits_of(0).rpm, Some(60));
        let own = c.limits_of(1);
        assert_eq!(
            (own.rpm, own.burst, own.tpm, own.timeout_s),
            (Some(120), Some(1), Some(1000), Some(30.0))
        );
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
            (
                "api_keys: [{key: k, limits: {rpm: 0}}]\nmodels:\n  m: {upstreams: [{url: http://x}]}\n",
                "api_keys[0].limits",
            ),
            (
                "api_keys: [{key: k, limits: {rmp: 5}}]\nmodels:\n  m: {upstreams: [{url: http://x}]}\n",
                "rmp",
            ),
            (
                "api_keys: [k, k]\nmodels:\n  m: {upstreams: [{url: http://x}]}\n",
                "twice",
            ),
            (
                "api_keys: [k]\ndefault_limits: {timeout_s: -1}\nmodels:\n  m: {upstreams: [{url: http://x}]}\n",
                "timeout_s",
            ),
            (
                "api_keys: [k]\ncache: {ttl_s: 0}\nmodels:\n  m: {upstreams: [{url: http://x}]}\n",
                "cache.ttl_s",
            ),
        ] {
            let e = parse(yaml).expect_err(yaml);
            assert!(e.to_string().contains(says), "{yaml}: {e}");
        }
    }
}

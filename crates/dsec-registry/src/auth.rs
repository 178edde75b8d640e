//! Per-registry credentials: a JSON file the node reads at start (`--registry-auth FILE`),
//! keyed by registry host as references name it (`host[:port]`; Docker Hub is
//! `docker.io`):
//!
//! ```json
//! {
//!   "registry.example:5000": { "username": "ci", "password": "s3cret" },
//!   "ghcr.io": { "token": "a pre-issued bearer token" }
//! }
//! ```
//!
//! A username and password are sent as HTTP basic auth to a registry that asks for it, or
//! exchanged for a bearer token at the realm a registry's `WWW-Authenticate: Bearer`
//! challenge names (the standard token flow, done by `oci-client`); a `token` is sent as
//! is. Registries not listed are pulled from anonymously.

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use oci_client::secrets::RegistryAuth;
use oci_client::Reference;
use serde::Deserialize;

use crate::{RegistryError, Result};

/// One registry's credentials.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged, deny_unknown_fields)]
pub enum Credential {
    /// HTTP basic auth, or a token exchange with these.
    Basic {
        /// User name.
        username: String,
        /// Password (or an access token the registry takes as one).
        password: String,
    },
    /// A bearer token sent as is.
    Token {
        /// The token.
        token: String,
    },
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Credential::Basic { username, .. } => f
                .debug_struct("Basic")
                .field("username", username)
                .finish_non_exhaustive(),
            Credential::Token { .. } => f.write_str("Token(..)"),
        }
    }
}

/// Credentials by registry host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Credentials {
    by_registry: HashMap<String, Credential>,
}

impl Credentials {
    /// Reads the credentials file `path` (format above). A file that others than its
    /// owner may read is refused: it holds passwords.
    pub fn load(path: &Path) -> Result<Self> {
        let bad = |message: String| RegistryError::Credentials {
            path: path.display().to_string(),
            message,
        };
        let meta = std::fs::metadata(path).map_err(|e| bad(e.to_string()))?;
        if meta.permissions().mode() & 0o077 != 0 {
            return Err(bad(format!(
                "mode {:o} lets others read it; chmod 600 it",
                meta.permissions().mode() & 0o777
            )));
        }
        let bytes = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
        Self::parse(&bytes).map_err(bad)
    }

    /// Parses the file's JSON.
    pub fn parse(bytes: &[u8]) -> std::result::Result<Self, String> {
        let by_registry: HashMap<String, Credential> =
            serde_json::from_slice(bytes).map_err(|e| {
                format!(
                    "not a JSON object of registry -> {{\"username\",\"password\"}} or \
                 {{\"token\"}}: {e}"
                )
            })?;
        if let Some(k) = by_registry.keys().find(|k| k.is_empty() || k.contains('/')) {
            return Err(format!(
                "{k:?} is not a registry host (write host or host:port, no scheme or path)"
            ));
        }
        Ok(Self { by_registry })
    }

    /// Adds (or replaces) `registry`'s credentials.
    pub fn insert(&mut self, registry: &str, cred: Credential) {
        self.by_registry.insert(registry.to_string(), cred);
    }

    /// Whether any registry has credentials.
    pub fn is_empty(&self) -> bool {
        self.by_registry.is_empty()
    }

    /// What to present to the registry of `reference`.
    pub(crate) fn for_reference(&self, reference: &Reference) -> RegistryAuth {
        let cred = self
            .by_registry
            .get(reference.registry())
            .or_else(|| self.by_registry.get(reference.resolve_registry()));
        match cred {
            Some(Credential::Basic { username, password }) => {
                RegistryAuth::Basic(username.clone(), password.clone())
            }
            Some(Credential::Token { token }) => RegistryAuth::Bearer(token.clone()),
            None => RegistryAuth::Anonymous,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_basic_and_token_entries() {
        let c = Credentials::parse(
            br#"{"localhost:5000":{"username":"u","password":"p"},"ghcr.io":{"token":"t"}}"#,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let r = |s: &str| s.parse::<Reference>().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            c.for_reference(&r("localhost:5000/a/b:1")),
            RegistryAuth::Basic("u".into(), "p".into())
        );
        assert_eq!(
            c.for_reference(&r("ghcr.io/o/x")),
            RegistryAuth::Bearer("t".into())
        );
        assert_eq!(c.for_reference(&r("busybox")), RegistryAuth::Anonymous);
    }

    #[test]
    fn refuses_malformed_files() {
        assert!(Credentials::parse(br#"{"https://r/":{"token":"t"}}"#).is_err());
        assert!(Credentials::parse(br#"{"r":{"username":"u"}}"#).is_err());
        assert!(Credentials::parse(b"[]").is_err());
    }

    #[test]
    fn a_file_others_may_read_is_refused() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("auth.json");
        std::fs::write(&path, br#"{"r:5000":{"token":"t"}}"#).unwrap_or_else(|e| panic!("{e}"));
        let chmod = |mode| {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
                .unwrap_or_else(|e| panic!("{e}"))
        };
        chmod(0o644);
        let err = Credentials::load(&path).expect_err("world-readable");
        assert!(err.to_string().contains("chmod 600"), "{err}");
        chmod(0o600);
        assert!(!Credentials::load(&path)
            .unwrap_or_else(|e| panic!("{e}"))
            .is_empty());
    }

    #[test]
    fn debug_hides_secrets() {
        let c = Credential::Basic {
            username: "u".into(),
            password: "hunter2".into(),
        };
        assert!(!format!("{c:?}").contains("hunter2"));
    }
}

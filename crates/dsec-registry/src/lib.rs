//! Pulls images from OCI registries into the dsec image store.
//!
//! The protocol is `oci-client`'s (the OCI distribution client of the oras project):
//! manifest and blob requests, the `WWW-Authenticate` challenge (basic auth, or a bearer
//! token fetched from the challenge's realm), plain HTTP for `insecure` registries. This
//! crate decides what to fetch and checks it:
//! - a reference (`[registry[:port]/]repository[:tag][@sha256:...]`) resolves to a manifest;
//!   an image index (OCI index or Docker manifest list) to its `linux` entry for this
//!   machine's architecture (`amd64` on x86-64); manifests fetched by digest are checked
//!   against it;
//! - the config and every layer blob are downloaded with a size limit, checked against
//!   the manifest's size and digest (a truncated, oversized or corrupt blob fails the
//!   pull) into a directory under the store's `tmp/`;
//! - `dsec-image` turns the blobs into EROFS layers as an OCI import does (gzip and zstd
//!   with its decompression-bomb cutoff, diff_id checks), once per layer blob: a layer
//!   converted before (here, or on a node sharing the blob store) is neither downloaded
//!   nor converted again.
//!
//! A failed pull keeps nothing: no ref, no new layer, no temp file.

use std::sync::Arc;
use std::time::Duration;

use dsec_image::{Image, ImageError, ImageStore};
use dsec_wire::v1::{ImportEvent, PullImageRequest};
use dsec_wire::{ApiError, ErrorCode};
use oci_client::Reference;

pub mod allow;
pub mod auth;
mod egress;
mod flight;
mod pull;

pub use allow::Allow;
pub use auth::{Credential, Credentials};
pub use flight::Puller;

/// Largest manifest or index accepted (the OCI distribution spec's suggested limit).
pub const MANIFEST_LIMIT: u64 = 4 << 20;
/// Largest image config accepted.
pub const CONFIG_LIMIT: u64 = 16 << 20;
/// Default number of layer blobs one pull downloads at once.
pub const DEFAULT_PARALLEL_DOWNLOADS: usize = 3;
/// Default largest layer blob accepted (compressed, as the registry serves it).
pub const DEFAULT_LAYER_LIMIT: u64 = 16 << 30;

/// Why a pull failed.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The reference does not parse.
    #[error("invalid image reference {reference:?}: {message}")]
    InvalidReference {
        /// As given.
        reference: String,
        /// Why.
        message: String,
    },
    /// The credentials file is unreadable or malformed.
    #[error("registry credentials file {path}: {message}")]
    Credentials {
        /// Its path.
        path: String,
        /// Why.
        message: String,
    },
    /// The registry is not one this node may pull from (`--allow-registry`).
    #[error("{0}")]
    Refused(String),
    /// The registry refused the credentials, or wants some and has none.
    #[error("{0}")]
    Unauthorized(String),
    /// The registry has no such repository, tag or manifest.
    #[error("{0}")]
    NotFound(String),
    /// The registry could not be reached, or a transfer broke off.
    #[error("{0}")]
    Transport(String),
    /// What the registry serves is not an image this node can use (media type, platform,
    /// malformed manifest).
    #[error("{0}")]
    Unsupported(String),
    /// A manifest, config or layer is larger than allowed.
    #[error("{what} is {size} bytes, more than the {limit} allowed")]
    TooLarge {
        /// Which.
        what: String,
        /// Its size.
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// A blob's bytes do not match the manifest (corrupt, truncated or oversized).
    #[error("{0}")]
    Corrupt(String),
    /// Storing the image failed (including the layer's own checks during conversion).
    #[error(transparent)]
    Image(#[from] ImageError),
    /// A local file operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// The operation.
        op: &'static str,
        /// On what.
        path: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// Result of this crate.
pub type Result<T, E = RegistryError> = std::result::Result<T, E>;

impl RegistryError {
    /// The API error code of this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            RegistryError::InvalidReference { .. }
            | RegistryError::Credentials { .. }
            | RegistryError::Unauthorized(_)
            | RegistryError::Unsupported(_)
            | RegistryError::Corrupt(_) => ErrorCode::BadRequest,
            RegistryError::NotFound(_) => ErrorCode::ImageNotFound,
            RegistryError::Refused(_) => ErrorCode::Forbidden,
            RegistryError::TooLarge { .. } => ErrorCode::PayloadTooLarge,
            RegistryError::Transport(_) => ErrorCode::Timeout,
            RegistryError::Image(ImageError::NotFound(_)) => ErrorCode::ImageNotFound,
            RegistryError::Image(
                ImageError::InvalidName { .. }
                | ImageError::InvalidDigest(_)
                | ImageError::UnsupportedSource(_)
                | ImageError::UnsafeEntry { .. }
                | ImageError::NotErofs(_)
                | ImageError::DigestMismatch { .. }
                | ImageError::InvalidImage { .. }
                | ImageError::Archive { .. },
            ) => ErrorCode::BadRequest,
            RegistryError::Image(_) | RegistryError::Io { .. } => ErrorCode::Internal,
        }
    }
}

impl From<&RegistryError> for ApiError {
    fn from(e: &RegistryError) -> Self {
        ApiError::new(e.code(), e.to_string())
    }
}

impl From<RegistryError> for ApiError {
    fn from(e: RegistryError) -> Self {
        (&e).into()
    }
}

/// Where progress of a pull goes (the same events an import reports).
pub type Progress = Arc<dyn Fn(ImportEvent) + Send + Sync>;

/// How a node pulls.
#[derive(Debug, Clone)]
pub struct RegistryConfig {
    /// Credentials by registry.
    pub credentials: Credentials,
    /// Registries pulls may reach.
    pub allow: Allow,
    /// Registries (`host[:port]` as references name them) spoken to in plain HTTP,
    /// whatever a request says (`--insecure-registry`).
    pub insecure: Vec<String>,
    /// Largest layer blob accepted.
    pub layer_limit: u64,
    /// Layer blobs of one pull downloaded at once.
    pub parallel_downloads: usize,
    /// Connect timeout of registry requests.
    pub connect_timeout: Duration,
    /// How long a request may go without receiving anything.
    pub read_timeout: Duration,
}

impl Default for RegistryConfig {
    fn default() -> Self {
        Self {
            credentials: Credentials::default(),
            allow: Allow::default(),
            insecure: Vec::new(),
            layer_limit: DEFAULT_LAYER_LIMIT,
            parallel_downloads: DEFAULT_PARALLEL_DOWNLOADS,
            connect_timeout: Duration::from_secs(10),
            read_timeout: Duration::from_secs(60),
        }
    }
}

/// Parses an image reference (`[registry[:port]/]repository[:tag][@sha256:...]`).
pub fn parse_reference(reference: &str) -> Result<Reference> {
    let trimmed = reference.trim();
    trimmed
        .parse::<Reference>()
        .map_err(|e| RegistryError::InvalidReference {
            reference: reference.to_string(),
            message: e.to_string(),
        })
}

/// The image name a pull of `reference` stores without a `name`: the reference as
/// written, with `@` written `:` (image names have no `@`).
pub fn default_name(reference: &str) -> String {
    reference.trim().replace('@', ":")
}

/// Pulls `req` into `store` with `config`; see the crate doc.
pub async fn pull(
    store: Arc<ImageStore>,
    config: &RegistryConfig,
    req: &PullImageRequest,
    progress: Progress,
) -> Result<Image> {
    pull::pull(store, config, req, progress).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_and_default_names() {
        let r = parse_reference("localhost:5000/org/app:v1").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r.registry(), "localhost:5000");
        assert_eq!(r.repository(), "org/app");
        assert_eq!(r.tag(), Some("v1"));
        let hex = "a".repeat(64);
        let d = format!("localhost:5000/app@sha256:{hex}");
        assert_eq!(
            parse_reference(&d)
                .unwrap_or_else(|e| panic!("{e}"))
                .digest(),
            Some(format!("sha256:{hex}").as_str())
        );
        assert_eq!(default_name(&d), format!("localhost:5000/app:sha256:{hex}"));
        assert!(dsec_image::validate_name(&default_name("localhost:5000/org/app:v1")).is_ok());
        assert!(parse_reference("org/Upper").is_err());
        assert!(parse_reference("").is_err());
    }

    #[test]
    fn error_codes() {
        assert_eq!(
            RegistryError::NotFound("x".into()).code(),
            ErrorCode::ImageNotFound
        );
        assert_eq!(
            RegistryError::Unauthorized("x".into()).code(),
            ErrorCode::BadRequest
        );
    }
}

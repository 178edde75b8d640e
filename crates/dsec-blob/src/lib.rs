//! Blob stores of dsec: where the bytes of image layers (and the small records naming them)
//! live, so that every node of a cluster finds the same layers.
//!
//! One synchronous trait, [`BlobStore`], with three backends:
//!
//! - [`DirStore`]: a directory (local, or a shared mount such as NFS). Writes go to a
//!   temporary file and are renamed into place, so readers never see half an object;
//!   uploads and downloads hard-link instead of copying when both sides share a file system.
//! - S3-compatible object stores (`s3://bucket/prefix`), through the `object_store` crate
//!   (signed requests, multipart uploads, retries). Credentials, region and endpoint come
//!   from the usual `AWS_*` environment variables or from `?endpoint=...&region=...` on the URL.
//! - HTTP(S) servers (`http://host/prefix`): GET with `Range` for reads; writes need a
//!   server that accepts PUT and DELETE (WebDAV style).
//!
//! Keys are relative, `/`-separated paths (`blobs/sha256/<hex>.erofs`, `refs/<name>.json`);
//! [`validate_key`] refuses anything that could leave the store's root.
//!
//! The trait is blocking on purpose: its callers are the image store (run on blocking
//! threads) and, later, FUSE request handlers (plain threads). The object-store backends
//! drive their async client on a runtime of their own, so they may be called from any
//! thread that may block, including tokio's blocking pool.

use std::fmt;
use std::future::Future;
use std::ops::Range;
use std::path::Path;
use std::time::SystemTime;

mod dir;
mod remote;

pub use dir::DirStore;
pub use remote::ObjectStoreBackend;

/// Errors of a blob store. Messages name the store and the key.
#[derive(Debug, thiserror::Error)]
pub enum BlobError {
    /// The key does not exist.
    #[error("{store}: {key} not found")]
    NotFound {
        /// The store's URL.
        store: String,
        /// The key.
        key: String,
    },
    /// The key is not a safe relative path.
    #[error("invalid blob key {key:?}: {reason}")]
    InvalidKey {
        /// The key as given.
        key: String,
        /// Why it was refused.
        reason: &'static str,
    },
    /// The store URL is not understood.
    #[error("invalid blob store {url:?}: {reason}")]
    InvalidUrl {
        /// The URL as given.
        url: String,
        /// Why it was refused.
        reason: String,
    },
    /// A local file operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was attempted.
        op: &'static str,
        /// The path that failed.
        path: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The remote store refused or failed a request.
    #[error("{store}: {op} {key}: {message}")]
    Remote {
        /// The store's URL.
        store: String,
        /// What was attempted.
        op: &'static str,
        /// The key.
        key: String,
        /// The error, with its causes.
        message: String,
    },
    /// A range read past the end of the object, or an empty/reversed range.
    #[error("{store}: {key}: bad range {start}..{end}")]
    BadRange {
        /// The store's URL.
        store: String,
        /// The key.
        key: String,
        /// Range start.
        start: u64,
        /// Range end.
        end: u64,
    },
}

impl BlobError {
    pub(crate) fn io(op: &'static str, path: &Path, source: std::io::Error) -> Self {
        BlobError::Io {
            op,
            path: path.display().to_string(),
            source,
        }
    }
}

/// Result alias of this crate.
pub type Result<T, E = BlobError> = std::result::Result<T, E>;

/// What a store knows of one object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectInfo {
    /// Its key.
    pub key: String,
    /// Its size in bytes.
    pub size: u64,
    /// When it was last written.
    pub modified: SystemTime,
}

/// Where blobs live. Blocking; see the module docs.
pub trait BlobStore: Send + Sync + fmt::Debug {
    /// The store's URL, for messages and `/v1/health`.
    fn url(&self) -> String;

    /// Size and age of `key`, or `None` if absent.
    fn head(&self, key: &str) -> Result<Option<ObjectInfo>>;

    /// The whole of a small object, or `None` if absent.
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>>;

    /// Bytes `range` of `key`; a range running past the end is cut at the end, one
    /// starting at or past it is an error.
    fn get_range(&self, key: &str, range: Range<u64>) -> Result<Vec<u8>>;

    /// Writes `key` to the new file `dest` (which must not exist), streaming. Returns its size.
    fn download(&self, key: &str, dest: &Path) -> Result<u64>;

    /// Stores `data` at `key`, replacing it; readers see the old or the new whole object.
    fn put(&self, key: &str, data: &[u8]) -> Result<()>;

    /// Stores the file `src` at `key`, replacing it; large files go up in parts.
    fn upload(&self, key: &str, src: &Path) -> Result<()>;

    /// Removes `key`; an absent key is not an error.
    fn delete(&self, key: &str) -> Result<()>;

    /// Every object whose key starts with `prefix` (a directory-like prefix ending in `/`).
    fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>>;
}

/// Checks that `key` is a relative `/`-separated path of plain components: not empty, no
/// leading or doubled `/`, no `.` or `..`, no backslash or control characters, at most
/// 1024 bytes.
pub fn validate_key(key: &str) -> Result<()> {
    let bad = |reason| {
        Err(BlobError::InvalidKey {
            key: key.to_string(),
            reason,
        })
    };
    if key.is_empty() {
        return bad("empty");
    }
    if key.len() > 1024 {
        return bad("longer than 1024 bytes");
    }
    if key.bytes().any(|b| b < 0x20 || b == 0x7f || b == b'\\') {
        return bad("contains a control character or backslash");
    }
    for part in key.split('/') {
        match part {
            "" => return bad("empty path component (leading, trailing or doubled `/`)"),
            "." | ".." => return bad("`.` or `..` component"),
            _ => {}
        }
    }
    Ok(())
}

/// Checks a list prefix: empty (everything) or a valid key followed by `/`.
pub(crate) fn validate_prefix(prefix: &str) -> Result<()> {
    if prefix.is_empty() {
        return Ok(());
    }
    match prefix.strip_suffix('/') {
        Some(p) => validate_key(p),
        None => Err(BlobError::InvalidKey {
            key: prefix.to_string(),
            reason: "a list prefix must end with `/`",
        }),
    }
}

/// Opens the store named by `spec`:
///
/// - an absolute path or `file:///path`: a [`DirStore`] (created if missing);
/// - `s3://bucket[/prefix]`: S3 or an S3-compatible server; options from `AWS_*` variables,
///   overridable by `?endpoint=URL&region=R` (an `http://` endpoint is allowed);
/// - `http://` / `https://`: an HTTP server read with Range requests.
pub fn open(spec: &str) -> Result<Box<dyn BlobStore>> {
    if spec.starts_with('/') {
        return Ok(Box::new(DirStore::open(spec)?));
    }
    let url = url::Url::parse(spec).map_err(|e| BlobError::InvalidUrl {
        url: spec.to_string(),
        reason: e.to_string(),
    })?;
    match url.scheme() {
        "file" => Ok(Box::new(DirStore::open(url.path())?)),
        "s3" => Ok(Box::new(ObjectStoreBackend::s3(spec, &url)?)),
        "http" | "https" => Ok(Box::new(ObjectStoreBackend::http(spec, &url)?)),
        other => Err(BlobError::InvalidUrl {
            url: spec.to_string(),
            reason: format!(
                "unknown scheme `{other}` (expected a path, file://, s3://, http(s)://)"
            ),
        }),
    }
}

/// Runs `fut` on `rt` and waits for it from a thread that may block (see the module docs).
/// `Err` carries the panic message of a task that panicked.
pub(crate) fn block_on<F>(rt: &tokio::runtime::Runtime, fut: F) -> Result<F::Output, String>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    futures::executor::block_on(rt.spawn(fut)).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_plain_relative_paths() {
        for ok in ["a", "blobs/sha256/ab.erofs", "refs/base%2Fdebian:12.json"] {
            assert!(validate_key(ok).is_ok(), "{ok}");
        }
        for bad in [
            "", "/abs", "a//b", "a/", "../x", "a/../b", "./a", "a\\b", "a\nb",
        ] {
            assert!(validate_key(bad).is_err(), "{bad:?}");
        }
        assert!(validate_key(&"a".repeat(1025)).is_err());
        assert!(validate_prefix("").is_ok());
        assert!(validate_prefix("refs/").is_ok());
        assert!(validate_prefix("refs").is_err());
        assert!(validate_prefix("../").is_err());
    }

    #[test]
    fn open_rejects_unknown_schemes() {
        let e = open("ftp://x/y").expect_err("ftp").to_string();
        assert!(e.contains("unknown scheme"), "{e}");
        assert!(open("not a url").is_err());
    }
}

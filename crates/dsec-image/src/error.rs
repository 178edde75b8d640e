//! The crate's error type: what failed, and for I/O on which path.

use std::io;
use std::path::{Path, PathBuf};

/// Errors of this crate. I/O errors name the path that failed.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// A filesystem operation failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was attempted.
        op: &'static str,
        /// The path that failed.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The image name is not acceptable.
    #[error("invalid image name {name:?}: {reason} (allowed: [a-z0-9][a-z0-9._:/-]{{0,127}}, not starting with `sha256:`)")]
    InvalidName {
        /// The name as given.
        name: String,
        /// Why it was rejected.
        reason: &'static str,
    },
    /// A digest string is malformed.
    #[error("invalid digest {0:?}: expected sha256:<64 lowercase hex>")]
    InvalidDigest(String),
    /// No image with that name or digest.
    #[error("image not found: {0}")]
    NotFound(String),
    /// The import source is neither a directory nor a (gzipped) tar.
    #[error("unsupported image source {}: expected a directory, .tar, .tar.gz or .tgz", .0.display())]
    UnsupportedSource(PathBuf),
    /// A tar archive could not be read or unpacked.
    #[error("archive {}: {message}", path.display())]
    Archive {
        /// The archive.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// A tar entry would land outside the extraction directory.
    #[error("archive {}: entry {} escapes the image root", archive.display(), entry.display())]
    UnsafeEntry {
        /// The archive.
        archive: PathBuf,
        /// The offending entry path.
        entry: PathBuf,
    },
    /// `mkfs.erofs` is not installed.
    #[error("mkfs.erofs not found: install erofs-utils")]
    MkfsMissing,
    /// `mkfs.erofs` failed.
    #[error("mkfs.erofs failed ({status}) building {}: {stderr}", dir.display())]
    MkfsFailed {
        /// Directory being packed.
        dir: PathBuf,
        /// Exit status.
        status: String,
        /// Its stderr (tail).
        stderr: String,
    },
    /// A file given to [`ImageStore::import_blob`](crate::ImageStore::import_blob) is not an EROFS image.
    #[error("{} is not an EROFS image (bad superblock magic)", .0.display())]
    NotErofs(PathBuf),
    /// `refs.json` is corrupt.
    #[error("parse {}: {source}", path.display())]
    Refs {
        /// The refs file.
        path: PathBuf,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
    /// mount(2) / umount(2) failed.
    #[error("{op} {} on {}: {errno}", source_path.display(), target.display())]
    Mount {
        /// `mount` or `umount`.
        op: &'static str,
        /// The blob file (for mount) or mount point (for umount).
        source_path: PathBuf,
        /// The mount point.
        target: PathBuf,
        /// The error.
        errno: nix::errno::Errno,
    },
    /// [`ImageStore::release`](crate::ImageStore::release) of a layer that is not acquired.
    #[error("layer {0} is not acquired")]
    NotAcquired(String),
    /// The shared blob store failed.
    #[error("shared store: {0}")]
    Shared(#[source] dsec_blob::BlobError),
    /// A `docker save` archive or OCI image layout is malformed or uses something unsupported.
    #[error("image {}: {message}", path.display())]
    InvalidImage {
        /// The image source (archive or directory).
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// Content of an image source does not match its digest.
    #[error("image {}: {what} has digest {actual}, expected {expected}", path.display())]
    DigestMismatch {
        /// The image source (archive or directory).
        path: PathBuf,
        /// What was checked (config, layer N blob, layer N uncompressed).
        what: String,
        /// The digest the image metadata names.
        expected: String,
        /// The digest of the content read.
        actual: String,
    },
}

impl ImageError {
    pub(crate) fn io(op: &'static str, path: &Path, source: io::Error) -> Self {
        ImageError::Io {
            op,
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Result alias of this crate.
pub type Result<T, E = ImageError> = std::result::Result<T, E>;

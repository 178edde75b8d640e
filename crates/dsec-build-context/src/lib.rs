//! The build context of a dsec Dockerfile build, and COPY/ADD steps out of it. Pure file
//! work: no network, no async.
//!
//! The client sends the context as a tar archive, which the server saves to a file;
//! [`Context::open`] indexes it (names checked and normalized, `.dockerignore` applied)
//! and [`Context::copy`] turns one planned [`CopyStep`](dsec_dockerfile::CopyStep) into
//! a tar archive that the builder uploads at `/` of the build sandbox, with a digest of
//! what was copied for the build cache. A tree downloaded from an earlier stage
//! (`COPY --from`) is a [`Context`] too, opened without `.dockerignore`.
//!
//! Docker's COPY semantics (the Dockerfile reference's COPY and ADD):
//! - sources are relative to the context root (a leading `/` is the root, `.` the whole
//!   context); wildcards per component with Go's `filepath.Match` syntax; a source that
//!   matches nothing, or only excluded paths, is an error;
//! - a directory source copies its contents into the destination (the destination
//!   directory takes the source directory's mode); a file goes at the destination, or
//!   inside it when the destination is a directory: it ends with `/` or `/.`, the
//!   builder found it is one in the image, or there are several sources;
//! - a source that is itself a symlink is dereferenced, as Docker's builders do: what it
//!   leads to is copied under its name (followed within the context: an absolute target
//!   is rooted there, `..` stops at its root; one leading out is an error); symlinks
//!   inside a copied directory, or in the middle of a source path, are not followed and
//!   are copied as symlinks; hard links of the context are regular files;
//! - `--chmod` applies to every file and directory; owners are the step's; mtimes are the
//!   archive's;
//! - ADD extracts a source that is a local tar archive (plain, gzip, zstd; detected by
//!   content) into the destination instead of copying it; bzip2 and xz archives are an
//!   error.
//!
//! Modules (private; their public items are re-exported here): `context` (the index),
//! `copy` (the output archive and digest), `archive` (ADD extraction), `glob` and `name`
//! (matching and paths), `error`.

mod archive;
mod context;
mod copy;
mod error;
mod glob;
mod name;

pub use archive::{MAX_EXPANSION_RATIO, MIN_EXPANSION_LIMIT};
pub use context::Context;
pub use error::ContextError;
pub use glob::{has_wildcards, Pattern};

/// Bounds on what an archive may make the server do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most entries in the context, and in each archive ADD extracts.
    pub max_entries: usize,
    /// Longest entry name, link target or destination path, in bytes.
    pub max_path_len: usize,
    /// Most bytes an ADD archive may extract to (its decompressed stream). A compressed
    /// archive is also held to [`MAX_EXPANSION_RATIO`] times its size (at least
    /// [`MIN_EXPANSION_LIMIT`]).
    pub max_extracted_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_entries: 1_000_000,
            max_path_len: 4096,
            max_extracted_bytes: 20 << 30,
        }
    }
}

/// What [`Context::copy`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyOutcome {
    /// sha256 (hex) over what was copied: per entry, in order, its destination path,
    /// type, mode, link target and content sha256; not mtimes nor the archive's owners,
    /// so the same files checked out again hit the build cache.
    pub digest: String,
    /// Absolute destination paths of the entries written, each once, in order (for the
    /// builder's `chown -h` under `--chown`).
    pub paths: Vec<String>,
    /// Bytes of file content written.
    pub bytes: u64,
}

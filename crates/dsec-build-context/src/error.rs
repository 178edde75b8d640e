//! [`ContextError`]: everything that can go wrong reading a context or copying from it.
//! Messages name the archive and the entry or source they are about, for the builder to
//! show the user as they are.

use std::io;

/// A build context that cannot be read, or a COPY/ADD step that cannot be done.
#[derive(Debug, thiserror::Error)]
pub enum ContextError {
    /// The archive is not a readable tar (bad header, truncated data...).
    #[error("{archive}: not a valid tar archive: {reason}")]
    BadArchive {
        /// Which archive: the build context, or an ADD source.
        archive: String,
        /// What is wrong.
        reason: String,
    },
    /// An entry whose name or link target is unsafe or unusable (`..`, NUL, not UTF-8,
    /// under a non-directory...).
    #[error("{archive}: entry {name:?}: {reason}")]
    UnsafeEntry {
        /// Which archive.
        archive: String,
        /// The entry's name as stored (lossily decoded).
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Something valid but not supported (sparse files, bzip2/xz archives...).
    #[error("{archive}: {what} is not supported")]
    Unsupported {
        /// Which archive.
        archive: String,
        /// What is not supported.
        what: String,
    },
    /// A [`Limits`](crate::Limits) value was exceeded.
    #[error("{archive}: {what} (limit {limit})")]
    Limit {
        /// Which archive.
        archive: String,
        /// What went past the limit.
        what: String,
        /// The limit.
        limit: u64,
    },
    /// A COPY/ADD source that matches nothing visible in the context.
    #[error(
        "no source files were specified: {pattern:?} matches nothing in the build context \
         (or only paths excluded by .dockerignore)"
    )]
    NoMatch {
        /// The source as written in the step.
        pattern: String,
    },
    /// A COPY/ADD source that is a symlink leading nowhere in the context.
    #[error("source {pattern:?}: {reason}")]
    BadSymlink {
        /// The source as written in the step.
        pattern: String,
        /// Where the link leads and why that fails.
        reason: String,
    },
    /// A source wildcard that is not a valid pattern.
    #[error("invalid source pattern {pattern:?}: {reason}")]
    BadPattern {
        /// The source as written in the step.
        pattern: String,
        /// What is wrong.
        reason: String,
    },
    /// A destination that cannot be written (NUL byte...).
    #[error("invalid destination {dest:?}: {reason}")]
    BadDest {
        /// The destination as written in the step.
        dest: String,
        /// What is wrong.
        reason: String,
    },
    /// The context's `.dockerignore` does not parse.
    #[error("build context: {0}")]
    DockerIgnore(#[from] dsec_dockerfile::IgnoreError),
    /// Reading the context file or writing the output failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
}

impl ContextError {
    pub(crate) fn io(what: impl Into<String>, source: io::Error) -> Self {
        ContextError::Io {
            what: what.into(),
            source,
        }
    }
}

//! Errors of the agent: [`AgentError`] for the process-level entry point, and helpers that
//! turn OS errors into wire [`ApiError`]s with a stable [`ErrorCode`].

use std::io;
use std::path::PathBuf;

use dsec_wire::{ApiError, ErrorCode};

/// Fatal errors of [`crate::run`]: the agent could not start serving.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The tokio runtime could not be built.
    #[error("building the tokio runtime: {0}")]
    Runtime(#[source] io::Error),
    /// The sandbox root directory could not be opened.
    #[error("opening the sandbox root {path}: {source}")]
    Root {
        /// The configured root.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The listening socket could not be registered with the runtime.
    #[error("listening socket: {0}")]
    Listener(#[source] io::Error),
    /// The SIGCHLD handler could not be installed.
    #[error("installing the SIGCHLD handler: {0}")]
    Signal(#[source] io::Error),
}

/// Result type of request handlers.
pub type ApiResult<T> = Result<T, ApiError>;

/// The wire code for an OS error.
pub fn io_code(err: &io::Error) -> ErrorCode {
    match err.raw_os_error() {
        Some(libc::ENOENT) => ErrorCode::NotFound,
        Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::EFBIG) => ErrorCode::NoSpace,
        Some(libc::ELOOP) | Some(libc::EXDEV) | Some(libc::ENAMETOOLONG) => ErrorCode::InvalidPath,
        Some(libc::EEXIST) | Some(libc::ENOTEMPTY) | Some(libc::EBUSY) => ErrorCode::Conflict,
        Some(libc::EACCES) | Some(libc::EPERM) | Some(libc::EROFS) | Some(libc::ENOTDIR)
        | Some(libc::EISDIR) | Some(libc::EINVAL) => ErrorCode::BadRequest,
        _ => match err.kind() {
            io::ErrorKind::InvalidInput => ErrorCode::InvalidPath,
            io::ErrorKind::NotFound => ErrorCode::NotFound,
            _ => ErrorCode::Internal,
        },
    }
}

/// Builds an [`ApiError`] for an OS error during `what` on `path`.
pub fn io_err(err: &io::Error, what: &str, path: &str) -> ApiError {
    ApiError::new(io_code(err), format!("{what} {path}: {err}"))
}

/// Shorthand for a [`ErrorCode::BadRequest`] error.
pub fn bad_request(msg: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::BadRequest, msg)
}

/// Shorthand for a [`ErrorCode::NotFound`] error.
pub fn not_found(msg: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::NotFound, msg)
}

/// Shorthand for a [`ErrorCode::Conflict`] error.
pub fn conflict(msg: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::Conflict, msg)
}

/// Shorthand for an [`ErrorCode::Internal`] error.
pub fn internal(msg: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::Internal, msg)
}

/// The sandbox's own process limit was reached starting `what` (a process, or a thread
/// of the agent's): the caller's to fix, so a `conflict` saying how.
pub fn pids_exhausted(what: &str) -> ApiError {
    conflict(format!(
        "{what}: the sandbox's process limit is reached (EAGAIN: resources.pids counts \
         every process and thread in it); wait for or kill processes, or create the \
         sandbox with a higher resources.pids"
    ))
}

/// The error of a thread the agent could not start for `what`.
pub fn thread_error(err: &io::Error, what: &str) -> ApiError {
    if err.raw_os_error() == Some(libc::EAGAIN) {
        return pids_exhausted(what);
    }
    internal(format!("{what}: starting a thread: {err}"))
}

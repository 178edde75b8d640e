//! Node errors and their mapping onto API error codes.

use dsec_wire::{ApiError, ErrorCode};

/// A node operation failed.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// No sandbox with this id on the node.
    #[error("sandbox {0} not found on this node")]
    NotFound(String),
    /// The image is unknown or unusable.
    #[error("image: {0}")]
    Image(#[from] dsec_image::ImageError),
    /// A sandbox disk could not be made or released.
    #[error("disk: {0}")]
    Disk(#[from] dsec_disk::DiskError),
    /// The node is full; retry later or elsewhere.
    #[error("node at capacity: {0}")]
    Capacity(String),
    /// The request asks for something this node is not set up to do.
    #[error("{0}")]
    Unsupported(String),
    /// A cgroup operation failed.
    #[error("cgroup: {0}")]
    Cgroup(#[from] dsec_cgroups::CgroupError),
    /// Sandbox networking failed or was refused.
    #[error(transparent)]
    Net(#[from] dsec_net::NetError),
    /// Sandbox creation failed; the message says at which step.
    #[error("create sandbox {id}: {reason}")]
    Create {
        /// Sandbox id.
        id: String,
        /// What went wrong.
        reason: String,
    },
    /// The sandbox's agent cannot be reached (its init died?).
    #[error("agent of sandbox {id} unreachable: {source}")]
    Agent {
        /// Sandbox id.
        id: String,
        /// Connect error.
        source: std::io::Error,
    },
    /// A virtual machine's QEMU failed a request (or the request was bad input).
    #[error(transparent)]
    Machine(#[from] dsec_vmm::VmmError),
    /// Local I/O failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was attempted.
        op: &'static str,
        /// On which path.
        path: String,
        /// OS error.
        source: std::io::Error,
    },
}

impl NodeError {
    pub(crate) fn io<'a>(
        op: &'static str,
        path: &'a std::path::Path,
    ) -> impl FnOnce(std::io::Error) -> NodeError + 'a {
        move |source| NodeError::Io {
            op,
            path: path.display().to_string(),
            source,
        }
    }

    /// The API error this maps to.
    pub fn to_api(&self) -> ApiError {
        let code = match self {
            NodeError::NotFound(_) => ErrorCode::NotFound,
            NodeError::Image(e) => image_code(e),
            NodeError::Agent { .. } => ErrorCode::AgentUnavailable,
            NodeError::Create { .. } | NodeError::Disk(_) => ErrorCode::Failed,
            NodeError::Unsupported(_) => ErrorCode::BadRequest,
            NodeError::Capacity(_) => ErrorCode::Capacity,
            NodeError::Net(
                dsec_net::NetError::Invalid(_)
                | dsec_net::NetError::Unavailable(_)
                | dsec_net::NetError::NoModelGateway,
            ) => ErrorCode::BadRequest,
            NodeError::Net(dsec_net::NetError::Exhausted) => ErrorCode::Capacity,
            NodeError::Net(_) => ErrorCode::Failed,
            NodeError::Machine(dsec_vmm::VmmError::Input(_)) => ErrorCode::BadRequest,
            NodeError::Machine(_) => ErrorCode::Failed,
            NodeError::Cgroup(_) | NodeError::Io { .. } => ErrorCode::Internal,
        };
        ApiError::new(code, self.to_string())
    }
}

impl From<NodeError> for ApiError {
    fn from(e: NodeError) -> Self {
        e.to_api()
    }
}

fn image_code(e: &dsec_image::ImageError) -> ErrorCode {
    use dsec_image::ImageError as E;
    match e {
        E::NotFound(_) => ErrorCode::ImageNotFound,
        E::InvalidName { .. }
        | E::InvalidDigest(_)
        | E::UnsupportedSource(_)
        | E::Archive { .. }
        | E::UnsafeEntry { .. }
        | E::InvalidImage { .. }
        | E::DigestMismatch { .. }
        | E::NotErofs(_) => ErrorCode::BadRequest,
        _ => ErrorCode::Internal,
    }
}

//! [`IamError`] and its mapping to the wire's [`ApiError`].

use std::time::Duration;

use dsec_state::StateError;
use dsec_wire::{ApiError, ErrorCode};

use crate::model::QuotaKind;

/// An IAM operation failed. Every refusal writes nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IamError {
    /// A tenant name is not 1-63 of `[a-z0-9-]` starting and ending with a letter or digit.
    #[error("invalid tenant name {name:?}: {why}")]
    InvalidTenantName {
        /// The name given.
        name: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A field is out of range (a key name, scopes, quotas, a usage delta).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// No such tenant.
    #[error("no tenant named {0:?}")]
    UnknownTenant(String),
    /// `create_tenant` of a name that exists (`default` always does).
    #[error("tenant {0:?} already exists")]
    TenantExists(String),
    /// The tenant is disabled: its keys are refused and it may not reserve quota.
    #[error("tenant {0:?} is disabled")]
    TenantDisabled(String),
    /// No API key with this id.
    #[error("no API key with id {0:?}")]
    UnknownKey(String),
    /// The key is revoked (or expired): it cannot be rotated.
    #[error("API key {0:?} is revoked or expired")]
    KeyRevoked(String),
    /// The presented key is missing, malformed, unknown, wrong, revoked or expired (one
    /// answer for all, so a caller learns nothing about which).
    #[error("missing or invalid API key")]
    Unauthenticated,
    /// The key is valid but lacks what the call needs.
    #[error("forbidden: {0}")]
    Forbidden(String),
    /// Reserving would exceed a tenant quota; nothing was reserved.
    #[error("quota exceeded for tenant {tenant:?}: {which} limit is {limit}, {used} in use{}",
        retry_after.map(|d| format!("; retry in {} ms", d.as_millis())).unwrap_or_default())]
    QuotaExceeded {
        /// The tenant.
        tenant: String,
        /// Which quota.
        which: QuotaKind,
        /// Its limit (for `creates_per_second`: the rate).
        limit: u64,
        /// What is in use (for `creates_per_second`: creates in the current burst).
        used: u64,
        /// For the rate quota: when a token will be there again.
        retry_after: Option<Duration>,
    },
    /// Too many replicas changed the tenant's usage at once for this call to get through
    /// before its deadline; nothing was reserved. Retryable.
    #[error("too much contention on tenant {0:?}'s usage; retry")]
    Contended(String),
    /// The state store failed.
    #[error(transparent)]
    Store(#[from] StateError),
    /// A stored IAM record could not be decoded.
    #[error("stored IAM data is corrupt: {0}")]
    Corrupt(String),
}

impl IamError {
    /// The wire error for this failure: the code clients switch on and a message.
    pub fn to_api_error(&self) -> ApiError {
        let code = match self {
            IamError::InvalidTenantName { .. } | IamError::Invalid(_) => ErrorCode::BadRequest,
            IamError::UnknownTenant(_) | IamError::UnknownKey(_) => ErrorCode::NotFound,
            IamError::TenantExists(_) | IamError::KeyRevoked(_) => ErrorCode::Conflict,
            IamError::TenantDisabled(_) | IamError::Forbidden(_) => ErrorCode::Forbidden,
            IamError::Unauthenticated => ErrorCode::Unauthorized,
            IamError::QuotaExceeded { .. } => ErrorCode::QuotaExceeded,
            // "Retry later": the store is unreachable, or the usage key is contended.
            IamError::Contended(_) | IamError::Store(StateError::Unavailable(_)) => {
                ErrorCode::Capacity
            }
            IamError::Store(_) | IamError::Corrupt(_) => ErrorCode::Internal,
        };
        ApiError::new(code, self.to_string())
    }
}

impl From<IamError> for ApiError {
    fn from(e: IamError) -> Self {
        e.to_api_error()
    }
}

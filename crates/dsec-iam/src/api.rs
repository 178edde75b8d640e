//! Request bodies of the admin HTTP API (`/v1/tenants`, `/v1/keys`); the responses are
//! [`crate::Tenant`], [`crate::KeyInfo`], [`crate::NewKey`] and [`crate::Usage`].

use serde::{Deserialize, Serialize};

use crate::model::{Quotas, Scope};

/// `POST /v1/tenants`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateTenant {
    /// The name (see [`crate::validate_tenant_name`]).
    pub name: String,
    /// Its quotas (default: unlimited).
    #[serde(default)]
    pub quotas: Quotas,
}

/// `PATCH /v1/tenants/{tenant}`: what is given is replaced, in one write.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct UpdateTenant {
    /// New quotas (all of them: an absent field is unlimited).
    #[serde(default)]
    pub quotas: Option<Quotas>,
    /// Disable or enable.
    #[serde(default)]
    pub disabled: Option<bool>,
}

/// `POST /v1/tenants/{tenant}/keys`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateKey {
    /// A label (at most 128 bytes, no control characters).
    #[serde(default)]
    pub name: String,
    /// What it may do (at least one).
    pub scopes: Vec<Scope>,
    /// When it expires (unix ms), if ever.
    #[serde(default)]
    pub expires_at: Option<u64>,
}

/// The query of `POST /v1/keys/{key_id}/rotate`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct RotateKey {
    /// How long the old key keeps working, in seconds (default 0: it stops at once).
    #[serde(default)]
    pub grace_s: u64,
}

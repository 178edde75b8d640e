//! The audit log (`GET /v1/audit`): who (key and tenant) did what (a state-changing
//! call: any method but GET and HEAD) to which sandbox, when, and with which result,
//! refused calls included. Each API server appends its own entries to its own files.

use serde::{Deserialize, Serialize};

/// Entries a query returns by default.
pub const DEFAULT_AUDIT_LIMIT: usize = 1000;
/// Entries a query returns at most.
pub const MAX_AUDIT_LIMIT: usize = 10_000;

/// One audited call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct AuditEntry {
    /// When it was answered (unix ms).
    pub at_ms: u64,
    /// Its request id (`x-request-id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// The caller's tenant; absent when the key was missing or refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// The caller's key id; absent when the key was missing or refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_id: Option<String>,
    /// HTTP method.
    pub method: String,
    /// Path (no query: it may carry data).
    pub path: String,
    /// The sandbox the path names, if it names one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<String>,
    /// HTTP status of the answer.
    pub status: u16,
    /// The error code of a refused or failed call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Milliseconds until the answer's head.
    pub duration_ms: u64,
    /// The caller's address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<String>,
}

/// Query of `GET /v1/audit`: every given filter must match.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct AuditQuery {
    /// Only entries at or after this time (unix ms); without it, the newest entries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since_ms: Option<u64>,
    /// Only this tenant's (a cluster admin's filter; a tenant admin sees its own only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Only calls on this sandbox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<String>,
    /// Only this key's calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_id: Option<String>,
    /// Only refused or failed calls (status 400 and above).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub failed: bool,
    /// Entries returned at most ([`DEFAULT_AUDIT_LIMIT`]; up to [`MAX_AUDIT_LIMIT`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<usize>,
}

impl AuditQuery {
    /// Whether `e` passes the filters.
    pub fn matches(&self, e: &AuditEntry) -> bool {
        self.since_ms.is_none_or(|t| e.at_ms >= t)
            && self
                .tenant
                .as_ref()
                .is_none_or(|t| e.tenant.as_ref() == Some(t))
            && self
                .sandbox
                .as_ref()
                .is_none_or(|s| e.sandbox.as_ref() == Some(s))
            && self
                .key_id
                .as_ref()
                .is_none_or(|k| e.key_id.as_ref() == Some(k))
            && (!self.failed || e.status >= 400)
    }
}

/// Answer of `GET /v1/audit`: oldest first.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct AuditList {
    /// The entries.
    pub entries: Vec<AuditEntry>,
    /// True if more entries matched than `limit` (with `since_ms`, ask again from the
    /// last one's time; without, these are the newest).
    pub truncated: bool,
}

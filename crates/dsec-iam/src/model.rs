//! The records IAM keeps and the values its API hands out.

use serde::{Deserialize, Serialize};

use crate::error::IamError;

/// Namespace of tenant records (key: tenant name, value: JSON [`Tenant`]).
pub const TENANTS_NS: &str = "tenants";
/// Namespace of API key records (key: key id, value: JSON; the secret's SHA-256 only).
pub const KEYS_NS: &str = "apikeys";
/// Namespace of per-tenant usage (key: tenant name, value: JSON usage and rate bucket).
pub const USAGE_NS: &str = "usage";
/// The tenant that always exists: the operator's. Until a record is written for it (by
/// `set_quotas` or `set_disabled`) it is unlimited and enabled. Its `admin` keys are
/// cluster admins (see [`Principal::is_cluster_admin`]).
pub const DEFAULT_TENANT: &str = "default";
/// The key id of the bootstrap key (`dsec serve --api-key`), never stored.
pub const BOOTSTRAP_KEY_ID: &str = "bootstrap";
/// The longest key name.
pub const MAX_KEY_NAME: usize = 128;

/// What a key may do. Every scope includes [`Scope::Read`]; [`Scope::Admin`] includes
/// every scope.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    /// Read-only calls (`GET`/`HEAD`): list and inspect sandboxes, read files, list images.
    Read,
    /// Create, exec in, write files of, pause, resume and delete sandboxes.
    Sandboxes,
    /// Import, build and delete images.
    Images,
    /// Manage keys: of its own tenant, or, for keys of the `default` tenant, every
    /// tenant, its keys and quotas.
    Admin,
}

impl Scope {
    /// Every scope.
    pub const ALL: [Scope; 4] = [Scope::Read, Scope::Sandboxes, Scope::Images, Scope::Admin];

    /// The scope's wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Read => "read",
            Scope::Sandboxes => "sandboxes",
            Scope::Images => "images",
            Scope::Admin => "admin",
        }
    }
}

impl std::fmt::Display for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Scope {
    type Err = IamError;

    fn from_str(s: &str) -> Result<Self, IamError> {
        Scope::ALL
            .into_iter()
            .find(|c| c.as_str() == s)
            .ok_or_else(|| {
                IamError::Invalid(format!(
                    "unknown scope {s:?} (read, sandboxes, images or admin)"
                ))
            })
    }
}

/// The scope an HTTP call needs: `/v1/tenants*` and `/v1/keys*` need `admin`; a
/// sandbox's terminal (`.../terminal`, a WebSocket) needs `sandboxes`; other
/// `GET`/`HEAD` calls need `read`; other calls under `/v1/images` need `images`;
/// everything else (sandboxes, jobs, the E2B and SWE-ReX fronts) needs `sandboxes`.
pub fn required_scope(method: &str, path: &str) -> Scope {
    let under = |prefix: &str| {
        path.strip_prefix(prefix)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
    };
    if under("/v1/tenants") || under("/v1/keys") {
        Scope::Admin
    } else if path.ends_with("/terminal") {
        // A terminal is a GET (a WebSocket upgrade) that runs commands.
        Scope::Sandboxes
    } else if method.eq_ignore_ascii_case("GET") || method.eq_ignore_ascii_case("HEAD") {
        Scope::Read
    } else if under("/v1/images") {
        Scope::Images
    } else {
        Scope::Sandboxes
    }
}

/// Per-tenant limits; `None` is unlimited.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct Quotas {
    /// Sandboxes that exist at once.
    #[serde(default)]
    pub max_sandboxes: Option<u64>,
    /// Sum of the sandboxes' CPU limits, in thousandths of a CPU.
    #[serde(default)]
    pub max_cpu_millis: Option<u64>,
    /// Sum of the sandboxes' memory limits, in MiB.
    #[serde(default)]
    pub max_memory_mb: Option<u64>,
    /// Sustained creates per second (a token bucket refilled at this rate; `0` refuses
    /// every create).
    #[serde(default)]
    pub creates_per_second: Option<u32>,
    /// Creates allowed at once after a quiet spell (the bucket's size); default
    /// `creates_per_second` (at least 1). Needs `creates_per_second`.
    #[serde(default)]
    pub creates_burst: Option<u32>,
}

impl Quotas {
    /// Refuses a burst without a rate, or a burst of 0.
    pub fn validate(&self) -> Result<(), IamError> {
        match (self.creates_per_second, self.creates_burst) {
            (None, Some(_)) => Err(IamError::Invalid(
                "creates_burst needs creates_per_second".into(),
            )),
            (Some(_), Some(0)) => Err(IamError::Invalid("creates_burst must be at least 1".into())),
            _ => Ok(()),
        }
    }

    /// The bucket's size in creates, if there is a rate quota.
    pub(crate) fn burst(&self) -> Option<u64> {
        let rate = self.creates_per_second?;
        Some(u64::from(self.creates_burst.unwrap_or(rate).max(1)))
    }
}

/// A tenant: the unit of isolation, quotas and keys.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Tenant {
    /// Name (see [`validate_tenant_name`]).
    pub name: String,
    /// Creation time (unix ms; 0 for the implicit `default`).
    pub created_at: u64,
    /// Limits.
    #[serde(default)]
    pub quotas: Quotas,
    /// A disabled tenant's keys are refused (`forbidden`) and it reserves nothing.
    #[serde(default)]
    pub disabled: bool,
}

impl Tenant {
    /// The implicit `default` tenant: unlimited and enabled.
    pub(crate) fn implicit_default() -> Self {
        Tenant {
            name: DEFAULT_TENANT.into(),
            created_at: 0,
            quotas: Quotas::default(),
            disabled: false,
        }
    }
}

/// Refuses a tenant name that is not 1-63 of `[a-z0-9-]` starting and ending with a
/// letter or digit (a DNS label, so it can name cgroups, hosts and paths).
pub fn validate_tenant_name(name: &str) -> Result<(), IamError> {
    let bad = |why| {
        Err(IamError::InvalidTenantName {
            name: name.chars().take(80).collect(),
            why,
        })
    };
    if name.is_empty() {
        return bad("it is empty");
    }
    if name.len() > 63 {
        return bad("it is longer than 63 characters");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return bad("only a-z, 0-9 and '-' are allowed");
    }
    if name.starts_with('-') || name.ends_with('-') {
        return bad("it must start and end with a letter or digit");
    }
    Ok(())
}

/// An API key as listed: everything but its secret.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct KeyInfo {
    /// Public id (the middle of `dsec_<id>_<secret>`).
    pub key_id: String,
    /// The tenant it acts for.
    pub tenant: String,
    /// A label chosen by its creator.
    pub name: String,
    /// What it may do.
    pub scopes: Vec<Scope>,
    /// Creation time (unix ms).
    pub created_at: u64,
    /// When it stops (stopped) working (unix ms): set by revoke (now) or rotate (now
    /// plus the grace).
    pub revoked_at: Option<u64>,
    /// When it expires (unix ms), if it was created to.
    pub expires_at: Option<u64>,
}

impl KeyInfo {
    /// Whether the key works at `now` (unix ms).
    pub fn active_at(&self, now: u64) -> bool {
        self.revoked_at.is_none_or(|t| now < t) && self.expires_at.is_none_or(|t| now < t)
    }
}

/// A key just created: `key` is the only copy of its secret, shown once.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct NewKey {
    /// The whole key to present: `dsec_<key_id>_<secret>`.
    pub key: String,
    /// Its record.
    pub info: KeyInfo,
}

impl std::fmt::Debug for NewKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NewKey")
            .field("key", &"<secret>")
            .field("info", &self.info)
            .finish()
    }
}

/// Who a request acts as: the result of [`crate::Iam::authenticate`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Principal {
    /// The tenant whose sandboxes it sees.
    pub tenant: String,
    /// The key's id ([`BOOTSTRAP_KEY_ID`] for the bootstrap key).
    pub key_id: String,
    /// Its scopes.
    pub scopes: Vec<Scope>,
}

impl Principal {
    /// The bootstrap key's principal (the operator of `dsec serve --api-key`): admin of
    /// [`DEFAULT_TENANT`] with every scope. Also what in-process callers (tests,
    /// benchmarks) act as.
    pub fn bootstrap() -> Self {
        Self {
            tenant: DEFAULT_TENANT.into(),
            key_id: BOOTSTRAP_KEY_ID.into(),
            scopes: Scope::ALL.to_vec(),
        }
    }

    /// Whether it may make a call needing `scope` (any scope includes `read`, `admin`
    /// includes all).
    pub fn allows(&self, scope: Scope) -> bool {
        self.scopes
            .iter()
            .any(|&s| s == scope || s == Scope::Admin || scope == Scope::Read)
    }

    /// [`IamError::Forbidden`] unless it [`allows`](Self::allows) `scope`.
    pub fn require(&self, scope: Scope) -> Result<(), IamError> {
        if self.allows(scope) {
            Ok(())
        } else {
            Err(IamError::Forbidden(format!(
                "this API key lacks the {scope} scope"
            )))
        }
    }

    /// An `admin` key of the `default` tenant: it manages every tenant, key and quota.
    pub fn is_cluster_admin(&self) -> bool {
        self.tenant == DEFAULT_TENANT && self.scopes.contains(&Scope::Admin)
    }

    /// Whether it may create, list, revoke and rotate the keys of `tenant`: a cluster
    /// admin, or an `admin` key of that tenant.
    pub fn may_manage_keys_of(&self, tenant: &str) -> bool {
        self.is_cluster_admin() || (self.tenant == tenant && self.scopes.contains(&Scope::Admin))
    }
}

/// Resources a tenant uses, or a change of them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Usage {
    /// Sandboxes (each one reserved also counts as one create for the rate quota).
    #[serde(default)]
    pub sandboxes: u64,
    /// CPU limits, in thousandths of a CPU.
    #[serde(default)]
    pub cpu_millis: u64,
    /// Memory limits, in MiB.
    #[serde(default)]
    pub memory_mb: u64,
}

impl Usage {
    /// One sandbox of `cpu_millis` and `memory_mb`.
    pub fn sandbox(cpu_millis: u64, memory_mb: u64) -> Self {
        Usage {
            sandboxes: 1,
            cpu_millis,
            memory_mb,
        }
    }

    pub(crate) fn is_zero(&self) -> bool {
        *self == Usage::default()
    }
}

/// Which quota a reservation would exceed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum QuotaKind {
    /// [`Quotas::max_sandboxes`].
    MaxSandboxes,
    /// [`Quotas::max_cpu_millis`].
    MaxCpuMillis,
    /// [`Quotas::max_memory_mb`].
    MaxMemoryMb,
    /// [`Quotas::creates_per_second`].
    CreatesPerSecond,
}

impl std::fmt::Display for QuotaKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            QuotaKind::MaxSandboxes => "max_sandboxes",
            QuotaKind::MaxCpuMillis => "max_cpu_millis",
            QuotaKind::MaxMemoryMb => "max_memory_mb",
            QuotaKind::CreatesPerSecond => "creates_per_second",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_names() {
        for ok in ["a", "default", "team-7", &"x".repeat(63)] {
            validate_tenant_name(ok).expect(ok);
        }
        for bad in [
            "",
            "-a",
            "a-",
            "A",
            "a_b",
            "a/b",
            "a.b",
            "é",
            &"x".repeat(64),
        ] {
            assert!(
                matches!(
                    validate_tenant_name(bad),
                    Err(IamError::InvalidTenantName { .. })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn scopes_of_http_calls() {
        assert_eq!(required_scope("GET", "/v1/sandboxes"), Scope::Read);
        assert_eq!(
            required_scope("GET", "/v1/sandboxes/x/terminal"),
            Scope::Sandboxes
        );
        assert_eq!(required_scope("POST", "/v1/sandboxes"), Scope::Sandboxes);
        assert_eq!(
            required_scope("DELETE", "/v1/sandboxes/x"),
            Scope::Sandboxes
        );
        assert_eq!(required_scope("POST", "/v1/images/build"), Scope::Images);
        assert_eq!(required_scope("GET", "/v1/images"), Scope::Read);
        assert_eq!(required_scope("GET", "/v1/tenants"), Scope::Admin);
        assert_eq!(required_scope("POST", "/v1/keys/k/rotate"), Scope::Admin);
        assert_eq!(required_scope("POST", "/v1/imagesx"), Scope::Sandboxes);
        assert_eq!(
            required_scope("POST", "/swerex/x/execute"),
            Scope::Sandboxes
        );
    }

    #[test]
    fn scope_inclusion() {
        let p = |scopes: Vec<Scope>| Principal {
            tenant: "t".into(),
            key_id: "k".into(),
            scopes,
        };
        let read = p(vec![Scope::Read]);
        assert!(read.allows(Scope::Read) && !read.allows(Scope::Sandboxes));
        let sb = p(vec![Scope::Sandboxes]);
        assert!(sb.allows(Scope::Read) && sb.allows(Scope::Sandboxes));
        assert!(!sb.allows(Scope::Images) && !sb.allows(Scope::Admin));
        let admin = p(vec![Scope::Admin]);
        assert!(Scope::ALL.iter().all(|&s| admin.allows(s)));
        assert!(admin.may_manage_keys_of("t") && !admin.may_manage_keys_of("u"));
        assert!(!admin.is_cluster_admin());
        let root = Principal {
            tenant: DEFAULT_TENANT.into(),
            ..admin
        };
        assert!(root.is_cluster_admin() && root.may_manage_keys_of("u"));
        assert!(matches!(
            read.require(Scope::Images),
            Err(IamError::Forbidden(_))
        ));
        assert_eq!("images".parse::<Scope>().ok(), Some(Scope::Images));
        assert!("root".parse::<Scope>().is_err());
    }

    #[test]
    fn quotas_validate() {
        assert!(Quotas::default().validate().is_ok());
        let q = Quotas {
            creates_burst: Some(3),
            ..Quotas::default()
        };
        assert!(q.validate().is_err());
        let q = Quotas {
            creates_per_second: Some(2),
            creates_burst: Some(0),
            ..Quotas::default()
        };
        assert!(q.validate().is_err());
        let q = Quotas {
            creates_per_second: Some(0),
            ..Quotas::default()
        };
        assert_eq!(q.burst(), Some(1));
    }
}

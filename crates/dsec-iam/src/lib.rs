//! Tenants, API keys and per-tenant quotas, kept in a [`dsec_state::StateStore`] so
//! every API server replica shares them.
//!
//! - **Tenants** ([`Tenant`]): a name, [`Quotas`] and a `disabled` flag, in namespace
//!   [`TENANTS_NS`]. The tenant [`DEFAULT_TENANT`] always exists (unlimited until a
//!   record is written for it).
//! - **API keys**: `dsec_<key_id>_<secret>`; only the SHA-256 of the secret is stored
//!   (namespace [`KEYS_NS`]), with the key's tenant, name, [`Scope`]s and revocation and
//!   expiry times. The secret is shown once, by [`Iam::create_key`] / [`Iam::rotate_key`].
//! - **Authentication** ([`Iam::authenticate`]) reads no store: each [`Iam`] keeps tenants
//!   and keys in memory, listed at [`Iam::new`] and kept fresh by watches, so a revocation
//!   or a disabled tenant takes effect on every replica as soon as its watch delivers it
//!   (milliseconds; tested within 1 s). A replica's own writes apply to its cache at once.
//! - **Bootstrap key**: the single `api_key` of `dsec serve` is the admin key of
//!   `default` with every scope (key id [`BOOTSTRAP_KEY_ID`]); it is never stored and
//!   works even if `default` is disabled, so the operator cannot lock themselves out.
//! - **Quotas** ([`Iam::reserve`] and friends): one usage record per tenant (namespace
//!   [`USAGE_NS`]: sandboxes, CPU, memory and the creates-per-second token bucket) changed
//!   by compare-and-swap on its revision, so replicas never admit more than the quota.
//!   [`Iam::reserve`] returns the check and put ([`QuotaTxn`]) for the caller to commit in
//!   the same [`dsec_state::Txn`] as its sandbox record: a create costs no extra write.
//! - **Model gateway tokens** ([`model_tokens`]): `dsgw_<id>_<secret>`, one per sandbox
//!   created with `model_access`, its record (namespace [`MODEL_TOKENS_NS`]) written and
//!   deleted with the sandbox's; [`Iam::authenticate_model_token`] checks one from memory,
//!   as keys are.
//!
//! Authorization is the caller's: [`required_scope`] says what an HTTP call needs,
//! [`Principal::require`] checks it, and [`Principal::is_cluster_admin`] /
//! [`Principal::may_manage_keys_of`] gate the admin operations of this crate, which do
//! not check who calls them.

pub mod api;
mod cache;
mod error;
pub mod key;
mod model;
pub mod model_spending;
pub mod model_tokens;
mod quota;

use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dsec_state::{Expect, Op, StateError, StateStore, Txn};
use tokio::task::JoinHandle;

use cache::{Cache, Kind, SharedCache, StoredKey};
pub use error::IamError;
pub use model::{
    required_scope, validate_tenant_name, KeyInfo, NewKey, Principal, QuotaKind, Quotas, Scope,
    Tenant, Usage, BOOTSTRAP_KEY_ID, DEFAULT_TENANT, KEYS_NS, MAX_KEY_NAME, TENANTS_NS, USAGE_NS,
};
pub use model_spending::{ModelSpendLedger, MODEL_SPENDING_NS};
pub use model_tokens::{MintedToken, ModelGrant, ModelTokenRecord, MODEL_TOKENS_NS};
pub use quota::QuotaTxn;

/// The wall clock IAM reads, in unix milliseconds (replaceable in tests).
pub type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

/// The system clock in unix ms.
pub fn system_clock() -> Clock {
    Arc::new(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    })
}

/// How an [`Iam`] is set up.
#[derive(Clone)]
pub struct IamConfig {
    /// The bootstrap admin key (`dsec serve --api-key`), if any: admin of `default` with
    /// every scope, never stored.
    pub bootstrap_key: Option<String>,
    /// The clock (key expiry, revocation grace, the rate quota).
    pub clock: Clock,
    /// How long [`Iam::reserve_now`] and [`Iam::release_now`] retry on conflicts with
    /// other replicas before giving up with [`IamError::Contended`].
    pub contention_deadline: Duration,
    /// Fail closed: once the watches have been down this long (the store unreachable),
    /// stored keys are refused as unavailable (a revocation could be missed); the
    /// bootstrap key still works. `None`: trust the cache however old.
    pub max_stale: Option<Duration>,
}

impl std::fmt::Debug for IamConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IamConfig")
            .field(
                "bootstrap_key",
                &self.bootstrap_key.as_ref().map(|_| "<secret>"),
            )
            .field("contention_deadline", &self.contention_deadline)
            .finish_non_exhaustive()
    }
}

impl IamConfig {
    /// The system clock, a 10 s contention deadline, a 5 s `max_stale` and
    /// `bootstrap_key`.
    pub fn new(bootstrap_key: Option<String>) -> Self {
        IamConfig {
            bootstrap_key,
            clock: system_clock(),
            contention_deadline: Duration::from_secs(10),
            max_stale: Some(Duration::from_secs(5)),
        }
    }
}

/// Tenants, keys and quotas over one store. Cheap to share (`Arc<Iam>`); dropping it stops
/// its watches.
pub struct Iam {
    store: Arc<dyn StateStore>,
    cache: SharedCache,
    bootstrap: Option<key::Hash>,
    clock: Clock,
    contention_deadline: Duration,
    max_stale: Option<Duration>,
    followers: Vec<JoinHandle<()>>,
    /// One lock per tenant: this replica's reservations of a tenant queue here instead
    /// of losing compare-and-swap races to each other (only other replicas race).
    usage_locks: std::sync::Mutex<std::collections::HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl std::fmt::Debug for Iam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = cache::read(&self.cache);
        f.debug_struct("Iam")
            .field("store", &self.store)
            .field("tenants", &c.tenants.len())
            .field("keys", &c.keys.len())
            .finish_non_exhaustive()
    }
}

impl Drop for Iam {
    fn drop(&mut self) {
        for f in &self.followers {
            f.abort();
        }
    }
}

/// How many times an admin write retries a compare-and-swap lost to another writer.
const ADMIN_CAS_TRIES: usize = 16;

fn encode<T: serde::Serialize>(v: &T) -> Vec<u8> {
    // Our records are plain structs of strings and numbers: serializing cannot fail.
    serde_json::to_vec(v).unwrap_or_default()
}

fn decode<T: serde::de::DeserializeOwned>(what: &str, bytes: &[u8]) -> Result<T, IamError> {
    serde_json::from_slice(bytes).map_err(|e| IamError::Corrupt(format!("{what}: {e}")))
}

fn put_op(ns: &str, key: &str, value: Vec<u8>) -> Op {
    Op::Put {
        ns: ns.into(),
        key: key.into(),
        value,
        lease: None,
    }
}

fn is_conflict(e: &StateError) -> bool {
    matches!(e, StateError::Conflict { .. })
}

impl Iam {
    /// [`Iam::with_config`] with the system clock.
    pub async fn new(
        store: Arc<dyn StateStore>,
        bootstrap_key: Option<String>,
    ) -> Result<Self, IamError> {
        Self::with_config(store, IamConfig::new(bootstrap_key)).await
    }

    /// Lists tenants and keys (failing if the store cannot be read), then follows them
    /// with watches on the current tokio runtime.
    pub async fn with_config(
        store: Arc<dyn StateStore>,
        config: IamConfig,
    ) -> Result<Self, IamError> {
        let cache: SharedCache = Arc::new(RwLock::new(Cache::default()));
        let mut followers = Vec::new();
        for kind in [Kind::Tenants, Kind::Keys, Kind::ModelTokens] {
            let rev = cache::relist(&*store, &cache, kind).await?;
            followers.push(tokio::spawn(cache::follow(
                store.clone(),
                cache.clone(),
                kind,
                rev,
            )));
        }
        Ok(Iam {
            store,
            cache,
            bootstrap: config
                .bootstrap_key
                .filter(|k| !k.is_empty())
                .map(|k| key::sha256(k.as_bytes())),
            clock: config.clock,
            contention_deadline: config.contention_deadline,
            max_stale: config.max_stale,
            followers,
            usage_locks: Default::default(),
        })
    }

    /// The store it keeps its records in.
    pub fn store(&self) -> &Arc<dyn StateStore> {
        &self.store
    }

    pub(crate) fn now(&self) -> u64 {
        (self.clock)()
    }

    /// Who `key` is, from memory: [`IamError::Unauthenticated`] if it is malformed,
    /// unknown, wrong, revoked or expired, or its tenant is unknown;
    /// [`IamError::TenantDisabled`] if its tenant is disabled; `Store(Unavailable)` if
    /// the cache has not followed the store for over [`IamConfig::max_stale`].
    pub fn authenticate(&self, key: &str) -> Result<Principal, IamError> {
        if let Some(boot) = &self.bootstrap {
            if key::ct_eq(&key::sha256(key.as_bytes()), boot) {
                return Ok(Principal::bootstrap());
            }
        }
        let (id, secret) = key::parse(key).ok_or(IamError::Unauthenticated)?;
        let hash = key::sha256(secret.as_bytes());
        let now = self.now();
        let c = cache::read(&self.cache);
        if let (Some(max), Some(stale)) = (self.max_stale, c.stale_for()) {
            if stale > max {
                return Err(IamError::Store(StateError::Unavailable(format!(
                    "API keys cannot be checked: the state store has been unreachable for {} s",
                    stale.as_secs()
                ))));
            }
        }
        let (k, _) = c.keys.get(id).ok_or(IamError::Unauthenticated)?;
        if !key::ct_eq(&hash, &k.hash) || !k.info.active_at(now) {
            return Err(IamError::Unauthenticated);
        }
        match c.tenants.get(&k.info.tenant) {
            Some((t, _)) if t.disabled => {
                return Err(IamError::TenantDisabled(t.name.clone()));
            }
            Some(_) => {}
            None if k.info.tenant == DEFAULT_TENANT => {}
            None => return Err(IamError::Unauthenticated),
        }
        Ok(Principal {
            tenant: k.info.tenant.clone(),
            key_id: k.info.key_id.clone(),
            scopes: k.info.scopes.clone(),
        })
    }

    /// Who presents model gateway token `token`, from memory:
    /// [`IamError::Unauthenticated`] if it is malformed, unknown (its sandbox is gone) or
    /// wrong, or its tenant is unknown; [`IamError::TenantDisabled`] if its tenant is
    /// disabled; `Store(Unavailable)` if the cache has not followed the store for over
    /// [`IamConfig::max_stale`].
    pub fn authenticate_model_token(&self, token: &str) -> Result<ModelGrant, IamError> {
        let (id, secret) = model_tokens::parse(token).ok_or(IamError::Unauthenticated)?;
        let hash = key::sha256(secret.as_bytes());
        let c = cache::read(&self.cache);
        if let (Some(max), Some(stale)) = (self.max_stale, c.stale_for()) {
            if stale > max {
                return Err(IamError::Store(StateError::Unavailable(format!(
                    "model tokens cannot be checked: the state store has been unreachable for {} s",
                    stale.as_secs()
                ))));
            }
        }
        let (t, _) = c.model_tokens.get(id).ok_or(IamError::Unauthenticated)?;
        if !key::ct_eq(&hash, &t.hash) {
            return Err(IamError::Unauthenticated);
        }
        let r = &t.record;
        match c.tenants.get(&r.tenant) {
            Some((tenant, _)) if tenant.disabled => {
                return Err(IamError::TenantDisabled(tenant.name.clone()));
            }
            Some(_) => {}
            None if r.tenant == DEFAULT_TENANT => {}
            None => return Err(IamError::Unauthenticated),
        }
        Ok(ModelGrant {
            token_id: r.token_id.clone(),
            tenant: r.tenant.clone(),
            sandbox: r.sandbox.clone(),
            access: r.access.clone(),
        })
    }

    /// Whether the model gateway token with id `token_id` exists, as this replica's
    /// cache knows (it is deleted with its sandbox).
    pub fn model_token_exists(&self, token_id: &str) -> bool {
        cache::read(&self.cache).model_tokens.contains_key(token_id)
    }

    /// A fresh model gateway token for `sandbox` of `tenant`, and the store operation
    /// that writes its record (to go in the transaction that stores the sandbox).
    pub fn mint_model_token(
        &self,
        tenant: &str,
        sandbox: &str,
        access: dsec_wire::v1::ModelAccess,
    ) -> (MintedToken, Op) {
        let minted = model_tokens::mint(tenant, sandbox, access, self.now());
        let op = put_op(
            MODEL_TOKENS_NS,
            &minted.record.token_id,
            encode(&minted.record),
        );
        (minted, op)
    }

    /// The store operation that deletes token `token_id` (with its sandbox).
    pub fn delete_model_token_op(token_id: &str) -> Op {
        Op::Delete {
            ns: MODEL_TOKENS_NS.into(),
            key: token_id.into(),
        }
    }

    /// A tenant as this replica's cache knows it (the implicit `default` included).
    pub fn cached_tenant(&self, name: &str) -> Option<Tenant> {
        let c = cache::read(&self.cache);
        match c.tenants.get(name) {
            Some((t, _)) => Some(t.clone()),
            None if name == DEFAULT_TENANT => Some(Tenant::implicit_default()),
            None => None,
        }
    }

    // ---- tenants ----

    /// Creates a tenant. [`IamError::TenantExists`] if it does (`default` always does).
    pub async fn create_tenant(&self, name: &str, quotas: Quotas) -> Result<Tenant, IamError> {
        validate_tenant_name(name)?;
        quotas.validate()?;
        if name == DEFAULT_TENANT {
            return Err(IamError::TenantExists(name.into()));
        }
        let t = Tenant {
            name: name.into(),
            created_at: self.now(),
            quotas,
            disabled: false,
        };
        match self
            .store
            .put(TENANTS_NS, name, &encode(&t), Expect::Absent)
            .await
        {
            Ok(rev) => {
                self.cache_tenant(&t, rev);
                Ok(t)
            }
            Err(e) if is_conflict(&e) => Err(IamError::TenantExists(name.into())),
            Err(e) => Err(e.into()),
        }
    }

    fn cache_tenant(&self, t: &Tenant, rev: dsec_state::Revision) {
        cache::write(&self.cache).put(
            Kind::Tenants,
            &dsec_state::Entry {
                key: t.name.clone(),
                value: encode(t),
                rev,
            },
        );
    }

    /// A tenant and its record's revision (`0`: the implicit `default`) from the store.
    async fn load_tenant(&self, name: &str) -> Result<(Tenant, Expect), IamError> {
        validate_tenant_name(name)?;
        match self.store.get(TENANTS_NS, name).await? {
            Some(e) => Ok((decode("a tenant record", &e.value)?, Expect::Rev(e.rev))),
            None if name == DEFAULT_TENANT => Ok((Tenant::implicit_default(), Expect::Absent)),
            None => Err(IamError::UnknownTenant(name.into())),
        }
    }

    /// A tenant, read from the store.
    pub async fn get_tenant(&self, name: &str) -> Result<Tenant, IamError> {
        Ok(self.load_tenant(name).await?.0)
    }

    /// Every tenant (the implicit `default` included), by name, read from the store.
    pub async fn list_tenants(&self) -> Result<Vec<Tenant>, IamError> {
        let (entries, _) = self.store.list(TENANTS_NS).await?;
        let mut out = entries
            .iter()
            .map(|e| decode::<Tenant>("a tenant record", &e.value))
            .collect::<Result<Vec<_>, _>>()?;
        if !out.iter().any(|t| t.name == DEFAULT_TENANT) {
            out.push(Tenant::implicit_default());
            out.sort_by(|a, b| a.name.cmp(&b.name));
        }
        Ok(out)
    }

    /// Changes a tenant record by compare-and-swap, retrying lost races.
    async fn modify_tenant(&self, name: &str, f: impl Fn(&mut Tenant)) -> Result<Tenant, IamError> {
        for _ in 0..ADMIN_CAS_TRIES {
            let (mut t, expect) = self.load_tenant(name).await?;
            f(&mut t);
            match self.store.put(TENANTS_NS, name, &encode(&t), expect).await {
                Ok(rev) => {
                    self.cache_tenant(&t, rev);
                    return Ok(t);
                }
                Err(e) if is_conflict(&e) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(IamError::Contended(name.into()))
    }

    /// Replaces a tenant's quotas. Lowering one below current usage refuses further
    /// reservations until usage drops; nothing running is stopped.
    pub async fn set_quotas(&self, name: &str, quotas: Quotas) -> Result<Tenant, IamError> {
        quotas.validate()?;
        self.modify_tenant(name, |t| t.quotas = quotas.clone())
            .await
    }

    /// Disables (or enables again) a tenant: while disabled its keys are refused with
    /// [`IamError::TenantDisabled`] and it reserves nothing. Its sandboxes are not
    /// touched (the control plane decides).
    pub async fn set_disabled(&self, name: &str, disabled: bool) -> Result<Tenant, IamError> {
        self.modify_tenant(name, |t| t.disabled = disabled).await
    }

    /// Replaces what `update` gives (quotas, disabled) in one write.
    pub async fn update_tenant(
        &self,
        name: &str,
        update: &api::UpdateTenant,
    ) -> Result<Tenant, IamError> {
        if let Some(q) = &update.quotas {
            q.validate()?;
        }
        self.modify_tenant(name, |t| {
            if let Some(q) = &update.quotas {
                t.quotas = q.clone();
            }
            if let Some(d) = update.disabled {
                t.disabled = d;
            }
        })
        .await
    }

    // ---- keys ----

    /// Creates a key for `tenant` (which must exist) with `scopes` (at least one) and an
    /// optional expiry (unix ms, in the future). The returned [`NewKey::key`] is the only
    /// copy of the secret.
    pub async fn create_key(
        &self,
        tenant: &str,
        name: &str,
        scopes: &[Scope],
        expires_at: Option<u64>,
    ) -> Result<NewKey, IamError> {
        let scopes = normalize_scopes(scopes)?;
        validate_key_name(name)?;
        let now = self.now();
        if expires_at.is_some_and(|t| t <= now) {
            return Err(IamError::Invalid("expires_at is not in the future".into()));
        }
        self.load_tenant(tenant).await?;
        let info = KeyInfo {
            key_id: String::new(),
            tenant: tenant.into(),
            name: name.into(),
            scopes,
            created_at: now,
            revoked_at: None,
            expires_at,
        };
        self.insert_key(info, Vec::new()).await
    }

    /// Writes a fresh key with `info`'s fields (and `extra` ops in the same txn), a new id
    /// each try if one collides.
    async fn insert_key(
        &self,
        mut info: KeyInfo,
        extra: Vec<(Op, Expect)>,
    ) -> Result<NewKey, IamError> {
        for _ in 0..4 {
            let (id, key, hash) = key::generate();
            info.key_id = id.clone();
            let stored = StoredKey {
                info: info.clone(),
                secret_sha256: hex::encode(hash),
            };
            let value = encode(&stored);
            let mut txn = Txn {
                checks: vec![(KEYS_NS.into(), id.clone(), Expect::Absent)],
                ops: vec![put_op(KEYS_NS, &id, value.clone())],
            };
            for (op, expect) in &extra {
                let (ns, k) = op.target();
                txn.checks.push((ns.into(), k.into(), *expect));
                txn.ops.push(op.clone());
            }
            match self.store.txn(txn).await {
                Ok(rev) => {
                    let mut c = cache::write(&self.cache);
                    c.put(
                        Kind::Keys,
                        &dsec_state::Entry {
                            key: id,
                            value,
                            rev,
                        },
                    );
                    for (op, _) in &extra {
                        if let Op::Put { key, value, .. } = op {
                            c.put(
                                Kind::Keys,
                                &dsec_state::Entry {
                                    key: key.clone(),
                                    value: value.clone(),
                                    rev,
                                },
                            );
                        }
                    }
                    return Ok(NewKey { key, info });
                }
                // Our fresh id collided (2^-60): draw again.
                Err(StateError::Conflict { ref key, .. }) if *key == id => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(IamError::Contended(info.tenant))
    }

    /// A key's record and revision from the store.
    async fn load_key(&self, key_id: &str) -> Result<(StoredKey, u64), IamError> {
        if !key::valid_key_id(key_id) {
            return Err(IamError::UnknownKey(key_id.chars().take(40).collect()));
        }
        let e = self
            .store
            .get(KEYS_NS, key_id)
            .await?
            .ok_or_else(|| IamError::UnknownKey(key_id.into()))?;
        Ok((decode("a key record", &e.value)?, e.rev))
    }

    /// A key, without its secret.
    pub async fn get_key(&self, key_id: &str) -> Result<KeyInfo, IamError> {
        Ok(self.load_key(key_id).await?.0.info)
    }

    /// The keys of `tenant` (revoked ones too), by id, without secrets.
    pub async fn list_keys(&self, tenant: &str) -> Result<Vec<KeyInfo>, IamError> {
        self.load_tenant(tenant).await?;
        let (entries, _) = self.store.list(KEYS_NS).await?;
        let mut out = Vec::new();
        for e in entries {
            let k: StoredKey = decode("a key record", &e.value)?;
            if k.info.tenant == tenant {
                out.push(k.info);
            }
        }
        Ok(out)
    }

    /// Revokes a key at once (on every replica as soon as its watch delivers: well
    /// under 1 s). Revoking a revoked key changes nothing and is not an error.
    pub async fn revoke_key(&self, key_id: &str) -> Result<KeyInfo, IamError> {
        for _ in 0..ADMIN_CAS_TRIES {
            let (mut k, rev) = self.load_key(key_id).await?;
            let now = self.now();
            if k.info.revoked_at.is_some_and(|t| t <= now) {
                return Ok(k.info);
            }
            k.info.revoked_at = Some(now);
            let value = encode(&k);
            match self
                .store
                .put(KEYS_NS, key_id, &value, Expect::Rev(rev))
                .await
            {
                Ok(rev) => {
                    cache::write(&self.cache).put(
                        Kind::Keys,
                        &dsec_state::Entry {
                            key: key_id.into(),
                            value,
                            rev,
                        },
                    );
                    return Ok(k.info);
                }
                Err(e) if is_conflict(&e) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(IamError::Contended(key_id.into()))
    }

    /// Replaces a key with a new one of the same tenant, name, scopes and expiry, in one
    /// transaction. The old key stops working after `grace` (at once for zero), so
    /// clients can switch without a gap. [`IamError::KeyRevoked`] if the old key no
    /// longer works.
    pub async fn rotate_key(&self, key_id: &str, grace: Duration) -> Result<NewKey, IamError> {
        let grace_ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX);
        for _ in 0..ADMIN_CAS_TRIES {
            let (mut old, rev) = self.load_key(key_id).await?;
            let now = self.now();
            if !old.info.active_at(now) {
                return Err(IamError::KeyRevoked(key_id.into()));
            }
            let until = now.saturating_add(grace_ms);
            old.info.revoked_at = Some(old.info.revoked_at.map_or(until, |t| t.min(until)));
            let info = KeyInfo {
                key_id: String::new(),
                created_at: now,
                revoked_at: None,
                ..old.info.clone()
            };
            let extra = vec![(put_op(KEYS_NS, key_id, encode(&old)), Expect::Rev(rev))];
            match self.insert_key(info, extra).await {
                Err(IamError::Store(e)) if is_conflict(&e) => continue,
                other => return other,
            }
        }
        Err(IamError::Contended(key_id.into()))
    }
}

/// Refuses no scopes; sorts and dedups.
fn normalize_scopes(scopes: &[Scope]) -> Result<Vec<Scope>, IamError> {
    if scopes.is_empty() {
        return Err(IamError::Invalid("a key needs at least one scope".into()));
    }
    let mut s = scopes.to_vec();
    s.sort();
    s.dedup();
    Ok(s)
}

/// Refuses a key name over [`MAX_KEY_NAME`] bytes or with control characters.
fn validate_key_name(name: &str) -> Result<(), IamError> {
    if name.len() > MAX_KEY_NAME {
        return Err(IamError::Invalid(format!(
            "a key name is at most {MAX_KEY_NAME} bytes"
        )));
    }
    if name.chars().any(char::is_control) {
        return Err(IamError::Invalid(
            "a key name may not hold control characters".into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests;

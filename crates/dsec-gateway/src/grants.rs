//! Callers that are not in the configuration: sandbox tokens, minted and revoked
//! elsewhere (the control plane; `dsec-iam` holds them) and known here through a
//! [`TokenAuthority`]. The gateway asks it on every request with a bearer that is not
//! one of its `api_keys`, so a token stops working the moment the authority forgets it
//! (its sandbox deleted).
//!
//! What the authority answers is a [`Grant`]: the models the token may call, its limits
//! and its budget of model tokens. Its caller (buckets, concurrency permits, tokens
//! spent) is made on the token's first request and kept by token id; callers whose
//! token the authority no longer knows are swept out (at most once a second after a
//! refused token, once a minute anyway, and whenever the map has doubled since the
//! last sweep), so the map holds about the live tokens that were used.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::config::{GatewayConfig, Limits};
use crate::limits::{CallerLimits, Clock};
use crate::usage::{TenantUsage, UsageCounters};
use crate::Caller;

/// What a sandbox token may do, as its [`TokenAuthority`] says.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Grant {
    /// The token's stable id (never the secret): its caller is kept under it.
    pub id: String,
    /// Who holds it, for logs and the response cache's scope (`tenant/sandbox`).
    pub name: String,
    /// The public model names it may call; `None`: every configured model. A model it
    /// may not call answers as a model that does not exist.
    pub models: Option<Vec<String>>,
    /// Its limits; what they leave unset comes from the configuration's
    /// `default_limits`, as for a configured key.
    pub limits: Limits,
    /// Model tokens it may spend in all (prompt and completion, answers from the cache
    /// included); `None`: no budget.
    pub budget_tokens: Option<u64>,
    /// The tenant whose shared limits (`tenant_limits` in the configuration) it counts
    /// against too, with every other token of that tenant; `None`: none.
    pub tenant: Option<String>,
}

/// Why a [`TokenAuthority`] gives no grant for a bearer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// Not a token it knows (malformed, wrong, revoked, its sandbox gone): a 401.
    #[error("the API key is not valid for this gateway")]
    Unknown,
    /// A token it knows that may not be used now (its tenant disabled): a 403.
    #[error("{0}")]
    Denied(String),
    /// It cannot tell now (its view of the store is stale): a 503, which SDKs retry.
    #[error("{0}")]
    Unavailable(String),
}

/// Where the gateway learns what a bearer that is not a configured key may do. Called
/// on every such request, so it answers from memory.
pub trait TokenAuthority: Send + Sync + std::fmt::Debug {
    /// The grant of the token `bearer`.
    fn grant(&self, bearer: &str) -> Result<Grant, TokenError>;

    /// Whether the token with id `token_id` still exists (its caller is dropped when
    /// not).
    fn is_live(&self, token_id: &str) -> bool;
}

/// Time between sweeps at least once the map is in use.
const SWEEP_EVERY: Duration = Duration::from_secs(60);
/// Time between sweeps set off by refused tokens (a token just revoked).
const SWEEP_AFTER_REFUSAL: Duration = Duration::from_secs(1);
/// Callers held before growth alone sets off a sweep.
const MIN_HIGH_WATER: usize = 1024;

/// The callers of tokens, by token id, each with the grant it was made from.
pub(crate) struct TokenCallers {
    authority: Arc<dyn TokenAuthority>,
    clock: Clock,
    state: Mutex<MapState>,
    /// Each tenant's shared limits, made on its first token's first request (as many
    /// as there are tenants with limits that used the gateway).
    tenants: Mutex<HashMap<String, Arc<CallerLimits>>>,
    /// Each tenant's usage counters, made on its first token's first request and kept
    /// (a tenant's usage outlives its tokens).
    tenant_usage: Mutex<HashMap<String, Arc<UsageCounters>>>,
    /// What other gateways charged each budgeted token, as the spend ledger last said
    /// (what a token's new caller starts from).
    elsewhere: Mutex<HashMap<String, u64>>,
}

impl std::fmt::Debug for TokenCallers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenCallers")
            .field("authority", &self.authority)
            .field("callers", &self.len())
            .finish_non_exhaustive()
    }
}

struct MapState {
    callers: HashMap<String, (Grant, Arc<Caller>)>,
    swept_at: Duration,
    /// Size past which the next insert sweeps.
    high_water: usize,
}

impl TokenCallers {
    pub(crate) fn new(authority: Arc<dyn TokenAuthority>, clock: Clock) -> Self {
        let now = clock();
        Self {
            authority,
            clock,
            state: Mutex::new(MapState {
                callers: HashMap::new(),
                swept_at: now,
                high_water: MIN_HIGH_WATER,
            }),
            tenants: Mutex::default(),
            tenant_usage: Mutex::default(),
            elsewhere: Mutex::default(),
        }
    }

    /// What this gateway charged each budgeted token held, in all.
    pub(crate) fn spent_here(&self) -> BTreeMap<String, u64> {
        self.state()
            .callers
            .iter()
            .filter(|(_, (grant, _))| grant.budget_tokens.is_some())
            .map(|(id, (_, caller))| (id.clone(), caller.limits.spent()))
            .collect()
    }

    /// Takes in what other gateways charged each token (absent: nothing).
    pub(crate) fn set_spent_elsewhere(&self, elsewhere: HashMap<String, u64>) {
        // The map first: a caller made meanwhile starts from the new figures.
        let elsewhere = {
            let mut held = self.elsewhere.lock().unwrap_or_else(|e| e.into_inner());
            *held = elsewhere;
            held.clone()
        };
        let state = self.state();
        for (id, (_, caller)) in &state.callers {
            caller
                .limits
                .set_spent_elsewhere(elsewhere.get(id).copied().unwrap_or(0));
        }
    }

    /// Fresh usage counters for a token of `tenant` that count into the tenant's too.
    fn usage_for(&self, tenant: Option<&str>) -> Arc<UsageCounters> {
        let Some(tenant) = tenant else {
            return Arc::default();
        };
        let mut all = self.tenant_usage.lock().unwrap_or_else(|e| e.into_inner());
        let shared = all.entry(tenant.to_string()).or_default().clone();
        Arc::new(UsageCounters::of_tenant(shared))
    }

    /// Each tenant's usage (only `only`'s if given), by name.
    pub(crate) fn tenant_usage(&self, only: Option<&str>) -> Vec<TenantUsage> {
        let mut held: HashMap<String, u64> = HashMap::new();
        for (grant, _) in self.state().callers.values() {
            if let Some(t) = &grant.tenant {
                *held.entry(t.clone()).or_default() += 1;
            }
        }
        let all = self.tenant_usage.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<TenantUsage> = all
            .iter()
            .filter(|(t, _)| only.is_none_or(|o| o == t.as_str()))
            .map(|(t, u)| TenantUsage::of(t, u, held.get(t).copied().unwrap_or(0)))
            .collect();
        out.sort_by(|a, b| a.tenant.cmp(&b.tenant));
        out
    }

    /// The limits `tenant`'s tokens share, if the configuration gives it some.
    fn tenant_limits(&self, tenant: &str, config: &GatewayConfig) -> Option<Arc<CallerLimits>> {
        let limits = config.tenant_limits_of(tenant)?;
        let mut tenants = self.tenants.lock().unwrap_or_else(|e| e.into_inner());
        Some(
            tenants
                .entry(tenant.to_string())
                .or_insert_with(|| {
                    Arc::new(CallerLimits::with_budget(
                        Limits {
                            // A time limit is per request, not shared.
                            timeout_s: None,
                            ..limits
                        },
                        None,
                        0,
                        self.clock.clone(),
                    ))
                })
                .clone(),
        )
    }

    fn state(&self) -> MutexGuard<'_, MapState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `bearer` is a token the authority knows.
    pub(crate) fn knows(&self, bearer: &str) -> bool {
        self.authority.grant(bearer).is_ok()
    }

    /// The caller of token `bearer`, made from its grant on first use (and again when
    /// the grant changed, the tokens spent carried over).
    pub(crate) fn caller(
        &self,
        bearer: &str,
        config: &GatewayConfig,
    ) -> Result<Arc<Caller>, TokenError> {
        let grant = match self.authority.grant(bearer) {
            Ok(g) => g,
            Err(e) => {
                let now = (self.clock)();
                let mut state = self.state();
                // A token just revoked: its caller goes soon. (Not when the authority
                // cannot tell: it may not know what is live either.)
                if e == TokenError::Unknown
                    && now.saturating_sub(state.swept_at) >= SWEEP_AFTER_REFUSAL
                {
                    self.sweep(&mut state, now);
                }
                return Err(e);
            }
        };
        let mut state = self.state();
        let (spent, usage) = match state.callers.get(&grant.id) {
            Some((held, caller)) if *held == grant => return Ok(caller.clone()),
            Some((held, caller)) if held.tenant == grant.tenant => {
                (caller.limits.spent(), caller.usage.clone())
            }
            Some((_, caller)) => (
                caller.limits.spent(),
                self.usage_for(grant.tenant.as_deref()),
            ),
            None => (0, self.usage_for(grant.tenant.as_deref())),
        };
        let caller = Arc::new(self.caller_of(&grant, config, spent, usage));
        let elsewhere = self
            .elsewhere
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&grant.id)
            .copied()
            .unwrap_or(0);
        caller.limits.set_spent_elsewhere(elsewhere);
        state
            .callers
            .insert(grant.id.clone(), (grant, caller.clone()));
        let now = (self.clock)();
        if state.callers.len() > state.high_water
            || now.saturating_sub(state.swept_at) >= SWEEP_EVERY
        {
            self.sweep(&mut state, now);
        }
        Ok(caller)
    }

    fn caller_of(
        &self,
        grant: &Grant,
        config: &GatewayConfig,
        spent: u64,
        usage: Arc<UsageCounters>,
    ) -> Caller {
        let limits = grant.limits.or(&config.default_limits);
        let tenant = grant
            .tenant
            .as_deref()
            .and_then(|t| Some((t, self.tenant_limits(t, config)?)));
        Caller {
            name: grant.name.clone(),
            token_id: Some(grant.id.clone()),
            usage,
            scope: format!("token:{}", grant.name),
            limits: Arc::new(
                CallerLimits::with_budget(limits, grant.budget_tokens, spent, self.clock.clone())
                    .sharing(tenant.as_ref().map(|(_, shared)| shared.clone())),
            ),
            config: limits,
            tenant: tenant.map(|(t, shared)| (t.to_string(), shared.limits())),
            tenant_name: grant.tenant.clone(),
            models: grant
                .models
                .as_ref()
                .map(|m| m.iter().cloned().collect::<BTreeSet<_>>()),
        }
    }

    /// Drops the callers of tokens the authority no longer knows.
    fn sweep(&self, state: &mut MapState, now: Duration) {
        let before = state.callers.len();
        state.callers.retain(|id, _| self.authority.is_live(id));
        state.swept_at = now;
        state.high_water = (state.callers.len() * 2).max(MIN_HIGH_WATER);
        let dropped = before - state.callers.len();
        if dropped > 0 {
            tracing::debug!(
                dropped,
                live = state.callers.len(),
                "callers of gone tokens dropped"
            );
        }
    }

    /// The callers held now.
    pub(crate) fn all(&self) -> Vec<Arc<Caller>> {
        self.state()
            .callers
            .values()
            .map(|(_, c)| c.clone())
            .collect()
    }

    /// Callers held now.
    pub(crate) fn len(&self) -> usize {
        self.state().callers.len()
    }
}

//! The model gateway's view of sandbox tokens when it runs inside `dsec serve`: the
//! tokens the control plane mints into `dsec-iam` (one per sandbox created with
//! `model_access`), checked from IAM's in-memory cache, which follows the store, so a
//! token stops working as soon as its sandbox's record is gone; and what the gateway
//! charged their budgets, exchanged with the other gateways through the store.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use dsec_gateway::{Grant, LedgerError, Limits, SpendLedger, TokenAuthority, TokenError};
use dsec_iam::{Iam, IamError, ModelSpendLedger};
use futures::future::BoxFuture;

/// [`TokenAuthority`] over an [`Iam`].
#[derive(Debug)]
pub struct IamTokens(pub Arc<Iam>);

impl TokenAuthority for IamTokens {
    fn grant(&self, bearer: &str) -> Result<Grant, TokenError> {
        let grant = self
            .0
            .authenticate_model_token(bearer)
            .map_err(|e| match e {
                IamError::Unauthenticated => TokenError::Unknown,
                IamError::TenantDisabled(t) => {
                    TokenError::Denied(format!("tenant {t} is disabled"))
                }
                IamError::Store(e) => TokenError::Unavailable(e.to_string()),
                other => TokenError::Unavailable(other.to_string()),
            })?;
        let a = grant.access;
        Ok(Grant {
            tenant: Some(grant.tenant.clone()),
            name: format!("{}/{}", grant.tenant, grant.sandbox),
            id: grant.token_id,
            models: Some(a.models),
            limits: Limits {
                rpm: a.rpm,
                burst: None,
                tpm: a.tpm,
                max_concurrency: a.max_concurrency,
                timeout_s: a.timeout_s.map(|s| s as f64),
            },
            budget_tokens: a.budget_tokens,
        })
    }

    fn is_live(&self, token_id: &str) -> bool {
        self.0.model_token_exists(token_id)
    }
}

/// [`SpendLedger`] over the store's model spending records ([`ModelSpendLedger`]): the
/// budgets of sandbox tokens hold across gateway replicas and restarts.
#[derive(Debug)]
pub struct IamSpendLedger(pub ModelSpendLedger);

impl SpendLedger for IamSpendLedger {
    fn exchange<'a>(
        &'a self,
        mine: &'a BTreeMap<String, u64>,
    ) -> BoxFuture<'a, Result<HashMap<String, u64>, LedgerError>> {
        Box::pin(async move {
            self.0
                .exchange(mine)
                .await
                .map_err(|e| LedgerError(e.to_string()))
        })
    }
}

/// How often a gateway exchanges its spending with the others'.
pub const SPEND_EXCHANGE_EVERY: std::time::Duration = std::time::Duration::from_secs(2);

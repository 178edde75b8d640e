//! Budgets beyond one gateway process. A sandbox token's budget is counted by each
//! gateway that answers it; with a [`SpendLedger`] the gateways tell each other what
//! they charged, so a budget holds across replicas and across a gateway's restart.
//!
//! Each gateway keeps the totals it charged each budgeted token (never increments, so a
//! lost exchange loses nothing), and every [`crate::Gateway::exchange_spending`] (the
//! task of [`crate::Gateway::start_spend_ledger`], every few seconds) stores them and
//! learns what every other gateway charged, which then counts against the budget as
//! if spent here. Between exchanges a budget can be overrun by what the other gateways
//! charged in that time; a gateway that starts counts its first requests before its
//! first exchange against its own spending only.

use std::collections::{BTreeMap, HashMap};

use futures::future::BoxFuture;

/// Where gateways keep what they charged to sandbox tokens' budgets.
pub trait SpendLedger: Send + Sync + std::fmt::Debug {
    /// Stores `mine` (token id -> model tokens this gateway charged it, in all) and
    /// answers what every other gateway, this one's earlier runs included, charged
    /// each token still live (token id -> tokens; absent: none).
    fn exchange<'a>(
        &'a self,
        mine: &'a BTreeMap<String, u64>,
    ) -> BoxFuture<'a, Result<HashMap<String, u64>, LedgerError>>;
}

/// The ledger could not be read or written now (the next exchange tries again).
#[derive(Debug, thiserror::Error)]
#[error("the spend ledger: {0}")]
pub struct LedgerError(pub String);

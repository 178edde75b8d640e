//! What model gateways charged to sandbox tokens' budgets, kept in the store so that a
//! budget holds across gateway replicas and restarts (the gateway side is
//! `dsec_gateway::ledger`).
//!
//! Each gateway process is one writer: a record in namespace [`MODEL_SPENDING_NS`]
//! under its own id (fresh per process), holding the totals it charged each budgeted
//! token it holds. A token's spending is the sum over every record, so a gateway that
//! restarts (a new id) still counts what its earlier run charged. A record is removed
//! by its writer when it holds nothing, and by any gateway once every token in it is
//! gone (its sandboxes deleted) and it has not been written for [`ABANDONED_AFTER_MS`].

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use dsec_state::Expect;

use crate::{Iam, IamError};

/// Namespace of the gateways' spending records (key: a gateway's id, value: JSON).
pub const MODEL_SPENDING_NS: &str = "modelspending";

/// How long a record whose tokens are all gone is left before another gateway removes
/// it (a token just minted may not be in this gateway's cache yet).
pub const ABANDONED_AFTER_MS: u64 = 60_000;

/// One gateway's record.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
struct SpendingRecord {
    /// Token id -> model tokens this gateway charged it, in all.
    spent: BTreeMap<String, u64>,
    /// When it was written, Unix ms.
    written_at_ms: u64,
}

/// One gateway's side of the spending records: writes its own, reads the others'.
#[derive(Debug)]
pub struct ModelSpendLedger {
    iam: Arc<Iam>,
    id: String,
    /// What this gateway last wrote (`None`: no record of its own).
    written: tokio::sync::Mutex<Option<BTreeMap<String, u64>>>,
}

impl ModelSpendLedger {
    /// A ledger writing under a fresh id (`<prefix>-<random hex>`).
    pub fn new(iam: Arc<Iam>, prefix: &str) -> Self {
        let id = format!("{prefix}-{:016x}", rand::random::<u64>());
        Self {
            iam,
            id,
            written: tokio::sync::Mutex::new(None),
        }
    }

    /// Its record's key.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Stores `mine` (token id -> tokens this gateway charged it, in all) as this
    /// gateway's record, if it changed, and answers what the other records charged each
    /// token that still exists. Removes abandoned records on the way.
    pub async fn exchange(
        &self,
        mine: &BTreeMap<String, u64>,
    ) -> Result<HashMap<String, u64>, IamError> {
        let store = self.iam.store().clone();
        let now = self.iam.now();
        {
            let mut written = self.written.lock().await;
            if written.as_ref() != Some(mine) {
                if mine.is_empty() {
                    store
                        .delete(MODEL_SPENDING_NS, &self.id, Expect::Any)
                        .await?;
                    *written = None;
                } else {
                    let record = SpendingRecord {
                        spent: mine.clone(),
                        written_at_ms: now,
                    };
                    let value = serde_json::to_vec(&record)
                        .map_err(|e| IamError::Corrupt(e.to_string()))?;
                    store
                        .put(MODEL_SPENDING_NS, &self.id, &value, Expect::Any)
                        .await?;
                    *written = Some(mine.clone());
                }
            }
        }
        let (entries, _) = store.list(MODEL_SPENDING_NS).await?;
        let mut others: HashMap<String, u64> = HashMap::new();
        for entry in entries.iter().filter(|e| e.key != self.id) {
            let record: SpendingRecord = match serde_json::from_slice(&entry.value) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(record = %entry.key, error = %e, "a model spending record that does not parse: ignored");
                    continue;
                }
            };
            let mut live = false;
            for (token, n) in &record.spent {
                if self.iam.model_token_exists(token) {
                    live = true;
                    let sum = others.entry(token.clone()).or_default();
                    *sum = sum.saturating_add(*n);
                }
            }
            if !live && now.saturating_sub(record.written_at_ms) >= ABANDONED_AFTER_MS {
                // Its tokens are gone: nobody needs it. Only as read (its writer may
                // have written since).
                match store
                    .delete(MODEL_SPENDING_NS, &entry.key, Expect::Rev(entry.rev))
                    .await
                {
                    Ok(_) => {
                        tracing::debug!(record = %entry.key, "abandoned model spending record removed")
                    }
                    Err(e) => {
                        tracing::debug!(record = %entry.key, error = %e, "abandoned model spending record left")
                    }
                }
            }
        }
        Ok(others)
    }
}

//! Model gateway tokens: what a sandbox created with `model_access` presents to the
//! model gateway (`OPENAI_API_KEY` in its environment).
//!
//! A token is `dsgw_<token_id>_<secret>` (the shape of an API key, another prefix). Its
//! record, in namespace [`MODEL_TOKENS_NS`] under its id, holds the SHA-256 of the
//! secret, the tenant and sandbox it belongs to, and the sandbox's [`ModelAccess`]. The
//! record is written in the transaction that stores the sandbox and deleted with it, so a
//! token lives exactly as long as its sandbox; every gateway follows the namespace by
//! watch and refuses a deleted token within moments.

use serde::{Deserialize, Serialize};

use dsec_wire::v1::ModelAccess;

use crate::key::{self, Hash};

/// Namespace of model gateway tokens (key: token id, value: JSON, the secret's SHA-256
/// only).
pub const MODEL_TOKENS_NS: &str = "modeltokens";
/// The prefix of every model gateway token.
pub const MODEL_TOKEN_PREFIX: &str = "dsgw_";

/// A token's record as stored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelTokenRecord {
    /// The token's public id.
    pub token_id: String,
    /// The tenant whose sandbox holds it.
    pub tenant: String,
    /// The sandbox it was minted for.
    pub sandbox: String,
    /// What it may call.
    pub access: ModelAccess,
    /// When it was minted, Unix ms.
    pub created_at_ms: u64,
    /// SHA-256 of its secret, hex.
    pub secret_sha256: String,
}

/// A token just minted: its record to store and the whole token for the sandbox (shown
/// once, never stored).
#[derive(Clone)]
pub struct MintedToken {
    /// The record, to be written with the sandbox's own.
    pub record: ModelTokenRecord,
    /// `dsgw_<id>_<secret>`.
    pub token: String,
}

impl std::fmt::Debug for MintedToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MintedToken")
            .field("record", &self.record)
            .field("token", &"<secret>")
            .finish()
    }
}

/// Who presents a token: its tenant and sandbox and what it may call.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelGrant {
    /// The token's id (for logs and usage; never the secret).
    pub token_id: String,
    /// The tenant.
    pub tenant: String,
    /// The sandbox.
    pub sandbox: String,
    /// What it may call.
    pub access: ModelAccess,
}

/// Mints a token for `sandbox` of `tenant` with `access`, at `now_ms`.
pub fn mint(tenant: &str, sandbox: &str, access: ModelAccess, now_ms: u64) -> MintedToken {
    let (token_id, token, hash) = key::generate_with(MODEL_TOKEN_PREFIX);
    MintedToken {
        record: ModelTokenRecord {
            token_id,
            tenant: tenant.to_string(),
            sandbox: sandbox.to_string(),
            access,
            created_at_ms: now_ms,
            secret_sha256: hex::encode(hash),
        },
        token,
    }
}

/// A record as the cache keeps it: the record and its decoded hash.
#[derive(Clone, Debug)]
pub(crate) struct CachedToken {
    pub record: ModelTokenRecord,
    pub hash: Hash,
}

pub(crate) fn decode(value: &[u8]) -> Result<CachedToken, String> {
    let record: ModelTokenRecord = serde_json::from_slice(value).map_err(|e| e.to_string())?;
    let mut hash = [0u8; 32];
    hex::decode_to_slice(&record.secret_sha256, &mut hash).map_err(|e| e.to_string())?;
    Ok(CachedToken { record, hash })
}

/// Splits a presented token into its id and secret; `None` if it is not shaped like one.
pub(crate) fn parse(token: &str) -> Option<(&str, &str)> {
    key::parse_with(MODEL_TOKEN_PREFIX, token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_minted_token_parses_and_its_record_checks_it() {
        let access = ModelAccess {
            models: vec!["policy".into()],
            ..ModelAccess::default()
        };
        let m = mint("t1", "sb-1", access.clone(), 5);
        let (id, secret) = parse(&m.token).expect("parses");
        assert_eq!(id, m.record.token_id);
        let cached = decode(&serde_json::to_vec(&m.record).expect("json")).expect("decodes");
        assert!(key::ct_eq(&key::sha256(secret.as_bytes()), &cached.hash));
        assert_eq!(cached.record.access, access);
        // An API key is not a model token, nor the other way round.
        assert!(key::parse(&m.token).is_none());
        let (_, api_key, _) = key::generate();
        assert!(parse(&api_key).is_none());
        assert!(
            !format!("{m:?}").contains(secret),
            "the secret stays out of logs"
        );
    }
}

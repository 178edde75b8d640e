//! The in-memory copy of tenants and keys that [`crate::Iam::authenticate`] reads: listed
//! at start, then kept fresh by a watch of each namespace (relisted on `Compacted`,
//! re-watched with backoff when the store is unavailable).

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use dsec_state::{Entry, Revision, StateError, StateStore, WatchEvent};
use futures::StreamExt;
use serde::{Deserialize, Serialize};

use crate::key::Hash;
use crate::model::{KeyInfo, Tenant, KEYS_NS, TENANTS_NS};
use crate::model_tokens::{self, CachedToken, MODEL_TOKENS_NS};

/// A key record as stored: its public fields and the SHA-256 of its secret (hex).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct StoredKey {
    #[serde(flatten)]
    pub info: KeyInfo,
    pub secret_sha256: String,
}

/// A cached key: its record and the decoded hash.
#[derive(Clone, Debug)]
pub(crate) struct CachedKey {
    pub info: KeyInfo,
    pub hash: Hash,
}

/// Which namespace a follower keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Tenants = 0,
    Keys = 1,
    ModelTokens = 2,
}

impl Kind {
    pub fn ns(self) -> &'static str {
        match self {
            Kind::Tenants => TENANTS_NS,
            Kind::Keys => KEYS_NS,
            Kind::ModelTokens => MODEL_TOKENS_NS,
        }
    }
}

/// Cached records, each with the revision it was read at (older news never replaces
/// newer: a replica's own writes are applied at once, and the watch brings them again).
#[derive(Debug, Default)]
pub(crate) struct Cache {
    pub tenants: HashMap<String, (Tenant, Revision)>,
    pub keys: HashMap<String, (CachedKey, Revision)>,
    pub model_tokens: HashMap<String, (CachedToken, Revision)>,
    /// Since when each namespace's watch has been down (tenants, keys, model tokens);
    /// `None` while it is following.
    pub broken_since: [Option<std::time::Instant>; 3],
}

pub(crate) fn decode_key(value: &[u8]) -> Result<CachedKey, String> {
    let stored: StoredKey = serde_json::from_slice(value).map_err(|e| e.to_string())?;
    let mut hash = [0u8; 32];
    hex::decode_to_slice(&stored.secret_sha256, &mut hash).map_err(|e| e.to_string())?;
    Ok(CachedKey {
        info: stored.info,
        hash,
    })
}

impl Cache {
    /// Notes that `kind`'s watch is following (`true`) or down.
    fn following(&mut self, kind: Kind, yes: bool) {
        let slot = &mut self.broken_since[kind as usize];
        if yes {
            *slot = None;
        } else if slot.is_none() {
            *slot = Some(std::time::Instant::now());
        }
    }

    /// How long the cache has not been following the store (the longest of them).
    pub fn stale_for(&self) -> Option<Duration> {
        self.broken_since
            .iter()
            .flatten()
            .map(|t| t.elapsed())
            .max()
    }

    /// Applies a put of `kind` at `rev`, unless the cache holds something newer. A record
    /// that does not decode is dropped (a key that cannot be checked does not work).
    pub fn put(&mut self, kind: Kind, e: &Entry) {
        match kind {
            Kind::Tenants => match serde_json::from_slice::<Tenant>(&e.value) {
                Ok(t) => upsert(&mut self.tenants, &e.key, t, e.rev),
                Err(err) => {
                    tracing::warn!(tenant = %e.key, error = %err, "undecodable tenant record");
                    self.tenants.remove(&e.key);
                }
            },
            Kind::Keys => match decode_key(&e.value) {
                Ok(k) => upsert(&mut self.keys, &e.key, k, e.rev),
                Err(err) => {
                    tracing::warn!(key_id = %e.key, error = %err, "undecodable key record");
                    self.keys.remove(&e.key);
                }
            },
            Kind::ModelTokens => match model_tokens::decode(&e.value) {
                Ok(t) => upsert(&mut self.model_tokens, &e.key, t, e.rev),
                Err(err) => {
                    tracing::warn!(token_id = %e.key, error = %err, "undecodable model token");
                    self.model_tokens.remove(&e.key);
                }
            },
        }
    }

    fn delete(&mut self, kind: Kind, key: &str) {
        match kind {
            Kind::Tenants => drop(self.tenants.remove(key)),
            Kind::Keys => drop(self.keys.remove(key)),
            Kind::ModelTokens => drop(self.model_tokens.remove(key)),
        }
    }

    /// Replaces a namespace with a listing as of `rev`, keeping entries written after it.
    pub(crate) fn replace(&mut self, kind: Kind, entries: &[Entry], rev: Revision) {
        match kind {
            Kind::Tenants => self.tenants.retain(|_, (_, r)| *r > rev),
            Kind::Keys => self.keys.retain(|_, (_, r)| *r > rev),
            Kind::ModelTokens => self.model_tokens.retain(|_, (_, r)| *r > rev),
        }
        for e in entries {
            self.put(kind, e);
        }
    }
}

fn upsert<T>(map: &mut HashMap<String, (T, Revision)>, key: &str, value: T, rev: Revision) {
    match map.get(key) {
        Some((_, have)) if *have >= rev => {}
        _ => {
            map.insert(key.to_string(), (value, rev));
        }
    }
}

pub(crate) type SharedCache = Arc<RwLock<Cache>>;

pub(crate) fn write(cache: &SharedCache) -> std::sync::RwLockWriteGuard<'_, Cache> {
    cache.write().unwrap_or_else(|e| e.into_inner())
}

pub(crate) fn read(cache: &SharedCache) -> std::sync::RwLockReadGuard<'_, Cache> {
    cache.read().unwrap_or_else(|e| e.into_inner())
}

/// Lists `kind` into the cache; returns the listing's revision.
pub(crate) async fn relist(
    store: &dyn StateStore,
    cache: &SharedCache,
    kind: Kind,
) -> Result<Revision, StateError> {
    let (entries, rev) = store.list(kind.ns()).await?;
    write(cache).replace(kind, &entries, rev);
    Ok(rev)
}

const BACKOFF_MIN: Duration = Duration::from_millis(50);
// Small: after an outage a replica must catch up within the 1 s a revocation may take.
const BACKOFF_MAX: Duration = Duration::from_millis(500);

/// Keeps `kind` fresh from revision `rev` on, forever (the task is aborted when its
/// `Iam` is dropped).
pub(crate) async fn follow(
    store: Arc<dyn StateStore>,
    cache: SharedCache,
    kind: Kind,
    mut rev: Revision,
) {
    let mut backoff = BACKOFF_MIN;
    let mut stale = false;
    loop {
        if stale {
            match relist(&*store, &cache, kind).await {
                Ok(r) => {
                    rev = r;
                    stale = false;
                }
                Err(e) => {
                    tracing::warn!(ns = kind.ns(), error = %e, "relisting IAM records failed");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                    continue;
                }
            }
        }
        let mut stream = match store.watch(kind.ns(), rev).await {
            Ok(s) => {
                write(&cache).following(kind, true);
                s
            }
            Err(e) => {
                write(&cache).following(kind, false);
                stale = e == StateError::Compacted;
                tracing::warn!(ns = kind.ns(), error = %e, "watching IAM records failed");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(BACKOFF_MAX);
                continue;
            }
        };
        while let Some(ev) = stream.next().await {
            match ev {
                Ok(ev) => {
                    backoff = BACKOFF_MIN;
                    rev = ev.rev();
                    let mut c = write(&cache);
                    match &ev {
                        WatchEvent::Put(e) => c.put(kind, e),
                        WatchEvent::Delete { key, .. } => c.delete(kind, key),
                    }
                }
                Err(e) => {
                    stale = e == StateError::Compacted;
                    tracing::warn!(ns = kind.ns(), error = %e, "the IAM watch broke");
                    break;
                }
            }
        }
        // The stream failed or ended: watch again from the last revision seen.
        write(&cache).following(kind, false);
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

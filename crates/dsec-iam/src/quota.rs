//! Quotas: one usage record per tenant, changed only by compare-and-swap.
//!
//! The record (namespace [`USAGE_NS`], key: the tenant) holds the tenant's reserved
//! sandboxes, CPU and memory, and the creates-per-second token bucket (tokens in
//! thousandths and the time of the last refill). A reservation reads it, checks every
//! limit, and yields a check `Expect::Rev(rev)` (or `Absent`) and a put of the new record
//! ([`QuotaTxn`]); two replicas reserving from the same revision cannot both commit, so
//! the quota holds across replicas. The bucket lives in the same record, so the rate
//! quota costs no extra write. Bucket times are the replicas' wall clocks; a replica
//! whose clock is behind the record's never refills it early (time never goes back).

use std::time::{Duration, Instant};

use dsec_state::{Expect, Op, StateError, Txn};
use rand::Rng;
use serde::{Deserialize, Serialize};

use crate::model::{validate_tenant_name, QuotaKind, Quotas, Usage, USAGE_NS};
use crate::{decode, encode, is_conflict, put_op, Iam, IamError};

/// A tenant's usage record as stored.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub(crate) struct UsageRecord {
    #[serde(flatten)]
    pub used: Usage,
    /// Tokens left in the creates bucket, in thousandths.
    #[serde(default)]
    pub bucket_milli: u64,
    /// When the bucket was last refilled (unix ms); 0: never used (full).
    #[serde(default)]
    pub bucket_at: u64,
}

/// The checks and ops that apply a reservation (or release) of a tenant's quota: add
/// them to the [`Txn`] that makes the change they pay for (e.g. puts the sandbox record),
/// so both happen or neither. If that txn fails with a conflict on this usage key
/// ([`QuotaTxn::lost_race`]), another replica changed the usage first: build a new one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QuotaTxn {
    /// Checks to add to the txn.
    pub checks: Vec<(String, String, Expect)>,
    /// Ops to add to the txn.
    pub ops: Vec<Op>,
    /// The tenant's usage once it commits.
    pub usage_after: Usage,
    tenant: String,
}

impl QuotaTxn {
    /// Adds the checks and ops to `txn`.
    pub fn add_to(self, txn: &mut Txn) {
        txn.checks.extend(self.checks);
        txn.ops.extend(self.ops);
    }

    /// A txn of just these checks and ops.
    pub fn into_txn(self) -> Txn {
        Txn {
            checks: self.checks,
            ops: self.ops,
        }
    }

    /// Whether a txn holding this failed because the usage changed under it (so the
    /// caller should reserve again), rather than on one of its own checks.
    pub fn lost_race(&self, e: &StateError) -> bool {
        matches!(e, StateError::Conflict { ns, key, .. } if ns == USAGE_NS && *key == self.tenant)
    }

    fn new(tenant: &str, expect: Expect, rec: &UsageRecord) -> Self {
        QuotaTxn {
            checks: vec![(USAGE_NS.into(), tenant.into(), expect)],
            ops: vec![put_op(USAGE_NS, tenant, encode(rec))],
            usage_after: rec.used,
            tenant: tenant.into(),
        }
    }
}

fn exceeded(tenant: &str, which: QuotaKind, limit: u64, used: u64) -> IamError {
    IamError::QuotaExceeded {
        tenant: tenant.into(),
        which,
        limit,
        used,
        retry_after: None,
    }
}

fn overflow() -> IamError {
    IamError::Invalid("usage overflows".into())
}

/// Adds `delta` to `rec` at `now`, or says which quota it would exceed.
fn admit(
    tenant: &str,
    q: &Quotas,
    rec: &mut UsageRecord,
    delta: Usage,
    now: u64,
) -> Result<(), IamError> {
    let u = rec.used;
    let after = Usage {
        sandboxes: u
            .sandboxes
            .checked_add(delta.sandboxes)
            .ok_or_else(overflow)?,
        cpu_millis: u
            .cpu_millis
            .checked_add(delta.cpu_millis)
            .ok_or_else(overflow)?,
        memory_mb: u
            .memory_mb
            .checked_add(delta.memory_mb)
            .ok_or_else(overflow)?,
    };
    let limits = [
        (
            QuotaKind::MaxSandboxes,
            q.max_sandboxes,
            u.sandboxes,
            after.sandboxes,
            delta.sandboxes,
        ),
        (
            QuotaKind::MaxCpuMillis,
            q.max_cpu_millis,
            u.cpu_millis,
            after.cpu_millis,
            delta.cpu_millis,
        ),
        (
            QuotaKind::MaxMemoryMb,
            q.max_memory_mb,
            u.memory_mb,
            after.memory_mb,
            delta.memory_mb,
        ),
    ];
    for (which, limit, used, after, delta) in limits {
        if let Some(limit) = limit {
            if delta > 0 && after > limit {
                return Err(exceeded(tenant, which, limit, used));
            }
        }
    }
    if let (Some(rate), Some(burst), true) = (q.creates_per_second, q.burst(), delta.sandboxes > 0)
    {
        let rate = u64::from(rate);
        let cap = burst.saturating_mul(1000);
        let tokens = if rec.bucket_at == 0 {
            cap
        } else {
            let elapsed = now.saturating_sub(rec.bucket_at);
            rec.bucket_milli
                .saturating_add(elapsed.saturating_mul(rate))
                .min(cap)
        };
        let need = delta.sandboxes.saturating_mul(1000);
        if tokens < need {
            let retry_after = (rate > 0 && need <= cap)
                .then(|| Duration::from_millis((need - tokens).div_ceil(rate)));
            return Err(IamError::QuotaExceeded {
                tenant: tenant.into(),
                which: QuotaKind::CreatesPerSecond,
                limit: rate,
                used: (cap - tokens).div_ceil(1000),
                retry_after,
            });
        }
        rec.bucket_milli = tokens - need;
        rec.bucket_at = rec.bucket_at.max(now);
    }
    rec.used = after;
    Ok(())
}

impl Iam {
    /// A tenant's usage record and the expectation that it is unchanged.
    async fn load_usage(&self, tenant: &str) -> Result<(UsageRecord, Expect), IamError> {
        Ok(match self.store.get(USAGE_NS, tenant).await? {
            Some(e) => (decode("a usage record", &e.value)?, Expect::Rev(e.rev)),
            None => (UsageRecord::default(), Expect::Absent),
        })
    }

    /// A tenant's reserved usage, read from the store.
    pub async fn usage(&self, tenant: &str) -> Result<Usage, IamError> {
        validate_tenant_name(tenant)?;
        Ok(self.load_usage(tenant).await?.0.used)
    }

    /// Reserves `delta` for `tenant` (each sandbox in it also takes one create from the
    /// rate quota) without writing: returns the [`QuotaTxn`] to commit, or
    /// [`IamError::QuotaExceeded`] naming the quota, its limit and the usage. The tenant
    /// must exist and be enabled (as this replica's cache says; the store is asked only
    /// about a tenant it does not know). One store read.
    pub async fn reserve(&self, tenant: &str, delta: Usage) -> Result<QuotaTxn, IamError> {
        validate_tenant_name(tenant)?;
        // A tenant created on another replica a moment ago may not be cached yet.
        let t = match self.cached_tenant(tenant) {
            Some(t) => t,
            None => self.get_tenant(tenant).await?,
        };
        if t.disabled {
            return Err(IamError::TenantDisabled(tenant.into()));
        }
        let (mut rec, expect) = self.load_usage(tenant).await?;
        if delta.is_zero() {
            return Ok(QuotaTxn {
                usage_after: rec.used,
                tenant: tenant.into(),
                ..QuotaTxn::default()
            });
        }
        admit(tenant, &t.quotas, &mut rec, delta, self.now())?;
        Ok(QuotaTxn::new(tenant, expect, &rec))
    }

    /// Returns `delta` to `tenant` without writing (usage never goes below zero; the
    /// tenant need not exist any more): the [`QuotaTxn`] to commit with the change that
    /// frees it (e.g. the delete of the sandbox record).
    pub async fn release(&self, tenant: &str, delta: Usage) -> Result<QuotaTxn, IamError> {
        validate_tenant_name(tenant)?;
        let (mut rec, expect) = self.load_usage(tenant).await?;
        if expect == Expect::Absent || delta.is_zero() {
            // Nothing to give back; the check still makes a racing reservation retry.
            return Ok(QuotaTxn {
                checks: vec![(USAGE_NS.into(), tenant.into(), expect)],
                ops: Vec::new(),
                usage_after: rec.used,
                tenant: tenant.into(),
            });
        }
        let u = &mut rec.used;
        u.sandboxes = u.sandboxes.saturating_sub(delta.sandboxes);
        u.cpu_millis = u.cpu_millis.saturating_sub(delta.cpu_millis);
        u.memory_mb = u.memory_mb.saturating_sub(delta.memory_mb);
        Ok(QuotaTxn::new(tenant, expect, &rec))
    }

    /// Counts `delta` in `tenant`'s usage without checking its quotas and without
    /// writing: for sandboxes that run already (created while the tenant had no quotas,
    /// so charged nothing), so that a quota set since sees them. The [`QuotaTxn`] goes
    /// with the write that marks them counted; usage may end above a quota, which then
    /// refuses reservations until it drops.
    pub async fn count(&self, tenant: &str, delta: Usage) -> Result<QuotaTxn, IamError> {
        validate_tenant_name(tenant)?;
        let (mut rec, expect) = self.load_usage(tenant).await?;
        let u = &mut rec.used;
        u.sandboxes = u.sandboxes.saturating_add(delta.sandboxes);
        u.cpu_millis = u.cpu_millis.saturating_add(delta.cpu_millis);
        u.memory_mb = u.memory_mb.saturating_add(delta.memory_mb);
        Ok(QuotaTxn::new(tenant, expect, &rec))
    }

    /// [`Iam::reserve`] committed on its own, retrying (with jittered backoff, up to
    /// [`crate::IamConfig::contention_deadline`]) while other replicas win the race.
    /// Returns the usage after it. A store that is unavailable is not retried: the write
    /// may have been applied, and a retry would count it twice.
    pub async fn reserve_now(&self, tenant: &str, delta: Usage) -> Result<Usage, IamError> {
        self.commit_loop(tenant, || self.reserve(tenant, delta))
            .await
    }

    /// [`Iam::release`] committed on its own, retrying lost races like
    /// [`Iam::reserve_now`]. Returns the usage after it.
    pub async fn release_now(&self, tenant: &str, delta: Usage) -> Result<Usage, IamError> {
        self.commit_loop(tenant, || self.release(tenant, delta))
            .await
    }

    /// Serializes this replica's changes of `tenant`'s usage: hold the guard from
    /// [`Iam::reserve`] until the txn holding its [`QuotaTxn`] is committed, and other
    /// calls on this replica wait instead of losing the compare-and-swap race (which only
    /// other replicas can then win). [`Iam::reserve_now`] and [`Iam::release_now`] take
    /// it themselves. Optional: without it reservations are still correct.
    pub async fn lock_usage(&self, tenant: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = {
            let mut locks = self.usage_locks.lock().unwrap_or_else(|e| e.into_inner());
            locks.entry(tenant.to_string()).or_default().clone()
        };
        lock.lock_owned().await
    }

    async fn commit_loop<F, Fut>(&self, tenant: &str, build: F) -> Result<Usage, IamError>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<QuotaTxn, IamError>>,
    {
        validate_tenant_name(tenant)?;
        let _queue = self.lock_usage(tenant).await;
        let deadline = Instant::now() + self.contention_deadline;
        let mut attempt: u32 = 0;
        loop {
            let q = build().await?;
            let usage = q.usage_after;
            if q.ops.is_empty() {
                return Ok(usage);
            }
            match self.store.txn(q.into_txn()).await {
                Ok(_) => return Ok(usage),
                Err(e) if is_conflict(&e) => {
                    if Instant::now() >= deadline {
                        return Err(IamError::Contended(tenant.into()));
                    }
                    let cap = 1u64 << attempt.min(5);
                    let ms = rand::thread_rng().gen_range(0..=cap);
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    attempt = attempt.saturating_add(1);
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rate(per_s: u32, burst: u32) -> Quotas {
        Quotas {
            creates_per_second: Some(per_s),
            creates_burst: Some(burst),
            ..Quotas::default()
        }
    }

    #[test]
    fn the_bucket_allows_a_burst_then_the_rate() {
        let q = rate(2, 3);
        let mut rec = UsageRecord::default();
        for _ in 0..3 {
            admit("t", &q, &mut rec, Usage::sandbox(0, 0), 1000).expect("within the burst");
        }
        let e = admit("t", &q, &mut rec, Usage::sandbox(0, 0), 1000).expect_err("empty");
        assert!(
            matches!(
                e,
                IamError::QuotaExceeded {
                    which: QuotaKind::CreatesPerSecond,
                    limit: 2,
                    used: 3,
                    retry_after: Some(d),
                    ..
                } if d == Duration::from_millis(500)
            ),
            "{e:?}"
        );
        // 500 ms later: one token.
        admit("t", &q, &mut rec, Usage::sandbox(0, 0), 1500).expect("refilled one");
        assert!(admit("t", &q, &mut rec, Usage::sandbox(0, 0), 1500).is_err());
        // A clock behind the record's refills nothing, and does not move it back.
        assert!(admit("t", &q, &mut rec, Usage::sandbox(0, 0), 900).is_err());
        assert_eq!(rec.bucket_at, 1500);
        // Long idle: back to the burst, no more.
        for _ in 0..3 {
            admit("t", &q, &mut rec, Usage::sandbox(0, 0), 100_000).expect("burst");
        }
        assert!(admit("t", &q, &mut rec, Usage::sandbox(0, 0), 100_000).is_err());
        assert_eq!(rec.used.sandboxes, 7);
    }

    #[test]
    fn releases_and_non_creates_take_no_token() {
        let q = rate(0, 1);
        let mut rec = UsageRecord::default();
        admit("t", &q, &mut rec, Usage::sandbox(0, 0), 5).expect("burst of 1");
        assert!(admit("t", &q, &mut rec, Usage::sandbox(0, 0), 10_000).is_err());
        // More memory for existing sandboxes is not a create.
        let more = Usage {
            memory_mb: 5,
            ..Usage::default()
        };
        admit("t", &q, &mut rec, more, 10_000).expect("no create");
    }

    #[test]
    fn each_limit_is_named() {
        let q = Quotas {
            max_sandboxes: Some(2),
            max_cpu_millis: Some(1500),
            max_memory_mb: Some(1024),
            ..Quotas::default()
        };
        let mut rec = UsageRecord::default();
        admit("t", &q, &mut rec, Usage::sandbox(1000, 512), 0).expect("fits");
        let e = admit("t", &q, &mut rec, Usage::sandbox(1000, 10), 0).expect_err("cpu");
        assert!(matches!(
            e,
            IamError::QuotaExceeded {
                which: QuotaKind::MaxCpuMillis,
                limit: 1500,
                used: 1000,
                ..
            }
        ));
        let e = admit("t", &q, &mut rec, Usage::sandbox(100, 600), 0).expect_err("memory");
        assert!(matches!(
            e,
            IamError::QuotaExceeded {
                which: QuotaKind::MaxMemoryMb,
                limit: 1024,
                used: 512,
                ..
            }
        ));
        admit("t", &q, &mut rec, Usage::sandbox(500, 512), 0).expect("exactly full");
        let e = admit("t", &q, &mut rec, Usage::sandbox(0, 0), 0).expect_err("count");
        assert!(matches!(
            e,
            IamError::QuotaExceeded {
                which: QuotaKind::MaxSandboxes,
                limit: 2,
                used: 2,
                ..
            }
        ));
        assert_eq!(
            rec.used,
            Usage {
                sandboxes: 2,
                cpu_millis: 1500,
                memory_mb: 1024
            }
        );
        let huge = Usage {
            cpu_millis: u64::MAX,
            ..Usage::default()
        };
        assert!(matches!(
            admit("t", &Quotas::default(), &mut rec, huge, 0),
            Err(IamError::Invalid(_))
        ));
    }
}

//! [`EtcdStore`]: the state store on etcd v3, for a cluster of stateless API servers.
//!
//! Keys are `PREFIX/ns/key`, so several clusters (or tests) can share one etcd.
//! Revisions are etcd's (`mod_revision`); a transaction is one etcd Txn comparing
//! `mod_revision` (or `version == 0` for [`Expect::Absent`]); watches start at
//! `after + 1`; leases are etcd leases (TTLs in whole seconds, rounded up).

use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, TxnOp,
    TxnOpResponse, WatchOptions,
};
use futures::StreamExt;

use crate::{
    check_key, check_ns, check_txn, expect_check, Entry, Expect, LeaseId, Op, Revision, StateError,
    StateStore, Txn, WatchEvent, WatchStream,
};

/// Where and how to reach etcd.
#[derive(Clone, Debug)]
pub struct EtcdConfig {
    /// Client URLs of the members (`http://10.0.0.1:2379`, ...); requests go to any
    /// that answers.
    pub endpoints: Vec<String>,
    /// Prefix of every key (no trailing '/'), e.g. `/dsec/prod`.
    pub prefix: String,
    /// How long one request may take before it fails as [`StateError::Unavailable`].
    pub request_timeout: Duration,
    /// How long connecting to an endpoint may take.
    pub connect_timeout: Duration,
}

impl EtcdConfig {
    /// `endpoints` under `prefix`, with 5 s request and 2 s connect timeouts.
    pub fn new(endpoints: Vec<String>, prefix: impl Into<String>) -> Self {
        Self {
            endpoints,
            prefix: prefix.into(),
            request_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(2),
        }
    }
}

/// The state store on etcd. Cheap to clone (one shared connection pool).
#[derive(Clone)]
pub struct EtcdStore {
    client: Client,
    prefix: String,
    timeout: Duration,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// Maps an etcd client error: transport failures and gRPC codes that mean "not now"
/// are [`StateError::Unavailable`] (retryable).
/// A lease etcd no longer has is [`StateError::LeaseExpired`] with id 0: the caller,
/// which knows the lease, fills it in ([`with_lease`]).
fn map_err(e: etcd_client::Error) -> StateError {
    use etcd_client::Error as E;
    if e.to_string().contains("lease not found") {
        return StateError::LeaseExpired(LeaseId(0));
    }
    match e {
        E::TransportError(e) => StateError::Unavailable(e.to_string()),
        E::IoError(e) => StateError::Unavailable(e.to_string()),
        E::GRpcStatus(s) => {
            use tonic::Code;
            let msg = s.message().to_string();
            match s.code() {
                Code::Unavailable
                | Code::DeadlineExceeded
                | Code::Cancelled
                | Code::Aborted
                | Code::Unknown
                    if !msg.contains("compacted") =>
                {
                    StateError::Unavailable(format!("{:?}: {msg}", s.code()))
                }
                _ if msg.contains("compacted") => StateError::Compacted,
                Code::ResourceExhausted | Code::InvalidArgument => StateError::Invalid(msg),
                _ => StateError::Backend(format!("{:?}: {msg}", s.code())),
            }
        }
        E::LeaseKeepAliveError(m) | E::WatchError(m) => StateError::Unavailable(m),
        other => StateError::Backend(other.to_string()),
    }
}

impl EtcdStore {
    /// Connects to `cfg.endpoints`. Fails as [`StateError::Unavailable`] if none answers.
    pub async fn connect(cfg: EtcdConfig) -> Result<Self, StateError> {
        if cfg.endpoints.is_empty() {
            return Err(StateError::Invalid("no etcd endpoints".into()));
        }
        if cfg.prefix.ends_with('/') {
            return Err(StateError::Invalid(format!(
                "etcd prefix {:?} ends with '/'",
                cfg.prefix
            )));
        }
        let opts = ConnectOptions::new()
            .with_connect_timeout(cfg.connect_timeout)
            .with_keep_alive(Duration::from_secs(5), cfg.request_timeout)
            .with_keep_alive_while_idle(true);
        let client = tokio::time::timeout(
            cfg.request_timeout,
            Client::connect(&cfg.endpoints, Some(opts)),
        )
        .await
        .map_err(|_| StateError::Unavailable("connecting to etcd timed out".into()))?
        .map_err(map_err)?;
        let store = Self {
            client,
            prefix: cfg.prefix,
            timeout: cfg.request_timeout,
        };
        // Connecting is lazy: ask once, so a wrong address fails here.
        store
            .call(|mut c| async move { c.get("health-probe", None).await })
            .await?;
        Ok(store)
    }

    fn full(&self, ns: &str, key: &str) -> String {
        format!("{}/{ns}/{key}", self.prefix)
    }

    fn ns_prefix(&self, ns: &str) -> String {
        format!("{}/{ns}/", self.prefix)
    }

    /// Runs one request with the request timeout.
    async fn call<T, F, Fut>(&self, f: F) -> Result<T, StateError>
    where
        F: FnOnce(Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        tokio::time::timeout(self.timeout, f(self.client.clone()))
            .await
            .map_err(|_| StateError::Unavailable("etcd request timed out".into()))?
            .map_err(map_err)
    }

    /// Runs `txn`: the revision after it and, per op, whether it changed a key.
    async fn exec(&self, txn: Txn) -> Result<(Revision, Vec<bool>), StateError> {
        check_txn(&txn)?;
        let compares: Vec<Compare> = txn
            .checks
            .iter()
            .filter_map(|(ns, key, expect)| {
                let k = self.full(ns, key);
                match expect {
                    Expect::Any => None,
                    Expect::Absent => Some(Compare::version(k, CompareOp::Equal, 0)),
                    Expect::Rev(r) => Some(Compare::mod_revision(
                        k,
                        CompareOp::Equal,
                        i64::try_from(*r).unwrap_or(i64::MAX),
                    )),
                }
            })
            .collect();
        let ops: Vec<TxnOp> = txn
            .ops
            .iter()
            .map(|op| match op {
                Op::Put {
                    ns,
                    key,
                    value,
                    lease,
                } => TxnOp::put(
                    self.full(ns, key),
                    value.clone(),
                    lease.map(|l| PutOptions::new().with_lease(l.0)),
                ),
                Op::Delete { ns, key } => TxnOp::delete(self.full(ns, key), None),
            })
            .collect();
        // When a check fails, the keys checked are read back to say what was found.
        let reads: Vec<TxnOp> = txn
            .checks
            .iter()
            .map(|(ns, key, _)| TxnOp::get(self.full(ns, key), None))
            .collect();
        let request = etcd_client::Txn::new()
            .when(compares)
            .and_then(ops)
            .or_else(reads);
        let resp = self
            .call(|mut c| async move { c.txn(request).await })
            .await
            .map_err(|e| with_lease(e, lease_of(&txn)))?;
        let rev = resp.header().map_or(0, |h| h.revision().max(0) as u64);
        if !resp.succeeded() {
            let found: Vec<Option<Revision>> = resp
                .op_responses()
                .into_iter()
                .map(|r| match r {
                    TxnOpResponse::Get(g) => g.kvs().first().map(|kv| kv.mod_revision() as u64),
                    _ => None,
                })
                .collect();
            let (i, (ns, key, expect)) = txn
                .checks
                .iter()
                .enumerate()
                .find(|(i, (_, _, e))| !crate::holds(*e, found.get(*i).copied().flatten()))
                .or_else(|| txn.checks.iter().enumerate().next())
                .ok_or_else(|| StateError::Backend("etcd txn failed without checks".into()))?;
            return Err(StateError::Conflict {
                ns: ns.clone(),
                key: key.clone(),
                expected: *expect,
                found: found.get(i).copied().flatten(),
            });
        }
        let changed = resp
            .op_responses()
            .into_iter()
            .map(|r| match r {
                TxnOpResponse::Delete(d) => d.deleted() > 0,
                _ => true,
            })
            .collect();
        Ok((rev, changed))
    }
}

/// Names `lease` in a [`StateError::LeaseExpired`] from [`map_err`].
fn with_lease(e: StateError, lease: Option<LeaseId>) -> StateError {
    match (e, lease) {
        (StateError::LeaseExpired(_), Some(l)) => StateError::LeaseExpired(l),
        (e, _) => e,
    }
}

/// The lease a transaction's puts use (for the error when etcd no longer has it).
fn lease_of(txn: &Txn) -> Option<LeaseId> {
    txn.ops.iter().find_map(|op| match op {
        Op::Put { lease, .. } => *lease,
        Op::Delete { .. } => None,
    })
}

#[async_trait]
impl StateStore for EtcdStore {
    async fn get(&self, ns: &str, key: &str) -> Result<Option<Entry>, StateError> {
        check_key(ns, key)?;
        let k = self.full(ns, key);
        let resp = self
            .call(|mut c| async move { c.get(k, None).await })
            .await?;
        Ok(resp.kvs().first().map(|kv| Entry {
            key: key.to_string(),
            value: kv.value().to_vec(),
            rev: kv.mod_revision() as u64,
        }))
    }

    async fn delete(&self, ns: &str, key: &str, expect: Expect) -> Result<bool, StateError> {
        let (_, changed) = self
            .exec(Txn {
                checks: expect_check(ns, key, expect),
                ops: vec![Op::Delete {
                    ns: ns.into(),
                    key: key.into(),
                }],
            })
            .await?;
        Ok(changed.first().copied().unwrap_or(false))
    }

    async fn txn(&self, txn: Txn) -> Result<Revision, StateError> {
        Ok(self.exec(txn).await?.0)
    }

    async fn list(&self, ns: &str) -> Result<(Vec<Entry>, Revision), StateError> {
        check_ns(ns)?;
        let prefix = self.ns_prefix(ns);
        let p = prefix.clone();
        let resp = self
            .call(|mut c| async move { c.get(p, Some(GetOptions::new().with_prefix())).await })
            .await?;
        let rev = resp.header().map_or(0, |h| h.revision().max(0) as u64);
        let mut out = Vec::with_capacity(resp.kvs().len());
        for kv in resp.kvs() {
            let key = kv
                .key_str()
                .map_err(|e| StateError::Corrupt(format!("a key under {prefix}: {e}")))?;
            out.push(Entry {
                key: key[prefix.len()..].to_string(),
                value: kv.value().to_vec(),
                rev: kv.mod_revision() as u64,
            });
        }
        Ok((out, rev))
    }

    async fn watch(&self, ns: &str, after: Revision) -> Result<WatchStream, StateError> {
        check_ns(ns)?;
        let prefix = self.ns_prefix(ns);
        let p = prefix.clone();
        let start = i64::try_from(after.saturating_add(1)).unwrap_or(i64::MAX);
        let stream = self
            .call(|mut c| async move {
                c.watch(
                    p,
                    Some(WatchOptions::new().with_prefix().with_start_revision(start)),
                )
                .await
            })
            .await?;
        // Pending events of one response, then the next response.
        let state = (
            Some(stream),
            std::collections::VecDeque::<WatchEvent>::new(),
        );
        let out = futures::stream::unfold(state, move |(stream, mut pending)| {
            let prefix = prefix.clone();
            async move {
                let mut stream = stream?;
                loop {
                    if let Some(e) = pending.pop_front() {
                        return Some((Ok(e), (Some(stream), pending)));
                    }
                    let resp = match stream.next().await {
                        None => {
                            let e = StateError::Unavailable("the etcd watch ended".into());
                            return Some((Err(e), (None, pending)));
                        }
                        Some(Err(e)) => return Some((Err(map_err(e)), (None, pending))),
                        Some(Ok(r)) => r,
                    };
                    if resp.compact_revision() > 0 {
                        return Some((Err(StateError::Compacted), (None, pending)));
                    }
                    if resp.canceled() {
                        let e = StateError::Unavailable(format!(
                            "etcd canceled the watch: {}",
                            resp.cancel_reason()
                        ));
                        return Some((Err(e), (None, pending)));
                    }
                    for ev in resp.events() {
                        let Some(kv) = ev.kv() else { continue };
                        let Some(key) = kv.key_str().ok().and_then(|k| k.strip_prefix(&prefix))
                        else {
                            continue;
                        };
                        let rev = kv.mod_revision() as u64;
                        pending.push_back(match ev.event_type() {
                            EventType::Put => WatchEvent::Put(Entry {
                                key: key.to_string(),
                                value: kv.value().to_vec(),
                                rev,
                            }),
                            EventType::Delete => WatchEvent::Delete {
                                key: key.to_string(),
                                rev,
                            },
                        });
                    }
                }
            }
        });
        Ok(out.boxed())
    }

    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId, StateError> {
        if ttl.is_zero() {
            return Err(StateError::Invalid("a lease's TTL must be positive".into()));
        }
        let secs =
            i64::try_from(ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0)).unwrap_or(i64::MAX);
        let resp = self
            .call(|mut c| async move { c.lease_grant(secs, None).await })
            .await?;
        Ok(LeaseId(resp.id()))
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<(), StateError> {
        let ttl = self
            .call(|mut c| async move {
                let (mut keeper, mut stream) = c.lease_keep_alive(lease.0).await?;
                keeper.keep_alive().await?;
                stream.message().await
            })
            .await
            .map_err(|e| with_lease(e, Some(lease)))?;
        match ttl {
            Some(r) if r.ttl() > 0 => Ok(()),
            _ => Err(StateError::LeaseExpired(lease)),
        }
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StateError> {
        match self
            .call(|mut c| async move { c.lease_revoke(lease.0).await })
            .await
        {
            Ok(_) | Err(StateError::LeaseExpired(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use dsec_testkit::Etcd;

    use super::*;
    use crate::conformance::{self, next_event, wait_until};

    async fn store(etcd: &Etcd, prefix: &str) -> EtcdStore {
        let mut cfg = EtcdConfig::new(etcd.endpoints(), prefix);
        cfg.request_timeout = Duration::from_secs(2);
        EtcdStore::connect(cfg).await.expect("connect")
    }

    /// Retries `f` while etcd is unavailable (a restart, an election), up to 15 s.
    async fn retry<T, F, Fut>(mut f: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, StateError>>,
    {
        let end = std::time::Instant::now() + Duration::from_secs(15);
        loop {
            match f().await {
                Ok(v) => return v,
                Err(StateError::Unavailable(e)) if std::time::Instant::now() < end => {
                    tracing::debug!(error = %e, "retrying");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("{e}"),
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn etcd_store_conforms() {
        let Some(etcd) = Etcd::start("etcd_store_conforms") else {
            return;
        };
        let s = store(&etcd, "/dsec-test/conformance").await;
        conformance::run_all(Arc::new(s)).await;
    }

    /// Stores under different prefixes share one etcd without seeing each other.
    #[tokio::test(flavor = "multi_thread")]
    async fn prefixes_keep_stores_apart() {
        let Some(etcd) = Etcd::start("prefixes_keep_stores_apart") else {
            return;
        };
        let a = store(&etcd, "/a").await;
        let b = store(&etcd, "/a/b").await;
        a.put("ns", "k", b"a", Expect::Any).await.expect("put");
        b.put("ns", "k", b"b", Expect::Any).await.expect("put");
        assert_eq!(a.list("ns").await.expect("list").0.len(), 1);
        assert_eq!(a.get("ns", "k").await.expect("get").expect("k").value, b"a");
        assert_eq!(b.get("ns", "k").await.expect("get").expect("k").value, b"b");
        assert!(matches!(
            EtcdStore::connect(EtcdConfig::new(vec![etcd.endpoint(0)], "/trailing/")).await,
            Err(StateError::Invalid(_))
        ));
    }

    /// A killed etcd loses no acknowledged write; while it is down calls fail as
    /// Unavailable; a watch broken by the restart resumes from the last revision seen.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_restart_loses_no_write_and_a_watch_resumes() {
        let Some(mut etcd) = Etcd::start("a_restart_loses_no_write_and_a_watch_resumes") else {
            return;
        };
        let s = store(&etcd, "/dsec-test/restart").await;
        let (_, start) = s.list("ns").await.expect("list");
        let mut w = s.watch("ns", start).await.expect("watch");
        let mut revs = Vec::new();
        for i in 0..20 {
            let key = format!("k{i:02}");
            revs.push(
                s.put("ns", &key, key.as_bytes(), Expect::Any)
                    .await
                    .expect("put"),
            );
        }
        let mut seen = start;
        for r in &revs {
            let e = next_event(&mut w).await.expect("event");
            assert_eq!(e.rev(), *r);
            seen = e.rev();
        }
        etcd.stop(0);
        assert!(matches!(
            s.get("ns", "k00").await,
            Err(StateError::Unavailable(_))
        ));
        // The watch ends with an error, not silently.
        let end = tokio::time::timeout(Duration::from_secs(15), w.next())
            .await
            .expect("the watch notices");
        assert!(
            matches!(end, Some(Err(StateError::Unavailable(_))) | None),
            "{end:?}"
        );
        etcd.start_member(0);
        let (list, rev) = retry(|| s.list("ns")).await;
        assert_eq!(list.len(), 20);
        assert!(list.iter().all(|e| e.key.as_bytes() == e.value.as_slice()));
        assert_eq!(list.iter().map(|e| e.rev).collect::<Vec<_>>(), revs);
        assert_eq!(rev, seen);
        // Resumed from the last revision seen: the next change, nothing repeated.
        let mut w = retry(|| s.watch("ns", seen)).await;
        let r = retry(|| s.put("ns", "after", b"x", Expect::Absent)).await;
        assert_eq!(next_event(&mut w).await.expect("event").rev(), r);
    }

    /// A watch from compacted history reports Compacted (the caller lists again).
    #[tokio::test(flavor = "multi_thread")]
    async fn a_watch_from_compacted_history_reports_compacted() {
        let Some(etcd) = Etcd::start("a_watch_from_compacted_history_reports_compacted") else {
            return;
        };
        let s = store(&etcd, "/dsec-test/compact").await;
        let r1 = s.put("ns", "a", b"1", Expect::Any).await.expect("put");
        let r2 = s.put("ns", "a", b"2", Expect::Any).await.expect("put");
        let mut c = Client::connect(etcd.endpoints(), None)
            .await
            .expect("client");
        c.compact(r2 as i64, None).await.expect("compact");
        let mut w = s.watch("ns", r1 - 1).await.expect("watch");
        let got = tokio::time::timeout(Duration::from_secs(10), w.next())
            .await
            .expect("an answer");
        assert!(matches!(got, Some(Err(StateError::Compacted))), "{got:?}");
        // From the list's revision it works.
        let (_, rev) = s.list("ns").await.expect("list");
        let mut w = s.watch("ns", rev).await.expect("watch");
        let r3 = s.put("ns", "a", b"3", Expect::Rev(r2)).await.expect("put");
        assert_eq!(next_event(&mut w).await.expect("event").rev(), r3);
    }

    /// With three members, losing one (whichever) leaves a store that still reads and
    /// writes, after at most an election.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_three_member_cluster_serves_after_losing_one() {
        let Some(mut etcd) =
            Etcd::start_cluster("a_three_member_cluster_serves_after_losing_one", 3)
        else {
            return;
        };
        let s = store(&etcd, "/dsec-test/ha").await;
        let r = s.put("ns", "k", b"1", Expect::Absent).await.expect("put");
        for lost in 0..2 {
            etcd.stop(lost);
            let value = format!("{}", lost + 2);
            let prev = retry(|| s.get("ns", "k")).await.expect("k").rev;
            assert!(prev >= r);
            retry(|| s.put("ns", "k", value.as_bytes(), Expect::Rev(prev))).await;
            assert_eq!(
                retry(|| s.get("ns", "k")).await.expect("k").value,
                value.as_bytes()
            );
            etcd.start_member(lost);
        }
        wait_until(Duration::from_secs(10), "all members healthy", || {
            let ok = (0..3).all(|i| etcd.is_healthy(i));
            async move { ok }
        })
        .await;
    }

    #[tokio::test]
    async fn an_unreachable_etcd_is_unavailable() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let mut cfg = EtcdConfig::new(vec![format!("http://127.0.0.1:{port}")], "/x");
        cfg.request_timeout = Duration::from_secs(1);
        let r = EtcdStore::connect(cfg).await;
        assert!(matches!(r, Err(StateError::Unavailable(_))), "{r:?}");
    }
}

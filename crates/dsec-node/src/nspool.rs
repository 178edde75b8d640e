//! Namespaces made ahead of creates for sandboxes of network mode `none`: a network
//! namespace with loopback up and, on a node with per-sandbox user namespaces, the user
//! namespace (and uid range) it belongs to.
//!
//! Why: making a network namespace and bringing its loopback up each take the kernel's
//! RTNL lock, which the kernel's own teardown of dead namespaces holds for long batches.
//! On a busy node an init that made its namespace itself queued there for tens of
//! milliseconds (off-CPU profiling of c=32 churn). Filler threads make them instead,
//! off every create's path; a create takes a ready one, or makes its own when the pool
//! is empty.
//!
//! A deleted sandbox's namespaces come back to the pool when nothing of the sandbox is
//! left in them (see [`NetnsPool::give_back`]): a sandbox has no `CAP_NET_ADMIN`, so
//! with its processes and sockets gone its network namespace is as new, bar loopback's
//! traffic counters. Reuse makes and tears down no namespace at all: no RTNL, and the
//! kernel's namespace teardown (a tenth of a churning node's CPU) is gone too.
//!
//! Nothing here outlives the node process: a pooled namespace is held by an fd only, and
//! a pooled uid range is a hold in the node's in-memory [`UidRanges`] that a restart does
//! not remember.

use std::collections::VecDeque;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::Duration;

use crate::userns::{UidRanges, UserNs, UsernsRecord};

/// How long the filler waits after failing to make a namespace.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// Namespaces a sandbox took from the pool, kept by the node until it is deleted.
#[derive(Debug)]
pub struct Lent {
    /// Its network namespace, loopback up.
    pub netns: OwnedFd,
    /// The user namespace that owns it (`None` on a node without user namespaces: the
    /// network namespace is the host's user namespace's).
    pub userns: Option<UserNs>,
}

/// One pooled entry: its namespaces and the key its uid range is held under.
#[derive(Debug)]
struct Entry {
    key: String,
    netns: OwnedFd,
    userns: Option<UserNs>,
}

#[derive(Debug)]
struct Inner {
    target: usize,
    ready: Mutex<VecDeque<Entry>>,
    wake: Condvar,
    stopping: AtomicBool,
    /// The node's uid ranges, when sandboxes get user namespaces of their own.
    ranges: Option<Arc<Mutex<UidRanges>>>,
    next_key: AtomicU64,
    /// Entries a filler is making now.
    making: std::sync::atomic::AtomicUsize,
}

/// Filler threads: making a namespace is mostly waiting for the RTNL lock, so two keep
/// up with a busy node where one does not.
const FILLERS: usize = 2;

/// The pool and its filler threads (stopped on drop).
#[derive(Debug)]
pub struct NetnsPool {
    inner: Arc<Inner>,
    fillers: Vec<std::thread::JoinHandle<()>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl NetnsPool {
    /// Keeps `target` entries ready. With `ranges`, each entry is a user namespace over a
    /// range held from `ranges` and a network namespace it owns; without, a network
    /// namespace of the host's user namespace. `target` 0 makes an empty pool.
    pub fn start(target: usize, ranges: Option<Arc<Mutex<UidRanges>>>) -> Self {
        let inner = Arc::new(Inner {
            target,
            ready: Mutex::new(VecDeque::with_capacity(target)),
            wake: Condvar::new(),
            stopping: AtomicBool::new(false),
            ranges,
            next_key: AtomicU64::new(0),
            making: Default::default(),
        });
        let mut fillers = Vec::new();
        for _ in 0..if target > 0 { FILLERS } else { 0 } {
            let weak = Arc::downgrade(&inner);
            match std::thread::Builder::new()
                .name("dsec-netns-pool".into())
                .spawn(move || fill(weak))
            {
                Ok(h) => fillers.push(h),
                Err(e) => tracing::warn!(error = %e, "namespace pool thread did not start"),
            }
        }
        Self { inner, fillers }
    }

    /// Entries ready now.
    pub fn ready(&self) -> usize {
        lock(&self.inner.ready).len()
    }

    /// Takes an entry for `sandbox`, whose uid range is to be that of `group` (on a node
    /// with user namespaces; the range's record comes with the entry): `None` when the
    /// pool is empty, or when `group` has a range already (its sandboxes share it; the
    /// pooled one is another).
    pub fn take(&self, sandbox: &str, group: &str) -> Option<(Lent, Option<UsernsRecord>)> {
        let entry = lock(&self.inner.ready).pop_front()?;
        self.inner.wake.notify_one();
        let rec = match &self.inner.ranges {
            Some(ranges) => {
                let moved = lock(ranges).transfer(&entry.key, sandbox, group);
                if moved.is_none() {
                    // Back to the pool for a sandbox of another group.
                    lock(&self.inner.ready).push_front(entry);
                    return None;
                }
                moved
            }
            None => None,
        };
        let lent = Lent {
            netns: entry.netns,
            userns: entry.userns,
        };
        Some((lent, rec))
    }

    /// Takes back the namespaces `sandbox` was lent, once its processes are all gone.
    /// They are pooled again when the pool holds less than twice its target, the
    /// sandbox held its uid range alone and nothing of it is left in the network
    /// namespace ([`dsec_net::netns::is_pristine`]); otherwise they are dropped and the
    /// range is released. Returns whether they were pooled.
    pub fn give_back(&self, sandbox: &str, lent: Lent) -> bool {
        let pooled = self.pool_again(sandbox, lent);
        if !pooled {
            if let Some(ranges) = &self.inner.ranges {
                lock(ranges).release(sandbox);
            }
        }
        pooled
    }

    fn pool_again(&self, sandbox: &str, lent: Lent) -> bool {
        // Up to twice the target: reuse is cheaper than anything the fillers make.
        if self.inner.stopping.load(Ordering::SeqCst) || self.ready() >= 2 * self.inner.target {
            return false;
        }
        match dsec_net::netns::is_pristine(lent.netns.as_fd()) {
            Ok(true) => {}
            Ok(false) => return false,
            Err(e) => {
                tracing::debug!(%sandbox, error = %e, "checking a network namespace to reuse");
                return false;
            }
        }
        let key = self.inner.new_key();
        match (&self.inner.ranges, &lent.userns) {
            (Some(ranges), Some(_)) => {
                if lock(ranges).transfer(sandbox, &key, &key).is_none() {
                    return false;
                }
            }
            (None, None) => {}
            _ => return false,
        }
        lock(&self.inner.ready).push_back(Entry {
            key,
            netns: lent.netns,
            userns: lent.userns,
        });
        true
    }

    /// Drops one ready entry and gives its uid range back (when ranges run out). Returns
    /// whether there was one.
    pub fn give_back_one(&self) -> bool {
        let Some(entry) = lock(&self.inner.ready).pop_back() else {
            return false;
        };
        if let Some(ranges) = &self.inner.ranges {
            lock(ranges).release(&entry.key);
        }
        true
    }
}

impl NetnsPool {
    /// Stops the fillers and drops every ready entry (a graceful stop). Entries lent to
    /// sandboxes are not pooled again.
    pub fn stop(&self) {
        self.inner.stopping.store(true, Ordering::SeqCst);
        self.inner.wake.notify_all();
        while self.give_back_one() {}
    }
}

impl Drop for NetnsPool {
    fn drop(&mut self) {
        self.inner.stopping.store(true, Ordering::SeqCst);
        self.inner.wake.notify_all();
        for h in self.fillers.drain(..) {
            let _ = h.join();
        }
        while self.give_back_one() {}
    }
}

/// The filler: tops the pool up to its target, then sleeps until an entry is taken.
fn fill(inner: Weak<Inner>) {
    let mut failing = false;
    loop {
        let Some(pool) = inner.upgrade() else { return };
        if pool.stopping.load(Ordering::SeqCst) {
            return;
        }
        // Claimed under the lock, so two fillers never make more than the target.
        let claimed = {
            let ready = lock(&pool.ready);
            let short = ready.len() + pool.making.load(Ordering::SeqCst) < pool.target;
            if short {
                pool.making.fetch_add(1, Ordering::SeqCst);
            }
            short
        };
        if !claimed {
            let ready = lock(&pool.ready);
            // Woken by a take or by the pool's drop; the timeout only bounds how long a
            // missed wake-up could matter.
            let _ = pool
                .wake
                .wait_timeout_while(ready, Duration::from_secs(5), |r| {
                    r.len() >= pool.target && !pool.stopping.load(Ordering::SeqCst)
                });
            continue;
        }
        match make_entry(&pool) {
            Ok(entry) => {
                failing = false;
                let mut ready = lock(&pool.ready);
                pool.making.fetch_sub(1, Ordering::SeqCst);
                if pool.stopping.load(Ordering::SeqCst) {
                    drop(ready);
                    if let Some(ranges) = &pool.ranges {
                        lock(ranges).release(&entry.key);
                    }
                    return;
                }
                ready.push_back(entry);
            }
            Err(e) => {
                pool.making.fetch_sub(1, Ordering::SeqCst);
                // Once per spell of failures (a node out of uid ranges stays so a while).
                if !std::mem::replace(&mut failing, true) {
                    tracing::warn!(error = %e, "making a pooled network namespace; retrying");
                }
                let ready = lock(&pool.ready);
                let _ = pool.wake.wait_timeout_while(ready, RETRY_AFTER, |_| {
                    !pool.stopping.load(Ordering::SeqCst)
                });
            }
        }
    }
}

impl Inner {
    /// A new key to hold a pooled uid range under.
    fn new_key(&self) -> String {
        format!("pool:{}", self.next_key.fetch_add(1, Ordering::Relaxed))
    }
}

fn make_entry(pool: &Inner) -> std::io::Result<Entry> {
    let key = pool.new_key();
    let Some(ranges) = &pool.ranges else {
        return Ok(Entry {
            key,
            netns: dsec_net::netns::loopback_only()?,
            userns: None,
        });
    };
    let rec = lock(ranges)
        .acquire(&key, &key)
        .map_err(std::io::Error::other)?;
    let made = UserNs::create_with_netns(rec.base, rec.size).and_then(|(ns, net)| {
        dsec_net::netns::loopback_up_in(net.as_fd())?;
        Ok((ns, net))
    });
    match made {
        Ok((ns, netns)) => Ok(Entry {
            key,
            netns,
            userns: Some(ns),
        }),
        Err(e) => {
            lock(ranges).release(&key);
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::userns::{UsernsConfig, UsernsScope};

    fn wait_ready(pool: &NetnsPool, n: usize) {
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while pool.ready() < n {
            assert!(std::time::Instant::now() < until, "pool never reached {n}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn pooled_ranges_move_to_sandboxes_and_back_and_are_freed_with_the_pool() {
        if !dsec_testkit::require_root("nspool") {
            return;
        }
        let cfg = UsernsConfig {
            base: 1_500_000_000,
            ranges: 8,
            scope: UsernsScope::Sandbox,
        };
        let ranges = Arc::new(Mutex::new(UidRanges::new(&cfg)));
        let pool = NetnsPool::start(2, Some(ranges.clone()));
        wait_ready(&pool, 2);
        assert_eq!(lock(&ranges).in_use(), 2, "each entry holds a range");

        let (got, rec) = pool.take("a", "sandbox:a").expect("an entry");
        let rec = rec.expect("a range");
        let ns = got.userns.as_ref().expect("a user namespace");
        assert_eq!(lock(&ranges).held("a"), Some(rec.clone()));
        assert_eq!((rec.group.as_str(), rec.size), ("sandbox:a", 65_536));
        // The network namespace is the user namespace's: its owner is that namespace.
        // SAFETY: NS_GET_USERNS on an open namespace fd returns a new fd or -1.
        let owner = unsafe { libc::ioctl(got.netns.as_raw_fd(), NS_GET_USERNS) };
        assert!(owner >= 0, "{}", std::io::Error::last_os_error());
        // SAFETY: owner is a new fd of ours.
        let owner = unsafe { OwnedFd::from_raw_fd(owner) };
        let ino = |fd: &OwnedFd| {
            std::fs::metadata(format!("/proc/self/fd/{}", fd.as_raw_fd()))
                .expect("stat")
                .ino()
        };
        assert_eq!(
            ino(&owner),
            ino(&ns.fd().try_clone_to_owned().expect("dup"))
        );
        assert!(dsec_net::netns::is_pristine(got.netns.as_fd()).expect("check"));

        // A group that has a range keeps it: the entry stays pooled.
        lock(&ranges).acquire("t1", "label:k=v").expect("label");
        wait_ready(&pool, 2);
        assert!(pool.take("b", "label:k=v").is_none());
        assert_eq!(pool.ready(), 2);

        // Back in the pool: the range is the pool's again.
        assert!(pool.give_back("a", got));
        assert!(lock(&ranges).held("a").is_none());
        assert!(pool.ready() >= 3);
        // A filler started before the give-back may hold one more range for a moment,
        // until its entry is pooled too.
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while lock(&ranges).in_use() != pool.ready() + 1 {
            assert!(
                std::time::Instant::now() < until,
                "ranges in use {} for {} pooled and the label's",
                lock(&ranges).in_use(),
                pool.ready()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        drop(pool);
        assert_eq!(lock(&ranges).in_use(), 1, "only the label's is left");
    }

    #[test]
    fn without_user_namespaces_entries_are_the_hosts() {
        if !dsec_testkit::require_root("nspool") {
            return;
        }
        let pool = NetnsPool::start(1, None);
        wait_ready(&pool, 1);
        let (got, rec) = pool.take("a", "").expect("entry");
        assert!(got.userns.is_none() && rec.is_none());
        assert!(dsec_net::netns::is_pristine(got.netns.as_fd()).expect("check"));
        assert!(
            NetnsPool::start(0, None).take("a", "").is_none(),
            "an empty pool"
        );
    }

    const NS_GET_USERNS: libc::c_ulong = 0xb701;
    use std::os::fd::{AsRawFd, FromRawFd};
    use std::os::unix::fs::MetadataExt;
}

//! The lifetimes of the node's sandboxes (TTL, idle timeout, held) and the stubs of the
//! ones whose lifetime ended, for [`LocalNode`](crate::LocalNode)'s reaper.
//!
//! Times are milliseconds of `CLOCK_BOOTTIME`: monotonic, counting suspend, and the same
//! across node restarts on one boot, so a restarted node keeps each sandbox's remaining
//! TTL. Each sandbox's [`Clocks`] are kept in `lifetime.json` in its run directory, next
//! to its runtime record, and go with it; activity is not kept (a restart counts as
//! activity). A stub is kept as `ended/ID.json` in the state directory until the control
//! plane destroys the sandbox, so it outlives a restart (and a reboot) of the node.
//!
//! Lock order: the node's sandbox table before this one. Stub and lifetime files are
//! written under this lock (they are small), so that a file on disk never outlives its
//! entry.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use dsec_node_api::lifetime::Clocks;
use dsec_node_api::{Lifetime, NodeSandbox};
use dsec_wire::{ApiError, ErrorCode};

use crate::{NodeConfig, NodeError};

/// Name of a sandbox's lifetime file in its run directory.
const LIFETIME_FILE: &str = "lifetime.json";
/// Directory of the stubs, in the state directory.
const ENDED_DIR: &str = "ended";

/// The node's clock, in milliseconds: `CLOCK_BOOTTIME`.
pub fn now_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we pass.
    if unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) } != 0 {
        return 0;
    }
    (ts.tv_sec as u64).saturating_mul(1000) + ts.tv_nsec as u64 / 1_000_000
}

#[derive(Debug, Default)]
struct Table {
    /// Sandboxes the node runs.
    clocks: HashMap<String, Clocks>,
    /// Sandboxes whose lifetime ended, until destroyed.
    ended: HashMap<String, NodeSandbox>,
}

/// Lifetimes and stubs of one node.
#[derive(Debug)]
pub(crate) struct Lifetimes {
    table: Mutex<Table>,
    /// `RUN_DIR/sandboxes`.
    run_root: PathBuf,
    /// `STATE_DIR/ended`.
    ended_dir: PathBuf,
}

/// An operation on a sandbox under way: it is not idle until this drops.
#[derive(Debug)]
pub(crate) struct Activity {
    lifetimes: Arc<Lifetimes>,
    id: String,
}

impl Drop for Activity {
    fn drop(&mut self) {
        if let Some(c) = self.lifetimes.lock().clocks.get_mut(&self.id) {
            c.end_op(now_ms());
        }
    }
}

fn ended_error(id: &str, reason: &str) -> ApiError {
    ApiError::new(
        ErrorCode::NotFound,
        format!("sandbox {id} ended on this node: {reason}"),
    )
}

/// Writes `value` as JSON to `dir/name`, atomically.
fn write_json<T: serde::Serialize>(dir: &Path, name: &str, value: &T) -> Result<(), NodeError> {
    let json = serde_json::to_vec(value).map_err(|e| NodeError::Io {
        op: "serialize",
        path: dir.join(name).display().to_string(),
        source: std::io::Error::other(e),
    })?;
    let tmp = dir.join(format!("{name}.tmp"));
    let path = dir.join(name);
    std::fs::write(&tmp, json).map_err(NodeError::io("write", &tmp))?;
    std::fs::rename(&tmp, &path).map_err(NodeError::io("rename", &path))
}

impl Lifetimes {
    /// Reads the stubs and the lifetimes of the `adopted` sandboxes back (one without a
    /// lifetime file, from an older node, has no limit).
    pub(crate) fn open<'a>(
        cfg: &NodeConfig,
        adopted: impl Iterator<Item = &'a String>,
    ) -> Result<Self, NodeError> {
        Self::open_in(&cfg.run_dir, &cfg.state_dir, adopted)
    }

    fn open_in<'a>(
        run_dir: &Path,
        state_dir: &Path,
        adopted: impl Iterator<Item = &'a String>,
    ) -> Result<Self, NodeError> {
        let run_root = run_dir.join("sandboxes");
        let ended_dir = state_dir.join(ENDED_DIR);
        std::fs::create_dir_all(&ended_dir).map_err(NodeError::io("mkdir", &ended_dir))?;
        let now = now_ms();
        let mut table = Table::default();
        for entry in std::fs::read_dir(&ended_dir).map_err(NodeError::io("read_dir", &ended_dir))? {
            let path = entry.map_err(NodeError::io("read_dir", &ended_dir))?.path();
            if path.extension().is_none_or(|e| e != "json") {
                // A write cut off by a crash.
                let _ = std::fs::remove_file(&path);
                continue;
            }
            let stub = std::fs::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice::<NodeSandbox>(&b).ok());
            match stub {
                Some(stub) if stub.ended.is_some() => {
                    table.ended.insert(stub.id.clone(), stub);
                }
                _ => {
                    tracing::warn!(path = %path.display(), "unreadable stub of an ended sandbox; removed");
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        for id in adopted {
            let path = run_root.join(id).join(LIFETIME_FILE);
            let clocks = match std::fs::read(&path) {
                Ok(b) => match serde_json::from_slice::<Clocks>(&b) {
                    Ok(c) => c.adopted(now),
                    Err(e) => {
                        tracing::warn!(%id, error = %e, "unreadable lifetime; the sandbox has no limit now");
                        Clocks::new(Lifetime::default(), now)
                    }
                },
                Err(_) => Clocks::new(Lifetime::default(), now),
            };
            table.clocks.insert(id.clone(), clocks);
        }
        Ok(Self {
            table: Mutex::new(table),
            run_root,
            ended_dir,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn persist(&self, id: &str, clocks: &Clocks) -> Result<(), NodeError> {
        write_json(&self.run_root.join(id), LIFETIME_FILE, clocks)
    }

    /// A sandbox just created (its run directory exists) with the lifetime it was
    /// created with, counted from `received`.
    pub(crate) fn start(
        &self,
        id: &str,
        lifetime: Lifetime,
        received: u64,
    ) -> Result<(), NodeError> {
        let clocks = Clocks::new(lifetime, received);
        let mut t = self.lock();
        self.persist(id, &clocks)?;
        t.clocks.insert(id.to_string(), clocks);
        Ok(())
    }

    /// Replaces a sandbox's lifetime, counted from now (activity too).
    pub(crate) fn set(&self, id: &str, lifetime: Lifetime) -> Result<(), ApiError> {
        let now = now_ms();
        let mut t = self.lock();
        if let Some(reason) = t.ended.get(id).and_then(|s| s.ended.clone()) {
            return Err(ended_error(id, &reason));
        }
        let Some(c) = t.clocks.get_mut(id) else {
            return Err(NodeError::NotFound(id.to_string()).into());
        };
        let mut next = c.clone();
        next.set(lifetime, now);
        next.touch(now);
        self.persist(id, &next)?;
        *c = next;
        Ok(())
    }

    /// Records that a sandbox was paused or resumed (resuming is activity).
    pub(crate) fn set_paused(&self, id: &str, paused: bool) {
        let now = now_ms();
        let mut t = self.lock();
        let Some(c) = t.clocks.get_mut(id) else {
            return;
        };
        c.paused = paused;
        if !paused {
            c.touch(now);
        }
        if let Err(e) = self.persist(id, c) {
            tracing::warn!(%id, error = %e, "keeping the sandbox's pause state");
        }
    }

    /// An ended sandbox answers `not_found`, with its reason.
    pub(crate) fn check(&self, id: &str) -> Result<(), ApiError> {
        match self.lock().ended.get(id).and_then(|s| s.ended.as_deref()) {
            Some(reason) => Err(ended_error(id, reason)),
            None => Ok(()),
        }
    }

    /// An operation on a sandbox starts: it is activity, and the sandbox is not idle
    /// until the returned guard drops. An ended sandbox answers `not_found`.
    pub(crate) fn activity(self: &Arc<Self>, id: &str) -> Result<Activity, ApiError> {
        let mut t = self.lock();
        if let Some(reason) = t.ended.get(id).and_then(|s| s.ended.as_deref()) {
            return Err(ended_error(id, reason));
        }
        if let Some(c) = t.clocks.get_mut(id) {
            c.begin_op(now_ms());
        }
        Ok(Activity {
            lifetimes: self.clone(),
            id: id.to_string(),
        })
    }

    /// An agent operation starts: as [`Lifetimes::activity`], but a paused sandbox
    /// answers `paused` at once (its frozen agent would hold the call until a resume; a
    /// control plane whose view is a moment old learns the state here).
    pub(crate) fn agent_activity(self: &Arc<Self>, id: &str) -> Result<Activity, ApiError> {
        if self.lock().clocks.get(id).is_some_and(|c| c.paused) {
            return Err(ApiError::new(
                ErrorCode::Paused,
                format!("sandbox {id} is paused: resume it first"),
            ));
        }
        self.activity(id)
    }

    /// Forgets a sandbox being destroyed: its lifetime and its stub.
    pub(crate) fn forget(&self, id: &str) {
        let mut t = self.lock();
        t.clocks.remove(id);
        if t.ended.remove(id).is_some() {
            let path = self.ended_dir.join(format!("{id}.json"));
            if let Err(e) = std::fs::remove_file(&path) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(path = %path.display(), error = %e, "removing a stub");
                }
            }
        }
    }

    /// The sandboxes whose lifetime ran out at `now`, with why.
    pub(crate) fn due(&self, now: u64) -> Vec<(String, &'static str)> {
        self.lock()
            .clocks
            .iter()
            .filter_map(|(id, c)| c.due(now).map(|r| (id.clone(), r)))
            .collect()
    }

    /// Ends a sandbox for `reason`: its lifetime becomes the stub made of `listed`
    /// (kept on disk before anything is torn down). False when it is gone already (a
    /// destroy got there first) or the stub could not be kept.
    pub(crate) fn end(&self, id: &str, reason: &str, mut listed: NodeSandbox) -> bool {
        let now = now_ms();
        let mut t = self.lock();
        let Some(c) = t.clocks.get(id) else {
            return false;
        };
        listed.age_ms = c.age_ms(now);
        listed.idle_ms = c.idle_ms(now);
        listed.ttl_left_ms = None;
        listed.alive = false;
        listed.pid = 0;
        listed.ip = None;
        listed.ended = Some(reason.to_string());
        if let Err(e) = write_json(&self.ended_dir, &format!("{id}.json"), &listed) {
            tracing::warn!(%id, error = %e, "keeping the stub of an ended sandbox; will retry");
            return false;
        }
        t.clocks.remove(id);
        t.ended.insert(id.to_string(), listed);
        true
    }

    /// Fills in `sb`'s clocks; `None` when it ended (its stub is listed instead).
    pub(crate) fn listed(&self, mut sb: NodeSandbox, now: u64) -> Option<NodeSandbox> {
        let t = self.lock();
        if t.ended.contains_key(&sb.id) {
            return None;
        }
        if let Some(c) = t.clocks.get(&sb.id) {
            sb.age_ms = c.age_ms(now);
            sb.idle_ms = c.idle_ms(now);
            sb.ttl_left_ms = c.ttl_left_ms(now);
        }
        Some(sb)
    }

    /// The stubs.
    pub(crate) fn stubs(&self) -> Vec<NodeSandbox> {
        self.lock().ended.values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listed(id: &str) -> NodeSandbox {
        NodeSandbox {
            id: id.into(),
            image_digest: "sha256:x".into(),
            pid: 42,
            alive: true,
            disk_mb: None,
            disk_free_mb: None,
            ip: None,
            age_ms: 0,
            idle_ms: 0,
            ttl_left_ms: None,
            ended: None,
            timings: Vec::new(),
        }
    }

    #[test]
    fn lifetimes_and_stubs_outlive_a_restart_and_destroy_forgets_them() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (run, state) = (dir.path().join("run"), dir.path().join("state"));
        for id in ["a", "b"] {
            std::fs::create_dir_all(run.join("sandboxes").join(id)).expect("mkdir");
        }
        let open = |ids: &[&str]| {
            let ids: Vec<String> = ids.iter().map(|s| s.to_string()).collect();
            Lifetimes::open_in(&run, &state, ids.iter()).expect("open")
        };
        let l = Arc::new(open(&[]));
        let life = Lifetime {
            ttl_ms: Some(60_000),
            idle_timeout_ms: None,
            held: false,
        };
        let t0 = now_ms();
        l.start("a", life, t0).expect("start");
        l.start("b", life, t0.saturating_sub(60_000))
            .expect("start");
        assert_eq!(
            l.due(t0),
            [("b".to_string(), dsec_node_api::lifetime::TTL_ENDED)]
        );
        assert!(l.end("b", dsec_node_api::lifetime::TTL_ENDED, listed("b")));
        assert!(!l.end("b", "again", listed("b")), "ended once");
        let e = l.activity("b").expect_err("ended");
        assert_eq!(e.code, ErrorCode::NotFound);
        assert!(l.listed(listed("b"), t0).is_none(), "listed as its stub");
        drop(l.activity("a").expect("running"));

        let again = open(&["a"]);
        let a = again.listed(listed("a"), now_ms()).expect("running");
        assert!(
            a.ttl_left_ms.is_some_and(|t| t > 50_000 && t <= 60_000),
            "{a:?}"
        );
        let stubs = again.stubs();
        assert_eq!(stubs.len(), 1);
        assert_eq!(
            (
                stubs[0].id.as_str(),
                stubs[0].alive,
                stubs[0].ended.as_deref()
            ),
            ("b", false, Some(dsec_node_api::lifetime::TTL_ENDED))
        );
        again.forget("b");
        assert!(again.stubs().is_empty());
        assert!(open(&[]).stubs().is_empty());
    }
}

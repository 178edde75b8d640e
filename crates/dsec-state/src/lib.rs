//! Control-plane state: a small key-value [`StateStore`] trait with an embedded
//! [`RedbStore`] (the single-node default). A cluster backend (etcd) implements the same
//! trait, so the control plane's logic does not change with the deployment.
//!
//! Keys live in namespaces (`sandboxes`, `keys`, ...); values are opaque bytes (the
//! control plane stores JSON).

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Condvar, Mutex, MutexGuard};

/// A state store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// The backend failed; the message says how.
    #[error("state store: {0}")]
    Backend(String),
}

fn backend<E: std::fmt::Display>(e: E) -> StateError {
    StateError::Backend(e.to_string())
}

/// Durable key-value state shared by control-plane replicas.
pub trait StateStore: Send + Sync + std::fmt::Debug + 'static {
    /// Reads a value.
    fn get(&self, ns: &str, key: &str) -> Result<Option<Vec<u8>>, StateError>;
    /// Writes a value (durably, before returning).
    fn put(&self, ns: &str, key: &str, value: &[u8]) -> Result<(), StateError>;
    /// Deletes a value; deleting a missing key is not an error.
    fn delete(&self, ns: &str, key: &str) -> Result<(), StateError>;
    /// All entries of a namespace, ordered by key.
    fn list(&self, ns: &str) -> Result<Vec<(String, Vec<u8>)>, StateError>;
}

/// The embedded store: one redb file. Namespaces are key prefixes in one table.
///
/// Writes are group-committed: concurrent `put`s and `delete`s queue up while one commit
/// is being made durable, and the next commit takes the whole queue, so N concurrent
/// writers pay for about two fsyncs instead of N. Each call still returns only once its
/// own write is durable.
#[derive(Debug)]
pub struct RedbStore {
    db: redb::Database,
    batch: Mutex<Batch>,
    committed: Condvar,
}

const TABLE: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("state");

fn full_key(ns: &str, key: &str) -> String {
    format!("{ns}/{key}")
}

/// A queued write.
#[derive(Debug)]
enum Write {
    Put(String, Vec<u8>),
    Delete(String),
}

/// Writes waiting for a commit, and how far commits have got.
#[derive(Debug, Default)]
struct Batch {
    /// Queued writes with their sequence numbers, in order.
    queue: Vec<(u64, Write)>,
    /// The sequence number of the next write.
    next: u64,
    /// Every write numbered below this has been committed (or has failed).
    done_below: u64,
    /// A caller is committing a batch now.
    committing: bool,
    /// Errors of failed writes, taken by their callers.
    failed: HashMap<u64, String>,
}

impl RedbStore {
    /// Opens or creates the store at `path`.
    pub fn open(path: &Path) -> Result<Self, StateError> {
        let db = redb::Database::create(path).map_err(backend)?;
        let tx = db.begin_write().map_err(backend)?;
        tx.open_table(TABLE).map_err(backend)?;
        tx.commit().map_err(backend)?;
        Ok(Self {
            db,
            batch: Mutex::new(Batch::default()),
            committed: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Batch> {
        self.batch.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `write` and returns once it is durable: the first caller to find no commit
    /// under way commits everything queued; the others wait for it.
    fn write(&self, write: Write) -> Result<(), StateError> {
        let mut batch = self.lock();
        let seq = batch.next;
        batch.next += 1;
        batch.queue.push((seq, write));
        loop {
            if batch.done_below > seq {
                return match batch.failed.remove(&seq) {
                    Some(e) => Err(StateError::Backend(e)),
                    None => Ok(()),
                };
            }
            if batch.committing {
                batch = self
                    .committed
                    .wait(batch)
                    .unwrap_or_else(|p| p.into_inner());
                continue;
            }
            batch.committing = true;
            let writes = std::mem::take(&mut batch.queue);
            drop(batch);
            let result = self.commit(&writes);
            batch = self.lock();
            batch.committing = false;
            if let Some((last, _)) = writes.last() {
                batch.done_below = last + 1;
            }
            if let Err(e) = result {
                let msg = e.to_string();
                for (s, _) in &writes {
                    batch.failed.insert(*s, msg.clone());
                }
            }
            self.committed.notify_all();
        }
    }

    /// Applies `writes` in order in one durable transaction.
    fn commit(&self, writes: &[(u64, Write)]) -> Result<(), StateError> {
        let tx = self.db.begin_write().map_err(backend)?;
        {
            let mut table = tx.open_table(TABLE).map_err(backend)?;
            for (_, w) in writes {
                match w {
                    Write::Put(k, v) => {
                        table.insert(k.as_str(), v.as_slice()).map_err(backend)?;
                    }
                    Write::Delete(k) => {
                        table.remove(k.as_str()).map_err(backend)?;
                    }
                }
            }
        }
        tx.commit().map_err(backend)
    }
}

impl StateStore for RedbStore {
    fn get(&self, ns: &str, key: &str) -> Result<Option<Vec<u8>>, StateError> {
        let tx = self.db.begin_read().map_err(backend)?;
        let table = tx.open_table(TABLE).map_err(backend)?;
        let value = table.get(full_key(ns, key).as_str()).map_err(backend)?;
        Ok(value.map(|v| v.value().to_vec()))
    }

    fn put(&self, ns: &str, key: &str, value: &[u8]) -> Result<(), StateError> {
        self.write(Write::Put(full_key(ns, key), value.to_vec()))
    }

    fn delete(&self, ns: &str, key: &str) -> Result<(), StateError> {
        self.write(Write::Delete(full_key(ns, key)))
    }

    fn list(&self, ns: &str) -> Result<Vec<(String, Vec<u8>)>, StateError> {
        let tx = self.db.begin_read().map_err(backend)?;
        let table = tx.open_table(TABLE).map_err(backend)?;
        let prefix = format!("{ns}/");
        // '0' is the byte after '/', so this range is exactly the namespace.
        let end = format!("{ns}0");
        let mut out = Vec::new();
        for entry in table
            .range(prefix.as_str()..end.as_str())
            .map_err(backend)?
        {
            let (k, v) = entry.map_err(backend)?;
            out.push((k.value()[prefix.len()..].to_string(), v.value().to_vec()));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crud_and_namespaces_survive_reopen() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.redb");
        {
            let s = RedbStore::open(&path).expect("open");
            s.put("sandboxes", "b", b"2").expect("put");
            s.put("sandboxes", "a", b"1").expect("put");
            s.put("sandboxes0", "x", b"other ns").expect("put");
            s.put("keys", "k", b"v").expect("put");
            s.delete("keys", "k").expect("delete");
            s.delete("keys", "missing").expect("delete missing is ok");
        }
        let s = RedbStore::open(&path).expect("reopen");
        let list = s.list("sandboxes").expect("list");
        assert_eq!(
            list,
            vec![("a".into(), b"1".to_vec()), ("b".into(), b"2".to_vec())]
        );
        assert_eq!(s.get("sandboxes", "a").expect("get"), Some(b"1".to_vec()));
        assert_eq!(s.get("keys", "k").expect("get"), None);
    }

    #[test]
    fn concurrent_writers_are_all_durable_in_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.redb");
        {
            let s = std::sync::Arc::new(RedbStore::open(&path).expect("open"));
            let threads: Vec<_> = (0..16)
                .map(|t| {
                    let s = s.clone();
                    std::thread::spawn(move || {
                        for i in 0..50 {
                            let key = format!("{t}-{i}");
                            s.put("sb", &key, key.as_bytes()).expect("put");
                            // Each thread's own order holds: a put then its delete.
                            if i % 2 == 0 {
                                s.delete("sb", &key).expect("delete");
                            }
                        }
                    })
                })
                .collect();
            for t in threads {
                t.join().expect("join");
            }
        }
        let s = RedbStore::open(&path).expect("reopen");
        let list = s.list("sb").expect("list");
        assert_eq!(list.len(), 16 * 25);
        assert!(list.iter().all(|(k, v)| k.as_bytes() == v.as_slice()));
        assert!(list.iter().all(|(k, _)| k
            .rsplit('-')
            .next()
            .and_then(|i| i.parse::<u32>().ok())
            .is_some_and(|i| i % 2 == 1)));
    }
}

//! Control-plane state: a small key-value [`StateStore`] trait with an embedded
//! [`RedbStore`] (the single-node default). A cluster backend (etcd) implements the same
//! trait, so the control plane's logic does not change with the deployment.
//!
//! Keys live in namespaces (`sandboxes`, `keys`, ...); values are opaque bytes (the
//! control plane stores JSON).

use std::path::Path;

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
#[derive(Debug)]
pub struct RedbStore {
    db: redb::Database,
}

const TABLE: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("state");

fn full_key(ns: &str, key: &str) -> String {
    format!("{ns}/{key}")
}

impl RedbStore {
    /// Opens or creates the store at `path`.
    pub fn open(path: &Path) -> Result<Self, StateError> {
        let db = redb::Database::create(path).map_err(backend)?;
        let tx = db.begin_write().map_err(backend)?;
        tx.open_table(TABLE).map_err(backend)?;
        tx.commit().map_err(backend)?;
        Ok(Self { db })
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
        let tx = self.db.begin_write().map_err(backend)?;
        {
            let mut table = tx.open_table(TABLE).map_err(backend)?;
            table
                .insert(full_key(ns, key).as_str(), value)
                .map_err(backend)?;
        }
        tx.commit().map_err(backend)
    }

    fn delete(&self, ns: &str, key: &str) -> Result<(), StateError> {
        let tx = self.db.begin_write().map_err(backend)?;
        {
            let mut table = tx.open_table(TABLE).map_err(backend)?;
            table.remove(full_key(ns, key).as_str()).map_err(backend)?;
        }
        tx.commit().map_err(backend)
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
}

//! What a node says about itself, and the checks every field passes before anything is
//! written.

use std::collections::{BTreeMap, HashSet};

use dsec_wire::v1::{Isolation, NetworkMode};
use serde::{Deserialize, Serialize};

use crate::FleetError;

/// The label naming a node's pool (`pool=onprem`, `pool=cloud`).
pub const POOL_LABEL: &str = "pool";
/// The pool of a node without a [`POOL_LABEL`].
pub const DEFAULT_POOL: &str = "default";
/// The most layer digests a node reports as cached (it reports its most used ones).
pub const MAX_CACHED_LAYERS: usize = 512;
/// The most labels a node carries.
pub const MAX_LABELS: usize = 32;
/// The longest node name.
pub const MAX_NAME_BYTES: usize = 128;

/// What a node can hold. Placement never puts more than this (times the placer's
/// overcommit) on it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Capacity {
    /// Requested CPU the node admits in total, millicores (its own overcommit applied).
    pub cpu_millis: u64,
    /// Memory the node admits in total, bytes.
    pub memory_bytes: u64,
    /// Most sandboxes it runs (0: no count limit).
    pub max_sandboxes: u64,
}

/// What a node's sandboxes have requested, as of its last heartbeat.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Load {
    /// Requested CPU, millicores.
    pub cpu_millis: u64,
    /// Requested memory, bytes.
    pub memory_bytes: u64,
    /// Sandboxes running or starting.
    pub sandboxes: u64,
}

impl Load {
    /// `self + other`, saturating.
    pub fn plus(self, other: Load) -> Load {
        Load {
            cpu_millis: self.cpu_millis.saturating_add(other.cpu_millis),
            memory_bytes: self.memory_bytes.saturating_add(other.memory_bytes),
            sandboxes: self.sandboxes.saturating_add(other.sandboxes),
        }
    }

    /// `self - other`, saturating at zero.
    pub fn minus(self, other: Load) -> Load {
        Load {
            cpu_millis: self.cpu_millis.saturating_sub(other.cpu_millis),
            memory_bytes: self.memory_bytes.saturating_sub(other.memory_bytes),
            sandboxes: self.sandboxes.saturating_sub(other.sandboxes),
        }
    }
}

/// A node's registration: sent by the node (through an API server) when it starts and
/// after its lease is lost, stored in the `nodes` namespace on the node's lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeRegistration {
    /// Unique node name (`[A-Za-z0-9._-]`, at most [`MAX_NAME_BYTES`]).
    pub name: String,
    /// Base URL of the node's internal API (`http://10.0.0.7:7070`).
    pub url: String,
    /// Labels, e.g. `pool=onprem`.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Isolation levels it can run.
    pub isolation: Vec<Isolation>,
    /// Network modes it can give sandboxes.
    pub network_modes: Vec<NetworkMode>,
    /// What it can hold.
    pub capacity: Capacity,
    /// What its sandboxes have requested now.
    #[serde(default)]
    pub load: Load,
    /// Digests (`sha256:...`) of layers it has cached, at most [`MAX_CACHED_LAYERS`].
    #[serde(default)]
    pub cached_layers: Vec<String>,
    /// The node's dsec version.
    #[serde(default)]
    pub version: String,
    /// A random id drawn when the node process starts ([`new_boot_id`]): a restarted
    /// node is told apart from the one before it.
    pub boot_id: String,
}

/// A fresh boot id for [`NodeRegistration::boot_id`].
pub fn new_boot_id() -> String {
    uuid::Uuid::new_v4().to_string()
}

fn invalid(field: &str, why: impl std::fmt::Display) -> FleetError {
    FleetError::Invalid(format!("{field}: {why}"))
}

/// Checks a node name: 1 to [`MAX_NAME_BYTES`] bytes of `[A-Za-z0-9._-]`, not `.`/`..`.
pub fn check_name(name: &str) -> Result<(), FleetError> {
    if name.is_empty() {
        return Err(invalid("name", "empty"));
    }
    if name.len() > MAX_NAME_BYTES {
        return Err(invalid(
            "name",
            format!("longer than {MAX_NAME_BYTES} bytes"),
        ));
    }
    if name == "." || name == ".." {
        return Err(invalid("name", format!("{name:?} is not a name")));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(invalid(
            "name",
            format!("{name:?} holds {c:?} (allowed: A-Z a-z 0-9 . _ -)"),
        ));
    }
    Ok(())
}

/// Checks a boot id: 1 to 64 bytes of `[A-Za-z0-9-]`.
pub fn check_boot_id(id: &str) -> Result<(), FleetError> {
    if id.is_empty() || id.len() > 64 || !id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
    {
        return Err(invalid(
            "boot_id",
            format!("{id:?} is not 1 to 64 characters of A-Z a-z 0-9 -"),
        ));
    }
    Ok(())
}

fn check_digest(d: &str) -> Result<(), FleetError> {
    let ok = d
        .strip_prefix("sha256:")
        .is_some_and(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()));
    if !ok {
        return Err(invalid(
            "cached_layers",
            format!("{d:?} is not a sha256:<64 hex> digest"),
        ));
    }
    Ok(())
}

/// Checks a list of cached layer digests.
pub fn check_cached_layers(layers: &[String]) -> Result<(), FleetError> {
    if layers.len() > MAX_CACHED_LAYERS {
        return Err(invalid(
            "cached_layers",
            format!(
                "{} digests: at most {MAX_CACHED_LAYERS} (report the most used)",
                layers.len()
            ),
        ));
    }
    layers.iter().try_for_each(|d| check_digest(d))
}

fn check_label(k: &str, v: &str) -> Result<(), FleetError> {
    let key_ok = !k.is_empty()
        && k.len() <= 63
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/'));
    if !key_ok {
        return Err(invalid(
            "labels",
            format!("key {k:?} is not 1 to 63 characters of A-Z a-z 0-9 . _ - /"),
        ));
    }
    let value_ok = v.len() <= 63
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if !value_ok {
        return Err(invalid(
            "labels",
            format!("value {v:?} of {k} is not at most 63 characters of A-Z a-z 0-9 . _ -"),
        ));
    }
    Ok(())
}

impl NodeRegistration {
    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), FleetError> {
        check_name(&self.name)?;
        let url = url::Url::parse(&self.url)
            .map_err(|e| invalid("url", format!("{:?}: {e}", self.url)))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(invalid(
                "url",
                format!("{:?}: the scheme must be http or https", self.url),
            ));
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(invalid("url", format!("{:?} has no host", self.url)));
        }
        if url.query().is_some() || url.fragment().is_some() || !url.username().is_empty() {
            return Err(invalid(
                "url",
                format!(
                    "{:?}: a base URL has no credentials, query or fragment",
                    self.url
                ),
            ));
        }
        if self.labels.len() > MAX_LABELS {
            return Err(invalid("labels", format!("more than {MAX_LABELS}")));
        }
        for (k, v) in &self.labels {
            check_label(k, v)?;
        }
        if self.isolation.is_empty() {
            return Err(invalid(
                "isolation",
                "a node runs at least one isolation level",
            ));
        }
        if self.network_modes.is_empty() {
            return Err(invalid(
                "network_modes",
                "a node offers at least one network mode",
            ));
        }
        if self.capacity.cpu_millis == 0 {
            return Err(invalid("capacity.cpu_millis", "zero"));
        }
        if self.capacity.memory_bytes == 0 {
            return Err(invalid("capacity.memory_bytes", "zero"));
        }
        check_cached_layers(&self.cached_layers)?;
        if self.version.len() > 64 || self.version.chars().any(char::is_control) {
            return Err(invalid("version", "at most 64 printable characters"));
        }
        check_boot_id(&self.boot_id)
    }

    /// The node's pool: its [`POOL_LABEL`], else [`DEFAULT_POOL`].
    pub fn pool(&self) -> &str {
        self.labels
            .get(POOL_LABEL)
            .map_or(DEFAULT_POOL, String::as_str)
    }
}

/// A live node as an API server sees it: its registration (with the load of its last
/// heartbeat), its lease and whether it is drained.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeStatus {
    /// What the node registered, with the load and cache of its last heartbeat.
    pub registration: NodeRegistration,
    /// The node's lease in the store.
    pub lease: i64,
    /// An operator drained it: no new placements.
    pub draining: bool,
    /// [`NodeRegistration::cached_layers`] as a set, for placement.
    pub cached: HashSet<String>,
}

impl NodeStatus {
    /// A status for `registration` (its cache set built).
    pub fn new(registration: NodeRegistration, lease: i64, draining: bool) -> Self {
        let cached = registration.cached_layers.iter().cloned().collect();
        Self {
            registration,
            lease,
            draining,
            cached,
        }
    }

    /// The node's name.
    pub fn name(&self) -> &str {
        &self.registration.name
    }
}

/// The record stored under `nodes/<name>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct NodeRecord {
    pub(crate) registration: NodeRegistration,
    /// The lease the record is bound to (so any replica can check a heartbeat's lease).
    pub(crate) lease: i64,
    /// The node is shutting down: it deregistered, and the record goes with its lease
    /// a moment later (watchers tell a node that left from one that was lost).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) leaving: bool,
}

/// The record stored under `node-admin/<name>`: operator state that outlives
/// registrations.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct AdminRecord {
    pub(crate) draining: bool,
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A valid registration for tests.
    pub(crate) fn reg(name: &str) -> NodeRegistration {
        NodeRegistration {
            name: name.into(),
            url: format!("http://{name}.internal:7070"),
            labels: BTreeMap::new(),
            isolation: vec![Isolation::Container],
            network_modes: vec![NetworkMode::None, NetworkMode::Allowlist, NetworkMode::Open],
            capacity: Capacity {
                cpu_millis: 8000,
                memory_bytes: 16 << 30,
                max_sandboxes: 100,
            },
            load: Load::default(),
            cached_layers: vec![],
            version: "0.1.0".into(),
            boot_id: new_boot_id(),
        }
    }

    #[test]
    fn a_valid_registration_passes() {
        reg("node-1").validate().expect("valid");
    }

    #[test]
    fn each_bad_field_is_named() {
        type Breaker = Box<dyn Fn(&mut NodeRegistration)>;
        let cases: Vec<(&str, Breaker)> = vec![
            ("name", Box::new(|r| r.name.clear())),
            ("name", Box::new(|r| r.name = "a/b".into())),
            ("name", Box::new(|r| r.name = "..".into())),
            ("name", Box::new(|r| r.name = "x".repeat(129))),
            ("url", Box::new(|r| r.url = "not a url".into())),
            ("url", Box::new(|r| r.url = "ftp://h:1".into())),
            ("url", Box::new(|r| r.url = "http://u:p@h:1".into())),
            ("url", Box::new(|r| r.url = "http://h:1/?q=1".into())),
            (
                "labels",
                Box::new(|r| {
                    r.labels.insert("pool".into(), "on prem".into());
                }),
            ),
            (
                "labels",
                Box::new(|r| {
                    r.labels.insert(String::new(), "x".into());
                }),
            ),
            ("isolation", Box::new(|r| r.isolation.clear())),
            ("network_modes", Box::new(|r| r.network_modes.clear())),
            (
                "capacity.cpu_millis",
                Box::new(|r| r.capacity.cpu_millis = 0),
            ),
            (
                "capacity.memory_bytes",
                Box::new(|r| r.capacity.memory_bytes = 0),
            ),
            (
                "cached_layers",
                Box::new(|r| r.cached_layers = vec!["sha256:xyz".into()]),
            ),
            (
                "cached_layers",
                Box::new(|r| {
                    r.cached_layers =
                        vec![format!("sha256:{}", "a".repeat(64)); MAX_CACHED_LAYERS + 1]
                }),
            ),
            ("version", Box::new(|r| r.version = "1\n2".into())),
            ("boot_id", Box::new(|r| r.boot_id.clear())),
            ("boot_id", Box::new(|r| r.boot_id = "a b".into())),
        ];
        for (field, break_it) in cases {
            let mut r = reg("n");
            break_it(&mut r);
            match r.validate() {
                Err(FleetError::Invalid(m)) => {
                    assert!(m.starts_with(&format!("{field}:")), "{field}: {m}")
                }
                other => panic!("{field}: {other:?}"),
            }
        }
    }

    #[test]
    fn the_pool_defaults() {
        let mut r = reg("n");
        assert_eq!(r.pool(), DEFAULT_POOL);
        r.labels.insert(POOL_LABEL.into(), "cloud".into());
        assert_eq!(r.pool(), "cloud");
    }
}

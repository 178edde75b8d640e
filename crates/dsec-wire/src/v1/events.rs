//! Fleet events (`GET /v1/events`): what happened to sandboxes and nodes, with its cause,
//! as a Server-Sent Events stream that a late client can replay from an event's id.
//!
//! An event is written to the state store in the same transaction as the change it
//! tells of (a record's new state, its removal), so it is there exactly when the change
//! is, once, whichever API server made it. Its id is the store revision of that
//! transaction: ids grow, and every server streams the same ids.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// How long events are kept by default (`--events-retention-s`).
pub const DEFAULT_EVENTS_RETENTION_S: u64 = 3600;

/// Events kept at most, whatever their age (the oldest go first).
pub const MAX_EVENTS_KEPT: usize = 100_000;

/// Event streams one tenant may hold open on one API server at once by default (each
/// holds a watch of the store); one more is refused with `quota_exceeded`.
pub const DEFAULT_MAX_EVENT_STREAMS_PER_TENANT: usize = 64;

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// A create stored the sandbox's record (`creating`).
    Created,
    /// The sandbox became `ready` (its create finished).
    Ready,
    /// It was paused.
    Paused,
    /// It was resumed.
    Resumed,
    /// It failed; the cause says why.
    Failed,
    /// Its agent stopped answering; the cause says what the node saw.
    Unhealthy,
    /// Its agent answers again (after `unhealthy`).
    Recovered,
    /// Its node stopped heartbeating (or restarted without it); the event names the node.
    Lost,
    /// Its node came back still running it.
    Found,
    /// Its lifetime ended (TTL or idle timeout) and it was removed; the cause says which.
    Expired,
    /// It was deleted (by a call, or its failed create was cleaned up).
    Deleted,
    /// A command in it was killed by its memory limit.
    OomKilled,
    /// A command's output passed its cap and the excess was dropped.
    OutputTruncated,
    /// Its disk filled up (a command's writes, seen by the node), or a write through the
    /// API failed for want of space.
    DiskFull,
    /// A node was drained (takes no new sandboxes).
    NodeDrained,
    /// A drained node was opened again.
    NodeUndrained,
    /// A node registered: new, restarted, or back after its registration lapsed (the
    /// cause says which this API server saw).
    NodeJoined,
    /// A node stopped heartbeating and its registration lapsed; its sandboxes are
    /// `lost` until it is back.
    NodeLost,
    /// A node shut down (it deregistered).
    NodeLeft,
    /// A warm pool's autoscaler changed its target; the cause says from what to what,
    /// and why.
    PoolScaled,
    /// A claim found no warm sandbox in its pool and had to wait (said once until the
    /// pool has warm sandboxes again).
    PoolExhausted,
    /// A create waited in the capacity queue (or a pool's) for its whole `max_wait_s`
    /// and was refused with `capacity`.
    QueueTimedOut,
}

impl EventKind {
    /// Every kind, in declaration order.
    pub const ALL: [EventKind; 22] = [
        EventKind::Created,
        EventKind::Ready,
        EventKind::Paused,
        EventKind::Resumed,
        EventKind::Failed,
        EventKind::Unhealthy,
        EventKind::Recovered,
        EventKind::Lost,
        EventKind::Found,
        EventKind::Expired,
        EventKind::Deleted,
        EventKind::OomKilled,
        EventKind::OutputTruncated,
        EventKind::DiskFull,
        EventKind::NodeDrained,
        EventKind::NodeUndrained,
        EventKind::NodeJoined,
        EventKind::NodeLost,
        EventKind::NodeLeft,
        EventKind::PoolScaled,
        EventKind::PoolExhausted,
        EventKind::QueueTimedOut,
    ];

    /// The kind's wire name (`oom_killed`).
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Created => "created",
            EventKind::Ready => "ready",
            EventKind::Paused => "paused",
            EventKind::Resumed => "resumed",
            EventKind::Failed => "failed",
            EventKind::Unhealthy => "unhealthy",
            EventKind::Recovered => "recovered",
            EventKind::Lost => "lost",
            EventKind::Found => "found",
            EventKind::Expired => "expired",
            EventKind::Deleted => "deleted",
            EventKind::OomKilled => "oom_killed",
            EventKind::OutputTruncated => "output_truncated",
            EventKind::DiskFull => "disk_full",
            EventKind::NodeDrained => "node_drained",
            EventKind::NodeUndrained => "node_undrained",
            EventKind::NodeJoined => "node_joined",
            EventKind::NodeLost => "node_lost",
            EventKind::NodeLeft => "node_left",
            EventKind::PoolScaled => "pool_scaled",
            EventKind::PoolExhausted => "pool_exhausted",
            EventKind::QueueTimedOut => "queue_timed_out",
        }
    }

    /// Whether the event is about a node (only cluster admins see those).
    pub fn is_node(self) -> bool {
        matches!(
            self,
            EventKind::NodeDrained
                | EventKind::NodeUndrained
                | EventKind::NodeJoined
                | EventKind::NodeLost
                | EventKind::NodeLeft
        )
    }
}

impl std::fmt::Display for EventKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for EventKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        EventKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = EventKind::ALL.iter().map(|k| k.as_str()).collect();
                format!("unknown event kind {s:?}; kinds: {}", names.join(", "))
            })
    }
}

/// One event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Event {
    /// Its id: the store revision that wrote it (0 in an event not yet stored).
    #[serde(default)]
    pub id: u64,
    /// Unix milliseconds.
    pub at_ms: u64,
    /// What happened.
    pub kind: EventKind,
    /// The sandbox it is about.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<String>,
    /// The sandbox's tenant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// The node it is about, or the sandbox's node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// The warm pool it is about (`pool_*` events, a claim's `queue_timed_out`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// The sandbox's labels.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Why, in words (a failure, the end of a lifetime, the node's view).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cause: Option<String>,
    /// The command it is about (`oom_killed`, `output_truncated`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    /// The id of the request that caused it (`x-request-id`), when a request did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
}

/// Query of `GET /v1/events`: every given filter must match.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct EventQuery {
    /// Replays the kept events after this id first (the SSE `Last-Event-ID` header says
    /// the same); without it, only new events. `0` replays everything kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<u64>,
    /// Only this sandbox's events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<String>,
    /// Only this tenant's (a cluster admin's filter; others see only their own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Comma-separated kinds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Comma-separated `key=value` labels the sandbox must carry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// Ends the stream after the replay instead of following (`dsec events` without
    /// `--follow`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_follow: bool,
}

/// An [`EventQuery`] parsed and checked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventFilter {
    /// Only this sandbox.
    pub sandbox: Option<String>,
    /// Only this tenant.
    pub tenant: Option<String>,
    /// Only these kinds (empty: all).
    pub kinds: Vec<EventKind>,
    /// Labels that must match.
    pub labels: BTreeMap<String, String>,
}

impl EventQuery {
    /// The filter it asks for; the error says what is malformed.
    pub fn filter(&self) -> Result<EventFilter, String> {
        let mut kinds = Vec::new();
        for k in split_list(self.kind.as_deref()) {
            kinds.push(k.parse::<EventKind>()?);
        }
        let mut labels = BTreeMap::new();
        for pair in split_list(self.label.as_deref()) {
            let Some((k, v)) = pair.split_once('=') else {
                return Err(format!("label filter {pair:?} is not key=value"));
            };
            if k.is_empty() {
                return Err(format!("label filter {pair:?} has an empty key"));
            }
            labels.insert(k.to_string(), v.to_string());
        }
        Ok(EventFilter {
            sandbox: self.sandbox.clone().filter(|s| !s.is_empty()),
            tenant: self.tenant.clone().filter(|s| !s.is_empty()),
            kinds,
            labels,
        })
    }
}

fn split_list(s: Option<&str>) -> impl Iterator<Item = &str> {
    s.unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
}

impl EventFilter {
    /// Whether `event` passes.
    pub fn matches(&self, event: &Event) -> bool {
        if self
            .sandbox
            .as_ref()
            .is_some_and(|s| event.sandbox.as_ref() != Some(s))
        {
            return false;
        }
        if self
            .tenant
            .as_ref()
            .is_some_and(|t| event.tenant.as_ref() != Some(t))
        {
            return false;
        }
        if !self.kinds.is_empty() && !self.kinds.contains(&event.kind) {
            return false;
        }
        self.labels
            .iter()
            .all(|(k, v)| event.labels.get(k) == Some(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip_by_name() {
        for k in EventKind::ALL {
            assert_eq!(k.as_str().parse::<EventKind>(), Ok(k));
            assert_eq!(
                serde_json::to_string(&k).expect("a kind encodes"),
                format!("\"{}\"", k.as_str())
            );
        }
        let e = "oom".parse::<EventKind>().expect_err("not a kind");
        assert!(e.contains("oom_killed"), "{e}");
    }

    #[test]
    fn a_filter_matches_every_part() {
        let q = EventQuery {
            kind: Some("oom_killed, deleted".into()),
            label: Some("job=7".into()),
            ..Default::default()
        };
        let f = q.filter().expect("a good filter");
        let mut e = Event {
            id: 1,
            at_ms: 0,
            kind: EventKind::Deleted,
            sandbox: Some("sb".into()),
            tenant: Some("t".into()),
            node: None,
            pool: None,
            labels: BTreeMap::from([("job".into(), "7".into())]),
            cause: None,
            command: None,
            request_id: None,
        };
        assert!(f.matches(&e));
        e.kind = EventKind::Ready;
        assert!(!f.matches(&e));
        e.kind = EventKind::Deleted;
        e.labels.clear();
        assert!(!f.matches(&e));
        let bad = EventQuery {
            label: Some("job".into()),
            ..Default::default()
        };
        assert!(bad.filter().expect_err("no =").contains("key=value"));
    }
}

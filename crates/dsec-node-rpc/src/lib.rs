//! The internal API between API servers and nodes: [`server::router`] serves a node's
//! [`NodeApi`](dsec_node_api::NodeApi) over HTTP (what `dsec node` runs), and
//! [`client::RemoteNode`] implements `NodeApi` by calling it (what `dsec apiserver`
//! holds for each node).
//!
//! Every request carries the node token (`Authorization: Bearer ...`), never a user's
//! API key. Bodies are JSON; streams pass through without being buffered whole: file and
//! tar bytes as the raw body, command output and import progress as NDJSON. Errors are
//! the node's [`ApiError`](dsec_wire::ApiError)s with their HTTP status, so a remote
//! node's error is the same value a local one returns.
//!
//! Routes, all under [`PREFIX`]:
//!
//! | route | operation |
//! |---|---|
//! | `GET /info` | name and cgroup version |
//! | `GET /capacity` | capacity and load |
//! | `GET /sandboxes`, `POST /sandboxes` | list, create |
//! | `DELETE /sandboxes/{id}` | destroy |
//! | `POST /sandboxes/{id}/{pause,resume,ping,commit,call,exec,exec-stream}` | |
//! | `PUT /sandboxes/{id}/network` | network policy |
//! | `PUT /sandboxes/{id}/lifetime` | lifetime (TTL, idle timeout, held) |
//! | `GET /sandboxes/{id}/processes/{pid}/output`, `POST .../stdin` | background processes |
//! | `GET`, `PUT /sandboxes/{id}/file?path=` | file bytes (`x-dsec-file-info` header) |
//! | `GET`, `PUT /sandboxes/{id}/tar?path=` | tar archives |
//! | `GET /images`, `GET /image?name=`, `DELETE /image?name=` | images |
//! | `POST /images/import?name=` (body: archive), `POST /images/tag`, `POST /images/gc` | |
//! | `GET /layer-stats` | on-demand layer accounting |
//!
//! The other direction, nodes registering with and heartbeating to API servers, is
//! [`registration`].

pub mod client;
pub mod registration;
pub mod server;

use serde::{Deserialize, Serialize};

/// Path prefix of every route.
pub const PREFIX: &str = "/node/v1";

/// Header carrying a read file's [`FileInfo`](dsec_wire::agent::FileInfo), as base64 of
/// its JSON (file names need not be ASCII).
pub const FILE_INFO_HEADER: &str = "x-dsec-file-info";

/// `GET /info`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// Node name.
    pub name: String,
    /// `v1` or `v2`.
    pub cgroup_version: String,
}

/// `POST /sandboxes/{id}/exec` and `/exec-stream`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExecCall {
    /// The command.
    pub spec: dsec_wire::agent::ExecSpec,
    /// Its whole stdin, base64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin_b64: Option<String>,
    /// Record it under this request id ([`dsec_node_api::NodeApi::exec_recorded`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
}

/// `POST /sandboxes/{id}/commit`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CommitCall {
    /// Name of the new image.
    pub name: String,
    /// Layers of the sandbox's earlier commits.
    pub previous_diffs: Vec<String>,
    /// The image's config.
    pub config: dsec_wire::v1::ImageConfig,
}

/// Reply of `commit`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CommitReply {
    /// The image.
    pub image: dsec_wire::v1::Image,
    /// The new layer, if anything changed.
    pub diff: Option<String>,
}

/// Reply of `pause`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct PauseReply {
    /// Memory in use before the pause.
    pub before: u64,
    /// Memory in use after reclaim.
    pub after: u64,
}

/// `POST /images/tag`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TagCall {
    /// Existing image.
    pub source: String,
    /// New name.
    pub name: String,
    /// Config of the new name; default the source's.
    #[serde(default)]
    pub config: Option<dsec_wire::v1::ImageConfig>,
}

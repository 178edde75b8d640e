//! Batch jobs (`/v1/batches`, `dsec submit job.yaml`): many tasks of one environment,
//! each run in a sandbox of its own with inputs placed from the blob store first and
//! declared outputs collected to it after.
//!
//! Collection is two-phase, so an output is only ever taken whole and verified: the
//! sandbox's agent hashes each output (sha256), then the server copies it to the blob
//! store, hashing as it copies, and compares. Only a task whose every output matched is
//! `finalized`, and only then is its sandbox deleted; an exit code alone never finishes a
//! task. A task's states: `pending → creating → initialized → running → collecting →
//! finalized`, or `failed` once its retries are spent.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{CreateSandboxRequest, Priority};
use crate::agent::Command;
use crate::Base64Bytes;

/// Label naming the batch of every sandbox a batch runs (set by the server).
pub const BATCH_LABEL: &str = "dsec-batch";
/// Label naming the task and attempt (`<task>.<attempt>`) of a batch's sandbox.
pub const BATCH_TASK_LABEL: &str = "dsec-batch-task";
/// Most tasks in one batch.
pub const MAX_BATCH_TASKS: usize = 100_000;
/// Most bytes of one inline input (`data` or `text`).
pub const MAX_INLINE_INPUT: usize = 1024 * 1024;
/// Most declared outputs (and inputs) of one task.
pub const MAX_TASK_FILES: usize = 64;
/// Largest output file collected, bytes.
pub const MAX_OUTPUT_BYTES: u64 = 1 << 30;
/// Most tasks of one batch running at once.
pub const MAX_PARALLELISM: u32 = 256;
/// Lines of output kept in an error snapshot.
pub const SNAPSHOT_LINES: usize = 100;

/// `POST /v1/batches` (and the YAML of `dsec submit`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct BatchSpec {
    /// A name for people (need not be unique).
    #[serde(default)]
    pub name: Option<String>,
    /// The sandbox every task runs in: any create request (image, resources, network,
    /// env...), or one naming a `pool` to claim warm sandboxes from.
    #[serde(default)]
    pub template: CreateSandboxRequest,
    /// Defaults of every task; each may override.
    #[serde(default)]
    pub defaults: TaskDefaults,
    /// The tasks: ids unique within the batch, at most [`MAX_BATCH_TASKS`].
    pub tasks: Vec<TaskSpec>,
    /// Tasks running at once. Default 8, at most [`MAX_PARALLELISM`].
    #[serde(default)]
    pub parallelism: Option<u32>,
    /// Place of the batch's creates among those waiting for capacity.
    #[serde(default)]
    pub priority: Priority,
}

/// What every task of a batch gets unless it says otherwise.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct TaskDefaults {
    /// The command (argv, or a string for `/bin/sh -c`).
    #[serde(default)]
    pub command: Option<Command>,
    /// Environment of the command (a task's own entries win).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory of the command.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Limit of one attempt's command, seconds. Default 600.
    #[serde(default)]
    pub timeout_s: Option<u64>,
    /// Attempts after a failed one. Default 2.
    #[serde(default)]
    pub retries: Option<u32>,
    /// Absolute paths in the sandbox collected after a successful command.
    #[serde(default)]
    pub outputs: Vec<String>,
}

/// One task of a batch.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct TaskSpec {
    /// `[A-Za-z0-9._-]{1,128}`, unique within the batch.
    pub id: String,
    /// The command; default the batch's.
    #[serde(default)]
    pub command: Option<Command>,
    /// Environment added to the batch's.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory; default the batch's.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Files placed before the command: absolute path in the sandbox → content.
    #[serde(default)]
    pub inputs: BTreeMap<String, InputRef>,
    /// Outputs; default the batch's.
    #[serde(default)]
    pub outputs: Option<Vec<String>>,
    /// Limit of one attempt, seconds; default the batch's.
    #[serde(default)]
    pub timeout_s: Option<u64>,
    /// Attempts after a failed one; default the batch's.
    #[serde(default)]
    pub retries: Option<u32>,
}

/// Where an input's bytes come from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum InputRef {
    /// An object uploaded before with `PUT /v1/inputs/{key}` (the tenant's inputs).
    Blob(String),
    /// Bytes carried in the spec (base64), at most [`MAX_INLINE_INPUT`].
    Data(Base64Bytes),
    /// Text carried in the spec, at most [`MAX_INLINE_INPUT`].
    Text(String),
}

/// `PUT /v1/inputs/{key}`: what was stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct InputObject {
    /// The key, as a task's `blob` input names it.
    pub key: String,
    /// sha256 of the bytes, hex.
    pub sha256: String,
    /// Size in bytes.
    pub bytes: u64,
}

/// A task's place in its life.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum TaskState {
    /// Waiting for a turn (or for its next attempt).
    #[default]
    Pending,
    /// Its sandbox is being created.
    Creating,
    /// Its sandbox is up and its inputs are placed.
    Initialized,
    /// Its command runs.
    Running,
    /// Its outputs are being hashed, copied and verified.
    Collecting,
    /// Done: every output is in the blob store, verified.
    Finalized,
    /// Given up: the last attempt's error (and snapshot) say why.
    Failed,
}

impl TaskState {
    /// Every state, in order.
    pub const ALL: [TaskState; 7] = [
        TaskState::Pending,
        TaskState::Creating,
        TaskState::Initialized,
        TaskState::Running,
        TaskState::Collecting,
        TaskState::Finalized,
        TaskState::Failed,
    ];

    /// Its name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            TaskState::Pending => "pending",
            TaskState::Creating => "creating",
            TaskState::Initialized => "initialized",
            TaskState::Running => "running",
            TaskState::Collecting => "collecting",
            TaskState::Finalized => "finalized",
            TaskState::Failed => "failed",
        }
    }

    /// The state named `s`.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|st| st.as_str() == s)
    }

    /// Whether the task is done for good.
    pub fn is_terminal(self) -> bool {
        matches!(self, TaskState::Finalized | TaskState::Failed)
    }
}

/// One collected output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct OutputRecord {
    /// Its key in the blob store.
    pub key: String,
    /// sha256, hex: the agent's, and the copy's (they matched).
    pub sha256: String,
    /// Size in bytes.
    pub bytes: u64,
}

/// Digest of a placed input.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct InputDigest {
    /// Its key in the blob store.
    pub key: String,
    /// sha256, hex.
    pub sha256: String,
    /// Size in bytes.
    pub bytes: u64,
}

/// A task as resolved at submit: the batch's defaults applied, inputs in the store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ResolvedTask {
    /// The command's argv.
    pub command: Vec<String>,
    /// Its environment (batch defaults and the task's own).
    pub env: BTreeMap<String, String>,
    /// Its working directory.
    pub cwd: Option<String>,
    /// Sandbox path → the input placed there.
    pub inputs: BTreeMap<String, InputDigest>,
    /// Outputs collected.
    pub outputs: Vec<String>,
    /// Limit of one attempt, seconds.
    pub timeout_s: u64,
    /// Attempts after a failed one.
    pub retries: u32,
}

/// A task's status (`GET /v1/batches/{id}/tasks`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct TaskStatus {
    /// The task's id.
    pub id: String,
    /// Where it is.
    pub state: TaskState,
    /// Number of its current (or last) attempt, from 1; 0 before the first.
    pub attempt: u32,
    /// Attempts that failed (an attempt a server restart interrupted is not one).
    pub failures: u32,
    /// The sandbox of the current attempt.
    pub sandbox_id: Option<String>,
    /// Its node.
    pub node: Option<String>,
    /// Exit code of the last command.
    pub exit_code: Option<i32>,
    /// Signal that ended the last command.
    pub signal: Option<i32>,
    /// Whether the last command hit its timeout.
    pub timed_out: bool,
    /// When the current attempt started, ms since the epoch.
    pub started_at_ms: Option<u64>,
    /// When the task reached `finalized` or `failed`.
    pub ended_at_ms: Option<u64>,
    /// Collected outputs by sandbox path (`finalized` only).
    pub outputs: BTreeMap<String, OutputRecord>,
    /// Why the last attempt failed.
    pub error: Option<String>,
    /// Blob key of the last abnormal exit's [`ErrorSnapshot`].
    pub error_snapshot: Option<String>,
}

impl TaskStatus {
    /// A task not yet started.
    pub fn new(id: &str) -> Self {
        Self {
            id: id.to_string(),
            state: TaskState::Pending,
            attempt: 0,
            failures: 0,
            sandbox_id: None,
            node: None,
            exit_code: None,
            signal: None,
            timed_out: false,
            started_at_ms: None,
            ended_at_ms: None,
            outputs: BTreeMap::new(),
            error: None,
            error_snapshot: None,
        }
    }
}

/// Saved beside the outputs when an attempt's command ends abnormally.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ErrorSnapshot {
    /// The task.
    pub task: String,
    /// The attempt.
    pub attempt: u32,
    /// Exit code, if it exited.
    pub exit_code: Option<i32>,
    /// Signal, if one ended it.
    pub signal: Option<i32>,
    /// Whether the memory limit killed it.
    pub oom_killed: bool,
    /// Whether it hit its timeout.
    pub timed_out: bool,
    /// Last lines of its stdout, at most [`SNAPSHOT_LINES`].
    pub stdout_tail: Vec<String>,
    /// Last lines of its stderr.
    pub stderr_tail: Vec<String>,
    /// Names (not values) of its environment variables.
    pub env_names: Vec<String>,
    /// How long it ran, ms.
    pub duration_ms: u64,
}

/// Whether a batch still runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum BatchState {
    /// Tasks are being run.
    #[default]
    Running,
    /// Every task is finalized or failed.
    Finished,
    /// Cancelled: tasks not finished then failed with `cancelled`.
    Cancelled,
}

/// A batch (`GET /v1/batches/{id}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Batch {
    /// Its id (`bt-...`).
    pub id: String,
    /// Its name.
    pub name: Option<String>,
    /// The tenant it runs for.
    pub tenant: String,
    /// Running, finished or cancelled.
    pub state: BatchState,
    /// Submitted, ms since the epoch.
    pub created_at_ms: u64,
    /// Finished or cancelled.
    pub ended_at_ms: Option<u64>,
    /// Number of tasks.
    pub total: u64,
    /// Tasks per state (every state present).
    pub counts: BTreeMap<TaskState, u64>,
    /// Tasks running at once.
    pub parallelism: u32,
    /// Its priority.
    pub priority: Priority,
    /// Image the tasks run (the template's, or its pool's).
    pub image: Option<String>,
    /// Its digest at submit.
    pub image_digest: Option<String>,
}

/// `GET /v1/batches`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct BatchList {
    /// The tenant's batches, newest first.
    pub batches: Vec<Batch>,
}

/// `GET /v1/batches/{id}/tasks?state=&after=&limit=`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct TaskList {
    /// Tasks in id order.
    pub tasks: Vec<TaskStatus>,
    /// Pass as `after` for the next page; absent on the last.
    pub next: Option<String>,
}

/// `?state=&after=&limit=` of `GET /v1/batches/{id}/tasks`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct TaskListQuery {
    /// Only tasks in this state.
    #[serde(default)]
    pub state: Option<String>,
    /// Only tasks whose id sorts after this one (the previous page's `next`).
    #[serde(default)]
    pub after: Option<String>,
    /// Page size, default 1000, at most 10 000.
    #[serde(default)]
    pub limit: Option<usize>,
}

/// One task in a batch's manifest: what ran (as resolved at submit) and its status
/// (state, attempt, node, sandbox, times, outputs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ManifestTask {
    /// What it runs.
    pub spec: ResolvedTask,
    /// Where it is, and where its last attempt ran.
    #[serde(flatten)]
    pub status: TaskStatus,
}

/// `GET /v1/batches/{id}/manifest`: enough to rerun any task one-to-one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct Manifest {
    /// The batch.
    pub batch: Batch,
    /// The sandbox template.
    pub template: CreateSandboxRequest,
    /// Image layers (digests) of the template's image at submit, base first.
    pub layers: Vec<String>,
    /// Every task.
    pub tasks: Vec<ManifestTask>,
}

/// Whether `id` may name a task: `[A-Za-z0-9._-]{1,128}`.
pub fn valid_task_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// The last `n` lines of `text` (a trailing newline ends the last line, it does not
/// start an empty one).
pub fn tail_lines(text: &str, n: usize) -> Vec<String> {
    let text = text.strip_suffix('\n').unwrap_or(text);
    if text.is_empty() {
        return Vec::new();
    }
    let lines: Vec<&str> = text.split('\n').collect();
    lines[lines.len().saturating_sub(n)..]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_file_parses_with_inputs_of_each_kind() {
        let spec: BatchSpec = serde_json::from_value(serde_json::json!({
            "name": "judge",
            "template": {"image": "base"},
            "defaults": {"command": "python3 /in/main.py", "outputs": ["/out/r.json"]},
            "tasks": [{"id": "t-1", "inputs": {
                "/in/a": {"blob": "sets/a.txt"},
                "/in/b": {"text": "hello"},
                "/in/c": {"data": "aGk="},
            }}],
            "priority": "low",
        }))
        .expect("spec");
        let inputs = &spec.tasks[0].inputs;
        assert_eq!(inputs["/in/a"], InputRef::Blob("sets/a.txt".into()));
        assert_eq!(inputs["/in/b"], InputRef::Text("hello".into()));
        assert_eq!(inputs["/in/c"], InputRef::Data(b"hi".to_vec().into()));
        assert_eq!(spec.priority, Priority::Low);
        let unknown = serde_json::from_value::<BatchSpec>(serde_json::json!({
            "tasks": [], "paralelism": 3,
        }));
        assert!(unknown.is_err(), "a misspelt field is refused");
    }

    #[test]
    fn task_ids_and_states() {
        assert!(valid_task_id("task-0001.a_b"));
        for bad in ["", "a/b", "a b", "../x", &"x".repeat(129)] {
            assert!(!valid_task_id(bad), "{bad:?}");
        }
        for st in TaskState::ALL {
            assert_eq!(TaskState::parse(st.as_str()), Some(st));
            let json = serde_json::to_string(&st).expect("json");
            assert_eq!(json, format!("\"{}\"", st.as_str()));
        }
        assert!(TaskState::Failed.is_terminal() && !TaskState::Collecting.is_terminal());
    }

    #[test]
    fn tails_keep_the_last_lines() {
        assert_eq!(tail_lines("a\nb\nc\n", 2), vec!["b", "c"]);
        assert_eq!(tail_lines("a\nb", 5), vec!["a", "b"]);
        assert!(tail_lines("", 3).is_empty());
        let many: String = (0..300).map(|i| format!("{i}\n")).collect();
        let tail = tail_lines(&many, SNAPSHOT_LINES);
        assert_eq!(tail.len(), 100);
        assert_eq!(tail[0], "200");
    }
}

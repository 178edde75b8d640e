//! The node <-> agent protocol.
//!
//! A unix-socket connection carries one request at a time. The node sends a [`Request`]
//! as a JSON frame, followed by `Data` frames and an `Eof` frame when the request takes
//! input (stdin, file upload, tar upload). The agent answers with frames as listed on each
//! variant; then, if [`Request::keeps_connection`], it waits on the same connection for
//! the next request (the node may keep it for one), else it closes the connection. An [`Reply::Error`] may replace any reply; for an
//! upload the agent may send it before it has read all the input (a full disk answers at
//! the first `ENOSPC`), so the node stops sending when its writes fail and reads the reply.
//!
//! Exec output shape: `Started` (only with `stream`), then `Stdout`/`Stderr` data frames,
//! then `Exited`. Without `stream` the agent keeps only the last `output_limit` bytes per
//! stream in a ring and sends them after exit; with `stream` it forwards output live.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::ApiError;

/// Version the agent reports in `Pong`; bumped when the protocol changes.
/// 2: a connection carries further requests after one that
/// [`keeps_connection`](Request::keeps_connection).
/// 3: [`Request::ExecKept`], commands that outlive their connection.
pub const PROTOCOL_VERSION: u32 = 3;

/// The first [`PROTOCOL_VERSION`] whose agents serve more than one request per
/// connection; the node keeps connections only to these (an older agent closes each
/// connection after its reply, and may not have yet when the next request is sent).
pub const KEEPS_CONNECTIONS_SINCE: u32 = 2;

/// Environment variable that carries the id of the API request that started a command
/// (`x-request-id`) into it: the node adds it to the environment of an exec or a process
/// start (unless the caller set it), so the agent, the command and what the command logs
/// can name the request.
pub const REQUEST_ID_ENV: &str = "DSEC_REQUEST_ID";

/// The environment variable that gives a command the W3C trace context (`traceparent`)
/// of the request that runs it, as OpenTelemetry's environment carriers name it.
pub const TRACEPARENT_ENV: &str = "TRACEPARENT";

/// Default cap on recorded output per stream (4 MiB).
pub const DEFAULT_OUTPUT_LIMIT: u64 = 4 * 1024 * 1024;

/// What to run: an argv vector (`["ls","-l"]`) or a shell string (`"ls | wc -l"`, run by
/// `/bin/sh -c`). In JSON an array is argv, a string is a shell command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(untagged)]
pub enum Command {
    /// Program and arguments, executed directly (looked up in PATH).
    Argv(Vec<String>),
    /// A shell command line for `/bin/sh -c`.
    Shell(String),
}

impl Command {
    /// The argv that the agent executes.
    pub fn to_argv(&self) -> Vec<String> {
        match self {
            Command::Argv(v) => v.clone(),
            Command::Shell(s) => vec!["/bin/sh".into(), "-c".into(), s.clone()],
        }
    }

    /// A short human-readable rendering.
    pub fn display(&self) -> String {
        match self {
            Command::Argv(v) => v.join(" "),
            Command::Shell(s) => s.clone(),
        }
    }
}

/// A one-shot command execution.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ExecSpec {
    /// What to run.
    pub cmd: Command,
    /// Extra environment variables (added to the sandbox's defaults).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory inside the sandbox; default `/`.
    #[serde(default)]
    pub cwd: Option<String>,
    /// If true, the node sends stdin as `Data` frames then `Eof` after the request.
    /// Otherwise stdin is `/dev/null`.
    #[serde(default)]
    pub stdin: bool,
    /// Kill the whole process group after this many milliseconds.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Forward output live instead of keeping a ring and sending it at exit.
    #[serde(default)]
    pub stream: bool,
    /// Ring size per stream for non-streaming exec; default [`DEFAULT_OUTPUT_LIMIT`].
    #[serde(default)]
    pub output_limit: Option<u64>,
    /// User to run as: a name from the sandbox's `/etc/passwd`, or `UID[:GID]`; default:
    /// the sandbox's user.
    #[serde(default)]
    pub user: Option<String>,
}

/// How a process ended.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ExitInfo {
    /// Exit code if the process exited normally.
    pub exit_code: Option<i32>,
    /// Signal number if it was killed by a signal.
    pub signal: Option<i32>,
    /// Wall time from spawn to exit.
    pub duration_ms: u64,
    /// True if the agent killed it because `timeout_ms` elapsed.
    pub timed_out: bool,
    /// Total bytes the process wrote to stdout (including any dropped by the ring).
    pub stdout_bytes: u64,
    /// Total bytes the process wrote to stderr.
    pub stderr_bytes: u64,
    /// True if stdout output was dropped because it exceeded the ring.
    pub stdout_truncated: bool,
    /// True if stderr output was dropped because it exceeded the ring.
    pub stderr_truncated: bool,
}

/// Terminal size for a PTY.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct PtySize {
    /// Rows.
    pub rows: u16,
    /// Columns.
    pub cols: u16,
}

/// A background process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct ProcessSpec {
    /// What to run.
    pub cmd: Command,
    /// Extra environment variables.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory; default `/`.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Run under a PTY of this size (stdout and stderr merge into stdout).
    #[serde(default)]
    pub pty: Option<PtySize>,
    /// A caller-chosen label to find the process again.
    #[serde(default)]
    pub tag: Option<String>,
    /// Ring size per stream; default [`DEFAULT_OUTPUT_LIMIT`].
    #[serde(default)]
    pub output_limit: Option<u64>,
    /// Kill the process group after this many milliseconds.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// User to run as: a name from the sandbox's `/etc/passwd`, or `UID[:GID]`; default:
    /// the sandbox's user.
    #[serde(default)]
    pub user: Option<String>,
}

/// State of a background process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct ProcessInfo {
    /// Process id inside the sandbox.
    pub pid: u32,
    /// Caller's label.
    pub tag: Option<String>,
    /// The command as given.
    pub cmd: Command,
    /// Whether it runs under a PTY.
    pub pty: bool,
    /// Exit information once it ended; `None` while running.
    pub exit: Option<ExitInfo>,
    /// Total stdout bytes so far (the next offset to read from).
    pub stdout_bytes: u64,
    /// Total stderr bytes so far.
    pub stderr_bytes: u64,
}

/// Information about a shell session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct SessionInfo {
    /// Session id.
    pub session: String,
    /// Pid of the session's shell.
    pub pid: u32,
    /// Whether a command is running in it now.
    pub busy: bool,
}

/// Result of one command in a session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct SessionResult {
    /// Merged stdout and stderr of the command (lossy UTF-8).
    pub output: String,
    /// Exit code of the command (`$?`); 130 after an interrupt.
    pub exit_code: i32,
    /// True if the per-command timeout fired and the command was interrupted.
    pub timed_out: bool,
    /// True if output beyond the cap was dropped.
    pub truncated: bool,
    /// Wall time of the command.
    pub duration_ms: u64,
}

/// Kind of a file system entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    /// Regular file.
    File,
    /// Directory.
    Dir,
    /// Symbolic link (not followed).
    Symlink,
    /// Anything else (fifo, socket, device).
    Other,
}

/// Metadata of one file system entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct FileInfo {
    /// Base name.
    pub name: String,
    /// Absolute path inside the sandbox.
    pub path: String,
    /// Entry kind.
    pub kind: FileKind,
    /// Size in bytes.
    pub size: u64,
    /// Permission bits (e.g. 0o644).
    pub mode: u32,
    /// Modification time, seconds since the epoch.
    pub mtime: i64,
    /// Owner uid.
    pub uid: u32,
    /// Owner gid.
    pub gid: u32,
    /// Target of a symlink.
    pub symlink_target: Option<String>,
}

/// Most input one function call may carry: stdin and files together (they travel in one
/// JSON frame, base64-encoded).
pub const CALL_INPUT_LIMIT: usize = 2 * 1024 * 1024;

/// Default and most output a function call keeps per stream (the last bytes).
pub const CALL_OUTPUT_LIMIT: u64 = 1024 * 1024;

/// Most bytes of files a function call may fetch back, together.
pub const CALL_FETCH_LIMIT: u64 = 512 * 1024;

/// One function call (FnCall): a command run in a private, throw-away view of the
/// sandbox. The agent starts it in new mount, PID and IPC namespaces whose root is an
/// overlay of the sandbox's root with an empty upper layer: the call's writes, processes
/// and IPC objects vanish with it, and the next call starts from the same state. Needs a
/// sandbox created for calls (its agent keeps a helper that can make namespaces).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct CallSpec {
    /// What to run.
    pub cmd: Command,
    /// Extra environment variables (added to the sandbox's defaults).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory; default: the sandbox's.
    #[serde(default)]
    pub cwd: Option<String>,
    /// User to run as (name or `UID[:GID]`); default: the sandbox's user.
    #[serde(default)]
    pub user: Option<String>,
    /// The command's whole standard input; none: `/dev/null`.
    #[serde(default)]
    pub stdin: Option<crate::Base64Bytes>,
    /// Files written before the command starts (parents created), by path; relative
    /// paths are taken from the working directory.
    #[serde(default)]
    pub files: BTreeMap<String, crate::Base64Bytes>,
    /// Regular files read back after the command ended (relative to the working
    /// directory), at most [`CALL_FETCH_LIMIT`] bytes together.
    #[serde(default)]
    pub fetch: Vec<String>,
    /// Kill the call (everything it started) after this many milliseconds.
    pub timeout_ms: u64,
    /// Address-space limit of every process of the call (`RLIMIT_AS`), bytes.
    #[serde(default)]
    pub memory_limit_bytes: Option<u64>,
    /// Output kept per stream (the last bytes); default and most [`CALL_OUTPUT_LIMIT`].
    #[serde(default)]
    pub output_limit: Option<u64>,
    /// A step run first in the same view (a compiler): the command runs only if it
    /// exits 0. Its own timeout; its output is kept apart.
    #[serde(default)]
    pub compile: Option<CompileSpec>,
}

/// The compile step of a call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct CompileSpec {
    /// What to run.
    pub cmd: Command,
    /// Kill it (and what it started) after this many milliseconds.
    pub timeout_ms: u64,
}

/// How a call's compile step ended.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct CompileResult {
    /// Its exit (`timed_out` when its timeout killed it).
    pub exit: ExitInfo,
    /// Its standard output (the last [`CALL_OUTPUT_LIMIT`] / 4 bytes).
    pub stdout: crate::Base64Bytes,
    /// Its standard error (likewise).
    pub stderr: crate::Base64Bytes,
}

/// A file a call asked for back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct FetchedFile {
    /// Its bytes, when it could be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<crate::Base64Bytes>,
    /// Why it could not be read (missing, not a regular file, over the limit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// How a function call ended.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct CallResult {
    /// The compile step, if the call had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compile: Option<CompileResult>,
    /// Whether the command ran (not when its compile step failed or setup did).
    #[serde(default)]
    pub ran: bool,
    /// Exit of the command (its `timed_out` set when the timeout killed it).
    pub exit: ExitInfo,
    /// Its standard output (the last `output_limit` bytes).
    pub stdout: crate::Base64Bytes,
    /// Its standard error (the last `output_limit` bytes).
    pub stderr: crate::Base64Bytes,
    /// The files asked for, by the path as asked.
    #[serde(default)]
    pub files: BTreeMap<String, FetchedFile>,
    /// Set when the command never started: a file that could not be written, a missing
    /// working directory or program. The call's own mistake; the sandbox is fine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub setup_error: Option<String>,
    /// Set when the sandbox should not serve another call: its helper is gone, the call's
    /// namespaces could not be made, or something outlived the call's end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub anomaly: Option<String>,
    /// Microseconds from the request to the command's start (namespaces, overlay, mounts).
    pub setup_us: u64,
    /// Microseconds from the command's end to every process of the call gone and the
    /// namespaces released: the reset between two calls.
    pub teardown_us: u64,
}

/// A request from node to agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Liveness. Reply: `Pong`.
    Ping,
    /// Run a command. Reply: `Started` (with `stream`), output frames, `Exited`.
    Exec(ExecSpec),
    /// Run a command kept under `key` (a node's request id): unlike [`Request::Exec`] it
    /// outlives the connection, and a later `ExecKept` with the same key attaches to it
    /// instead of starting another. The first request with a key starts `spec` (its
    /// stdin, if any, follows as `Data` frames then `Eof`, as for `Exec`); an attach
    /// sends `spec: None` (or any spec, and its input is discarded), and a key the agent
    /// does not know answers `not_found` instead of running anything. Reply: with
    /// `stream`, `Started` then the output from its first kept byte and live until the
    /// exit; without it, the kept output once it exited; then `Exited`. An `Error` first
    /// means nothing started. Like an exec, what is
    /// left of its process group dies when it exits.
    ExecKept {
        /// The caller's key; one command per key for the agent's lifetime.
        key: String,
        /// What to run, if not running yet.
        #[serde(default)]
        spec: Option<ExecSpec>,
        /// Forward output live (from the first kept byte) instead of after the exit.
        #[serde(default)]
        stream: bool,
    },
    /// Start a persistent bash session. Reply: `SessionCreated`.
    SessionCreate {
        /// Session id chosen by the caller.
        session: String,
        /// Environment for the shell.
        #[serde(default)]
        env: BTreeMap<String, String>,
        /// Initial working directory.
        #[serde(default)]
        cwd: Option<String>,
        /// User the shell runs as (name or `UID[:GID]`); default: the sandbox's user.
        #[serde(default)]
        user: Option<String>,
    },
    /// Run one command in a session. Reply: `SessionResult`.
    SessionRun {
        /// Session id.
        session: String,
        /// Command line, interpreted by the session's bash.
        command: String,
        /// Interrupt the command (SIGINT, then SIGKILL of its group) after this long.
        #[serde(default)]
        timeout_ms: Option<u64>,
    },
    /// Send SIGINT to the command running in a session. Reply: `Ok`.
    SessionInterrupt {
        /// Session id.
        session: String,
    },
    /// Kill a session's shell. Reply: `Ok`.
    SessionClose {
        /// Session id.
        session: String,
    },
    /// Reply: `Sessions`.
    SessionList,
    /// Start a background process. Reply: `ProcessStarted`.
    ProcessStart(ProcessSpec),
    /// Reply: `Processes`.
    ProcessList,
    /// Read a process's recorded output from byte offsets. Reply: `OutputStart`, then
    /// output frames; with `follow`, live output until the process exits; then `Exited`
    /// if it has exited, or `OutputEnd` if it still runs.
    ProcessOutput {
        /// Process id.
        pid: u32,
        /// First stdout byte wanted (0 = from the beginning of what the ring holds).
        #[serde(default)]
        stdout_offset: u64,
        /// First stderr byte wanted.
        #[serde(default)]
        stderr_offset: u64,
        /// Keep streaming until the process exits.
        #[serde(default)]
        follow: bool,
    },
    /// Write to a process's stdin: `Data` frames follow, then `Eof`. If `close` is set,
    /// stdin is closed after the data. Reply: `Ok`.
    ProcessStdin {
        /// Process id.
        pid: u32,
        /// Close stdin after writing.
        #[serde(default)]
        close: bool,
    },
    /// Send a signal to a process's group. Reply: `Ok`.
    ProcessSignal {
        /// Process id.
        pid: u32,
        /// Signal number.
        signal: i32,
    },
    /// Resize a process's PTY. Reply: `Ok`.
    ProcessResize {
        /// Process id.
        pid: u32,
        /// New size.
        size: PtySize,
    },
    /// Read a file. Reply: `File` (its metadata), then `Data` frames, then `Eof`.
    FileRead {
        /// Path inside the sandbox.
        path: String,
        /// Start offset.
        #[serde(default)]
        offset: u64,
        /// Maximum bytes to read; default to the end.
        #[serde(default)]
        length: Option<u64>,
    },
    /// Write a file from `Data` frames ending with `Eof`. Reply: `Written`.
    /// The file is written to a temporary name and renamed into place, so a failed or
    /// interrupted upload leaves the old file intact.
    FileWrite {
        /// Path inside the sandbox.
        path: String,
        /// Permission bits for a new file; default 0o644.
        #[serde(default)]
        mode: Option<u32>,
        /// Create missing parent directories.
        #[serde(default)]
        create_parents: bool,
    },
    /// List a directory. Reply: `Entries`.
    FileList {
        /// Directory path.
        path: String,
    },
    /// Stat a path without following a final symlink. Reply: `File`.
    FileStat {
        /// Path.
        path: String,
    },
    /// sha256 of a regular file, not following a final symlink. Reply: `Hashed`.
    FileHash {
        /// Path.
        path: String,
    },
    /// Create a directory and its parents (`mkdir -p`). Reply: `Ok`.
    FileMkdir {
        /// Path.
        path: String,
    },
    /// Remove a file or directory. Reply: `Ok`.
    FileRemove {
        /// Path.
        path: String,
        /// Remove a non-empty directory recursively.
        #[serde(default)]
        recursive: bool,
    },
    /// Rename within the sandbox. Reply: `Ok`.
    FileRename {
        /// Source path.
        from: String,
        /// Destination path.
        to: String,
    },
    /// Download a directory as a tar stream. Reply: `Data` frames, then `Eof`.
    TarDownload {
        /// Directory path.
        path: String,
    },
    /// Extract a tar stream (`Data` frames then `Eof`) into a directory, which is created
    /// if missing. Entries that would land outside it are rejected. Reply: `Written`.
    TarUpload {
        /// Destination directory.
        path: String,
    },
    /// Run one function call (see [`CallSpec`]). Reply: `Called`.
    Call(CallSpec),
}

impl Request {
    /// Whether the connection may carry another request once this one's reply is read:
    /// true for requests without an input phase, whose exchange always ends at a frame
    /// boundary (an upload answered early with an error may leave input unread).
    pub fn keeps_connection(&self) -> bool {
        match self {
            Request::Exec(spec) => !spec.stdin,
            Request::ExecKept { spec, .. } => spec.as_ref().is_none_or(|s| !s.stdin),
            Request::ProcessStdin { .. }
            | Request::FileWrite { .. }
            | Request::TarUpload { .. } => false,
            _ => true,
        }
    }
}

/// A reply from agent to node (JSON frames).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum Reply {
    /// Answer to `Ping`.
    Pong {
        /// [`PROTOCOL_VERSION`].
        version: u32,
        /// The agent's pid inside the sandbox (1 when it is init).
        pid: u32,
    },
    /// The process was spawned.
    Started {
        /// Its pid inside the sandbox.
        pid: u32,
    },
    /// The process ended; last frame of an exec or of a followed output stream.
    Exited(ExitInfo),
    /// A session was created.
    SessionCreated {
        /// Session id.
        session: String,
        /// Shell pid.
        pid: u32,
    },
    /// Result of `SessionRun`.
    SessionResult(SessionResult),
    /// Answer to `SessionList`.
    Sessions {
        /// Open sessions.
        sessions: Vec<SessionInfo>,
    },
    /// A background process was started.
    ProcessStarted(ProcessInfo),
    /// Answer to `ProcessList`.
    Processes {
        /// Known processes, running and exited.
        processes: Vec<ProcessInfo>,
    },
    /// Start of `ProcessOutput`: where the returned bytes begin. If the requested
    /// offset fell out of the ring, the data starts later and `*_truncated` is set.
    OutputStart {
        /// Offset of the first stdout byte that follows.
        stdout_offset: u64,
        /// Offset of the first stderr byte that follows.
        stderr_offset: u64,
        /// Requested stdout bytes were lost to the ring.
        stdout_truncated: bool,
        /// Requested stderr bytes were lost to the ring.
        stderr_truncated: bool,
    },
    /// End of a non-following `ProcessOutput` on a running process.
    OutputEnd {
        /// Next stdout offset to ask for.
        stdout_offset: u64,
        /// Next stderr offset to ask for.
        stderr_offset: u64,
    },
    /// Metadata of one file.
    File(FileInfo),
    /// Directory listing.
    Entries {
        /// Entries sorted by name.
        entries: Vec<FileInfo>,
    },
    /// Bytes written by an upload.
    Written {
        /// Count of bytes.
        bytes: u64,
    },
    /// Result of `FileHash`.
    Hashed {
        /// sha256 of the file's bytes, hex.
        sha256: String,
        /// Bytes hashed.
        size: u64,
    },
    /// Success without data.
    Ok,
    /// Result of `Call`.
    Called(CallResult),
    /// The request failed.
    Error(ApiError),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_json_forms() {
        let argv: Command = serde_json::from_str(r#"["ls","-l"]"#).expect("argv");
        assert_eq!(argv.to_argv(), vec!["ls", "-l"]);
        let shell: Command = serde_json::from_str(r#""echo hi | wc""#).expect("shell");
        assert_eq!(shell.to_argv(), vec!["/bin/sh", "-c", "echo hi | wc"]);
    }

    #[test]
    fn request_is_tagged_and_strict() {
        let r: Request = serde_json::from_str(r#"{"op":"file_stat","path":"/etc"}"#).expect("ok");
        assert_eq!(
            r,
            Request::FileStat {
                path: "/etc".into()
            }
        );
        let bad = serde_json::from_str::<Request>(r#"{"op":"file_stat","path":"/","x":1}"#);
        assert!(bad.is_err(), "unknown fields must be rejected");
        let ping = serde_json::to_string(&Request::Ping).expect("ser");
        assert_eq!(ping, r#"{"op":"ping"}"#);
    }
}

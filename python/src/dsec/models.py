"""Pydantic models of the dsec v1 wire types (``crates/dsec-wire/src/v1.rs`` and ``agent.rs``).

Response models accept (and keep) fields they do not know, so a newer server does not
break an older SDK. Times are unix milliseconds; durations name their unit.
"""

from __future__ import annotations

from typing import Any, Annotated, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "Resources",
    "EffectiveResources",
    "SandboxInfo",
    "PauseResult",
    "JobSandboxOutcome",
    "JobResult",
    "ExecResult",
    "StartedEvent",
    "StdoutEvent",
    "StderrEvent",
    "ExitEvent",
    "EndEvent",
    "ErrorEvent",
    "ExecEvent",
    "SessionInfo",
    "SessionResult",
    "FileInfo",
    "WriteResult",
    "Image",
    "Health",
    "ApiErrorBody",
]


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class Resources(BaseModel):
    """Requested resource limits; absent fields take the node's defaults."""

    model_config = ConfigDict(extra="forbid")

    cpu: Optional[float] = None
    """CPU limit in cores (0.5, 2). Default 1."""
    memory_mb: Optional[int] = None
    """Memory limit in MiB. Default 512."""
    pids: Optional[int] = None
    """Maximum number of processes/threads. Default 512."""
    disk_mb: Optional[int] = None
    """Size of the writable layer in MiB."""


class EffectiveResources(_Response):
    """The limits a sandbox actually got."""

    cpu: float
    memory_mb: int
    pids: int
    disk_mb: Optional[int] = None


class Network(BaseModel):
    """A sandbox's network policy (wire type ``NetworkPolicy``)."""

    mode: str = "none"
    """``none`` (loopback only), ``allowlist`` or ``open``."""
    allow: List[str] = Field(default_factory=list)
    """Allowed destinations of an allowlist: ``pypi.org:443``, ``*.pythonhosted.org``,
    ``10.0.0.0/8``, ``192.0.2.7:80``."""


class ModelAccess(BaseModel):
    """What code in a sandbox may call through the model gateway (wire type
    ``ModelAccess``): the sandbox gets a token of its own in ``OPENAI_API_KEY`` and the
    gateway's URL in ``OPENAI_BASE_URL``, so an unmodified ``openai`` client works."""

    model_config = ConfigDict(extra="forbid")

    models: List[str]
    """The gateway's model names it may call."""
    budget_tokens: Optional[int] = None
    """Model tokens it may spend in all (then 429 ``insufficient_quota``)."""
    rpm: Optional[int] = None
    """Requests per minute."""
    tpm: Optional[int] = None
    """Model tokens per minute."""
    max_concurrency: Optional[int] = None
    """Requests in flight at once."""
    timeout_s: Optional[int] = None
    """Seconds one request may take."""


class PhaseTiming(_Response):
    """One phase of a create (wire type ``PhaseTiming``)."""

    phase: str
    """``validate``, ``placement``, ``images``, ``store``, then the node's ``admit``,
    ``layers``, ``disk``, ``namespaces``, ``cgroup``, ``network``, ``init``, ``agent``,
    then ``node_call`` (the round trip beyond them), ``files``, ``commit``."""
    start_ms: float
    """From the create's start."""
    ms: float


class CreateTimings(_Response):
    """Where a create's time went (wire type ``CreateTimings``): its phases back to back."""

    total_ms: float
    phases: List[PhaseTiming] = Field(default_factory=list)

    def by_phase(self) -> Dict[str, float]:
        """Milliseconds per phase name (summed if one repeats)."""
        out: Dict[str, float] = {}
        for p in self.phases:
            out[p.phase] = out.get(p.phase, 0.0) + p.ms
        return out


class Event(_Response):
    """One fleet event (wire type ``Event``, from ``GET /v1/events``)."""

    id: int
    """Grows with every event; pass it as ``after`` to resume after it."""
    at_ms: int
    kind: str
    """``created``, ``ready``, ``paused``, ``resumed``, ``failed``, ``unhealthy``,
    ``recovered``, ``lost``, ``found``, ``expired``, ``deleted``, ``oom_killed``,
    ``output_truncated``, ``disk_full``, ``node_drained``, ``node_undrained``,
    ``node_joined``, ``node_lost``, ``node_left``, ``pool_scaled``, ``pool_exhausted``,
    ``queue_timed_out``."""
    sandbox: Optional[str] = None
    tenant: Optional[str] = None
    node: Optional[str] = None
    pool: Optional[str] = None
    labels: Dict[str, str] = Field(default_factory=dict)
    cause: Optional[str] = None
    command: Optional[str] = None
    request_id: Optional[str] = None


class AuditEntry(_Response):
    """One audited call (wire type ``AuditEntry``)."""

    at_ms: int
    request_id: Optional[str] = None
    tenant: Optional[str] = None
    key_id: Optional[str] = None
    method: str
    path: str
    sandbox: Optional[str] = None
    status: int
    error: Optional[str] = None
    duration_ms: int
    remote: Optional[str] = None


class AuditList(_Response):
    """Answer of ``GET /v1/audit``: entries oldest first."""

    entries: List[AuditEntry] = Field(default_factory=list)
    truncated: bool = False


class SandboxInfo(_Response):
    """A sandbox as the API reports it (wire type ``Sandbox``)."""

    id: str
    tenant: str = "default"
    """The tenant it belongs to (the API key's)."""
    state: str
    """``creating``, ``ready``, ``paused``, ``stopping``, ``failed``, ``unhealthy`` (its
    agent stopped answering; it goes back to ``ready`` when the agent answers again) or
    ``lost`` (its node stopped heartbeating; it comes back if the node returns with it)."""
    image: str
    qos: str = "latency_sensitive"
    isolation: str = "container"
    """``container``, ``oci``, ``gvisor``, ``microvm`` or ``vm``."""
    auto_resume: bool = False
    layers: List[str] = Field(default_factory=list)
    image_digest: str = ""
    backend: str = "container"
    resources: Optional[EffectiveResources] = None
    labels: Dict[str, str] = Field(default_factory=dict)
    created_at: int = 0
    expires_at: int = 0
    idle_timeout_s: Optional[int] = None
    last_active_at: int = 0
    failure: Optional[str] = None
    unhealthy_cause: Optional[str] = None
    """What the node saw of its agent, for ``unhealthy``."""
    unhealthy_since: Optional[int] = None
    disk_full_since: Optional[int] = None
    """Since when (unix ms) its disk is full (writes fail with ``ENOSPC``); ``None`` once
    space is freed."""
    lost_since: Optional[int] = None
    """Since when it is ``lost`` (unix ms)."""
    lost_from: Optional[str] = None
    """The state it goes back to when its node returns still running it."""
    node: str = ""
    job_suspended_at: Optional[int] = None
    committed_layers: List[str] = Field(default_factory=list)
    network: Network = Field(default_factory=Network)
    ip: Optional[str] = None
    """Its IPv4 address, when networked."""
    filesystem: Dict[str, Any] = Field(default_factory=dict)
    """Its file rules (``{"writable": [...]}``)."""
    model_access: Optional[ModelAccess] = None
    """What it may call through the model gateway, if created with ``model_access``."""
    model_token_id: Optional[str] = None
    """The public id of its gateway token (the token itself is in its environment)."""
    timings: Optional[CreateTimings] = None
    """Where its create's time went (in the create's answer only when asked for with
    ``timings=True``; the record keeps the phases up to its last write)."""


class PauseResult(_Response):
    """Answer of ``POST /v1/sandboxes/{id}/pause``."""

    sandbox: SandboxInfo
    memory_before_bytes: int
    memory_after_bytes: int


class ApiErrorBody(_Response):
    """The inner object of an error body."""

    code: str
    message: str


class JobSandboxOutcome(_Response):
    """What happened to one sandbox in a job suspend or resume."""

    id: str
    state: str
    error: Optional[ApiErrorBody] = None
    memory_before_bytes: int = 0
    memory_after_bytes: int = 0


class JobResult(_Response):
    """Answer of ``POST /v1/jobs/{job}/suspend`` and ``.../resume``."""

    job: str
    sandboxes: List[JobSandboxOutcome]


class ExecResult(_Response):
    """Result of a non-streaming exec."""

    stdout: str
    stderr: str
    exit_code: Optional[int] = None
    """Exit status, or ``None`` when a signal ended the process."""
    signal: Optional[int] = None
    duration_ms: int = 0
    timed_out: bool = False
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    oom_killed: bool = False

    @property
    def ok(self) -> bool:
        """True when the command exited with status 0."""
        return self.exit_code == 0


class CallRecord(_Response):
    """One call of a sandbox's call log: a call that carried a request id."""

    seq: int
    """Its place in the log, from 1."""
    request_id: str
    kind: str
    """What it was: ``exec``, ``session_run``, ``process_start``, ``file_write`` or
    ``tar_upload``."""
    args: Dict[str, Any] = Field(default_factory=dict)
    """Its arguments as the node ran them (stdin as ``stdin_bytes``, its length)."""
    started_at_ms: int
    ended_at_ms: Optional[int] = None
    state: str
    """``running``, ``done`` or ``lost`` (its outcome could not be learnt)."""
    exit: Optional[Dict[str, Any]] = None
    """How its command ended: ``exit_code``, ``signal``, ``duration_ms``, byte counts."""
    oom_killed: bool = False
    error: Optional[Dict[str, Any]] = None
    output_dropped: bool = False
    stdout: Optional[str] = None
    """Its kept stdout, when the log was read with ``output=True``."""
    stderr: Optional[str] = None
    reply: Optional[Dict[str, Any]] = None
    """The answer of a session command, a process start or an upload, with ``output=True``."""
    body_sha256: Optional[str] = None
    """SHA-256 (hex) of the bytes an upload wrote."""


class CallLog(_Response):
    """A page of a sandbox's call log, oldest first."""

    calls: List[CallRecord] = Field(default_factory=list)
    next_after: Optional[int] = None
    """Pass as ``after`` for the next page; ``None`` on the last."""


class StartedEvent(_Response):
    """The process started."""

    type: Literal["started"]
    pid: int


class StdoutEvent(_Response):
    """A chunk of stdout (UTF-8, invalid sequences replaced)."""

    type: Literal["stdout"]
    data: str


class StderrEvent(_Response):
    """A chunk of stderr."""

    type: Literal["stderr"]
    data: str


class ExitEvent(_Response):
    """The process ended; the last event of an exec stream."""

    type: Literal["exit"]
    exit_code: Optional[int] = None
    signal: Optional[int] = None
    duration_ms: int = 0
    timed_out: bool = False
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    oom_killed: bool = False


class ProcessExit(_Response):
    """How a background process ended."""

    exit_code: Optional[int] = None
    signal: Optional[int] = None
    duration_ms: int = 0
    timed_out: bool = False


class ProcessInfo(_Response):
    """A background process (``POST/GET /v1/sandboxes/{id}/processes``)."""

    pid: int
    tag: Optional[str] = None
    cmd: Any = None
    pty: bool = False
    exit: Optional[ProcessExit] = None
    """``None`` while it runs."""
    stdout_bytes: int = 0
    stderr_bytes: int = 0


class EndEvent(_Response):
    """Output position at the end of a non-following read of a running process."""

    type: Literal["end"]
    stdout_offset: int
    stderr_offset: int


class ErrorEvent(_Response):
    """The stream failed."""

    type: Literal["error"]
    error: ApiErrorBody


ExecEvent = Annotated[
    Union[StartedEvent, StdoutEvent, StderrEvent, ExitEvent, EndEvent, ErrorEvent],
    Field(discriminator="type"),
]
"""One line of an NDJSON exec stream, discriminated by ``type``."""


class SessionInfo(_Response):
    """A persistent shell session."""

    session: str
    pid: int = 0
    busy: bool = False


class SessionResult(_Response):
    """Result of one command run in a session."""

    output: str
    """Combined stdout and stderr."""
    exit_code: int
    timed_out: bool = False
    truncated: bool = False
    duration_ms: int = 0

    @property
    def ok(self) -> bool:
        """True when the command exited with status 0."""
        return self.exit_code == 0


class FileInfo(_Response):
    """Metadata of one file system entry in a sandbox."""

    name: str
    path: str
    kind: str
    """``file``, ``dir``, ``symlink`` or ``other``."""
    size: int
    mode: int
    mtime: int
    uid: int = 0
    gid: int = 0
    symlink_target: Optional[str] = None


class WriteResult(_Response):
    """Answer of a file upload."""

    bytes: int


class Image(_Response):
    """An image known to the node."""

    name: str
    digest: str
    size_bytes: int = 0
    created_at: int = 0
    source: str = ""
    layers: List[str] = Field(default_factory=list)
    config: Dict[str, Any] = Field(default_factory=dict)


class IsolationLevel(_Response):
    """An isolation level the node offers (wire type ``IsolationLevel``)."""

    isolation: str
    runtime: Optional[str] = None
    platform: Optional[str] = None
    """gVisor's platform: ``systrap``, ``ptrace`` or ``kvm``."""


class Health(_Response):
    """Answer of ``GET /v1/health``."""

    status: str
    version: str = ""
    node: str = ""
    cgroup: str = ""
    sandboxes: int = 0
    isolation: List[IsolationLevel] = Field(default_factory=list)

"""dsec: Python SDK for the dsec sandbox platform.

Quick start::

    import dsec

    with dsec.Sandbox.create(image="base") as sb:        # deleted on exit
        r = sb.exec(["python3", "-c", "print(6*7)"])
        assert r.stdout == "42\\n"

The default client reads ``DSEC_URL`` and ``DSEC_API_KEY`` (or ``DSEC_API_KEY_FILE``).
Every API error is raised as a subclass of :class:`DsecError` named after its code.
"""

from .client import API_KEY_HEADER, DEFAULT_URL, Client, default_client
from .errors import (
    ERROR_CLASSES,
    AgentUnavailable,
    BadRequest,
    Capacity,
    Conflict,
    ConnectionFailed,
    DsecError,
    Expired,
    Failed,
    Forbidden,
    ImageNotFound,
    Internal,
    InvalidPath,
    NoSpace,
    NotFound,
    PayloadTooLarge,
    MethodNotAllowed,
    Paused,
    QuotaExceeded,
    Lost,
    Unavailable,
    Timeout,
    Unauthorized,
)
from .models import (
    AuditEntry,
    AuditList,
    CallLog,
    CallRecord,
    CreateTimings,
    Network,
    EndEvent,
    ErrorEvent,
    Event,
    ExecEvent,
    ExecResult,
    ExitEvent,
    FileInfo,
    Health,
    Image,
    IsolationLevel,
    JobResult,
    JobSandboxOutcome,
    ModelAccess,
    PauseResult,
    PhaseTiming,
    ProcessExit,
    ProcessInfo,
    Resources,
    SandboxInfo,
    SessionInfo,
    SessionResult,
    StartedEvent,
    StderrEvent,
    StdoutEvent,
)
from .sandbox import Process, Sandbox, Session, resume_job, suspend_job
from . import aio
from .aio import AsyncClient, AsyncProcess, AsyncSandbox, AsyncSession

__version__ = "0.1.0"

__all__ = [
    "Client",
    "default_client",
    "DEFAULT_URL",
    "API_KEY_HEADER",
    "Sandbox",
    "ModelAccess",
    "CreateTimings",
    "PhaseTiming",
    "Event",
    "AuditEntry",
    "AuditList",
    "Session",
    "Process",
    "suspend_job",
    "AsyncClient",
    "AsyncSandbox",
    "AsyncSession",
    "AsyncProcess",
    "resume_job",
    # errors
    "DsecError",
    "BadRequest",
    "Unauthorized",
    "Forbidden",
    "NotFound",
    "Expired",
    "Failed",
    "Conflict",
    "ImageNotFound",
    "Capacity",
    "Timeout",
    "InvalidPath",
    "NoSpace",
    "PayloadTooLarge",
    "MethodNotAllowed",
    "Paused",
    "AgentUnavailable",
    "Internal",
    "QuotaExceeded",
    "Lost",
    "Unavailable",
    "ConnectionFailed",
    "ERROR_CLASSES",
    # models
    "Network",
    "Resources",
    "SandboxInfo",
    "PauseResult",
    "JobResult",
    "JobSandboxOutcome",
    "ExecResult",
    "CallRecord",
    "CallLog",
    "ExecEvent",
    "StartedEvent",
    "StdoutEvent",
    "StderrEvent",
    "ExitEvent",
    "EndEvent",
    "ErrorEvent",
    "SessionInfo",
    "SessionResult",
    "ProcessInfo",
    "ProcessExit",
    "FileInfo",
    "Image",
    "Health",
    "IsolationLevel",
]

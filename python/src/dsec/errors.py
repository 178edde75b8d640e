"""Typed errors of the dsec API.

Every error response of the server has the body
``{"error": {"code": "...", "message": "..."}}``; the SDK raises the subclass of
:class:`DsecError` that matches ``code``. Transport failures (connection refused, reset)
are raised as :class:`ConnectionFailed`.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Type

__all__ = [
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
    "error_from_body",
    "ERROR_CLASSES",
]


class DsecError(Exception):
    """Base class of every error the SDK raises.

    Attributes:
        code: The API's stable error code (``"not_found"``, ...).
        message: The server's human-readable explanation.
        status: The HTTP status, if the error came from a response.
        retryable: Whether the same request may succeed if retried later.
        request_id: The server's id of the request (its ``x-request-id``), to find it
            in the server's log; ``None`` if the error did not come from the server.
    """

    code: str = "unknown"
    retryable: bool = False

    def __init__(
        self,
        message: str,
        *,
        code: Optional[str] = None,
        status: Optional[int] = None,
        request_id: Optional[str] = None,
    ) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        self.status = status
        self.request_id = request_id

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class BadRequest(DsecError):
    """The request is malformed or a field is out of range (HTTP 400)."""

    code = "bad_request"


class Unauthorized(DsecError):
    """Missing or invalid API key (HTTP 401)."""

    code = "unauthorized"


class Forbidden(DsecError):
    """The API key is valid but may not do this: it lacks the scope, or its tenant is
    disabled (HTTP 403)."""

    code = "forbidden"


class NotFound(DsecError):
    """No such sandbox, session, process or file (HTTP 404)."""

    code = "not_found"


class Expired(DsecError):
    """The sandbox's lifetime ran out and it was removed (HTTP 410)."""

    code = "expired"


class Failed(DsecError):
    """The sandbox failed (creation error, its init died) (HTTP 500)."""

    code = "failed"


class Conflict(DsecError):
    """The sandbox's state does not allow the call (HTTP 409)."""

    code = "conflict"


class ImageNotFound(DsecError):
    """The named image is unknown (HTTP 404)."""

    code = "image_not_found"


class Capacity(DsecError):
    """The node has no capacity for the request now; retry later (HTTP 503)."""

    code = "capacity"
    retryable = True


class Timeout(DsecError):
    """The operation did not finish in time (HTTP 504)."""

    code = "timeout"
    retryable = True


class InvalidPath(DsecError):
    """A path escapes the sandbox root or is otherwise invalid (HTTP 400)."""

    code = "invalid_path"


class NoSpace(DsecError):
    """The sandbox's disk or a size limit was exceeded (HTTP 507)."""

    code = "no_space"


class PayloadTooLarge(DsecError):
    """The request body is too large (HTTP 413)."""

    code = "payload_too_large"


class Paused(DsecError):
    """The sandbox is paused; resume it first (or create it with ``auto_resume``) (HTTP 409)."""

    code = "paused"


class AgentUnavailable(DsecError):
    """The in-sandbox agent could not be reached (HTTP 500)."""

    code = "agent_unavailable"
    retryable = True


class Internal(DsecError):
    """An unexpected server-side error (HTTP 500)."""

    code = "internal"


class MethodNotAllowed(DsecError):
    """The route exists, but not with this HTTP method (HTTP 405)."""

    code = "method_not_allowed"


class QuotaExceeded(DsecError):
    """A tenant quota (sandboxes, CPU, memory, creates per second) would be exceeded;
    retry after usage drops or the rate refills, not at once (HTTP 429)."""

    code = "quota_exceeded"
    retryable = True


class Lost(DsecError):
    """The sandbox's node stopped heartbeating: the sandbox is ``lost`` until the node
    returns still running it (HTTP 502)."""

    code = "lost"


class Unavailable(DsecError):
    """The cluster's state store (etcd) cannot be reached or has no quorum; retry (a
    create retried with its ``idempotency_key`` finds what an earlier attempt made)
    (HTTP 503)."""

    code = "unavailable"
    retryable = True


class ConnectionFailed(DsecError):
    """The server could not be reached, or the connection broke (no HTTP answer)."""

    code = "connection_failed"
    retryable = True


ERROR_CLASSES: Dict[str, Type[DsecError]] = {
    cls.code: cls
    for cls in (
        BadRequest,
        Unauthorized,
        NotFound,
        Expired,
        Failed,
        Conflict,
        ImageNotFound,
        Capacity,
        Timeout,
        InvalidPath,
        NoSpace,
        PayloadTooLarge,
        Paused,
        AgentUnavailable,
        Internal,
        MethodNotAllowed,
        Forbidden,
        QuotaExceeded,
        Lost,
        Unavailable,
    )
}


def error_from_body(body: Any, status: Optional[int] = None) -> DsecError:
    """Builds the typed error for an API error body (``{"error": {...}}`` or the inner object).

    Unknown codes give a plain :class:`DsecError` carrying the code.
    """
    err = body.get("error", body) if isinstance(body, dict) else None
    if not isinstance(err, dict) or "code" not in err:
        return DsecError(f"HTTP {status}: {str(body)[:512]}", code="unknown", status=status)
    code = str(err.get("code"))
    message = str(err.get("message", ""))
    request_id = err.get("request_id")
    request_id = str(request_id) if request_id is not None else None
    cls = ERROR_CLASSES.get(code)
    if cls is None:
        return DsecError(message, code=code, status=status, request_id=request_id)
    return cls(message, status=status, request_id=request_id)

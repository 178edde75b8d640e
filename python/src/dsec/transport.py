"""The sync client's HTTP/1.1 transport: keep-alive connections in a thread-safe pool.

Built on the standard library (``socket`` + ``http.client``'s response parser) rather than
httpx because a sandbox call is small and frequent: an exec of ``true`` through httpx cost
about 0.6 ms more client time than the same request through ``http.client`` on the bench
machine. Each request goes out in one ``sendall`` (head and body together; TCP_NODELAY),
and a pooled connection the server has closed is noticed (readable at EOF) before reuse;
one that closes in the very moment of reuse gets an idempotent request sent again.

Only what the dsec API needs: ``http``/``https`` URLs with an optional path prefix,
``content-length`` or chunked bodies, length-delimited or chunked responses, a per-operation timeout.
No proxies, no redirects, no cookies.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import ssl
import threading
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union
from urllib.parse import urlencode, urlsplit

__all__ = ["Response", "StreamResponse", "Transport", "TransportError", "Params"]

Params = Union[Mapping[str, Any], Sequence[Tuple[str, Any]], None]
Body = Union[bytes, Iterable[bytes], None]
"""Bytes (sent with ``content-length``) or an iterable of chunks (sent chunked)."""

_CONNECT_TIMEOUT = 10.0
"""Seconds to wait for a TCP (and TLS) connection."""
_MAX_IDLE = 64
"""Idle connections kept for reuse; more are closed when returned."""
_ONE_WRITE_MAX = 64 << 10
"""Bodies up to this size are copied behind the head and sent in one write."""
_IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})
"""Methods sent again on a new connection when a reused one turns out closed (an exec,
a POST, never is: the server may have run it)."""


class TransportError(Exception):
    """The request did not get an answer: connection refused or lost, timeout, or a
    malformed response. ``timed_out`` tells a timeout apart."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class Response:
    """A complete answer: status, headers and the whole body."""

    def __init__(self, status_code: int, headers: Dict[str, str], content: bytes) -> None:
        self.status_code = status_code
        self.headers = headers
        """Header names in lower case."""
        self.content = content

    @property
    def is_success(self) -> bool:
        """2xx."""
        return 200 <= self.status_code < 300

    @property
    def text(self) -> str:
        """The body as UTF-8 (undecodable bytes replaced)."""
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body parsed as JSON (``ValueError`` if it is not)."""
        return json.loads(self.content)

    def __repr__(self) -> str:
        return f"<Response [{self.status_code}]>"


class _Conn:
    """One connection to the server."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def stale(self) -> bool:
        """Whether the server closed it (or sent something unasked) while it was idle."""
        poller = select.poll()  # not select(): descriptors above 1023 are common here
        try:
            poller.register(self.sock, select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class StreamResponse:
    """An answer whose body is read as it arrives (:meth:`iter_lines`); use it as a context
    manager so the connection is returned (body read to the end) or closed (it was not)."""

    def __init__(self, transport: "Transport", conn: _Conn, resp: http.client.HTTPResponse) -> None:
        self._transport = transport
        self._conn: Optional[_Conn] = conn
        self._resp = resp
        self.status_code = resp.status
        self.headers = {k.lower(): v for k, v in resp.getheaders()}

    @property
    def is_success(self) -> bool:
        """2xx."""
        return 200 <= self.status_code < 300

    def read(self) -> Response:
        """Reads the rest of the body; the answer as a complete :class:`Response`."""
        try:
            content = self._resp.read()
        except (OSError, http.client.HTTPException) as e:
            self.close()
            raise _transport_error("reading the answer", e) from e
        self._finish()
        return Response(self.status_code, self.headers, content)

    def iter_lines(self) -> Iterator[str]:
        """The body line by line (without line ends), as UTF-8 text."""
        while True:
            try:
                line = self._resp.readline()
            except (OSError, http.client.HTTPException) as e:
                self.close()
                raise _transport_error("reading the answer", e) from e
            if not line:
                self._finish()
                return
            yield line.rstrip(b"\r\n").decode("utf-8", errors="replace")

    def _finish(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._transport._release(conn, self._resp)

    def close(self) -> None:
        """Closes the connection unless the body was read to the end (then it is reused)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            self._resp.close()
            conn.close()

    def __enter__(self) -> "StreamResponse":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _transport_error(what: str, e: BaseException) -> TransportError:
    if isinstance(e, (socket.timeout, TimeoutError)):
        return TransportError(f"{what}: timed out", timed_out=True)
    return TransportError(f"{what}: {e!r}")


class Transport:
    """Requests to one server, over a pool of keep-alive connections (thread-safe).

    Args:
        base_url: ``http://host[:port][/prefix]`` or ``https://...``.
        headers: Sent with every request.
        timeout: Default seconds per socket operation (``None``: wait forever).
    """

    def __init__(self, base_url: str, headers: Mapping[str, str], timeout: Optional[float]) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"server URL must be http://HOST[:PORT] or https://...: {base_url!r}")
        self._tls = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._tls else 80)
        self._prefix = parts.path.rstrip("/")
        self._ssl = ssl.create_default_context() if self._tls else None
        default_port = 443 if self._tls else 80
        host = f"[{self._host}]" if ":" in self._host else self._host
        host_header = host if self._port == default_port else f"{host}:{self._port}"
        fixed = {"host": host_header, **{k.lower(): v for k, v in headers.items()}}
        self._fixed = fixed
        self.timeout = timeout
        self._idle: List[_Conn] = []
        self._lock = threading.Lock()

    def close(self) -> None:
        """Closes every idle connection; later requests open new ones."""
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    # ------------------------------------------------------------ connections

    def _connect(self) -> _Conn:
        try:
            sock = socket.create_connection((self._host, self._port), timeout=_CONNECT_TIMEOUT)
        except OSError as e:
            raise _transport_error(f"connecting to {self._host}:{self._port}", e) from e
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl is not None:
                sock = self._ssl.wrap_socket(sock, server_hostname=self._host)
        except (OSError, ssl.SSLError) as e:
            sock.close()
            raise _transport_error(f"connecting to {self._host}:{self._port}", e) from e
        return _Conn(sock)

    def _acquire(self) -> Tuple[_Conn, bool]:
        """A connection, and whether it was reused."""
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return self._connect(), False
            if not conn.stale():
                return conn, True
            conn.close()

    def _release(self, conn: _Conn, resp: http.client.HTTPResponse) -> None:
        """Back to the pool if the server keeps it open and the body was read to the end."""
        if resp.will_close or not resp.isclosed():
            conn.close()
            return
        with self._lock:
            if len(self._idle) < _MAX_IDLE:
                self._idle.append(conn)
                return
        conn.close()

    # ------------------------------------------------------------ requests

    def _head(
        self, method: str, path: str, params: Params, headers: Optional[Mapping[str, str]], length: Optional[int]
    ) -> bytes:
        target = self._prefix + path
        if params:
            items = params.items() if isinstance(params, Mapping) else params
            target += "?" + urlencode([(k, _param(v)) for k, v in items])
        all_headers = dict(self._fixed)
        if headers:
            all_headers.update({k.lower(): v for k, v in headers.items()})
        if length is None:
            all_headers["transfer-encoding"] = "chunked"
        elif length or method in ("POST", "PUT", "PATCH"):
            all_headers["content-length"] = str(length)
        lines = [f"{method} {target} HTTP/1.1"]
        lines += [f"{k}: {v}" for k, v in all_headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def open(
        self,
        method: str,
        path: str,
        *,
        params: Params = None,
        body: Body = None,
        headers: Optional[Mapping[str, str]] = None,
        timeout: Union[float, None, object] = ...,
    ) -> StreamResponse:
        """Sends a request and reads the answer's status and headers; the body is left to
        the returned :class:`StreamResponse`. ``timeout`` (seconds per socket operation,
        ``None`` for none) defaults to the transport's."""
        if body is None:
            body = b""
        whole = isinstance(body, (bytes, bytearray, memoryview))
        head = self._head(method, path, params, headers, len(body) if whole else None)  # type: ignore[arg-type]
        conn, reused = self._acquire()
        while True:
            try:
                resp = self._send(conn, head, body, whole, method, timeout)
                break
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                # Closed by the server just as it was taken from the pool: nothing of an
                # answer arrived; a request that may safely run twice goes again.
                closed = isinstance(e, (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected))
                if reused and whole and closed and method in _IDEMPOTENT:
                    conn, reused = self._connect(), False
                    continue
                raise _transport_error(f"{method} {path}", e) from e
        return StreamResponse(self, conn, resp)

    def _send(
        self, conn: _Conn, head: bytes, body: Body, whole: bool, method: str, timeout: Union[float, None, object]
    ) -> http.client.HTTPResponse:
        """Writes the request and reads the answer's status line and headers."""
        conn.sock.settimeout(self.timeout if timeout is ... else timeout)  # type: ignore[arg-type]
        if not whole:
            conn.sock.sendall(head)
            for chunk in body:  # type: ignore[union-attr]
                if chunk:
                    conn.sock.sendall(b"%x\r\n" % len(chunk) + bytes(chunk) + b"\r\n")
            conn.sock.sendall(b"0\r\n\r\n")
        elif len(body) <= _ONE_WRITE_MAX:  # type: ignore[arg-type]
            conn.sock.sendall(head + bytes(body))  # type: ignore[arg-type]
        else:
            conn.sock.sendall(head)
            conn.sock.sendall(body)  # type: ignore[arg-type]
        resp = http.client.HTTPResponse(conn.sock, method=method)
        resp.begin()
        return resp

    def request(
        self,
        method: str,
        path: str,
        *,
        params: Params = None,
        body: Body = None,
        headers: Optional[Mapping[str, str]] = None,
        timeout: Union[float, None, object] = ...,
    ) -> Response:
        """Sends a request and reads the whole answer (arguments as for :meth:`open`)."""
        return self.open(method, path, params=params, body=body, headers=headers, timeout=timeout).read()


def _param(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)

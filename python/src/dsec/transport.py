"""The clients' HTTP/1.1 transports: keep-alive connections in a pool, for threads
(:class:`Transport`) and for asyncio (:class:`AsyncTransport`).

Built on the standard library (``socket`` + ``http.client``'s response parser; asyncio
streams and a small parser) rather than httpx because a sandbox call is small and
frequent: on the bench machine an exec of ``true`` cost about 0.6 ms more client time
through httpx than through ``http.client``, and 3.3 ms of CPU per call through its async
client. Each request goes out in one write (head and body together; TCP_NODELAY), and a
pooled connection the server has closed is noticed (readable at EOF) before reuse; one
that closes in the very moment of reuse gets an idempotent request sent again.

Only what the dsec API needs: ``http``/``https`` URLs with an optional path prefix,
``content-length`` or chunked bodies, length-delimited or chunked responses, a timeout
per socket operation. No proxies, no redirects, no cookies.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import select
import socket
import ssl
import threading
import weakref
from typing import (
    Any,
    AsyncIterator,
    Awaitable,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
    Union,
)
from urllib.parse import urlencode, urlsplit

__all__ = [
    "AsyncStreamResponse", "AsyncTransport", "Body", "Params", "Response", "StreamResponse", "Transport",
    "TransportError",
]

Params = Union[Mapping[str, Any], Sequence[Tuple[str, Any]], None]
Body = Union[bytes, Iterable[bytes], None]
"""Bytes (sent with ``content-length``) or an iterable of chunks (sent chunked)."""

_CONNECT_TIMEOUT = 10.0
"""Seconds to wait for a TCP (and TLS) connection."""
_MAX_IDLE = 256
"""Idle connections kept for reuse (a trainer may have hundreds of calls in flight); more
are closed when returned."""
_ONE_WRITE_MAX = 64 << 10
"""Bodies up to this size are copied behind the head and sent in one write."""
_IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})
"""Methods sent again on a new connection when a reused one turns out closed (an exec,
a POST, never is: the server may have run it)."""


_POOLS: "weakref.WeakSet[Any]" = weakref.WeakSet()
"""Every transport, so that a forked child forgets the connections it inherited."""


def _forget_inherited_connections() -> None:
    # In a child after fork the pooled sockets are shared with the parent: a request on
    # one would interleave with the parent's. The child drops its references (closing a
    # copy sends nothing while the parent holds the socket) and connects anew.
    for pool in list(_POOLS):
        pool._idle = []
        if isinstance(pool, Transport):
            pool._lock = threading.Lock()  # it may have been held by another thread


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited_connections)


class TransportError(Exception):
    """The request did not get an answer: connection refused or lost, timeout, or a
    malformed response. ``timed_out`` tells a timeout apart; ``unsent`` says no
    connection to the server could be made, so nothing of the request reached it."""

    def __init__(self, message: str, *, timed_out: bool = False, unsent: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out
        self.unsent = unsent


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


class _Server:
    """Where requests go and what every request carries (shared by both transports)."""

    def __init__(self, base_url: str, headers: Mapping[str, str]) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"server URL must be http://HOST[:PORT] or https://...: {base_url!r}")
        tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if tls else 80)
        self.prefix = parts.path.rstrip("/")
        self.ssl = ssl.create_default_context() if tls else None
        host = f"[{self.host}]" if ":" in self.host else self.host
        host_header = host if self.port == (443 if tls else 80) else f"{host}:{self.port}"
        self.fixed = {"host": host_header, **{k.lower(): v for k, v in headers.items()}}

    def head(
        self, method: str, path: str, params: Params, headers: Optional[Mapping[str, str]], length: Optional[int]
    ) -> bytes:
        """The request line and headers; ``length`` ``None`` announces a chunked body."""
        target = self.prefix + path
        if params:
            items = params.items() if isinstance(params, Mapping) else params
            target += "?" + urlencode([(k, _param(v)) for k, v in items])
        all_headers = dict(self.fixed)
        if headers:
            all_headers.update({k.lower(): v for k, v in headers.items()})
        if length is None:
            all_headers["transfer-encoding"] = "chunked"
        elif length or method in ("POST", "PUT", "PATCH"):
            all_headers["content-length"] = str(length)
        lines = [f"{method} {target} HTTP/1.1"]
        lines += [f"{k}: {v}" for k, v in all_headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _transport_error(what: str, e: BaseException, *, unsent: bool = False) -> TransportError:
    if isinstance(e, (socket.timeout, TimeoutError, asyncio.TimeoutError)):
        return TransportError(f"{what}: timed out", timed_out=True, unsent=unsent)
    return TransportError(f"{what}: {e!r}", unsent=unsent)


def split_urls(url: Union[str, Sequence[str]]) -> List[str]:
    """Server URLs from a list or a comma-separated string (``$DSEC_URL`` may name
    several API server replicas), without trailing slashes."""
    parts = url.split(",") if isinstance(url, str) else list(url)
    urls = [u.strip().rstrip("/") for u in parts if u.strip()]
    if not urls:
        raise ValueError("no server URL given")
    return urls


class Transport:
    """Requests to one server, over a pool of keep-alive connections (thread-safe).

    Args:
        base_url: ``http://host[:port][/prefix]`` or ``https://...``.
        headers: Sent with every request.
        timeout: Default seconds per socket operation (``None``: wait forever).
    """

    def __init__(self, base_url: str, headers: Mapping[str, str], timeout: Optional[float]) -> None:
        self._server = _Server(base_url, headers)
        self._host, self._port, self._ssl = self._server.host, self._server.port, self._server.ssl
        self.timeout = timeout
        self._idle: List[_Conn] = []
        self._lock = threading.Lock()
        _POOLS.add(self)

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
            raise _transport_error(f"connecting to {self._host}:{self._port}", e, unsent=True) from e
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
        return self._server.head(method, path, params, headers, length)

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


# ---------------------------------------------------------------- asyncio


async def _timed(aw: Any, seconds: Optional[float]) -> Any:
    """Awaits ``aw`` for at most ``seconds`` (``None``: no limit)."""
    if seconds is None:
        return await aw
    if hasattr(asyncio, "timeout"):  # 3.11+: no extra task per read
        async with asyncio.timeout(seconds):
            return await aw
    return await asyncio.wait_for(aw, seconds)


class _AsyncConn:
    """One connection, bound to the event loop that opened it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.loop = asyncio.get_running_loop()

    def stale(self) -> bool:
        """Closed by the server, unusable from this loop, or holding unasked data."""
        if self.loop is not asyncio.get_running_loop() or self.reader.at_eof() or self.writer.is_closing():
            return True
        sock = self.writer.get_extra_info("socket")
        if sock is None:
            return True
        poller = select.poll()
        try:
            poller.register(sock.fileno(), select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        try:
            self.writer.close()
        except (OSError, RuntimeError):  # RuntimeError: its loop is closed
            pass


class AsyncStreamResponse:
    """The async :class:`StreamResponse`: :meth:`aiter_lines`, :meth:`aread`, and
    ``async with`` to return (body read to the end) or close the connection."""

    def __init__(
        self, transport: "AsyncTransport", conn: _AsyncConn, status: int, headers: Dict[str, str],
        method: str, timeout: Optional[float],
    ) -> None:
        self._transport = transport
        self._conn: Optional[_AsyncConn] = conn
        self.status_code = status
        self.headers = headers
        """Header names in lower case."""
        self._timeout = timeout
        no_body = method == "HEAD" or status in (204, 304) or 100 <= status < 200
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        self._left: Optional[int] = 0 if no_body else (None if self._chunked or length is None else int(length))
        self._to_eof = not no_body and not self._chunked and length is None
        self._keep = not self._to_eof and headers.get("connection", "").lower() != "close"
        self._done = self._left == 0 and not self._chunked

    @property
    def is_success(self) -> bool:
        """2xx."""
        return 200 <= self.status_code < 300

    async def _piece(self) -> bytes:
        """The next piece of the body; ``b""`` at its end."""
        conn = self._conn
        if self._done or conn is None:
            return b""
        r = conn.reader
        if self._chunked:
            size_line = await r.readline()
            try:
                size = int(size_line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise ConnectionResetError(f"bad chunk size line {size_line[:40]!r}") from None
            if size == 0:
                while (await r.readline()) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                self._done = True
                return b""
            data = await r.readexactly(size)
            await r.readexactly(2)
            return data
        if self._to_eof:
            data = await r.read(1 << 16)
            self._done = not data
            return data
        data = await r.read(min(self._left or 0, 1 << 16))
        if not data:
            raise ConnectionResetError("the server closed the connection in the middle of an answer")
        self._left = (self._left or 0) - len(data)
        self._done = self._left == 0
        return data

    async def _next_piece(self) -> bytes:
        try:
            data = await _timed(self._piece(), self._timeout)
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
            await self.aclose()
            raise _transport_error("reading the answer", e) from e
        if self._done:
            self._finish()
        return data

    async def aread(self) -> Response:
        """Reads the rest of the body; the answer as a complete :class:`Response`."""
        parts = []
        while True:
            piece = await self._next_piece()
            if not piece:
                return Response(self.status_code, self.headers, b"".join(parts))
            parts.append(piece)

    async def aiter_lines(self) -> AsyncIterator[str]:
        """The body line by line (without line ends), as UTF-8 text."""
        pending = b""
        while True:
            piece = await self._next_piece()
            if not piece:
                if pending:
                    yield pending.rstrip(b"\r").decode("utf-8", errors="replace")
                return
            pending += piece
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode("utf-8", errors="replace")

    def _finish(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._transport._release(conn, self._keep)

    async def aclose(self) -> None:
        """Closes the connection unless the body was read to the end (then it is reused)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    async def __aenter__(self) -> "AsyncStreamResponse":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def _read_head(reader: asyncio.StreamReader) -> Tuple[int, Dict[str, str]]:
    """The status and headers of an answer (1xx interim answers skipped)."""
    while True:
        line = await reader.readline()
        if not line:
            raise ConnectionResetError("the server closed the connection without an answer")
        parts = line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
            raise ConnectionResetError(f"not an HTTP answer: {line[:60]!r}")
        try:
            status = int(parts[1])
        except ValueError:
            raise ConnectionResetError(f"bad status line: {line[:60]!r}") from None
        headers: Dict[str, str] = {}
        while True:
            h = await reader.readline()
            if h in (b"\r\n", b"\n", b""):
                break
            name, _, value = h.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if parts[0] == b"HTTP/1.0" and headers.get("connection", "").lower() != "keep-alive":
            headers["connection"] = "close"
        if status >= 200 or status < 100:
            return status, headers


class AsyncTransport:
    """The asyncio counterpart of :class:`Transport` (same arguments and behaviour; bodies
    are bytes). Use it from one event loop at a time: connections another loop opened
    are not reused."""

    def __init__(self, base_url: str, headers: Mapping[str, str], timeout: Optional[float]) -> None:
        self._server = _Server(base_url, headers)
        self.timeout = timeout
        self._idle: List[_AsyncConn] = []
        _POOLS.add(self)

    async def aclose(self) -> None:
        """Closes every idle connection; later requests open new ones."""
        idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    async def _connect(self) -> _AsyncConn:
        srv = self._server
        try:
            reader, writer = await _timed(
                asyncio.open_connection(
                    srv.host, srv.port, ssl=srv.ssl, server_hostname=srv.host if srv.ssl else None
                ),
                _CONNECT_TIMEOUT,
            )
        except (OSError, asyncio.TimeoutError, ssl.SSLError) as e:
            raise _transport_error(f"connecting to {srv.host}:{srv.port}", e, unsent=True) from e
        return _AsyncConn(reader, writer)

    async def _acquire(self) -> Tuple[_AsyncConn, bool]:
        while self._idle:
            conn = self._idle.pop()
            if not conn.stale():
                return conn, True
            conn.close()
        return await self._connect(), False

    def _release(self, conn: _AsyncConn, keep: bool) -> None:
        if keep and len(self._idle) < _MAX_IDLE and not conn.stale():
            self._idle.append(conn)
        else:
            conn.close()

    async def open(
        self,
        method: str,
        path: str,
        *,
        params: Params = None,
        body: Optional[bytes] = None,
        headers: Optional[Mapping[str, str]] = None,
        timeout: Union[float, None, object] = ...,
    ) -> AsyncStreamResponse:
        """Sends a request and reads the answer's status and headers (see
        :meth:`Transport.open`)."""
        body = bytes(body or b"")
        t: Optional[float] = self.timeout if timeout is ... else timeout  # type: ignore[assignment]
        head = self._server.head(method, path, params, headers, len(body))
        conn, reused = await self._acquire()
        while True:
            try:
                conn.writer.write(head + body if len(body) <= _ONE_WRITE_MAX else head)
                if len(body) > _ONE_WRITE_MAX:
                    conn.writer.write(body)
                status, resp_headers = await _timed(self._send_and_read_head(conn), t)
                break
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
                conn.close()
                if reused and isinstance(e, (ConnectionResetError, BrokenPipeError)) and method in _IDEMPOTENT:
                    conn, reused = await self._connect(), False
                    continue
                raise _transport_error(f"{method} {path}", e) from e
        return AsyncStreamResponse(self, conn, status, resp_headers, method, t)

    @staticmethod
    async def _send_and_read_head(conn: _AsyncConn) -> Tuple[int, Dict[str, str]]:
        await conn.writer.drain()
        return await _read_head(conn.reader)

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Params = None,
        body: Optional[bytes] = None,
        headers: Optional[Mapping[str, str]] = None,
        timeout: Union[float, None, object] = ...,
    ) -> Response:
        """Sends a request and reads the whole answer."""
        resp = await self.open(method, path, params=params, body=body, headers=headers, timeout=timeout)
        return await resp.aread()


_T = TypeVar("_T")


class FailoverTransport:
    """Requests to one of several servers (API server replicas serving the same
    sandboxes), with the interface of :class:`Transport`. A request goes to the server
    that answered last; one that cannot be connected to is skipped at once (nothing of
    the request reached it, so any request may go to the next); after any other failure
    the error is raised (the request may have run) and later requests start at the next
    server."""

    def __init__(self, base_urls: Sequence[str], headers: Mapping[str, str], timeout: Optional[float]) -> None:
        self._all = [Transport(u, headers, timeout) for u in base_urls]
        self._at = 0
        self._lock = threading.Lock()

    def _call(self, fn: Callable[[Transport], _T]) -> _T:
        n = len(self._all)
        with self._lock:
            start = self._at
        for i in range(n):
            idx = (start + i) % n
            try:
                result = fn(self._all[idx])
            except TransportError as e:
                with self._lock:
                    if self._at == idx:
                        self._at = (idx + 1) % n
                if not e.unsent or i == n - 1:
                    raise
                continue
            with self._lock:
                self._at = idx
            return result
        raise TransportError("no server to send the request to", unsent=True)

    def request(self, *args: Any, **kwargs: Any) -> "Response":
        return self._call(lambda t: t.request(*args, **kwargs))

    def open(self, *args: Any, **kwargs: Any) -> "StreamResponse":
        return self._call(lambda t: t.open(*args, **kwargs))

    def close(self) -> None:
        for t in self._all:
            t.close()


class AsyncFailoverTransport:
    """The asyncio counterpart of :class:`FailoverTransport`."""

    def __init__(self, base_urls: Sequence[str], headers: Mapping[str, str], timeout: Optional[float]) -> None:
        self._all = [AsyncTransport(u, headers, timeout) for u in base_urls]
        self._at = 0

    async def _call(self, fn: Callable[[AsyncTransport], Awaitable[_T]]) -> _T:
        n = len(self._all)
        start = self._at
        for i in range(n):
            idx = (start + i) % n
            try:
                result = await fn(self._all[idx])
            except TransportError as e:
                if self._at == idx:
                    self._at = (idx + 1) % n
                if not e.unsent or i == n - 1:
                    raise
                continue
            self._at = idx
            return result
        raise TransportError("no server to send the request to", unsent=True)

    async def request(self, *args: Any, **kwargs: Any) -> "Response":
        return await self._call(lambda t: t.request(*args, **kwargs))

    async def open(self, *args: Any, **kwargs: Any) -> "AsyncStreamResponse":
        return await self._call(lambda t: t.open(*args, **kwargs))

    async def aclose(self) -> None:
        for t in self._all:
            await t.aclose()

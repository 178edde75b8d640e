"""The sync client's transport (dsec.transport) against a real `dsec serve`, and against
small real HTTP servers on loopback for what dsec itself never does (closing an idle
connection, not answering)."""

from __future__ import annotations

import asyncio
import http.server
import io
import os
import socket
import threading
import time
from typing import Iterator, List, Tuple

import pytest

import dsec
from dsec.transport import AsyncTransport, Transport, TransportError


def _idle_ports(client: dsec.Client) -> List[int]:
    pool = client._http._all[0]
    with pool._lock:
        return [c.sock.getsockname()[1] for c in pool._idle]


def test_sequential_calls_share_one_connection(sandbox: dsec.Sandbox) -> None:
    with dsec.Client(sandbox.client.url, sandbox.client.api_key) as own:
        sb = dsec.Sandbox.connect(sandbox.id, client=own)
        sb.exec(["true"])
        first = _idle_ports(own)
        for _ in range(20):
            assert sb.exec(["true"]).exit_code == 0
        sb.stat("/")
        assert len(first) == 1 and _idle_ports(own) == first


def test_write_from_a_file_object_is_sent_in_chunks(sandbox: dsec.Sandbox) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)  # four 1 MiB reads: a chunked body
    assert sandbox.write("/tmp/chunked.bin", io.BytesIO(data)) == len(data)
    assert sandbox.read("/tmp/chunked.bin") == data


def test_an_abandoned_stream_does_not_poison_the_pool(sandbox: dsec.Sandbox) -> None:
    events = sandbox.exec_stream("for i in $(seq 1 2000); do echo line $i; done; sleep 1")
    next(events)
    events.close()  # body unread: that connection must be closed, not reused
    r = sandbox.exec(["echo", "after"])
    assert r.exit_code == 0 and r.stdout == "after\n"


def test_a_forked_child_opens_its_own_connection(sandbox: dsec.Sandbox) -> None:
    with dsec.Client(sandbox.client.url, sandbox.client.api_key) as own:
        sb = dsec.Sandbox.connect(sandbox.id, client=own)
        sb.exec(["true"])
        (parent_port,) = _idle_ports(own)
        pid = os.fork()
        if pid == 0:  # the child: exit status 0 only if it used a connection of its own
            code = 1
            try:
                fresh = not _idle_ports(own)
                ok = sb.exec(["echo", "child"]).stdout == "child\n"
                code = 0 if fresh and ok and _idle_ports(own) != [parent_port] else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        assert sb.exec(["echo", "parent"]).stdout == "parent\n"
        assert _idle_ports(own) == [parent_port], "the parent's connection is intact"


class _Handler(http.server.BaseHTTPRequestHandler):
    """Answers 200 with a JSON body. With ``mode`` "close-after", then closes the
    connection without saying so (a server whose idle timeout fired between two
    requests); with "drop-second", reads the second request on a connection and closes
    without answering (the close racing the reuse)."""

    protocol_version = "HTTP/1.1"
    mode = "close-after"
    peers: List[Tuple[str, int]] = []

    def _answer(self) -> None:
        if self.mode == "drop-second" and getattr(self, "served", 0) == 1:
            self.close_connection = True
            return
        self.served = getattr(self, "served", 0) + 1
        type(self).peers.append(self.client_address)
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        body = b'{"ok":true}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()
        self.close_connection = self.mode == "close-after"

    do_GET = do_POST = _answer  # noqa: N815 (http.server's naming)

    def log_message(self, *args: object) -> None:
        pass


def _serve(mode: str) -> Iterator[str]:
    _Handler.mode = mode
    _Handler.peers = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def closing_server() -> Iterator[str]:
    yield from _serve("close-after")


@pytest.fixture
def dropping_server() -> Iterator[str]:
    yield from _serve("drop-second")


def test_a_connection_the_server_closed_is_not_reused(closing_server: str) -> None:
    tr = Transport(closing_server, {}, 5.0)
    for _ in range(3):
        r = tr.request("GET", "/x")
        assert r.status_code == 200 and r.json() == {"ok": True}
        time.sleep(0.1)  # the server's close has arrived: seen before reuse
    ports = [p for _, p in _Handler.peers]
    assert len(ports) == 3 and len(set(ports)) == 3, "each request on a new connection"
    tr.close()


def test_a_close_racing_the_reuse_resends_only_idempotent_requests(dropping_server: str) -> None:
    tr = Transport(dropping_server, {}, 5.0)
    assert tr.request("GET", "/a").status_code == 200
    assert tr.request("GET", "/b").status_code == 200, "sent again on a new connection"
    ports = [p for _, p in _Handler.peers]
    assert len(ports) == 2 and ports[0] != ports[1]
    with pytest.raises(TransportError):
        tr.request("POST", "/exec", body=b"{}")  # may have run: not sent twice
    assert len(_Handler.peers) == 2
    tr.close()


def test_a_silent_server_times_out_as_a_typed_error() -> None:
    with socket.socket() as lsock:
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(1)  # accepted by the kernel, never answered
        url = f"http://127.0.0.1:{lsock.getsockname()[1]}"
        with pytest.raises(TransportError) as ei:
            Transport(url, {}, 0.3).request("GET", "/health")
        assert ei.value.timed_out
        c = dsec.Client(url, "k", timeout=0.3)
        with pytest.raises(dsec.ConnectionFailed) as ce:
            c.health()
        assert "timed out" in str(ce.value) and ce.value.retryable


def test_bad_urls_are_refused_up_front() -> None:
    for url in ("ftp://127.0.0.1", "127.0.0.1:7070", "http://", " , "):
        with pytest.raises(ValueError):
            dsec.Client(url, "k")


def _dead_url() -> str:
    """A loopback URL nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_client_fails_over_to_the_next_url(sandbox: dsec.Sandbox) -> None:
    live, dead = sandbox.client.url, _dead_url()
    # The first server is down: each call goes on to the next at once.
    with dsec.Client(f"{dead},{live}", sandbox.client.api_key) as c:
        assert c.urls == [dead, live]
        assert dsec.Sandbox.connect(sandbox.id, client=c).exec(["true"]).exit_code == 0
        assert c.health().status == "ok"
    # A list works too, and all of them down is a typed, retryable error.
    with dsec.Client([dead, _dead_url()], "k") as c:
        with pytest.raises(dsec.ConnectionFailed) as ce:
            c.health()
        assert ce.value.retryable

    async def go() -> None:
        async with dsec.AsyncClient([dead, live], sandbox.client.api_key) as ac:
            assert (await ac.get_sandbox(sandbox.id)).id == sandbox.id

    asyncio.run(go())


# ------------------------------------------------------------------ asyncio


def test_async_calls_share_one_connection_and_streams_end_cleanly(sandbox: dsec.Sandbox) -> None:
    async def go() -> None:
        async with dsec.AsyncClient(sandbox.client.url, sandbox.client.api_key) as ac:
            sb = dsec.AsyncSandbox(ac, await ac.get_sandbox(sandbox.id))
            ports = set()
            for _ in range(10):
                assert (await sb.exec(["true"])).exit_code == 0
                ports.update(c.writer.get_extra_info("sockname")[1] for c in ac._http._all[0]._idle)
            assert len(ports) == 1 and len(ac._http._all[0]._idle) == 1
            # A chunked NDJSON answer read to its end: the connection goes back.
            evs = [e async for e in sb.exec_stream("seq 1 3000")]
            out = "".join(e.data for e in evs if isinstance(e, dsec.StdoutEvent))
            assert out == "".join(f"{i}\n" for i in range(1, 3001))
            assert len(ac._http._all[0]._idle) == 1
            # One abandoned midway is closed, not reused.
            gen = sb.exec_stream("for i in $(seq 1 2000); do echo line $i; done; sleep 1")
            await gen.__anext__()
            await gen.aclose()
            r = await sb.exec(["echo", "after"])
            assert r.stdout == "after\n"

    asyncio.run(go())


def test_async_close_races_and_timeouts(dropping_server: str) -> None:
    async def go() -> None:
        tr = AsyncTransport(dropping_server, {}, 5.0)
        assert (await tr.request("GET", "/a")).json() == {"ok": True}
        assert (await tr.request("GET", "/b")).status_code == 200, "sent again on a new connection"
        with pytest.raises(TransportError):
            await tr.request("POST", "/exec", body=b"{}")
        assert len(_Handler.peers) == 2
        await tr.aclose()
        with socket.socket() as lsock:
            lsock.bind(("127.0.0.1", 0))
            lsock.listen(1)
            url = f"http://127.0.0.1:{lsock.getsockname()[1]}"
            with pytest.raises(TransportError) as ei:
                await AsyncTransport(url, {}, 0.3).request("GET", "/health")
            assert ei.value.timed_out

    asyncio.run(go())


def test_async_stale_connection_is_not_reused(closing_server: str) -> None:
    async def go() -> None:
        tr = AsyncTransport(closing_server, {}, 5.0)
        for _ in range(3):
            assert (await tr.request("GET", "/x")).json() == {"ok": True}
            await asyncio.sleep(0.1)
        assert len({p for _, p in _Handler.peers}) == 3
        await tr.aclose()

    asyncio.run(go())


def test_an_unavailable_store_is_a_retryable_typed_error() -> None:
    e = dsec.errors.error_from_body({"error": {"code": "unavailable", "message": "no quorum"}}, 503)
    assert isinstance(e, dsec.Unavailable) and e.retryable and e.status == 503

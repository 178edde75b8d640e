"""Async API, same shape as the sync one: ``AsyncClient``, ``AsyncSandbox``, ``AsyncSession``.

::

    async with dsec.aio.AsyncClient() as c:
        async with await dsec.aio.AsyncSandbox.create(c) as sb:
            r = await sb.exec("echo hi")
            async for ev in sb.exec_stream("echo a; echo b"):
                ...
"""

from __future__ import annotations

import asyncio
import os
import random
import uuid
from typing import Any, AsyncIterator, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .client import API_KEY_HEADER, DEFAULT_URL, Client, _api_key_from_env, _body, _parse_event, _seg
from .errors import Capacity, ConnectionFailed, Expired, NotFound, Unavailable
from .transport import AsyncFailoverTransport, Params, Response, TransportError, split_urls
from .models import (
    ExecResult,
    ExitEvent,
    FileInfo,
    Image,
    JobResult,
    PauseResult,
    ProcessInfo,
    Resources,
    SandboxInfo,
    SessionInfo,
    SessionResult,
    StderrEvent,
    StdoutEvent,
    WriteResult,
)
from .sandbox import Command, Sandbox, create_body, network_body, process_body
from .transfer import extract_tar, tar_directory

__all__ = ["AsyncClient", "AsyncSandbox", "AsyncSession", "AsyncProcess"]


class AsyncClient:
    """Async counterpart of :class:`dsec.Client` (same arguments and environment)."""

    def __init__(self, url: Union[str, Sequence[str], None] = None, api_key: Optional[str] = None, *, timeout: float = 120.0, create_retries: int = 5) -> None:
        self.urls = split_urls(url or os.environ.get("DSEC_URL") or DEFAULT_URL)
        self.url = self.urls[0]
        self.api_key = api_key if api_key is not None else _api_key_from_env()
        self.create_retries = create_retries
        headers = {API_KEY_HEADER: self.api_key} if self.api_key else {}
        self._http = AsyncFailoverTransport([u + "/v1" for u in self.urls], headers, timeout)

    async def aclose(self) -> None:
        """Closes the connection pool."""
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Params = None,
        content: Optional[bytes] = None,
        headers: Optional[Mapping[str, str]] = None,
        timeout: Any = ...,
    ) -> Response:
        """Sends one request (``json`` or ``content`` as its body); a non-2xx answer
        raises its typed :class:`DsecError`. ``timeout`` is seconds per read, ``None``
        for none."""
        body, headers = _body(json, content, headers)
        try:
            resp = await self._http.request(method, path, params=params, body=body, headers=headers, timeout=timeout)  # type: ignore[arg-type]
        except TransportError as e:
            raise ConnectionFailed(f"{method} {path}: {e}") from e
        Client._raise_for(resp)
        return resp

    async def _json(self, method: str, path: str, **kw: Any) -> Any:
        resp = await self.request(method, path, **kw)
        return resp.json() if resp.content else None

    async def create_sandbox(self, body: Dict[str, Any]) -> SandboxInfo:
        """``POST /v1/sandboxes``, retried like :meth:`dsec.Client.create_sandbox` (with one
        idempotency key for all attempts)."""
        body = {**body}
        body.setdefault("idempotency_key", uuid.uuid4().hex)
        attempt = 0
        while True:
            try:
                return SandboxInfo.model_validate(await self._json("POST", "/sandboxes", json=body))
            except (ConnectionFailed, Capacity, Unavailable):
                if attempt >= self.create_retries:
                    raise
                await asyncio.sleep(min(8.0, 0.5 * (2**attempt)) * (0.5 + random.random() / 2))
                attempt += 1

    async def get_sandbox(self, sandbox_id: str) -> SandboxInfo:
        return SandboxInfo.model_validate(await self._json("GET", f"/sandboxes/{_seg(sandbox_id)}"))

    async def list_sandboxes(
        self, labels: Optional[Mapping[str, str]] = None, state: Optional[str] = None
    ) -> List[SandboxInfo]:
        params = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        if state is not None:
            params.append(("state", state))
        data = await self._json("GET", "/sandboxes", params=params)
        return [SandboxInfo.model_validate(s) for s in data["sandboxes"]]

    async def delete_sandbox(self, sandbox_id: str) -> None:
        await self.request("DELETE", f"/sandboxes/{_seg(sandbox_id)}")

    async def suspend_job(self, job: str) -> JobResult:
        return JobResult.model_validate(await self._json("POST", f"/jobs/{_seg(job)}/suspend", timeout=None))

    async def resume_job(self, job: str) -> JobResult:
        return JobResult.model_validate(await self._json("POST", f"/jobs/{_seg(job)}/resume", timeout=None))

    async def stream_events(
        self,
        path: str,
        body: Optional[Dict[str, Any]],
        timeout_s: Optional[float],
        *,
        method: str = "POST",
        params: Any = None,
    ) -> AsyncIterator[Any]:
        """Yields the events of an NDJSON route; an ``error`` event is raised."""
        raw, headers = _body(body, None, None)
        try:
            resp = await self._http.open(
                method, path, params=params, body=raw, headers=headers, timeout=Client._exec_timeout(timeout_s)  # type: ignore[arg-type]
            )
            async with resp:
                if not resp.is_success:
                    Client._raise_for(await resp.aread())
                async for line in resp.aiter_lines():
                    ev = _parse_event(line)
                    if ev is not None:
                        yield ev
        except TransportError as e:
            raise ConnectionFailed(f"{method} {path}: {e}") from e


class AsyncSandbox:
    """Async counterpart of :class:`dsec.Sandbox`; ``async with`` deletes it on exit."""

    def __init__(self, client: AsyncClient, info: SandboxInfo) -> None:
        self.client = client
        self.info = info

    @classmethod
    async def create(
        cls,
        client: Optional[AsyncClient] = None,
        image: Optional[str] = None,
        layers: Optional[Sequence[str]] = None,
        resources: Union[Resources, Mapping[str, Any], None] = None,
        timeout: Optional[int] = None,
        labels: Optional[Mapping[str, str]] = None,
        job: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        workdir: Optional[str] = None,
        qos: Optional[str] = None,
        auto_resume: bool = False,
        *,
        network: Any = None,
        user: Optional[str] = None,
        pool: Optional[str] = None,
        max_wait: Optional[float] = None,
        model_access: Any = None,
        timings: bool = False,
        isolation: Optional[str] = None,
    ) -> "AsyncSandbox":
        """Creates a sandbox; arguments as for :meth:`dsec.Sandbox.create`."""
        client = client or AsyncClient()
        body = create_body(
            image=image, layers=layers, resources=resources, timeout=timeout, idle_timeout=None,
            labels=labels, job=job, env=env, workdir=workdir, qos=qos, auto_resume=auto_resume,
            network=network, user=user, pool=pool, max_wait=max_wait, model_access=model_access,
            timings=timings, isolation=isolation,
        )
        return cls(client, await client.create_sandbox(body))

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def _base(self) -> str:
        return f"/sandboxes/{_seg(self.info.id)}"

    async def kill(self) -> None:
        """Deletes the sandbox."""
        await self.client.delete_sandbox(self.id)

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.kill()
        except (NotFound, Expired):
            pass

    async def pause(self) -> PauseResult:
        res = PauseResult.model_validate(await self.client._json("POST", f"{self._base}/pause", timeout=None))
        self.info = res.sandbox
        return res

    async def resume(self) -> SandboxInfo:
        self.info = SandboxInfo.model_validate(await self.client._json("POST", f"{self._base}/resume", timeout=None))
        return self.info

    async def set_timeout(self, seconds: int) -> SandboxInfo:
        self.info = SandboxInfo.model_validate(await self.client._json("POST", f"{self._base}/timeout", json={"timeout_s": int(seconds)}))
        return self.info

    async def set_network(self, network: Any) -> SandboxInfo:
        """Replaces the network policy; see :meth:`dsec.Sandbox.set_network`."""
        self.info = SandboxInfo.model_validate(
            await self.client._json("PUT", f"{self._base}/network", json=network_body(network))
        )
        return self.info

    async def commit(self, name: str) -> Image:
        return Image.model_validate(await self.client._json("POST", f"{self._base}/commit", json={"name": name}, timeout=None))

    async def exec(self, cmd: Command, env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
                   stdin: Union[str, bytes, None] = None, timeout: Optional[float] = None,
                   *, user: Optional[str] = None, request_id: Optional[str] = None) -> ExecResult:
        """Runs a command to completion (see :meth:`dsec.Sandbox.exec`; ``request_id`` is
        sent as given, none by default)."""
        body = Sandbox._exec_body(cmd, env, cwd, stdin, timeout, None, user)
        if request_id is not None:
            body["request_id"] = request_id
        t = None if timeout is None else timeout + 60.0
        return ExecResult.model_validate(await self.client._json("POST", f"{self._base}/exec", json=body, timeout=t))

    def exec_stream(self, cmd: Command, env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
                    stdin: Union[str, bytes, None] = None, timeout: Optional[float] = None,
                    *, user: Optional[str] = None, request_id: Optional[str] = None) -> AsyncIterator[Any]:
        """Yields the command's events (see :meth:`dsec.Sandbox.exec_stream`)."""
        body = Sandbox._exec_body(cmd, env, cwd, stdin, timeout, None, user)
        if request_id is not None:
            body["request_id"] = request_id
        return self.client.stream_events(f"{self._base}/exec/stream", body, timeout)

    async def session(self, env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
                      *, user: Optional[str] = None) -> "AsyncSession":
        """Opens a persistent bash session (``async with`` closes it)."""
        body: Dict[str, Any] = {}
        if env:
            body["env"] = dict(env)
        if cwd is not None:
            body["cwd"] = cwd
        if user is not None:
            body["user"] = user
        info = SessionInfo.model_validate(await self.client._json("POST", f"{self._base}/sessions", json=body))
        return AsyncSession(self, info)

    async def start(self, cmd: Command, env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
                    *, pty: Optional[Tuple[int, int]] = None, tag: Optional[str] = None,
                    timeout: Optional[float] = None, user: Optional[str] = None,
                    request_id: Optional[str] = None) -> "AsyncProcess":
        """Starts a background process (see :meth:`dsec.Sandbox.start`)."""
        body = process_body(cmd, env, cwd, pty, tag, timeout, user)
        if request_id is not None:
            body["request_id"] = request_id
        info = ProcessInfo.model_validate(await self.client._json("POST", f"{self._base}/processes", json=body))
        return AsyncProcess(self, info)

    async def processes(self) -> List[ProcessInfo]:
        """The sandbox's background processes."""
        data = await self.client._json("GET", f"{self._base}/processes")
        return [ProcessInfo.model_validate(p) for p in data["processes"]]

    async def process(self, pid: int) -> "AsyncProcess":
        """Re-attaches to background process ``pid`` (raises :class:`dsec.NotFound`)."""
        for p in await self.processes():
            if p.pid == pid:
                return AsyncProcess(self, p)
        raise NotFound(f"no process {pid} in sandbox {self.id}")

    async def upload_dir(self, local_dir: str, remote_dir: str, *, request_id: Optional[str] = None) -> int:
        """Copies a local directory's contents into ``remote_dir`` (see :meth:`dsec.Sandbox.upload_dir`)."""
        data = tar_directory(local_dir)
        await self.mkdir(remote_dir)
        params = {"path": remote_dir}
        if request_id is not None:
            params["request_id"] = request_id
        await self.client.request("PUT", f"{self._base}/files/tar", params=params, content=data,
                                  headers={"content-type": "application/x-tar"}, timeout=None)
        return len(data)

    async def download_dir(self, remote_dir: str, local_dir: str) -> None:
        """Copies ``remote_dir``'s contents into a local directory (see :meth:`dsec.Sandbox.download_dir`)."""
        resp = await self.client.request("GET", f"{self._base}/files/tar", params={"path": remote_dir}, timeout=None)
        extract_tar(resp.content, local_dir)

    async def write(self, path: str, data: Union[bytes, str], mode: Optional[int] = None,
                    *, request_id: Optional[str] = None) -> int:
        """Writes a file from bytes or str; returns the bytes written (``request_id`` as
        for :meth:`dsec.Sandbox.write`, none by default)."""
        params: Dict[str, str] = {"path": path}
        if mode is not None:
            params["mode"] = f"0o{mode:o}"
        if request_id is not None:
            params["request_id"] = request_id
        content = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        res = await self.client._json("PUT", f"{self._base}/files", params=params, content=content,
                                      headers={"content-type": "application/octet-stream"}, timeout=None)
        return WriteResult.model_validate(res).bytes

    async def read(self, path: str) -> bytes:
        """Reads a whole file."""
        return (await self.client.request("GET", f"{self._base}/files", params={"path": path}, timeout=None)).content

    async def list(self, path: str) -> List[FileInfo]:
        data = await self.client._json("GET", f"{self._base}/files/list", params={"path": path})
        return [FileInfo.model_validate(e) for e in data["entries"]]

    async def stat(self, path: str) -> FileInfo:
        return FileInfo.model_validate(await self.client._json("GET", f"{self._base}/files/stat", params={"path": path}))

    async def remove(self, path: str, recursive: bool = False) -> None:
        await self.client.request("DELETE", f"{self._base}/files", params={"path": path, "recursive": "true" if recursive else "false"})

    async def mkdir(self, path: str) -> None:
        await self.client.request("POST", f"{self._base}/files/mkdir", json={"path": path})

    async def rename(self, src: str, dst: str) -> None:
        await self.client.request("POST", f"{self._base}/files/rename", json={"from": src, "to": dst})


class AsyncSession:
    """Async counterpart of :class:`dsec.Session`."""

    def __init__(self, sandbox: AsyncSandbox, info: SessionInfo) -> None:
        self.sandbox = sandbox
        self.info = info

    @property
    def _base(self) -> str:
        return f"{self.sandbox._base}/sessions/{_seg(self.info.session)}"

    async def run(self, command: str, timeout: Optional[float] = None, *,
                  request_id: Optional[str] = None) -> SessionResult:
        body: Dict[str, Any] = {"command": command}
        if request_id is not None:
            body["request_id"] = request_id
        if timeout is not None:
            body["timeout_s"] = float(timeout)
        t = None if timeout is None else timeout + 60.0
        return SessionResult.model_validate(await self.sandbox.client._json("POST", f"{self._base}/run", json=body, timeout=t))

    async def close(self) -> None:
        try:
            await self.sandbox.client.request("DELETE", self._base)
        except (NotFound, Expired):
            pass

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncProcess:
    """Async counterpart of :class:`dsec.Process`."""

    def __init__(self, sandbox: AsyncSandbox, info: ProcessInfo) -> None:
        self.sandbox = sandbox
        self.info = info

    @property
    def pid(self) -> int:
        return self.info.pid

    @property
    def _base(self) -> str:
        return f"{self.sandbox._base}/processes/{self.pid}"

    def output(self, follow: bool = False, stdout_offset: int = 0, stderr_offset: int = 0) -> AsyncIterator[Any]:
        """Its output events from the given offsets (see :meth:`dsec.Process.output`)."""
        params = {"follow": "true" if follow else "false",
                  "stdout_offset": stdout_offset, "stderr_offset": stderr_offset}
        return self.sandbox.client.stream_events(f"{self._base}/output", None, None, method="GET", params=params)

    async def wait(self) -> ExecResult:
        """Waits for it to exit; its whole recorded output and exit status."""
        out: List[str] = []
        err: List[str] = []
        exit_fields: Dict[str, Any] = {}
        async for ev in self.output(follow=True):
            if isinstance(ev, StdoutEvent):
                out.append(ev.data)
            elif isinstance(ev, StderrEvent):
                err.append(ev.data)
            elif isinstance(ev, ExitEvent):
                exit_fields = ev.model_dump(exclude={"type"})
        return ExecResult.model_validate({"stdout": "".join(out), "stderr": "".join(err), **exit_fields})

    async def send_stdin(self, data: Union[str, bytes], close: bool = False) -> None:
        body = {"data": data.decode("utf-8") if isinstance(data, bytes) else data, "close": close}
        await self.sandbox.client.request("POST", f"{self._base}/stdin", json=body)

    async def close_stdin(self) -> None:
        await self.send_stdin("", close=True)

    async def signal(self, signal: Union[str, int] = "SIGTERM") -> None:
        await self.sandbox.client.request("POST", f"{self._base}/signal", json={"signal": str(signal)})

    async def kill(self) -> None:
        await self.signal("SIGKILL")

    async def resize(self, cols: int, rows: int) -> None:
        await self.sandbox.client.request("POST", f"{self._base}/resize", json={"cols": cols, "rows": rows})

"""The HTTP client: one :class:`Client` per server, shared by every :class:`~dsec.Sandbox`."""

from __future__ import annotations

import json
import os
import random
import threading
import time
import uuid
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union
from urllib.parse import quote

from pydantic import TypeAdapter

from .errors import Capacity, ConnectionFailed, DsecError, Unavailable, error_from_body
from .transport import Body, FailoverTransport, Params, Response, TransportError, split_urls
from .models import (
    AuditList,
    ErrorEvent,
    Event,
    ExecEvent,
    Health,
    Image,
    JobResult,
    SandboxInfo,
)

T = TypeVar("T")

__all__ = ["Client", "default_client", "DEFAULT_URL", "DEFAULT_API_KEY_FILE", "API_KEY_HEADER"]

DEFAULT_URL = "http://127.0.0.1:7070"
"""Server URL used when neither ``url`` nor ``DSEC_URL`` is given."""
DEFAULT_API_KEY_FILE = "/var/lib/dsec/api-key"
"""Key file read when neither ``api_key``, ``DSEC_API_KEY`` nor ``DSEC_API_KEY_FILE`` is set."""
API_KEY_HEADER = "x-api-key"

_EVENT_ADAPTER: TypeAdapter[Any] = TypeAdapter(ExecEvent)
_KNOWN_EVENTS = {"started", "stdout", "stderr", "exit", "end", "error"}


def _api_key_from_env() -> Optional[str]:
    key = os.environ.get("DSEC_API_KEY", "").strip()
    if key:
        return key
    path = os.environ.get("DSEC_API_KEY_FILE", "")
    if path:
        with open(path, encoding="utf-8") as f:  # an unreadable explicit file is an error
            return f.read().strip() or None
    try:
        with open(DEFAULT_API_KEY_FILE, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _seg(s: str) -> str:
    return quote(s, safe="")


class Client:
    """A connection to a dsec server.

    Args:
        url: Server base URL, or several (a list or a comma-separated string: API server
            replicas of one cluster). A request that cannot connect to one goes to the
            next at once; after any other connection failure the request's error is raised
            and later requests start at the next (creates are retried, see
            ``create_retries``). Default: ``$DSEC_URL``, else ``http://127.0.0.1:7070``.
        api_key: API key. Default: ``$DSEC_API_KEY``, else the contents of the file named
            by ``$DSEC_API_KEY_FILE``, else of ``/var/lib/dsec/api-key`` if readable.
        timeout: Seconds to wait for an ordinary (non-exec) answer.
        create_retries: How many times :meth:`create_sandbox` retries after a connection
            error, a ``capacity`` or an ``unavailable`` answer (exponential backoff from 0.5 s, at most 8 s
            between attempts, with jitter). 0 disables retries.
        record_calls: Give every exec a request id unless it has one (``True``, the
            default): the server then runs it once, whatever the retries, and lists it in
            the sandbox's call log (:meth:`Sandbox.log`).
        call_retries: How many times an exec with a request id is sent again after a
            connection error (the same id: the retry attaches to the first, or gets its
            result; nothing runs twice). 0 disables retries.

    The client is thread-safe (a pool of keep-alive connections, see
    :mod:`dsec.transport`) and a context manager.
    """

    def __init__(
        self,
        url: Union[str, Sequence[str], None] = None,
        api_key: Optional[str] = None,
        *,
        timeout: float = 120.0,
        create_retries: int = 5,
        record_calls: bool = True,
        call_retries: int = 5,
    ) -> None:
        self.urls = split_urls(url or os.environ.get("DSEC_URL") or DEFAULT_URL)
        self.url = self.urls[0]
        self.api_key = api_key if api_key is not None else _api_key_from_env()
        self.timeout = timeout
        self.create_retries = create_retries
        self.record_calls = record_calls
        self.call_retries = call_retries
        headers = {API_KEY_HEADER: self.api_key} if self.api_key else {}
        self._http = FailoverTransport([u + "/v1" for u in self.urls], headers, timeout)

    # ------------------------------------------------------------ plumbing

    def close(self) -> None:
        """Closes the connection pool."""
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"dsec.Client(url={','.join(self.urls)!r})"

    @staticmethod
    def _raise_for(resp: Response) -> None:
        if resp.is_success:
            return
        try:
            body: Any = resp.json()
        except ValueError:
            body = resp.text
        raise error_from_body(body, resp.status_code)

    def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: Params = None,
        content: Body = None,
        headers: Optional[Mapping[str, str]] = None,
        timeout: Union[float, None, object] = ...,
    ) -> Response:
        """Sends one request to ``/v1`` + ``path`` and raises the typed error of a non-2xx
        answer. ``timeout`` is seconds per socket operation; ``None`` waits forever; the
        default is the client's ``timeout``."""
        body, headers = _body(json_body, content, headers)
        try:
            resp = self._http.request(method, path, params=params, body=body, headers=headers, timeout=timeout)
        except TransportError as e:
            raise ConnectionFailed(f"{method} {path}: {e}") from e
        self._raise_for(resp)
        return resp

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        resp = self.request(method, path, **kw)
        return resp.json() if resp.content else None

    @staticmethod
    def _exec_timeout(timeout_s: Optional[float]) -> Optional[float]:
        # Commands may run long: wait for their own timeout plus a margin, or forever.
        return None if timeout_s is None else timeout_s + 60.0

    # ------------------------------------------------------------ server

    def health(self) -> Health:
        """``GET /v1/health``."""
        return Health.model_validate(self._json("GET", "/health"))

    def events(
        self,
        *,
        after: Optional[int] = None,
        sandbox: Optional[str] = None,
        tenant: Optional[str] = None,
        kind: Union[str, Sequence[str], None] = None,
        labels: Optional[Mapping[str, str]] = None,
        follow: bool = True,
    ) -> Iterator[Event]:
        """``GET /v1/events``: what happens to sandboxes (and, for cluster admins, nodes),
        with causes. Yields the kept events after ``after`` first (``0``: all kept ones;
        ``None``: none), then, with ``follow``, new ones as they happen until the iterator
        is closed. Filters: a sandbox, a tenant, kinds (``"oom_killed"`` or a list), labels
        the sandbox carries. A stream the server ended with an error raises it; a dropped
        connection raises :class:`ConnectionFailed` (resume with ``after`` = the last id)."""
        params: Dict[str, str] = {}
        if after is not None:
            params["after"] = str(after)
        elif not follow:
            params["after"] = "0"
        if sandbox:
            params["sandbox"] = sandbox
        if tenant:
            params["tenant"] = tenant
        if kind:
            params["kind"] = kind if isinstance(kind, str) else ",".join(kind)
        if labels:
            params["label"] = ",".join(f"{k}={v}" for k, v in labels.items())
        if not follow:
            params["no_follow"] = "true"
        try:
            with self._http.open("GET", "/events", params=params, timeout=None) as resp:
                if not resp.is_success:
                    self._raise_for(resp.read())
                name, data = "message", []
                for line in resp.iter_lines():
                    if line:
                        field, _, value = line.partition(":")
                        value = value[1:] if value.startswith(" ") else value
                        if field == "event":
                            name = value
                        elif field == "data":
                            data.append(value)
                        continue
                    if data:
                        body = json.loads("\n".join(data))
                        if name == "error":
                            raise error_from_body({"error": body}, 500)
                        yield Event.model_validate(body)
                    name, data = "message", []
        except TransportError as e:
            raise ConnectionFailed(f"GET /events: {e}") from e

    def audit(
        self,
        *,
        since_ms: Optional[int] = None,
        tenant: Optional[str] = None,
        sandbox: Optional[str] = None,
        key_id: Optional[str] = None,
        failed: bool = False,
        limit: Optional[int] = None,
    ) -> AuditList:
        """``GET /v1/audit`` (admin keys): who made which state-changing call, on which
        sandbox, when, with which result (refused calls included), oldest first: from
        ``since_ms`` on, or the newest ``limit`` (1000)."""
        params: Dict[str, str] = {}
        for k, v in (("since_ms", since_ms), ("tenant", tenant), ("sandbox", sandbox), ("key_id", key_id), ("limit", limit)):
            if v is not None:
                params[k] = str(v)
        if failed:
            params["failed"] = "true"
        return AuditList.model_validate(self._json("GET", "/audit", params=params))

    def list_images(self) -> List[Image]:
        """``GET /v1/images``."""
        return [Image.model_validate(i) for i in self._json("GET", "/images")["images"]]

    def get_image(self, name: str) -> Image:
        """``GET /v1/images/{name}``: one image; raises ``ImageNotFound`` if there is none."""
        return Image.model_validate(self._json("GET", f"/images/{_seg(name)}"))

    def import_image(self, name: str, source: str, *, flatten: bool = False) -> Image:
        """``POST /v1/images``: imports ``source`` (a path on the server's machine) as ``name``."""
        body = {"name": name, "source": source, "flatten": flatten}
        return Image.model_validate(self._json("POST", "/images", json_body=body, timeout=None))

    def upload_image(self, name: str, path: str, *, flatten: bool = False) -> Image:
        """``POST /v1/images/upload``: sends the archive at ``path`` on *this* machine (a
        rootfs .tar or .tar.gz, a ``docker save`` or OCI archive, or an .erofs layer) as
        ``name``, streamed. What a cluster needs: its API servers' nodes are other machines,
        so :meth:`import_image`'s server-side path does not reach them."""
        f = open(path, "rb")  # a missing file raises here, before anything is sent

        def chunks() -> Iterator[bytes]:
            with f:
                while True:
                    b = f.read(1 << 20)
                    if not b:
                        return
                    yield b

        try:
            data = self._json(
                "POST",
                "/images/upload",
                params={"name": name, "flatten": "true" if flatten else "false"},
                content=chunks(),
                headers={"content-type": "application/octet-stream"},
                timeout=None,
            )
        finally:
            f.close()
        return Image.model_validate(data)

    def pull_image(
        self,
        reference: str,
        *,
        name: Optional[str] = None,
        insecure: bool = False,
        on_progress: Optional[Any] = None,
    ) -> Image:
        """``POST /v1/images/pull``: pulls ``reference`` (``[REGISTRY[:PORT]/]REPO[:TAG][@sha256:..]``)
        from its OCI registry as ``name`` (default: the reference, ``@`` written ``:``);
        ``insecure`` speaks plain HTTP to the registry. ``on_progress(phase, bytes_done,
        bytes_total)`` is called for each progress line. A failed pull raises and keeps nothing."""
        body: Dict[str, Any] = {"reference": reference, "insecure": insecure}
        if name is not None:
            body["name"] = name
        raw, headers = _body(body, None, None)

        def on_event(ev: Dict[str, Any]) -> None:
            if ev.get("type") == "progress" and on_progress is not None:
                on_progress(ev.get("phase"), ev.get("bytes_done", 0), ev.get("bytes_total"))

        return self._image_events("/images/pull", on_event, body=raw, headers=headers)

    def build_dockerfile(
        self,
        name: str,
        context: str,
        *,
        dockerfile: Optional[str] = None,
        target: Optional[str] = None,
        build_args: Optional[Mapping[str, str]] = None,
        network: Optional[str] = None,
        no_cache: bool = False,
        on_event: Optional[Any] = None,
    ) -> Image:
        """``POST /v1/images/build/dockerfile``: builds the Dockerfile of the directory
        ``context`` (sent as a tar; the server applies its ``.dockerignore``) as ``name``.
        ``dockerfile`` is its path inside the context (default ``Dockerfile``); ``network``
        ``"open"`` gives ``RUN`` steps the internet. ``on_event(event)`` gets each event
        (``{"type": "step"|"output"|"warning", ...}``). A failed build raises (the message
        names the Dockerfile line) and names nothing."""
        import tarfile
        import tempfile

        if not os.path.isdir(context):
            raise ValueError(f"build context {context!r} is not a directory")
        params: List[Tuple[str, str]] = [("name", name)]
        if dockerfile is not None:
            params.append(("dockerfile", dockerfile))
        if target is not None:
            params.append(("target", target))
        if network is not None:
            params.append(("network", network))
        if no_cache:
            params.append(("no_cache", "true"))
        for k, v in (build_args or {}).items():
            params.append(("build_arg", f"{k}={v}"))
        with tempfile.TemporaryFile() as spool:
            with tarfile.open(fileobj=spool, mode="w", format=tarfile.PAX_FORMAT) as tar:
                for entry in sorted(os.listdir(context)):
                    tar.add(os.path.join(context, entry), arcname=entry, recursive=True)
            spool.seek(0)

            def chunks() -> Iterator[bytes]:
                while True:
                    b = spool.read(1 << 20)
                    if not b:
                        return
                    yield b

            return self._image_events(
                "/images/build/dockerfile",
                on_event,
                params=params,
                body=chunks(),
                headers={"content-type": "application/x-tar"},
            )

    def _image_events(self, path: str, on_event: Optional[Any], **request: Any) -> Image:
        """POSTs to ``path``, whose answer is NDJSON events ending in ``done`` (the image)
        or ``error`` (raised); every other event goes to ``on_event``."""
        try:
            with self._http.open("POST", path, timeout=None, **request) as resp:
                if not resp.is_success:
                    self._raise_for(resp.read())
                for line in resp.iter_lines():
                    if not line.strip():
                        continue
                    ev = json.loads(line)
                    kind = ev.get("type")
                    if kind == "done":
                        return Image.model_validate(ev["image"])
                    if kind == "error":
                        raise error_from_body(ev["error"])
                    if on_event is not None:
                        on_event(ev)
        except TransportError as e:
            raise ConnectionFailed(f"POST {path}: {e}") from e
        raise ConnectionFailed(f"POST {path}: the stream ended without a result")

    def delete_image(self, name: str) -> None:
        """``DELETE /v1/images/{name}``."""
        self.request("DELETE", f"/images/{_seg(name)}")

    # ------------------------------------------------------------ warm pools

    def create_pool(
        self,
        name: str,
        template: Optional[Mapping[str, Any]] = None,
        min: int = 1,
        max: int = 32,
        autoscale: Optional[Mapping[str, Any]] = None,
        fncall: Optional[Mapping[str, Any]] = None,
    ) -> Dict[str, Any]:
        """``POST /v1/pools``: a warm pool whose sandboxes are made as ``template`` (a
        ``POST /v1/sandboxes`` body: image, resources, env, ...) asks;
        ``Sandbox.create(pool=name)`` claims one. With ``fncall`` (``{}`` or
        ``{"max_calls": N}``) its sandboxes serve :meth:`fncall` instead. Returns the
        pool's status."""
        body: Dict[str, Any] = {"name": name, "template": dict(template or {}), "min": min, "max": max}
        if autoscale is not None:
            body["autoscale"] = dict(autoscale)
        if fncall is not None:
            body["fncall"] = dict(fncall)
        return self._json("POST", "/pools", json_body=body)

    def fncall(
        self,
        pool: str,
        command: Optional[Any] = None,
        *,
        code: Optional[str] = None,
        language: Optional[str] = None,
        stdin: Optional[str] = None,
        files: Optional[Mapping[str, bytes]] = None,
        fetch_files: Optional[List[str]] = None,
        timeout: float = 10.0,
        **extra: Any,
    ) -> Dict[str, Any]:
        """``POST /v1/fncall``: runs ``command`` (argv list or shell string), or ``code``
        in ``language``, in a throw-away view of a warm sandbox of ``pool``. Returns the
        result (status, exit_code, stdout, stderr, files, ...); fetched files come back
        base64-encoded under ``files[path]["data"]``."""
        import base64

        body: Dict[str, Any] = {"pool": pool, "timeout_s": timeout}
        if command is not None:
            body["command"] = command
        if code is not None:
            body["code"] = code
        if language is not None:
            body["language"] = language
        if stdin is not None:
            body["stdin"] = stdin
        if files:
            body["files"] = {p: base64.b64encode(b).decode() for p, b in files.items()}
        if fetch_files:
            body["fetch_files"] = list(fetch_files)
        body.update(extra)
        return self._json("POST", "/fncall", json_body=body, timeout=None)

    # ------------------------------------------------------------ batches

    def put_input(self, key: str, data: bytes) -> Dict[str, Any]:
        """``PUT /v1/inputs/{key}``: stores ``data`` as an input that batch tasks name as
        ``{"blob": key}``. Returns ``{key, sha256, bytes}``."""
        path = "/inputs/" + "/".join(_seg(part) for part in key.split("/"))
        return self._json(
            "PUT", path, content=bytes(data), headers={"content-type": "application/octet-stream"}, timeout=None
        )

    def submit_batch(self, spec: Mapping[str, Any]) -> Dict[str, Any]:
        """``POST /v1/batches``: submits a batch (the shape of ``dsec submit``'s job file:
        ``template``, ``defaults``, ``tasks``, ``parallelism``, ``priority``) and returns it
        (``id``, ``state``, ``counts`` per task state)."""
        return self._json("POST", "/batches", json_body=dict(spec), timeout=None)

    def get_batch(self, batch_id: str) -> Dict[str, Any]:
        """``GET /v1/batches/{id}``."""
        return self._json("GET", f"/batches/{_seg(batch_id)}")

    def wait_batch(self, batch_id: str, timeout: Optional[float] = None, poll: float = 1.0) -> Dict[str, Any]:
        """Polls a batch until it has ended (finished or cancelled) and returns it; raises
        ``TimeoutError`` after ``timeout`` seconds."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            batch = self.get_batch(batch_id)
            if batch.get("ended_at_ms") is not None:
                return batch
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"batch {batch_id} still running after {timeout} s")
            time.sleep(poll)

    def batch_tasks(self, batch_id: str, state: Optional[str] = None) -> List[Dict[str, Any]]:
        """Every task of a batch (all pages of ``GET /v1/batches/{id}/tasks``), optionally
        only those in ``state``."""
        tasks: List[Dict[str, Any]] = []
        params: Dict[str, str] = {}
        if state is not None:
            params["state"] = state
        while True:
            page = self._json("GET", f"/batches/{_seg(batch_id)}/tasks", params=dict(params))
            tasks.extend(page["tasks"])
            if not page.get("next"):
                return tasks
            params["after"] = page["next"]

    def batch_output(self, batch_id: str, task: str, path: Optional[str] = None) -> bytes:
        """A finalized task's collected output at ``path`` (verified by sha256), or with no
        ``path`` the JSON error snapshot of a failed one."""
        params = {"path": path} if path is not None else None
        resp = self.request("GET", f"/batches/{_seg(batch_id)}/tasks/{_seg(task)}/output", params=params)
        return resp.content

    def batch_manifest(self, batch_id: str) -> Dict[str, Any]:
        """``GET /v1/batches/{id}/manifest``: image digest, layers, resolved commands,
        input digests, nodes and times of every task."""
        return self._json("GET", f"/batches/{_seg(batch_id)}/manifest")

    def cancel_batch(self, batch_id: str) -> Dict[str, Any]:
        """``DELETE /v1/batches/{id}``: cancels a running batch."""
        return self._json("DELETE", f"/batches/{_seg(batch_id)}")

    def get_pool(self, name: str) -> Dict[str, Any]:
        """``GET /v1/pools/{name}``: sizes, queue, scale events."""
        return self._json("GET", f"/pools/{_seg(name)}")

    def list_pools(self) -> List[Dict[str, Any]]:
        """``GET /v1/pools``."""
        return self._json("GET", "/pools")["pools"]

    def update_pool(
        self,
        name: str,
        min: Optional[int] = None,
        max: Optional[int] = None,
        autoscale: Optional[Mapping[str, Any]] = None,
    ) -> Dict[str, Any]:
        """``PATCH /v1/pools/{name}``: new bounds or autoscale policy."""
        body: Dict[str, Any] = {}
        if min is not None:
            body["min"] = min
        if max is not None:
            body["max"] = max
        if autoscale is not None:
            body["autoscale"] = dict(autoscale)
        return self._json("PATCH", f"/pools/{_seg(name)}", json_body=body)

    def delete_pool(self, name: str) -> None:
        """``DELETE /v1/pools/{name}``: the pool and its warm sandboxes (claimed ones stay)."""
        self.request("DELETE", f"/pools/{_seg(name)}")

    # ------------------------------------------------------------ sandboxes

    def create_sandbox(self, body: Dict[str, Any]) -> SandboxInfo:
        """``POST /v1/sandboxes`` with the raw request ``body``, retried after connection
        errors, ``capacity`` and ``unavailable`` answers (see ``create_retries``). Every
        attempt carries the same ``idempotency_key`` (a random one unless the body has its own), so a retry
        after a lost answer gets the sandbox the first attempt made instead of a second."""
        body = {**body}
        body.setdefault("idempotency_key", uuid.uuid4().hex)
        attempt = 0
        while True:
            try:
                return SandboxInfo.model_validate(self._json("POST", "/sandboxes", json_body=body))
            except (ConnectionFailed, Capacity, Unavailable):
                if attempt >= self.create_retries:
                    raise
                delay = min(8.0, 0.5 * (2**attempt)) * (0.5 + random.random() / 2)
                attempt += 1
                time.sleep(delay)

    def get_sandbox(self, sandbox_id: str) -> SandboxInfo:
        """``GET /v1/sandboxes/{id}``."""
        return SandboxInfo.model_validate(self._json("GET", f"/sandboxes/{_seg(sandbox_id)}"))

    def list_sandboxes(
        self, labels: Optional[Mapping[str, str]] = None, state: Optional[str] = None
    ) -> List[SandboxInfo]:
        """``GET /v1/sandboxes``, filtered by every ``labels`` pair and by ``state`` (e.g.
        ``"unhealthy"``)."""
        params = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        if state is not None:
            params.append(("state", state))
        data = self._json("GET", "/sandboxes", params=params)
        return [SandboxInfo.model_validate(s) for s in data["sandboxes"]]

    def delete_sandbox(self, sandbox_id: str) -> None:
        """``DELETE /v1/sandboxes/{id}``, retried after a lost connection (``call_retries``):
        it carries an ``Idempotency-Key``, so a retry of a delete that went through answers
        as it did."""
        headers = {"Idempotency-Key": uuid.uuid4().hex}
        self.retried(lambda: self.request("DELETE", f"/sandboxes/{_seg(sandbox_id)}", headers=headers), True)

    def suspend_job(self, job: str) -> JobResult:
        """``POST /v1/jobs/{job}/suspend``: pauses every sandbox labelled ``job=JOB``."""
        return JobResult.model_validate(self._json("POST", f"/jobs/{_seg(job)}/suspend", timeout=None))

    def resume_job(self, job: str) -> JobResult:
        """``POST /v1/jobs/{job}/resume``."""
        return JobResult.model_validate(self._json("POST", f"/jobs/{_seg(job)}/resume", timeout=None))

    def retry_delay(self, attempt: int) -> None:
        """Sleeps before retry ``attempt`` (0-based): exponential from 0.5 s, at most 8 s,
        with jitter."""
        time.sleep(min(8.0, 0.5 * (2**attempt)) * (0.5 + random.random() / 2))

    def retried(self, call: Callable[[], T], safe: bool) -> T:
        """``call()``, sent again after a lost connection (``call_retries`` times) when it
        is ``safe`` to (it carries a request id or an idempotency key)."""
        attempt = 0
        while True:
            try:
                return call()
            except ConnectionFailed:
                if not safe or attempt >= self.call_retries:
                    raise
                self.retry_delay(attempt)
                attempt += 1

    # ------------------------------------------------------------ streams

    def stream_events(
        self,
        path: str,
        body: Optional[Dict[str, Any]],
        timeout_s: Optional[float],
        *,
        method: str = "POST",
        params: Any = None,
    ) -> Iterator[Any]:
        """Sends ``body`` to an NDJSON route (``GET`` with ``params`` for process output)
        and yields its events as models.

        An ``error`` event is raised as the matching :class:`DsecError`; event types this
        SDK does not know are skipped.
        """
        raw, headers = _body(body, None, None)
        try:
            with self._http.open(
                method, path, params=params, body=raw, headers=headers, timeout=self._exec_timeout(timeout_s)
            ) as resp:
                if not resp.is_success:
                    self._raise_for(resp.read())
                for line in resp.iter_lines():
                    ev = _parse_event(line)
                    if ev is not None:
                        yield ev
        except TransportError as e:
            raise ConnectionFailed(f"{method} {path}: {e}") from e


def _body(
    json_body: Any, content: Body, headers: Optional[Mapping[str, str]]
) -> "tuple[Body, Optional[Mapping[str, str]]]":
    """The bytes to send and the headers that describe them: ``json_body`` serialized
    (compact, UTF-8) with its content type, or ``content`` as given."""
    if json_body is None:
        return content, headers
    raw = json.dumps(json_body, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")
    return raw, {"content-type": "application/json", **(headers or {})}


def _parse_event(line: str) -> Any:
    """One NDJSON line as an event model; ``None`` for blank lines and event types this
    SDK does not know (a newer server). An ``error`` event is raised."""
    if not line.strip():
        return None
    raw = json.loads(line)
    if raw.get("type") not in _KNOWN_EVENTS:
        return None
    ev = _EVENT_ADAPTER.validate_python(raw)
    if isinstance(ev, ErrorEvent):
        raise error_from_body(ev.error.model_dump())
    return ev


_default: Optional[Client] = None
_default_lock = threading.Lock()


def default_client() -> Client:
    """The process-wide client configured from the environment, created on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Client()
        return _default


def _reset_default_client() -> None:
    """Forgets the default client (tests that change the environment)."""
    global _default
    with _default_lock:
        if _default is not None:
            _default.close()
        _default = None


_ = DsecError  # re-exported for typing in callers

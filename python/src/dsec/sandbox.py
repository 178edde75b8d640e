"""Sandboxes and shell sessions."""

from __future__ import annotations

import uuid
from typing import IO, Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union

from .client import Client, _seg, default_client
from .errors import ConnectionFailed, DsecError, Expired, NoSpace, NotFound
from .models import (
    CallLog,
    CallRecord,
    ExecResult,
    ExitEvent,
    FileInfo,
    Image,
    JobResult,
    ModelAccess,
    Network,
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
from .transfer import extract_tar, tar_directory

__all__ = ["Sandbox", "Session", "Process", "suspend_job", "resume_job", "Command"]

Command = Union[str, Sequence[str]]
"""A shell command line (run by ``/bin/sh -c``) or an argv list (run directly)."""

JOB_LABEL = "job"


def _cmd(cmd: Command) -> Union[str, List[str]]:
    if isinstance(cmd, str):
        return cmd
    return [str(a) for a in cmd]


def _text(data: Union[str, bytes, None]) -> Optional[str]:
    if isinstance(data, bytes):
        return data.decode("utf-8")
    return data


def create_body(
    *,
    image: Optional[str],
    layers: Optional[Sequence[str]],
    resources: Any,
    timeout: Optional[float],
    idle_timeout: Optional[float],
    labels: Optional[Mapping[str, str]],
    job: Optional[str],
    env: Optional[Mapping[str, str]],
    workdir: Optional[str],
    qos: Optional[str],
    auto_resume: bool,
    network: Any = None,
    writable: Optional[Sequence[str]] = None,
    tcp_bind: Optional[Sequence[int]] = None,
    tcp_connect: Optional[Sequence[int]] = None,
    user: Optional[str] = None,
    pool: Optional[str] = None,
    max_wait: Optional[float] = None,
    model_access: Any = None,
    timings: bool = False,
    isolation: Optional[str] = None,
) -> Dict[str, Any]:
    """The ``POST /v1/sandboxes`` body for :meth:`Sandbox.create` (and its async twin)."""
    body: Dict[str, Any] = {"auto_resume": auto_resume}
    if pool is not None:
        body["pool"] = pool
    if max_wait is not None:
        body["queue"] = {"max_wait_s": float(max_wait)}
    if image is not None:
        body["image"] = image
    if layers:
        body["layers"] = list(layers)
    if resources is not None:
        res = resources if isinstance(resources, Resources) else Resources.model_validate(dict(resources))
        body["resources"] = res.model_dump(exclude_none=True)
    if timeout is not None:
        body["timeout_s"] = int(timeout)
    if idle_timeout is not None:
        body["idle_timeout_s"] = int(idle_timeout)
    all_labels = dict(labels or {})
    if job is not None:
        all_labels[JOB_LABEL] = job
    if all_labels:
        body["labels"] = all_labels
    if env:
        body["env"] = dict(env)
    if workdir is not None:
        body["workdir"] = workdir
    if user is not None:
        body["user"] = user
    if qos is not None:
        body["qos"] = qos
    if network is not None:
        body["network"] = network_body(network)
    fs: Dict[str, Any] = {}
    if writable:
        fs["writable"] = [str(p) for p in writable]
    if tcp_bind is not None:
        fs["tcp_bind"] = [int(p) for p in tcp_bind]
    if tcp_connect is not None:
        fs["tcp_connect"] = [int(p) for p in tcp_connect]
    if fs:
        body["filesystem"] = fs
    if model_access is not None:
        body["model_access"] = model_access_body(model_access)
    if timings:
        body["timings"] = True
    if isolation is not None:
        body["isolation"] = isolation
    return body


def model_access_body(access: Any) -> Dict[str, Any]:
    """``model_access`` for the wire from a :class:`ModelAccess`, a dict of its fields, or
    a list of model names."""
    if isinstance(access, ModelAccess):
        return access.model_dump(exclude_none=True)
    if isinstance(access, Mapping):
        return ModelAccess.model_validate(dict(access)).model_dump(exclude_none=True)
    if isinstance(access, str):
        return {"models": [access]}
    return {"models": [str(m) for m in access]}


def process_body(
    cmd: Command,
    env: Optional[Mapping[str, str]],
    cwd: Optional[str],
    pty: Optional[Tuple[int, int]],
    tag: Optional[str],
    timeout: Optional[float],
    user: Optional[str],
) -> Dict[str, Any]:
    """The ``POST .../processes`` body for :meth:`Sandbox.start` (and its async twin)."""
    body: Dict[str, Any] = {"cmd": _cmd(cmd)}
    if env:
        body["env"] = dict(env)
    if cwd is not None:
        body["cwd"] = cwd
    if pty is not None:
        body["pty"] = {"cols": int(pty[0]), "rows": int(pty[1])}
    if tag is not None:
        body["tag"] = tag
    if timeout is not None:
        body["timeout_s"] = float(timeout)
    if user is not None:
        body["user"] = user
    return body


def collect_output(events: Iterable[Any]) -> Tuple[str, str, Optional[Any]]:
    """Stdout, stderr and the exit event (``None`` if the stream ended first) of events."""
    out, err, exit_ev = [], [], None
    for ev in events:
        if isinstance(ev, StdoutEvent):
            out.append(ev.data)
        elif isinstance(ev, StderrEvent):
            err.append(ev.data)
        elif isinstance(ev, ExitEvent):
            exit_ev = ev
    return "".join(out), "".join(err), exit_ev


def network_body(network: Any) -> Dict[str, Any]:
    """A network policy for the wire from ``"none"``/``"open"``, a list of allowed
    destinations (an allowlist), a dict or a :class:`dsec.Network`."""
    if isinstance(network, Network):
        return network.model_dump()
    if isinstance(network, str):
        return {"mode": network, "allow": []}
    if isinstance(network, Mapping):
        return Network.model_validate(dict(network)).model_dump()
    return {"mode": "allowlist", "allow": [str(a) for a in network]}


T = TypeVar("T")


def _record_full(e: DsecError) -> bool:
    """Whether ``e`` is the sandbox refusing a new request id because its record of calls
    is full (65,536 calls): calls without an id still run."""
    return isinstance(e, NoSpace) and "without a request id" in str(e)


class Sandbox:
    """One sandbox. Make one with :meth:`Sandbox.create` (or attach with :meth:`Sandbox.connect`).

    A ``Sandbox`` is a context manager that always deletes the sandbox on exit::

        with dsec.Sandbox.create(image="base") as sb:
            print(sb.exec("echo hi").stdout)
    """

    def __init__(self, client: Client, info: SandboxInfo) -> None:
        self.client = client
        self.info = info
        # The sandbox recorded as many calls as it keeps: default ids stop.
        self._record_full = False

    # ------------------------------------------------------------ lifecycle

    @classmethod
    def create(
        cls,
        client: Optional[Client] = None,
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
        idle_timeout: Optional[int] = None,
        network: Union[str, Sequence[str], Mapping[str, Any], Network, None] = None,
        writable: Optional[Sequence[str]] = None,
        tcp_bind: Optional[Sequence[int]] = None,
        tcp_connect: Optional[Sequence[int]] = None,
        user: Optional[str] = None,
        pool: Optional[str] = None,
        max_wait: Optional[float] = None,
        model_access: Union[ModelAccess, Mapping[str, Any], Sequence[str], None] = None,
        timings: bool = False,
        isolation: Optional[str] = None,
    ) -> "Sandbox":
        """Creates a sandbox and returns when it is ready.

        Args:
            client: Client to use; default :func:`dsec.default_client` (from the environment).
            image: Image name or ``sha256:`` digest; the server's default is ``base``.
                A registry reference (``"ghcr.io/org/app:v1"``) the server has not
                pulled yet is pulled first (if its ``--allow-registry`` allows it).
            layers: More images stacked on top of ``image``, bottom first.
            resources: ``Resources`` or a dict with ``cpu``, ``memory_mb``, ``pids``, ``disk_mb``.
            timeout: Lifetime in seconds (server default one hour).
            labels: Free-form labels, filterable in list.
            job: Sets the ``job`` label: :func:`suspend_job` / :func:`resume_job` act on it.
            env: Environment of every command.
            workdir: Default working directory of commands.
            qos: ``"latency_sensitive"`` (default) or ``"best_effort"``.
            auto_resume: When paused, resume on use instead of raising :class:`dsec.Paused`.
            idle_timeout: Delete after this many seconds without API activity.
            network: ``"none"`` (default: loopback only), ``"open"``, or the allowed
                destinations of an allowlist, e.g. ``["pypi.org:443", "*.pythonhosted.org"]``
                (names, ``*.suffix``, IPs or CIDRs, each with an optional ``:port``).
            writable: Commands may write only beneath these absolute paths (Landlock);
                the files API is not bound by it.
            tcp_bind, tcp_connect: When given, the only TCP ports commands may bind or
                connect to (Landlock).
            user: Default user of commands (a name in the image, or ``"UID[:GID]"``);
                default: the image's user, else root.
            pool: Claim a warm sandbox of this pool (:meth:`dsec.Client.create_pool`)
                instead of making one; the environment is the pool's, so leave
                ``image``, ``resources``, ``env`` and the other environment arguments unset.
            max_wait: With ``pool``: wait at most this many seconds for a warm sandbox
                (server default 30), then raise :class:`dsec.Capacity`.
            model_access: Models code in the sandbox may call through the server's model
                gateway: a list of model names, or a :class:`ModelAccess` (or dict) with
                limits (``budget_tokens``, ``rpm``, ``tpm``, ``max_concurrency``,
                ``timeout_s``). The sandbox gets its own token in ``OPENAI_API_KEY`` and the
                gateway's URL in ``OPENAI_BASE_URL``; its network reaches the gateway
                whatever ``network`` says, and the token dies with the sandbox.
            timings: Fill ``info.timings`` (:class:`CreateTimings`) with where the
                create's time went, phase by phase (the record keeps them either way:
                :meth:`refresh` shows them).
            isolation: ``"container"`` (default: dsec's own), ``"gvisor"`` (gVisor's
                user-space kernel serves the sandbox's system calls), ``"microvm"`` (a
                QEMU microVM with a kernel of its own), ``"vm"`` (a full machine booting
                the image's own systemd) or ``"oci"`` (the node's OCI runtime);
                :meth:`dsec.Client.health` lists what the node offers.

        Connection errors and ``capacity`` answers are retried with exponential backoff
        (``Client.create_retries`` times, default 5); other errors are raised at once.
        """
        client = client or default_client()
        body = create_body(
            image=image, layers=layers, resources=resources, timeout=timeout,
            idle_timeout=idle_timeout, labels=labels, job=job, env=env, workdir=workdir,
            qos=qos, auto_resume=auto_resume, network=network, writable=writable,
            tcp_bind=tcp_bind, tcp_connect=tcp_connect, user=user, pool=pool, max_wait=max_wait,
            model_access=model_access, timings=timings, isolation=isolation,
        )
        return cls(client, client.create_sandbox(body))

    @classmethod
    def connect(cls, sandbox_id: str, client: Optional[Client] = None) -> "Sandbox":
        """Attaches to an existing sandbox by id."""
        client = client or default_client()
        return cls(client, client.get_sandbox(sandbox_id))

    @property
    def id(self) -> str:
        """The sandbox id (also its hostname)."""
        return self.info.id

    @property
    def _base(self) -> str:
        return f"/sandboxes/{_seg(self.info.id)}"

    def refresh(self) -> SandboxInfo:
        """Re-reads the sandbox from the server (``GET /v1/sandboxes/{id}``)."""
        self.info = self.client.get_sandbox(self.id)
        return self.info

    def kill(self) -> None:
        """Deletes the sandbox (``DELETE /v1/sandboxes/{id}``)."""
        self.client.delete_sandbox(self.id)

    def pause(self) -> PauseResult:
        """Freezes the sandbox and gives its memory back; calls then raise :class:`dsec.Paused`."""
        res = PauseResult.model_validate(self.client._json("POST", f"{self._base}/pause", timeout=None))
        self.info = res.sandbox
        return res

    def resume(self) -> SandboxInfo:
        """Continues a paused sandbox where it stopped."""
        self.info = SandboxInfo.model_validate(self.client._json("POST", f"{self._base}/resume", timeout=None))
        return self.info

    def set_timeout(self, seconds: int) -> SandboxInfo:
        """The sandbox now expires ``seconds`` from now."""
        body = {"timeout_s": int(seconds)}
        self.info = SandboxInfo.model_validate(self.client._json("POST", f"{self._base}/timeout", json_body=body))
        return self.info

    def set_network(self, network: Union[str, Sequence[str], Mapping[str, Any], Network]) -> SandboxInfo:
        """Replaces the network policy of a networked sandbox (``open`` or an allowlist)."""
        self.info = SandboxInfo.model_validate(
            self.client._json("PUT", f"{self._base}/network", json_body=network_body(network))
        )
        return self.info

    def screenshot(self) -> bytes:
        """A full VM's screen (isolation ``"vm"``), as PNG bytes."""
        return self.client.request("GET", f"{self._base}/screen").content

    def type(self, text: Optional[str] = None, *, keys: Sequence[str] = ()) -> None:
        """Types into a full VM's keyboard (isolation ``"vm"``): ``text`` key by key (US
        layout, ``\\n`` is Enter), then each chord of ``keys`` (``"ret"``, ``"ctrl+c"``,
        ``"ctrl+alt+f2"``; QEMU's key names)."""
        events: List[Dict[str, Any]] = []
        if text:
            events.append({"type": "text", "text": text})
        for chord in keys:
            events.append({"type": "keys", "keys": chord.split("+")})
        if not events:
            raise ValueError("nothing to type: give text or keys")
        self.send_input(events)

    def click(self, x: int, y: int, *, button: str = "left", count: int = 1) -> None:
        """Clicks a full VM's pointer at pixel (``x``, ``y``) of its screen (a screenshot's
        coordinates): ``button`` is ``"left"``, ``"right"`` or ``"middle"``, ``count`` 2 a
        double click."""
        self.send_input([{"type": "click", "x": x, "y": y, "button": button, "count": count}])

    def move(self, x: int, y: int) -> None:
        """Moves a full VM's pointer to pixel (``x``, ``y``)."""
        self.send_input([{"type": "move", "x": x, "y": y}])

    def scroll(self, dy: int) -> None:
        """Turns a full VM's mouse wheel by ``dy`` notches (positive scrolls down)."""
        self.send_input([{"type": "scroll", "dy": dy}])

    def send_input(self, events: Sequence[Dict[str, Any]]) -> None:
        """Sends raw input events to a full VM, in order: ``text``, ``keys``, ``move``,
        ``click``, ``button`` (press or release, for drags) and ``scroll`` (see the API's
        ``InputEvent``)."""
        self.client.request("POST", f"{self._base}/input", json_body={"events": list(events)}, timeout=None)

    def commit(self, name: str) -> Image:
        """Saves the sandbox's files as a new image ``name``."""
        return Image.model_validate(
            self.client._json("POST", f"{self._base}/commit", json_body={"name": name}, timeout=None)
        )

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.kill()
        except (NotFound, Expired):
            pass

    def __repr__(self) -> str:
        return f"dsec.Sandbox(id={self.id!r}, state={self.info.state!r})"

    # ------------------------------------------------------------ exec

    @staticmethod
    def _exec_body(
        cmd: Command,
        env: Optional[Mapping[str, str]],
        cwd: Optional[str],
        stdin: Union[str, bytes, None],
        timeout: Optional[float],
        output_limit: Optional[int],
        user: Optional[str] = None,
    ) -> Dict[str, Any]:
        body: Dict[str, Any] = {"cmd": _cmd(cmd)}
        if user is not None:
            body["user"] = user
        if env:
            body["env"] = dict(env)
        if cwd is not None:
            body["cwd"] = cwd
        if stdin is not None:
            body["stdin"] = _text(stdin)
        if timeout is not None:
            body["timeout_s"] = float(timeout)
        if output_limit is not None:
            body["output_limit"] = int(output_limit)
        return body

    def _request_id(self, request_id: Optional[str]) -> Optional[str]:
        if request_id is None and self.client.record_calls and not self._record_full:
            # Unique, and never another sandbox's: ids name one call on one sandbox.
            return f"{self.id}.{uuid.uuid4().hex}"
        return request_id

    def _recorded(self, request_id: Optional[str], send: Callable[[Optional[str]], T], resendable: bool = True) -> T:
        """``send(rid)`` with the call's request id (``request_id``, else a fresh one unless
        recording is off), sent again after a lost connection when that is safe. A
        sandbox whose record of calls is full refuses new ids: a call whose id this SDK
        made then goes without one, as do the sandbox's later calls; a call given an id
        by its caller raises :class:`NoSpace`."""
        rid = self._request_id(request_id)
        try:
            return self.client.retried(lambda: send(rid), rid is not None and resendable)
        except NoSpace as e:
            if request_id is not None or rid is None or not resendable or not _record_full(e):
                raise
            self._record_full = True
            return send(None)

    def exec(
        self,
        cmd: Command,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        stdin: Union[str, bytes, None] = None,
        timeout: Optional[float] = None,
        *,
        output_limit: Optional[int] = None,
        user: Optional[str] = None,
        request_id: Optional[str] = None,
    ) -> ExecResult:
        """Runs a command to completion.

        Args:
            cmd: A string is a shell command line (``/bin/sh -c``); a list is an argv.
            env: Extra environment variables.
            cwd: Working directory.
            stdin: Text fed to stdin, then closed (bytes must be UTF-8).
            timeout: Kill the process tree after this many seconds (``timed_out`` is set).
            output_limit: Cap on recorded output per stream, bytes.
            user: Run as this user (a name in the sandbox, or ``"UID[:GID]"``).
            request_id: The call's id (at most 256 bytes): the server runs it once, a
                retry with the same id gets its result (or waits for it), and a different
                call with the id is refused (:class:`Conflict`). Default: a fresh one,
                unless the client's ``record_calls`` is off. A connection lost meanwhile
                is retried with it (``call_retries``), safely.

        A non-zero exit is not an exception: check ``result.exit_code`` / ``result.ok``.
        """
        body = self._exec_body(cmd, env, cwd, stdin, timeout, output_limit, user)
        data = self._recorded(
            request_id,
            lambda rid: self.client._json(
                "POST", f"{self._base}/exec", json_body=_with_id(body, "request_id", rid),
                timeout=Client._exec_timeout(timeout),
            ),
        )
        return ExecResult.model_validate(data)

    def exec_stream(
        self,
        cmd: Command,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        stdin: Union[str, bytes, None] = None,
        timeout: Optional[float] = None,
        *,
        output_limit: Optional[int] = None,
        user: Optional[str] = None,
        request_id: Optional[str] = None,
    ) -> Iterator[Any]:
        """Runs a command and yields its events as they happen: :class:`StartedEvent`,
        :class:`StdoutEvent` / :class:`StderrEvent` chunks, and a final :class:`ExitEvent`.
        Arguments as for :meth:`exec`. An ``error`` event is raised as a :class:`DsecError`.

        With a request id (the default), a connection lost mid-stream is retried: the retry
        attaches to the same command and the output already yielded is not repeated."""
        body = self._exec_body(cmd, env, cwd, stdin, timeout, output_limit, user)
        rid = self._request_id(request_id)
        if rid is None:
            return self.client.stream_events(f"{self._base}/exec/stream", body, timeout)
        return self._attached_stream(body, rid, timeout, own_id=request_id is None)

    def _attached_stream(
        self, plain: Dict[str, Any], rid: str, timeout: Optional[float], own_id: bool
    ) -> Iterator[Any]:
        """Events of a recorded exec, attaching again after a lost connection and skipping
        what was yielded before (a retry streams from the command's first byte). A
        sandbox whose record is full runs it without the id when this SDK made it."""
        body = {**plain, "request_id": rid}
        seen = {"stdout": 0, "stderr": 0}
        started = False
        attempt = 0
        while True:
            # What this attempt still has to skip, per stream.
            skip = dict(seen)
            try:
                for ev in self.client.stream_events(f"{self._base}/exec/stream", body, timeout):
                    if isinstance(ev, (StdoutEvent, StderrEvent)):
                        kind = "stdout" if isinstance(ev, StdoutEvent) else "stderr"
                        if skip[kind] >= len(ev.data):
                            skip[kind] -= len(ev.data)
                            continue
                        if skip[kind]:
                            ev = ev.model_copy(update={"data": ev.data[skip[kind]:]})
                            skip[kind] = 0
                        seen[kind] += len(ev.data)
                    elif not isinstance(ev, ExitEvent):
                        if started:
                            continue
                        started = True
                    yield ev
                return
            except NoSpace as e:
                if not own_id or started or not _record_full(e):
                    raise
                self._record_full = True
                yield from self.client.stream_events(f"{self._base}/exec/stream", plain, timeout)
                return
            except ConnectionFailed:
                if attempt >= self.client.call_retries:
                    raise
                self.client.retry_delay(attempt)
                attempt += 1

    def replay(self, steps: Iterable[Mapping[str, Any]]) -> List[ExecResult]:
        """Re-issues a trajectory's execs, in order, each with its ``request_id``: a call
        that ran already answers its recorded result without running again, one still
        running is waited for, one that never reached the server runs now. Each step is
        the keyword arguments of :meth:`exec` (``cmd`` and ``request_id`` required)."""
        results = []
        for step in steps:
            step = dict(step)
            if not step.get("request_id"):
                raise ValueError(f"replay step without a request_id: {step!r}")
            cmd = step.pop("cmd")
            results.append(self.exec(cmd, **step))
        return results

    def log(
        self,
        after: Optional[int] = None,
        limit: Optional[int] = None,
        output: bool = False,
        request_id: Optional[str] = None,
    ) -> CallLog:
        """``GET /v1/sandboxes/{id}/log``: a page of the calls that carried a request id,
        oldest first, with their arguments, times and exits (and kept output with
        ``output=True``)."""
        params: List[Tuple[str, str]] = []
        if after is not None:
            params.append(("after", str(after)))
        if limit is not None:
            params.append(("limit", str(limit)))
        if output:
            params.append(("output", "true"))
        if request_id is not None:
            params.append(("request_id", request_id))
        return CallLog.model_validate(self.client._json("GET", f"{self._base}/log", params=params))

    def calls(self, output: bool = False) -> List[CallRecord]:
        """Every recorded call, all pages (what a trainer needs to rebuild its trajectory)."""
        out: List[CallRecord] = []
        after: Optional[int] = None
        while True:
            page = self.log(after=after, limit=1000, output=output)
            out.extend(page.calls)
            if page.next_after is None:
                return out
            after = page.next_after

    def fork(
        self,
        count: int,
        *,
        labels: Optional[Mapping[str, str]] = None,
        env: Optional[Mapping[str, str]] = None,
        workdir: Optional[str] = None,
        user: Optional[str] = None,
        timeout: Optional[int] = None,
        resources: Optional[Mapping[str, Any]] = None,
    ) -> List["Sandbox"]:
        """``POST /v1/sandboxes/{id}/fork``: ``count`` new sandboxes whose files equal this
        one's now (captured once, shared by all; this one keeps running). Env, workdir,
        user, resources and policies carry over unless given here; processes do not."""
        body: Dict[str, Any] = {"count": int(count)}
        if labels is not None:
            body["labels"] = dict(labels)
        if env:
            body["env"] = dict(env)
        if workdir is not None:
            body["workdir"] = workdir
        if user is not None:
            body["user"] = user
        if timeout is not None:
            body["timeout_s"] = int(timeout)
        if resources:
            body["resources"] = dict(resources)
        data = self.client._json("POST", f"{self._base}/fork", json_body=body, timeout=None)
        return [Sandbox(self.client, SandboxInfo.model_validate(sb)) for sb in data["sandboxes"]]

    # ------------------------------------------------------------ sessions

    def session(
        self,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        name: Optional[str] = None,
        user: Optional[str] = None,
    ) -> "Session":
        """Opens a persistent bash session: cwd, variables and shell state carry over
        between :meth:`Session.run` calls. Use it as a context manager to close it."""
        body: Dict[str, Any] = {}
        if name is not None:
            body["session"] = name
        if env:
            body["env"] = dict(env)
        if cwd is not None:
            body["cwd"] = cwd
        if user is not None:
            body["user"] = user
        info = SessionInfo.model_validate(self.client._json("POST", f"{self._base}/sessions", json_body=body))
        return Session(self, info)

    # ------------------------------------------------------------ background processes

    def start(
        self,
        cmd: Command,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        *,
        pty: Optional[Tuple[int, int]] = None,
        tag: Optional[str] = None,
        timeout: Optional[float] = None,
        user: Optional[str] = None,
        request_id: Optional[str] = None,
    ) -> "Process":
        """Starts a background process and returns at once.

        Args:
            cmd, env, cwd, user: As for :meth:`exec`.
            pty: ``(cols, rows)`` to run under a terminal (stdout and stderr merge).
            tag: A label to find the process again in :meth:`processes`.
            timeout: Kill the process tree after this many seconds.
            request_id: As for :meth:`exec` (a fresh one by default): a retried start
                starts one process.

        Its output is kept by the sandbox, so any client can re-attach later with
        :meth:`process` and read from any offset.
        """
        body = process_body(cmd, env, cwd, pty, tag, timeout, user)
        data = self._recorded(
            request_id,
            lambda rid: self.client._json(
                "POST", f"{self._base}/processes", json_body=_with_id(body, "request_id", rid)
            ),
        )
        return Process(self, ProcessInfo.model_validate(data))

    def processes(self) -> List[ProcessInfo]:
        """The sandbox's background processes (running and recently ended)."""
        data = self.client._json("GET", f"{self._base}/processes")
        return [ProcessInfo.model_validate(p) for p in data["processes"]]

    def process(self, pid: int) -> "Process":
        """Re-attaches to background process ``pid`` (raises :class:`dsec.NotFound`)."""
        for p in self.processes():
            if p.pid == pid:
                return Process(self, p)
        raise NotFound(f"no process {pid} in sandbox {self.id}")

    # ------------------------------------------------------------ directories

    def upload_dir(self, local_dir: str, remote_dir: str, *, request_id: Optional[str] = None) -> int:
        """Copies the contents of local directory ``local_dir`` into ``remote_dir``
        (created with its parents); returns the bytes of the archive sent.

        ``request_id`` is as for :meth:`write` (a fresh one by default): a retry after a
        lost connection extracts the archive once."""
        data = tar_directory(local_dir)
        self.mkdir(remote_dir)
        params = {"path": remote_dir}
        self._recorded(
            request_id,
            lambda rid: self.client.request(
                "PUT", f"{self._base}/files/tar", params=_with_id(params, "request_id", rid), content=data,
                headers={"content-type": "application/x-tar"}, timeout=None,
            ),
        )
        return len(data)

    def download_dir(self, remote_dir: str, local_dir: str) -> None:
        """Copies the contents of ``remote_dir`` into local directory ``local_dir``
        (created if missing). Entries that would land or link outside ``local_dir`` are
        refused before anything is written."""
        data = self.client.request("GET", f"{self._base}/files/tar", params={"path": remote_dir}, timeout=None).content
        extract_tar(data, local_dir)

    # ------------------------------------------------------------ files

    def write(
        self,
        path: str,
        data: Union[bytes, bytearray, memoryview, str, IO[bytes], Iterable[bytes]],
        mode: Optional[int] = None,
        *,
        request_id: Optional[str] = None,
    ) -> int:
        """Writes a file (parents are created); returns the bytes written.

        ``data`` may be bytes, a str (written as UTF-8), a binary file object or an
        iterable of byte chunks (both streamed). ``mode`` is the permission bits (e.g. 0o755).

        ``request_id`` records the write under that id (a fresh one by default, unless
        the client's ``record_calls`` is off): a retry with the same id and bytes gets
        the first answer without writing again, other bytes are a ``Conflict``. Bytes
        and str bodies are sent again after a lost connection; streamed ones cannot be.
        """
        content: Any
        if isinstance(data, str):
            content = data.encode("utf-8")
        elif isinstance(data, (bytearray, memoryview)):
            content = bytes(data)
        elif hasattr(data, "read"):
            f = data

            def chunks() -> Iterator[bytes]:
                while True:
                    b = f.read(1 << 20)  # type: ignore[union-attr]
                    if not b:
                        return
                    yield b

            content = chunks()
        else:
            content = data
        params: Dict[str, str] = {"path": path}
        if mode is not None:
            params["mode"] = f"0o{mode:o}"
        data_json = self._recorded(
            request_id,
            lambda rid: self.client._json(
                "PUT",
                f"{self._base}/files",
                params=_with_id(params, "request_id", rid),
                content=content,
                headers={"content-type": "application/octet-stream"},
                timeout=None,
            ),
            # A streamed body is gone once sent.
            resendable=isinstance(content, bytes),
        )
        return WriteResult.model_validate(data_json).bytes

    def read(self, path: str, offset: int = 0, length: Optional[int] = None) -> bytes:
        """Reads a file (or ``length`` bytes from ``offset``)."""
        params: Dict[str, Any] = {"path": path}
        if offset:
            params["offset"] = offset
        if length is not None:
            params["length"] = length
        return self.client.request("GET", f"{self._base}/files", params=params, timeout=None).content

    def list(self, path: str) -> List[FileInfo]:
        """Lists a directory, sorted by name."""
        data = self.client._json("GET", f"{self._base}/files/list", params={"path": path})
        return [FileInfo.model_validate(e) for e in data["entries"]]

    def stat(self, path: str) -> FileInfo:
        """Metadata of one entry (symlinks are not followed)."""
        return FileInfo.model_validate(self.client._json("GET", f"{self._base}/files/stat", params={"path": path}))

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists in the sandbox."""
        try:
            self.stat(path)
            return True
        except NotFound:
            return False

    def remove(self, path: str, recursive: bool = False) -> None:
        """Removes a file, or a directory (with its contents when ``recursive``)."""
        params = {"path": path, "recursive": "true" if recursive else "false"}
        self.client.request("DELETE", f"{self._base}/files", params=params)

    def mkdir(self, path: str) -> None:
        """Creates a directory with its parents."""
        self.client.request("POST", f"{self._base}/files/mkdir", json_body={"path": path})

    def rename(self, src: str, dst: str) -> None:
        """Renames (moves) ``src`` to ``dst``."""
        self.client.request("POST", f"{self._base}/files/rename", json_body={"from": src, "to": dst})


class Session:
    """A persistent bash session in a sandbox (see :meth:`Sandbox.session`)."""

    def __init__(self, sandbox: Sandbox, info: SessionInfo) -> None:
        self.sandbox = sandbox
        self.info = info
        self.closed = False

    @property
    def id(self) -> str:
        """The session id."""
        return self.info.session

    @property
    def _base(self) -> str:
        return f"{self.sandbox._base}/sessions/{_seg(self.id)}"

    def run(self, command: str, timeout: Optional[float] = None, *, request_id: Optional[str] = None) -> SessionResult:
        """Runs a command line in the session's shell; ``output`` is stdout and stderr
        combined. On ``timeout`` the command is interrupted and the session stays usable.
        ``request_id`` as for :meth:`Sandbox.exec` (a fresh one by default): a lost
        connection is retried, and the command runs once."""
        body: Dict[str, Any] = {"command": command}
        if timeout is not None:
            body["timeout_s"] = float(timeout)
        client = self.sandbox.client
        data = self.sandbox._recorded(
            request_id,
            lambda rid: client._json(
                "POST", f"{self._base}/run", json_body=_with_id(body, "request_id", rid),
                timeout=Client._exec_timeout(timeout),
            ),
        )
        return SessionResult.model_validate(data)

    def interrupt(self) -> None:
        """Sends Ctrl-C to the running command."""
        self.sandbox.client.request("POST", f"{self._base}/interrupt")

    def close(self) -> None:
        """Ends the session's shell (idempotent; a gone sandbox is fine)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.sandbox.client.request("DELETE", self._base)
        except (NotFound, Expired):
            pass

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def suspend_job(job: str, client: Optional[Client] = None) -> JobResult:
    """Pauses every sandbox labelled ``job=JOB``; their lifetimes stop until :func:`resume_job`."""
    return (client or default_client()).suspend_job(job)


def resume_job(job: str, client: Optional[Client] = None) -> JobResult:
    """Resumes every sandbox of a suspended job."""
    return (client or default_client()).resume_job(job)


class Process:
    """A background process in a sandbox (see :meth:`Sandbox.start`)."""

    def __init__(self, sandbox: Sandbox, info: ProcessInfo) -> None:
        self.sandbox = sandbox
        self.info = info

    @property
    def pid(self) -> int:
        """Its pid inside the sandbox."""
        return self.info.pid

    @property
    def _base(self) -> str:
        return f"{self.sandbox._base}/processes/{self.pid}"

    def output(self, follow: bool = False, stdout_offset: int = 0, stderr_offset: int = 0) -> Iterator[Any]:
        """Its recorded output from the given byte offsets as events; with ``follow``,
        live until it exits (the last event is then :class:`ExitEvent`), else up to now
        (ending with :class:`EndEvent`, whose offsets continue the next read)."""
        params = {"follow": "true" if follow else "false",
                  "stdout_offset": stdout_offset, "stderr_offset": stderr_offset}
        return self.sandbox.client.stream_events(f"{self._base}/output", None, None, method="GET", params=params)

    def wait(self) -> ExecResult:
        """Waits for it to exit; its whole recorded output and exit status."""
        out, err, ev = collect_output(self.output(follow=True))
        exit_fields = ev.model_dump(exclude={"type"}) if ev is not None else {}
        return ExecResult.model_validate({"stdout": out, "stderr": err, **exit_fields})

    def send_stdin(self, data: Union[str, bytes], close: bool = False) -> None:
        """Writes ``data`` (UTF-8) to its stdin; ``close`` closes stdin afterwards."""
        body = {"data": _text(data) or "", "close": close}
        self.sandbox.client.request("POST", f"{self._base}/stdin", json_body=body)

    def close_stdin(self) -> None:
        """Closes its stdin (EOF)."""
        self.send_stdin("", close=True)

    def signal(self, signal: Union[str, int] = "SIGTERM") -> None:
        """Sends ``signal`` (a name like ``"SIGINT"`` or a number) to its process group."""
        self.sandbox.client.request("POST", f"{self._base}/signal", json_body={"signal": str(signal)})

    def kill(self) -> None:
        """Sends SIGKILL to its process group."""
        self.signal("SIGKILL")

    def resize(self, cols: int, rows: int) -> None:
        """Resizes its terminal (processes started with ``pty``)."""
        self.sandbox.client.request("POST", f"{self._base}/resize", json_body={"cols": cols, "rows": rows})

    def refresh(self) -> ProcessInfo:
        """Re-reads its state (``exit`` is set once it ended)."""
        self.info = self.sandbox.process(self.pid).info
        return self.info

    def __repr__(self) -> str:
        return f"dsec.Process(pid={self.pid}, sandbox={self.sandbox.id!r})"


def _with_id(fields: Dict[str, Any], name: str, rid: Optional[str]) -> Dict[str, Any]:
    """``fields`` with ``name`` set to ``rid`` (a copy), or as they are without one."""
    return fields if rid is None else {**fields, name: rid}

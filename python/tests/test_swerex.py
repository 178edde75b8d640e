"""The unmodified `swe-rex` package (SWE-agent's runtime client) driving a dsec sandbox
through dsec's SWE-ReX front at /swerex/{sandbox_id}."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

import dsec

try:
    import swerex.runtime.remote as swerex_remote
except ImportError as e:  # CI must run these: fail there instead of skipping
    if os.environ.get("CI") in ("true", "1"):
        raise
    pytest.skip(f"swe-rex not installed: {e}", allow_module_level=True)
from swerex.exceptions import (  # noqa: E402
    CommandTimeoutError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
)
from swerex.runtime.abstract import (  # noqa: E402
    BashAction,
    BashInterruptAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)


def test_remote_runtime_drives_a_dsec_sandbox(server, sandbox: dsec.Sandbox, tmp_path: Path) -> None:
    rt = swerex_remote.RemoteRuntime(host=f"{server.url}/swerex/{sandbox.id}", port=None, auth_token=server.key)

    async def episode() -> None:
        assert (await rt.is_alive()).is_alive
        await rt.create_session(CreateBashSessionRequest(session="main"))
        with pytest.raises(SessionExistsError):
            await rt.create_session(CreateBashSessionRequest(session="main"))
        obs = await rt.run_in_session(BashAction(session="main", command="cd /tmp && export X=7"))
        assert obs.exit_code == 0
        obs = await rt.run_in_session(BashAction(session="main", command="echo $X; pwd"))
        assert obs.output.split() == ["7", "/tmp"]
        with pytest.raises(NonZeroExitCodeError):
            await rt.run_in_session(BashAction(session="main", command="false"))
        obs = await rt.run_in_session(BashAction(session="main", command="(exit 3)", check="silent"))
        assert obs.exit_code == 3
        with pytest.raises(CommandTimeoutError):
            await rt.run_in_session(BashAction(session="main", command="sleep 30", timeout=1))
        # The session survives its timeout.
        obs = await rt.run_in_session(BashAction(session="main", command="echo alive"))
        assert obs.output.strip() == "alive"
        await rt.run_in_session(BashInterruptAction(session="main"))
        with pytest.raises(SessionDoesNotExistError):
            await rt.run_in_session(BashAction(session="nope", command="true"))

        r = await rt.execute(Command(command="echo out; echo err >&2", shell=True))
        assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 0)
        r = await rt.execute(Command(command=["python3", "-c", "print(6*7)"]))
        assert r.stdout == "42\n"
        r = await rt.execute(Command(command="echo a; echo b >&2", shell=True, merge_output_streams=True))
        assert r.stdout == "a\nb\n"
        r = await rt.execute(Command(command="pwd", shell=True, cwd="/etc", env={"Y": "1"}))
        assert r.stdout == "/etc\n"
        with pytest.raises(NonZeroExitCodeError):
            await rt.execute(Command(command="exit 4", shell=True, check=True))

        await rt.write_file(WriteFileRequest(path="/work/notes/a.txt", content="héllo\n"))
        assert (await rt.read_file(ReadFileRequest(path="/work/notes/a.txt"))).content == "héllo\n"
        with pytest.raises(FileNotFoundError):
            await rt.read_file(ReadFileRequest(path="/work/none"))

        # upload: a file as is, a directory zipped and extracted inside the sandbox.
        (tmp_path / "one.txt").write_text("one\n")
        (tmp_path / "tree" / "sub").mkdir(parents=True)
        (tmp_path / "tree" / "sub" / "two.txt").write_text("two\n")
        await rt.upload(UploadRequest(source_path=str(tmp_path / "one.txt"), target_path="/work/up/one.txt"))
        await rt.upload(UploadRequest(source_path=str(tmp_path / "tree"), target_path="/work/up/tree"))
        r = await rt.execute(Command(command="cat /work/up/one.txt /work/up/tree/sub/two.txt", shell=True))
        assert r.stdout == "one\ntwo\n"

        await rt.close_session(CloseBashSessionRequest(session="main"))
        with pytest.raises(SessionDoesNotExistError):
            await rt.close_session(CloseBashSessionRequest(session="main"))
        await rt.close()

    asyncio.run(episode())
    # close() does not delete: the sandbox belongs to the dsec API.
    assert sandbox.exec("true").exit_code == 0


def test_swerex_front_needs_the_api_key(server, sandbox: dsec.Sandbox) -> None:
    rt = swerex_remote.RemoteRuntime(host=f"{server.url}/swerex/{sandbox.id}", port=None, auth_token="wrong")
    assert not asyncio.run(rt.is_alive()).is_alive


def test_a_retried_swerex_execute_runs_once(server, sandbox: dsec.Sandbox) -> None:
    # swe-rex sends one X-Request-ID with a call and all its retries (RemoteRuntime._request).
    import json
    import urllib.request

    def execute() -> dict:
        req = urllib.request.Request(
            f"{server.url}/swerex/{sandbox.id}/execute",
            data=json.dumps({"command": "echo x >> /root/swerex-f; wc -l < /root/swerex-f", "shell": True}).encode(),
            headers={"Content-Type": "application/json", "X-API-Key": server.key, "X-Request-ID": "retry-1"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read())

    first, retry = execute(), execute()
    assert first["stdout"].strip() == "1" and retry == first
    assert sandbox.exec("wc -l < /root/swerex-f").stdout.strip() == "1"
    assert [c.request_id for c in sandbox.calls()][:1] == ["swerex.retry-1"]

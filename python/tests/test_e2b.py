"""The unmodified `e2b` SDK (from PyPI) against dsec's E2B front, configured only through
E2B's own environment variables. Each test covers calls README's E2B section lists."""

from __future__ import annotations

import time
from typing import Iterator

import pytest

import e2b  # installed by run-tests.sh (pinned)
from e2b import CommandExitException, Sandbox
from e2b.sandbox.commands.command_handle import PtySize
from e2b.sandbox.filesystem.filesystem import WriteEntry
from e2b.sandbox.sandbox_api import SandboxQuery


@pytest.fixture
def e2b_env(server, monkeypatch) -> None:
    monkeypatch.setenv("E2B_API_URL", f"{server.url}/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", f"{server.url}/e2b/envd")
    monkeypatch.setenv("E2B_API_KEY", server.key)
    monkeypatch.setenv("E2B_VALIDATE_API_KEY", "false")


@pytest.fixture
def sbx(e2b_env) -> Iterator[Sandbox]:
    sb = Sandbox.create(template="base", timeout=300, metadata={"suite": "e2b"}, envs={"GLOBAL": "g"})
    try:
        yield sb
    finally:
        sb.kill()


def test_lifecycle_list_timeout_connect_kill(e2b_env) -> None:
    sb = Sandbox.create(template="base", timeout=120, metadata={"task": "t-1", "run": "a b"})
    try:
        info = sb.get_info()
        assert info.template_id == "base" and info.metadata == {"task": "t-1", "run": "a b"}
        assert info.state.value == "running"
        found = Sandbox.list(query=SandboxQuery(metadata={"run": "a b"})).next_items()
        assert [s.sandbox_id for s in found] == [sb.sandbox_id]
        assert Sandbox.list(query=SandboxQuery(metadata={"run": "other"})).next_items() == []
        before = info.end_at
        sb.set_timeout(600)
        assert sb.get_info().end_at > before
        again = Sandbox.connect(sb.sandbox_id)
        assert again.commands.run("echo again").stdout == "again\n"
        assert sb.is_running()
    finally:
        sb.kill()
    assert not sb.is_running()
    assert sb.sandbox_id not in [s.sandbox_id for s in Sandbox.list().next_items()]


def test_commands_foreground(sbx: Sandbox) -> None:
    r = sbx.commands.run("echo $GLOBAL $LOCAL; whoami; pwd", envs={"LOCAL": "l"})
    assert (r.stdout, r.stderr, r.exit_code) == ("g l\nuser\n/home/user\n", "", 0)
    r = sbx.commands.run("pwd; id -un", cwd="/tmp", user="root")
    assert r.stdout == "/tmp\nroot\n"
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("echo out; echo err >&2; exit 3")
    assert (e.value.exit_code, e.value.stdout, e.value.stderr) == (3, "out\n", "err\n")
    seen = []
    sbx.commands.run("for i in 1 2 3; do echo $i; done", on_stdout=seen.append)
    assert "".join(seen) == "1\n2\n3\n"


def test_commands_background_stdin_list_connect_kill(sbx: Sandbox) -> None:
    h = sbx.commands.run("cat", background=True, stdin=True)
    assert h.pid in [p.pid for p in sbx.commands.list()]
    sbx.commands.send_stdin(h.pid, "line one\n")
    sbx.commands.close_stdin(h.pid)
    assert h.wait().stdout == "line one\n"

    h = sbx.commands.run("echo started; sleep 60", background=True)
    attached = sbx.commands.connect(h.pid)
    assert sbx.commands.kill(h.pid)
    with pytest.raises(CommandExitException) as e:
        attached.wait()
    assert e.value.exit_code == -1
    assert h.pid not in [p.pid for p in sbx.commands.list()]


def test_pty(sbx: Sandbox) -> None:
    h = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.resize(h.pid, PtySize(rows=30, cols=100))
    sbx.pty.send_stdin(h.pid, b"stty size; echo marker-$((6*7)); exit\n")
    out: list = []
    assert h.wait(on_pty=out.append).exit_code == 0
    text = b"".join(out).decode(errors="replace")
    assert "marker-42" in text and "30 100" in text
    h = sbx.pty.create(PtySize(rows=24, cols=80))
    assert sbx.pty.kill(h.pid)


def test_files(sbx: Sandbox) -> None:
    info = sbx.files.write("/home/user/notes.txt", "text content")
    assert info.path == "/home/user/notes.txt"
    assert sbx.files.read("notes.txt") == "text content"
    sbx.files.write_files([
        WriteEntry(path="/home/user/d/x.txt", data="x"),
        WriteEntry(path="y.bin", data=b"\x00\x01\xff"),
    ])
    assert bytes(sbx.files.read("y.bin", format="bytes")) == b"\x00\x01\xff"
    assert sbx.files.exists("d/x.txt") and not sbx.files.exists("missing")
    st = sbx.files.get_info("d/x.txt")
    assert (st.name, st.type.value, st.size) == ("x.txt", "file", 1)
    # Files the SDK writes belong to the sandbox's user, as in E2B.
    assert sbx.commands.run("stat -c %U d/x.txt; echo more >> d/x.txt").stdout == "user\n"
    assert sbx.files.make_dir("newdir") is True
    assert sbx.files.make_dir("newdir") is False
    sbx.files.rename("d/x.txt", "d/z.txt")
    assert sorted(e.name for e in sbx.files.list("d")) == ["z.txt"]
    sbx.files.remove("d")
    assert not sbx.files.exists("d")
    with pytest.raises(e2b.NotFoundException):
        sbx.files.read("/nonexistent/file")


def test_command_timeout(sbx: Sandbox) -> None:
    started = time.monotonic()
    with pytest.raises(e2b.TimeoutException):
        sbx.commands.run("sleep 20", timeout=1)
    assert time.monotonic() - started < 10
    # The sandbox still answers.
    assert sbx.commands.run("echo ok").stdout == "ok\n"

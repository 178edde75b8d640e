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


def test_network_allowlist_at_create_and_update_network(e2b_env, client) -> None:
    """E2B egress rules map onto dsec's network modes: deny-all plus allowOut is an
    allowlist, no denyOut is open; update_network replaces them; what dsec cannot
    express (a partial deny list) is a clear error."""
    sb = Sandbox.create(
        template="base",
        timeout=120,
        network={"allow_out": ["pypi.org", "10.0.0.0/8"], "deny_out": ["0.0.0.0/0"]},
    )
    try:
        info = client.get_sandbox(sb.sandbox_id)
        assert info.network.mode == "allowlist"
        assert info.network.allow == ["pypi.org", "10.0.0.0/8"]
        sb.update_network({"allow_out": ["example.com"], "deny_out": ["0.0.0.0/0"]})
        assert client.get_sandbox(sb.sandbox_id).network.allow == ["example.com"]
        sb.update_network({})
        assert client.get_sandbox(sb.sandbox_id).network.mode == "open"
        with pytest.raises(Exception, match="cannot deny some destinations"):
            sb.update_network({"deny_out": ["8.8.8.8/32"]})
    finally:
        sb.kill()
    with pytest.raises(Exception, match="cannot deny some destinations"):
        Sandbox.create(template="base", timeout=60, network={"deny_out": ["1.1.1.1"]})
    closed = Sandbox.create(template="base", timeout=60, allow_internet_access=False)
    try:
        assert client.get_sandbox(closed.sandbox_id).network.mode == "none"
    finally:
        closed.kill()


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


def test_template_builder_then_create_from_its_alias(e2b_env, tmp_path) -> None:
    from e2b import Template, wait_for_file

    token = f"{time.time_ns()}"
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "main.py").write_text(f"print('{token}')\n")
    (tmp_path / "app" / "notes.txt").write_text("notes\n")
    (tmp_path / "app" / "skip.log").write_text("left out\n")
    t = (
        Template(file_context_path=str(tmp_path))
        .from_base_image()
        .copy("app", "/opt/app/")
        .copy("app/*.txt", "/opt/txt/", mode=0o600)
        .set_envs({"GREETING": "hello", "TOKEN": token})
        .run_cmd("echo $GREETING-$TOKEN > /tmp/built && whoami > /tmp/built-by")
        .set_workdir("/opt/app")
        .run_cmd("id -u agent || useradd -m agent", user="root")
        .set_user("agent")
        .set_start_cmd("echo up > /tmp/started-$(whoami)", wait_for_file("/tmp/started-agent"))
    )
    logs: list = []
    info = Template.build(t, "dsec-tpl", cpu_count=1, memory_mb=512, on_build_logs=logs.append)
    assert info.template_id == "dsec-tpl" and "default" in info.tags
    assert any("RUN" in str(getattr(l, "message", l)) for l in logs), logs
    assert Template.exists("dsec-tpl")
    sb = Sandbox.create("dsec-tpl", timeout=120)
    try:
        r = sb.commands.run(
            "cat /tmp/built /tmp/built-by /tmp/started-agent; ls /opt/app; ls /opt/txt; "
            "stat -c '%U %a' /opt/txt/notes.txt /opt/app/main.py",
            user="root",
        )
        # COPY is owned by the user current at the step (E2B's rule), `user` here.
        assert r.stdout == (
            f"hello-{token}\nuser\nup\nmain.py\nnotes.txt\nskip.log\nnotes.txt\n"
            "user 600\nuser 644\n"
        ), r.stdout
        # The template's final USER and WORKDIR are the sandbox's defaults (E2B's finalize).
        assert sb.commands.run("whoami; pwd").stdout == "agent\n/opt/app\n"
    finally:
        sb.kill()
    # A rebuild of the same template is cached; a create by build id works too.
    again = Template.build(t, "dsec-tpl")
    sb = Sandbox.create(f"dsec-tpl:{again.build_id}", timeout=60)
    try:
        assert sb.commands.run("cat /tmp/built", user="root").stdout == f"hello-{token}\n"
    finally:
        sb.kill()
    # A failing step fails the build, naming the step; the alias does not move.
    broken = Template().from_template("dsec-tpl").run_cmd("echo broken >&2; exit 3")
    with pytest.raises(e2b.BuildException) as e:
        Template.build(broken, "dsec-tpl-broken")
    assert "exit code 3" in str(e.value)
    assert not Template.exists("dsec-tpl-broken")


def test_template_from_dockerfile(e2b_env, tmp_path) -> None:
    from e2b import Template

    (tmp_path / "data.txt").write_text("from the context\n")
    dockerfile = (
        "FROM e2bdev/base\nENV MODE=test\nWORKDIR /srv\nCOPY data.txt ./\n"
        "RUN echo \"$MODE $(cat data.txt)\" > result\n"
    )
    t = Template(file_context_path=str(tmp_path)).from_dockerfile(dockerfile)
    Template.build(t, "dsec-tpl-df")
    sb = Sandbox.create("dsec-tpl-df", timeout=60)
    try:
        assert sb.commands.run("cat /srv/result").stdout == "test from the context\n"
        # No USER in the Dockerfile: E2B's `user`, in the Dockerfile's WORKDIR.
        assert sb.commands.run("whoami; pwd; cat result").stdout == "user\n/srv\ntest from the context\n"
    finally:
        sb.kill()
    with pytest.raises(Exception) as e:
        Sandbox.create("dsec-tpl-df:nosuchtag", timeout=60)
    assert "does not exist" in str(e.value)

"""RL rollouts through the SDK against a real server: a trainer process killed mid-exec
and a retry that runs nothing twice, default request ids and the call log, replay of a
trajectory, and fork of a prepared sandbox."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import dsec

APPEND = "sleep 2; echo done >> /root/f; echo done"


def test_a_killed_trainer_retries_and_nothing_runs_twice(server, client: dsec.Client, sandbox: dsec.Sandbox) -> None:
    # A real client process, killed mid-call: what a preempted trainer is.
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import dsec, sys; c = dsec.Client(sys.argv[1], sys.argv[2]);"
            "dsec.Sandbox.connect(sys.argv[3], c).exec(sys.argv[4], request_id='step-1')",
            server.url,
            server.key,
            sandbox.id,
            APPEND,
        ]
    )
    time.sleep(1.0)
    trainer.kill()
    trainer.wait()
    r = sandbox.exec(APPEND, request_id="step-1")
    assert (r.stdout, r.exit_code) == ("done\n", 0)
    again = sandbox.exec(APPEND, request_id="step-1")
    assert again.stdout == "done\n" and again.duration_ms == r.duration_ms
    assert sandbox.exec("cat /root/f", request_id=None).stdout == "done\n"
    with pytest.raises(dsec.Conflict):
        sandbox.exec("echo something else", request_id="step-1")
    with pytest.raises(dsec.BadRequest):
        sandbox.exec("true", request_id="x" * 257)

    # Every exec gets an id by default; the log lists them in order with their exits.
    sandbox.exec("echo a")
    sandbox.exec("exit 5")
    calls = sandbox.calls(output=True)
    assert [c.request_id for c in calls[:1]] == ["step-1"]
    assert [c.exit["exit_code"] for c in calls] == [0, 0, 0, 5]
    assert all(c.request_id.startswith(sandbox.id) for c in calls[1:])
    assert calls[2].stdout == "a\n"
    # Streams take ids too, and a trajectory replays without running again.
    out = "".join(ev.data for ev in sandbox.exec_stream("echo s >> /root/f; echo s", request_id="s-1")
                  if isinstance(ev, dsec.StdoutEvent))
    assert out == "s\n"
    steps = [{"cmd": APPEND, "request_id": "step-1"}, {"cmd": "echo s >> /root/f; echo s", "request_id": "s-1"}]
    assert [r.stdout for r in sandbox.replay(steps)] == ["done\n", "s\n"]
    assert sandbox.exec("cat /root/f").stdout == "done\ns\n"


def test_fork_makes_sandboxes_with_the_prepared_files(sandbox: dsec.Sandbox) -> None:
    sandbox.exec("mkdir -p /work && echo prepared > /work/state")
    forks = sandbox.fork(3, env={"ROLLOUT": "g"})
    try:
        assert len(forks) == 3
        for i, f in enumerate(forks):
            assert f.exec("cat /work/state; echo $ROLLOUT").stdout == "prepared\ng\n"
            f.exec(f"echo {i} > /work/state")
        assert [f.exec("cat /work/state").stdout for f in forks] == ["0\n", "1\n", "2\n"]
        assert sandbox.exec("cat /work/state").stdout == "prepared\n"
    finally:
        for f in forks:
            f.kill()


def test_session_commands_and_process_starts_take_request_ids(sandbox: dsec.Sandbox) -> None:
    with sandbox.session() as s:
        line = "echo x >> /root/sr; wc -l < /root/sr"
        first = s.run(line, request_id="sr-1")
        assert first.output.strip() == "1"
        assert s.run(line, request_id="sr-1") == first
        assert s.run(line).output.strip() == "2"  # a fresh id: runs
    p1 = sandbox.start("sleep 100", tag="one", request_id="p-1")
    p2 = sandbox.start("sleep 100", tag="one", request_id="p-1")
    assert p1.pid == p2.pid
    assert [p.tag for p in sandbox.processes()].count("one") == 1
    kinds = [c.kind for c in sandbox.calls()]
    assert kinds.count("session_run") == 2 and kinds.count("process_start") == 1


def test_file_writes_and_directory_uploads_take_request_ids(sandbox: dsec.Sandbox, tmp_path) -> None:
    assert sandbox.write("/root/w", "first", request_id="w-1") == 5
    sandbox.exec("echo changed > /root/w")
    assert sandbox.write("/root/w", "first", request_id="w-1") == 5  # recorded: not written again
    assert sandbox.read("/root/w") == b"changed\n"
    with pytest.raises(dsec.Conflict):
        sandbox.write("/root/w", "other bytes", request_id="w-1")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.txt").write_text("x")
    sandbox.upload_dir(str(tmp_path / "d"), "/root/d", request_id="d-1")
    sandbox.exec("rm /root/d/x.txt")
    sandbox.upload_dir(str(tmp_path / "d"), "/root/d", request_id="d-1")
    assert not sandbox.exists("/root/d/x.txt")
    sandbox.write("/root/fresh", b"y")  # a fresh id by default
    kinds = [(c.kind, c.body_sha256 is not None) for c in sandbox.calls() if c.kind != "exec"]
    assert kinds == [("file_write", True), ("tar_upload", True), ("file_write", True)]


def test_the_async_sdk_passes_request_ids(client: dsec.Client) -> None:
    import asyncio

    async def go() -> None:
        async with dsec.AsyncClient(client.url, client.api_key) as ac:
            async with await dsec.AsyncSandbox.create(ac, job="async-ids") as sb:
                cmd = "echo x >> /root/n; wc -l < /root/n"
                assert (await sb.exec(cmd, request_id="a-1")).stdout == "1\n"
                assert (await sb.exec(cmd, request_id="a-1")).stdout == "1\n"
                await sb.write("/root/w", "w", request_id="a-2")
                with pytest.raises(dsec.Conflict):
                    await sb.write("/root/w", "v", request_id="a-2")
                async with await sb.session() as s:
                    assert (await s.run(cmd, request_id="a-3")).output == "2\n"
                    assert (await s.run(cmd, request_id="a-3")).output == "2\n"

    asyncio.run(go())


def test_a_full_record_of_calls_makes_the_sdk_send_its_calls_without_ids(sandbox: dsec.Sandbox) -> None:
    from conftest import MAX_RECORDED_CALLS

    for _ in range(MAX_RECORDED_CALLS):
        sandbox.exec("true")
    assert len(sandbox.calls()) == MAX_RECORDED_CALLS
    # The next call's SDK-made id is refused: it runs without one, as do later calls.
    assert sandbox.exec("echo past the record").stdout == "past the record\n"
    out = "".join(ev.data for ev in sandbox.exec_stream("echo streamed") if isinstance(ev, dsec.StdoutEvent))
    assert out == "streamed\n"
    sandbox.write("/root/w", b"written")
    assert sandbox.exec("cat /root/w").stdout == "written"
    assert len(sandbox.calls()) == MAX_RECORDED_CALLS
    # A caller's own id cannot fall back: it is told.
    with pytest.raises(dsec.NoSpace, match="without a request id"):
        sandbox.exec("true", request_id="mine")
    # Retries of recorded calls still get their outcomes.
    first = sandbox.calls()[0]
    assert sandbox.exec("true", request_id=first.request_id).exit_code == 0

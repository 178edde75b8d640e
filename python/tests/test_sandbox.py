"""End-to-end tests of the dsec SDK against a real `dsec serve` (see conftest.py)."""

from __future__ import annotations

import os
import time
import uuid

import pytest

import dsec


def test_health_and_env_default_client(client: dsec.Client) -> None:
    assert client.health().status == "ok"
    # client=None: the default client built from DSEC_URL / DSEC_API_KEY.
    with dsec.Sandbox.create(labels={"t": "env"}) as sb:
        assert sb.exec("true").ok


def test_create_exec_delete(client: dsec.Client) -> None:
    sb = dsec.Sandbox.create(client, image="base", resources={"memory_mb": 256}, env={"FOO": "bar"}, workdir="/tmp")
    try:
        assert sb.info.state == "ready"
        assert sb.info.resources is not None and sb.info.resources.memory_mb == 256
        r = sb.exec(["echo", "hello", "world"])
        assert (r.stdout, r.stderr, r.exit_code) == ("hello world\n", "", 0)
        r = sb.exec("echo out; echo err >&2; exit 3")
        assert r.stdout == "out\n" and r.stderr == "err\n" and r.exit_code == 3 and not r.ok
        assert sb.exec("echo $FOO $BAR; pwd", env={"BAR": "baz"}).stdout == "bar baz\n/tmp\n"
        assert sb.exec(["pwd"], cwd="/etc").stdout == "/etc\n"
        assert sb.exec(["cat"], stdin="fed in").stdout == "fed in"
        r = sb.exec("sleep 30", timeout=0.5)
        assert r.timed_out
    finally:
        sb.kill()
    with pytest.raises(dsec.NotFound) as ei:
        sb.exec("true")
    assert ei.value.code == "not_found" and not ei.value.retryable and ei.value.status == 404
    # The server's id of the failed request, to find it in its log.
    rid = ei.value.request_id
    assert rid and rid.startswith("req_") and len(rid) == 20, rid


def test_a_gvisor_sandbox_through_the_sdk(client: dsec.Client) -> None:
    """The SDK drives a gVisor sandbox as any other: commands, a session, files."""
    levels = {level.isolation: level for level in client.health().isolation}
    if "gvisor" not in levels:
        assert not os.environ.get("CI"), f"the test server offers no gvisor: {levels}"
        pytest.skip("runsc is not installed (apt-get install runsc)")
    assert levels["gvisor"].platform in ("systrap", "ptrace"), levels
    with dsec.Sandbox.create(client, isolation="gvisor", env={"LEVEL": "g"}) as sb:
        assert sb.info.isolation == "gvisor"
        r = sb.exec("echo $LEVEL; uname -r")
        assert r.stdout.splitlines()[0] == "g"
        assert r.stdout.splitlines()[1] != os.uname().release, "gVisor's kernel answers"
        with sb.session() as s:
            assert s.run("cd /tmp && export X=1").ok
            assert s.run("echo $X $(pwd)").output == "1 /tmp\n"
        sb.write("/tmp/f.bin", b"\x00\x01gvisor")
        assert sb.read("/tmp/f.bin") == b"\x00\x01gvisor"
        assert sb.exec(["cat", "/tmp/f.bin"]).stdout.endswith("gvisor")
    with pytest.raises(dsec.BadRequest) as ei:
        dsec.Sandbox.create(client, isolation="gvisor", network="open")
    assert "isolation gvisor" in str(ei.value)


def test_a_microvm_through_the_sdk(client: dsec.Client) -> None:
    """The SDK drives a microVM as any other: commands, a session, files."""
    levels = {level.isolation: level for level in client.health().isolation}
    if "microvm" not in levels:
        assert not os.environ.get("CI"), f"the test server offers no microvm: {levels}"
        pytest.skip("QEMU or a guest kernel is missing")
    assert levels["microvm"].platform in ("tcg", "kvm"), levels
    with dsec.Sandbox.create(client, isolation="microvm", env={"LEVEL": "m"}) as sb:
        assert sb.info.isolation == "microvm"
        r = sb.exec("echo $LEVEL; uname -r")
        assert r.stdout.splitlines()[0] == "m"
        assert r.stdout.splitlines()[1] != os.uname().release, "the guest's kernel answers"
        with sb.session() as s:
            assert s.run("cd /tmp && export X=1").ok
            assert s.run("echo $X $(pwd)").output == "1 /tmp\n"
        sb.write("/tmp/f.bin", b"\x00\x01microvm")
        assert sb.read("/tmp/f.bin") == b"\x00\x01microvm"
    with pytest.raises(dsec.BadRequest) as ei:
        dsec.Sandbox.create(client, isolation="microvm", writable=["/tmp"])
    assert "isolation microvm" in str(ei.value)


def test_screen_and_keyboard_are_a_vms_only(client: dsec.Client, sandbox: dsec.Sandbox) -> None:
    """A container has no screen or keyboard: the SDK's calls get the server's reason
    (the VM itself is driven in the Rust suite's tests/vm.rs)."""
    assert "vm" in {level.isolation for level in client.health().isolation} or not os.environ.get("CI")
    with pytest.raises(dsec.BadRequest) as ei:
        sandbox.screenshot()
    assert "no screen" in str(ei.value)
    with pytest.raises(dsec.BadRequest) as ei:
        sandbox.type("hello", keys=["ctrl+c"])
    assert "no screen" in str(ei.value)
    with pytest.raises(dsec.BadRequest) as ei:
        sandbox.click(10, 20, button="right", count=2)
    assert "no screen" in str(ei.value)
    with pytest.raises(ValueError):
        sandbox.type()
    # A malformed event is the server's to refuse, with its reason.
    with pytest.raises(dsec.BadRequest):
        sandbox.send_input([{"type": "click", "button": "thumb"}])


def test_exec_stream_events(sandbox: dsec.Sandbox) -> None:
    events = list(sandbox.exec_stream("echo a; echo b >&2; sleep 0.2; echo c; exit 7"))
    assert isinstance(events[0], dsec.StartedEvent) and events[0].pid > 0
    assert isinstance(events[-1], dsec.ExitEvent) and events[-1].exit_code == 7
    out = "".join(e.data for e in events if isinstance(e, dsec.StdoutEvent))
    err = "".join(e.data for e in events if isinstance(e, dsec.StderrEvent))
    assert out == "a\nc\n" and err == "b\n"


def test_session_keeps_cwd_and_env(sandbox: dsec.Sandbox) -> None:
    with sandbox.session() as s:
        assert s.run("cd /tmp").ok
        assert s.run("export GREETING=hi").ok
        assert s.run("pwd").output == "/tmp\n"
        assert s.run("echo $GREETING").output == "hi\n"
        r = s.run("false")
        assert r.exit_code == 1
    assert s.closed


def test_files_round_trip(sandbox: dsec.Sandbox) -> None:
    blob = bytes(range(256)) * 64
    assert sandbox.write("/tmp/bin.dat", blob) == len(blob)
    assert sandbox.read("/tmp/bin.dat") == blob
    assert sandbox.read("/tmp/bin.dat", offset=10, length=5) == blob[10:15]
    sandbox.write("/tmp/text.txt", "héllo\n")
    assert sandbox.exec(["cat", "/tmp/text.txt"]).stdout == "héllo\n"

    big = os.urandom(10 * 1024 * 1024)
    assert sandbox.write("/tmp/big.bin", big) == len(big)
    assert sandbox.read("/tmp/big.bin") == big
    assert sandbox.stat("/tmp/big.bin").size == len(big)


def test_list_stat_remove_rename_mkdir(sandbox: dsec.Sandbox) -> None:
    sandbox.mkdir("/work/a/b")
    sandbox.write("/work/a/one.txt", b"1")
    sandbox.write("/work/a/b/two.txt", b"22", mode=0o600)
    names = [e.name for e in sandbox.list("/work/a")]
    assert names == ["b", "one.txt"]
    st = sandbox.stat("/work/a/b/two.txt")
    assert (st.kind, st.size, st.mode & 0o777) == ("file", 2, 0o600)
    assert sandbox.stat("/work/a/b").kind == "dir"

    sandbox.rename("/work/a/one.txt", "/work/a/uno.txt")
    assert not sandbox.exists("/work/a/one.txt")
    assert sandbox.read("/work/a/uno.txt") == b"1"

    sandbox.remove("/work/a/uno.txt")
    assert not sandbox.exists("/work/a/uno.txt")
    with pytest.raises(dsec.DsecError):
        sandbox.remove("/work/a")  # not empty
    sandbox.remove("/work/a", recursive=True)
    with pytest.raises(dsec.NotFound):
        sandbox.stat("/work/a")
    with pytest.raises(dsec.NotFound):
        sandbox.read("/nope/missing")


def test_typed_errors(client: dsec.Client) -> None:
    with pytest.raises(dsec.BadRequest) as ei:
        dsec.Sandbox.create(client, resources={"memory_mb": 1 << 40})
    assert ei.value.code == "bad_request" and ei.value.message
    with pytest.raises(dsec.ImageNotFound) as ei2:
        dsec.Sandbox.create(client, image="no-such-image-" + uuid.uuid4().hex[:8])
    assert ei2.value.code == "image_not_found"
    with pytest.raises(dsec.NotFound):
        dsec.Sandbox.connect("sb-does-not-exist", client)
    with pytest.raises(dsec.Unauthorized):
        dsec.Client(client.url, "wrong-key").list_sandboxes()
    # Every code has its class, under DsecError.
    assert set(dsec.ERROR_CLASSES) == {
        "bad_request", "not_found", "expired", "failed", "conflict", "image_not_found",
        "capacity", "timeout", "invalid_path", "no_space", "payload_too_large", "paused",
        "agent_unavailable", "internal", "unauthorized", "method_not_allowed", "forbidden",
        "quota_exceeded", "lost", "unavailable",
    }
    assert all(issubclass(c, dsec.DsecError) for c in dsec.ERROR_CLASSES.values())
    assert dsec.Capacity("x").retryable and not dsec.Paused("x").retryable


def test_connection_error_is_typed() -> None:
    c = dsec.Client("http://127.0.0.1:9", "k", create_retries=1)
    with pytest.raises(dsec.ConnectionFailed) as ei:
        dsec.Sandbox.create(c)
    assert ei.value.retryable


def test_pause_resume(sandbox: dsec.Sandbox) -> None:
    sandbox.exec("echo before > /tmp/state")
    res = sandbox.pause()
    assert res.sandbox.state == "paused" and sandbox.info.state == "paused"
    with pytest.raises(dsec.Paused) as ei:
        sandbox.exec("true")
    assert ei.value.code == "paused"
    assert sandbox.resume().state == "ready"
    assert sandbox.exec("cat /tmp/state").stdout == "before\n"
    info = sandbox.set_timeout(1200)
    assert info.expires_at > info.created_at


def test_context_manager_deletes(client: dsec.Client) -> None:
    with dsec.Sandbox.create(client) as sb:
        sid = sb.id
        assert client.get_sandbox(sid).state == "ready"
    with pytest.raises(dsec.NotFound):
        client.get_sandbox(sid)
    # Also when the block raises.
    with pytest.raises(RuntimeError):
        with dsec.Sandbox.create(client) as sb:
            sid = sb.id
            raise RuntimeError("boom")
    with pytest.raises(dsec.NotFound):
        client.get_sandbox(sid)


def test_job_label_suspend_resume(client: dsec.Client) -> None:
    job = "pyjob-" + uuid.uuid4().hex[:8]
    with dsec.Sandbox.create(client, job=job) as a, dsec.Sandbox.create(client, job=job) as b:
        assert a.info.labels["job"] == job
        assert {s.id for s in client.list_sandboxes({"job": job})} == {a.id, b.id}
        res = dsec.suspend_job(job, client)
        assert res.job == job and {o.id for o in res.sandboxes} == {a.id, b.id}
        assert all(o.state == "paused" and o.error is None for o in res.sandboxes)
        assert a.refresh().job_suspended_at is not None
        with pytest.raises(dsec.Paused):
            a.exec("true")
        res = dsec.resume_job(job)  # default client
        assert all(o.state == "ready" for o in res.sandboxes)
        assert b.exec("echo ok").stdout == "ok\n"


def test_rollout_example(client: dsec.Client) -> None:
    import rollout

    summary = rollout.run_rollout(4, client=client)
    assert summary.episodes == 4
    assert summary.rewards == [1, 1, 1, 0]  # task 3's policy is wrong on purpose
    assert client.list_sandboxes({"job": summary.job}) == []
    assert rollout.main(["--sandboxes", "4"]) == 0


def test_async_api(client: dsec.Client) -> None:
    import asyncio

    async def go() -> str:
        async with dsec.AsyncClient(client.url, client.api_key) as ac:
            async with await dsec.AsyncSandbox.create(ac, job="async") as sb:
                sid = sb.id
                r = await sb.exec(["sh", "-c", "echo $0", "x"])
                assert r.stdout == "x\n"
                evs = [e async for e in sb.exec_stream("echo s; exit 2")]
                assert isinstance(evs[-1], dsec.ExitEvent) and evs[-1].exit_code == 2
                await sb.write("/tmp/f", b"\x00\xff")
                assert await sb.read("/tmp/f") == b"\x00\xff"
                async with await sb.session() as s:
                    await s.run("cd /etc")
                    assert (await s.run("pwd")).output == "/etc\n"
            with pytest.raises(dsec.NotFound):
                await ac.get_sandbox(sid)
            return sid

    assert asyncio.run(go())


def test_create_is_idempotent_with_one_key(client: dsec.Client) -> None:
    """Retries reuse the first attempt's key: the same key answers the same sandbox."""
    body = {"image": "base", "idempotency_key": "py-idem-" + uuid.uuid4().hex}
    first = client.create_sandbox(body)
    try:
        again = client.create_sandbox(body)
        assert again.id == first.id
        fresh = client.create_sandbox({"image": "base"})
        try:
            assert fresh.id != first.id
        finally:
            client.delete_sandbox(fresh.id)
    finally:
        client.delete_sandbox(first.id)


def test_network_policy_create_and_replace(client: dsec.Client) -> None:
    with dsec.Sandbox.create(client, network=["pypi.org:443", "*.pythonhosted.org"]) as sb:
        assert sb.info.network.mode == "allowlist"
        assert sb.info.network.allow == ["pypi.org:443", "*.pythonhosted.org"]
        assert sb.info.ip and sb.info.ip.startswith("10.239.")
        # The sandbox has a link to the node and nothing else resolves.
        r = sb.exec("cat /proc/net/dev; getent hosts example.com; echo rc=$?")
        assert "eth0" in r.stdout and "rc=2" in r.stdout
        info = sb.set_network("open")
        assert info.network.mode == "open" and info.network.allow == []
        assert sb.refresh().network.mode == "open"
    with dsec.Sandbox.create(client, writable=["/tmp"]) as ro:
        assert ro.info.filesystem == {"writable": ["/tmp"]}
        r = ro.exec("(echo x > /etc/x) 2>/dev/null || echo denied; echo y > /tmp/y && echo ok")
        assert r.stdout == "denied\nok\n"
    with dsec.Sandbox.create(client) as plain:
        assert plain.info.network.mode == "none" and plain.info.ip is None
        with pytest.raises(dsec.BadRequest):
            plain.set_network("open")
    with pytest.raises(dsec.BadRequest):
        dsec.Sandbox.create(client, network=["http://pypi.org"])
    with pytest.raises(dsec.BadRequest):
        dsec.Sandbox.create(client, network={"mode": "open", "allow": ["pypi.org"]})


def test_background_process_stdin_signal_and_reattach(sandbox: dsec.Sandbox) -> None:
    # A process reading stdin: fed, closed, and its output read back from a re-attach.
    p = sandbox.start("while read l; do echo got:$l; done; echo done >&2", tag="reader")
    p.send_stdin("one\ntwo\n")
    p.close_stdin()
    again = sandbox.process(p.pid)
    assert again.info.tag == "reader"
    r = again.wait()
    assert r.exit_code == 0
    assert r.stdout == "got:one\ngot:two\n"
    assert r.stderr == "done\n"
    assert again.refresh().exit is not None

    # Output read up to now, then continued from the offsets of the End event.
    p = sandbox.start("echo first; sleep 30")
    seen = ""
    for _ in range(100):
        evs = list(p.output())
        seen = "".join(e.data for e in evs if isinstance(e, dsec.StdoutEvent))
        if seen:
            break
    assert seen == "first\n"
    end = [e for e in evs if isinstance(e, dsec.EndEvent)][-1]
    assert end.stdout_offset == len("first\n")
    p.signal("SIGTERM")
    r = p.wait()
    assert r.signal == 15

    # As another user, and under a terminal.
    p = sandbox.start(["id", "-un"], user="nobody")
    assert p.wait().stdout == "nobody\n"
    p = sandbox.start("stty size", pty=(100, 30))
    assert p.wait().stdout.strip() == "30 100"
    with pytest.raises(dsec.NotFound):
        sandbox.process(999999)


def test_upload_and_download_directories(sandbox: dsec.Sandbox, tmp_path) -> None:
    src = tmp_path / "src"
    (src / "pkg" / "sub").mkdir(parents=True)
    (src / "pkg" / "a.py").write_text("print('a')\n")
    (src / "pkg" / "sub" / "run.sh").write_text("#!/bin/sh\necho ran\n")
    os.chmod(src / "pkg" / "sub" / "run.sh", 0o755)
    os.symlink("a.py", src / "pkg" / "link.py")
    sent = sandbox.upload_dir(str(src), "/work/project")
    assert sent > 0
    r = sandbox.exec("cat /work/project/pkg/link.py; /work/project/pkg/sub/run.sh")
    assert r.stdout == "print('a')\nran\n"
    sandbox.exec("echo made > /work/project/pkg/new.txt")
    out = tmp_path / "out"
    sandbox.download_dir("/work/project", str(out))
    assert (out / "pkg" / "new.txt").read_text() == "made\n"
    assert os.readlink(out / "pkg" / "link.py") == "a.py"
    assert os.access(out / "pkg" / "sub" / "run.sh", os.X_OK)

    # A sandbox-made link to a host path does not make the download write outside.
    sandbox.exec("mkdir -p /work/evil && ln -s /etc/passwd /work/evil/x")
    with pytest.raises(ValueError):
        sandbox.download_dir("/work/evil", str(tmp_path / "evil"))
    assert not (tmp_path / "evil" / "x").exists()


def test_users_and_async_processes(client: dsec.Client) -> None:
    import asyncio

    with dsec.Sandbox.create(client, user="www-data", timeout=600) as sb:
        assert sb.exec("id -un").stdout == "www-data\n"
        assert sb.exec("id -u", user="root").stdout == "0\n"
        with sb.session(user="nobody") as s:
            assert s.run("whoami").output == "nobody\n"

    async def go() -> None:
        async with dsec.AsyncClient(client.url, client.api_key) as ac:
            async with await dsec.AsyncSandbox.create(ac) as sb:
                p = await sb.start("cat", user="nobody")
                await p.send_stdin("hello", close=True)
                r = await (await sb.process(p.pid)).wait()
                assert r.stdout == "hello" and r.exit_code == 0
                assert (await sb.exec("id -un", user="nobody")).stdout == "nobody\n"

    asyncio.run(go())


def test_build_dockerfile_builds_an_image_sandboxes_run(client: dsec.Client, tmp_path) -> None:
    token = uuid.uuid4().hex
    (tmp_path / "Dockerfile").write_text(
        "FROM base\nARG WHO=nobody\nENV WHO=$WHO\nWORKDIR /app\nCOPY . .\n"
        'RUN echo "hi $WHO" > greeting\nLABEL suite=python\n'
    )
    (tmp_path / "token.txt").write_text(token)
    (tmp_path / "skip.log").write_text("left out")
    (tmp_path / ".dockerignore").write_text("*.log\n")
    events: list = []
    img = client.build_dockerfile("py/df", str(tmp_path), build_args={"WHO": "py"}, on_event=events.append)
    assert img.name == "py/df" and img.config["labels"] == {"suite": "python"}
    steps = [e for e in events if e["type"] == "step"]
    assert [s["text"] for s in steps] == ["WORKDIR /app", "COPY . .", 'RUN echo "hi $WHO" > greeting']
    with dsec.Sandbox.create(client, image="py/df") as sb:
        assert sb.exec("cat greeting token.txt; ls").stdout == f"hi py\n{token}Dockerfile\ngreeting\ntoken.txt\n"
    # A failing RUN raises with its line; nothing is named.
    (tmp_path / "Dockerfile").write_text("FROM base\nRUN echo broken >&2 && false\n")
    with pytest.raises(dsec.errors.DsecError) as e:
        client.build_dockerfile("py/df-broken", str(tmp_path))
    assert "Dockerfile line 2" in str(e.value) and "broken" in str(e.value)
    assert "py/df-broken" not in [i.name for i in client.list_images()]
    assert client.get_image("py/df").digest == img.digest
    with pytest.raises(dsec.errors.ImageNotFound):
        client.get_image("py/df-broken")


def test_pull_image_errors_are_raised(client: dsec.Client) -> None:
    # A reference that does not parse is refused before the pull starts.
    with pytest.raises(dsec.errors.BadRequest):
        client.pull_image("no spaces/allowed")
    # A registry the server's --allow-registry does not name: refused before any request.
    with pytest.raises(dsec.errors.Forbidden) as e:
        client.pull_image("127.0.0.1:2/none:v1", insecure=True)
    assert "--allow-registry 127.0.0.1:2" in str(e.value)
    # Allowed, but nothing listens there (port 1): the pull's stream ends with the error,
    # raised here.
    port = 1
    phases: list = []
    with pytest.raises(dsec.errors.DsecError) as e:
        client.pull_image(f"127.0.0.1:{port}/none:v1", insecure=True, on_progress=lambda p, d, t: phases.append(p))
    assert f"127.0.0.1:{port}" in str(e.value)
    assert phases == ["resolving"]
    assert all(i.name != f"127.0.0.1:{port}/none:v1" for i in client.list_images())


def test_warm_pool_claims_with_the_sdk(client: dsec.Client) -> None:
    name = f"py-{uuid.uuid4().hex[:8]}"
    pool = client.create_pool(name, template={"env": {"FROM": "pool"}, "workdir": "/tmp"}, min=2, max=4)
    try:
        assert pool["spec"]["name"] == name and pool["target"] == 2
        deadline = time.time() + 60
        while client.get_pool(name)["ready"] < 2:
            assert time.time() < deadline, client.get_pool(name)
            time.sleep(0.05)
        # The SDK's retry key rides along: a keyed claim takes one warm sandbox.
        with dsec.Sandbox.create(client, pool=name, labels={"task": "1"}, timeout=300) as sb:
            assert sb.info.labels["dsec-pool-origin"] == name
            assert sb.exec("echo $FROM; pwd").stdout == "pool\n/tmp\n"
        assert client.get_pool(name)["claimed"] == 1
        assert name in [p["spec"]["name"] for p in client.list_pools()]
        # A claim that describes an environment is refused with what is wrong.
        with pytest.raises(dsec.DsecError) as ei:
            dsec.Sandbox.create(client, pool=name, image="base")
        assert "leave it unset" in str(ei.value)
        client.update_pool(name, min=0, max=0)
        deadline = time.time() + 30
        while client.get_pool(name)["size"] > 0:
            assert time.time() < deadline, client.get_pool(name)
            time.sleep(0.05)
        retries, client.create_retries = client.create_retries, 0
        try:
            with pytest.raises(dsec.Capacity):
                dsec.Sandbox.create(client, pool=name, max_wait=0.2)
        finally:
            client.create_retries = retries
    finally:
        client.delete_pool(name)
    with pytest.raises(dsec.NotFound):
        client.get_pool(name)

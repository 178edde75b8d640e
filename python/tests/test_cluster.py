"""A cluster of three `dsec node`s behind two `dsec apiserver`s on etcd
(scripts/local-cluster): the SDK, the unmodified E2B SDK and the unmodified SWE-ReX
client work through either API server, and creates spread over every node."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List

import pytest

import dsec

CREATES = 300


def _on_every_node(infos: List[dsec.SandboxInfo]) -> List[dsec.SandboxInfo]:
    """One sandbox of each node."""
    first = {}
    for i in infos:
        first.setdefault(i.node, i)
    return [first[n] for n in sorted(first)]


def _node_counts(c: dsec.Client) -> Dict[str, int]:
    return {n["name"]: n["sandboxes"] for n in c.request("GET", "/nodes").json()["nodes"]}


def _until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_tenant_made_with_the_cli_holds_on_every_apiserver(cluster) -> None:
    """`dsec tenant` and `dsec key` through one API server: the key works on the other,
    the tenant's quota holds across both, the operator does not see its sandboxes, and a
    revocation through one API server stops the key on the other within a second."""
    a_url, b_url = cluster.urls
    dsec_bin = os.environ.get("DSEC_BIN", "target/debug/dsec")

    def cli(url: str, *args: str) -> dict:
        out = subprocess.run(
            [dsec_bin, "--url", url, "--api-key", cluster.key, "--json", *args],
            capture_output=True, text=True, check=True,
        )
        return json.loads(out.stdout)

    cli(a_url, "tenant", "create", "team-c", "--max-sandboxes", "2")
    made = cli(a_url, "key", "create", "team-c", "--scope", "sandboxes")
    key, key_id = made["key"], made["info"]["key_id"]
    with dsec.Client(a_url, key) as ta, dsec.Client(b_url, key) as tb, dsec.Client(
        cluster.urls, cluster.key
    ) as op:
        first, second = ta.create_sandbox({}), tb.create_sandbox({})
        assert first.tenant == second.tenant == "team-c"
        for c in (ta, tb):
            with pytest.raises(dsec.QuotaExceeded):
                c.create_sandbox({})
        with pytest.raises(dsec.NotFound):
            op.get_sandbox(first.id)
        assert cli(b_url, "tenant", "get", "team-c")["usage"]["sandboxes"] == 2
        ta.delete_sandbox(second.id)
        tb.delete_sandbox(first.id)
        assert cli(a_url, "tenant", "get", "team-c")["usage"]["sandboxes"] == 0

        cli(b_url, "key", "revoke", key_id)
        revoked_at = time.monotonic()

        def refused() -> bool:
            try:
                ta.list_sandboxes()
                return False
            except dsec.Unauthorized:
                return True

        assert _until(refused, timeout=5.0), "the revoked key still works on the other API server"
        took = time.monotonic() - revoked_at
        assert took < 1.5, f"the revocation reached the other API server after {took:.2f} s"


def test_300_creates_spread_over_three_nodes_and_work_through_either_apiserver(cluster) -> None:
    a_url, b_url = cluster.urls
    with dsec.Client(cluster.urls, cluster.key) as both, dsec.Client(a_url, cluster.key) as a, dsec.Client(
        b_url, cluster.key
    ) as b:
        clients = [a, b]

        # 300 creates from 16 threads, alternating API servers.
        def create(i: int) -> dsec.SandboxInfo:
            return clients[i % 2].create_sandbox({"labels": {"suite": "cluster", "i": str(i)}})

        with ThreadPoolExecutor(16) as pool:
            infos = list(pool.map(create, range(CREATES)))
        try:
            assert len({i.id for i in infos}) == CREATES
            per_node = collections.Counter(i.node for i in infos)
            assert sorted(per_node) == ["node1", "node2", "node3"], per_node
            # Placement spreads them (equal nodes, equal sandboxes): no node gets less than
            # half its share.
            assert min(per_node.values()) >= CREATES // 3 // 2, per_node
            # Each node reports what it runs in its heartbeats (every second).
            assert _until(lambda: _node_counts(both) == dict(per_node)), (_node_counts(both), per_node)
            # Both API servers list all of them (one store).
            for c in clients:
                listed = c.list_sandboxes(labels={"suite": "cluster"})
                assert len(listed) == CREATES

            for k, info in enumerate(_on_every_node(infos)):
                via_a = dsec.Sandbox.connect(info.id, client=a)
                via_b = dsec.Sandbox.connect(info.id, client=b)
                # exec through A, files written through A read through B and the reverse.
                r = via_a.exec(["sh", "-c", "hostname; echo $((6*7))"])
                assert (r.exit_code, r.stdout) == (0, f"{info.id}\n42\n")
                via_a.write("/tmp/from-a", b"a" * 100_000)
                assert via_b.read("/tmp/from-a") == b"a" * 100_000
                via_b.write("/tmp/from-b", "b\n")
                assert via_a.read("/tmp/from-b") == b"b\n"
                # A session opened through B keeps its state; streamed exec through A.
                with via_b.session() as s:
                    s.run("cd /tmp && export K=%d" % k)
                    assert s.run("echo $K; pwd").output == f"{k}\n/tmp\n"
                events = [e.type for e in via_a.exec_stream(["sh", "-c", "echo 1; echo 2 >&2"])]
                assert "stdout" in events and "stderr" in events and events[-1] in ("exit", "end")
        finally:
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(lambda i: clients[hash(i.id) % 2].delete_sandbox(i.id), infos))
        # A replica lists from its watch of the store: the other one's deletes reach it
        # within a watch round trip.
        assert _until(lambda: both.list_sandboxes(labels={"suite": "cluster"}) == [])
        assert _until(lambda: set(_node_counts(both).values()) == {0}), _node_counts(both)


def test_e2b_sdk_through_either_apiserver(cluster, monkeypatch) -> None:
    from e2b import Sandbox  # installed by run-tests.sh (pinned)

    monkeypatch.setenv("E2B_API_KEY", cluster.key)
    monkeypatch.setenv("E2B_VALIDATE_API_KEY", "false")

    def through(url: str) -> None:
        monkeypatch.setenv("E2B_API_URL", f"{url}/e2b")
        monkeypatch.setenv("E2B_SANDBOX_URL", f"{url}/e2b/envd")

    a_url, b_url = cluster.urls
    made = []
    try:
        # Three creates through A, each used through B: wherever it was placed.
        through(a_url)
        for i in range(3):
            made.append(Sandbox.create(template="base", timeout=300, metadata={"suite": "e2b-cluster"}))
        through(b_url)
        for i, sb in enumerate(made):
            again = Sandbox.connect(made[i].sandbox_id)
            r = again.commands.run(f"echo {i} > /tmp/n; cat /tmp/n; hostname")
            assert r.stdout == f"{i}\n{sb.sandbox_id}\n"
            again.files.write("/tmp/e2b.txt", "through b\n")
            h = again.commands.run("cat", background=True, stdin=True)
            again.commands.send_stdin(h.pid, "stdin through b\n")
            again.commands.close_stdin(h.pid)
            assert h.wait().stdout == "stdin through b\n"
        through(a_url)
        for sb in made:
            assert Sandbox.connect(sb.sandbox_id).files.read("/tmp/e2b.txt") == "through b\n"
        nodes = {dsec.Client(a_url, cluster.key).get_sandbox(sb.sandbox_id).node for sb in made}
        assert len(nodes) >= 2, nodes
    finally:
        through(b_url)
        for sb in made:
            Sandbox.connect(sb.sandbox_id).kill()


def test_swerex_through_either_apiserver(cluster) -> None:
    try:
        import swerex.runtime.remote as swerex_remote
        from swerex.runtime.abstract import BashAction, Command, CreateBashSessionRequest, ReadFileRequest, WriteFileRequest
    except ImportError as e:
        if os.environ.get("CI") in ("true", "1"):
            raise
        pytest.skip(f"swe-rex not installed: {e}")
    a_url, b_url = cluster.urls
    with dsec.Client(cluster.urls, cluster.key) as c:
        sbs = [dsec.Sandbox.create(c, timeout=300) for _ in range(3)]
        try:
            assert len({sb.refresh().node for sb in sbs}) >= 2
            for sb in sbs:
                via_a = swerex_remote.RemoteRuntime(host=f"{a_url}/swerex/{sb.id}", port=None, auth_token=cluster.key)
                via_b = swerex_remote.RemoteRuntime(host=f"{b_url}/swerex/{sb.id}", port=None, auth_token=cluster.key)

                async def episode() -> None:
                    assert (await via_a.is_alive()).is_alive and (await via_b.is_alive()).is_alive
                    await via_a.create_session(CreateBashSessionRequest(session="main"))
                    # The session lives in the sandbox: B drives what A opened.
                    await via_a.run_in_session(BashAction(session="main", command="cd /etc && export X=9"))
                    obs = await via_b.run_in_session(BashAction(session="main", command="echo $X; pwd"))
                    assert obs.output.split() == ["9", "/etc"]
                    await via_b.write_file(WriteFileRequest(path="/work/x.txt", content="x\n"))
                    assert (await via_a.read_file(ReadFileRequest(path="/work/x.txt"))).content == "x\n"
                    r = await via_b.execute(Command(command="hostname", shell=True))
                    assert r.stdout.strip() == sb.id
                    await via_a.close()
                    await via_b.close()

                asyncio.run(episode())
        finally:
            for sb in sbs:
                sb.kill()


# Run inside a sandbox: one chat completion through the gateway with the sandbox's env.
CHAT = r"""
import json, os, sys, urllib.error, urllib.request
req = urllib.request.Request(
    os.environ["OPENAI_BASE_URL"] + "/chat/completions",
    data=json.dumps({"model": sys.argv[1], "messages": [{"role": "user", "content": "hi"}]}).encode(),
    headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
             "Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=30) as r:
        print(json.load(r)["choices"][0]["message"]["content"])
except urllib.error.HTTPError as e:
    print(e.code)
"""


def _gateway_status(url: str, token: str) -> int:
    req = urllib.request.Request(url + "/models", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_sandboxes_on_every_node_call_the_clusters_model_gateway(cluster) -> None:
    """API servers mint tokens into etcd, `dsec gateway` reads them from there, and each
    node forwards its sandboxes' model address to the gateway on the host."""
    with dsec.Client(cluster.urls, cluster.key) as c:
        sbs = [dsec.Sandbox.create(c, model_access=["policy"], timeout=300) for _ in range(6)]
        try:
            infos = [sb.refresh() for sb in sbs]
            nodes = {i.node for i in infos}
            assert len(nodes) >= 2, f"all on {nodes}"
            tokens = []
            for sb in sbs:
                sb.write("/tmp/chat.py", CHAT)
                r = sb.exec(["python3", "/tmp/chat.py", "policy"], timeout=60)
                assert r.stdout.strip() == "echo: hi", (sb.refresh().node, r.stdout, r.stderr)
                tokens.append(sb.exec("echo $OPENAI_API_KEY").stdout.strip())
            assert len(set(tokens)) == len(tokens)
        finally:
            for sb in sbs:
                sb.kill()
    # Each token dies with its sandbox, on the gateway too (it follows etcd).
    for token in tokens:
        assert _until(lambda t=token: _gateway_status(cluster.gateway_url, t) == 401, 5), token


def _chat_as(url: str, token: str, prompt: str) -> int:
    """A chat completion at gateway `url` with sandbox token `token`: the status."""
    req = urllib.request.Request(
        url + "/chat/completions",
        data=json.dumps({"model": "policy", "messages": [{"role": "user", "content": prompt}]}).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _spent(url: str, token: str) -> int:
    """What gateway `url` counts against the token's budget (its own `/usage`)."""
    req = urllib.request.Request(url + "/usage", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return int(json.load(r)["spent_tokens"])
    except (urllib.error.URLError, OSError):
        return -1


def test_a_budget_holds_across_gateway_replicas_and_a_restart(cluster) -> None:
    """Gateways share what they charged through etcd: a second replica starts from what
    the first charged, and one that restarts from what its earlier run charged."""
    from conftest import _dsec_bin, _free_port, _pdeathsig

    state = json.loads((cluster.root / "cluster.json").read_text())
    first = cluster.gateway_url

    def replica(name: str) -> "tuple[subprocess.Popen, str]":
        url = f"http://127.0.0.1:{_free_port()}/v1"
        log = open(cluster.root / f"gateway-{name}.log", "w")
        p = subprocess.Popen(
            [str(_dsec_bin()), "gateway", "--config", str(cluster.root / "gateway.yaml"),
             "--listen", url[len("http://"):-len("/v1")], "--etcd", ",".join(state["etcd"]),
             "--etcd-prefix", f"/dsec-{state['tag']}"],
            stdout=log, stderr=subprocess.STDOUT, preexec_fn=_pdeathsig)
        def up() -> bool:
            try:
                return _gateway_status(url, "nobody") == 401
            except (urllib.error.URLError, OSError):
                return False

        assert _until(up, 20), (cluster.root / f"gateway-{name}.log").read_text()
        return p, url

    started: List[subprocess.Popen] = []
    with dsec.Client(cluster.urls, cluster.key) as c:
        sb = dsec.Sandbox.create(
            c, model_access=dsec.ModelAccess(models=["policy"], budget_tokens=40), timeout=300)
        try:
            token = sb.exec("echo $OPENAI_API_KEY").stdout.strip()
            # The fake charges 9 tokens for this prompt (4 words in, "echo:" and 4 out).
            prompt = "one two three four"
            for _ in range(3):
                assert _chat_as(first, token, prompt) == 200
            assert _spent(first, token) == 27
            # A second replica starts from the first's 27: 13 left, one call more.
            p, second = replica("second")
            started.append(p)
            assert _until(lambda: _spent(second, token) == 27, 10), _spent(second, token)
            assert _chat_as(second, token, prompt) == 200  # 36 of 40
            assert _chat_as(second, token, prompt) == 200  # 45: over, no more anywhere
            assert _chat_as(second, token, prompt) == 429
            assert _until(lambda: _spent(first, token) == 45, 10), _spent(first, token)
            assert _chat_as(first, token, prompt) == 429
            # The second replica restarts (its last totals stored as it stops).
            p.terminate()
            assert p.wait(timeout=20) == 0
            p, again = replica("second-restarted")
            started.append(p)
            assert _until(lambda: _spent(again, token) == 45, 10), _spent(again, token)
            assert _chat_as(again, token, prompt) == 429
        finally:
            for p in started:
                p.kill()
                p.wait()
            sb.kill()

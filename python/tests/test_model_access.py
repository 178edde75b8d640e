"""Sandboxes created with `model_access` call the model gateway from inside, with the
unmodified `openai` SDK and nothing but the environment the sandbox was given. The token
is the sandbox's own: its models, its budget, and it dies with the sandbox. The sandbox
reaches the gateway and nothing else of the host: not the upstream, not other ports.

The server is conftest's `dsec serve --gateway-config`, whose gateway fronts a fake
upstream (`fake-openai`) listening on every address."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import dsec
from conftest import Server, _missing

# The openai SDK put into sandboxes: the version run-tests.sh pins for the host.
OPENAI_VERSION = "2.54.0"


@pytest.fixture(scope="module")
def openai_for_sandboxes(server: Server) -> Path:
    """The openai SDK and its dependencies for the base image's Python (3.11), as a
    directory to upload (cached across runs)."""
    target = server.root / f"openai-{OPENAI_VERSION}-py311"
    if (target / ".complete").exists():
        return target
    shutil.rmtree(target, ignore_errors=True)
    cmd = [
        sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
        "--target", str(target), "--python-version", "3.11", "--only-binary=:all:",
        f"openai=={OPENAI_VERSION}",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        _missing(f"pip could not fetch openai for the sandbox: {done.stderr[-2000:]}")
    (target / ".complete").write_text("")
    return target


def _gateway_get(server: Server, path: str, key: str) -> int:
    """The status of GET `path` on the gateway's outside listener with `key`."""
    req = urllib.request.Request(server.gateway_url + path, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


# Run inside the sandbox: one call per line of argv[1:] (JSON: model, prompt), with the
# client built from the environment alone; prints one JSON line per call.
CALLS = r"""
import json, sys
import openai
client = openai.OpenAI(max_retries=0)
for arg in sys.argv[1:]:
    call = json.loads(arg)
    try:
        r = client.chat.completions.create(
            model=call["model"], messages=[{"role": "user", "content": call["prompt"]}],
            max_tokens=call.get("max_tokens"))
        print(json.dumps({"ok": r.choices[0].message.content, "tokens": r.usage.total_tokens}))
    except openai.APIStatusError as e:
        print(json.dumps({"status": e.status_code, "code": e.code,
                          "retry": e.response.headers.get("x-should-retry")}))
"""


def _calls(sb: dsec.Sandbox, *calls: dict) -> list:
    r = sb.exec(["python3", "/opt/calls.py", *[json.dumps(c) for c in calls]],
                env={"PYTHONPATH": "/opt/py"}, timeout=120)
    assert r.exit_code == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


def test_a_sandbox_calls_its_models_with_the_token_it_was_given(
        client: dsec.Client, server: Server, openai_for_sandboxes: Path) -> None:
    sb = dsec.Sandbox.create(client, model_access={"models": ["policy"], "budget_tokens": 60})
    try:
        info = sb.refresh()
        assert info.model_access is not None and info.model_access.models == ["policy"]
        assert info.model_token_id
        env = sb.exec("echo $OPENAI_BASE_URL; echo $OPENAI_API_KEY").stdout.split()
        assert env[0] == "http://169.254.169.250/v1", env
        token = env[1]
        assert token.startswith("dsgw_") and info.model_token_id in token
        assert info.model_dump_json().find(token) < 0, "the view never shows the token"

        sb.upload_dir(str(openai_for_sandboxes), "/opt/py")
        sb.write("/opt/calls.py", CALLS)
        first, other_model = _calls(
            sb, {"model": "policy", "prompt": "hello from the sandbox"},
            {"model": "judge", "prompt": "not mine"})
        assert first["ok"] == "echo: hello from the sandbox", first
        # A model the token was not given answers as one that does not exist.
        assert other_model["status"] == 404 and other_model["code"] == "model_not_found", other_model

        # The budget (60 tokens) runs out; then the gateway refuses before the upstream,
        # and tells the SDK not to retry.
        results = _calls(sb, *[{"model": "policy", "prompt": "spend " * 8}] * 6)
        spent = [r for r in results if "ok" in r]
        refused = [r for r in results if "status" in r]
        assert spent and refused, results
        assert refused[-1] == {"status": 429, "code": "insufficient_quota", "retry": "false"}, results

        # The same token works from outside (a trainer debugging) until the sandbox goes.
        assert _gateway_get(server, "/models", token) == 200
    finally:
        sb.kill()
    deadline = time.monotonic() + 2
    while _gateway_get(server, "/models", token) != 401:
        assert time.monotonic() < deadline, "the token outlived its sandbox by 2 s"
        time.sleep(0.05)


# Run inside the sandbox: TCP connects to each argv "host:port"; prints one verdict each.
PROBE = r"""
import socket, sys
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
        print("open")
    except OSError as e:
        print("closed")
"""


def test_a_sandbox_reaches_the_gateway_and_nothing_else_of_the_host(
        client: dsec.Client, server: Server) -> None:
    # Mode none: the gateway is its only way out.
    sb = dsec.Sandbox.create(client, model_access=["policy"])
    try:
        sb.write("/tmp/probe.py", PROBE)
        host_end = sb.exec("ip route 2>/dev/null | awk '/default/ {print $3}'").stdout.strip()
        if not host_end:  # no iproute2 in the image: the slot's host end is .1 of its /30
            ip = sb.refresh().ip or ""
            parts = ip.split(".")
            host_end = ".".join(parts[:3] + [str(int(parts[3]) - 1)]) if len(parts) == 4 else ""
        assert host_end, "the sandbox has an address"
        targets = [
            "169.254.169.250:80",                 # the gateway
            "169.254.169.250:81",                 # the gateway's address, another port
            f"{host_end}:{server.fake_port}",     # the upstream, on the host end
            f"{host_end}:{server.url.rsplit(':', 1)[1]}",  # dsec's own API
            "1.1.1.1:443",                        # anywhere else
        ]
        r = sb.exec(["python3", "/tmp/probe.py", *targets], timeout=60)
        assert r.exit_code == 0, r.stderr
        assert r.stdout.split() == ["open", "closed", "closed", "closed", "closed"], (targets, r.stdout)
    finally:
        sb.kill()

    # Without model access the gateway is not there either.
    plain = dsec.Sandbox.create(client, network="open")
    try:
        plain.write("/tmp/probe.py", PROBE)
        r = plain.exec(["python3", "/tmp/probe.py", "169.254.169.250:80"], timeout=60)
        assert r.stdout.split() == ["closed"], r.stdout
    finally:
        plain.kill()


def test_bad_model_access_is_refused_with_what_to_fix(client: dsec.Client) -> None:
    with pytest.raises(dsec.BadRequest, match="serves no model"):
        dsec.Sandbox.create(client, model_access=["gpt-nonexistent"])
    with pytest.raises(dsec.BadRequest, match="OPENAI_API_KEY"):
        dsec.Sandbox.create(client, model_access=["policy"], env={"OPENAI_API_KEY": "sk-mine"})
    with pytest.raises(dsec.BadRequest, match="port 80"):
        dsec.Sandbox.create(client, model_access=["policy"], tcp_connect=[443])

"""Function calls: a pool made for calls, driven by the dsec SDK and by the unmodified
`sandbox-fusion` client (what verl's reward code uses) through dsec's SandboxFusion
front at /sandboxfusion/{pool}: python, bash and cpp programs with correct output, a
compile error, a timeout and a runtime error."""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit

import pytest
import requests

import dsec

try:
    from sandbox_fusion import RunCodeRequest, run_code
    from sandbox_fusion.models import CommandRunStatus, RunStatus
except ImportError as e:  # CI must run these: fail there instead of skipping
    if os.environ.get("CI") in ("true", "1"):
        raise
    pytest.skip(f"sandbox-fusion not installed: {e}", allow_module_level=True)

POOL = "judge"


def _cpp_tar() -> Path:
    tar = Path(os.environ.get("DSEC_CPP_TAR", "/var/cache/dsec/cpp-bookworm.tar"))
    if not tar.exists():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{tar} missing (scripts/lib.sh: ensure_cpp_tar)", pytrace=False)
        pytest.skip(f"{tar} missing (scripts/lib.sh: ensure_cpp_tar)")
    return tar


@pytest.fixture(scope="module")
def judge(client: dsec.Client) -> Iterator[str]:
    """A call pool on an image with compilers; yields its name."""
    if not any(i.name == "cpp" for i in client.list_images()):
        client.import_image("cpp", str(_cpp_tar()))
    client.create_pool(POOL, template={"image": "cpp"}, min=2, max=4, fncall={"max_calls": 500})
    deadline = time.monotonic() + 120
    while client.get_pool(POOL)["ready"] < 2:
        assert time.monotonic() < deadline, client.get_pool(POOL)
        time.sleep(0.2)
    yield POOL
    client.delete_pool(POOL)


def _endpoint(server, pool: str) -> str:
    # The client sends no headers: the key rides as the URL's password (Basic auth).
    u = urlsplit(server.url)
    return f"http://dsec:{server.key}@{u.netloc}/sandboxfusion/{pool}"


def test_sandbox_fusion_client_runs_python_bash_and_cpp(server, judge: str) -> None:
    ep = _endpoint(server, judge)
    r = run_code(RunCodeRequest(code="print('Hello, world!')", language="python"), endpoint=ep)
    assert r.status == RunStatus.Success, r
    assert r.compile_result is None
    assert r.run_result.status == CommandRunStatus.Finished
    assert (r.run_result.return_code, r.run_result.stdout, r.run_result.stderr) == (0, "Hello, world!\n", "")
    assert r.executor_pod_name

    r = run_code(RunCodeRequest(code='read x; echo "got $x"', language="bash", stdin="42\n"), endpoint=ep)
    assert r.status == RunStatus.Success, r
    assert r.run_result.stdout == "got 42\n"

    cpp = '#include <iostream>\nint main() { int a, b; std::cin >> a >> b; std::cout << a + b << "\\n"; }\n'
    r = run_code(RunCodeRequest(code=cpp, language="cpp", stdin="2 40"), endpoint=ep)
    assert r.status == RunStatus.Success, r
    assert r.compile_result.status == CommandRunStatus.Finished
    assert r.compile_result.return_code == 0
    assert r.run_result.stdout == "42\n"

    # Input files land beside the code; fetched files come back base64.
    r = run_code(
        RunCodeRequest(
            code="print(open('data.txt').read().upper()); open('out.txt', 'w').write('done')",
            language="python",
            files={"data.txt": base64.b64encode(b"payload").decode()},
            fetch_files=["out.txt", "not-there.txt"],
        ),
        endpoint=ep,
    )
    assert r.status == RunStatus.Success, r
    assert r.run_result.stdout == "PAYLOAD\n"
    assert r.files == {"out.txt": base64.b64encode(b"done").decode()}


def test_sandbox_fusion_client_sees_compile_errors_timeouts_and_runtime_errors(server, judge: str) -> None:
    ep = _endpoint(server, judge)
    r = run_code(RunCodeRequest(code="int main() { return undeclared; }", language="cpp"), endpoint=ep)
    assert r.status == RunStatus.Failed, r
    assert r.compile_result.status == CommandRunStatus.Finished
    assert r.compile_result.return_code != 0
    assert "undeclared" in r.compile_result.stderr
    assert r.run_result is None

    started = time.monotonic()
    r = run_code(RunCodeRequest(code="import time\nprint('x', flush=True)\ntime.sleep(60)", language="python", run_timeout=1), endpoint=ep)
    assert time.monotonic() - started < 10
    assert r.status == RunStatus.Failed, r
    assert r.run_result.status == CommandRunStatus.TimeLimitExceeded
    assert r.run_result.return_code is None
    assert r.run_result.stdout == "x\n"

    r = run_code(RunCodeRequest(code="assert 1 == 2", language="python"), endpoint=ep)
    assert r.status == RunStatus.Failed, r
    assert r.run_result.status == CommandRunStatus.Finished
    assert r.run_result.return_code == 1
    assert "AssertionError" in r.run_result.stderr

    # A language dsec does not run is the sandbox's error, said plainly; so is a pool
    # that does not exist (the client raises on SandboxError).
    with pytest.raises(Exception, match="not supported"):
        run_code(RunCodeRequest(code="fn main() {}", language="rust"), endpoint=ep, max_attempts=1)
    with pytest.raises(Exception, match="not found"):
        run_code(RunCodeRequest(code="print(1)", language="python"), endpoint=_endpoint(server, "nope"), max_attempts=1)


def test_verl_style_posts_and_the_health_check(server, judge: str) -> None:
    # verl posts to the full .../run_code URL with its own headers and a memory limit.
    url = f"{server.url}/sandboxfusion/{judge}/run_code"
    payload = {"compile_timeout": 10, "run_timeout": 10, "code": "print(int(input()) * 2)", "stdin": "21",
               "memory_limit_MB": 1024, "language": "python", "files": {}, "fetch_files": []}
    resp = requests.post(url, json=payload, headers={"Authorization": f"Bearer {server.key}"}, timeout=30)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["status"] == "Success", body
    assert body["run_result"]["stdout"] == "42\n"
    # Without a key: refused.
    assert requests.post(url, json=payload, timeout=30).status_code == 401
    # The health check answers without one, as SandboxFusion's does.
    ping = requests.get(f"{server.url}/sandboxfusion/{judge}/v1/ping", timeout=30)
    assert (ping.status_code, ping.json()) == (200, "pong")


def test_sdk_calls_do_not_see_each_other(client: dsec.Client, judge: str) -> None:
    first = client.fncall(judge, "echo secret > /tmp/left; touch /etc/marker; sleep 100 & echo ok")
    assert (first["status"], first["stdout"]) == ("finished", "ok\n"), first
    seen = set()
    for _ in range(4):  # every sandbox of the pool, whichever serves
        r = client.fncall(judge, "ls /tmp/left /etc/marker 2>/dev/null | wc -l; pgrep -c sleep || true")
        assert r["stdout"].split() == ["0", "0"], r
        seen.add(r["sandbox_id"])
    r = client.fncall(judge, None, code="import sys; sys.exit(7)", language="python")
    assert r["exit_code"] == 7, r

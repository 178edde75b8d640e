"""Fixtures: one real `dsec serve` per test session.

Environment:
    DSEC_BIN        the dsec binary (default: <repo>/target/debug/dsec)
    DSEC_AGENT_BIN  the static agent (default: <repo>/target/x86_64-unknown-linux-gnu/release/dsec-agent)
    DSEC_BASE_TAR   the base rootfs tarball (default: /var/cache/dsec/base-bookworm.tar)
    DSEC_PY_TEST_DIR where state lives between runs (default: /tmp/dsec-pytest); the
                    imported base image is kept there, so later runs start fast.
    CI=true         missing prerequisites fail instead of skipping.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python" / "examples"))

import dsec  # noqa: E402
from dsec.client import _reset_default_client  # noqa: E402


def _missing(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"prerequisite missing (CI=true): {reason}", pytrace=False)
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pdeathsig() -> None:
    # The server dies with the test process, even when pytest is killed.
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Server:
    """A running `dsec serve`."""

    def __init__(self, url: str, key: str, root: Path, proc: subprocess.Popen) -> None:
        self.url = url
        self.key = key
        self.root = root
        self.proc = proc
        # Its in-process model gateway (see `_start_fake_openai`).
        self.gateway_url = ""
        self.gateway_key = GATEWAY_KEY
        self.fake_port = 0

    def log(self) -> str:
        try:
            return (self.root / "serve.log").read_text(errors="replace")[-4000:]
        except OSError:
            return ""


def _dsec_bin() -> Path:
    bin_path = Path(os.environ.get("DSEC_BIN", REPO / "target" / "debug" / "dsec"))
    if not bin_path.is_absolute():
        bin_path = REPO / bin_path
    if not bin_path.exists():
        _missing(f"{bin_path} not built (cargo build --workspace --bins)")
    return bin_path


def _base_tar() -> Path:
    base_tar = Path(os.environ.get("DSEC_BASE_TAR", "/var/cache/dsec/base-bookworm.tar"))
    if not base_tar.exists():
        _missing(f"{base_tar} missing (scripts/build-base-image.sh)")
    return base_tar


def _server_env() -> Dict[str, str]:
    env = dict(os.environ)
    if not env.get("DSEC_AGENT_BIN"):
        static = REPO / "target" / "x86_64-unknown-linux-gnu" / "release" / "dsec-agent"
        if static.exists():
            env["DSEC_AGENT_BIN"] = str(static)
    return env


# Calls with a request id the test server's sandboxes keep (`--max-recorded-calls`).
MAX_RECORDED_CALLS = 300
# The key the test server's model gateway gives callers outside sandboxes.
GATEWAY_KEY = "py-trainer-key"


def _start_fake_openai(root: Path) -> "tuple[subprocess.Popen, int]":
    """A fake OpenAI upstream (dsec-testkit's `fake-openai`) on every address, so a test
    can show a sandbox does not reach it directly; its port."""
    path = _dsec_bin().parent / "fake-openai"
    if not path.exists():
        _missing(f"{path} not built (cargo build --workspace --bins)")
    proc = subprocess.Popen(
        [str(path), "--listen", "0.0.0.0:0", "--models", "real-policy,real-judge"],
        stdout=subprocess.PIPE, stderr=open(root / "fake-openai.log", "wb"), text=True,
        preexec_fn=_pdeathsig,
    )
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()  # http://ADDR:PORT/v1
    if not url.startswith("http://"):
        proc.kill()
        pytest.fail(f"fake-openai did not start: {(root / 'fake-openai.log').read_text()}", pytrace=False)
    return proc, int(url.rsplit(":", 1)[1].split("/", 1)[0])


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    if os.geteuid() != 0:
        _missing("dsec serve needs root")
    bin_path = _dsec_bin()
    env = _server_env()

    root = Path(os.environ.get("DSEC_PY_TEST_DIR", "/tmp/dsec-pytest"))
    root.mkdir(parents=True, exist_ok=True)
    # The run directory on a tmpfs, like a real node's /run/dsec.
    state, run = root / "state", Path(os.environ.get("DSEC_PY_RUN_DIR", "/run/dsec-pytest"))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    fake, fake_port = _start_fake_openai(root)
    gateway_config = root / "gateway.yaml"
    gateway_config.write_text(
        f"api_keys: [{GATEWAY_KEY}]\n"
        "models:\n"
        f"  policy: {{upstreams: [{{url: 'http://127.0.0.1:{fake_port}/v1', model: real-policy}}]}}\n"
        f"  judge: {{upstreams: [{{url: 'http://127.0.0.1:{fake_port}/v1', model: real-judge}}]}}\n"
    )
    gateway_port = _free_port()
    log = open(root / "serve.log", "ab")
    proc = subprocess.Popen(
        [
            str(bin_path), "serve", "--listen", f"127.0.0.1:{port}", "--state-dir", str(state),
            "--run-dir", str(run),
            # Networking of its own, apart from any other dsec on this host.
            "--nft-table", "dsec_py", "--link-prefix", "dspy", "--sandbox-subnet", "10.239.0.0/16",
            "--dns-port", "15369", "--net-pool", "1",
            # Its own cgroup parent: a node on the default one (the quick start's) keeps it.
            "--cgroup-parent", "dsec-py",
            # A loopback "registry" where nothing listens (port 1): the pull error test.
            "--allow-registry", "127.0.0.1:1",
            # A small record of calls per sandbox: the test of a full one stays quick
            # (no other test records this many calls in one sandbox).
            "--max-recorded-calls", str(MAX_RECORDED_CALLS),
            # The model gateway in process, its sandbox port apart from any other dsec's.
            "--gateway-config", str(gateway_config),
            "--gateway-listen", f"127.0.0.1:{gateway_port}",
            "--gateway-sandbox-port", str(_free_port()),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        preexec_fn=_pdeathsig,
    )
    srv = None
    try:
        key = ""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            try:
                key = (state / "api-key").read_text().strip()
                if key:
                    dsec.Client(url, key, timeout=2).health()
                    break
            except (OSError, dsec.DsecError):
                pass
            key = ""
            time.sleep(0.1)
        srv = Server(url, key, root, proc)
        srv.gateway_url = f"http://127.0.0.1:{gateway_port}/v1"
        srv.fake_port = fake_port
        if not key:
            pytest.fail(f"dsec serve did not come up; log:\n{srv.log()}", pytrace=False)
        with dsec.Client(url, key) as c:
            if not any(i.name == "base" for i in c.list_images()):
                c.import_image("base", str(_base_tar()))
            for sb in c.list_sandboxes():  # leftovers of an interrupted run
                c.delete_sandbox(sb.id)
        yield srv
    finally:
        if srv is not None and srv.key:
            try:
                with dsec.Client(url, srv.key) as c:
                    for sb in c.list_sandboxes():
                        c.delete_sandbox(sb.id)
            except dsec.DsecError:
                pass
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        fake.kill()
        fake.wait()
        shutil.rmtree(run, ignore_errors=True)


@pytest.fixture(scope="session")
def client(server: Server) -> Iterator[dsec.Client]:
    # The default client (Sandbox.create() without client=) reads these too.
    os.environ["DSEC_URL"] = server.url
    os.environ["DSEC_API_KEY"] = server.key
    _reset_default_client()
    c = dsec.Client(server.url, server.key)
    yield c
    c.close()
    _reset_default_client()


@pytest.fixture
def sandbox(client: dsec.Client) -> Iterator[dsec.Sandbox]:
    with dsec.Sandbox.create(client, timeout=600) as sb:
        yield sb


class Cluster:
    """A dsec cluster on this machine (scripts/local-cluster): etcd, API servers, nodes."""

    def __init__(self, root: Path, urls: List[str], key: str) -> None:
        self.root = root
        self.urls = urls
        self.key = key
        self.gateway_url = ""  # its `dsec gateway` (.../v1)

    def logs(self) -> str:
        out = []
        for log in sorted(self.root.glob("*.log")):
            out.append(f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}")
        return "\n".join(out)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """Three nodes and two API servers on one etcd, with the base image uploaded."""
    if os.geteuid() != 0:
        _missing("dsec nodes need root")
    bin_path, base_tar = _dsec_bin(), _base_tar()
    if shutil.which("etcd") is None and not Path("/usr/bin/etcd").exists():
        _missing("etcd not installed (apt-get install etcd-server)")
    root = Path(os.environ.get("DSEC_PY_TEST_DIR", "/tmp/dsec-pytest")) / "cluster"
    script = str(REPO / "scripts" / "local-cluster")
    if (root / "cluster.json").exists():  # an interrupted run's
        subprocess.run([script, "down", str(root)], check=False)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    # A model gateway in front of a fake upstream, reading sandbox tokens from etcd.
    fake, fake_port = _start_fake_openai(root)
    gateway_config = root / "gateway.yaml"
    gateway_config.write_text(
        f"api_keys: [{GATEWAY_KEY}]\n"
        "models:\n"
        f"  policy: {{upstreams: [{{url: 'http://127.0.0.1:{fake_port}/v1', model: real-policy}}]}}\n"
    )
    up = subprocess.run(
        [script, "up", str(root), "--nodes", "3", "--apiservers", "2", "--dsec", str(bin_path),
         "--gateway-config", str(gateway_config), "--gateway-models", "policy"],
        env=_server_env(), capture_output=True, text=True,
    )
    if up.returncode != 0:
        fake.kill()
        pytest.fail(f"local-cluster up failed:\n{up.stderr}", pytrace=False)
    env = dict(line.split("=", 1) for line in up.stdout.splitlines() if "=" in line)
    c = Cluster(root, env["DSEC_URL"].split(","), env["DSEC_API_KEY"])
    c.gateway_url = env["DSEC_GATEWAY_URL"]
    try:
        with dsec.Client(c.urls, c.key) as client:
            client.upload_image("base", str(base_tar))
        yield c
    finally:
        subprocess.run([script, "down", str(root)], check=False)
        fake.kill()
        fake.wait()

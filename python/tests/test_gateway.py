"""The model gateway (`dsec gateway`) driven by the unmodified `openai` SDK, in front of
fake OpenAI-compatible upstreams (`fake-openai`, from dsec-testkit): chat, streaming,
completions, embeddings (the SDK's default base64), the model list, failover past an
upstream that is down, and OpenAI-shaped errors the SDK raises as its own exceptions."""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Iterator, List

import openai  # installed (pinned) by python/run-tests.sh
import pytest

from conftest import REPO, _free_port, _missing, _pdeathsig  # noqa: E402

KEY = "gw-python-key"


def _bin(name: str) -> Path:
    path = Path(os.environ.get("DSEC_BIN", REPO / "target" / "debug" / "dsec")).parent / name
    if not path.exists():
        _missing(f"{path} not built (cargo build --workspace --bins)")
    return path


def _start(args: List[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True,
                            preexec_fn=_pdeathsig)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("gateway")
    procs = []
    try:
        fake = _start([str(_bin("fake-openai")), "--models", "real-policy"], root / "fake.log")
        procs.append(fake)
        assert fake.stdout is not None
        fake_url = fake.stdout.readline().strip()
        assert fake_url.startswith("http://"), fake_url
        dead = f"http://127.0.0.1:{_free_port()}/v1"
        config = root / "gateway.yaml"
        config.write_text(
            f"api_keys: [{KEY}]\n"
            "models:\n"
            "  policy:\n"
            f"    upstreams: [{{url: '{dead}'}}, {{url: '{fake_url}', model: real-policy}}]\n"
        )
        port = _free_port()
        gw = _start([str(_bin("dsec")), "gateway", "--config", str(config), "--listen", f"127.0.0.1:{port}"],
                    root / "gateway.log")
        procs.append(gw)
        url = f"http://127.0.0.1:{port}/v1"
        deadline = time.time() + 20
        while True:
            try:
                urllib.request.urlopen(url + "/models", timeout=1)
            except urllib.error.HTTPError:
                break  # it answers (401 without a key)
            except OSError:
                if gw.poll() is not None or time.time() > deadline:
                    pytest.fail(f"dsec gateway did not start: {(root / 'gateway.log').read_text()}")
                time.sleep(0.1)
        yield url
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_the_openai_sdk_works_through_the_gateway(gateway: str) -> None:
    client = openai.OpenAI(base_url=gateway, api_key=KEY, max_retries=0)
    r = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi there"}])
    assert r.choices[0].message.content == "echo: hi there"
    assert r.usage is not None and r.usage.total_tokens > 0

    stream = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "a b c"}], stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "echo: a b c"
    assert chunks[-1].usage is not None and chunks[-1].choices == []

    c = client.completions.create(model="policy", prompt="xyz")
    assert c.choices[0].text == "echo: xyz"
    e = client.embeddings.create(model="policy", input=["one", "two"])  # base64 on the wire
    assert len(e.data) == 2 and len(e.data[0].embedding) == 4
    assert [m.id for m in client.models.list()] == ["policy"]


def test_errors_are_the_sdks_own_exceptions(gateway: str) -> None:
    bad_key = openai.OpenAI(base_url=gateway, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
    client = openai.OpenAI(base_url=gateway, api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "[fake fail=503]"}])

"""The model gateway (`dsec gateway`) driven by the unmodified `openai` SDK, in front of
fake OpenAI-compatible upstreams (`fake-openai`, from dsec-testkit): chat, streaming,
completions, embeddings (the SDK's default base64), the model list, failover past an
upstream that is down, OpenAI-shaped errors the SDK raises as its own exceptions, and
the limits of caller keys (429s the SDK's own retries wait out, a concurrency cap), and
the response cache with the coalescing of identical requests."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List

import openai  # installed (pinned) by python/run-tests.sh
import pytest

from conftest import REPO, _free_port, _missing, _pdeathsig  # noqa: E402

KEY = "gw-python-key"
RPM_KEY = "gw-rpm-120-burst-1"  # one request each 0.5 s
STRICT_KEY = "gw-rpm-1"  # one request a minute
TWO_KEY = "gw-two-at-once"
QUICK_KEY = "gw-one-second"


@dataclass
class Gateway:
    url: str  # the gateway's base URL (.../v1)
    fake: str  # the fake upstream's root URL

    def fake_stats(self) -> Dict:
        with urllib.request.urlopen(self.fake + "/_fake/stats", timeout=5) as r:
            return json.load(r)

    def fake_chats(self) -> int:
        return int(self.fake_stats()["requests"].get("/v1/chat/completions", 0))

    def metric(self, series: str) -> float:
        req = urllib.request.Request(self.url[: -len("/v1")] + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(req, timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(series + " "):
                    return float(line.split()[-1])
        raise AssertionError(f"no {series} in /metrics")

    def fake_reset(self) -> None:
        urllib.request.urlopen(urllib.request.Request(self.fake + "/_fake/reset", method="POST"), timeout=5).close()


def _bin(name: str) -> Path:
    path = Path(os.environ.get("DSEC_BIN", REPO / "target" / "debug" / "dsec")).parent / name
    if not path.exists():
        _missing(f"{path} not built (cargo build --workspace --bins)")
    return path


def _start(args: List[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True,
                            preexec_fn=_pdeathsig)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[Gateway]:
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
            "api_keys:\n"
            f"  - {KEY}\n"
            f"  - {{key: {RPM_KEY}, limits: {{rpm: 120, burst: 1}}}}\n"
            f"  - {{key: {STRICT_KEY}, limits: {{rpm: 1}}}}\n"
            f"  - {{key: {TWO_KEY}, limits: {{max_concurrency: 2}}}}\n"
            f"  - {{key: {QUICK_KEY}, limits: {{timeout_s: 1}}}}\n"
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
        yield Gateway(url=url, fake=fake_url[: -len("/v1")])
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_the_openai_sdk_works_through_the_gateway(gateway: Gateway) -> None:
    client = openai.OpenAI(base_url=gateway.url, api_key=KEY, max_retries=0)
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
    # Without include_usage the gateway still asks for the usage (to charge tokens), but
    # the caller does not see that chunk.
    stream = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "a b c"}], stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "echo: a b c"
    assert all(c.choices for c in chunks), "no usage-only chunk"

    c = client.completions.create(model="policy", prompt="xyz")
    assert c.choices[0].text == "echo: xyz"
    e = client.embeddings.create(model="policy", input=["one", "two"])  # base64 on the wire
    assert len(e.data) == 2 and len(e.data[0].embedding) == 4
    assert [m.id for m in client.models.list()] == ["policy"]


def test_errors_are_the_sdks_own_exceptions(gateway: Gateway) -> None:
    bad_key = openai.OpenAI(base_url=gateway.url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
    client = openai.OpenAI(base_url=gateway.url, api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "[fake fail=503]"}])


def _ask(client: openai.OpenAI, prompt: str) -> str:
    r = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": prompt}])
    return r.choices[0].message.content or ""


def test_rate_limits_are_waited_out_by_the_sdks_own_retries(gateway: Gateway) -> None:
    # 120 a minute with a burst of 1: each call after the first is refused once, with a
    # retry-after-ms of about 500 that the SDK (2 retries by default) honours.
    client = openai.OpenAI(base_url=gateway.url, api_key=RPM_KEY)
    for i in range(5):
        assert _ask(client, f"call {i}") == f"echo: call {i}"


def test_a_429_is_a_rate_limit_error_with_both_retry_headers(gateway: Gateway) -> None:
    client = openai.OpenAI(base_url=gateway.url, api_key=STRICT_KEY, max_retries=0)
    assert _ask(client, "first") == "echo: first"
    with pytest.raises(openai.RateLimitError) as e:
        _ask(client, "second")
    assert e.value.code == "rate_limit_exceeded"
    headers = e.value.response.headers
    assert 1 <= int(headers["retry-after"]) <= 60
    assert 0 < float(headers["retry-after-ms"]) <= 60_000


def test_a_concurrency_cap_holds_and_the_sdk_retries_past_it(gateway: Gateway) -> None:
    gateway.fake_reset()
    client = openai.OpenAI(base_url=gateway.url, api_key=TWO_KEY)
    answers: List[str] = []
    errors: List[BaseException] = []

    def call(i: int) -> None:
        try:
            answers.append(_ask(client, f"slow {i} [fake latency_ms=300]"))
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(answers) == [f"echo: slow {i} [fake latency_ms=300]" for i in range(4)]
    assert gateway.fake_stats()["max_in_flight"] == 2
    assert gateway.metric('dsec_gateway_limited_total{limit="concurrency"}') >= 2


def test_over_its_time_limit_a_call_fails_at_once_and_a_stream_raises(gateway: Gateway) -> None:
    gateway.fake_reset()
    client = openai.OpenAI(base_url=gateway.url, api_key=QUICK_KEY)  # 2 retries by default
    start = time.monotonic()
    with pytest.raises(openai.InternalServerError) as e:
        _ask(client, "slow [fake latency_ms=5000]")
    assert e.value.status_code == 504 and e.value.code == "timeout"
    assert gateway.fake_chats() == 1, "x-should-retry: false, so the SDK did not retry"
    assert time.monotonic() - start < 4.5
    stream = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "long [fake chunks=30 chunk_ms=100]"}], stream=True)
    with pytest.raises(openai.APIError, match="time limit"):
        for _ in stream:
            pass


def test_a_deterministic_call_is_answered_from_the_cache(gateway: Gateway) -> None:
    gateway.fake_reset()
    client = openai.OpenAI(base_url=gateway.url, api_key=KEY, max_retries=0)
    messages = [{"role": "user", "content": "cache me"}]
    first = client.chat.completions.with_raw_response.create(model="policy", messages=messages, temperature=0)
    assert first.headers["x-dsec-cache"] == "miss"
    assert gateway.fake_chats() == 1
    second = client.chat.completions.with_raw_response.create(model="policy", messages=messages, temperature=0)
    assert second.headers["x-dsec-cache"] == "hit"
    assert gateway.fake_chats() == 1, "the second call never reached the upstream"
    assert second.parse().choices[0].message.content == first.parse().choices[0].message.content == "echo: cache me"
    # Not deterministic: not cached.
    third = client.chat.completions.with_raw_response.create(model="policy", messages=messages, temperature=0.5)
    assert third.headers["x-dsec-cache"] == "bypass"
    assert gateway.fake_chats() == 2


def test_identical_concurrent_calls_share_one_upstream_call(gateway: Gateway) -> None:
    gateway.fake_reset()
    messages = [{"role": "user", "content": "all together [fake latency_ms=500]"}]

    async def twenty():
        client = openai.AsyncOpenAI(base_url=gateway.url, api_key=KEY, max_retries=0)
        try:
            return await asyncio.gather(*[
                client.chat.completions.with_raw_response.create(model="policy", messages=messages, temperature=0)
                for _ in range(20)
            ])
        finally:
            await client.close()

    answers = asyncio.run(twenty())
    assert gateway.fake_chats() == 1
    assert {a.parse().choices[0].message.content for a in answers} == {"echo: " + messages[0]["content"]}
    used = sorted(a.headers["x-dsec-cache"] for a in answers)
    # One call went upstream; the others waited for it (or, had they come after it
    # landed, were answered from the cache).
    assert used.count("miss") == 1 and used.count("coalesced") >= 1, used
    assert set(used) <= {"miss", "coalesced", "hit"}, used

"""Events and the audit log (#29) through the SDK, against the real server of conftest:
an OOM kill names its command, a delete names its request; a follow sees a new sandbox
live; the audit log has the delete (and a refused call) with who made it."""

from __future__ import annotations

import threading

import pytest

import dsec
from conftest import Server


def test_events_replay_and_follow(client: dsec.Client) -> None:
    sb = dsec.Sandbox.create(client, timeout=120, resources={"memory_mb": 64}, labels={"suite": "py-events"})
    r = sb.exec("python3 -c 'b = bytearray(512 * 2**20)'")
    assert r.oom_killed, r
    sb.kill()
    kept = list(client.events(sandbox=sb.id, follow=False))
    kinds = [e.kind for e in kept]
    assert kinds[:2] == ["created", "ready"], kinds
    assert "oom_killed" in kinds and kinds[-1] == "deleted", kinds
    oom = next(e for e in kept if e.kind == "oom_killed")
    assert "bytearray" in (oom.command or ""), oom
    assert kept[-1].request_id, kept[-1]
    assert [e.id for e in kept] == sorted(e.id for e in kept)
    # Resuming after an id gives what came after it.
    after = list(client.events(after=kept[1].id, sandbox=sb.id, follow=False))
    assert after == kept[2:]

    # Following from the last id seen: a sandbox created after it comes out, whenever the
    # stream's request reaches the server.
    seen: "list[dsec.Event]" = []

    def follow() -> None:
        for e in client.events(after=kept[-1].id, labels={"suite": "py-events-live"}, kind="ready"):
            seen.append(e)
            break

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    live = dsec.Sandbox.create(client, timeout=120, labels={"suite": "py-events-live"})
    try:
        t.join(30)
        assert seen and seen[0].sandbox == live.id, seen
    finally:
        live.kill()

    with pytest.raises(dsec.BadRequest, match="unknown event kind"):
        list(client.events(kind="exploded", follow=False))


def test_the_audit_log_names_who_did_what(server: Server, client: dsec.Client) -> None:
    sb = dsec.Sandbox.create(client, timeout=120)
    sb.kill()
    stranger = dsec.Client(server.url, api_key="not-a-key", create_retries=0)
    with pytest.raises(dsec.Unauthorized):
        stranger.create_sandbox({})
    entries = client.audit(sandbox=sb.id).entries
    deleted = [e for e in entries if e.method == "DELETE"]
    assert deleted and deleted[-1].tenant == "default" and deleted[-1].request_id, entries
    refused = client.audit(failed=True, limit=50).entries
    assert any(e.status == 401 and e.key_id is None and e.path == "/v1/sandboxes" for e in refused), refused

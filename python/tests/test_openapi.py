"""The OpenAPI document (#29) against real tools and a real server: it is a valid
OpenAPI 3.1 document by openapi-spec-validator, and what the server really answers
(JSON bodies, NDJSON lines, SSE events, errors) matches the schemas the document gives
for that operation and status."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Dict, List, Optional, Tuple

import pytest
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate

from conftest import Server


def _fetch(server: Server, method: str, path: str, body: Any = None, raw: Optional[bytes] = None,
           key: Optional[str] = "") -> Tuple[int, str, bytes]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(server.url + path, data=data, method=method)
    if key is not None:
        req.add_header("x-api-key", key or server.key)
    if body is not None:
        req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.headers.get("content-type", ""), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("content-type", ""), e.read()


@pytest.fixture(scope="module")
def document(server: Server) -> Dict[str, Any]:
    status, kind, body = _fetch(server, "GET", "/v1/openapi.json", key=None)
    assert status == 200 and kind == "application/json", (status, kind)
    return json.loads(body)


class Checker:
    """Validates answers against the document's schema for (operation, status)."""

    def __init__(self, doc: Dict[str, Any]) -> None:
        self.doc = doc
        self.checked: List[str] = []

    def _validator(self, schema: Dict[str, Any]) -> Draft202012Validator:
        # The schema's $refs point into the document: validate with it as the root.
        root = dict(schema)
        root["components"] = self.doc["components"]
        return Draft202012Validator(root)

    def response(self, method: str, template: str, status: int, kind: str, body: bytes) -> Any:
        op = self.doc["paths"][template][method.lower()]
        answer = op["responses"].get(str(status)) or op["responses"]["default"]
        media = kind.split(";")[0].strip()
        content = answer.get("content", {})
        assert media in content or not content, f"{method} {template} {status}: {media} not documented"
        self.checked.append(f"{method} {template} {status}")
        if not content:
            assert body == b"", body
            return None
        spec = content[media]
        if media == "application/json":
            value = json.loads(body)
            self._validator(spec["schema"]).validate(value)
            return value
        if media == "application/x-ndjson":
            items = [json.loads(line) for line in body.splitlines() if line.strip()]
            v = self._validator(spec["x-item-schema"])
            for item in items:
                v.validate(item)
            return items
        if media == "text/event-stream":
            events = [json.loads(line[5:]) for line in body.decode().splitlines() if line.startswith("data:")]
            v = self._validator(spec["x-item-schema"])
            for e in events:
                v.validate(e)
            return events
        return body


def test_the_document_is_valid_openapi_3_1(document: Dict[str, Any]) -> None:
    validate(document)
    assert document["openapi"] == "3.1.0"
    assert len(document["paths"]) > 50


def test_real_answers_match_the_documented_schemas(server: Server, document: Dict[str, Any]) -> None:
    c = Checker(document)

    def call(method: str, template: str, path: Optional[str] = None, body: Any = None,
             raw: Optional[bytes] = None, expect: int = 200) -> Any:
        status, kind, data = _fetch(server, method, path or template, body=body, raw=raw)
        assert status == expect, (method, path or template, status, data[:500])
        return c.response(method, template, status, kind, data)

    call("GET", "/v1/health")
    sb = call("POST", "/v1/sandboxes", body={"image": "base", "timeout_s": 120,
                                               "labels": {"suite": "py-openapi"}}, expect=201)
    sid = sb["id"]
    s = f"/v1/sandboxes/{sid}"
    try:
        call("GET", "/v1/sandboxes", "/v1/sandboxes?label=suite=py-openapi&state=ready")
        call("GET", "/v1/sandboxes/{id}", s)
        call("POST", "/v1/sandboxes/{id}/timeout", s + "/timeout", body={"timeout_s": 300})
        call("POST", "/v1/sandboxes/{id}/exec", s + "/exec", body={"cmd": "echo hi; echo oops >&2; exit 3"})
        lines = call("POST", "/v1/sandboxes/{id}/exec/stream", s + "/exec/stream",
                     body={"cmd": "echo one; echo two"})
        assert len(lines) >= 2, lines
        call("PUT", "/v1/sandboxes/{id}/files", s + "/files?path=/tmp/a.txt", raw=b"hello")
        call("GET", "/v1/sandboxes/{id}/files/stat", s + "/files/stat?path=/tmp/a.txt")
        call("GET", "/v1/sandboxes/{id}/files/list", s + "/files/list?path=/tmp")
        call("GET", "/v1/sandboxes/{id}/files", s + "/files?path=/tmp/a.txt")
        call("POST", "/v1/sandboxes/{id}/files/mkdir", s + "/files/mkdir", body={"path": "/tmp/d"}, expect=204)
        session = call("POST", "/v1/sandboxes/{id}/sessions", s + "/sessions", body={}, expect=201)
        call("GET", "/v1/sandboxes/{id}/sessions", s + "/sessions")
        call("POST", "/v1/sandboxes/{id}/sessions/{session}/run", f"{s}/sessions/{session['session']}/run",
             body={"command": "cd /tmp && pwd"})
        proc = call("POST", "/v1/sandboxes/{id}/processes", s + "/processes",
                    body={"cmd": "echo bg"}, expect=201)
        call("GET", "/v1/sandboxes/{id}/processes", s + "/processes")
        call("GET", "/v1/sandboxes/{id}/processes/{pid}/output",
             f"{s}/processes/{proc['pid']}/output?follow=true")
        call("GET", "/v1/sandboxes/{id}/log", s + "/log")
        call("POST", "/v1/sandboxes/{id}/pause", s + "/pause")
        call("POST", "/v1/sandboxes/{id}/resume", s + "/resume")
        # An error answers with the documented error body.
        call("GET", "/v1/sandboxes/{id}", "/v1/sandboxes/no-such-sandbox", expect=404)
        call("POST", "/v1/sandboxes", body={"imag": "typo"}, expect=400)
    finally:
        call("DELETE", "/v1/sandboxes/{id}", s, expect=204)
    events = call("GET", "/v1/events", f"/v1/events?after=0&sandbox={sid}&no_follow=true")
    assert [e["kind"] for e in events][:2] == ["created", "ready"], events
    call("GET", "/v1/audit", "/v1/audit?limit=5")
    call("GET", "/v1/images")
    call("GET", "/v1/images/{name}", "/v1/images/base")
    call("GET", "/v1/images/layers")
    call("GET", "/v1/queue")
    call("GET", "/v1/pools")
    call("GET", "/v1/batches")
    call("GET", "/v1/tenants")
    call("GET", "/v1/tenants/{tenant}", "/v1/tenants/default")
    call("GET", "/v1/tenants/{tenant}/keys", "/v1/tenants/default/keys")
    assert len(c.checked) >= 35, c.checked

"""The web console (#29) in a real browser: Debian's chromium, headless, driven over the
Chrome DevTools Protocol. A wrong key gets a clear message; the right one signs in; a
sandbox created through the API appears within 2 s; its page runs a command; it is
deleted from the UI; a read-only key sees no buttons that write; every view renders
(a screenshot of each goes to the CI log directory); the browser logs no errors."""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

import dsec
from conftest import REPO, Server, _missing, _pdeathsig

SHOTS = Path(os.environ.get("DSEC_CI_LOG_DIR", str(REPO / "target" / "ci-logs"))) / "console"


class Browser:
    """One headless chromium and one page of it, over CDP."""

    def __init__(self) -> None:
        binary = shutil.which("chromium") or shutil.which("chromium-browser")
        if not binary:
            _missing("chromium is not installed (apt-get install chromium)")
        self.profile = tempfile.mkdtemp(prefix="dsec-chromium-")
        self.proc = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-dev-shm-usage", "--remote-debugging-port=0", "--remote-allow-origins=*",
             f"--user-data-dir={self.profile}", "--window-size=1400,900", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_pdeathsig,
        )
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not port_file.exists() or len(port_file.read_text().split()) < 2:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("chromium did not start its DevTools endpoint")
            time.sleep(0.05)
        port, path = port_file.read_text().split()[:2]
        self.stack = contextlib.ExitStack()
        self.ws = self.stack.enter_context(connect(f"ws://127.0.0.1:{port}{path}", max_size=64 << 20))
        self.ids = itertools.count(1)
        self.events: List[Dict[str, Any]] = []
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable", session=True)

    def call(self, method: str, params: Optional[Dict[str, Any]] = None, session: bool = False) -> Dict[str, Any]:
        msg_id = next(self.ids)
        msg: Dict[str, Any] = {"id": msg_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = self.session
        self.ws.send(json.dumps(msg))
        while True:
            reply = json.loads(self.ws.recv(timeout=60))
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def js(self, expression: str) -> Any:
        r = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                           "awaitPromise": True}, session=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait(self, expression: str, timeout: float = 10.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = self.js(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {timeout} s: {expression}\npage: {self.js('document.body.innerText')}")
            time.sleep(0.05)

    def type(self, text: str) -> None:
        """Types `text` as key presses into the focused element ("\n" is Enter)."""
        for c in text:
            if c == "\n":
                key = {"key": "Enter", "code": "Enter", "windowsVirtualKeyCode": 13}
            else:
                key = {"key": c, "text": c}
            self.call("Input.dispatchKeyEvent", dict(type="keyDown", **key), session=True)
            self.call("Input.dispatchKeyEvent", {"type": "keyUp", "key": key["key"]}, session=True)

    def goto(self, url: str) -> None:
        self.call("Page.navigate", {"url": url}, session=True)
        self.wait("document.readyState === 'complete'")

    def screenshot(self, name: str) -> Path:
        SHOTS.mkdir(parents=True, exist_ok=True)
        data = self.call("Page.captureScreenshot", {"format": "png"}, session=True)["data"]
        path = SHOTS / f"{name}.png"
        path.write_bytes(base64.b64decode(data))
        return path

    def errors(self) -> List[str]:
        """What the page logged as errors: console errors, exceptions, failed loads."""
        out = []
        for e in self.events:
            p = e.get("params", {})
            if e.get("method") == "Runtime.consoleAPICalled" and p.get("type") == "error":
                out.append("console: " + " ".join(str(a.get("value", a.get("description"))) for a in p.get("args", [])))
            elif e.get("method") == "Runtime.exceptionThrown":
                out.append("exception: " + json.dumps(p.get("exceptionDetails", {}))[:500])
            elif e.get("method") == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                entry = p["entry"]
                out.append(f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}")
        return out

    def close(self) -> None:
        try:
            self.stack.close()
        finally:
            self.proc.kill()
            self.proc.wait()
            shutil.rmtree(self.profile, ignore_errors=True)


@pytest.fixture
def browser() -> Iterator[Browser]:
    b = Browser()
    try:
        yield b
    finally:
        b.close()


def sign_in(b: Browser, key: str) -> None:
    b.js(f"document.querySelector('#key').value = {json.dumps(key)}")
    b.js("document.querySelector('#login-form').requestSubmit()")


def test_the_console_in_a_real_browser(server: Server, client: dsec.Client, browser: Browser) -> None:
    b = browser
    b.goto(server.url + "/ui")
    b.wait("!document.querySelector('#login').hidden")

    # A wrong key: a clear message, not a blank page.
    sign_in(b, "dsec_nope_wrong")
    message = b.wait("!document.querySelector('#login-error').hidden && document.querySelector('#login-error').textContent")
    assert "refused" in message and "key" in message, message
    b.screenshot("login-refused")
    refused = len(b.errors())  # the browser logs the refused call (401) as a failed load

    sign_in(b, server.key)
    b.wait("!document.querySelector('#app').hidden && document.querySelector('#who').textContent.includes('default')")
    # The list follows the event stream once it is connected ("live" in the header).
    b.wait("document.querySelector('#live').classList.contains('on')")

    # A sandbox created through the API shows up within 2 s (the event stream).
    sb = dsec.Sandbox.create(client, timeout=300, labels={"suite": "py-console"})
    try:
        t0 = time.monotonic()
        b.wait(f"!!document.querySelector('#sandboxes tr[data-id=\"{sb.id}\"]')", timeout=2.0)
        seen_s = time.monotonic() - t0
        assert seen_s < 2.0, seen_s
        b.js("document.querySelector('#filter').value = 'suite=py-console'; "
             "document.querySelector('#filter').dispatchEvent(new Event('input'))")
        b.wait("document.querySelectorAll('#sandboxes tbody tr').length === 1")
        b.screenshot("sandboxes")

        # Its page: the record, its events, and a command run from the UI.
        b.js(f"document.querySelector('#sandboxes tr[data-id=\"{sb.id}\"]').click()")
        b.wait("!document.querySelector('#view-sandbox').hidden && "
               "document.querySelector('#sandbox-facts').textContent.includes('ready')")
        b.wait("document.querySelector('#sandbox-events').textContent.includes('created')")
        b.js("document.querySelector('#exec-cmd').value = 'echo hello-from-$((6*7))'")
        b.js("document.querySelector('#exec-form').requestSubmit()")
        b.wait("document.querySelector('#exec-out').textContent.includes('hello-from-42')")
        b.screenshot("sandbox")

        # Its terminal: a shell on a PTY over a WebSocket, typed into key by key.
        b.js("document.querySelector('#term-open').click()")
        b.wait("document.querySelector('#term-state').textContent === 'connected'")
        b.js("document.querySelector('#term').focus()")
        b.type("echo term-$((6*7))\n")
        b.wait("document.querySelector('#term').textContent.includes('term-42')")
        b.screenshot("terminal")
        b.js("document.querySelector('#term-close').click()")
        b.wait("document.querySelector('#term-state').textContent === 'closed'")
        assert _eventually(lambda: not [p for p in sb.processes() if p.tag == "terminal" and p.exit is None])

        # Deleted from the UI (two clicks: arm, confirm).
        b.js("document.querySelector('#delete').click()")
        b.wait("document.querySelector('#delete').textContent === 'Confirm delete'")
        b.js("document.querySelector('#delete').click()")
        b.wait("location.hash === '#sandboxes' && document.querySelector('#status').textContent.includes('Deleted')")
        with pytest.raises((dsec.NotFound, dsec.Expired)):
            client.get_sandbox(sb.id)
    finally:
        try:
            sb.kill()
        except dsec.DsecError:
            pass

    # Every view renders.
    for view, ready in [
        ("nodes", "document.querySelectorAll('#nodes tbody tr td').length > 1 && "
                  "document.querySelector('#utilization polyline.sandboxes').getAttribute('points').length > 0"),
        ("images", "document.querySelector('#images tbody').textContent.includes('base')"),
        ("pools", "document.querySelector('#queue').textContent.length > 0"),
        ("events", "document.querySelector('#events tbody').textContent.includes('deleted')"),
    ]:
        b.js(f"location.hash = '{view}'")
        b.wait(f"!document.querySelector('#view-{view}').hidden && ({ready})")
        b.screenshot(view)

    # A read-only key sees a read-only console.
    reader = client._json("POST", "/tenants/default/keys", json_body={"name": "console-reader", "scopes": ["read"]})
    b.js("document.querySelector('#logout').click()")
    b.wait("!document.querySelector('#login').hidden")
    sign_in(b, reader["key"])
    b.wait("!!document.querySelector('#read-only')")
    b.js("location.hash = 'sandboxes'")
    assert b.js("document.querySelector('#exec-form').hidden && document.querySelector('#delete').hidden")
    b.screenshot("read-only")

    errors = b.errors()
    assert len(errors) == refused and all("401" in e for e in errors), "\n".join(errors)


def _eventually(check, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


def _key_protocol(key: str) -> str:
    return "dsec.key." + base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


def test_the_terminal_websocket(server: Server, client: dsec.Client) -> None:
    """The terminal without the console: the key as a subprotocol, keys in, output out,
    a resize seen by the shell, the shell killed when the socket closes; a wrong key, a
    read-only key and a plain GET are refused before any shell starts."""
    ws_url = server.url.replace("http://", "ws://")
    with dsec.Sandbox.create(client, timeout=300) as sb:
        url = f"{ws_url}/v1/sandboxes/{sb.id}/terminal?cols=80&rows=24"
        with connect(url, subprotocols=["dsec.terminal.v1", _key_protocol(server.key)]) as ws:
            assert ws.subprotocol == "dsec.terminal.v1"
            started = json.loads(ws.recv(timeout=30))
            assert started["type"] == "started", started
            pid = started["pid"]
            ws.send(json.dumps({"type": "resize", "cols": 133, "rows": 41}))
            ws.send(json.dumps({"type": "stdin", "data": "stty size; echo ws-$((6*7))\r"}))
            seen = ""
            while "ws-42" not in seen or "41 133" not in seen:
                ev = json.loads(ws.recv(timeout=30))
                assert ev["type"] in ("stdout", "stderr"), ev
                seen += ev["data"]
            ws.send("not json")
            err = json.loads(ws.recv(timeout=30))
            while err["type"] == "stdout":
                err = json.loads(ws.recv(timeout=30))
            assert err["type"] == "error" and err["error"]["code"] == "bad_request", err
        # The socket closed: its shell is killed.
        assert _eventually(lambda: any(p.pid == pid and p.exit is not None for p in sb.processes())), \
            sb.processes()

        # A shell that exits ends the socket with its exit.
        with connect(f"{ws_url}/v1/sandboxes/{sb.id}/terminal?cmd=exit+7",
                     subprotocols=["dsec.terminal.v1", _key_protocol(server.key)]) as ws:
            events = []
            while not events or events[-1]["type"] not in ("exit", "error"):
                events.append(json.loads(ws.recv(timeout=30)))
            assert events[-1]["type"] == "exit" and events[-1]["exit_code"] == 7, events

        reader = client._json("POST", "/tenants/default/keys", json_body={"name": "ws-reader", "scopes": ["read"]})
        for key, status in [("dsec_wrong_key", 401), (reader["key"], 403)]:
            with pytest.raises(InvalidStatus) as refused:
                connect(url, subprotocols=["dsec.terminal.v1", _key_protocol(key)]).close()
            assert refused.value.response.status_code == status
        before = len(sb.processes())
        req = urllib.request.Request(f"{server.url}/v1/sandboxes/{sb.id}/terminal", headers={"x-api-key": server.key})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 400 and b"WebSocket" in e.value.read()
        assert len(sb.processes()) == before, "a refused terminal starts no shell"

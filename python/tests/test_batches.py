"""Batch jobs through the SDK against a real server: an uploaded input and an inline one
placed, outputs collected and verified, a failing task's error snapshot, the manifest."""

from __future__ import annotations

import hashlib
import json

import pytest

import dsec


def test_a_batch_collects_verified_outputs_and_snapshots_failures(client: dsec.Client) -> None:
    obj = client.put_input("py/words.txt", b"b\na\n")
    assert obj["bytes"] == 4 and obj["sha256"] == hashlib.sha256(b"b\na\n").hexdigest()
    batch = client.submit_batch(
        {
            "name": "sdk",
            "defaults": {
                "command": "mkdir -p /out && sort /in/words > /out/sorted",
                "outputs": ["/out/sorted"],
                "timeout_s": 30,
                "retries": 0,
            },
            "tasks": [
                {"id": "uploaded", "inputs": {"/in/words": {"blob": "py/words.txt"}}},
                {"id": "inline", "inputs": {"/in/words": {"text": "z\ny\n"}}},
                {"id": "fails", "command": "echo last words; exit 4"},
            ],
        }
    )
    done = client.wait_batch(batch["id"], timeout=120, poll=0.2)
    assert done["state"] == "finished", done
    assert (done["counts"]["finalized"], done["counts"]["failed"]) == (2, 1), done

    assert client.batch_output(batch["id"], "uploaded", "/out/sorted") == b"a\nb\n"
    tasks = {t["id"]: t for t in client.batch_tasks(batch["id"])}
    out = tasks["inline"]["outputs"]["/out/sorted"]
    assert out["sha256"] == hashlib.sha256(b"y\nz\n").hexdigest()
    assert tasks["fails"]["state"] == "failed" and tasks["fails"]["exit_code"] == 4
    snap = json.loads(client.batch_output(batch["id"], "fails"))
    assert snap["exit_code"] == 4 and snap["stdout_tail"] == ["last words"]
    assert [t["id"] for t in client.batch_tasks(batch["id"], state="failed")] == ["fails"]

    manifest = client.batch_manifest(batch["id"])
    assert {t["id"] for t in manifest["tasks"]} == {"uploaded", "inline", "fails"}
    assert manifest["batch"]["image_digest"].startswith("sha256:")

    # A missing input is refused before anything runs.
    with pytest.raises(dsec.DsecError) as e:
        client.submit_batch({"tasks": [{"id": "x", "command": "true", "inputs": {"/in/a": {"blob": "none"}}}]})
    assert "not found" in str(e.value)

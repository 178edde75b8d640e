#!/usr/bin/env bash
# Runs the Python SDK's tests against a real `dsec serve` (started by the tests).
# Creates the venv ($DSEC_PY_VENV, default /tmp/dsec-py) if needed, (re)installs ./python
# and pytest into it, then runs pytest. Expects target/debug/dsec built and, ideally,
# DSEC_AGENT_BIN exported (scripts/lib.sh: build_static_agent; static_agent_path).
# Extra arguments go to pytest.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
venv="${DSEC_PY_VENV:-/tmp/dsec-py}"

if [[ ! -x "$venv/bin/python" ]]; then
  python3 -m venv "$venv"
fi
# swe-rex (+ aiohttp, which its RemoteRuntime imports but does not declare) and e2b
# (pinned) and sandbox-fusion: the compatibility tests drive dsec with the unmodified
# SWE-ReX, E2B and SandboxFusion clients; openai (pinned) drives the model gateway;
# openapi-spec-validator (with jsonschema) checks the OpenAPI document and the answers;
# websockets speaks the DevTools protocol to the chromium that tests the console.
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$here" pytest swe-rex aiohttp "e2b==2.63.0" sandbox-fusion "openai==2.54.0" openapi-spec-validator websockets

cd "$repo"
exec "$venv/bin/python" -m pytest "$here/tests" -q "$@"

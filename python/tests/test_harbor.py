"""Harbor (PyPI `harbor`, its E2B environment) runs a task end to end on dsec's E2B front,
pointed at dsec only by E2B's own variables: it builds the task's Dockerfile as an E2B
template, starts a sandbox from it, uploads the oracle's solution and the tests, runs them
and reads the reward back.

Harbor needs Python >= 3.12, newer than the SDK's venv may be, so it gets a venv of its own
($DSEC_HARBOR_VENV, default /tmp/dsec-harbor-venv; made and filled from PyPI on first use)
and runs as the `harbor` command. The task is fixtures/harbor-task/.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import List, Optional

import pytest

TASK = Path(__file__).resolve().parent / "fixtures" / "harbor-task"
PINS = ("harbor[e2b]==0.26.0", "e2b==2.63.0")
RUN_TIMEOUT = 600  # seconds per `harbor run`


def _missing(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"prerequisite missing (CI=true): {reason}", pytrace=False)
    pytest.skip(reason)


def _python_312() -> Optional[str]:
    """A Python >= 3.12 on this machine: on PATH, or one of pyenv's versions."""
    candidates: List[str] = []
    for name in ("python3.12", "python3.13", "python3.14", "python3"):
        found = shutil.which(name)
        if found:
            candidates.append(found)
    for pattern in ("3.12*", "3.13*", "3.14*"):
        candidates += sorted(glob.glob(f"/root/.pyenv/versions/{pattern}/bin/python3"))
    for exe in candidates:
        try:
            # pyenv's shims are on PATH even for versions that are not selected; they fail.
            r = subprocess.run(
                [exe, "-c", "import sys; print(sys.version_info >= (3, 12))"],
                capture_output=True, text=True, timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0 and r.stdout.strip() == "True":
            return exe
    return None


def _venv_ready(venv: Path) -> bool:
    py = venv / "bin" / "python"
    if not (venv / "bin" / "harbor").exists() or not py.exists():
        return False
    r = subprocess.run(
        [str(py), "-c",
         "from importlib.metadata import version as v; print(v('harbor'), v('e2b'))"],
        capture_output=True, text=True, timeout=60,
    )
    return r.returncode == 0 and r.stdout.split() == ["0.26.0", "2.63.0"]


@pytest.fixture(scope="session")
def harbor() -> str:
    """The `harbor` command of a venv with the pinned Harbor and e2b."""
    venv = Path(os.environ.get("DSEC_HARBOR_VENV", "/tmp/dsec-harbor-venv"))
    if not _venv_ready(venv):
        python = _python_312()
        if python is None:
            _missing("Harbor needs Python >= 3.12; none found (python3.12 on PATH or pyenv)")
        if venv.exists():
            if not (venv / "pyvenv.cfg").exists():
                pytest.fail(f"{venv} exists and is not a venv; set DSEC_HARBOR_VENV", pytrace=False)
            shutil.rmtree(venv)  # an older or broken one: start over
        subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=300)
        r = subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
             "--disable-pip-version-check", *PINS],
            capture_output=True, text=True, timeout=1200,
        )
        if r.returncode != 0 or not _venv_ready(venv):
            pytest.fail(f"pip install {' '.join(PINS)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}",
                        pytrace=False)
    return str(venv / "bin" / "harbor")


def _harbor_run(harbor: str, server, jobs: Path, name: str, *extra: str,
                agent: str = "oracle", reward: float = 1.0) -> Path:
    """`harbor run` of the fixture task with `agent` on E2B = dsec; checks that the trial ran
    without an exception and earned `reward`; returns the trial's directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(
        E2B_API_URL=f"{server.url}/e2b",
        E2B_SANDBOX_URL=f"{server.url}/e2b/envd",
        E2B_API_KEY=server.key,
        HARBOR_TELEMETRY="0",
    )
    cmd = [harbor, "run", "-p", str(TASK), "-a", agent, "-e", "e2b",
           "-o", str(jobs), "--job-name", name, "-n", "1", "-y", *extra]
    start = time.monotonic()
    try:
        r = subprocess.run(cmd, env=env, cwd=str(jobs), capture_output=True, text=True,
                           timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"harbor run {name} took over {RUN_TIMEOUT} s:\n{e.stdout}\n{e.stderr}\n"
                    f"{_trial_logs(jobs / name)}\n--- dsec serve log\n{server.log()}", pytrace=False)
    took = time.monotonic() - start
    print(f"harbor run {name}: {took:.1f} s")
    trials = sorted((jobs / name).glob("*/result.json"))
    details = (f"exit {r.returncode} after {took:.1f} s\n--- stdout\n{r.stdout[-4000:]}\n"
               f"--- stderr\n{r.stderr[-4000:]}\n{_trial_logs(jobs / name)}\n"
               f"--- dsec serve log\n{server.log()}")
    assert r.returncode == 0 and len(trials) == 1, details
    trial = json.loads(trials[0].read_text())
    assert trial.get("exception_info") is None, details
    assert (trial.get("verifier_result") or {}).get("rewards") == {"reward": reward}, details
    job = json.loads((jobs / name / "result.json").read_text())
    assert job["stats"]["n_errored_trials"] == 0, details
    assert (trials[0].parent / "verifier" / "reward.txt").read_text().strip() == str(int(reward))
    return trials[0].parent


def _trial_logs(job_dir: Path) -> str:
    out = []
    for pattern in ("*/exception.txt", "*/trial.log", "*/verifier/test-stdout.txt",
                    "*/verifier/test-stderr.txt", "*/agent/oracle.txt"):
        for f in sorted(job_dir.glob(pattern)):
            out.append(f"--- {f.relative_to(job_dir)}\n{f.read_text(errors='replace')[-3000:]}")
    return "\n".join(out)


def test_harbor_oracle_run(server, harbor: str, tmp_path: Path) -> None:
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    # The first run builds the template (--force-build: dsec's state dir outlives a test
    # session, and the template's name is a hash of environment/, so it would be reused).
    built = (_harbor_run(harbor, server, jobs, "build", "--force-build") / "trial.log").read_text()
    started = re.search(r"E2B template build started: (harbor-[0-9a-f]{32}):\S+ build=(\S+)", built)
    assert started, built
    ref = f"Using E2B template {started[1]}:{started[2]}"
    assert ref in built, built
    # The second finds that build by its tag (GET /templates/NAME/tags) and starts
    # `harbor-<hash>:<buildID>` without building.
    reused = (_harbor_run(harbor, server, jobs, "reuse") / "trial.log").read_text()
    assert "build started" not in reused and ref in reused, reused
    # An agent that does nothing fails the task's test: the file is the agent's doing.
    _harbor_run(harbor, server, jobs, "nop", agent="nop", reward=0.0)

#!/usr/bin/env python3
"""An RL-style rollout on dsec: N sandboxes in parallel, one multi-step shell episode each.

Each episode is a tiny "task": compute sum(k*k for k in 0..i) for its index i. The
"policy" writes a Python solution into the sandbox, runs it in a shell session, and the
final command checks the answer; reward = 1 if that check exits 0. (The toy policy is
deliberately wrong for every fourth task, so rewards are not all 1.)

All sandboxes carry the label job=<job>; they are deleted when their episode ends, and
on Ctrl-C (or any error) every sandbox of the job is deleted before exiting.

    DSEC_URL=http://127.0.0.1:7070 DSEC_API_KEY=... python rollout.py --sandboxes 16
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import dsec


@dataclass
class Summary:
    """What a rollout produced."""

    job: str
    episodes: int
    rewards: List[int] = field(default_factory=list)
    """Reward per episode, by episode index (0 for an episode that errored)."""
    errors: Dict[int, str] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def mean_reward(self) -> float:
        return sum(self.rewards) / len(self.rewards) if self.rewards else 0.0


class Registry:
    """Sandboxes alive right now, so an interrupt can delete them all."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: Dict[str, dsec.Sandbox] = {}
        self.stop = threading.Event()

    def add(self, sb: dsec.Sandbox) -> None:
        with self.lock:
            self.live[sb.id] = sb

    def discard(self, sb: dsec.Sandbox) -> None:
        with self.lock:
            self.live.pop(sb.id, None)

    def kill_all(self) -> None:
        with self.lock:
            live = list(self.live.values())
            self.live.clear()
        for sb in live:
            try:
                sb.kill()
            except dsec.DsecError:
                pass


def policy(task: int) -> str:
    """The 'model': a Python program for the task (wrong for every fourth task)."""
    upper = task + 1 if task % 4 != 3 else task  # off-by-one bug on purpose
    return f"print(sum(k * k for k in range({upper})))\n"


def expected(task: int) -> int:
    return sum(k * k for k in range(task + 1))


def episode(task: int, client: dsec.Client, job: str, reg: Registry) -> int:
    """Runs one episode in its own sandbox and returns its reward."""
    if reg.stop.is_set():
        raise KeyboardInterrupt
    with dsec.Sandbox.create(client, job=job, timeout=600, resources={"memory_mb": 256}, labels={"task": str(task)}) as sb:
        reg.add(sb)
        try:
            if reg.stop.is_set():
                raise KeyboardInterrupt
            # Step 1: the environment sets up the task.
            sb.mkdir("/work/episode")
            sb.write("/work/episode/task.txt", f"sum of squares up to {task}\n")
            # Step 2: the policy acts: it writes its solution.
            sb.write("/work/episode/solution.py", policy(task))
            with sb.session() as sh:
                # Step 3: run it in a shell that keeps its cwd between steps.
                sh.run("cd /work/episode")
                run = sh.run("python3 solution.py > answer.txt", timeout=60)
                if not run.ok:
                    return 0
                # Step 4: the grader: the final command's exit code is the reward.
                check = sh.run(f'test "$(cat answer.txt)" = "{expected(task)}"', timeout=30)
                return 1 if check.exit_code == 0 else 0
        finally:
            reg.discard(sb)


def run_rollout(n: int = 16, client: Optional[dsec.Client] = None, job: Optional[str] = None, workers: Optional[int] = None) -> Summary:
    """Runs ``n`` episodes in parallel (one thread and one sandbox each) and returns the
    summary. Every sandbox is deleted when this returns or raises (KeyboardInterrupt too)."""
    client = client or dsec.default_client()
    job = job or f"rollout-{uuid.uuid4().hex[:8]}"
    summary = Summary(job=job, episodes=n, rewards=[0] * n)
    reg = Registry()
    start = time.monotonic()
    pool = cf.ThreadPoolExecutor(max_workers=workers or n)
    try:
        futures = {pool.submit(episode, i, client, job, reg): i for i in range(n)}
        pending = set(futures)
        while pending:  # short waits so Ctrl-C reaches this thread promptly
            done, pending = cf.wait(pending, timeout=0.2)
            for f in done:
                i = futures[f]
                try:
                    summary.rewards[i] = f.result()
                except Exception as e:  # an episode failing is data, not a crash
                    summary.errors[i] = f"{type(e).__name__}: {e}"
    finally:
        reg.stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
        reg.kill_all()
        # Sweep by label: catches sandboxes whose create was in flight during an interrupt.
        try:
            for info in client.list_sandboxes({"job": job}):
                try:
                    client.delete_sandbox(info.id)
                except dsec.DsecError:
                    pass
        except dsec.DsecError:
            pass
        summary.seconds = time.monotonic() - start
    return summary


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--sandboxes", type=int, default=16, help="parallel sandboxes/episodes (default 16)")
    p.add_argument("--job", help="job label (default: rollout-<random>)")
    args = p.parse_args(argv)
    try:
        s = run_rollout(args.sandboxes, job=args.job)
    except KeyboardInterrupt:
        print("interrupted: all sandboxes deleted", file=sys.stderr)
        return 130
    print(f"job {s.job}: {s.episodes} episodes in {s.seconds:.1f}s")
    print(f"rewards: {''.join(str(r) for r in s.rewards)}  mean {s.mean_reward:.2f}")
    for i, err in sorted(s.errors.items()):
        print(f"episode {i} failed: {err}", file=sys.stderr)
    return 0 if not s.errors else 1


if __name__ == "__main__":
    sys.exit(main())

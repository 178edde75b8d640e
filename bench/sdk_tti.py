"""The Python SDK, timed: time to interactive (Sandbox.create + exec("true"), one sandbox
after another), or with MODE `exec` the exec round trip on one running sandbox (`aexec`:
the same through the asyncio client), or with MODE `conc` and WORKERS, WORKERS asyncio
tasks of one process looping AsyncSandbox.create -> exec(["true"]) -> kill until N
sandboxes were attempted.

Usage: python sdk_tti.py URL API_KEY N [exec|aexec]  -> prints one JSON list of milliseconds.
       python sdk_tti.py URL API_KEY N conc WORKERS  -> prints one JSON object: "cycles"
       (each [create_ms, tti_ms, delete_ms]), "failed" and "secs".
"""
import asyncio
import json
import sys
import time

import dsec

url, key, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
mode = sys.argv[4] if len(sys.argv) > 4 else "tti"
client = dsec.Client(url, key)
samples = []


async def async_exec() -> None:
    async with dsec.AsyncClient(url, key) as ac:
        sb = await dsec.AsyncSandbox.create(ac)
        try:
            for i in range(n + 5):
                t = time.perf_counter()
                r = await sb.exec(["true"])
                ms = (time.perf_counter() - t) * 1000
                if r.exit_code != 0:
                    raise SystemExit(f"exec true failed: {r}")
                if i >= 5:
                    samples.append(ms)
        finally:
            await sb.kill()


async def concurrent(workers: int) -> None:
    cycles = []
    failed = 0
    attempted = 0

    async def worker(ac: "dsec.AsyncClient") -> None:
        nonlocal failed, attempted
        while attempted < n:
            attempted += 1
            t = time.perf_counter()
            try:
                sb = await dsec.AsyncSandbox.create(ac)
            except dsec.DsecError:
                failed += 1
                continue
            created = time.perf_counter()
            try:
                r = await sb.exec(["true"])
                done = time.perf_counter()
                ok = r.exit_code == 0
            except dsec.DsecError:
                ok = False
            try:
                await sb.kill()
                deleted = time.perf_counter()
            except dsec.DsecError:
                ok = False
            if not ok:
                failed += 1
                continue
            cycles.append([(created - t) * 1000, (done - t) * 1000, (deleted - done) * 1000])

    async with dsec.AsyncClient(url, key) as ac:
        start = time.perf_counter()
        await asyncio.gather(*(worker(ac) for _ in range(workers)))
        secs = time.perf_counter() - start
    print(json.dumps({"cycles": cycles, "failed": failed, "secs": secs}))


if mode == "conc":
    asyncio.run(concurrent(int(sys.argv[5])))
    sys.exit(0)
elif mode == "aexec":
    asyncio.run(async_exec())
elif mode == "exec":
    sb = dsec.Sandbox.create(client)
    try:
        for i in range(n + 5):
            t = time.perf_counter()
            r = sb.exec(["true"])
            ms = (time.perf_counter() - t) * 1000
            if r.exit_code != 0:
                raise SystemExit(f"exec true failed: {r}")
            if i >= 5:
                samples.append(ms)
    finally:
        sb.kill()
else:
    for i in range(n + 2):
        t = time.perf_counter()
        sb = dsec.Sandbox.create(client)
        r = sb.exec(["true"])
        ms = (time.perf_counter() - t) * 1000
        if r.exit_code != 0:
            raise SystemExit(f"exec true failed: {r}")
        sb.kill()
        if i >= 2:
            samples.append(ms)
print(json.dumps(samples))

"""The Python SDK, timed: time to interactive (Sandbox.create + exec("true"), one sandbox
after another), or with MODE `exec` the exec round trip on one running sandbox (`aexec`:
the same through the asyncio client).

Usage: python sdk_tti.py URL API_KEY N [exec|aexec]  -> prints one JSON list of milliseconds.
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


if mode == "aexec":
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

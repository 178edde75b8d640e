"""Time to interactive through the Python SDK: Sandbox.create + exec("true"), sequential.

Usage: python sdk_tti.py URL API_KEY N  -> prints one JSON list of milliseconds.
"""
import json
import sys
import time

import dsec

url, key, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
client = dsec.Client(url, key)
samples = []
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

"""Where a create's time goes (#29): the create's answer carries its phases when asked
(`timings=True`), back to back from the server's first step to the last write, the
node's own phases inside; the record keeps them; `/metrics` has a histogram per phase.
Against the real server and node of conftest."""

from __future__ import annotations

import time
import urllib.request

import dsec
from conftest import Server

NODE_PHASES = ["admit", "layers", "disk", "namespaces", "cgroup", "network", "init", "agent"]


def test_a_create_reports_its_phases_and_they_add_up_to_its_time(server: Server, client: dsec.Client) -> None:
    walls = []
    sbs = []
    try:
        for _ in range(5):
            t0 = time.monotonic()
            sb = dsec.Sandbox.create(client, timeout=120, timings=True)
            walls.append((time.monotonic() - t0) * 1000)
            sbs.append(sb)
        for sb, wall in zip(sbs, walls):
            t = sb.info.timings
            assert t is not None, sb.info
            names = [p.phase for p in t.phases]
            assert names[:4] == ["validate", "placement", "images", "store"], names
            assert names[4:4 + len(NODE_PHASES)] == NODE_PHASES, names
            assert names[-3:] == ["node_call", "files", "commit"] or names[-2:] == ["node_call", "commit"], names
            # Back to back: each starts where the one before ended, and they add up.
            for a, b in zip(t.phases, t.phases[1:]):
                assert abs(a.start_ms + a.ms - b.start_ms) < 0.5, (a, b)
            total = sum(p.ms for p in t.phases)
            assert abs(total - t.total_ms) < 0.5, (total, t.total_ms)
            # The server's total is the create as the client saw it, less the HTTP hop.
            assert t.total_ms <= wall * 1.02, (t.total_ms, wall)
            assert t.by_phase()["init"] > 0
        # The phases account for the create: the median gap to the client's own
        # measure (the HTTP hop and the SDK) is within 10% of it, or 2 ms.
        gaps = sorted(wall - sb.info.timings.total_ms for sb, wall in zip(sbs, walls))
        median_wall = sorted(walls)[len(walls) // 2]
        assert gaps[len(gaps) // 2] <= max(0.1 * median_wall, 2.0), (gaps, walls)
        # Without asking, the answer has none; the record has them either way.
        plain = dsec.Sandbox.create(client, timeout=120)
        sbs.append(plain)
        assert plain.info.timings is None
        kept = plain.refresh().timings
        assert kept is not None and "init" in kept.by_phase(), kept
    finally:
        for sb in sbs:
            sb.kill()

    req = urllib.request.Request(server.url + "/metrics", headers={dsec.API_KEY_HEADER: server.key})
    with urllib.request.urlopen(req, timeout=10) as r:
        metrics = r.read().decode()
    count = [line for line in metrics.splitlines() if line.startswith("dsec_create_seconds_count")]
    assert count and float(count[0].split()[-1]) >= 4, count
    assert 'dsec_create_phase_seconds_bucket{phase="init",le="+Inf"}' in metrics
    assert 'dsec_create_phase_seconds_count{phase="agent"}' in metrics

"""Smoke test of ``bench.proxy.routing`` at its smallest: one configuration, a few seconds.

The figures are not asserted against targets (they are emulated and depend on the machine);
what is asserted is that the two-proxy consistent_hash stack starts, that the per-call split
sends calls through both proxies, that every workflow request completes, that the hit rate is
read from the engines' counters, that the comparison table has its shape, and that no process
the stack started outlives it.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from bench.proxy.routing import CONFIGS, RoutingStack, Shape, comparisons, load
from shared import metric_names as names
from shared.engine_load import samples

pytestmark = pytest.mark.timeout(50)

TINY = Shape(duration_s=2.0, beam=(2, 2, 3), speedup=10.0)


async def _proxied_calls(port: int) -> float:
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as r:
        page = await r.text()
    return sum(v for n, v in samples(page) if n == names.PROXY_REQUESTS)


@pytest.mark.slow
async def test_two_proxies_consistent_hash_serves_a_tiny_load(tmp_path: Path) -> None:
    config = next(c for c in CONFIGS if c.name == "two_proxies_consistent_hash")
    async with RoutingStack(tmp_path, TINY, config) as stack:
        assert len(stack.engines) == 4 and len(stack.proxy_ports) == 2
        run = await load(stack, rate=2.0, duration_s=TINY.duration_s, seed=1)
        calls = [await _proxied_calls(p) for p in stack.proxy_ports]
        procs = list(stack._stack.procs) if stack._stack else []
    assert run["failed"] == 0 and run["completed"] >= 1, run
    assert 0.0 < run["prefix_hit_rate"] < 1.0
    assert sum(e["prefix_cache_queries"] for e in run["engines"].values()) > 0
    assert all(c > 0 for c in calls) and abs(calls[0] - calls[1]) <= 1, calls  # per call, in turn
    assert len(procs) == 6 and all(p.poll() is not None for p in procs)


def test_comparisons_say_whether_the_targets_held() -> None:
    def run(hit: float, mean: float) -> dict[str, object]:
        return {"prefix_hit_rate": hit, "latency_s": {"mean": mean}}

    runs = {
        "one_proxy_prefix_affinity": run(0.80, 10.0),
        "two_proxies_consistent_hash": run(0.78, 10.4),
        "two_proxies_round_robin": run(0.70, 12.0),
    }
    out = comparisons(runs)
    near = out["two_proxy_consistent_hash_vs_one_proxy_prefix_affinity"]
    assert near["hit_rate_ratio"] == pytest.approx(0.975) and near["met"] is True
    better = out["two_proxy_consistent_hash_vs_two_proxy_round_robin"]
    assert better["mean_latency_ratio"] == pytest.approx(10.4 / 12.0) and better["met"] is True
    runs["two_proxies_consistent_hash"] = run(0.70, 10.6)
    assert not comparisons(runs)["two_proxy_consistent_hash_vs_one_proxy_prefix_affinity"]["met"]

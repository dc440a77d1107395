"""bench.accuracy.sim_agreement on a tiny plan: emulator processes, the proxy, the simulator, one load;
checks the result's shape and labels (the figures themselves are the benchmark's job)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench.accuracy.sim_agreement import RunShape, run, table

TINY = RunShape(
    speedup=20.0,
    fractions=(0.5,),
    warmup_s=1.0,
    duration_s=6.0,
    passages=100,
    long_run_s=20.0,
    capacity_s=30.0,
)


@pytest.mark.slow
async def test_tiny_plan_writes_labelled_points_and_summary(tmp_path: Path) -> None:
    result = await run(TINY, tmp_path)
    assert set(result["labels"]) == {"emulated", "simulated"}
    assert result["simulated_capacity_rps"] > 0
    (point,) = result["points"]
    assert point["requests_measured"] > 0
    for side in ("emulated", "simulated", "simulated_long_run"):
        assert {"mean_s", "p50_s", "p90_s"} <= set(point[side])
        assert point[side]["mean_s"] > 0
    assert point["emulated"]["failed"] == 0
    assert math.isclose(
        point["relative_error"], point["emulated"]["mean_s"] / point["simulated"]["mean_s"] - 1
    )
    # the proxy saw one embedding, one rerank and one chat call per request
    calls = {m: v["ok"] for m, v in point["proxy_calls"].items()}
    assert set(calls) == {"e5-base-v2", "bge-reranker-base", "llama-3-8b"}
    assert len(set(calls.values())) == 1
    assert set(point["emulator_lag"]) == {"e5-base-v2/0", "bge-reranker-base/1", "llama-3-8b/2"}
    assert set(result["summary"]) >= {"max_mean_latency_error", "points"}
    assert result["summary"]["points"] == 1
    md = table(result)
    assert "emulated" in md and "simulated" in md and md.count("\n| 50% |") == 1

"""A throughput-latency point re-measures an overloaded verdict its run was too short to give."""

from __future__ import annotations

from typing import Any

import pytest

from bench.evaluation.runs import PointJob, _longer, _windows, run_point
from bench.evaluation.setup import QUICK
from bench.evaluation.static import _whole
from sim.cluster import Allocation, ReplicaSpec

LATENCIES = (QUICK.warmup_latencies, QUICK.min_window_latencies)


def _figures(arrival: float, throughput: float, latency: float, done: int = 300) -> Any:
    return {
        "beam": {
            "arrival_rate": arrival,
            "throughput": throughput,
            "latency_mean": latency,
            "started": 300,
            "completed": done,
            "sustained": throughput >= 0.95 * arrival and done >= 0.95 * 300,
        }
    }


@pytest.mark.timeout(10)
def test_a_kept_up_point_or_one_that_left_requests_unfinished_stands() -> None:
    kept = _figures(2.0, 1.98, 30.0)
    assert _longer(kept, _windows(kept, 50.0, 170.0), None, LATENCIES) is None
    backlog = _figures(2.0, 1.5, 30.0, done=200)  # a backlog the drain did not clear
    assert _longer(backlog, _windows(backlog, 50.0, 170.0), None, LATENCIES) is None


@pytest.mark.timeout(10)
def test_a_short_run_is_stretched_to_the_evaluations_lengths_in_its_own_latency() -> None:
    short = _figures(2.0, 1.8, 30.0)  # 120 s of window: 4 latencies of 30 s
    longer = _longer(short, _windows(short, 50.0, 170.0), None, LATENCIES)
    assert longer == pytest.approx((4.0 * 30.0, 10.0 * 30.0))


@pytest.mark.timeout(10)
def test_a_shortfall_that_grew_with_the_run_is_an_overload() -> None:
    first = _figures(2.0, 1.8, 30.0)
    again = _figures(2.0, 1.7, 45.0)  # longer and further behind
    before = _windows(first, 50.0, 170.0)
    assert _longer(again, _windows(again, 120.0, 420.0), before, LATENCIES) is None


@pytest.mark.timeout(120)
def test_a_filling_pipeline_read_as_overload_is_sustained_when_run_long_enough() -> None:
    # beam search on 2 generator + 2 verifier GPUs at 2.7 req/s: the quick window (120 s)
    # holds 4.4 of its 27 s latencies and completes 5.7% fewer than arrive (simulated);
    # warm-up and window in its own latency keep up within 2%
    alloc = Allocation.of(
        ReplicaSpec("llama-3.2-1b", "a6000", tp=1, share=1.0, count=2),
        ReplicaSpec("llama-3.1-8b-prm", "a6000", tp=1, share=1.0, count=2),
    )
    point = run_point(PointJob("even", "beam", 4, 2.7, 0.0, alloc, QUICK, 12.0, 0, {}))
    [first] = point["stretched_from"]
    assert not first["workflows"]["beam"]["sustained"]
    assert point["sustained"]
    warm, end = point["window_s"]
    assert warm >= 4 * first["workflows"]["beam"]["latency_mean"] - 1e-6
    assert end - warm > 2 * (first["window_s"][1] - first["window_s"][0])
    # past capacity the stretched run still falls behind
    over = run_point(PointJob("even", "beam", 4, 3.4, 0.0, alloc, QUICK, 12.0, 0, {}))
    assert over["stretched_from"] and not over["sustained"]


@pytest.mark.timeout(10)
def test_independent_sizing_retries_on_whole_gpus_by_largest_remainders() -> None:
    # 9.3 and 6.7 GPUs of 16: the fractional split (10 x 0.93 and 6 + 0.7) fragments the
    # GPUs; on whole GPUs the larger remainder gets the spare one
    assert _whole({"8b": 93, "1b": 67}, 16) == {"8b": 90, "1b": 70}
    assert _whole({"a": 2, "b": 3, "c": 35}, 4) == {"a": 10, "b": 10, "c": 20}
    assert _whole({"a": 10, "b": 10, "c": 20}, 2) is None  # fewer GPUs than models

"""The autoscaler's warm start: the pod counts its own rule settles on at a steady load."""

from __future__ import annotations

import pytest

from sim.cluster import Allocation
from sim.des import WorkloadSpec, simulate
from sim.dynamic import DynamicSimulation, run_dynamic
from sim.hpa import Hpa, HpaSettings, _desired, _fit, settled_counts

MODELS = ("e5-base-v2", "bge-reranker-base", "llama-3-8b")
LOAD = [WorkloadSpec("rag", 4.0)]


def test_pods_beyond_the_gpus_are_left_out_round_robin() -> None:
    assert _fit({"a": 4, "b": 3, "c": 1}, ("a", "b", "c"), 5) == {"a": 2, "b": 2, "c": 1}
    assert _fit({"a": 4, "b": 3, "c": 1}, ("a", "b", "c"), 3) == {"a": 1, "b": 1, "c": 1}
    assert _fit({"a": 2, "b": 1}, ("a", "b"), 8) == {"a": 2, "b": 1}


@pytest.mark.parametrize(
    ("usage", "current", "want"),
    [(1.4, 2, 2), (1.5, 2, 2), (2.2, 2, 4), (0.5, 3, 1), (0.0, 1, 1)],
)
def test_the_rule_keeps_counts_within_its_tolerance(usage: float, current: int, want: int) -> None:
    assert _desired(usage, current, HpaSettings()) == want


def test_the_settled_counts_are_a_fixed_point_of_the_rule() -> None:
    counts = settled_counts(MODELS, 8, LOAD, seed=1, duration_s=60.0)
    assert counts["llama-3-8b"] > 1  # 4 RAG req/s load one 8B pod far past 70%
    assert counts["e5-base-v2"] == counts["bge-reranker-base"] == 1
    assert sum(counts.values()) <= 8
    assert settled_counts(MODELS, 8, LOAD, seed=1, duration_s=60.0) == counts
    # once more at the settled counts: the rule asks for no change (or more than fits)
    alloc = Allocation.of(*((m, "a6000", 1, 1.0, counts[m]) for m in MODELS))
    res = simulate(alloc, LOAD, duration_s=60.0, drain_s=0.0, seed=1)
    usage = {m: sum(r.utilisation for r in res.replicas if r.model == m) for m in MODELS}
    again = _fit({m: _desired(usage[m], counts[m], HpaSettings()) for m in MODELS}, MODELS, 8)
    assert again == counts


def test_a_warm_start_begins_at_the_settled_counts_and_scales_less() -> None:
    counts = settled_counts(MODELS, 8, LOAD, seed=1, duration_s=60.0)
    runs = {}
    for name, start in (("cold", None), ("warm", counts)):
        hpa = Hpa(MODELS, gpus=8)
        initial = hpa.initial(start)
        assert {s.model: s.count for s in initial.replicas} == (start or dict.fromkeys(MODELS, 1))
        sim = DynamicSimulation(initial, LOAD, 1, hpa, 30.0)
        runs[name] = (run_dynamic(sim, 180.0, 0.0, 60.0), sim)
    cold, warm = runs["cold"][1], runs["warm"][1]
    assert sum(c.count for c in warm.changes if c.kind == "start") < sum(
        c.count for c in cold.changes if c.kind == "start"
    )
    assert (
        runs["warm"][0].workflows["rag"].latency.mean
        < runs["cold"][0].workflows["rag"].latency.mean
    )

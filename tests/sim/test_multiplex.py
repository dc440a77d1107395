"""Aegaeon-style pooled instances: model switches, one GPU's physics, disaggregated serving."""

from __future__ import annotations

import pytest

from sim.des import WorkloadSpec, simulate
from sim.engine import EngineCore, EngineRequest
from sim.multiplex import PooledEngine, PooledSimulation, simulate_pooled, switch_seconds
from sim.perf import MODELS, perf_model

SMALL, BIG = "llama-3.2-1b", "llama-3.1-8b-prm"


def _requests(model: str, n: int, out: int) -> list[EngineRequest]:
    return [
        EngineRequest(f"{model}-{i}", [i * 1000 + j for j in range(300)], out, model=model)
        for i in range(n)
    ]


def _drain(engine: EngineCore) -> float:
    total = 0.0
    while engine.has_work():
        total += engine.step().duration
    return total


def _solo(model: str, n: int, out: int) -> float:
    engine = EngineCore(perf_model(model, "a6000"), enable_prefix_caching=False)
    for r in _requests(model, n, out):
        engine.submit(r)
    return _drain(engine)


@pytest.mark.timeout(30)
def test_an_instance_pays_a_switch_each_time_it_changes_model() -> None:
    pooled = PooledEngine("a6000", [SMALL, BIG], "decode")
    total = 0.0
    for model in (SMALL, BIG, SMALL, BIG):  # one model at a time: four switches
        for r in _requests(model, 2, 20):
            pooled.submit(r)
        total += _drain(pooled)
    assert pooled.switches == 4
    expected = 2 * (_solo(SMALL, 2, 20) + _solo(BIG, 2, 20))
    switches = 2 * (switch_seconds(SMALL) + switch_seconds(BIG))
    assert switches == pytest.approx(pooled.switch_time)
    assert total == pytest.approx(expected + switches)
    assert switch_seconds(BIG) > switch_seconds(SMALL) > 0  # the weights dominate
    assert switch_seconds(SMALL, 10**9) > switch_seconds(SMALL)  # KV swapped too


@pytest.mark.timeout(30)
def test_two_models_on_one_instance_never_outrun_one_gpu() -> None:
    pooled = PooledEngine("a6000", [SMALL, BIG], "decode")
    for r in _requests(SMALL, 16, 200) + _requests(BIG, 16, 200):
        pooled.submit(r)
    total = _drain(pooled)
    # both models' work, one after the other on the whole GPU, plus the switches it took
    alone = _solo(SMALL, 16, 200) + _solo(BIG, 16, 200)
    assert pooled.switches > 2  # the quantum made it alternate while both had work
    assert total >= alone + pooled.switch_time - 1e-9
    assert pooled.prefix_cache_hits == 0 and pooled.generation_tokens_total == 32 * 200


@pytest.mark.timeout(30)
def test_a_prefill_instance_stops_generation_at_the_first_token() -> None:
    pooled = PooledEngine("a6000", [SMALL], "prefill")
    (req,) = _requests(SMALL, 1, 50)
    pooled.submit(req)
    _drain(pooled)
    assert pooled.generation_tokens_total == 1
    assert pooled.take(req.rid) == req and pooled.take(req.rid) is None
    with pytest.raises(ValueError, match="not served"):
        pooled.submit(EngineRequest("x", [1, 2, 3], 1, model=BIG))


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_beam_on_a_pool_decodes_on_decode_instances_without_cache_hits() -> None:
    spec = [WorkloadSpec("beam", 0.1)]
    res, switches = simulate_pooled(spec, 4, 3, duration_s=60.0, seed=2, drain_s=120.0)
    beam = res.workflows["beam"]
    assert beam.started > 0 and beam.completed == beam.started
    names = {r.name: r for r in res.replicas}
    assert set(names) == {"prefill/0", "prefill/1", "prefill/2", "decode/0"}
    assert all(r.prefix_hit_rate == 0.0 for r in res.replicas)
    assert names["decode/0"].steps > 0
    # the prefill instances alternate generator and verifier: switching costs them time
    assert sum(s["switches"] for s in switches.values()) > 3
    assert all(0.0 <= s["busy_share"] <= 1.0 for s in switches.values())
    # the same load on two GPUs per model with prefix caching is faster
    from sim.cluster import Allocation

    alloc = Allocation.of((SMALL, "a6000", 1, 1.0, 2), (BIG, "a6000", 1, 1.0, 2))
    even = simulate(alloc, spec, duration_s=60.0, seed=2, drain_s=120.0).workflows["beam"]
    assert even.latency.mean < beam.latency.mean


@pytest.mark.timeout(30)
def test_a_split_needs_whole_nodes_and_both_roles() -> None:
    spec = [WorkloadSpec("rag", 1.0)]
    for gpus, prefill in ((4, 4), (4, 0), (6, 3)):
        with pytest.raises(ValueError, match="whole nodes"):
            PooledSimulation(spec, gpus, prefill)
    sim = PooledSimulation(spec, 8, 1)
    assert [r.name for r in sim.replicas if r.name.startswith("prefill")] == [
        "prefill/0",
        "prefill/1",
    ]
    # decode instances hold only generators; prefill ones every model of the workload
    engines = [r.engine for r in sim.replicas if isinstance(r.engine, PooledEngine)]
    assert {tuple(e.engines) for e in engines if e.role == "decode"} == {("llama-3-8b",)}
    assert all(len(e.engines) == 3 for e in engines if e.role == "prefill")
    assert MODELS["llama-3-8b"].kind == "generate"

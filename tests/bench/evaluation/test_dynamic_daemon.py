"""The dynamic scenario's Scepsy side is the daemon's own pass (``optimizer.control.step``) on
the simulator: its settings are the evaluation's, and a rollout it decides runs plan step by
step until what a backend would observe is what the simulator serves."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import orjson
import pytest

import optimizer.control.step
from bench.evaluation import daemon as dynamic
from bench.evaluation.scepsy import (
    Knowledge,
    allocate,
    capacity,
    capacity_beside,
    knowledge_from_doc,
)
from bench.evaluation.setup import (
    COMBINED_BEAM_FRACTION,
    cluster,
    memory_floor_bytes,
    workflow_models,
    workloads,
)
from shared.cluster import cluster_from_settings
from sim.dynamic import DynamicSimulation, run_dynamic
from tests.bench.evaluation.test_evaluate import _knowledge

GPUS = 4


def _k() -> Knowledge:
    return knowledge_from_doc(orjson.loads(orjson.dumps(_knowledge())))


def test_the_scenario_runs_the_daemons_step() -> None:
    assert vars(dynamic)["step"] is optimizer.control.step.step


@pytest.mark.parametrize("gpus", [4, 8, 16])
def test_the_daemons_settings_are_the_evaluations(gpus: int, tmp_path: Path) -> None:
    s = dynamic.daemon_settings(gpus, tmp_path)
    assert cluster_from_settings(s.cluster) == cluster(gpus)
    assert {m.name: m.min_memory_bytes for m in s.rollout.models} == {
        m: memory_floor_bytes(m) for m in workflow_models("combined")
    }
    assert s.optimizer.interval_s == 60 and s.optimizer.windows_to_confirm == 3  # defaults


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rate_step_is_rolled_out_and_what_runs_is_what_serves(tmp_path: Path) -> None:
    k = _k()
    beam = COMBINED_BEAM_FRACTION * capacity(k, "beam", GPUS)
    top = capacity_beside(k, "rag", {"beam": beam}, GPUS)
    s = dynamic.daemon_settings(GPUS, tmp_path)
    fast = dataclasses.replace(
        s.optimizer,
        interval_s=20,
        window_s=60,
        windows_to_confirm=2,
        cooldown_s=60,
        min_requests=10,
    )
    daemon = dynamic.SimulatedDaemon(k, dataclasses.replace(s, optimizer=fast))
    groups = daemon.initial({"beam": beam, "rag": 0.25 * top})
    sim = DynamicSimulation(
        dynamic.allocation_of(groups),
        workloads("combined", 0.25 * top, beam),
        7,
        daemon,
        10.0,
        record_calls=True,
    )
    daemon.adopt(groups, list(sim.replicas))
    sim.at(120.0, functools.partial(sim.set_rate, 1, 0.7 * top))
    run_dynamic(sim, 300.0, 0.0, 60.0)

    log = daemon.decisions
    assert [e["t"] for e in log] == sorted(e["t"] for e in log)
    assert all(e["reasons"] for e in log if e["kind"] not in ("no_data", "steady", "pending"))
    rollouts = [e for e in log if e["kind"] == "rollout"]
    assert rollouts and all(e["outcome"] == "ok" for e in rollouts)
    assert daemon.rollouts == [e["t"] for e in rollouts] and rollouts[0]["t"] > 120.0
    assert daemon.started > 0 and not daemon.busy
    end = daemon.control.detector.last_rollout_end
    assert end is not None and end > dynamic.T0 + rollouts[-1]["t"]
    # what a backend would observe is what the simulator serves: ready, routed, every model
    assert all(r.ready for r in daemon.replicas.values())
    assert daemon.routed == set(daemon.replicas)
    models = {r.model for r in daemon.replicas.values()}
    assert models == set(workflow_models("combined"))
    for m in models:
        ours = {id(daemon.engines[r]) for r, rep in daemon.replicas.items() if rep.model == m}
        assert {id(e) for e in sim.serving(m)} == ours
    # the per-step check starts the step at its rollout's end and reads what runs' prediction
    assert len(daemon.rollout_ends) == len(daemon.rollouts)
    spans = list(zip(daemon.rollouts, daemon.rollout_ends, strict=True))
    steps = [(0.0, 0.25 * top), (120.0, 0.7 * top)]
    rows = dynamic.step_check(sim, steps, 300.0, spans, log, fast.window_s)
    assert [r["from"] for r in rows] == [0.0, 120.0]
    assert rows[1]["settled"] == max(end for start, end in spans if 120.0 <= start < 300.0)
    rag = rows[1]["workflows"]["rag"]
    assert rag["requests"] > 0 and rag["observed"] is not None
    if rag["predicted"] is not None:
        assert rag["ratio"] == pytest.approx(rag["observed"] / rag["predicted"])


@pytest.mark.timeout(120)
def test_rags_capacity_is_taken_beside_beam_at_its_own_rate() -> None:
    k = _k()
    beam = COMBINED_BEAM_FRACTION * capacity(k, "beam", GPUS)
    top = capacity_beside(k, "rag", {"beam": beam}, GPUS)
    near = allocate(k, {"beam": beam, "rag": 0.95 * top}, GPUS)
    assert near.feasible and near.placed
    assert near.predicted["beam"]["served_rate"] >= beam * (1 - 1e-9)
    # At an unreachable RAG target the search cuts beam to RAG's fraction of its goal: a
    # capacity read there is one beam does not get its rate beside.
    unreachable = allocate(k, {"beam": beam, "rag": 1e4}, GPUS)
    assert unreachable.predicted["beam"]["throughput"] < beam
    assert unreachable.predicted["rag"]["throughput"] > top

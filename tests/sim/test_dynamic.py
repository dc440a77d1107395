"""The simulator with control events (``sim.dynamic``) and the HPA on it (``sim.hpa``):
replicas start, serve after the cold start, drain, and the run stays reproducible."""

from __future__ import annotations

from dataclasses import dataclass, field

from sim.cluster import Allocation, Replica
from sim.des import WorkloadSpec
from sim.dynamic import DynamicSimulation, colocate, run_dynamic
from sim.hpa import Hpa

RAG = Allocation.of(
    ("e5-base-v2", "a6000", 1, 0.2, 1),
    ("bge-reranker-base", "a6000", 1, 0.3, 1),
    ("llama-3-8b", "a6000", 1, 1.0, 1),
)
COLD_S = 30.0


@dataclass
class Swap:
    """At its first tick: start a second llama replica; once it serves, retire the first."""

    interval_s: float = 20.0
    ticks: list[float] = field(default_factory=list)
    fresh: list[Replica] = field(default_factory=list)
    old: list[Replica] = field(default_factory=list)

    def tick(self, sim: DynamicSimulation) -> None:
        self.ticks.append(sim.now)
        if len(self.ticks) == 1:
            self.old = sim.serving("llama-3-8b")
            self.fresh = sim.start(
                Allocation.of(("llama-3-8b", "a6000", 1, 1.0, 1)),
                then=lambda _live: sim.retire(self.old),
            )


def _sim(controller: Swap | Hpa, rate: float = 0.5, seed: int = 3) -> DynamicSimulation:
    return DynamicSimulation(RAG, [WorkloadSpec("rag", rate)], seed, controller, COLD_S)


def test_a_started_replica_serves_after_the_cold_start_and_the_old_one_drains() -> None:
    swap = Swap()
    sim = _sim(swap)
    res = run_dynamic(sim, 120.0, 0.0, 60.0)
    assert swap.ticks[:3] == [20.0, 40.0, 60.0]  # every interval_s
    kinds = [(c.t, c.kind, c.model) for c in sim.changes]
    assert kinds == [
        (20.0, "start", "llama-3-8b"),
        (20.0 + COLD_S, "ready", "llama-3-8b"),
        (20.0 + COLD_S, "retire", "llama-3-8b"),
    ]
    assert sim.serving("llama-3-8b") == swap.fresh
    assert swap.fresh[0].name == "llama-3-8b/3"  # named after the initial replicas
    assert swap.fresh[0].gpus[0] >= 1000  # clear of the first batch's GPUs
    assert res.workflows["rag"].completed > 0 and res.workflows["rag"].failed == 0


def test_a_model_keeps_its_last_serving_replica() -> None:
    sim = _sim(Swap())
    only = sim.serving("e5-base-v2")
    sim.retire(only)
    assert sim.serving("e5-base-v2") == only and sim.draining() == []


def test_rates_change_and_are_listed() -> None:
    sim = _sim(Swap(interval_s=1e9))
    sim.at(10.0, lambda: sim.set_rate(0, 2.0))
    run_dynamic(sim, 30.0, 0.0, 30.0)
    [change] = [c for c in sim.changes if c.kind == "rate"]
    assert (change.t, change.model, change.detail) == (10.0, "rag", "2/s")
    assert sim.workloads[0].rate == 2.0


def test_colocate_lays_a_batch_out_as_given() -> None:
    sim = _sim(Swap())
    replicas = list(sim.replicas)  # first-fit: e5 and bge share GPU 0
    assert replicas[0].peers and replicas[1].peers
    colocate(replicas, [(0,), (1,), (2,)])
    assert [r.gpus for r in replicas] == [(0,), (1,), (2,)]
    assert all(not r.peers for r in replicas)
    colocate(replicas, [(1,), (1,), (0,)])
    assert replicas[0].peers == [replicas[1]] and replicas[1].peers == [replicas[0]]
    assert replicas[2].peers == []


def test_the_same_inputs_give_the_same_run() -> None:
    a = run_dynamic(_sim(Swap(), rate=1.0), 90.0, 0.0, 60.0)
    b = run_dynamic(_sim(Swap(), rate=1.0), 90.0, 0.0, 60.0)
    assert a.workflows["rag"].latency == b.workflows["rag"].latency
    assert a.workflows["rag"].completed == b.workflows["rag"].completed


def test_the_hpa_scales_a_loaded_model_up_within_the_gpus() -> None:
    models = ("e5-base-v2", "bge-reranker-base", "llama-3-8b")
    hpa = Hpa(models, gpus=5)
    assert hpa.initial() == Allocation.of(*((m, "a6000", 1, 1.0, 1) for m in models))
    sim = DynamicSimulation(hpa.initial(), [WorkloadSpec("rag", 4.0)], 1, hpa, COLD_S)
    run_dynamic(sim, 240.0, 0.0, 60.0)
    started = [c for c in sim.changes if c.kind == "start"]
    assert started and {c.model for c in started} == {"llama-3-8b"}
    assert sum(c.count for c in started) <= 5 - len(models)  # whole GPUs, no more than free
    assert len(hpa.log) == len([t for t in hpa.log if "t" in t]) >= 240 / hpa.interval_s - 1
    assert hpa.log[0]["llama-3-8b"]["utilisation"] > hpa.settings.target_utilisation

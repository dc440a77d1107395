"""The allocations ``bench.accuracy.alp_picks`` judges, apart from the fitted set: the search's
own picks and a held-out set, with where each model's curve came from and, per latency point,
how each model's simulated call latency compares with the curve the prediction used.

Role:
- ``search_picks``: per workflow, cluster size and rate, what the product's search chooses
  (``optimizer.search.solve.search_and_place``, called through its module so that a change
  to the search's ranking is what this bench measures), with the shipped optimizer settings
  (``shared.optimizer_settings.OptimizerSettings``) on the evaluation's clusters
  (``bench.evaluation.setup``); rates are fractions of the largest rate the search finds
  feasible at that size. Identical allocations are judged once, remembering every
  (size, rate) that picked them.
- ``held_out``: allocations no constant of the ALP was fitted on: fractional verifier and 8B
  generator (shares 0.5 and 0.75: an 8B model's memory floor is 0.42 of an A6000, so 0.2 and
  0.25 cannot hold it), small models at 0.2 and 0.25, and different models sharing one GPU
  (the simulator packs fractions first fit, largest share first, across models). Their
  profiles are the fitted set's keys only, so every share off those keys is derived by the
  product's share model (``ProfileBook.lookup``), which is what this set tests.
- ``provenance``: per model of an allocation, whether its curve was measured or scaled
  (``Profile.scaled_from``) and corrected by live points.
- ``stage_check``: one simulated run at a latency point, recording calls: per model, its mean
  call latency against the curve's (pooled) call latency the prediction used, so a miss is
  traced to a model's curve at a load.

Invariants: pure over its inputs except ``stage_check`` (one seeded simulation); every
simulated figure is *simulated*.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.accuracy.alp_truth import sim_allocation
from bench.accuracy.cases import Alloc, AllocRow, Case
from bench.evaluation.setup import cluster, memory_floor_bytes
from optimizer.model.alp import ModelAlloc, Pipeline, Prediction
from optimizer.model.curves import ProfileBook
from optimizer.search import solve
from optimizer.search.space import SearchProblem, WorkflowTarget
from shared.optimizer_settings import OptimizerSettings
from sim.des import WorkloadSpec, simulate

SIZES, QUICK_SIZES = (4, 8, 16), (4,)
# of the largest rate the search finds feasible at the size
RATE_FRACTIONS, QUICK_RATE_FRACTIONS = (0.3, 0.6, 0.9), (0.5, 0.9)
UNBOUNDED_RATE = 1e4  # requests/s no allocation serves: the search returns its max capacity
QUICK_HELD_OUT = 2  # held-out allocations per workflow in --quick (the first ones)

_B1, _PRM = "llama-3.2-1b", "llama-3.1-8b-prm"
_E5, _RR, _G8 = "e5-base-v2", "bge-reranker-base", "llama-3-8b"
# Per workflow; each names what it holds out. Shares a key the fitted set profiles (1.0 for
# every model, 0.5 for the small ones, TP 2 whole GPUs for the 8B ones) are there only beside
# a derived one.
HELD_OUT: dict[str, list[Alloc]] = {
    "beam": [
        {_B1: (1, 1, 0.25), _PRM: (1, 1, 0.75)},  # scaled both, one GPU shared across models
        {_B1: (1, 1, 1.0), _PRM: (2, 1, 0.5)},  # fractional verifier (scaled from 1.0)
        {_B1: (2, 1, 0.25), _PRM: (2, 1, 0.75)},  # two GPUs, each 1B + verifier
        {_B1: (1, 1, 0.5), _PRM: (3, 1, 0.5)},  # a 0.5 verifier beside the 0.5 1B
        {_B1: (2, 1, 0.2), _PRM: (1, 2, 1.0)},  # 0.2 generators beside a TP 2 verifier
    ],
    "rag": [
        {_E5: (1, 1, 0.25), _RR: (1, 1, 0.25), _G8: (1, 1, 0.5)},  # all three on one GPU
        {_E5: (1, 1, 0.25), _RR: (1, 1, 0.25), _G8: (2, 1, 0.75)},  # 8B 0.75 + an encoder
        {_E5: (1, 1, 0.2), _RR: (1, 1, 0.2), _G8: (2, 1, 0.5)},  # fractional 8B, 0.2 encoders
        {_E5: (1, 1, 0.25), _RR: (2, 1, 0.25), _G8: (4, 1, 0.75)},
    ],
    "fanout": [
        {_B1: (1, 1, 0.25), _G8: (1, 1, 0.75)},  # one GPU shared across models
        {_B1: (1, 1, 0.5), _G8: (3, 1, 0.5)},  # fractional 8B, mixed on the second GPU
        {_B1: (2, 1, 0.25), _G8: (2, 1, 0.75)},
        {_B1: (2, 1, 0.2), _G8: (2, 1, 0.75)},
    ],
}


@dataclass(frozen=True)
class Pick:
    """One distinct allocation the search chose, and every (GPUs, rate) that chose it."""

    allocation: Alloc
    picked_at: tuple[dict[str, Any], ...]  # gpus, rate, max_rate, feasible, predicted latency


def problem(pipe: Pipeline, book: ProfileBook, gpus: int, rate: float) -> SearchProblem:
    """The search problem the daemon would pose for ``pipe`` alone (shipped settings)."""
    knobs = OptimizerSettings()
    return SearchProblem(
        (WorkflowTarget(pipe, rate),),
        book,
        cluster(gpus),
        memory_floor_bytes={st.model: memory_floor_bytes(st.model) for st in pipe.stages},
        granularity=knobs.granularity,
        headroom=knobs.headroom,
        welfare=knobs.welfare,
    )


def as_alloc(allocation: dict[str, ModelAlloc]) -> Alloc:
    return {
        m: (a.replicas, a.tp, round(a.share, 6), a.rest, round(a.rest_share, 6))
        if a.rest
        else (a.replicas, a.tp, round(a.share, 6))
        for m, a in allocation.items()
    }


def search_pick(pipe: Pipeline, book: ProfileBook, gpus: int, rate: float) -> solve.PlacedSearch:
    return solve.search_and_place(problem(pipe, book, gpus, rate))


def max_feasible_rate(pipe: Pipeline, book: ProfileBook, gpus: int) -> float:
    """The largest rate the search covers with headroom on ``gpus`` GPUs: asked for more than
    anything serves, it returns the allocation of largest capacity and the rate it serves."""
    return float(search_pick(pipe, book, gpus, UNBOUNDED_RATE).result.workflows[0].served_rate)


def search_picks(
    pipe: Pipeline, book: ProfileBook, sizes: Sequence[int], fractions: Sequence[float]
) -> list[Pick]:
    """The search's distinct picks for ``pipe`` over ``sizes`` x ``fractions`` of each size's
    largest feasible rate, in the order first picked. A pick that did not place is skipped
    (its (size, rate) is then missing from every ``picked_at``)."""
    picks: dict[tuple[tuple[str, AllocRow], ...], list[dict[str, Any]]] = {}
    for gpus in sizes:
        top = max_feasible_rate(pipe, book, gpus)
        for f in fractions:
            placed = search_pick(pipe, book, gpus, f * top)
            w = placed.result.workflows[0]
            if placed.placement is None or not w.models:
                continue
            key = tuple(sorted(as_alloc(w.allocation).items()))
            picks.setdefault(key, []).append(
                {
                    "gpus": gpus,
                    "rate": f * top,
                    "rate_fraction": f,
                    "max_feasible_rate": top,
                    "feasible": w.feasible,
                    "predicted_latency": w.latency,
                    "predicted_throughput": w.throughput,
                    "on_line": placed.on_line,
                }
            )
    return [Pick(dict(k), tuple(v)) for k, v in picks.items()]


def provenance(book: ProfileBook, alloc: Alloc) -> dict[str, dict[str, Any]]:
    """Per model: ``measured`` or ``scaled`` (and from which share), live corrections, and the
    share model's relative uncertainty and light-load exponent (``optimizer.model.shares``)."""
    out: dict[str, dict[str, Any]] = {}
    for m, row in alloc.items():
        main = ModelAlloc(*row)  # a mixed allocation's rest group: its profile is the same book's
        prof = book.lookup(m, main.tp, main.share)
        out[m] = {
            "curve": "measured" if prof.scaled_from is None else "scaled",
            "scaled_from": prof.scaled_from,
            "corrected_by": prof.corrected_by,
            "uncertainty": prof.uncertainty,
            "beta": prof.beta,
            "saturation_calls_per_s": prof.saturation,
        }
    return out


def stage_check(
    case: Case,
    pipe: Pipeline,
    alloc: Alloc,
    pred: Prediction,
    requests: int,
    warmup_s: float,
    seed: int,
) -> dict[str, dict[str, float]]:
    """One simulated run at ``pred.rate`` recording calls: per model, the mean latency of the
    calls of requests that arrived after ``warmup_s`` against the prediction's call latency
    (the curve at the per-replica call rate, pooled), and the calls per second per replica
    (over every replica of the model, a mixed allocation's rest group included) it saw
    against the traced calls per request at ``pred.rate``."""
    calls_per_request = {st.model: st.n for st in pipe.stages}
    spec = [WorkloadSpec(case.workflow, pred.rate, case.params)]  # type: ignore[arg-type]
    res = simulate(
        sim_allocation(case, alloc),
        spec,
        n_requests=requests,
        warmup_s=warmup_s,
        record_calls=True,
        seed=seed,
    )
    lo, hi = res.window_s
    out: dict[str, dict[str, float]] = {}
    for st in pred.stages:
        replicas = max(ModelAlloc(*alloc[st.model]).count, 1)
        mine = [c for c in res.calls if c.call.model == st.model and lo <= c.t_start < hi]
        sim_lat = float(np.mean([c.t_end - c.t_start for c in mine])) if mine else float("nan")
        out[st.model] = {
            "predicted_call_latency": st.call_latency,
            "simulated_call_latency": sim_lat,
            "error": (st.call_latency - sim_lat) / sim_lat if sim_lat > 0 else float("nan"),
            "predicted_calls_per_s_per_replica": pred.rate * calls_per_request[st.model] / replicas,
            "simulated_calls_per_s_per_replica": len(mine) / max(hi - lo, 1e-9) / replicas,
            "predicted_utilisation": st.utilisation,
        }
    return out

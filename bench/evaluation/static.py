"""The static baselines: per-LLM independent sizing and an even split by hand.

Role: allocations for ``bench.evaluation.evaluate``'s "independent" and "even" systems, as the simulator's
``Allocation`` plus whether ``optimizer.placement`` can place them on the cluster.

- independent (what multi-LLM serving systems do: no workflow view): each model's demand is
  its own call rate over its whole-GPU profiled capacity, ``λ_w · n_m / T_m``; the cluster's
  GPU units are split in proportion to demand (at least the model's memory floor, largest
  remainders), each model's units become whole-GPU TP-1 replicas plus one fractional replica
  for the remainder. No TP, no latency view: it balances utilisation, not request latency.
  Where those remainders fragment the GPUs so that the split does not place, every model
  goes on whole GPUs instead (the placement retry Scepsy's search gets too).
- even (a user's hand configuration; Ayo's allocation too): the GPUs are split equally between workflows, and inside
  a workflow equally between its models as whole GPUs (the remainder to the largest models);
  with fewer GPUs than models, the largest models get a GPU each and the smaller ones share
  the last GPU equally.

Invariants: pure; every model of the workload gets at least one replica; units sum to at most
the cluster's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from bench.evaluation.scepsy import Knowledge, specs_of
from bench.evaluation.setup import GRANULARITY, cluster, memory_floor_bytes, workflow_models
from optimizer.placement import PlacementError, ReplicaDemand, place
from sim.cluster import Allocation
from sim.perf import GPUS, MODELS

__all__ = ["even", "independent", "placeable"]

Row = tuple[str, int, int, float]  # model, replicas, tp, share


def _floor_units(model: str, gpu: str = "a6000") -> int:
    return max(
        1, math.ceil(memory_floor_bytes(model) / GPUS[gpu].memory_bytes * GRANULARITY - 1e-9)
    )


def _rows(units: Mapping[str, int]) -> list[Row]:
    """Whole GPUs plus one replica for the remainder; a remainder below the memory floor is
    spread instead: ``whole + 1`` equal replicas (units over the floor each)."""
    rows: list[Row] = []
    for m, u in units.items():
        whole, rest = divmod(u, GRANULARITY)
        if rest and whole and rest < _floor_units(m):
            rows.append((m, whole + 1, 1, u / (GRANULARITY * (whole + 1))))
            continue
        if whole:
            rows.append((m, whole, 1, 1.0))
        if rest:
            rows.append((m, 1, 1, rest / GRANULARITY))
    return rows


def independent(k: Knowledge, rates: Mapping[str, float], gpus: int) -> Allocation:
    """``rates``: workflow kind ("beam", "rag") -> requests/s. Where the proportional split's
    fractional replicas do not place (its remainders fragment the GPUs), the placement retry
    a user of per-LLM sizing makes: every model on whole GPUs, by largest remainders."""
    units = _units(k, rates, gpus)
    first = specs_of(_rows(units))
    whole = _whole(units, gpus)
    if whole is None or placeable(first, gpus)[0]:
        return first
    return specs_of(_rows(whole))


def _whole(units: Mapping[str, int], gpus: int) -> dict[str, int] | None:
    """``units`` rounded to whole GPUs (at least one per model, the rest by largest
    remainders), or None with fewer GPUs than models."""
    if len(units) > gpus:
        return None
    exact = {m: u / GRANULARITY for m, u in units.items()}
    got = {m: max(1, math.floor(v)) for m, v in exact.items()}
    spare = gpus - sum(got.values())
    for m in sorted(exact, key=lambda m: got[m] - exact[m])[: max(spare, 0)]:
        got[m] += 1
    while sum(got.values()) > gpus:  # the at-least-one rule overshot: take from the largest
        got[max(got, key=lambda m: got[m])] -= 1
    return {m: g * GRANULARITY for m, g in got.items()}


def _units(k: Knowledge, rates: Mapping[str, float], gpus: int) -> dict[str, int]:
    """GPU units per model in proportion to its demand over its whole-GPU capacity (at
    least its memory floor; largest remainders)."""
    demand: dict[str, float] = {}
    for w, rate in rates.items():
        pipe = k.pipelines[w]
        for st in pipe.stages:
            cap = k.book.lookup(st.model, 1, 1.0).saturation
            demand[st.model] = demand.get(st.model, 0.0) + rate * st.n / cap
    total = gpus * GRANULARITY
    floors = {m: _floor_units(m) for m in demand}
    free = total - sum(floors.values())
    weight = sum(demand.values())
    # each model gets its floor, the rest in proportion to the demand above what it covers
    exact = {m: max(demand[m] / weight * total, floors[m]) for m in demand}
    scale = free / max(sum(exact[m] - floors[m] for m in demand), 1e-12)
    exact = {m: floors[m] + (exact[m] - floors[m]) * scale for m in demand}
    units = {m: math.floor(v) for m, v in exact.items()}
    for m in sorted(demand, key=lambda m: units[m] - exact[m])[: total - sum(units.values())]:
        units[m] += 1
    return units


def even(kinds: tuple[str, ...], gpus: int) -> Allocation:
    """``kinds``: the workflow kinds served ("beam", "rag")."""
    rows: list[Row] = []
    per = [gpus // len(kinds) + (1 if i < gpus % len(kinds) else 0) for i in range(len(kinds))]
    for kind, g in zip(kinds, per, strict=True):
        models = sorted(workflow_models(kind), key=lambda m: -MODELS[m].params)
        if g >= len(models):
            counts = {m: g // len(models) for m in models}
            for m in models[: g % len(models)]:
                counts[m] += 1
            rows += [(m, c, 1, 1.0) for m, c in counts.items()]
        else:
            big, small = models[: g - 1], models[g - 1 :]
            rows += [(m, 1, 1, 1.0) for m in big]
            share = math.floor(GRANULARITY / len(small)) / GRANULARITY
            rows += [(m, 1, 1, share) for m in small]
    return specs_of(rows)


def placeable(allocation: Allocation, gpus: int) -> tuple[bool, str]:
    """Whether ``optimizer.placement`` places ``allocation`` on the evaluation cluster."""
    demands = [
        ReplicaDemand("eval", s.model, s.tp, s.share, None, memory_floor_bytes(s.model))
        for s in allocation.replicas
        for _ in range(s.count)
    ]
    try:
        place(cluster(gpus), demands)
    except PlacementError as exc:
        return False, str(exc)
    return True, ""

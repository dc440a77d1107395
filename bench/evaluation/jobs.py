"""The evaluation's points as jobs: one per system and rate of a sweep, planned before it runs.

Role: :func:`point_jobs` turns a sweep (a workflow on a cluster, rates as fractions of
Scepsy's predicted capacity there) into :class:`bench.evaluation.runs.PointJob` s, each with
its system's allocation at its rate (Scepsy and the ablations searched and placed, per-LLM
independent sizing, the even split; the autoscaler and Aegaeon none: they run dynamically);
``bench.evaluation.evaluate`` runs the grid, ``bench.evaluation.knee`` one rate at a time.

Invariants: a job is planned from the knowledge alone (profiles and pipelines), so the same
knowledge, rate and system give the same job; its seed is the grid's (``1000 x GPUs + 10 x
the rate's index``) unless a caller replaces it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bench.evaluation.runs import PointJob
from bench.evaluation.scepsy import Knowledge, allocate, alp_view, capacity, capacity_beside
from bench.evaluation.setup import (
    ABLATIONS,
    AYO,
    BELOW_SWEEP_FRACTIONS,
    BELOW_SWEEP_SYSTEMS,
    COMBINED_BEAM_FRACTION,
    RunLengths,
)
from bench.evaluation.static import even, independent, placeable


def sweep_of(k: Knowledge, gpus: int, kind: str) -> dict[str, float]:
    """The sweep's anchor: Scepsy's predicted capacity (``capacity``) and, for combined, beam
    search's fixed rate (``beam_rate``; 0 otherwise)."""
    if kind != "combined":
        return {"capacity": capacity(k, kind, gpus), "beam_rate": 0.0}
    beam_rate = COMBINED_BEAM_FRACTION * capacity(k, "beam", gpus)
    # anchored at RAG's capacity beside beam at its own rate (not at an unreachable RAG
    # target, where the search would cut beam to RAG's fraction too)
    return {
        "capacity": capacity_beside(k, "rag", {"beam": beam_rate}, gpus),
        "beam_rate": beam_rate,
    }


def point_jobs(
    k: Knowledge,
    gpus: int,
    kind: str,
    fractions: Sequence[float],
    lengths: RunLengths,
    systems: Sequence[str],
    sweep: Mapping[str, float] | None = None,
) -> tuple[list[PointJob], dict[str, Any]]:
    """The jobs of ``fractions`` x the sweep's capacity (``sweep``: one :func:`sweep_of`
    gave already, not searched again), and the sweep."""
    anchor = dict(sweep) if sweep is not None else sweep_of(k, gpus, kind)
    top, beam_rate = anchor["capacity"], anchor["beam_rate"]
    light = max(k.light_latency.values()) if kind == "combined" else k.light_latency[kind]
    jobs = []
    below = [s for s in systems if s in BELOW_SWEEP_SYSTEMS]
    rates = [(f, systems) for f in fractions] + [(f, below) for f in BELOW_SWEEP_FRACTIONS]
    for i, (f, at_f) in enumerate(rates):
        rate = f * top
        targets = {"beam": beam_rate, "rag": rate} if kind == "combined" else {kind: rate}
        kinds = tuple(targets)
        for system in at_f:
            meta: dict[str, Any] = {}
            allocation = None
            if system in ABLATIONS:
                tp, frac = ABLATIONS[system]
                p = allocate(k, targets, gpus, system, tp, frac)
                allocation = p.allocation
                meta = {
                    "placed": p.placed,
                    "feasible": p.feasible,
                    "predicted": p.predicted,
                    "sim_gpus": p.sim_gpus,
                    "note": p.note,
                }
            elif system == "independent":
                allocation = independent(k, targets, gpus)
            elif system in ("even", AYO):  # Ayo serves the user's hand allocation
                allocation = even(kinds, gpus)
            if allocation is not None and system in ("independent", "even", AYO):
                ok, why = placeable(allocation, gpus)
                meta = {"placed": ok, "note": why}
            if allocation is not None:
                meta["alp"] = alp_view(k, allocation, targets)
                meta["allocation"] = [
                    {"model": s.model, "replicas": s.count, "tp": s.tp, "share": s.share}
                    for s in allocation.replicas
                ]
            jobs.append(
                PointJob(
                    system,
                    kind,
                    gpus,
                    rate,
                    beam_rate,
                    allocation,
                    lengths,
                    light,
                    seed=1000 * gpus + 10 * i,
                    meta=meta,
                )
            )
    return jobs, anchor

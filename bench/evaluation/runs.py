"""One throughput-latency point of one system: a simulated run and its figures.

Role: the unit of work ``bench.evaluation.evaluate`` farms out to a process pool. A :class:`PointJob`
names the system, workflow kind, cluster size, offered rates and either a static allocation
(run with ``sim.des.simulate``; ``ayo`` without prefix caching, by workflow-request start) or ``None``
for Aegaeon's pooled instances (``sim.multiplex.simulate_pooled`` at the system's split) and
for the autoscaler (run with ``sim.dynamic`` with
``sim.hpa``, measured after its warm-up): ``hpa`` starts cold (one replica per model),
``hpa_warm`` at the pod counts its own rule settles on at the point's load
(``sim.hpa.settled_counts``, over ``HPA_SETTLE_ROUNDS`` static runs of ``hpa_window_s / 4``).

Measurement (all simulated): requests arriving in the window ``[warm-up, end of arrivals)``;
warm-up and window are multiples of the light-load request latency (at least enough for the
window to hold the configured number of requests); completions are drained for a few
latencies after arrivals stop, and what has not finished by then counts as failed. A point is
*sustained* when >= 95% of its measured requests completed and the in-window completion rate
is >= 90% of the in-window arrival rate, for every workflow of the point.

Invariants: pure function of the job (seeded); returns plain JSON-ready dicts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypedDict

from bench.evaluation.setup import (
    AEGAEON_PREFILL_PER_NODE,
    AYO,
    GPU,
    GPUS_PER_NODE,
    SUSTAINED,
    RunLengths,
    workflow_models,
    workloads,
)
from sim.cluster import Allocation
from sim.des import SimResult, simulate
from sim.dynamic import DynamicSimulation, run_dynamic
from sim.hpa import METRIC, Hpa, settled_counts
from sim.multiplex import simulate_pooled

COLD_START_S = 90.0  # optimizer settings' cold_start_s default (calibration.md: 52-110 s)
HPA_SYSTEMS = ("hpa", "hpa_warm")  # the autoscaler: cold and warm-started
HPA_SETTLE_ROUNDS = 6


@dataclass(frozen=True)
class PointJob:
    system: str
    kind: str  # "beam" | "rag" | "combined"
    gpus: int
    rate: float  # the swept workflow's rate (RAG's for "combined")
    beam_rate: float  # combined only: beam search's fixed rate
    allocation: Allocation | None  # None: the autoscaler
    lengths: RunLengths
    light_latency: float  # longest light-load mean request latency of the point's workflows
    seed: int
    meta: dict[str, Any]  # planning facts carried into the point (placed, predicted, ...)


def _window(job: PointJob) -> tuple[float, float, float]:
    """Warm-up, arrival horizon and drain (simulated seconds)."""
    lengths = job.lengths
    swept = "beam" if job.kind == "beam" else "rag"
    n = lengths.requests[swept]
    if job.system in HPA_SYSTEMS:
        warm, window = lengths.hpa_warmup_s, lengths.hpa_window_s
    else:
        warm = lengths.warmup_latencies * job.light_latency
        window = max(n / job.rate, lengths.min_window_latencies * job.light_latency)
        if job.kind == "combined":  # enough beam requests to judge it sustained, too
            window = max(window, 0.5 * lengths.requests["beam"] / job.beam_rate)
    return warm, warm + window, 3.0 * job.light_latency + 30.0


def _figures(res: SimResult) -> dict[str, Any]:
    span = res.window_s[1] - res.window_s[0]
    out: dict[str, Any] = {}
    for name, w in res.workflows.items():
        arrival = w.started / span if span > 0 else 0.0
        sustained = (
            w.started > 0 and w.completed >= SUSTAINED * w.started and w.throughput >= 0.9 * arrival
        )
        out[name] = {
            "offered": w.offered_rate,
            "arrival_rate": arrival,
            "throughput": w.throughput,
            "latency_mean": w.latency.mean,
            "latency_p90": w.latency.p90,
            "started": w.started,
            "completed": w.completed,
            "failed": w.failed,
            "sustained": sustained,
        }
    return out


class _RunWindow(TypedDict):
    """The simulators' run keywords every static or pooled point shares."""

    duration_s: float
    warmup_s: float
    drain_s: float
    seed: int


def run_point(job: PointJob) -> dict[str, Any]:
    warm, horizon, drain = _window(job)
    specs = workloads(job.kind, job.rate, job.beam_rate)
    extra: dict[str, Any] = {}
    run: _RunWindow = {"duration_s": horizon, "warmup_s": warm, "drain_s": drain, "seed": job.seed}
    if job.system in AEGAEON_PREFILL_PER_NODE:
        prefill = AEGAEON_PREFILL_PER_NODE[job.system]
        try:
            res, switches = simulate_pooled(
                specs, job.gpus, prefill, **run, node_gpus=GPUS_PER_NODE, gpu=GPU
            )
        except ValueError as exc:  # a model no instance can hold (memory)
            return {**_unserved(job, set()), "error": str(exc)}
        extra = {"prefill_per_node": prefill, "switches": switches}
    elif job.allocation is None:
        if job.system not in HPA_SYSTEMS:
            raise ValueError(f"{job.system}: a static system needs an allocation")
        models = workflow_models(job.kind)
        if len(models) > job.gpus:  # one whole-GPU pod per model cannot even start
            return _unserved(job, set(models[job.gpus :]))
        hpa = Hpa(models, job.gpus)
        counts = None
        if job.system == "hpa_warm":
            settle_s = max(60.0, job.lengths.hpa_window_s / 4)
            counts = settled_counts(
                models, job.gpus, specs, job.seed, settle_s, max_rounds=HPA_SETTLE_ROUNDS
            )
        sim = DynamicSimulation(hpa.initial(counts), specs, job.seed, hpa, COLD_START_S)
        res = run_dynamic(sim, horizon, warm, drain)
        in_window = [c for c in sim.changes if warm <= c.t < horizon]
        extra = {
            "metric": METRIC,
            "start": "warm" if counts else "cold",
            "replicas_start": counts or {m: 1 for m in models},
            "scaling_events": sum(1 for c in in_window if c.kind in ("start", "retire")),
            "replicas_end": {m: len(sim.serving(m)) for m in hpa.models},
            "replica_range": _replica_range(hpa.log, warm, horizon),
        }
    else:
        missing = set(workflow_models(job.kind)) - job.allocation.models()
        if missing:
            return _unserved(job, missing)
        try:
            res = simulate(
                job.allocation,
                specs,
                **run,
                enable_prefix_caching=job.system != AYO,  # Ayo runs on vLLM v0.2
                scheduling="priority" if job.system == AYO else "fcfs",
            )
        except ValueError as exc:  # a replica the engine model refuses (memory)
            return {**_unserved(job, set()), "error": str(exc)}
    figures = _figures(res)
    swept = "beam" if job.kind == "beam" else "rag"
    return {
        "system": job.system,
        "workflow": job.kind,
        "gpus": job.gpus,
        "rate": job.rate,
        "beam_rate": job.beam_rate if job.kind == "combined" else None,
        "throughput": figures[swept]["throughput"],
        "latency_mean": figures[swept]["latency_mean"],
        "latency_p90": figures[swept]["latency_p90"],
        "sustained": all(f["sustained"] for f in figures.values()),
        "workflows": figures,
        "window_s": [warm, horizon],
        "wall_s": res.wall_s,
        "label": res.label,
        **extra,
        **job.meta,
    }


def _unserved(job: PointJob, missing: set[str]) -> dict[str, Any]:
    """A point whose allocation leaves a model without replicas: nothing completes."""
    return {
        "system": job.system,
        "workflow": job.kind,
        "gpus": job.gpus,
        "rate": job.rate,
        "beam_rate": job.beam_rate if job.kind == "combined" else None,
        "throughput": 0.0,
        "latency_mean": math.inf,
        "latency_p90": math.inf,
        "sustained": False,
        "workflows": {},
        "window_s": None,
        "wall_s": 0.0,
        "label": "simulated",
        "unserved": sorted(missing),
        **job.meta,
    }


def _replica_range(log: list[dict[str, Any]], t0: float, t1: float) -> dict[str, list[int]]:
    """Per model, the fewest and most serving replicas seen at the autoscaler's syncs."""
    out: dict[str, list[int]] = {}
    for rec in log:
        if not t0 <= rec["t"] < t1:
            continue
        for m, v in rec.items():
            if m == "t":
                continue
            lo, hi = out.get(m, [v["ready"], v["ready"]])
            out[m] = [min(lo, v["ready"]), max(hi, v["ready"])]
    return out

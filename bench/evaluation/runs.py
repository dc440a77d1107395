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
kept up with the in-window arrival rate (``sim.profiling.keeps_up``: within 5%), for every
workflow of the point. A verdict of "not sustained" from a run too short for its own request
latency (every request completed, but the window held a pipeline still filling) is measured
again with a longer warm-up and window (``bench.run_length.stretch``), the same rule for every
system; the point records the runs it stretched from.

Invariants: pure function of the job (seeded); returns plain JSON-ready dicts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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
from bench.run_length import Window, stretch
from sim.cluster import Allocation
from sim.des import SimResult, simulate
from sim.dynamic import DynamicSimulation, run_dynamic
from sim.hpa import METRIC, Hpa, settled_counts
from sim.multiplex import simulate_pooled
from sim.profiling import keeps_up

COLD_START_S = 90.0  # optimizer settings' cold_start_s default (calibration.md: 52-110 s)
HPA_SYSTEMS = ("hpa", "hpa_warm")  # the autoscaler: cold and warm-started
HPA_SETTLE_ROUNDS = 6
# A point's run is stretched (``bench.run_length.stretch``) at most STRETCHES times, its
# window to at most STRETCH_MAX x the first one's, to the evaluation's own run lengths in
# measured latencies (not the accuracy bench's 5 and 20): a stretched run at a rate past
# capacity simulates a backlog that grows with its length (beam on 4 GPUs at 1.2x capacity:
# a 120 s window stretched twice to 1,480 s cost 105 s of wall time, and the first stretch
# had given the same verdict), while a filling pipeline needs a handful of its own
# latencies (beam on 8 GPUs at 35 s per request had a 117 s window, 3.3 latencies). Simulated.
STRETCHES, STRETCH_MAX = 1, 4.0


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
        out[name] = {
            "offered": w.offered_rate,
            "arrival_rate": arrival,
            "throughput": w.throughput,
            "latency_mean": w.latency.mean,
            "latency_p90": w.latency.p90,
            "started": w.started,
            "completed": w.completed,
            "failed": w.failed,
            "sustained": _drained(w.started, w.completed) and keeps_up(arrival, w.throughput),
        }
    return out


def _drained(started: int, completed: int) -> bool:
    return started > 0 and completed >= SUSTAINED * started


def _windows(figures: dict[str, Any], warm: float, horizon: float) -> dict[str, Window]:
    return {
        name: Window(f["arrival_rate"], f["throughput"], f["latency_mean"], warm, horizon - warm)
        for name, f in figures.items()
    }


def _longer(
    figures: dict[str, Any],
    now: dict[str, Window],
    before: dict[str, Window] | None,
    latencies: tuple[float, float],
) -> tuple[float, float] | None:
    """(warm-up, window) to run a point again with, or None when its verdict stands: it was
    sustained; a workflow left requests unfinished after the drain (a backlog no window
    length explains away); or no workflow's run was too short for its own latency
    (``bench.run_length.stretch``, with ``latencies``: warm-up and window in request
    latencies, the evaluation's own run lengths read in the latency the run measured rather
    than in the light-load one)."""
    if all(f["sustained"] for f in figures.values()):
        return None
    if not all(_drained(f["started"], f["completed"]) for f in figures.values()):
        return None
    asks = [
        ask
        for name, w in now.items()
        if not figures[name]["sustained"]
        and (ask := stretch(w, before[name] if before else None, *latencies)) is not None
    ]
    if not asks:
        return None
    return max(a[0] for a in asks), max(a[1] for a in asks)


class _RunWindow(TypedDict):
    """The simulators' run keywords every static or pooled point shares."""

    duration_s: float
    warmup_s: float
    drain_s: float
    seed: int


Runner = Callable[[float, float], SimResult]  # (warm-up, end of arrivals) -> the run


def run_point(job: PointJob) -> dict[str, Any]:
    """The point's run, and its runs again with longer warm-up and window while its
    overloaded verdict came from a run too short for its own latency (``_longer``, at most
    ``STRETCHES`` times, windows at most ``STRETCH_MAX`` x the first; the last run
    decides): the same rule for every system."""
    warm, horizon, drain = _window(job)
    specs = workloads(job.kind, job.rate, job.beam_rate)
    extra: dict[str, Any] = {}
    runner: Runner
    if job.system in AEGAEON_PREFILL_PER_NODE:
        prefill = AEGAEON_PREFILL_PER_NODE[job.system]

        def pooled(warm: float, horizon: float) -> SimResult:
            res, switches = simulate_pooled(
                specs,
                job.gpus,
                prefill,
                **_run(job, warm, horizon, drain),
                node_gpus=GPUS_PER_NODE,
                gpu=GPU,
            )
            extra.update(prefill_per_node=prefill, switches=switches)
            return res

        runner = pooled
    elif job.allocation is None:
        if job.system not in HPA_SYSTEMS:
            raise ValueError(f"{job.system}: a static system needs an allocation")
        models = workflow_models(job.kind)
        if len(models) > job.gpus:  # one whole-GPU pod per model cannot even start
            return _unserved(job, set(models[job.gpus :]))
        counts = None
        if job.system == "hpa_warm":
            settle_s = max(60.0, job.lengths.hpa_window_s / 4)
            counts = settled_counts(
                models, job.gpus, specs, job.seed, settle_s, max_rounds=HPA_SETTLE_ROUNDS
            )

        def autoscaled(warm: float, horizon: float) -> SimResult:
            hpa = Hpa(models, job.gpus)
            sim = DynamicSimulation(hpa.initial(counts), specs, job.seed, hpa, COLD_START_S)
            res = run_dynamic(sim, horizon, warm, drain)
            in_window = [c for c in sim.changes if warm <= c.t < horizon]
            extra.update(
                metric=METRIC,
                start="warm" if counts else "cold",
                replicas_start=counts or {m: 1 for m in models},
                scaling_events=sum(1 for c in in_window if c.kind in ("start", "retire")),
                replicas_end={m: len(sim.serving(m)) for m in hpa.models},
                replica_range=_replica_range(hpa.log, warm, horizon),
            )
            return res

        runner = autoscaled
    else:
        allocation = job.allocation
        missing = set(workflow_models(job.kind)) - allocation.models()
        if missing:
            return _unserved(job, missing)

        def static(warm: float, horizon: float) -> SimResult:
            return simulate(
                allocation,
                specs,
                **_run(job, warm, horizon, drain),
                enable_prefix_caching=job.system != AYO,  # Ayo runs on vLLM v0.2
                scheduling="priority" if job.system == AYO else "fcfs",
            )

        runner = static
    try:
        res = runner(warm, horizon)
    except ValueError as exc:  # a replica the engine model refuses, a model no instance holds
        return {**_unserved(job, set()), "error": str(exc)}
    figures, wall, before, stretched = _figures(res), res.wall_s, None, []
    longest = STRETCH_MAX * (horizon - warm)
    latencies = (job.lengths.warmup_latencies, job.lengths.min_window_latencies)
    for _ in range(STRETCHES):
        now = _windows(figures, warm, horizon)
        longer = _longer(figures, now, before, latencies)
        if longer is None:
            break
        stretched.append({"window_s": [warm, horizon], "workflows": figures})
        warm, horizon = longer[0], longer[0] + min(longer[1], longest)
        res = runner(warm, horizon)
        figures, wall, before = _figures(res), wall + res.wall_s, now
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
        "stretched_from": stretched,
        "wall_s": wall,
        "label": res.label,
        **extra,
        **job.meta,
    }


def _run(job: PointJob, warm: float, horizon: float, drain: float) -> _RunWindow:
    return {"duration_s": horizon, "warmup_s": warm, "drain_s": drain, "seed": job.seed}


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

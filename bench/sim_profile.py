"""Profiling by simulation: throughput-latency points of one model from the simulator.

Role: the bench-side stand-in for ``scepsy profile`` (which replays traced calls against
emulator processes). For one ``(model, tp, share)`` the workflow runs in ``sim.des`` with that
model on a single replica and every other model of the workflow over-provisioned, so the
model sees its real call mix, fan-out and prefix sharing. The workflow rate is doubled from
light load until the model's achieved call throughput stops following the offered call rate
(saturation found, not configured), then points at fixed fractions of the saturation estimate
are added. Every figure here is *simulated*.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from optimizer.profiles import FOLLOW_TOLERANCE, ProfilePoint
from shared.records import CallRecord
from sim.cluster import Allocation, ReplicaSpec
from sim.des import SimCall, WorkloadSpec, simulate
from sim.workflows import WorkflowParams, models_of

ENGINE = "sim-engine"
BASE_US = 1_700_000_000_000_000  # simulated t=0 as a wall-clock time
OVERPROVISION = 6  # replicas of every model that is not being profiled
REFINE = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95)  # fractions of the saturation estimate


@dataclass(frozen=True)
class Case:
    """One workflow of the accuracy bench."""

    workflow: str  # "beam" | "rag" | "fanout"
    params: WorkflowParams
    gpu: str
    trace_rate: float
    trace_requests: int
    eval_requests: int
    profile_calls: int = 1500  # calls of the profiled model per profile point
    allocations: list[dict[str, tuple[int, int, float]]] = field(default_factory=list)


@dataclass(frozen=True)
class ProfileJob:
    case: Case
    model: str
    tp: int
    share: float
    n_per_request: float  # calls of ``model`` per workflow request (from stats)
    target_calls: int  # calls of the model each point should measure
    start_rate: float  # calls/s of the first (light-load) point
    refine: tuple[float, ...] = REFINE
    max_doublings: int = 12


def calls_to_rows(calls: Sequence[SimCall]) -> list[tuple[Any, ...]]:
    """Simulated calls as call-record rows (simulated seconds become microseconds)."""
    rows = []
    for c in calls:
        inputs = c.call.inputs
        rows.append(CallRecord(
            call_id=f"sim-{c.call_id}", proxy_id="sim", workflow=c.workflow,
            request_id=c.request_id, model=c.call.model, endpoint=c.call.endpoint, status=200,
            t_start=BASE_US + round(c.t_start * 1e6),
            t_first_byte=BASE_US + round(c.t_first * 1e6) if c.t_first >= 0 else None,
            t_end=BASE_US + round(c.t_end * 1e6),
            prompt_tokens=sum(len(p) for p in inputs),
            completion_tokens=c.call.output_tokens * len(inputs),
            cached_tokens=c.cached_tokens,
        ).row())
    return rows


def _point(job: ProfileJob, call_rate: float, seed: int) -> ProfilePoint:
    case = job.case
    specs = [ReplicaSpec(job.model, case.gpu, job.tp, job.share, 1)]
    specs += [ReplicaSpec(m, case.gpu, 1, 1.0, OVERPROVISION)
              for m in models_of(case.params) if m != job.model]
    duration = job.target_calls / call_rate
    warmup = 0.2 * duration
    res = simulate(Allocation(tuple(specs)),
                   [WorkloadSpec(case.workflow, call_rate / job.n_per_request,  # type: ignore[arg-type]
                                 case.params)],
                   duration_s=duration, warmup_s=warmup, drain_s=0.5 * duration,
                   record_calls=True, seed=seed)
    end = res.window_s[1]
    mine = [c for c in res.calls if c.call.model == job.model]
    started = [c for c in mine if warmup <= c.t_start < end]
    finished = sum(1 for c in mine if warmup <= c.t_end <= end)
    lat = np.array([c.t_end - c.t_start for c in started]) if started else np.array([np.inf])
    ttft = [c.t_first - c.t_start for c in started if c.t_first >= 0]
    p50, p90, p99 = np.percentile(lat, [50, 90, 99])
    return ProfilePoint(
        model=job.model, engine=ENGINE, gpu_type=case.gpu, tp=job.tp, share=job.share,
        # offered: the calls the workflow actually submitted in the window (bursty workflows
        # stray far from the nominal rate over a short run); under overload the queue grows,
        # so completions fall behind submissions.
        offered_rate=len(started) / max(end - warmup, 1e-9),
        throughput=finished / max(end - warmup, 1e-9),
        lat_mean=float(lat.mean()), lat_p50=float(p50), lat_p90=float(p90),
        lat_p99=float(p99), ttft_mean=float(np.mean(ttft)) if ttft else 0.0,
        n_calls=len(started),
    )


def run_profile(job: ProfileJob) -> list[ProfilePoint]:
    """Sweep from light load to saturation, then refine below the saturation estimate."""
    points: list[ProfilePoint] = []
    rate = job.start_rate
    for k in range(job.max_doublings):
        p = _point(job, rate, seed=1000 + k)
        points.append(p)
        if p.throughput < (1.0 - 2 * FOLLOW_TOLERANCE) * p.offered_rate:
            break
        rate *= 2.0
    saturation = max(p.throughput for p in points)
    for k, frac in enumerate(job.refine):
        target = frac * saturation
        if any(abs(p.offered_rate - target) < 0.05 * target for p in points):
            continue
        points.append(_point(job, target, seed=2000 + k))
    # Just past the estimate: pins the plateau (deep overload thrashes and reads lower).
    points.append(_point(job, 1.15 * saturation, seed=3000))
    return sorted(points, key=lambda p: p.offered_rate)

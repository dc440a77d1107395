"""Profiling by simulation: throughput-latency points of one model from the simulator.

Role: the simulated stand-in for ``scepsy profile`` (which replays traced calls against
emulator processes); ``sim.profiles`` runs it for the demo, the accuracy and evaluation
benches for their own workflows. For one ``(model, tp, share)`` the workflow runs in
``sim.des`` with that model on one replica (a fractional share: on as many co-located replicas
as fill one GPU, see ``colocated``, or alone on its GPU with ``ProfileJob.alone``; each point
says which in ``colocation``) and every other model of the workflow over-provisioned, so
the model sees its real call mix, fan-out and prefix sharing. The rate is doubled from light
load until the replica stops keeping up (``keeps_up``: saturation found, not configured), the
bracket is bisected, then points at fixed fractions of the saturation estimate are added for
the latency curve. Keeping up is judged by the calls piling up *at this model* per workflow
request arriving: a workflow whose calls depend on earlier calls (beam search: ~40 calls of
each model per request, ~3 at a time) stops sending when the replica falls behind, so its
submitted calls track its completed ones deep into overload (97% of them at 20% overload); a
pile of ``k`` calls there holds ``k / p`` requests, against ``started / n`` arriving (``n``
calls per request, ``p`` at a time). Counting the whole workflow's backlog instead would blame
this model for an over-provisioned one's limit (RAG's embedder profiled at 30 000 calls/s
needs the generator to keep up too). ``bracket`` is shared with the accuracy bench, which
finds a whole allocation's maximum throughput the same way.

Invariants: imports only ``sim`` and ``shared`` (the points are ``shared.profile_points``
records, the contract the optimizer reads); ``FOLLOW_TOLERANCE`` is the optimizer's keep-up
test (``optimizer.model.curves``, checked equal by the tests); deterministic for a given job;
every figure here is *simulated*.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from shared.profile_points import ProfilePoint, packed_copies
from sim.cluster import Allocation, ReplicaSpec
from sim.des import SimCall, WorkloadSpec, simulate
from sim.workflows import WorkflowParams, models_of

ENGINE = "sim-engine"
# Why a copy: sim does not import the optimizer; tests/sim/test_profiling.py checks it equals
# optimizer.model.curves.FOLLOW_TOLERANCE (achieved within 5% of offered: the engine keeps up).
FOLLOW_TOLERANCE = 0.05
OVERPROVISION = 6  # replicas of every model that is not being profiled
# Workflow requests per profile point at least, quick runs too: keeping up is judged by the
# calls piled up per request (x n/p, ~18 for beam's generator), and 100 beam requests per
# point read in-flight swings at the window's ends as overload (generator 18 calls/s instead
# of 59).
PROFILE_REQUESTS = 300
REFINE = (0.2, 0.4, 0.6, 0.8, 0.9)  # fractions of the saturation estimate
# A point judged overloaded by less than this shortfall is measured once more over
# RECHECK_SCALE times the window, and the longer reading decides: the pile of a
# dependency-bound model counts per request (x n/p, ~17 for beam's generator), so a few
# requests' swing of in-flight calls reads as overload. Measured (simulated): beam's generator
# profiled at 48.6 calls/s from points judged overloaded at 53 and 56 calls/s (5% and 9%
# short) while the same model kept up at 58-65 calls/s at other seeds, and the whole workflow
# on one generator kept up at 1.5 req/s (58.7 calls/s) over 1200 requests.
MARGINAL_SHORTFALL = 0.15
RECHECK_SCALE = 2.0
# Profiles can go further (``ProfileJob.follow_z``, the accuracy bench's full run): a verdict
# within FOLLOW_Z standard errors of the tolerance, either side, is measured again over
# RECHECK_SCALE times the window, up to PROFILE_MAX_SCALE times it. The standard error is
# that of the pile: the swing of the model's in-flight calls over the window (sampled at
# FOLLOW_SAMPLES times), at both of its ends, in the pile's units (x n/p per request). Measured (simulated): beam's 1B generator at
# nominal 62-87 calls/s read shortfalls of 6-12% and 1% in turn over 300-request windows
# (in-flight swings of ~20 calls, ~4% of a window's requests once x n/p), and the profile
# capped at 75.9 calls/s while one replica in the allocations sustained ~88.
FOLLOW_Z = 2.0
FOLLOW_SAMPLES = 41
PROFILE_MAX_SCALE = 4.0
# And (``ProfileJob.fill_latencies``, the accuracy bench's full run) a point judged overloaded
# whose warm-up held fewer than FILL_LATENCIES of the workflow's own request latencies is
# measured again with a warm-up that long (up to FILL_MAX_SCALE x the window), when the fill
# could explain its shortfall: the workflow's in-flight requests still filling, a pile of at
# most one request latency over the window (x n/p per request, as above). It stands when a
# longer run fell further behind (a growing backlog). Measured (simulated): beam's 1B
# generator at a 0.5 share read 27% short at 42.5 calls/s per copy over the 138 s window
# (warm-up 28 s) and kept up, at 44.1, over 4x that; the profile had capped at 37.9 calls/s
# while the allocations' copies sustained ~47. Its noise (``follow_se``) does not see this:
# the fill is a bias, not a swing.
FILL_LATENCIES = 3.0
FILL_MAX_SCALE = 8.0


class ProfiledWorkflow(Protocol):
    """What a profile runs the model in: a workflow of ``sim.workflows`` with its parameters,
    on one GPU type (the accuracy bench's cases carry more, read elsewhere)."""

    @property
    def workflow(self) -> str: ...  # "beam" | "rag" | "fanout"

    @property
    def params(self) -> WorkflowParams: ...

    @property
    def gpu(self) -> str: ...


@dataclass(frozen=True)
class WorkflowSetup:
    """The plain :class:`ProfiledWorkflow`."""

    workflow: str
    params: WorkflowParams
    gpu: str


@dataclass(frozen=True)
class ProfileJob:
    """One profile: ``model`` at ``(tp, share)`` inside ``case``, and how to sweep it."""

    case: ProfiledWorkflow
    model: str
    tp: int
    share: float
    n_per_request: float  # calls of ``model`` per workflow request (from stats)
    target_calls: int  # calls of the model each point should measure
    start_rate: float  # calls/s of the first (light-load) point
    refine: tuple[float, ...] = REFINE
    precision: float = 0.04  # bisect the saturation bracket down to this relative width
    max_doublings: int = 12
    min_requests: int = 0  # workflow requests each point's window holds at least
    # refining points run longer (up to 8x) until their mean latency's batch-means standard
    # error is below this fraction of it; 0: one run each
    latency_se: float = 0.0
    # calls of the model a request runs at once (stats' p); None: judge calls alone, as if
    # every call were independent
    parallel: float | None = None
    # re-measure a verdict within this many standard errors of the tolerance (``uncertain``),
    # over longer windows up to ``max_scale`` x; None: only a marginal overload, once
    follow_z: float | None = None
    max_scale: float = RECHECK_SCALE
    # re-measure an overload that the workflow's fill could explain with a warm-up of this
    # many of its request latencies (``refill_scale``); 0: off
    fill_latencies: float = 0.0
    # measure the share alone on its GPU (no co-located copies): the other end of what
    # neighbours cost, which the optimizer blends by how busy a placement's neighbours are
    alone: bool = False


def colocated(share: float) -> int:
    """Replicas of one share that fill a GPU: a fractional share is profiled next to busy
    copies of itself, since an allocation packs fractions onto shared GPUs and co-located
    replicas contend for HBM bandwidth (``sim.cluster``): the points' ``"packed"``."""
    return packed_copies(share)


def keeps_up(offered: float, achieved: float) -> bool:
    """The engine (or workflow) kept up: completions within ``FOLLOW_TOLERANCE`` of arrivals
    over the same window, i.e. no backlog growing at more than that fraction of the rate."""
    return achieved >= (1.0 - FOLLOW_TOLERANCE) * offered


def bracket(
    probe: Callable[[float], bool],
    start: float,
    factor: float,
    precision: float,
    max_expansions: int = 12,
) -> tuple[float, float]:
    """``(lo, hi)``: the largest probed rate that kept up (0 if none) and the smallest that did
    not (``inf`` if none). Steps from ``start`` by ``factor`` until the outcome flips, then
    bisects geometrically until ``hi / lo <= 1 + precision``. Assumes keeping up is monotone
    in the rate (noise near capacity can break that; the bracket is then still a bracket of
    probed outcomes)."""
    lo, hi = 0.0, math.inf
    rate = start
    for _ in range(max_expansions):
        if probe(rate):
            lo = rate
            if hi < math.inf:
                break
            rate *= factor
        else:
            hi = rate
            if lo > 0:
                break
            rate /= factor
    while lo > 0 and hi < math.inf and hi / lo > 1.0 + precision:
        mid = math.sqrt(lo * hi)
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


@dataclass(frozen=True)
class Reading:
    """One measured point, with the standard errors that say how far to trust it."""

    point: ProfilePoint
    latency_rel_se: float  # batch-means standard error of the mean latency, relative to it
    # standard error of the shortfall (1 - throughput / offered) the keep-up test reads;
    # nan where the measurement cannot tell (the recheck then falls back to ``marginal``)
    follow_se: float = math.nan
    scale: float = 1.0  # of the job's window, this reading's
    warmup_s: float = math.nan
    window_s: float = math.nan
    fill_s: float = math.nan  # the workflow's mean request latency: its in-flight fill time

    @property
    def shortfall(self) -> float:
        return 1.0 - self.point.throughput / max(self.point.offered_rate, 1e-12)


def _inflight_swing(mine: Sequence[SimCall], lo: float, hi: float) -> float:
    """Standard deviation of the model's calls in flight, sampled across ``[lo, hi]``."""
    starts = np.sort(np.array([c.t_start for c in mine]))
    ends = np.sort(np.array([c.t_end for c in mine]))
    grid = np.linspace(lo, hi, FOLLOW_SAMPLES)
    inflight = np.searchsorted(starts, grid, "right") - np.searchsorted(ends, grid, "right")
    return float(np.std(inflight, ddof=1))


def _point(job: ProfileJob, call_rate: float, seed: int, scale: float = 1.0) -> Reading:
    """One rate: ``colocated(share)`` replicas on one GPU, each offered ``call_rate``, behind
    the simulator's default router (as an allocation's replicas are: prefix locality is lost
    the same way; the queueing is pooled over the co-located copies, which the pipeline's
    pooling correction then counts again, slightly under-predicting their latency)."""
    case = job.case
    k = 1 if job.alone else colocated(job.share)
    specs = [ReplicaSpec(job.model, case.gpu, job.tp, job.share, k)]
    specs += [
        ReplicaSpec(m, case.gpu, 1, 1.0, OVERPROVISION)
        for m in models_of(case.params)
        if m != job.model
    ]
    wf_rate = k * call_rate / job.n_per_request
    duration = scale * max(job.target_calls / call_rate, job.min_requests / wf_rate)
    warmup = 0.2 * duration
    res = simulate(
        Allocation(tuple(specs)),
        [WorkloadSpec(case.workflow, wf_rate, case.params)],  # type: ignore[arg-type]
        duration_s=duration,
        warmup_s=warmup,
        drain_s=0.5 * duration,
        record_calls=True,
        seed=seed,
    )
    end = res.window_s[1]
    span = k * max(end - warmup, 1e-9)
    mine = [c for c in res.calls if c.call.model == job.model]
    started = sorted((c for c in mine if warmup <= c.t_start < end), key=lambda c: c.t_start)
    finished = sum(1 for c in mine if warmup <= c.t_end <= end)
    lat = np.array([c.t_end - c.t_start for c in started]) if started else np.array([np.inf])
    ttft = [c.t_first - c.t_start for c in started if c.t_first >= 0]
    p50, p90, p99 = np.percentile(lat, [50, 90, 99])
    # calls piled up at this model per call sent, then per request arriving (see above)
    pile = max(0.0, 1.0 - finished / max(len(started), 1))
    per_request = job.n_per_request / max(job.parallel, 1.0) if job.parallel is not None else 1.0
    pile = min(pile * per_request, 0.99)
    # the pile is the change of calls in flight over the window: its noise is their swing
    # at both ends, in the same units
    pile_se = (
        (math.sqrt(2.0) * _inflight_swing(mine, warmup, end) / max(len(started), 1) * per_request)
        if len(mine) > 1
        else math.nan
    )
    point = ProfilePoint(
        model=job.model,
        engine=ENGINE,
        gpu_type=case.gpu,
        tp=job.tp,
        share=job.share,
        # offered: the calls the workflow actually submitted in the window (bursty workflows
        # stray far from the nominal rate over a short run), or for a dependency-bound
        # workflow the rate whose shortfall is the share of arriving requests piling up here
        offered_rate=max(len(started), finished / (1.0 - pile)) / span,
        throughput=finished / span,
        lat_mean=float(lat.mean()),
        lat_p50=float(p50),
        lat_p90=float(p90),
        lat_p99=float(p99),
        ttft_mean=float(np.mean(ttft)) if ttft else 0.0,
        n_calls=len(started),
        colocation="alone" if k == 1 else "packed",
        # as an engine's usage reports them: every input's output (0 for embed and rerank)
        completion_tokens=(
            float(np.mean([c.call.output_tokens * len(c.call.inputs) for c in started]))
            if started
            else -1.0
        ),
    )
    se = (
        float(np.std([b.mean() for b in np.array_split(lat, 10)], ddof=1) / math.sqrt(10))
        if len(lat) >= 20
        else math.inf
    )
    wf = res.workflows[case.workflow]
    return Reading(
        point,
        se / max(point.lat_mean, 1e-12),
        pile_se,
        scale,
        warmup,
        end - warmup,
        wf.latency.mean if wf.completed else math.inf,
    )


Measure = Callable[[ProfileJob, float, int, float], Reading]


def marginal(offered: float, achieved: float) -> bool:
    """Judged overloaded, but by a shortfall that in-flight swings can explain."""
    return not keeps_up(offered, achieved) and achieved >= (1.0 - MARGINAL_SHORTFALL) * offered


def uncertain(reading: Reading, z: float | None = FOLLOW_Z) -> bool:
    """A verdict the point's own noise could flip: its shortfall lies within ``z`` standard
    errors of the tolerance, either side (``z`` None, or no standard error: ``marginal``)."""
    p = reading.point
    if z is None or not math.isfinite(reading.follow_se):
        return marginal(p.offered_rate, p.throughput)
    shortfall = 1.0 - p.throughput / max(p.offered_rate, 1e-12)
    return abs(shortfall - FOLLOW_TOLERANCE) < z * reading.follow_se


def refill_scale(r: Reading, latencies: float, previous: Reading | None = None) -> float | None:
    """The scale to measure an overloaded reading ``r`` again at, when its warm-up held fewer
    than ``latencies`` workflow request latencies and that fill could explain its shortfall
    (``FILL_LATENCIES``' comment); None when the verdict stands (``latencies`` 0: off)."""
    p = r.point
    if latencies <= 0 or keeps_up(p.offered_rate, p.throughput) or not math.isfinite(r.fill_s):
        return None
    if previous is not None and r.shortfall >= previous.shortfall:
        return None  # fell further behind over a longer run: a backlog
    if r.shortfall > r.fill_s / r.window_s:  # more than a fill can pile up
        return None
    scale = min(FILL_MAX_SCALE, r.scale * latencies * r.fill_s / r.warmup_s)
    return scale if scale > 1.05 * r.scale else None


def decide(run: Callable[[float], tuple[bool, bool]], max_scale: float = RECHECK_SCALE) -> bool:
    """Kept up? ``run(scale)`` measures over ``scale`` x the window and says (kept up, worth
    measuring again); such a verdict is replaced by one over ``RECHECK_SCALE`` x the window,
    and so on up to ``max_scale`` x it (by default: once)."""
    scale = 1.0
    ok, again = run(scale)
    while again and scale * RECHECK_SCALE <= max_scale + 1e-9:
        scale *= RECHECK_SCALE
        ok, again = run(scale)
    return ok


def run_profile(job: ProfileJob, measure: Measure | None = None) -> list[ProfilePoint]:
    """Double the rate from light load until the replica stops keeping up, bisect to
    ``job.precision``, then add points below the saturation estimate for the latency curve.
    A probe whose verdict its noise could flip (``uncertain``) is re-measured over longer
    windows, up to ``job.max_scale``, and an overload that the workflow's own fill could
    explain with a longer warm-up (``refill_scale``, ``job.fill_latencies``); the last
    reading decides and is the one kept (a superseded short window would cap or inflate the
    profile). ``measure``: the point
    measurement (default: the simulator)."""
    point = measure or _point
    points: list[ProfilePoint] = []
    seeds = itertools.count(1000)

    def probe(rate: float) -> bool:
        readings: list[Reading] = []

        def run(scale: float) -> tuple[bool, bool]:
            r = point(job, rate, next(seeds), scale)
            readings.append(r)
            return (keeps_up(r.point.offered_rate, r.point.throughput), uncertain(r, job.follow_z))

        ok = decide(run, job.max_scale)
        previous: Reading | None = None
        while (
            not ok
            and (again := refill_scale(readings[-1], job.fill_latencies, previous)) is not None
        ):
            previous = readings[-1]
            ok, _ = run(again)
        points.append(readings[-1].point)
        return ok

    bracket(probe, job.start_rate, 2.0, job.precision, job.max_doublings)
    kept = [p.throughput for p in points if keeps_up(p.offered_rate, p.throughput)]
    saturation = max(kept, default=points[0].throughput)
    for k, frac in enumerate(job.refine):
        target = frac * saturation
        if any(abs(p.offered_rate - target) < 0.05 * target for p in points):
            continue
        scale = 1.0
        refined = point(job, target, 2000 + k, scale)
        while job.latency_se > 0 and refined.latency_rel_se > job.latency_se and scale < 8:
            scale = min(
                8.0, max(2 * scale, scale * 1.3 * (refined.latency_rel_se / job.latency_se) ** 2)
            )
            refined = point(job, target, 2000 + k, scale)
        points.append(refined.point)
    return sorted(points, key=lambda p: p.offered_rate)

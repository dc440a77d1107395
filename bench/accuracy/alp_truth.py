"""The ALP accuracy bench's ground truth: an allocation's simulated max throughput and mean
latency (``sim.des``; every figure here is *simulated*).

Role: ``evaluate(job)`` measures one allocation of a ``bench.accuracy.cases.Case`` at one rate
(a latency job) or finds its maximum throughput (a capacity job); ``bench.accuracy.alp_accuracy``
compares them with the pipeline's predictions.

Invariants: every run of a job uses the job's seed, so a longer run extends the same
arrivals; a run's measurement window starts after a warm-up and holds a number of request
latencies that the run checks on itself (``bench.run_length.stretch``, ``next_latency_run``): near capacity a
batching engine's in-flight count fills for many request latencies, and a window shorter than
that reads the fill as a backlog (throughput) or as a lighter load (latency), and a
standard error from batches shorter than a queue's excursions under-reads
(``latency_batches``); a latency point's value is the mean of independent runs at further
seeds (``replicate``), its standard error their spread.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from bench.accuracy.cases import Alloc, Case
from bench.run_length import CAP_STRETCHES, Window, stretch
from optimizer.model.alp import ModelAlloc
from sim.cluster import Allocation, ReplicaSpec
from sim.des import WorkloadSpec, simulate, simulate_requests
from sim.profiling import bracket, decide, keeps_up, marginal

# Max throughput: the largest workflow rate the allocation keeps up with (completions within
# 5% of arrivals over a long window), bracketed around the prediction by steps of CAP_STEP
# and bisected to CAP_PRECISION. A single overloaded run would not do: latency in overload
# is the running batch over the throughput (~40 s for RAG on one A6000), longer than a short
# window, and a prefix-sharing workflow's throughput sinks in sustained overload as its
# prefix cache thrashes (hit rate 0.78 -> 0.53 for beam's verifier).
CAP_STEP, CAP_PRECISION, CAP_PRECISION_QUICK = 1.1, 0.03, 0.1
CAP_WARMUP = 0.4  # of the measured window, run before it
# The simulated max throughput is the most the allocation completed per second: over a probe
# that kept up (its completions, not its nominal rate: the 5% tolerance would otherwise let a
# rate up to 5% past capacity count), or under a standing backlog at CAP_BACKLOG x the
# smallest overloaded rate. Near capacity (rho > 0.9) the queue's random walk outlasts any
# affordable window: RAG 2x0.5 encoders + 2 generators at 11.6 req/s read 8.2-10.4 completions
# per second over 1400 requests (the last quarter's latency 21 s) yet 11.9-12.0 over 4000, and
# a backlog at 14 req/s completed 12.4-12.6 per second (ALP: 12.2). A backlogged beam search
# thrashes its prefix caches and completes less (1x1 at 1.7 req/s: 1.15-1.38 per second,
# while it kept up at 1.5 over 1200 requests), hence the larger of the two.
CAP_BACKLOG = 1.25
# Latency runs grow until the standard error of the mean is below LATENCY_SE (relative), at
# most LATENCY_GROWTH_CAP times the case's eval_requests; and until their warm-up holds
# LATENCY_WARMUP_LATENCIES mean latencies and their window LATENCY_WINDOW_LATENCIES, at most
# LATENCY_MAX_REQUESTS requests. A short run's batch means are correlated and its standard
# error under-reads: beam (1B + TP2 verifier) at 1.88 req/s stopped at 200 requests (window
# 4 latencies) with a mean of 25.1 s +-3%, while 2,000 requests (28 latencies) read 34.7 s.
# With the check on, the standard error's batches span LATENCY_BATCH_LATENCIES mean
# latencies each (the window holds five of them): near capacity a queue's excursions last
# several latencies, and fan-out (1B + TP2 8B) at 80% load read 9.21 / 9.99 / 11.47 /
# 10.47 s across seeds and lengths with 25-latency windows, each "+-2.5%" from batches of
# ~2.5 latencies. Simulated.
LATENCY_SE, LATENCY_SE_QUICK, LATENCY_GROWTH_CAP = 0.03, 0.05, 8
LATENCY_WARMUP_LATENCIES, LATENCY_WINDOW_LATENCIES = 3.0, 50.0
LATENCY_BATCH_LATENCIES, LATENCY_BATCHES = 10.0, 10
LATENCY_MAX_REQUESTS = 20_000
# A latency point is then measured again over independent seeds at the same length (at least
# LATENCY_REPLICATIONS runs, more while their spread says the mean is imprecise, at most
# LATENCY_MAX_REPLICATIONS): its value is the runs' mean, its standard error their spread.
# The run-length rule above sizes a run by the mean it has read so far, so a run that happens
# to read low looks long enough and stops there, and its batch means under-read the spread
# between runs. Stop 17's full run: RAG (1 x TP2 generator) at 80% load read 3.50 s over
# 2,400 requests "+-7%", while 4 seeds x 20,000 requests read 4.41 +- 0.02 s; fan-out (1B +
# TP2 8B) read 9.48 s against 10.45 +- 0.07 s. Seeds are the job's plus multiples of
# REPLICATION_SEED_STRIDE (bench.accuracy.alp_seeds replicates with the same ones). Simulated.
LATENCY_REPLICATIONS, LATENCY_MAX_REPLICATIONS, REPLICATION_SEED_STRIDE = 3, 6, 1000


@dataclass(frozen=True)
class EvalJob:
    case: Case
    alloc_index: int
    fraction: float  # of predicted capacity (capacity jobs: where the bracket starts)
    kind: str  # "latency" | "capacity"
    rate: float
    seed: int
    settle_s: float  # a few light-load request latencies: the pipeline's fill time
    precision: float = CAP_PRECISION
    latency_se: float = LATENCY_SE
    # run-length checks in request latencies (0: off, the quick run's fixed windows)
    cap_stretches: int = CAP_STRETCHES
    latency_window_latencies: float = LATENCY_WINDOW_LATENCIES
    replications: int = LATENCY_REPLICATIONS  # independent latency runs (1: the pilot only)


def sim_allocation(case: Case, alloc: Alloc) -> Allocation:
    return allocation_on(alloc, case.gpu)


def allocation_on(alloc: Alloc, gpu: str) -> Allocation:
    """``alloc`` as the simulator's allocation on ``gpu`` GPUs."""
    return Allocation(
        tuple(
            ReplicaSpec(m, gpu, tp, share, d)
            for m, row in alloc.items()
            for d, tp, share in ModelAlloc(*row).groups
        )
    )


def capacity_window(job: EvalJob, rate: float, warmup_s: float, window_s: float) -> Window:
    """One run of the job's allocation at ``rate`` (the same seeded arrivals at every rate)."""
    case = job.case
    spec = [WorkloadSpec(case.workflow, rate, case.params)]  # type: ignore[arg-type]
    res = simulate(
        sim_allocation(case, case.allocations[job.alloc_index]),
        spec,
        duration_s=warmup_s + window_s,
        warmup_s=warmup_s,
        drain_s=0.0,
        seed=job.seed,
    )
    wf = res.workflows[case.workflow]
    lo, hi = res.window_s
    latency = wf.latency.mean if wf.completed else math.inf
    return Window(wf.started / (hi - lo), wf.throughput, latency, warmup_s, hi - lo)


def keeps_up_at(
    job: EvalJob,
    rate: float,
    scale: float = 1.0,
    warmup_share: float = CAP_WARMUP,
    run: Callable[[EvalJob, float, float, float], Window] = capacity_window,
) -> tuple[bool, bool, float]:
    """Did the workflow keep up at ``rate`` over ``scale`` x the case's window (completions
    within ``FOLLOW_TOLERANCE`` of arrivals), was a shortfall marginal
    (``sim.profiling.marginal``), and its completions per second. An overloaded verdict
    from a run too short for its latency is measured again (``stretch``), at most
    ``job.cap_stretches`` times; the last run decides."""
    window = scale * job.case.capacity_requests / rate
    # near capacity the in-flight count climbs for minutes before its plateau
    w = run(job, rate, max(job.settle_s, warmup_share * window), window)
    previous: Window | None = None
    for _ in range(job.cap_stretches):
        longer = stretch(w, previous)
        if longer is None:
            break
        previous, w = w, run(job, rate, *longer)
    return keeps_up(w.offered, w.achieved), marginal(w.offered, w.achieved), w.achieved


def mean_and_se(values: Sequence[float], batches: int = LATENCY_BATCHES) -> tuple[float, float]:
    """Mean and its batch-means standard error (values in arrival order: batches of
    consecutive requests absorb their correlation)."""
    a = np.asarray(values, dtype=np.float64)
    if len(a) < 2 * batches:
        return float(a.mean()) if len(a) else math.nan, math.inf
    means = np.array([b.mean() for b in np.array_split(a, batches)])
    return float(a.mean()), float(means.std(ddof=1) / math.sqrt(batches))


@dataclass(frozen=True)
class LatencyRun:
    n: int  # arrivals, warm-up included
    warmup_s: float
    mean: float
    se: float
    completed: int
    failed: int


def latency_run(job: EvalJob, n: int, warmup_s: float) -> LatencyRun:
    """Mean latency of ``n`` arrivals at the job's rate, after ``warmup_s``."""
    case = job.case
    spec = [WorkloadSpec(case.workflow, job.rate, case.params)]  # type: ignore[arg-type]
    res, spans = simulate_requests(
        sim_allocation(case, case.allocations[job.alloc_index]),
        spec,
        n_requests=n,
        warmup_s=warmup_s,
        seed=job.seed,
    )
    lo, hi = res.window_s
    measured = [s for s in spans if lo <= s.arrival < hi]
    lat = [s.end - s.arrival for s in measured if s.end >= 0 and not s.failed]
    mean, se = mean_and_se(
        lat, latency_batches(job, hi - lo, float(np.mean(lat)) if lat else math.nan)
    )
    return LatencyRun(n, warmup_s, mean, se, len(lat), len(measured) - len(lat))


def latency_batches(job: EvalJob, window_s: float, mean: float) -> int:
    """How many batches a latency run's standard error takes: ``LATENCY_BATCHES``, or with
    the run-length check as many of ``LATENCY_BATCH_LATENCIES`` x the ``mean`` latency as the
    window holds (at least 2: a window that holds fewer grows, ``next_latency_run``)."""
    if job.latency_window_latencies <= 0 or not math.isfinite(mean) or mean <= 0:
        return LATENCY_BATCHES
    return max(2, min(LATENCY_BATCHES, int(window_s / (LATENCY_BATCH_LATENCIES * mean))))


def latency_warmup(job: EvalJob, n: int, mean: float) -> float:
    """The warm-up of an ``n``-arrival latency run: the pipeline's fill at light load, a
    tenth of the run, and (with the run-length check) ``LATENCY_WARMUP_LATENCIES`` x the
    ``mean`` latency a shorter run measured (NaN or inf: none measured yet)."""
    warmup = max(job.settle_s, 0.1 * n / job.rate)
    if job.latency_window_latencies > 0 and math.isfinite(mean):
        warmup = max(warmup, LATENCY_WARMUP_LATENCIES * mean)
    return warmup


def next_latency_run(job: EvalJob, r: LatencyRun) -> int | None:
    """Arrivals of the next, longer run, or None when ``r`` is precise enough: its standard
    error under ``job.latency_se`` of its mean (growing up to ``LATENCY_GROWTH_CAP`` x the
    case's requests), and warm-up and window long enough for that mean (growing up to
    ``LATENCY_MAX_REQUESTS``). A run shorter than its warm-up measures nothing (NaN mean):
    it grows. Every next run is longer, so the sequence ends."""
    cap = job.case.eval_requests * LATENCY_GROWTH_CAP
    n = r.n
    if not r.se <= job.latency_se * r.mean and r.n < cap:
        # the standard error shrinks as 1/sqrt(n): aim a little past the target
        grow = (r.se / (job.latency_se * r.mean)) ** 2 if math.isfinite(r.se) else 4.0
        n = min(cap, max(2 * n, math.ceil(n * 1.3 * grow)))
    if job.latency_window_latencies > 0 and math.isfinite(r.mean):
        window_s = r.n / job.rate - r.warmup_s
        if (
            r.warmup_s < 0.95 * LATENCY_WARMUP_LATENCIES * r.mean
            or window_s < 0.95 * job.latency_window_latencies * r.mean
        ):
            needed = job.rate * (LATENCY_WARMUP_LATENCIES + job.latency_window_latencies) * r.mean
            n = max(n, min(LATENCY_MAX_REQUESTS, math.ceil(1.1 * needed)))
    return n if n > r.n else None


def replication_seed(job: EvalJob, k: int) -> int:
    """The seed of a latency point's ``k``-th run (0: the job's own, the pilot)."""
    return job.seed + REPLICATION_SEED_STRIDE * k


def across_seeds(means: Sequence[float]) -> tuple[float, float]:
    """The mean of independent replications' means and its standard error from their
    spread (``inf`` from fewer than two)."""
    a = np.asarray(means, dtype=np.float64)
    se = float(a.std(ddof=1) / math.sqrt(len(a))) if len(a) > 1 else math.inf
    return float(a.mean()), se


def across_runs(runs: Sequence[LatencyRun]) -> tuple[float, float]:
    """Mean latency over independent runs of one point and its standard error from their
    spread (one run: its own batch-means estimate)."""
    if len(runs) == 1:
        return runs[0].mean, runs[0].se
    return across_seeds([r.mean for r in runs])


def replicate(
    job: EvalJob,
    pilot: LatencyRun,
    run: Callable[[EvalJob, int, float], LatencyRun] = latency_run,
) -> list[LatencyRun]:
    """The pilot and its replications: runs of the pilot's length and warm-up at further
    seeds, ``job.replications`` of them in all, more while their spread puts the standard
    error over ``job.latency_se`` of their mean, at most ``LATENCY_MAX_REPLICATIONS``."""
    runs = [pilot]
    while job.replications > 1 and len(runs) < LATENCY_MAX_REPLICATIONS:
        mean, se = across_runs(runs)
        if len(runs) >= job.replications and se <= job.latency_se * mean:
            break
        runs.append(
            run(replace(job, seed=replication_seed(job, len(runs))), pilot.n, pilot.warmup_s)
        )
    return runs


def simulated_capacity(probes: Sequence[tuple[float, bool, float]], backlog: float) -> float:
    """The most completed per second (``CAP_BACKLOG``'s comment): over the probes
    ``(rate, kept up, completions/s)`` that kept up, or under the standing ``backlog``."""
    return max([achieved for _, ok, achieved in probes if ok] + [backlog])


def evaluate(job: EvalJob) -> dict[str, Any]:
    """A capacity job's simulated max throughput with its probes, or a latency job's mean."""
    started = time.perf_counter()
    if job.kind == "capacity":
        probes: list[tuple[float, bool, float]] = []

        def probe(rate: float) -> bool:
            def run(scale: float) -> tuple[bool, bool]:
                ok, close, achieved = keeps_up_at(job, rate, scale)
                probes.append((rate, ok, achieved))
                return ok, close

            # as the profiles do: a longer window decides a marginal shortfall
            return decide(run)

        lo, hi = bracket(probe, job.rate, CAP_STEP, job.precision)
        # What a standing backlog completes: past a stable rate, not drained or refilled
        # (a continuous-batching engine fills its batch before its completions reach their
        # backlogged rate: RAG's generator completed 3.6 req/s over its first minute at 14)
        # (no stretches: a backlog's shortfall is the point)
        past = CAP_BACKLOG * (hi if math.isfinite(hi) else lo)
        _, _, backlog = keeps_up_at(replace(job, cap_stretches=0), past, warmup_share=1.0)
        return {
            "capacity": simulated_capacity(probes, backlog),
            "kept_up_at": lo,
            "overloaded_at": hi,
            "backlog_throughput": backlog,
            "probes": probes,
            "wall_s": time.perf_counter() - started,
        }
    r = latency_run(
        job, job.case.eval_requests, latency_warmup(job, job.case.eval_requests, math.nan)
    )
    while (n := next_latency_run(job, r)) is not None:
        r = latency_run(job, n, latency_warmup(job, n, r.mean))
    runs = replicate(job, r)
    mean, se = across_runs(runs)
    return {
        "latency_mean": mean,
        "latency_se": se,
        "requests": sum(x.n for x in runs),
        "run_requests": r.n,
        "replication_means": [x.mean for x in runs],
        "warmup_s": r.warmup_s,
        "completed": sum(x.completed for x in runs),
        "failed": sum(x.failed for x in runs),
        "wall_s": time.perf_counter() - started,
    }

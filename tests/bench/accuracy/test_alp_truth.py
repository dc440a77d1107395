"""The accuracy bench's ground truth checks its runs' lengths against their own latency."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest

from bench.accuracy.alp_accuracy import _cases
from bench.accuracy.alp_truth import (
    LATENCY_BATCHES,
    LATENCY_MAX_REPLICATIONS,
    LATENCY_MAX_REQUESTS,
    LATENCY_REPLICATIONS,
    LATENCY_WARMUP_LATENCIES,
    LATENCY_WINDOW_LATENCIES,
    EvalJob,
    LatencyRun,
    across_runs,
    keeps_up_at,
    latency_batches,
    mean_and_se,
    next_latency_run,
    replicate,
    replication_seed,
)
from bench.run_length import (
    CAP_STRETCHES,
    CAP_WARMUP_LATENCIES,
    CAP_WINDOW_LATENCIES,
    Window,
    stretch,
)

pytestmark = pytest.mark.timeout(30)

Run = Callable[[EvalJob, float, float, float], Window]


def _job(kind: str = "capacity", rate: float = 10.0, **kw: float) -> EvalJob:
    case = replace(_cases()[2], capacity_requests=1000, eval_requests=200)
    return EvalJob(case, 0, 1.0, kind, rate, seed=1, settle_s=5.0, **kw)  # type: ignore[arg-type]


def test_a_short_overloaded_window_is_stretched_to_its_latency() -> None:
    w = Window(offered=10.0, achieved=9.0, latency_s=20.0, warmup_s=40.0, window_s=100.0)
    assert stretch(w, None) == (CAP_WARMUP_LATENCIES * 20.0, CAP_WINDOW_LATENCIES * 20.0)
    # kept up: stands, however short
    assert stretch(replace(w, achieved=9.9), None) is None
    # long enough for its latency: the overload stands
    long = replace(w, warmup_s=CAP_WARMUP_LATENCIES * 20.0, window_s=CAP_WINDOW_LATENCIES * 20)
    assert stretch(long, None) is None
    # a shortfall that grew over the longer run is a growing backlog, not fill
    assert stretch(w, replace(w, achieved=9.2)) is None
    assert stretch(w, replace(w, achieved=8.0)) is not None


def _filling(
    latency_s: float, tau_s: float, drift: float = 0.0
) -> tuple[Run, list[tuple[float, float]]]:
    """A fake run: a stable system whose in-flight count fills as 1 - exp(-t / tau) towards
    rate x latency, so a window completes its arrivals less that fill (and less ``drift``
    of them: an overload)."""
    calls: list[tuple[float, float]] = []

    def run(job: EvalJob, rate: float, warmup_s: float, window_s: float) -> Window:
        calls.append((warmup_s, window_s))
        q = rate * latency_s
        fill = q * (math.exp(-warmup_s / tau_s) - math.exp(-(warmup_s + window_s) / tau_s))
        achieved = rate * (1.0 - drift) - fill / window_s
        return Window(
            rate,
            achieved,
            latency_s * (1 + drift * (warmup_s + window_s) / 100),
            warmup_s,
            window_s,
        )

    return run, calls


def test_a_filling_pipeline_is_judged_kept_up_once_the_window_fits_its_latency() -> None:
    job = _job(rate=20.0)
    run, calls = _filling(latency_s=15.0, tau_s=30.0)
    ok, _, achieved = keeps_up_at(replace(job, cap_stretches=0), 20.0, run=run)
    assert not ok  # the fixed 1,000-request window reads the fill as a backlog
    ok, _, achieved = keeps_up_at(job, 20.0, run=run)
    assert ok and achieved == pytest.approx(20.0, rel=0.05)
    assert calls[-1] == (CAP_WARMUP_LATENCIES * 15.0, CAP_WINDOW_LATENCIES * 15.0)


def test_an_overload_stays_an_overload_and_stops_stretching() -> None:
    job = _job(rate=20.0)
    run, calls = _filling(latency_s=15.0, tau_s=30.0, drift=0.15)
    ok, _, achieved = keeps_up_at(job, 20.0, run=run)
    assert not ok and achieved < 0.9 * 20.0
    assert 2 <= len(calls) <= 1 + CAP_STRETCHES


def test_latency_runs_grow_to_hold_their_own_latency() -> None:
    job = _job("latency", rate=2.0, latency_se=0.03)
    # precise (1%) but its window holds 4 latencies of 25 s: grows to fit 3 + 25 of them
    short = LatencyRun(n=200, warmup_s=40.0, mean=25.0, se=0.25, completed=150, failed=0)
    n = next_latency_run(job, short)
    needed = 2.0 * (LATENCY_WARMUP_LATENCIES + LATENCY_WINDOW_LATENCIES) * 25.0
    assert n is not None and n >= needed
    # long and precise enough: done
    assert next_latency_run(job, replace(short, n=n, warmup_s=80.0)) is None
    # the quick run's fixed windows: precise is enough
    assert next_latency_run(replace(job, latency_window_latencies=0.0), short) is None
    # imprecise: grows as before, by the standard error
    noisy = replace(short, se=2.5)
    quick = next_latency_run(replace(job, latency_window_latencies=0.0), noisy)
    assert quick is not None and quick > short.n
    # bounded: a latency too long for the cap stops at LATENCY_MAX_REQUESTS
    huge = replace(short, mean=1e4, se=1.0)
    assert next_latency_run(job, huge) == LATENCY_MAX_REQUESTS
    assert next_latency_run(job, replace(huge, n=LATENCY_MAX_REQUESTS)) is None
    # nothing measured yet (the run was shorter than its warm-up): grows
    empty = LatencyRun(n=200, warmup_s=400.0, mean=math.nan, se=math.inf, completed=0, failed=0)
    grown = next_latency_run(job, empty)
    assert grown is not None and grown > 200


def test_standard_error_batches_span_several_latencies_when_runs_check_their_length() -> None:
    job = _job("latency", rate=2.0)
    # a window of 50 latencies of 10 s: five batches of ten latencies each
    assert latency_batches(job, 500.0, 10.0) == 5
    # short windows still give an estimate (they grow: next_latency_run), long ones cap out
    assert latency_batches(job, 50.0, 10.0) == 2
    assert latency_batches(job, 1e6, 10.0) == LATENCY_BATCHES
    # the quick run's fixed windows, or no latency measured: the fixed count
    assert (
        latency_batches(replace(job, latency_window_latencies=0.0), 500.0, 10.0) == LATENCY_BATCHES
    )
    assert latency_batches(job, 500.0, math.nan) == LATENCY_BATCHES


def test_long_batches_read_a_correlated_series_honestly() -> None:
    # An AR(1) series whose correlation lasts ~200 values: batches of 50 (a queue's
    # excursions outlasting the batch) claim a precision its mean does not have; five
    # batches of 1,000 read the spread of the mean across independent series.
    rng = np.random.default_rng(3)
    phi, n = 0.99, 5000
    means, short_se, long_se = [], [], []
    for _ in range(60):
        noise = rng.normal(size=n)
        x = np.empty(n)
        x[0] = noise[0] / math.sqrt(1 - phi * phi)
        for i in range(1, n):
            x[i] = phi * x[i - 1] + noise[i]
        means.append(x.mean())
        short_se.append(mean_and_se(list(x + 100.0), n // 50)[1])
        long_se.append(mean_and_se(list(x + 100.0), 5)[1])
    true_se = float(np.std(means, ddof=1))
    assert float(np.median(long_se)) == pytest.approx(true_se, rel=0.4)
    assert float(np.median(short_se)) < 0.7 * true_se


def _fake_runs(
    means: dict[int, float],
) -> tuple[Callable[[EvalJob, int, float], LatencyRun], list[tuple[int, int, float]]]:
    """A latency run that reads ``means[seed]`` (precise by its own batch means), and the
    (seed, arrivals, warm-up) it was asked for."""
    calls: list[tuple[int, int, float]] = []

    def run(job: EvalJob, n: int, warmup_s: float) -> LatencyRun:
        calls.append((job.seed, n, warmup_s))
        return LatencyRun(n, warmup_s, means[job.seed], 0.001, n - 10, 0)

    return run, calls


def test_a_latency_point_is_the_mean_of_independent_runs_at_the_pilots_length() -> None:
    job = _job("latency", rate=2.0, latency_se=0.03)
    pilot = LatencyRun(n=2400, warmup_s=30.0, mean=3.5, se=0.1, completed=2100, failed=0)
    # runs that agree to ~1%: the pilot and LATENCY_REPLICATIONS - 1 more, at other seeds
    agree = {replication_seed(job, k): 4.4 + 0.01 * k for k in range(1, 10)}
    run, calls = _fake_runs(agree)
    runs = replicate(job, replace(pilot, mean=4.4), run)
    assert len(runs) == LATENCY_REPLICATIONS
    assert [c[0] for c in calls] == [job.seed + 1000 * k for k in range(1, LATENCY_REPLICATIONS)]
    assert all(n == 2400 and w == 30.0 for _, n, w in calls)
    mean, se = across_runs(runs)
    assert mean == pytest.approx(np.mean([r.mean for r in runs]))
    assert se == pytest.approx(np.std([r.mean for r in runs], ddof=1) / math.sqrt(len(runs)))
    # a pilot that read low, "precise" by its batch means: its spread against the other
    # runs keeps replicating, up to the cap, and the point no longer reads the pilot's 3.5
    run, calls = _fake_runs(agree)
    runs = replicate(job, pilot, run)
    mean, se = across_runs(runs)
    assert len(runs) == LATENCY_MAX_REPLICATIONS
    assert mean > 4.2 and se > 0.03 * mean
    # one run asked for (the quick run): the pilot alone, with its own standard error
    run, calls = _fake_runs(agree)
    single = replicate(replace(job, replications=1), pilot, run)
    assert single == [pilot] and not calls and across_runs(single) == (3.5, 0.1)

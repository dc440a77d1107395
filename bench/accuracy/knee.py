"""What an open-loop run of workflow requests shows: its mean latency, whether it kept up, and
where a workflow stops keeping up (its knee), found by bracketing and bisecting the rate.

Role: the pure half of :mod:`bench.accuracy.agent_path`, which runs the requests (emulated
engines behind the proxy) and reads each request's span from the trace store. Here a run is
its requests' arrival and end times, in model seconds from the run's start.

A run at ``rate`` for ``duration`` seconds of arrivals is judged over its *window*: the
arrivals after the first ``warm`` fraction (the pipeline filling). It kept up when both hold:

- completions in the window are within ``SHORTFALL_LIMIT`` of the arrivals in it (the requests
  in flight did not pile up: under a backlog completions run at capacity, below the rate);
- the mean latency of the window's later half is at most ``GROWTH_LIMIT`` x its earlier
  half's (a backlog makes every later arrival wait longer; a queue that keeps up does not).

Both tests see an overload of about 5-10% over a window of a few hundred model seconds near
capacity (at 5% over, the backlog grows by 5% of the arrivals, and the latency by 5% of the
time between the halves); less than that reads as keeping up, and a queue's excursion just
below capacity can read as overload, which bounds how finely the knee is known whatever the
bisection's precision. On a fake FIFO workflow of capacity 5/s and 20 s latency, searches
from predictions 40% low to 60% high placed the knee at 4.72-5.53 with 300-s runs and at
4.95-5.34 with 600-s runs (tests/bench/accuracy/test_agent_path.py's fake): mostly high,
as a small overload goes unseen.

The knee search (:func:`next_rate`) starts at a predicted capacity, steps by ``step`` up while
runs keep up and down while they do not, then bisects geometrically between the highest rate
kept up with and the lowest that was not until they are within ``precision`` of each other;
the knee is their geometric mean. A run that did not keep up also measures the capacity
directly: its window's completions per second, served from a backlog (``served_rate``).

Invariants: pure functions of their arguments; times in one unit (the caller's model
seconds); a run with no request in its window is neither kept up nor overloaded (it raises).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

SHORTFALL_LIMIT = 0.05  # completions may fall this short of arrivals in the window
GROWTH_LIMIT = 1.2  # the later half's mean latency over the earlier half's
WARM_FRACTION = 1.0 / 3.0  # of the arrival span, left out of the judgement (filling)


@dataclass(frozen=True, slots=True)
class Span:
    """One request: when its first call started and its last call ended (s from run start)."""

    arrival: float
    end: float

    @property
    def latency(self) -> float:
        return self.end - self.arrival


@dataclass(frozen=True, slots=True)
class RunJudgement:
    """One run's figures over its window (arrivals in ``[window_from, duration]``)."""

    rate: float  # offered (nominal) requests/s
    window_from: float
    duration: float
    arrivals: int  # in the window
    completions: int  # requests that ended in the window (whenever they arrived)
    shortfall: float  # 1 - completions / arrivals
    growth: float  # later half's mean latency / earlier half's
    latency_mean: float  # of the window's arrivals
    served_rate: float  # completions per second over the window

    @property
    def kept_up(self) -> bool:
        return self.shortfall <= SHORTFALL_LIMIT and self.growth <= GROWTH_LIMIT


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def judge(
    spans: Sequence[Span], rate: float, duration: float, warm: float = WARM_FRACTION
) -> RunJudgement:
    """The figures of a run of ``duration`` seconds of arrivals at ``rate`` (module docstring)."""
    if not 0 <= warm < 1 or duration <= 0:
        raise ValueError("need 0 <= warm < 1 and a positive duration")
    lo = warm * duration
    mid = (lo + duration) / 2
    inside = [s for s in spans if lo <= s.arrival <= duration]
    if not inside:
        raise ValueError(f"no request arrived in the window [{lo:g}, {duration:g}] s")
    completions = sum(1 for s in spans if lo <= s.end <= duration)
    early = [s.latency for s in inside if s.arrival < mid]
    late = [s.latency for s in inside if s.arrival >= mid]
    growth = _mean(late) / _mean(early) if early and late else 1.0
    return RunJudgement(
        rate=rate,
        window_from=lo,
        duration=duration,
        arrivals=len(inside),
        completions=completions,
        shortfall=1.0 - completions / len(inside),
        growth=growth,
        latency_mean=_mean([s.latency for s in inside]),
        served_rate=completions / (duration - lo),
    )


def mean_latency(spans: Sequence[Span], duration: float, warm: float) -> tuple[float, float, int]:
    """Mean latency of the requests that arrived after ``warm`` x ``duration``, its standard
    error (requests taken as independent: a lower bound near capacity) and their count."""
    lat = [s.latency for s in spans if warm * duration <= s.arrival <= duration]
    if not lat:
        raise ValueError("no request arrived after the warm-up")
    mean = _mean(lat)
    if len(lat) < 2:
        return mean, math.nan, len(lat)
    var = sum((x - mean) ** 2 for x in lat) / (len(lat) - 1)
    return mean, math.sqrt(var / len(lat)), len(lat)


@dataclass(frozen=True, slots=True)
class Bracket:
    """The knee search so far: the highest rate kept up with, the lowest that was not."""

    kept_up: float | None = None
    overloaded: float | None = None

    def add(self, j: RunJudgement) -> Bracket:
        if j.kept_up:
            best = j.rate if self.kept_up is None else max(self.kept_up, j.rate)
            return Bracket(best, self.overloaded)
        worst = j.rate if self.overloaded is None else min(self.overloaded, j.rate)
        return Bracket(self.kept_up, worst)

    def closed(self, precision: float) -> bool:
        return (
            self.kept_up is not None
            and self.overloaded is not None
            and self.overloaded <= self.kept_up * (1.0 + precision)
        )

    @property
    def knee(self) -> float | None:
        """The geometric mean of the bracket's ends (None until both are known)."""
        if self.kept_up is None or self.overloaded is None:
            return None
        return math.sqrt(self.kept_up * self.overloaded)


def next_rate(bracket: Bracket, start: float, step: float, precision: float) -> float | None:
    """The next rate to run, or None when the bracket is within ``precision``. A bracket
    whose ends cross (noise: a rate kept up with above one that was not) is closed too."""
    if step <= 1 or precision <= 0 or start <= 0:
        raise ValueError("need step > 1, precision > 0 and a positive start")
    lo, hi = bracket.kept_up, bracket.overloaded
    if lo is None and hi is None:
        return start
    if hi is None:
        assert lo is not None
        return lo * step
    if lo is None:
        return hi / step
    if bracket.closed(precision):
        return None
    return math.sqrt(lo * hi)


def relative_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured; nan when either is not a positive finite number."""
    if not (math.isfinite(predicted) and math.isfinite(measured) and measured > 0):
        return math.nan
    return (predicted - measured) / measured

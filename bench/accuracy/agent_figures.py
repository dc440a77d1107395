"""The agent bench's figures: what an open-loop run of requests shows (its mean latency,
whether it kept up, where the workflow stops keeping up), what the ALP is given, and the
report's errors against the targets.

Role: the pure half of :mod:`bench.accuracy.agent_path`, which runs the requests (emulated
engines behind the proxy), reads each request's span from the trace store and runs the
product's commands. Here a run is its requests' arrival and end times, in model seconds
from the run's start.

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
seconds); a run with no request in its window is neither kept up nor overloaded (it raises);
a figure that is not finite is ``None`` in the report (JSON has no infinity).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from examples.agent_loop import AgentConfig
from optimizer.model.alp import ModelAlloc, Overlap, Pipeline, Prediction
from optimizer.model.curves import ProfileBook

LABEL = "emulated"
CAPACITY_TARGET, LATENCY_TARGET, LATENCY_LOAD_LIMIT = 0.10, 0.15, 0.8

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


# ---- what the ALP is given, and the report ---------------------------------------------------


def expected_calls(cfg: AgentConfig) -> dict[str, float]:
    """Calls per request the agent makes on average (its loop, in closed form): the planner
    once per step, the worker ``fan_out`` times on each non-final step that fans out."""
    steps, alive = 0.0, 1.0  # expected steps; probability the loop reaches step k
    for k in range(1, cfg.max_steps + 1):
        steps += alive
        if k >= cfg.min_steps:
            alive *= 0.0 if k == cfg.max_steps else 1.0 - cfg.p_stop
    return {cfg.planner: steps, cfg.worker: (steps - 1.0) * cfg.p_fan_out * cfg.fan_out}


def pipeline_from_stats(workflow: str, doc: dict[str, Any], speedup: float) -> Pipeline:
    """The ALP's pipeline from ``scepsy stats --json``'s entry for ``workflow``, as
    ``Pipeline.from_stats`` builds it from the same figures, with the tool time (recorded in
    wall seconds) in model seconds: ``n``, ``p`` and the overlap couplings are ratios."""
    models = doc["models"]
    busy = {m: float(v["busy_mean"] or math.nan) for m, v in models.items()}
    pairs = [
        Overlap.traced(a, b, float(o["together_s"]), busy.get(a, math.nan), busy.get(b, math.nan))
        for o in doc.get("overlaps", [])
        for a, b in [o["models"]]
    ]
    return Pipeline.from_figures(
        workflow,
        {m: (float(v["n"]), float(v["p_agg"] or math.nan)) for m, v in models.items()},
        overlap=float(doc["overlap_factor"] or math.nan),
        tool_time=float(doc["tool_time_mean"] or 0.0) * speedup,
        overlaps=[o for o in pairs if o is not None],
    )


def num(x: float) -> float | None:
    return x if math.isfinite(x) else None


def prediction_doc(p: Prediction) -> dict[str, Any]:
    return {
        "rate": p.rate,
        "latency_s": num(p.latency),
        "throughput": num(p.throughput),
        "bottleneck": p.bottleneck,
        "stages": {
            s.model: {
                "call_rate": s.call_rate,
                "call_latency_s": num(s.call_latency),
                "contribution_s": num(s.contribution),
                "capacity": num(s.capacity),
            }
            for s in p.stages
        },
    }


def curve_doc(book: ProfileBook, model: str, key: ModelAlloc) -> dict[str, Any]:
    """The curve the ALP reads for ``model`` at ``key``: T_m and its (rate, mean) points."""
    prof = book.lookup(model, key.tp, key.share)
    pts = zip(prof.rates, prof.lat["mean"], strict=True)
    return {"saturation": prof.saturation, "points": [[float(r), float(x)] for r, x in pts]}


def knee_doc(
    bracket: Bracket,
    probes: Sequence[tuple[dict[str, Any], RunJudgement]],
    capacity: float,
    precision: float,
) -> dict[str, Any]:
    """The knee search's outcome against the predicted ``capacity``; each probe is its run's
    record and its judgement."""
    overloaded = [j.served_rate for _, j in probes if not j.kept_up]
    return {
        "kept_up": bracket.kept_up,
        "overloaded": bracket.overloaded,
        "knee": bracket.knee,
        "closed": bracket.closed(precision),
        "capacity_error": num(relative_error(capacity, bracket.knee or math.nan)),
        # a backlogged run completes requests at the capacity: a second reading of it
        "served_from_backlog": max(overloaded) if overloaded else None,
        "probes": [run | asdict(j) | {"kept_up": j.kept_up} for run, j in probes],
    }


def summary(doc: dict[str, Any], speedup: float) -> dict[str, Any]:
    """The report's verdict: capacity and mean-latency errors against their targets."""
    cap_err = doc["knee"]["capacity_error"]
    lat = {f: v["error"] for f, v in doc["latency"].items()}
    judged = [e for f, e in lat.items() if float(f) <= LATENCY_LOAD_LIMIT]
    return {
        "label": LABEL,
        "predicted_capacity": doc["predicted"]["capacity"],
        "emulated_knee": doc["knee"]["knee"],
        "knee_bracket": [doc["knee"]["kept_up"], doc["knee"]["overloaded"]],
        "capacity_error": cap_err,
        "capacity_ok": cap_err is not None and abs(cap_err) <= CAPACITY_TARGET,
        "latency_error": lat,
        "latency_ok": bool(judged)
        and all(e is not None and abs(e) <= LATENCY_TARGET for e in judged),
        "speedup": speedup,
    }

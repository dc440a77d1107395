"""The measurement-window statistics of the profiler: settings, a point's figures, its tests.

Role: the pure core of :mod:`optimizer.profiling.profiler` (which does the HTTP): what a sweep is
configured with (:class:`SweepSettings`, ``QUICK``), how one point's calls become a
:class:`ProfilePoint` (edge-tapered rates, latencies of the calls sent in the window), when
that point's window may start (the groups' send spans, the queue's fill time), how sure its
follow test is (the in-flight count's spread), whether it shows saturation, where the
bracket search goes next, and what tokens a response reports (:func:`usage_tokens`).

Invariants: pure functions of their arguments (times are wall seconds on one clock; points
are in model time, wall x ``speedup``); a point "keeps up" here exactly when
``optimizer.model.curves`` counts it as following (``FOLLOW_TOLERANCE``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import orjson

from optimizer.model.curves import FOLLOW_TOLERANCE
from shared.profile_points import ProfilePoint


@dataclass(frozen=True, slots=True)
class Target:
    """One running engine to profile, or several copies of it packed on one GPU. ``speedup``:
    model seconds per wall second. ``copies``: the other copies' URLs; the sweep offers the
    copies its rate together (each request's calls to one copy, as prefix-affinity routing
    does) and reports every figure per copy."""

    url: str  # http://host:port (the call's endpoint path is appended)
    served_model: str
    engine: str
    gpu_type: str
    tp: int
    share: float
    speedup: float = 1.0
    copies: tuple[str, ...] = ()

    @property
    def urls(self) -> tuple[str, ...]:
        """Every copy's URL, ``url`` first."""
        return (self.url, *self.copies)


@dataclass(frozen=True, slots=True)
class SweepSettings:
    calls_per_point: int = 1200
    min_groups_per_point: int = 40
    min_point_s: float = 4.0  # wall seconds
    max_point_s: float = 40.0
    warmup_fraction: float = 0.2
    edge_taper: float = 0.25  # of the window (summarise_point: batch-proof rates)
    # the curve below saturation: fractions of the capacity estimate, lightest first
    curve: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.85)
    first_bracket: float = 0.95  # the first rate tried near capacity (fraction of the estimate)
    step_up: float = 1.15  # kept up there: raise the rate by this factor until it does not
    # stop bisecting once the lowest overloaded rate is within this of the highest kept up
    # with (relative): T_m is then known to that resolution, from below
    resolution: float = 0.04
    max_points: int = 12
    probe_concurrency: int = 256
    probe_max_s: float = 8.0
    latency_blowup: float = 10.0
    max_in_flight: int = 4096
    call_timeout_s: float = 300.0
    seed: int = 0


QUICK = SweepSettings(
    calls_per_point=600,
    min_groups_per_point=20,
    min_point_s=2.0,
    max_point_s=18.0,
    curve=(0.25, 0.6),
    resolution=0.06,
    max_points=6,
    probe_max_s=4.0,
)


@dataclass(frozen=True, slots=True)
class CallTiming:
    """One replayed call, wall seconds on the loop's clock; ``end`` None if cut short."""

    sent: float
    first: float
    end: float | None
    ok: bool
    error: str | None = None
    prompt_tokens: int | None = None  # as the engine's usage reported them (None: it did not)
    cached_tokens: int | None = None  # of those, found in its prefix cache
    completion_tokens: int | None = None  # the call's output, as its usage reported it


# A point's prefix-hit rate may depart from the trace's by this much (absolute: 0.10 is 75%
# against 85%) and still be trusted. Past it the engine's cache held what live traffic's did
# not (a warm cache reads light: 98% against 75% read 2.83 s where a fresh engine read
# 4.91 s), or the reverse; what the point measured is not the traced workload.
HIT_RATE_TOLERANCE = 0.10


def hit_rate(timings: Sequence[CallTiming], window: tuple[float, float]) -> float | None:
    """Σ cached / Σ prompt tokens of the calls sent in ``window`` whose engine reported both
    (None: none did, or no prompt tokens)."""
    prompt = cached = 0
    for c in timings:
        if window[0] <= c.sent < window[1] and c.prompt_tokens and c.cached_tokens is not None:
            prompt += c.prompt_tokens
            cached += c.cached_tokens
    return cached / prompt if prompt else None


def hit_rate_departure(
    measured: float | None, traced: float | None, tolerance: float = HIT_RATE_TOLERANCE
) -> str | None:
    """Why a point whose prefix-hit rate was ``measured`` does not stand for a trace whose
    rate was ``traced`` (None: it does, or either is unknown)."""
    if measured is None or traced is None or abs(measured - traced) <= tolerance:
        return None
    return (
        f"prefix-hit rate {measured:.0%} against {traced:.0%} traced "
        f"(tolerance {tolerance:.0%}): the engine's cache did not hold what live traffic's did"
    )


def tapered_rate(times: Sequence[float], window: tuple[float, float], taper: float) -> float:
    """Events per second in ``window``, averaged over every sub-window of its length less
    ``taper`` (a fraction of it, at most 0.5) sliding across it: each event weighs 1, falling
    linearly to 0 over ``taper`` at both edges. An engine that completes calls in batches
    (one step finishes many) then reads the same whichever phase its steps have at the
    edges, where a plain count swings by a whole batch."""
    t_w, t_e = window
    span = max(t_e - t_w, 1e-9)
    tau = min(max(taper, 0.0), 0.5) * span
    x = np.asarray(times, dtype=np.float64)
    x = x[(x >= t_w) & (x <= t_e)]
    if tau <= 0.0:
        return float(x.size) / span
    weight = np.minimum(1.0, np.minimum(x - t_w, t_e - x) / tau)
    return float(weight.sum()) / (span - tau)


def summarise_point(
    target: Target,
    model: str,
    timings: Sequence[CallTiming],
    window: tuple[float, float],
    nominal_rate: float,
    taper: float = 0.0,
    sends: Sequence[float] | None = None,
) -> tuple[ProfilePoint, int]:
    """The profile point of one run (model time) and its failure count. ``sends``: the send
    time of every call, those cut short included (default: the timings'). Rates count with
    edges tapered over ``taper`` of the window (:func:`tapered_rate`); latencies are of the
    calls sent inside the window that finished."""
    t_w, t_e = window
    k = target.speedup
    sent = [c for c in timings if t_w <= c.sent < t_e]
    sent_at = [c.sent for c in timings] if sends is None else sends
    ends = [c.end for c in timings if c.ok and c.end is not None]
    measured = [c for c in sent if c.ok and c.end is not None]
    lat = np.array([(c.end or 0.0) - c.sent for c in measured]) * k
    if lat.size == 0:
        lat = np.array([math.inf])
    ttft = np.array([c.first - c.sent for c in measured]) * k
    p50, p90, p99 = (
        (math.inf,) * 3
        if math.isinf(lat[0])
        # none finished in time
        else (float(x) for x in np.percentile(lat, [50, 90, 99]))
    )
    point = ProfilePoint(
        model=model,
        engine=target.engine,
        gpu_type=target.gpu_type,
        tp=target.tp,
        share=target.share,
        offered_rate=tapered_rate(sent_at, window, taper) / k,
        throughput=tapered_rate(ends, window, taper) / k,
        lat_mean=float(lat.mean()),
        lat_p50=p50,
        lat_p90=p90,
        lat_p99=p99,
        ttft_mean=float(ttft.mean()) if ttft.size else math.inf,
        n_calls=sum(1 for t in sent_at if t_w <= t < t_e),
        colocation="alone",  # the profiled replica runs by itself on its GPUs
        completion_tokens=_mean_reported(c.completion_tokens for c in measured),
    )
    return point, sum(1 for c in timings if not c.ok and c.end is not None)


def _mean_reported(values: Iterable[int | None]) -> float:
    """The mean of the values an engine reported; -1 (not recorded) where it reported none."""
    got = [v for v in values if v is not None]
    return sum(got) / len(got) if got else -1.0


def saturation_reason(
    point: ProfilePoint,
    nominal_rate: float,
    light_p50: float | None,
    settings: SweepSettings,
    groups: float = math.inf,
) -> str | None:
    """Why ``point`` shows an engine that no longer keeps up, or None. ``groups``: request
    groups expected in the window; the nominal-rate test allows for their Poisson noise."""
    follow = 1.0 - FOLLOW_TOLERANCE
    if point.throughput < follow * point.offered_rate:
        return (
            f"throughput {point.throughput:.3g}/s < {follow:.0%} of sent {point.offered_rate:.3g}/s"
        )
    floor = min(0.8, 1.0 - 3.0 / math.sqrt(max(groups, 1e-9)))
    if point.throughput < floor * nominal_rate:
        return f"throughput {point.throughput:.3g}/s < {floor:.0%} of offered {nominal_rate:.3g}/s"
    if light_p50 is not None and point.lat_p50 > settings.latency_blowup * light_p50:
        return f"median latency {point.lat_p50:.3g}s > {settings.latency_blowup:g}x light load"
    return None


def next_rate(
    kept_up: float | None, overloaded: float | None, estimate: float, settings: SweepSettings
) -> float | None:
    """The bracket's next nominal rate, or None when saturation is pinned to ``resolution``.
    ``kept_up``: the highest rate the engine kept up with; ``overloaded``: the lowest it did
    not; ``estimate``: the capacity estimate the sweep started from."""
    if overloaded is None:
        first = settings.first_bracket * estimate
        return first if kept_up is None or kept_up < first else kept_up * settings.step_up
    if kept_up is None or overloaded <= kept_up * (1.0 + settings.resolution):
        return None
    return math.sqrt(kept_up * overloaded)


def follow_error(
    sends: Sequence[float],
    ends: Sequence[float],
    window: tuple[float, float],
    n_sent: int,
    grid: int = 100,
) -> float:
    """Standard error of throughput / offered over ``window``: the count of calls in flight
    at the window's edges decides the ratio's noise, so sqrt(2) x its spread over the window
    (edges tapered: an overestimate), over the calls sent."""
    t = np.linspace(window[0], window[1], grid)
    in_flight = np.searchsorted(
        np.sort(np.asarray(sends, dtype=np.float64)), t, side="right"
    ) - np.searchsorted(np.sort(np.asarray(ends, dtype=np.float64)), t, side="right")
    return float(math.sqrt(2.0) * in_flight.std() / max(n_sent, 1))


LOST = "scepsy_emulator_lost_wall_seconds_total"
SETTLE_MARGIN = 1.5  # a higher rate's groups take longer to send their last call
MAX_WARMUP = 0.6  # of a point's duration: the rest is its window


def fill_time(
    sends: Sequence[float],
    ends: Sequence[float],
    start: float,
    end: float,
    late: float = 1.0 - MAX_WARMUP,
    level: float = 0.9,
    grid: int = 200,
) -> float:
    """Seconds from ``start`` until the calls in flight first reach ``level`` of their mean
    over the last ``late`` of ``[start, end]``: the queue has filled. For an engine that
    keeps up this is its ramp; for one that does not, the count keeps growing and this is
    late (the caller caps it), so the window still sees the growth."""
    t = np.linspace(start, end, grid)
    s = np.searchsorted(np.sort(np.asarray(sends, dtype=np.float64)), t, side="right")
    e = np.searchsorted(np.sort(np.asarray(ends, dtype=np.float64)), t, side="right")
    in_flight = s - e
    tail = in_flight[t >= end - late * (end - start)]
    if tail.size == 0 or tail.mean() <= 0:
        return 0.0
    reached = np.nonzero(in_flight >= level * tail.mean())[0]
    return float(t[reached[0]] - start) if reached.size else end - start


def send_span(
    marks: Sequence[Sequence[float]],
    arrived_by: float,
    now: float,
    groups: Sequence[Sequence[int]],
    order: Sequence[int] | npt.NDArray[np.int64],
    quantile: float = 0.95,
) -> float:
    """Wall seconds until ``quantile`` of the groups that arrived before ``arrived_by`` had
    sent their last call (a group still sending counts as sending until ``now``).
    ``marks[j]``: group ``j``'s start, then its calls' send times; ``order[j]`` its index."""
    spans = []
    for j, m in enumerate(marks):
        if not m or m[0] >= arrived_by:
            continue
        complete = len(m) - 1 >= len(groups[int(order[j])])
        spans.append((m[-1] if complete else now) - m[0])
    return float(np.quantile(spans, quantile)) if spans else 0.0


CLIENT_LATE = 0.05  # mean send lateness, as a share of the window, that makes a point client-bound


def clock_lag(before: dict[str, float], after: dict[str, float], wall_s: float) -> float | None:
    """An emulator's lost wall time over ``wall_s`` between two scrapes (0.05: its model
    clock fell 5% behind); None for an engine that does not report it."""
    if LOST not in before or LOST not in after or wall_s <= 0:
        return None
    return (after[LOST] - before[LOST]) / wall_s


def usage_tokens(data: bytes, stream: bool) -> tuple[int | None, int | None, int | None]:
    """(prompt tokens, cached prompt tokens, completion tokens) from a response body, or a
    stream's last bytes (its last event that carries usage); None where the engine did not
    report them."""
    doc: object = None
    try:
        if not stream:
            doc = orjson.loads(data)
        else:
            at = data.rfind(b'"usage"')
            if at < 0:
                return None, None, None
            start = data.rfind(b"data:", 0, at)
            stop = data.find(b"\n", at)
            doc = orjson.loads(data[start + 5 : stop if stop >= 0 else len(data)])
    except orjson.JSONDecodeError:
        return None, None, None
    usage = doc.get("usage") if isinstance(doc, dict) else None
    if not isinstance(usage, dict):
        return None, None, None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return (
        prompt if isinstance(prompt, int) else None,
        cached if isinstance(cached, int) else None,
        completion if isinstance(completion, int) else None,
    )

"""The profiler: replay one model's traced calls against an engine, from light load to saturation.

Role: DESIGN §3.5's measurement loop, the part of the optimizer that touches the world (HTTP
to one engine). :func:`sweep` first runs a short closed-loop probe to estimate the engine's
capacity, then offers the replay workload (``optimizer.replay``) at rates growing
geometrically from a fraction of that estimate until achieved throughput stops following the
offered rate (saturation is found, not configured), then adds a few refining points below
(and just past) the saturation estimate. Each rate yields one :class:`ProfilePoint`.

Invariants:
- every rate and latency is in *model* time: an emulator running ``speedup`` model seconds
  per wall second is offered ``rate x speedup`` calls per wall second, and wall latencies are
  multiplied by ``speedup`` (a real engine has speedup 1);
- a call is sent only once the calls it depends on (same request, ended before it started in
  the trace) have finished;
- throughput counts calls completed inside the steady window (after a warm-up of at least one
  traced group span), offered rate the calls sent inside it, latencies the calls sent inside
  it; a point ends by cancelling what is still in flight after a bounded drain, so the engine
  is idle before the next point starts;
- a point is saturated when throughput < 90% of the calls sent, or < 80% of the nominal rate
  (dependency-bound workloads stop sending under overload), or its median latency exceeds
  ``latency_blowup`` x the light-load median, or the in-flight bound is hit;
- nothing here knows how the engine was started (see ``optimizer.profile_cmd``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import aiohttp
import numpy as np

from optimizer.profiles import FOLLOW_TOLERANCE, ProfilePoint
from optimizer.replay import Workload, schedule


class ProfileRunError(RuntimeError):
    """The engine refused or failed too many calls for a measurement to mean anything."""


@dataclass(frozen=True, slots=True)
class Target:
    """One running engine to profile. ``speedup``: model seconds per wall second."""

    url: str  # http://host:port (the call's endpoint path is appended)
    served_model: str
    engine: str
    gpu_type: str
    tp: int
    share: float
    speedup: float = 1.0


@dataclass(frozen=True, slots=True)
class SweepSettings:
    calls_per_point: int = 1200
    min_groups_per_point: int = 40
    min_point_s: float = 4.0  # wall seconds
    max_point_s: float = 40.0
    warmup_fraction: float = 0.2
    start_fraction: float = 0.1  # of the probe's capacity estimate
    growth: float = 1.5
    max_points: int = 12
    # fractions of the plateau (best throughput so far): T_m is the highest rate the engine
    # kept up with (optimizer.profiles), so points just below the plateau decide it
    refine: tuple[float, ...] = (0.5, 0.8, 0.9, 0.95)
    overshoot: tuple[float, ...] = (1.5,)  # past the estimate: pins the plateau
    probe_concurrency: int = 256
    probe_max_s: float = 8.0
    latency_blowup: float = 10.0
    max_in_flight: int = 4096
    call_timeout_s: float = 300.0
    seed: int = 0


QUICK = SweepSettings(calls_per_point=400, min_groups_per_point=20, min_point_s=2.0,
                      max_point_s=10.0, start_fraction=0.2, growth=2.0, max_points=7,
                      refine=(0.9, 0.95), overshoot=(), probe_max_s=4.0)


@dataclass(frozen=True, slots=True)
class CallTiming:
    """One replayed call, wall seconds on the loop's clock; ``end`` None if cut short."""

    sent: float
    first: float
    end: float | None
    ok: bool
    error: str | None = None


@dataclass(frozen=True, slots=True)
class PointResult:
    point: ProfilePoint
    nominal_rate: float  # model calls/s the schedule aimed at
    saturated: str | None  # why this point counts as saturated, else None
    failures: int
    send_lag_s: float  # mean lateness of the client's sends (wall): a client-bound run shows
    clock_lag: float | None = None  # an emulator's own clock lag at the end (None: not one)


@dataclass(frozen=True, slots=True)
class SweepResult:
    points: tuple[PointResult, ...]
    probe_rate: float  # model calls/s of the closed-loop probe
    saturation: float  # max achieved throughput (model calls/s)
    saturated: bool  # False: no point reached saturation, ``saturation`` is a lower bound


class Progress(Protocol):
    def point_started(self, index: int, rate: float, duration_s: float) -> None: ...
    def point_finished(self, index: int, result: PointResult) -> None: ...


# ---- pure summaries ------------------------------------------------------------------------

def summarise_point(target: Target, model: str, timings: Sequence[CallTiming], window: tuple[
        float, float], nominal_rate: float) -> tuple[ProfilePoint, int]:
    """The profile point of one run (model time) and its failure count."""
    t_w, t_e = window
    k = target.speedup
    span_model = max(t_e - t_w, 1e-9) * k
    sent = [c for c in timings if t_w <= c.sent < t_e]
    done = [c for c in timings if c.ok and c.end is not None and t_w <= c.end <= t_e]
    measured = [c for c in sent if c.ok and c.end is not None]
    lat = np.array([(c.end or 0.0) - c.sent for c in measured]) * k
    if lat.size == 0:
        lat = np.array([math.inf])
    ttft = np.array([c.first - c.sent for c in measured]) * k
    p50, p90, p99 = (float(x) for x in np.percentile(lat, [50, 90, 99]))
    point = ProfilePoint(
        model=model, engine=target.engine, gpu_type=target.gpu_type, tp=target.tp,
        share=target.share, offered_rate=len(sent) / span_model,
        throughput=len(done) / span_model, lat_mean=float(lat.mean()), lat_p50=p50,
        lat_p90=p90, lat_p99=p99, ttft_mean=float(ttft.mean()) if ttft.size else math.inf,
        n_calls=len(sent))
    return point, sum(1 for c in timings if not c.ok and c.end is not None)


def saturation_reason(point: ProfilePoint, nominal_rate: float, light_p50: float | None,
                      settings: SweepSettings, groups: float = math.inf) -> str | None:
    """Why ``point`` shows an engine that no longer keeps up, or None. ``groups``: request
    groups expected in the window; the nominal-rate test allows for their Poisson noise."""
    follow = 1.0 - 2.0 * FOLLOW_TOLERANCE
    if point.throughput < follow * point.offered_rate:
        return f"throughput {point.throughput:.3g}/s < {follow:.0%} of sent {point.offered_rate:.3g}/s"
    floor = min(0.8, 1.0 - 3.0 / math.sqrt(max(groups, 1e-9)))
    if point.throughput < floor * nominal_rate:
        return f"throughput {point.throughput:.3g}/s < {floor:.0%} of offered {nominal_rate:.3g}/s"
    if light_p50 is not None and point.lat_p50 > settings.latency_blowup * light_p50:
        return f"median latency {point.lat_p50:.3g}s > {settings.latency_blowup:g}x light load"
    return None


def refine_rates(saturation: float, done: Sequence[float], settings: SweepSettings) -> list[float]:
    """Rates still worth measuring: refine and overshoot fractions, away from ``done``."""
    wanted = [f * saturation for f in (*settings.refine, *settings.overshoot)]
    return [r for r in wanted if all(abs(r - d) > 0.05 * r for d in done)]


# ---- the replay ----------------------------------------------------------------------------

class Replayer:
    """Sends a workload's calls to one target over one session, honouring dependencies."""

    def __init__(self, session: aiohttp.ClientSession, target: Target, workload: Workload,
                 timeout_s: float) -> None:
        self.session = session
        self.target = target
        self.workload = workload
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.in_flight = 0

    async def call(self, index: int) -> CallTiming:
        c = self.workload.calls[index]
        loop = asyncio.get_running_loop()
        sent = loop.time()
        first = sent
        self.in_flight += 1
        try:
            async with self.session.post(
                    self.target.url + c.endpoint, data=c.body, timeout=self.timeout,
                    headers={"Content-Type": "application/json"}) as resp:
                if resp.status >= 300:
                    text = (await resp.read())[:300].decode("utf-8", "replace")
                    return CallTiming(sent, loop.time(), loop.time(), False,
                                      f"HTTP {resp.status}: {text}")
                if c.stream:
                    got_first = False
                    async for _ in resp.content.iter_any():
                        if not got_first:
                            first, got_first = loop.time(), True
                else:
                    await resp.read()
                end = loop.time()
                return CallTiming(sent, first if c.stream else end, end, True)
        except (aiohttp.ClientError, TimeoutError) as exc:
            now = loop.time()
            return CallTiming(sent, now, now, False, f"{type(exc).__name__}: {exc}")
        finally:
            self.in_flight -= 1

    async def group(self, g: int, out: list[CallTiming]) -> None:
        """Run one request group: each call starts once its dependencies ended."""
        members = self.workload.groups[g]
        done = {i: asyncio.Event() for i in members}

        async def one(i: int) -> None:
            for d in self.workload.calls[i].deps:
                await done[d].wait()
            try:
                out.append(await self.call(i))
            finally:
                done[i].set()
        await asyncio.gather(*(one(i) for i in members))


async def probe(rep: Replayer, settings: SweepSettings) -> float:
    """Closed-loop capacity estimate (model calls/s): ``probe_concurrency`` callers sending
    the workload's calls in trace order, dependencies ignored; measured after the first
    ``concurrency`` completions (the engine's batch filled) until as many again or a bound."""
    loop = asyncio.get_running_loop()
    n = len(rep.workload.calls)
    concurrency = settings.probe_concurrency
    ends: list[float] = []
    failures: list[str] = []
    cursor = iter(range(1 << 62))

    async def worker() -> None:
        while True:
            t = await rep.call(next(cursor) % n)
            if t.ok and t.end is not None:
                ends.append(t.end)
            elif t.error:
                failures.append(t.error)
                if len(failures) > 20:
                    return

    start = loop.time()
    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    try:
        # until enough completions; past probe_max_s a few dozen do; past 4x, give up
        while loop.time() - start < 4.0 * settings.probe_max_s:
            if len(ends) >= 2 * concurrency + 20 or len(failures) > 20:
                break
            if loop.time() - start > settings.probe_max_s and len(ends) >= 40:
                break
            await asyncio.sleep(0.05)
    finally:
        await _cancel(tasks)
    if len(failures) > 20 or (failures and not ends):
        raise ProfileRunError(f"the engine at {rep.target.url} fails calls: {failures[0]}")
    ends.sort()
    if len(ends) < 40:
        raise ProfileRunError(f"the engine at {rep.target.url} completed {len(ends)} calls in "
                              f"{4 * settings.probe_max_s:g}s: too slow to profile (lower its speedup?)")
    lo = min(concurrency, len(ends) // 2)
    window = max(ends[-1] - ends[lo], 1e-9)
    return (len(ends) - 1 - lo) / window / rep.target.speedup


async def run_point(rep: Replayer, rate: float, settings: SweepSettings, rng: np.random.Generator,
                    progress: Progress | None = None, index: int = 0,
                    light_p50: float | None = None, latency_hint: float = 0.0) -> PointResult:
    """Offer ``rate`` model calls/s for one measurement window; return its point.
    ``latency_hint``: a call's latency (model s) near capacity; the warm-up covers it twice,
    so an overloaded engine is measured with its batch full, not while it fills."""
    loop = asyncio.get_running_loop()
    wl, k = rep.workload, rep.target.speedup
    wall_rate = rate * k
    settle = max(2.0, wl.depth) * latency_hint / k  # a group's chain fills the pipeline
    want = max(settings.calls_per_point, settings.min_groups_per_point * wl.calls_per_group)
    duration = min(max(want / wall_rate, settings.min_point_s, 3.0 * settle),
                   settings.max_point_s)
    warmup = min(max(settings.warmup_fraction * duration, settle), 0.5 * duration)
    times, order = schedule(wl, wall_rate, duration, rng)
    if progress is not None:
        progress.point_started(index, rate, duration)
    timings: list[CallTiming] = []
    tasks: list[asyncio.Task[None]] = []
    lag = 0.0
    overflow = False
    start = loop.time()
    try:
        for t, g in zip(times.tolist(), order.tolist(), strict=True):
            delay = start + t - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            lag += max(0.0, loop.time() - (start + t))
            if rep.in_flight >= settings.max_in_flight:
                overflow = True
                break
            tasks.append(asyncio.create_task(rep.group(g, timings)))
        t_end = start + duration
        await asyncio.sleep(max(0.0, t_end - loop.time()))
        # drain: calls sent inside the window may finish (their latencies count), bounded
        pending = [t for t in tasks if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=max(1.0, 0.5 * duration))
    finally:
        await _cancel(tasks)
    point, failures = summarise_point(rep.target, wl.model, timings, (start + warmup, t_end),
                                      rate)
    errors = [c.error for c in timings if c.error]
    if failures > max(5, 0.05 * len(timings)):
        raise ProfileRunError(f"{failures} of {len(timings)} calls failed at {rate:.3g}/s "
                              f"(model time), e.g. {errors[0]}")
    groups = wall_rate * (t_end - start - warmup) / wl.calls_per_group
    reason = "in-flight bound reached" if overflow else saturation_reason(
        point, rate, light_p50, settings, groups)
    metrics = await engine_metrics(rep.session, rep.target.url)
    result = PointResult(point, rate, reason, failures, lag / max(1, len(times)),
                         metrics.get("scepsy_emulator_clock_lag_ratio"))
    if progress is not None:
        progress.point_finished(index, result)
    return result


async def engine_metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The unlabelled-by-us samples of ``/metrics`` (first sample per name); {} if none.
    Emulators report ``scepsy_emulator_speedup``, ``..._clock_lag_ratio``,
    ``..._model_busy_seconds_total``; real engines report none of them."""
    try:
        async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
            if r.status != 200:
                return {}
            text = await r.text()
    except (aiohttp.ClientError, TimeoutError):
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.partition("{")[0]
        value = line.rsplit(" ", 1)[-1]
        name = name.split(" ", 1)[0]
        with contextlib.suppress(ValueError):
            out.setdefault(name, float(value))
    return out


async def _cancel(tasks: Sequence[asyncio.Task[None]]) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t


async def sweep(target: Target, workload: Workload, settings: SweepSettings = SweepSettings(),
                progress: Progress | None = None) -> SweepResult:
    """Profile ``workload`` on ``target`` from light load to saturation (module docstring)."""
    rng = np.random.default_rng(settings.seed)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        rep = Replayer(session, target, workload, settings.call_timeout_s)
        estimate = await probe(rep, settings)
        results: list[PointResult] = []
        rate = settings.start_fraction * estimate
        light: float | None = None
        for _ in range(3):  # the probe overestimated: even the lightest rate saturates
            first = await run_point(rep, rate, settings, rng, progress, 0)
            if first.saturated is None:
                break
            rate /= settings.growth ** 2
        results.append(first)
        light = first.point.lat_p50
        hint = first.point.lat_p90
        while first.saturated is None and len(results) < settings.max_points:
            rate *= settings.growth
            res = await run_point(rep, rate, settings, rng, progress, len(results), light, hint)
            results.append(res)
            if res.saturated is not None:
                break
            hint = res.point.lat_p90
        saturated = any(r.saturated is not None for r in results)
        best = max(r.point.throughput for r in results)
        if best <= 0.0:
            raise ProfileRunError(f"no call completed inside any measurement window at "
                                  f"{target.url}: the engine is too slow for these windows")
        if saturated:
            done = [r.nominal_rate for r in results]
            for extra in refine_rates(best, done, settings):
                res = await run_point(rep, extra, settings, rng, progress, len(results), light,
                                      hint)
                results.append(res)
        results.sort(key=lambda r: r.nominal_rate)
        best = max(r.point.throughput for r in results)
        return SweepResult(tuple(results), estimate, best, saturated)


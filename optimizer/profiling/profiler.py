"""The profiler: replay one model's traced calls against an engine, from light load to saturation.

Role: DESIGN §3.5's measurement loop, the part of the optimizer that touches the world (HTTP
to one engine). :func:`sweep` starts from a capacity estimate (a short closed-loop probe, or
one its caller already measured on the same engine), offers the replay workload
(``optimizer.profiling.replay``) at a few fractions of it for the curve, then brackets saturation: it
raises the rate until a point no longer keeps up and bisects (geometrically) between the
highest rate kept up with and the lowest one that was not, until they are within
``resolution`` of each other (saturation is found, not configured). Each rate yields one
:class:`ProfilePoint`; ``T_m`` is read off them by ``optimizer.model.curves``.

Invariants:
- every rate and latency is in *model* time: an emulator running ``speedup`` model seconds
  per wall second is offered ``rate x speedup`` calls per wall second, and wall latencies are
  multiplied by ``speedup`` (a real engine has speedup 1);
- a call is sent only once the calls it depends on (same request, ended before it started in
  the trace) have finished;
- an engine is never sent a prompt it was sent before in this profile (each replay of a
  request is tagged apart, :class:`Replayer`), so its prefix cache holds what the traced
  workload's would, not the earlier passes; each point reports the prefix-hit rate its calls
  met (``PointResult.hit_rate``) for the caller to hold against the trace's;
- throughput counts calls completed inside the steady window, offered rate the calls sent
  inside it (both with tapered edges), latencies the calls sent inside it; the window starts
  once the send rate is steady and the queue has filled (both measured), and a point whose
  follow test is within two standard errors of its threshold runs on (the statistics are
  ``optimizer.profiling.window``'s); a point ends by cancelling what is still in flight, so the engine is idle before the
  next point starts. A point that kept up first waits (bounded) for the calls sent in its
  window, so their latencies count; an overloaded one does not (its latencies are those of
  the calls that finished: a lower bound, and ``optimizer.model.curves`` ignores them);
- a point is saturated when it did not keep up in ``optimizer.model.curves``' sense (throughput
  below ``1 - FOLLOW_TOLERANCE`` of the calls sent: the sweep and the curve use one test), or
  its throughput fell well short of the nominal rate (dependency-bound workloads stop sending
  under overload), or its median latency exceeds ``latency_blowup`` x the light-load median,
  or the in-flight bound was hit; a point whose client started groups late (``CLIENT_LATE``)
  is client-bound instead: it bounds the search, it does not show the engine saturated; an
  overloaded point that was client-bound or whose emulator lagged (``LAG_LIMIT``) is measured
  once more, and the second reading steers the search (both are kept);
- the bracket moves on nominal rates; the points keep what was achieved;
- nothing here knows how the engine was started (see ``optimizer.cli.profile``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import aiohttp
import numpy as np

from optimizer.model.curves import FOLLOW_TOLERANCE
from optimizer.profiling.replay import Workload, schedule, tagged_body
from optimizer.profiling.window import (
    CLIENT_LATE,
    MAX_WARMUP,
    SETTLE_MARGIN,
    CallTiming,
    SweepSettings,
    Target,
    clock_lag,
    fill_time,
    follow_error,
    hit_rate,
    next_rate,
    saturation_reason,
    send_span,
    summarise_point,
    tapered_rate,
    usage_tokens,
)
from shared.engine_load import first_samples
from shared.profile_points import ProfilePoint

LAG_LIMIT = 0.05  # an emulator whose clock lagged more during a point read it pessimistic


class ProfileRunError(RuntimeError):
    """The engine refused or failed too many calls for a measurement to mean anything."""


@dataclass(frozen=True, slots=True)
class PointResult:
    point: ProfilePoint
    nominal_rate: float  # model calls/s the schedule aimed at
    saturated: str | None  # why this point counts as saturated, else None
    failures: int
    send_lag_s: float  # mean lateness of the client's sends (wall): a client-bound run shows
    clock_lag: float | None = None  # an emulator's lost wall time over the point's wall time
    client_bound: bool = False  # the client sent late: what the engine could do is unknown
    settle: float = 0.0  # model s until the groups of the point's first half sent their last call
    follow_error: float = 0.0  # standard error of throughput / offered (see follow_error)
    hit_rate: float | None = None  # prefix-hit rate of the window's calls (None: not reported)


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

# ---- the replay ----------------------------------------------------------------------------


class Replayer:
    """Sends a workload's calls to one target over one session, honouring dependencies.

    Every send is tagged (:func:`optimizer.profiling.replay.tagged_body`) with this
    replayer's salt (random: two replayers, or two profiles of one engine, never share a
    tag) and the replay's number: the calls of one replay of a group share their tag, and a
    call is never sent twice with one tag, so the engine never sees a prompt it was sent
    before in this profile. Each call's usage, where the engine reports it, gives the
    prefix-hit rate the replay met."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        target: Target,
        workload: Workload,
        timeout_s: float,
        salt: str | None = None,
    ) -> None:
        self.session = session
        self.target = target
        self.workload = workload
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.salt = secrets.token_hex(4) if salt is None else salt
        self.replays = [0] * len(workload.calls)  # per call: the next replay's number
        # packed copies: a request's calls all go to one copy (its group's), so each copy's
        # prefix cache sees whole requests, as behind the proxy's affinity routing
        urls = target.urls
        self.url_of = [urls[0]] * len(workload.calls)
        for g, members in enumerate(workload.groups):
            for i in members:
                self.url_of[i] = urls[g % len(urls)]
        self.in_flight = 0
        self.sent = 0  # calls sent so far
        self.sends: list[float] = []  # their send times (wall), kept when a call is cut short

    def body(self, index: int, replay: int | None = None) -> bytes:
        """The body of call ``index``'s replay number ``replay`` (default: its next one);
        the call's later replays get higher numbers."""
        n = self.replays[index] if replay is None else replay
        self.replays[index] = max(self.replays[index], n + 1)
        return tagged_body(self.workload.calls[index], f"{self.salt}.{n}")

    async def call(self, index: int, replay: int | None = None) -> CallTiming:
        c = self.workload.calls[index]
        body = self.body(index, replay)
        loop = asyncio.get_running_loop()
        sent = loop.time()
        first = sent
        self.in_flight += 1
        self.sent += 1
        self.sends.append(sent)
        try:
            async with self.session.post(
                self.url_of[index] + c.endpoint,
                data=body,
                timeout=self.timeout,
                headers={"Content-Type": "application/json"},
            ) as resp:
                if resp.status >= 300:
                    text = (await resp.read())[:300].decode("utf-8", "replace")
                    return CallTiming(
                        sent, loop.time(), loop.time(), False, f"HTTP {resp.status}: {text}"
                    )
                if c.stream:
                    got_first = False
                    tail = b""  # the stream's end, where its usage event is
                    async for chunk in resp.content.iter_any():
                        if not got_first:
                            first, got_first = loop.time(), True
                        tail = (tail + chunk)[-_USAGE_TAIL:]
                    data = tail
                else:
                    data = await resp.read()
                end = loop.time()
                prompt, cached, completion = usage_tokens(data, c.stream)
                return CallTiming(
                    sent, first if c.stream else end, end, True, None, prompt, cached, completion
                )
        except (aiohttp.ClientError, TimeoutError) as exc:
            now = loop.time()
            return CallTiming(sent, now, now, False, f"{type(exc).__name__}: {exc}")
        finally:
            self.in_flight -= 1

    async def group(self, g: int, out: list[CallTiming], marks: list[float] | None = None) -> None:
        """Run one request group: each call starts once its dependencies ended. ``marks``
        gets the group's start time, then each call's send time as it is sent. Every call
        of this replay of the group carries one replay number, higher than any its calls
        were sent with (claimed now: a replay of the group that starts meanwhile gets the
        next)."""
        members = self.workload.groups[g]
        replay = max(self.replays[i] for i in members)
        for i in members:
            self.replays[i] = replay + 1
        done = {i: asyncio.Event() for i in members}
        loop = asyncio.get_running_loop()
        if marks is not None:
            marks.append(loop.time())

        async def one(i: int) -> None:
            for d in self.workload.calls[i].deps:
                await done[d].wait()
            if marks is not None:
                marks.append(loop.time())
            try:
                out.append(await self.call(i, replay))
            finally:
                done[i].set()

        await asyncio.gather(*(one(i) for i in members))


_USAGE_TAIL = 4096  # bytes of a stream's end kept: its usage event and [DONE]


async def probe(rep: Replayer, settings: SweepSettings) -> float:
    """Closed-loop capacity estimate (model calls/s): see :func:`probe_ends`."""
    ends, stop = await probe_ends(rep, settings)
    return capacity_estimate(ends, stop, settings, rep.target.speedup)


def capacity_estimate(
    ends: Sequence[float], stop: float, settings: SweepSettings, speedup: float
) -> float:
    """Model calls/s completed from the ``probe_concurrency``-th completion (the batch filled)
    to ``stop``, from the sorted completion times (wall s) of a closed-loop probe; edges
    tapered (:func:`tapered_rate`), as an engine finishing a batch a step reads by bursts."""
    lo = min(settings.probe_concurrency, len(ends) // 2)
    return tapered_rate(ends, (ends[lo], stop), 0.5) / speedup


async def probe_ends(rep: Replayer, settings: SweepSettings) -> tuple[list[float], float]:
    """Completion times (wall s, sorted) of a closed-loop probe, and when it stopped:
    ``probe_concurrency`` callers sending the workload's calls in trace order, dependencies
    ignored, until twice that many completed (the batch filled, then as many again), or
    ``probe_max_s`` passed with a few dozen; either way only once the measured stretch
    spans three median latencies (several steps of an engine that finishes calls by
    batches); within a bound."""
    loop = asyncio.get_running_loop()
    n = len(rep.workload.calls)
    concurrency = settings.probe_concurrency
    ends: list[float] = []
    latencies: list[float] = []
    failures: list[str] = []
    cursor = iter(range(1 << 62))

    async def worker() -> None:
        while True:
            t = await rep.call(next(cursor) % n)
            if t.ok and t.end is not None:
                ends.append(t.end)
                latencies.append(t.end - t.sent)
            elif t.error:
                failures.append(t.error)
                if len(failures) > 20:
                    return

    def spans_steps(now: float) -> bool:
        lo = min(concurrency, len(ends) // 2)
        return now - ends[lo] >= 3.0 * float(np.median(latencies))

    start = loop.time()
    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    try:
        while (now := loop.time()) - start < 4.0 * settings.probe_max_s:
            if len(failures) > 20:
                break
            enough = len(ends) >= 2 * concurrency + 20 or (
                now - start > settings.probe_max_s and len(ends) >= 40
            )
            if enough and spans_steps(now):
                break
            await asyncio.sleep(0.05)
    finally:
        stop = loop.time()
        await _cancel(tasks)
    if len(failures) > 20 or (failures and not ends):
        raise ProfileRunError(f"the engine at {rep.target.url} fails calls: {failures[0]}")
    ends.sort()
    if len(ends) < 40:
        raise ProfileRunError(
            f"the engine at {rep.target.url} completed {len(ends)} calls in "
            f"{4 * settings.probe_max_s:g}s: too slow to profile (lower its speedup?)"
        )
    return ends, stop


async def run_point(
    rep: Replayer,
    rate: float,
    settings: SweepSettings,
    rng: np.random.Generator,
    progress: Progress | None = None,
    index: int = 0,
    light_p50: float | None = None,
    settle_hint: float = 0.0,
) -> PointResult:
    """Offer ``rate`` model calls/s for one measurement window; return its point.

    ``settle_hint``: how long (model s) groups took to send their last call at the last rate
    kept up with; the planned warm-up allows half as much again (latency grows with load).
    The window starts once the send rate is steady and the queue has filled, both measured
    (:func:`send_span`, :func:`fill_time`; at most ``MAX_WARMUP`` into the point). When the
    follow test is too close to call (within two standard errors of its threshold, the
    error from the in-flight count's spread) after half of ``calls_per_point``, the point
    runs on by as much again, up to twice ``calls_per_point``: a clear point costs half the
    calls, a marginal one gets more calls rather than a coin toss."""
    loop = asyncio.get_running_loop()
    wl, k = rep.workload, rep.target.speedup
    wall_rate = rate * k
    warmup, steady, duration, longest = _point_times(wl, wall_rate, k, settings, settle_hint)
    times, order = schedule(wl, wall_rate, longest, rng)
    if progress is not None:
        progress.point_started(index, rate, duration)
    before = await engine_metrics(rep.session, rep.target.url)
    timings: list[CallTiming] = []
    tasks: list[asyncio.Task[None]] = []
    marks: list[list[float]] = []
    first_send = len(rep.sends)
    late = [0.0, 0]  # summed lateness of the group starts, and their count
    overflow = False
    start = loop.time()

    async def send() -> None:
        nonlocal overflow
        for t, g in zip(times.tolist(), order.tolist(), strict=True):
            delay = start + t - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            late[0] += max(0.0, loop.time() - (start + t))
            late[1] += 1
            if rep.in_flight >= settings.max_in_flight:
                overflow = True
                return
            marks.append([])
            tasks.append(asyncio.create_task(rep.group(g, timings, marks[-1])))

    def judge(t_end: float) -> tuple[tuple[float, float], float, str | None, float, float]:
        """The window, its expected groups, the saturation reason, the follow test's margin
        and standard error, as of ``t_end`` (throughput and sends are known, latencies not)."""
        span = send_span(marks, start + 0.5 * (t_end - start), t_end, wl.groups, order)
        ends = [c.end for c in timings if c.end is not None]
        fill = fill_time(rep.sends[first_send:], ends, start, t_end)
        w = min(max(warmup, span, fill), MAX_WARMUP * (t_end - start))
        window = (start + w, t_end)
        groups = wall_rate * (t_end - start - w) / wl.calls_per_group
        point = summarise_point(
            rep.target, wl.model, timings, window, rate, settings.edge_taper, rep.sends[first_send:]
        )[0]
        margin = point.throughput / max(point.offered_rate, 1e-12) - (1 - FOLLOW_TOLERANCE)
        return (
            window,
            groups,
            saturation_reason(point, rate, None, settings, groups),
            margin,
            follow_error(rep.sends[first_send:], ends, window, point.n_calls),
        )

    sender = asyncio.create_task(send())
    try:
        t_end = start + duration
        while True:
            await asyncio.sleep(max(0.0, t_end - loop.time()))
            window, groups, reason, margin, error = judge(t_end)
            if overflow or abs(margin) >= 2.0 * error or t_end >= start + longest - 1e-9:
                break
            t_end = min(t_end + min(steady, duration - warmup), start + longest)
        sender.cancel()
        pending = [t for t in tasks if not t.done()]
        if pending and reason is None and not overflow:  # latencies of the window's calls
            await asyncio.wait(pending, timeout=max(1.0, 0.5 * duration))
    finally:
        sender.cancel()
        await _cancel([sender, *tasks])
    wall = loop.time() - start
    point, failures = summarise_point(
        rep.target, wl.model, timings, window, rate, settings.edge_taper, rep.sends[first_send:]
    )
    errors = [c.error for c in timings if c.error]
    if failures > max(5, 0.05 * len(timings)):
        raise ProfileRunError(
            f"{failures} of {len(timings)} calls failed at {rate:.3g}/s "
            f"(model time), e.g. {errors[0]}"
        )
    send_lag = late[0] / max(1, late[1])
    client_bound, reason = _verdict(
        point, rate, light_p50, settings, groups, overflow, send_lag, window
    )
    after = await engine_metrics(rep.session, rep.target.url)
    span = send_span(marks, start + 0.5 * (window[1] - start), window[1], wl.groups, order)
    result = PointResult(
        point,
        rate,
        reason,
        failures,
        send_lag,
        clock_lag(before, after, wall),
        client_bound,
        span * k,
        error,
        hit_rate(timings, window),
    )
    if progress is not None:
        progress.point_finished(index, result)
    return result


def _point_times(
    wl: Workload, wall_rate: float, speedup: float, settings: SweepSettings, settle_hint: float
) -> tuple[float, float, float, float]:
    """A point's planned (wall s) warm-up, steady stretch, first look (warm-up plus steady)
    and longest run: the steady stretch sends half the calls a point wants (a clear point
    stops there, a marginal one runs on), and the warm-up allows ``SETTLE_MARGIN`` times the
    settle hint (model s)."""
    settle = SETTLE_MARGIN * settle_hint / speedup
    want = max(settings.calls_per_point, settings.min_groups_per_point * wl.calls_per_group)
    # first look after half the calls: a clear point stops there, a marginal one runs on
    steady = max(0.5 * want / wall_rate, settings.min_point_s)
    warmup = max(settings.warmup_fraction * steady, settle)
    duration = min(warmup + steady, settings.max_point_s)
    longest = duration + 3.0 * min(steady, duration - warmup)
    return warmup, steady, duration, longest


def _verdict(
    point: ProfilePoint,
    rate: float,
    light_p50: float | None,
    settings: SweepSettings,
    groups: float,
    overflow: bool,
    send_lag: float,
    window: tuple[float, float],
) -> tuple[bool, str | None]:
    """Whether a finished point was client-bound, and why it counts as saturated (None: it
    kept up): the in-flight bound, a late client, or :func:`saturation_reason`."""
    # a client that starts groups late offers less than the schedule: the shortfall is its
    # own, so the point says nothing about the rate the engine could take
    client_bound = send_lag > CLIENT_LATE * (window[1] - window[0])
    reason = (
        "in-flight bound reached"
        if overflow
        else f"client-bound: groups started {send_lag:.2g}s late on average"
        if client_bound
        else saturation_reason(point, rate, light_p50, settings, groups)
    )
    return client_bound, reason


async def engine_metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The samples of ``/metrics`` (first sample per name, labels dropped); {} if none.
    Emulators report ``scepsy_emulator_speedup``, ``..._clock_lag_ratio``,
    ``..._model_busy_seconds_total``; real engines report none of them."""
    try:
        async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
            if r.status != 200:
                return {}
            text = await r.text()
    except (aiohttp.ClientError, TimeoutError):
        return {}
    return first_samples(text)


async def _cancel(tasks: Sequence[asyncio.Task[None]]) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t


async def sweep(
    target: Target,
    workload: Workload,
    settings: SweepSettings = SweepSettings(),
    progress: Progress | None = None,
    estimate: float | None = None,
) -> SweepResult:
    """Profile ``workload`` on ``target`` from light load to saturation (module docstring).
    ``estimate``: the engine's capacity (model calls/s) if already probed; else probed here."""
    rng = np.random.default_rng(settings.seed)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        rep = Replayer(session, target, workload, settings.call_timeout_s)
        if estimate is None:
            estimate = await probe(rep, settings)
        results: list[PointResult] = []
        kept_up: float | None = None  # highest nominal rate kept up with
        overloaded: float | None = None  # lowest nominal rate that was not
        light: float | None = None  # median latency at the lightest rate kept up with
        hint = 0.0  # model s groups took to send their last call at the highest rate kept up with

        async def measure(rate: float) -> None:
            nonlocal kept_up, overloaded, light, hint
            res = await run_point(rep, rate, settings, rng, progress, len(results), light, hint)
            results.append(res)
            if (
                res.saturated is not None
                and len(results) < settings.max_points
                and (res.client_bound or (res.clock_lag or 0.0) > LAG_LIMIT)
            ):
                # short of CPU (this client, or the emulator's clock): the reading says little
                # about the engine, so measure the rate once more; both points are kept
                res = await run_point(rep, rate, settings, rng, progress, len(results), light, hint)
                results.append(res)
            if res.saturated is None:
                kept_up = max(rate, kept_up or 0.0)
                if light is None:
                    light = res.point.lat_p50
                if rate >= kept_up:
                    hint = res.settle
            else:  # a client-bound point bounds the search too: no higher rate can be sent
                overloaded = min(rate, overloaded or math.inf)

        curve = [f * estimate for f in settings.curve]
        for _ in range(3):  # the estimate was far too high: even the lightest rate saturates
            await measure(curve[0])
            if kept_up is not None:
                break
            curve = [r / 4.0 for r in curve]
        for rate in curve[1:]:
            if overloaded is not None or len(results) >= settings.max_points:
                break
            await measure(rate)
        while len(results) < settings.max_points and kept_up is not None:
            bracket = next_rate(kept_up, overloaded, estimate, settings)
            if bracket is None:
                break
            await measure(bracket)
        best = max(r.point.throughput for r in results)
        if best <= 0.0:
            raise ProfileRunError(
                f"no call completed inside any measurement window at "
                f"{target.url}: the engine is too slow for these windows"
            )
        results.sort(key=lambda r: r.nominal_rate)
        saturated = any(r.saturated is not None and not r.client_bound for r in results)
        n = len(target.urls)
        if n == 1:
            return SweepResult(tuple(results), estimate, best, saturated)
        return SweepResult(
            tuple(per_copy(r, n) for r in results), estimate / n, best / n, saturated
        )


def per_copy(result: PointResult, copies: int) -> PointResult:
    """A point measured on ``copies`` packed copies offered its rate together, per copy: each
    copy offered and completing its part, the calls' latencies as they were, marked
    ``"packed"`` (:mod:`shared.profile_points`: each copy offered the same rate)."""
    p = result.point
    point = replace(
        p,
        offered_rate=p.offered_rate / copies,
        throughput=p.throughput / copies,
        colocation="packed",
    )
    return replace(result, point=point, nominal_rate=result.nominal_rate / copies)

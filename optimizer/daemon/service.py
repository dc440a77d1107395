"""The optimizer daemon: the control loop of DESIGN §3.8, with /health and /metrics.

Role: every ``optimizer.interval_s`` one pass, :meth:`Daemon.tick`: **read** (statistics of the
last window from the store and what each replica did in it, in a thread; what the backend
observes; live profile points derived from the replicas' loads, :mod:`optimizer.model.live`, and
saved; the stored profiles, replayed curves corrected by live points) →
**step** (:func:`optimizer.control.step.step`, pure, in a thread: detect a change, and on a
confirmed one search, place, plan and judge) → **execute** (a taken decision is rolled out
through the backend, :func:`optimizer.rollout.backend.execute`) → **record** (one row in the
decision log, :mod:`optimizer.store.decisions`, the metrics, :mod:`optimizer.daemon.metrics`,
and one log line) → **reprofile** (:func:`optimizer.control.reprofile.choose`, pure: a model
without a profile, a key the proposal wants that no point measures, a latency that strays from
its prediction; on GPUs no replica holds or the proposal wants, else the request waits), run
in the background by :class:`optimizer.daemon.reprofiler.Reprofiler`, which a later pass
harvests.
The daemon holds no decision logic: what it decides is the step's and the triggers'.
:func:`make_app` wraps a :class:`Daemon` into an aiohttp app whose ``cleanup_ctx`` runs the
loop; ``scepsy run`` (:mod:`optimizer.cli.run`) serves it.

Invariants:
- one event loop; DuckDB reads and writes and the step (the search) run in worker threads;
- the first pass observes the backend, which adopts engines already running: a restarted daemon
  re-plans from what runs and starts nothing twice (the executor is resumable);
- profiles are read from the store as they are (``scepsy profile`` writes them, the daemon adds
  live points each pass); a model without a replayed profile makes the pass an ``error``
  decision naming it, and nothing is rolled out (live points alone make no curve);
- a replica's load becomes a live point only if it passes :func:`optimizer.model.live.verdict`;
  a replica short of ``live.MIN_CALLS`` finished calls in the window is read over a window
  ``LIVE_WIDENING`` times as long (never before the first call, nor, by the verdict, before it
  started);
  "running since the window began" is when this daemon first observed the replica ready, so a
  restarted daemon learns nothing from its first window;
- the window never reaches back before the first recorded call, so a fresh store does not read
  as a low rate; it ends ``settle_s`` early for completions (see :class:`optimizer.stats.figures.Window`);
- the step refuses a plan that leaves a served model without a replica (after re-trying other
  layouts) or stops serving a model called in the last ``RECENT_S`` (read here each pass);
- every pass logs one line with its decision's kind, outcome and reasons (INFO; WARNING for an
  error or a failed rollout);
- a failed pass or rollout is logged and recorded; the loop keeps going. Cancelling the loop
  (SIGTERM) interrupts at most one await: engines keep running, and the next daemon resumes;
- ``/health/ready`` (and ``/health``, its old name) reports the passes: 503 with the last
  error after ``optimizer.health_failed_passes`` failed passes in a row, or when none has
  succeeded for 3 intervals + 60 s; ``/health/live`` is 200 while the server answers;
- at most one profiling run at a time (:mod:`optimizer.daemon.reprofiler`): passes go on
  meanwhile; its replica (a group id starting ``profiling-``) is left out of what the step
  plans from and is never routed; a rollout whose plan needs its GPUs cancels it first; the run
  is cancelled when the loop stops;
- an unreadable trace-store segment is skipped by the readers (:mod:`shared.store`), named in
  a warning and counted in ``scepsy_optimizer_store_unreadable_segments``: it fails no pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import asdict, dataclass, field, replace

import orjson
from aiohttp import web

from optimizer.control import step
from optimizer.control.decide import Decision, DetectorState, Proposal
from optimizer.control.proposal import Running, allocation_doc, cluster_without, running_doc
from optimizer.control.reprofile import ReprofileRun
from optimizer.control.step import RECENT_S, ControlState, StepInput, StepOutput
from optimizer.daemon import reprofiler
from optimizer.daemon.metrics import DaemonMetrics
from optimizer.daemon.reprofiler import Reprofiler
from optimizer.model import live
from optimizer.model.curves import ProfileBook
from optimizer.placement import Placement
from optimizer.plan.observed import Observed
from optimizer.plan.planner import Plan
from optimizer.profiling.window import SweepSettings
from optimizer.rollout.backend import Backend, execute
from optimizer.search.solve import SearchResult
from optimizer.stats.figures import Window, WorkflowStats
from optimizer.stats.reader import summarise_store
from optimizer.stats.replica_load import ReplicaLoad
from optimizer.stats.replicas import replica_loads_store
from optimizer.store import decisions, profiles
from optimizer.store.decisions import DecisionRow
from shared.cluster import cluster_from_settings
from shared.optimizer_settings import OptimizerSettings
from shared.profile_points import ProfilePoint
from shared.settings import Settings
from shared.store import StoreReader, unreadable_segments

__all__ = ["DAEMON", "Daemon", "TickReport", "make_app"]

log = logging.getLogger(__name__)
US = 1_000_000
# A replica with too few finished calls in the window for a live point (a slow or lightly used
# one) is read over a window twice, then four times as long: a slowed replica still teaches.
LIVE_WIDENING = (1, 2, 4)


@dataclass(frozen=True)
class TickReport:
    """One pass of the loop, for the demo's live view and for tests."""

    decision: Decision
    stats: Mapping[str, WorkflowStats]
    window_s: float
    running: Running
    predicted_now: Mapping[str, float]
    result: SearchResult | None = None
    placement: Placement | None = None
    plan: Plan | None = None
    outcome: str | None = None
    search_s: float | None = None
    rollout_s: float | None = None
    proposal: Proposal | None = None
    live_points: tuple[ProfilePoint, ...] = ()  # live profile points this pass saved


def first_call_us(store: str) -> int | None:
    """When the store's first recorded call started (``None``: nothing recorded yet)."""
    reader = StoreReader(store)
    try:
        rows = reader.read(lambda calls: calls.aggregate("min(t_start)").fetchall())
    finally:
        reader.close()
    return None if not rows or rows[0][0] is None else int(rows[0][0])


def recent_models(store: str, since_us: int) -> set[str]:
    """Models with a call recorded as starting at or after ``since_us``."""
    reader = StoreReader(store)
    try:
        rows = reader.read(lambda calls: calls.aggregate("model").fetchall(), since_us)
    finally:
        reader.close()
    return {str(r[0]) for r in rows if r[0] is not None}


def window_stats(
    store: str, now: float, cfg: OptimizerSettings, data_start_us: int | None
) -> tuple[dict[str, WorkflowStats], float]:
    """Statistics of the ``window_s`` ending at ``now`` (never before the first recorded call,
    ``data_start_us``; ``settle_s`` early for completions) and the window's length (s)."""
    now_us = round(now * US)
    lo = now_us - round(cfg.window_s * US)
    if data_start_us is not None:
        lo = max(lo, data_start_us)
    span_s = (now_us - lo) / US
    if data_start_us is None or span_s <= cfg.settle_s:
        return {}, span_s
    window = Window(lo, now_us, round(cfg.settle_s * US))
    return summarise_store(store, window), span_s - cfg.settle_s


def replica_window(
    now: float, cfg: OptimizerSettings, data_start_us: int | None
) -> tuple[tuple[int, ...], int] | None:
    """The statistics window of :func:`window_stats` as ``(starts, to)`` µs for the replicas'
    loads (ending ``settle_s`` early, as completions do), with the starts of the windows
    ``LIVE_WIDENING`` times as long, none before the first call; ``None`` when it is empty."""
    if data_start_us is None:
        return None
    now_us = round(now * US)
    hi = now_us - round(cfg.settle_s * US)
    starts = {max(now_us - round(k * cfg.window_s * US), data_start_us) for k in LIVE_WIDENING}
    kept = tuple(sorted(lo for lo in starts if lo < hi))  # replica_loads_store orders them
    return (kept, hi) if kept else None


@dataclass(frozen=True)
class _Read:
    """What a pass read: the window's statistics and length, the models called lately."""

    stats: dict[str, WorkflowStats]
    window_s: float
    recent_models: frozenset[str]
    loads: tuple[ReplicaLoad, ...] = ()  # what each replica did in the window


@dataclass
class Daemon:
    """The loop's state and one pass of it (:meth:`tick`); :meth:`run` repeats it."""

    settings: Settings
    backend: Backend
    clock: Callable[[], float] = time.time  # wall seconds (call records are epoch µs)
    metrics: DaemonMetrics = field(default_factory=DaemonMetrics)
    on_tick: Callable[[TickReport], None] | None = None
    control: ControlState = field(default_factory=ControlState)  # what the step remembers
    ticks: int = 0
    errors: int = 0
    last: TickReport | None = None
    last_tick_end: float | None = None  # monotonic, of the last successful pass
    failures_in_a_row: int = 0  # passes that raised since the last successful one
    last_error: str | None = None  # the last failed pass's error, one line
    started: float | None = None  # monotonic, when run() began
    _data_start_us: int | None = None
    _book_cache: tuple[int | None, ProfileBook] | None = None
    _seen_since: dict[str, float] = field(default_factory=dict)  # replica URL -> first seen ready
    # replica URL -> where the window of its last live point ended (epoch s): the next point
    # comes from a window after it (optimizer.model.live)
    _learned_until: dict[str, float] = field(default_factory=dict)
    reprofile_sweep: SweepSettings | None = None  # profiling runs' sweep (None: from settings)

    def __post_init__(self) -> None:
        self.cfg = self.settings.optimizer
        self.store = self.settings.store.path
        # the step derives both from the settings each pass; built here, a bad cluster
        # section or reserve_gpus fails the daemon's start instead of every pass
        self.cluster = cluster_from_settings(self.settings.cluster)
        self.search_cluster = cluster_without(self.cluster, self.cfg.reserve_gpus)
        self.gpu_types = {n.name: n.gpus[0].type for n in self.cluster.nodes if n.gpus}
        self.reprofiler = Reprofiler(
            self.settings,
            self.backend,
            self.metrics,
            self.cluster,
            self.gpu_types,
            self.clock,
            self.reprofile_sweep,
        )

    @property
    def reprofiles(self) -> list[ReprofileRun]:
        """The profiling runs this daemon started, oldest first."""
        return self.reprofiler.runs

    async def reprofile_done(self) -> None:
        """Wait for the profiling run in flight, if any, to end (tests, the demo)."""
        await self.reprofiler.done()

    @property
    def state(self) -> DetectorState:
        """The change detector's state (baseline, streaks, last rollout)."""
        return self.control.detector

    # --- one pass: read → step → execute → record ------------------------------------------
    async def tick(self) -> TickReport:
        now = self.clock()
        if await self.reprofiler.harvest():
            self._book_cache = None  # a run saved points: re-read the profiles
        read = await asyncio.to_thread(self._read, now)
        self.metrics.observe_stats(read.stats)
        observed_all = await self.backend.observe()
        observed = reprofiler.served(
            observed_all
        )  # a profiling replica is neither planned nor served
        await self.reprofiler.stop_orphans(observed_all)
        self._observe_allocation(observed)
        self._note_replicas(observed, now)
        learned = await self._learn(read.loads, observed)
        book = await self._book()
        self.metrics.observe_live_points(
            {m: sum(len(v) for k, v in book.live.items() if k.model == m) for m in _models(book)}
        )
        inp = StepInput(
            self.control,
            read.stats,
            read.window_s,
            observed,
            book,
            self.settings,
            now,
            read.recent_models,
        )
        out = await asyncio.to_thread(step.step, inp)
        self.metrics.observe_predicted(out.predicted_now)
        if out.searched_s is not None:
            self.metrics.search_time.observe(out.searched_s)
        report = TickReport(
            out.decision,
            read.stats,
            read.window_s,
            out.running,
            dict(out.predicted_now),
            out.result,
            out.placement,
            out.plan,
            search_s=out.search_s,
            proposal=out.proposal,
            live_points=learned,
        )
        report = await self._execute(out, report)
        await self._record(report)
        _log_decision(report)
        window_start = now - report.window_s - self.cfg.settle_s
        rolled = report.rollout_s is not None
        self.reprofiler.note_drift(self.ticks, window_start, read.stats, out.predicted_now, rolled)
        if not rolled:  # after a rollout what runs changed: the next pass looks again
            await self.reprofiler.consider(now, read.stats, observed_all, book, out.placement)
        self.ticks += 1
        self.last = report
        self.last_tick_end = time.monotonic()
        if self.on_tick is not None:
            self.on_tick(report)
        return report

    def _read(self, now: float) -> _Read:
        """Statistics of the window ending at ``now``, the window's length (s), and the models
        called in the last ``RECENT_S`` seconds."""
        try:
            stats, span = self._read_window(now)
            recent = recent_models(self.store, round((now - RECENT_S) * US))
            bounds = replica_window(now, self.cfg, self._data_start_us)
            loads = (
                ()
                if bounds is None
                else tuple(replica_loads_store(self.store, *bounds, min_calls=live.MIN_CALLS))
            )
            return _Read(stats, span, frozenset(recent), loads)
        finally:  # what the readers skipped, this pass (a bad segment never fails a pass)
            self.metrics.unreadable_segments.set(len(unreadable_segments(self.store)))

    def _read_window(self, now: float) -> tuple[dict[str, WorkflowStats], float]:
        if self._data_start_us is None:
            self._data_start_us = first_call_us(self.store)
        return window_stats(self.store, now, self.cfg, self._data_start_us)

    async def _execute(self, out: StepOutput, report: TickReport) -> TickReport:
        """Roll a taken decision out (unless ``optimizer.apply`` is false) and carry the
        state on: the step's, or after a rollout the one its outcome settles."""
        if not out.decision.taken or out.plan is None:
            self.control = out.state
            return report
        if not self.cfg.apply:
            self.control = out.after_rollout(self.clock(), ok=True)
            return replace(report, outcome="not applied (optimizer.apply is false)")
        t1 = time.monotonic()
        try:
            await self.reprofiler.yield_gpus(out.plan)
            await execute(out.plan, self.backend)
            outcome, ok = "ok", True
        except Exception as exc:  # a failed rollout is recorded; the loop goes on
            log.warning("rollout failed: %s", exc)
            outcome, ok = f"failed: {type(exc).__name__}: {exc}", False
        rollout_s = time.monotonic() - t1
        self._observe_allocation(reprofiler.served(await self.backend.observe()))
        self.metrics.rollouts.labels("ok" if ok else "failed").inc()
        self.metrics.rollout_time.observe(rollout_s)
        self.control = out.after_rollout(self.clock(), ok)
        return replace(report, outcome=outcome, rollout_s=rollout_s)

    def _note_replicas(self, observed: Observed, now: float) -> None:
        """Remember since when each ready replica (by URL) runs: its engine's start where the
        backend knows it (a restarted daemon learns from its first pass; an engine restarted
        at the same URL starts over), else when this daemon first saw it; forget the others."""
        ready = {r.url: r.started_at for r in observed.replicas if r.ready}
        since = {}
        for url, started in sorted(ready.items()):
            seen = self._seen_since.get(url)
            if started is None:
                since[url] = now if seen is None else seen
            else:
                since[url] = min(now, started) if seen is None else max(seen, min(now, started))
        self._seen_since = since

    async def _learn(
        self, loads: tuple[ReplicaLoad, ...], observed: Observed
    ) -> tuple[ProfilePoint, ...]:
        """The window's trusted replica loads as live profile points, saved to the store."""
        if not loads:
            return ()
        replayed = sorted((await self._book()).profiles)
        engines: dict[str, str] = {}
        for key in replayed:  # the engine of the model's replayed profile (first by key)
            engines.setdefault(key.model, key.engine)
        points = live.live_points(
            loads,
            observed.replicas,
            self._seen_since,
            self.gpu_types,
            engines,
            self.cfg.window_s / 2,
            self._learned_until,
        )
        # keyed as live_points keys its points (no trailing slash); replicas gone are forgotten
        running = {u.rstrip("/") for u in self._seen_since}
        kept = {u: t for u, t in self._learned_until.items() if u in running}
        self._learned_until = kept | {u: p.observed_at for u, p in points.items()}
        if points:
            await profiles.save_points_async(self.store, list(points.values()))
            self._book_cache = None  # re-read, whatever the file's time stamp says
        return tuple(points.values())

    async def _book(self) -> ProfileBook:
        """The stored profiles, re-read only when the database file changed."""
        try:
            stamp = os.stat(profiles.db_path(self.store)).st_mtime_ns
        except FileNotFoundError:
            stamp = None
        if self._book_cache is None or self._book_cache[0] != stamp:
            points = await profiles.load_points_async(self.store) if stamp is not None else []
            self._book_cache = (stamp, ProfileBook(points))
        return self._book_cache[1]

    def _observe_allocation(self, observed: Observed) -> None:
        replicas: dict[str, int] = {}
        gpus: dict[str, float] = {}
        for r in observed.replicas:
            replicas[r.model] = replicas.get(r.model, 0) + 1
            gpus[r.model] = gpus.get(r.model, 0.0) + r.tp * r.share
        self.metrics.observe_allocation(replicas, gpus)

    async def _record(self, report: TickReport) -> None:
        d = report.decision
        self.metrics.decisions.labels(d.kind).inc()
        predicted = None
        if report.result is not None:
            predicted = {
                w.workflow: {
                    "current": _num(report.predicted_now.get(w.workflow)),
                    "proposed": _num(w.latency),
                }
                for w in report.result.workflows
            }
        elif report.predicted_now:
            predicted = {w: {"current": _num(v)} for w, v in report.predicted_now.items()}
        row = DecisionRow(
            t=d.t,
            kind=d.kind,
            taken=d.taken,
            outcome=report.outcome,
            reasons=d.reasons,
            changes=tuple(asdict(c) for c in d.changes),
            gain=_num(d.gain),
            benefit_s=_num(d.benefit_s),
            cost_s=_num(d.cost_s),
            search_s=report.search_s,
            rollout_s=report.rollout_s,
            rates={w: s.arrival_rate for w, s in report.stats.items()},
            observed={
                w: s.latency_mean for w, s in report.stats.items() if math.isfinite(s.latency_mean)
            },
            predicted=predicted,
            allocation=(
                allocation_doc(report.result)
                if report.result is not None
                else running_doc(report.running)
            ),
            plan=tuple(report.plan.render().splitlines()) if report.plan is not None else (),
        )
        await decisions.save_decision_async(self.store, row)

    # --- the loop --------------------------------------------------------------------------
    async def run(self) -> None:
        """Tick every ``interval_s`` until cancelled (a profiling run in flight is cancelled
        too: its replica is stopped)."""
        self.started = time.monotonic()
        try:
            while True:
                t0 = time.monotonic()
                try:
                    await self.tick()
                    self.failures_in_a_row, self.last_error = 0, None
                except Exception as exc:  # one bad pass (store, backend down) is not fatal
                    self.errors += 1
                    self.failures_in_a_row += 1
                    self.last_error = " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
                    log.exception("optimizer pass failed")
                await asyncio.sleep(max(0.0, self.cfg.interval_s - (time.monotonic() - t0)))
        finally:
            await self.reprofiler.close()

    def health(self) -> tuple[bool, dict[str, object]]:
        """Readiness: ``False`` once ``health_failed_passes`` passes in a row failed
        ("failing", with the last error), or when no pass has succeeded for 3 intervals + 60 s
        since the last success or the start ("stalled"); ``True`` before the first pass is
        due. Liveness is the server answering at all (``/health/live``)."""
        now = time.monotonic()
        since = self.last_tick_end if self.last_tick_end is not None else self.started
        failing = self.failures_in_a_row >= self.cfg.health_failed_passes
        stalled = since is not None and now - since >= 3 * self.cfg.interval_s + 60.0
        status = "failing" if failing else "stalled" if stalled else "ok"
        age = None if self.last_tick_end is None else now - self.last_tick_end
        return status == "ok", {
            "status": status,
            "ticks": self.ticks,
            "errors": self.errors,
            "failed_passes_in_a_row": self.failures_in_a_row,
            "last_error": self.last_error,
            "seconds_since_last_pass": age,
            "last_decision": None if self.last is None else self.last.decision.kind,
            "unreadable_segments": len(unreadable_segments(self.store)),
        }


def _log_decision(report: TickReport) -> None:
    """One line per pass: what was decided, what came of it, and why."""
    d = report.decision
    bad = d.kind == "error" or (report.outcome or "").startswith("failed")
    log.log(
        logging.WARNING if bad else logging.INFO,
        "decision %s%s: %s",
        d.kind,
        f" ({report.outcome})" if report.outcome else "",
        "; ".join(d.reasons) or "no reasons given",
        extra={
            "event": "decision",
            "kind": d.kind,
            "taken": d.taken,
            "outcome": report.outcome,
            "reasons": list(d.reasons),
            "gain": _num(d.gain),
        },
    )


def _models(book: ProfileBook) -> list[str]:
    return sorted({k.model for k in book.profiles} | {k.model for k in book.live})


def _num(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


# --- the app ---------------------------------------------------------------------------------
DAEMON = web.AppKey("daemon", Daemon)


async def _health(request: web.Request) -> web.Response:
    """Readiness (``/health/ready``, and ``/health`` as before): 503 while passes fail."""
    ok, body = request.app[DAEMON].health()
    return web.Response(
        status=200 if ok else 503, body=orjson.dumps(body), content_type="application/json"
    )


async def _live(request: web.Request) -> web.Response:
    """Liveness: the process and its event loop answer, whatever the passes do (a restart
    would not mend an unreadable store or a backend that is down)."""
    return web.Response(body=b'{"status":"alive"}', content_type="application/json")


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(
        body=request.app[DAEMON].metrics.exposition(),
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )


async def _loop_ctx(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(app[DAEMON].run(), name="optimizer-loop")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def make_app(daemon: Daemon, *, loop: bool = True) -> web.Application:
    """The daemon's HTTP face; ``loop=False`` serves /health and /metrics without running
    the loop (tests drive :meth:`Daemon.tick` themselves)."""
    app = web.Application()
    app[DAEMON] = daemon
    app.router.add_get("/health", _health)
    app.router.add_get("/health/ready", _health)
    app.router.add_get("/health/live", _live)
    app.router.add_get("/metrics", _metrics)
    if loop:
        app.cleanup_ctx.append(_loop_ctx)
    return app

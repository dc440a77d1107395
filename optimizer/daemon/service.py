"""The optimizer daemon: the control loop of DESIGN §3.8, with /health and /metrics.

Role: every ``optimizer.interval_s``: statistics of the last window (DuckDB, in a thread) →
change detection against the baseline (:mod:`optimizer.control.decide`) → only on a confirmed change:
the allocation search and placement (in a thread) → plan against what the backend observes →
decide → roll out through the backend (:func:`optimizer.rollout.backend.execute`). Every pass leaves one
row in the decision log (:mod:`optimizer.store.decisions`) and updates the metrics
(:mod:`optimizer.daemon.metrics`). :func:`make_app` wraps a :class:`Daemon` into an aiohttp app
whose ``cleanup_ctx`` runs the loop; ``scepsy run`` (:mod:`optimizer.cli.run`) serves it.

Invariants:
- one event loop; DuckDB reads and writes and the search run in worker threads;
- the first pass observes the backend, which adopts engines already running: a restarted daemon
  re-plans from what runs and starts nothing twice (the executor is resumable);
- profiles are read from the store as they are (``scepsy profile`` writes them); a model
  without a profile makes the pass an ``error`` decision naming it, and nothing is rolled out;
- the window never reaches back before the first recorded call, so a fresh store does not read
  as a low rate; it ends ``settle_s`` early for completions (see :class:`optimizer.stats.figures.Window`);
- no rollout leaves a served model without a replica: a plan that would is re-tried on other
  layouts of the same allocation, else refused (``optimizer.reserve_gpus`` keeps room for
  temporary copies); a plan that stops serving a model called in the last ``RECENT_S`` is
  refused too (a workflow below ``min_requests`` may still use it);
- a workflow once planned for keeps its last trusted pipeline: a model whose calls are all
  still running (calls are recorded when they end) is not taken for a model it stopped using;
- every pass logs one line with its decision's kind, outcome and reasons (INFO; WARNING for an
  error or a failed rollout);
- a failed pass or rollout is logged and recorded; the loop keeps going. Cancelling the loop
  (SIGTERM) interrupts at most one await: engines keep running, and the next daemon resumes;
- ``/health/ready`` (and ``/health``, its old name) reports the passes: 503 with the last
  error after ``optimizer.health_failed_passes`` failed passes in a row, or when none has
  succeeded for 3 intervals + 60 s; ``/health/live`` is 200 while the server answers;
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

from optimizer.control.decide import (
    Decision,
    Detection,
    DetectorState,
    after_rollout,
    detect,
    failed,
    judge,
    keep_running,
    snapshot_from_stats,
)
from optimizer.control.proposal import (
    Running,
    allocation_doc,
    cluster_variants,
    cluster_without,
    make_proposal,
    pipelines,
    predict_running,
    remembered,
    running_allocation,
    running_doc,
    search_problem,
)
from optimizer.daemon.metrics import DaemonMetrics
from optimizer.model.alp import Pipeline
from optimizer.model.curves import ProfileBook
from optimizer.placement import Placement, PlacementError, place
from optimizer.plan.planner import Observed, Plan, make_plan, target_from_placement
from optimizer.rollout.backend import Backend, execute
from optimizer.search.solve import SearchResult, replica_demands, search_and_place
from optimizer.stats.figures import Window, WorkflowStats
from optimizer.stats.reader import summarise_store
from optimizer.store.decisions import DecisionRow, save_decision_async
from optimizer.store.profiles import db_path, load_points_async
from shared.cluster import cluster_from_settings
from shared.settings import Settings
from shared.store import StoreReader, unreadable_segments

__all__ = ["DAEMON", "Daemon", "TickReport", "make_app"]

log = logging.getLogger(__name__)
US = 1_000_000
RECENT_S = 120.0  # a model called this recently is still in use, whatever the window says


class PlanningError(RuntimeError):
    """The search or placement found nothing to roll out (the message says why)."""


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


@dataclass
class Daemon:
    """The loop's state and one pass of it (:meth:`tick`); :meth:`run` repeats it."""

    settings: Settings
    backend: Backend
    clock: Callable[[], float] = time.time  # wall seconds (call records are epoch µs)
    metrics: DaemonMetrics = field(default_factory=DaemonMetrics)
    on_tick: Callable[[TickReport], None] | None = None
    state: DetectorState = field(default_factory=DetectorState)
    ticks: int = 0
    errors: int = 0
    last: TickReport | None = None
    last_tick_end: float | None = None  # monotonic, of the last successful pass
    failures_in_a_row: int = 0  # passes that raised since the last successful one
    last_error: str | None = None  # the last failed pass's error, one line
    started: float | None = None  # monotonic, when run() began
    _data_start_us: int | None = None
    _book_cache: tuple[int | None, ProfileBook] | None = None
    _known: dict[str, Pipeline] = field(default_factory=dict)  # last trusted pipelines
    _placed: Placement | None = None  # the layout the last plan was made for

    def __post_init__(self) -> None:
        self.cfg = self.settings.optimizer
        self.store = self.settings.store.path
        self.cluster = cluster_from_settings(self.settings.cluster)
        self.search_cluster = cluster_without(self.cluster, self.cfg.reserve_gpus)

    # --- one pass --------------------------------------------------------------------------
    def _read(self, now: float) -> tuple[dict[str, WorkflowStats], float]:
        """Statistics of the window ending at ``now``, and the window's length (s)."""
        try:
            return self._read_window(now)
        finally:  # what the readers skipped, this pass (a bad segment never fails a pass)
            self.metrics.unreadable_segments.set(len(unreadable_segments(self.store)))

    def _read_window(self, now: float) -> tuple[dict[str, WorkflowStats], float]:
        if self._data_start_us is None:
            self._data_start_us = first_call_us(self.store)
        now_us = round(now * US)
        lo = now_us - round(self.cfg.window_s * US)
        if self._data_start_us is not None:
            lo = max(lo, self._data_start_us)
        span_s = (now_us - lo) / US
        if self._data_start_us is None or span_s <= self.cfg.settle_s:
            return {}, span_s
        window = Window(lo, now_us, round(self.cfg.settle_s * US))
        return summarise_store(self.store, window), span_s - self.cfg.settle_s

    async def tick(self) -> TickReport:
        now = self.clock()
        stats, span = await asyncio.to_thread(self._read, now)
        self.metrics.observe_stats(stats)
        observed = await self.backend.observe()
        self._observe_allocation(observed)
        pipes = {
            w: remembered(p, self._known.get(w)) for w, p in pipelines(self._planned(stats)).items()
        }
        self._known |= {
            w: p for w, p in pipes.items() if stats[w].requests >= self.cfg.min_requests
        }
        rates = {w: s.arrival_rate for w, s in stats.items()}
        # A planned workflow without a completed request in this window (its requests all
        # still running) keeps its pipeline; its rate is the arrivals the store saw (open rows
        # count), or the baseline's when it saw none, until the detector confirms it is gone.
        base = self.state.baseline
        for w, known in self._known.items():
            if w not in pipes and base is not None and w in base.workflows:
                arrived = stats[w].arrival_rate if w in stats and stats[w].arrivals else 0.0
                pipes[w], rates[w] = known, arrived or base.workflows[w].rate
        book = await self._book()
        running = running_allocation(observed, pipes, rates)
        predicted_now = predict_running(pipes, book, running, rates)
        self.metrics.observe_predicted(predicted_now)
        det = detect(self.state, snapshot_from_stats(now, span, stats), self.cfg, predicted_now)
        # The decision is filled in below; the rest is what this pass saw.
        seen = TickReport(Decision(now, "steady", ()), stats, span, running, predicted_now)
        if det.act:
            report = await self._replan(seen, det, observed, pipes, rates, book)
        else:
            decision, self.state = judge(self.state, det, None, self.cfg)
            report = replace(seen, decision=decision)
        await self._record(report)
        _log_decision(report)
        self.ticks += 1
        self.last = report
        self.last_tick_end = time.monotonic()
        if self.on_tick is not None:
            self.on_tick(report)
        return report

    async def _replan(
        self,
        report: TickReport,
        det: Detection,
        observed: Observed,
        pipes: Mapping[str, Pipeline],
        rates: Mapping[str, float],
        book: ProfileBook,
    ) -> TickReport:
        """Search, place and plan for the window's traffic; judge; roll out if decided."""
        t0 = time.perf_counter()
        if not pipes:
            decision, self.state = keep_running(
                self.state,
                det,
                "no workflow has enough traffic to plan for: what runs stays",
                self.cfg,
            )
            return replace(report, decision=decision)
        try:
            unknown = sorted(
                {st.model for p in pipes.values() for st in p.stages}
                - set(self.settings.rollout.revisions())
            )
            if unknown:
                raise PlanningError(
                    f"model(s) {', '.join(unknown)} not in rollout.models: "
                    "the daemon cannot start them"
                )
            missing = sorted(
                {st.model for p in pipes.values() for st in p.stages}
                - {k.model for k in book.profiles}
            )
            if missing:
                raise PlanningError(
                    f"no profile for model(s) {', '.join(missing)}: run "
                    "`scepsy profile` (profiles are read from the store)"
                )
            problem = search_problem(self.settings, pipes, rates, book, self.search_cluster)
            placed = await asyncio.to_thread(search_and_place, problem)
            search_s = time.perf_counter() - t0
            self.metrics.search_time.observe(search_s)
            if placed.placement is None:
                raise PlanningError("no placement fits: " + (placed.failures or ("?",))[-1])
            plan = self._safe_plan(observed, placed.result, placed.placement)
            called = await asyncio.to_thread(
                recent_models, self.store, round((det.t - RECENT_S) * US)
            )
            orphaned = sorted(
                set(plan.dropped)
                & (called | {m for ws in report.stats.values() for m in ws.models})
            )
            if orphaned:  # a workflow below min_requests still calls them: wait for it
                raise PlanningError(
                    f"the plan would stop serving {', '.join(orphaned)}, which still get calls "
                    "from a workflow without enough requests to plan for yet"
                )
            proposal = make_proposal(placed.result, plan, report.predicted_now, rates)
        except (PlanningError, ValueError) as exc:  # SearchError, ProfileError, ... are these
            decision, self.state = failed(self.state, det, f"{type(exc).__name__}: {exc}")
            return replace(report, decision=decision, search_s=time.perf_counter() - t0)
        decision, decided = judge(self.state, det, proposal, self.cfg)
        report = replace(
            report,
            decision=decision,
            result=placed.result,
            placement=self._placed or placed.placement,
            plan=plan,
            search_s=search_s,
        )
        if not decision.taken:
            self.state = decided
            return report
        if not self.cfg.apply:
            self.state = after_rollout(decided, self.state, self.clock(), ok=True)
            return replace(report, outcome="not applied (optimizer.apply is false)")
        t1 = time.monotonic()
        try:
            await execute(plan, self.backend)
            outcome, ok = "ok", True
        except Exception as exc:  # a failed rollout is recorded; the loop goes on
            log.warning("rollout failed: %s", exc)
            outcome, ok = f"failed: {type(exc).__name__}: {exc}", False
        rollout_s = time.monotonic() - t1
        self._observe_allocation(await self.backend.observe())
        self.metrics.rollouts.labels("ok" if ok else "failed").inc()
        self.metrics.rollout_time.observe(rollout_s)
        self.state = after_rollout(decided, self.state, self.clock(), ok)
        return replace(report, outcome=outcome, rollout_s=rollout_s)

    def _safe_plan(self, observed: Observed, result: SearchResult, placement: Placement) -> Plan:
        """The plan to ``placement``, or to another layout of the same allocation whose plan
        leaves no served model without a replica; :class:`PlanningError` if none does."""
        revisions = self.settings.rollout.revisions()
        plan = make_plan(observed, target_from_placement(placement, revisions), self.cluster)
        self._placed = placement
        if plan.safe:
            return plan
        floors = {m.name: m.min_memory_bytes for m in self.settings.rollout.models}
        demands = replica_demands(result, floors)
        for variant in cluster_variants(self.search_cluster)[1:]:
            try:
                other = place(variant, demands)
            except PlacementError:
                continue
            alt = make_plan(observed, target_from_placement(other, revisions), self.cluster)
            if alt.safe:
                self._placed = other
                return alt
        raise PlanningError(
            f"no rollout order keeps every model served ({', '.join(plan.outages)} would be "
            "without a replica for a while); optimizer.reserve_gpus leaves room for "
            "temporary copies"
        )

    def _planned(self, stats: Mapping[str, WorkflowStats]) -> dict[str, WorkflowStats]:
        """The workflows to plan for: those with enough completed requests in the window, and
        those that had enough when last judged and still have some. A trickle (an index
        build) is not traffic to plan for; a real workflow dipping below the bar keeps its
        replicas. (A new workflow is planned for once it has enough requests.)"""
        base = self.state.baseline
        before = set() if base is None else set(base.trusted(self.cfg.min_requests))
        return {
            w: s
            for w, s in stats.items()
            if s.requests >= self.cfg.min_requests or (w in before and s.requests > 0)
        }

    async def _book(self) -> ProfileBook:
        """The stored profiles, re-read only when the database file changed."""
        try:
            stamp = os.stat(db_path(self.store)).st_mtime_ns
        except FileNotFoundError:
            stamp = None
        if self._book_cache is None or self._book_cache[0] != stamp:
            points = await load_points_async(self.store) if stamp is not None else []
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
        await save_decision_async(self.store, row)

    # --- the loop --------------------------------------------------------------------------
    async def run(self) -> None:
        """Tick every ``interval_s`` until cancelled."""
        self.started = time.monotonic()
        while True:
            t0 = time.monotonic()
            try:
                await self.tick()
                self.failures_in_a_row, self.last_error = 0, None
            except Exception as exc:  # one bad pass (store unreadable, backend down) is not fatal
                self.errors += 1
                self.failures_in_a_row += 1
                self.last_error = " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
                log.exception("optimizer pass failed")
            await asyncio.sleep(max(0.0, self.cfg.interval_s - (time.monotonic() - t0)))

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

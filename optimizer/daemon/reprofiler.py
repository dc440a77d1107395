"""The daemon's profiling runs: when to start one, the one in flight, and what it did.

Role: the stateful, effectful side of reprofiling for :class:`optimizer.daemon.service.Daemon`
(the triggers and the GPU budget are pure, :mod:`optimizer.control.reprofile`; one run is
:func:`optimizer.profiling.auto.reprofile`). Each pass the daemon calls :meth:`Reprofiler.harvest`
(settle a run that ended: save its points, record it), :meth:`Reprofiler.stop_orphans`,
:meth:`Reprofiler.note_drift` (the pass's predicted vs observed latency) and
:meth:`Reprofiler.consider` (start what the triggers ask for, or record that it waits); before a
rollout :meth:`Reprofiler.yield_gpus`; on shutdown :meth:`Reprofiler.close`.

Invariants:
- at most one run, in a background task; the daemon's passes go on meanwhile;
- its points are saved and its rows written by :meth:`harvest`, called by a pass, so every
  store write stays in the pass's order (no write races the pass's reads);
- a run whose GPUs a rollout needs is cancelled first (its replica stopped); a profiling group
  no run of this daemon owns (a stopped daemon's) is stopped;
- every start, end, failure, cancellation and wait is one decision-log row (kind
  ``reprofile``, ``reprofile_waiting``, recorded once per wait), one log line and a count in
  ``scepsy_optimizer_reprofiles_total{reason,outcome}``; ``scepsy_optimizer_reprofile_running``
  is 1 while a run is in flight;
- nothing is profiled while ``optimizer.apply`` is false or ``optimizer.reprofile.enabled`` is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from optimizer.control import reprofile
from optimizer.control.reprofile import DriftSample, ReprofileRequest, ReprofileRun, Slot
from optimizer.daemon.metrics import DaemonMetrics
from optimizer.model.curves import ProfileBook
from optimizer.placement import Placement
from optimizer.plan.observed import Observed
from optimizer.plan.planner import Plan
from optimizer.profiling import auto
from optimizer.profiling.auto import ReprofileOutcome
from optimizer.profiling.window import SweepSettings
from optimizer.rollout.backend import Backend
from optimizer.stats.figures import WorkflowStats
from optimizer.store import decisions, profiles
from optimizer.store.decisions import DecisionRow
from shared.cluster import Cluster
from shared.settings import Settings

__all__ = ["Reprofiler", "served"]

log = logging.getLogger(__name__)


@dataclass
class Reprofiler:
    """The daemon's profiling runs (module docstring)."""

    settings: Settings
    backend: Backend
    metrics: DaemonMetrics
    cluster: Cluster
    gpu_types: Mapping[str, str]  # node -> its GPU type
    clock: Callable[[], float]
    sweep: SweepSettings | None = None  # the runs' sweep (None: from the settings)
    runs: list[ReprofileRun] = field(default_factory=list)  # runs started, oldest first
    _reprofiling: _Reprofiling | None = None  # the run in flight, or ended and not harvested
    _drift: list[DriftSample] = field(default_factory=list)  # the last passes' predictions
    _drift_since: float = -math.inf  # drift counts windows starting after this (a change)
    _waiting: str | None = None  # the last reprofile_waiting recorded (recorded once)

    def __post_init__(self) -> None:
        self.cfg = self.settings.optimizer.reprofile
        self.default_gpu_type = next(iter(self.gpu_types.values()), "")

    def note_drift(
        self,
        index: int,
        window_start: float,
        stats: Mapping[str, WorkflowStats],
        predicted: Mapping[str, float],
        rolled_out: bool,
    ) -> None:
        """Remember pass ``index``'s predicted and observed latency per workflow, for the
        drift trigger; a rollout forgets them (the next windows measure another allocation),
        and a window starting before the allocation or the profiles changed is not counted."""
        if rolled_out:
            self._drift.clear()
            self._drift_since = self.clock()
            return
        if window_start < self._drift_since:
            return
        for w, ws in stats.items():
            if w in predicted:
                self._drift.append(
                    DriftSample(index, w, predicted[w], ws.latency_mean, ws.requests)
                )
        keep = self.cfg.drift_windows
        self._drift = [s for s in self._drift if s.index > index - keep]

    async def consider(
        self,
        now: float,
        stats: Mapping[str, WorkflowStats],
        observed: Observed,
        book: ProfileBook,
        wanted: Placement | None,
    ) -> None:
        """Start the profiling run the triggers ask for on GPUs the budget finds (``observed``:
        every replica, profiling ones too; ``wanted``: the last proposal's placement), or
        record that it waits; nothing while one runs or with ``optimizer.apply`` false."""
        cfg = self.cfg
        if not cfg.enabled or not self.settings.optimizer.apply or self._reprofiling is not None:
            return
        inp = reprofile.TriggerInput(
            stats,
            book,
            served(observed).replicas,
            reprofile.wanted_keys(wanted, self.gpu_types),
            tuple(self._drift),
            tuple(self.runs),
            frozenset(self.settings.rollout.revisions()),
            self.gpu_types,
            self.default_gpu_type,
            cfg,
            now,
        )
        choice = reprofile.choose(inp, self.cluster, observed.replicas, wanted)
        req = choice.request
        if req is None or choice.slot is None:
            note = None if req is None else f"{req.model}: {choice.waiting}"
            if req is not None and note != self._waiting:
                self.metrics.reprofiles.labels(req.reason, "waiting").inc()
                log.info("reprofile waits: %s (%s)", note, req.detail)
                await self._record(now, "reprofile_waiting", req, f"waiting: {note}")
            self._waiting = note
            return
        self._waiting = None
        self.runs.append(
            ReprofileRun(
                req.model, req.gpu_type, req.tp, req.share, req.reason, now, copies=req.copies
            )
        )
        task = asyncio.create_task(
            auto.reprofile(
                req,
                choice.slot,
                self.backend,
                self.settings,
                book=book,
                sweep=self.sweep,
                save=False,
            ),
            name=f"reprofile-{req.model}",
        )
        group = auto.profiling_group(req, choice.slot, self.settings).id
        self._reprofiling = _Reprofiling(req, choice.slot, group, task)
        task.add_done_callback(lambda _: self.metrics.reprofile_running.set(0))
        self.metrics.reprofile_running.set(1)
        self.metrics.reprofiles.labels(req.reason, "started").inc()
        log.info(
            "reprofile started: %s tp=%d share=%g x%d on %s GPU %s (%s: %s)",
            req.model,
            req.tp,
            req.share,
            req.copies,
            choice.slot.node,
            ",".join(map(str, choice.slot.gpus)),
            req.reason,
            req.detail,
        )
        await self._record(now, "reprofile", req, "started", choice.slot)

    async def harvest(self) -> bool:
        """Settle a profiling run that ended: save its points, record and count its outcome,
        restart the drift windows; ``True`` when profiles were saved (re-read them)."""
        run = self._reprofiling
        if run is None or not run.task.done():
            return False
        self._reprofiling = None
        req, t = run.request, self.clock()
        self.runs = [replace(r, finished=t) if r.finished is None else r for r in self.runs]
        if run.task.cancelled():
            self.metrics.reprofiles.labels(req.reason, "cancelled").inc()
            log.info("reprofile of %s cancelled; its replica was stopped", req.model)
            await self._record(t, "reprofile", req, "cancelled", run.slot)
            return False
        exc = run.task.exception()
        if exc is not None:
            self.metrics.reprofiles.labels(req.reason, "failed").inc()
            log.warning("reprofile of %s failed: %s: %s", req.model, type(exc).__name__, exc)
            outcome = f"failed: {type(exc).__name__}: {exc}"
            await self._record(t, "reprofile", req, outcome, run.slot)
            return False
        result = run.task.result()
        if result.points:
            await profiles.save_points_async(self.settings.store.path, result.points)
            self._drift.clear()
            self._drift_since = t
        self.metrics.reprofiles.labels(req.reason, "ok").inc()
        log.info("reprofile done: %s", result.summary())
        await self._record(t, "reprofile", req, f"ok: {result.summary()}", run.slot, result)
        return bool(result.points)

    async def yield_gpus(self, plan: Plan) -> None:
        """Cancel the profiling run if the rollout's target needs its GPUs (a profile never
        keeps GPUs from a served model); its replica is stopped before the rollout starts."""
        run = self._reprofiling
        if run is None or run.task.done():
            return
        # the groups it starts (new ones, temporary copies) and the ones it ends with
        starts = [(s.node, s.gpus) for s in plan.steps if s.kind == "start"]
        starts += [(g.node, g.gpus) for g in plan.target]
        if any(n == run.slot.node and set(gs) & set(run.slot.gpus) for n, gs in starts):
            log.info("reprofile of %s cancelled: the rollout needs its GPUs", run.request.model)
            await _cancel(run.task)

    async def stop_orphans(self, observed: Observed) -> None:
        """Stop profiling groups this daemon does not run (a daemon that stopped mid-run left
        them): nothing else would ever free their GPUs."""
        mine = None if self._reprofiling is None else self._reprofiling.group
        for gid in sorted({r.group for r in observed.replicas if reprofile.is_profiling(r)}):
            if gid != mine:
                log.warning("stopping profiling group %s, which no run of this daemon owns", gid)
                await self.backend.stop(gid)

    async def done(self) -> None:
        """Wait for the profiling run in flight, if any, to end (tests, the demo)."""
        if self._reprofiling is not None:
            await asyncio.wait([self._reprofiling.task])

    async def _record(
        self,
        t: float,
        kind: str,
        req: ReprofileRequest,
        outcome: str,
        slot: Slot | None = None,
        result: ReprofileOutcome | None = None,
    ) -> None:
        """One decision-log row for a profiling run's start, end or wait: its key, why, where,
        and what it changed (points saved, ``T_m`` of the key before and after)."""
        change: dict[str, object] = {
            "model": req.model,
            "gpu_type": req.gpu_type,
            "tp": req.tp,
            "share": req.share,
            "reason": req.reason,
        }
        if slot is not None:
            change |= {"node": slot.node, "gpus": list(slot.gpus)}
        if result is not None:
            change |= {
                "points_saved": len(result.points),
                "points_untrusted": len(result.untrusted),
                "saturation_before": _num(result.saturation_before),
                "saturation_after": _num(result.saturation_after),
                "seconds": result.seconds,
            }
        row = DecisionRow(
            t=t,
            kind=kind,
            taken=False,
            outcome=outcome,
            reasons=(f"{req.reason}: {req.detail}",),
            changes=(change,),
        )
        await decisions.save_decision_async(self.settings.store.path, row)

    async def close(self) -> None:
        """Cancel the run in flight, if any (its replica is stopped)."""
        if self._reprofiling is not None:
            await _cancel(self._reprofiling.task)


def served(observed: Observed) -> Observed:
    """What runs without the profiling replicas (the routes are the proxies' as they are)."""
    replicas = tuple(r for r in observed.replicas if not reprofile.is_profiling(r))
    if len(replicas) == len(observed.replicas):
        return observed
    return replace(observed, replicas=replicas)


def _num(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


@dataclass(frozen=True)
class _Reprofiling:
    """The profiling run in flight (or ended, until a pass harvests it)."""

    request: ReprofileRequest
    slot: Slot
    group: str  # the profiling group's id
    task: asyncio.Task[ReprofileOutcome]


async def _cancel(task: asyncio.Task[ReprofileOutcome]) -> None:
    """Cancel ``task`` and wait for it to end (its ``finally`` stops the replica)."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task

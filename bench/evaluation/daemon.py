"""The dynamic scenario: the daemon's decision logic against the autoscaler, over time.

Role: ``bench.evaluation.evaluate``'s second scenario. Beam search holds a steady rate while the RAG rate
steps up and down; both systems run in ``bench.evaluation.dynsim`` on the same arrivals (same seed):

- scepsy: the optimizer daemon's loop with its default settings (``OptimizerSettings``): every
  ``interval_s`` the calls of the last ``window_s`` are written to a trace store as the proxy
  writes them (``sim.trace.call_rows``; calls still in flight as open rows,
  ``sim.trace.open_rows``, so queued requests count) and summarised
  (``optimizer.stats.reader.summarise_store``), the detector
  (``optimizer.control.decide.detect``) looks for confirmed changes, and on one the search runs at the
  observed rates (``optimizer.search.solve.search_and_place``) and ``optimizer.control.decide.judge`` decides;
  a rollout starts the changed models' new replicas, which serve after ``cold_start_s``, then
  the replaced ones drain (make-before-break; # assumed: spare capacity for the overlap, which
  the real rollout provides with surge replicas only where GPUs are free). The proposal is
  built here from the search result (``optimizer.control.proposal`` was not final when this was
  written). It starts from the allocation planned for the first step's rates.
- hpa: ``bench.evaluation.dynsim.Hpa`` over all five models, from one replica each.

Reported: per system, reconfigurations (Scepsy: rollouts; HPA: syncs that started or retired
pods) in total and per rate step, replicas started, mean latency per workflow, and latency over
time (30 s buckets by arrival). Every figure is simulated.
"""

from __future__ import annotations

import functools
import itertools
import shutil
import tempfile
from collections import Counter
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.evaluation.dynsim import DynamicSimulation, Hpa, run_dynamic
from bench.evaluation.runs import COLD_START_S
from bench.evaluation.scepsy import Knowledge, capacity, plan, problem, specs_of
from bench.evaluation.setup import (
    COMBINED_BEAM_FRACTION,
    DYNAMIC_DRAIN_S,
    workflow_models,
    workloads,
)
from optimizer.control.decide import (
    DetectorState,
    Outlook,
    Proposal,
    after_rollout,
    detect,
    judge,
    snapshot_from_stats,
)
from optimizer.model.alp import ModelAlloc, predict
from optimizer.search.solve import SearchResult, search_and_place
from optimizer.stats.figures import Window
from optimizer.stats.reader import summarise_store
from shared.optimizer_settings import OptimizerSettings
from shared.settings import StoreSettings
from shared.store import SegmentWriter
from sim.cluster import Allocation
from sim.des import SimResult
from sim.trace import DEFAULT_T0_US, call_rows, open_rows

STEPS = (0.25, 0.7, 0.25, 0.55)  # RAG rate per step, x Scepsy's RAG capacity next to beam
BUCKET_S = 30.0
FLUSH_S = StoreSettings().flush_interval_s  # the proxy announces calls running this long
Running = dict[str, dict[str, ModelAlloc]]


def _running(result: SearchResult) -> Running:
    return {w.workflow: dict(w.allocation) for w in result.workflows}


def _allocation(running: Running) -> Allocation:
    return specs_of((m, a.replicas, a.tp, a.share) for w in running.values() for m, a in w.items())


@dataclass
class Daemon:
    """The daemon's loop as a simulator controller (see the module docstring)."""

    k: Knowledge
    gpus: int
    running: Running
    cfg: OptimizerSettings = field(default_factory=OptimizerSettings)
    state: DetectorState = field(default_factory=DetectorState)
    store: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="scepsy-daemon-")))
    decisions: list[dict[str, Any]] = field(default_factory=list)
    rollouts: list[float] = field(default_factory=list)
    unplaced: list[float] = field(default_factory=list)  # rollouts decided, not placeable
    started: int = 0
    _written: int = 0
    _announced: set[int] = field(default_factory=set)  # calls written as open rows

    @property
    def interval_s(self) -> float:
        return self.cfg.interval_s

    def _record(self, sim: DynamicSimulation) -> None:
        """What the proxy would have written by now: the calls finished since the last tick,
        and open rows for the calls running for at least a flush interval, once each."""
        new = sim.trace[self._written :]
        self._written = len(sim.trace)
        rows = []
        if new:
            shell = SimResult(
                "simulated", sim.seed, sim.now, 0.0, 0, (0.0, sim.now), {}, (), tuple(new)
            )
            rows = call_rows(shell, bodies=False)
        running = [
            c
            for c in sim.open_calls()
            if c.t_start <= sim.now - FLUSH_S and c.call_id not in self._announced
        ]
        self._announced.update(c.call_id for c in running)
        rows += open_rows(running, seed=sim.seed)
        if rows:
            writer = SegmentWriter(self.store, "simulated")
            try:
                writer.write(rows)
            finally:
                writer.close()

    def _predict(self, running: Running, rates: dict[str, float]) -> dict[str, float]:
        out = {}
        for w, rate in rates.items():
            if w in running and rate > 0:
                out[w] = predict(self.k.pipelines[w], self.k.book, running[w], rate).latency
        return out

    def tick(self, sim: DynamicSimulation) -> None:
        self._record(sim)
        cfg, now = self.cfg, sim.now
        # The trace starts with the run (t = 0): a window reaching before it would read the
        # rates low (arrivals over the whole window length), so it starts there.
        start = max(0.0, now - cfg.window_s)
        window = Window(
            DEFAULT_T0_US + round(start * 1e6),
            DEFAULT_T0_US + round(now * 1e6),
            round(cfg.settle_s * 1e6),
        )
        stats = summarise_store(self.store, window)
        snap = snapshot_from_stats(now, now - start, stats)
        rates = {w: o.rate for w, o in snap.workflows.items() if w in self.k.pipelines}
        det = detect(self.state, snap, cfg, self._predict(self.running, rates))
        if not det.act:
            decision, self.state = judge(self.state, det, None, cfg)
            self.decisions.append({"t": now, "kind": decision.kind})
            return
        targets = {w: rates.get(w, 0.0) for w in self.running}
        targets = {w: r for w, r in targets.items() if r > 0}
        placed = search_and_place(problem(self.k, targets, self.gpus))
        proposed = _running(placed.result)
        current = self._predict(self.running, targets)
        outlook = tuple(
            Outlook(w, r, current.get(w, float("inf")), placed.result.workflow(w).latency)
            for w, r in targets.items()
        )
        old, new = _allocation(self.running), _allocation(proposed)
        before = Counter(old.replicas)
        moved = sum((Counter(new.replicas) - before).values())
        total = sum(s.count for s in new.replicas)
        same = Counter(new.replicas) == before
        proposal = Proposal(
            outlook, placed.result.feasible, moved / max(total, 1) if not same else 0.0, same
        )
        prior = self.state
        decision, decided = judge(prior, det, proposal, cfg)
        self.decisions.append(
            {"t": now, "kind": decision.kind, "reasons": decision.reasons, "rates": targets}
        )
        self.state = decided
        if decision.taken and placed.placement is None:
            # the search's allocation does not place (fragmentation): nothing can roll out
            self.unplaced.append(now)
            self.decisions[-1]["kind"] = "rollout_unplaced"
            self.decisions[-1]["failures"] = placed.failures
            self.state = prior
        elif decision.taken:
            self._roll_out(sim, self.running, proposed)
            self.running = proposed
            self.rollouts.append(now)
            self.state = after_rollout(decided, prior, now + sim.cold_start_s, ok=True)

    def _roll_out(self, sim: DynamicSimulation, old: Running, new: Running) -> None:
        """Start the models whose configuration changed; retire their old replicas once the
        new ones serve."""

        def per_model(r: Running) -> dict[str, tuple[tuple[int, int, float], ...]]:
            out: dict[str, list[tuple[int, int, float]]] = {}
            for w in r.values():
                for m, a in w.items():
                    out.setdefault(m, []).append((a.replicas, a.tp, round(a.share, 6)))
            return {m: tuple(sorted(v)) for m, v in out.items()}

        a, b = per_model(old), per_model(new)
        changed = sorted(m for m in b if a.get(m) != b[m])
        if not changed:
            return
        fresh = specs_of((m, d, tp, s) for m in changed for d, tp, s in b[m])
        self.started += sum(s.count for s in fresh.replicas)
        victims = [r for m in changed for r in sim.serving(m)]
        sim.start(fresh, then=lambda _live: sim.retire(victims))


def _timeline(sim: DynamicSimulation, horizon: float) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {}
    for w, spec in enumerate(sim.workloads):
        buckets: dict[int, list[float]] = {}
        for r in sim.runs:
            if r.workflow == w and r.end >= 0 and not r.failed and r.arrival < horizon:
                buckets.setdefault(int(r.arrival // BUCKET_S), []).append(r.end - r.arrival)
        out[spec.label] = [
            ((b + 0.5) * BUCKET_S, float(np.mean(v))) for b, v in sorted(buckets.items())
        ]
    return out


def _run(
    args: tuple[str, Knowledge, int, float, list[tuple[float, float]], float, int],
) -> dict[str, Any]:
    system, k, gpus, beam_rate, steps, duration, seed = args
    specs = workloads("combined", steps[0][1], beam_rate)
    controller: Daemon | Hpa
    if system == "scepsy":
        first = plan(k, {"beam": beam_rate, "rag": steps[0][1]}, gpus)
        running = {
            w: {
                m: ModelAlloc(s.count, s.tp, s.share)
                for m in workflow_models(w)
                for s in first.allocation.replicas
                if s.model == m
            }
            for w in ("beam", "rag")
        }
        controller = Daemon(k, gpus, running)
        initial = first.allocation
    else:
        controller = Hpa(workflow_models("combined"), gpus)
        initial = controller.initial()
    sim = DynamicSimulation(
        initial, specs, seed, controller, COLD_START_S, record_calls=system == "scepsy"
    )
    for t, rate in steps[1:]:
        sim.at(t, functools.partial(sim.set_rate, 1, rate))
    try:
        res = run_dynamic(sim, duration, 0.0, DYNAMIC_DRAIN_S)
    finally:
        if isinstance(controller, Daemon):
            shutil.rmtree(controller.store, ignore_errors=True)
    if isinstance(controller, Daemon):
        times = list(controller.rollouts)
        started = controller.started
        log: Any = controller.decisions
        unplaced = list(controller.unplaced)
    else:
        times = sorted({c.t for c in sim.changes if c.kind in ("start", "retire")})
        started = sum(c.count for c in sim.changes if c.kind == "start")
        log = controller.log
        unplaced = []
    bounds = [t for t, _ in steps] + [duration]
    per_step = [sum(1 for t in times if lo <= t < hi) for lo, hi in itertools.pairwise(bounds)]
    return {
        "reconfigurations": len(times),
        "per_step": per_step,
        "rollout_times": times,
        "replicas_started": started,
        "rollouts_unplaced": unplaced,
        "latency_mean": {w: r.latency.mean for w, r in res.workflows.items()},
        "latency_p90": {w: r.latency.p90 for w, r in res.workflows.items()},
        "failed": {w: r.failed for w, r in res.workflows.items()},
        "timeline": _timeline(sim, duration),
        "log": log,
        "wall_s": res.wall_s,
    }


def scenario(k: Knowledge, pool: Executor, gpus: int, quick: bool) -> dict[str, Any]:
    beam_rate = COMBINED_BEAM_FRACTION * capacity(k, "beam", gpus)
    top = plan(k, {"beam": beam_rate, "rag": 1e4}, gpus).predicted["rag"]["throughput"]
    step_s = 480.0 if quick else 900.0
    steps = [(i * step_s, f * top) for i, f in enumerate(STEPS)]
    duration = step_s * len(STEPS)
    runs = list(
        pool.map(_run, [(s, k, gpus, beam_rate, steps, duration, 7) for s in ("scepsy", "hpa")])
    )
    return {
        "label": "simulated",
        "gpus": gpus,
        "beam_rate": beam_rate,
        "steps": steps,
        "step_s": step_s,
        "duration_s": duration,
        "controller": "optimizer.control.decide detect/judge with default OptimizerSettings "
        "(interval 60 s, window 120 s, 3 windows to confirm, cooldown 300 s)",
        "systems": dict(zip(("scepsy", "hpa"), runs, strict=True)),
    }

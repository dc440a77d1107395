"""The dynamic scenario: the optimizer daemon's pass against the autoscaler, over time.

Role: ``bench.evaluation.evaluate``'s second scenario. Beam search holds a steady rate while the
RAG rate steps up and down; both systems run in ``sim.dynamic`` on the same arrivals (same seed):

- scepsy: the optimizer daemon's pass, :func:`optimizer.control.step.step`, the very function
  ``optimizer.daemon.service.Daemon.tick`` calls, with the daemon's default settings
  (``OptimizerSettings``; the search's granularity and headroom are the evaluation's, which
  are the defaults) on the scenario's cluster. This module is only the glue that stands in for
  the daemon's reads and its backend, as :class:`SimulatedDaemon`: every ``interval_s``
  1. read: the calls the proxy would have written by now go to a trace store
     (``sim.trace.call_rows``; calls in flight for a flush interval as open rows,
     ``sim.trace.open_rows``, so queued requests count), and the window is read as the daemon
     reads it (``optimizer.daemon.service.window_stats``, ``recent_models``); what runs is the
     simulator's replicas as a backend observes them; profiles are the evaluation's
     (``Knowledge.book``);
  2. step;
  3. execute: a taken decision's plan runs on the simulator step by step: ``start`` starts a
     GPU group's replicas laid out where the placement put them (``sim.dynamic.colocate``),
     ``wait_ready`` waits the ``cold_start_s`` they take, ``add_route`` routes them (they serve
     from ready on), ``drain`` withdraws replicas and waits until they finished what they hold
     or ``rollout.drain_s`` passed (as the local backend does), and ``stop`` forgets them
     (# assumed: a simulated replica still finishes its calls after the stop, and its GPUs
     contend with nothing started after it). The daemon's pass awaits its rollout, so ticks falling inside one are
     skipped (# assumed: the next pass keeps the interval grid; the daemon's would follow the
     rollout at once); the cooldown runs from the rollout's end;
  4. record: one entry per pass in ``decisions``.
  It starts from the allocation searched and placed for the first step's rates, with the
  evaluation's pipelines (``Knowledge.pipelines``).
- hpa: ``sim.hpa.Hpa`` over all five models, from one replica each; hpa_warm: the same HPA
  from the pod counts its rule settles on at the first step's rates
  (``sim.hpa.settled_counts``), as Scepsy starts from its allocation for them.

Reported: per system, reconfigurations (Scepsy: rollouts; HPA: syncs that started or retired
pods) in total and per rate step, replicas started, mean latency per workflow, and latency over
time (30 s buckets by arrival); for Scepsy also the passes whose change could not be placed or
planned without leaving a model unserved (``rollouts_unplaced``: no rollout happened). Every
figure is simulated.
"""

from __future__ import annotations

import functools
import itertools
import shutil
import tempfile
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.evaluation.runs import COLD_START_S
from bench.evaluation.scepsy import Knowledge, capacity, capacity_beside, specs_of
from bench.evaluation.setup import (
    COMBINED_BEAM_FRACTION,
    DYNAMIC_DRAIN_S,
    GRANULARITY,
    HEADROOM,
    cluster,
    memory_floor_bytes,
    workflow_models,
    workloads,
)
from optimizer.control.proposal import cluster_without, search_problem
from optimizer.control.step import RECENT_S, ControlState, StepInput, step
from optimizer.daemon.service import US, first_call_us, recent_models, window_stats
from optimizer.plan.observed import Observed, Route, RunningReplica
from optimizer.plan.planner import Plan
from optimizer.plan.target import GroupSpec, target_from_placement
from optimizer.search.solve import search_and_place
from shared.cluster import GB, Cluster, cluster_from_settings, settings_mapping
from shared.optimizer_settings import OptimizerSettings
from shared.settings import Settings, StoreSettings, settings_from_mapping
from shared.store import SegmentWriter
from sim.cluster import Allocation, Replica
from sim.des import SimResult
from sim.dynamic import DynamicSimulation, colocate, run_dynamic
from sim.hpa import Hpa, settled_counts
from sim.trace import DEFAULT_T0_US, call_rows, open_rows

STEPS = (0.25, 0.7, 0.25, 0.55)  # RAG rate per step, x Scepsy's RAG capacity next to beam
BUCKET_S = 30.0
FLUSH_S = StoreSettings().flush_interval_s  # the proxy announces calls running this long
T0 = DEFAULT_T0_US / US  # the trace store's epoch second of simulated time 0
DRAIN_POLL_S = 1.0  # how often a drain looks whether the replicas finished
UNPLACED = ("PlanningError: no placement fits", "PlanningError: no rollout order")


def daemon_settings(gpus: int, store: Path) -> Settings:
    """The daemon's settings for the scenario: defaults, on the evaluation's cluster, with the
    evaluation's models and memory floors (and its search granularity and headroom)."""
    models = sorted(set(workflow_models("combined")))
    return settings_from_mapping(
        {
            "store": {"path": str(store)},
            "cluster": settings_mapping(cluster(gpus)),
            "rollout": {
                "models": [{"name": m, "min_memory_gb": memory_floor_bytes(m) / GB} for m in models]
            },
            "optimizer": {
                "granularity": GRANULARITY,
                "headroom": HEADROOM,
                "cold_start_s": COLD_START_S,
            },
        },
        env=None,
    )


def _gpu_ids(c: Cluster) -> dict[tuple[str, int], int]:
    """A simulator GPU index per (node, GPU) of the cluster."""
    pairs = [(n.name, g.index) for n in c.nodes for g in n.gpus]
    return {p: i for i, p in enumerate(pairs)}


def _running(group: GroupSpec, ready: bool) -> list[RunningReplica]:
    return list(group.running(lambda rid: f"sim://{rid}", ready))


@dataclass
class SimulatedDaemon:
    """The daemon's loop on the simulator: read → step → execute → record (module docstring)."""

    k: Knowledge
    settings: Settings
    control: ControlState = field(default_factory=ControlState)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    rollouts: list[float] = field(default_factory=list)  # when a rollout was decided (sim s)
    rollout_ends: list[float] = field(default_factory=list)  # when each one ended
    unplaced: list[float] = field(default_factory=list)  # changes not placeable or plannable
    started: int = 0  # replicas started by rollouts
    replicas: dict[str, RunningReplica] = field(default_factory=dict)  # what a backend sees
    routed: set[str] = field(default_factory=set)  # replica ids the proxies route to
    engines: dict[str, Replica] = field(default_factory=dict)  # replica id -> simulated one
    busy: bool = False  # a rollout is in flight: the daemon's pass is awaiting it
    _data_start_us: int | None = None
    _written: int = 0
    _announced: set[int] = field(default_factory=set)  # calls written as open rows

    def __post_init__(self) -> None:
        self.cfg = self.settings.optimizer
        self.store = self.settings.store.path
        self.cluster = cluster_from_settings(self.settings.cluster)
        self.gpu_ids = _gpu_ids(self.cluster)

    @property
    def interval_s(self) -> float:
        return self.cfg.interval_s

    # --- the start: what runs before the first pass ----------------------------------------
    def initial(self, rates: Mapping[str, float]) -> tuple[GroupSpec, ...]:
        """The target groups of the allocation searched and placed for ``rates``, with the
        evaluation's pipelines."""
        search_cluster = cluster_without(self.cluster, self.cfg.reserve_gpus)
        pipes = {w: self.k.pipelines[w] for w in rates}
        problem = search_problem(self.settings, pipes, rates, self.k.book, search_cluster)
        placed = search_and_place(problem)
        if placed.placement is None:
            raise ValueError(
                "the first step's allocation does not place: " + "; ".join(placed.failures)
            )
        return target_from_placement(placed.placement, self.settings.rollout.revisions())

    def adopt(self, groups: tuple[GroupSpec, ...], engines: list[Replica]) -> None:
        """``engines``, the simulation's initial replicas (built from :func:`allocation_of`
        ``groups``, in that order), run ``groups``: ready, routed, laid out as placed."""
        running = [r for g in groups for r in _running(g, ready=True)]
        for r, e in zip(running, engines, strict=True):
            assert e.spec.model == r.model, (e.spec.model, r.model)
            self.replicas[r.id], self.engines[r.id] = r, e
            self.routed.add(r.id)
        colocate(engines, [self.sim_gpus(r) for r in running])

    def sim_gpus(self, r: RunningReplica) -> tuple[int, ...]:
        return tuple(self.gpu_ids[(r.node, g)] for g in r.gpus)

    # --- one pass ---------------------------------------------------------------------------
    def tick(self, sim: DynamicSimulation) -> None:
        self._write(sim)
        if self.busy:  # the daemon's pass is still awaiting its rollout
            return
        # read
        now = T0 + sim.now
        if self._data_start_us is None:
            self._data_start_us = first_call_us(self.store)
        stats, span = window_stats(self.store, now, self.cfg, self._data_start_us)
        recent = frozenset(recent_models(self.store, round((now - RECENT_S) * US)))
        routes = tuple(
            Route(self.replicas[r].model, self.replicas[r].url) for r in sorted(self.routed)
        )
        observed = Observed(tuple(self.replicas.values()), routes)
        # step
        inp = StepInput(
            self.control, stats, span, observed, self.k.book, self.settings, now, recent
        )
        out = step(inp)
        # record (a rollout's outcome is added when it ends)
        d = out.decision
        entry: dict[str, Any] = {
            "t": sim.now,
            "kind": d.kind,
            # what runs, predicted at the window's rates (None: past its capacity)
            "predicted": {w: _finite(x) for w, x in out.predicted_now.items()},
        }
        if d.kind not in ("no_data", "steady", "pending"):
            entry |= {"reasons": d.reasons, "rates": {w: s.arrival_rate for w, s in stats.items()}}
        self.decisions.append(entry)
        if d.kind == "error" and d.reasons[-1].startswith(UNPLACED):
            self.unplaced.append(sim.now)
        # execute
        if not d.taken or out.plan is None:
            self.control = out.state
            return
        self.rollouts.append(sim.now)
        self.busy = True

        def done() -> None:
            entry["outcome"] = "ok"
            self.rollout_ends.append(sim.now)
            self.control = out.after_rollout(T0 + sim.now, ok=True)
            self.busy = False

        _Rollout(self, sim, out.plan, done).advance()

    def _write(self, sim: DynamicSimulation) -> None:
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


def _finite(x: float) -> float | None:
    return x if np.isfinite(x) else None


def step_check(
    sim: DynamicSimulation,
    steps: list[tuple[float, float]],
    duration: float,
    spans: list[tuple[float, float]],
    passes: list[dict[str, Any]],
    window_s: float,
) -> list[dict[str, Any]]:
    """The issue's promise per rate step: once the step's rollout ended (``spans``: each
    rollout's start and end; none in the step: from the step's start), each workflow's mean
    latency over the requests arriving until the step ends, against the steady-state
    prediction: what runs predicted at the observed rates by the last pass in the step whose
    window started after that rollout ended (``None`` where none did). ``unfinished``:
    those requests still running at the end of the run."""
    out = []
    bounds = [t for t, _ in steps] + [duration]
    for lo, hi in itertools.pairwise(bounds):
        settled = max([end for start, end in spans if lo <= start < hi] + [lo])
        judged = [p for p in passes if settled + window_s <= p["t"] <= hi]
        predicted = judged[-1]["predicted"] if judged else {}
        row: dict[str, Any] = {"from": lo, "to": hi, "settled": settled, "workflows": {}}
        for w, spec in enumerate(sim.workloads):
            runs = [r for r in sim.runs if r.workflow == w and settled <= r.arrival < hi]
            done = [r.end - r.arrival for r in runs if r.end >= 0 and not r.failed]
            mean = float(np.mean(done)) if done else None
            pred = predicted.get(spec.label)
            row["workflows"][spec.label] = {
                "observed": mean,
                "predicted": pred,
                "ratio": mean / pred if mean is not None and pred else None,
                "requests": len(runs),
                "unfinished": len(runs) - len(done),
            }
        out.append(row)
    return out


def _drained(engines: list[Replica]) -> bool:
    return all(e.outstanding == 0 and not e.engine.has_work() for e in engines)


def allocation_of(groups: tuple[GroupSpec, ...]) -> Allocation:
    """The simulator's allocation of ``groups``: one spec per replica, in order."""
    return specs_of((r.spec.model, 1, r.spec.tp, r.spec.share) for g in groups for r in g.replicas)


@dataclass
class _Rollout:
    """A plan executed on the simulator, step by step (see the module docstring)."""

    daemon: SimulatedDaemon
    sim: DynamicSimulation
    plan: Plan
    done: Callable[[], None]
    next: int = 0
    ready: set[str] = field(default_factory=set)  # groups whose started replicas serve

    def advance(self) -> None:
        d, steps = self.daemon, self.plan.steps
        while self.next < len(steps):
            s = steps[self.next]
            if s.kind == "start":
                self._start(self.plan.group(s.group))
            elif s.kind == "wait_ready" and s.group not in self.ready:
                return  # resumed once the group serves
            elif s.kind == "add_route":
                d.routed.update(s.replicas)
            elif s.kind == "drain":  # consecutive drains go together, as the executor's
                batch = list(itertools.takewhile(lambda x: x.kind == "drain", steps[self.next :]))
                ids = [r for b in batch for r in b.replicas]
                engines = [d.engines[r] for r in ids if r in d.engines]
                self.sim.retire(engines)
                d.routed.difference_update(ids)
                self.next += len(batch)
                if not _drained(engines):
                    self._wait_drained(engines, self.sim.now + d.settings.rollout.drain_s)
                    return  # resumed once they finished what they hold, or at the deadline
                continue
            elif s.kind == "stop":
                for r in s.replicas:
                    d.replicas.pop(r, None)
                    d.engines.pop(r, None)
                    d.routed.discard(r)
            self.next += 1
        self.done()

    def _wait_drained(self, engines: list[Replica], deadline: float) -> None:
        def check() -> None:
            if _drained(engines) or self.sim.now >= deadline:
                self.advance()
            else:
                self._wait_drained(engines, deadline)

        self.sim.at(min(self.sim.now + DRAIN_POLL_S, deadline), check)

    def _start(self, group: GroupSpec) -> None:
        d = self.daemon
        fresh = [r for r in _running(group, ready=False) if r.id not in d.replicas]
        if not fresh:
            self.ready.add(group.id)
            return
        d.started += len(fresh)
        d.replicas |= {r.id: r for r in fresh}

        def serving(_live: list[Replica]) -> None:
            d.replicas |= {r.id: replace(r, ready=True) for r in fresh}
            self.ready.add(group.id)
            self.advance()

        allocation = specs_of((r.model, 1, r.tp, r.share) for r in fresh)
        engines = self.sim.start(allocation, then=serving)
        colocate(engines, [d.sim_gpus(r) for r in fresh])
        d.engines |= {r.id: e for r, e in zip(fresh, engines, strict=True)}


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
    controller: SimulatedDaemon | Hpa
    store = Path(tempfile.mkdtemp(prefix="scepsy-daemon-"))
    groups: tuple[GroupSpec, ...] = ()
    if system == "scepsy":
        controller = SimulatedDaemon(k, daemon_settings(gpus, store))
        groups = controller.initial({"beam": beam_rate, "rag": steps[0][1]})
        initial = allocation_of(groups)
    else:
        models = workflow_models("combined")
        controller = Hpa(models, gpus)
        warm = settled_counts(models, gpus, specs, seed, 150.0) if system == "hpa_warm" else None
        initial = controller.initial(warm)
    try:
        sim = DynamicSimulation(
            initial, specs, seed, controller, COLD_START_S, record_calls=system == "scepsy"
        )
        if isinstance(controller, SimulatedDaemon):
            controller.adopt(groups, list(sim.replicas))
        for t, rate in steps[1:]:
            sim.at(t, functools.partial(sim.set_rate, 1, rate))
        res = run_dynamic(sim, duration, 0.0, DYNAMIC_DRAIN_S)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    checks: list[dict[str, Any]] = []
    if isinstance(controller, SimulatedDaemon):
        times = list(controller.rollouts)
        started = controller.started
        log: Any = controller.decisions
        unplaced = list(controller.unplaced)
        ends = controller.rollout_ends + [duration] * (len(times) - len(controller.rollout_ends))
        spans = list(zip(times, ends, strict=True))  # one still running ends with the run
        checks = step_check(sim, steps, duration, spans, log, controller.cfg.window_s)
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
        "steps": checks,
        "log": log,
        "wall_s": res.wall_s,
    }


def _controller(o: OptimizerSettings) -> str:
    return (
        "optimizer.control.step.step (the daemon's pass) with default OptimizerSettings "
        f"(interval {o.interval_s:g} s, window {o.window_s:g} s, {o.windows_to_confirm} "
        f"windows to confirm a shift, {o.overload_windows_to_confirm} an overload or 1 when "
        f"the live window shows it too, cooldown {o.cooldown_s:g} s)"
    )


def scenario(k: Knowledge, pool: Executor, gpus: int, quick: bool) -> dict[str, Any]:
    beam_rate = COMBINED_BEAM_FRACTION * capacity(k, "beam", gpus)
    top = capacity_beside(k, "rag", {"beam": beam_rate}, gpus)
    step_s = 480.0 if quick else 900.0
    steps = [(i * step_s, f * top) for i, f in enumerate(STEPS)]
    duration = step_s * len(STEPS)
    systems = ("scepsy", "hpa", "hpa_warm")
    runs = list(pool.map(_run, [(s, k, gpus, beam_rate, steps, duration, 7) for s in systems]))
    return {
        "label": "simulated",
        "gpus": gpus,
        "beam_rate": beam_rate,
        "steps": steps,
        "step_s": step_s,
        "duration_s": duration,
        "controller": _controller(OptimizerSettings()),
        "systems": dict(zip(systems, runs, strict=True)),
    }

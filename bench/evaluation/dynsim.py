"""A simulator whose replicas change mid-run, and the Kubernetes HPA-style autoscaler on it.

Role: ``sim.des.simulate`` runs one fixed allocation; the autoscaler baseline and the daemon
scenario of ``bench.evaluation.evaluate`` need replicas that start and stop while requests are in flight.
:class:`DynamicSimulation` drives the simulator through its run-time hook
(``sim.des.Simulation.at`` / ``add_replicas`` / ``withdraw`` / ``set_rate``): a controller ticks
every ``interval_s`` simulated seconds and may start replicas (serving after ``cold_start_s``),
retire replicas (no new calls; in-flight calls finish: a drain) and change a workload's rate.
Queues, caches and in-flight requests carry over, so oscillation shows.

:class:`Hpa` is the Kubernetes HorizontalPodAutoscaler (autoscaling/v2 defaults) per model:
whole GPUs, TP 1; metric: GPU utilisation (busy fraction of the last sync period, what DCGM's
GPU_UTIL reports) averaged over the model's pods; ``desired = ceil(Σ utilisation / target)``
with pods still starting counted at 0% (as the HPA does for unready pods when scaling up);
no change within the 10% tolerance; scale-up at most max(2x, +4 pods) per sync; scale-down to
the highest recommendation of the last 300 s (the default stabilisation window); a pod that
finds no free GPU stays Pending until one frees (drained pods free theirs).

Invariants: the same (initial allocation, workloads, controller, seed) gives the same run; a
model always keeps at least one serving replica; GPU indices of replicas started later do
not overlap earlier ones (co-location contention is modelled only within one start batch).
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from sim.cluster import Allocation, Replica, ReplicaSpec, build_replicas
from sim.des import SimResult, Simulation, WorkloadSpec, simulate

__all__ = ["Controller", "DynamicSimulation", "Hpa", "HpaSettings", "run_dynamic"]

ENGINE_KW: dict[str, Any] = {
    "max_num_batched_tokens": 8192,
    "max_num_seqs": 256,
    "enable_prefix_caching": True,
}
# Route as the static points do: sim.des.simulate's default is the product proxy's policy.
ROUTING = inspect.signature(simulate).parameters["routing"].default


class Controller(Protocol):
    @property
    def interval_s(self) -> float: ...

    def tick(self, sim: DynamicSimulation) -> None: ...


@dataclass
class Change:
    t: float
    kind: str  # "start" | "ready" | "retire" | "rate"
    model: str
    count: int
    detail: str = ""


class DynamicSimulation(Simulation):
    """The simulator with control events (see the module docstring)."""

    def __init__(
        self,
        allocation: Allocation,
        workloads: Sequence[WorkloadSpec],
        seed: int,
        controller: Controller,
        cold_start_s: float,
        record_calls: bool = False,
    ) -> None:
        super().__init__(allocation, workloads, seed, ROUTING, record_calls, True, dict(ENGINE_KW))
        self.controller = controller
        self.cold_start_s = cold_start_s
        self.starting: list[Replica] = []
        self.retired: list[Replica] = []
        self.changes: list[Change] = []
        self._generation = 0
        self._serial = len(self.replicas)
        self.at(controller.interval_s, self._tick)

    def _tick(self) -> None:
        self.controller.tick(self)
        self.at(self.now + self.controller.interval_s, self._tick)

    # --- what controllers see and do (besides ``serving`` and ``at``) --------------------
    def draining(self) -> list[Replica]:
        self.retired = [r for r in self.retired if r.outstanding > 0 or r.engine.has_work()]
        return self.retired

    def start(
        self,
        allocation: Allocation,
        then: Callable[[list[Replica]], None] | None = None,
    ) -> list[Replica]:
        """Start ``allocation``'s replicas; they serve after the cold start, then ``then``
        runs with them (e.g. retire what they replace: make-before-break)."""
        self._generation += 1
        fresh = build_replicas(allocation, **ENGINE_KW)
        for r in fresh:
            r.gpus = tuple(g + 1000 * self._generation for g in r.gpus)
            r.name = f"{r.spec.model}/{self._serial}"
            self._serial += 1
        self.starting.extend(fresh)
        for model, n in _counts(fresh).items():
            self.changes.append(Change(self.now, "start", model, n))

        def ready() -> None:
            live = [r for r in fresh if r in self.starting]
            for r in live:
                self.starting.remove(r)
            self.add_replicas(live)
            for model, n in _counts(live).items():
                self.changes.append(Change(self.now, "ready", model, n))
            if then is not None:
                then(live)

        self.at(self.now + self.cold_start_s, ready)
        return fresh

    def cancel(self, replica: Replica) -> None:
        """Stop a replica that is still starting."""
        self.starting.remove(replica)
        self.changes.append(Change(self.now, "cancel", replica.spec.model, 1))

    def retire(self, replicas: Sequence[Replica]) -> None:
        """No new calls for ``replicas``; they finish what they hold."""
        self.retired += [r for r in replicas if self.withdraw(r)]
        for model, n in _counts(list(replicas)).items():
            self.changes.append(Change(self.now, "retire", model, n))

    def set_rate(self, index: int, rate: float) -> None:
        super().set_rate(index, rate)
        self.changes.append(
            Change(self.now, "rate", self.workloads[index].label, 0, f"{rate:.4g}/s")
        )


def _counts(replicas: Sequence[Replica]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in replicas:
        out[r.spec.model] = out.get(r.spec.model, 0) + 1
    return out


def run_dynamic(
    sim: DynamicSimulation, duration_s: float, warmup_s: float, drain_s: float
) -> SimResult:
    wall = time.perf_counter()
    window_end = sim.run(duration_s, None, drain_s)
    return sim.result(warmup_s, window_end, time.perf_counter() - wall)


@dataclass(frozen=True)
class HpaSettings:
    sync_s: float = 15.0  # --horizontal-pod-autoscaler-sync-period
    target_utilisation: float = 0.7  # averageUtilization target # assumed (common 60-80%)
    tolerance: float = 0.1  # --horizontal-pod-autoscaler-tolerance
    scale_down_window_s: float = 300.0  # behavior.scaleDown.stabilizationWindowSeconds
    scale_up_pods: int = 4  # default scale-up policy: max(100%, 4 pods) per 15 s


@dataclass
class Hpa:
    """One HPA per model over a pool of whole GPUs (see the module docstring)."""

    models: tuple[str, ...]
    gpus: int
    gpu: str = "a6000"
    settings: HpaSettings = field(default_factory=HpaSettings)
    interval_s: float = 15.0
    pending: dict[str, int] = field(default_factory=dict)
    history: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    _busy: dict[str, float] = field(default_factory=dict)
    log: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.interval_s = self.settings.sync_s

    def initial(self) -> Allocation:
        """minReplicas = 1 per model."""
        return Allocation(tuple(ReplicaSpec(m, self.gpu, 1, 1.0, 1) for m in self.models))

    def _utilisation(self, r: Replica, dt: float) -> float:
        last = self._busy.get(r.name, 0.0)
        self._busy[r.name] = r.busy_time
        return min(1.0, max(0.0, (r.busy_time - last) / dt))

    def _used(self, sim: DynamicSimulation) -> int:
        return (
            sum(len(sim.serving(m)) for m in self.models) + len(sim.starting) + len(sim.draining())
        )

    def tick(self, sim: DynamicSimulation) -> None:
        s, now = self.settings, sim.now
        record: dict[str, Any] = {"t": now}
        for m in self.models:
            ready = sim.serving(m)
            starting = [r for r in sim.starting if r.spec.model == m]
            current = len(ready) + len(starting) + self.pending.get(m, 0)
            usage = sum(self._utilisation(r, self.interval_s) for r in ready)
            ratio = usage / (s.target_utilisation * current) if current else 1.0
            raw = (
                current
                if abs(ratio - 1.0) <= s.tolerance
                else max(1, math.ceil(usage / s.target_utilisation))
            )
            raw = min(raw, max(2 * current, current + s.scale_up_pods), self.gpus)
            hist = [(t, d) for t, d in self.history.get(m, []) if t > now - s.scale_down_window_s]
            hist.append((now, raw))
            self.history[m] = hist
            desired = raw if raw >= current else min(current, max(d for _, d in hist))
            record[m] = {
                "utilisation": usage / max(len(ready), 1),
                "desired": desired,
                "ready": len(ready),
                "starting": len(starting),
                "pending": self.pending.get(m, 0),
            }
            if desired > current:
                self.pending[m] = self.pending.get(m, 0) + desired - current
            elif desired < current:
                self._scale_down(sim, m, current - desired, starting, ready)
        self._start_pending(sim)
        self.log.append(record)

    def _scale_down(
        self, sim: DynamicSimulation, m: str, n: int, starting: list[Replica], ready: list[Replica]
    ) -> None:
        cut = min(n, self.pending.get(m, 0))
        self.pending[m] = self.pending.get(m, 0) - cut
        n -= cut
        for r in reversed(starting):  # unready pods go first, newest first
            if n == 0:
                return
            sim.cancel(r)
            n -= 1
        victims = list(reversed(ready))[: min(n, len(ready) - 1)]
        if victims:
            sim.retire(victims)

    def _start_pending(self, sim: DynamicSimulation) -> None:
        free = self.gpus - self._used(sim)
        while free > 0 and any(v > 0 for v in self.pending.values()):
            for m in self.models:  # round-robin over models with pending pods
                if free > 0 and self.pending.get(m, 0) > 0:
                    self.pending[m] -= 1
                    free -= 1
                    sim.start(Allocation((ReplicaSpec(m, self.gpu, 1, 1.0, 1),)))

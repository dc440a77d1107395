"""The Kubernetes HorizontalPodAutoscaler as a controller of a :class:`sim.dynamic.DynamicSimulation`.

Role: the autoscaler baseline of ``bench.evaluation.evaluate`` (its static points and its
dynamic scenario). :class:`Hpa` is the HPA (autoscaling/v2 defaults) per model: whole GPUs,
TP 1; metric: GPU utilisation (busy fraction of the last sync period, what DCGM's GPU_UTIL
reports) averaged over the model's pods; ``desired = ceil(Σ utilisation / target)`` with pods
still starting counted at 0% (as the HPA does for unready pods when scaling up); no change
within the 10% tolerance; scale-up at most max(2x, +4 pods) per sync; scale-down to the highest
recommendation of the last 300 s (the default stabilisation window); a pod that finds no free
GPU stays Pending until one frees (drained pods free theirs).

Invariants: deterministic (no randomness of its own); a model keeps at least one serving pod;
never more pods than ``gpus``; one record per sync in ``log``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from sim.cluster import Allocation, Replica, ReplicaSpec
from sim.dynamic import DynamicSimulation

__all__ = ["Hpa", "HpaSettings"]


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

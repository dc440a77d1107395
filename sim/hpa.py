"""The Kubernetes HorizontalPodAutoscaler as a controller of a :class:`sim.dynamic.DynamicSimulation`.

Role: the autoscaler baseline of ``bench.evaluation.evaluate`` (its static points and its
dynamic scenario). :class:`Hpa` is the HPA (autoscaling/v2 defaults) per model: whole GPUs,
TP 1; metric: GPU utilisation (busy fraction of the last sync period, what DCGM's GPU_UTIL
reports) averaged over the model's pods; ``desired = ceil(Σ utilisation / target)`` with pods
still starting counted at 0% (as the HPA does for unready pods when scaling up); no change
within the 10% tolerance; scale-up at most max(2x, +4 pods) per sync; scale-down to the highest
recommendation of the last 300 s (the default stabilisation window); a pod that finds no free
GPU stays Pending until one frees (drained pods free theirs).

Cold and warm starts: :meth:`Hpa.initial` starts from ``minReplicas`` (one pod per model), as
a deployment created with the traffic already on; :func:`settled_counts` gives the pod counts
the HPA's own rule settles on at a steady load (a fixed point of ``desired = ceil(Σ
utilisation / target)`` over short static simulations at those counts, pods beyond the GPUs
left out round-robin as Pending pods would be), which :meth:`Hpa.initial` takes as a warm
start: how an autoscaled deployment that has run at that rate for a while looks, so its figures
measure the rule's steady behaviour (and its oscillation), not how fast it ramps from cold.

Invariants: deterministic (no randomness of its own); a model keeps at least one serving pod;
never more pods than ``gpus``; one record per sync in ``log``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sim.cluster import Allocation, Replica, ReplicaSpec
from sim.des import WorkloadSpec, simulate
from sim.dynamic import DynamicSimulation

__all__ = ["METRIC", "Hpa", "HpaSettings", "settled_counts"]

METRIC = (
    "GPU utilisation (DCGM GPU_UTIL: busy fraction of the sync period), mean over the model's pods"
)


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

    def initial(self, counts: Mapping[str, int] | None = None) -> Allocation:
        """Cold: minReplicas = 1 per model; warm: ``counts`` pods per model (at least 1)."""
        n = {m: max(1, (counts or {}).get(m, 1)) for m in self.models}
        return Allocation(tuple(ReplicaSpec(m, self.gpu, 1, 1.0, n[m]) for m in self.models))

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


def _desired(usage: float, current: int, s: HpaSettings) -> int:
    """The HPA's recommendation for ``current`` pods using ``usage`` (Σ utilisation)."""
    ratio = usage / (s.target_utilisation * current)
    return (
        current
        if abs(ratio - 1.0) <= s.tolerance
        else max(1, math.ceil(usage / s.target_utilisation))
    )


def _fit(desired: Mapping[str, int], models: Sequence[str], gpus: int) -> dict[str, int]:
    """What starts of ``desired`` on ``gpus`` whole GPUs: one pod each, then round-robin (the
    order :meth:`Hpa._start_pending` starts Pending pods in)."""
    got = {m: 1 for m in models}
    free = gpus - len(models)
    while free > 0 and any(got[m] < desired[m] for m in models):
        for m in models:
            if free > 0 and got[m] < desired[m]:
                got[m] += 1
                free -= 1
    return got


def settled_counts(
    models: Sequence[str],
    gpus: int,
    workloads: Sequence[WorkloadSpec],
    seed: int,
    duration_s: float,
    gpu: str = "a6000",
    settings: HpaSettings | None = None,
    max_rounds: int = 8,
) -> dict[str, int]:
    """Pods per model the HPA settles on under ``workloads`` (see the module docstring): from
    one pod each, simulate ``duration_s`` at the current counts, apply the rule to each model's
    summed utilisation, fit to the GPUs, until the counts repeat (or ``max_rounds``)."""
    s = settings or HpaSettings()
    counts = {m: 1 for m in models}
    seen: list[dict[str, int]] = []
    for _ in range(max_rounds):
        alloc = Allocation(tuple(ReplicaSpec(m, gpu, 1, 1.0, counts[m]) for m in models))
        res = simulate(alloc, workloads, duration_s=duration_s, drain_s=0.0, seed=seed)
        usage = {m: sum(r.utilisation for r in res.replicas if r.model == m) for m in models}
        nxt = _fit({m: _desired(usage[m], counts[m], s) for m in models}, models, gpus)
        if nxt == counts or nxt in seen:  # settled, or the rule oscillates: keep the last
            return nxt
        seen.append(counts)
        counts = nxt
    return counts

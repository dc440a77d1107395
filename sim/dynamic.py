"""A simulator whose replicas change mid-run, driven by a controller.

Role: ``sim.des.simulate`` runs one fixed allocation; an autoscaler (:mod:`sim.hpa`) or the
optimizer's control loop (``bench.evaluation.daemon``) needs replicas that start and stop while
requests are in flight. :class:`DynamicSimulation` drives the simulator through its run-time
hook (``sim.des.Simulation.at`` / ``add_replicas`` / ``withdraw`` / ``set_rate``): a
:class:`Controller` ticks every ``interval_s`` simulated seconds and may start replicas (serving
after ``cold_start_s``), cancel replicas still starting, retire replicas (no new calls;
in-flight calls finish: a drain) and change a workload's rate. Queues, caches and in-flight
requests carry over, so oscillation shows. Every change is listed in ``changes``.

A controller that knows where replicas really sit lays a batch out with :func:`colocate`.

Invariants: the same (initial allocation, workloads, controller, seed) gives the same run; a
model always keeps at least one serving replica; GPU indices of replicas started later do
not overlap earlier ones (co-location contention is modelled only within one start batch).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sim.cluster import Allocation, Replica, build_replicas
from sim.des import SimResult, Simulation, WorkloadSpec, simulate

__all__ = ["ENGINE_KW", "Change", "Controller", "DynamicSimulation", "colocate", "run_dynamic"]

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
    kind: str  # "start" | "ready" | "cancel" | "retire" | "rate"
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


def colocate(replicas: Sequence[Replica], gpus: Sequence[tuple[int, ...]]) -> None:
    """Lay ``replicas`` (one start batch: the initial ones, or what one ``start`` returned)
    out on ``gpus`` (per replica, in order) instead of the simulator's first-fit: co-location
    contention follows that layout. The indices are shifted by the batch's lowest, so they stay
    clear of other batches'."""
    base = min((g for r in replicas for g in r.gpus), default=0)
    for r, g in zip(replicas, gpus, strict=True):
        r.gpus = tuple(base + i for i in g)
    for r in replicas:
        r.peers = [o for o in replicas if o is not r and set(o.gpus) & set(r.gpus)]


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

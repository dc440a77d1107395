"""Rollout backends' common contract, and the executor that runs a plan against one.

Role: :class:`Backend` is what the local (processes) and the kubernetes (pods) backends both
implement: observe the running replica set and the proxies' routes, start / wait for / stop one
GPU group, replace the route table, wait for removed replicas to drain. :func:`execute` runs a
:class:`~optimizer.plan.planner.Plan` step by step; :func:`converge` observes, plans and executes.

Invariants:
- resumable: before every step the executor observes again and skips what is already done (a
  group already running, replicas already routed or already gone), so running the same plan
  twice, or re-planning after a crash half way, starts nothing twice and loses no route;
- the route table is always pushed whole (the proxies' ``PUT /admin/routes`` replaces it):
  the observed table plus or minus the step's replicas; routes the plan does not know (upstreams
  configured by hand) are kept;
- consecutive route steps of one kind are pushed together, so draining several groups waits
  the drain time once;
- an unsafe plan (one that leaves a served model without replicas for a while) is refused
  unless ``allow_outage`` is given.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from optimizer.plan import planner
from optimizer.plan.observed import Observed, Route, RunningReplica
from optimizer.plan.planner import Plan, Step
from optimizer.plan.target import GroupSpec
from shared.cluster import Cluster

__all__ = [
    "Backend",
    "RolloutError",
    "StepResult",
    "converge",
    "execute",
    "route_table",
]


class RolloutError(RuntimeError):
    """A step that could not be carried out (timeout, a crashing engine, an API refusal)."""


class Backend(Protocol):
    """What a rollout backend does. Every method is idempotent."""

    async def observe(self) -> Observed:
        """The replicas this backend runs (ready or not, stopping included) and the routes."""
        ...

    async def start(self, group: GroupSpec) -> None:
        """Start the group's replicas (those already running are left alone); don't wait."""
        ...

    async def wait_ready(self, group: GroupSpec) -> None:
        """Return once every replica of the group answers its health check, else raise
        :class:`RolloutError` (timeout, crash)."""
        ...

    async def push_routes(self, routes: Sequence[Route]) -> None:
        """Give every proxy this route table (it replaces the previous one)."""
        ...

    async def wait_drained(self, replicas: Sequence[RunningReplica]) -> None:
        """Return once calls in flight on these (now unrouted) replicas had time to finish."""
        ...

    async def stop(self, group_id: str) -> None:
        """Stop the group; return once its GPUs are free. Unknown groups are a no-op."""
        ...


@dataclass(frozen=True)
class StepResult:
    index: int
    step: Step
    skipped: bool
    seconds: float


def route_table(
    observed: Observed, add: Sequence[str] = (), remove: Sequence[str] = ()
) -> tuple[Route, ...]:
    """The observed routes plus the replicas ``add``, minus the replicas ``remove`` (ids)."""
    by_id = {r.id: r for r in observed.replicas}
    missing = [rid for rid in add if rid not in by_id]
    if missing:
        raise RolloutError(f"cannot route replicas that are not running: {', '.join(missing)}")
    gone = {(by_id[rid].model, by_id[rid].url) for rid in remove if rid in by_id}
    routes = {(r.model, r.url): r for r in observed.routes if (r.model, r.url) not in gone}
    for rid in add:
        r = by_id[rid]
        routes.setdefault((r.model, r.url), Route(r.model, r.url))
    return tuple(routes[k] for k in sorted(routes))


def _done(step: Step, state: Observed) -> bool:
    """Whether ``step`` has already taken effect in ``state``."""
    present = {r.id: r for r in state.replicas}
    routed = state.routed_ids()
    if step.kind == "start":
        return all(rid in present for rid in step.replicas)
    if step.kind == "wait_ready":
        return all(rid in present and present[rid].ready for rid in step.replicas)
    if step.kind == "add_route":
        return all(rid in routed for rid in step.replicas)
    if step.kind == "drain":
        # Once the replicas are gone nothing can be in flight on them.
        return not any(rid in present for rid in step.replicas)
    return not any(r.group == step.group for r in state.replicas)


async def execute(
    plan: Plan,
    backend: Backend,
    *,
    allow_outage: bool = False,
    on_step: Callable[[StepResult], None] | None = None,
) -> list[StepResult]:
    """Run ``plan`` against ``backend``; see the module docstring for the guarantees."""
    if not plan.safe and not allow_outage:
        raise RolloutError(
            f"the plan leaves {', '.join(plan.outages)} without a replica for a while; "
            "refusing without allow_outage"
        )
    results: list[StepResult] = []
    steps = plan.steps
    i = 0
    while i < len(steps):
        step = steps[i]
        t0 = time.monotonic()
        state = await backend.observe()
        batch = [step]
        if step.kind in ("add_route", "drain"):
            while i + len(batch) < len(steps) and steps[i + len(batch)].kind == step.kind:
                batch.append(steps[i + len(batch)])
        todo = [s for s in batch if not _done(s, state)]
        if step.kind == "start" and todo:
            await backend.start(plan.group(step.group))
        elif step.kind == "wait_ready" and todo:
            await backend.wait_ready(plan.group(step.group))
        elif step.kind == "add_route" and todo:
            ids = [rid for s in todo for rid in s.replicas]
            await backend.push_routes(route_table(state, add=ids))
        elif step.kind == "drain" and todo:
            gone = {rid for s in todo for rid in s.replicas}
            await backend.push_routes(route_table(state, remove=sorted(gone)))
            await backend.wait_drained([r for r in state.replicas if r.id in gone])
        elif step.kind == "stop" and todo:
            await backend.stop(step.group)
        seconds = time.monotonic() - t0
        for k, s in enumerate(batch):
            result = StepResult(i + k + 1, s, s not in todo, seconds if k == 0 else 0.0)
            results.append(result)
            if on_step is not None:
                on_step(result)
        i += len(batch)
    return results


async def converge(
    backend: Backend,
    target: Sequence[GroupSpec],
    *,
    cluster: Cluster | None = None,
    allow_outage: bool = False,
    on_step: Callable[[StepResult], None] | None = None,
) -> tuple[Plan, list[StepResult]]:
    """Observe, plan towards ``target``, execute; returns the plan and what each step did.

    ``cluster`` lets the plan use spare GPUs for temporary replicas (see ``make_plan``)."""
    plan = planner.make_plan(await backend.observe(), target, cluster)
    return plan, await execute(plan, backend, allow_outage=allow_outage, on_step=on_step)

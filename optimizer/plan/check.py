"""Dry-run of a rollout plan: walk its steps over a model of the state and check invariants.

Role: pure. :func:`dry_run` replays a :class:`~optimizer.plan.planner.Plan` against the
:class:`~optimizer.plan.observed.Observed` state it was made from, without a backend, and returns one
line per step (the step and how many routed replicas each model has after it), or raises
:class:`~optimizer.plan.target.PlanError` at the first broken invariant: a group starting on GPUs
another present group holds; a step naming a group that is not running; a model the target
serves losing its last routed replica when the plan did not declare that outage; an end state
other than exactly the target, every target replica routed.
"""

from __future__ import annotations

from collections import defaultdict

from optimizer.plan.observed import Observed
from optimizer.plan.planner import Plan, gpus_of
from optimizer.plan.target import PlanError

__all__ = ["dry_run"]


def dry_run(plan: Plan, observed: Observed) -> list[str]:
    """Walk the plan over a model of the state; one line per step, or :class:`PlanError`.

    Checks: a group starts only on GPUs no present group holds; steps name groups and replicas
    that exist when they run; a model the target serves keeps a routed replica once it has one
    (unless the plan declared it in ``outages``); the end state is exactly the target.
    """
    held: dict[str, tuple[str, tuple[int, ...]]] = {}
    members: dict[str, dict[str, str]] = defaultdict(dict)  # group -> replica id -> model
    for gid, rs in observed.groups().items():
        held[gid] = (rs[0].node, gpus_of(rs))
        members[gid] = {r.id: r.model for r in rs}
    routed = set(observed.routed_ids())
    served = {r.spec.model for g in plan.target for r in g.replicas}
    lines: list[str] = []

    def count(model: str) -> int:
        return sum(
            1 for gid in members for rid, m in members[gid].items() if m == model and rid in routed
        )

    for i, step in enumerate(plan.steps, 1):
        where = f"step {i} ({step.kind} {step.group})"
        if step.kind == "start":
            g = plan.group(step.group)
            clash = [o for o, (node, gpus) in held.items() if o != g.id and g.overlaps(node, gpus)]
            if clash:
                raise PlanError(f"{where}: GPUs still held by group {clash[0]}")
            held[g.id] = (g.node, g.gpus)
            members[g.id] = {r.id: r.spec.model for r in g.replicas}
        elif step.group not in held:
            raise PlanError(f"{where}: the group is not running")
        elif step.kind == "add_route":
            routed |= set(step.replicas)
        elif step.kind == "drain":
            before = {m: count(m) for m in step.models}
            routed -= set(step.replicas)
            for m in step.models:
                if m in served and before[m] and not count(m) and m not in plan.outages:
                    raise PlanError(f"{where}: {m} loses its last routed replica")
        elif step.kind == "stop":
            routed -= set(members.pop(step.group, {}))
            held.pop(step.group)
        routes = sorted(
            (
                m,
                sum(
                    1
                    for gid in members
                    for rid, mm in members[gid].items()
                    if mm == m and rid in routed
                ),
            )
            for m in served | {m for g in members.values() for m in g.values()}
        )
        lines.append(
            f"{i:>3}. {step.render()}  -> routed: " + ", ".join(f"{m}={n}" for m, n in routes)
        )
    target = {g.id: {r.id for r in g.replicas} for g in plan.target}
    if set(held) != set(target):
        raise PlanError(f"after the plan, groups {sorted(held)} run instead of {sorted(target)}")
    unrouted = sorted(rid for ids in target.values() for rid in ids if rid not in routed)
    if unrouted:
        raise PlanError(f"after the plan, replicas {unrouted} have no route")
    return lines

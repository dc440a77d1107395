"""The target of a rollout: replica specs grouped into the units a backend starts and stops.

Role: what placement decided, as data a plan is made from (:func:`target_from_placement`);
a group holds the replicas that must start and stop together (those sharing a GPU), and its id
is a digest of what it runs, so an unchanged group keeps its id across plans.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from optimizer.placement import Placement
from optimizer.plan.observed import RunningReplica


class PlanError(ValueError):
    """A plan that breaks its invariants against a state (found by ``plan_check.dry_run``)."""


@dataclass(frozen=True)
class ReplicaSpec:
    """What a replica is: model, node, GPUs (NVML indices), share and memory per GPU.

    ``revision`` digests how the model is served (engine, weights, arguments): two replicas
    differing only in it are different replicas, so changing an engine flag replaces them.
    """

    model: str
    node: str
    gpus: tuple[int, ...]
    share: float
    memory_bytes_per_gpu: int
    revision: str = ""

    @property
    def tp(self) -> int:
        return len(self.gpus)

    def key(self) -> tuple[Any, ...]:
        return (
            self.gpus,
            self.model,
            round(self.share, 6),
            self.memory_bytes_per_gpu,
            self.revision,
        )


@dataclass(frozen=True)
class TargetReplica:
    """A replica of the target: its id (its group's id and its place in the group, so the same
    target gives the same id) and what it is. What runs is a :class:`RunningReplica`."""

    id: str
    spec: ReplicaSpec


@dataclass(frozen=True)
class GroupSpec:
    """Replicas of one node sharing GPUs (transitively); started and stopped as one unit."""

    id: str
    node: str
    gpus: tuple[int, ...]
    replicas: tuple[TargetReplica, ...]

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(sorted({r.spec.model for r in self.replicas}))

    @property
    def shared(self) -> bool:
        """True when the GPUs are shared (an MPS daemon is needed)."""
        return len(self.replicas) > 1 or any(r.spec.share < 1.0 - 1e-9 for r in self.replicas)

    def overlaps(self, node: str, gpus: Iterable[int]) -> bool:
        return node == self.node and not set(self.gpus).isdisjoint(gpus)

    def running(
        self,
        url: Callable[[str], str],
        ready: bool | Sequence[bool] = False,
        started: Sequence[float | None] = (),
    ) -> tuple[RunningReplica, ...]:
        """Its replicas as a backend observes them: ``url`` of a replica id; ``ready`` (all
        of them, or each in order) and when each started (epoch s, in order; default unknown)."""
        ok = [ready] * len(self.replicas) if isinstance(ready, bool) else list(ready)
        since = list(started) + [None] * (len(self.replicas) - len(started))
        return tuple(
            RunningReplica(
                r.id,
                self.id,
                r.spec.model,
                self.node,
                r.spec.gpus,
                r.spec.share,
                r.spec.tp,
                url(r.id),
                ok[k],
                r.spec.memory_bytes_per_gpu,
                r.spec.revision,
                since[k],
            )
            for k, r in enumerate(self.replicas)
        )


def _digest(parts: Any) -> str:
    return hashlib.sha256(orjson.dumps(parts)).hexdigest()[:10]


def _group(node: str, specs: Sequence[ReplicaSpec]) -> GroupSpec:
    ordered = sorted(specs, key=ReplicaSpec.key)
    gid = "g" + _digest([node, [list(s.key()) for s in ordered]])
    gpus = tuple(sorted({g for s in ordered for g in s.gpus}))
    return GroupSpec(
        gid, node, gpus, tuple(TargetReplica(f"{gid}-{k}", s) for k, s in enumerate(ordered))
    )


def _root(parent: dict[int, int], g: int) -> int:
    """Union-find root of GPU ``g`` (with path halving)."""
    while parent[g] != g:
        parent[g] = parent[parent[g]]
        g = parent[g]
    return g


def group_specs(specs: Iterable[ReplicaSpec]) -> tuple[GroupSpec, ...]:
    """Split replicas into GPU groups (connected by shared GPUs), ordered by node then GPUs."""
    by_node: dict[str, list[ReplicaSpec]] = defaultdict(list)
    for s in specs:
        by_node[s.node].append(s)
    groups: list[GroupSpec] = []
    for node, members in by_node.items():
        parent = {g: g for s in members for g in s.gpus}
        for s in members:
            for g in s.gpus[1:]:
                parent[_root(parent, g)] = _root(parent, s.gpus[0])
        parts: dict[int, list[ReplicaSpec]] = defaultdict(list)
        for s in members:
            parts[_root(parent, s.gpus[0])].append(s)
        groups += [_group(node, part) for part in parts.values()]
    return tuple(sorted(groups, key=lambda g: (g.node, g.gpus)))


def target_from_placement(
    placement: Placement, revisions: Mapping[str, str] | None = None
) -> tuple[GroupSpec, ...]:
    """The target groups of a placement; ``revisions``: per model, how it is served."""
    revisions = revisions or {}
    return group_specs(
        ReplicaSpec(
            r.demand.model,
            r.node,
            tuple(sorted(r.gpus)),
            r.share,
            r.memory_bytes_per_gpu,
            revisions.get(r.demand.model, ""),
        )
        for r in placement.replicas
    )

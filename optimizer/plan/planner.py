"""Rollout plans: the ordered steps that turn the running replica set into the desired one.

Role: pure. Given what runs (:class:`Observed`: replicas and the proxies' routes) and the target
(:class:`GroupSpec` values, usually from :func:`target_from_placement`), :func:`make_plan`
returns a :class:`Plan` of steps ``start``, ``wait_ready``, ``add_route``, ``drain``, ``stop``
that a backend executes one by one (:mod:`optimizer.rollout.backend`). A plan can be printed
(:meth:`Plan.render`), serialised (:meth:`Plan.to_json`) and dry-run
(:func:`optimizer.plan.check.dry_run`).

The unit of starting and stopping is a GPU group: the replicas of one node that share GPUs,
transitively (one pod on Kubernetes, one MPS daemon locally). Group and replica ids are digests
of their content, so the same target always yields the same ids: a rollout interrupted half way
is finished by planning again, and nothing is started twice.

Order (make-before-break where the GPUs allow):
1. repair kept groups (identical in both): start what is missing, wait, route what is unrouted;
2. start every new group whose GPUs no old group holds, wait for it, route it;
3. when the remaining new groups all need GPUs old groups hold: pick the one whose blocking old
   groups can go while every model they serve keeps a routed replica elsewhere (fewest blockers
   first), with the blockers of further new groups as long as no served model loses more than
   half of its routed replicas at once, drain and stop those, then go back to 2; the rest of
   the replicas carry the traffic.
   If every choice would leave a model unserved and a cluster is given, first start a temporary
   copy of one of its replicas on GPUs no running or target group uses (stopped in 4);
4. drain and stop the old groups left.

Invariants of a plan: two groups never hold one GPU at once (a new group starts only after every
old group overlapping it stopped); a model the target serves never loses its last routed replica
unless the GPUs leave no other order, and then it is listed in ``Plan.outages`` (the executor
refuses such a plan unless told otherwise); models served now and absent from the target are
listed in ``Plan.dropped`` and removed last.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, cast

import orjson

from optimizer.plan.observed import Observed, RunningReplica
from optimizer.plan.target import GroupSpec, ReplicaSpec, TargetReplica, group_specs
from shared.cluster import Cluster, Gpu

__all__ = ["Plan", "Step", "StepKind", "make_plan"]

StepKind = Literal["start", "wait_ready", "add_route", "drain", "stop"]


@dataclass(frozen=True)
class Step:
    kind: StepKind
    group: str
    node: str
    gpus: tuple[int, ...]
    replicas: tuple[str, ...]
    models: tuple[str, ...]

    def render(self) -> str:
        gpus = ",".join(map(str, self.gpus))
        return (
            f"{self.kind:<10} {self.group} {self.node} GPU {gpus:<8} "
            f"{', '.join(self.models)} ({len(self.replicas)} replica(s))"
        )


@dataclass(frozen=True)
class Plan:
    target: tuple[GroupSpec, ...]
    steps: tuple[Step, ...]
    kept: tuple[str, ...] = ()
    outages: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    temporary: tuple[GroupSpec, ...] = ()

    @property
    def safe(self) -> bool:
        return not self.outages

    @property
    def empty(self) -> bool:
        return not self.steps

    @property
    def rounds(self) -> int:
        """Cold-start phases: maximal runs of ``wait_ready`` steps. Each costs the engines'
        start-up (a minute or more), so it is what a rollout's duration grows with."""
        return sum(
            1
            for i, s in enumerate(self.steps)
            if s.kind == "wait_ready" and (i == 0 or self.steps[i - 1].kind != "wait_ready")
        )

    def group(self, gid: str) -> GroupSpec:
        for g in (*self.target, *self.temporary):
            if g.id == gid:
                return g
        raise KeyError(gid)

    def render(self) -> str:
        starts = sum(s.kind == "start" for s in self.steps)
        stops = sum(s.kind == "stop" for s in self.steps)
        head = (
            f"plan: {len(self.target)} target group(s), {len(self.kept)} kept, {starts} "
            f"start(s), {stops} stop(s); "
            + ("safe" if self.safe else f"UNSAFE: {', '.join(self.outages)} unserved a while")
        )
        if self.dropped:
            head += f"; stops serving {', '.join(self.dropped)}"
        if self.temporary:
            head += f"; {len(self.temporary)} temporary group(s) carry traffic meanwhile"
        lines = [head] + [f"{i:>3}. {s.render()}" for i, s in enumerate(self.steps, 1)]
        return "\n".join(lines)

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self), option=orjson.OPT_INDENT_2)

    @classmethod
    def from_json(cls, data: bytes | str) -> Plan:
        raw = orjson.loads(data)

        def groups(items: list[dict[str, Any]]) -> tuple[GroupSpec, ...]:
            return tuple(
                GroupSpec(
                    g["id"],
                    g["node"],
                    tuple(g["gpus"]),
                    tuple(
                        TargetReplica(
                            r["id"], ReplicaSpec(**{**r["spec"], "gpus": tuple(r["spec"]["gpus"])})
                        )
                        for r in g["replicas"]
                    ),
                )
                for g in items
            )

        target = groups(raw["target"])
        steps = tuple(
            Step(
                cast(StepKind, s["kind"]),
                s["group"],
                s["node"],
                tuple(s["gpus"]),
                tuple(s["replicas"]),
                tuple(s["models"]),
            )
            for s in raw["steps"]
        )
        return cls(
            target,
            steps,
            tuple(raw["kept"]),
            tuple(raw["outages"]),
            tuple(raw["dropped"]),
            groups(raw["temporary"]),
        )


@dataclass
class _Planner:
    """Mutable bookkeeping of one :func:`make_plan` call."""

    routed: dict[str, set[str]]  # model -> routed replica ids
    steps: list[Step] = field(default_factory=list)
    outages: set[str] = field(default_factory=set)

    def emit(
        self,
        kind: StepKind,
        gid: str,
        node: str,
        gpus: tuple[int, ...],
        replicas: Sequence[tuple[str, str]],
    ) -> None:
        self.steps.append(
            Step(
                kind,
                gid,
                node,
                gpus,
                tuple(r for r, _ in replicas),
                tuple(sorted({m for _, m in replicas})),
            )
        )

    def bring_up(
        self,
        groups: Sequence[GroupSpec],
        unrouted: Mapping[str, set[str]],
        start: Mapping[str, bool],
        ready: Mapping[str, bool],
    ) -> None:
        """Start the groups together, then wait for each, then route each."""
        for g in groups:
            if start[g.id]:
                self.emit("start", g.id, g.node, g.gpus, _pairs(g))
        for g in groups:
            if not ready[g.id]:
                self.emit("wait_ready", g.id, g.node, g.gpus, _pairs(g))
        for g in groups:
            todo = [(r.id, r.spec.model) for r in g.replicas if r.id in unrouted[g.id]]
            if todo:
                self.emit("add_route", g.id, g.node, g.gpus, todo)
                for rid, model in todo:
                    self.routed[model].add(rid)

    def lost(self, replicas: Sequence[RunningReplica], served: set[str]) -> set[str]:
        """Models the target serves that would lose their last routed replica."""
        ids = {r.id for r in replicas}
        return {
            r.model
            for r in replicas
            if r.model in served and self.routed[r.model] and self.routed[r.model] <= ids
        }

    def take_down(
        self, old: Sequence[tuple[str, tuple[RunningReplica, ...]]], served: set[str]
    ) -> None:
        """Drain the groups together, then stop each."""
        everyone = [r for _, rs in old for r in rs]
        self.outages |= self.lost(everyone, served)
        for gid, rs in old:
            pairs = [(r.id, r.model) for r in rs if r.id in self.routed[r.model]]
            if pairs:
                self.emit("drain", gid, rs[0].node, gpus_of(rs), pairs)
            for r in rs:
                self.routed[r.model].discard(r.id)
        for gid, rs in old:
            self.emit("stop", gid, rs[0].node, gpus_of(rs), [(r.id, r.model) for r in rs])


def _pairs(g: GroupSpec) -> list[tuple[str, str]]:
    return [(r.id, r.spec.model) for r in g.replicas]


def gpus_of(rs: Sequence[RunningReplica]) -> tuple[int, ...]:
    return tuple(sorted({g for r in rs for g in r.gpus}))


def _overlap(g: GroupSpec, rs: Sequence[RunningReplica]) -> bool:
    return g.overlaps(rs[0].node, gpus_of(rs))


def _surge(
    lost: set[str],
    blockers: Sequence[tuple[str, tuple[RunningReplica, ...]]],
    busy: set[tuple[str, int]],
    cluster: Cluster,
) -> list[ReplicaSpec]:
    """Copies of one replica of each ``lost`` model on GPUs no group holds or will hold.

    Same share, memory, tensor-parallel degree and GPU type; a copy's GPUs lie in one NVLink
    domain; copies may share a GPU within its share and memory. The GPUs used are added to
    ``busy``. Empty when any copy does not fit.
    """
    copies: list[ReplicaSpec] = []
    load: dict[tuple[str, int], tuple[float, int]] = {}
    for model in sorted(lost):
        r = next(r for _, rs in blockers for r in rs if r.model == model)
        kind = cluster.node(r.node).gpu(r.gpus[0]).type

        def fits(node: str, gpu: Gpu, r: RunningReplica = r, kind: str = kind) -> bool:
            share, memory = load.get((node, gpu.index), (0.0, 0))
            return (
                gpu.type == kind
                and (node, gpu.index) not in busy
                and share + r.share <= 1.0 + 1e-9
                and memory + r.memory_bytes_per_gpu <= gpu.memory_bytes
            )

        nodes = sorted(cluster.nodes, key=lambda n: n.name != r.node)  # its own node first
        spot = next(
            (
                (n.name, free[: r.tp])
                for n in nodes
                for d in n.domains
                for free in [[g.index for g in d.gpus if fits(n.name, g)]]
                if len(free) >= r.tp
            ),
            None,
        )
        if spot is None:
            return []
        for g in spot[1]:
            share, memory = load.get((spot[0], g), (0.0, 0))
            load[(spot[0], g)] = (share + r.share, memory + r.memory_bytes_per_gpu)
        copies.append(
            ReplicaSpec(model, spot[0], tuple(spot[1]), r.share, r.memory_bytes_per_gpu, r.revision)
        )
    busy |= set(load)
    return copies


_Old = tuple[str, tuple[RunningReplica, ...]]  # a running group: its id and replicas


def make_plan(
    observed: Observed, target: Sequence[GroupSpec], cluster: Cluster | None = None
) -> Plan:
    """The steps from ``observed`` to ``target`` (see the module docstring for the order).

    With ``cluster``, when the only way on would leave a model unserved, a temporary copy of
    one of its replicas is started on GPUs neither the running nor the target groups use, and
    stopped once the new groups are up (``Plan.temporary``).
    """
    running = observed.groups()
    routed_ids = observed.routed_ids()
    planner = _Planner(defaultdict(set))
    for r in observed.replicas:
        if r.id in routed_ids:
            planner.routed[r.model].add(r.id)
    served = {r.spec.model for g in target for r in g.replicas}
    kept = _repair_kept(planner, observed, target, running, routed_ids)
    temporary = _replace(planner, observed, target, running, served, cluster)
    running_models = {r.model for r in observed.replicas}
    return Plan(
        tuple(target),
        tuple(planner.steps),
        tuple(g.id for g in kept),
        tuple(sorted(planner.outages)),
        tuple(sorted(running_models - served)),
        tuple(temporary),
    )


def _repair_kept(
    planner: _Planner,
    observed: Observed,
    target: Sequence[GroupSpec],
    running: Mapping[str, tuple[RunningReplica, ...]],
    routed_ids: frozenset[str],
) -> list[GroupSpec]:
    """Order step 1: the target groups already running (kept); start what is missing of
    them, wait for them, route what is unrouted."""
    ready_ids = {r.id for r in observed.replicas if r.ready}
    kept = [g for g in target if g.id in running]
    present = {rid for g in kept for rid in (r.id for r in running[g.id])}
    planner.bring_up(
        kept,
        unrouted={g.id: {r.id for r in g.replicas if r.id not in routed_ids} for g in kept},
        start={g.id: any(r.id not in present for r in g.replicas) for g in kept},
        ready={g.id: all(r.id in ready_ids for r in g.replicas) for g in kept},
    )
    return kept


def _replace(
    planner: _Planner,
    observed: Observed,
    target: Sequence[GroupSpec],
    running: Mapping[str, tuple[RunningReplica, ...]],
    served: set[str],
    cluster: Cluster | None,
) -> list[GroupSpec]:
    """Order steps 2-4: bring up the new groups and take down the old ones, freeing GPUs for
    blocked new groups, with temporary copies where a model would go unserved; the
    temporary groups started."""
    target_ids = {g.id for g in target}
    pending_new = [g for g in target if g.id not in running]
    pending_old = sorted(
        ((gid, rs) for gid, rs in running.items() if gid not in target_ids),
        key=lambda item: (item[1][0].node, gpus_of(item[1]), item[0]),
    )
    fresh = {g.id: {r.id for r in g.replicas} for g in pending_new}
    yes = {g.id: True for g in pending_new}
    no = {g.id: False for g in pending_new}
    busy = {(r.node, g) for r in observed.replicas for g in r.gpus}
    busy |= {(t.node, g) for t in target for g in t.gpus}
    temporary: list[GroupSpec] = []
    while pending_new or pending_old:
        free = [g for g in pending_new if not any(_overlap(g, rs) for _, rs in pending_old)]
        if free:
            planner.bring_up(free, fresh, yes, no)
            pending_new = [g for g in pending_new if g not in free]
            continue
        if not pending_new:
            planner.take_down(pending_old, served)
            break
        # Every new group waits for GPUs old groups hold: free those of the cheapest one.
        blockers, lost = _cheapest_blockers(planner, pending_new, pending_old, served)
        copies = _surge(lost, blockers, busy, cluster) if lost and cluster else []
        if copies:
            surge = group_specs(copies)
            temporary += surge
            ids = {g.id: {r.id for r in g.replicas} for g in surge}
            planner.bring_up(surge, ids, {g.id: True for g in surge}, {g.id: False for g in surge})
            pending_old += [_as_running(g) for g in surge]
            continue
        planner.take_down(blockers, served)
        pending_old = [item for item in pending_old if item not in blockers]
    return temporary


def _cheapest_blockers(
    planner: _Planner,
    pending_new: Sequence[GroupSpec],
    pending_old: Sequence[_Old],
    served: set[str],
) -> tuple[list[_Old], set[str]]:
    """The old groups blocking one new group, chosen to leave the fewest models unserved,
    then to stop the fewest groups, then first in target order; the models they would leave
    unserved. Where that leaves every model served, the blockers of further new groups (in the
    same order) join the batch while every model still keeps a routed replica and no model
    loses more than half of its routed replicas at once: each round of a rollout on a full
    cluster costs a drain and a cold start, so groups whose swap the traffic can bear together
    are swapped together."""
    options = []
    for i, g in enumerate(pending_new):
        blockers = [(gid, rs) for gid, rs in pending_old if _overlap(g, rs)]
        lost = planner.lost([r for _, rs in blockers for r in rs], served)
        options.append((len(lost), len(blockers), i, blockers))
    options.sort(key=lambda o: o[:3])
    first = options[0][3]
    lost = planner.lost([r for _, rs in first for r in rs], served)
    if lost:
        return first, lost
    batch = list(first)
    for _, _, _, more in options[1:]:
        grown = batch + [b for b in more if b not in batch]
        if len(grown) > len(batch) and _bearable(planner, grown, served):
            batch = grown
    return batch, set()


def _bearable(planner: _Planner, groups: Sequence[_Old], served: set[str]) -> bool:
    """Taking ``groups`` down at once leaves every served model a routed replica and at least
    half of those it has now."""
    replicas = [r for _, rs in groups for r in rs]
    if planner.lost(replicas, served):
        return False
    down: dict[str, int] = defaultdict(int)
    for r in replicas:
        if r.id in planner.routed[r.model]:
            down[r.model] += 1
    return all(n <= len(planner.routed[m]) // 2 for m, n in down.items() if m in served)


def _as_running(g: GroupSpec) -> _Old:
    """A temporary group as an old group to take down later (not ready, no URL)."""
    return g.id, g.running(lambda _rid: "")

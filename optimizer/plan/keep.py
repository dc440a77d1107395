"""Keeping what runs: the demands of a new allocation that a running GPU group already serves.

Role: pure. :func:`kept_places` matches the running GPU groups (:class:`Observed`) against an
allocation's replica demands and gives, per matched demand, the place its running replica
holds, for :func:`optimizer.placement.place` to keep (``fixed``). A layout that keeps them
leaves those groups untouched by the rollout (same content, so the same group id: the planner
counts them as kept), so the models they serve never lose those replicas while the rest moves.
That is what lets a rollout on a full cluster, with no free GPU for a temporary copy, keep
every model served.

Invariants:
- a group is kept whole or not at all: every replica of it matches a distinct demand of the
  same model, tensor-parallel degree, share, memory per GPU and revision (a group that lost or
  gained a member is another group, and would be stopped anyway);
- only groups on GPUs of the cluster given (the search's: GPUs reserved for temporary copies
  are not in it) and of the demand's GPU type are kept;
- deterministic: groups in the order of their id, demands in their order.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from optimizer.placement import EPS, Fixed, ReplicaDemand
from optimizer.plan.observed import Observed, RunningReplica
from shared.cluster import Cluster, Gpu

__all__ = ["kept_places"]


def kept_places(
    observed: Observed,
    demands: Sequence[ReplicaDemand],
    cluster: Cluster,
    revisions: Mapping[str, str],
) -> dict[int, Fixed]:
    """Per demand index, the place (node, GPUs, memory per GPU) of the running replica that
    serves it, for every running group whose replicas all match demands."""
    gpus = {(n.name, g.index): g for n in cluster.nodes for g in n.gpus}
    taken: dict[int, Fixed] = {}
    for _, group in sorted(observed.groups().items()):
        matched: dict[int, Fixed] = {}
        for r in group:
            i = _match(r, demands, gpus, revisions, taken.keys() | matched.keys())
            if i is None:
                break
            matched[i] = (r.node, tuple(sorted(r.gpus)), r.memory_bytes_per_gpu)
        else:
            taken |= matched
    return taken


def _match(
    r: RunningReplica,
    demands: Sequence[ReplicaDemand],
    gpus: Mapping[tuple[str, int], Gpu],
    revisions: Mapping[str, str],
    used: Collection[int],
) -> int | None:
    """The first unused demand ``r`` serves as it runs, or ``None``."""
    if revisions.get(r.model, "") != r.revision or len(set(r.gpus)) != r.tp:
        return None
    here = [gpus[(r.node, g)] for g in r.gpus if (r.node, g) in gpus]
    if len(here) != r.tp:  # a GPU outside the cluster given
        return None
    for i, d in enumerate(demands):
        if i in used or d.model != r.model or d.tp != r.tp or abs(d.share - r.share) > EPS:
            continue
        if d.gpu_type is not None and any(g.type != d.gpu_type for g in here):
            continue
        memory = min(
            d.memory_bytes_per_gpu
            if d.memory_bytes_per_gpu is not None
            else int(d.share * g.memory_bytes)
            for g in here
        )
        if memory != r.memory_bytes_per_gpu or memory * d.tp < d.min_memory_bytes:
            continue
        return i
    return None

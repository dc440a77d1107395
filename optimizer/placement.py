"""Topology-aware fractional placement (paper §6): replicas onto nodes, NVLink domains and GPUs.

Role: map an allocation's replicas (each a tensor-parallel degree ``tp``, a share ``s`` of each
of its ``tp`` GPUs, and memory per GPU) onto a :class:`shared.cluster.Cluster`. Pure: frozen
values in, a new :class:`Placement` out.

The heuristic (most constrained first, as the paper's):
- order: tensor-parallel replicas (``tp > 1``) before the rest; within each, larger first
  (``tp x share``, then memory); ties keep the input order;
- inter-node stage: each replica goes to the node whose best intra-node candidate scores best,
  ties to the earlier node;
- intra-node stage, tensor-parallel and whole-GPU replicas: NVLink domains with ``tp`` GPUs that
  fit are scored by the imbalance (largest minus smallest per-GPU share over the domain) they
  would have with the replica placed, on its least-used fitting GPUs; among the most balanced,
  the domain with the least free capacity wins, so large domains stay whole for large groups;
- intra-node stage, sub-GPU replicas (``tp == 1``, ``share < 1``): packed onto an already used
  GPU first (the fullest one it fits on); only when none fits, an empty GPU by the domain rule;
- demands given a place (``fixed``: what runs, kept by a rollout) keep it, and the heuristic
  places nothing else on their GPUs.

Invariants of every result, checked by :func:`check_placement` before :func:`place` returns: no
GPU over 100% share or over its memory; every replica's GPUs are ``tp`` distinct GPUs of one
NVLink domain on one node (of the replica's GPU type when it names one); every replica's memory
(per GPU x ``tp``) at or above its floor. When a replica cannot be placed, :class:`PlacementError`
names it (workflow, model, ordinal among that model's replicas) and says why.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shared.cluster import GB, Cluster, Gpu, Node, NvlinkDomain

__all__ = [
    "Fixed",
    "PlacedReplica",
    "Placement",
    "PlacementError",
    "ReplicaDemand",
    "check_placement",
    "place",
    "placement_order",
]

EPS = 1e-9  # shares are sums of decimal fractions (0.1 + 0.2); compare with slack
Fixed = tuple[str, tuple[int, ...], int]  # a demand's given place: node, GPUs, memory per GPU


@dataclass(frozen=True)
class ReplicaDemand:
    """One replica the allocation asks for.

    ``share`` is the fraction of each of its ``tp`` GPUs; ``memory_bytes_per_gpu`` the memory it
    gets on each (``None``: in proportion to its share, ``share x the GPU's memory``, which is
    what MPS's pinned-memory limit and vLLM's ``--gpu-memory-utilization`` are set from);
    ``min_memory_bytes`` the least the replica needs in total over its ``tp`` GPUs (weights plus
    a minimal KV cache). ``gpu_type``: only GPUs of this type (``None``: any).
    """

    workflow: str
    model: str
    tp: int
    share: float
    memory_bytes_per_gpu: int | None
    min_memory_bytes: int
    gpu_type: str | None = None

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"{self.workflow}/{self.model}: tp must be at least 1, got {self.tp}")
        if not 0.0 < self.share <= 1.0 + EPS:
            raise ValueError(f"{self.workflow}/{self.model}: share must be in (0, 1]")
        if self.memory_bytes_per_gpu is not None and self.memory_bytes_per_gpu < 0:
            raise ValueError(f"{self.workflow}/{self.model}: memory must not be negative")
        if self.min_memory_bytes < 0:
            raise ValueError(f"{self.workflow}/{self.model}: memory floor must not be negative")

    @property
    def size(self) -> float:
        """GPU-equivalents the replica takes."""
        return self.tp * self.share

    @property
    def whole(self) -> bool:
        return self.share >= 1.0 - EPS


@dataclass(frozen=True)
class PlacedReplica:
    demand: ReplicaDemand
    node: str
    gpus: tuple[int, ...]
    share: float
    memory_bytes_per_gpu: int


@dataclass(frozen=True)
class Placement:
    """Per demand, in the order the demands were given: where it runs."""

    replicas: tuple[PlacedReplica, ...]

    def gpu_usage(self) -> dict[tuple[str, int], tuple[float, int]]:
        """(node, GPU index) → (share used, memory bytes used), for every GPU in use."""
        usage: dict[tuple[str, int], tuple[float, int]] = {}
        for r in self.replicas:
            for index in r.gpus:
                share, memory = usage.get((r.node, index), (0.0, 0))
                usage[(r.node, index)] = (share + r.share, memory + r.memory_bytes_per_gpu)
        return usage


class PlacementError(ValueError):
    """No placement for a replica (``demand_index`` into the demands), or a broken invariant."""

    def __init__(self, message: str, demand_index: int | None = None) -> None:
        super().__init__(message)
        self.demand_index = demand_index


def _label(demands: Sequence[ReplicaDemand], i: int) -> str:
    d = demands[i]
    ordinal = sum(1 for e in demands[:i] if (e.workflow, e.model) == (d.workflow, d.model)) + 1
    memory = (
        "memory ∝ share"
        if d.memory_bytes_per_gpu is None
        else f"{d.memory_bytes_per_gpu / GB:.1f} GB/GPU"
    )
    return (
        f"replica {ordinal} of model {d.model!r} in workflow {d.workflow!r} "
        f"(tp {d.tp}, share {d.share:.2f}, {memory}, floor {d.min_memory_bytes / GB:.1f} GB)"
    )


def placement_order(demands: Sequence[ReplicaDemand]) -> list[int]:
    """Indices of ``demands`` in the order they are placed: TP first, then larger first."""
    return sorted(
        range(len(demands)),
        key=lambda i: (
            demands[i].tp == 1,
            -demands[i].size,
            -(demands[i].memory_bytes_per_gpu or 0),
            -demands[i].min_memory_bytes,
        ),
    )


class _State:
    """Share and memory used per GPU while placing; mutable, private to one :func:`place`."""

    def __init__(self, cluster: Cluster) -> None:
        self.share = {(n.name, g.index): 0.0 for n in cluster.nodes for g in n.gpus}
        self.memory = {(n.name, g.index): 0 for n in cluster.nodes for g in n.gpus}

    def memory_on(self, d: ReplicaDemand, gpu: Gpu) -> int:
        if d.memory_bytes_per_gpu is not None:
            return d.memory_bytes_per_gpu
        return int(d.share * gpu.memory_bytes)

    def fits(self, node: str, gpu: Gpu, d: ReplicaDemand) -> bool:
        key = (node, gpu.index)
        return (
            (d.gpu_type is None or gpu.type == d.gpu_type)
            and self.share[key] + d.share <= 1.0 + EPS
            and self.memory[key] + self.memory_on(d, gpu) <= gpu.memory_bytes
        )

    def imbalance_with(
        self, node: str, domain: NvlinkDomain, chosen: Sequence[Gpu], s: float
    ) -> float:
        used = [self.share[(node, g.index)] + (s if g in chosen else 0.0) for g in domain.gpus]
        return max(used) - min(used)

    def free(self, node: str, domain: NvlinkDomain) -> float:
        return sum(1.0 - self.share[(node, g.index)] for g in domain.gpus)


# A candidate: (score, node position, GPUs). Lower scores win.
_Candidate = tuple[tuple[float, ...], int, tuple[Gpu, ...]]


def _group_memory(state: _State, d: ReplicaDemand, gpus: Sequence[Gpu]) -> int:
    return min(state.memory_on(d, g) for g in gpus)


def _domain_candidates(state: _State, node: Node, pos: int, d: ReplicaDemand) -> list[_Candidate]:
    out: list[_Candidate] = []
    for domain in node.domains:
        if domain.size < d.tp:
            continue
        fitting = [g for g in domain.gpus if state.fits(node.name, g, d)]
        if len(fitting) < d.tp:
            continue
        # The least-used fitting GPUs: keeps the domain level, so later TP groups still fit.
        chosen = sorted(fitting, key=lambda g: (state.share[(node.name, g.index)], g.index))
        group = tuple(sorted(chosen[: d.tp], key=lambda g: g.index))
        if _group_memory(state, d, group) * d.tp < d.min_memory_bytes:
            continue
        imbalance = round(state.imbalance_with(node.name, domain, group, d.share), 6)
        out.append(((1.0, imbalance, state.free(node.name, domain)), pos, group))
    return out


def _packing_candidates(state: _State, node: Node, pos: int, d: ReplicaDemand) -> list[_Candidate]:
    out: list[_Candidate] = []
    for gpu in node.gpus:
        used = state.share[(node.name, gpu.index)]
        if used <= EPS or not state.fits(node.name, gpu, d):
            continue
        if state.memory_on(d, gpu) < d.min_memory_bytes:
            continue
        # Fullest GPU first (best fit), then the lower index.
        out.append(((0.0, 1.0 - used - d.share, float(gpu.index)), pos, (gpu,)))
    return out


def _best(state: _State, cluster: Cluster, d: ReplicaDemand) -> _Candidate | None:
    candidates: list[_Candidate] = []
    if d.tp == 1 and not d.whole:
        for pos, node in enumerate(cluster.nodes):
            candidates += _packing_candidates(state, node, pos, d)
    if not candidates:
        for pos, node in enumerate(cluster.nodes):
            candidates += _domain_candidates(state, node, pos, d)
    return min(candidates, key=lambda c: (c[0], c[1]), default=None)


def _why(cluster: Cluster, state: _State, d: ReplicaDemand) -> str:
    """Why ``d`` has no candidate: the first static reason, else exhausted capacity."""
    gpus = [(n, g) for n in cluster.nodes for g in n.gpus if d.gpu_type in (None, g.type)]
    if not gpus:
        types = ", ".join(cluster.gpu_types) or "none"
        return f"no GPU of type {d.gpu_type!r} in the cluster (types: {types})"
    largest = max(
        (
            sum(1 for g in dom.gpus if d.gpu_type in (None, g.type))
            for n in cluster.nodes
            for dom in n.domains
        ),
        default=0,
    )
    if largest < d.tp:
        return f"needs {d.tp} GPUs in one NVLink domain, but the largest domain has {largest}"
    biggest = max(g.memory_bytes for _, g in gpus)
    if d.memory_bytes_per_gpu is not None and d.memory_bytes_per_gpu > biggest:
        return (
            f"needs {d.memory_bytes_per_gpu / GB:.1f} GB per GPU, but the largest GPU has "
            f"{biggest / GB:.1f} GB"
        )
    most = (d.memory_bytes_per_gpu or int(d.share * biggest)) * d.tp
    if most < d.min_memory_bytes:
        return (
            f"its memory floor is {d.min_memory_bytes / GB:.1f} GB, but {d.tp} GPU(s) at this "
            f"share give it at most {most / GB:.1f} GB"
        )
    free = sum(max(0.0, 1.0 - state.share[(n.name, g.index)]) for n, g in gpus)
    where = "no GPU has" if d.tp == 1 else f"no NVLink domain has {d.tp} GPUs each with"
    return (
        f"{where} {d.share:.2f} share and its memory free: the replicas placed before it "
        f"left {free:.2f} GPU-equivalents free, in pieces too small (it needs {d.size:.2f})"
    )


def place(
    cluster: Cluster,
    demands: Sequence[ReplicaDemand],
    fixed: Mapping[int, Fixed] | None = None,
) -> Placement:
    """Place every demand, or raise :class:`PlacementError` naming the first that cannot fit.

    ``fixed``: demands (by index) that already have a place (where a running replica of theirs
    runs, :mod:`optimizer.plan.keep`); they keep it, and no other demand is placed on their
    GPUs, so the GPU groups they form stay exactly what runs."""
    demands = tuple(demands)
    state = _State(cluster)
    placed: dict[int, PlacedReplica] = {}
    for i, (node, gpus, memory) in sorted((fixed or {}).items()):
        placed[i] = PlacedReplica(demands[i], node, gpus, demands[i].share, memory)
        for index in gpus:
            state.share[(node, index)] = 1.0  # full: nothing joins a kept group
    for i in placement_order(demands):
        if i in placed:
            continue
        d = demands[i]
        best = _best(state, cluster, d)
        if best is None:
            raise PlacementError(f"cannot place {_label(demands, i)}: {_why(cluster, state, d)}", i)
        _, pos, group = best
        node = cluster.nodes[pos].name
        memory = _group_memory(state, d, group)
        for gpu in group:
            state.share[(node, gpu.index)] += d.share
            state.memory[(node, gpu.index)] += memory
        placed[i] = PlacedReplica(d, node, tuple(g.index for g in group), d.share, memory)
    result = Placement(tuple(placed[i] for i in range(len(demands))))
    check_placement(cluster, result)
    return result


def violations(cluster: Cluster, placement: Placement) -> list[str]:
    """Every broken placement invariant, as one sentence each (empty: the placement is sound)."""
    problems: list[str] = []
    demands = [r.demand for r in placement.replicas]
    for i, r in enumerate(placement.replicas):
        label = _label(demands, i)
        names = [n.name for n in cluster.nodes]
        if r.node not in names:
            problems.append(f"{label}: node {r.node!r} is not in the cluster")
            continue
        node = cluster.node(r.node)
        known = {g.index for g in node.gpus}
        if len(r.gpus) != r.demand.tp or len(set(r.gpus)) != len(r.gpus):
            problems.append(f"{label}: needs {r.demand.tp} distinct GPUs, got {list(r.gpus)}")
        if not set(r.gpus) <= known:
            problems.append(f"{label}: GPU(s) {sorted(set(r.gpus) - known)} not on {r.node}")
            continue
        if r.gpus and len({node.domain_of(g).indices for g in r.gpus}) > 1:
            problems.append(f"{label}: GPUs {list(r.gpus)} span NVLink domains on {r.node}")
        if r.demand.gpu_type is not None and any(
            node.gpu(g).type != r.demand.gpu_type for g in r.gpus
        ):
            problems.append(f"{label}: placed on GPUs not of type {r.demand.gpu_type!r}")
        if abs(r.share - r.demand.share) > EPS:
            problems.append(f"{label}: share {r.share} differs from the demand's")
        if r.demand.memory_bytes_per_gpu not in (None, r.memory_bytes_per_gpu):
            problems.append(f"{label}: memory differs from the demand's")
        if r.memory_bytes_per_gpu * r.demand.tp < r.demand.min_memory_bytes:
            problems.append(
                f"{label}: {r.memory_bytes_per_gpu * r.demand.tp / GB:.2f} GB is below its floor"
            )
    for (node_name, index), (share, memory) in placement.gpu_usage().items():
        if node_name not in [n.name for n in cluster.nodes]:
            continue
        node = cluster.node(node_name)
        if index not in {g.index for g in node.gpus}:
            continue
        if share > 1.0 + EPS:
            problems.append(f"{node_name} GPU {index}: {share:.0%} share is over 100%")
        if memory > node.gpu(index).memory_bytes:
            problems.append(
                f"{node_name} GPU {index}: {memory / GB:.2f} GB used of "
                f"{node.gpu(index).memory_bytes / GB:.2f} GB"
            )
    return problems


def check_placement(cluster: Cluster, placement: Placement) -> None:
    """Raise :class:`PlacementError` listing every broken invariant of ``placement``."""
    problems = violations(cluster, placement)
    if problems:
        raise PlacementError("placement breaks its invariants: " + "; ".join(problems))

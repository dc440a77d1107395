"""The allocation search space (paper §5), shared by the search and its reference solver.

Role: define *what* an allocation candidate is, once, so that :mod:`optimizer.search` (fast,
exact) and :mod:`optimizer.search_reference` (brute force) provably search the same space.

The space, for one workflow given ``B`` GPU units (``F`` units per GPU, the granularity) that
start at unit ``start`` of the cluster's GPU line:

- every LLM ``m`` of the workflow gets ``u_m >= 1`` units, ``Σ u_m <= B`` (what is left stays
  idle: more units can rule configurations out, see the next rule);
- the LLMs are packed contiguously in *packing order* (highest light-load latency contribution
  ``n/p · L(0)`` first, ties by name: paper §5, "the highest-latency LLMs have less
  partitioning"); LLM ``m`` starts at offset ``o_m`` inside its first GPU and spans
  ``g_m = ceil((o_m + u_m) / F)`` GPUs;
- a configuration ``(tp, d)`` of ``m`` needs ``tp · d`` to divide ``g_m`` (paper: "tensor
  parallelism degree times replica count evenly divides the number of GPUs"), ``tp`` a power of
  two within the largest NVLink domain and among the model's allowed degrees (only 1 when TP is
  disabled); every replica gets the share ``s = u_m / (F · tp · d)`` of each of its ``tp`` GPUs,
  ``s <= 1`` (``s == 1`` when fractions are disabled), and ``s · tp · memory >= floor_m`` with
  ``memory`` the smallest GPU memory of the cluster (conservative on mixed clusters);
- configurations named in ``SearchProblem.exclude`` are out (placement retries use this).

Several workflows split the line: workflow ``k`` gets budget ``b_k`` starting where the previous
budgets end. Invariants: everything here is pure; :func:`chain` is the one dynamic programme both
levels (LLMs inside a workflow, workflows inside the cluster) combine tables with.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np
import numpy.typing as npt

from optimizer.alp import Pipeline
from optimizer.profiles import ProfileBook, Stat
from shared.cluster import Cluster

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

SHARE_DIGITS = 6  # shares compare after rounding (sums of decimal fractions)
FEASIBLE_RTOL = 1e-9  # throughput >= target * (1 - this) counts as covering the target


class SearchError(ValueError):
    """A search problem that cannot be searched (no profile at any allowed TP degree, ...)."""


@dataclass(frozen=True)
class WorkflowTarget:
    """A workflow's Aggregate LLM Pipeline and the rate (requests/s) it must be served at."""

    pipeline: Pipeline
    rate: float

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise SearchError(f"{self.pipeline.workflow}: target rate must be positive")
        if not self.pipeline.stages:
            raise SearchError(f"{self.pipeline.workflow}: a pipeline needs at least one stage")


@dataclass(frozen=True)
class ExcludedConfig:
    """One configuration of one model of one workflow that the search must not choose."""

    workflow: str
    model: str
    tp: int
    replicas: int
    share: float


@dataclass(frozen=True)
class SearchProblem:
    """Everything the search reads. Mappings are copied into read-only views."""

    workflows: tuple[WorkflowTarget, ...]
    book: ProfileBook
    cluster: Cluster
    memory_floor_bytes: Mapping[str, int] = field(default_factory=dict)
    tp_degrees: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # default: profiled
    granularity: int = 10  # units per GPU
    headroom: float = 0.1  # throughput must cover rate x (1 + headroom)
    allow_tp: bool = True
    allow_fraction: bool = True
    welfare: str = "egalitarian"  # or "social" (optimizer.welfare)
    stat: Stat = "mean"
    pooling: bool = True
    exclude: frozenset[ExcludedConfig] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "memory_floor_bytes",
                           MappingProxyType(dict(self.memory_floor_bytes)))
        object.__setattr__(self, "tp_degrees", MappingProxyType(
            {k: tuple(v) for k, v in self.tp_degrees.items()}))
        if not self.workflows:
            raise SearchError("nothing to search: no workflows")
        names = [w.pipeline.workflow for w in self.workflows]
        if len(set(names)) != len(names):
            raise SearchError(f"workflow names must be unique, got {names}")
        if self.granularity < 1:
            raise SearchError("granularity must be at least 1 unit per GPU")
        if self.headroom < 0:
            raise SearchError("headroom must not be negative")
        if self.cluster.gpu_count < 1:
            raise SearchError("the cluster has no GPUs")

    @property
    def units(self) -> int:
        return self.cluster.gpu_count * self.granularity

    @property
    def gpu_memory_bytes(self) -> int:
        return min(g.memory_bytes for _, g in self.cluster.all_gpus())


@dataclass(frozen=True)
class ModelRules:
    """What configurations of one model (in one workflow) are allowed."""

    model: str
    tps: tuple[int, ...]  # allowed TP degrees, ascending
    floor_bytes: int
    gpu_memory_bytes: int
    allow_fraction: bool
    excluded: frozenset[tuple[int, int, float]]  # (tp, replicas, rounded share)


def powers_of_two_upto(limit: int) -> tuple[int, ...]:
    out, t = [], 1
    while t <= limit:
        out.append(t)
        t *= 2
    return tuple(out)


def model_rules(problem: SearchProblem, workflow: str, model: str) -> ModelRules:
    domain = powers_of_two_upto(problem.cluster.max_domain_size)
    profiled = sorted({k.tp for k in problem.book.profiles if k.model == model})
    wanted = problem.tp_degrees.get(model, tuple(profiled))
    tps = tuple(t for t in sorted(set(wanted)) if t in domain and t in profiled
                and (problem.allow_tp or t == 1))
    if not tps:
        raise SearchError(
            f"model {model!r}: no usable TP degree (profiled {profiled or 'none'}, allowed "
            f"{list(wanted)}, NVLink domain up to {problem.cluster.max_domain_size}"
            f"{', TP disabled' if not problem.allow_tp else ''})")
    excluded = frozenset((e.tp, e.replicas, round(e.share, SHARE_DIGITS))
                         for e in problem.exclude if (e.workflow, e.model) == (workflow, model))
    return ModelRules(model, tps, int(problem.memory_floor_bytes.get(model, 0)),
                      problem.gpu_memory_bytes, problem.allow_fraction, excluded)


def span(offset: npt.ArrayLike, units: npt.ArrayLike, granularity: int) -> IntArray:
    """GPUs a run of ``units`` starting ``offset`` units into a GPU touches."""
    total = np.asarray(offset, dtype=np.int64) + np.asarray(units, dtype=np.int64)
    return np.asarray(-(-total // granularity), dtype=np.int64)


def raw_pairs(gpus: int, domain_tps: Sequence[int]) -> list[tuple[int, int]]:
    """Every (tp, replicas) with ``tp · replicas`` dividing ``gpus``, tp from ``domain_tps``."""
    return [(t, k // t) for k in range(1, gpus + 1) if gpus % k == 0
            for t in domain_tps if k % t == 0]


def valid_mask(rules: ModelRules, units: IntArray, tp: IntArray, replicas: IntArray,
               granularity: int) -> BoolArray:
    """Which configurations (arrays of equal shape; ``tp · replicas`` already divides the span)
    the rules allow."""
    share = units / (granularity * tp * replicas)
    ok = (share <= 1.0 + 1e-12) & np.isin(tp, rules.tps)
    if not rules.allow_fraction:
        ok &= np.abs(share - 1.0) <= 1e-12
    ok &= share * tp * rules.gpu_memory_bytes >= rules.floor_bytes * (1.0 - 1e-12)
    for t, d, s in rules.excluded:
        ok &= ~((tp == t) & (replicas == d) & (np.round(share, SHARE_DIGITS) == s))
    return np.asarray(ok, dtype=np.bool_)


def packing_order(problem: SearchProblem, pipeline: Pipeline) -> tuple[int, ...]:
    """Stage indices, highest light-load latency contribution first (ties by model name)."""
    keys = []
    for j, st in enumerate(pipeline.stages):
        tp = model_rules(problem, pipeline.workflow, st.model).tps[0]
        prof = problem.book.lookup(st.model, tp, 1.0)
        keys.append((-float(prof.lat[problem.stat][0]) * st.n / st.p, st.model, j))
    return tuple(j for *_, j in sorted(keys))


# ---- the exact combination -----------------------------------------------------------------

Combine = Callable[[FloatArray, FloatArray], FloatArray]


@dataclass(frozen=True)
class Semiring:
    """How :func:`chain` adds a stage (``combine``) and which of two totals wins (``better``)."""

    combine: Combine
    better: Callable[[FloatArray, FloatArray], BoolArray]  # strict: ties keep the earlier
    identity: float  # the total of no stages
    worst: float  # no way to reach this total


MIN_SUM = Semiring(np.add, np.less, 0.0, np.inf)  # lowest summed latency
MAX_MIN = Semiring(np.minimum, np.greater, np.inf, -np.inf)  # highest bottleneck capacity
MAX_SUM = Semiring(np.add, np.greater, 0.0, -np.inf)  # social welfare


def chain(tables: Sequence[FloatArray], start: int, total: int, granularity: int,
          ring: Semiring, min_units: int = 1,
          prefer_more: bool = False) -> tuple[FloatArray, list[IntArray]]:
    """Best total of stages laid out one after another from unit ``start``.

    ``tables[k][o, u]``: stage ``k``'s value when it starts ``o`` units into a GPU and takes
    ``u`` units (``u >= min_units``). Returns ``best[y]`` over layouts using exactly ``y`` units
    and, per stage, ``choice[k][y]``: the units stage ``k`` took when stages ``0..k`` used ``y``
    (for :func:`backtrack`). Ties keep the stage's smaller ``u``, or its larger one with
    ``prefer_more``. Exact: every layout is covered, ``O(K · total²)`` array work.
    """
    positions = np.arange(total + 1)
    offsets = (start + positions) % granularity
    best = np.full(total + 1, ring.worst)
    best[0] = ring.identity
    choices: list[IntArray] = []
    for table in tables:
        new = np.full(total + 1, ring.worst)
        choice = np.zeros(total + 1, dtype=np.int64)
        useful = np.flatnonzero((table != ring.worst).any(axis=0))
        for col in useful[useful >= min_units]:
            u = int(col)
            n = total + 1 - u
            cand = ring.combine(best[:n], table[offsets[:n], u])
            win = ring.better(cand, new[u:])
            if prefer_more:
                win |= (cand == new[u:]) & (cand != ring.worst)
            if win.any():
                new[u:] = np.where(win, cand, new[u:])
                choice[u:] = np.where(win, u, choice[u:])
        best = new
        choices.append(choice)
    return best, choices


def count_chain(tables: Sequence[FloatArray], start: int, total: int, granularity: int) -> float:
    """How many layouts (times per-stage multiplicities ``tables[k][o, u]``) use at most
    ``total`` units: the size of the space :func:`chain` covers (float: exact below 2**53)."""
    offsets = (start + np.arange(total + 1)) % granularity
    ways = np.zeros(total + 1)
    ways[0] = 1.0
    for table in tables:
        new = np.zeros(total + 1)
        for col in np.flatnonzero(table.any(axis=0)):
            u = int(col)
            if u < 1 or u > total:
                continue
            n = total + 1 - u
            new[u:] += ways[:n] * table[offsets[:n], u]
        ways = new
    return float(ways.sum())


def backtrack(choices: Sequence[IntArray], used: int) -> list[int]:
    """Units per stage of the layout that ``chain`` reached ``used`` with."""
    out = []
    for choice in reversed(choices):
        u = int(choice[used])
        out.append(u)
        used -= u
    return out[::-1]

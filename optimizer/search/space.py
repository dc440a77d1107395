"""The allocation search space (paper §5), shared by the search and its reference solver.

Role: define *what* an allocation candidate is, once, so that :mod:`optimizer.search.solve` (fast,
exact) and :mod:`optimizer.search.reference` (brute force) provably search the same space.

The space, for one workflow given ``B`` GPU units (``F`` units per GPU, the granularity) that
start at unit ``start`` of the cluster's *GPU line* (its GPUs in node, NVLink-domain, index
order: :func:`line_gpus`):

- every LLM ``m`` of the workflow gets ``u_m >= 1`` units, ``Σ u_m <= B`` (what is left stays
  idle: more units can rule configurations out, see the next rules);
- the LLMs are packed contiguously in *packing order* (highest light-load latency contribution
  ``n/p · L(0)`` first, ties by name: paper §5, "the highest-latency LLMs have less
  partitioning"); LLM ``m``'s run starts at offset ``o_m`` inside its first GPU and spans
  ``g_m = ceil((o_m + u_m) / F)`` GPUs, holding a *piece* of each: ``F - o_m`` units of the
  first, all ``F`` of the ones in between, the rest of the last;
- a configuration ``(tp, d, s)`` of ``m`` (``d`` replicas at TP ``tp``, each on the share ``s``
  of each of its ``tp`` GPUs) must fit *inside the run's pieces*, so that the line itself is a
  placement (placement-aware: no GPU over 100 %, nothing to fragment). Two families:
  (a) one replica GPU per GPU of the run: ``tp · d == g_m`` (paper: "tensor parallelism degree
  times replica count evenly divides the number of GPUs"), ``s`` the smallest piece over ``F``,
  and each TP group (``tp`` consecutive GPUs of the run) inside one NVLink domain on the line;
  (b) TP 1 with several replicas per piece (beyond the paper: one LLM's replicas share a GPU
  the way different LLMs do): for a slot of ``c`` units (``1 <= c <= F``), ``d = Σ_pieces
  floor(piece / c)`` replicas of share ``c / F``;
  (c) mixed shares, TP 1 (beyond the paper: what per-LLM sizing does with a remainder): one
  replica per piece at the piece's own size, where the run has whole pieces and partial ones
  of one size (``3 x 1.0 + 1 x 0.5`` on 3.5 GPUs; family (a) would run four replicas at the
  smallest piece, 0.5); the partial pieces form the :class:`ModelAlloc`'s rest group;
  what a configuration does not use of the run stays idle;
- ``tp`` a power of two within the largest NVLink domain and among the model's allowed degrees
  (only 1 when TP is disabled); ``s == 1`` when fractions are disabled; ``s · tp · memory >=
  floor_m`` with ``memory`` the smallest GPU memory of the cluster (conservative on mixed
  clusters);
- configurations named in ``SearchProblem.exclude`` are out (placement retries use this).

Because TP groups must sit inside NVLink domains, a configuration depends on where on the line
its run starts, modulo the line's *cycle*: ``F x`` the number of GPUs after which the line's
domain pattern repeats (:class:`LineLayout`; 2 GPUs for nodes of 4 with NVLink pairs).

Several workflows split the line: in some order (:func:`workflow_orders`: every order for up to
four workflows), each gets budget ``b_k`` starting where the previous budgets end. The order
matters: a workflow's runs start where the previous one's end, so where its TP groups and
whole-GPU replicas fall (and what is left in a shared GPU) depends on what precedes it (beam
search then RAG on 4 GPUs: RAG's generator cannot take two whole GPUs and leave room for its
encoders; RAG first, it can). Invariants: everything here is pure; :func:`chain` is the one
dynamic programme both levels (LLMs inside a workflow, workflows inside the cluster) combine
tables with.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np
import numpy.typing as npt

from optimizer.model.alp import Pipeline
from optimizer.model.curves import ProfileBook, Stat
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
    rest: int = 0
    rest_share: float = 0.0


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
    # cover the goal and rank at the slow end of each prediction's uncertainty (False: point
    # estimates, what a search that found nothing feasible that way tries next)
    cautious: bool = True
    allow_tp: bool = True
    allow_fraction: bool = True
    welfare: str = "egalitarian"  # or "social" (optimizer.search.welfare)
    stat: Stat = "mean"
    pooling: bool = True
    exclude: frozenset[ExcludedConfig] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "memory_floor_bytes", MappingProxyType(dict(self.memory_floor_bytes))
        )
        object.__setattr__(
            self, "tp_degrees", MappingProxyType({k: tuple(v) for k, v in self.tp_degrees.items()})
        )
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
    # (tp, replicas, rounded share, rest replicas, rounded rest share)
    excluded: frozenset[tuple[int, int, float, int, float]]


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
    tps = tuple(
        t
        for t in sorted(set(wanted))
        if t in domain and t in profiled and (problem.allow_tp or t == 1)
    )
    if not tps:
        raise SearchError(
            f"model {model!r}: no usable TP degree (profiled {profiled or 'none'}, allowed "
            f"{list(wanted)}, NVLink domain up to {problem.cluster.max_domain_size}"
            f"{', TP disabled' if not problem.allow_tp else ''})"
        )
    excluded = frozenset(
        (e.tp, e.replicas, round(e.share, SHARE_DIGITS), e.rest, round(e.rest_share, SHARE_DIGITS))
        for e in problem.exclude
        if (e.workflow, e.model) == (workflow, model)
    )
    return ModelRules(
        model,
        tps,
        int(problem.memory_floor_bytes.get(model, 0)),
        problem.gpu_memory_bytes,
        problem.allow_fraction,
        excluded,
    )


def line_gpus(cluster: Cluster) -> tuple[tuple[str, int], ...]:
    """(node name, GPU index) of every GPU in line order: nodes in order, inside a node its
    NVLink domains in order, inside a domain its GPUs in order."""
    return tuple((n.name, g.index) for n in cluster.nodes for d in n.domains for g in d.gpus)


@dataclass(frozen=True)
class LineLayout:
    """Where TP groups may sit on the GPU line, periodically (see the module docstring)."""

    granularity: int
    gpus: int
    period: int  # GPUs after which the domain pattern repeats (divides ``gpus``)
    tps: tuple[int, ...]  # powers of two up to the largest NVLink domain
    # tp -> (period, most groups + 1): True where ``d`` groups of ``tp`` GPUs starting at that
    # GPU (mod period) each lie inside one NVLink domain
    groups_ok: Mapping[int, BoolArray]

    @property
    def cycle(self) -> int:
        """Units after which configurations repeat along the line."""
        return self.granularity * self.period


def line_layout(cluster: Cluster, granularity: int) -> LineLayout:
    line = line_gpus(cluster)
    where = {}
    for n in cluster.nodes:
        for k, dom in enumerate(n.domains):
            for g in dom.gpus:
                where[(n.name, g.index)] = (n.name, k)
    count = len(line)
    tps = powers_of_two_upto(cluster.max_domain_size)

    def one_domain(i: int, t: int) -> bool:
        return i + t <= count and len({where[line[j]] for j in range(i, i + t)}) == 1

    ok = {t: [one_domain(i, t) for i in range(count)] for t in tps}
    period = next(
        p
        for p in range(1, count + 1)
        if count % p == 0 and all(ok[t][i] == ok[t][i % p] for t in tps for i in range(count))
    )
    groups = {}
    for t in tps:
        most = count // t + 2
        table = np.zeros((period, most), dtype=np.bool_)
        for first in range(period):
            table[first, 0] = True
            for d in range(1, most):
                table[first, d] = table[first, d - 1] and ok[t][(first + (d - 1) * t) % period]
        groups[t] = table
    return LineLayout(granularity, count, period, tps, MappingProxyType(groups))


@dataclass(frozen=True)
class RunConfigs:
    """Configurations of runs, as parallel arrays; ``run`` indexes the runs asked about;
    ``rest`` replicas of ``rest_share`` beside the main group (family (c); 0 elsewhere)."""

    run: IntArray
    tp: IntArray
    replicas: IntArray
    share: FloatArray
    rest: IntArray
    rest_share: FloatArray


def run_configs(layout: LineLayout, position: npt.ArrayLike, units: npt.ArrayLike) -> RunConfigs:
    """Every configuration (both families, before the model's rules) of each run of ``units``
    starting at line unit ``position`` (taken modulo the cycle), each listed once."""
    f = layout.granularity
    x = np.asarray(position, dtype=np.int64).reshape(-1) % layout.cycle
    u = np.asarray(units, dtype=np.int64).reshape(-1)
    idx = np.arange(len(u))
    o, first = x % f, x // f
    g = -(-(o + u) // f)
    head = np.minimum(f - o, u)
    tail = np.where(g >= 2, o + u - (g - 1) * f, 0)
    inner = np.maximum(g - 2, 0)
    smallest = np.where(g >= 2, np.minimum(head, tail), u)
    parts: list[tuple[IntArray, IntArray, IntArray, FloatArray]] = []
    # (b) with the smallest piece as the slot: where it gives exactly one replica per GPU,
    # it is (a) at TP 1, listed once there
    same = head // smallest + inner * (f // smallest) + tail // smallest == g
    for t in layout.tps:  # (a) one replica GPU per GPU of the run, TP groups inside domains
        d = g // t
        table = layout.groups_ok[t]
        fits = (g % t == 0) & (d < table.shape[1])
        fits[fits] &= table[first[fits], d[fits]]
        parts.append((idx[fits], np.full(int(fits.sum()), t), d[fits], smallest[fits] / f))
    for slot in range(1, f + 1):  # (b) TP 1, several replicas per piece
        d = head // slot + inner * (f // slot) + tail // slot
        fits = (d >= 1) & ~((slot == smallest) & same)
        parts.append(
            (
                idx[fits],
                np.ones(int(fits.sum()), dtype=np.int64),
                d[fits],
                np.full(int(fits.sum()), slot / f),
            )
        )
    # (c) one replica per piece: the whole pieces at share 1, the partial ones (all of one
    # size) as the rest group
    partial = (head < f).astype(np.int64) + ((tail > 0) & (tail < f)).astype(np.int64)
    whole = g - partial
    size = np.where(head < f, head, tail)
    one_size = (head == f) | (tail == 0) | (tail == f) | (head == tail)
    mixed = (g >= 2) & (whole >= 1) & (partial >= 1) & one_size
    count = int(mixed.sum())
    run, tp, reps = (
        np.concatenate([q[i] for q in parts] + [x]).astype(np.int64)
        for i, x in enumerate((idx[mixed], np.ones(count), whole[mixed]))
    )
    share = np.concatenate([q[3] for q in parts] + [np.ones(count)]).astype(np.float64)
    singles = len(run) - count
    rest = np.concatenate([np.zeros(singles, np.int64), partial[mixed]]).astype(np.int64)
    rest_share = np.concatenate([np.zeros(singles), size[mixed] / f]).astype(np.float64)
    return RunConfigs(run, tp, reps, share, rest, rest_share)


def valid_mask(rules: ModelRules, rc: RunConfigs) -> BoolArray:
    """Which configurations of ``rc`` the rules allow (a rest group counts as a fraction and
    must hold the memory floor too)."""
    tp, share = rc.tp, rc.share
    has_rest = rc.rest > 0
    ok = (share <= 1.0 + 1e-12) & np.isin(tp, rules.tps)
    if not rules.allow_fraction:
        ok &= (np.abs(share - 1.0) <= 1e-12) & ~has_rest
    ok &= share * tp * rules.gpu_memory_bytes >= rules.floor_bytes * (1.0 - 1e-12)
    rest_fits = rc.rest_share * rules.gpu_memory_bytes >= rules.floor_bytes * (1.0 - 1e-12)
    ok &= ~has_rest | rest_fits
    for t, d, s, r, rs in rules.excluded:
        ok &= ~(
            (tp == t)
            & (rc.replicas == d)
            & (np.round(share, SHARE_DIGITS) == s)
            & (rc.rest == r)
            & (np.round(rc.rest_share, SHARE_DIGITS) == rs)
        )
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


def chain(
    tables: Sequence[FloatArray],
    start: int,
    total: int,
    cycle: int,
    ring: Semiring,
    min_units: int = 1,
    prefer_more: bool = False,
) -> tuple[FloatArray, list[IntArray]]:
    """Best total of stages laid out one after another from unit ``start``.

    ``tables[k][o, u]``: stage ``k``'s value when it starts at line unit ``o`` (modulo
    ``cycle``, :attr:`LineLayout.cycle`) and takes ``u`` units (``u >= min_units``). Returns ``best[y]`` over layouts using exactly ``y`` units
    and, per stage, ``choice[k][y]``: the units stage ``k`` took when stages ``0..k`` used ``y``
    (for :func:`backtrack`). Ties keep the stage's smaller ``u``, or its larger one with
    ``prefer_more``. Exact: every layout is covered, ``O(K · total²)`` array work.
    """
    positions = np.arange(total + 1)
    offsets = (start + positions) % cycle
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


def count_chain(tables: Sequence[FloatArray], start: int, total: int, cycle: int) -> float:
    """How many layouts (times per-stage multiplicities ``tables[k][o, u]``) use at most
    ``total`` units: the size of the space :func:`chain` covers (float: exact below 2**53)."""
    offsets = (start + np.arange(total + 1)) % cycle
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


MAX_ORDER_WORKFLOWS = 4  # every order up to 4! = 24 splits; beyond, given and reversed order


def workflow_orders(count: int) -> list[tuple[int, ...]]:
    """Orders in which workflows are laid out on the line, the given order first."""
    given = tuple(range(count))
    if count <= MAX_ORDER_WORKFLOWS:
        return list(itertools.permutations(given))
    return [given, given[::-1]]


Split = Callable[[Sequence[FloatArray], int, int], tuple[tuple[int, ...], float]]


def best_split(
    split: Split, utilities: Sequence[FloatArray], total: int, cycle: int, tie_tol: float
) -> tuple[tuple[int, ...], tuple[int, ...], float]:
    """``(order, budgets in that order, objective)``: the welfare policy's ``split`` over
    every :func:`workflow_orders`; the best objective wins, then the largest sum of
    utilities, then the earlier order."""
    best: tuple[float, float, tuple[int, ...], tuple[int, ...]] | None = None
    for order in workflow_orders(len(utilities)):
        budgets, objective = split([utilities[i] for i in order], total, cycle)
        pos, summed = 0, 0.0
        for i, b in zip(order, budgets, strict=True):
            summed += float(utilities[i][pos % cycle, b])
            pos += b
        if (
            best is None
            or objective > best[0] + tie_tol * max(1.0, abs(best[0]))
            or (
                abs(objective - best[0]) <= tie_tol * max(1.0, abs(best[0]))
                and summed > best[1] + tie_tol * max(1.0, abs(best[1]))
            )
        ):
            best = (objective, summed, order, budgets)
    assert best is not None
    return best[2], best[3], best[0]


def backtrack(choices: Sequence[IntArray], used: int) -> list[int]:
    """Units per stage of the layout that ``chain`` reached ``used`` with."""
    out = []
    for choice in reversed(choices):
        u = int(choice[used])
        out.append(u)
        used -= u
    return out[::-1]

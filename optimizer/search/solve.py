"""The allocation search (paper §5): replicas, TP degree and GPU share per LLM, per workflow.

Role: given each workflow's Aggregate LLM Pipeline and target rate, the profiles and the cluster,
find per workflow the allocation with the lowest predicted latency whose throughput covers
``rate x (1 + headroom)``, over the space :mod:`optimizer.search.space` defines; when nothing
covers it, the allocation serving the largest rate (flagged infeasible, its latency predicted
at the rate it serves with headroom). Both figures are taken at the slow end of the
prediction's uncertainty (:mod:`optimizer.model.alp`: ``capacity_low``, ``latency_high``), so
a configuration derived from another GPU share counts for less than a measured one, the
farther the less (see "Ranking under uncertainty" below). Several workflows: an outer level splits the cluster's
units between them by a welfare policy (:mod:`optimizer.search.welfare`), in the order of workflows
on the line that serves the policy best (:func:`optimizer.search.space.best_split`: the
per-workflow utility tables do not depend on the order, so each order costs one split); a
model used by several workflows gets separate replicas in each.

How, and why it is exact: the ALP's latency is a sum of per-LLM contributions and its
throughput the minimum of per-LLM capacities, so a layout's best configuration is the best
configuration of each LLM for the offset and units it has. Per LLM, every (offset, units) is
resolved into its (TP, replicas) configurations, the rules prune them (memory floor, share,
NVLink domain, ablation flags), one :func:`optimizer.model.batch.predict_many` call per LLM predicts
the rest, and each (offset, units) keeps its best; an exact dynamic programme over the packing
order (:func:`optimizer.search.space.chain`) then combines the LLMs, covering every layout the
paper's enumeration would, without enumerating them one by one. The paper's extra latency-ratio
pruning (higher-latency LLMs get more units) is heuristic; ``search_reference`` measures it.
Where LLMs run at once (``Pipeline.overlaps``) the latency is no longer a sum: the search
still minimises the stage sum times the traced overlap ratio (``Pipeline.overlap``), exact
for LLMs called in turn and an approximation for fanned-out ones (it may spend units on a
stage the other hides), and the chosen allocation's latency is predicted with the overlaps.

Ranking under uncertainty (issue 24, item 5): choosing the lowest point estimate among many
candidates picks, among near-equals, the one whose error happens to flatter it most (the
optimizer's curse), and a share scaled from another share would count as much as one
measured. So a candidate must cover the goal with its *lower* capacity bound, and candidates
rank by their *upper* latency bound, not the point estimate: a measured configuration
(``u = 0``) competes with its estimate, a derived one with its estimate plus its error, and
it wins only where it is better by more than it may be wrong. The upper bound rather than the
point estimate among feasible candidates because the curse bites the latency objective as much
as the capacity test (the issue's over-predicted fractional verifiers won on latency as well);
the price is at most ``u`` of latency where a derived share was in truth better, and it falls
as live points and reprofiling shrink ``u``. Where every profile is measured the bounds are the
estimates and the search is the paper's. Reported figures (``latency``, ``throughput``) stay
point estimates; the bounds are reported beside them.

Invariants: pure over frozen inputs (callers on an event loop run it in a thread); the returned
predictions come from :func:`optimizer.model.alp.predict` on the chosen allocation.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from optimizer.model import alp
from optimizer.model.alp import ModelAlloc, Pipeline, Stage
from optimizer.model.batch import predict_many
from optimizer.placement import (
    PlacedReplica,
    Placement,
    PlacementError,
    ReplicaDemand,
    check_placement,
    place,
)
from optimizer.search.result import ModelChoice, SearchResult, SearchStats, WorkflowAllocation
from optimizer.search.space import (
    FEASIBLE_RTOL,
    MAX_MIN,
    MIN_SUM,
    ExcludedConfig,
    FloatArray,
    IntArray,
    LineLayout,
    ModelRules,
    SearchProblem,
    WorkflowTarget,
    backtrack,
    best_split,
    chain,
    count_chain,
    line_gpus,
    line_layout,
    model_rules,
    packing_order,
    run_configs,
    valid_mask,
)
from optimizer.search.welfare import TIE_TOL, policy

__all__ = [
    "MIN_HEADROOM",
    "ExcludedConfig",
    "ModelChoice",
    "PlacedSearch",
    "SearchProblem",
    "SearchResult",
    "SearchStats",
    "WorkflowAllocation",
    "WorkflowTarget",
    "line_placement",
    "relaxations",
    "replica_demands",
    "search",
    "search_and_place",
    "search_as_posed",
]


# The least headroom a relaxed search keeps: at its capacity itself a workflow's latency is
# unbounded, so the goal stays a little above the rate.
MIN_HEADROOM = 0.02


@dataclass(frozen=True)
class _Configs:
    """One LLM's valid configurations, as parallel arrays (``offset``: line unit mod cycle)."""

    stage: Stage
    offset: IntArray
    units: IntArray
    tp: IntArray
    replicas: IntArray
    share: FloatArray
    rest: IntArray  # the mixed family's TP-1 rest group (0: none)
    rest_share: FloatArray
    raw: FloatArray  # (cycle, U+1): configurations per (offset, units) before the rules
    valid: FloatArray  # (cycle, U+1): 1 where at least one survives the rules


def _configs(
    problem: SearchProblem, layout: LineLayout, stage: Stage, rules: ModelRules
) -> _Configs:
    cycle, total = layout.cycle, problem.units
    grid_o, grid_u = np.meshgrid(np.arange(cycle), np.arange(1, total + 1), indexing="ij")
    o, u = grid_o.ravel(), grid_u.ravel()
    rc = run_configs(layout, o, u)
    raw = np.zeros((cycle, total + 1))
    np.add.at(raw, (o[rc.run], u[rc.run]), 1.0)
    ok = valid_mask(rules, rc)
    co, cu = o[rc.run[ok]], u[rc.run[ok]]
    valid = np.zeros((cycle, total + 1))
    valid[co, cu] = 1.0
    return _Configs(
        stage,
        co,
        cu,
        rc.tp[ok],
        rc.replicas[ok],
        rc.share[ok],
        rc.rest[ok],
        rc.rest_share[ok],
        raw,
        valid,
    )


@dataclass(frozen=True)
class _Tables:
    lat: FloatArray  # (F, U+1) best upper-bound contribution among those covering the target
    lat_arg: IntArray
    cap: FloatArray  # (F, U+1) best lower-bound capacity
    cap_arg: IntArray
    contribution: FloatArray  # per configuration, at the slow end of its uncertainty
    capacity: FloatArray  # per configuration, at the slow end of its uncertainty
    predicted: int


def _cell_best(
    cell: IntArray, key: FloatArray, size: int, worst: float
) -> tuple[FloatArray, IntArray]:
    """Per cell, the smallest ``key`` and the index of the row holding it."""
    best = np.full(size, worst)
    arg = np.full(size, -1, dtype=np.int64)
    if cell.size:
        order = np.lexsort((key, cell))
        cells, first = np.unique(cell[order], return_index=True)
        best[cells] = key[order[first]]
        arg[cells] = order[first]
    return best, arg


def _tables(
    problem: SearchProblem, c: _Configs, workflow: str, rate: float, target: float, cycle: int
) -> _Tables:
    total = problem.units
    # one integer key per (tp, replicas, share, rest, rest share): a 1-D unique is far
    # cheaper than rows' (shares are multiples of 1 / granularity, at most 1: 8 bits each)
    steps = np.round(c.share * problem.granularity).astype(np.int64)
    rest_steps = np.round(c.rest_share * problem.granularity).astype(np.int64)
    key = (((c.replicas * 64 + c.tp) * 256 + steps) * 256 + c.rest) * 256 + rest_steps
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    single = Pipeline(workflow, (c.stage,))
    pred = predict_many(
        single,
        problem.book,
        rate,
        c.replicas[first, None],
        c.tp[first, None],
        c.share[first, None],
        stat=problem.stat,
        pooling=problem.pooling,
        rest=c.rest[first, None],
        rest_share=c.rest_share[first, None],
    )
    # ranked at the slow end of the uncertainty (module docstring), unless relaxed
    if problem.cautious:
        contribution = pred.contribution_high[inverse, 0]
        capacity = pred.throughput_low[inverse]
    else:
        contribution = pred.contribution[inverse, 0]
        capacity = pred.throughput[inverse]
    cell = c.offset * (total + 1) + c.units
    covers = capacity >= target * (1.0 - FEASIBLE_RTOL)
    lat_key = np.where(covers & np.isfinite(contribution), contribution, np.inf)
    lat, lat_arg = _cell_best(cell, lat_key, cycle * (total + 1), np.inf)
    neg_cap, cap_arg = _cell_best(cell, -capacity, cycle * (total + 1), np.inf)
    shape = (cycle, total + 1)
    return _Tables(
        lat.reshape(shape),
        lat_arg.reshape(shape),
        -neg_cap.reshape(shape),
        cap_arg.reshape(shape),
        contribution,
        capacity,
        len(first),
    )


class _Workflow:
    """One workflow's search state: configurations and tables in packing order."""

    def __init__(self, problem: SearchProblem, target: WorkflowTarget, layout: LineLayout) -> None:
        self.problem, self.target, self.cycle = problem, target, layout.cycle
        pipe = target.pipeline
        self.order = packing_order(problem, pipe)
        self.configs = [
            _configs(
                problem,
                layout,
                pipe.stages[j],
                model_rules(problem, pipe.workflow, pipe.stages[j].model),
            )
            for j in self.order
        ]
        self.goal = target.rate * (1.0 + problem.headroom)
        self.tables = [
            _tables(problem, c, pipe.workflow, target.rate, self.goal, self.cycle)
            for c in self.configs
        ]
        self.predicted = sum(t.predicted for t in self.tables)

    def latency_curve(self, start: int) -> FloatArray:
        """Best workflow latency per budget (units, prefix-best) from ``start``."""
        best, _ = chain(
            [t.lat for t in self.tables], start, self.problem.units, self.cycle, MIN_SUM
        )
        pipe = self.target.pipeline
        return np.minimum.accumulate(pipe.overlap * best + pipe.tool_time)

    def capacity_curve(self, start: int) -> FloatArray:
        best, _ = chain(
            [t.cap for t in self.tables], start, self.problem.units, self.cycle, MAX_MIN
        )
        return np.maximum.accumulate(best)

    def stats(self, start: int, budget: int, seconds: float) -> SearchStats:
        generated = count_chain([c.raw for c in self.configs], start, budget, self.cycle)
        evaluated = count_chain([c.valid for c in self.configs], start, budget, self.cycle)
        return SearchStats(
            round(generated),
            round(generated - evaluated),
            round(evaluated),
            self.predicted,
            seconds,
        )

    def choose(self, start: int, budget: int, utility: float, seconds: float) -> WorkflowAllocation:
        """The allocation for ``budget`` units from ``start`` (feasible, else max capacity)."""
        p, pipe, f = self.problem, self.target.pipeline, self.cycle
        tables, rate = self.tables, self.target.rate
        best, choices = chain([t.lat for t in tables], start, p.units, f, MIN_SUM)
        feasible = bool(np.isfinite(best[: budget + 1]).any())
        if not feasible:
            cap = self.capacity_curve(start)[budget]
            if not cap > 0:
                return WorkflowAllocation(
                    pipe.workflow,
                    rate,
                    0.0,
                    False,
                    np.inf,
                    0.0,
                    "",
                    utility,
                    start,
                    budget,
                    (),
                    self.stats(start, budget, seconds),
                )
            # The lowest latency among allocations reaching that capacity, at the rate they
            # serve with headroom.
            rate = float(cap) / (1.0 + p.headroom)
            tables = [_tables(p, c, pipe.workflow, rate, float(cap), f) for c in self.configs]
            best, choices = chain([t.lat for t in tables], start, p.units, f, MIN_SUM)
        args = [t.lat_arg for t in tables]
        used = int(np.argmin(best[: budget + 1]))
        if not np.isfinite(best[used]):
            # No headroom: at its full capacity every allocation's latency is unbounded, so
            # any allocation reaching that capacity will do.
            best, choices = chain([t.cap for t in tables], start, p.units, f, MAX_MIN)
            args = [t.cap_arg for t in tables]
            used = int(np.argmax(best[: budget + 1]))
        units = backtrack(choices, used)
        picks: dict[str, tuple[ModelAlloc, int, int]] = {}
        pos = start
        for c, arg, u in zip(self.configs, args, units, strict=True):
            i = int(arg[pos % f, u])
            picks[c.stage.model] = (
                ModelAlloc(
                    int(c.replicas[i]),
                    int(c.tp[i]),
                    float(c.share[i]),
                    int(c.rest[i]),
                    float(c.rest_share[i]),
                ),
                u,
                pos,
            )
            pos += u
        allocation = {m: a for m, (a, _, _) in picks.items()}
        pred = alp.predict(pipe, p.book, allocation, rate, stat=p.stat, pooling=p.pooling)
        g = p.granularity
        models = tuple(
            ModelChoice(
                s.model,
                picks[s.model][0],
                picks[s.model][1],
                picks[s.model][2] % g,
                picks[s.model][2],
                sp.contribution,
                sp.capacity,
            )
            for s, sp in zip(pipe.stages, pred.stages, strict=True)
        )
        return WorkflowAllocation(
            pipe.workflow,
            self.target.rate,
            rate,
            feasible,
            pred.latency,
            pred.throughput,
            pred.bottleneck,
            utility,
            start,
            budget,
            models,
            self.stats(start, budget, seconds),
            pred.latency_high,
            pred.capacity_low,
        )


def utility_curve(
    latency: FloatArray, capacity: FloatArray, goal: float, alone: float
) -> FloatArray:
    """Welfare utility per budget: ``alone / latency`` where the goal is covered, else the
    fraction of the goal served minus one (so any feasible budget beats any infeasible one)."""
    served = np.clip(np.where(capacity > 0, capacity, 0.0) / goal, 0.0, 1.0) - 1.0
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = alone / latency if np.isfinite(alone) else np.ones_like(latency)
        return np.where(np.isfinite(latency), ratio, np.minimum(served, -1e-12))


def search(problem: SearchProblem) -> SearchResult:
    """The best allocation of every workflow of ``problem`` (see the module docstring); where
    no allocation covers every goal, the first relaxation that does (``relaxed`` names it)."""
    result = search_as_posed(problem)
    if result.feasible:
        return result
    for what, easier in relaxations(problem):
        got = search_as_posed(easier)
        if got.feasible:
            return replace(got, relaxed=what)
    return result


def relaxations(problem: SearchProblem) -> list[tuple[str, SearchProblem]]:
    """The easier problems a search with no feasible answer tries, in order: point estimates
    instead of the slow end of their uncertainty, then also ``MIN_HEADROOM`` of headroom. A
    margin taken for safety must not become the reason a workflow is declared infeasible and
    every workflow is cut to an equal fraction of its rate (the egalitarian rule's answer to
    an infeasible one), which is an unbounded backlog for all of them."""
    out = []
    if problem.cautious:
        out.append(("point estimates", replace(problem, cautious=False)))
    if problem.headroom > MIN_HEADROOM:
        out.append(
            (
                f"point estimates, {MIN_HEADROOM:.0%} headroom",
                replace(problem, cautious=False, headroom=MIN_HEADROOM),
            )
        )
    return out


def search_as_posed(problem: SearchProblem) -> SearchResult:
    """The best allocation of every workflow of ``problem`` as posed, never relaxed (what the
    reference solver checks exactly)."""
    t0 = time.perf_counter()
    layout = line_layout(problem.cluster, problem.granularity)
    flows = [_Workflow(problem, w, layout) for w in problem.workflows]
    f, total = layout.cycle, problem.units
    rule = policy(problem.welfare)
    starts = range(f) if len(flows) > 1 else range(1)
    utilities = []
    for w in flows:
        lat = {o: w.latency_curve(o) for o in starts}
        cap = {o: w.capacity_curve(o) for o in starts}
        # Its best latency alone on the whole cluster (from whichever offset it may start at).
        alone = min(float(v[total - o]) for o, v in lat.items())
        table = np.full((f, total + 1), -1.0)
        for o in starts:
            table[o] = utility_curve(lat[o], cap[o], w.goal, alone)
        utilities.append(table)
    order, budgets, objective = best_split(rule.split, utilities, total, f, TIE_TOL)
    elapsed = time.perf_counter() - t0
    picked: dict[int, WorkflowAllocation] = {}
    pos = 0
    for i, b in zip(order, budgets, strict=True):  # laid out in ``order``, reported in given
        picked[i] = flows[i].choose(pos, b, float(utilities[i][pos % f, b]), elapsed)
        pos += b
    seconds = time.perf_counter() - t0
    chosen = [_with_seconds(picked[i], seconds) for i in range(len(flows))]
    totals = SearchStats(
        sum(a.stats.candidates_generated for a in chosen),
        sum(a.stats.candidates_pruned for a in chosen),
        sum(a.stats.candidates_evaluated for a in chosen),
        sum(a.stats.configs_predicted for a in chosen),
        seconds,
    )
    return SearchResult(
        tuple(chosen), rule.name, objective, problem.granularity, problem.headroom, totals
    )


def _with_seconds(a: WorkflowAllocation, seconds: float) -> WorkflowAllocation:
    return replace(a, stats=replace(a.stats, seconds=seconds))


def replica_demands(
    result: SearchResult, floors: Mapping[str, int] | None = None
) -> list[ReplicaDemand]:
    """One :class:`ReplicaDemand` per replica of ``result`` (memory in proportion to share)."""
    floors = floors or {}
    return [
        ReplicaDemand(w.workflow, m.model, tp, min(share, 1.0), None, int(floors.get(m.model, 0)))
        for w in result.workflows
        for m in w.models
        for count, tp, share in m.alloc.groups
        for _ in range(count)
    ]


def line_placement(problem: SearchProblem, result: SearchResult) -> Placement:
    """The placement the search's own layout is: every model's replicas inside the pieces of
    its run on the GPU line (TP groups on consecutive GPUs of the run, TP-1 replicas filling
    piece after piece), in :func:`replica_demands` order, checked by ``check_placement``.
    Exists for every allocation of the space (:mod:`optimizer.search.space`)."""
    f = problem.granularity
    line = line_gpus(problem.cluster)
    memory = {(n, g.index): g.memory_bytes for n, g in problem.cluster.all_gpus()}
    demands = replica_demands(result, problem.memory_floor_bytes)
    placed: list[PlacedReplica] = []
    for w in result.workflows:
        for m in w.models:
            first, end = m.start // f, m.start + m.units
            pieces = [
                (gpu, min(end, (gpu + 1) * f) - max(m.start, gpu * f))
                for gpu in range(first, -(-end // f))
            ]
            a = m.alloc
            groups: list[tuple[int, ...]]
            if a.tp > 1:
                groups = [
                    tuple(gpu for gpu, _ in pieces[r * a.tp : (r + 1) * a.tp])
                    for r in range(a.replicas)
                ]
            elif a.rest:  # one replica per piece: the whole ones first, then the partial ones
                groups = [(gpu,) for gpu, units in pieces if units == f]
                groups += [(gpu,) for gpu, units in pieces if units < f]
            else:
                slot = a.share * f
                groups = [
                    tuple([gpu]) for gpu, units in pieces for _ in range(int(units / slot + 1e-9))
                ][: a.replicas]
            if len(groups) < a.count:
                raise PlacementError(
                    f"{w.workflow}/{m.model}: {a} does not fit its run "
                    f"of {m.units} units at line unit {m.start}"
                )
            for group in groups:
                d = demands[len(placed)]
                node = line[group[0]][0]
                gpus = tuple(line[gpu][1] for gpu in group)
                mem = min(int(d.share * memory[(node, i)]) for i in gpus)
                placed.append(PlacedReplica(d, node, gpus, d.share, mem))
    out = Placement(tuple(placed))
    check_placement(problem.cluster, out)
    return out


@dataclass(frozen=True)
class PlacedSearch:
    """The last search result tried, its placement (``None``: none placed), and the way there.
    ``on_line``: the placement heuristic failed and the search's own layout was used."""

    result: SearchResult
    placement: Placement | None
    attempts: int  # searches run (1: the first result placed)
    excluded: frozenset[ExcludedConfig]  # configurations given up because they did not place
    failures: tuple[str, ...]  # the placement errors met on the way
    on_line: bool = False


def search_and_place(problem: SearchProblem, max_attempts: int = 8) -> PlacedSearch:
    """Search, then place with :func:`optimizer.placement.place` (paper §6); where that
    heuristic fails, the search's own layout is the placement (:func:`line_placement`). Only
    when both fail (a GPU type a replica cannot use, say), exclude the failing replica's model
    configuration (that workflow, TP, replicas, share) and search again: the best allocation
    without it. Gives up after ``max_attempts`` searches (``placement`` is then ``None``)."""
    failures: list[str] = []
    attempt = 0
    while True:
        attempt += 1
        result = search(problem)
        demands = replica_demands(result, problem.memory_floor_bytes)
        try:
            return PlacedSearch(
                result, place(problem.cluster, demands), attempt, problem.exclude, tuple(failures)
            )
        except PlacementError as exc:
            try:
                return PlacedSearch(
                    result,
                    line_placement(problem, result),
                    attempt,
                    problem.exclude,
                    tuple(failures),
                    on_line=True,
                )
            except PlacementError:
                pass
            failures.append(str(exc))
            if exc.demand_index is None or attempt >= max_attempts:
                return PlacedSearch(result, None, attempt, problem.exclude, tuple(failures))
            d = demands[exc.demand_index]
            alloc = result.workflow(d.workflow).allocation[d.model]
            problem = replace(
                problem,
                exclude=problem.exclude
                | {
                    ExcludedConfig(
                        d.workflow,
                        d.model,
                        alloc.tp,
                        alloc.replicas,
                        alloc.share,
                        alloc.rest,
                        alloc.rest_share,
                    )
                },
            )

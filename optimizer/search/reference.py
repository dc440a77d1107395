"""Exhaustive reference solver for the allocation search, for small instances.

Role: prove (or show exactly where not) that :mod:`optimizer.search.solve` finds the optimum of the
space :mod:`optimizer.search.space` defines. It shares only the space's rules with the search;
everything else is brute force: every units vector ``u >= 1`` with ``Σ u <= budget``, packed in
the same order, every configuration of every LLM's run on the GPU line
(:func:`optimizer.search.space.run_configs`), the full cartesian product across LLMs, the rules
applied to each row, and every
remaining row predicted with the *whole-pipeline* :func:`optimizer.model.batch.predict_many` (so the
search's per-LLM decomposition is checked too). Same selection, at the slow end of each
prediction's uncertainty as the search ranks (``latency_high``, ``throughput_low``; the point
estimates where the problem is not ``cautious``): the lowest
upper-bound latency among rows whose lower-bound throughput covers ``rate x (1 + headroom)``;
else, among rows of the highest lower-bound throughput ``T``, the lowest upper-bound latency at
the rate ``T / (1 + headroom)``.

``ratio_order=True`` adds the paper's latency-ratio pruning (LLMs earlier in the packing
order, i.e. of higher latency, get at least as many units) so the benchmark can measure what
that heuristic loses. Several workflows: :func:`solve_split` tries every split of the units.

Invariants: pure; raises :class:`ReferenceTimeout` past ``deadline`` (``time.monotonic``), so
callers can cap it; sizes grow as ``budget^LLMs x configurations^LLMs``.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from optimizer.model.alp import ModelAlloc
from optimizer.model.batch import BatchPrediction, predict_many
from optimizer.search.space import (
    FEASIBLE_RTOL,
    FloatArray,
    IntArray,
    LineLayout,
    SearchProblem,
    WorkflowTarget,
    line_layout,
    model_rules,
    packing_order,
    run_configs,
    valid_mask,
)
from optimizer.search.welfare import TIE_TOL

__all__ = ["ReferenceResult", "ReferenceTimeout", "SplitResult", "solve", "solve_split"]

CHUNK = 2048  # units vectors per batch


class ReferenceTimeout(TimeoutError):
    """The reference solver ran past its deadline."""


@dataclass(frozen=True)
class ReferenceResult:
    feasible: bool
    served_rate: float
    latency: float  # at served_rate (the point estimate)
    throughput: float
    allocation: dict[str, ModelAlloc]
    rows: int  # allocations (units x configurations) predicted
    seconds: float
    latency_high: float = math.inf  # at served_rate: what the rows ranked by (slow end if cautious)
    throughput_low: float = 0.0  # what had to cover the goal (the slow end if cautious)


def _compositions(length: int, total: int, cap: int | None) -> IntArray:
    """Every vector of ``length`` entries >= 1 with sum <= ``total`` (non-increasing and at most
    ``cap`` when ``cap`` is given)."""
    rows = np.zeros((1, 0), dtype=np.int64)
    sums = np.zeros(1, dtype=np.int64)
    prev = np.full(1, total if cap is None else cap, dtype=np.int64)
    for i in range(length):
        room = total - sums - (length - i - 1)
        most = np.maximum(np.minimum(room, prev) if cap is not None else room, 0)
        idx = np.repeat(np.arange(len(rows)), most)
        starts = np.cumsum(most) - most
        value = np.arange(len(idx)) - np.repeat(starts, most) + 1
        rows = np.concatenate([rows[idx], value[:, None]], axis=1)
        sums, prev = sums[idx] + value, value
    return rows


def _vectors(models: int, budget: int, ratio_order: bool) -> Iterator[IntArray]:
    """Every units vector (packing order), in chunks that share their first entry."""
    for first in range(1, budget + 1):
        rest = _compositions(models - 1, budget - first, first if ratio_order else None)
        if len(rest):
            yield np.concatenate([np.full((len(rest), 1), first, dtype=np.int64), rest], axis=1)


Rows = tuple[IntArray, IntArray, FloatArray, IntArray, FloatArray]


def _rows(
    problem: SearchProblem,
    layout: LineLayout,
    target: WorkflowTarget,
    order: tuple[int, ...],
    vectors: IntArray,
    start: int,
) -> Rows:
    """(replicas, tp, share, rest, rest share) per row and stage (stage order) for every
    valid configuration."""
    stages = target.pipeline.stages
    count = len(stages)
    vec = np.arange(len(vectors))
    tp = np.zeros((len(vectors), count), dtype=np.int64)
    reps, rest = np.zeros_like(tp), np.zeros_like(tp)
    share, rest_share = np.zeros((len(vectors), count)), np.zeros((len(vectors), count))
    starts = start + np.concatenate(
        [np.zeros((len(vectors), 1), dtype=np.int64), np.cumsum(vectors, axis=1)[:, :-1]], axis=1
    )
    for pos, j in enumerate(order):
        rules = model_rules(problem, target.pipeline.workflow, stages[j].model)
        rc = run_configs(layout, starts[vec, pos], vectors[vec, pos])
        vec, tp, reps, share = vec[rc.run], tp[rc.run], reps[rc.run], share[rc.run]
        rest, rest_share = rest[rc.run], rest_share[rc.run]
        tp[:, j], reps[:, j], share[:, j] = rc.tp, rc.replicas, rc.share
        rest[:, j], rest_share[:, j] = rc.rest, rc.rest_share
        ok = valid_mask(rules, rc)
        vec, tp, reps, share = vec[ok], tp[ok], reps[ok], share[ok]
        rest, rest_share = rest[ok], rest_share[ok]
    return reps, tp, share, rest, rest_share


def solve(
    problem: SearchProblem,
    workflow: int = 0,
    start: int = 0,
    budget: int | None = None,
    ratio_order: bool = False,
    deadline: float | None = None,
) -> ReferenceResult:
    """Brute-force optimum of workflow ``workflow`` on ``budget`` units from unit ``start``."""
    t0 = time.perf_counter()
    target = problem.workflows[workflow]
    pipe, layout = target.pipeline, line_layout(problem.cluster, problem.granularity)
    budget = problem.units if budget is None else budget
    order = packing_order(problem, pipe)
    goal = target.rate * (1.0 + problem.headroom)
    parts = []
    for chunk in _vectors(len(pipe.stages), budget, ratio_order):
        for i in range(0, len(chunk), CHUNK):
            if deadline is not None and time.monotonic() > deadline:
                raise ReferenceTimeout(f"{pipe.workflow}: reference solver past its deadline")
            parts.append(_rows(problem, layout, target, order, chunk[i : i + CHUNK], start))
    empty = np.zeros((0, len(pipe.stages)))
    reps, tp, share, rest, rest_share = (
        np.concatenate([p[k] for p in parts]) if parts else empty for k in range(5)
    )
    if len(reps) == 0:
        return ReferenceResult(False, 0.0, math.inf, 0.0, {}, 0, time.perf_counter() - t0)

    def run(rate: float) -> BatchPrediction:
        return predict_many(
            pipe,
            problem.book,
            rate,
            reps,
            tp,
            share,
            stat=problem.stat,
            pooling=problem.pooling,
            rest=rest,
            rest_share=rest_share,
        )

    rate = target.rate
    pred = run(rate)
    covers = _low(problem, pred) >= goal * (1.0 - FEASIBLE_RTOL)
    feasible = bool(covers.any())
    if not feasible:
        top = float(_low(problem, pred).max())
        rate = top / (1.0 + problem.headroom)
        pred = run(rate)
        covers = _low(problem, pred) >= top * (1.0 - FEASIBLE_RTOL)
    best = int(np.argmin(np.where(covers, _high(problem, pred), np.inf)))
    alloc = {
        st.model: ModelAlloc(
            int(reps[best, j]),
            int(tp[best, j]),
            float(share[best, j]),
            int(rest[best, j]),
            float(rest_share[best, j]),
        )
        for j, st in enumerate(pipe.stages)
    }
    return ReferenceResult(
        feasible,
        rate,
        float(pred.latency[best]),
        float(pred.throughput[best]),
        alloc,
        len(reps),
        time.perf_counter() - t0,
        float(_high(problem, pred)[best]),
        float(_low(problem, pred)[best]),
    )


def _low(problem: SearchProblem, pred: BatchPrediction) -> FloatArray:
    """The capacities a candidate must cover the goal with: the slow end, unless relaxed."""
    return pred.throughput_low if problem.cautious else pred.throughput


def _high(problem: SearchProblem, pred: BatchPrediction) -> FloatArray:
    """The latencies candidates rank by: the slow end, unless relaxed."""
    return pred.latency_high if problem.cautious else pred.latency


@dataclass(frozen=True)
class SplitResult:
    budgets: tuple[int, ...]
    utilities: tuple[float, ...]
    objective: float


def utility(
    problem: SearchProblem, workflow: int, start: int, budget: int, deadline: float | None = None
) -> float:
    """The welfare utility :mod:`optimizer.search.solve` defines, by brute force (on the
    upper-bound latencies and lower-bound throughputs it ranks by)."""
    cycle, total = line_layout(problem.cluster, problem.granularity).cycle, problem.units
    goal = problem.workflows[workflow].rate * (1.0 + problem.headroom)
    alone = min(
        solve(problem, workflow, o, total - o, deadline=deadline).latency_high
        for o in range(cycle if len(problem.workflows) > 1 else 1)
    )
    here = solve(problem, workflow, start, budget, deadline=deadline)
    if here.feasible:
        return alone / here.latency_high if math.isfinite(alone) else 1.0
    return min(min(here.throughput_low / goal, 1.0) - 1.0, -1e-12)


def solve_split(problem: SearchProblem, deadline: float | None = None) -> SplitResult:
    """Every split of the cluster's units between the workflows, scored by the welfare policy
    (egalitarian: the worst utility, ties by the sum; social: the sum)."""
    count, total = len(problem.workflows), problem.units
    cycle = line_layout(problem.cluster, problem.granularity).cycle
    memo: dict[tuple[int, int, int], float] = {}

    def util(w: int, start: int, budget: int) -> float:
        key = (w, start % cycle, budget)
        if key not in memo:
            memo[key] = utility(problem, w, start, budget, deadline)
        return memo[key]

    best: tuple[tuple[float, float], SplitResult] | None = None
    for budgets in itertools.product(range(total + 1), repeat=count):
        if sum(budgets) > total:
            continue
        starts = np.concatenate([[0], np.cumsum(budgets)[:-1]])
        utils = tuple(
            util(w, int(s), b) for w, (s, b) in enumerate(zip(starts, budgets, strict=True))
        )
        score = (min(utils), sum(utils)) if problem.welfare == "egalitarian" else (sum(utils), 0.0)
        if (
            best is None
            or score[0] > best[0][0] + TIE_TOL
            or (abs(score[0] - best[0][0]) <= TIE_TOL and score[1] > best[0][1] + TIE_TOL)
        ):
            best = (score, SplitResult(budgets, utils, score[0]))
    assert best is not None
    return best[1]

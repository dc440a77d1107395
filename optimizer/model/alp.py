"""The Aggregate LLM Pipeline: a workflow's latency and throughput under an allocation.

Role: paper §4 eqs. 1-2, DESIGN §1. A workflow becomes one stage per LLM ``m`` with ``n_m``
calls per request and request-level parallelism ``p_m``; with ``d_m`` replicas of a profile
``(t_m, s_m)``:

    stage latency   L_wm = L_m(λ_w · n_m / d_m) · n_m / p_m
    latency         L_w  = Σ_m L_wm - Σ_(m,m') overlap(L_wm, L_wm') + tool_time
    throughput      T_w  = min_m d_m · T_m / n_m        (the argmin is the bottleneck)

Overlap (beyond the paper): calls fanned out across different LLMs are not serial. Per pair
of stages whose calls ran at once in the traced requests (``overlaps``), with contributions
``x`` and ``y``, ``overlap(x, y) = min(coupling · xy/(x+y), min(x, y))``: the shared time of a
fork-join of two independent exponential branches (mean longest ``x + y - xy/(x+y)``), with
``coupling`` making it exact at the traced load. When one stage queues, the other, beside
it, stays hidden. Three models at once count pairwise, and the path is never shorter than
its longest stage. With no pairs known (a scenario file's workflow, the search's budget
curves) the traced ratio ``overlap`` (mean critical path / mean Σ per-model busy time)
stands in: ``L_w = overlap · Σ_m L_wm + tool_time``. ``tool_time`` (mean uncovered time
inside a request) is a fixed, load-independent stage.

Pooling (beyond the paper): a router puts a freely routed call on the replica with the fewest
calls in flight, so ``d`` replicas serve it faster than one at ``λ/d``; far less than a shared
FCFS queue would (a batching replica shares its batch; a placed call never moves), and only
for the ``1 / n_m`` of calls not pinned to a replica by prefix affinity. With ``L_m^0`` the
profile's light-load latency and ``rho`` the utilisation:

    pooled L_m = L_m - (1 / n_m) · max(L_m - L_m^0, 0) · (1 - f(rho, d)^POOLING_EXPONENT)
    f(rho, d)  = rho^(sqrt(2(d+1)) - 2) / d    (M/M/c over M/M/1 waiting, Sakasegawa; 1 at d=1)

``p_m`` is the ratio-of-totals parallelism (``ModelStats.p_agg``) by default, so that
``n_m · L_m / p_m`` is ``m``'s mean per-request busy time at the traced load and the prediction
reproduces the trace's mean latency there; ``parallelism="paper"`` takes the per-request mean.

Uncertainty (issue 24): every profile carries a relative uncertainty ``u_m`` of its speed
(:mod:`optimizer.model.shares`: 0 where the share was profiled, wider the farther the share it
was derived from). Each stage is also evaluated on its *pessimistic* curve, the profile run
``1 / (1 + u_m)`` as fast, which gives the bounds:

    capacity_low  = min_m d_m · T_m / ((1 + u_m) · n_m)
    latency_high  = the same combination of the stages' pessimistic contributions

The stages' errors are taken as fully correlated (every stage at its slow end at once): the
shares of one allocation are derived by the same rule, and typically from the same ``β``, so
they err the same way; and a bound that is a sum of per-stage bounds keeps the search's
per-LLM decomposition exact (a root-sum-square would not). With every ``u_m = 0`` the bounds
are the point estimates.

Invariants: pure functions over frozen dataclasses, no I/O. A rate at or beyond any stage's
capacity gives latency ``inf``. Stages whose profile was scaled from another GPU share are
flagged (``scaled_from``). :func:`optimizer.model.batch.predict_many` evaluates a batch of
allocations with numpy, by the same equations.
What was tried before these rules, and by how much it missed: bench/results/alp_history.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from optimizer.model.curves import Profile, ProfileBook, Stat
from optimizer.stats.figures import WorkflowStats

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
# how much of a shared queue's pooling gain d replicas behind the router get (see above)
POOLING_EXPONENT = 0.25


@dataclass(frozen=True, slots=True)
class Stage:
    model: str
    n: float  # calls per workflow request
    p: float  # request-level parallelism (>= 1)


@dataclass(frozen=True, slots=True)
class Overlap:
    """Stages ``a`` and ``b`` run calls at the same time within a request; ``coupling`` is
    their traced time together over ``xy/(x+y)`` of their traced busy times (in (0, 2])."""

    a: str
    b: str
    coupling: float

    @classmethod
    def traced(
        cls, a: str, b: str, together: float, busy_a: float, busy_b: float
    ) -> Overlap | None:
        """From the mean time both ran per request and each one's mean busy time (s); ``None``
        when any of them is not a positive number."""
        if not all(math.isfinite(v) and v > 0 for v in (together, busy_a, busy_b)):
            return None
        return cls(a, b, together / (busy_a * busy_b / (busy_a + busy_b)))


@dataclass(frozen=True, slots=True)
class Pipeline:
    """A workflow as the ALP sees it."""

    workflow: str
    stages: tuple[Stage, ...]
    overlap: float = 1.0  # critical path / Σ per-model busy time, in (0, 1] (see above)
    tool_time: float = 0.0  # seconds per request spent outside any LLM call
    overlaps: tuple[Overlap, ...] = ()  # pairs of stages whose calls run at once

    @classmethod
    def from_stats(
        cls,
        stats: WorkflowStats,
        parallelism: Literal["agg", "paper"] = "agg",
        cross_model_overlap: bool = True,
        tool_stage: bool = True,
    ) -> Pipeline:
        pairs = [
            Overlap.traced(a, b, t, stats.models[a].busy_mean, stats.models[b].busy_mean)
            for (a, b), t in stats.overlaps.items()
            if a in stats.models and b in stats.models
        ]
        return cls.from_figures(
            stats.workflow,
            {
                ms.model: (ms.n, ms.p_agg if parallelism == "agg" else ms.p)
                for ms in stats.models.values()
            },
            overlap=stats.overlap_factor if cross_model_overlap else 1.0,
            tool_time=stats.tool_time_mean if tool_stage else 0.0,
            overlaps=[o for o in pairs if o is not None] if cross_model_overlap else (),
        )

    @classmethod
    def from_figures(
        cls,
        workflow: str,
        models: Mapping[str, tuple[float, float]],
        overlap: float = 1.0,
        tool_time: float = 0.0,
        overlaps: Sequence[Overlap] = (),
    ) -> Pipeline:
        """From per-model ``(n, p)`` and the workflow's overlap, tool time and overlapping
        pairs, as statistics report them (a JSON report's, say): a ``p`` below 1 or not
        finite counts as 1, an overlap that is not a positive number as 1, a tool time that
        is not as 0; a pair naming a model without a stage, or with a coupling that is not
        a positive number, is dropped."""
        return cls(
            workflow=workflow,
            stages=tuple(
                Stage(m, n, p if math.isfinite(p) and p >= 1.0 else 1.0)
                for m, (n, p) in models.items()
            ),
            overlap=overlap if math.isfinite(overlap) and overlap > 0 else 1.0,
            tool_time=tool_time if math.isfinite(tool_time) and tool_time > 0 else 0.0,
            overlaps=tuple(
                o
                for o in overlaps
                if o.a in models
                and o.b in models
                and o.a != o.b
                and math.isfinite(o.coupling)
                and o.coupling > 0
            ),
        )


@dataclass(frozen=True, slots=True)
class ModelAlloc:
    """One model's share of an allocation: ``replicas`` copies at TP ``tp``, each on ``share``
    of each of its ``tp`` GPUs, and ``rest`` more TP-1 copies on ``rest_share`` of a GPU each
    (mixed shares: the whole GPUs of a run plus its partial ones, ``3 x 1.0 + 1 x 0.5``)."""

    replicas: int
    tp: int = 1
    share: float = 1.0
    rest: int = 0
    rest_share: float = 0.0

    @property
    def groups(self) -> tuple[tuple[int, int, float], ...]:
        """``(replicas, tp, share)`` of each group of identical replicas."""
        main = ((self.replicas, self.tp, self.share),)
        return (*main, (self.rest, 1, self.rest_share)) if self.rest else main

    @property
    def count(self) -> int:
        """Replicas of every group."""
        return self.replicas + self.rest

    @property
    def gpus(self) -> float:
        """GPUs held, shares summed."""
        return sum(d * t * s for d, t, s in self.groups)

    def doc(self) -> dict[str, float]:
        """{replicas, tp, share, gpus} (shares rounded to 4 digits), with ``rest`` and
        ``rest_share`` where there is a rest group."""
        out: dict[str, float] = {
            "replicas": self.replicas,
            "tp": self.tp,
            "share": round(self.share, 4),
            "gpus": round(self.gpus, 4),
        }
        if self.rest:
            out |= {"rest": self.rest, "rest_share": round(self.rest_share, 4)}
        return out

    @classmethod
    def from_doc(cls, doc: Mapping[str, float]) -> ModelAlloc:
        """The allocation :meth:`doc` wrote (``gpus`` is derived, so not read)."""
        return cls(
            int(doc["replicas"]),
            int(doc["tp"]),
            float(doc["share"]),
            int(doc.get("rest", 0)),
            float(doc.get("rest_share", 0.0)),
        )

    def shares(self) -> str:
        """The share column of a table: ``0.50``, or ``1.00 + 1 x 0.50`` with a rest group."""
        return f"{self.share:.2f}" + (
            f" + {self.rest} x {self.rest_share:.2f}" if self.rest else ""
        )

    def describe(self) -> str:
        """``2 x TP1 @ 0.50`` (``+ 1 x 0.25`` with a rest group)."""
        main = f"{self.replicas} x TP{self.tp} @ {self.share:.2f}"
        return main + (f" + {self.rest} x {self.rest_share:.2f}" if self.rest else "")


@dataclass(frozen=True, slots=True)
class StagePrediction:
    model: str
    call_rate: float  # calls per second per replica
    call_latency: float  # L_m at that rate (s)
    contribution: float  # L_wm = call_latency · n / p (s), before overlaps are taken off
    capacity: float  # d · T_m / n: workflow requests per second this stage sustains
    utilisation: float  # rate / capacity
    scaled_from: float | None  # the measured share this stage's profile was scaled from
    uncertainty: float = 0.0  # the profile's relative uncertainty u_m
    capacity_low: float = 0.0  # d · T_m / ((1 + u_m) · n): the capacity's slow end
    contribution_high: float = math.inf  # L_wm on the pessimistic curve (s)


@dataclass(frozen=True, slots=True)
class Prediction:
    workflow: str
    rate: float  # workflow requests per second
    latency: float  # predicted mean (or percentile) latency (s); inf when overloaded
    throughput: float  # T_w
    bottleneck: str  # the stage with the least capacity
    stages: tuple[StagePrediction, ...]
    stat: Stat
    capacity_low: float = 0.0  # T_w with every stage at its slow end (module docstring)
    latency_high: float = math.inf  # latency with every stage at its slow end (s)

    @property
    def feasible(self) -> bool:
        return self.rate < self.throughput


def pooling_factor(rho: npt.ArrayLike, replicas: npt.ArrayLike) -> FloatArray:
    """Waiting time of ``d`` pooled servers relative to one server, both at utilisation
    ``rho`` (Sakasegawa: ``Lq(M/M/c) ≈ rho^sqrt(2(c+1)) / (1-rho)``); exactly 1 for ``d = 1``."""
    d = np.maximum(np.asarray(replicas, dtype=np.float64), 1.0)
    r = np.clip(np.asarray(rho, dtype=np.float64), 1e-9, 1.0)
    return np.asarray(r ** (np.sqrt(2.0 * (d + 1.0)) - 2.0) / d, dtype=np.float64)


def stage_latency(
    prof: Profile,
    call_rate: npt.ArrayLike,
    replicas: npt.ArrayLike,
    stat: Stat,
    pooling: bool,
    calls_per_request: float,
) -> FloatArray:
    """A stage's call latency at ``call_rate`` calls/s per replica on ``prof``, less the
    pooling gain of ``replicas`` replicas behind the router (module docstring)."""
    lat = prof.latency(call_rate, stat)
    if not pooling:
        return lat
    rho = np.asarray(call_rate, dtype=np.float64) / prof.saturation
    free = 1.0 / max(1.0, calls_per_request)  # calls the router places freely (see above)
    with np.errstate(invalid="ignore"):
        excess = np.maximum(lat - float(prof.lat[stat][0]), 0.0)
        gain = 1.0 - pooling_factor(rho, replicas) ** POOLING_EXPONENT
        pooled = lat - free * excess * gain
    return np.asarray(np.where(np.isfinite(lat), pooled, lat), dtype=np.float64)


def _mixed(
    st: Stage,
    rate: float,
    counts: FloatArray,
    profs: Sequence[Profile],
    stat: Stat,
    pooling: bool,
) -> tuple[float, float, float]:
    """One stage served by groups of replicas (``counts[g]`` of profile ``profs[g]``): the
    call rate per replica of the first group, the stage's call latency and its capacity
    (workflow requests/s). The router spreads calls in proportion to the replicas' speed
    (every replica at the same utilisation), so the stage's latency is the groups' latencies
    weighted by the calls each serves; pooling counts every replica. One group: eqs. 1-2."""
    sat = np.array([p.saturation for p in profs])
    total = float((counts * sat).sum())
    capacity = total / st.n if st.n > 0 else math.inf
    calls = rate * st.n
    if len(profs) == 1:
        per_replica = np.array([calls / counts[0]])
    else:
        per_replica = calls * sat / total if total > 0 else np.full(len(profs), math.inf)
    pool = float(counts.sum())
    lat = np.array(
        [
            float(stage_latency(p, r, pool, stat, pooling, st.n))
            for p, r in zip(profs, per_replica, strict=True)
        ]
    )
    served = counts * sat / total if total > 0 else counts / counts.sum()
    latency = float((served * lat).sum()) if np.isfinite(lat).all() else math.inf
    return float(per_replica[0]), latency, capacity


def critical_path(pipeline: Pipeline, contribution: npt.ArrayLike) -> FloatArray:
    """Per candidate, the mean time a request spends in LLM calls, from its stages'
    contributions (a (C, M) array in stage order; see the module docstring). Infinite where
    any contribution is."""
    c = np.asarray(contribution, dtype=np.float64)
    total = c.sum(axis=1)
    if not pipeline.overlaps:
        return np.asarray(pipeline.overlap * total, dtype=np.float64)
    column = {st.model: j for j, st in enumerate(pipeline.stages)}
    for o in pipeline.overlaps:
        x, y = c[:, column[o.a]], c[:, column[o.b]]
        shorter = np.minimum(x, y)
        with np.errstate(invalid="ignore", divide="ignore"):
            both = np.minimum(o.coupling * x * y / (x + y), shorter)
        # both stages idle (0/0), or one unbounded (the total is already inf): nothing to take
        total = total - np.where(np.isfinite(both), both, 0.0)
    return np.asarray(np.maximum(total, c.max(axis=1, initial=0.0)), dtype=np.float64)


def predict(
    pipeline: Pipeline,
    book: ProfileBook,
    allocation: Mapping[str, ModelAlloc],
    rate: float,
    stat: Stat = "mean",
    pooling: bool = True,
    busy: Mapping[str, float] | None = None,
) -> Prediction:
    """Latency and throughput of ``pipeline`` at ``rate`` requests/s under ``allocation``;
    ``busy``: per model, the packed curve's weight where it was placed
    (:mod:`optimizer.model.colocation`; a model left out, or ``None``: the packed curve)."""
    stages = []
    for st in pipeline.stages:
        alloc = allocation[st.model]
        weight = None if busy is None else busy.get(st.model)
        profs = [book.lookup(st.model, t, s, busy=weight) for _, t, s in alloc.groups]
        counts = np.array([float(d) for d, _, _ in alloc.groups])
        fast = _mixed(st, rate, counts, profs, stat, pooling)
        slow = _mixed(st, rate, counts, [p.pessimistic() for p in profs], stat, pooling)
        call_rate, call_latency, capacity = fast
        high, capacity_low = slow[1], slow[2]
        stages.append(
            StagePrediction(
                model=st.model,
                call_rate=call_rate,
                call_latency=call_latency,
                contribution=call_latency * st.n / st.p,
                capacity=capacity,
                utilisation=rate / capacity if capacity > 0 else math.inf,
                scaled_from=next((p.scaled_from for p in profs if p.scaled_from), None),
                uncertainty=max(p.uncertainty for p in profs),
                capacity_low=capacity_low,
                contribution_high=high * st.n / st.p,
            )
        )
    neck = min(stages, key=lambda s: s.capacity)
    path = critical_path(pipeline, [[s.contribution for s in stages]])
    latency = float(path[0]) + pipeline.tool_time
    capacity_low = min(s.capacity_low for s in stages)
    high = float(critical_path(pipeline, [[s.contribution_high for s in stages]])[0])
    latency_high = high + pipeline.tool_time if rate < capacity_low else math.inf
    return Prediction(
        workflow=pipeline.workflow,
        rate=rate,
        latency=latency if math.isfinite(latency) else math.inf,
        throughput=neck.capacity,
        bottleneck=neck.model,
        stages=tuple(stages),
        stat=stat,
        capacity_low=capacity_low,
        latency_high=latency_high if math.isfinite(latency_high) else math.inf,
    )

"""Scepsy as the product runs it, on the simulator: trace, statistics, profiles, search, placement.

Role: the "scepsy" system and its ablations in ``bench.evaluation.evaluate``. Per workflow kind:
1. trace: a light-load simulated run is written to a temporary trace store with
   ``sim.trace.write_trace`` and summarised with ``optimizer.stats.reader.summarise_store`` — exactly the
   records the proxy would have written, read the way the daemon reads them;
2. profiles: per model, TP degree and GPU share, the profiler's sweep is done by simulation
   (``sim.profiling``: the model alone on one replica, every other model over-provisioned,
   light load up to saturation, then refined below it);
3. per target rate: ``optimizer.search.solve.search_and_place`` with the shipped settings
   (granularity 10, headroom 10%, egalitarian welfare) and the ablation flags, and the result
   turned into the simulator's ``Allocation``.

Invariants: profiles and pipelines are computed once per workflow kind and reused for every
cluster size and rate; an allocation that does not place is reported (``SystemAllocation.placed``), never
silently replaced; every figure is simulated. (A :class:`SystemAllocation` is what one
system runs for some rates; the optimizer's rollout plan is ``optimizer.plan.planner.Plan``.)
"""

from __future__ import annotations

import hashlib
import inspect
import math
import platform
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench.accuracy.cases import Case
from bench.evaluation.setup import (
    BEAM,
    GPU,
    GRANULARITY,
    HEADROOM,
    RAG,
    cluster,
    memory_floor_bytes,
    workflow_models,
)
from optimizer.model.alp import ModelAlloc, Pipeline, predict
from optimizer.model.curves import ProfileBook
from optimizer.search.solve import search_and_place
from optimizer.search.space import SearchProblem, WorkflowTarget
from optimizer.stats.figures import WorkflowStats
from optimizer.stats.reader import summarise_store
from shared.profile_points import ProfilePoint
from sim.cluster import Allocation, ReplicaSpec
from sim.cluster import place as sim_place
from sim.des import WorkloadSpec, simulate
from sim.profiling import PROFILE_REQUESTS, REFINE, ProfileJob, run_profile
from sim.trace import write_trace

# Profiled (tp, share) per model: the shares the search's choices sit on or just above (the
# ALP scales a curve down to shares in between); TP 2 for the 8B models only (TP for a 1B
# generator or an encoder buys nothing on one A6000 pair).
PROFILE_KEYS: dict[str, tuple[tuple[int, float], ...]] = {
    "llama-3.2-1b": ((1, 1.0), (1, 0.5), (1, 0.2)),
    "llama-3.1-8b-prm": ((1, 1.0), (1, 0.5), (2, 1.0), (2, 0.5)),
    "e5-base-v2": ((1, 1.0), (1, 0.5), (1, 0.2)),
    "bge-reranker-base": ((1, 1.0), (1, 0.5), (1, 0.2)),
    "llama-3-8b": ((1, 1.0), (1, 0.5), (2, 1.0), (2, 0.5)),
}
TRACE = {"beam": (0.05, 150), "rag": (0.5, 300)}  # light load: rate, requests
# The modules the profiles depend on (repository-relative globs): the profile cache is keyed
# by their contents and by this module's tracing and profiling code and settings, so any
# change to them profiles afresh.
KNOWLEDGE_SOURCES = (
    "sim/*.py",
    "shared/*.py",
    "optimizer/stats*.py",
    "optimizer/stats/modality.py",
    "optimizer/model/curves.py",
    "bench/accuracy/cases.py",
)


@dataclass(frozen=True)
class Knowledge:
    """What the optimizer knows after tracing and profiling."""

    stats: dict[str, WorkflowStats]
    pipelines: dict[str, Pipeline]
    book: ProfileBook
    points: tuple[ProfilePoint, ...]
    light_latency: dict[str, float]  # simulated mean request latency at the trace's load (s)


@dataclass(frozen=True)
class SystemAllocation:
    """What one system runs for some target rates: the search's allocation, as the simulator
    runs it, with whether it placed, and the ALP's predictions for it."""

    system: str
    allocation: Allocation  # what the simulator runs
    placed: bool  # optimizer.placement placed every replica on the cluster
    feasible: bool  # the search covered every target rate with headroom
    predicted: dict[str, dict[str, float]]  # workflow -> latency, throughput (simulated units)
    sim_gpus: int  # GPUs the simulator's first-fit placement uses
    note: str = ""

    def describe(self) -> list[dict[str, Any]]:
        return [
            {"model": s.model, "replicas": s.count, "tp": s.tp, "share": round(s.share, 3)}
            for s in self.allocation.replicas
        ]


def _trace(kind: str) -> tuple[WorkflowStats, float, dict[str, float]]:
    """Stats of a light-load run via the trace store, its mean latency, and per model the calls
    one busy second serves (the profiler's first guess at capacity)."""
    rate, n = TRACE[kind]
    params = BEAM if kind == "beam" else RAG
    generous = Allocation(tuple(ReplicaSpec(m, GPU, 1, 1.0, 2) for m in workflow_models(kind)))
    res = simulate(
        generous,
        [WorkloadSpec(kind, rate, params)],  # type: ignore[arg-type]
        n_requests=n,
        record_calls=True,
        seed=11,
    )
    store = Path(tempfile.mkdtemp(prefix=f"scepsy-eval-{kind}-"))
    try:
        write_trace(res, store, bodies=False)
        stats = summarise_store(store)[kind]
    finally:
        shutil.rmtree(store, ignore_errors=True)
    busy: dict[str, float] = {}
    for r in res.replicas:
        busy[r.model] = busy.get(r.model, 0.0) + r.utilisation * res.simulated_s
    per_busy = {
        m: sum(1 for c in res.calls if c.call.model == m) / max(b, 1e-9) for m, b in busy.items()
    }
    return stats, res.workflows[kind].latency.mean, per_busy


def _jobs(
    kind: str, stats: WorkflowStats, per_busy: Mapping[str, float], calls: int, quick: bool
) -> list[ProfileJob]:
    rate, n = TRACE[kind]
    case = Case(kind, BEAM if kind == "beam" else RAG, GPU, rate, n, 0, profile_calls=calls)
    return [
        ProfileJob(
            case,
            m,
            tp,
            share,
            n_per_request=stats.models[m].n,
            target_calls=calls,
            start_rate=0.5 * share * per_busy[m],
            refine=(0.5, 0.8, 0.9) if quick else REFINE,
            # as the accuracy bench profiles: enough requests per point, and
            # keeping up judged per request for chained calls (beam search);
            # --quick halves the floor as it cuts the calls (beam's points are
            # bound by requests, not calls: the longest jobs of the run)
            min_requests=PROFILE_REQUESTS // 2 if quick else PROFILE_REQUESTS,
            parallel=stats.models[m].p_agg,
        )
        for m in workflow_models(kind)
        for tp, share in PROFILE_KEYS[m]
    ]


def learn(
    pool: Executor,
    calls: int,
    quick: bool,
    cache: Path | None = None,
    reuse: bool = False,
    profiled: Path | None = None,
) -> Knowledge:
    """Trace both workflows and profile every model (in ``pool``); the result is saved to the
    JSON file ``cache``, and with ``reuse`` read from it instead when it exists. ``profiled``:
    a saved knowledge file whose profile points stand in for profiling (the traces, seconds,
    always run: the pipelines follow the current ALP code)."""
    if cache is not None and reuse and cache.exists():
        return knowledge_from_doc(orjson.loads(cache.read_bytes()))
    kinds = ("beam", "rag")
    traced = dict(zip(kinds, pool.map(_trace, kinds), strict=True))
    if profiled is not None:
        points = knowledge_from_doc(orjson.loads(profiled.read_bytes())).points
    else:
        jobs = [j for k in kinds for j in _jobs(k, traced[k][0], traced[k][2], calls, quick)]
        order = sorted(range(len(jobs)), key=lambda i: -jobs[i].tp)  # slowest first
        done = dict(zip(order, pool.map(run_profile, [jobs[i] for i in order]), strict=True))
        points = _measured(p for i in range(len(jobs)) for p in done[i])
    k = Knowledge(
        {kd: t[0] for kd, t in traced.items()},
        {kd: Pipeline.from_stats(t[0]) for kd, t in traced.items()},
        ProfileBook(points),
        points,
        {kd: t[1] for kd, t in traced.items()},
    )
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_bytes(orjson.dumps(_to_doc(k), option=orjson.OPT_SERIALIZE_NUMPY))
    return k


def knowledge_key(calls: int, quick: bool) -> str:
    """The profiles :func:`learn` computes are a pure function of this key (seeded
    simulations): the settings, Python and numpy versions, ``KNOWLEDGE_SOURCES``' contents
    and the source of this module's functions that trace, profile and save."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256(f"{calls}/{quick}/{platform.python_version()}/{np.__version__}".encode())
    h.update(repr((BEAM, RAG, GPU, PROFILE_KEYS, TRACE, PROFILE_REQUESTS, REFINE)).encode())
    for fn in (_trace, _jobs, learn, _measured, _to_doc, knowledge_from_doc):
        h.update(inspect.getsource(fn).encode())
    for pattern in KNOWLEDGE_SOURCES:
        for f in sorted(root.glob(pattern)):
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:20]


def _measured(points: Iterable[ProfilePoint]) -> tuple[ProfilePoint, ...]:
    """The points that measured at least one call. The simulated profiler can return a point
    where no call of the model started in its window (seen for e5 at share 0.2, driven at
    thousands of calls/s): its latency is infinite at a rate of 0, and the profile's monotone
    latency envelope then makes the whole curve infinite, so the search never picks that
    share (nor the shares scaled from it)."""
    return tuple(p for p in points if p.n_calls > 0)


def _to_doc(k: Knowledge) -> dict[str, Any]:
    return {
        "pipelines": {w: asdict(p) for w, p in k.pipelines.items()},
        "points": [asdict(p) for p in k.points],
        "light_latency": k.light_latency,
        "stats": {
            w: {
                "n": {m: s.n for m, s in st.models.items()},
                "p_agg": {m: s.p_agg for m, s in st.models.items()},
                "overlap_factor": st.overlap_factor,
                "latency_mean": st.latency_mean,
            }
            for w, st in k.stats.items()
        },
    }


def knowledge_from_doc(doc: dict[str, Any]) -> Knowledge:
    from optimizer.model.alp import Overlap, Stage

    pipes = {
        w: Pipeline(
            p["workflow"],
            tuple(Stage(**s) for s in p["stages"]),
            p["overlap"],
            p["tool_time"],
            tuple(Overlap(**o) for o in p.get("overlaps", ())),
        )
        for w, p in doc["pipelines"].items()
    }
    # JSON has no infinity: a point where no call finished in time was saved with null
    # latencies (orjson), which read back as infinite again
    rows: list[dict[str, Any]] = [
        {f: math.inf if v is None else v for f, v in p.items()} for p in doc["points"]
    ]
    points = _measured(ProfilePoint(**row) for row in rows)
    return Knowledge({}, pipes, ProfileBook(points), points, dict(doc["light_latency"]))


def knowledge_doc(k: Knowledge) -> dict[str, Any]:
    """The pipelines and profile saturations, for the report."""
    return {
        "pipelines": {w: asdict(p) for w, p in k.pipelines.items()},
        "light_latency_s": k.light_latency,
        "profiles": {
            f"{p.key.model}/tp{p.key.tp}/s{p.key.share}": {
                "saturation_calls_per_s": p.saturation,
                "saturated": p.saturated,
                "points": len(p.rates),
            }
            for p in k.book.profiles.values()
        },
    }


def problem(
    k: Knowledge,
    targets: Mapping[str, float],
    gpus: int,
    allow_tp: bool = True,
    allow_fraction: bool = True,
) -> SearchProblem:
    models = {m for w in targets for m in workflow_models(w)}
    return SearchProblem(
        workflows=tuple(WorkflowTarget(k.pipelines[w], r) for w, r in targets.items()),
        book=k.book,
        cluster=cluster(gpus),
        memory_floor_bytes={m: memory_floor_bytes(m) for m in models},
        granularity=GRANULARITY,
        headroom=HEADROOM,
        allow_tp=allow_tp,
        allow_fraction=allow_fraction,
    )


def sim_gpus(allocation: Allocation) -> int:
    return 1 + max((g for _, gpus in sim_place(allocation) for g in gpus), default=-1)


def specs_of(models: Iterable[tuple[str, int, int, float]]) -> Allocation:
    """``(model, replicas, tp, share)`` as the simulator's allocation (zero replicas dropped)."""
    return Allocation(
        tuple(ReplicaSpec(m, GPU, tp, round(share, 6), d) for m, d, tp, share in models if d > 0)
    )


def allocate(
    k: Knowledge,
    targets: Mapping[str, float],
    gpus: int,
    system: str = "scepsy",
    allow_tp: bool = True,
    allow_fraction: bool = True,
) -> SystemAllocation:
    """Search and place for ``targets`` (workflow -> requests/s) on ``gpus`` GPUs."""
    placed = search_and_place(problem(k, targets, gpus, allow_tp, allow_fraction))
    result = placed.result
    allocation = specs_of(
        (m.model, count, tp, share)
        for w in result.workflows
        for m in w.models
        for count, tp, share in m.alloc.groups
    )
    predicted = {
        w.workflow: {"latency": w.latency, "throughput": w.throughput, "served_rate": w.served_rate}
        for w in result.workflows
    }
    note = "; ".join(placed.failures)
    return SystemAllocation(
        system,
        allocation,
        placed.placement is not None,
        result.feasible,
        predicted,
        sim_gpus(allocation),
        note,
    )


def capacity(k: Knowledge, kind: str, gpus: int) -> float:
    """Scepsy's predicted peak throughput of ``kind`` alone on ``gpus`` GPUs (requests/s)."""
    high = 1e4
    p = allocate(k, {kind: high}, gpus)
    return float(p.predicted[kind]["throughput"])


def capacity_beside(
    k: Knowledge, kind: str, others: Mapping[str, float], gpus: int, rtol: float = 0.01
) -> float:
    """Scepsy's predicted peak throughput of ``kind`` on ``gpus`` GPUs while every workflow of
    ``others`` keeps its rate (requests/s) covered: the predicted throughput of ``kind`` in the
    allocation for the largest rate of it the search covers beside them (bisection to
    ``rtol``). Not ``kind`` at an unreachable target: there the search splits the cluster so
    that every workflow serves the same fraction of its goal, and ``others`` with it fall
    short of their rates. 0 where ``others`` alone are not covered."""

    def covered(rate: float) -> SystemAllocation | None:
        got = allocate(k, {**others, kind: rate}, gpus)
        return got if got.feasible and got.placed else None

    hi = capacity(k, kind, gpus)
    best = covered(hi)
    if best is not None:
        return float(best.predicted[kind]["throughput"])
    lo = 0.0
    while hi - lo > rtol * hi:
        mid = (lo + hi) / 2
        got = covered(mid)
        if got is None:
            hi = mid
        else:
            lo, best = mid, got
    return float(best.predicted[kind]["throughput"]) if best is not None else 0.0


def _model_alloc(groups: Sequence[ReplicaSpec]) -> ModelAlloc | None:
    """One model's replica groups as the search's unit: one group, or a group and a rest of
    TP-1 replicas on another share (None: not expressible)."""
    if len(groups) == 1:
        g = groups[0]
        return ModelAlloc(g.count, g.tp, g.share)
    if len(groups) == 2:
        main, rest = sorted(groups, key=lambda g: (g.tp, g.share), reverse=True)
        if rest.tp == 1 and rest.share < main.share:
            return ModelAlloc(main.count, main.tp, main.share, rest.count, rest.share)
    return None


def alp_view(
    k: Knowledge, allocation: Allocation, targets: Mapping[str, float]
) -> dict[str, dict[str, float | None]]:
    """The ALP's view of any system's allocation at ``targets`` (workflow -> requests/s), to
    tell a misprediction from a search that missed: per workflow, the predicted throughput
    (per model, the sum over its replica groups of ``d · T(tp, s) / n``) and latency at the
    target rate (``None`` where a model's replicas are not one ``ModelAlloc``, the search's
    unit: one group of a TP and share, and at most one more of TP-1 replicas, its rest)."""
    out: dict[str, dict[str, float | None]] = {}
    for w, rate in targets.items():
        pipe = k.pipelines[w]
        specs = {
            st.model: [r for r in allocation.replicas if r.model == st.model] for st in pipe.stages
        }
        if not all(specs.values()):
            out[w] = {"throughput": 0.0, "latency": None}
            continue
        throughput = min(
            sum(
                r.count * k.book.lookup(st.model, r.tp, r.share).saturation for r in specs[st.model]
            )
            / st.n
            for st in pipe.stages
        )
        latency: float | None = None
        units = {m: a for m, v in specs.items() if (a := _model_alloc(v)) is not None}
        if rate > 0 and len(units) == len(specs):
            latency = predict(pipe, k.book, units, rate).latency
        out[w] = {"throughput": throughput, "latency": latency}
    return out

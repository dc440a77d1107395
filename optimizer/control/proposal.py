"""From statistics to a judged proposal: the pure glue between the daemon's stages.

Role: what the daemon computes between "a change was confirmed" and "decide": the search
problem of the observed traffic (:func:`search_problem`), the allocation that runs now as the
ALP sees it (:func:`running_allocation`), its predicted latency at the observed rates
(:func:`predict_running`, each model's curve read where its replicas were placed), and the :class:`optimizer.control.decide.Proposal` comparing it with the
search's result and the plan's size (:func:`make_proposal`). Also the JSON shapes of an
allocation and a placement that the decision log and the demo report store.

Invariants: pure (frozen values in, new values out). The running allocation is reconstructed
from the replicas a backend observes, which carry no workflow: a model serving several
workflows is split between them in proportion to their call rates (at least one replica each,
approximate; the daemon's own rollouts know better and say so in the decision log). Where a
replica set mixes configurations of one model, the most common (tp, share) stands for the
main group and, where it is TP 1, the other TP-1 replicas form the rest group at the next most
common share (``ModelAlloc.rest``); otherwise the most common stands for all.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from optimizer.control.decide import Outlook, Proposal
from optimizer.model import alp, colocation
from optimizer.model.alp import ModelAlloc, Pipeline
from optimizer.model.colocation import Placed
from optimizer.model.curves import ProfileBook
from optimizer.placement import Placement
from optimizer.plan.observed import Observed
from optimizer.plan.planner import Plan
from optimizer.search.solve import SearchProblem, SearchResult, WorkflowTarget
from optimizer.stats.figures import WorkflowStats
from shared.cluster import GB, Cluster, Node, NvlinkDomain
from shared.profile_points import ProfileError
from shared.settings import Settings

__all__ = [
    "Running",
    "allocation_doc",
    "make_proposal",
    "moved_fraction",
    "pipelines",
    "placed_replicas",
    "placement_doc",
    "predict_placed",
    "predict_running",
    "predictions_running",
    "running_allocation",
    "search_problem",
]

Running = dict[str, dict[str, ModelAlloc]]  # workflow -> model -> what serves it now


def pipelines(stats: Mapping[str, WorkflowStats]) -> dict[str, Pipeline]:
    """The ALP of every workflow with traffic and at least one model."""
    return {
        w: Pipeline.from_stats(s)
        for w, s in stats.items()
        if s.requests > 0 and s.arrival_rate > 0 and s.models
    }


def remembered(pipe: Pipeline, known: Pipeline | None) -> Pipeline:
    """``pipe`` plus the stages of ``known`` (the workflow's last trusted pipeline) that this
    window lacks: a model whose calls are all still running (calls are recorded when they
    end, so an overloaded model can vanish from a window) is not a model the workflow dropped."""
    if known is None:
        return pipe
    have = {st.model for st in pipe.stages}
    extra = tuple(st for st in known.stages if st.model not in have)
    return replace(pipe, stages=pipe.stages + extra) if extra else pipe


def search_problem(
    settings: Settings,
    pipes: Mapping[str, Pipeline],
    rates: Mapping[str, float],
    book: ProfileBook,
    cluster: Cluster,
) -> SearchProblem:
    knobs = settings.optimizer
    targets = tuple(WorkflowTarget(pipes[w], rates[w]) for w in sorted(pipes) if rates[w] > 0)
    return SearchProblem(
        targets,
        book,
        cluster,
        memory_floor_bytes={m.name: m.min_memory_bytes for m in settings.rollout.models},
        granularity=knobs.granularity,
        headroom=knobs.headroom,
        welfare=knobs.welfare,
    )


def running_allocation(
    observed: Observed, pipes: Mapping[str, Pipeline], rates: Mapping[str, float]
) -> Running:
    """Per workflow and model, the ready replicas serving it (see the module docstring)."""
    by_model: dict[str, list[tuple[int, float]]] = {}
    for r in observed.replicas:
        if r.ready:
            by_model.setdefault(r.model, []).append((r.tp, round(r.share, 6)))
    load: dict[str, dict[str, float]] = {}
    for w, pipe in pipes.items():
        for st in pipe.stages:
            load.setdefault(st.model, {})[w] = rates.get(w, 0.0) * st.n
    out: Running = {w: {} for w in pipes}
    for model, users in load.items():
        configs = by_model.get(model)
        if not configs:
            continue
        counts = Counter(configs).most_common()
        (tp, share), _ = counts[0]
        # TP-1 configurations beside a TP-1 main one: the mixed shares the search picks
        # (whole GPUs and a remainder), at the second most common share
        rest = [c for c in counts[1:] if c[0][0] == 1] if tp == 1 else []
        rest_share = rest[0][0][1] if rest else 0.0
        extra = sum(n for _, n in rest)
        main = len(configs) - extra
        total = sum(users.values())
        for w, calls in users.items():
            frac = calls / total if total > 0 else 1.0 / len(users)
            out[w][model] = ModelAlloc(
                max(1, round(main * frac)), tp, share, round(extra * frac), rest_share
            )
    return out


def placed_replicas(observed: Observed) -> tuple[Placed, ...]:
    """The ready replicas where they run, for :mod:`optimizer.model.colocation`."""
    return tuple(
        Placed(r.model, r.node, r.gpus, r.share, r.tp) for r in observed.replicas if r.ready
    )


def predictions_running(
    pipes: Mapping[str, Pipeline],
    book: ProfileBook,
    running: Running,
    rates: Mapping[str, float],
    placed: Sequence[Placed] = (),
) -> dict[str, alp.Prediction | None]:
    """The ALP's prediction of each workflow under what runs (``None``: a stage has no
    replica); workflows whose profiles are missing are left out. Each model's curve is read
    where ``placed`` put its replicas (packed where it is empty)."""
    busy = colocation.placed_weights(pipes, book, placed, rates) if placed else None
    out: dict[str, alp.Prediction | None] = {}
    for w, pipe in pipes.items():
        alloc = running.get(w, {})
        if any(st.model not in alloc for st in pipe.stages):
            out[w] = None
            continue
        try:
            out[w] = alp.predict(pipe, book, alloc, rates.get(w, 0.0), busy=busy)
        except ProfileError:
            continue
    return out


def predict_running(
    pipes: Mapping[str, Pipeline],
    book: ProfileBook,
    running: Running,
    rates: Mapping[str, float],
    placed: Sequence[Placed] = (),
) -> dict[str, float]:
    """:func:`predictions_running`'s latencies: ``inf`` when a stage has no replica or the
    rate is past capacity."""
    got = predictions_running(pipes, book, running, rates, placed)
    return {w: math.inf if p is None else p.latency for w, p in got.items()}


def cluster_without(cluster: Cluster, reserve: int) -> Cluster:
    """The cluster less its ``reserve`` highest-numbered GPUs, taken from the last nodes."""
    nodes = list(cluster.nodes)
    while reserve > 0 and nodes:
        last = nodes.pop()
        indices = sorted(g.index for g in last.gpus)
        drop = set(indices[max(0, len(indices) - reserve) :])
        reserve -= len(drop)
        domains = tuple(
            NvlinkDomain(tuple(g for g in d.gpus if g.index not in drop))
            for d in last.domains
            if any(g.index not in drop for g in d.gpus)
        )
        if domains:
            nodes.append(Node(last.name, domains))
            break
    if not nodes:
        raise ValueError("optimizer.reserve_gpus leaves no GPU to allocate")
    return Cluster(tuple(nodes))


def cluster_variants(cluster: Cluster) -> list[Cluster]:
    """The same GPUs listed in other orders (NVLink domains, and GPUs inside them, reversed):
    placement breaks ties by order, so a variant may lay replicas out where a rollout can
    move them without leaving a model unserved."""
    out = [cluster]
    for flip_domains, flip_gpus in ((True, False), (False, True), (True, True)):
        nodes = []
        for node in cluster.nodes:
            doms = tuple(
                NvlinkDomain(tuple(reversed(d.gpus)) if flip_gpus else d.gpus) for d in node.domains
            )
            nodes.append(Node(node.name, tuple(reversed(doms)) if flip_domains else doms))
        out.append(Cluster(tuple(nodes)))
    return out


def moved_fraction(plan: Plan) -> float:
    """Replicas the plan starts (temporary ones excluded) over the target's replicas."""
    temporary = {g.id for g in plan.temporary}
    started = sum(
        len(s.replicas) for s in plan.steps if s.kind == "start" and s.group not in temporary
    )
    total = sum(len(g.replicas) for g in plan.target)
    return min(1.0, started / total) if total else 0.0


def predict_placed(
    pipes: Mapping[str, Pipeline],
    book: ProfileBook,
    result: SearchResult,
    placement: Placement,
    rates: Mapping[str, float],
) -> dict[str, float]:
    """The search's allocation predicted where ``placement`` puts it, at the observed
    ``rates``, as :func:`predict_running` predicts what runs: so that the proposal's latency
    and the running one's are read the same way (the search itself ranks on packed curves)."""
    placed = tuple(
        Placed(r.demand.model, r.node, r.gpus, r.share, r.demand.tp) for r in placement.replicas
    )
    busy = colocation.placed_weights(pipes, book, placed, rates)
    out: dict[str, float] = {}
    for w in result.workflows:
        alloc = {m.model: m.alloc for m in w.models}
        pipe = pipes.get(w.workflow)
        if pipe is None or not w.feasible or any(st.model not in alloc for st in pipe.stages):
            continue
        out[w.workflow] = alp.predict(
            pipe, book, alloc, rates.get(w.workflow, w.rate), busy=busy
        ).latency
    return out


def make_proposal(
    result: SearchResult,
    plan: Plan,
    current: Mapping[str, float],
    rates: Mapping[str, float],
    proposed: Mapping[str, float] | None = None,
) -> Proposal:
    """``proposed``: the allocation's latency where it was placed (:func:`predict_placed`);
    a workflow left out reads the search's own prediction."""
    where = proposed or {}
    outlook = tuple(
        Outlook(
            w.workflow,
            rates.get(w.workflow, w.rate),
            current.get(w.workflow, math.inf),
            where.get(w.workflow, w.latency) if w.feasible else math.inf,
        )
        for w in result.workflows
    )
    return Proposal(outlook, result.feasible, moved_fraction(plan), plan.empty, result.relaxed)


def _num(x: float) -> float | None:
    return x if math.isfinite(x) else None


def allocation_doc(result: SearchResult) -> dict[str, dict[str, dict[str, Any]]]:
    """workflow -> model -> {replicas, tp, share, gpus[, rest, rest_share]}, plus per workflow a ``_`` entry with
    the predicted latency, throughput and feasibility."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for w in result.workflows:
        models: dict[str, dict[str, Any]] = {m.model: dict(m.alloc.doc()) for m in w.models}
        models["_"] = {
            "rate": w.rate,
            "latency": _num(w.latency),
            "throughput": _num(w.throughput),
            "feasible": w.feasible,
            "bottleneck": w.bottleneck,
        }
        out[w.workflow] = models
    return out


def running_doc(running: Running) -> dict[str, dict[str, dict[str, Any]]]:
    return {w: {m: dict(a.doc()) for m, a in models.items()} for w, models in running.items()}


def placement_doc(placement: Placement) -> list[dict[str, Any]]:
    return [
        {
            "workflow": r.demand.workflow,
            "model": r.demand.model,
            "node": r.node,
            "gpus": list(r.gpus),
            "share": round(r.share, 4),
            "memory_gb": round(r.memory_bytes_per_gpu / GB, 2),
        }
        for r in placement.replicas
    ]


def result_running(result: SearchResult) -> Running:
    return {w.workflow: dict(w.allocation) for w in result.workflows}


def rates_of(stats: Mapping[str, WorkflowStats], names: Sequence[str]) -> dict[str, float]:
    return {w: stats[w].arrival_rate if w in stats else 0.0 for w in names}

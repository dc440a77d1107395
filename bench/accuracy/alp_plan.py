"""The ALP accuracy bench's plan: the cases it measures and the jobs it derives from them.

``bench.accuracy.alp_accuracy`` runs the plan; ``alp_picks``, ``alp_seeds`` and
``alp_point_check`` reuse its cases, trace and jobs. This module holds per workflow (beam
search, RAG, a fan-out across two different LLMs) the allocations evaluated and the request
counts of each phase (``_cases``) and the ``--quick`` variant (``quick_cases``); the
light-load trace that yields a workflow's statistics (``_trace``); the profile jobs, one per
(model, TP, share) its allocations use (``_profile_jobs``); an earlier run's profile points
(``_reused_points``, ``_profile_docs``); and the latency points' seeds (``latency_seed``).

Invariants: every run, quick or full, is seeded, so the same plan gives the same simulated
result; a profile job's key is (workflow, model, TP, share rounded to 6 places, measured alone
where the share packs copies), and a profile
point is written and read back under its workflow, never mixed across workflows (a model is
profiled under each workflow's own call mix); ``quick_cases`` keeps the workflows and their
order, and the first ``QUICK_ALLOCATIONS`` allocations of each; a full-run capacity window
holds at least ``CAP_MIN_REQUESTS`` requests.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import orjson

from bench.accuracy.alp_truth import LATENCY_SE, sim_allocation
from bench.accuracy.cases import Alloc, Case, calls_to_rows
from optimizer.model.alp import ModelAlloc
from optimizer.stats.figures import WorkflowStats
from optimizer.stats.reader import summarise_store
from shared.profile_points import ProfilePoint, packed_copies
from shared.store import SegmentWriter
from sim.des import WorkloadSpec, simulate
from sim.profiling import (
    FILL_LATENCIES,
    FOLLOW_Z,
    PROFILE_MAX_SCALE,
    PROFILE_REQUESTS,
    RECHECK_SCALE,
    REFINE,
    ProfileJob,
)
from sim.workflows import BeamParams, FanoutParams, RagParams

GPU = "a6000"
# Workflow requests a capacity window holds at least, quick runs too: near capacity the
# in-flight count swings by a few percent of a short window's arrivals, so a 5% shortfall
# test misjudges. Measured (simulated): RAG with 3 generator replicas was judged overloaded at
# 14.2, 15.7 and 17.2 req/s over 600-request windows but kept up at all three over 1500 (two
# seeds), and a backlogged run completed 18.6-19.0 req/s; beam 1x1 judged overloaded at 1.4
# req/s over 400 requests kept up at 1.5 over 1200.
CAP_MIN_REQUESTS = 1000
# --quick is a smoke run that has to finish in 3 minutes on two cores: shorter capacity windows
# (the misjudgement above, a few percent near capacity, is the price), a coarser bisection,
# two allocations and two rates per workflow, fewer profile points (one refinement, 10%).
# Its errors are indicative; the targets are judged on the full run. Profile points keep the
# full run's request floor: with 100 requests a point's window is mostly the engine filling
# its batch, and saturation read 40% low (llama-3.2-1b 43 calls/s against 76).
CAP_MIN_REQUESTS_QUICK = 400
QUICK_ALLOCATIONS = 2
QUICK_FRACTIONS = (0.4, 0.8)
FRACTIONS = (0.2, 0.4, 0.6, 0.8, 0.9)  # of predicted capacity, the full run's latency points
# a latency job's warm-up is at least this many light-load request latencies (the fill)
SETTLE_LATENCIES = 3.0


BEAM = ("llama-3.2-1b", "llama-3.1-8b-prm")
RAG = ("e5-base-v2", "bge-reranker-base", "llama-3-8b")
FAN = ("llama-3.2-1b", "llama-3-8b")


def _cases() -> list[Case]:
    # Fractional replicas come in pairs that fill a GPU (as a search that packs fractions
    # would deploy them); the quick run takes the first QUICK_ALLOCATIONS of each list.
    # Traces hold enough requests for n_m to a percent or two: a beam request's call count
    # varies with its iterations, and 150 requests read n = 39.09 calls per model against
    # 41.76 / 41.79 from 1,500 / 3,000 (simulated), which put every beam capacity 4-8% high
    # and its latencies at 80% load 10-15% low (``bench.accuracy.alp_replay`` on stop 17's full run
    # with the 3,000-request figures: beam throughput error mean 0.062 -> 0.036). Fan-out:
    # 2.523 from 300 requests, 2.491 from 3,000; RAG's n is exactly 1.
    return [
        Case(
            "beam",
            BeamParams(),
            GPU,
            trace_rate=0.05,
            trace_requests=1500,
            eval_requests=200,
            profile_calls=3000,
            capacity_requests=1200,
            allocations=[
                {BEAM[0]: (1, 1, 1.0), BEAM[1]: (1, 1, 1.0)},
                {BEAM[0]: (1, 1, 1.0), BEAM[1]: (2, 1, 1.0)},
                {BEAM[0]: (2, 1, 0.5), BEAM[1]: (1, 1, 1.0)},
                {BEAM[0]: (1, 1, 1.0), BEAM[1]: (1, 2, 1.0)},
                {BEAM[0]: (2, 1, 1.0), BEAM[1]: (1, 1, 1.0)},
                {BEAM[0]: (1, 1, 1.0), BEAM[1]: (3, 1, 1.0)},
                {BEAM[0]: (2, 1, 1.0), BEAM[1]: (2, 1, 1.0)},
                {BEAM[0]: (2, 1, 0.5), BEAM[1]: (2, 1, 1.0)},
                {BEAM[0]: (2, 1, 1.0), BEAM[1]: (1, 2, 1.0)},
                {BEAM[0]: (2, 1, 0.5), BEAM[1]: (2, 2, 1.0)},
            ],
        ),
        Case(
            "rag",
            RagParams(),
            GPU,
            trace_rate=0.5,
            trace_requests=300,
            eval_requests=300,
            profile_calls=2500,
            capacity_requests=1500,
            allocations=[
                {RAG[0]: (1, 1, 1.0), RAG[1]: (1, 1, 1.0), RAG[2]: (1, 1, 1.0)},
                {RAG[0]: (1, 1, 0.5), RAG[1]: (1, 1, 0.5), RAG[2]: (2, 1, 1.0)},
                {RAG[0]: (2, 1, 0.5), RAG[1]: (2, 1, 1.0), RAG[2]: (3, 1, 1.0)},
                {RAG[0]: (1, 1, 0.5), RAG[1]: (1, 1, 0.5), RAG[2]: (1, 2, 1.0)},
                {RAG[0]: (1, 1, 0.5), RAG[1]: (1, 1, 0.5), RAG[2]: (1, 1, 1.0)},
                {RAG[0]: (1, 1, 1.0), RAG[1]: (2, 1, 1.0), RAG[2]: (3, 1, 1.0)},
                {RAG[0]: (1, 1, 0.5), RAG[1]: (1, 1, 0.5), RAG[2]: (3, 1, 1.0)},
                {RAG[0]: (1, 1, 0.5), RAG[1]: (3, 1, 0.5), RAG[2]: (2, 2, 1.0)},
                {RAG[0]: (1, 1, 0.5), RAG[1]: (1, 1, 0.5), RAG[2]: (4, 1, 1.0)},
                {RAG[0]: (2, 1, 0.5), RAG[1]: (2, 1, 0.5), RAG[2]: (3, 1, 1.0)},
            ],
        ),
        Case(
            "fanout",
            FanoutParams(models=FAN),
            GPU,
            trace_rate=0.2,
            trace_requests=1500,
            eval_requests=200,
            profile_calls=2500,
            capacity_requests=1000,
            allocations=[
                {FAN[0]: (1, 1, 1.0), FAN[1]: (1, 1, 1.0)},
                {FAN[0]: (1, 1, 1.0), FAN[1]: (2, 1, 1.0)},
                {FAN[0]: (2, 1, 0.5), FAN[1]: (2, 1, 1.0)},
                {FAN[0]: (1, 1, 1.0), FAN[1]: (1, 2, 1.0)},
                {FAN[0]: (2, 1, 1.0), FAN[1]: (1, 1, 1.0)},
                {FAN[0]: (1, 1, 1.0), FAN[1]: (3, 1, 1.0)},
                {FAN[0]: (2, 1, 0.5), FAN[1]: (1, 2, 1.0)},
                {FAN[0]: (2, 1, 0.5), FAN[1]: (3, 1, 1.0)},
                {FAN[0]: (2, 1, 0.5), FAN[1]: (2, 2, 1.0)},
                {FAN[0]: (4, 1, 0.5), FAN[1]: (4, 1, 1.0)},
            ],
        ),
    ]


def quick_cases(cases: Sequence[Case]) -> list[Case]:
    """The ``--quick`` variant: the first ``QUICK_ALLOCATIONS`` allocations, shorter traces and
    latency runs, capacity windows of ``CAP_MIN_REQUESTS_QUICK`` requests (see there)."""
    return [
        replace(
            c,
            trace_requests=c.trace_requests // 2,
            eval_requests=c.eval_requests // 2,
            capacity_requests=CAP_MIN_REQUESTS_QUICK,
            allocations=c.allocations[:QUICK_ALLOCATIONS],
        )
        for c in cases
    ]


def _trace(case: Case) -> tuple[WorkflowStats, dict[str, Any]]:
    """Stats of a light-load run, and per model the calls/s one busy-second serves (a first
    guess of capacity that ignores batching, so it errs low)."""
    generous: Alloc = {m: (2, 1, 1.0) for m in case.allocations[0]}
    result = simulate(
        sim_allocation(case, generous),
        [WorkloadSpec(case.workflow, case.trace_rate, case.params)],  # type: ignore[arg-type]
        n_requests=case.trace_requests,
        record_calls=True,
        seed=11,
    )
    store = Path(tempfile.mkdtemp(prefix=f"scepsy-alp-{case.workflow}-"))
    try:
        writer = SegmentWriter(store, "sim")
        writer.write(calls_to_rows(result.calls))
        writer.close()
        stats = summarise_store(store)[case.workflow]
    finally:
        shutil.rmtree(store, ignore_errors=True)
    sim = result.workflows[case.workflow]
    busy: dict[str, float] = {}
    for r in result.replicas:
        busy[r.model] = busy.get(r.model, 0.0) + r.utilisation * result.simulated_s
    per_busy_s = {
        m: sum(1 for c in result.calls if c.call.model == m) / max(b, 1e-9) for m, b in busy.items()
    }
    return stats, {
        "requests": sim.completed,
        "latency_mean_s": sim.latency.mean,
        "calls_per_busy_s": per_busy_s,
    }


def _profile_jobs(
    case: Case, stats: WorkflowStats, trace: dict[str, Any], quick: bool
) -> list[ProfileJob]:
    keys = sorted(
        {
            (m, tp, share)
            for alloc in case.allocations
            for m, row in alloc.items()
            for _, tp, share in ModelAlloc(*row).groups
        }
    )
    target = case.profile_calls // 2 if quick else case.profile_calls
    return [
        ProfileJob(
            case,
            model,
            tp,
            share,
            n_per_request=stats.models[model].n,
            target_calls=target,
            refine=(0.6,) if quick else REFINE,
            precision=0.1 if quick else 0.04,
            start_rate=0.5 * share * trace["calls_per_busy_s"][model],
            min_requests=PROFILE_REQUESTS,
            latency_se=0.0 if quick else LATENCY_SE,
            parallel=stats.models[model].p_agg,
            # the quick run keeps one recheck of a marginal overload (3 minutes)
            follow_z=None if quick else FOLLOW_Z,
            max_scale=RECHECK_SCALE if quick else PROFILE_MAX_SCALE,
            fill_latencies=0.0 if quick else FILL_LATENCIES,
        )
        for model, tp, share in keys
    ]


# workflow, model, TP, share, and whether a share that packs copies was measured alone
ProfileJobKey = tuple[str, str, int, float, bool]


def _profile_key(
    workflow: str, model: str, tp: int, share: float, alone: bool = False
) -> ProfileJobKey:
    return workflow, model, tp, round(share, 6), alone and packed_copies(share) > 1


def _job_key(job: ProfileJob) -> ProfileJobKey:
    return _profile_key(job.case.workflow, job.model, job.tp, job.share, job.alone)


def _reused_points(path: Path | None) -> dict[ProfileJobKey, list[ProfilePoint]]:
    """Profile points of an earlier run (``--profiles-from``), by workflow and key (a model is
    profiled under each workflow's own call mix)."""
    if path is None:
        return {}
    out: dict[ProfileJobKey, list[ProfilePoint]] = {}
    for doc in orjson.loads(path.read_bytes())["profile_points"]:
        workflow = doc.pop("workflow")
        p = ProfilePoint(**doc)
        key = _profile_key(workflow, p.model, p.tp, p.share, p.colocation == "alone")
        out.setdefault(key, []).append(p)
    return out


def _profile_docs(
    jobs: Sequence[ProfileJob],
    profiled: Sequence[Sequence[ProfilePoint]],
) -> list[dict[str, Any]]:
    """Profile points as JSON documents, each with its workflow (``_reused_points`` reads
    them back)."""
    return [
        {"workflow": job.case.workflow, **asdict(p)}
        for job, pts in zip(jobs, profiled, strict=True)
        for p in pts
    ]


def latency_seed(alloc_index: int, fraction_index: int) -> int:
    """The seed of an allocation's latency point at ``FRACTIONS[fraction_index]`` (or the
    quick run's), so that a later bench can extend the same arrivals."""
    return 101 + 10 * alloc_index + fraction_index

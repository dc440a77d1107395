"""The picks bench's knowledge: what the optimizer knows of each workflow after tracing and
profiling, and after the daemon's reprofiler ran for the judged allocations.

Role: :mod:`bench.accuracy.alp_picks` judges allocations against the simulator; this module
builds what it predicts with. :func:`learn` traces every workflow and profiles the fitted
set's keys (``bench.accuracy.alp_accuracy``'s jobs, an earlier run's points reused by key);
:func:`reprofile` adds the keys :mod:`bench.accuracy.pick_reprofile` names for the judged
allocations; :class:`Learned` predicts an allocation where the simulator places it, each
model between its alone and packed curves (:mod:`optimizer.model.colocation`). Every figure
is *simulated*.

Invariants: a key an earlier run measured is reused, never profiled again; the profiling
checkpoint (``PROFILES_FILE``) holds every point measured so far, for ``--profiles-from``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson

from bench.accuracy import pick_reprofile
from bench.accuracy.alp_accuracy import (
    GPU,
    PROFILES_FILE,
    SETTLE_LATENCIES,
    _cases,
    _job_key,
    _profile_docs,
    _profile_jobs,
    _reused_points,
    _trace,
    quick_cases,
)
from bench.accuracy.alp_truth import sim_allocation
from bench.accuracy.cases import Alloc, Case
from optimizer.model import colocation
from optimizer.model.alp import ModelAlloc, Pipeline, Prediction, predict
from optimizer.model.colocation import Placed
from optimizer.model.curves import ProfileBook
from optimizer.stats.figures import WorkflowStats
from shared.profile_points import ProfilePoint, packed_copies
from sim.cluster import place
from sim.profiling import ProfileJob, run_profile


def progress(line: str) -> None:
    """One line of a long run's progress, on stderr."""
    print(line, file=sys.stderr, flush=True)


def _allocation(alloc: Alloc) -> dict[str, ModelAlloc]:
    return {m: ModelAlloc(*row) for m, row in alloc.items()}


def placed(case: Case, alloc: Alloc) -> tuple[Placed, ...]:
    """The replicas of ``alloc`` where the simulator places them (``sim.cluster.place``)."""
    return tuple(
        Placed(spec.model, "sim", gpus, spec.share, spec.tp)
        for spec, gpus in place(sim_allocation(case, alloc))
    )


@dataclass(frozen=True)
class Learned:
    """What the optimizer knows of one workflow after tracing and profiling."""

    case: Case  # the workflow's case (quick or full run lengths)
    pipe: Pipeline
    book: ProfileBook
    settle_s: float  # a few light-load request latencies: the pipeline's fill
    points: tuple[ProfilePoint, ...]  # what ``book`` is made of
    # the trace's statistics (``pipe`` is made of them) and figures (``alp_plan._trace``'s):
    # what new profiling jobs need; None where only predictions are made (``picks_replay``)
    stats: WorkflowStats | None = None
    trace: dict[str, Any] = field(default_factory=dict)

    def with_points(self, points: Sequence[ProfilePoint]) -> Learned:
        """The same knowledge with ``points`` added to the book (``pick_reprofile``)."""
        if not points:
            return self
        every = (*self.points, *points)
        return replace(self, book=ProfileBook(every), points=every)

    def predict(self, alloc: Alloc, rate: float | None) -> Prediction:
        """The ALP's prediction for ``alloc`` where the simulator places it, each model read
        between its alone and packed curves by its neighbours' load
        (:mod:`optimizer.model.colocation`) at ``rate`` (``None``: at the workflow's own
        capacity, for ``T_w``)."""
        allocation = _allocation(alloc)
        where = placed(self.case, alloc)
        busy = (
            colocation.capacity_weights(self.pipe, self.book, allocation, where)
            if rate is None
            else colocation.placed_weights(
                {self.pipe.workflow: self.pipe}, self.book, where, {self.pipe.workflow: rate}
            )
        )
        return predict(self.pipe, self.book, allocation, rate or 0.0, busy=busy)


def _run_profiles(
    pool: Executor, jobs: Sequence[ProfileJob], reused_from: Path | None, stage: str
) -> list[list[ProfilePoint]]:
    """Each job's profile points: an earlier run's where ``reused_from`` holds its key,
    else profiled in ``pool`` (longest first, so the pool does not end on one long job)."""
    reused = _reused_points(reused_from)
    done = {j: reused[_job_key(job)] for j, job in enumerate(jobs) if _job_key(job) in reused}
    order = sorted(
        (j for j in range(len(jobs)) if j not in done), key=lambda j: -jobs[j].target_calls
    )
    progress(f"{stage}; profiling {len(order)} keys ({len(done)} reused)")
    done.update(zip(order, pool.map(run_profile, [jobs[j] for j in order]), strict=True))
    return [list(done[j]) for j in range(len(jobs))]


def checkpoint(out: Path, quick: bool, docs: Sequence[dict[str, Any]]) -> None:
    """The profile points so far, for a later run's ``--profiles-from``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / PROFILES_FILE).write_bytes(
        orjson.dumps(
            {"label": "simulated", "quick": quick, "profile_points": list(docs)},
            option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY,
        )
    )


def reprofile(
    pool: Executor,
    learned: Mapping[str, Learned],
    judged: Mapping[str, Sequence[Alloc]],
    quick: bool,
    reused_from: Path | None,
) -> tuple[dict[str, Learned], list[ProfileJob], list[list[ProfilePoint]]]:
    """Per workflow, the knowledge after the daemon's reprofiler ran for the keys of its
    ``judged`` allocations (:mod:`bench.accuracy.pick_reprofile`), and the jobs and points."""
    jobs = [
        job
        for w, k in learned.items()
        if k.stats is not None
        for job in pick_reprofile.reprofile_jobs(
            k.case,
            k.stats,
            k.trace,
            k.book,
            judged.get(w, ()),
            GPU,
            quick,
        )
    ]
    profiled = _run_profiles(pool, jobs, reused_from, "reprofiling the uncovered keys")
    after = {
        w: k.with_points(
            [
                p
                for job, pts in zip(jobs, profiled, strict=True)
                if job.case.workflow == w
                for p in pts
            ]
        )
        for w, k in learned.items()
    }
    return after, jobs, profiled


def learn(
    pool: Executor, cases: Sequence[Case], quick: bool, reused_from: Path | None, out: Path
) -> tuple[dict[str, Learned], list[dict[str, Any]]]:
    """Trace and profile every workflow over the fitted set's keys (reusing the points of
    ``reused_from`` where it holds a key), write the profiling checkpoint to ``out``; the
    knowledge per workflow and the profile points as documents."""
    keyed = {c.workflow: c.allocations for c in _cases()}
    run = quick_cases(cases) if quick else list(cases)
    traced = list(pool.map(_trace, run))
    jobs = [
        job
        for case, (stats, info) in zip(run, traced, strict=True)
        for job in _profile_jobs(
            replace(case, allocations=keyed[case.workflow]), stats, info, quick
        )
    ]
    # a share that packs copies onto a GPU is measured alone too: the prediction reads each
    # replica between the two ends by how busy its placed neighbours are
    jobs += [replace(job, alone=True) for job in jobs if packed_copies(job.share) > 1]
    profiled = _run_profiles(pool, jobs, reused_from, "traced")
    docs = _profile_docs(jobs, profiled)
    checkpoint(out, quick, docs)
    learned = {}
    for case, (stats, info) in zip(run, traced, strict=True):
        points = tuple(
            p
            for job, pts in zip(jobs, profiled, strict=True)
            if job.case.workflow == case.workflow
            for p in pts
        )
        learned[case.workflow] = Learned(
            case,
            Pipeline.from_stats(stats),
            ProfileBook(points),
            SETTLE_LATENCIES * info["latency_mean_s"],
            points,
            stats,
            info,
        )
    return learned, docs

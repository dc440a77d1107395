"""The picks bench's second book: what the daemon profiles before it trusts a judged allocation.

Role: :mod:`bench.accuracy.alp_picks` profiles the fitted set's keys only, so a judged
allocation that places a model at a share where the book measured none of that model's
fractional shares is predicted with share exponents borrowed from other models. The daemon
does not keep trusting such a curve: its reprofiler (``optimizer.control.reprofile``, rule
``uncovered`` with ``reprofile.borrowed_shares``, on by default) profiles that key on a free
GPU, alone, as soon as a proposal places it. This module finds those keys for the judged
allocations (with the product's own rule, :func:`optimizer.control.reprofile.uncovered`, at the
shipped settings), builds the simulated profiling job for each (the fitted bench's job for the
model, at that share, alone: the daemon's profiling replica has its GPUs to itself), and
returns the keys' profile points. The bench judges each allocation on the book with them (the
product path after the reprofiler ran) and reports the fitted-set-only prediction beside it
(``borrowed``), on the same simulated truth. Where the simulator packs two or more copies of
a share onto one GPU, the rule's packed run follows (``reprofile.packed_shares``): the share
profiled packed, as many copies as fill the GPU, once it is measured alone.

Invariants: pure but for the profiling jobs the caller runs; the keys are the product rule's,
never a list of the bench's own; a key the fitted set measured is never profiled again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from bench.accuracy.alp_plan import _profile_jobs
from bench.accuracy.alp_truth import allocation_on
from bench.accuracy.cases import Alloc, Case
from optimizer.control.reprofile import WantedKey, packed_run, uncovered, with_copies
from optimizer.model.curves import ProfileBook
from optimizer.stats.figures import WorkflowStats
from shared.optimizer_settings import ReprofileSettings
from shared.profile_points import ProfileKey
from sim.cluster import place
from sim.profiling import ProfileJob

__all__ = ["reprofile_jobs", "wanted"]


def wanted(allocations: Iterable[Alloc], gpu_type: str) -> list[WantedKey]:
    """The distinct (model, GPU type, TP, share) keys ``allocations`` place replicas at, each
    with the most copies of it the simulator's placement (``sim.cluster.place``, where the
    bench predicts and simulates an allocation) puts on one GPU."""
    return list(
        with_copies(
            (WantedKey(spec.model, gpu_type, spec.tp, round(spec.share, 6)), (n, gpus))
            for n, alloc in enumerate(allocations)
            for spec, gpus in place(allocation_on(alloc, gpu_type))
        )
    )


def reprofile_jobs(
    case: Case,
    stats: WorkflowStats,
    trace: dict[str, Any],
    book: ProfileBook,
    allocations: Sequence[Alloc],
    gpu_type: str,
    quick: bool,
) -> list[ProfileJob]:
    """The profiling jobs the daemon's reprofiler would start for ``allocations`` of ``case``
    given ``book``: one per key the shipped ``uncovered`` rule names, each the fitted bench's
    job for that model and TP at the key's share, measured alone; then, for a share the
    placement packs copies of, the packed run the rule names once the share is measured alone
    (the daemon starts it on a later pass), with as many copies as fill the GPU."""
    settings = ReprofileSettings()
    keys = wanted(allocations, gpu_type)
    alone = [k for k in keys if uncovered(book.profiles, replace(k, copies=1), settings)]
    after = [*book.profiles, *(ProfileKey(k.model, "", k.gpu_type, k.tp, k.share) for k in alone)]
    packed = [
        k
        for k in keys
        if packed_run(k, settings) > 1 and uncovered(after, k, settings, book.packed)
    ]
    jobs = [replace(job, alone=True) for job in _jobs(case, stats, trace, alone, quick)]
    return jobs + [replace(job, alone=False) for job in _jobs(case, stats, trace, packed, quick)]


def _jobs(
    case: Case, stats: WorkflowStats, trace: dict[str, Any], keys: Sequence[WantedKey], quick: bool
) -> list[ProfileJob]:
    """The fitted bench's profiling job for each key's model, TP and share."""
    if not keys:
        return []
    one = replace(case, allocations=[{k.model: (1, k.tp, k.share)} for k in keys])
    return _profile_jobs(one, stats, trace, quick)

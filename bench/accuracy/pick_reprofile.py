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
(``borrowed``), on the same simulated truth.

Invariants: pure but for the profiling jobs the caller runs; the keys are the product rule's,
never a list of the bench's own; a key the fitted set measured is never profiled again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from bench.accuracy.alp_plan import _profile_jobs
from bench.accuracy.cases import Alloc, Case
from optimizer.control.reprofile import WantedKey, uncovered
from optimizer.model.alp import ModelAlloc
from optimizer.model.curves import ProfileBook
from optimizer.stats.figures import WorkflowStats
from shared.optimizer_settings import ReprofileSettings
from sim.profiling import ProfileJob

__all__ = ["reprofile_jobs", "wanted"]


def wanted(allocations: Iterable[Alloc], gpu_type: str) -> list[WantedKey]:
    """The distinct (model, GPU type, TP, share) keys ``allocations`` place replicas at."""
    keys = {
        WantedKey(model, gpu_type, tp, round(share, 6))
        for alloc in allocations
        for model, row in alloc.items()
        for _, tp, share in ModelAlloc(*row).groups
    }
    return sorted(keys, key=lambda k: (k.model, k.tp, k.share))


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
    job for that model and TP at the key's share, measured alone."""
    settings = ReprofileSettings()
    keys = [k for k in wanted(allocations, gpu_type) if uncovered(book.profiles, k, settings)]
    if not keys:
        return []
    one = replace(case, allocations=[{k.model: (1, k.tp, k.share)} for k in keys])
    return [replace(job, alone=True) for job in _profile_jobs(one, stats, trace, quick)]

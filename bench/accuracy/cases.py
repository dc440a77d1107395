"""The accuracy bench's workflows (:class:`Case`) and simulated calls as call-record rows.

Role: a ``Case`` is one workflow the accuracy and evaluation benches trace, profile (by
simulation, :mod:`sim.profiling`: a ``Case`` is a ``sim.profiling.ProfiledWorkflow``) and
evaluate; :func:`calls_to_rows` turns a simulated run's calls into the rows the optimizer's
statistics read from a trace store.

Invariants: simulated seconds become microseconds after ``BASE_US``; every row is from proxy
``sim`` with call id ``sim-<n>``, so it is never mistaken for a measured one; every figure is
*simulated*.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.records import CallRecord
from sim.des import SimCall
from sim.workflows import WorkflowParams

BASE_US = 1_700_000_000_000_000  # simulated t=0 as a wall-clock time


# model -> (replicas, tp, share[, rest replicas, rest share]): optimizer.model.alp.ModelAlloc's
# fields, a rest group only where the allocation mixes shares
AllocRow = tuple[int, int, float] | tuple[int, int, float, int, float]
Alloc = dict[str, AllocRow]


@dataclass(frozen=True)
class Case:
    """One workflow of the accuracy bench."""

    workflow: str  # "beam" | "rag" | "fanout"
    params: WorkflowParams
    gpu: str
    trace_rate: float
    trace_requests: int
    eval_requests: int
    profile_calls: int = 1500  # calls of the profiled model per profile point
    capacity_requests: int = 400  # workflow requests per run when bracketing max throughput
    allocations: list[Alloc] = field(default_factory=list)


def calls_to_rows(calls: Sequence[SimCall]) -> list[tuple[Any, ...]]:
    """Simulated calls as call-record rows (simulated seconds become microseconds)."""
    rows = []
    for c in calls:
        inputs = c.call.inputs
        rows.append(
            CallRecord(
                call_id=f"sim-{c.call_id}",
                proxy_id="sim",
                workflow=c.workflow,
                request_id=c.request_id,
                model=c.call.model,
                endpoint=c.call.endpoint,
                status=200,
                t_start=BASE_US + round(c.t_start * 1e6),
                t_first_byte=BASE_US + round(c.t_first * 1e6) if c.t_first >= 0 else None,
                t_end=BASE_US + round(c.t_end * 1e6),
                prompt_tokens=sum(len(p) for p in inputs),
                completion_tokens=c.call.output_tokens * len(inputs),
                cached_tokens=c.cached_tokens,
            ).row()
        )
    return rows

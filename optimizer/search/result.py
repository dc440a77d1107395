"""What the allocation search returns: per workflow its allocation and predictions, and the
search's own figures (frozen values, no logic beyond lookups).

Role: the result types of :mod:`optimizer.search.solve`, in a module of their own so that the
search's machinery and its callers (the control step, the CLI, the benchmarks) share them
without the machinery; :mod:`optimizer.search.solve` re-exports them.

Invariants: every figure is a point estimate of :func:`optimizer.model.alp.predict` except
``latency_high`` and ``capacity_low``, the slow end of its uncertainty the search ranked by;
an infeasible workflow's figures are taken at the rate it serves (``served_rate``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from optimizer.model.alp import ModelAlloc

__all__ = ["ModelChoice", "SearchResult", "SearchStats", "WorkflowAllocation"]


@dataclass(frozen=True)
class SearchStats:
    """The search's own figures. Candidates are complete layouts x configurations: generated
    (the unpruned space), pruned (by the rules, or dominated inside their LLM's cell), evaluated
    (compared by the dynamic programme, one best configuration per LLM each)."""

    candidates_generated: int
    candidates_pruned: int
    candidates_evaluated: int
    configs_predicted: int  # per-LLM configurations the ALP predicted
    seconds: float


@dataclass(frozen=True)
class ModelChoice:
    model: str
    alloc: ModelAlloc
    units: int  # GPU units (granularity ths of a GPU) the model's run holds on the line
    offset: int  # where its run starts inside its first GPU (units), from the packing
    start: int  # where its run starts on the cluster's GPU line (units)
    contribution: float  # its latency contribution L_wm at the served rate (s)
    capacity: float  # workflow requests/s it sustains


@dataclass(frozen=True)
class WorkflowAllocation:
    workflow: str
    rate: float  # the target (requests/s)
    served_rate: float  # the target when feasible, else the largest rate served with headroom
    feasible: bool
    latency: float  # predicted at served_rate (s)
    throughput: float  # T_w
    bottleneck: str
    utility: float  # welfare utility: best latency alone / latency here; fraction - 1 if infeasible
    start_unit: int
    budget_units: int
    models: tuple[ModelChoice, ...]  # pipeline stage order; empty when nothing can be served
    stats: SearchStats
    latency_high: float = np.inf  # predicted at served_rate at the slow end (what ranked it)
    capacity_low: float = 0.0  # T_w at the slow end (what had to cover the goal)

    @property
    def allocation(self) -> dict[str, ModelAlloc]:
        return {m.model: m.alloc for m in self.models}


@dataclass(frozen=True)
class SearchResult:
    workflows: tuple[WorkflowAllocation, ...]
    welfare: str
    objective: float  # the welfare policy's value of the split
    granularity: int
    headroom: float
    stats: SearchStats  # totals over workflows, seconds for the whole search
    relaxed: str = ""  # how the problem was relaxed to find it ("": as posed; see relaxations)

    @property
    def feasible(self) -> bool:
        return all(w.feasible for w in self.workflows)

    def workflow(self, name: str) -> WorkflowAllocation:
        for w in self.workflows:
            if w.workflow == name:
                return w
        raise KeyError(name)

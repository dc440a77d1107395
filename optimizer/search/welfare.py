"""Welfare policies: how the search splits the cluster's GPU units between workflows.

Role: the outer level of the search (paper §5, "Scheduling multiple workflows"). Each workflow
comes with a utility table ``u[o, b]``: its utility when its units start at line unit ``o``
(modulo the line's cycle, :class:`optimizer.search.space.LineLayout`) and it may use ``b``
units (non-decreasing in ``b``). A policy picks budgets ``b_k``, laid out
one after another from unit 0 with ``Σ b_k <= total``, maximising its aggregate:

- ``egalitarian`` (the paper's default): the worst workflow's utility; among the splits reaching
  it, the one with the largest sum (so spare units are not left idle for nothing);
- ``social``: the sum of utilities.

Invariants: exact (one :func:`optimizer.search.space.chain` per pass); deterministic ties (the
larger budget wins, so units no utility needs still go to someone: a workflow's allocation is
the best within its budget, and an infeasible workflow's utility, the fraction of its rate it
serves, does not see the latency that more units still buy); pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from optimizer.search.space import MAX_MIN, MAX_SUM, FloatArray, SearchError, backtrack, chain

__all__ = ["POLICIES", "Egalitarian", "Social", "Welfare", "policy"]

TIE_TOL = 1e-12


class Welfare(Protocol):
    @property
    def name(self) -> str: ...

    def split(
        self, utilities: Sequence[FloatArray], total: int, cycle: int
    ) -> tuple[tuple[int, ...], float]:
        """Budgets per workflow (units) and the aggregate utility they reach."""
        ...


def _max_sum(
    utilities: Sequence[FloatArray], total: int, cycle: int
) -> tuple[tuple[int, ...], float]:
    # Ties go to larger budgets: a workflow's allocation is the best within its budget, so a
    # unit that changes no utility is better used than left idle.
    best, choices = chain(utilities, 0, total, cycle, MAX_SUM, min_units=0, prefer_more=True)
    used = int(total - np.argmax(best[::-1]))
    if not np.isfinite(best[used]):
        raise SearchError("no split of the cluster gives every workflow a utility")
    return tuple(backtrack(choices, used)), float(best[used])


@dataclass(frozen=True)
class Social:
    name: str = "social"

    def split(
        self, utilities: Sequence[FloatArray], total: int, cycle: int
    ) -> tuple[tuple[int, ...], float]:
        return _max_sum(utilities, total, cycle)


@dataclass(frozen=True)
class Egalitarian:
    name: str = "egalitarian"

    def split(
        self, utilities: Sequence[FloatArray], total: int, cycle: int
    ) -> tuple[tuple[int, ...], float]:
        best, _ = chain(utilities, 0, total, cycle, MAX_MIN, min_units=0)
        worst = float(best.max())
        # Second pass: the largest sum among splits that keep every utility at the maximin.
        floor = worst - TIE_TOL * max(1.0, abs(worst))
        kept = [np.where(u >= floor, u, -np.inf) for u in utilities]
        budgets, _ = _max_sum(kept, total, cycle)
        return budgets, worst


POLICIES: dict[str, Welfare] = {"egalitarian": Egalitarian(), "social": Social()}


def policy(name: str) -> Welfare:
    try:
        return POLICIES[name]
    except KeyError:
        raise SearchError(
            f"unknown welfare policy {name!r} (known: {', '.join(POLICIES)})"
        ) from None

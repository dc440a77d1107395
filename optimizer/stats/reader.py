"""Workflow statistics of a trace store: the DuckDB scan, then the figures.

Role: the effectful edge of the statistics stage; :func:`summarise` runs
:mod:`optimizer.stats.scan` over a relation of call records and hands the arrays to
:func:`optimizer.stats.figures.assemble`; :func:`summarise_store` opens the store.

Invariants: a segment found unreadable mid-way is skipped and the summary run again
(``StoreReader.read``); the connection is closed whatever happens.
"""

from __future__ import annotations

from pathlib import Path

import duckdb

from optimizer.stats.figures import Window, WorkflowStats, assemble
from optimizer.stats.scan import UNION_CALLS_CAP, scan
from optimizer.stats.scanned import Bounds
from shared.store import StoreReader


def summarise(
    con: duckdb.DuckDBPyConnection,
    calls: duckdb.DuckDBPyRelation,
    window: Window = Window(),
    union_cap: int | None = UNION_CALLS_CAP,
) -> dict[str, WorkflowStats]:
    """Statistics per workflow over ``window`` from ``calls`` (a relation on ``con``). The
    per-request figures come from a hash sample of requests holding about ``union_cap`` calls
    at most (``None``: all of them; ``WorkflowStats.union_requests`` says how many)."""
    hi = None if window.t_to_us is None else window.t_to_us - window.settle_us
    got = scan(con, calls, Bounds(lo=window.t_from_us, t_to=window.t_to_us, hi=hi), union_cap)
    return assemble(got, window, hi)


def summarise_store(
    store: str | Path,
    window: Window = Window(),
    lookback_us: int = 600 * 1_000_000,
    union_cap: int | None = UNION_CALLS_CAP,
) -> dict[str, WorkflowStats]:
    """Read the store and summarise. Calls up to ``lookback_us`` before the window are read so
    that a request straddling its start is recognised as having arrived earlier."""
    reader = StoreReader(store)
    try:
        t_from = None if window.t_from_us is None else window.t_from_us - lookback_us
        # read(): a segment found unreadable mid-way is skipped and the summary run again.
        return reader.read(
            lambda calls: summarise(reader.con, calls, window, union_cap), t_from, window.t_to_us
        )
    finally:
        reader.close()

"""The daemon's decision log: table ``decisions`` of ``<store>/optimizer.duckdb``.

Role: every decision of the daemon (taken or not) is one row with its reasons, the changes that
prompted it, the figures it was judged on (gain, request-seconds saved and lost), the proposed
allocation and predictions, and what came of it (``outcome``: ok, failed: ..., not applied).
``scepsy demo`` and operators read it back with :func:`load_decisions`.

Invariants: the database is opened read-write only for the one insert, and read-only to read
(the way :mod:`optimizer.model.curves` shares the file with the profiler and the CLI); structured
columns are JSON text so that the table reads in any DuckDB client; times are epoch seconds.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from optimizer.store.profiles import _connect, db_path

__all__ = ["DecisionRow", "load_decisions", "save_decision", "save_decision_async"]

_CREATE = """
CREATE TABLE IF NOT EXISTS decisions (
    t DOUBLE, kind VARCHAR, taken BOOLEAN, outcome VARCHAR, reasons VARCHAR, changes VARCHAR,
    gain DOUBLE, benefit_s DOUBLE, cost_s DOUBLE, search_s DOUBLE, rollout_s DOUBLE,
    rates VARCHAR, observed VARCHAR, predicted VARCHAR, allocation VARCHAR, plan VARCHAR)
"""
_JSON = ("reasons", "changes", "rates", "observed", "predicted", "allocation", "plan")


@dataclass(frozen=True)
class DecisionRow:
    """One row. ``allocation``: workflow -> model -> {replicas, tp, share}; ``predicted``:
    workflow -> {current, proposed} latency (s); ``plan``: the rendered plan's lines."""

    t: float
    kind: str
    taken: bool
    outcome: str | None
    reasons: tuple[str, ...]
    changes: tuple[dict[str, Any], ...] = ()
    gain: float | None = None
    benefit_s: float | None = None
    cost_s: float | None = None
    search_s: float | None = None
    rollout_s: float | None = None
    rates: dict[str, float] | None = None
    observed: dict[str, float] | None = None
    predicted: dict[str, dict[str, float | None]] | None = None
    allocation: dict[str, dict[str, dict[str, float]]] | None = None
    plan: tuple[str, ...] = ()


_FIELDS = tuple(DecisionRow.__dataclass_fields__)


def _json(value: Any) -> str:
    # nan/inf are not JSON: they become null (a latency nobody can serve reads as "none").
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY).decode()


def save_decision(store: str | Path, row: DecisionRow) -> None:
    path = db_path(store)
    path.parent.mkdir(parents=True, exist_ok=True)
    values = [_json(getattr(row, f)) if f in _JSON else getattr(row, f) for f in _FIELDS]
    con = _connect(path, read_only=False)
    try:
        con.execute(_CREATE)
        con.execute(
            f"INSERT INTO decisions ({', '.join(_FIELDS)}) VALUES "
            f"({', '.join('?' for _ in _FIELDS)})",
            values,
        )
    finally:
        con.close()


async def save_decision_async(store: str | Path, row: DecisionRow) -> None:
    await asyncio.to_thread(save_decision, store, row)


def load_decisions(store: str | Path) -> list[dict[str, Any]]:
    """Every row, oldest first, with the JSON columns parsed."""
    path = db_path(store)
    if not path.exists():
        return []
    con = _connect(path, read_only=True)
    try:
        found = con.execute(
            "SELECT count(*) FROM duckdb_tables() WHERE table_name = 'decisions'"
        ).fetchall()
        if found[0][0] == 0:
            return []
        rows = con.execute(f"SELECT {', '.join(_FIELDS)} FROM decisions ORDER BY t").fetchall()
    finally:
        con.close()
    return [
        {
            f: orjson.loads(v) if f in _JSON and v is not None else v
            for f, v in zip(_FIELDS, row, strict=True)
        }
        for row in rows
    ]

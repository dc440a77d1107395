"""The optimizer's profile table: profile points in ``<store>/optimizer.duckdb``.

Role: the only code that reads or writes table ``profile``.

Invariants:
- a re-run replaces exactly the keys it measured (delete + insert in one transaction);
- the database is opened only for the duration of one call, read-write only to write, so the
  daemon, the CLI and a profiler can take turns; async callers use the ``*_async`` wrappers,
  which run in a thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

import duckdb

from shared.profile_points import ProfilePoint

DB_NAME = "optimizer.duckdb"
_COLUMNS = tuple(f.name for f in fields(ProfilePoint))
_SQL_TYPES = {
    "model": "VARCHAR",
    "engine": "VARCHAR",
    "gpu_type": "VARCHAR",
    "tp": "INTEGER",
    "n_calls": "BIGINT",
}
_CREATE = (
    "CREATE TABLE IF NOT EXISTS profile ("
    + ", ".join(f"{c} {_SQL_TYPES.get(c, 'DOUBLE')}" for c in _COLUMNS)
    + ")"
)


def db_path(store: str | Path) -> Path:
    return Path(store) / DB_NAME


def _connect(path: Path, read_only: bool, wait_s: float = 5.0) -> duckdb.DuckDBPyConnection:
    """Open, waiting a little while another process holds the file (each holds it briefly)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return duckdb.connect(str(path), read_only=read_only)
        except duckdb.IOException:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


def save_points(store: str | Path, points: Sequence[ProfilePoint]) -> int:
    """Store ``points``, replacing every earlier point of the keys they cover. Returns rows."""
    if not points:
        return 0
    path = db_path(store)
    path.parent.mkdir(parents=True, exist_ok=True)
    con = _connect(path, read_only=False)
    try:
        con.execute(_CREATE)
        con.execute("BEGIN TRANSACTION")
        for key in sorted({p.key for p in points}):
            con.execute(
                "DELETE FROM profile WHERE model = ? AND engine = ? AND gpu_type = ? AND tp = ? "
                "AND share = ?",
                [key.model, key.engine, key.gpu_type, key.tp, key.share],
            )
        con.executemany(
            f"INSERT INTO profile ({', '.join(_COLUMNS)}) VALUES "
            f"({', '.join('?' for _ in _COLUMNS)})",
            [[getattr(p, c) for c in _COLUMNS] for p in points],
        )
        con.execute("COMMIT")
    finally:
        con.close()
    return len(points)


def load_points(store: str | Path, model: str | None = None) -> list[ProfilePoint]:
    """Every stored point (of ``model``), ordered by key then offered rate."""
    path = db_path(store)
    if not path.exists():
        return []
    con = _connect(path, read_only=True)
    try:
        tables = con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'profile'")
        if tables.fetchall()[0][0] == 0:
            return []
        where, params = ("WHERE model = ?", [model]) if model is not None else ("", [])
        rows = con.execute(
            f"SELECT {', '.join(_COLUMNS)} FROM profile {where} "
            "ORDER BY model, engine, gpu_type, tp, share, offered_rate",
            params,
        ).fetchall()
    finally:
        con.close()
    return [ProfilePoint(*row) for row in rows]


async def save_points_async(store: str | Path, points: Sequence[ProfilePoint]) -> int:
    return await asyncio.to_thread(save_points, store, points)


async def load_points_async(store: str | Path, model: str | None = None) -> list[ProfilePoint]:
    return await asyncio.to_thread(load_points, store, model)

"""The optimizer's profile table: profile points in ``<store>/optimizer.duckdb``.

Role: the only code that reads or writes table ``profile``.

Invariants:
- saving replay points replaces exactly the replay points of the keys measured in the same
  arrangement (delete + insert in one transaction): a re-run of the profiler replaces its own
  points and never a live one; packed points (copies side by side) replace only packed ones,
  alone (or unrecorded) points only those;
- saving live points never deletes a replay point; per key it keeps the newest ``LIVE_KEEP``
  live points no older than ``LIVE_MAX_AGE_S`` before the key's newest (by ``observed_at``),
  so a replica's recent behaviour corrects its curve and an old one ages out;
- a table written before points had provenance (no ``source``/``observed_at``/``colocation``/
  ``completion_tokens`` columns) is migrated on the next write (columns added with their
  defaults: replay, 0, "", -1) and read as replay points of unrecorded colocation and tokens
  until then;
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

from shared.profile_points import ProfileKey, ProfilePoint

DB_NAME = "optimizer.duckdb"
LIVE_KEEP = 5  # live points kept per key: the last few windows a replica of the key served
LIVE_MAX_AGE_S = 3600.0  # ... none older than this before the key's newest live point
_COLUMNS = tuple(f.name for f in fields(ProfilePoint))
_SQL_TYPES = {
    "model": "VARCHAR",
    "engine": "VARCHAR",
    "gpu_type": "VARCHAR",
    "tp": "INTEGER",
    "n_calls": "BIGINT",
    "source": "VARCHAR",
    "colocation": "VARCHAR",
}
# of columns added after the first
_DEFAULTS = {
    "source": "'replay'",
    "observed_at": "0.0::DOUBLE",
    "colocation": "''",
    "completion_tokens": "-1.0::DOUBLE",
}
_CREATE = (
    "CREATE TABLE IF NOT EXISTS profile ("
    + ", ".join(f"{c} {_SQL_TYPES.get(c, 'DOUBLE')}" for c in _COLUMNS)
    + ")"
)
_MIGRATE = tuple(
    f"ALTER TABLE profile ADD COLUMN IF NOT EXISTS {c} {_SQL_TYPES.get(c, 'DOUBLE')} "
    f"DEFAULT {default}"
    for c, default in _DEFAULTS.items()
)
_KEY_WHERE = "model = ? AND engine = ? AND gpu_type = ? AND tp = ? AND share = ?"


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
    """Store ``points``: replay points replace every earlier replay point of the keys they
    cover; live points join the key's live points, the oldest beyond the bounds dropped
    (``LIVE_KEEP``, ``LIVE_MAX_AGE_S``). Returns the rows inserted."""
    if not points:
        return 0
    path = db_path(store)
    path.parent.mkdir(parents=True, exist_ok=True)
    con = _connect(path, read_only=False)
    try:
        con.execute(_CREATE)
        for statement in _MIGRATE:
            con.execute(statement)
        con.execute("BEGIN TRANSACTION")
        replay_keys = sorted(
            {(p.key, p.colocation == "packed") for p in points if p.source != "live"}
        )
        for key, packed in replay_keys:
            # a packed measurement and an alone (or unrecorded) one are two ends of one key
            same = "colocation = 'packed'" if packed else "colocation <> 'packed'"
            con.execute(
                f"DELETE FROM profile WHERE {_KEY_WHERE} AND source <> 'live' AND {same}",
                _key_params(key),
            )
        con.executemany(
            f"INSERT INTO profile ({', '.join(_COLUMNS)}) VALUES "
            f"({', '.join('?' for _ in _COLUMNS)})",
            [[getattr(p, c) for c in _COLUMNS] for p in points],
        )
        for key in sorted({p.key for p in points if p.source == "live"}):
            _prune_live(con, key)
        con.execute("COMMIT")
    finally:
        con.close()
    return len(points)


def _key_params(key: ProfileKey) -> list[object]:
    return [key.model, key.engine, key.gpu_type, key.tp, key.share]


def _prune_live(con: duckdb.DuckDBPyConnection, key: ProfileKey) -> None:
    """Drop the key's live points beyond the newest ``LIVE_KEEP`` or older than
    ``LIVE_MAX_AGE_S`` before its newest."""
    con.execute(
        f"""
        DELETE FROM profile WHERE {_KEY_WHERE} AND source = 'live' AND observed_at NOT IN (
            SELECT observed_at FROM profile WHERE {_KEY_WHERE} AND source = 'live'
            ORDER BY observed_at DESC LIMIT {LIVE_KEEP})
        """,
        _key_params(key) * 2,
    )
    con.execute(
        f"""
        DELETE FROM profile WHERE {_KEY_WHERE} AND source = 'live' AND observed_at < (
            SELECT max(observed_at) FROM profile WHERE {_KEY_WHERE} AND source = 'live'
        ) - {LIVE_MAX_AGE_S}
        """,
        _key_params(key) * 2,
    )


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
        have = {str(r[1]) for r in con.execute("PRAGMA table_info('profile')").fetchall()}
        # a table not yet migrated reads its missing columns' defaults (read-only: no ALTER)
        cols = [c if c in have else f"{_DEFAULTS[c]} AS {c}" for c in _COLUMNS]
        rows = con.execute(
            f"SELECT {', '.join(cols)} FROM profile {where} "
            "ORDER BY model, engine, gpu_type, tp, share, source, offered_rate, observed_at",
            params,
        ).fetchall()
    finally:
        con.close()
    return [ProfilePoint(*row) for row in rows]


async def save_points_async(store: str | Path, points: Sequence[ProfilePoint]) -> int:
    return await asyncio.to_thread(save_points, store, points)


async def load_points_async(store: str | Path, model: str | None = None) -> list[ProfilePoint]:
    return await asyncio.to_thread(load_points, store, model)

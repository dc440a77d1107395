"""The trace store layout: the one writer and the one reader of call segments (DESIGN §3.3).

Layout: ``<store>/calls/proxy=<proxy_id>/seg-<t_min_us>-<seq>.parquet``, each file a closed,
immutable Parquet segment written by one proxy. ``<store>/optimizer.duckdb`` belongs to the
optimizer and is not touched here.

Invariants:
- a segment appears under its final name only when complete: it is written through an
  in-memory DuckDB connection to a dot-prefixed ``.tmp`` name in the same folder, fsynced, then
  atomically renamed; a writer killed mid-write leaves at most a ``.tmp`` file, which readers
  never match and the next writer of that proxy removes;
- every segment has exactly the columns of ``shared.records.COLUMNS`` with their SQL types,
  even when every value of a column is null;
- the reader never opens a file for writing, so any number of readers can run beside writers.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import duckdb
import numpy as np

from shared.records import COLUMN_NAMES, COLUMNS

# Segments are read far more often than written (the optimizer re-reads each window every
# period): LZ4 decompresses several times faster than zstd, the one cost that dominated a
# statistics pass (16% of its instructions on 1M calls), for files about 1.5x larger; it also
# costs the proxy's recorder less to write. Readers take any codec, older zstd segments too.
SEGMENT_CODEC = "lz4_raw"

CALLS_DIR = "calls"
_SAFE_ID = re.compile(r"[^A-Za-z0-9_.-]")
_SELECT_TYPED = ", ".join(f"CAST({name} AS {sql}) AS {name}" for name, sql in COLUMNS)
_EMPTY_SELECT = "SELECT " + ", ".join(f"CAST(NULL AS {sql}) AS {name}" for name, sql in COLUMNS)


def segment_dir(store: str | Path, proxy_id: str) -> Path:
    return Path(store) / CALLS_DIR / f"proxy={_SAFE_ID.sub('_', proxy_id)}"


class SegmentWriter:
    """Writes batches of record rows as Parquet segments for one proxy. Not thread-safe:
    one writer task owns it (the recorder calls it from one worker thread at a time)."""

    def __init__(self, store: str | Path, proxy_id: str) -> None:
        self.directory = segment_dir(store, proxy_id)
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob(".*.tmp"):
            stale.unlink(missing_ok=True)  # left by a writer that was killed mid-write
        self._con = duckdb.connect(":memory:")
        self._seq = itertools.count()
        self._pid = os.getpid()

    def write(self, rows: Sequence[Sequence[Any]]) -> Path | None:
        """Write ``rows`` (tuples in ``COLUMN_NAMES`` order) as one segment; return its path."""
        if not rows:
            return None
        columns = list(zip(*rows, strict=True))
        batch = {
            name: np.array(col, dtype=object)
            for name, col in zip(COLUMN_NAMES, columns, strict=True)
        }
        t_min = min((r[COLUMN_NAMES.index("t_start")] or 0) for r in rows)
        name = f"seg-{t_min:016d}-{self._pid}-{next(self._seq):06d}.parquet"
        final = self.directory / name
        tmp = self.directory / f".{name}.tmp"
        self._con.register("batch", batch)
        try:
            self._con.execute(
                f"COPY (SELECT {_SELECT_TYPED} FROM batch) TO '{tmp}' "
                f"(FORMAT parquet, COMPRESSION {SEGMENT_CODEC})"
            )
        finally:
            self._con.unregister("batch")
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        return final

    def close(self) -> None:
        self._con.close()


class StoreReader:
    """Reads call records across every proxy's segments as DuckDB relations."""

    def __init__(self, store: str | Path, con: duckdb.DuckDBPyConnection | None = None) -> None:
        self.store = str(store)
        self.con = con or duckdb.connect(":memory:")

    @property
    def glob(self) -> str:
        return f"{self.store.rstrip('/')}/{CALLS_DIR}/*/*.parquet"

    def segments(self) -> list[Path]:
        return sorted(Path(self.store, CALLS_DIR).glob("*/*.parquet"))

    def calls(
        self, t_from_us: int | None = None, t_to_us: int | None = None
    ) -> duckdb.DuckDBPyRelation:
        """Records whose ``t_start`` lies in ``[t_from_us, t_to_us)``, as a lazy relation."""
        if self.store.startswith(("s3://", "gs://", "http://", "https://")) or self.segments():
            source = f"SELECT {_SELECT_TYPED} FROM read_parquet('{self.glob}', union_by_name=true)"
        else:
            source = _EMPTY_SELECT + " WHERE false"
        where = []
        if t_from_us is not None:
            where.append(f"t_start >= {int(t_from_us)}")
        if t_to_us is not None:
            where.append(f"t_start < {int(t_to_us)}")
        sql = source if not where else f"SELECT * FROM ({source}) WHERE {' AND '.join(where)}"
        return self.con.sql(sql)

    def close(self) -> None:
        self.con.close()

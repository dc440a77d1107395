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
- the reader never opens a file for writing, so any number of readers can run beside writers;
- one row cannot cost its neighbours: rows pass :func:`shared.records.storable` before a write,
  and a batch DuckDB still refuses is split until the rows it refuses are found; those go to
  ``<store>/quarantine/proxy=<id>/`` as JSON lines (with the reason) and the rest are written.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import numpy as np

from shared.records import COLUMN_NAMES, COLUMNS, now_us, storable

# Segments are read far more often than written (the optimizer re-reads each window every
# period): LZ4 decompresses several times faster than zstd, the one cost that dominated a
# statistics pass (16% of its instructions on 1M calls), for files about 1.5x larger; it also
# costs the proxy's recorder less to write. Readers take any codec, older zstd segments too.
SEGMENT_CODEC = "lz4_raw"

CALLS_DIR = "calls"
QUARANTINE_DIR = "quarantine"
_SAFE_ID = re.compile(r"[^A-Za-z0-9_.-]")
_SELECT_TYPED = ", ".join(f"CAST({name} AS {sql}) AS {name}" for name, sql in COLUMNS)
_EMPTY_SELECT = "SELECT " + ", ".join(f"CAST(NULL AS {sql}) AS {name}" for name, sql in COLUMNS)


def segment_dir(store: str | Path, proxy_id: str) -> Path:
    return Path(store) / CALLS_DIR / f"proxy={_SAFE_ID.sub('_', proxy_id)}"


@dataclass(frozen=True)
class Written:
    """What one :meth:`SegmentWriter.write` did: the segment (``None``: no row to write), its
    rows, and the rows quarantined instead, by reason."""

    path: Path | None
    rows: int
    quarantined: dict[str, int] = field(default_factory=dict)


class SegmentWriter:
    """Writes batches of record rows as Parquet segments for one proxy. Not thread-safe:
    one writer task owns it (the recorder calls it from one worker thread at a time)."""

    def __init__(self, store: str | Path, proxy_id: str) -> None:
        self.directory = segment_dir(store, proxy_id)
        self.quarantine = Path(store) / QUARANTINE_DIR / self.directory.name
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob(".*.tmp"):
            stale.unlink(missing_ok=True)  # left by a writer that was killed mid-write
        self._con = duckdb.connect(":memory:")
        self._seq = itertools.count()
        self._pid = os.getpid()

    def write(self, rows: Sequence[Sequence[Any]]) -> Written:
        """Write ``rows`` (tuples in ``COLUMN_NAMES`` order) as one segment, quarantining any
        row DuckDB refuses. An ``OSError`` (the disk) propagates: no row of it was written."""
        return self._write_checked([storable(r) for r in rows])

    def _write_checked(self, rows: list[tuple[Any, ...]]) -> Written:
        if not rows:
            return Written(None, 0)
        try:
            return Written(self._write(rows), len(rows))
        except duckdb.Error:
            good, bad = self._split(rows)
        path = self._write(good) if good else None
        reasons: dict[str, int] = {}
        if bad:
            self.quarantine.mkdir(parents=True, exist_ok=True)
            name = f"q-{now_us():016d}-{self._pid}-{next(self._seq):06d}.jsonl"
            with open(self.quarantine / name, "w", encoding="ascii") as out:
                for row, reason in bad:
                    reasons[reason] = reasons.get(reason, 0) + 1
                    doc = {"reason": reason, "row": dict(zip(COLUMN_NAMES, row, strict=True))}
                    out.write(json.dumps(doc, default=repr) + "\n")  # ASCII: any text fits
        return Written(path, len(good), reasons)

    def _split(
        self, rows: list[tuple[Any, ...]]
    ) -> tuple[list[tuple[Any, ...]], list[tuple[tuple[Any, ...], str]]]:
        """The rows DuckDB converts, and those it refuses with the reason (by halving)."""
        try:
            self._convert(rows)
            return rows, []
        except duckdb.Error as exc:
            if len(rows) == 1:
                return [], [(rows[0], f"{type(exc).__name__}: {str(exc).splitlines()[0]}"[:200])]
        half = len(rows) // 2
        good_a, bad_a = self._split(rows[:half])
        good_b, bad_b = self._split(rows[half:])
        return good_a + good_b, bad_a + bad_b

    def _convert(self, rows: list[tuple[Any, ...]]) -> None:
        self._con.register("batch", self._columns(rows))
        try:
            # Materialised: a count alone would let DuckDB skip the casts it is asked to try.
            self._con.execute(
                f"CREATE OR REPLACE TEMP TABLE checked AS SELECT {_SELECT_TYPED} FROM batch"
            )
        finally:
            self._con.unregister("batch")

    @staticmethod
    def _columns(rows: Sequence[Sequence[Any]]) -> dict[str, Any]:
        columns = list(zip(*rows, strict=True))
        return {
            name: np.array(col, dtype=object)
            for name, col in zip(COLUMN_NAMES, columns, strict=True)
        }

    def _write(self, rows: Sequence[Sequence[Any]]) -> Path:
        batch = self._columns(rows)
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
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
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

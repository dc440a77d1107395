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
- a segment the reader cannot read is skipped with a warning naming it and remembered by path,
  size and mtime for the rest of the process (:func:`unreadable_segments`); it is tried again
  only once it changes;
- one row cannot cost its neighbours: a batch DuckDB refuses is made storable
  (:func:`shared.records.storable`) and tried again, and one it still refuses is split until
  the rows it refuses are found; those go to ``<store>/quarantine/proxy=<id>/`` as JSON lines
  (with the reason) and the rest are written. (The common batch pays for none of this: the
  per-row check runs only after DuckDB refused a batch.)
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import duckdb
import numpy as np

from shared.records import COLUMN_NAMES, COLUMNS, now_us, storable

# Segments are read far more often than written (the optimizer re-reads each window every
# period): LZ4 decompresses several times faster than zstd, the one cost that dominated a
# statistics pass (16% of its instructions on 1M calls), for files about 1.5x larger; it also
# costs the proxy's recorder less to write. Readers take any codec, older zstd segments too.
SEGMENT_CODEC = "lz4_raw"

log = logging.getLogger(__name__)
T = TypeVar("T")

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
        if not rows:
            return Written(None, 0)
        try:
            return Written(self._write(rows), len(rows))
        except duckdb.Error:
            return self._write_checked([storable(r) for r in rows])

    def _write_checked(self, rows: list[tuple[Any, ...]]) -> Written:
        """Write the storable ``rows``, quarantining those DuckDB still refuses."""
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


# Segments found unreadable (a truncated copy, a disk error, garbage under a .parquet name),
# process-wide so that every later reader skips them without opening them again: path ->
# (size, mtime_ns, reason). A file whose size or mtime changes is tried again.
_bad_lock = threading.Lock()
_bad: dict[str, tuple[int, int, str]] = {}
# A DuckDB error that names the file it failed on: 'path' or "path".
_NAMED_FILE = re.compile(r"""['"]([^'"]+\.parquet)['"]""")


# Errors that say nothing about the files (a query's own mistake, memory, an interrupt).
_NOT_THE_FILES: tuple[type[duckdb.Error], ...] = (
    duckdb.BinderException,
    duckdb.CatalogException,
    duckdb.ParserException,
    duckdb.InterruptException,
    duckdb.OutOfMemoryException,
)


def _stamp(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def _known_bad(path: str) -> bool:
    """Whether ``path`` was found unreadable and has not changed since."""
    with _bad_lock:
        entry = _bad.get(path)
    if entry is None:
        return False
    if _stamp(path) == entry[:2]:
        return True
    with _bad_lock:
        _bad.pop(path, None)  # replaced or gone: tried again if it is still there
    return False


def _mark_bad(path: str, reason: str) -> None:
    stamp = _stamp(path)
    if stamp is None:
        return  # gone (compacted away): nothing to skip
    with _bad_lock:
        known = _bad.get(path)
        _bad[path] = (*stamp, reason)
    if known is None or known[:2] != stamp:
        log.warning(
            "skipping unreadable segment %s: %s",
            path,
            reason,
            extra={"event": "unreadable_segment", "segment": path, "reason": reason},
        )


def unreadable_segments(store: str | Path) -> dict[Path, str]:
    """The segments of ``store`` found unreadable (still there, unchanged), with the reason:
    what every reader skips."""
    calls = os.path.join(str(store), CALLS_DIR) + os.sep
    with _bad_lock:
        mine = [p for p in _bad if p.startswith(calls)]
    return {Path(p): _bad[p][2] for p in mine if _known_bad(p)}


def _sql_text(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _reason(exc: duckdb.Error, path: str) -> str:
    """DuckDB's first line, without the path the warning names already."""
    text = (str(exc).splitlines() or [""])[0]
    for quoted in (f"'{path}'", f'"{path}"'):
        text = text.replace(f" {quoted}", "").replace(quoted, "")
    return " ".join(text.split())[:300] or type(exc).__name__


class StoreReader:
    """Reads call records across every proxy's segments as DuckDB relations.

    A segment DuckDB cannot read is skipped with a warning naming it, and remembered (path,
    size, mtime) so that later reads skip it without opening it: one bad file never makes the
    store unreadable. The common case costs nothing more: the segments are read through one
    glob, and files are probed one by one only after a read failed. A footer that cannot be
    read shows when :meth:`calls` binds its relation (every file's schema is read then);
    damaged data pages show only when the relation runs, which :meth:`read` handles.
    """

    def __init__(self, store: str | Path, con: duckdb.DuckDBPyConnection | None = None) -> None:
        self.store = str(store)
        self.con = con or duckdb.connect(":memory:")
        self.skipped: tuple[Path, ...] = ()  # the unreadable segments the last read left out
        self._readable: list[str] = []  # the segments the last read read

    @property
    def glob(self) -> str:
        return f"{self.store.rstrip('/')}/{CALLS_DIR}/*/*.parquet"

    @property
    def remote(self) -> bool:
        return self.store.startswith(("s3://", "gs://", "http://", "https://"))

    def segments(self) -> list[Path]:
        return sorted(Path(self.store, CALLS_DIR).glob("*/*.parquet"))

    def calls(
        self, t_from_us: int | None = None, t_to_us: int | None = None
    ) -> duckdb.DuckDBPyRelation:
        """Records whose ``t_start`` lies in ``[t_from_us, t_to_us)``, as a lazy relation
        over the readable segments (see :meth:`read` to run it)."""
        where = []
        if t_from_us is not None:
            where.append(f"t_start >= {int(t_from_us)}")
        if t_to_us is not None:
            where.append(f"t_start < {int(t_to_us)}")
        if self.remote:  # no listing, no skipping: the glob as it is
            return self.con.sql(self._sql(_sql_text(self.glob), where))
        files = [str(p) for p in self.segments()]
        good = [f for f in files if not _known_bad(f)]
        try:
            rel = self.con.sql(self._sql(self._source(files, good), where))
        except duckdb.Error:
            found = self._probe(good)
            if not found:
                raise
            good = [f for f in good if f not in found]
            rel = self.con.sql(self._sql(self._source(files, good), where))
        readable = set(good)
        self.skipped = tuple(Path(f) for f in files if f not in readable)
        self._readable = good
        return rel

    def read(
        self,
        query: Callable[[duckdb.DuckDBPyRelation], T],
        t_from_us: int | None = None,
        t_to_us: int | None = None,
    ) -> T:
        """``query(self.calls(t_from_us, t_to_us))``, run again without any segment whose
        data turned out unreadable while it ran: the one the error names, or else those a
        full read of each finds unreadable (none: the error is raised as it is)."""
        while True:
            rel = self.calls(t_from_us, t_to_us)
            try:
                return query(rel)
            except _NOT_THE_FILES:
                raise
            except duckdb.Error as exc:
                # Each turn marks a file bad (or finds it gone from the listing): the loop ends.
                named = self._named_segment(exc)
                if named is not None:
                    _mark_bad(named, _reason(exc, named))
                elif not self._probe(self._readable, deep=True):
                    raise

    def _named_segment(self, exc: duckdb.Error) -> str | None:
        """The segment of this store the error names, if it names one still unmarked."""
        if self.remote:
            return None
        files = {str(p) for p in self.segments()}
        for name in _NAMED_FILE.findall(str(exc)):
            if name in files and not _known_bad(name):
                return str(name)
        return None

    def _probe(self, files: list[str], *, deep: bool = False) -> set[str]:
        """The files whose Parquet metadata (``deep``: or any value) cannot be read, each
        marked bad (with a warning)."""
        found = set()
        for f in files:
            sql = (
                f"SELECT max(hash(COLUMNS(*))) FROM read_parquet({_sql_text(f)})"
                if deep
                else f"SELECT count(*) FROM parquet_metadata({_sql_text(f)})"
            )
            try:
                self.con.execute(sql).fetchall()
            except duckdb.Error as exc:
                _mark_bad(f, _reason(exc, f))
                found.add(f)
        return found

    def _source(self, files: list[str], good: list[str]) -> str | None:
        """What ``read_parquet`` reads: the glob while every segment is readable, else the
        list of the readable ones (``None``: there are none)."""
        if not good:
            return None
        if len(good) == len(files):
            return _sql_text(self.glob)
        return "[" + ", ".join(map(_sql_text, good)) + "]"

    @staticmethod
    def _sql(source: str | None, where: list[str]) -> str:
        if source is None:
            sql = _EMPTY_SELECT + " WHERE false"
        else:
            sql = f"SELECT {_SELECT_TYPED} FROM read_parquet({source}, union_by_name=true)"
        return sql if not where else f"SELECT * FROM ({sql}) WHERE {' AND '.join(where)}"

    def close(self) -> None:
        self.con.close()

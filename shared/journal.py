"""The recorder's journal: every finished call row on local disk within a loop turn, so that a
proxy killed without warning (``kill -9``, the OOM killer) loses none of the calls it answered.

Layout, beside the segments: ``<store>/journal/host=<hostname>/`` holds, per living recorder, a
lock file ``<token>.lock`` (``flock``-ed for the process's life) and its generations
``<token>-<gen>-<created_us>.jsonl``, one JSON array per row (``COLUMN_NAMES`` order).

Invariants:
- a row is appended to the current generation as the recorder accepts it, and the bytes reach
  the kernel (``os.write``; the page cache survives the process) at the end of the loop turn;
- the recorder rotates to a new generation at each flush; a closed generation is deleted once
  every row of it is in a segment or in quarantine, and kept when any of its rows was lost to a
  failing store, so the next start replays it;
- :func:`replay` takes only generations whose owner is dead (its lock can be taken), on this
  host: a shared store folder never lets one host take another's journal. A row the owner had
  already written (same ``call_id`` and ``attempt``, finished, in a segment of its proxy written
  since the generation began) is not written twice; a line cut short by the kill is skipped.
"""

from __future__ import annotations

import fcntl
import os
import socket
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import duckdb
import orjson

from shared.records import COLUMN_NAMES, now_us, storable
from shared.store import segment_dir

__all__ = ["Journal", "journal_dir", "replay"]

_CALL_ID, _ATTEMPT, _PROXY = (COLUMN_NAMES.index(c) for c in ("call_id", "attempt", "proxy_id"))
_SLACK_S = 2.0  # file times are compared with a margin for coarse clocks


def journal_dir(store: str | Path) -> Path:
    return Path(store) / "journal" / f"host={socket.gethostname()}"


def encode(row: Sequence[Any]) -> bytes:
    try:
        return orjson.dumps(row) + b"\n"
    except TypeError:  # text orjson refuses (a lone surrogate): made storable first
        return orjson.dumps(storable(row)) + b"\n"


class Journal:
    """Appends and generations for one recorder; used from its event loop only."""

    def __init__(self, store: str | Path) -> None:
        self.directory = journal_dir(store)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.token = uuid.uuid4().hex[:16]
        self._lock = os.open(self.directory / f"{self.token}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._gen = 0
        self._pending: list[bytes] = []
        # Generations oldest first: [path, rows not yet resolved, any row lost].
        self._gens: deque[list[Any]] = deque()
        self._fd = self._open()

    def _open(self) -> int:
        self._gen += 1
        path = self.directory / f"{self.token}-{self._gen:08d}-{now_us()}.jsonl"
        self._gens.append([path, 0, False])
        return os.open(path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600)

    def append(self, row: Sequence[Any]) -> bool:
        """Queue ``row``; True when it is the first of this loop turn (the caller schedules
        :meth:`sync` once per turn)."""
        self._pending.append(encode(row))
        self._gens[-1][1] += 1
        return len(self._pending) == 1

    def sync(self) -> None:
        """Hand the queued rows to the kernel in one write."""
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]

    def rotate(self) -> None:
        """Start a new generation: rows appended from now on belong to it."""
        self.sync()
        os.close(self._fd)
        self._fd = self._open()
        self._collect()

    def resolved(self, rows: int, lost: bool = False) -> None:
        """The oldest ``rows`` journaled rows are in the store (or lost, when ``lost``)."""
        for gen in self._gens:
            if rows <= 0:
                break
            take = min(rows, gen[1])
            gen[1] -= take
            gen[2] = gen[2] or (lost and take > 0)
            rows -= take
        self._collect()

    def _collect(self) -> None:
        while len(self._gens) > 1 and self._gens[0][1] == 0:
            path, _, lost = self._gens.popleft()
            if not lost:  # a lost row's generation waits for the next start's replay
                path.unlink(missing_ok=True)

    def close(self, written: bool) -> None:
        """Stop journaling; remove every generation when everything was ``written``."""
        self.sync()
        os.close(self._fd)
        if written and not any(lost for _, _, lost in self._gens):
            for path, _, _ in self._gens:
                path.unlink(missing_ok=True)
            (self.directory / f"{self.token}.lock").unlink(missing_ok=True)
        os.close(self._lock)


def _dead_owners(directory: Path, alive: str | None) -> list[tuple[str, int]]:
    owners = []
    for lock in sorted(directory.glob("*.lock")):
        if lock.stem == alive:
            continue
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)  # its recorder runs
            continue
        owners.append((lock.stem, fd))
    return owners


def _already_written(store: str | Path, rows: list[tuple[Any, ...]], since_s: float) -> set[Any]:
    """(call_id, attempt) of ``rows`` already in a segment of their proxy written since
    ``since_s``: the owner flushed them after the generation began, before it died."""
    keys: set[Any] = set()
    for proxy in {r[_PROXY] for r in rows}:
        folder = segment_dir(store, str(proxy))
        files = [str(p) for p in folder.glob("*.parquet") if p.stat().st_mtime >= since_s]
        if files:
            con = duckdb.connect(":memory:")
            try:
                keys.update(
                    con.execute(
                        "SELECT call_id, CAST(attempt AS BIGINT) FROM read_parquet(?, "
                        "union_by_name=true) WHERE t_end IS NOT NULL",
                        [files],
                    ).fetchall()
                )
            finally:
                con.close()
    return keys


def replay(
    store: str | Path,
    write: Callable[[list[tuple[Any, ...]]], object],
    alive: str | None = None,
) -> tuple[int, int]:
    """Write the rows of dead recorders' journals through ``write``; return (rows replayed,
    lines skipped). Blocking: run it in a thread before the recorder starts."""
    directory = journal_dir(store)
    if not directory.is_dir():
        return 0, 0
    replayed = skipped = 0
    for token, fd in _dead_owners(directory, alive):
        try:
            for gen in sorted(directory.glob(f"{token}-*.jsonl")):
                rows: list[tuple[Any, ...]] = []
                for line in gen.read_bytes().splitlines():
                    try:
                        row = orjson.loads(line)
                    except ValueError:
                        skipped += 1  # cut short by the kill
                        continue
                    if isinstance(row, list) and len(row) == len(COLUMN_NAMES):
                        rows.append(storable(row))
                    else:
                        skipped += 1
                created_s = int(gen.stem.rsplit("-", 1)[1]) / 1e6 - _SLACK_S
                done = _already_written(store, rows, created_s) if rows else set()
                fresh = [r for r in rows if (r[_CALL_ID], r[_ATTEMPT]) not in done]
                if fresh:
                    write(fresh)
                replayed += len(fresh)
                gen.unlink()
            (directory / f"{token}.lock").unlink(missing_ok=True)
        finally:
            os.close(fd)
    return replayed, skipped

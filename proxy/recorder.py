"""The recorder: takes call records from request handlers without waiting, writes segments.

Role: the bounded buffer between the request path and the trace store. Handlers call
:meth:`Recorder.begin` when an attempt starts and :meth:`Recorder.submit` when it ends (both
synchronous, O(1), never awaiting, so safe in a ``finally`` of a cancelled handler); one
background task hands full or aged batches to a worker thread that writes them through
:class:`shared.store.SegmentWriter`.

Calls in flight are announced: at each aged flush, every call begun at least
``flush_interval_s`` earlier and not yet submitted or announced is written once as an open row
(``shared.records``). Without them the store would show only finished calls, and under
overload — requests queued for minutes — the optimizer would read the arrival rate low and
requests as complete early, just when it must act.

Invariants:
- ``submit`` never blocks: past ``queue_size`` pending records a record is dropped and counted;
- pending = buffered + being written ≤ ``queue_size``;
- a segment is written when ``segment_rows`` records wait or ``flush_interval_s`` passed, and
  everything still buffered is written by :meth:`close` (graceful shutdown);
- one writer thread at a time owns the DuckDB connection;
- a call gets at most one open row, and only if it was still running a whole flush interval
  after it began (short calls, the common case, cost no extra row);
- a call the proxy answered survives ``kill -9``: each accepted finished row is appended to the
  journal (:mod:`shared.journal`) in the same loop turn, the journal rotates at each flush and
  forgets rows once they are in a segment; at start, rows killed recorders on this host left
  are written first (counted in ``replayed``);
- a row the store refuses costs only itself: it is quarantined and counted by reason
  (``quarantined``), its neighbours written;
- the store's health for ``/health/ready`` is two facts: the last write did not fail recently
  (:meth:`Recorder.failing`; a later write that succeeds clears it), and the segment folder
  takes a small file now (:meth:`Recorder.check_writable`, blocking: run it in a thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from operator import attrgetter
from typing import Any

from shared.journal import Journal, replay
from shared.records import COLUMN_NAMES, CallRecord, now_us
from shared.settings import StoreSettings
from shared.store import SegmentWriter, Written, segment_dir

log = logging.getLogger("scepsy.proxy.recorder")
_row: Callable[[CallRecord], tuple[Any, ...]] = attrgetter(*COLUMN_NAMES)
_T_END = COLUMN_NAMES.index("t_end")  # set on every finished row, never on an open one


class Recorder:
    def __init__(self, settings: StoreSettings, proxy_id: str) -> None:
        self.settings = settings
        self.proxy_id = proxy_id
        self._buffer: list[tuple[Any, ...]] = []
        self._open: dict[int, CallRecord] = {}  # begun, not yet submitted nor announced
        self._writing = 0
        self._wake = asyncio.Event()
        self._writer: SegmentWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.written = 0  # rows on disk, open rows included
        self.announced = 0  # open rows queued
        self.dropped = 0
        self.segments = 0
        self.write_errors = 0
        self.last_error: str | None = None  # of the last write, cleared by a successful one
        self._failed_at: float | None = None  # monotonic time of that failed write
        self.quarantined: dict[str, int] = {}  # rows the store refused, by reason
        self.replayed = 0  # rows of a killed recorder's journal written at start
        self.journal_errors = 0
        self._journal: Journal | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def depth(self) -> int:
        """Records accepted and not yet on disk."""
        return len(self._buffer) + self._writing

    def begin(self, record: CallRecord) -> None:
        """An attempt starts: announced as open if it is still running at a later flush."""
        self._open[id(record)] = record

    def _announce(self, before_us: int) -> None:
        """Queue open rows for the calls begun before ``before_us`` and still running."""
        due = [key for key, rec in self._open.items() if rec.t_start < before_us]
        room = self.settings.queue_size - len(self._buffer) - self._writing
        for key in due:
            rec = self._open.pop(key)
            if room > 0:  # announcing is best effort: finished rows matter more
                self._buffer.append(rec.opened())
                self.announced += 1
                room -= 1

    def submit(self, record: CallRecord) -> bool:
        """Queue one record; False (and counted) when the queue is full."""
        self._open.pop(id(record), None)
        if len(self._buffer) + self._writing >= self.settings.queue_size:
            self.dropped += 1
            return False
        row = _row(record)
        self._buffer.append(row)
        if self._journal is not None and self._journal.append(row):
            assert self._loop is not None
            self._loop.call_soon(self._sync_journal)  # one write per loop turn
        if len(self._buffer) >= self.settings.segment_rows:
            self._wake.set()
        return True

    def _sync_journal(self) -> None:
        assert self._journal is not None
        try:
            self._journal.sync()
        except OSError as exc:
            # The segments still get every row; only a kill would now lose some.
            self.journal_errors += 1
            log.warning("cannot append to the journal in %s: %s", self._journal.directory, exc)

    def _start_store(self) -> tuple[SegmentWriter, Journal | None]:
        """The writer, after replaying what killed recorders on this host left in their
        journals; then this recorder's own journal (none, with a warning, if it cannot be)."""
        writer = SegmentWriter(self.settings.path, self.proxy_id)
        replayed, skipped = replay(self.settings.path, lambda rows: self._count(writer.write(rows)))
        if replayed or skipped:
            self.replayed += replayed
            log.warning(
                "replayed %d call records a killed proxy had journaled (%d cut-short lines)",
                replayed,
                skipped,
            )
        try:
            return writer, Journal(self.settings.path)
        except OSError as exc:
            log.warning("no journal (a kill would lose the last flush interval): %s", exc)
            return writer, None

    def _count(self, written: Written) -> None:
        for reason, n in written.quarantined.items():
            self.quarantined[reason] = self.quarantined.get(reason, 0) + n
            log.warning("quarantined %d call records the store refused: %s", n, reason)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._writer, self._journal = await asyncio.to_thread(self._start_store)
        self._task = asyncio.create_task(self._run(), name="scepsy-recorder")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        interval = self.settings.flush_interval_s
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(0.0, last + interval - loop.time()))
            self._wake.clear()
            # Full segments go out as soon as they fill; a partial one only once the interval
            # has passed, so a steady stream of records makes few, large segments.
            aged = loop.time() >= last + interval
            if aged and self._open:
                self._announce(now_us() - round(interval * 1e6))
            await self._flush(partial=aged)
            if aged:
                last = loop.time()
        while self._buffer:  # the last turn: everything left, however it arrived
            await self._flush()

    async def _flush(self, partial: bool = True) -> None:
        # A partial flush writes only what was buffered when it began: records that arrive
        # while a segment is being written wait for the next turn, or a busy proxy would
        # write a stream of tiny segments, each paying the fixed cost of a Parquet file.
        due = len(self._buffer) if partial else 0
        if self._journal is not None and due:
            self._rotate_journal()
        while due > 0 or len(self._buffer) >= self.settings.segment_rows:
            batch = self._buffer[: self.settings.segment_rows]
            due -= len(batch)
            del self._buffer[: len(batch)]
            self._writing = len(batch)
            journaled = sum(1 for row in batch if row[_T_END] is not None)
            try:
                assert self._writer is not None
                written = await asyncio.to_thread(self._writer.write, batch)
            except Exception as exc:
                # A failing store must never take the data plane down: count, log, go on.
                self.write_errors += 1
                self.dropped += len(batch)
                self.last_error = f"{type(exc).__name__}: {exc}"
                self._failed_at = time.monotonic()
                log.exception(
                    "could not write %d call records to %s", len(batch), self.settings.path
                )
                if self._journal is not None:  # kept for the next start to replay
                    self._journal.resolved(journaled, lost=True)
            else:
                self._count(written)
                self.written += written.rows
                self.segments += written.path is not None
                self.last_error, self._failed_at = None, None
                if self._journal is not None:
                    self._journal.resolved(journaled)
            finally:
                self._writing = 0

    def _rotate_journal(self) -> None:
        assert self._journal is not None
        try:
            self._journal.rotate()
        except OSError as exc:
            self.journal_errors += 1
            log.warning("cannot rotate the journal in %s: %s", self._journal.directory, exc)

    def failing(self, within_s: float) -> str | None:
        """The last write's error if it failed less than ``within_s`` seconds ago, else None.
        (Bounded in time: with no traffic no write comes to clear it, and the folder check
        then says whether the store works again.)"""
        if self._failed_at is None or time.monotonic() - self._failed_at >= within_s:
            return None
        return self.last_error

    def check_writable(self) -> str | None:
        """Why this proxy's segment folder cannot take a file now, or None when it can.
        Blocking (a small file is written and removed): call it in a worker thread."""
        folder = segment_dir(self.settings.path, self.proxy_id)
        probe = folder / f".ready-{os.getpid()}.probe"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, b"ok")
            finally:
                os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            return f"cannot write to {folder}: {exc.strerror or exc}"
        return None

    async def close(self) -> None:
        """Stop the background task after it has written everything still buffered.

        The task is asked to stop rather than cancelled: a cancelled ``to_thread`` write would
        go on in its thread while a second flush used the same DuckDB connection.
        """
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._journal is not None:
            self._journal.close(written=not self._buffer)
            self._journal = None

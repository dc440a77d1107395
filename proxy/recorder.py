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

from shared.records import COLUMN_NAMES, CallRecord, now_us
from shared.settings import StoreSettings
from shared.store import SegmentWriter, segment_dir

log = logging.getLogger("scepsy.proxy.recorder")
_row: Callable[[CallRecord], tuple[Any, ...]] = attrgetter(*COLUMN_NAMES)


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
        self._buffer.append(_row(record))
        if len(self._buffer) >= self.settings.segment_rows:
            self._wake.set()
        return True

    async def start(self) -> None:
        self._writer = await asyncio.to_thread(SegmentWriter, self.settings.path, self.proxy_id)
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
        while due > 0 or len(self._buffer) >= self.settings.segment_rows:
            batch = self._buffer[: self.settings.segment_rows]
            due -= len(batch)
            del self._buffer[: len(batch)]
            self._writing = len(batch)
            try:
                assert self._writer is not None
                await asyncio.to_thread(self._writer.write, batch)
            except Exception as exc:
                # A failing store must never take the data plane down: count, log, go on.
                self.write_errors += 1
                self.dropped += len(batch)
                self.last_error = f"{type(exc).__name__}: {exc}"
                self._failed_at = time.monotonic()
                log.exception(
                    "could not write %d call records to %s", len(batch), self.settings.path
                )
            else:
                self.written += len(batch)
                self.segments += 1
                self.last_error, self._failed_at = None, None
            finally:
                self._writing = 0

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

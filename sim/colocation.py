"""Co-located emulated engines contend like simulated ones: a board per GPU they all read.

Role: emulated engines are separate processes, so the simulator's rule for replicas sharing a
GPU (:func:`sim.perf.contention`: while several have work, each runs at its solo rate divided
by the busy clients' summed solo rates when that sum exceeds 1) needs to know which of its
neighbours are busy. A :class:`GpuBoard` is a small file per GPU (``DIR/gpu-<index>``) of fixed
slots ``(pid, token, share, busy_at)``, mapped into memory by every engine on that GPU: an engine
claims a slot at start, stamps ``busy_at`` (wall clock) before each step while it has work and
clears it when it goes idle, and before each step reads its neighbours' slots.

Invariants:
- a neighbour counts as busy when its stamp is newer than ``STALE_S``: an engine that dies
  busy stops slowing the others within that time, without anyone cleaning up after it;
- a slot is claimed under an exclusive ``flock`` on the file, reusing a slot whose process is
  gone (several engines of one process hold a slot each); an engine never writes another
  engine's slot except to claim a dead one;
- reads take no lock: a torn read of a neighbour's slot can only misjudge one step;
- with no board (``--gpu-board`` not given) an engine runs alone, as before.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import struct
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from sim.engine import EngineCore
from sim.perf import Contended

__all__ = ["SLOTS", "STALE_S", "GpuBoard", "Neighbours", "attach"]

SLOTS = 64  # engines one GPU can hold at once (shares of 1/64 and up)
_SLOT = struct.Struct("<qqdd")  # pid, engine token, share, busy_at (epoch s; 0: idle)
_BUSY_AT = 24  # offset of busy_at within a slot
STALE_S = 1.0  # a busy stamp older than this is a dead or stalled engine's: ignored


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class GpuBoard:
    """One GPU's slots, mapped in memory; this engine's own slot is ``slot``."""

    def __init__(self, path: Path, share: float, token: int) -> None:
        self.path = path
        self.pid = os.getpid()
        self.token = token
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_size < SLOTS * _SLOT.size:
                os.ftruncate(fd, SLOTS * _SLOT.size)
            self._map = mmap.mmap(fd, SLOTS * _SLOT.size)
            self.slot = self._claim(share)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _claim(self, share: float) -> int:
        for k in range(SLOTS):
            pid = _SLOT.unpack_from(self._map, k * _SLOT.size)[0]
            if pid == 0 or not _alive(pid):
                _SLOT.pack_into(self._map, k * _SLOT.size, self.pid, self.token, share, 0.0)
                return k
        raise ValueError(f"{self.path}: all {SLOTS} slots are taken by live engines")

    def mark(self, busy_at: float) -> None:
        """Stamp this engine busy as of ``busy_at`` (0: idle)."""
        struct.pack_into("<d", self._map, self.slot * _SLOT.size + _BUSY_AT, busy_at)

    def busy(self, now: float) -> dict[tuple[int, int], float]:
        """The other engines busy as of ``now``: (pid, token) -> share."""
        out = {}
        for k in range(SLOTS):
            if k == self.slot:
                continue
            pid, token, share, busy_at = _SLOT.unpack_from(self._map, k * _SLOT.size)
            if pid and busy_at > 0 and now - busy_at < STALE_S:
                out[(pid, token)] = share
        return out

    def release(self) -> None:
        offset = self.slot * _SLOT.size
        _SLOT.pack_into(self._map, offset, 0, 0, 0.0, 0.0)
        self._map.close()


class Neighbours:
    """An engine's boards (one per GPU it spans): marks it busy or idle on all of them and
    tells which co-located engines are busy, each once (by its token) however many of this
    engine's GPUs it shares."""

    def __init__(
        self,
        directory: Path,
        gpus: Iterable[int],
        share: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.clock = clock
        token = secrets.randbits(62)
        self.boards = [GpuBoard(directory / f"gpu-{g}", share, token) for g in sorted(set(gpus))]

    def busy_shares(self) -> tuple[float, ...]:
        """Marks this engine busy now and returns its busy neighbours' shares (sorted)."""
        now = self.clock()
        found: dict[tuple[int, int], float] = {}
        for board in self.boards:
            board.mark(now)
            found.update(board.busy(now))
        return tuple(sorted(found.values()))

    def idle(self) -> None:
        for board in self.boards:
            board.mark(0.0)

    def close(self) -> None:
        for board in self.boards:
            board.release()


def attach(
    core: EngineCore, neighbours: Neighbours
) -> tuple[Callable[[], None], Callable[[], None]]:
    """The driver's ``(before_step, on_idle)`` hooks for ``core`` among ``neighbours``: before
    each step the core runs under its busy neighbours' contention; idle, it stops counting as
    busy for them."""
    contended = Contended(core.perf)

    def before_step() -> None:
        core.perf = contended.under(neighbours.busy_shares())

    return before_step, neighbours.idle

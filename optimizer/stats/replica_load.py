"""What one replica did over one statistics window: the figures live profile points come from.

Role: the contract between :mod:`optimizer.stats.replicas` (DuckDB, the store edge) and
:mod:`optimizer.model.live` (pure), so the model never imports the database.

Invariants: one :class:`ReplicaLoad` per (model, upstream URL) the proxies sent calls to; a
retried call counts once (its last attempt); rates are per second of ``window_s``; latencies are
seconds over the window's finished calls (status 200, ``t_end`` in the window), ``nan`` where
none finished.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One (model, upstream) over the window ``[t_from_us, t_to_us)``."""

    model: str
    upstream: str
    t_from_us: int
    t_to_us: int
    started: int  # logical calls that started in the window (whatever came of them)
    finished: int  # logical calls that finished in the window with status 200
    lat_mean: float  # t_end - t_start of the finished calls, seconds
    lat_p50: float
    lat_p90: float
    lat_p99: float
    ttft_mean: float  # t_first_byte - t_start, where known; nan if never
    lat_mean_early: float  # mean latency of the finished calls that started in the first half
    lat_mean_late: float  # ... and in the second half (nan where none)
    open_early: int  # logical calls started in the first half and not ended by the window's end
    finished_late: int  # of ``finished``, those that ended in the window's second half
    # mean completion tokens of the finished calls whose usage was reported (nan: none was)
    completion_tokens_mean: float = math.nan

    @property
    def window_s(self) -> float:
        return (self.t_to_us - self.t_from_us) / 1e6

    @property
    def throughput(self) -> float:
        """Finished calls per second of the window."""
        return self.finished / self.window_s if self.window_s > 0 else 0.0

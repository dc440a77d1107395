"""What a simulation returns: per-workflow and per-replica figures, and the call trace.

Role: the frozen result types of ``sim.des.simulate``. Every result carries ``label`` =
"simulated" so it is never shown as a measurement.

Invariants: latencies and times are seconds of simulated time; ``calls`` is empty unless the
simulation recorded them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from sim.workflows import Call

__all__ = ["LatencyStats", "ReplicaResult", "SimCall", "SimResult", "WorkflowResult"]


@dataclass(frozen=True)
class LatencyStats:
    mean: float
    p50: float
    p90: float
    p99: float

    @staticmethod
    def of(values: Sequence[float]) -> LatencyStats:
        if not values:
            return LatencyStats(math.nan, math.nan, math.nan, math.nan)
        a = np.asarray(values)
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return LatencyStats(float(a.mean()), float(p50), float(p90), float(p99))


@dataclass(frozen=True)
class WorkflowResult:
    name: str
    offered_rate: float
    started: int  # measured requests (arrived in the measurement window)
    completed: int
    failed: int
    throughput: float  # measured completions per second of the window
    latency: LatencyStats  # seconds, over completed measured requests
    calls_per_request: dict[str, float]  # per model: mean calls per completed request (n_m)


@dataclass(frozen=True)
class ReplicaResult:
    name: str
    model: str
    gpus: tuple[int, ...]
    share: float
    utilisation: float  # fraction of simulated time spent in steps
    steps: int
    preemptions: int
    prefix_hit_rate: float


@dataclass(frozen=True)
class SimCall:
    """One simulated call, for traces (times in simulated seconds)."""

    call_id: int
    workflow: str
    request_id: str
    call: Call
    replica: str
    t_start: float
    t_first: float
    t_end: float
    cached_tokens: int


@dataclass(frozen=True)
class SimResult:
    label: str
    seed: int
    simulated_s: float
    wall_s: float
    events: int
    window_s: tuple[float, float]
    workflows: dict[str, WorkflowResult]
    replicas: tuple[ReplicaResult, ...]
    calls: tuple[SimCall, ...] = ()

    def summary(self) -> dict[str, Any]:
        """JSON-ready figures (without the call trace)."""
        out = asdict(replace(self, calls=()))  # asdict would deep-copy every call's prompt
        out.pop("calls")
        return out

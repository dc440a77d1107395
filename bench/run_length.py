"""Whether a simulated run was long enough for its own request latency to judge overload.

Role: the one rule both benches (``bench.accuracy.alp_truth``'s capacity probes and
``bench.evaluation.runs``'s throughput-latency points) apply before they call a rate
overloaded: a run whose completions fell short of its arrivals is run again, longer, when its
warm-up or window held too few of its own request latencies to tell a pipeline still filling
from a backlog that grows.

Invariants: pure; a run that kept up (``sim.profiling.keeps_up``) never stretches; a stretch
never shortens warm-up or window; a shortfall that grew since the shorter run before it
stands (a backlog that grows with time is overload, not fill).
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.profiling import keeps_up

__all__ = ["CAP_STRETCHES", "CAP_WARMUP_LATENCIES", "CAP_WINDOW_LATENCIES", "Window", "stretch"]

# A run judged overloaded from a window too short for its own request latency (warm-up under
# CAP_WARMUP_LATENCIES latencies, or window under CAP_WINDOW_LATENCIES) runs again with both
# that long, up to CAP_STRETCHES times, unless its shortfall grew. The fill is slow where
# many requests are in flight: fan-out with 4 x 8B replicas at 21.6 req/s read 4.6% short over
# 2,000 requests (latency 8.7 s in the window's first seventh, 14 s later), kept up at 24.4
# req/s over 8,000 (latency flat at 21-24 s), and with these stretches kept up at 25.5 (2.2%
# short, latency 30-33 s) and fell behind at 27 (6.2% -> 8.1% short, latency 40 -> 54 s); the
# fixed 1,000-request windows had read its capacity as 20.5 req/s. Simulated.
CAP_WARMUP_LATENCIES, CAP_WINDOW_LATENCIES, CAP_STRETCHES = 5.0, 20.0, 2


@dataclass(frozen=True)
class Window:
    """One run: arrivals and completions per second over its measurement window, the mean
    latency of the requests completed in it, and how long warm-up and window were."""

    offered: float
    achieved: float
    latency_s: float
    warmup_s: float
    window_s: float

    @property
    def shortfall(self) -> float:
        return 1.0 - self.achieved / max(self.offered, 1e-12)


def stretch(
    w: Window,
    previous: Window | None,
    warmup_latencies: float = CAP_WARMUP_LATENCIES,
    window_latencies: float = CAP_WINDOW_LATENCIES,
) -> tuple[float, float] | None:
    """(warm-up, window) in seconds to run an overloaded verdict ``w`` again with, or None
    when it stands: its run was long enough for its own latency (warm-up and window of
    ``warmup_latencies`` and ``window_latencies`` x its mean latency), or it fell further
    behind than the shorter run before it (``previous``), as a growing backlog does."""
    if keeps_up(w.offered, w.achieved):
        return None
    if previous is not None and w.shortfall >= previous.shortfall:
        return None
    warmup = warmup_latencies * w.latency_s
    window = window_latencies * w.latency_s
    if w.warmup_s >= 0.95 * warmup and w.window_s >= 0.95 * window:
        return None
    return max(w.warmup_s, warmup), max(w.window_s, window)

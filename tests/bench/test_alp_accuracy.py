"""The ALP accuracy bench's measurement helpers: keeping up from the backlog trend, and the
standard error of a mean latency."""

from __future__ import annotations

import numpy as np
import pytest

from bench.alp_accuracy import mean_and_se
from bench.sim_profile import backlog_growth
from sim.des import RequestSpan


def _spans(rate: float, service: float, horizon: float, seed: int) -> list[RequestSpan]:
    """Poisson arrivals into one FIFO server with exponential service times."""
    rng = np.random.default_rng(seed)
    t, free = 0.0, 0.0
    out: list[RequestSpan] = []
    while True:
        t += rng.exponential(1.0 / rate)
        if t >= horizon:
            return out
        free = max(free, t) + rng.exponential(service)
        out.append(RequestSpan("w", t, free if free < horizon else -1.0, False))


def test_backlog_growth_is_zero_when_keeping_up_and_the_deficit_in_overload() -> None:
    stable = [backlog_growth(_spans(1.0, 0.8, 3000.0, s), 300.0, 3000.0) for s in range(5)]
    assert max(abs(g) for g in stable) < 0.05
    over = backlog_growth(_spans(1.0, 1.25, 3000.0, 1), 300.0, 3000.0)
    assert over == pytest.approx(1.0 - 1.0 / 1.25, abs=0.05)


def test_backlog_growth_ignores_where_the_end_points_happen_to_fall() -> None:
    # a queue that is empty at the start of the window and holds a burst at its end: the
    # end points say 'falling behind', the trend does not
    spans = [RequestSpan("w", float(t), float(t) + 0.5, False) for t in range(100, 1000)]
    spans += [RequestSpan("w", 999.0 + i / 100, -1.0, False) for i in range(60)]
    assert backlog_growth(spans, 100.0, 1000.0) < 0.05


def test_mean_and_se_batch_means() -> None:
    rng = np.random.default_rng(0)
    values = rng.exponential(2.0, 4000)
    mean, se = mean_and_se(list(values))
    assert mean == pytest.approx(2.0, rel=0.08)
    assert se == pytest.approx(2.0 / np.sqrt(4000), rel=0.6)
    assert mean_and_se([1.0, 2.0])[1] == float("inf")

"""The ALP accuracy bench's measurement helpers: a mean latency's standard error, quick cases."""

from __future__ import annotations

import numpy as np
import pytest

from bench.alp_accuracy import (
    CAP_MIN_REQUESTS,
    QUICK_ALLOCATIONS,
    _cases,
    mean_and_se,
    quick_cases,
)


def test_mean_and_se_batch_means() -> None:
    rng = np.random.default_rng(0)
    values = rng.exponential(2.0, 4000)
    mean, se = mean_and_se(list(values))
    assert mean == pytest.approx(2.0, rel=0.08)
    assert se == pytest.approx(2.0 / np.sqrt(4000), rel=0.6)
    assert mean_and_se([1.0, 2.0])[1] == float("inf")


def test_quick_keeps_capacity_windows_long_enough() -> None:
    full = _cases()
    quick = quick_cases(full)
    assert [c.workflow for c in quick] == [c.workflow for c in full]
    for f, q in zip(full, quick, strict=True):
        assert len(q.allocations) == min(QUICK_ALLOCATIONS, len(f.allocations))
        assert q.eval_requests < f.eval_requests
        # the simulated truth stays as precise as the test's tolerance needs
        assert q.capacity_requests >= CAP_MIN_REQUESTS
        assert f.capacity_requests >= CAP_MIN_REQUESTS

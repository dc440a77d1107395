"""The ALP accuracy bench's measurement helpers: the standard error of a mean latency."""

from __future__ import annotations

import numpy as np
import pytest

from bench.alp_accuracy import mean_and_se


def test_mean_and_se_batch_means() -> None:
    rng = np.random.default_rng(0)
    values = rng.exponential(2.0, 4000)
    mean, se = mean_and_se(list(values))
    assert mean == pytest.approx(2.0, rel=0.08)
    assert se == pytest.approx(2.0 / np.sqrt(4000), rel=0.6)
    assert mean_and_se([1.0, 2.0])[1] == float("inf")

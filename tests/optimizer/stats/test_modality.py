"""optimizer.stats.modality: Otsu split and the bimodality criterion."""

from __future__ import annotations

import numpy as np
import pytest

from optimizer.stats.modality import bimodal_split, otsu_split


def test_otsu_on_two_points() -> None:
    split = otsu_split([0.1] * 5 + [0.9] * 15)
    assert split is not None
    assert split.threshold == pytest.approx(0.5)
    assert split.low_fraction == pytest.approx(0.25)
    assert split.eta == pytest.approx(1.0)


def test_constant_sample_has_no_split() -> None:
    assert otsu_split([0.3] * 10) is None
    assert bimodal_split([0.3] * 50) is None


@pytest.mark.parametrize("seed", range(5))
def test_unimodal_samples_are_not_bimodal(seed: int) -> None:
    rng = np.random.default_rng(seed)
    assert bimodal_split(np.clip(rng.normal(0.5, 0.1, 400), 0, 1)) is None
    assert bimodal_split(rng.uniform(0.2, 0.8, 400)) is None
    assert bimodal_split(rng.exponential(0.1, 400)) is None


def test_two_modes_are_bimodal() -> None:
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.normal(0.2, 0.04, 150), rng.normal(0.7, 0.04, 250)])
    split = bimodal_split(x)
    assert split is not None
    assert split.low_fraction == pytest.approx(150 / 400, abs=0.01)
    assert split.low_mean == pytest.approx(0.2, abs=0.02)


def test_a_few_outliers_are_not_a_mode() -> None:
    x = [0.5] * 95 + [0.95] * 5
    assert bimodal_split(x) is None

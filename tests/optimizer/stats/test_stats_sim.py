"""optimizer.stats.figures on simulated beam-search traces: shares are stabler than latency (paper §2.4)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from optimizer.stats.reader import summarise_store
from sim.cluster import Allocation, ReplicaSpec
from sim.des import WorkloadSpec, simulate
from sim.trace import call_rows
from sim.workflows import BeamParams
from tests.optimizer.conftest import Row


def test_shares_vary_less_than_latency_on_simulated_beam_search(
    write_store: Callable[[list[Row]], Path],
) -> None:
    params = BeamParams()
    alloc = Allocation(
        (
            ReplicaSpec(params.generator, "a6000", 1, 1.0, 1),
            ReplicaSpec(params.verifier, "a6000", 1, 1.0, 1),
        )
    )
    result = simulate(
        alloc, [WorkloadSpec("beam", 0.05, params)], n_requests=40, record_calls=True, seed=3
    )
    stats = summarise_store(write_store(call_rows(result, bodies=False)))["beam"]
    assert stats.requests == result.workflows["beam"].completed
    assert stats.latency_mean == pytest.approx(result.workflows["beam"].latency.mean, rel=1e-3)
    for model in (params.generator, params.verifier):
        ms = stats.models[model]
        assert ms.n == pytest.approx(result.workflows["beam"].calls_per_request[model])
        assert ms.share_cv < stats.latency_cv / 2
        assert ms.p > 1.5  # beams run in parallel
    assert stats.overlap_factor == pytest.approx(1.0)  # generator and verifier alternate

"""bench.accuracy.alp_point_check: points at a load of the capacity a fresh trace predicts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.accuracy.alp_point_check import main

pytestmark = pytest.mark.timeout(60)

RUN = Path(__file__).resolve().parents[3] / "bench" / "results" / "alp_accuracy_full.json"


def test_a_rag_point_from_the_committed_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                str(RUN),
                "--workflow",
                "rag",
                "--allocations",
                "0",
                "--load",
                "0.5",
                "--trace-requests",
                "100",
                "--seeds",
                "2",
                "--requests",
                "150",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["label"] == "simulated" and out["trace"]["requests"] == 100
    (point,) = out["points"]
    # one generator replica on a full GPU bounds RAG (the run's profile: ~6.3 calls/s)
    assert 5.0 < point["capacity"] < 8.0
    assert point["rate"] == pytest.approx(0.5 * point["capacity"])
    assert len(point["seed_means"]) == 2 and point["seed_means"][0] != point["seed_means"][1]
    assert 1.0 < point["predicted"] < 5.0 and 1.0 < point["simulated"] < 5.0
    assert point["error"] == pytest.approx(
        abs(point["predicted"] - point["simulated"]) / point["simulated"]
    )

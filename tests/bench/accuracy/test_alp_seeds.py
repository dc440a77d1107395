"""bench.accuracy.alp_seeds: a run's missed latency points simulated again over several seeds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from bench.accuracy.alp_accuracy import _cases
from bench.accuracy.alp_seeds import _alloc_index, main, selected
from bench.accuracy.cases import Alloc

pytestmark = pytest.mark.timeout(60)

RAG = _cases()[1]


def _doc(alloc: Alloc) -> dict[str, dict[str, float]]:
    return {m: {"replicas": row[0], "tp": row[1], "share": row[2]} for m, row in alloc.items()}


def _run(tmp_path: Path) -> Path:
    alloc = _doc(RAG.allocations[1])
    points: list[dict[str, Any]] = [
        {
            "allocation": alloc,
            "kind": "mean_latency",
            "load": 0.8,
            "rate": 1.0,
            "predicted": 2.0,
            "simulated": 1.0,
            "simulated_se": 0.1,
            "requests": 300,
            "error": 1.0,
        },
        # not selected: another load, a small error, a throughput point
        {
            "allocation": alloc,
            "kind": "mean_latency",
            "load": 0.6,
            "rate": 0.8,
            "predicted": 2.0,
            "simulated": 1.0,
            "simulated_se": 0.1,
            "requests": 300,
            "error": 1.0,
        },
        {
            "allocation": alloc,
            "kind": "mean_latency",
            "load": 0.8,
            "rate": 1.0,
            "predicted": 1.01,
            "simulated": 1.0,
            "simulated_se": 0.1,
            "requests": 300,
            "error": 0.01,
        },
        {
            "allocation": alloc,
            "kind": "max_throughput",
            "predicted": 2.0,
            "simulated": 1.0,
            "error": 1.0,
        },
    ]
    path = tmp_path / "alp_accuracy.json"
    path.write_bytes(
        orjson.dumps({"workflows": {"rag": {"trace": {"latency_mean_s": 1.5}, "points": points}}})
    )
    return path


def test_allocation_index_and_selection(tmp_path: Path) -> None:
    assert _alloc_index(RAG.allocations, _doc(RAG.allocations[3])) == 3
    with pytest.raises(ValueError, match="not one of"):
        _alloc_index(RAG.allocations, _doc({"llama-3-8b": (9, 1, 1.0)}))
    run = orjson.loads(_run(tmp_path).read_bytes())
    chosen = selected(run, 0.8, 0.15)
    assert [(p["workflow"], p["load"], p["error"]) for p in chosen] == [("rag", 0.8, 1.0)]


def test_replications_measure_the_point_again(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert (
        main(
            [
                str(_run(tmp_path)),
                "--seeds",
                "2",
                "--requests",
                "150",
                "--workers",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = orjson.loads((out / "alp_seeds.json").read_bytes())
    assert report["label"] == "simulated"
    (point,) = report["points"]
    seeds = point["seed_means"]
    assert len(seeds) == 2 and all(0.5 < s < 30 for s in seeds) and seeds[0] != seeds[1]
    assert point["simulated"] == pytest.approx(sum(seeds) / 2)
    assert point["error"] == pytest.approx(abs(2.0 - point["simulated"]) / point["simulated"])
    assert point["run_error"] == 1.0

"""Runs merged into one report: whole series, the last-named run wins, sweeps must agree."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import orjson
import pytest

from bench.evaluation import evaluate
from bench.evaluation.merge import MergeError, merge_docs
from bench.evaluation.report import summarise

pytestmark = pytest.mark.timeout(60)

SWEEP = {"capacity": 2.0, "beam_rate": 0.0}


def _pt(system: str, gpus: int, rate: float, sustained: bool, latency: float) -> dict[str, Any]:
    return {
        "system": system,
        "workflow": "beam",
        "gpus": gpus,
        "rate": rate,
        "throughput": rate if sustained else rate / 2,
        "latency_mean": latency,
        "latency_p90": 2 * latency,
        "sustained": sustained,
        "label": "simulated",
    }


def _doc(command: str, points: list[dict[str, Any]], gpus: tuple[int, ...]) -> dict[str, Any]:
    return {
        "label": "simulated",
        "points": points,
        "sweeps": {"beam": {str(g): dict(SWEEP) for g in gpus}},
        "dynamic": None,
        "plots": [],
        "wall_s": 1.0,
        "meta": {"command": command, "wall_s": 1.0, "workers": 1, "rate_fractions": [0.5, 1.0]},
    }


def test_a_series_comes_whole_from_the_last_run_that_holds_it() -> None:
    main = _doc(
        "main",
        [_pt("scepsy", 4, 1.0, True, 1.0), _pt("hpa", 16, 1.0, True, 3.0)],
        (4, 16),
    )
    later = _doc(
        "later",
        [
            _pt("scepsy", 16, 1.0, True, 1.0),
            _pt("scepsy", 16, 2.0, True, 2.0),
            _pt("hpa", 16, 2.0, False, 9.0),
        ],
        (16,),
    )
    got = merge_docs([("a", main), ("b", later)])
    series: dict[tuple[int, str], list[tuple[float, int]]] = {}
    for p in got["points"]:
        series.setdefault((p["gpus"], p["system"]), []).append((p["rate"], p["run"]))
    assert series == {
        (4, "scepsy"): [(1.0, 0)],
        (16, "scepsy"): [(1.0, 1), (2.0, 1)],
        (16, "hpa"): [(2.0, 1)],  # the later run's series whole, not mixed with the first's
    }
    assert got["runs"][0]["series"] == [["beam", 4, "scepsy"]]
    assert got["runs"][1]["command"] == "later"
    assert set(got["sweeps"]["beam"]) == {"4", "16"}


def test_runs_on_different_rate_grids_do_not_merge() -> None:
    other = _doc("other", [_pt("scepsy", 4, 1.1, True, 1.0)], (4,))
    other["sweeps"]["beam"]["4"]["capacity"] = 2.2
    with pytest.raises(MergeError, match=r"sweeps\.beam\.4: b swept"):
        merge_docs([("a", _doc("main", [], (4,))), ("b", other)])


def test_a_cluster_without_scepsy_compares_nothing() -> None:
    summary, shortfalls = summarise([_pt("hpa", 16, 1.0, True, 3.0)])
    assert math.isnan(summary["beam"]["16"]["hpa"]["throughput_ratio_scepsy_over"])
    assert shortfalls == []  # no "higher peak than Scepsy's 0"


def test_report_only_merges_earlier_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main, later = tmp_path / "main", tmp_path / "later"
    for d, doc in (
        (
            main,
            _doc(
                "main", [_pt("scepsy", 4, 1.0, True, 1.0), _pt("hpa", 16, 1.0, True, 3.0)], (4, 16)
            ),
        ),
        (later, _doc("later", [_pt("scepsy", 16, 1.0, True, 1.0)], (16,))),
    ):
        d.mkdir()
        (d / "evaluation.json").write_bytes(orjson.dumps(doc))
    assert evaluate.main(["--out", str(main), "--report-only"]) == 0
    md_before = (main / "evaluation.md").read_text()
    assert "Scepsy was not run on 16 GPUs" in md_before
    assert evaluate.main(["--out", str(main), "--report-only", "--merge", str(later)]) == 0
    doc = orjson.loads((main / "evaluation.json").read_bytes())
    assert doc["summary"]["beam"]["16"]["hpa"]["throughput_ratio_scepsy_over"] == 1.0
    md = (main / "evaluation.md").read_text()
    assert "Scepsy was not run" not in md and f"`{later}`: `later` — beam 16 GPUs: scepsy" in md
    # the merged document keeps its provenance; merging it again would lose it
    assert evaluate.main(["--out", str(main), "--report-only"]) == 0
    assert "Merged report" in (main / "evaluation.md").read_text()
    assert evaluate.main(["--out", str(main), "--report-only", "--merge", str(later)]) == 2
    assert "already a merged report" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        evaluate.main(["--out", str(main), "--merge", str(later)])

"""The knee's bisection, bracket checks and interval (bench.evaluation.knee), on a fake verdict."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.evaluation import evaluate
from bench.evaluation.knee import (
    KNEE_FILE,
    TOLERANCE,
    UP_LIMIT,
    Bracket,
    grid_bracket,
    interval,
    knee_lines,
    merged_into,
    placeable,
    seek,
    verdict,
)
from tests.bench.evaluation.test_merge import _doc
from tests.bench.evaluation.test_merge import _pt as _run_pt

pytestmark = pytest.mark.timeout(60)

TOP = 10.0
GRID = [f * TOP for f in (0.2, 0.4, 0.6, 0.8, 0.9, 1.0, 1.2)]


def _pt(rate: float, sustained: bool, placed: bool = True) -> dict[str, object]:
    return {"rate": rate, "sustained": sustained, "placed": placed}


def test_a_series_that_never_placed_is_not_a_knee_of_zero() -> None:
    assert placeable([_pt(1.0, False), {**_pt(2.0, False), "unserved": ["m"]}])
    assert not placeable([{**_pt(r, False), "unserved": ["m"]} for r in GRID])
    assert not placeable([_pt(r, True, placed=False) for r in GRID])


def test_the_grid_bracket_is_the_highest_sustained_and_the_next_rate_not() -> None:
    pts = [_pt(r, r <= 8.0) for r in GRID]
    assert grid_bracket(pts) == Bracket(8.0, 9.0)
    # an unplaced point never counts as sustained (the report's rule)
    pts = [_pt(r, True, placed=r < 6.0) for r in GRID]
    assert grid_bracket(pts) == Bracket(4.0, 6.0)
    assert grid_bracket([_pt(r, False) for r in GRID]) == Bracket(0.0, 2.0)
    assert grid_bracket([_pt(r, True) for r in GRID]) == Bracket(12.0, math.inf)


@settings(max_examples=200, deadline=None)
@given(
    knee=st.floats(0.05 * TOP, UP_LIMIT * TOP * 0.95),
    grid_knee=st.floats(0.1 * TOP, 1.3 * TOP),
)
def test_bisection_brackets_the_true_knee_within_tolerance(knee: float, grid_knee: float) -> None:
    """The grid's seed put the knee at ``grid_knee``; this seed's is ``knee``: wherever it
    lies, the search ends with a bracket around it, 5% wide, without running a rate twice."""
    first = grid_bracket([_pt(r, r <= grid_knee) for r in GRID])
    runs: list[float] = []

    def check(rate: float) -> bool:
        runs.append(rate)
        return rate <= knee

    b, log, censored = seek(first, TOP, check)
    assert not censored
    assert b.lo <= knee < b.hi
    assert b.hi - b.lo <= TOLERANCE * b.hi
    assert len(set(runs)) == len(runs) == len(log)


def test_a_knee_above_the_limit_is_censored() -> None:
    b, log, censored = seek(Bracket(12.0, math.inf), TOP, lambda rate: True)
    assert censored and b.lo <= UP_LIMIT * TOP and not math.isfinite(b.hi)
    assert all(ok for _, ok in log)


def test_nothing_sustained_ends_at_zero() -> None:
    b, log, censored = seek(Bracket(0.0, 2.0), TOP, lambda rate: False)
    assert b.lo == 0.0 and not censored and len(log) < 20


def test_the_interval_is_the_mean_s_with_student_t() -> None:
    knees = [9.0, 10.0, 11.0]
    mean, lo, hi = interval(knees)
    half = 4.303 * statistics.stdev(knees) / math.sqrt(3)
    assert mean == 10.0 and lo == pytest.approx(10.0 - half) and hi == pytest.approx(10 + half)
    assert interval([5.0]) == (5.0, 5.0, 5.0)


def test_verdict_by_intervals() -> None:
    assert verdict((10.0, 9.5, 10.5), (8.0, 7.5, 9.0)) == "Scepsy ahead"
    assert verdict((8.0, 7.5, 9.0), (10.0, 9.5, 10.5)) == "Scepsy behind"
    assert verdict((10.0, 9.0, 11.0), (10.5, 10.0, 11.0)).startswith("tie")


def test_markdown_compares_each_system_with_scepsy() -> None:
    def row(system: str, knees: list[float], censored: bool = False) -> dict[str, object]:
        mean, lo, hi = interval(knees)
        return {
            "workflow": "beam",
            "gpus": 4,
            "system": system,
            "seeds": [{"knee": k} for k in knees],
            "mean": mean,
            "ci95": [lo, hi],
            "censored": censored,
        }

    rows = [row("scepsy", [3.0, 3.1, 3.05]), row("hpa", [2.0, 2.1, 2.2])]
    rows.append({**row("hpa_warm", [0.0, 0.0, 0.0]), "placeable": False})
    md = "\n".join(knee_lines({"series": rows, "commands": ["cmd"]}))
    assert "| beam | 4 | hpa_warm | n/a | n/a" in md
    assert "| beam | 4 | hpa | 2, 2.1, 2.2 | 2.1 [" in md and "Scepsy ahead" in md
    assert "`cmd`" in md


def test_the_evaluation_report_shows_knees_written_beside_it(tmp_path: Path) -> None:
    run = _doc("main", [_run_pt("scepsy", 4, 1.0, True, 1.0)], (4,))
    (tmp_path / "evaluation.json").write_bytes(orjson.dumps(run))
    mean, lo, hi = interval([2.0, 2.2, 2.1])
    knee = {
        "commands": ["python -m bench.evaluation.knee ..."],
        "series": [
            {
                "workflow": "beam",
                "gpus": 4,
                "system": "scepsy",
                "seeds": [{"knee": 2.0}, {"knee": 2.2}, {"knee": 2.1}],
                "mean": mean,
                "ci95": [lo, hi],
                "censored": False,
            }
        ],
    }
    (tmp_path / KNEE_FILE).write_bytes(orjson.dumps(knee))
    assert evaluate.main(["--out", str(tmp_path), "--report-only"]) == 0
    md = (tmp_path / "evaluation.md").read_text()
    assert "## Knees by bisection (simulated)" in md and "| beam | 4 | scepsy | 2, 2.2, 2.1 |" in md


def test_a_series_run_again_replaces_its_knees_and_the_others_stay(tmp_path: Path) -> None:
    def row(system: str, knee: float) -> dict[str, object]:
        return {"workflow": "beam", "gpus": 4, "system": system, "seeds": [{"knee": knee}]}

    first = merged_into(tmp_path / KNEE_FILE, [row("scepsy", 1.0), row("hpa", 0.5)], "one")
    (tmp_path / KNEE_FILE).write_bytes(orjson.dumps(first))
    doc = merged_into(tmp_path / KNEE_FILE, [row("scepsy", 2.0)], "two")
    by = {r["system"]: r for r in doc["series"]}
    assert by["scepsy"]["seeds"] == [{"knee": 2.0}] and by["scepsy"]["command"] == "two"
    assert by["hpa"]["command"] == "one" and doc["commands"] == ["one", "two"]

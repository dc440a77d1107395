"""The self-correction bench's pure figures: relative errors of a pass, the windows until a
workflow's prediction is within tolerance again, the decision log's reprofile rows."""

from __future__ import annotations

import math

import pytest

from bench.accuracy.self_correct import (
    PassRow,
    median_abs,
    rel_error,
    reprofile_rows,
    windows_until_recovered,
)

pytestmark = pytest.mark.timeout(10)


def _row(t: float, pred: float | None, obs: float | None, window_s: float = 20.0) -> PassRow:
    return PassRow(
        t=t,
        window_from=t - window_s,
        kind="hold",
        outcome=None,
        predicted={} if pred is None else {"rag": pred},
        observed={} if obs is None else {"rag": obs},
        requests={"rag": 30},
        planned=(),
        live=(),
        reasons=(),
    )


def test_rel_error_is_relative_to_the_observed_and_needs_both() -> None:
    assert rel_error(_row(30, 1.5, 1.0), "rag") == pytest.approx(0.5)
    assert rel_error(_row(30, 0.5, 1.0), "rag") == pytest.approx(-0.5)
    assert rel_error(_row(30, None, 1.0), "rag") is None
    assert rel_error(_row(30, 1.0, 0.0), "rag") is None
    assert rel_error(_row(30, 1.0, 1.0), "beam") is None
    assert rel_error(_row(30, math.inf, 1.0), "rag") == math.inf  # predicted overloaded: out


def test_windows_are_counted_from_the_first_one_starting_after_the_event() -> None:
    # restart at t=100: windows of 20 s; the pass at 110 straddles it, 120 is the first after
    rows = [
        _row(90, 1.0, 1.0),
        _row(110, 1.0, 1.6),
        _row(120, 1.0, 2.0),
        _row(125, 1.5, 2.0),
        _row(130, 1.9, 2.0),
        _row(135, 2.0, 2.0),
    ]
    got = windows_until_recovered(rows, "rag", since=100.0)
    assert got["windows"] == 4
    assert got["errors"] == [-0.5, -0.25, -0.05, 0.0]
    assert got["straddling"] == [-0.375]
    assert got["first_within"] == 3 and got["within_from"] == 3
    assert got["first_out"] == 1 and got["recovered_at"] == 3


def test_a_window_back_out_of_tolerance_moves_within_from_and_never_is_none() -> None:
    rows = [_row(t, p, 1.0) for t, p in ((120, 1.1), (125, 1.5), (130, 1.05), (135, 1.1))]
    got = windows_until_recovered(rows, "rag", since=100.0)
    assert got["first_within"] == 1 and got["within_from"] == 3
    assert got["first_out"] == 2 and got["recovered_at"] == 3
    never = [_row(t, 2.0, 1.0) for t in (120, 125, 130)]
    assert windows_until_recovered(never, "rag", 100.0) | {"errors": []} == {
        "windows": 3,
        "first_within": None,
        "first_out": 1,
        "recovered_at": None,
        "within_from": None,
        "errors": [],
        "straddling": [],
    }


def test_the_last_window_out_of_tolerance_means_not_recovered() -> None:
    rows = [_row(t, p, 1.0) for t, p in ((120, 1.0), (125, 1.0), (130, 1.4))]
    got = windows_until_recovered(rows, "rag", since=100.0)
    assert got["first_within"] == 1 and got["within_from"] is None


def test_median_abs_and_reprofile_rows() -> None:
    assert median_abs([-0.3, 0.1, 0.2]) == pytest.approx(0.2)
    assert median_abs([]) is None
    decisions = [
        {"t": 1000.0, "kind": "error", "outcome": None, "reasons": ["x"], "changes": []},
        {
            "t": 1010.0,
            "kind": "reprofile",
            "outcome": "started",
            "reasons": ["no_profile: m"],
            "changes": [{"model": "m"}],
        },
        {"t": 1050.5, "kind": "reprofile", "outcome": "ok: ...", "reasons": [], "changes": None},
    ]
    got = reprofile_rows(decisions, t0=1000.0)
    assert [(r["t"], r["outcome"]) for r in got] == [(10.0, "started"), (50.5, "ok: ...")]
    assert got[0]["change"] == {"model": "m"} and got[1]["change"] == {}

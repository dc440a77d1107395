"""bench.accuracy.alp_picks: the search's picks and the held-out set, judged apart (a smoke run)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson
import pytest

from bench.accuracy import pick_sets, picks_replay
from bench.accuracy.alp_picks import main
from optimizer.model.alp import Overlap, Pipeline, Stage
from optimizer.model.curves import ProfileBook
from optimizer.search import solve
from shared.profile_points import ProfilePoint

B1, G8 = "llama-3.2-1b", "llama-3-8b"
# Fan-out's profile points, read off a --quick run's simulated profiles (kept up: (calls/s,
# mean latency s); the last one overloaded: offered, achieved, latency), so that the smoke run
# profiles nothing and its predictions land near the simulated truth.
CURVES: dict[
    tuple[str, int, float], tuple[list[tuple[float, float]], tuple[float, float, float]]
] = {
    (G8, 1, 1.0): ([(0.4, 1.55), (3.07, 1.74), (7.15, 2.47), (12.66, 4.93)], (17.3, 14.1, 8.5)),
    (G8, 2, 1.0): ([(0.4, 1.14), (5.84, 1.28), (16.3, 2.14), (21.7, 3.3)], (26.1, 23.6, 4.7)),
    (B1, 1, 1.0): ([(0.54, 1.06), (8.0, 1.33), (17.4, 2.01), (24.6, 3.48)], (29.5, 26.2, 4.6)),
    (B1, 1, 0.5): ([(0.26, 1.31), (3.75, 2.01), (8.5, 2.91), (14.3, 6.41)], (17.5, 13.7, 7.0)),
}
# What the daemon's reprofiler measures for the held-out 0.75 8B (no fractional share of the
# 8B is in the fitted set): alone on its GPU
REPROFILED = {
    (G8, 1, 0.75): ([(0.4, 1.62), (2.5, 1.85), (5.8, 2.7), (10.0, 5.2)], (14.0, 11.5, 8.8)),
}


def _point(
    key: tuple[str, int, float], offered: float, got: float, lat: float, alone: bool = False
) -> ProfilePoint:
    m, tp, share = key
    return ProfilePoint(
        m,
        "sim-engine",
        "a6000",
        tp,
        share,
        offered,
        got,
        lat,
        lat,
        lat,
        lat,
        0.05,
        1000,
        colocation="alone" if alone else "",
    )


def _points(curves: dict[Any, Any] = CURVES, alone: bool = False) -> list[ProfilePoint]:
    out = []
    for key, (kept, (offered, got, lat)) in curves.items():
        out += [_point(key, r, r, lat, alone) for r, lat in kept]
        out.append(_point(key, offered, got, lat, alone))
    return out


def _book() -> ProfileBook:
    return ProfileBook(_points())


PIPE = Pipeline("fanout", (Stage(B1, 2.5, 2.0), Stage(G8, 2.5, 2.0)), overlap=0.8)


@pytest.mark.timeout(30)
def test_search_picks_are_the_searchs_own_and_distinct() -> None:
    book = _book()
    picks = pick_sets.search_picks(PIPE, book, (4,), (0.3, 0.31, 0.9))
    top = pick_sets.max_feasible_rate(PIPE, book, 4)
    seen = []
    for p in picks:
        for at in p.picked_at:
            assert at["gpus"] == 4 and at["max_feasible_rate"] == pytest.approx(top)
            direct = solve.search_and_place(pick_sets.problem(PIPE, book, 4, at["rate"]))
            assert pick_sets.as_alloc(direct.result.workflows[0].allocation) == p.allocation
            seen.append(at["rate_fraction"])
    assert sorted(seen) == [0.3, 0.31, 0.9]  # every rate placed, each pick listed once
    assert len({tuple(sorted(p.allocation.items())) for p in picks}) == len(picks)


@pytest.mark.timeout(30)
def test_provenance_names_scaled_curves() -> None:
    got = pick_sets.provenance(_book(), {B1: (1, 1, 0.25), G8: (1, 1, 0.75)})
    assert got[B1]["curve"] == "scaled" and got[B1]["scaled_from"] == 0.5
    assert got[G8]["curve"] == "scaled" and got[G8]["scaled_from"] == 1.0
    assert pick_sets.provenance(_book(), {B1: (2, 1, 0.5)})[B1]["curve"] == "measured"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_smoke_run_reports_the_sets_apart(tmp_path: Path) -> None:
    profiles = tmp_path / "profiles.json"
    profiles.write_bytes(
        orjson.dumps(
            {
                "profile_points": [
                    {"workflow": "fanout", **asdict(p)}
                    for p in _points() + _points(REPROFILED, alone=True)
                ]
            }
        )
    )
    out = tmp_path / "out"
    argv = ["--out", str(out), "--quick", "--workflows", "fanout", "--workers", "1"]
    argv += ["--profiles-from", str(profiles), "--sizes", "4", "--rate-fractions", "0.5"]
    assert main([*argv, "--held-out", "1", "--loads", "0.4"]) == 0
    report: dict[str, Any] = orjson.loads((out / "alp_picks.json").read_bytes())
    assert report["label"] == "simulated"
    assert set(report["sets"]) == {"search_picks", "held_out"}
    assert set(report["summary"]) == {"search_picks", "held_out"} | {
        "search_picks_borrowed",
        "held_out_borrowed",
    }
    for s in ("search_picks", "held_out"):
        summary = report["summary"][s]["fanout"]
        assert summary["allocations"] == 1 and summary["latency_points"] == 1
        for k in ("throughput_error", "latency_error"):
            assert 0 <= summary[f"{k}_median"] <= summary[f"{k}_max"]
        (doc,) = report["sets"][s]["fanout"]
        assert doc["throughput"]["simulated"] > 0 and doc["latency"][0]["load"] == 0.4
        assert doc["throughput"]["predicted_low"] <= doc["throughput"]["predicted"]
        assert doc["latency"][0]["predicted_high"] >= doc["latency"][0]["predicted"]
        assert 0 <= summary["latency_within_band"] <= 1
        assert set(doc["curves"]) == set(doc["stage_check"]["models"]) == {B1, G8}
    held = report["sets"]["held_out"]["fanout"][0]
    assert held["curves"][B1]["curve"] == "scaled"  # 0.25 of a model profiled at 0.5 and 1.0
    # the 8B's 0.75 borrowed the 1B's exponents: the daemon's reprofiler profiles it (reused
    # here), and the fitted-set-only prediction is reported beside, on the same truth
    assert report["reprofiled_keys"] == [["fanout", G8, 1, 0.75, "alone"]]
    assert held["curves"][G8]["curve"] == "measured"
    assert held["borrowed"]["curves"][G8]["curve"] == "scaled"
    assert held["borrowed"]["throughput"]["predicted"] != held["throughput"]["predicted"]
    assert report["summary"]["held_out_borrowed"]["fanout"]["allocations"] == 1
    # the pick is what the search returns for the recorded pipeline, book and rate
    pick = report["sets"]["search_picks"]["fanout"][0]
    (at,) = pick["picked_at"]
    doc_pipe = report["pipelines"]["fanout"]
    pipe = Pipeline(
        "fanout",
        tuple(Stage(**st) for st in doc_pipe["stages"]),
        doc_pipe["overlap"],
        doc_pipe["tool_time"],
        tuple(Overlap(**o) for o in doc_pipe["overlaps"]),
    )
    direct = solve.search_and_place(pick_sets.problem(pipe, _book(), 4, at["rate"]))
    want = pick_sets.as_alloc(direct.result.workflows[0].allocation)
    assert {m: (a["replicas"], a["tp"], a["share"]) for m, a in pick["allocation"].items()} == want
    # the replay rebuilds the run's pipeline and book: today's predictions are the run's
    replayed = picks_replay.replay(out / "alp_picks.json")
    for row in replayed["points"]:
        assert row["throughput"][1] == pytest.approx(row["throughput"][0], rel=1e-9)
        for _, then, now in row["latency"]:
            assert now == pytest.approx(then, rel=1e-9)
    assert len(replayed["points"]) == 2

"""bench.accuracy.alp_replay: an accuracy run's points predicted again from its own JSON."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson
import pytest

from bench.accuracy.alp_replay import main, pipeline_of, replay
from optimizer.model.alp import ModelAlloc, Overlap, Pipeline, predict
from optimizer.model.curves import ProfileBook
from shared.profile_points import ProfilePoint

pytestmark = pytest.mark.timeout(30)


def _points(model: str, saturation: float, light: float) -> list[ProfilePoint]:
    out = []
    for f in (0.2, 0.5, 0.8, 1.0):
        lat = light / (1.0 - 0.9 * f)  # convex, finite at the last point
        out.append(
            ProfilePoint(
                model=model,
                engine="e",
                gpu_type="g",
                tp=1,
                share=1.0,
                offered_rate=f * saturation,
                throughput=f * saturation,
                lat_mean=lat,
                lat_p50=lat,
                lat_p90=2 * lat,
                lat_p99=3 * lat,
                ttft_mean=0.1,
                n_calls=500,
            )
        )
    return out


TRACE: dict[str, Any] = {
    "overlap_factor": 0.8,
    "tool_time_mean_s": 0.5,
    "overlaps": [{"a": "a", "b": "b", "coupling": 1.3, "together_s": 0.4}],
    # p_agg is what the run predicted with; p (the paper's) differs, so a replay that took it
    # would predict other latencies
    "models": {"a": {"n": 4.0, "p": 1.0, "p_agg": 2.0}, "b": {"n": 1.0, "p": 1.0, "p_agg": 1.0}},
}


def _run(tmp_path: Path) -> Path:
    points = _points("a", 40.0, 1.0) + _points("b", 6.0, 2.0)
    pipe = Pipeline.from_figures(
        "w", {"a": (4.0, 2.0), "b": (1.0, 1.0)}, 0.8, 0.5, [Overlap("a", "b", 1.3)]
    )
    book = ProfileBook(points)
    doc_points = []
    for replicas in (1, 2):
        alloc = {"a": ModelAlloc(1), "b": ModelAlloc(replicas)}
        alloc_doc = {
            m: {"replicas": a.replicas, "tp": a.tp, "share": a.share} for m, a in alloc.items()
        }
        cap = predict(pipe, book, alloc, 0.0).throughput
        # the "simulation" reads 10% above every prediction
        doc_points.append(
            {
                "allocation": alloc_doc,
                "kind": "max_throughput",
                "predicted": cap,
                "simulated": 1.1 * cap,
            }
        )
        for load in (0.4, 0.8, 0.9):
            lat = predict(pipe, book, alloc, load * cap).latency
            doc_points.append(
                {
                    "allocation": alloc_doc,
                    "kind": "mean_latency",
                    "load": load,
                    "rate": load * cap,
                    "predicted": lat,
                    "simulated": 1.1 * lat,
                }
            )
    run = tmp_path / "alp_accuracy.json"
    run.write_bytes(
        orjson.dumps(
            {
                "summary": {"w": {"throughput_error_max": 1 / 11}},
                "workflows": {"w": {"trace": TRACE, "points": doc_points}},
                "profile_points": [{"workflow": "w", **asdict(p)} for p in points],
            }
        )
    )
    return run


def test_pipeline_of_a_trace_section_is_the_ratio_of_totals_one() -> None:
    pipe = pipeline_of("w", TRACE)
    assert [(s.model, s.n, s.p) for s in pipe.stages] == [("a", 4.0, 2.0), ("b", 1.0, 1.0)]
    assert (pipe.overlap, pipe.tool_time) == (0.8, 0.5)
    assert pipe.overlaps == (Overlap("a", "b", 1.3),)
    odd = {
        **TRACE,
        "overlap_factor": float("nan"),
        "tool_time_mean_s": -1.0,
        "models": {"a": {"n": 2.0, "p": 1.0, "p_agg": 0.5}},
    }
    pipe = pipeline_of("w", odd)
    assert (pipe.stages[0].p, pipe.overlap, pipe.tool_time) == (1.0, 1.0, 0.0)
    assert pipe.overlaps == ()  # b has no stage
    older = {k: v for k, v in TRACE.items() if k != "overlaps"}  # runs before the pairs
    assert pipeline_of("w", older).overlaps == ()


def test_replay_reproduces_the_run_and_scores_it(tmp_path: Path) -> None:
    run = _run(tmp_path)
    out = replay(run)
    points = out["points"]["w"]
    assert len(points) == 8
    for p in points:
        assert p["predicted"] == pytest.approx(p["predicted_then"], rel=1e-12)
        assert p["error"] == pytest.approx(1 / 11, rel=1e-9)
    summary = out["summary"]["w"]
    assert summary["throughput_error_max"] == pytest.approx(1 / 11)
    assert summary["latency_error_max"] == pytest.approx(1 / 11)
    assert out["run_summary"] == {"w": {"throughput_error_max": 1 / 11}}
    assert out["label"] == "simulated"


def test_main_writes_the_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path)
    assert main([str(run), "--out", str(tmp_path / "out"), "--points"]) == 0
    printed = capsys.readouterr().out
    assert "max_throughput a:1x1x1 b:2x1x1" in printed
    written = orjson.loads((tmp_path / "out" / "alp_replay.json").read_bytes())
    assert written["summary"]["w"]["latency_error_mean"] == pytest.approx(1 / 11)


def test_the_committed_full_run_replays_to_its_own_summary() -> None:
    """The current ALP predicts the committed accuracy run's points as that run did: every
    summary figure equal to twelve digits (a refactor that changes a prediction fails; the
    last digit of a float sum may differ between CPUs, as numpy's vector width does)."""
    run = Path(__file__).resolve().parents[3] / "bench" / "results" / "alp_accuracy_full.json"
    out = replay(run)
    assert out["summary"]
    for workflow, figures in out["summary"].items():
        then = out["run_summary"][workflow]
        assert {k: then[k] for k in figures} == pytest.approx(figures, rel=1e-12), workflow


def _edit(run: Path, kind: str, factor: float) -> bytes:
    """The run as an older ALP would have written it: ``kind``'s predictions x ``factor``."""
    report = orjson.loads(run.read_bytes())
    for p in report["workflows"]["w"]["points"]:
        if p["kind"] == kind:
            p["predicted"] *= factor
    run.write_bytes(orjson.dumps(report))
    return run.read_bytes()


def test_rewrite_takes_the_new_predictions_and_keeps_every_simulated_figure(
    tmp_path: Path,
) -> None:
    run = _run(tmp_path)
    simulated = [p["simulated"] for p in orjson.loads(run.read_bytes())["workflows"]["w"]["points"]]
    _edit(run, "mean_latency", 2.0)  # latency predicted 2x by an older ALP
    assert main([str(run), "--rewrite"]) == 0
    report = orjson.loads(run.read_bytes())
    points = report["workflows"]["w"]["points"]
    assert [p["simulated"] for p in points] == simulated
    for p in points:
        assert p["predicted"] == pytest.approx(p["simulated"] / 1.1, rel=1e-12)
    latency = [p for p in points if p["kind"] == "mean_latency"]
    assert all(p["error"] == pytest.approx(1 / 11) for p in latency)
    assert all("predicted_without_pooling" in p for p in latency)
    assert report["summary"]["w"]["latency_error_max"] == pytest.approx(1 / 11)
    assert "alp_replay --rewrite" in report["predictions_replayed"]
    # and the rewritten run replays to its own summary, as the committed one must
    again = replay(run)
    assert {k: again["run_summary"]["w"][k] for k in again["summary"]["w"]} == again["summary"]["w"]


def test_rewrite_is_refused_where_a_capacity_prediction_moved(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run(tmp_path)
    before = _edit(run, "max_throughput", 1.5)  # T_w moved: the latency rates would too
    assert main([str(run), "--rewrite"]) == 1
    assert "predicted max throughput moved" in capsys.readouterr().err
    assert run.read_bytes() == before

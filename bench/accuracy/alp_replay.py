"""Benchmark: today's Aggregate LLM Pipeline against an earlier accuracy run's simulations.

``python -m bench.accuracy.alp_replay RUN/alp_accuracy.json [--out DIR] [--points]`` rebuilds each
workflow's pipeline from the run's trace statistics (``Pipeline.from_figures``) and its
profile book from the run's profile points, predicts every point of the run again with the
current ``optimizer.model.alp``, and prints the errors against the run's simulated figures, per
workflow in ``bench.accuracy.alp_accuracy``'s summary shape beside the run's own summary (``--out``:
also ``DIR/alp_replay.json``; ``--points``: every point's old and new prediction).

Role: a full accuracy run simulates for about 90 minutes on two cores; the simulated side of
its points does not depend on the pipeline, so a change to the pipeline can be judged in
seconds on the same points. What it cannot judge is a change to profiling or to the
simulator: those need a new run (``bench.accuracy.alp_accuracy --profiles-from`` keeps the profiles).

Invariants: reads only the run's JSON; every figure compared is the earlier run's, and
*simulated*; the errors are relative to the simulation, as in the accuracy bench.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from bench.accuracy.alp_accuracy import (
    LATENCY_LOAD_MAX,
    TARGETS,
    _err,
    _reused_points,
    error_summary,
)
from optimizer.model.alp import ModelAlloc, Overlap, Pipeline, predict
from optimizer.model.curves import ProfileBook
from shared.profile_points import ProfilePoint


def pipeline_of(workflow: str, trace: dict[str, Any]) -> Pipeline:
    """The pipeline the run predicted with, from its ``trace`` section (ratio-of-totals p)."""
    return Pipeline.from_figures(
        workflow,
        {m: (s["n"], s["p_agg"]) for m, s in trace["models"].items()},
        overlap=trace["overlap_factor"],
        tool_time=trace["tool_time_mean_s"],
        overlaps=[Overlap(o["a"], o["b"], o["coupling"]) for o in trace.get("overlaps", [])],
    )


def books_of(run: Path) -> dict[str, ProfileBook]:
    """Per workflow, the profile book of the run's profile points."""
    by_workflow: dict[str, list[ProfilePoint]] = {}
    for (workflow, *_), points in _reused_points(run).items():
        by_workflow.setdefault(workflow, []).extend(points)
    return {w: ProfileBook(points) for w, points in by_workflow.items()}


def _allocation(doc: dict[str, dict[str, float]]) -> dict[str, ModelAlloc]:
    return {
        m: ModelAlloc(int(a["replicas"]), int(a["tp"]), float(a["share"])) for m, a in doc.items()
    }


def replay(run: Path) -> dict[str, Any]:
    """Every point of ``run`` predicted again, with per-workflow summaries (new and the
    run's own)."""
    report = orjson.loads(run.read_bytes())
    books = books_of(run)
    out: dict[str, Any] = {
        "label": "simulated",
        "replayed": str(run),
        "targets": TARGETS,
        "summary": {},
        "run_summary": report["summary"],
        "points": {},
    }
    for workflow, doc in report["workflows"].items():
        pipe, book = pipeline_of(workflow, doc["trace"]), books[workflow]
        thr_errors: list[float] = []
        lat_errors: list[float] = []
        points = []
        for p in doc["points"]:
            allocation = _allocation(p["allocation"])
            if p["kind"] == "max_throughput":
                new = predict(pipe, book, allocation, 0.0).throughput
                thr_errors.append(_err(new, p["simulated"]))
            else:
                new = predict(pipe, book, allocation, p["rate"]).latency
                if p["load"] <= LATENCY_LOAD_MAX + 1e-9:
                    lat_errors.append(_err(new, p["simulated"]))
            points.append(
                {
                    "allocation": p["allocation"],
                    "kind": p["kind"],
                    "load": p.get("load", 1.0),
                    "simulated": p["simulated"],
                    "predicted_then": p["predicted"],
                    "predicted": new,
                    "error": _err(new, p["simulated"]),
                }
            )
        out["summary"][workflow] = error_summary(thr_errors, lat_errors)
        out["points"][workflow] = points
    return out


def _tag(allocation: dict[str, dict[str, float]]) -> str:
    return " ".join(
        f"{m}:{a['replicas']:g}x{a['tp']:g}x{a['share']:g}" for m, a in allocation.items()
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="an earlier run's alp_accuracy.json")
    ap.add_argument("--out", type=Path, help="also write DIR/alp_replay.json")
    ap.add_argument("--points", action="store_true", help="print every point")
    args = ap.parse_args(argv)
    out = replay(args.run)
    if args.points:
        for workflow, points in out["points"].items():
            for p in points:
                print(
                    f"{workflow} {p['kind']} {_tag(p['allocation'])} load {p['load']:.1f}: "
                    f"simulated {p['simulated']:.4g}, predicted {p['predicted_then']:.4g} "
                    f"then, {p['predicted']:.4g} now (error {p['error']:.3f})"
                )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "alp_replay.json").write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2))
    print(
        orjson.dumps(
            {k: out[k] for k in ("label", "replayed", "summary", "run_summary")},
            option=orjson.OPT_INDENT_2,
        ).decode()
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

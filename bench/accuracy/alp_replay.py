"""Benchmark: today's Aggregate LLM Pipeline against an earlier accuracy run's simulations.

``python -m bench.accuracy.alp_replay RUN/alp_accuracy.json [--out DIR] [--points]`` rebuilds each
workflow's pipeline from the run's trace statistics (``Pipeline.from_figures``) and its
profile book from the run's profile points, predicts every point of the run again with the
current ``optimizer.model.alp``, and prints the errors against the run's simulated figures, per
workflow in ``bench.accuracy.alp_accuracy``'s summary shape beside the run's own summary (``--out``:
also ``DIR/alp_replay.json``; ``--points``: every point's old and new prediction;
``--rewrite``: the run's file itself takes the new predictions and summary, see below).

Role: a full accuracy run simulates for about 90 minutes on two cores; the simulated side of
its points does not depend on the pipeline, so a change to the pipeline can be judged in
seconds on the same points. What it cannot judge is a change to profiling or to the
simulator: those need a new run (``bench.accuracy.alp_accuracy --profiles-from`` keeps the profiles).

Invariants: reads only the run's JSON; every figure compared is the earlier run's, and
*simulated*; the errors are relative to the simulation, as in the accuracy bench.
``--rewrite`` changes only predictions, their errors and the summary, and refuses (exit 1)
where a capacity prediction moved: the run's latency points were simulated at fractions of
its predicted ``T_w``, so with ``T_w`` unchanged a new full run would simulate exactly the
same points (same rates, same seeds) and the rewritten file is what it would write; with
``T_w`` moved only a new run says.
"""

from __future__ import annotations

import argparse
import math
import sys
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
    return {m: ModelAlloc.from_doc(a) for m, a in doc.items()}


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
        paper_errors: list[float] = []
        points = []
        for p in doc["points"]:
            allocation = _allocation(p["allocation"])
            point: dict[str, Any] = {}
            if p["kind"] == "max_throughput":
                new = predict(pipe, book, allocation, 0.0).throughput
                thr_errors.append(_err(new, p["simulated"]))
            else:
                new = predict(pipe, book, allocation, p["rate"]).latency
                paper = predict(pipe, book, allocation, p["rate"], pooling=False).latency
                point["predicted_without_pooling"] = paper
                if p["load"] <= LATENCY_LOAD_MAX + 1e-9:
                    lat_errors.append(_err(new, p["simulated"]))
                    paper_errors.append(_err(paper, p["simulated"]))
            points.append(
                {
                    "allocation": p["allocation"],
                    "kind": p["kind"],
                    "load": p.get("load", 1.0),
                    "simulated": p["simulated"],
                    "predicted_then": p["predicted"],
                    "predicted": new,
                    "error": _err(new, p["simulated"]),
                    **point,
                }
            )
        out["summary"][workflow] = error_summary(thr_errors, lat_errors) | {
            "latency_error_max_without_pooling": max(paper_errors, default=float("nan"))
        }
        out["points"][workflow] = points
    return out


def rewrite(run: Path, replayed: dict[str, Any]) -> str | None:
    """Write ``replayed``'s predictions, errors and summary into ``run`` (module docstring);
    why not, where a capacity prediction moved."""
    report = orjson.loads(run.read_bytes())
    for workflow, doc in report["workflows"].items():
        for p, new in zip(doc["points"], replayed["points"][workflow], strict=True):
            if p["kind"] == "max_throughput" and not math.isclose(
                p["predicted"], new["predicted"], rel_tol=1e-9
            ):
                return (
                    f"{workflow}: predicted max throughput moved ({p['predicted']:.6g} -> "
                    f"{new['predicted']:.6g}), so the latency points' rates would too: run the "
                    "accuracy bench again (bench.accuracy.alp_accuracy --profiles-from)"
                )
            for key in ("predicted", "error", "predicted_without_pooling"):
                if key in new:
                    p[key] = new[key]
        report["summary"][workflow] |= replayed["summary"][workflow]
    report["predictions_replayed"] = (
        "predictions, errors and summary by bench.accuracy.alp_replay --rewrite with a later "
        "ALP; every simulated figure is the run's own"
    )
    run.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    return None


def _tag(allocation: dict[str, dict[str, float]]) -> str:
    return " ".join(
        f"{m}:{a['replicas']:g}x{a['tp']:g}x{a['share']:g}" for m, a in allocation.items()
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="an earlier run's alp_accuracy.json")
    ap.add_argument("--out", type=Path, help="also write DIR/alp_replay.json")
    ap.add_argument("--points", action="store_true", help="print every point")
    ap.add_argument(
        "--rewrite",
        action="store_true",
        help="write the new predictions and summary into RUN (refused where T_w moved)",
    )
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
    if args.rewrite and (why := rewrite(args.run, out)) is not None:
        print(f"alp_replay: not rewritten: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

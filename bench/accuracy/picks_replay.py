"""Benchmark: today's ALP on an earlier picks run's simulated truth.

``python -m bench.accuracy.picks_replay RUN/alp_picks.json [--points]`` rebuilds each
workflow's pipeline (the run's ``pipelines``) and profile book (its ``profile_points``: the
fitted set's keys and the ones the reprofiler measured), predicts every judged allocation
again as :mod:`bench.accuracy.alp_picks` does (where the simulator places it, each model
between its alone and packed curves), and prints per set and workflow the run's summary and
today's (``--points``: every figure's old and new signed error).

Role: a picks run simulates for most of an hour; its simulated side does not depend on the
predictor, so a change to the model can be judged on the same truth in a second. It judges
capacities exactly and latencies at the run's rates (a new run would simulate its latency
points at fractions of the new ``T_w``); it cannot judge a change to profiling or to the
simulator. Every figure is *simulated*, as in the run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from bench.accuracy.alp_accuracy import LATENCY_LOAD_MAX, _cases, _reused_points
from bench.accuracy.cases import Alloc
from bench.accuracy.pick_knowledge import Learned
from bench.accuracy.pick_report import relative_error, summary
from optimizer.model.alp import ModelAlloc, Overlap, Pipeline, Stage
from optimizer.model.curves import ProfileBook
from shared.profile_points import ProfilePoint

__all__ = ["alloc_of", "learned_of", "replay"]


def alloc_of(doc: dict[str, float]) -> tuple[int, int, float, int, float]:
    """One model's row of an allocation document (``ModelAlloc.doc``)."""
    a = ModelAlloc.from_doc(doc)
    return a.replicas, a.tp, a.share, a.rest, a.rest_share


def learned_of(run: Path, report: dict[str, Any]) -> dict[str, Learned]:
    """Per workflow, the pipeline and profile book ``run`` predicted with."""
    cases = {c.workflow: c for c in _cases()}
    points: dict[str, list[ProfilePoint]] = {}
    for (workflow, *_), pts in _reused_points(run).items():
        points.setdefault(workflow, []).extend(pts)
    out = {}
    for workflow, doc in report["pipelines"].items():
        pipe = Pipeline(
            workflow,
            tuple(Stage(**st) for st in doc["stages"]),
            doc["overlap"],
            doc["tool_time"],
            tuple(Overlap(**o) for o in doc["overlaps"]),
        )
        every = tuple(points.get(workflow, ()))
        # the settle time only shapes new simulations: unused here
        out[workflow] = Learned(cases[workflow], pipe, ProfileBook(every), 0.0, every)
    return out


def replay(run: Path) -> dict[str, Any]:
    """The run's summary and today's, per set and workflow, and every figure's errors."""
    report = orjson.loads(run.read_bytes())
    learned = learned_of(run, report)
    out: dict[str, Any] = {"label": "simulated", "replayed": str(run), "summary": {}}
    points: list[dict[str, Any]] = []
    for name, by_workflow in report["sets"].items():
        for workflow, docs in by_workflow.items():
            k = learned[workflow]
            thr_errors: list[float] = []
            lat_errors: list[float] = []
            for doc in docs:
                alloc: Alloc = {m: alloc_of(a) for m, a in doc["allocation"].items()}
                sim = doc["throughput"]["simulated"]
                cap = k.predict(alloc, None).throughput
                thr_errors.append(relative_error(cap, sim))
                row = {
                    "set": name,
                    "workflow": workflow,
                    "allocation": doc["allocation"],
                    "throughput": [doc["throughput"]["signed_error"], (cap - sim) / sim],
                    "latency": [],
                }
                for p in doc["latency"]:
                    new = (k.predict(alloc, p["rate"]).latency - p["simulated"]) / p["simulated"]
                    if p["load"] <= LATENCY_LOAD_MAX + 1e-9:
                        lat_errors.append(abs(new))
                    row["latency"].append([p["load"], p["signed_error"], new])
                points.append(row)
            out["summary"].setdefault(name, {})[workflow] = {
                "run": {
                    k_: v
                    for k_, v in report["summary"][name][workflow].items()
                    if k_.endswith(("_max", "_median"))
                },
                "now": summary(thr_errors, lat_errors),
            }
    out["points"] = points
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="an earlier run's alp_picks.json")
    ap.add_argument("--points", action="store_true", help="print every figure too")
    args = ap.parse_args(argv)
    got = replay(args.run)
    if not args.points:
        del got["points"]
    sys.stdout.write(orjson.dumps(got, option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark: how far an accuracy run's simulated mean latencies move with seed and length.

``python -m bench.accuracy.alp_seeds RUN/alp_accuracy.json [--load 0.8] [--min-error 0.15]
[--seeds 4] [--requests 20000] [--workflows W ...] [--out DIR]`` takes the run's mean-latency points at ``--load``
whose error was above ``--min-error``, simulates each again over ``--seeds`` independent
seeds of ``--requests`` arrivals (the first seed is the run's own, so its longer run extends
the same arrivals), and prints each seed's mean, their mean with its across-seed standard
error, and the prediction's error against that mean beside the run's.

Role: near capacity a mean latency converges slowly, and a batch-means standard error from one
run under-reads when the queue's excursions outlast its batches; independent replications
do not share that bias. This says whether a miss of ``bench.accuracy.alp_accuracy`` is the pipeline's
or the ground truth's, for the few points worth the cost. Every figure is *simulated*.

Invariants: reads only the run's JSON and ``bench.accuracy.alp_accuracy``'s cases; each replication
is ``bench.accuracy.alp_truth.latency_run`` (its warm-up from ``latency_warmup``), so it measures
exactly as the accuracy bench does, only longer and more than once.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson

from bench.accuracy.alp_accuracy import FRACTIONS, SETTLE_LATENCIES, _cases, latency_seed
from bench.accuracy.alp_truth import (
    EvalJob,
    across_seeds,
    latency_run,
    latency_warmup,
    replication_seed,
)
from bench.accuracy.cases import Alloc
from optimizer.model.alp import ModelAlloc


def _alloc_index(case_allocations: Sequence[Alloc], doc: dict[str, dict[str, float]]) -> int:
    def key(a: ModelAlloc) -> tuple[int, int, float, int, float]:
        return a.replicas, a.tp, round(a.share, 6), a.rest, round(a.rest_share, 6)

    wanted = {m: key(ModelAlloc.from_doc(a)) for m, a in doc.items()}
    for i, alloc in enumerate(case_allocations):
        if {m: key(ModelAlloc(*row)) for m, row in alloc.items()} == wanted:
            return i
    raise ValueError(f"allocation {wanted} is not one of the bench's")


def replication_mean(job: EvalJob, n: int, mean_hint: float = math.nan) -> float:
    """One replication's mean latency over ``n`` arrivals, warmed up as the accuracy bench
    warms a run after reading ``mean_hint`` (NaN: as its first run)."""
    return latency_run(job, n, latency_warmup(job, n, mean_hint)).mean


def seed_summary(predicted: float, seeds: Sequence[float]) -> dict[str, Any]:
    """Replications' means, their mean and its across-seed standard error, and the
    prediction's relative error against that mean."""
    mean, se = across_seeds(seeds)
    return {
        "seed_means": list(seeds),
        "simulated": mean,
        "simulated_se": se,
        "error": abs(predicted - mean) / mean,
    }


def selected(run: dict[str, Any], load: float, min_error: float) -> list[dict[str, Any]]:
    """The run's mean-latency points at ``load`` with an error above ``min_error``, each with
    its workflow."""
    return [
        {"workflow": w, **p}
        for w, doc in run["workflows"].items()
        for p in doc["points"]
        if p["kind"] == "mean_latency" and abs(p["load"] - load) < 1e-9 and p["error"] > min_error
    ]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="an earlier run's alp_accuracy.json")
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--min-error", type=float, default=0.15)
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--workflows", nargs="*", help="only these workflows (default: all)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, help="also write DIR/alp_seeds.json")
    args = ap.parse_args(argv)
    run = orjson.loads(args.run.read_bytes())
    cases = {c.workflow: c for c in _cases()}
    points = [
        p
        for p in selected(run, args.load, args.min_error)
        if not args.workflows or p["workflow"] in args.workflows
    ]
    jobs: list[tuple[EvalJob, int, float]] = []
    for p in points:
        case = cases[p["workflow"]]
        index = _alloc_index(case.allocations, p["allocation"])
        # the run's seed for this point first, then others
        k = min(range(len(FRACTIONS)), key=lambda j: abs(FRACTIONS[j] - p["load"]))
        settle = SETTLE_LATENCIES * run["workflows"][p["workflow"]]["trace"]["latency_mean_s"]
        for s in range(args.seeds):
            job = EvalJob(
                case, index, p["load"], "latency", p["rate"], latency_seed(index, k), settle
            )
            jobs.append(
                (replace(job, seed=replication_seed(job, s)), args.requests, p["simulated"])
            )
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        means = list(pool.map(replication_mean, *zip(*jobs, strict=True))) if jobs else []
    report: dict[str, Any] = {
        "label": "simulated",
        "run": str(args.run),
        "requests": args.requests,
        "points": [],
    }
    for i, p in enumerate(points):
        report["points"].append(
            {
                "workflow": p["workflow"],
                "allocation": p["allocation"],
                "load": p["load"],
                "rate": p["rate"],
                "predicted": p["predicted"],
                "run_simulated": p["simulated"],
                "run_simulated_se": p["simulated_se"],
                "run_requests": p["requests"],
                "run_error": p["error"],
                **seed_summary(p["predicted"], means[i * args.seeds : (i + 1) * args.seeds]),
            }
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "alp_seeds.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark: a few allocations' latency at a load of their capacity, predicted from a fresh
trace and an earlier run's profiles, against long simulations over several seeds.

``python -m bench.accuracy.alp_point_check RUN/alp_accuracy.json --workflow beam [--allocations 1 3 5 7]
[--load 0.8] [--trace-requests 3000] [--seeds 2] [--requests 8000]`` traces the workflow
afresh (``bench.accuracy.alp_accuracy._trace`` with ``--trace-requests`` requests: the statistics'
production path), builds its pipeline from those statistics and its profile book from the
run's profile points, and for each chosen allocation of the bench predicts the capacity,
then the mean latency at ``--load`` of it, and simulates that rate over ``--seeds``
replications of ``--requests`` arrivals (``bench.accuracy.alp_truth.latency_run``).

Role: a change to the statistics (a larger trace, a better ``n_m``) moves every point's rate,
so ``bench.accuracy.alp_replay`` cannot judge it at the old points' loads; this judges a handful of
points at the new loads without the 90-minute full run. Every figure is *simulated*.

Invariants: reads only the run's JSON and the bench's cases; each replication has its own
seed; prints one JSON document.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson

from bench.accuracy.alp_accuracy import SETTLE_LATENCIES, _cases, _trace
from bench.accuracy.alp_replay import books_of
from bench.accuracy.alp_seeds import replication_mean, seed_summary
from bench.accuracy.alp_truth import EvalJob
from optimizer.model.alp import ModelAlloc, Pipeline, predict


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="an earlier run's alp_accuracy.json (profiles)")
    ap.add_argument("--workflow", required=True, choices=[c.workflow for c in _cases()])
    ap.add_argument("--allocations", type=int, nargs="*", help="indices (default: all)")
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--trace-requests", type=int, default=3000)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=8000)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    case = next(c for c in _cases() if c.workflow == args.workflow)
    indices = args.allocations if args.allocations else list(range(len(case.allocations)))
    stats, info = _trace(replace(case, trace_requests=args.trace_requests))
    pipe = Pipeline.from_stats(stats)
    book = books_of(args.run)[args.workflow]
    settle = SETTLE_LATENCIES * float(info["latency_mean_s"])
    points: list[dict[str, Any]] = []
    jobs: list[EvalJob] = []
    for i in indices:
        alloc = {m: ModelAlloc(*row) for m, row in case.allocations[i].items()}
        capacity = predict(pipe, book, alloc, 0.0).throughput
        rate = args.load * capacity
        points.append(
            {
                "allocation": case.allocations[i],
                "capacity": capacity,
                "rate": rate,
                "predicted": predict(pipe, book, alloc, rate).latency,
            }
        )
        jobs += [
            EvalJob(case, i, args.load, "latency", rate, 5000 + 10 * i + s, settle)
            for s in range(args.seeds)
        ]
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        means = list(pool.map(replication_mean, jobs, [args.requests] * len(jobs)))
    for k, p in enumerate(points):
        p.update(seed_summary(p["predicted"], means[k * args.seeds : (k + 1) * args.seeds]))
    print(
        orjson.dumps(
            {
                "label": "simulated",
                "workflow": args.workflow,
                "load": args.load,
                "trace": {
                    "requests": args.trace_requests,
                    "n": {m: s.n for m, s in stats.models.items()},
                },
                "profiles_from": str(args.run),
                "requests": args.requests,
                "points": points,
                "error_max": max((p["error"] for p in points), default=float("nan")),
            },
            option=orjson.OPT_INDENT_2,
        ).decode()
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

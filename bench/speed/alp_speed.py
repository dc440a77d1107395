"""Benchmark: how fast the Aggregate LLM Pipeline scores candidate allocations.

``python -m bench.speed.alp_speed --out DIR [--quick]`` builds a three-model pipeline with synthetic
(M/M/1-shaped) profiles at TP 1, 2, 4 and shares 1.0, 0.5 (other shares are scaled), draws
random allocations (replicas 1-8, TP in {1, 2, 4}, share in {0.1, ..., 1.0}) and times
``predict_many``. Writes ``DIR/alp_speed.json``. Target: 100 000 candidates in under 1 s.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import orjson

from optimizer.model.alp import Overlap, Pipeline, Stage
from optimizer.model.batch import predict_many
from optimizer.model.curves import ProfileBook
from shared.profile_points import ProfilePoint

MODELS = {"embed": 200.0, "rerank": 40.0, "gen": 8.0}  # full-GPU TP1 saturation, calls/s


def synthetic_book() -> ProfileBook:
    points = []
    for model, mu1 in MODELS.items():
        for tp in (1, 2, 4):
            for share in (1.0, 0.5):
                mu = mu1 * tp**0.8 * share
                for frac in (0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 1.2):
                    lam = frac * mu
                    lat = 1.0 / (mu - lam) if lam < mu else 100.0
                    points.append(
                        ProfilePoint(
                            model,
                            "emulator",
                            "H100",
                            tp,
                            share,
                            lam,
                            min(lam, mu),
                            lat,
                            lat,
                            2 * lat,
                            3 * lat,
                            0.0,
                            500,
                        )
                    )
    return ProfileBook(points)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--candidates", type=int, default=100_000)
    args = ap.parse_args(argv)
    n = args.candidates // 10 if args.quick else args.candidates
    # every pair of stages overlapping: the costliest critical path the pipeline computes
    pipe = Pipeline(
        "rag",
        (Stage("embed", 1.0, 1.0), Stage("rerank", 1.0, 1.0), Stage("gen", 1.0, 1.0)),
        overlap=1.0,
        tool_time=0.01,
        overlaps=(
            Overlap("embed", "rerank", 1.2),
            Overlap("embed", "gen", 0.8),
            Overlap("rerank", "gen", 1.0),
        ),
    )
    book = synthetic_book()
    rng = np.random.default_rng(0)
    shape = (n, len(pipe.stages))
    replicas = rng.integers(1, 9, size=shape)
    tp = rng.choice([1, 2, 4], size=shape)
    share = rng.choice(np.round(np.arange(1, 11) / 10, 1), size=shape)
    timings = []
    for _ in range(5):
        t = time.perf_counter()
        batch = predict_many(pipe, book, 5.0, replicas, tp, share)
        timings.append(time.perf_counter() - t)
    result = {
        "candidates": n,
        "cpus": os.cpu_count(),
        "seconds": [round(x, 4) for x in timings],
        "best_s": round(min(timings), 4),
        "target_s": 1.0,
        "feasible": int(np.isfinite(batch.latency).sum()),
        "best_latency_s": float(np.min(batch.latency)),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "alp_speed.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    print(orjson.dumps(result).decode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

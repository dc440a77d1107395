"""Benchmark: allocation search time at the scales of the paper's Fig. 11, and its exactness.

``python -m bench.speed.search_time --out DIR [--quick]`` writes ``DIR/search_time.json``:

- ``llms``: 2..5 LLMs on 16 GPUs at 10 fractions per GPU;
- ``gpus``: 4..128 GPUs with 3 LLMs at 10 fractions;
- ``fractions``: 1..20 fractions per GPU with 3 LLMs on 16 GPUs;
- ``random``: small random instances (<= 4 GPUs, <= 3 LLMs, as the tests use).

Every point is one workflow with synthetic (simulated) profiles from
``tests.optimizer.search.instances``; seconds are the best of ``repeats`` runs of ``search`` on this
machine (``cpu_seconds``: process CPU time, robust to other load on a shared machine). Wherever the exhaustive reference solver (``optimizer.search.reference``) finishes
within its cap it runs too, and the point records whether the search's objective (feasible,
served rate, latency evaluated the reference's way) equals the reference's, and whether the
paper's latency-ratio pruning (higher-latency LLMs get at least as many units) would have kept
the optimum. Targets: 5 LLMs / 16 GPUs / 10 fractions <= 1 s; 3 LLMs / 128 GPUs <= 3 s (the
paper reports up to 35 s and 70 s).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from optimizer.model.batch import predict_many
from optimizer.search.reference import ReferenceResult, ReferenceTimeout, solve
from optimizer.search.solve import SearchResult, search
from optimizer.search.space import SearchProblem
from tests.optimizer.search.instances import random_problem, scaled_problem

MAX_REFERENCE_VECTORS = 250_000  # beyond this the reference is not even tried


def _search_latency(problem: SearchProblem, result: SearchResult, rate: float) -> float:
    pipe = problem.workflows[0].pipeline
    alloc = result.workflows[0].allocation
    if not alloc:
        return math.inf
    pred = predict_many(
        pipe,
        problem.book,
        rate,
        [[alloc[s.model].replicas for s in pipe.stages]],
        [[alloc[s.model].tp for s in pipe.stages]],
        [[alloc[s.model].share for s in pipe.stages]],
        stat=problem.stat,
        pooling=problem.pooling,
    )
    return float(pred.latency[0])


def _same(a: float, b: float) -> bool:
    return a == b or math.isclose(a, b, rel_tol=1e-9)


def _objective(r: ReferenceResult) -> dict[str, Any]:
    return {
        "feasible": r.feasible,
        "served_rate": r.served_rate,
        "latency": r.latency if math.isfinite(r.latency) else None,
    }


def point(problem: SearchProblem, repeats: int, reference_cap_s: float) -> dict[str, Any]:
    """Time the search on ``problem`` and compare with the reference where it finishes."""
    seconds, cpu = [], []
    result = search(problem)
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        result = search(problem)
        seconds.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    w = result.workflows[0]
    out: dict[str, Any] = {
        "llms": len(problem.workflows[0].pipeline.stages),
        "gpus": problem.cluster.gpu_count,
        "fractions": problem.granularity,
        "seconds": min(seconds),
        "cpu_seconds": min(cpu),
        "candidates_generated": result.stats.candidates_generated,
        "candidates_pruned": result.stats.candidates_pruned,
        "candidates_evaluated": result.stats.candidates_evaluated,
        "configs_predicted": result.stats.configs_predicted,
        "feasible": w.feasible,
        "served_rate": w.served_rate,
        "latency": w.latency if math.isfinite(w.latency) else None,
        "reference": None,
    }
    vectors = math.comb(problem.units, out["llms"])
    if vectors > MAX_REFERENCE_VECTORS:
        out["reference"] = {"status": f"not run: {vectors:,} units vectors"}
        return out
    try:
        deadline = time.monotonic() + reference_cap_s
        ref = solve(problem, deadline=deadline)
        paper = solve(problem, ratio_order=True, deadline=deadline)
    except ReferenceTimeout:
        out["reference"] = {"status": f"timed out after {reference_cap_s:g} s"}
        return out
    match = (
        w.feasible == ref.feasible
        and _same(w.served_rate, ref.served_rate)
        and _same(_search_latency(problem, result, ref.served_rate), ref.latency)
    )
    paper_keeps = (
        paper.feasible == ref.feasible
        and _same(paper.served_rate, ref.served_rate)
        and _same(paper.latency, ref.latency)
    )
    out["reference"] = {
        "status": "ok",
        "seconds": ref.seconds,
        "rows": ref.rows,
        "objective": _objective(ref),
        "match": match,
        "ratio_pruning_keeps_optimum": paper_keeps,
        "ratio_pruning_objective": _objective(paper),
    }
    return out


def run(quick: bool) -> dict[str, Any]:
    repeats = 1 if quick else 3
    cap = 5.0 if quick else 30.0
    llms = (2, 3, 5) if quick else (2, 3, 4, 5)
    gpus = (4, 16, 128) if quick else (4, 8, 16, 32, 64, 128)
    fractions = (1, 5, 10, 20) if quick else (1, 2, 4, 5, 8, 10, 15, 20)
    randoms = 50 if quick else 200
    doc: dict[str, Any] = {
        "benchmark": "search_time",
        "quick": quick,
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "profiles": "simulated (synthetic curves)",
        "llms": [point(scaled_problem(n, 16, 10), repeats, cap) for n in llms],
        "gpus": [point(scaled_problem(3, g, 10), repeats, cap) for g in gpus],
        "fractions": [point(scaled_problem(3, 16, f), repeats, cap) for f in fractions],
    }
    rng = np.random.default_rng(2026)
    doc["random"] = [point(random_problem(rng), 1, cap) for _ in range(randoms)]
    refs = [
        p["reference"]
        for key in ("llms", "gpus", "fractions", "random")
        for p in doc[key]
        if p["reference"]["status"] == "ok"
    ]
    by_scale = {
        (p["llms"], p["gpus"], p["fractions"]): p for key in ("llms", "gpus") for p in doc[key]
    }
    doc["summary"] = {
        "llms5_gpus16_seconds": by_scale[(5, 16, 10)]["seconds"],
        "llms3_gpus128_seconds": by_scale[(3, 128, 10)]["seconds"],
        "llms5_gpus16_cpu_seconds": by_scale[(5, 16, 10)]["cpu_seconds"],
        "llms3_gpus128_cpu_seconds": by_scale[(3, 128, 10)]["cpu_seconds"],
        "reference_instances": len(refs),
        "reference_matches": sum(r["match"] for r in refs),
        "ratio_pruning_keeps_optimum": sum(r["ratio_pruning_keeps_optimum"] for r in refs),
        "targets": {"llms5_gpus16_seconds": 1.0, "llms3_gpus128_seconds": 3.0},
    }
    return doc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="fewer points (<= 60 s)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    doc = run(args.quick)
    doc["wall_seconds"] = time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "search_time.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    print(orjson.dumps(doc["summary"]).decode())


if __name__ == "__main__":
    main()

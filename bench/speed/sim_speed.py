"""Benchmark: how fast the discrete-event simulator runs beam search on a 16-GPU allocation.

``python -m bench.speed.sim_speed --out DIR [--quick] [--requests N] [--rate R]`` simulates N
beam-search requests (default 1000; 100 with ``--quick``) arriving as a Poisson process at R
requests/s on 16 simulated A6000s (8 Llama-3.2-1B generator replicas at half a GPU each, two per
GPU, and 12 Llama-3.1-8B-PRM verifier replicas on whole GPUs), once with decode fast-forward and
once step by step, and writes ``DIR/sim_speed.json``: wall and CPU seconds, events, simulated
seconds and the simulated workflow figures. Target (issue 3): 1,000 requests in under 60 s.
All workflow figures are simulated.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from sim.cluster import Allocation, ReplicaSpec
from sim.des import WorkloadSpec, simulate

ALLOCATION = Allocation.of(
    ReplicaSpec("llama-3.2-1b", "a6000", tp=1, share=0.5, count=8),
    ReplicaSpec("llama-3.1-8b-prm", "a6000", tp=1, share=1.0, count=12),
)
TARGET_S = 60.0


def run(requests: int, rate: float, seed: int, fast_forward: bool) -> dict[str, Any]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = simulate(
        ALLOCATION,
        [WorkloadSpec("beam", rate)],
        n_requests=requests,
        seed=seed,
        fast_forward=fast_forward,
    )
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    beam = result.workflows["beam"]
    return {
        "fast_forward": fast_forward,
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "events": result.events,
        "simulated_s": round(result.simulated_s, 3),
        "speedup_vs_real_time": round(result.simulated_s / wall, 1),
        "completed": beam.completed,
        "failed": beam.failed,
        "latency_mean_s": round(beam.latency.mean, 3),
        "latency_p99_s": round(beam.latency.p99, 3),
        "calls_per_request": beam.calls_per_request,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quick", action="store_true", help="100 requests instead of 1000")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--rate", type=float, default=4.0, help="beam requests per second")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    requests = args.requests or (100 if args.quick else 1000)
    runs = [run(requests, args.rate, args.seed, ff) for ff in (True, False)]
    report = {
        "label": "simulated",
        "benchmark": "sim_speed",
        "requests": requests,
        "rate": args.rate,
        "gpus": ALLOCATION.gpus,
        "allocation": [vars(s) for s in ALLOCATION.replicas],
        "target_wall_s": TARGET_S,
        "wall_s": runs[0]["wall_s"],
        "meets_target": runs[0]["wall_s"] < TARGET_S * requests / 1000,
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sim_speed.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("requests", "wall_s", "meets_target")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

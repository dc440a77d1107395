"""How long ``scepsy profile --quick`` takes for two emulated models, and how close it gets.

Role: the issue's figure "profiling two emulated models end to end through ``scepsy profile``
in under 3 minutes with ``--quick``, producing curves whose saturation throughput is within
10% of what the emulator's model implies". It writes a simulated trace (sim.des: a fan-out
workflow calling llama-3.2-1b and a RAG workflow calling e5-base-v2) into a fresh store, runs
``scepsy profile --quick`` once per model as a subprocess (timed end to end, emulator start-up
included), and compares each stored curve's saturation throughput with
``implied_capacity`` (``tests.optimizer.profiling.capacity``, the profiler test's oracle): the
same replay workload (same bodies, tokenised as the emulator tokenises them, same forced output
lengths, same dependencies) run on ``sim.engine.EngineCore`` on a virtual clock with a deep
backlog, i.e. the throughput the emulator's performance model sustains for this call mix.
Every figure is *emulated* (profiles) or *simulated* (capacity).

    python -m bench.speed.profile_time --out DIR [--quick]

Writes ``DIR/profile_time.json``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from optimizer.model.curves import Profile
from optimizer.profiling.replay import load_workload
from optimizer.store.profiles import load_points
from sim.cluster import Allocation, ReplicaSpec
from sim.des import WorkloadSpec, simulate
from sim.trace import write_trace
from tests.optimizer.profiling.capacity import implied_capacity

GPU = "a6000"
MODELS = ("llama-3.2-1b", "e5-base-v2")


def make_store(store: Path, duration_s: float = 120.0, seed: int = 1) -> int:
    """A simulated trace of fan-out (llama-3.2-1b + llama-3-8b) and RAG (e5 + reranker +
    llama-3-8b) requests, with bodies; returns the number of calls written."""
    alloc = Allocation(
        (
            ReplicaSpec("llama-3.2-1b", GPU, 1, 1.0, 2),
            ReplicaSpec("llama-3-8b", GPU, 1, 1.0, 2),
            ReplicaSpec("e5-base-v2", GPU, 1, 1.0, 1),
            ReplicaSpec("bge-reranker-base", GPU, 1, 1.0, 1),
        )
    )
    res = simulate(
        alloc,
        [WorkloadSpec("fanout", 2.0), WorkloadSpec("rag", 2.0)],
        duration_s=duration_s,
        record_calls=True,
        seed=seed,
    )
    write_trace(res, store)
    return len(res.calls)


def profile_model(store: Path, model: str, quick: bool) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "optimizer.cli",
        "profile",
        "--store",
        str(store),
        "--model",
        model,
        "--gpu",
        GPU,
        "--tp",
        "1",
        "--shares",
        "1.0",
    ]
    if quick:
        cmd.append("--quick")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"scepsy profile failed ({proc.returncode}): {proc.stderr[-2000:]}")
    points = load_points(store, model)
    profile = Profile.from_points(points)
    capacity = implied_capacity(load_workload(store, model), GPU)
    return {
        "model": model,
        "wall_s": wall,
        "points": len(points),
        "saturation_emulated": profile.saturation,
        "saturated": profile.saturated,
        "capacity_simulated": capacity,
        "saturation_error": profile.saturation / capacity - 1.0,
        "stdout_tail": proc.stdout[-3000:],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="(always --quick profiles; this flag only shortens the trace)",
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    store = args.out / "store"
    if store.exists():
        subprocess.run(["rm", "-rf", str(store)], check=True)
    n = make_store(store, duration_s=60.0 if args.quick else 120.0)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    models = [profile_model(store, m, quick=True) for m in MODELS]
    total = time.perf_counter() - t0
    # real-time emulation shares this machine's CPUs: the figures depend on the load
    load_after = os.getloadavg()
    load = {"before": load_before, "after": load_after, "cpus": os.cpu_count()}
    doc = {
        "label": "emulated profiles vs simulated capacity",
        "gpu": GPU,
        "trace_calls": n,
        "total_wall_s": total,
        "load_average": load,
        "models": models,
        "summary": {
            "total_wall_s": total,
            "under_3_minutes": total < 180.0,
            "saturation_error_max": max(abs(m["saturation_error"]) for m in models),
        },
    }
    (args.out / "profile_time.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    for m in models:
        print(
            f"{m['model']}: {m['wall_s']:.1f} s, saturation {m['saturation_emulated']:.3g}/s "
            f"(emulated) vs {m['capacity_simulated']:.3g}/s implied (simulated): "
            f"{m['saturation_error']:+.1%}"
        )
    print(
        f"total {total:.1f} s for {len(models)} models (--quick); load average "
        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after, {os.cpu_count()} CPUs"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark: how fast the simulator runs the evaluation's heaviest points.

``python -m bench.speed.sim_eval_speed --out DIR [--quick] [--cases NAME ...]`` times, each in
this process, the kinds of point that dominate ``bench.evaluation.evaluate``'s wall time (its
setup: ``bench.evaluation.setup.workloads``, the seeds, windows and allocations of the full
run's points), and writes ``DIR/sim_eval_speed.json``: per case wall and CPU seconds, events,
simulated seconds, the simulated workflow figures and a digest of the whole result (every
``SimResult`` field but wall time), so two runs of different code can be checked for equal
results as well as compared for speed. All workflow figures are simulated.

Cases:
- ``hpa_warm_beam16``: the autoscaler (``sim.dynamic.run_dynamic`` with ``sim.hpa.Hpa``) on 16
  GPUs from 8 + 8 pods, beam search at 10.2 requests/s, 300 s warm-up + 600 s window + drain
  (as ``bench.evaluation.runs.run_point`` runs ``hpa_warm``; its settling runs are left out);
- ``hpa_cold_beam16``: the same from one pod per model at 7.65 requests/s (``hpa``);
- ``static_beam8``: ``sim.des.simulate`` of Scepsy's 8-GPU beam allocation at 5.8 requests/s;
- ``static_rag8``: Scepsy's 8-GPU RAG allocation (co-located encoders) at 42.8 requests/s.
``--quick`` shortens the autoscaler runs to a 150 s warm-up and a 150 s window.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.evaluation.runs import COLD_START_S
from bench.evaluation.setup import workflow_models, workloads
from sim.cluster import Allocation
from sim.des import SimResult, simulate
from sim.dynamic import DynamicSimulation, run_dynamic
from sim.hpa import Hpa

BEAM_LIGHT_S = 46.752328069094986 / 4  # the full run's light-load beam latency (warm-up / 4)
RAG_LIGHT_S = 4.752628577851395 / 4


def _drain(light: float) -> float:
    return 3.0 * light + 30.0  # bench.evaluation.runs._window


@dataclass(frozen=True)
class HpaCase:
    rate: float
    counts: dict[str, int] | None  # None: a cold start
    seed: int

    def run(self, quick: bool) -> tuple[SimResult, dict[str, Any]]:
        warm, window = (150.0, 150.0) if quick else (300.0, 600.0)
        hpa = Hpa(workflow_models("beam"), 16)
        specs = workloads("beam", self.rate)
        sim = DynamicSimulation(hpa.initial(self.counts), specs, self.seed, hpa, COLD_START_S)
        res = run_dynamic(sim, warm + window, warm, _drain(BEAM_LIGHT_S))
        changes = sum(1 for c in sim.changes if c.kind in ("start", "retire"))
        return res, {"scaling_events": changes, "syncs": len(hpa.log)}


@dataclass(frozen=True)
class StaticCase:
    kind: str
    rate: float
    allocation: Allocation
    window: tuple[float, float]
    light: float
    seed: int

    def run(self, quick: bool) -> tuple[SimResult, dict[str, Any]]:
        res = simulate(
            self.allocation,
            workloads(self.kind, self.rate),
            duration_s=self.window[1],
            warmup_s=self.window[0],
            drain_s=_drain(self.light),
            seed=self.seed,
        )
        return res, {}


CASES: dict[str, HpaCase | StaticCase] = {
    "hpa_warm_beam16": HpaCase(
        10.199147990942663, {"llama-3.2-1b": 8, "llama-3.1-8b-prm": 8}, 16030
    ),
    "hpa_cold_beam16": HpaCase(7.6493609932069955, None, 16020),
    "static_beam8": StaticCase(
        "beam",
        5.825269826965726,
        Allocation.of(
            ("llama-3.1-8b-prm", "a6000", 1, 1.0, 5), ("llama-3.2-1b", "a6000", 1, 1.0, 3)
        ),
        (46.752328069094986, 163.63314824183243),
        BEAM_LIGHT_S,
        8050,
    ),
    "static_rag8": StaticCase(
        "rag",
        42.84144302147575,
        Allocation.of(
            ("bge-reranker-base", "a6000", 1, 0.9, 1),
            ("e5-base-v2", "a6000", 1, 0.1, 1),
            ("llama-3-8b", "a6000", 1, 1.0, 7),
        ),
        (4.752628577851395, 28.09451273191025),
        RAG_LIGHT_S,
        8060,
    ),
}


def digest(res: SimResult) -> str:
    """A digest of every figure of ``res`` but its wall time (equal results, equal digests)."""
    figures = res.summary()
    figures.pop("wall_s")
    return hashlib.sha256(json.dumps(figures, sort_keys=True).encode()).hexdigest()[:16]


def time_case(name: str, quick: bool) -> dict[str, Any]:
    wall, cpu = time.perf_counter(), time.process_time()
    res, extra = CASES[name].run(quick)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {
        "case": name,
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "events": res.events,
        "simulated_s": round(res.simulated_s, 3),
        "workflows": {
            n: {
                "started": w.started,
                "completed": w.completed,
                "failed": w.failed,
                "throughput": w.throughput,
                "latency_mean_s": w.latency.mean,
            }
            for n, w in res.workflows.items()
        },
        "digest": digest(res),
        **extra,
    }


def main(argv: list[str] | None = None, clock: Callable[[], float] = time.time) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quick", action="store_true", help="shorter autoscaler runs")
    ap.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    args = ap.parse_args(argv)
    runs = []
    for name in args.cases:
        runs.append(time_case(name, args.quick))
        print(json.dumps({k: runs[-1][k] for k in ("case", "wall_s", "cpu_s", "digest")}))
    report = {
        "label": "simulated",
        "benchmark": "sim_eval_speed",
        "quick": args.quick,
        "at": clock(),
        "wall_s": round(sum(r["wall_s"] for r in runs), 3),
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sim_eval_speed.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The demo's profiles, by simulation: ``python -m sim.profiles --out FILE.json``.

Role: ``scepsy demo`` has minutes, not the quarter hour that replaying five models' traces
against emulators (``scepsy profile``) takes on two cores. It starts this module as a
*separate process* (as it starts emulated engines with ``sim.cli``) to profile each demo
model by simulation instead: the discrete-event simulator (:mod:`sim.des`, the same engine
core and performance model the emulator runs) sweeps each model alone from light load to
saturation under its workflow's real call mix (:func:`sim.profiling.run_profile`). The points
are written as a profile JSON file (``shared.profile_points.export_json``), which the demo
imports through the same path as ``scepsy profile --from-json``.

Invariants: only ever run as a subprocess (the optimizer package does not import the
simulator: DESIGN §2); every point is labelled engine ``simulated``, and so is the one line
it prints; rates and latencies are in model seconds (the demo runs its emulators at speed-up
1, so model time is wall time); deterministic for given arguments.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

from shared.profile_points import ProfilePoint, export_json
from sim.cluster import Allocation, ReplicaSpec
from sim.des import WorkloadSpec, simulate
from sim.perf import perf_model
from sim.profiling import ProfileJob, WorkflowSetup, colocated, run_profile
from sim.workflows import BeamParams, RagParams, WorkflowParams, models_of

ENGINE = "simulated"


def _calls_per_request(workflow: str, params: WorkflowParams, gpu: str) -> dict[str, float]:
    alloc = Allocation(tuple(ReplicaSpec(m, gpu, 1, 1.0, 2) for m in models_of(params)))
    res = simulate(
        alloc,
        [WorkloadSpec(workflow, 0.2, params)],  # type: ignore[arg-type]
        n_requests=40,
        seed=7,
    )
    return dict(res.workflows[workflow].calls_per_request)


def jobs(
    gpu: str, beam: BeamParams, rag: RagParams, calls: int, shares: Sequence[float] = (1.0,)
) -> list[ProfileJob]:
    """One job per model of beam search and RAG and per GPU share it fits in, each at TP 1 (a
    share whose memory holds no KV cache after the weights is skipped, as placement skips it);
    a share that packs several copies onto a GPU is also profiled alone, so the optimizer
    knows both ends of what its neighbours cost."""
    out = []
    for workflow, params in (("beam", beam), ("rag", rag)):
        n = _calls_per_request(workflow, params, gpu)
        setup = WorkflowSetup(workflow, params, gpu)
        for model in models_of(params):
            out += [
                ProfileJob(
                    setup,
                    model,
                    1,
                    share,
                    n[model],
                    calls,
                    start_rate=share,
                    refine=(0.5, 0.8),
                    max_doublings=14,
                )
                for share in shares
                if perf_model(model, gpu, 1, share).kv_capacity_tokens() > 0
            ]
    return out + [replace(j, alone=True) for j in out if colocated(j.share) > 1]


def _run(job: ProfileJob) -> list[ProfilePoint]:
    return [replace(p, engine=ENGINE) for p in run_profile(job)]


def _shares(text: str) -> tuple[float, ...]:
    try:
        shares = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"--shares: a comma-separated list of numbers, got {text!r}") from None
    if not shares or any(not 0 < s <= 1 for s in shares):
        raise SystemExit(f"--shares: every share must be in (0, 1], got {text!r}")
    return shares


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m sim.profiles",
        description="The demo's models profiled by simulation (sim.des); every point is simulated.",
    )
    p.add_argument("--out", type=Path, required=True, help="profile JSON file to write")
    p.add_argument("--gpu", default="a6000")
    p.add_argument("--beam", default="2,2,5", help="beams,width,iterations of beam search")
    p.add_argument("--calls", type=int, default=300, help="calls per profile point")
    p.add_argument(
        "--shares",
        default="1,0.75,0.5,0.25",
        help="GPU shares to profile at (the demo places replicas at each; a share is measured,"
        " never scaled from another)",
    )
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args(argv)
    n, width, iterations = (int(x) for x in args.beam.split(","))
    todo = jobs(
        args.gpu,
        BeamParams(n=n, beam_width=width, max_iterations=iterations),
        RagParams(),
        args.calls,
        _shares(args.shares),
    )
    with ProcessPoolExecutor(args.workers) as pool:
        points = [pt for batch in pool.map(_run, todo) for pt in batch]
    args.out.write_bytes(export_json(points))
    models = len({pt.model for pt in points})
    print(f"{len(points)} simulated profile points of {models} models written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

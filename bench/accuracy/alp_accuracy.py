"""Benchmark: Aggregate LLM Pipeline predictions against the discrete-event simulator.

``python -m bench.accuracy.alp_accuracy --out DIR [--quick]`` writes ``DIR/alp_accuracy.json`` (and,
as soon as profiling ends, ``DIR/profiles.json`` for ``--profiles-from``). All
measured figures are *simulated* (``sim.des``, the same engine model for profiles and runs).
The cases, their trace and the profile jobs are ``bench.accuracy.alp_plan``'s (re-exported here
for the benches and tests that import them from this module); this module runs them, judges
each point against the simulation and writes the report.

Per workflow (beam search, RAG, a fan-out across two different LLMs):
1. trace: simulate a light load with generous replicas, write the calls as call records into a
   temporary store (``shared.store.SegmentWriter``) and summarise them with
   ``optimizer.stats.figures`` — the production path;
2. profile by simulation (``sim.profiling``): per model and (TP, share) used below, sweep
   the workflow's rate with that model on one replica (fractional shares: next to busy copies
   of itself, as packed) and every other model over-provisioned, bisecting to the rate where
   the replica stops keeping up, then adding points below it;
3. for each allocation, predict ``T_w`` and the mean latency at 20%..90% of ``T_w`` with
   ``optimizer.model.alp``, simulate the same rates, and find the simulated maximum throughput as
   the most the allocation completes per second: at the rates it keeps up with (bracketed
   from ``T_w``, then bisected; a marginal shortfall is judged again over a window twice as
   long) or under a standing backlog just past them (``CAP_BACKLOG``).

Measurement precision (``bench.accuracy.alp_truth``, the ground truth): a mean latency near capacity
converges slowly (at 80% load one RAG replica's 300-request means spread 4-7 s around a 5.9 s
steady state), so each latency run grows (same seed, same first arrivals) until the
batch-means standard error of its mean is below ``LATENCY_SE`` and, in the full run, until its
warm-up and window hold enough of its own mean latencies; the JSON carries each figure's
standard error. Keeping up compares completions with arrivals over a window that starts after
a warm-up of 40% of its length and holds at least ``CAP_MIN_REQUESTS`` requests (``--quick``:
``CAP_MIN_REQUESTS_QUICK``, a smoke run whose errors are indicative); in the full run an
overloaded verdict from a window short for its own request latency is measured again over a
longer one (near capacity a batching engine's in-flight count climbs for many latencies). A
least-squares trend of requests in the system was tried instead and was worse: a beam window
of 400 requests holds only a few independent swings of 15-50 requests in flight, and the trend
followed one (2 x 2 replicas at 1.6 requests/s read 8% growth while 1,500-request runs at
2.3 requests/s stayed finite).

Errors are relative to the simulation. Summary per workflow: ``throughput_error_max`` and
``latency_error_max`` (latency over points at <= 80% of predicted capacity). Targets: 10% and
15%. Simulations run in a process pool (one worker per CPU).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import orjson

# Re-exported: other benches and the tests import these from here.
from bench.accuracy.alp_plan import CAP_MIN_REQUESTS as CAP_MIN_REQUESTS
from bench.accuracy.alp_plan import CAP_MIN_REQUESTS_QUICK as CAP_MIN_REQUESTS_QUICK
from bench.accuracy.alp_plan import FRACTIONS as FRACTIONS
from bench.accuracy.alp_plan import GPU as GPU
from bench.accuracy.alp_plan import QUICK_ALLOCATIONS as QUICK_ALLOCATIONS
from bench.accuracy.alp_plan import QUICK_FRACTIONS
from bench.accuracy.alp_plan import SETTLE_LATENCIES as SETTLE_LATENCIES
from bench.accuracy.alp_plan import _cases as _cases
from bench.accuracy.alp_plan import _job_key as _job_key
from bench.accuracy.alp_plan import _profile_docs as _profile_docs
from bench.accuracy.alp_plan import _profile_jobs as _profile_jobs
from bench.accuracy.alp_plan import _reused_points as _reused_points
from bench.accuracy.alp_plan import _trace as _trace
from bench.accuracy.alp_plan import latency_seed as latency_seed
from bench.accuracy.alp_plan import quick_cases as quick_cases
from bench.accuracy.alp_truth import (
    CAP_PRECISION,
    CAP_PRECISION_QUICK,
    LATENCY_SE,
    LATENCY_SE_QUICK,
    EvalJob,
    evaluate,
)
from optimizer.model.alp import ModelAlloc, Pipeline, predict
from optimizer.model.curves import ProfileBook
from sim.profiling import run_profile

LATENCY_LOAD_MAX = 0.8
TARGETS = {"throughput_error_max": 0.10, "latency_error_max": 0.15}
PROFILES_FILE = "profiles.json"  # the profiling checkpoint


def _alloc_doc(allocation: dict[str, ModelAlloc]) -> dict[str, dict[str, float]]:
    return {
        m: {"replicas": a.replicas, "tp": a.tp, "share": a.share} for m, a in allocation.items()
    }


def error_summary(
    throughput_errors: Sequence[float],
    latency_errors: Sequence[float],
) -> dict[str, float]:
    """A workflow's summary: max and mean relative error of max throughput and of mean
    latency (the latter over points at <= ``LATENCY_LOAD_MAX``)."""
    return {
        "throughput_error_max": max(throughput_errors, default=float("nan")),
        "latency_error_max": max(latency_errors, default=float("nan")),
        "throughput_error_mean": sum(throughput_errors) / max(len(throughput_errors), 1),
        "latency_error_mean": sum(latency_errors) / max(len(latency_errors), 1),
    }


def _progress(line: str) -> None:
    """One line of progress on stderr (stdout carries the JSON summary); in job order, so a
    line can wait on a slower job before it."""
    print(line, file=sys.stderr, flush=True)


def _err(pred: float, sim: float) -> float:
    return abs(pred - sim) / sim if sim > 0 else float("inf")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_ALLOCATIONS} allocations, {len(QUICK_FRACTIONS)} rates each, "
        "shorter windows: a smoke run (its errors are indicative)",
    )
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--workflows",
        nargs="*",
        choices=[c.workflow for c in _cases()],
        help="only these workflows (default: all three)",
    )
    ap.add_argument(
        "--profiles-from",
        type=Path,
        help="an earlier run's alp_accuracy.json or profiles.json (written once "
        "profiling ends): reuse its profile points for the keys it holds "
        "(same mode: the same seeded result), profile the rest",
    )
    args = ap.parse_args(argv)
    started = time.perf_counter()
    cases = [c for c in _cases() if not args.workflows or c.workflow in args.workflows]
    reused = _reused_points(args.profiles_from)
    fractions = QUICK_FRACTIONS if args.quick else FRACTIONS
    precision = CAP_PRECISION_QUICK if args.quick else CAP_PRECISION
    latency_se = LATENCY_SE_QUICK if args.quick else LATENCY_SE
    # the quick run keeps fixed windows (3 minutes); the full run checks them on latency
    lengths: dict[str, Any] = (
        {"cap_stretches": 0, "latency_window_latencies": 0.0, "replications": 1}
        if args.quick
        else {}
    )
    if args.quick:
        cases = quick_cases(cases)
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        traced = list(pool.map(_trace, cases))
        phase_s = {"trace": time.perf_counter() - started}
        jobs = [
            job
            for case, (stats, info) in zip(cases, traced, strict=True)
            for job in _profile_jobs(case, stats, info, args.quick)
        ]
        done = {j: reused[_job_key(job)] for j, job in enumerate(jobs) if _job_key(job) in reused}
        # Longest first, so the pool does not end on one long job.
        order = sorted(
            (j for j in range(len(jobs)) if j not in done),
            key=lambda j: -jobs[j].target_calls,  # the case's profile_calls, or half in --quick
        )
        _progress(
            f"traced in {phase_s['trace']:.0f} s; profiling {len(order)} keys ({len(done)} reused)"
        )
        done.update(zip(order, pool.map(run_profile, [jobs[j] for j in order]), strict=True))
        profiled = [done[j] for j in range(len(jobs))]
        # a checkpoint for --profiles-from: the evaluation that follows is the long part
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / PROFILES_FILE).write_bytes(
            orjson.dumps(
                {
                    "label": "simulated",
                    "quick": args.quick,
                    "profile_points": _profile_docs(jobs, profiled),
                },
                option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY,
            )
        )
        books = {
            c.workflow: ProfileBook(
                p
                for job, pts in zip(jobs, profiled, strict=True)
                if job.case.workflow == c.workflow
                for p in pts
            )
            for c in cases
        }
        pipes = {
            c.workflow: Pipeline.from_stats(s) for c, (s, _) in zip(cases, traced, strict=True)
        }
        settle = {
            c.workflow: info["latency_mean_s"] for c, (_, info) in zip(cases, traced, strict=True)
        }
        phase_s["profile"] = time.perf_counter() - started - phase_s["trace"]
        evals: list[EvalJob] = []
        predictions: dict[tuple[str, int], Any] = {}
        for case in cases:
            for i, alloc in enumerate(case.allocations):
                allocation = {m: ModelAlloc(*row) for m, row in alloc.items()}
                cap = predict(pipes[case.workflow], books[case.workflow], allocation, 0.0)
                predictions[case.workflow, i] = (allocation, cap.throughput)
                settle_s = SETTLE_LATENCIES * settle[case.workflow]
                # capacity jobs first: each is a sequence of runs, the longest jobs
                evals.insert(
                    0,
                    EvalJob(
                        case,
                        i,
                        1.0,
                        "capacity",
                        cap.throughput,
                        seed=100 + 10 * i,
                        settle_s=settle_s,
                        precision=precision,
                        **lengths,
                    ),
                )
                for k, f in enumerate(fractions):
                    evals.append(
                        EvalJob(
                            case,
                            i,
                            f,
                            "latency",
                            f * cap.throughput,
                            seed=latency_seed(i, k),
                            settle_s=settle_s,
                            latency_se=latency_se,
                            **lengths,
                        )
                    )
        _progress(f"profiled in {phase_s['profile']:.0f} s; {len(evals)} simulations to run")
        simulated = []
        for k, (ev, sim) in enumerate(
            zip(evals, pool.map(evaluate, evals, chunksize=1), strict=True), 1
        ):
            simulated.append(sim)
            _progress(
                f"{k}/{len(evals)} {ev.case.workflow} allocation {ev.alloc_index} "
                f"{ev.kind} {ev.fraction:.1f} ({time.perf_counter() - started:.0f} s)"
            )
        phase_s["evaluate"] = time.perf_counter() - started - phase_s["trace"] - phase_s["profile"]
    report: dict[str, Any] = {
        "label": "simulated",
        "gpu": GPU,
        "quick": args.quick,
        "profiles_reused_from": str(args.profiles_from or ""),
        "targets": TARGETS,
        "workflows": {},
        "summary": {},
    }
    for case, (stats, trace_info) in zip(cases, traced, strict=True):
        pipe, book = pipes[case.workflow], books[case.workflow]
        points: list[dict[str, Any]] = []
        thr_errors, lat_errors, paper_errors = [], [], []
        capacities: dict[int, dict[str, Any]] = {}
        for ev, sim in zip(evals, simulated, strict=True):
            if ev.case.workflow != case.workflow:
                continue
            allocation, capacity = predictions[case.workflow, ev.alloc_index]
            if ev.kind == "capacity":
                capacities[ev.alloc_index] = sim
                continue
            pred = predict(pipe, book, allocation, ev.rate)
            paper = predict(pipe, book, allocation, ev.rate, pooling=False)
            err = _err(pred.latency, sim["latency_mean"])
            if ev.fraction <= LATENCY_LOAD_MAX + 1e-9:
                lat_errors.append(err)
                paper_errors.append(_err(paper.latency, sim["latency_mean"]))
            points.append(
                {
                    "allocation": _alloc_doc(allocation),
                    "kind": "mean_latency",
                    "load": ev.fraction,
                    "rate": ev.rate,
                    "predicted": pred.latency,
                    "simulated": sim["latency_mean"],
                    "error": err,
                    "simulated_se": sim["latency_se"],
                    "requests": sim["requests"],
                    "run_requests": sim["run_requests"],
                    "replication_means": sim["replication_means"],
                    "predicted_without_pooling": paper.latency,
                    "bottleneck": pred.bottleneck,
                    "completed": sim["completed"],
                    "failed": sim["failed"],
                    "scaled_profiles": [s.model for s in pred.stages if s.scaled_from is not None],
                }
            )
        for i, sim in sorted(capacities.items()):
            allocation, capacity = predictions[case.workflow, i]
            err = _err(capacity, sim["capacity"])
            thr_errors.append(err)
            points.append(
                {
                    "allocation": _alloc_doc(allocation),
                    "kind": "max_throughput",
                    "predicted": capacity,
                    "simulated": sim["capacity"],
                    "error": err,
                    "simulated_overloaded_at": sim["overloaded_at"],
                    "simulated_kept_up_at": sim["kept_up_at"],
                    "simulated_backlog_throughput": sim["backlog_throughput"],
                    "probes": [
                        {"rate": r, "kept_up": ok, "throughput": a} for r, ok, a in sim["probes"]
                    ],
                }
            )
        report["workflows"][case.workflow] = {
            "trace": {
                **trace_info,
                "latency_cv": stats.latency_cv,
                "overlap_factor": stats.overlap_factor,
                "tool_time_mean_s": stats.tool_time_mean,
                "overlaps": [
                    {
                        "a": o.a,
                        "b": o.b,
                        "coupling": o.coupling,
                        "together_s": stats.overlaps[(o.a, o.b)],
                    }
                    for o in pipes[case.workflow].overlaps
                ],
                "models": {
                    m: {
                        "n": s.n,
                        "p": s.p,
                        "p_agg": s.p_agg,
                        "share_mean": s.share_mean,
                        "share_cv": s.share_cv,
                    }
                    for m, s in stats.models.items()
                },
                "share_cv_below_latency_cv": all(
                    s.share_cv < stats.latency_cv for s in stats.models.values()
                ),
            },
            "profiles": {
                f"{p.key.model}/tp{p.key.tp}/s{p.key.share}": {
                    "saturation_calls_per_s": p.saturation,
                    "saturated": p.saturated,
                    "points": len(p.rates),
                }
                for p in book.profiles.values()
            },
            "points": points,
        }
        report["summary"][case.workflow] = {
            **error_summary(thr_errors, lat_errors),
            "latency_error_max_without_pooling": max(paper_errors, default=float("nan")),
            "allocations": len(case.allocations),
        }
    report["profile_points"] = _profile_docs(jobs, profiled)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    report["phase_s"] = {k: round(v, 1) for k, v in phase_s.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "alp_accuracy.json").write_bytes(
        orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
    )
    print(
        orjson.dumps(
            {k: report[k] for k in ("summary", "wall_s", "phase_s")}, option=orjson.OPT_INDENT_2
        ).decode()
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

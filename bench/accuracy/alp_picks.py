"""Benchmark: the ALP's predictions for the allocations the search picks and for a held-out set,
against the discrete-event simulator (every measured figure here is *simulated*).

``python -m bench.accuracy.alp_picks --out DIR [--quick] [--profiles-from FILE]`` prints a JSON
summary and writes ``DIR/alp_picks.json`` (and ``DIR/profiles.json`` once profiling ends, for
``--profiles-from``). Two sets, reported apart from each other and from
``bench.accuracy.alp_accuracy``'s fitted set (``bench.accuracy.pick_sets`` defines them):
``search_picks`` (the product's search at 4, 8 and 16 GPUs and several rates per workflow)
and ``held_out`` (fractional verifier and 8B, shares 0.2/0.25/0.75, different models sharing
a GPU).

Per workflow (beam, RAG, fan-out: ``bench.accuracy.alp_accuracy``'s cases) the trace and the
profiles are the fitted bench's own (``_trace``, ``_profile_jobs``) over the fitted set's keys
only: whole GPUs, 0.5 shares of the small models, TP 2 of the 8B ones; then, as the daemon's
reprofiler would once a proposal placed them, the judged allocations' keys its shipped
``uncovered`` rule names (a fractional share of a model measured only whole, whose share
exponents would be other models'), each measured alone, then packed where the simulator packs
two or more copies of it onto one GPU (``bench.accuracy.pick_reprofile``).
Every other share is derived by the product's share model, and each allocation records per
model whether its curve was measured or scaled; beside it, ``borrowed`` is the same
allocation predicted with the fitted set's keys only, on the same truth (the summary's
``<set>_borrowed``). For every allocation: predicted ``T_w`` and the mean latency at
20..80% of it (``optimizer.model.alp``), the simulated truth from ``bench.accuracy.alp_truth``
(the same jobs, seeds and run-length rules as the fitted bench), and at the highest latency
load a per-model check (``pick_sets.stage_check``): each model's simulated call latency
against the curve's. Each figure also says whether the truth lies in the prediction's
uncertainty band (``optimizer.model.alp``'s ``capacity_low`` .. ``throughput`` and ``latency``
.. ``latency_high``, within ``BAND_TOL``). Summary per set and workflow: max and median
relative error of throughput and of mean latency at <= 80% load (targets 10% and 15%), and
the share of figures inside their band.

What it predicts with is :mod:`bench.accuracy.pick_knowledge`'s; its report's figures are
:mod:`bench.accuracy.pick_report`'s. ``--sets held_out`` judges one set. ``--quick`` (a smoke run, under ten minutes on two
cores): 4 GPUs only, two rates, two held-out allocations per workflow, two loads, the fitted
bench's quick windows; its errors are indicative.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from bench.accuracy import pick_sets
from bench.accuracy.alp_accuracy import (
    GPU,
    LATENCY_LOAD_MAX,
    TARGETS,
    _cases,
    _profile_docs,
    latency_seed,
)
from bench.accuracy.alp_truth import (
    CAP_PRECISION,
    CAP_PRECISION_QUICK,
    LATENCY_SE,
    LATENCY_SE_QUICK,
    EvalJob,
    evaluate,
)
from bench.accuracy.cases import Alloc
from bench.accuracy.pick_knowledge import Learned, checkpoint, learn, progress, reprofile
from bench.accuracy.pick_report import (
    Judged,
    band_coverage,
    borrowed,
    point_docs,
    summary,
)

LOADS, QUICK_LOADS = (0.2, 0.4, 0.6, 0.8), (0.4, 0.8)  # of predicted T_w
MAX_WORKERS = 2  # the bench shares two cores
SETS = ("search_picks", "held_out")


@dataclass(frozen=True)
class Scope:
    """What a run judges: cluster sizes, rates (fractions of the largest feasible), held-out
    allocations per workflow (the first ones), loads (fractions of predicted ``T_w``)."""

    quick: bool
    sizes: tuple[int, ...]
    rate_fractions: tuple[float, ...]
    held_out: int
    loads: tuple[float, ...]

    @classmethod
    def of(cls, quick: bool, **given: Any) -> Scope:
        """The full run's scope or ``--quick``'s, with any field ``given`` (not None) instead."""
        base = cls(
            quick,
            pick_sets.QUICK_SIZES if quick else pick_sets.SIZES,
            pick_sets.QUICK_RATE_FRACTIONS if quick else pick_sets.RATE_FRACTIONS,
            pick_sets.QUICK_HELD_OUT if quick else max(map(len, pick_sets.HELD_OUT.values())),
            QUICK_LOADS if quick else LOADS,
        )
        return replace(base, **{k: v for k, v in given.items() if v is not None})


def judged_allocations(k: Learned, scope: Scope, sets: Sequence[str] = SETS) -> list[Judged]:
    """One workflow's allocations in ``sets``: the search's distinct picks (the search runs
    only where they are judged), then the held-out ones."""
    entries: list[tuple[str, Alloc, dict[str, Any]]] = []
    if "search_picks" in sets:
        entries += [
            ("search_picks", p.allocation, {"picked_at": list(p.picked_at)})
            for p in pick_sets.search_picks(k.pipe, k.book, scope.sizes, scope.rate_fractions)
        ]
    if "held_out" in sets:
        held = pick_sets.HELD_OUT[k.case.workflow][: scope.held_out]
        entries += [("held_out", a, {}) for a in held]
    case = replace(k.case, allocations=[a for _, a, _ in entries])
    return [Judged(case.workflow, s, i, case, ctx) for i, (s, _, ctx) in enumerate(entries)]


def eval_jobs(k: Learned, j: Judged, scope: Scope) -> list[EvalJob]:
    """The capacity job and the latency jobs (at ``LOADS`` of predicted ``T_w``) of ``j``, with
    the fitted bench's seeds and run lengths."""
    quick = scope.quick
    lengths: dict[str, Any] = (
        {"cap_stretches": 0, "latency_window_latencies": 0.0, "replications": 1} if quick else {}
    )
    cap = k.predict(j.case.allocations[j.index], None).throughput
    i = j.index
    out = [
        EvalJob(
            j.case,
            i,
            1.0,
            "capacity",
            cap,
            seed=100 + 10 * i,
            settle_s=k.settle_s,
            precision=CAP_PRECISION_QUICK if quick else CAP_PRECISION,
            **lengths,
        )
    ]
    for n, f in enumerate(scope.loads):
        out.append(
            EvalJob(
                j.case,
                i,
                f,
                "latency",
                f * cap,
                seed=latency_seed(i, n),
                settle_s=k.settle_s,
                latency_se=LATENCY_SE_QUICK if quick else LATENCY_SE,
                **lengths,
            )
        )
    return out


def _stage_check(job: EvalJob, k: Learned) -> dict[str, dict[str, float]]:
    """``pick_sets.stage_check`` at a latency job's rate, over the case's latency-run length."""
    alloc = job.case.allocations[job.alloc_index]
    pred = k.predict(alloc, job.rate)
    n = job.case.eval_requests * 2
    warmup = max(k.settle_s, 0.1 * n / max(job.rate, 1e-9))
    return pick_sets.stage_check(job.case, k.pipe, alloc, pred, n, warmup, job.seed)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quick", action="store_true", help="a smoke run (see the module doc)")
    ap.add_argument("--workers", type=int, default=MAX_WORKERS, help=f"at most {MAX_WORKERS}")
    ap.add_argument("--workflows", nargs="*", choices=[c.workflow for c in _cases()])
    ap.add_argument(
        "--profiles-from",
        type=Path,
        help="an earlier run's alp_picks.json, alp_accuracy.json or profiles.json (same mode): "
        "reuse its profile points for the keys it holds, profile the rest",
    )
    ap.add_argument("--sizes", nargs="+", type=int, help="GPUs (default 4 8 16; quick: 4)")
    ap.add_argument("--rate-fractions", nargs="+", type=float, help="of the largest feasible rate")
    ap.add_argument("--held-out", type=int, help="held-out allocations per workflow")
    ap.add_argument("--loads", nargs="+", type=float, help="of predicted T_w")
    ap.add_argument("--sets", nargs="+", choices=SETS, default=list(SETS), help="sets to judge")
    args = ap.parse_args(argv)
    scope = Scope.of(
        args.quick,
        sizes=tuple(args.sizes) if args.sizes else None,
        rate_fractions=tuple(args.rate_fractions) if args.rate_fractions else None,
        held_out=args.held_out,
        loads=tuple(args.loads) if args.loads else None,
    )
    started = time.perf_counter()
    cases = [c for c in _cases() if not args.workflows or c.workflow in args.workflows]
    with ProcessPoolExecutor(max_workers=max(1, min(args.workers, MAX_WORKERS))) as pool:
        learned, docs = learn(pool, cases, args.quick, args.profiles_from, args.out)
        judged = [j for k in learned.values() for j in judged_allocations(k, scope, args.sets)]
        fitted = learned
        wanted: dict[str, list[Alloc]] = {}
        for j in judged:
            wanted.setdefault(j.workflow, []).append(j.case.allocations[j.index])
        learned, re_jobs, re_points = reprofile(
            pool, fitted, wanted, args.quick, args.profiles_from
        )
        docs += _profile_docs(re_jobs, re_points)
        checkpoint(args.out, args.quick, docs)
        profile_s = time.perf_counter() - started
        jobs = {id(j): eval_jobs(learned[j.workflow], j, scope) for j in judged}
        flat = [ev for j in judged for ev in jobs[id(j)]]
        # capacity jobs first: each is a sequence of runs, the longest jobs
        order = sorted(range(len(flat)), key=lambda n: flat[n].kind != "capacity")
        progress(f"profiled in {profile_s:.0f} s; {len(judged)} allocations, {len(flat)} jobs")
        results: dict[int, dict[str, Any]] = {}
        for count, (n, sim) in enumerate(
            zip(order, pool.map(evaluate, [flat[n] for n in order], chunksize=1), strict=True), 1
        ):
            results[n] = sim
            ev = flat[n]
            progress(
                f"{count}/{len(flat)} {ev.case.workflow} allocation {ev.alloc_index} {ev.kind} "
                f"{ev.fraction:.1f} ({time.perf_counter() - started:.0f} s)"
            )
        # the per-model check at each allocation's highest load at or under LATENCY_LOAD_MAX
        tops = [
            max(
                (
                    ev
                    for ev in jobs[id(j)]
                    if ev.kind == "latency" and ev.fraction <= LATENCY_LOAD_MAX + 1e-9
                ),
                key=lambda ev: ev.fraction,
            )
            for j in judged
        ]
        stages = list(
            pool.map(_stage_check, tops, [learned[j.workflow] for j in judged], chunksize=1)
        )
    sims = [results[n] for n in range(len(flat))]
    report: dict[str, Any] = {
        "label": "simulated",
        "gpu": GPU,
        "quick": args.quick,
        "scope": asdict(scope),
        "pipelines": {w: asdict(k.pipe) for w, k in learned.items()},
        "profiles_reused_from": str(args.profiles_from or ""),
        "targets": TARGETS,
        "profiled_keys": "the fitted set's (bench.accuracy.alp_accuracy), then the keys the "
        "daemon's reprofiler profiles for the judged allocations (bench.accuracy.pick_reprofile, "
        "alone, then packed where the simulator packs copies): other shares are scaled; "
        "<set>_borrowed: the same truth predicted with the fitted set's keys only",
        "reprofiled_keys": sorted(
            {
                (
                    job.case.workflow,
                    job.model,
                    job.tp,
                    job.share,
                    "alone" if job.alone else "packed",
                )
                for job in re_jobs
            }
        ),
        "sets": {s: {} for s in args.sets},
        "summary": {s: {} for s in args.sets} | {f"{s}_borrowed": {} for s in args.sets},
    }
    pos = 0
    errors: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    for j, stage in zip(judged, stages, strict=True):
        js = jobs[id(j)]
        doc, thr, lat = point_docs(learned[j.workflow], j, js, sims[pos : pos + len(js)])
        pos += len(js)
        doc["stage_check"] = {
            "load": max(
                ev.fraction
                for ev in js
                if ev.kind == "latency" and ev.fraction <= LATENCY_LOAD_MAX + 1e-9
            ),
            "models": stage,
        }
        doc["borrowed"], b_thr, b_lat = borrowed(
            fitted[j.workflow], j.case.allocations[j.index], doc
        )
        report["sets"][j.set].setdefault(j.workflow, []).append(doc)
        for name, t, ls in ((j.set, thr, lat), (f"{j.set}_borrowed", b_thr, b_lat)):
            thr_errors, lat_errors = errors.setdefault((name, j.workflow), ([], []))
            thr_errors.append(t)
            lat_errors.extend(ls)
    for (s, wf), (thr_errors, lat_errors) in sorted(errors.items()):
        report["summary"][s][wf] = summary(thr_errors, lat_errors)
        if s in report["sets"]:
            report["summary"][s][wf] |= band_coverage(report["sets"][s][wf])
    report["profile_points"] = docs
    report["profile_s"] = round(profile_s, 1)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    (args.out / "alp_picks.json").write_bytes(
        orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
    )
    print(
        orjson.dumps(
            {k: report[k] for k in ("label", "quick", "summary", "wall_s")},
            option=orjson.OPT_INDENT_2,
        ).decode()
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

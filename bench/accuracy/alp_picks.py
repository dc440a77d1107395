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
exponents would be other models'), each measured alone (``bench.accuracy.pick_reprofile``).
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

``--sets held_out`` judges one set. ``--quick`` (a smoke run, under ten minutes on two
cores): 4 GPUs only, two rates, two held-out allocations per workflow, two loads, the fitted
bench's quick windows; its errors are indicative.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson

from bench.accuracy import pick_reprofile, pick_sets
from bench.accuracy.alp_accuracy import (
    GPU,
    LATENCY_LOAD_MAX,
    PROFILES_FILE,
    SETTLE_LATENCIES,
    TARGETS,
    _cases,
    _job_key,
    _profile_docs,
    _profile_jobs,
    _reused_points,
    _trace,
    latency_seed,
    quick_cases,
)
from bench.accuracy.alp_truth import (
    CAP_PRECISION,
    CAP_PRECISION_QUICK,
    LATENCY_SE,
    LATENCY_SE_QUICK,
    EvalJob,
    evaluate,
    sim_allocation,
)
from bench.accuracy.cases import Alloc, Case
from optimizer.model import colocation
from optimizer.model.alp import ModelAlloc, Pipeline, Prediction, predict
from optimizer.model.colocation import Placed
from optimizer.model.curves import ProfileBook
from optimizer.stats.figures import WorkflowStats
from shared.profile_points import ProfilePoint, packed_copies
from sim.cluster import place
from sim.profiling import ProfileJob, run_profile

LOADS, QUICK_LOADS = (0.2, 0.4, 0.6, 0.8), (0.4, 0.8)  # of predicted T_w
MAX_WORKERS = 2  # the bench shares two cores
SETS = ("search_picks", "held_out")
# a figure within this of the prediction's uncertainty band counts as inside it (the
# simulated truth's own precision: 3-5% standard error, CAP_PRECISION 3-10%)
BAND_TOL = 0.05


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _err(pred: float, sim: float) -> float:
    return abs(pred - sim) / sim if sim > 0 else float("inf")


def summary(throughput_errors: Sequence[float], latency_errors: Sequence[float]) -> dict[str, Any]:
    """Max and median relative error of max throughput and of mean latency (<= 80% load)."""

    def stats(xs: Sequence[float]) -> tuple[float, float]:
        return (max(xs), statistics.median(xs)) if xs else (float("nan"), float("nan"))

    t_max, t_med = stats(throughput_errors)
    l_max, l_med = stats(latency_errors)
    return {
        "throughput_error_max": t_max,
        "throughput_error_median": t_med,
        "latency_error_max": l_max,
        "latency_error_median": l_med,
        "allocations": len(throughput_errors),
        "latency_points": len(latency_errors),
        "meets_targets": t_max <= TARGETS["throughput_error_max"]
        and l_max <= TARGETS["latency_error_max"],
    }


def band_coverage(docs: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The share of throughput and latency figures (<= 80% load) inside the prediction's
    uncertainty band (``within_band``)."""
    thr = [d["throughput"]["within_band"] for d in docs]
    lat = [
        p["within_band"] for d in docs for p in d["latency"] if p["load"] <= LATENCY_LOAD_MAX + 1e-9
    ]
    return {
        "throughput_within_band": sum(thr) / len(thr) if thr else math.nan,
        "latency_within_band": sum(lat) / len(lat) if lat else math.nan,
    }


def _doc(alloc: Alloc) -> dict[str, dict[str, float]]:
    return {m: ModelAlloc(*row).doc() for m, row in alloc.items()}


def _allocation(alloc: Alloc) -> dict[str, ModelAlloc]:
    return {m: ModelAlloc(*row) for m, row in alloc.items()}


def placed(case: Case, alloc: Alloc) -> tuple[Placed, ...]:
    """The replicas of ``alloc`` where the simulator places them (``sim.cluster.place``)."""
    return tuple(
        Placed(spec.model, "sim", gpus, spec.share, spec.tp)
        for spec, gpus in place(sim_allocation(case, alloc))
    )


@dataclass(frozen=True)
class Learned:
    """What the optimizer knows of one workflow after tracing and profiling."""

    case: Case  # the workflow's case (quick or full run lengths)
    pipe: Pipeline
    book: ProfileBook
    settle_s: float  # a few light-load request latencies: the pipeline's fill
    points: tuple[ProfilePoint, ...]  # what ``book`` is made of
    # the trace's statistics (``pipe`` is made of them) and figures (``alp_plan._trace``'s):
    # what new profiling jobs need; None where only predictions are made (``picks_replay``)
    stats: WorkflowStats | None = None
    trace: dict[str, Any] = field(default_factory=dict)

    def with_points(self, points: Sequence[ProfilePoint]) -> Learned:
        """The same knowledge with ``points`` added to the book (``pick_reprofile``)."""
        if not points:
            return self
        every = (*self.points, *points)
        return replace(self, book=ProfileBook(every), points=every)

    def predict(self, alloc: Alloc, rate: float | None) -> Prediction:
        """The ALP's prediction for ``alloc`` where the simulator places it, each model read
        between its alone and packed curves by its neighbours' load
        (:mod:`optimizer.model.colocation`) at ``rate`` (``None``: at the workflow's own
        capacity, for ``T_w``)."""
        allocation = _allocation(alloc)
        where = placed(self.case, alloc)
        busy = (
            colocation.capacity_weights(self.pipe, self.book, allocation, where)
            if rate is None
            else colocation.placed_weights(
                {self.pipe.workflow: self.pipe}, self.book, where, {self.pipe.workflow: rate}
            )
        )
        return predict(self.pipe, self.book, allocation, rate or 0.0, busy=busy)


def _run_profiles(
    pool: Executor, jobs: Sequence[ProfileJob], reused_from: Path | None, stage: str
) -> list[list[ProfilePoint]]:
    """Each job's profile points: an earlier run's where ``reused_from`` holds its key,
    else profiled in ``pool`` (longest first, so the pool does not end on one long job)."""
    reused = _reused_points(reused_from)
    done = {j: reused[_job_key(job)] for j, job in enumerate(jobs) if _job_key(job) in reused}
    order = sorted(
        (j for j in range(len(jobs)) if j not in done), key=lambda j: -jobs[j].target_calls
    )
    _progress(f"{stage}; profiling {len(order)} keys ({len(done)} reused)")
    done.update(zip(order, pool.map(run_profile, [jobs[j] for j in order]), strict=True))
    return [list(done[j]) for j in range(len(jobs))]


def _checkpoint(out: Path, quick: bool, docs: Sequence[dict[str, Any]]) -> None:
    """The profile points so far, for a later run's ``--profiles-from``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / PROFILES_FILE).write_bytes(
        orjson.dumps(
            {"label": "simulated", "quick": quick, "profile_points": list(docs)},
            option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY,
        )
    )


def reprofile(
    pool: Executor,
    learned: Mapping[str, Learned],
    judged: Sequence[Judged],
    quick: bool,
    reused_from: Path | None,
) -> tuple[dict[str, Learned], list[ProfileJob], list[list[ProfilePoint]]]:
    """Per workflow, the knowledge after the daemon's reprofiler ran for the judged
    allocations' keys (:mod:`bench.accuracy.pick_reprofile`), and the jobs and points."""
    jobs = [
        job
        for w, k in learned.items()
        if k.stats is not None
        for job in pick_reprofile.reprofile_jobs(
            k.case,
            k.stats,
            k.trace,
            k.book,
            [j.case.allocations[j.index] for j in judged if j.workflow == w],
            GPU,
            quick,
        )
    ]
    profiled = _run_profiles(pool, jobs, reused_from, "reprofiling the uncovered keys")
    after = {
        w: k.with_points(
            [
                p
                for job, pts in zip(jobs, profiled, strict=True)
                if job.case.workflow == w
                for p in pts
            ]
        )
        for w, k in learned.items()
    }
    return after, jobs, profiled


def learn(
    pool: Executor, cases: Sequence[Case], quick: bool, reused_from: Path | None, out: Path
) -> tuple[dict[str, Learned], list[dict[str, Any]]]:
    """Trace and profile every workflow over the fitted set's keys (reusing the points of
    ``reused_from`` where it holds a key), write the profiling checkpoint to ``out``; the
    knowledge per workflow and the profile points as documents."""
    keyed = {c.workflow: c.allocations for c in _cases()}
    run = quick_cases(cases) if quick else list(cases)
    traced = list(pool.map(_trace, run))
    jobs = [
        job
        for case, (stats, info) in zip(run, traced, strict=True)
        for job in _profile_jobs(
            replace(case, allocations=keyed[case.workflow]), stats, info, quick
        )
    ]
    # a share that packs copies onto a GPU is measured alone too: the prediction reads each
    # replica between the two ends by how busy its placed neighbours are
    jobs += [replace(job, alone=True) for job in jobs if packed_copies(job.share) > 1]
    profiled = _run_profiles(pool, jobs, reused_from, "traced")
    docs = _profile_docs(jobs, profiled)
    _checkpoint(out, quick, docs)
    learned = {}
    for case, (stats, info) in zip(run, traced, strict=True):
        points = tuple(
            p
            for job, pts in zip(jobs, profiled, strict=True)
            if job.case.workflow == case.workflow
            for p in pts
        )
        learned[case.workflow] = Learned(
            case,
            Pipeline.from_stats(stats),
            ProfileBook(points),
            SETTLE_LATENCIES * info["latency_mean_s"],
            points,
            stats,
            info,
        )
    return learned, docs


@dataclass(frozen=True)
class Judged:
    """One allocation to judge: its set, where it came from, and the Case that holds it."""

    workflow: str
    set: str
    index: int  # in ``case.allocations``
    case: Case  # the workflow's case holding every judged allocation (alp_truth indexes it)
    context: dict[str, Any]


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


def judged_allocations(k: Learned, scope: Scope) -> list[Judged]:
    """One workflow's allocations: the search's distinct picks, then the held-out ones."""
    entries: list[tuple[str, Alloc, dict[str, Any]]] = [
        ("search_picks", p.allocation, {"picked_at": list(p.picked_at)})
        for p in pick_sets.search_picks(k.pipe, k.book, scope.sizes, scope.rate_fractions)
    ]
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


def borrowed(
    k: Learned, alloc: Alloc, doc: dict[str, Any]
) -> tuple[dict[str, Any], float, list[float]]:
    """``alloc`` (judged in ``doc``) predicted with the fitted set's keys only (``k``: before
    the reprofiler ran), against the same simulated figures: its capacity and each latency
    point's prediction at the point's rate, with their errors."""
    cap = k.predict(alloc, None).throughput
    thr_err = _err(cap, doc["throughput"]["simulated"])
    out: dict[str, Any] = {
        "curves": pick_sets.provenance(k.book, alloc),
        "throughput": {"predicted": cap, "error": thr_err},
        "latency": [],
    }
    lat_errs = []
    for point in doc["latency"]:
        pred = k.predict(alloc, point["rate"]).latency
        err = _err(pred, point["simulated"])
        if point["load"] <= LATENCY_LOAD_MAX + 1e-9:
            lat_errs.append(err)
        out["latency"].append({"load": point["load"], "predicted": pred, "error": err})
    return out, thr_err, lat_errs


def _point_docs(
    k: Learned, j: Judged, jobs: Sequence[EvalJob], sims: Sequence[dict[str, Any]]
) -> tuple[dict[str, Any], float, list[float]]:
    alloc = j.case.allocations[j.index]
    doc: dict[str, Any] = {
        "set": j.set,
        "allocation": _doc(alloc),
        "curves": pick_sets.provenance(k.book, alloc),
        **j.context,
        "latency": [],
    }
    thr_err = math.nan
    lat_errs: list[float] = []
    for ev, sim in zip(jobs, sims, strict=True):
        if ev.kind == "capacity":
            thr_err = _err(ev.rate, sim["capacity"])
            low = k.predict(alloc, None).capacity_low
            doc["throughput"] = {
                "predicted": ev.rate,
                "simulated": sim["capacity"],
                "error": thr_err,
                "signed_error": (ev.rate - sim["capacity"]) / sim["capacity"],
                # the share model's band: the truth between the slow end and the prediction
                "predicted_low": low,
                "within_band": low * (1 - BAND_TOL) <= sim["capacity"] <= ev.rate * (1 + BAND_TOL),
                "simulated_kept_up_at": sim["kept_up_at"],
                "simulated_overloaded_at": sim["overloaded_at"],
                "simulated_backlog_throughput": sim["backlog_throughput"],
            }
            continue
        pred = k.predict(alloc, ev.rate)
        err = _err(pred.latency, sim["latency_mean"])
        if ev.fraction <= LATENCY_LOAD_MAX + 1e-9:
            lat_errs.append(err)
        doc["latency"].append(
            {
                "load": ev.fraction,
                "rate": ev.rate,
                "predicted": pred.latency,
                "simulated": sim["latency_mean"],
                "simulated_se": sim["latency_se"],
                "error": err,
                "signed_error": (pred.latency - sim["latency_mean"]) / sim["latency_mean"],
                "predicted_high": pred.latency_high,
                "within_band": pred.latency * (1 - BAND_TOL)
                <= sim["latency_mean"]
                <= pred.latency_high * (1 + BAND_TOL),
                "bottleneck": pred.bottleneck,
                "requests": sim["requests"],
            }
        )
    return doc, thr_err, lat_errs


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
        judged = [
            j for k in learned.values() for j in judged_allocations(k, scope) if j.set in args.sets
        ]
        fitted = learned
        learned, re_jobs, re_points = reprofile(
            pool, fitted, judged, args.quick, args.profiles_from
        )
        docs += _profile_docs(re_jobs, re_points)
        _checkpoint(args.out, args.quick, docs)
        profile_s = time.perf_counter() - started
        jobs = {id(j): eval_jobs(learned[j.workflow], j, scope) for j in judged}
        flat = [ev for j in judged for ev in jobs[id(j)]]
        # capacity jobs first: each is a sequence of runs, the longest jobs
        order = sorted(range(len(flat)), key=lambda n: flat[n].kind != "capacity")
        _progress(f"profiled in {profile_s:.0f} s; {len(judged)} allocations, {len(flat)} jobs")
        results: dict[int, dict[str, Any]] = {}
        for count, (n, sim) in enumerate(
            zip(order, pool.map(evaluate, [flat[n] for n in order], chunksize=1), strict=True), 1
        ):
            results[n] = sim
            ev = flat[n]
            _progress(
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
        "alone): other shares are scaled; <set>_borrowed: the same truth predicted with the "
        "fitted set's keys only",
        "reprofiled_keys": sorted(
            {(job.case.workflow, job.model, job.tp, job.share) for job in re_jobs}
        ),
        "sets": {s: {} for s in args.sets},
        "summary": {s: {} for s in args.sets} | {f"{s}_borrowed": {} for s in args.sets},
    }
    pos = 0
    errors: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    for j, stage in zip(judged, stages, strict=True):
        js = jobs[id(j)]
        doc, thr, lat = _point_docs(learned[j.workflow], j, js, sims[pos : pos + len(js)])
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

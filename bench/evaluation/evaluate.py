"""Benchmark: the paper's §7 comparisons, reproduced on the discrete-event simulator.

``python -m bench.evaluation.evaluate --out DIR [--quick]`` writes ``DIR/evaluation.json`` (every point
and ``summary[workflow][gpus][system]``), ``DIR/evaluation.md`` (tables next to the paper's
figures, and where Scepsy falls short) and PNG curves (``curves_*.png``, ``dynamic.png``).
Every figure is *simulated*.

Workflows: beam search, RAG + reranker, and both at once (beam fixed, RAG swept), on 4, 8 and
16 emulated A6000 GPUs (``--quick``: 4 GPUs, 5 rates, shorter runs, fewer profile calls).
Systems (``bench.evaluation.setup.SYSTEMS``): Scepsy as shipped (trace store -> stats, profiles by
simulation, search + placement per rate: ``bench.evaluation.scepsy``), the Kubernetes HPA run
dynamically (``sim.hpa`` on ``sim.dynamic``), per-LLM independent sizing and an even split
(``bench.evaluation.static``), Ayo (the even split without prefix caching, workflow-aware
scheduling), Aegaeon at each prefill/decode split (``sim.multiplex``), and Scepsy without
TP / fractions / both. Rates are fractions of
Scepsy's predicted capacity on each cluster (combined: of RAG's capacity beside beam at its own
rate, ``bench.evaluation.scepsy.capacity_beside``); every system runs the same rates with the
same seeds, and Ayo and Aegaeon also a few rates below them (``BELOW_SWEEP_FRACTIONS``). A second scenario (``bench.evaluation.daemon``) steps the RAG rate while beam holds steady and
compares the daemon's decisions with the autoscaler over time (run alongside the points). A
series of points (one system, workflow and cluster) stops after 2 consecutive rates it does
not sustain. Profiles are cached under ``--cache``, keyed by the settings and the
contents of the sources they depend on (``--fresh`` recomputes). ``--report-only`` re-renders
the summary and report of an earlier run from its ``evaluation.json`` (of an interrupted one,
from the points it logged, labelled partial), with ``--merge RUN ...`` taking the series it
lacks from earlier runs on the same rates (:mod:`bench.evaluation.merge`), and shows the knees
:mod:`bench.evaluation.knee` wrote into DIR; ``--resume`` continues an interrupted run with
its profiles and the points it logged.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import (
    FIRST_COMPLETED,
    Executor,
    Future,
    ProcessPoolExecutor,
    ThreadPoolExecutor,
    wait,
)
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson

from bench.evaluation.daemon import scenario
from bench.evaluation.dynamic_report import plot_dynamic
from bench.evaluation.jobs import point_jobs
from bench.evaluation.knee import KNEE_FILE, knee_lines
from bench.evaluation.merge import MergeError, merge_docs
from bench.evaluation.report import markdown, plot_curves, summarise
from bench.evaluation.runs import HPA_SYSTEMS, PointJob, run_point
from bench.evaluation.scepsy import (
    Knowledge,
    knowledge_doc,
    knowledge_key,
    learn,
)
from bench.evaluation.setup import (
    DYNAMIC_GPUS,
    FULL,
    QUICK,
    QUICK_RATE_FRACTIONS,
    QUICK_SIZES,
    RATE_FRACTIONS,
    SIZES,
    SYSTEMS,
    WORKFLOWS,
    RunLengths,
)


def _cost(job: PointJob) -> float:
    """Rough simulated work, to start the longest jobs first."""
    hpa = job.system in HPA_SYSTEMS
    per_s = job.rate * (40.0 if job.kind == "beam" else 1.0) + job.beam_rate * 40.0
    span = (
        (job.lengths.hpa_warmup_s + job.lengths.hpa_window_s)
        if hpa
        else job.lengths.requests["beam" if job.kind == "beam" else "rag"] / job.rate
    )
    return per_s * span


STOP_AFTER = 2  # a series stops after this many consecutive rates it did not sustain


def _point_key(system: str, kind: str, gpus: int, rate: float) -> tuple[str, str, int, float]:
    return system, kind, gpus, round(rate, 9)


def _run_points(
    pool: Executor,
    jobs: Sequence[PointJob],
    workers: int,
    run: Callable[[PointJob], dict[str, Any]] = run_point,
    log: Path | None = None,
    prior: Sequence[dict[str, Any]] = (),
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run every series (one system, workflow and cluster size) up its rates, and stop a
    series after ``STOP_AFTER`` consecutive rates it did not sustain: the rates above carry
    no peak and no equal-rate latency, and an overloaded point is the costliest to simulate
    (its backlog grows). Series run side by side, at most ``workers`` points at once, smaller
    clusters first (an interrupted run has whole cluster sizes), then the series with the
    most simulated work left. Returns the points run (in ``jobs`` order) and the rates
    skipped; each point is also appended to ``log`` (JSON lines) as it finishes. ``prior``:
    points an interrupted run finished (``--resume``): a job they hold is taken from them,
    not run again, and counts towards its series' stop as if it had run. Progress goes to
    stderr about every tenth of the points."""
    known = {_point_key(p["system"], p["workflow"], p["gpus"], p["rate"]): p for p in prior}
    series: dict[tuple[str, str, int], list[int]] = {}
    for i in sorted(range(len(jobs)), key=lambda i: jobs[i].rate):
        series.setdefault((jobs[i].system, jobs[i].kind, jobs[i].gpus), []).append(i)
    failed = dict.fromkeys(series, 0)
    running: dict[Future[dict[str, Any]], tuple[tuple[str, str, int], int]] = {}
    done: dict[int, dict[str, Any]] = {}
    skipped: list[dict[str, Any]] = []
    started, step = time.perf_counter(), max(1, len(jobs) // 10)

    def settle(key: tuple[str, str, int], i: int, point: dict[str, Any]) -> None:
        done[i] = point
        failed[key] = 0 if point["sustained"] else failed[key] + 1
        if failed[key] >= STOP_AFTER and key in series:
            skipped.extend(
                {"system": key[0], "workflow": key[1], "gpus": key[2], "rate": jobs[j].rate}
                for j in series.pop(key)
            )

    while series or running:
        busy = {key for key, _ in running.values()}
        idle = [key for key in series if key not in busy]
        for key in sorted(idle, key=lambda k: (k[2], -sum(_cost(jobs[i]) for i in series[k]))):
            while key in series and len(running) < workers:
                i = series[key].pop(0)
                if not series[key]:
                    del series[key]
                old = known.get(_point_key(key[0], key[1], key[2], jobs[i].rate))
                if old is None:
                    running[pool.submit(run, jobs[i])] = (key, i)
                    break
                settle(key, i, old)
        if not running:
            continue
        finished, _ = wait(running, return_when=FIRST_COMPLETED)
        for fut in finished:
            key, i = running.pop(fut)
            point = fut.result()
            if log is not None:
                with log.open("ab") as f:
                    f.write(orjson.dumps(point, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
            settle(key, i, point)
            if len(done) % step == 0:
                print(
                    f"[evaluate] points {len(done)} run, {len(skipped)} skipped, of "
                    f"{len(jobs)} ({time.perf_counter() - started:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
    return [done[i] for i in sorted(done)], skipped


def _cpu_s() -> float:
    """CPU seconds of this process and its live children (the pool's workers; Linux /proc):
    on a shared machine, what a phase costs independent of the load."""
    total = sum(os.times()[:2])
    tick = os.sysconf("SC_CLK_TCK")
    for children in Path("/proc/self/task").glob("*/children"):
        for pid in children.read_text().split():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def _point_wall(points: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Simulation seconds spent per workflow, cluster size and system (where the time goes)."""
    out: dict[str, float] = {}
    for p in points:
        key = f"{p['workflow']}/{p['gpus']}/{p['system']}"
        out[key] = round(out.get(key, 0.0) + p["wall_s"], 1)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _knowledge(
    pool: Executor, args: argparse.Namespace, lengths: RunLengths
) -> tuple[Knowledge, str]:
    """Traces and profiles: all from DIR/knowledge.json (``--reuse-profiles``); else traced,
    with the profiles from the cache when it holds this key (the same settings and sources:
    the same seeded result), else profiled and cached. Also says where they came from."""
    mine = args.out / "knowledge.json"
    if args.reuse_profiles and mine.exists():
        return learn(pool, lengths.profile_calls, args.quick, mine, reuse=True), str(mine)
    key = knowledge_key(lengths.profile_calls, args.quick)
    cached = args.cache / f"knowledge-{'quick' if args.quick else 'full'}-{key}.json"
    if cached.exists() and not args.fresh:
        k = learn(pool, lengths.profile_calls, args.quick, mine, profiled=cached)
        return k, f"traced; profiles from the cache {cached} (key {key})"
    k = learn(pool, lengths.profile_calls, args.quick, mine)
    args.cache.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(mine, cached)
    return k, f"traced and profiled (cached as key {key})"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="4 GPUs, 5 rates, shorter runs (under 10 minutes on 2 cores)",
    )
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--sizes", type=int, nargs="*", help="cluster sizes (default 4 8 16)")
    ap.add_argument("--workflows", nargs="*", choices=WORKFLOWS, default=list(WORKFLOWS))
    ap.add_argument(
        "--systems",
        nargs="*",
        choices=SYSTEMS,
        default=list(SYSTEMS),
        help="systems to run (default: all; a subset gives a partial comparison)",
    )
    ap.add_argument("--rates", type=float, nargs="*", help="fractions of Scepsy's capacity")
    ap.add_argument("--no-dynamic", action="store_true", help="skip the dynamic scenario")
    ap.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply run lengths (requests per point, autoscaler windows)",
    )
    ap.add_argument(
        "--reuse-profiles",
        action="store_true",
        help="reuse DIR/knowledge.json from an earlier run with the same mode",
    )
    ap.add_argument(
        "--cache",
        type=Path,
        default=Path.home() / ".cache" / "scepsy-eval",
        help="where traces and profiles are cached, keyed by the settings and the "
        "sources they depend on (bench.evaluation.scepsy.knowledge_key)",
    )
    ap.add_argument(
        "--fresh",
        action="store_true",
        help="trace and profile afresh even when the cache holds the same key",
    )
    ap.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted run of the same command in DIR: its knowledge.json "
        "and the points its points.jsonl holds are reused, the rest is run",
    )
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="re-render DIR/evaluation.md (and the summary) from DIR/evaluation.json",
    )
    ap.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        metavar="RUN",
        help="with --report-only: take from these earlier runs' directories the series DIR's "
        "run lacks; a series in several runs comes whole from the last named",
    )
    args = ap.parse_args(argv)
    if args.merge and not args.report_only:
        ap.error("--merge renders a report: it needs --report-only")
    if args.report_only:
        try:
            return _rerender(args.out, args.merge or ())
        except MergeError as e:  # runs that cannot share a report: one line, not a traceback
            print(f"evaluate: {e}", file=sys.stderr)
            return 2
    partial = args.out / "points.jsonl"
    prior: list[dict[str, Any]] = []
    if args.resume:
        args.reuse_profiles = True  # the same profiles, so the same rates and allocations
        if partial.exists():
            prior = _read_points(partial)
        print(f"[evaluate] resuming: {len(prior)} points logged earlier", file=sys.stderr)
    started = time.perf_counter()
    lengths = QUICK if args.quick else FULL
    command = "python -m bench.evaluation.evaluate " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    if args.scale != 1.0:
        lengths = replace(
            lengths,
            requests={k: max(1, round(v * args.scale)) for k, v in lengths.requests.items()},
            hpa_warmup_s=lengths.hpa_warmup_s * args.scale,
            hpa_window_s=lengths.hpa_window_s * args.scale,
        )
    sizes = tuple(args.sizes or (QUICK_SIZES if args.quick else SIZES))
    fractions = tuple(args.rates or (QUICK_RATE_FRACTIONS if args.quick else RATE_FRACTIONS))
    args.out.mkdir(parents=True, exist_ok=True)
    phases: dict[str, float] = {}
    cpu: dict[str, float] = {}
    cpu0 = _cpu_s()

    def phase(name: str) -> None:
        """Record the phase that just ended, and say so on stderr (long runs show progress)."""
        phases[name] = time.perf_counter() - started - sum(phases.values())
        cpu[name] = _cpu_s() - cpu0 - sum(cpu.values())
        print(
            f"[evaluate] {name}: {phases[name]:.1f} s, {cpu[name]:.0f} CPU s (total "
            f"{time.perf_counter() - started:.1f} s, load {os.getloadavg()[0]:.2f})",
            file=sys.stderr,
            flush=True,
        )

    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        k, knowledge_from = _knowledge(pool, args, lengths)
        phase("trace_and_profile")
        jobs: list[PointJob] = []
        sweeps: dict[str, Any] = {}
        for gpus in sizes:
            for kind in args.workflows:
                js, info = point_jobs(k, gpus, kind, fractions, lengths, args.systems)
                jobs += js
                sweeps.setdefault(kind, {})[str(gpus)] = info
        phase("plan")
        if not args.resume:
            partial.unlink(missing_ok=True)
        (args.out / "run_meta.json").write_bytes(
            orjson.dumps(
                {
                    "command": command,
                    "workers": args.workers,
                    "quick": args.quick,
                    "rate_fractions": fractions,
                    "sweeps": sweeps,
                }
            )
        )
        # The dynamic scenario's two long runs go to the pool first and the points fill the
        # workers around them (run after the points, one worker idled while the longer ran).
        saved = args.out / DYNAMIC_FILE
        with ThreadPoolExecutor(1) as side:
            pending = (
                None
                if args.no_dynamic
                else side.submit(_saved_scenario, k, pool, args.quick, saved, args.resume)
            )
            points, skipped = _run_points(pool, jobs, args.workers, log=partial, prior=prior)
            phase("points_and_dynamic" if pending else "points")
            dynamic = pending.result() if pending else None
        if pending:
            phase("dynamic_rest")
    summary, shortfalls = summarise(points)
    wall = time.perf_counter() - started
    meta = {
        "command": command,
        "wall_s": wall,
        "workers": args.workers,
        "quick": args.quick,
        "rate_fractions": fractions,
        "load_average": os.getloadavg(),
        "cpus": os.cpu_count(),
        "stop_after": STOP_AFTER,
        "skipped": len(skipped),
        "knowledge": knowledge_from,
    }
    plots = plot_curves(points, args.out)
    if dynamic is not None:
        plots.append(plot_dynamic(dynamic, args.out))
    report = {
        "label": "simulated",
        "meta": meta,
        "quick": args.quick,
        "sizes": sizes,
        "systems": SYSTEMS,
        "summary": summary,
        "shortfalls": shortfalls,
        "sweeps": sweeps,
        "points": points,
        "skipped": skipped,
        "dynamic": dynamic,
        "knowledge": knowledge_doc(k),
        "plots": plots,
        "wall_s": round(wall, 1),
        "phase_s": {p: round(v, 1) for p, v in phases.items()},
        "phase_cpu_s": {p: round(v, 1) for p, v in cpu.items()},
        "point_wall_s": _point_wall(points),
    }
    (args.out / "evaluation.json").write_bytes(
        orjson.dumps(
            report,
            option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS,
        )
    )
    (args.out / "evaluation.md").write_text(markdown(summary, shortfalls, meta, dynamic, points))
    brief = {
        wf: {
            g: {
                s: {
                    k2: round(v, 3) if isinstance(v, float) else v
                    for k2, v in e.items()
                    if k2 in ("peak_throughput", "latency_ratio_to_scepsy_median")
                }
                for s, e in by.items()
            }
            for g, by in d.items()
        }
        for wf, d in summary.items()
    }
    print(
        orjson.dumps(
            {"summary": brief, "wall_s": round(wall, 1), "phase_s": report["phase_s"]},
            option=orjson.OPT_INDENT_2,
        ).decode()
    )
    return 0


DYNAMIC_FILE = "dynamic.json"  # the dynamic scenario, written as soon as it finished


def _saved_scenario(
    k: Knowledge, pool: Executor, quick: bool, path: Path, resume: bool
) -> dict[str, Any]:
    """The dynamic scenario, written to ``path`` when it finishes (an interrupted run keeps
    it; ``--report-only`` shows it), or with ``resume`` read from ``path`` when it is there."""
    if resume and path.exists():
        got: dict[str, Any] = orjson.loads(path.read_bytes())
        return got
    dynamic = scenario(k, pool, DYNAMIC_GPUS, quick)
    path.write_bytes(orjson.dumps(dynamic, option=orjson.OPT_SERIALIZE_NUMPY))
    return dynamic


def _read_points(path: Path) -> list[dict[str, Any]]:
    """The points a run logged as it went (JSON lines)."""
    pts = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    for p in pts:  # JSON has no infinity: an unserved point's latencies came back null
        p.update({f: math.inf for f in ("latency_mean", "latency_p90") if p[f] is None})
    return pts


def _run_doc(out: Path) -> dict[str, Any]:
    """An earlier run's document: its ``evaluation.json``, or for an interrupted run one built
    from the points it finished (``points.jsonl``), labelled partial."""
    if (out / "evaluation.json").exists():
        got: dict[str, Any] = orjson.loads((out / "evaluation.json").read_bytes())
        return got
    run = orjson.loads((out / "run_meta.json").read_bytes())
    pts = _read_points(out / "points.jsonl")
    run["command"] += f" (PARTIAL: interrupted; {len(pts)} points finished)"
    saved = out / DYNAMIC_FILE
    dynamic = orjson.loads(saved.read_bytes()) if saved.exists() else None
    return {
        "label": "simulated",
        "partial": True,
        "points": pts,
        "dynamic": dynamic,
        "sweeps": run.pop("sweeps"),
        "plots": plot_curves(pts, out) + ([plot_dynamic(dynamic, out)] if dynamic else []),
        "wall_s": 0.0,
        "meta": {**run, "wall_s": 0.0},  # unknown: interrupted
    }


def _rerender(out: Path, merge: Sequence[Path] = ()) -> int:
    """The summary, shortfalls and Markdown again from the points of an earlier run (the
    report's rules changed, the runs did not); with ``merge``, the series DIR's run lacks or
    that a later-named run holds come from those runs (``bench.evaluation.merge``)."""
    doc = _run_doc(out)
    meta = doc.get("meta") or {
        "command": "python -m bench.evaluation.evaluate (an earlier run)",
        "wall_s": doc["wall_s"],
        "workers": "?",
        "rate_fractions": sorted(
            {
                round(p["rate"] / doc["sweeps"][p["workflow"]][str(p["gpus"])]["capacity"], 3)
                for p in doc["points"]
            }
        ),
    }
    if merge:
        if "runs" in meta:
            raise MergeError(f"{out}: already a merged report; merge into the unmerged run")
        others = [_run_doc(d) for d in merge]
        merged = merge_docs(
            [(str(out), {**doc, "meta": meta}), *zip(map(str, merge), others, strict=True)]
        )
        doc.update(points=merged["points"], sweeps=merged["sweeps"])
        doc["plots"] = plot_curves(doc["points"], out) + [
            f for f in doc.get("plots", []) if f.startswith("dynamic")
        ]
        meta = {**meta, "runs": merged["runs"]}
        doc["meta"] = meta
    summary, shortfalls = summarise(doc["points"])
    shown = {**meta, "command": meta["command"] + " (report re-rendered by --report-only)"}
    doc.update(summary=summary, shortfalls=shortfalls)
    (out / "evaluation.json").write_bytes(
        orjson.dumps(
            doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
        )
    )
    text = markdown(summary, shortfalls, shown, doc["dynamic"], doc["points"])
    if (out / KNEE_FILE).exists():  # bench.evaluation.knee run into this directory
        text += "\n" + "\n".join(knee_lines(orjson.loads((out / KNEE_FILE).read_bytes())))
    (out / "evaluation.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

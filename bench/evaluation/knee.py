"""Benchmark: each system's knee by bisection to 5% of rate, over several seeds, with an interval.

``python -m bench.evaluation.knee --run DIR --out OUT [--sizes 4] [--workflows beam]
[--systems scepsy hpa_warm] [--seeds 3] [--workers 2]`` starts from an evaluation run's grid
(``DIR/evaluation.json``: each series' highest sustained rate and the next rate up it did not
sustain) and, per seed, bisects between them until the bracket is within ``TOLERANCE`` of its
upper end; a seed's knee is the highest rate it sustained. The points are the evaluation's
own (``bench.evaluation.runs.run_point`` on the jobs ``bench.evaluation.evaluate`` builds: the
same run lengths, verdict, allocations searched or sized per rate, ``DIR/knowledge.json``'s
profiles); only the seeds differ. Writes ``OUT/knee.json`` (every run) and ``OUT/knee.md``
(per workflow and cluster: each system's knee, mean and 95% t-interval over the seeds, and
Scepsy's against it: ahead where its interval lies above the system's, behind where below,
else a tie); with ``--out`` the evaluation run's own directory, its report shows them
(``bench.evaluation.evaluate --report-only``). Every figure is simulated.

Invariants: a seed's bracket is checked at that seed before bisecting (a grid rate sustained
by the grid's seed may not be by another: the bracket then widens down, or up while below
``UP_LIMIT`` x the grid's top rate; past it the knee is censored, reported as ">="); a point
counts as sustained by the evaluation report's own rule (``bench.evaluation.report``: placed
on the cluster and sustained).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from bench.evaluation.jobs import point_jobs, sweep_of
from bench.evaluation.runs import PointJob, run_point
from bench.evaluation.scepsy import Knowledge, knowledge_from_doc
from bench.evaluation.setup import FULL, QUICK, SYSTEMS, WORKFLOWS
from bench.evaluation.text import fmt

TOLERANCE = 0.05  # the bracket's width, relative to its upper end, where bisection stops
UP_LIMIT = 1.5  # how far above the grid's top rate a bracket may widen up
# two-sided 95% Student t quantiles by degrees of freedom (n seeds - 1)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
KNEE_FILE = "knee.json"  # in --out; an evaluation run's report shows it when there
SEED_STEP = 7919  # seeds apart by a prime, clear of the grid's 1000 x GPUs + 10 x i

Series = tuple[str, int, str]  # workflow, GPUs, system


@dataclass(frozen=True)
class Bracket:
    lo: float  # the highest rate sustained so far (0: none)
    hi: float  # the lowest rate not sustained so far (inf: none)

    def done(self) -> bool:
        return self.lo > 0 and math.isfinite(self.hi) and self.hi - self.lo <= TOLERANCE * self.hi


def counts(point: dict[str, Any]) -> bool:
    """Sustained on the cluster (the evaluation report's rule)."""
    return bool(point.get("sustained")) and point.get("placed") is not False


def placeable(points: Sequence[dict[str, Any]]) -> bool:
    """Whether any point of a series placed at all (the report's "n/a" where none did: one
    whole-GPU pod per model that does not fit, an ablation with nothing to place)."""
    return any("unserved" not in p and p.get("placed") is not False for p in points)


def grid_bracket(points: Sequence[dict[str, Any]]) -> Bracket:
    """A series' bracket from its grid points: its highest sustained rate and the lowest
    rate above it that it did not sustain."""
    ok = [p["rate"] for p in points if counts(p)]
    lo = max(ok, default=0.0)
    above = [p["rate"] for p in points if p["rate"] > lo and not counts(p)]
    return Bracket(lo, min(above, default=math.inf))


def next_rate(b: Bracket, top: float) -> float | None:
    """The rate to run next for bracket ``b`` (None: the knee is found or censored)."""
    if b.done():
        return None
    if b.lo <= 0:
        return b.hi / 2 if b.hi > top * 1e-3 else None  # nothing sustained: widen down
    if not math.isfinite(b.hi):  # widen up, to the limit at most; sustained there: censored
        limit = UP_LIMIT * top
        return min(b.lo * 1.2, limit) if b.lo < limit * (1.0 - 1e-9) else None
    return (b.lo + b.hi) / 2


def update(b: Bracket, rate: float, sustained: bool) -> Bracket:
    return Bracket(max(b.lo, rate), b.hi) if sustained else Bracket(b.lo, min(b.hi, rate))


def interval(knees: Sequence[float]) -> tuple[float, float, float]:
    """Mean and 95% t-interval over seeds (the mean's, not the seeds' spread)."""
    mean = statistics.fmean(knees)
    if len(knees) < 2:
        return mean, mean, mean
    half = T95.get(len(knees) - 1, 1.96) * statistics.stdev(knees) / math.sqrt(len(knees))
    return mean, mean - half, mean + half


def verdict(scepsy: tuple[float, float, float], other: tuple[float, float, float]) -> str:
    """Scepsy against a system by their intervals."""
    if scepsy[1] > other[2]:
        return "Scepsy ahead"
    if scepsy[2] < other[1]:
        return "Scepsy behind"
    return "tie (intervals overlap)"


def seek(
    first: Bracket, top: float, check: Callable[[float], bool]
) -> tuple[Bracket, list[tuple[float, bool]], bool]:
    """One seed's bisection from the grid's bracket: the final bracket, the runs, and whether
    the knee is censored (sustained up to ``UP_LIMIT`` x ``top``). The grid bracket's ends are
    run at this seed first; an end the seed contradicts is dropped and the bracket widens."""
    runs: list[tuple[float, bool]] = []
    b = Bracket(0.0, math.inf)
    for rate in (first.lo, first.hi):
        if rate > 0 and math.isfinite(rate):
            ok = check(rate)
            runs.append((rate, ok))
            b = update(b, rate, ok)
    while (rate_next := next_rate(b, top)) is not None:
        ok = check(rate_next)
        runs.append((rate_next, ok))
        b = update(b, rate_next, ok)
    return b, runs, not math.isfinite(b.hi)


def _job_at(
    k: Knowledge, series: Series, rate: float, sweep: dict[str, float], seed: int, quick: bool
) -> PointJob:
    wf, gpus, system = series
    top = sweep["capacity"]
    lengths = QUICK if quick else FULL
    jobs, _ = point_jobs(k, gpus, wf, [rate / top], lengths, [system], sweep)
    job = min(jobs, key=lambda j: abs(j.rate - rate))  # not the below-sweep extras
    return replace(job, seed=seed)


def _seek_one(
    args: tuple[Knowledge, Series, Bracket, dict[str, float], int, bool],
) -> dict[str, Any]:
    k, series, first, sweep, seed, quick = args

    def check(rate: float) -> bool:
        return counts(run_point(_job_at(k, series, rate, sweep, seed, quick)))

    b, runs, censored = seek(first, sweep["capacity"], check)
    return {"seed": seed, "knee": b.lo, "hi": b.hi, "censored": censored, "runs": runs}


def knees(
    run: dict[str, Any], k: Knowledge, want: Sequence[Series], seeds: int, pool: Executor
) -> list[dict[str, Any]]:
    """Per series of ``want`` present in ``run``: its seeds' knees and their interval."""
    grid: dict[Series, list[dict[str, Any]]] = {}
    for p in run["points"]:
        grid.setdefault((p["workflow"], p["gpus"], p["system"]), []).append(p)
    meta = run.get("meta", {})
    quick = bool(meta.get("quick", "--quick" in meta.get("command", "")))
    tasks = []
    checked: set[tuple[str, int]] = set()
    for s in want:
        if s not in grid:
            continue
        sweep = run["sweeps"][s[0]][str(s[1])]
        if s[:2] not in checked:  # the knowledge must give the run's grid, once per sweep
            again = sweep_of(k, s[1], s[0])["capacity"]
            if not math.isclose(again, sweep["capacity"], rel_tol=1e-9):
                raise ValueError(
                    f"{s[0]} on {s[1]} GPUs: capacity {again} != the run's {sweep['capacity']}"
                )
            checked.add(s[:2])
        first = grid_bracket(grid[s])
        for i in range(seeds):
            tasks.append((k, s, first, sweep, 1000 * s[1] + SEED_STEP * (i + 1), quick))
    results = list(pool.map(_seek_one, tasks))
    out = []
    for s in want:
        mine = [r for t, r in zip(tasks, results, strict=True) if t[1] == s]
        if not mine:
            continue
        mean, low, high = interval([r["knee"] for r in mine])
        out.append(
            {
                "workflow": s[0],
                "gpus": s[1],
                "system": s[2],
                "seeds": mine,
                "mean": mean,
                "ci95": [low, high],
                "censored": any(r["censored"] for r in mine),
                "placeable": placeable(grid[s]),
            }
        )
    return out


def _key(row: dict[str, Any]) -> Series:
    return row["workflow"], row["gpus"], row["system"]


def _order(row: dict[str, Any]) -> tuple[int, int, int]:
    """The report's order: workflow, cluster, then Scepsy first and the systems as listed."""
    return WORKFLOWS.index(row["workflow"]), row["gpus"], SYSTEMS.index(row["system"])


def merged_into(path: Path, rows: Sequence[dict[str, Any]], command: str) -> dict[str, Any]:
    """The knee document at ``path`` (if any) with ``rows`` in it: a series run again replaces
    its earlier knees, the others stay; ``commands`` lists every run that gave a series."""
    old: dict[str, Any] = orjson.loads(path.read_bytes()) if path.exists() else {}
    new = {_key(r) for r in rows}
    kept = [r for r in old.get("series", []) if _key(r) not in new]
    series = sorted([*kept, *({**r, "command": command} for r in rows)], key=_order)
    giving = {r["command"] for r in series}  # in the order the runs were made
    commands = [c for c in dict.fromkeys([*old.get("commands", []), command]) if c in giving]
    return {"label": "simulated", "tolerance": TOLERANCE, "commands": commands, "series": series}


def knee_lines(doc: dict[str, Any]) -> list[str]:
    """The knees of a ``knee.json`` document as a Markdown section."""
    rows: list[dict[str, Any]] = doc["series"]
    lines = [
        "## Knees by bisection (simulated)",
        "",
        "Commands: " + "; ".join(f"`{c}`" for c in doc["commands"]) + ". "
        "Per seed, the highest rate sustained, bisected to "
        f"{TOLERANCE:.0%} of rate from the evaluation grid's bracket; mean and 95% "
        "t-interval of the mean over seeds. `>=`: sustained up to the highest rate tried.",
        "",
        "| workflow | GPUs | system | knees per seed (req/s) | mean [95% CI] | Scepsy vs it |",
        "|---|---|---|---|---|---|",
    ]
    by = {(r["workflow"], r["gpus"], r["system"]): r for r in rows}
    for r in rows:
        sc = by.get((r["workflow"], r["gpus"], "scepsy"))
        head = f"| {r['workflow']} | {r['gpus']} | {r['system']} |"
        if not r.get("placeable", True):
            lines.append(f"{head} n/a | n/a (places nothing on the cluster) | |")
            continue
        vs = ""
        if sc is not None and r["system"] != "scepsy":
            vs = verdict((sc["mean"], *sc["ci95"]), (r["mean"], *r["ci95"]))
        per = ", ".join(fmt(x["knee"]) for x in r["seeds"])
        lo, hi = r["ci95"]
        lines.append(
            f"{head} {per} | "
            f"{'>=' if r['censored'] else ''}{fmt(r['mean'])} [{fmt(lo)}-{fmt(hi)}] | {vs} |"
        )
    return [*lines, ""]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, type=Path, help="an evaluation run's directory")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--sizes", type=int, nargs="+", default=[4])
    ap.add_argument("--workflows", nargs="+", choices=WORKFLOWS, default=list(WORKFLOWS))
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error("--seeds must be at least 1")
    run = orjson.loads((args.run / "evaluation.json").read_bytes())
    k = knowledge_from_doc(orjson.loads((args.run / "knowledge.json").read_bytes()))
    want = [(w, g, s) for w in args.workflows for g in args.sizes for s in args.systems]
    with ProcessPoolExecutor(args.workers) as pool:
        rows = knees(run, k, want, args.seeds, pool)
    if not rows:
        print("knee: none of the series asked for is in the run", file=sys.stderr)
        return 1
    command = "python -m bench.evaluation.knee " + " ".join(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    doc = merged_into(args.out / KNEE_FILE, rows, command)
    (args.out / KNEE_FILE).write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    text = "\n".join(knee_lines(doc))
    (args.out / "knee.md").write_text(text.replace("## ", "# ", 1))  # a document of its own
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

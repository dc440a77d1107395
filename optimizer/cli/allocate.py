"""``scepsy allocate``: search the allocation, place it, and show both (table, JSON or plot).

Role: the presentation edge of :mod:`optimizer.search.solve`. Inputs come either from a trace store
(``--store DIR``: workflow statistics and the recorded profiles, with the cluster, the
models' memory floors and the search knobs (``optimizer.granularity``, ``headroom``,
``welfare``) from the settings file ``--config FILE``) or from a scenario file (``--scenario FILE``, see
:mod:`optimizer.search.scenario`). Prints per workflow and model the allocation (replicas, TP degree,
GPU share), the predicted latency and throughput, and the placement map (node / GPU / share).
``--plot FILE.png`` draws each workflow's predicted throughput-latency curve under the chosen
allocation against the best whole-GPU one (the search with fractions disabled).

JSON shape (stable; more keys may be added)::

    {"welfare", "objective", "feasible", "relaxed", "search": {candidates..., "seconds"},
     "workflows": {NAME: {"rate", "served_rate", "feasible", "latency", "throughput",
                          "bottleneck", "utility", "gpus",
                          "models": {MODEL: {"replicas", "tp", "share", "gpus",
                                             "contribution", "capacity"}}}},
     "placement": [{"workflow", "model", "node", "gpus", "share", "memory_gb"}] | null,
     "placement_attempts", "placement_errors": [...]}

Every latency and throughput shown is the ALP's prediction (labelled so), not a measurement;
unbounded values are null in JSON. Exit status 1 when no placement was found.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import duckdb
import orjson
from rich.console import Console
from rich.table import Table

from optimizer.cli.main import UsageError, existing_store
from optimizer.model import alp
from optimizer.model.alp import Pipeline
from optimizer.model.curves import ProfileBook
from optimizer.placement import Placement
from optimizer.search import scenario, solve
from optimizer.search.solve import SearchResult, WorkflowAllocation
from optimizer.search.space import SearchError, SearchProblem, WorkflowTarget
from optimizer.store import profiles
from shared.cluster import GB, ClusterError, cluster_from_settings
from shared.optimizer_settings import MAX_GRANULARITY
from shared.profile_points import ProfileError
from shared.settings_schema import SettingsError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--store", type=Path, help="trace store: statistics and recorded profiles")
    src.add_argument("--scenario", type=Path, help="scenario YAML (workflows, cluster, profiles)")
    parser.add_argument(
        "--config", type=Path, help="settings file (cluster, rollout.models); required with --store"
    )
    parser.add_argument(
        "--rate",
        action="append",
        default=[],
        metavar="WORKFLOW=RATE",
        help="target rate override (requests/s); default: the measured rate",
    )
    parser.add_argument("--granularity", type=int, help="GPU units per GPU (default 10)")
    parser.add_argument("--headroom", type=float, help="throughput headroom (default 0.1)")
    parser.add_argument("--welfare", choices=["egalitarian", "social"])
    parser.add_argument("--no-tp", action="store_true", help="ablation: no tensor parallelism")
    parser.add_argument("--no-fraction", action="store_true", help="ablation: whole GPUs only")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--plot", type=Path, help="write throughput-latency curves to this PNG")


def _rates(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            out[name] = float(value)
        except ValueError:
            raise UsageError(f"--rate {item!r}: expected WORKFLOW=RATE") from None
        if not sep or not name or not out[name] > 0:
            raise UsageError(f"--rate {item!r}: expected WORKFLOW=RATE with RATE > 0")
    return out


def _from_store(args: argparse.Namespace) -> SearchProblem:
    from optimizer.stats.reader import summarise_store
    from shared.settings import load_settings

    if args.config is None:
        raise UsageError("--store needs --config FILE (the cluster and the models' floors)")
    settings = load_settings(args.config)
    existing_store(args.store)
    try:
        stats = summarise_store(args.store)
        points = profiles.load_points(args.store)
    except duckdb.Error as exc:
        raise UsageError(f"cannot read the store at {args.store}: {exc}") from exc
    workflows = [
        WorkflowTarget(Pipeline.from_stats(s), s.arrival_rate)
        for s in stats.values()
        if s.requests > 0 and s.arrival_rate > 0
    ]
    if not workflows:
        raise UsageError(f"no completed workflow requests recorded in {args.store}")
    if not points:
        raise UsageError(f"no profiles in {args.store} (run `scepsy profile` first)")
    knobs = settings.optimizer
    return SearchProblem(
        tuple(workflows),
        ProfileBook(points),
        cluster_from_settings(settings.cluster),
        memory_floor_bytes={m.name: m.min_memory_bytes for m in settings.rollout.models},
        granularity=knobs.granularity,
        headroom=knobs.headroom,
        welfare=knobs.welfare,
    )


def build_problem(args: argparse.Namespace) -> SearchProblem:
    """The search problem the command line describes (overrides applied)."""
    try:
        if args.scenario is not None:
            prob = scenario.problem(*scenario.load_scenario(args.scenario))
        else:
            prob = _from_store(args)
        rates = _rates(args.rate)
        unknown = sorted(set(rates) - {w.pipeline.workflow for w in prob.workflows})
        if unknown:
            raise UsageError(f"--rate names unknown workflow(s): {', '.join(unknown)}")
        changes: dict[str, Any] = {
            "workflows": tuple(
                WorkflowTarget(w.pipeline, rates.get(w.pipeline.workflow, w.rate))
                for w in prob.workflows
            )
        }
        if args.granularity is not None and not 1 <= args.granularity <= MAX_GRANULARITY:
            raise UsageError(f"--granularity must be between 1 and {MAX_GRANULARITY}")
        if args.headroom is not None and not 0 <= args.headroom < math.inf:
            raise UsageError("--headroom must be a finite number, at least 0")
        for key in ("granularity", "headroom", "welfare"):
            if getattr(args, key) is not None:
                changes[key] = getattr(args, key)
        if args.no_tp:
            changes["allow_tp"] = False
        if args.no_fraction:
            changes["allow_fraction"] = False
        return replace(prob, **changes)
    except (SettingsError, SearchError, ProfileError, ClusterError) as exc:
        raise UsageError(str(exc)) from exc


def _num(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _workflow_json(w: WorkflowAllocation, granularity: int) -> dict[str, Any]:
    return {
        "rate": w.rate,
        "served_rate": w.served_rate,
        "feasible": w.feasible,
        "latency": _num(w.latency),
        "throughput": _num(w.throughput),
        "bottleneck": w.bottleneck,
        "utility": w.utility,
        "gpus": sum(m.units for m in w.models) / granularity,
        "models": {
            m.model: {
                **m.alloc.doc(),
                "gpus": m.units / granularity,
                "contribution": _num(m.contribution),
                "capacity": _num(m.capacity),
            }
            for m in w.models
        },
    }


def to_json(
    result: SearchResult, placement: Placement | None, attempts: int, errors: tuple[str, ...]
) -> dict[str, Any]:
    rows = (
        None
        if placement is None
        else [
            {
                "workflow": r.demand.workflow,
                "model": r.demand.model,
                "node": r.node,
                "gpus": list(r.gpus),
                "share": r.share,
                "memory_gb": r.memory_bytes_per_gpu / GB,
            }
            for r in placement.replicas
        ]
    )
    return {
        "welfare": result.welfare,
        "objective": result.objective,
        "feasible": result.feasible,
        "relaxed": result.relaxed,
        "search": asdict(result.stats),
        "workflows": {w.workflow: _workflow_json(w, result.granularity) for w in result.workflows},
        "placement": rows,
        "placement_attempts": attempts,
        "placement_errors": list(errors),
    }


def _tables(result: SearchResult, placement: Placement | None) -> list[Table]:
    alloc = Table(
        title=f"allocation ({result.welfare} welfare, predicted by the ALP)", title_justify="left"
    )
    for col in (
        "workflow",
        "model",
        "replicas",
        "TP",
        "share",
        "GPUs",
        "latency s",
        "throughput/s",
        "rate/s",
        "note",
    ):
        alloc.add_column(col, justify="left" if col in ("workflow", "model", "note") else "right")
    f = result.granularity
    for w in result.workflows:
        note = "feasible" if w.feasible else f"INFEASIBLE: serves {w.served_rate:.3g}/s"
        if result.relaxed:
            note += f" (on {result.relaxed})"
        alloc.add_row(
            w.workflow,
            "(all)",
            "",
            "",
            "",
            f"{sum(m.units for m in w.models) / f:g}",
            f"{w.latency:.3f}",
            f"{w.throughput:.3f}",
            f"{w.rate:.3g}",
            f"{note}, bottleneck {w.bottleneck or '-'}",
        )
        for m in w.models:
            alloc.add_row(
                "",
                m.model,
                str(m.alloc.replicas),
                str(m.alloc.tp),
                m.alloc.shares(),
                f"{m.units / f:g}",
                f"{m.contribution:.3f}",
                f"{m.capacity:.3f}",
                "",
                "",
            )
    out = [alloc]
    if placement is not None:
        where = Table(title="placement", title_justify="left")
        for col in ("node", "GPUs", "share", "memory GB", "workflow", "model"):
            where.add_column(col)
        for r in sorted(placement.replicas, key=lambda r: (r.node, r.gpus)):
            where.add_row(
                r.node,
                ",".join(map(str, r.gpus)),
                f"{r.share:.2f}",
                f"{r.memory_bytes_per_gpu / GB:.1f}",
                r.demand.workflow,
                r.demand.model,
            )
        out.append(where)
    return out


def plot(path: Path, prob: SearchProblem, result: SearchResult) -> None:
    """Predicted throughput-latency curves: chosen allocation vs the best whole-GPU one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    whole = solve.search(replace(prob, allow_fraction=False))
    fig, axes = plt.subplots(
        1, len(result.workflows), squeeze=False, figsize=(5.5 * len(result.workflows), 4)
    )
    for ax, w, target in zip(axes[0], result.workflows, prob.workflows, strict=True):
        for label, chosen in (
            ("Scepsy (fractions + TP)", w),
            ("whole GPUs only", whole.workflow(w.workflow)),
        ):
            if not chosen.models:
                continue
            rates = np.linspace(0.02, 0.98, 60) * chosen.throughput
            lat = [
                alp.predict(
                    target.pipeline,
                    prob.book,
                    chosen.allocation,
                    float(r),
                    stat=prob.stat,
                    pooling=prob.pooling,
                ).latency
                for r in rates
            ]
            ax.plot(rates, lat, label=f"{label}: max {chosen.throughput:.2f}/s")
        ax.axvline(target.rate, color="grey", linestyle=":", label="target rate")
        ax.set_title(f"{w.workflow} (predicted)")
        ax.set_xlabel("workflow requests/s")
        ax.set_ylabel("mean latency (s)")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    prob = build_problem(args)
    try:
        placed = solve.search_and_place(prob)
    except (SearchError, ProfileError) as exc:
        raise UsageError(str(exc)) from exc
    result, placement, attempts, errors = (
        placed.result,
        placed.placement,
        placed.attempts,
        placed.failures,
    )
    if args.plot is not None:
        plot(args.plot, prob, result)
    if args.json:
        print(
            orjson.dumps(
                to_json(result, placement, attempts, errors), option=orjson.OPT_INDENT_2
            ).decode()
        )
        return 0 if placement is not None else 1
    console = Console(width=None if Console().is_terminal else 160)
    for table in _tables(result, placement):
        console.print(table)
    s = result.stats
    console.print(
        f"search: {s.candidates_generated:,} candidates, {s.candidates_pruned:,} "
        f"pruned, {s.candidates_evaluated:,} compared, {s.configs_predicted:,} "
        f"configurations predicted, {s.seconds:.3f} s"
    )
    for i, e in enumerate(errors, 1):
        console.print(f"placement attempt {i}: {e}")
    if errors and placement is not None:
        console.print(
            f"placed on attempt {attempts}: the best allocation without the "
            "configurations that did not place"
        )
    if placement is None:
        console.print(
            f"placement: none found in {attempts} attempts; the allocation above "
            "is the last one tried"
        )
    if args.plot is not None:
        console.print(f"wrote {args.plot}")
    return 0 if placement is not None else 1

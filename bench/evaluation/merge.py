"""Runs merged into one report: series (system, workflow, cluster) taken whole from other runs.

Role: ``python -m bench.evaluation.evaluate --out DIR --report-only --merge RUN ...`` renders one
report from DIR's run and the series of earlier runs that DIR's run did not finish (a full run
takes hours on 2 cores; its 16-GPU points come from runs made one workflow at a time).

Invariants:
- a series is never mixed: every point of one (system, workflow, cluster) comes from one run;
  a series present in several runs comes from the last one named (DIR's own run first);
- two runs merge only where their sweeps agree (the same capacity and beam rate for a workflow
  and cluster), so their rates are the same grid and Scepsy's points and a baseline's compare
  at equal offered rates; a disagreement is an error naming the sweep;
- every point keeps the run it came from (``run``: an index into ``meta["runs"]``), and the
  report names each run's command and the series it gave.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

Series = tuple[str, int, str]  # workflow, GPUs, system


class MergeError(ValueError):
    """Two runs' sweeps disagree: their points are not on the same rate grid."""


def _agree(a: Mapping[str, float], b: Mapping[str, float]) -> bool:
    return all(math.isclose(a[k], b[k], rel_tol=1e-9, abs_tol=1e-12) for k in a.keys() | b.keys())


def merge_docs(docs: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """``docs``: (directory, evaluation.json document) per run, DIR's own run first. Returns
    ``points`` (each with ``run``), ``sweeps`` (the union), ``runs`` (per run its directory,
    command and the series it gave, ``[workflow, gpus, system]``)."""
    sweeps: dict[str, dict[str, Any]] = {}
    chosen: dict[Series, int] = {}
    for i, (where, doc) in enumerate(docs):
        for wf, by_gpus in doc["sweeps"].items():
            for gpus, sweep in by_gpus.items():
                have = sweeps.setdefault(wf, {}).setdefault(gpus, sweep)
                if not _agree(have, sweep):
                    raise MergeError(
                        f"sweeps.{wf}.{gpus}: {where} swept {dict(sweep)}, "
                        f"an earlier run {dict(have)}; their rates are different grids"
                    )
        for p in doc["points"]:
            chosen[p["workflow"], p["gpus"], p["system"]] = i
    points = [
        {**p, "run": i}
        for i, (_, doc) in enumerate(docs)
        for p in doc["points"]
        if chosen[p["workflow"], p["gpus"], p["system"]] == i
    ]
    runs = [
        {
            "dir": where,
            "command": doc["meta"]["command"],
            "series": sorted([wf, g, s] for (wf, g, s), j in chosen.items() if j == i),
        }
        for i, (where, doc) in enumerate(docs)
    ]
    return {"points": points, "sweeps": sweeps, "runs": runs}


def provenance_lines(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The report's account of where its series came from (nothing for a single run)."""
    if len(runs) < 2:
        return []
    lines = [
        "Merged report: each series (system, workflow, cluster) comes whole from one run, "
        "the last named that holds it; the runs swept the same rates (same capacities), "
        "so points compare at equal offered rates. Runs made at different commits "
        "simulate with the code of their commit.",
        "",
    ]
    for i, r in enumerate(runs):
        by: dict[tuple[str, int], list[str]] = {}
        for wf, g, s in r["series"]:
            by.setdefault((wf, g), []).append(s)
        gave = "; ".join(f"{wf} {g} GPUs: {', '.join(s)}" for (wf, g), s in sorted(by.items()))
        lines.append(
            f"- run {i}, `{r['dir']}`: `{r['command']}` — {gave or 'nothing (superseded)'}"
        )
    return [*lines, ""]

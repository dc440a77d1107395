"""Does the daemon correct itself? Two emulated scenarios (issue 24, "What it must show").

Role: ``python -m bench.accuracy.self_correct --out DIR [--quick]`` runs beam search and RAG
through the real proxy and store, against emulated engines started by the local backend, with
the real daemon in this process (:mod:`bench.accuracy.self_correct_stack`), and prints (and
writes to ``DIR/self_correct.json``) what it did:

- **A, a model no one profiled**: the store holds the demo's simulated profiles for every
  model but ``bge-reranker-base``, which RAG calls from its first request. Measured: from the
  reranker's first recorded call to the daemon's reprofile start and end (decision log), to
  the first pass that plans with it and the first rollout; the run's reason and the points it
  stored; then predicted vs observed mean latency per workflow for the windows after that
  rollout.
- **B, a replica that changes**: once the daemon has rolled out and settled, one served
  replica's engine is restarted at ``--speedup 0.5`` (twice as slow in wall time) behind the
  same URL (:func:`~bench.accuracy.self_correct_stack.restart_replica`). Per pass after it:
  predicted vs observed mean latency per workflow, the live points the pass stored for the
  slowed model, drift reprofiles; and the windows until ``|pred - obs| / obs <= 15%`` again
  (:func:`windows_until_recovered`; ``None`` when it never is within the run).

Invariants: every figure is emulated (engines at speed-up 1, so model time is wall time;
the starting profiles are simulated, and labelled so); a window is judged only when it begins
at or after the event it is judged against (a window straddling it is listed apart); every
process started is stopped, on errors too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import shutil
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.accuracy.self_correct_stack import (
    Emulated,
    Shape,
    first_call_s,
    restart_replica,
    simulated_profiles,
)
from optimizer.control.reprofile import is_profiling
from optimizer.daemon.service import TickReport
from optimizer.demo.run import BOOTSTRAP
from optimizer.store.decisions import load_decisions
from optimizer.store.profiles import load_points
from shared.profile_points import ProfilePoint

TOLERANCE = 0.15  # |pred - obs| / obs the issue asks for
NEW_MODEL = "bge-reranker-base"
SLOW_ORDER = ("llama-3-8b", "llama-3.2-1b", "llama-3.1-8b-prm", "e5-base-v2", NEW_MODEL)
QUIET = {"steady", "unchanged"}  # passes that saw nothing to act on
LABEL = (
    "emulated: sim.cli engines at speed-up 1 behind the real proxy, store and daemon; "
    "starting profiles simulated (sim.profiles)"
)


@dataclass(frozen=True)
class PassRow:
    """One daemon pass, times in seconds since the load started."""

    t: float
    window_from: float  # the statistics window's start
    kind: str
    outcome: str | None
    predicted: dict[str, float]  # per workflow, for what ran
    observed: dict[str, float]  # per workflow, mean latency of the window
    requests: dict[str, int]
    planned: tuple[str, ...]  # models the pass's placement holds (empty: no search)
    live: tuple[tuple[str, float, float, float], ...]  # (model, share, calls/s, mean s) saved
    reasons: tuple[str, ...]


def pass_row(report: TickReport, t0: float, settle_s: float) -> PassRow:
    d = report.decision
    stats = report.stats
    placed = () if report.placement is None else report.placement.replicas
    return PassRow(
        t=d.t - t0,
        window_from=d.t - t0 - report.window_s - settle_s,
        kind=d.kind,
        outcome=report.outcome,
        predicted=dict(report.predicted_now),  # inf: predicted overloaded
        observed={w: s.latency_mean for w, s in stats.items() if math.isfinite(s.latency_mean)},
        requests={w: s.requests for w, s in stats.items()},
        planned=tuple(sorted({r.demand.model for r in placed})),
        live=tuple((p.model, p.share, p.throughput, p.lat_mean) for p in report.live_points),
        reasons=d.reasons,
    )


def rel_error(row: PassRow, workflow: str) -> float | None:
    """(predicted - observed) / observed of ``workflow`` in ``row`` (``inf`` where the pass
    predicted overload); ``None`` without both."""
    pred, obs = row.predicted.get(workflow), row.observed.get(workflow)
    if pred is None or obs is None or obs <= 0 or math.isnan(pred):
        return None
    return (pred - obs) / obs


def windows_until_recovered(
    rows: Sequence[PassRow], workflow: str, since: float, tolerance: float = TOLERANCE
) -> dict[str, Any]:
    """Over the passes whose window starts at or after ``since`` and that judge ``workflow``:
    ``first_within`` (1-based: the first such window within ``tolerance``), ``first_out`` (the
    first one past it), ``recovered_at`` (the first within after ``first_out``), ``within_from``
    (the first window from which every later one is within), ``None`` when there is none;
    ``errors`` the relative errors in order; ``straddling`` those of windows holding ``since``."""
    judged = [(r, rel_error(r, workflow)) for r in rows if r.window_from >= since]
    errors = [e for _, e in judged if e is not None]
    straddling = [
        e for r in rows if r.window_from < since <= r.t if (e := rel_error(r, workflow)) is not None
    ]
    first = next((k + 1 for k, e in enumerate(errors) if abs(e) <= tolerance), None)
    # the first window back within after the first one out of it (the event was noticed)
    out = next((k for k, e in enumerate(errors) if abs(e) > tolerance), None)
    recovered = (
        None
        if out is None
        else next((k + 1 for k, e in enumerate(errors) if k > out and abs(e) <= tolerance), None)
    )
    within_from = None
    for k in range(len(errors), 0, -1):
        if abs(errors[k - 1]) > tolerance:
            break
        within_from = k
    return {
        "windows": len(errors),
        "first_within": first,
        "first_out": None if out is None else out + 1,
        "recovered_at": recovered,
        "within_from": within_from,
        "errors": [round(e, 4) for e in errors],
        "straddling": [round(e, 4) for e in straddling],
    }


def median_abs(errors: Sequence[float]) -> float | None:
    return statistics.median(abs(e) for e in errors) if errors else None


def reprofile_rows(decisions: Sequence[Mapping[str, Any]], t0: float) -> list[dict[str, Any]]:
    """The decision log's reprofile rows, times since the load started."""
    return [
        {
            "t": round(float(d["t"]) - t0, 2),
            "kind": d["kind"],
            "outcome": d["outcome"],
            "reasons": d["reasons"],
            "change": (d["changes"] or [{}])[0],
        }
        for d in decisions
        if str(d["kind"]).startswith("reprofile")
    ]


def _points(points: Sequence[ProfilePoint]) -> dict[str, Any]:
    by_source: dict[str, int] = {}
    for p in points:
        by_source[p.source] = by_source.get(p.source, 0) + 1
    replay = [
        {"share": p.share, "calls_s": round(p.throughput, 3), "lat_mean_s": round(p.lat_mean, 4)}
        for p in points
        if p.source == "replay"
    ]
    return {"by_source": by_source, "replay": replay}


def _rows_doc(rows: Sequence[PassRow]) -> list[dict[str, Any]]:
    return [
        asdict(r)
        | {"errors": {w: round(e, 4) for w in r.observed if (e := rel_error(r, w)) is not None}}
        for r in rows
    ]


async def scenario_a(
    folder: Path, shape: Shape, profiles: Sequence[ProfilePoint], load_s: float
) -> dict[str, Any]:
    """A model that appears in traffic with no profile (module docstring)."""
    stack = Emulated(folder, shape, BOOTSTRAP, [p for p in profiles if p.model != NEW_MODEL])
    try:
        await stack.start(load_s)
        await stack.watch(load_s)
        await stack.stop_daemon()
        drivers = await stack.drivers()
    finally:
        await stack.close()
    assert stack.settings is not None
    store, t0 = stack.settings.store.path, stack.t0
    settle = stack.settings.optimizer.settle_s
    rows = [pass_row(r, t0, settle) for r in stack.passes]
    runs = reprofile_rows(load_decisions(store), t0)
    first = first_call_s(store, NEW_MODEL)
    t_first = None if first is None else first - t0
    started = next((r["t"] for r in runs if r["outcome"] == "started"), None)
    ended = next((r for r in runs if r["kind"] == "reprofile" and r["outcome"] != "started"), None)
    planned = next((r for r in rows if NEW_MODEL in r.planned), None)
    rollout = next(
        (r for r in rows if r.kind == "rollout" and r.outcome == "ok" and NEW_MODEL in r.planned),
        None,
    )
    # judged from the plan that serves the model: its rollout, or the plan itself when the
    # search kept what runs (the bootstrap already serves the reranker)
    judged_from = rollout or planned
    after = [] if judged_from is None else [r for r in rows if r.window_from >= judged_from.t]
    accuracy: dict[str, dict[str, Any]] = {}
    for w in ("beam", "rag"):
        errors = [round(e, 4) for r in after if (e := rel_error(r, w)) is not None]
        accuracy[w] = {"errors": errors, "median_abs": median_abs(errors)}

    def since(t: float | None) -> float | None:
        return None if t is None or t_first is None else round(t - t_first, 2)

    return {
        "first_call_of_new_model_s": t_first,
        "error_passes_before_plan": sum(1 for r in rows if r.kind == "error"),
        "reprofile_start_after_first_call_s": since(started),
        "reprofile_end_after_first_call_s": since(None if ended is None else ended["t"]),
        "reprofile_outcome": None if ended is None else ended["outcome"],
        "first_plan_with_model_after_first_call_s": since(None if planned is None else planned.t),
        "first_plan_kind": None if planned is None else planned.kind,
        "first_rollout_with_model_after_first_call_s": since(
            None if rollout is None else rollout.t
        ),
        "reprofiles": runs,
        "points_of_new_model": _points(load_points(store, NEW_MODEL)),
        "accuracy_after_plan": accuracy,
        "drivers": drivers,
        "passes": _rows_doc(rows),
    }


async def _choose(stack: Emulated) -> str:
    """The replica to slow: by SLOW_ORDER, a model served by exactly one replica first."""
    assert stack.backend is not None
    observed = await stack.backend.observe()
    served = [r for r in observed.replicas if not is_profiling(r) and r.ready]
    counts = {m: sum(1 for r in served if r.model == m) for m in SLOW_ORDER}
    order = sorted(SLOW_ORDER, key=lambda m: (counts[m] != 1, SLOW_ORDER.index(m)))
    model = next(m for m in order if counts[m] > 0)
    replica = next(r for r in served if r.model == model)
    return replica.id


async def scenario_b(
    folder: Path,
    shape: Shape,
    profiles: Sequence[ProfilePoint],
    settle_max_s: float,
    after_s: float,
) -> dict[str, Any]:
    """A served replica restarted twice as slow (module docstring)."""
    load_s = settle_max_s + after_s
    stack = Emulated(folder, shape, BOOTSTRAP, profiles)
    restart: dict[str, Any] = {}
    try:
        await stack.start(load_s)
        deadline = time.monotonic() + settle_max_s
        while time.monotonic() < deadline:  # planned, and 4 quiet passes since
            await stack.watch(shape.interval_s)
            kinds = [r.decision.kind for r in stack.passes]
            # a pending change or one held by the cooldown may still roll out (and replace the
            # replica about to be slowed): only passes that saw nothing to do count as quiet
            if len(kinds) >= 8 and set(kinds[-4:]) <= QUIET:
                break
        replica = await _choose(stack)
        assert stack.backend is not None
        restart = restart_replica(stack.backend, replica, 0.5) | {"t": time.time() - stack.t0}
        await stack.watch(max(0.0, load_s - (time.time() - stack.t0)))
        await stack.stop_daemon()
        drivers = await stack.drivers()
    finally:
        await stack.close()
    assert stack.settings is not None
    store, t0 = stack.settings.store.path, stack.t0
    rows = [pass_row(r, t0, stack.settings.optimizer.settle_s) for r in stack.passes]
    t_restart = float(restart["t"])
    rolled = [r.t for r in rows if r.kind == "rollout" and r.t < t_restart]
    since = rolled[-1] if rolled else 0.0
    before = [r for r in rows if r.window_from >= since and r.t < t_restart]
    slow = restart["model"]
    return {
        "restart": restart,
        "before_restart": {
            w: [round(e, 4) for r in before if (e := rel_error(r, w)) is not None]
            for w in ("beam", "rag")
        },
        "after_restart": {w: windows_until_recovered(rows, w, t_restart) for w in ("beam", "rag")},
        "rollouts_after_restart": [r.t for r in rows if r.kind == "rollout" and r.t >= t_restart],
        "live_points_of_slowed_model": [
            {"t": round(r.t, 1), "points": [p for p in r.live if p[0] == slow]}
            for r in rows
            if r.t >= t_restart
        ],
        "reprofiles": reprofile_rows(load_decisions(store), t0),
        "points_of_slowed_model": _points(load_points(store, slow)),
        "drivers": drivers,
        "passes": _rows_doc(rows),
    }


async def run(out: Path, quick: bool, only: str | None) -> dict[str, Any]:
    shape = Shape()
    runs = out / "runs"
    profiles = await asyncio.to_thread(simulated_profiles, runs / "profiles", shape)
    doc: dict[str, Any] = {"label": LABEL, "shape": asdict(shape), "quick": quick}
    if only in (None, "A"):
        doc["A"] = await scenario_a(runs / "a", shape, profiles, 150.0 if quick else 240.0)
    if only in (None, "B"):
        doc["B"] = await scenario_b(
            runs / "b", shape, profiles, 100.0 if quick else 130.0, 100.0 if quick else 150.0
        )
    return doc


def _without_passes(v: Any) -> Any:
    return {k: x for k, x in v.items() if k != "passes"} if isinstance(v, dict) else v


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quick", action="store_true", help="shorter phases (about 4 min each)")
    p.add_argument("--only", choices=("A", "B"), default=None, help="one scenario")
    args = p.parse_args(argv)
    shutil.rmtree(args.out / "runs", ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(  # the daemon's decisions and reprofiles, one line each
        filename=args.out / "daemon.log",
        filemode="w",
        level=logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    doc = asyncio.run(run(args.out, args.quick, args.only))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "self_correct.json").write_text(json.dumps(doc, indent=2, default=str))
    brief = {k: _without_passes(v) for k, v in doc.items()}  # the passes are in the file
    json.dump(brief, sys.stdout, indent=2, default=str)
    print()


if __name__ == "__main__":
    main()

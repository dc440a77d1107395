"""``scepsy stats``: workflow statistics as a rich table or as JSON.

Role: the presentation edge of :mod:`optimizer.stats.figures` (which stays pure). The window ends at the
last recorded call, so a store recorded earlier still reads as "the last 15 minutes of traffic",
and never starts before the first recorded call (a 3-minute store read with ``--window 15m``
has its arrivals divided by 3 minutes, not 15); ``--window all`` takes everything.

JSON shape (stable; more keys may be added)::

    {"workflows": {NAME: {"requests", "arrival_rate", "unidentified_calls", ...,
                          "models": {MODEL: {"n", "p", "latency_mean", "share_mean",
                                             "share_cv", ...}}}}}

Times are seconds, rates per second; unknown values (no token usage reported) are ``null``.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
import orjson

from optimizer.cli.main import UsageError, existing_store, parse_duration_s
from optimizer.stats.figures import Window, WorkflowStats
from optimizer.stats.reader import summarise_store

if TYPE_CHECKING:
    from rich.table import Table
from optimizer.stats.scan import UNION_CALLS_CAP
from shared.store import StoreReader


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", required=True, type=Path, help="trace store folder or URI")
    parser.add_argument("--window", default="15m", help="e.g. 30s, 15m, 2h, or 'all'")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--exact",
        action="store_true",
        help="compute the per-request figures (shares, critical path, overlap, tool time, p) "
        f"over every request, not a hash sample of about {UNION_CALLS_CAP:,} calls (slower on "
        "big stores; counts, call latencies and request latencies are always exact)",
    )


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    return value


def to_json(stats: dict[str, WorkflowStats]) -> dict[str, Any]:
    """The documented JSON document for a set of workflow statistics."""
    out: dict[str, Any] = {}
    for name, wf in stats.items():
        doc = asdict(wf)
        doc.pop("workflow")
        doc["models"] = {
            m: {k: v for k, v in ms.items() if k != "model"} for m, ms in doc["models"].items()
        }
        if wf.bimodal is not None:
            doc["bimodal"] = {"model": wf.bimodal.model, **asdict(wf.bimodal.split)}
        # JSON keys are strings: a pair of models becomes a list entry
        doc["overlaps"] = [
            {"models": list(pair), "together_s": t} for pair, t in wf.overlaps.items()
        ]
        out[name] = _clean(doc)
    return {"workflows": out}


def _table(stats: dict[str, WorkflowStats]) -> tuple[Table, list[str]]:
    from rich.table import Table  # rich is paid for only when a table is printed

    table = Table(title="workflow statistics", title_justify="left")
    for col in (
        "workflow",
        "model",
        "requests",
        "rate/s",
        "n",
        "p",
        "latency s",
        "share",
        "share cv",
        "latency cv",
        "overlap",
        "tool s",
    ):
        table.add_column(
            col, justify="left" if col in ("workflow", "model") else "right", no_wrap=True
        )
    notes = []
    for name, wf in stats.items():
        if wf.unidentified_calls:
            notes.append(f"{name}: {wf.unidentified_calls} calls without request id (excluded)")
        if wf.requests == 0 and wf.arrivals:
            notes.append(
                f"{name}: {wf.arrivals} requests arrived and none completed in the "
                "window (all still running: overloaded, or longer than the window)"
            )
        if wf.union_requests < wf.requests:
            notes.append(
                f"{name}: shares, overlap, tool time and p from a sample of "
                f"{wf.union_requests} of {wf.requests} requests (--exact for all)"
            )
        if wf.bimodal is not None:
            s = wf.bimodal.split
            notes.append(
                f"{name}: bimodal on {wf.bimodal.model}'s share: {s.low_fraction:.0%} "
                f"of requests ≤ {s.threshold:.2f} (cluster means {s.low_mean:.2f} / "
                f"{s.high_mean:.2f}); consider modelling it as two workflows"
            )
        if wf.tool_time_after_fanout_mean > 0:
            notes.append(
                f"{name}: {wf.tool_time_after_fanout_mean:.3f} s of the tool time per request "
                "follows calls that ran at once (a tool beside a fan-out that outlasted it; "
                "tool time hidden beside calls is not in the records)"
            )
        for (a, b), together in wf.overlaps.items():
            notes.append(f"{name}: {a} and {b} run at once {together:.3f} s per request")
        table.add_row(
            name,
            "(all)",
            str(wf.requests),
            f"{wf.arrival_rate:.3f}",
            "",
            "",
            f"{wf.latency_mean:.3f}",
            "",
            "",
            f"{wf.latency_cv:.2f}",
            f"{wf.overlap_factor:.2f}",
            f"{wf.tool_time_mean:.3f}",
        )
        for model, ms in wf.models.items():
            table.add_row(
                "",
                model,
                str(ms.requests_calling),
                "",
                f"{ms.n:.2f}",
                f"{ms.p:.2f}",
                f"{ms.latency_mean:.3f}",
                f"{ms.share_mean:.2f}",
                f"{ms.share_cv:.2f}",
                "",
                "",
                "",
            )
    return table, notes


def _window(store: Path, text: str) -> Window:
    """The ``--window`` ending at the last recorded call, never reaching back before the first
    one (as the daemon's, ``optimizer.daemon.service.window_stats``): a store shorter than the
    window divides its arrivals by the time it covers, not by the window's length."""
    if text.strip().lower() == "all":
        return Window()
    length_us = round(parse_duration_s(text) * 1e6)
    if length_us <= 0:
        raise UsageError("--window must be positive")
    reader = StoreReader(store)
    try:
        rows = reader.read(
            lambda calls: calls.aggregate("min(t_start), max(coalesce(t_end, t_start))").fetchall()
        )
    finally:
        reader.close()
    if not rows or rows[0][1] is None:
        return Window()
    first, end = int(rows[0][0]), int(rows[0][1]) + 1
    return Window(t_from_us=max(end - length_us, first), t_to_us=end)


def run(args: argparse.Namespace) -> int:
    existing_store(args.store)
    try:
        cap = None if args.exact else UNION_CALLS_CAP
        stats = summarise_store(args.store, _window(args.store, args.window), union_cap=cap)
    except duckdb.Error as exc:
        raise UsageError(f"cannot read the store at {args.store}: {exc}") from exc
    if args.json:
        print(orjson.dumps(to_json(stats), option=orjson.OPT_INDENT_2).decode())
        return 0
    from rich.console import Console

    if not stats:
        Console().print(f"no calls recorded in {args.store} in that window")
    else:
        console = Console(width=None if Console().is_terminal else 160)
        table, notes = _table(stats)
        console.print(table)
        for note in notes:
            console.print(note)
    return 0

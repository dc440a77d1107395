"""What ``scepsy demo`` shows live: the daemon's latest pass, as rich renderables.

Role: turn one :class:`optimizer.daemon.service.TickReport` (plus the demo's phase line and the profile
book) into tables: per workflow the statistics the daemon learned (rate, n_m, p_m, observed
and predicted latency), the profiles (saturation, light-load latency), the decision with its
reasons, and, when the pass searched, the proposed allocation and placement. Pure rendering:
nothing here starts, waits or reads files. Every table says "emulated".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from optimizer.daemon.service import TickReport
from optimizer.model.curves import ProfileBook

__all__ = ["render"]


def _s(x: float | None, unit: str = "s") -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:.3g}{unit}"


def _stats_table(report: TickReport) -> Table:
    t = Table(
        title=f"what the daemon learned (emulated, last {report.window_s:.0f}s window)",
        title_justify="left",
    )
    for col in ("workflow", "rate/s", "requests", "model", "n_m", "p_m", "observed", "predicted"):
        t.add_column(col)
    for name, ws in report.stats.items():
        first = True
        for model, ms in ws.models.items():
            t.add_row(
                name if first else "",
                f"{ws.arrival_rate:.2f}" if first else "",
                str(ws.requests) if first else "",
                model,
                f"{ms.n:.2f}",
                f"{ms.p_agg:.2f}",
                _s(ws.latency_mean) if first else "",
                _s(report.predicted_now.get(name)) if first else "",
            )
            first = False
    return t


def _profiles_table(book: ProfileBook) -> Table:
    t = Table(title="profiles (simulated engine model, tp 1, whole GPU)", title_justify="left")
    for col in ("model", "saturation calls/s", "latency at light load", "at 80% load"):
        t.add_column(col)
    for key, prof in book.profiles.items():
        light = float(prof.lat["mean"][0])
        busy = float(prof.latency(0.8 * prof.saturation)[()])
        t.add_row(key.model, f"{prof.saturation:.3g}", _s(light), _s(busy))
    return t


def _decision(report: TickReport) -> Text:
    d = report.decision
    style = {
        "rollout": "bold green",
        "error": "bold red",
        "hold_cooldown": "yellow",
        "hold_gain": "yellow",
        "pending": "cyan",
    }.get(d.kind, "white")
    text = Text(f"decision: {d.kind}", style=style)
    if report.outcome:
        text.append(
            f" ({report.outcome}"
            + (f", {report.rollout_s:.1f}s" if report.rollout_s is not None else "")
            + ")"
        )
    for reason in d.reasons:
        text.append(f"\n  - {reason}")
    return text


def _allocation_table(report: TickReport) -> Table | None:
    if report.result is None:
        return None
    t = Table(title="proposed allocation (emulated 4-GPU node)", title_justify="left")
    for col in ("workflow", "model", "replicas", "tp", "share", "predicted", "feasible"):
        t.add_column(col)
    for w in report.result.workflows:
        for k, m in enumerate(w.models):
            t.add_row(
                w.workflow if k == 0 else "",
                m.model,
                str(m.alloc.replicas),
                str(m.alloc.tp),
                m.alloc.shares(),
                _s(w.latency) if k == 0 else "",
                str(w.feasible) if k == 0 else "",
            )
    return t


def _placement_table(report: TickReport) -> Table | None:
    if report.placement is None:
        return None
    t = Table(title="placement", title_justify="left")
    for col in ("node", "GPU", "replicas (share)"):
        t.add_column(col)
    by_gpu: dict[tuple[str, int], list[str]] = {}
    for r in report.placement.replicas:
        for g in r.gpus:
            by_gpu.setdefault((r.node, g), []).append(f"{r.demand.model} ({r.share:.2f})")
    for (node, gpu), items in sorted(by_gpu.items()):
        t.add_row(node, str(gpu), ", ".join(items))
    return t


def render(
    phase: str, report: TickReport | None, book: ProfileBook | None, notes: Sequence[str] = ()
) -> RenderableType:
    parts: list[RenderableType] = [Text(f"scepsy demo (EMULATED): {phase}", style="bold")]
    parts += [Text(n, style="dim") for n in notes]
    if book is not None and book.profiles:
        parts.append(_profiles_table(book))
    if report is not None:
        parts.append(_stats_table(report))
        parts.append(_decision(report))
        for table in (_allocation_table(report), _placement_table(report)):
            if table is not None:
                parts.append(table)
    return Group(*parts)

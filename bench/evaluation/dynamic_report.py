"""The dynamic scenario's report: its table, the per-step check and its plot.

Role: renders ``bench.evaluation.daemon.scenario``'s result (plain JSON-ready dicts) as
Markdown lines for ``evaluation.md`` and as ``dynamic.png``; reads nothing else, and every
figure it shows is simulated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.evaluation.setup import DYNAMIC_DRAIN_S
from bench.evaluation.text import fmt as _fmt

__all__ = ["dynamic_markdown", "plot_dynamic"]


def dynamic_markdown(d: dict[str, Any]) -> list[str]:
    lines = [
        "## Dynamic scenario: RAG rate steps, beam steady (simulated)",
        "",
        f"{d['gpus']} GPUs; beam at {_fmt(d['beam_rate'])} req/s; RAG steps "
        f"{', '.join(_fmt(r) for _, r in d['steps'])} req/s, each {d['step_s']:.0f} s. "
        f"Scepsy's controller: {d['controller']}.",
        "",
        "| system | reconfigurations | per step | replicas started | mean latency beam / "
        "RAG (s) | p90 beam / RAG (s) | unfinished beam / RAG |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in d["systems"].items():
        p90, left = s.get("latency_p90", {}), s.get("failed", {})
        lines.append(
            f"| {name} | {s['reconfigurations']} | {s['per_step']} | "
            f"{s['replicas_started']} | {_fmt(s['latency_mean']['beam'])} / "
            f"{_fmt(s['latency_mean']['rag'])} | {_fmt(p90.get('beam', math.nan))} / "
            f"{_fmt(p90.get('rag', math.nan))} | {left.get('beam', '-')} / "
            f"{left.get('rag', '-')} |"
        )
    lines += [
        "",
        "Unfinished: requests still running when the run ended, "
        f"{DYNAMIC_DRAIN_S:.0f} s after the last arrival (a backlog, not an error).",
    ]
    sc = d["systems"].get("scepsy", {})
    if sc.get("rollouts_unplaced"):
        lines += [
            "",
            f"Scepsy's pass could not act on a confirmed change {len(sc['rollouts_unplaced'])} "
            f"time(s) (at {', '.join(f'{t:.0f}' for t in sc['rollouts_unplaced'])} s): the "
            "searched allocation did not place, or no rollout order kept every model served "
            "(an `error` decision, retried the next pass); see `log` in evaluation.json.",
        ]
    lines += _step_check_lines(sc.get("steps", []))
    steps = sc.get("per_step", [2])
    ok = all(n <= 1 for n in steps)
    answered = sum(1 for n in steps[1:] if n >= 1)
    lines += [
        "",
        f"Scepsy reconfigures at most once per rate step: **{'yes' if ok else 'no'}**; "
        f"rate changes answered with a rollout: **{answered} of {len(steps) - 1}** (the "
        "first step runs the allocation planned for it). Latency over time: "
        "`dynamic.png` and `dynamic` in evaluation.json.",
        "",
    ]
    return lines


def _step_check_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Scepsy per rate step, once the step's rollout ended: mean latency against what runs
    predicted (the promise: at most 2x), and requests left unfinished at the end."""
    if not rows:
        return []
    names = list(rows[0]["workflows"])
    out = [
        "",
        "Scepsy per rate step, from the end of the step's rollout (or the step's start) to "
        "the step's end: observed mean latency of the requests arriving then, against what "
        "runs predicted at the observed rates by the step's last pass whose window began "
        "after the rollout ended (the promise: at most 2x); unfinished: those still running "
        "when the run ended.",
        "",
        "| step (s) | settled at (s) | "
        + " | ".join(f"{w} observed / predicted (s) | {w} ratio" for w in names)
        + " |",
        "|---|---|" + "---|---|" * len(names),
    ]
    for r in rows:
        cells = []
        for w in names:
            c = r["workflows"][w]
            ratio = c["ratio"]
            flag = "" if ratio is None or ratio <= 2.0 else " **over 2x**"
            left = f", {c['unfinished']} unfinished" if c["unfinished"] else ""
            cells.append(
                f"{_fmt(c['observed'])} / {_fmt(c['predicted'])} | "
                f"{'-' if ratio is None else _fmt(ratio, 2)}{flag}{left}"
            )
        out.append(
            f"| {r['from']:.0f}-{r['to']:.0f} | {r['settled']:.0f} | " + " | ".join(cells) + " |"
        )
    return out


def plot_dynamic(d: dict[str, Any], out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for i, (name, s) in enumerate(d["systems"].items()):
        colour = f"C{i}"
        for wf, style in (("beam", "-"), ("rag", "--")):
            series = s["timeline"][wf]
            axes[0].plot(
                [t for t, _ in series],
                [v for _, v in series],
                style,
                color=colour,
                label=f"{name} {wf}",
            )
        for t in s["rollout_times"]:
            axes[1].axvline(t, color=colour, alpha=0.5)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("mean latency per 30 s (s)")
    axes[0].legend(fontsize=8)
    axes[1].step(
        [t for t, _ in d["steps"]] + [d["duration_s"]],
        [r for _, r in d["steps"]] + [d["steps"][-1][1]],
        where="post",
    )
    axes[1].set_ylabel("RAG rate (req/s); lines: reconfigurations")
    axes[1].set_xlabel("simulated time (s)")
    fig.tight_layout()
    fig.savefig(out / "dynamic.png", dpi=90)
    plt.close(fig)
    return "dynamic.png"

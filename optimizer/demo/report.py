"""The demo's report: ``report.json`` and ``report.md`` with plots, everything labelled emulated.

Role: from what the demo collected (the daemon's passes, its decision log, the load drivers'
reports, the phases' times), build the JSON document (:func:`report_doc`) and write it with a
markdown page and its plots (:func:`write_report`): arrival rates and rollouts over time,
predicted vs observed latency per workflow, the GPU share per model before and after the
shift, per model how many profile points came from simulated replay and how many the daemon
learned from live traffic (which curves they corrected, and the replica's speed against the
replay), and the profiling runs the daemon started on its own (model, key, why, when, how long).

Invariants: ``report.json`` has at least ``rollouts``, ``failed_requests``, ``allocations``,
``predicted_vs_observed`` and ``problems`` (:func:`problems`: why the run showed less than the
demo exists to show; the command exits non-zero when it is not empty); predictions compared with observations come from windows that start
after the rollout they follow ended (a window straddling a rollout measures neither
allocation); plots use matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from optimizer.control.reprofile import ReprofileRun
from optimizer.daemon.service import TickReport
from optimizer.model.curves import ProfileBook
from shared.profile_points import ProfileError, ProfilePoint, packed_copies

__all__ = ["Pass", "problems", "report_doc", "write_report"]

LABEL = "emulated"


@dataclass(frozen=True)
class Pass:
    """One daemon pass as the demo keeps it: when it started (seconds since the demo started),
    and its report."""

    t: float
    report: TickReport


def _num(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else round(float(x), 4)


def _allocation(report: TickReport) -> dict[str, dict[str, dict[str, float]]]:
    assert report.result is not None
    return {w.workflow: {m.model: m.alloc.doc() for m in w.models} for w in report.result.workflows}


def _entry(report: TickReport) -> dict[str, Any] | None:
    return _allocation(report) if report.result is not None else None


def report_doc(
    passes: Sequence[Pass],
    decisions: Sequence[Mapping[str, Any]],
    loads: Sequence[Mapping[str, Any]],
    timeline: Mapping[str, float],
    settings_doc: Mapping[str, Any],
    t0_wall: float,
    points: Sequence[ProfilePoint] = (),
    reprofiles: Sequence[ReprofileRun] = (),
) -> dict[str, Any]:
    """``Pass.t`` is when the pass started, in seconds since the demo started; ``points``: the
    profile points stored at the end (replayed and live); ``reprofiles``: the profiling runs
    the daemon started."""
    shift = timeline.get("shift", math.inf)
    rollouts: list[dict[str, Any]] = []
    # When each allocation took effect: the bootstrap, then every rollout that succeeded.
    changes: list[tuple[float, str]] = [(timeline.get("bootstrap_ready", 0.0), "bootstrap")]
    rolling: list[tuple[float, float]] = []  # (start, end) of every rollout, ok or not
    for p in passes:
        r = p.report
        if not r.decision.taken:
            continue
        end = p.t + (r.search_s or 0.0) + (r.rollout_s or 0.0)
        rolling.append((p.t, end))
        if r.outcome == "ok":
            changes.append((end, f"rollout {len(rollouts) + 1}"))
        rollouts.append(
            {
                "t": round(p.t, 1),
                "ended": round(end, 1),
                "after_shift": p.t >= shift,
                "outcome": r.outcome,
                "rollout_s": _num(r.rollout_s),
                "search_s": _num(r.search_s),
                "changes": [c.kind for c in r.decision.changes],
                "reasons": list(r.decision.reasons),
                "gain": _num(r.decision.gain),
                "allocation": _entry(r),
                "plan": r.plan.render().splitlines() if r.plan is not None else [],
            }
        )
    before = [p for p in passes if p.t < shift and p.report.result is not None]
    after = [p for p in passes if p.t >= shift and p.report.decision.taken]
    allocations = []
    if before:
        allocations.append(
            {
                "phase": "before shift",
                "t": round(before[-1].t, 1),
                "decision": before[-1].report.decision.kind,
                "allocation": _entry(before[-1].report),
            }
        )
    allocations += [
        {
            "phase": "after shift",
            "t": round(p.t, 1),
            "decision": "rollout",
            "allocation": _entry(p.report),
        }
        for p in after
    ]
    pvo = []
    for p in passes:
        r = p.report
        settled = [label for end, label in changes if end <= p.t - r.window_s]
        # A window a rollout ran in measured neither allocation, and the pass predicted the
        # one the rollout left: it is no evidence either way, so it is left out.
        straddled = any(start < p.t and end > p.t - r.window_s for start, end in rolling)
        if not settled or straddled:
            continue
        for w, ws in r.stats.items():
            pred = r.predicted_now.get(w)
            if pred is None or ws.requests == 0:
                continue
            # The daemon learns live points from the first full window an allocation serves
            # traffic in; windows that start after that one are what its predictions are
            # judged on.
            served = max(end for end, _ in changes if end <= p.t - r.window_s)
            learned = max(served, timeline.get("load_started", 0.0)) + r.window_s
            pvo.append(
                {
                    "t": round(p.t, 1),
                    "workflow": w,
                    "allocation": settled[-1],
                    "judged": p.t - r.window_s >= learned,
                    "rate": round(ws.arrival_rate, 3),
                    "requests": ws.requests,
                    "predicted_s": _num(pred),
                    "observed_s": _num(ws.latency_mean),
                    "error": _num(
                        (pred - ws.latency_mean) / ws.latency_mean if ws.latency_mean > 0 else None
                    ),
                }
            )
    failed = sum(
        int(wf.get("failed", 0)) for load in loads for wf in load.get("workflows", {}).values()
    )
    kinds: dict[str, int] = {}
    for d in decisions:
        kinds[str(d["kind"])] = kinds.get(str(d["kind"]), 0) + 1
    doc: dict[str, Any] = {
        "label": LABEL,
        "note": "every figure comes from emulated engines (scepsy-engine) on an "
        "emulated 4-GPU node; profiles come from the simulator (same engine model); times are "
        "seconds since the demo started",
        "rollouts": rollouts,
        "rollouts_after_shift": sum(1 for r in rollouts if r["after_shift"]),
        "failed_requests": failed,
        "allocations": allocations,
        "predicted_vs_observed": pvo,
        "accuracy": accuracy(pvo),
        "decisions": kinds,
        "profile_points": profile_sources(points),
        "reprofiles": [
            {
                "model": r.model,
                "key": f"{r.gpu_type}/tp{r.tp}/{r.share:g}",
                "reason": r.reason,
                "started": round(r.started - t0_wall, 1),
                "finished": None if r.finished is None else round(r.finished - t0_wall, 1),
            }
            for r in reprofiles
        ],
        "timeline_s": dict(timeline),
        "started_at_epoch_s": t0_wall,
        "load": list(loads),
        "decision_log": [
            {k: d[k] for k in ("kind", "taken", "outcome", "reasons")}
            | {"t": round(float(d["t"]) - t0_wall, 1)}
            for d in decisions
        ],
        "settings": dict(settings_doc),
    }
    doc["problems"] = problems(doc)
    return doc


def profile_sources(points: Sequence[ProfilePoint]) -> dict[str, dict[str, Any]]:
    """Per model: points from replay (and of them, those of a fractional share measured alone
    on its GPU rather than packed next to busy copies) and from live traffic, and the keys
    (``tp``/``share``) whose curve live points corrected, each with the replica's speed
    against the replay."""
    book = ProfileBook(points)
    out: dict[str, dict[str, Any]] = {}
    for p in points:
        entry = out.setdefault(
            p.model, {"replay": 0, "replay_alone": 0, "live": 0, "corrected": []}
        )
        entry["live" if p.source == "live" else "replay"] += 1
        if p.source != "live" and p.colocation == "alone" and packed_copies(p.share) > 1:
            entry["replay_alone"] += 1
    for key in book.live:
        try:
            prof = book.lookup(key.model, key.tp, key.share, key.engine, key.gpu_type)
        except ProfileError:  # live points of a model with no replayed curve correct nothing
            continue
        if prof.corrected_by:
            out[key.model]["corrected"].append(f"tp{key.tp}/{key.share:g} x{prof.speed:.2f}")
    return dict(sorted(out.items()))


def _plots(doc: Mapping[str, Any], passes: Sequence[Pass], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names: list[str] = []
    flows = sorted({w for p in passes for w in p.report.stats})
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for w in flows:
        pts = [(p.t, p.report.stats[w]) for p in passes if w in p.report.stats]
        ax1.plot([t for t, _ in pts], [s.arrival_rate for _, s in pts], marker=".", label=w)
        obs = [(t, s.latency_mean) for t, s in pts if math.isfinite(s.latency_mean)]
        ax2.plot([t for t, _ in obs], [v for _, v in obs], marker=".", label=f"{w} observed")
        pred = [
            (p.t, p.report.predicted_now[w])
            for p in passes
            if math.isfinite(p.report.predicted_now.get(w, math.inf))
        ]
        ax2.plot([t for t, _ in pred], [v for _, v in pred], linestyle="--", label=f"{w} predicted")
    for r in doc["rollouts"]:
        for ax in (ax1, ax2):
            ax.axvspan(r["t"], r["ended"], color="green", alpha=0.2)
    if "shift" in doc["timeline_s"]:
        for ax in (ax1, ax2):
            ax.axvline(doc["timeline_s"]["shift"], color="red", linestyle=":")
    ax1.set_ylabel("arrival rate (req/s)")
    ax2.set_ylabel("mean latency (s)")
    ax2.set_xlabel("seconds since the demo started (green: rollouts, red: RAG x3)")
    for ax in (ax1, ax2):
        if ax.get_legend_handles_labels()[0]:  # a run with no traffic has nothing to label
            ax.legend(fontsize=7)
    fig.suptitle("EMULATED: traffic, rollouts, predicted vs observed latency")
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=100)
    plt.close(fig)
    names.append("timeline.png")
    if doc["allocations"]:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        labels = [f"{a['phase']} (t={a['t']:.0f}s)" for a in doc["allocations"]]
        models = sorted(
            {m for a in doc["allocations"] for w in (a["allocation"] or {}).values() for m in w}
        )
        bottom = [0.0] * len(labels)
        for m in models:
            vals = [
                sum(w.get(m, {}).get("gpus", 0.0) for w in (a["allocation"] or {}).values())
                for a in doc["allocations"]
            ]
            ax.barh(labels, vals, left=bottom, label=m)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set_xlabel("GPU-equivalents (emulated 4-GPU node)")
        ax.legend(fontsize=7, loc="lower right")
        fig.suptitle("EMULATED: allocation per rollout")
        fig.tight_layout()
        fig.savefig(out / "allocations.png", dpi=100)
        plt.close(fig)
        names.append("allocations.png")
    return names


def _markdown(doc: Mapping[str, Any], plots: Sequence[str]) -> str:
    lines = ["# Scepsy demo report (EMULATED)", "", str(doc["note"]), ""]
    if doc["problems"]:
        lines += ["**This run did not show what the demo is for:**", ""]
        lines += [f"- {p}" for p in doc["problems"]] + [""]
    lines += [
        f"- rollouts: {len(doc['rollouts'])} "
        f"({doc['rollouts_after_shift']} after the RAG rate tripled)",
        f"- failed client requests: {doc['failed_requests']}",
        f"- decisions: {', '.join(f'{k} {v}' for k, v in sorted(doc['decisions'].items()))}",
        f"- timeline (s): {', '.join(f'{k} {v:.0f}' for k, v in doc['timeline_s'].items())}",
        "",
    ]
    for name in plots:
        lines += [f"![{name}]({name})", ""]
    lines += [
        "## Allocation before and after the shift",
        "",
        "| phase | t (s) | workflow | model | replicas | tp | share |",
        "|---|---|---|---|---|---|---|",
    ]
    for a in doc["allocations"]:
        for w, models in (a["allocation"] or {}).items():
            for m, x in models.items():
                lines.append(
                    f"| {a['phase']} ({a['decision']}) | {a['t']:.0f} | {w} | {m} | "
                    f"{x['replicas']} | {x['tp']} | {x['share']} |"
                )
    lines.append("")
    for k, r in enumerate(doc["rollouts"], 1):
        lines += [
            f"## Rollout {k} at t={r['t']:.0f}s "
            f"({'after' if r['after_shift'] else 'before'} the shift, {r['outcome']}, "
            f"{r['rollout_s'] or 0:.1f}s)",
            "",
        ]
        lines += [f"- {reason}" for reason in r["reasons"]] + [""]
        if r["allocation"]:
            lines += ["| workflow | model | replicas | tp | share |", "|---|---|---|---|---|"]
            for w, models in r["allocation"].items():
                for m, a in models.items():
                    lines.append(f"| {w} | {m} | {a['replicas']} | {a['tp']} | {a['share']} |")
            lines.append("")
        lines += ["```", *r["plan"], "```", ""]
    lines += [
        "## Profile points: replay vs live",
        "",
        "| model | from simulated replay | of them, a share measured alone | from live traffic "
        "| curves corrected (tp/share x speed against the replay) |",
        "|---|---|---|---|---|",
    ]
    for model, n in doc.get("profile_points", {}).items():
        fixed = ", ".join(n["corrected"]) or "no"
        lines.append(
            f"| {model} | {n['replay']} | {n.get('replay_alone', 0)} | {n['live']} | {fixed} |"
        )
    lines += ["", "## Profiling runs the daemon started on its own", ""]
    runs = doc.get("reprofiles", [])
    if not runs:
        lines.append(
            "None: every model in traffic had a profile, every key the plans wanted was "
            "measured, and no workflow's latency strayed from its prediction for long."
        )
    else:
        lines += ["| model | key | why | started (s) | finished (s) |", "|---|---|---|---|---|"]
        for r in runs:
            end = "-" if r["finished"] is None else f"{r['finished']:.0f}"
            lines.append(
                f"| {r['model']} | {r['key']} | {r['reason']} | {r['started']:.0f} | {end} |"
            )
    lines.append("")
    lines += [
        "## Predicted vs observed mean latency (windows that start after the allocation took effect)",
        "",
        "Judged windows (starting after the first full window an allocation served, which the "
        "daemon learns live profile points from), median |error| per workflow: "
        + ", ".join(
            f"{w} {a['median_abs_error']:.0%} over {a['windows']}"
            if a["median_abs_error"] is not None
            else f"{w} none"
            for w, a in doc.get("accuracy", {}).items()
        ),
        "",
        "| t (s) | workflow | allocation | rate/s | predicted (s) | observed (s) | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in doc["predicted_vs_observed"]:
        err = "-" if p["error"] is None else f"{p['error']:+.0%}"
        lines.append(
            f"| {p['t']:.0f} | {p['workflow']} | {p['allocation']} | {p['rate']} | "
            f"{p['predicted_s']} | {p['observed_s']} | {err} |"
        )
    return "\n".join(lines) + "\n"


def accuracy(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float | int | None]]:
    """Per workflow, the median |predicted - observed| / observed over the judged windows (those
    that start after the first full window an allocation served), and how many there were."""
    out: dict[str, dict[str, float | int | None]] = {}
    for w in sorted({str(r["workflow"]) for r in rows}):
        errors = sorted(
            abs(float(r["error"]))
            for r in rows
            if r["workflow"] == w and r.get("judged") and r["error"] is not None
        )
        median = None
        if errors:
            mid = len(errors) // 2
            median = errors[mid] if len(errors) % 2 else (errors[mid - 1] + errors[mid]) / 2
        out[w] = {"median_abs_error": median, "windows": len(errors)}
    return out


def problems(doc: Mapping[str, Any]) -> list[str]:
    """Why a finished run did not show what the demo is for, one sentence each (empty: it did).

    A run with no traffic, a dead load driver or a daemon that never saw data has shown
    nothing, however clean its other figures look."""
    found: list[str] = []
    for load in doc["load"]:
        if "error" in load:
            found.append(f"load driver {load.get('driver', '?')} failed: {load['error']}")
    completed = sum(
        int(wf.get("completed", 0))
        for load in doc["load"]
        for wf in load.get("workflows", {}).values()
    )
    if completed == 0:
        found.append("no client request completed")
    if doc["failed_requests"]:
        found.append(f"{doc['failed_requests']} client requests failed (see report.json 'load')")
    passes = sum(doc["decisions"].values())
    if passes == 0 or doc["decisions"].get("no_data", 0) == passes:
        found.append(f"the daemon never saw traffic ({passes} passes, none with data)")
    elif doc["rollouts_after_shift"] == 0:
        found.append("the daemon rolled out no new allocation after the RAG rate tripled")
    if completed and not doc["predicted_vs_observed"]:
        found.append("no window after a rollout had both a prediction and observed requests")
    return found


def write_report(out: Path, doc: Mapping[str, Any], passes: Sequence[Pass]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    plots = _plots(doc, passes, out)
    (out / "report.md").write_text(_markdown(doc, plots))

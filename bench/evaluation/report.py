"""The evaluation's summary, Markdown report and throughput-latency curves.

Role: turn ``bench.evaluation.evaluate``'s points (one per system, workflow, cluster size and rate) into
``summary[workflow][gpus][system] = {peak_throughput, latency_ratio_to_scepsy_median, ...}``,
``evaluation.md`` (a table per workflow next to the paper's figures, and every place where
Scepsy is not at or above a baseline, with the planner's facts that explain it) and PNG curves
in the layout of the paper's Fig. 6 (against the baselines), Fig. 7 and 8 (Aegaeon, Ayo)
and Fig. 10 (ablations). The dynamic scenario's section comes from
``bench.evaluation.dynamic_report``.

Definitions: a system's peak is the highest *offered* rate among its sustained points
(``max_sustained_rate``; a point whose allocation does not place on the cluster counts as not
sustained; every system is offered the same rates with the same seeds), and
``peak_throughput`` the in-window completion rate measured at that point (0 when none is
sustained). Peaks compare by offered rate: the measured rate of one point depends on its
window (the autoscaler's is longer, after a warm-up of minutes) and on the Poisson arrivals
that fall in it, so two systems sustaining the same offered rate tie. Latency ratios are
``system / Scepsy`` mean latency at each offered rate both sustain (> 1: Scepsy is faster);
the shortfalls list every rate where a baseline sustains a rate Scepsy does not or is faster
by more than 5%, and every system whose peak is above Scepsy's. ``censored``: the system
sustained the highest rate swept, so its true peak is at least that.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.evaluation.dynamic_report import dynamic_markdown
from bench.evaluation.merge import provenance_lines
from bench.evaluation.setup import (
    AEGAEON_PREFILL_PER_NODE,
    AYO,
    BELOW_SWEEP_FRACTIONS,
    HEADROOM,
    PAPER_ABLATION,
    PAPER_AEGAEON,
    PAPER_AYO,
    PAPER_HPA,
    SYSTEMS,
)
from bench.evaluation.text import fmt as _fmt
from sim.hpa import METRIC as HPA_METRIC

Point = dict[str, Any]
LATENCY_SLACK = 1.05  # a baseline faster than Scepsy by less than this is a tie (noise)


def _group(points: Sequence[Point]) -> dict[tuple[str, int, str], list[Point]]:
    out: dict[tuple[str, int, str], list[Point]] = {}
    for p in points:
        out.setdefault((p["workflow"], p["gpus"], p["system"]), []).append(p)
    for v in out.values():
        v.sort(key=lambda p: p["rate"])
    return out


def _counts(p: Point) -> bool:
    """Sustained on the cluster: an allocation ``optimizer.placement`` cannot place there was
    simulated first-fit on more GPUs than the cluster has, so it sustains nothing here."""
    return bool(p["sustained"]) and p.get("placed") is not False


def summarise(points: Sequence[Point]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The summary, and the shortfalls (where Scepsy is not at or above a baseline)."""
    groups = _group(points)
    summary: dict[str, Any] = {}
    shortfalls: list[dict[str, Any]] = []
    for wf, gpus, system in sorted(groups):
        pts = groups[wf, gpus, system]
        base = {p["rate"]: p for p in groups.get((wf, gpus, "scepsy"), [])}
        ok = [p for p in pts if _counts(p)]
        ratios = [
            p["latency_mean"] / base[p["rate"]]["latency_mean"]
            for p in ok
            if p["rate"] in base and _counts(base[p["rate"]])
        ]
        ratios_p90 = [
            p["latency_p90"] / base[p["rate"]]["latency_p90"]
            for p in ok
            if p["rate"] in base and _counts(base[p["rate"]])
        ]
        top = max(ok, key=lambda p: p["rate"], default=None)
        entry = {
            "peak_throughput": top["throughput"] if top is not None else 0.0,
            "latency_ratio_to_scepsy_median": statistics.median(ratios) if ratios else math.nan,
            "latency_ratio_to_scepsy_range": [min(ratios), max(ratios)] if ratios else None,
            "p90_ratio_to_scepsy_median": (
                statistics.median(ratios_p90) if ratios_p90 else math.nan
            ),
            "max_sustained_rate": top["rate"] if top is not None else 0.0,
            "censored": top is not None and top["rate"] >= max(p["rate"] for p in pts),
            "rates_compared": len(ratios),
            # False: no point of the series placed at all (e.g. one whole-GPU pod per model
            # does not fit): "n/a", not a peak of 0
            "placeable": any("unserved" not in p and p.get("placed") is not False for p in pts),
        }
        summary.setdefault(wf, {}).setdefault(str(gpus), {})[system] = entry
        if system == "scepsy":
            continue
        for p in pts:
            s = base.get(p["rate"])
            if s is None or not _counts(p):
                continue
            if not _counts(s):
                shortfalls.append(_shortfall(p, s, "sustains a rate Scepsy does not"))
            elif p["latency_mean"] * LATENCY_SLACK < s["latency_mean"]:
                shortfalls.append(_shortfall(p, s, "is faster at this rate"))
    for wf, by_gpus in summary.items():
        for gpus, systems in by_gpus.items():
            if "scepsy" not in systems:  # not run at this size: nothing to compare with
                for e in systems.values():
                    e["throughput_ratio_scepsy_over"] = math.nan
                continue
            sc = systems["scepsy"]["max_sustained_rate"]
            for system, e in systems.items():
                e["throughput_ratio_scepsy_over"] = (
                    sc / e["max_sustained_rate"] if e["max_sustained_rate"] > 0 else math.inf
                )
                if system != "scepsy" and e["max_sustained_rate"] > sc * 1.0001:
                    shortfalls.append(
                        {
                            "workflow": wf,
                            "gpus": int(gpus),
                            "system": system,
                            "rate": None,
                            "what": "higher peak",
                            "baseline": e["max_sustained_rate"],
                            "scepsy": sc,
                        }
                    )
    return summary, shortfalls


def _beam_latency(p: Point) -> float | None:
    """Beam search's simulated mean latency in a combined point (None elsewhere)."""
    beam = (p.get("workflows") or {}).get("beam") if p["workflow"] == "combined" else None
    return beam["latency_mean"] if beam else None


def _shortfall(p: Point, s: Point, what: str) -> dict[str, Any]:
    return {
        "workflow": p["workflow"],
        "gpus": p["gpus"],
        "system": p["system"],
        "rate": p["rate"],
        "what": what,
        "beam_latency": {"baseline": _beam_latency(p), "scepsy": _beam_latency(s)},
        "baseline": {
            "latency_mean": p["latency_mean"],
            "throughput": p["throughput"],
            "allocation": p.get("allocation"),
            "alp": p.get("alp"),
            "replica_range": p.get("replica_range"),
        },
        "scepsy": {
            "latency_mean": s["latency_mean"],
            "throughput": s["throughput"],
            "sustained": s["sustained"],
            "allocation": s.get("allocation"),
            "predicted": s.get("predicted"),
            "feasible": s.get("feasible"),
            "alp": s.get("alp"),
        },
    }


def cause(s: dict[str, Any]) -> str:
    """Which part is at fault for one shortfall, from the ALP's view of both allocations at
    that rate: the search's space (the baseline gives a model replicas of different shares),
    the ALP's capacity (it predicts the baseline cannot carry the rate with the search's
    headroom, the simulator sustains it), the search (the ALP rates the baseline better and
    it covers the rate) or the ALP's ranking (it rates Scepsy's better, the simulator does
    not)."""
    b, sc = s["baseline"], s["scepsy"]
    wf = "rag" if s["workflow"] == "combined" else s["workflow"]
    beam = s.get("beam_latency") or {}
    trade = ""
    if (
        beam.get("baseline")
        and beam.get("scepsy")
        and beam["baseline"] > LATENCY_SLACK * beam["scepsy"]
    ):
        trade = (
            f"Trade-off: the baseline's beam search is slower ({_fmt(beam['baseline'])} s "
            f"vs Scepsy's {_fmt(beam['scepsy'])} s; Scepsy's egalitarian split weighs "
            "both workflows). "
        )
    return trade + _cause(s, b, sc, wf)


def _cause(s: dict[str, Any], b: dict[str, Any], sc: dict[str, Any], wf: str) -> str:
    if b.get("alp") is None and s["system"] in AEGAEON_PREFILL_PER_NODE:
        return "pooled instances switching models; the ALP cannot rate a multiplexed pool"
    if b.get("alp") is None:
        return (
            f"autoscaled (replicas over the window: {b.get('replica_range')}); the ALP "
            "cannot rate a changing allocation"
        )
    ba, sa = b["alp"].get(wf, {}), (sc.get("alp") or {}).get(wf, {})
    bt, st = ba.get("throughput", 0.0), sa.get("throughput", 0.0)
    bl, sl = ba.get("latency"), sa.get("latency")
    view = (
        f"ALP: baseline {_fmt(bt)} req/s capacity, latency {_fmt(bl)} s; Scepsy "
        f"{_fmt(st)} req/s, {_fmt(sl)} s"
    )
    if bl is None and bt > st:
        return (
            f"{view}. Search space: the baseline gives one model replicas of more kinds "
            "than the search's unit (one TP and share per model, and a rest of TP-1 "
            "replicas on one smaller share) can express"
        )
    goal = s["rate"] * (1.0 + HEADROOM)
    if bt < goal:
        return (
            f"{view}. ALP capacity: it predicts the baseline's allocation below the rate "
            f"with the search's headroom ({_fmt(goal)} req/s), so the search could not "
            "pick it; the simulator sustains it"
        )
    if not s["what"].startswith("is faster") and st >= goal * (1.0 - 1e-6):
        return (
            f"{view}. ALP capacity: it predicts Scepsy's allocation covers the rate with "
            f"the search's headroom ({_fmt(goal)} req/s), the simulator does not sustain "
            "it; the search, which takes the lowest predicted latency among allocations "
            "covering the rate, had no reason to prefer the baseline's"
        )
    if s["what"].startswith("is faster"):
        better = bl is not None and sl is not None and bl < sl
    else:
        better = bt > st * 1.0001
    if better:
        return (
            f"{view}. Search: the ALP rates the baseline better, the search did not pick "
            "it (the search lays each workflow out as one contiguous run per LLM, in a "
            "fixed packing order: a placement that interleaves workflows or puts one "
            "LLM's replicas on scattered GPU pieces is outside its space)"
        )
    return f"{view}. ALP ranking: it rates Scepsy's allocation better, the simulator does not"


def _paper_multiplex(system: str, wf: str, gpus: int) -> str:
    """The paper's figure for Ayo or Aegaeon (any split: it reports the best) on ``wf``."""
    if system == AYO and gpus in PAPER_AYO.get(wf, {}):
        return f"{PAPER_AYO[wf][gpus]}x (vLLM v0.2 both)"
    if system in AEGAEON_PREFILL_PER_NODE and gpus in PAPER_AEGAEON.get(wf, {}):
        thr, lat = PAPER_AEGAEON[wf][gpus]
        return f"{thr}x, latency {lat}x (best split)"
    return ""


def _alloc_text(alloc: Any) -> str:
    if not alloc:
        return "autoscaled"
    return ", ".join(f"{a['model']} {a['replicas']}x(tp{a['tp']},{a['share']:g})" for a in alloc)


def markdown(
    summary: dict[str, Any],
    shortfalls: list[dict[str, Any]],
    meta: dict[str, Any],
    dynamic: dict[str, Any] | None,
    points: Sequence[Point] = (),
) -> str:
    lines = [
        "# Scepsy evaluation (simulated)",
        "",
        "Every figure below is **simulated** (discrete-event simulator, emulated A6000 "
        "GPUs, 4 per node, NVLink in pairs); the paper's figures are measured on real "
        "GPUs and quoted for comparison only.",
        "",
        f"Command: `{meta['command']}` — wall time {meta['wall_s']:.0f} s "
        f"({meta['workers']} workers). Rates swept: "
        f"{', '.join(f'{f:g}' for f in meta['rate_fractions'])} x Scepsy's predicted "
        "capacity on each cluster (combined: of RAG's capacity beside beam at its own rate)."
        + (
            f" A series (system, workflow, cluster) stops after {meta['stop_after']} "
            f"consecutive rates it does not sustain: {meta['skipped']} higher rates were "
            "not run (counted as not sustained)."
            if meta.get("stop_after")
            else ""
        )
        + (f" Traces and profiles: {meta['knowledge']}." if meta.get("knowledge") else ""),
        "",
        *provenance_lines(meta.get("runs", ())),
        "Peak = highest offered rate sustained (req/s; `>=`: the highest rate swept, "
        "so the true peak is higher), with the throughput measured there; `x` = Scepsy "
        "peak / system peak (by offered rate: equal offered rates tie, whatever the "
        "window measured); latency = system / Scepsy mean latency at equal rates both "
        "sustain, median [min-max]. Paper: Fig. 6 (HPA) throughput gain and latency "
        "range. Sustained: >= 95% of the window's requests completed and completions kept "
        "within 5% of arrivals, for every workflow; a point that completed its requests "
        "but fell short over a window too short for its own latency is run once more, "
        "warm-up and window counted in the latency it measured (the same rule for every "
        "system; `stretched_from` in the points).",
        "",
        f"Autoscaler: the Kubernetes HPA per model on whole GPUs, metric {HPA_METRIC}, "
        "target 70%; `hpa` starts cold (one pod per model) at every rate, `hpa_warm` at "
        "the pod counts its own rule settles on at that rate (`sim.hpa.settled_counts`).",
        "",
        "Ayo (paper Fig. 8): the `even` hand allocation on engines without prefix caching "
        "(vLLM v0.2), waiting calls served by their workflow request's start; the paper ran "
        "Scepsy on vLLM v0.2 for that comparison, here Scepsy keeps its prefix caches, so the "
        "ratio includes their gain. Aegaeon (paper Fig. 7): every GPU a whole-GPU instance "
        "multiplexing all models, one at a time, paying a model switch (weights and KV over "
        "PCIe from host memory) when it changes model; `aegaeon_3p1d` etc. name the prefill/"
        "decode instances per node; encoders and one-token calls run on prefill instances; "
        "no prefix caching (`sim.multiplex`). Both also run at "
        f"{', '.join(f'{f:g}' for f in BELOW_SWEEP_FRACTIONS)} x capacity, below the sweep. "
        "Their paper figures: Scepsy's throughput gain (and Aegaeon's latency ratio) against "
        "the baseline's best split.",
        "",
    ]
    for wf, by_gpus in summary.items():
        lines += [f"## {wf}", ""]
        if wf == "combined":
            lines += [
                "Beam search held at a fixed rate (see points), RAG swept; throughput "
                "and latency are RAG's, a point counts only if both workflows sustain "
                "it.",
                "",
            ]
        lines += [
            "| GPUs | system | peak req/s | measured req/s | x | latency ratio | "
            "p90 ratio | paper |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for gpus, systems in sorted(by_gpus.items(), key=lambda kv: int(kv[0])):
            for system in SYSTEMS:
                e = systems.get(system)
                if e is None:
                    continue
                rng = e["latency_ratio_to_scepsy_range"]
                lat = (
                    f"{_fmt(e['latency_ratio_to_scepsy_median'])} [{_fmt(rng[0])}-{_fmt(rng[1])}]"
                    if rng
                    else "-"
                )
                paper = ""
                if system.startswith("hpa") and wf in PAPER_HPA and int(gpus) in PAPER_HPA[wf]:
                    thr, (lo, hi) = PAPER_HPA[wf][int(gpus)]
                    paper = f"{thr}x, latency {lo}-{hi}x"
                elif system.startswith("no_") and wf in PAPER_ABLATION:
                    paper = PAPER_ABLATION[wf]
                else:
                    paper = _paper_multiplex(system, wf, int(gpus))
                peak = (">=" if e["censored"] else "") + _fmt(e["max_sustained_rate"])
                measured = _fmt(e["peak_throughput"])
                if not e.get("placeable", True):
                    peak = measured = "n/a"
                lines.append(
                    f"| {gpus} | {system} | {peak} | {measured} | "
                    f"{_fmt(e['throughput_ratio_scepsy_over'])} | {lat} | "
                    f"{_fmt(e['p90_ratio_to_scepsy_median'])} | {paper} |"
                )
        lines.append("")
        missing = [g for g, systems in by_gpus.items() if "scepsy" not in systems]
        if missing:
            lines += [
                f"Scepsy was not run on {', '.join(sorted(missing, key=int))} GPUs here: "
                "those rows are the baselines alone, compared with nothing.",
                "",
            ]
    unplaced = Counter(
        (p["workflow"], p["gpus"], p["system"]) for p in points if p.get("placed") is False
    )
    if unplaced:
        lines += [
            "Allocations `optimizer.placement` could not place on the cluster (the "
            "simulator ran them anyway, first-fit, spilling onto GPUs the cluster does "
            "not have; they count as not sustained, their latencies are not compared): "
            + "; ".join(
                f"{w} {g} GPUs {s} ({n} rates)" for (w, g, s), n in sorted(unplaced.items())
            )
            + ".",
            "",
        ]
    lines += alp_check(points)
    lines += ["## Where Scepsy is not at or above a baseline", ""]
    if not shortfalls:
        lines.append(
            "Nowhere: at every cluster size Scepsy's peak is at or above every "
            "baseline's, and its latency at or below theirs (5% slack) at every rate "
            "both sustain."
        )
    for s in shortfalls:
        if s["rate"] is None:
            lines.append(
                f"- {s['workflow']}, {s['gpus']} GPUs: **{s['system']}** reaches a "
                f"higher peak ({_fmt(s['baseline'])} vs {_fmt(s['scepsy'])} req/s)."
            )
            continue
        b, sc = s["baseline"], s["scepsy"]
        lines.append(
            f"- {s['workflow']}, {s['gpus']} GPUs, {_fmt(s['rate'])} req/s: **{s['system']}** "
            f"{s['what']} (latency {_fmt(b['latency_mean'])} s vs Scepsy "
            f"{_fmt(sc['latency_mean'])} s{'' if sc['sustained'] else ', Scepsy not sustained'}"
            f"). Baseline: {_alloc_text(b['allocation'])}. Scepsy: "
            f"{_alloc_text(sc['allocation'])}. Cause: {cause(s)}."
        )
    lines += [""]
    if dynamic is not None:
        lines += dynamic_markdown(dynamic)
    return "\n".join(lines) + "\n"


def alp_check(points: Sequence[Point]) -> list[str]:
    """Scepsy's own points: the capacity the ALP predicted for the allocation chosen at each
    rate against whether the simulator sustained the rate (over: predicted to cover it, not
    sustained; under: predicted short of it, sustained)."""
    lines = [
        "## The ALP against the simulator on Scepsy's allocations",
        "",
        "Per Scepsy point: offered rate, the ALP's predicted capacity of the allocation "
        "chosen for it, and whether the simulator sustained the rate. `over`: the ALP "
        "promised the rate and the simulator did not sustain it; `under`: the ALP "
        "predicted less than the rate and the simulator sustained it.",
        "",
    ]
    for (wf, gpus, system), pts in sorted(_group(points).items()):
        if system != "scepsy":
            continue
        swept = "rag" if wf == "combined" else wf
        cells = []
        for p in pts:
            cap = ((p.get("predicted") or {}).get(swept) or {}).get("throughput")
            if cap is None:
                continue
            tag = (
                "over"
                if cap >= p["rate"] and not p["sustained"]
                else "under"
                if cap < p["rate"] and p["sustained"]
                else "ok"
            )
            cells.append(
                f"{_fmt(p['rate'])}: {_fmt(cap)} "
                f"{'sustained' if p['sustained'] else 'not sustained'} ({tag})"
            )
        if cells:
            lines.append(f"- {wf}, {gpus} GPUs: " + "; ".join(cells) + ".")
    return [*lines, ""]


def plot_curves(points: Sequence[Point], out: Path) -> list[str]:
    """One PNG per workflow and cluster size: baselines (Fig. 6), Ayo and Aegaeon (Fig. 7, 8)
    and ablations (Fig. 10)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _group(points)
    files = []
    for wf, gpus in sorted({(w, g) for w, g, _ in groups}):
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
        panels = (
            ("vs baselines (Fig. 6)", ("scepsy", "hpa", "hpa_warm", "independent", "even")),
            ("vs Ayo, Aegaeon (Fig. 7, 8)", ("scepsy", AYO, *AEGAEON_PREFILL_PER_NODE)),
            ("ablations (Fig. 10)", ("scepsy", "no_tp", "no_fraction", "no_tp_no_fraction")),
        )
        for ax, (title, systems) in zip(axes, panels, strict=True):
            for system in systems:
                pts = groups.get((wf, gpus, system), [])
                xs = [p["throughput"] for p in pts]
                ys = [p["latency_mean"] for p in pts]
                ax.plot(xs, ys, marker="o", label=system)
                ax.scatter(
                    [p["throughput"] for p in pts if not p["sustained"]],
                    [p["latency_mean"] for p in pts if not p["sustained"]],
                    marker="x",
                    color="black",
                    zorder=3,
                )
            if any(
                0 < (p["latency_mean"] or 0) < math.inf
                for s in systems
                for p in groups.get((wf, gpus, s), [])
            ):
                ax.set_yscale("log")  # (no finite latency at all: a linear empty panel)
            ax.set_xlabel("throughput (req/s, simulated)")
            ax.set_ylabel("mean latency (s, simulated)")
            ax.set_title(f"{wf}, {gpus} GPUs: {title}")
            ax.legend(fontsize=8)
        fig.tight_layout()
        name = f"curves_{wf}_{gpus}gpus.png"
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
        files.append(name)
    return files

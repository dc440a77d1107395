"""The picks bench's figures: errors, summaries and the fitted-set-only prediction.

Role: :mod:`bench.accuracy.alp_picks` simulates; this module turns predictions and simulated
figures into its report: one judged allocation's document (:func:`point_docs`: predicted
against simulated capacity and latencies, with their uncertainty bands), relative errors,
the per-set summary against the targets, how many figures lie in the bands, and
:func:`borrowed`, an allocation predicted with the fitted set's keys only beside the
reprofiled prediction.
Every figure is *simulated*.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.accuracy import pick_sets
from bench.accuracy.alp_accuracy import LATENCY_LOAD_MAX, TARGETS
from bench.accuracy.alp_truth import EvalJob
from bench.accuracy.cases import Alloc, Case
from bench.accuracy.pick_knowledge import Learned
from optimizer.model.alp import ModelAlloc

# a figure within this of the prediction's uncertainty band counts as inside it (the
# simulated truth's own precision: 3-5% standard error, CAP_PRECISION 3-10%)
BAND_TOL = 0.05


def relative_error(pred: float, sim: float) -> float:
    return abs(pred - sim) / sim if sim > 0 else float("inf")


def summary(throughput_errors: Sequence[float], latency_errors: Sequence[float]) -> dict[str, Any]:
    """Max and median relative error of max throughput and of mean latency (<= 80% load)."""

    def stats(xs: Sequence[float]) -> tuple[float, float]:
        return (max(xs), statistics.median(xs)) if xs else (float("nan"), float("nan"))

    t_max, t_med = stats(throughput_errors)
    l_max, l_med = stats(latency_errors)
    return {
        "throughput_error_max": t_max,
        "throughput_error_median": t_med,
        "latency_error_max": l_max,
        "latency_error_median": l_med,
        "allocations": len(throughput_errors),
        "latency_points": len(latency_errors),
        "meets_targets": t_max <= TARGETS["throughput_error_max"]
        and l_max <= TARGETS["latency_error_max"],
    }


def band_coverage(docs: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The share of throughput and latency figures (<= 80% load) inside the prediction's
    uncertainty band (``within_band``)."""
    thr = [d["throughput"]["within_band"] for d in docs]
    lat = [
        p["within_band"] for d in docs for p in d["latency"] if p["load"] <= LATENCY_LOAD_MAX + 1e-9
    ]
    return {
        "throughput_within_band": sum(thr) / len(thr) if thr else math.nan,
        "latency_within_band": sum(lat) / len(lat) if lat else math.nan,
    }


def alloc_doc(alloc: Alloc) -> dict[str, dict[str, float]]:
    return {m: ModelAlloc(*row).doc() for m, row in alloc.items()}


def borrowed(
    k: Learned, alloc: Alloc, doc: dict[str, Any]
) -> tuple[dict[str, Any], float, list[float]]:
    """``alloc`` (judged in ``doc``) predicted with the fitted set's keys only (``k``: before
    the reprofiler ran), against the same simulated figures: its capacity and each latency
    point's prediction at the point's rate, with their errors."""
    cap = k.predict(alloc, None).throughput
    thr_err = relative_error(cap, doc["throughput"]["simulated"])
    out: dict[str, Any] = {
        "curves": pick_sets.provenance(k.book, alloc),
        "throughput": {"predicted": cap, "error": thr_err},
        "latency": [],
    }
    lat_errs = []
    for point in doc["latency"]:
        pred = k.predict(alloc, point["rate"]).latency
        err = relative_error(pred, point["simulated"])
        if point["load"] <= LATENCY_LOAD_MAX + 1e-9:
            lat_errs.append(err)
        out["latency"].append({"load": point["load"], "predicted": pred, "error": err})
    return out, thr_err, lat_errs


@dataclass(frozen=True)
class Judged:
    """One allocation to judge: its set, where it came from, and the Case that holds it."""

    workflow: str
    set: str
    index: int  # in ``case.allocations``
    case: Case  # the workflow's case holding every judged allocation (alp_truth indexes it)
    context: dict[str, Any]


def point_docs(
    k: Learned, j: Judged, jobs: Sequence[EvalJob], sims: Sequence[dict[str, Any]]
) -> tuple[dict[str, Any], float, list[float]]:
    alloc = j.case.allocations[j.index]
    doc: dict[str, Any] = {
        "set": j.set,
        "allocation": alloc_doc(alloc),
        "curves": pick_sets.provenance(k.book, alloc),
        **j.context,
        "latency": [],
    }
    thr_err = math.nan
    lat_errs: list[float] = []
    for ev, sim in zip(jobs, sims, strict=True):
        if ev.kind == "capacity":
            thr_err = relative_error(ev.rate, sim["capacity"])
            low = k.predict(alloc, None).capacity_low
            doc["throughput"] = {
                "predicted": ev.rate,
                "simulated": sim["capacity"],
                "error": thr_err,
                "signed_error": (ev.rate - sim["capacity"]) / sim["capacity"],
                # the share model's band: the truth between the slow end and the prediction
                "predicted_low": low,
                "within_band": low * (1 - BAND_TOL) <= sim["capacity"] <= ev.rate * (1 + BAND_TOL),
                "simulated_kept_up_at": sim["kept_up_at"],
                "simulated_overloaded_at": sim["overloaded_at"],
                "simulated_backlog_throughput": sim["backlog_throughput"],
            }
            continue
        pred = k.predict(alloc, ev.rate)
        err = relative_error(pred.latency, sim["latency_mean"])
        if ev.fraction <= LATENCY_LOAD_MAX + 1e-9:
            lat_errs.append(err)
        doc["latency"].append(
            {
                "load": ev.fraction,
                "rate": ev.rate,
                "predicted": pred.latency,
                "simulated": sim["latency_mean"],
                "simulated_se": sim["latency_se"],
                "error": err,
                "signed_error": (pred.latency - sim["latency_mean"]) / sim["latency_mean"],
                "predicted_high": pred.latency_high,
                "within_band": pred.latency * (1 - BAND_TOL)
                <= sim["latency_mean"]
                <= pred.latency_high * (1 + BAND_TOL),
                "bottleneck": pred.bottleneck,
                "requests": sim["requests"],
            }
        )
    return doc, thr_err, lat_errs

"""optimizer.stats.figures against a brute-force reference on random traces: overlapping and nested
calls, calls across models at once, retries, missing request ids, calls still running and the
proxy's open rows of calls that finished later, windows.

The reference re-derives every figure from DESIGN §3.4 row by row in plain Python, so the
DuckDB pass + numpy unions must agree with it exactly (up to float rounding)."""

from __future__ import annotations

import itertools
import math
import random
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from optimizer.stats.figures import Window, WorkflowStats
from optimizer.stats.reader import summarise_store
from shared.records import CallRecord
from tests.optimizer.conftest import Row, S, call
from tests.optimizer.stats.test_stats_union import _union

Write = Callable[[list[Row]], Path]
MODELS = {"a": ("gen", "ver"), "b": ("emb", "gen", "llm")}


def _trace(rng: random.Random) -> list[Row]:
    rows: list[Row] = []
    for i in range(rng.randint(5, 40)):
        wf = rng.choice(sorted(MODELS))
        t0 = rng.uniform(0, 100)
        rid = None if rng.random() < 0.05 else f"r{i}"
        for j in range(rng.randint(1, 8)):
            start = round(t0 + rng.choice([0.0, 0.5, 1.0, rng.uniform(0, 6)]), 3)
            end = None if rng.random() < 0.05 else round(start + rng.uniform(0, 4), 3)
            model = rng.choice(MODELS[wf])
            prompt = None if rng.random() < 0.1 else rng.randint(1, 50)
            if rng.random() < 0.1:  # a retried call: the attempt-0 row must be dropped
                rows.append(
                    call(
                        wf,
                        rid,
                        model,
                        start,
                        start + 9.0,
                        call_id=f"x{i}-{j}",
                        attempt=0,
                        prompt=999,
                        status=502,  # the proxy's retry: the last attempt decides
                    )
                )
                rows.append(
                    call(wf, rid, model, start, end, call_id=f"x{i}-{j}", attempt=1, prompt=prompt)
                )
            else:
                # a call failed on the serving side (5xx, 408, 429, 499) fails its request; a
                # client's own mistake (another 4xx) does not
                status = rng.choice([502, 429, 499, 400, 422]) if rng.random() < 0.08 else 200
                rows.append(call(wf, rid, model, start, end, prompt=prompt, status=status))
                if end is not None and rng.random() < 0.15:  # announced while it ran
                    rows.append(CallRecord(*rows[-1]).opened())
    return rows


def _reference(rows: list[Row], window: Window) -> dict[str, dict[str, Any]]:
    cols = (
        "call_id",
        "workflow",
        "request_id",
        "model",
        "attempt",
        "t_start",
        "t_end",
        "prompt_tokens",
        "status",
    )
    idx = {
        name: i
        for i, name in enumerate(
            (
                "call_id",
                "proxy_id",
                "workflow",
                "request_id",
                "model",
                "endpoint",
                "upstream",
                "attempt",
                "status",
                "error",
                "stream",
                "t_start",
                "t_first_byte",
                "t_end",
                "prompt_tokens",
            )
        )
    }
    recs = [{c: r[idx[c]] for c in cols} for r in rows]
    top: dict[str, int] = defaultdict(int)
    for r in recs:
        top[r["call_id"]] = max(top[r["call_id"]], r["attempt"])
    recs = [r for r in recs if r["attempt"] == top[r["call_id"]]]
    lo, t_to = window.t_from_us, window.t_to_us
    hi = None if t_to is None else t_to - window.settle_us

    def windowed(r: dict[str, Any]) -> bool:
        return (lo is None or r["t_start"] >= lo) and (t_to is None or r["t_start"] < t_to)

    out: dict[str, dict[str, Any]] = {}
    by_req: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    finished = {r["call_id"] for r in recs if r["t_end"] is not None}
    running: dict[tuple[str, str], list[int]] = defaultdict(list)  # open, not superseded
    for r in recs:
        wf = r["workflow"] or ""
        doc = out.setdefault(wf, {"unidentified": 0, "tokens": defaultdict(list)})
        if r["t_end"] is None:
            if r["request_id"] is not None and r["call_id"] not in finished:
                running[(wf, r["request_id"])].append(r["t_start"])
            continue
        if windowed(r):
            if r["request_id"] is None:
                doc["unidentified"] += 1
            if r["prompt_tokens"] is not None:
                doc["tokens"][r["model"]].append(r["prompt_tokens"])
        if r["request_id"] is not None:
            by_req[(wf, r["request_id"])].append(r)

    def first(k: tuple[str, str]) -> int:
        return int(min([c["t_start"] for c in by_req.get(k, [])] + running.get(k, [])))

    arrived = {
        k
        for k in {*by_req, *running}
        if (lo is None or first(k) >= lo) and (hi is None or first(k) < hi)
    }
    done = {
        k: by_req[k]
        for k in arrived
        if k not in running
        and (hi is None or max(c["t_end"] for c in by_req[k]) <= hi)
        and not any(c["status"] >= 500 or c["status"] in (408, 429, 499) for c in by_req[k])
    }
    for wf, doc in out.items():
        reqs = [v for (w, _), v in done.items() if w == wf]
        doc["arrivals"] = sum(1 for (w, _) in arrived if w == wf)
        doc["requests"] = len(reqs)
        if not reqs:
            continue
        spans, crit, stage, tool = [], [], [], []
        together: dict[tuple[str, str], float] = defaultdict(float)
        per_model: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for calls in reqs:
            span = max(c["t_end"] for c in calls) - min(c["t_start"] for c in calls)
            total = sum(c["t_end"] - c["t_start"] for c in calls)
            union_all = _union([(c["t_start"], c["t_end"]) for c in calls])
            unions = 0
            called = sorted({c["model"] for c in calls})
            for a, b in itertools.combinations(called, 2):  # the time both models run
                ua, ub, uab = (
                    _union([(c["t_start"], c["t_end"]) for c in calls if c["model"] in ms])
                    for ms in ((a,), (b,), (a, b))
                )
                together[(a, b)] += ua + ub - uab
            for m in called:
                mine = [c for c in calls if c["model"] == m]
                u = _union([(c["t_start"], c["t_end"]) for c in mine])
                d = sum(c["t_end"] - c["t_start"] for c in mine)
                unions += u
                pm = per_model[m]
                pm["k"].append(len(mine))
                pm["dur"].append(d)
                pm["u"].append(u)
                if u:
                    pm["p"].append(d / u)
                if total:
                    pm["share"].append(d / total)
            spans.append(span)
            crit.append(union_all)
            stage.append(unions)
            tool.append(span - union_all)
        n = len(reqs)
        doc["latency_mean"] = np.mean(spans) / S
        doc["critical_path_mean"] = np.mean(crit) / S
        doc["stage_sum_mean"] = np.mean(stage) / S
        doc["tool_time_mean"] = np.mean(tool) / S
        doc["overlaps"] = {k: v / n / S for k, v in together.items() if v > 0}
        doc["models"] = {}
        for m, pm in per_model.items():
            share = np.asarray(pm["share"] + [0.0] * (n - len(pm["share"])))
            doc["models"][m] = {
                "calls": sum(pm["k"]),
                "requests_calling": len(pm["k"]),
                "n": sum(pm["k"]) / n,
                "p": np.mean(pm["p"]) if pm["p"] else math.nan,
                "latency_mean": sum(pm["dur"]) / sum(pm["k"]) / S,
                "busy_mean": sum(pm["u"]) / n / S,
                "share_mean": share.mean(),
                "share_cv": share.std() / share.mean() if share.mean() > 0 else 0.0,
            }
    return out


def _check(got: dict[str, WorkflowStats], want: dict[str, dict[str, Any]]) -> None:
    assert set(got) == set(want)
    for wf, doc in want.items():
        mine = got[wf]
        assert mine.unidentified_calls == doc["unidentified"], wf
        assert mine.requests == doc["requests"], wf
        assert mine.arrivals == doc["arrivals"], wf
        for model, tokens in doc["tokens"].items():
            if model in mine.models:
                ts = mine.models[model].prompt_tokens
                assert ts.mean == pytest.approx(np.mean(tokens))
                assert ts.p50 == pytest.approx(np.quantile(tokens, 0.5))
                assert ts.p90 == pytest.approx(np.quantile(tokens, 0.9))
        if not doc["requests"]:
            continue
        for key in ("latency_mean", "critical_path_mean", "stage_sum_mean", "tool_time_mean"):
            assert getattr(mine, key) == pytest.approx(doc[key], abs=1e-9), (wf, key)
        assert set(mine.overlaps) == set(doc["overlaps"]), wf
        for pair, value in doc["overlaps"].items():
            assert mine.overlaps[pair] == pytest.approx(value, abs=1e-9), (wf, pair)
        assert set(mine.models) == set(doc["models"])
        for model, ref in doc["models"].items():
            ms = mine.models[model]
            for key, value in ref.items():
                assert getattr(ms, key) == pytest.approx(value, abs=1e-9, nan_ok=True), (
                    wf,
                    model,
                    key,
                )


@pytest.mark.parametrize("seed", range(8))
def test_random_traces_match_the_reference(write_store: Write, seed: int) -> None:
    rows = _trace(random.Random(seed))
    store = write_store(rows)
    _check(summarise_store(store), _reference(rows, Window()))
    window = Window(t_from_us=20 * S, t_to_us=80 * S, settle_us=3 * S)
    _check(summarise_store(store, window), _reference(rows, window))

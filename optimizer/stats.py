"""Workflow statistics: what the recorded calls say about how each workflow uses each LLM.

Role: the first optimizer stage (DESIGN §3.4, paper §4 step 2). Input: the call records of a
time window (the relation ``StoreReader.calls`` returns); output: one frozen
:class:`WorkflowStats` per workflow with, per model, the Aggregate LLM Pipeline inputs ``n_m``
(calls per request) and ``p_m`` (request-level parallelism), and the stability figures the paper
relies on (share of LLM time and its coefficient of variation across requests).

Beyond the paper, per request: the *critical path* (length of the union of every call interval,
whatever the model) against the sum of the per-model unions gives an ``overlap_factor`` (< 1
when calls to different LLMs run at once, so their stage latencies must not simply be added),
and the gaps inside a request's span that no call covers give the non-LLM ``tool_time``. A
workflow whose requests split into two populations by share is flagged (``bimodal``).

Invariants:
- all heavy aggregation runs in DuckDB SQL (10 M calls in well under two seconds); Python only
  touches per-workflow and per-(workflow, model) rows, plus a per-request share vector for the
  bimodality test;
- a retried call is one logical call: rows sharing a ``call_id`` collapse to the highest
  ``attempt``;
- calls without a request id are counted (``unidentified_calls``) and excluded from every
  per-request figure; calls without ``t_end`` are ignored;
- a request arrives at its first call's start and counts only if that start lies in the window;
  it is *completed* when its last call ended by ``t_to - settle``; only completed requests feed
  per-request figures;
- times in the output are seconds; nothing here opens files (see :func:`summarise_store`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np

from optimizer.modality import Split, bimodal_split
from shared.store import StoreReader

US = 1_000_000.0
_names = itertools.count()


@dataclass(frozen=True, slots=True)
class Window:
    """The time window to summarise; ``None`` bounds mean "as far as the data goes"."""

    t_from_us: int | None = None
    t_to_us: int | None = None
    settle_us: int = 0  # a request whose last call ended later than t_to - settle may still run


@dataclass(frozen=True, slots=True)
class TokenStats:
    """A token-count distribution over calls; ``nan`` where the engine reported no usage."""

    mean: float
    p50: float
    p90: float


@dataclass(frozen=True, slots=True)
class ModelStats:
    """One LLM's role in one workflow (an Aggregate LLM Pipeline stage's inputs)."""

    model: str
    calls: int  # calls of completed requests
    requests_calling: int  # completed requests with at least one call to this model
    n: float  # mean calls per request, over all completed requests (paper n_m)
    p: float  # per request Σ durations / union length, averaged (paper p_m)
    p_agg: float  # Σ durations / Σ union lengths over requests: what makes n·L/p exact on average
    latency_mean: float  # mean call duration (s)
    busy_mean: float  # mean per-request union length of this model's calls (s)
    share_mean: float  # mean share of the request's summed LLM time
    share_cv: float  # coefficient of variation of that share across requests
    prompt_tokens: TokenStats
    completion_tokens: TokenStats


@dataclass(frozen=True, slots=True)
class Bimodality:
    """Requests fall into two populations by ``model``'s share of their LLM time."""

    model: str
    split: Split


@dataclass(frozen=True, slots=True)
class WorkflowStats:
    """One workflow over one window."""

    workflow: str
    requests: int  # completed requests
    arrivals: int  # requests whose first call started in the window
    arrival_rate: float  # arrivals per second (λ_w)
    window_s: float
    unidentified_calls: int  # calls in the window without a request id (excluded)
    latency_mean: float  # mean request span, first call start to last call end (s)
    latency_cv: float  # coefficient of variation of that span across requests
    critical_path_mean: float  # mean length of the union of all calls' intervals (s)
    stage_sum_mean: float  # mean Σ over models of the per-model union lengths (s)
    overlap_factor: float  # critical_path_mean / stage_sum_mean, in (0, 1]
    tool_time_mean: float  # mean time inside the span not covered by any call (s)
    models: Mapping[str, ModelStats]
    bimodal: Bimodality | None


def _cv(mean: float, mean_sq: float) -> float:
    if mean <= 0:
        return 0.0
    return math.sqrt(max(mean_sq - mean * mean, 0.0)) / mean


def _num(value: object) -> float:
    return float("nan") if value is None else float(value)  # type: ignore[arg-type]


def summarise(
    con: duckdb.DuckDBPyConnection, calls: duckdb.DuckDBPyRelation, window: Window = Window()
) -> dict[str, WorkflowStats]:
    """Statistics per workflow over ``window`` from ``calls`` (a relation on ``con``)."""
    tag = next(_names)
    raw, c, r, rm = (f"_scepsy_{kind}_{tag}" for kind in ("raw", "c", "r", "rm"))
    con.execute("SET enable_progress_bar = false")
    calls.create_view(raw, replace=True)
    try:
        return _summarise(con, raw, c, r, rm, window)
    finally:
        for table in (rm, r, c):
            con.execute(f"DROP TABLE IF EXISTS {table}")
        con.execute(f"DROP VIEW IF EXISTS {raw}")


def _summarise(
    con: duckdb.DuckDBPyConnection, raw: str, c: str, r: str, rm: str, window: Window
) -> dict[str, WorkflowStats]:
    lo = window.t_from_us
    hi = None if window.t_to_us is None else window.t_to_us - window.settle_us
    in_window = " AND ".join(
        [f"t_start >= {int(lo)}" if lo is not None else "true"]
        + ([f"t_start < {int(window.t_to_us)}"] if window.t_to_us is not None else [])
    )
    # Only calls that were retried can have a lower attempt to drop: find those few first, so
    # the common case is one anti-join probe instead of a full group-by over every call.
    con.execute(f"""
        CREATE TEMP TABLE {c} AS
        WITH base AS (
            SELECT call_id, coalesce(workflow, '') AS workflow, request_id,
                   hash(coalesce(workflow, ''), request_id) AS rk, model,
                   coalesce(attempt, 0) AS attempt, t_start, t_end,
                   prompt_tokens, completion_tokens
            FROM {raw}),
        top AS (
            SELECT call_id, max(attempt) AS top FROM base
            WHERE call_id IN (SELECT call_id FROM base WHERE attempt > 0) GROUP BY call_id)
        SELECT base.* EXCLUDE (call_id, attempt) FROM base
        ANTI JOIN top ON base.call_id = top.call_id AND base.attempt < top.top
    """)
    arrive_lo = f"t0 >= {int(lo)}" if lo is not None else "true"
    arrive_hi = f"t0 < {int(hi)}" if hi is not None else "true"
    done = f"t1 <= {int(hi)}" if hi is not None else "true"
    con.execute(f"""
        CREATE TEMP TABLE {r} AS
        SELECT rk, any_value(workflow) AS workflow, min(t_start) AS t0, max(t_end) AS t1,
               sum(t_end - t_start) AS dur
        FROM {c} WHERE request_id IS NOT NULL AND t_end IS NOT NULL
        GROUP BY rk
        HAVING {arrive_lo} AND {arrive_hi}
    """)
    arrivals = dict(con.execute(f"SELECT workflow, count(*) FROM {r} GROUP BY ALL").fetchall())
    con.execute(f"DELETE FROM {r} WHERE NOT ({done})")
    # Union length of sorted intervals without building islands: an interval adds whatever
    # of it lies past the running maximum end of the intervals before it.
    con.execute(f"""
        CREATE TEMP TABLE {rm} AS
        WITH w AS (
            SELECT c.rk, c.workflow, c.model, c.t_start, c.t_end,
                max(c.t_end) OVER (PARTITION BY c.rk, c.model
                    ORDER BY c.t_start ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS pm,
                max(c.t_end) OVER (PARTITION BY c.rk
                    ORDER BY c.t_start ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS pa
            FROM {c} c SEMI JOIN {r} r ON c.rk = r.rk
            WHERE c.t_end IS NOT NULL AND c.request_id IS NOT NULL)
        SELECT rk, any_value(workflow) AS workflow, model, count(*) AS k,
               sum(t_end - t_start)::DOUBLE AS dur,
               sum(greatest(t_end - greatest(t_start, coalesce(pm, t_start)), 0))::DOUBLE AS u,
               sum(greatest(t_end - greatest(t_start, coalesce(pa, t_start)), 0))::DOUBLE AS ua
        FROM w GROUP BY rk, model
    """)
    flows = con.execute(f"""
        WITH q AS (
            SELECT r.workflow, (r.t1 - r.t0)::DOUBLE AS span, sum(rm.u) AS u_sum,
                   sum(rm.ua) AS u_all
            FROM {r} r JOIN {rm} rm USING (rk)
            GROUP BY r.rk, r.workflow, r.t0, r.t1)
        SELECT workflow, count(*), avg(span), avg(span * span), avg(u_all), avg(u_sum),
               avg(span - u_all)
        FROM q GROUP BY ALL
    """).fetchall()
    per_model = con.execute(f"""
        SELECT rm.workflow, rm.model, sum(rm.k), count(*), sum(rm.dur), sum(rm.u),
               avg(rm.dur / nullif(rm.u, 0)),
               sum(rm.dur / nullif(r.dur, 0)), sum((rm.dur / nullif(r.dur, 0)) ** 2)
        FROM {rm} rm JOIN {r} r USING (rk) GROUP BY rm.workflow, rm.model
    """).fetchall()
    tokens = {
        (row[0], row[1]): (TokenStats(*map(_num, row[2:5])), TokenStats(*map(_num, row[5:8])))
        for row in con.execute(f"""
            SELECT workflow, model,
                   avg(prompt_tokens), quantile_cont(prompt_tokens, 0.5),
                   quantile_cont(prompt_tokens, 0.9),
                   avg(completion_tokens), quantile_cont(completion_tokens, 0.5),
                   quantile_cont(completion_tokens, 0.9)
            FROM {c} WHERE {in_window} GROUP BY ALL
        """).fetchall()
    }
    unidentified = dict(
        con.execute(
            f"SELECT workflow, count(*) FROM {c} WHERE request_id IS NULL AND {in_window} "
            "GROUP BY ALL"
        ).fetchall()
    )
    span_us = _window_span_us(con, r, window, lo, hi)

    nan_tokens = TokenStats(math.nan, math.nan, math.nan)
    models: dict[str, dict[str, ModelStats]] = {}
    counts = {row[0]: int(row[1]) for row in flows}
    for wf, model, k, req_calling, dur, u, p, share_sum, share_sq in per_model:
        n_req = counts[wf]
        share_mean = float(share_sum or 0.0) / n_req
        prompt, completion = tokens.get((wf, model), (nan_tokens, nan_tokens))
        models.setdefault(wf, {})[model] = ModelStats(
            model=model,
            calls=int(k),
            requests_calling=int(req_calling),
            n=int(k) / n_req,
            p=_num(p),
            p_agg=float(dur) / float(u) if u else math.nan,
            latency_mean=float(dur) / int(k) / US,
            busy_mean=float(u) / n_req / US,
            share_mean=share_mean,
            share_cv=_cv(share_mean, float(share_sq or 0.0) / n_req),
            prompt_tokens=prompt,
            completion_tokens=completion,
        )
    bimodal = _bimodality(con, r, rm, counts)
    out: dict[str, WorkflowStats] = {}
    for wf, n_req, span, span_sq, u_all, u_sum, tool in flows:
        n_arr = int(arrivals.get(wf, n_req))
        rate_den = span_us.get(wf, 0.0) if lo is None or hi is None else float(hi - lo)
        rate_num = n_arr - 1 if lo is None or hi is None else n_arr
        out[wf] = WorkflowStats(
            workflow=wf,
            requests=int(n_req),
            arrivals=n_arr,
            arrival_rate=rate_num / (rate_den / US) if rate_den > 0 else 0.0,
            window_s=rate_den / US,
            unidentified_calls=int(unidentified.pop(wf, 0)),
            latency_mean=float(span) / US,
            latency_cv=_cv(float(span), float(span_sq)),
            critical_path_mean=float(u_all) / US,
            stage_sum_mean=float(u_sum) / US,
            overlap_factor=float(u_all) / float(u_sum) if u_sum else 1.0,
            tool_time_mean=float(tool) / US,
            models=dict(sorted(models.get(wf, {}).items())),
            bimodal=bimodal.get(wf),
        )
    # A workflow whose every call lacked a request id still shows up, with its count.
    for wf, count in unidentified.items():
        out[wf] = WorkflowStats(
            workflow=wf, requests=0, arrivals=0, arrival_rate=0.0, window_s=0.0,
            unidentified_calls=int(count), latency_mean=math.nan, latency_cv=math.nan,
            critical_path_mean=math.nan, stage_sum_mean=math.nan, overlap_factor=1.0,
            tool_time_mean=math.nan, models={}, bimodal=None,
        )
    return dict(sorted(out.items()))


def _window_span_us(
    con: duckdb.DuckDBPyConnection, r: str, window: Window, lo: int | None, hi: int | None
) -> dict[str, float]:
    """Without explicit bounds, the rate is (arrivals - 1) over first-to-last arrival."""
    if lo is not None and hi is not None:
        return {}
    rows = con.execute(f"SELECT workflow, max(t0) - min(t0) FROM {r} GROUP BY ALL").fetchall()
    return {wf: float(span) for wf, span in rows}


def _bimodality(
    con: duckdb.DuckDBPyConnection, r: str, rm: str, counts: Mapping[str, int]
) -> dict[str, Bimodality]:
    """Per workflow, the model whose per-request share splits most cleanly in two, if any."""
    got = con.execute(f"""
        SELECT rm.workflow, rm.model, list(rm.dur / nullif(r.dur, 0)) AS shares
        FROM {rm} rm JOIN {r} r USING (rk)
        WHERE rm.workflow IN (SELECT workflow FROM {rm} GROUP BY ALL HAVING count(DISTINCT model) > 1)
        GROUP BY ALL
    """).fetchall()
    best: dict[str, Bimodality] = {}
    for wf, model, shares in got:
        values = np.zeros(counts[wf])  # requests that never call the model have share 0
        known = np.asarray([s for s in shares if s is not None], dtype=np.float64)
        values[: known.size] = known
        split = bimodal_split(values)
        if split is not None and (wf not in best or split.eta > best[wf].split.eta):
            best[wf] = Bimodality(model=model, split=split)
    return best


def summarise_store(
    store: str | Path, window: Window = Window(), lookback_us: int = 600 * 1_000_000
) -> dict[str, WorkflowStats]:
    """Read the store and summarise. Calls up to ``lookback_us`` before the window are read so
    that a request straddling its start is recognised as having arrived earlier."""
    reader = StoreReader(store)
    try:
        t_from = None if window.t_from_us is None else window.t_from_us - lookback_us
        return summarise(reader.con, reader.calls(t_from, window.t_to_us), window)
    finally:
        reader.close()

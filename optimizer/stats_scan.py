"""The DuckDB side of workflow statistics: one pass over the call records to compact arrays.

Role: the only part of :mod:`optimizer.stats` that runs SQL. It reads the store in one full
pass of the needed columns (into a narrow numeric temp table; two cheap passes before it find
the few (workflow, model) pairs and the retried calls), and hands numpy what the per-request
work needs: per completed request one row, per call of a completed request ``(pair, a, b)`` sorted
by ``a``, plus token-count histograms and unidentified-call counts. DuckDB does what it is
good at (the scan, retry de-duplication, hash grouping, one single-key sort, all on every
core); :mod:`optimizer.stats_union` does the interval arithmetic in linear passes.

Layout of the sorted calls: every completed request ``i`` owns the integer range
``[off_i, off_i + extent_i]`` with ``off_{i+1} = off_i + extent_i + 1``, where ``extent_i``
covers every start and end of its calls; a call's ``a``/``b`` are its start/end shifted by
``off_i - t0_i``. Sorting by ``a`` therefore orders calls by request, then start, and a
running maximum of ``b`` never carries from one request into the next.

Invariants (the same as before this module existed, DESIGN §3.4):
- a retried call is one logical call: rows sharing a ``call_id`` keep only the highest
  ``attempt`` (skipped when no row has ``attempt > 0``);
- a request is keyed by ``hash(coalesce(workflow, ''), request_id)``; calls without a request
  id only feed the unidentified counts and the token histograms; calls without ``t_end`` only
  the token histograms;
- a request arrives at its first (ended) call's start and counts only if that lies in
  ``[t_from, t_to - settle)``; it is completed when its last call ended by ``t_to - settle``;
- token histograms and unidentified counts cover calls whose start lies in the window;
- every temp table and view it creates is dropped, and the connection's
  ``preserve_insertion_order`` restored, before it returns.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import duckdb
import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]
I32 = npt.NDArray[np.int32]
_names = itertools.count()


@dataclass(frozen=True, slots=True)
class Bounds:
    """The window in microseconds; ``None`` means unbounded on that side."""

    lo: int | None  # arrivals and windowed calls start at or after this
    t_to: int | None  # windowed calls start before this
    hi: int | None  # arrivals start before, completed requests end by, this (t_to - settle)


@dataclass(frozen=True, slots=True)
class Histogram:
    """How many windowed calls of each pair reported each token count (nulls left out)."""

    pair: I32
    value: I64
    count: I64


@dataclass(frozen=True, slots=True)
class Scan:
    """What the statistics need, as arrays. Pair codes index ``pairs``; workflow codes
    index ``workflows``."""

    workflows: tuple[str, ...]
    pairs: tuple[tuple[int, str], ...]  # (workflow code, model; "" if null) per pair code
    arrivals: I64  # per workflow code: requests that arrived in the window
    unidentified: I64  # per workflow code: windowed calls without a request id
    # completed requests, ordered by their offset
    req_pair: I32  # the pair of one of its calls (for its workflow)
    req_t0: I64
    req_t1: I64
    req_dur: I64  # Σ call durations
    req_off: I64  # start of its range in the shifted layout
    # calls of completed requests (with an end), sorted by a
    call_pair: I32
    call_a: I64
    call_b: I64
    prompt: Histogram
    completion: Histogram


def _i64(got: dict[str, npt.NDArray[np.generic]], name: str) -> I64:
    return np.ascontiguousarray(got[name], dtype=np.int64)


def _i32(got: dict[str, npt.NDArray[np.generic]], name: str) -> I32:
    return np.ascontiguousarray(got[name], dtype=np.int32)


def scan(con: duckdb.DuckDBPyConnection, calls: duckdb.DuckDBPyRelation, bounds: Bounds) -> Scan:
    """Run the pass over ``calls`` (a relation on ``con``) for the window ``bounds``."""
    tag = next(_names)
    raw, n, top, c, r, q = (f"_scepsy_{k}_{tag}" for k in ("raw", "n", "top", "c", "r", "q"))
    con.execute("SET enable_progress_bar = false")
    got = con.execute("SELECT current_setting('preserve_insertion_order')").fetchone()
    preserve = bool(got[0]) if got else True
    # Row order never matters here (every result is grouped or sorted), and not keeping the
    # scan's order lets DuckDB fill the temp tables in parallel without re-ordering them.
    con.execute("SET preserve_insertion_order = false")
    calls.create_view(raw, replace=True)
    try:
        return _scan(con, raw, n, top, c, r, q, bounds)
    finally:
        for table in (q, r, c, top, n):
            con.execute(f"DROP TABLE IF EXISTS {table}")
        con.execute(f"DROP VIEW IF EXISTS {raw}")
        con.execute(f"SET preserve_insertion_order = {str(preserve).lower()}")


def _scan(
    con: duckdb.DuckDBPyConnection, raw: str, n: str, top: str, c: str, r: str, q: str,
    bounds: Bounds,
) -> Scan:
    lo, t_to, hi = bounds.lo, bounds.t_to, bounds.hi
    in_window = " AND ".join(
        [f"t_start >= {int(lo)}" if lo is not None else "true"]
        + ([f"t_start < {int(t_to)}"] if t_to is not None else [])
    )
    # Pair codes: the (workflow, model) pairs are few and dictionary-encoded in Parquet, so
    # this pass is cheap, and every later grouping is on a small integer instead of strings.
    con.execute(f"""
        CREATE TEMP TABLE {n} AS
        SELECT (row_number() OVER (ORDER BY workflow, model) - 1)::INTEGER AS pair, workflow, model
        FROM (SELECT DISTINCT coalesce(workflow, '') AS workflow, model FROM {raw})
    """)
    names = con.execute(f"SELECT workflow, model FROM {n} ORDER BY pair").fetchall()
    workflows = tuple(sorted({str(w) for w, _ in names}))
    code = {w: i for i, w in enumerate(workflows)}
    pairs = tuple((code[str(w)], "" if m is None else str(m)) for w, m in names)
    # Retries are rare: find the retried calls' ids first (a filtered scan that decodes
    # call_id only for rows with attempt > 0), and pay for the anti-join only if there are any.
    con.execute(f"""
        CREATE TEMP TABLE {top} AS
        SELECT call_id, max(coalesce(attempt, 0)) AS top FROM {raw}
        WHERE coalesce(attempt, 0) > 0 GROUP BY call_id
    """)
    retried = con.execute(f"SELECT count(*) FROM {top}").fetchone()
    dedup = (
        f"ANTI JOIN {top} x ON b.call_id = x.call_id AND coalesce(b.attempt, 0) < x.top"
        if retried and retried[0] else ""
    )
    con.execute(f"""
        CREATE TEMP TABLE {c} AS
        SELECT CASE WHEN b.request_id IS NULL THEN NULL
                    ELSE hash(coalesce(b.workflow, ''), b.request_id) END AS rk,
               n.pair, b.t_start, b.t_end, b.prompt_tokens, b.completion_tokens
        FROM {raw} b
        JOIN {n} n ON n.workflow = coalesce(b.workflow, '') AND n.model IS NOT DISTINCT FROM b.model
        {dedup}
    """)
    arrive = " AND ".join(
        [f"t0 >= {int(lo)}" if lo is not None else "true"]
        + ([f"t0 < {int(hi)}"] if hi is not None else [])
    )
    con.execute(f"""
        CREATE TEMP TABLE {r} AS
        SELECT rk, any_value(pair) AS pair, min(t_start) AS t0, max(t_end) AS t1,
               max(t_start) AS s1, sum(t_end - t_start)::BIGINT AS dur
        FROM {c} WHERE rk IS NOT NULL AND t_end IS NOT NULL
        GROUP BY rk HAVING {arrive}
    """)
    n_wf = len(workflows)
    wf_of_pair = np.asarray([w for w, _ in pairs], dtype=np.int64)
    arrivals = _per_workflow(con.execute(
        f"SELECT pair, count(*) FROM {r} GROUP BY pair").fetchall(), wf_of_pair, n_wf)
    done = f"t1 <= {int(hi)}" if hi is not None else "true"
    # extent covers starts too (a call may end before it starts); + 1 keeps ranges disjoint.
    con.execute(f"""
        CREATE TEMP TABLE {q} AS
        SELECT rk, pair, t0, t1, dur,
               (sum(greatest(t1, s1) - t0 + 1) OVER (ORDER BY t0, rk ROWS UNBOUNDED PRECEDING)
                - (greatest(t1, s1) - t0 + 1))::BIGINT AS off
        FROM {r} WHERE {done}
    """)
    req = con.execute(f"SELECT pair, t0, t1, dur, off FROM {q} ORDER BY off").fetchnumpy()
    got = con.execute(f"""
        SELECT c.pair, c.t_start + (q.off - q.t0) AS a, c.t_end + (q.off - q.t0) AS b
        FROM {c} c JOIN {q} q USING (rk) WHERE c.t_end IS NOT NULL ORDER BY a
    """).fetchnumpy()
    unidentified = _per_workflow(con.execute(
        f"SELECT pair, count(*) FROM {c} WHERE rk IS NULL AND {in_window} GROUP BY pair"
    ).fetchall(), wf_of_pair, n_wf)
    return Scan(
        workflows=workflows,
        pairs=pairs,
        arrivals=arrivals,
        unidentified=unidentified,
        req_pair=_i32(req, "pair"),
        req_t0=_i64(req, "t0"),
        req_t1=_i64(req, "t1"),
        req_dur=_i64(req, "dur"),
        req_off=_i64(req, "off"),
        call_pair=_i32(got, "pair"),
        call_a=_i64(got, "a"),
        call_b=_i64(got, "b"),
        prompt=_histogram(con, c, "prompt_tokens", in_window),
        completion=_histogram(con, c, "completion_tokens", in_window),
    )


def _per_workflow(rows: list[tuple[int, int]], wf_of_pair: I64, n_wf: int) -> I64:
    out = np.zeros(n_wf, dtype=np.int64)
    for pair, count in rows:
        out[wf_of_pair[pair]] += int(count)
    return out


def _histogram(con: duckdb.DuckDBPyConnection, c: str, column: str, in_window: str) -> Histogram:
    got = con.execute(f"""
        SELECT pair, {column} AS value, count(*) AS count FROM {c}
        WHERE {column} IS NOT NULL AND {in_window} GROUP BY ALL ORDER BY pair, value
    """).fetchnumpy()
    return Histogram(
        pair=_i32(got, "pair"),
        value=_i64(got, "value"),
        count=_i64(got, "count"),
    )

"""What each replica did in a window, read from the trace store (DuckDB, the store edge).

Role: :func:`replica_loads` groups the window's call records by (model, upstream URL) into
:class:`optimizer.stats.replica_load.ReplicaLoad` (calls started and finished, latency mean and
percentiles, TTFT, latency early and late in the window); :func:`replica_loads_store` opens the
store and reads one or more nested windows ending together, keeping per replica the shortest
that holds ``min_calls`` finished calls (:func:`widest_needed`). The daemon turns them into live
profile points (:mod:`optimizer.model.live`).

Invariants:
- a retried call is one logical call, as in the statistics scan: rows sharing a ``call_id``
  keep only the highest ``attempt``; an open row (``t_end`` null) is the same call as the
  finished row that supersedes it (calls are counted by ``call_id``);
- ``started`` counts logical calls whose start lies in ``[t_from, t_to)``; the latency figures
  and ``finished`` cover calls that ended in ``[t_from, t_to)`` with status 200 (a window's
  completions: at a steady load as many as started); ``open_early`` counts logical calls that
  started in the window's first half and had not ended (any status) by its end: calls waiting
  in a queue, where a slowdown in the window's last seconds leaves none; ``finished_late``
  those of ``finished`` that ended in its second half; ``completion_tokens_mean`` is over the
  finished calls whose engine reported usage (``nan`` where none did);
- rows without an upstream (refused before any replica was picked) are left out;
- a replica's load is that of the shortest of the nested windows with ``min_calls`` finished
  calls, else of the shortest window it appears in: a slow or lightly used replica still yields
  a figure (over a longer span) where a busy one keeps the freshest; a longer window is read
  only while a replica of the shorter one is short of calls (one that served nothing in the
  shortest window is not looked for further back); the choice depends on the replicas'
  own counts only;
- the connection is closed whatever happens; a segment found unreadable is skipped
  (``StoreReader.read``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import duckdb

from optimizer.stats.replica_load import ReplicaLoad
from shared.store import StoreReader

__all__ = ["replica_loads", "replica_loads_store", "widest_needed"]

_LOOKBACK_US = 600 * 1_000_000  # calls that ended in the window may have started this early


def replica_loads(
    con: duckdb.DuckDBPyConnection, calls: duckdb.DuckDBPyRelation, t_from_us: int, t_to_us: int
) -> list[ReplicaLoad]:
    """Per (model, upstream) over ``[t_from_us, t_to_us)`` from ``calls`` (a relation on
    ``con``), ordered by model then upstream."""
    view = f"_scepsy_replicas_{id(calls)}"
    calls.create_view(view, replace=True)
    lo, hi = int(t_from_us), int(t_to_us)
    mid = (lo + hi) // 2
    try:
        rows = con.execute(f"""
            WITH top AS (
                SELECT call_id, max(coalesce(attempt, 0)) AS top FROM {view} GROUP BY call_id),
            c AS (
                SELECT b.model, b.upstream, b.call_id, b.status, b.t_start, b.t_first_byte,
                       b.t_end, b.completion_tokens
                FROM {view} b JOIN top x
                  ON b.call_id = x.call_id AND coalesce(b.attempt, 0) = x.top
                WHERE b.upstream IS NOT NULL AND b.model IS NOT NULL),
            done AS (
                SELECT *, (t_end - t_start) / 1e6 AS lat FROM c
                WHERE t_end IS NOT NULL AND status = 200 AND t_end >= {lo} AND t_end < {hi})
            SELECT k.model, k.upstream,
                   coalesce(s.started, 0), coalesce(d.finished, 0), d.lat_mean, d.p50, d.p90,
                   d.p99, d.ttft, d.early, d.late, coalesce(s.open_early, 0),
                   coalesce(d.finished_late, 0), d.completion
            FROM (SELECT DISTINCT model, upstream FROM c
                  WHERE (t_start >= {lo} AND t_start < {hi})
                     OR (t_end >= {lo} AND t_end < {hi})) k
            LEFT JOIN (SELECT model, upstream, count(DISTINCT call_id) AS started,
                              count(DISTINCT call_id) FILTER (WHERE t_start < {mid})
                                - count(DISTINCT call_id) FILTER (
                                    WHERE t_start < {mid} AND t_end IS NOT NULL AND t_end < {hi})
                                AS open_early
                       FROM c WHERE t_start >= {lo} AND t_start < {hi} GROUP BY ALL) s
              USING (model, upstream)
            LEFT JOIN (SELECT model, upstream, count(*) AS finished, avg(lat) AS lat_mean,
                              quantile_cont(lat, 0.5) AS p50, quantile_cont(lat, 0.9) AS p90,
                              quantile_cont(lat, 0.99) AS p99,
                              avg((t_first_byte - t_start) / 1e6) AS ttft,
                              avg(lat) FILTER (WHERE t_start >= {lo} AND t_start < {mid})
                                AS early,
                              avg(lat) FILTER (WHERE t_start >= {mid}) AS late,
                              count(*) FILTER (WHERE t_end >= {mid}) AS finished_late,
                              avg(completion_tokens) AS completion
                       FROM done GROUP BY ALL) d
              USING (model, upstream)
            ORDER BY k.model, k.upstream
        """).fetchall()
    finally:
        con.execute(f"DROP VIEW IF EXISTS {view}")
    return [
        ReplicaLoad(
            model=str(m),
            upstream=str(u),
            t_from_us=lo,
            t_to_us=hi,
            started=int(started),
            finished=int(finished),
            lat_mean=_f(mean),
            lat_p50=_f(p50),
            lat_p90=_f(p90),
            lat_p99=_f(p99),
            ttft_mean=_f(ttft),
            lat_mean_early=_f(early),
            lat_mean_late=_f(late),
            open_early=int(open_early),
            finished_late=int(finished_late),
            completion_tokens_mean=_f(completion),
        )
        for (
            m,
            u,
            started,
            finished,
            mean,
            p50,
            p90,
            p99,
            ttft,
            early,
            late,
            open_early,
            finished_late,
            completion,
        ) in rows
    ]


def _f(x: Any) -> float:
    return math.nan if x is None else float(x)


def widest_needed(by_window: Sequence[Sequence[ReplicaLoad]], min_calls: int) -> list[ReplicaLoad]:
    """Per (model, upstream), its load in the first window of ``by_window`` (shortest first)
    with ``min_calls`` finished calls, else in the first window it appears in; ordered by
    model then upstream."""
    chosen: dict[tuple[str, str], ReplicaLoad] = {}
    for loads in by_window:
        for load in loads:
            key = (load.model, load.upstream)
            held = chosen.get(key)
            if held is None or (held.finished < min_calls <= load.finished):
                chosen[key] = load
    return [chosen[k] for k in sorted(chosen)]


def replica_loads_store(
    store: str | Path,
    t_from_us: int | Sequence[int],
    t_to_us: int,
    *,
    min_calls: int = 0,
) -> list[ReplicaLoad]:
    """:func:`replica_loads` over the store's calls (read from ``_LOOKBACK_US`` before the
    earliest window, so that a call ending in it is seen). ``t_from_us``: one window's start,
    or several nested windows' starts ending at ``t_to_us`` (:func:`widest_needed` picks)."""
    starts = sorted({int(t_from_us)} if isinstance(t_from_us, int) else set(t_from_us))[::-1]
    reader = StoreReader(store)

    def nested(calls: duckdb.DuckDBPyRelation) -> list[list[ReplicaLoad]]:
        out = [replica_loads(reader.con, calls, starts[0], t_to_us)]
        for lo in starts[1:]:  # a longer window only while a replica is short of calls
            if all(ld.finished >= min_calls for ld in out[-1]):
                break
            out.append(replica_loads(reader.con, calls, lo, t_to_us))
        return out

    try:
        by_window = reader.read(nested, starts[-1] - _LOOKBACK_US, t_to_us)
    finally:
        reader.close()
    return widest_needed(by_window, min_calls)

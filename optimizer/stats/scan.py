"""The DuckDB side of workflow statistics: grouped passes over the call records, to arrays.

Role: the only part of :mod:`optimizer.stats.figures` that runs SQL. One pass reads the store's
columns once into a narrow table of integers (request key, pair key, times, tokens; retried
attempts dropped); one grouping of it by request gives every request's span, sums and whether
it arrived in the window and completed. From those, exact figures come cheap: arrivals, every
completed request's span, and per (workflow, model) pair the calls of completed requests and
their summed durations. Everything per (request, model) (shares, interval unions, parallelism
``p_m``) needs each request's calls in start order, the one step that grows faster than the
store (a sort of calls): it runs over a uniform hash sample of each workflow's completed
requests, about ``union_cap`` calls in all (every request when they hold fewer: then every
figure is exact), sorted by ``a`` in the shifted layout below for
:mod:`optimizer.stats.union`. Token-count histograms and unidentified-call counts are exact.

Layout of the sorted calls: every completed request ``i`` owns the integer range
``[off_i, off_i + extent_i]`` with ``off_{i+1} = off_i + extent_i + 1``, where ``extent_i``
covers every start and end of its calls; a call's ``a``/``b`` are its start/end shifted by
``off_i - t0_i``. Sorting by ``a`` therefore orders calls by request, then start, and a
running maximum of ``b`` never carries from one request into the next.

Invariants (DESIGN §3.4):
- a retried call is one logical call: rows sharing a ``call_id`` keep only the highest
  ``attempt`` (skipped when no row has ``attempt > 0``);
- a request is keyed by ``hash(coalesce(workflow, ''), request_id)``; calls without a request
  id only feed the unidentified counts and the token histograms;
- an open row (``t_end`` null: a call in flight when the proxy flushed, ``shared.records``) is
  superseded by a finished row of the same ``call_id``; one that is not marks its call as
  still running: the call's start counts for its request's arrival, and the request is not
  completed. Open rows feed nothing else (matching them decodes ``call_id``, paid only when
  the store holds any);
- a request arrives at its first call's start and counts only if that lies in
  ``[t_from, t_to - settle)``; it is completed when no call of it is still running, its
  last call ended by ``t_to - settle`` and none of its calls (at its last attempt) failed
  on the serving side (a 5xx, 408, 429, or 499: the client hung up): a request with a failed
  call is no served request (a dead or restarting replica's quick 502s, and the client's
  retries after its back-off, would read as extra calls and tool time); it still counts as
  an arrival. A client's own mistake (another 4xx) is an answer, and its request goes on;
- the sample is a pure function of the request keys and each workflow's numbers of calls
  and requests (the same store gives the same sample); it holds every request when all of
  them hold at most ``union_cap`` calls, and at least one of each workflow's. Budgets and
  thresholds: :mod:`optimizer.stats.sample` (a quiet workflow beside a busy one keeps a
  sample of its own);
- token histograms and unidentified counts cover calls whose start lies in the window;
- every temp table and view it creates is dropped, and the connection's
  ``preserve_insertion_order`` restored, before it returns.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import duckdb
import numpy as np
import numpy.typing as npt

from optimizer.stats.sample import SAMPLE_MODULUS as SAMPLE_MODULUS
from optimizer.stats.sample import UNION_CALLS_CAP as UNION_CALLS_CAP
from optimizer.stats.sample import keep_thresholds
from optimizer.stats.scanned import I32, I64, Bounds, Histogram, Scan

_tags = itertools.count()


class _Names(NamedTuple):
    raw: str  # the caller's relation
    n: str  # (workflow, model) pairs: their codes and key hashes
    top: str  # retried call ids
    c: str  # the calls, de-duplicated, with integer request and pair keys
    o: str  # calls still running: open rows no finished row supersedes
    r: str  # every request: span, sums, whether it arrived in the window, whether completed
    k: str  # per pair code: its workflow's sample threshold
    q: str  # the sampled completed requests with their offsets


class _Pairs(NamedTuple):
    """The store's (workflow, model) pairs, coded."""

    workflows: tuple[str, ...]  # sorted: a workflow's code is its index
    pairs: tuple[tuple[int, str], ...]  # (workflow code, model; "" if null) per pair code
    pair_of: dict[int, int]  # a pair's key hash -> its code
    wf_of_pair: I64  # per pair code, its workflow code


class _Tally(NamedTuple):
    """What the grouping sets of :func:`_windowed_counts` say, per code."""

    unidentified: I64  # per workflow: windowed calls without a request id
    all_calls: I64  # per pair: every identified finished call
    all_dur: I64  # per pair: their summed durations
    prompt: Histogram
    completion: Histogram


def _i64(got: dict[str, npt.NDArray[np.generic]], name: str) -> I64:
    return np.ascontiguousarray(got[name], dtype=np.int64)


def _i32(got: dict[str, npt.NDArray[np.generic]], name: str) -> I32:
    return np.ascontiguousarray(got[name], dtype=np.int32)


def scan(
    con: duckdb.DuckDBPyConnection,
    calls: duckdb.DuckDBPyRelation,
    bounds: Bounds,
    union_cap: int | None = UNION_CALLS_CAP,
) -> Scan:
    """Run the passes over ``calls`` (a relation on ``con``) for the window ``bounds``; the
    unions cover a hash sample of about ``union_cap`` calls at most (``None``: every call)."""
    tag = next(_tags)
    names = _Names(*(f"_scepsy_{k}_{tag}" for k in _Names._fields))
    con.execute("SET enable_progress_bar = false")
    got = con.execute("SELECT current_setting('preserve_insertion_order')").fetchone()
    preserve = bool(got[0]) if got else True
    # Row order never matters here (every result is grouped or sorted), and not keeping the
    # scan's order lets DuckDB fill the temp tables in parallel without re-ordering them.
    con.execute("SET preserve_insertion_order = false")
    calls.create_view(names.raw, replace=True)
    try:
        return _scan(con, names, bounds, union_cap)
    finally:
        for table in (names.q, names.k, names.r, names.o, names.c, names.top, names.n):
            con.execute(f"DROP TABLE IF EXISTS {table}")
        con.execute(f"DROP VIEW IF EXISTS {names.raw}")
        con.execute(f"SET preserve_insertion_order = {str(preserve).lower()}")


def _scan(con: duckdb.DuckDBPyConnection, t: _Names, bounds: Bounds, union_cap: int | None) -> Scan:
    """The passes in order, each building the tables the next ones read."""
    coded = _pair_table(con, t)
    has_open = _call_table(con, t)
    counted = _windowed_counts(con, t, bounds)
    _request_table(con, t, bounds, has_open)
    arrivals, arrivals_late = _arrivals(con, t, coded, bounds)
    wf_calls, wf_requests, lowest = _completed_per_workflow(con, t, coded)
    # Ordered, so that float sums over them come out the same every time.
    req = con.execute(f"""
        SELECT n.pair, r.t0, r.t1 FROM {t.r} r JOIN {t.n} n USING (pk) WHERE r.complete
        ORDER BY r.t0, r.rk
    """).fetchnumpy()
    keep = keep_thresholds(
        union_cap, [int(c) for c in wf_calls], [int(c) for c in wf_requests], lowest
    )
    _sample_table(con, t, coded, keep)
    smp = con.execute(f"SELECT pair, dur, off, span FROM {t.q} ORDER BY off").fetchnumpy()
    got = _sample_calls(con, t, max(keep, default=0))
    tally = _tally(counted, coded)
    pair_calls, pair_dur = _pair_totals(con, t, coded.pair_of, tally.all_calls, tally.all_dur)
    return Scan(
        workflows=coded.workflows,
        pairs=coded.pairs,
        arrivals=arrivals,
        arrivals_late=arrivals_late,
        unidentified=tally.unidentified,
        req_pair=_i32(req, "pair"),
        req_t0=_i64(req, "t0"),
        req_t1=_i64(req, "t1"),
        pair_calls=pair_calls,
        pair_dur=pair_dur,
        smp_pair=_i32(smp, "pair"),
        smp_dur=_i64(smp, "dur"),
        smp_off=_i64(smp, "off"),
        smp_span=_i64(smp, "span"),
        call_pair=_i32(got, "pair"),
        call_a=_i64(got, "a"),
        call_b=_i64(got, "b"),
        prompt=tally.prompt,
        completion=tally.completion,
    )


def _pair_table(con: duckdb.DuckDBPyConnection, t: _Names) -> _Pairs:
    """Code the (workflow, model) pairs and build ``t.n`` (pair code, key hash)."""
    # The (workflow, model) pairs are few and dictionary-encoded in Parquet, so this pass is
    # cheap; every later pass keys a pair by its 64-bit hash, an integer, not two strings.
    found = con.execute(f"""
        SELECT w, model, hash(w, model) AS pk
        FROM (SELECT DISTINCT coalesce(workflow, '') AS w, model FROM {t.raw})
    """).fetchall()
    found.sort(key=lambda row: (row[0], row[1] is None, row[1] or ""))
    if len({row[2] for row in found}) != len(found):  # two pairs, one hash: never seen
        raise RuntimeError("stats: two (workflow, model) pairs share a 64-bit key hash")
    workflows = tuple(sorted({str(w) for w, _, _ in found}))
    code = {w: i for i, w in enumerate(workflows)}
    pairs = tuple((code[str(w)], "" if m is None else str(m)) for w, m, _ in found)
    pair_of = {int(key): k for k, (_, _, key) in enumerate(found)}
    con.execute(f"CREATE TEMP TABLE {t.n} (pair INTEGER, pk UBIGINT)")
    if found:
        con.executemany(
            f"INSERT INTO {t.n} VALUES (?, ?)", list(enumerate(int(key) for _, _, key in found))
        )
    wf_of_pair = np.asarray([w for w, _ in pairs], dtype=np.int64)
    return _Pairs(workflows, pairs, pair_of, wf_of_pair)


def _retry_filter(con: duckdb.DuckDBPyConnection, t: _Names) -> str:
    """Build ``t.top`` (each retried call id, its highest attempt); the anti-join clause that
    keeps only that attempt, or "" when nothing was retried."""
    # Retries are rare: find the retried calls' ids first (a filtered scan that decodes
    # call_id only for rows with attempt > 0), and pay for the anti-join only if there are any.
    con.execute(f"""
        CREATE TEMP TABLE {t.top} AS
        SELECT call_id, max(coalesce(attempt, 0)) AS top FROM {t.raw}
        WHERE coalesce(attempt, 0) > 0 GROUP BY call_id
    """)
    retried = con.execute(f"SELECT count(*) FROM {t.top}").fetchone()
    return (
        f"ANTI JOIN {t.top} x ON b.call_id = x.call_id AND coalesce(b.attempt, 0) < x.top"
        if retried and retried[0]
        else ""
    )


def _call_table(con: duckdb.DuckDBPyConnection, t: _Names) -> bool:
    """Build ``t.c``, the one pass over the store: each logical call's request and pair keys,
    times and tokens. Whether the store holds open rows (then ``t.c`` also holds ``ck``, the
    call id's hash)."""
    dedup = _retry_filter(con, t)
    # Open rows are matched to their finished rows by call id, the one column the pass would
    # not otherwise decode: it is read only when the store holds open rows (a filtered count
    # that Parquet statistics mostly answer).
    opened = con.execute(f"SELECT count(*) FROM {t.raw} WHERE t_end IS NULL").fetchone()
    has_open = bool(opened and opened[0])
    ck = ", hash(b.call_id) AS ck" if has_open else ""
    # Every later pass reads this narrow integer table (the strings, and call_id for the
    # retries, are decoded once).
    con.execute(f"""
        CREATE TEMP TABLE {t.c} AS
        SELECT CASE WHEN b.request_id IS NULL THEN NULL
                    ELSE hash(coalesce(b.workflow, ''), b.request_id) END AS rk,
               hash(coalesce(b.workflow, ''), b.model) AS pk, b.t_start, b.t_end,
               b.prompt_tokens, b.completion_tokens,
               coalesce(b.status >= 500 OR b.status IN (408, 429, 499), false) AS bad{ck}
        FROM {t.raw} b {dedup}
    """)
    return has_open


def _windowed_counts(
    con: duckdb.DuckDBPyConnection, t: _Names, bounds: Bounds
) -> list[tuple[Any, ...]]:
    """Token histograms and unidentified counts of the windowed calls, and every identified
    call's count and summed duration per pair (the totals :func:`_pair_totals` starts from),
    in one pass over the finished calls: rows of three grouping sets, told apart by ``gid``
    (3: prompt tokens, 5: completion tokens, 6: identified or not)."""
    lo, t_to = bounds.lo, bounds.t_to
    in_window = " AND ".join(
        [f"t_start >= {int(lo)}" if lo is not None else "true"]
        + ([f"t_start < {int(t_to)}"] if t_to is not None else [])
    )
    return con.execute(f"""
        SELECT pk, prompt_tokens, completion_tokens, unid,
               GROUPING(prompt_tokens, completion_tokens, unid) AS gid,
               count(*) FILTER (WHERE windowed) AS n, count(*) AS n_all,
               sum(t_end - t_start)::BIGINT AS d_all
        FROM (SELECT pk, prompt_tokens, completion_tokens, t_start, t_end,
                     rk IS NULL AS unid, {in_window} AS windowed
              FROM {t.c} WHERE t_end IS NOT NULL)
        GROUP BY GROUPING SETS ((pk, prompt_tokens), (pk, completion_tokens), (pk, unid))
    """).fetchall()


def _request_table(
    con: duckdb.DuckDBPyConnection, t: _Names, bounds: Bounds, has_open: bool
) -> None:
    """Build ``t.r``, every request once (one grouping of the calls, by request only): its
    pair, first start ``t0``, last end ``t1``, last start ``s1``, summed durations, finished
    calls, whether one is still running, and whether it arrived and completed in the window.
    With open rows, ``t.o`` (the calls still running) first."""
    lo, hi = bounds.lo, bounds.hi
    arrive = " AND ".join(
        [f"t0 >= {int(lo)}" if lo is not None else "true"]
        + ([f"t0 < {int(hi)}"] if hi is not None else [])
    )
    done = f"t1 <= {int(hi)}" if hi is not None else "true"
    running = _running_calls(con, t) if has_open else 0
    if running:
        # A request with a call still running arrives at its first start, whichever row
        # holds it, and is not completed.
        source = f"""
            SELECT rk, pk, t_start, t_end, bad, false AS open FROM {t.c}
            WHERE rk IS NOT NULL AND t_end IS NOT NULL
            UNION ALL SELECT rk, pk, t_start, NULL, false, true FROM {t.o}"""
        done += " AND NOT open"
        is_open, calls = "bool_or(open) AS open", "count(t_end)"
    else:
        source = f"SELECT * FROM {t.c} WHERE rk IS NOT NULL AND t_end IS NOT NULL"
        is_open, calls = "false AS open", "count(*)"
    con.execute(f"""
        CREATE TEMP TABLE {t.r} AS
        SELECT *, coalesce({arrive}, false) AS arrived,
               coalesce({arrive} AND {done} AND NOT failed, false) AS complete
        FROM (SELECT rk, any_value(pk) AS pk, min(t_start) AS t0, max(t_end) AS t1,
                     max(t_start) AS s1, sum(t_end - t_start)::BIGINT AS dur,
                     {calls} AS calls, bool_or(bad) AS failed, {is_open}
              FROM ({source}) GROUP BY rk)
    """)


def _arrivals(
    con: duckdb.DuckDBPyConnection, t: _Names, coded: _Pairs, bounds: Bounds
) -> tuple[I64, I64]:
    """Per workflow code, the requests that arrived in the window, and those of them that
    arrived in its later half (none counted when the window is unbounded)."""
    lo, hi = bounds.lo, bounds.hi
    late = f"t0 >= {(int(lo) + int(hi)) // 2}" if lo is not None and hi is not None else "false"
    rows = con.execute(f"""
        SELECT pk, count(*), count(*) FILTER (WHERE {late}) FROM {t.r} WHERE arrived GROUP BY pk
    """).fetchall()
    n_wf = len(coded.workflows)
    all_, later = (
        _per_workflow([(coded.pair_of[int(r[0])], int(r[i])) for r in rows], coded.wf_of_pair, n_wf)
        for i in (1, 2)
    )
    return all_, later


def _completed_per_workflow(
    con: duckdb.DuckDBPyConnection, t: _Names, coded: _Pairs
) -> tuple[I64, I64, list[int]]:
    """Per workflow code, over its completed requests: their calls, their number, and the
    smallest request key modulo ``SAMPLE_MODULUS`` (``SAMPLE_MODULUS`` when it has none)."""
    per_pk = con.execute(f"""
        SELECT pk, sum(calls)::BIGINT, count(*), min(rk % {SAMPLE_MODULUS})
        FROM {t.r} WHERE complete GROUP BY pk
    """).fetchall()
    n_wf = len(coded.workflows)
    wf_calls, wf_requests = (
        _per_workflow(
            [(coded.pair_of[int(row[0])], int(row[i])) for row in per_pk], coded.wf_of_pair, n_wf
        )
        for i in (1, 2)
    )
    lowest = [SAMPLE_MODULUS] * n_wf
    for row in per_pk:
        w = coded.pairs[coded.pair_of[int(row[0])]][0]
        lowest[w] = min(lowest[w], int(row[3]))
    return wf_calls, wf_requests, lowest


def _sample_table(
    con: duckdb.DuckDBPyConnection, t: _Names, coded: _Pairs, keep: list[int]
) -> None:
    """Build ``t.k`` (each pair's workflow threshold ``keep``) and ``t.q``, the sampled
    completed requests with their offsets ``off`` in the shifted layout (module docstring)."""
    con.execute(f"CREATE TEMP TABLE {t.k} (pair INTEGER, keep BIGINT)")
    if coded.pairs:
        con.executemany(
            f"INSERT INTO {t.k} VALUES (?, ?)",
            [(k, keep[w]) for k, (w, _) in enumerate(coded.pairs)],
        )
    # extent covers starts too (a call may end before it starts); + 1 keeps ranges disjoint.
    con.execute(f"""
        CREATE TEMP TABLE {t.q} AS
        SELECT rk, pair, t0, t1 - t0 AS span, dur,
               (sum(greatest(t1, s1) - t0 + 1) OVER w - (greatest(t1, s1) - t0 + 1))::BIGINT AS off
        FROM (SELECT r.*, n.pair FROM {t.r} r JOIN {t.n} n USING (pk) JOIN {t.k} k USING (pair)
              WHERE r.complete AND r.rk % {SAMPLE_MODULUS} < k.keep)
        WINDOW w AS (ORDER BY t0, rk ROWS UNBOUNDED PRECEDING)
    """)


def _sample_calls(
    con: duckdb.DuckDBPyConnection, t: _Names, top_keep: int
) -> dict[str, npt.NDArray[np.generic]]:
    """The sampled requests' finished calls, shifted (``a``, ``b``) and sorted by ``a``."""
    # A cheap predicate (the highest threshold) drops most calls before the join probes.
    return con.execute(f"""
        SELECT n.pair, x.t_start + (q.off - q.t0) AS a, x.t_end + (q.off - q.t0) AS b
        FROM (SELECT * FROM {t.c} WHERE t_end IS NOT NULL AND rk % {SAMPLE_MODULUS} < {top_keep}) x
        JOIN {t.q} q USING (rk) JOIN {t.n} n USING (pk)
        ORDER BY a
    """).fetchnumpy()


def _tally(counted: list[tuple[Any, ...]], coded: _Pairs) -> _Tally:
    """Sort :func:`_windowed_counts`' rows into per-code arrays and histograms."""
    n_pairs = len(coded.pairs)
    unidentified = np.zeros(len(coded.workflows), dtype=np.int64)
    hist: dict[int, list[tuple[int, int, int]]] = {3: [], 5: []}
    all_calls, all_dur = np.zeros(n_pairs, np.int64), np.zeros(n_pairs, np.int64)
    for key, prompt, completion, unid, gid, count, n_all, d_all in counted:
        k = coded.pair_of[int(key)]
        if gid == 6 and unid:
            unidentified[coded.pairs[k][0]] += int(count)
        elif gid == 6:
            all_calls[k], all_dur[k] = int(n_all), int(d_all)
        elif gid == 3 and prompt is not None and count:
            hist[3].append((k, int(prompt), int(count)))
        elif gid == 5 and completion is not None and count:
            hist[5].append((k, int(completion), int(count)))
    return _Tally(unidentified, all_calls, all_dur, _histogram(hist[3]), _histogram(hist[5]))


def _pair_totals(
    con: duckdb.DuckDBPyConnection,
    t: _Names,
    pair_of: dict[int, int],
    all_calls: I64,
    all_dur: I64,
) -> tuple[I64, I64]:
    """Per pair code, the calls of completed requests and their summed durations (exact),
    from the totals over every identified call: probes the calls against the smaller side,
    the completed requests, or (to subtract) the others, a few at the window's edges when the
    window is long."""
    got = con.execute(f"SELECT count(*) FILTER (WHERE complete), count(*) FROM {t.r}").fetchone()
    complete, total = (int(got[0] or 0), int(got[1] or 0)) if got else (0, 0)
    if complete == total:
        return all_calls, all_dur
    which = "complete" if complete <= total - complete else "NOT complete"
    calls, dur = np.zeros_like(all_calls), np.zeros_like(all_dur)
    for key, n, d in con.execute(f"""
        SELECT pk, count(*), sum(t_end - t_start)::BIGINT FROM {t.c}
        SEMI JOIN (SELECT rk FROM {t.r} WHERE {which}) USING (rk)
        WHERE t_end IS NOT NULL GROUP BY pk
    """).fetchall():
        calls[pair_of[int(key)]], dur[pair_of[int(key)]] = int(n), int(d)
    if which == "complete":
        return calls, dur
    return all_calls - calls, all_dur - dur


def _running_calls(con: duckdb.DuckDBPyConnection, t: _Names) -> int:
    """Fill ``t.o`` with the calls still running (see the module docstring); their count.
    ``t.c`` holds ``ck``, the call id's hash: an open row is superseded by a finished row of
    the same call (parallel calls of one request may share model and start)."""
    con.execute(f"""
        CREATE TEMP TABLE {t.o} AS
        SELECT rk, pk, min(t_start) AS t_start
        FROM (SELECT * FROM {t.c} WHERE t_end IS NULL AND rk IS NOT NULL) o
        ANTI JOIN (SELECT ck FROM {t.c} WHERE t_end IS NOT NULL) f USING (ck)
        GROUP BY rk, pk, ck
    """)
    got = con.execute(f"SELECT count(*) FROM {t.o}").fetchone()
    return int(got[0]) if got else 0


def _histogram(rows: list[tuple[int, int, int]]) -> Histogram:
    """(pair, value, count) rows, sorted by pair then value."""
    cols = np.asarray(sorted(rows), dtype=np.int64).reshape(-1, 3)
    return Histogram(
        pair=cols[:, 0].astype(np.int32), value=cols[:, 1].copy(), count=cols[:, 2].copy()
    )


def _per_workflow(rows: list[tuple[int, int]], wf_of_pair: I64, n_wf: int) -> I64:
    out = np.zeros(n_wf, dtype=np.int64)
    for pair, count in rows:
        out[wf_of_pair[pair]] += int(count)
    return out

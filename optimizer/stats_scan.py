"""The DuckDB side of workflow statistics: grouped passes over the call records, to arrays.

Role: the only part of :mod:`optimizer.stats` that runs SQL. One pass reads the store's
columns once into a narrow table of integers (request key, pair key, times, tokens; retried
attempts dropped); grouped passes over it hand numpy compact arrays: per completed request one
row, per (request, model) *segment* one row (exact counts and summed durations: every per-model
figure but the unions comes from these), plus token-count histograms and unidentified-call
counts. The interval unions (critical path, per-model busy time, parallelism ``p_m``) need each
request's calls in start order, the one step that grows faster than the store (a sort of
calls); they are computed over a uniform hash sample of the completed requests holding at most
about ``union_cap`` calls (all requests when they hold fewer: then every figure is exact),
sorted by ``a`` in the shifted layout below for :mod:`optimizer.stats_union`.

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
  ``[t_from, t_to - settle)``; it is completed when no call of it is still running and its
  last call ended by ``t_to - settle``;
- the union sample is a pure function of the request keys and the number of calls (the same
  store gives the same sample), and includes every request when they hold at most
  ``union_cap`` calls;
- token histograms and unidentified counts cover calls whose start lies in the window;
- every temp table and view it creates is dropped, and the connection's
  ``preserve_insertion_order`` restored, before it returns.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import duckdb
import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]
I32 = npt.NDArray[np.int32]
_tags = itertools.count()
# The union sample: about this many calls at most (10 M calls sort in seconds, 1 M in a tenth
# of that; a mean over the tens of thousands of requests they hold is as good as exact).
UNION_CALLS_CAP = 1_000_000
SAMPLE_MODULUS = 1 << 20  # a request is sampled when its key modulo this is below a threshold


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
    index ``workflows``; request indices follow the requests' offset order."""

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
    req_sampled: npt.NDArray[np.bool_]  # its calls are in call_* (the union sample)
    # (request, pair) segments of completed requests, exact; sorted by pair, then request
    seg_pair: I32
    seg_request: I32
    seg_calls: I64
    seg_dur: I64  # Σ call durations
    # calls (with an end) of the sampled completed requests, sorted by a
    call_pair: I32
    call_a: I64
    call_b: I64
    prompt: Histogram
    completion: Histogram


class _Names(NamedTuple):
    raw: str  # the caller's relation
    n: str  # (workflow, model) pairs: their codes and key hashes
    top: str  # retried call ids
    c: str  # the calls, de-duplicated, with integer request and pair keys
    g: str  # (request, pair) segments
    o: str  # calls still running: open rows no finished row supersedes
    r: str  # requests that arrived
    q: str  # completed requests with offsets and the sample flag


def _i64(got: dict[str, npt.NDArray[np.generic]], name: str) -> I64:
    return np.ascontiguousarray(got[name], dtype=np.int64)


def _i32(got: dict[str, npt.NDArray[np.generic]], name: str) -> I32:
    return np.ascontiguousarray(got[name], dtype=np.int32)


def sample_threshold(calls: int, union_cap: int | None) -> int:
    """Requests whose key modulo ``SAMPLE_MODULUS`` lies below this are in the union sample:
    all of them when ``calls`` fit in ``union_cap`` (or there is no cap)."""
    if union_cap is None or calls <= union_cap:
        return SAMPLE_MODULUS
    return max(1, union_cap * SAMPLE_MODULUS // calls)


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
        for table in (names.q, names.r, names.o, names.g, names.c, names.top, names.n):
            con.execute(f"DROP TABLE IF EXISTS {table}")
        con.execute(f"DROP VIEW IF EXISTS {names.raw}")
        con.execute(f"SET preserve_insertion_order = {str(preserve).lower()}")


def _scan(
    con: duckdb.DuckDBPyConnection, t: _Names, bounds: Bounds, union_cap: int | None
) -> Scan:
    lo, t_to, hi = bounds.lo, bounds.t_to, bounds.hi
    in_window = " AND ".join(
        [f"t_start >= {int(lo)}" if lo is not None else "true"]
        + ([f"t_start < {int(t_to)}"] if t_to is not None else [])
    )
    # The (workflow, model) pairs are few and dictionary-encoded in Parquet, so this pass is
    # cheap; every later pass keys a pair by its 64-bit hash, an integer, not two strings.
    pk = "hash(coalesce(workflow, ''), model)"
    found = con.execute(
        f"SELECT DISTINCT coalesce(workflow, '') AS w, model, {pk} AS pk FROM {t.raw}"
    ).fetchall()
    found.sort(key=lambda row: (row[0], row[1] is None, row[1] or ""))
    if len({row[2] for row in found}) != len(found):  # two pairs, one hash: never seen
        raise RuntimeError("stats: two (workflow, model) pairs share a 64-bit key hash")
    workflows = tuple(sorted({str(w) for w, _, _ in found}))
    code = {w: i for i, w in enumerate(workflows)}
    pairs = tuple((code[str(w)], "" if m is None else str(m)) for w, m, _ in found)
    pair_of = {int(key): k for k, (_, _, key) in enumerate(found)}
    con.execute(f"CREATE TEMP TABLE {t.n} (pair INTEGER, pk UBIGINT)")
    if found:
        con.executemany(f"INSERT INTO {t.n} VALUES (?, ?)", list(
            enumerate(int(key) for _, _, key in found)))
    # Retries are rare: find the retried calls' ids first (a filtered scan that decodes
    # call_id only for rows with attempt > 0), and pay for the anti-join only if there are any.
    con.execute(f"""
        CREATE TEMP TABLE {t.top} AS
        SELECT call_id, max(coalesce(attempt, 0)) AS top FROM {t.raw}
        WHERE coalesce(attempt, 0) > 0 GROUP BY call_id
    """)
    retried = con.execute(f"SELECT count(*) FROM {t.top}").fetchone()
    dedup = (
        f"ANTI JOIN {t.top} x ON b.call_id = x.call_id AND coalesce(b.attempt, 0) < x.top"
        if retried and retried[0] else ""
    )
    # Open rows are matched to their finished rows by call id, the one column the pass would
    # not otherwise decode: it is read only when the store holds open rows (a filtered count
    # that Parquet statistics mostly answer).
    opened = con.execute(f"SELECT count(*) FROM {t.raw} WHERE t_end IS NULL").fetchone()
    has_open = bool(opened and opened[0])
    ck = ", hash(b.call_id) AS ck" if has_open else ""
    # The one pass over the store: every later pass reads this narrow integer table (the
    # strings, and call_id for the retries, are decoded once).
    con.execute(f"""
        CREATE TEMP TABLE {t.c} AS
        SELECT CASE WHEN b.request_id IS NULL THEN NULL
                    ELSE hash(coalesce(b.workflow, ''), b.request_id) END AS rk,
               hash(coalesce(b.workflow, ''), b.model) AS pk, b.t_start, b.t_end,
               b.prompt_tokens, b.completion_tokens{ck}
        FROM {t.raw} b {dedup}
    """)
    con.execute(f"""
        CREATE TEMP TABLE {t.g} AS
        SELECT x.rk, n.pair, x.calls, x.dur, x.t0, x.t1, x.s1
        FROM (SELECT rk, pk, count(*) AS calls, sum(t_end - t_start)::BIGINT AS dur,
                     min(t_start) AS t0, max(t_end) AS t1, max(t_start) AS s1
              FROM {t.c} WHERE rk IS NOT NULL AND t_end IS NOT NULL GROUP BY rk, pk) x
        JOIN {t.n} n USING (pk)
    """)
    # Token histograms and unidentified counts of the windowed calls, in one pass.
    counted = con.execute(f"""
        SELECT pk, prompt_tokens, completion_tokens, unid,
               GROUPING(prompt_tokens, completion_tokens, unid) AS gid, count(*) AS n
        FROM (SELECT pk, prompt_tokens, completion_tokens, rk IS NULL AS unid
              FROM {t.c} WHERE {in_window} AND t_end IS NOT NULL)
        GROUP BY GROUPING SETS ((pk, prompt_tokens), (pk, completion_tokens), (pk, unid))
    """).fetchall()
    arrive = " AND ".join(
        [f"t0 >= {int(lo)}" if lo is not None else "true"]
        + ([f"t0 < {int(hi)}"] if hi is not None else [])
    )
    running = _running_calls(con, t) if has_open else 0
    # A request with a call still running arrives at its first start, whichever row holds it.
    extra = (f" UNION ALL SELECT o.rk, n.pair, o.t_start, NULL, o.t_start, 0, 0, true "
             f"FROM {t.o} o JOIN {t.n} n USING (pk)") if running else ""
    con.execute(f"""
        CREATE TEMP TABLE {t.r} AS
        SELECT rk, any_value(pair) AS pair, min(t0) AS t0, max(t1) AS t1, max(s1) AS s1,
               sum(dur)::BIGINT AS dur, sum(calls)::BIGINT AS calls, bool_or(open) AS open
        FROM (SELECT rk, pair, t0, t1, s1, dur, calls, false AS open FROM {t.g}{extra})
        GROUP BY rk HAVING {arrive}
    """)
    n_wf = len(workflows)
    wf_of_pair = np.asarray([w for w, _ in pairs], dtype=np.int64)
    arrivals = _per_workflow(con.execute(
        f"SELECT pair, count(*) FROM {t.r} GROUP BY pair").fetchall(), wf_of_pair, n_wf)
    done = f"t1 <= {int(hi)}" if hi is not None else "true"
    if running:
        done += " AND NOT open"
    total = con.execute(f"SELECT coalesce(sum(calls), 0) FROM {t.r} WHERE {done}").fetchone()
    keep = sample_threshold(int(total[0]) if total else 0, union_cap)
    sampled = f"rk % {SAMPLE_MODULUS} < {keep}"
    # extent covers starts too (a call may end before it starts); + 1 keeps ranges disjoint.
    con.execute(f"""
        CREATE TEMP TABLE {t.q} AS
        SELECT rk, pair, t0, t1, dur,
               (sum(greatest(t1, s1) - t0 + 1) OVER w - (greatest(t1, s1) - t0 + 1))::BIGINT AS off,
               (row_number() OVER w - 1)::INTEGER AS idx, {sampled} AS sampled
        FROM {t.r} WHERE {done}
        WINDOW w AS (ORDER BY t0, rk ROWS UNBOUNDED PRECEDING)
    """)
    req = con.execute(
        f"SELECT pair, t0, t1, dur, off, sampled FROM {t.q} ORDER BY off").fetchnumpy()
    seg = con.execute(f"""
        SELECT g.pair, q.idx AS request, g.calls, g.dur FROM {t.g} g JOIN {t.q} q USING (rk)
        ORDER BY g.pair, q.idx
    """).fetchnumpy()
    # The sample's calls: the same predicate on both sides drops most calls before the join
    # probes.
    got = con.execute(f"""
        SELECT n.pair, x.t_start + (q.off - q.t0) AS a, x.t_end + (q.off - q.t0) AS b
        FROM (SELECT * FROM {t.c} WHERE t_end IS NOT NULL AND {sampled}) x
        JOIN (SELECT * FROM {t.q} WHERE sampled) q USING (rk) JOIN {t.n} n USING (pk)
        ORDER BY a
    """).fetchnumpy()
    unidentified = np.zeros(n_wf, dtype=np.int64)
    hist: dict[int, list[tuple[int, int, int]]] = {3: [], 5: []}
    for key, prompt, completion, unid, gid, count in counted:
        k = pair_of[int(key)]
        if gid == 6 and unid:
            unidentified[pairs[k][0]] += int(count)
        elif gid == 3 and prompt is not None:
            hist[3].append((k, int(prompt), int(count)))
        elif gid == 5 and completion is not None:
            hist[5].append((k, int(completion), int(count)))
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
        req_sampled=np.ascontiguousarray(req["sampled"], dtype=bool),
        seg_pair=_i32(seg, "pair"),
        seg_request=_i32(seg, "request"),
        seg_calls=_i64(seg, "calls"),
        seg_dur=_i64(seg, "dur"),
        call_pair=_i32(got, "pair"),
        call_a=_i64(got, "a"),
        call_b=_i64(got, "b"),
        prompt=_histogram(hist[3]),
        completion=_histogram(hist[5]),
    )


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
    return Histogram(pair=cols[:, 0].astype(np.int32), value=cols[:, 1].copy(),
                     count=cols[:, 2].copy())


def _per_workflow(rows: list[tuple[int, int]], wf_of_pair: I64, n_wf: int) -> I64:
    out = np.zeros(n_wf, dtype=np.int64)
    for pair, count in rows:
        out[wf_of_pair[pair]] += int(count)
    return out

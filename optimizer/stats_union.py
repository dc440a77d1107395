"""Interval unions and exact quantiles in linear numpy passes (the numeric core of the stats).

Role: given the calls of completed requests in the shifted layout of
:mod:`optimizer.stats_scan` (sorted by shifted start ``a``; each request owns a disjoint integer
range, so requests follow one another and a running maximum never carries across them),
compute per request the length of the union of all its calls' intervals (the critical path)
and per (request, pair) the calls, summed durations and union length. Also the exact
``quantile_cont`` of a value histogram.

Union of intervals sorted by start in one pass: a call adds whatever of it lies past the
running maximum of the ends before it, ``max(0, b - max(a, max(b_prev...)))``. The per-pair
pass reuses the request order: a stable sort by pair (a radix sort on small codes) keeps each
pair's calls sorted by ``a``, so the same formula applies within each pair's slice.

Invariants: pure functions over int64 arrays (exact integer microseconds, no float until the
caller divides); inputs are not modified; every request index passed in has at least one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]
I32 = npt.NDArray[np.int32]
F64 = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class Segments:
    """One row per (request, pair) with at least one call, grouped by pair."""

    pair: I32
    request: I32  # index into the requests (their offset order)
    calls: I64
    dur: I64  # Σ call durations (µs)
    union: I64  # length of the union of the calls' intervals (µs)


def covered(a: I64, b: I64) -> I64:
    """Per interval ``[a_i, b_i]`` (sorted by ``a``), the length it adds to the union of the
    intervals before it; their sum is the union's length."""
    out = np.empty_like(b)
    if b.size == 0:
        return out
    out[0] = a[0]
    np.maximum.accumulate(b[:-1], out=out[1:])  # running max of the ends before each one
    np.maximum(out, a, out=out)
    np.subtract(b, out, out=out)
    np.maximum(out, 0, out=out)
    return out


def request_starts(a: I64, offsets: I64) -> I64:
    """Index of each request's first call: requests own ``[offset_i, offset_{i+1})``."""
    return np.searchsorted(a, offsets, side="left").astype(np.int64)


def request_unions(a: I64, b: I64, starts: I64) -> I64:
    """Per request, the length of the union of all its calls (any pair)."""
    return np.add.reduceat(covered(a, b), starts) if starts.size else np.zeros(0, np.int64)


def segments(pair: I32, a: I64, b: I64, starts: I64) -> Segments:
    """Per (request, pair): calls, summed durations, union length."""
    n = a.size
    counts = np.diff(starts, append=n)
    request = np.repeat(np.arange(starts.size, dtype=np.int32), counts)
    # A stable sort by pair keeps each pair's calls in request-then-start order; on codes
    # that fit 16 bits numpy's stable sort is a radix sort (linear).
    keys = pair.astype(np.uint16) if n and int(pair.max()) < 1 << 16 else pair
    order = np.argsort(keys, kind="stable")
    pair_s, request_s, a_s, b_s = pair[order], request[order], a[order], b[order]
    del order, request
    cover = np.empty_like(b_s)
    bounds = np.flatnonzero(np.diff(pair_s)) + 1
    for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, n], strict=True):
        cover[lo:hi] = covered(a_s[lo:hi], b_s[lo:hi])  # restart at each pair
    new = np.empty(n, dtype=bool)
    if n:
        new[0] = True
        np.not_equal(request_s[1:], request_s[:-1], out=new[1:])
        new[bounds] = True
    first = np.flatnonzero(new)
    np.subtract(b_s, a_s, out=b_s)  # b_s now holds durations
    return Segments(
        pair=pair_s[first],
        request=request_s[first],
        calls=np.diff(first, append=n),
        dur=np.add.reduceat(b_s, first) if n else np.zeros(0, np.int64),
        union=np.add.reduceat(cover, first) if n else np.zeros(0, np.int64),
    )


def quantile_cont(values: I64, counts: I64, q: float) -> float:
    """DuckDB's ``quantile_cont`` (linear interpolation between order statistics) of the
    sample in which ``values[i]`` (ascending) occurs ``counts[i]`` times; ``nan`` if empty."""
    total = int(counts.sum())
    if total == 0:
        return float("nan")
    pos = q * (total - 1)
    lo, hi = int(np.floor(pos)), int(np.ceil(pos))
    cum = np.cumsum(counts)
    x_lo = float(values[np.searchsorted(cum, lo, side="right")])
    x_hi = float(values[np.searchsorted(cum, hi, side="right")])
    return x_lo + (pos - lo) * (x_hi - x_lo)


def mean_of(values: I64, counts: I64) -> float:
    total = int(counts.sum())
    return float(np.dot(values.astype(np.float64), counts)) / total if total else float("nan")

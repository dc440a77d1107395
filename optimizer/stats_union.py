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

from collections.abc import Sequence
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


def segments(pair: I32, a: I64, b: I64, offsets: I64, groups: Sequence[I64]) -> Segments:
    """Per (request, pair): calls, summed durations, union length.

    ``groups[pair]`` lists the requests (indices into ``offsets``, ascending) that may call
    ``pair`` (those of its workflow); every call of ``pair`` belongs to one of them.
    """
    n = a.size
    # A stable sort by pair keeps each pair's calls in request-then-start order; on codes
    # that fit 16 bits numpy's stable sort is a radix sort (linear).
    keys = pair.astype(np.uint16) if n and int(pair.max()) < 1 << 16 else pair
    order = np.argsort(keys, kind="stable")
    ends = np.cumsum(np.bincount(pair, minlength=len(groups)))
    parts: list[tuple[I32, I32, I64, I64, I64]] = []
    for p, hi in enumerate(ends):
        lo = int(ends[p - 1]) if p else 0
        if hi == lo:
            continue
        take = order[lo:hi]
        a_p, b_p = a[take], b[take]
        cover = covered(a_p, b_p)
        np.subtract(b_p, a_p, out=b_p)  # durations
        request, first = _split(a_p, offsets, groups[p])
        parts.append((
            np.full(first.size, p, dtype=np.int32), request,
            np.diff(first, append=a_p.size),
            np.add.reduceat(b_p, first), np.add.reduceat(cover, first),
        ))
    if not parts:
        empty = np.zeros(0, np.int64)
        return Segments(np.zeros(0, np.int32), np.zeros(0, np.int32), empty, empty, empty)
    cols = list(zip(*parts, strict=True))
    return Segments(*(np.concatenate(c) for c in cols))


def _split(a: I64, offsets: I64, candidates: I64) -> tuple[I32, I64]:
    """For calls sorted by ``a``, the request of each run of calls and the run's first index;
    ``candidates`` are the requests those calls can belong to. Searches whichever side is
    shorter, so the cost stays O(min(calls, requests) · log)."""
    if candidates.size <= a.size:
        first = np.searchsorted(a, offsets[candidates], side="left")
        end = np.append(first[1:], a.size)
        keep = end > first
        return candidates[keep].astype(np.int32), first[keep].astype(np.int64)
    owner = np.searchsorted(offsets[candidates], a, side="right") - 1
    new = np.empty(a.size, dtype=bool)
    new[0] = True
    np.not_equal(owner[1:], owner[:-1], out=new[1:])
    first = np.flatnonzero(new)
    return candidates[owner[first]].astype(np.int32), first.astype(np.int64)


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

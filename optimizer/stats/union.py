"""Interval unions and exact quantiles in linear numpy passes (the numeric core of the stats).

Role: given the calls of completed requests in the shifted layout of
:mod:`optimizer.stats.scan` (sorted by shifted start ``a``; each request owns a disjoint integer
range, so requests follow one another and a running maximum never carries across them),
compute per request the length of the union of all its calls' intervals (the critical path)
and per (request, pair) the calls, summed durations and union length, and for a set of pairs
the summed per-request union of their calls together (what two models' calls overlap by is
their two unions less their joint one). Also the exact
``quantile_cont`` of a value histogram.

Union of intervals sorted by start in one pass: a call adds whatever of it lies past the
running maximum of the ends before it, ``max(0, b - max(a, max(b_prev...)))``. The per-pair
pass reuses the request order: selecting each pair's calls (by a boolean mask per pair, or for
many pairs a stable radix sort by pair) keeps them sorted by ``a``, so the same formula applies
within each pair's slice. Call-sized arrays are few and reused (``scratch``): on small
machines, fresh memory is a visible part of the cost.

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
MASK_PAIRS = 16  # up to this many pairs, a boolean mask per pair beats sorting by pair


@dataclass(frozen=True, slots=True)
class Segments:
    """One row per (request, pair) with at least one call, grouped by pair."""

    pair: I32
    request: I32  # index into the requests (their offset order)
    calls: I64
    dur: I64  # Σ call durations (µs)
    union: I64  # length of the union of the calls' intervals (µs)


def covered(a: I64, b: I64, out: I64 | None = None) -> I64:
    """Per interval ``[a_i, b_i]`` (sorted by ``a``), the length it adds to the union of the
    intervals before it; their sum is the union's length. Written into ``out`` if given."""
    out = np.empty_like(b) if out is None else out
    if b.size == 0:
        return out
    out[0] = a[0]
    np.maximum.accumulate(b[:-1], out=out[1:])  # running max of the ends before each one
    np.maximum(out, a, out=out)
    np.subtract(b, out, out=out)
    np.maximum(out, 0, out=out)
    return out


def joint_union(
    pair: I32, a: I64, b: I64, members: Sequence[int], scratch: I64 | None = None
) -> int:
    """Σ over requests of the length of the union of the calls of the pairs in ``members``
    (calls of every request, in the shifted layout): a running maximum never carries across
    requests, so one pass over the selected calls sums the per-request unions."""
    mask = np.isin(pair, np.asarray(members, dtype=pair.dtype))
    a_m, b_m = a[mask], b[mask]
    out = None if scratch is None else scratch[: a_m.size]
    return int(covered(a_m, b_m, out).sum())


def request_starts(a: I64, offsets: I64) -> I64:
    """Index of each request's first call: requests own ``[offset_i, offset_{i+1})``."""
    return np.searchsorted(a, offsets, side="left").astype(np.int64)


def request_unions(a: I64, b: I64, starts: I64, scratch: I64 | None = None) -> I64:
    """Per request, the length of the union of all its calls (any pair); ``scratch`` (as long
    as ``a``) saves allocating a call-sized array."""
    if not starts.size:
        return np.zeros(0, np.int64)
    return np.add.reduceat(covered(a, b, scratch), starts)


def segments(
    pair: I32, a: I64, b: I64, offsets: I64, groups: Sequence[I64], scratch: I64 | None = None
) -> Segments:
    """Per (request, pair): calls, summed durations, union length.

    ``groups[pair]`` lists the requests (indices into ``offsets``, ascending) that may call
    ``pair`` (those of its workflow); every call of ``pair`` belongs to one of them.
    ``scratch`` (as long as ``a``) saves allocating a call-sized array.
    """
    n = a.size
    ends = np.cumsum(np.bincount(pair, minlength=len(groups)))
    # Each pair's calls, still in request-then-start order, one pair after another.
    a_s, b_s = np.empty_like(a), np.empty_like(b)
    nonempty = [
        (p, int(ends[p - 1]) if p else 0, int(hi))
        for p, hi in enumerate(ends)
        if hi > (ends[p - 1] if p else 0)
    ]
    if len(nonempty) <= MASK_PAIRS:
        mask = np.empty(n, dtype=bool)  # few pairs: one sequential pass each, no index array
        for p, lo, hi in nonempty:
            np.equal(pair, p, out=mask)
            np.compress(mask, a, out=a_s[lo:hi])
            np.compress(mask, b, out=b_s[lo:hi])
    else:  # a stable sort by pair; on codes that fit 16 bits numpy makes it a radix sort
        keys = pair.astype(np.uint16) if int(pair.max()) < 1 << 16 else pair
        order = np.argsort(keys, kind="stable")
        np.take(a, order, out=a_s)
        np.take(b, order, out=b_s)
        del order
    cover = np.empty_like(b) if scratch is None else scratch
    parts: list[tuple[I32, I32, I64, I64, I64]] = []
    for p, lo, hi in nonempty:
        a_p, b_p, cover_p = a_s[lo:hi], b_s[lo:hi], cover[lo:hi]
        covered(a_p, b_p, cover_p)
        np.subtract(b_p, a_p, out=b_p)  # durations
        request, first = _split(a_p, offsets, groups[p])
        parts.append(
            (
                np.full(first.size, p, dtype=np.int32),
                request,
                np.diff(first, append=a_p.size),
                np.add.reduceat(b_p, first),
                np.add.reduceat(cover_p, first),
            )
        )
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

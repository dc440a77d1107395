"""optimizer.stats.union: interval unions over the shifted layout, per-pair segments, quantiles."""

from __future__ import annotations

import numpy as np
import pytest

from optimizer.stats import union as stats_union
from optimizer.stats.union import (
    covered,
    mean_of,
    quantile_cont,
    request_starts,
    request_unions,
    segments,
)


def _union(intervals: list[tuple[int, int]]) -> int:
    """Brute force: merge the sorted intervals."""
    total, end = 0, None
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if end is None or s > end:
            total, end = total + e - s, e
        elif e > end:
            total, end = total + e - end, e
    return total


def _layout(requests: list[list[tuple[int, int, int]]]) -> tuple[np.ndarray, ...]:
    """(pair, start, end) per call per request → the shifted, sorted layout of stats_scan."""
    pair, a, b, offsets = [], [], [], []
    off = 0
    for calls in requests:
        t0 = min(s for _, s, _ in calls)
        extent = max(max(s, e) for _, s, e in calls) - t0
        offsets.append(off)
        for p, s, e in sorted(calls, key=lambda c: c[1]):
            pair.append(p)
            a.append(s - t0 + off)
            b.append(e - t0 + off)
        off += extent + 1
    return (
        np.asarray(pair, np.int32),
        np.asarray(a, np.int64),
        np.asarray(b, np.int64),
        np.asarray(offsets, np.int64),
    )


def test_covered_on_nested_overlapping_and_disjoint_intervals() -> None:
    a = np.asarray([0, 1, 2, 10, 12, 12], np.int64)
    b = np.asarray([4, 3, 6, 12, 13, 14], np.int64)
    # [0,4] adds 4, [1,3] is nested (0), [2,6] adds 2, [10,12] 2, [12,13] 1, [12,14] 1
    assert covered(a, b).tolist() == [4, 0, 2, 2, 1, 1]
    assert covered(a[:0], b[:0]).size == 0


def test_an_interval_that_ends_before_it_starts_covers_nothing() -> None:
    a = np.asarray([0, 2, 3], np.int64)
    b = np.asarray([1, 1, 5], np.int64)
    assert covered(a, b).tolist() == [1, 0, 2]


def test_request_unions_do_not_leak_across_requests() -> None:
    # request 0 has a long call; request 1 starts right after request 0's range
    _, a, b, offsets = _layout([[(0, 0, 100), (0, 5, 6)], [(0, 1000, 1001), (0, 1000, 1003)]])
    starts = request_starts(a, offsets)
    assert starts.tolist() == [0, 2]
    assert request_unions(a, b, starts).tolist() == [100, 3]


@pytest.mark.parametrize("mask_pairs", [16, 0])  # a mask per pair, or the sort by pair
@pytest.mark.parametrize("seed", range(6))
def test_random_requests_match_brute_force(
    seed: int, mask_pairs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stats_union, "MASK_PAIRS", mask_pairs)
    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(int(rng.integers(1, 40))):
        calls = []
        for _ in range(int(rng.integers(1, 9))):
            s = int(rng.integers(0, 30))
            calls.append((int(rng.integers(0, 3)), s, s + int(rng.integers(-2, 12))))
        requests.append(calls)
    pair, a, b, offsets = _layout(requests)
    starts = request_starts(a, offsets)
    unions = request_unions(a, b, starts)
    every = np.arange(len(requests), dtype=np.int64)
    seg = segments(pair, a, b, offsets, [every, every, every])
    expected = {}
    for i, calls in enumerate(requests):
        assert unions[i] == _union([(s, e) for _, s, e in calls])
        for p in {p for p, _, _ in calls}:
            mine = [(s, e) for q, s, e in calls if q == p]
            expected[(p, i)] = (len(mine), sum(e - s for s, e in mine), _union(mine))
    got = {
        (int(p), int(r)): (int(k), int(d), int(u))
        for p, r, k, d, u in zip(seg.pair, seg.request, seg.calls, seg.dur, seg.union, strict=True)
    }
    assert got == expected
    assert list(seg.pair) == sorted(seg.pair)  # grouped by pair, as the bimodality test expects


def test_segments_when_a_pair_has_fewer_calls_than_candidate_requests() -> None:
    # pair 1 is called by 2 of 50 requests: the split searches the calls, not the requests
    requests = [[(0, 0, 5)] for _ in range(50)]
    requests[7].append((1, 1, 3))
    requests[30] += [(1, 0, 2), (1, 1, 4)]
    pair, a, b, offsets = _layout(requests)
    every = np.arange(50, dtype=np.int64)
    seg = segments(pair, a, b, offsets, [every, every])
    ones = seg.pair == 1
    assert seg.request[ones].tolist() == [7, 30]
    assert seg.calls[ones].tolist() == [1, 2]
    assert seg.union[ones].tolist() == [2, 4]
    assert seg.dur[ones].tolist() == [2, 5]
    assert seg.calls[seg.pair == 0].sum() == 50


def test_no_calls_give_no_segments() -> None:
    empty = np.zeros(0, np.int64)
    seg = segments(np.zeros(0, np.int32), empty, empty, empty, [])
    assert seg.pair.size == 0 and seg.union.size == 0


@pytest.mark.parametrize("q", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_quantile_of_a_histogram_matches_numpy_linear(q: float) -> None:
    rng = np.random.default_rng(3)
    sample = rng.integers(0, 40, 301)
    values, counts = np.unique(sample, return_counts=True)
    assert quantile_cont(values, counts, q) == pytest.approx(float(np.quantile(sample, q)))
    assert mean_of(values, counts) == pytest.approx(float(sample.mean()))


def test_empty_histogram_is_nan() -> None:
    empty = np.zeros(0, np.int64)
    assert np.isnan(quantile_cont(empty, empty, 0.5))
    assert np.isnan(mean_of(empty, empty))

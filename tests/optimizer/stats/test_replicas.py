"""Per-replica figures of a window, from a real store written by the segment writer."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from optimizer.stats.replicas import replica_loads_store
from shared.records import CallRecord
from shared.store import SegmentWriter

S = 1_000_000
_ids = itertools.count()


def _row(
    model: str,
    upstream: str,
    start: float,
    end: float | None,
    *,
    status: int = 200,
    call_id: str | None = None,
    attempt: int = 0,
    ttfb: float | None = None,
    completion: int | None = None,
) -> tuple[object, ...]:
    return CallRecord(
        call_id=call_id or f"r{next(_ids)}",
        proxy_id="test",
        workflow="wf",
        request_id=f"q{next(_ids)}",
        model=model,
        endpoint="/v1/chat/completions",
        upstream=upstream,
        attempt=attempt,
        status=None if end is None else status,
        t_start=round(start * S),
        t_first_byte=None if ttfb is None else round(ttfb * S),
        t_end=None if end is None else round(end * S),
        completion_tokens=completion,
    ).row()


def _write(store: Path, rows: list[tuple[object, ...]]) -> None:
    writer = SegmentWriter(store, "test")
    try:
        writer.write(rows)
    finally:
        writer.close()


def test_each_replica_gets_its_own_counts_latencies_and_ttft(tmp_path: Path) -> None:
    rows = []
    for i in range(10):  # replica a: one call a second, 0.5 s each (0.1 s to first byte)
        # its engine reported 10 or 30 completion tokens, but for one call
        tokens = None if i == 0 else 10 + 20 * (i % 2)
        rows.append(_row("m", "http://a", 100 + i, 100.5 + i, ttfb=100.1 + i, completion=tokens))
    for i in range(4):  # replica b: slower, 2 s
        rows.append(_row("m", "http://b", 100 + 2 * i, 102 + 2 * i))
    rows.append(_row("m", "http://b", 108.5, None))  # still running: started, not finished
    rows.append(_row("m", "http://b", 105, 106, status=500))  # failed: started only
    rows.append(_row("m", "http://a", 50, 51))  # before the window: nothing
    _write(tmp_path, rows)
    loads = {ld.upstream: ld for ld in replica_loads_store(tmp_path, 100 * S, 110 * S)}
    a, b = loads["http://a"], loads["http://b"]
    assert (a.started, a.finished, a.window_s, a.throughput) == (10, 10, 10.0, 1.0)
    assert a.lat_mean == pytest.approx(0.5) and a.lat_p99 == pytest.approx(0.5)
    assert a.ttft_mean == pytest.approx(0.1)
    assert a.lat_mean_early == pytest.approx(0.5) and a.lat_mean_late == pytest.approx(0.5)
    assert a.finished_late == 5  # ended at 105.5 … 109.5
    assert (b.started, b.finished) == (6, 4)
    assert b.lat_mean == pytest.approx(2.0) and math.isnan(b.ttft_mean)
    # tokens: over the calls whose usage was reported (five of 30, four of 10); none at b
    assert a.completion_tokens_mean == pytest.approx(190 / 9)
    assert math.isnan(b.completion_tokens_mean)


def test_a_retried_call_counts_once_at_its_last_attempt(tmp_path: Path) -> None:
    rows = [
        _row("m", "http://a", 100, 101, status=502, call_id="x", attempt=0),
        _row("m", "http://b", 101, 102, call_id="x", attempt=1),
        _row("m", "http://b", 103, 104),
    ]
    _write(tmp_path, rows)
    loads = {ld.upstream: ld for ld in replica_loads_store(tmp_path, 100 * S, 110 * S)}
    assert set(loads) == {"http://b"}
    assert (loads["http://b"].started, loads["http://b"].finished) == (2, 2)


def test_latency_early_and_late_in_the_window(tmp_path: Path) -> None:
    rows = [_row("m", "http://a", 100 + i, 100.2 + i + 0.2 * i) for i in range(10)]
    _write(tmp_path, rows)
    (a,) = replica_loads_store(tmp_path, 100 * S, 112 * S)
    assert a.lat_mean_late > 2 * a.lat_mean_early


def test_calls_of_the_first_half_still_open_at_the_end(tmp_path: Path) -> None:
    rows = [
        _row("m", "http://a", 101, None),  # queued since the first half: open
        _row("m", "http://a", 102, 113),  # ended after the window: open at its end
        _row("m", "http://a", 103, None, call_id="y"),  # open row superseded by its end
        _row("m", "http://a", 103, 104, call_id="y"),
        _row("m", "http://a", 104, 105, status=500),  # failed: ended, not queued
        _row("m", "http://a", 108, None),  # second half: a late start, not counted
    ]
    _write(tmp_path, rows)
    (a,) = replica_loads_store(tmp_path, 100 * S, 110 * S)
    assert (a.started, a.finished, a.open_early, a.finished_late) == (5, 1, 2, 0)


def test_each_replica_is_read_over_the_shortest_window_with_enough_calls(tmp_path: Path) -> None:
    rows = [_row("m", "http://busy", 100 + 0.5 * i, 100.2 + 0.5 * i) for i in range(80)]
    rows += [_row("m", "http://slow", 100 + 4 * i, 101 + 4 * i) for i in range(10)]
    rows += [_row("m", "http://idle", 131, 132)]
    _write(tmp_path, rows)
    loads = {
        ld.upstream: ld
        for ld in replica_loads_store(tmp_path, (130 * S, 100 * S), 140 * S, min_calls=5)
    }
    busy, slow, idle = loads["http://busy"], loads["http://slow"], loads["http://idle"]
    assert (busy.window_s, busy.finished) == (10.0, 20)  # enough in the shortest
    assert (slow.window_s, slow.finished) == (40.0, 10)  # 2 in the shortest: the longer one
    assert (idle.window_s, idle.finished) == (10.0, 1)  # never enough: the shortest


def test_one_window_start_reads_as_before(tmp_path: Path) -> None:
    _write(tmp_path, [_row("m", "http://a", 100 + i, 100.5 + i) for i in range(3)])
    one = replica_loads_store(tmp_path, 100 * S, 110 * S, min_calls=20)
    assert one == replica_loads_store(tmp_path, (100 * S,), 110 * S)


def test_a_longer_window_is_read_only_for_a_replica_short_of_calls(tmp_path: Path) -> None:
    rows = [_row("m", "http://busy", 100 + 0.5 * i, 100.2 + 0.5 * i) for i in range(80)]
    rows += [_row("m", "http://gone", 101, 102)]  # served nothing in the shortest window
    _write(tmp_path, rows)
    got = replica_loads_store(tmp_path, (130 * S, 100 * S), 140 * S, min_calls=5)
    assert [(ld.upstream, ld.window_s) for ld in got] == [("http://busy", 10.0)]

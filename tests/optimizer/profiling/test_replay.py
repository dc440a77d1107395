"""The replay workload: dependencies, retries, skipped calls, forced lengths, the schedule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from optimizer.profiling.replay import (
    ReplayError,
    build_workload,
    frontier_deps,
    load_workload,
    schedule,
)
from shared.records import CallRecord
from shared.store import SegmentWriter

S = 1_000_000


def rec(
    call_id: str,
    rid: str | None,
    start: float,
    end: float | None,
    *,
    attempt: int = 0,
    status: int = 200,
    body: dict[str, Any] | None = None,
    model: str = "m",
    completion: int | None = 7,
) -> CallRecord:
    doc = (
        body
        if body is not None
        else {
            "model": "traced",
            "messages": [{"role": "user", "content": call_id}],
            "max_tokens": 99,
        }
    )
    return CallRecord(
        call_id=call_id,
        proxy_id="t",
        workflow="w",
        request_id=rid,
        model=model,
        endpoint="/v1/chat/completions",
        attempt=attempt,
        status=status,
        t_start=round(start * S),
        t_end=None if end is None else round(end * S),
        completion_tokens=completion,
        body=orjson.dumps(doc).decode(),
    )


def rows(records: list[CallRecord]) -> list[tuple[Any, ...]]:
    return [
        (
            r.call_id,
            r.request_id,
            r.endpoint,
            r.attempt,
            r.status,
            r.error,
            r.stream,
            r.t_start,
            r.t_end,
            r.completion_tokens,
            r.body,
        )
        for r in records
    ]


def test_frontier_keeps_only_direct_predecessors() -> None:
    # a [0,1], b [0,2] parallel; c [2,3] after both; d [3,4] after c only (a, b implied)
    assert frontier_deps([0, 0, 2, 3], [1, 2, 3, 4]) == [(), (), (0, 1), (2,)]
    # overlapping calls never depend on each other
    assert frontier_deps([0, 1], [5, 6]) == [(), ()]


def test_workload_groups_dependencies_retries_and_skips() -> None:
    records = [
        rec("a", "r1", 0.0, 1.0),
        rec("b", "r1", 0.0, 2.0),
        rec("c", "r1", 2.5, 3.0, attempt=0, status=502),
        rec("c", "r1", 2.5, 3.5, attempt=1),  # the retry that succeeded: one logical call
        rec("d", "r2", 0.5, 0.9),
        rec("x", "r2", 1.0, 2.0, status=500),  # failed: skipped
        rec("e", None, 0.2, 0.4),
        rec("f", None, 0.3, 0.6),
    ]
    nobody = rec("g", "r2", 3.0, 4.0)
    nobody.body = None
    wl = build_workload("m", rows([*records, nobody]), served_model="served")
    assert wl.skipped == 2 and len(wl.calls) == 6
    ids = [orjson.loads(c.body)["messages"][0]["content"] for c in wl.calls]
    by_id = dict(zip(ids, range(len(ids)), strict=True))
    assert wl.calls[by_id["c"]].deps == (by_id["a"], by_id["b"])
    assert all(not wl.calls[by_id[k]].deps for k in ("a", "b", "d", "e", "f"))
    assert sorted(len(g) for g in wl.groups) == [1, 1, 1, 3]  # r1, r2 (d), e, f
    body = orjson.loads(wl.calls[by_id["c"]].body)
    assert body["model"] == "served" and body["max_tokens"] == 7 and body["ignore_eos"] is True
    assert wl.depth == pytest.approx(5 / 4)  # r1: chain of 2; the rest: 1


def test_finished_row_supersedes_the_open_row() -> None:
    """The proxy announces a long call with an open row (no end, no body) before its finished
    row; the pair is one replayable call in either order."""
    done = rec("a", "r1", 0.0, 9.0)
    opened = rec("a", "r1", 0.0, None)
    opened.body, opened.status = None, None
    for order in ([opened, done], [done, opened]):
        wl = build_workload("m", rows(order))
        assert wl.skipped == 0 and len(wl.calls) == 1 and wl.calls[0].body


def test_lengths_not_forced_when_asked_or_unknown() -> None:
    wl = build_workload("m", rows([rec("a", "r", 0, 1, completion=None)]))
    assert "ignore_eos" not in orjson.loads(wl.calls[0].body)
    wl = build_workload("m", rows([rec("a", "r", 0, 1)]), force_lengths=False)
    assert orjson.loads(wl.calls[0].body)["max_tokens"] == 99


def test_nothing_replayable_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ReplayError, match="none succeeded"):
        build_workload("m", rows([rec("a", "r", 0, 1, status=500)]))
    writer = SegmentWriter(tmp_path, "p")
    writer.write([rec("a", "r", 0, 1, model="other").row()])
    writer.close()
    with pytest.raises(ReplayError, match="'m'"):
        load_workload(tmp_path, "m")
    assert len(load_workload(tmp_path, "other").calls) == 1


def test_schedule_offers_the_rate_with_the_traced_mix() -> None:
    records = [rec(f"c{i}", f"r{i // 3}", i, i + 0.5) for i in range(30)]  # 10 groups of 3
    wl = build_workload("m", rows(records))
    times, groups = schedule(wl, rate=60.0, duration_s=100.0, rng=np.random.default_rng(1))
    assert np.all(np.diff(times) >= 0) and times[-1] < 100.0
    assert len(times) == 2000  # conditioned on its count: 20 groups/s x 100 s, exactly
    counts = np.bincount(groups, minlength=len(wl.groups))
    assert counts.max() - counts.min() <= 1  # shuffled passes: every group equally often

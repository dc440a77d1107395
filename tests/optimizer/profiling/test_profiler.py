"""The profiler against a fake engine of known capacity, and ``scepsy profile`` end to end."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
from aiohttp import web

from optimizer.cli.main import main
from optimizer.model.curves import Profile
from optimizer.profiling.profiler import Replayer, sweep
from optimizer.profiling.replay import build_workload, load_workload
from optimizer.profiling.window import (
    SweepSettings,
    Target,
    fill_time,
    next_rate,
    send_span,
    tapered_rate,
)
from optimizer.store.profiles import load_points, save_points
from shared.profile_points import ProfilePoint, export_json
from shared.records import CallRecord
from shared.store import SegmentWriter
from tests.loopback import serving

S = 1_000_000
SLOTS, SERVICE_S = 8, 0.05  # the fake serves 8 calls at once, 50 ms each: 160 calls/s


def _rows(n_groups: int) -> list[CallRecord]:
    out = []
    for g in range(n_groups):  # per request: two parallel calls, then one after both
        t = g * 10.0
        for i, (a, b) in enumerate(((0.0, 1.0), (0.0, 1.5), (2.0, 3.0))):
            out.append(
                CallRecord(
                    call_id=f"g{g}c{i}",
                    proxy_id="t",
                    workflow="w",
                    request_id=f"r{g}",
                    model="fake-1b",
                    endpoint="/v1/chat/completions",
                    status=200,
                    t_start=round((t + a) * S),
                    t_end=round((t + b) * S),
                    completion_tokens=5,
                    body=orjson.dumps(
                        {"model": "fake-1b", "messages": [{"role": "user", "content": f"g{g}c{i}"}]}
                    ).decode(),
                )
            )
    return out


def _workload_rows(records: list[CallRecord]) -> list[tuple[Any, ...]]:
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


@pytest.fixture
async def fake_engine() -> AsyncIterator[tuple[str, list[tuple[str, float, float]]]]:
    """A FIFO engine with SLOTS servers of SERVICE_S each; it logs (content, start, end)."""
    slots = asyncio.Semaphore(SLOTS)
    log: list[tuple[str, float, float]] = []

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        loop = asyncio.get_running_loop()
        start = loop.time()
        async with slots:
            await asyncio.sleep(SERVICE_S)
        log.append((untagged(body["messages"][0]["content"]), start, loop.time()))
        return web.json_response({"choices": [{"message": {"content": "ok"}}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    async with serving(app) as url:
        yield url, log


def untagged(text: str) -> str:
    """A replayed prompt without the replayer's tag."""
    return re.sub(r"^\[replay [0-9a-f]+\.\d+\] ", "", text)


SMALL = SweepSettings(
    calls_per_point=250,
    min_groups_per_point=10,
    min_point_s=1.0,
    max_point_s=3.0,
    curve=(0.2, 0.6),
    resolution=0.08,
    max_points=6,
    probe_concurrency=32,
    probe_max_s=1.0,
)


async def test_dependent_calls_start_after_their_predecessors_end(
    fake_engine: tuple[str, list[tuple[str, float, float]]],
) -> None:
    url, log = fake_engine
    wl = build_workload("fake-1b", _workload_rows(_rows(3)))
    target = Target(url, "fake-1b", "fake", "none", 1, 1.0)
    async with aiohttp.ClientSession() as session:
        rep = Replayer(session, target, wl, 10.0)
        timings: list[Any] = []
        await asyncio.gather(*(rep.group(g, timings) for g in range(len(wl.groups))))
    seen = {content: (start, end) for content, start, end in log}
    assert len(seen) == 9 and all(t.ok for t in timings)
    for g in range(3):
        last_start = seen[f"g{g}c2"][0]
        assert last_start >= seen[f"g{g}c0"][1] and last_start >= seen[f"g{g}c1"][1]
        assert seen[f"g{g}c1"][0] < seen[f"g{g}c0"][1]  # parallel calls overlap


@pytest.mark.slow
@pytest.mark.parametrize("speedup", [1.0, 4.0])
async def test_sweep_finds_the_fake_engines_capacity(
    fake_engine: tuple[str, list[tuple[str, float, float]]], speedup: float
) -> None:
    url, _ = fake_engine
    wl = build_workload("fake-1b", _workload_rows(_rows(40)))
    # a speed-up of 4 means 4 model seconds per wall second: capacity in model time is /4
    target = Target(url, "fake-1b", "fake", "none", 1, 1.0, speedup)
    result = await sweep(target, wl, SMALL)
    capacity = SLOTS / SERVICE_S / speedup
    assert result.saturated
    assert result.saturation == pytest.approx(capacity, rel=0.1)
    light = result.points[0].point
    assert light.lat_p50 == pytest.approx(SERVICE_S * speedup, rel=0.5)
    assert light.throughput == pytest.approx(light.offered_rate, rel=0.15)
    assert Profile.from_points([r.point for r in result.points]).saturated


@pytest.mark.slow
async def test_packed_copies_are_measured_per_copy_with_each_request_on_one(
    fake_engine: tuple[str, list[tuple[str, float, float]]],
) -> None:
    """Two copies offered the sweep's rate together: every figure per copy (each copy's
    capacity is the fake's), the points marked packed, a request's calls all on one copy."""
    url, log = fake_engine
    other_log: list[tuple[str, float, float]] = []
    slots = asyncio.Semaphore(SLOTS)

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        start = asyncio.get_running_loop().time()
        async with slots:
            await asyncio.sleep(SERVICE_S)
        other_log.append((untagged(body["messages"][0]["content"]), start, 0.0))
        return web.json_response({"choices": [{"message": {"content": "ok"}}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    wl = build_workload("fake-1b", _workload_rows(_rows(40)))
    async with serving(app) as other:
        target = Target(url, "fake-1b", "fake", "none", 1, 0.5, copies=(other,))
        result = await sweep(target, wl, SMALL)
    assert result.saturated
    assert result.saturation == pytest.approx(SLOTS / SERVICE_S, rel=0.15)
    assert {r.point.colocation for r in result.points} == {"packed"}
    light = result.points[0].point
    assert light.throughput == pytest.approx(light.offered_rate, rel=0.15)
    # each request (g<k>) went to one copy only, and both copies served
    first = {c.split("c")[0] for c, *_ in log}
    second = {c.split("c")[0] for c, *_ in other_log}
    assert first and second and not first & second


def _store(tmp_path: Path) -> Path:
    writer = SegmentWriter(tmp_path, "p")
    writer.write([r.row() for r in _rows(5)])
    writer.close()
    return tmp_path


def test_unknown_model_exits_2_naming_model_and_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _store(tmp_path)
    assert main(["profile", "--store", str(store), "--model", "nope"]) == 2
    err = capsys.readouterr().err
    assert "'nope'" in err and str(store) in err


def test_from_json_replaces_only_its_keys(tmp_path: Path) -> None:
    def pt(share: float, rate: float) -> ProfilePoint:
        return ProfilePoint(
            "m", "emulator", "a6000", 1, share, rate, rate, 1.0, 1.0, 1.0, 1.0, 0.5, 100
        )

    save_points(tmp_path, [pt(1.0, 1.0), pt(1.0, 2.0), pt(0.5, 1.0)])
    src = tmp_path / "p.json"
    src.write_bytes(export_json([pt(1.0, 5.0)]))
    assert main(["profile", "--store", str(tmp_path), "--model", "m", "--from-json", str(src)]) == 0
    stored = load_points(tmp_path, "m")
    assert sorted((p.share, p.offered_rate) for p in stored) == [(0.5, 1.0), (1.0, 5.0)]


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("SCEPSY_E2E_PROFILE"),
    reason="~40 s of real-time emulation whose saturation reading depends on machine load: "
    "set SCEPSY_E2E_PROFILE=1 (bench.speed.profile_time reports the same figure)",
)
@pytest.mark.timeout(150)  # ~40 s at load 3 on 2 cores; the emulator runs in real time
def test_profile_emulated_embedder_end_to_end(tmp_path: Path) -> None:
    """``scepsy profile --quick`` against a real emulator process (e5-base-v2) at the speed-up
    it calibrates itself, checked against the capacity the emulator's performance model
    implies for the same calls."""
    from sim.cluster import Allocation, ReplicaSpec
    from sim.des import WorkloadSpec, simulate
    from sim.trace import write_trace
    from tests.optimizer.profiling.capacity import implied_capacity

    alloc = Allocation(
        tuple(
            ReplicaSpec(m, "a6000", 1, 1.0, 1)
            for m in ("e5-base-v2", "bge-reranker-base", "llama-3-8b")
        )
    )
    write_trace(
        simulate(alloc, [WorkloadSpec("rag", 4.0)], duration_s=20, record_calls=True, seed=3),
        tmp_path,
    )
    capacity = implied_capacity(load_workload(tmp_path, "e5-base-v2"), "a6000")
    save_points(
        tmp_path,
        [
            ProfilePoint(
                "e5-base-v2", "emulator", "a6000", 1, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 10
            )
        ],
    )
    assert (
        main(
            [
                "profile",
                "--store",
                str(tmp_path),
                "--model",
                "e5-base-v2",
                "--quick",
            ]
        )
        == 0
    )
    points = load_points(tmp_path, "e5-base-v2")
    measured = [p for p in points if p.share == 1.0]
    assert len(measured) >= 4 and any(p.share == 0.5 for p in points)  # other key kept
    profile = Profile.from_points(measured)
    assert profile.saturated
    assert profile.saturation == pytest.approx(capacity, rel=0.1)
    assert replace(measured[0], n_calls=0).engine == "emulator"


def test_bracket_rises_then_bisects_to_the_resolution() -> None:
    s = SweepSettings(first_bracket=0.95, step_up=1.15, resolution=0.06)
    assert next_rate(None, None, 100.0, s) == pytest.approx(95.0)
    assert next_rate(60.0, None, 100.0, s) == pytest.approx(95.0)  # curve below: bracket
    assert next_rate(95.0, None, 100.0, s) == pytest.approx(95.0 * 1.15)  # kept up: rise
    assert next_rate(60.0, 95.0, 100.0, s) == pytest.approx((60.0 * 95.0) ** 0.5)
    assert next_rate(95.0, 100.0, 100.0, s) is None  # within 6%: saturation is pinned
    assert next_rate(None, 50.0, 100.0, s) is None  # nothing kept up: the caller lowers


def test_tapered_rate_ignores_the_phase_of_batched_completions() -> None:
    # a batching engine finishes 10 calls every 0.1 s (at 0.05, 0.15, ...): 100 calls/s
    # whatever the window's phase, while a plain count over 1.05 s holds 10 or 11 batches
    bursts = np.repeat(np.arange(0.05, 5.0, 0.1), 10).tolist()
    for shift in (0.0, 0.02, 0.04, 0.06, 0.08):
        window = (1.0 + shift, 2.05 + shift)
        assert tapered_rate(bursts, window, 0.25) == pytest.approx(100.0, rel=0.03)
    assert tapered_rate(bursts, (0.99, 2.04), 0.0) == pytest.approx(100 / 1.05)
    assert tapered_rate(bursts, (1.04, 2.09), 0.0) == pytest.approx(110 / 1.05)


def test_window_waits_for_the_groups_last_calls_and_the_queue() -> None:
    groups = ((0, 1, 2), (3,))
    # group 0 started at 0 and sent its last call at 3; group 1 (one call) at 1
    marks = [[0.0, 0.0, 1.5, 3.0], [1.0, 1.0]]
    assert send_span(marks, 2.0, 10.0, groups, [0, 1], quantile=1.0) == pytest.approx(3.0)
    # a group still sending counts until now
    assert send_span([[0.0, 0.0, 1.5]], 2.0, 10.0, groups, [0], quantile=1.0) == 10.0
    # calls in flight climb to 10 by t=5, then stay: the queue filled at 90% of that level
    sends = np.arange(0.0, 20.0, 0.1)
    ends = sends[sends < 19.0] + np.minimum(1.0, sends[sends < 19.0] / 5.0)
    assert 3.0 < fill_time(sends.tolist(), ends.tolist(), 0.0, 20.0) < 5.5

"""A daemon pass learns live profile points from a replica's traffic and blends them in."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from optimizer.daemon.service import Daemon
from optimizer.plan.observed import RunningReplica
from optimizer.store.profiles import load_points
from shared.records import CallRecord
from shared.store import SegmentWriter
from tests.optimizer.daemon.test_daemon import T0, FakeBackend, FakeClock, _profiles, _settings

S = 1_000_000
URL = "http://fake/llama-0"


def _traffic(
    store: Path, seconds: float, rate: float = 2.0, latency: float = 0.5, start: float = T0
) -> None:
    """``rate`` llama-3-8b calls/s served by the replica at ``URL`` from ``start`` (epoch s),
    ``latency`` s each."""
    rows = []
    n = int(seconds * rate)
    for i in range(n):
        t = start + i / rate
        rows.append(
            CallRecord(
                call_id=f"c{start}-{i}",
                proxy_id="test",
                workflow="chat",
                request_id=f"q{i}",
                model="llama-3-8b",
                endpoint="/v1/chat/completions",
                upstream=URL,
                status=200,
                t_start=round(t * S),
                t_first_byte=round((t + 0.1) * S),
                t_end=round((t + latency) * S),
                prompt_tokens=10,
                completion_tokens=5,
            ).row()
        )
    writer = SegmentWriter(store, f"live-{start}")
    try:
        writer.write(rows)
    finally:
        writer.close()


def _backend() -> FakeBackend:
    backend = FakeBackend()
    backend.replicas["llama-0"] = RunningReplica(
        "llama-0", "g0", "llama-3-8b", "n0", (0,), 1.0, 1, URL, True
    )
    return backend


@pytest.mark.timeout(60)
async def test_a_pass_saves_live_points_of_a_replica_running_the_whole_window(
    tmp_path: Path,
) -> None:
    _profiles(tmp_path)
    _traffic(tmp_path, 200.0)
    clock = FakeClock(T0 + 100)
    daemon = Daemon(_settings(tmp_path, apply=False), _backend(), clock=clock)
    before = (await daemon._book()).lookup("llama-3-8b", 1, 1.0)
    first = await daemon.tick()  # the replica is seen for the first time: nothing learned
    assert first.live_points == ()
    clock.t += 20
    assert (await daemon.tick()).live_points == ()  # its window began before it was seen
    clock.t += 20
    report = await daemon.tick()
    (point,) = report.live_points
    assert (point.model, point.engine, point.gpu_type, point.tp, point.share) == (
        "llama-3-8b",
        "emulator",
        "a6000",
        1,
        1.0,
    )
    assert point.source == "live" and point.lat_mean == pytest.approx(0.5)
    assert point.throughput == pytest.approx(2.0, rel=0.05)
    assert point.observed_at == pytest.approx(clock.t - 3)  # settle_s early
    stored = [p for p in load_points(tmp_path) if p.source == "live"]
    assert stored == [point]
    after = (await daemon._book()).lookup("llama-3-8b", 1, 1.0)
    assert after.corrected_by == 1 and before.corrected_by == 0
    assert after.latency(2.0) == pytest.approx(0.5)
    text = daemon.metrics.exposition().decode()
    assert 'scepsy_optimizer_live_profile_points{model="llama-3-8b"} 1.0' in text
    # the next pass's window (40 s, 20 s on) overlaps this one's: no second reading of it
    clock.t += 20
    assert (await daemon.tick()).live_points == ()
    clock.t += 20
    (again,) = (await daemon.tick()).live_points
    assert again.observed_at == pytest.approx(point.observed_at + 40)


@pytest.mark.timeout(60)
async def test_a_replica_whose_engine_started_before_the_window_teaches_the_first_pass(
    tmp_path: Path,
) -> None:
    _profiles(tmp_path)
    _traffic(tmp_path, 200.0)
    backend = _backend()
    started = T0 - 60  # the backend knows the engine ran before the daemon did
    backend.replicas["llama-0"] = replace(backend.replicas["llama-0"], started_at=started)
    daemon = Daemon(_settings(tmp_path, apply=False), backend, clock=FakeClock(T0 + 100))
    (point,) = (await daemon.tick()).live_points
    assert point.lat_mean == pytest.approx(0.5)


@pytest.mark.timeout(60)
async def test_an_engine_restarted_slower_is_corrected_within_a_bounded_number_of_passes(
    tmp_path: Path,
) -> None:
    """The engine at ``URL`` restarts at T0 + 200 s (same URL) and serves each call in 1 s
    where it took 0.5 s: the first window after the restart is not trusted (it straddles the
    restart), and within LIVE_KEEP passes the curve reads what the replica does now."""
    _profiles(tmp_path)
    _traffic(tmp_path, 200.0, latency=0.5)
    _traffic(tmp_path, 400.0, latency=1.0, start=T0 + 201.0)
    backend = _backend()
    backend.replicas["llama-0"] = replace(backend.replicas["llama-0"], started_at=T0 - 60)
    clock = FakeClock(T0 + 160)
    daemon = Daemon(_settings(tmp_path, apply=False), backend, clock=clock)
    assert (await daemon.tick()).live_points  # learned at once: the engine ran before
    before = (await daemon._book()).lookup("llama-3-8b", 1, 1.0)
    assert before.latency(2.0) == pytest.approx(0.5)
    backend.replicas["llama-0"] = replace(backend.replicas["llama-0"], started_at=T0 + 200)
    passes = 0  # passes after the restart
    while True:
        clock.t += 20
        passes += clock.t > T0 + 200
        report = await daemon.tick()
        # the replicas' window is [now - window_s, now - settle_s)
        if clock.t - 40 < T0 + 200 < clock.t - 3:  # it holds the restart
            assert report.live_points == ()
        got = float((await daemon._book()).lookup("llama-3-8b", 1, 1.0).latency(2.0))
        if (passes and abs(got - 1.0) <= 0.15) or passes > 10:
            break
    # 1 pass whose window straddles the restart, then the median of LIVE_KEEP = 5 points
    # turns after 3 new ones
    assert abs(got - 1.0) <= 0.15 and passes <= 1 + 3
    curve = (await daemon._book()).lookup("llama-3-8b", 1, 1.0)
    assert curve.speed < before.speed  # slower than before the restart


@pytest.mark.timeout(60)
async def test_a_replica_with_too_few_calls_teaches_nothing(tmp_path: Path) -> None:
    _profiles(tmp_path)
    # 0.1 calls/s: 16 calls even over the widest window (4 x 40 s): too few to trust
    _traffic(tmp_path, 400.0, rate=0.1)
    clock = FakeClock(T0 + 100)
    daemon = Daemon(_settings(tmp_path, apply=False), _backend(), clock=clock)
    for _ in range(12):
        assert (await daemon.tick()).live_points == ()
        clock.t += 20
    assert [p for p in load_points(tmp_path) if p.source == "live"] == []


@pytest.mark.timeout(60)
async def test_a_slow_replica_is_read_over_a_longer_window(tmp_path: Path) -> None:
    """0.4 calls/s gives 15 calls in the 40 s window (too few) and 31 in one twice as long:
    the point comes from the doubled window, at the rate the replica served."""
    _profiles(tmp_path)
    _traffic(tmp_path, 400.0, rate=0.4, latency=1.5)
    backend = _backend()
    backend.replicas["llama-0"] = replace(backend.replicas["llama-0"], started_at=T0 - 60)
    clock = FakeClock(T0 + 200)
    daemon = Daemon(_settings(tmp_path, apply=False), backend, clock=clock)
    (point,) = (await daemon.tick()).live_points
    assert point.n_calls == 31 and point.throughput == pytest.approx(0.4, rel=0.05)
    assert point.lat_mean == pytest.approx(1.5)


@pytest.mark.timeout(60)
async def test_a_longer_window_never_reaches_before_the_replica_started(tmp_path: Path) -> None:
    """Seen first at T0 + 100 s: the doubled window holds enough calls only once it begins
    after that, 80 s later."""
    _profiles(tmp_path)
    _traffic(tmp_path, 400.0, rate=0.4)
    clock = FakeClock(T0 + 100)
    daemon = Daemon(_settings(tmp_path, apply=False), _backend(), clock=clock)
    learned_at = None
    for _ in range(8):
        if (await daemon.tick()).live_points:
            learned_at = clock.t - T0
            break
        clock.t += 20
    assert learned_at == 180

"""The daemon on a damaged store and with failing passes, through a real server on loopback:
a bad segment fails no pass and shows in /metrics; /health/ready (and /health) turn 503 with
the error after failed passes in a row and back to 200 when a pass succeeds; /health/live
stays 200."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from optimizer.daemon.service import Daemon, make_app
from shared.store import segment_dir
from tests.optimizer.daemon.test_daemon import (
    T0,
    FakeBackend,
    FakeClock,
    _profiles,
    _settings,
    _trace,
)


async def _serve(daemon: Daemon, *, loop: bool) -> AsyncIterator[str]:
    runner = web.AppRunner(make_app(daemon, loop=loop))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()  # cancels the loop task


async def _get(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        if resp.content_type == "application/json":
            return resp.status, await resp.json()
        return resp.status, await resp.text()


async def _until(check: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.mark.timeout(60)
async def test_a_damaged_segment_fails_no_pass_and_is_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _profiles(tmp_path)
    _trace(tmp_path, [(1.0, 120.0)])
    (segment,) = sorted(segment_dir(tmp_path, "simulated").glob("*.parquet"))
    whole = segment.read_bytes()
    # a second copy of the segment, cut short, and a file of garbage
    truncated = segment.with_name("seg-truncated.parquet")
    truncated.write_bytes(whole[: len(whole) // 3])
    garbage = segment.with_name("seg-garbage.parquet")
    garbage.write_bytes(os.urandom(2048))
    daemon = Daemon(_settings(tmp_path), FakeBackend(), clock=FakeClock(T0 + 100))
    with caplog.at_level(logging.WARNING, logger="shared.store"):
        report = await daemon.tick()
    assert report.decision.kind == "rollout" and "rag" in report.stats
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert str(truncated) in warned and str(garbage) in warned
    async for base in _serve(daemon, loop=False):
        status, text = await _get(f"{base}/metrics")
        assert status == 200
        assert "scepsy_optimizer_store_unreadable_segments 2.0" in text
        status, health = await _get(f"{base}/health/ready")
        assert status == 200 and health["unreadable_segments"] == 2


@pytest.mark.timeout(60)
async def test_health_reports_failing_passes_and_recovers(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    _profiles(ready)
    _trace(ready, [(1.0, 120.0)])
    store = tmp_path / "store"
    store.write_bytes(b"not a folder")  # the store is unreadable: every pass fails
    settings = _settings(store, interval_s=0.05, health_failed_passes=2)
    daemon = Daemon(settings, FakeBackend(), clock=FakeClock(T0 + 100))
    async for base in _serve(daemon, loop=True):
        await _until(lambda: daemon.failures_in_a_row >= 2)
        for path in ("/health/ready", "/health"):
            status, body = await _get(base + path)
            assert status == 503, path
            assert body["status"] == "failing" and body["failed_passes_in_a_row"] >= 2
            assert body["last_error"] and "\n" not in body["last_error"]
        assert await _get(f"{base}/health/live") == (200, {"status": "alive"})

        store.unlink()
        ready.rename(store)
        await _until(lambda: daemon.ticks >= 1)
        status, body = await _get(f"{base}/health/ready")
        assert status == 200 and body["status"] == "ok" and body["last_error"] is None
        assert body["errors"] >= 2 and body["failed_passes_in_a_row"] == 0


@pytest.mark.timeout(30)
async def test_one_failed_pass_is_not_yet_unhealthy_nor_is_a_daemon_not_started(
    tmp_path: Path,
) -> None:
    daemon = Daemon(_settings(tmp_path, health_failed_passes=2), FakeBackend())
    async for base in _serve(daemon, loop=False):
        assert (await _get(f"{base}/health"))[0] == 200  # before the first pass is due
        daemon.failures_in_a_row, daemon.last_error = 1, "OSError: disk"
        status, body = await _get(f"{base}/health/ready")
        assert status == 200 and body["last_error"] == "OSError: disk"
        daemon.started = asyncio.get_running_loop().time() - 3 * 20 - 61  # monotonic clock
        status, body = await _get(f"{base}/health/ready")
        assert status == 503 and body["status"] == "stalled"

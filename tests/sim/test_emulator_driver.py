"""The real-time driver: pacing on the model's clock, lag accounting, aborts, and the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
import urllib.request

import pytest

from shared.ports import free_port
from sim.engine import EngineCore
from sim.engine_driver import EngineDriver, Update
from sim.perf import perf_model
from sim.text import token_ids


async def _drive(driver: EngineDriver, jobs: int, tokens: int) -> list[Update]:
    sink: asyncio.Queue[Update] = asyncio.Queue()
    task = asyncio.create_task(driver.run())
    try:
        for i in range(jobs):
            driver.submit(f"r{i}", token_ids(f"prompt number {i} " * 20), tokens, sink, i)
        updates, done = [], 0
        while done < jobs:
            updates.append(await sink.get())
            done += updates[-1].finished
        return updates
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_wall_time_follows_the_model_clock_divided_by_speedup() -> None:
    speedup = 4.0
    driver = EngineDriver(EngineCore(perf_model("llama-3-8b", "a6000")), speedup=speedup)
    start = time.monotonic()
    updates = await _drive(driver, jobs=8, tokens=40)
    wall = time.monotonic() - start
    intended = driver.model_busy_s / speedup
    assert intended > 0.2  # ~40 decode steps of ~30 ms model time each
    assert intended * 0.97 <= wall <= intended * 1.2 + 0.03  # slack for a loaded CI machine
    assert -0.02 < driver.step_stretch < 0.15 and driver.lag_ratio < 0.15
    per_choice = {u.choice: u.emitted for u in updates if u.finished}
    assert per_choice == dict.fromkeys(range(8), 40)
    firsts = [u for u in updates if u.first]
    assert sorted(u.choice for u in firsts) == list(range(8))


async def test_updates_are_cumulative_and_end_with_one_finish() -> None:
    driver = EngineDriver(EngineCore(perf_model("llama-3.2-1b", "a100")), speedup=1000.0)
    updates = await _drive(driver, jobs=3, tokens=7)
    for choice in range(3):
        mine = [u for u in updates if u.choice == choice]
        counts = [u.emitted for u in mine]
        assert counts == sorted(counts) and counts[-1] == 7
        assert [u.finished for u in mine].count(True) == 1 and mine[-1].finished
    assert not driver.tickets


async def test_abort_stops_updates_and_frees_the_core() -> None:
    core = EngineCore(perf_model("llama-3.2-1b", "a100"))
    driver = EngineDriver(core, speedup=50.0)
    sink: asyncio.Queue[Update] = asyncio.Queue()
    task = asyncio.create_task(driver.run())
    try:
        driver.submit("long", token_ids("hello there"), 10_000, sink)
        await sink.get()
        driver.abort("long")
        await asyncio.sleep(0.02)
        while not sink.empty():
            assert not sink.get_nowait().finished
        assert not core.has_work() and not driver.tickets
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_speedup_must_be_positive() -> None:
    with pytest.raises(ValueError, match="speedup"):
        EngineDriver(EngineCore(perf_model("llama-3.2-1b", "a100")), speedup=0)


def test_cli_serves_and_stops_gracefully() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sim.cli",
            "--model",
            "e5-base-v2",
            "--gpu",
            "a6000",
            "--share",
            "0.3",
            "--port",
            str(port),
            "--speedup",
            "10",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    assert r.status == 200 and r.headers["X-Scepsy-Emulated"] == "1"
                    break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
        proc.terminate()
        assert proc.wait(timeout=10) == 0
        assert "EMULATED e5-base-v2" in (proc.stderr.read() if proc.stderr else "")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_rejects_bad_flags_in_one_line() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sim.cli", "--model", "llama-3-8b", "--speedup", "-1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "speedup" in out.stderr and "Traceback" not in out.stderr

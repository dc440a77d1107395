"""The recorder never blocks, bounds its memory, and flushes on size, interval and close."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from proxy.recorder import Recorder
from shared.records import CallRecord
from shared.settings import StoreSettings
from shared.store import StoreReader
from tests.proxy.conftest import ProxyHandle


def _rec(i: int) -> CallRecord:
    return CallRecord(
        call_id=f"c{i}",
        proxy_id="p",
        workflow="w",
        request_id="r",
        model="m",
        endpoint="/v1/chat/completions",
        t_start=i,
    )


async def _count(store: Path) -> int:
    return int(StoreReader(store).calls().count("*").fetchall()[0][0])


async def test_full_queue_drops_and_counts(tmp_path: Path) -> None:
    rec = Recorder(
        StoreSettings(path=str(tmp_path), queue_size=10, segment_rows=100, flush_interval_s=60), "p"
    )
    await rec.start()
    accepted = [rec.submit(_rec(i)) for i in range(15)]
    assert accepted == [True] * 10 + [False] * 5 and rec.dropped == 5 and rec.depth == 10
    await rec.close()
    assert rec.written == 10 and await _count(tmp_path) == 10


async def test_flush_on_size_and_on_interval(tmp_path: Path) -> None:
    rec = Recorder(StoreSettings(path=str(tmp_path), segment_rows=5, flush_interval_s=0.2), "p")
    await rec.start()
    try:
        for i in range(5):
            rec.submit(_rec(i))
        for _ in range(100):
            if rec.written == 5:
                break
            await asyncio.sleep(0.01)
        assert rec.written == 5 and rec.segments == 1  # the size trigger, well before the interval
        rec.submit(_rec(5))
        await asyncio.sleep(0.5)
        assert rec.written == 6 and rec.segments == 2  # the interval trigger
    finally:
        await rec.close()


async def test_steady_traffic_makes_one_segment_per_interval(tmp_path: Path) -> None:
    """Records that arrive while a segment is written wait for the next interval; a flush
    that chased them would write a stream of tiny segments for as long as traffic lasts."""
    interval = 0.3
    rec = Recorder(
        StoreSettings(path=str(tmp_path), segment_rows=100_000, flush_interval_s=interval), "p"
    )
    await rec.start()
    try:
        i = 0
        t_end = asyncio.get_running_loop().time() + 3.5 * interval
        while asyncio.get_running_loop().time() < t_end:
            for _ in range(20):  # ~20 records per millisecond, as a loaded proxy submits them
                rec.submit(_rec(i))
                i += 1
            await asyncio.sleep(0.001)
        assert 1 <= rec.segments <= 4, rec.segments
    finally:
        await rec.close()
    assert rec.written == i and await _count(tmp_path) == i


async def test_a_failing_store_counts_and_keeps_going(tmp_path: Path) -> None:
    rec = Recorder(StoreSettings(path=str(tmp_path), segment_rows=2, flush_interval_s=60), "p")
    await rec.start()
    assert rec._writer is not None
    segdir = rec._writer.directory
    segdir.chmod(0o500)  # writes into the segment folder now fail
    try:
        rec.submit(_rec(0))
        rec.submit(_rec(1))
        for _ in range(100):
            if rec.write_errors:
                break
            await asyncio.sleep(0.01)
    finally:
        segdir.chmod(0o700)
    import os

    if os.geteuid() != 0:  # root ignores folder permissions; the check is meaningful elsewhere
        assert rec.write_errors == 1 and rec.dropped == 2
    rec.submit(_rec(2))
    await rec.close()
    assert await _count(tmp_path) >= 1


async def test_metrics_expose_calls_and_recorder(proxy: ProxyHandle) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.post(proxy.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
        async with s.post(proxy.url + "/v1/chat/completions", data=b"nope") as r:
            assert r.status == 400
        await proxy.flush()
        async with s.get(proxy.url + "/metrics") as r:
            text = await r.text()
    assert 'scepsy_proxy_requests_total{code="200",model="m",workflow="wf0"} 3.0' in text
    assert 'scepsy_proxy_requests_total{code="400",model="",workflow=""} 1.0' in text
    assert 'scepsy_proxy_prompt_tokens_total{model="m",workflow="wf0"} 30.0' in text
    assert "scepsy_proxy_request_duration_seconds_bucket" in text
    assert "scepsy_proxy_time_to_first_byte_seconds_count" in text
    assert "scepsy_proxy_records_written_total 3.0" in text
    assert "scepsy_proxy_recorder_queue_depth 0.0" in text
    assert 'scepsy_proxy_upstream_in_flight{model="m",upstream="' in text

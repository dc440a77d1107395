"""The recorder never blocks, bounds its memory, and flushes on size, interval and close."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import openai

from proxy.recorder import Recorder
from shared.records import CallRecord, now_us
from shared.settings import StoreSettings
from shared.store import StoreReader
from tests.proxy.conftest import ProxyFactory, ProxyHandle
from tests.proxy.fake_engine import FakeEngine


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


async def test_calls_in_flight_are_announced_once(tmp_path: Path) -> None:
    """A call still running a flush interval after it began is written once as an open row
    (no end), then its finished row; a call that ends before that costs no extra row."""
    interval = 0.2
    rec = Recorder(StoreSettings(path=str(tmp_path), flush_interval_s=interval), "p")
    await rec.start()
    try:
        long, short = _rec(1), _rec(2)
        long.t_start = short.t_start = now_us()
        rec.begin(long)
        rec.begin(short)
        short.t_end = now_us()
        rec.submit(short)
        await asyncio.sleep(3.5 * interval)  # several flushes while the long call runs
        assert rec.announced == 1
        long.t_end, long.status = now_us(), 200
        rec.submit(long)
    finally:
        await rec.close()
    got = (
        StoreReader(tmp_path)
        .calls()
        .order("call_id, t_end NULLS FIRST")
        .select("call_id, t_start, t_end, status")
        .fetchall()
    )
    assert got == [
        ("c1", long.t_start, None, None),
        ("c1", long.t_start, long.t_end, 200),
        ("c2", short.t_start, short.t_end, None),
    ]


async def test_a_long_call_is_in_the_store_while_it_runs(
    proxy_factory: ProxyFactory, engine: FakeEngine
) -> None:
    """Through the proxy and the real client: the optimizer can see a call the engine has not
    answered yet (an open row), and its finished row once it has."""
    p = await proxy_factory([("m", engine.url)], store={"flush_interval_s": 0.2})
    headers = {"X-Scepsy-Workflow": "wf", "X-Scepsy-Request-Id": "r1", "X-Fake-Delay-S": "1.5"}
    async with openai.AsyncOpenAI(base_url=f"{p.url}/v1", api_key="k", max_retries=0) as client:
        call = asyncio.create_task(
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], extra_headers=headers
            )
        )
        rows: list[tuple[object, ...]] = []
        for _ in range(100):
            await asyncio.sleep(0.1)
            if (tmp := p.store / "calls").exists() and any(tmp.rglob("*.parquet")):
                rows = (
                    StoreReader(p.store)
                    .calls()
                    .select("workflow, request_id, model, t_end")
                    .fetchall()
                )
                if rows:
                    break
        assert rows == [("wf", "r1", "m", None)] and not call.done()
        await call
    got = await p.records()
    assert sorted((r["request_id"], r["t_end"] is None, r["status"] or 0) for r in got) == [
        ("r1", False, 200),
        ("r1", True, 0),
    ]
    assert got[0]["t_start"] == got[1]["t_start"] and got[0]["call_id"] == got[1]["call_id"]

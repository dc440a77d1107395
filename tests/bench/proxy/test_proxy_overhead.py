"""Smoke test of ``bench.proxy.overhead`` at a tiny scale, and the bench upstream's HTTP parsing.

The benchmark's figures are not asserted (they depend on the machine); what is asserted is that
every measurement ran without errors, that the report has the documented shape, and that the
proxy's store held one record per call that reached the upstream through it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from bench.proxy._upstream import Counters, EngineProtocol
from bench.proxy.overhead import TARGETS, RunShape, run_benchmark, write_report

TINY = RunShape(
    duration_s=0.3,
    warmup_s=0.1,
    stream_duration_s=0.4,
    stream_chunks=8,
    recorder_burst=3_000,
    recorder_paced=1_000,
    recorder_rate=10_000.0,
)
SUMMARY_KEYS = {
    "added_p50_ms_c1",
    "direct_rps_c16",
    "proxied_rps_c16",
    "added_p50_ms_c16",
    "added_p99_ms_c16",
    "proxied_rps_c64",
    "stream_events_per_s",
    "recorder_records_per_s",
    "records_dropped",
}


@pytest.mark.slow
def test_tiny_benchmark_writes_a_complete_report(tmp_path: Path) -> None:
    report = run_benchmark(TINY, client="aiohttp", pin=False)
    data = orjson.loads(write_report(report, tmp_path).read_bytes())

    assert data["config"]["load_client"] == "aiohttp"
    assert data["machine"]["cpu_count"] >= 1
    runs = data["http"]
    assert sorted((r["target"], r["concurrency"]) for r in runs) == sorted(
        (t, c) for t in ("direct", "proxied") for c in (1, 16, 64)
    )
    for r in runs:
        assert r["errors"] == 0, r
        assert r["requests"] > 0 and r["rps"] > 0
        assert 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"]
    for target in ("direct", "proxied"):
        s = data["streaming"][target]
        assert s["errors"] == 0 and s["streams"] > 0
        assert s["events_per_stream"] == data["streaming"]["expected_events_per_stream"] == 9
    check = data["store_check"]
    assert check["posts_via_proxy"] > 0
    assert check["records_in_store"] == check["posts_via_proxy"]
    assert check["proxy_recorder_dropped"] == 0
    for run in data["recorder"].values():
        assert run["on_disk"] == run["written"] == run["records"]
    assert set(data["summary"]) >= SUMMARY_KEYS
    assert data["summary"]["proxied_rps_c16"] == next(
        r["rps"] for r in runs if r["target"] == "proxied" and r["concurrency"] == 16
    )
    assert set(data["targets"]) == set(TARGETS)
    assert all(isinstance(t["met"], bool) for t in data["targets"].values())


async def _exchange(server_port: int, raw: bytes, pieces: int) -> bytes:
    """Send ``raw`` cut into ``pieces`` writes; read until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server_port)
    step = max(1, len(raw) // pieces)
    for i in range(0, len(raw), step):
        writer.write(raw[i : i + step])
        await writer.drain()
        await asyncio.sleep(0.001)
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return data


async def test_upstream_answers_pipelined_and_partial_requests_in_order() -> None:
    counters = Counters()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: EngineProtocol(counters, 3), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    plain = b'{"model":"bench"}'
    stream = b'{"model":"bench","stream":true,"stream_options":{"include_usage":true}}'

    def post(body: bytes, close: bool = False) -> bytes:
        extra = b"Connection: close\r\n" if close else b""
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + extra
        return head + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body

    try:
        raw = post(plain) + post(stream) + post(plain, close=True)
        for pieces in (1, 7, 50):  # one write, and requests cut at arbitrary bytes
            data = await _exchange(port, raw, pieces)
            assert data.count(b"HTTP/1.1 200 OK") == 3
            first, second, third = data.split(b"HTTP/1.1 200 OK")[1:]
            assert b'"chat.completion"' in first and b"event-stream" not in first
            assert second.count(b"data: ") == 5  # 3 chunks, usage, [DONE]
            assert b'"usage":{"prompt_tokens"' in second and second.endswith(b"0\r\n\r\n")
            assert b'"chat.completion"' in third
        assert counters.posts == 9 and counters.streams == 3
    finally:
        server.close()
        await server.wait_closed()

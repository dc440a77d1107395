"""Smoke test of ``bench.proxy.overhead`` at a tiny scale; the process-tree CPU sum, the
per-worker recorder sum and the bench upstream's HTTP parsing.

The benchmark's figures are not asserted (they depend on the machine); what is asserted is that
every measurement ran without errors, that the report has the documented shape (peers that are
not installed reported as skipped), and that the proxy's store held one record per call that
reached the upstream through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest

from bench.proxy._load import _stat_fields, cpu_seconds, process_tree
from bench.proxy._upstream import Counters, EngineProtocol
from bench.proxy.overhead import RunShape, run_benchmark, write_report
from bench.proxy.overhead_report import TARGETS, judge
from bench.proxy.peers import PEERS, SCEPSY
from bench.proxy.servers import recorder_totals

TINY = RunShape(
    duration_s=0.3,
    warmup_s=0.1,
    stream_duration_s=0.4,
    stream_chunks=8,
    recorder_burst=3_000,
    recorder_paced=1_000,
    recorder_rate=10_000.0,
)
FIGURES = {
    "added_p50_ms_c1",
    "rps_c16",
    "rps_c64",
    "cpu_ms_per_request_c16",
    "host_busy_pct_c16",
    "stream_events_per_s",
    "stream_p50_ms",
}


@pytest.mark.slow
def test_tiny_benchmark_writes_a_complete_report(tmp_path: Path) -> None:
    report = run_benchmark(TINY, client="aiohttp", pin=False)
    data = orjson.loads(write_report(report, tmp_path).read_bytes())

    assert data["config"]["load_client"] == data["machine"]["load_client"] == "aiohttp"
    assert data["machine"]["cpu_count"] >= 1
    assert sorted((r["concurrency"]) for r in data["direct"]["http"]) == [16, 64]
    assert set(data["servers"]) == {SCEPSY, *(p.name for p in PEERS)}
    ran = [n for n, phase in data["servers"].items() if "skipped" not in phase]
    assert SCEPSY in ran
    for peer in PEERS:
        if peer.missing():
            assert data["servers"][peer.name]["skipped"] == "not installed"
    for name in ran:
        phase = data["servers"][name]
        runs = phase["http"]
        assert sorted((r["target"], r["concurrency"]) for r in runs) == sorted(
            [("direct", 1), *((name, c) for c in (1, 16, 64))]
        )
        for r in [*runs, *data["direct"]["http"]]:
            assert r["errors"] == 0, (name, r)
            assert r["requests"] > 0 and r["rps"] > 0
            assert 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"]
            assert r["server_cpu_s"] is not None and r["host_busy_pct"] is not None
        for s in (phase["streaming"], data["direct"]["streaming"]):
            assert s["errors"] == 0 and s["streams"] > 0
            assert s["events_per_stream"] == data["expected_events_per_stream"] == 9
        figures = data["summary"]["servers"][name]
        assert set(figures) >= FIGURES and figures["errors"] == 0
        assert figures["rps_c16"] == next(
            r["rps"] for r in runs if r["target"] == name and r["concurrency"] == 16
        )
    check = data["servers"][SCEPSY]["store_check"]
    assert check["posts_via_proxy"] > 0
    assert check["records_in_store"] == check["posts_via_proxy"] == check["proxy_recorder_written"]
    assert check["proxy_recorder_dropped"] == 0
    assert check["proxy_recorders_closed"] == data["servers"][SCEPSY]["workers"] >= 1
    for run in data["recorder"].values():
        assert run["on_disk"] == run["written"] == run["records"]
    assert data["summary"]["proxied_rps_c16"] == data["summary"]["servers"][SCEPSY]["rps_c16"]
    assert set(data["targets"]) == set(TARGETS)
    assert "usable CPUs" in data["notes"][0]
    for t in data["targets"].values():
        assert t["met"] is None if t["value"] is None else isinstance(t["met"], bool)


# A child that starts a grandchild burning 0.3 s of CPU, then on each line on stdin: first
# kills and reaps the grandchild (its time moves to the child's cutime), then exits.
_TREE_CHILD = textwrap.dedent(
    r"""
    import subprocess, sys
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    burn += "print('burnt', flush=True)\ntime.sleep(30)\n"
    g = subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE, text=True)
    g.stdout.readline()
    print(g.pid, flush=True)
    sys.stdin.readline()
    g.kill()
    g.wait()
    print("reaped", flush=True)
    sys.stdin.readline()
    """
)


def test_cpu_seconds_sums_the_whole_process_tree() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _TREE_CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        grandchild = int(child.stdout.readline())
        assert process_tree(child.pid) == [child.pid, grandchild]
        fields = _stat_fields(child.pid)
        assert fields is not None
        own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # start-up only
        total = cpu_seconds(child.pid)
        assert total is not None and total >= 0.28 and total > own + 0.25
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "reaped"
        assert process_tree(child.pid) == [child.pid]
        after = cpu_seconds(child.pid)  # the reaped grandchild's time still counts
        assert after is not None and after >= total
    finally:
        child.kill()
        child.wait()
    assert cpu_seconds(child.pid) is None and process_tree(child.pid) == []


def test_recorder_totals_sum_every_worker() -> None:
    stderr = "\n".join(
        [
            "2026-12-06 INFO scepsy.proxy: scepsy-proxy worker 0 ready",
            "2026-12-06 INFO scepsy.proxy.app: recorder closed: 1200 written, 0 dropped",
            "2026-12-06 WARNING scepsy.proxy: something else",
            "2026-12-06 INFO scepsy.proxy.app: recorder closed: 34 written, 5 dropped",
        ]
    )
    assert recorder_totals(stderr) == {"written": 1234, "dropped": 5, "recorders": 2}
    single = "INFO scepsy.proxy.app: recorder closed: 7 written, 0 dropped\n"
    assert recorder_totals(single) == {"written": 7, "dropped": 0, "recorders": 1}
    assert recorder_totals("no such line") is None


def test_targets_without_a_figure_are_not_judged() -> None:
    summary = {
        "added_p50_ms_c1": 0.1,
        "proxied_rps_c16": 5000.0,
        "ratios": {"rps_c16_over_vllm_router": 0.9, "rps_c16_over_sglang_router": None},
        "records_lost": 0,
    }
    verdicts = judge(summary)
    assert verdicts["added_p50_ms_c1_issue26"]["met"] is True
    assert verdicts["rps_c16_over_vllm_router"]["met"] is True
    assert verdicts["rps_c16_over_sglang_router"] == {
        "issue": 26,
        "figure": "ratios.rps_c16_over_sglang_router",
        "target": ">= 1",
        "value": None,
        "met": None,
    }
    assert verdicts["records_dropped"]["met"] is None  # absent from this summary


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


@contextlib.asynccontextmanager
async def _engine(counters: Counters) -> AsyncIterator[int]:
    """The bench upstream (3 chunks a stream) on a free port, in this event loop."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: EngineProtocol(counters, 3), "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


def _post(body: bytes, close: bool = False, path: bytes = b"/v1/chat/completions") -> bytes:
    extra = b"Connection: close\r\n" if close else b""
    head = b"POST " + path + b" HTTP/1.1\r\nHost: x\r\n" + extra
    return head + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body


async def test_upstream_answers_pipelined_and_partial_requests_in_order() -> None:
    counters = Counters()
    plain = b'{"model":"bench"}'
    stream = b'{"model":"bench","stream":true,"stream_options":{"include_usage":true}}'
    async with _engine(counters) as port:
        raw = _post(plain) + _post(stream) + _post(plain, close=True)
        for pieces in (1, 7, 50):  # one write, and requests cut at arbitrary bytes
            data = await _exchange(port, raw, pieces)
            assert data.count(b"HTTP/1.1 200 OK") == 3
            first, second, third = data.split(b"HTTP/1.1 200 OK")[1:]
            assert b'"chat.completion"' in first and b"event-stream" not in first
            assert second.count(b"data: ") == 5  # 3 chunks, usage, [DONE]
            assert b'"usage":{"prompt_tokens"' in second and second.endswith(b"0\r\n\r\n")
            assert b'"chat.completion"' in third
    assert counters.posts == 9 and counters.streams == 3


async def test_upstream_answers_render_with_token_ids_and_counts_it_apart() -> None:
    counters = Counters()
    body = b'{"model":"bench","messages":[{"role":"user","content":"ping"}]}'
    async with _engine(counters) as port:
        raw = _post(body, close=True, path=b"/v1/chat/completions/render")
        data = await _exchange(port, raw, 1)
    answer = orjson.loads(data.split(b"\r\n\r\n", 1)[1])
    assert data.startswith(b"HTTP/1.1 200 OK") and len(answer["token_ids"]) > 0
    assert (counters.renders, counters.posts) == (1, 0)

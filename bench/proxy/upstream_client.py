"""Benchmark: the proxy's own upstream client (``proxy.upstream``) against aiohttp's
``ClientSession``, in CPU time per request and requests/s.

``python -m bench.proxy.upstream_client --out DIR [--quick]`` writes ``DIR/upstream_client.json``.

Set-up: ``bench.proxy._upstream`` (raw asyncio HTTP/1.1, pre-built vLLM-shaped answers, 100 chunk
events per stream) in its own process; the client in this process, on an event loop of each
kind (asyncio's own and uvloop). Where the machine has two cores or more the client gets the
first core to itself and the upstream the others. Each cell — loop x client x body kind
(plain JSON, a 100-event SSE stream) x concurrency (1, 16) — warms up, then runs ``c``
workers back to back for a fixed time, counting completed requests and this process's CPU
time over the window. Both clients are used as the proxy uses them: the same request headers,
``read()`` for JSON and ``iter_any()`` for streams, counting the events received.

Invariants: all figures are real measurements on this machine (nothing emulated); a cell with
an error or a short stream is reported with its error count, never hidden; over several rounds
a cell reports its least CPU per request (interference from other work only ever adds CPU) and
every round is kept under ``rounds``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import uvloop

from bench.proxy.overhead import Server
from proxy.upstream import UpstreamClient

ROUTE = "/v1/chat/completions"
EVENTS = 100
_MESSAGES = [{"role": "user", "content": "ping"}]
JSON_BODY = orjson.dumps({"model": "bench", "messages": _MESSAGES, "max_tokens": 16})
SSE_BODY = orjson.dumps({"model": "bench", "messages": _MESSAGES, "stream": True})
# What the proxy forwards of a typical OpenAI-SDK call (after dropping hop-by-hop headers).
HEADERS = (
    ("Content-Type", "application/json"),
    ("Accept", "application/json"),
    ("User-Agent", "OpenAI/Python 1.54.0"),
    ("X-Stainless-Lang", "python"),
    ("X-Stainless-Retry-Count", "0"),
    ("Authorization", "Bearer sk-bench"),
)
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


@dataclass(frozen=True)
class RunShape:
    """One benchmark run's shape: each cell's duration and warm-up, rounds, concurrencies."""

    duration_s: float
    warmup_s: float
    rounds: int
    concurrencies: tuple[int, ...] = (1, 16)


QUICK = RunShape(1.0, 0.3, 1)
FULL = RunShape(4.0, 1.0, 2)

# One call: send, consume the body, return the number of SSE events seen (0 for JSON).
Call = Callable[[bytes, bool], Awaitable[int]]


async def _count_events(pieces: AsyncIterator[bytes]) -> int:
    """SSE events (blank-line boundaries) in a body, counting those split across pieces."""
    n, last = 0, b""
    async for piece in pieces:
        n += piece.count(b"\n\n") + (last == b"\n" and piece[:1] == b"\n")
        last = piece[-1:]
    return n


async def _scepsy(url: str) -> tuple[Call, Callable[[], Awaitable[None]]]:
    client = UpstreamClient()

    async def call(body: bytes, stream: bool) -> int:
        async with await client.request("POST", url, ROUTE, HEADERS, body) as r:
            if r.status != 200:
                raise RuntimeError(f"status {r.status}")
            if not stream:
                await r.read()
                return 0
            return await _count_events(r.iter_any())

    return call, client.close


async def _aiohttp(url: str) -> tuple[Call, Callable[[], Awaitable[None]]]:
    # Configured as proxy.app configures the proxy's session.
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=4),
        timeout=aiohttp.ClientTimeout(total=600, sock_connect=5, sock_read=300),
        auto_decompress=False,
        skip_auto_headers=("User-Agent",),
    )
    headers = dict(HEADERS)
    target = url + ROUTE

    async def call(body: bytes, stream: bool) -> int:
        async with session.post(target, data=body, headers=headers) as r:
            if r.status != 200:
                raise RuntimeError(f"status {r.status}")
            if not stream:
                await r.read()
                return 0
            return await _count_events(r.content.iter_any())

    return call, session.close


CLIENTS = {"scepsy": _scepsy, "aiohttp": _aiohttp}


async def _cell(
    client: str, url: str, stream: bool, concurrency: int, shape: RunShape
) -> dict[str, Any]:
    """Warm up, then ``concurrency`` workers back to back over the measured window."""
    call, close = await CLIENTS[client](url)
    body = SSE_BODY if stream else JSON_BODY
    counts = {"requests": 0, "errors": 0, "short": 0, "events": 0}
    measuring = False
    stop_at = time.perf_counter() + shape.warmup_s

    async def worker() -> None:
        while time.perf_counter() < stop_at:
            try:
                n = await call(body, stream)
            except Exception:
                if measuring:
                    counts["errors"] += 1
                continue
            if measuring:
                counts["requests"] += 1
                counts["events"] += n
                counts["short"] += stream and n < EVENTS + 1  # chunks + [DONE]

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        measuring = True
        cpu0, wall0 = time.process_time(), time.perf_counter()
        stop_at = wall0 + shape.duration_s
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    finally:
        await close()
    done = counts["requests"]
    return {
        **counts,
        "seconds": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "rps": round(done / wall, 1),
        "cpu_us_per_request": round(cpu * 1e6 / done, 1) if done else None,
        "cpu_us_per_event": round(cpu * 1e6 / counts["events"], 2) if counts["events"] else None,
        "core_share": round(cpu / wall, 3),
    }


@dataclass(frozen=True)
class Cell:
    loop: str
    body: str  # "json" or "sse"
    concurrency: int
    client: str


def measure(url: str, shape: RunShape) -> list[dict[str, Any]]:
    cells = [
        Cell(loop, body, c, client)
        for loop in LOOPS
        for body in ("json", "sse")
        for c in shape.concurrencies
        for client in CLIENTS
    ]
    rounds: dict[Cell, list[dict[str, Any]]] = {cell: [] for cell in cells}
    for _ in range(shape.rounds):
        for cell in cells:
            with asyncio.Runner(loop_factory=LOOPS[cell.loop]) as runner:
                res = runner.run(
                    _cell(cell.client, url, cell.body == "sse", cell.concurrency, shape)
                )
            rounds[cell].append(res)
            print(
                f"{cell.loop:7} {cell.body:4} c={cell.concurrency:<2} {cell.client:7}"
                f" {res['rps']:>8.0f} req/s  {res['cpu_us_per_request']} us cpu/req"
                f"  errors {res['errors']}",
                flush=True,
            )
    out = []
    for cell, runs in rounds.items():
        best = min(runs, key=lambda r: r["cpu_us_per_request"] or float("inf"))
        out.append({**asdict(cell), **best, "rounds": runs})
    return out


def summarise(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per loop x body x concurrency: both clients' CPU per request and their ratio."""
    by = {(r["loop"], r["body"], r["concurrency"], r["client"]): r for r in results}
    rows = []
    for (loop, body, c, client), mine in by.items():
        if client != "scepsy":
            continue
        theirs = by[(loop, body, c, "aiohttp")]
        a, b = mine["cpu_us_per_request"], theirs["cpu_us_per_request"]
        rows.append(
            {
                "loop": loop,
                "body": body,
                "concurrency": c,
                "scepsy_cpu_us_per_request": a,
                "aiohttp_cpu_us_per_request": b,
                "cpu_ratio_scepsy_over_aiohttp": round(a / b, 3) if a and b else None,
                "scepsy_rps": mine["rps"],
                "aiohttp_rps": theirs["rps"],
            }
        )
    return rows


def run_benchmark(shape: RunShape, pin: bool) -> dict[str, Any]:
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    cpus = sorted(os.sched_getaffinity(0))
    mine, others = (cpus[:1], cpus[1:]) if pin and len(cpus) > 1 else (cpus, cpus)
    with tempfile.TemporaryDirectory(prefix="scepsy-bench-upstream-") as tmp:
        cmd = [sys.executable, "-m", "bench.proxy._upstream", "--chunks", str(EVENTS)]
        upstream = Server("upstream", cmd, frozenset(others), Path(tmp))
        own = os.sched_getaffinity(0)
        os.sched_setaffinity(0, mine)
        try:
            results = measure(upstream.url, shape)
        finally:
            os.sched_setaffinity(0, own)
            upstream.stop()
    return {
        "benchmark": "upstream_client",
        "kind": "measured",
        "machine": {
            "cpu_count": os.cpu_count(),
            "usable_cpus": len(cpus),
            "client_cpus": mine,
            "upstream_cpus": others,
            "platform": platform.platform(),
            "python": platform.python_version(),
            # other work on the machine competes with the client: this says how much there was
            "loadavg_1m_before": round(load_before, 2),
            "loadavg_1m_after": round(os.getloadavg()[0], 2),
            "aiohttp": aiohttp.__version__,
            "uvloop": version("uvloop"),
        },
        "config": {**asdict(shape), "events_per_stream": EVENTS, "headers": [*map(list, HEADERS)]},
        "summary": summarise(results),
        "results": results,
        "elapsed_s": round(time.perf_counter() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.proxy.upstream_client", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--out", required=True, type=Path, help="folder for upstream_client.json")
    p.add_argument("--quick", action="store_true", help="short runs (about half a minute)")
    p.add_argument("--no-pin", action="store_true", help="do not give the client its own core")
    args = p.parse_args(argv)
    report = run_benchmark(QUICK if args.quick else FULL, not args.no_pin)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "upstream_client.json"
    path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
    for row in report["summary"]:
        print(
            f"{row['loop']:7} {row['body']:4} c={row['concurrency']:<2}"
            f" scepsy {row['scepsy_cpu_us_per_request']} us  aiohttp"
            f" {row['aiohttp_cpu_us_per_request']} us  ratio {row['cpu_ratio_scepsy_over_aiohttp']}"
        )
    print(f"wrote {path} in {report['elapsed_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

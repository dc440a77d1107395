"""1,000 concurrent streams held open through one proxy (two workers), with the real openai client.

The fake replica sends each stream's first token and then holds it (``hold`` mode) until the
test has seen all 1,000 in flight at the proxy (``GET /admin/routes`` and the
``scepsy_proxy_upstream_in_flight`` gauge on ``/metrics``); then it lets them all finish, the
proxy is stopped with SIGTERM, and the store must hold one clean record per stream.

The proxy runs as its own process so that it, and not the test's client, gets a core of its
own; the client side is spread over several openai clients because one httpx connection pool
scans all its connections for every request (quadratic in the pool size).
"""

from __future__ import annotations

import asyncio
import resource
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from shared import metric_names
from shared.store import StoreReader
from tests.proxy.fake_engine import FakeEngine
from tests.proxy.proxy_process import proxy_process

N = 1000
CLIENTS = 10
ADMIN = "admin-secret"
MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


def _raise_open_file_limit(need: int) -> None:
    # This process holds two sockets per stream (client and fake), the proxy two more.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))


async def _in_flight(session: aiohttp.ClientSession, url: str) -> tuple[int, float]:
    """(in flight per /admin/routes, in flight per the /metrics gauge), over all replicas."""
    auth = {"Authorization": f"Bearer {ADMIN}"}
    async with session.get(f"{url}/admin/routes", headers=auth) as r:
        routes: dict[str, Any] = await r.json()
    async with session.get(f"{url}/metrics") as r:
        text = await r.text()
    gauge = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(metric_names.PROXY_IN_FLIGHT + "{")
    )
    return sum(int(u["in_flight"]) for u in routes["upstreams"]), gauge


async def _one(client: openai.AsyncOpenAI) -> str:
    stream = await client.chat.completions.create(
        model="m", messages=MSG, stream=True, extra_headers={"X-Fake-Mode": "hold"}
    )
    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


@pytest.mark.slow
@pytest.mark.timeout(60)
async def test_thousand_concurrent_streams_are_held_and_recorded(tmp_path: Path) -> None:
    _raise_open_file_limit(2 * N + 512)
    fake = await FakeEngine(name="e", tokens=2).start(backlog=2 * N)
    # Two workers: the admin view and /metrics must count every worker's streams.
    settings = {"proxy": {"admin_token": ADMIN, "proxy_id": "c1000", "workers": 2}}
    try:
        async with proxy_process(tmp_path, fake.url, settings) as proxy:
            clients = [
                openai.AsyncOpenAI(
                    base_url=f"{proxy.url}/v1",
                    api_key="sk-test",
                    max_retries=0,
                    timeout=30,
                    http_client=openai.DefaultAsyncHttpxClient(verify=False),
                )
                for _ in range(CLIENTS)
            ]
            t0 = time.monotonic()
            tasks = [asyncio.create_task(_one(clients[i % CLIENTS])) for i in range(N)]
            async with aiohttp.ClientSession() as session:
                peak, peak_gauge = 0, 0.0
                # Held end to end: counted by the proxy and being answered by the replica.
                while peak < N or fake.in_flight < N:
                    ended = [t for t in tasks if t.done()]
                    assert not ended, f"a held stream ended: {ended[0].exception()!r} ({peak})"
                    assert time.monotonic() - t0 < 30, f"{peak}, {fake.in_flight} of {N} held"
                    await asyncio.sleep(0.1)
                    peak, peak_gauge = await _in_flight(session, proxy.url)
                held_s = time.monotonic() - t0
                fake.release.set()
                texts = await asyncio.gather(*tasks)
                after = await _in_flight(session, proxy.url)
            for client in clients:
                await client.close()
            proxy.proc.send_signal(signal.SIGTERM)
            assert await proxy.exit_code(15) == 0, proxy.stderr()
    finally:
        await fake.stop()
    assert (peak, peak_gauge, fake.peak_in_flight) == (N, N, N)
    assert after == (0, 0.0)
    assert texts == ["tok0 tok1 "] * N
    records = StoreReader(proxy.store).calls().fetchall()
    assert len(records) == N and len({r[0] for r in records}) == N
    rel = StoreReader(proxy.store).calls()
    clean = "status = 200 AND error IS NULL AND stream AND completion_tokens = 2"
    [(ok,)] = rel.filter(clean).aggregate("count(*)").fetchall()
    assert ok == N
    print(f"{N} streams held after {held_s:.1f}s, all done {time.monotonic() - t0:.1f}s")

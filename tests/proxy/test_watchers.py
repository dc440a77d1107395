"""The load scraper: engine figures reach the pick within a scrape interval, and a broken or
hostile /metrics page costs nothing but its own figures."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import openai
import pytest
from aiohttp import web

from proxy.watchers import MAX_METRICS_BYTES, _scrape
from shared.engine_load import EngineLoad
from sim.emulator_server import RunningEmulator, serving
from sim.serving import EmulatorConfig
from tests.loopback import serving as serving_app
from tests.proxy.conftest import ProxyFactory

MODEL = "llama-3.2-1b"
Handler = Callable[[web.Request], Awaitable[web.Response]]


@contextlib.asynccontextmanager
async def _engines() -> AsyncIterator[list[RunningEmulator]]:
    async with (
        serving(EmulatorConfig(model=MODEL, seed=1)) as a,
        serving(EmulatorConfig(model=MODEL, seed=2)) as b,
    ):
        yield [a, b]


@contextlib.asynccontextmanager
async def _held(engine: RunningEmulator, calls: int) -> AsyncIterator[None]:
    """``calls`` long generations sent to ``engine`` directly (another proxy's traffic), all
    cancelled on exit."""
    async with openai.AsyncOpenAI(base_url=engine.base_url, api_key="x", max_retries=0) as client:

        async def one(i: int) -> object:
            return await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"other {i}"}], max_tokens=2000
            )

        tasks = [asyncio.create_task(one(i)) for i in range(calls)]
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _until(check: Callable[[], bool], limit_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + limit_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("policy", ["least_outstanding", "consistent_hash"])
async def test_an_engine_busy_with_other_traffic_gets_less_new_work(
    proxy_factory: ProxyFactory, policy: str
) -> None:
    async with _engines() as (busy, idle):
        proxy = await proxy_factory(
            [(MODEL, busy.url), (MODEL, idle.url)],
            routing={"policy": policy, "engine_scrape_s": 0.2, "affinity_slack": 2},
        )
        reps = {r.url: r for r in proxy.router.replicas()}
        async with _held(busy, 48):
            # the engine runs them; the proxy's scraper sees it, with no call of its own there
            await _until(lambda: proxy.router.load(reps[busy.url]) >= 24, 15.0)
            async with openai.AsyncOpenAI(
                base_url=f"{proxy.url}/v1", api_key="x", max_retries=0
            ) as client:
                for i in range(20):
                    await client.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": f"new {i}"}],
                        max_tokens=1,
                        extra_headers={"X-Scepsy-Request-Id": f"q{i}"},
                    )
            assert reps[idle.url].served >= 19, {u: r.served for u, r in reps.items()}


async def _read(handler: Handler) -> EngineLoad | None:
    app = web.Application()
    app.router.add_get("/metrics", handler)
    async with serving_app(app) as url, aiohttp.ClientSession() as session:
        return await _scrape(session, url, 0.5)


async def test_pages_that_name_no_load_are_no_figures() -> None:
    async def good(_: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_waiting 3\nvllm:num_requests_running 1\n")

    async def huge(_: web.Request) -> web.Response:
        return web.Response(body=b"vllm:num_requests_waiting 3\n" + b"#" * MAX_METRICS_BYTES)

    async def junk(_: web.Request) -> web.Response:
        return web.Response(body=bytes(range(256)) * 100)

    async def failing(_: web.Request) -> web.Response:
        return web.Response(status=500, text="vllm:num_requests_waiting 3\n")

    async def hangs(_: web.Request) -> web.Response:
        await asyncio.sleep(1.5)
        return web.Response(text="vllm:num_requests_waiting 3\n")

    assert await _read(good) == EngineLoad(running=1.0, waiting=3.0, kv_usage=None)
    for handler in (huge, junk, failing, hangs):
        assert await _read(handler) is None, handler.__name__

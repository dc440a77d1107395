"""Fixtures: fake engines and a real proxy on loopback ports, torn down after every test."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from proxy.app import make_app, make_runner
from proxy.keys import RECORDER, ROUTER
from proxy.router import Router
from shared.settings import Settings, settings_from_mapping
from shared.store import StoreReader
from tests.proxy.fake_engine import FakeEngine
from tests.proxy.upstream_servers import LOOPS, Run


@dataclass
class ProxyHandle:
    app: web.Application
    runner: web.AppRunner
    port: int
    store: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def router(self) -> Router:
        return self.app[ROUTER]

    async def flush(self) -> None:
        """Write every buffered record now (as the interval flush would)."""
        await self.app[RECORDER]._flush()

    async def records(self) -> list[dict[str, Any]]:
        await self.flush()
        rel = StoreReader(self.store).calls()
        cols = rel.columns
        return [
            dict(zip(cols, row, strict=True)) for row in rel.order("t_start, attempt").fetchall()
        ]

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_proxy(settings: Settings) -> ProxyHandle:
    app = make_app(settings)
    runner = make_runner(app, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return ProxyHandle(app, runner, port, Path(settings.store.path))


EngineFactory = Callable[..., Awaitable[FakeEngine]]
ProxyFactory = Callable[..., Awaitable[ProxyHandle]]


@pytest.fixture
async def engine_factory() -> AsyncIterator[EngineFactory]:
    started: list[FakeEngine] = []

    async def make(**kw: Any) -> FakeEngine:
        eng = await FakeEngine(**kw).start()
        started.append(eng)
        return eng

    yield make
    await asyncio.gather(*(e.stop() for e in started))


@pytest.fixture
async def proxy_factory(tmp_path: Path) -> AsyncIterator[ProxyFactory]:
    started: list[ProxyHandle] = []

    async def make(upstreams: list[tuple[str, str]] | None = None, **proxy: Any) -> ProxyHandle:
        store = proxy.pop("store", {})
        extra = list(proxy.pop("upstream_docs", []))
        ups = [{"model": m, "url": u} for m, u in upstreams or []] + extra
        doc = {
            "proxy": {"listen": "127.0.0.1:0", "proxy_id": "test-proxy", **proxy, "upstreams": ups},
            "store": {"path": str(tmp_path / "store"), "flush_interval_s": 60.0, **store},
        }
        handle = await start_proxy(settings_from_mapping(doc))
        started.append(handle)
        return handle

    yield make
    for handle in started:
        await handle.stop()


@pytest.fixture
async def engine(engine_factory: EngineFactory) -> FakeEngine:
    return await engine_factory(name="e1", models=("m", "emb", "rr"))


@pytest.fixture
async def proxy(proxy_factory: ProxyFactory, engine: FakeEngine) -> ProxyHandle:
    return await proxy_factory(
        [("m", engine.url), ("emb", engine.url), ("rr", engine.url)], default_workflow="wf0"
    )


@pytest.fixture(params=list(LOOPS))
def run(request: pytest.FixtureRequest) -> Run:
    """(proxy.upstream tests) One test coroutine in a fresh loop of each kind; no leftovers."""

    def runner(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
        with asyncio.Runner(loop_factory=LOOPS[request.param]) as r:
            r.run(asyncio.wait_for(test(), 10))
            left = [t for t in asyncio.all_tasks(r.get_loop()) if not t.done()]
            assert not left, f"tasks left running: {left}"

    return runner

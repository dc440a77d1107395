"""The proxy's two background loops over its replicas: the health prober and the load scraper.

Role: ``cleanup_ctx`` generators that :func:`proxy.app.make_app` installs.
- :func:`prober_ctx` probes each ejected replica's ``/health`` once its ejection has passed and
  hands the verdict to the router (which re-admits it and logs so);
- :func:`scraper_ctx` reads every active replica's ``/metrics`` each
  ``routing.engine_scrape_s`` and hands the engine's running and waiting calls and KV-cache use
  to the router (:meth:`proxy.router.Router.scraped`), which folds them into every pick.

Invariants:
- neither loop ever blocks or fails a call: a probe or scrape that errs, times out, or reads a
  page that is too large or names no load counts as "no figures" (an ejected replica stays out;
  a scraped load ages out after ``routing.engine_stale_s`` and local counts take over);
- one request per engine URL per round, whatever number of models it serves, each bounded by a
  timeout no longer than the round; a round that runs late is not stacked on the next;
- both tasks end when the app shuts down (cancelled, awaited), before the session closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web

from proxy.keys import ROUTER, SESSION, SETTINGS
from proxy.router import Replica
from shared.engine_load import EngineLoad, engine_load

log = logging.getLogger("scepsy.proxy.watchers")
MAX_METRICS_BYTES = 4 << 20  # a vLLM page with every histogram is ~100 KB; past this, ignored


async def _probe(session: aiohttp.ClientSession, rep: Replica, limit_s: float) -> bool:
    try:
        async with session.get(
            f"{rep.url}/health", timeout=aiohttp.ClientTimeout(total=limit_s)
        ) as r:
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def _scrape(session: aiohttp.ClientSession, url: str, limit_s: float) -> EngineLoad | None:
    try:
        async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=limit_s)) as r:
            if r.status != 200:
                return None
            page = bytearray()
            async for chunk in r.content.iter_any():
                page += chunk
                if len(page) > MAX_METRICS_BYTES:
                    return None
    except (aiohttp.ClientError, TimeoutError):
        return None
    return engine_load(page.decode("utf-8", "replace"))


async def _background(
    name: str, every_s: float, round_: Callable[[], Awaitable[None]]
) -> AsyncIterator[None]:
    async def loop() -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await round_()
            except Exception:  # a bug in one round must not end the loop for good
                log.exception("%s: a round failed; the next one runs as usual", name)

    task = asyncio.create_task(loop(), name=name)
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def prober_ctx(app: web.Application) -> AsyncIterator[None]:
    router, session = app[ROUTER], app[SESSION]
    interval = app[SETTINGS].proxy.routing.probe_interval_s

    async def round_() -> None:
        due = router.due_probes()
        if due:
            results = await asyncio.gather(*(_probe(session, r, interval) for r in due))
            for rep, ok in zip(due, results, strict=True):
                router.probe_result(rep, ok)  # logs the re-admission

    async for _ in _background("scepsy-prober", min(interval, 1.0), round_):
        yield


async def scraper_ctx(app: web.Application) -> AsyncIterator[None]:
    router, session = app[ROUTER], app[SESSION]
    every = app[SETTINGS].proxy.routing.engine_scrape_s
    if every <= 0:
        yield
        return
    limit = max(0.2, min(every, 2.0))

    async def round_() -> None:
        by_url: dict[str, list[Replica]] = {}
        for rep in router.scrape_targets():
            by_url.setdefault(rep.url, []).append(rep)
        if not by_url:
            return
        loads = await asyncio.gather(*(_scrape(session, url, limit) for url in by_url))
        for reps, load in zip(by_url.values(), loads, strict=True):
            for rep in reps:
                router.scraped(rep, load)

    async for _ in _background("scepsy-load-scraper", every, round_):
        yield

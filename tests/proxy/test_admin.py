"""Routes change at run time without dropping a call; removed replicas drain."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai

from tests.proxy.conftest import EngineFactory, ProxyFactory

TOKEN = {"Authorization": "Bearer admin-secret"}


async def _routes(
    url: str, method: str = "GET", json: Any = None, headers: Any = TOKEN
) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, url + "/admin/routes", json=json, headers=headers) as r,
    ):
        return r.status, await r.json(content_type=None)


async def test_admin_needs_the_token(
    proxy_factory: ProxyFactory, engine_factory: EngineFactory
) -> None:
    a = await engine_factory()
    p = await proxy_factory([("m", a.url)], admin_token="admin-secret")
    assert (await _routes(p.url, headers={}))[0] == 401
    assert (await _routes(p.url, headers={"Authorization": "Bearer nope"}))[0] == 401
    status, body = await _routes(p.url)
    assert status == 200 and body["upstreams"][0]["url"] == a.url
    off = await proxy_factory([("m", a.url)])
    assert (await _routes(off.url))[0] == 404


async def test_bad_table_names_the_key_and_changes_nothing(
    proxy_factory: ProxyFactory, engine_factory: EngineFactory
) -> None:
    a = await engine_factory()
    p = await proxy_factory([("m", a.url)], admin_token="admin-secret")
    status, body = await _routes(p.url, "PUT", {"upstreams": [{"model": "m", "url": "ftp://x"}]})
    assert status == 400 and body["error"]["param"] == "upstreams[0].url"
    assert p.router.version == 1


async def test_swap_replicas_under_load_drops_nothing(
    proxy_factory: ProxyFactory, engine_factory: EngineFactory
) -> None:
    old = await engine_factory(name="old", tokens=20)
    new = await engine_factory(name="new", tokens=20)
    p = await proxy_factory([("m", old.url)], admin_token="admin-secret")
    async with openai.AsyncOpenAI(base_url=f"{p.url}/v1", api_key="k", max_retries=0) as client:

        async def one() -> str:
            stream = await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "x"}],
                stream=True,
                extra_headers={"X-Fake-Mode": "slow"},
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        first = [asyncio.create_task(one()) for _ in range(20)]
        while len(old.calls) < 20:  # noqa: ASYNC110 -- wait until all 20 stream from `old`
            await asyncio.sleep(0.005)
        status, body = await _routes(p.url, "PUT", {"upstreams": [{"model": "m", "url": new.url}]})
        assert status == 200
        states = {(u["url"], u["state"]) for u in body["upstreams"]}
        assert (old.url, "draining") in states and (new.url, "active") in states
        second = [asyncio.create_task(one()) for _ in range(20)]
        results = await asyncio.gather(*first, *second)
    assert all(len(r.split()) == 20 for r in results)
    assert len(old.calls) == 20 and len(new.calls) == 20
    status, body = await _routes(p.url)
    assert [u["url"] for u in body["upstreams"]] == [new.url]  # the drained replica is gone
    assert len(await p.records()) == 40

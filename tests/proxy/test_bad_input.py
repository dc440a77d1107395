"""Malformed calls get OpenAI-style 4xx bodies; credentials are handled and never stored."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest

from tests.proxy.conftest import ProxyFactory, ProxyHandle
from tests.proxy.fake_engine import FakeEngine

CHAT = "/v1/chat/completions"


async def _post(
    url: str, data: Any = None, json: Any = None, **kw: Any
) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.post(url, data=data, json=json, **kw) as r:
        return r.status, await r.json(content_type=None)


@pytest.mark.parametrize(
    ("path", "data", "status", "code"),
    [
        (CHAT, b"{not json", 400, "invalid_request"),
        (CHAT, b"[1, 2]", 400, "invalid_request"),
        (CHAT, b'{"messages": []}', 400, "invalid_request"),
        (CHAT, b'{"model": "nope", "messages": []}', 404, "model_not_found"),
        ("/v1/unknown", b'{"model": "nope"}', 404, "not_found"),
    ],
)
async def test_malformed_calls(
    proxy: ProxyHandle, path: str, data: bytes, status: int, code: str
) -> None:
    got, body = await _post(
        proxy.url + path, data=data, headers={"Content-Type": "application/json"}
    )
    assert got == status
    assert (
        set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == code
    )
    assert await proxy.records() == []


async def test_oversized_body_is_413(proxy_factory: ProxyFactory, engine: FakeEngine) -> None:
    p = await proxy_factory([("m", engine.url)], max_body_bytes=2048)
    status, body = await _post(
        p.url + CHAT, json={"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]}
    )
    assert status == 413 and body["error"]["code"] == "request_too_large"


async def test_unknown_post_route_naming_a_known_model_is_forwarded(
    proxy: ProxyHandle, engine: FakeEngine
) -> None:
    status, _ = await _post(proxy.url + "/v1/responses", json={"model": "m", "prompt": "a"})
    assert status == 200 and engine.calls[-1].path == "/v1/responses"
    [rec] = await proxy.records()
    assert rec["endpoint"] == "/v1/responses"


async def test_client_keys_and_upstream_keys(
    proxy_factory: ProxyFactory, engine: FakeEngine
) -> None:
    p = await proxy_factory(
        client_keys=["proxy-key"],
        upstream_docs=[
            {"model": "m", "url": engine.url, "api_key": "engine-key"},
            {"model": "open", "url": engine.url},
        ],
    )
    with pytest.raises(openai.AuthenticationError):
        async with openai.AsyncOpenAI(base_url=f"{p.url}/v1", api_key="wrong", max_retries=0) as c:
            await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    async with openai.AsyncOpenAI(base_url=f"{p.url}/v1", api_key="proxy-key", max_retries=0) as c:
        await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        await c.chat.completions.create(model="open", messages=[{"role": "user", "content": "x"}])
    assert engine.calls[0].headers["Authorization"] == "Bearer engine-key"
    # The proxy's own key is never passed on.
    assert "Authorization" not in engine.calls[1].headers


async def test_secrets_never_reach_the_store(proxy: ProxyHandle, engine: FakeEngine) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "api_key": "sk-secret-1",
        "metadata": {"token": "sk-secret-2"},
    }
    status, _ = await _post(
        proxy.url + CHAT,
        json=body,
        headers={"Authorization": "Bearer sk-secret-3", "api-key": "sk-secret-4"},
    )
    assert status == 200
    assert (
        engine.calls[-1].body["api_key"] == "sk-secret-1"
    )  # the engine still gets the body as sent
    assert "api-key" not in {k.lower() for k in engine.calls[-1].headers}
    [rec] = await proxy.records()
    assert not any("sk-secret" in str(v) for v in rec.values())

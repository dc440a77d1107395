"""Event streams through the proxy, whatever the route: the Responses API with the real openai
client (streamed event by event, usage from ``response.completed`` recorded), and a route the
proxy knows nothing about whose engine answers ``text/event-stream``."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import openai
from openai.types.responses import ResponseCompletedEvent, ResponseStreamEvent

from tests.proxy.conftest import ProxyFactory, ProxyHandle
from tests.proxy.fake_engine import FakeEngine

HEADERS = {"X-Scepsy-Workflow": "agent", "X-Scepsy-Request-Id": "run-1"}


def _aclient(proxy: ProxyHandle) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{proxy.url}/v1", api_key="sk-client", max_retries=0, default_headers=HEADERS
    )


async def test_responses_stream_reaches_the_client_while_the_engine_holds_the_rest(
    proxy: ProxyHandle, engine: FakeEngine
) -> None:
    events: list[ResponseStreamEvent] = []
    async with _aclient(proxy) as client:
        stream = await client.responses.create(
            model="m", input="say some words", stream=True, extra_headers={"X-Fake-Mode": "hold"}
        )
        it = stream.__aiter__()
        # The engine sends its first delta and then waits to be released: a proxy that
        # buffered the stream would let nothing through, and this would time out.
        while not events or events[-1].type != "response.output_text.delta":
            events.append(await asyncio.wait_for(it.__anext__(), 5))
        assert not engine.release.is_set() and engine.in_flight == 1
        engine.release.set()
        events.extend([e async for e in stream])
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and kinds.count("response.output_text.delta") == 5
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "tok0 tok1 tok2 tok3 tok4 "
    last = events[-1]
    assert isinstance(last, ResponseCompletedEvent) and last.response.usage is not None
    assert (last.response.usage.input_tokens, last.response.usage.output_tokens) == (3, 5)
    assert "stream_options" not in engine.calls[-1].body  # the Responses API reports usage
    [rec] = await proxy.records()
    assert (rec["endpoint"], rec["status"], rec["stream"]) == ("/v1/responses", 200, True)
    assert (rec["workflow"], rec["request_id"]) == ("agent", "run-1")
    assert (rec["prompt_tokens"], rec["completion_tokens"], rec["cached_tokens"]) == (3, 5, 2)
    assert rec["t_start"] <= rec["t_first_byte"] < rec["t_end"] and rec["error"] is None


async def test_responses_stream_first_event_comes_long_before_the_last(
    proxy: ProxyHandle,
) -> None:
    """A paced stream (10 ms a token, 40 tokens): the first event arrives at once, not when
    the engine is done."""
    async with _aclient(proxy) as client:
        start = time.monotonic()
        stream = await client.responses.create(
            model="m",
            input="go",
            stream=True,
            extra_headers={"X-Fake-Mode": "slow", "X-Fake-Tokens": "40"},
        )
        first: float | None = None
        async for event in stream:
            if first is None:
                first = time.monotonic() - start
                assert event.type == "response.created"
        total = time.monotonic() - start
    assert first is not None and total >= 0.4 and first < total / 4
    [rec] = await proxy.records()
    assert rec["completion_tokens"] == 40
    assert rec["t_first_byte"] - rec["t_start"] < (rec["t_end"] - rec["t_start"]) / 4


async def test_responses_whole_answer_records_usage(proxy: ProxyHandle) -> None:
    async with _aclient(proxy) as client:
        out = await client.responses.create(model="m", input="one two")
    assert out.output_text == "tok0 tok1 tok2 tok3 tok4 "
    assert out.usage is not None and out.usage.output_tokens == 5
    [rec] = await proxy.records()
    assert (rec["endpoint"], rec["stream"]) == ("/v1/responses", False)
    assert (rec["prompt_tokens"], rec["completion_tokens"], rec["cached_tokens"]) == (2, 5, 2)


async def _read_sse(url: str, body: dict[str, Any], headers: dict[str, str]) -> bytes:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, json=body, headers=headers) as r,
    ):
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        return await r.read()


async def test_responses_stream_error_event_is_recorded(proxy: ProxyHandle) -> None:
    body = {"model": "m", "input": "x", "stream": True}
    data = await _read_sse(f"{proxy.url}/v1/responses", body, {"X-Fake-Mode": "error_event"})
    assert b"event: error\n" in data and b"KV cache exhausted" in data
    assert b"response.completed" not in data
    [rec] = await proxy.records()
    assert rec["error"] == "upstream error event: KV cache exhausted"
    assert rec["completion_tokens"] is None  # never reported: unknown, not zero


async def test_responses_stream_cut_ends_with_an_error_event(proxy: ProxyHandle) -> None:
    body = {"model": "m", "input": "x", "stream": True}
    data = await _read_sse(f"{proxy.url}/v1/responses", body, {"X-Fake-Mode": "cut"})
    assert data.count(b"event: response.output_text.delta\n") == 2
    assert data.endswith(b"\n\n") and b'"code":"upstream_error"' in data.rsplit(b"data: ", 1)[1]
    [rec] = await proxy.records()
    assert rec["error"].startswith("upstream stream cut") and rec["stream"] is True


async def test_any_route_answered_as_an_event_stream_is_streamed(
    proxy_factory: ProxyFactory, engine: FakeEngine
) -> None:
    """A route the proxy has no table entry for (allowed by ``proxy.extra_routes``): the
    engine's event stream is relayed as it comes, not buffered."""
    proxy = await proxy_factory([("m", engine.url)], extra_routes=["/v1/brand/new"])
    body = {"model": "m", "prompt": "a b", "stream": True}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{proxy.url}/v1/brand/new", json=body, headers={"X-Fake-Mode": "hold"}) as r,
    ):
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 5)
        assert b"tok0" in first and not engine.release.is_set()
        engine.release.set()
        rest = await r.read()
    assert rest.endswith(b"data: [DONE]\n\n")
    [rec] = await proxy.records()
    assert (rec["endpoint"], rec["stream"], rec["status"]) == ("/v1/brand/new", True, 200)
    assert rec["t_first_byte"] < rec["t_end"]

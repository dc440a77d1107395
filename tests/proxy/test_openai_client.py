"""The real openai client through the proxy to a fake vLLM replica: what the client gets and
what the store holds."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.proxy.conftest import ProxyHandle
from tests.proxy.fake_engine import FakeEngine

HEADERS = {"X-Scepsy-Workflow": "rag", "X-Scepsy-Request-Id": "req-1"}


def _client(proxy: ProxyHandle) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{proxy.url}/v1", api_key="sk-client", max_retries=0, default_headers=HEADERS
    )


def _aclient(proxy: ProxyHandle) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{proxy.url}/v1", api_key="sk-client", max_retries=0, default_headers=HEADERS
    )


async def test_sync_chat_non_streaming(proxy: ProxyHandle, engine: FakeEngine) -> None:
    def call() -> openai.types.chat.ChatCompletion:
        with _client(proxy) as client:
            return client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5
            )

    out = await asyncio.to_thread(call)
    assert out.choices[0].message.content == "e1: tok0 tok1 tok2 tok3 tok4"
    assert out.usage is not None and out.usage.completion_tokens == 5
    seen = engine.calls[-1]
    assert seen.headers["Authorization"] == "Bearer sk-client"
    assert not any(k.lower().startswith("x-scepsy") for k in seen.headers)
    [rec] = await proxy.records()
    assert (rec["workflow"], rec["request_id"], rec["model"]) == ("rag", "req-1", "m")
    assert rec["endpoint"] == "/v1/chat/completions" and rec["status"] == 200
    assert (rec["prompt_tokens"], rec["completion_tokens"], rec["cached_tokens"]) == (10, 5, 2)
    assert rec["t_start"] <= rec["t_first_byte"] <= rec["t_end"]
    assert rec["upstream"] == engine.url and rec["stream"] is False
    assert '"messages"' in rec["body"] and "sk-client" not in rec["body"]


async def test_async_stream_without_usage_strips_the_extra_event(
    proxy: ProxyHandle, engine: FakeEngine
) -> None:
    async with _aclient(proxy) as client:
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        "tok0 tok1 tok2 tok3 tok4 "
    )
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)
    assert engine.calls[-1].body["stream_options"] == {"include_usage": True}
    [rec] = await proxy.records()
    assert rec["stream"] is True and rec["prompt_tokens"] == 10 and rec["completion_tokens"] == 5
    assert rec["t_first_byte"] is not None and rec["error"] is None
    assert "stream_options" not in rec["body"]  # the client's body, not the rewritten one


async def test_async_stream_with_usage_keeps_it(proxy: ProxyHandle) -> None:
    async with _aclient(proxy) as client:
        stream = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    [rec] = await proxy.records()
    assert rec["completion_tokens"] == 5


async def test_sync_completions_stream(proxy: ProxyHandle) -> None:
    def call() -> str:
        with _client(proxy) as client:
            stream = client.completions.create(model="m", prompt="one two three", stream=True)
            return "".join(c.choices[0].text for c in stream if c.choices)

    assert await asyncio.to_thread(call) == "tok0 tok1 tok2 tok3 tok4 "
    [rec] = await proxy.records()
    assert rec["endpoint"] == "/v1/completions" and rec["prompt_tokens"] == 3


async def test_embeddings_and_rerank(proxy: ProxyHandle) -> None:
    async with _aclient(proxy) as client:
        emb = await client.embeddings.create(model="emb", input=["query: a b", "c"])
        assert len(emb.data) == 2
        ranked = await client.post(
            "/rerank",
            cast_to=object,
            body={"model": "rr", "query": "q", "documents": ["a", "b", "c"], "top_n": 2},
        )
    assert isinstance(ranked, dict) and [r["index"] for r in ranked["results"]] == [0, 1]
    recs = await proxy.records()
    assert [(r["model"], r["endpoint"]) for r in recs] == [
        ("emb", "/v1/embeddings"),
        ("rr", "/v1/rerank"),
    ]
    assert recs[0]["prompt_tokens"] == 4 and recs[1]["prompt_tokens"] == 21


async def test_stream_cut_midway(proxy: ProxyHandle) -> None:
    async with _aclient(proxy) as client:
        stream = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_headers={"X-Fake-Mode": "cut"},
        )
        got: list[str] = []
        with pytest.raises(openai.APIError):
            async for c in stream:
                got.append(c.choices[0].delta.content or "")
    assert "".join(got) == "tok0 tok1 "
    [rec] = await proxy.records()
    assert rec["error"].startswith("upstream stream cut")
    assert rec["completion_tokens"] is None  # unknown, not zero


async def test_mid_stream_error_event_passes_through(proxy: ProxyHandle) -> None:
    async with _aclient(proxy) as client:
        stream = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_headers={"X-Fake-Mode": "error_event"},
        )
        with pytest.raises(openai.APIError, match="KV cache exhausted"):
            async for _ in stream:
                pass
    [rec] = await proxy.records()
    assert rec["status"] == 200 and "KV cache exhausted" in rec["error"]


async def test_upstream_error_passes_through_unchanged(proxy: ProxyHandle) -> None:
    async with _aclient(proxy) as client:
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "hi"}],
                extra_headers={"X-Fake-Mode": "status500"},
            )
    assert info.value.status_code == 500
    assert info.value.body == {
        "message": "engine exploded",
        "type": "InternalServerError",
        "code": 500,
    }
    [rec] = await proxy.records()
    assert rec["status"] == 500 and "engine exploded" in rec["error"]


async def test_models_are_merged(proxy_factory, engine_factory) -> None:  # type: ignore[no-untyped-def]
    a = await engine_factory(name="a", models=("m",))
    b = await engine_factory(name="b", models=("x",))
    p = await proxy_factory([("m", a.url), ("x", b.url), ("m", b.url)])
    async with openai.AsyncOpenAI(base_url=f"{p.url}/v1", api_key="k") as client:
        models = await client.models.list()
    ids = sorted(m.id for m in models.data)
    assert ids == ["m", "x"]
    assert all(getattr(m, "max_model_len", None) == 4096 for m in models.data)

"""The real ``openai`` client (sync and async) against an in-process ``scepsy-engine``."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from sim.emulator import DRIVER_TASK
from sim.emulator_server import RunningEmulator, serving
from sim.serving import EmulatorConfig

FAST = 1000.0  # model seconds per wall second: tests stay fast, pacing still runs
QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is 2 + 2? Think step by step."}
]


@pytest.fixture
async def gen() -> AsyncIterator[RunningEmulator]:
    async with serving(EmulatorConfig(model="llama-3.2-1b", speedup=FAST, seed=7)) as server:
        yield server


@pytest.fixture
async def embedder() -> AsyncIterator[RunningEmulator]:
    async with serving(EmulatorConfig(model="e5-base-v2", speedup=FAST)) as server:
        yield server


@pytest.fixture
async def reranker() -> AsyncIterator[RunningEmulator]:
    async with serving(EmulatorConfig(model="bge-reranker-base", speedup=FAST)) as server:
        yield server


def client(server: RunningEmulator) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)


async def test_chat_non_streaming_n_and_stop(gen: RunningEmulator) -> None:
    resp = await client(gen).chat.completions.create(
        model="llama-3.2-1b", messages=QUESTION, n=3, stop=["\n\n"], max_tokens=2048, seed=1
    )
    assert resp.system_fingerprint == "scepsy-emulated"
    assert [c.index for c in resp.choices] == [0, 1, 2]
    texts = [c.message.content or "" for c in resp.choices]
    assert len(set(texts)) == 3 and all(t and "\n\n" not in t for t in texts)
    for c in resp.choices:
        assert c.finish_reason == "stop"
        assert (c.model_extra or {}).get("stop_reason") in ("\n\n", None)
    assert resp.usage is not None and resp.usage.completion_tokens >= 3
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.usage.prompt_tokens_details is not None


async def test_same_request_and_seed_give_same_text(gen: RunningEmulator) -> None:
    c = client(gen)
    args: Any = {"model": "llama-3.2-1b", "messages": QUESTION, "max_tokens": 200, "seed": 42}
    a, b = [await c.chat.completions.create(**args) for _ in range(2)]
    other = await c.chat.completions.create(**{**args, "seed": 43})
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.content != other.choices[0].message.content


async def test_max_tokens_cuts_with_length(gen: RunningEmulator) -> None:
    resp = await client(gen).chat.completions.create(
        model="llama-3.2-1b", messages=QUESTION, max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 5


async def test_user_stop_string_ends_generation(gen: RunningEmulator) -> None:
    c = client(gen)
    base = await c.completions.create(
        model="llama-3.2-1b",
        prompt="Count:",
        max_tokens=300,
        seed=5,
        extra_body={"ignore_eos": True},
    )
    full = base.choices[0].text
    word = full.split()[3]
    cut = await c.completions.create(
        model="llama-3.2-1b",
        prompt="Count:",
        max_tokens=300,
        seed=5,
        stop=[word],
        extra_body={"ignore_eos": True},
    )
    assert cut.choices[0].text == full[: full.index(word)]
    assert cut.choices[0].finish_reason == "stop"


async def test_streaming_matches_non_streaming_and_reports_usage(gen: RunningEmulator) -> None:
    c = client(gen)
    args: Any = {
        "model": "llama-3.2-1b",
        "messages": QUESTION,
        "max_tokens": 300,
        "seed": 9,
        "stop": ["\n\n"],
        "n": 2,
    }
    whole = await c.chat.completions.create(**args)
    stream = await c.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    )
    texts, finishes, usage, events = ["", ""], [None, None], None, 0
    async for chunk in stream:
        events += 1
        assert chunk.system_fingerprint == "scepsy-emulated"
        if not chunk.choices:
            usage = chunk.usage
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            finishes[ch.index] = ch.finish_reason or finishes[ch.index]
    assert texts == [ch.message.content for ch in whole.choices]
    assert finishes == [ch.finish_reason for ch in whole.choices]
    assert usage is not None and whole.usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert events >= usage.completion_tokens  # token by token


async def test_stream_usage_opt_in_and_vllm_empty_options(gen: RunningEmulator) -> None:
    async def usage_events(options: object) -> int:
        body = {"model": "llama-3.2-1b", "messages": QUESTION, "max_tokens": 4, "stream": True}
        if options is not None:
            body["stream_options"] = options
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{gen.base_url}/chat/completions", json=body) as r,
        ):
            assert r.headers["X-Scepsy-Emulated"] == "1"
            raw = (await r.read()).decode()
        assert raw.rstrip().endswith("data: [DONE]")
        return raw.count('"choices":[]')

    assert await usage_events(None) == 0
    assert await usage_events({}) == 1  # vLLM: {} means include
    assert await usage_events({"include_usage": False}) == 0


async def test_completions_streaming(gen: RunningEmulator) -> None:
    c = client(gen)
    whole = await c.completions.create(model="llama-3.2-1b", prompt="Once", max_tokens=20, seed=3)
    text = ""
    async for chunk in await c.completions.create(
        model="llama-3.2-1b", prompt="Once", max_tokens=20, seed=3, stream=True
    ):
        text += "".join(ch.text for ch in chunk.choices)
    assert text == whole.choices[0].text and whole.object == "text_completion"


async def test_prm_style_scoring_returns_plus_and_minus(gen: RunningEmulator) -> None:
    c = client(gen)
    msgs: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Problem.\n\nStep one: add the numbers."}
    ]
    probs = []
    for _ in range(2):
        resp = await c.chat.completions.create(
            model="llama-3.2-1b", messages=msgs, max_tokens=1, logprobs=True, top_logprobs=5
        )
        lp = resp.choices[0].logprobs
        assert lp is not None and lp.content is not None and len(lp.content) == 1
        top = {t.token: math.exp(t.logprob) for t in lp.content[0].top_logprobs}
        assert {"+", "-"} <= set(top) and len(top) == 5
        assert lp.content[0].token in ("+", "-")
        probs.append(top["+"] / (top["+"] + top["-"]))
    assert probs[0] == probs[1] and 0 < probs[0] < 1


async def test_logprobs_on_longer_generation(gen: RunningEmulator) -> None:
    resp = await client(gen).chat.completions.create(
        model="llama-3.2-1b",
        messages=QUESTION,
        max_tokens=8,
        logprobs=True,
        top_logprobs=3,
        seed=2,
        extra_body={"ignore_eos": True},
    )
    assert resp.choices[0].logprobs is not None
    content = resp.choices[0].logprobs.content
    assert content is not None and len(content) == 8
    assert "".join(t.token for t in content) == resp.choices[0].message.content
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token for t in content)


async def test_continue_final_message_continues_the_assistant(gen: RunningEmulator) -> None:
    c = client(gen)
    msgs: list[ChatCompletionMessageParam] = [
        *QUESTION,
        {"role": "assistant", "content": "## Step 1: add"},
    ]
    resp = await c.chat.completions.create(
        model="llama-3.2-1b",
        messages=msgs,
        max_tokens=10,
        seed=1,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert resp.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as err:  # vLLM refuses both at once
        await c.chat.completions.create(
            model="llama-3.2-1b", messages=msgs, extra_body={"continue_final_message": True}
        )
    err_body: Any = err.value.body
    assert err_body["param"] == "continue_final_message"


async def test_sync_client_in_a_thread(gen: RunningEmulator) -> None:
    def call() -> tuple[str, list[str]]:
        sync = openai.OpenAI(base_url=gen.base_url, api_key="x", max_retries=0)
        whole = sync.chat.completions.create(
            model="llama-3.2-1b", messages=QUESTION, max_tokens=12, seed=4
        )
        stream: Any = sync.chat.completions.create(
            model="llama-3.2-1b", messages=QUESTION, max_tokens=12, seed=4, stream=True
        )
        parts = [ch.choices[0].delta.content or "" for ch in stream if ch.choices]
        return whole.choices[0].message.content or "", parts

    text, parts = await asyncio.to_thread(call)
    assert "".join(parts) == text and len(parts) >= 12


async def test_errors_are_openai_shaped(gen: RunningEmulator) -> None:
    c = client(gen)
    with pytest.raises(openai.NotFoundError) as nf:
        await c.chat.completions.create(model="gpt-nope", messages=QUESTION)
    nf_body: Any = nf.value.body
    assert nf_body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as bad:
        await c.chat.completions.create(model="llama-3.2-1b", messages=QUESTION, n=0)
    body: Any = bad.value.body
    assert set(body) >= {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError):
        await c.embeddings.create(model="llama-3.2-1b", input="a generate model cannot embed")
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{gen.base_url}/chat/completions", data=b"{not json") as r,
    ):
        assert r.status == 400 and "error" in await r.json()


async def test_models_health_and_metrics(gen: RunningEmulator) -> None:
    c = client(gen)
    models = await c.models.list()
    assert [m.id for m in models.data] == ["llama-3.2-1b"]
    await c.chat.completions.create(model="llama-3.2-1b", messages=QUESTION, max_tokens=3)
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{gen.url}/health") as r:
            assert r.status == 200
        async with s.get(f"{gen.url}/metrics") as r:
            text = await r.text()
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
        "scepsy_emulator_clock_lag_ratio",
    ):
        assert f"{name}{{" in text, name
    assert 'model_name="llama-3.2-1b"' in text
    assert 'vllm:e2e_request_latency_seconds_count{model_name="llama-3.2-1b"} 1.0' in text


async def test_embeddings_similar_texts_score_higher(embedder: RunningEmulator) -> None:
    c = client(embedder)
    resp = await c.embeddings.create(
        model="e5-base-v2",
        input=[
            "query: how many prime numbers are below one hundred",
            "passage: there are 25 prime numbers below one hundred",
            "passage: the castle moat was filled with water during the siege",
        ],
    )
    vecs = [d.embedding for d in resp.data]  # the SDK asked for base64 and decoded it
    assert all(len(v) == 768 and abs(sum(x * x for x in v) - 1) < 1e-4 for v in vecs)

    def dot(a: list[float], b: list[float]) -> float:
        return sum(x * y for x, y in zip(a, b, strict=True))

    assert dot(vecs[0], vecs[1]) > dot(vecs[0], vecs[2]) + 0.2
    again = await c.embeddings.create(
        model="e5-base-v2",
        input="passage: there are 25 prime numbers below one hundred",
        encoding_format="float",
    )
    assert again.data[0].embedding == pytest.approx(vecs[1], abs=1e-6)
    assert resp.usage.prompt_tokens > 10


async def test_rerank_via_client_post_sorted_and_cut(reranker: RunningEmulator) -> None:
    c = client(reranker)
    docs = [
        "Paris is the capital of France.",
        "Bananas are yellow.",
        "France has Paris as its capital city.",
        "Submarines use sonar.",
    ]
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):  # base_url ends in /v1
        url = path if path == "/rerank" else f"{reranker.url}{path}"
        out: Any = await c.post(
            url,
            cast_to=object,
            body={
                "model": "bge-reranker-base",
                "query": "What is the capital of France?",
                "documents": docs,
                "top_n": 2,
            },
        )
        scores = [r["relevance_score"] for r in out["results"]]
        assert scores == sorted(scores, reverse=True) and len(scores) == 2
        assert {r["index"] for r in out["results"]} == {0, 2}
        assert out["results"][0]["document"]["text"] in docs


async def test_score_and_pooling(reranker: RunningEmulator, gen: RunningEmulator) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"{reranker.url}/score",
            json={
                "model": "bge-reranker-base",
                "text_1": "capital of France",
                "text_2": ["Paris is the capital of France", "bananas are yellow"],
            },
        ) as r:
            data = (await r.json())["data"]
        assert data[0]["score"] > data[1]["score"]
        async with s.post(
            f"{gen.url}/pooling", json={"model": "llama-3.2-1b", "input": "step one"}
        ) as r:
            pooled = (await r.json())["data"][0]["data"]
        assert len(pooled) == 2 and sum(pooled) == pytest.approx(1.0)


async def test_usage_reports_prefix_cache_hits(gen: RunningEmulator) -> None:
    c = client(gen)
    long_context: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "You solve problems. " * 60},
        *QUESTION,
    ]
    first = await c.chat.completions.create(
        model="llama-3.2-1b", messages=long_context, max_tokens=2, seed=1
    )
    again = await c.chat.completions.create(
        model="llama-3.2-1b", messages=long_context, max_tokens=2, seed=2
    )
    assert first.usage is not None and again.usage is not None
    assert again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens or 0
    assert 0 < cached < again.usage.prompt_tokens  # all but the last block came from the cache


async def test_client_gone_mid_stream_aborts_in_the_core() -> None:
    async with serving(EmulatorConfig(model="llama-3.2-1b", speedup=5.0)) as slow:
        body = {
            "model": "llama-3.2-1b",
            "messages": QUESTION,
            "max_tokens": 5000,
            "stream": True,
            "ignore_eos": True,
        }
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{slow.base_url}/chat/completions", json=body) as r:
                await r.content.readline()  # the role event: the request is in the core
                assert slow.engine.driver.core.has_work()
        for _ in range(100):  # the closed connection reaches the handler within a few steps
            if not slow.engine.driver.core.has_work():
                break
            await asyncio.sleep(0.01)
        assert not slow.engine.driver.core.has_work() and not slow.engine.driver.tickets


async def test_health_is_503_once_the_driver_died(gen: RunningEmulator) -> None:
    task = gen.app[DRIVER_TASK]
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    async with aiohttp.ClientSession() as s, s.get(f"{gen.url}/health") as r:
        assert r.status == 503


async def test_api_key_guards_v1_routes_only() -> None:
    async with serving(EmulatorConfig(model="e5-base-v2", speedup=FAST, api_key="k")) as srv:
        with pytest.raises(openai.AuthenticationError):
            await client(srv).embeddings.create(model="e5-base-v2", input="hi")
        good = openai.AsyncOpenAI(base_url=srv.base_url, api_key="k", max_retries=0)
        assert (await good.embeddings.create(model="e5-base-v2", input="hi")).data
        async with aiohttp.ClientSession() as s, s.get(f"{srv.url}/health") as r:
            assert r.status == 200


async def test_a_prompt_beyond_the_kv_cache_is_refused_cleanly() -> None:
    tight = EmulatorConfig(model="llama-3-8b", gpu="a6000", share=0.4, speedup=FAST)
    async with serving(tight) as srv:
        huge: list[ChatCompletionMessageParam] = [{"role": "user", "content": "word " * 3000}]
        with pytest.raises(openai.BadRequestError, match="KV cache"):
            await client(srv).chat.completions.create(
                model="llama-3-8b", messages=huge, max_tokens=4
            )
        assert not srv.engine.driver.tickets and not srv.engine.driver.core.has_work()
        ok = await client(srv).chat.completions.create(
            model="llama-3-8b", messages=QUESTION, max_tokens=4
        )
        assert ok.choices[0].message.content

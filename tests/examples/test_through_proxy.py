"""Both agent apps, and LangChain's ChatOpenAI, through the proxy in front of emulated engines:
what the store then holds per workflow request."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from examples.beam_search import PROBLEMS, BeamConfig, solve
from examples.endpoints import Endpoints
from examples.passages import passages, questions
from examples.rag_rerank import RagConfig, answer, build_index
from shared.settings import settings_from_mapping
from sim.emulator_server import serving_many
from sim.serving import EmulatorConfig
from tests.proxy.conftest import ProxyHandle, start_proxy

MODELS = ("llama-3.2-1b", "llama-3.1-8b-prm", "e5-base-v2", "bge-reranker-base", "llama-3-8b")


@pytest.fixture
async def proxy(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[ProxyHandle]:
    # Emulated time runs 2000x faster unless a test asks for less (indirect parametrisation).
    speedup = float(getattr(request, "param", 2000.0))
    configs = [EmulatorConfig(model=m, speedup=speedup) for m in MODELS]
    async with serving_many(configs) as servers:
        ups = [{"model": m, "url": s.base_url.removesuffix("/v1")} for m, s in servers.items()]
        settings = settings_from_mapping(
            {
                "proxy": {"listen": "127.0.0.1:0", "proxy_id": "ex", "upstreams": ups},
                "store": {"path": str(tmp_path / "store"), "flush_interval_s": 60.0},
            }
        )
        handle = await start_proxy(settings)
        try:
            yield handle
        finally:
            await handle.stop()


def _of(recs: list[dict[str, Any]], rid: str) -> list[dict[str, Any]]:
    return sorted((r for r in recs if r["request_id"] == rid), key=lambda r: r["t_start"])


async def test_rag_through_the_proxy_records_embed_rerank_chat_in_order(proxy: ProxyHandle) -> None:
    endpoints = Endpoints(f"{proxy.url}/v1", max_retries=0)
    cfg = RagConfig()
    try:
        index = await build_index(endpoints, cfg, passages(120, seed=2), batch=60)
        for i, q in enumerate(questions(3, seed=2)):
            await answer(endpoints, index, q.text, cfg, request_id=f"rag-{i}")
    finally:
        await endpoints.close()
    recs = await proxy.records()
    for i in range(3):
        calls = _of(recs, f"rag-{i}")
        assert [(c["model"], c["endpoint"]) for c in calls] == [
            ("e5-base-v2", "/v1/embeddings"),
            ("bge-reranker-base", "/v1/rerank"),
            ("llama-3-8b", "/v1/chat/completions"),
        ]
        assert {c["workflow"] for c in calls} == {"rag"}
        assert all(c["status"] == 200 and c["prompt_tokens"] for c in calls)
        # Strictly in sequence: each call starts after the previous one ended.
        assert all(a["t_end"] <= b["t_start"] for a, b in itertools.pairwise(calls))


# At 2000x a generator call lasts about a millisecond, and on a loaded machine the first of
# an iteration's calls could end before the last one started: the overlap checked below would
# then depend on the scheduler. At 50x a call lasts tens of milliseconds.
@pytest.mark.parametrize("proxy", [50.0], indirect=True)
async def test_beam_through_the_proxy_fans_out_within_each_iteration(proxy: ProxyHandle) -> None:
    endpoints = Endpoints(f"{proxy.url}/v1", max_retries=0)
    cfg = BeamConfig(n=4, width=2, iterations=4)
    try:
        result = await solve(endpoints, PROBLEMS[1], cfg, request_id="beam-1", seed=5)
    finally:
        await endpoints.close()
    calls = _of(await proxy.records(), "beam-1")
    assert len(calls) == 8 * result.iterations and {c["workflow"] for c in calls} == {"beam"}
    for it in range(result.iterations):
        block = calls[8 * it : 8 * it + 8]
        gen = [c for c in block if c["model"] == "llama-3.2-1b"]
        ver = [c for c in block if c["model"] == "llama-3.1-8b-prm"]
        assert len(gen) == len(ver) == 4
        for group in (gen, ver):  # the n calls of one kind overlap in time
            assert max(c["t_start"] for c in group) < min(c["t_end"] for c in group)
        assert max(c["t_end"] for c in gen) <= min(c["t_start"] for c in ver)
        assert all(c["completion_tokens"] == 1 for c in ver)


async def test_langchain_chat_openai_through_the_proxy(proxy: ProxyHandle) -> None:
    from langchain_openai import ChatOpenAI

    # Keyword arguments as a user passes them; their declared types move between
    # langchain-openai releases (aliases, SecretStr), which is not what this test checks.
    options: dict[str, Any] = {
        "base_url": f"{proxy.url}/v1",
        "api_key": "EMPTY",
        "model": "llama-3-8b",
        "max_tokens": 8,
        "temperature": 0,
        "max_retries": 0,
        "default_headers": {"X-Scepsy-Workflow": "lc", "X-Scepsy-Request-Id": "lc-1"},
    }
    llm = ChatOpenAI(**options)
    out = await llm.ainvoke("Say something.")
    assert isinstance(out.content, str) and out.content
    chunks = [c async for c in llm.astream("Stream something.")]
    assert "".join(str(c.content) for c in chunks)
    # LangChain turns stream usage off behind a base_url; the proxy asked for it anyway.
    assert all(not getattr(c, "usage_metadata", None) for c in chunks)
    recs = _of(await proxy.records(), "lc-1")
    assert [r["stream"] for r in recs] == [False, True]
    assert all(r["workflow"] == "lc" and r["completion_tokens"] for r in recs)

"""The agent apps end to end against emulated engines, one per model, each on its own port."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from aiohttp import web

from examples import load
from examples.agent_loop import TASKS as AGENT_TASKS
from examples.agent_loop import AgentConfig
from examples.agent_loop import run as agent_run
from examples.beam_search import PROBLEMS, BeamConfig, solve
from examples.endpoints import REQUEST_HEADER, WORKFLOW_HEADER, Endpoints
from examples.passages import passages, questions, topic_of
from examples.rag_rerank import RagConfig, answer, build_index
from sim.emulator_server import RunningEmulator, serving_many
from sim.serving import EmulatorConfig

MODELS = ("llama-3.2-1b", "llama-3.1-8b-prm", "e5-base-v2", "bge-reranker-base", "llama-3-8b")


@dataclass(frozen=True)
class Seen:
    order: int
    model_port: int
    path: str
    workflow: str | None
    request_id: str | None


@dataclass
class Cluster:
    servers: dict[str, RunningEmulator]
    seen: list[Seen]

    def endpoints(self) -> Endpoints:
        return Endpoints(
            "http://127.0.0.1:9/v1",  # nothing listens there: every model is mapped
            {m: s.base_url for m, s in self.servers.items()},
            max_retries=0,
        )

    def model_of(self, seen: Seen) -> str:
        return next(m for m, s in self.servers.items() if s.port == seen.model_port)


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    seen: list[Seen] = []
    counter = itertools.count()

    def observe(request: web.Request) -> None:
        port = request.url.port or 0
        seen.append(
            Seen(
                next(counter),
                port,
                request.path,
                request.headers.get(WORKFLOW_HEADER),
                request.headers.get(REQUEST_HEADER),
            )
        )

    configs = [EmulatorConfig(model=m, speedup=2000.0) for m in MODELS]
    async with serving_many(configs, observe=observe) as servers:
        yield Cluster(servers, seen)


async def test_beam_search_tags_calls_and_fans_out(cluster: Cluster) -> None:
    endpoints = cluster.endpoints()
    cfg = BeamConfig(n=4, width=2, iterations=6)
    try:
        result = await solve(endpoints, PROBLEMS[0], cfg, request_id="req-1", seed=3)
    finally:
        await endpoints.close()
    assert 1 <= result.iterations <= 6
    assert result.generator_calls == result.verifier_calls == 4 * result.iterations
    calls = [s for s in cluster.seen if s.request_id == "req-1"]
    assert len(calls) == 8 * result.iterations and {s.workflow for s in calls} == {"beam"}
    models = [cluster.model_of(s) for s in calls]
    assert models.count("llama-3.2-1b") == models.count("llama-3.1-8b-prm")
    # Each iteration: its n generator calls, then its n verifier calls.
    for it in range(result.iterations):
        block = models[8 * it : 8 * it + 8]
        assert block == ["llama-3.2-1b"] * 4 + ["llama-3.1-8b-prm"] * 4
    assert 0.0 < result.score < 1.0 and result.answer


async def test_rag_calls_embed_rerank_chat_in_order_and_retrieves(cluster: Cluster) -> None:
    endpoints = cluster.endpoints()
    cfg = RagConfig()
    asked = questions(4, seed=1)
    try:
        index = await build_index(endpoints, cfg, passages(240, seed=1), batch=100)
        results = [
            await answer(endpoints, index, q.text, cfg, request_id=f"rag-{i}")
            for i, q in enumerate(asked)
        ]
    finally:
        await endpoints.close()
    on_topic = 0
    for i, (q, r) in enumerate(zip(asked, results, strict=True)):
        calls = [s for s in cluster.seen if s.request_id == f"rag-{i}"]
        assert [cluster.model_of(s) for s in calls] == [
            "e5-base-v2",
            "bge-reranker-base",
            "llama-3-8b",
        ]
        assert [s.path for s in calls] == ["/v1/embeddings", "/v1/rerank", "/v1/chat/completions"]
        assert {s.workflow for s in calls} == {"rag"}
        assert len(r.passages) == 5 and r.answer
        on_topic += sum(topic_of(index.texts[p]) == q.topic for p in r.passages)
    assert on_topic >= 0.8 * 5 * len(asked)  # similarity search and reranking find the topic
    index_calls = [s for s in cluster.seen if s.workflow == "rag-index"]
    assert len(index_calls) == 3 and len({s.request_id for s in index_calls}) == 1


def _args(cluster: Cluster, **over: object) -> argparse.Namespace:
    argv = ["--base-url", "http://127.0.0.1:9/v1", "--duration", "0.6", "--passages", "120"]
    for model, server in cluster.servers.items():
        argv += ["--model-url", f"{model}={server.base_url}"]
    args = load.parser().parse_args(argv)
    for key, value in over.items():
        setattr(args, key, value)
    return args


async def test_load_reports_both_workflows(cluster: Cluster) -> None:
    report = await load.run(_args(cluster, workflow="beam,rag", rate="4,8", iterations=3))
    assert set(report["workflows"]) == {"beam", "rag"}
    for name in ("beam", "rag"):
        w = report["workflows"][name]
        assert w["started"] >= 1 and w["completed"] == w["started"] and w["failed"] == 0
        assert w["throughput_rps"] > 0
        assert w["latency_s"]["p50"] <= w["latency_s"]["p99"] <= w["latency_s"]["max"]
    beam_ids = {s.request_id for s in cluster.seen if s.workflow == "beam"}
    assert len(beam_ids) == report["workflows"]["beam"]["started"]


async def test_load_counts_failures(cluster: Cluster) -> None:
    args = _args(cluster, workflow="rag", rate="8", rag_generator="no-such-model")
    args.model_url.append(f"no-such-model={cluster.servers['llama-3-8b'].base_url}")
    report = await load.run(args)  # the engine answers 404: the model is not served there
    w = report["workflows"]["rag"]
    assert w["completed"] == 0 and w["failed"] == w["started"] >= 1
    assert w["failures"] == {"NotFoundError": w["started"]} and w["latency_s"] == {}


async def _cli(module: str, cluster: Cluster, *extra: str) -> dict[str, object]:
    argv = [sys.executable, "-m", module, "--base-url", "http://127.0.0.1:9/v1", *extra]
    for model, server in cluster.servers.items():
        argv += ["--model-url", f"{model}={server.base_url}"]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=40)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    result: dict[str, object] = json.loads(out)
    return result


@pytest.mark.slow  # two interpreter start-ups (openai, numpy): ~3-6 s
async def test_examples_run_once_from_the_command_line(cluster: Cluster) -> None:
    beam, rag = await asyncio.gather(
        _cli("examples.beam_search", cluster, "--iterations", "3", "--n", "4"),
        _cli("examples.rag_rerank", cluster, "--passages", "60"),
    )
    assert beam["generator_calls"] == beam["verifier_calls"] == 4 * int(str(beam["iterations"]))
    assert rag["answer"] and len(rag["passages"]) == 5  # type: ignore[arg-type]
    workflows = {s.workflow for s in cluster.seen}
    assert {"beam", "rag", "rag-index"} <= workflows


async def test_agent_loop_plans_in_sequence_and_fans_out_beside_its_tool(cluster: Cluster) -> None:
    endpoints = cluster.endpoints()
    cfg = AgentConfig(min_steps=3, max_steps=5, p_stop=0.0, p_fan_out=1.0, fan_out=3, tool_s=0.01)
    try:
        result = await agent_run(endpoints, AGENT_TASKS[0], cfg, request_id="agent-1", seed=2)
    finally:
        await endpoints.close()
    calls = [s for s in cluster.seen if s.request_id == "agent-1"]
    assert {s.workflow for s in calls} == {"agent"}
    models = [cluster.model_of(s) for s in calls]
    # p_stop 0: every step but the last fans out; the last planner call ends the run.
    assert result.steps == result.planner_calls == 5 and result.worker_calls == 3 * 4
    assert models == (["llama-3-8b"] + ["llama-3.2-1b"] * 3) * 4 + ["llama-3-8b"]
    assert result.tool_s > 0 and result.latency_s > 0


async def test_load_runs_the_agent_workflow(cluster: Cluster) -> None:
    report = await load.run(_args(cluster, workflow="agent", rate="6", max_steps=3, tool_s=0.01))
    w = report["workflows"]["agent"]
    assert w["started"] >= 1 and w["completed"] == w["started"] and w["failed"] == 0

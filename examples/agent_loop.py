"""A tool-using agent: a planner loop with tool time, and fan-outs to a small worker model.

Role: an agent app as a user writes it, with the plain ``openai`` SDK, of the kind the optimizer
was not tuned on. Each step, the planner (an 8B chat model) reads the transcript so far and
picks an action; the app then either runs a tool (time outside any LLM call), or fans out
``fan_out`` calls to a small worker model in parallel *while* a tool runs beside them (a search
whose results the workers summarise as they arrive), and appends the result to the transcript.
The loop ends when the planner is done (after ``min_steps``, with probability ``p_stop`` per
step) or after ``max_steps``. Every call of one run carries ``X-Scepsy-Workflow: agent`` and one
fresh request id.

    python -m examples.agent_loop --base-url http://127.0.0.1:8080/v1 [--max-steps 6]

Invariants: the planner's calls of one run are sequential and each one's prompt extends the
previous one's (the prefix an engine can cache); a fan-out's worker calls run concurrently with
each other and with that step's tool; the action sequence is a pure function of the seed and the
request id (emulated text is random, so the app does not parse it to decide).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass

from openai import AsyncOpenAI

from examples.endpoints import (
    Endpoints,
    add_endpoint_args,
    endpoints_from,
    new_request_id,
    tagged,
)

WORKFLOW = "agent"
SYSTEM_PROMPT = (
    "You are a research agent. At each step, think briefly, then choose one action: "
    "SEARCH(query) to look something up, READ(url) to read a page, DELEGATE(subtasks) to have "
    "assistants summarise sources in parallel, or ANSWER(text) when you are done. Keep each "
    "thought under three sentences."
)
TASKS = (
    "Compare the memory bandwidth of the last three GPU generations and explain what it means "
    "for LLM decoding.",
    "Find out why prefix caching helps multi-turn agents and when it does not.",
    "Summarise the trade-offs between tensor and pipeline parallelism for a 70B model.",
    "Which scheduling policies do LLM serving engines use, and how do they treat long prompts?",
)


@dataclass(frozen=True)
class AgentConfig:
    planner: str = "llama-3-8b"
    worker: str = "llama-3.2-1b"
    min_steps: int = 2
    max_steps: int = 6
    p_stop: float = 0.35  # after min_steps, the planner is done with this probability per step
    p_fan_out: float = 0.5  # otherwise a step fans out (else it runs a tool alone)
    fan_out: int = 3
    tool_s: float = 0.3  # mean tool time (exponential)
    planner_tokens: int = 96
    worker_tokens: int = 64

    def __post_init__(self) -> None:
        if not 1 <= self.min_steps <= self.max_steps or self.fan_out < 1 or self.tool_s < 0:
            raise ValueError("need 1 <= min_steps <= max_steps, fan_out >= 1, tool_s >= 0")


@dataclass(frozen=True)
class AgentResult:
    request_id: str
    answer: str
    steps: int
    planner_calls: int
    worker_calls: int
    tool_s: float
    latency_s: float


async def _think(client: AsyncOpenAI, cfg: AgentConfig, transcript: list[dict[str, str]]) -> str:
    resp = await client.chat.completions.create(
        model=cfg.planner,
        messages=transcript,  # type: ignore[arg-type]
        max_tokens=cfg.planner_tokens,
        temperature=0.7,
    )
    return resp.choices[0].message.content or ""


async def _summarise(client: AsyncOpenAI, cfg: AgentConfig, task: str, part: int) -> str:
    resp = await client.chat.completions.create(
        model=cfg.worker,
        messages=[
            {"role": "system", "content": "Summarise the source for the task in two sentences."},
            {"role": "user", "content": f"Task: {task}\nSource #{part}: retrieved notes."},
        ],
        max_tokens=cfg.worker_tokens,
        temperature=0.3,
    )
    return resp.choices[0].message.content or ""


async def _tool(seconds: float) -> str:
    await asyncio.sleep(seconds)  # a search, a page fetch: time no LLM call covers
    return f"tool output after {seconds:.2f}s"


async def run(
    endpoints: Endpoints,
    task: str,
    cfg: AgentConfig = AgentConfig(),
    *,
    request_id: str | None = None,
    seed: int = 0,
) -> AgentResult:
    """Run one agent request; every call is tagged with its request id."""
    rid = request_id or new_request_id()
    planner = tagged(endpoints.client(cfg.planner), WORKFLOW, rid)
    worker = tagged(endpoints.client(cfg.worker), WORKFLOW, rid)
    rng = random.Random(f"{seed}:{rid}")
    started = time.monotonic()
    transcript = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task},
    ]
    planner_calls = worker_calls = 0
    tool_total = 0.0
    thought = ""
    for step in range(1, cfg.max_steps + 1):
        thought = await _think(planner, cfg, transcript)
        planner_calls += 1
        transcript.append({"role": "assistant", "content": thought})
        if step >= cfg.min_steps and (step == cfg.max_steps or rng.random() < cfg.p_stop):
            break
        seconds = rng.expovariate(1.0 / cfg.tool_s) if cfg.tool_s > 0 else 0.0
        tool_total += seconds
        if rng.random() < cfg.p_fan_out:
            found = await asyncio.gather(
                _tool(seconds), *[_summarise(worker, cfg, task, i) for i in range(cfg.fan_out)]
            )
            worker_calls += cfg.fan_out
            observation = "\n".join(found)
        else:
            observation = await _tool(seconds)
        transcript.append({"role": "user", "content": f"Observation {step}: {observation}"})
    return AgentResult(
        rid,
        thought,
        planner_calls,
        planner_calls,
        worker_calls,
        tool_total,
        time.monotonic() - started,
    )


def add_agent_args(p: argparse.ArgumentParser) -> None:
    d = AgentConfig()
    p.add_argument("--planner", default=d.planner, help="the planner model (llama-3-8b)")
    p.add_argument("--worker", default=d.worker, help="the fan-out worker model (llama-3.2-1b)")
    p.add_argument("--max-steps", type=int, default=d.max_steps, help="most planner steps (6)")
    p.add_argument("--fan-out", type=int, default=d.fan_out, help="worker calls per fan-out (3)")
    p.add_argument("--tool-s", type=float, default=d.tool_s, help="mean tool time, s (0.3)")


def agent_config_from(args: argparse.Namespace) -> AgentConfig:
    return AgentConfig(
        planner=args.planner,
        worker=args.worker,
        max_steps=args.max_steps,
        min_steps=min(AgentConfig.min_steps, args.max_steps),
        fan_out=args.fan_out,
        tool_s=args.tool_s,
    )


async def _main(args: argparse.Namespace) -> None:
    endpoints = endpoints_from(args)
    try:
        result = await run(
            endpoints, args.task or random.choice(TASKS), agent_config_from(args), seed=args.seed
        )
    finally:
        await endpoints.close()
    print(json.dumps(result.__dict__, indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description="A tool-using agent with fan-outs, once.")
    add_endpoint_args(p)
    add_agent_args(p)
    p.add_argument("--task", default=None, help="the task (default: a bundled one)")
    p.add_argument("--seed", type=int, default=0)
    asyncio.run(_main(p.parse_args()))


if __name__ == "__main__":
    main()

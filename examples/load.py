"""Open-loop load: Poisson arrivals of workflow requests, then a JSON report per workflow.

Role: start beam-search, RAG and/or agent-loop workflow requests as Poisson processes (each workflow at its
own rate) for ``--duration`` seconds, wait for every request it started, and print achieved
throughput, latency percentiles and failures per workflow as JSON on stdout.

    python -m examples.load --workflow beam --rate 0.5 --duration 60 --base-url URL
    python -m examples.load --workflow beam,rag --rate 0.2,2 --duration 60 --base-url URL

Invariants: arrivals do not wait for completions (open loop); a failed request counts once in
``failed`` with its exception type and never in the latency figures; throughput is completed
requests over the time from the first arrival to the last completion.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from examples import agent_loop
from examples.beam_search import PROBLEMS, BeamConfig, add_beam_args, beam_config_from, solve
from examples.endpoints import Endpoints, add_endpoint_args, endpoints_from
from examples.passages import passages, questions
from examples.rag_rerank import RagConfig, add_rag_args, answer, build_index, rag_config_from

Request = Callable[[int], Awaitable[object]]  # request number -> one workflow request


@dataclass
class Tally:
    """Outcomes of one workflow's requests."""

    latencies: list[float] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)
    started: int = 0
    first_start: float | None = None
    last_end: float | None = None

    def report(self, rate: float) -> dict[str, Any]:
        span = (self.last_end or 0.0) - (self.first_start or 0.0)
        lat = np.asarray(self.latencies)
        pct = (
            (
                {f"p{q}": float(np.percentile(lat, q)) for q in (50, 90, 95, 99)}
                | {"mean": float(lat.mean()), "max": float(lat.max())}
            )
            if lat.size
            else {}
        )
        return {
            "offered_rate_rps": rate,
            "started": self.started,
            "completed": len(self.latencies),
            "failed": sum(self.failures.values()),
            "failures": dict(self.failures),
            "throughput_rps": len(self.latencies) / span if span > 0 else 0.0,
            "latency_s": pct,
        }


async def _timed(tally: Tally, make: Request, number: int) -> None:
    start = time.monotonic()
    tally.started += 1
    tally.first_start = start if tally.first_start is None else tally.first_start
    try:
        await make(number)
    except Exception as exc:  # a failed request is a result to report, not a crash
        tally.failures[type(exc).__name__] += 1
    else:
        tally.latencies.append(time.monotonic() - start)
    finally:
        tally.last_end = time.monotonic()


async def poisson(
    make: Request, rate: float, duration_s: float, tally: Tally, *, seed: int = 0
) -> None:
    """Start ``make`` at Poisson arrivals for ``duration_s`` seconds, then await them all."""
    rng = random.Random(seed)
    tasks: list[asyncio.Task[None]] = []
    deadline = time.monotonic() + duration_s
    number = 0
    next_at = time.monotonic() + rng.expovariate(rate)
    while next_at < deadline:
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        tasks.append(asyncio.create_task(_timed(tally, make, number)))
        number += 1
        next_at += rng.expovariate(rate)
    await asyncio.gather(*tasks)


async def workflow_requests(name: str, endpoints: Endpoints, args: argparse.Namespace) -> Request:
    """The request function of one workflow (the RAG index is built here, before the clock)."""
    if name == "beam":
        beam_cfg: BeamConfig = beam_config_from(args)

        async def beam(number: int) -> object:
            return await solve(
                endpoints, PROBLEMS[number % len(PROBLEMS)], beam_cfg, seed=args.seed + number
            )

        return beam
    if name == "rag":
        rag_cfg: RagConfig = rag_config_from(args)
        index = await build_index(endpoints, rag_cfg, passages(args.passages, seed=args.seed))
        asked = questions(256, seed=args.seed)

        async def rag(number: int) -> object:
            return await answer(endpoints, index, asked[number % len(asked)].text, rag_cfg)

        return rag
    if name == "agent":
        agent_cfg = agent_loop.agent_config_from(args)

        async def agent(number: int) -> object:
            task = agent_loop.TASKS[number % len(agent_loop.TASKS)]
            return await agent_loop.run(endpoints, task, agent_cfg, seed=args.seed + number)

        return agent
    raise SystemExit(f"unknown workflow {name!r} (beam, rag or agent)")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    names = [w.strip() for w in args.workflow.split(",") if w.strip()]
    rates = [float(r) for r in str(args.rate).split(",")]
    if len(rates) == 1:
        rates *= len(names)
    if len(rates) != len(names) or any(r <= 0 for r in rates):
        raise SystemExit("--rate needs one positive rate, or one per workflow")
    endpoints = endpoints_from(args)
    try:
        makers = [await workflow_requests(n, endpoints, args) for n in names]
        tallies = [Tally() for _ in names]
        started = time.monotonic()
        await asyncio.gather(
            *[
                poisson(m, r, args.duration, t, seed=args.seed + i)
                for i, (m, r, t) in enumerate(zip(makers, rates, tallies, strict=True))
            ]
        )
        elapsed = time.monotonic() - started
    finally:
        await endpoints.close()
    return {
        "duration_s": args.duration,
        "elapsed_s": elapsed,
        "workflows": {n: t.report(r) for n, r, t in zip(names, rates, tallies, strict=True)},
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Poisson load of agent workflows; JSON report.")
    p.add_argument("--workflow", default="beam", help="beam, rag, agent, or several: beam,rag")
    p.add_argument("--rate", default="1", help="requests per second (one, or one per workflow)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    p.add_argument("--seed", type=int, default=0)
    add_endpoint_args(p)
    add_beam_args(p)
    add_rag_args(p)
    agent_loop.add_agent_args(p)
    return p


def main() -> None:
    print(json.dumps(asyncio.run(run(parser().parse_args())), indent=2))


if __name__ == "__main__":
    main()

"""Beam search with a process-reward verifier (after HuggingFace search-and-learn).

Role: an agent app as a user writes it, with the plain ``openai`` SDK: a small generator writes
solution steps (ending at "\\n\\n"), a PRM scores each beam after every step (a 1-token chat
completion with logprobs, reading P("+")), and the top n/M beams survive, each copied M times.
Every call of one solve carries ``X-Scepsy-Workflow: beam`` and one fresh request id.

    python -m examples.beam_search --base-url http://127.0.0.1:8080/v1 [--n 4 --width 4]

Invariants (per iteration, as in workloads.md): n generator calls, then n verifier calls, each
group concurrent; a beam completes on end-of-sequence, length, or an empty step; completed
beams stop being extended; the search ends when n beams have completed (search-and-learn's
default, ``sort_completed=False``), no beam is active, or the iterations run out; the answer is
the best-scored completed beam.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, replace

from openai import AsyncOpenAI

from examples.endpoints import (
    Endpoints,
    add_endpoint_args,
    endpoints_from,
    new_request_id,
    tagged,
)

WORKFLOW = "beam"
# search-and-learn's system prompt (about 140 tokens).
SYSTEM_PROMPT = (
    "Solve the following math problem efficiently and clearly:\n\n"
    "- For simple problems (2 steps or fewer):\nProvide a concise solution with minimal "
    "explanation.\n\n- For complex problems (3 steps or more):\nUse this step-by-step format:"
    "\n\n## Step 1: [Concise description]\n[Brief explanation and calculations]\n\n"
    "## Step 2: [Concise description]\n[Brief explanation and calculations]\n\n...\n\n"
    "Regardless of the approach, always conclude with:\n\nTherefore, the final answer is: "
    "$\\boxed{answer}$. I hope it is correct.\n\nWhere [answer] is just the final number or "
    "expression that solves the problem."
)
PROBLEMS = (
    "What is the smallest positive integer $n$ such that $17n \\equiv 1234 \\pmod{7}$?",
    "If $x^2 + 6x + k$ is the square of a binomial, what is the value of $k$?",
    "How many positive divisors does $6!$ have?",
    "The sum of two numbers is 22 and their difference is 4. What is the greater number?",
    "Find the distance between the points $(1, 1)$ and $(4, 7)$. Express it in simplest "
    "radical form.",
    "What is the remainder when $2^{100}$ is divided by 7?",
    "A regular polygon has interior angles of 162 degrees. How many sides does it have?",
    "Evaluate $\\log_2 64 + \\log_3 81$.",
)
STEP_END = "\n\n"


@dataclass(frozen=True)
class BeamConfig:
    """search-and-learn's defaults (workloads.md)."""

    n: int = 4
    width: int = 4  # M: each survivor is copied M times
    iterations: int = 40
    temperature: float = 0.8
    max_tokens: int = 2048
    generator: str = "llama-3.2-1b"
    verifier: str = "llama-3.1-8b-prm"

    def __post_init__(self) -> None:
        if self.n < 1 or self.width < 1 or self.n % self.width:
            raise ValueError("n and width must be positive and n a multiple of width")


@dataclass(frozen=True)
class Beam:
    text: str = ""
    score: float = 0.0
    completed: bool = False


@dataclass(frozen=True)
class BeamResult:
    request_id: str
    answer: str
    score: float
    iterations: int
    generator_calls: int
    verifier_calls: int
    latency_s: float


async def _extend(
    client: AsyncOpenAI, cfg: BeamConfig, problem: str, beam: Beam, last: bool, seed: int
) -> Beam:
    """One generator call: the beam's next step (or, in the last iteration, its end)."""
    messages: list[dict[str, str]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": problem},
    ]
    extra: dict[str, object] = {}
    if beam.text:  # continue the assistant's partial solution rather than start a new turn
        messages.append({"role": "assistant", "content": beam.text})
        extra = {"continue_final_message": True, "add_generation_prompt": False}
    resp = await client.chat.completions.create(
        model=cfg.generator,
        messages=messages,  # type: ignore[arg-type]
        temperature=cfg.temperature,
        max_tokens=cfg.max_tokens,
        seed=seed,
        stop=None if last else [STEP_END],
        extra_body=extra or None,
    )
    choice = resp.choices[0]
    step = choice.message.content or ""
    stopped_at_step = choice.finish_reason == "stop" and _stop_reason(choice) == STEP_END
    done = last or not stopped_at_step or not step.strip()
    return Beam(beam.text + step + ("" if done else STEP_END), beam.score, done)


def _stop_reason(choice: object) -> object:
    # vLLM's extra field: the stop string matched, or None for end-of-sequence.
    extra = getattr(choice, "model_extra", None) or {}
    return extra.get("stop_reason")


async def _score(client: AsyncOpenAI, cfg: BeamConfig, problem: str, beam: Beam) -> float:
    """One verifier call: P("+") the PRM gives the beam's latest step."""
    resp = await client.chat.completions.create(
        model=cfg.verifier,
        max_tokens=1,
        temperature=0.0,
        logprobs=True,
        top_logprobs=5,
        messages=[{"role": "user", "content": f"{problem}\n\n{beam.text.rstrip()}"}],
    )
    content = resp.choices[0].logprobs.content if resp.choices[0].logprobs else None
    probs = {t.token: math.exp(t.logprob) for t in (content[0].top_logprobs if content else [])}
    plus, minus = probs.get("+", 0.0), probs.get("-", 0.0)
    return plus / (plus + minus) if plus + minus > 0 else 0.0


async def solve(
    endpoints: Endpoints,
    problem: str,
    cfg: BeamConfig = BeamConfig(),
    *,
    request_id: str | None = None,
    seed: int = 0,
) -> BeamResult:
    """Run one beam-search workflow request; every call is tagged with its request id."""
    rid = request_id or new_request_id()
    gen = tagged(endpoints.client(cfg.generator), WORKFLOW, rid)
    ver = tagged(endpoints.client(cfg.verifier), WORKFLOW, rid)
    rng = random.Random(f"{seed}:{rid}")
    started = time.monotonic()
    beams, completed = [Beam() for _ in range(cfg.n)], []
    gen_calls = ver_calls = iterations = 0
    for it in range(cfg.iterations):
        active = [b for b in beams if not b.completed]
        if not active:
            break
        iterations += 1
        batch = [active[i % len(active)] for i in range(cfg.n)]  # copied round-robin up to n
        last = it == cfg.iterations - 1
        stepped = await asyncio.gather(
            *[_extend(gen, cfg, problem, b, last, rng.randrange(2**31)) for b in batch]
        )
        scores = await asyncio.gather(*[_score(ver, cfg, problem, b) for b in stepped])
        gen_calls += len(batch)
        ver_calls += len(stepped)
        scored = [replace(b, score=s) for b, s in zip(stepped, scores, strict=True)]
        completed += [b for b in scored if b.completed]
        if len(completed) >= cfg.n:  # search-and-learn stops once n beams have completed
            break
        survivors = sorted((b for b in scored if not b.completed), key=lambda b: -b.score)
        beams = [b for b in survivors[: cfg.n // cfg.width] for _ in range(cfg.width)]
    pool = completed or beams
    best = max(pool, key=lambda b: b.score) if pool else Beam()
    return BeamResult(
        rid, best.text, best.score, iterations, gen_calls, ver_calls, time.monotonic() - started
    )


def add_beam_args(p: argparse.ArgumentParser) -> None:
    d = BeamConfig()
    p.add_argument("--n", type=int, default=d.n, help="beams (4; runs also use 16 and 64)")
    p.add_argument("--width", type=int, default=d.width, help="beam width M (4)")
    p.add_argument("--iterations", type=int, default=d.iterations, help="most iterations (40)")
    p.add_argument("--generator", default=d.generator, help="generator model name")
    p.add_argument("--verifier", default=d.verifier, help="process-reward model name")


def beam_config_from(args: argparse.Namespace) -> BeamConfig:
    return BeamConfig(
        n=args.n,
        width=args.width,
        iterations=args.iterations,
        generator=args.generator,
        verifier=args.verifier,
    )


async def _main(args: argparse.Namespace) -> None:
    endpoints = endpoints_from(args)
    try:
        result = await solve(
            endpoints,
            args.problem or random.choice(PROBLEMS),
            beam_config_from(args),
            seed=args.seed,
        )
    finally:
        await endpoints.close()
    print(json.dumps(result.__dict__, indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description="Beam search with a PRM verifier, once.")
    add_endpoint_args(p)
    add_beam_args(p)
    p.add_argument("--problem", default=None, help="the problem (default: a bundled one)")
    p.add_argument("--seed", type=int, default=0)
    asyncio.run(_main(p.parse_args()))


if __name__ == "__main__":
    main()

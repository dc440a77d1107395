"""Do the emulator and the simulator agree? Mean RAG workflow latency, both ways, three loads.

Role: ``python -m bench.accuracy.sim_agreement --out DIR [--quick]``. One small allocation (RAG:
e5-base-v2 and bge-reranker-base at half an A6000 each, llama-3-8b on a whole A6000), three
arrival rates (25/50/75% of the simulator's capacity for it). For each rate:
- simulated: ``sim.des.simulate`` with the workflow parameters aligned to the example app's
  text (token counts measured with the emulator's tokenizer, the vector-search time measured
  on the example's index) records every request's arrival and latency;
- emulated: the same arrival times (model seconds / speed-up) drive ``examples.rag_rerank``
  requests with the plain ``openai`` SDK through a proxy process in front of three
  ``scepsy-engine`` processes; client latencies (wall) x speed-up are model seconds;
- the pair is compared over the requests that arrived after the warm-up; an independent,
  long simulation at the same rate is reported alongside (the sampling noise of one run).

Why paired arrivals: near saturation the mean latency of a few hundred requests swings by
+-10% with the arrival sample alone (sim: 7% std at 75% load over 240 s); replaying the
simulator's arrivals removes that noise from the comparison, leaving what differs between
the two drivers (real-time pacing, lag, HTTP and proxy overheads, prefix-cache contents).

Invariants: every figure is labelled "emulated" or "simulated"; the emulators run as separate
processes at one speed-up, restarted per rate (cold caches, as the simulation starts); the
output lengths are fixed at the example's ``max_tokens`` on both sides (the emulator's length
model gets a median far above it and no spread, so every answer runs to ``max_tokens``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.speed.emulator_lag import (
    EmulatedStack,
    EngineProcess,
    lags,
    recorded_calls,
    reexec_single_threaded,
    scrape_all,
)
from examples.endpoints import Endpoints
from examples.passages import passages, questions
from examples.rag_rerank import SYSTEM_PROMPT, PassageIndex, RagConfig, answer, build_index
from sim.cluster import Allocation, ReplicaSpec
from sim.des import WorkloadSpec, simulate
from sim.emulator_server import serving
from sim.results import LatencyStats
from sim.serving import EmulatorConfig
from sim.text import BOS, render_chat, token_ids
from sim.workflows import RagParams

TARGET = 0.10  # issue 3: mean latencies within 10%
PAIR_SEPARATOR = "</s></s>"  # how the emulator joins a rerank pair (sim.pooling)
# Every emulated answer runs to max_tokens, as the simulator's fixed output_tokens assume.
FIXED_LENGTH = ("--step-median-tokens", "64", "--step-sigma", "0")


@dataclass(frozen=True)
class RunShape:
    """One agreement run's shape: speed-up, loads, durations, corpus size, seed."""

    speedup: float  # model seconds per wall second of the emulators
    fractions: tuple[float, ...]  # arrival rates as fractions of the simulated capacity
    warmup_s: float  # model seconds of arrivals not measured
    duration_s: float  # model seconds of measured arrivals
    passages: int  # the example's generated passage collection
    long_run_s: float = 1200.0  # the independent simulation's arrivals (model seconds)
    capacity_s: float = 120.0  # arrivals per overload simulation that finds the capacity
    seed: int = 0


# Speed-ups: the client, proxy and emulator CPU per request (~50 ms on this 2-core machine)
# is wall time the model's clock does not count; x speed-up it inflates emulated latencies.
FULL = RunShape(
    speedup=1.0, fractions=(0.25, 0.5, 0.75), warmup_s=15.0, duration_s=110.0, passages=2_000
)
QUICK = RunShape(
    speedup=2.0,
    fractions=(0.25, 0.5, 0.75),
    warmup_s=10.0,
    duration_s=70.0,
    passages=2_000,
    long_run_s=600.0,
)


def rag_allocation() -> Allocation:
    return Allocation.of(
        ReplicaSpec("e5-base-v2", "a6000", 1, 0.5, 1),
        ReplicaSpec("bge-reranker-base", "a6000", 1, 0.5, 1),
        ReplicaSpec("llama-3-8b", "a6000", 1, 1.0, 1),
    )


# --- aligning the simulator's workflow with the example app ---------------------------------


def rag_params(
    texts: Sequence[str],
    asked: Sequence[str],
    cfg: RagConfig,
    *,
    search_s: float,
    sample: int = 200,
    seed: int = 0,
) -> tuple[RagParams, dict[str, float]]:
    """RagParams whose prompts have the example's mean token counts under the emulator's
    tokenizer, and the measured counts themselves. The chat prompt keeps the simulator's
    structure (system prefix, passages, query) with the example's rendered system prefix as
    the shared part and its mean total length."""
    rng = np.random.default_rng(seed)
    qs = [asked[int(i)] for i in rng.integers(len(asked), size=sample)]
    embed = np.mean([len(token_ids(f"{BOS}query: {q}")) for q in qs])
    pairs = np.mean(
        [
            len(token_ids(f"{BOS}{q}{PAIR_SEPARATOR}{texts[int(d)]}"))
            for q in qs[:50]
            for d in rng.integers(len(texts), size=cfg.retrieve)
        ]
    )
    system = len(token_ids(BOS + "<|start_header_id|>system<|end_header_id|>\n\n" + SYSTEM_PROMPT))
    chats = []
    for q in qs:
        docs = "\n".join(
            f"Doc {k + 1}: {texts[int(d)]}"
            for k, d in enumerate(rng.integers(len(texts), size=cfg.keep))
        )
        chats.append(
            len(
                token_ids(
                    render_chat(
                        [
                            {"role": "system", "content": SYSTEM_PROMPT + docs},
                            {"role": "user", "content": f"Question: {q}"},
                        ]
                    )
                )
            )
        )
    chat = float(np.mean(chats))
    query = round(float(embed))
    params = RagParams(
        embedder=cfg.embedder,
        reranker=cfg.reranker,
        generator=cfg.generator,
        query_tokens=query,
        documents=cfg.retrieve,
        pair_tokens=round(float(pairs)),
        top_n=cfg.keep,
        system_tokens=system,
        passage_tokens=round((chat - system - query) / cfg.keep),
        output_tokens=cfg.max_tokens,
        search_seconds=search_s,
        corpus=len(texts),
    )
    measured = {
        "embed_prompt_tokens": float(embed),
        "rerank_pair_tokens": float(pairs),
        "chat_prompt_tokens": chat,
        "chat_shared_prefix_tokens": float(system),
    }
    return params, measured


def search_seconds(index: PassageIndex, k: int, trials: int = 30) -> float:
    """Mean wall seconds of one top-k search over the example's index."""
    rng = np.random.default_rng(1)
    queries = index.vectors[rng.integers(len(index.texts), size=trials)]
    start = time.perf_counter()
    for q in queries:
        index.search(q, k)
    return (time.perf_counter() - start) / trials


def capacity(
    allocation: Allocation, params: RagParams, seed: int = 0, duration_s: float = 120.0
) -> float:
    """Simulated workflow requests per second at overload: the offered rate doubles until
    the throughput falls below 80% of it; the best throughput seen is the capacity."""
    rate, best = 0.5, 0.0
    while True:
        res = simulate(
            allocation,
            [WorkloadSpec("rag", rate, params)],
            duration_s=duration_s,
            warmup_s=duration_s / 4,
            seed=seed,
            drain_s=0.0,
        )
        got = res.workflows["rag"].throughput
        best = max(best, got)
        if got < 0.8 * rate and best > 0:
            return best
        rate *= 2


@dataclass(frozen=True)
class Schedule:
    """A simulated run: per request index, its arrival and latency (model seconds)."""

    arrivals: tuple[float, ...]
    latencies: tuple[float, ...]  # nan where it did not finish
    call_s: dict[str, float]  # per model: mean call duration (model seconds)


def simulated_schedule(
    allocation: Allocation, params: RagParams, rate: float, shape: RunShape, seed: int
) -> Schedule:
    res = simulate(
        allocation,
        [WorkloadSpec("rag", rate, params)],
        duration_s=shape.warmup_s + shape.duration_s,
        seed=seed,
        record_calls=True,
    )
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    calls: dict[str, list[float]] = {}
    for c in res.calls:
        calls.setdefault(c.call.model, []).append(c.t_end - c.t_start)
        i = int(c.request_id.rsplit("-", 1)[1])
        first[i] = min(first.get(i, math.inf), c.t_start)
        last[i] = max(last.get(i, -math.inf), c.t_end)
    n = max(first) + 1
    if len(first) != n:
        raise RuntimeError("a simulated request made no call")
    return Schedule(
        tuple(first[i] for i in range(n)),
        tuple(last[i] - first[i] for i in range(n)),
        {m: float(np.mean(v)) for m, v in sorted(calls.items())},
    )


# --- the emulated side ----------------------------------------------------------------------


@dataclass(frozen=True)
class Emulated:
    latencies: tuple[float, ...]  # model seconds (wall x speed-up); nan for failures
    failures: dict[str, int]
    slip_ms: tuple[float, ...]  # wall ms each request started after its scheduled time


async def drive(
    endpoints: Endpoints,
    index: PassageIndex,
    asked: Sequence[str],
    cfg: RagConfig,
    arrivals: Sequence[float],
    speedup: float,
) -> Emulated:
    """Start RAG request i at arrivals[i] / speedup wall seconds from now; await them all."""
    latencies = [math.nan] * len(arrivals)
    slips = [0.0] * len(arrivals)
    failures: dict[str, int] = {}

    async def one(i: int) -> None:
        try:
            res = await answer(endpoints, index, asked[i % len(asked)], cfg, request_id=f"rag-{i}")
        except Exception as exc:  # a failed request is a figure to report
            failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
        else:
            latencies[i] = res.latency_s * speedup

    t0 = time.monotonic() + 0.1
    tasks = []
    for i, t in enumerate(arrivals):
        due = t0 + t / speedup
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        slips[i] = (time.monotonic() - due) * 1000
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    return Emulated(tuple(latencies), failures, tuple(slips))


async def warm_relevance(url: str, model: str, texts: Sequence[str], batch: int = 500) -> None:
    """Have the reranker emulator compute (and cache) every passage's relevance vector once.

    Why: the emulator scores a pair from hashed word-feature vectors it caches per text; cold,
    that is ~5 ms of CPU per passage (~100 ms per 20-document rerank), wall time the model's
    clock does not know about, which the speed-up then multiplies. A real reranker has no such
    cost, so it is paid here, before the measured window (``/pooling`` on a rerank model
    scores a text against itself, which caches the text's vector; its blocks never match a
    query-document pair's, so the prefix cache is not warmed by it)."""
    async with aiohttp.ClientSession() as session:
        for start in range(0, len(texts), batch):
            body = {"model": model, "input": list(texts[start : start + batch])}
            async with session.post(f"{url}/pooling", json=body) as resp:
                resp.raise_for_status()
                await resp.read()


async def emulated_point(
    shape: RunShape,
    allocation: Allocation,
    index: PassageIndex,
    asked: Sequence[str],
    cfg: RagConfig,
    schedule: Schedule,
    workdir: Path,
) -> tuple[Emulated, dict[str, Any]]:
    engines = [
        EngineProcess(s.model, s.gpu, s.tp, s.share, FIXED_LENGTH)
        for s in allocation.replicas
        for _ in range(s.count)
    ]
    shutil.rmtree(workdir, ignore_errors=True)
    async with EmulatedStack(engines, shape.speedup, workdir, seed=shape.seed) as stack:
        reranker = next(
            c for e, c in zip(engines, stack.emulators, strict=True) if e.model == cfg.reranker
        )
        await warm_relevance(reranker.url, cfg.reranker, index.texts)
        before = await scrape_all(stack)
        endpoints = Endpoints(stack.base_url, max_retries=0)
        load0 = os.getloadavg()
        wall0, cpu0, client0 = time.monotonic(), stack.cpu(), time.process_time()
        try:
            emu = await drive(endpoints, index, asked, cfg, schedule.arrivals, shape.speedup)
        finally:
            await endpoints.close()
        wall = time.monotonic() - wall0
        cpu1, client1 = stack.cpu(), time.process_time()
        after = await scrape_all(stack)
        load1 = os.getloadavg()
    n = len(schedule.arrivals)
    cpu = {k: (cpu1[k] - v) * 1000 / n for k, v in cpu0.items() if k in cpu1}
    cpu["client (this process)"] = (client1 - client0) * 1000 / n
    extra = {
        "engines": lags(stack, before, after),
        "calls": recorded_calls(stack.store),
        "wall_s": wall,
        "load_average": {"before": load0, "after": load1},
        "cpu_ms_per_request": cpu,
    }
    return emu, extra


# --- comparing ------------------------------------------------------------------------------


def stats(values: Sequence[float]) -> dict[str, float]:
    s = LatencyStats.of([v for v in values if not math.isnan(v)])
    return {"mean_s": s.mean, "p50_s": s.p50, "p90_s": s.p90, "p99_s": s.p99}


def compare(
    shape: RunShape,
    rate: float,
    frac: float,
    sched: Schedule,
    emu: Emulated,
    long_run: dict[str, Any],
    extra: dict[str, Any],
) -> dict[str, Any]:
    measured = [i for i, t in enumerate(sched.arrivals) if t >= shape.warmup_s]
    e = stats([emu.latencies[i] for i in measured])
    s = stats([sched.latencies[i] for i in measured])
    engines = extra["engines"]
    return {
        "rate_rps": rate,
        "fraction_of_capacity": frac,
        "requests_measured": len(measured),
        "emulated": e | {"failed": sum(emu.failures.values()), "failures": emu.failures},
        "simulated": s | {"arrivals": "same as emulated (paired)"},
        "simulated_long_run": long_run,
        "relative_error": e["mean_s"] / s["mean_s"] - 1,
        "relative_error_vs_long_run": e["mean_s"] / long_run["mean_s"] - 1,
        "emulator_lag": {m: v["lag_ratio"] for m, v in engines.items()},
        "emulator_max_lag": max(v["lag_ratio"] for v in engines.values()),
        "emulated_engines": engines,
        "proxy_calls": extra["calls"],
        "call_s": {
            "simulated": sched.call_s,
            "emulated": {
                m: v["mean_call_wall_ms"] / 1000 * shape.speedup
                for m, v in extra["calls"].items()
                if v["mean_call_wall_ms"] is not None
            },
        },
        "arrival_slip_ms": {"mean": float(np.mean(emu.slip_ms)), "max": float(np.max(emu.slip_ms))},
        "wall_s": extra["wall_s"],
        "load_average": extra["load_average"],
        "cpu_ms_per_request": extra["cpu_ms_per_request"],
    }


def long_run_stats(
    allocation: Allocation, params: RagParams, rate: float, shape: RunShape
) -> dict[str, Any]:
    res = simulate(
        allocation,
        [WorkloadSpec("rag", rate, params)],
        duration_s=shape.long_run_s,
        warmup_s=shape.warmup_s,
        seed=shape.seed + 1000,
    )
    w = res.workflows["rag"]
    llama = next(r for r in res.replicas if r.model == params.generator)
    return {
        "mean_s": w.latency.mean,
        "p50_s": w.latency.p50,
        "p90_s": w.latency.p90,
        "requests": w.completed,
        "generator_utilisation": llama.utilisation,
        "generator_prefix_hit_rate": llama.prefix_hit_rate,
    }


async def run(shape: RunShape, out: Path) -> dict[str, Any]:
    cfg = RagConfig()
    allocation = rag_allocation()
    texts = passages(shape.passages, seed=shape.seed)
    # distinct questions: a repeated question would find its whole prompt in the prefix cache
    asked = list(dict.fromkeys(q.text for q in questions(20_000, seed=shape.seed)))
    # the index is built offline (not part of any request) by an in-process e5 emulator with
    # the stack's seed, so its vectors are the ones the stack's e5 would give
    async with serving(
        EmulatorConfig(model=cfg.embedder, gpu="a6000", speedup=1e6, seed=shape.seed)
    ) as e5:
        local = Endpoints(e5.base_url, max_retries=0)
        try:
            index = await build_index(local, cfg, texts)
        finally:
            await local.close()
    search_wall = search_seconds(index, cfg.retrieve)
    params, tokens = rag_params(texts, asked, cfg, search_s=search_wall * shape.speedup)
    cap = capacity(allocation, params, shape.seed, shape.capacity_s)
    points = []
    for k, frac in enumerate(shape.fractions):
        rate = frac * cap
        sched = simulated_schedule(allocation, params, rate, shape, shape.seed + k)
        if len(sched.arrivals) > len(asked):
            raise RuntimeError(f"{len(sched.arrivals)} requests but {len(asked)} questions")
        emu, extra = await emulated_point(
            shape, allocation, index, asked, cfg, sched, out / f"work-{k}"
        )
        long_run = long_run_stats(allocation, params, rate, shape)
        points.append(compare(shape, rate, frac, sched, emu, long_run, extra))
        print(
            json.dumps(
                {
                    "fraction": frac,
                    "emulated_mean_s": points[-1]["emulated"]["mean_s"],
                    "simulated_mean_s": points[-1]["simulated"]["mean_s"],
                    "max_lag": points[-1]["emulator_max_lag"],
                }
            ),
            flush=True,
        )
    errors = [abs(p["relative_error"]) for p in points]
    return {
        "labels": {
            "emulated": "emulated engines in real time x speed-up, through the proxy",
            "simulated": "discrete-event simulation",
        },
        "plan": asdict(shape),
        "allocation": [asdict(s) for s in allocation.replicas],
        "simulated_capacity_rps": cap,
        "workflow_params": asdict(params)
        | {"measured_tokens": tokens, "search_wall_s": search_wall},
        "questions_distinct": len(asked),
        "points": points,
        "summary": {
            "max_mean_latency_error": max(errors),
            "points": len(points),
            "target": TARGET,
            "within_target": max(errors) <= TARGET,
            "max_emulator_lag": max(p["emulator_max_lag"] for p in points),
        },
    }


def table(result: dict[str, Any]) -> str:
    alloc = ", ".join(f"{a['model']} {a['gpu']} share {a['share']}" for a in result["allocation"])
    lines = [
        "# Emulator vs simulator: RAG workflow latency (model seconds)",
        "",
        f"Allocation: {alloc}; "
        f"simulated capacity {result['simulated_capacity_rps']:.2f} req/s; speed-up "
        f"{result['plan']['speedup']}.",
        "",
        "| load | rate req/s | n | emulated mean | simulated mean | error | emulated p50/p90 "
        "| simulated p50/p90 | simulated long-run mean | max emulator lag | proxy calls "
        "| load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result["points"]:
        e, s = p["emulated"], p["simulated"]
        calls = " / ".join(f"{v['ok']}" for v in p["proxy_calls"].values())
        lines.append(
            f"| {p['fraction_of_capacity']:.0%} | {p['rate_rps']:.2f} | {p['requests_measured']} "
            f"| {e['mean_s']:.3f} | {s['mean_s']:.3f} | {p['relative_error']:+.1%} "
            f"| {e['p50_s']:.2f}/{e['p90_s']:.2f} | {s['p50_s']:.2f}/{s['p90_s']:.2f} "
            f"| {p['simulated_long_run']['mean_s']:.3f} | {p['emulator_max_lag']:.1%} "
            f"| {calls} | {p['load_average']['after'][0]:.1f} |"
        )
    sm = result["summary"]
    lines += [
        "",
        f"Max |error| of the mean: {sm['max_mean_latency_error']:.1%} "
        f"(target {sm['target']:.0%}); every figure emulated or simulated as labelled.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Emulated vs simulated RAG latency, three loads.")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--quick", action="store_true", help="shorter runs (under 4 minutes)")
    p.add_argument("--speedup", type=float, default=None, help="override the run shape's speed-up")
    args = p.parse_args(argv)
    reexec_single_threaded("bench.accuracy.sim_agreement", sys.argv[1:] if argv is None else argv)
    shape = QUICK if args.quick else FULL
    if args.speedup is not None:
        shape = replace(shape, speedup=args.speedup)
    args.out.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(run(shape, args.out))
    (args.out / "sim_agreement.json").write_text(json.dumps(result, indent=2))
    (args.out / "sim_agreement.md").write_text(table(result))
    print(json.dumps(result["summary"]))


if __name__ == "__main__":
    main()

"""Lazy decoding (``EngineCore(decode_lazily=True)``, the simulator's engines) steps exactly as
the eager engine: same durations, admissions, first tokens, finishes, preemptions, blocks and
counters, under KV pressure (preemption) and a small token budget (chunked prefill), with
decode runs fast-forwarded and cut as the simulator does."""

from __future__ import annotations

import random
from typing import Any

import pytest

from sim.engine import EngineCore, EngineRequest
from sim.perf import perf_model
from sim.workflows import Prompt


def drive(lazy: bool, seed: int, steps: int = 2500) -> tuple[list[Any], EngineCore]:
    rng = random.Random(seed)
    # ~7.9k KV tokens: a dozen requests of ~1k tokens preempt one another
    engine = EngineCore(
        perf_model("llama-3-8b", "a6000", share=0.42),
        max_num_batched_tokens=384,
        max_num_seqs=48,
        decode_lazily=lazy,
    )
    roots = [Prompt(k, rng.randint(20, 200)) for k in range(1, 5)]  # shared prefixes
    log: list[Any] = []
    for i in range(steps):
        if rng.random() < 0.4:
            prompt = rng.choice(roots).extend(1000 + i, rng.randint(1, 700))
            req = EngineRequest(str(i), prompt, rng.choice([0, 1, rng.randint(2, 1500)]))
            engine.submit(req)
        if rng.random() < 0.01 and engine.has_work():
            engine.abort(str(rng.randrange(i + 1)))
        if not engine.has_work():
            continue
        k = engine.decode_run_length()
        if k >= 2 and rng.random() < 0.5:
            n = rng.randint(1, k)  # a run cut short, as a submit in the simulator does
            log.append(("run", k, n, engine.decode_run_times(k)[:n].tolist()))
            engine.advance_decode(n)
            continue
        out = engine.step()
        log.append((out.duration, out.first_token, out.finished, out.preempted, out.cached_tokens))
    log.append(
        (
            engine.num_running,
            engine.num_waiting,
            engine.kv_usage,
            engine.prefix_cache_hits,
            engine.prefix_cache_queries,
            engine.prompt_tokens_total,
            engine.generation_tokens_total,
            engine.preemptions_total,
        )
    )
    return log, engine


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_lazy_decoding_steps_exactly_as_the_eager_engine(seed: int) -> None:
    eager, engine = drive(False, seed)
    lazy, _ = drive(True, seed)
    assert engine.preemptions_total > 0  # the scenario reaches the exact fall-back
    assert lazy == eager

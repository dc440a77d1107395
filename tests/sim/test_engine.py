"""The engine core: batching, prefix caching, preemption, saturation (clock-free)."""

from __future__ import annotations

from typing import Literal

import numpy as np
import pytest

from sim.engine import EngineCore, EngineRequest, StepOutcome, chain_block_hashes
from sim.perf import GPUS, MODELS, GpuSpec, PerfModel, perf_model


def run(engine: EngineCore, max_steps: int = 100_000) -> tuple[float, list[StepOutcome]]:
    clock, outcomes = 0.0, []
    while engine.has_work():
        out = engine.step()
        clock += out.duration
        outcomes.append(out)
        assert len(outcomes) < max_steps
    return clock, outcomes


def tokens(prefix: int, n: int) -> list[int]:
    return [prefix * 100_000 + i for i in range(n)]


def tiny_gpu(kv_tokens: int) -> PerfModel:
    """A GPU with room for ``kv_tokens`` of llama-3.2-1b KV cache."""
    base = GPUS["a6000"]
    need = 2.5e9 + 1.0e9 + kv_tokens * MODELS["llama-3.2-1b"].kv_bytes_per_token
    gpu = GpuSpec("tiny", base.hbm_bytes_per_s, base.flops, int(need / 0.9) + 1)
    return PerfModel(MODELS["llama-3.2-1b"], gpu)


def test_one_request_emits_its_tokens_once() -> None:
    engine = EngineCore(perf_model("llama-3.2-1b", "a6000"))
    engine.submit(EngineRequest("a", tokens(1, 100), 5))
    _, outs = run(engine)
    assert [o.first_token for o in outs] == [["a"], [], [], [], []]
    assert sum(n for o in outs for _, n in o.emitted) == 5
    assert outs[-1].finished == ["a"]
    assert engine.generation_tokens_total == 5 and engine.prompt_tokens_total == 100
    assert engine.kv_usage == 0.0 and not engine.has_work()


def test_prefill_only_request_finishes_with_its_first_step() -> None:
    engine = EngineCore(perf_model("e5-base-v2", "a6000"))
    engine.submit(EngineRequest("q", tokens(1, 15), 0))
    out = engine.step()
    assert out.first_token == ["q"] and out.finished == ["q"] and out.emitted == []
    assert out.duration > 0 and not engine.has_work()


def test_shared_prefix_is_not_prefilled_twice() -> None:
    perf = perf_model("llama-3.2-1b", "a6000")
    engine = EngineCore(perf)
    system = tokens(7, 200)
    engine.submit(EngineRequest("a", system + tokens(1, 56), 1))
    first = engine.step()
    engine.submit(EngineRequest("b", system + tokens(2, 56), 1))
    second = engine.step()
    assert second.first_token == ["b"] and second.cached_tokens == {"b": 192}
    assert engine.prefix_cache_hits == 192  # the 12 full blocks of the common 200 tokens
    assert second.duration == pytest.approx(perf.step_time(256 - 192, 0, 0))
    assert second.duration < first.duration
    cold = EngineCore(perf, enable_prefix_caching=False)
    cold.submit(EngineRequest("b", system + tokens(2, 56), 1))
    assert cold.step().duration == pytest.approx(first.duration)
    assert cold.prefix_cache_hits == 0


def test_fully_cached_prompt_still_computes_its_last_block() -> None:
    engine = EngineCore(perf_model("llama-3.2-1b", "a6000"))
    prompt = tokens(3, 64)
    engine.submit(EngineRequest("a", prompt, 1))
    run(engine)
    engine.submit(EngineRequest("b", prompt, 1))
    assert engine.step().first_token == ["b"]
    assert engine.prefix_cache_hits == 48


def test_concurrent_beams_share_a_prefix_while_running() -> None:
    engine = EngineCore(perf_model("llama-3.2-1b", "a6000"))
    engine.submit(EngineRequest("root", tokens(1, 160), 50))
    engine.step()  # root's prompt blocks are now cached and referenced
    for i in range(4):
        engine.submit(EngineRequest(f"beam{i}", tokens(1, 160) + tokens(10 + i, 30), 10))
    engine.step()
    assert engine.prefix_cache_hits == 4 * 160
    assert all(engine.cached_tokens(f"beam{i}") == 160 for i in range(4))
    run(engine)


def test_unreferenced_cached_blocks_are_evicted_lru_when_space_is_needed() -> None:
    engine = EngineCore(tiny_gpu(64 * 16))  # 64 blocks
    assert engine.num_blocks == 64
    old = tokens(1, 32 * 16)
    engine.submit(EngineRequest("old", old, 1))
    run(engine)
    assert engine.kv_usage == 0.0  # cached but unreferenced counts as free
    engine.submit(EngineRequest("big", tokens(2, 48 * 16), 1))  # needs 16 of the old blocks
    run(engine)
    engine.submit(EngineRequest("again", old, 1))
    out = engine.step()
    # the old prompt's tail blocks went first; its head is still cached
    assert out.cached_tokens == {"again": 16 * 16}


def test_tiny_kv_cache_preempts_and_still_completes_everything() -> None:
    engine = EngineCore(tiny_gpu(64 * 16))
    for i in range(8):
        engine.submit(EngineRequest(f"r{i}", tokens(i, 100), 200))  # 19 blocks each at the end
    _, outs = run(engine)
    emitted: dict[str, int] = {}
    for o in outs:
        for rid, n in o.emitted:
            emitted[rid] = emitted.get(rid, 0) + n
    assert emitted == {f"r{i}": 200 for i in range(8)}
    assert sorted(r for o in outs for r in o.finished) == sorted(emitted)
    assert engine.preemptions_total > 0 and any(o.preempted for o in outs)
    assert sum(len(o.first_token) for o in outs) == 8  # recompute does not re-announce
    assert engine.kv_usage == 0.0


def test_throughput_grows_with_batch_then_saturates() -> None:
    def tokens_per_s(concurrency: int) -> float:
        engine = EngineCore(perf_model("llama-3-8b", "a100"), max_num_seqs=256)
        for i in range(concurrency):
            engine.submit(EngineRequest(f"r{i}", tokens(i, 256), 64))
        clock, _ = run(engine)
        return concurrency * 64 / clock

    t1, t8, t256, t1024 = (tokens_per_s(c) for c in (1, 8, 256, 1024))
    assert t8 > 4 * t1
    assert t256 > 3 * t8
    assert t1024 == pytest.approx(t256, rel=0.1)  # max_num_seqs caps the batch


def test_long_prompt_is_prefilled_in_chunks_within_the_token_budget() -> None:
    perf = perf_model("llama-3.2-1b", "a100")
    engine = EngineCore(perf, max_num_batched_tokens=4096)
    engine.submit(EngineRequest("long", tokens(1, 10_000), 2))
    engine.submit(EngineRequest("short", tokens(2, 10), 2))
    outs = [engine.step() for _ in range(3)]
    assert [o.first_token for o in outs] == [[], [], ["long", "short"]]
    assert outs[0].duration == pytest.approx(perf.step_time(4096, 0, 0))


def test_max_num_seqs_bounds_the_running_batch() -> None:
    engine = EngineCore(perf_model("llama-3.2-1b", "a100"), max_num_seqs=3)
    for i in range(5):
        engine.submit(EngineRequest(f"r{i}", tokens(i, 20), 4))
    engine.step()
    assert engine.num_running == 3 and engine.num_waiting == 2
    run(engine)


def test_abort_frees_blocks_and_bad_requests_raise() -> None:
    engine = EngineCore(perf_model("llama-3-8b", "a6000"))
    engine.submit(EngineRequest("a", tokens(1, 100), 50))
    engine.step()
    assert engine.kv_usage > 0
    engine.abort("a")
    engine.abort("unknown")
    assert engine.kv_usage == 0.0 and not engine.has_work()
    engine.submit(EngineRequest("b", tokens(1, 10), 1))
    with pytest.raises(ValueError, match="already"):
        engine.submit(EngineRequest("b", tokens(1, 10), 1))
    with pytest.raises(ValueError, match="context"):
        engine.submit(EngineRequest("c", tokens(1, 8000), 500))
    with pytest.raises(ValueError):
        engine.submit(EngineRequest("d", [], 3))
    with pytest.raises(ValueError, match="does not fit"):
        EngineCore(perf_model("llama-3-8b", "a6000", share=0.3))


def test_chain_hashes_depend_on_the_whole_prefix() -> None:
    a = chain_block_hashes(tokens(1, 64), 16)
    b = chain_block_hashes(tokens(2, 16) + tokens(1, 64)[16:], 16)
    assert len(a) == 4 and a[1:] != b[1:]
    assert chain_block_hashes([*tokens(1, 64), 5], 16) == a


def test_decode_run_fast_forward_matches_step_by_step() -> None:
    def fresh() -> EngineCore:
        engine = EngineCore(perf_model("llama-3.2-1b", "a6000"))
        for i in range(5):
            engine.submit(EngineRequest(f"r{i}", tokens(i, 40 + 10 * i), 30 + i))
        engine.step()  # the prefill step
        return engine

    fast, slow = fresh(), fresh()
    k = fast.decode_run_length()
    assert k == 28  # the shortest request's last token finishes the run: 30 - 1 - 1
    total = float(fast.decode_run_times(k).sum())
    fast.advance_decode(k)
    assert total == pytest.approx(sum(slow.step().duration for _ in range(k)))
    assert fast.generation_tokens_total == slow.generation_tokens_total
    assert fast.kv_usage == slow.kv_usage
    assert run(fast)[0] == pytest.approx(run(slow)[0])
    assert fast.decode_run_length() == 0  # nothing running


def test_block_accounting_holds_under_random_shared_prefix_load() -> None:
    import random

    rnd = random.Random(7)
    engine = EngineCore(tiny_gpu(48 * 16))
    prefixes = [tokens(100 + p, 16 * rnd.randint(1, 6)) for p in range(3)]
    submitted = finished = 0
    for step in range(3000):
        if step % 3 == 0 and submitted < 150:
            prompt = rnd.choice(prefixes) + tokens(submitted, rnd.randint(1, 60))
            engine.submit(EngineRequest(f"q{submitted}", prompt, rnd.randint(0, 80)))
            submitted += 1
        out = engine.step()
        finished += len(out.finished)
        pool = engine._pool
        shared = sum(1 for count in pool.refs.values() if count > 0)
        used = shared + sum(s.private for s in engine._running)
        assert used == round(engine.kv_usage * engine.num_blocks)
        assert pool.free + len(pool.lru) + used == engine.num_blocks
        assert all(s.nblocks == len(s.held) + s.private for s in engine._running)
        if submitted == 150 and not engine.has_work():
            break
    assert finished == 150
    assert engine.prefix_cache_hits > 0 and engine.preemptions_total > 0


def _open_loop(perf: PerfModel, rate: float, horizon: float, prompt: int, out: int) -> float:
    """Poisson arrivals at ``rate`` on a virtual clock; completions per second over the second
    half of ``horizon`` (the first half lets the running batch fill)."""
    engine = EngineCore(perf)
    gaps = np.random.default_rng(0).exponential(1.0 / rate, size=int(rate * horizon * 1.5) + 10)
    arrivals = np.cumsum(gaps)
    clock, admitted, finished = 0.0, 0, 0
    while clock < horizon:
        while admitted < len(arrivals) and arrivals[admitted] <= clock:
            engine.submit(EngineRequest(f"r{admitted}", tokens(admitted, prompt), out))
            admitted += 1
        if not engine.has_work():
            clock = float(arrivals[admitted])
            continue
        step = engine.step()
        clock += step.duration
        if clock >= horizon / 2:
            finished += len(step.finished)
    return finished / (horizon / 2)


@pytest.mark.parametrize(
    ("perf", "out"),
    [(perf_model("llama-3.2-1b", "a6000"), 40), (tiny_gpu(4096), 200)],
    ids=["roomy", "preempting"],
)
def test_sustained_overload_keeps_throughput_at_saturation(perf: PerfModel, out: int) -> None:
    # Saturation: a backlog that never empties. Twice that rate must not thrash: running
    # requests keep decoding, new ones wait, preemption (tiny KV) evicts the newest only.
    saturation = _open_loop(perf, 1000.0, 20.0, 300, out)
    assert _open_loop(perf, 2.0 * saturation, 40.0, 300, out) >= 0.9 * saturation


@pytest.mark.timeout(30)
def test_priority_scheduling_admits_the_earliest_workflow_request_first() -> None:
    def first_tokens(scheduling: Literal["fcfs", "priority"]) -> list[str]:
        engine = EngineCore(
            perf_model("llama-3.2-1b", "a6000"), max_num_seqs=1, scheduling=scheduling
        )
        for rid, priority in (("late", 5.0), ("early", 1.0), ("early2", 1.0), ("mid", 3.0)):
            engine.submit(EngineRequest(rid, tokens(len(rid), 40), 3, priority=priority))
        _, outs = run(engine)
        return [rid for o in outs for rid in o.first_token]

    assert first_tokens("fcfs") == ["late", "early", "early2", "mid"]
    assert first_tokens("priority") == ["early", "early2", "mid", "late"]  # ties: submission
    with pytest.raises(ValueError, match="scheduling"):
        EngineCore(perf_model("llama-3.2-1b", "a6000"), scheduling="lifo")  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_a_preempted_request_keeps_its_rank_under_priority_scheduling() -> None:
    engine = EngineCore(tiny_gpu(64 * 16), scheduling="priority")
    for i in range(8):
        engine.submit(EngineRequest(f"r{i}", tokens(i, 100), 200, priority=float(8 - i)))
    _, outs = run(engine)
    assert engine.preemptions_total > 0
    finished = [rid for o in outs for rid in o.finished]
    assert finished == [f"r{i}" for i in reversed(range(8))]  # lower priority value first


@pytest.mark.timeout(30)
def test_a_prefilled_request_computes_one_token_then_decodes_the_rest() -> None:
    perf = perf_model("llama-3.2-1b", "a6000")
    engine = EngineCore(perf, enable_prefix_caching=False)
    engine.submit(EngineRequest("a", tokens(1, 2000), 5, prefilled=True))
    _, outs = run(engine)
    assert outs[0].duration == pytest.approx(perf.step_time(1, 0, 0))  # not a 2000-token prefill
    assert not any(o.first_token for o in outs)  # its first token was sampled at prefill
    assert sum(n for o in outs for _, n in o.emitted) == 4
    assert outs[-1].finished == ["a"] and engine.prefix_cache_hits == 0
    assert engine.kv_usage == 0.0

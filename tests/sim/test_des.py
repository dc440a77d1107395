"""The discrete-event simulator: workflow control flow, queueing, contention, traces."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path
from typing import Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optimizer.stats.reader import summarise_store
from shared.store import SegmentWriter, StoreReader
from sim.cluster import Allocation, Router, build_replicas, place
from sim.des import (
    SimResult,
    Simulation,
    WorkflowResult,
    WorkloadSpec,
    simulate,
    simulate_requests,
)
from sim.engine import EngineRequest
from sim.perf import perf_model
from sim.trace import call_rows, open_rows, write_trace
from sim.workflows import BeamParams, FanoutParams, Prompt, RagParams

RAG = Allocation.of(
    ("e5-base-v2", "a6000", 1, 0.2, 1),
    ("bge-reranker-base", "a6000", 1, 0.3, 1),
    ("llama-3-8b", "a6000", 1, 1.0, 1),
)
BEAM = Allocation.of(("llama-3.2-1b", "a6000", 1, 0.5, 2), ("llama-3.1-8b-prm", "a6000", 1, 1.0, 2))


def by_request(result: SimResult) -> dict[str, list]:  # type: ignore[type-arg]
    out: dict[str, list] = defaultdict(list)  # type: ignore[type-arg]
    for c in sorted(result.calls, key=lambda c: c.t_start):
        out[c.request_id].append(c)
    return out


def test_rag_calls_run_in_sequence_and_light_load_latency_is_their_sum() -> None:
    res = simulate(RAG, [WorkloadSpec("rag", 0.5)], n_requests=20, seed=3, record_calls=True)
    assert res.label == "simulated"
    rag = res.workflows["rag"]
    assert rag.completed == 20 and rag.failed == 0
    assert rag.calls_per_request == {"bge-reranker-base": 1.0, "e5-base-v2": 1.0, "llama-3-8b": 1.0}
    for calls in by_request(res).values():
        assert [c.call.endpoint for c in calls] == [
            "/v1/embeddings",
            "/v1/rerank",
            "/v1/chat/completions",
        ]
        for a, b in itertools.pairwise(calls):
            assert b.t_start >= a.t_end
        assert calls[1].t_start - calls[0].t_end == pytest.approx(0.005)  # local search
        assert all(c.t_start <= c.t_first <= c.t_end for c in calls)
    # alone, a chat call is one ~800-token prefill plus 31 decode steps
    p = perf_model("llama-3-8b", "a6000")
    alone = p.step_time(855, 0, 0) + 31 * p.step_time(0, 1, 870)
    assert rag.latency.p50 == pytest.approx(alone + 0.005 + 0.01, rel=0.15)


def test_beam_iterations_fan_out_n_generator_then_n_verifier_calls() -> None:
    res = simulate(BEAM, [WorkloadSpec("beam", 0.2)], n_requests=6, seed=5, record_calls=True)
    beam = res.workflows["beam"]
    assert beam.completed == 6
    gen, ver = beam.calls_per_request["llama-3.2-1b"], beam.calls_per_request["llama-3.1-8b-prm"]
    assert gen == ver and 4 <= gen <= 160
    for calls in by_request(res).values():
        models = [c.call.model for c in calls]
        assert len(calls) % 8 == 0
        for it in range(0, len(calls), 8):  # 4 generator calls, then 4 verifier calls
            assert models[it : it + 4] == ["llama-3.2-1b"] * 4
            assert models[it + 4 : it + 8] == ["llama-3.1-8b-prm"] * 4
            gens, vers = calls[it : it + 4], calls[it + 4 : it + 8]
            assert max(c.t_start for c in gens) < min(c.t_end for c in gens)  # overlapping
            assert min(c.t_start for c in vers) >= max(c.t_end for c in gens)
            assert all(c.call.output_tokens == 1 for c in vers)
        # verifier prompts grow every iteration and reuse the cached beam prefix
        ver_lens = [len(c.call.inputs[0]) for c in calls if c.call.model == "llama-3.1-8b-prm"]
        assert ver_lens[-1] > ver_lens[0]
    assert all(r.prefix_hit_rate > 0.3 for r in res.replicas)


def test_same_seed_same_result_and_fast_forward_changes_nothing_material() -> None:
    work = [WorkloadSpec("beam", 1.0)]
    a = simulate(BEAM, work, n_requests=15, seed=11)
    b = simulate(BEAM, work, n_requests=15, seed=11)
    c = simulate(BEAM, work, n_requests=15, seed=11, fast_forward=False)
    assert a.workflows == b.workflows
    assert a.events < c.events
    assert a.workflows["beam"].latency.mean == pytest.approx(
        c.workflows["beam"].latency.mean, rel=0.03
    )
    d = simulate(BEAM, work, n_requests=15, seed=12)
    assert d.workflows != a.workflows


def test_overload_saturates_throughput_and_more_replicas_help() -> None:
    def rag(chat_replicas: int, rate: float, duration: float) -> WorkflowResult:
        alloc = Allocation.of(
            ("e5-base-v2", "a6000", 1, 0.2, 1),
            ("bge-reranker-base", "a6000", 1, 0.3, 1),
            ("llama-3-8b", "a6000", 1, 1.0, chat_replicas),
        )
        res = simulate(
            alloc, [WorkloadSpec("rag", rate)], duration_s=duration, warmup_s=duration / 3, seed=1
        )
        return res.workflows["rag"]

    light = rag(1, 2.0, 30)
    assert light.throughput == pytest.approx(2.0, rel=0.25)
    over, further = rag(1, 8.0, 100), rag(1, 12.0, 100)
    assert over.throughput < 7.5  # one A6000 prefills ~5k tokens/s: ~6 RAG requests/s
    assert further.throughput == pytest.approx(over.throughput, rel=0.1)  # saturated
    assert further.latency.mean > over.latency.mean > 3 * light.latency.mean
    scaled = rag(3, 12.0, 30)
    assert scaled.throughput == pytest.approx(12.0, rel=0.2)
    assert scaled.latency.mean < further.latency.mean / 5


def test_fanout_calls_two_models_in_parallel_and_workflows_mix() -> None:
    alloc = Allocation.of(
        ("llama-3.2-1b", "a6000", 1, 1.0, 1),
        ("llama-3-8b", "a6000", 1, 1.0, 1),
        ("e5-base-v2", "a6000", 1, 0.2, 1),
        ("bge-reranker-base", "a6000", 1, 0.3, 1),
    )
    res = simulate(
        alloc,
        [
            WorkloadSpec("fanout", 1.0, FanoutParams(rounds=(2, 2))),
            WorkloadSpec("rag", 1.0, name="rag-a"),
        ],
        n_requests=12,
        seed=2,
        record_calls=True,
    )
    assert set(res.workflows) == {"fanout", "rag-a"}
    assert res.workflows["fanout"].calls_per_request == {"llama-3-8b": 2.0, "llama-3.2-1b": 2.0}
    for rid, calls in by_request(res).items():
        if rid.startswith("fanout"):
            small, large = calls[0], calls[1]
            assert {small.call.model, large.call.model} == {"llama-3.2-1b", "llama-3-8b"}
            assert small.t_start == large.t_start


def test_requests_that_cannot_fit_fail_and_unknown_models_are_refused() -> None:
    too_long = RagParams(passage_tokens=2000)  # 5 passages exceed Llama-3-8B's 8k context
    res = simulate(RAG, [WorkloadSpec("rag", 1.0, too_long)], n_requests=3, seed=1)
    assert res.workflows["rag"].failed == 3 and res.workflows["rag"].completed == 0
    with pytest.raises(ValueError, match="no replica serves"):
        simulate(RAG, [WorkloadSpec("beam", 1.0)], n_requests=1)
    with pytest.raises(ValueError, match="BeamParams"):
        simulate(RAG, [WorkloadSpec("beam", 1.0, too_long)], n_requests=1)


def test_placement_packs_shares_and_co_located_replicas_contend() -> None:
    alloc = Allocation.of(
        ("llama-3.2-1b", "a6000", 1, 0.5, 2),
        ("e5-base-v2", "a6000", 1, 0.3, 2),
        ("llama-3-8b", "a6000", 2, 1.0, 1),
    )
    assert alloc.gpus == pytest.approx(1.0 + 0.6 + 2.0)
    gpus = [g for _, g in place(alloc)]
    assert gpus[:2] == [(2,), (2,)] and gpus[2:4] == [(3,), (3,)] and gpus[4] == (0, 1)
    a, b, *_ = build_replicas(alloc)
    assert b in a.peers
    a.apply_contention()
    assert (a.engine.perf.compute_contention, a.engine.perf.memory_contention) == (1.0, 1.0)
    b.engine.submit(EngineRequest("x", Prompt(9, 64), 4))
    a.apply_contention()
    # two busy halves: their solo rates (1/1.665 compute, 1/1.09 memory each) sum past 1
    assert a.engine.perf.compute_contention == pytest.approx(2 / 1.665)
    assert a.engine.perf.memory_contention == pytest.approx(2 / 1.09)
    assert (
        a.engine.perf.step_time(0, 1, 64)
        > 1.5 * perf_model("llama-3.2-1b", "a6000", share=0.5).step_time(0, 1, 64) - 0.004
    )


def test_router_policies_balance_outstanding_calls() -> None:
    import random

    replicas = build_replicas(Allocation.of(("llama-3.2-1b", "a6000", 1, 1.0, 4)))
    for policy in ("p2c", "least", "affinity"):
        for r in replicas:
            r.outstanding = 0
        router = Router(replicas, policy, random.Random(0))
        for key in range(400):
            router.pick("llama-3.2-1b", key % 7 if policy == "affinity" else key).outstanding += 1
        counts = sorted(r.outstanding for r in replicas)
        assert counts[-1] - counts[0] <= (30 if policy == "p2c" else 9)


def test_prompt_block_hashes_match_for_equal_segment_chains() -> None:
    root = Prompt(1, 140).extend(77, 30)
    a, b = root.extend(5, 50), root.extend(6, 50)
    ha, hb = a.block_hashes(16), b.block_hashes(16)
    assert ha[:10] == hb[:10] and ha[10] != hb[10]
    assert Prompt(1, 140).extend(77, 30).extend(5, 50).block_hashes(16) == ha
    assert len(a) == 220 and len(ha) == 13 and list(a)[139:141] == [a[139], a[140]]


def _reference_block_hashes(segments: list[tuple[int, int]], block: int) -> list[int]:
    """Block hashes token by token: each block named by its runs of (key, offset, length)."""
    tokens = [(key, i) for key, length in segments for i in range(length)]
    out, prev = [], 0
    for lo in range(0, len(tokens) - block + 1, block):
        pieces: list[tuple[int, int, int]] = []
        for key, i in tokens[lo : lo + block]:
            if pieces and pieces[-1][0] == key and pieces[-1][1] + pieces[-1][2] == i:
                pieces[-1] = (key, pieces[-1][1], pieces[-1][2] + 1)
            else:
                pieces.append((key, i, 1))
        prev = hash((prev, tuple(pieces)))
        out.append(prev)
    return out


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 70)), min_size=1, max_size=6),
    st.sampled_from([4, 16, 32]),
)
def test_prompt_block_hashes_name_each_block_by_its_pieces(
    segments: list[tuple[int, int]], block: int
) -> None:
    prompt = Prompt(*segments[0])
    for key, length in segments[1:]:
        prompt = prompt.extend(key, length)
    assert prompt.block_hashes(block) == _reference_block_hashes(segments, block)


def test_trace_rows_go_through_the_store(tmp_path: Path) -> None:
    res = simulate(RAG, [WorkloadSpec("rag", 1.0)], n_requests=5, seed=4, record_calls=True)
    rows = call_rows(res)
    assert len(rows) == 15
    paths = write_trace(res, tmp_path)
    assert paths
    reader = StoreReader(tmp_path)
    got = reader.calls().fetchall()
    cols = [d[0] for d in reader.calls().description]
    assert len(got) == 15
    rec = [dict(zip(cols, r, strict=True)) for r in got]
    assert {r["proxy_id"] for r in rec} == {"simulated"}
    chat = [r for r in rec if r["endpoint"] == "/v1/chat/completions"]
    body = json.loads(chat[0]["body"])
    words = body["messages"][0]["content"].split()
    assert len(words) == chat[0]["prompt_tokens"] and body["max_tokens"] == 32
    rerank = json.loads(next(r for r in rec if r["endpoint"] == "/v1/rerank")["body"])
    assert len(rerank["documents"]) == 20 and len(rerank["query"].split()) == 15
    assert all(r["t_start"] <= r["t_first_byte"] <= r["t_end"] for r in rec)
    reader.close()
    with pytest.raises(ValueError, match="record_calls"):
        write_trace(simulate(RAG, [WorkloadSpec("rag", 1.0)], n_requests=1), tmp_path)


def test_beam_params_depth_follows_the_stop_rule() -> None:
    quick = BeamParams(eos_probability=1.0)  # every beam ends at its first step
    res = simulate(BEAM, [WorkloadSpec("beam", 1.0, quick)], n_requests=3, seed=1)
    assert res.workflows["beam"].calls_per_request["llama-3.2-1b"] == 4.0
    capped = BeamParams(eos_probability=0.0, max_iterations=3)
    res = simulate(BEAM, [WorkloadSpec("beam", 1.0, capped)], n_requests=3, seed=1)
    assert res.workflows["beam"].calls_per_request["llama-3.2-1b"] == 12.0


def test_prefix_affinity_mirrors_the_proxy_router() -> None:
    import random

    replicas = build_replicas(Allocation.of(("llama-3.2-1b", "a6000", 1, 1.0, 3)))
    router = Router(replicas, "prefix_affinity", random.Random(0))
    # a conversation that grows keeps its replica (most of its blocks were seen there)
    turn = Prompt(1, 140).extend(77, 300)
    first = router.pick("llama-3.2-1b", 0, turn)
    first.outstanding += 1
    for k in range(5):
        turn = turn.extend(100 + k, 60)
        assert router.pick("llama-3.2-1b", 0, turn) is first
    # a prompt sharing only a short system prompt goes to the least loaded replica
    other = router.pick("llama-3.2-1b", 0, Prompt(1, 140).extend(78, 900))
    assert other is not first and other.outstanding == 0
    # far busier than the least loaded: the preferred replica is passed over
    first.outstanding += 9
    assert router.pick("llama-3.2-1b", 0, turn.extend(200, 60)) is not first
    # a replica taken out of the pool is never picked again, even for its own prefixes
    first.outstanding = 0
    router.by_model["llama-3.2-1b"].remove(first)
    assert router.pick("llama-3.2-1b", 0, turn.extend(201, 60)) is not first
    router.by_model["llama-3.2-1b"].append(first)
    # no chat prompt (embeddings, rerank): the proxy's power of two choices
    picks = {router.pick("llama-3.2-1b", 0, None).name for _ in range(60)}
    assert len(picks) == 3


def test_a_prefix_every_replica_holds_spreads_like_the_proxy() -> None:
    """As ``proxy.router``: a long system prompt that every replica has served does not herd
    new requests onto the last replica that served it; a request's own continuation sticks."""
    import random

    replicas = build_replicas(Allocation.of(("llama-3.2-1b", "a6000", 1, 1.0, 4)))
    router = Router(replicas, "prefix_affinity", random.Random(0))
    homes = []
    for i in range(40):  # system prompt of 400 tokens, then each request's own 60
        prompt = Prompt(1, 400).extend(1000 + i, 60)
        rep = router.pick("llama-3.2-1b", i, prompt)
        rep.outstanding += 1
        homes.append((prompt, rep))
    loads = sorted(r.outstanding for r in replicas)
    assert loads[-1] - loads[0] <= 2, loads
    for prompt, home in homes[::7]:
        assert router.pick("llama-3.2-1b", 0, prompt.extend(7, 40)) is home


def test_prefix_table_cuts_prompts_like_the_proxy() -> None:
    from sim.cluster import PrefixTable

    table = PrefixTable(block=32, limit=128, capacity=4)
    a = Prompt(1, 100).extend(5, 20)  # 120 tokens: 3 full blocks and a partial one
    b = Prompt(1, 100).extend(6, 20)
    ka, kb = table.keys(a), table.keys(b)
    assert len(ka) == 4 and ka[:3] == kb[:3] and ka[3] != kb[3]
    assert table.keys(Prompt(1, 100).extend(5, 20)) == ka  # equal prompts, equal keys
    assert len(table.keys(a.extend(9, 500))) == 4  # only the first `limit` tokens count


def test_default_routing_keeps_a_beam_on_its_replica_and_its_prefix_cache() -> None:
    alloc = Allocation.of(
        ("llama-3.2-1b", "a6000", 1, 1.0, 3), ("llama-3.1-8b-prm", "a6000", 1, 1.0, 3)
    )
    work = [WorkloadSpec("beam", 0.5, BeamParams(max_iterations=6))]
    hits = {}
    for routing in ("p2c", "prefix_affinity"):
        res = simulate(alloc, work, n_requests=12, seed=3, record_calls=True, routing=routing)
        hits[routing] = sum(c.cached_tokens for c in res.calls)
        if routing == "prefix_affinity":
            default = simulate(alloc, work, n_requests=12, seed=3)
            assert default.workflows == res.workflows
    assert hits["prefix_affinity"] > 1.1 * hits["p2c"]


def test_run_time_hook_adds_withdraws_replicas_and_changes_rates() -> None:
    one = Allocation.of(
        ("e5-base-v2", "a6000", 1, 0.2, 1),
        ("bge-reranker-base", "a6000", 1, 0.3, 1),
        ("llama-3-8b", "a6000", 1, 1.0, 1),
    )
    sim = Simulation(one, [WorkloadSpec("rag", 2.0)], seed=4, record_calls=True)
    first = sim.serving("llama-3-8b")[0]
    extra = build_replicas(Allocation.of(("llama-3-8b", "a6000", 1, 1.0, 1)))
    for r in extra:
        r.name = "llama-3-8b/late"
    fired: list[float] = []

    def grow() -> None:
        fired.append(sim.now)
        sim.add_replicas(extra)

    def shrink() -> None:
        fired.append(float(sim.withdraw(first)))
        sim.set_rate(0, 0.5)

    sim.at(20.0, grow)
    # the last serving replica stays; once a second one serves, the first one drains
    sim.at(10.0, lambda: fired.append(float(sim.withdraw(first))))
    sim.at(40.0, shrink)
    end = sim.run(80.0, None, 60.0)
    assert fired == [0.0, 20.0, 1.0]
    assert sim.serving("llama-3-8b") == extra
    chat = [c for c in sim.trace if c.call.model == "llama-3-8b"]
    late = [c for c in chat if c.replica == "llama-3-8b/late"]
    assert late and min(c.t_start for c in late) >= 20.0
    assert not [c for c in chat if c.replica != "llama-3-8b/late" and c.t_start > 40.0]
    # the rate drop: arrivals per second before and after 40 s
    before = sum(1 for r in sim.runs if r.arrival < 40.0) / 40.0
    after = sum(1 for r in sim.runs if r.arrival >= 40.0) / 40.0
    assert before > 1.4 and after < 1.0
    res = sim.result(0.0, end)
    assert res.workflows["rag"].failed == 0 and len(res.replicas) == 4


def test_open_calls_make_queued_requests_visible(tmp_path: Path) -> None:
    """Stopped mid-overload, the calls in flight come back as open rows that share call ids
    with the finished rows a longer run writes; with them the store counts every request
    that arrived, and only the finished ones as complete."""
    sim = Simulation(BEAM, [WorkloadSpec("beam", 6.0)], seed=5, record_calls=True)
    sim.run(20.0, None, 0.0)
    running = sim.open_calls()
    assert running and all(c.t_end == -1.0 for c in running)
    assert len({c.call_id for c in running}) == len(running)
    shell = SimResult(
        "simulated", sim.seed, sim.now, 0.0, 0, (0.0, sim.now), {}, (), tuple(sim.trace)
    )
    finished = call_rows(shell, bodies=False)
    opened = open_rows(running, seed=sim.seed)
    assert not {r[0] for r in opened} & {r[0] for r in finished}  # all still running
    writer = SegmentWriter(tmp_path, "simulated")
    writer.write(finished)
    seen_without = summarise_store(tmp_path)["beam"]
    writer.write(opened)
    writer.close()
    beam = summarise_store(tmp_path)["beam"]
    done = sum(1 for r in sim.runs if r.end >= 0)
    assert beam.arrivals == len(sim.runs) > seen_without.arrivals
    assert beam.requests == done < len(sim.runs)


def _saturated_rerank_calls_per_s(share: float, count: int) -> float:
    """Rerank calls/s the reranker's replicas complete under a RAG load far past their
    capacity, every other model over-provisioned (simulated)."""
    alloc = Allocation.of(
        ("e5-base-v2", "a6000", 1, 1.0, 8),
        ("llama-3-8b", "a6000", 1, 1.0, 40),
        ("bge-reranker-base", "a6000", 1, share, count),
    )
    res = simulate(
        alloc, [WorkloadSpec("rag", 200.0)], duration_s=30.0, seed=3, record_calls=True, drain_s=0
    )
    done = [c for c in res.calls if c.replica.startswith("bge-reranker-base/") and c.t_end >= 10]
    return len([c for c in done if c.t_end < 30.0]) / 20.0


@pytest.mark.timeout(120)
def test_two_half_shares_never_serve_more_than_one_whole_gpu_at_saturation() -> None:
    whole = _saturated_rerank_calls_per_s(1.0, 1)
    halves = _saturated_rerank_calls_per_s(0.5, 2)
    # two schedulers batch twice the tokens per step at most: a sliver of launch overhead
    assert 0.8 * whole < halves <= 1.03 * whole


@pytest.mark.timeout(60)
def test_ayo_options_hit_no_cache_and_finish_workflow_requests_in_start_order() -> None:
    one = Allocation.of(("llama-3-8b", "a6000", 1, 1.0, 1))
    spec = [WorkloadSpec("fanout", 2.0, FanoutParams(models=("llama-3-8b", "llama-3-8b")))]

    def ends(
        prefix: bool = True, scheduling: Literal["fcfs", "priority"] = "fcfs"
    ) -> tuple[list[float], float]:
        res, spans = simulate_requests(
            one,
            spec,
            n_requests=20,
            seed=4,
            max_num_seqs=1,
            enable_prefix_caching=prefix,
            scheduling=scheduling,
        )
        assert all(s.end >= 0 for s in spans)
        return [s.end for s in spans], res.replicas[0].prefix_hit_rate

    fcfs, hits = ends()
    assert hits > 0 and fcfs != sorted(fcfs)  # later requests overtake under FCFS
    ayo, no_hits = ends(False, "priority")
    assert no_hits == 0.0
    assert ayo == sorted(ayo)  # an earlier-started request's calls always go first

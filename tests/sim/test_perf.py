"""The performance model against shared/reference/calibration.md (one call per figure)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from sim.perf import GPUS, MODELS, PerfModel, contention, perf_model


def ratio(a: float, b: float) -> float:
    return a / b


def test_llama3_8b_batch1_decode_on_a6000_is_near_the_roofline() -> None:
    roofline = 16.1e9 / (0.75 * 768e9)  # calibration.md: weight bytes / (η · HBM), ≈ 28 ms
    assert roofline == pytest.approx(0.028, rel=0.01)
    t = perf_model("llama-3-8b", "a6000").step_time(0, 1, 512)
    assert roofline <= t <= 1.15 * roofline


@pytest.mark.parametrize(("gpu", "roofline_ms"), [("a6000", 4.3), ("a100", 1.6), ("h100", 1.0)])
def test_small_model_decode_is_dominated_by_step_overhead(gpu: str, roofline_ms: float) -> None:
    p = perf_model("llama-3.2-1b", gpu)
    assert p.decode_roofline() * 1e3 == pytest.approx(roofline_ms, rel=0.1)
    t = p.step_time(0, 1, 256)
    assert t - p.decode_roofline() == pytest.approx(0.0035, abs=0.0015)  # cal: +3-5 ms/step


def test_decode_stays_nearly_flat_to_batch_8_then_grows() -> None:
    p = perf_model("llama-3-8b", "a100")
    one, eight, big = (
        p.step_time(0, 1, 512),
        p.step_time(0, 8, 8 * 512),
        p.step_time(0, 128, 128 * 512),
    )
    assert 8 * one / eight == pytest.approx(6.6, rel=0.15)  # cal: 6.6x throughput at concurrency 8
    assert big > 2 * eight


def tp_speedup(tp: int, prefill: int, decode: int, context: int) -> float:
    base = perf_model("llama-3-8b", "a100").step_time(prefill, decode, context)
    return base / perf_model("llama-3-8b", "a100", tp=tp).step_time(prefill, decode, context)


@pytest.mark.parametrize(
    ("tp", "prefill", "decode", "context", "published", "tolerance"),
    [
        (2, 32 * 256, 0, 0, 1.78, 0.10),  # cal: prefill 32 x 256, TP2 1.78x
        (4, 32 * 256, 0, 0, 2.97, 0.10),
        (8, 32 * 256, 0, 0, 4.49, 0.10),
        (2, 0, 1, 128, 0.93, 0.05),  # cal: batch-1 decode TP2 0.93x (slower)
        (2, 0, 128, 128 * 512, 1.43, 0.10),  # cal: batch-128 decode TP2 1.43x
        (4, 0, 128, 128 * 512, 2.08, 0.10),  # cal: batch-128 decode TP4 2.08x
    ],
)
def test_tensor_parallel_speedups_have_the_published_shape(
    tp: int, prefill: int, decode: int, context: int, published: float, tolerance: float
) -> None:
    assert tp_speedup(tp, prefill, decode, context) == pytest.approx(published, rel=tolerance)


def test_tp_helps_prefill_more_than_large_decode_more_than_small_decode() -> None:
    for tp in (2, 4, 8):
        prefill = tp_speedup(tp, 8192, 0, 0)
        large = tp_speedup(tp, 0, 128, 128 * 512)
        small = tp_speedup(tp, 0, 1, 128)
        assert prefill > large > small


MPS = {  # cal: time at a share relative to 100% of SMs (7B on A100)
    "prefill 8x128": ((1024, 0, 0), (2.74, 2.08, 1.68, 1.42, 1.25, 1.13, 1.04)),
    "prefill 32x256": ((8192, 0, 0), (2.67, 1.98, 1.65, 1.42, 1.26, 1.14, 1.07)),
    "decode 1x128": ((0, 1, 128), (1.41, 1.26, 1.09, 1.07, 1.05, 1.03, 1.00)),
    "decode 8x128": ((0, 8, 8 * 128), (1.46, 1.25, 1.09, 1.06, 1.05, 1.04, 1.00)),
    "decode 128x256": ((0, 128, 128 * 256), (1.72, 1.59, 1.29, 1.14, 1.04, 1.03, 1.00)),
}
SHARES = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def share_slowdown(share: float, prefill: int, decode: int, context: int) -> float:
    full = perf_model("llama-3-8b", "a100").step_time(prefill, decode, context)
    return perf_model("llama-3-8b", "a100", share=share).step_time(prefill, decode, context) / full


@pytest.mark.parametrize("row", sorted(MPS))
def test_gpu_share_slowdowns_follow_the_mps_table(row: str) -> None:
    shape, published = MPS[row]
    got = [share_slowdown(s, *shape) for s in SHARES]
    # decode 128x256 mixes compute and memory; the table has it steeper at 40-70%
    tolerance = 0.15 if row == "decode 128x256" else 0.10
    for share, g, p in zip(SHARES, got, published, strict=True):
        assert g == pytest.approx(p, rel=tolerance), f"{row} at {share}"
    assert got == sorted(got, reverse=True)  # more SMs never slower


def test_small_shares_extrapolate_past_the_table() -> None:
    assert share_slowdown(0.1, 1024, 0, 0) == pytest.approx(
        3 * share_slowdown(0.3, 1024, 0, 0), rel=0.1
    )
    assert 1.41 < share_slowdown(0.1, 0, 1, 128) < 3.0


def test_a_busy_neighbour_slows_decode_and_prefill_an_idle_one_nothing() -> None:
    half = perf_model("llama-3-8b", "a6000", share=0.5)
    compute, memory = contention((0.5, 0.5))
    both = dataclasses.replace(half, compute_contention=compute, memory_contention=memory)
    # two halves busy: each gets half the GPU's bandwidth and half its SMs' work
    assert ratio(both.step_time(0, 1, 512), half.step_time(0, 1, 512)) == pytest.approx(
        2.0 / 1.09, rel=0.05
    )
    assert ratio(both.step_time(8192, 0, 0), half.step_time(8192, 0, 0)) == pytest.approx(
        2.0 / 1.665, rel=0.05
    )
    assert contention((0.5,)) == (1.0, 1.0)  # alone on its half: the MPS table's factors only
    # three quarter-shares busy: their solo compute sums to under one GPU, so only bandwidth
    # contends (the table's idle SMs at small shares)
    compute, memory = contention((0.25, 0.25, 0.25))
    assert compute == 1.0 and memory > 1.0


@settings(max_examples=200, deadline=None)
@given(
    k=st.integers(2, 6),
    prefill=st.integers(0, 2048),
    decode=st.integers(0, 64),
    context=st.integers(0, 50_000),
    model=st.sampled_from(["llama-3-8b", "llama-3.2-1b", "e5-base-v2"]),
)
def test_shares_that_fill_one_gpu_never_serve_more_than_the_whole_gpu(
    k: int, prefill: int, decode: int, context: int, model: str
) -> None:
    """k busy clients of share 1/k, each with a batch, take at least as long per step as the
    whole GPU takes for all k batches at once: together they never serve more."""
    assume(prefill + decode > 0)
    whole = perf_model(model, "a6000")
    compute, memory = contention([1.0 / k] * k)
    part = dataclasses.replace(
        perf_model(model, "a6000", share=1.0 / k),
        compute_contention=compute,
        memory_contention=memory,
    )
    t_part = part.step_time(prefill, decode, context)
    assert t_part >= whole.step_time(k * prefill, k * decode, k * context) * (1 - 1e-9)


def test_tensor_parallel_link_follows_the_placement() -> None:
    nvlink = perf_model("llama-3-8b", "a6000", tp=2)
    assert nvlink.link_bytes_per_s == nvlink.gpu.link_bytes_per_s  # a pair fits a domain
    pcie = dataclasses.replace(nvlink, nvlink=False)  # placed across two domains
    assert pcie.link_bytes_per_s == nvlink.gpu.pcie_bytes_per_s
    assert pcie.step_time(4096, 0, 0) > nvlink.step_time(4096, 0, 0)
    # all-reduce on a share runs on fewer SMs: slower than on whole GPUs
    shared = dataclasses.replace(nvlink, share=0.25)
    assert shared._allreduce_time(4096) > nvlink._allreduce_time(4096)


def test_kv_capacity_counts_share_tp_weights_and_reserve() -> None:
    full = perf_model("llama-3-8b", "a6000").kv_capacity_tokens()
    assert full == int((0.9 * 48e9 - 16.1e9 - 1e9) // (128 * 1024))
    assert perf_model("llama-3-8b", "a6000", tp=2).kv_capacity_tokens() > 2 * full
    assert perf_model("llama-3-8b", "a6000", share=0.3).kv_capacity_tokens() == 0  # too small
    assert perf_model("e5-base-v2", "a6000", share=0.1).kv_capacity_tokens() > 10_000


def test_step_time_is_monotone_and_zero_when_empty() -> None:
    for model in MODELS:
        for gpu in GPUS:
            p = perf_model(model, gpu)
            assert p.step_time(0, 0, 0) == 0.0
            base = p.step_time(64, 4, 1000)
            assert p.step_time(128, 4, 1000) > base
            assert p.step_time(64, 8, 1000) > base
            assert p.step_time(64, 4, 2000) > base


def test_encoders_are_far_cheaper_than_generators() -> None:
    embed = perf_model("e5-base-v2", "a6000").step_time(20 * 150, 0, 0)
    rerank = perf_model("bge-reranker-base", "a6000").step_time(20 * 150, 0, 0)
    chat = perf_model("llama-3-8b", "a6000").step_time(800, 0, 0)
    assert embed < rerank < chat / 4


def test_bad_names_and_values_raise() -> None:
    with pytest.raises(ValueError, match="unknown model"):
        perf_model("gpt-5", "a6000")
    with pytest.raises(ValueError, match="unknown GPU"):
        perf_model("llama-3-8b", "tpu")
    with pytest.raises(ValueError, match="power of two"):
        perf_model("llama-3-8b", "a100", tp=3)
    with pytest.raises(ValueError, match="share"):
        PerfModel(MODELS["llama-3-8b"], GPUS["a100"], share=0.0)

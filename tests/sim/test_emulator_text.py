"""Pure parts of the emulator: tokenisation, planned generations, vectors and relevance."""

from __future__ import annotations

import statistics

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.text import (
    GenerationRequest,
    LengthModel,
    plan_generation,
    prm_top_logprobs,
    render_chat,
    token_ids,
)
from sim.vectors import cosine, embed, relevance

LENGTHS = LengthModel()


def test_shared_leading_text_shares_leading_token_ids() -> None:
    system = [
        {"role": "system", "content": "Solve the problem step by step."},
        {"role": "user", "content": "What is 3 * 7?"},
    ]
    a = token_ids(
        render_chat(
            [*system, {"role": "assistant", "content": "First, multiply."}],
            add_generation_prompt=False,
            continue_final_message=True,
        )
    )
    b = token_ids(
        render_chat(
            [*system, {"role": "assistant", "content": "First, add."}],
            add_generation_prompt=False,
            continue_final_message=True,
        )
    )
    common = token_ids(render_chat(system, add_generation_prompt=False))
    assert a[: len(common)] == b[: len(common)] == common
    assert a != b


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 2**32),
    st.integers(1, 400),
    st.sampled_from([(), ("\n\n",), (" the",)]),
    st.booleans(),
)
def test_deltas_join_to_text_and_never_show_a_stop(
    key: int, max_tokens: int, stop: tuple[str, ...], incl: bool
) -> None:
    req = GenerationRequest("prompt", max_tokens, stop, key, include_stop_str_in_output=incl)
    gen = plan_generation(req, 0, seed=1, lengths=LENGTHS)
    assert 1 <= len(gen.tokens) <= max_tokens
    assert len(gen.deltas) == len(gen.tokens) == len(gen.logprobs)
    assert "".join(gen.deltas) == gen.text
    if gen.stop_reason is not None:
        assert gen.finish_reason == "stop" and gen.stop_reason in stop
        if incl:
            assert gen.text.endswith(gen.stop_reason)
    if not incl:
        assert not any(s in gen.text for s in stop)
    assert gen == plan_generation(req, 0, seed=1, lengths=LENGTHS)  # deterministic


def test_step_lengths_follow_the_configured_median() -> None:
    req = GenerationRequest("p", 4096, ("\n\n",), 0)
    lengths = [
        len(
            plan_generation(
                GenerationRequest("p", 4096, ("\n\n",), k), 0, seed=0, lengths=LENGTHS
            ).tokens
        )
        for k in range(300)
    ]
    assert 50 <= statistics.median(lengths) <= 70
    ends = [
        plan_generation(
            GenerationRequest("p", 4096, ("\n\n",), k), 0, seed=0, lengths=LENGTHS
        ).stop_reason
        for k in range(300)
    ]
    eos_share = ends.count(None) / len(ends)
    assert 0.05 <= eos_share <= 0.16  # ~eos_probability = 0.1, independently per sample
    assert plan_generation(req, 0, seed=0, lengths=LengthModel(median_tokens=10)).tokens


def test_prm_top_logprobs_hold_both_verdicts_with_their_probabilities() -> None:
    top = dict(prm_top_logprobs(0.8, 4))
    assert list(top)[:2] == ["+", "-"] and len(top) == 4
    p = np.exp(top["+"]) / (np.exp(top["+"]) + np.exp(top["-"]))
    assert abs(p - 0.8) < 1e-9
    assert set(dict(prm_top_logprobs(0.3, 0))) == {"+", "-"}


def test_vectors_are_unit_deterministic_and_similarity_follows_overlap() -> None:
    v = embed("a glacier carves a fjord", 768)
    assert abs(float(np.linalg.norm(v)) - 1) < 1e-5 and np.array_equal(
        v, embed("a glacier carves a fjord", 768)
    )
    assert abs(float(np.linalg.norm(embed("", 64))) - 1) < 1e-5
    q = "query: glacier meltwater in the fjord"
    assert (
        cosine(q, "passage: the glacier meltwater fills the fjord", 768)
        > cosine(q, "passage: the orchestra played a symphony", 768) + 0.3
    )
    assert relevance(q, "glacier fjord meltwater") > 0.6 > 0.3 > relevance(q, "chess opening")

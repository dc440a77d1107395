"""Usage extraction from bodies and events without parsing whole embedding responses."""

from __future__ import annotations

import orjson

from proxy.relay import apply_usage, find_usage
from shared.records import CallRecord


def test_usage_with_nested_details_at_the_end_of_a_large_body() -> None:
    body = orjson.dumps(
        {
            "data": [{"embedding": [0.1] * 5000, "note": "a {brace} in text"}],
            "usage": {
                "prompt_tokens": 7,
                "total_tokens": 7,
                "prompt_tokens_details": {"cached_tokens": 3},
            },
        }
    )
    assert find_usage(body) == {
        "prompt_tokens": 7,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 3},
    }


def test_null_or_missing_usage_is_unknown() -> None:
    assert find_usage(b'data: {"choices": [{"delta": {}}], "usage": null}\n\n') is None
    assert find_usage(b'{"choices": []}') is None
    assert find_usage(b'{"usage": {"prompt_tokens": 1') is None  # cut short


def test_apply_usage_reads_rerank_totals_and_keeps_unknowns_unknown() -> None:
    rec = CallRecord("c", "p", "w", None, "m", "/rerank")
    apply_usage(rec, {"total_tokens": 21})
    assert (rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens) == (21, 0, None)

"""What counts as a credential in a stored body, and what an error text may not keep."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.records import MAX_BODY_DEPTH, BodyTooDeep, is_secret_name, redact_text, scrub_body

SECRET_NAMES = [
    "api_key",
    "apiKey",
    "x-api-key",
    "openai_api_key",
    "authorization",
    "password",
    "db_password",
    "passwd",
    "passphrase",
    "secret",
    "client_secret",
    "secret_key",
    "aws_secret_access_key",
    "private_key",
    "privateKey",
    "access_token",
    "refresh_token",
    "refreshToken",
    "id_token",
    "session_token",
    "hf_token",
    "HF-TOKEN",
    "token",
    "bearer",
    "credentials",
    "google_application_credentials",
    "cookie",
    "Set-Cookie",
    "key",
    "jwt",
    "auth",
    "signing_key",
]
# Body fields engines and clients send that hold no secret: kept as they are.
PLAIN_NAMES = [
    "model",
    "messages",
    "content",
    "role",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "cached_tokens",
    "truncate_prompt_tokens",
    "add_special_tokens",
    "skip_special_tokens",
    "stop_token_ids",
    "return_tokens_as_token_ids",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "top_k",
    "temperature",
    "stream_options",
    "include_usage",
    "prompt_cache_key",
    "tokenizer",
    "eos_token",
    "bos_token",
    "session_id",
    "user",
    "metadata",
    "response_format",
    "keywords",
    "tool_choice",
]


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_secret_names(name: str) -> None:
    assert is_secret_name(name)


@pytest.mark.parametrize("name", PLAIN_NAMES)
def test_plain_names(name: str) -> None:
    assert not is_secret_name(name)


_SECRET_TAILS = ["token", "api_key", "secret", "password", "private_key", "credentials"]


@settings(max_examples=200, deadline=None, database=None)
@given(
    prefix=st.from_regex(r"[a-z][a-z0-9]{0,11}", fullmatch=True),
    tail=st.sampled_from(_SECRET_TAILS),
    sep=st.sampled_from(["_", "-", "", "."]),
    upper=st.booleans(),
)
def test_any_name_ending_in_a_secret_word_is_a_secret(
    prefix: str, tail: str, sep: str, upper: bool
) -> None:
    name = f"{prefix}{sep}{tail}"
    assert is_secret_name(name.upper() if upper else name)


@settings(max_examples=100, deadline=None, database=None)
@given(
    value=st.text(min_size=1, max_size=20),
    name=st.sampled_from(SECRET_NAMES),
    depth=st.integers(0, 5),
)
def test_scrubbed_body_never_holds_a_secret_value(value: str, name: str, depth: int) -> None:
    body: dict[str, object] = {"model": "m", name: "SECRET-" + value}
    for _ in range(depth):
        body = {"model": "m", "nested": [body]}
    raw = orjson.dumps(body)
    stored = scrub_body(raw, orjson.loads(raw))
    assert "SECRET-" not in stored and orjson.loads(stored)["model"] == "m"


def test_too_deep_a_body_is_refused_not_a_recursion_error() -> None:
    # ~1,000 levels: orjson reads it (its limit is 1,024), a recursive walk must not.
    raw = b'{"model": "m", "x": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    with pytest.raises(BodyTooDeep):
        scrub_body(raw, orjson.loads(raw))
    edge = b"[" * MAX_BODY_DEPTH + b"]" * MAX_BODY_DEPTH
    assert scrub_body(edge, orjson.loads(edge)) == edge.decode()
    shallow = orjson.dumps({"x": [[[[1]]]]})
    assert scrub_body(shallow, orjson.loads(shallow)) == shallow.decode()


@pytest.mark.parametrize(
    ("text", "secrets", "kept"),
    [
        ("Incorrect API key provided: my-key-123. See docs.", ["my-key-123"], "See docs."),
        ('{"error": "bad key sk-proj-AbCdEf0123456789"}', [], '"error": "bad key'),
        ("header was Authorization: Bearer abc.def.ghi, refused", [], "refused"),
        ("hf token hf_abcdefghijklmnop rejected", [], "rejected"),
    ],
)
def test_redact_text(text: str, secrets: list[str], kept: str) -> None:
    out = redact_text(text, secrets)
    assert "[redacted]" in out and kept in out
    for secret in ("my-key-123", "sk-proj-AbCdEf", "abc.def.ghi", "hf_abcdefghijklmnop"):
        assert secret not in out
    assert redact_text("plain engine error: out of memory") == "plain engine error: out of memory"

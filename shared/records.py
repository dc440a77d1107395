"""The call record: one row per upstream call attempt that reached the proxy (DESIGN §3.2).

Role: the schema shared by the proxy (which fills records), the store (which writes and reads
them) and the optimizer (which summarises them). Column order and SQL types live here only.

Invariants:
- times are integer microseconds since the epoch (UTC); ``t_first_byte`` and token counts are
  ``None`` when unknown (a stream cut before its usage event leaves usage unknown, not zero);
- a retried call keeps its ``call_id``; ``attempt`` counts from 0 across client retries
  (``x-stainless-retry-count``) and the proxy's own retry;
- ``body`` never holds credentials: :func:`scrub_body` removes secret-looking keys
  (:func:`is_secret_name`), and ``error`` text is passed through :func:`redact_text`;
- every row the store is handed has passed :func:`storable`: integers fit their column (else
  null),
  text is valid UTF-8 (a lone surrogate, from a non-UTF-8 byte a client sent, becomes U+FFFD)
  and bounded (``MAX_TEXT`` characters, ``MAX_BODY`` for the body), so no client value can
  make the writer refuse a row;
- an *open* row (``t_end`` null) announces a call still in flight when the proxy flushed
  (:meth:`CallRecord.opened`): it carries the identity and ``t_start`` of the finished row that
  follows it (same ``call_id``, ``attempt`` and ``t_start``), no outcome and no body. Readers
  let a finished row supersede it; until one does, the call's request is still running. A
  finished row always has ``t_end``.
"""

from __future__ import annotations

import itertools
import re
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import astuple, dataclass, fields
from typing import Any

import orjson

# (column, DuckDB type). The order is the Parquet column order.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("call_id", "VARCHAR"),
    ("proxy_id", "VARCHAR"),
    ("workflow", "VARCHAR"),
    ("request_id", "VARCHAR"),
    ("model", "VARCHAR"),
    ("endpoint", "VARCHAR"),
    ("upstream", "VARCHAR"),
    ("attempt", "BIGINT"),
    ("status", "INTEGER"),
    ("error", "VARCHAR"),
    ("stream", "BOOLEAN"),
    ("t_start", "BIGINT"),
    ("t_first_byte", "BIGINT"),
    ("t_end", "BIGINT"),
    ("prompt_tokens", "BIGINT"),
    ("completion_tokens", "BIGINT"),
    ("cached_tokens", "BIGINT"),
    ("request_bytes", "BIGINT"),
    ("response_bytes", "BIGINT"),
    ("body", "VARCHAR"),
)
COLUMN_NAMES: tuple[str, ...] = tuple(name for name, _ in COLUMNS)
# What an open row (a call still in flight) carries: who called what, where, since when.
_OPEN_COLUMNS = frozenset(
    {
        "call_id",
        "proxy_id",
        "workflow",
        "request_id",
        "model",
        "endpoint",
        "upstream",
        "attempt",
        "stream",
        "t_start",
        "request_bytes",
    }
)


@dataclass(slots=True)
class CallRecord:
    """Mutable while the call runs; handed to the recorder once, in the handler's ``finally``."""

    call_id: str
    proxy_id: str
    workflow: str | None
    request_id: str | None
    model: str
    endpoint: str
    upstream: str | None = None
    attempt: int = 0
    status: int | None = None
    error: str | None = None
    stream: bool = False
    t_start: int = 0
    t_first_byte: int | None = None
    t_end: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    request_bytes: int = 0
    response_bytes: int = 0
    body: str | None = None

    def row(self) -> tuple[Any, ...]:
        return astuple(self)

    def opened(self) -> tuple[Any, ...]:
        """The open row announcing this call while it runs (see the module docstring)."""
        return tuple(
            getattr(self, name) if name in _OPEN_COLUMNS else None for name in COLUMN_NAMES
        )


assert tuple(f.name for f in fields(CallRecord)) == COLUMN_NAMES, "schema and record disagree"


MAX_TEXT = 4096  # characters of an identity, model, endpoint or error column
MAX_BODY = 64 * 2**20  # characters of a stored request body (above any body the proxy accepts)
_INT_RANGES = {"BIGINT": range(-(2**63), 2**63), "INTEGER": range(-(2**31), 2**31)}
_TEXT_LIMITS = tuple(
    (i, MAX_BODY if name == "body" else MAX_TEXT)
    for i, (name, sql) in enumerate(COLUMNS)
    if sql == "VARCHAR"
)
_INT_COLUMNS = tuple(
    (i, _INT_RANGES[sql]) for i, (_, sql) in enumerate(COLUMNS) if sql in _INT_RANGES
)
_BOOL_COLUMNS = tuple(i for i, (_, sql) in enumerate(COLUMNS) if sql == "BOOLEAN")


def valid_text(value: str, limit: int = MAX_TEXT) -> str:
    """``value`` as valid UTF-8 text of at most ``limit`` characters (lone surrogates, which
    aiohttp makes of undecodable bytes, become U+FFFD)."""
    if not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError:
            try:  # the bytes aiohttp could not decode, each shown as U+FFFD
                value = value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
            except UnicodeEncodeError:  # surrogates no byte maps to
                value = value.encode("utf-8", "replace").decode()
    return value if len(value) <= limit else value[:limit]


def storable(row: Sequence[Any]) -> tuple[Any, ...]:
    """``row`` (``COLUMN_NAMES`` order) with every value of its column's type and bounds: text
    made valid and cut to length, an integer outside 64 bits or of another type made null,
    a flag made a bool. The common row (ASCII text, small numbers) is returned as it was."""
    out: list[Any] | None = None
    for i, limit in _TEXT_LIMITS:
        v = row[i]
        if v is None or (type(v) is str and v.isascii() and len(v) <= limit):
            continue
        out = out or list(row)
        out[i] = valid_text(v if isinstance(v, str) else str(v), limit)
    for i, bounds in _INT_COLUMNS:
        v = row[i]
        if v is None or (type(v) is int and v in bounds):
            continue
        out = out or list(row)
        out[i] = int(v) if isinstance(v, int) and not isinstance(v, bool) and v in bounds else None
    for i in _BOOL_COLUMNS:
        v = row[i]
        if v is not None and type(v) is not bool:
            out = out or list(row)
            out[i] = bool(v)
    return tuple(row) if out is None else tuple(out)


def now_us() -> int:
    """Wall-clock microseconds since the epoch."""
    return time.time_ns() // 1000


_ID_PREFIX = uuid.uuid4().hex[:16]
_ID_COUNTER = itertools.count()


def new_call_id() -> str:
    """Unique across processes (a random 64-bit prefix per process) without a syscall per id."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"


# Keys whose values are credentials wherever they appear in a body, compared normalised (lower
# case, without '-', '_', '.' and blanks, so `refreshToken`, `refresh-token` and
# `REFRESH_TOKEN` are one name). Body keys like "max_tokens" are not secrets: a name is a secret
# when it is one of these, ends in one of the suffixes, or holds one of the words.
_SECRET_KEYS = frozenset(
    {"auth", "authorization", "bearer", "jwt", "key", "pwd", "secret", "token", "xapikey"}
)
_SECRET_SUFFIXES = ("token", "apikey", "secretkey", "privatekey", "accesskey", "signingkey")
_SECRET_WORDS = ("secret", "password", "passwd", "passphrase", "credential", "cookie", "apikey")
# Names that end like a secret and are not one: tokenizer special tokens a chat template names.
_NOT_SECRET = frozenset({"bostoken", "eostoken", "padtoken", "unktoken", "septoken", "clstoken"})
MAX_BODY_DEPTH = 200  # nesting a stored body may have (orjson writes at most 254 levels)
# Cache of key -> is it a secret's name; bodies repeat the same few keys ("model", "role",
# "content", ...), so the normalisation runs once per distinct key, not once per call.
_KEY_IS_SECRET: dict[str, bool] = {}
_MAX_CACHED_KEYS = 4096


class BodyTooDeep(ValueError):
    """A request body nested deeper than :data:`MAX_BODY_DEPTH`: no real call is."""


def is_secret_name(name: str) -> bool:
    """Whether a body key (or header name) names a credential (see ``_SECRET_KEYS``)."""
    norm = name.lower().replace("-", "").replace("_", "").replace(".", "").replace(" ", "")
    if norm in _SECRET_KEYS:
        return True
    if norm in _NOT_SECRET:
        return False
    return norm.endswith(_SECRET_SUFFIXES) or any(word in norm for word in _SECRET_WORDS)


def _is_secret_key(key: object) -> bool:
    name = key if isinstance(key, str) else str(key)
    known = _KEY_IS_SECRET.get(name)
    if known is None:
        known = is_secret_name(name)
        if len(_KEY_IS_SECRET) < _MAX_CACHED_KEYS:
            _KEY_IS_SECRET[name] = known
    return known


def _has_secret(value: Any, depth: int = 0) -> bool:
    """Whether :func:`_scrub` would redact anything: a walk over keys only, so its cost
    follows the body's structure, not the length of its prompts. Refuses a body nested past
    :data:`MAX_BODY_DEPTH` (:class:`BodyTooDeep`) before the walk can exhaust the stack."""
    if depth > MAX_BODY_DEPTH:
        raise BodyTooDeep(f"the body is nested deeper than {MAX_BODY_DEPTH} levels")
    if isinstance(value, dict):
        known = _KEY_IS_SECRET.get
        for key, item in value.items():
            secret = known(key)
            if secret if secret is not None else _is_secret_key(key):
                return True
            if isinstance(item, (dict, list)) and _has_secret(item, depth + 1):
                return True
        return False
    if isinstance(value, list):
        for item in value:
            if isinstance(item, (dict, list)) and _has_secret(item, depth + 1):
                return True
    return False


def check_depth(value: Any, depth: int = 0) -> None:
    """Raise :class:`BodyTooDeep` when ``value`` nests past :data:`MAX_BODY_DEPTH` (what
    :func:`scrub_body` checks on its way; for bodies that are not stored)."""
    if depth > MAX_BODY_DEPTH:
        raise BodyTooDeep(f"the body is nested deeper than {MAX_BODY_DEPTH} levels")
    items = value.values() if isinstance(value, dict) else value
    for item in items:
        if isinstance(item, (dict, list)):
            check_depth(item, depth + 1)


def _scrub(value: Any) -> tuple[Any, bool]:
    if isinstance(value, dict):
        changed = False
        out: dict[str, Any] = {}
        for key, item in value.items():
            if _is_secret_key(key):
                out[key] = "[redacted]"
                changed = True
            else:
                out[key], sub = _scrub(item)
                changed = changed or sub
        return out, changed
    if isinstance(value, list):
        items = [_scrub(item) for item in value]
        return [i for i, _ in items], any(c for _, c in items)
    return value, False


def scrub_body(raw: bytes, parsed: Any) -> str:
    """The body as stored: the raw JSON text, or a re-serialised copy with secrets redacted.

    The common case (no secret-named key) costs a walk over the keys and a single decode.
    Raises :class:`BodyTooDeep` for a body nested past :data:`MAX_BODY_DEPTH` (whose walk
    could exhaust the stack, and which orjson could not write back).
    """
    if _has_secret(parsed):
        cleaned, _ = _scrub(parsed)
        return orjson.dumps(cleaned).decode()
    return raw.decode("utf-8", errors="replace")


# What a key looks like in free text: OpenAI-style keys (sk-..., sk-proj-...), Hugging Face
# tokens (hf_...), and whatever follows "Bearer".
_KEY_IN_TEXT = re.compile(
    r"\b(?:sk-[A-Za-z0-9_-]{8,}|hf_[A-Za-z0-9]{8,})|(?i:bearer)\s+[^\s\"',;]{4,}"
)


def redact_text(text: str, secrets: Iterable[str | None] = ()) -> str:
    """``text`` (an upstream's error message, which may echo the request's headers) with
    each of ``secrets`` (the keys the call carried) and anything that looks like an API key
    replaced by ``[redacted]``."""
    for secret in secrets:
        if secret and len(secret) >= 4 and secret in text:
            text = text.replace(secret, "[redacted]")
    return _KEY_IN_TEXT.sub("[redacted]", text)

"""The call record: one row per upstream call attempt that reached the proxy (DESIGN §3.2).

Role: the schema shared by the proxy (which fills records), the store (which writes and reads
them) and the optimizer (which summarises them). Column order and SQL types live here only.

Invariants:
- times are integer microseconds since the epoch (UTC); ``t_first_byte`` and token counts are
  ``None`` when unknown (a stream cut before its usage event leaves usage unknown, not zero);
- a retried call keeps its ``call_id``; ``attempt`` counts from 0 across client retries
  (``x-stainless-retry-count``) and the proxy's own retry;
- ``body`` never holds credentials: :func:`scrub_body` removes secret-looking keys.
"""

from __future__ import annotations

import itertools
import re
import time
import uuid
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
    ("attempt", "INTEGER"),
    ("status", "INTEGER"),
    ("error", "VARCHAR"),
    ("stream", "BOOLEAN"),
    ("t_start", "BIGINT"),
    ("t_first_byte", "BIGINT"),
    ("t_end", "BIGINT"),
    ("prompt_tokens", "INTEGER"),
    ("completion_tokens", "INTEGER"),
    ("cached_tokens", "INTEGER"),
    ("request_bytes", "BIGINT"),
    ("response_bytes", "BIGINT"),
    ("body", "VARCHAR"),
)
COLUMN_NAMES: tuple[str, ...] = tuple(name for name, _ in COLUMNS)


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


assert tuple(f.name for f in fields(CallRecord)) == COLUMN_NAMES, "schema and record disagree"


def now_us() -> int:
    """Wall-clock microseconds since the epoch."""
    return time.time_ns() // 1000


_ID_PREFIX = uuid.uuid4().hex[:16]
_ID_COUNTER = itertools.count()


def new_call_id() -> str:
    """Unique across processes (a random 64-bit prefix per process) without a syscall per id."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"


# Keys whose values are credentials wherever they appear in a body (compared lower-case,
# with '-' and '_' removed). Body keys like "max_tokens" are not secrets: match whole names.
_SECRET_KEYS = frozenset(
    {
        "apikey",
        "authorization",
        "password",
        "secret",
        "token",
        "accesstoken",
        "clientsecret",
        "bearer",
        "xapikey",
        "openaiapikey",
        "key",
    }
)
# Every key _scrub redacts ends in one of these right before its closing quote; "max_tokens"
# does not match b'token"', so ordinary bodies skip the walk entirely.
_HINT = re.compile(rb'(?i)(?:key|token|secret|password|authorization|bearer)"')


def _scrub(value: Any) -> tuple[Any, bool]:
    if isinstance(value, dict):
        changed = False
        out: dict[str, Any] = {}
        for key, item in value.items():
            norm = str(key).lower().replace("-", "").replace("_", "")
            if norm in _SECRET_KEYS or norm.endswith(("apikey", "secret", "password")):
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

    The cheap byte search keeps the common case (no secret-looking key) to a single decode.
    """
    if _HINT.search(raw):
        cleaned, changed = _scrub(parsed)
        if changed:
            return orjson.dumps(cleaned).decode()
    return raw.decode("utf-8", errors="replace")

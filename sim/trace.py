"""Simulated call traces as trace-store records, so the optimizer can read simulated runs.

Role: turn a ``SimResult``'s calls into rows of ``shared.records.COLUMNS`` (one per call, as
the proxy would have recorded it) and write them through ``shared.store.SegmentWriter``.

Invariants:
- times are integer microseconds: ``t0_us`` plus simulated seconds; ``t_first_byte`` is the
  first token (chat) or the result (embeddings, rerank);
- ``upstream`` names the simulated replica and ``proxy_id`` defaults to "simulated", so
  simulated rows are never mistaken for measured ones;
- the body is the request JSON an OpenAI client would send, with synthetic text: one short
  word per prompt token, the same words for the same prompt segment, so a profiler replaying
  the bodies against the emulator sees the same shared prefixes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from shared.records import COLUMN_NAMES, CallRecord
from shared.store import SegmentWriter
from sim.des import SimCall, SimResult
from sim.workflows import Prompt

__all__ = ["call_rows", "open_rows", "prompt_text", "write_trace"]

DEFAULT_T0_US = 1_767_225_600_000_000  # 2026-01-01T00:00:00Z
_WORDS = np.array(
    """the a of to and is we that this so then for with by as it be are from on
    let each value sum term solve find step since thus given both side add root total answer
    first next which gives hence note case check now can must all two three four five ten half
    less more than where when rule area ratio angle point line count ways order prime even odd
    digit there their what how why who into over under about after before while until""".split()
)


class _Texts:
    """Synthetic words per segment key, memoised (segments recur across a request's calls)."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, int], str] = {}

    def segment(self, key: int, length: int) -> str:
        text = self._cache.get((key, length))
        if text is None:
            rng = np.random.default_rng(key & ((1 << 63) - 1))
            text = " ".join(_WORDS[rng.integers(0, len(_WORDS), size=length)])
            self._cache[(key, length)] = text
        return text

    def prompt(self, prompt: Prompt) -> str:
        return " ".join(self.segment(k, n) for k, n in prompt.segments() if n > 0)


def prompt_text(prompt: Prompt) -> str:
    """The synthetic text of a prompt (one word per token)."""
    return _Texts().prompt(prompt)


def _body(c: SimCall, texts: _Texts) -> dict[str, Any]:
    call = c.call
    if call.endpoint == "/v1/embeddings":
        return {"model": call.model, "input": texts.prompt(call.inputs[0])}
    if call.endpoint == "/v1/rerank":
        # every input is query + document: the query is the first segment
        query = call.inputs[0].segments()[0]
        docs = [" ".join(texts.segment(k, n) for k, n in p.segments()[1:]) for p in call.inputs]
        return {"model": call.model, "query": texts.segment(*query), "documents": docs}
    return {
        "model": call.model,
        "max_tokens": call.output_tokens,
        "messages": [{"role": "user", "content": texts.prompt(call.inputs[0])}],
    }


def _call_id(seed: int, c: SimCall) -> str:
    """A call's id in the store: the same for its open and its finished row."""
    return f"sim-{seed}-{c.call_id}"


def call_rows(
    result: SimResult,
    *,
    t0_us: int = DEFAULT_T0_US,
    proxy_id: str = "simulated",
    bodies: bool = True,
) -> list[tuple[Any, ...]]:
    """One row per simulated call, in ``shared.records.COLUMN_NAMES`` order."""
    texts = _Texts()
    rows: list[tuple[Any, ...]] = []
    for c in sorted(result.calls, key=lambda c: (c.t_start, c.call_id)):
        prompt_tokens = sum(len(p) for p in c.call.inputs)
        completion = c.call.output_tokens * len(c.call.inputs)
        body = orjson.dumps(_body(c, texts)).decode() if bodies else None
        values = {
            "call_id": _call_id(result.seed, c),
            "proxy_id": proxy_id,
            "workflow": c.workflow,
            "request_id": c.request_id,
            "model": c.call.model,
            "endpoint": c.call.endpoint,
            "upstream": c.replica,
            "attempt": 0,
            "status": 200,
            "error": None,
            "stream": False,
            "t_start": t0_us + round(c.t_start * 1e6),
            "t_first_byte": t0_us + round(c.t_first * 1e6),
            "t_end": t0_us + round(c.t_end * 1e6),
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "cached_tokens": c.cached_tokens,
            "request_bytes": len(body) if body is not None else 0,
            "response_bytes": 0,
            "body": body,
        }
        rows.append(tuple(values[name] for name in COLUMN_NAMES))
    return rows


def open_rows(
    calls: Sequence[SimCall], *, seed: int, t0_us: int = DEFAULT_T0_US, proxy_id: str = "simulated"
) -> list[tuple[Any, ...]]:
    """Open rows (``shared.records``) for calls still in flight, e.g.
    ``Simulation.open_calls()``: what the proxy announces for calls it has not finished. The
    call ids match the finished rows ``call_rows`` writes for the same run (``seed``)."""
    return [
        CallRecord(
            _call_id(seed, c),
            proxy_id,
            c.workflow,
            c.request_id,
            c.call.model,
            c.call.endpoint,
            upstream=c.replica,
            t_start=t0_us + round(c.t_start * 1e6),
        ).opened()
        for c in calls
    ]


def write_trace(
    result: SimResult,
    store: str | Path,
    *,
    proxy_id: str = "simulated",
    t0_us: int = DEFAULT_T0_US,
    bodies: bool = True,
    segment_rows: int = 50_000,
) -> list[Path]:
    """Write the result's calls (``simulate(..., record_calls=True)``) as store segments."""
    if not result.calls:
        raise ValueError("the result holds no calls: simulate with record_calls=True")
    rows = call_rows(result, t0_us=t0_us, proxy_id=proxy_id, bodies=bodies)
    writer = SegmentWriter(store, proxy_id)
    try:
        paths = [writer.write(_chunk).path for _chunk in _chunks(rows, segment_rows)]
    finally:
        writer.close()
    return [p for p in paths if p is not None]


def _chunks(rows: Sequence[tuple[Any, ...]], size: int) -> list[Sequence[tuple[Any, ...]]]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]

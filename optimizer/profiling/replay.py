"""The replay workload of one model: its traced calls, their bodies and their order (DESIGN §3.5).

Role: the pure core of the profiler. :func:`build_workload` turns the call records of one model
(rows of the trace store) into a :class:`Workload`: one :class:`ReplayCall` per logical call,
grouped by workflow request, each with the calls of its request it must wait for.
:func:`schedule` lays out Poisson arrivals of request groups at an offered call rate
(conditioned on their count, so a short run offers the rate it names).
:func:`load_workload` is the one function here that reads (the store, through
``shared.store``).

Invariants:
- a retried call is one logical call: rows sharing a ``call_id`` collapse to the highest
  ``attempt`` (its finished row over its open row); a call whose last attempt failed (status
  not 2xx, an error, no ``t_end``) or that has no body is skipped, as its cost is unknown;
- dependency (DESIGN §3.5): call ``j`` waits for every call ``i`` of its request that ended
  before ``j`` started in the trace. Only the frontier is kept (``i`` is dropped when it ended
  before another predecessor of ``j`` started), which the replay makes transitive, so the
  order is the same with far fewer edges; dependencies point backwards in start order, so the
  graph has no cycle;
- calls without a request id are groups of one (no dependency);
- bodies are sent as recorded except: ``model`` names the engine's served model, and
  (``force_lengths``) a generate call whose completion length was recorded asks for exactly
  that many tokens (``max_tokens`` + vLLM's ``ignore_eos``), so the engine does the traced
  amount of work rather than drawing its own lengths;
- the schedule draws groups as shuffled passes over the workload (every group once per pass),
  so the replayed mix matches the trace's even over short runs;
- a profile replays the trace several times, and an engine that was sent a prompt before
  answers it from its prefix cache (a profile then measures a warm cache, not the workload):
  :func:`tagged_body` puts a tag at the very start of a generate call's prompt (the first
  chat message's text, or the completion prompt), the same for every call of one replay of a
  request (their shared prefixes stay shared) and never the same for two replays of one call
  (the replayer's tags, :mod:`optimizer.profiling.profiler`). ``traced_hit_rate`` is the
  trace's own prefix-hit rate (cached over prompt tokens), what a replay should come near.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from shared.store import StoreReader

GENERATE_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
# the tag opens the prompt: an engine caches whole blocks of 16 tokens or so, and the chat
# template's few tokens before the first message's text never fill one
TAG_FORMAT = "[replay {}] "
_COLUMNS = (
    "call_id",
    "request_id",
    "endpoint",
    "attempt",
    "status",
    "error",
    "stream",
    "t_start",
    "t_end",
    "completion_tokens",
    "body",
)


class ReplayError(ValueError):
    """No replayable calls (none recorded for the model, or none with a body)."""


@dataclass(frozen=True, slots=True)
class ReplayCall:
    """One call to replay. ``deps`` index calls of the same workload that must end first."""

    endpoint: str
    body: bytes
    stream: bool
    group: int
    deps: tuple[int, ...]
    t_start_us: int  # in the trace: the replay keeps start order within a group


@dataclass(frozen=True, slots=True)
class Workload:
    """The replayable calls of one model, grouped by workflow request (start order)."""

    model: str
    calls: tuple[ReplayCall, ...]
    groups: tuple[tuple[int, ...], ...]
    skipped: int  # logical calls left out (failed, no body)
    depth: float  # mean over groups of the longest dependency chain (calls)
    max_depth: int = 1  # the longest chain of any group: how long a group keeps sending
    # Σ cached / Σ prompt tokens over the traced calls whose engine reported both (None: none
    # did): the prefix-cache hit rate the workload had live
    traced_hit_rate: float | None = None

    @property
    def calls_per_group(self) -> float:
        return len(self.calls) / len(self.groups)


@dataclass(frozen=True, slots=True)
class _Row:
    call_id: str
    request_id: str | None
    endpoint: str
    attempt: int
    status: int | None
    error: str | None
    stream: bool
    t_start: int
    t_end: int | None
    completion_tokens: int | None
    body: str | None

    @property
    def ok(self) -> bool:
        return (
            self.error is None
            and self.t_end is not None
            and self.body is not None
            and self.status is not None
            and 200 <= self.status < 300
        )


def _latest_attempts(rows: Iterable[Sequence[Any]]) -> list[_Row]:
    latest: dict[str, _Row] = {}
    for values in rows:
        row = _Row(*values)
        seen = latest.get(row.call_id)
        # the finished row of an attempt supersedes its open row (``shared.records``)
        if seen is None or (row.attempt, row.t_end is not None) > (
            seen.attempt,
            seen.t_end is not None,
        ):
            latest[row.call_id] = row
    return list(latest.values())


def _prepared_body(row: _Row, served_model: str, force_lengths: bool) -> bytes:
    doc: Any = orjson.loads(row.body or "{}")
    if not isinstance(doc, dict):
        raise ReplayError(f"call {row.call_id}: the recorded body is not a JSON object")
    doc["model"] = served_model
    if force_lengths and row.endpoint in GENERATE_ENDPOINTS and row.completion_tokens:
        # n choices report their tokens summed; each choice emits its share
        n_field = doc.get("n")
        n = n_field if isinstance(n_field, int) and n_field > 0 else 1
        doc.pop("max_completion_tokens", None)
        doc["max_tokens"] = max(1, round(row.completion_tokens / n))
        doc["ignore_eos"] = True
    return orjson.dumps(doc)


def tagged_body(call: ReplayCall, tag: str) -> bytes:
    """``call``'s body with ``TAG_FORMAT.format(tag)`` opening its prompt: the first chat
    message's text (or a text part before its parts), or each text prompt of a completion.
    Token-id prompts, and other endpoints (embeddings, scoring: no prefix cache), are sent
    untagged. A stream asks for its usage (``stream_options.include_usage``): the replayer
    reads the cached tokens from it."""
    if call.endpoint not in GENERATE_ENDPOINTS:
        return call.body
    doc: Any = orjson.loads(call.body)
    text = TAG_FORMAT.format(tag)
    messages, prompt = doc.get("messages"), doc.get("prompt")
    if isinstance(messages, list) and messages and isinstance(messages[0], dict):
        first = messages[0]
        content = first.get("content")
        if isinstance(content, str):
            first["content"] = text + content
        elif isinstance(content, list):
            first["content"] = [{"type": "text", "text": text}, *content]
        elif content is None:
            first["content"] = text
    elif isinstance(prompt, str):
        doc["prompt"] = text + prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        doc["prompt"] = [text + p for p in prompt]
    if doc.get("stream") is True:  # a stream reports usage (the hit rate) only when asked
        options = doc.get("stream_options")
        doc["stream_options"] = {
            **(options if isinstance(options, dict) else {}),
            "include_usage": True,
        }
    return orjson.dumps(doc)


def frontier_deps(starts: Sequence[int], ends: Sequence[int]) -> list[tuple[int, ...]]:
    """For calls of one request in start order, the predecessors each must wait for (frontier).

    ``i`` precedes ``j`` when ``ends[i] <= starts[j]``; it is implied (dropped) when it also
    ended by the start of another predecessor ``k`` of ``j``.
    """
    out: list[tuple[int, ...]] = []
    for j, start in enumerate(starts):
        preds = [i for i in range(j) if ends[i] <= start]
        if not preds:
            out.append(())
            continue
        latest_start = max(starts[i] for i in preds)
        out.append(tuple(i for i in preds if ends[i] > latest_start))
    return out


def build_workload(
    model: str,
    rows: Iterable[Sequence[Any]],
    *,
    served_model: str | None = None,
    force_lengths: bool = True,
) -> Workload:
    """The workload from record rows of ``model`` (columns in ``_COLUMNS`` order)."""
    logical = _latest_attempts(rows)
    usable = sorted((r for r in logical if r.ok), key=lambda r: (r.t_start, r.call_id))
    skipped = len(logical) - len(usable)
    if not usable:
        raise ReplayError(
            f"no replayable calls of model {model!r}: {len(logical)} recorded, "
            "none succeeded with a recorded body"
        )
    by_request: dict[str, list[_Row]] = {}
    singles: list[_Row] = []
    for r in usable:
        if r.request_id is None:
            singles.append(r)
        else:
            by_request.setdefault(r.request_id, []).append(r)
    ordered = sorted(
        [*by_request.values(), *([r] for r in singles)], key=lambda members: members[0].t_start
    )
    calls: list[ReplayCall] = []
    groups: list[tuple[int, ...]] = []
    depths: list[int] = []
    for g, members in enumerate(ordered):
        base = len(calls)
        starts = [r.t_start for r in members]
        ends = [r.t_end or r.t_start for r in members]
        chain: list[int] = []
        for r, deps in zip(members, frontier_deps(starts, ends), strict=True):
            chain.append(1 + max((chain[d] for d in deps), default=0))
            calls.append(
                ReplayCall(
                    r.endpoint,
                    _prepared_body(r, served_model or model, force_lengths),
                    bool(r.stream),
                    g,
                    tuple(base + i for i in deps),
                    r.t_start,
                )
            )
        groups.append(tuple(range(base, len(calls))))
        depths.append(max(chain))
    return Workload(
        model, tuple(calls), tuple(groups), skipped, float(np.mean(depths)), max(depths)
    )


def load_workload(
    store: str | Path, model: str, *, served_model: str | None = None, force_lengths: bool = True
) -> Workload:
    """Read ``model``'s calls from the store and build its workload (ReplayError if none),
    with the trace's prefix-hit rate."""
    reader = StoreReader(store)
    mine = f"model = {_quote(model)}"
    try:
        rows = reader.read(lambda calls: calls.filter(mine).select(", ".join(_COLUMNS)).fetchall())
        tokens = reader.read(
            lambda calls: (
                calls.filter(
                    f"{mine} AND status BETWEEN 200 AND 299 AND t_end IS NOT NULL "
                    "AND cached_tokens IS NOT NULL AND prompt_tokens > 0"
                )
                .aggregate("sum(cached_tokens)::DOUBLE, sum(prompt_tokens)::DOUBLE")
                .fetchall()
            )
        )
    finally:
        reader.close()
    if not rows:
        raise ReplayError(f"no calls of model {model!r} recorded in the store {store}")
    wl = build_workload(model, rows, served_model=served_model, force_lengths=force_lengths)
    cached, prompt = tokens[0] if tokens else (None, None)
    if cached is None or not prompt:
        return wl
    return replace(wl, traced_hit_rate=min(1.0, max(0.0, float(cached) / float(prompt))))


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def schedule(
    workload: Workload, rate: float, duration_s: float, rng: np.random.Generator
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """Group arrivals (seconds from 0, group indices) in ``[0, duration_s)``: a Poisson process
    of ``rate / calls_per_group`` groups per second conditioned on its count, i.e. the
    expected number of groups (rounded at random, so unbiased) at uniform random times. The
    gaps stay exponential-like, but a short run offers its nominal rate rather than a draw
    that is often 10% off it."""
    if rate <= 0 or duration_s <= 0:
        return np.zeros(0), np.zeros(0, dtype=np.int64)
    expected = rate / workload.calls_per_group * duration_s
    n = int(expected + rng.random())
    times = np.sort(rng.uniform(0.0, duration_s, size=n))
    passes = -(-n // len(workload.groups)) if n else 0
    order = np.concatenate(
        [rng.permutation(len(workload.groups)) for _ in range(passes)]
        or [np.zeros(0, dtype=np.int64)]
    )
    return times, order[:n].astype(np.int64)

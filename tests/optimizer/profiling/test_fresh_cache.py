"""A profile measures the workload, not the cache: no prompt is sent twice in a profile, each
point's prefix-hit rate is read from the engine's usage, and a point whose rate departs from
the trace's is flagged and not stored."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from optimizer.cli.profile import export_document, trusted_points
from optimizer.profiling.profiler import PointResult, Replayer
from optimizer.profiling.replay import ReplayCall, build_workload, load_workload, tagged_body
from optimizer.profiling.window import (
    HIT_RATE_TOLERANCE,
    CallTiming,
    Target,
    hit_rate,
    hit_rate_departure,
    summarise_point,
    usage_tokens,
)
from shared.profile_points import ProfilePoint, import_json
from shared.records import CallRecord
from shared.store import SegmentWriter
from tests.loopback import serving
from tests.optimizer.profiling.test_profiler import _rows, _workload_rows, untagged

S = 1_000_000
SYSTEM = "You are a careful assistant who answers in one sentence. " * 4


def _call(body: dict[str, Any], endpoint: str = "/v1/chat/completions") -> ReplayCall:
    return ReplayCall(endpoint, orjson.dumps(body), bool(body.get("stream")), 0, (), 0)


def test_the_tag_opens_the_prompt_and_asks_streams_for_usage() -> None:
    chat = _call({"messages": [{"role": "system", "content": "sys"}, {"role": "user"}]})
    doc = orjson.loads(tagged_body(chat, "ab.3"))
    assert doc["messages"][0]["content"] == "[replay ab.3] sys"
    assert doc["messages"][1] == {"role": "user"}
    parts = _call({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]})
    assert orjson.loads(tagged_body(parts, "t"))["messages"][0]["content"][0]["text"] == (
        "[replay t] "
    )
    stream = _call(
        {"prompt": ["a", "b"], "stream": True, "stream_options": {"x": 1}}, "/v1/completions"
    )
    doc = orjson.loads(tagged_body(stream, "t"))
    assert doc["prompt"] == ["[replay t] a", "[replay t] b"]
    assert doc["stream_options"] == {"x": 1, "include_usage": True}
    embed = _call({"input": "x"}, "/v1/embeddings")
    assert tagged_body(embed, "t") == embed.body  # no prefix cache: sent as recorded
    ids = _call({"prompt": [1, 2, 3]}, "/v1/completions")
    assert orjson.loads(tagged_body(ids, "t"))["prompt"] == [1, 2, 3]


def test_usage_is_read_from_a_body_and_from_a_streams_last_event() -> None:
    body = orjson.dumps(
        {
            "usage": {
                "prompt_tokens": 40,
                "completion_tokens": 7,
                "prompt_tokens_details": {"cached_tokens": 32},
            }
        }
    )
    assert usage_tokens(body, False) == (40, 32, 7)
    stream = (
        b'data: {"choices":[{"delta":{"content":"x"}}],"usage":null}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":1,'
        b'"prompt_tokens_details":{"cached_tokens":0}}}\n\ndata: [DONE]\n\n'
    )
    assert usage_tokens(stream, True) == (9, 0, 1)
    assert usage_tokens(b'{"usage": {"prompt_tokens": 5}}', False) == (5, None, None)
    assert usage_tokens(b"data: [DONE]\n\n", True) == (None, None, None)
    assert usage_tokens(b"not json", False) == (None, None, None)


@pytest.fixture
async def caching_engine() -> AsyncIterator[tuple[str, list[str]]]:
    """A chat engine with a prefix cache of whole prompts' leading messages: a call's cached
    tokens are the words of its longest leading run of messages sent before (as an engine
    with a prefix cache reports them); it logs every prompt."""
    seen: set[str] = set()
    log: list[str] = []

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        texts = [str(m.get("content", "")) for m in body["messages"]]
        prompt = "\n".join(texts)
        log.append(prompt)
        cached = 0
        for k in range(len(texts), 0, -1):
            if "\n".join(texts[:k]) in seen:
                cached = len(" ".join(texts[:k]).split())
                break
        for k in range(1, len(texts) + 1):
            seen.add("\n".join(texts[:k]))
        await asyncio.sleep(0.002)
        usage = {
            "prompt_tokens": len(prompt.split()),
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        return web.json_response({"choices": [{"message": {"content": "ok"}}], "usage": usage})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    async with serving(app) as url:
        yield url, log


def _agent_rows(n: int) -> list[CallRecord]:
    """Requests of two planner calls, the second extending the first's prompt (the prefix
    an engine caches within a request), all opening with one system prompt."""
    out = []
    for g in range(n):
        first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"task {g}"}]
        second = [*first, {"role": "assistant", "content": f"step {g}"}]
        for i, messages in enumerate((first, second)):
            out.append(
                CallRecord(
                    call_id=f"g{g}c{i}",
                    proxy_id="t",
                    workflow="agent",
                    request_id=f"r{g}",
                    model="m",
                    endpoint="/v1/chat/completions",
                    status=200,
                    t_start=round((g * 10 + 2 * i) * S),
                    t_end=round((g * 10 + 2 * i + 1) * S),
                    completion_tokens=5,
                    prompt_tokens=40,
                    cached_tokens=30,
                    body=orjson.dumps({"model": "m", "messages": messages}).decode(),
                )
            )
    return out


async def test_no_prompt_is_sent_twice_across_replays_and_probes(
    caching_engine: tuple[str, list[str]],
) -> None:
    url, log = caching_engine
    wl = build_workload("m", _workload_rows(_agent_rows(4)))
    target = Target(url, "m", "fake", "none", 1, 1.0)
    passes: list[list[CallTiming]] = []
    async with aiohttp.ClientSession() as session:
        rep = Replayer(session, target, wl, 10.0)
        for _ in range(3):  # three passes over the trace, as a sweep's points make
            passes.append([])
            for g in range(len(wl.groups)):
                await rep.group(g, passes[-1])
        passes.append([await rep.call(i) for i in range(len(wl.calls))])  # a probe's sends
        # a second replayer on the same engine (the sweep after calibration's probe)
        again = Replayer(session, target, wl, 10.0)
        passes.append([])
        for g in range(len(wl.groups)):
            await again.group(g, passes[-1])
    assert len(log) == 5 * len(wl.calls) and len(set(log)) == len(log)
    traced = {"\n".join(m["content"] for m in orjson.loads(c.body)["messages"]) for c in wl.calls}
    assert {untagged(p) for p in log} == traced
    rates = [hit_rate(timings, (-1e18, 1e18)) for timings in passes]
    # every pass meets the sharing the trace had (a request's calls, the system prompt), as
    # the first did; none finds the earlier passes' prompts (that would read 100%)
    assert rates[0] is not None and 0.5 < rates[0] < 0.95
    assert rates == [rates[0]] * len(passes)


def test_hit_rate_counts_the_window_calls_with_usage() -> None:
    timings = [
        CallTiming(0.5, 0.6, 0.7, True, None, 100, 90),  # before the window
        CallTiming(1.0, 1.1, 1.2, True, None, 100, 50),
        CallTiming(1.5, 1.6, 1.7, True, None, 300, 30),
        CallTiming(1.6, 1.7, 1.8, True, None, None, None),  # engine reported nothing
    ]
    assert hit_rate(timings, (1.0, 2.0)) == pytest.approx(80 / 400)
    assert hit_rate(timings[3:], (1.0, 2.0)) is None


def test_a_point_carries_the_completion_tokens_its_engine_reported() -> None:
    target = Target("http://e", "m", "emulator", "a6000", 1, 1.0)
    timings = [
        CallTiming(1.0, 1.1, 1.2, True, None, 100, 50, 7),
        CallTiming(1.5, 1.6, 1.7, True, None, 300, 30, 13),
        CallTiming(1.6, 1.7, 1.8, True, None, None, None, None),  # engine reported nothing
    ]
    point, _ = summarise_point(target, "m", timings, (1.0, 2.0), 3.0)
    assert point.completion_tokens == pytest.approx(10.0)
    silent, _ = summarise_point(target, "m", timings[2:], (1.0, 2.0), 1.0)
    assert silent.completion_tokens < 0  # not recorded


def test_a_point_whose_hit_rate_departs_is_flagged_and_not_stored() -> None:
    assert hit_rate_departure(0.98, 0.75) is not None  # the warm cache the issue saw
    assert hit_rate_departure(0.75 + HIT_RATE_TOLERANCE - 0.01, 0.75) is None
    assert hit_rate_departure(None, 0.75) is None and hit_rate_departure(0.9, None) is None

    def result(rate: float, hits: float | None) -> PointResult:
        p = ProfilePoint("m", "emulator", "a6000", 1, 1.0, rate, rate, 1, 1, 1, 1, 0.5, 100)
        return PointResult(p, rate, None, 0, 0.0, hit_rate=hits)

    results = [result(1.0, 0.74), result(2.0, 0.98), result(3.0, None)]
    kept, dropped = trusted_points(results, 0.75, HIT_RATE_TOLERANCE)
    assert [p.offered_rate for p in kept] == [1.0, 3.0]
    assert [u.point.offered_rate for u in dropped] == [2.0]
    assert "98%" in dropped[0].reason and "75%" in dropped[0].reason
    doc = orjson.loads(export_document(kept, dropped))
    assert doc["untrusted"][0]["hit_rate"] == 0.98
    assert doc["untrusted"][0]["traced_hit_rate"] == 0.75
    assert [p.offered_rate for p in import_json(export_document(kept, dropped))] == [1.0, 3.0]
    assert trusted_points(results, 0.75, 1.0)[1] == []  # tolerance 1 keeps every point


def test_the_traced_hit_rate_comes_from_the_records(tmp_path: Path) -> None:
    writer = SegmentWriter(tmp_path, "p")
    writer.write([r.row() for r in _agent_rows(3)])
    writer.close()
    assert load_workload(tmp_path, "m").traced_hit_rate == pytest.approx(30 / 40)
    plain = tmp_path / "plain"
    writer = SegmentWriter(plain, "p")
    writer.write([r.row() for r in _rows(3)])  # no usage recorded: no rate to hold against
    writer.close()
    assert load_workload(plain, "fake-1b").traced_hit_rate is None

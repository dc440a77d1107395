"""Replica faults through a real proxy, with the real openai client against fake vLLM replicas:
a replica killed under load, ejection and return via /health probes, every replica gone, a
client that hangs up, an upstream that never answers.

Every call carries an ``Idempotency-Key``, which the proxy uses as the record's ``call_id``,
so each client-side outcome can be matched with its rows in the store.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from shared.records import now_us
from tests.proxy.conftest import EngineFactory, ProxyFactory, ProxyHandle
from tests.proxy.fake_engine import FakeEngine

MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
ADMIN = "admin-secret"


def _client(proxy: ProxyHandle, timeout: float = 10.0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{proxy.url}/v1", api_key="sk-test", max_retries=0, timeout=timeout
    )


@dataclass
class Outcome:
    key: str
    stream: bool
    after_kill: bool
    text: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


async def _call(
    client: openai.AsyncOpenAI, stream: bool, after_kill: bool, headers: dict[str, str]
) -> Outcome:
    """One chat call; the outcome says what the client got, never raises."""
    out = Outcome(uuid.uuid4().hex, stream, after_kill)
    extra = {"Idempotency-Key": out.key, **headers}
    try:
        if stream:
            chunks = await client.chat.completions.create(
                model="m", messages=MSG, stream=True, extra_headers=extra
            )
            finish = None
            async for c in chunks:
                if c.choices:
                    out.text += c.choices[0].delta.content or ""
                    finish = c.choices[0].finish_reason or finish
            if finish != "length":
                out.error = f"stream ended without finish_reason (got {out.text!r})"
        else:
            done = await client.chat.completions.create(
                model="m", messages=MSG, extra_headers=extra
            )
            out.text = done.choices[0].message.content or ""
    except openai.APIError as exc:
        out.error = f"{exc.__class__.__name__}: {exc}"
    return out


def _keys(engine: FakeEngine) -> set[str]:
    """The Idempotency-Keys of every call the engine received (header names in any case)."""
    return {v for c in engine.calls for k, v in c.headers.items() if k.lower() == "idempotency-key"}


async def _until(cond: Callable[[], bool], limit_s: float, what: str) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {limit_s}s waiting for {what}")
        await asyncio.sleep(0.01)


async def _routes(proxy: ProxyHandle) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"{proxy.url}/admin/routes", headers={"Authorization": f"Bearer {ADMIN}"}) as r,
    ):
        assert r.status == 200
        data: dict[str, Any] = await r.json()
        return data


def _state(routes: dict[str, Any], url: str) -> str:
    [rep] = [u for u in routes["upstreams"] if u["url"] == url]
    return str(rep["state"])


async def _rows_by_key(proxy: ProxyHandle) -> dict[str, list[dict[str, Any]]]:
    rows: dict[str, list[dict[str, Any]]] = {}
    for rec in await proxy.records():
        rows.setdefault(rec["call_id"], []).append(rec)
    return rows


@pytest.mark.timeout(30)
async def test_replica_killed_under_load_fails_only_its_in_flight_calls(
    engine_factory: EngineFactory, proxy_factory: ProxyFactory
) -> None:
    a = await engine_factory(name="a")
    b = await engine_factory(name="b")
    # Never ejected here, so late calls keep picking the dead replica (ejection: below).
    routing = {"eject_after_failures": 1000}
    proxy = await proxy_factory([("m", a.url), ("m", b.url)], routing=routing)
    # Streams take ~0.4 s (40 paced tokens), plain calls wait 0.3 s: the kill lands mid-call.
    slow_stream = {"X-Fake-Mode": "slow", "X-Fake-Tokens": "40"}
    slow_plain = {"X-Fake-Delay-S": "0.3"}
    async with _client(proxy) as client:
        before = [
            asyncio.create_task(
                _call(client, i % 2 == 0, False, slow_stream if i % 2 == 0 else slow_plain)
            )
            for i in range(60)
        ]
        await _until(lambda: a.in_flight >= 10 and b.in_flight >= 10, 5, "calls on both replicas")
        seen_by_a = _keys(a)
        in_flight_on_a = a.in_flight
        t_kill = now_us()
        await a.kill()
        after = [asyncio.create_task(_call(client, i % 2 == 0, True, {})) for i in range(40)]
        outcomes = await asyncio.gather(*before, *after)
    assert in_flight_on_a >= 10
    # The killed replica's streams in flight failed (a stream cannot move once it has begun).
    cut_streams = [o for o in outcomes if o.stream and o.key in seen_by_a and not o.after_kill]
    assert cut_streams and any(not o.ok for o in cut_streams)
    # Every call started after the kill succeeded on the surviving replica.
    late = [o for o in outcomes if o.after_kill]
    assert all(o.ok for o in late), [o.error for o in late if not o.ok]
    assert all(o.text.startswith("b:") or o.stream for o in late)
    assert {o.key for o in late} <= _keys(b) and not {o.key for o in late} & seen_by_a
    # The store holds every call; successful ones a clean 200, failed ones an error, and
    # every failed call was in flight on the killed replica: sent to it before it died.
    rows = await _rows_by_key(proxy)
    assert set(rows) == {o.key for o in outcomes}
    for o in outcomes:
        final = max(rows[o.key], key=lambda r: r["attempt"])
        if o.ok:
            assert final["status"] == 200 and final["error"] is None, final
        else:
            assert final["error"] and final["upstream"] == a.url, (o, final)
            assert final["t_start"] < t_kill <= final["t_end"], (o, final)
    # Late calls that picked the dead replica were refused there and retried once on b.
    retried = [rows[o.key] for o in late if len(rows[o.key]) > 1]
    assert retried, "no late call was refused by the dead replica"
    for first, second in retried:
        assert (first["upstream"], second["upstream"]) == (a.url, b.url)
        assert first["error"].startswith("connect") and second["attempt"] == first["attempt"] + 1


@pytest.mark.timeout(10)
async def test_call_already_sent_to_a_killed_replica_is_not_replayed(
    engine_factory: EngineFactory, proxy_factory: ProxyFactory
) -> None:
    """Only connection failures before any byte was sent are retried (issue 2): a call the
    dead replica had already received may have run there, so it fails rather than runs twice."""
    a = await engine_factory(name="a")
    b = await engine_factory(name="b")
    proxy = await proxy_factory([("m", a.url), ("m", b.url)])
    proxy.router.replicas()[1].in_flight += 1000  # steer the first pick to `a`
    b.release.set()  # `hold` waits on a, answers at once on b
    async with _client(proxy, timeout=3) as client:
        task = asyncio.create_task(_call(client, False, False, {"X-Fake-Mode": "hold"}))
        await _until(lambda: a.in_flight == 1, 3, "the call to reach replica a")
        proxy.router.replicas()[1].in_flight -= 1000
        await a.kill()
        out = await task
    assert out.key not in _keys(b), "the call a had received was replayed on b"
    assert not out.ok and "502" in (out.error or ""), out
    [row] = (await _rows_by_key(proxy))[out.key]
    assert row["upstream"] == a.url and row["error"]


@pytest.mark.timeout(15)
async def test_failing_replica_is_ejected_then_probed_back(
    engine_factory: EngineFactory, proxy_factory: ProxyFactory
) -> None:
    a = await engine_factory(name="a")
    b = await engine_factory(name="b")
    routing = {"eject_after_failures": 2, "eject_seconds": 0.2, "probe_interval_s": 0.05}
    proxy = await proxy_factory([("m", a.url), ("m", b.url)], admin_token=ADMIN, routing=routing)
    port = a.port
    await a.kill()
    async with _client(proxy) as client:
        # Each call that picks the dead replica is refused, retried once on b, and succeeds.
        for _ in range(40):
            out = await _call(client, False, True, {})
            assert out.ok and out.text.startswith("b:"), out
        assert _state(await _routes(proxy), a.url) == "ejected"
        refused = [r for r in await proxy.records() if r["upstream"] == a.url]
        assert len(refused) == 2 and all(r["error"].startswith("connect") for r in refused)

        # Back on its port but unhealthy: probed, kept out, sent nothing.
        a.healthy = False
        await a.start(port)
        await _until(lambda: a.probes >= 2, 3, "health probes of the ejected replica")
        results = await asyncio.gather(*(_call(client, i % 2 == 0, True, {}) for i in range(20)))
        assert all(o.ok for o in results)
        assert a.calls == [] and _state(await _routes(proxy), a.url) == "ejected"

        # Healthy again: the next probe returns it and it takes calls.
        a.healthy = True
        probes = a.probes
        deadline = time.monotonic() + 3
        while _state(await _routes(proxy), a.url) != "active":
            assert time.monotonic() < deadline, "the healthy replica never came back"
            await asyncio.sleep(0.02)
        assert a.probes > probes
        results = await asyncio.gather(*(_call(client, False, True, {}) for i in range(40)))
    assert all(o.ok for o in results)
    assert any(o.text.startswith("a:") for o in results) and len(a.calls) > 0


@pytest.mark.timeout(10)
async def test_every_replica_dead_is_503_openai_style_and_recorded(
    engine_factory: EngineFactory, proxy_factory: ProxyFactory
) -> None:
    a = await engine_factory(name="a")
    b = await engine_factory(name="b")
    proxy = await proxy_factory(
        [("m", a.url), ("m", b.url)], routing={"eject_after_failures": 2, "eject_seconds": 60}
    )
    await a.kill()
    await b.kill()
    keys: list[str] = []
    async with _client(proxy) as client:
        # Refused everywhere (twice each: both replicas end ejected), then nothing to pick.
        for stream in (False, True, False, True):
            key = uuid.uuid4().hex
            keys.append(key)
            with pytest.raises(openai.APIStatusError) as info:
                await client.chat.completions.create(
                    model="m", messages=MSG, stream=stream, extra_headers={"Idempotency-Key": key}
                )
            assert info.value.status_code == 503
            assert isinstance(info.value.body, dict) and info.value.body["message"]
            assert info.value.body["code"] == "no_replica_available"
    assert all(not r.active for r in proxy.router.replicas())
    rows = await _rows_by_key(proxy)
    # A call turned away because no replica was left still reached the proxy: it is recorded.
    assert set(rows) == set(keys)
    assert all(r["error"] for rs in rows.values() for r in rs)


async def _cancel_after(call: Awaitable[Any], seconds: float) -> None:
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(call, seconds)


@pytest.mark.timeout(10)
async def test_client_hangup_mid_stream_cancels_upstream_and_is_recorded(
    engine_factory: EngineFactory, proxy_factory: ProxyFactory
) -> None:
    a = await engine_factory(name="a", tokens=10)
    proxy = await proxy_factory([("m", a.url)])
    async with _client(proxy) as client:
        stream = await client.chat.completions.create(
            model="m", messages=MSG, stream=True, extra_headers={"X-Fake-Mode": "hold"}
        )
        first = await stream.__anext__()
        second = await stream.__anext__()
        assert (first.choices[0].delta.role, second.choices[0].delta.content) == (
            "assistant",
            "tok0 ",
        )
        await stream.close()  # hang up while the engine is still generating
    await _until(lambda: a.cancelled == 1, 3, "the upstream call to be cancelled")
    assert a.in_flight == 0
    [rec] = await proxy.records()
    assert rec["stream"] is True and rec["status"] == 200
    assert "client disconnected" in rec["error"] and rec["t_end"] >= rec["t_first_byte"]
    assert proxy.router.replicas()[0].in_flight == 0


@pytest.mark.timeout(10)
async def test_client_hangup_mid_call_cancels_upstream_and_is_recorded(
    engine_factory: EngineFactory, proxy_factory: ProxyFactory
) -> None:
    a = await engine_factory(name="a")
    proxy = await proxy_factory([("m", a.url)])
    async with _client(proxy) as client:
        call = client.chat.completions.create(
            model="m", messages=MSG, extra_headers={"X-Fake-Mode": "hang"}
        )
        await _until_started(a, _cancel_after(call, 0.3))
    await _until(lambda: a.cancelled == 1, 3, "the upstream call to be cancelled")
    [rec] = await proxy.records()
    assert rec["status"] is None and "client disconnected" in rec["error"]
    assert proxy.router.replicas()[0].in_flight == 0


async def _until_started(engine: FakeEngine, work: Awaitable[None]) -> None:
    """Run ``work`` and check the engine had the call while it ran."""
    task = asyncio.ensure_future(work)
    await _until(lambda: engine.in_flight == 1 or task.done(), 3, "the call to reach the engine")
    assert engine.in_flight == 1
    await task


@pytest.mark.timeout(10)
async def test_upstream_that_never_answers_is_504(
    engine_factory: EngineFactory, proxy_factory: ProxyFactory
) -> None:
    a = await engine_factory(name="a", tokens=10)
    proxy = await proxy_factory([("m", a.url)], upstream_timeout_s=0.3)
    async with _client(proxy) as client:
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(
                model="m", messages=MSG, extra_headers={"X-Fake-Mode": "hang"}
            )
        assert info.value.status_code == 504 and time.monotonic() - t0 < 3
        assert isinstance(info.value.body, dict) and info.value.body["code"] == "upstream_timeout"
        # A stream already under way cannot change its status: it ends with an error event.
        stream = await client.chat.completions.create(
            model="m", messages=MSG, stream=True, extra_headers={"X-Fake-Mode": "hold"}
        )
        with pytest.raises(openai.APIError, match="stopped sending"):
            async for _ in stream:
                pass
    await _until(lambda: a.cancelled == 2, 3, "both upstream calls to be cancelled")
    plain, streamed = await proxy.records()
    assert plain["error"] == "upstream timed out" and plain["stream"] is False
    assert streamed["error"] == "upstream stream timed out" and streamed["status"] == 200

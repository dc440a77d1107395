"""Operations on a real proxy over loopback: /health/live and /health/ready, the bounded
``workflow`` label of /metrics, the access log, and the log lines of ejections, re-admissions
and route swaps."""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from proxy.keys import METRICS
from proxy.metrics import OTHER, AccessLoggingMetrics, ProxyMetrics, label_value
from shared.store import segment_dir
from tests.proxy.conftest import EngineFactory, ProxyFactory, ProxyHandle
from tests.proxy.fake_engine import FakeEngine

CHAT = "/v1/chat/completions"
ADMIN = {"Authorization": "Bearer admin-secret"}
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def _get(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        if r.content_type == "application/json":
            return r.status, await r.json()
        return r.status, await r.text()


async def _chat(session: aiohttp.ClientSession, proxy: ProxyHandle, workflow: str) -> int:
    headers = {"X-Scepsy-Workflow": workflow}
    async with session.post(proxy.url + CHAT, json=BODY, headers=headers) as r:
        await r.read()
        return r.status


async def _until(cond: Callable[[], bool], limit_s: float, what: str) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {limit_s}s waiting for {what}")
        await asyncio.sleep(0.01)


# --- health ------------------------------------------------------------------------------
@pytest.mark.timeout(15)
async def test_ready_needs_a_route_live_does_not(
    proxy_factory: ProxyFactory, engine: FakeEngine
) -> None:
    p = await proxy_factory([], admin_token="admin-secret")
    assert (await _get(p.url + "/health/live"))[0] == 200
    status, body = await _get(p.url + "/health/ready")
    assert status == 503 and body["status"] == "not ready"
    assert body["reasons"] == ["no routes: the route table has no upstream"]
    assert (await _get(p.url + "/health"))[0] == 200  # unchanged, for existing probes
    async with (
        aiohttp.ClientSession() as s,
        s.put(
            p.url + "/admin/routes",
            json={"upstreams": [{"model": "m", "url": engine.url}]},
            headers=ADMIN,
        ) as r,
    ):
        assert r.status == 200
    status, body = await _get(p.url + "/health/ready")
    assert status == 200 and body == {
        "status": "ready",
        "reasons": [],
        "proxy_id": "test-proxy",
        "models": ["m"],
        "routes_version": 2,
    }


@pytest.mark.timeout(15)
async def test_ready_is_503_while_the_store_cannot_be_written(
    proxy_factory: ProxyFactory, engine: FakeEngine
) -> None:
    p = await proxy_factory([("m", engine.url)])
    folder = segment_dir(p.store, "test-proxy")
    assert (await _get(p.url + "/health/ready"))[0] == 200
    # The segment folder becomes a file: nothing can be written under it.
    shutil.rmtree(folder)
    folder.write_text("in the way")
    status, body = await _get(p.url + "/health/ready")
    assert status == 503 and len(body["reasons"]) == 1
    assert body["reasons"][0].startswith("the trace store is not writable: cannot write to")
    assert (await _get(p.url + "/health/live"))[0] == 200
    # A write fails too: the recorder's failure keeps the proxy unready ...
    async with aiohttp.ClientSession() as s:
        assert await _chat(s, p, "wf") == 200
        await p.flush()
        folder.unlink()
        folder.mkdir()
        status, body = await _get(p.url + "/health/ready")
        assert status == 503
        assert body["reasons"][0].startswith("the trace store's last write failed:")
        # ... until a write succeeds again.
        assert await _chat(s, p, "wf") == 200
        await p.flush()
    assert (await _get(p.url + "/health/ready"))[0] == 200


# --- the bounded workflow label ----------------------------------------------------------
def _workflow_labels(exposition: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for line in exposition.splitlines():
        m = re.match(
            r'scepsy_proxy_requests_total\{.*?workflow="((?:[^"\\]|\\.)*)".*\} (\S+)', line
        )
        if m:
            counts[m[1]] = counts.get(m[1], 0.0) + float(m[2])
    return counts


@pytest.mark.timeout(60)
async def test_500_workflows_make_at_most_max_plus_one_labels(
    proxy_factory: ProxyFactory, engine: FakeEngine
) -> None:
    p = await proxy_factory([("m", engine.url)])
    gate = asyncio.Semaphore(32)
    async with aiohttp.ClientSession() as s:

        async def one(i: int) -> int:
            async with gate:
                return await _chat(s, p, f"wf-{i}")

        assert set(await asyncio.gather(*(one(i) for i in range(500)))) == {200}
    status, text = await _get(p.url + "/metrics")
    assert status == 200
    labels = _workflow_labels(text)
    assert len(labels) <= 50 + 1 and labels[OTHER] == 450
    assert sum(labels.values()) == 500
    assert {f"wf-{i}" for i in range(50)} <= set(labels)  # the first ones seen keep theirs


@pytest.mark.timeout(15)
async def test_named_workflows_keep_their_label_and_bad_bytes_cannot_break_metrics(
    proxy_factory: ProxyFactory, engine: FakeEngine
) -> None:
    p = await proxy_factory([("m", engine.url)], default_workflow="named", metrics_max_workflows=1)
    # A header value with a byte that is not UTF-8 (aiohttp hands it on as a lone surrogate).
    reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"X-Scepsy-Workflow: caf\xff\r\nConnection: close\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    await writer.drain()
    assert (await reader.read()).startswith(b"HTTP/1.1 200")
    writer.close()
    await writer.wait_closed()
    async with aiohttp.ClientSession() as s:
        for wf in ("late-1", "late-2"):
            assert await _chat(s, p, wf) == 200
        async with s.post(p.url + CHAT, json=BODY) as r:  # no workflow: the default
            assert r.status == 200
    status, text = await _get(p.url + "/metrics")
    assert status == 200
    labels = _workflow_labels(text)
    # aiohttp's parsers hand the byte on as a lone surrogate or as U+FFFD: either way the
    # label is valid UTF-8 and /metrics encodes it.
    [bad] = set(labels) - {OTHER, "named"}
    assert bad in ("caf?", "caf\ufffd")
    assert labels == {bad: 1, OTHER: 2, "named": 1}
    assert label_value("caf\udcff") == "caf?" and len(label_value("x" * 10_000)) == 200


# --- logs ----------------------------------------------------------------------------------
@pytest.mark.timeout(15)
async def test_access_log_one_line_per_call_only_when_asked(
    proxy_factory: ProxyFactory, engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="scepsy.proxy.access")
    quiet = await proxy_factory([("m", engine.url)])
    loud = await proxy_factory([("m", engine.url)], access_log=True)
    assert type(quiet.app[METRICS]) is ProxyMetrics  # off: the plain class, no cost per call
    assert isinstance(loud.app[METRICS], AccessLoggingMetrics)
    async with aiohttp.ClientSession() as s:
        assert await _chat(s, quiet, "wf-q") == 200
        assert await _chat(s, loud, "wf-l") == 200
    [rec] = [r for r in caplog.records if r.name == "scepsy.proxy.access"]
    fields = {k: getattr(rec, k) for k in ("method", "path", "status", "model", "workflow")}
    assert fields == {
        "method": "POST",
        "path": CHAT,
        "status": 200,
        "model": "m",
        "workflow": "wf-l",
    }
    assert rec.upstream == engine.url and rec.duration_ms >= 0
    assert rec.getMessage().startswith(f"POST {CHAT} 200 model=m workflow=wf-l")


@pytest.mark.timeout(15)
async def test_ejection_readmission_and_route_swaps_are_logged(
    engine_factory: EngineFactory, proxy_factory: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="scepsy.proxy")
    a = await engine_factory(name="a")
    b = await engine_factory(name="b")
    routing = {"eject_after_failures": 1, "eject_seconds": 0.1, "probe_interval_s": 0.05}
    p = await proxy_factory(
        [("m", a.url), ("m", b.url)], admin_token="admin-secret", routing=routing
    )
    port = a.port
    await a.kill()

    def logged(name: str, event: str) -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == name and getattr(r, "event", None) == event]

    async with aiohttp.ClientSession() as s:
        for _ in range(40):
            assert await _chat(s, p, "wf") == 200
            if logged("scepsy.proxy.router", "eject"):
                break
        [eject] = logged("scepsy.proxy.router", "eject")
        assert eject.levelname == "WARNING" and a.url in eject.getMessage()
        await a.start(port)
        await _until(lambda: bool(logged("scepsy.proxy.router", "readmit")), 5, "re-admission")
        [back] = logged("scepsy.proxy.router", "readmit")
        assert back.levelname == "INFO" and back.upstream == a.url

        table = {
            "upstreams": [
                {"model": "m", "url": b.url},
                {"model": "e", "url": a.url},
                {"model": "e", "url": b.url},
            ]
        }
        async with s.put(p.url + "/admin/routes", json=table, headers=ADMIN) as r:
            assert r.status == 200
    [swap] = logged("scepsy.proxy.admin", "routes")
    assert swap.getMessage().startswith(
        "routes swapped via the admin API: 2 → 3 upstreams (2 added, 1 draining), version 2"
    )
    assert swap.getMessage().endswith("e 0→2, m 2→1")

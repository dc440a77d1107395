"""Several worker processes on one address: every call recorded once, one route table, one
/metrics, restarts, and no orphan when the supervisor is killed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import aiohttp
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.metrics import merge_expositions
from proxy.workers import merge_snapshots
from shared import metric_names
from shared.store import StoreReader
from tests.proxy.conftest import EngineFactory
from tests.proxy.proxy_process import REPO, ProxyProcess, proxy_process

ADMIN = "admin-secret"
SETTINGS = {"proxy": {"admin_token": ADMIN, "proxy_id": "pw", "workers": 2}}


def _workers_of(pid: int) -> set[int]:
    """The worker processes (multiprocessing spawn children) of process ``pid``."""
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) != pid:
                continue
            with contextlib.suppress(OSError):
                if "spawn_main" in Path(f"/proc/{entry}/cmdline").read_text():
                    out.add(int(entry))
    return out


def _alive(pids: set[int]) -> bool:
    return any(Path(f"/proc/{p}").exists() for p in pids)


async def _health_ids(url: str, n: int) -> list[dict[str, object]]:
    """``/health`` over ``n`` fresh connections (the kernel spreads them over the workers)."""
    out = []
    for _ in range(n):
        async with aiohttp.ClientSession() as s, s.get(f"{url}/health") as r:
            out.append(await r.json())
    return out


async def _calls(proxy: ProxyProcess, n: int) -> None:
    for i in range(n):
        # a fresh client, so a fresh connection: calls land on both workers
        async with openai.AsyncOpenAI(
            base_url=f"{proxy.url}/v1", api_key="sk", max_retries=0
        ) as client:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"c{i}"}], max_tokens=2
            )


@pytest.mark.timeout(60)
async def test_two_workers_record_every_call_once_and_count_them_in_one_metrics(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    fake = await engine_factory(name="up")
    async with proxy_process(tmp_path, fake.url, SETTINGS) as proxy:
        await _calls(proxy, 60)
        async with aiohttp.ClientSession() as s, s.get(f"{proxy.url}/metrics") as r:
            text = await r.text()
        total = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(metric_names.PROXY_REQUESTS + "{")
        )
        proxy.proc.send_signal(signal.SIGTERM)
        assert await proxy.exit_code(20) == 0, proxy.stderr()
    assert total == 60
    folders = sorted(p.name for p in (proxy.store / "calls").iterdir())
    assert folders == ["proxy=pw-w0", "proxy=pw-w1"]
    records = StoreReader(proxy.store).calls().fetchall()
    assert len(records) == 60 == len({r[0] for r in records})
    assert len(fake.calls) == 60


@pytest.mark.timeout(60)
async def test_a_route_change_reaches_every_worker_before_it_is_answered(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    one, two = await engine_factory(name="one"), await engine_factory(name="two")
    async with proxy_process(tmp_path, one.url, SETTINGS) as proxy:
        body = {"upstreams": [{"model": "m", "url": two.url}, {"model": "n", "url": two.url}]}
        auth = {"Authorization": f"Bearer {ADMIN}"}
        async with (
            aiohttp.ClientSession() as s,
            s.put(f"{proxy.url}/admin/routes", json=body, headers=auth) as r,
        ):
            assert r.status == 200, await r.text()
            view = await r.json()
        assert view["version"] == 2
        seen = await _health_ids(proxy.url, 24)
        assert {h["proxy_id"] for h in seen} == {"pw-w0", "pw-w1"}
        assert all(h["routes_version"] == 2 and h["models"] == ["m", "n"] for h in seen)
        await _calls(proxy, 10)
        assert len(one.calls) == 0 and len(two.calls) == 10


@pytest.mark.timeout(60)
async def test_a_dead_worker_is_restarted_and_a_killed_supervisor_leaves_no_orphan(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    fake = await engine_factory(name="up")
    async with proxy_process(tmp_path, fake.url, SETTINGS) as proxy:
        workers = _workers_of(proxy.proc.pid)
        assert len(workers) == 2
        victim = min(workers)
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while True:
            now = _workers_of(proxy.proc.pid) - {victim}
            if len(now) == 2:
                break
            assert time.monotonic() < deadline, proxy.stderr()
            await asyncio.sleep(0.1)
        deadline = time.monotonic() + 20
        while {h["proxy_id"] for h in await _health_ids(proxy.url, 12)} != {"pw-w0", "pw-w1"}:
            assert time.monotonic() < deadline, proxy.stderr()
        assert "restarting it" in proxy.stderr()
        proxy.proc.send_signal(signal.SIGKILL)
        await proxy.exit_code(5)
        deadline = time.monotonic() + 20
        while _alive(now):
            assert time.monotonic() < deadline, "a worker outlived its supervisor"
            await asyncio.sleep(0.1)


def test_merged_metrics_sum_counters_and_keep_shared_state_once() -> None:
    a = (
        b"# HELP scepsy_proxy_requests_total Calls\n# TYPE scepsy_proxy_requests_total counter\n"
        b'scepsy_proxy_requests_total{code="200",model="m"} 3.0\n'
        b'scepsy_proxy_requests_created{code="200",model="m"} 100.0\n'
        b"# HELP scepsy_proxy_replicas Replicas\n# TYPE scepsy_proxy_replicas gauge\n"
        b'scepsy_proxy_replicas{model="m",state="active"} 2.0\n'
    )
    b = (
        b"# HELP scepsy_proxy_requests_total Calls\n# TYPE scepsy_proxy_requests_total counter\n"
        b'scepsy_proxy_requests_total{code="200",model="m"} 4.0\n'
        b'scepsy_proxy_requests_total{code="503",model="m"} 1.0\n'
        b'scepsy_proxy_requests_created{code="200",model="m"} 90.0\n'
        b"# HELP scepsy_proxy_replicas Replicas\n# TYPE scepsy_proxy_replicas gauge\n"
        b'scepsy_proxy_replicas{model="m",state="active"} 2.0\n'
    )
    lines = merge_expositions([a, b]).decode().splitlines()
    assert lines == [
        "# HELP scepsy_proxy_requests_total Calls",
        "# TYPE scepsy_proxy_requests_total counter",
        'scepsy_proxy_requests_total{code="200",model="m"} 7.0',
        'scepsy_proxy_requests_created{code="200",model="m"} 90.0',
        'scepsy_proxy_requests_total{code="503",model="m"} 1.0',
        "# HELP scepsy_proxy_replicas Replicas",
        "# TYPE scepsy_proxy_replicas gauge",
        'scepsy_proxy_replicas{model="m",state="active"} 2.0',
    ]


@given(st.lists(st.binary(max_size=300), max_size=4))
def test_any_pages_merge_without_raising(pages: list[bytes]) -> None:
    assert merge_expositions(pages).endswith(b"\n")


def test_merged_routes_sum_each_replicas_calls() -> None:
    def view(version: int, in_flight: int) -> dict[str, object]:
        up = {"model": "m", "url": "http://a", "state": "active", "in_flight": in_flight}
        return {"version": version, "upstreams": [{**up, "served": 10}]}

    merged = merge_snapshots([view(2, 3), view(2, 4)])
    assert merged["version"] == 2
    assert merged["upstreams"] == [
        {"model": "m", "url": "http://a", "state": "active", "in_flight": 7, "served": 20}
    ]
    assert merge_snapshots([]) == {"version": 0, "upstreams": []}


@pytest.mark.timeout(60)
async def test_a_second_proxy_on_a_taken_port_fails_instead_of_sharing_it(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    fake = await engine_factory(name="up")
    (tmp_path / "a").mkdir()
    async with proxy_process(tmp_path / "a", fake.url, SETTINGS) as first:
        port = first.url.rsplit(":", 1)[1]
        config = tmp_path / "second.yaml"
        config.write_text(f"proxy: {{workers: 2, listen: '127.0.0.1:{port}'}}\n")
        second = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "proxy.cli",
            "--config",
            str(config),
            "--upstream",
            f"m={fake.url}",
            "--store",
            str(tmp_path / "store2"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=REPO,
        )
        out, err = await asyncio.wait_for(second.communicate(), 30)
        assert second.returncode == 1, (out, err)
        assert b"cannot listen on" in err

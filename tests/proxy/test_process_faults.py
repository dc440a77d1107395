"""The proxy as a process: SIGTERM under load loses no record, SIGKILL under load leaves only
complete readable segments, bad settings exit 2 with one line naming the key.

The proxy runs as ``python -m proxy.cli`` in a subprocess; the fake replica and the openai
client run in the test's event loop. Every subprocess is killed in a ``finally``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import duckdb
import httpx2
import openai
import pytest
import yaml
from openai.types.chat import ChatCompletionMessageParam

from shared.records import COLUMNS
from shared.store import SegmentWriter, StoreReader, segment_dir
from tests.proxy.conftest import EngineFactory
from tests.proxy.proxy_process import REPO, proxy_process

MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


def _client(url: str) -> openai.AsyncOpenAI:
    limits = httpx2.Limits(max_connections=2000, max_keepalive_connections=2000)
    return openai.AsyncOpenAI(
        base_url=f"{url}/v1",
        api_key="sk-test",
        max_retries=0,
        timeout=15,
        http_client=openai.DefaultAsyncHttpxClient(limits=limits),
    )


async def _complete_call(client: openai.AsyncOpenAI, key: str, stream: bool) -> bool:
    """One chat call; True when the client received the whole response."""
    headers = {"Idempotency-Key": key}
    try:
        if stream:
            headers |= {"X-Fake-Mode": "slow", "X-Fake-Tokens": "30"}
            chunks = await client.chat.completions.create(
                model="m", messages=MSG, stream=True, extra_headers=headers
            )
            finish = [c.choices[0].finish_reason async for c in chunks if c.choices]
            return finish[-1:] == ["length"]
        done = await client.chat.completions.create(model="m", messages=MSG, extra_headers=headers)
        return done.choices[0].finish_reason == "length"
    except (openai.APIError, httpx2.HTTPError):
        return False


async def _until(cond: Any, limit_s: float, what: str) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {limit_s}s waiting for {what}"
        await asyncio.sleep(0.005)


@pytest.mark.timeout(40)
async def test_sigterm_under_load_loses_no_record(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    fake = await engine_factory(name="up")
    # Records reach disk only at shutdown (the interval flush never comes): SIGTERM must flush.
    settings = {
        "proxy": {"proxy_id": "p-term", "shutdown_grace_s": 10},
        "store": {"flush_interval_s": 600},
    }
    async with proxy_process(tmp_path, fake.url, settings) as proxy, _client(proxy.url) as client:
        keys = [uuid.uuid4().hex for _ in range(200)]
        streams = set(keys[::4])  # 50 paced streams of ~0.3 s among 150 plain calls
        tasks = {k: asyncio.create_task(_complete_call(client, k, k in streams)) for k in keys}
        await _until(lambda: fake.in_flight >= 20, 30, "calls in flight at the replica")
        received = {
            v for c in fake.calls for h, v in c.headers.items() if h.lower() == "idempotency-key"
        }
        proxy.proc.send_signal(signal.SIGTERM)
        # Calls keep coming while it shuts down: they may be refused, never half-recorded.
        late = [uuid.uuid4().hex for _ in range(50)]
        for k in late:
            tasks[k] = asyncio.create_task(_complete_call(client, k, False))
            await asyncio.sleep(0.002)
        done = dict(zip(tasks, await asyncio.gather(*tasks.values()), strict=True))
        assert await proxy.exit_code(15) == 0, proxy.stderr()
    completed = {k for k, ok in done.items() if ok}
    rows = StoreReader(proxy.store).calls().fetchall()
    recorded = {r[0]: r for r in rows}
    status_at = [name for name, _ in COLUMNS].index("status")
    assert len(recorded) == len(rows), "a call was recorded twice"
    missing = completed - set(recorded)
    assert not missing, f"{len(missing)} completed calls have no record"
    assert all(recorded[k][status_at] == 200 for k in completed)
    # Every call the replica had received by SIGTERM (many still in flight) finished for its client.
    assert received & streams and all(done[k] for k in received)
    assert " written, 0 dropped" in proxy.stderr()


@pytest.mark.timeout(30)
async def test_sigterm_cuts_calls_past_the_grace_and_records_them(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    fake = await engine_factory(name="up")
    settings = {
        "proxy": {"proxy_id": "p-grace", "shutdown_grace_s": 0.5},
        "store": {"flush_interval_s": 600},
    }
    async with proxy_process(tmp_path, fake.url, settings) as proxy, _client(proxy.url) as client:
        held = {"X-Fake-Mode": "hold"}  # the fake never lets these finish

        async def call(stream: bool) -> None:
            if stream:
                chunks = await client.chat.completions.create(
                    model="m", messages=MSG, stream=True, extra_headers=held
                )
                [_ async for _ in chunks]
            else:
                await client.chat.completions.create(model="m", messages=MSG, extra_headers=held)

        tasks = [asyncio.create_task(call(i % 2 == 0)) for i in range(10)]
        await _until(lambda: fake.in_flight == 10, 10, "10 held calls at the replica")
        t_term = time.monotonic()
        proxy.proc.send_signal(signal.SIGTERM)
        assert await proxy.exit_code(10) == 0, proxy.stderr()
        stopped_s = time.monotonic() - t_term
        results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, openai.APIError | httpx2.HTTPError) for r in results), results
    assert stopped_s < 5, stopped_s
    await _until(lambda: fake.cancelled == 10, 3, "every held upstream call to be cancelled")
    rows = StoreReader(proxy.store).calls().fetchall()
    errors = [r[[name for name, _ in COLUMNS].index("error")] for r in rows]
    assert len(rows) == 10 and all(errors), errors


@pytest.mark.timeout(40)
async def test_sigkill_under_load_leaves_only_complete_segments(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    fake = await engine_factory(name="up")
    # Tiny, frequent segments: the writer is busy all the time, so the kill lands mid-write
    # more often than not.
    settings = {
        "proxy": {"proxy_id": "p-kill"},
        "store": {"flush_interval_s": 0.01, "segment_rows": 8},
    }
    seg_dir = segment_dir(tmp_path / "store", "p-kill")
    async with proxy_process(tmp_path, fake.url, settings) as proxy, _client(proxy.url) as client:
        stop = asyncio.Event()

        async def load() -> None:
            while not stop.is_set():
                await _complete_call(client, uuid.uuid4().hex, False)

        workers = [asyncio.create_task(load()) for _ in range(32)]
        try:
            await _until(lambda: len(list(seg_dir.glob("*.parquet"))) >= 10, 20, "segments")
            proxy.proc.send_signal(signal.SIGKILL)
            assert await proxy.exit_code(5) == -signal.SIGKILL
        finally:
            stop.set()
            await asyncio.gather(*workers)
    segments = sorted(seg_dir.glob("*.parquet"))
    others = [p.name for p in seg_dir.iterdir() if p.suffix != ".parquet"]
    # Anything not a finished segment is a hidden temporary that no reader's glob matches.
    assert all(n.startswith(".") and n.endswith(".tmp") for n in others), others
    con = duckdb.connect(":memory:")
    names = [name for name, _ in COLUMNS]
    rows = 0
    for seg in segments:
        rel = con.sql(f"SELECT * FROM read_parquet('{seg}', hive_partitioning = false)")
        assert rel.columns == names, seg
        n = len(rel.fetchall())
        assert 1 <= n <= 8, seg
        rows += n
    [(total,)] = StoreReader(proxy.store).calls().aggregate("count(*)").fetchall()
    assert total == rows and len(segments) >= 10
    # The next writer of that proxy removes what the killed one left half-written.
    SegmentWriter(proxy.store, "p-kill").close()
    assert [p.name for p in seg_dir.iterdir() if p.suffix != ".parquet"] == []
    assert len(sorted(seg_dir.glob("*.parquet"))) == len(segments)


@pytest.mark.timeout(60)
async def test_sigkill_loses_no_call_answered_before_it(
    engine_factory: EngineFactory, tmp_path: Path
) -> None:
    # No flush comes before the kill (600 s interval): every record lives only in memory and in
    # the journal. The restarted proxy replays the journal: each call answered 50 ms or more
    # before the kill is in the store, once.
    fake = await engine_factory(name="up")
    settings = {
        "proxy": {"proxy_id": "p-journal", "shutdown_grace_s": 5},
        "store": {"flush_interval_s": 600},
    }
    answered: dict[str, float] = {}
    async with proxy_process(tmp_path, fake.url, settings) as proxy, _client(proxy.url) as client:
        stop = asyncio.Event()

        async def load() -> None:  # 16 callers at ~12 calls/s each: ~200 calls/s
            while not stop.is_set():
                key = uuid.uuid4().hex
                if await _complete_call(client, key, False):
                    answered[key] = time.monotonic()
                await asyncio.sleep(0.08)

        workers = [asyncio.create_task(load()) for _ in range(16)]
        try:
            await _until(lambda: len(answered) >= 300, 30, "answered calls")
            killed_at = time.monotonic()
            proxy.proc.send_signal(signal.SIGKILL)
            assert await proxy.exit_code(5) == -signal.SIGKILL
        finally:
            stop.set()
            await asyncio.gather(*workers)
    assert StoreReader(proxy.store).calls().fetchall() == []  # nothing had been flushed
    async with proxy_process(tmp_path, fake.url, settings) as again:
        again.proc.send_signal(signal.SIGTERM)
        assert await again.exit_code(15) == 0, again.stderr()
    assert "replayed" in again.stderr()
    ids = [r[0] for r in StoreReader(proxy.store).calls().fetchall()]
    assert len(ids) == len(set(ids)), "a call was recorded twice"
    due = {k for k, t in answered.items() if t <= killed_at - 0.05}
    missing = due - set(ids)
    assert len(due) >= 250 and not missing, f"{len(missing)} of {len(due)} answered calls lost"


def _scepsy_proxy() -> list[str]:
    script = Path(sys.executable).parent / "scepsy-proxy"
    return [str(script)] if script.exists() else [sys.executable, "-m", "proxy.cli"]


BAD_CONFIGS: list[tuple[dict[str, Any], str]] = [
    ({"proxy": {"upstreams": [{"model": "m", "url": "ftp://x"}]}}, "proxy.upstreams[0].url"),
    ({"store": {"flush_interval_s": "soon"}}, "store.flush_interval_s"),
    ({"proxy": {"upstreamz": []}}, "proxy.upstreamz"),
    ({"proxy": {"workers": 0}}, "proxy.workers"),
    (
        {
            "proxy": {"upstreams": [{"model": "m", "url": "http://127.0.0.1:9"}], "workers": 2},
            "store": {"path": "/dev/null/store"},  # under a file: no folder can be made
        },
        "store.path",
    ),
]


@pytest.mark.timeout(30)
async def test_bad_config_exits_2_with_one_line_naming_the_key(tmp_path: Path) -> None:
    async def run(i: int, doc: dict[str, Any]) -> tuple[int | None, bytes, bytes]:
        config = tmp_path / f"bad{i}.yaml"
        config.write_text(yaml.safe_dump(doc))
        proc = await asyncio.create_subprocess_exec(
            *_scepsy_proxy(),
            "--config",
            str(config),
            cwd=tmp_path,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), 20)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        return proc.returncode, out, err

    results = await asyncio.gather(*(run(i, doc) for i, (doc, _) in enumerate(BAD_CONFIGS)))
    for (doc, key), (code, out, err) in zip(BAD_CONFIGS, results, strict=True):
        lines = err.decode().splitlines()
        assert code == 2, (doc, code, err)
        assert len(lines) == 1 and key in lines[0], (doc, lines)
        assert b"Traceback" not in err and out == b"", (doc, out)

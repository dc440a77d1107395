"""The daemon profiles on its own: a model that appears in traffic without a profile is profiled
on a free GPU through the backend (against a real loopback engine), its points are saved, the
replica is stopped, and the next pass plans with the new profile; with no free GPU the request
waits and nothing starts; the decision log and /metrics show each run."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from optimizer.control.reprofile import is_profiling
from optimizer.daemon.metrics import DaemonMetrics
from optimizer.daemon.reprofiler import Reprofiler
from optimizer.daemon.service import Daemon
from optimizer.model.curves import ProfileBook
from optimizer.plan.observed import RunningReplica
from optimizer.plan.planner import Plan, Step
from optimizer.plan.target import GroupSpec
from optimizer.profiling.window import SweepSettings
from optimizer.store.decisions import load_decisions
from optimizer.store.profiles import load_points
from shared import metric_names
from shared.cluster import cluster_from_settings as daemon_cluster
from shared.records import CallRecord
from shared.settings import Settings, settings_from_mapping
from shared.store import SegmentWriter
from tests.loopback import serving
from tests.optimizer.control.test_step import _stats
from tests.optimizer.daemon.test_daemon import (
    RAG_MODELS,
    FakeBackend,
    FakeClock,
    _profiles,
    _settings_doc,
)

S = 1_000_000
T0 = 1_700_000_000.0
MODEL = "fake-1b"
SLOTS, SERVICE_S = 8, 0.02  # the fake engine serves 8 calls at once, 20 ms each
TINY = SweepSettings(
    calls_per_point=80,
    min_groups_per_point=8,
    min_point_s=0.4,
    max_point_s=1.0,
    curve=(0.3,),
    resolution=0.25,
    max_points=3,
    probe_concurrency=16,
    probe_max_s=0.5,
)


@pytest.fixture
async def engine() -> AsyncIterator[str]:
    """A FIFO engine with SLOTS servers of SERVICE_S each (OpenAI chat shape)."""
    slots = asyncio.Semaphore(SLOTS)

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        async with slots:
            await asyncio.sleep(SERVICE_S)
        return web.json_response({"choices": [{"message": {"content": "ok"}}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    async with serving(app) as url:
        yield url


class ProfilingBackend(FakeBackend):
    """The fake backend, whose profiling replicas answer at the loopback engine's URL."""

    def __init__(self, engine_url: str) -> None:
        super().__init__()
        self.engine_url = engine_url
        self.at_start: list[tuple[GroupSpec, tuple[RunningReplica, ...]]] = []

    async def start(self, group: GroupSpec) -> None:
        self.at_start.append((group, tuple(self.replicas.values())))
        await super().start(group)
        if group.id.startswith("profiling-"):
            for rid, r in list(self.replicas.items()):
                if r.group == group.id:
                    self.replicas[rid] = RunningReplica(
                        r.id, r.group, r.model, r.node, r.gpus, r.share, r.tp,
                        self.engine_url, True,
                    )  # fmt: skip


def _trace(store: Path, requests: int = 30) -> None:
    """Workflow ``w``: per request two parallel calls of MODEL, then one after both."""
    rows = []
    for g in range(requests):
        t = T0 + 2.0 * g
        for i, (a, b) in enumerate(((0.0, 0.2), (0.0, 0.3), (0.4, 0.6))):
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"r{g} c{i}"}]}
            rows.append(
                CallRecord(
                    call_id=f"r{g}c{i}",
                    proxy_id="t",
                    workflow="w",
                    request_id=f"r{g}",
                    model=MODEL,
                    endpoint="/v1/chat/completions",
                    status=200,
                    t_start=round((t + a) * S),
                    t_end=round((t + b) * S),
                    prompt_tokens=20,
                    completion_tokens=5,
                    body=orjson.dumps(body).decode(),
                ).row()
            )
    writer = SegmentWriter(store, "p")
    try:
        writer.write(rows)
    finally:
        writer.close()


def _settings(store: Path, gpus: int = 2, **reprofile: Any) -> Settings:
    return settings_from_mapping(
        {
            "store": {"path": str(store)},
            "cluster": {"nodes": [{"name": "n0", "gpu_type": "a6000", "gpus": gpus}]},
            "rollout": {
                "backend": "local",
                "models": [{"name": MODEL}, {"name": "other-1b"}],
                "local": {"state_dir": str(store / "local")},
            },
            "optimizer": {
                "interval_s": 20,
                "window_s": 40,
                "settle_s": 3,
                "windows_to_confirm": 2,
                "cooldown_s": 60,
                "min_requests": 10,
                "granularity": 2,
                "listen": "127.0.0.1:0",
                "reprofile": reprofile,
            },
        },
        env=None,
    )


async def test_a_model_without_a_profile_is_profiled_and_planned_with_no_person(
    tmp_path: Path, engine: str
) -> None:
    _trace(tmp_path)
    backend = ProfilingBackend(engine)
    clock = FakeClock(T0 + 50.0)
    daemon = Daemon(_settings(tmp_path), backend, clock=clock, reprofile_sweep=TINY)

    first = await daemon.tick()
    assert first.decision.kind == "error" and MODEL in " ".join(first.decision.reasons)
    running = f"{metric_names.OPTIMIZER_REPROFILE_RUNNING} 1.0"
    assert running in daemon.metrics.exposition().decode()
    await asyncio.wait_for(daemon.reprofile_done(), 60)

    # the profiling replica ran on a GPU nothing served, and is gone
    (group, held), *_ = backend.at_start
    assert group.id.startswith("profiling-") and group.models == (MODEL,)
    assert not {g for r in held for g in r.gpus} & set(group.gpus)
    assert backend.stopped == [group.id]
    assert not any(is_profiling(r) for r in backend.replicas.values())

    clock.t += 20.0
    second = await daemon.tick()
    assert second.decision.kind != "error", second.decision.reasons
    points = [p for p in load_points(tmp_path) if p.model == MODEL]
    assert points and all(p.source == "replay" and p.gpu_type == "a6000" for p in points)
    assert {(p.tp, p.share) for p in points} == {(1, 1.0)}

    rows = [d for d in load_decisions(tmp_path) if d["kind"] == "reprofile"]
    assert [r["outcome"].split(":")[0] for r in rows] == ["started", "ok"]
    change = rows[1]["changes"][0]
    assert change["reason"] == "no_profile" and change["points_saved"] == len(points)
    assert change["saturation_before"] is None and change["saturation_after"] > 0
    text = daemon.metrics.exposition().decode()
    assert f'{metric_names.OPTIMIZER_REPROFILES}{{outcome="ok",reason="no_profile"}} 1.0' in text
    assert f"{metric_names.OPTIMIZER_REPROFILE_RUNNING} 0.0" in text

    clock.t += 20.0  # profiled within min_interval_s: not again
    await daemon.tick()
    assert sum(1 for g, _ in backend.at_start if g.id.startswith("profiling-")) == 1


async def test_with_no_free_gpu_the_request_waits_and_nothing_starts(tmp_path: Path) -> None:
    _trace(tmp_path)
    backend = FakeBackend()
    backend.replicas["a"] = RunningReplica(
        "a", "g1", "other-1b", "n0", (0,), 0.5, 1, "http://fake/a", True
    )
    clock = FakeClock(T0 + 50.0)
    daemon = Daemon(_settings(tmp_path, gpus=1), backend, clock=clock, reprofile_sweep=TINY)
    await daemon.tick()
    clock.t += 20.0
    await daemon.tick()
    assert not any(g.startswith("profiling-") for g in backend.started)
    rows = [d for d in load_decisions(tmp_path) if d["kind"] == "reprofile_waiting"]
    assert len(rows) == 1  # recorded once, not every pass
    assert "no free a6000 GPU" in rows[0]["outcome"] and MODEL in rows[0]["outcome"]


async def test_disabled_reprofiling_starts_nothing(tmp_path: Path) -> None:
    _trace(tmp_path)
    backend = FakeBackend()
    daemon = Daemon(_settings(tmp_path, enabled=False), backend, clock=FakeClock(T0 + 50.0))
    await daemon.tick()
    assert backend.started == [] and daemon.reprofiles == []


def _plan_to(group: GroupSpec) -> Plan:
    """A plan that starts ``group``."""
    return Plan((group,), (Step("start", group.id, group.node, group.gpus, (), ()),))


class StuckBackend(FakeBackend):
    """A fake backend whose profiling replicas never become ready (a run stays in flight)."""

    async def wait_ready(self, group: GroupSpec) -> None:
        if group.id.startswith("profiling-"):
            await asyncio.Event().wait()


async def _in_flight(tmp_path: Path) -> tuple[Daemon, StuckBackend, str]:
    _trace(tmp_path)
    backend = StuckBackend()
    daemon = Daemon(_settings(tmp_path), backend, clock=FakeClock(T0 + 50.0))
    await daemon.tick()
    for _ in range(500):  # the run's task starts its replica (slowly on a loaded machine)
        started = [g for g in backend.started if g.startswith("profiling-")]
        if started:
            break
        await asyncio.sleep(0.01)
    (gid,) = started
    return daemon, backend, gid


async def test_a_rollout_that_needs_the_profiling_gpus_cancels_the_run_first(
    tmp_path: Path,
) -> None:
    daemon, backend, gid = await _in_flight(tmp_path)
    held = next(r for r in backend.replicas.values() if r.group == gid).gpus
    other = tuple(g for g in (0, 1) if g not in held)
    await daemon.reprofiler.yield_gpus(_plan_to(GroupSpec("g-other", "n0", other, ())))
    assert backend.stopped == []  # a rollout on other GPUs leaves it running
    await daemon.reprofiler.yield_gpus(_plan_to(GroupSpec("g-new", "n0", held, ())))
    assert backend.stopped == [gid] and not backend.replicas
    await daemon.tick()  # the next pass records the cancelled run
    rows = [d for d in load_decisions(tmp_path) if d["kind"] == "reprofile"]
    assert [r["outcome"] for r in rows] == ["started", "cancelled"]


async def test_stopping_the_loop_cancels_the_run_and_stops_its_replica(tmp_path: Path) -> None:
    daemon, backend, gid = await _in_flight(tmp_path)
    loop = asyncio.create_task(daemon.run())
    await asyncio.sleep(0.1)
    loop.cancel()
    with pytest.raises(asyncio.CancelledError):
        await loop
    assert gid in backend.stopped and not backend.replicas


async def test_a_profiling_group_no_run_owns_is_stopped(tmp_path: Path) -> None:
    _trace(tmp_path)
    backend = FakeBackend()
    backend.replicas["p"] = RunningReplica(
        "p", "profiling-left", MODEL, "n0", (1,), 1.0, 1, "http://fake/p", True
    )
    daemon = Daemon(_settings(tmp_path, enabled=False), backend, clock=FakeClock(T0 + 50.0))
    await daemon.tick()
    assert backend.stopped == ["profiling-left"]


async def test_drift_held_for_several_passes_starts_a_run_and_one_bad_pass_does_not(
    tmp_path: Path,
) -> None:
    """Fake time: the pass's predictions against the observed latency, pass by pass."""
    settings = settings_from_mapping(
        _settings_doc(tmp_path, min_requests=10, windows_to_confirm=2), env=None
    )
    _profiles(tmp_path)
    backend = FakeBackend()
    for k, m in enumerate(RAG_MODELS):
        backend.replicas[m] = RunningReplica(
            m, f"g{k}", m, "n0", (0,), 0.3, 1, f"http://f/{m}", True
        )
    observed = await backend.observe()
    clock = FakeClock(T0)
    rep = Reprofiler(
        settings, backend, DaemonMetrics(), daemon_cluster(settings.cluster), {"n0": "a6000"}, clock
    )
    book = ProfileBook(load_points(tmp_path))
    stats = _stats(1.0, latency=1.0)  # 40 requests a window, 1 s observed

    async def passes(gaps: list[float], start: int) -> None:
        for k, gap in enumerate(gaps):
            clock.t += 20.0
            rep.note_drift(start + k, clock.t - 43.0, stats, {"rag": 1.0 + gap}, False)
            await rep.consider(clock.t, stats, observed, book, None)

    await passes([0.0, 0.0, 2.0, 0.0, 2.0, 2.0], 0)  # one bad pass, then two: not yet
    assert rep.runs == []
    await passes([2.0], 6)  # the third in a row
    assert [(r.model, r.reason) for r in rep.runs] == [
        ("bge-reranker-base", "drift")
    ]  # never profiled: by name
    await rep.done()  # the store holds no calls to replay: the run fails
    assert not await rep.harvest()
    rows = [d for d in load_decisions(tmp_path) if d["kind"] == "reprofile"]
    assert [r["outcome"].split(":")[0] for r in rows] == ["started", "failed"]
    assert "over-predicted by 200%" in rows[0]["reasons"][0]
    assert backend.started == []  # it failed reading the trace, before starting a replica

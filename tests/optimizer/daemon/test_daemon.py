"""The optimizer daemon's loop against an in-memory backend and a store of simulated traces:
decision rows with reasons, one rollout per shift, adoption on restart, metrics names, and a
stop that leaves the engines running (in-process and a real SIGTERM to ``scepsy run``)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from optimizer.cli.run import serve
from optimizer.daemon.service import Daemon, make_app
from optimizer.plan.observed import Observed, Route, RunningReplica
from optimizer.plan.target import GroupSpec
from optimizer.store.decisions import load_decisions
from optimizer.store.profiles import save_points
from shared import metric_names
from shared.records import COLUMN_NAMES
from shared.settings import Settings, settings_from_mapping
from shared.store import SegmentWriter
from sim.cluster import Allocation
from sim.des import WorkloadSpec, simulate
from sim.trace import DEFAULT_T0_US, call_rows, write_trace
from tests.optimizer.conftest import call
from tests.optimizer.control.test_step import _points as step_points

T0 = DEFAULT_T0_US / 1e6
RAG_MODELS = ("e5-base-v2", "bge-reranker-base", "llama-3-8b")


class FakeBackend:
    """An in-memory :class:`optimizer.rollout.backend.Backend`: started replicas are ready at once."""

    def __init__(self) -> None:
        self.replicas: dict[str, RunningReplica] = {}
        self.routes: tuple[Route, ...] = ()
        self.started: list[str] = []
        self.stopped: list[str] = []
        self.observed = 0
        self.passes = asyncio.Event()  # set once a few passes observed the backend

    async def observe(self) -> Observed:
        self.observed += 1
        if self.observed >= 4:  # a pass observes once, twice after a rollout
            self.passes.set()
        return Observed(tuple(self.replicas.values()), self.routes)

    async def start(self, group: GroupSpec) -> None:
        self.started.append(group.id)
        for r in group.replicas:
            self.replicas.setdefault(
                r.id,
                RunningReplica(
                    r.id,
                    group.id,
                    r.spec.model,
                    group.node,
                    r.spec.gpus,
                    r.spec.share,
                    r.spec.tp,
                    f"http://fake/{r.id}",
                    True,
                    r.spec.memory_bytes_per_gpu,
                    r.spec.revision,
                ),
            )

    async def wait_ready(self, group: GroupSpec) -> None:
        return None

    async def push_routes(self, routes: Sequence[Route]) -> None:
        self.routes = tuple(routes)

    async def wait_drained(self, replicas: Sequence[RunningReplica]) -> None:
        return None

    async def stop(self, group_id: str) -> None:
        self.stopped.append(group_id)
        self.replicas = {k: r for k, r in self.replicas.items() if r.group != group_id}


def _settings(store: Path, **optimizer: Any) -> Settings:
    return settings_from_mapping(_settings_doc(store, **optimizer))


def _settings_doc(store: Path, **optimizer: Any) -> dict[str, Any]:
    return {
        "store": {"path": str(store)},
        "cluster": {"nodes": [{"name": "n0", "gpu_type": "a6000", "gpus": 2}]},
        "rollout": {
            "backend": "local",
            "models": [{"name": m} for m in RAG_MODELS],
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
            **optimizer,
        },
    }


def _profiles(store: Path) -> None:
    """The synthetic RAG curves the control step's tests use, stored."""
    save_points(store, step_points())


def _trace(store: Path, phases: Sequence[tuple[float, float]]) -> None:
    """RAG traffic at ``rate`` for ``seconds``, phase after phase (simulated)."""
    alloc = Allocation.of(
        ("e5-base-v2", "a6000", 1, 1.0, 1),
        ("bge-reranker-base", "a6000", 1, 1.0, 1),
        ("llama-3-8b", "a6000", 1, 1.0, 3),
    )
    t0 = DEFAULT_T0_US
    for k, (rate, seconds) in enumerate(phases):
        res = simulate(
            alloc, [WorkloadSpec("rag", rate)], duration_s=seconds, seed=k, record_calls=True
        )
        if k == 0:
            write_trace(res, store, t0_us=t0, bodies=False)
        else:  # request ids restart at rag-0 in every run: keep them apart
            rid = COLUMN_NAMES.index("request_id")
            rows = [
                (*r[:rid], f"p{k}-{r[rid]}", *r[rid + 1 :])
                for r in call_rows(res, t0_us=t0, bodies=False)
            ]
            writer = SegmentWriter(store, f"phase{k}")
            try:
                writer.write(rows)
            finally:
                writer.close()
        t0 += round(seconds * 1e6)


class FakeClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


async def _run(daemon: Daemon, clock: FakeClock, until: float) -> None:
    while clock.t <= T0 + until:
        await daemon.tick()
        clock.t += daemon.cfg.interval_s


@pytest.mark.slow  # eleven passes (DuckDB statistics each) over two simulated phases: ~5 s
async def test_a_held_shift_is_planned_once_and_every_pass_is_a_decision_row(
    tmp_path: Path,
) -> None:
    _profiles(tmp_path)
    _trace(tmp_path, [(1.0, 120.0), (3.0, 120.0)])
    backend = FakeBackend()
    clock = FakeClock(T0 + 40)
    # the synthetic curves are whole-GPU only: the shares planned here would be reprofiled
    settings = _settings(tmp_path, reprofile={"borrowed_shares": False})
    daemon = Daemon(settings, backend, clock=clock)
    await _run(daemon, clock, 240)
    rows = load_decisions(tmp_path)
    assert len(rows) == daemon.ticks >= 10
    assert all(r["reasons"] for r in rows)
    taken = [r for r in rows if r["taken"]]
    assert taken[0]["changes"][0]["kind"] == "initial" and taken[0]["outcome"] == "ok"
    assert "cannot serve rag" in taken[0]["reasons"][-1]
    # The tripled rate is noticed (confirmed over two windows) and judged exactly once.
    shifted = [r for r in rows if any(c["kind"] == "rate_shift" for c in r["changes"])]
    judged = [r for r in shifted if r["kind"] in ("rollout", "hold_gain", "unchanged")]
    assert len(judged) == 1, [(r["t"] - T0, r["kind"], r["reasons"]) for r in rows]
    assert judged[0]["t"] - T0 >= 120 + daemon.cfg.interval_s
    assert judged[0]["rates"]["rag"] == pytest.approx(3.0, rel=0.3)
    assert len(taken) <= 2
    assert all(r["kind"] in ("steady", "pending") for r in rows if r["t"] > judged[0]["t"])
    # What runs is what the last rollout planned: every rag model served and routed.
    models = {r.model for r in backend.replicas.values()}
    assert models == set(RAG_MODELS)
    assert {r.model for r in backend.routes} == set(RAG_MODELS)
    last = taken[-1]
    assert {m for m in last["allocation"]["rag"] if m != "_"} == set(RAG_MODELS)
    assert last["predicted"]["rag"]["proposed"] > 0
    assert last["plan"] and last["plan"][0].startswith("plan:")


async def test_a_restarted_daemon_adopts_what_runs_and_starts_nothing(tmp_path: Path) -> None:
    _profiles(tmp_path)
    _trace(tmp_path, [(1.0, 120.0)])
    backend = FakeBackend()
    clock = FakeClock(T0 + 100)
    first = Daemon(_settings(tmp_path), backend, clock=clock)
    assert (await first.tick()).decision.kind == "rollout"
    started = list(backend.started)
    again = Daemon(_settings(tmp_path), backend, clock=clock)
    report = await again.tick()
    assert report.decision.kind == "unchanged", report.decision.reasons
    assert backend.started == started and not backend.stopped


async def test_a_model_without_a_profile_is_an_error_decision_naming_it(tmp_path: Path) -> None:
    _trace(tmp_path, [(1.0, 120.0)])
    backend = FakeBackend()
    daemon = Daemon(_settings(tmp_path), backend, clock=FakeClock(T0 + 100))
    report = await daemon.tick()
    assert report.decision.kind == "error"
    assert "no profile" in report.decision.reasons[-1]
    assert not backend.started
    assert load_decisions(tmp_path)[0]["kind"] == "error"


async def test_a_model_a_quiet_workflow_still_calls_is_never_dropped(tmp_path: Path) -> None:
    _profiles(tmp_path)
    _trace(tmp_path, [(1.0, 120.0)])
    # "side" calls llama-3.2-1b twice in the window: too few requests to plan for.
    writer = SegmentWriter(tmp_path, "side")
    try:
        writer.write(
            [call("side", f"s{k}", "llama-3.2-1b", T0 + 80.0 + k, T0 + 81.0 + k) for k in range(2)]
        )
    finally:
        writer.close()
    backend = FakeBackend()
    side = RunningReplica(
        "side-0", "gside", "llama-3.2-1b", "n0", (1,), 0.5, 1, "http://fake/side-0", True
    )
    backend.replicas[side.id] = side
    backend.routes = (Route(side.model, side.url),)
    settings = settings_from_mapping(
        {
            **_settings_doc(tmp_path),
            "rollout": {
                "backend": "local",
                "models": [{"name": m} for m in (*RAG_MODELS, "llama-3.2-1b")],
                "local": {"state_dir": str(tmp_path / "local")},
            },
        }
    )
    report = await Daemon(settings, backend, clock=FakeClock(T0 + 100)).tick()
    assert report.decision.kind == "pending"
    assert "waiting: the plan would stop serving llama-3.2-1b" in report.decision.reasons[-1]
    assert not backend.started and not backend.stopped


async def test_an_empty_store_is_no_data(tmp_path: Path) -> None:
    daemon = Daemon(_settings(tmp_path), FakeBackend(), clock=FakeClock(T0))
    assert (await daemon.tick()).decision.kind == "no_data"


async def test_metrics_export_every_optimizer_name_and_health_answers(tmp_path: Path) -> None:
    _profiles(tmp_path)
    _trace(tmp_path, [(1.0, 120.0)])
    daemon = Daemon(_settings(tmp_path), FakeBackend(), clock=FakeClock(T0 + 100))
    await daemon.tick()
    runner = aiohttp.web.AppRunner(make_app(daemon, loop=False))
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                text = await resp.text()
            async with http.get(f"http://127.0.0.1:{port}/health") as resp:
                health = await resp.json()
                assert resp.status == 200
    finally:
        await runner.cleanup()
    for name in metric_names.OPTIMIZER_METRICS:
        assert f"# HELP {name} " in text or f"# HELP {name.removesuffix('_total')}" in text, name
    assert 'scepsy_optimizer_workflow_rate{workflow="rag"}' in text
    assert 'scepsy_optimizer_calls_per_request{model="llama-3-8b",workflow="rag"} 1.0' in text
    assert 'scepsy_optimizer_decisions_total{code="rollout"} 1.0' in text
    assert 'scepsy_optimizer_rollouts_total{code="ok"} 1.0' in text
    assert 'scepsy_optimizer_replicas{model="llama-3-8b"}' in text
    assert health["ticks"] == 1 and health["last_decision"] == "rollout"


async def test_stop_ends_the_service_within_seconds_and_leaves_engines_running(
    tmp_path: Path,
) -> None:
    _profiles(tmp_path)
    _trace(tmp_path, [(1.0, 120.0)])
    backend = FakeBackend()
    settings = _settings(tmp_path, interval_s=0.2)
    stop = asyncio.Event()
    task = asyncio.create_task(serve(settings, backend, "127.0.0.1:0", stop, handle_signals=False))
    await asyncio.wait_for(backend.passes.wait(), 10)
    stop.set()
    t0 = time.monotonic()
    await asyncio.wait_for(task, 5)
    assert time.monotonic() - t0 < 3
    assert len(load_decisions(tmp_path)) >= 2  # the loop ran (on the wall clock: no data)
    assert not backend.stopped


def test_sigterm_stops_scepsy_run_within_seconds(tmp_path: Path) -> None:
    config = tmp_path / "settings.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "store": {"path": str(tmp_path / "store")},
                "cluster": {"nodes": [{"name": "n0", "gpu_type": "a6000", "gpus": 1}]},
                "rollout": {"local": {"state_dir": str(tmp_path / "local")}},
                "optimizer": {"interval_s": 0.5, "window_s": 10, "listen": "127.0.0.1:0"},
            }
        )
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "optimizer.cli", "run", "--config", str(config)],
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[3],
        start_new_session=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "health and metrics on http://127.0.0.1:" in line, line
        os.kill(proc.pid, signal.SIGTERM)
        t0 = time.monotonic()
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - t0 < 5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

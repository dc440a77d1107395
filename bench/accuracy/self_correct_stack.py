"""The emulated stack of the self-correction bench: proxy, engines, daemon, load, one restart.

Role: what :mod:`bench.accuracy.self_correct` runs its scenarios on, the local stack of
``scepsy demo`` (:mod:`optimizer.demo.run`) with the bench's own allocation and profiles: a
proxy process recording into a fresh store, emulated engines (``sim.cli``) started by the
:class:`~optimizer.rollout.local.backend.LocalBackend`, the real
:class:`~optimizer.daemon.service.Daemon` in this process (every pass kept as a
:class:`~optimizer.daemon.service.TickReport`), and ``examples.load`` drivers (the plain
``openai`` SDK) as subprocesses. :func:`simulated_profiles` computes the demo's simulated
profiles once (``python -m sim.profiles``) so both scenarios share them.

:func:`restart_replica` changes how one served replica behaves without the product knowing:
it kills the engine process of one replica and starts a replacement on the same port with
``--speedup`` set (an emulated engine whose model takes ``1/speedup`` x as long in wall time),
then writes the replacement's pid into the backend's state record so that the backend adopts
it as the same replica (same URL, same route). The product has no hook for this; it is done
here with the local backend's own process and state helpers.

Invariants: every process this module starts is stopped by :meth:`Emulated.close` (engines,
profiling replicas, proxy, drivers), on errors too; the restart runs without an ``await``
between the kill and the state write, so no daemon pass sees the replica half-replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import yaml

from optimizer.daemon.service import Daemon, TickReport
from optimizer.demo.run import (
    LOAD_DRIVER,
    DemoConfig,
    Stack,
    bootstrap,
    settings_doc,
    wait_http,
)
from optimizer.rollout.local import engines
from optimizer.rollout.local.backend import LocalBackend
from optimizer.store.profiles import save_points
from shared.cluster import cluster_from_settings
from shared.ports import free_port
from shared.profile_points import ProfilePoint, import_json
from shared.settings import Settings, load_settings
from shared.store import StoreReader

__all__ = ["Emulated", "Shape", "first_call_s", "restart_replica", "simulated_profiles"]

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Shape:
    """Rates and the daemon's cadence. Windows of 20 s at these rates give each RAG replica
    the 20 finished calls a live point needs (optimizer.model.live.MIN_CALLS)."""

    beam_rate: float = 0.8
    rag_rate: float = 1.5
    beam: tuple[int, int, int] = (2, 2, 5)
    passages: int = 200
    interval_s: float = 5.0
    window_s: float = 20.0
    min_requests: int = 4
    profile_calls: int = 200

    def demo(self) -> DemoConfig:
        return DemoConfig(
            beam_rate=self.beam_rate,
            rag_rate=self.rag_rate,
            beam=self.beam,
            passages=self.passages,
            interval_s=self.interval_s,
            window_s=self.window_s,
            min_requests=self.min_requests,
            profile_calls=self.profile_calls,
        )


def simulated_profiles(folder: Path, shape: Shape, timeout_s: float = 300.0) -> list[ProfilePoint]:
    """The demo's simulated profiles (every demo model at shares 1, 0.75, 0.5, 0.25)."""
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "profiles.json"
    argv = [sys.executable, "-m", "sim.profiles", "--out", str(out)]
    argv += ["--beam", ",".join(map(str, shape.beam)), "--calls", str(shape.profile_calls)]
    with open(folder / "profiles.log", "wb") as log:
        subprocess.run(argv, stdout=log, stderr=log, cwd=ROOT, timeout=timeout_s, check=True)
    return import_json(out.read_bytes())


def first_call_s(store: str, model: str) -> float | None:
    """When the store's first recorded call of ``model`` started (epoch s)."""
    reader = StoreReader(store)
    quoted = "'" + model.replace("'", "''") + "'"
    try:
        rows = reader.read(
            lambda calls: calls.filter(f"model = {quoted}").aggregate("min(t_start)").fetchall()
        )
    finally:
        reader.close()
    return None if not rows or rows[0][0] is None else int(rows[0][0]) / 1e6


def restart_replica(backend: LocalBackend, replica_id: str, speedup: float) -> dict[str, Any]:
    """Kill the engine of ``replica_id`` and start a replacement on the same port with
    ``--speedup speedup``; the backend's state record gets the new pid (module docstring)."""
    records = backend.state.load()
    rec = next(r for r in records.values() if r.engine(replica_id) is not None)
    old = rec.engine(replica_id)
    assert old is not None and old.pid is not None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(old.pid, signal.SIGKILL)
    while engines.start_time(old.pid) is not None:  # gone once reaped (a zombie reads gone)
        time.sleep(0.01)
    ports = {r.id: (p.port if (p := rec.engine(r.id)) else 0) for r in rec.group.replicas}
    launch = next(
        x
        for x in engines.launches(
            rec.group, backend.rollout, backend.cluster, ports, backend.state.path
        )
        if x.role == "engine" and x.name == replica_id
    )
    argv = (*launch.argv, "--speedup", f"{speedup:g}")
    fresh = engines.ProcRecord(
        "engine", old.name, old.model, old.port, old.url, engines.new_token(), old.log
    )
    started = engines.spawn(
        engines.Launch("engine", launch.name, launch.model, argv, launch.env, launch.port),
        fresh,
        backend.state.path,
    )
    backend.state.save(rec.with_proc(started))
    return {"replica": replica_id, "model": old.model, "url": old.url, "speedup": speedup}


def _load_argv(
    workflow: str, rate: float, duration_s: float, url: str, seed: int, shape: Shape
) -> list[str]:
    argv = [sys.executable, "-m", LOAD_DRIVER, "--workflow", workflow, "--rate", str(rate)]
    argv += ["--duration", str(duration_s), "--base-url", url, "--seed", str(seed)]
    if workflow == "beam":
        n, width, iterations = shape.beam
        argv += ["--n", str(n), "--width", str(width), "--iterations", str(iterations)]
    else:
        argv += ["--passages", str(shape.passages)]
    return argv


@dataclass
class Emulated:
    """One scenario's stack in ``run`` (a fresh folder): :meth:`start`, then :meth:`close`."""

    run: Path
    shape: Shape
    allocation: Sequence[Mapping[str, Any]]
    profiles: Sequence[ProfilePoint]
    reprofile: Mapping[str, Any] = field(default_factory=dict)  # optimizer.reprofile settings
    passes: list[TickReport] = field(default_factory=list)
    t0: float = 0.0  # epoch s when the load started
    settings: Settings | None = None
    backend: LocalBackend | None = None
    daemon: Daemon | None = None
    _stack: Stack | None = None
    _loads: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = None

    async def start(self, load_s: float) -> None:
        """Proxy, bootstrap engines, profiles in the store, load for ``load_s``, daemon."""
        self.run.mkdir(parents=True)
        port, token = free_port(), secrets.token_hex(16)
        doc = settings_doc(self.run, port, token, self.shape.demo())
        doc["rollout"]["allocation"] = [dict(a) for a in self.allocation]
        doc["optimizer"]["reprofile"] = dict(self.reprofile)
        (self.run / "settings.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        self.settings = settings = load_settings(self.run / "settings.yaml")
        self._stack = stack = Stack(self.run)
        stack.spawn("proxy", [sys.executable, "-m", "proxy.cli", "--config",
                              str(self.run / "settings.yaml"), "--log-level", "WARNING"])  # fmt: skip
        await wait_http(f"http://127.0.0.1:{port}/health", 60)
        cluster = cluster_from_settings(settings.cluster)
        self.backend = stack.backend = LocalBackend.from_settings(settings, cluster)
        await bootstrap(settings, self.backend)
        save_points(settings.store.path, list(self.profiles))
        url = f"http://127.0.0.1:{port}/v1"
        for k, (wf, rate) in enumerate(
            (("beam", self.shape.beam_rate), ("rag", self.shape.rag_rate))
        ):
            self._loads[wf] = stack.spawn(
                f"load-{wf}", _load_argv(wf, rate, load_s, url, k, self.shape), subprocess.PIPE
            )
        self.t0 = time.time()
        self.daemon = Daemon(settings, self.backend, on_tick=self.passes.append)
        self._task = asyncio.create_task(self.daemon.run(), name="bench-daemon")

    async def watch(self, seconds: float) -> None:
        """Sleep while the drivers run; a driver that fails ends the scenario."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for name, proc in self._loads.items():
                if proc.poll() not in (None, 0):
                    raise RuntimeError(f"load driver {name} exited with {proc.returncode}")
            if self._task is not None and self._task.done():
                raise RuntimeError("the daemon's loop ended")
            await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    async def stop_daemon(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def drivers(self, timeout_s: float = 240.0) -> dict[str, Any]:
        """Wait for the drivers' last requests; their JSON reports by workflow."""
        out: dict[str, Any] = {}
        for name, proc in self._loads.items():
            await asyncio.to_thread(proc.wait, timeout_s)
            assert proc.stdout is not None
            raw = proc.stdout.read()
            try:
                out[name] = orjson.loads(raw)["workflows"][name]
            except (orjson.JSONDecodeError, KeyError):
                out[name] = {"error": f"exit status {proc.returncode}"}
        return out

    async def close(self) -> None:
        await self.stop_daemon()
        if self._stack is not None:
            await self._stack.close()

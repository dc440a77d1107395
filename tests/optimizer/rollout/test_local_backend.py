"""The local backend with real emulated engines (processes) and a real proxy on loopback.

Every test tags its engines with its own state folder; the ``procs`` fixture kills whatever
carries that tag (by process group) when the test ends, whatever happened.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from optimizer.plan.observed import Route
from optimizer.plan.target import GroupSpec, ReplicaSpec, group_specs
from optimizer.rollout.backend import RolloutError, StepResult, converge
from optimizer.rollout.local.backend import LocalBackend
from optimizer.rollout.local.engines import (
    GroupRecord,
    ProcRecord,
    alive,
    find_tagged,
    launches,
    spawn,
)
from shared.cluster import GB, Cluster
from shared.rollout_settings import RolloutSettings
from shared.settings import settings_from_mapping
from shared.settings_schema import SettingsError, decode
from tests.proxy.conftest import ProxyHandle, start_proxy

E5, LLAMA = "e5-base-v2", "llama-3.2-1b"
TOKEN = "admin-secret"
CLUSTER = Cluster.uniform(1, 4, 2, "a6000", 48 * GB)


def rollout_settings(
    state: Path, proxies: list[str], *, speedup: float = 100.0, drain_s: float = 3.0, **local: Any
) -> RolloutSettings:
    fast = ["--speedup", str(speedup)]
    return decode(
        RolloutSettings,
        {
            "drain_s": drain_s,
            "models": [{"name": E5, "extra_args": fast}, {"name": LLAMA, "extra_args": fast}],
            "local": {
                "state_dir": str(state),
                "proxies": proxies,
                "admin_token": TOKEN,
                "ready_timeout_s": 30.0,
                "stop_grace_s": 3.0,
                "poll_interval_s": 0.05,
                "request_timeout_s": 10.0,
                **local,
            },
        },
    )


def target(
    rollout: RolloutSettings, *replicas: tuple[str, tuple[int, ...], float]
) -> tuple[GroupSpec, ...]:
    revisions = rollout.revisions()
    return group_specs(
        ReplicaSpec(m, "node-0", gpus, share, round(share * 20 * GB), revisions.get(m, ""))
        for m, gpus, share in replicas
    )


def before(r: RolloutSettings) -> tuple[GroupSpec, ...]:
    # e5 and llama share GPU 0 (launched one after the other), a second llama on GPU 1.
    return target(r, (E5, (0,), 0.5), (LLAMA, (0,), 0.5), (LLAMA, (1,), 1.0))


def after(r: RolloutSettings) -> tuple[GroupSpec, ...]:
    # e5 moves to GPU 1, which the old llama holds: that group must go first.
    return target(r, (E5, (1,), 1.0), (LLAMA, (2,), 1.0), (LLAMA, (3,), 1.0))


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "state"
    try:
        yield path
    finally:
        for pid in find_tagged(path.resolve()):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


@pytest.fixture
async def proxy(tmp_path: Path) -> AsyncIterator[ProxyHandle]:
    handle = await start_proxy(
        settings_from_mapping(
            {
                "proxy": {"listen": "127.0.0.1:0", "proxy_id": "p", "admin_token": TOKEN},
                "store": {"path": str(tmp_path / "store"), "flush_interval_s": 60.0},
            }
        )
    )
    try:
        yield handle
    finally:
        await handle.stop()


@pytest.fixture
def rollout(state: Path, proxy: ProxyHandle) -> RolloutSettings:
    return rollout_settings(state, [proxy.url])


@pytest.fixture
async def backend(rollout: RolloutSettings) -> AsyncIterator[LocalBackend]:
    b = LocalBackend(rollout, CLUSTER)
    try:
        yield b
    finally:
        await b.close()


def routed(proxy: ProxyHandle) -> set[tuple[str, str]]:
    return {
        (u["model"], u["url"])
        for u in proxy.router.snapshot()["upstreams"]
        if u["state"] != "draining"
    }


def expected_routes(b: LocalBackend, groups: tuple[GroupSpec, ...]) -> set[tuple[str, str]]:
    records = b.state.load()
    return {
        (r.spec.model, proc.url)
        for g in groups
        for r in g.replicas
        if (proc := records[g.id].engine(r.id)) is not None
    }


def check_no_duplicates(b: LocalBackend, groups: tuple[GroupSpec, ...]) -> None:
    """One state file per target group, one live recorded process per replica, and no live
    process tagged with the state folder that no record names."""
    records = b.state.load()
    assert set(records) == {g.id for g in groups}
    recorded = {p.pid for rec in records.values() for p in rec.procs}
    for g in groups:
        engines = [p for p in records[g.id].procs if p.role == "engine"]
        assert sorted(p.name for p in engines) == sorted(r.id for r in g.replicas)
        assert all(alive(p) for p in engines)
    assert set(find_tagged(b.state.path)) == recorded


async def call(session: aiohttp.ClientSession, proxy: ProxyHandle, model: str) -> dict[str, Any]:
    body: dict[str, Any]
    if model == E5:
        path, body = "/v1/embeddings", {"model": E5, "input": "a query"}
    else:
        path = "/v1/chat/completions"
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with session.post(proxy.url + path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        out: dict[str, Any] = await resp.json()
        return out


def test_launches_of_vllm_engines_sharing_a_gpu() -> None:
    r = decode(
        RolloutSettings,
        {
            "models": [
                {"name": LLAMA, "engine": "vllm", "source": "meta-llama/Llama-3.2-1B-Instruct"},
                {"name": E5},
            ]
        },
    )
    group, emulated = target(r, (LLAMA, (1,), 0.5), (LLAMA, (1,), 0.25), (E5, (2, 3), 1.0))
    ports = {rep.id: 9000 + k for k, rep in enumerate((*group.replicas, *emulated.replicas))}
    mps, first, second = launches(group, r, CLUSTER, ports, Path("/s"))
    assert mps.role == "mps" and mps.argv == ("nvidia-cuda-mps-control", "-f")
    assert dict(mps.env)["CUDA_VISIBLE_DEVICES"] == "1"
    env = dict(first.env)
    # Under MPS the daemon remaps GPU 1 to device 0 for its clients.
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == dict(mps.env)["CUDA_MPS_PIPE_DIRECTORY"]
    shares = {dict(x.env)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] for x in (first, second)}
    assert shares == {"25", "50"}
    limits = {dict(x.env)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] for x in (first, second)}
    assert limits == {f"0={round(0.25 * 20 * GB) >> 20}M", f"0={round(0.5 * 20 * GB) >> 20}M"}
    argv = list(first.argv)
    assert argv[:2] == ["vllm", "serve"]
    fraction = float(argv[argv.index("--gpu-memory-utilization") + 1])
    assert fraction in (pytest.approx(5 / 48, abs=1e-3), pytest.approx(10 / 48, abs=1e-3))
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    (engine,) = launches(emulated, r, CLUSTER, ports, Path("/s"))
    assert engine.argv[:3] == (sys.executable, "-m", "sim.cli")
    env = dict(engine.env)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env
    assert engine.argv[engine.argv.index("--tp") + 1] == "2"
    # an emulated engine contends with the others on its GPUs through their boards
    board = engine.argv[engine.argv.index("--gpu-board") + 1]
    assert board == str(Path("/s") / "gpus" / emulated.node)
    assert engine.argv[engine.argv.index("--gpu-ids") + 1] == "2,3"
    assert "--gpu-board" not in first.argv  # a real engine contends on its own


def test_local_settings_errors_name_their_key() -> None:
    with pytest.raises(SettingsError, match=r"^local.last_port: must be at least first_port"):
        decode(RolloutSettings, {"local": {"first_port": 9000, "last_port": 8000}})
    with pytest.raises(SettingsError, match=r"^local.proxies\[0\]: must start with http"):
        decode(RolloutSettings, {"local": {"proxies": ["proxy:8080"]}})


async def test_converge_starts_engines_pushes_routes_and_serves(
    backend: LocalBackend, rollout: RolloutSettings, proxy: ProxyHandle
) -> None:
    groups = before(rollout)
    plan, _ = await converge(backend, groups)
    assert plan.safe
    check_no_duplicates(backend, groups)
    assert routed(proxy) == expected_routes(backend, groups) and len(routed(proxy)) == 3
    async with aiohttp.ClientSession() as s:
        assert len((await call(s, proxy, E5))["data"][0]["embedding"]) > 0
        assert (await call(s, proxy, LLAMA))["choices"][0]["message"]["content"]
    shared = next(g for g in groups if len(g.replicas) == 2)
    rec = backend.state.load()[shared.id]
    first, second = (rec.engine(r.id) for r in shared.replicas)
    assert first is not None and second is not None and first.pid is not None
    environ = read(f"/proc/{first.pid}/environ").split(b"\0")
    assert b"CUDA_VISIBLE_DEVICES=0" in environ
    assert b"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50" in environ
    assert f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={round(0.5 * 20 * GB) >> 20}M".encode() in environ
    # Co-located replicas start one at a time: the second after the first answered /health.
    assert second.started_at - first.started_at > 0.2
    assert b"EMULATED" in read(first.log)
    # Converging again finds everything done: nothing started, nothing pushed.
    pids = {p.pid for r in backend.state.load().values() for p in r.procs}
    version = proxy.router.version
    plan, _ = await converge(backend, groups)
    assert plan.empty and proxy.router.version == version
    assert {p.pid for r in backend.state.load().values() for p in r.procs} == pids


@pytest.mark.slow  # two rollouts: ~6 s
async def test_rollout_is_make_before_break(
    backend: LocalBackend, rollout: RolloutSettings, proxy: ProxyHandle
) -> None:
    await converge(backend, before(rollout))
    old = [p for rec in backend.state.load().values() for p in rec.procs]
    counts: list[dict[str, int]] = []
    done = asyncio.Event()

    async def poll() -> None:
        while not done.is_set():
            table = routed(proxy)
            counts.append({m: sum(1 for mm, _ in table if mm == m) for m in (E5, LLAMA)})
            await asyncio.sleep(0.01)

    steps: list[StepResult] = []
    poller = asyncio.create_task(poll())
    try:
        plan, _ = await converge(backend, after(rollout), on_step=steps.append)
    finally:
        done.set()
        await poller
    assert plan.safe and len(counts) > 20
    assert all(c[E5] >= 1 and c[LLAMA] >= 1 for c in counts), counts
    # Nothing was in flight, so every drain ended as soon as the proxy let the replicas go.
    assert all(s.seconds < rollout.drain_s for s in steps if s.step.kind == "drain")
    assert not any(alive(p) for p in old)
    check_no_duplicates(backend, after(rollout))
    assert routed(proxy) == expected_routes(backend, after(rollout))


def read(path: str) -> bytes:
    return Path(path).read_bytes()


class Killer:
    """An ``on_step`` callback that cancels the rollout task right after a step of ``kind``."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.task: asyncio.Task[Any] | None = None

    def __call__(self, result: StepResult) -> None:
        if result.step.kind == self.kind and not result.skipped and self.task is not None:
            self.task.cancel()


def no_untracked(b: LocalBackend) -> None:
    recorded = {p.pid for rec in b.state.load().values() for p in rec.procs}
    assert set(find_tagged(b.state.path)) == recorded


@pytest.mark.slow  # four daemons, one rollout: ~7 s
async def test_killed_mid_rollout_again_and_again_converges_without_duplicates(
    backend: LocalBackend, rollout: RolloutSettings, proxy: ProxyHandle
) -> None:
    await converge(backend, before(rollout))
    current = backend
    # The daemon dies right after each of these steps; a new one takes over on the same state.
    for kill_after in ("start", "add_route", "drain"):
        killer = Killer(kill_after)
        killer.task = asyncio.create_task(converge(current, after(rollout), on_step=killer))
        with pytest.raises(asyncio.CancelledError):
            await killer.task
        await current.close()
        no_untracked(current)
        current = LocalBackend(rollout, CLUSTER)
    try:
        plan, results = await converge(current, after(rollout))
        assert plan.safe and results
        check_no_duplicates(current, after(rollout))
        assert routed(proxy) == expected_routes(current, after(rollout))
        async with aiohttp.ClientSession() as s:
            await call(s, proxy, E5)
            await call(s, proxy, LLAMA)
    finally:
        await current.close()


async def test_engine_spawned_before_its_pid_was_recorded_is_adopted(
    backend: LocalBackend, rollout: RolloutSettings, proxy: ProxyHandle
) -> None:
    # The daemon wrote the record, spawned the engine and died before writing its pid.
    (group,) = target(rollout, (E5, (0,), 1.0))
    (replica,) = group.replicas
    port = backend._pick_port(set())
    (launch,) = launches(group, rollout, CLUSTER, {replica.id: port}, backend.state.path)
    pending = ProcRecord(
        "engine",
        replica.id,
        E5,
        port,
        f"http://127.0.0.1:{port}",
        "t0k3n",
        str(backend.state.logs / "orphan.log"),
    )
    backend.state.save(GroupRecord(group, (pending,)))
    spawn(launch, pending, backend.state.path)
    plan, _ = await converge(LocalBackend(rollout, CLUSTER), (group,))
    assert [s.kind for s in plan.steps if s.kind == "start"] == []  # adopted, not restarted
    check_no_duplicates(backend, (group,))
    assert routed(proxy) == {(E5, f"http://127.0.0.1:{port}")}


async def test_a_dead_engine_is_forgotten_unrouted_and_restarted_alone(
    backend: LocalBackend, rollout: RolloutSettings, proxy: ProxyHandle
) -> None:
    groups = before(rollout)
    await converge(backend, groups)
    shared = next(g for g in groups if len(g.replicas) == 2)
    rec = backend.state.load()[shared.id]
    victim, survivor = (rec.engine(r.id) for r in reversed(shared.replicas))
    assert victim is not None and victim.pid is not None and survivor is not None
    os.killpg(victim.pid, signal.SIGKILL)
    for _ in range(300):
        if not alive(victim):
            break
        await asyncio.sleep(0.01)
    seen = await backend.observe()
    assert victim.name not in {r.id for r in seen.replicas}
    assert survivor.name in {r.id for r in seen.replicas}
    assert (victim.model, victim.url) not in routed(proxy)
    plan, _ = await converge(backend, groups)
    assert [s.kind for s in plan.steps] == ["start", "wait_ready", "add_route"]
    check_no_duplicates(backend, groups)
    restarted = backend.state.load()[shared.id]
    assert restarted.engine(survivor.name) == survivor  # the co-located replica was left alone
    assert routed(proxy) == expected_routes(backend, groups)


async def test_a_proxy_that_is_down_is_reported_not_fatal(state: Path, proxy: ProxyHandle) -> None:
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    rollout = rollout_settings(state, [dead, proxy.url], push_attempts=2)
    b = LocalBackend(rollout, CLUSTER)
    try:
        groups = target(rollout, (E5, (0,), 1.0))
        await converge(b, groups)
        assert routed(proxy) == expected_routes(b, groups)
        assert set(b.proxies.errors) == {dead}
        await b.stop(groups[0].id)
        check_no_duplicates(b, ())
    finally:
        await b.close()


async def test_a_wrong_admin_token_is_an_error(state: Path, proxy: ProxyHandle) -> None:
    rollout = rollout_settings(state, [proxy.url], admin_token="wrong")
    b = LocalBackend(rollout, CLUSTER)
    try:
        with pytest.raises(RolloutError, match="401"):
            await b.observe()
    finally:
        await b.close()


async def test_the_admin_token_defaults_to_the_proxy_section(
    state: Path, proxy: ProxyHandle
) -> None:
    settings = settings_from_mapping(
        {
            "proxy": {"admin_token": TOKEN},
            "rollout": {"local": {"state_dir": str(state), "proxies": [proxy.url]}},
        }
    )
    b = LocalBackend.from_settings(settings, CLUSTER)
    try:
        await b.push_routes([Route(E5, "http://127.0.0.1:9")])
        assert routed(proxy) == {(E5, "http://127.0.0.1:9")} and not b.proxies.errors
        assert (await b.observe()).routes == (Route(E5, "http://127.0.0.1:9"),)
    finally:
        await b.close()


async def test_a_drain_lasts_until_the_calls_in_flight_finish(
    state: Path, proxy: ProxyHandle
) -> None:
    rollout = rollout_settings(state, [proxy.url], speedup=1.0, drain_s=20.0)
    b = LocalBackend(rollout, CLUSTER)
    try:
        groups = target(rollout, (LLAMA, (0,), 1.0))
        await converge(b, groups)
        (replica,) = (await b.observe()).replicas
        body = {
            "model": LLAMA,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 120,
            "ignore_eos": True,
        }  # about a second at real speed
        async with aiohttp.ClientSession() as s:

            async def long_call() -> int:
                async with s.post(proxy.url + "/v1/chat/completions", json=body) as resp:
                    await resp.read()
                    return resp.status

            task = asyncio.create_task(long_call())
            for _ in range(500):
                if any(u["in_flight"] for u in proxy.router.snapshot()["upstreams"]):
                    break
                await asyncio.sleep(0.01)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await b.push_routes([])
            await b.wait_drained([replica])
            waited = loop.time() - t0
            assert not proxy.router.snapshot()["upstreams"]
            assert await task == 200
        assert 0.2 < waited < rollout.drain_s
        await b.stop(groups[0].id)
        check_no_duplicates(b, ())
    finally:
        await b.close()


class PortThief(LocalBackend):
    """Picks, once, a port another process already holds (as if it took it after the pick)."""

    def __init__(self, *args: Any, busy: int, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.busy: int | None = busy

    def _pick_port(self, taken: set[int]) -> int:
        port, self.busy = self.busy, None
        return port if port is not None else super()._pick_port(taken)


async def test_an_engine_that_lost_its_port_is_relaunched_on_another(
    rollout: RolloutSettings, proxy: ProxyHandle
) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        b = PortThief(rollout, CLUSTER, busy=busy)
        try:
            groups = target(rollout, (E5, (0,), 1.0))
            await converge(b, groups)
            (proc,) = b.state.load()[groups[0].id].procs
            assert proc.port != busy and b"address already in use" in read(proc.log).lower()
            assert routed(proxy) == {(E5, proc.url)}
        finally:
            await b.close()


async def test_an_engine_that_fails_to_start_is_reported_with_its_log(state: Path) -> None:
    rollout = decode(
        RolloutSettings,
        {
            "models": [{"name": "bogus", "source": "no-such-model"}],
            "local": {"state_dir": str(state), "ready_timeout_s": 30.0, "poll_interval_s": 0.05},
        },
    )
    b = LocalBackend(rollout, CLUSTER)
    try:
        (group,) = target(rollout, ("bogus", (0,), 1.0))
        with pytest.raises(RolloutError, match=r"exited before it was ready.*invalid choice"):
            await converge(b, (group,))
        assert (await b.observe()).replicas == ()  # forgotten, nothing left running
        check_no_duplicates(b, ())
    finally:
        await b.close()

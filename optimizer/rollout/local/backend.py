"""The local rollout backend: engine processes on this machine, routes pushed to the proxies.

Role: implements :class:`optimizer.rollout.backend.Backend` (DESIGN §3.7 ``local``). A GPU group is a
set of processes (:mod:`optimizer.rollout.local.engines`: an MPS control daemon where real engines share
GPUs, one engine per replica, the emulator by default) recorded in the state folder; routes go
to every proxy's admin API (:mod:`optimizer.rollout.local.proxies`).

Invariants:
- engines outlive the daemon (own session) and a new backend on the same state folder adopts
  them: :meth:`observe` reports every recorded live engine (ready when ``/health`` answers 200),
  forgets dead ones (their records, their routes) and never starts anything; :meth:`start`
  launches only the replicas without a live process, so a rollout interrupted anywhere and
  planned again starts no duplicate;
- replicas sharing a GPU are launched one at a time, each once the previous one is healthy
  (vLLM sizes its KV cache from the memory free at start: calibration.md);
- a replica's URL is ``http://<local.host>:<port>``, the port picked free (in
  ``local.first_port..last_port`` when set) and never one another record holds;
- :meth:`stop` returns once the group's process groups are gone (SIGTERM, SIGKILL after
  ``local.stop_grace_s``), so the GPUs are free for the next group;
- a drain ends when no proxy lists the replicas any more (their in-flight calls finished) or
  after ``rollout.drain_s``, whichever comes first.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace

import aiohttp

from optimizer.plan.observed import Observed, Route, RunningReplica
from optimizer.plan.target import GroupSpec
from optimizer.rollout.backend import RolloutError
from optimizer.rollout.local.engines import (
    GroupRecord,
    Launch,
    ProcRecord,
    StateDir,
    alive,
    find_tagged,
    launches,
    log_tail,
    mps_dirs,
    new_token,
    spawn,
    start_time,
    terminate,
)
from optimizer.rollout.local.proxies import ProxyAdmin, common_routes
from shared.cluster import Cluster
from shared.rollout_settings import RolloutSettings
from shared.settings import Settings

__all__ = ["LocalBackend"]

log = logging.getLogger(__name__)

_RELAUNCHES = 3  # per wait, for engines that lost their port before binding it


class LocalBackend:
    """:class:`optimizer.rollout.backend.Backend` over processes on this machine."""

    def __init__(
        self,
        rollout: RolloutSettings,
        cluster: Cluster,
        *,
        admin_token: str | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rollout = rollout
        self.local = rollout.local
        self.cluster = cluster
        self.state = StateDir(self.local)
        self.proxies = ProxyAdmin(
            self.local.proxies,
            self.local.admin_token or admin_token,
            timeout_s=self.local.request_timeout_s,
            attempts=self.local.push_attempts,
            sleep=sleep,
        )
        self._sleep = sleep
        self._clock = clock
        self._http: aiohttp.ClientSession | None = None

    @classmethod
    def from_settings(cls, settings: Settings, cluster: Cluster) -> LocalBackend:
        """The backend of a settings file; the admin token defaults to ``proxy.admin_token``."""
        return cls(settings.rollout, cluster, admin_token=settings.proxy.admin_token)

    async def close(self) -> None:
        """Close HTTP sessions; engines keep running."""
        if self._http is not None:
            await self._http.close()
        await self.proxies.close()

    # --- observing ---------------------------------------------------------------------
    def _session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.local.request_timeout_s)
            )
        return self._http

    async def _healthy(self, url: str) -> bool:
        try:
            async with self._session().get(f"{url}/health") as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    def _settle(self, rec: GroupRecord) -> tuple[GroupRecord | None, list[ProcRecord]]:
        """The record with its dead processes dropped (``None`` once no engine lives), and the
        dead engines; a record without pid gets the pid of the process tagged with its token."""
        procs: list[ProcRecord] = []
        dead: list[ProcRecord] = []
        for p in rec.procs:
            if p.pid is None:  # spawned (or not) by a daemon killed before it wrote the pid
                found = find_tagged(self.state.path, p.token)
                if found:
                    pid = next(iter(found))
                    p = replace(p, pid=pid, pid_start=start_time(pid))
            (procs if alive(p) else dead).append(p)
        if procs != list(rec.procs):
            if not any(p.role == "engine" for p in procs):
                return None, [p for p in dead if p.role == "engine"]
            rec = GroupRecord(rec.group, tuple(procs), rec.created_at)
            self.state.save(rec)
        return rec, [p for p in dead if p.role == "engine"]

    async def observe(self) -> Observed:
        records = self.state.load()
        live: list[tuple[GroupRecord, ProcRecord]] = []
        dead_urls: set[str] = set()
        for rec in records.values():
            settled, dead = self._settle(rec)
            dead_urls |= {p.url for p in dead}
            if settled is None:
                await self._forget(rec)
                continue
            live += [(settled, p) for p in settled.procs if p.role == "engine"]
        ready = await asyncio.gather(*(self._healthy(p.url) for _, p in live))
        replicas = []
        for (rec, p), ok in zip(live, ready, strict=True):
            r = next(r for r in rec.group.replicas if r.id == p.name)
            replicas.append(
                RunningReplica(
                    r.id,
                    rec.group.id,
                    r.spec.model,
                    rec.group.node,
                    r.spec.gpus,
                    r.spec.share,
                    r.spec.tp,
                    p.url,
                    ok,
                    r.spec.memory_bytes_per_gpu,
                    r.spec.revision,
                    p.started_at or None,
                )
            )
        tables = await self.proxies.tables()
        routes = common_routes(tables, self.state.load_routes())
        if dead_urls:
            # A dead engine's route can only fail calls; the plan restarts what the target needs.
            kept = tuple(r for r in routes if r.url not in dead_urls)
            if kept != routes or any(
                u["url"] in dead_urls for t in tables.values() if t for u in t
            ):
                log.warning(
                    "engines gone: %s; their routes are removed", ", ".join(sorted(dead_urls))
                )
                await self.push_routes(kept)
            routes = kept
        return Observed(tuple(sorted(replicas, key=lambda r: r.id)), routes)

    # --- starting ----------------------------------------------------------------------
    def _check_node(self, group: GroupSpec) -> None:
        node = self.local.node
        if node is not None and group.node != node:
            raise RolloutError(
                f"group {group.id} is placed on node {group.node}, and this "
                f"machine is {node} (rollout.local.node)"
            )
        real = any(self.rollout.model(r.spec.model).engine != "emulator" for r in group.replicas)
        if node is None and real and len(self.cluster.nodes) > 1:
            raise RolloutError(
                "real engines on a multi-node cluster need rollout.local.node "
                "(which node this machine is)"
            )

    def _taken_ports(self) -> set[int]:
        return {p.port for rec in self.state.load().values() for p in rec.procs if p.port}

    def _pick_port(self, taken: set[int]) -> int:
        first, last = self.local.first_port, self.local.last_port
        candidates = range(first, last + 1) if first else [0] * 20
        for port in candidates:
            if port and port in taken:
                continue
            with socket.socket() as s:
                try:
                    s.bind((self.local.host, port))
                except OSError:
                    continue
                chosen: int = s.getsockname()[1]
            if chosen not in taken:
                taken.add(chosen)
                return chosen
        raise RolloutError(f"no free port in {first}-{last} on {self.local.host}")

    def _url(self, port: int) -> str:
        host = self.local.host
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def _launch(self, rec: GroupRecord, launch: Launch) -> GroupRecord:
        url = self._url(launch.port) if launch.role == "engine" else ""
        stem = f"{rec.group.id}-{launch.name}" if launch.role == "mps" else launch.name
        pending = ProcRecord(
            launch.role,
            launch.name,
            launch.model,
            launch.port,
            url,
            new_token(),
            str(self.state.logs / f"{stem}.log"),
        )
        rec = rec.with_proc(pending)
        self.state.save(rec)  # before the spawn: a crash in between leaves a findable record
        try:
            started = spawn(launch, pending, self.state.path)
        except OSError as exc:
            self.state.save(
                GroupRecord(
                    rec.group, tuple(p for p in rec.procs if p is not pending), rec.created_at
                )
            )
            raise RolloutError(f"group {rec.group.id}: {exc}") from exc
        rec = rec.with_proc(started)
        self.state.save(rec)
        return rec

    async def start(self, group: GroupSpec) -> None:
        """Launch the replicas without a live process. Returns once all are launched; a replica
        sharing a GPU with an earlier one is launched after that one is healthy."""
        self._check_node(group)
        existing = self.state.get(group.id)
        rec = self._settle(existing)[0] if existing is not None else None
        if rec is None:
            if existing is not None:  # every engine died; a lone MPS daemon goes too
                await terminate(
                    [p for p in existing.procs if p.role == "mps"],
                    self.local.stop_grace_s,
                    self._sleep,
                    self._clock,
                )
            rec = GroupRecord(group, (), time.time())
        missing = {r.id for r in group.replicas if (p := rec.engine(r.id)) is None or not alive(p)}
        if not missing:
            return
        taken = self._taken_ports()
        ports = {
            r.id: p.port
            if r.id not in missing and (p := rec.engine(r.id))
            else self._pick_port(taken)
            for r in group.replicas
        }
        plan = launches(group, self.rollout, self.cluster, ports, self.state.path)
        for launch in plan:
            if launch.role == "mps":
                old = rec.mps()
                if old is None or not alive(old):
                    for d in mps_dirs(self.state.path, group.id):
                        d.mkdir(parents=True, exist_ok=True)
                    rec = self._launch(rec, launch)
                    await self._wait_mps(rec)
                continue
            if launch.name not in missing:
                continue
            k = next(k for k, r in enumerate(group.replicas) if r.id == launch.name)
            gpus = set(group.replicas[k].spec.gpus)
            before = [r.id for r in group.replicas[:k] if not gpus.isdisjoint(r.spec.gpus)]
            if before:
                await self._wait_engines(group, before)
            rec = self._launch(rec, launch)

    async def _wait_mps(self, rec: GroupRecord) -> None:
        pipe, _ = mps_dirs(self.state.path, rec.group.id)
        daemon = rec.mps()
        deadline = self._clock() + self.local.ready_timeout_s
        while not (pipe / "control").exists():
            if daemon is None or not alive(daemon):
                raise RolloutError(
                    f"group {rec.group.id}: the MPS control daemon exited: "
                    f"{log_tail(daemon.log) if daemon else ''}"
                )
            if self._clock() >= deadline:
                raise RolloutError(
                    f"group {rec.group.id}: no MPS control pipe after "
                    f"{self.local.ready_timeout_s:g} s"
                )
            await self._sleep(self.local.poll_interval_s)

    def _relaunch(self, group: GroupSpec, replica_id: str) -> None:
        """Launch one replica again on a fresh port (another process took the one picked)."""
        rec = self.state.get(group.id)
        assert rec is not None
        ports = {r.id: p.port if (p := rec.engine(r.id)) else 0 for r in group.replicas}
        ports[replica_id] = self._pick_port(self._taken_ports())
        launch = next(
            x
            for x in launches(group, self.rollout, self.cluster, ports, self.state.path)
            if x.role == "engine" and x.name == replica_id
        )
        log.warning(
            "replica %s lost its port to another process; relaunched on port %d",
            replica_id,
            launch.port,
        )
        self._launch(rec, launch)

    async def _wait_engines(self, group: GroupSpec, ids: Sequence[str]) -> None:
        deadline = self._clock() + self.local.ready_timeout_s
        relaunches = 0
        while True:
            rec = self.state.get(group.id)
            procs = [rec.engine(rid) if rec else None for rid in ids]
            relaunched = False
            for rid, p in zip(ids, procs, strict=True):
                if p is None:
                    raise RolloutError(f"replica {rid} of group {group.id} was not started")
                if alive(p):
                    continue
                tail = log_tail(p.log)
                # The port was free when picked; another process may bind it before the engine.
                if "address already in use" in tail.lower() and relaunches < _RELAUNCHES:
                    relaunches += 1
                    self._relaunch(group, rid)
                    relaunched = True
                    continue
                raise RolloutError(
                    f"replica {rid} ({p.model}) exited before it was ready; log {p.log}: {tail}"
                )
            if relaunched:
                continue
            health = await asyncio.gather(*(self._healthy(p.url) for p in procs if p))
            if all(health):
                return
            if self._clock() >= deadline:
                slow = [rid for rid, ok in zip(ids, health, strict=True) if not ok]
                raise RolloutError(
                    f"group {group.id}: {', '.join(slow)} not healthy after "
                    f"{self.local.ready_timeout_s:g} s"
                )
            await self._sleep(self.local.poll_interval_s)

    async def wait_ready(self, group: GroupSpec) -> None:
        await self._wait_engines(group, [r.id for r in group.replicas])

    # --- routes and draining -----------------------------------------------------------
    async def push_routes(self, routes: Sequence[Route]) -> None:
        """Record the table, then give it to every proxy (one that is down is reported in
        ``self.proxies.errors`` and gets it at the next push)."""
        self.state.save_routes([r.as_json() for r in routes])
        await self.proxies.push(routes)

    async def wait_drained(self, replicas: Sequence[RunningReplica]) -> None:
        urls = {r.url for r in replicas}
        if not urls:
            return
        deadline = self._clock() + self.rollout.drain_s
        while self._clock() < deadline:
            tables = await self.proxies.tables()
            if not any(u["url"] in urls for t in tables.values() if t for u in t):
                return
            await self._sleep(self.local.poll_interval_s)
        log.info(
            "drain of %s ended after %g s with calls possibly in flight",
            ", ".join(sorted(urls)),
            self.rollout.drain_s,
        )

    # --- stopping ----------------------------------------------------------------------
    async def stop(self, group_id: str) -> None:
        rec = self.state.get(group_id)
        if rec is None:
            return
        grace = self.local.stop_grace_s
        await terminate(
            [p for p in rec.procs if p.role == "engine"], grace, self._sleep, self._clock
        )
        await self._forget(rec)

    async def _forget(self, rec: GroupRecord) -> None:
        """Stop the group's MPS daemon (its clients are gone) and drop its record and pipes."""
        await terminate(
            [p for p in rec.procs if p.role == "mps"],
            self.local.stop_grace_s,
            self._sleep,
            self._clock,
        )
        shutil.rmtree(mps_dirs(self.state.path, rec.group.id)[0].parent, ignore_errors=True)
        self.state.remove(rec.group.id)

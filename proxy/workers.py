"""Several proxy processes on one address: the supervisor, and each worker's life.

Role: ``scepsy-proxy`` with ``proxy.workers`` > 1 runs :func:`run_workers`: a supervisor
process that reserves the listen address, starts the workers (``multiprocessing`` spawn: a
fresh interpreter each, no inherited event loop), relays their requests to one another, and
restarts a worker that dies. Each worker (``proxy.cli.worker_main``) serves the whole app on the same
address with ``SO_REUSEPORT`` (the kernel spreads connections over them), records into its own
segment folder (``<proxy_id>-w<i>``), and talks to the supervisor through
:class:`proxy.siblings.Siblings`.

Invariants:
- one route table for all: a change accepted by any worker is installed by the supervisor in
  every running worker, one change at a time and in one order, before the PUT is answered; a
  worker started later (a restart) starts with the latest table;
- ``/metrics`` on any worker is the sum of every worker's (gathered one scrape at a time, so
  two large expositions never cross in the pipes);
- SIGTERM/SIGINT on the supervisor stops every worker gracefully (each drains its in-flight
  calls for ``proxy.shutdown_grace_s`` and flushes its records) and waits for them; a worker
  whose supervisor disappears, even by ``kill -9``, shuts itself down the same way;
- the address stays reserved by the supervisor (a bound, never listening ``SO_REUSEPORT``
  socket) for its whole life, so port 0 names one port for all workers and restarts;
- a worker that dies before it is ready fails the start (exit 1, its error on stderr); one that
  dies later is restarted after :data:`RESTART_DELAY_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from proxy.metrics import merge_expositions
from shared.settings import Settings, UpstreamSettings, parse_host_port
from shared.settings_schema import document

log = logging.getLogger("scepsy.proxy.workers")
# a worker's life: (settings document, index, reserved port, its pipe end, (log level, format))
WorkerMain = Callable[[dict[str, Any], int, int, Connection, tuple[str, str]], None]
READY_S = 60.0  # longest a worker may take to start serving
RESTART_DELAY_S = 1.0
ANSWER_S = 5.0  # longest the supervisor waits for one worker's answer


def reserve(host: str, port: int) -> socket.socket:
    """A bound, never listening ``SO_REUSEPORT`` socket holding ``host:port`` (0: any) for the
    workers. The address is first bound without ``SO_REUSEPORT``, so an address another
    process holds fails here (``OSError``), even one whose holder also set ``SO_REUSEPORT``
    (a second proxy on the same port would otherwise silently take half the connections)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
        port = probe.getsockname()[1]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


# --- the supervisor ----------------------------------------------------------------------
@dataclass(eq=False)
class _Worker:
    index: int
    process: BaseProcess
    conn: Connection
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    answers: dict[int, asyncio.Future[Any]] = field(default_factory=dict)
    alive: bool = True


class Supervisor:
    """Starts, relays for, restarts and stops the workers (see the module docstring)."""

    def __init__(
        self, settings: Settings, count: int, target: WorkerMain, log_setup: tuple[str, str]
    ) -> None:
        self._target = target
        self._doc = document(settings)
        self._base_id = settings.proxy.resolved_proxy_id
        self._upstreams = settings.proxy.upstreams
        self._count = count
        self._log_setup = log_setup
        self._grace_s = settings.proxy.shutdown_grace_s
        self._ctx = multiprocessing.get_context("spawn")
        self._workers: dict[int, _Worker] = {}
        self._ids = itertools.count(1)
        self._routes_lock = asyncio.Lock()
        self._metrics_lock = asyncio.Lock()
        self._stopping = False
        self._died = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    # --- lifecycle -------------------------------------------------------------------------
    async def run(self, host: str, port: int, stop: asyncio.Event) -> int:
        with reserve(host, port) as held:
            self.port = held.getsockname()[1]
            for i in range(self._count):
                self._start(i)
            if not await self._all_ready():
                await self._stop_all()
                return 1
            print(
                f"scepsy-proxy listening on http://{host}:{self.port} "
                f"({self._count} workers, store {self._doc['store']['path']})",
                flush=True,
            )
            while not stop.is_set():
                waits = [
                    asyncio.ensure_future(stop.wait()),
                    asyncio.ensure_future(self._died.wait()),
                ]
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for w in waits:
                    w.cancel()
                if stop.is_set():
                    break
                self._died.clear()
                await asyncio.sleep(RESTART_DELAY_S)
                async with self._routes_lock:  # a restart starts with the latest table
                    for i, worker in list(self._workers.items()):
                        if not worker.alive and not stop.is_set():
                            log.error(
                                "worker %d exited (code %s); restarting it",
                                i,
                                worker.process.exitcode,
                            )
                            self._start(i)
            await self._stop_all()
        return 0

    def _start(self, index: int) -> None:
        doc = {**self._doc, "proxy": dict(self._doc["proxy"])}
        doc["proxy"]["proxy_id"] = f"{self._base_id}-w{index}"
        doc["proxy"]["upstreams"] = document(self._upstreams)
        mine, theirs = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=self._target,
            args=(doc, index, self.port, theirs, self._log_setup),
            name=f"scepsy-proxy-w{index}",
            daemon=False,
        )
        process.start()
        theirs.close()  # our copy: the worker's death then reads as EOF here
        worker = _Worker(index, process, mine)
        self._workers[index] = worker
        asyncio.get_running_loop().add_reader(mine.fileno(), self._readable, worker)

    async def _all_ready(self) -> bool:
        waits = {i: asyncio.ensure_future(w.ready.wait()) for i, w in self._workers.items()}
        deadline = asyncio.get_running_loop().time() + READY_S
        while True:
            if all(t.done() for t in waits.values()):
                return True
            if any(not w.alive for w in self._workers.values()):
                failed = [i for i, w in self._workers.items() if not w.alive]
                print(f"scepsy-proxy: worker {failed[0]} failed to start", file=sys.stderr)
                break
            if asyncio.get_running_loop().time() > deadline:
                print("scepsy-proxy: workers did not start in time", file=sys.stderr)
                break
            await asyncio.sleep(0.05)
        for t in waits.values():
            t.cancel()
        return False

    async def _stop_all(self) -> None:
        self._stopping = True
        for worker in self._workers.values():
            if worker.alive:
                with contextlib.suppress(OSError, ValueError):
                    worker.conn.send(("stop", 0))
        limit = self._grace_s + 15.0
        loop = asyncio.get_running_loop()
        for worker in self._workers.values():
            await loop.run_in_executor(None, worker.process.join, limit)
            if worker.process.is_alive():
                log.error("worker %d did not stop in %.0f s; killing it", worker.index, limit)
                worker.process.kill()
                await loop.run_in_executor(None, worker.process.join, 5.0)
        for task in list(self._tasks):
            task.cancel()

    # --- messages --------------------------------------------------------------------------
    def _readable(self, worker: _Worker) -> None:
        try:
            while worker.conn.poll():
                self._on_message(worker, worker.conn.recv())
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(worker.conn.fileno())
            worker.conn.close()
            worker.alive = False
            for fut in worker.answers.values():
                if not fut.done():
                    fut.cancel()
            if not self._stopping:
                self._died.set()

    def _on_message(self, worker: _Worker, message: tuple[Any, ...]) -> None:
        kind, rid, *payload = message
        if kind == "ready":
            worker.ready.set()
        elif kind in ("installed", "exposed", "snapshot"):
            fut = worker.answers.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result(payload[0] if payload else None)
        elif kind == "routes":
            self._spawn(self._swap_routes(worker, rid, payload[0]))
        elif kind == "metrics":
            self._spawn(self._gather_metrics(worker, rid))
        elif kind == "routes_view":
            self._spawn(self._gather_routes(worker, rid))
        else:
            log.warning("unknown message from worker %d: %r", worker.index, kind)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _ask_all(self, kind: str, *payload: Any) -> list[Any]:
        """Send ``kind`` to every running worker; their answers (``None`` for one that did
        not answer in :data:`ANSWER_S`), in worker order."""
        loop = asyncio.get_running_loop()
        waits = []
        for worker in self._workers.values():
            if not worker.alive:
                continue
            rid = next(self._ids)
            fut: asyncio.Future[Any] = loop.create_future()
            worker.answers[rid] = fut
            try:
                worker.conn.send((kind, rid, *payload))
            except (OSError, ValueError):
                worker.answers.pop(rid, None)
                continue
            waits.append(fut)
        done = await asyncio.gather(
            *(asyncio.wait_for(f, ANSWER_S) for f in waits), return_exceptions=True
        )
        return [None if isinstance(d, BaseException) else d for d in done]

    def _reply(self, worker: _Worker, rid: int, value: Any) -> None:
        if worker.alive:
            with contextlib.suppress(OSError, ValueError):
                worker.conn.send(("reply", rid, value))

    async def _swap_routes(
        self, origin: _Worker, rid: int, upstreams: tuple[UpstreamSettings, ...]
    ) -> None:
        async with self._routes_lock:
            self._upstreams = upstreams
            await self._ask_all("install", upstreams)
        self._reply(origin, rid, None)

    async def _gather_metrics(self, origin: _Worker, rid: int) -> None:
        async with self._metrics_lock:
            pages = [p for p in await self._ask_all("expose") if isinstance(p, bytes)]
            self._reply(origin, rid, merge_expositions(pages))

    async def _gather_routes(self, origin: _Worker, rid: int) -> None:
        views = [v for v in await self._ask_all("snapshot") if isinstance(v, dict)]
        self._reply(origin, rid, merge_snapshots(views))


def merge_snapshots(views: list[dict[str, Any]]) -> dict[str, Any]:
    """Workers' ``Router.snapshot()``s as one: the first worker's table (all hold the same
    one, or the newest version's when a change is being installed), with every worker's
    in-flight and served calls per replica summed."""
    if not views:
        return {"version": 0, "upstreams": []}
    newest = max(views, key=lambda v: int(v["version"]))
    merged = [dict(u) for u in newest["upstreams"]]
    index = {(u["model"], u["url"], u["state"] == "draining"): u for u in merged}
    for view in views:
        if view is newest:
            continue
        for u in view["upstreams"]:
            mine = index.get((u["model"], u["url"], u["state"] == "draining"))
            if mine is not None:
                mine["in_flight"] += u["in_flight"]
                mine["served"] += u["served"]
    return {"version": newest["version"], "upstreams": merged}


def run_workers(
    settings: Settings, count: int, target: WorkerMain, log_setup: tuple[str, str]
) -> int:
    """Serve with ``count`` worker processes running ``target`` (``proxy.cli.worker_main``)
    until SIGTERM or SIGINT; the exit status."""
    host, port = parse_host_port(settings.proxy.listen, "proxy.listen")

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await Supervisor(settings, count, target, log_setup).run(host, port, stop)

    return asyncio.run(main())

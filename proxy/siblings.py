"""A worker's line to its supervisor: route changes that reach every worker, and one /metrics.

Role: with ``proxy.workers`` > 1 (:mod:`proxy.workers`) several processes accept on one
address, each with its own router, recorder and registry. A worker holds one
:class:`Siblings` (app key :data:`proxy.keys.SIBLINGS`) over a duplex pipe to the supervisor:
- ``PUT /admin/routes`` validates the table, then :meth:`Siblings.swap_routes` asks the
  supervisor to install it in every worker, in one order for all, and returns once all have;
- ``GET /metrics`` answers :meth:`Siblings.metrics`: the supervisor collects every worker's
  exposition and sums it (:func:`proxy.metrics.merge_expositions`); ``GET /admin/routes``
  answers :meth:`Siblings.routes`, every worker's table with its calls summed;
- the supervisor's own requests (install this table, show your exposition, stop) are answered
  from the event loop by :meth:`Siblings._on_message`.

Invariants:
- messages are pickled tuples ``(kind, id, *payload)``; replies carry the request's id, so
  concurrent requests from one worker never mix;
- a request the supervisor does not answer within :data:`REPLY_S` fails with
  :class:`SiblingsDown` (the handler answers 503), and its waiter is forgotten;
- the pipe closing (the supervisor died, even by ``kill -9``) sets :attr:`Siblings.parent_gone`:
  the worker shuts down gracefully (drains, flushes) instead of serving on, orphaned.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from shared.settings import UpstreamSettings

log = logging.getLogger("scepsy.proxy.siblings")
REPLY_S = 10.0  # longest a worker waits for the supervisor's answer


class SiblingsDown(RuntimeError):
    """The supervisor did not answer (it is gone, or stuck)."""


class Siblings:
    def __init__(
        self,
        conn: Connection,
        install: Callable[[tuple[UpstreamSettings, ...]], None],
        expose: Callable[[], bytes],
        snapshot: Callable[[], dict[str, Any]],
    ) -> None:
        self._conn = conn
        self._install = install
        self._expose = expose
        self._snapshot = snapshot
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self.parent_gone = asyncio.Event()
        self.stop_asked = asyncio.Event()

    def start(self) -> None:
        asyncio.get_running_loop().add_reader(self._conn.fileno(), self._readable)

    def close(self) -> None:
        if not self._conn.closed:
            asyncio.get_running_loop().remove_reader(self._conn.fileno())
        for fut in self._waiting.values():
            fut.cancel()
        self._waiting.clear()

    def send(self, *message: Any) -> None:
        try:
            self._conn.send(message)
        except (OSError, ValueError):  # the supervisor is gone: its reader sees the close
            self._gone()

    async def _request(self, kind: str, *payload: Any) -> Any:
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        try:
            self.send(kind, rid, *payload)
            return await asyncio.wait_for(fut, REPLY_S)
        except TimeoutError:
            raise SiblingsDown("the proxy's supervisor did not answer in time") from None
        finally:
            self._waiting.pop(rid, None)

    async def swap_routes(self, upstreams: tuple[UpstreamSettings, ...]) -> None:
        """Install ``upstreams`` in every worker (this one included); returns once all have."""
        await self._request("routes", upstreams)

    async def metrics(self) -> bytes:
        """Every worker's /metrics, summed."""
        body = await self._request("metrics")
        assert isinstance(body, bytes)
        return body

    async def routes(self) -> dict[str, Any]:
        """The route table with every worker's in-flight and served calls summed."""
        view = await self._request("routes_view")
        assert isinstance(view, dict)
        return view

    def _gone(self) -> None:
        if not self.parent_gone.is_set():
            log.warning("the proxy's supervisor is gone: this worker shuts down")
            self.parent_gone.set()
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(SiblingsDown("the proxy's supervisor is gone"))

    def _readable(self) -> None:
        try:
            while self._conn.poll():
                self._on_message(self._conn.recv())
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(self._conn.fileno())
            self._gone()

    def _on_message(self, message: tuple[Any, ...]) -> None:
        kind, rid, *payload = message
        if kind == "install":
            self._install(payload[0])
            self.send("installed", rid)
        elif kind == "expose":
            self.send("exposed", rid, self._expose())
        elif kind == "snapshot":
            self.send("snapshot", rid, self._snapshot())
        elif kind == "stop":
            self.stop_asked.set()
        elif kind == "reply":
            fut = self._waiting.get(rid)
            if fut is not None and not fut.done():
                fut.set_result(payload[0])
        else:  # a newer supervisor's message this worker does not know: say so, go on
            log.warning("unknown message from the supervisor: %r", kind)

"""The proxies' admin API as the local backend uses it: read every route table, push one to all.

Role: a small client of ``GET/PUT /admin/routes`` (:mod:`proxy.admin`) over a set of proxies,
and :func:`common_routes`, the pure rule that turns the proxies' tables into the one route
table a plan starts from.

Invariants:
- every proxy is told (concurrently); a proxy that cannot be reached (connection refused,
  timeout, 5xx, 408/429) after ``push_attempts`` tries is *reported* in
  :attr:`ProxyAdmin.errors`, not fatal: it learns the table at the next push, and a plan made
  while it was down re-adds what it lacks;
- a proxy that refuses the table itself (401 wrong token, 400 bad table, 404 admin API off) is a
  configuration error and raises :class:`~optimizer.rollout.backend.RolloutError`;
- a route counts as present only where every reachable proxy has it active (not draining), so a
  proxy that restarted with its settings file's table makes the missing routes look unrouted and
  the next plan pushes them again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import aiohttp
import orjson

from optimizer.plan.observed import Route
from optimizer.rollout.backend import RolloutError

__all__ = ["ProxyAdmin", "Table", "common_routes"]

log = logging.getLogger(__name__)

Table = list[dict[str, Any]]  # GET /admin/routes "upstreams": model, url, state, in_flight, ...

_TRANSIENT = {408, 429}


class _Unreachable(Exception):
    pass


def common_routes(
    tables: Mapping[str, Table | None], recorded: Sequence[Mapping[str, Any]]
) -> tuple[Route, ...]:
    """The routes active at every reachable proxy (all of ``recorded`` if none answered);
    ``api_key`` values, which proxies never echo, come from ``recorded``."""
    keys = {(r["model"], r["url"]): r.get("api_key") for r in recorded}
    answered = [t for t in tables.values() if t is not None]
    if not answered:
        present = set(keys)
    else:
        sets = [
            {(u["model"], u["url"]) for u in t if u.get("state") != "draining"} for t in answered
        ]
        present = set.intersection(*sets)
    return tuple(Route(m, u, keys.get((m, u))) for m, u in sorted(present))


class ProxyAdmin:
    """Admin API client over ``urls`` (proxy base URLs)."""

    def __init__(
        self,
        urls: Sequence[str],
        token: str | None,
        *,
        timeout_s: float,
        attempts: int,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.urls = tuple(u.rstrip("/") for u in urls)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._attempts = attempts
        self._sleep = sleep
        self._session: aiohttp.ClientSession | None = None
        self.errors: dict[str, str] = {}  # proxy url -> why the last call to it failed

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _call(self, method: str, url: str, body: bytes | None = None) -> Table:
        try:
            async with self.session().request(
                method,
                f"{url}/admin/routes",
                data=body,
                headers={**self._headers, "Content-Type": "application/json"},
            ) as resp:
                data = await resp.read()
                if resp.status >= 500 or resp.status in _TRANSIENT:
                    raise _Unreachable(f"{resp.status} {data[:200].decode(errors='replace')}")
                if resp.status != 200:
                    raise RolloutError(
                        f"proxy {url} refused {method} /admin/routes: "
                        f"{resp.status} {data[:300].decode(errors='replace')}"
                    )
                table: Table = orjson.loads(data)["upstreams"]
                return table
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise _Unreachable(f"{type(exc).__name__}: {exc}") from exc
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            raise _Unreachable(f"bad answer: {exc}") from exc

    async def _one(self, method: str, url: str, body: bytes | None, attempts: int) -> Table | None:
        for attempt in range(attempts):
            try:
                table = await self._call(method, url, body)
            except _Unreachable as exc:
                if attempt + 1 < attempts:
                    await self._sleep(0.2 * 2**attempt)
                    continue
                if self.errors.get(url) != str(exc):
                    log.warning("proxy %s: %s /admin/routes failed: %s", url, method, exc)
                self.errors[url] = str(exc)
                return None
            self.errors.pop(url, None)
            return table
        return None  # pragma: no cover (attempts >= 1)

    async def tables(self) -> dict[str, Table | None]:
        """Each proxy's table (``None`` where the proxy did not answer); one try each."""
        found = await asyncio.gather(*(self._one("GET", u, None, 1) for u in self.urls))
        return dict(zip(self.urls, found, strict=True))

    async def push(self, routes: Sequence[Route]) -> dict[str, Table | None]:
        """Install ``routes`` at every proxy; per proxy the table it now holds, or ``None``."""
        body = orjson.dumps({"upstreams": [r.as_json() for r in routes]})
        found = await asyncio.gather(
            *(self._one("PUT", u, body, self._attempts) for u in self.urls)
        )
        return dict(zip(self.urls, found, strict=True))

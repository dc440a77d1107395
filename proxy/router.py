"""Replica choice: the live route table, load-aware and prefix-aware routing, ejection, draining.

Role: owns every replica's state (in-flight calls, consecutive failures, ejected, draining) and
answers "which replica serves this call". It does no I/O: the app's prober task calls
:meth:`Router.due_probes` / :meth:`Router.probe_result`, the handler reports outcomes.

Invariants:
- a call is only ever sent to an *active* replica: listed in the current routes, not draining,
  not ejected; ``pick`` raises :class:`~proxy.errors.NoReplica` when none is left;
- ``acquire``/``release`` are paired (the handler does it in ``try/finally``), so ``in_flight``
  is exact; a replica removed by a route update keeps serving its in-flight calls (draining)
  and is forgotten when the last one ends;
- a route update keeps the state of replicas present before and after it (same model and URL);
- every ejection is logged (WARNING) and every re-admission (INFO), on ``scepsy.proxy.router``.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.errors import ModelNotFound, NoReplica
from proxy.ring import HashRing
from shared.engine_load import EngineLoad
from shared.settings import RoutingSettings, UpstreamSettings

log = logging.getLogger("scepsy.proxy.router")


@dataclass(eq=False, slots=True)
class Replica:
    model: str
    url: str
    api_key: str | None
    in_flight: int = 0
    failures: int = 0
    ejected: bool = False
    retry_at: float = 0.0  # monotonic time of the next /health probe while ejected
    draining: bool = False
    served: int = 0
    engine: EngineLoad | None = None  # the engine's own figures at the last scrape
    scraped_at: float = -math.inf  # monotonic time of that scrape
    beyond: float = 0.0  # what that scrape adds to this proxy's in-flight count (Router.load)

    @property
    def active(self) -> bool:
        return not (self.ejected or self.draining)

    def describe(self) -> dict[str, Any]:
        state = "draining" if self.draining else "ejected" if self.ejected else "active"
        return {
            "model": self.model,
            "url": self.url,
            "state": state,
            "in_flight": self.in_flight,
            "served": self.served,
            "has_api_key": self.api_key is not None,
            "engine": None
            if self.engine is None
            else {
                "running": self.engine.running,
                "waiting": self.engine.waiting,
                "kv_usage": self.engine.kv_usage,
            },
        }


def _url(rep: Replica) -> str:
    return rep.url


class PrefixTable:
    """LRU map from hashed prompt-prefix blocks to the replica URLs that served them.

    A prompt is cut into blocks of ``block`` characters (up to ``limit``); block ``i``'s key
    chains the hash of every block before it, so a key match means the whole prefix matched.
    A block remembers every replica that served it, not only the last: a prefix all requests
    share (a system prompt) is soon cached on every replica, and following only the last one
    would herd every new request onto it.
    """

    def __init__(self, block: int, limit: int, capacity: int) -> None:
        self.block, self.limit, self.capacity = block, limit, capacity
        self._map: OrderedDict[int, set[str]] = OrderedDict()

    def keys(self, text: str) -> list[int]:
        text = text[: self.limit]
        keys: list[int] = []
        h = 0
        for start in range(0, max(len(text), 1), self.block):
            h = hash((h, text[start : start + self.block]))
            keys.append(h)
        return keys

    def longest(self, keys: Sequence[int], usable: Container[str]) -> tuple[list[str], int]:
        """(URLs, number of matched blocks) of the longest remembered prefix that a ``usable``
        replica holds; ``([], 0)`` when none holds any."""
        for i in range(len(keys) - 1, -1, -1):
            urls = self._map.get(keys[i])
            if urls:
                hits = [u for u in urls if u in usable]
                if hits:
                    return hits, i + 1
        return [], 0

    def remember(self, keys: Iterable[int], url: str) -> None:
        for key in keys:
            urls = self._map.get(key)
            if urls is None:
                self._map[key] = {url}
            else:
                urls.add(url)
                self._map.move_to_end(key)
        while len(self._map) > self.capacity:
            self._map.popitem(last=False)


class Router:
    def __init__(
        self,
        settings: RoutingSettings,
        upstreams: Iterable[UpstreamSettings],
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        on_eject: Callable[[Replica], None] | None = None,
    ) -> None:
        self.settings = settings
        self._clock = clock
        self._rng = rng or random.Random()
        self._on_eject = on_eject
        self._pools: dict[str, list[Replica]] = {}
        self._draining: list[Replica] = []
        self._prefixes: dict[str, PrefixTable] = {}
        self._rings: dict[str, HashRing] = {}
        self._turn = 0  # round_robin's counter
        self.version = 0
        self.replace(upstreams)

    # --- route table -------------------------------------------------------------------
    def models(self) -> list[str]:
        return [m for m, pool in self._pools.items() if pool]

    def knows(self, model: str) -> bool:
        return bool(self._pools.get(model))

    def replicas(self) -> list[Replica]:
        return [r for pool in self._pools.values() for r in pool] + self._draining

    def replace(self, upstreams: Iterable[UpstreamSettings]) -> list[Replica]:
        """Install a new route table; return the replicas that now drain."""
        old = {(r.model, r.url): r for pool in self._pools.values() for r in pool}
        pools: dict[str, list[Replica]] = {}
        for up in upstreams:
            rep = old.pop((up.model, up.url), None)
            if rep is None:
                rep = Replica(up.model, up.url, up.api_key)
            rep.api_key = up.api_key
            pools.setdefault(up.model, []).append(rep)
        removed = list(old.values())
        for rep in removed:
            rep.draining = True
            if rep.in_flight:
                self._draining.append(rep)
        self._pools = pools
        self._prefixes = {m: t for m, t in self._prefixes.items() if m in pools}
        self._rings = {
            m: HashRing((r.url for r in pool), self.settings.hash_vnodes)
            for m, pool in pools.items()
        }
        self.version += 1
        return removed

    def snapshot(self) -> dict[str, Any]:
        return {"version": self.version, "upstreams": [r.describe() for r in self.replicas()]}

    # --- choosing ----------------------------------------------------------------------
    def pick(
        self,
        model: str,
        prompt: str | None = None,
        exclude: Sequence[Replica] = (),
        key: str | None = None,
    ) -> Replica:
        """The replica for one call. ``prompt`` is its text (``prefix_affinity``), ``key`` its
        affinity key (``consistent_hash``: :func:`proxy.ring.affinity_key`); ``exclude`` the
        replicas this call already tried."""
        pool = self._pools.get(model)
        if not pool:
            raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
        live = [r for r in pool if r.active and r not in exclude]
        if not live:
            raise NoReplica(f"No replica of `{model}` is available right now; try again shortly.")
        if self.settings.policy == "prefix_affinity" and prompt and len(pool) > 1:
            table = self._table(model)
            keys = table.keys(prompt)
            chosen = self._pick_affine(table, keys, live)
            table.remember(keys, chosen.url)
            return chosen
        if self.settings.policy == "consistent_hash" and key is not None and len(live) > 1:
            return self._rings[model].choose(
                key,
                live,
                _url,
                self.load,
                self.settings.hash_load_factor,
                self.settings.affinity_slack,
            )
        if len(live) == 1:
            return live[0]
        if self.settings.policy == "round_robin":
            self._turn += 1
            return live[self._turn % len(live)]
        a, b = self._rng.sample(live, 2)
        return a if self.load(a) <= self.load(b) else b

    def _table(self, model: str) -> PrefixTable:
        table = self._prefixes.get(model)
        if table is None:
            s = self.settings
            table = PrefixTable(s.prefix_block_chars, s.max_prefix_chars, s.affinity_entries)
            self._prefixes[model] = table
        return table

    def _pick_affine(self, table: PrefixTable, keys: list[int], live: list[Replica]) -> Replica:
        least = min(live, key=lambda r: (self.load(r), self._rng.random()))
        urls, matched = table.longest(keys, {r.url for r in live})
        if not urls or matched / len(keys) < self.settings.affinity_min_match:
            return least
        # Among the replicas holding the longest prefix, the least loaded: a shared prefix
        # spreads, a request's own continuation (held by one replica) sticks.
        preferred = min(
            (r for r in live if r.url in urls), key=lambda r: (self.load(r), self._rng.random())
        )
        others = [self.load(r) for r in live if r is not preferred]
        return preferred if self.settings.keeps_affinity(self.load(preferred), others) else least

    # --- load ----------------------------------------------------------------------------
    def load(self, rep: Replica) -> float:
        """The calls a new one would find ahead of it on ``rep``: this proxy's in flight there,
        plus what the engine reported beyond them at its last scrape (other proxies' and
        workers' calls, its queue), plus one batch more when its KV cache is full (a new call
        waits for a running one to end). A scrape older than ``engine_stale_s``, or none,
        leaves the local count alone."""
        if self._clock() - rep.scraped_at > self.settings.engine_stale_s:
            return float(rep.in_flight)
        return rep.in_flight + rep.beyond

    def scrape_targets(self) -> list[Replica]:
        """Replicas whose engine load is worth reading: those new calls may go to."""
        return [r for pool in self._pools.values() for r in pool if r.active]

    def scraped(self, rep: Replica, engine: EngineLoad | None) -> None:
        """Record one scrape of ``rep``'s engine (``None``: it failed or named no load, and
        the last figures age out)."""
        if engine is None:
            return
        # Worked out once per scrape, not per pick: the engine counted this proxy's calls in
        # flight then, so only the rest is added.
        others = max(0.0, engine.calls - rep.in_flight)
        full = engine.kv_usage is not None and engine.kv_usage >= self.settings.engine_kv_full
        rep.engine, rep.scraped_at = engine, self._clock()
        rep.beyond = others + (engine.running if full else 0.0)

    def has_alternative(self, model: str, tried: Sequence[Replica]) -> bool:
        """Whether an active replica of ``model`` is left that ``tried`` does not hold."""
        return any(r.active and r not in tried for r in self._pools.get(model, ()))

    # --- outcomes ----------------------------------------------------------------------
    def acquire(self, rep: Replica) -> None:
        rep.in_flight += 1
        rep.served += 1

    def release(self, rep: Replica) -> None:
        rep.in_flight -= 1
        if rep.draining and rep.in_flight == 0 and rep in self._draining:
            self._draining.remove(rep)

    def succeeded(self, rep: Replica) -> None:
        rep.failures = 0

    def failed(self, rep: Replica) -> None:
        """A connection-level failure; eject after ``eject_after_failures`` in a row."""
        rep.failures += 1
        if not rep.ejected and rep.failures >= self.settings.eject_after_failures:
            rep.ejected = True
            rep.retry_at = self._clock() + self.settings.eject_seconds
            log.warning(
                "replica %s of %s ejected after %d connection failures in a row; "
                "probed again in %.0f s",
                rep.url,
                rep.model,
                rep.failures,
                self.settings.eject_seconds,
                extra={"event": "eject", "model": rep.model, "upstream": rep.url},
            )
            if self._on_eject is not None:
                self._on_eject(rep)

    def due_probes(self) -> list[Replica]:
        now = self._clock()
        return [r for pool in self._pools.values() for r in pool if r.ejected and r.retry_at <= now]

    def probe_result(self, rep: Replica, healthy: bool) -> None:
        if healthy:
            was_ejected = rep.ejected
            rep.ejected, rep.failures = False, 0
            if was_ejected:
                log.info(
                    "replica %s of %s is back: its /health answered, it takes calls again",
                    rep.url,
                    rep.model,
                    extra={"event": "readmit", "model": rep.model, "upstream": rep.url},
                )
        else:
            rep.retry_at = self._clock() + self.settings.probe_interval_s

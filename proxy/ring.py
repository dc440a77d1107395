"""Consistent hashing with bounded load: the replica for an affinity key, the same in every
proxy process that sees the same replicas.

Role: :class:`proxy.router.Router` asks a :class:`HashRing` which replica a call's affinity key
(its workflow request, or its prompt's leading characters; :func:`affinity_key`) belongs to.
The ring places ``vnodes`` points per replica URL on a 64-bit circle; a key goes to the first
point clockwise of its own hash whose replica is usable and *not over its bound*:

    mean  = (Σ load + 1) / n                               (n usable replicas)
    bound = max(ceil(load_factor · mean), ceil(mean) + slack)

(Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing with Bounded Loads", SODA 2018, with
an absolute ``slack``): no replica takes more than ``load_factor`` times the mean or ``slack``
calls above it, whichever is more, so a hot key (a beam search fanning out 32 calls) spills to
the next replica on the circle instead of queueing on one, and spills to the same next replica
in every process; and a light burst (one beam step's few calls, on two replicas) stays together
where the factor alone would split it and lose the engine's prefix cache.

Invariants:
- pure and deterministic: points and key hashes are BLAKE2b digests of the URL and the key (not
  Python's ``hash``, which is salted per process), so two proxies, or two workers of one, with
  the same replica URLs map every key to the same replica at equal loads;
- adding or removing one of ``n`` replicas moves only the keys whose first point changes owner:
  about ``1/n`` of them (``tests/proxy/test_ring.py`` pins it);
- a key always gets a replica when any is usable: the replica with the least load ends the walk
  if every one is at its bound (impossible for ``load_factor > 1``, kept as the guarantee).
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")


def stable_hash(text: str) -> int:
    """A 64-bit hash that is the same in every process (unlike ``hash(str)``)."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def affinity_key(
    workflow: str | None, request_id: str | None, prompt: str | None, key_chars: int
) -> str | None:
    """The key a call is hashed on: its workflow request when it names one (every call of one
    agent run or beam search shares the prompt prefix the engine caches), else the prompt's
    first ``key_chars`` characters (calls continuing one conversation); ``None`` when it has
    neither, and the call goes to the least-loaded replica."""
    if request_id:
        return f"r\x00{workflow or ''}\x00{request_id}"
    if prompt:
        return f"p\x00{prompt[:key_chars]}"
    return None


class HashRing:
    """The circle of one model's replica URLs (``vnodes`` points each)."""

    def __init__(self, urls: Iterable[str], vnodes: int) -> None:
        if vnodes < 1:
            raise ValueError(f"vnodes must be at least 1, got {vnodes}")
        points = sorted(
            (stable_hash(f"{url}#{i}"), url) for url in dict.fromkeys(urls) for i in range(vnodes)
        )
        self._hashes = [h for h, _ in points]
        self._owners = [u for _, u in points]
        self.urls = frozenset(self._owners)

    def walk(self, key: str) -> Iterator[str]:
        """Every URL once, in the order a walk clockwise from ``key``'s hash meets them (lazy:
        a choice usually stops at the first)."""
        n = len(self._owners)
        start = bisect.bisect_right(self._hashes, stable_hash(key))
        seen: set[str] = set()
        for i in range(n):
            url = self._owners[(start + i) % n]
            if url not in seen:
                seen.add(url)
                yield url
                if len(seen) == len(self.urls):
                    return

    def choose(
        self,
        key: str,
        usable: Sequence[T],
        url_of: Callable[[T], str],
        load_of: Callable[[T], float],
        load_factor: float,
        slack: float = 0.0,
    ) -> T:
        """The first of ``usable`` on the walk from ``key`` whose load is under the bound
        (see the module docstring); ``usable`` must not be empty."""
        if not usable:
            raise ValueError("no usable replica to choose from")
        by_url = {url_of(r): r for r in usable}
        loads = {url: load_of(r) for url, r in by_url.items()}
        mean = (sum(loads.values()) + 1) / len(by_url)
        bound = max(math.ceil(load_factor * mean), math.ceil(mean) + slack)
        for url in self.walk(key):
            if url in by_url and loads[url] < bound:
                return by_url[url]
        # Not on the ring (a replica added since it was built), or every one at its bound.
        return min(usable, key=lambda r: (load_of(r), url_of(r)))

"""What runs: the replicas a backend observes and the routes the proxies were last given.

Role: the observed side of a rollout plan, read by the planner, the control step and the
backends; frozen data, no I/O.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class RunningReplica:
    """A replica as a backend observes it."""

    id: str
    group: str
    model: str
    node: str
    gpus: tuple[int, ...]
    share: float
    tp: int
    url: str
    ready: bool
    memory_bytes_per_gpu: int = 0
    revision: str = ""
    # when its engine process started (epoch s), where the backend knows; None: unknown
    started_at: float | None = None


@dataclass(frozen=True)
class Route:
    """One entry of the proxies' route table (``PUT /admin/routes`` shape)."""

    model: str
    url: str
    api_key: str | None = None

    def as_json(self) -> dict[str, str]:
        out = {"model": self.model, "url": self.url}
        if self.api_key is not None:
            out["api_key"] = self.api_key
        return out


@dataclass(frozen=True)
class Observed:
    """What runs now, and the routes the proxies were last given."""

    replicas: tuple[RunningReplica, ...] = ()
    routes: tuple[Route, ...] = ()

    def groups(self) -> dict[str, tuple[RunningReplica, ...]]:
        out: dict[str, list[RunningReplica]] = defaultdict(list)
        for r in self.replicas:
            out[r.group].append(r)
        return {g: tuple(rs) for g, rs in out.items()}

    def routed_ids(self) -> frozenset[str]:
        urls = {(r.model, r.url) for r in self.routes}
        return frozenset(r.id for r in self.replicas if (r.model, r.url) in urls)

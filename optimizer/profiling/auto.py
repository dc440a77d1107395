"""A profiling run the daemon starts on its own: a replica or packed copies, a sweep, points saved.

Role: the effectful half of reprofiling (the decision is :mod:`optimizer.control.reprofile`'s).
:func:`reprofile` starts one profiling replica (or the request's ``copies`` of it, side by side
on one GPU, replayed together and measured per copy) through the rollout backend on the GPUs the
budget found (:func:`profiling_group`: a group whose id starts with
:data:`~optimizer.control.reprofile.PROFILING_PREFIX`), waits for it, replays the store's traced
calls of the model against it with the sweep ``scepsy profile`` runs
(:func:`optimizer.profiling.profiler.sweep`), keeps the points whose prefix-hit rate matches the
trace's (:func:`trusted_points`, shared with ``scepsy profile``), saves them to the store's
profile table and stops the replica. It returns what changed (:class:`ReprofileOutcome`: points
saved, saturation ``T_m`` of the key before and after).

Invariants:
- the replica is stopped whatever happens after its start (error, timeout, cancellation):
  ``backend.stop`` runs in ``finally``;
- a profiling group is never routed (nothing adds it to a route table) and the daemon leaves it
  out of what the step plans from, so no plan stops it or counts it as serving;
- nothing is saved unless a point is trusted; saved points replace only their key's replay
  points.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Protocol

import aiohttp
import orjson

from optimizer.control.reprofile import PROFILING_PREFIX, ReprofileRequest, Slot
from optimizer.model.curves import Profile, ProfileBook
from optimizer.plan.observed import Observed
from optimizer.plan.target import GroupSpec, ReplicaSpec, TargetReplica
from optimizer.profiling import profiler, replay, window
from optimizer.profiling.profiler import PointResult, ProfileRunError
from optimizer.profiling.window import QUICK, SweepSettings, Target
from optimizer.store import profiles
from shared.cluster import cluster_from_settings
from shared.optimizer_settings import ReprofileSettings
from shared.profile_points import ProfileError, ProfilePoint
from shared.settings import Settings

__all__ = [
    "Backend",
    "ReprofileOutcome",
    "Untrusted",
    "profiling_group",
    "reprofile",
    "sweep_settings",
    "trusted_points",
]

log = logging.getLogger(__name__)


class Backend(Protocol):
    """What a profiling run needs of a rollout backend (a part of
    :class:`optimizer.rollout.backend.Backend`, which sits in a higher layer)."""

    async def observe(self) -> Observed: ...

    async def start(self, group: GroupSpec) -> None: ...

    async def wait_ready(self, group: GroupSpec) -> None: ...

    async def stop(self, group_id: str) -> None: ...


@dataclass(frozen=True)
class Untrusted:
    """A measured point not stored: its prefix-hit rate departed from the trace's."""

    point: ProfilePoint
    hit_rate: float | None
    traced_hit_rate: float | None
    reason: str

    def to_json(self) -> dict[str, object]:
        return {
            "point": asdict(self.point),
            "hit_rate": self.hit_rate,
            "traced_hit_rate": self.traced_hit_rate,
            "reason": self.reason,
        }


def trusted_points(
    results: Sequence[PointResult], traced_hit_rate: float | None, tolerance: float
) -> tuple[list[ProfilePoint], list[Untrusted]]:
    """The points to store, and those whose prefix-hit rate departs from the trace's."""
    kept: list[ProfilePoint] = []
    dropped: list[Untrusted] = []
    for r in results:
        reason = window.hit_rate_departure(r.hit_rate, traced_hit_rate, tolerance)
        if reason is None:
            kept.append(r.point)
        else:
            dropped.append(Untrusted(r.point, r.hit_rate, traced_hit_rate, reason))
    return kept, dropped


@dataclass(frozen=True)
class ReprofileOutcome:
    """What one profiling run did: its request and group, the points it saved (and those it
    did not trust), ``T_m`` of the key before (``None``: no curve, or a borrowed one) and after
    (``None``: nothing saved), and how long it took (wall seconds)."""

    request: ReprofileRequest
    group: str
    node: str
    gpus: tuple[int, ...]
    points: tuple[ProfilePoint, ...]
    untrusted: tuple[Untrusted, ...]
    saturation_before: float | None
    saturation_after: float | None
    seconds: float

    def summary(self) -> str:
        r = self.request
        change = (
            "nothing trusted, nothing saved"
            if not self.points
            else f"{len(self.points)} point(s) saved, T_m "
            + ("none" if self.saturation_before is None else f"{self.saturation_before:.4g}")
            + " -> "
            + ("?" if self.saturation_after is None else f"{self.saturation_after:.4g}")
            + " calls/s"
        )
        packed = f" x{r.copies} packed" if r.copies > 1 else ""
        return (
            f"{r.model} tp={r.tp} share={r.share:g}{packed} on {r.gpu_type} ({r.reason}): {change}"
        )


def profiling_group(request: ReprofileRequest, slot: Slot, settings: Settings) -> GroupSpec:
    """The group that profiles ``request`` on ``slot``: one replica, or ``request.copies`` of
    it side by side on the slot's GPUs (its id marks it as a profiling group and is a digest
    of what it runs, so a retried start starts nothing twice)."""
    node = cluster_from_settings(settings.cluster).node(slot.node)
    memory = int(min(node.gpu(g).memory_bytes for g in slot.gpus) * request.share)
    revisions = settings.rollout.revisions()
    spec = ReplicaSpec(
        request.model,
        slot.node,
        slot.gpus,
        request.share,
        memory,
        revisions.get(request.model, ""),
    )
    copies = max(1, request.copies)
    what: list[object] = [list(spec.key()), slot.node] + ([copies] if copies > 1 else [])
    digest = hashlib.sha256(orjson.dumps(what)).hexdigest()[:10]
    gid = f"{PROFILING_PREFIX}{digest}"
    replicas = tuple(TargetReplica(f"{gid}-{i}", spec) for i in range(copies))
    return GroupSpec(gid, slot.node, slot.gpus, replicas)


def sweep_settings(cfg: ReprofileSettings) -> SweepSettings:
    """The sweep a profiling run replays: ``scepsy profile --quick``'s or the full one, with
    ``calls_per_point`` when set."""
    base = QUICK if cfg.quick else SweepSettings()
    return (
        base if cfg.calls_per_point is None else replace(base, calls_per_point=cfg.calls_per_point)
    )


def _saturation(book: ProfileBook | None, r: ReprofileRequest) -> float | None:
    """``T_m`` of the key as the book held it (a measured or share-scaled curve of the same
    GPU type), ``None`` without one."""
    if book is None:
        return None
    try:
        return book.lookup(r.model, r.tp, r.share, gpu_type=r.gpu_type).saturation
    except ProfileError:
        return None


async def _urls(backend: Backend, group: GroupSpec) -> tuple[str, ...]:
    """The base URLs of the group's replicas, every one of them ready (sorted by id)."""
    observed = await backend.observe()
    ready = sorted(
        (rep.id, rep.url.rstrip("/").removesuffix("/v1"))
        for rep in observed.replicas
        if rep.group == group.id and rep.ready
    )
    if len(ready) < len(group.replicas):
        raise ProfileRunError(
            f"profiling group {group.id}: {len(ready)} of {len(group.replicas)} replicas "
            "observed ready"
        )
    return tuple(url for _, url in ready)


async def _speedup(url: str) -> float:
    """The engine's model seconds per wall second (an emulator reports it; else 1)."""
    async with aiohttp.ClientSession() as session:
        got = await profiler.engine_metrics(session, url)
    return got.get("scepsy_emulator_speedup", 1.0)


async def reprofile(
    request: ReprofileRequest,
    slot: Slot,
    backend: Backend,
    settings: Settings,
    *,
    book: ProfileBook | None = None,
    sweep: SweepSettings | None = None,
    save: bool = True,
) -> ReprofileOutcome:
    """Profile ``request`` on a replica started on ``slot`` (module docstring); ``book``: the
    profiles before, for ``T_m`` before; ``sweep``: the sweep (default from the settings);
    ``save=False`` leaves saving the trusted points to the caller (the daemon saves them
    between its own store accesses).
    Raises :class:`ProfileRunError`, :class:`~optimizer.profiling.replay.ReplayError` or the
    backend's :class:`~optimizer.rollout.backend.RolloutError`; the replica is stopped."""
    t0 = time.monotonic()
    store = settings.store.path
    cfg = settings.optimizer.reprofile
    workload = await asyncio.to_thread(replay.load_workload, store, request.model)
    group = profiling_group(request, slot, settings)
    engine = settings.rollout.model(request.model).engine
    log.info(
        "reprofile %s: starting profiling group %s on %s GPU %s",
        request.model,
        group.id,
        slot.node,
        ",".join(map(str, slot.gpus)),
    )
    try:
        await backend.start(group)
        await backend.wait_ready(group)
        url, *copies = await _urls(backend, group)
        target = Target(
            url,
            request.model,
            engine,
            request.gpu_type,
            request.tp,
            request.share,
            await _speedup(url),
            tuple(copies),
        )
        result = await profiler.sweep(target, workload, sweep or sweep_settings(cfg))
    finally:
        await backend.stop(group.id)
    kept, dropped = trusted_points(
        result.points, workload.traced_hit_rate, window.HIT_RATE_TOLERANCE
    )
    for u in dropped:
        log.warning(
            "reprofile %s: point at %.3g calls/s not trusted: %s",
            request.model,
            u.point.offered_rate,
            u.reason,
        )
    if kept and save:
        await profiles.save_points_async(store, kept)
    return ReprofileOutcome(
        request,
        group.id,
        slot.node,
        slot.gpus,
        tuple(kept),
        tuple(dropped),
        _saturation(book, request),
        Profile.from_points(kept).saturation if kept else None,
        time.monotonic() - t0,
    )

"""Live profile points: what serving replicas did over a window, as profile points (pure).

Role: :func:`live_points` turns each replica's load over one statistics window
(:class:`optimizer.stats.replica_load.ReplicaLoad`, read by :mod:`optimizer.stats.replicas`)
into a :class:`shared.profile_points.ProfilePoint` of the replica's key ``(model, engine,
gpu_type, tp, share)`` with ``source="live"``: offered rate = throughput = finished calls per
second, latencies as measured, ``n_calls`` the finished calls, ``observed_at`` the window's end.
The profile book blends them with the replayed curve (:mod:`optimizer.model.curves`).

Invariants (trust rules; :func:`verdict` names the one a load fails):
- the load must match a replica that runs now (same model and URL), is ready, and was already
  running when the window began (by its engine's start where the backend knows it, else by
  when the daemon first saw it; one started or replaced during it is skipped), and it served
  calls from the window's first half (an engine started before the window may have been
  loading weights through part of it);
- at least ``MIN_CALLS`` finished calls over a window at least ``min_window_s`` long;
- a replica's points come from disjoint windows: a load whose window begins before the end of
  the window of the replica's last point (``learned_until``, per URL) makes none. The daemon
  passes every few seconds over a window several passes long; overlapping windows would count
  one burst of queueing several times over, and the book's median of a key's newest points
  would then follow the burst instead of the replica;
- the point's rates are those the replica served, so the curve it corrects is read at the load
  the replica actually saw; nothing here extrapolates;
- a window is not trusted when calls started but not finished in it exceed ``MAX_BACKLOG`` of
  those started, or calls finished exceed those started by as much (a queue from before it
  draining: its latencies are the queue's), or the mean latency of calls started in its second half exceeds
  ``MAX_RISE`` x that of its first half (a queue building up reads as rising latency);
- an *overloaded* window — calls in flight grown by more than ``MAX_BACKLOG`` of those started
  beyond the replica's steady occupancy (Little's law: throughput x latency, which a window
  that began idle fills up to), and a queue across the window, not a slowdown in its last
  seconds: latency rising past ``MAX_RISE`` x, or more than ``MAX_BACKLOG`` of the first
  half's calls still open at its end (a queue that was already long when the window began) —
  makes a *saturated*
  point: what the replica served while it could not keep up is what it can serve, so the
  point says so as a replayed overloaded point does, with an offered rate above its throughput
  (the calls started per second, at least ``SATURATED_OFFER`` x the throughput) and its
  throughput that of the window's second half where it beats the whole window's (a queue that
  began mid-window: its first half served only what arrived); its latency
  (a queue's) corrects nothing, its throughput caps ``T_m`` (:mod:`optimizer.model.curves`).
  Without saturated points a replica that became slower would teach nothing until its queue
  drained.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Protocol

from optimizer.stats.replica_load import ReplicaLoad
from shared.profile_points import ProfilePoint

__all__ = [
    "MAX_BACKLOG",
    "MAX_RISE",
    "MIN_CALLS",
    "OVERLOADED",
    "SATURATED_OFFER",
    "Replica",
    "live_points",
    "verdict",
]

MIN_CALLS = 20  # finished calls: below this a window's mean and p99 are noise
MAX_BACKLOG = 0.10  # (started - finished) / started above this: the replica fell behind
MAX_RISE = 1.5  # second-half / first-half mean latency above this: a queue was building
SATURATED_OFFER = 1.25  # a saturated point's offered rate, x its throughput at least
UNKNOWN_ENGINE = "unknown"  # engine of a model no replayed profile names
OVERLOADED = "overloaded"  # how a verdict that makes a saturated point begins


class Replica(Protocol):
    """What a backend observes of a replica (``optimizer.plan.observed.RunningReplica``)."""

    @property
    def model(self) -> str: ...
    @property
    def node(self) -> str: ...
    @property
    def tp(self) -> int: ...
    @property
    def share(self) -> float: ...
    @property
    def url(self) -> str: ...
    @property
    def ready(self) -> bool: ...


def verdict(
    load: ReplicaLoad,
    replica: Replica | None,
    seen_since: float | None,
    min_window_s: float,
    learned_until: float | None = None,
) -> str | None:
    """Why ``load`` is not trusted (``None``: it is; a reason starting with ``OVERLOADED``:
    only as a saturated point). ``seen_since``: since when the replica runs (epoch s);
    ``learned_until``: where the window of the replica's last live point ended (epoch s)."""
    if replica is None:
        return "no running replica at this URL"
    if not replica.ready:
        return "replica not ready"
    if seen_since is None or seen_since > load.t_from_us / 1e6:
        return "replica started or replaced during the window"
    if learned_until is not None and load.t_from_us / 1e6 < learned_until:
        return "window overlaps the one of the replica's last live point"
    if load.window_s < min_window_s:
        return f"window {load.window_s:.0f} s < {min_window_s:.0f} s"
    if load.finished < MIN_CALLS:
        return f"{load.finished} calls < {MIN_CALLS}"
    if not math.isfinite(load.lat_mean):
        return "no latency measured"
    if not math.isfinite(load.lat_mean_early):  # started before, but serving only since
        return "no call finished from the window's first half"
    growth = load.started - load.finished  # calls in flight at the end, less at the start
    early, late = load.lat_mean_early, load.lat_mean_late
    rising = math.isfinite(early) and math.isfinite(late) and late > early
    # A window that began with the replica idle fills it up to its steady occupancy
    # (Little: throughput x latency); a queue is what grows beyond that, latency rising.
    # A slowdown in the window's last seconds (a noisy neighbour, a pause) leaves calls in
    # flight too, but none from the first half and no clear rise: it is no capacity figure.
    queued = (rising and late > MAX_RISE * early) or load.open_early > MAX_BACKLOG * (
        load.started / 2
    )
    if queued and growth - load.throughput * load.lat_mean > MAX_BACKLOG * load.started:
        return f"{OVERLOADED}: {load.started} calls started, {load.finished} finished"
    if growth > MAX_BACKLOG * load.started:
        return f"behind: {load.started} calls started, {load.finished} finished"
    if -growth > MAX_BACKLOG * load.started:
        return f"draining: {load.started} calls started, {load.finished} finished"
    if rising and late > MAX_RISE * early:
        return f"latency rose from {early:.3f} s to {late:.3f} s in the window"
    return None


def live_points(
    loads: Iterable[ReplicaLoad],
    replicas: Iterable[Replica],
    seen_since: Mapping[str, float],
    gpu_types: Mapping[str, str],
    engines: Mapping[str, str],
    min_window_s: float,
    learned_until: Mapping[str, float] | None = None,
) -> dict[str, ProfilePoint]:
    """The trusted loads as live points, overloaded ones as saturated points, by replica URL
    (without a trailing slash). ``seen_since``: per replica URL, since when it runs (epoch s);
    ``gpu_types``: per node, its GPU type; ``engines``: per model, the engine its replayed
    profile names; ``learned_until``: per replica URL, where the window of its last live
    point ended (epoch s; none: no point yet)."""
    # the proxy records the route's URL as given, the settings strip a trailing slash
    by_url = {(r.model, r.url.rstrip("/")): r for r in replicas}
    since_by_url = {u.rstrip("/"): t for u, t in seen_since.items()}
    until_by_url = {u.rstrip("/"): t for u, t in (learned_until or {}).items()}
    out: dict[str, ProfilePoint] = {}
    for load in sorted(loads, key=lambda ld: (ld.model, ld.upstream)):
        url = load.upstream.rstrip("/")
        replica = by_url.get((load.model, url))
        if replica is None:
            continue
        why = verdict(load, replica, since_by_url.get(url), min_window_s, until_by_url.get(url))
        if why is None:
            out[url] = _point(load, replica, gpu_types, engines)
        elif why.startswith(OVERLOADED):
            point = _point(load, replica, gpu_types, engines)
            served = max(point.throughput, load.finished_late / (load.window_s / 2))
            offered = max(load.started / load.window_s, SATURATED_OFFER * served)
            out[url] = replace(point, offered_rate=offered, throughput=served)
    return out


def _point(
    load: ReplicaLoad, replica: Replica, gpu_types: Mapping[str, str], engines: Mapping[str, str]
) -> ProfilePoint:
    rate = load.throughput
    # a call whose first byte was never recorded: its first byte is as late as its end
    ttft = load.ttft_mean if math.isfinite(load.ttft_mean) else load.lat_mean
    return ProfilePoint(
        model=load.model,
        engine=engines.get(load.model, UNKNOWN_ENGINE),
        gpu_type=gpu_types.get(replica.node, ""),
        tp=replica.tp,
        share=replica.share,
        offered_rate=rate,
        throughput=rate,
        lat_mean=load.lat_mean,
        lat_p50=_or(load.lat_p50, load.lat_mean),
        lat_p90=_or(load.lat_p90, load.lat_mean),
        lat_p99=_or(load.lat_p99, load.lat_mean),
        ttft_mean=ttft,
        n_calls=load.finished,
        source="live",
        observed_at=load.t_to_us / 1e6,
        completion_tokens=_or(load.completion_tokens_mean, -1.0),
    )


def _or(x: float, default: float) -> float:
    return x if math.isfinite(x) else default

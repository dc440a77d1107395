"""A rollout's path: what serves the traffic at each point of a plan, and where to stop early.

Role: pure. A plan on a full cluster replaces replicas in rounds (drain, stop, start, wait for
the engines, route), and between rounds fewer replicas may serve than before or after:
converting two TP-2 replicas into four TP-1 ones on the same GPUs takes each TP-2 replica away
for a cold start. :func:`waypoints` lists the routed sets a plan passes through, from what runs
to the target, with each workflow's predicted latency and throughput on them (the ALP, read
as :func:`optimizer.control.proposal.predict_running` reads what runs). :func:`request_seconds`
prices a path over the decision's horizon with a fluid queue (# assumed model: a workflow's
backlog grows at its rate less the waypoint's capacity and drains at the difference the other
way; every request also pays the waypoint's predicted latency). Two uses:

- :func:`dip_cost`: the queueing a plan's own rounds cause (from an empty queue), which the
  decision adds to the move's cost;
- :func:`first_move`: when what runs cannot serve the traffic, the plan or the prefix of it
  that ends at a serving waypoint, whichever the fluid queue prices lowest with the backlog
  already waiting. A prefix stays until the rest is searched for again after the cooldown.

Invariants:
- the first waypoint is what runs (``end`` 0); a further one follows a batch of ``add_route``
  steps, a batch of ``drain`` steps, or a ``stop`` of replicas still serving (the routed set
  changes nowhere else); ``hold`` is the cold-start rounds until the next one (0 for the
  last, which holds to the horizon's end);
- a prefix ends after a batch of ``add_route`` steps, stops every group it drains, starts no
  temporary copy, and so keeps every model served that the plan keeps served.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType

from optimizer.control.proposal import placed_replicas, predictions_running, running_allocation
from optimizer.model.alp import Pipeline
from optimizer.model.curves import ProfileBook
from optimizer.plan.observed import Observed
from optimizer.plan.planner import Plan, Step
from shared.optimizer_settings import OptimizerSettings

__all__ = ["Waypoint", "dip_cost", "first_move", "request_seconds", "waypoints"]


@dataclass(frozen=True, slots=True)
class Waypoint:
    """The routed replicas once ``plan.steps[:end]`` ran."""

    end: int
    rounds: int  # cold-start rounds waited before it
    hold: int  # cold-start rounds it lasts (until the next waypoint; 0 for the last)
    latency: Mapping[str, float]  # per workflow at the rates (inf: cannot serve it)
    capacity: Mapping[str, float]  # per workflow: the ALP's throughput there (req/s)

    def serves(self, rates: Mapping[str, float]) -> bool:
        return all(math.isfinite(x) for w, x in self.latency.items() if rates.get(w, 0.0) > 0)


def _url(rid: str) -> str:
    return f"plan://{rid}"


def _point(
    end: int,
    rounds: int,
    obs: Observed,
    pipes: Mapping[str, Pipeline],
    book: ProfileBook,
    rates: Mapping[str, float],
) -> Waypoint:
    running = running_allocation(obs, pipes, rates)
    got = predictions_running(pipes, book, running, rates, placed_replicas(obs))
    at = {w: math.inf if p is None else p.latency for w, p in got.items()}
    cap = {w: 0.0 if p is None else p.throughput for w, p in got.items()}
    return Waypoint(end, rounds, 0, MappingProxyType(at), MappingProxyType(cap))


def waypoints(
    plan: Plan,
    observed: Observed,
    pipes: Mapping[str, Pipeline],
    book: ProfileBook,
    rates: Mapping[str, float],
) -> tuple[Waypoint, ...]:
    """What runs, then the routed sets ``plan`` passes through."""
    present = {r.id: r for r in observed.replicas}
    routed = {r.id for r in observed.replicas if r.ready}  # what predict_running reads now

    def serving() -> Observed:
        return Observed(tuple(replace(present[r], ready=True) for r in sorted(routed)))

    out = [_point(0, 0, serving(), pipes, book, rates)]
    rounds = 0
    steps = plan.steps
    i = 0
    while i < len(steps):
        s = steps[i]
        if s.kind in ("start", "wait_ready"):
            if s.kind == "start":
                present |= {r.id: r for r in plan.group(s.group).running(_url, True)}
            elif i == 0 or steps[i - 1].kind != "wait_ready":
                rounds += 1
            i += 1
            continue
        batch = 1  # consecutive routing steps take effect together, as the executor's
        while s.kind != "stop" and i + batch < len(steps) and steps[i + batch].kind == s.kind:
            batch += 1
        ids = {r for b in steps[i : i + batch] for r in b.replicas}
        i += batch
        if s.kind == "add_route":
            routed |= ids & present.keys()
        else:  # drain, or stop (a replica stopped unrouted stops serving too)
            gone = set(ids)
            if s.kind == "stop":
                gone |= {r.id for r in present.values() if r.group == s.group}
                present = {k: r for k, r in present.items() if k not in gone}
            if not gone & routed:
                continue
            routed -= gone
        out.append(_point(i, rounds, serving(), pipes, book, rates))
    nxt = [p.rounds for p in out[1:]] + [out[-1].rounds]
    out = [replace(p, hold=n - p.rounds) for p, n in zip(out, nxt, strict=True)]
    return (*out[:-1], replace(out[-1], hold=0))


def _queue(q: float, rate: float, capacity: float, d: float) -> tuple[float, float]:
    """A fluid queue over ``d`` seconds from ``q`` requests: (request-seconds, queue after)."""
    net = rate - capacity
    after = max(0.0, q + net * d)
    if after > 0.0 or net >= 0.0:
        return (q + after) / 2.0 * d, after
    empty = q / -net  # it empties within d
    return q * empty / 2.0, 0.0


def request_seconds(
    points: Sequence[Waypoint],
    rates: Mapping[str, float],
    backlog: Mapping[str, float],
    horizon_s: float,
    cold_start_s: float,
    queue_only: bool = False,
) -> float:
    """Request-seconds over ``horizon_s`` of the path ``points`` (the last held to the
    horizon's end) from ``backlog`` requests waiting per workflow: the
    fluid queue's and, unless ``queue_only``, every arrival's predicted latency where it
    arrives (a waypoint that cannot serve a workflow charges the path's last finite latency:
    its queue says the rest)."""
    total = 0.0
    for w, r in rates.items():
        if r <= 0:
            continue
        q, left = backlog.get(w, 0.0), horizon_s
        fallback = next(
            (p.latency[w] for p in reversed(points) if math.isfinite(p.latency.get(w, math.inf))),
            0.0,
        )
        for k, p in enumerate(points):
            d = left if k == len(points) - 1 else min(left, p.hold * cold_start_s)
            waited, q = _queue(q, r, p.capacity.get(w, 0.0), d)
            lat = p.latency.get(w, math.inf)
            total += waited + (
                0.0 if queue_only else r * d * (lat if math.isfinite(lat) else fallback)
            )
            left -= d
    return total


def dip_cost(
    points: Sequence[Waypoint], rates: Mapping[str, float], cfg: OptimizerSettings
) -> float:
    """The queueing a plan's own rounds cause: its path's queue from empty, less what the
    target alone would queue (nothing, where it serves the rates)."""
    path = request_seconds(points, rates, {}, cfg.horizon_s, cfg.cold_start_s, queue_only=True)
    end = request_seconds(points[-1:], rates, {}, cfg.horizon_s, cfg.cold_start_s, queue_only=True)
    return max(0.0, path - end)


def _clean(steps: Sequence[Step]) -> bool:
    """``steps`` end after routing and stop every group whose replicas they drained."""
    if not steps or steps[-1].kind != "add_route":
        return False
    drained = {s.group for s in steps if s.kind == "drain"}
    return drained <= {s.group for s in steps if s.kind == "stop"}


def first_move(
    plan: Plan,
    observed: Observed,
    pipes: Mapping[str, Pipeline],
    book: ProfileBook,
    rates: Mapping[str, float],
    backlog: Mapping[str, float],
    proposed: Mapping[str, float],
    cfg: OptimizerSettings,
) -> tuple[Plan, Mapping[str, float], float, str]:
    """The plan to judge, its predicted latency per workflow, the queueing its rounds cause
    (:func:`dip_cost`), and why it is a prefix ("": the whole plan, ``proposed`` its
    latency). When what runs cannot serve a workflow, a prefix ending at a serving waypoint
    is taken instead where the fluid queue prices it lower over the horizon, with the
    ``backlog`` already waiting (module docstring)."""
    points = waypoints(plan, observed, pipes, book, rates)
    whole = plan, proposed, dip_cost(points, rates, cfg), ""
    if points[0].serves(rates) or plan.temporary:
        return whole

    def price(path: Sequence[Waypoint]) -> float:
        return request_seconds(path, rates, backlog, cfg.horizon_s, cfg.cold_start_s)

    full = price(points)
    options = [
        (price(points[: k + 1]), k)
        for k, p in enumerate(points[1:-1], start=1)
        if p.serves(rates) and _clean(plan.steps[: p.end])
    ]
    if not options or min(options)[0] >= full:
        return whole
    cost, k = min(options)
    stop = points[k]
    first = Plan(plan.target, plan.steps[: stop.end], plan.kept)
    why = (
        f"staged: steps 1-{stop.end} of {len(plan.steps)} ({stop.rounds} cold-start round(s)) "
        f"serve every workflow; priced at {cost:.3g} request-s over {cfg.horizon_s:.0f}s "
        f"against {full:.3g} for the whole plan, whose later rounds leave a workflow short "
        "again; the rest is searched for again after the cooldown"
    )
    return first, stop.latency, dip_cost(points[: k + 1], rates, cfg), why

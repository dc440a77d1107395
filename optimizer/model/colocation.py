"""Co-location: what a replica's GPU neighbours cost it, from where it was placed.

Role: a fractional share's replay curve is measured either *packed* (next to as many busy
copies of itself as fill the GPU, each offered the same rate) or *alone* (nothing else on
its GPU); :mod:`shared.profile_points` records which. A placed replica sits between the two:
its neighbours are whatever the placement put beside it, as busy as their own load makes
them. This module says where between (a weight per model); the profile book blends the two
curves there (:meth:`optimizer.model.curves.ProfileBook.lookup`, ``busy=``, through
:func:`optimizer.model.shares.blend`). :func:`settle` finds the weights of a whole placement,
whose replicas' loads depend on each other's weights; :func:`placed_weights` at given
workflow rates, :func:`capacity_weights` at a workflow's own capacity.

The model. A replica is busy (has work, so contends for SMs and bandwidth) with probability
``b = 1 - exp(-λ L / p)``: ``λ L`` calls in flight (Little's law), in groups of the ``p`` a
request runs at once, the groups Poisson-distributed. A replica of
share ``s`` at call rate ``λ`` has *neighbour load* ``Σ_j s_j b_j`` over the other replicas on
its GPUs (the busiest of its GPUs under tensor parallelism). Its packed profile at the same
``λ`` had ``(k - 1)`` copies of share ``s`` beside it, each as busy as itself: a load
``(k - 1) s b``, with ``k = packed_copies(s)``. The weight of the packed curve is their ratio,
clipped to ``[0, 1]``: a placement that reproduces the packed profile reads exactly it (1),
idle neighbours read the alone curve (0), and more contention than the profile saw is not
extrapolated (1). The two curves are blended at equal utilisation ``rho = λ / T``: latency
linearly in the weight, saturation geometrically (as two shares are bridged,
:func:`optimizer.model.shares.interpolated`), so the blend is non-decreasing in ``λ`` and ends
exactly at both measured curves.

Invariants: pure functions of frozen data; a weight is in ``[0, 1]``; a placement that
reproduces a packed profile gets weight 1, a replica alone on its GPUs 0.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from optimizer.model import alp
from optimizer.model.alp import ModelAlloc, Pipeline
from optimizer.model.curves import ProfileBook
from shared.profile_points import packed_copies

SETTLE_ROUNDS = 4  # weights -> latencies -> busy -> weights; moves < 1% after three here


@dataclass(frozen=True, slots=True)
class Placed:
    """One replica where it runs: ``share`` of each of ``gpus`` on ``node``."""

    model: str
    node: str
    gpus: tuple[int, ...]
    share: float
    tp: int = 1


def busy_probability(call_rate: float, latency: float, parallel: float = 1.0) -> float:
    """P(the replica has work) at ``call_rate`` calls/s of ``latency`` s each, arriving
    ``parallel`` at a time (a request's calls that run together keep it busy once; module
    docstring): 1 past saturation (``latency`` infinite)."""
    if call_rate <= 0.0:
        return 0.0
    if not math.isfinite(latency):
        return 1.0
    return 1.0 - math.exp(-call_rate * max(latency, 0.0) / max(parallel, 1.0))


def weights(placed: Sequence[Placed], busy: Mapping[str, float]) -> dict[str, float]:
    """Per model, the packed curve's weight for its replicas (the mean over them) given each
    model's busy probability ``busy`` (module docstring). A model missing from ``busy`` counts
    as idle."""
    on_gpu: dict[tuple[str, int], list[int]] = {}
    for i, r in enumerate(placed):
        for g in r.gpus:
            on_gpu.setdefault((r.node, g), []).append(i)
    per_model: dict[str, list[float]] = {}
    for i, r in enumerate(placed):
        loads = [
            sum(
                placed[j].share * busy.get(placed[j].model, 0.0)
                for j in on_gpu[(r.node, g)]
                if j != i
            )
            for g in r.gpus
        ]
        load = max(loads, default=0.0)
        packed = (packed_copies(r.share) - 1) * r.share * busy.get(r.model, 0.0)
        w = min(1.0, load / packed) if packed > 0 else (1.0 if load > 0 else 0.0)
        per_model.setdefault(r.model, []).append(w)
    return {m: sum(ws) / len(ws) for m, ws in per_model.items()}


def settle(
    book: ProfileBook,
    placed: Sequence[Placed],
    call_rates: Mapping[str, float],
    parallel: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """Each placed model's weight where the placement settles: ``call_rates`` (calls/s per
    replica, by model; ``parallel`` of them at a time, default 1) read on the curves of the
    current weights give busy probabilities, those give new weights; from all-packed (1),
    :data:`SETTLE_ROUNDS` rounds. A model with no curve counts as idle."""
    together = parallel or {}
    configs = {r.model: (r.tp, r.share) for r in placed}
    w = dict.fromkeys(configs, 1.0)
    for _ in range(SETTLE_ROUNDS):
        busy: dict[str, float] = {}
        for model, (tp, share) in configs.items():
            rate = call_rates.get(model, 0.0)
            try:
                prof = book.lookup(model, tp, share, busy=w[model])
            except ValueError:
                continue
            lat = float(prof.latency(rate))
            busy[model] = busy_probability(rate, lat, together.get(model, 1.0))
        w = {m: weights(placed, busy).get(m, 1.0) for m in configs}
    return w


def placed_weights(
    pipes: Mapping[str, Pipeline],
    book: ProfileBook,
    placed: Sequence[Placed],
    rates: Mapping[str, float],
) -> dict[str, float]:
    """Per placed model, its packed curve's weight at workflow ``rates``: each model's calls
    (over every workflow's pipeline) spread evenly over its placed replicas, ``p_m`` at a time
    (the workflows' mean, weighted by their calls), then :func:`settle`."""
    replicas = Counter(r.model for r in placed)
    calls: dict[str, float] = {}
    weighted_p: dict[str, float] = {}
    for w, pipe in pipes.items():
        for st in pipe.stages:
            c = rates.get(w, 0.0) * st.n
            calls[st.model] = calls.get(st.model, 0.0) + c
            weighted_p[st.model] = weighted_p.get(st.model, 0.0) + c * st.p
    parallel = {m: weighted_p[m] / c for m, c in calls.items() if c > 0}
    per_replica = {m: calls.get(m, 0.0) / n for m, n in replicas.items()}
    return settle(book, placed, per_replica, parallel)


def capacity_weights(
    pipe: Pipeline,
    book: ProfileBook,
    allocation: Mapping[str, ModelAlloc],
    placed: Sequence[Placed],
) -> dict[str, float]:
    """The weights of ``placed`` where ``pipe`` runs at its own capacity: the rate just below
    the ``T_w`` those weights give, from the packed one's (every model as busy as its load
    at the workflow's saturation makes it; :data:`SETTLE_ROUNDS` rounds)."""
    w: dict[str, float] = {}
    for _ in range(SETTLE_ROUNDS):
        cap = alp.predict(pipe, book, allocation, 0.0, busy=w or None).throughput
        w = placed_weights({pipe.workflow: pipe}, book, placed, {pipe.workflow: 0.99 * cap})
    return w

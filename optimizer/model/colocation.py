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
request runs at once, the groups Poisson-distributed. While it has work a share draws ``q`` of a
whole GPU's service (its *demand*): alone a share keeps more than its part of the GPU (the
memory bandwidth above all), and ``q`` is what it serves alone of what the whole GPU serves
alone, ``T_alone(s) / T_alone(1)``: measured where the share was measured alone, else
``s^gamma`` with the book's ``gamma`` for the model's alone shares (the share model's,
:func:`optimizer.model.shares.pair_gamma`); where the share was measured packed next to
``k - 1`` copies, ``q`` is calibrated on it: ``k`` busy copies reproduce that profile's
contention ``T_alone / T_packed``. (The fitted ``s^gamma`` in place of a measured ratio read the
fan-out 8B's 0.75 share, which serves 0.85 of its whole GPU alone, as drawing 0.75: its alone
shares are bounded by their KV memory, so ``gamma`` fits 1 across its pairs.) Co-located clients
share the GPU like the simulator's (``sim.perf.contention``): while the sum of the busy ones'
demands exceeds 1, each runs that many times slower than alone. A busy neighbour draws its own
demand ``q_j``: what its model's share draws of the GPU when it runs, calibrated on its own
packed profile where one was measured (the daemon's reprofiler measures a share packed once a
placement packs it), else ``s_j^gamma_j`` with its own alone exponent; a neighbour at another
share than its model's ends moves by that exponent. A placed replica's expected contention is
``C = q + Σ_j b_j q_j`` over the other replicas on its GPUs (the busiest of its GPUs under
tensor parallelism). (Counting a neighbour instead as a copy of the replica's own model at the
neighbour's share, ``q (s_j / s)^gamma``, let a big model whose alone shares are bound by their
KV memory, ``gamma`` about 1, take a busy small model beside it for free: the fan-out 8B at 0.75
beside a 1B at 0.25 read 3.7 s per call against 6.6 s simulated.) The packed end stands for
contention ``C_ref``: for a measured packed share its own (``q (1 + (k - 1) b)``, the copies as
busy as itself), for a derived one the ratio of the two ends' capacities. The weight
``w = ln C / ln C_ref`` (at least 0) makes the blend's capacity, geometric in ``w``, the alone
capacity over ``C``: a placement that reproduces the packed profile reads exactly it (1), idle
neighbours the alone curve (0). More contention than the packed end's (``C > max(C_ref, 1)``: a
neighbour of another model that draws more of the GPU than the copies the share was measured
next to) reads as the packed curve run ``C / max(C_ref, 1)`` times slower, as the simulator's
co-located clients do while their summed demand exceeds the GPU; its weight is
``1 + ln(C / max(C_ref, 1))``. The two curves are blended at equal utilisation
(:func:`optimizer.model.shares.blend`), so the blend is non-decreasing in ``λ`` and ends exactly
at both measured curves.

Invariants: pure functions of frozen data; a weight is at least 0 (above 1 only past the
packed end's contention); a placement that reproduces a packed profile gets weight 1, a
replica alone on its GPUs 0.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from optimizer.model import alp
from optimizer.model.alp import ModelAlloc, Pipeline
from optimizer.model.curves import ProfileBook

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


@dataclass(frozen=True, slots=True)
class Ends:
    """What a model's share draws and where its two curves lie (module docstring):
    ``demand`` ``q``, the packed end's contention ``contended`` (``T_alone / T_packed``, at
    least 1) and the copies it was measured next to (``copies``, 0 where it was derived)."""

    demand: float
    contended: float = 1.0
    copies: int = 0
    exponent: float = 1.0  # the model's alone ``gamma``: how its demand moves with its share
    share: float = 1.0  # the share ``demand`` is of

    def at(self, share: float) -> float:
        """The demand of this model's replica at ``share`` (its own ``demand`` moved by its
        exponent; module docstring)."""
        return self.demand * math.pow(share / self.share, self.exponent)


def ends(book: ProfileBook, model: str, tp: int, share: float) -> Ends:
    """The :class:`Ends` of ``model`` at ``(tp, share)`` in ``book``."""
    if book.alone is None:
        return Ends(share, share=share)
    alone, packed = book.end_curves(model, tp, share)
    contended = max(1.0, alone.saturation / packed.saturation)
    copies = book.measured_copies(model, tp, share)
    gamma = book.alone.betas.for_model(model).gamma
    if copies > 1:
        return Ends(contended / copies, contended, copies, gamma, share)
    # what it serves alone of what the whole GPU serves alone (``s^gamma`` where derived)
    whole, _ = book.end_curves(model, tp, 1.0)
    served = alone.saturation / whole.saturation if whole.saturation > 0 else share**gamma
    return Ends(min(1.0, served), contended, 0, gamma, share)


def weight(demand: float, load: float, reference: float) -> float:
    """The packed curve's weight of a replica drawing ``demand`` beside neighbours drawing
    ``load`` (busy-weighted) when its packed end stands for contention ``reference``: so that
    the blend's capacity is its alone capacity over the contention ``demand + load``. Beyond
    the packed end's contention the weight exceeds 1 by the log of the excess
    (:data:`optimizer.model.curves.ProfileBook.lookup` slows the packed curve by it)."""
    c = demand + load
    beyond = max(c, 1.0) / max(reference, 1.0)
    if beyond > 1.0 + 1e-9:
        return 1.0 + math.log(beyond)
    if reference > 1.0 + 1e-9:
        return min(1.0, math.log(max(c, 1.0)) / math.log(reference))
    if reference > demand:
        return min(1.0, max(0.0, (c - demand) / (reference - demand)))
    return 0.0


def weights(
    placed: Sequence[Placed], busy: Mapping[str, float], model_ends: Mapping[str, Ends]
) -> dict[str, float]:
    """Per model, the packed curve's weight for its replicas (the mean over its fractional
    ones, where it has any) given each model's busy probability ``busy`` and :class:`Ends`
    (module docstring). A model missing from ``busy`` counts as idle; a replica whose model
    is missing from ``model_ends`` draws its share."""
    on_gpu: dict[tuple[str, int], list[int]] = {}
    for i, r in enumerate(placed):
        for g in r.gpus:
            on_gpu.setdefault((r.node, g), []).append(i)

    def demand(r: Placed) -> float:
        e = model_ends.get(r.model)
        return r.share if e is None else e.at(r.share)

    per_model: dict[str, list[tuple[bool, float]]] = {}
    for i, r in enumerate(placed):
        e = model_ends.get(r.model) or Ends(r.share, share=r.share)
        # each busy neighbour draws its own demand (module docstring)
        load = max(
            (
                sum(
                    demand(placed[j]) * busy.get(placed[j].model, 0.0)
                    for j in on_gpu[(r.node, g)]
                    if j != i
                )
                for g in r.gpus
            ),
            default=0.0,
        )
        # a measured packed end: its copies as busy as this replica; a derived one: contended
        reference = (
            e.demand * (1.0 + (e.copies - 1) * busy.get(r.model, 0.0))
            if e.copies > 1
            else e.contended
        )
        w = weight(e.demand, load, reference)
        # a whole GPU has one curve (its weight is moot): a mixed allocation's weight is its
        # fractional rest group's, not diluted by its whole replicas
        per_model.setdefault(r.model, []).append((r.share >= 1.0, w))
    return {m: _mean_fractional(ws) for m, ws in per_model.items()}


def _mean_fractional(ws: Sequence[tuple[bool, float]]) -> float:
    """The mean weight over a model's fractional replicas (over all of them if none is)."""
    picked = [w for whole, w in ws if not whole] or [w for _, w in ws]
    return sum(picked) / len(picked)


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
    # per model its fractional replicas' (tp, share) where it has any: only those share a GPU
    configs = {r.model: (r.tp, r.share) for r in sorted(placed, key=lambda r: -r.share)}
    model_ends: dict[str, Ends] = {}
    for model, (tp, share) in configs.items():
        try:
            model_ends[model] = ends(book, model, tp, share)
        except ValueError:
            continue
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
        got = weights(placed, busy, model_ends)
        w = {m: got.get(m, 1.0) for m in configs}
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

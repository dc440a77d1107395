"""The share model: a curve for a GPU share that was not profiled, and how far to trust it.

Role: :class:`optimizer.model.curves.ProfileBook` looks a ``(model, tp, share)`` up; where that
share was not profiled this module derives its curve from the profiled shares of the same
model and TP (DESIGN §3.5), and says how uncertain the result is. Pure: functions of profiles
and numbers, no I/O; the optimizer never asks the simulator how a share behaves, it learns it
from profile points.

The model. A replica on share ``s`` of a GPU, derived from a profiled share ``c`` (``r = s/c``):

    T_s     = r · T_c                                  (saturation throughput)
    L_s(λ)  = L⁰_c · r^-β  +  (L_c(λ/r) - L⁰_c) · r^-δ   (each latency statistic)

``L⁰`` is the curve's light-load latency (its lightest point); ``L_c(λ/r) - L⁰_c`` the
excess that queueing and batching add at the same utilisation ``rho = λ / T`` (``λ/r`` on
``c`` is ``λ`` on ``s`` at equal ``rho``). The two regimes: at light load a call is one batch
of one request, and a share slows it far less than proportionally (the memory-bound weight
streaming keeps the whole GPU's bandwidth; only compute shrinks): ``r^-β`` with
``0 <= β <= 1``. Above it the excess dominates; a queue whose every step ran ``1/r`` times
slower would stretch it by ``1/r`` (``δ = 1``). That is what a share next to busy copies
(packed) is: every resource contended, ``δ = 1``. A share alone keeps much of the GPU's
memory bandwidth, so its steps at moderate batches slow less than its capacity shrinks:
alone, ``δ`` is fitted from the alone share pairs like ``β`` (below), and where no pair gives
one it is the capacity's exponent ``gamma``. With ``β = δ = 1`` it is exactly linear scaling
(``L_c(λ/r)/r``). Saturation throughput scales by ``r`` and never more: a share is a subset
of the GPU (``r · T_c`` bounds a derived share from above when scaled down, from below when
scaled up from a smaller share).

Shares measured *alone* on their GPU (the profile book's second end,
:mod:`optimizer.model.colocation`) are moved with a saturation exponent as well:
``T_s = r^gamma · T_c``, ``gamma`` fitted like ``β`` from the alone pairs' saturations
(:func:`pair_gamma`; 1 where there is none). Alone, a share keeps much of
the GPU's memory bandwidth and serves more than its part (simulated, A6000: ``gamma`` 0.27 to
0.72 over the accuracy bench's small models); next to busy neighbours it never does (the
packed ends keep ``gamma = 1``).

``β`` comes from the book's own profiled share pairs (same model, engine, GPU type and TP; two
shares ``a < b`` give ``β = ln(L⁰_a / L⁰_b) / ln(b/a)``, clipped to ``[0, 1]``): the median over
the model's pairs, else over every pair of the book, else :data:`DEFAULT_BETA`. ``δ`` alone the
same way from the alone pairs' excesses at equal utilisation (:func:`pair_delta`; simulated
A6000, the accuracy bench's quick profiles: 0.0-0.5, where their ``gamma`` reads 0.27-0.72;
packed pairs against the whole GPU read 0.4-1.0, noisier, and stay at 1; a derived RAG 8B
half share alone read 1.6x its simulated excess at 50-60% load with ``δ = gamma``, 1.2x
with the book's ``δ``). Between two profiled shares ``a < s < b`` the curve is interpolated
instead: both are moved to ``s`` with that pair's own ``β`` and ``δ`` (so ``L⁰`` is exact at
both ends), blended in ``rho`` with weight ``w = ln(s/a) / ln(b/a)`` (latency linearly,
saturation geometrically), the saturation kept between ``T_a`` and ``r · T_b``. A profiled
share is returned as measured.

The uncertainty. Every curve carries ``u >= 0``, a relative error of its speed: the truth is
taken to lie between this curve and the same curve run ``1 / (1 + u)`` as fast (capacity
``T / (1 + u)``, latency at ``λ`` read at ``λ (1 + u)`` and stretched by ``1 + u``; the transform
of a share applied in time, so a slower truth loses capacity and latency at once). ``u = 0``
for a profiled share (an unsaturated profile's ``T_m`` is a lower bound already: pessimistic,
no widening); a derived one gets ``K · |ln r|``, with ``K`` by where ``β`` came from
(:data:`K_MODEL`, :data:`K_BOOK`, :data:`K_DEFAULT`), times :data:`EXTRAPOLATE` when scaled up
beyond the largest profiled share (no measured share bounds it); an interpolated one
``K_PAIR · ln(s/a) · ln(b/s) / ln(b/a)`` (zero at both measured ends). Live points that
corrected the curve divide ``u`` by ``sqrt(1 + n)``. A curve never extrapolates in rate (flat
below its lightest point, ``inf`` past ``T_m``), so rate extrapolation needs no term.

The constants are measured on ``python -m sim.profiles --shares 1,0.75,0.5,0.25`` (simulated,
A6000, its default ``--gpu``; the demo's five models): its share pairs give ``β`` from 0.06 to
1.0, median 0.35 (:data:`DEFAULT_BETA`; per model 0.10 to 0.78). Each ``K`` is about the
median relative error of mean latency (points below 80% of the measured ``T_m``) per unit of
``|ln r|`` (per unit of the bridge when interpolated) when a share is predicted from the
others: 0.3 with the model's own ``β``, 0.45 with other models' (the book's), 0.3 to 0.45 with
the default fitted on those same profiles (0.5 here: out of sample, on another GPU, it can only
be worse), 0.4 between two shares (0.5 here: the medians hide a 26% miss at 0.75 where ``β``
bends). Linear scaling misses by a median 32% / 68% / 158% at shares 0.75 / 0.5 / 0.25 of those
profiles, this model from the whole GPU alone with the default ``β`` by 13% / 22% / 39%. In that
simulator ``r · T`` is below the measured saturation (0.8 to 0.98 of it, 0.6 where the whole
GPU's own ``T_m`` reads low: a share keeps the GPU's memory bandwidth), so a derived capacity
errs low, on the safe side.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt

from shared.profile_points import ProfileKey

if TYPE_CHECKING:
    from optimizer.model.curves import FloatArray, Profile

DEFAULT_BETA = 0.35  # median β of the simulated demo profiles' share pairs (see above)
K_MODEL = 0.3  # u per unit |ln r| when β was fitted on the same model's pairs
K_BOOK = 0.45  # ... on other models' pairs
K_DEFAULT = 0.5  # ... taken from DEFAULT_BETA
K_PAIR = 0.5  # interpolation between two profiled shares (a bridge, 0 at both ends)
_TINY = 1e-12  # a latency read as 0 (an instant stage) still has a logarithm
EXTRAPOLATE = 2.0  # scaled up beyond the largest profiled share
_MIN_LOG_SPAN = 0.05  # shares closer than 5% give no usable β
# δ is read at these utilisations of both curves, where the excess is at least MIN_EXCESS of
# the light-load latency (below it, the excess is the points' noise)
DELTA_RHOS = (0.3, 0.5, 0.7, 0.8)
MIN_EXCESS = 0.05
# Between two measured loads a curve rises as a queue does, not along the chord: its log
# latency is interpolated linearly in the queue coordinate -ln(1 - rho / QUEUE_HEADROOM)
# (``along``). Measured on the accuracy bench's full simulated profiles (15 keys, points below
# 90% of T_m, each left out with its neighbours up to three knots apart): median |error| of a
# left-out point 2.5% (p90 10%) against 14% (p90 90%) for linear interpolation in the rate and
# 7.6% (p90 43%) for log-linear. Out of sample, the --quick profiles' sparser curves read at
# the full profiles' points: mean |error| 13.5% against 20.7% (linear). The headroom puts the
# curve's pole a little past T_m (the highest load that kept up, not the pole itself);
# 1.02 to 1.10 read alike.
QUEUE_HEADROOM = 1.05
BetaSource = Literal["model", "book", "default", "pair"]
_K: Mapping[BetaSource, float] = {"model": K_MODEL, "book": K_BOOK, "default": K_DEFAULT}


@dataclass(frozen=True, slots=True)
class Beta:
    """The light-load exponent ``β`` used for a share and where it came from, and the
    saturation exponent ``gamma`` (``T_s = r^gamma · T_c``): 1 for shares next to busy neighbours,
    which never serve more than their part of the GPU; fitted for shares alone on their GPU
    (see :func:`pair_gamma`)."""

    value: float
    source: BetaSource
    gamma: float = 1.0
    delta: float | None = None  # the excess exponent δ (None: the capacity's, ``gamma``)


def light(prof: Profile) -> float:
    """The curve's light-load mean latency ``L⁰`` (its lightest point)."""
    return float(prof.lat["mean"][0])


def pair_beta(a: Profile, b: Profile) -> float | None:
    """``β`` from two profiled shares of one key but the share (see the module docstring);
    ``None`` when the shares are too close or a light-load latency is not positive."""
    span = math.log(b.key.share / a.key.share)
    la, lb = light(a), light(b)
    if abs(span) < _MIN_LOG_SPAN or not (la > 0 and lb > 0):
        return None
    return min(max(math.log(la / lb) / span, 0.0), 1.0)


def pair_delta(a: Profile, b: Profile) -> float | None:
    """``δ`` from two profiled shares of one key: the median over :data:`DELTA_RHOS` of
    ``ln(E_a / E_b) / ln(b / a)``, ``E`` a curve's excess over its light-load latency at that
    utilisation of its own ``T_m``, clipped to ``[0, 1]``; ``None`` when the shares are too
    close or no utilisation shows both excesses above :data:`MIN_EXCESS`."""
    span = math.log(b.key.share / a.key.share)
    if abs(span) < _MIN_LOG_SPAN:
        return None
    got = []
    for rho in DELTA_RHOS:
        ea = float(a.latency(rho * a.saturation)) - light(a)
        eb = float(b.latency(rho * b.saturation)) - light(b)
        if ea > MIN_EXCESS * light(a) and eb > MIN_EXCESS * light(b):
            got.append(math.log(ea / eb) / span)
    return min(max(statistics.median(got), 0.0), 1.0) if got else None


def pair_gamma(a: Profile, b: Profile) -> float | None:
    """``gamma`` from two profiled shares of one key measured alone: ``ln(T_b / T_a) / ln(b / a)``,
    clipped to ``[0, 1]`` (a share alone keeps much of the GPU's memory bandwidth, so it
    serves more than its part; never less, nor more than the whole); ``None`` when the shares
    are too close."""
    span = math.log(b.key.share / a.key.share)
    if abs(span) < _MIN_LOG_SPAN or not (a.saturation > 0 and b.saturation > 0):
        return None
    return min(max(math.log(b.saturation / a.saturation) / span, 0.0), 1.0)


def _group(k: ProfileKey) -> tuple[str, str, str, int]:
    return (k.model, k.engine, k.gpu_type, k.tp)


@dataclass(frozen=True, slots=True)
class Betas:
    """Every ``β`` a book's profiled share pairs give: per model and over the whole book."""

    by_model: Mapping[str, float]
    book: float | None
    # gamma per model and over the book (empty and None where shares are taken as contended)
    gamma_by_model: Mapping[str, float] = field(default_factory=dict)
    gamma_book: float | None = None
    delta_by_model: Mapping[str, float] = field(default_factory=dict)
    delta_book: float | None = None

    @classmethod
    def fitted(cls, profiles: Iterable[Profile], alone: bool = False) -> Betas:
        """``β`` (and with ``alone``, ``gamma``) from every pair of profiled shares of a key."""
        groups: dict[tuple[str, str, str, int], list[Profile]] = {}
        for p in profiles:
            groups.setdefault(_group(p.key), []).append(p)
        per_model: dict[str, list[float]] = {}
        gammas: dict[str, list[float]] = {}
        deltas: dict[str, list[float]] = {}
        for (model, *_), ps in sorted(groups.items()):
            ps = sorted(ps, key=lambda p: p.key.share)
            for i, a in enumerate(ps):
                for b in ps[i + 1 :]:
                    beta = pair_beta(a, b)
                    if beta is not None:
                        per_model.setdefault(model, []).append(beta)
                    gamma = pair_gamma(a, b) if alone else None
                    if gamma is not None:
                        gammas.setdefault(model, []).append(gamma)
                    delta = pair_delta(a, b) if alone else None
                    if delta is not None:
                        deltas.setdefault(model, []).append(delta)

        def medians(by: dict[str, list[float]]) -> tuple[dict[str, float], float | None]:
            every = [x for xs in by.values() for x in xs]
            per = {m: statistics.median(xs) for m, xs in by.items()}
            return per, statistics.median(every) if every else None

        (by_model, book), (by_gamma, gamma_book) = medians(per_model), medians(gammas)
        by_delta, delta_book = medians(deltas)
        return cls(by_model, book, by_gamma, gamma_book, by_delta, delta_book)

    def for_model(self, model: str) -> Beta:
        gamma = self.gamma_by_model.get(model, self.gamma_book)
        gamma = 1.0 if gamma is None else gamma
        delta = self.delta_by_model.get(model, self.delta_book)
        if model in self.by_model:
            return Beta(self.by_model[model], "model", gamma, delta)
        if self.book is not None:
            return Beta(self.book, "book", gamma, delta)
        return Beta(DEFAULT_BETA, "default", gamma, delta)


def along(rho: npt.ArrayLike, knots: FloatArray, values: FloatArray) -> FloatArray:
    """``values`` (latencies at utilisations ``knots``, ascending, below 1) read at ``rho``:
    exact at the knots, flat below the first and above the last, and between two knots log
    latency linear in ``-ln(1 - rho / QUEUE_HEADROOM)`` (see :data:`QUEUE_HEADROOM`), so a
    non-decreasing curve stays non-decreasing."""
    at = np.minimum(np.asarray(rho, dtype=np.float64), 1.0)
    z = -np.log1p(-np.minimum(knots, 1.0) / QUEUE_HEADROOM)
    logs = np.log(np.maximum(values, _TINY))
    return np.asarray(np.exp(np.interp(-np.log1p(-at / QUEUE_HEADROOM), z, logs)), np.float64)


def _moved(
    prof: Profile, r: float, beta: float, gamma: float = 1.0, delta: float | None = None
) -> tuple[float, FloatArray, dict[str, FloatArray]]:
    """``(T, rho, latencies)`` of ``prof`` moved to ``r`` x its share (module docstring):
    capacity by ``r^gamma``, the excess over light load by ``r^-δ`` (``δ`` None: ``gamma``)."""
    stretch = r ** (-beta)
    excess = r ** (-(gamma if delta is None else delta))
    lat = {k: v[0] * stretch + (v - v[0]) * excess for k, v in prof.lat.items()}
    return prof.saturation * r**gamma, prof.rates / prof.saturation, lat


def derived(base: Profile, share: float, beta: Beta) -> Profile:
    """``base`` (a profiled share) moved to ``share`` with ``beta``, with its uncertainty."""
    r = share / base.key.share
    saturation, rho, lat = _moved(base, r, beta.value, beta.gamma, beta.delta)
    k = K_PAIR if beta.source == "pair" else _K[beta.source]
    u = k * abs(math.log(r)) * (EXTRAPOLATE if r > 1.0 else 1.0)
    return replace(
        base,
        key=replace(base.key, share=share),
        saturation=saturation,
        rates=rho * saturation,
        lat=lat,
        ttft_mean=base.ttft_mean * r ** (-beta.value),
        scaled_from=base.key.share if base.scaled_from is None else base.scaled_from,
        uncertainty=u,
        beta=beta.value,
    )


def interpolated(lower: Profile, upper: Profile, share: float, alone: bool = False) -> Profile:
    """The curve at ``share`` between two profiled shares of one key (module docstring);
    ``scaled_from`` names the upper one. A pair that gives no ``β`` falls back to
    :data:`DEFAULT_BETA` for the move (the blend still ends at both measured curves);
    ``alone``: shares measured alone, whose capacity moves by the pair's own ``gamma``."""
    a, b, s = lower.key.share, upper.key.share, share
    beta = pair_beta(lower, upper)
    beta = DEFAULT_BETA if beta is None else beta
    gamma = (pair_gamma(lower, upper) if alone else None) or 1.0
    delta = pair_delta(lower, upper) if alone else None
    w = math.log(s / a) / math.log(b / a)
    _, rho_a, lat_a = _moved(lower, s / a, beta, gamma, delta)
    t_b, rho_b, lat_b = _moved(upper, s / b, beta, gamma, delta)
    geometric = lower.saturation ** (1.0 - w) * upper.saturation**w
    saturation = max(lower.saturation, min(geometric, t_b))
    rho = np.union1d(rho_a, rho_b)
    lat = {
        k: (1.0 - w) * along(rho, rho_a, lat_a[k]) + w * along(rho, rho_b, lat_b[k]) for k in lat_b
    }
    span = math.log(b / a)
    return replace(
        upper,
        key=replace(upper.key, share=s),
        saturation=saturation,
        saturated=lower.saturated and upper.saturated,
        rates=rho * saturation,
        lat=lat,
        ttft_mean=(1.0 - w) * lower.ttft_mean + w * upper.ttft_mean,
        scaled_from=b,
        uncertainty=K_PAIR * math.log(s / a) * math.log(b / s) / span,
        beta=beta,
    )


def blend(alone: Profile, packed: Profile, w: float) -> Profile:
    """The curve ``w`` of the way from ``alone`` to ``packed`` (one key, measured alone and
    next to busy copies; :mod:`optimizer.model.colocation` says which ``w``): blended at equal
    utilisation, latency linearly, saturation geometrically; exactly each end at 0 and 1."""
    if w <= 0.0:
        return alone
    if w >= 1.0:
        return packed
    rho_a = alone.rates / alone.saturation
    rho_p = packed.rates / packed.saturation
    rho = np.union1d(rho_a, rho_p)
    saturation = alone.saturation ** (1.0 - w) * packed.saturation**w
    lat = {
        k: (1.0 - w) * along(rho, rho_a, alone.lat[k]) + w * along(rho, rho_p, v)
        for k, v in packed.lat.items()
    }
    return replace(
        packed,
        saturation=saturation,
        saturated=alone.saturated and packed.saturated,
        rates=rho * saturation,
        lat=lat,
        ttft_mean=(1.0 - w) * alone.ttft_mean + w * packed.ttft_mean,
        uncertainty=(1.0 - w) * alone.uncertainty + w * packed.uncertainty,
    )


def after_live(prof: Profile) -> Profile:
    """``prof`` with its uncertainty narrowed by the live points that corrected it."""
    if not prof.corrected_by or not prof.uncertainty:
        return prof
    return replace(prof, uncertainty=prof.uncertainty / math.sqrt(1.0 + prof.corrected_by))


def slowed(prof: Profile, factor: float) -> Profile:
    """``prof`` run ``factor`` (>= 1) times slower in time: capacity over it, the latency at
    ``λ`` read at ``λ · factor`` and stretched by it."""
    if factor <= 1.0:
        return prof
    s = 1.0 / factor
    return replace(
        prof,
        saturation=prof.saturation * s,
        rates=prof.rates * s,
        lat={k: v / s for k, v in prof.lat.items()},
        ttft_mean=prof.ttft_mean / s,
    )


def pessimistic(prof: Profile) -> Profile:
    """``prof`` run ``1 / (1 + u)`` as fast: the slow end of its uncertainty (itself at 0)."""
    if not prof.uncertainty:
        return prof
    return replace(slowed(prof, 1.0 + prof.uncertainty), uncertainty=0.0)

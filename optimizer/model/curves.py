"""Profile curves: the throughput-latency curve one key's profile points make (DESIGN §3.5).

Role: a :class:`Profile` is the curve of one ``(model, engine, gpu_type, tp, share)`` key:
saturation throughput ``T_m`` and a latency function ``L(λ)`` that the Aggregate LLM Pipeline
evaluates for many rates at once; a :class:`ProfileBook` finds the curve for an allocation.

Invariants:
- ``T_m`` is the largest throughput measured at a point where the engine kept up (achieved
  within ``FOLLOW_TOLERANCE`` of offered); an overloaded point's reading never raises it: over
  a finite window a backlog draining, a transient batch or a still-warm prefix cache can read
  above what the engine sustains, and deep overload can read far below it;
- ``L(λ)`` is non-decreasing in ``λ``, finite below ``T_m`` and ``inf`` at or beyond it;
- a curve for a share that was not profiled is derived by :mod:`optimizer.model.shares` (not
  linearly: a share slows light load far less than in proportion, saturation throughput by
  ``r`` and never more), interpolated between two profiled shares where it lies between
  them; it says so in ``scaled_from`` and carries a relative ``uncertainty`` (0 for a
  profiled share, wider the farther the share it was derived from, narrower once live points
  corrected it);
- a share measured both packed and alone has two replayed ends: the packed one is its curve,
  and :meth:`ProfileBook.lookup` with ``busy`` blends in the alone one by how busy a placed
  replica's neighbours are (:mod:`optimizer.model.colocation`); without ``busy``, or in a
  book without alone ends, every lookup is exactly what it was before they existed;
- curves are made from replay points only (``source="replay"``); live points
  (:mod:`optimizer.model.live`, ``source="live"``) correct the curve of their own key where
  the replica ran (:meth:`Profile.corrected`). Each live point gives the replica's *speed*
  ``s``: the curve run ``s`` x as fast (``s`` x the rate; a call at rate λ takes as long as one
  at λ/s did on the replay, x 1/s: a share's transform, in time) passes through its
  (throughput, mean latency); the book takes the median, clipped to ``[MIN_FACTOR,
  MAX_FACTOR]``. Capacity is lowered by a slow reading and raised only by throughput sustained:
  a replica slower than its replay (``s < 1``: a neighbour's contention, longer outputs, a
  throttled or changed engine) gets the whole slower curve, ``T_m`` included; a faster one
  (``s > 1``: idle neighbours, shorter calls, more cache hits than the replay saw) gets, at
  each load its points ran at, the latency ratio they read there (the median of points within
  ``_LOAD_BIN`` of each other's throughput), interpolated between those loads, flat below the
  lightest and fading (in log) back to the replayed curve at the replay's highest point above
  the heaviest; it keeps ``T_m``, unless a point read past ``T_m``
  raises it to the throughput it sustained. A *saturated* live point (its window overloaded:
  offered above throughput, :mod:`optimizer.model.live`) says what the replica serves when it
  cannot keep up: their median throughput below ``T_m`` slows the curve (in time) to reach
  ``T_m`` there, if the other points do not slow it more and none of the key kept up with as
  much or more (then the reading is a window that fell behind near the knee, and the points
  that kept up say the speed); its latency (a queue's) is not read.
  The corrected curve says how many live points made
  it (``corrected_by``) and their speed (``speed``). Live points of a model with no replayed curve
  make no curve; without live points every curve is exactly the replayed one. The blend is
  pure and deterministic (which live points count, the newest few per key, is the store's
  rule: :mod:`optimizer.store.profiles`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import numpy.typing as npt

from optimizer.model import shares
from optimizer.model.shares import Beta, Betas
from shared.profile_points import ProfileError, ProfileKey, ProfilePoint, packed_copies

FOLLOW_TOLERANCE = 0.05  # achieved within 5% of offered: the engine keeps up
_SLIVER = 1e-6  # T_m sits this far (relatively) above the highest point that kept up
MIN_FACTOR, MAX_FACTOR = 0.25, 4.0  # how far live points may move a replayed curve's speed
_FADE_KNOTS = 9  # knots between the live loads and the top, where a faster reading fades
_LOAD_BIN = 0.25  # live points within 25% of each other's throughput read one load
_SPEED_STEPS = 60  # bisection steps on log(speed): far below any measurement's precision
Stat = Literal["mean", "p50", "p90", "p99"]
_STATS: tuple[Stat, ...] = ("mean", "p50", "p90", "p99")
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class Profile:
    """The throughput-latency curve of one key, ready for vectorised lookups.

    ``rates`` are achieved throughputs of the points where the engine kept up with the
    offered rate (ascending); ``lat`` maps a statistic to latencies at those rates, made
    non-decreasing and interpolated between them as a queue grows (log latency linear in
    ``-ln(1 - rho / h)``, :func:`optimizer.model.shares.along`). ``saturation`` is the highest of
    those rates (plus a sliver, so that the last point stays finite); beyond it ``inf``.
    """

    key: ProfileKey
    saturation: float  # T_m: calls per second this key sustains
    saturated: bool  # False when no point overloaded the engine (T_m is then a lower bound)
    rates: FloatArray
    lat: dict[str, FloatArray]
    ttft_mean: float  # at the lightest load
    scaled_from: float | None = None  # the profiled share this curve was scaled from
    corrected_by: int = 0  # live points that corrected this curve (0: replay only)
    speed: float = 1.0  # the live points' speed relative to the replay (1.0: replay only)
    uncertainty: float = 0.0  # relative error of the curve's speed (optimizer.model.shares)
    beta: float | None = None  # the light-load share exponent a derived curve used

    @classmethod
    def from_points(cls, points: Sequence[ProfilePoint]) -> Profile:
        if not points:
            raise ProfileError("a profile needs at least one point")
        keys = {p.key for p in points}
        if len(keys) != 1:
            raise ProfileError(f"points of several keys: {sorted(keys)}")
        pts = sorted(points, key=lambda p: p.offered_rate)
        following = [p for p in pts if p.throughput >= (1.0 - FOLLOW_TOLERANCE) * p.offered_rate]
        saturated = len(following) < len(pts)
        if not following:  # every point overloaded: the lightest one's reading is all we have
            following = pts[:1]
        rates = np.array([p.throughput for p in following], dtype=np.float64)
        order = np.argsort(rates, kind="stable")
        rates = rates[order]
        lat: dict[str, FloatArray] = {}
        for stat in _STATS:
            values = np.array([getattr(p, f"lat_{stat}") for p in following])[order]
            lat[stat] = np.maximum.accumulate(values)
        return cls(
            key=pts[0].key,
            saturation=float(rates[-1]) * (1.0 + _SLIVER),
            saturated=saturated,
            rates=rates,
            lat=lat,
            ttft_mean=float(pts[0].ttft_mean),
        )

    def latency(self, rate: npt.ArrayLike, stat: Stat = "mean") -> FloatArray:
        """Latency (s) at arrival rate(s) ``rate`` (calls/s); ``inf`` at or past saturation."""
        lam = np.asarray(rate, dtype=np.float64)
        out = self._along(lam, self.lat[stat])  # flat below the lightest point
        return np.asarray(np.where(lam >= self.saturation, np.inf, out), dtype=np.float64)

    def _along(self, rate: FloatArray, values: FloatArray) -> FloatArray:
        """``values`` (at this curve's rates) read at ``rate``, between its points as a queue
        grows (:func:`optimizer.model.shares.along`)."""
        return shares.along(rate / self.saturation, self.rates / self.saturation, values)

    def scaled(self, share: float, beta: Beta | None = None) -> Profile:
        """This curve moved to GPU share ``share`` by the share model (DESIGN §3.5,
        :mod:`optimizer.model.shares`): saturation x r, light-load latency x r^-β, the
        queueing excess at equal utilisation x 1/r; ``beta`` defaults to the documented
        :data:`~optimizer.model.shares.DEFAULT_BETA`."""
        return shares.derived(self, share, beta or Beta(shares.DEFAULT_BETA, "default"))

    def pessimistic(self) -> Profile:
        """The slow end of this curve's uncertainty (itself when it has none)."""
        return shares.pessimistic(self)

    def _timed(self, r: float) -> Profile:
        """This curve run ``r`` x as fast: ``r`` x the rates, latencies x 1/r."""
        return replace(
            self,
            saturation=self.saturation * r,
            rates=self.rates * r,
            lat={k: v / r for k, v in self.lat.items()},
            ttft_mean=self.ttft_mean / r,
        )

    def speed_at(self, throughput: float, latency: float) -> float:
        """The speed ``s`` at which this curve, run ``s`` x as fast, reads mean ``latency`` at
        ``throughput``, within ``[MIN_FACTOR, MAX_FACTOR]``. ``L(λ/s)/s`` falls strictly as
        ``s`` grows, so bisection on ``log s`` finds it; a reading past the curve's
        saturation at every allowed speed gives the fastest allowed."""
        lo, hi = math.log(MIN_FACTOR), math.log(MAX_FACTOR)
        if latency <= 0 or not math.isfinite(latency):
            return 1.0
        for _ in range(_SPEED_STEPS):
            mid = (lo + hi) / 2
            s = math.exp(mid)
            if float(self.latency(throughput / s)) / s > latency:
                lo = mid  # slower than the reading at this speed: the replica runs faster
            else:
                hi = mid
        return math.exp((lo + hi) / 2)

    def _faded(self, live: Sequence[ProfilePoint]) -> Profile:
        """This curve x the latency ratio the ``live`` points read where they ran, ``T_m``
        kept: per load (points within ``_LOAD_BIN`` of each other's throughput) the median
        ratio live / curve; between loads interpolated in log, flat below the lightest, and
        fading to 1 at the replay's highest point above the heaviest."""
        top = float(self.rates[-1])
        knots: list[tuple[float, float]] = []  # (throughput, log ratio)
        group: list[tuple[float, float]] = []
        for p in sorted(live, key=lambda p: p.throughput):
            base = float(self.latency(p.throughput))
            if not (p.throughput < top and base > 0 and math.isfinite(base) and p.lat_mean > 0):
                continue  # past T_m: such a point only raises T_m
            if group and p.throughput > group[0][0] * (1.0 + _LOAD_BIN):
                knots.append(_knot(group))
                group = []
            group.append((p.throughput, math.log(p.lat_mean / base)))
        if group:
            knots.append(_knot(group))
        if not knots:
            return self
        xs = np.array([x for x, _ in knots] + [top])
        ys = np.array([y for _, y in knots] + [0.0])
        grid = np.union1d(self.rates, np.linspace(xs[0], top, _FADE_KNOTS))
        grid = np.union1d(grid, xs)
        factor = np.exp(np.interp(grid, xs, ys))  # flat below the lightest load
        lat = {k: np.maximum.accumulate(self._along(grid, v) * factor) for k, v in self.lat.items()}
        ttft = self.ttft_mean * float(factor[0])
        return replace(self, rates=grid, lat=lat, ttft_mean=ttft)

    def corrected(self, live: Sequence[ProfilePoint]) -> Profile:
        """This curve corrected by ``live`` points of its key (see the module docstring);
        itself when there are none."""
        if not live:
            return self
        pts = sorted(live, key=lambda p: (p.throughput, p.observed_at, p.lat_mean))
        following = [p for p in pts if p.throughput >= (1 - FOLLOW_TOLERANCE) * p.offered_rate]
        saturated = [p for p in pts if p not in following]
        speed = math.inf
        if following:
            speed = statistics.median(self.speed_at(p.throughput, p.lat_mean) for p in following)
        if saturated:  # it served this much while it could not keep up: T_m is no more
            served = statistics.median(p.throughput for p in saturated)
            # ... unless it kept up with more elsewhere: a window that fell behind near the
            # knee (a burst, a backlog left by a restart) under-reads what it can serve
            if all(p.throughput < served for p in following):
                speed = min(speed, max(MIN_FACTOR, served / self.saturation))
        if speed <= 1.0:
            got = self._timed(speed)
        elif following:
            got = self._faded(following)
        else:  # saturated only, past T_m: the raise below is all they say
            got, speed = self, 1.0
        got = replace(got, corrected_by=len(pts), speed=speed)
        top = pts[-1]
        if top.throughput < got.saturation:
            return got
        # sustained beyond T_m even at the fastest allowed speed: the curve reaches it
        rates = np.append(got.rates, top.throughput)
        lat = {
            stat: np.append(v, max(float(v[-1]), float(getattr(top, f"lat_{stat}"))))
            for stat, v in got.lat.items()
        }
        return replace(got, saturation=top.throughput * (1.0 + _SLIVER), rates=rates, lat=lat)


class ProfileBook:
    """Every profile of a cluster, looked up by model, TP degree and share: the replayed
    curves, corrected by the live points of their keys (``profiles``; ``live`` holds the
    live points by key). A key's replayed curve is made of its packed or unrecorded points,
    else of its alone points; where a key was measured both packed and alone, the alone
    curves make a second book (``alone``) that :meth:`lookup` blends in by a placement's
    neighbours (:mod:`optimizer.model.colocation`)."""

    def __init__(
        self, points: Iterable[ProfilePoint], *, live_too: bool = True, alone_ends: bool = False
    ) -> None:
        replay: dict[ProfileKey, list[ProfilePoint]] = {}
        alone: dict[ProfileKey, list[ProfilePoint]] = {}
        live: dict[ProfileKey, list[ProfilePoint]] = {}
        for p in points:
            if p.source == "live":
                if live_too:
                    live.setdefault(p.key, []).append(p)
            else:
                (alone if p.colocation == "alone" else replay).setdefault(p.key, []).append(p)
        both = sorted(k for k in alone if k in replay)
        self.both = frozenset(both)  # keys measured packed and alone
        # keys with a packed end of their own: measured with copies side by side, or of
        # unrecorded colocation, which is read as packed (the daemon's reprofiler asks)
        self.packed = frozenset(replay)
        for k, ps in alone.items():
            replay.setdefault(k, ps)
        self.live = {k: tuple(v) for k, v in sorted(live.items())}
        self._replayed = {k: Profile.from_points(v) for k, v in sorted(replay.items())}
        self.profiles = {k: p.corrected(self.live.get(k, ())) for k, p in self._replayed.items()}
        # the book's share pairs' β (and for the alone ends, gamma)
        self.betas = Betas.fitted(self._replayed.values(), alone=alone_ends)
        self._alone_ends = alone_ends
        self._scaled: dict[ProfileKey, Profile] = {}
        self._blended: dict[tuple[ProfileKey, float], Profile] = {}
        # the alone ends: each key's alone points where it has them, else its one curve
        self.alone = (
            ProfileBook(
                [p for k, ps in replay.items() for p in (alone.get(k) or ps)],
                live_too=False,
                alone_ends=True,
            )
            if both
            else None
        )
        # a fractional share measured only alone (one copy fills its GPU) has no packed end
        # of its own: next to busy neighbours it gets its part of the GPU, which is the
        # packed shares' and the whole GPU's curves moved to it (``contended``)
        self._alone_only = frozenset(k for k in alone if k not in both and k.share < 1.0 - 1e-9)
        self.contended = (
            ProfileBook(
                [p for k, ps in replay.items() if k not in self._alone_only for p in ps],
                live_too=False,
            )
            if self.alone is not None and self._alone_only
            else None
        )

    def lookup(
        self,
        model: str,
        tp: int,
        share: float,
        engine: str | None = None,
        gpu_type: str | None = None,
        busy: float | None = None,
    ) -> Profile:
        """The measured curve; else, between two measured shares, the two interpolated;
        else the nearest larger (else largest) measured share of the same model/TP moved to
        ``share`` by the share model (:mod:`optimizer.model.shares`, ``β`` from the book's
        share pairs). A derived curve is flagged by ``scaled_from`` and carries its
        ``uncertainty``; either is corrected by the live points of its own key.

        ``busy``: the packed curve's weight for a placed replica
        (:mod:`optimizer.model.colocation`); where the book has alone curves, the
        replayed (or derived) alone and packed curves are blended by it before the live
        correction, and a weight ``w > 1`` (more contention than the packed end's) slows the
        packed curve ``e^(w - 1)`` times. ``None``: the packed curve, as where the book has
        no alone curves."""
        if busy is None or self.alone is None:
            return self._lookup(model, tp, share, engine, gpu_type)
        target, packed = self._packed_end(model, tp, share, engine, gpu_type)
        w = round(max(busy, 0.0), 3)
        got = self._blended.get((target, w))
        if got is None:
            if w > 1.0:  # past the packed end's contention: the alone end plays no part
                mixed = shares.slowed(packed, math.exp(w - 1.0))
            else:
                _, alone = self.alone._replay_curve(model, tp, share, engine, gpu_type)
                mixed = shares.blend(replace(alone, key=target), packed, w)
            live = [p for k, ps in self.live.items() if _same(k, target) for p in ps]
            got = shares.after_live(mixed.corrected(live))
            self._blended[(target, w)] = got
        return got

    def end_curves(
        self, model: str, tp: int, share: float, engine: str | None = None
    ) -> tuple[Profile, Profile]:
        """The alone and the packed replayed curve of a share (measured, interpolated or
        derived; before any live correction); both the one curve where the book has no alone
        ends."""
        if self.alone is None:
            _, packed = self._replay_curve(model, tp, share, engine, None)
            return packed, packed
        _, packed = self._packed_end(model, tp, share, engine, None)
        _, alone = self.alone._replay_curve(model, tp, share, engine, None)
        return alone, packed

    def _packed_end(
        self, model: str, tp: int, share: float, engine: str | None, gpu_type: str | None
    ) -> tuple[ProfileKey, Profile]:
        """The key looked up and its packed end (see ``contended`` in ``__init__``)."""
        target, packed = self._replay_curve(model, tp, share, engine, gpu_type)
        if self.contended is not None and target in self._alone_only:
            try:
                _, moved = self.contended._replay_curve(model, tp, share, engine, gpu_type)
            except ProfileError:  # no other share of it: its one curve is both ends
                return target, packed
            return target, replace(moved, key=target)
        return target, packed

    def measured_copies(self, model: str, tp: int, share: float) -> int:
        """How many copies filled the GPU when this exact share was measured packed (its alone
        end measured too); 0 where it was not."""
        for k in self.both:
            if k.model == model and k.tp == tp and abs(k.share - share) < 1e-9:
                return packed_copies(share)
        return 0

    def _candidates(
        self, model: str, tp: int, engine: str | None, gpu_type: str | None
    ) -> list[ProfileKey]:
        candidates = [
            k
            for k in self._replayed
            if k.model == model
            and k.tp == tp
            and (engine is None or k.engine == engine)
            and (gpu_type is None or k.gpu_type == gpu_type)
        ]
        if not candidates:
            raise ProfileError(f"no profile for model {model!r} at tp={tp}")
        return candidates

    def _replay_curve(
        self, model: str, tp: int, share: float, engine: str | None, gpu_type: str | None
    ) -> tuple[ProfileKey, Profile]:
        """The key looked up and its replayed, interpolated or derived curve, uncorrected."""
        candidates = self._candidates(model, tp, engine, gpu_type)
        for k in candidates:
            if abs(k.share - share) < 1e-9:
                return k, self._replayed[k]
        larger = [k for k in candidates if k.share > share]
        base = (
            min(larger, key=lambda k: k.share) if larger else max(candidates, key=lambda k: k.share)
        )
        smaller = [
            k
            for k in candidates
            if k.share < share and (k.engine, k.gpu_type) == (base.engine, base.gpu_type)
        ]
        target = replace(base, share=share)
        if larger and smaller:
            low = max(smaller, key=lambda k: k.share)
            return target, shares.interpolated(
                self._replayed[low], self._replayed[base], share, self._alone_ends
            )
        return target, shares.derived(self._replayed[base], share, self.betas.for_model(model))

    def _lookup(
        self, model: str, tp: int, share: float, engine: str | None, gpu_type: str | None
    ) -> Profile:
        for k in self._candidates(model, tp, engine, gpu_type):
            if abs(k.share - share) < 1e-9:
                return self.profiles[k]
        target, moved = self._replay_curve(model, tp, share, engine, gpu_type)
        got = self._scaled.get(target)
        if got is None:
            live = [p for k, ps in self.live.items() if _same(k, target) for p in ps]
            got = shares.after_live(moved.corrected(live))
            self._scaled[target] = got
        return got


def _same(a: ProfileKey, b: ProfileKey) -> bool:
    return (a.model, a.engine, a.gpu_type, a.tp) == (b.model, b.engine, b.gpu_type, b.tp) and abs(
        a.share - b.share
    ) < 1e-9


def _knot(group: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """One load's (median throughput, median log ratio)."""
    return (
        statistics.median(x for x, _ in group),
        statistics.median(y for _, y in group),
    )

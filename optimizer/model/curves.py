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
- a curve scaled to another GPU share (throughput x r, latency at rate λ/r stretched by 1/r)
  says so in ``scaled_from``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import numpy.typing as npt

from shared.profile_points import ProfileError, ProfileKey, ProfilePoint

FOLLOW_TOLERANCE = 0.05  # achieved within 5% of offered: the engine keeps up
_SLIVER = 1e-6  # T_m sits this far (relatively) above the highest point that kept up
Stat = Literal["mean", "p50", "p90", "p99"]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class Profile:
    """The throughput-latency curve of one key, ready for vectorised lookups.

    ``rates`` are achieved throughputs of the points where the engine kept up with the
    offered rate (ascending); ``lat`` maps a statistic to latencies at those rates, made
    non-decreasing and interpolated linearly between them. ``saturation`` is the highest of
    those rates (plus a sliver, so that the last point stays finite); beyond it ``inf``.
    """

    key: ProfileKey
    saturation: float  # T_m: calls per second this key sustains
    saturated: bool  # False when no point overloaded the engine (T_m is then a lower bound)
    rates: FloatArray
    lat: dict[str, FloatArray]
    ttft_mean: float  # at the lightest load
    scaled_from: float | None = None  # the profiled share this curve was scaled from

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
        lat = {}
        for stat in ("mean", "p50", "p90", "p99"):
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
        out = np.interp(lam, self.rates, self.lat[stat])  # flat below the lightest point
        return np.asarray(np.where(lam >= self.saturation, np.inf, out), dtype=np.float64)

    def scaled(self, share: float) -> Profile:
        """This curve moved to GPU share ``share`` (DESIGN §3.5): a replica on rx the GPU
        serves rx the rate, and a call at rate λ takes as long as one at λ/r did, x 1/r."""
        r = share / self.key.share
        return replace(
            self,
            key=replace(self.key, share=share),
            saturation=self.saturation * r,
            rates=self.rates * r,
            lat={k: v / r for k, v in self.lat.items()},
            ttft_mean=self.ttft_mean / r,
            scaled_from=self.key.share if self.scaled_from is None else self.scaled_from,
        )


class ProfileBook:
    """Every profile of a cluster, looked up by model, TP degree and share."""

    def __init__(self, points: Iterable[ProfilePoint]) -> None:
        by_key: dict[ProfileKey, list[ProfilePoint]] = {}
        for p in points:
            by_key.setdefault(p.key, []).append(p)
        self.profiles = {k: Profile.from_points(v) for k, v in sorted(by_key.items())}

    def lookup(
        self,
        model: str,
        tp: int,
        share: float,
        engine: str | None = None,
        gpu_type: str | None = None,
    ) -> Profile:
        """The measured curve, else the one of the nearest larger (else largest) measured share
        of the same model/TP scaled to ``share`` (flagged by ``scaled_from``)."""
        candidates = [
            p
            for k, p in self.profiles.items()
            if k.model == model
            and k.tp == tp
            and (engine is None or k.engine == engine)
            and (gpu_type is None or k.gpu_type == gpu_type)
        ]
        if not candidates:
            raise ProfileError(f"no profile for model {model!r} at tp={tp}")
        for p in candidates:
            if abs(p.key.share - share) < 1e-9:
                return p
        larger = [p for p in candidates if p.key.share > share]
        base = (
            min(larger, key=lambda p: p.key.share)
            if larger
            else max(candidates, key=lambda p: p.key.share)
        )
        return base.scaled(share)

"""The Aggregate LLM Pipeline over many candidate allocations at once (numpy).

Role: :func:`predict_many` is :func:`optimizer.model.alp.predict` for a batch of allocations,
what the allocation search (:mod:`optimizer.search`) predicts its configurations with: the
same equations, per stage one profile lookup per distinct (TP, share) among the candidates
(and among their rest groups), 100 000 candidates in well under a second.

Invariants: pure; for every candidate the figures equal :func:`optimizer.model.alp.predict`'s
on the same allocation without co-location weights, up to the rounding of shares to 6 digits
(tests/optimizer/model/test_alp.py and test_mixed_shares.py hold the two together).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from optimizer.model.alp import FloatArray, IntArray, Pipeline, critical_path, stage_latency
from optimizer.model.curves import Profile, ProfileBook, Stat

__all__ = ["BatchPrediction", "predict_many"]


@dataclass(frozen=True, slots=True)
class BatchPrediction:
    """Predictions for C candidate allocations over the pipeline's M stages (stage order)."""

    latency: FloatArray  # (C,)
    throughput: FloatArray  # (C,)
    bottleneck: IntArray  # (C,) index into pipeline.stages
    contribution: FloatArray  # (C, M)
    scaled: npt.NDArray[np.bool_]  # (C, M): the stage's profile was scaled from another share
    uncertainty: FloatArray  # (C, M): the stage's profile's relative uncertainty u_m
    throughput_low: FloatArray  # (C,) capacity_low: every stage at its slow end
    latency_high: FloatArray  # (C,) latency with every stage at its slow end
    contribution_high: FloatArray  # (C, M) contributions on the pessimistic curves


@dataclass(frozen=True)
class _Group:
    """One group of identical replicas for some rows of a batch: the profile of each row
    (rows sharing a (TP, share) share one lookup) and its pessimistic curve."""

    profiles: tuple[Profile, ...]
    inverse: IntArray  # per row, its index into ``profiles``

    @classmethod
    def of(
        cls,
        book: ProfileBook,
        model: str,
        tp: npt.ArrayLike,
        share: npt.ArrayLike,
    ) -> _Group:
        t = np.asarray(tp, dtype=np.float64)
        # Shares are compared after rounding so float noise does not split a group.
        s_key = np.round(np.asarray(share, dtype=np.float64), 6)
        if not len(t):
            return cls((), np.zeros(0, dtype=np.int64))
        pairs, inverse = np.unique(np.stack([t, s_key], axis=1), axis=0, return_inverse=True)
        profiles = tuple(book.lookup(model, int(a), float(b)) for a, b in pairs)
        return cls(profiles, inverse.reshape(-1).astype(np.int64))

    def saturation(self, fast: bool) -> FloatArray:
        per = [
            p.saturation if fast else p.saturation / (1.0 + p.uncertainty) for p in self.profiles
        ]
        return np.asarray(np.array(per, dtype=np.float64)[self.inverse], dtype=np.float64)

    @property
    def certain(self) -> bool:
        """No profile has an uncertainty: its pessimistic curve is itself."""
        return not any(p.uncertainty for p in self.profiles)

    @property
    def scaled(self) -> npt.NDArray[np.bool_]:
        return np.array([p.scaled_from is not None for p in self.profiles], dtype=bool)[
            self.inverse
        ]

    @property
    def uncertainty(self) -> FloatArray:
        return np.asarray(
            np.array([p.uncertainty for p in self.profiles], dtype=np.float64)[self.inverse],
            dtype=np.float64,
        )

    def latency(
        self,
        fast: bool,
        call_rate: FloatArray,
        pool: FloatArray,
        stat: Stat,
        pooling: bool,
        n: float,
        subset: IntArray | None = None,
    ) -> FloatArray:
        """Per row (of ``subset``, positions among the group's rows; default every row), the call
        latency at ``call_rate`` per replica, on the profile (``fast``) or its pessimistic
        curve (a profile without uncertainty is its own: no second curve)."""
        which = self.inverse if subset is None else self.inverse[subset]
        out = np.empty(len(which))
        for g, prof in enumerate(self.profiles):
            at = np.flatnonzero(which == g)
            if not at.size:
                continue
            curve = prof if fast or not prof.uncertainty else prof.pessimistic()
            out[at] = stage_latency(curve, call_rate[at], pool[at], stat, pooling, n)
        return out


def predict_many(
    pipeline: Pipeline,
    book: ProfileBook,
    rate: float,
    replicas: npt.ArrayLike,
    tp: npt.ArrayLike,
    share: npt.ArrayLike,
    stat: Stat = "mean",
    pooling: bool = True,
    rest: npt.ArrayLike | None = None,
    rest_share: npt.ArrayLike | None = None,
) -> BatchPrediction:
    """Vectorised :func:`predict`: ``replicas``, ``tp``, ``share`` (and ``rest``,
    ``rest_share``: the TP-1 rest group of :class:`ModelAlloc`, 0 where none) are (C, M)
    arrays, column ``j`` for ``pipeline.stages[j]``."""
    d = np.asarray(replicas, dtype=np.float64)
    t = np.asarray(tp, dtype=np.int64)
    s = np.asarray(share, dtype=np.float64)
    r = np.zeros_like(d) if rest is None else np.asarray(rest, dtype=np.float64)
    rs = np.zeros_like(d) if rest_share is None else np.asarray(rest_share, dtype=np.float64)
    if (
        d.ndim != 2
        or d.shape[1] != len(pipeline.stages)
        or t.shape != d.shape
        or s.shape != d.shape
        or r.shape != d.shape
        or rs.shape != d.shape
    ):
        raise ValueError(f"allocations must be (C, {len(pipeline.stages)}) arrays")
    n_cand, n_stage = d.shape
    contribution = np.empty((n_cand, n_stage))
    capacity = np.empty((n_cand, n_stage))
    scaled = np.zeros((n_cand, n_stage), dtype=bool)
    u = np.zeros((n_cand, n_stage))
    contribution_high = np.empty((n_cand, n_stage))
    capacity_low = np.empty((n_cand, n_stage))
    for j, st in enumerate(pipeline.stages):
        main = _Group.of(book, st.model, t[:, j], s[:, j])
        mixed = np.flatnonzero(r[:, j] > 0)
        extra = _Group.of(book, st.model, np.ones(len(mixed), np.int64), rs[mixed, j])
        pool = d[:, j] + r[:, j]
        calls = rate * st.n
        # the slow end equals the estimate where no profile has an uncertainty: not twice
        for fast in (True,) if main.certain and extra.certain else (True, False):
            sat = main.saturation(fast)
            total = d[:, j] * sat
            sat_rest = extra.saturation(fast)
            total[mixed] += r[mixed, j] * sat_rest
            lat = main.latency(fast, calls / d[:, j], pool, stat, pooling, st.n)
            if mixed.size:
                lat_main = main.latency(
                    fast, calls * sat[mixed] / total[mixed], pool[mixed], stat, pooling, st.n, mixed
                )
                lat_rest = extra.latency(
                    fast, calls * sat_rest / total[mixed], pool[mixed], stat, pooling, st.n
                )
                with np.errstate(invalid="ignore"):
                    lat[mixed] = (
                        d[mixed, j] * sat[mixed] * lat_main + r[mixed, j] * sat_rest * lat_rest
                    ) / total[mixed]
                lat[mixed] = np.where(
                    np.isfinite(lat_main) & np.isfinite(lat_rest), lat[mixed], np.inf
                )
            cap = total / st.n if st.n > 0 else np.full(n_cand, np.inf)
            if fast:
                contribution[:, j], capacity[:, j] = lat * st.n / st.p, cap
            contribution_high[:, j], capacity_low[:, j] = lat * st.n / st.p, cap
        scaled[:, j] = main.scaled
        u[:, j] = main.uncertainty
        scaled[mixed, j] |= extra.scaled
        u[mixed, j] = np.maximum(u[mixed, j], extra.uncertainty)
    neck = np.argmin(capacity, axis=1)
    throughput = capacity[np.arange(n_cand), neck]
    latency = critical_path(pipeline, contribution) + pipeline.tool_time
    latency = np.where(rate >= throughput, np.inf, latency)
    throughput_low = capacity_low.min(axis=1, initial=np.inf)
    latency_high = critical_path(pipeline, contribution_high) + pipeline.tool_time
    latency_high = np.where(rate >= throughput_low, np.inf, latency_high)
    return BatchPrediction(
        latency=latency,
        throughput=throughput,
        bottleneck=neck,
        contribution=contribution,
        scaled=scaled,
        uncertainty=u,
        throughput_low=throughput_low,
        latency_high=latency_high,
        contribution_high=contribution_high,
    )

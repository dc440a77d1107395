"""Bimodality of per-request shares: a two-cluster split of a 1-D sample (Otsu's method).

Role: decide whether a workflow's requests fall into two populations by how their LLM time is
shared between models (e.g. a RAG app where some questions skip retrieval), so that the
workflow can be modelled as two Aggregate LLM Pipelines instead of one averaged one.

Method: Otsu's threshold maximises the between-class variance of a 1-D sample. Otsu always
finds *some* split, so the flag needs a separation criterion that a unimodal sample fails:
- the effectiveness ``eta = between-class variance / total variance``. A normal sample gives
  0.64, a uniform one 0.75, two separated modes approach 1. We require ``eta >= 0.8``;
- each cluster holds at least ``min_fraction`` of the sample (one outlier is not a mode);
- the cluster means differ by at least ``min_gap`` in absolute terms (shares live in [0, 1];
  a 2-point difference between tight clusters is noise, not a second workflow).

Invariants: pure numpy, no I/O; ``None`` means "not bimodal" (or too few samples to tell).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

MIN_SAMPLES = 20
MIN_ETA = 0.8
MIN_FRACTION = 0.1
MIN_GAP = 0.1


@dataclass(frozen=True, slots=True)
class Split:
    """A two-cluster split of a 1-D sample; values ``<= threshold`` form the low cluster."""

    threshold: float
    low_fraction: float
    low_mean: float
    high_mean: float
    eta: float  # between-class variance / total variance, in [0, 1]


def otsu_split(values: npt.ArrayLike) -> Split | None:
    """The variance-maximising two-cluster split, or ``None`` when the sample is constant."""
    x = np.sort(np.asarray(values, dtype=np.float64))
    n = x.size
    if n < 2 or x[0] == x[-1]:
        return None
    csum = np.cumsum(x)
    total = csum[-1]
    k = np.arange(1, n)  # low cluster = x[:k]
    # Only split between distinct values, so equal values never land in different clusters.
    valid = x[1:] > x[:-1]
    w0 = k / n
    mu0 = csum[:-1] / k
    mu1 = (total - csum[:-1]) / (n - k)
    between = np.where(valid, w0 * (1.0 - w0) * (mu0 - mu1) ** 2, -1.0)
    best = int(np.argmax(between))
    variance = float(np.var(x))
    return Split(
        threshold=float((x[best] + x[best + 1]) / 2.0),
        low_fraction=float(w0[best]),
        low_mean=float(mu0[best]),
        high_mean=float(mu1[best]),
        eta=float(between[best] / variance) if variance > 0 else 0.0,
    )


def bimodal_split(
    values: npt.ArrayLike,
    *,
    min_eta: float = MIN_ETA,
    min_fraction: float = MIN_FRACTION,
    min_gap: float = MIN_GAP,
) -> Split | None:
    """The split when the sample is clearly two populations, else ``None``."""
    x = np.asarray(values, dtype=np.float64)
    if x.size < MIN_SAMPLES:
        return None
    split = otsu_split(x)
    if split is None:
        return None
    if split.eta < min_eta:
        return None
    if min(split.low_fraction, 1.0 - split.low_fraction) < min_fraction:
        return None
    if split.high_mean - split.low_mean < min_gap:
        return None
    return split

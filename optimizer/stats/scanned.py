"""What the statistics scan hands the figures: the store's calls grouped into arrays.

Role: the contract between :mod:`optimizer.stats.scan` (DuckDB) and
:mod:`optimizer.stats.figures` (pure numpy), so the figures never import the database.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]
I32 = npt.NDArray[np.int32]


@dataclass(frozen=True, slots=True)
class Bounds:
    """The window in microseconds; ``None`` means unbounded on that side."""

    lo: int | None  # arrivals and windowed calls start at or after this
    t_to: int | None  # windowed calls start before this
    hi: int | None  # arrivals start before, completed requests end by, this (t_to - settle)


@dataclass(frozen=True, slots=True)
class Histogram:
    """How many windowed calls of each pair reported each token count (nulls left out)."""

    pair: I32
    value: I64
    count: I64


@dataclass(frozen=True, slots=True)
class Scan:
    """What the statistics need, as arrays. Pair codes index ``pairs``; workflow codes
    index ``workflows``."""

    workflows: tuple[str, ...]
    pairs: tuple[tuple[int, str], ...]  # (workflow code, model; "" if null) per pair code
    arrivals: I64  # per workflow code: requests that arrived in the window
    arrivals_late: I64  # of those, the ones that arrived in its later half (0: unbounded window)
    unidentified: I64  # per workflow code: windowed calls without a request id
    # every completed request, ordered by first start (then key)
    req_pair: I32  # the pair of one of its calls (for its workflow)
    req_t0: I64
    req_t1: I64
    # per pair code, over every completed request: its calls and their summed durations
    pair_calls: I64
    pair_dur: I64
    # the sample: completed requests ordered by their offset in the shifted layout
    smp_pair: I32
    smp_dur: I64  # Σ call durations
    smp_off: I64  # start of its range in the shifted layout
    smp_span: I64  # t1 - t0
    # calls (with an end) of the sampled requests, sorted by a
    call_pair: I32
    call_a: I64
    call_b: I64
    prompt: Histogram
    completion: Histogram

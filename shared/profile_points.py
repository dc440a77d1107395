"""Profile points: the contract between whoever measures an LLM and whoever models it (DESIGN §3.5).

Role: a :class:`ProfilePoint` is one measured arrival rate for one
``(model, engine, gpu_type, tp, share)`` key. The profiler, the simulator's profiling and a
file carried between clusters all produce them; the optimizer stores them and fits curves.

Provenance: ``source`` says who measured a point: ``"replay"`` (a profiler or the simulator
replaying a trace) or ``"live"`` (the daemon, from what a serving replica did over one window,
:mod:`optimizer.model.live`); ``observed_at`` is a live point's window end (epoch seconds, 0 for
replay points) and ``n_calls`` the sample size. ``completion_tokens`` is the mean completion
(output) tokens per call the engine reported over the point's calls (0 for embeddings and
rerank, about 1 for a verifier that scores with one token; negative: not recorded): the work
behind a point's speed, recorded beside it (the curves do not read it yet). ``colocation``
says what shared the GPU while a replay point was measured: ``"alone"`` (nothing else ran on
its GPUs), ``"packed"`` (as many busy copies of the same key as fill the GPU, each offered the
same rate: how an allocation packs fractions) or ``""`` (not recorded). All four (``source``,
``observed_at``, ``colocation``, ``completion_tokens``) default, so files and tables written
before they existed still load as replay points of unrecorded colocation and tokens.

Invariants: points travel as ``{"points": [...]}`` JSON; :func:`import_json` refuses a point
with ``tp < 1``, a share outside ``(0, 1]``, a negative rate or an unknown ``source`` or
``colocation``, naming the bad entry.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import orjson

from shared.settings_schema import SettingsError, decode

SOURCES = ("replay", "live")
COLOCATIONS = ("", "alone", "packed")


class ProfileError(ValueError):
    """A bad profile file or an unusable set of points."""


@dataclass(frozen=True, slots=True)
class ProfilePoint:
    """One measured arrival rate. Rates are calls per second, latencies seconds."""

    model: str
    engine: str
    gpu_type: str
    tp: int
    share: float
    offered_rate: float
    throughput: float
    lat_mean: float
    lat_p50: float
    lat_p90: float
    lat_p99: float
    ttft_mean: float
    n_calls: int
    source: str = "replay"  # "replay" | "live" (see the module docstring)
    observed_at: float = 0.0  # epoch seconds of a live point's window end
    colocation: str = ""  # "alone" | "packed" | "" (not recorded; see the module docstring)
    completion_tokens: float = -1.0  # mean per call; negative: not recorded

    @property
    def key(self) -> ProfileKey:
        return ProfileKey(self.model, self.engine, self.gpu_type, self.tp, self.share)


@dataclass(frozen=True, slots=True, order=True)
class ProfileKey:
    model: str
    engine: str
    gpu_type: str
    tp: int
    share: float


def packed_copies(share: float) -> int:
    """Replicas of ``share`` that fill one GPU: how many ran side by side, each at the measured
    rate, for a ``"packed"`` point (1 for a share above one half: packed is then alone)."""
    return max(1, int(1.0 / share + 1e-9))


def export_json(points: Iterable[ProfilePoint]) -> bytes:
    return orjson.dumps({"points": [asdict(p) for p in points]}, option=orjson.OPT_INDENT_2)


def import_json(data: bytes | str) -> list[ProfilePoint]:
    """Points from ``{"points": [...]}`` (or a bare list); errors name the bad entry."""
    try:
        doc: Any = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ProfileError(f"profile file is not JSON: {exc}") from exc
    items = doc.get("points") if isinstance(doc, dict) else doc
    if not isinstance(items, list):
        raise ProfileError('expected {"points": [...]} or a list of points')
    try:
        points = [decode(ProfilePoint, item, f"points[{i}]") for i, item in enumerate(items)]
    except SettingsError as exc:
        raise ProfileError(str(exc)) from exc
    for i, p in enumerate(points):
        if p.tp < 1 or not 0 < p.share <= 1 or p.offered_rate < 0 or p.throughput < 0:
            raise ProfileError(f"points[{i}]: tp >= 1, 0 < share <= 1, rates >= 0 required")
        if p.source not in SOURCES:
            raise ProfileError(f"points[{i}]: source must be one of {SOURCES}, not {p.source!r}")
        if p.colocation not in COLOCATIONS:
            raise ProfileError(
                f"points[{i}]: colocation must be one of {COLOCATIONS}, not {p.colocation!r}"
            )
    return points

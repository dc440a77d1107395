"""LLM throughput-latency profiles: the stored points and the curve one key's points make.

Role: DESIGN §3.5. A :class:`ProfilePoint` is one measured arrival rate for one
``(model, engine, gpu_type, tp, share)`` key; the points live in table ``profile`` of
``<store>/optimizer.duckdb`` and travel as JSON between clusters. A :class:`Profile` is the
curve of one key: saturation throughput ``T_m`` and a latency function ``L(λ)`` that the
Aggregate LLM Pipeline evaluates for many rates at once.

Invariants:
- a re-run replaces exactly the keys it measured (delete + insert in one transaction);
- the database is opened only for the duration of one call, read-write only to write, so the
  daemon, the CLI and a profiler can take turns; async callers use the ``*_async`` wrappers,
  which run in a thread;
- ``T_m`` is the largest throughput measured at a point where the engine kept up (achieved
  within ``FOLLOW_TOLERANCE`` of offered); an overloaded point's reading never raises it: over
  a finite window a backlog draining, a transient batch or a still-warm prefix cache can read
  above what the engine sustains, and deep overload can read far below it;
- ``L(λ)`` is non-decreasing in ``λ``, finite below ``T_m`` and ``inf`` at or beyond it;
- a curve scaled to another GPU share (throughput x r, latency at rate λ/r stretched by 1/r)
  says so in ``scaled_from``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

import duckdb
import numpy as np
import numpy.typing as npt
import orjson

from shared.settings_schema import SettingsError, decode

DB_NAME = "optimizer.duckdb"
FOLLOW_TOLERANCE = 0.05  # achieved within 5% of offered: the engine keeps up
_SLIVER = 1e-6  # T_m sits this far (relatively) above the highest point that kept up
Stat = Literal["mean", "p50", "p90", "p99"]
FloatArray = npt.NDArray[np.float64]


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


_COLUMNS = tuple(f.name for f in fields(ProfilePoint))
_SQL_TYPES = {"model": "VARCHAR", "engine": "VARCHAR", "gpu_type": "VARCHAR", "tp": "INTEGER",
              "n_calls": "BIGINT"}
_CREATE = "CREATE TABLE IF NOT EXISTS profile (" + ", ".join(
    f"{c} {_SQL_TYPES.get(c, 'DOUBLE')}" for c in _COLUMNS) + ")"


# ---- storage -------------------------------------------------------------------------------

def db_path(store: str | Path) -> Path:
    return Path(store) / DB_NAME


def _connect(path: Path, read_only: bool, wait_s: float = 5.0) -> duckdb.DuckDBPyConnection:
    """Open, waiting a little while another process holds the file (each holds it briefly)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return duckdb.connect(str(path), read_only=read_only)
        except duckdb.IOException:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


def save_points(store: str | Path, points: Sequence[ProfilePoint]) -> int:
    """Store ``points``, replacing every earlier point of the keys they cover. Returns rows."""
    if not points:
        return 0
    path = db_path(store)
    path.parent.mkdir(parents=True, exist_ok=True)
    con = _connect(path, read_only=False)
    try:
        con.execute(_CREATE)
        con.execute("BEGIN TRANSACTION")
        for key in sorted({p.key for p in points}):
            con.execute(
                "DELETE FROM profile WHERE model = ? AND engine = ? AND gpu_type = ? AND tp = ? "
                "AND share = ?", [key.model, key.engine, key.gpu_type, key.tp, key.share])
        con.executemany(
            f"INSERT INTO profile ({', '.join(_COLUMNS)}) VALUES "
            f"({', '.join('?' for _ in _COLUMNS)})",
            [[getattr(p, c) for c in _COLUMNS] for p in points])
        con.execute("COMMIT")
    finally:
        con.close()
    return len(points)


def load_points(store: str | Path, model: str | None = None) -> list[ProfilePoint]:
    """Every stored point (of ``model``), ordered by key then offered rate."""
    path = db_path(store)
    if not path.exists():
        return []
    con = _connect(path, read_only=True)
    try:
        tables = con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'profile'")
        if tables.fetchall()[0][0] == 0:
            return []
        where, params = ("WHERE model = ?", [model]) if model is not None else ("", [])
        rows = con.execute(
            f"SELECT {', '.join(_COLUMNS)} FROM profile {where} "
            "ORDER BY model, engine, gpu_type, tp, share, offered_rate", params).fetchall()
    finally:
        con.close()
    return [ProfilePoint(*row) for row in rows]


async def save_points_async(store: str | Path, points: Sequence[ProfilePoint]) -> int:
    return await asyncio.to_thread(save_points, store, points)


async def load_points_async(store: str | Path, model: str | None = None) -> list[ProfilePoint]:
    return await asyncio.to_thread(load_points, store, model)


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
    return points


# ---- the curve -----------------------------------------------------------------------------

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
        following = [p for p in pts
                     if p.throughput >= (1.0 - FOLLOW_TOLERANCE) * p.offered_rate]
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
        return cls(key=pts[0].key, saturation=float(rates[-1]) * (1.0 + _SLIVER),
                   saturated=saturated, rates=rates, lat=lat,
                   ttft_mean=float(pts[0].ttft_mean))

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

    def lookup(self, model: str, tp: int, share: float, engine: str | None = None,
               gpu_type: str | None = None) -> Profile:
        """The measured curve, else the one of the nearest larger (else largest) measured share
        of the same model/TP scaled to ``share`` (flagged by ``scaled_from``)."""
        candidates = [p for k, p in self.profiles.items()
                      if k.model == model and k.tp == tp
                      and (engine is None or k.engine == engine)
                      and (gpu_type is None or k.gpu_type == gpu_type)]
        if not candidates:
            raise ProfileError(f"no profile for model {model!r} at tp={tp}")
        for p in candidates:
            if abs(p.key.share - share) < 1e-9:
                return p
        larger = [p for p in candidates if p.key.share > share]
        base = (min(larger, key=lambda p: p.key.share) if larger
                else max(candidates, key=lambda p: p.key.share))
        return base.scaled(share)

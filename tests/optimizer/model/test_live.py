"""Live profile points: the trust rules and the point a good window makes."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest

from optimizer.model import live
from optimizer.model.live import live_points, verdict
from optimizer.stats.replica_load import ReplicaLoad
from shared.profile_points import ProfileKey, ProfilePoint

S = 1_000_000
T0 = 1_700_000_000.0


@dataclass(frozen=True)
class _Replica:
    model: str = "m"
    node: str = "n0"
    tp: int = 1
    share: float = 0.5
    url: str = "http://a"
    ready: bool = True


def _load(**kw: object) -> ReplicaLoad:
    base = ReplicaLoad(
        model="m",
        upstream="http://a",
        t_from_us=round(T0 * S),
        t_to_us=round((T0 + 40) * S),
        started=100,
        finished=100,
        lat_mean=0.6,
        lat_p50=0.55,
        lat_p90=0.9,
        lat_p99=1.2,
        ttft_mean=0.1,
        lat_mean_early=0.6,
        lat_mean_late=0.62,
        open_early=0,
        finished_late=50,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def _points(
    load: ReplicaLoad, since: float = T0 - 100, replica: _Replica | None = None
) -> list[ProfilePoint]:
    got = live_points(
        [load],
        [replica or _Replica()],
        {"http://a": since},
        {"n0": "a6000"},
        {"m": "emulator"},
        min_window_s=20.0,
    )
    return list(got.values())


def test_a_good_window_makes_one_live_point_of_the_replica_key() -> None:
    (p,) = _points(_load())
    assert p.key == ProfileKey("m", "emulator", "a6000", 1, 0.5)
    assert p.offered_rate == p.throughput == pytest.approx(100 / 40)
    assert (p.lat_mean, p.lat_p50, p.lat_p90, p.lat_p99, p.ttft_mean) == (0.6, 0.55, 0.9, 1.2, 0.1)
    assert (p.n_calls, p.source, p.observed_at) == (100, "live", T0 + 40)
    assert p.completion_tokens < 0  # the engine reported no usage: not recorded
    (q,) = _points(_load(completion_tokens_mean=42.0))
    assert q.completion_tokens == 42.0


@pytest.mark.parametrize(
    ("load", "why"),
    [
        (_load(started=19, finished=19), "calls <"),
        (_load(t_to_us=round((T0 + 15) * S)), "window"),
        (_load(lat_mean_early=math.nan), "first half"),
    ],
)
def test_too_few_calls_a_short_window_or_a_late_start_make_no_point(
    load: ReplicaLoad, why: str
) -> None:
    assert _points(load) == []
    reason = verdict(load, _Replica(), T0 - 100, 20.0)
    assert reason is not None and why in reason


@pytest.mark.parametrize(
    "queue",
    [
        # a queue building up in the window: latency climbs well past the first half's
        _load(started=160, finished=100, lat_mean_early=0.5, lat_mean_late=0.9),
        # a queue already long when the window began: latency flat-ish, first-half calls open
        _load(started=160, finished=100, lat_mean_early=8.0, lat_mean_late=8.6, open_early=30),
    ],
)
def test_a_queue_across_the_window_makes_a_saturated_point(queue: ReplicaLoad) -> None:
    (p,) = _points(queue)
    assert p.throughput == pytest.approx(100 / 40) and p.offered_rate == pytest.approx(160 / 40)
    reason = verdict(queue, _Replica(), T0 - 100, 20.0)
    assert reason is not None and reason.startswith(live.OVERLOADED)


def test_a_queue_from_mid_window_is_served_at_the_second_halfs_rate() -> None:
    # arrivals tripled mid-window: the first half served what arrived, the second what it could
    shift = _load(started=64, finished=25, lat_mean_early=1.8, lat_mean_late=6.0, finished_late=15)
    (p,) = _points(shift)
    assert p.throughput == pytest.approx(15 / 20) and p.offered_rate == pytest.approx(64 / 40)


def test_a_draining_queue_teaches_nothing() -> None:
    drain = _load(started=86, finished=120, lat_mean=13.8, lat_mean_early=16.0, lat_mean_late=9.0)
    assert _points(drain) == []
    reason = verdict(drain, _Replica(), T0 - 100, 20.0)
    assert reason is not None and reason.startswith("draining")


def test_a_slowdown_in_the_windows_last_seconds_teaches_nothing() -> None:
    # as in an emulated demo window whose engines lost the CPU for its last 4 s: 11 calls in
    # flight, all started late; latency only mildly up; nothing from the first half open
    tail = _load(started=33, finished=22, lat_mean=1.87, lat_mean_early=1.7, lat_mean_late=2.1)
    assert _points(tail) == []
    reason = verdict(tail, _Replica(), T0 - 100, 20.0)
    assert reason is not None and reason.startswith("behind")


@pytest.mark.parametrize(
    "load",
    [
        _load(lat_mean_early=0.4, lat_mean_late=0.9),  # latency rose, nothing piled up
        _load(started=160, finished=100, lat_mean_early=0.6, lat_mean_late=0.5),  # not rising
        # a window that began with the replica idle: it filled up to its steady occupancy
        # (2.5 calls/s x 6 s = 15 calls in flight), no queue beyond it
        _load(started=115, finished=100, lat_mean=6.0, lat_mean_early=5.0, lat_mean_late=6.5),
    ],
)
def test_a_window_behind_or_slowing_without_a_queue_teaches_nothing(load: ReplicaLoad) -> None:
    assert _points(load) == []
    reason = verdict(load, _Replica(), T0 - 100, 20.0)
    assert reason is not None and not reason.startswith(live.OVERLOADED)


def test_a_replica_not_ready_replaced_or_unknown_makes_no_point() -> None:
    assert _points(_load(), replica=_Replica(ready=False)) == []
    assert _points(_load(), since=T0 + 5) == []  # started during the window
    assert _points(_load(), replica=_Replica(url="http://other")) == []


def test_a_small_backlog_and_unknown_ttft_are_still_trusted() -> None:
    (p,) = _points(_load(started=105, finished=100, ttft_mean=math.nan))
    assert p.ttft_mean == p.lat_mean
    assert live.MIN_CALLS == 20 and live.MAX_BACKLOG == 0.10


def test_a_replica_learns_from_disjoint_windows_only() -> None:
    """The daemon's windows overlap from pass to pass; a replica's next point comes from a
    window that begins where its last point's window ended, or later."""
    first = _load()
    overlapping = _load(t_from_us=round((T0 + 10) * S), t_to_us=round((T0 + 50) * S))
    after = _load(t_from_us=round((T0 + 40) * S), t_to_us=round((T0 + 80) * S))

    def learn(load: ReplicaLoad, until: dict[str, float]) -> dict[str, ProfilePoint]:
        return live_points(
            [load], [_Replica()], {"http://a/": T0 - 100}, {"n0": "a6000"}, {"m": "e"}, 20.0, until
        )

    (url, p) = next(iter(learn(first, {}).items()))
    assert url == "http://a" and p.observed_at == T0 + 40
    assert learn(overlapping, {url: p.observed_at}) == {}
    reason = verdict(overlapping, _Replica(), T0 - 100, 20.0, p.observed_at)
    assert reason is not None and "overlaps" in reason
    assert learn(after, {"http://a/": p.observed_at})["http://a"].observed_at == T0 + 80
    # another replica's last point does not hold this one back
    assert learn(overlapping, {"http://b": T0 + 40})

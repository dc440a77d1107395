"""optimizer.model.curves: storage, JSON, the curve (saturation, interpolation, scaling)."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from optimizer.model.curves import Profile, ProfileBook
from optimizer.model.shares import QUEUE_HEADROOM, Beta
from optimizer.store.profiles import load_points, load_points_async, save_points, save_points_async
from shared.profile_points import ProfileError, ProfilePoint, export_json, import_json

MU = 10.0  # an M/M/1 server: latency 1 / (mu - lambda), throughput min(lambda, mu)
AT_MU = 50.0  # latency read at lambda >= mu over a finite window


def mm1(
    model: str = "gen",
    tp: int = 1,
    share: float = 1.0,
    mu: float = MU,
    rates: tuple[float, ...] | None = None,
) -> list[ProfilePoint]:
    """Points of an M/M/1 server (by default 1..15 and ``mu`` itself); the point at ``mu``
    keeps up (barely), those past it do not."""
    out = []
    for lam in sorted({1, 3, 5, 7, 8, 9, 12, 15, mu} if rates is None else rates):
        lat = 1.0 / (mu - lam) if lam < mu else AT_MU
        out.append(
            ProfilePoint(
                model,
                "emulator",
                "H100",
                tp,
                share,
                lam,
                min(lam, mu),
                lat,
                lat * 0.7,
                lat * 2.3,
                lat * 4.6,
                0.01,
                1000,
            )
        )
    return out


def test_save_replaces_only_the_measured_keys(tmp_path: Path) -> None:
    save_points(tmp_path, mm1("gen") + mm1("ver") + mm1("gen", tp=2))
    assert len(load_points(tmp_path)) == 27
    fresh = mm1("gen", rates=(2, 4))
    save_points(tmp_path, fresh)
    gen1 = [p for p in load_points(tmp_path, "gen") if p.tp == 1]
    assert [p.offered_rate for p in gen1] == [2, 4]
    assert len(load_points(tmp_path, "ver")) == 9
    assert len([p for p in load_points(tmp_path, "gen") if p.tp == 2]) == 9


def test_load_from_empty_store(tmp_path: Path) -> None:
    assert load_points(tmp_path) == []


async def test_async_wrappers(tmp_path: Path) -> None:
    await save_points_async(tmp_path, mm1())
    got = await load_points_async(tmp_path, "gen")
    assert got == sorted(mm1(), key=lambda p: p.offered_rate)
    await asyncio.sleep(0)


def test_json_round_trip() -> None:
    points = mm1() + mm1("ver", share=0.5)
    assert import_json(export_json(points)) == points


def test_json_errors_name_the_entry() -> None:
    doc = export_json(mm1()).replace(b'"tp": 1', b'"tp": "one"', 1)
    with pytest.raises(ProfileError, match=r"points\[0\]\.tp"):
        import_json(doc)
    with pytest.raises(ProfileError, match="not JSON"):
        import_json(b"{")
    bad = export_json([replace(mm1()[0], share=1.5)])
    with pytest.raises(ProfileError, match="share"):
        import_json(bad)


def test_saturation_is_where_throughput_stops_following() -> None:
    prof = Profile.from_points(mm1())
    assert prof.saturation == pytest.approx(MU)
    assert prof.saturated
    unsat = Profile.from_points(mm1(rates=(1, 3, 5)))
    assert not unsat.saturated
    assert unsat.saturation == pytest.approx(5.0, rel=1e-5)


def test_an_overloaded_reading_never_raises_saturation() -> None:
    # A short overloaded window reads 11/s (a backlog draining), above anything that kept up.
    pts = mm1(rates=(1, 3, 5, 7, 8, 9))
    pts.append(replace(pts[-1], offered_rate=14.0, throughput=11.0, lat_mean=40.0))
    prof = Profile.from_points(pts)
    assert prof.saturated
    assert prof.saturation == pytest.approx(9.0, rel=1e-5)
    assert np.isinf(prof.latency(9.5))


def queued(lam: float, lo: tuple[float, float], hi: tuple[float, float], top: float) -> float:
    """The latency at ``lam`` between two points ``(rate, latency)`` of a curve whose
    saturation is ``top``: log latency linear in ``-ln(1 - rate / (top * QUEUE_HEADROOM))``."""

    def z(x: float) -> float:
        return -math.log1p(-x / (top * (1.0 + 1e-6) * QUEUE_HEADROOM))

    f = (z(lam) - z(lo[0])) / (z(hi[0]) - z(lo[0]))
    return math.exp(math.log(lo[1]) + f * (math.log(hi[1]) - math.log(lo[1])))


def test_between_sparse_points_the_curve_follows_the_queue_not_the_chord() -> None:
    # an M/M/1 server profiled at three loads only: read in between, the curve stays near the
    # queue's 1/(mu - lambda), where the chord over-reads by up to 1.8x
    prof = Profile.from_points(mm1(rates=(1, 5, 9)))
    lam = np.array([2.0, 3.0, 4.0, 6.0, 7.0, 8.0])
    truth = 1.0 / (MU - lam)
    chord = np.interp(lam, [1.0, 5.0, 9.0], [1 / 9, 1 / 5, 1.0])
    got = prof.latency(lam)
    assert np.all(np.abs(got / truth - 1) < 0.25)
    assert np.all(np.abs(got / truth - 1) < np.abs(chord / truth - 1))
    assert np.max(chord / truth) > 1.75


def test_latency_interpolates_and_diverges() -> None:
    prof = Profile.from_points(mm1())
    lam = np.array([0.5, 1.0, 2.0, 6.0, 9.5, 10.0, 10.1, 20.0])
    got = prof.latency(lam)
    assert got[0] == pytest.approx(1 / 9)  # flat below the lightest point
    assert got[1] == pytest.approx(1 / 9)
    # between points: log latency linear in the queue coordinate, below the chord
    assert got[2] == pytest.approx(queued(2.0, (1.0, 1 / 9), (3.0, 1 / 7), MU))
    assert got[3] == pytest.approx(queued(6.0, (5.0, 1 / 5), (7.0, 1 / 3), MU))
    assert got[4] == pytest.approx(queued(9.5, (9.0, 1.0), (MU, AT_MU), MU))
    assert 1 / 9 < got[2] < (1 / 9 + 1 / 7) / 2 and got[4] < (1.0 + AT_MU) / 2
    assert got[5] == pytest.approx(AT_MU)  # the highest point that kept up stays finite
    assert np.isinf(got[6]) and np.isinf(got[7])
    finite = got[np.isfinite(got)]
    assert np.all(np.diff(finite) >= 0)
    assert prof.latency(5.0, "p90") == pytest.approx(2.3 / 5)


def test_latency_is_monotone_even_when_points_are_not() -> None:
    pts = mm1(rates=(1, 3, 5))
    pts[1] = replace(pts[1], lat_mean=0.01)  # a noisy dip
    prof = Profile.from_points(pts)
    assert np.all(np.diff(prof.latency(np.linspace(0, 4.9, 50))) >= 0)


def test_scaled_share() -> None:
    full = Profile.from_points(mm1())
    half = full.scaled(0.5)
    assert half.saturation == pytest.approx(MU / 2)
    assert half.scaled_from == 1.0
    # a share slows light load less than in proportion (linear would read 1/0.5 x)
    assert full.latency(5.0) < half.latency(2.5) < full.latency(5.0) / 0.5
    linear = full.scaled(0.5, Beta(1.0, "model"))  # beta 1: linear by construction
    assert linear.latency(2.5) == pytest.approx(full.latency(5.0) / 0.5)


def test_book_prefers_measured_then_scales() -> None:
    book = ProfileBook(mm1() + mm1(share=0.5, mu=6.0))
    measured = book.lookup("gen", 1, 0.5)
    assert measured.scaled_from is None and measured.saturation == pytest.approx(6.0)
    scaled = book.lookup("gen", 1, 0.25)
    assert scaled.scaled_from == 0.5 and scaled.saturation == pytest.approx(3.0)
    assert book.lookup("gen", 1, 0.75).scaled_from == 1.0
    with pytest.raises(ProfileError):
        book.lookup("gen", 4, 1.0)


# --- live points blended with the replayed curve ---------------------------------------------
def live(
    rate: float, factor: float, share: float = 1.0, model: str = "gen", t: float = 1000.0
) -> ProfilePoint:
    """A live point at ``rate`` reading ``factor`` x the replayed M/M/1 latency (at share 1)."""
    lat = factor / (MU - rate) if rate < MU else AT_MU
    return ProfilePoint(
        model, "emulator", "H100", 1, share, rate, rate, lat, lat * 0.7, lat * 2.3, lat * 4.6,
        0.01, 60, source="live", observed_at=t,
    )  # fmt: skip


def at_speed(rate: float, speed: float, t: float = 1000.0) -> ProfilePoint:
    """A live point of the same M/M/1 server running ``speed`` x as fast: 1 / (s mu - lambda)."""
    return live(rate, (MU - rate) / (speed * MU - rate), t=t)


def test_a_replica_at_half_speed_halves_the_capacity_and_stretches_the_curve() -> None:
    replayed = ProfileBook(mm1()).lookup("gen", 1, 1.0)
    got = ProfileBook([*mm1(), at_speed(2.0, 0.5), at_speed(3.0, 0.5, t=1001.0)]).lookup(
        "gen", 1, 1.0
    )
    assert got.corrected_by == 2 and replayed.corrected_by == 0 and replayed.speed == 1.0
    assert got.speed == pytest.approx(0.5, rel=0.03)
    assert got.saturation == pytest.approx(replayed.saturation * got.speed)
    rates = np.array([0.5, 2.0, 4.0])
    for stat in ("mean", "p50", "p90", "p99"):
        assert got.latency(rates, stat) == pytest.approx(
            replayed.latency(rates / got.speed, stat) / got.speed
        )
    # the corrected curve passes through what the replica read, and near saturation it is the
    # slow server's (a latency-only factor would read 2 x 1/(10-4.5) = 0.36 s there, not ~2 s)
    assert got.latency(3.0) == pytest.approx(1 / (5.0 - 3.0), rel=0.05)
    assert got.latency(4.5) > 1.0 and not np.isfinite(got.latency(5.5))


def test_light_load_readings_move_latency_by_their_ratio() -> None:
    replayed = ProfileBook(mm1()).lookup("gen", 1, 1.0)
    got = ProfileBook([*mm1(), live(1.0, 0.5)]).lookup("gen", 1, 1.0)
    # at the lightest replayed point the curve is flat below: the speed is the latency ratio
    assert got.speed == pytest.approx(2.0, rel=1e-6)
    assert got.latency(1.0) == pytest.approx(float(replayed.latency(1.0)) * 0.5)


def test_a_faster_reading_keeps_t_m_and_fades_back_to_the_replay_at_the_top() -> None:
    replayed = ProfileBook(mm1()).lookup("gen", 1, 1.0)
    got = ProfileBook([*mm1(), live(3.0, 0.6)]).lookup("gen", 1, 1.0)
    assert got.speed > 1.0 and got.saturation == replayed.saturation
    assert got.latency(3.0) == pytest.approx(0.6 * float(replayed.latency(3.0)))
    assert got.latency(10.0) == pytest.approx(float(replayed.latency(10.0)))
    ratios = got.latency(np.array([3.0, 5.0, 7.0, 9.0])) / replayed.latency([3.0, 5.0, 7.0, 9.0])
    assert np.all(np.diff(ratios) > 0) and np.all(ratios < 1.0)  # 0.6 fading towards 1
    assert np.all(np.diff(got.latency(np.linspace(0, 9.99, 200))) >= 0)


def test_faster_readings_at_two_loads_correct_each_load_and_between() -> None:
    replayed = ProfileBook(mm1()).lookup("gen", 1, 1.0)
    pts = [live(1.0, 0.5), live(1.1, 0.5, t=1001.0), live(6.0, 0.8, t=1002.0)]
    got = ProfileBook([*mm1(), *pts]).lookup("gen", 1, 1.0)
    ratio = got.latency(np.array([1.0, 6.0, 9.99])) / replayed.latency([1.0, 6.0, 9.99])
    read = pts[2].lat_mean / float(replayed.latency(6.0))  # the curve interpolates 5..7
    assert ratio[0] == pytest.approx(0.5, rel=0.05) and ratio[1] == pytest.approx(read)
    assert ratio[2] == pytest.approx(1.0, rel=0.02)  # back to the replay at its top
    assert got.saturation == replayed.saturation


def test_saturated_readings_cap_t_m_and_a_slower_curve_follows() -> None:
    """A replica that served 4 calls/s while it could not keep up (replay: T_m 10)."""
    replayed = ProfileBook(mm1()).lookup("gen", 1, 1.0)
    sat = replace(live(4.0, 1.0), offered_rate=6.0, lat_mean=9.0)  # its latency is a queue's
    got = ProfileBook([*mm1(), sat]).lookup("gen", 1, 1.0)
    assert got.saturation == pytest.approx(4.0 * (1 + 1e-6), rel=1e-3)
    assert got.speed == pytest.approx(4.0 / replayed.saturation, rel=1e-3)
    assert got.latency(1.0) == pytest.approx(replayed.latency(1.0 / got.speed) / got.speed)
    # a following reading slower still wins; a faster one does not lift the cap
    slow = ProfileBook([*mm1(), sat, at_speed(1.0, 0.3)]).lookup("gen", 1, 1.0)
    assert slow.speed == pytest.approx(0.3, rel=0.05)
    fast = ProfileBook([*mm1(), sat, live(1.0, 0.5)]).lookup("gen", 1, 1.0)
    assert fast.speed == got.speed
    # a saturated reading past T_m only says the replica served more
    above = replace(live(0.0, 1.0), offered_rate=15.0, throughput=12.0, lat_mean=5.0)
    assert ProfileBook([*mm1(), above]).lookup("gen", 1, 1.0).saturation >= 12.0


def test_a_saturated_reading_never_caps_t_m_below_a_rate_the_replica_kept_up_with() -> None:
    """Replay T_m 10; the replica kept up at 6 calls/s (a slower curve, speed 0.7) and fell
    behind once serving 4: T_m stays at the speed's 7, at least the 6 it sustained."""
    sat = replace(live(4.0, 1.0), offered_rate=6.0, lat_mean=9.0)
    kept = at_speed(6.0, 0.7, t=1001.0)
    got = ProfileBook([*mm1(), sat, kept]).lookup("gen", 1, 1.0)
    assert got.speed == pytest.approx(0.7, rel=0.05) and got.saturation >= 6.0
    # a rate kept up with below the saturated reading leaves the cap where it was
    low = ProfileBook([*mm1(), sat, at_speed(1.0, 0.9, t=1001.0)]).lookup("gen", 1, 1.0)
    assert low.saturation == pytest.approx(4.0 * (1 + 1e-6), rel=1e-3)


def test_the_median_reading_wins_over_one_outlier() -> None:
    pts = [at_speed(2.0, 0.8, t=1000.0), at_speed(3.0, 0.8, t=1001.0), live(2.5, 30.0, t=1002.0)]
    assert ProfileBook([*mm1(), *pts]).lookup("gen", 1, 1.0).speed == pytest.approx(0.8, rel=0.05)


def test_the_correction_is_clipped() -> None:
    slow = ProfileBook([*mm1(), live(1.0, 1000.0)]).lookup("gen", 1, 1.0)
    fast = ProfileBook([*mm1(), live(3.0, 0.001)]).lookup("gen", 1, 1.0)
    assert slow.speed == pytest.approx(0.25) and fast.speed == pytest.approx(4.0)


def test_a_scaled_curve_is_corrected_by_live_points_of_its_own_key() -> None:
    book = ProfileBook([*mm1(), live(2.0, 1.0, share=0.5)])  # replayed at 1.0 only
    plain = ProfileBook(mm1()).lookup("gen", 1, 0.5)
    got = book.lookup("gen", 1, 0.5)
    assert got.scaled_from == 1.0 and got.corrected_by == 1
    # the live point read 1/(10-2) = 0.125 s at 2 calls/s: the scaled curve moves onto it
    assert got.latency(2.0) == pytest.approx(0.125, rel=1e-6)
    ratio = 0.125 / float(plain.latency(2.0))  # faster than scaled: the ratio holds below
    assert got.latency(1.0) == pytest.approx(float(plain.latency(1.0)) * ratio)
    assert book.lookup("gen", 1, 0.25).corrected_by == 0  # not where the replica ran


def test_a_live_point_beyond_saturation_raises_it() -> None:
    extra = replace(live(0.0, 1.0, share=0.5), offered_rate=30.0, throughput=30.0, lat_mean=2.0)
    got = ProfileBook([*mm1(share=0.5, mu=6.0), extra]).lookup("gen", 1, 0.5)
    assert got.saturation == pytest.approx(30.0)  # 4 x faster would still stop at 24
    assert np.isfinite(got.latency(29.0)) and got.latency(30.0) >= got.latency(20.0)


def test_live_points_alone_make_no_curve_and_none_leave_the_book_as_it_was() -> None:
    with pytest.raises(ProfileError):
        ProfileBook([live(3.0, 1.0)]).lookup("gen", 1, 1.0)
    assert ProfileBook([live(3.0, 1.0)]).profiles == {}
    a, b = ProfileBook(mm1()), ProfileBook(mm1())
    assert a.profiles.keys() == b.profiles.keys()
    for k, p in a.profiles.items():
        q = b.profiles[k]
        assert (p.saturation, p.corrected_by) == (q.saturation, 0)
        assert np.array_equal(p.rates, q.rates) and np.array_equal(p.lat["mean"], q.lat["mean"])


def test_saving_live_points_keeps_replay_points_and_only_the_newest_live_ones(
    tmp_path: Path,
) -> None:
    save_points(tmp_path, mm1())
    for t in range(8):
        save_points(tmp_path, [live(3.0, 0.5, t=1000.0 + t)])
    got = load_points(tmp_path)
    assert len([p for p in got if p.source == "replay"]) == 9
    assert sorted(p.observed_at for p in got if p.source == "live") == [
        1003.0 + i for i in range(5)
    ]
    save_points(tmp_path, [live(3.0, 0.5, t=1007.0 + 4000.0)])  # an hour later: old ones age out
    assert [p.observed_at for p in load_points(tmp_path) if p.source == "live"] == [5007.0]
    save_points(tmp_path, mm1(rates=(2, 4)))  # a new replay replaces replay points only
    got = load_points(tmp_path)
    assert [p.offered_rate for p in got if p.source == "replay"] == [2, 4]
    assert len([p for p in got if p.source == "live"]) == 1


def test_json_source_is_validated() -> None:
    points = [live(3.0, 0.5)]
    assert import_json(export_json(points)) == points
    bad = export_json([replace(points[0], source="guess")])
    with pytest.raises(ProfileError, match="source"):
        import_json(bad)
    # a file written before provenance existed loads as replay points
    old = b'{"points": [{"model": "m", "engine": "e", "gpu_type": "g", "tp": 1, "share": 1.0, '
    old += b'"offered_rate": 1, "throughput": 1, "lat_mean": 1, "lat_p50": 1, "lat_p90": 1, '
    old += b'"lat_p99": 1, "ttft_mean": 0.1, "n_calls": 10}]}'
    (p,) = import_json(old)
    assert (p.source, p.observed_at, p.colocation) == ("replay", 0.0, "")
    with pytest.raises(ProfileError, match="colocation"):
        import_json(export_json([replace(points[0], colocation="crowded")]))

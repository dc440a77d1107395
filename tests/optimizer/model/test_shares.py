"""optimizer.model.shares: curves for shares that were not profiled, and their uncertainty."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optimizer.model.curves import Profile, ProfileBook
from optimizer.model.shares import (
    DEFAULT_BETA,
    EXTRAPOLATE,
    K_BOOK,
    K_DEFAULT,
    K_MODEL,
    K_PAIR,
    Beta,
    pair_beta,
)
from shared.profile_points import ProfilePoint
from tests.optimizer.model.test_profiles import live, mm1

RHOS = (0.05, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0, 1.3)


def queue(
    model: str = "gen",
    share: float = 1.0,
    saturation: float = 10.0,
    light: float = 1.0,
    blowup: float = 0.5,
) -> list[ProfilePoint]:
    """A batching engine's profile: ``light`` at light load, growing as a queue towards
    ``saturation`` (the point at 1.0 barely keeps up, the one past it does not)."""
    out = []
    for rho in RHOS:
        lam = rho * saturation
        lat = light * (1 + blowup * min(rho, 0.95) / (1 - min(rho, 0.95)))
        out.append(
            ProfilePoint(
                model, "emulator", "H100", 1, share, lam, min(lam, saturation),
                lat, lat * 0.8, lat * 1.5, lat * 2.0, light * 0.2, 500,
            )
        )  # fmt: skip
    return out


def test_a_share_slows_light_load_far_less_than_in_proportion() -> None:
    full = Profile.from_points(queue())
    half = full.scaled(0.5)
    light = float(full.latency(0.5))
    assert half.saturation == pytest.approx(full.saturation * 0.5)
    assert half.scaled_from == 1.0 and half.beta == DEFAULT_BETA
    assert float(half.latency(0.25)) == pytest.approx(light * 2**DEFAULT_BETA)
    assert float(half.latency(0.25)) < float(full.latency(0.5)) / 0.5  # linear's figure
    # near saturation the queueing excess dominates and the curve approaches linear scaling
    for stat in ("mean", "p50", "p90", "p99"):
        near = float(half.latency(0.9 * half.saturation, stat))
        linear = float(full.latency(0.9 * full.saturation, stat)) / 0.5
        assert 0.8 * linear < near <= linear
    assert half.ttft_mean == pytest.approx(full.ttft_mean * 2**DEFAULT_BETA)


def test_beta_one_is_linear_scaling() -> None:
    full = Profile.from_points(queue())
    half = full.scaled(0.5, Beta(1.0, "model"))
    lam = np.linspace(0.1, 4.9, 13)
    assert half.latency(lam) == pytest.approx(full.latency(lam / 0.5) / 0.5)


def test_profiled_shares_are_returned_exactly() -> None:
    points = queue() + queue(share=0.5, saturation=5.5, light=1.3)
    book = ProfileBook(points)
    half = book.lookup("gen", 1, 0.5)
    measured = Profile.from_points(queue(share=0.5, saturation=5.5, light=1.3))
    assert half.scaled_from is None and half.uncertainty == 0 and half.beta is None
    assert half.saturation == measured.saturation
    lam = np.linspace(0.1, 5.4, 11)
    assert np.array_equal(half.latency(lam), measured.latency(lam))


def test_between_two_profiled_shares_the_curve_joins_both() -> None:
    book = ProfileBook(queue() + queue(share=0.5, saturation=5.0, light=1.3))
    low, high = book.lookup("gen", 1, 0.5), book.lookup("gen", 1, 1.0)
    near_low = book.lookup("gen", 1, 0.5 * (1 + 1e-9))
    near_high = book.lookup("gen", 1, 1.0 - 1e-9)
    for got, want in ((near_low, low), (near_high, high)):
        assert got.saturation == pytest.approx(want.saturation, rel=1e-6)
        rho = np.array([0.05, 0.3, 0.6, 0.85])
        assert got.latency(rho * got.saturation) == pytest.approx(
            want.latency(rho * want.saturation), rel=1e-6
        )
        assert got.uncertainty == pytest.approx(0.0, abs=1e-8)
    mid = book.lookup("gen", 1, 0.7)
    assert mid.scaled_from == 1.0
    # the light-load latency lies on the power law through both measured shares
    beta = pair_beta(low, high)
    assert beta is not None
    assert beta == pytest.approx(math.log(1.3) / math.log(2.0))
    assert float(mid.latency(0.0)) == pytest.approx(float(high.latency(0.0)) * 0.7 ** (-beta))
    assert low.saturation < mid.saturation <= 0.7 * high.saturation * (1 + 1e-9)


def test_beta_comes_from_the_models_pairs_else_the_books_else_the_default() -> None:
    gen = queue() + queue(share=0.5, saturation=5.0, light=2**0.6)
    other = queue("ver", light=0.5)
    book = ProfileBook(gen + other)
    assert book.betas.by_model == {"gen": pytest.approx(0.6)}
    assert book.betas.book == pytest.approx(0.6)
    # below the smallest profiled share: moved from it with the model's own beta
    quarter = book.lookup("gen", 1, 0.25)
    assert quarter.scaled_from == 0.5 and quarter.beta == pytest.approx(0.6)
    assert quarter.uncertainty == pytest.approx(K_MODEL * math.log(2.0))
    half = float(book.lookup("gen", 1, 0.5).latency(0.0))
    assert float(quarter.latency(0.0)) == pytest.approx(half * 2**0.6)
    # a model without pairs takes the book's
    ver = book.lookup("ver", 1, 0.5)
    assert ver.beta == pytest.approx(0.6)
    assert ver.uncertainty == pytest.approx(K_BOOK * math.log(2.0))
    # a book without pairs, the default
    alone = ProfileBook(other).lookup("ver", 1, 0.5)
    assert alone.beta == DEFAULT_BETA
    assert alone.uncertainty == pytest.approx(K_DEFAULT * math.log(2.0))


def test_the_excess_moves_by_the_pairs_delta_not_by_the_capacity() -> None:
    # the half share: light load 2^0.6 slower, the excess at equal utilisation 2^0.3 larger
    # (measured alone, each share with nothing else on its GPU)
    half = queue(share=0.5, saturation=5.0, light=2**0.6, blowup=0.5 * 2**0.3 / 2**0.6)
    points = [replace(p, colocation="alone") for p in queue() + half + queue("ver", light=0.5)]
    book = ProfileBook(points, alone_ends=True)  # the alone end of a book with both
    delta = book.betas.delta_by_model["gen"]
    assert delta == pytest.approx(0.3, abs=0.03)
    assert book.betas.delta_book == delta
    measured, quarter = book.lookup("gen", 1, 0.5), book.lookup("gen", 1, 0.25)
    # capacity: by the alone pair's gamma (here 1: the half share serves half)
    assert quarter.saturation == pytest.approx(measured.saturation / 2)

    def excess(p: Profile, rho: float) -> float:
        return float(p.latency(rho * p.saturation)) - float(p.lat["mean"][0])

    for rho in (0.4, 0.8):
        assert excess(quarter, rho) == pytest.approx(excess(measured, rho) * 2**delta)
    # a model without pairs takes the book's; packed shares (contended next to busy copies),
    # and a book without pairs, move it with the capacity
    ver = book.lookup("ver", 1, 0.5)
    assert excess(ver, 0.8) == pytest.approx(excess(book.lookup("ver", 1, 1.0), 0.8) * 2**delta)
    packed = ProfileBook(queue() + half)
    assert packed.betas.delta_by_model == {}
    lone, whole = packed.lookup("gen", 1, 0.25), packed.lookup("gen", 1, 0.5)
    assert excess(lone, 0.8) == pytest.approx(excess(whole, 0.8) * 2)


def test_noisy_pairs_are_clipped_to_a_physical_beta() -> None:
    faster = ProfileBook(queue() + queue(share=0.5, saturation=5.0, light=0.9))
    slower = ProfileBook(queue() + queue(share=0.5, saturation=5.0, light=5.0))
    assert faster.betas.by_model["gen"] == 0.0  # a share is never faster at light load
    assert slower.betas.by_model["gen"] == 1.0  # nor slower than in proportion


def test_uncertainty_grows_with_the_distance_to_a_profiled_share() -> None:
    book = ProfileBook(queue())
    u = [book.lookup("gen", 1, s).uncertainty for s in (1.0, 0.75, 0.5, 0.25, 0.1)]
    assert u[0] == 0 and all(a < b for a, b in itertools.pairwise(u))
    # scaled up beyond the largest profiled share, wider than scaled down as far
    up = ProfileBook(queue(share=0.5, saturation=5.0)).lookup("gen", 1, 1.0)
    assert up.uncertainty == pytest.approx(EXTRAPOLATE * K_DEFAULT * math.log(2.0))
    assert up.saturation == pytest.approx(10.0)
    # between two profiled shares: a bridge, 0 at both ends, widest in the middle
    pair = ProfileBook(queue() + queue(share=0.25, saturation=2.5, light=1.5))
    mids = [pair.lookup("gen", 1, s).uncertainty for s in (0.3, 0.5, 0.8)]
    assert mids[1] == pytest.approx(K_PAIR * math.log(2.0) ** 2 / math.log(4.0))
    assert mids[0] < mids[1] and mids[2] < mids[1]
    assert max(mids) < book.lookup("gen", 1, 0.5).uncertainty


def test_live_points_narrow_the_uncertainty_of_their_own_key() -> None:
    plain = ProfileBook(mm1()).lookup("gen", 1, 0.5)
    pts = [live(1.0, 1.0, share=0.5, t=1000.0 + i) for i in range(3)]
    got = ProfileBook([*mm1(), *pts]).lookup("gen", 1, 0.5)
    assert got.corrected_by == 3
    assert got.uncertainty == pytest.approx(plain.uncertainty / 2.0)


def test_the_pessimistic_curve_is_the_curve_run_slower() -> None:
    prof = ProfileBook(queue()).lookup("gen", 1, 0.5)
    slow = prof.pessimistic()
    s = 1 + prof.uncertainty
    assert slow.saturation == pytest.approx(prof.saturation / s)
    lam = np.array([0.1, 1.0, 2.0, 3.0])
    assert slow.latency(lam) == pytest.approx(prof.latency(lam * s) * s)
    whole = ProfileBook(queue()).lookup("gen", 1, 1.0)
    assert whole.pessimistic() is whole


shares = st.floats(0.05, 0.99)


@settings(max_examples=60, deadline=None)
@given(
    share=shares,
    light=st.floats(0.01, 5.0),
    blowup=st.floats(0.05, 3.0),
    saturation=st.floats(0.5, 200.0),
    half_ratio=st.floats(0.2, 0.5),
    half_light=st.floats(1.0, 2.0),  # physical: at most 1/share slower
)
def test_a_share_never_serves_more_than_its_part_of_the_whole_gpu(
    share: float,
    light: float,
    blowup: float,
    saturation: float,
    half_ratio: float,
    half_light: float,
) -> None:
    whole = queue(saturation=saturation, light=light, blowup=blowup)
    t_whole = Profile.from_points(whole).saturation
    l_whole = float(Profile.from_points(whole).latency(0.0))  # its lightest point's reading
    half = queue(
        share=0.5, saturation=half_ratio * saturation, light=light * half_light, blowup=blowup
    )
    for book in (ProfileBook(whole), ProfileBook(whole + half)):
        got = book.lookup("gen", 1, share)
        assert got.saturation <= share * t_whole * (1 + 1e-9)
        assert got.uncertainty >= 0
        lam = np.linspace(0, 1, 40) * got.saturation
        lat = got.latency(lam)
        finite = lat[np.isfinite(lat)]
        assert len(finite) >= 39 and np.all(np.diff(finite) >= -1e-12)
        # a share slows light load, never by more than in proportion
        assert l_whole * (1 - 1e-9) <= float(got.latency(0.0)) <= l_whole / share * (1 + 1e-9)

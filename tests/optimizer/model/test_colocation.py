"""optimizer.model.colocation: a placed replica's curve between its alone and packed profiles."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optimizer.model import alp, colocation
from optimizer.model.alp import ModelAlloc, Pipeline, Stage
from optimizer.model.colocation import (
    Ends,
    Placed,
    busy_probability,
    capacity_weights,
    ends,
    settle,
    weights,
)
from optimizer.model.curves import Profile, ProfileBook
from optimizer.model.shares import blend
from shared.profile_points import ProfilePoint
from tests.optimizer.model.test_shares import queue

pytestmark = pytest.mark.timeout(60)


def tagged(points: list[ProfilePoint], colocation: str) -> list[ProfilePoint]:
    return [replace(p, colocation=colocation) for p in points]


def two_ends(model: str = "gen", share: float = 0.5) -> list[ProfilePoint]:
    """A share measured alone (fast: light 1 s, 10 calls/s) and packed next to a busy copy
    (light 1.6 s, 7 calls/s), plus the whole GPU."""
    return (
        tagged(queue(model, share, saturation=10.0, light=1.0), "alone")
        + tagged(queue(model, share, saturation=7.0, light=1.6), "packed")
        + tagged(queue(model, 1.0, saturation=16.0, light=0.9), "alone")
    )


def test_the_ends_are_the_measured_curves() -> None:
    a = Profile.from_points(tagged(queue(light=1.0), "alone"))
    p = Profile.from_points(tagged(queue(saturation=7.0, light=1.6), "packed"))
    assert blend(a, p, 0.0) is a
    assert blend(a, p, 1.0) is p


@settings(max_examples=60, deadline=None)
@given(st.floats(0.01, 0.99), st.floats(0.0, 1.2))
def test_a_blend_lies_between_the_ends_at_equal_utilisation(w: float, rho: float) -> None:
    a = Profile.from_points(queue(saturation=10.0, light=1.0))
    p = Profile.from_points(queue(saturation=7.0, light=1.6))
    b = blend(a, p, w)
    assert p.saturation <= b.saturation <= a.saturation
    lat = b.latency(rho * b.saturation)
    lo, hi = sorted((float(a.latency(rho * a.saturation)), float(p.latency(rho * p.saturation))))
    if np.isfinite(lat):
        assert lo - 1e-9 <= float(lat) <= hi + 1e-9
    curve = b.latency(np.linspace(0.0, b.saturation * 1.1, 50))
    finite = curve[np.isfinite(curve)]
    assert np.all(np.diff(finite) >= 0) and np.isinf(curve[-1])  # still a curve


def test_busy_probability() -> None:
    assert busy_probability(0.0, 5.0) == 0.0
    assert busy_probability(1.0, float("inf")) == 1.0
    assert busy_probability(2.0, 0.5) == pytest.approx(1 - np.exp(-1.0))
    # four calls of a request at once keep the replica busy once
    assert busy_probability(2.0, 0.5, parallel=4.0) == pytest.approx(1 - np.exp(-0.25))


def test_weights_read_the_packed_profile_where_the_placement_reproduces_it() -> None:
    # a half share measured packed next to one copy: two busy copies draw 1.6 of the GPU
    half = Ends(demand=0.8, contended=1.6, copies=2, share=0.5)
    twins = [Placed("gen", "n", (0,), 0.5), Placed("gen", "n", (0,), 0.5)]
    for b in (0.2, 0.7, 1.0):
        assert weights(twins, {"gen": b}, {"gen": half}) == {"gen": pytest.approx(1.0)}
    # beside an idle neighbour, or on a GPU of its own: the alone end
    mixed = [Placed("gen", "n", (0,), 0.5), Placed("emb", "n", (0,), 0.25)]
    ends = {"gen": half, "emb": Ends(demand=0.4, share=0.25)}
    assert weights(mixed, {"gen": 0.8, "emb": 0.0}, ends)["gen"] == 0.0
    apart = [Placed("gen", "n", (0,), 0.5), Placed("emb", "n", (1,), 0.25)]
    assert weights(apart, {"gen": 0.8, "emb": 1.0}, ends)["gen"] == 0.0
    # a busy quarter share draws its own demand (0.4): capacity alone / (0.8 + 0.4),
    # between the ends
    w = weights(mixed, {"gen": 1.0, "emb": 1.0}, ends)["gen"]
    assert 1.6**w == pytest.approx(1.2)
    # more contention than the profile saw (its copy busy 30% of the time: 0.8 x 1.3) is
    # the packed end slowed by the excess: 1 + ln(1.6 / 1.04); emb at 0.5 draws 0.4 x 2
    even = [Placed("gen", "n", (0,), 0.5), Placed("emb", "n", (0,), 0.5)]
    got = weights(even, {"gen": 0.3, "emb": 1.0}, ends)["gen"]
    assert got == pytest.approx(1.0 + math.log(1.6 / 1.04))
    # a derived end stands for its own contention (here a quarter share drawing 0.25^0.5)
    quarter = Ends(demand=0.5, contended=2.0, exponent=0.5, share=0.25)
    derived = {"q": quarter, "x": quarter, "y": quarter}
    quarters = [Placed("q", "n", (0,), 0.25), Placed("x", "n", (0,), 0.25)]
    assert weights(quarters, {"q": 1.0, "x": 1.0}, derived)["q"] == pytest.approx(0.0)
    quarters.append(Placed("y", "n", (0,), 0.25))
    got = weights(quarters, {"q": 1.0, "x": 1.0, "y": 1.0}, derived)["q"]
    assert 2.0**got == pytest.approx(1.5)
    # a neighbour whose model has no ends draws its share
    assert weights(quarters[:2], {"q": 1.0, "x": 1.0}, {"q": quarter})["q"] == 0.0
    # tensor parallel: the busiest of its GPUs
    tp = [Placed("big", "n", (0, 1), 0.5, tp=2), Placed("emb", "n", (1,), 0.5)]
    big = {"big": Ends(demand=0.7, contended=1.4, share=0.5), "emb": Ends(demand=0.7, share=0.5)}
    assert weights(tp, {"big": 0.5, "emb": 1.0}, big)["big"] == 1.0


def test_a_busy_neighbour_draws_its_own_demand() -> None:
    beside = [Placed("v", "n", (0,), 0.75), Placed("small", "n", (0,), 0.25)]
    busy = {"v": 1.0, "small": 1.0}
    memory = {"v": Ends(demand=0.75**0.3, contended=2.0, exponent=0.3, share=0.75)}
    bandwidth = Ends(demand=0.25**0.3, exponent=0.3, share=0.25)  # a memory-bound small model
    c = 0.75**0.3 + 0.25**0.3
    assert 2.0 ** weights(beside, busy, memory | {"small": bandwidth})["v"] == pytest.approx(c)
    sms = Ends(demand=0.25, exponent=1.0, share=0.25)  # a compute-bound one draws less
    c = 0.75**0.3 + 0.25
    assert 2.0 ** weights(beside, busy, memory | {"small": sms})["v"] == pytest.approx(c)
    # a big model whose alone shares are bound by their KV memory (exponent 1, so demand
    # 0.75) does not take a busy memory-bound neighbour for free: past its packed end
    kv = {"v": Ends(demand=0.75, contended=1.3, exponent=1.0, share=0.75), "small": bandwidth}
    got = weights(beside, busy, kv)["v"]
    assert got == pytest.approx(1.0 + math.log((0.75 + 0.25**0.3) / 1.3))
    # a neighbour at another share than its ends' moves by its own exponent
    eighth = [Placed("v", "n", (0,), 0.75), Placed("small", "n", (0,), 0.125)]
    got = weights(eighth, busy, memory | {"small": bandwidth})["v"]
    assert 2.0**got == pytest.approx(0.75**0.3 + 0.125**0.3)


def test_ends_come_from_the_book() -> None:
    book = ProfileBook(two_ends("gen") + tagged(queue("big", 1.0, saturation=20.0), "alone"))
    measured = ends(book, "gen", 1, 0.5)
    assert measured.copies == 2
    assert measured.contended == pytest.approx(10.0 / 7.0, rel=1e-3)
    assert measured.demand == pytest.approx(measured.contended / 2)
    derived = ends(book, "big", 1, 0.5)
    gamma = book.alone.betas.for_model("big").gamma if book.alone else 1.0
    assert (derived.copies, derived.demand) == (0, pytest.approx(0.5**gamma))
    assert derived.exponent == measured.exponent == gamma
    assert derived.contended == pytest.approx(0.5 ** (gamma - 1.0), rel=1e-3)
    assert (measured.share, derived.share) == (0.5, 0.5)
    assert ends(ProfileBook(queue("gen", 0.5)), "gen", 1, 0.5) == Ends(0.5, share=0.5)


def test_the_book_blends_only_where_a_key_was_measured_both_ways() -> None:
    legacy = ProfileBook(queue("gen", 0.5, light=1.6))
    assert legacy.alone is None
    assert legacy.lookup("gen", 1, 0.5, busy=0.0) is legacy.lookup("gen", 1, 0.5)
    book = ProfileBook(two_ends())
    packed = book.lookup("gen", 1, 0.5)
    assert packed.saturation == pytest.approx(7.0, rel=1e-3)  # the default is the packed end
    alone = book.lookup("gen", 1, 0.5, busy=0.0)
    assert alone.saturation == pytest.approx(10.0, rel=1e-3)
    assert float(alone.latency(1.0)) < float(packed.latency(1.0))
    assert book.lookup("gen", 1, 0.5, busy=1.0).saturation == pytest.approx(7.0, rel=1e-3)
    half = book.lookup("gen", 1, 0.5, busy=0.5)
    assert 7.0 < half.saturation < 10.0
    # a share that was not profiled blends the two ends derived to it
    quarter_alone = book.lookup("gen", 1, 0.25, busy=0.0)
    quarter_packed = book.lookup("gen", 1, 0.25, busy=1.0)
    assert quarter_alone.saturation > quarter_packed.saturation
    assert quarter_packed.saturation == pytest.approx(book.lookup("gen", 1, 0.25).saturation)


def test_contention_past_the_packed_end_slows_the_packed_curve_in_time() -> None:
    book = ProfileBook(two_ends())
    packed = book.lookup("gen", 1, 0.5, busy=1.0)
    beyond = book.lookup("gen", 1, 0.5, busy=1.0 + math.log(1.25))
    # (weights are read to 1e-3)
    assert beyond.saturation == pytest.approx(packed.saturation / 1.25, rel=1e-3)
    for rho in (0.2, 0.5, 0.8):
        assert float(beyond.latency(rho * beyond.saturation)) == pytest.approx(
            1.25 * float(packed.latency(rho * packed.saturation)), rel=1e-3
        )


def test_a_share_measured_alone_demands_what_it_serves_of_the_whole_gpu() -> None:
    # three quarters measured alone serving 0.85 of the whole GPU, a half serving 0.49: the
    # pairs fit a capacity exponent of 1 (clipped), yet the 0.75 share draws 0.85, not 0.75
    points = (
        tagged(
            queue("big", 1.0, saturation=20.0)
            + queue("big", 0.75, saturation=17.0)
            + queue("big", 0.5, saturation=9.8),
            "alone",
        )
        + tagged(queue("gen", 0.5, saturation=7.0), "packed")
        + tagged(queue("gen", 0.5, saturation=10.0), "alone")
    )
    book = ProfileBook(points)
    assert book.alone is not None and book.alone.betas.for_model("big").gamma == 1.0
    assert ends(book, "big", 1, 0.75).demand == pytest.approx(0.85, rel=1e-3)
    assert ends(book, "big", 1, 0.5).demand == pytest.approx(0.49, rel=1e-3)
    # a share not measured: moved from the nearest measured one by the share model's exponent
    assert ends(book, "big", 1, 0.25).demand == pytest.approx(0.49 * 0.5, rel=1e-3)


def test_a_mixed_allocation_weighs_its_rest_replica_not_its_whole_gpus() -> None:
    half = Ends(demand=0.8, contended=1.6, copies=2, share=0.5)
    light = Ends(demand=0.4, share=0.5)
    beside = [Placed("gen", "n", (0,), 0.5), Placed("emb", "n", (0,), 0.5)]
    mixed = [*(Placed("gen", "n", (g,), 1.0) for g in (1, 2, 3)), *beside]
    ends = {"gen": half, "emb": light}
    alone = weights(beside, {"gen": 1.0, "emb": 1.0}, ends)["gen"]
    assert 0.0 < alone == weights(mixed, {"gen": 1.0, "emb": 1.0}, ends)["gen"]


def test_a_key_measured_only_alone_is_its_own_curve() -> None:
    book = ProfileBook(tagged(queue("gen", 0.5, saturation=9.0), "alone"))
    assert book.lookup("gen", 1, 0.5).saturation == pytest.approx(9.0, rel=1e-3)


def test_live_points_correct_the_blended_curve() -> None:
    live = ProfilePoint(
        "gen", "emulator", "H100", 1, 0.5, 2.0, 2.0, 3.0, 2.4, 4.5, 6.0, 0.2, 40,
        source="live", observed_at=100.0,
    )  # fmt: skip
    book = ProfileBook([*two_ends(), live])
    corrected = book.lookup("gen", 1, 0.5, busy=0.0)
    assert corrected.corrected_by == 1
    assert float(corrected.latency(2.0)) == pytest.approx(3.0, rel=0.02)


def test_settle_reads_idle_neighbours_as_alone_and_busy_copies_as_packed() -> None:
    book = ProfileBook(two_ends("gen") + two_ends("emb"))
    beside_idle = [Placed("gen", "n", (0,), 0.5), Placed("emb", "n", (0,), 0.5)]
    w = settle(book, beside_idle, {"gen": 3.0, "emb": 0.0})
    assert w["gen"] == 0.0
    # a lightly loaded replica beside a busy one: the busy one runs close to alone; the light
    # one sees more contention than its packed profile saw at that load (its copy as lightly
    # loaded as itself), so it reads the packed curve slowed (a weight above 1)
    w = settle(book, beside_idle, {"gen": 3.0, "emb": 0.3})
    assert w["gen"] < 0.25 and w["emb"] > 1.0
    twins = [Placed("gen", "n", (0,), 0.5), Placed("gen", "n", (0,), 0.5)]
    assert settle(book, twins, {"gen": 3.0}) == {"gen": 1.0}
    # both busy: somewhere between, and the more loaded neighbour weighs more
    w = settle(book, beside_idle, {"gen": 3.0, "emb": 1.0})
    assert 0.0 < w["gen"] < 1.0 < w["emb"]
    assert colocation.SETTLE_ROUNDS >= 2


def test_capacity_reads_neighbours_as_busy_as_the_workflow_at_its_capacity() -> None:
    book = ProfileBook(two_ends("gen") + two_ends("emb"))
    pipe = Pipeline("wf", (Stage("gen", 1.0, 1.0), Stage("emb", 1.0, 1.0)), 1.0, 0.0)
    allocation = {"gen": ModelAlloc(1, 1, 0.5), "emb": ModelAlloc(1, 1, 0.5)}
    together = [Placed("gen", "n", (0,), 0.5), Placed("emb", "n", (0,), 0.5)]
    apart = [Placed("gen", "n", (0,), 0.5), Placed("emb", "n", (1,), 0.5)]
    packed = alp.predict(pipe, book, allocation, 0.0).throughput
    shared = alp.predict(
        pipe, book, allocation, 0.0, busy=capacity_weights(pipe, book, allocation, together)
    ).throughput
    alone = alp.predict(
        pipe, book, allocation, 0.0, busy=capacity_weights(pipe, book, allocation, apart)
    ).throughput
    # at capacity both are busy: two models sharing a GPU read (nearly) as packed; on GPUs
    # of their own, as measured alone
    assert packed == pytest.approx(7.0, rel=1e-3)
    assert shared < 0.5 * (packed + alone)
    assert alone == pytest.approx(10.0, rel=1e-3)


def test_a_share_derived_alone_keeps_more_than_its_part_and_a_packed_one_never() -> None:
    # the alone ends: a half share serves 10 of the whole GPU's 16 calls/s (gamma ~0.68)
    book = ProfileBook(two_ends("gen") + tagged(queue("big", 1.0, saturation=20.0), "alone"))
    assert book.alone is not None
    gamma = book.alone.betas.for_model("big").gamma
    assert gamma == pytest.approx(np.log(16.0 / 10.0) / np.log(2.0), rel=1e-3)
    assert book.betas.for_model("big").gamma == 1.0  # packed: never more than its part
    alone = book.lookup("big", 1, 0.5, busy=0.0)
    packed = book.lookup("big", 1, 0.5, busy=1.0)
    assert packed.saturation == pytest.approx(10.0, rel=1e-3)
    assert alone.saturation == pytest.approx(20.0 * 0.5**gamma, rel=1e-3)
    assert float(alone.latency(5.0)) < float(packed.latency(5.0))


def test_a_share_measured_only_alone_takes_its_part_of_the_gpu_beside_busy_neighbours() -> None:
    # three quarters measured alone (one copy fills its GPU): packed, it gets no more than its
    # part of the whole GPU, bridged from the packed half (7 calls/s) and the whole (16)
    three = tagged(queue("gen", 0.75, saturation=14.0, light=0.95), "alone")
    book = ProfileBook(two_ends("gen") + three)
    assert book.lookup("gen", 1, 0.75).saturation == pytest.approx(14.0, rel=1e-3)
    assert book.lookup("gen", 1, 0.75, busy=0.0).saturation == pytest.approx(14.0, rel=1e-3)
    packed = book.lookup("gen", 1, 0.75, busy=1.0).saturation
    assert 7.0 * 1.5 <= packed <= 16.0 * 0.75
    e = ends(book, "gen", 1, 0.75)
    assert e.copies == 0 and e.contended == pytest.approx(14.0 / packed, rel=1e-3)

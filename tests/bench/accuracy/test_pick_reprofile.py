"""bench.accuracy.pick_reprofile: the keys the daemon's reprofiler would profile for a judged
allocation, by the product's own rule."""

from __future__ import annotations

import pytest

from bench.accuracy.pick_reprofile import wanted
from optimizer.control.reprofile import WantedKey, uncovered
from optimizer.model.curves import ProfileBook
from shared.optimizer_settings import ReprofileSettings
from shared.profile_points import ProfileKey
from tests.bench.accuracy.test_alp_picks import B1, G8, _points

pytestmark = pytest.mark.timeout(30)


def test_wanted_keys_are_every_group_of_every_model() -> None:
    got = wanted([{G8: (2, 1, 1.0, 1, 0.5), B1: (1, 1, 0.25)}, {G8: (1, 2, 1.0)}], "a6000")
    assert got == [
        WantedKey(G8, "a6000", 1, 0.5),
        WantedKey(G8, "a6000", 1, 1.0),
        WantedKey(G8, "a6000", 2, 1.0),
        WantedKey(B1, "a6000", 1, 0.25),
    ]


def test_only_a_share_whose_exponents_are_borrowed_is_uncovered() -> None:
    book = ProfileBook(_points())  # the 8B whole (TP 1 and 2), the 1B whole and at 0.5
    shipped = ReprofileSettings()
    keys = wanted([{B1: (1, 1, 0.25), G8: (1, 1, 0.75)}, {G8: (1, 2, 1.0)}], "a6000")
    named = [k for k in keys if uncovered(book.profiles, k, shipped)]
    # the 1B's 0.25 is scaled from its own 0.5 (its own exponents): covered by default
    assert named == [WantedKey(G8, "a6000", 1, 0.75)]
    assert uncovered(book.profiles, WantedKey(G8, "h100", 1, 1.0), shipped)  # another GPU


def test_copies_the_simulator_packs_onto_one_gpu_are_counted_and_named_packed() -> None:
    (half,) = wanted([{G8: (2, 1, 0.5)}], "a6000")
    assert half == WantedKey(G8, "a6000", 1, 0.5, copies=2)
    # three 0.5 copies: two share a GPU, the third is alone on the next
    assert wanted([{G8: (3, 1, 0.5)}], "a6000")[0].copies == 2
    book = ProfileBook(_points())  # the 1B's 0.5 measured packed, the 8B whole only
    shipped = ReprofileSettings()
    measured_alone = [*book.profiles, ProfileKey(G8, "", "a6000", 1, 0.5)]
    assert uncovered(measured_alone, half, shipped, book.packed)
    (one_b,) = wanted([{B1: (2, 1, 0.5)}], "a6000")
    assert one_b.copies == 2 and not uncovered(book.profiles, one_b, shipped, book.packed)

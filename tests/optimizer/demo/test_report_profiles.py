"""The demo report's profile section: replay vs live points per model, and what they corrected."""

from __future__ import annotations

from dataclasses import replace

from optimizer.demo.report import profile_sources
from shared.profile_points import ProfilePoint


def _p(model: str, rate: float, share: float = 1.0) -> ProfilePoint:
    return ProfilePoint(model, "e", "a6000", 1, share, rate, rate, 1.0, 1.0, 1.2, 1.5, 0.1, 50)


def test_each_model_counts_its_replay_and_live_points_and_names_corrected_curves() -> None:
    replay = [_p("a", r) for r in (1.0, 2.0, 3.0)]
    live = [replace(_p("a", 2.0, share=0.5), lat_mean=0.5, source="live", observed_at=9.0)]
    orphan = [replace(_p("b", 1.0), source="live", observed_at=9.0)]  # no replayed curve
    got = profile_sources(replay + live + orphan)
    assert got == {
        "a": {"replay": 3, "live": 1, "corrected": ["tp1/0.5"]},
        "b": {"replay": 0, "live": 1, "corrected": []},
    }

"""The demo report's profile sections: replay vs live points per model, what they corrected, and
the profiling runs the daemon started."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from optimizer.control.reprofile import ReprofileRun
from optimizer.demo.report import profile_sources, report_doc, write_report
from shared.profile_points import ProfilePoint


def _p(model: str, rate: float, share: float = 1.0) -> ProfilePoint:
    return ProfilePoint(model, "e", "a6000", 1, share, rate, rate, 1.0, 1.0, 1.2, 1.5, 0.1, 50)


def test_each_model_counts_its_replay_and_live_points_and_names_corrected_curves() -> None:
    replay = [_p("a", r) for r in (1.0, 2.0, 3.0)]
    live = [replace(_p("a", 2.0), lat_mean=0.5, source="live", observed_at=9.0)]
    orphan = [replace(_p("b", 1.0), source="live", observed_at=9.0)]  # no replayed curve
    # a half share measured packed and alone; a whole GPU "alone" is no second end
    ends = [replace(_p("c", 1.0, 0.5), colocation=c) for c in ("packed", "alone", "alone")]
    ends.append(replace(_p("c", 2.0), colocation="alone"))
    got = profile_sources(replay + live + orphan + ends)
    (fixed,) = got["a"].pop("corrected")
    assert got == {
        "a": {"replay": 3, "replay_alone": 0, "live": 1},
        "b": {"replay": 0, "replay_alone": 0, "live": 1, "corrected": []},
        "c": {"replay": 4, "replay_alone": 2, "live": 0, "corrected": []},
    }
    # the live replica read half the flat curve's latency: twice its speed
    assert fixed == "tp1/1 x2.00"


@pytest.mark.timeout(60)
def test_the_report_lists_the_profiling_runs_the_daemon_started(tmp_path: Path) -> None:
    runs = [
        ReprofileRun("e5", "a6000", 1, 1.0, "no_profile", started=1010.0, finished=1050.5),
        ReprofileRun("gen", "a6000", 1, 0.5, "drift", started=1100.0),
    ]
    doc = report_doc([], [], [], {"bootstrap_ready": 0.0}, {}, 1000.0, (), runs)
    assert doc["reprofiles"] == [
        {"model": "e5", "key": "a6000/tp1/1", "reason": "no_profile", "started": 10.0,
         "finished": 50.5},
        {"model": "gen", "key": "a6000/tp1/0.5", "reason": "drift", "started": 100.0,
         "finished": None},
    ]  # fmt: skip
    write_report(tmp_path, doc, [])
    text = (tmp_path / "report.md").read_text()
    assert "| e5 | a6000/tp1/1 | no_profile | 10 | 50 |" in text
    assert "| gen | a6000/tp1/0.5 | drift | 100 | - |" in text
    quiet = report_doc([], [], [], {"bootstrap_ready": 0.0}, {}, 1000.0)
    write_report(tmp_path, quiet, [])
    assert "None: every model in traffic had a profile" in (tmp_path / "report.md").read_text()

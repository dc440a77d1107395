"""The demo report compares a prediction with an observation only over a window one allocation
served whole: a window a rollout ran in is left out, and later ones carry the new label."""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

import pytest

from optimizer.control.decide import Decision
from optimizer.daemon.service import TickReport
from optimizer.demo.report import Pass, report_doc
from optimizer.stats.figures import WorkflowStats
from tests.optimizer.control.test_step import _stats

WINDOW_S = 10.0


def _pass(t: float, taken: bool = False) -> Pass:
    stats: dict[str, WorkflowStats] = {
        w: replace(s, latency_mean=2.0) for w, s in _stats(1.0, workflow="w").items()
    }
    decision = Decision(t, "rollout" if taken else "steady", ())
    report = TickReport(
        decision,
        MappingProxyType(stats),
        WINDOW_S,
        {},
        {"w": 2.2},
        outcome="ok" if taken else None,
        rollout_s=4.0 if taken else None,
    )
    return Pass(t, report)


def test_windows_a_rollout_ran_in_are_left_out() -> None:
    # A rollout starts at t=30 and ends at 34; windows are the 10 s before each pass.
    passes = [_pass(t, taken=t == 30.0) for t in (10.0, 20.0, 30.0, 40.0, 50.0, 60.0)]
    doc = report_doc(passes, [], [], {"bootstrap_ready": 0.0}, {}, 0.0)
    rows = [(r["t"], r["allocation"]) for r in doc["predicted_vs_observed"]]
    # 10: its window [0, 10] served the bootstrap whole; 30: the pass that rolled out, its
    # window before the rollout; 40: [30, 40] holds the rollout (left out); 50, 60: after it.
    assert rows == [
        (10.0, "bootstrap"),
        (20.0, "bootstrap"),
        (30.0, "bootstrap"),
        (50.0, "rollout 1"),
        (60.0, "rollout 1"),
    ]
    assert all(abs(r["error"] - 0.1) < 1e-9 for r in doc["predicted_vs_observed"])
    # Judged: windows starting after the first full window of their allocation ([0, 10] for
    # the bootstrap, [34, 44] for the rollout): t=20, 30 and 60.
    judged = [r["t"] for r in doc["predicted_vs_observed"] if r["judged"]]
    assert judged == [20.0, 30.0, 60.0]
    assert doc["accuracy"] == {"w": {"median_abs_error": pytest.approx(0.1), "windows": 3}}


def test_the_first_window_of_traffic_is_not_judged() -> None:
    """Load starts at t=5 on a bootstrap ready at 0: the daemon's first full window of traffic
    is [5, 15], so windows from t=15 on are judged (the pass at t=30 and later)."""
    passes = [_pass(t) for t in (10.0, 20.0, 30.0, 40.0)]
    doc = report_doc(passes, [], [], {"bootstrap_ready": 0.0, "load_started": 5.0}, {}, 0.0)
    judged = [r["t"] for r in doc["predicted_vs_observed"] if r["judged"]]
    assert judged == [30.0, 40.0]

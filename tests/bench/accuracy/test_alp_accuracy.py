"""The ALP accuracy bench's measurement helpers: a mean latency's standard error, quick cases."""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import orjson
import pytest

from bench.accuracy.alp_accuracy import (
    CAP_MIN_REQUESTS,
    CAP_MIN_REQUESTS_QUICK,
    QUICK_ALLOCATIONS,
    _cases,
    _profile_docs,
    _reused_points,
    quick_cases,
)
from bench.accuracy.alp_truth import mean_and_se, simulated_capacity
from shared.profile_points import ProfilePoint
from sim.profiling import ProfileJob


def test_mean_and_se_batch_means() -> None:
    rng = np.random.default_rng(0)
    values = rng.exponential(2.0, 4000)
    mean, se = mean_and_se(list(values))
    assert mean == pytest.approx(2.0, rel=0.08)
    assert se == pytest.approx(2.0 / np.sqrt(4000), rel=0.6)
    assert mean_and_se([1.0, 2.0])[1] == float("inf")


def test_quick_is_smaller_and_the_full_run_keeps_long_windows() -> None:
    full = _cases()
    quick = quick_cases(full)
    assert [c.workflow for c in quick] == [c.workflow for c in full]
    for f, q in zip(full, quick, strict=True):
        assert len(q.allocations) == min(QUICK_ALLOCATIONS, len(f.allocations))
        assert q.eval_requests < f.eval_requests
        assert q.capacity_requests == CAP_MIN_REQUESTS_QUICK < f.capacity_requests
        # the truth the full run's errors are taken against stays as precise as it needs
        assert f.capacity_requests >= CAP_MIN_REQUESTS


def test_simulated_capacity_is_what_was_completed_not_the_rate_offered() -> None:
    # kept up (within the 5% tolerance) at 10/s while completing 9.6/s; overloaded at 11/s
    probes = [(9.0, True, 9.0), (10.0, True, 9.6), (11.0, False, 9.7)]
    assert simulated_capacity(probes, backlog=9.2) == pytest.approx(9.6)
    # a standing backlog that completes more than any probe that kept up counts
    assert simulated_capacity(probes, backlog=10.4) == pytest.approx(10.4)
    assert simulated_capacity([(5.0, False, 4.0)], backlog=4.5) == pytest.approx(4.5)


def test_reused_profile_points_are_keyed_by_workflow(tmp_path: Path) -> None:
    # The same model is profiled under each workflow's own call mix: an earlier run's points
    # come back under (workflow, model, tp, share), never mixed across workflows.
    def point(share: float, rate: float) -> ProfilePoint:
        return ProfilePoint(
            "llama-3.2-1b",
            "sim-engine",
            "a6000",
            1,
            share,
            rate,
            rate,
            1.0,
            1.0,
            1.0,
            1.0,
            0.1,
            100,
        )

    doc = {
        "profile_points": [
            {"workflow": "beam", **asdict(point(1.0, 5.0))},
            {"workflow": "fanout", **asdict(point(1.0, 7.0))},
            {"workflow": "fanout", **asdict(point(0.5, 3.0))},
        ]
    }
    path = tmp_path / "alp_accuracy.json"
    path.write_bytes(orjson.dumps(doc))
    reused = _reused_points(path)
    assert reused[("beam", "llama-3.2-1b", 1, 1.0, False)] == [point(1.0, 5.0)]
    assert reused[("fanout", "llama-3.2-1b", 1, 1.0, False)] == [point(1.0, 7.0)]
    assert reused[("fanout", "llama-3.2-1b", 1, 0.5, False)] == [point(0.5, 3.0)]
    assert _reused_points(None) == {}
    # a packed share's alone end comes back under its own key; a whole GPU's "alone" is no
    # second end
    alone = [
        replace(point(0.5, 4.0), colocation="alone"),
        replace(point(1.0, 9.0), colocation="alone"),
    ]
    doc = {"profile_points": [{"workflow": "beam", **asdict(p)} for p in alone]}
    path.write_bytes(orjson.dumps(doc))
    reused = _reused_points(path)
    assert reused[("beam", "llama-3.2-1b", 1, 0.5, True)] == alone[:1]
    assert reused[("beam", "llama-3.2-1b", 1, 1.0, False)] == alone[1:]


def test_profile_documents_read_back_as_the_points_they_hold(tmp_path: Path) -> None:
    # the checkpoint written once profiling ends feeds --profiles-from
    case = _cases()[2]
    jobs = [
        ProfileJob(case, m, tp, share, n_per_request=1.0, target_calls=100, start_rate=1.0)
        for m, tp, share in sorted(
            {(m, row[1], row[2]) for alloc in case.allocations for m, row in alloc.items()}
        )
    ]
    profiled = [
        [
            ProfilePoint(
                j.model, "sim-engine", "a6000", j.tp, j.share, r, r, 1.0, 1.0, 1.0, 1.0, 0.1, 100
            )
            for r in (1.0, 2.0)
        ]
        for j in jobs
    ]
    path = tmp_path / "profiles.json"
    path.write_bytes(orjson.dumps({"profile_points": _profile_docs(jobs, profiled)}))
    reused = _reused_points(path)
    assert len(reused) == len(jobs)
    for job, pts in zip(jobs, profiled, strict=True):
        assert reused[(case.workflow, job.model, job.tp, round(job.share, 6), False)] == pts

"""bench.accuracy.agent_path and bench.accuracy.agent_figures: the agent bench's pure pieces.

The bench itself runs for minutes against emulated engines (its smallest run profiles two
models, ~3 minutes); here its judgement of a run, the knee search on a fake workflow whose
capacity is known, the pipeline it builds from ``scepsy stats --json``, the spans it reads
from a store, and the report it writes.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from bench.accuracy.agent_figures import (
    GROWTH_LIMIT,
    Bracket,
    RunJudgement,
    Span,
    expected_calls,
    judge,
    knee_doc,
    mean_latency,
    next_rate,
    pipeline_from_stats,
    relative_error,
    summary,
)
from bench.accuracy.agent_path import FULL, QUICK, Run, profile_argv, spans
from examples.agent_loop import AgentConfig
from optimizer.cli.stats import to_json
from optimizer.model.alp import Pipeline
from optimizer.stats.reader import summarise_store
from shared.store import SegmentWriter
from tests.optimizer.conftest import S, call

pytestmark = pytest.mark.timeout(60)


def fifo_run(rate: float, capacity: float, duration: float, seed: int = 0) -> list[Span]:
    """A fake workflow: Poisson arrivals at ``rate``, 20 s of work each (the agent's latency
    near its knee), then served one after another at ``capacity`` per second (a backlog
    grows past it)."""
    rng = random.Random(seed)
    out, t, free = [], rng.expovariate(rate), 0.0
    while t < duration:
        free = max(free, t + 20.0) + 1.0 / capacity
        out.append(Span(t, free))
        t += rng.expovariate(rate)
    return out


def test_a_run_below_capacity_keeps_up_and_one_above_does_not() -> None:
    below = judge(fifo_run(4.0, 5.0, 300.0), 4.0, 300.0)
    assert below.kept_up
    assert below.shortfall < 0.05 and below.growth < GROWTH_LIMIT
    above = judge(fifo_run(5.5, 5.0, 300.0), 5.5, 300.0)
    assert not above.kept_up
    # a backlogged run completes at its capacity
    assert above.served_rate == pytest.approx(5.0, rel=0.03)


def test_the_knee_search_finds_a_fake_capacity_from_a_wrong_prediction() -> None:
    for predicted in (3.0, 5.0, 8.0):
        bracket, runs = Bracket(), 0
        while (rate := next_rate(bracket, predicted, 1.1, 0.05)) is not None and runs < 20:
            bracket = bracket.add(judge(fifo_run(rate, 5.0, 600.0, seed=runs), rate, 600.0))
            runs += 1
        assert bracket.closed(0.05)
        # the judgement misses an overload under ~5% (agent_figures.py): the knee reads up to ~7% high
        assert bracket.knee == pytest.approx(5.0, rel=0.08)


def test_next_rate_steps_then_bisects() -> None:
    assert next_rate(Bracket(), 4.0, 1.1, 0.05) == 4.0
    assert next_rate(Bracket(kept_up=4.0), 4.0, 1.1, 0.05) == pytest.approx(4.4)
    assert next_rate(Bracket(overloaded=4.0), 4.0, 1.1, 0.05) == pytest.approx(4.0 / 1.1)
    assert next_rate(Bracket(4.0, 4.84), 4.0, 1.1, 0.05) == pytest.approx(4.4)
    assert next_rate(Bracket(4.0, 4.1), 4.0, 1.1, 0.05) is None
    assert next_rate(Bracket(4.4, 4.0), 4.0, 1.1, 0.05) is None  # crossed by noise: stop
    with pytest.raises(ValueError):
        next_rate(Bracket(), 4.0, 1.0, 0.05)


def test_a_bracket_keeps_its_tightest_ends() -> None:
    def j(rate: float, kept: bool) -> RunJudgement:
        return RunJudgement(rate, 0, 1, 10, 10 if kept else 5, 0 if kept else 0.5, 1, 1, 1)

    b = Bracket().add(j(4.0, True)).add(j(3.0, True)).add(j(6.0, False)).add(j(5.0, False))
    assert (b.kept_up, b.overloaded) == (4.0, 5.0)
    assert b.knee == pytest.approx(math.sqrt(20.0))
    assert Bracket(kept_up=4.0).knee is None


def test_mean_latency_leaves_the_warm_up_out() -> None:
    runs = [Span(t, t + (10.0 if t < 25 else 2.0)) for t in range(100)]
    mean, se, n = mean_latency(runs, 100.0, 0.25)
    assert (mean, se, n) == (2.0, 0.0, 75)
    with pytest.raises(ValueError):
        mean_latency([Span(1.0, 2.0)], 100.0, 0.25)


def test_relative_error_is_nan_without_a_finite_measure() -> None:
    assert relative_error(11.0, 10.0) == pytest.approx(0.1)
    assert math.isnan(relative_error(math.inf, 10.0))
    assert math.isnan(relative_error(1.0, math.nan))


def test_expected_calls_of_the_agent_loop() -> None:
    fixed = AgentConfig(min_steps=3, max_steps=3, p_fan_out=0.5, fan_out=4)
    assert expected_calls(fixed) == {fixed.planner: 3.0, fixed.worker: 2 * 0.5 * 4}
    always = AgentConfig(min_steps=2, max_steps=6, p_stop=1.0)
    assert expected_calls(always)[always.planner] == 2.0
    # default: 2 steps, then each further one with probability 0.65, at most 6
    d = AgentConfig()
    want = 1 + sum(0.65 ** max(0, k - 2) for k in range(2, 7))
    assert expected_calls(d)[d.planner] == pytest.approx(want)


def _agent_store(path: Path) -> Path:
    rows = []
    for i in range(6):  # planner, worker fan-out beside a tool, planner
        t, rid = 10.0 * i, f"r{i}"
        rows += [
            call("agent", rid, "planner", t, t + 2),
            call("agent", rid, "worker", t + 2.5, t + 3),
            call("agent", rid, "worker", t + 2.5, t + 3.5),
            call("agent", rid, "planner", t + 4, t + 6),
        ]
    writer = SegmentWriter(path, "test")
    try:
        writer.write(rows)
    finally:
        writer.close()
    return path


def test_the_pipeline_from_stats_json_is_the_products_with_tool_time_in_model_time(
    tmp_path: Path,
) -> None:
    stats = summarise_store(_agent_store(tmp_path))
    doc = json.loads(json.dumps(to_json(stats)))["workflows"]["agent"]
    got = pipeline_from_stats("agent", doc, speedup=4.0)
    want = Pipeline.from_stats(stats["agent"])
    assert got.stages == want.stages and got.overlaps == want.overlaps
    assert got.overlap == pytest.approx(want.overlap)
    assert got.tool_time == pytest.approx(4.0 * want.tool_time)
    assert want.tool_time == pytest.approx(1.0)  # 0.5 s before the fan-out, 0.5 s after


def test_spans_are_model_seconds_from_the_run_start(tmp_path: Path) -> None:
    store = _agent_store(tmp_path)
    run = Run(1.0, 60.0, t_from_us=20 * S, t_to_us=70 * S, client={}, max_lag=0, load_average=0)
    got = sorted(spans(store, run, speedup=4.0), key=lambda s: s.arrival)
    assert [(s.arrival, s.end) for s in got] == [(4 * t, 4 * (t + 6)) for t in (0, 10, 20, 30)]


def test_the_report_has_every_field_and_finite_values() -> None:
    runs = [(fifo_run(r, 5.0, 300.0, seed=i), r) for i, r in enumerate((4.5, 5.5, 5.0))]
    probes = [({"rate": r}, judge(sp, r, 300.0)) for sp, r in runs]
    bracket = Bracket()
    for _, j in probes:
        bracket = bracket.add(j)
    knee = knee_doc(bracket, probes, 5.2, 0.05)
    doc = {
        "knee": knee,
        "predicted": {"capacity": 5.2},
        "latency": {"0.2": {"error": 0.05}, "0.5": {"error": -0.1}, "0.8": {"error": 0.12}},
    }
    got = summary(doc, 4.0)
    assert got["label"] == "emulated"
    for key in ("predicted_capacity", "emulated_knee", "capacity_error", "speedup"):
        assert math.isfinite(got[key]), key
    assert got["capacity_ok"] is (abs(got["capacity_error"]) <= 0.10)
    assert got["latency_ok"] is True
    assert knee["served_from_backlog"] == pytest.approx(5.0, rel=0.05)
    json.dumps(knee, allow_nan=False)  # every probe's figures are finite
    worse = summary(doc | {"latency": {"0.8": {"error": 0.2}}}, 4.0)
    assert worse["latency_ok"] is False


def test_the_profile_is_the_products_command_at_the_allocations_key(tmp_path: Path) -> None:
    full = profile_argv(FULL, tmp_path, "llama-3-8b", tmp_path / "p.json")
    assert full[0] == "profile" and "--quick" not in full
    flags = dict(zip(full[1::2], full[2::2], strict=True))
    assert flags["--model"] == "llama-3-8b" and flags["--store"] == str(tmp_path)
    assert (flags["--tp"], flags["--shares"], flags["--gpu"]) == ("1", "1.0", "a6000")
    assert "--speedup" not in flags  # the profiler picks its own (auto)
    assert profile_argv(QUICK, tmp_path, "llama-3-8b", tmp_path / "p.json")[-1] == "--quick"
    for key in ("trace_s", "latency_s", "knee_s", "knee_probes"):
        assert getattr(QUICK, key) < getattr(FULL, key), key

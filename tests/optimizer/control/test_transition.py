"""A rollout's waypoints and its staged first move, on real plans over hand-built states."""

from __future__ import annotations

import math

import pytest

from optimizer.control import transition
from optimizer.control.proposal import placed_replicas, predict_running, running_allocation
from optimizer.model.alp import Pipeline, Stage
from optimizer.model.curves import ProfileBook
from optimizer.plan.observed import Observed, Route
from optimizer.plan.planner import Plan, make_plan
from optimizer.plan.target import GroupSpec, ReplicaSpec, group_specs
from shared.optimizer_settings import OptimizerSettings
from tests.optimizer.control.test_step import _points

pytestmark = pytest.mark.timeout(60)

LLM, EMBED = "llama-3-8b", "e5-base-v2"
PIPES = {"rag": Pipeline("rag", (Stage(EMBED, 1.0, 1.0), Stage(LLM, 1.0, 1.0)))}
CFG = OptimizerSettings()
BOOK = ProfileBook(_points((EMBED, LLM)))  # the control step tests' synthetic curves


def _spec(model: str, gpu: int, share: float) -> ReplicaSpec:
    return ReplicaSpec(model, "n0", (gpu,), share, int(share * 48e9))


def _running(groups: tuple[GroupSpec, ...]) -> Observed:
    """``groups`` running, ready and routed."""
    replicas = tuple(r for g in groups for r in g.running(lambda rid: f"http://{rid}", True))
    return Observed(replicas, tuple(Route(r.model, r.url) for r in replicas))


# What runs: GPU 0 holds the LLM beside the embedder, GPU 1 the LLM alone, GPU 2 is free.
RUNNING = _running(group_specs([_spec(LLM, 0, 0.9), _spec(EMBED, 0, 0.1), _spec(LLM, 1, 1.0)]))
# The target gives the LLM GPU 0 whole and moves the embedder to GPU 2 beside a third LLM:
# round 1 starts GPU 2 (three LLM replicas serve), round 2 replaces GPU 0 (two serve).
TARGET = group_specs(
    [_spec(LLM, 0, 1.0), _spec(LLM, 1, 1.0), _spec(LLM, 2, 0.9), _spec(EMBED, 2, 0.1)]
)


def _plan() -> Plan:
    plan = make_plan(RUNNING, TARGET)
    assert plan.safe and plan.rounds == 2, plan.render()
    return plan


def _capacity(replicas: list[ReplicaSpec]) -> float:
    """The highest rate (0.1/s steps) at which those replicas serve rag by the ALP."""
    obs = _running(group_specs(replicas))
    rate = 0.1
    while math.isfinite(_predicted(obs, rate)):
        rate += 0.1
    return rate - 0.1


def _predicted(obs: Observed, rate: float) -> float:
    run = running_allocation(obs, PIPES, {"rag": rate})
    return predict_running(PIPES, BOOK, run, {"rag": rate}, placed_replicas(obs))["rag"]


TWO = _capacity([_spec(LLM, 0, 0.9), _spec(EMBED, 0, 0.1), _spec(LLM, 1, 1.0)])  # what runs
THREE = _capacity(
    [_spec(LLM, 0, 0.9), _spec(LLM, 1, 1.0), _spec(LLM, 2, 0.9), _spec(EMBED, 2, 0.1)]
)


def test_waypoints_follow_the_routed_set_from_what_runs_round_by_round() -> None:
    plan = _plan()
    rates = {"rag": 1.0}
    points = transition.waypoints(plan, RUNNING, PIPES, BOOK, rates)
    assert points[0].end == 0 and points[-1].end == len(plan.steps)
    assert [p.end for p in points] == sorted({p.end for p in points})
    assert sum(p.hold for p in points) == plan.rounds and points[-1].hold == 0
    assert all(p.serves(rates) for p in points)  # a light rate: every waypoint carries it
    assert transition.dip_cost(points, rates, CFG) == 0.0
    # what runs, then GPU 2 routed (three LLM replicas), GPU 0 drained (two), GPU 0 back
    caps = [p.capacity["rag"] for p in points]
    assert caps[0] == pytest.approx(TWO, abs=0.2) and caps[1] == pytest.approx(THREE, abs=0.2)
    assert caps[2] < caps[1] and caps[3] > caps[2]


def test_the_fluid_queue_prices_a_short_round_and_its_drain() -> None:
    def point(hold: int, capacity: float, latency: float) -> transition.Waypoint:
        return transition.Waypoint(0, 0, hold, {"rag": latency}, {"rag": capacity})

    path = [point(1, 0.0, math.inf), point(0, 4.0, 1.0)]
    rates = {"rag": 2.0}
    # 90 s at nothing served: 180 requests wait, 8100 request-s; drained at 2/s in 90 s: 8100
    queue = transition.request_seconds(path, rates, {}, 1800.0, 90.0, queue_only=True)
    assert queue == pytest.approx(16_200.0)
    # and every arrival pays the predicted latency (the short round at the next finite one)
    assert transition.request_seconds(path, rates, {}, 1800.0, 90.0) == pytest.approx(
        16_200.0 + 2.0 * 1800.0 * 1.0
    )
    assert transition.dip_cost(path, rates, CFG) == pytest.approx(16_200.0)
    # A backlog waiting already: a path ending barely above the rate drains it slowly, one
    # through a short round to a large capacity fast, and costs less over the horizon.
    slow = [point(1, 1.0, math.inf), point(0, 2.2, 3.0)]
    fast = [
        point(1, 1.0, math.inf),
        point(1, 2.2, 3.0),
        point(1, 1.0, math.inf),
        point(0, 8.0, 1.0),
    ]
    backlog = {"rag": 1_000.0}
    assert transition.request_seconds(
        fast, rates, backlog, 1800.0, 90.0
    ) < transition.request_seconds(slow, rates, backlog, 1800.0, 90.0)


def test_when_what_runs_falls_short_the_move_stops_where_it_serves_if_the_rest_would_dip() -> None:
    rate = (TWO + THREE) / 2  # past what runs and past two replicas, within three
    assert TWO < rate < THREE, (TWO, THREE)
    plan, rates = _plan(), {"rag": rate}
    points = transition.waypoints(plan, RUNNING, PIPES, BOOK, rates)
    assert [p.serves(rates) for p in points] == [False, True, False, True]
    assert transition.dip_cost(points, rates, CFG) > 0

    moved, latency, dip, why = transition.first_move(
        plan, RUNNING, PIPES, BOOK, rates, {"rag": 100.0}, {"rag": 1.5}, CFG
    )
    assert moved.steps == plan.steps[: points[1].end] and moved.steps[-1].kind == "add_route"
    assert {s.group for s in moved.steps if s.kind == "start"} == {
        g.id for g in TARGET if 2 in g.gpus
    }
    assert not any(s.kind in ("drain", "stop") for s in moved.steps)  # GPU 2 was free
    assert latency == points[1].latency and math.isfinite(latency["rag"])
    assert why.startswith(f"staged: steps 1-{points[1].end} of {len(plan.steps)}")
    assert dip == transition.dip_cost(points[:2], rates, CFG)


def test_the_whole_plan_when_what_runs_serves_or_no_waypoint_does_before_the_end() -> None:
    plan = _plan()
    for rate in (1.0, 1e3):  # every waypoint serves; none does
        got = transition.first_move(
            plan, RUNNING, PIPES, BOOK, {"rag": rate}, {}, {"rag": 1.5}, CFG
        )
        assert got[0] == plan and got[1] == {"rag": 1.5} and got[3] == ""

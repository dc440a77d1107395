"""The control step's decisions without a store or a backend: statistics, what runs and the
profiles are values built here, time is a number, and the state is carried by hand."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import pytest

from optimizer.control.decide import DetectorState
from optimizer.control.step import ControlState, StepInput, StepOutput, quickest, step
from optimizer.model.curves import ProfileBook
from optimizer.plan.observed import Observed, Route, RunningReplica
from optimizer.plan.planner import Plan, make_plan
from optimizer.plan.target import ReplicaSpec, group_specs
from optimizer.search import solve
from optimizer.search.solve import PlacedSearch
from optimizer.search.space import SearchProblem
from optimizer.stats.figures import ModelStats, TokenStats, WorkflowStats
from shared.profile_points import ProfilePoint
from shared.settings import Settings, settings_from_mapping

RAG = ("e5-base-v2", "bge-reranker-base", "llama-3-8b")
# Synthetic full-GPU profiles: light-load latency (s) and saturation (calls/s) per model.
CURVES = {"e5-base-v2": (0.01, 200.0), "bge-reranker-base": (0.05, 60.0), "llama-3-8b": (1.0, 6.0)}
WINDOW_S = 40.0
T = 1_000.0


def _points(models: tuple[str, ...] = RAG) -> list[ProfilePoint]:
    out = []
    for m in models:
        light, sat = CURVES[m]
        for frac in (0.1, 0.3, 0.5, 0.7, 0.9):
            lat = light / (1.0 - 0.8 * frac)
            out.append(
                ProfilePoint(
                    m,
                    "emulator",
                    "a6000",
                    1,
                    1.0,
                    frac * sat,
                    frac * sat,
                    lat,
                    lat,
                    1.3 * lat,
                    1.6 * lat,
                    0.2 * lat,
                    500,
                )
            )
        out.append(
            ProfilePoint(
                m,
                "emulator",
                "a6000",
                1,
                1.0,
                1.3 * sat,
                sat,
                10 * light,
                10 * light,
                12 * light,
                15 * light,
                light,
                500,
            )
        )
    return out


BOOK = ProfileBook(_points())


def _settings(gpus: int = 4, models: tuple[str, ...] = RAG, **optimizer: Any) -> Settings:
    return settings_from_mapping(
        {
            "cluster": {"nodes": [{"name": "n0", "gpu_type": "a6000", "gpus": gpus}]},
            "rollout": {"models": [{"name": m} for m in models]},
            "optimizer": {
                "windows_to_confirm": 2,
                "cooldown_s": 60,
                "min_requests": 10,
                "granularity": 2,
                **optimizer,
            },
        },
        env=None,
    )


def _model(m: str) -> ModelStats:
    tokens = TokenStats(100.0, 100.0, 100.0)
    latency = CURVES[m][0]
    return ModelStats(m, 100, 100, 1.0, 1.0, 1.0, latency, latency, 0.33, 0.1, tokens, tokens)


def _stats(rate: float, latency: float = 1.5, workflow: str = "rag") -> dict[str, WorkflowStats]:
    """One window of ``workflow`` calling the RAG models once each, at ``rate`` requests/s."""
    n = round(rate * WINDOW_S)
    models = MappingProxyType({m: _model(m) for m in RAG})
    return {
        workflow: WorkflowStats(
            workflow,
            n,
            n,
            rate,
            WINDOW_S,
            0,
            latency,
            0.1,
            latency,
            latency,
            1.0,
            0.0,
            models,
            None,
        )
    }


def _running(plan: Plan) -> Observed:
    """What a backend observes once ``plan`` ran: its target, ready and routed."""
    replicas = tuple(
        RunningReplica(
            r.id,
            g.id,
            r.spec.model,
            g.node,
            r.spec.gpus,
            r.spec.share,
            r.spec.tp,
            f"http://fake/{r.id}",
            True,
            r.spec.memory_bytes_per_gpu,
            r.spec.revision,
        )
        for g in plan.target
        for r in g.replicas
    )
    return Observed(replicas, tuple(Route(r.model, r.url) for r in replicas))


def _step(
    state: ControlState,
    stats: Mapping[str, WorkflowStats],
    observed: Observed,
    settings: Settings,
    now: float,
    book: ProfileBook = BOOK,
    recent: frozenset[str] = frozenset(),
) -> StepOutput:
    return step(
        StepInput(state, stats, WINDOW_S, observed, book, settings, now, recent),
        timer=lambda: 0.0,
    )


class Loop:
    """Carries the state as the daemon does: the step's, or after a rollout (which takes
    ``rollout_s`` and leaves the plan's target running) the one its outcome settles."""

    def __init__(
        self, settings: Settings, rollout_s: float = 5.0, book: ProfileBook = BOOK
    ) -> None:
        self.settings, self.rollout_s, self.book = settings, rollout_s, book
        self.state, self.observed, self.t = ControlState(), Observed(), T
        self.outs: list[StepOutput] = []

    def tick(self, rate: float, latency: float = 1.5) -> StepOutput:
        out = _step(
            self.state, _stats(rate, latency), self.observed, self.settings, self.t, self.book
        )
        if out.decision.taken:
            assert out.plan is not None
            self.state = out.after_rollout(self.t + self.rollout_s, ok=True)
            self.observed = _running(out.plan)
        else:
            self.state = out.state
        self.outs.append(out)
        self.t += self.settings.optimizer.interval_s
        return out

    def kinds(self) -> list[str]:
        return [o.decision.kind for o in self.outs]


def test_no_data_is_a_no_data_decision_and_searches_nothing() -> None:
    out = _step(ControlState(), {}, Observed(), _settings(), T)
    assert out.decision.kind == "no_data" and not out.decision.taken
    assert "10 completed requests" in out.decision.reasons[0]
    assert out.proposal is None and out.plan is None and out.result is None
    assert out.search_s is None and out.searched_s is None
    assert out.state.detector.baseline is None and out.running == {}


def test_the_first_trusted_window_rolls_out_what_it_searched() -> None:
    out = _step(ControlState(), _stats(1.0), Observed(), _settings(), T)
    d = out.decision
    assert d.kind == "rollout" and d.taken
    assert [c.kind for c in d.changes] == ["initial"]
    assert "cannot serve rag" in d.reasons[-1]
    assert out.proposal is not None and not out.proposal.same
    assert out.plan is not None and out.plan.safe and out.plan.steps
    assert {r.spec.model for g in out.plan.target for r in g.replicas} == set(RAG)
    assert out.placement is not None and out.result is not None
    assert out.predicted_now == {"rag": math.inf}  # nothing runs yet
    assert out.searched_s == 0.0 and out.search_s == 0.0  # the injected timer
    after = out.after_rollout(T + 30.0, ok=True)
    assert after.detector.last_rollout_end == T + 30.0
    assert after.detector.baseline is not None and "rag" in after.detector.baseline.workflows
    assert set(after.known) == {"rag"}


def test_stable_traffic_keeps_what_runs() -> None:
    loop = Loop(_settings())
    loop.tick(1.0)
    for _ in range(5):
        out = loop.tick(1.0)
        assert out.decision.kind == "steady", out.decision.reasons
        assert out.proposal is None and out.plan is None
    assert set(out.running["rag"]) == set(RAG)  # the ALP's view of what runs
    assert math.isfinite(out.predicted_now["rag"])


def test_a_shift_held_for_enough_windows_replans_with_a_proposal_and_a_plan() -> None:
    loop = Loop(_settings(min_gain=0.01))
    loop.tick(1.0)
    loop.tick(1.0)
    first = loop.tick(4.0)  # past rate_change_threshold, one window of two
    assert first.decision.kind == "pending" and first.plan is None
    assert "[1/2 windows]" in first.decision.reasons[0]
    out = loop.tick(4.0)
    d = out.decision
    assert d.kind == "rollout", d.reasons
    assert [c.kind for c in d.changes] == ["rate_shift"] and d.changes[0].relative > 2.0
    assert out.proposal is not None and out.plan is not None and not out.plan.empty
    assert d.gain is not None and d.gain >= 0.01 and d.benefit_s > d.cost_s  # type: ignore[operator]
    assert out.proposal.moved_fraction > 0
    # acted on once: the next windows at the new rate are steady
    assert [loop.tick(4.0).decision.kind for _ in range(3)] == ["steady"] * 3


def test_a_model_without_a_profile_is_an_error_naming_it() -> None:
    book = ProfileBook(_points(RAG[:2]))
    out = _step(ControlState(), _stats(1.0), Observed(), _settings(), T, book=book)
    assert out.decision.kind == "error" and not out.decision.taken
    assert "no profile for model(s) llama-3-8b" in out.decision.reasons[-1]
    assert out.plan is None and out.proposal is None
    assert out.searched_s is None and out.search_s is not None  # failed before searching
    # the change is retried next window: still no baseline, still an error
    again = _step(out.state, _stats(1.0), Observed(), _settings(), T + 60, book=book)
    assert again.decision.kind == "error"


def test_a_model_the_rollout_cannot_start_is_an_error_naming_it() -> None:
    out = _step(ControlState(), _stats(1.0), Observed(), _settings(models=RAG[:2]), T)
    assert out.decision.kind == "error"
    assert "llama-3-8b not in rollout.models" in out.decision.reasons[-1]


def test_cooldown_holds_a_confirmed_change_and_it_is_acted_on_after() -> None:
    loop = Loop(_settings(min_gain=0.01, cooldown_s=300))
    loop.tick(1.0)  # rollout, ends at T + 5
    loop.tick(4.0)
    held = loop.tick(4.0)  # confirmed at T + 120: 185 s of cooldown left
    assert held.decision.kind == "hold_cooldown"
    assert held.decision.reasons[-1] == "cooldown: 185s left"
    assert held.plan is not None  # searched, judged, not rolled out
    # the streak is kept: the first window past the cooldown acts at once
    while loop.t - (T + 5) < 300:
        assert loop.tick(4.0).decision.kind == "hold_cooldown"
    assert loop.tick(4.0).decision.kind == "rollout"


def test_min_gain_and_the_move_cost_hold_a_small_gain() -> None:
    loop = Loop(_settings(min_gain=0.5))
    loop.tick(1.0)
    loop.tick(4.0)
    out = loop.tick(4.0)
    assert out.decision.kind == "hold_gain"
    assert "below min_gain 50%" in out.decision.reasons[-1]
    assert out.proposal is not None and out.plan is not None
    # judged once: re-based on the window, no retry of the same shift
    assert loop.tick(4.0).decision.kind == "steady"
    costly = Loop(_settings(min_gain=0.01, cold_start_s=100_000))
    costly.tick(1.0)
    costly.tick(4.0)
    out = costly.tick(4.0)
    assert out.decision.kind == "hold_gain"
    assert out.decision.reasons[-1].endswith("the move costs more than it saves")


def test_a_proposal_equal_to_what_runs_is_unchanged() -> None:
    loop = Loop(_settings(gpus=2))
    loop.tick(1.0)
    loop.tick(3.0)
    out = loop.tick(3.0)
    assert out.decision.kind == "unchanged"
    assert out.proposal is not None and out.proposal.same and out.plan is not None
    assert out.plan.empty


def test_a_failed_rollout_keeps_the_change_and_starts_the_cooldown() -> None:
    out = _step(ControlState(), _stats(1.0), Observed(), _settings(), T)
    after = out.after_rollout(T + 30.0, ok=False)
    assert after.detector.baseline is None  # the state before the pass: retried
    assert after.detector.last_rollout_end == T + 30.0
    retry = _step(after, _stats(1.0), Observed(), _settings(), T + 60)
    assert retry.decision.kind == "hold_cooldown"


def test_a_model_still_called_is_never_dropped() -> None:
    side = RunningReplica("s-0", "gs", "llama-3.2-1b", "n0", (3,), 0.5, 1, "http://fake/s", True)
    observed = Observed((side,), (Route(side.model, side.url),))
    quiet = _step(ControlState(), _stats(1.0), observed, _settings(), T)
    assert quiet.decision.kind == "rollout"
    assert quiet.plan is not None and quiet.plan.dropped == ("llama-3.2-1b",)
    recent = frozenset({"llama-3.2-1b"})
    called = _step(ControlState(), _stats(1.0), observed, _settings(), T, recent=recent)
    # waiting for that workflow's traffic is no failure (errors are counted and alerted on)
    assert called.decision.kind == "pending" and not called.decision.taken
    assert called.plan is None and called.proposal is None
    assert "waiting: the plan would stop serving llama-3.2-1b" in called.decision.reasons[-1]
    assert called.state.detector.baseline is None  # the first window is retried next pass
    later = _step(called.state, _stats(1.0), observed, _settings(), T + 10, recent=frozenset())
    assert later.decision.kind == "rollout"


def test_a_plan_that_leaves_a_model_unserved_is_refused() -> None:
    only = RunningReplica("x-0", "gx", "llama-3-8b", "n0", (0,), 1.0, 1, "http://fake/x", True)
    observed = Observed((only,), (Route(only.model, only.url),))
    out = _step(ControlState(), _stats(0.5), observed, _settings(gpus=1, granularity=4), T)
    assert out.decision.kind == "error" and out.plan is None
    assert "no rollout order keeps every model served (llama-3-8b" in out.decision.reasons[-1]
    assert out.searched_s is not None  # the search ran (the daemon's metric observes it)


def test_every_workflow_gone_keeps_what_runs() -> None:
    """A baseline workflow that vanished, with no pipeline remembered: nothing to plan for."""
    first = _step(ControlState(), _stats(1.0), Observed(), _settings(), T)
    judged = first.after_rollout(T, ok=True)
    forgotten = ControlState(judged.detector, MappingProxyType({}))
    cfg = _settings(windows_to_confirm=1, cooldown_s=0)
    out = _step(forgotten, {}, Observed(), cfg, T + 60)
    assert out.decision.kind == "unchanged"
    assert out.decision.reasons[-1].startswith("no workflow has enough traffic to plan for")
    assert out.state.detector.baseline is not None
    assert "rag" not in out.state.detector.baseline.workflows


def test_a_workflow_whose_requests_all_run_keeps_its_pipeline() -> None:
    """Without a completed request the workflow is still planned for, with the pipeline it
    was last trusted with, at the arrivals seen (here none: the baseline's rate)."""
    loop = Loop(_settings())
    loop.tick(1.0)
    steady = loop.tick(1.0)
    empty: Mapping[str, ModelStats] = MappingProxyType({})
    stats = {
        "rag": WorkflowStats(
            "rag", 0, 0, 0.0, WINDOW_S, 0, math.nan, 0.0, 0.0, 0.0, 1.0, 0.0, empty, None
        )
    }
    out = _step(loop.state, stats, loop.observed, loop.settings, loop.t)
    assert out.decision.kind == "pending"  # the rate fell to 0: not yet confirmed
    assert out.running == steady.running
    assert out.predicted_now == steady.predicted_now


def test_the_step_is_a_function_of_its_input() -> None:
    inp = StepInput(ControlState(), _stats(1.0), WINDOW_S, Observed(), BOOK, _settings(), T)
    a, b = step(inp, timer=lambda: 0.0), step(inp, timer=lambda: 0.0)
    # (the search result also reports how long the search took: that alone may differ)
    same = ("decision", "state", "before", "running", "predicted_now", "proposal", "plan")
    assert [getattr(a, f) for f in (*same, "placement")] == [
        getattr(b, f) for f in (*same, "placement")
    ]
    assert inp.state == ControlState() and inp.state.detector == DetectorState()


def test_the_step_imports_no_store_web_process_or_event_loop() -> None:
    code = (
        "import sys, optimizer.control.step\n"
        "bad = {'duckdb', 'aiohttp', 'asyncio', 'subprocess', 'kubernetes'}\n"
        "print(sorted(bad & {m.split('.')[0] for m in sys.modules}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_rollout_goes_to_the_layout_with_the_fewest_cold_start_rounds() -> None:
    def spec(model: str, gpu: int, share: float) -> ReplicaSpec:
        return ReplicaSpec(model, "n0", (gpu,), share, int(share * 48_000_000_000))

    old = group_specs([spec("a", 0, 1.0), spec("a", 1, 1.0)])
    observed = Observed(
        tuple(
            RunningReplica(r.id, g.id, "a", "n0", r.spec.gpus, 1.0, 1, f"http://{r.id}", True)
            for g in old
            for r in g.replicas
        ),
    )
    observed = Observed(observed.replicas, tuple(Route("a", r.url) for r in observed.replicas))

    def plan_to(*gpus: int) -> Plan:
        pairs = [x for g in gpus for x in (spec("a", g, 0.5), spec("b", g, 0.5))]
        return make_plan(observed, group_specs(pairs))

    in_place, beside = plan_to(0, 1), plan_to(2, 3)
    assert (in_place.rounds, beside.rounds) == (2, 1)  # GPUs 2-3 are free: one round
    assert quickest([(in_place, "searched"), (beside, "variant")]) == (beside, "variant")
    assert quickest([(beside, "searched"), (plan_to(2, 3), "same")]) == (beside, "searched")
    alone = Observed(observed.replicas[:1], observed.routes[:1])  # a's only replica on GPU 0
    unsafe = make_plan(alone, group_specs([spec("a", 0, 0.5), spec("b", 0, 0.5)]))
    assert not unsafe.safe and quickest([(unsafe, "unsafe")]) is None


def _ends(share: float, slow: float, colocation: str) -> list[ProfilePoint]:
    """Every RAG model at ``share``: the whole GPU's curve ``slow`` x slower, ``share`` x
    the rate."""
    return [
        replace(
            p,
            share=share,
            offered_rate=p.offered_rate * share,
            throughput=p.throughput * share,
            lat_mean=p.lat_mean * slow,
            lat_p50=p.lat_p50 * slow,
            colocation=colocation,
        )
        for p in _points()
    ]


def test_the_proposal_and_what_runs_are_predicted_where_they_are_placed() -> None:
    # shares measured alone and packed: an allocation is read between them by its placement,
    # the proposal's as what runs, so the same allocation in the same place reads the same
    book = ProfileBook(
        _points()
        + [
            p
            for s in (0.5, 0.25)
            for c, slow in (("alone", 1.2), ("packed", 2.0))
            for p in _ends(s, slow * (1 / s) ** 0.3, c)
        ]
    )
    loop = Loop(_settings(gpus=2), book=book)
    loop.tick(1.0)
    loop.tick(3.0)
    out = loop.tick(3.0)
    assert out.decision.kind == "unchanged" and out.proposal is not None
    (rag,) = [o for o in out.proposal.outlook if o.workflow == "rag"]
    assert math.isclose(rag.proposed, rag.current, rel_tol=1e-9)
    assert out.result is not None
    (searched,) = [w for w in out.result.workflows if w.workflow == "rag"]
    assert rag.proposed <= searched.latency  # the search ranks on the packed end


def test_an_overload_seen_live_is_planned_at_once_for_its_later_half_rate() -> None:
    """What runs was planned for 1 request/s; a window at 12/s whose later half ran at 14/s,
    its requests slower than the baseline's: one window, and the search plans for 14/s."""
    loop = Loop(_settings())
    loop.tick(1.0)
    loop.tick(1.0)

    def window(late: float, latency: float) -> StepOutput:
        stats = {"rag": replace(_stats(12.0, latency)["rag"], arrival_rate_late=late)}
        return _step(loop.state, stats, loop.observed, loop.settings, loop.t)

    out = window(14.0, 10.0)
    assert out.predicted_now["rag"] == math.inf
    assert out.decision.taken and [c.kind for c in out.decision.changes] == ["over_capacity"]
    assert out.proposal is not None and out.proposal.outlook[0].rate == 14.0
    falling = window(8.0, 10.0)
    assert falling.proposal is not None and falling.proposal.outlook[0].rate == 12.0
    unseen = window(14.0, 1.5)  # the live window does not show it: a second window first
    assert unseen.decision.kind == "pending" and unseen.proposal is None


def test_an_overload_that_cannot_be_planned_at_its_later_half_rate_is_planned_at_the_window_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A search that cannot place past 13/s (a fake standing in for a full cluster): the
    later half's 14/s fails, so the pass plans for the window's 12/s and says why; when
    the window's rate fails as well, the error is the later half's."""
    loop = Loop(_settings())
    loop.tick(1.0)
    loop.tick(1.0)
    real = solve.search_and_place

    def full_past_13(problem: SearchProblem, max_attempts: int = 8) -> PlacedSearch:
        got = real(problem, max_attempts)
        if max(t.rate for t in problem.workflows) > 13.0:
            return replace(got, placement=None, failures=("the cluster is full",))
        return got

    monkeypatch.setattr(solve, "search_and_place", full_past_13)

    def window(rate: float, late: float) -> StepOutput:
        stats = {"rag": replace(_stats(rate, 10.0)["rag"], arrival_rate_late=late)}
        return _step(loop.state, stats, loop.observed, loop.settings, loop.t)

    out = window(12.0, 14.0)
    assert out.decision.taken and out.proposal is not None
    assert out.proposal.outlook[0].rate == 12.0
    assert out.decision.reasons[-1] == (
        "planned at the window's rates: at the later half's, "
        "PlanningError: no placement fits: the cluster is full"
    )
    both = window(13.5, 14.0)
    assert both.decision.kind == "error" and both.decision.reasons[-1].endswith("is full")

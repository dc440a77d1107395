"""Change detection and rollout decisions on fake time: a held shift yields exactly one rollout,
noise around a steady rate none, the cooldown is respected, and the gain has to pay the move."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import numpy as np
import pytest

from optimizer.control.decide import (
    Decision,
    Detection,
    DetectorState,
    ModelObs,
    Outlook,
    Proposal,
    Snapshot,
    WorkflowObs,
    after_rollout,
    detect,
    failed,
    judge,
    planning_rate,
)
from shared.optimizer_settings import OptimizerSettings

CFG = OptimizerSettings(
    interval_s=60,
    window_s=120,
    windows_to_confirm=3,
    rate_change_threshold=0.3,
    cooldown_s=300,
    min_requests=5,
    min_gain=0.1,
    horizon_s=1800,
    cold_start_s=90,
)
MU = 1.0  # requests/s one toy replica serves
BASE_LATENCY = 2.0  # s, at light load


def _obs(rate: float, requests: int, latency: float = 2.0, prompt: float = 100.0) -> WorkflowObs:
    return WorkflowObs(
        "rag", rate, requests, latency, MappingProxyType({"gen": ModelObs(1.0, 1.0, prompt, 30.0)})
    )


def _toy_latency(rate: float, replicas: int) -> float:
    """An M/M/1-like toy: each replica at rate/d, latency blows up at capacity."""
    if replicas <= 0 or rate >= replicas * MU:
        return math.inf
    return BASE_LATENCY / (1.0 - rate / (replicas * MU))


def _best_replicas(rate: float, headroom: float = 0.1) -> int:
    return max(1, math.ceil(rate * (1.0 + headroom) / MU + 1e-9) + 1)


@dataclass
class Loop:
    """The daemon's decision loop in miniature: windowed Poisson counts on a fake clock, a toy
    search (fewest replicas covering the rate, plus one), a rollout that takes 30 s."""

    cfg: OptimizerSettings = CFG
    replicas: int = 0
    state: DetectorState = field(default_factory=DetectorState)
    decisions: list[Decision] = field(default_factory=list)
    planned_rates: list[float] = field(default_factory=list)

    def tick(self, t: float, rate: float, requests: int) -> Decision:
        snap = Snapshot(t, self.cfg.window_s, MappingProxyType({"rag": _obs(rate, requests)}))
        det = detect(self.state, snap, self.cfg)
        proposal = None
        if det.act:
            want = _best_replicas(rate)
            proposal = Proposal(
                (
                    Outlook(
                        "rag", rate, _toy_latency(rate, self.replicas), _toy_latency(rate, want)
                    ),
                ),
                feasible=True,
                moved_fraction=abs(want - self.replicas) / want,
                same=want == self.replicas,
            )
        decision, new_state = judge(self.state, det, proposal, self.cfg)
        if decision.taken:
            assert proposal is not None
            self.replicas = _best_replicas(rate)
            self.planned_rates.append(rate)
            new_state = after_rollout(new_state, self.state, t + 30.0, ok=True)
        self.state = new_state
        self.decisions.append(decision)
        return decision

    def run(self, arrivals: np.ndarray, until: float) -> None:
        t = self.cfg.window_s  # the first full window (the daemon clips to the data it has)
        while t <= until:
            lo = t - self.cfg.window_s
            n = int(((arrivals >= lo) & (arrivals < t)).sum())
            self.tick(t, n / self.cfg.window_s, n)
            t += self.cfg.interval_s

    @property
    def rollouts(self) -> list[Decision]:
        return [d for d in self.decisions if d.taken]


def _poisson(rng: np.random.Generator, pieces: list[tuple[float, float, float]]) -> np.ndarray:
    """Arrival times of a piecewise-constant Poisson process: (start, end, rate) pieces."""
    out = [
        start + np.cumsum(rng.exponential(1.0 / rate, size=int(rate * (end - start) * 2) + 50))
        for start, end, rate in pieces
    ]
    return np.sort(np.concatenate([a[a < end] for a, (_, end, _) in zip(out, pieces, strict=True)]))


@pytest.mark.parametrize("seed", range(5))
def test_a_held_shift_yields_exactly_one_rollout_at_its_full_size(seed: int) -> None:
    rng = np.random.default_rng(seed)
    arrivals = _poisson(rng, [(0, 1800, 1.0), (1800, 5400, 3.0)])
    loop = Loop()
    loop.run(arrivals, 5400)
    # One rollout to start serving, one for the shift: never a second one for the same shift.
    assert len(loop.rollouts) == 2, [(d.t, d.kind, d.reasons) for d in loop.decisions]
    first, second = loop.rollouts
    assert first.changes[0].kind == "initial"
    assert second.changes[0].kind == "rate_shift" and second.t > 1800
    # Confirmed over three windows: not before the third window past the shift.
    assert second.t >= 1800 + 2 * CFG.interval_s
    # Planned for the tripled rate, not for a window still mixing the old one.
    assert loop.planned_rates[1] == pytest.approx(3.0, rel=0.25)
    assert loop.replicas == _best_replicas(3.0)
    kinds = {d.kind for d in loop.decisions if d.t > second.t + CFG.window_s}
    assert kinds <= {"steady", "pending"}


@pytest.mark.parametrize("seed", range(5))
def test_noise_around_a_steady_rate_yields_no_rollout(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    arrivals = _poisson(rng, [(0, 20_000, 2.0)])
    loop = Loop()
    loop.run(arrivals, 20_000)
    assert [d.changes[0].kind for d in loop.rollouts] == ["initial"]
    assert len(loop.decisions) > 300


def test_spikes_that_flip_direction_or_do_not_last_are_never_confirmed() -> None:
    loop = Loop()
    loop.tick(60, 1.0, 100)
    assert loop.rollouts and loop.state.baseline is not None
    rates = [1.5, 0.5, 1.5, 0.5, 1.5, 1.5, 1.0, 1.5, 1.5, 0.9] * 5
    for k, rate in enumerate(rates):
        d = loop.tick(120 + 60 * k, rate, 100)
        assert d.kind in ("steady", "pending"), d
    assert any(d.kind == "pending" and "[2/3 windows]" in d.reasons[0] for d in loop.decisions)
    assert len(loop.rollouts) == 1


def test_the_cooldown_delays_a_second_shift_then_it_is_rolled_out() -> None:
    cfg = replace(CFG, cooldown_s=900)
    loop = Loop(cfg=cfg)
    loop.tick(60, 1.0, 100)
    t = 1200.0  # the first rollout's cooldown has passed
    for _ in range(3):
        loop.tick(t, 3.0, 300)
        t += 60
    assert len(loop.rollouts) == 2
    end = loop.state.last_rollout_end
    assert end is not None
    # Up by a third, which what runs still serves (slowly): confirmed after three windows,
    # held until the cooldown has passed.
    while t < end + cfg.cooldown_s:
        d = loop.tick(t, 4.0, 400)
        assert not d.taken
        t += 60
    assert any(d.kind == "hold_cooldown" and "cooldown" in d.reasons[-1] for d in loop.decisions)
    d = loop.tick(t, 4.0, 400)
    assert d.taken and d.changes[0].kind == "rate_shift"
    assert d.changes[0].relative == pytest.approx(1 / 3)
    assert len(loop.rollouts) == 3


def test_the_cooldown_never_holds_traffic_what_runs_cannot_serve() -> None:
    loop = Loop(cfg=replace(CFG, cooldown_s=900))
    loop.tick(60, 1.0, 100)
    t = 1200.0
    for _ in range(3):
        loop.tick(t, 3.0, 300)
        t += 60
    end = loop.state.last_rollout_end
    assert end is not None and len(loop.rollouts) == 2
    # Doubles: what runs (sized for 3/s) cannot serve 6/s and the proposal can, so the
    # rollout comes once the shift is confirmed, inside the cooldown.
    decisions = [loop.tick(t + 60 * k, 6.0, 600) for k in range(3)]
    assert [d.kind for d in decisions] == ["pending", "pending", "rollout"]
    assert decisions[-1].t < end + 900
    assert "cooldown waived" in " ".join(decisions[-1].reasons)
    # A proposal that cannot serve it either is held as before (no rollout after rollout).
    base = Snapshot(0, 120, MappingProxyType({"rag": _obs(1.0, 100)}))
    state = DetectorState(baseline=base, last_rollout_end=30.0)
    det = detect(
        state,
        Snapshot(60, 120, MappingProxyType({"rag": _obs(9.0, 900)})),
        replace(CFG, windows_to_confirm=1),
    )
    hopeless = Proposal((Outlook("rag", 9.0, math.inf, math.inf),), False, 1.0, False)
    held, _ = judge(state, det, hopeless, CFG)
    assert held.kind == "hold_cooldown"


def _doubled(state: DetectorState, cfg: OptimizerSettings = CFG) -> Detection:
    """A window with the rate doubled against ``state``'s baseline, confirmed at once."""
    snap = Snapshot(60, 120, MappingProxyType({"rag": _obs(2.0, 200)}))
    return detect(state, snap, replace(cfg, windows_to_confirm=1))


def _det_and_proposal(
    current: float, proposed: float, moved: float
) -> tuple[DetectorState, Decision]:
    base = Snapshot(0, 120, MappingProxyType({"rag": _obs(1.0, 100)}))
    state = DetectorState(baseline=base)
    det = _doubled(state)
    proposal = Proposal((Outlook("rag", 2.0, current, proposed),), True, moved, False)
    decision, new = judge(state, det, proposal, CFG)
    return new, decision


def test_a_gain_below_min_gain_or_not_paying_for_the_move_is_held() -> None:
    _, small = _det_and_proposal(current=2.0, proposed=1.9, moved=0.5)
    assert small.kind == "hold_gain" and "below min_gain" in small.reasons[-1]
    # 20% faster, but over the horizon it saves less than restarting everything costs.
    _, costly = _det_and_proposal(current=2.0, proposed=1.6, moved=1.0)
    assert costly.gain == pytest.approx(0.2)
    assert costly.benefit_s is not None and costly.cost_s is not None
    assert costly.benefit_s == pytest.approx(1800 * 2.0 * 0.4)
    assert costly.cost_s == pytest.approx(90 * 1.0 * 2.0 * 2.0)
    assert costly.kind == "rollout"  # 1440 > 360
    cfg_short = replace(CFG, horizon_s=60)
    base = Snapshot(0, 120, MappingProxyType({"rag": _obs(1.0, 100)}))
    state = DetectorState(baseline=base)
    det = _doubled(state, cfg_short)
    held, new = judge(
        state, det, Proposal((Outlook("rag", 2.0, 2.0, 1.6),), True, 1.0, False), cfg_short
    )
    assert held.kind == "hold_gain" and "costs more" in held.reasons[-1]
    # Held: the running allocation was judged for this traffic, so no re-search next window.
    assert new.baseline is det.snapshot and not new.streaks


def test_an_infeasible_running_allocation_is_replaced_whatever_the_gain() -> None:
    _, d = _det_and_proposal(current=math.inf, proposed=5.0, moved=1.0)
    assert d.kind == "rollout" and "cannot serve rag" in d.reasons[-1]


def test_new_workflows_and_models_act_at_once_token_and_latency_drift_need_confirming() -> None:
    cfg = replace(CFG, windows_to_confirm=2)
    state = DetectorState(baseline=Snapshot(0, 120, MappingProxyType({"rag": _obs(1.0, 100)})))
    beam = WorkflowObs("beam", 0.5, 50, 8.0, MappingProxyType({"gen": ModelObs(4, 2, 80, 60)}))
    rag2 = replace(
        _obs(1.0, 100),
        models=MappingProxyType(
            {"gen": ModelObs(1.0, 1.0, 100, 30), "rerank": ModelObs(1, 1, 50, 0)}
        ),
    )
    det = detect(state, Snapshot(60, 120, MappingProxyType({"rag": rag2, "beam": beam})), cfg)
    assert sorted(c.kind for c in det.changes) == ["new_model", "new_workflow"]
    # Prompts doubled, latency 3x the prediction: pending for one window, confirmed on the next.
    drift = _obs(1.0, 100, latency=6.0, prompt=200.0)
    snap = Snapshot(60, 120, MappingProxyType({"rag": drift}))
    first = detect(state, snap, cfg, predicted_now={"rag": 2.0})
    assert not first.act and {c.kind for c in first.pending} == {"token_drift", "latency_drift"}
    second = detect(
        replace(state, streaks=first.streaks), replace(snap, t=120), cfg, predicted_now={"rag": 2.0}
    )
    assert {c.kind for c in second.changes} == {"token_drift", "latency_drift"}
    # Latency is not judged on a window that overlaps the last rollout.
    recent = replace(state, last_rollout_end=50.0)
    assert not [
        c
        for c in detect(recent, snap, cfg, predicted_now={"rag": 2.0}).pending
        if c.kind == "latency_drift"
    ]


def _next_window(
    state: DetectorState, first: Detection, cfg: OptimizerSettings, predicted: float
) -> Detection:
    """The window after ``first`` (same traffic, 60 s later), with ``first``'s streaks and
    rag's running allocation predicted at ``predicted`` s."""
    snap = first.snapshot
    return detect(
        replace(state, streaks=first.streaks),
        replace(snap, t=snap.t + 60),
        cfg,
        predicted_now={"rag": predicted},
    )


def test_an_allocation_predicted_past_capacity_is_searched_again_once_confirmed() -> None:
    """The corrected profiles say what runs cannot carry the arrivals, and the live window
    does not (yet) show it: confirmed after overload_windows_to_confirm windows."""
    cfg = replace(CFG, windows_to_confirm=2)
    state = DetectorState(baseline=Snapshot(0, 120, MappingProxyType({"rag": _obs(1.0, 100)})))
    snap = Snapshot(60, 120, MappingProxyType({"rag": _obs(1.0, 100, latency=2.5)}))
    first = detect(state, snap, cfg, predicted_now={"rag": math.inf})
    assert not first.act and [c.kind for c in first.pending] == ["over_capacity"]
    second = _next_window(state, first, cfg, math.inf)
    assert [c.kind for c in second.changes] == ["over_capacity"]
    # a finite prediction, no arrivals, or a window overlapping the last rollout: nothing
    finite = detect(state, snap, cfg, predicted_now={"rag": 40.0})
    assert "over_capacity" not in {c.kind for c in finite.pending}
    idle = Snapshot(60, 120, MappingProxyType({"rag": _obs(0.0, 2, latency=30.0)}))
    kinds = {c.kind for c in detect(state, idle, cfg, {"rag": math.inf}).pending}
    assert kinds == {"rate_shift"}  # traffic gone is a shift down, not a lack of capacity
    recent = replace(state, last_rollout_end=50.0)
    assert not detect(recent, snap, cfg, predicted_now={"rag": math.inf}).pending


@pytest.mark.parametrize(
    ("obs", "evidence"),
    [
        (_obs(3.0, 300, latency=4.0), "observed latency 2s -> 4s"),  # slower past 50%
        (_obs(3.0, 2, latency=30.0), "2 of 360 requests completed in the window"),  # stalled
    ],
)
def test_an_overload_the_live_window_shows_is_confirmed_at_once(
    obs: WorkflowObs, evidence: str
) -> None:
    """Predicted past capacity and seen in the live window (requests slower than the
    baseline's by the latency drift threshold, or too few completing while enough arrive):
    two signals that do not share their noise, so no second window is waited for."""
    state = DetectorState(baseline=Snapshot(0, 120, MappingProxyType({"rag": _obs(1.0, 100)})))
    det = detect(state, Snapshot(60, 120, MappingProxyType({"rag": obs})), CFG, {"rag": math.inf})
    assert [c.kind for c in det.changes] == ["over_capacity"]
    assert det.changes[0].reason.endswith(evidence)
    # the same window with capacity left by the profiles: no overload, whatever it shows
    calm = detect(state, Snapshot(60, 120, MappingProxyType({"rag": obs})), CFG, {"rag": 9.0})
    assert not calm.act


def test_an_overload_not_seen_live_waits_for_its_second_window() -> None:
    """Noise: latency up by less than the drift threshold, or a baseline that itself had too
    few completed requests to compare with."""
    state = DetectorState(baseline=Snapshot(0, 120, MappingProxyType({"rag": _obs(1.0, 100)})))
    near = Snapshot(60, 120, MappingProxyType({"rag": _obs(3.0, 300, latency=2.9)}))
    assert not detect(state, near, CFG, {"rag": math.inf}).act
    thin = DetectorState(baseline=Snapshot(0, 120, MappingProxyType({"rag": _obs(1.0, 3)})))
    stalled = Snapshot(60, 120, MappingProxyType({"rag": _obs(3.0, 2, latency=math.nan)}))
    assert not detect(thin, stalled, CFG, {"rag": math.inf}).act


def test_a_rising_overload_is_planned_for_its_later_half_rate() -> None:
    rising = replace(_obs(10.0, 300, latency=9.0), late_rate=16.0)
    assert planning_rate(rising) == 16.0
    assert planning_rate(replace(rising, late_rate=7.0)) == 10.0  # falling: the window's
    assert planning_rate(replace(rising, late_rate=math.nan)) == 10.0  # unknown: the window's
    state = DetectorState(baseline=Snapshot(0, 120, MappingProxyType({"rag": _obs(5.0, 500)})))
    det = detect(
        state, Snapshot(60, 120, MappingProxyType({"rag": rising})), CFG, {"rag": math.inf}
    )
    assert "(16/s in the window's later half: planned for that)" in det.changes[0].reason


def test_an_overload_is_confirmed_sooner_than_other_changes() -> None:
    """Windows to confirm: 3 for a rate shift, 2 for what runs predicted past capacity (its
    backlog grows while it waits); never more than windows_to_confirm."""
    state = DetectorState(baseline=Snapshot(0, 120, MappingProxyType({"rag": _obs(1.0, 100)})))
    snap = Snapshot(60, 120, MappingProxyType({"rag": _obs(3.0, 300)}))
    first = detect(state, snap, CFG, predicted_now={"rag": math.inf})
    assert not first.act
    assert sorted(c.reason[-13:] for c in first.pending) == ["[1/2 windows]", "[1/3 windows]"]
    second = _next_window(state, first, CFG, math.inf)
    assert [c.kind for c in second.changes] == ["over_capacity"]
    assert [c.kind for c in second.pending] == ["rate_shift"]
    # a capacity the running allocation still has (finite prediction): the shift waits for 3
    calm = _next_window(state, first, CFG, 9.0)
    assert not calm.act
    one = replace(CFG, windows_to_confirm=1, overload_windows_to_confirm=2)
    assert detect(state, snap, one, predicted_now={"rag": math.inf}).act


def test_failures_and_failed_rollouts_keep_the_change_for_a_retry() -> None:
    state = DetectorState(baseline=Snapshot(0, 120, MappingProxyType({"rag": _obs(1.0, 100)})))
    cfg = replace(CFG, windows_to_confirm=1)
    det = detect(state, Snapshot(60, 120, MappingProxyType({"rag": _obs(3.0, 300)})), cfg)
    d, kept = failed(state, det, "no profile for gen at tp=1")
    assert d.kind == "error" and d.reasons[-1].startswith("no profile")
    assert kept.baseline is state.baseline and kept.streaks == det.streaks
    decided = replace(state, baseline=det.snapshot)
    back = after_rollout(decided, state, 90.0, ok=False)
    assert back.baseline is state.baseline and back.last_rollout_end == 90.0
    assert after_rollout(decided, state, 90.0, ok=True).baseline is det.snapshot


def test_no_trusted_traffic_is_no_data_and_a_workflow_gone_is_a_shift_down() -> None:
    loop = Loop()
    assert loop.tick(60, 0.01, 2).kind == "no_data"
    loop.tick(120, 1.0, 100)
    for k in range(3):
        d = loop.tick(180 + 60 * k, 0.0, 0)
    assert d.changes and d.changes[0].kind == "rate_shift" and d.changes[0].relative == -1.0


def test_a_workflow_whose_requests_all_still_run_is_not_gone() -> None:
    """Overloaded past the window, no request completes in it; the store still shows the
    arrivals (open rows), so the rate holds and no shift down is confirmed."""
    state = DetectorState(baseline=Snapshot(0.0, 120.0, MappingProxyType({"rag": _obs(10.0, 900)})))
    for k in range(5):
        running = WorkflowObs("rag", 10.2, 0, math.nan, MappingProxyType({}))
        det = detect(
            state, Snapshot(60.0 * (k + 1), 120.0, MappingProxyType({"rag": running})), CFG
        )
        assert not det.changes and not det.pending
        _, state = judge(state, det, None, CFG)


def test_a_baseline_judged_on_an_all_running_window_keeps_its_models() -> None:
    """Judged on a window where the workflow had no completed request (a new workflow made it
    act), the baseline takes its rate but keeps its models: when requests complete again
    nothing reads as new."""
    state = DetectorState(baseline=Snapshot(0.0, 120.0, MappingProxyType({"rag": _obs(10.0, 900)})))
    running = WorkflowObs("rag", 30.0, 0, math.nan, MappingProxyType({}))
    beam = replace(_obs(1.0, 60), workflow="beam")
    det = detect(
        state, Snapshot(60.0, 120.0, MappingProxyType({"rag": running, "beam": beam})), CFG
    )
    assert [c.kind for c in det.changes] == ["new_workflow"]
    outlook = (Outlook("rag", 30.0, 5.0, 5.0), Outlook("beam", 1.0, 5.0, 5.0))
    decision, state = judge(state, det, Proposal(outlook, True, 0.0, True), CFG)
    assert decision.kind == "unchanged" and state.baseline is not None
    rag = state.baseline.workflows["rag"]
    assert rag.rate == 30.0 and rag.requests == 900 and set(rag.models) == {"gen"}
    back = detect(
        state, Snapshot(120.0, 120.0, MappingProxyType({"rag": _obs(30.0, 900), "beam": beam})), CFG
    )
    assert not back.changes and not back.pending


def test_a_proposal_found_on_relaxed_margins_says_so() -> None:
    base = Snapshot(0, 120, MappingProxyType({"rag": _obs(1.0, 100)}))
    state = DetectorState(baseline=base)
    det = _doubled(state)
    outlook = (Outlook("rag", 2.0, math.inf, 5.0),)
    plain, _ = judge(state, det, Proposal(outlook, True, 1.0, False), CFG)
    assert not any("searched on" in r for r in plain.reasons)
    relaxed, _ = judge(state, det, Proposal(outlook, True, 1.0, False, "point estimates"), CFG)
    assert relaxed.kind == "rollout"
    assert "searched on point estimates: no allocation covers every rate" in " ".join(
        relaxed.reasons
    )


def test_the_backlog_of_a_round_that_leaves_a_workflow_short_is_part_of_the_cost() -> None:
    """The move that pays for itself (test above: 1440 request-s saved against 360) is held
    once its rounds cost a backlog (``Proposal.dip_s``) larger than the saving."""
    base = Snapshot(0, 120, MappingProxyType({"rag": _obs(1.0, 100)}))
    state = DetectorState(baseline=base)
    outlook = (Outlook("rag", 2.0, 2.0, 1.6),)
    dipping = Proposal(outlook, True, 1.0, False, dip_s=2.0 * 90**2 / 2)
    held, _ = judge(state, _doubled(state), dipping, CFG)
    assert held.kind == "hold_gain" and held.cost_s == pytest.approx(360 + 8100)
    assert "8.1e+03 of it while a round leaves a workflow short" in held.reasons[-1]


def test_a_staged_rollout_is_searched_again_once_its_cooldown_passed() -> None:
    base = Snapshot(0, 120, MappingProxyType({"rag": _obs(1.0, 100)}))
    state = DetectorState(baseline=base)
    staged = Proposal(
        (Outlook("rag", 2.0, math.inf, 3.0),), True, 0.3, False, staged="staged: steps 1-5"
    )
    taken, decided = judge(state, _doubled(state), staged, CFG)
    assert taken.kind == "rollout" and taken.reasons[-1] == "staged: steps 1-5"
    done = after_rollout(decided, state, 100.0, ok=True)
    assert done.unfinished

    def window(t: float) -> Detection:
        return detect(done, Snapshot(t, 120, MappingProxyType({"rag": _obs(2.0, 200)})), CFG)

    assert not window(100.0 + CFG.cooldown_s - 1).act  # the same traffic, inside the cooldown
    again = window(100.0 + CFG.cooldown_s)
    assert [c.kind for c in again.changes] == ["unfinished"]
    # Searched again: the rest holds (here: it costs more than it saves); nothing is left.
    rest = Proposal((Outlook("rag", 2.0, 3.0, 2.9),), True, 0.7, False)
    held, after = judge(done, again, rest, CFG)
    assert held.kind == "hold_gain" and not after.unfinished

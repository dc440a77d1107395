"""The optimizer's control step: one window of statistics in, one decision out (pure).

Role: everything the daemon (:mod:`optimizer.daemon.service`) decides in one pass, as one
function over frozen values, so that decisions are tested without a store or a backend and the
evaluation's dynamic scenario (:mod:`bench.evaluation.daemon`) runs the very same pass.
:func:`step` takes a :class:`StepInput` (what the controller remembers, the window's statistics,
what runs, the profiles, the settings, the time) and returns a :class:`StepOutput` (the decision,
the state to carry on, the proposal and the rollout plan):

1. traffic: the workflows to plan for (enough completed requests in the window, or enough when
   last judged and some now), their pipelines (a model whose calls are all still running stays
   in the workflow's last trusted pipeline) and rates (a planned workflow without a completed
   request keeps its pipeline at the arrivals seen, or the baseline's rate, until the detector
   confirms it is gone);
2. what runs as the ALP sees it, and its predicted latency at the observed rates;
3. detect (:func:`optimizer.control.decide.detect`); without a confirmed change, judge at once;
4. on one: check that every model can be started (``rollout.models``) and has a profile, search
   and place (:func:`optimizer.search.solve.search_and_place`), plan against what runs
   (:func:`optimizer.plan.planner.make_plan`; a plan that would leave a served model without a
   replica is re-tried on other layouts of the same allocation, else refused), refuse a plan
   that stops serving a model still called (in the window, or in the last :data:`RECENT_S`
   seconds: ``StepInput.recent_models``), price the plan's rounds
   (:func:`optimizer.control.transition.first_move`: the queueing its short rounds cause; when
   what runs cannot serve the traffic, the prefix of the plan up to a serving waypoint where
   that costs less over the horizon), and judge the :class:`Proposal`. An overloaded
   workflow is planned for its rate in the window's later half when that is higher
   (:func:`optimizer.control.decide.planning_rate`), and for the window's rate when that
   cannot be planned (the reasons say so).

What the step does not do is what touches the world: reading the store and the backend, timing
the search for the metric aside (``timer``), rolling out, recording. A taken decision is rolled
out by the caller, whose outcome settles the state (:meth:`StepOutput.after_rollout`).

Invariants:
- pure: no clock (time is ``StepInput.now``; ``timer`` only measures how long the search
  took), no file, no network, no thread; the same input gives the same decision, state,
  proposal and plan;
- a search, placement or planning failure (:class:`PlanningError`, or a ``ValueError`` such as
  a missing profile point) is an ``error`` decision that keeps the detector's streaks, so the
  change is retried next window; nothing else is caught.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TypeVar

from optimizer.control import transition
from optimizer.control.decide import (
    Decision,
    Detection,
    DetectorState,
    Proposal,
    after_rollout,
    detect,
    failed,
    judge,
    keep_running,
    planning_rate,
    snapshot_from_stats,
    waiting,
)
from optimizer.control.proposal import (
    Running,
    cluster_variants,
    cluster_without,
    make_proposal,
    moved_fraction,
    pipelines,
    placed_replicas,
    predict_placed,
    predict_running,
    remembered,
    running_allocation,
    search_problem,
)
from optimizer.model.alp import Pipeline
from optimizer.model.curves import ProfileBook
from optimizer.placement import Placement, PlacementError, place
from optimizer.plan import keep, planner
from optimizer.plan import target as plan_target
from optimizer.plan.observed import Observed
from optimizer.plan.planner import Plan
from optimizer.search import solve
from optimizer.search.solve import SearchResult
from optimizer.stats.figures import WorkflowStats
from shared.cluster import Cluster, cluster_from_settings
from shared.settings import Settings

__all__ = [
    "RECENT_S",
    "ControlState",
    "PlanningError",
    "StepInput",
    "StepOutput",
    "planned_workflows",
    "safe_plan",
    "step",
]

_L = TypeVar("_L")  # what a plan goes to (a placement)

RECENT_S = 120.0  # a model called this recently is still in use, whatever the window says


class PlanningError(RuntimeError):
    """The search or placement found nothing to roll out (the message says why)."""


@dataclass(frozen=True, slots=True)
class ControlState:
    """What the controller remembers between passes."""

    detector: DetectorState = field(default_factory=DetectorState)
    # per workflow, its last trusted pipeline (a model whose calls all still run stays in it)
    known: Mapping[str, Pipeline] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True, slots=True)
class StepInput:
    """One pass's inputs: ``stats`` of the window ending at ``now`` (``window_s`` long, as the
    detector sees it), ``observed``: what runs; ``recent_models``: models with a call started
    in the last :data:`RECENT_S` seconds (needed only when a change is confirmed)."""

    state: ControlState
    stats: Mapping[str, WorkflowStats]
    window_s: float
    observed: Observed
    book: ProfileBook
    settings: Settings
    now: float
    recent_models: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One pass's decision and what came with it.

    ``state`` is the state to carry on unless the decision is rolled out (then
    :meth:`after_rollout`). ``result``, ``placement``, ``plan`` and ``proposal`` are set once
    a search ended in a proposal to judge; ``search_s`` is how long the search pass took up to
    its end or failure, ``searched_s`` how long :func:`search_and_place` had taken when it
    returned (``None``: it did not run or did not return)."""

    decision: Decision
    state: ControlState
    before: ControlState  # the input state, with this window's pipelines remembered
    running: Running
    predicted_now: Mapping[str, float]
    proposal: Proposal | None = None
    plan: Plan | None = None
    result: SearchResult | None = None
    placement: Placement | None = None
    search_s: float | None = None
    searched_s: float | None = None

    def after_rollout(self, t_end: float, ok: bool) -> ControlState:
        """The state once the rollout of a taken decision ended at ``t_end``: the judged one
        when it succeeded, the one from before the pass when it failed (the change is
        retried), with the cooldown running from ``t_end`` either way."""
        return replace(
            self.state,
            detector=after_rollout(self.state.detector, self.before.detector, t_end, ok),
        )


def planned_workflows(
    stats: Mapping[str, WorkflowStats], baseline_trusted: set[str], min_requests: int
) -> dict[str, WorkflowStats]:
    """The workflows to plan for: those with enough completed requests in the window, and
    those that had enough when last judged (``baseline_trusted``) and still have some. A
    trickle (an index build) is not traffic to plan for; a real workflow dipping below the bar
    keeps its replicas. (A new workflow is planned for once it has enough requests.)"""
    return {
        w: s
        for w, s in stats.items()
        if s.requests >= min_requests or (w in baseline_trusted and s.requests > 0)
    }


def _traffic(
    state: ControlState, stats: Mapping[str, WorkflowStats], min_requests: int
) -> tuple[dict[str, Pipeline], dict[str, float], dict[str, Pipeline]]:
    """The pipelines and rates to plan for, and the pipelines to remember."""
    base = state.detector.baseline
    before = set() if base is None else set(base.trusted(min_requests))
    pipes = {
        w: remembered(p, state.known.get(w))
        for w, p in pipelines(planned_workflows(stats, before, min_requests)).items()
    }
    known = dict(state.known)
    known |= {w: p for w, p in pipes.items() if stats[w].requests >= min_requests}
    rates = {w: s.arrival_rate for w, s in stats.items()}
    # A planned workflow without a completed request in this window (its requests all
    # still running) keeps its pipeline; its rate is the arrivals the store saw (open rows
    # count), or the baseline's when it saw none, until the detector confirms it is gone.
    for w, pipe in known.items():
        if w not in pipes and base is not None and w in base.workflows:
            arrived = stats[w].arrival_rate if w in stats and stats[w].arrivals else 0.0
            pipes[w], rates[w] = pipe, arrived or base.workflows[w].rate
    return pipes, rates, known


def step(inp: StepInput, *, timer: Callable[[], float] = time.perf_counter) -> StepOutput:
    """Detect, judge, and on a confirmed change search, place and plan (module docstring)."""
    cfg = inp.settings.optimizer
    pipes, rates, known = _traffic(inp.state, inp.stats, cfg.min_requests)
    before = replace(inp.state, known=MappingProxyType(known))
    running = running_allocation(inp.observed, pipes, rates)
    placed = placed_replicas(inp.observed)
    predicted_now = predict_running(pipes, inp.book, running, rates, placed)
    det = detect(
        inp.state.detector,
        snapshot_from_stats(inp.now, inp.window_s, inp.stats),
        cfg,
        predicted_now,
    )
    seen = StepOutput(
        Decision(inp.now, "steady", ()), before, before, running, MappingProxyType(predicted_now)
    )
    if not det.act:
        decision, detector = judge(inp.state.detector, det, None, cfg)
        return replace(seen, decision=decision, state=replace(before, detector=detector))
    # An overloaded workflow is planned for where its rate is heading (decide.planning_rate);
    # when that cannot be planned (no placement, no safe rollout order), for the window's rate.
    flows = det.snapshot.workflows
    heading = {
        w: planning_rate(flows[w])
        if w in flows and any(c.kind == "over_capacity" and c.workflow == w for c in det.changes)
        else r
        for w, r in rates.items()
    }
    out = _replan(inp, seen, det, pipes, heading, timer)
    if heading == rates or out.decision.kind != "error":
        return out
    fallback = _replan(inp, seen, det, pipes, rates, timer)
    if fallback.decision.kind == "error":
        return out
    note = f"planned at the window's rates: at the later half's, {out.decision.reasons[-1]}"
    d = fallback.decision
    spent = (out.search_s or 0.0) + (fallback.search_s or 0.0)  # the pass ran both searches
    return replace(fallback, decision=replace(d, reasons=(*d.reasons, note)), search_s=spent)


def _replan(
    inp: StepInput,
    seen: StepOutput,
    det: Detection,
    pipes: Mapping[str, Pipeline],
    rates: Mapping[str, float],
    timer: Callable[[], float],
) -> StepOutput:
    """Search, place and plan for the window's traffic; judge."""
    settings, cfg, prior = inp.settings, inp.settings.optimizer, inp.state.detector
    t0 = timer()
    if not pipes:
        decision, detector = keep_running(
            prior, det, "no workflow has enough traffic to plan for: what runs stays", cfg
        )
        return replace(seen, decision=decision, state=replace(seen.before, detector=detector))
    cluster = cluster_from_settings(settings.cluster)
    search_cluster = cluster_without(cluster, cfg.reserve_gpus)
    searched_s: float | None = None

    def held(decision: Decision, detector: DetectorState) -> StepOutput:
        """Nothing planned this pass: ``decision``, the state before it, the search's time."""
        return replace(
            seen,
            decision=decision,
            state=replace(seen.before, detector=detector),
            search_s=timer() - t0,
            searched_s=searched_s,
        )

    try:
        models = {st.model for p in pipes.values() for st in p.stages}
        unknown = sorted(models - set(settings.rollout.revisions()))
        if unknown:
            raise PlanningError(
                f"model(s) {', '.join(unknown)} not in rollout.models: the daemon cannot start them"
            )
        missing = sorted(models - {k.model for k in inp.book.profiles})
        if missing:
            raise PlanningError(
                f"no profile for model(s) {', '.join(missing)}: the daemon profiles a model it "
                "sees in traffic on free GPUs (optimizer.reprofile), or run `scepsy profile` "
                "(profiles are read from the store)"
            )
        problem = search_problem(settings, pipes, rates, inp.book, search_cluster)
        placed = solve.search_and_place(problem)
        searched_s = timer() - t0
        if placed.placement is None:
            raise PlanningError("no placement fits: " + (placed.failures or ("?",))[-1])
        plan, placement = safe_plan(
            inp.observed, placed.result, placed.placement, settings, cluster, search_cluster
        )
        called = inp.recent_models | {m for ws in inp.stats.values() for m in ws.models}
        orphaned = sorted(set(plan.dropped) & called)
        if orphaned:  # a workflow below min_requests still calls them: wait for it
            return held(
                *waiting(
                    prior,
                    det,
                    f"waiting: the plan would stop serving {', '.join(orphaned)}, which still "
                    "get calls from a workflow without enough requests to plan for yet",
                )
            )
        whole = predict_placed(pipes, inp.book, placed.result, placement, rates)
        # requests that arrived in the window and did not complete: the backlog a move meets
        backlog = {w: max(0.0, float(s.arrivals - s.requests)) for w, s in inp.stats.items()}
        plan, where, dip, stage = transition.first_move(
            plan, inp.observed, pipes, inp.book, rates, backlog, whole, cfg
        )
        proposal = replace(
            make_proposal(placed.result, plan, seen.predicted_now, rates, where),
            dip_s=dip,
            staged=stage,
        )
    except (PlanningError, ValueError) as exc:  # SearchError, ProfileError, ... are these
        return held(*failed(prior, det, f"{type(exc).__name__}: {exc}"))
    decision, detector = judge(prior, det, proposal, cfg)
    return replace(
        seen,
        decision=decision,
        state=replace(seen.before, detector=detector),
        proposal=proposal,
        plan=plan,
        result=placed.result,
        placement=placement,
        search_s=searched_s,
        searched_s=searched_s,
    )


def quickest(options: Sequence[tuple[Plan, _L]]) -> tuple[Plan, _L] | None:
    """The safe plan with the fewest cold-start rounds, then the fewest replicas started; the
    first of equals (callers list the search's own layout first); ``None`` if none is safe."""
    safe = [o for o in options if o[0].safe]
    return min(safe, key=lambda o: (o[0].rounds, moved_fraction(o[0]))) if safe else None


def safe_plan(
    observed: Observed,
    result: SearchResult,
    placement: Placement,
    settings: Settings,
    cluster: Cluster,
    search_cluster: Cluster,
) -> tuple[Plan, Placement]:
    """Among ``placement`` and the other layouts of the same allocation (the
    ``search_cluster``'s GPUs listed in other orders, each also with the running groups the
    allocation still asks for kept where they run), the one whose plan leaves no served model
    without a replica in the fewest cold-start rounds (``Plan.rounds``), then starting the
    fewest replicas, ``placement`` first on ties; with the layout it goes to.
    :class:`PlanningError` if no layout's plan is safe."""
    revisions = settings.rollout.revisions()
    plan = planner.make_plan(
        observed, plan_target.target_from_placement(placement, revisions), cluster
    )
    if plan.empty:
        return plan, placement
    floors = {m.name: m.min_memory_bytes for m in settings.rollout.models}
    demands = solve.replica_demands(result, floors)
    options = [(plan, placement)]
    # Each layout also with the running groups the allocation still asks for kept where they
    # run (optimizer.plan.keep): on a full cluster that is often the only safe order.
    variants = cluster_variants(search_cluster)
    kept = keep.kept_places(observed, demands, search_cluster, revisions)
    layouts = [(v, None) for v in variants[1:]] + [(v, kept) for v in variants if kept]
    for variant, fixed in layouts:
        try:
            other = place(variant, demands, fixed)
        except PlacementError:
            continue
        alt = planner.make_plan(
            observed, plan_target.target_from_placement(other, revisions), cluster
        )
        options.append((alt, other))
    best = quickest(options)
    if best is not None:
        return best
    raise PlanningError(
        f"no rollout order keeps every model served ({', '.join(plan.outages)} would be "
        "without a replica for a while); optimizer.reserve_gpus leaves room for "
        "temporary copies"
    )

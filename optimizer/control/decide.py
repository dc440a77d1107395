"""Change detection and the rollout decision of the optimizer daemon (pure).

Role: DESIGN §3.8's "detect change → ... → if infeasible or the gain beats a threshold and the
cooldown has passed → roll out", as two pure steps over frozen values, so that fake-time tests
can drive them with any sequence of windows:

1. :func:`detect` compares one window's :class:`Snapshot` with the *baseline* (the snapshot the
   running allocation was planned or last judged for) and returns the changes: the first trusted
   traffic ever (``initial``), a new workflow or a new model in a workflow (at once), and, only
   once they held for ``windows_to_confirm`` consecutive windows, a rate shift past
   ``rate_change_threshold`` (in one direction: a streak resets when the sign flips), a token
   length drift, observed latency straying from the running allocation's prediction, or the
   running allocation predicted past capacity at the observed arrival rate (``over_capacity``:
   a replica that became slower lowers its curve while overloaded, when too few requests
   complete to judge latency; both checked only on windows starting after the last rollout
   ended). An overload is confirmed after ``overload_windows_to_confirm`` windows, fewer:
   its backlog grows while it waits; and at once when the live window shows it too (requests
   slower than the baseline's by ``latency_drift_threshold``, or too few completing while
   enough arrive). An overloaded workflow is planned for its rate in the window's later half
   when that is higher (:func:`planning_rate`: a rising rate). Once the cooldown after a
   rollout that stopped at a serving waypoint of its plan has passed (``unfinished``:
   :mod:`optimizer.control.transition`), the rest of the move is searched for again. A
   confirmed change means "search again".
2. :func:`judge` takes the search's proposal (:class:`Proposal`: per workflow the running
   allocation's and the proposal's predicted latency at the observed rate, and how much of
   the allocation the move restarts) and decides. A rollout happens only after the cooldown, and
   only when the running allocation cannot serve the traffic, or when the rate-weighted relative
   gain is at least ``min_gain`` *and* the request-seconds it saves over ``horizon_s`` outweigh
   the move's cost. The cost (assumed model): for ``cold_start_s`` the moved fraction of the
   allocation is not serving, so that fraction of the traffic pays its current latency again;
   plus the backlog of the rounds that leave a workflow short (``Proposal.dip_s``).
   The cooldown does not hold a proposal that serves traffic the running allocation cannot
   (``urgent``): that backlog only grows while it waits; after a failed rollout it does (a
   backoff, not a retry loop).

Invariants:
- every call returns a :class:`Decision` (taken or not) with human-readable reasons;
- no oscillation: a rollout, a decision to keep the running allocation, or a proposal equal to
  it re-bases the baseline on the window it was judged for and clears every streak, so one
  shift is acted on once (a workflow with too few completed requests in that window keeps
  what the baseline knew of it, at the window's rate); a hold for cooldown keeps the
  streaks, so it is acted on after it;
- nothing here reads a clock or a file: time is the snapshot's ``t`` (seconds).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Literal

from optimizer.stats.figures import WorkflowStats
from shared.optimizer_settings import OptimizerSettings

__all__ = [
    "Change",
    "Decision",
    "DecisionKind",
    "Detection",
    "DetectorState",
    "ModelObs",
    "Outlook",
    "Proposal",
    "Snapshot",
    "WorkflowObs",
    "after_rollout",
    "detect",
    "failed",
    "judge",
    "keep_running",
    "planning_rate",
    "snapshot_from_stats",
]

ChangeKind = Literal[
    "initial",
    "new_workflow",
    "new_model",
    "rate_shift",
    "token_drift",
    "latency_drift",
    "over_capacity",
    "unfinished",
]
DecisionKind = Literal[
    "no_data",  # no workflow has enough completed requests yet
    "steady",  # nothing changed
    "pending",  # a change was seen, not yet for windows_to_confirm windows
    "unchanged",  # searched again: the best allocation is the running one
    "hold_cooldown",  # worth acting on, but the last rollout was too recent
    "hold_gain",  # the new allocation does not gain enough to pay for the move
    "rollout",  # roll the proposal out
    "error",  # the search, placement or rollout failed (reasons say why)
]


@dataclass(frozen=True, slots=True)
class ModelObs:
    n: float  # calls per request
    p: float  # request-level parallelism
    prompt_tokens: float  # mean per call (nan: unknown)
    completion_tokens: float


@dataclass(frozen=True, slots=True)
class WorkflowObs:
    workflow: str
    rate: float  # arrivals per second in the window
    requests: int  # completed requests in the window
    latency: float  # observed mean request latency (s)
    models: Mapping[str, ModelObs]
    late_rate: float = math.nan  # arrivals per second over the window's later half


def planning_rate(o: WorkflowObs) -> float:
    """The rate an overloaded workflow is planned for: the window's, or its later half's when
    that is higher (a rising rate: planning for the whole window's would size the allocation
    for a rate already left behind, and roll out twice)."""
    return max(o.rate, o.late_rate) if math.isfinite(o.late_rate) else o.rate


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One window of traffic as the detector sees it; ``t`` is the window's end (s)."""

    t: float
    window_s: float
    workflows: Mapping[str, WorkflowObs]

    def trusted(self, min_requests: int) -> dict[str, WorkflowObs]:
        return {k: w for k, w in self.workflows.items() if w.requests >= min_requests}


def snapshot_from_stats(t: float, window_s: float, stats: Mapping[str, WorkflowStats]) -> Snapshot:
    """The detector's view of :func:`optimizer.stats.reader.summarise` output."""
    flows = {}
    for name, ws in stats.items():
        if ws.arrivals == 0 and ws.requests == 0:
            continue
        models = {
            m: ModelObs(ms.n, ms.p_agg, ms.prompt_tokens.mean, ms.completion_tokens.mean)
            for m, ms in ws.models.items()
        }
        flows[name] = WorkflowObs(
            name,
            ws.arrival_rate,
            ws.requests,
            ws.latency_mean,
            MappingProxyType(models),
            ws.arrival_rate_late,
        )
    return Snapshot(t, window_s, MappingProxyType(flows))


@dataclass(frozen=True, slots=True)
class Change:
    kind: ChangeKind
    workflow: str
    model: str | None
    relative: float  # the relative change that triggered it (nan where not a ratio)
    reason: str


@dataclass(frozen=True, slots=True)
class DetectorState:
    """What the detector remembers between windows."""

    baseline: Snapshot | None = None  # what the running allocation was judged for
    streaks: Mapping[str, int] = field(default_factory=dict)  # signal key -> windows in a row
    last_rollout_end: float | None = None
    last_rollout_ok: bool = True  # a failed one backs off for the whole cooldown, urgent or not
    unfinished: bool = False  # the last rollout was a staged plan's prefix: search again later


@dataclass(frozen=True, slots=True)
class Detection:
    t: float
    changes: tuple[Change, ...]  # confirmed: search again
    pending: tuple[Change, ...]  # seen, not yet confirmed
    streaks: Mapping[str, int]
    snapshot: Snapshot

    @property
    def act(self) -> bool:
        return bool(self.changes)


def _rel(new: float, old: float) -> float:
    if not (math.isfinite(new) and math.isfinite(old)):
        return math.nan
    if old == 0.0:
        return 0.0 if new == 0.0 else math.inf
    return (new - old) / old


def _overload_seen(
    o: WorkflowObs, base: WorkflowObs, window_s: float, cfg: OptimizerSettings
) -> str:
    """What in the live window shows an overload ("": nothing does)."""
    if o.requests >= cfg.min_requests:
        if base.latency > 0 and o.latency > (1 + cfg.latency_drift_threshold) * base.latency:
            return f"observed latency {base.latency:.3g}s -> {o.latency:.3g}s"
        return ""
    if base.requests >= cfg.min_requests and o.rate * window_s >= cfg.min_requests:
        return f"{o.requests} of {round(o.rate * window_s)} requests completed in the window"
    return ""


def detect(
    state: DetectorState,
    snap: Snapshot,
    cfg: OptimizerSettings,
    predicted_now: Mapping[str, float] | None = None,
) -> Detection:
    """Changes of ``snap`` against the baseline; ``predicted_now``: per workflow, the running
    allocation's predicted latency at the snapshot's rate (for the latency-drift check)."""
    trusted = snap.trusted(cfg.min_requests)
    base = state.baseline
    if base is None:
        changes = tuple(
            Change(
                "initial",
                w,
                None,
                math.nan,
                f"{w}: first trusted window ({o.requests} requests, {o.rate:.3g}/s)",
            )
            for w, o in sorted(trusted.items())
        )
        return Detection(snap.t, changes, (), {}, snap)
    now: list[Change] = []
    ended = state.last_rollout_end
    if state.unfinished and (ended is None or snap.t - ended >= cfg.cooldown_s):
        now.append(
            Change(
                "unfinished",
                "*",
                None,
                math.nan,
                "the last rollout stopped at a waypoint of its plan that serves the traffic",
            )
        )
    seen: list[tuple[str, Change]] = []  # (streak key, change) past a threshold this window
    for w, o in sorted(trusted.items()):
        if w not in base.workflows:
            now.append(
                Change(
                    "new_workflow",
                    w,
                    None,
                    math.nan,
                    f"{w}: new workflow ({o.requests} requests, {o.rate:.3g}/s)",
                )
            )
            continue
        old = base.workflows[w]
        for m in sorted(set(o.models) - set(old.models)):
            now.append(Change("new_model", w, m, math.nan, f"{w}: now calls {m}"))
        for m in sorted(set(o.models) & set(old.models)):
            for what in ("prompt_tokens", "completion_tokens"):
                r = _rel(getattr(o.models[m], what), getattr(old.models[m], what))
                if math.isfinite(r) and abs(r) > cfg.token_drift_threshold:
                    seen.append(
                        (
                            f"tokens:{w}:{m}:{what}",
                            Change(
                                "token_drift",
                                w,
                                m,
                                r,
                                f"{w}/{m}: mean {what.replace('_', ' ')} "
                                f"{getattr(old.models[m], what):.0f} -> {getattr(o.models[m], what):.0f}",
                            ),
                        )
                    )
        pred = (predicted_now or {}).get(w)
        after = state.last_rollout_end is None or snap.t - snap.window_s >= state.last_rollout_end
        if pred is not None and after and math.isfinite(pred):
            r = _rel(o.latency, pred)
            if math.isfinite(r) and abs(r) > cfg.latency_drift_threshold:
                seen.append(
                    (
                        f"latency:{w}",
                        Change(
                            "latency_drift",
                            w,
                            None,
                            r,
                            f"{w}: observed latency {o.latency:.3g}s vs predicted {pred:.3g}s",
                        ),
                    )
                )
    # What runs cannot carry the traffic by the profiles as corrected (a replica that became
    # slower teaches its capacity while overloaded, when too few requests complete to judge
    # latency): a workflow with arrivals predicted past capacity. Confirmed at once when the
    # live traffic corroborates it (requests slower than the baseline's by the latency drift
    # threshold, or too few completing to judge while enough arrive): two signals that do not
    # share their noise, and the backlog grows while a further window is waited for.
    corroborated: set[str] = set()
    for w, o in sorted(snap.workflows.items()):
        pred = (predicted_now or {}).get(w)
        after = state.last_rollout_end is None or snap.t - snap.window_s >= state.last_rollout_end
        if pred is not None and math.isinf(pred) and o.rate > 0 and after and w in base.workflows:
            reason = f"{w}: what runs cannot carry {o.rate:.3g}/s by the profiles"
            if planning_rate(o) > o.rate:
                reason += f" ({o.late_rate:.3g}/s in the window's later half: planned for that)"
            evidence = _overload_seen(o, base.workflows[w], snap.window_s, cfg)
            if evidence:
                corroborated.add(f"capacity:{w}")
                reason += f"; {evidence}"
            seen.append((f"capacity:{w}", Change("over_capacity", w, None, math.nan, reason)))
    for w, old in sorted(base.workflows.items()):
        if old.requests < cfg.min_requests and w not in trusted:
            continue  # a trickle (an index build, a probe) is not traffic to plan for
        rate = snap.workflows[w].rate if w in snap.workflows else 0.0
        r = _rel(rate, old.rate)
        if abs(r) > cfg.rate_change_threshold:
            sign = "+" if r > 0 else "-"
            seen.append(
                (
                    f"rate{sign}:{w}",
                    Change(
                        "rate_shift",
                        w,
                        None,
                        r,
                        f"{w}: arrival rate {old.rate:.3g}/s -> {rate:.3g}/s ({r:+.0%})",
                    ),
                )
            )
    streaks: dict[str, int] = {}
    for key, _ in seen:
        streaks[key] = state.streaks.get(key, 0) + 1
    overload = min(cfg.overload_windows_to_confirm, cfg.windows_to_confirm)
    need = {
        key: (1 if key in corroborated else overload)
        if c.kind == "over_capacity"
        else cfg.windows_to_confirm
        for key, c in seen
    }
    confirmed = [c for key, c in seen if streaks[key] >= need[key]]
    pending = [
        replace(c, reason=f"{c.reason} [{streaks[key]}/{need[key]} windows]")
        for key, c in seen
        if streaks[key] < need[key]
    ]
    return Detection(
        snap.t, tuple(now + confirmed), tuple(pending), MappingProxyType(streaks), snap
    )


@dataclass(frozen=True, slots=True)
class Outlook:
    """One workflow at the observed rate: the running allocation's and the proposal's
    predicted latency (``inf``: cannot serve it, or not allocated at all)."""

    workflow: str
    rate: float
    current: float
    proposed: float


@dataclass(frozen=True, slots=True)
class Proposal:
    """What the search proposes, as the decision needs it."""

    outlook: tuple[Outlook, ...]
    feasible: bool  # the proposal covers every workflow's rate with headroom
    moved_fraction: float  # replicas the move starts / replicas of the proposal, in [0, 1]
    same: bool  # the proposal is what runs (its plan has no steps)
    relaxed: str = ""  # how the search relaxed its margins to cover every rate ("": it did not)
    # request-seconds lost where the plan's rounds leave a workflow short (transition.dip_cost)
    dip_s: float = 0.0
    # the plan is a prefix of the search's (transition.first_move): why ("": the whole plan)
    staged: str = ""


@dataclass(frozen=True, slots=True)
class Decision:
    t: float
    kind: DecisionKind
    reasons: tuple[str, ...]
    changes: tuple[Change, ...] = ()
    gain: float | None = None  # rate-weighted relative latency gain
    benefit_s: float | None = None  # request-seconds saved over the horizon
    cost_s: float | None = None  # request-seconds the move costs

    @property
    def taken(self) -> bool:
        return self.kind == "rollout"


def _weighted(outlook: tuple[Outlook, ...], which: Literal["current", "proposed"]) -> float:
    total = sum(o.rate for o in outlook)
    if total <= 0:
        return math.inf
    return sum(o.rate * (o.current if which == "current" else o.proposed) for o in outlook) / total


def _rebased(state: DetectorState, det: Detection, min_requests: int) -> DetectorState:
    """The baseline becomes the judged window, except that a workflow trusted before and not
    in it (too few of its requests completed: under overload they all outlast the window)
    keeps what was known of it, with the window's rate: its models, tokens and completed
    count stay comparable, so they do not come back as "new" once requests complete again."""
    snap, base = det.snapshot, state.baseline
    kept = (
        {}
        if base is None
        else {
            w: replace(old, rate=o.rate)
            for w, o in snap.workflows.items()
            if o.requests < min_requests
            and (old := base.workflows.get(w)) is not None
            and old.requests >= min_requests
        }
    )
    if kept:
        snap = replace(snap, workflows=MappingProxyType({**snap.workflows, **kept}))
    return replace(state, baseline=snap, streaks=MappingProxyType({}), unfinished=False)


def judge(
    state: DetectorState, det: Detection, proposal: Proposal | None, cfg: OptimizerSettings
) -> tuple[Decision, DetectorState]:
    """The decision for one window, and the detector state to carry to the next.

    ``proposal`` is needed only when ``det.act``; the caller searches only then."""
    reasons = tuple(c.reason for c in det.changes)
    keep = replace(state, streaks=det.streaks)
    if not det.act:
        if state.baseline is None:
            return Decision(
                det.t,
                "no_data",
                (f"no workflow has {cfg.min_requests} completed requests in the window yet",),
            ), keep
        if det.pending:
            return Decision(
                det.t, "pending", tuple(c.reason for c in det.pending), det.pending
            ), keep
        return Decision(det.t, "steady", ("no change past the thresholds",)), keep
    if proposal is None:
        raise ValueError("a confirmed change needs a proposal to judge")
    if proposal.relaxed:
        reasons += (
            f"searched on {proposal.relaxed}: no allocation covers every rate with the "
            "configured margins",
        )
    current = _weighted(proposal.outlook, "current")
    proposed = _weighted(proposal.outlook, "proposed")
    # What runs cannot serve the traffic and the proposal can: every window waited is backlog
    # that only grows, so no cooldown holds it (as an autoscaler scales up at once and only
    # stabilises scaling down). A proposal that cannot serve it either waits, or it would
    # roll out again and again for nothing.
    urgent = state.last_rollout_ok and not math.isfinite(current) and math.isfinite(proposed)
    since = math.inf if state.last_rollout_end is None else det.t - state.last_rollout_end
    cooling = since < cfg.cooldown_s
    if cooling and not urgent:
        left = cfg.cooldown_s - since
        return Decision(
            det.t, "hold_cooldown", (*reasons, f"cooldown: {left:.0f}s left"), det.changes
        ), keep
    if proposal.same:
        return Decision(
            det.t, "unchanged", (*reasons, "the best allocation is the running one"), det.changes
        ), _rebased(state, det, cfg.min_requests)
    if not math.isfinite(current):
        if cooling:
            reasons += ("cooldown waived: what runs cannot serve the traffic, the proposal can",)
        short = [o.workflow for o in proposal.outlook if not math.isfinite(o.current)]
        why = f"the running allocation cannot serve {', '.join(short)} at the observed rate"
        if not proposal.feasible and not math.isfinite(proposed):
            why += " (neither can the proposal: it serves as much as the cluster allows)"
        staged = (proposal.staged,) if proposal.staged else ()
        rebased = _rebased(state, det, cfg.min_requests)
        return (
            Decision(det.t, "rollout", (*reasons, why, *staged), det.changes),
            replace(rebased, unfinished=bool(proposal.staged)),
        )
    gain = (current - proposed) / current if current > 0 else 0.0
    benefit = cfg.horizon_s * sum(o.rate * (o.current - o.proposed) for o in proposal.outlook)
    cost = (
        cfg.cold_start_s
        * proposal.moved_fraction
        * sum(o.rate * o.current for o in proposal.outlook)
        + proposal.dip_s
    )
    dip = (
        f", {proposal.dip_s:.3g} of it while a round leaves a workflow short"
        if proposal.dip_s > 0
        else ""
    )
    figures = (
        f"predicted latency {current:.3g}s -> {proposed:.3g}s ({gain:+.0%}); saves "
        f"{benefit:.3g} request-s over {cfg.horizon_s:.0f}s against a move cost of "
        f"{cost:.3g} request-s ({proposal.moved_fraction:.0%} of replicas restart{dip})"
    )
    if gain >= cfg.min_gain and benefit > cost:
        kind: DecisionKind = "rollout"
    else:
        kind = "hold_gain"
        figures += (
            f"; below min_gain {cfg.min_gain:.0%}"
            if gain < cfg.min_gain
            else "; the move costs more than it saves"
        )
    return (
        Decision(det.t, kind, (*reasons, figures), det.changes, gain, benefit, cost),
        _rebased(state, det, cfg.min_requests),
    )


def keep_running(
    state: DetectorState, det: Detection, why: str, cfg: OptimizerSettings
) -> tuple[Decision, DetectorState]:
    """Nothing to plan for (every workflow went quiet): what runs stays, judged for now."""
    return (
        Decision(det.t, "unchanged", (*(c.reason for c in det.changes), why), det.changes),
        _rebased(state, det, cfg.min_requests),
    )


def waiting(state: DetectorState, det: Detection, reason: str) -> tuple[Decision, DetectorState]:
    """A plan that has to wait for traffic (it would stop a model that a workflow with too
    few requests to plan for still calls): nothing done, the streaks kept so the change is
    retried next window; ``pending``, since waiting for data is no failure."""
    return (
        Decision(det.t, "pending", (*(c.reason for c in det.changes), reason), det.changes),
        replace(state, streaks=det.streaks),
    )


def failed(state: DetectorState, det: Detection, reason: str) -> tuple[Decision, DetectorState]:
    """The search or placement failed: record why, keep the streaks (retry next window)."""
    return (
        Decision(det.t, "error", (*(c.reason for c in det.changes), reason), det.changes),
        replace(state, streaks=det.streaks),
    )


def after_rollout(
    decided: DetectorState, before: DetectorState, t_end: float, ok: bool
) -> DetectorState:
    """State once a rollout ended at ``t_end``: ``decided`` (judge's) when it succeeded; when
    it failed, the state from before it (so the change is retried), both with the cooldown
    running from ``t_end``."""
    return replace(decided if ok else before, last_rollout_end=t_end, last_rollout_ok=ok)

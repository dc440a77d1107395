"""When the daemon profiles a model on its own, and where the profiling replica may run (pure).

Role: the decision half of the daemon's reprofiling (issue 24, item 2); the effectful half that
starts the replica and replays the trace is :mod:`optimizer.profiling.auto`. :func:`triggers`
reads one pass's figures and returns what is worth profiling, most urgent first:

- ``no_profile``: a model in the window's traffic (and in ``rollout.models``, so it can be
  started) that the profile book has no replayed curve for: the step cannot plan without one;
- ``uncovered``: a (model, GPU type, TP) the last proposal placed a replica at that no replayed
  point measures, so its curve is borrowed from another GPU type or TP; a fractional share of
  one whose points are all whole GPUs, so its share exponents are other models'
  (``reprofile.borrowed_shares``, on by default); with ``reprofile.scaled_shares`` also a
  share that is only scaled from another share; and (``reprofile.packed_shares``, on by
  default) a share measured alone that the placement packs two or more copies of onto one
  GPU, never measured packed: that run starts as many copies as fill one GPU and replays them
  side by side (``copies`` in the request);
- ``drift``: a workflow whose observed mean latency departed from the prediction for what runs
  by more than ``drift_threshold`` (relative to the observed) in ``drift_windows`` consecutive
  passes, each with ``min_requests`` completed requests and all on the same side. A single bad
  window, a thin one or a prediction that flips side never fires; the model profiled is the
  workflow's served model whose last profiling run is oldest, at the key it runs at.

Rate limits: nothing while a run is in flight; a model is not profiled twice in one
arrangement (alone, or packed copies) within ``min_interval_s`` (counted from a run's start, a
failed run counts), so neither is a key: a share measured alone can be measured packed next.

:func:`find_slot` is the GPU budget: a profiling replica gets whole GPUs of the request's type,
``tp`` of them in one NVLink domain (at most ``max_gpus``), that no replica the backend
observes holds (any share, profiling or stopping ones too) and that the proposal being rolled
out does not want. Without such GPUs the request waits; it never preempts a served model.
:func:`choose` puts both together for the daemon.

Invariants: pure (no clock, no I/O; time is ``now``); deterministic order (reasons in the
order above, then by model and key); a request never names a model outside ``servable``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from optimizer.model.curves import ProfileBook
from optimizer.placement import Placement
from optimizer.plan.observed import RunningReplica
from optimizer.stats.figures import WorkflowStats
from shared.cluster import Cluster
from shared.optimizer_settings import ReprofileSettings
from shared.profile_points import ProfileKey, packed_copies

__all__ = [
    "PROFILING_PREFIX",
    "DriftSample",
    "ReprofileChoice",
    "ReprofileReason",
    "ReprofileRequest",
    "ReprofileRun",
    "Slot",
    "TriggerInput",
    "WantedKey",
    "choose",
    "find_slot",
    "is_profiling",
    "triggers",
    "uncovered",
    "wanted_keys",
    "with_copies",
]

ReprofileReason = Literal["no_profile", "uncovered", "drift"]
PROFILING_PREFIX = "profiling-"  # group ids of profiling replicas: never routed, never planned


def is_profiling(replica: RunningReplica) -> bool:
    """Whether ``replica`` is a profiling replica (its group id says so)."""
    return replica.group.startswith(PROFILING_PREFIX)


@dataclass(frozen=True, slots=True)
class WantedKey:
    """A (model, GPU type, TP, share) a replica is placed at; ``copies``: the most replicas of
    it the placement puts on one GPU (1: none beside another copy)."""

    model: str
    gpu_type: str
    tp: int
    share: float
    copies: int = 1


@dataclass(frozen=True, slots=True)
class ReprofileRequest:
    """One profiling run worth starting, and why (``detail`` says it in words); ``copies``
    replicas side by side on one GPU (1: alone; more: packed, as many as fill the GPU)."""

    model: str
    gpu_type: str
    tp: int
    share: float
    reason: ReprofileReason
    detail: str
    copies: int = 1

    @property
    def key(self) -> WantedKey:
        return WantedKey(self.model, self.gpu_type, self.tp, self.share, self.copies)


@dataclass(frozen=True, slots=True)
class ReprofileRun:
    """A profiling run the daemon started (``finished`` is ``None`` while it runs)."""

    model: str
    gpu_type: str
    tp: int
    share: float
    reason: ReprofileReason
    started: float
    finished: float | None = None
    copies: int = 1


@dataclass(frozen=True, slots=True)
class DriftSample:
    """One pass's prediction for what ran against the window's observation, per workflow.
    ``index`` counts passes, so that consecutive passes can be told apart from a gap."""

    index: int
    workflow: str
    predicted: float
    observed: float
    requests: int


@dataclass(frozen=True, slots=True)
class TriggerInput:
    """What :func:`triggers` reads. ``running``: the served replicas (profiling ones left
    out); ``wanted``: the keys of the last proposal's placement (empty without one);
    ``drift``: the passes' samples since the allocation or the profiles last changed;
    ``gpu_types``: node name -> its GPU type; ``default_gpu_type``: where a model without a
    profile is first profiled (TP 1, a whole GPU)."""

    stats: Mapping[str, WorkflowStats]
    book: ProfileBook
    running: Sequence[RunningReplica]
    wanted: Sequence[WantedKey]
    drift: Sequence[DriftSample]
    history: Sequence[ReprofileRun]
    servable: frozenset[str]
    gpu_types: Mapping[str, str]
    default_gpu_type: str
    settings: ReprofileSettings
    now: float


def wanted_keys(placement: Placement | None, gpu_types: Mapping[str, str]) -> tuple[WantedKey, ...]:
    """The distinct keys ``placement`` puts replicas at (sorted)."""
    if placement is None:
        return ()
    return with_copies(
        (
            WantedKey(r.demand.model, gpu_types.get(r.node, ""), len(r.gpus), round(r.share, 6)),
            (r.node, g),
        )
        for r in placement.replicas
        for g in r.gpus
    )


def with_copies(on_gpus: Iterable[tuple[WantedKey, Hashable]]) -> tuple[WantedKey, ...]:
    """The distinct keys of ``(key, gpu)`` pairs, one per replica and GPU it spans, each with
    ``copies`` the most replicas of it on one GPU (sorted)."""
    copies: dict[WantedKey, int] = {}
    for (k, _), n in Counter(on_gpus).items():
        copies[k] = max(n, copies.get(k, 1))
    return tuple(sorted((replace(k, copies=n) for k, n in copies.items()), key=_key_order))


def _key_order(k: WantedKey) -> tuple[str, str, int, float, int]:
    return (k.model, k.gpu_type, k.tp, k.share, k.copies)


def _no_profile(inp: TriggerInput) -> list[ReprofileRequest]:
    profiled = {k.model for k in inp.book.profiles}
    callers: dict[str, list[str]] = {}
    for w, ws in sorted(inp.stats.items()):
        for m in ws.models:
            callers.setdefault(m, []).append(w)
    return [
        ReprofileRequest(
            m,
            inp.default_gpu_type,
            1,
            1.0,
            "no_profile",
            f"{m} is called by {', '.join(ws)} and has no profile",
        )
        for m, ws in sorted(callers.items())
        if m not in profiled and m in inp.servable
    ]


def uncovered(
    measured: Iterable[ProfileKey],
    key: WantedKey,
    settings: ReprofileSettings,
    packed: Collection[ProfileKey] = frozenset(),
) -> str | None:
    """Why ``key`` is ``uncovered`` by the replayed keys ``measured`` (the module docstring's
    rule, in words; ``packed``: those of them measured packed), ``None`` where it is covered.
    The alone rules come first: a packed run is asked for once the share's alone curve is
    the book's own (:func:`packed_run`)."""
    same = [p for p in measured if (p.model, p.gpu_type, p.tp) == (key.model, key.gpu_type, key.tp)]
    if not same:
        return (
            f"the proposal places {key.model} at tp={key.tp} on {key.gpu_type}, "
            "where no point was measured"
        )
    if (
        settings.borrowed_shares
        and key.share < 1.0 - 1e-6
        and not any(p.share < 1.0 - 1e-6 for p in same)
    ):
        return (
            f"the proposal places {key.model} at share {key.share:g} on {key.gpu_type} "
            f"(tp={key.tp}), where no fractional share was measured: its share curve "
            "borrows other models' exponents"
        )
    if settings.scaled_shares and not any(abs(p.share - key.share) < 1e-6 for p in same):
        return (
            f"the proposal places {key.model} at share {key.share:g} on {key.gpu_type} "
            f"(tp={key.tp}), scaled from share(s) "
            f"{', '.join(f'{p.share:g}' for p in sorted(same, key=lambda p: p.share))}"
        )
    if (
        settings.packed_shares
        and key.copies > 1
        and key.share < 1.0 - 1e-6
        # measured at this very share (alone): a packed-only key would be read packed alone too
        and any(abs(p.share - key.share) < 1e-6 for p in same)
        and not any(p in packed and abs(p.share - key.share) < 1e-6 for p in same)
    ):
        return (
            f"the proposal packs {key.copies} copies of {key.model} at share {key.share:g} "
            f"onto one {key.gpu_type} GPU (tp={key.tp}), never measured side by side: "
            "what the copies cost each other is modelled, not measured"
        )
    return None


def packed_run(key: WantedKey, settings: ReprofileSettings) -> int:
    """How many copies a run for ``key`` starts: as many as fill one GPU
    (:func:`shared.profile_points.packed_copies`, the book's meaning of a packed point)
    where the packed rule names it, else 1 (alone)."""
    if settings.packed_shares and key.copies > 1 and key.share < 1.0 - 1e-6:
        return packed_copies(key.share)
    return 1


def _uncovered(inp: TriggerInput) -> list[ReprofileRequest]:
    out = []
    for k in inp.wanted:
        if k.model not in inp.servable or k.tp > inp.settings.max_gpus or not k.gpu_type:
            continue
        detail = uncovered(inp.book.profiles, k, inp.settings, inp.book.packed)
        if detail is None:
            continue
        # the alone rules name a key whose share curve is not the book's own: alone first
        alone = uncovered(inp.book.profiles, replace(k, copies=1), inp.settings) is not None
        copies = 1 if alone else packed_run(k, inp.settings)
        out.append(
            ReprofileRequest(k.model, k.gpu_type, k.tp, k.share, "uncovered", detail, copies)
        )
    return out


def drifting(samples: Sequence[DriftSample], settings: ReprofileSettings) -> dict[str, float]:
    """Workflows whose last ``drift_windows`` samples are consecutive passes ending at the
    latest pass, each with ``min_requests`` and finite figures, all past ``drift_threshold``
    on the same side; with the latest relative gap (predicted - observed) / observed."""
    if not samples:
        return {}
    latest = max(s.index for s in samples)
    by_workflow: dict[str, dict[int, DriftSample]] = {}
    for s in samples:
        by_workflow.setdefault(s.workflow, {})[s.index] = s
    out: dict[str, float] = {}
    for w, by_index in sorted(by_workflow.items()):
        run = [by_index.get(latest - k) for k in range(settings.drift_windows)]
        gaps = [_gap(s, settings) for s in run]
        if all(g is not None for g in gaps):
            signs = {math.copysign(1.0, g) for g in gaps if g is not None}
            if len(signs) == 1 and gaps[0] is not None:
                out[w] = gaps[0]
    return out


def _gap(s: DriftSample | None, settings: ReprofileSettings) -> float | None:
    """The sample's relative gap if it counts towards drift, else ``None``."""
    if s is None or s.requests < settings.min_requests:
        return None
    if not (math.isfinite(s.predicted) and math.isfinite(s.observed)) or s.observed <= 0:
        return None
    gap = (s.predicted - s.observed) / s.observed
    return gap if abs(gap) > settings.drift_threshold else None


def _drift(
    inp: TriggerInput, last_start: Mapping[tuple[str, bool], float]
) -> list[ReprofileRequest]:
    out = []
    for w, gap in drifting(inp.drift, inp.settings).items():
        models = set(inp.stats[w].models) if w in inp.stats else set()
        served = sorted(
            (r for r in inp.running if r.model in models and r.model in inp.servable),
            key=lambda r: (
                last_start.get((r.model, False), -math.inf),
                r.model,
                r.tp,
                r.share,
                r.id,
            ),
        )
        for r in served:
            gpu_type = inp.gpu_types.get(r.node, "")
            if r.tp > inp.settings.max_gpus or not gpu_type:
                continue
            side = "over" if gap > 0 else "under"
            detail = (
                f"{w}'s latency was {side}-predicted by {abs(gap):.0%} for "
                f"{inp.settings.drift_windows} windows in a row; {r.model} was profiled "
                "longest ago of its models"
            )
            out.append(
                ReprofileRequest(r.model, gpu_type, r.tp, round(r.share, 6), "drift", detail)
            )
            break
    return out


def triggers(inp: TriggerInput) -> list[ReprofileRequest]:
    """What is worth profiling now, most urgent first, within the rate limits (module
    docstring); empty while a run is in flight or when reprofiling is disabled."""
    cfg = inp.settings
    if not cfg.enabled or any(r.finished is None for r in inp.history):
        return []
    last_start: dict[tuple[str, bool], float] = {}
    for r in inp.history:
        at = (r.model, r.copies > 1)
        last_start[at] = max(r.started, last_start.get(at, -math.inf))
    seen: set[WantedKey] = set()
    out = []
    for req in _no_profile(inp) + _uncovered(inp) + _drift(inp, last_start):
        since = inp.now - last_start.get((req.model, req.copies > 1), -math.inf)
        if req.key in seen or since < cfg.min_interval_s:
            continue
        seen.add(req.key)
        out.append(req)
    return out


@dataclass(frozen=True, slots=True)
class Slot:
    """Where a profiling replica runs: whole GPUs of one node."""

    node: str
    gpus: tuple[int, ...]
    gpu_type: str


def find_slot(
    request: ReprofileRequest,
    cluster: Cluster,
    replicas: Iterable[RunningReplica],
    wanted: Placement | None,
    max_gpus: int,
) -> Slot | None:
    """``request.tp`` whole GPUs of ``request.gpu_type`` in one NVLink domain that no observed
    replica holds and ``wanted`` does not place anything on (the last node's highest-numbered
    first, away from where placement packs); ``None`` if there are none or ``tp > max_gpus``."""
    if request.tp > max_gpus:
        return None
    taken = {(r.node, g) for r in replicas for g in r.gpus}
    if wanted is not None:
        taken |= {(r.node, g) for r in wanted.replicas for g in r.gpus}
    for node in reversed(cluster.nodes):
        for domain in reversed(node.domains):
            free = [
                g.index
                for g in domain.gpus
                if g.type == request.gpu_type and (node.name, g.index) not in taken
            ]
            if len(free) >= request.tp:
                return Slot(node.name, tuple(sorted(free)[-request.tp :]), request.gpu_type)
    return None


@dataclass(frozen=True, slots=True)
class ReprofileChoice:
    """What the daemon does about reprofiling this pass: start ``request`` on ``slot``, or
    record that it waits (``waiting`` says why), or nothing (both ``None``)."""

    request: ReprofileRequest | None = None
    slot: Slot | None = None
    waiting: str | None = None


def choose(
    inp: TriggerInput,
    cluster: Cluster,
    observed: Iterable[RunningReplica],
    wanted: Placement | None,
) -> ReprofileChoice:
    """The first request that finds GPUs (:func:`find_slot` over every observed replica,
    ``observed``), or the first one waiting for some."""
    requests = triggers(inp)
    held = tuple(observed)
    for req in requests:
        slot = find_slot(req, cluster, held, wanted, inp.settings.max_gpus)
        if slot is not None:
            return ReprofileChoice(req, slot)
    if not requests:
        return ReprofileChoice()
    req = requests[0]
    return ReprofileChoice(
        req,
        None,
        f"no free {req.gpu_type} GPU for tp={req.tp}: every one is used or wanted by a "
        "served model",
    )

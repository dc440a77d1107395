"""The daemon's reprofiling decisions without a store or a backend (fake time: ``now`` is a
number): each trigger fires when it should and not on noise, the rate limits hold, and the GPU
budget never hands out a GPU a served model holds or a proposal wants."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from optimizer.control.reprofile import (
    DriftSample,
    ReprofileRequest,
    ReprofileRun,
    TriggerInput,
    WantedKey,
    choose,
    find_slot,
    triggers,
    wanted_keys,
)
from optimizer.model.curves import ProfileBook
from optimizer.placement import PlacedReplica, Placement, ReplicaDemand
from optimizer.plan.observed import RunningReplica
from shared.cluster import Cluster
from shared.optimizer_settings import ReprofileSettings
from shared.profile_points import ProfilePoint
from tests.optimizer.control.test_step import RAG, _points, _stats

BOOK = ProfileBook(_points())  # RAG's three models at tp 1, share 1 on a6000
CFG = ReprofileSettings()
NOW = 10_000.0


def _cluster(gpus: int = 4) -> Cluster:
    return Cluster.uniform(1, gpus, gpus, "a6000", 48 << 30, name_prefix="node")


def _replica(
    model: str, gpus: tuple[int, ...], share: float = 1.0, group: str = "g1"
) -> RunningReplica:
    return RunningReplica(
        f"{group}-{model}-{gpus}", group, model, "node0", gpus, share, len(gpus), "http://x", True
    )


def _input(**kw: object) -> TriggerInput:
    base = TriggerInput(
        stats=_stats(1.0),
        book=BOOK,
        running=(),
        wanted=(),
        drift=(),
        history=(),
        servable=frozenset(RAG) | {"new-7b"},
        gpu_types={"node0": "a6000"},
        default_gpu_type="a6000",
        settings=CFG,
        now=NOW,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def _with_new_model(book: ProfileBook = BOOK) -> TriggerInput:
    stats = _stats(1.0)
    ws = stats["rag"]
    models = dict(ws.models) | {"new-7b": replace(ws.models["llama-3-8b"], model="new-7b")}
    return _input(stats={"rag": replace(ws, models=models)}, book=book)


# --- no_profile ------------------------------------------------------------------------------


def test_a_model_in_traffic_without_a_profile_is_profiled_at_tp1_on_a_whole_gpu() -> None:
    reqs = triggers(_with_new_model())
    assert [(r.model, r.gpu_type, r.tp, r.share, r.reason) for r in reqs] == [
        ("new-7b", "a6000", 1, 1.0, "no_profile")
    ]
    assert "rag" in reqs[0].detail


def test_profiled_models_and_models_the_rollout_cannot_start_fire_nothing() -> None:
    assert triggers(_input()) == []
    assert triggers(replace(_with_new_model(), servable=frozenset(RAG))) == []


def test_disabled_fires_nothing() -> None:
    assert triggers(replace(_with_new_model(), settings=replace(CFG, enabled=False))) == []


# --- rate limits -----------------------------------------------------------------------------


def _run(model: str, started: float, finished: float | None) -> ReprofileRun:
    return ReprofileRun(model, "a6000", 1, 1.0, "no_profile", started, finished)


def test_nothing_while_a_run_is_in_flight() -> None:
    inp = replace(_with_new_model(), history=(_run("llama-3-8b", NOW - 5000, None),))
    assert triggers(inp) == []


def test_a_model_is_not_profiled_twice_within_the_interval() -> None:
    recent = _run("new-7b", NOW - CFG.min_interval_s + 1, NOW - 100)
    assert triggers(replace(_with_new_model(), history=(recent,))) == []
    old = _run("new-7b", NOW - CFG.min_interval_s - 1, NOW - 100)
    assert [r.model for r in triggers(replace(_with_new_model(), history=(old,)))] == ["new-7b"]


# --- uncovered -------------------------------------------------------------------------------


def test_a_wanted_tp_that_no_point_measures_fires_and_a_measured_one_does_not() -> None:
    wanted = (WantedKey("llama-3-8b", "a6000", 1, 1.0), WantedKey("llama-3-8b", "a6000", 2, 1.0))
    reqs = triggers(_input(wanted=wanted, settings=replace(CFG, max_gpus=2)))
    assert [(r.model, r.tp, r.reason) for r in reqs] == [("llama-3-8b", 2, "uncovered")]


def test_a_wanted_gpu_type_that_no_point_measures_fires() -> None:
    reqs = triggers(_input(wanted=(WantedKey("llama-3-8b", "h100", 1, 0.5),)))
    assert [(r.gpu_type, r.share, r.reason) for r in reqs] == [("h100", 0.5, "uncovered")]


def test_a_share_of_a_model_with_only_whole_gpus_measured_fires_by_default() -> None:
    wanted = (WantedKey("llama-3-8b", "a6000", 1, 0.5),)
    reqs = triggers(_input(wanted=wanted))
    assert [(r.share, r.reason) for r in reqs] == [(0.5, "uncovered")]
    assert "borrows other models' exponents" in reqs[0].detail
    assert triggers(_input(wanted=wanted, settings=replace(CFG, borrowed_shares=False))) == []
    # a whole GPU it has measured is covered
    assert triggers(_input(wanted=(WantedKey("llama-3-8b", "a6000", 1, 1.0),))) == []


def test_a_scaled_share_fires_only_when_asked_for() -> None:
    # the model has a fractional share measured: another share is scaled from it
    half = [replace(p, share=0.5) for p in _points() if p.model == "llama-3-8b"]
    book = ProfileBook([*_points(), *half])
    wanted = (WantedKey("llama-3-8b", "a6000", 1, 0.25),)
    assert triggers(_input(wanted=wanted, book=book)) == []
    reqs = triggers(_input(wanted=wanted, book=book, settings=replace(CFG, scaled_shares=True)))
    assert [(r.share, r.reason) for r in reqs] == [(0.25, "uncovered")]
    assert "scaled from share(s) 0.5, 1" in reqs[0].detail


def test_a_wanted_key_wider_than_max_gpus_is_not_requested() -> None:
    assert triggers(_input(wanted=(WantedKey("llama-3-8b", "a6000", 2, 1.0),))) == []


def test_wanted_keys_read_the_placement() -> None:
    placement = _placement(("llama-3-8b", (0,), 0.5), ("llama-3-8b", (1,), 0.5))
    assert wanted_keys(placement, {"node0": "a6000"}) == (WantedKey("llama-3-8b", "a6000", 1, 0.5),)
    assert wanted_keys(None, {}) == ()
    # two copies on GPU 0, one on GPU 1: the key is packed two to a GPU
    packed = _placement(
        ("llama-3-8b", (0,), 0.5), ("llama-3-8b", (0,), 0.5), ("llama-3-8b", (1,), 0.5)
    )
    assert wanted_keys(packed, {"node0": "a6000"}) == (
        WantedKey("llama-3-8b", "a6000", 1, 0.5, copies=2),
    )


def _alone_half() -> ProfileBook:
    """RAG's book with the 8B's half share measured alone (what the alone rule profiles)."""
    half = [replace(p, share=0.5, colocation="alone") for p in _points() if p.model == "llama-3-8b"]
    return ProfileBook([*_points(), *half])


def test_packed_copies_never_measured_side_by_side_fire_after_the_alone_share() -> None:
    packed = (WantedKey("llama-3-8b", "a6000", 1, 0.5, copies=2),)
    # the share's alone curve is borrowed: the alone run comes first, one copy
    (first,) = triggers(_input(wanted=packed))
    assert (first.copies, first.share) == (1, 0.5)
    assert "borrows other models' exponents" in first.detail
    # measured alone: now the copies, as many as fill the GPU
    (req,) = triggers(_input(wanted=packed, book=_alone_half()))
    assert (req.copies, req.reason) == (2, "uncovered")
    assert "never measured side by side" in req.detail
    # a quarter share packed two to a GPU is profiled four to a GPU (the book's packed point)
    quarter = [
        replace(p, share=0.25, colocation="alone") for p in _points() if p.model == "llama-3-8b"
    ]
    book = ProfileBook([*_points(), *quarter])
    wanted = (WantedKey("llama-3-8b", "a6000", 1, 0.25, copies=2),)
    assert [r.copies for r in triggers(_input(wanted=wanted, book=book))] == [4]
    # a share only scaled from another (not measured at all): not profiled packed alone
    scaled = (WantedKey("llama-3-8b", "a6000", 1, 0.3, copies=3),)
    assert triggers(_input(wanted=scaled, book=_alone_half())) == []
    # one copy per GPU, or the rule off: nothing
    alone_wanted = (WantedKey("llama-3-8b", "a6000", 1, 0.5),)
    assert triggers(_input(wanted=alone_wanted, book=_alone_half())) == []
    off = replace(CFG, packed_shares=False)
    assert triggers(_input(wanted=packed, book=_alone_half(), settings=off)) == []


def test_a_share_measured_packed_is_covered_and_runs_are_limited_per_arrangement() -> None:
    packed = (WantedKey("llama-3-8b", "a6000", 1, 0.5, copies=2),)
    side = [
        replace(p, share=0.5, colocation="packed") for p in _points() if p.model == "llama-3-8b"
    ]
    measured = ProfileBook([*_alone_points(), *side])
    assert triggers(_input(wanted=packed, book=measured)) == []
    assert measured.packed  # the book tells packed keys apart
    # an alone run of the model an hour ago does not hold back its packed run, a packed one does
    alone_run = ReprofileRun("llama-3-8b", "a6000", 1, 0.5, "uncovered", NOW - 10, NOW - 5)
    got = triggers(_input(wanted=packed, book=_alone_half(), history=(alone_run,)))
    assert [r.copies for r in got] == [2]
    packed_run = replace(alone_run, copies=2)
    assert triggers(_input(wanted=packed, book=_alone_half(), history=(packed_run,))) == []


def _alone_points() -> list[ProfilePoint]:
    return [
        *_points(),
        *(replace(p, share=0.5, colocation="alone") for p in _points() if p.model == "llama-3-8b"),
    ]


# --- drift -----------------------------------------------------------------------------------


def _drift(
    gaps: Sequence[float | None], requests: int = 100, start: int = 0
) -> tuple[DriftSample, ...]:
    """One sample per pass; a gap is (predicted - observed) / observed, ``None``: a pass
    that recorded nothing for the workflow."""
    return tuple(
        DriftSample(start + k, "rag", 1.0 * (1.0 + g), 1.0, requests)
        for k, g in enumerate(gaps)
        if g is not None
    )


def _drift_input(samples: tuple[DriftSample, ...], **kw: object) -> TriggerInput:
    running = (
        _replica("e5-base-v2", (0,)),
        _replica("bge-reranker-base", (1,)),
        _replica("llama-3-8b", (2,), 0.5),
    )
    return _input(drift=samples, running=running, **kw)


def test_drift_held_for_k_windows_fires_for_the_model_profiled_longest_ago() -> None:
    history = (
        _run("e5-base-v2", NOW - 9000, NOW - 8900),
        _run("bge-reranker-base", NOW - 8000, NOW - 7900),
    )  # llama was never profiled by the daemon: it goes first
    reqs = triggers(_drift_input(_drift([0.8, 0.9, 1.0]), history=history))
    assert [(r.model, r.share, r.reason) for r in reqs] == [("llama-3-8b", 0.5, "drift")]
    assert "over-predicted by 100%" in reqs[0].detail


def test_one_bad_window_does_not_fire() -> None:
    assert triggers(_drift_input(_drift([0.0, 0.0, 2.0]))) == []
    assert triggers(_drift_input(_drift([2.0, 0.0, 2.0, 2.0]))) == []


def test_thin_windows_do_not_fire() -> None:
    thin = _drift([1.0, 1.0, 1.0], requests=CFG.min_requests - 1)
    assert triggers(_drift_input(thin)) == []
    mixed = (*_drift([1.0, 1.0]), DriftSample(2, "rag", 2.0, 1.0, 3))
    assert triggers(_drift_input(mixed)) == []


def test_a_gap_below_the_threshold_or_flipping_side_does_not_fire() -> None:
    assert triggers(_drift_input(_drift([0.4, 0.45, 0.49]))) == []
    assert triggers(_drift_input(_drift([0.9, -0.6, 0.9]))) == []


def test_a_pass_missing_from_the_streak_breaks_it() -> None:
    assert triggers(_drift_input(_drift([1.0, None, 1.0, 1.0]))) == []
    # the latest pass recorded the workflow elsewhere: its streak is not the latest
    other = (DriftSample(3, "beam", 1.0, 1.0, 100),)
    assert triggers(_drift_input(_drift([1.0, 1.0, 1.0]) + other)) == []


def test_non_finite_figures_do_not_count() -> None:
    bad = (*_drift([1.0, 1.0]), DriftSample(2, "rag", math.inf, 1.0, 100))
    assert triggers(_drift_input(bad)) == []


def test_drift_respects_the_interval_of_every_candidate_model() -> None:
    history = tuple(_run(m, NOW - 100, NOW - 50) for m in RAG)
    assert triggers(_drift_input(_drift([1.0, 1.0, 1.0]), history=history)) == []


def test_triggers_come_most_urgent_first_one_per_key() -> None:
    inp = replace(
        _drift_input(_drift([1.0, 1.0, 1.0]), wanted=(WantedKey("llama-3-8b", "h100", 1, 1.0),)),
        stats=_with_new_model().stats,
    )
    assert [r.reason for r in triggers(inp)] == ["no_profile", "uncovered", "drift"]


# --- the GPU budget --------------------------------------------------------------------------


def _placement(*replicas: tuple[str, tuple[int, ...], float]) -> Placement:
    return Placement(
        tuple(
            PlacedReplica(ReplicaDemand("rag", m, len(g), s, None, 0), "node0", g, s, 1 << 30)
            for m, g, s in replicas
        )
    )


REQ = ReprofileRequest("new-7b", "a6000", 1, 1.0, "no_profile", "")


def test_the_budget_never_takes_a_gpu_a_replica_holds_even_a_sliver() -> None:
    held = [
        _replica("e5-base-v2", (0,), 0.25),
        _replica("llama-3-8b", (1,)),
        _replica("x", (3,), 0.1),
    ]
    slot = find_slot(REQ, _cluster(), held, None, 1)
    assert slot is not None and slot.gpus == (2,)
    assert find_slot(REQ, _cluster(3), [*held[:2], _replica("x", (2,), 0.1)], None, 1) is None


def test_the_budget_never_takes_a_gpu_the_proposal_wants() -> None:
    held = [_replica("e5-base-v2", (0,))]
    wanted = _placement(("llama-3-8b", (3,), 0.5), ("llama-3-8b", (2,), 1.0))
    slot = find_slot(REQ, _cluster(), held, wanted, 1)
    assert slot is not None and slot.gpus == (1,)
    full = _placement(("llama-3-8b", (1,), 0.5), ("llama-3-8b", (2, 3), 1.0))
    assert find_slot(REQ, _cluster(), held, full, 1) is None


def test_the_budget_needs_the_gpu_type_and_tp_within_max_gpus() -> None:
    assert find_slot(replace(REQ, gpu_type="h100"), _cluster(), [], None, 1) is None
    assert find_slot(replace(REQ, tp=2), _cluster(), [], None, 1) is None
    slot = find_slot(replace(REQ, tp=2), _cluster(), [], None, 2)
    assert slot is not None and slot.gpus == (2, 3)


def test_every_exhaustive_layout_leaves_served_gpus_alone() -> None:
    """Over every way four GPUs can be held by served replicas, the slot is never one held."""
    for mask in range(16):
        held = [_replica("m", (g,), 0.5) for g in range(4) if mask >> g & 1]
        slot = find_slot(REQ, _cluster(), held, None, 1)
        used = {g for r in held for g in r.gpus}
        if len(used) == 4:
            assert slot is None
        else:
            assert slot is not None and not set(slot.gpus) & used


def test_choose_waits_with_the_reason_when_no_gpu_is_free() -> None:
    inp = _with_new_model()
    held = [_replica(m, (g,)) for g, m in enumerate(RAG)]
    got = choose(inp, _cluster(3), held, None)
    assert got.slot is None and got.request is not None and got.request.model == "new-7b"
    assert got.waiting is not None and "no free a6000 GPU" in got.waiting
    started = choose(inp, _cluster(4), held, None)
    assert started.slot is not None and started.slot.gpus == (3,) and started.waiting is None
    assert choose(_input(), _cluster(), held, None).request is None

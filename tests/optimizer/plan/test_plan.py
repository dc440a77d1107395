"""Plans: GPU groups, make-before-break, one-group-at-a-time replacement, safety, JSON, dry-run."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optimizer.placement import PlacementError, ReplicaDemand, place
from optimizer.plan.check import dry_run
from optimizer.plan.observed import Observed, Route, RunningReplica
from optimizer.plan.planner import Plan, make_plan
from optimizer.plan.target import (
    GroupSpec,
    PlanError,
    ReplicaSpec,
    group_specs,
    target_from_placement,
)
from shared.cluster import GB, Cluster

G = 1_000_000_000


def spec(model: str, gpus: Sequence[int], share: float = 1.0, node: str = "n0") -> ReplicaSpec:
    return ReplicaSpec(model, node, tuple(gpus), share, int(share * 48 * G))


def running(groups: Sequence[GroupSpec], *, ready: bool = True, routed: bool = True) -> Observed:
    replicas = tuple(
        RunningReplica(
            r.id,
            g.id,
            r.spec.model,
            g.node,
            r.spec.gpus,
            r.spec.share,
            r.spec.tp,
            f"http://{r.id}:8000",
            ready,
            r.spec.memory_bytes_per_gpu,
            r.spec.revision,
        )
        for g in groups
        for r in g.replicas
    )
    routes = tuple(Route(r.model, r.url) for r in replicas) if routed else ()
    return Observed(replicas, routes)


def kinds(plan: Plan) -> list[tuple[str, tuple[str, ...]]]:
    return [(s.kind, s.models) for s in plan.steps]


def test_groups_join_replicas_sharing_gpus_transitively() -> None:
    groups = group_specs(
        [
            spec("a", [0, 1], 0.5),
            spec("b", [1], 0.5),
            spec("c", [0], 0.5),
            spec("d", [2]),
            spec("e", [0], 0.5, node="n1"),
        ]
    )
    assert [(g.node, g.gpus, g.models) for g in groups] == [
        ("n0", (0, 1), ("a", "b", "c")),
        ("n0", (2,), ("d",)),
        ("n1", (0,), ("e",)),
    ]
    assert groups[0].shared and not groups[1].shared


def test_ids_are_content_digests_independent_of_order() -> None:
    specs = [spec("a", [0], 0.5), spec("b", [0], 0.5), spec("a", [0], 0.5, node="n1")]
    one, two = group_specs(specs), group_specs(reversed(specs))
    assert one == two
    assert len({g.id for g in one}) == 2
    # A different share is a different group (and a different pod).
    assert group_specs([spec("a", [0], 0.4), spec("b", [0], 0.5)])[0].id != one[0].id
    # Identical replicas in one group get distinct ids.
    twins = group_specs([spec("a", [0], 0.5), spec("a", [0], 0.5)])[0]
    assert len({r.id for r in twins.replicas}) == 2


def test_from_nothing_starts_all_then_waits_then_routes() -> None:
    target = group_specs([spec("a", [0]), spec("b", [1], 0.5), spec("c", [1], 0.5)])
    plan = make_plan(Observed(), target)
    assert [s.kind for s in plan.steps] == [
        "start",
        "start",
        "wait_ready",
        "wait_ready",
        "add_route",
        "add_route",
    ]
    assert plan.safe and not plan.kept and not plan.dropped
    dry_run(plan, Observed())


def test_identical_target_gives_an_empty_plan() -> None:
    target = group_specs([spec("a", [0]), spec("b", [1])])
    plan = make_plan(running(target), target)
    assert plan.empty and set(plan.kept) == {g.id for g in target}


def test_kept_group_is_repaired_not_restarted() -> None:
    target = group_specs([spec("a", [0])])
    plan = make_plan(running(target, ready=False, routed=False), target)
    assert [s.kind for s in plan.steps] == ["wait_ready", "add_route"]


def test_make_before_break_when_gpus_are_free() -> None:
    old = group_specs([spec("a", [0]), spec("b", [1])])
    new = group_specs([spec("a", [2]), spec("b", [1])])  # a moves to a free GPU
    plan = make_plan(running(old), new)
    assert kinds(plan) == [
        ("start", ("a",)),
        ("wait_ready", ("a",)),
        ("add_route", ("a",)),
        ("drain", ("a",)),
        ("stop", ("a",)),
    ]
    assert plan.steps[0].gpus == (2,) and plan.steps[-1].gpus == (0,)
    dry_run(plan, running(old))


def test_blocked_groups_are_replaced_one_at_a_time_while_others_serve() -> None:
    # Two whole-GPU replicas of a become two shared GPUs (a + b each): every new group needs
    # the GPU of an old one, so one GPU is switched at a time and a never goes unserved.
    old = group_specs([spec("a", [0]), spec("a", [1])])
    new = group_specs(
        [spec("a", [0], 0.5), spec("b", [0], 0.5), spec("a", [1], 0.5), spec("b", [1], 0.5)]
    )
    plan = make_plan(running(old), new)
    assert [(s.kind, s.gpus) for s in plan.steps] == [
        ("drain", (0,)),
        ("stop", (0,)),
        ("start", (0,)),
        ("wait_ready", (0,)),
        ("add_route", (0,)),
        ("drain", (1,)),
        ("stop", (1,)),
        ("start", (1,)),
        ("wait_ready", (1,)),
        ("add_route", (1,)),
    ]
    assert plan.safe
    lines = dry_run(plan, running(old))
    assert "a=1" in lines[0] and "a=2, b=2" in lines[-1]


def test_blocked_groups_the_traffic_can_spare_are_swapped_together() -> None:
    # Four whole-GPU replicas of a become four shared GPUs: half of a's replicas may go at
    # once, so two rounds (each a drain and a cold start) instead of four.
    old = group_specs([spec("a", [g]) for g in range(4)])
    new = group_specs([x for g in range(4) for x in (spec("a", [g], 0.5), spec("b", [g], 0.5))])
    plan = make_plan(running(old), new)
    assert [(s.kind, s.gpus) for s in plan.steps] == [
        ("drain", (0,)),
        ("drain", (1,)),
        ("stop", (0,)),
        ("stop", (1,)),
        ("start", (0,)),
        ("start", (1,)),
        ("wait_ready", (0,)),
        ("wait_ready", (1,)),
        ("add_route", (0,)),
        ("add_route", (1,)),
        ("drain", (2,)),
        ("drain", (3,)),
        ("stop", (2,)),
        ("stop", (3,)),
        ("start", (2,)),
        ("start", (3,)),
        ("wait_ready", (2,)),
        ("wait_ready", (3,)),
        ("add_route", (2,)),
        ("add_route", (3,)),
    ]
    assert plan.safe and plan.rounds == 2
    lines = dry_run(plan, running(old))
    assert "a=2" in lines[2]  # never fewer than half of a's replicas routed


def test_no_order_keeps_a_sole_replica_so_the_plan_says_unsafe() -> None:
    old = group_specs([spec("a", [0])])
    new = group_specs([spec("a", [0], 0.5), spec("b", [0], 0.5)])
    plan = make_plan(running(old), new)
    assert plan.outages == ("a",) and not plan.safe
    assert "UNSAFE" in plan.render()
    dry_run(plan, running(old))  # declared outages pass the dry-run


def test_spare_gpus_carry_a_sole_replica_while_its_gpu_is_rebuilt() -> None:
    cluster = Cluster.uniform(1, 4, 2, "a6000", 48 * GB, name_prefix="n")
    old = group_specs([spec("a", [0]), spec("c", [2, 3])])
    new = group_specs([spec("a", [0], 0.5), spec("b", [0], 0.5), spec("c", [2, 3])])
    plan = make_plan(running(old), new, cluster)
    assert plan.safe
    (temp,) = plan.temporary
    assert temp.gpus == (1,) and temp.models == ("a",)
    assert [(s.kind, s.gpus) for s in plan.steps] == [
        ("start", (1,)),
        ("wait_ready", (1,)),
        ("add_route", (1,)),
        ("drain", (0,)),
        ("stop", (0,)),
        ("start", (0,)),
        ("wait_ready", (0,)),
        ("add_route", (0,)),
        ("drain", (1,)),
        ("stop", (1,)),
    ]
    dry_run(plan, running(old))
    assert Plan.from_json(plan.to_json()) == plan
    # A tensor-parallel replica needs a whole free NVLink domain: none here, so no copy.
    old2 = group_specs([spec("c", [2, 3]), spec("a", [0])])
    new2 = group_specs([spec("c", [2, 3], 0.5), spec("b", [2], 0.5), spec("a", [0])])
    assert make_plan(running(old2), new2, cluster).outages == ("c",)


def test_a_model_the_target_drops_is_listed_and_removed_last() -> None:
    old = group_specs([spec("a", [0]), spec("z", [1])])
    new = group_specs([spec("a", [0]), spec("b", [2])])
    plan = make_plan(running(old), new)
    assert plan.dropped == ("z",) and plan.safe
    assert kinds(plan)[-2:] == [("drain", ("z",)), ("stop", ("z",))]


def test_unrouted_old_replicas_are_stopped_without_a_drain() -> None:
    old = group_specs([spec("a", [0])])
    plan = make_plan(running(old, routed=False), group_specs([spec("a", [1])]))
    assert "drain" not in [s.kind for s in plan.steps]


def test_plan_round_trips_through_json() -> None:
    old = group_specs([spec("a", [0]), spec("a", [1])])
    new = group_specs([spec("a", [0], 0.5), spec("b", [0], 0.5), spec("c", [2, 3])])
    plan = make_plan(running(old), new)
    assert Plan.from_json(plan.to_json()) == plan


def test_dry_run_catches_a_broken_plan() -> None:
    old = group_specs([spec("a", [0])])
    new = group_specs([spec("a", [0], 0.5), spec("b", [0], 0.5)])
    plan = make_plan(running(old), new)
    reordered = Plan(
        plan.target,
        (plan.steps[2], *plan.steps[:2], *plan.steps[3:]),
        plan.kept,
        plan.outages,
        plan.dropped,
    )
    with pytest.raises(PlanError, match="GPUs still held"):
        dry_run(reordered, running(old))
    undeclared = Plan(plan.target, plan.steps, plan.kept, (), plan.dropped)
    with pytest.raises(PlanError, match="loses its last routed replica"):
        dry_run(undeclared, running(old))
    with pytest.raises(PlanError, match="instead of"):
        dry_run(Plan(plan.target, plan.steps[:2], outages=plan.outages), running(old))


def test_target_from_placement_carries_revisions() -> None:
    cluster = Cluster.uniform(1, 2, 2, "a6000", 48 * GB)
    placement = place(
        cluster,
        [ReplicaDemand("w", "a", 1, 0.5, None, 0), ReplicaDemand("w", "b", 1, 0.5, None, 0)],
    )
    (group,) = target_from_placement(placement, {"a": "r1"})
    assert {(r.spec.model, r.spec.revision) for r in group.replicas} == {("a", "r1"), ("b", "")}


MODELS = ("a", "b", "c")
demand = st.tuples(
    st.sampled_from(MODELS), st.sampled_from([1, 2]), st.sampled_from([0.25, 0.5, 1.0])
)


def _target(cluster: Cluster, ds: list[tuple[str, int, float]]) -> tuple[GroupSpec, ...] | None:
    try:
        placement = place(cluster, [ReplicaDemand("w", m, tp, s, None, 0) for m, tp, s in ds])
    except PlacementError:
        return None
    return target_from_placement(placement)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(st.lists(demand, min_size=1, max_size=6), st.lists(demand, min_size=1, max_size=6))
def test_any_plan_dry_runs_to_its_target(
    old_ds: list[tuple[str, int, float]], new_ds: list[tuple[str, int, float]]
) -> None:
    cluster = Cluster.uniform(2, 4, 2, "a6000", 48 * GB)
    old, new = _target(cluster, old_ds), _target(cluster, new_ds)
    if old is None or new is None:
        return
    plan = make_plan(running(old), new, cluster if len(old_ds) % 2 else None)
    dry_run(plan, running(old))  # raises on any broken invariant
    both = {m for m, _, _ in old_ds} & {m for m, _, _ in new_ds}
    assert set(plan.outages) <= both

    # Make-before-break: a model with a new replica on GPUs no old group holds never goes
    # unserved; and an outage only hits a model whose every old group a new group needs.
    def overlaps_old(g: GroupSpec) -> bool:
        return any(g.overlaps(o.node, o.gpus) for o in old if o.id not in plan.kept)

    def overlaps_new(o: GroupSpec) -> bool:
        return any(o.overlaps(g.node, g.gpus) for g in new if g.id not in plan.kept)

    free_models = {m for g in new if not overlaps_old(g) for m in g.models}
    assert not set(plan.outages) & free_models
    for m in plan.outages:
        assert all(overlaps_new(o) for o in old if m in o.models)
    again = make_plan(running(new), new)
    assert again.empty

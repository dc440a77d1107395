"""Keeping what runs: running groups the new allocation still asks for stay where they run, and
that turns rollouts on a full cluster that would leave a model unserved into safe ones."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optimizer.placement import PlacementError, ReplicaDemand, place
from optimizer.plan.check import dry_run
from optimizer.plan.keep import kept_places
from optimizer.plan.observed import Observed
from optimizer.plan.planner import make_plan
from optimizer.plan.target import GroupSpec, target_from_placement
from shared.cluster import GB, Cluster
from tests.optimizer.plan.test_plan import running

pytestmark = pytest.mark.timeout(120)

CLUSTER = Cluster.uniform(1, 4, 2, "a6000", 48 * GB)  # one node, two NVLink pairs


def demands(*ds: tuple[str, int, float]) -> list[ReplicaDemand]:
    return [ReplicaDemand("w", m, tp, s, None, 0) for m, tp, s in ds]


def runs(*ds: tuple[str, int, float]) -> Observed:
    return running(target_from_placement(place(CLUSTER, demands(*ds))))


def test_a_full_cluster_rollout_that_would_leave_models_unserved_keeps_what_it_can() -> None:
    # Every GPU is busy; the new allocation halves a and b and adds a small d, but keeps c's
    # two half-GPU replicas exactly as they run.
    old = runs(("a", 1, 1.0), ("a", 1, 1.0), ("b", 1, 1.0), ("c", 1, 0.5), ("c", 1, 0.5))
    new = demands(
        ("c", 1, 0.5), ("c", 1, 0.5), ("c", 1, 0.5), ("a", 1, 0.5), ("b", 1, 0.5), ("d", 1, 0.25)
    )
    plain = make_plan(old, target_from_placement(place(CLUSTER, new)), CLUSTER)
    assert not plain.safe and plain.outages == ("a", "b")
    kept = kept_places(old, new, CLUSTER, {})
    (c_group,) = [gid for gid, rs in old.groups().items() if {r.model for r in rs} == {"c"}]
    assert sorted(kept) == [0, 1]  # c's two running replicas serve its first two demands
    placement = place(CLUSTER, new, kept)
    plan = make_plan(old, target_from_placement(placement), CLUSTER)
    assert plan.safe and c_group in plan.kept
    dry_run(plan, old)


def test_a_group_is_kept_whole_or_not_at_all() -> None:
    old = runs(("a", 1, 0.5), ("b", 1, 0.5))  # one GPU group of two replicas
    assert kept_places(old, demands(("a", 1, 0.5)), CLUSTER, {}) == {}
    assert kept_places(old, demands(("a", 1, 0.5), ("b", 1, 0.25)), CLUSTER, {}) == {}
    both = kept_places(old, demands(("b", 1, 0.5), ("x", 1, 1.0), ("a", 1, 0.5)), CLUSTER, {})
    assert sorted(both) == [0, 2]


def test_another_revision_or_gpus_outside_the_cluster_are_not_kept() -> None:
    old = runs(("a", 1, 1.0), ("b", 2, 1.0))
    new = demands(("a", 1, 1.0), ("b", 2, 1.0))
    assert sorted(kept_places(old, new, CLUSTER, {})) == [0, 1]
    assert sorted(kept_places(old, new, CLUSTER, {"a": "v2"})) == [1]  # a is served anew
    smaller = Cluster.uniform(1, 2, 2, "a6000", 48 * GB)  # GPUs 2 and 3 reserved, say
    got = kept_places(old, new, smaller, {})
    assert all(max(gpus) < 2 for _, gpus, _ in got.values())


_DEMAND = st.tuples(
    st.sampled_from(["a", "b", "c"]), st.sampled_from([1, 2]), st.sampled_from([0.25, 0.5, 1.0])
)


def _groups(ds: list[tuple[str, int, float]]) -> tuple[GroupSpec, ...] | None:
    try:
        return target_from_placement(place(CLUSTER, demands(*ds)))
    except PlacementError:
        return None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(st.lists(_DEMAND, min_size=1, max_size=6), st.lists(_DEMAND, min_size=1, max_size=6))
def test_a_kept_layout_holds_every_matched_group_unchanged_and_dry_runs(
    old_ds: list[tuple[str, int, float]], new_ds: list[tuple[str, int, float]]
) -> None:
    old_groups = _groups(old_ds)
    if old_groups is None:
        return
    old = running(old_groups)
    new = demands(*new_ds)
    kept = kept_places(old, new, CLUSTER, {})
    try:
        placement = place(CLUSTER, new, kept)  # checks every placement invariant
    except PlacementError:
        return
    for i, (node, gpus, memory) in kept.items():
        got = placement.replicas[i]
        assert (got.node, got.gpus, got.memory_bytes_per_gpu) == (node, gpus, memory)
    target = target_from_placement(placement)
    kept_gpus = {g for _, gpus, _ in kept.values() for g in gpus}
    matched = {
        gid for gid, rs in old.groups().items() if {g for r in rs for g in r.gpus} <= kept_gpus
    }
    assert matched <= {g.id for g in target}  # each one is the same group, so the same id
    plan = make_plan(old, target, CLUSTER)
    assert matched <= set(plan.kept)
    dry_run(plan, old)

"""Placement: invariants on random clusters and demands (hypothesis), ordering and scoring rules,
and errors that name the replica that does not fit."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optimizer.placement import (
    Placement,
    PlacementError,
    ReplicaDemand,
    check_placement,
    place,
    placement_order,
    violations,
)
from shared.cluster import GB, Cluster, Gpu, Node, NvlinkDomain

MEMORY = {"a6000": 48 * GB, "h100": 80 * GB}


def node(name: str, *domains: tuple[int, ...], gpu_type: str = "a6000") -> Node:
    return Node(
        name,
        tuple(NvlinkDomain(tuple(Gpu(i, gpu_type, MEMORY[gpu_type]) for i in d)) for d in domains),
    )


def demand(
    model: str = "m",
    tp: int = 1,
    share: float = 1.0,
    memory_gb: float | None = None,
    floor_gb: float = 0.0,
    workflow: str = "w",
    gpu_type: str | None = None,
) -> ReplicaDemand:
    memory = None if memory_gb is None else int(memory_gb * GB)
    return ReplicaDemand(workflow, model, tp, share, memory, int(floor_gb * GB), gpu_type)


def where(p: Placement) -> list[tuple[str, tuple[int, ...]]]:
    return [(r.node, r.gpus) for r in p.replicas]


# --- random clusters and demands -----------------------------------------------------------

POW2 = st.sampled_from([1, 2, 4, 8])


@st.composite
def clusters(draw: st.DrawFn, pow2_domains: bool = False) -> Cluster:
    nodes = []
    for n in range(draw(st.integers(1, 4))):
        gpu_type = draw(st.sampled_from(sorted(MEMORY)))
        sizes: list[int] = []
        while sum(sizes) < 8 and (not sizes or draw(st.booleans())):
            size = draw(POW2 if pow2_domains else st.integers(1, 4))
            sizes.append(min(size, 8 - sum(sizes)))
        start, domains = 0, []
        for size in sizes:
            domains.append(tuple(range(start, start + size)))
            start += size
        nodes.append(node(f"n{n}", *domains, gpu_type=gpu_type))
    return Cluster(tuple(nodes))


@st.composite
def cases(draw: st.DrawFn) -> tuple[Cluster, list[ReplicaDemand]]:
    """A cluster and demands whose total size is up to about its GPU count (some do not fit)."""
    cluster = draw(clusters())
    budget = cluster.gpu_count * draw(st.sampled_from([0.5, 0.8, 1.0, 1.2]))
    out: list[ReplicaDemand] = []
    while len(out) < 40:
        tp = draw(st.sampled_from([1, 1, 1, 2, 2, 4, 8]))
        if tp > cluster.max_domain_size and draw(st.integers(0, 9)):
            tp = 1  # mostly demands the topology can host; the rest test the error
        share = draw(st.integers(1, 10)) / 10
        if tp * share > budget:
            break
        budget -= tp * share
        # Floors and explicit memory mostly within what the share gives on an A6000.
        floor = draw(st.integers(0, int(tp * share * 48)))
        explicit = draw(st.booleans())
        out.append(
            demand(
                model=draw(st.sampled_from(["gen", "ver", "emb"])),
                workflow=draw(st.sampled_from(["beam", "rag"])),
                tp=tp,
                share=share,
                memory_gb=draw(st.integers(max(1, floor // tp), 50)) if explicit else None,
                floor_gb=floor,
                gpu_type=draw(st.sampled_from([None] * 20 + [*cluster.gpu_types] * 3 + ["b200"])),
            )
        )
    return cluster, out


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_every_placement_keeps_the_invariants(case: tuple[Cluster, list[ReplicaDemand]]) -> None:
    cluster, ds = case
    try:
        result = place(cluster, ds)
    except PlacementError as exc:
        assert exc.demand_index is not None and 0 <= exc.demand_index < len(ds)
        bad = ds[exc.demand_index]
        assert f"model {bad.model!r} in workflow {bad.workflow!r}" in str(exc)
        return
    assert violations(cluster, result) == []
    assert [r.demand for r in result.replicas] == ds
    for r in result.replicas:
        gpus = [cluster.node(r.node).gpu(i) for i in r.gpus]
        assert len({cluster.node(r.node).domain_of(i).indices for i in r.gpus}) == 1
        assert r.memory_bytes_per_gpu * r.demand.tp >= r.demand.min_memory_bytes
        if r.demand.memory_bytes_per_gpu is None:  # memory in proportion to the share
            assert r.memory_bytes_per_gpu == min(int(r.share * g.memory_bytes) for g in gpus)
    for (name, index), (share, memory) in result.gpu_usage().items():
        assert share <= 1.0 + 1e-9
        assert memory <= cluster.node(name).gpu(index).memory_bytes


@st.composite
def carvings(draw: st.DrawFn) -> tuple[Cluster, list[ReplicaDemand]]:
    """A power-of-two cluster cut into whole-GPU TP groups that fill some of its domains."""
    cluster = draw(clusters(pow2_domains=True))
    out: list[ReplicaDemand] = []
    for n in cluster.nodes:
        for domain in n.domains:
            left = domain.size if draw(st.booleans()) else draw(st.integers(0, domain.size))
            while left:
                tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if t <= left]))
                if domain.size % tp == 0 and left % tp == 0:
                    out.append(demand(model=f"tp{tp}", tp=tp, floor_gb=tp * 10))
                    left -= tp
    seed = draw(st.integers(0, 2**16))
    random.Random(seed).shuffle(out)
    return cluster, out


@settings(max_examples=100, deadline=None)
@given(carvings())
def test_whole_gpu_power_of_two_carvings_always_fit(
    case: tuple[Cluster, list[ReplicaDemand]],
) -> None:
    # Largest first over power-of-two domains leaves every domain's free GPUs a multiple of the
    # next group's size, so a demand that some carving fits is always placed.
    cluster, ds = case
    result = place(cluster, ds)
    assert violations(cluster, result) == []


# --- ordering and scoring rules ------------------------------------------------------------


def test_order_is_tensor_parallel_first_then_larger_first_then_input_order() -> None:
    ds = [
        demand("a", tp=1, share=1.0),
        demand("b", tp=2, share=0.3),
        demand("c", tp=1, share=0.5),
        demand("d", tp=4, share=0.5),
        demand("e", tp=2, share=0.3, memory_gb=20),
        demand("f", tp=1, share=0.5),
        demand("g", tp=2, share=1.0),
    ]
    assert [ds[i].model for i in placement_order(ds)] == ["d", "g", "e", "b", "a", "c", "f"]


def test_tensor_parallel_group_goes_to_the_smallest_balanced_domain() -> None:
    # A TP2 group in the 2-GPU domain keeps the domain level (imbalance 0); in the 4-GPU domain
    # it would leave [1, 1, 0, 0]. So the 4-GPU domain stays whole for the TP4 that follows.
    cluster = Cluster((node("n", (0, 1, 2, 3), (4, 5)),))
    result = place(cluster, [demand("small", tp=2), demand("big", tp=4)])
    assert where(result) == [("n", (4, 5)), ("n", (0, 1, 2, 3))]


def test_least_capacity_among_equally_balanced_domains_across_nodes() -> None:
    # After the 0.6 group sits on n0's first domain, the 0.4 group would leave that domain or a
    # fresh one equally level; the fuller one (least capacity) wins, on either node.
    cluster = Cluster((node("n0", (0, 1), (2, 3)), node("n1", (0, 1))))
    result = place(cluster, [demand("x", tp=2, share=0.4), demand("y", tp=2, share=0.6)])
    assert where(result) == [("n0", (0, 1)), ("n0", (0, 1))]


def test_balance_beats_capacity() -> None:
    # A half-used GPU in domain (0, 1): a 0.5 TP2 group there would leave [1.0, 0.5]; the empty
    # domain (2, 3) stays level, so it wins although it has more capacity.
    cluster = Cluster((node("n", (0, 1), (2, 3)),))
    ds = [demand("big", tp=2, share=0.5), demand("seed", tp=1, share=0.5, memory_gb=1)]
    first = place(cluster, ds[1:])
    assert where(first) == [("n", (0,))]
    both = place(cluster, [demand("seed2", tp=1, share=1.0), *ds])
    # seed2 (whole) then big (TP2) first by order: big → (0, 1), seed2 → 2, seed → 1 or 3.
    assert where(both)[1] == ("n", (0, 1))


def test_sub_gpu_shares_pack_onto_used_gpus_fullest_first() -> None:
    cluster = Cluster((node("n", (0, 1), (2, 3)),))
    ds = [
        demand("a", share=0.6),
        demand("b", share=0.3),
        demand("c", share=0.4),
        demand("d", share=0.3),
        demand("e", share=0.3),
    ]
    # Order: a 0.6 → GPU 0; c 0.4 → GPU 0 (fills it); b 0.3 → no used GPU fits → new GPU;
    # d, e 0.3 → onto b's GPU. Three GPUs stay untouched by sub-GPU shares: 0 and one other.
    result = place(cluster, ds)
    used = {r.gpus for r in result.replicas}
    assert len(used) == 2
    assert where(result)[0] == where(result)[2] == ("n", (0,))
    assert where(result)[1] == where(result)[3] == where(result)[4]


def test_explicit_memory_keeps_replicas_apart() -> None:
    cluster = Cluster((node("n", (0,), (1,)),))
    result = place(cluster, [demand("a", share=0.3, memory_gb=30)] * 2)
    assert {r.gpus for r in result.replicas} == {(0,), (1,)}
    assert all(r.memory_bytes_per_gpu == 30 * GB for r in result.replicas)


def test_gpu_type_is_honoured_on_a_mixed_cluster() -> None:
    cluster = Cluster((node("a", (0, 1)), node("h", (0, 1), gpu_type="h100")))
    result = place(cluster, [demand("x", tp=2, gpu_type="h100"), demand("y", share=0.5)])
    assert where(result)[0] == ("h", (0, 1))
    assert result.replicas[1].memory_bytes_per_gpu == 24 * GB  # half of an A6000


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ds", "index", "reason"),
    [
        (
            [demand("gen", tp=4)],
            0,
            "needs 4 GPUs in one NVLink domain, but the largest domain has 2",
        ),
        ([demand("gen", gpu_type="b200")], 0, "no GPU of type 'b200' in the cluster"),
        ([demand("gen", share=0.5, memory_gb=60)], 0, "needs 60.0 GB per GPU, but the largest"),
        ([demand("gen", share=0.2, floor_gb=16)], 0, "memory floor is 16.0 GB, but 1 GPU(s)"),
        (
            # Larger groups go first, so the last one given is not the one that fails.
            [demand("gen", tp=2, share=0.5), demand("big", tp=2), demand("big", tp=2)],
            0,
            "no NVLink domain has 2 GPUs each with 0.50 share",
        ),
        ([demand("emb", share=0.6)] * 5, 4, "no GPU has 0.60 share and its memory free"),
    ],
)
def test_error_names_the_replica_and_why(ds: list[ReplicaDemand], index: int, reason: str) -> None:
    cluster = Cluster((node("n", (0, 1), (2, 3)),))
    with pytest.raises(PlacementError) as info:
        place(cluster, ds)
    assert info.value.demand_index == index
    bad = ds[index]
    ordinal = sum(1 for d in ds[: index + 1] if d.model == bad.model)
    assert f"replica {ordinal} of model {bad.model!r} in workflow 'w'" in str(info.value)
    assert reason in str(info.value)


def test_check_placement_catches_every_broken_invariant() -> None:
    cluster = Cluster((node("n", (0, 1), (2, 3)),))
    good = place(cluster, [demand("g", tp=2, floor_gb=40), demand("e", share=0.5)])
    check_placement(cluster, good)
    g, e = good.replicas
    broken = {
        "span NVLink domains": dataclasses.replace(g, gpus=(1, 2)),
        "distinct GPUs": dataclasses.replace(g, gpus=(0, 0)),
        "below its floor": dataclasses.replace(g, memory_bytes_per_gpu=10 * GB),
        "not on n": dataclasses.replace(g, gpus=(0, 9)),
        "not in the cluster": dataclasses.replace(g, node="elsewhere"),
        "over 100%": dataclasses.replace(e, gpus=g.gpus[:1]),
        "differs from the demand": dataclasses.replace(e, share=0.2),
    }
    for needle, bad in broken.items():
        replicas = (bad, e) if bad.demand is g.demand else (g, bad)
        with pytest.raises(PlacementError, match=needle):
            check_placement(cluster, Placement(replicas))
    heavy = dataclasses.replace(e, share=0.3, memory_bytes_per_gpu=30 * GB)
    heavy = dataclasses.replace(heavy, demand=dataclasses.replace(heavy.demand, share=0.3))
    apart = Placement(
        (dataclasses.replace(heavy, gpus=(2,)), dataclasses.replace(heavy, gpus=(3,)))
    )
    assert violations(cluster, apart) == []
    together = Placement((dataclasses.replace(heavy, gpus=(2,)),) * 2)
    assert violations(cluster, together) == ["n GPU 2: 60.00 GB used of 48.00 GB"]


def test_bad_demands_are_refused_up_front() -> None:
    with pytest.raises(ValueError, match="tp must be at least 1"):
        demand(tp=0)
    with pytest.raises(ValueError, match="share"):
        demand(share=1.5)
    with pytest.raises(ValueError, match="share"):
        demand(share=0.0)

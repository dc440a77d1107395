"""A model served by whole-GPU replicas and a remainder on a smaller share (``ModelAlloc.rest``)."""

from __future__ import annotations

import numpy as np
import pytest

from optimizer.control.proposal import running_allocation
from optimizer.model.alp import ModelAlloc, Pipeline, Stage, predict
from optimizer.model.batch import predict_many
from optimizer.model.curves import ProfileBook
from optimizer.plan.observed import Observed, RunningReplica
from tests.optimizer.model.test_shares import queue

pytestmark = pytest.mark.timeout(60)

PIPE = Pipeline("rag", (Stage("gen", 1.0, 1.0),))
# measured at both shares: half a GPU serves 4 of the whole GPU's 10 calls/s, 1.5x as slow
BOOK = ProfileBook(queue("gen", 1.0, 10.0, 1.0) + queue("gen", 0.5, 4.0, 1.5))
MIXED = ModelAlloc(3, 1, 1.0, rest=1, rest_share=0.5)


def test_capacity_adds_the_groups_and_latency_weighs_them_by_the_calls_they_serve() -> None:
    got = predict(PIPE, BOOK, {"gen": MIXED}, 17.0, pooling=False)
    assert got.throughput == pytest.approx(3 * 10.0 + 4.0, rel=1e-5)
    # every replica at the same utilisation, 17/34: the whole GPUs serve 30/34 of the calls
    whole = float(BOOK.lookup("gen", 1, 1.0).latency(5.0))
    half = float(BOOK.lookup("gen", 1, 0.5).latency(2.0))
    assert got.latency == pytest.approx((30 * whole + 4 * half) / 34)
    assert got.stages[0].call_rate == pytest.approx(5.0)
    # more than three whole GPUs alone, and on this profile more and faster than seven halves
    alone = predict(PIPE, BOOK, {"gen": ModelAlloc(3)}, 17.0, pooling=False)
    halves = predict(PIPE, BOOK, {"gen": ModelAlloc(7, 1, 0.5)}, 17.0, pooling=False)
    assert alone.throughput < got.throughput and halves.throughput < got.throughput
    assert got.latency < halves.latency


@pytest.mark.parametrize("pooling", [True, False])
def test_the_batch_agrees_with_the_single_prediction(pooling: bool) -> None:
    allocs = [MIXED, ModelAlloc(2, 1, 1.0, 2, 0.5), ModelAlloc(4), ModelAlloc(1, 1, 0.5)]
    batch = predict_many(
        PIPE,
        BOOK,
        12.0,
        [[a.replicas] for a in allocs],
        [[a.tp] for a in allocs],
        [[a.share] for a in allocs],
        pooling=pooling,
        rest=[[a.rest] for a in allocs],
        rest_share=[[a.rest_share] for a in allocs],
    )
    for i, a in enumerate(allocs):
        one = predict(PIPE, BOOK, {"gen": a}, 12.0, pooling=pooling)
        assert batch.throughput[i] == pytest.approx(one.throughput, rel=1e-9)
        assert batch.latency[i] == pytest.approx(one.latency, rel=1e-9)
        assert batch.latency_high[i] == pytest.approx(one.latency_high, rel=1e-9)
    assert np.isinf(batch.latency[3])  # one half GPU (4 calls/s) at 12 calls/s


def test_groups_gpus_and_the_json_shape() -> None:
    assert MIXED.groups == ((3, 1, 1.0), (1, 1, 0.5))
    assert MIXED.count == 4 and MIXED.gpus == pytest.approx(3.5)
    assert MIXED.doc() == {
        "replicas": 3,
        "tp": 1,
        "share": 1.0,
        "gpus": 3.5,
        "rest": 1,
        "rest_share": 0.5,
    }
    assert "rest" not in ModelAlloc(2, 2, 0.5).doc()
    assert MIXED.shares() == "1.00 + 1 x 0.50"
    # the document reads back as the allocation (a report's reader keeps the rest group)
    for a in (MIXED, ModelAlloc(2, 2, 0.5), ModelAlloc(1, 1, 0.25, 2, 0.125)):
        assert ModelAlloc.from_doc(a.doc()) == a


def test_the_running_allocation_keeps_a_remainder_as_its_rest_group() -> None:
    def replica(i: int, share: float, tp: int = 1) -> RunningReplica:
        return RunningReplica(f"g-{i}", "g", "gen", "n0", (i,), share, tp, f"http://g{i}", True)

    mixed = Observed(replicas=(*(replica(i, 1.0) for i in range(3)), replica(3, 0.5)))
    assert running_allocation(mixed, {"rag": PIPE}, {"rag": 10.0}) == {"rag": {"gen": MIXED}}
    tp2 = Observed(replicas=(replica(0, 1.0, 2), replica(2, 1.0, 2), replica(4, 0.5)))
    # beside a TP-2 group, the odd replica is counted with it (the ALP has no such group)
    assert running_allocation(tp2, {"rag": PIPE}, {"rag": 10.0}) == {
        "rag": {"gen": ModelAlloc(3, 2, 1.0)}
    }

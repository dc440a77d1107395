"""control.proposal.predict_running: what runs is predicted where it runs."""

from __future__ import annotations

import pytest

from optimizer.control.proposal import placed_replicas, predict_running, running_allocation
from optimizer.model.alp import Pipeline, Stage
from optimizer.model.curves import ProfileBook
from optimizer.plan.observed import Observed, RunningReplica
from tests.optimizer.model.test_colocation import two_ends
from tests.optimizer.model.test_shares import queue

pytestmark = pytest.mark.timeout(60)

PIPE = {"wf": Pipeline("wf", (Stage("gen", 1.0, 1.0), Stage("emb", 4.0, 2.0)), 1.0, 0.0)}


def _observed(gen_gpu: int, emb_gpu: int) -> Observed:
    return Observed(
        replicas=(
            RunningReplica("g-0", "g", "gen", "n0", (gen_gpu,), 0.5, 1, "http://g", True),
            RunningReplica("e-0", "e", "emb", "n0", (emb_gpu,), 0.5, 1, "http://e", True),
        )
    )


def _predicted(book: ProfileBook, observed: Observed, rate: float) -> float:
    rates = {"wf": rate}
    running = running_allocation(observed, PIPE, rates)
    return predict_running(PIPE, book, running, rates, placed_replicas(observed))["wf"]


def test_a_replica_beside_a_busy_neighbour_is_predicted_slower_than_one_alone() -> None:
    book = ProfileBook(two_ends("gen") + two_ends("emb"))
    together, apart = _observed(0, 0), _observed(0, 1)
    for rate in (0.5, 1.0, 1.5):
        shared, alone = _predicted(book, together, rate), _predicted(book, apart, rate)
        assert alone < shared
        # between the two measured ends
        packed = predict_running(
            PIPE, book, running_allocation(together, PIPE, {"wf": rate}), {"wf": rate}
        )["wf"]
        assert shared <= packed + 1e-9


def test_a_book_without_alone_points_predicts_as_before() -> None:
    book = ProfileBook(queue("gen", 0.5, light=1.6) + queue("emb", 0.5, light=0.2))
    rates = {"wf": 1.0}
    running = running_allocation(_observed(0, 1), PIPE, rates)
    assert predict_running(PIPE, book, running, rates) == predict_running(
        PIPE, book, running, rates, placed_replicas(_observed(0, 1))
    )

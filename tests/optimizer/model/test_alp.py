"""optimizer.model.alp: eqs. 1-2 on M/M/1 profiles, overlap and tool stages, the vectorised batch,
and stages fanned out together."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from optimizer.model.alp import (
    POOLING_EXPONENT,
    ModelAlloc,
    Overlap,
    Pipeline,
    Stage,
    critical_path,
    pooling_factor,
    predict,
)
from optimizer.model.batch import predict_many
from optimizer.model.curves import ProfileBook
from optimizer.model.shares import DEFAULT_BETA, K_DEFAULT
from optimizer.stats.reader import summarise_store
from shared.profile_points import ProfilePoint
from tests.optimizer.conftest import Row, call
from tests.optimizer.model.test_profiles import MU, mm1, queued


def _book() -> ProfileBook:
    return ProfileBook(
        mm1("gen", mu=10.0)
        + mm1("gen", tp=2, mu=18.0, rates=(2, 6, 10, 14, 16, 17, 18, 20))
        + mm1("ver", mu=10.0)
    )


PIPE = Pipeline("beam", (Stage("gen", n=4.0, p=2.0), Stage("ver", n=2.0, p=1.0)))
FANNED = replace(PIPE, overlaps=(Overlap("gen", "ver", 1.2),))


def test_eqs_1_and_2() -> None:
    alloc = {"gen": ModelAlloc(replicas=2), "ver": ModelAlloc(replicas=1)}
    pred = predict(PIPE, _book(), alloc, rate=1.5, pooling=False)
    # gen: 1.5 * 4 / 2 = 3 calls/s per replica -> 1/(10-3); ver: 1.5 * 2 / 1 = 3 -> 1/7
    assert pred.stages[0].call_rate == pytest.approx(3.0)
    assert pred.stages[0].contribution == pytest.approx((1 / 7) * 4 / 2)
    assert pred.stages[1].contribution == pytest.approx((1 / 7) * 2 / 1)
    assert pred.latency == pytest.approx(2 / 7 + 2 / 7)
    # capacities: gen 2 * 10 / 4 = 5, ver 1 * 10 / 2 = 5 -> tie, both 5
    assert pred.throughput == pytest.approx(5.0)
    assert pred.feasible


def test_bottleneck_and_overload() -> None:
    alloc = {"gen": ModelAlloc(replicas=1), "ver": ModelAlloc(replicas=2)}
    pred = predict(PIPE, _book(), alloc, rate=3.0)
    assert pred.bottleneck == "gen"
    assert pred.throughput == pytest.approx(2.5)
    assert not pred.feasible and pred.latency == float("inf")


def test_percentile_uses_the_profile_percentile() -> None:
    alloc = {"gen": ModelAlloc(replicas=2), "ver": ModelAlloc(replicas=1)}
    mean = predict(PIPE, _book(), alloc, rate=1.5, pooling=False)
    p90 = predict(PIPE, _book(), alloc, rate=1.5, stat="p90", pooling=False)
    assert p90.latency == pytest.approx(2.3 * mean.latency)


def test_unprofiled_share_is_scaled_and_flagged() -> None:
    alloc = {"gen": ModelAlloc(replicas=2, share=0.5), "ver": ModelAlloc(replicas=1)}
    pred = predict(PIPE, _book(), alloc, rate=1.0, pooling=False)
    gen = pred.stages[0]
    assert gen.scaled_from == 1.0
    assert gen.capacity == pytest.approx(2 * 5.0 / 4)
    # 2 calls/s on half a GPU: the light-load latency 1/9 stretched by 2^beta (no share pair in
    # the book: the default beta), plus the whole GPU's excess stretched by 2, read at the
    # same utilisation (the whole GPU's 4 calls/s, between its points at 3 and 5)
    light = 1 / 9

    def moved(lat: float) -> float:
        return light * 2**DEFAULT_BETA + (lat - light) * 2

    want = queued(4.0, (3.0, moved(1 / 7)), (5.0, moved(1 / 5)), MU)
    assert gen.call_latency == pytest.approx(want)
    assert gen.call_latency < 2 / (MU - 4.0)  # linear scaling's figure
    assert pred.stages[1].scaled_from is None


def test_bounds_equal_the_estimate_where_every_share_was_profiled() -> None:
    alloc = {"gen": ModelAlloc(replicas=2), "ver": ModelAlloc(replicas=1)}
    pred = predict(PIPE, _book(), alloc, rate=1.5)
    assert pred.capacity_low == pred.throughput
    assert pred.latency_high == pred.latency
    assert all(s.uncertainty == 0 for s in pred.stages)


def test_a_derived_share_widens_capacity_and_latency_bounds() -> None:
    book = _book()
    alloc = {"gen": ModelAlloc(replicas=4, share=0.5), "ver": ModelAlloc(replicas=2)}
    pred = predict(PIPE, book, alloc, rate=1.5, pooling=False)
    gen, ver = pred.stages
    u = K_DEFAULT * math.log(2.0)
    assert gen.uncertainty == pytest.approx(u) and ver.uncertainty == 0
    assert gen.capacity_low == pytest.approx(gen.capacity / (1 + u))
    assert ver.capacity_low == ver.capacity
    assert pred.capacity_low == pytest.approx(min(gen.capacity / (1 + u), ver.capacity))
    # the pessimistic stage: its curve run 1/(1+u) as fast, read at the same call rate
    slow = book.lookup("gen", 1, 0.5).pessimistic()
    assert gen.contribution_high == pytest.approx(float(slow.latency(gen.call_rate)) * 4 / 2)
    assert gen.contribution_high > gen.contribution
    assert pred.latency_high == pytest.approx(gen.contribution_high + ver.contribution)
    # past the lower capacity bound the upper latency bound is unbounded, not the estimate
    over = predict(PIPE, book, alloc, 0.5 * (pred.capacity_low + pred.throughput), pooling=False)
    assert math.isfinite(over.latency) and math.isinf(over.latency_high)


@pytest.mark.parametrize("pipe", [PIPE, FANNED], ids=["serial", "fanned"])
def test_batch_agrees_with_single(pipe: Pipeline) -> None:
    rng = np.random.default_rng(3)
    c = 200
    replicas = rng.integers(1, 5, size=(c, 2))
    tp = np.stack([rng.choice([1, 2], size=c), np.ones(c, dtype=int)], axis=1)
    share = rng.choice([0.25, 0.5, 1.0], size=(c, 2))
    book = _book()
    batch = predict_many(pipe, book, 2.0, replicas, tp, share)
    for i in range(0, c, 7):
        alloc = {
            st.model: ModelAlloc(int(replicas[i, j]), int(tp[i, j]), float(share[i, j]))
            for j, st in enumerate(pipe.stages)
        }
        one = predict(pipe, book, alloc, 2.0)
        assert batch.throughput[i] == pytest.approx(one.throughput)
        assert pipe.stages[int(batch.bottleneck[i])].model == one.bottleneck or (
            batch.throughput[i] == pytest.approx(one.throughput)
        )
        if np.isinf(one.latency):
            assert np.isinf(batch.latency[i])
        else:
            assert batch.latency[i] == pytest.approx(one.latency)
        assert bool(batch.scaled[i, 0]) == (one.stages[0].scaled_from is not None)
        assert batch.throughput_low[i] == pytest.approx(one.capacity_low)
        assert batch.uncertainty[i, 0] == pytest.approx(one.stages[0].uncertainty)
        if np.isinf(one.latency_high):
            assert np.isinf(batch.latency_high[i])
        else:
            assert batch.latency_high[i] == pytest.approx(one.latency_high)
            assert batch.latency_high[i] >= batch.latency[i]


def test_pooling_shrinks_the_excess_over_light_load_by_a_fraction_of_the_queue_ratio() -> None:
    book = _book()
    pipe = Pipeline("chat", (Stage("gen", n=1.0, p=1.0),))
    one, two = {"gen": ModelAlloc(replicas=1)}, {"gen": ModelAlloc(replicas=2)}
    # one replica: pooling changes nothing
    assert predict(pipe, book, one, 6.0).latency == pytest.approx(
        predict(pipe, book, one, 6.0, pooling=False).latency
    )
    pooled = predict(pipe, book, two, 12.0).stages[0]
    separate = predict(pipe, book, two, 12.0, pooling=False).stages[0]
    light = 1.0 / (MU - 1.0)  # the M/M/1 profile's lightest point (1 call/s)
    rho = 6.0 / MU
    factor = pooling_factor(rho, 2)
    assert factor == pytest.approx(rho ** (6**0.5 - 2) / 2)
    assert pooled.call_latency == pytest.approx(
        light + (separate.call_latency - light) * factor**POOLING_EXPONENT
    )
    # far less than a shared FCFS queue would gain, and never below light load
    assert light + (separate.call_latency - light) * factor < pooled.call_latency
    assert pooled.call_latency < separate.call_latency
    assert pooled.capacity == separate.capacity


def test_calls_that_follow_their_prefix_do_not_pool() -> None:
    # A stage with n calls per request: only the first is placed freely by the router; the
    # rest follow the request's prompt prefix to its replica, so 1/n of the gain remains.
    book = _book()
    sticky = Pipeline("loop", (Stage("gen", n=4.0, p=1.0),))
    free = Pipeline("chat", (Stage("gen", n=1.0, p=1.0),))
    two = {"gen": ModelAlloc(replicas=2)}
    # both at 6 calls/s per replica
    separate = predict(sticky, book, two, 3.0, pooling=False).stages[0].call_latency
    gain_free = separate - predict(free, book, two, 12.0).stages[0].call_latency
    gain_sticky = separate - predict(sticky, book, two, 3.0).stages[0].call_latency
    assert gain_free > 0
    assert gain_sticky == pytest.approx(gain_free / 4.0)


def test_a_flat_profile_does_not_pool() -> None:
    # A replica whose latency does not grow with its rate has nothing for peers to absorb.
    points = [
        ProfilePoint("gen", "emulator", "H100", 1, 1.0, lam, lam, 0.5, 0.5, 0.9, 1.2, 0.01, 1000)
        for lam in (1.0, 3.0, 5.0, 7.0, 9.0)
    ]
    book = ProfileBook(points)
    pipe = Pipeline("chat", (Stage("gen", n=1.0, p=1.0),))
    alloc = {"gen": ModelAlloc(replicas=3)}
    assert predict(pipe, book, alloc, 24.0).latency == pytest.approx(0.5)


def test_batch_shape_is_checked() -> None:
    with pytest.raises(ValueError):
        predict_many(PIPE, _book(), 1.0, np.ones((3, 3)), np.ones((3, 3)), np.ones((3, 3)))


def _flat(model: str, latency: float) -> list[ProfilePoint]:
    """A model whose calls take ``latency`` at light load (M/M/1 with mu = 100 / latency)."""
    return [
        ProfilePoint(
            model, "emulator", "H100", 1, 1.0, r, r, latency, latency, latency, latency, 0.0, 100
        )
        for r in (0.01, 0.02)
    ] + [
        ProfilePoint(model, "emulator", "H100", 1, 1.0, 1000.0, 50.0, 9.0, 9.0, 9.0, 9.0, 0.0, 100)
    ]


def test_stats_overlap_and_tool_time_reach_the_prediction(
    write_store: Callable[[list[Row]], Path],
) -> None:
    # Each request fans out to gen and ver at once (1 s each), then waits 2 s on a tool, then
    # calls gen again (1 s): the span is 4 s, not 1 + 1 + 1 (serial) and not without the tool.
    rows = []
    for i in range(5):
        t = i * 100.0
        rows += [
            call("f", f"r{i}", "gen", t, t + 1),
            call("f", f"r{i}", "ver", t, t + 1),
            call("f", f"r{i}", "gen", t + 3, t + 4),
        ]
    stats = summarise_store(write_store(rows))["f"]
    assert stats.latency_mean == pytest.approx(4.0)
    book = ProfileBook(_flat("gen", 1.0) + _flat("ver", 1.0))
    alloc = {"gen": ModelAlloc(1), "ver": ModelAlloc(1)}
    full = predict(Pipeline.from_stats(stats), book, alloc, rate=0.01)
    assert full.latency == pytest.approx(4.0, rel=1e-3)
    no_overlap = predict(Pipeline.from_stats(stats, cross_model_overlap=False), book, alloc, 0.01)
    assert no_overlap.latency == pytest.approx(5.0, rel=1e-3)
    no_tool = predict(Pipeline.from_stats(stats, tool_stage=False), book, alloc, 0.01)
    assert no_tool.latency == pytest.approx(2.0, rel=1e-3)


# A slow stage (M/M/1, mu 1 call/s) and a fast one (mu 10) fanned out together; traced at 0.1
# requests/s, where the fast stage's calls (1/9.9 s) lay wholly inside the slow one's (1/0.9 s).
SLOW, FAST = 1 / 0.9, 1 / 9.9
FAN_BOOK = ProfileBook(
    mm1("slow", mu=1.0, rates=(0.1, 0.3, 0.5, 0.7, 0.8, 0.9))
    + mm1("fast", mu=10.0, rates=(0.1, 0.2, 0.8, 1, 3, 5, 7, 9))
)


def _fan(together: float) -> Pipeline:
    traced = Overlap.traced("slow", "fast", together, SLOW, FAST)
    assert traced is not None
    return Pipeline(
        "fan",
        (Stage("slow", 1.0, 1.0), Stage("fast", 1.0, 1.0)),
        overlap=(SLOW + FAST - together) / (SLOW + FAST),
        overlaps=(traced,),
    )


def test_a_hidden_stage_made_faster_does_not_shorten_the_request() -> None:
    pipe = _fan(together=FAST)
    one = {"slow": ModelAlloc(1), "fast": ModelAlloc(1)}
    two = {"slow": ModelAlloc(1), "fast": ModelAlloc(2)}
    # at the traced load the request takes exactly the slow stage's time
    assert predict(pipe, FAN_BOOK, one, 0.1, pooling=False).latency == pytest.approx(SLOW)
    # at 0.8/s the slow stage queues (5 s a call); the fast one still runs beside it, hidden,
    # so a second fast replica changes nothing
    loaded = [predict(pipe, FAN_BOOK, a, 0.8, pooling=False) for a in (one, two)]
    assert loaded[1].stages[1].contribution < loaded[0].stages[1].contribution
    assert [p.latency for p in loaded] == pytest.approx([5.0, 5.0])
    # a single traced ratio would have scaled the slow stage's queueing down with it
    scalar = replace(pipe, overlaps=())
    ratio = [predict(scalar, FAN_BOOK, a, 0.8, pooling=False).latency for a in (one, two)]
    assert ratio[1] < ratio[0] < 5.0


def test_overlap_is_exact_at_the_traced_load_and_bounded_elsewhere() -> None:
    pipe = _fan(together=FAST / 2)  # half of the fast stage ran beside the slow one
    alloc = {"slow": ModelAlloc(1), "fast": ModelAlloc(1)}
    traced = predict(pipe, FAN_BOOK, alloc, 0.1, pooling=False)
    assert traced.latency == pytest.approx(SLOW + FAST - FAST / 2)
    for rate in (0.3, 0.5, 0.7, 0.85):
        pred = predict(pipe, FAN_BOOK, alloc, rate, pooling=False)
        x, y = (s.contribution for s in pred.stages)
        both = x + y - pred.latency
        assert both == pytest.approx(min(pipe.overlaps[0].coupling * x * y / (x + y), y))
        assert 0 < both <= y and pred.latency >= x


def test_three_stages_at_once_are_never_shorter_than_the_longest() -> None:
    pipe = Pipeline(
        "three",
        tuple(Stage(m, 1.0, 1.0) for m in "abc"),
        overlaps=(Overlap("a", "b", 2.0), Overlap("a", "c", 2.0), Overlap("b", "c", 2.0)),
    )
    path = critical_path(pipe, [[1.0, 1.0, 1.0], [4.0, 1.0, np.inf]])
    assert path[0] == pytest.approx(1.0)  # 3 - 3 x min(2 x 1/2, 1) = 0 -> the longest, 1
    assert np.isinf(path[1])


def test_from_figures_drops_pairs_it_cannot_use() -> None:
    pipe = Pipeline.from_figures(
        "w",
        {"a": (1.0, 1.0), "b": (1.0, 1.0)},
        overlaps=[
            Overlap("a", "b", 1.1),
            Overlap("a", "z", 1.0),
            Overlap("a", "a", 1.0),
            Overlap("b", "a", float("nan")),
            Overlap("b", "a", 0.0),
        ],
    )
    assert pipe.overlaps == (Overlap("a", "b", 1.1),)
    assert Overlap.traced("a", "b", 0.0, 1.0, 1.0) is None
    assert Overlap.traced("a", "b", 0.5, 1.0, 1.0) == Overlap("a", "b", 1.0)

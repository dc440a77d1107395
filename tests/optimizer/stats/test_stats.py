"""optimizer.stats.figures against hand-computed values on small crafted traces."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path

import duckdb
import pytest

from optimizer.stats.figures import Window
from optimizer.stats.reader import summarise_store
from optimizer.stats.scan import SAMPLE_MODULUS
from shared.records import CallRecord
from tests.optimizer.conftest import Row, S, call

Write = Callable[[list[Row]], Path]


def _two_requests() -> list[Row]:
    return [
        # request A: gen nested [0,4] ⊃ [1,3], overlapping [2,6]; ver [6,8] after it.
        call("w", "A", "gen", 0, 0.5, call_id="a1", attempt=0, prompt=1000),  # superseded
        call("w", "A", "gen", 0, 4, call_id="a1", attempt=1, prompt=10),
        call("w", "A", "gen", 1, 3, prompt=20),
        call("w", "A", "gen", 2, 6, prompt=30),
        call("w", "A", "ver", 6, 8),
        # request B: gen [10,12]; ver [12,13] and [12,14] overlapping.
        call("w", "B", "gen", 10, 12, prompt=40),
        call("w", "B", "ver", 12, 13),
        call("w", "B", "ver", 12, 14),
        # a call with no request id: counted, excluded.
        call("w", None, "gen", 3, 9, prompt=50),
    ]


def test_hand_computed_values(write_store: Write) -> None:
    stats = summarise_store(write_store(_two_requests()))
    wf = stats["w"]
    assert wf.requests == 2
    assert wf.unidentified_calls == 1
    assert wf.arrival_rate == pytest.approx(1 / 10)  # (2 - 1) arrivals over 10 s
    gen, ver = wf.models["gen"], wf.models["ver"]
    assert gen.calls == 4 and ver.calls == 3  # the retried call counts once
    assert gen.n == pytest.approx(2.0) and ver.n == pytest.approx(1.5)
    # p per request: A gen 10/6, B gen 1 ; A ver 1, B ver 3/2
    assert gen.p == pytest.approx((10 / 6 + 1) / 2)
    assert ver.p == pytest.approx((1 + 1.5) / 2)
    assert gen.p_agg == pytest.approx(12 / 8)
    assert gen.latency_mean == pytest.approx(12 / 4)
    assert ver.latency_mean == pytest.approx(5 / 3)
    assert gen.busy_mean == pytest.approx((6 + 2) / 2)
    # shares of summed LLM time: A gen 10/12, B gen 2/5
    shares = [10 / 12, 2 / 5]
    mean = sum(shares) / 2
    std = math.sqrt(sum((x - mean) ** 2 for x in shares) / 2)
    assert gen.share_mean == pytest.approx(mean)
    assert gen.share_cv == pytest.approx(std / mean)
    assert ver.share_mean == pytest.approx(1 - mean)
    # spans 8 and 4
    assert wf.latency_mean == pytest.approx(6.0)
    assert wf.latency_cv == pytest.approx(2 / 6)
    assert wf.tool_time_mean == pytest.approx(0.0)
    assert wf.overlap_factor == pytest.approx(1.0)
    assert wf.overlaps == {}  # gen and ver only ever run in turn
    # tokens over the window's calls (the unidentified one included, the superseded one not)
    assert gen.prompt_tokens.mean == pytest.approx(30.0)
    assert gen.prompt_tokens.p50 == pytest.approx(30.0)
    assert gen.prompt_tokens.p90 == pytest.approx(46.0)


def test_cross_model_overlap_is_measured(write_store: Write) -> None:
    # gen and ver fan out at once: the critical path is 4 s, not 4 + 4.
    rows = [call("f", "R", "gen", 0, 4), call("f", "R", "ver", 0, 4), call("f", "R", "ver", 1, 3)]
    wf = summarise_store(write_store(rows))["f"]
    assert wf.critical_path_mean == pytest.approx(4.0)
    assert wf.stage_sum_mean == pytest.approx(8.0)
    assert wf.overlap_factor == pytest.approx(0.5)
    assert wf.overlaps == {("gen", "ver"): pytest.approx(4.0)}  # ver's union [0,4] is inside
    assert wf.latency_mean == pytest.approx(4.0)


def test_pairwise_overlaps_are_measured_per_pair_of_models(write_store: Write) -> None:
    # a [0,6] with b [4,8] (2 s together) and c [5,10] (1 s with a, 3 s with b); then a alone.
    rows = [
        call("t", "R", "a", 0, 6),
        call("t", "R", "b", 4, 8),
        call("t", "R", "c", 5, 10),
        call("t", "R", "a", 12, 13),
        call("t", "Q", "a", 0, 1),
        call("t", "Q", "b", 1, 2),
    ]  # strictly in turn
    wf = summarise_store(write_store(rows))["t"]
    assert wf.overlaps == {
        ("a", "b"): pytest.approx(1.0),
        ("a", "c"): pytest.approx(0.5),
        ("b", "c"): pytest.approx(1.5),
    }  # per request, over 2 requests
    assert wf.critical_path_mean == pytest.approx((11 + 2) / 2)


def test_tool_time_is_the_uncovered_gap(write_store: Write) -> None:
    rows = [
        call("t", "R", "gen", 0, 1),
        call("t", "R", "gen", 0.5, 1.5),  # covered [0, 1.5]
        call("t", "R", "ver", 3.5, 4),  # a 2 s tool call between them
    ]
    wf = summarise_store(write_store(rows))["t"]
    assert wf.latency_mean == pytest.approx(4.0)
    assert wf.critical_path_mean == pytest.approx(2.0)
    assert wf.tool_time_mean == pytest.approx(2.0)
    assert wf.tool_time_after_fanout_mean == pytest.approx(2.0)  # the gap follows two at once


def test_tool_time_after_a_fanout_is_reported_apart(write_store: Write) -> None:
    """An agent's step: planner, then workers fanned out with a tool beside them that outlasts
    them (the gap after their join), a planner call, a tool alone, a last planner call."""

    def agent(rid: str, t: float, tool_tail: float) -> list[Row]:
        return [
            call("agent", rid, "planner", t, t + 1.0),
            call("agent", rid, "worker", t + 1.1, t + 1.5),
            call("agent", rid, "worker", t + 1.1, t + 1.6),
            call("agent", rid, "worker", t + 1.1, t + 1.4),
            call("agent", rid, "planner", t + 1.6 + tool_tail, t + 2.6 + tool_tail),
            call("agent", rid, "planner", t + 2.9 + tool_tail, t + 3.9 + tool_tail),
        ]

    # the tool beside the workers ran 0.5 s past their join in R1, and ended before it in R2;
    # a sequential call that starts as the last one ends (R3) is no fan-out
    rows = [
        *agent("R1", 0.0, 0.5),
        *agent("R2", 10.0, 0.0),
        call("agent", "R3", "planner", 20.0, 21.0),
        call("agent", "R3", "planner", 21.0, 22.0),
        call("agent", "R3", "planner", 22.5, 23.0),
    ]
    wf = summarise_store(write_store(rows))["agent"]
    # uncovered: 0.1 before the fan-out, 0.5 after its join (R1), 0.3 of tool alone
    assert wf.tool_time_mean == pytest.approx((0.9 + 0.4 + 0.5) / 3)
    assert wf.tool_time_after_fanout_mean == pytest.approx(0.5 / 3)


def test_window_bounds_arrivals_and_completion(write_store: Write) -> None:
    rows = [
        call("w", "early", "gen", 5, 12),  # arrived before the window: excluded
        call("w", "early", "gen", 12, 13),
        call("w", "in1", "gen", 10, 11),
        call("w", "in2", "gen", 20, 22),
        call("w", "late", "gen", 25, 29),  # arrived in the window, still running at its end
        call("w", None, "gen", 11, 12),
        call("w", None, "gen", 31, 32),  # outside the window: not counted
    ]
    window = Window(t_from_us=10 * S, t_to_us=30 * S, settle_us=2 * S)
    wf = summarise_store(write_store(rows), window)["w"]
    assert wf.arrivals == 3
    assert wf.requests == 2
    assert wf.arrival_rate == pytest.approx(3 / 18)
    assert wf.unidentified_calls == 1
    assert wf.models["gen"].n == pytest.approx(1.0)


def _opened(row: Row) -> Row:
    """The open row the proxy writes for ``row`` while it runs (shared.records)."""
    return CallRecord(*row).opened()


def test_open_rows_are_calls_still_running(write_store: Write) -> None:
    """A request with a call still in flight (an open row no finished row supersedes) has
    arrived but is not complete; a finished row supersedes its open row wherever it lies."""
    queued = call("w", "queued", "gen", 2, None, call_id="q2")  # running, announced
    early = call("w", "queued", "gen", 0, 1)
    only = call("w", "only", "gen", 3, None)  # its first and only call still running
    done = call("w", "done", "gen", 4, 5, call_id="d1")  # finished, announced while running
    done_open = _opened(call("w", "done", "gen", 4, None, call_id="d1"))
    stray = call("w", None, "gen", 6, 7, call_id="u1")  # unidentified, announced too
    # two parallel calls of one request, same model and start: one finished, one running
    par = [
        call("w", "par", "gen", 8, 9, call_id="p1"),
        call("w", "par", "gen", 8, None, call_id="p2"),
    ]
    rows = [
        done_open,
        early,
        _opened(queued),
        _opened(only),
        done,
        stray,
        _opened(call("w", None, "gen", 6, None, call_id="u1")),
        _opened(par[0]),
        par[0],
        _opened(par[1]),
    ]
    window = Window(t_from_us=0, t_to_us=30 * S, settle_us=2 * S)
    wf = summarise_store(write_store(rows), window)["w"]
    assert wf.arrivals == 4  # "only" is seen only through its open row
    assert wf.requests == 1  # "queued", "only" and "par" still run
    assert wf.models["gen"].calls == 1 and wf.models["gen"].latency_mean == pytest.approx(1.0)
    assert wf.unidentified_calls == 1  # the open row does not count a second time


def _share_trace(shares: list[float]) -> list[Row]:
    rows = []
    for i, share in enumerate(shares):
        t0 = i * 100.0
        rows.append(call("b", f"r{i}", "gen", t0, t0 + 10 * share))
        rows.append(call("b", f"r{i}", "ver", t0 + 10 * share, t0 + 10))
    return rows


def test_bimodal_workflow_is_flagged(write_store: Write) -> None:
    rng = random.Random(7)
    shares = [rng.gauss(0.85, 0.03) for _ in range(30)] + [rng.gauss(0.25, 0.03) for _ in range(20)]
    wf = summarise_store(write_store(_share_trace(shares)))["b"]
    assert wf.bimodal is not None
    split = wf.bimodal.split
    assert 0.3 < split.threshold < 0.8
    # gen's share is low in 20 of 50 requests; ver's (its complement) in the other 30
    expected = 20 / 50 if wf.bimodal.model == "gen" else 30 / 50
    assert split.low_fraction == pytest.approx(expected)


def test_unimodal_workflow_is_not_flagged(write_store: Write) -> None:
    rng = random.Random(7)
    shares = [min(max(rng.gauss(0.5, 0.12), 0.05), 0.95) for _ in range(60)]
    wf = summarise_store(write_store(_share_trace(shares)))["b"]
    assert wf.bimodal is None


def _many_requests(n: int) -> list[Row]:
    """``n`` requests of a gen/ver loop with a parallel fan-out of ver calls, and retries."""
    rng = random.Random(7)
    rows: list[Row] = []
    for i in range(n):
        t = i * 0.5
        for _ in range(rng.randint(1, 4)):
            g = rng.uniform(0.5, 2.0)
            rows.append(call("w", f"r{i}", "gen", t, t + g))
            t += g
            for _ in range(rng.randint(1, 3)):  # ver calls at once
                rows.append(call("w", f"r{i}", "ver", t, t + rng.uniform(0.2, 0.6)))
            t += 0.7
        if i % 50 == 0:  # a retried call: its first attempt must not count, sampled or not
            rows.append(call("w", f"r{i}", "gen", t, t + 30, call_id=f"x{i}", attempt=0))
            rows.append(call("w", f"r{i}", "gen", t, t + 1, call_id=f"x{i}", attempt=1))
    return rows


def test_per_request_figures_come_from_a_sample_above_the_cap(write_store: Write) -> None:
    store = write_store(_many_requests(800))
    exact = summarise_store(store, union_cap=None)["w"]
    sampled = summarise_store(store, union_cap=1500)["w"]
    again = summarise_store(store, union_cap=1500)["w"]
    assert exact.union_requests == exact.requests == 800
    # about 1,500 of ~6,000 calls: a quarter of the requests, the same ones every time
    assert 120 < sampled.union_requests < 300
    assert again == sampled
    # counts, call durations and request spans stay exact over every request
    assert sampled.requests == exact.requests and sampled.arrival_rate == exact.arrival_rate
    assert sampled.latency_mean == exact.latency_mean
    assert sampled.latency_cv == exact.latency_cv
    for model in ("gen", "ver"):
        mine, full = sampled.models[model], exact.models[model]
        assert (mine.calls, mine.n, mine.latency_mean) == (full.calls, full.n, full.latency_mean)
        # per-request figures are estimates from the sample, close to the exact ones
        assert mine.requests_calling == pytest.approx(full.requests_calling, rel=0.05)
        assert mine.share_mean == pytest.approx(full.share_mean, rel=0.05)
        assert mine.share_cv == pytest.approx(full.share_cv, rel=0.1)
        assert mine.p_agg == pytest.approx(full.p_agg, rel=0.05)
        assert mine.busy_mean == pytest.approx(full.busy_mean, rel=0.08)
    assert exact.models["ver"].p_agg > 1.3  # the fan-out is there to be measured
    assert sampled.critical_path_mean == pytest.approx(exact.critical_path_mean, rel=0.08)
    assert sampled.overlap_factor == pytest.approx(exact.overlap_factor, rel=0.05)
    assert sampled.tool_time_mean == pytest.approx(exact.tool_time_mean, rel=0.1)


def test_a_small_workflow_keeps_a_sample_of_its_own(write_store: Write) -> None:
    """Beside a busy workflow, a quiet one is not sampled at the busy one's rate: its
    budget is a share of the cap, never under a tenth of it."""
    rows = _many_requests(800)
    rows += [call("q", f"q{i}", "gen", i, i + 0.5) for i in range(100)]
    stats = summarise_store(write_store(rows), union_cap=1500)
    assert stats["w"].union_requests < 400
    assert stats["q"].union_requests == stats["q"].requests == 100


def test_no_workflow_is_left_without_a_sample(write_store: Write) -> None:
    """Three long requests far over the cap: the hash threshold would likely take none of
    them; the sample keeps one, and the exact counts stay."""
    # request ids whose keys all lie above the threshold (a third of the key space)
    con = duckdb.connect()
    keys = dict(
        con.execute(
            f"SELECT 'long' || i, hash('w', 'long' || i) % {SAMPLE_MODULUS} FROM range(100) t(i)"
        ).fetchall()
    )
    con.close()
    ids = [rid for rid, key in keys.items() if key > SAMPLE_MODULUS // 2][:3]
    rows = [
        call("w", rid, "gen", 100 * i + j, 100 * i + j + 0.5)
        for i, rid in enumerate(ids)
        for j in range(50)
    ]
    wf = summarise_store(write_store(rows), union_cap=50)["w"]
    assert wf.requests == 3 and wf.union_requests == 1
    gen = wf.models["gen"]
    assert gen.calls == 150 and gen.n == pytest.approx(50.0)
    assert gen.share_mean == pytest.approx(1.0) and gen.requests_calling >= 1
    assert not math.isnan(wf.critical_path_mean)


def test_everything_is_exact_when_all_calls_fit_under_the_cap(write_store: Write) -> None:
    rows = _many_requests(80)  # ~600 calls
    rows += [call("q", f"q{i}", "gen", i, i + 0.5) for i in range(10)]
    stats = summarise_store(write_store(rows), union_cap=1000)
    assert all(wf.union_requests == wf.requests for wf in stats.values())


def test_a_request_with_a_failed_call_arrives_but_is_no_served_request(write_store: Write) -> None:
    """R2's generation hit a restarting replica: two quick 502s, the client's back-off, then a
    200. Counted as served, R2 would read as 3 gen calls and 2.5 s of tool time."""
    rows = [
        call("w", "R1", "emb", 0, 0.1),
        call("w", "R1", "gen", 0.1, 2.1),
        call("w", "R2", "emb", 1, 1.1),
        call("w", "R2", "gen", 1.1, 1.15, status=502),
        call("w", "R2", "gen", 1.9, 1.95, status=502),
        call("w", "R2", "gen", 3.5, 5.5),
        # a proxy retry is one logical call: its last attempt decides
        call("w", "R3", "emb", 6, 6.1),
        call("w", "R3", "gen", 6.1, 6.2, call_id="g3", attempt=0, status=502),
        call("w", "R3", "gen", 6.1, 8.1, call_id="g3", attempt=1),
        # a client's own mistake is an answer: R4 goes on and is served
        call("w", "R4", "gen", 9, 9.1, status=400),
        call("w", "R4", "gen", 9.1, 11.1),
    ]
    wf = summarise_store(write_store(rows))["w"]
    assert (wf.requests, wf.arrivals) == (3, 4)
    assert wf.models["gen"].n == pytest.approx(4 / 3)
    assert wf.latency_mean == pytest.approx(2.1) and wf.tool_time_mean == pytest.approx(0.0)


def test_a_workflow_with_every_request_still_running_keeps_its_arrivals(write_store: Write) -> None:
    """No request completed in the window (all outlast it): the workflow is still there, with
    the arrivals its open rows show and no per-request figure."""
    rows = [_opened(call("w", f"r{i}", "gen", 10 + i, None)) for i in range(6)]
    rows += [call("w", "r0", "ver", 9, 10)]  # r0's first call ended; its second still runs
    window = Window(t_from_us=0, t_to_us=30 * S, settle_us=5 * S)
    wf = summarise_store(write_store(rows), window)["w"]
    assert wf.requests == 0 and wf.arrivals == 6 and not wf.models
    assert wf.arrival_rate == pytest.approx(6 / 25) and wf.window_s == pytest.approx(25)
    assert math.isnan(wf.latency_mean)


def test_the_later_half_of_the_window_has_its_own_arrival_rate(write_store: Write) -> None:
    """Window [0, 40) s of arrivals (settle 0): 4 requests in the first half, 13 in the later
    one (one still running); a rising rate shows in the later half before it fills the
    window. The store is written in two parts, so the first read sees only the running one."""
    window = Window(t_from_us=0, t_to_us=40 * S, settle_us=0)
    store = write_store([_opened(call("w", "late", "gen", 39.0, None))])
    running = summarise_store(store, window)["w"]  # none completed: arrivals are the figure
    assert running.requests == 0 and running.arrival_rate_late == pytest.approx(1 / 20)
    starts = [2.0, 7.0, 12.0, 17.0] + [20.0 + 1.5 * i for i in range(12)]
    write_store([call("w", f"r{i}", "gen", t, t + 0.5) for i, t in enumerate(starts)])
    wf = summarise_store(store, window)["w"]
    assert wf.arrivals == 17 and wf.arrival_rate == pytest.approx(17 / 40)
    assert wf.arrival_rate_late == pytest.approx(13 / 20)
    assert math.isnan(summarise_store(store)["w"].arrival_rate_late)  # no bounds: unknown

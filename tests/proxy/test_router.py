"""Replica choice: power of two choices, prefix affinity with load fallback, ejection."""

from __future__ import annotations

import random

import pytest

from proxy.errors import ModelNotFound, NoReplica
from proxy.router import Router
from shared.engine_load import EngineLoad
from shared.settings import RoutingSettings, UpstreamSettings


def _router(n: int = 3, clock: list[float] | None = None, **kw: object) -> Router:
    ups = [UpstreamSettings(model="m", url=f"http://r{i}") for i in range(n)]
    t = clock if clock is not None else [0.0]
    return Router(RoutingSettings(**kw), ups, clock=lambda: t[0], rng=random.Random(1))  # type: ignore[arg-type]


def test_least_outstanding_avoids_the_busy_replica() -> None:
    r = _router(2)
    busy = r.pick("m")
    for _ in range(5):
        r.acquire(busy)
    assert all(r.pick("m") is not busy for _ in range(50))


def test_p2c_spreads_load() -> None:
    r = _router(4)
    for _ in range(400):
        r.acquire(r.pick("m"))
    loads = sorted(rep.in_flight for rep in r.replicas())
    assert loads[-1] - loads[0] <= 2


def test_prefix_affinity_follows_the_prefix_and_falls_back_when_busy() -> None:
    r = _router(4, policy="prefix_affinity", prefix_block_chars=16, affinity_slack=2)
    system = "You are a careful math solver. " * 4
    beam = system + "Problem 17: integrate x^2 from 0 to 1. Step 1: the antiderivative is"
    home = r.pick("m", beam)
    r.acquire(home)
    # A longer prompt sharing that prefix (the next beam step) goes to the same replica...
    for i in range(2):
        nxt = r.pick("m", beam + f" x^3/3, branch {i}")
        assert nxt is home
        r.acquire(nxt)
    # ...until it is busier than the least-loaded one by more than the slack.
    assert r.pick("m", beam + " x^3/3, branch 9") is not home
    # A new problem shares only the system prompt: too short a match, goes to the least loaded.
    other = r.pick("m", system + "Problem 99: what is 2+2? Step 1: add")
    assert other.in_flight == 0


@pytest.mark.parametrize(("ratio", "sticks_at_35"), [(1.0, True), (0.0, False)])
def test_under_heavy_load_affinity_tolerates_a_proportional_imbalance(
    ratio: float, sticks_at_35: bool
) -> None:
    """With 20 calls in flight everywhere, a fixed slack of 8 is crossed by ordinary swings;
    the load ratio lets a prefix stay home up to twice its peers' load, never beyond."""
    r = _router(
        2,
        policy="prefix_affinity",
        prefix_block_chars=16,
        affinity_slack=8,
        affinity_load_ratio=ratio,
    )
    beam = "You are a careful math solver. " * 4 + "Problem 17: integrate x^2. Step 1:"
    home = r.pick("m", beam)
    other = next(rep for rep in r.replicas() if rep is not home)
    for _ in range(20):
        r.acquire(other)
    for _ in range(35):
        r.acquire(home)
    assert (r.pick("m", beam + " x^3/3") is home) is sticks_at_35
    for _ in range(6):
        r.acquire(home)  # 41: more than twice the least loaded
    assert r.pick("m", beam + " x^3/3") is other


def test_affinity_is_bounded_by_the_pools_mean_not_its_least_loaded_replica() -> None:
    """In a pool of 8 busy replicas the least loaded one is a swing, no reason to scatter:
    a prefix stays home up to twice the other replicas' mean load. An idle replica is spare
    capacity: it takes the call once home is affinity_slack ahead."""
    r = _router(8, policy="prefix_affinity", prefix_block_chars=16, affinity_slack=8)
    beam = "You are a careful math solver. " * 4 + "Problem 17: integrate x^2. Step 1:"
    home = r.pick("m", beam)
    others = [rep for rep in r.replicas() if rep is not home]
    for n, rep in enumerate(others):
        for _ in range(4 if n == 0 else 20):
            r.acquire(rep)  # their mean: 124 / 7 = 17.7
    for _ in range(35):
        r.acquire(home)
    assert r.pick("m", beam + " x^3/3") is home  # 35 <= 2 x 17.7, though 31 above the least
    r.acquire(home)
    assert r.pick("m", beam + " x^3/3") is others[0]  # 36: past twice the mean
    for _ in range(4):
        r.release(others[0])
    for _ in range(27):
        r.release(home)  # 9 in flight, 9 ahead of an idle replica
    assert r.pick("m", beam + " x^3/3") is others[0]


def test_a_prefix_every_replica_holds_spreads_while_continuations_stick() -> None:
    """A long system prompt shared by every request is cached on every replica after a few
    requests: new requests that match only it go to the least loaded holder, not all to the
    replica that happened to serve it last; each request's own continuation stays home."""
    r = _router(4, policy="prefix_affinity", prefix_block_chars=16, affinity_slack=8)
    system = "You are a careful math solver. Think step by step and check each step. " * 6
    homes = {}
    for i in range(40):  # 40 requests arrive and stay in flight
        prompt = system + f"Problem {i}: integrate x^{i} from 0 to 1, then simplify. "
        rep = r.pick("m", prompt)
        r.acquire(rep)
        homes[i] = (prompt, rep)
    loads = sorted(rep.in_flight for rep in r.replicas())
    assert loads[-1] - loads[0] <= 2, loads  # herding would put ~9 on one before the slack
    for i in range(0, 40, 7):
        prompt, home = homes[i]
        assert r.pick("m", prompt + "step 2 of this problem's own beam") is home


def test_ejection_and_probe_return() -> None:
    clock = [0.0]
    r = _router(2, clock, eject_after_failures=2, eject_seconds=5.0, probe_interval_s=1.0)
    bad = r.replicas()[0]
    r.failed(bad)
    assert bad.active
    r.failed(bad)
    assert bad.ejected and not bad.active
    assert all(r.pick("m") is not bad for _ in range(20))
    assert r.due_probes() == []
    clock[0] = 5.0
    assert r.due_probes() == [bad]
    r.probe_result(bad, healthy=False)
    assert r.due_probes() == []
    clock[0] = 6.0
    r.probe_result(bad, healthy=True)
    assert bad.active and bad.failures == 0


def test_no_replica_and_unknown_model() -> None:
    r = _router(1, eject_after_failures=1)
    with pytest.raises(ModelNotFound):
        r.pick("other")
    r.failed(r.replicas()[0])
    with pytest.raises(NoReplica):
        r.pick("m")


def test_replace_keeps_state_and_drains_removed() -> None:
    r = _router(2)
    a, b = r.replicas()
    r.acquire(a)
    r.acquire(b)
    removed = r.replace(
        [UpstreamSettings(model="m", url=b.url), UpstreamSettings(model="m", url="http://new")]
    )
    assert removed == [a] and a.draining
    assert b in r.replicas() and b.in_flight == 1
    assert all(r.pick("m") is not a for _ in range(20))
    r.release(a)
    assert a not in r.replicas()


def test_an_engine_reported_queue_counts_until_it_is_stale() -> None:
    clock = [0.0]
    r = _router(2, clock=clock, engine_stale_s=3.0)
    a, b = r.replicas()
    r.acquire(a)
    # a's engine holds our one call and 9 from other proxies; b's engine is idle
    r.scraped(a, EngineLoad(running=6.0, waiting=4.0, kv_usage=0.2))
    r.scraped(b, EngineLoad(running=0.0, waiting=0.0, kv_usage=0.0))
    assert r.load(a) == 10.0 and r.load(b) == 0.0
    assert all(r.pick("m") is b for _ in range(20))
    r.scraped(a, None)  # a failed scrape keeps the last figures until they are stale
    clock[0] = 3.5
    assert r.load(a) == 1.0  # local counts only


def test_a_full_kv_cache_counts_its_running_batch_again() -> None:
    r = _router(2)
    a, _ = r.replicas()
    r.scraped(a, EngineLoad(running=4.0, waiting=0.0, kv_usage=0.99))
    assert r.load(a) == 8.0


def test_round_robin_takes_each_replica_in_turn_whatever_its_load() -> None:
    r = _router(3, policy="round_robin")
    first = r.pick("m")
    for _ in range(9):
        r.acquire(first)
    picks = [r.pick("m").url for _ in range(6)]
    assert sorted(picks) == sorted(["http://r0", "http://r1", "http://r2"] * 2)

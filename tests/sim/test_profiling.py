"""Profiling by simulation (sim.profiling): saturation of a dependency-bound workflow's model,
rechecks (noise, and the workflow's fill); the demo's profiles command (sim.profiles)."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from optimizer.model import curves
from optimizer.model.curves import Profile
from optimizer.model.shares import Beta
from shared.profile_points import ProfilePoint, import_json
from sim.profiling import (
    FILL_LATENCIES,
    FOLLOW_TOLERANCE,
    FOLLOW_Z,
    RECHECK_SCALE,
    Measure,
    ProfileJob,
    Reading,
    WorkflowSetup,
    _point,
    decide,
    keeps_up,
    marginal,
    refill_scale,
    run_profile,
    uncertain,
)
from sim.workflows import BeamParams, RagParams, models_of


def test_a_dependency_bound_workflow_falling_behind_is_not_keeping_up() -> None:
    # Beam search sends a request's next verifier calls only when its last ones are done, so
    # past saturation the verifier's submitted calls track its completions (here ~97% of
    # them): the calls piled up there count per request arriving (~23 calls, ~3 at a time).
    case = WorkflowSetup("beam", BeamParams(max_iterations=6), "a6000")
    job = ProfileJob(
        case,
        "llama-3.1-8b-prm",
        1,
        1.0,
        n_per_request=23.1,
        target_calls=100,
        start_rate=1.0,
        min_requests=150,
        parallel=3.0,
    )
    light = _point(job, 50.0, seed=1).point
    assert keeps_up(light.offered_rate, light.throughput)
    reading = _point(job, 66.0, seed=1)
    over = reading.point
    assert not keeps_up(over.offered_rate, over.throughput)
    # the pile's noise is known, and this overload is clear of it
    assert 0 < reading.follow_se < (1 - over.throughput / over.offered_rate - 0.05) / FOLLOW_Z
    calls_alone = replace(job, parallel=None)  # every call judged as if independent
    over = _point(calls_alone, 66.0, seed=1).point
    assert keeps_up(over.offered_rate, over.throughput)


def _fake_measure(true_capacity: float, short_noise_from: float) -> Measure:
    """A replica that sustains ``true_capacity`` calls/s; a one-scale window above
    ``short_noise_from`` reads 8% short (an in-flight swing), a longer window reads true."""

    def measure(job: ProfileJob, rate: float, seed: int, scale: float) -> Reading:
        if rate > true_capacity:
            achieved = 0.8 * rate
        elif scale == 1.0 and rate > short_noise_from:
            achieved = 0.92 * rate
        else:
            achieved = rate
        return Reading(
            ProfilePoint(
                job.model,
                "fake",
                "a6000",
                job.tp,
                job.share,
                rate,
                achieved,
                1.0,
                1.0,
                1.0,
                1.0,
                0.1,
                1000,
            ),
            0.0,
        )

    return measure


def test_a_marginal_overload_is_measured_again_over_a_longer_window() -> None:
    case = WorkflowSetup("beam", BeamParams(), "a6000")
    job = ProfileJob(
        case,
        "gen",
        1,
        1.0,
        n_per_request=40.0,
        target_calls=100,
        start_rate=5.0,
        precision=0.02,
        refine=(),
    )
    points = run_profile(job, _fake_measure(true_capacity=60.0, short_noise_from=45.0))
    profile = Profile.from_points(points)
    # a short window's swing no longer caps the profile at the last rate below 45 calls/s
    assert 0.98 * 60.0 <= profile.saturation <= 60.0 * 1.001
    # a clear overload is not measured twice
    over = [p for p in points if p.offered_rate > 60.0]
    assert over and all(not marginal(p.offered_rate, p.throughput) for p in over)
    assert len({p.offered_rate for p in over}) == len(over)


def test_decide_asks_a_longer_window_only_when_marginal() -> None:
    asked: list[float] = []

    def run(verdicts: dict[float, tuple[bool, bool]]) -> Callable[[float], tuple[bool, bool]]:
        def measure(scale: float) -> tuple[bool, bool]:
            asked.append(scale)
            return verdicts[scale]

        return measure

    assert decide(run({1.0: (False, True), RECHECK_SCALE: (True, False)}))
    assert asked == [1.0, RECHECK_SCALE]
    asked.clear()
    assert not decide(run({1.0: (False, False)}))  # a clear overload is not run again
    assert asked == [1.0]


def _noisy_measure(true_capacity: float, asked: list[tuple[float, float]]) -> Measure:
    """A replica that sustains ``true_capacity`` calls/s, whose readings near it swing: the
    shortfall's standard error is 0.06 / scale, and a one-scale window reads the verdict
    wrong within 15% of capacity (an over-read below it, an under-read above)."""

    def measure(job: ProfileJob, rate: float, seed: int, scale: float) -> Reading:
        asked.append((rate, scale))
        near = abs(rate / true_capacity - 1.0) < 0.15
        if rate > true_capacity:
            achieved = rate if near and scale == 1.0 else 0.85 * rate
        else:
            achieved = 0.9 * rate if near and scale == 1.0 else rate
        point = ProfilePoint(
            job.model,
            "fake",
            "a6000",
            job.tp,
            job.share,
            rate,
            achieved,
            1.0,
            1.0,
            1.0,
            1.0,
            0.1,
            1000,
        )
        return Reading(point, 0.0, 0.06 / scale)

    return measure


def test_a_verdict_within_its_noise_is_measured_again_either_way() -> None:
    case = WorkflowSetup("beam", BeamParams(), "a6000")
    job = ProfileJob(
        case,
        "gen",
        1,
        1.0,
        n_per_request=40.0,
        target_calls=100,
        start_rate=5.0,
        precision=0.02,
        refine=(),
        follow_z=FOLLOW_Z,
        max_scale=4.0,
    )
    asked: list[tuple[float, float]] = []
    points = run_profile(job, _noisy_measure(60.0, asked))
    profile = Profile.from_points(points)
    # neither the short windows' false overloads below 60 nor their false keeping-up above
    # it move the saturation
    assert 0.98 * 60.0 <= profile.saturation <= 60.0 * 1.001
    # rechecked up to 4x, and only the deciding reading of each probe is kept
    assert {scale for _, scale in asked} == {1.0, 2.0, 4.0}
    assert len(points) == sum(1 for _, scale in asked if scale == 1.0)
    without = run_profile(
        replace(job, follow_z=None, max_scale=RECHECK_SCALE), _noisy_measure(60.0, [])
    )
    # the old rule rechecks only a marginal overload: a false keep-up above 60 stands
    assert Profile.from_points(without).saturation > 60.0 * 1.01


def test_uncertain_reads_the_noise_either_side_of_the_tolerance() -> None:
    def reading(shortfall: float, se: float) -> Reading:
        return Reading(
            ProfilePoint(
                "m",
                "fake",
                "a6000",
                1,
                1.0,
                100.0,
                100.0 * (1 - shortfall),
                1.0,
                1.0,
                1.0,
                1.0,
                0.1,
                1000,
            ),
            0.0,
            se,
        )

    assert uncertain(reading(0.0, 0.03))  # kept up, but 0.05 is within 2 x 0.03
    assert not uncertain(reading(0.0, 0.02))
    assert uncertain(reading(0.10, 0.03))  # overloaded, within the noise
    assert not uncertain(reading(0.20, 0.03))
    # without a standard error (or a z), only a marginal overload is rechecked
    assert not uncertain(reading(0.0, float("nan")))
    assert uncertain(reading(0.10, float("nan")))
    assert not uncertain(reading(0.0, 0.03), z=None)


def _filling_measure(true_capacity: float, fill_s: float, asked: list[float]) -> Measure:
    """A replica that sustains ``true_capacity`` calls/s, whose workflow's requests take
    ``fill_s`` to fill their in-flight count: a window after a warm-up of ``w`` reads the
    fill still to come, ``exp(-w / fill_s) x fill_s / window`` of its calls, as a pile (a
    bias that no swing explains: its standard error is small)."""

    def measure(job: ProfileJob, rate: float, seed: int, scale: float) -> Reading:
        asked.append(scale)
        window, warmup = 100.0 * scale, 20.0 * scale
        pile = math.exp(-warmup / fill_s) * fill_s / window
        achieved = rate * (1.0 - pile) if rate <= true_capacity else 0.7 * rate
        point = ProfilePoint(
            job.model,
            "fake",
            "a6000",
            job.tp,
            job.share,
            rate,
            achieved,
            1.0,
            1.0,
            1.0,
            1.0,
            0.1,
            1000,
        )
        return Reading(point, 0.0, 0.005, scale, warmup, window, fill_s)

    return measure


def test_an_overload_the_workflows_fill_explains_is_measured_with_a_longer_warmup() -> None:
    case = WorkflowSetup("beam", BeamParams(), "a6000")
    job = ProfileJob(
        case,
        "gen",
        1,
        1.0,
        n_per_request=40.0,
        target_calls=100,
        start_rate=5.0,
        precision=0.02,
        refine=(),
        follow_z=FOLLOW_Z,
        max_scale=4.0,
        fill_latencies=FILL_LATENCIES,
    )
    asked: list[float] = []
    # a 40 s fill reads 6% short after the one-scale 20 s warm-up: every rate looks overloaded
    points = run_profile(job, _filling_measure(60.0, 40.0, asked))
    assert 0.98 * 60.0 <= Profile.from_points(points).saturation <= 60.0 * 1.001
    assert max(asked) == FILL_LATENCIES * 40.0 / 20.0
    without = run_profile(replace(job, fill_latencies=0.0), _filling_measure(60.0, 40.0, []))
    assert Profile.from_points(without).saturation < 0.5 * 60.0


def test_refill_stands_for_a_backlog() -> None:
    def reading(shortfall: float, scale: float = 1.0, fill_s: float = 40.0) -> Reading:
        point = ProfilePoint(
            "m",
            "fake",
            "a6000",
            1,
            1.0,
            100.0,
            100.0 * (1 - shortfall),
            1.0,
            1.0,
            1.0,
            1.0,
            0.1,
            1000,
        )
        return Reading(point, 0.0, 0.005, scale, 20.0 * scale, 100.0 * scale, fill_s)

    assert refill_scale(reading(0.2), 3.0) == 6.0
    assert refill_scale(reading(0.2), 0.0) is None  # off
    assert refill_scale(reading(0.02), 3.0) is None  # kept up
    assert refill_scale(reading(0.5), 3.0) is None  # more than a 40 s fill piles in 100 s
    assert refill_scale(reading(0.2, scale=6.0), 3.0) is None  # warm-up long enough already
    # a longer run that fell further behind: a backlog
    assert refill_scale(reading(0.25, scale=2.0), 3.0, previous=reading(0.2)) is None
    assert refill_scale(reading(0.1, scale=2.0), 3.0, previous=reading(0.2)) == 6.0


def test_the_keep_up_test_is_the_optimizers() -> None:
    # sim cannot import the optimizer, so it keeps a copy of the tolerance its curves use
    assert FOLLOW_TOLERANCE == curves.FOLLOW_TOLERANCE


# ~4 s; fewer calls per point can leave one with no call started (an infinite latency)
QUICK = ("--calls", "100", "--workers", "1", "--beam", "1,2,2", "--shares", "1,0.25")


def test_the_demo_profiles_command_writes_simulated_points_of_every_demo_model(
    tmp_path: Path,
) -> None:
    # As scepsy demo starts it: its own process, not from the project folder.
    out = tmp_path / "profiles.json"
    done = subprocess.run(
        [sys.executable, "-m", "sim.profiles", "--out", str(out), *QUICK],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "simulated" in done.stdout
    points = import_json(out.read_bytes())
    assert {p.engine for p in points} == {"simulated"}
    models = {m for params in (BeamParams(), RagParams()) for m in models_of(params)}
    assert {p.model for p in points} == models
    whole_gpu = [p for p in points if p.share == 1.0]
    assert all(Profile.from_points(ps).saturation > 0 for ps in _by_model(whole_gpu).values())
    # Each share is measured where the model fits (an 8B's weights leave a quarter of an A6000
    # no KV cache), never scaled: a quarter GPU slows a light load far less than 4x.
    quarter = {p.model for p in points if p.share == 0.25}
    assert quarter == models - {"llama-3.1-8b-prm", "llama-3-8b"}
    for model in quarter:
        whole = Profile.from_points([p for p in points if p.model == model and p.share == 1.0])
        ends = {
            c: Profile.from_points(
                [p for p in points if p.model == model and p.share == 0.25 and p.colocation == c]
            )
            for c in ("packed", "alone")
        }
        measured = ends["packed"]
        light = 0.2 * measured.saturation
        linear = whole.scaled(0.25, Beta(1.0, "model"))  # latency stretched by 1 / share
        assert float(measured.latency(light)) < float(linear.latency(light))
        # a quarter is measured next to three busy copies and alone; alone it is never slower
        assert ends["alone"].saturation >= 0.95 * measured.saturation
    assert {p.colocation for p in whole_gpu} == {"alone"}
    # each point says what its calls emit, as an engine's usage would: nothing for an
    # embedding or a rerank, one token for the verifier's score, the generators' answers
    tokens = {p.model: p.completion_tokens for p in whole_gpu}
    assert tokens["e5-base-v2"] == tokens["bge-reranker-base"] == 0.0
    assert tokens["llama-3.1-8b-prm"] == 1.0
    assert tokens["llama-3.2-1b"] > 1.0 and tokens["llama-3-8b"] > 1.0


def test_the_profiles_command_refuses_a_share_outside_0_1() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sim.profiles", "--out", "x.json", "--shares", "1,1.5"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode != 0 and "--shares" in done.stderr


def _by_model(points: list[ProfilePoint]) -> dict[str, list[ProfilePoint]]:
    out: dict[str, list[ProfilePoint]] = {}
    for p in points:
        out.setdefault(p.model, []).append(p)
    return out

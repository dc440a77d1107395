"""Profiling by simulation: saturation of a dependency-bound workflow's model."""

from __future__ import annotations

from dataclasses import replace

from bench.sim_profile import Case, ProfileJob, _point, keeps_up
from sim.workflows import BeamParams


def test_a_dependency_bound_workflow_falling_behind_is_not_keeping_up() -> None:
    # Beam search sends a request's next verifier calls only when its last ones are done, so
    # past saturation the verifier's submitted calls track its completions (here ~97% of
    # them): the calls piled up there count per request arriving (~23 calls, ~3 at a time).
    case = Case("beam", BeamParams(max_iterations=6), "a6000", 0.0, 0, 0)
    job = ProfileJob(case, "llama-3.1-8b-prm", 1, 1.0, n_per_request=23.1, target_calls=100,
                     start_rate=1.0, min_requests=150, parallel=3.0)
    light, _ = _point(job, 50.0, seed=1)
    assert keeps_up(light.offered_rate, light.throughput)
    over, _ = _point(job, 64.7, seed=1)
    assert not keeps_up(over.offered_rate, over.throughput)
    calls_alone = replace(job, parallel=None)  # every call judged as if independent
    over, _ = _point(calls_alone, 64.7, seed=1)
    assert keeps_up(over.offered_rate, over.throughput)

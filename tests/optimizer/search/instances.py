"""Synthetic allocation-search instances for the search tests and ``bench.speed.search_time``
(simulated profiles).

Role: search problems with plausible but made-up LLM profiles, reproducible from a seed. A
model's curve at TP ``t`` on a whole GPU: saturation ``T_1 · t^a`` calls/s and light-load latency
``L_0 / t^b`` (sub-linear TP scaling), latency ``L_0 · (1 + c · rho / (1 - rho))`` at utilisation
``rho`` (a queue's blow-up), and one overloaded point so the profile sees saturation. Shares below
one are scaled from these curves by the ALP (the profile book says so).

Invariants: pure functions of their arguments (``numpy.random.Generator`` or a seed).
"""

from __future__ import annotations

import numpy as np

from optimizer.model.alp import Pipeline, Stage
from optimizer.model.curves import ProfileBook
from optimizer.search.space import SearchProblem, WorkflowTarget
from shared.cluster import GB, Cluster
from shared.profile_points import ProfilePoint

GPU_MEMORY = 48 * GB
_RHOS = (0.05, 0.3, 0.5, 0.7, 0.85, 0.95)


def curve(
    model: str, tp: int, saturation: float, light: float, blowup: float, gpu_type: str = "a6000"
) -> list[ProfilePoint]:
    """Profile points of one (model, TP) on a whole GPU; the last point is overloaded."""
    out = []
    for rho in _RHOS:
        lam = rho * saturation
        lat = light * (1.0 + blowup * rho / (1.0 - rho))
        out.append(
            ProfilePoint(
                model,
                "synthetic",
                gpu_type,
                tp,
                1.0,
                lam,
                lam,
                lat,
                lat * 0.9,
                lat * 1.6,
                lat * 2.4,
                light * 0.2,
                500,
            )
        )
    lat = light * (1.0 + blowup * 30.0)
    out.append(
        ProfilePoint(
            model,
            "synthetic",
            gpu_type,
            tp,
            1.0,
            1.4 * saturation,
            saturation,
            lat,
            lat,
            lat,
            lat,
            light * 0.2,
            500,
        )
    )
    return out


def random_models(
    rng: np.random.Generator, count: int, max_tp: int
) -> tuple[list[ProfilePoint], dict[str, tuple[float, float]]]:
    """``count`` models m0.. with curves at TP 1..max_tp; returns points and (T_1, L_0) each."""
    points: list[ProfilePoint] = []
    base: dict[str, tuple[float, float]] = {}
    for i in range(count):
        name = f"m{i}"
        sat, light = float(rng.uniform(0.5, 20.0)), float(rng.uniform(0.05, 3.0))
        a, b, c = rng.uniform(0.5, 0.95), rng.uniform(0.2, 0.7), rng.uniform(0.3, 2.0)
        base[name] = (sat, light)
        t = 1
        while t <= max_tp:
            points += curve(name, t, sat * t**a, light / t**b, float(c))
            t *= 2
    return points, base


def random_pipeline(rng: np.random.Generator, name: str, models: list[str]) -> Pipeline:
    stages = []
    for m in models:
        n = float(rng.uniform(0.5, 10.0))
        stages.append(Stage(m, n, float(rng.uniform(1.0, max(1.0, n)))))
    overlap = float(rng.uniform(0.6, 1.0))
    return Pipeline(name, tuple(stages), overlap, float(rng.uniform(0.0, 0.5)))


def demand_rate(
    pipe: Pipeline, base: dict[str, tuple[float, float]], gpus: int, load: float
) -> float:
    """A rate that would use ``load`` of ``gpus`` whole GPUs at TP 1 split by demand."""
    gpu_seconds = sum(st.n / base[st.model][0] for st in pipe.stages)
    return load * gpus / gpu_seconds


def random_problem(
    rng: np.random.Generator,
    max_gpus: int = 4,
    max_llms: int = 3,
    granularities: tuple[int, ...] = (2, 3, 4, 5),
) -> SearchProblem:
    """A small single-workflow instance: 1..max_gpus GPUs on one node, 1..max_llms LLMs."""
    gpus = int(rng.integers(1, max_gpus + 1))
    domain = int(rng.choice([d for d in (1, 2, 4) if gpus % d == 0]))
    llms = int(rng.integers(1, max_llms + 1))
    points, base = random_models(rng, llms, max_tp=4)
    pipe = random_pipeline(rng, "w", list(base))
    floors = {m: int(rng.choice([0.0, 0.2, 0.45, 0.9, 1.5]) * GPU_MEMORY) for m in base}
    return SearchProblem(
        workflows=(
            WorkflowTarget(pipe, demand_rate(pipe, base, gpus, float(rng.uniform(0.1, 1.3)))),
        ),
        book=ProfileBook(points),
        cluster=Cluster.uniform(1, gpus, domain, "a6000", GPU_MEMORY),
        memory_floor_bytes=floors,
        granularity=int(rng.choice(granularities)),
        headroom=float(rng.choice([0.0, 0.1, 0.2])),
        allow_tp=bool(rng.random() < 0.8),
        allow_fraction=bool(rng.random() < 0.8),
    )


def scaled_problem(
    llms: int, gpus: int, granularity: int, seed: int = 0, load: float = 0.7
) -> SearchProblem:
    """A Fig. 11-style instance: one workflow over ``llms`` LLMs on ``gpus`` GPUs (nodes of 8
    with NVLink domains of 4; smaller clusters are one node)."""
    rng = np.random.default_rng(seed)
    per_node = min(gpus, 8)
    domain = min(per_node, 4)
    points, base = random_models(rng, llms, max_tp=domain)
    pipe = random_pipeline(rng, "combined", list(base))
    floors = {m: int(0.3 * GPU_MEMORY) for m in base}
    return SearchProblem(
        workflows=(WorkflowTarget(pipe, demand_rate(pipe, base, gpus, load)),),
        book=ProfileBook(points),
        cluster=Cluster.uniform(gpus // per_node, per_node, domain, "a6000", GPU_MEMORY),
        memory_floor_bytes=floors,
        granularity=granularity,
    )

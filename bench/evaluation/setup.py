"""The evaluation's fixed inputs: clusters, workflows, systems, run lengths and the paper's figures.

Role: one place for every constant of ``bench.evaluation.evaluate`` (paper §7's setup as far as the
simulator can express it), so the modules that run systems and the report read the same values.

Invariants:
- clusters are the paper's: nodes of 4 emulated A6000 GPUs, NVLink in pairs;
- every model's memory floor is weights + runtime reserve + a minimal KV cache, divided by the
  engines' memory utilisation (what ``sim.perf`` lets an engine use), so a floor-sized replica
  can hold the workflows' longest prompts;
- the paper's figures are quoted, never computed; every figure this bench produces is simulated;
- the baselines the paper ran are modelled as it describes them, no better: Ayo on the hand
  split without prefix caching, Aegaeon on every split it ran (``sim.multiplex``).
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.cluster import Cluster
from sim.des import WorkloadSpec
from sim.perf import GPU_MEMORY_UTILIZATION, GPUS, MODELS, RUNTIME_RESERVE_BYTES
from sim.workflows import BeamParams, RagParams, models_of

GPU = "a6000"
GPUS_PER_NODE = 4
NVLINK_DOMAIN = 2
SIZES = (4, 8, 16)
QUICK_SIZES = (4,)
GRANULARITY = 10
HEADROOM = 0.1
# Minimal KV cache a replica must hold, in tokens: generators a long beam (# assumed: 8k, the
# 8B models' context), encoders one batch of their longest inputs.
MIN_KV_TOKENS = {"generate": 8192, "embed": 4096, "rerank": 4096}

SYSTEMS = (
    "scepsy",
    "hpa",
    "hpa_warm",
    "independent",
    "even",
    "ayo",
    "aegaeon_3p1d",
    "aegaeon_2p2d",
    "aegaeon_1p3d",
    "no_tp",
    "no_fraction",
    "no_tp_no_fraction",
)
ABLATIONS = {
    "scepsy": (True, True),
    "no_tp": (False, True),
    "no_fraction": (True, False),
    "no_tp_no_fraction": (False, False),
}  # (allow_tp, allow_fraction)
# Ayo (ASPLOS'25, paper §7.2 Fig. 8): the user's hand allocation ("even"), on vLLM v0.2 (no
# automatic prefix caching), with workflow-aware scheduling (a call of an earlier-started
# workflow request goes first): ``sim.des.simulate``'s engine options, in ``runs``.
AYO = "ayo"
# Aegaeon (SOSP'25, paper §7.2 Fig. 7): pooled whole-GPU instances multiplexing every model,
# prefill instances per node of 4 (the rest decode): the paper's three splits
# (``sim.multiplex``).
AEGAEON_PREFILL_PER_NODE = {"aegaeon_3p1d": 3, "aegaeon_2p2d": 2, "aegaeon_1p3d": 1}
WORKFLOWS = ("beam", "rag", "combined")
BEAM, RAG = BeamParams(), RagParams()
# Combined: beam search held at this fraction of Scepsy's beam-only capacity on the cluster
# while the RAG rate sweeps (paper Fig. 9a: beam fixed, RAG varied).
COMBINED_BEAM_FRACTION = 0.3
# Rate sweep: fractions of Scepsy's predicted capacity on the cluster (the same rates for
# every system, so latencies compare at equal rates). Seven, denser near capacity where the
# peaks differ; a point's cost grows with its rate (a window of fixed length at high rates),
# and ten rates at 16 GPUs did not finish in 26 min.
RATE_FRACTIONS = (0.2, 0.4, 0.6, 0.8, 0.9, 1.0, 1.2)
QUICK_RATE_FRACTIONS = (0.2, 0.5, 0.8, 1.0, 1.2)
# Ayo and Aegaeon also run below the sweep (full and quick): the paper puts their peaks at
# 1/2 to 1/8 of Scepsy's, under the sweep's lowest rate for beam search. Cheap points: a
# series stops after two rates it does not sustain.
BELOW_SWEEP_SYSTEMS = ("ayo", "aegaeon_3p1d", "aegaeon_2p2d", "aegaeon_1p3d")
BELOW_SWEEP_FRACTIONS = (0.05, 0.1, 0.15)
# The dynamic scenario runs on 8 GPUs (paper Fig. 9), also in --quick: on 4 GPUs the
# autoscaler cannot start one whole-GPU pod for each of the five models.
DYNAMIC_GPUS = 8
DYNAMIC_DRAIN_S = 120.0  # the dynamic scenario's runs end this long after the last arrival
SUSTAINED = 0.95  # a point is sustained when >= 95% of its requests complete (runs.py: and keep up)

# The paper's reported figures (§7.2 Fig. 6 vs the Kubernetes HPA; §7.4 Fig. 10 ablations are
# reported qualitatively only). Throughput: Scepsy / HPA; latency: HPA / Scepsy, a range.
PAPER_HPA = {
    "beam": {4: (2.4, (1.4, 7.6)), 8: (1.5, (1.3, 5.2)), 16: (1.8, (1.7, 10.4))},
    "rag": {4: (1.5, (1.9, 14.9)), 8: (1.2, (1.2, 7.2)), 16: (1.2, (1.4, 27.0))},
}
# §7.2 Fig. 7 (Aegaeon, best split): throughput Scepsy / Aegaeon, latency Aegaeon / Scepsy;
# Fig. 8 (Ayo, both on vLLM v0.2): throughput Scepsy / Ayo (latency: comparable at low load).
PAPER_AEGAEON = {"beam": {4: (7.3, 14.1), 8: (6.8, 12.9)}, "rag": {4: (2.5, 3.4), 8: (2.9, 4.5)}}
PAPER_AYO = {"beam": {4: 3.2, 8: 8.2}, "rag": {4: 2.1, 8: 2.4}}
PAPER_ABLATION = {
    "rag": "co-location (fractional shares) is the biggest contributor to throughput",
    "beam": "tensor parallelism gives the latency reduction",
    "combined": "not evaluated against baselines in the paper (Fig. 9 shows Scepsy only)",
}


@dataclass(frozen=True)
class RunLengths:
    """How long each simulated point runs (simulated seconds / requests)."""

    requests: dict[str, int]  # measured requests per point, per workflow kind
    warmup_latencies: float  # warm-up, in light-load request latencies
    min_window_latencies: float  # the measurement window is at least this many latencies
    hpa_warmup_s: float  # the autoscaler needs minutes to settle from its initial state
    hpa_window_s: float  # two scale-down stabilisation windows (300 s): oscillation shows
    profile_calls: int


# Beam requests last ~12 s: a window of a few latencies reads throughput low (pipeline fill);
# 10 after a warm-up of 4 still holds >= 250 requests at the rates where it binds (it binds at
# high rates only, where it sets the cost: 20 made a 16-GPU point simulate ~10x its requests).
# A combined point's beam side needs half the beam requests (it is judged sustained, not
# measured).
FULL = RunLengths({"beam": 250, "rag": 1000}, 4.0, 10.0, 300.0, 600.0, 1500)
QUICK = RunLengths({"beam": 150, "rag": 500}, 4.0, 10.0, 150.0, 300.0, 600)


def cluster(gpus: int) -> Cluster:
    if gpus % GPUS_PER_NODE:
        raise ValueError(f"{gpus} GPUs: whole nodes of {GPUS_PER_NODE} only")
    return Cluster.uniform(
        gpus // GPUS_PER_NODE, GPUS_PER_NODE, NVLINK_DOMAIN, GPU, GPUS[GPU].memory_bytes
    )


def memory_floor_bytes(model: str) -> int:
    spec = MODELS[model]
    need = (
        spec.weight_bytes
        + RUNTIME_RESERVE_BYTES[spec.kind]
        + MIN_KV_TOKENS[spec.kind] * spec.kv_bytes_per_token
    )
    return int(need / GPU_MEMORY_UTILIZATION) + 1


def workflow_models(kind: str) -> tuple[str, ...]:
    """Models of ``beam``, ``rag`` or ``combined``, in workload order."""
    if kind == "beam":
        return models_of(BEAM)
    if kind == "rag":
        return models_of(RAG)
    return models_of(BEAM) + models_of(RAG)


def workloads(kind: str, rate: float, beam_rate: float = 0.0) -> list[WorkloadSpec]:
    """The simulator's workloads: for ``combined``, ``rate`` is RAG's and beam runs at
    ``beam_rate``."""
    if kind == "beam":
        return [WorkloadSpec("beam", rate, BEAM)]
    if kind == "rag":
        return [WorkloadSpec("rag", rate, RAG)]
    return [WorkloadSpec("beam", beam_rate, BEAM), WorkloadSpec("rag", rate, RAG)]

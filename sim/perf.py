"""The engine performance model: how long one continuous-batching step takes (pure).

Role: given a model spec, a GPU type, a tensor-parallel degree ``tp`` and a GPU share, say how
long one engine step takes for a batch of ``prefill_tokens`` new prompt tokens plus
``decode_seqs`` decoding sequences reading ``context_tokens`` cached tokens, and how many
KV-cache tokens fit. Both drivers (emulator, simulator) and the engine core use it.

The step is the sum of (all per tensor-parallel rank):
- a fixed per-step CPU/launch overhead (vLLM's scheduler, sampling, kernel launches);
- weight streaming: ``weight_bytes / tp`` over the effective HBM bandwidth (memory-bound decode);
- KV reads: ``context_tokens * kv_bytes_per_token / tp`` over a lower effective bandwidth
  (paged attention does not reach the streaming roofline);
- compute: ``2 * params * tokens`` plus attention FLOPs at efficiency η_c, so prefill is
  compute-bound and decode grows past batch ~8. The three terms add rather than overlap (a
  roofline ``max``): the published batch-128 TP speed-ups need decode that slow;
- all-reduce (``tp > 1``): two per layer, each a fixed latency plus the activations over the
  interconnect: NVLink when the replica's GPUs lie in one NVLink domain (``nvlink``, from the
  placement; by degree where no placement is known), else PCIe; NCCL's kernels run on the
  replica's SMs, so a share slows it like memory-bound work (# assumed).
A GPU share (MPS) slows the compute part like calibration.md's prefill rows and the memory part
like its batch-1 decode rows. Co-located clients contend (:func:`contention`): alone, a client
of share ``s`` gets ``1 / slowdown(s)`` of the GPU's compute and of its bandwidth (more than
``s`` at small shares: the table's idle SMs); while several have work, each gets its solo rate
divided by the sum of the busy clients' solo rates when that sum exceeds 1, so their combined
service never exceeds one whole GPU's (``compute_contention``, ``memory_contention``).

Invariants: pure functions of frozen dataclasses; every constant cites
``shared/reference/calibration.md`` ("cal:") or is marked ``# assumed``; ``step_time`` is
non-decreasing in each argument and 0 for an empty step.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from types import MappingProxyType
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "GPUS",
    "MODELS",
    "Contended",
    "GpuSpec",
    "ModelSpec",
    "PerfModel",
    "contention",
    "perf_model",
]

GB = 1e9


@dataclass(frozen=True)
class ModelSpec:
    name: str
    kind: Literal["generate", "embed", "rerank"]
    params: float  # parameter count
    layers: int
    hidden: int
    kv_bytes_per_token: int  # generators: K+V cache; encoders: per-token activations held
    weight_bytes: int
    max_context: int


@dataclass(frozen=True)
class GpuSpec:
    name: str
    hbm_bytes_per_s: float
    flops: float  # dense BF16 peak
    memory_bytes: int
    # Effective all-reduce bandwidth inside an NVLink domain, and across PCIe beyond it.
    link_bytes_per_s: float = 100 * GB
    pcie_bytes_per_s: float = 16 * GB  # assumed: PCIe 4.0 x16 all-reduce bus bandwidth
    nvlink_domain: int = 8  # GPUs per NVLink domain


_KIB = 1024

MODELS: Mapping[str, ModelSpec] = MappingProxyType(
    {
        # cal: Llama-3.2-1B ≈ 2.5 GB BF16, KV 32 KiB/token (16 layers x 8 KV heads x 64 x 2 x 2).
        "llama-3.2-1b": ModelSpec(
            "llama-3.2-1b", "generate", 1.24e9, 16, 2048, 32 * _KIB, int(2.5 * GB), 131072
        ),
        # cal: Llama-3-8B ≈ 16.1 GB BF16, KV 128 KiB/token (32 x 8 x 128 x 2 x 2); 8k context.
        "llama-3-8b": ModelSpec(
            "llama-3-8b", "generate", 8.03e9, 32, 4096, 128 * _KIB, int(16.1 * GB), 8192
        ),
        # The paper's verifier is a Llama-3.1-8B PRM: same shapes as Llama-3-8B, 128k context.
        "llama-3.1-8b-prm": ModelSpec(
            "llama-3.1-8b-prm", "generate", 8.03e9, 32, 4096, 128 * _KIB, int(16.1 * GB), 131072
        ),
        # cal: e5-base-v2 ≈ 0.22 GB (110M). Activations per token: K+V of 12 layers x 768, BF16
        # (# assumed: what one encoder forward pass holds per token).
        "e5-base-v2": ModelSpec(
            "e5-base-v2", "embed", 110e6, 12, 768, 12 * 768 * 2 * 2, int(0.22 * GB), 512
        ),
        # cal: bge-reranker-base ≈ 0.55 GB (278M; XLM-R base: 12 layers x 768).
        "bge-reranker-base": ModelSpec(
            "bge-reranker-base", "rerank", 278e6, 12, 768, 12 * 768 * 2 * 2, int(0.55 * GB), 512
        ),
    }
)

GPUS: Mapping[str, GpuSpec] = MappingProxyType(
    {
        # cal: RTX A6000 768 GB/s, ~155 TFLOP/s dense BF16, 48 GB; NVLink in pairs.
        # link: NVLink bridge 112.5 GB/s bidirectional, ~40 GB/s all-reduce bus bandwidth # assumed
        "a6000": GpuSpec(
            "a6000", 768 * GB, 155e12, int(48 * GB), link_bytes_per_s=40 * GB, nvlink_domain=2
        ),
        # cal: A100-80GB SXM 2039 GB/s, 312 TFLOP/s, 80 GB. link fitted to cal's prefill TP rows.
        "a100": GpuSpec("a100", 2039 * GB, 312e12, int(80 * GB), link_bytes_per_s=100 * GB),
        # cal: H100-80GB SXM 3350 GB/s, ~990 TFLOP/s, 80 GB. NVLink4 is 1.5x NVLink3 # assumed
        "h100": GpuSpec("h100", 3350 * GB, 990e12, int(80 * GB), link_bytes_per_s=150 * GB),
        # cal: H200 4800 GB/s, ~990 TFLOP/s, 141 GB.
        "h200": GpuSpec("h200", 4800 * GB, 990e12, int(141 * GB), link_bytes_per_s=150 * GB),
    }
)

# --- efficiencies and overheads -------------------------------------------------------------
ETA_HBM = 0.75  # cal: "η ≈ 0.75 measured on A100" for weight streaming
ETA_KV = 0.4  # assumed: paged-attention KV reads reach well under the streaming roofline
ETA_COMPUTE = 0.55  # cal: "η_c ≈ 0.5-0.6"
STEP_OVERHEAD_S = {"generate": 3e-3, "embed": 1e-3, "rerank": 1e-3}  # cal: "~3-5 ms" (low end);
# encoders: no sampling or detokenisation # assumed
ATTENTION_SPAN_CAP = 1024  # assumed: mean attention span of prefill tokens within one step
# All-reduce: per-call latency fitted to cal's "batch 1: TP2 0.93x" (vLLM's TP also pays a
# per-step broadcast to the workers; it is folded in here).
ALLREDUCE_LATENCY_S = 98e-6
ACTIVATION_BYTES = 2  # BF16 activations
# Memory: vLLM's default --gpu-memory-utilization 0.9; per-GPU runtime reserve (CUDA context,
# activations, graphs) # assumed.
GPU_MEMORY_UTILIZATION = 0.9
RUNTIME_RESERVE_BYTES = {"generate": int(1.0 * GB), "embed": int(0.3 * GB), "rerank": int(0.3 * GB)}

# cal: MPS table (7B on A100): time relative to 100% of SMs. Shares below 0.3 extrapolate.
_SHARE_POINTS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
# prefill rows averaged (8x128 and 32x256): compute-bound, ≈ 1/share.
_COMPUTE_SLOWDOWN = (2.705, 2.03, 1.665, 1.42, 1.255, 1.135, 1.055, 1.0)
# decode 1x128 row: memory-bound, flat down to ~50%.
_MEMORY_SLOWDOWN = (1.41, 1.26, 1.09, 1.07, 1.05, 1.03, 1.00, 1.0)


def _interpolate(points: tuple[float, ...], values: tuple[float, ...], x: float) -> float:
    i = bisect.bisect_left(points, x)
    if i <= 0:
        return values[0]
    if i >= len(points):
        return values[-1]
    x0, x1 = points[i - 1], points[i]
    return values[i - 1] + (values[i] - values[i - 1]) * (x - x0) / (x1 - x0)


def compute_slowdown(share: float) -> float:
    """Compute-bound time at ``share`` of the SMs relative to the whole GPU (cal: MPS table)."""
    if share >= _SHARE_POINTS[0]:
        return _interpolate(_SHARE_POINTS, _COMPUTE_SLOWDOWN, share)
    return _COMPUTE_SLOWDOWN[0] * _SHARE_POINTS[0] / share  # ≈ 1/share below the table


def memory_slowdown(share: float) -> float:
    """Memory-bound time at ``share`` of the SMs relative to the whole GPU (cal: MPS table)."""
    if share >= _SHARE_POINTS[0]:
        return _interpolate(_SHARE_POINTS, _MEMORY_SLOWDOWN, share)
    # assumed: below 30% of SMs, reachable bandwidth falls like sqrt(share)
    return _MEMORY_SLOWDOWN[0] * math.sqrt(_SHARE_POINTS[0] / share)


def contention(busy_shares: Sequence[float]) -> tuple[float, float]:
    """(compute, memory) contention of clients co-located on one GPU while those of
    ``busy_shares`` (the client itself included) have work: the sum of their solo rates,
    at least 1 (see the module docstring)."""
    compute = sum(1.0 / compute_slowdown(s) for s in busy_shares)
    memory = sum(1.0 / memory_slowdown(s) for s in busy_shares)
    return max(1.0, compute), max(1.0, memory)


class Contended:
    """A replica's performance model under its busy co-located neighbours (by their shares),
    built once per set of neighbours: the simulator's replicas and the emulator's engines ask
    before every step."""

    def __init__(self, base: PerfModel) -> None:
        self.base = base
        self._by_busy: dict[tuple[float, ...], PerfModel] = {(): base}

    def under(self, busy: tuple[float, ...]) -> PerfModel:
        """``base`` while co-located replicas of shares ``busy`` (sorted) have work."""
        perf = self._by_busy.get(busy)
        if perf is None:
            compute, memory = contention((self.base.share, *busy))
            perf = replace(self.base, compute_contention=compute, memory_contention=memory)
            self._by_busy[busy] = perf
        return perf


@dataclass(frozen=True)
class PerfModel:
    model: ModelSpec
    gpu: GpuSpec
    tp: int = 1
    share: float = 1.0
    # the busy co-located clients' summed solo rates (>= 1; 1: alone or within one GPU)
    compute_contention: float = 1.0
    memory_contention: float = 1.0
    nvlink: bool | None = None  # GPUs in one NVLink domain (None: as the degree allows)

    def __post_init__(self) -> None:
        if self.tp < 1 or self.tp & (self.tp - 1):
            raise ValueError(f"tp must be a power of two >= 1, got {self.tp}")
        if not 0.0 < self.share <= 1.0:
            raise ValueError(f"share must be in (0, 1], got {self.share}")
        if not (self.compute_contention >= 1.0 and self.memory_contention >= 1.0):
            raise ValueError("contention factors must be >= 1")

    # Share-dependent factors depend only on the fields: computed once per instance.
    @cached_property
    def _memory_factor(self) -> float:
        return memory_slowdown(self.share) * self.memory_contention

    @cached_property
    def _compute_factor(self) -> float:
        return compute_slowdown(self.share) * self.compute_contention

    @cached_property
    def link_bytes_per_s(self) -> float:
        """The all-reduce's interconnect: NVLink within a domain, else PCIe."""
        gpu = self.gpu
        nvlink = self.tp <= gpu.nvlink_domain if self.nvlink is None else self.nvlink
        return gpu.link_bytes_per_s if nvlink else gpu.pcie_bytes_per_s

    def _allreduce_time(self, tokens: int) -> float:
        if self.tp == 1:
            return 0.0
        ring = 2.0 * (self.tp - 1) / self.tp  # bytes each rank moves, relative to the message
        message = tokens * self.model.hidden * ACTIVATION_BYTES
        per_layer = ALLREDUCE_LATENCY_S + ring * message / self.link_bytes_per_s
        return 2 * self.model.layers * per_layer * memory_slowdown(self.share)

    def step_time(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        """Seconds one engine step takes. ``context_tokens``: cached tokens the decoding
        sequences attend to, summed over them."""
        if prefill_tokens + decode_seqs <= 0:
            return 0.0
        return float(self._time(prefill_tokens, decode_seqs, context_tokens))

    def step_times(
        self, prefill_tokens: int, decode_seqs: int, context_tokens: NDArray[np.float64]
    ) -> NDArray[np.float64]:
        """``step_time`` for many context sizes at once (the simulator's decode runs)."""
        if prefill_tokens + decode_seqs <= 0:
            return np.zeros_like(context_tokens)
        return np.asarray(self._time(prefill_tokens, decode_seqs, context_tokens))

    def _time(self, prefill_tokens: int, decode_seqs: int, context_tokens: Any) -> Any:
        """The step-time formula; ``context_tokens`` may be a number or an array."""
        m, g, tp = self.model, self.gpu, self.tp
        tokens = prefill_tokens + decode_seqs
        flops = 2.0 * m.params * tokens
        flops += (
            2.0 * m.layers * m.hidden * prefill_tokens * min(prefill_tokens, ATTENTION_SPAN_CAP)
        )
        flops = flops + 4.0 * m.layers * m.hidden * context_tokens
        compute = flops / tp / (ETA_COMPUTE * g.flops) * self._compute_factor
        weights = m.weight_bytes / tp / (ETA_HBM * g.hbm_bytes_per_s)
        kv = context_tokens * m.kv_bytes_per_token / tp / (ETA_KV * g.hbm_bytes_per_s)
        memory = (kv + weights) * self._memory_factor
        return memory + (compute + (STEP_OVERHEAD_S[m.kind] + self._allreduce_time(tokens)))

    def kv_capacity_tokens(self) -> int:
        """KV-cache tokens that fit in (share x memory x tp) - weights - runtime reserve."""
        m = self.model
        usable = self.share * self.gpu.memory_bytes * GPU_MEMORY_UTILIZATION * self.tp
        free = usable - m.weight_bytes - RUNTIME_RESERVE_BYTES[m.kind] * self.tp
        return max(0, int(free // m.kv_bytes_per_token))

    def decode_roofline(self) -> float:
        """Weight bytes / (η · HBM bandwidth) for this replica: cal's batch-1 decode estimate."""
        return self.model.weight_bytes / self.tp / (ETA_HBM * self.gpu.hbm_bytes_per_s)


def perf_model(model: str, gpu: str, tp: int = 1, share: float = 1.0) -> PerfModel:
    """The performance model for named specs; ValueError on an unknown name or bad value."""
    try:
        spec = MODELS[model]
    except KeyError:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(sorted(MODELS))}") from None
    try:
        gspec = GPUS[gpu]
    except KeyError:
        raise ValueError(f"unknown GPU {gpu!r}; known: {', '.join(sorted(GPUS))}") from None
    return PerfModel(spec, gspec, tp=tp, share=share)

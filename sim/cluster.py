"""The simulated cluster: an allocation's engine replicas, their GPU placement and the router.

Role: turn an ``Allocation`` (per model: GPU type, TP degree, GPU share, replica count) into
``Replica``s, each an ``EngineCore`` placed on GPUs, and route calls among a model's replicas.

Invariants and assumptions:
- placement is first-fit: whole-GPU replicas get GPUs of their own; fractional replicas (share
  < 1) are packed, largest share first, onto groups of ``tp`` GPUs of their type whose shares
  sum to at most 1; an allocation that asks for more than 100% of a GPU cannot happen;
- a tensor-parallel group of ``tp`` GPUs starts at a multiple of ``tp`` (as NVLink-aware
  placement puts it in one domain); its all-reduce runs over NVLink when its GPUs lie in one
  domain of the GPU type (``GpuSpec.nvlink_domain``), else PCIe, unless the spec says which
  (``ReplicaSpec.nvlink``: an evaluation placing replicas as the optimizer did);
- co-located replicas contend for SMs and HBM bandwidth while they have work: at the start of
  a step a replica's compute and memory times are stretched by the busy co-located clients'
  summed solo rates (:func:`sim.perf.contention`), so shares that sum to one GPU never serve
  more than one whole GPU at saturation, and an idle neighbour costs nothing;
- routing picks, per call, among the replicas of the call's model: power of two choices on
  outstanding calls, the least outstanding, affinity by workflow request with a fall-back to
  the least loaded when the preferred replica is far busier, or ``prefix_affinity``: the
  product proxy's policy (``proxy.router``, the one ``deploy/proxy-settings.yaml`` deploys)
  with its default settings, over token blocks instead of characters (# assumed: 4
  characters a token): a chat call follows the replica that last served the longest
  remembered prefix of its prompt when at least half of the prompt's blocks matched and that
  replica is not much busier than the others' mean (``RoutingSettings.keeps_affinity``, the
  proxy's own rule); otherwise (and for embeddings and rerank calls, which carry no chat
  prompt) the least loaded replica, ties broken at random.
"""

from __future__ import annotations

import dataclasses
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from shared.settings import RoutingSettings
from sim.engine import EngineCore
from sim.perf import Contended, perf_model
from sim.workflows import Prompt

__all__ = [
    "Allocation",
    "PrefixTable",
    "Replica",
    "ReplicaSpec",
    "Router",
    "RoutingPolicy",
    "build_replicas",
]

RoutingPolicy = Literal["p2c", "least", "affinity", "prefix_affinity"]
_EPS = 1e-9
CHARS_PER_TOKEN = 4  # assumed: the proxy hashes characters, the simulator counts tokens


@dataclass(frozen=True)
class ReplicaSpec:
    model: str
    gpu: str = "a6000"
    tp: int = 1
    share: float = 1.0
    count: int = 1
    nvlink: bool | None = None  # the group's GPUs in one NVLink domain (None: as placed here)

    def __post_init__(self) -> None:
        perf_model(self.model, self.gpu, self.tp, self.share)  # validates names and values
        if self.count < 0:
            raise ValueError(f"{self.model}: count must be >= 0")


@dataclass(frozen=True)
class Allocation:
    replicas: tuple[ReplicaSpec, ...]

    @classmethod
    def of(cls, *specs: ReplicaSpec | tuple[str, str, int, float, int]) -> Allocation:
        """From specs or ``(model, gpu, tp, share, count)`` tuples."""
        return cls(tuple(s if isinstance(s, ReplicaSpec) else ReplicaSpec(*s) for s in specs))

    @property
    def gpus(self) -> float:
        """GPU-equivalents the allocation uses (sum of count x tp x share)."""
        return sum(s.count * s.tp * s.share for s in self.replicas)

    def models(self) -> set[str]:
        return {s.model for s in self.replicas if s.count > 0}


def place(allocation: Allocation) -> list[tuple[ReplicaSpec, tuple[int, ...]]]:
    """First-fit placement: each replica instance with the GPU indices it uses."""
    instances = [s for s in allocation.replicas for _ in range(s.count)]
    order = sorted(range(len(instances)), key=lambda i: -instances[i].share)
    groups: list[tuple[str, int, list[int], list[float]]] = []  # gpu type, tp, indices, [used]
    placed: dict[int, tuple[int, ...]] = {}
    next_gpu = 0
    for i in order:
        spec = instances[i]
        for gpu, tp, idx, used in groups:
            if gpu == spec.gpu and tp == spec.tp and used[0] + spec.share <= 1.0 + _EPS:
                used[0] += spec.share
                placed[i] = tuple(idx)
                break
        else:
            next_gpu = -(-next_gpu // spec.tp) * spec.tp  # aligned: one NVLink domain if it can
            idx = list(range(next_gpu, next_gpu + spec.tp))
            next_gpu += spec.tp
            groups.append((spec.gpu, spec.tp, idx, [spec.share]))
            placed[i] = tuple(idx)
    return [(instances[i], placed[i]) for i in range(len(instances))]


class Replica:
    """One engine replica on the virtual clock. ``outstanding``: calls routed, not finished."""

    def __init__(
        self,
        name: str,
        spec: ReplicaSpec,
        gpus: tuple[int, ...],
        engine: EngineCore,
    ) -> None:
        self.name = name
        self.spec = spec
        self.gpus = gpus
        self.engine = engine
        self.peers: list[Replica] = []  # co-located replicas (sharing any GPU)
        self.outstanding = 0
        self.stepping = False  # a step is in flight on the virtual clock
        self.busy_time = 0.0
        self.steps = 0
        # a fast-forwarded run of decode steps in flight: (start time, cumulative durations)
        self.macro: tuple[float, NDArray[np.float64]] | None = None
        self.version = 0  # bumps when the replica's pending step-end event is superseded
        self._contended = Contended(engine.perf)

    def apply_contention(self) -> None:
        """Set the engine's contention for the step about to start: by the co-located
        replicas that have work now."""
        if self.peers:
            busy = tuple(sorted(p.spec.share for p in self.peers if p.engine.has_work()))
            self.engine.perf = self._contended.under(busy)


def build_replicas(
    allocation: Allocation,
    *,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
    enable_prefix_caching: bool = True,
    scheduling: Literal["fcfs", "priority"] = "fcfs",
) -> list[Replica]:
    """The allocation's replicas, placed first-fit; the keywords are ``EngineCore``'s."""
    replicas: list[Replica] = []
    counters: dict[str, int] = {}
    for spec, gpus in place(allocation):
        n = counters.get(spec.model, 0)
        counters[spec.model] = n + 1
        perf = perf_model(spec.model, spec.gpu, spec.tp, spec.share)
        domain = perf.gpu.nvlink_domain
        nvlink = len({g // domain for g in gpus}) == 1 if spec.nvlink is None else spec.nvlink
        engine = EngineCore(
            dataclasses.replace(perf, nvlink=nvlink),
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=enable_prefix_caching,
            scheduling=scheduling,
            decode_lazily=True,  # the simulator reads no per-token output
        )
        replicas.append(Replica(f"{spec.model}/{n}", spec, gpus, engine))
    for r in replicas:
        r.peers = [o for o in replicas if o is not r and set(o.gpus) & set(r.gpus)]
    return replicas


class PrefixTable:
    """``proxy.router.PrefixTable`` over a simulated prompt: an LRU map from chained prefix
    block keys to every replica that served them. Keys are the prompt's first ``limit``
    tokens in blocks of ``block`` (the last one partial, as the proxy cuts text)."""

    def __init__(self, block: int, limit: int, capacity: int) -> None:
        self.block, self.limit, self.capacity = block, limit, capacity
        self._map: OrderedDict[int, list[Replica]] = OrderedDict()

    @classmethod
    def from_settings(cls, s: RoutingSettings) -> PrefixTable:
        return cls(
            max(1, s.prefix_block_chars // CHARS_PER_TOKEN),
            max(1, s.max_prefix_chars // CHARS_PER_TOKEN),
            s.affinity_entries,
        )

    def keys(self, prompt: Prompt) -> list[int]:
        limit = min(prompt.total, self.limit)
        full = prompt.block_hashes(self.block)[: limit // self.block]
        start = len(full) * self.block
        if limit > start or not full:  # the partial last block, named by its segment pieces
            pieces: list[tuple[int, int, int]] = []
            end = prompt.total
            node: Prompt | None = prompt
            while node is not None and end > start:
                lo = max(start, end - node.length)
                hi = min(limit, end)
                if hi > lo:
                    pieces.append((node.key, lo - (end - node.length), hi - lo))
                end -= node.length
                node = node.parent
            full = [*full, hash((full[-1] if full else 0, tuple(reversed(pieces))))]
        return full

    def longest(self, keys: Sequence[int], pool: Sequence[Replica]) -> tuple[list[Replica], int]:
        """(replicas of ``pool``, number of matched blocks) of the longest remembered prefix
        that a replica of ``pool`` holds; ``([], 0)`` when none does."""
        for i in range(len(keys) - 1, -1, -1):
            held = self._map.get(keys[i])
            if held:
                hits = [r for r in held if r in pool]
                if hits:
                    return hits, i + 1
        return [], 0

    def remember(self, keys: Sequence[int], replica: Replica) -> None:
        for key in keys:
            held = self._map.get(key)
            if held is None:
                self._map[key] = [replica]
            else:
                if replica not in held:
                    held.append(replica)
                self._map.move_to_end(key)
        while len(self._map) > self.capacity:
            self._map.popitem(last=False)


class Router:
    """Picks a replica of a model for each call."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        policy: RoutingPolicy,
        rng: random.Random,
        affinity_slack: int = 8,
        settings: RoutingSettings | None = None,
    ) -> None:
        self.policy = policy
        self.rng = rng
        self.affinity_slack = affinity_slack
        self.settings = settings or RoutingSettings()
        self.by_model: dict[str, list[Replica]] = {}
        for r in replicas:
            self.by_model.setdefault(r.spec.model, []).append(r)
        self._prefixes: dict[str, PrefixTable] = {}

    def pick(self, model: str, request_key: int, prompt: Prompt | None = None) -> Replica:
        """KeyError if no replica serves ``model``. ``prompt``: a chat call's prompt, which
        ``prefix_affinity`` routes by (None: the call carries none, as embeddings)."""
        pool = self.by_model[model]
        if len(pool) == 1:
            return pool[0]
        if self.policy == "prefix_affinity":
            return self._pick_prefix(model, pool, prompt)
        if self.policy == "p2c":
            ra, rb = self.rng.sample(pool, 2)
            return ra if ra.outstanding <= rb.outstanding else rb
        least = min(pool, key=lambda r: r.outstanding)
        if self.policy == "least":
            return least
        preferred = pool[request_key % len(pool)]
        if preferred.outstanding > least.outstanding + self.affinity_slack:
            return least
        return preferred

    def _pick_prefix(self, model: str, pool: list[Replica], prompt: Prompt | None) -> Replica:
        if prompt is None:  # the proxy's p2c
            ra, rb = self.rng.sample(pool, 2)
            return ra if ra.outstanding <= rb.outstanding else rb
        table = self._prefixes.get(model)
        if table is None:
            table = self._prefixes[model] = PrefixTable.from_settings(self.settings)
        keys = table.keys(prompt)
        least = min(pool, key=lambda r: (r.outstanding, self.rng.random()))
        chosen = least
        # Only replicas still in the pool count (a removed one is forgotten, as the proxy
        # does); among the holders of the longest match, the least loaded.
        held, matched = table.longest(keys, pool)
        if held and matched / len(keys) >= self.settings.affinity_min_match:
            preferred = min(held, key=lambda r: (r.outstanding, self.rng.random()))
            others = [r.outstanding for r in pool if r is not preferred]
            if self.settings.keeps_affinity(preferred.outstanding, others):
                chosen = preferred
        table.remember(keys, chosen)
        return chosen

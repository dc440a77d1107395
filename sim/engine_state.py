"""The engine core's request and block state: requests, step outcomes, sequences, block pool.

Role: the data ``sim.engine.EngineCore`` schedules over, kept apart from its scheduler. A
:class:`Seq` is one request's scheduling state; while the simulator's engines decode it lazily
(``EngineCore(decode_lazily=True)``) its ``computed`` and ``generated`` lag by the engine steps
since ``since`` (see ``sim.engine``). :class:`BlockPool` counts free blocks and holds the
prefix cache's hash -> reference-count table with its LRU.

Invariants: a ``Seq``'s ``nblocks == len(held) + private``; ``slot`` grows with every admission,
so the engine's running list is in ``slot`` order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

__all__ = ["BlockPool", "EngineRequest", "HashedPrompt", "Seq", "StepOutcome", "chain_block_hashes"]


@runtime_checkable
class HashedPrompt(Protocol):
    """A prompt that knows its chained block hashes (the simulator's compact prompts)."""

    def block_hashes(self, block_size: int) -> Sequence[int]: ...


def chain_block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Hashes of the full blocks of ``tokens``, each chained over the previous block's hash."""
    out: list[int] = []
    prev = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        prev = hash((prev, tuple(tokens[start : start + block_size])))
        out.append(prev)
    return out


@dataclass
class EngineRequest:
    rid: str
    prompt: Sequence[int]  # token ids (drivers derive them from text; shared prefixes share ids)
    output_tokens: int  # tokens this request will emit; 0 = prefill only (embed/rerank/score)
    arrival: float = 0.0  # driver's clock, for metrics only
    priority: float = 0.0  # lower is served first under scheduling="priority"; else ignored
    model: str = ""  # the model the call names (multi-model engines dispatch on it)
    prefilled: bool = False  # prompt KV delivered by a prefill instance, first token sampled


@dataclass
class StepOutcome:
    duration: float  # seconds this step takes on the modelled GPU
    first_token: list[str] = field(default_factory=list)  # prefill completed (result ready)
    emitted: list[tuple[str, int]] = field(default_factory=list)  # (rid, tokens this step)
    finished: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # for the rids in first_token: prompt tokens found in the prefix cache (usage's
    # prompt_tokens_details.cached_tokens)
    cached_tokens: dict[str, int] = field(default_factory=dict)


class Seq:
    """A request's scheduling state. ``computed``: tokens whose KV is in the cache."""

    __slots__ = (
        "_hashes",
        "cached_tokens",
        "computed",
        "due",
        "fin",
        "full_blocks",
        "generated",
        "held",
        "landed",
        "lazy",
        "nblocks",
        "private",
        "prompt_len",
        "rank",
        "registered",
        "req",
        "since",
        "slot",
    )

    def __init__(self, req: EngineRequest, block_size: int, order: int = 0) -> None:
        self.req = req
        self.prompt_len = len(req.prompt)
        self.full_blocks = self.prompt_len // block_size  # prompt blocks the cache can hold
        self.generated = 1 if req.prefilled else 0
        self.landed = req.prefilled  # KV delivered, not yet admitted
        self.rank = (req.priority, order)  # the waiting queue's order under "priority"
        self.computed = 0
        self.held: list[int] = []  # hashes of cached blocks this request references, in order
        self.private = 0  # blocks held outside the prefix cache
        self.nblocks = 0  # len(held) + private
        self.registered = 0  # prompt blocks already offered to the cache
        self.cached_tokens = 0  # prefix-cache hit at the last admission
        self._hashes: Sequence[int] | None = None
        self.slot = 0  # admission order (the running list's order)
        # lazy decoding: computed and generated lag by the engine's steps since ``since``;
        # ``due``: the step at which it needs a block or finishes; ``fin``: the step it finishes
        self.lazy = False
        self.since = self.due = self.fin = 0

    def hashes(self, block_size: int) -> Sequence[int]:
        if self._hashes is None:
            prompt = self.req.prompt
            own = getattr(prompt, "block_hashes", None)  # HashedPrompt; isinstance() is slow
            self._hashes = (
                own(block_size) if own is not None else chain_block_hashes(prompt, block_size)
            )
        return self._hashes


class BlockPool:
    """Counts free blocks and keeps the hash -> reference-count table with its LRU."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free = num_blocks  # blocks holding nothing reusable
        self.refs: dict[int, int] = {}  # cached block hash -> references
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced, oldest first

    def available(self) -> int:
        return self.free + len(self.lru)

    def take(self, n: int) -> None:
        """Claim ``n`` fresh blocks, evicting least recently used cached blocks if needed."""
        from_free = min(n, self.free)
        self.free -= from_free
        for _ in range(n - from_free):
            victim, _ = self.lru.popitem(last=False)
            del self.refs[victim]

    def register(self, h: int) -> bool:
        """Turn one private block into a cached one under ``h``; False if ``h`` is taken."""
        if h in self.refs:
            return False
        self.refs[h] = 1
        return True

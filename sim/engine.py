"""The engine core: a clock-free continuous-batching scheduler shared by emulator and simulator.

Role: hold requests, decide what one engine step computes (vLLM V1 style: running requests
first, then waiting ones, within a token budget, chunked prefill allowed), keep the KV-cache
block budget, preempt by recompute when blocks run out, and reuse prompt blocks through a
hashed prefix cache. ``step`` returns the step's modelled duration (from ``sim.perf``); the
driver owns the clock.

Invariants:
- blocks held by requests + free blocks + cached unreferenced blocks == ``num_blocks``;
- a prompt block is cached under a hash chained over every token id up to its end, so a hit
  means the whole prefix matches; only full prompt blocks are cached;
- cached blocks with no reference sit in an LRU; they are evicted (oldest first, a request's
  tail blocks before its head) only when a fresh block is needed;
- every submitted request eventually finishes (or is aborted) provided it fits in the cache
  alone: ``submit`` refuses one that cannot;
- a request whose prompt is entirely cached still recomputes its last block (as vLLM does,
  the last token must run through the model to produce logits);
- ``scheduling="fcfs"`` (the default) admits waiting requests in submission order;
  ``"priority"`` by ``EngineRequest.priority`` (lower first, ties in submission order), a
  preempted request re-queued at its own rank (``sim.des`` sets a call's priority to its
  workflow request's start: Ayo-style workflow-aware scheduling);
- a ``prefilled`` request arrives with its prompt's KV computed elsewhere (disaggregated
  prefill, ``sim.multiplex``) and its first token sampled: its admission computes one token
  and counts no prefix-cache hit; a preemption drops that KV (recompute, as any request).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from sim.perf import PerfModel

__all__ = [
    "EngineCore",
    "EngineRequest",
    "HashedPrompt",
    "StepOutcome",
    "chain_block_hashes",
]


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


class _Seq:
    """A request's scheduling state. ``computed``: tokens whose KV is in the cache."""

    __slots__ = (
        "_hashes",
        "cached_tokens",
        "computed",
        "full_blocks",
        "generated",
        "held",
        "landed",
        "nblocks",
        "private",
        "prompt_len",
        "rank",
        "registered",
        "req",
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

    def hashes(self, block_size: int) -> Sequence[int]:
        if self._hashes is None:
            prompt = self.req.prompt
            own = getattr(prompt, "block_hashes", None)  # HashedPrompt; isinstance() is slow
            self._hashes = (
                own(block_size) if own is not None else chain_block_hashes(prompt, block_size)
            )
        return self._hashes


class _BlockPool:
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


class EngineCore:
    """Continuous batching over a modelled GPU. Not thread-safe: one driver owns it."""

    def __init__(
        self,
        perf: PerfModel,
        *,
        max_num_batched_tokens: int = 8192,
        max_num_seqs: int = 256,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        scheduling: Literal["fcfs", "priority"] = "fcfs",
    ) -> None:
        if max_num_batched_tokens < 1 or max_num_seqs < 1 or block_size < 1:
            raise ValueError("max_num_batched_tokens, max_num_seqs and block_size must be >= 1")
        if scheduling not in ("fcfs", "priority"):
            raise ValueError(f"scheduling must be 'fcfs' or 'priority', got {scheduling!r}")
        num_blocks = perf.kv_capacity_tokens() // block_size
        if num_blocks < 1:
            raise ValueError(
                f"{perf.model.name} does not fit on {perf.tp} x {perf.gpu.name} "
                f"at share {perf.share}: no memory left for the KV cache"
            )
        self.perf = perf
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.by_priority = scheduling == "priority"
        self._submitted = 0
        self._pool = _BlockPool(num_blocks)
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._seqs: dict[str, _Seq] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.preemptions_total = 0

    # --- counters ------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_usage(self) -> float:
        """Fraction of blocks held by requests (cached unreferenced blocks count as free)."""
        return 1.0 - self._pool.available() / self._pool.num_blocks

    def cached_tokens(self, rid: str) -> int:
        """Prompt tokens a live request found in the prefix cache at its last admission."""
        seq = self._seqs.get(rid)
        return seq.cached_tokens if seq is not None else 0

    # --- requests ------------------------------------------------------------------------
    def submit(self, req: EngineRequest) -> None:
        """Queue ``req``; ValueError if its id is live, or it could never fit."""
        if req.rid in self._seqs:
            raise ValueError(f"request id {req.rid!r} is already in the engine")
        if req.output_tokens < 0 or len(req.prompt) == 0:
            raise ValueError("a request needs at least one prompt token and output_tokens >= 0")
        total = len(req.prompt) + req.output_tokens
        if total > self.perf.model.max_context:
            raise ValueError(
                f"{total} tokens exceed the context of {self.perf.model.name} "
                f"({self.perf.model.max_context})"
            )
        if -(-total // self.block_size) > self._pool.num_blocks:
            raise ValueError(
                f"{total} tokens exceed the KV cache "
                f"({self._pool.num_blocks * self.block_size} tokens)"
            )
        seq = _Seq(req, self.block_size, self._submitted)
        self._submitted += 1
        self._seqs[req.rid] = seq
        if self.by_priority:
            self._enqueue(seq)
        else:
            self._waiting.append(seq)

    def _enqueue(self, seq: _Seq) -> None:
        """Insert ``seq`` into the waiting queue at its rank (priority scheduling)."""
        waiting = self._waiting
        waiting.insert(bisect.bisect_right(waiting, seq.rank, key=lambda s: s.rank), seq)

    def abort(self, rid: str) -> None:
        """Drop a request wherever it is; unknown ids are ignored (it may have finished)."""
        seq = self._seqs.pop(rid, None)
        if seq is None:
            return
        if seq in self._running:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        self._release(seq)

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    # --- blocks --------------------------------------------------------------------------
    def _release(self, seq: _Seq) -> None:
        pool = self._pool
        refs, lru = pool.refs, pool.lru
        for h in reversed(seq.held):  # tail blocks enter the LRU first, so go first
            count = refs[h] - 1
            refs[h] = count
            if count == 0:
                lru[h] = None
        pool.free += seq.private
        seq.held = []
        seq.private = 0
        seq.nblocks = 0
        seq.computed = 0
        seq.registered = 0

    def _preempt(self, seq: _Seq, out: StepOutcome) -> None:
        self._release(seq)
        if self.by_priority:
            self._enqueue(seq)
        else:
            self._waiting.appendleft(seq)
        self.preemptions_total += 1
        out.preempted.append(seq.req.rid)

    def _match_prefix(self, seq: _Seq) -> tuple[int, int]:
        """Prompt blocks found cached, and how many of them sit unreferenced in the LRU."""
        if not self.enable_prefix_caching:
            return 0, 0
        counts = list(map(self._pool.refs.get, seq.hashes(self.block_size)))
        hits = counts.index(None) if None in counts else len(counts)
        # the last token must be computed to produce logits
        hits = min(hits, (seq.prompt_len + seq.generated - 1) // self.block_size)
        return hits, counts[:hits].count(0)

    def _register(self, seq: _Seq) -> None:
        full = min(seq.computed // self.block_size, seq.full_blocks)
        if full <= seq.registered:
            return
        hashes = seq.hashes(self.block_size)
        pool = self._pool
        for j in range(seq.registered, full):
            if pool.register(hashes[j]):
                seq.private -= 1
                seq.held.append(hashes[j])
        seq.registered = full

    # --- scheduling ----------------------------------------------------------------------
    def _account(self, seq: _Seq, n: int, out: StepOutcome, done: list[_Seq]) -> None:
        """``seq`` computes ``n`` more tokens this step: register its full prompt blocks (at
        schedule time, as vLLM does) and sample a token when its pending tokens are done."""
        computed = seq.computed = seq.computed + n
        if seq.registered < seq.full_blocks and self.enable_prefix_caching:
            self._register(seq)
        generated = seq.generated
        if computed < seq.prompt_len + generated:
            return  # a prefill chunk: no token sampled yet
        rid = seq.req.rid
        if generated == 0:
            out.first_token.append(rid)
            out.cached_tokens[rid] = seq.cached_tokens
            self.prompt_tokens_total += seq.prompt_len
        wanted = seq.req.output_tokens
        if generated < wanted:
            seq.generated = generated = generated + 1
            out.emitted.append((rid, 1))
        if generated >= wanted:
            out.finished.append(rid)
            done.append(seq)

    def step(self) -> StepOutcome:
        """Schedule and account one engine step; the driver advances its clock by
        ``duration`` (simulator) or sleeps it (emulator). Running requests go first, in
        admission order; waiting ones are admitted only if nothing had to be preempted."""
        out = StepOutcome(0.0)
        budget = self.max_num_batched_tokens
        bs = self.block_size
        pool = self._pool
        lru = pool.lru
        prefill = decode = context = 0
        done: list[_Seq] = []  # finished: their blocks are freed after the step, as in vLLM
        emitted = out.emitted
        running = self._running
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            computed = seq.computed
            pending = seq.prompt_len + seq.generated - computed
            n = pending if pending < budget else budget
            need = (computed + n + bs - 1) // bs - seq.nblocks
            if need > 0:
                while need > pool.free + len(lru) and running[-1] is not seq:
                    self._preempt(running.pop(), out)
                if need > pool.free + len(lru):  # seq is the lowest priority: it yields
                    running.pop()
                    self._preempt(seq, out)
                    break
                pool.take(need)
                seq.private += need
                seq.nblocks += need
            budget -= n
            i += 1
            if pending == 1 and seq.generated > 0:  # a decode step: _account's fast path
                decode += 1
                context += computed
                seq.computed = computed + 1
                generated = seq.generated
                wanted = seq.req.output_tokens
                if generated < wanted:
                    seq.generated = generated = generated + 1
                    emitted.append((seq.req.rid, 1))
                if generated >= wanted:
                    out.finished.append(seq.req.rid)
                    done.append(seq)
            else:
                prefill += n
                self._account(seq, n, out, done)
        waiting = self._waiting
        while waiting and budget > 0 and len(running) < self.max_num_seqs and not out.preempted:
            seq = waiting[0]
            if seq.landed:  # its prompt's KV arrived from a prefill instance: one token runs
                hits, in_lru = 0, 0
                computed = seq.prompt_len + seq.generated - 1
            else:
                hits, in_lru = self._match_prefix(seq)
                computed = hits * bs
            n = min(seq.prompt_len + seq.generated - computed, budget)
            need = (computed + n + bs - 1) // bs - hits
            if need + in_lru > pool.free + len(lru):
                break
            waiting.popleft()
            seq.held = held = list(seq.hashes(bs)[:hits])
            refs = pool.refs
            for h in held:
                count = refs[h]
                if count == 0:
                    del lru[h]
                refs[h] = count + 1
            seq.registered = hits
            seq.computed = computed
            seq.cached_tokens = hits * bs
            seq.landed = False  # after a preemption it recomputes everything
            self.prefix_cache_queries += seq.prompt_len
            self.prefix_cache_hits += hits * bs
            pool.take(need)
            seq.private = need
            seq.nblocks = hits + need
            running.append(seq)
            prefill += n
            budget -= n
            self._account(seq, n, out, done)
        self.generation_tokens_total += len(out.emitted)
        if done:
            for seq in done:
                self._release(seq)
                del self._seqs[seq.req.rid]
                seq.computed = -1  # marks it for removal from the running list
            self._running = [s for s in running if s.computed >= 0]
        if prefill or decode:
            out.duration = self.perf.step_time(prefill, decode, context)
        return out

    # --- fast-forward for the simulator ---------------------------------------------------
    def decode_run_length(self) -> int:
        """How many of the next steps are certain to be identical pure-decode steps in which
        nothing finishes, is admitted or is preempted (0 when the next step is not one)."""
        running = self._running
        if not running or len(running) > self.max_num_batched_tokens:
            return 0
        if self._waiting and len(running) < self.max_num_seqs:
            return 0  # the next step may admit
        k = self.max_num_batched_tokens  # any large bound
        for seq in running:
            if seq.generated == 0 or seq.computed != seq.prompt_len + seq.generated - 1:
                return 0
            left = seq.req.output_tokens - seq.generated - 1  # the last decode step finishes
            if left < k:
                k = left
        while k > 0 and self._decode_blocks(k) > self._pool.available():
            k //= 2
        return k

    def _decode_blocks(self, steps: int) -> int:
        bs = self.block_size
        return sum((s.computed + steps + bs - 1) // bs - s.nblocks for s in self._running)

    def decode_run_times(self, steps: int) -> NDArray[np.float64]:
        """Durations of the next ``steps`` decode steps (``steps <= decode_run_length()``)."""
        d = len(self._running)
        context0 = sum(s.computed for s in self._running)
        contexts = context0 + d * np.arange(steps, dtype=np.float64)
        return self.perf.step_times(0, d, contexts)

    def advance_decode(self, steps: int) -> None:
        """Account ``steps`` decode steps at once (``steps <= decode_run_length()``); their
        outcomes (one token per running request per step) are not reported."""
        bs = self.block_size
        pool = self._pool
        for seq in self._running:
            computed = seq.computed = seq.computed + steps
            seq.generated += steps
            need = (computed + bs - 1) // bs - seq.nblocks
            if need > 0:
                pool.take(need)
                seq.private += need
                seq.nblocks += need
        self.generation_tokens_total += steps * len(self._running)

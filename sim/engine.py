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
  and counts no prefix-cache hit; a preemption drops that KV (recompute, as any request);
- lazy decoding (``decode_lazily``: the simulator's engines, where a step batches ~50
  decoding requests and visiting each per step dominated): a running request in pure decode
  that needs no new block and does not finish in the next step is not visited; its counters
  lag by the steps since and catch up at the step it needs a block or finishes, or before any
  step whose tokens or blocks might not fit (that step then runs with none lazy, so preemption
  picks the same victims). Steps, durations, blocks and outcomes are exactly those of the
  eager engine, except that ``emitted`` is not reported.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from sim.engine_state import (
    BlockPool,
    EngineRequest,
    HashedPrompt,
    Seq,
    StepOutcome,
    chain_block_hashes,
)
from sim.perf import PerfModel

__all__ = [
    "EngineCore",
    "EngineRequest",
    "HashedPrompt",
    "StepOutcome",
    "chain_block_hashes",
]


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
        decode_lazily: bool = False,
    ) -> None:
        """``decode_lazily``: the simulator's mode (see the module docstring); ``step`` then
        reports no ``emitted`` tokens."""
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
        self._pool = BlockPool(num_blocks)
        self._waiting: deque[Seq] = deque()
        self._running: list[Seq] = []
        self._seqs: dict[str, Seq] = {}
        self._admitted = 0
        # Lazy decoding: ``_active`` is ``_running`` itself while no request is lazy, else the
        # running requests that are not, in running order; ``_clock`` counts steps;
        # ``_due``: step -> lazy requests that need a block or finish then (stale entries
        # are skipped); ``_lazy_context``: the lazy requests' computed tokens, summed.
        self.decode_lazily = decode_lazily
        self._active = self._running
        self._clock = 0
        self._lazy_count = 0
        self._lazy_context = 0
        self._due: dict[int, list[Seq]] = {}
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
        seq = Seq(req, self.block_size, self._submitted)
        self._submitted += 1
        self._seqs[req.rid] = seq
        if self.by_priority:
            self._enqueue(seq)
        else:
            self._waiting.append(seq)

    def _enqueue(self, seq: Seq) -> None:
        """Insert ``seq`` into the waiting queue at its rank (priority scheduling)."""
        waiting = self._waiting
        waiting.insert(bisect.bisect_right(waiting, seq.rank, key=lambda s: s.rank), seq)

    def abort(self, rid: str) -> None:
        """Drop a request wherever it is; unknown ids are ignored (it may have finished)."""
        seq = self._seqs.pop(rid, None)
        if seq is None:
            return
        if seq.lazy:
            self._wake(seq)
        if seq in self._running:
            self._running.remove(seq)
            if self._active is not self._running:
                if seq in self._active:
                    self._active.remove(seq)
                if not self._lazy_count:
                    self._active = self._running
        else:
            self._waiting.remove(seq)
        self._release(seq)

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    # --- blocks --------------------------------------------------------------------------
    def _release(self, seq: Seq) -> None:
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

    def _preempt(self, seq: Seq, out: StepOutcome) -> None:
        self._release(seq)
        if self.by_priority:
            self._enqueue(seq)
        else:
            self._waiting.appendleft(seq)
        self.preemptions_total += 1
        out.preempted.append(seq.req.rid)

    def _match_prefix(self, seq: Seq) -> tuple[int, int]:
        """Prompt blocks found cached, and how many of them sit unreferenced in the LRU."""
        if not self.enable_prefix_caching:
            return 0, 0
        counts = list(map(self._pool.refs.get, seq.hashes(self.block_size)))
        hits = counts.index(None) if None in counts else len(counts)
        # the last token must be computed to produce logits
        hits = min(hits, (seq.prompt_len + seq.generated - 1) // self.block_size)
        return hits, counts[:hits].count(0)

    def _register(self, seq: Seq) -> None:
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
    def _account(self, seq: Seq, n: int, out: StepOutcome, done: list[Seq]) -> None:
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
        lazy = self._prepare_lazy() if self._lazy_count else 0
        budget = self.max_num_batched_tokens - lazy
        bs = self.block_size
        pool = self._pool
        lru = pool.lru
        prefill = 0
        decode, context = lazy, self._lazy_context  # the lazy requests decode one token each
        done: list[Seq] = []  # finished: their blocks are freed after the step, as in vLLM
        emitted = out.emitted
        running = self._running
        batch = self._active  # running itself unless some requests are lazy (none preempted)
        i = 0
        while i < len(batch) and budget > 0:
            seq = batch[i]
            computed = seq.computed
            pending = seq.prompt_len + seq.generated - computed
            n = pending if pending < budget else budget
            need = (computed + n + bs - 1) // bs - seq.nblocks
            if need > 0:
                while need > pool.free + len(lru) and batch[-1] is not seq:
                    self._preempt(batch.pop(), out)
                if need > pool.free + len(lru):  # seq is the lowest priority: it yields
                    batch.pop()
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
            seq.slot = self._admitted
            self._admitted += 1
            running.append(seq)
            if batch is not running:
                batch.append(seq)
            prefill += n
            budget -= n
            self._account(seq, n, out, done)
        self.generation_tokens_total += len(out.emitted) + lazy
        if lazy:
            self._clock += 1
            self._lazy_context += lazy
        if done:
            for seq in done:
                self._release(seq)
                del self._seqs[seq.req.rid]
                seq.computed = -1  # marks it for removal from the running list
            self._running = [s for s in running if s.computed >= 0]
            self._active = (
                self._running if batch is running else [s for s in batch if s.computed >= 0]
            )
        if prefill or decode:
            out.duration = self.perf.step_time(prefill, decode, context)
        if self.decode_lazily:
            self._lazify()
            out.emitted = []
        return out

    # --- lazy decoding (the simulator's engines) -----------------------------------------
    def _lazify(self) -> None:
        """After a step: let every active request in pure decode that needs no block and does
        not finish in the next step decode lazily until it does (its ``due`` step)."""
        clock, bs = self._clock, self.block_size
        batch = self._active
        keep: list[Seq] = []
        for seq in batch:
            generated = seq.generated
            computed = seq.computed
            if generated and computed == seq.prompt_len + generated - 1:
                fin = clock + seq.req.output_tokens - generated - 1  # its last decode step
                due = min(clock + seq.nblocks * bs - computed, fin)  # or its next new block
                if due > clock:
                    seq.lazy = True
                    seq.since, seq.due, seq.fin = clock, due, fin
                    self._lazy_count += 1
                    self._lazy_context += computed
                    self._due.setdefault(due, []).append(seq)
                    continue
            keep.append(seq)
        if len(keep) < len(batch):
            self._active = keep

    def _wake(self, seq: Seq) -> None:
        """Bring a lazy request's counters up to date; it is stepped one by one again."""
        lag = self._clock - seq.since
        seq.computed += lag
        seq.generated += lag
        seq.lazy = False
        self._lazy_count -= 1
        self._lazy_context -= seq.computed

    def _prepare_lazy(self) -> int:
        """Before a step: wake the requests due now; wake all when the step's tokens might
        exceed the budget or its blocks the free ones (then the step runs exactly as if none
        had been lazy: preemption order matters). Returns how many stay lazy."""
        clock = self._clock
        woken = [s for s in self._due.pop(clock, ()) if s.lazy and s.due == clock]
        for seq in woken:
            self._wake(seq)
        if not self._lazy_count:
            self._active = self._running
            return 0
        active = self._active
        if woken:
            active.extend(woken)
            active.sort(key=_slot)
        bs = self.block_size
        budget = self.max_num_batched_tokens - self._lazy_count
        need = 0
        for seq in active:
            computed = seq.computed
            pending = seq.prompt_len + seq.generated - computed
            budget -= pending
            need += max(0, (computed + pending + bs - 1) // bs - seq.nblocks)
        if budget < 0 or need > self._pool.available():
            self._wake_all()
            return 0
        return self._lazy_count

    def _wake_all(self) -> None:
        for seq in self._running:
            if seq.lazy:
                self._wake(seq)
        self._due.clear()
        self._active = self._running

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
        if self._lazy_count:  # the lazy decode until their ``fin`` step, then finish
            k = min(k, min([s.fin for s in running if s.lazy]) - self._clock)
        for seq in self._active:
            if seq.generated == 0 or seq.computed != seq.prompt_len + seq.generated - 1:
                return 0
            left = seq.req.output_tokens - seq.generated - 1  # the last decode step finishes
            if left < k:
                k = left
        while k > 0 and self._decode_blocks(k) > self._pool.available():
            k //= 2
        return k

    def _decode_blocks(self, steps: int) -> int:
        bs, clock = self.block_size, self._clock
        return sum(
            (s.computed + (clock - s.since if s.lazy else 0) + steps + bs - 1) // bs - s.nblocks
            for s in self._running
        )

    def decode_run_times(self, steps: int) -> NDArray[np.float64]:
        """Durations of the next ``steps`` decode steps (``steps <= decode_run_length()``)."""
        d = len(self._running)
        context0 = self._lazy_context + sum(s.computed for s in self._active)
        contexts = context0 + d * np.arange(steps, dtype=np.float64)
        return self.perf.step_times(0, d, contexts)

    def advance_decode(self, steps: int) -> None:
        """Account ``steps`` decode steps at once (``steps <= decode_run_length()``); their
        outcomes (one token per running request per step) are not reported."""
        active = self._active
        for seq in active:
            seq.computed += steps
            seq.generated += steps
            self._cover(seq)
        if self._lazy_count:
            # The lazy ones due for a block inside the run wake at its end and take their
            # blocks then: the run's blocks fit, and taking them in another order ends the same.
            clock, due = self._clock, self._due
            woken = [
                s
                for c in range(clock, clock + steps)
                for s in due.pop(c, ())
                if s.lazy and s.due == c
            ]
            self._clock += steps
            self._lazy_context += steps * self._lazy_count
            for seq in woken:
                self._wake(seq)
                self._cover(seq)
            if not self._lazy_count:
                self._active = self._running
            elif woken:
                active.extend(woken)
                active.sort(key=_slot)
        self.generation_tokens_total += steps * len(self._running)

    def _cover(self, seq: Seq) -> None:
        """Take the blocks ``seq``'s computed tokens need."""
        need = (seq.computed + self.block_size - 1) // self.block_size - seq.nblocks
        if need > 0:
            self._pool.take(need)
            seq.private += need
            seq.nblocks += need


def _slot(seq: Seq) -> int:
    return seq.slot

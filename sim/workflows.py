"""Stochastic workflow generators for the simulator: the control flow of workloads.md's apps.

Role: each workflow request is a Python generator that yields what it does next: a list of
LLM ``Call``s to run in parallel (it resumes once all have finished) or a ``Delay`` (non-LLM
work such as a vector search). Prompts are ``Prompt`` chains of synthetic segments, so shared
prefixes (system prompt, a beam's earlier steps) have equal block hashes and the engines'
prefix caches see them, without materialising token lists.

Workflows (assumptions are marked; published step statistics were not found, workloads.md):
- ``beam``: beam search with a process-reward verifier (search-and-learn defaults n=4, M=4,
  at most 40 iterations). Per iteration n generator calls, then n verifier calls, each batch
  in parallel. Step length lognormal (median 60, sigma 0.7, cap 2048) # assumed, matching the
  emulator's defaults; a step ends the beam (EOS) with probability 0.1 # assumed; the search
  stops once n beams have completed (# assumed: ~10 iterations, inside workloads.md's 5-15),
  when no beam is active, or after the last iteration.
- ``rag``: embed the query (~15 tokens) -> local vector search (5 ms # assumed) -> rerank 20
  documents (~150 tokens per query+document pair) -> chat with ~800 input tokens, 32 out.
- ``fanout``: rounds of two parallel calls to two different LLMs (for ALP-accuracy tests).

Invariants: a generator's randomness comes only from the ``numpy.random.Generator`` it is
given, so a (seed, arrival order) pair replays exactly; ``Prompt`` is immutable.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, overload

import numpy as np

__all__ = [
    "BeamParams",
    "Call",
    "Delay",
    "FanoutParams",
    "Prompt",
    "RagParams",
    "WorkflowGen",
    "WorkflowParams",
    "start_workflow",
]


class Prompt(Sequence[int]):
    """A token sequence made of segments ``(key, length)``: token ``i`` of a segment is a
    pure function of ``(key, i)``. ``extend`` shares the parent's segments and block hashes."""

    __slots__ = ("_hashes", "key", "length", "parent", "total")

    def __init__(self, key: int, length: int, parent: Prompt | None = None) -> None:
        if length < 0:
            raise ValueError("segment length must be >= 0")
        self.key = key
        self.length = length
        self.parent = parent
        self.total: int = length + (parent.total if parent is not None else 0)
        # block hashes by block size: the engines (16 tokens) and the router (32) both ask,
        # and one slot would make them recompute each other's, up the whole chain
        self._hashes: dict[int, list[int]] | None = None

    def extend(self, key: int, length: int) -> Prompt:
        return Prompt(key, length, self)

    def segments(self) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        node: Prompt | None = self
        while node is not None:
            out.append((node.key, node.length))
            node = node.parent
        out.reverse()
        return out

    def __len__(self) -> int:
        return self.total

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...
    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.total))]
        if index < 0:
            index += self.total
        if not 0 <= index < self.total:
            raise IndexError(index)
        for key, length in self.segments():
            if index < length:
                return hash((key, index)) & 0x1FFFF  # a Llama-3-sized vocabulary
            index -= length
        raise AssertionError("unreachable")

    def __iter__(self) -> Iterator[int]:
        for key, length in self.segments():
            for i in range(length):
                yield hash((key, i)) & 0x1FFFF

    def block_hashes(self, block_size: int) -> list[int]:
        """Chained hashes of the full blocks; a block's content is named by its
        (key, offset, length) pieces, so equal segment chains give equal hashes."""
        cache = self._hashes
        if cache is None:
            cache = self._hashes = {}
        else:
            known = cache.get(block_size)
            if known is not None:
                return known
        parent = self.parent
        hashes = parent.block_hashes(block_size)[: parent.total // block_size] if parent else []
        full = self.total // block_size
        if full > len(hashes):
            lo0 = len(hashes) * block_size
            # the segments covering [lo0, total), as (key, start, length), walking up the chain
            tail: list[tuple[int, int, int]] = []
            node: Prompt | None = self
            end = self.total
            while node is not None and end > lo0:
                tail.append((node.key, end - node.length, node.length))
                end -= node.length
                node = node.parent
            tail.reverse()
            prev = hashes[-1] if hashes else 0
            s = 0
            append = hashes.append
            for j in range(len(hashes), full):
                lo, hi = j * block_size, (j + 1) * block_size
                while tail[s][1] + tail[s][2] <= lo:
                    s += 1
                key, start, length = tail[s]
                if start <= lo and hi <= start + length:  # the block lies in one segment
                    prev = hash((prev, ((key, lo - start, block_size),)))
                    append(prev)
                    continue
                pieces = []
                t = s
                while t < len(tail) and tail[t][1] < hi:
                    key, start, length = tail[t]
                    a, b = max(lo, start), min(hi, start + length)
                    if b > a:
                        pieces.append((key, a - start, b - a))
                    t += 1
                prev = hash((prev, tuple(pieces)))
                append(prev)
        cache[block_size] = hashes
        return hashes


@dataclass(frozen=True)
class Call:
    """One LLM call: ``inputs`` are engine requests run together (rerank: one per pair)."""

    model: str
    endpoint: Literal["/v1/chat/completions", "/v1/embeddings", "/v1/rerank"]
    inputs: tuple[Prompt, ...]
    output_tokens: int  # per input; 0 for embeddings and rerank


@dataclass(frozen=True)
class Delay:
    seconds: float


Action = list[Call] | Delay
WorkflowGen = Generator[Action, None, None]


@dataclass(frozen=True)
class BeamParams:
    generator: str = "llama-3.2-1b"
    verifier: str = "llama-3.1-8b-prm"
    n: int = 4  # beams
    beam_width: int = 4  # M
    max_iterations: int = 40
    system_tokens: int = 140
    problem_tokens: tuple[int, int] = (20, 60)  # uniform range # assumed ("a few dozen")
    verifier_template_tokens: int = 24  # PRM instruction wrapped around the beam # assumed
    step_median_tokens: float = 60.0  # assumed (workloads.md: median 40-80)
    step_sigma: float = 0.7  # assumed
    max_step_tokens: int = 2048
    eos_probability: float = 0.1  # assumed
    stop_after_completed: int | None = None  # None: n completed beams end the search


@dataclass(frozen=True)
class RagParams:
    embedder: str = "e5-base-v2"
    reranker: str = "bge-reranker-base"
    generator: str = "llama-3-8b"
    query_tokens: int = 15
    documents: int = 20
    pair_tokens: int = 150
    top_n: int = 5
    system_tokens: int = 60  # assumed
    passage_tokens: int = 140  # ~100 words
    output_tokens: int = 32
    search_seconds: float = 0.005  # local vector search # assumed
    corpus: int = 100_000  # passages to draw from


@dataclass(frozen=True)
class FanoutParams:
    models: tuple[str, str] = ("llama-3.2-1b", "llama-3-8b")
    rounds: tuple[int, int] = (1, 4)  # uniform range of rounds per request
    prompt_tokens: tuple[int, int] = (400, 200)  # per model, per round (new tokens)
    output_median: tuple[float, float] = (120.0, 40.0)  # lognormal medians per model
    output_sigma: float = 0.5


WorkflowParams = BeamParams | RagParams | FanoutParams

# Segment keys: small constants for prompts every request shares, random 62-bit keys for the rest.
_BEAM_SYSTEM, _PRM_TEMPLATE, _RAG_SYSTEM, _FANOUT_SYSTEM = 1, 2, 3, 4
_PASSAGE_BASE = 1 << 40


@dataclass
class _Keys:
    rng: np.random.Generator

    def fresh(self) -> int:
        return int(self.rng.integers(1 << 48, 1 << 62))


def _lognormal(rng: np.random.Generator, median: float, sigma: float, cap: int) -> int:
    return int(min(cap, max(1, round(median * float(np.exp(sigma * rng.standard_normal()))))))


def beam_search(p: BeamParams, rng: np.random.Generator) -> WorkflowGen:
    keys = _Keys(rng)
    problem = keys.fresh(), int(rng.integers(p.problem_tokens[0], p.problem_tokens[1] + 1))
    gen_root = Prompt(_BEAM_SYSTEM, p.system_tokens).extend(*problem)
    ver_root = Prompt(_PRM_TEMPLATE, p.verifier_template_tokens).extend(*problem)
    # a beam is its text so far: the step segments, as seen by generator and verifier
    beams: list[tuple[Prompt, Prompt]] = [(gen_root, ver_root)] * p.n
    completed = 0
    enough = p.stop_after_completed or p.n
    for it in range(p.max_iterations):
        last = it == p.max_iterations - 1
        steps = [
            (keys.fresh(), _lognormal(rng, p.step_median_tokens, p.step_sigma, p.max_step_tokens))
            for _ in beams
        ]
        yield [
            Call(p.generator, "/v1/chat/completions", (g,), n)
            for (g, _), (_, n) in zip(beams, steps, strict=True)
        ]
        grown = [(g.extend(*s), v.extend(*s)) for (g, v), s in zip(beams, steps, strict=True)]
        yield [Call(p.verifier, "/v1/chat/completions", (v,), 1) for _, v in grown]
        done = last or rng.random(len(grown)) < p.eos_probability
        active = [b for b, d in zip(grown, np.broadcast_to(done, len(grown)), strict=True) if not d]
        completed += len(grown) - len(active)
        if not active or completed >= enough:
            return
        # scores are i.i.d. here: the top n/M survivors are a random subset, copied M times
        keep = max(1, p.n // p.beam_width)
        chosen = rng.choice(len(active), size=min(keep, len(active)), replace=False)
        survivors = [active[int(i)] for i in chosen]
        beams = [survivors[i % len(survivors)] for i in range(p.n)]


def rag(p: RagParams, rng: np.random.Generator) -> WorkflowGen:
    keys = _Keys(rng)
    query = keys.fresh()
    yield [Call(p.embedder, "/v1/embeddings", (Prompt(query, p.query_tokens),), 0)]
    yield Delay(p.search_seconds)
    docs = rng.choice(p.corpus, size=p.documents, replace=False) + _PASSAGE_BASE
    pairs = tuple(
        Prompt(query, p.query_tokens).extend(int(d), p.pair_tokens - p.query_tokens) for d in docs
    )
    yield [Call(p.reranker, "/v1/rerank", pairs, 0)]
    prompt = Prompt(_RAG_SYSTEM, p.system_tokens)
    for d in docs[: p.top_n]:
        prompt = prompt.extend(int(d), p.passage_tokens)
    prompt = prompt.extend(query, p.query_tokens)
    yield [Call(p.generator, "/v1/chat/completions", (prompt,), p.output_tokens)]


def fanout(p: FanoutParams, rng: np.random.Generator) -> WorkflowGen:
    keys = _Keys(rng)
    contexts = [Prompt(_FANOUT_SYSTEM, 32), Prompt(_FANOUT_SYSTEM, 32)]
    for _ in range(int(rng.integers(p.rounds[0], p.rounds[1] + 1))):
        calls = []
        for i, model in enumerate(p.models):
            contexts[i] = contexts[i].extend(keys.fresh(), p.prompt_tokens[i])
            out = _lognormal(rng, p.output_median[i], p.output_sigma, 4096)
            calls.append(Call(model, "/v1/chat/completions", (contexts[i],), out))
        yield calls


def start_workflow(params: WorkflowParams, rng: np.random.Generator) -> WorkflowGen:
    """A fresh workflow request driven by ``rng``."""
    if isinstance(params, BeamParams):
        return beam_search(params, rng)
    if isinstance(params, RagParams):
        return rag(params, rng)
    return fanout(params, rng)


def models_of(params: WorkflowParams) -> tuple[str, ...]:
    if isinstance(params, BeamParams):
        return (params.generator, params.verifier)
    if isinstance(params, RagParams):
        return (params.embedder, params.reranker, params.generator)
    return params.models

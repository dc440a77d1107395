"""Deterministic text for the emulator: tokenisation, chat templating and generated output.

Role: turn request text into token ids for the engine core, and decide up front what an
emulated model "generates" (its tokens, its text, where it stops and why), so that the engine
core only paces tokens and never sees words.

Invariants:
- tokenisation is a pure function of the text, position-independent per piece, so two prompts
  with the same leading text share the same leading token ids (prefix caching sees them);
- generation is a pure function of (emulator seed, prompt, sampling key, choice index): the same
  request with the same seed yields the same text; the sampling key is the request's ``seed``,
  or a server-side draw number when the request samples (temperature > 0) without one;
- the output length is decided before the engine core sees the request; stop strings truncate
  the planned tokens at their first occurrence in the generated text, exactly as a stop check
  on the decoded text would.

Assumptions (not measured, marked as such): the number of tokens per beam-search step is
lognormal with median ``median_tokens`` (default 60) and log-sigma ``sigma`` (default 0.7);
a step ends with end-of-sequence instead of its stop string with probability
``eos_probability`` (default 0.1, independently per sample, as ``sim.workflows`` assumes:
a search that stops at n completed beams then runs ~10 iterations, inside workloads.md's 5-15).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

VOCAB_SIZE = 128_256  # Llama-3's vocabulary size; ids only need to be stable, not meaningful
# Words split into chunks of at most five letters: ~1.3 tokens per English word, like BPE.
_PIECE = re.compile(r"<\|[a-z_]+\|>| ?[A-Za-z0-9]{1,5}| ?[^\sA-Za-z0-9]|\s+")
BOS = "<|begin_of_text|>"

# Words the emulated models write with: reasoning-flavoured so logs look plausible.
_WORDS: tuple[str, ...] = tuple(
    """the a of to and is we that this so then for with by as it be are from on let each
    value number sum term equation solve find step since because therefore thus given both
    side divide multiply add subtract factor root square total answer result first second next
    which gives hence note substitute expression integer positive negative equal case check
    now can must all two three four five ten hundred half twice less more than where when
    formula rule simplify compute write get so area length ratio angle point line circle
    probability count ways choose order remainder prime even odd digit product difference""".split()
)


def digest(*parts: object) -> int:
    """A stable 64-bit hash of the parts' text (Python's hash() is salted per process)."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(repr(part).encode())
        h.update(b"\x1f")
    return int.from_bytes(h.digest(), "little")


def pieces(text: str) -> list[str]:
    """Split text into token strings: special tokens, (space+)word chunks of at most five
    letters, punctuation, whitespace runs."""
    return _PIECE.findall(text)


@lru_cache(maxsize=1 << 18)
def _piece_id(piece: str) -> int:
    return digest(piece) % VOCAB_SIZE


def token_ids(text: str) -> list[int]:
    """Token ids of text; identical pieces always map to identical ids."""
    return list(map(_piece_id, _PIECE.findall(text)))


def content_text(content: Any) -> str:
    """A chat message's content as text: a string, or the text parts of a content list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    return str(content)


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """Render messages with a Llama-3-style template, as vLLM would before tokenising.

    With ``continue_final_message`` the last message stays open (no end-of-turn token) and no
    generation prompt follows, so the model continues that message's text.
    """
    out = [BOS]
    for i, msg in enumerate(messages):
        role = str(msg.get("role", "user"))
        out.append(f"<|start_header_id|>{role}<|end_header_id|>\n\n")
        out.append(content_text(msg.get("content")))
        if not (continue_final_message and i == len(messages) - 1):
            out.append("<|eot_id|>")
    if add_generation_prompt and not continue_final_message:
        out.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(out)


@dataclass(frozen=True)
class LengthModel:
    """How long an emulated generation runs before its stop string or end-of-sequence."""

    median_tokens: float = 60.0  # assumption: workloads.md says median 40-80, not measured
    sigma: float = 0.7  # assumption: gives a tail past 500 tokens in ~0.1% of steps
    eos_probability: float = 0.1  # assumption: ~10 steps per beam-search solution

    def __post_init__(self) -> None:
        if self.median_tokens < 1 or self.sigma < 0 or not 0 <= self.eos_probability <= 1:
            raise ValueError(f"invalid length model {self}")


@dataclass(frozen=True)
class Generation:
    """One choice's planned output: the engine emits ``len(tokens)`` tokens, the client sees
    ``text`` (stop string removed unless asked for) and ``deltas`` (per token; they join to
    ``text``)."""

    tokens: tuple[str, ...]
    deltas: tuple[str, ...]
    text: str
    finish_reason: str  # "stop" | "length"
    stop_reason: str | None  # the stop string matched, None for end-of-sequence or length
    logprobs: tuple[float, ...]  # logprob of each emitted token
    verdict: float | None = None  # P("+") when this is a process-reward verdict ("+" or "-")


@dataclass(frozen=True)
class GenerationRequest:
    """What decides a generation, extracted from a chat or completions body."""

    prompt: str
    max_tokens: int
    stop: tuple[str, ...] = ()
    sampling_key: int = 0
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False


def _words(rng: np.random.Generator, count: int) -> list[str]:
    """``count`` tokens of sentence-like text: words, with a full stop now and then."""
    out: list[str] = []
    capital = True
    for _ in range(count):
        if not capital and rng.random() < 0.08:
            out.append(".")
            capital = True
            continue
        word = _WORDS[int(rng.integers(len(_WORDS)))]
        out.append(" " + (word.capitalize() if capital else word))
        capital = False
    if out:
        out[0] = out[0].lstrip()
    return out


def plan_generation(
    req: GenerationRequest, choice: int, *, seed: int, lengths: LengthModel
) -> Generation:
    """Decide one choice's output tokens, text and finish reason (see module invariants)."""
    rng = np.random.default_rng(digest("gen", seed, req.prompt, req.sampling_key, choice))
    if req.ignore_eos:
        length, ending = req.max_tokens, None
    else:
        drawn = lengths.median_tokens * math.exp(lengths.sigma * float(rng.standard_normal()))
        length = max(1, round(drawn), req.min_tokens)
        # Each sample ends the solution on its own (as the simulator's beam workflow assumes).
        eos = not req.stop or float(rng.random()) < lengths.eos_probability
        ending = None if eos else req.stop[0]
    body = _words(rng, max(0, length - 1) if ending is not None else length)
    tokens = [*body, ending] if ending is not None else body
    finish, stop_reason = ("length" if req.ignore_eos else "stop"), None
    if len(tokens) > req.max_tokens:
        tokens, finish = tokens[: req.max_tokens], "length"
    # Stop strings cut the text at their first occurrence, whichever token completes them.
    full, emitted, visible = "", len(tokens), -1
    longest = max(map(len, req.stop), default=0)
    for k, tok in enumerate(tokens):
        start = max(0, len(full) - longest)
        full += tok
        hit = _first_stop(full, req.stop, start)
        if hit is not None and k + 1 >= req.min_tokens:
            at, stop = hit
            visible = at + len(stop) if req.include_stop_str_in_output else at
            emitted, finish, stop_reason = k + 1, "stop", stop
            break
    visible = len(full) if visible < 0 else visible
    # Deltas cut at the visible end, so a stop string is never streamed, even in part.
    deltas, bound = [], 0
    for tok in tokens[:emitted]:
        deltas.append(full[min(bound, visible) : min(bound + len(tok), visible)])
        bound += len(tok)
    text = full[:visible]
    kept = tuple(tokens[:emitted])
    logprobs = tuple(float(np.log(rng.uniform(0.25, 0.98))) for _ in kept)
    return Generation(kept, tuple(deltas), text, finish, stop_reason, logprobs)


def _first_stop(text: str, stops: Sequence[str], start: int) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for stop in stops:
        if not stop:
            continue
        at = text.find(stop, start)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    return best


def alternatives(token: str, logprob: float, k: int, key: int) -> list[tuple[str, float]]:
    """``k`` top alternatives for a position, the chosen token first, descending logprobs."""
    if k <= 0:
        return []
    rng = np.random.default_rng(digest("alt", token, key))
    out = [(token, logprob)]
    rest = 1.0 - math.exp(logprob)
    for _ in range(k - 1):
        word = " " + _WORDS[int(rng.integers(len(_WORDS)))]
        if any(word == w for w, _ in out):
            word += "s"
        share = rest * float(rng.uniform(0.2, 0.6))
        rest -= share
        out.append((word, math.log(max(share, 1e-12))))
    out[1:] = sorted(out[1:], key=lambda wl: -wl[1])
    return out


def prm_probability(prompt: str, *, seed: int) -> float:
    """Deterministic P("+") a process-reward model assigns to the step that ends ``prompt``."""
    u = (digest("prm", seed, prompt) % 1_000_003) / 1_000_003
    return 0.05 + 0.9 * u


def prm_top_logprobs(p_plus: float, k: int) -> list[tuple[str, float]]:
    """Top logprobs of a PRM's one-token verdict: "+" and "-" (always both), then filler."""
    mass = 0.98  # the verdict tokens take almost all of the probability, as in a trained PRM
    out = [("+", math.log(mass * p_plus)), ("-", math.log(mass * (1 - p_plus)))]
    out.sort(key=lambda wl: -wl[1])
    filler = [" The", " Step", "\n", " I", " ", " +"]
    rest = 1.0 - mass
    for word in filler[: max(0, k - 2)]:
        rest /= 2
        out.append((word, math.log(rest)))
    return out

"""Deterministic embeddings and relevance scores for emulated embedding and reranker models.

Role: give ``/v1/embeddings``, ``/rerank``, ``/score`` and ``/pooling`` answers that behave
like a real model's where it matters to an application: texts that share words score higher
than texts that do not, so a RAG pipeline's vector search and reranking pick sensible passages.

Method: a hashed bag of lowercase word unigrams and bigrams (stop words and e5's ``query:`` /
``passage:`` prefixes removed), each feature projected onto a fixed pseudo-random Gaussian
direction (seeded by the feature's hash), summed with weights and normalised to unit length.

Invariants: a pure function of (text, dimension, seed); every vector has unit L2 norm (an empty
text gets a direction from its own hash); cosine similarity of unrelated texts is near 0, and
grows with shared vocabulary.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from functools import lru_cache

import numpy as np
import numpy.typing as npt

from sim.text import digest

Vector = npt.NDArray[np.float32]

_WORD = re.compile(r"[a-z0-9]+")
_PREFIX = re.compile(r"^\s*(query|passage)\s*:\s*", re.IGNORECASE)
_STOP_WORDS = frozenset(
    """a an the of to and or in on at by for with is are was were be been it its this that
    these those as from what which who whom how when where why do does did not no so than then
    there their they them he she his her we our you your i me my""".split()
)
_BIGRAM_WEIGHT = 0.5  # bigrams sharpen phrase matches without drowning single-word overlap


def features(text: str) -> dict[str, float]:
    """Weighted unigram and bigram features of a text (see module docstring)."""
    words = [w for w in _WORD.findall(_PREFIX.sub("", text).lower()) if w not in _STOP_WORDS]
    out: dict[str, float] = dict(Counter(words))
    for a, b in itertools.pairwise(words):
        out[f"{a} {b}"] = out.get(f"{a} {b}", 0.0) + _BIGRAM_WEIGHT
    return out


@lru_cache(maxsize=65_536)
def _direction(feature: str, dim: int, seed: int) -> Vector:
    rng = np.random.default_rng(digest("feature", seed, feature))
    return rng.standard_normal(dim).astype(np.float32)


@lru_cache(maxsize=8192)
def embed(text: str, dim: int, *, seed: int = 0) -> Vector:
    """A unit vector for text; similar texts get nearby vectors. Cached (RAG asks about the
    same passages again and again), so the result is read-only."""
    feats = features(text)
    if feats:
        # Sub-linear term frequency, as in TF-IDF practice, so repeated words do not dominate.
        weights = np.fromiter(
            (1.0 + math.log(w) if w >= 1 else w for w in feats.values()),
            dtype=np.float32,
            count=len(feats),
        )
        vec = weights @ np.stack([_direction(f, dim, seed) for f in feats])
    else:
        vec = np.zeros(dim, dtype=np.float32)
    norm = float(np.linalg.norm(vec))
    if norm == 0.0:
        vec = _direction(f"\x00empty:{text}", dim, seed)
        norm = float(np.linalg.norm(vec))
    out: Vector = (vec / np.float32(norm)).astype(np.float32)
    out.setflags(write=False)
    return out


def relevance(query: str, document: str, *, seed: int = 0, dim: int = 256) -> float:
    """A cross-encoder-like relevance in (0, 1): a logistic of the texts' cosine similarity.

    The logistic's slope and offset are chosen (assumption) so unrelated pairs land near 0.1
    and pairs sharing most content words near 0.9, like a bge-reranker's sigmoid scores.
    """
    cos = float(np.dot(embed(query, dim, seed=seed), embed(document, dim, seed=seed)))
    return 1.0 / (1.0 + math.exp(-(10.0 * cos - 2.2)))


def cosine(a: str, b: str, dim: int, *, seed: int = 0) -> float:
    return float(np.dot(embed(a, dim, seed=seed), embed(b, dim, seed=seed)))
